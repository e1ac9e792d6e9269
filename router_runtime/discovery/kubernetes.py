"""Kubernetes discovery: watch the engines' EndpointSlices (or an InferencePool's pods:
``InferencePoolWatcher``) and publish complete worker sets.

    watcher = EndpointSliceWatcher("llm", "kubernetes.io/service-name=engine", plane.set_workers,
                                   config=EngineDiscoveryConfig(kv_port=5557, replay_port=5657),
                                   registry=registry)
    await watcher.start()          # loads KUBECONFIG / in-cluster credentials; raises if there are none
    ...
    await watcher.stop()

List-then-watch (``reflector.py``: a set is only ever published from a complete list; 410 relists at
once; other failures unsync, are counted by reason and relist after a backoff; the set last published
stays in force while unsynced), through the project's Kubernetes client (``routerfleet_kube``:
credentials from the kubernetes client's own kubeconfig / in-cluster loaders, so exec plugins, token
files and rotation work).

With ``storage_annotation`` set, each new pod UID's pod is fetched once (GET, never list/watch) and the
storage identity its annotation declares (``storage_annotation.py``) goes into its WorkerSpec before
the set is published; a fetch that fails or is slow leaves that incarnation without one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

import aiohttp
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter

from routerfleet_kube import ApiError, KubeClient, path

from ..tasks import end_tasks
from ..worker import Role, WorkerSpec
from .endpointslices import EngineDiscoveryConfig, SliceMapping, map_slices
from .inference_pool import REVISION_LABEL, PoolShape, map_pool_pods, pod_revision, pod_role, pool_shape
from .reflector import ListWatch, Reflector, ReflectorMetrics
from .storage_annotation import Reading, Result, read_pod_storage, validate_annotation_key

log = logging.getLogger(__name__)

USER_AGENT = "routerfleet-router/discovery"
# While an engine is left out because its pod could not be read for its role label: how often the
# watcher publishes again (so reads it again), whether or not any slice changed.
UNREAD_RETRY_S = 5.0
UNREAD_RETRY_MAX_S = 60.0  # ... doubling while they stay unread
# Only the metadata of a pod (its spec can be large); an API server without it sends the whole pod.
POD_METADATA_ACCEPT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


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


class DiscoveryMetrics(ReflectorMetrics):
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_discovery_"
        super().__init__(
            registry,
            p,
            synced="1 when the worker set mirrors a complete, current list",
            errors="Discovery list/watch failures, by reason",
            lists="Complete lists of the watched EndpointSlices",
        )
        self.workers = Gauge(p + "workers", "Workers in the set last published", registry=registry)
        self.endpoints = Gauge(
            p + "endpoints",
            "Endpoints in the watched slices, by state (see endpointslices.py)",
            ["state"],
            registry=registry,
        )
        self.storage_annotation = PromCounter(
            p + "storage_annotation",
            "Engine pods whose storage-identity annotation was read (--k8s-storage-annotation), by result",
            ["result"],
            registry=registry,
        )
        for result in Result:
            self.storage_annotation.labels(result.value)


def publish_workers(
    watcher: EndpointSliceWatcher | InferencePoolWatcher,
    mapping: SliceMapping,
    errors: Reflector,
) -> None:
    """``mapping`` as ``watcher``'s engines: its states in the endpoint gauge, and its workers to
    ``on_change`` when they changed. A callback that raises counts against ``errors`` and publishes
    nothing, so the next change (or relist) tries again."""
    metrics = watcher.metrics
    metrics.endpoints.clear()
    for state, n in mapping.states.items():
        metrics.endpoints.labels(state).set(n)
    workers = mapping.workers
    if workers == watcher.published:
        return
    try:
        watcher.on_change(list(workers))
    except Exception as e:
        log.exception("discovery: on_change failed")
        errors.count("callback")
        errors.last_error = f"callback: {e!r}"
        return
    watcher.published = workers
    metrics.workers.set(len(workers))
    log.info("%s: %d worker(s): %s", watcher.what(), len(workers), ", ".join(w.engine for w in workers))


@dataclass(frozen=True, slots=True)
class PodReading:
    """What one read of an engine pod found: its storage identity (when asked), its revision and its
    role."""

    storage: Reading | None
    revision: str = ""
    read: bool = False  # the pod was read, and was this incarnation
    role: Role | None = Role.BOTH  # None: its role label names none this router can serve


class PodReadings:
    """What each engine pod declares beyond its slice, merged into its WorkerSpec: the storage identity
    of its annotation (``storage_annotation.py``, with ``storage_key``), its engine revision (the pod
    label ``revision_label``: disaggregation pairs engines of one revision) and its role (the pod label
    ``role_label``; ``inference_pool.pod_role``). The pod is read once per UID (GET, metadata only);
    readings are kept while the UID is in a watched slice.

    Decided once per incarnation, whatever the outcome: a spec that changed afterwards (an answer that
    came after the set was published, a retried failure) would look to the KV plane like the engine
    leaving and coming back. So a pod that could not be read within ``timeout_s`` (the most a
    publication waits) runs without that identity (and revision) until it is replaced; its /server_info
    identity, if any, still counts. The exception is a role label's pod: unread, it is not published at
    all, and read again at the next publication."""

    def __init__(
        self,
        api: SliceApi,
        counter: PromCounter,
        *,
        storage_key: str | None = None,
        revision_label: str | None = None,
        role_label: str | None = None,
        timeout_s: float = 2.0,
        concurrency: int = 16,
        log_every_s: float = 60.0,
    ) -> None:
        self.key = validate_annotation_key(storage_key) if storage_key else None
        self.revision_label = revision_label
        self.role_label = role_label
        self.api = api
        self.counter = counter
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.log_every_s = log_every_s
        self.readings: dict[str, PodReading] = {}  # pod UID -> what its read said
        self._last_warned: dict[Result, float] = {}
        self._unwarned: Counter[Result] = Counter()
        self._unrouted: set[str] = set()  # pod UIDs not published for want of their role (logged once)
        # Engines the last publication left out because their pod could not be read for its role: the
        # watcher publishes again after UNREAD_RETRY_S (slice events alone may not come for hours).
        self.left_unread = 0

    async def apply(self, workers: list[WorkerSpec]) -> list[WorkerSpec]:
        """``workers`` with what each pod declares merged in; reads the pods not seen yet first."""
        new = [w for w in workers if w.incarnation and w.incarnation not in self.readings]
        if new:
            await self._read_all(new)
        out = []
        self.left_unread = 0
        for w in workers:
            reading = self.readings.get(w.incarnation)
            if reading is None:
                out.append(w)
                continue
            ident = reading.storage.identity if reading.storage is not None else None
            if ident is not None:
                w = replace(w, storage_id=ident.storage_id, storage_epoch=ident.epoch)
            if self.revision_label and not reading.read:
                # Unknown is not "unlabelled": an engine whose revision could not be read pairs with
                # no other (it would hand KV across an engine rolling update unseen).
                w = replace(w, revision=f"unread:{w.incarnation}")
            elif reading.revision:
                w = replace(w, revision=reading.revision)
            if self.role_label and (not reading.read or reading.role is None):
                # A role unknown, or not served here: a prefill engine routed as a whole one would get
                # clients' requests. Not published; an unread pod is read again at the next
                # publication (never published before, so a later reading changes no spec).
                if not reading.read:
                    del self.readings[w.incarnation]
                    self.left_unread += 1
                self._not_routed(w, reading)
                continue
            if self.role_label:
                w = replace(w, role=reading.role)
            out.append(w)
        return out

    def _not_routed(self, w: WorkerSpec, reading: PodReading) -> None:
        """One log line per pod left out for its role."""
        if w.incarnation in self._unrouted:
            return
        self._unrouted.add(w.incarnation)
        if reading.read:
            why, hint = "names no role this router serves (docs/disaggregation.md)", ""
        else:
            failed = reading.storage  # a failed read says why there
            cause = failed.why if failed is not None else "another incarnation answered"
            why = f"could not be read ({cause[:300]})"
            forbidden = failed is not None and failed.result is Result.FORBIDDEN
            hint = "; the router's Role needs get on pods" if forbidden else ""
        log.warning(
            "discovery: engine %s not routed: its pod's role label %s %s%s",
            w.engine,
            self.role_label,
            why,
            hint,
        )

    def retain(self, uids: set[str]) -> None:
        """Forget the pods no longer in any watched slice."""
        for uid in self.readings.keys() - uids:
            del self.readings[uid]
        self._unrouted &= uids

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
                reading = PodReading(Reading(Result.TIMEOUT, why=f"no answer within {self.timeout_s:g}s"))
            elif (exc := t.exception()) is not None:
                reading = PodReading(Reading(Result.ERROR, why=repr(exc)))
            else:
                reading = t.result()
            self.readings[w.incarnation] = reading
            if reading.storage is not None and self.key:  # a failed read says why there, asked or not
                self._record(w, reading.storage)

    async def _read(self, w: WorkerSpec) -> PodReading:
        namespace, _, name = w.engine.partition("/")
        try:
            pod = await self.api.get_pod(namespace, name, timeout_s=self.timeout_s)
        except ApiError as e:
            return PodReading(Reading(Result.FORBIDDEN if e.status == 403 else Result.ERROR, why=str(e)))
        except TimeoutError:
            return PodReading(Reading(Result.TIMEOUT, why=f"no answer within {self.timeout_s:g}s"))
        except (aiohttp.ClientError, OSError) as e:
            return PodReading(Reading(Result.ERROR, why=repr(e)))
        except Exception as e:  # a bug: the engine still gets published, without what it declares
            log.exception("discovery: reading pod %s failed", w.engine)
            return PodReading(Reading(Result.ERROR, why=repr(e)))
        storage = read_pod_storage(pod, self.key, w.incarnation) if self.key else None
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        same = isinstance(meta, dict) and meta.get("uid") == w.incarnation  # not a replacement's labels
        revision = pod_revision(meta, self.revision_label) if self.revision_label and same else ""
        role = pod_role(meta, self.role_label) if self.role_label and same else Role.BOTH
        return PodReading(storage, revision, read=same, role=role)

    def _record(self, w: WorkerSpec, reading: Reading) -> None:
        """A storage reading's count and log line."""
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


class EndpointSliceWatcher(Reflector):
    """Publishes the complete worker set of the EndpointSlices matching ``label_selector`` in
    ``namespace`` (None: all namespaces) to ``on_change``, on the event loop, each time it changes.

    The first call, after the first complete list, may be an empty list ("synced and empty"); before it
    ``synced`` is False and ``workers`` is None ("not synced yet").

    ``storage_annotation``: a pod annotation key (``--k8s-storage-annotation``) whose storage identity
    goes into each engine's WorkerSpec; ``revision_label``: so does the revision that pod label names
    (``PodReadings``); a publication waits for new pods' reads at most ``storage_timeout_s``."""

    metrics: DiscoveryMetrics

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
        revision_label: str | None = None,
        role_label: str | None = None,
    ) -> None:
        if storage_annotation:
            validate_annotation_key(storage_annotation)  # before start(): a bad key fails at once
        super().__init__(
            DiscoveryMetrics(registry if registry is not None else CollectorRegistry()),
            watch_timeout_s=watch_timeout_s,
            page_limit=page_limit,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
        )
        self.namespace = namespace or None
        self.label_selector = label_selector
        self.on_change = on_change
        self.config = config or EngineDiscoveryConfig()
        self._api = api
        self._kubeconfig, self._context = kubeconfig, context
        self.published: list[WorkerSpec] | None = None  # the set last published
        self._warned: set[str] = set()
        self.storage_annotation = storage_annotation or None
        self._storage_timeout_s = storage_timeout_s
        self.revision_label = revision_label
        self.role_label = role_label
        # once started, with storage_annotation, revision_label or role_label
        self.pods: PodReadings | None = None
        self._publishing = asyncio.Lock()  # the watch's publications and the unread pods' retries
        self._retry: asyncio.Task | None = None

    @property
    def workers(self) -> list[WorkerSpec] | None:
        """The set last published (a copy); None until the first one ("not synced yet")."""
        return list(self.published) if self.published is not None else None

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start watching. Loads credentials first (raises if there are none); never waits for sync."""
        if self._api is None:
            self._api = await KubeSlices.connect(self._kubeconfig, self._context)
        if self.storage_annotation or self.revision_label or self.role_label:
            self.pods = PodReadings(
                self._api,
                self.metrics.storage_annotation,
                storage_key=self.storage_annotation,
                revision_label=self.revision_label,
                role_label=self.role_label,
                timeout_s=self._storage_timeout_s,
            )
        self.start_loop(f"discovery-{self.namespace}-{self.label_selector}")
        if self.role_label:
            self._retry = asyncio.create_task(self._retry_unread(), name="discovery-unread-pods")

    async def stop(self) -> None:
        """Cancel the watch and close the API client's connections."""
        await end_tasks([self._retry], "discovery")
        self._retry = None
        await self.stop_loop()
        if self._api is not None:
            await self._api.close()

    # ---- the reflector's parts ------------------------------------------------------------------

    def what(self) -> str:
        return f"discovery of endpointslices {self.label_selector!r} in {self.namespace or 'all namespaces'}"

    async def list_page(self, *, limit: int, continue_token: str | None) -> dict:
        assert self._api is not None
        return await self._api.list_slices(
            self.namespace, self.label_selector, limit=limit, continue_token=continue_token
        )

    def watch(self, *, resource_version: str, timeout_s: int) -> AsyncIterator[dict]:
        assert self._api is not None
        return self._api.watch_slices(
            self.namespace, self.label_selector, resource_version=resource_version, timeout_s=timeout_s
        )

    async def _retry_unread(self) -> None:
        """Publish again while engines are left out for a pod that could not be read for its role."""
        pause = UNREAD_RETRY_S
        while True:
            await asyncio.sleep(pause)
            if self.pods is not None and self.pods.left_unread and self.synced:
                try:
                    await self.publish()
                except Exception:  # the watch's own publications go on; this one is tried again
                    log.exception("discovery: publishing again for unread pods failed")
                # Still unread (a lasting failure: the Role lacks get on pods): ask less often.
                pause = min(pause * 2, UNREAD_RETRY_MAX_S) if self.pods.left_unread else UNREAD_RETRY_S

    async def publish(self) -> None:
        async with self._publishing:
            await self._publish()

    async def _publish(self) -> None:
        mapping = map_slices(self.objects.values(), self.config)
        for state, n in mapping.states.items():
            if state.startswith("port_missing:") and state not in self._warned:
                self._warned.add(state)
                log.warning(
                    "discovery: %d endpoint(s) of %s unusable: slice lists no port named %r",
                    n,
                    self.what(),
                    state.partition(":")[2],
                )
        if self.pods is not None:
            mapping.workers = await self.pods.apply(mapping.workers)
            self.pods.retain(_pod_uids(self.objects.values()))
        publish_workers(self, mapping, self)


class InferencePoolWatcher:
    """Publishes the engines of InferencePool ``pool`` in ``namespace`` (the pods its selector matches,
    on its target ports: ``inference_pool.py``) to ``on_change``, each time they change. Two list/watch
    loops: the pool itself (a changed selector or port list takes effect at once) and the namespace's
    pods, matched here as the extension's reference picker matches them (RBAC: get/list/watch on
    inferencepools and pods).

    ``workers`` is None until both are synced. A pool that is missing or malformed publishes no engine
    (never a guess), says why in ``last_error`` and counts under ``routerfleet_discovery_pool_errors``."""

    def __init__(
        self,
        namespace: str,
        pool: str,
        on_change: Callable[[list[WorkerSpec]], None],
        *,
        config: EngineDiscoveryConfig | None = None,
        kubeconfig: str | None = None,
        registry: CollectorRegistry | None = None,
        watch_timeout_s: float = 300.0,
        revision_label: str = REVISION_LABEL,
        role_label: str | None = None,
    ) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.namespace, self.pool, self.on_change = namespace, pool, on_change
        self.revision_label, self.role_label = revision_label, role_label  # map_pool_pods
        self.config = config or EngineDiscoveryConfig()
        self._kubeconfig = kubeconfig
        self.metrics = DiscoveryMetrics(registry)  # of the pods: what became engines
        pool_metrics = ReflectorMetrics(
            registry,
            "routerfleet_discovery_pool_",
            synced="1 when the InferencePool (--k8s-inference-pool) is listed and current",
            errors="InferencePool list/watch failures, and a pool missing or malformed, by reason",
            lists="Complete lists of the InferencePool",
        )
        self._pool = ListWatch(
            pool_metrics,
            path("InferencePool", namespace),
            self._publish,
            params={"fieldSelector": f"metadata.name={pool}"},
            watch_timeout_s=watch_timeout_s,
        )
        pods = path("Pod", namespace)
        self._pods = ListWatch(self.metrics, pods, self._publish, watch_timeout_s=watch_timeout_s)
        self.published: list[WorkerSpec] | None = None  # the set last published
        self._pool_error: str | None = None
        self._client: KubeClient | None = None

    @property
    def workers(self) -> list[WorkerSpec] | None:
        return list(self.published) if self.published is not None else None

    @property
    def last_error(self) -> str | None:
        return self._pool.last_error or self._pool_error or self._pods.last_error

    def what(self) -> str:
        return f"discovery of the pods of InferencePool {self.pool!r} in {self.namespace}"

    async def start(self) -> None:
        """Loads credentials first (raises if there are none); never waits for sync."""
        self._client = await KubeClient.connect(self._kubeconfig, user_agent=USER_AGENT)
        for loop, name in ((self._pool, "pool"), (self._pods, "pods")):
            loop.client = self._client
            loop.start_loop(f"discovery-{name}-{self.namespace}-{self.pool}")

    async def stop(self) -> None:
        await self._pool.stop_loop()
        await self._pods.stop_loop()
        if self._client is not None:
            await self._client.close()

    def _shape(self) -> PoolShape | None:
        found = [o for (_ns, name), o in self._pool.objects.items() if name == self.pool]
        why = None
        if not found:
            why = f"InferencePool {self.pool!r} not found in {self.namespace}"
        else:
            try:
                return pool_shape(found[0])
            except ValueError as e:
                why = f"InferencePool {self.pool!r}: {e}"
        if why != self._pool_error:
            self._pool.count("not_found" if not found else "decode")
            log.warning("discovery: %s; no engines from it", why)
        self._pool_error = why
        return None

    async def _publish(self) -> None:
        if not (self._pool.synced and self._pods.synced):
            return
        shape = self._shape()
        if shape is not None:
            self._pool_error = None
        mapping = (
            map_pool_pods(
                shape, self._pods.objects.values(), self.config, self.revision_label, self.role_label
            )
            if shape is not None
            else SliceMapping([])
        )
        publish_workers(self, mapping, self._pods)
