"""Reading each router pod's bootstrap verdict: ``GET /internal/bootstrap`` at the pod's IP and internal
port, with the fleet's bearer token and a short timeout. A pod that does not answer (not up yet,
unreachable, an unknown document) has no report, and the decision waits for it: nothing is admitted
on a guess."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp

from .model import INTERNAL_PORT
from .rollout import BootstrapReport

log = logging.getLogger(__name__)
TIMEOUT_S = 2.0


def bootstrap_url(pod: Mapping[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{INTERNAL_PORT}/internal/bootstrap"


async def fetch_report(
    session: aiohttp.ClientSession, pod: Mapping[str, Any], token: str
) -> BootstrapReport | None:
    url = bootstrap_url(pod)
    if url is None:
        return None
    try:
        async with session.get(url, headers={"Authorization": f"Bearer {token}"}) as r:
            if r.status != 200:
                log.debug("%s: %s", url, r.status)
                return None
            doc = await r.json(content_type=None)
        return BootstrapReport.parse(doc)
    except (TimeoutError, aiohttp.ClientError, ValueError, TypeError, KeyError) as exc:
        log.debug("%s: %r", url, exc)
        return None


async def fetch_reports(
    pods: Iterable[Mapping[str, Any]], token: str, timeout_s: float = TIMEOUT_S
) -> dict[str, BootstrapReport | None]:
    """Every pod's report by pod name, fetched side by side."""
    pods = list(pods)
    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(1.0, timeout_s))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        reports = await asyncio.gather(*(fetch_report(session, p, token) for p in pods))
    return {p["metadata"]["name"]: r for p, r in zip(pods, reports, strict=True)}
