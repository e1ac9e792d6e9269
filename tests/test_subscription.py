"""Subscriptions over real ZMQ sockets against the fake engine's publisher: live apply, gap replay,
an uncovered gap, a publisher restart, malformed batches, a dead replay socket, writer overflow."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from prometheus_client import CollectorRegistry

from router_runtime.kv.config import KvConfig
from router_runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Dialect
from router_runtime.kv.hold import RankHold
from router_runtime.kv.plane import KVPlane
from router_runtime.kv.subscription import SPLICE_IN_FLIGHT_S, ReplayTimeouts
from router_runtime.worker import Carrier, WorkerSpec
from routerfleet_fake_engine.publisher import Drop, KvPublisher

from .support import eventually, join_stream

BS = 4
ENGINE = "http://engine-a"


def store(h: int, tokens: list[int], parent: int | None = None, medium: str | None = "GPU") -> BlockStored:
    return BlockStored((h,), parent, tuple(tokens), BS, medium=medium)


def sample(plane: KVPlane, name: str, **labels) -> float:
    return plane.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def setup(dialect=Dialect.VLLM_033, dp=1, replay_buffer=10_000, replay_endpoint=True, **plane_kw):
    pub = KvPublisher(
        dialect=dialect,
        dp_size=dp,
        host="127.0.0.1",
        kv_port=0,
        replay_port=0,
        topic="kv-topic",
        replay_buffer=replay_buffer,
    )
    pub.start()
    registry = CollectorRegistry()
    plane_kw.setdefault("disconnect_grace_s", 0.0)  # removed at once: these tests are about one stream
    config = KvConfig(block_size=BS, replay=ReplayTimeouts(idle_s=0.3, total_s=2), **plane_kw)
    plane = KVPlane(config, registry)
    await plane.start()
    plane.set_workers(
        [
            WorkerSpec(
                ENGINE,
                ENGINE,
                kv=pub.kv_endpoint(0),
                replay=pub.replay_endpoint(0)
                if replay_endpoint is True
                else replay_endpoint or "tcp://127.0.0.1:1",
                dp_size=dp,
                topic=b"kv-topic",
            ),
        ]
    )
    try:
        for sub in sorted(plane.subscriptions(), key=lambda s: s.carrier.rank):
            await join_stream(pub, sub, sub.carrier.rank)
        yield pub, plane
    finally:
        await plane.stop()
        await pub.close()


def matched(plane: KVPlane, tokens: list[int]) -> dict[Carrier, int]:
    return {c: m.blocks for c, m in plane.index.match(tokens).items()}


@pytest.mark.parametrize("dialect", list(Dialect))
async def test_live_events_reach_the_index_in_every_dialect(dialect):
    async with setup(dialect, dp=2) as (pub, plane):
        pub.publish(0, [store(11, [1, 2, 3, 4]), store(12, [5, 6, 7, 8], parent=11)])
        pub.publish(1, [store(21, [1, 2, 3, 4], medium="CPU" if dialect != Dialect.SGLANG else "CPU_PINNED")])
        r0, r1 = Carrier(ENGINE, 0), Carrier(ENGINE, 1)
        await eventually(
            lambda: matched(plane, [1, 2, 3, 4, 5, 6, 7, 8]) == {r0: 2, r1: 1}, what="both ranks"
        )
        m = plane.index.match([1, 2, 3, 4])
        assert m[r0].tier_blocks == (1, 0, 0, 0) and m[r1].tier_blocks == (0, 1, 0, 0)
        # Session affinity reads when each rank last lost blocks, or may have (what came before its
        # first batch is unknown to us): stamped on the first batch, then by removals and clears only.
        evicted = dict(plane.writer.evicted_at)
        assert set(evicted) == {r0, r1}
        pub.publish(0, [store(13, [9, 9, 9, 9])])
        await eventually(lambda: matched(plane, [9, 9, 9, 9]), what="another store")
        assert plane.writer.evicted_at == evicted  # a store is not an eviction
        before = time.monotonic()
        pub.publish(0, [BlockRemoved((12,), "GPU")])
        await eventually(lambda: matched(plane, [1, 2, 3, 4, 5, 6, 7, 8]) == {r0: 1, r1: 1}, what="removal")
        assert plane.writer.evicted_at[r0] >= before and plane.writer.evicted_at[r1] == evicted[r1]
        pub.publish(1, [AllBlocksCleared()])
        await eventually(lambda: matched(plane, [1, 2, 3, 4]) == {r0: 1}, what="clear")
        assert plane.writer.evicted_at[r1] >= before


async def test_a_gap_is_filled_from_the_replay_buffer():
    async with setup() as (pub, plane):
        pub.publish(0, [store(1, [1, 2, 3, 4])], drop=Drop.PUB)  # lost on PUB, still in the buffer
        pub.publish(0, [store(2, [5, 6, 7, 8], parent=1)])
        await eventually(lambda: matched(plane, [1, 2, 3, 4, 5, 6, 7, 8]), what="replayed store")
        assert matched(plane, [1, 2, 3, 4, 5, 6, 7, 8]) == {Carrier(ENGINE, 0): 2}
        assert sample(plane, "routerfleet_kv_gaps_total") == 1
        assert sample(plane, "routerfleet_kv_replays_total", outcome="filled") == 1
        assert sample(plane, "routerfleet_kv_ranks_cleared_total", reason="uncovered_gap") == 0
        sub = plane.subscriptions()[0]
        await eventually(lambda: sub.cursor == pub.last_seq(0), what="cursor at the publisher's last seq")


async def test_a_gap_the_buffer_no_longer_covers_clears_the_rank():
    async with setup(replay_buffer=2) as (pub, plane):
        pub.publish(0, [store(1, [1, 2, 3, 4])])
        await eventually(lambda: matched(plane, [1, 2, 3, 4]), what="first store")
        pub.publish(0, [BlockRemoved((1,), None)], drop=Drop.PUB)  # the removal we will never see...
        pub.skip(0, 3)  # ...because the 2-batch buffer moves past it
        pub.publish(0, [store(9, [9, 9, 9, 9])])
        await eventually(lambda: matched(plane, [9, 9, 9, 9]), what="store after the gap")
        # Cold, never wrong: the block whose removal was lost is gone from the index too.
        assert matched(plane, [1, 2, 3, 4]) == {}
        assert sample(plane, "routerfleet_kv_replays_total", outcome="uncovered") == 1
        assert sample(plane, "routerfleet_kv_ranks_cleared_total", reason="uncovered_gap") == 1


async def test_a_publisher_restart_clears_the_rank():
    async with setup() as (pub, plane):
        pub.publish(0, [store(1, [1, 2, 3, 4])])
        pub.publish(0, [store(2, [5, 6, 7, 8])])
        await eventually(lambda: matched(plane, [5, 6, 7, 8]), what="stores")
        pub.reset()  # a new incarnation: sequences start again at 0
        pub.publish(0, [store(3, [7, 7, 7, 7])])
        await eventually(lambda: matched(plane, [7, 7, 7, 7]), what="store after the restart")
        assert matched(plane, [1, 2, 3, 4]) == {} and matched(plane, [5, 6, 7, 8]) == {}
        assert sample(plane, "routerfleet_kv_ranks_cleared_total", reason="publisher_restart") == 1


async def test_a_subscription_that_fails_clears_its_rank_and_follows_it_again():
    """A rank's subscription that fails (here the replay endpoint ZMQ refuses, at the first gap) never
    leaves its blocks credited while their removals go unheard: the rank is cleared, counted, and
    followed again."""
    async with setup(replay_endpoint="tcp://127.0.0.1:-1") as (pub, plane):
        pub.publish(0, [store(1, [1, 2, 3, 4])])
        await eventually(lambda: matched(plane, [1, 2, 3, 4]), what="the first store")
        pub.publish(0, [BlockRemoved((1,), None)], drop=Drop.PUB)  # a gap: its replay fails
        pub.publish(0, [store(2, [5, 6, 7, 8])])
        await eventually(
            lambda: sample(plane, "routerfleet_kv_ranks_cleared_total", reason="subscription_failed") == 1,
            what="the rank cleared",
        )
        await plane.writer.drain()
        assert matched(plane, [1, 2, 3, 4]) == {}
        sub = plane.subscriptions()[0]
        await eventually(lambda: sub.connected, timeout=10, what="the rank followed again")
        pub.publish(0, [store(3, [9, 9, 9, 9])])
        await eventually(lambda: matched(plane, [9, 9, 9, 9]), timeout=10, what="a store after it")


@pytest.mark.parametrize("ahead", [1, 3])
async def test_a_restarted_publisher_whose_sequence_passed_ours_is_found_by_our_cursors_batch(ahead):
    """An engine restarts on the same ports and publishes while our SUB reconnects (those batches are
    lost): its first live batch we see is past our cursor, next to it (``ahead`` 1) or beyond (3), so the
    sequence alone looks like a stream that went on. The batch the new process holds at our cursor is
    another than the one we applied: the rank is cleared and follows the new process from its start."""
    async with setup() as (pub, plane):
        pub.publish(0, [store(1, [1, 2, 3, 4])])
        pub.publish(0, [store(2, [5, 6, 7, 8])])
        await eventually(lambda: matched(plane, [5, 6, 7, 8]), what="the old process's stores")
        sub = plane.subscriptions()[0]
        cursor = sub.cursor
        kv_port, replay_port = pub.kv_port_base, pub.replay_port_base
        await pub.close()  # the engine's process ends: our SUB sees its connection go
        await eventually(lambda: not sub.connected, what="the SUB disconnected")
        new = KvPublisher(
            dialect=Dialect.VLLM_033,
            dp_size=1,
            host="127.0.0.1",
            kv_port=kv_port,
            replay_port=replay_port,
            topic="kv-topic",
        )
        new.start()
        try:
            for k in range(cursor + ahead):  # published before our SUB is back: lost to us, buffered
                new.publish(0, [store(100 + k, [k + 1] * 4)], drop=Drop.PUB)
            await eventually(lambda: sub.connected, timeout=10, what="the SUB reconnected")
            await asyncio.sleep(0.3)  # ZMQ's subscription handshake completes after the TCP connect
            new.publish(0, [store(9, [9, 9, 9, 9])])
            await eventually(lambda: matched(plane, [9, 9, 9, 9]), what="the new process's live store")
            await plane.writer.drain()
            assert matched(plane, [1, 2, 3, 4]) == {} and matched(plane, [5, 6, 7, 8]) == {}
            assert sample(plane, "routerfleet_kv_ranks_cleared_total", reason="publisher_restart") == 1
            assert matched(plane, [1, 1, 1, 1]) == {Carrier(ENGINE, 0): 1}  # replayed from its start
            assert sub.cursor == new.last_seq(0)
        finally:
            await new.close()


async def test_a_publisher_restart_under_a_hold_that_judges_it_is_held_not_cleared():
    """Warm re-adoption's contract: a hold whose owner judges a new process itself keeps the rank (no
    clear) and holds the new stream from its sequence 0; a plain hold clears as usual."""

    class Judging(RankHold):
        restarts = 0

        def take_over_restart(self) -> bool:
            self.restarts += 1
            return True

    async with setup() as (pub, plane):
        pub.publish(0, [store(1, [1, 2, 3, 4])])
        pub.publish(0, [store(2, [5, 6, 7, 8])])
        await eventually(lambda: matched(plane, [5, 6, 7, 8]), what="stores")
        sub = plane.subscriptions()[0]
        sub.attach(hold := Judging())
        pub.reset()
        pub.publish(0, [store(3, [7, 7, 7, 7])])
        pub.publish(0, [store(4, [8, 8, 8, 8])])
        await eventually(lambda: len(hold) == 2, what="the new stream held")
        assert hold.restarts == 1 and [b.seq for b in hold.take()] == [0, 1]
        assert sample(plane, "routerfleet_kv_ranks_cleared_total", reason="publisher_restart") == 0
        assert matched(plane, [5, 6, 7, 8]) == {Carrier(ENGINE, 0): 1}  # the index untouched
        sub.attach(plain := RankHold())
        pub.reset()
        pub.publish(0, [store(5, [9, 9, 9, 9])])
        await eventually(
            lambda: sample(plane, "routerfleet_kv_ranks_cleared_total", reason="publisher_restart") == 1,
            what="a plain hold clears",
        )
        assert not plain.active


async def test_a_malformed_batch_is_counted_and_clears_the_rank():
    async with setup() as (pub, plane):
        pub.publish(0, [store(1, [1, 2, 3, 4])])
        await eventually(lambda: matched(plane, [1, 2, 3, 4]), what="store")
        pub.publish_payload(0, b"\x93\xcb\x00")  # truncated msgpack
        pub.publish(0, [store(2, [5, 6, 7, 8])])
        await eventually(lambda: matched(plane, [5, 6, 7, 8]), what="store after the bad batch")
        assert matched(plane, [1, 2, 3, 4]) == {}
        assert sample(plane, "routerfleet_kv_ranks_cleared_total", reason="malformed_batch") == 1
        reasons = {
            s.labels["reason"]
            for m in plane.registry.collect()
            for s in m.samples
            if s.name == "routerfleet_kv_malformed_frames_total"
        }
        assert reasons, "the malformed payload is counted by reason"


async def test_an_unanswered_replay_fails_cold():
    async with setup(replay_endpoint=False) as (pub, plane):
        pub.publish(0, [store(1, [1, 2, 3, 4])])
        await eventually(lambda: matched(plane, [1, 2, 3, 4]), what="store")
        pub.skip(0, 1)
        pub.publish(0, [store(2, [5, 6, 7, 8])])
        await eventually(lambda: matched(plane, [5, 6, 7, 8]), what="store after the failed replay")
        assert matched(plane, [1, 2, 3, 4]) == {}
        assert sample(plane, "routerfleet_kv_replays_total", outcome="timeout") == 1
        assert sample(plane, "routerfleet_kv_ranks_cleared_total", reason="replay_failed") == 1


async def test_writer_overflow_is_handled_as_lost_batches():
    async with setup(queue_batches=2) as (pub, plane):
        await plane.writer.drain()
        plane._writer_task.cancel()  # stall the writer so the queue fills
        for i in range(5):
            pub.publish(0, [store(100 + i, [i] * 4)])
        sub = plane.subscriptions()[0]
        await eventually(lambda: sub.cursor == pub.last_seq(0), what="all batches received")
        plane._writer_task = asyncio.create_task(plane.writer.run())
        await plane.writer.drain()
        assert sample(plane, "routerfleet_kv_queue_overflows_total") == 3
        assert sample(plane, "routerfleet_kv_ranks_cleared_total", reason="overflow") == 3
        assert all(matched(plane, [i] * 4) == {} for i in range(5))


async def test_a_replay_resending_what_a_graft_holds_is_dropped_and_the_join_proved():
    """A graft with nothing held above its cursor drops live batches at or below it only while they can
    be in flight (SPLICE_IN_FLIGHT_S); batches a gap's replay resends from our own cursor are the same
    process's whenever they come, so they are dropped too and the next one proves the join."""
    async with setup() as (pub, plane):
        sub = plane.subscriptions()[0]
        pub.publish(0, [store(1, [1, 2, 3, 4])])
        await eventually(lambda: sub.cursor == pub.last_seq(0), what="caught up")
        base, spliced = sub.cursor, []
        sub.on_splice = spliced.append
        sub.arm_splice(base + 2)  # a sibling saw two batches more than reached us
        pub.publish(0, [store(2, [5, 6, 7, 8], parent=1)], drop=Drop.PUB)  # lost live, in the buffer
        pub.publish(0, [store(3, [9, 9, 9, 9], parent=2)], drop=Drop.PUB)
        await asyncio.sleep(SPLICE_IN_FLIGHT_S + 0.2)
        pub.publish(0, [store(4, [8, 8, 8, 8], parent=3)])  # a gap: replayed from our cursor
        await eventually(lambda: sub.cursor == pub.last_seq(0), what="replayed")
        assert spliced == [base + 3]
