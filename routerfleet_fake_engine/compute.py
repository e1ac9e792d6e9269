"""One rank's compute, when its requests share it (``--shared-compute``), as one accelerator's steps do.

By default every running request computes alone: a prefill is a timer of its own, and a decode emits its
tokens at the decode rate whatever else runs. That leaves out what disaggregation is for. With shared
compute, per rank:

- prefills run one at a time, in arrival order (an engine prefills so many tokens per second, however
  many prompts wait): two cold prompts at once take twice as long as one;
- a decode's next token waits while a prefill runs (the step that carries the prefill carries the
  decodes batched with it, and takes the prefill's time), so a long local prefill stalls every stream
  on the rank, where a remote prefill stalls none.

A KV transfer does not take compute (it runs beside the steps, as NIXL's does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator


class Compute:
    __slots__ = ("_idle", "_lock")

    def __init__(self) -> None:
        self._lock = asyncio.Lock()  # FIFO: prefills in arrival order
        self._idle = asyncio.Event()
        self._idle.set()

    async def prefill(self, seconds: float) -> None:
        """Prefill for ``seconds`` of the rank's compute, after the prefills that came before."""
        if seconds <= 0:
            return
        async with self._lock:
            self._idle.clear()
            try:
                await asyncio.sleep(seconds)
            finally:
                self._idle.set()

    async def stalled(self) -> float:
        """Wait until no prefill runs (a decode's next step); returns how long that was, in seconds."""
        if self._idle.is_set():
            return 0.0
        start = time.monotonic()
        await self._idle.wait()
        return time.monotonic() - start


class Alone:
    """The default: every request computes alone (a prefill is its own timer, a decode never waits)."""

    __slots__ = ()

    async def prefill(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    async def stalled(self) -> float:
        return 0.0


async def paced(tokens: int, rate: float, compute: Compute | Alone) -> AsyncIterator[int]:
    """Each of ``tokens`` output tokens' index once it is decoded, at ``rate`` per second (0: at once).
    With shared compute a token after the first (the prefill step's own) waits while the rank prefills,
    and the rest of the schedule moves with it."""
    start = time.monotonic()
    for i in range(tokens):
        if rate:
            wait = start + (i + 1) / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if i:
                start += await compute.stalled()
        yield i
