"""A request that names a LoRA adapter as its model, as vLLM's OpenAI server takes it, is routed in the
adapter's KV namespace (router_runtime/discovery/served_models.py): the engines list their adapters in
/v1/models. Pure (the page parser), then over real HTTP and ZMQ against fake engines serving one adapter
the way vLLM's --lora-modules does, with the router's own audit as the witness."""

from __future__ import annotations

import pytest

from router_runtime.discovery.served_models import adapters_in
from router_runtime.proxy.config import ProxyConfig
from tests.support import eventually, router_over_fakes

BS = 4
BASE = "routerfleet/fake-model"
PROMPT = list(range(500, 500 + 16 * BS + 1))


def test_the_adapters_are_the_models_with_a_parent():
    page = {
        "object": "list",
        "data": [
            {"id": "base", "parent": None},
            {"id": "sql", "parent": "base", "root": "/adapters/sql"},
            {"id": "self", "parent": "self"},
            {"id": 7, "parent": "base"},
            {"id": "x" * 600, "parent": "base"},
            "junk",
        ],
    }
    assert adapters_in(page["data"]) == frozenset({"sql"})
    assert adapters_in([None, 3, []]) == frozenset()


def audited(router, name: str) -> float:
    return sum(
        s.value
        for m in router.registry.collect()
        for s in m.samples
        if s.name == f"routerfleet_audit_{name}_tokens_total"
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read", [True, False], ids=["served-models-read", "not-read"])
async def test_a_request_naming_an_adapter_as_its_model_is_never_credited_the_base_models_blocks(read):
    """The base model caches a prompt; the same prompt then comes for adapter "sql" by model name. The
    engine computes it afresh (another namespace). Knowing the adapters, the router predicts nothing
    cached and the audit finds no false hit; not knowing them, it credits the base model's blocks."""
    proxy = ProxyConfig(engine_header=True, served_models_interval_s=0.05 if read else 0)
    engine = {"lora_modules": ("sql",), "decode_tokens_per_s": 0}
    async with router_over_fakes(2, BS, engine=engine, proxy=proxy) as (_engines, router, url, s):
        if read:
            await eventually(lambda: router.served_models.adapters == {"sql"}, what="the adapters read")

        async def complete(model: str) -> dict:
            body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        await complete(BASE)
        await eventually(
            lambda: any(m.blocks for m in router.kv.index.match(PROMPT).values()), what="indexed"
        )
        answer = await complete("sql")
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the engine: another namespace
        if read:
            assert audited(router, "false_hit") == 0
            assert audited(router, "predicted") == 0
        else:
            assert audited(router, "predicted") == audited(router, "false_hit") == 16 * BS
