"""Shedding by InferenceObjective, against a real API server and through real Envoy: the router follows
its pool's InferenceObjectives (the inference extension's own CRD) by list and watch, and while its one
engine has no room, a request whose objective's priority is below 0 is answered 429 by the picker (and
by the proxy: one scheduler), every other request is served. Changing or deleting an objective takes
effect through the watch.

    .venv/bin/python -m e2e.cluster pytest tests/e2e/test_objectives.py
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest
import yaml
from kubernetes import client

from e2e.gateway.extension import crd
from router_runtime.app import run_router
from router_runtime.config import RouterConfig
from router_runtime.discovery.config import DiscoveryConfig
from router_runtime.fleet.config import FleetConfig
from router_runtime.fleet.engine_metrics import ScrapeConfig
from router_runtime.fleet.saturation import SaturationLimits
from router_runtime.gateway.config import PickerConfig
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.health import HealthConfig
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS, eventually, join_all, static_workers
from tests.test_gateway_picker import envoy

pytestmark = pytest.mark.timeout(300)

BS = 4
POOL = "pool"
GROUP, VERSION, PLURAL = "inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives"


def objective(name: str, priority: int, pool: str = POOL) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceObjective",
        "metadata": {"name": name},
        "spec": {"priority": priority, "poolRef": {"name": pool}},
    }


@pytest.fixture(scope="module")
def objectives_crd(cluster):
    """The extension's InferenceObjective CRD, installed once (server-side apply), established."""
    manifest = yaml.safe_load(crd(f"{GROUP}_{PLURAL}.yaml").read_text())
    ext = client.ApiextensionsV1Api(cluster.api)
    ext.patch_custom_resource_definition(
        manifest["metadata"]["name"],
        manifest,
        field_manager="routerfleet-e2e",
        force=True,
        _content_type="application/apply-patch+yaml",
    )
    cluster.wait_for(
        "the InferenceObjective CRD established",
        lambda: (
            ("Established", "True")
            in {
                (c.type, c.status)
                for c in ext.read_custom_resource_definition(f"{PLURAL}.{GROUP}").status.conditions or []
            }
        ),
        60,
    )


async def test_a_sheddable_objective_is_answered_429_while_the_pool_is_saturated(
    cluster, namespace, objectives_crd, tmp_path: Path
):
    custom = client.CustomObjectsApi(cluster.api)
    for name, priority, pool in (("batch", -1, POOL), ("chat", 10, POOL), ("theirs", -1, "other")):
        custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, objective(name, priority, pool)
        )
    async with contextlib.AsyncExitStack() as stack:
        # one engine that runs one request at a time: the rest wait in its queue
        engine = await stack.enter_async_context(
            run_fake_engine(block_size=BS, max_concurrency=1, decode_tokens_per_s=20)
        )
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            workers=static_workers([engine]),
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            discovery=DiscoveryConfig(namespace=namespace, kubeconfig=str(cluster.kubeconfig)),
            gateway=PickerConfig(port=0, pool=POOL, saturation=SaturationLimits(queue_depth=0)),
            fleet=FleetConfig(scrape=ScrapeConfig(interval_s=0.05)),
        )
        router, own = await stack.enter_async_context(run_router(cfg))
        await join_all(router, [engine])
        base = await stack.enter_async_context(envoy(router.epp_address, [engine.http_url], tmp_path))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        assert router.objectives is not None
        await eventually(
            lambda: router.objectives.table == {"batch": -1, "chat": 10}, timeout=30, what="the objectives"
        )

        async def ask(url: str, objective: str | None, max_tokens: int = 1) -> int:
            headers = {"x-gateway-inference-objective": objective} if objective else {}
            body = {"model": "m", "prompt": "hello", "max_tokens": max_tokens}
            async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                if r.status == 429:
                    assert (await r.json())["error"]["code"] == "shed"
                return r.status

        assert await ask(base, "batch") == 200  # room to spare: nothing is shed
        # Fill the engine: one request running, two waiting (more than --epp-saturation-queue-depth 0).
        busy = [asyncio.create_task(ask(base, None, max_tokens=40)) for _ in range(3)]
        limits = cfg.gateway.saturation
        await eventually(
            lambda: router.fleet.saturated(router.targets.candidates(), limits), timeout=10, what="saturated"
        )
        assert await ask(base, "batch") == 429
        assert await ask(own, "batch") == 429  # the proxy's door: the same scheduler
        waiting = [
            asyncio.create_task(ask(base, name)) for name in ("chat", "theirs", "unknown", None)
        ]  # admitted: they wait their turn
        await eventually(lambda: router.load.total == 7, timeout=10, what="the admitted ones dispatched")
        # A change of priority takes effect through the watch.
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "chat", {"spec": {"priority": -5}}
        )
        await eventually(lambda: router.objectives.priority("chat") == -5, timeout=30, what="chat sheddable")
        assert await ask(base, "chat") == 429
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "batch")
        await eventually(lambda: "batch" not in router.objectives.table, timeout=30, what="batch deleted")
        waiting.append(asyncio.create_task(ask(base, "batch")))
        assert await asyncio.gather(*busy, *waiting) == [200] * 8
        assert router.registry.get_sample_value("routerfleet_shed_requests_total") == 3
        assert router.registry.get_sample_value("routerfleet_objectives_synced") == 1
