"""Kubernetes discovery: watch the engines' EndpointSlices and publish complete worker sets.

    watcher = EndpointSliceWatcher("llm", "kubernetes.io/service-name=engine", plane.set_workers,
                                   config=EngineDiscoveryConfig(kv_port=5557, replay_port=5657),
                                   registry=registry)
    await watcher.start()          # loads KUBECONFIG / in-cluster credentials; raises if there are none
    ...
    await watcher.stop()

List-then-watch, all on the event loop, through the project's Kubernetes client (``routerfleet_kube``:
credentials from the kubernetes client's own kubeconfig / in-cluster loaders, so exec plugins, token
files and rotation work):

* list every page (``limit``/``continue``), then publish the mapped set: a set is only ever published
  from a complete list, never from part of one (a list that fails mid-way publishes nothing);
* watch from the list's resourceVersion (with bookmarks); every event updates the local cache of slices
  and the set is recomputed from the cache and published if it changed; a watch that ends normally (the
  server-side timeout) is resumed from the last resourceVersion;
* 410 Gone (on the watch, or a continue token that expired) relists at once; any other failure (HTTP
  error, connection, timeout, undecodable body) marks the watcher unsynced, is counted by reason, and
  relists after a bounded, jittered exponential backoff.

``synced`` is False until the first complete list and again after any failure, until a relist succeeds.
The set last published stays in force while unsynced (emptying it would turn an API-server or RBAC
problem into an outage); ``synced``, ``last_error`` and the metrics make the condition visible.

With ``storage_annotation`` set, each new pod UID's pod is fetched once (GET, never list/watch) and the
storage identity its annotation declares (``storage_annotation.py``) goes into its WorkerSpec before
the set is published; a fetch that fails or is slow leaves that incarnation without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import replace
from typing import Protocol

import aiohttp
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter

from routerfleet_kube import ApiError, KubeClient, path

from ..worker import WorkerSpec
from .endpointslices import EngineDiscoveryConfig, map_slices
from .storage_annotation import Reading, Result, read_pod_storage, validate_annotation_key

log = logging.getLogger(__name__)

USER_AGENT = "routerfleet-router/discovery"
# Only the metadata of a pod (its spec can be large); an API server without it sends the whole pod.
POD_METADATA_ACCEPT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"

# errors_total reasons, pre-created at 0 so dashboards and alerts see them before the first error
REASONS = (
    "forbidden",  # 403: RBAC does not allow list/watch of endpointslices
    "unauthorized",  # 401: bad or expired credentials
    "gone",  # 410: resourceVersion or continue token too old (relisted at once; routine)
    "not_found",  # 404: e.g. the discovery.k8s.io/v1 API is not served
    "throttled",  # 429
    "server_error",  # 5xx
    "http_error",  # any other HTTP status
    "watch_error",  # an ERROR event on the watch stream other than 410
    "connection",  # could not connect, or the connection broke
    "timeout",  # connect or read timeout
    "decode",  # a response or event that is not the JSON we expect
    "callback",  # on_change raised
    "internal",  # anything else (a bug): logged with its traceback
)


class SliceApi(Protocol):
    """What the watcher needs from the API server (``KubeSlices``; tests pass an in-memory fake)."""

    async def list_slices(
        self, namespace: str | None, label_selector: str, *, limit: int, continue_token: str | None
    ) -> dict: ...

    def watch_slices(
        self, namespace: str | None, label_selector: str, *, resource_version: str, timeout_s: int
    ) -> AsyncIterator[dict]: ...

    async def get_pod(self, namespace: str, name: str, *, timeout_s: float) -> dict:
        """Only with ``storage_annotation``: the pod's metadata (GET; a failure raises ApiError)."""
        ...

    async def close(self) -> None: ...


# --------------------------------------------------------------------------------------- API client


class KubeSlices:
    """``SliceApi`` over the project's Kubernetes client."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    @classmethod
    async def connect(cls, kubeconfig: str | None = None, context: str | None = None) -> KubeSlices:
        return cls(await KubeClient.connect(kubeconfig, context, user_agent=USER_AGENT))

    async def close(self) -> None:
        await self.client.close()

    async def list_slices(
        self, namespace: str | None, label_selector: str, *, limit: int, continue_token: str | None
    ) -> dict:
        params = {"labelSelector": label_selector, "limit": str(limit)}
        if continue_token:
            params["continue"] = continue_token
        return await self.client.get_object(path("EndpointSlice", namespace), params=params)

    async def get_pod(self, namespace: str, name: str, *, timeout_s: float) -> dict:
        return await self.client.get_object(
            path("Pod", namespace, name), accept=POD_METADATA_ACCEPT, timeout_s=timeout_s
        )

    def watch_slices(
        self, namespace: str | None, label_selector: str, *, resource_version: str, timeout_s: int
    ) -> AsyncIterator[dict]:
        params = {"labelSelector": label_selector, "resourceVersion": resource_version}
        return self.client.watch(path("EndpointSlice", namespace), params, timeout_s=timeout_s)


# --------------------------------------------------------------------------------------- watcher


class DiscoveryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_discovery_"
        self.synced = Gauge(
            p + "synced", "1 when the worker set mirrors a complete, current list", registry=registry
        )
        self.errors = PromCounter(
            p + "errors", "Discovery list/watch failures, by reason", ["reason"], registry=registry
        )
        for reason in REASONS:
            self.errors.labels(reason)
        self.workers = Gauge(p + "workers", "Workers in the set last published", registry=registry)
        self.endpoints = Gauge(
            p + "endpoints",
            "Endpoints in the watched slices, by state (see endpointslices.py)",
            ["state"],
            registry=registry,
        )
        self.lists = PromCounter(
            p + "lists", "Complete lists of the watched EndpointSlices", registry=registry
        )
        self.storage_annotation = PromCounter(
            p + "storage_annotation",
            "Engine pods whose storage-identity annotation was read (--k8s-storage-annotation), by result",
            ["result"],
            registry=registry,
        )
        for result in Result:
            self.storage_annotation.labels(result.value)


class _Gone(Exception):
    pass


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


class PodStorageAnnotations:
    """The storage identity each engine pod's annotation declares (``storage_annotation.py``), merged
    into its WorkerSpec. The pod is read once per UID (GET, metadata only); readings are kept while the
    UID is in a watched slice.

    Decided once per incarnation, whatever the outcome: a spec that changed afterwards (an answer that
    came after the set was published, a retried failure) would look to the KV plane like the engine
    leaving and coming back. So a pod whose annotation could not be read within ``timeout_s`` (the
    most a publication waits) runs without that identity until it is replaced; its /server_info
    identity, if any, still counts."""

    def __init__(
        self,
        api: SliceApi,
        key: str,
        counter: PromCounter,
        *,
        timeout_s: float = 2.0,
        concurrency: int = 16,
        log_every_s: float = 60.0,
    ) -> None:
        self.key = validate_annotation_key(key)
        self.api = api
        self.counter = counter
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.log_every_s = log_every_s
        self.readings: dict[str, Reading] = {}  # pod UID -> what its annotation said
        self._last_warned: dict[Result, float] = {}
        self._unwarned: Counter[Result] = Counter()

    async def apply(self, workers: list[WorkerSpec]) -> list[WorkerSpec]:
        """``workers`` with the identity of each pod merged in; reads the pods not seen yet first."""
        new = [w for w in workers if w.incarnation and w.incarnation not in self.readings]
        if new:
            await self._read_all(new)
        out = []
        for w in workers:
            reading = self.readings.get(w.incarnation)
            ident = reading.identity if reading is not None else None
            out.append(replace(w, storage_id=ident.storage_id, storage_epoch=ident.epoch) if ident else w)
        return out

    def retain(self, uids: set[str]) -> None:
        """Forget the pods no longer in any watched slice."""
        for uid in self.readings.keys() - uids:
            del self.readings[uid]

    async def _read_all(self, workers: list[WorkerSpec]) -> None:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(w: WorkerSpec) -> Reading:
            async with gate:
                return await self._read(w)

        tasks = {asyncio.create_task(one(w), name=f"pod-annotation-{w.engine}"): w for w in workers}
        try:
            done, _pending = await asyncio.wait(tasks, timeout=self.timeout_s)
        finally:  # timed out, or the watcher stopped: nothing outlives this publication
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t, w in tasks.items():
            if t not in done or t.cancelled():
                reading = Reading(Result.TIMEOUT, why=f"no answer within {self.timeout_s:g}s")
            elif (exc := t.exception()) is not None:
                reading = Reading(Result.ERROR, why=repr(exc))
            else:
                reading = t.result()
            self._record(w, reading)

    async def _read(self, w: WorkerSpec) -> Reading:
        namespace, _, name = w.engine.partition("/")
        try:
            pod = await self.api.get_pod(namespace, name, timeout_s=self.timeout_s)
        except ApiError as e:
            return Reading(Result.FORBIDDEN if e.status == 403 else Result.ERROR, why=str(e))
        except TimeoutError:
            return Reading(Result.TIMEOUT, why=f"no answer within {self.timeout_s:g}s")
        except (aiohttp.ClientError, OSError) as e:
            return Reading(Result.ERROR, why=repr(e))
        except Exception as e:  # a bug: the engine still gets published, without this identity
            log.exception("discovery: reading pod %s failed", w.engine)
            return Reading(Result.ERROR, why=repr(e))
        return read_pod_storage(pod, self.key, w.incarnation)

    def _record(self, w: WorkerSpec, reading: Reading) -> None:
        self.readings[w.incarnation] = reading
        self.counter.labels(reading.result.value).inc()
        if reading.result is Result.FOUND:
            assert reading.identity is not None
            log.info(
                "discovery: engine %s: storage identity %s epoch %d from its pod's annotation",
                w.engine,
                reading.identity.storage_id,
                reading.identity.epoch,
            )
        elif reading.result is not Result.ABSENT:
            self._warn(w.engine, reading)

    def _warn(self, engine: str, reading: Reading) -> None:
        """At most one line per result per ``log_every_s``: a missing RBAC rule fails for every pod."""
        now = time.monotonic()
        if now - self._last_warned.get(reading.result, -float("inf")) < self.log_every_s:
            self._unwarned[reading.result] += 1
            return
        self._last_warned[reading.result] = now
        more = self._unwarned.pop(reading.result, 0)
        hint = " (the router's Role needs get on pods)" if reading.result is Result.FORBIDDEN else ""
        log.warning(
            "discovery: engine %s has no storage identity from annotation %s: %s: %s%s%s",
            engine,
            self.key,
            reading.result.value,
            reading.why[:300],
            hint,
            f"; {more} more pod(s) like this since the last such line" if more else "",
        )


def _pod_uids(slices: Iterable[dict]) -> set[str]:
    return {
        uid
        for sl in slices
        for ep in sl.get("endpoints") or []
        if (uid := (ep.get("targetRef") or {}).get("uid"))
    }


class EndpointSliceWatcher:
    """Publishes the complete worker set of the EndpointSlices matching ``label_selector`` in
    ``namespace`` (None: all namespaces) to ``on_change``, on the event loop, each time it changes.

    The first call, after the first complete list, may be an empty list ("synced and empty"); before it
    ``synced`` is False and ``workers`` is None ("not synced yet").

    ``storage_annotation``: a pod annotation key (``--k8s-storage-annotation``) whose storage identity
    goes into each engine's WorkerSpec (``PodStorageAnnotations``); a publication waits for new pods'
    reads at most ``storage_timeout_s``."""

    def __init__(
        self,
        namespace: str | None,
        label_selector: str,
        on_change: Callable[[list[WorkerSpec]], None],
        *,
        config: EngineDiscoveryConfig | None = None,
        api: SliceApi | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        registry: CollectorRegistry | None = None,
        watch_timeout_s: float = 300.0,
        page_limit: int = 500,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        storage_annotation: str | None = None,
        storage_timeout_s: float = 2.0,
    ) -> None:
        if storage_annotation:
            validate_annotation_key(storage_annotation)  # before start(): a bad key fails at once
        self.namespace = namespace or None
        self.label_selector = label_selector
        self.on_change = on_change
        self.config = config or EngineDiscoveryConfig()
        self._api = api
        self._kubeconfig, self._context = kubeconfig, context
        self.metrics = DiscoveryMetrics(registry if registry is not None else CollectorRegistry())
        self.watch_timeout_s = watch_timeout_s
        self.page_limit = page_limit
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._slices: dict[tuple[str, str], dict] = {}
        self._published: list[WorkerSpec] | None = None
        self._synced = False
        self._synced_event = asyncio.Event()
        self.last_error: str | None = None
        self.errors: Counter[str] = Counter()
        self._task: asyncio.Task | None = None
        self._warned: set[str] = set()
        self.storage_annotation = storage_annotation or None
        self._storage_timeout_s = storage_timeout_s
        self.storage: PodStorageAnnotations | None = None  # once started, with storage_annotation

    # ---- state ------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def workers(self) -> list[WorkerSpec] | None:
        """The set last published (a copy); None until the first one ("not synced yet")."""
        return list(self._published) if self._published is not None else None

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

    def _count(self, reason: str) -> None:
        self.errors[reason] += 1
        self.metrics.errors.labels(reason).inc()

    def _fail(self, reason: str, message: str) -> None:
        self._count(reason)
        self.last_error = f"{reason}: {message}"
        self._set_synced(False)

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start watching. Loads credentials first (raises if there are none); never waits for sync."""
        if self._task is not None:
            raise RuntimeError("watcher already started")
        if self._api is None:
            self._api = await KubeSlices.connect(self._kubeconfig, self._context)
        if self.storage_annotation:
            self.storage = PodStorageAnnotations(
                self._api,
                self.storage_annotation,
                self.metrics.storage_annotation,
                timeout_s=self._storage_timeout_s,
            )
        self._task = asyncio.create_task(self.run(), name=f"discovery-{self.namespace}-{self.label_selector}")

    async def stop(self) -> None:
        """Cancel the watch and close the API client's connections."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._api is not None:
            await self._api.close()
        self._set_synced(False)

    async def run(self) -> None:
        """The list/watch loop; runs until cancelled."""
        assert self._api is not None
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
            except _Gone as e:
                self._count("gone")
                now, prev = time.monotonic(), last_gone
                last_gone = now
                if now - prev > 1.0:  # routine: relist at once, and stay synced meanwhile
                    log.info("discovery of %s: %s; relisting", self._what(), e)
                    continue
                self.last_error = f"gone: {e}"
            except ApiError as e:
                self._fail(e.reason, str(e))
            except TimeoutError as e:
                self._fail("timeout", repr(e))
            except (aiohttp.ClientError, OSError) as e:
                self._fail("connection", repr(e))
            except Exception as e:
                log.exception("discovery of %s: unexpected error", self._what())
                self._fail("internal", repr(e))
            delay = self._backoff.next()
            log.warning("discovery of %s: %s; retrying in %.1fs", self._what(), self.last_error, delay)
            await asyncio.sleep(delay)

    def _what(self) -> str:
        return f"endpointslices {self.label_selector!r} in {self.namespace or 'all namespaces'}"

    # ---- list / watch ---------------------------------------------------------------------------

    async def _relist(self) -> str:
        items: dict[tuple[str, str], dict] = {}
        token: str | None = None
        rv = ""
        while True:
            try:
                page = await self._api.list_slices(
                    self.namespace, self.label_selector, limit=self.page_limit, continue_token=token
                )
            except ApiError as e:
                if e.status == 410:  # continue token expired mid-list: start over, publish nothing
                    raise _Gone(f"list continue token expired ({e})") from e
                raise
            meta = page.get("metadata") or {}
            for item in page.get("items") or []:
                items[_key(item)] = item
            rv = meta.get("resourceVersion") or rv
            token = meta.get("continue") or None
            if token is None:
                break
        if not rv:
            raise ApiError(200, "list response has no resourceVersion", "decode")
        self._slices = items  # only now: a failed or partial list never touches the cache
        self.metrics.lists.inc()
        self.last_error = None
        self._set_synced(True)
        await self._publish()
        return rv

    async def _watch(self, rv: str) -> tuple[str, int]:
        """Apply one watch's events; returns the last resourceVersion and the number of events."""
        timeout = max(1, round(self.watch_timeout_s * random.uniform(1.0, 1.5)))
        n = 0
        stream = self._api.watch_slices(
            self.namespace, self.label_selector, resource_version=rv, timeout_s=timeout
        )
        try:
            async with contextlib.aclosing(stream):
                async for ev in stream:
                    n += 1
                    kind, obj = ev["type"], ev["object"]
                    if kind == "ERROR":
                        code = int(obj.get("code") or 0)
                        if code == 410:
                            raise _Gone(f"watch expired: {obj.get('message', '')}")
                        raise ApiError(code, obj.get("message") or json.dumps(obj)[:500], "watch_error")
                    if kind in ("ADDED", "MODIFIED"):
                        self._slices[_key(obj)] = obj
                    elif kind == "DELETED":
                        self._slices.pop(_key(obj), None)
                    elif kind != "BOOKMARK":
                        raise ApiError(0, f"unknown watch event type {kind!r}", "decode")
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if kind != "BOOKMARK":
                        await self._publish()
        except ApiError as e:
            if e.status == 410:
                raise _Gone(f"watch refused: {e}") from e
            raise
        return rv, n  # the server ended the watch (its timeout): resume from rv

    async def _publish(self) -> None:
        mapping = map_slices(self._slices.values(), self.config)
        self.metrics.endpoints.clear()
        for state, n in mapping.states.items():
            self.metrics.endpoints.labels(state).set(n)
            if state.startswith("port_missing:") and state not in self._warned:
                self._warned.add(state)
                log.warning(
                    "discovery: %d endpoint(s) of %s unusable: slice lists no port named %r",
                    n,
                    self._what(),
                    state.partition(":")[2],
                )
        workers = mapping.workers
        if self.storage is not None:
            workers = await self.storage.apply(workers)
            self.storage.retain(_pod_uids(self._slices.values()))
        if workers == self._published:
            return
        try:
            self.on_change(list(workers))
        except Exception as e:
            log.exception("discovery: on_change failed")
            self._count("callback")
            self.last_error = f"callback: {e!r}"
            return  # not recorded as published: the next change (or relist) tries again
        self._published = workers
        self.metrics.workers.set(len(workers))
        log.info("discovery: %d worker(s): %s", len(workers), ", ".join(w.engine for w in workers))


def _key(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise ApiError(0, "EndpointSlice without metadata.name", "decode")
    return meta.get("namespace") or "", name
