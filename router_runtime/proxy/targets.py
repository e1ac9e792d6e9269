"""The candidate targets: the current workers' targets, less the engines whose breaker is open.

A KV policy targets each (engine, rank) of a worker with ``dp_size > 1`` (each rank has its own cache;
the rank is pinned with ``X-Data-Parallel-Rank``) and the engine itself otherwise; other policies
target whole engines (``rank=None``) and let the engine balance its ranks. The candidate tuple is
cached until the worker set or a breaker changes, so a request pays one comparison for it.

In a disaggregated fleet (docs/disaggregation.md) the candidates are the engines that answer clients
(decode and whole engines); prefill engines are offered apart (``prefill_candidates``), to the step
that asks one for a remote prefill.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..scheduling.types import Target
from ..worker import Role, WorkerSpec
from .health import HealthBoard


def worker_targets(spec: WorkerSpec, per_rank: bool) -> tuple[Target, ...]:
    if per_rank and spec.dp_size > 1:
        return tuple(Target(spec.engine, spec.url, r) for r in range(spec.dp_size))
    return (Target(spec.engine, spec.url),)


class TargetBook:
    def __init__(self, board: HealthBoard, *, per_rank: bool) -> None:
        self.board = board
        self.per_rank = per_rank
        self._by_engine: dict[str, tuple[Target, ...]] = {}
        self._urls: dict[str, str] = {}
        self._roles: dict[str, Role] = {}
        self._prefill: frozenset[str] = frozenset()  # engines that only prefill
        self._revisions: dict[str, str] = {}
        self._bootstrap: dict[str, int] = {}
        self._cache: tuple[Target, ...] = ()
        self._prefill_cache: tuple[Target, ...] = ()
        self._cache_version = -1
        self._cache_until = 0.0

    def set_workers(self, specs: Iterable[WorkerSpec]) -> None:
        specs = sorted(specs, key=lambda s: s.engine)
        self._by_engine = {s.engine: worker_targets(s, self.per_rank) for s in specs}
        self._urls = {s.engine: s.url for s in specs}
        self._roles = {s.engine: s.role for s in specs}
        self._prefill = frozenset(e for e, r in self._roles.items() if r is Role.PREFILL)
        self._revisions = {s.engine: s.revision for s in specs}
        self._bootstrap = {s.engine: s.bootstrap_port for s in specs if s.bootstrap_port is not None}
        self.board.sync(self._by_engine)  # bumps the board's version: the cache is stale

    def all_targets(self) -> set[Target]:
        """Every known target, healthy or not."""
        return {t for ts in self._by_engine.values() for t in ts}

    @property
    def urls(self) -> dict[str, str]:
        """engine -> base URL of every known engine, healthy or not."""
        return self._urls

    @property
    def disaggregated(self) -> bool:
        """Whether discovery names any engine's role (prefill or decode, healthy or not): a
        disaggregated fleet, even while none of its prefill engines is listed."""
        return any(r is not Role.BOTH for r in self._roles.values())

    def role(self, engine: str) -> Role:
        return self._roles.get(engine, Role.BOTH)

    def revision(self, engine: str) -> str:
        return self._revisions.get(engine, "")

    def bootstrap_port(self, engine: str) -> int | None:
        return self._bootstrap.get(engine)

    def candidates(self) -> tuple[Target, ...]:
        """The healthy targets that answer clients (every engine but the prefill-only ones)."""
        self._refresh()
        return self._cache

    def prefill_candidates(self) -> tuple[Target, ...]:
        """The healthy prefill engines' targets."""
        self._refresh()
        return self._prefill_cache

    def _refresh(self) -> None:
        board = self.board
        if board.version != self._cache_version or board.clock() >= self._cache_until:
            available = [(e, ts) for e, ts in self._by_engine.items() if board.available(e)]
            self._cache = tuple(t for e, ts in available if e not in self._prefill for t in ts)
            self._prefill_cache = tuple(t for e, ts in available if e in self._prefill for t in ts)
            self._cache_version = board.version
            self._cache_until = board.next_change()
