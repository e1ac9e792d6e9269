"""Reading an HTTP response body from a peer or an engine whole, under a size cap (one stream read
may return any part of it, and a hostile or broken sender may never stop)."""

from __future__ import annotations

import asyncio

import aiohttp

# Above this, the chunks are joined off the loop (``bytes.join`` releases the GIL for large copies): a
# peer's snapshot is hundreds of MiB, and one copy of it on the loop stalls every live event.
_JOIN_OFF_LOOP = 1 << 20


# An answer read for its status (a health probe, a response probe): read this much so the connection can
# be reused; past it, the connection is dropped instead.
STATUS_ONLY = 64 << 10


async def read_capped(stream: aiohttp.StreamReader, cap: int) -> bytes | None:
    """The whole body, or None past ``cap`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream.iter_chunked(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return None
    if size <= _JOIN_OFF_LOOP:
        return b"".join(chunks)
    return await asyncio.get_running_loop().run_in_executor(None, b"".join, chunks)
