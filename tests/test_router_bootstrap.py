"""The router process with peer bootstrap wired in: two routers over real HTTP and ZMQ, the second
seeded from the first through the authenticated internal port, with readiness held until it settles."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest

from router_runtime.app import run_router
from router_runtime.bootstrap.config import PeerConfig
from router_runtime.config import parse_args
from router_runtime.kv.events import Tier
from routerfleet_fake_engine.cache import PLAIN
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS

from .support import eventually
from .test_bootstrap_component import BS, prompts


def worker_flag(e) -> str:
    return f"url={e.http_url},kv={e.kv_endpoint(0)},replay={e.replay_endpoint(0)}"


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text("s3cret\n")
    return str(p)


def args(e, token_file, *extra):
    config = parse_args(
        [
            "--block-size",
            str(BS),
            "--worker",
            worker_flag(e),
            "--internal-token-file",
            token_file,
            "--health-interval-ms",
            "0",
            *extra,
        ]
    )
    # ephemeral ports (the CLI wants real ones)
    return dataclasses.replace(
        config, port=0, metrics=LOCAL_METRICS, internal=dataclasses.replace(config.internal, port=0)
    )


async def test_a_second_router_is_seeded_through_the_internal_port(token_file):
    async with (
        run_fake_engine(block_size=BS) as e,
        aiohttp.ClientSession() as http,
        run_router(args(e, token_file)) as (a, _a_url),
    ):
        await eventually(lambda: all(s.connected for s in a.kv.subscriptions()), what="a subscribed")
        await asyncio.sleep(0.3)
        for p in prompts(1, 60):
            e.admit(0, p, PLAIN)
        await eventually(
            lambda: (
                a.kv.writer.applied.get(a.kv.index.carriers[0]) == e.publisher.last_seq(0)
                if a.kv.index.carriers
                else False
            ),
            what="a caught up",
        )
        # The internal port answers only with the fleet token.
        async with http.get(a.internal_url + "/internal/bootstrap") as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
        auth = {"Authorization": "Bearer s3cret"}
        async with http.get(a.internal_url + "/internal/bootstrap", headers=auth) as r:
            assert (await r.json())["verdict"] == "no_peers"  # a booted before any event: nothing to inherit
        async with run_router(args(e, token_file, "--kv-peer", a.internal_url, "--no-kv-origin")) as (
            b,
            b_url,
        ):
            await eventually(lambda: b.bootstrap.settled, timeout=10, what="b settled")
            async with http.get(b.internal_url + "/internal/bootstrap", headers=auth) as r:
                report = await r.json()
            assert report["apiVersion"] == "routerfleet.io/bootstrap/v1"
            assert report["verdict"] == "warm" and report["index"]["nodes"] == a.kv.index.node_count()
            async with http.get(b_url + "/readyz") as r:
                assert r.status == 200
            for p in prompts(1, 60):
                assert b.kv.index.match(p) == a.kv.index.match(p) != {}
            # Its gauges count the grafted blocks, though no event batch came after the graft.
            c = b.kv.index.carriers[0]
            gauge = {"engine": c.engine, "rank": str(c.rank), "tier": "device"}
            held = b.kv.index.carrier_blocks(c)[Tier.DEVICE]
            assert held and b.kv.registry.get_sample_value("routerfleet_kv_index_blocks", gauge) == held
            # What the engine evicted before the graft was never seen by b: no session memory older
            # than the graft is vouched for there.
            assert set(b.kv.writer.evicted_at) == set(b.kv.index.carriers)


async def test_readiness_holds_until_bootstrap_settles(token_file):
    async with run_fake_engine(block_size=BS) as e, aiohttp.ClientSession() as http:
        # A peer that is not there: readiness waits for the bootstrap budget, then opens.
        config = args(e, token_file, "--kv-peer", "http://127.0.0.1:1", "--kv-bootstrap-timeout-ms", "1500")
        async with run_router(config) as (b, b_url):
            await eventually(lambda: all(s.connected for s in b.kv.subscriptions()), what="b subscribed")
            async with http.get(b_url + "/readyz") as r:
                body = await r.json()
                assert r.status == 503 and body["reason"].startswith("bootstrap")
            await eventually(lambda: b.bootstrap.settled, timeout=10, what="deadline")
            async with http.get(b_url + "/readyz") as r:
                assert r.status == 200  # seed not required: a timeout opens readiness
            assert b.bootstrap.verdict.value == "timed_out" and b.bootstrap.seed_failed


async def test_engines_without_kv_events_do_not_hold_readiness(token_file):
    """kv_aware over engines that publish no events (an index that stays empty): no rank will ever
    come to bootstrap, so bootstrap settles at once (nothing to inherit) instead of holding forever."""
    async with run_fake_engine(block_size=BS) as e, aiohttp.ClientSession() as http:
        config = parse_args(
            ["--block-size", str(BS), "--worker", f"url={e.http_url}", "--health-interval-ms", "0"]
        )
        peers = PeerConfig(urls=("http://127.0.0.1:1",))
        config = dataclasses.replace(config, port=0, metrics=LOCAL_METRICS, peers=peers)
        async with run_router(config) as (b, b_url):
            async with http.get(b_url + "/readyz") as r:
                assert r.status == 200, await r.text()
            assert b.bootstrap.settled and b.bootstrap.verdict.value == "no_peers"
            assert not b.bootstrap.seed_failed


async def test_seed_required_holds_readiness_for_three_budgets_then_opens(token_file):
    async with run_fake_engine(block_size=BS) as e, aiohttp.ClientSession() as http:
        config = args(
            e,
            token_file,
            "--kv-peer",
            "http://127.0.0.1:1",
            "--kv-bootstrap-timeout-ms",
            "700",
            "--kv-bootstrap-seed-required",
        )
        async with run_router(config) as (b, b_url):
            await eventually(lambda: b.bootstrap.settled, timeout=10, what="deadline")
            async with http.get(b_url + "/readyz") as r:
                assert r.status == 503 and "seed required" in (await r.json())["reason"]
            await eventually(lambda: b.ready()[0], timeout=10, what="the 3x hold to expire")
            async with http.get(b_url + "/readyz") as r:
                assert r.status == 200


def test_a_deadline_armed_at_construction_does_not_settle_before_the_first_engine():
    """The seed's review finding: settled() must not latch on a deadline armed before any rank exists,
    or a fleet with slow engine discovery silently skips bootstrap. And reading it has no effect."""
    from prometheus_client import CollectorRegistry

    from router_runtime.bootstrap.fetch import SnapshotFetcher
    from router_runtime.bootstrap.metrics import BootstrapMetrics
    from router_runtime.bootstrap.peers import PeerRegistry
    from router_runtime.bootstrap.sweep import BootstrapConfig, Bootstrapper
    from router_runtime.bootstrap.vetting import HashingConfig
    from router_runtime.kv.config import KvConfig
    from router_runtime.kv.plane import KVPlane

    now = [0.0]
    reg = CollectorRegistry()
    plane = KVPlane(KvConfig(block_size=BS, disconnect_grace_s=0.0), reg)
    boot = Bootstrapper(
        plane,
        PeerRegistry(),
        SnapshotFetcher("t"),
        HashingConfig(BS, "x"),
        BootstrapMetrics(reg),
        BootstrapConfig(timeout_s=5),
        clock=lambda: now[0],
    )
    now[0] = 1000.0  # long past any deadline counted from construction
    assert not boot.settled and not boot.readiness()[0]
    # Reading settles nothing: the loop's check latches it, exports it, and dates it at the deadline.
    boot.first_rank_at = 990.0
    assert boot.settled and boot.settled_at is None
    assert reg.get_sample_value("routerfleet_bootstrap_settled") == 0
    assert boot.check_settled() and boot.settled_at == 995.0
    assert reg.get_sample_value("routerfleet_bootstrap_settled") == 1


def test_a_replica_leaves_itself_out_of_its_peers_by_name_or_by_address_ipv6_too():
    from router_runtime.bootstrap.peers import Peer, PeerRegistry, peers_of
    from router_runtime.worker import WorkerSpec

    specs = [
        WorkerSpec("ns/rf-a", "http://10.0.0.5:9090"),
        WorkerSpec("ns/rf-b", "http://[fd00::7]:9090"),
        WorkerSpec("ns/rf-c", "http://[fd00::8]:9090"),
    ]
    assert [(p.name, p.ip) for p in peers_of(specs)] == [
        ("rf-a", "10.0.0.5"),
        ("rf-b", "fd00::7"),
        ("rf-c", "fd00::8"),
    ]
    by_name = PeerRegistry(self_name="rf-b")
    by_name.publish(peers_of(specs))
    assert [p.name for p in by_name.peers] == ["rf-a", "rf-c"]
    # Endpoints without a targetRef: POD_IP is the fallback, and an IPv6 one must match too.
    for ip, left in (("fd00::7", 2), ("10.0.0.5", 2), ("fd00::9", 3)):
        registry = PeerRegistry(self_ip=ip)
        registry.publish([Peer("", p.url, p.ip) for p in peers_of(specs)])
        assert len(registry.peers) == left, ip


def test_peer_selector_is_refused_without_kubernetes_discovery(token_file, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--kv-peer-selector", "app=router", "--internal-token-file", token_file])
    assert "--kv-peer-selector" in capsys.readouterr().err
