"""Peer bootstrap end to end over real loopback HTTP and real ZMQ: a warm replica A, a booting replica
B that grafts A's index beneath its live stream, and the ways it must refuse and stay cold."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from router_runtime.bootstrap import sweep
from router_runtime.bootstrap.fetch import FetchBounds, SnapshotFetcher
from router_runtime.bootstrap.http import internal_app
from router_runtime.bootstrap.metrics import BootstrapMetrics
from router_runtime.bootstrap.peers import Peer, PeerRegistry
from router_runtime.bootstrap.producer import SnapshotProducer
from router_runtime.bootstrap.state import Verdict
from router_runtime.bootstrap.sweep import BootstrapConfig, Bootstrapper
from router_runtime.bootstrap.vetting import HashingConfig
from router_runtime.bootstrap.wire import encode
from router_runtime.kv.adoption import CarrierState
from router_runtime.kv.config import KvConfig
from router_runtime.kv.hashing import SCHEME
from router_runtime.kv.plane import KVPlane
from router_runtime.kv.snapshot import Exporter
from router_runtime.kv.subscription import SPLICE_IN_FLIGHT_S, ReplayTimeouts
from router_runtime.kv.withhold import WithholdReason
from router_runtime.worker import WorkerSpec
from routerfleet_fake_engine.cache import PLAIN
from routerfleet_fake_engine.server import FakeEngine, run_fake_engine

from .support import closed_port_url, eventually, snapshot_peer

BS = 4
TOKEN = "fleet-secret"


@dataclass
class Replica:
    name: str
    plane: KVPlane
    boot: Bootstrapper
    url: str
    registry: CollectorRegistry


def spec(e: FakeEngine) -> WorkerSpec:
    return WorkerSpec(
        e.http_url,
        e.http_url,
        kv=e.kv_endpoint(0),
        replay=e.replay_endpoint(0),
        dp_size=e.config.dp_size,
        incarnation=e.incarnation,
    )


@contextlib.asynccontextmanager
async def replica(name, engines, peers, *, block_size=BS, token=TOKEN, peer_token=TOKEN, grace_s=0.0, **cfg):
    registry = CollectorRegistry()
    config = KvConfig(block_size=block_size, replay=ReplayTimeouts(0.3, 2), disconnect_grace_s=grace_s)
    plane = KVPlane(config, registry)
    await plane.start()
    reg = PeerRegistry(self_name=name, self_ip="")
    if peers is not None:
        reg.publish([Peer(u, u) for u in peers])
    hashing = HashingConfig(block_size, SCHEME)
    # origin=False: these tests are about the peer path (young fake engines would rebuild from origin).
    config = BootstrapConfig(
        **{"timeout_s": 10, "probe_interval_s": 0.2, "retry_interval_s": 0.1, "origin": False, **cfg}
    )
    boot = Bootstrapper(
        plane,
        reg,
        SnapshotFetcher(peer_token, FetchBounds(1, 5, 10)),
        hashing,
        BootstrapMetrics(registry),
        config,
    )
    producer = SnapshotProducer(
        plane,
        hashing,
        producer_id=name,
        producer_incarnation=name,
        ready=lambda: boot.settled,
        include=boot.exportable,
    )
    runner = web.AppRunner(internal_app(token, boot, producer))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    boot.start()
    plane.set_workers([spec(e) for e in engines])
    try:
        yield Replica(name, plane, boot, f"http://127.0.0.1:{runner.addresses[0][1]}", registry)
    finally:
        await runner.cleanup()
        await boot.stop()
        await plane.stop()


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 200) for _ in range(BS * 6)] for _ in range(5)]
    return [
        rng.choice(systems) + [rng.randrange(1, 200) for _ in range(BS * rng.randrange(1, 8))]
        for _ in range(n)
    ]


async def connected(r: Replica) -> None:
    await eventually(lambda: all(s.connected for s in r.plane.subscriptions()), what=f"{r.name} subscribed")
    await asyncio.sleep(0.3)  # ZMQ's subscription handshake completes after the TCP connect


def load(engines, batch: list[list[int]], seed: int) -> None:
    rng = random.Random(seed)
    for p in batch:
        rng.choice(engines).admit(0, p, PLAIN)


async def caught_up(r: Replica, engines) -> None:
    def ok():
        applied = r.plane.writer.applied
        return all(applied.get(c) == e.publisher.last_seq(0) for e in engines for c in spec(e).carriers())

    await eventually(ok, timeout=10, what=f"{r.name} applied every published batch")


async def only_the_new_process_credited(r: Replica, engine, old: list[list[int]]) -> None:
    """``engine``'s new process stores new prompts: ``r`` indexes them, and credits none of ``old``."""
    await connected(r)
    new = prompts(7, 5)
    load([engine], new, seed=7)
    await eventually(lambda: all(r.plane.index.match(p) for p in new), what="the new process's blocks")
    assert not any(r.plane.index.match(p) for p in old)


def queries(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    base = prompts(1, 400) + prompts(2, 100)
    out = []
    for _ in range(n):
        p = rng.choice(base)
        cut = rng.randrange(1, len(p) + 1)
        out.append(p[:cut] + [rng.randrange(1, 200) for _ in range(rng.randrange(0, 3 * BS))])
    return out


def same_views(a: Replica, b: Replica, qs: list[list[int]]) -> int:
    hits = 0
    for q in qs:
        ma, mb = a.plane.index.match(q), b.plane.index.match(q)
        assert ma == mb
        hits += bool(ma)
    return hits


async def test_a_booting_replica_grafts_a_warm_sibling_beneath_its_live_stream():
    async with (
        run_fake_engine(block_size=BS, capacity_blocks=600) as e1,
        run_fake_engine(block_size=BS, capacity_blocks=600, dialect="sglang") as e2,
    ):
        engines = [e1, e2]
        async with replica("a", engines, peers=[]) as a:
            await connected(a)
            load(engines, prompts(1, 400), seed=1)
            await caught_up(a, engines)
            assert a.boot.verdict is Verdict.NO_PEERS
            async with replica("b", engines, peers=[a.url]) as b:
                await connected(b)
                load(engines, prompts(2, 50), seed=2)  # live batches arrive while b holds
                await eventually(lambda: b.boot.settled, timeout=10, what="b settled")
                await caught_up(b, engines)
                await caught_up(a, engines)
                fetches = {
                    o: b.registry.get_sample_value(
                        "routerfleet_bootstrap_snapshot_fetches_total", {"outcome": o}
                    )
                    for o in ("accepted", "unreachable", "cold_peer", "rejected")
                }
                assert b.boot.verdict is Verdict.WARM, (b.boot.report(), fetches)
                qs = queries(10_000, seed=3)
                hits = same_views(a, b, qs)
                assert hits > 5_000  # the comparison is not vacuous
                # Spliced under the stream, not substituted for it: new events keep both equal.
                load(engines, prompts(4, 200), seed=4)
                for e in engines:  # and evictions
                    for p in prompts(1, 30):
                        e.emit(0, e.caches[0].remove(p, PLAIN))
                await caught_up(a, engines)
                await caught_up(b, engines)
                same_views(a, b, qs)
                report = b.boot.report()
                assert report["verdict"] == "warm" and report["settled"] and not report["seedFailed"]


async def test_replicas_of_two_versions_seed_each_other_during_a_rollout():
    """A rollout mixes versions: a new replica must graft from an old one (format 1, gzipped, whatever
    it is asked) and an old one, booting on a rollback, must get format 1 from a new one."""
    from router_runtime.bootstrap.wire import CONTENT_TYPE, FORMAT, LEGACY_FORMAT, Limits, decode, inflate

    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        load([e1], prompts(1, 80), seed=1)
        await caught_up(a, [e1])
        auth = {"Authorization": f"Bearer {TOKEN}", "Accept-Encoding": "gzip"}
        got = {}
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            for params in ({}, {"format": "1"}, {"format": "2"}, {"format": "3"}):
                async with http.get(a.url + "/internal/kv_snapshot", params=params, headers=auth) as r:
                    got[params.get("format")] = (r.status, r.content_type, r.headers.get("Content-Encoding"))
                    body = await r.read()
                    if r.status == 200:
                        raw = inflate(body, Limits()) if r.headers.get("Content-Encoding") else body
                        assert decode(raw, Limits()).format == int(params.get("format", LEGACY_FORMAT))
        assert got == {
            None: (200, CONTENT_TYPE[LEGACY_FORMAT], "gzip"),  # what an old consumer gets
            "1": (200, CONTENT_TYPE[LEGACY_FORMAT], "gzip"),
            "2": (200, CONTENT_TYPE[FORMAT], None),  # never gzipped: packed inside
            "3": (400, "application/json", None),
        }
        async with (
            aiohttp.ClientSession(auto_decompress=False) as http,
            http.get(a.url + "/internal/kv_snapshot", headers=auth) as r,
        ):
            legacy = await r.read()

        async def old_producer(_req):  # ignores ``format``, as the previous version does
            return web.Response(
                body=legacy, content_type="application/x-msgpack", headers={"Content-Encoding": "gzip"}
            )

        async with snapshot_peer(old_producer) as url, replica("b", [e1], peers=[url]) as b:
            await eventually(lambda: b.boot.settled, timeout=10, what="b settled")
            assert b.boot.verdict is Verdict.WARM, b.boot.report()
            await caught_up(b, [e1])
            assert same_views(a, b, queries(2_000, seed=3)) > 500


async def test_two_replicas_booting_together_never_seed_from_each_other():
    async with run_fake_engine(block_size=BS) as e1:
        load([e1], prompts(1, 50), seed=1)  # the engine is warm, but no router knows it yet
        async with replica("b", [e1], peers=None) as b, replica("c", [e1], peers=None) as c:
            b.boot.peers.publish([Peer(c.url, c.url)])
            c.boot.peers.publish([Peer(b.url, b.url)])
            await eventually(lambda: b.boot.settled and c.boot.settled, timeout=10, what="both settled")
            assert b.boot.verdict is Verdict.FLEET_COLD and c.boot.verdict is Verdict.FLEET_COLD
            assert b.plane.index.node_count() == 0 and c.plane.index.node_count() == 0


@pytest.mark.parametrize("case", ["wrong_token", "wrong_block_size"])
async def test_a_refused_snapshot_leaves_the_index_untouched_and_the_rank_cold(case):
    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        load([e1], prompts(1, 100), seed=1)
        await caught_up(a, [e1])
        kw = {"peer_token": "wrong"} if case == "wrong_token" else {"block_size": BS * 2}
        async with replica("b", [e1], peers=[a.url], timeout_s=1.5, **kw) as b:
            await eventually(lambda: b.boot.settled, timeout=10, what="b settled")
            assert b.plane.index.node_count() == 0
            assert b.boot.verdict is Verdict.TIMED_OUT and b.boot.seed_failed
            # Another block size: the peer is foreign, and with no store of its own to judge by the
            # replica cannot tell which side is wrong, so it stays a failed seed (never fleet_cold).
            outcome = "rejected" if case == "wrong_token" else "foreign"
            assert (
                b.registry.get_sample_value(
                    "routerfleet_bootstrap_snapshot_fetches_total", {"outcome": outcome}
                )
                > 0
            )
            cause = b.boot.report()["cause"]
            code, text = ("PeerRefused", "HTTP 401") if case == "wrong_token" else ("PeerRefused", "block")
            assert cause["code"] == code and text in cause["message"], cause


async def test_a_replica_whose_own_stream_does_not_fit_says_config_mismatch_without_waiting():
    """The engines' stores refused for this router's block size while it holds: the verdict names the
    mismatch at once, whatever its peers answer, and the rank runs live and empty."""
    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        load([e1], prompts(1, 50), seed=1)
        await caught_up(a, [e1])
        async with replica("b", [e1], peers=[a.url], block_size=BS * 2, timeout_s=30) as b:
            await connected(b)
            load([e1], prompts(2, 20), seed=2)  # live stores, held while b is pending
            await eventually(lambda: b.boot.settled, timeout=10, what="b settled on its own evidence")
            report = b.boot.report()
            assert report["verdict"] == "config_mismatch" and not report["seedFailed"], report
            assert report["ranks"][0]["outcome"] == "config_mismatch"
            assert report["cause"]["code"] == "ConfigMismatch"
            assert f"block size {BS}; this router is configured for {BS * 2}" in report["cause"]["message"]
            assert b.plane.index.node_count() == 0
            ok, why = b.boot.readiness()
            assert ok and "cache-blind" in why and "block size" in why, why
            labels = {"engine": e1.http_url, "rank": "0", "reason": "block_size_mismatch"}
            b.boot.publish_misfits()  # as a scrape does
            assert b.registry.get_sample_value("routerfleet_kv_config_mismatch", labels) == 1


async def test_a_foreign_peer_leaves_a_replica_whose_stream_fits_fleet_cold():
    """The other way round: this replica's stores fit, the peer uses another block size. Nothing to
    inherit (the peer's tree is useless here), so fleet_cold at once instead of a timed-out seed."""
    async with (
        run_fake_engine(block_size=BS) as e1,
        replica("a", [e1], peers=[], block_size=BS * 2) as a,
        replica("b", [e1], peers=[a.url], timeout_s=30) as b,
    ):
        await connected(b)
        await connected(a)
        load([e1], prompts(2, 20), seed=2)
        await eventually(lambda: a.boot.settled, timeout=10, what="a settled")
        await eventually(lambda: b.boot.settled, timeout=10, what="b settled")
        assert b.boot.verdict is Verdict.FLEET_COLD, b.boot.report()
        # a settled no_peers before any store came; its own stream then shows the mismatch.
        await eventually(lambda: a.boot.verdict is Verdict.CONFIG_MISMATCH, what="a's verdict follows")


async def test_a_graft_with_nothing_held_is_proved_by_the_first_live_batch():
    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        load([e1], prompts(1, 100), seed=1)
        await caught_up(a, [e1])
        async with replica("b", [e1], peers=[a.url], probe_interval_s=30) as b:
            await eventually(lambda: b.boot.settled, timeout=10, what="b settled")
            assert b.boot.report()["ranks"][0]["state"] == "recovered"  # grafted, proving
            assert b.boot.verdict is Verdict.WARM
            await connected(b)
            load([e1], prompts(5, 5), seed=5)
            await caught_up(b, [e1])
            await caught_up(a, [e1])
            assert b.boot.report()["ranks"][0]["outcome"] == "warm"
            same_views(a, b, queries(2_000, seed=6))


async def test_a_graft_nobody_can_speak_to_is_kept_unwitnessed():
    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        load([e1], prompts(1, 100), seed=1)
        await caught_up(a, [e1])
        async with replica("b", [e1], peers=[a.url], probe_interval_s=0.05) as b:
            ranks = lambda: b.boot.report()["ranks"]  # noqa: E731
            await eventually(lambda: ranks()[0]["outcome"] == "warm_unwitnessed", timeout=10, what="kept")
            assert b.boot.verdict is Verdict.WARM_UNWITNESSED
            same_views(a, b, queries(2_000, seed=6))


@contextlib.asynccontextmanager
async def bad_peer(mode: str, body: bytes = b""):
    """A peer that stalls before answering, or sends half a body and then stalls or dies."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if mode == "stall":
            await asyncio.sleep(3600)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-msgpack"})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        if mode == "half_then_stall":
            await asyncio.sleep(3600)
        request.transport.close()  # half_then_die
        return resp

    app = web.Application()
    app.router.add_get("/internal/kv_snapshot", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def snapshot_body(a: Replica) -> bytes:
    import aiohttp

    async with (
        aiohttp.ClientSession() as s,
        s.get(a.url + "/internal/kv_snapshot", headers={"Authorization": f"Bearer {TOKEN}"}) as r,
    ):
        return await r.read()


@pytest.mark.parametrize("mode", ["stall", "half_then_stall", "half_then_die"])
async def test_a_peer_that_stalls_or_dies_mid_body_leaves_the_rank_cold(mode):
    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        load([e1], prompts(1, 100), seed=1)
        await caught_up(a, [e1])
        body = await snapshot_body(a)
        async with bad_peer(mode, body) as url, replica("b", [e1], peers=[url], timeout_s=2.5) as b:
            await eventually(lambda: b.boot.settled, timeout=10, what="b settled")
            assert b.boot.verdict is Verdict.TIMED_OUT and b.boot.seed_failed
            assert b.plane.index.node_count() == 0
            # The readiness deadline and the sweep's own cut of the fetch land at about the same time.
            fetches = lambda: b.registry.get_sample_value(  # noqa: E731
                "routerfleet_bootstrap_snapshot_fetches_total", {"outcome": "unreachable"}
            )
            await eventually(lambda: fetches() >= 1, what="the stalled fetch cut and counted")


@pytest.mark.parametrize("event", ["gap", "restart"])
async def test_a_gap_or_restart_while_holding_abandons_the_rank(event):
    async with (
        run_fake_engine(block_size=BS, replay_buffer=2) as e1,
        bad_peer("stall") as url,
        replica("b", [e1], peers=[url], timeout_s=30) as b,
    ):
        await connected(b)
        load([e1], prompts(1, 3), seed=1)  # held
        sub = b.plane.subscriptions()[0]
        await eventually(lambda: sub.hold is not None and len(sub.hold) == 3, what="three batches held")
        if event == "gap":
            e1.publisher.skip(0, 5, keep_in_replay=False)  # lost for good: replay cannot cover it
        else:
            e1.restart()
        load([e1], prompts(7, 1), seed=7)
        await eventually(
            lambda: b.boot.report()["ranks"][0]["outcome"] == "publisher_reset", what="abandoned"
        )
        await caught_up(b, [e1])
        # Nothing from before the doubt survives; only what came after it.
        before = prompts(1, 3)
        assert all(b.plane.index.match(p) == {} for p in before)


async def test_a_breaker_that_closes_while_the_bootstrap_holds_turns_the_rank_cold():
    """The engine's breaker opens and closes while the bootstrap still holds its rank. Re-adoption
    cannot prove the rank beneath a graft still to come, and two owners must not share one hold: the
    rank turns cold at once (the bootstrap abandons it), and the engine shows again, its stream going on."""
    async with (
        run_fake_engine(block_size=BS) as e1,
        bad_peer("stall") as url,
        replica("b", [e1], peers=[url], timeout_s=30, grace_s=600) as b,
    ):
        await connected(b)
        load([e1], prompts(1, 3), seed=1)  # held
        sub = b.plane.subscriptions()[0]
        await eventually(lambda: sub.hold is not None and len(sub.hold) == 3, what="three batches held")
        b.plane.engine_unreachable(e1.http_url)
        b.plane.engine_reachable(e1.http_url)
        await eventually(
            lambda: b.boot.report()["ranks"][0]["outcome"] == "publisher_reset", what="abandoned"
        )
        await eventually(
            lambda: b.plane.carrier_states() == {e1.http_url: CarrierState.OK}, what="shown again"
        )
        after = prompts(7, 1)
        load([e1], after, seed=7)
        await caught_up(b, [e1])
        assert all(b.plane.index.match(p) == {} for p in prompts(1, 3))  # nothing from before the doubt
        assert b.plane.index.match(after[0]) != {}


async def test_a_peer_set_that_only_answers_errors_resolves_in_a_few_sweeps_not_at_the_timeout():
    async def broken(_req):
        return web.Response(status=500, text="boom")

    async with (
        snapshot_peer(broken) as url,
        run_fake_engine(block_size=BS) as e1,
        replica("b", [e1], peers=[url], timeout_s=60) as b,
    ):
        await eventually(lambda: b.boot.settled, timeout=10, what="settled long before the 60 s timeout")
        report = b.boot.report()
        assert report["verdict"] == "timed_out" and report["seedFailed"], report
        assert report["cause"]["code"] == "PeerRefused" and "HTTP 500" in report["cause"]["message"]


async def test_a_graft_whose_cursor_is_beyond_the_stream_turns_cold_at_the_next_batch_not_frozen():
    """A peer's snapshot claiming cursor 2^63-1: every live batch would be dropped as already in the
    graft, freezing the rank while it reports warm. The first batch far below the cursor disproves it."""
    from router_runtime.bootstrap.wire import Limits, decode, encode

    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        load([e1], prompts(1, 30), seed=1)
        await caught_up(a, [e1])
        await eventually(lambda: a.boot.settled, what="a settled")
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with http.get(a.url + "/internal/kv_snapshot", headers=headers) as r:
                assert r.status == 200
                snap = decode(await r.read(), Limits())
        snap.cursors = [(w, (1 << 63) - 1) for w, _seq in snap.cursors]
        forged = encode(snap)

        async def hostile(_req):
            return web.Response(body=forged, content_type="application/x-msgpack")

        async with (
            snapshot_peer(hostile) as url,
            replica("b", [e1], peers=[url], timeout_s=30, max_unknown_probes=1) as b,
        ):
            await eventually(lambda: b.boot.settled, timeout=10, what="b settled on the forged graft")
            load([e1], prompts(2, 5), seed=2)  # live batches, far below the forged cursor
            await eventually(lambda: b.boot.report()["ranks"][0]["outcome"] == "gap", what="cursor disproved")
            await caught_up(b, [e1])  # and the rank runs live again: not frozen


async def test_a_rank_is_doubtful_while_its_bootstrap_holds_and_not_after():
    """The prediction audit labels predictions made while a rank's batches are held: the KV plane's
    ``doubtful`` is that fact."""
    release = asyncio.Event()

    async def slow(_req):
        await release.wait()
        return web.Response(status=500)

    async with (
        snapshot_peer(slow) as url,
        run_fake_engine(block_size=BS) as e1,
        replica("b", [e1], peers=[url], timeout_s=60, max_refused_sweeps=1) as b,
    ):
        await connected(b)
        (carrier,) = spec(e1).carriers()
        assert b.plane.doubtful(carrier) and not b.boot.settled
        release.set()
        await eventually(lambda: b.boot.settled, timeout=10, what="settled")
        assert not b.plane.doubtful(carrier)


async def test_a_withheld_rank_is_not_exported():
    """A rank whose credit a replica withholds (its blocks in doubt) is left out of its snapshot: a
    sibling booting from it starts that rank cold, never crediting what the producer doubts."""
    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        old = prompts(1, 100)
        load([e1], old, seed=1)
        await caught_up(a, [e1])
        (c,) = spec(e1).carriers()
        a.plane.withholds.withhold(c, WithholdReason.FALSE_HIT)  # the audit doubts this rank
        assert not any(a.plane.index.match(p) for p in old)
        async with replica("b", [e1], peers=[a.url], probe_interval_s=0.05, max_unknown_probes=1) as b:
            await eventually(lambda: b.boot.settled, timeout=10, what="b settled")
            assert not any(b.plane.index.match(p) for p in old)


async def test_a_rank_restarted_during_the_walk_is_not_exported_under_its_new_name(monkeypatch):
    """The producer's walk spans writer turns. An engine replaced meanwhile (a new incarnation) must not
    have its old process's blocks and cursor exported under the new process's name: a sibling that knows
    the new one would graft them and skip the new stream up to the old cursor."""
    steps = []
    step = Exporter.step
    monkeypatch.setattr(Exporter, "step", lambda ex, budget=4096: steps.append(budget) or step(ex, budget))
    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        old = prompts(1, 100)
        load([e1], old, seed=1)
        await caught_up(a, [e1])
        await eventually(lambda: a.boot.settled, what="a settled")
        producer = SnapshotProducer(
            a.plane, HashingConfig(BS, SCHEME), producer_id="a", producer_incarnation="a",
            ready=lambda: True, include=a.boot.exportable, chunk=16,
        )  # fmt: skip
        building = asyncio.create_task(producer.get(0))
        async with asyncio.timeout(10):
            while len(steps) < 2:  # the walk under way (each turn, not a poll: it would end meanwhile)
                await asyncio.sleep(0)
        assert not building.done()
        e1.restart()  # the pod replaced under the same name: its new process caches nothing yet
        a.plane.set_workers([spec(e1)])  # ... and discovery sees its new incarnation, mid-walk
        body = encode((await building).snapshot)

        async def answer(_: web.Request) -> web.Response:
            return web.Response(body=body, content_type="application/vnd.routerfleet.kv-snapshot.v2")

        async with (
            snapshot_peer(answer) as url,
            replica("b", [e1], peers=[url], probe_interval_s=0.05, max_unknown_probes=1) as b,
        ):
            await eventually(lambda: b.boot.settled, timeout=10, what="b settled")
            await only_the_new_process_credited(b, e1, old)


async def test_a_graft_vetted_for_an_engine_replaced_meanwhile_is_not_applied(monkeypatch):
    """The engine is replaced under the same id (a new incarnation; readoption off, so its rank is
    removed and added again) while the graft for it is vetted: the graft is for a rank that no longer
    exists, and the new process's rank must not take the old one's blocks and cursor."""
    vetting, release = threading.Event(), threading.Event()
    vet = sweep.vet

    def slow_vet(*args, **kwargs):
        vetted = vet(*args, **kwargs)  # against the old incarnation
        vetting.set()
        release.wait(10)
        return vetted

    monkeypatch.setattr(sweep, "vet", slow_vet)
    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        old = prompts(1, 100)
        load([e1], old, seed=1)
        await caught_up(a, [e1])
        async with replica("b", [e1], peers=[a.url]) as b:
            await eventually(vetting.is_set, timeout=10, what="b vetting a's snapshot")
            e1.restart()  # a new process, caching nothing yet, its sequence from 0
            b.plane.set_workers([spec(e1)])
            release.set()
            await eventually(lambda: b.boot.settled, timeout=10, what="b settled")
            await only_the_new_process_credited(b, e1, old)


async def test_an_engine_restarted_after_a_graft_with_nothing_held_turns_the_rank_cold():
    """A graft with nothing held drops live batches at or below its cursor (already in it). An engine
    restarted under the same identity (a static worker; a container restart keeps the pod's) starts its
    sequence again below that cursor, on a new connection: those batches are another process's, and the
    rank goes cold as a replica following the stream throughout does, never crediting the dead one's."""
    async with run_fake_engine(block_size=BS) as e1, replica("a", [e1], peers=[]) as a:
        await connected(a)
        old = prompts(1, 100)
        load([e1], old, seed=1)
        await caught_up(a, [e1])
        async with replica("b", [e1], peers=[a.url], probe_interval_s=0.05, max_unknown_probes=1) as b:
            outcome = lambda: b.boot.report()["ranks"][0]["outcome"]  # noqa: E731
            await eventually(
                lambda: outcome() == "warm_unwitnessed", timeout=10, what="b grafted, unwitnessed"
            )
            await connected(b)
            await asyncio.sleep(SPLICE_IN_FLIGHT_S)  # nothing of the old process can still be on its way
            e1.restart()
            new = prompts(7, 5)
            load([e1], new, seed=7)
            await caught_up(b, [e1])
            assert all(b.plane.index.match(p) for p in new) and not any(b.plane.index.match(p) for p in old)
            assert outcome() == "gap"


async def test_a_peer_that_refuses_beside_an_unreachable_one_is_asked_ever_less_often():
    """Every peer refusing ends the sweeps after a few; one refusing beside one that cannot be reached
    does not, so its snapshot (up to 1 GiB, fetched and decoded each time) is asked for at doubling
    intervals rather than at every retry."""
    asked = 0

    async def refusing(_req):
        nonlocal asked
        asked += 1
        return web.Response(status=500, text="boom")

    async with (
        snapshot_peer(refusing) as url,
        run_fake_engine(block_size=BS) as e1,
        replica("b", [e1], peers=[url, closed_port_url()], retry_interval_s=0.05) as b,
    ):
        await asyncio.sleep(2.0)  # 40 retries' worth at a steady 0.05 s
        assert not b.boot.settled and 3 <= asked <= 8, asked
