"""The configuration-mismatch rule (kv/fit.py) over every skip reason, and its agreement with the
index: a rank is a misfit exactly when the index would refuse all its stores for a configuration reason."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router_runtime.bootstrap.state import RankBoot, RankOutcome, RankState, SweepResult, Verdict, verdict
from router_runtime.kv.events import BlockStored, EventBatch
from router_runtime.kv.fit import CONFIG_SKIPS, FitTally
from router_runtime.kv.index import RadixIndex, Skip, store_skip
from router_runtime.worker import Carrier

BS = 4
C = Carrier("e1", 0)


def stored(n=2, *, block_size=BS, medium=None, group=None, kind=None, tokens=None, parent=None):
    return BlockStored(
        block_hashes=tuple(range(1000, 1000 + n)),
        parent_block_hash=parent,
        token_ids=tuple(range(tokens if tokens is not None else n * block_size)),
        block_size=block_size,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=kind,
    )


def batch(*events) -> EventBatch:
    return EventBatch(ts=0.0, events=tuple(events))


CASES = {
    # event -> (the index's skip reason, whether a rank sending only these is a misfit)
    "fits": (stored(), None, False),
    "block_size": (stored(block_size=BS * 2), Skip.BLOCK_SIZE_MISMATCH, True),
    "other_group": (stored(group=1), Skip.OTHER_GROUP, True),
    "sliding_window": (stored(kind="sliding_window"), Skip.OTHER_GROUP, True),
    "unknown_medium": (stored(medium="NVME_OVER_FABRIC"), Skip.UNKNOWN_MEDIUM, True),
    "token_count": (stored(tokens=3), Skip.TOKEN_COUNT, False),  # a bad event, not our configuration
    "unknown_parent": (stored(parent=77), Skip.UNKNOWN_PARENT, False),  # joined mid-stream: normal
}


@pytest.mark.parametrize("case", CASES)
def test_every_skip_reason(case):
    ev, skip, misfit = CASES[case]
    idx = RadixIndex(BS)
    stats = idx.apply_batch(C, batch(ev))
    assert (next(iter(stats.skipped), None)) is skip
    tally = FitTally()
    tally.add(batch(ev), BS, 0)
    assert (tally.misfit is not None) is misfit
    if misfit:
        assert tally.misfit.reason is skip and skip in CONFIG_SKIPS
        assert "1000" not in tally.misfit.detail  # never a hash (nor a token)
    # One store that fits is enough: a hybrid model sends other groups beside the full-attention one.
    tally.add(batch(stored()), BS, 0)
    assert tally.misfit is None


def test_the_detail_names_what_to_fix():
    tally = FitTally()
    tally.add(batch(stored(block_size=16)), 32, 0)
    assert tally.misfit.detail == "the engine publishes block size 16; this router is configured for 32"
    tally = FitTally()
    tally.add(batch(stored(group=2, kind="full_attention")), BS, 0)
    assert "group 2 (full_attention)" in tally.misfit.detail and "group 0" in tally.misfit.detail


def test_no_store_is_no_evidence():
    tally = FitTally()
    tally.add(batch(), BS, 0)
    assert tally.misfit is None


EVENTS = st.builds(
    stored,
    n=st.integers(1, 3),
    block_size=st.sampled_from([BS, BS * 2]),
    medium=st.sampled_from([None, "GPU", "CPU", "TAPE"]),
    group=st.sampled_from([None, 0, 1]),
    kind=st.sampled_from([None, "full_attention", "mamba"]),
)


@given(st.lists(EVENTS, max_size=6))
def test_the_tally_agrees_with_the_index(events):
    idx = RadixIndex(BS)
    tally = FitTally()
    b = batch(*events)
    stats = idx.apply_batch(C, b)
    tally.add(b, BS, 0)
    assert tally.accepted == sum(len(e.block_hashes) for e in events if store_skip(e, BS, 0) is None)
    refused = sum(n for skip, n in stats.skipped.items() if skip in CONFIG_SKIPS)
    accepted = sum(len(e.block_hashes) for e in events) - sum(stats.skipped.values())
    assert tally.refused == refused and tally.accepted == accepted
    assert (tally.misfit is not None) == (refused > 0 and accepted == 0)


@pytest.mark.parametrize("outcome", list(RankOutcome))
def test_a_misfit_outranks_every_rank_outcome(outcome):
    ranks = [RankBoot(state=RankState.SETTLED, outcome=outcome)]
    for sweep in (None, *SweepResult):
        assert verdict(True, True, ranks, sweep, misfit=True) is Verdict.CONFIG_MISMATCH
    assert verdict(True, False, ranks, None, misfit=True) is Verdict.PENDING  # not settled yet
    assert verdict(False, True, ranks, None, misfit=True) is Verdict.DISABLED
