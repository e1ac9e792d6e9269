"""Attributes more than one span names the same way."""

from __future__ import annotations

from functools import lru_cache

from ..scheduling.types import Target
from .spans import Attr


@lru_cache(maxsize=4096)
def upstream(target: Target) -> dict[str, Attr | None]:
    """The engine a request goes to, as its upstream span says it (remembered per target: its address
    is parsed from its URL once). Read-only: spans copy it."""
    host, _, port = target.endpoint.rpartition(":")
    return {
        "routerfleet.engine": target.engine,
        "routerfleet.rank": target.rank,
        "server.address": host.strip("[]"),
        "server.port": int(port),
    }
