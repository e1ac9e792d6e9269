"""Bootstrap states, outcomes and verdicts, and the pure rules that derive readiness from them.

A rank goes PENDING (batches held) -> RECOVERED (grafted, continuity being proved) -> SETTLED with an
outcome. The fleet-level verdict is what the operator reads; which verdict may hold readiness is the
whole safety argument: ``no_peers`` (first deploy) and ``fleet_cold`` (every sibling proved it holds
nothing) must never gate, or a fleet whose replicas are all unready (and so out of each other's peer
sets) deadlocks.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable
from dataclasses import dataclass


class RankState(enum.StrEnum):
    PENDING = "pending"
    RECOVERED = "recovered"  # grafted; the live stream has not yet proved it joins the watermark
    SETTLED = "settled"


class RankOutcome(enum.StrEnum):
    FROM_ORIGIN = "from_origin"  # rebuilt exactly from the engine's own replay buffer, from seq 0
    WARM = "warm"  # grafted and the live stream proved it joins at cursor + 1
    WARM_UNWITNESSED = "warm_unwitnessed"  # grafted; no batch and no peer could speak to the watermark
    GAP = "gap"  # the live stream did not join the watermark: graft discarded
    ABANDONED = "abandoned"  # no graft: no peers, a cold fleet, or the timeout
    OVERFLOW = "overflow"  # the hold overflowed
    PUBLISHER_RESET = "publisher_reset"  # the rank was cleared while pending (restart, lost batches)
    TREE_REJECTED = "tree_rejected"  # a snapshot was refused by vetting for this rank
    NOT_IN_SNAPSHOT = "not_in_snapshot"  # the accepted snapshot had nothing for this rank
    CONFIG_MISMATCH = "config_mismatch"  # the rank's own stores do not fit this router's configuration


class OriginOutcome(enum.StrEnum):
    """One attempt to rebuild a rank from the engine's replay buffer, starting at sequence 0."""

    COMPLETE = "complete"
    AGED_OUT = "aged_out"  # the buffer no longer reaches back to 0: a long-lived publisher
    TRUNCATED = "truncated"  # the replay stopped mid-way (silence, a byte bound, a bad batch)
    GAP = "gap"  # a hole inside the replay, or between its end and the held live batches
    TIMEOUT = "timeout"  # nothing came back
    CONFIG_MISMATCH = "config_mismatch"  # complete, and not one store fits this router (kv/fit.py)


class SnapshotOutcome(enum.StrEnum):
    """One fetch from one peer."""

    ACCEPTED = "accepted"
    UNREACHABLE = "unreachable"
    COLD_PEER = "cold_peer"  # 404, not ready, or nothing usable: the peer holds nothing for us
    REJECTED = "rejected"  # malformed, corrupt, bad shape
    FOREIGN = "foreign"  # another block size or key scheme: which side is wrong, our own stream tells


class SweepResult(enum.StrEnum):
    FOUND = "found"
    NO_PEERS = "no_peers"
    FLEET_COLD = "fleet_cold"
    TIMED_OUT = "timed_out"


class Verdict(enum.StrEnum):
    """The fleet-level verdict of one replica's bootstrap (the operator's input)."""

    PENDING = "pending"
    WARM = "warm"
    FROM_ORIGIN = "from_origin"  # exact, from the engines' own replay (the operator treats it as warm)
    WARM_UNWITNESSED = "warm_unwitnessed"
    NO_PEERS = "no_peers"
    FLEET_COLD = "fleet_cold"
    TIMED_OUT = "timed_out"
    DISABLED = "disabled"
    # The engines' own stores do not fit this router's configuration (kv/fit.py): the index stays
    # empty whatever was inherited. Never in the operator's passVerdicts.
    CONFIG_MISMATCH = "config_mismatch"


class CauseCode(enum.StrEnum):
    """Why a replica is not (or not yet) warm, as the operator shows it: the reasons of its conditions."""

    CONFIG_MISMATCH = "ConfigMismatch"
    NO_ENGINES = "NoEnginesDiscovered"
    ENGINE_DISCOVERY = "EngineDiscoveryNotSynced"  # RBAC, a missing namespace, an unreachable API
    PEER_DISCOVERY = "PeerDiscoveryNotSynced"
    PEER_REFUSED = "PeerRefused"
    PEER_UNREACHABLE = "PeerUnreachable"


@dataclass(frozen=True, slots=True)
class Cause:
    code: CauseCode
    message: str  # for a user to act on: names engines, peers and settings, never tokens or hashes

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code.value, "message": self.message}


# Verdicts that only mean "nothing to inherit": never a seed failure, never a readiness hold.
NOTHING_TO_INHERIT = frozenset({Verdict.NO_PEERS, Verdict.FLEET_COLD, Verdict.DISABLED})


@dataclass(slots=True)
class RankBoot:
    state: RankState = RankState.PENDING
    outcome: RankOutcome | None = None
    epoch: int = 0
    since: float = 0.0  # when the rank started holding
    retried: bool = False  # a gap gets one more sweep, stamped fresh
    watermark: int | None = None
    probes: int = 0
    origin: asyncio.Task | None = None  # the replay-from-0 attempt, which the sweep waits for


def verdict(
    enabled: bool,
    settled: bool,
    ranks: Iterable[RankBoot],
    last_sweep: SweepResult | None,
    misfit: bool = False,
) -> Verdict:
    """Fold rank states and outcomes and the last sweep's result into one verdict. A rank whose graft
    landed and is still proving its watermark counts as warm (a later gap turns it cold). ``misfit``: a
    rank's own stores do not fit our configuration (kv/fit.py), which outranks whatever was inherited:
    the index cannot hold that rank's blocks, so the replica routes cache-blind on it."""
    if not enabled:
        return Verdict.DISABLED
    if not settled:
        return Verdict.PENDING
    if misfit:
        return Verdict.CONFIG_MISMATCH
    ranks = list(ranks)
    seen = {b.outcome for b in ranks}
    if RankOutcome.WARM in seen or any(b.state is RankState.RECOVERED for b in ranks):
        return Verdict.WARM
    if RankOutcome.FROM_ORIGIN in seen:
        return Verdict.FROM_ORIGIN
    if RankOutcome.WARM_UNWITNESSED in seen:
        return Verdict.WARM_UNWITNESSED
    if last_sweep is SweepResult.NO_PEERS:
        return Verdict.NO_PEERS
    if last_sweep is SweepResult.FLEET_COLD:
        return Verdict.FLEET_COLD
    if last_sweep is None:
        return Verdict.NO_PEERS  # settled without a sweep: no engine ranks to bootstrap
    return Verdict.TIMED_OUT


def seed_failed(v: Verdict, candidates_seen: bool) -> bool:
    """Siblings were there and their tree could not be pulled. Only this may gate readiness."""
    return v is Verdict.TIMED_OUT and candidates_seen


@dataclass(frozen=True, slots=True)
class Gate:
    """Readiness inputs for ``readiness``; all times on one monotonic clock."""

    enabled: bool
    settled: bool
    seed_required: bool
    seed_failed: bool  # or a configuration mismatch: both mean "not warm, and not by bad luck"
    first_rank_at: float | None  # the hold is measured from the first rank, never from construction
    now: float
    timeout_s: float
    latched: bool  # a 200 was served once: never go back


def readiness(g: Gate) -> tuple[bool, str]:
    """Whether bootstrap lets ``/readyz`` say 200, and why not."""
    if not g.enabled or g.latched:
        return True, "ready"
    if g.first_rank_at is None:
        return False, "bootstrap: waiting for the first engine"
    waited = g.now - g.first_rank_at
    if not g.settled:
        return False, "bootstrap: pulling a warm sibling's index"
    if g.seed_required and g.seed_failed:
        # Bounded: a fleet-wide restart where every peer is booting must not hold forever.
        if waited < 3 * g.timeout_s:
            return False, "bootstrap: seed required and the warm siblings' index could not be pulled"
        return True, "ready (seed-required hold expired)"
    return True, "ready"
