"""The LoRA affinity scorer: send a request for an adapter where that adapter is already loaded.

An engine holds a few adapters on the device at once (vLLM's ``--max-loras``); a request for one that
is not there waits for it to load, and evicts another. What this router knows of each engine's
adapters, freshest first:

- the engine's own report (``vllm:lora_requests_info``, read with its load: ``fleet/engine_metrics.py``):
  adapters with requests running or waiting there, out of how many slots;
- the requests this router has in flight there (``pre_request`` / ``request_ended``): their adapters
  are loaded while they run;
- the last few adapters this router sent there (as many as the engine has slots; 4 when it does not
  say): the engine evicts the least recently used, so those are likely still loaded; and the same of
  each sibling, from its load reports (``shared``/``accept_peer``, ``fleet/gossip.py``).

A target whose engine has the adapter by any of these costs nothing; one with a free slot (slots
beyond those its latest report and the fleet's recent requests account for) costs a load; one without
costs two (a load that evicts an adapter likely wanted again, or waits); one whose engine says nothing
of its adapters costs one. A load weighs as much as prefilling ``load_cost_tokens``, in blocks as every
kv_aware cost (one additive cost). Among engines that would load it at equal cost, every replica
prefers the same one (``_home``), so the siblings place a new adapter alike without telling each other.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping

import xxhash

from .framework import Cycle, Scores
from .siblings import Sender, Siblings
from .types import Adapters, Decision, Shared, Target

DEFAULT_SLOTS = 4  # assumed where the engine does not report its slots
MAX_ENGINES = 4096  # engines remembered (each entry is small); past it the oldest goes
MAX_INFLIGHT = 1 << 14  # requests in flight with an adapter
MAX_ADAPTERS_SHARED = 16  # adapters per engine a replica remembers sending, and tells its siblings


class LoraAffinity:
    name = "lora_affinity"

    def __init__(
        self,
        *,
        load_cost_tokens: float = 1024.0,
        max_age_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.load_cost_tokens = load_cost_tokens
        self.max_age_s = max_age_s  # an engine's report counts this long
        self._clock = clock
        self._reports: dict[str, tuple[float, Adapters]] = {}
        self._inflight: dict[str, Counter[str]] = {}  # engine -> adapter -> our requests running there
        self._sent: dict[int, tuple[Decision, str]] = {}  # id(decision) -> it (kept: its id stays its own)
        self._recent: dict[str, OrderedDict[str, None]] = {}  # engine -> adapters we sent, newest last
        # Each sibling's: engine -> adapters it sent there, newest last; and their union per engine.
        self._peers: Siblings[Mapping[str, tuple[str, ...]]] = Siblings()
        self._peers_sent: tuple[int, dict[str, frozenset[str]]] = (-1, {})

    def score(self, cycle: Cycle) -> Scores:
        adapter, index = cycle.request.lora_name, cycle.index
        if adapter is None or index is None or self.load_cost_tokens <= 0:
            return Scores()
        load = self.load_cost_tokens / index.block_size
        now = self._clock()
        costs = []
        for t in cycle.targets:
            n = self._loads(t.engine, adapter, now)
            costs.append(load * n + _home(adapter, t.engine) if n else 0.0)
        return Scores(costs)

    def _loads(self, engine: str, adapter: str, now: float) -> int:
        """What sending ``adapter`` to ``engine`` costs, in adapter loads (0, 1 or 2)."""
        ours = self._recent.get(engine, ())
        theirs = self._peer_sent(now).get(engine, frozenset())
        if adapter in ours or adapter in theirs or adapter in self._inflight.get(engine, ()):
            return 0
        held = self._reports.get(engine)
        if held is None or now - held[0] > self.max_age_s:
            return 1
        report = held[1]
        if adapter in report.active:
            return 0
        # Slots held, as far as we know: what it reports active, and what the fleet sent there last.
        held_by = report.active.union(self._inflight.get(engine, ()), ours, theirs)
        return 1 if len(held_by) < report.max_loras else 2

    def _peer_sent(self, now: float) -> dict[str, frozenset[str]]:
        """engine -> the adapters the siblings sent there lately, rebuilt only when their reports change."""
        self._peers.expire(now)
        version, union = self._peers_sent
        if version != self._peers.version:
            merged: dict[str, set[str]] = {}
            for part in self._peers.parts():
                for engine, names in part.items():
                    merged.setdefault(engine, set()).update(names)
            union = {engine: frozenset(names) for engine, names in merged.items()}
            self._peers_sent = (self._peers.version, union)
        return union

    def pre_request(self, cycle: Cycle, decision: Decision) -> None:
        adapter = cycle.request.lora_name
        if adapter is None:
            return
        engine = decision.target.engine
        self._inflight.setdefault(engine, Counter())[adapter] += 1
        self._sent[id(decision)] = (decision, adapter)
        while len(self._sent) > MAX_INFLIGHT:  # ends never seen: bounded, the oldest forgotten
            self.request_ended(next(iter(self._sent.values()))[0])
        recent = self._recent.setdefault(engine, OrderedDict())
        recent[adapter] = None
        recent.move_to_end(adapter)
        held = self._reports.get(engine)
        slots = min(held[1].max_loras if held is not None else DEFAULT_SLOTS, MAX_ADAPTERS_SHARED)
        while len(recent) > slots:
            recent.popitem(last=False)
        while len(self._recent) > MAX_ENGINES:
            del self._recent[next(iter(self._recent))]

    def request_ended(self, decision: Decision) -> None:
        sent = self._sent.pop(id(decision), None)
        if sent is None:
            return
        engine = decision.target.engine
        running = self._inflight.get(engine)
        if running is not None:
            running[sent[1]] -= 1
            if running[sent[1]] <= 0:
                del running[sent[1]]
            if not running:
                del self._inflight[engine]

    def shared(self) -> Shared:
        """The adapters this router sent to each engine lately, for its siblings."""
        return Shared(adapters={engine: tuple(names) for engine, names in self._recent.items() if names})

    def accept_peer(self, sender: Sender, shared: Shared, max_age_s: float) -> None:
        """A sibling's, vetted (fleet/gossip.py), replacing its last; counted for ``max_age_s`` at most."""
        now = self._clock()
        self._peers.expire(now)
        self._peers.put(sender, shared.adapters, now + max_age_s)

    def adapters_read(self, engine: str, adapters: Adapters | None) -> None:
        """An engine's latest report of its adapters (None: it reports none, or the read failed)."""
        if adapters is None:
            self._reports.pop(engine, None)
            return
        self._reports[engine] = (self._clock(), adapters)
        while len(self._reports) > MAX_ENGINES:
            del self._reports[next(iter(self._reports))]

    def remove_target(self, target: Target) -> int:
        """Forget an engine that left discovery or restarted empty (its adapters went with it)."""
        engine = target.engine
        for key in [k for k, (d, _) in self._sent.items() if d.target.engine == engine]:
            del self._sent[key]
        self._recent.pop(engine, None)
        self._reports.pop(engine, None)
        return sum(self._inflight.pop(engine, Counter()).values())


def _home(adapter: str, engine: str) -> float:
    """A tie-break below any other cost difference, the same in every replica: where an adapter would
    be loaded, equal costs otherwise, is the engine with the lowest hash of (adapter, engine), so the
    siblings load it on one engine without telling each other (rendezvous hashing)."""
    return _TIE_BREAK * (xxhash.xxh3_64_intdigest(f"{adapter}\0{engine}".encode()) / 2**64)


_TIE_BREAK = 1e-3  # blocks: under the smallest difference of real costs, above the picker's rounding
