"""The router's own in-flight count per target: the load the policies see.

``acquire`` when a request is dispatched to a target, ``release`` exactly once when its response is
finished, whatever the ending (success, upstream error, timeout, client gone). A target with nothing
in flight is absent (policies read missing as 0), so the mapping stays as small as the live load.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ..routing.types import Target


class LoadTracker:
    __slots__ = ("_by_engine", "_counts", "_total", "view")

    def __init__(self) -> None:
        self._counts: dict[Target, int] = {}
        self._by_engine: dict[str, int] = {}
        self._total = 0
        # A live read-only view, built once: what policies get as ``loads``.
        self.view: Mapping[Target, int] = MappingProxyType(self._counts)

    def acquire(self, target: Target) -> int:
        """Count one more request on ``target``; returns the engine's new in-flight count."""
        counts = self._counts
        counts[target] = counts.get(target, 0) + 1
        n = self._by_engine.get(target.engine, 0) + 1
        self._by_engine[target.engine] = n
        self._total += 1
        return n

    def release(self, target: Target) -> int:
        """One request on ``target`` finished; returns the engine's new in-flight count. Releasing what
        was never acquired is a bug and raises (never a silent negative load)."""
        n = self._counts.get(target, 0)
        if n <= 0:
            raise RuntimeError(f"release of {target} without a matching acquire")
        if n == 1:
            del self._counts[target]
        else:
            self._counts[target] = n - 1
        e = self._by_engine[target.engine] - 1
        if e:
            self._by_engine[target.engine] = e
        else:
            del self._by_engine[target.engine]
        self._total -= 1
        return e

    def get(self, target: Target) -> int:
        return self._counts.get(target, 0)

    def engine(self, engine: str) -> int:
        return self._by_engine.get(engine, 0)

    @property
    def total(self) -> int:
        return self._total

    def engines(self) -> dict[str, int]:
        return dict(self._by_engine)
