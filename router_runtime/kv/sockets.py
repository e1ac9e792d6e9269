"""The KV plane's ZMQ sockets: one context, and every socket opened through ``open`` (or ``monitor``)
under a name and closed by the ``with`` block that opened it. The close is synchronous, so it runs
whatever point its task is cancelled at: a cancellation can interrupt an ``await`` in a ``finally``,
never a ``with`` exit that does not await.

``zmq.Context.term()`` blocks (the event loop with it) until every socket of the context is closed, so
``close`` never calls it with a socket open: what an owner left open is named in a warning (a bug:
``open_names`` lets a test say so) and closed with the context by ``destroy(linger=0)``, which returns
at once."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)


class Sockets:
    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self._open: dict[zmq.asyncio.Socket, str] = {}

    @contextlib.contextmanager
    def open(self, kind: int, name: str) -> Iterator[zmq.asyncio.Socket]:
        """A socket of ``kind`` (LINGER 0: a close never waits for unsent messages), closed on exit."""
        sock = self.ctx.socket(kind)
        self._open[sock] = name
        try:
            sock.setsockopt(zmq.LINGER, 0)
            yield sock
        finally:
            self._open.pop(sock, None)
            sock.close(0)

    @contextlib.contextmanager
    def monitor(self, sock: zmq.asyncio.Socket, events: int, name: str) -> Iterator[zmq.asyncio.Socket]:
        """The PAIR socket that receives ``sock``'s ``events``; monitoring ends and it closes on exit."""
        mon = sock.get_monitor_socket(events)
        self._open[mon] = name
        try:
            yield mon
        finally:
            self._open.pop(mon, None)
            with contextlib.suppress(zmq.ZMQError):  # ``sock`` may have been closed first
                sock.disable_monitor()
            mon.close(0)

    def open_names(self) -> list[str]:
        return sorted(self._open.values())

    def close(self) -> list[str]:
        """End the context without blocking; returns the names of the sockets still open (a bug in
        their owner), which are closed with it."""
        if self.ctx.closed:
            return []
        left = self.open_names()
        if left:
            log.warning("KV plane stopped with %d ZMQ sockets still open: %s", len(left), ", ".join(left))
        self._open.clear()
        self.ctx.destroy(linger=0)
        return left
