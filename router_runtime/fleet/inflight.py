"""This replica's own in-flight count per target: the part of the fleet load it measures itself.

``acquire`` when a request is dispatched to a target, ``release`` exactly once when its response is
finished, whatever the ending (success, upstream error, timeout, client gone). A target with nothing
in flight is absent (read as 0), so the mapping stays as small as the live load.
The prompt tokens in flight per target and a change hook (``on_change``) are for the siblings' view
(``fleet/``); the policies read the fleet's combined load, not this one alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from ..scheduling.types import Target


class LoadTracker:
    __slots__ = ("_by_engine", "_counts", "_started", "_tokens", "_total", "on_change", "view")

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._counts: dict[Target, int] = {}
        self._tokens: dict[Target, int] = {}
        self._started: dict[Target, int] = {}  # requests ever acquired per target (never shrinks)
        self._by_engine: dict[str, int] = {}
        self._total = 0
        self.on_change = on_change  # each acquire and release (the gossip's wake-up)
        # A live read-only view, built once: what policies get as ``loads``.
        self.view: Mapping[Target, int] = MappingProxyType(self._counts)

    def acquire(self, target: Target, tokens: int = 0) -> int:
        """Count one more request (of ``tokens`` prompt tokens) on ``target``; returns the engine's new
        in-flight count."""
        counts = self._counts
        counts[target] = counts.get(target, 0) + 1
        self._started[target] = self._started.get(target, 0) + 1
        if tokens:
            self._tokens[target] = self._tokens.get(target, 0) + tokens
        n = self._by_engine.get(target.engine, 0) + 1
        self._by_engine[target.engine] = n
        self._total += 1
        if self.on_change is not None:
            self.on_change()
        return n

    def release(self, target: Target, tokens: int = 0) -> int:
        """One request on ``target`` finished; returns the engine's new in-flight count. Releasing what
        was never acquired is a bug and raises (never a silent negative load)."""
        n = self._counts.get(target, 0)
        if n <= 0:
            raise RuntimeError(f"release of {target} without a matching acquire")
        if n == 1:
            del self._counts[target]
            self._tokens.pop(target, None)
        else:
            self._counts[target] = n - 1
            if tokens:
                self._tokens[target] = max(0, self._tokens.get(target, 0) - tokens)
        e = self._by_engine[target.engine] - 1
        if e:
            self._by_engine[target.engine] = e
        else:
            del self._by_engine[target.engine]
        self._total -= 1
        if self.on_change is not None:
            self.on_change()
        return e

    def get(self, target: Target) -> int:
        return self._counts.get(target, 0)

    def started(self, target: Target) -> int:
        """Requests ever dispatched to ``target``."""
        return self._started.get(target, 0)

    def prompt_tokens(self, target: Target) -> int:
        return self._tokens.get(target, 0)

    def engine(self, engine: str) -> int:
        return self._by_engine.get(engine, 0)

    @property
    def total(self) -> int:
        return self._total

    def engines(self) -> dict[str, int]:
        return dict(self._by_engine)
