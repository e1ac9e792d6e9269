"""The scheduler framework: a profile of one-method plugins makes each routing decision.

    candidates -> filters (each keeps some) -> scorers (each a cost per candidate, in blocks, summed)
               -> picker (one target and the reason) -> pre-request hooks (the decision is final)
    ... the request runs ...                              -> request-ended hooks (``Profile.ended``)

The shape is the Gateway API Inference Extension's endpoint picker (Filter, Scorer, Picker, PreRequest;
per-request state in a ``Cycle``), with two things kept from ours: a decision carries its ``Reason``, and
scores are one additive cost in blocks (a cached block credits -1 at device weight, one in-flight
request costs ``load_cost_tokens / block_size``) rather than scores normalised to [0, 1]. A scorer also
says which candidates hold the request's prefix (``Evidence``): the picker's reason comes from that.

Everything here is a pure function of (request, candidates, loads, index) plus the plugins' own state
(a round-robin cursor, a text tree), so profiles are unit-tested without I/O; the proxy (and the
endpoint picker) are shells around ``Profile.choose``. The presets are in ``presets.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol, runtime_checkable

from ..kv.index import CarrierMatch, RadixIndex
from ..worker import Carrier
from .reuse import reusable_tokens
from .siblings import Sender
from .types import Adapters, Candidate, Decision, Reason, RouteRequest, Shared, Target


@dataclass(frozen=True, slots=True)
class Cycle:
    """One decision's inputs, as every plugin sees them: the candidates left by the filters, their
    loads (the fleet's in-flight requests, parallel to ``targets``), and where the returning session's
    remembered target is among them (``prefer``; None: no session, or it is not a candidate)."""

    request: RouteRequest
    targets: Sequence[Target]
    loads: Sequence[float]
    index: RadixIndex | None
    prefer: int | None
    # prefix_matches' answer, once computed
    _matched: list[tuple[int, Mapping[Carrier, CarrierMatch]]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @property
    def vouched(self) -> int | None:
        """Where the returning session's remembered target is, when its whole prefix is credited beyond
        what the index shows (``RouteRequest.prefer_vouched``); never a rank whose credit is withheld
        (kv/withhold.py: its blocks are in doubt)."""
        p, index = self.prefer, self.index
        if p is None or not self.request.prefer_vouched:
            return None
        if index is not None and self.targets[p].carrier in index.withheld:
            return None
        return p

    def prefix_matches(self) -> tuple[int, Mapping[Carrier, CarrierMatch]]:
        """The request's reusable prefix in full blocks (reuse.py: what an engine would serve from its
        cache), and what the index matches of it per carrier: computed once per decision, for every
        scorer that reads it. Needs the index and the request's tokens."""
        if not self._matched:
            request, index = self.request, self.index
            assert index is not None and request.tokens, "prefix_matches needs an index and tokens"
            usable = reusable_tokens(len(request.tokens), request.logprobs_from)
            total = usable // index.block_size
            matches = {}
            if total:
                tokens = request.tokens[:usable]
                matches = index.match(tokens, lora_name=request.lora_name, cache_salt=request.cache_salt)
            self._matched.append((total, matches))
        return self._matched[0]

    @classmethod
    def of(
        cls,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, float],
        index: RadixIndex | None,
    ) -> Cycle:
        get = loads.get
        prefer = request.prefer
        p = next((i for i, t in enumerate(targets) if t == prefer), None) if prefer is not None else None
        return cls(request, targets, [get(t, 0) for t in targets], index, p)


class Evidence(enum.IntEnum):
    """Why a candidate is believed to hold the request's prefix (the stronger of two scorers' wins)."""

    NONE = 0
    SESSION = 1  # only the returning session's memory puts it there
    INFLIGHT = 2  # only a request this router just sent there (inflight_prefix.py): not stored yet
    CACHED = 3  # the index (or the text tree) shows some of it there


@dataclass(frozen=True, slots=True)
class Measure:
    """What a decision reports of the chosen target's prefix (the audit and metrics read it)."""

    matched_blocks: int = 0
    total_blocks: int = 0
    tier_blocks: tuple[int, int, int, int] = (0, 0, 0, 0)  # device, host, disk, external
    matched_chars: int = 0
    total_chars: int = 0
    inflight_blocks: int = 0  # predicted by a request just sent there, beyond what the index confirms


@dataclass(frozen=True, slots=True)
class Scores:
    """One scorer's view of the candidates. ``costs``: per candidate, in blocks (negative: a credit),
    None when it has nothing to say (all equal). ``evidence``: who holds the prefix (None: nobody).
    ``measure``: what the decision reports if that target is chosen."""

    costs: Sequence[float] | None = None
    evidence: Sequence[Evidence] | None = None
    measure: Callable[[Target], Measure] | None = None


@dataclass(frozen=True, slots=True)
class Scored:
    """The scorers' views combined, as the picker sees them: costs summed (rounded, so that equal
    mixes tie exactly despite float sums) and evidence merged; None where no scorer spoke."""

    costs: Sequence[float] | None
    evidence: Sequence[Evidence] | None


@dataclass(frozen=True, slots=True)
class Choice:
    index: int  # into Cycle.targets
    reason: Reason


class Filter(Protocol):
    name: str
    # A filter that narrows the candidates to one by rule (a pin) makes the decision, with this reason;
    # None: it only narrows (or reorders).
    decides: Reason | None

    def filter(self, cycle: Cycle) -> Sequence[Target]:
        """The candidates to keep, in the order the rest should see them: ``cycle.targets`` itself when
        unchanged; empty when none may take the request (``Unschedulable``)."""
        ...


class Unschedulable(Exception):
    """No candidate may take the request: ``filter`` (its name) left none."""

    def __init__(self, filter_name: str) -> None:
        super().__init__(f"the {filter_name} filter left no candidate")
        self.filter = filter_name


class Scorer(Protocol):
    name: str

    def score(self, cycle: Cycle) -> Scores: ...


class Picker(Protocol):
    name: str

    def pick(self, cycle: Cycle, scored: Scored) -> Choice: ...


@runtime_checkable
class PreRequest(Protocol):
    """A plugin told the decision before the request is sent (a text tree records what went where)."""

    def pre_request(self, cycle: Cycle, decision: Decision) -> None: ...


@runtime_checkable
class RequestEnded(Protocol):
    """A plugin told that the request a decision sent has ended, however it ended (each front door
    calls ``Profile.ended`` once per dispatched decision)."""

    def request_ended(self, decision: Decision) -> None: ...


@runtime_checkable
class SharesWithSiblings(Protocol):
    """A plugin whose knowledge travels to the siblings with the load report (``fleet/gossip.py``), and
    that counts theirs: its part of ``Shared``."""

    def shared(self) -> Shared: ...

    def accept_peer(self, sender: Sender, shared: Shared, max_age_s: float) -> None: ...


@runtime_checkable
class WatchesAdapters(Protocol):
    """A plugin told each engine's latest report of its LoRA adapters (``lora_affinity.py``)."""

    def adapters_read(self, engine: str, adapters: Adapters | None) -> None: ...


@runtime_checkable
class KeepsTargetState(Protocol):
    """A plugin that keeps something per target, forgotten when the target leaves discovery or restarts
    empty; returns how much it held."""

    def remove_target(self, target: Target) -> int: ...


_ROUND = 6  # decimal places of a summed cost: equal tier mixes tie exactly


class Profile:
    """A named list of plugins: the scheduler one ``--policy`` runs. ``needs_tokens``/``needs_text``:
    whether the proxy must tokenize a text request, or render a chat request's prompt text, for it."""

    def __init__(
        self,
        name: str,
        *,
        picker: Picker,
        filters: Sequence[Filter] = (),
        scorers: Sequence[Scorer] = (),
        needs_tokens: bool = False,
        needs_text: bool = False,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self.needs_tokens = needs_tokens
        self.needs_text = needs_text
        plugins = (*self.filters, *self.scorers, picker)
        self._pre_request = tuple(p for p in plugins if isinstance(p, PreRequest))
        self._ended = tuple(p for p in plugins if isinstance(p, RequestEnded))
        self._stateful = tuple(p for p in plugins if isinstance(p, KeepsTargetState))
        self._sharing = tuple(p for p in plugins if isinstance(p, SharesWithSiblings))
        self._adapters = tuple(p for p in plugins if isinstance(p, WatchesAdapters))

    def choose(
        self,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, float],
        index: RadixIndex | None,
        *,
        explain: bool = False,
    ) -> Decision:
        """Pick one of ``targets`` (never empty). ``loads``: in-flight requests per target (missing =
        0). Never mutates the index; plugins may update their own state. Raises ``Unschedulable`` when
        a filter leaves no candidate. ``explain``: the decision lists every candidate the picker weighed
        (``Decision.candidates``), for a trace."""
        cycle = Cycle.of(request, targets, loads, index)
        for f in self.filters:
            kept = f.filter(cycle)
            if kept is cycle.targets:
                continue
            if not kept:
                raise Unschedulable(f.name)
            if f.decides is not None and len(kept) == 1:
                return Decision(kept[0], f.decides)
            cycle = Cycle.of(request, kept, loads, index)
        views = [s.score(cycle) for s in self.scorers]
        scored = _combined(views, len(cycle.targets))
        choice = self.picker.pick(cycle, scored)
        target = cycle.targets[choice.index]
        measures = [v.measure for v in views if v.measure is not None]
        measure = partial(_measured, measures) if measures else None
        m = measure(target) if measure is not None else _NO_MEASURE
        decision = Decision(
            target,
            choice.reason,
            m.matched_blocks,
            m.total_blocks,
            m.tier_blocks,
            m.matched_chars,
            m.total_chars,
            m.inflight_blocks,
            _explained(cycle, scored, measure, choice.index, m) if explain else (),
        )
        for hook in self._pre_request:
            hook.pre_request(cycle, decision)
        return decision

    def ended(self, decision: Decision) -> None:
        """The request ``decision`` sent has ended (answered, failed, cut or never connected)."""
        for plugin in self._ended:
            plugin.request_ended(decision)

    def remove_target(self, target: Target) -> int:
        """Forget what the plugins keep about a target that left discovery (or restarted empty)."""
        return sum(p.remove_target(target) for p in self._stateful)

    def adapters_read(self, engine: str, adapters: Adapters | None) -> None:
        """An engine's latest report of its LoRA adapters (None: it reports none)."""
        for plugin in self._adapters:
            plugin.adapters_read(engine, adapters)

    def shared(self) -> Shared:
        """What this replica's plugins tell its siblings (the load report carries it)."""
        parts = [plugin.shared() for plugin in self._sharing]
        if len(parts) == 1:
            return parts[0]
        return Shared(
            tuple(p for part in parts for p in part.predictions),
            {engine: names for part in parts for engine, names in part.adapters.items()},
        )

    def accept_peer(self, sender: Sender, shared: Shared, max_age_s: float) -> None:
        """A sibling's ``Shared``, vetted, replacing its last one for ``max_age_s`` at most."""
        for plugin in self._sharing:
            plugin.accept_peer(sender, shared, max_age_s)


_NO_MEASURE = Measure()


def _measured(measures: Sequence[Callable[[Target], Measure]], target: Target) -> Measure:
    """What the scorers report of ``target``: the first one's prefix, and any in-flight prediction."""
    m = measures[0](target)
    for other in measures[1:]:
        inflight = other(target).inflight_blocks
        if inflight:
            m = replace(m, inflight_blocks=inflight)
    return m


def _explained(
    cycle: Cycle, scored: Scored, measure: Callable[[Target], Measure] | None, chosen: int, measured: Measure
) -> tuple[Candidate, ...]:
    """Every candidate's standing; the chosen one's ``measured`` already (measuring is not free)."""
    out = []
    costs, loads = scored.costs, cycle.loads
    for i, t in enumerate(cycle.targets):
        m = measured if i == chosen or measure is None else measure(t)
        out.append(
            Candidate(t, loads[i], costs[i] if costs is not None else None, m.matched_blocks, m.tier_blocks)
        )
    return tuple(out)


def _combined(views: Sequence[Scores], n: int) -> Scored:
    columns = [v.costs for v in views if v.costs is not None]
    costs = None
    if len(columns) == 1:
        costs = [round(c, _ROUND) for c in columns[0]]
    elif columns:
        costs = [round(sum(col[i] for col in columns), _ROUND) for i in range(n)]
    said = [v.evidence for v in views if v.evidence is not None]
    evidence = said[0] if len(said) == 1 else [max(e[i] for e in said) for i in range(n)] if said else None
    return Scored(costs, evidence)
