"""List-then-watch one set of Kubernetes objects into a local cache, on the event loop.

* list every page (``limit``/``continue``), then ``publish`` from the complete cache: a set is only
  ever published from a complete list, never from part of one (a list that fails mid-way publishes
  nothing);
* watch from the list's resourceVersion (with bookmarks); every event updates the cache and publishes;
  a watch that ends normally (the server-side timeout) is resumed from the last resourceVersion;
* 410 Gone (on the watch, or a continue token that expired) relists at once; any other failure (HTTP
  error, connection, timeout, undecodable body) marks the reflector unsynced, is counted by reason, and
  relists after a bounded, jittered exponential backoff.

``synced`` is False until the first complete list and again after any failure, until a relist succeeds.
What was last published stays in force while unsynced (emptying it would turn an API-server or RBAC
problem into an outage); ``synced``, ``last_error`` and the metrics make the condition visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import Counter as Tally
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from routerfleet_kube import ApiError, KubeClient

log = logging.getLogger(__name__)

# errors_total reasons, pre-created at 0 so dashboards and alerts see them before the first error
REASONS = (
    "forbidden",  # 403: RBAC does not allow list/watch
    "unauthorized",  # 401: bad or expired credentials
    "gone",  # 410: resourceVersion or continue token too old (relisted at once; routine)
    "not_found",  # 404: e.g. the API (or the CRD) is not served
    "throttled",  # 429
    "server_error",  # 5xx
    "http_error",  # any other HTTP status
    "watch_error",  # an ERROR event on the watch stream other than 410
    "connection",  # could not connect, or the connection broke
    "timeout",  # connect or read timeout
    "decode",  # a response or event that is not the JSON we expect
    "callback",  # publishing raised
    "internal",  # anything else (a bug): logged with its traceback
)


class ReflectorMetrics:
    """The three series every reflector keeps, under its own ``prefix``: ``synced``, ``errors`` (by
    reason, each pre-created at 0) and ``lists``; a subclass adds what it publishes."""

    def __init__(
        self, registry: CollectorRegistry, prefix: str, *, synced: str, errors: str, lists: str
    ) -> None:
        self.synced = Gauge(prefix + "synced", synced, registry=registry)
        self.errors = Counter(prefix + "errors", errors, ["reason"], registry=registry)
        for reason in REASONS:
            self.errors.labels(reason)
        self.lists = Counter(prefix + "lists", lists, registry=registry)


class Gone(Exception):
    """The server no longer has what we asked from (410): relist."""


class Backoff:
    """Exponential with jitter, bounded by ``maximum``; back to ``initial`` after a quiet period."""

    def __init__(self, initial: float, maximum: float, *, reset_after: float | None = None) -> None:
        self.initial, self.maximum = initial, maximum
        self.reset_after = reset_after if reset_after is not None else 2 * maximum
        self._current = initial
        self._last = -float("inf")

    def next(self) -> float:
        now = time.monotonic()
        if now - self._last > self.reset_after:
            self._current = self.initial
        self._last = now
        delay = self._current
        self._current = min(self.maximum, self._current * 2)
        return delay * random.uniform(0.5, 1.0)


class Reflector:
    """The list/watch loop over ``list_page`` and ``watch`` (a subclass gives both, and ``publish``,
    which maps ``self.objects`` to what it publishes)."""

    def __init__(
        self,
        metrics: ReflectorMetrics,
        *,
        watch_timeout_s: float = 300.0,
        page_limit: int = 500,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.metrics = metrics
        self.watch_timeout_s = watch_timeout_s
        self.page_limit = page_limit
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self.objects: dict[tuple[str, str], dict] = {}  # (namespace, name) -> the object
        self._synced = False
        self._synced_event = asyncio.Event()
        self.last_error: str | None = None
        self.errors: Tally[str] = Tally()
        self._task: asyncio.Task | None = None

    # ---- what a subclass gives ----------------------------------------------------------------

    def what(self) -> str:
        """The watched set, for log lines."""
        raise NotImplementedError

    async def list_page(self, *, limit: int, continue_token: str | None) -> dict:
        raise NotImplementedError

    def watch(self, *, resource_version: str, timeout_s: int) -> AsyncIterator[dict]:
        raise NotImplementedError

    async def publish(self) -> None:
        """Map ``self.objects`` (complete, current) to what is published; called after every complete
        list and every change."""
        raise NotImplementedError

    # ---- state ------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self._synced

    async def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait until synced (True) or ``timeout`` passes (False)."""
        try:
            await asyncio.wait_for(self._synced_event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _set_synced(self, value: bool) -> None:
        self._synced = value
        self.metrics.synced.set(1 if value else 0)
        if value:
            self._synced_event.set()
        else:
            self._synced_event.clear()

    def count(self, reason: str) -> None:
        self.errors[reason] += 1
        self.metrics.errors.labels(reason).inc()

    def _fail(self, reason: str, message: str) -> None:
        self.count(reason)
        self.last_error = f"{reason}: {message}"
        self._set_synced(False)

    # ---- lifecycle ------------------------------------------------------------------------------

    def start_loop(self, name: str) -> None:
        if self._task is not None:
            raise RuntimeError("already started")
        self._task = asyncio.create_task(self.run(), name=name)

    async def stop_loop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._set_synced(False)

    async def run(self) -> None:
        """The list/watch loop; runs until cancelled."""
        last_gone = -float("inf")
        while True:
            try:
                rv = await self._relist()
                while True:
                    t0 = time.monotonic()
                    rv, events = await self._watch(rv)
                    if not events and time.monotonic() - t0 < 1.0:  # closed at once: do not spin
                        await asyncio.sleep(self._backoff.next())
            except asyncio.CancelledError:
                raise
            except Gone as e:
                self.count("gone")
                now, prev = time.monotonic(), last_gone
                last_gone = now
                if now - prev > 1.0:  # routine: relist at once, and stay synced meanwhile
                    log.info("%s: %s; relisting", self.what(), e)
                    continue
                self.last_error = f"gone: {e}"
            except ApiError as e:
                self._fail(e.reason, str(e))
            except TimeoutError as e:
                self._fail("timeout", repr(e))
            except (aiohttp.ClientError, OSError) as e:
                self._fail("connection", repr(e))
            except Exception as e:
                log.exception("%s: unexpected error", self.what())
                self._fail("internal", repr(e))
            delay = self._backoff.next()
            log.warning("%s: %s; retrying in %.1fs", self.what(), self.last_error, delay)
            await asyncio.sleep(delay)

    # ---- list / watch ---------------------------------------------------------------------------

    async def _relist(self) -> str:
        items: dict[tuple[str, str], dict] = {}
        token: str | None = None
        rv = ""
        while True:
            try:
                page = await self.list_page(limit=self.page_limit, continue_token=token)
            except ApiError as e:
                if e.status == 410:  # continue token expired mid-list: start over, publish nothing
                    raise Gone(f"list continue token expired ({e})") from e
                raise
            meta = page.get("metadata") or {}
            for item in page.get("items") or []:
                items[key_of(item)] = item
            rv = meta.get("resourceVersion") or rv
            token = meta.get("continue") or None
            if token is None:
                break
        if not rv:
            raise ApiError(200, "list response has no resourceVersion", "decode")
        self.objects = items  # only now: a failed or partial list never touches the cache
        self.metrics.lists.inc()
        self.last_error = None
        self._set_synced(True)
        await self.publish()
        return rv

    async def _watch(self, rv: str) -> tuple[str, int]:
        """Apply one watch's events; returns the last resourceVersion and the number of events."""
        timeout = max(1, round(self.watch_timeout_s * random.uniform(1.0, 1.5)))
        n = 0
        stream = self.watch(resource_version=rv, timeout_s=timeout)
        try:
            async with contextlib.aclosing(stream):
                async for ev in stream:
                    n += 1
                    kind, obj = ev["type"], ev["object"]
                    if kind == "ERROR":
                        code = int(obj.get("code") or 0)
                        if code == 410:
                            raise Gone(f"watch expired: {obj.get('message', '')}")
                        raise ApiError(code, obj.get("message") or json.dumps(obj)[:500], "watch_error")
                    if kind in ("ADDED", "MODIFIED"):
                        self.objects[key_of(obj)] = obj
                    elif kind == "DELETED":
                        self.objects.pop(key_of(obj), None)
                    elif kind != "BOOKMARK":
                        raise ApiError(0, f"unknown watch event type {kind!r}", "decode")
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if kind != "BOOKMARK":
                        await self.publish()
        except ApiError as e:
            if e.status == 410:
                raise Gone(f"watch refused: {e}") from e
            raise
        return rv, n  # the server ended the watch (its timeout): resume from rv


class ListWatch(Reflector):
    """One collection at ``path`` (``params``: its label or field selector) listed and watched through
    ``client`` (set before ``start_loop``); every complete list and change calls ``changed``."""

    def __init__(
        self,
        metrics: ReflectorMetrics,
        path: str,
        changed: Callable[[], Awaitable[None]],
        *,
        params: Mapping[str, str] | None = None,
        watch_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(metrics, watch_timeout_s=watch_timeout_s)
        self.path, self.params, self.changed = path, dict(params or {}), changed
        self.client: KubeClient | None = None

    def what(self) -> str:
        return f"{self.path} {self.params}" if self.params else self.path

    async def list_page(self, *, limit: int, continue_token: str | None) -> dict:
        assert self.client is not None
        params = {**self.params, "limit": str(limit)}
        if continue_token:
            params["continue"] = continue_token
        return await self.client.get_object(self.path, params=params)

    def watch(self, *, resource_version: str, timeout_s: int) -> AsyncIterator[dict]:
        assert self.client is not None
        params = {**self.params, "resourceVersion": resource_version}
        return self.client.watch(self.path, params, timeout_s=timeout_s)

    async def publish(self) -> None:
        await self.changed()


def key_of(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise ApiError(0, f"{obj.get('kind') or 'an object'} without metadata.name", "decode")
    return meta.get("namespace") or "", name
