"""Ranks whose credit is withheld: the index still holds their blocks, but no match credits them, so
requests route as if the rank were cold (and their predictions are doubtful) until the index is known
to follow the engine again.

Two ways in, each from this replica or told by a sibling:

* **The engine denied a credited prefix** (``FALSE_HIT``): the audit found it reported far fewer cached
  tokens than a prediction made in no doubt (``audit.denies``). Its cache changed behind the index's
  back (a reset announced only with its next step, as vLLM does; state lost without a word). The
  withhold ends on the engine's own account of what went: the first batch applied for the rank that
  cleared or removed blocks, or the rank cleared for any reason. (A batch that only stores proves
  nothing about what it lost.) Evidence applied after the denied prediction was made (vLLM announces
  its reset with the very step that served it, so it usually lands before the response does) proves
  it already: no withhold then.
* **A flush through the router** (``FLUSH``): withheld on every replica before the engines reset, so no
  request routes on the dropped blocks; ended by ``flushed`` once the engines have answered: the rank
  is cleared (it warms again from the engines' own events) and its credit given back after the clear.

Either way, a withhold not ended within its bound clears the rank and ends: cold, never wrong. The
writer is still the index's one writer; the withheld set is a read filter (``RadixIndex.withheld``)
set on the loop, so the very next match no longer credits the rank.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

from ..worker import Carrier
from .index import ApplyStats, RadixIndex
from .metrics import KVMetrics
from .writer import ClearReason, IndexWriter

log = logging.getLogger(__name__)


class WithholdReason(enum.StrEnum):
    FALSE_HIT = "false_hit"  # this replica's audit
    SIBLING_FALSE_HIT = "sibling_false_hit"  # a sibling's audit, told over the internal port
    FLUSH = "flush"  # a flush through this replica
    SIBLING_FLUSH = "sibling_flush"  # a flush through a sibling

    @property
    def ends_on_evidence(self) -> bool:
        return self in (WithholdReason.FALSE_HIT, WithholdReason.SIBLING_FALSE_HIT)


class WithholdEnd(enum.StrEnum):
    EVIDENCE = "evidence"  # a batch of the engine's cleared or removed blocks
    FLUSHED = "flushed"  # the flush's engines answered: cleared, then given back
    EXPIRED = "expired"  # nothing ended it in time: cleared
    REMOVED = "removed"  # the rank left


@dataclass(slots=True)
class _Withhold:
    reason: WithholdReason
    timer: asyncio.TimerHandle
    ending: WithholdEnd | None = None  # cleared, given back once the clear is applied


class Withholds:
    def __init__(self, index: RadixIndex, writer: IndexWriter, metrics: KVMetrics, *, bound_s: float) -> None:
        self.index = index
        self.writer = writer
        self.metrics = metrics
        self.bound_s = bound_s
        self._ranks: dict[Carrier, _Withhold] = {}
        self._evidence_at: dict[Carrier, float] = {}  # when the writer last applied evidence (monotonic)
        writer.on_applied = self._applied
        metrics.withheld.set_function(lambda: len(self._ranks))
        for r in WithholdReason:
            metrics.withholds.labels(r.value)
        for e in WithholdEnd:
            metrics.withhold_ends.labels(e.value)

    def __contains__(self, carrier: Carrier) -> bool:
        return carrier in self._ranks

    def withhold(self, carrier: Carrier, reason: WithholdReason, since: float | None = None) -> None:
        """From now on no match credits ``carrier``, unless evidence was applied after ``since`` (when
        the denied prediction was made, ``time.monotonic()``). A rank withheld already keeps its first
        bound; a flush overrides an audit's withhold (only the flush may end it)."""
        if since is not None and self._evidence_at.get(carrier, float("-inf")) > since:
            return
        old = self._ranks.get(carrier)
        if old is not None:
            if not (old.reason.ends_on_evidence and not reason.ends_on_evidence):
                return
            old.timer.cancel()
        timer = asyncio.get_running_loop().call_later(self.bound_s, self._expire, carrier)
        self._ranks[carrier] = _Withhold(reason, timer)
        self.index.withheld.add(carrier)
        self.metrics.withholds.labels(reason.value).inc()
        log.info("rank %s withheld: %s", carrier, reason.value)

    def flushed(self, carrier: Carrier) -> None:
        """The flush's engines have reset: clear the rank, and give its credit back once the clear is
        applied (whatever the writer applies after it is the engine's own new state). Cleared whether or
        not this replica withheld it for the flush (it may have missed that notice, or joined between
        the two): the engine's cache is gone either way; an audit's withhold ends on the clear."""
        w = self._ranks.get(carrier)
        if w is not None and not w.reason.ends_on_evidence:
            self._clear_and_end(carrier, ClearReason.FLUSH, WithholdEnd.FLUSHED)
        else:
            self.writer.submit_clear(carrier, ClearReason.FLUSH)

    def forget(self, carrier: Carrier) -> None:
        self._evidence_at.pop(carrier, None)
        if carrier in self._ranks:
            self._end(carrier, WithholdEnd.REMOVED)

    def stop(self) -> None:
        for w in self._ranks.values():
            w.timer.cancel()

    # ---- the writer's hook, and the bound --------------------------------------------------------

    def _applied(self, carrier: Carrier, stats: ApplyStats | None) -> None:
        """The writer applied a batch (``stats``) or cleared the rank (None)."""
        if stats is not None and not (stats.cleared or stats.removed):
            return
        self._evidence_at[carrier] = time.monotonic()
        w = self._ranks.get(carrier)
        if w is not None and w.reason.ends_on_evidence and w.ending is None:
            self._end(carrier, WithholdEnd.EVIDENCE)

    def _expire(self, carrier: Carrier) -> None:
        if carrier in self._ranks:
            self._clear_and_end(carrier, ClearReason.WITHHOLD_EXPIRED, WithholdEnd.EXPIRED)

    def _clear_and_end(self, carrier: Carrier, reason: ClearReason, how: WithholdEnd) -> None:
        w = self._ranks[carrier]
        w.timer.cancel()
        w.ending = how
        self.writer.submit_clear(carrier, reason)
        self.writer.call(lambda _index: self._end(carrier, how) if self._ranks.get(carrier) is w else None)

    def _end(self, carrier: Carrier, how: WithholdEnd) -> None:
        w = self._ranks.pop(carrier)
        w.timer.cancel()
        self.index.withheld.discard(carrier)
        self.metrics.withhold_ends.labels(how.value).inc()
        log.info("rank %s given its credit back: %s", carrier, how.value)
