"""Carrier lifecycle across an engine's absence: OK -> DISCONNECTED (grace timer) -> REMOVED, and the
adoption decision when the engine comes back (after Mooncake's LOCAL_DISK warm re-adoption RFC).

An engine that leaves discovery or fails health is not erased: its carriers become DISCONNECTED, which
hides them from every reader (``RadixIndex.set_visible``: the one visibility predicate that ``match``
and the snapshot export apply) while the index keeps their blocks. When it returns:

* the same incarnation whose stream resumes without a gap (a replay covers it): every tier adopted;
* a new incarnation: the device tier is dropped (GPU memory is gone); host/disk/external tiers are
  adopted only if the engine proves the same storage identity and epoch it had; otherwise dropped;
* nobody returns within the grace window: REMOVED (today's ``remove_carrier``).

A cap on adoptions per storage identity (in a sliding window) stops a crash-looping engine from
flapping the index. Everything in this module but ``AdoptionMetrics`` is pure: ``decide`` is a function
of the old record, what the engine shows now and whether its stream is continuous.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .events import Tier

DEVICE_TIERS = int(Tier.DEVICE)  # gone with the process
# What may outlive an engine's process, if its storage is proved: disk and external stores. Host
# (CPU) memory dies with the process like the device's (vLLM's CPU offloading, LMCache's local CPU
# backend): re-adopting it would route on blocks nobody holds.
STORAGE_TIERS = int(Tier.DISK | Tier.EXTERNAL)
ALL = 0xF


class CarrierState(enum.StrEnum):
    OK = "ok"
    DISCONNECTED = "disconnected"
    REMOVED = "removed"


class DisconnectCause(enum.StrEnum):
    """Why an engine went DISCONNECTED: it left discovery (its subscriptions end; a return subscribes
    again), or its health check failed (they stay, so its stream is still followed)."""

    DISCOVERY = "discovery"
    HEALTH = "health"


class Outcome(enum.StrEnum):
    """Adoption attempts, by outcome (a metric label)."""

    SUCCESS = "success"
    EPOCH_MISMATCH = "epoch_mismatch"  # same storage, but its content was invalidated meanwhile
    IDENTITY_MISMATCH = "identity_mismatch"  # other storage (or none, or another engine's)
    REJECTED = "rejected"  # a gap in the stream, a changed shape, or the adoption cap


@dataclass(frozen=True, slots=True)
class StorageIdentity:
    """Bound to the storage, never to the process: the marker file's id, and an epoch that moves when
    the storage's content is invalidated."""

    storage_id: str
    epoch: int


@dataclass(slots=True)
class EngineRecord:
    """What the plane remembers of an engine across its absence (all its ranks share it)."""

    engine: str
    spec: object  # the WorkerSpec it had
    state: CarrierState = CarrierState.OK
    disconnected_at: float | None = None
    storage: StorageIdentity | None = None  # as proved while it was OK
    positions: dict[int, object] = field(default_factory=dict)  # rank -> StreamPosition when it left
    generation: int = 0  # bumped on every transition: a stale decision never lands
    prior_spec: object | None = None  # while a return is undecided: the spec it is judged against
    new_process_gen: int = -1  # the generation in which its stream showed a new process (same incarnation)
    unhealthy: bool = False  # its breaker is open: failed health, not passed since
    # The return being decided: its ranks' outcomes (counted once, when it settles), the identity the
    # new process proved (it becomes ``storage`` then: until the return settles, every decision of
    # it is judged against the identity the held blocks were kept under), and whether a new process's
    # storage tiers were adopted (what the adoption cap counts).
    outcomes: list = field(default_factory=list)
    new_process_seen: bool = False  # this return is a new process (another incarnation, a restart)
    judged_new: bool = False  # a new-process decision applied in this return
    proved: StorageIdentity | None = None  # what that new process proved (None: nothing)
    new_process_adopted: bool = False
    kept: set = field(default_factory=set)  # ranks this return kept before any new process was seen

    def reset_return(self) -> None:
        self.outcomes, self.new_process_seen, self.judged_new = [], False, False
        self.proved, self.new_process_adopted, self.kept = None, False, set()


@dataclass(frozen=True, slots=True)
class Decision:
    keep: int  # tier bits re-adopted (made visible again); the others are dropped
    outcome: Outcome | None  # None: nothing was at stake (no storage tiers to adopt, fresh engine)
    why: str = ""


def decide(
    old_storage: StorageIdentity | None,
    new_storage: StorageIdentity | None,
    *,
    same_shape: bool = True,
    storage_claimed_by_other: bool = False,
    cap_reached: bool = False,
    from_start: bool = True,
) -> Decision:
    """What to re-adopt of a returning engine that is a new process: a new incarnation, or the same
    one whose event stream shows a restart (Kubernetes keeps a pod's UID across container restarts;
    static workers have no incarnation). Whatever lived in its memory is gone; its storage may have
    survived. (The same process is judged by its stream alone: ``KVPlane._probe``.)

    ``old_storage``: the identity it proved when it last settled, under which the blocks we hold
    were kept. ``same_shape``: DP size and topic unchanged. ``storage_claimed_by_other``: another
    live engine reports the same storage id (a copied disk). ``from_start``: its event stream could
    be followed from its first batch (its replay buffer still reaches sequence 0); else what it
    evicted from its storage before we subscribed is unknowable, and adopting would risk routing on
    blocks it no longer has."""
    if not same_shape:
        return Decision(0, Outcome.REJECTED, "shape changed")
    if cap_reached:
        return Decision(0, Outcome.REJECTED, "adoption cap")
    if old_storage is None:
        return Decision(0, None, "no storage identity")
    if new_storage is None or new_storage.storage_id != old_storage.storage_id or storage_claimed_by_other:
        return Decision(0, Outcome.IDENTITY_MISMATCH, "storage identity differs")
    if new_storage.epoch != old_storage.epoch:
        return Decision(0, Outcome.EPOCH_MISMATCH, "storage epoch moved")
    if not from_start:
        return Decision(0, Outcome.REJECTED, "its new stream cannot be followed from its start")
    return Decision(STORAGE_TIERS, Outcome.SUCCESS, "same storage identity and epoch")


class AdoptionCap:
    """At most ``cap`` adoptions per storage identity (or engine, when it has none) per ``window_s``."""

    def __init__(self, cap: int, window_s: float) -> None:
        self.cap = cap
        self.window_s = window_s
        self._seen: dict[str, deque[float]] = {}

    def reached(self, key: str, now: float) -> bool:
        q = self._seen.get(key)
        if q is None:
            return False
        while q and q[0] <= now - self.window_s:
            q.popleft()
        return self.cap > 0 and len(q) >= self.cap

    def uses(self, key: str) -> int:
        return len(self._seen.get(key, ()))

    def record(self, key: str, now: float) -> None:
        self._seen.setdefault(key, deque()).append(now)


def parse_storage(info: dict) -> StorageIdentity | None:
    """The storage identity an engine's /server_info reports (``storage_id``, ``storage_epoch``), or
    None when it reports none (or a malformed one)."""
    sid, epoch = info.get("storage_id"), info.get("storage_epoch")
    if not isinstance(sid, str) or not sid or isinstance(epoch, bool) or not isinstance(epoch, int):
        return None
    return StorageIdentity(sid, epoch)


class AdoptionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_kv_"
        self.carriers = Gauge(
            p + "carriers", "Carriers (engine ranks) by state", ["state"], registry=registry
        )
        self.attempts = Counter(
            p + "adoption_attempts",
            "Re-adoptions of a returning engine, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.grace_expirations = Counter(
            p + "grace_expirations",
            "Disconnected engines removed when their grace window passed",
            registry=registry,
        )
        self.disconnect_window = Histogram(
            p + "disconnect_window_seconds",
            "How long an engine was disconnected before it returned or expired",
            registry=registry,
            buckets=(0.1, 0.5, 1, 5, 15, 60, 180, 600, 1800),
        )
        for o in Outcome:
            self.attempts.labels(o.value)
        for s in CarrierState:
            self.carriers.labels(s.value)
