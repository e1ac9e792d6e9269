"""What the engines say about their own load: their Prometheus ``/metrics``, read per engine at a short
interval with a deadline.

The parser is pure and knows both dialects by name, so nothing needs configuring:

- vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (older
  releases: ``vllm:gpu_cache_usage_perc``), ``vllm:prompt_tokens_total``; a data-parallel deployment
  labels each rank's series ``engine="<rank>"``.
- SGLang: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
  ``sglang:prompt_tokens_total``; per-rank series carry ``dp_rank="<rank>"``.

LoRA adapters (vLLM only): ``vllm:lora_requests_info{max_lora, running_lora_adapters,
waiting_lora_adapters}``, whose value is the time it was set; earlier label sets stay on the page with
older times, so the newest one is the engine's state.

Only those lines are looked at (a real engine's page is mostly histograms), label values are read
without interpretation beyond the rank, and a page that has no running-requests series is an error,
not a zero load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from ..http_body import read_capped
from ..scheduling.types import Adapters
from .view import EngineSample, RankLoad

log = logging.getLogger(__name__)

# metric name -> RankLoad field
_FIELDS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "sglang:prompt_tokens_total": "prompt_tokens",
}
_RANK_LABELS = ("engine", "dp_rank")
_MAX_RANK = 1 << 16
_LORA_INFO = "vllm:lora_requests_info"
_MAX_ADAPTERS = 1024  # names in one list
_MAX_ADAPTER_NAME = 256


class MetricsUnreadable(ValueError):
    """The page has no running-requests series we know."""


def _labels(text: str) -> dict[str, str]:
    """``a="x",b="y"`` -> {a: x, b: y}; escaped quotes are kept escaped (only ranks are read)."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= n or text[eq + 1] != '"':
            break
        name = text[i:eq].strip().lstrip(",").strip()
        j = eq + 2
        while j < n and text[j] != '"':
            j += 2 if text[j] == "\\" else 1
        out[name] = text[eq + 2 : j]
        i = j + 1
    return out


def _rank(labels: Mapping[str, str]) -> int | None:
    for name in _RANK_LABELS:
        v = labels.get(name)
        if v is not None and v.isdigit() and int(v) < _MAX_RANK:
            return int(v)
    return None


def _adapter_names(text: str) -> frozenset[str] | None:
    names = [n for n in text.split(",") if n] if text else []
    if len(names) > _MAX_ADAPTERS or any(len(n) > _MAX_ADAPTER_NAME for n in names):
        return None
    return frozenset(names)


def _adapters(labels: Mapping[str, str]) -> Adapters | None:
    """One ``vllm:lora_requests_info`` label set, or None when it is not one we can trust."""
    slots = labels.get("max_lora", "")
    running = _adapter_names(labels.get("running_lora_adapters", ""))
    waiting = _adapter_names(labels.get("waiting_lora_adapters", ""))
    if not slots.isdigit() or not 0 < int(slots) <= _MAX_ADAPTERS or running is None or waiting is None:
        return None
    return Adapters(int(slots), running, waiting)


def parse_engine_load(text: str, at: float) -> EngineSample:
    """The engine's load per rank from its Prometheus text exposition."""
    acc: dict[int | None, dict[str, float]] = {}
    adapters: tuple[float, Adapters] | None = None  # the newest label set, with its time
    for line in text.splitlines():
        if not (line.startswith("vllm:") or line.startswith("sglang:")):
            continue
        if line.startswith(_LORA_INFO + "{"):
            close = line.rfind("}")
            parts = line[close + 1 :].split()
            try:
                when = float(parts[0]) if close > 0 and parts else math.nan
            except ValueError:
                continue
            state = _adapters(_labels(line[len(_LORA_INFO) + 1 : close]))
            if state is not None and math.isfinite(when) and (adapters is None or when > adapters[0]):
                adapters = (when, state)
            continue
        brace = line.find("{")
        if brace >= 0:
            close = line.rfind("}")
            if close < brace:
                continue
            name, labels, rest = line[:brace], _labels(line[brace + 1 : close]), line[close + 1 :]
        else:
            name, _, rest = line.partition(" ")
            labels = {}
        field = _FIELDS.get(name)
        if field is None:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        fields = acc.setdefault(_rank(labels), {})
        fields[field] = fields.get(field, 0.0) + value  # several models on one rank add up
    if not any("running" in f for f in acc.values()):
        raise MetricsUnreadable(
            "no running-requests series (vllm:num_requests_running, sglang:num_running_reqs)"
        )
    ranks = {
        rank: RankLoad(
            running=int(f.get("running", 0)),
            waiting=int(f.get("waiting", 0)),
            kv_usage=min(1.0, f["kv_usage"]) if "kv_usage" in f else None,
            prompt_tokens=f.get("prompt_tokens"),
        )
        for rank, f in acc.items()
    }
    return EngineSample(at, ranks, adapters[1] if adapters is not None else None)


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    interval_s: float = 0.2  # 0: off
    timeout_s: float = 0.5  # the deadline of one read
    max_bytes: int = 4 << 20
    # A replica reads at most this many pages a second in all: a large fleet stretches the interval
    # (a vLLM page is 50-200 KB to parse) instead of spending a core on it.
    max_reads_per_s: float = 50.0


class EngineLoadScraper:
    """Reads every engine's ``/metrics`` each interval, one task per engine: a stalled engine delays its
    own next read only. ``started(engine)`` as a read begins; results go to ``sink(engine, sample or
    None, outcome)`` (None: this read failed)."""

    def __init__(
        self,
        urls: Callable[[], Mapping[str, str]],
        started: Callable[[str], None],
        sink: Callable[[str, EngineSample | None, str], None],
        config: ScrapeConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.urls = urls
        self.started = started
        self.sink = sink
        self.config = config
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._reads: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        cfg = self.config
        # Its own small pool: load reads never take a connection the proxy would use.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=1, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
        )
        try:
            while True:
                urls = self.urls()
                for engine, task in list(self._reads.items()):
                    if engine not in urls:
                        task.cancel()
                        del self._reads[engine]
                for engine, url in urls.items():
                    task = self._reads.get(engine)
                    if task is None or task.done():
                        self._reads[engine] = asyncio.create_task(
                            self._read(engine, url), name=f"load-{engine}"
                        )
                await asyncio.sleep(max(cfg.interval_s, len(urls) / cfg.max_reads_per_s))
        finally:
            for task in self._reads.values():
                task.cancel()
            for task in self._reads.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._reads.clear()
            await self._session.close()

    async def _read(self, engine: str, url: str) -> None:
        assert self._session is not None
        self.started(engine)
        try:
            async with self._session.get(url + "/metrics") as r:
                if r.status != 200:
                    self.sink(engine, None, "error")
                    return
                body = await read_capped(r.content, self.config.max_bytes)
            if body is None:
                self.sink(engine, None, "too_large")
                return
            sample = parse_engine_load(body.decode("utf-8", "replace"), self.clock())
        except TimeoutError:
            self.sink(engine, None, "timeout")
        except MetricsUnreadable:
            self.sink(engine, None, "unreadable")
        except aiohttp.ClientError:
            self.sink(engine, None, "error")
        else:
            self.sink(engine, sample, "ok")
