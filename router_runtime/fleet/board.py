"""The fleet load board: the latest report from each sibling and the latest read of each engine, and the
combined per-target view the policies read (``view.fleet_load``).

Updates (a report arrives, an engine is read) recompute what the other sources add, once; a decision
then costs two dict lookups per target on top of the replica's own live count. The precomputed part
also expires on its own (the first contributing report to age out), so a sibling that died drops out
of the view within ``Bounds.peer_max_age_s`` even when nothing else happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from ..scheduling.types import Shared, Target
from .gossip import PeerReport, PredictionPacker, ReportOutcome, encode_report
from .inflight import LoadTracker
from .saturation import SaturationLimits, saturated
from .view import AtRead, Bounds, EngineSample, LoadKey, Remote, TargetReport, fleet_load, key, remote

MAX_SENDERS = 1024  # sibling processes held at once (a fleet is far smaller; a restart adds one)


class FleetLoadView(Mapping[Target, float]):
    """What policies get as ``loads``: a live read-only mapping of target -> fleet load."""

    __slots__ = ("_board",)

    def __init__(self, board: LoadBoard) -> None:
        self._board = board

    def get(self, t: Target, default: float = 0) -> float:  # type: ignore[override]
        b = self._board
        r = b.remote()
        k = key(t)
        return fleet_load(b.own.get(t), r.peers.get(k, 0), r.engines.get(k, 0.0))

    def __getitem__(self, t: Target) -> float:
        return self.get(t)

    def __iter__(self) -> Iterator[Target]:
        return iter(self._board.targets())

    def __len__(self) -> int:
        return len(self._board.targets())


class LoadBoard:
    def __init__(
        self,
        own: LoadTracker,
        targets: Callable[[], Sequence[Target]],
        *,
        replica: str,
        incarnation: str,
        bounds: Bounds | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.own = own
        self.targets = targets
        self.replica = replica
        self.incarnation = incarnation
        self.bounds = bounds or Bounds()
        self.clock = clock
        # (replica, incarnation) -> (received at, its latest report)
        self._peers: dict[tuple[str, str], tuple[float, PeerReport]] = {}
        # engine -> (its latest read, what the routers knew per target while it was read)
        self._samples: dict[str, tuple[EngineSample, AtRead]] = {}
        # engine -> per target, as its read began: (own in flight, own dispatched ever, siblings')
        self._reading: dict[str, dict[LoadKey, tuple[int, int, int]]] = {}
        self._remote = Remote({}, {}, 0.0)  # expired: computed on first read
        self._seq = 0
        self._packer = PredictionPacker()
        self.view = FleetLoadView(self)

    # ---- sources -------------------------------------------------------------------------------

    def accept(self, report: PeerReport) -> ReportOutcome:
        if report.replica == self.replica and report.incarnation == self.incarnation:
            return ReportOutcome.SELF  # listed as our own peer (no POD_NAME): never count ourselves twice
        # Keyed per sender process: a restarted sibling is a new sender, and its old entry ages out.
        sender = (report.replica, report.incarnation)
        held = self._peers.get(sender)
        if held is not None and report.seq <= held[1].seq:
            return ReportOutcome.STALE
        if held is None and len(self._peers) >= MAX_SENDERS:
            self._drop_aged(self.clock())
            if len(self._peers) >= MAX_SENDERS:
                return ReportOutcome.REJECTED  # a flood of "new processes": bounded, never a leak
        self._peers[sender] = (self.clock(), report)
        self._remote = Remote({}, {}, 0.0)
        return ReportOutcome.ACCEPTED

    def engine_read_started(self, engine: str) -> None:
        own, peers = self.own, self.remote().claimed
        self._reading[engine] = {
            key(t): (own.get(t), own.started(t), peers.get(key(t), 0))
            for t in self.targets()
            if t.engine == engine
        }

    def engine_read(self, engine: str, sample: EngineSample | None) -> None:
        """The latest read of an engine; None (a failed read) leaves the last good one to age out.
        The engine rendered its page somewhere between the read's start and end, so what the routers
        knew is taken as an upper bound over that window: our in flight at the start plus every
        request we dispatched since (including ones already finished), and the siblings' larger
        figure. Requests of ours can then never look like someone else's."""
        before = self._reading.pop(engine, {})
        if sample is not None:
            own, peers = self.own, self.remote().claimed
            known: dict[LoadKey, int] = {}
            ours: dict[LoadKey, int] = {}
            theirs: dict[LoadKey, int] = {}
            for t in self.targets():
                if t.engine != engine:
                    continue
                k = key(t)
                inflight, started, sibs = before.get(k, (own.get(t), own.started(t), peers.get(k, 0)))
                dispatched = own.started(t) - started  # ours sent during the read
                # Ours at least, as the siblings' room is measured: in flight at the end, less any
                # that started during the read (at most that many may have missed the engine's page).
                ours[k] = max(0, own.get(t) - dispatched)
                theirs[k] = min(sibs, peers.get(k, 0))
                known[k] = inflight + dispatched + max(sibs, peers.get(k, 0))
            self._samples[engine] = (sample, AtRead(known, ours, theirs))
            self._remote = Remote({}, {}, 0.0)

    def forget_engines(self, keep: set[str]) -> None:
        for engine in set(self._samples) - keep:
            del self._samples[engine]
        for engine in set(self._reading) - keep:
            del self._reading[engine]

    # ---- reads ---------------------------------------------------------------------------------

    def remote(self) -> Remote:
        r = self._remote
        now = self.clock()
        if now >= r.valid_until:
            by_engine: dict[str, list[Target]] = {}
            for t in self.targets():
                by_engine.setdefault(t.engine, []).append(t)
            peers = {name: (at, rep.targets) for name, (at, rep) in self._peers.items()}
            r = self._remote = remote(peers, self._samples, by_engine, now, self.bounds)
            self._drop_aged(now)
        return r

    def saturated(self, targets: Sequence[Target], limits: SaturationLimits) -> bool:
        """Whether none of ``targets`` has room by its engine's latest read (saturation.py)."""
        samples = {engine: sample for engine, (sample, *_) in self._samples.items()}
        return saturated(targets, samples, self.clock(), self.bounds.engine_max_age_s, limits)

    def _drop_aged(self, now: float) -> None:
        """Forget the senders whose latest report aged out: a departed sibling costs nothing more."""
        for sender, (at, _) in list(self._peers.items()):
            if now - at > self.bounds.peer_max_age_s:
                del self._peers[sender]

    def fresh_peers(self) -> int:
        now = self.clock()
        return sum(1 for at, _ in self._peers.values() if now - at <= self.bounds.peer_max_age_s)

    def report(self, shared: Shared | None = None) -> bytes:
        """This replica's report for its siblings: its in-flight count and prompt tokens per target, and
        what its plugins share."""
        self._seq += 1
        own = self.own
        targets = [
            TargetReport(t.engine, t.rank, n, own.prompt_tokens(t))
            # By engine, then rank (a whole engine's None first: both may be in flight when its
            # data-parallel size changed, and None does not compare with a number).
            for t, n in sorted(
                own.view.items(),
                key=lambda item: (item[0].engine, item[0].rank is not None, item[0].rank or 0),
            )
        ]
        return encode_report(
            self.replica, self.incarnation, self._seq, targets, shared or Shared(), self._packer
        )

    def describe(self, targets: Sequence[Target]) -> dict[str, int | list]:
        """For a trace's schedule span: each candidate's load by source, and how many siblings' reports
        are fresh (0: this replica decides on its own counts and the engines' alone)."""
        r, own = self.remote(), self.own
        mine, peers, unseen = [], [], []
        for t in targets:
            k = key(t)
            mine.append(own.get(t))
            peers.append(r.peers.get(k, 0))
            unseen.append(float(r.engines.get(k, 0.0)))
        return {
            "routerfleet.load.fresh_peers": self.fresh_peers(),
            "routerfleet.candidates.load.own": mine,
            "routerfleet.candidates.load.peers": peers,
            "routerfleet.candidates.load.unseen": unseen,
        }

    def summary(self) -> dict:
        """For /debug/load: each target's load by source (never prompts or hashes)."""
        r = self.remote()
        now = self.clock()
        out = []
        for t in sorted(self.targets()):
            k = key(t)
            out.append(
                {
                    "engine": t.engine,
                    "rank": t.rank,
                    "own": self.own.get(t),
                    "peers": r.peers.get(k, 0),
                    "unseen": r.engines.get(k, 0.0),
                    "discounted": r.discounted.get(k, 0),
                    "load": self.view.get(t),
                }
            )
        samples = {
            e: {"age_s": round(now - s.at, 3), "queue": {str(k): v.queue for k, v in s.ranks.items()}}
            for e, (s, *_) in self._samples.items()
        }
        peers = [
            {
                "replica": rep.replica,
                "incarnation": rep.incarnation,
                "age_s": round(now - at, 3),
                "seq": rep.seq,
            }
            for at, rep in self._peers.values()
        ]
        return {"targets": out, "engines": samples, "peers": peers}
