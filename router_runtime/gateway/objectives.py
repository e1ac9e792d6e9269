"""The InferenceObjectives of the pool this picker serves, and their priorities.

A request names its objective in ``x-gateway-inference-objective``; an objective is an
``inference.networking.x-k8s.io`` InferenceObjective in the pool's namespace whose ``poolRef`` names the
pool (``--epp-pool``). Its ``priority`` (0 when unset) below 0 makes its requests sheddable
(scheduling/admission.py). The table follows the API server by list-then-watch (discovery/reflector.py);
an objective not (or no longer) known has priority 0: nothing is shed on a name alone.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable

from prometheus_client import CollectorRegistry, Gauge

from routerfleet_kube import KubeClient, path

from ..discovery.reflector import Reflector, ReflectorMetrics

log = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_KIND = "InferencePool"
USER_AGENT = "routerfleet-router/objectives"


def priorities(objects: Iterable[dict], pool: str) -> dict[str, int]:
    """Each objective's priority, by name, of the objects whose ``poolRef`` is the InferencePool
    ``pool`` (its group and kind defaulted as the CRD defaults them); objects being deleted excluded.
    A priority that is not an integer counts as unset (0)."""
    out: dict[str, int] = {}
    for obj in objects:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        ref = spec.get("poolRef") or {}
        if meta.get("deletionTimestamp") or not meta.get("name"):
            continue
        if ref.get("name") != pool or (ref.get("group") or POOL_GROUP) != POOL_GROUP:
            continue
        if (ref.get("kind") or POOL_KIND) != POOL_KIND:
            continue
        priority = spec.get("priority")
        out[meta["name"]] = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
    return out


class ObjectiveMetrics(ReflectorMetrics):
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_objectives_"
        super().__init__(
            registry,
            p,
            synced="1 when the objectives table mirrors a complete, current list",
            errors="InferenceObjective list/watch failures, by reason",
            lists="Complete lists of the InferenceObjectives",
        )
        self.sheddable = Gauge(
            p + "sheddable", "The pool's objectives whose priority is below 0", registry=registry
        )
        self.known = Gauge(p + "known", "The pool's objectives", registry=registry)


class Objectives(Reflector):
    """The priorities of ``pool``'s InferenceObjectives in ``namespace``, kept current."""

    metrics: ObjectiveMetrics

    def __init__(
        self,
        namespace: str,
        pool: str,
        registry: CollectorRegistry,
        *,
        kubeconfig: str | None = None,
        watch_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(ObjectiveMetrics(registry), watch_timeout_s=watch_timeout_s)
        self.namespace = namespace
        self.pool = pool
        self.table: dict[str, int] = {}
        self._kubeconfig = kubeconfig
        self._client: KubeClient | None = None

    def priority(self, objective: str) -> int:
        return self.table.get(objective, 0)

    async def start(self) -> None:
        """Loads credentials (raises if there are none), then follows the objectives in the background."""
        self._client = await KubeClient.connect(self._kubeconfig, user_agent=USER_AGENT)
        self.start_loop(f"objectives-{self.namespace}-{self.pool}")

    async def stop(self) -> None:
        await self.stop_loop()
        if self._client is not None:
            await self._client.close()

    def what(self) -> str:
        return f"InferenceObjectives of pool {self.pool!r} in {self.namespace}"

    async def list_page(self, *, limit: int, continue_token: str | None) -> dict:
        assert self._client is not None
        params = {"limit": str(limit)}
        if continue_token:
            params["continue"] = continue_token
        return await self._client.get_object(path("InferenceObjective", self.namespace), params=params)

    def watch(self, *, resource_version: str, timeout_s: int) -> AsyncIterator[dict]:
        assert self._client is not None
        return self._client.watch(
            path("InferenceObjective", self.namespace),
            {"resourceVersion": resource_version},
            timeout_s=timeout_s,
        )

    async def publish(self) -> None:
        table = priorities(self.objects.values(), self.pool)
        if table != self.table:
            log.info(
                "objectives of pool %s: %d (%d sheddable)",
                self.pool,
                len(table),
                sum(p < 0 for p in table.values()),
            )
        self.table = table
        self.metrics.known.set(len(table))
        self.metrics.sheddable.set(sum(p < 0 for p in table.values()))
