"""Carrier lifecycle through the plane, against fake engines with a disk tier in a storage directory:
DISCONNECTED on leaving discovery or failing health, re-adoption after a gapless return, device dropped
and disk kept across a restart with the same storage identity, a moved disk and a moved epoch refused,
the adoption cap, grace expiry, and events racing the adoption decision."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import time

import pytest
from prometheus_client import CollectorRegistry

import router_runtime.kv.readoption as readoption_mod
import router_runtime.kv.subscription as sub_mod
from router_runtime.kv.adoption import CarrierState, StorageIdentity
from router_runtime.kv.config import KvConfig
from router_runtime.kv.events import Tier
from router_runtime.kv.hold import HoldEnd
from router_runtime.kv.plane import KVPlane
from router_runtime.kv.readoption import lookup_storage
from router_runtime.kv.subscription import ReplayTimeouts
from router_runtime.worker import Carrier, WorkerSpec
from routerfleet_fake_engine import FakeEngine, FakeEngineConfig
from routerfleet_fake_engine.publisher import Drop
from routerfleet_fake_engine.server import run_fake_engine

from .support import eventually, join_stream

BS = 4
DEV = list(range(1, 9))  # two blocks kept on device
DISK = list(range(50, 58))  # two blocks put on disk


def sample(plane: KVPlane, name: str, **labels) -> float:
    return plane.registry.get_sample_value(name, labels) or 0.0


def blocks(plane: KVPlane, tier: str, engine: str = "e") -> float:
    """What the index-blocks gauge says rank 0 of ``engine`` holds in ``tier``."""
    return sample(plane, "routerfleet_kv_index_blocks", engine=engine, rank="0", tier=tier)


def outcome(plane: KVPlane, o: str) -> float:
    return sample(plane, "routerfleet_kv_adoption_attempts_total", outcome=o)


def tiers(plane: KVPlane, tokens: list[int], engine: str = "e") -> tuple | None:
    m = plane.index.match(tokens).get(Carrier(engine))
    return m.tier_blocks if m else None


@contextlib.asynccontextmanager
async def fake(tmp_path, name="s", **kw):
    cfg = FakeEngineConfig(
        block_size=BS, capacity_blocks=64, storage_dir=str(tmp_path / name), disk_capacity_blocks=64, **kw
    )
    engine = FakeEngine(cfg)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@contextlib.asynccontextmanager
async def plane_for(storage_lookup=None, **kv):
    """A plane whose KvConfig has ``kv`` set (a grace window of 60 s unless given)."""
    kv = {"disconnect_grace_s": 60, **kv}
    config = KvConfig(block_size=BS, replay=ReplayTimeouts(idle_s=0.3, total_s=2), **kv)
    plane = KVPlane(config, CollectorRegistry(), storage_lookup=storage_lookup)
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


def spec(engine: FakeEngine, name: str = "e") -> WorkerSpec:
    return WorkerSpec(
        name,
        engine.http_url,
        kv=engine.kv_endpoint(0),
        replay=engine.replay_endpoint(0),
        incarnation=engine.incarnation,
    )


def in_pod(engine: FakeEngine, name: str = "e") -> WorkerSpec:
    """As Kubernetes discovery sees it: the incarnation is the pod's UID, which a container restart
    keeps."""
    return WorkerSpec(
        name,
        engine.http_url,
        kv=engine.kv_endpoint(0),
        replay=engine.replay_endpoint(0),
        incarnation="pod-uid",
    )


async def join(plane: KVPlane, engine: FakeEngine, name: str = "e") -> None:
    sub = next(s for s in plane.subscriptions() if s.carrier.engine == name)
    await join_stream(engine.publisher, sub)


async def warm(plane: KVPlane, engine: FakeEngine, name: str = "e", *, pod: bool = False) -> None:
    """Subscribe, learn the storage identity, and index DEV on device and DISK on disk. ``pod``: as
    Kubernetes discovery sees the engine (``in_pod``: an incarnation a container restart keeps)."""
    plane.set_workers([*(plane.workers.values()), (in_pod if pod else spec)(engine, name)])
    await join(plane, engine, name)
    engine.emit(0, engine.caches[0].store(DEV))
    engine.emit(0, engine.caches[0].store(DISK, tier=Tier.DISK))
    await eventually(lambda: tiers(plane, DISK, name) == (0, 0, 2, 0), what="disk blocks indexed")
    assert tiers(plane, DEV, name) == (2, 0, 0, 0)
    await eventually(lambda: plane.readoption.record(name).storage is not None, what="storage learned")


async def back(plane: KVPlane, s: WorkerSpec) -> None:
    """The engine returns to discovery as ``s``: wait for its decision and for the writer to apply it."""
    plane.set_workers([s])
    await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided")
    await plane.writer.drain()


def leave(plane: KVPlane, name: str = "e") -> None:
    plane.set_workers([s for s in plane.workers.values() if s.engine != name])


async def test_disconnected_engine_is_invisible_at_once_and_readopted_after_a_gapless_return(tmp_path):
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        # Synchronously hidden: the very next routing decision does not see it; the index keeps it.
        assert tiers(plane, DEV) is None and tiers(plane, DISK) is None
        assert plane.index.carrier_blocks(Carrier("e"))[Tier.DEVICE] == 2
        assert plane.carrier_states() == {"e": CarrierState.DISCONNECTED}
        assert sample(plane, "routerfleet_kv_carriers", state="disconnected") == 1
        # While we are away the engine goes on: the replay buffer covers it.
        engine.emit(0, engine.caches[0].store(list(range(9, 13))))
        engine.emit(0, engine.caches[0].remove(DEV))
        plane.set_workers([spec(engine)])
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="adopted")
        assert outcome(plane, "success") == 1
        await eventually(lambda: tiers(plane, list(range(9, 13))) == (1, 0, 0, 0), what="missed store")
        assert tiers(plane, DEV) is None  # the missed removal applied too
        assert tiers(plane, DISK) == (0, 0, 2, 0)  # every tier re-adopted, nothing replayed for it
        assert sample(plane, "routerfleet_kv_disconnect_window_seconds_count") == 1


async def test_restart_with_the_same_storage_drops_device_and_keeps_disk(tmp_path):
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()  # a new incarnation on the same storage: re-announces nothing
        assert engine.caches[0].disk_hashes() and not engine.caches[0].device_hashes()
        await plane.writer.drain()
        assert blocks(plane, "device") == 2 and blocks(plane, "disk") == 2
        await back(plane, spec(engine))
        assert outcome(plane, "success") == 1
        assert tiers(plane, DEV) is None  # GPU memory is gone
        assert tiers(plane, DISK) == (0, 0, 2, 0)  # the disk survived and is adopted
        # The gauges say so too, though no event batch came after the drop.
        assert blocks(plane, "device") == 0 and blocks(plane, "disk") == 2
        # The new incarnation's stream works on top of it: a disk hit is promoted, by engine hash.
        await join(plane, engine)
        engine.admit(0, DISK, engine.caches[0].chain(DISK)[0].namespace)
        await eventually(lambda: tiers(plane, DISK) == (2, 0, 0, 0), what="promotion applied")


async def test_restart_on_a_fresh_process_reads_the_storage_dir_again(tmp_path):
    """The disk survives the process itself, not only an in-place restart."""
    async with plane_for() as plane:
        async with fake(tmp_path) as engine:
            await warm(plane, engine)
        leave(plane)
        async with fake(tmp_path) as engine2:  # another process, same directory
            assert len(engine2.caches[0].disk_hashes()) == 2
            plane.set_workers([spec(engine2)])
            await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided")
            await plane.writer.drain()
            assert outcome(plane, "success") == 1 and tiers(plane, DISK) == (0, 0, 2, 0)


async def test_a_container_restart_in_the_same_pod_drops_device_and_keeps_disk(tmp_path):
    """Same incarnation, new process: its replay buffer holds nothing at or after our cursor (its
    sequence went back), so it is judged by its storage identity like a new incarnation."""
    async with fake(tmp_path) as engine, plane_for() as plane:
        plane.set_workers([in_pod(engine)])
        await join(plane, engine)
        for _ in range(5):  # the old process had published a few batches more than the new one will
            engine.emit(0, [])
        engine.emit(0, engine.caches[0].store(DEV))
        engine.emit(0, engine.caches[0].store(DISK, tier=Tier.DISK))
        await eventually(lambda: tiers(plane, DISK) == (0, 0, 2, 0), what="disk blocks indexed")
        await eventually(lambda: plane.readoption.record("e").storage is not None, what="storage learned")
        leave(plane)
        engine.restart()  # the container restarts: same pod UID, a new process on the same storage dir
        engine.emit(0, [])  # it has published less than its predecessor by the time we come back
        await back(plane, in_pod(engine))
        assert (outcome(plane, "success"), outcome(plane, "rejected")) == (1, 0)
        assert tiers(plane, DEV) is None  # GPU memory died with the process
        assert tiers(plane, DISK) == (0, 0, 2, 0)  # the disk survived and is adopted
        # The new process's stream flows on top, from its first batch: a disk hit is promoted.
        engine.admit(0, DISK, engine.caches[0].chain(DISK)[0].namespace)
        await eventually(lambda: tiers(plane, DISK) == (2, 0, 0, 0), what="promotion applied")


async def test_a_restarted_process_that_caught_up_with_our_cursor_is_not_taken_for_the_old_one(tmp_path):
    """The new process has published more batches than its predecessor by the time we return: its
    buffer holds our cursor's sequence number, but another batch there (the payload hash differs)."""
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine, pod=True)
        cursor = plane.subscriptions()[0].cursor
        leave(plane)
        engine.restart()
        for i in range(cursor + 5):
            engine.emit(0, engine.caches[0].store([1000 + i] * BS))
        await back(plane, in_pod(engine))
        assert (outcome(plane, "success"), outcome(plane, "rejected")) == (1, 0)
        assert tiers(plane, DEV) is None and tiers(plane, DISK) == (0, 0, 2, 0)
        # Its whole stream from sequence 0 was replayed beneath the decision, in order.
        await eventually(lambda: tiers(plane, [1000] * BS) == (1, 0, 0, 0), what="the new stream")


async def test_a_new_process_whose_stream_cannot_be_followed_from_its_start_is_refused(tmp_path):
    """Its replay buffer no longer reaches sequence 0: what it evicted from its disk before we
    subscribed is unknowable, so its disk is not adopted (cold, never a false hit)."""
    async with fake(tmp_path, replay_buffer=4) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()
        engine.emit(0, engine.caches[0].remove(DISK))  # evicted from disk before we are back ...
        for i in range(6):  # ... and aged out of its replay buffer
            engine.emit(0, engine.caches[0].store([1000 + i] * BS))
        await back(plane, spec(engine))
        assert (outcome(plane, "success"), outcome(plane, "rejected")) == (0, 1)
        assert tiers(plane, DISK) is None


async def test_a_caught_up_restart_is_not_proved_by_a_live_batch_while_the_probe_is_slow(
    tmp_path, monkeypatch
):
    """The new process reached exactly our cursor, keeps publishing, and its replay answers slowly (as
    vLLM's, polled between engine steps): the live batch numbered cursor + 1 arrives first and must
    not pass as continuity; the probe's payload check decides."""
    real = readoption_mod.replay

    async def slow(*a, **kw):
        await asyncio.sleep(0.2)
        return await real(*a, **kw)

    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine, pod=True)
        cursor = plane.subscriptions()[0].cursor
        leave(plane)
        engine.restart()
        for i in range(cursor + 1):
            engine.emit(0, engine.caches[0].store([1000 + i] * BS))
        monkeypatch.setattr(readoption_mod, "replay", slow)
        plane.set_workers([in_pod(engine)])
        while plane.carrier_states() != {"e": CarrierState.OK}:  # a busy engine
            engine.publisher.publish(0, ())
            await asyncio.sleep(0.02)
        await plane.writer.drain()
        assert (outcome(plane, "success"), outcome(plane, "rejected")) == (1, 0)
        assert tiers(plane, DEV) is None  # the dead process's device tier is not shown
        assert tiers(plane, DISK) == (0, 0, 2, 0)


async def test_a_busy_engine_that_only_flapped_is_proved_by_a_slow_probe(tmp_path, monkeypatch):
    """The same process, publishing all along, its buffer past sequence 0, its replay answering late:
    the batches it publishes while the probe is out move our cursor, and the probe must still compare
    the batch at the cursor it asked for with the one we applied there (every tier kept)."""
    real = readoption_mod.replay

    async def slow(*a, **kw):
        await asyncio.sleep(0.1)
        return await real(*a, **kw)

    async with fake(tmp_path, replay_buffer=50) as engine, plane_for() as plane:
        await warm(plane, engine)
        for _ in range(60):
            engine.publisher.publish(0, ())
        await eventually(lambda: plane.subscriptions()[0].cursor >= 60, what="busy")
        leave(plane)  # a readiness flap: the process lives on
        monkeypatch.setattr(readoption_mod, "replay", slow)
        plane.set_workers([spec(engine)])
        while plane.carrier_states() != {"e": CarrierState.OK}:
            engine.publisher.publish(0, ())
            await asyncio.sleep(0.01)
        await plane.writer.drain()
        assert (outcome(plane, "success"), outcome(plane, "rejected")) == (1, 0)
        assert tiers(plane, DEV) == (2, 0, 0, 0) and tiers(plane, DISK) == (0, 0, 2, 0)


async def test_an_idle_rank_is_judged_alone_and_does_not_take_its_proved_sibling_down(tmp_path):
    """dp=2, adopted from a new process: rank 1 has published nothing since (cursor -1), rank 0 is busy
    (its buffer past 0). On a readiness flap rank 0 is proved by its probe and keeps every tier; rank 1
    cannot be, and is judged by the storage identity alone (its disk kept)."""
    async with fake(tmp_path, dp_size=2, replay_buffer=8) as engine, plane_for() as plane:

        def both() -> WorkerSpec:
            return dp2(engine)

        r0, _ = await adopted_with_an_idle_rank(plane, engine)
        engine.emit(0, engine.caches[0].store(DEV))
        for _ in range(20):
            engine.publisher.publish(0, ())
        await eventually(lambda: r0.cursor is not None and r0.cursor >= 20, what="rank 0 busy")
        leave(plane)
        await back(plane, both())
        m = plane.index.match(DEV)
        assert m[Carrier("e", 0)].tier_blocks == (2, 0, 0, 0)  # proved: its device tier kept
        m = plane.index.match(DISK)
        assert m[Carrier("e", 1)].tier_blocks == (0, 0, 2, 0) and m[Carrier("e", 0)].blocks == 2
        assert outcome(plane, "rejected") == 0


async def test_a_failed_decision_resumes_the_rank_cold_and_its_stream_flows(tmp_path, monkeypatch):
    async def broken(*_a, **_kw):
        raise RuntimeError("a bug in the probe")

    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        monkeypatch.setattr(readoption_mod, "replay", broken)
        await back(plane, spec(engine))
        assert tiers(plane, DISK) is None and outcome(plane, "rejected") == 1
        assert sample(plane, "routerfleet_kv_ranks_cleared_total", reason="adoption_failed") == 1
        engine.emit(0, engine.caches[0].store(list(range(9, 13))))
        await eventually(lambda: tiers(plane, list(range(9, 13))) == (1, 0, 0, 0), what="the stream flows")


async def test_a_second_restart_after_an_idle_adoption_is_judged_by_its_storage_again(tmp_path):
    """Adopted from a new process that then published nothing (cursor -1), the engine restarts in
    place again, on a wiped disk: nothing can prove continuity, so the storage epoch decides."""
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine, pod=True)
        leave(plane)
        engine.restart()
        await back(plane, in_pod(engine))
        assert tiers(plane, DISK) == (0, 0, 2, 0) and plane.subscriptions()[0].cursor == -1
        leave(plane)
        engine.wipe_storage()
        engine.restart()
        await back(plane, in_pod(engine))
        assert outcome(plane, "epoch_mismatch") == 1 and outcome(plane, "success") == 1
        assert plane.index.carrier_blocks(Carrier("e"))[Tier.DISK] == 0


async def test_a_new_process_whose_buffer_does_not_answer_is_refused(tmp_path):
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()
        engine.emit(0, engine.caches[0].remove(DISK))  # evicted before we are back; we never hear it
        plane.set_workers([dataclasses.replace(spec(engine), replay="tcp://127.0.0.1:1")])
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, timeout=10, what="decided")
        await plane.writer.drain()
        assert (outcome(plane, "success"), outcome(plane, "rejected")) == (0, 1)
        assert tiers(plane, DISK) is None


async def test_tiers_dropped_on_adoption_count_as_an_eviction(tmp_path):
    """Session affinity must not vouch for a remembered engine whose device tier died with it."""
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        evicted = plane.writer.evicted_at
        leave(plane)
        before = time.monotonic()
        assert evicted[Carrier("e")] < before  # its first batch, when we began to watch it
        engine.restart()
        await back(plane, spec(engine))
        assert outcome(plane, "success") == 1 and evicted[Carrier("e")] >= before


async def test_a_container_restart_on_wiped_storage_is_refused(tmp_path):
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine, pod=True)
        leave(plane)
        engine.wipe_storage()
        engine.restart()
        await back(plane, in_pod(engine))
        assert outcome(plane, "epoch_mismatch") == 1 and outcome(plane, "success") == 0
        assert plane.index.carrier_blocks(Carrier("e"))[Tier.DISK] == 0


async def test_a_moved_disk_is_refused(tmp_path):
    async with fake(tmp_path, "s1") as e1, fake(tmp_path, "s2") as e2, plane_for() as plane:
        await warm(plane, e1, "e1")
        await warm(plane, e2, "e2")
        leave(plane, "e2")
        await e2.stop()
        shutil.rmtree(tmp_path / "s2")
        shutil.copytree(tmp_path / "s1", tmp_path / "s2")  # e1's disk shows up under e2
        async with fake(tmp_path, "s2") as moved:
            plane.set_workers([plane.workers["e1"], spec(moved, "e2")])
            await eventually(lambda: plane.carrier_states()["e2"] is CarrierState.OK, what="decided")
            await plane.writer.drain()
            assert outcome(plane, "identity_mismatch") == 1 and outcome(plane, "success") == 0
            assert tiers(plane, DISK, "e2") is None  # nothing of e2 adopted
            assert plane.index.carrier_blocks(Carrier("e2")) == dict.fromkeys(
                (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.EXTERNAL), 0
            )
            assert tiers(plane, DISK, "e1") == (0, 0, 2, 0)  # the rightful owner is untouched


async def test_an_epoch_mismatch_is_refused(tmp_path):
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        engine.wipe_storage()  # the disk content is invalidated: epoch 0 -> 1
        engine.emit(0, engine.caches[0].store(DISK, tier=Tier.DISK))  # same content again, new epoch
        engine.restart()
        await back(plane, spec(engine))
        assert outcome(plane, "epoch_mismatch") == 1
        assert tiers(plane, DISK) is None and plane.index.carrier_blocks(Carrier("e"))[Tier.DISK] == 0


async def test_the_adoption_cap_stops_a_crash_loop(tmp_path):
    async with fake(tmp_path) as engine, plane_for(adoption_cap=1) as plane:
        await warm(plane, engine)
        for _ in range(2):
            leave(plane)
            engine.restart()
            plane.set_workers([spec(engine)])
            await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided")
            await plane.writer.drain()
            await eventually(lambda: plane.readoption.record("e").storage is not None, what="storage")
        assert (outcome(plane, "success"), outcome(plane, "rejected")) == (1, 1)
        assert tiers(plane, DISK) is None  # the second cycle was refused: dropped, cold


async def test_grace_expiry_removes_the_carriers(tmp_path):
    async with fake(tmp_path) as engine, plane_for(disconnect_grace_s=0.2) as plane:
        await warm(plane, engine)
        leave(plane)
        assert Carrier("e") in plane.index.carriers
        await eventually(lambda: Carrier("e") not in plane.index.carriers, what="REMOVED")
        assert sample(plane, "routerfleet_kv_grace_expirations_total") == 1
        assert Carrier("e") in plane.writer.evicted_at  # kept: it may come back under this identity, cold
        assert plane.carrier_states() == {}
        # It comes back later: a fresh engine, nothing adopted, nothing counted.
        engine.restart()
        plane.set_workers([spec(engine)])
        await plane.writer.drain()
        assert tiers(plane, DISK) is None and outcome(plane, "success") == 0


async def test_health_failure_hides_and_recovery_shows(tmp_path):
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        plane.engine_unreachable("e")
        assert tiers(plane, DEV) is None
        export_ok = plane.index.visible_tiers(Carrier("e")) == 0
        assert export_ok
        engine.emit(0, engine.caches[0].store(list(range(9, 13))))  # the stream keeps being tracked
        await eventually(
            lambda: plane.index.carrier_blocks(Carrier("e"))[Tier.DEVICE] == 3, what="hidden apply"
        )
        assert tiers(plane, list(range(9, 13))) is None
        plane.engine_reachable("e")  # its ranks are proved by their probes before they show
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="proved")
        await plane.writer.drain()
        assert tiers(plane, list(range(9, 13))) == (1, 0, 0, 0) and tiers(plane, DISK) == (0, 0, 2, 0)


async def test_events_racing_the_adoption_are_held_and_applied_after_it(tmp_path):
    gate = asyncio.Event()

    async def slow_lookup(s: WorkerSpec):
        rec = plane.readoption.record("e")
        if rec is not None and rec.state is CarrierState.DISCONNECTED:
            await gate.wait()
        return await lookup_storage(s)

    async with fake(tmp_path) as engine, plane_for(storage_lookup=slow_lookup) as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()
        plane.set_workers([spec(engine)])
        await join(plane, engine)  # batches arrive while the decision waits on the storage proof
        # The new incarnation promotes the disk blocks: GPU store, then STORAGE removals. Applied
        # before the decision, the device drop would erase them; held, they land on top of it.
        engine.admit(0, DISK, engine.caches[0].chain(DISK)[0].namespace)
        sub = plane.subscriptions()[0]
        await eventually(lambda: sub.hold is not None and len(sub.hold) >= 2, what="batches held")
        assert tiers(plane, DISK) is None  # still DISCONNECTED: nothing half-adopted is visible
        assert plane.index.carrier_blocks(Carrier("e"))[Tier.DEVICE] == 2  # the old device tier
        gate.set()
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided")
        await plane.writer.drain()
        assert outcome(plane, "success") == 1
        assert tiers(plane, DISK) == (2, 0, 0, 0)  # decision first, then the held batches, in order
        assert tiers(plane, DEV) is None


async def test_every_rank_is_decided_in_one_step_and_a_second_departure_mid_decision_is_cold(tmp_path):
    gate = asyncio.Event()

    async def gated(s: WorkerSpec):
        rec = plane.readoption.record("e")
        if rec is not None and rec.state is CarrierState.DISCONNECTED:
            await gate.wait()
        return await lookup_storage(s)

    async with fake(tmp_path, dp_size=2) as engine, plane_for(storage_lookup=gated) as plane:
        plane.set_workers(
            [
                WorkerSpec(
                    "e",
                    engine.http_url,
                    kv=engine.kv_endpoint(0),
                    replay=engine.replay_endpoint(0),
                    dp_size=2,
                    incarnation=engine.incarnation,
                )
            ]
        )
        for sub in plane.subscriptions():
            await join_stream(engine.publisher, sub, sub.carrier.rank)
        for r in (0, 1):
            engine.emit(r, engine.caches[r].store(DISK, tier=Tier.DISK))
        await eventually(lambda: len(plane.index.match(DISK)) == 2, what="both ranks indexed")
        await eventually(lambda: plane.readoption.record("e").storage is not None, what="storage")

        def both():
            return WorkerSpec(
                "e",
                engine.http_url,
                kv=engine.kv_endpoint(0),
                replay=engine.replay_endpoint(0),
                dp_size=2,
                incarnation=engine.incarnation,
            )

        leave(plane)
        engine.restart()
        plane.set_workers([both()])
        assert plane.index.match(DISK) == {}
        leave(plane)  # gone again before the decision: nothing is decided, nothing shows
        gate.set()
        await asyncio.sleep(0.05)
        assert plane.index.match(DISK) == {} and outcome(plane, "success") == 0
        await back(plane, both())
        assert {c.rank: m.tier_blocks for c, m in plane.index.match(DISK).items()} == {
            0: (0, 0, 2, 0),
            1: (0, 0, 2, 0),
        }
        assert outcome(plane, "success") == 1


async def test_storage_identity_sources_in_order(tmp_path):
    """The engine's /server_info first; the identity discovery found (a pod annotation) when the engine
    reports none or cannot be asked; else none."""
    annotated = dict(storage_id="pv-7", storage_epoch=3)
    async with fake(tmp_path) as engine:
        own = await lookup_storage(spec(engine))
        assert own is not None and own.storage_id != "pv-7"
        assert await lookup_storage(dataclasses.replace(spec(engine), **annotated)) == own
    async with run_fake_engine(block_size=BS) as plain:  # no storage dir: reports no identity
        s = WorkerSpec("e", plain.http_url)
        assert await lookup_storage(s) is None
        assert await lookup_storage(dataclasses.replace(s, **annotated)) == StorageIdentity("pv-7", 3)
    gone = WorkerSpec("e", "http://127.0.0.1:1", **annotated)
    assert await lookup_storage(gone) == StorageIdentity("pv-7", 3)


# ---- races between a return's decision, its stream and the writer (third review) ---------------


async def pause_writer(plane):
    plane._writer_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await plane._writer_task


def resume_writer(plane):
    plane._writer_task = asyncio.create_task(plane.writer.run())


async def test_a_show_queued_before_a_second_departure_does_not_undo_its_hide(tmp_path):
    """A decision's show waits behind a busy writer and the engine leaves again before it runs: the
    departure's hide is queued too, so the engine stays hidden; back as a new process on a wiped disk,
    none of its old blocks shows during the decision."""
    gate = asyncio.Event()

    async def gated(s):
        rec = plane.readoption.record("e")
        if rec is not None and rec.state is CarrierState.DISCONNECTED and gate_on[0]:
            await gate.wait()
        return await lookup_storage(s)

    gate_on = [False]
    async with fake(tmp_path) as engine, plane_for(storage_lookup=gated) as plane:
        await warm(plane, engine)
        leave(plane)
        await pause_writer(plane)  # a deep writer queue
        plane.set_workers([spec(engine)])  # same process, flapped
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided")
        leave(plane)  # gone again before the writer ran the show
        assert plane.index.visible_tiers(Carrier("e")) == 0
        resume_writer(plane)
        await plane.writer.drain()
        vis = plane.index.visible_tiers(Carrier("e"))
        state = plane.carrier_states()
        assert state == {"e": CarrierState.DISCONNECTED}
        # now it comes back as a new process whose disk was wiped
        engine.wipe_storage()
        engine.restart()
        gate_on[0] = True
        plane.set_workers([spec(engine)])
        await asyncio.sleep(0.1)
        during = (tiers(plane, DEV), tiers(plane, DISK))
        gate.set()
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided 2")
        await plane.writer.drain()
        assert vis == 0, "DISCONNECTED carrier visible after a stale queued show"
        assert during == (None, None), "blocks the engine does not hold are visible during the decision"


async def test_one_return_is_one_attempt_and_a_decision_of_no_rank_counts_nothing(tmp_path, monkeypatch):
    """dp=2, rank 1 idle (cursor -1) and its hold overflowing while its storage is checked: the return
    counts one attempt (its worst rank's outcome), and a check that decides no rank counts nothing."""
    gate = asyncio.Event()
    real = readoption_mod.replay
    gating = [False]

    async def gated_lookup(s):
        if gating[0]:
            await gate.wait()
        return await lookup_storage(s)

    async def gated_replay(ctx, endpoint, start, *a, **kw):
        if gating[0] and endpoint == engine.replay_endpoint(0):
            await gate.wait()
        return await real(ctx, endpoint, start, *a, **kw)

    async with (
        fake(tmp_path, dp_size=2, replay_buffer=8) as engine,
        plane_for(storage_lookup=gated_lookup) as plane,
    ):

        def both() -> WorkerSpec:
            return dp2(engine)

        r0, _ = await adopted_with_an_idle_rank(plane, engine)
        while r0.cursor is None or r0.cursor < 20:
            engine.publisher.publish(0, ())
            await asyncio.sleep(0.01)
        leave(plane)
        s0, r0_ = outcome(plane, "success"), outcome(plane, "rejected")
        monkeypatch.setattr(readoption_mod, "replay", gated_replay)
        gating[0] = True
        plane.set_workers([both()])
        await asyncio.sleep(0.05)
        sub1 = next(s for s in plane.subscriptions() if s.carrier.rank == 1)
        assert Carrier("e", 1) in plane.readoption.phases() and sub1.hold is not None
        sub1.hold.end(HoldEnd.OVERFLOW)  # as a hold that overflowed
        assert Carrier("e", 1) not in plane.readoption.phases()
        gate.set()
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided")
        await plane.writer.drain()
        ds, dr = outcome(plane, "success") - s0, outcome(plane, "rejected") - r0_
        assert (ds, dr) == (0, 1)  # one return, one attempt: its worst rank's outcome


async def test_a_catch_up_answered_by_a_process_that_then_died_is_not_spliced(tmp_path, monkeypatch):
    """A new incarnation (p2) answers the catch-up replay from 0 and dies; its successor (p3, same
    ports) reaches the live loop from its sequence 0 before the answer is used. The answer does not
    continue p3's stream (another batch at the cursor): refused, and none of p2's blocks shows."""
    real = readoption_mod.replay
    sub_box = []

    async def racing(ctx, endpoint, start, *a, **kw):
        result = await real(ctx, endpoint, start, *a, **kw)
        if start == 0 and not sub_box:
            sub = plane.subscriptions()[0]
            sub_box.append(sub)
            engine.restart()  # p2 dies after answering; p3 on the same ports
            deadline = time.monotonic() + 5
            while (sub.cursor is None or sub.cursor < 0) and time.monotonic() < deadline:
                engine.publisher.publish(0, ())
                await asyncio.sleep(0.01)
            sub_box.append(sub.cursor)  # checked by the test (an assert here would only fail the task)
        return result

    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()  # p2
        for i in range(10):
            engine.emit(0, engine.caches[0].store([2000 + i] * BS))
        monkeypatch.setattr(readoption_mod, "replay", racing)
        await back(plane, spec(engine))
        assert 0 <= sub_box[1] <= 9  # the live loop held p3's batches where the answer has p2's
        shown = [i for i in range(10) if tiers(plane, [2000 + i] * BS) is not None]
        assert not engine.caches[0].device_hashes()
        assert shown == [], "a dead process's device blocks are routed to"
        assert outcome(plane, "rejected") == 1  # the answer does not continue p3's stream


async def test_a_breaker_opening_during_a_return_keeps_the_engine_hidden(tmp_path):
    gate = asyncio.Event()
    on = [False]

    async def gated(s):
        if on[0]:
            await gate.wait()
        return await lookup_storage(s)

    async with fake(tmp_path) as engine, plane_for(storage_lookup=gated) as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()
        on[0] = True
        plane.set_workers([spec(engine)])
        await asyncio.sleep(0.05)
        plane.engine_unreachable("e")  # breaker opens mid-decision
        assert not plane.readoption.busy("e") and not plane.readoption.phases()  # the decision is stopped
        gate.set()
        await plane.writer.drain()
        assert plane.carrier_states() == {"e": CarrierState.DISCONNECTED}
        assert plane.index.visible_tiers(Carrier("e")) == 0  # hidden while its breaker is open
        plane.engine_reachable("e")  # its ranks are proved by their probes before they show
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="proved")
        await plane.writer.drain()
        assert plane.carrier_states() == {"e": CarrierState.OK} and tiers(plane, DISK) is None  # cold
        assert (outcome(plane, "success"), outcome(plane, "rejected")) == (0, 1)


async def test_gapless_returns_of_a_live_process_do_not_fill_the_adoption_cap(tmp_path):
    """The cap stops crash loops: gapless returns of a live dp=3 process are not counted against it
    (per-rank counting once filled the default cap of 3 in one flap and rejected the next)."""
    async with fake(tmp_path, dp_size=3, replay_buffer=4) as engine, plane_for() as plane:

        def three():
            return dataclasses.replace(spec(engine), dp_size=3)

        plane.set_workers([three()])
        for sub in plane.subscriptions():
            await join_stream(engine.publisher, sub, sub.carrier.rank)
        for r in range(3):
            engine.emit(r, engine.caches[r].store(DISK, tier=Tier.DISK))
        await eventually(lambda: len(plane.index.match(DISK)) == 3, what="indexed")
        await eventually(lambda: plane.readoption.record("e").storage is not None, what="storage")
        for r in range(3):
            for _ in range(8):
                engine.publisher.publish(r, ())
        await eventually(lambda: all(s.cursor >= 8 for s in plane.subscriptions()), what="busy")
        leave(plane)
        await back(plane, three())
        assert len(plane.index.match(DISK)) == 3
        leave(plane)
        await back(plane, three())
        assert len(plane.index.match(DISK)) == 3, "second flap of the same live process rejected by the cap"


async def test_a_rank_is_shown_only_after_its_held_batches_apply(tmp_path):
    """The new process evicted disk blocks before we subscribed; its catch-up batches are held. A
    reader polling throughout never sees those blocks: drop, held batches, then show."""
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()
        for i in range(150):
            engine.emit(0, engine.caches[0].store([3000 + i] * BS))
        engine.emit(0, engine.caches[0].remove(DISK))  # evicted from disk before we are back
        seen = []
        done = asyncio.Event()

        async def reader():
            while not done.is_set():
                if plane.carrier_states() == {"e": CarrierState.OK} and tiers(plane, DISK) is not None:
                    seen.append(tiers(plane, DISK))
                await asyncio.sleep(0)

        t = asyncio.create_task(reader())
        await back(plane, spec(engine))
        done.set()
        await t
        assert seen == [], "evicted disk blocks visible while the held batches were being applied"


def probe_waits(monkeypatch, engine: FakeEngine, until) -> None:
    """Rank 0's probe (a replay from its cursor, not from 0) answers only after ``await until()``:
    a busy engine serves its replay socket late."""
    real = readoption_mod.replay

    async def late(ctx, endpoint, start, *a, **kw):
        if endpoint == engine.replay_endpoint(0) and start != 0:
            await until()
        return await real(ctx, endpoint, start, *a, **kw)

    monkeypatch.setattr(readoption_mod, "replay", late)


def dp2(engine: FakeEngine) -> WorkerSpec:
    return dataclasses.replace(in_pod(engine), dp_size=2)


async def adopted_with_an_idle_rank(plane: KVPlane, engine: FakeEngine) -> tuple:
    """dp=2 in a pod, both ranks with DISK on disk; the container restarts and the engine is adopted
    as a new process; rank 1 publishes nothing since (cursor -1), rank 0 is busy again."""
    plane.set_workers([dp2(engine)])
    for sub in plane.subscriptions():
        await join_stream(engine.publisher, sub, sub.carrier.rank)
    for r in (0, 1):
        engine.emit(r, engine.caches[r].store(DISK, tier=Tier.DISK))
    await eventually(lambda: len(plane.index.match(DISK)) == 2, what="both ranks indexed")
    await eventually(lambda: plane.readoption.record("e").storage is not None, what="storage")
    leave(plane)
    engine.restart()
    await back(plane, dp2(engine))
    r0, r1 = sorted(plane.subscriptions(), key=lambda s: s.carrier.rank)
    assert r1.cursor == -1
    deadline = time.monotonic() + 5
    while r0.cursor is None or r0.cursor < 7:  # ZMQ may drop the first ones (slow joiner): go on
        assert time.monotonic() < deadline, "rank 0's stream never reached the subscription"
        engine.publisher.publish(0, ())
        await asyncio.sleep(0.01)
    return r0, r1


async def test_an_idle_rank_of_a_live_process_does_not_fill_the_adoption_cap(tmp_path):
    async with fake(tmp_path, dp_size=2, replay_buffer=8) as engine, plane_for() as plane:
        await adopted_with_an_idle_rank(plane, engine)
        cap_uses = plane.readoption.cap_uses("e")
        for _ in range(4):  # readiness flaps of the same live process
            leave(plane)
            await back(plane, dp2(engine))
            assert len(plane.index.match(DISK)) == 2
        assert plane.readoption.cap_uses("e") == cap_uses
        assert outcome(plane, "rejected") == 0


async def test_an_identity_that_cannot_be_learned_is_not_replaced_by_the_old_one(tmp_path):
    """A new process whose identity cannot be learned gets nothing adopted, and what it then keeps on
    disk was kept under no proven identity: a later process proving the old one adopts none of it."""
    s1 = StorageIdentity("s1", 0)
    current: list = [s1]

    async def lookup(_s: WorkerSpec):
        return current[0]

    fresh = list(range(80, 88))
    async with fake(tmp_path) as engine, plane_for(storage_lookup=lookup) as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()
        current[0] = None
        await back(plane, spec(engine))
        assert tiers(plane, DISK) is None and plane.readoption.record("e").storage is None
        await join(plane, engine)
        engine.emit(0, engine.caches[0].store(fresh, tier=Tier.DISK))
        await eventually(lambda: tiers(plane, fresh) == (0, 0, 2, 0), what="blocks under no identity")
        leave(plane)
        engine.restart()
        current[0] = s1
        await back(plane, spec(engine))
        assert tiers(plane, fresh) is None


async def test_an_identity_change_seen_by_an_idle_rank_is_judged_for_the_whole_engine(tmp_path, monkeypatch):
    """The container restarts on another disk (s2) while rank 0's probe answers late: rank 1's check
    sees s2 and the engine is judged as a new process at once (nothing adopted); the blocks it then
    stores under s2 are not adopted when a later process proves s1."""
    s1, s2 = StorageIdentity("s1", 0), StorageIdentity("s2", 0)
    current: list = [s1]

    async def lookup(_s: WorkerSpec):
        return current[0]

    gate = asyncio.Event()
    later = list(range(90, 98))
    async with (
        fake(tmp_path, dp_size=2, replay_buffer=8) as engine,
        plane_for(storage_lookup=lookup) as plane,
    ):
        await adopted_with_an_idle_rank(plane, engine)
        leave(plane)
        engine.restart()
        current[0] = s2
        probe_waits(monkeypatch, engine, gate.wait)
        await back(plane, dp2(engine))  # decided without rank 0's probe: rank 1's check escalated
        assert outcome(plane, "identity_mismatch") == 1 and plane.readoption.record("e").storage == s2
        assert plane.index.match(DISK) == {}
        gate.set()
        sub1 = next(s for s in plane.subscriptions() if s.carrier.rank == 1)
        await join_stream(engine.publisher, sub1, 1)
        engine.emit(1, engine.caches[1].store(later, tier=Tier.DISK))
        await eventually(lambda: len(plane.index.match(later)) == 1, what="blocks under s2")
        leave(plane)
        engine.restart()
        current[0] = s1
        await back(plane, dp2(engine))
        assert plane.index.match(later) == {}


# ---- fifth review ---------------------------------------------------------------------------


def rank_tiers(plane, tokens):
    return {c.rank: m.tier_blocks for c, m in plane.index.match(tokens).items()}


async def test_a_catch_up_must_contain_what_the_live_loop_held_before(tmp_path, monkeypatch):
    """Idle rank 1 returns; while its storage is checked the live loop holds the old process's device
    store; that process dies and its successor (same disk) answers the catch-up with nothing: the
    answer does not contain what was held, so the held device blocks are never shown."""
    gate_lookup, gate_probe = asyncio.Event(), asyncio.Event()
    on = [False]

    async def lookup(s):
        if on[0]:
            await gate_lookup.wait()
        return await lookup_storage(s)

    async with (
        fake(tmp_path, dp_size=2, replay_buffer=8) as engine,
        plane_for(storage_lookup=lookup) as plane,
    ):
        await adopted_with_an_idle_rank(plane, engine)
        leave(plane)
        on[0] = True
        probe_waits(monkeypatch, engine, gate_probe.wait)
        plane.set_workers([dp2(engine)])
        sub1 = next(s for s in plane.subscriptions() if s.carrier.rank == 1)
        await join_stream(engine.publisher, sub1, 1)  # P's live batches, held
        engine.emit(1, engine.caches[1].store(DEV))  # P stores DEV on device (held)
        await eventually(lambda: sub1.cursor is not None and sub1.cursor >= 1, what="held")
        engine.restart()  # P dies; P' on the same disk, publishes nothing yet
        assert not engine.caches[1].device_hashes()
        gate_lookup.set()
        await eventually(lambda: Carrier("e", 1) not in plane.readoption.phases(), what="rank 1 decided")
        gate_probe.set()
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="settled")
        await plane.writer.drain()
        assert 1 not in rank_tiers(plane, DEV), "a dead process's device blocks are routed to"


async def test_an_idle_rank_without_identity_goes_cold_alone(tmp_path, monkeypatch):
    """No storage identity: an idle rank's check has nothing to judge by and goes cold alone; the live
    rank 0, proved continuous by its (late) probe, keeps its device tier."""

    async def none(_s):
        return None

    async with fake(tmp_path, dp_size=2, replay_buffer=8) as engine, plane_for(storage_lookup=none) as plane:
        plane.set_workers([dp2(engine)])
        for sub in plane.subscriptions():
            await join_stream(engine.publisher, sub, sub.carrier.rank)
        leave(plane)
        engine.restart()
        await back(plane, dp2(engine))
        r0, r1 = sorted(plane.subscriptions(), key=lambda s: s.carrier.rank)
        assert r1.cursor == -1
        await join_stream(engine.publisher, r0, 0)
        engine.emit(0, engine.caches[0].store(DEV))
        await eventually(lambda: rank_tiers(plane, DEV) == {0: (2, 0, 0, 0)}, what="rank 0 device")
        for _ in range(12):  # rank 0 busy: its buffer no longer reaches 0
            engine.publisher.publish(0, ())
        await eventually(lambda: r0.cursor >= 12, what="busy")
        leave(plane)  # readiness flap, same live process
        probe_waits(monkeypatch, engine, lambda: asyncio.sleep(0.2))
        await back(plane, dp2(engine))
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="x")
        await plane.writer.drain()
        assert engine.caches[0].device_hashes()
        assert rank_tiers(plane, DEV) == {0: (2, 0, 0, 0)}, "a live continuous rank's device tier dropped"


@pytest.mark.parametrize("stop", ["breaker", "hold_lost"])
async def test_a_new_process_never_judged_leaves_no_identity(tmp_path, stop):
    """A new incarnation on other storage (s2) never gets its decision: its breaker opens first, or its
    only rank's hold ends. It comes back cold and no identity was proved, so what it stores is not
    adopted by a later process proving the old one (s1)."""
    s1, s2 = StorageIdentity("s1", 0), StorageIdentity("s2", 0)
    cur = [s1]
    gate = asyncio.Event()
    on = [False]

    async def lookup(_s):
        if on[0]:
            await gate.wait()
        return cur[0]

    fresh = list(range(80, 88))
    async with fake(tmp_path) as engine, plane_for(storage_lookup=lookup) as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()
        cur[0] = s2
        on[0] = True
        plane.set_workers([spec(engine)])
        await asyncio.sleep(0.05)
        if stop == "breaker":
            plane.engine_unreachable("e")
            on[0] = False
            gate.set()
            plane.engine_reachable("e")  # its ranks are proved by their probes before they show
        else:
            plane.subscriptions()[0].hold.end(HoldEnd.OVERFLOW)
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="back, cold")
        on[0] = False
        gate.set()
        await plane.writer.drain()
        await join(plane, engine)
        engine.emit(0, engine.caches[0].store(fresh, tier=Tier.DISK))
        await eventually(lambda: tiers(plane, fresh) == (0, 0, 2, 0), what="stored under s2")
        leave(plane)
        engine.restart()
        cur[0] = s1
        await back(plane, spec(engine))
        assert tiers(plane, fresh) is None, "blocks stored on s2 adopted under s1"


async def test_one_failed_lookup_on_an_idle_rank_does_not_take_the_engine_down(tmp_path, monkeypatch):
    """One failed storage lookup for an idle rank makes that rank cold, not the engine: the live rank
    0 keeps its device tier."""
    fail = [False]

    async def lookup(s):
        if fail[0]:
            fail[0] = False
            raise TimeoutError("busy engine")
        return await lookup_storage(s)

    async with (
        fake(tmp_path, dp_size=2, replay_buffer=8) as engine,
        plane_for(storage_lookup=lookup) as plane,
    ):
        r0, _ = await adopted_with_an_idle_rank(plane, engine)
        engine.emit(0, engine.caches[0].store(DEV))
        for _ in range(10):
            engine.publisher.publish(0, ())
        await eventually(lambda: rank_tiers(plane, DEV) == {0: (2, 0, 0, 0)} and r0.cursor >= 18, what="busy")
        leave(plane)
        fail[0] = True
        probe_waits(monkeypatch, engine, lambda: asyncio.sleep(0.2))
        await back(plane, dp2(engine))
        assert engine.caches[0].device_hashes() and engine.caches[1].disk_hashes()
        assert rank_tiers(plane, DEV) == {0: (2, 0, 0, 0)}, "live rank 0's device tier dropped"


async def test_ranks_kept_before_a_restart_shows_are_judged_with_the_new_process(tmp_path, monkeypatch):
    """Rank 1 is kept under s1; then rank 0's probe shows a restart and the new process proves s2:
    the decision drops rank 1's storage blocks too, so a later process proving s2 adopts none."""
    s1, s2 = StorageIdentity("s1", 0), StorageIdentity("s2", 0)
    cur = [s1]

    async def lookup(_s):
        return cur[0]

    gate = asyncio.Event()
    async with (
        fake(tmp_path, dp_size=2, replay_buffer=8) as engine,
        plane_for(storage_lookup=lookup) as plane,
    ):
        await adopted_with_an_idle_rank(plane, engine)
        leave(plane)
        engine.restart()
        probe_waits(monkeypatch, engine, gate.wait)
        plane.set_workers([dp2(engine)])
        await eventually(lambda: Carrier("e", 1) not in plane.readoption.phases(), what="rank 1 kept")
        cur[0] = s2
        gate.set()
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="settled")
        await plane.writer.drain()
        leave(plane)
        engine.restart()
        await back(plane, dp2(engine))  # a process proving s2 again
        assert rank_tiers(plane, DISK) == {}, "blocks kept under s1 adopted under s2"


async def test_a_breaker_stopped_return_that_expires_counts_as_rejected(tmp_path):
    """A return stopped by the breaker, then the grace window passes, then the breaker closes: one
    attempt, rejected (its blocks are gone)."""
    gate = asyncio.Event()
    on = [False]

    async def gated(s):
        if on[0]:
            await gate.wait()
        return await lookup_storage(s)

    async with fake(tmp_path) as engine, plane_for(storage_lookup=gated, disconnect_grace_s=0.5) as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()
        on[0] = True
        plane.set_workers([spec(engine)])
        await asyncio.sleep(0.05)
        plane.engine_unreachable("e")
        await eventually(lambda: sample(plane, "routerfleet_kv_grace_expirations_total") == 1, what="expired")
        plane.engine_reachable("e")  # its ranks are proved by their probes before they show
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="proved")
        await plane.writer.drain()
        assert (outcome(plane, "success"), outcome(plane, "rejected")) == (0, 1)


# ---- randomized interleavings (their minimal repros) ---------------------------------------------


def false_visible(plane: KVPlane, engine: FakeEngine, rank: int = 0) -> dict[str, int]:
    """Blocks the index shows for the engine's rank that the engine does not hold in that tier."""
    c = Carrier("e", rank)
    vis = plane.index.visible_tiers(c)
    held = plane.index.carrier_engine_hashes(c)
    cache = engine.caches[rank]
    truth = {
        Tier.DEVICE: set(cache.device_hashes()),
        Tier.HOST: set(cache.host_hashes()),
        Tier.DISK: set(cache.disk_hashes()),
        Tier.EXTERNAL: set(),
    }
    return {t.name: len(held[t] - truth[t]) for t in truth if vis & t and held[t] - truth[t]}


async def test_a_restart_after_a_replayed_history_is_not_taken_for_duplicates(tmp_path):
    """Adopted with its batches from the catch-up replay only (no live sequence seen), the new process
    restarts again with discovery unchanged: the next one's first batches carry sequence numbers we
    applied, but other batches there; they are a restart, not duplicates."""
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        engine.restart()
        x, y, z = [700] * BS, [701] * BS, [702] * BS
        engine.emit(0, engine.caches[0].store(x))
        engine.emit(0, engine.caches[0].store(y))
        await back(plane, spec(engine))  # the catch-up replays 0..1
        sub = plane.subscriptions()[0]
        assert tiers(plane, x) == (1, 0, 0, 0) and sub.cursor == 1
        engine.restart()
        engine.emit(0, engine.caches[0].store(z))  # seq 0 of the next process
        engine.publisher.publish(0, ())
        engine.publisher.publish(0, ())
        await eventually(lambda: sub.cursor == 2 and tiers(plane, z) is not None, what="the new stream")
        await plane.writer.drain()
        assert tiers(plane, x) is None and not false_visible(plane, engine)


@pytest.mark.parametrize("moved", [False, True], ids=["same_spec", "spec_changed_while_open"])
async def test_a_process_restarted_behind_an_open_breaker_is_proved_before_it_shows(tmp_path, moved):
    """``moved``: its spec changes while its breaker is open, so that return is proved and shown before
    the restart, the breaker still open; it is proved again all the same when the breaker closes (a
    randomized interleaving found it shown without a proof)."""
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine, pod=True)
        plane.engine_unreachable("e")
        if moved:
            await back(plane, dataclasses.replace(in_pod(engine), url=engine.http_url + "/"))
        engine.restart()  # publishes nothing: no batch shows the restart
        plane.engine_reachable("e")
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="proved")
        await plane.writer.drain()
        assert tiers(plane, DEV) is None and tiers(plane, DISK) == (0, 0, 2, 0)
        assert not false_visible(plane, engine)


async def test_the_host_tier_is_not_adopted_across_a_restart(tmp_path):
    """Host (CPU) memory dies with the process, like the device's."""
    async with fake(tmp_path, host_capacity_blocks=4) as engine, plane_for() as plane:
        await warm(plane, engine)
        h = [800] * BS + [801] * BS
        engine.emit(0, engine.caches[0].store(h, tier=Tier.HOST))
        await eventually(lambda: tiers(plane, h) == (0, 2, 0, 0), what="host indexed")
        leave(plane)
        engine.restart()
        await back(plane, spec(engine))
        assert tiers(plane, h) is None and tiers(plane, DISK) == (0, 0, 2, 0)
        assert not false_visible(plane, engine)


def gated_replay(gate):
    real = readoption_mod.replay

    async def gated(*a, **kw):
        await gate.wait()
        return await real(*a, **kw)

    return gated


async def test_evictions_held_by_a_return_cut_short_are_kept(tmp_path, monkeypatch):
    """A same-incarnation return whose probe is slow holds the engine's next batch (its disk blocks
    promoted to device: BlockRemoved STORAGE); discovery drops it before the probe answers, and the
    container restarts on the same disk. The held batch is never applied, but its evictions are
    kept, so the new process's adoption does not show the promoted (now gone) disk blocks."""
    gate = asyncio.Event()
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        leave(plane)
        real = readoption_mod.replay
        probe_start = plane.readoption.record("e").positions[0].cursor

        async def gated(ctx, endpoint, start, *a, **kw):
            if start == probe_start:  # the probe (a gap fill asks from cursor + 1)
                await gate.wait()
            return await real(ctx, endpoint, start, *a, **kw)

        monkeypatch.setattr(readoption_mod, "replay", gated)
        plane.set_workers([spec(engine)])  # same process returns; its probe waits
        sub = plane.subscriptions()[0]
        await eventually(lambda: sub.connected, what="connected")
        await asyncio.sleep(0.2)
        engine.admit(0, DISK, engine.caches[0].chain(DISK)[0].namespace)  # promote DISK to device
        await eventually(lambda: sub.hold is not None and len(sub.hold) >= 1, what="held")
        leave(plane)  # gone again before the decision: the held batch is dropped
        gate.set()
        engine.restart()
        await back(plane, spec(engine))
        assert not false_visible(plane, engine), false_visible(plane, engine)


async def test_evictions_held_by_a_breaker_return_cut_short_are_kept(tmp_path, monkeypatch):
    """As above, through the breaker: it closes (its ranks held for their probes), the promotion's
    batch lands in the hold, and discovery drops the engine before the probe answers."""
    gate = asyncio.Event()
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine)
        plane.engine_unreachable("e")
        monkeypatch.setattr(readoption_mod, "replay", gated_replay(gate))
        plane.engine_reachable("e")  # held and probed
        sub = plane.subscriptions()[0]
        engine.admit(0, DISK, engine.caches[0].chain(DISK)[0].namespace)
        await eventually(lambda: sub.hold is not None and len(sub.hold) >= 1, what="held")
        leave(plane)
        gate.set()
        engine.restart()
        await back(plane, spec(engine))
        assert not false_visible(plane, engine), false_visible(plane, engine)


async def test_evictions_of_the_old_process_held_before_a_restart_shows_are_kept(tmp_path, monkeypatch):
    """In a pod: the old process returns, its probe is slow, it evicts its disk blocks (held), then its
    container restarts and the new process's first batch shows the restart: the old process's held
    evictions are kept, and the new-process adoption does not show the evicted blocks."""
    gate = asyncio.Event()
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine, pod=True)
        leave(plane)
        real = readoption_mod.replay
        probe_start = plane.readoption.record("e").positions[0].cursor

        async def gated(ctx, endpoint, start, *a, **kw):
            if start == probe_start:
                await gate.wait()
            return await real(ctx, endpoint, start, *a, **kw)

        monkeypatch.setattr(readoption_mod, "replay", gated)
        plane.set_workers([in_pod(engine)])
        sub = plane.subscriptions()[0]
        await eventually(lambda: sub.connected, what="connected")
        await asyncio.sleep(0.2)
        engine.emit(0, engine.caches[0].remove(DISK))  # the old process evicts its disk blocks
        await eventually(lambda: sub.hold is not None and len(sub.hold) >= 1, what="held")
        engine.restart()
        engine.publisher.publish(0, ())  # seq 0 of the new process: the restart shows live
        await asyncio.sleep(0.3)
        gate.set()
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided")
        await plane.writer.drain()
        assert not false_visible(plane, engine), false_visible(plane, engine)


async def test_a_gap_fill_spanning_a_reset_does_not_splice_a_dead_process(tmp_path, monkeypatch):
    """A gap fill is out when the probe shows a restart (resume to -1, live_last None); by the time
    the fill asks again the engine has restarted once more. The refill takes p3's batches, cannot
    reach the live seq in hand (p2's), clears the rank and accepts p2's batch as FIRST: a dead
    process's device store is applied to p3's carrier, and with live_last wiped by the reset, p3's
    next batches (seq <= that cursor, hashes unknown) are dropped as duplicates."""
    probe_gate, fill_gate, lookup_gate = asyncio.Event(), asyncio.Event(), asyncio.Event()
    gating = [False]

    async def lookup(s):
        if gating[0]:
            await lookup_gate.wait()
        return await lookup_storage(s)

    async with fake(tmp_path) as engine, plane_for(storage_lookup=lookup) as plane:
        await warm(plane, engine, pod=True)
        K = plane.subscriptions()[0].cursor
        leave(plane)
        engine.restart()  # p2
        for _ in range(K + 2):  # p2: 0 .. K+1
            engine.publisher.publish(0, ())
        real_p, real_s = readoption_mod.replay, sub_mod.replay

        async def probe(ctx, endpoint, start, *a, **kw):
            if start == K:
                await probe_gate.wait()
            return await real_p(ctx, endpoint, start, *a, **kw)

        fills = []

        async def fill(ctx, endpoint, start, *a, **kw):
            fills.append(start)
            if len(fills) == 1:
                await fill_gate.wait()
            return await real_s(ctx, endpoint, start, *a, **kw)

        monkeypatch.setattr(readoption_mod, "replay", probe)
        monkeypatch.setattr(sub_mod, "replay", fill)
        gating[0] = True
        plane.set_workers([in_pod(engine)])
        sub = plane.subscriptions()[0]
        await eventually(lambda: sub.connected, what="connected")
        await asyncio.sleep(0.2)
        Y = [900] * BS
        engine.emit(0, engine.caches[0].store(Y), Drop.NONE)  # p2 seq K+2: a live GAP (cursor K) ...
        await eventually(lambda: fills, what="gap fill out")  # ... whose fill waits
        probe_gate.set()  # the probe: another batch at K -> restarted in place, resume(-1)
        await eventually(lambda: sub.cursor == -1, what="reset by the probe")
        engine.restart()  # p3, same ports: Y died with p2
        for _ in range(2):
            engine.publisher.publish(0, ())  # p3: 0, 1
        fill_gate.set()
        await eventually(lambda: len(fills) >= 2, what="refill")
        await asyncio.sleep(0.2)
        lookup_gate.set()
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="settled")
        await plane.writer.drain()
        # p3 goes on publishing: are its batches followed?
        Z = [901] * BS
        engine.emit(0, engine.caches[0].store(Z))  # p3 seq 2
        engine.publisher.publish(0, ())  # p3 seq 3
        await asyncio.sleep(0.3)
        await plane.writer.drain()
        assert not false_visible(plane, engine), false_visible(plane, engine)
        assert tiers(plane, Z) is not None, "p3's store was dropped as a duplicate"


def late_delivery(monkeypatch) -> tuple[list[bool], asyncio.Event]:
    """Batches that sit in the SUB socket for a while: once ``gating[0]`` is set, the live loop reads
    nothing more until ``deliver`` is set."""
    deliver = asyncio.Event()
    gating = [False]
    real_on_live = sub_mod.RankSubscription.on_live

    async def on_live(self, frames):
        if gating[0]:
            await deliver.wait()
        return await real_on_live(self, frames)

    monkeypatch.setattr(sub_mod.RankSubscription, "on_live", on_live)
    return gating, deliver


async def test_a_dead_process_batch_read_late_is_not_applied(tmp_path, monkeypatch):
    """The old process's last batch still sits in the SUB socket when the breaker closes and the probe
    judges the engine a new process and decides it. When the batch is read at last, the gap replay
    it triggers ends before it (the new process never sent it): it is dropped, not applied."""
    gating, deliver = late_delivery(monkeypatch)
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine, pod=True)
        gating[0] = True
        plane.engine_unreachable("e")
        Y = [950] * BS
        engine.emit(0, engine.caches[0].store(Y))  # p1's last batch: in the socket, not read yet
        await asyncio.sleep(0.1)
        engine.restart()  # p2; Y died with p1
        plane.engine_reachable("e")  # probes: p2's buffer is empty -> a new process, decided
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided")
        await plane.writer.drain()
        deliver.set()  # the queued batch of the dead process is read now
        await asyncio.sleep(0.5)
        await plane.writer.drain()
        assert not false_visible(plane, engine), false_visible(plane, engine)


async def test_held_batches_the_catch_up_contradicts_are_not_applied(tmp_path, monkeypatch):
    """Behind an open breaker the engine restarts twice (p2, then p3); p2's batch reaches the live loop
    only after p3 is up and is held for the new-process decision. The catch-up asks p3, whose empty
    answer contradicts what was held: the decision is rejected and p2's batch is not applied."""
    gating, deliver = late_delivery(monkeypatch)
    async with fake(tmp_path) as engine, plane_for() as plane:
        await warm(plane, engine, pod=True)
        gating[0] = True
        plane.engine_unreachable("e")
        engine.restart()  # p2
        Y = [960] * BS
        engine.emit(0, engine.caches[0].store(Y))  # p2 seq 0, not read yet
        await asyncio.sleep(0.1)
        engine.restart()  # p3: Y is gone, p3 has published nothing
        plane.engine_reachable("e")
        deliver.set()  # p2's batch is read now
        await eventually(lambda: plane.carrier_states() == {"e": CarrierState.OK}, what="decided")
        await plane.writer.drain()
        await asyncio.sleep(0.3)
        assert not false_visible(plane, engine), false_visible(plane, engine)
