"""Request bodies being read and parsed, and the router-wide budget for them (``--body-budget-bytes``).

Each body is capped (``--max-body-bytes``) and so are connections, but not what all of them hold at
once, and a body costs more while it parses than its size: Python's JSON objects take up to ~31 bytes
per byte of the worst shapes (nested empty arrays). So each request holds a share of one budget: its
body's bytes as they arrive, then, before it parses, ``parse_cost`` (an upper bound), given back once
parsed. A share that does not fit waits up to ``WAIT_S`` for others to finish, then the request gets a
503 with ``Retry-After``; a body whose parse alone would exceed the whole budget gets a 413. Both front
doors (the proxy, the endpoint picker) hold their shares of one budget.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Executor, Future
from typing import Any

from .errors import ProxyError
from .request import parse_json

# Bytes of Python objects per JSON value, at most: measured with tracemalloc on bodies of 200,000 of
# one value each, 64 for two-character strings, 52 for [[]], 38 for {}, 34 for [], 10 for small ints.
PER_VALUE = 64
# And per object member, at most: its key string, the dict's slot and the decoder's memo entry for the
# key (measured as above: 137 for one-member objects of unique 8-character keys).
PER_MEMBER = 160
PER_BODY = 4096  # and the parser's own, whatever the body (~2 KiB measured)
WAIT_S = 1.0  # a share that does not fit waits this long for others before its 503


def parse_cost(raw: bytes) -> int:
    """An upper bound on what parsing ``raw`` holds (tests/test_proxy_units.py measures it): its bytes;
    the text they decode to and the strings parsed from it, 2 bytes per byte when pure ASCII without
    escapes, 8 otherwise (one character outside the BMP makes a string 4 bytes a character);
    PER_VALUE per value (a body has at most one value more than its commas, brackets and braces);
    PER_MEMBER per object member (at most one per colon); and PER_BODY."""
    text = 2 if raw.isascii() and b"\\u" not in raw else 8
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
    return (1 + text) * len(raw) + PER_VALUE * values + PER_MEMBER * raw.count(b":") + PER_BODY


def over_budget(wait_s: float) -> ProxyError:
    return ProxyError(
        503,
        f"the router is reading and parsing as many request bodies as its memory budget allows, and"
        f" none finished within {wait_s:g}s; retry shortly",
        type_="service_unavailable",
        code="body_budget_exhausted",
        outcome="overloaded",
        headers={"Retry-After": "1"},
    )


def too_complex(cost: int, cap: int) -> ProxyError:
    return ProxyError(
        413,
        f"parsing this request body would hold about {cost >> 20} MiB, more than the router's whole body"
        f" budget ({cap >> 20} MiB)",
        code="request_too_large",
    )


class Bodies:
    """The bytes held by the bodies being read and parsed, against ``cap`` (0: no budget), and their
    parsing: inline when small, else on ``executor`` so the event loop stays free. One event loop."""

    def __init__(
        self,
        cap: int,
        *,
        wait_s: float = WAIT_S,
        executor: Executor | None = None,
        inline_max_bytes: int = 256 << 10,
    ) -> None:
        if cap < 0:
            raise ValueError("a body budget is positive, or 0 for none")
        self.cap, self.wait_s = cap, wait_s
        self.executor, self.inline_max_bytes = executor, inline_max_bytes
        self.held = 0
        self._freed = asyncio.Event()  # set, and replaced, whenever a share is given back

    def share(self) -> Share:
        """A request's share, empty at first: ``async with`` it, or ``release`` it once done."""
        return Share(self)

    async def parse(self, share: Share, raw: bytes) -> Any:
        """``raw`` parsed (``parse_json``'s 400s), ``share`` holding its parse's upper bound first."""
        if self.cap:
            await share.grow_to(parse_cost(raw))
        if self.executor is None or len(raw) <= self.inline_max_bytes:
            return parse_json(raw)
        running = self.executor.submit(parse_json, raw)
        try:
            return await asyncio.wrap_future(running)
        except asyncio.CancelledError:  # the client went; the thread parses on, holding its memory
            share.held_by(running)
            raise

    def _give_back(self, n: int) -> None:
        self.held -= n
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()


class Share:
    """One request's part of the budget; it grows, and is given back whole."""

    def __init__(self, bodies: Bodies) -> None:
        self.bodies, self.size = bodies, 0
        self._parsing: Future | None = None  # a parse its request left running on a thread

    async def __aenter__(self) -> Share:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def held_by(self, parsing: Future) -> None:
        """``parsing`` holds this share's memory until it ends, whenever the request ends: the share is
        given back then."""
        self._parsing = parsing
        loop = asyncio.get_running_loop()

        def ended(_: Future) -> None:  # on the parsing thread
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to give back to
                loop.call_soon_threadsafe(self._give_back)

        parsing.add_done_callback(ended)

    def release(self) -> None:
        """Given back, now or (a parse left running) when that parse ends; again: nothing."""
        if self._parsing is None or self._parsing.done():
            self._give_back()

    def _give_back(self) -> None:
        if self.size:
            self.bodies._give_back(self.size)
            self.size = 0

    def grow_now(self, n: int) -> bool:
        """``grow_to`` when it needs no wait: True once the share holds ``n`` bytes (or there is no
        budget), False if others must give theirs back first; a 413 if ``n`` alone exceeds the budget."""
        b = self.bodies
        if not b.cap or n <= self.size:
            return True
        if n > b.cap:
            raise too_complex(n, b.cap)
        need = n - self.size
        if b.held + need > b.cap:
            return False
        b.held += need
        self.size = n
        return True

    async def grow_to(self, n: int) -> None:
        """Hold ``n`` bytes in all: at once if they fit, else after others give theirs back (a 503
        if that takes longer than the budget's wait, a 413 if ``n`` alone exceeds it)."""
        if self.grow_now(n):
            return
        b = self.bodies
        try:
            async with asyncio.timeout(b.wait_s):
                while not self.grow_now(n):
                    await b._freed.wait()
        except TimeoutError:
            raise over_budget(b.wait_s) from None
