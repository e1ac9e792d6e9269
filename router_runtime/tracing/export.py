"""Finished traces to a collector: encoded as OTLP (``wire.py``, pure) and POSTed over OTLP/HTTP in
batches by one task (``OtlpExporter``). Bounded everywhere: a queue of traces (past it, new ones are
dropped and counted), one export at a time with a deadline, a collector's "later" (429, 502-504) honoured
with a bounded backoff, and a last flush at the stop with its own deadline.

OTLP/HTTP, not OTLP/gRPC: the router's own HTTP client, not a second network stack with threads of its
own in the process (bench/README.md, "The cost of tracing")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from ..http_body import STATUS_ONLY, read_capped
from .config import TracingConfig
from .spans import Attr, Trace
from .wire import encode_trace, export_request, rejected_spans

log = logging.getLogger(__name__)

SCOPE = "routerfleet.router"
# OTLP/HTTP's binary encoding: the request and the answer are protobuf bytes, as wire.py writes and reads.
PROTOBUF = "application/x-protobuf"
MAX_QUEUED_TRACES = 4096
BATCH_TRACES = 256  # per export request
INTERVAL_S = 1.0  # a batch goes at least this often while traces wait
EXPORT_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 2.0  # what the stop gives the traces still queued
# OTLP/HTTP's answers that say "later": the batch goes again after the collector's Retry-After, or a
# backoff doubling from INTERVAL_S up to MAX_BACKOFF_S (the queue's bound holds meanwhile).
RETRYABLE = frozenset({429, 502, 503, 504})
MAX_BACKOFF_S = 30.0


def resource_of(config: TracingConfig, version: str) -> dict[str, Attr]:
    """The router as a trace's resource: its service name and version, its instance (the pod's name)."""
    return {
        "service.name": config.service_name,
        "service.version": version,
        "service.instance.id": socket.gethostname(),
    }


class TraceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.spans = Counter(
            "routerfleet_trace_spans_exported", "Spans the collector accepted", registry=registry
        )
        self.dropped = Counter(
            "routerfleet_trace_spans_dropped",
            "Spans not exported, by reason (queue_full: the collector is slower than the traffic;"
            " export_failed: it refused or did not answer in time)",
            ["reason"],
            registry=registry,
        )


class OtlpExporter:
    """Queues finished traces (``submit``, from the request path: an append) and sends them in batches."""

    def __init__(self, config: TracingConfig, metrics: TraceMetrics, version: str) -> None:
        assert config.endpoint is not None
        self.endpoint = config.endpoint
        self.url = config.traces_url
        self.metrics = metrics
        self.version = version
        self.resource = resource_of(config, version)
        # Each finished trace encoded (and its span count): bytes only, which the garbage collector
        # never scans, so a trace's objects die young instead of aging through its generations while
        # they wait for their batch (up to a second, thousands of them at full sampling).
        self._queue: deque[tuple[bytes, int]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._backoff_s = 0.0  # while the collector says "later" (0: it does not)
        self._resume_at = 0.0  # no export before this (the event loop's clock)

    def submit(self, trace: Trace) -> None:
        """Queue a finished trace, encoded now; never raises into the request that made it."""
        n = len(trace.spans)
        if len(self._queue) >= MAX_QUEUED_TRACES:
            self.metrics.dropped.labels("queue_full").inc(n)
            return
        try:
            encoded = encode_trace(trace)
        except Exception as e:  # a bug in an attribute's value: this trace only
            self.metrics.dropped.labels("export_failed").inc(n)
            log.error("a trace could not be encoded: %r", e)
            return
        self._queue.append((encoded, n))
        if len(self._queue) >= BATCH_TRACES:
            self._wake.set()

    def start(self) -> None:
        # Its own session (one connection: one export at a time), apart from the engines' pool; no
        # proxy settings from the environment, as the router's other clients.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1),
            timeout=aiohttp.ClientTimeout(total=EXPORT_TIMEOUT_S),
            headers={"Content-Type": PROTOBUF},
        )
        self._task = asyncio.create_task(self._run(), name="trace-export")

    async def stop(self) -> None:
        """Stop the batching task, then send what is queued, within FLUSH_TIMEOUT_S."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            async with asyncio.timeout(FLUSH_TIMEOUT_S):
                while self._queue:
                    await self._export_batch(retry=False)
        except TimeoutError:
            pass
        finally:
            if self._queue:
                self.metrics.dropped.labels("export_failed").inc(sum(n for _, n in self._queue))
                self._queue.clear()
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def _run(self) -> None:
        # A batch goes when it is full, or when INTERVAL_S has passed since the last went: never just
        # what queued during the previous export (at full sampling a few dozen traces, which each paid
        # a share of that export's fixed cost).
        loop = asyncio.get_running_loop()
        due = loop.time() + INTERVAL_S
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(due):
                    await self._wake.wait()
            self._wake.clear()
            if loop.time() < self._resume_at:  # the collector asked for a pause
                await asyncio.sleep(self._resume_at - loop.time())
            while len(self._queue) >= BATCH_TRACES and loop.time() >= self._resume_at:
                await self._export_batch()
            if loop.time() >= due:
                if self._queue and loop.time() >= self._resume_at:
                    await self._export_batch()
                due = loop.time() + INTERVAL_S

    async def _export_batch(self, retry: bool = True) -> None:
        """Send up to BATCH_TRACES queued traces; whatever fails is counted and logged, never raised
        (the task sending them must outlive any one batch). A "later" puts the batch back (``retry``)."""
        n = min(len(self._queue), BATCH_TRACES)
        batch = [self._queue.popleft() for _ in range(n)]
        spans = sum(n for _, n in batch)
        assert self._session is not None
        try:
            request = export_request([b for b, _ in batch], self.resource, SCOPE, self.version)
            async with self._session.post(self.url, data=request) as answer:
                body = await read_capped(answer.content, STATUS_ONLY)
                status = answer.status
                retry_after = answer.headers.get("Retry-After")
        except asyncio.CancelledError:  # the stop, mid-export: the batch is not coming back
            self.metrics.dropped.labels("export_failed").inc(spans)
            raise
        except (aiohttp.ClientError, TimeoutError) as e:
            self.metrics.dropped.labels("export_failed").inc(spans)
            log.warning("trace export to %s failed: %s", self.endpoint, type(e).__name__)
            return
        except Exception as e:  # a bug (an encoding)
            self.metrics.dropped.labels("export_failed").inc(spans)
            log.error("trace export to %s failed: %r", self.endpoint, e)
            return
        if status in RETRYABLE and retry:
            self._later(batch, retry_after)
            return
        self._backoff_s = 0.0
        if status != 200 or body is None:
            self.metrics.dropped.labels("export_failed").inc(spans)
            log.warning("trace export to %s failed: HTTP %d", self.endpoint, status)
            return
        # The answer's partial_success, read by wire.rejected_spans: how many spans the collector refused.
        try:
            rejected = rejected_spans(body)
        except ValueError:
            self.metrics.dropped.labels("export_failed").inc(spans)
            log.warning("trace export to %s: the answer is not OTLP protobuf", self.endpoint)
            return
        if rejected > spans:  # more than were sent (or a negative int64): the answer is nonsense
            log.warning("trace export to %s: %d of %d spans rejected", self.endpoint, rejected, spans)
            rejected = spans
        if rejected:
            self.metrics.dropped.labels("export_failed").inc(rejected)
        self.metrics.spans.inc(spans - rejected)

    def _later(self, batch: list[tuple[bytes, int]], retry_after: str | None) -> None:
        """The collector said "later": ``batch`` goes back to the queue's head (what no longer fits is
        dropped and counted), and no export is sent before its Retry-After (seconds) or the backoff."""
        if not self._backoff_s:
            log.warning("trace export to %s: the collector asks to retry later; backing off", self.endpoint)
        self._backoff_s = min(max(self._backoff_s * 2, INTERVAL_S), MAX_BACKOFF_S)
        delay = self._backoff_s
        if retry_after is not None and retry_after.isascii() and retry_after.isdigit():  # seconds (else
            # a date form: the backoff), at least the interval (a "0" would have the batch sent at once)
            delay = min(max(int(retry_after), INTERVAL_S), MAX_BACKOFF_S)
        self._resume_at = asyncio.get_running_loop().time() + delay
        room = max(MAX_QUEUED_TRACES - len(self._queue), 0)
        kept, lost = batch[:room], batch[room:]
        self._queue.extendleft(reversed(kept))
        if lost:
            self.metrics.dropped.labels("queue_full").inc(sum(n for _, n in lost))
