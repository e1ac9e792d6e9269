"""Export the index as flat columns, and graft such columns back, a chunk at a time.

The export is a list of node records where every parent precedes its children and is referenced by
record index (never by hash): ``parent[i] < i``, -1 for a chain's first block. A record with no
carriers is structure only (the parent of records that have some). Each record carries its block key
and its carriers, each with its tier bits and its engine hash (future removals and parent
links arrive as engine hashes, so a graft without them could never be corrected by the live stream).

Both walks are native (``native/src/snapshot.rs``) and run on the index writer, stopping every
``budget`` records so live events keep flowing. The result is therefore a point-in-time aggregate,
not one instant; that is safe because the caller reads the per-rank cursors BEFORE the walk starts,
and the consumer re-applies every batch after the cursor (stores and removals are idempotent), so
anything the walk saw change after the cursor is corrected by the consumer's own stream.

Trust: the graft takes columns that the bootstrap plane's vetting produced; it never sees wire data.
"""

from __future__ import annotations

from collections.abc import Callable

import routerfleet_index

from ..worker import Carrier
from .index import RadixIndex

# Node records as parallel columns, held by the core: record ``i`` owns carrier entries
# ``[start[i], start[i] + ncar[i])`` of worker/tiers/hash, ``start`` being the running sum of ``ncar``.
# ``Columns.from_le(parent, key, ncar, worker, tiers, hash)`` builds them from little-endian bytes
# (i64, u64, u16, u32, u8, u64) and ``.le()`` gives those bytes back. Not trusted: only vetting's
# ``routerfleet_index.vet_columns`` turns them into ``VettedColumns``, the one thing a graft takes.
Columns = routerfleet_index.Columns
VettedColumns = routerfleet_index.VettedColumns


class Exporter:
    """Walks an index into ``Columns`` a chunk at a time (``step``), carrier by identity: the worker
    table is built as carriers are met, so a carrier id reused mid-walk can never be misattributed.
    ``include(carrier)`` is asked once per chunk for every carrier of the index."""

    def __init__(self, index: RadixIndex, include: Callable[[Carrier], bool] | None = None) -> None:
        self._index = index
        self._native = routerfleet_index.Exporter(index.native)
        self._include = include or (lambda _c: True)
        self._columns: Columns | None = None

    @property
    def done(self) -> bool:
        return self._native.done

    def step(self, budget: int = 4096) -> bool:
        """Export up to ``budget`` more slots of the index; True when the walk is done."""
        idx = self._index
        include = [idx.cid(c) for c in idx.carriers if self._include(c)]
        return self._native.step(idx.native, budget, include)

    @property
    def columns(self) -> Columns:
        """The export, once the walk is done (taken from the walk once; vetting consumes it)."""
        if self._columns is None:
            if not self.done:
                raise RuntimeError("the export is not done")
            self._columns = self._native.take_columns()
        return self._columns

    @property
    def workers(self) -> list[Carrier]:
        return [Carrier(engine, rank) for engine, rank in self._native.workers]


class Grafter:
    """Applies ``VettedColumns`` onto a live index a chunk at a time: absent nodes are created, present
    ones get the carriers unioned in. ``carriers[w]`` is the local carrier for worker ``w`` (already
    resolved by vetting), or None to skip that worker's entries; ``admit(carrier)`` is asked per
    chunk, so a rank that stopped pending (a restart, a removal) is never grafted. Takes the columns:
    build it off the loop (it counts them)."""

    def __init__(
        self,
        index: RadixIndex,
        columns: VettedColumns,
        carriers: list[Carrier | None],
        admit: Callable[[Carrier], bool] | None = None,
    ) -> None:
        self._index = index
        self._carriers = carriers
        self._admit = admit or (lambda _c: True)
        self._native = routerfleet_index.Grafter(columns)

    @property
    def done(self) -> bool:
        return self._native.done

    @property
    def blocks(self) -> int:
        """Tier bits newly held."""
        return self._native.blocks

    def step(self, budget: int = 4096) -> bool:
        idx = self._index
        admitted = {c: idx.cid(c) for c in set(self._carriers) if c is not None and self._admit(c)}
        carrier_of = [admitted.get(c) if c is not None else None for c in self._carriers]
        return self._native.step(idx.native, budget, carrier_of)
