"""Engine health: a circuit breaker per engine (functional core) and the active checker (thin shell).

Breaker, per engine::

    CLOSED --K consecutive failures--> OPEN --cooldown elapsed--> HALF_OPEN --success--> CLOSED
                                          ^                           |
                                          +---------failure-----------+

A failure is a connect error or a timeout (of a health check or a proxied request), or a health
check's 5xx. An engine's 5xx to a client's own request is not: any client could send requests that
fail, and open every breaker with them. Any other answer is a success. An OPEN engine is not a
candidate for requests; a HALF_OPEN one is again (its next outcome, a health check's or a request's,
decides). Outcomes that arrive while the breaker is OPEN and cooling down (requests that were in
flight when it opened) are ignored, so the cooldown is never cut short or extended by stale news.

Time is passed in (``now``), so the state machine is tested without a clock.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from ..flags import Count, Flag, Ms
from ..http_body import STATUS_ONLY, read_capped
from ..scheduling.hooks import Exchange, ResponseWatch

log = logging.getLogger(__name__)


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failures: int = 3  # consecutive failures that open the breaker
    cooldown_s: float = 5.0  # time OPEN before a trial (HALF_OPEN)

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError("failures must be at least 1")
        if self.cooldown_s < 0:
            raise ValueError("cooldown_s must not be negative")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Engine health (``RouterConfig.health``): active checks, and the breaker request outcomes drive."""

    interval_s: float = 5.0  # 0: no active checks (request outcomes still drive the breakers)
    timeout_s: float = 2.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)


FLAGS = (
    Flag(
        "--health-interval-ms",
        "health.interval_s",
        Ms(0),
        "GET /health on every engine this often",
        zero="no active checks",
    ),
    Flag("--health-timeout-ms", "health.timeout_s", Ms(1), "one health check"),
    Flag(
        "--breaker-failures",
        "health.breaker.failures",
        Count(1),
        "consecutive failures (connect errors, 5xx) that take an engine out",
    ),
    Flag(
        "--breaker-cooldown-ms",
        "health.breaker.cooldown_s",
        Ms(0),
        "time an engine stays out before it is tried again",
    ),
)


class Breaker:
    __slots__ = ("_opened_at", "_state", "config", "consecutive_failures")

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self.consecutive_failures = 0

    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.config.cooldown_s:
            return BreakerState.HALF_OPEN
        return self._state

    def available(self, now: float) -> bool:
        return self.state(now) is not BreakerState.OPEN

    def reopens_at(self) -> float:
        """When an OPEN breaker turns HALF_OPEN (inf when it is not OPEN)."""
        return self._opened_at + self.config.cooldown_s if self._state is BreakerState.OPEN else math.inf

    def success(self, now: float) -> BreakerState | None:
        """Record a success; returns the new state when it changed."""
        state = self.state(now)
        if state is BreakerState.OPEN:
            return None
        self.consecutive_failures = 0
        if state is BreakerState.HALF_OPEN:
            self._state = BreakerState.CLOSED
            return BreakerState.CLOSED
        return None

    def failure(self, now: float) -> BreakerState | None:
        state = self.state(now)
        if state is BreakerState.OPEN:
            return None
        self.consecutive_failures += 1
        if state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.config.failures:
            self._state = BreakerState.OPEN
            self._opened_at = now
            return BreakerState.OPEN
        return None


class HealthBoard:
    """The breakers of the current engine set. ``version`` changes whenever the set of available
    engines may have changed, except the time-driven OPEN -> HALF_OPEN step, which happens at
    ``next_change()``: a caller caching ``available`` engines recomputes at either."""

    def __init__(
        self,
        config: BreakerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[str, BreakerState], None] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.on_transition = on_transition
        self._breakers: dict[str, Breaker] = {}
        self.version = 0

    def sync(self, engines: Iterable[str]) -> None:
        """Keep breakers for exactly ``engines``: new ones start CLOSED, gone ones are forgotten."""
        want = set(engines)
        for gone in self._breakers.keys() - want:
            del self._breakers[gone]
        for new in want - self._breakers.keys():
            self._breakers[new] = Breaker(self.config)
        self.version += 1

    def _record(self, engine: str, ok: bool) -> None:
        breaker = self._breakers.get(engine)
        if breaker is None:  # an engine that left discovery while its request ran
            return
        changed = breaker.success(self.clock()) if ok else breaker.failure(self.clock())
        if changed is not None:
            self.version += 1
            log.info("engine %s: circuit breaker %s", engine, changed)
            if self.on_transition:
                self.on_transition(engine, changed)

    def success(self, engine: str) -> None:
        self._record(engine, True)

    def failure(self, engine: str) -> None:
        self._record(engine, False)

    def available(self, engine: str) -> bool:
        breaker = self._breakers.get(engine)
        return breaker is not None and breaker.available(self.clock())

    def state(self, engine: str) -> BreakerState | None:
        breaker = self._breakers.get(engine)
        return breaker.state(self.clock()) if breaker else None

    def states(self) -> dict[str, BreakerState]:
        now = self.clock()
        return {e: b.state(now) for e, b in self._breakers.items()}

    def next_change(self) -> float:
        return min((b.reopens_at() for b in self._breakers.values()), default=math.inf)

    def should_probe(self, engine: str) -> bool:
        """An OPEN breaker waits out its cooldown unprobed; every other engine is probed."""
        return self.state(engine) is not BreakerState.OPEN


class HealthChecker:
    """Every ``interval_s``: ``GET {url}/health`` on each engine (concurrently), outcomes to the board."""

    def __init__(
        self,
        board: HealthBoard,
        session_fn: Callable[[], aiohttp.ClientSession],
        engines_fn: Callable[[], dict[str, str]],
        *,
        interval_s: float,
        timeout_s: float,
        path: str = "/health",
    ) -> None:
        self.board = board
        self.session_fn = session_fn
        self.engines_fn = engines_fn
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.path = path
        self.rounds = 0

    async def probe(self, engine: str, url: str) -> bool:
        try:
            async with self.session_fn().get(url + self.path, timeout=self.timeout) as r:
                await read_capped(r.content, STATUS_ONLY)
                ok = r.status < 500
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        self.board.success(engine) if ok else self.board.failure(engine)
        return ok

    async def check_once(self) -> None:
        probes = [
            self.probe(engine, url)
            for engine, url in self.engines_fn().items()
            if self.board.should_probe(engine)
        ]
        if probes:
            await asyncio.gather(*probes)
        self.rounds += 1

    async def run(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # one bad round must not end the checker
                log.exception("health check round failed")
            await asyncio.sleep(self.interval_s)


class AnswerProvesUp:
    """The request hook: an engine that answers below 500 is up. Its 5xx to one client's request proves
    nothing about the engine (the request itself may be what fails), and counting it would let any
    client open every breaker: only connect failures, timeouts and health checks count against it."""

    name = "health"

    def __init__(self, board: HealthBoard) -> None:
        self.board = board

    def pre_request(self, exchange: Exchange) -> ResponseWatch:
        return _Answered(self.board, exchange.target.engine)


class _Answered(ResponseWatch):
    def __init__(self, board: HealthBoard, engine: str) -> None:
        self.board, self.engine = board, engine

    def response_received(self, status: int, headers) -> None:
        if status < 500:
            self.board.success(self.engine)
