"""Sibling replicas tell each other their in-flight load over the internal port, with the fleet token, to
every peer the bootstrap's peer discovery lists: one WebSocket per peer (``GET /internal/load/stream``),
each binary message a report. A sibling of an older release, which serves no stream, gets each report as
a ``POST /internal/load``, as before. Why a stream: under load a replica reports every few milliseconds
to every sibling, and an HTTP request per report cost both ends about 220 us of CPU, a message and its
one-byte answer on an open stream about 60 us (docs/fleet-load.md has what it does to the fleet).

A report is small and bounded (one entry per target this replica has in flight), sent a coalescing
window after the load changes and at least every heartbeat. ``vet_report`` is the only way a body off
the network becomes a ``PeerReport``: every field is checked as a bounded value of its type before use
(a hostile peer can cost a rejected report, never a frozen or wrong view). Reports are taken in order
per sender process (its incarnation, then its sequence); a sender that stops talking ages out of the
view (``view.Bounds.peer_max_age_s``).

A report also carries what the sender's plugins share (``scheduling/types.Shared``): its live in-flight
predictions (``scheduling/inflight_prefix.py``: per prediction its engine and rank, the position of its
first block and the index's chained keys of its blocks from there, packed as little-endian u64s in
base64: block keys and positions only, never tokens), and the LoRA adapters it sent to each engine
lately (``scheduling/lora_affinity.py``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import enum
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import aiohttp
from aiohttp import WSMsgType

from ..scheduling.inflight_prefix import MAX_SHARED, MAX_SHARED_KEYS
from ..scheduling.lora_affinity import MAX_ADAPTERS_SHARED
from ..scheduling.types import Prediction, Shared
from ..worker import Carrier
from .view import TargetReport

log = logging.getLogger(__name__)

FORMAT = 1
MAX_BODY_BYTES = 256 << 10
MAX_TARGETS = 4096
_MAX_NAME = 512
_MAX_RANK = 1 << 16
_MAX_INFLIGHT = 1 << 20
_MAX_TOKENS = 1 << 40
_MAX_SEQ = (1 << 63) - 1
_MAX_START = 1 << 24  # a prediction's first block: a prompt of ~16M blocks
STREAM_PATH = "/internal/load/stream"
STREAM_RETRY_S = 30.0  # a peer that served no stream (an older release) is asked for one again after this
# A peer that refused the stream otherwise (a wrong token, overloaded, stopping): its refusal stands this
# long, counted per report without a connection each (a connection per round would churn sockets).
REFUSAL_HOLD_S = 2.0
# A stream's answer to each report, one byte: taken (vetted), or refused (counted as the POST's 400 was).
TAKEN = b"\x00"
REFUSED = b"\x01"
_ANSWERS = {TAKEN: "ok", REFUSED: "refused"}
_ANSWER_BYTES = 16  # a message from the peer of this many bytes or more ends the stream
_ENDED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR)


class GossipRejected(ValueError):
    pass


class ReportOutcome(enum.StrEnum):
    """What became of a received report; a metric label."""

    ACCEPTED = "accepted"
    STALE = "stale"  # not newer than what we hold from that sender
    SELF = "self"  # our own report, listed back to us as a peer
    REJECTED = "rejected"


_TOKEN = object()


class PeerReport:
    """A sibling's load, vetted. Built only by ``vet_report``."""

    __slots__ = ("incarnation", "replica", "seq", "shared", "targets")

    def __init__(
        self,
        token: object,
        *,
        replica: str,
        incarnation: str,
        seq: int,
        targets: tuple[TargetReport, ...],
        shared: Shared,
    ) -> None:
        if token is not _TOKEN:
            raise TypeError("a PeerReport is built only by vet_report")
        self.replica = replica
        self.incarnation = incarnation
        self.seq = seq
        self.targets = targets
        self.shared = shared


def encode_report(
    replica: str,
    incarnation: str,
    seq: int,
    targets: Iterable[TargetReport],
    shared: Shared | None = None,
    packer: PredictionPacker | None = None,
) -> bytes:
    shared = shared or Shared()
    body: dict = {
        "format": FORMAT,
        "replica": replica,
        "incarnation": incarnation,
        "seq": seq,
        "targets": [[t.engine, t.rank, t.inflight, t.prompt_tokens] for t in targets],
    }
    # Each absent when empty: a sibling of an older release reads the rest as before.
    if shared.adapters:
        body["adapters"] = [[engine, list(names)] for engine, names in shared.adapters.items()]
    raw = json.dumps(body, separators=(",", ":"))
    if shared.predictions:
        packed = (packer or PredictionPacker())(shared.predictions)
        raw = f'{raw[:-1]},"predictions":[{",".join(packed)}]}}'
    return raw.encode()


class PredictionPacker:
    """Each prediction's wire form (a JSON array), made once: a replica reports its live predictions
    every few milliseconds, and most are the ones it reported last time (the plugin hands out the same
    ``Prediction`` object for as long as it lives)."""

    def __init__(self) -> None:
        self._memo: dict[int, tuple[Prediction, str]] = {}  # id -> (it, kept so its id stays its own; wire)

    def __call__(self, predictions: Sequence[Prediction]) -> list[str]:
        memo, kept, out = self._memo, {}, []
        for p in predictions:
            held = memo.get(id(p))
            if held is None or held[0] is not p:
                keys = base64.b64encode(struct.pack(f"<{len(p.keys)}Q", *p.keys)).decode("ascii")
                held = (
                    p,
                    json.dumps([p.carrier.engine, p.carrier.rank, p.start, keys], separators=(",", ":")),
                )
            kept[id(p)] = held
            out.append(held[1])
        self._memo = kept  # only the current ones: bounded by a report's size
        return out


def _int(v: object, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:  # bool is an int subclass: refused by the type check
        raise GossipRejected(f"{what} must be an integer in [{lo}, {hi}]")
    return v


def _str(v: object, what: str) -> str:
    if type(v) is not str or not 0 < len(v) <= _MAX_NAME:
        raise GossipRejected(f"{what} must be a string of 1-{_MAX_NAME} characters")
    return v


def vet_report(body: bytes) -> PeerReport:
    if len(body) > MAX_BODY_BYTES:
        raise GossipRejected(f"report over {MAX_BODY_BYTES} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # also: integers beyond Python's digit limit
        raise GossipRejected("not JSON") from None
    if type(doc) is not dict:
        raise GossipRejected("not a JSON object")
    if doc.get("format") != FORMAT or type(doc.get("format")) is not int:
        raise GossipRejected("unknown format")
    replica = _str(doc.get("replica"), "replica")
    incarnation = _str(doc.get("incarnation"), "incarnation")
    seq = _int(doc.get("seq"), 0, _MAX_SEQ, "seq")
    raw = doc.get("targets")
    if type(raw) is not list or len(raw) > MAX_TARGETS:
        raise GossipRejected(f"targets must be a list of at most {MAX_TARGETS}")
    targets = []
    for entry in raw:
        if type(entry) is not list or len(entry) != 4:
            raise GossipRejected("a target is [engine, rank, inflight, prompt_tokens]")
        engine, rank, inflight, tokens = entry
        targets.append(
            TargetReport(
                _str(engine, "engine"),
                None if rank is None else _int(rank, 0, _MAX_RANK, "rank"),
                _int(inflight, 0, _MAX_INFLIGHT, "inflight"),
                _int(tokens, 0, _MAX_TOKENS, "prompt_tokens"),
            )
        )
    return PeerReport(
        _TOKEN,
        replica=replica,
        incarnation=incarnation,
        seq=seq,
        targets=tuple(targets),
        shared=Shared(_vet_predictions(doc.get("predictions", [])), _vet_adapters(doc.get("adapters", []))),
    )


def _vet_adapters(raw: object) -> dict[str, tuple[str, ...]]:
    if type(raw) is not list or len(raw) > MAX_TARGETS:
        raise GossipRejected(f"adapters must be a list of at most {MAX_TARGETS}")
    out: dict[str, tuple[str, ...]] = {}
    for entry in raw:
        if type(entry) is not list or len(entry) != 2 or type(entry[1]) is not list:
            raise GossipRejected("an engine's adapters are [engine, [adapter, ...]]")
        engine, names = _str(entry[0], "engine"), entry[1]
        if len(names) > MAX_ADAPTERS_SHARED:
            raise GossipRejected(f"at most {MAX_ADAPTERS_SHARED} adapters per engine")
        out[engine] = tuple(_str(n, "adapter") for n in names)
    return out


def _vet_predictions(raw: object) -> tuple[Prediction, ...]:
    if type(raw) is not list or len(raw) > MAX_SHARED:
        raise GossipRejected(f"predictions must be a list of at most {MAX_SHARED}")
    out = []
    total = 0
    for entry in raw:
        if type(entry) is not list or len(entry) != 4:
            raise GossipRejected("a prediction is [engine, rank, start, keys]")
        engine, rank, start, packed = entry
        if type(packed) is not str or len(packed) > 4 * ((8 * MAX_SHARED_KEYS + 2) // 3):
            raise GossipRejected("a prediction's keys must be a base64 string")
        try:
            blob = base64.b64decode(packed, validate=True)
        except (binascii.Error, ValueError):
            raise GossipRejected("a prediction's keys must be a base64 string") from None
        n = len(blob) // 8
        if not blob or len(blob) % 8:
            raise GossipRejected("a prediction's keys must be 8 bytes each, at least one")
        total += n
        if total > MAX_SHARED_KEYS:
            raise GossipRejected(f"predictions of more than {MAX_SHARED_KEYS} blocks in all")
        carrier = Carrier(_str(engine, "engine"), _int(rank, 0, _MAX_RANK, "rank"))
        out.append(Prediction(carrier, _int(start, 0, _MAX_START, "start"), struct.unpack(f"<{n}Q", blob)))
    return tuple(out)


def peer_session(timeout_s: float, limit: int = 100) -> aiohttp.ClientSession:
    """A session for telling siblings, whose answers are read for their status alone (a stream's, one
    byte each): a body is never read, nor inflated (a peer, or anything peer discovery points at, could
    answer a gzip bomb). ``limit``: connections at once (0: no cap)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(keepalive_timeout=4.0, limit=limit),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        auto_decompress=False,
    )


def _let_go(sock: socket.socket | None, shut: bool) -> None:
    """A dropped stream's connection, released whatever the peer does. aiohttp closes a connection
    gracefully: the socket, and the bytes not yet sent, wait for the peer to read them, in the loop's
    transport or, once its file is closed, in the kernel; a peer that reads nothing would keep every
    dropped stream's. With no linger its close resets it at once; one whose close did not finish is also
    ``shut``, which wakes the transport waiting to write so that it closes. Done on a duplicate of its
    file: the loop's socket object may refuse both (uvloop's), and socket options and a shutdown are the
    socket's, whichever file names it. A socket already closed (its file -1) is left."""
    if sock is None:
        return
    with contextlib.suppress(OSError, ValueError, TypeError):
        fd = sock.fileno()
        if fd < 0:
            return
        with socket.socket(fileno=os.dup(fd)) as dup:
            dup.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            if shut:
                dup.shutdown(socket.SHUT_RDWR)


class _Refused(Exception):
    """A peer refused the stream with ``status`` (not as an older release does: that one gets POSTs)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


@dataclass(frozen=True, slots=True)
class GossipConfig:
    window_s: float = 0.002  # after a change, wait this long for more before sending (0: gossip off)
    heartbeat_s: float = 0.5  # send at least this often, changed or not
    timeout_s: float = 0.5  # one report to one peer, until its answer (a stream's open: its own as much)


class LoadGossip:
    """Sends this replica's report to every peer. One send in flight per peer, until the peer answers
    it: a slow peer is skipped (``busy``) until then, and gets the newest report, so it never delays
    the others and never has a backlog of old reports to read. Each peer gets its reports over one
    stream, opened on its first report and again after it breaks; a peer that serves none (an older
    release) gets them posted, and is asked for a stream again after ``STREAM_RETRY_S``."""

    def __init__(
        self,
        token: str,
        peer_urls: Callable[[], list[str]],
        report: Callable[[], bytes],
        config: GossipConfig,
        on_sent: Callable[[str], None] = lambda outcome: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.peer_urls = peer_urls
        self.report = report
        self.config = config
        self.on_sent = on_sent
        self._clock = clock
        self.changed = asyncio.Event()
        self._posts: dict[str, asyncio.Task] = {}
        self._behind: set[str] = set()  # peers skipped while busy: owed the newest report
        self._streams: dict[str, aiohttp.ClientWebSocketResponse] = {}
        # Each stream's socket, taken at its open: its connection may outlive the stream's own view of it.
        self._sockets: dict[str, socket.socket | None] = {}
        self._closing: dict[str, asyncio.Task] = {}  # a dropped stream's close, one per peer at most
        self._posting: dict[str, float] = {}  # peers that serve no stream -> when to ask again
        self._refused: dict[str, tuple[float, int]] = {}  # peers that refused a stream -> (until, status)
        self._session: aiohttp.ClientSession | None = None
        self._stopped = False

    def streaming_to(self) -> list[str]:
        """The peers this replica's reports go to over an open stream (tests, debugging)."""
        return [url for url, ws in self._streams.items() if not ws.closed]

    async def run(self) -> None:
        cfg = self.config
        self._session = peer_session(cfg.timeout_s, limit=0)  # a stream holds a connection per peer
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(cfg.heartbeat_s):
                        await self.changed.wait()
                await asyncio.sleep(cfg.window_s)  # coalesce a burst into one report
                self.changed.clear()
                try:
                    self.send_round()
                except Exception:  # a bug: this round is lost, never the reports to come
                    log.exception("load reports: a round failed")
        finally:
            self._stopped = True
            for sock in self._sockets.values():  # first: a send cancelled below forgets its stream
                _let_go(sock, shut=True)
            self._sockets.clear()
            tasks = [*self._posts.values(), *self._closing.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._posts.clear()
            self._closing.clear()
            self._streams.clear()
            with contextlib.suppress(TimeoutError):  # the POSTs' connections
                async with asyncio.timeout(cfg.timeout_s):
                    await self._session.close()

    def send_round(self) -> None:
        urls = self.peer_urls()
        for url in list(self._posts):
            if url not in urls and self._posts[url].done():
                del self._posts[url]
        for url in [u for u in self._streams if u not in urls]:  # a peer gone: its stream too
            self._drop(url)
        for held in (self._posting, self._refused):
            for url in [u for u in held if u not in urls]:
                del held[url]
        body = None
        for url in urls:
            task = self._posts.get(url)
            if task is not None and not task.done():
                self.on_sent("busy")
                self._behind.add(url)
                continue
            if body is None:
                body = self.report()
            self._posts[url] = asyncio.create_task(self._send(url, body), name=f"gossip-{url}")

    async def _send(self, url: str, body: bytes) -> None:
        try:
            if len(body) > MAX_BODY_BYTES:  # a sibling would refuse it (a POST's 413)
                self.on_sent("too_large")
                return
            for attempt in range(2):  # a stream the peer closed while idle: once more on a new one
                if attempt and url not in self.peer_urls():  # it left meanwhile: its stream was dropped
                    return
                ws = await self._stream(url)
                if ws is None:
                    await self._post(url, body)
                    return
                outcome = await self._over(url, ws, body)
                if outcome is not None:
                    self.on_sent(outcome)
                    return
            self.on_sent("error")
        except _Refused as e:
            self.on_sent(f"http_{e.status // 100}xx")
        except TimeoutError:
            self.on_sent("timeout")
        except (aiohttp.ClientError, ConnectionError):
            self.on_sent("error")
        finally:
            if url in self._behind:  # a round skipped it: another round now, not at the next change
                self._behind.discard(url)
                self.changed.set()

    async def _over(self, url: str, ws: aiohttp.ClientWebSocketResponse, body: bytes) -> str | None:
        """``body`` over ``ws`` and the peer's answer to it, within the send timeout: the outcome, or None
        when the stream had ended (the peer closed it: nothing reads it between reports, so that shows
        only now); it is dropped either way, and the caller may open another."""
        try:
            async with asyncio.timeout(self.config.timeout_s):
                try:
                    await ws.send_bytes(body)
                except ConnectionError:
                    self._drop(url)
                    return None
                answer = await ws.receive()
        except BaseException:
            self._drop(url)
            raise
        outcome = _ANSWERS.get(answer.data) if answer.type is WSMsgType.BINARY else None
        if outcome is None:  # the peer's close, or anything but an answer: this stream is done
            self._drop(url)
            return None if answer.type in _ENDED else "error"
        return outcome

    async def _stream(self, url: str) -> aiohttp.ClientWebSocketResponse | None:
        """The open stream to ``url``, opened now if need be; None for a peer that serves none. The peer's
        last stream is closed first (within the send timeout, else this raises), so that a peer that
        holds its connections open costs one at a time."""
        ws = self._streams.get(url)
        if ws is not None and not ws.closed:
            return ws
        self._drop(url)  # one the peer closed meanwhile
        now = self._clock()
        if now < self._posting.get(url, 0.0):
            return None
        until, status = self._refused.get(url, (0.0, 0))
        if now < until:
            raise _Refused(status)
        closing = self._closing.get(url)
        if closing is not None:
            await asyncio.wait({closing}, timeout=self.config.timeout_s)
            if not closing.done():
                raise ConnectionError("the last stream to this peer is still closing")
        assert self._session is not None
        try:
            ws = await self._session.ws_connect(
                url + STREAM_PATH,
                headers=self._auth,
                timeout=aiohttp.ClientWSTimeout(ws_close=self.config.timeout_s),
                autoping=False,  # a peer sends answers and its close; anything else ends the stream
                max_msg_size=_ANSWER_BYTES,
            )
        except aiohttp.WSServerHandshakeError as e:
            if e.status not in (404, 405):  # the token, an overloaded or stopping peer: said, asked again
                self._refused[url] = (self._clock() + REFUSAL_HOLD_S, e.status)
                raise _Refused(e.status) from None
            self._posting[url] = self._clock() + STREAM_RETRY_S  # an older release: posts, for now
            return None
        self._posting.pop(url, None)
        self._refused.pop(url, None)
        self._streams[url] = ws
        self._sockets[url] = ws.get_extra_info("socket")
        return ws

    def _drop(self, url: str) -> None:
        """Forget the stream to ``url`` and close it, in the background and within the send timeout."""
        ws = self._streams.pop(url, None)
        sock = self._sockets.pop(url, None)
        if ws is None or self._stopped:  # stopped: the stop lets go of them all
            return
        if ws.closed:  # closed as a WebSocket, its connection perhaps not (a close frame unsent)
            _let_go(sock, shut=True)
            return
        _let_go(sock, shut=False)  # no linger, before its close can leave it to the kernel

        async def close() -> None:
            closed = False
            try:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self.config.timeout_s):
                        await ws.close()
                        closed = True
            finally:
                _let_go(sock, shut=not closed)
                if self._closing.get(url) is asyncio.current_task():
                    del self._closing[url]

        self._closing[url] = asyncio.create_task(close(), name=f"gossip-close-{url}")

    async def _post(self, url: str, body: bytes) -> None:
        assert self._session is not None
        async with self._session.post(url + "/internal/load", data=body, headers=self._auth) as r:
            self.on_sent("ok" if r.status == 204 else f"http_{r.status // 100}xx")
