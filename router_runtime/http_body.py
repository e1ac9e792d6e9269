"""Reading an HTTP response body from a peer or an engine whole, under a size cap (one stream read
may return any part of it, and a hostile or broken sender may never stop)."""

from __future__ import annotations

import aiohttp


async def read_capped(stream: aiohttp.StreamReader, cap: int) -> bytes | None:
    """The whole body, or None past ``cap`` bytes."""
    body = bytearray()
    async for chunk in stream.iter_chunked(1 << 16):
        body += chunk
        if len(body) > cap:
            return None
    return bytes(body)
