"""The in-flight prefix scorer: what this router has sent where and is still in flight there.

A fan-out burst (one context sent N times at once: best-of-N, an agent's tool calls) reaches the router
before the first copy's engine has published a block, so the index credits nobody and the copies would
scatter, each engine prefilling the same prompt. After each decision with tokens (``pre_request``) the
request's reusable full blocks beyond what the index credited its target with (what the engine will
compute and store) are recorded there as a *prediction*; a later request is credited the predicted
blocks that continue its prefix beyond what the index confirms there, at ``weight`` of a device block
(below a confirmed one; above a slower tier, since the engine computes them into device memory), with
the evidence ``INFLIGHT`` (the decision's reason says so, and the audit counts its outcome apart:
proxy/audit.py).

A prediction lives as long as the request that made it (``request_ended``, which every front door calls
however the request ends): while it runs, the engine holds its prompt's blocks (they are in use, so
never evicted); once it has ended, the blocks it stored are the index's to report, and an eviction the
index sees afterwards is not papered over. ``ttl_s`` bounds a prediction whose end is never seen, and a
target that leaves discovery or restarts empty takes its predictions along (``remove_target``).
Predictions are not cache content: never in the index, never in a snapshot a sibling grafts.

Siblings share them (``shared`` and ``accept_peer``): each replica's load report carries its live
predictions (``fleet/gossip.py``: block keys and positions, never tokens), and a sibling's count here as
ours do until its next report replaces them or the report ages out. So the copies of a fan-out that a
Service spreads over the replicas meet on one engine too. A report's predictions are bounded in number
and size, and credit only the blocks a request itself has: a lying sibling can add at most ``weight`` of
a block for each block of the request's own prompt beyond what the index confirms.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from ..worker import Carrier
from .framework import Cycle, Evidence, Measure, Scores
from .reuse import reusable_tokens
from .siblings import Sender, Siblings
from .types import Decision, Prediction, RouteRequest, Shared, Target

MAX_PREDICTIONS = 1 << 14  # requests in flight with a prediction; past it the oldest is dropped
# What one replica shares (and a sibling's report may hold): the newest predictions first, up to both.
MAX_SHARED = 1024
MAX_SHARED_KEYS = 8192


class _Made:
    """One prediction: the keys of its prompt's blocks from ``start`` on (chained: equal keys at position
    i mean equal prefixes up to i; before ``start`` the index credited them)."""

    __slots__ = ("carrier", "decision", "expires", "keys", "shared", "start")

    def __init__(
        self, carrier: Carrier, start: int, keys: Sequence[int], expires: float, decision: Decision | None
    ) -> None:
        self.decision = decision  # ours: kept, so that its id stays its own while this lives
        self.carrier = carrier
        self.start = start
        self.keys = keys
        self.expires = expires
        self.shared: Prediction | None = None  # its wire shape, made once (reports go every few ms)

    def covers(self, keys: Sequence[int]) -> int:
        """How far this prediction runs along ``keys``: the end of their common prefix (found by
        bisection: chained keys agree up to some position, then never again), or 0 when that ends
        before the part it predicts."""
        mine, start = self.keys, self.start
        n = min(start + len(mine), len(keys))
        if n <= start or mine[0] != keys[start]:  # parts before its own: nothing to add
            return 0
        lo, hi = start + 1, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mine[mid - 1 - start] == keys[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        return lo


class InflightPrefix:
    name = "inflight_prefix"

    def __init__(
        self,
        *,
        weight: float = 0.9,
        ttl_s: float = 30.0,
        share: bool = True,
        max_predictions: int = MAX_PREDICTIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.weight = weight
        self.ttl_s = ttl_s
        self.share = share
        self.max_predictions = max_predictions
        self._clock = clock
        # id(decision) -> its prediction, oldest first (one TTL for all: insertion order is expiry order).
        self._made: dict[int, _Made] = {}
        self._by_carrier: dict[Carrier, dict[int, _Made]] = {}
        # Each sibling's latest predictions: carrier -> predictions there.
        self._peers: Siblings[dict[Carrier, list[_Made]]] = Siblings()
        self._shared: Shared | None = None  # what shared() said, until a prediction comes or goes
        # The last request's keys: score and pre_request see the same request, hashed once.
        self._keyed: tuple[RouteRequest, list[int]] | None = None

    def score(self, cycle: Cycle) -> Scores:
        request, index = cycle.request, cycle.index
        if index is None or not request.tokens or self.ttl_s <= 0:  # 0: no predictions, ours or theirs
            return Scores()
        self._expire(self._clock())
        targets = cycle.targets
        on = self._on(targets)
        if not on:
            return Scores()
        keys = self._keys(request, index)
        if not keys:
            return Scores()
        confirmed = index.match_keys(keys)
        beyond: dict[Target, int] = {}
        vouched = cycle.vouched  # its whole prefix credited already (prefix_cache.py): nothing beyond it
        for i, t in enumerate(targets):
            made = on.get(t.carrier)
            if made and i != vouched:
                m = confirmed.get(t.carrier)
                stored = m.blocks if m is not None else 0
                extra = _run(made, keys, stored) - stored
                if extra > 0:
                    beyond[t] = extra
        if not beyond:
            return Scores()
        w = self.weight
        return Scores(
            [-w * beyond.get(t, 0) for t in targets],
            [Evidence.INFLIGHT if t in beyond else Evidence.NONE for t in targets],
            lambda t: Measure(inflight_blocks=beyond.get(t, 0)),
        )

    def pre_request(self, cycle: Cycle, decision: Decision) -> None:
        request, index = cycle.request, cycle.index
        if index is None or not request.tokens or self.ttl_s <= 0:
            return
        # What the engine will compute and store: the blocks beyond those the index credited it with.
        keys = self._keys(request, index)
        if len(keys) <= decision.matched_blocks:
            return
        start = decision.matched_blocks
        made = _Made(decision.target.carrier, start, keys[start:], self._clock() + self.ttl_s, decision)
        self._made[id(decision)] = made
        self._by_carrier.setdefault(made.carrier, {})[id(decision)] = made
        self._shared = None
        while len(self._made) > self.max_predictions:
            self._end(next(iter(self._made)))

    def request_ended(self, decision: Decision) -> None:
        """The request ``decision`` sent has ended, however (its prediction, if it made one, ends)."""
        self._end(id(decision))

    def remove_target(self, target: Target) -> int:
        """Forget the predictions on a target that left discovery (or restarted empty); returns how
        many blocks they predicted."""
        c = target.carrier
        gone = list(self._by_carrier.pop(c, {}).values())
        for made in gone:
            self._made.pop(id(made.decision), None)
        if gone:
            self._shared = None
        theirs = [made for on in self._peers.parts() for made in on.pop(c, ())]
        if theirs:
            self._peers.changed()
        return _predicted(gone + theirs)

    def shared(self) -> Shared:
        """This replica's live predictions for its siblings, the newest first, as many as a report
        holds (none when sharing is off)."""
        if not self.share:
            return Shared()
        self._expire(self._clock())
        if self._shared is not None:
            return self._shared
        out: list[Prediction] = []
        keys = 0
        for made in reversed(self._made.values()):
            keys += len(made.keys)
            if len(out) == MAX_SHARED or keys > MAX_SHARED_KEYS:
                break
            if made.shared is None:
                made.shared = Prediction(made.carrier, made.start, made.keys)
            out.append(made.shared)
        self._shared = Shared(predictions=tuple(out))
        return self._shared

    def accept_peer(self, sender: Sender, shared: Shared, max_age_s: float) -> None:
        """A sibling's live predictions, vetted (fleet/gossip.py), replacing its last ones; they count
        for ``max_age_s`` unless a newer report replaces them first."""
        if not self.share:
            return
        until = self._clock() + max_age_s
        on: dict[Carrier, list[_Made]] = {}
        for p in shared.predictions:
            on.setdefault(p.carrier, []).append(_Made(p.carrier, p.start, p.keys, until, None))
        self._peers.put(sender, on, until)

    def predicted_blocks(self, carrier: Carrier) -> int:
        """Distinct blocks predicted on ``carrier`` by requests in flight there, ours and the siblings'
        (tests, debugging)."""
        self._expire(self._clock())
        return _predicted(self._on_carrier(carrier))

    def _end(self, made_id: int) -> None:
        made = self._made.pop(made_id, None)
        if made is None:
            return
        self._shared = None
        on = self._by_carrier.get(made.carrier)
        if on is not None:
            on.pop(made_id, None)
            if not on:
                del self._by_carrier[made.carrier]

    def _expire(self, now: float) -> None:
        made = self._made
        while made:
            first = next(iter(made))
            if made[first].expires > now:
                break
            self._end(first)
        self._peers.expire(now)

    def _on(self, targets: Sequence[Target]) -> dict[Carrier, list[_Made]]:
        """The predictions on each of ``targets``' carriers that has any, ours and the siblings'."""
        out: dict[Carrier, list[_Made]] = {}
        if not self._by_carrier and not self._peers:
            return out
        for t in targets:
            made = self._on_carrier(t.carrier)
            if made:
                out[t.carrier] = made
        return out

    def _on_carrier(self, carrier: Carrier) -> list[_Made]:
        own = self._by_carrier.get(carrier)
        made = list(own.values()) if own else []
        for on in self._peers.parts():
            made += on.get(carrier, ())
        return made

    def _keys(self, request: RouteRequest, index) -> list[int]:
        """The index's keys of the request's full reusable blocks (what the engine will store)."""
        keyed = self._keyed
        if keyed is not None and keyed[0] is request:
            return keyed[1]
        tokens = request.tokens or ()
        usable = reusable_tokens(len(tokens), request.logprobs_from)
        usable -= usable % index.block_size
        keys = (
            index.keys_for(tokens[:usable], lora_name=request.lora_name, cache_salt=request.cache_salt)
            if usable
            else []
        )
        self._keyed = (request, keys)
        return keys


def in_one_report(*parts: Shared) -> Shared:
    """Several profiles' shares as one load report carries them: the predictions in the parts' order, as
    many as a report holds (a sibling refuses a report with more: fleet/gossip.py), the adapters by
    engine."""
    out: list[Prediction] = []
    keys = 0
    for p in (p for part in parts for p in part.predictions):
        keys += len(p.keys)
        if len(out) == MAX_SHARED or keys > MAX_SHARED_KEYS:
            break
        out.append(p)
    return Shared(tuple(out), {engine: names for part in parts for engine, names in part.adapters.items()})


def _run(made: Iterable[_Made], keys: Sequence[int], start: int) -> int:
    """Where the predicted run along ``keys`` from ``start`` ends: each prediction covers its own part
    of its prompt ([its start, where its prompt and ``keys`` part)); parts that meet chain on."""
    end = start
    # In order of where they start, one pass: a part starting past the run's end cannot join it, nor
    # can any after it (sorted; many siblings' parts would otherwise take a pass each).
    for lo, hi in sorted((m.start, m.covers(keys)) for m in made):
        if lo > end:
            break
        end = max(end, hi)
    return end


def _predicted(made: Iterable[_Made]) -> int:
    return len({k for m in made for k in m.keys})
