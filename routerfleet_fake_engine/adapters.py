"""LoRA adapter slots, as vLLM keeps them on the device (``--max-loras``), simplified.

At most ``max_loras`` adapters are resident at once, least recently used first out. A request's adapter
must be resident while it runs: loading one that is not costs ``load_s`` and evicts the least recently
used adapter no running request uses; when every resident adapter is in use, the request waits. Its
state is what vLLM's ``vllm:lora_requests_info`` gauge shows (``metrics.py``): the adapters with running
requests, those with requests waiting, and ``max_lora``; ``loads`` counts the loads (what a router that
knows where adapters are spares).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator


class AdapterSlots:
    def __init__(self, max_loras: int, load_s: float) -> None:
        self.max_loras = max_loras
        self.load_s = load_s
        self.loads = 0
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter -> its running requests, LRU first
        self.waiting: Counter[str] = Counter()
        self._changed = asyncio.Condition()

    def running(self) -> list[str]:
        return [name for name, n in self.resident.items() if n]

    def _room(self, name: str) -> bool:
        resident = self.resident
        return name in resident or len(resident) < self.max_loras or any(n == 0 for n in resident.values())

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[None]:
        """Hold ``name`` resident while the request runs (loading it first if needed)."""
        resident = self.resident
        self.waiting[name] += 1
        try:
            async with self._changed:
                await self._changed.wait_for(lambda: self._room(name))
                load = name not in resident
                if load and len(resident) >= self.max_loras:
                    del resident[next(n for n, k in resident.items() if k == 0)]
                resident[name] = resident.get(name, 0) + 1  # in use from here: not evicted while it loads
                resident.move_to_end(name)
        finally:
            self.waiting[name] -= 1
            if not self.waiting[name]:
                del self.waiting[name]
        try:
            if load:
                self.loads += 1
                await asyncio.sleep(self.load_s)
            yield
        finally:
            resident[name] -= 1
            async with self._changed:
                self._changed.notify_all()
