"""Record what the engines accept, from their own source: the fields of the KV events configuration (and
of vLLM's KV transfer configuration) and the names of their command-line options.

    python tests/data/engine_config/record.py --vllm-src DIR --sglang-src DIR

``DIR`` is an unpacked wheel (``pip download --no-deps vllm==0.33.0 sglang==0.5.23``, then unzip; the
directory holding ``vllm/`` or ``sglang/``). The script parses the class that ``--kv-events-config``'s
JSON is loaded into (vLLM's dataclass ``vllm/config/kv_events.py:KVEventsConfig``, SGLang's pydantic
model ``sglang/srt/disaggregation/kv_events.py:KVEventsConfig``) without importing it, and writes
``engines.json`` beside itself: per engine release, each field's annotation and default as
written in the source (vLLM's ``--kv-transfer-config`` class, ``vllm/config/kv_transfer.py:
KVTransferConfig``, as ``transfer_fields``); and the option names of ``vllm serve`` (the fields of
``EngineArgs`` and the frontend's ``FrontendArgs``/``BaseFrontendArgs``) and of SGLang's server (the
fields of the classes in ``sglang/srt/arg_groups/fields/``), as the flags' snake-case names.
``tests/test_samples.py`` holds the sample manifests to it. Not run by the tests or CI (the wheels are
large).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = {
    "vllm-0.33.0": ("vllm", "vllm/config/kv_events.py"),
    "sglang-0.5.23": ("sglang", "sglang/srt/disaggregation/kv_events.py"),
}
# The class --kv-transfer-config's JSON is loaded into (disaggregated prefill's KV connector).
TRANSFER_SOURCES = {"vllm-0.33.0": ("vllm", "vllm/config/kv_transfer.py", "KVTransferConfig")}
OPTIONS = {
    "vllm-0.33.0": [
        ("vllm/engine/arg_utils.py", "EngineArgs"),
        ("vllm/entrypoints/common/cli_args.py", "BaseFrontendArgs"),
        ("vllm/entrypoints/common/cli_args.py", "FrontendArgs"),
    ],
    "sglang-0.5.23": [("sglang/srt/arg_groups/fields/*.py", None)],
}


def fields(path: Path, class_name: str = "KVEventsConfig") -> dict[str, dict[str, str]]:
    """The annotated class attributes of ``class_name`` in ``path``: {name: {annotation, default}}."""
    tree = ast.parse(path.read_text(), str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return _annotated(cls)


def options(root: Path, specs: list[tuple[str, str | None]]) -> list[str]:
    """The annotated attributes of the named classes (or of every class, for None) in the files."""
    names: set[str] = set()
    for pattern, class_name in specs:
        for path in sorted(root.glob(pattern)):
            tree = ast.parse(path.read_text(), str(path))
            for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                if class_name is None or cls.name == class_name:
                    names |= _annotated(cls).keys()
    return sorted(n for n in names if not n.startswith("_"))


def _annotated(cls: ast.ClassDef) -> dict[str, dict[str, str]]:
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            default = ast.unparse(node.value) if node.value is not None else ""
            out[node.target.id] = {"annotation": ast.unparse(node.annotation), "default": default}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-src", type=Path, required=True, help="unpacked vllm wheel (contains vllm/)")
    ap.add_argument("--sglang-src", type=Path, required=True, help="unpacked sglang wheel (contains sglang/)")
    args = ap.parse_args(argv)
    roots = {"vllm": args.vllm_src, "sglang": args.sglang_src}
    record = {
        release: {
            "source": rel,
            "fields": fields(roots[engine] / rel),
            "options": options(roots[engine], OPTIONS[release]),
        }
        for release, (engine, rel) in SOURCES.items()
    }
    for release, (engine, rel, class_name) in TRANSFER_SOURCES.items():
        record[release]["transfer_fields"] = fields(roots[engine] / rel, class_name)
    out = HERE / "engines.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"{out}: "
        + ", ".join(f"{r} {len(v['fields'])} fields, {len(v['options'])} options" for r, v in record.items())
    )


if __name__ == "__main__":
    main()
