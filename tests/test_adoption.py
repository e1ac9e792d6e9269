"""Carrier lifecycle, the pure parts: the visibility mask (routing and export), dropping tiers, the
adoption decision and its cap, the fake engine's disk tier and storage identity. No sockets."""

from __future__ import annotations

import json

import pytest

from router_runtime.kv.adoption import (
    ALL,
    STORAGE_TIERS,
    AdoptionCap,
    Outcome,
    StorageIdentity,
    decide,
    parse_storage,
)
from router_runtime.kv.events import BlockRemoved, BlockStored, Dialect, EventBatch, Tier
from router_runtime.kv.index import RadixIndex
from router_runtime.kv.snapshot import Exporter
from router_runtime.worker import Carrier
from routerfleet_fake_engine.cache import CacheConfig, RankCache
from routerfleet_fake_engine.storage import MARKER, StorageDir

from .columns import arrays

BS = 4
A, B = Carrier("a"), Carrier("b")
S1 = StorageIdentity("s1", 0)


def stored(hashes, parent, tokens, medium="GPU") -> EventBatch:
    return EventBatch(0.0, (BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium=medium),))


def two_carriers() -> RadixIndex:
    """A holds [1..8] on device and [9..12] below it on disk; B holds [1..4] on device."""
    idx = RadixIndex(BS)
    idx.apply_batch(A, stored([11, 12], None, range(1, 9)))
    idx.apply_batch(A, stored([13], 12, range(9, 13), medium="STORAGE"))
    idx.apply_batch(B, stored([21], None, range(1, 5)))
    return idx


def blocks(idx: RadixIndex, tokens) -> dict[Carrier, tuple[int, tuple]]:
    return {c: (m.blocks, m.tier_blocks) for c, m in idx.match(list(tokens)).items()}


def export(idx: RadixIndex) -> dict[Carrier, int]:
    ex = Exporter(idx)
    while not ex.step(2):
        pass
    out: dict[Carrier, int] = {}
    for w in arrays(ex.columns)["worker"]:
        out[ex.workers[w]] = out.get(ex.workers[w], 0) + 1
    return out


def test_disconnected_carrier_is_invisible_to_routing_and_export():
    idx = two_carriers()
    assert blocks(idx, range(1, 13)) == {A: (3, (2, 0, 1, 0)), B: (1, (1, 0, 0, 0))}
    assert export(idx) == {A: 3, B: 1}

    idx.set_visible(A, 0)  # DISCONNECTED: one int, no walk
    assert blocks(idx, range(1, 13)) == {B: (1, (1, 0, 0, 0))}
    assert idx.match_keys(idx.keys_for(list(range(1, 13)))).keys() == {B}
    assert export(idx) == {B: 1}
    assert idx.carrier_blocks(A)[Tier.DEVICE] == 2  # still held, only hidden

    idx.set_visible(B, 0)  # nobody visible: the walk stops at once
    assert blocks(idx, range(1, 13)) == {}

    idx.set_visible(A, STORAGE_TIERS)  # only the device tier hidden: the disk block is below hidden ones
    idx.set_visible(B, ALL)
    assert blocks(idx, range(1, 13)) == {B: (1, (1, 0, 0, 0))}
    assert export(idx) == {A: 1, B: 1}  # A's disk block only

    idx.set_visible(A, ALL)  # adopted: everything back, nothing was rebuilt
    assert blocks(idx, range(1, 13)) == {A: (3, (2, 0, 1, 0)), B: (1, (1, 0, 0, 0))}


def test_drop_tiers_keeps_the_other_tiers_and_the_hashes_that_still_hold():
    idx = two_carriers()
    # Block 12 is on device and disk: after the drop it is a disk block, reachable under no parent.
    idx.apply_batch(A, stored([12], 11, range(5, 9), medium="STORAGE"))
    assert idx.drop_tiers(A, int(Tier.DEVICE)) == 2
    assert idx.carrier_blocks(A) == {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 2, Tier.EXTERNAL: 0}
    assert {t: len(h) for t, h in idx.carrier_engine_hashes(A).items()}[Tier.DISK] == 2
    # A later removal by engine hash still finds the surviving block; the dropped one is unknown.
    idx.apply_batch(A, EventBatch(0.0, (BlockRemoved((13, 11), "STORAGE"),)))
    assert idx.carrier_blocks(A)[Tier.DISK] == 1
    assert blocks(idx, range(1, 5)) == {B: (1, (1, 0, 0, 0))}


@pytest.mark.parametrize(
    ("old", "new", "kw", "keep", "outcome"),
    [
        (S1, S1, {}, STORAGE_TIERS, Outcome.SUCCESS),
        (S1, StorageIdentity("s1", 1), {}, 0, Outcome.EPOCH_MISMATCH),
        (S1, StorageIdentity("s2", 0), {}, 0, Outcome.IDENTITY_MISMATCH),
        (S1, None, {}, 0, Outcome.IDENTITY_MISMATCH),
        (None, S1, {}, 0, None),  # no identity was ever proved: nothing to adopt (not counted)
        (S1, S1, {"storage_claimed_by_other": True}, 0, Outcome.IDENTITY_MISMATCH),
        (S1, S1, {"cap_reached": True}, 0, Outcome.REJECTED),
        (S1, S1, {"same_shape": False}, 0, Outcome.REJECTED),
        (S1, S1, {"from_start": False}, 0, Outcome.REJECTED),
    ],
)
def test_decide_a_new_process(old, new, kw, keep, outcome):
    d = decide(old, new, **kw)
    assert (d.keep, d.outcome) == (keep, outcome)


def test_adoption_cap_is_per_storage_identity_in_a_sliding_window():
    cap = AdoptionCap(2, window_s=10)
    for t in (0, 1):
        assert not cap.reached("s1", t)
        cap.record("s1", t)
    assert cap.reached("s1", 5) and not cap.reached("s2", 5)
    assert not cap.reached("s1", 10.5)  # the first one left the window


def test_parse_storage():
    assert parse_storage({"storage_id": "x", "storage_epoch": 3}) == StorageIdentity("x", 3)
    for bad in (
        {},
        {"storage_id": "x"},
        {"storage_id": "", "storage_epoch": 0},
        {"storage_id": "x", "storage_epoch": True},
    ):
        assert parse_storage(bad) is None


# ---- the fake engine's disk tier and storage identity ----------------------------------------------


def test_fake_disk_tier_takes_evictions_and_survives_a_reset():
    cache = RankCache(CacheConfig(Dialect.VLLM_033, block_size=BS, device_capacity=2, disk_capacity=4))
    cache.admit(list(range(1, 9)))
    events = cache.admit(list(range(100, 108))).events  # evicts [1..8] from device to disk
    media = [(type(e).__name__, e.medium) for e in events]
    assert ("BlockStored", "STORAGE") in media and ("BlockRemoved", "GPU") in media
    assert len(cache.disk_hashes()) == 2
    assert cache.lookup(list(range(1, 9))).disk_blocks == 2
    cache.reset(keep_disk=True)
    assert cache.device_hashes() == [] and len(cache.disk_hashes()) == 2
    promote = cache.admit(list(range(1, 9))).events  # a disk hit is promoted: GPU store, disk removal
    assert [(type(e).__name__, e.medium) for e in promote][-2:] == [("BlockRemoved", "STORAGE")] * 2


def test_storage_marker_is_bound_to_the_directory(tmp_path):
    first = StorageDir(tmp_path / "s")
    again = StorageDir(tmp_path / "s")  # a restarted process finds the same identity
    assert (again.storage_id, again.epoch) == (first.storage_id, 0)
    assert StorageDir(tmp_path / "other").storage_id != first.storage_id
    cache = RankCache(CacheConfig(Dialect.SGLANG, block_size=BS, device_capacity=1, disk_capacity=4))
    cache.store(list(range(1, 9)), tier=Tier.DISK)
    first.save(0, cache.disk_blocks())
    assert [b.hash for b in StorageDir(tmp_path / "s").load(0)] == cache.disk_hashes()
    assert first.bump_epoch() == 1
    assert StorageDir(tmp_path / "s").epoch == 1
    assert StorageDir(tmp_path / "s").load(0) == []  # written under epoch 0: invalidated
    # Data without a marker cannot be vouched for: discarded, new identity.
    (tmp_path / "s" / MARKER).unlink()
    first.save(0, cache.disk_blocks())
    fresh = StorageDir(tmp_path / "s")
    assert fresh.storage_id != first.storage_id and fresh.load(0) == []
    assert json.loads((tmp_path / "s" / MARKER).read_text())["storage_id"] == fresh.storage_id


def test_flags(capsys):
    from router_runtime.config import parse_args
    from routerfleet_fake_engine.cli import build_parser, config_from_args
    from routerfleet_fake_engine.config import ConfigError

    default = parse_args(["--worker", "http://e:8000"])
    assert (default.kv.disconnect_grace_s, default.kv.adoption_cap, default.kv.adoption_window_s) == (
        600,
        3,
        3600,
    )
    cfg = parse_args(["--worker", "http://e:8000", "--kv-disconnect-grace-s", "0", "--kv-adoption-cap", "1"])
    assert (cfg.kv.disconnect_grace_s, cfg.kv.adoption_cap) == (0, 1)
    for flag, bad in (
        ("--kv-disconnect-grace-s", "-1"),
        ("--kv-adoption-cap", "-1"),
        ("--kv-adoption-window-s", "0"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--worker", "http://e:8000", flag, bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("routerfleet-router: error: ") and flag in err, err  # one line, naming it
    fe = config_from_args(
        build_parser().parse_args(["--storage-dir", "/tmp/x", "--disk-capacity-blocks", "8"])
    )
    assert (fe.storage_dir, fe.disk_capacity_blocks) == ("/tmp/x", 8)
    with pytest.raises(ConfigError):
        config_from_args(build_parser().parse_args(["--disk-capacity-blocks", "8"])).validate()
