"""An engine described by its own ``GET /server_info`` (SGLang; the fake engine serves it too).

``kv_events`` carries ``publisher``, ``endpoint_host``, ``endpoint_port_base``, optionally
``replay_port_base``, ``topic``, ``block_size``, ``dp_size`` (and the fake engine's ``dialect``). A wildcard
host (``*``, ``0.0.0.0``, ``::``, empty) means "the host of the worker's URL". Older SGLang spells the
endpoint as ``endpoint: tcp://*:5557``; both are read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aiohttp

from ..worker import WorkerSpec

_WILDCARDS = {"", "*", "0.0.0.0", "::", "[::]"}


@dataclass(frozen=True, slots=True)
class ServerInfo:
    spec: WorkerSpec
    block_size: int | None  # None: the engine did not say
    dialect: str | None  # the fake engine's wire dialect; real engines do not report one


def _url_host(url: str) -> str:
    host = urlparse(url).hostname
    if not host:
        raise ValueError(f"worker URL has no host: {url!r}")
    return f"[{host}]" if ":" in host else host


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"server_info {what} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"server_info {what} must be an integer, got {value!r}") from None


def _port(value: Any, what: str, dp: int) -> int:
    """A port base, its ``dp`` ranks' ports all TCP ports."""
    port = _int(value, what)
    if not 1 <= port <= 65536 - dp:
        raise ValueError(
            f"server_info {what} must be a TCP port (1-65535 for each of {dp} ranks), got {port}"
        )
    return port


def parse_server_info(
    url: str, info: Mapping[str, Any], *, engine: str | None = None, incarnation: str | None = None
) -> ServerInfo:
    """The WorkerSpec for the engine at ``url`` whose /server_info body is ``info`` (pure).

    ``engine`` defaults to the URL (as for static workers); ``incarnation`` to the body's ``incarnation``
    field (the fake engine's), else empty. No ``kv_events``, or a publisher other than zmq: kv=None."""
    url = url.rstrip("/")
    ev = info.get("kv_events")
    if isinstance(ev, str):  # some SGLang versions serialise the config as a JSON string
        ev = json.loads(ev) if ev.strip() else None
    ev = ev if isinstance(ev, Mapping) else {}
    dp = _int(ev.get("dp_size", info.get("dp_size", 1)) or 1, "dp_size")
    if dp < 1:
        raise ValueError(f"server_info dp_size must be >= 1, got {dp}")
    kv = replay = None
    host = ev.get("endpoint_host")
    base = ev.get("endpoint_port_base")
    if base is None and isinstance(ev.get("endpoint"), str):  # tcp://host:port
        head, _, port = ev["endpoint"].rpartition(":")
        host, base = head.removeprefix("tcp://"), port
    if ev.get("publisher", "zmq") == "zmq" and base is not None:
        host = str(host or "").strip().removeprefix("[").removesuffix("]")
        host = _url_host(url) if host in _WILDCARDS else (f"[{host}]" if ":" in host else host)
        kv = f"tcp://{host}:{_port(base, 'endpoint_port_base', dp)}"
        if ev.get("replay_port_base") is not None:
            replay = f"tcp://{host}:{_port(ev['replay_port_base'], 'replay_port_base', dp)}"
    block_size = ev.get("block_size", info.get("page_size"))
    spec = WorkerSpec(
        engine=engine or url,
        url=url,
        kv=kv,
        replay=replay,
        dp_size=dp,
        topic=str(ev.get("topic") or "").encode(),
        incarnation=incarnation if incarnation is not None else str(info.get("incarnation") or ""),
    )
    return ServerInfo(
        spec, _int(block_size, "block_size") if block_size is not None else None, ev.get("dialect")
    )


async def fetch_server_info(
    url: str, *, session: aiohttp.ClientSession | None = None, timeout: float = 5.0, **kw: Any
) -> ServerInfo:
    """GET ``<url>/server_info`` (falling back to ``/get_server_info``) and parse it; ``kw`` goes to
    ``parse_server_info``. Raises aiohttp errors, or ValueError for a body that does not parse."""
    own = session is None
    session = session or aiohttp.ClientSession()
    try:
        to = aiohttp.ClientTimeout(total=timeout)
        for path in ("/server_info", "/get_server_info"):
            async with session.get(url.rstrip("/") + path, timeout=to) as r:
                if r.status == 404 and path == "/server_info":
                    continue
                r.raise_for_status()
                body = await r.json(content_type=None)
                if not isinstance(body, Mapping):
                    raise ValueError(f"{url}{path} did not return a JSON object")
                return parse_server_info(url, body, **kw)
        raise AssertionError("unreachable")
    finally:
        if own:
            await session.close()


async def server_info_spec(url: str, **kw: Any) -> WorkerSpec:
    """The WorkerSpec of the engine at ``url``, as its /server_info describes it."""
    return (await fetch_server_info(url, **kw)).spec
