"""The trust boundary: ``vet`` is the only way a peer's ``WireSnapshot`` becomes a ``VettedSnapshot``,
the only type the graft accepts.

Vetting rejects rather than repairs. A rejected snapshot leaves ranks cold, which is slow and visible;
a snapshot grafted on a hope can hide a missed removal as a permanent false cache hit, which is silent.
Every wire worker is resolved against the engines this replica discovered itself (identity AND
incarnation), so a peer can never introduce an engine we do not know; entries for other workers are
dropped, as are tier bits this build does not rank (dropped, never folded onto device).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import routerfleet_index

from ..kv.snapshot import Columns, VettedColumns
from ..worker import Carrier
from .state import SnapshotOutcome
from .wire import FORMATS, Limits, WireSession, WireSnapshot

KNOWN_TIERS = 0xF  # device, host, disk, external


class VetError(enum.StrEnum):
    UNKNOWN_FORMAT = "unknown_format"
    PRODUCER_COLD = "producer_cold"  # not ready: empty, unsettled or hashing not established
    HASHING_MISMATCH = "hashing_mismatch"  # another block size or key scheme
    INCONSISTENT = "inconsistent_columns"  # columns whose lengths do not fit together
    INVALID_PARENT = "invalid_parent"  # forward, self or out-of-range parent reference
    WORKER_OUT_OF_RANGE = "worker_out_of_range"
    TOO_DEEP = "too_deep"
    NOTHING_USABLE = "nothing_usable"  # no entry names a worker we know, in a tier we rank

    @property
    def cold_peer(self) -> bool:
        """The peer is fine but has nothing for us (counted apart from rejections)."""
        return self in (VetError.PRODUCER_COLD, VetError.NOTHING_USABLE)

    @property
    def outcome(self) -> SnapshotOutcome:
        if self.cold_peer:
            return SnapshotOutcome.COLD_PEER
        if self is VetError.HASHING_MISMATCH:
            return SnapshotOutcome.FOREIGN
        return SnapshotOutcome.REJECTED

    @property
    def explain(self) -> str:
        """The refusal in words (the causes in the operator's status quote it)."""
        return _EXPLAIN.get(self, self.value)


_EXPLAIN = {
    VetError.UNKNOWN_FORMAT: "unknown_format (a snapshot format this router does not read)",
    VetError.HASHING_MISMATCH: "hashing_mismatch (the peer uses another block size or key scheme)",
    VetError.INCONSISTENT: "inconsistent_columns (a corrupt tree)",
    VetError.INVALID_PARENT: "invalid_parent (a corrupt tree)",
    VetError.WORKER_OUT_OF_RANGE: "worker_out_of_range (a corrupt tree)",
    VetError.TOO_DEEP: "too_deep (a tree deeper than this router accepts)",
}


class VetFailed(Exception):
    def __init__(self, error: VetError) -> None:
        super().__init__(error.value)
        self.error = error


@dataclass(frozen=True, slots=True)
class HashingConfig:
    """What makes two routers' block keys comparable; read as one value."""

    block_size: int
    scheme: str


@dataclass(frozen=True, slots=True)
class LocalWorker:
    carrier: Carrier
    incarnation: str


_TOKEN = object()


class VettedSnapshot:
    """Columns whose every worker index resolves to a local carrier (or None: skip), with parents
    proven backward, tiers masked to known bits and cursors per local carrier. Built only by ``vet``."""

    __slots__ = ("built_ms", "carriers", "columns", "cursors", "producer_id", "usable_entries")

    def __init__(
        self,
        token: object,
        *,
        columns: VettedColumns,
        carriers: list[Carrier | None],
        cursors: dict[Carrier, int],
        built_ms: int,
        producer_id: str,
        usable_entries: int,
    ) -> None:
        if token is not _TOKEN:
            raise TypeError("VettedSnapshot is built only by vetting.vet()")
        self.columns = columns
        self.carriers = carriers
        self.cursors = cursors
        self.built_ms = built_ms
        self.producer_id = producer_id
        self.usable_entries = usable_entries


def vet(
    wire: WireSnapshot,
    local: Mapping[tuple[str, int], LocalWorker],
    hashing: HashingConfig,
    limits: Limits | None = None,
) -> VettedSnapshot:
    """Check a decoded snapshot against this replica's own view; raise ``VetFailed`` or return the
    only graftable form. ``local`` maps (engine, rank) to the carrier and incarnation we discovered.
    Consumes ``wire``: its columns are masked and remapped (by the core, with the GIL released)."""
    limits = limits or Limits()
    if wire.format not in FORMATS:
        raise VetFailed(VetError.UNKNOWN_FORMAT)
    if not wire.producer_ready:
        raise VetFailed(VetError.PRODUCER_COLD)
    if wire.block_size != hashing.block_size or wire.scheme != hashing.scheme:
        raise VetFailed(VetError.HASHING_MISMATCH)
    # Workers: resolve identity and incarnation; unknown ones map to None and are skipped. A worker
    # without a cursor is skipped too: nothing could prove our stream joins the snapshot for it.
    carriers: list[Carrier | None] = []
    for w in wire.workers:
        mine = local.get((w.engine, w.rank))
        carriers.append(mine.carrier if mine is not None and mine.incarnation == w.incarnation else None)
    cursors: dict[Carrier, int] = {}
    with_cursor = set()
    for w, seq in wire.cursors:
        c = carriers[w]
        if c is not None:
            cursors[c] = seq
            with_cursor.add(w)
    carriers = [c if i in with_cursor else None for i, c in enumerate(carriers)]
    usable, columns = _vet_columns(wire.columns, [c is not None for c in carriers], limits)
    if usable == 0:
        raise VetFailed(VetError.NOTHING_USABLE)
    carriers.append(None)  # the slot tierless entries point at
    return VettedSnapshot(
        _TOKEN,
        columns=columns,
        carriers=carriers,
        cursors=cursors,
        built_ms=wire.built_ms,
        producer_id=wire.producer_id,
        usable_entries=usable,
    )


def _vet_columns(columns: Columns, usable: list[bool], limits: Limits) -> tuple[int, VettedColumns]:
    """The column checks, in the core with the GIL released, one pass each: lengths that fit together,
    parents strictly backward and depth bounded, worker indices in range, tiers masked to known bits;
    an entry left with no tier is pointed one past the worker table (a slot that resolves to None), so
    it is never grafted as "held in no tier". Consumes ``columns``."""
    try:
        return routerfleet_index.vet_columns(columns, usable, KNOWN_TIERS, limits.max_depth)
    except routerfleet_index.ColumnsRefused as e:
        raise VetFailed(VetError(e.args[0])) from None


def vet_export(columns: Columns, workers: int, limits: Limits | None = None) -> VettedColumns:
    """An export of one of this replica's own indexes (a scratch index rebuilt from an engine's replay),
    through the same checks as a peer's, every worker usable: the graft takes nothing else. The
    returned columns name worker ``workers`` for a tierless entry: give the grafter one more carrier."""
    return _vet_columns(columns, [True] * workers, limits or Limits())[1]


def vet_sessions(sessions: Iterable[WireSession], incarnations: Mapping[str, str]) -> list[WireSession]:
    """A peer's session table, vetted like its tree: an entry naming an engine this replica did not
    discover itself, or another incarnation of it (a restarted engine: its cache is gone), is dropped.
    ``incarnations``: engine -> incarnation of every engine we know."""
    return [s for s in sessions if incarnations.get(s.engine) == s.incarnation]
