"""Export the index as flat columns, and graft such columns back, a chunk at a time.

The export is a list of node records where every parent precedes its children and is referenced by
record index (never by hash): ``parent[i] < i``, -1 for a chain's first block. A record with no
carriers is structure only (the parent of records that have some). Each record carries its block key
and its carriers, each with its tier bits and its engine hash (future removals and parent
links arrive as engine hashes, so a graft without them could never be corrected by the live stream).

Both passes run on the index writer and stop every ``budget`` records so live events keep flowing.
The result is therefore a point-in-time aggregate, not one instant; that is safe because the caller
reads the per-rank cursors BEFORE the walk starts, and the consumer re-applies every batch after the
cursor (stores and removals are idempotent), so anything the walk saw change after the cursor is
corrected by the consumer's own stream.

Trust: the graft takes columns that the bootstrap plane's vetting produced; it never sees wire data.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from .index import ROOT, Carrier, RadixIndex


@dataclass(slots=True)
class Columns:
    """Node records as parallel arrays. Carriers are flattened: record ``i`` owns carrier entries
    ``[start[i], start[i] + ncar[i])`` of ``worker``/``tiers``/``hash``, with ``start`` the running
    sum of ``ncar``."""

    parent: array = field(default_factory=lambda: array("q"))
    key: array = field(default_factory=lambda: array("Q"))
    ncar: array = field(default_factory=lambda: array("H"))
    worker: array = field(default_factory=lambda: array("I"))  # index into the worker table
    tiers: array = field(default_factory=lambda: array("B"))
    hash: array = field(default_factory=lambda: array("Q"))

    def __len__(self) -> int:
        return len(self.key)


class Exporter:
    """Walks an index into ``Columns`` a chunk at a time (``step``), carrier by identity: the worker
    table is built as carriers are met, so a carrier id reused mid-walk can never be misattributed."""

    def __init__(self, index: RadixIndex, include: Callable[[Carrier], bool] | None = None) -> None:
        self._index = index
        self._order = index._order  # our own reference: a compaction swaps in a new list
        self._end = len(self._order)  # nodes created after the walk starts are after the cursors
        self._pos = 0
        self._include = include or (lambda _c: True)
        self._index_of: dict[int, int] = {}
        self.columns = Columns()
        self.workers: list[Carrier] = []
        self._worker_idx: dict[Carrier, int] = {}

    @property
    def done(self) -> bool:
        return self._pos >= self._end

    def step(self, budget: int = 4096) -> bool:
        """Export up to ``budget`` more entries of the creation order; True when the walk is done."""
        idx = self._index
        carriers_of, parents = idx._carriers_of, idx._parent
        index_of = self._index_of
        stop = min(self._pos + budget, self._end)
        for key in self._order[self._pos : stop]:
            if key in index_of or key not in carriers_of:
                continue
            chain = [key]
            p = parents[key]
            while p != ROOT and p not in index_of and p in carriers_of:
                chain.append(p)
                p = parents[p]
            if p == ROOT:
                pidx = -1
            elif p in index_of:
                pidx = index_of[p]
            else:
                # The chain hangs under a block nobody holds now. It is unreachable today, but a later
                # event may store that block again and make it reachable, so the chain is sent under a
                # carrier-less placeholder that only names the missing block's key.
                pidx = self._placeholder(p)
            for k in reversed(chain):
                pidx = self._emit(k, pidx)
        self._pos = stop
        return self.done

    def _placeholder(self, key: int) -> int:
        cols = self.columns
        i = self._index_of[key] = len(cols.key)
        cols.parent.append(-1)  # its own parent is unknown; it is never created, only referenced
        cols.key.append(key)
        cols.ncar.append(0)
        return i

    def _emit(self, key: int, pidx: int) -> int:
        cols = self.columns
        i = len(cols.key)
        self._index_of[key] = i
        cols.parent.append(pidx)
        cols.key.append(key)
        # The reader visibility predicate: a DISCONNECTED carrier (or tier) is never exported.
        c = self._index._carriers_of[key] & self._index._visible
        by_cid = self._index._by_cid
        n = 0
        while c:
            low = c & -c
            cid = (low.bit_length() - 1) >> 2
            shift = cid * 4
            nib = (c >> shift) & 0xF
            c &= ~(0xF << shift)
            st = by_cid[cid]
            if st is None or not self._include(st.carrier):
                continue
            w = self._worker_idx.get(st.carrier)
            if w is None:
                w = self._worker_idx[st.carrier] = len(self.workers)
                self.workers.append(st.carrier)
            cols.worker.append(w)
            cols.tiers.append(nib)
            cols.hash.append(st.hash_of[key])
            n += 1
        cols.ncar.append(n)
        return i


class Grafter:
    """Applies vetted ``Columns`` onto a live index a chunk at a time: absent nodes are created, present
    ones get the carriers unioned in. ``carriers[w]`` is the local carrier for worker ``w`` (already
    resolved by vetting), or None to skip that worker's entries; ``admit(carrier)`` is asked per
    chunk, so a rank that stopped pending (a restart, a removal) is never grafted."""

    def __init__(
        self,
        index: RadixIndex,
        columns: Columns,
        carriers: list[Carrier | None],
        admit: Callable[[Carrier], bool] | None = None,
    ) -> None:
        self._index = index
        self._cols = columns
        self._carriers = carriers
        self._admit = admit or (lambda _c: True)
        self._pos = 0
        self._car = 0  # running start of the current record's carrier entries
        self.blocks = 0  # tier bits newly held

    @property
    def done(self) -> bool:
        return self._pos >= len(self._cols.key)

    def step(self, budget: int = 4096) -> bool:
        idx, cols = self._index, self._cols
        admitted = {c: idx._state(c) for c in set(self._carriers) if c is not None and self._admit(c)}
        keys, parents, ncar = cols.key, cols.parent, cols.ncar
        stop = min(self._pos + budget, len(keys))
        car = self._car
        for i in range(self._pos, stop):
            n = ncar[i]
            if n:
                key = keys[i]
                p = parents[i]
                pkey = ROOT if p < 0 else keys[p]
                for j in range(car, car + n):
                    carrier = self._carriers[cols.worker[j]]
                    st = admitted.get(carrier) if carrier is not None else None
                    if st is not None:
                        self.blocks += idx._hold(st, key, pkey, cols.tiers[j], cols.hash[j])
            car += n
        self._pos, self._car = stop, car
        return self.done
