"""A fleet-wide cache flush through the router (``POST /internal/flush_cache``): every rank of the named
engines routes cold on this replica and, told first, on every sibling; then each engine resets its
own prefix cache (vLLM's ``/reset_prefix_cache``, SGLang's ``/flush_cache``); then every replica clears
those ranks and gives their credit back, and they warm again from the engines' own events
(``kv/withhold.py``). No request is routed on the flushed blocks from the moment the flush is
accepted, and an engine that refuses or cannot be reached is reported, never guessed at: its ranks
are cleared all the same (cold, never wrong)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

import aiohttp

from ..kv.plane import KVPlane
from ..kv.withhold import WithholdReason
from ..worker import WorkerSpec
from .notices import KvNotice, NoticeKind, Notices

# vLLM's path (served with VLLM_SERVER_DEV_MODE=1), then SGLang's.
RESET_PATHS = ("/reset_prefix_cache", "/flush_cache")
_BODY_BYTES = 512  # of an engine's answer, in ours


@dataclass(frozen=True, slots=True)
class EngineReset:
    engine: str
    path: str | None  # the reset path that answered (None: neither is served)
    status: int | None  # its HTTP status (None: no answer)
    body: str  # the start of its answer, or why there is none


@dataclass(frozen=True, slots=True)
class FlushResult:
    engines: tuple[EngineReset, ...]
    siblings_withheld: dict[str, str]  # peer URL -> outcome of the notice that cooled its ranks
    siblings_flushed: dict[str, str]

    def json(self) -> dict:
        return {
            "engines": [asdict(e) for e in self.engines],
            "siblings": {"withheld": self.siblings_withheld, "flushed": self.siblings_flushed},
        }


async def reset_engine(session: aiohttp.ClientSession, spec: WorkerSpec, timeout_s: float) -> EngineReset:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    for path in RESET_PATHS:
        try:
            async with session.post(spec.url + path, timeout=timeout) as r:
                body = (await r.content.read(_BODY_BYTES)).decode("utf-8", "replace")
        except TimeoutError:
            return EngineReset(spec.engine, path, None, f"no answer in {timeout_s:g}s")
        except aiohttp.ClientError as exc:
            return EngineReset(spec.engine, path, None, f"unreachable: {type(exc).__name__}")
        if r.status not in (404, 405):
            return EngineReset(spec.engine, path, r.status, body)
    return EngineReset(spec.engine, None, 404, "serves neither " + " nor ".join(RESET_PATHS))


async def flush(
    plane: KVPlane,
    engines: list[WorkerSpec],
    session: aiohttp.ClientSession,
    notices: Notices | None,
    timeout_s: float,
) -> FlushResult:
    carriers = tuple(c for spec in engines if spec.kv is not None for c in spec.carriers())
    for c in carriers:
        plane.withholds.withhold(c, WithholdReason.FLUSH)
    withheld = await notices.send(KvNotice(NoticeKind.WITHHOLD_FLUSH, carriers)) if notices else {}
    resets = await asyncio.gather(*(reset_engine(session, spec, timeout_s) for spec in engines))
    for c in carriers:
        plane.withholds.flushed(c)
    flushed = await notices.send(KvNotice(NoticeKind.FLUSHED, carriers)) if notices else {}
    return FlushResult(tuple(resets), withheld, flushed)
