"""Kubernetes engine discovery's configuration section (``RouterConfig.discovery``) and its flags."""

from __future__ import annotations

from dataclasses import dataclass

from routerfleet_kube import default_namespace

from ..flags import Count, Flag, Text
from .endpointslices import EngineDiscoveryConfig, port_ref
from .inference_pool import REVISION_LABEL
from .storage_annotation import validate_annotation_key


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    selector: str | None = None  # the engines' EndpointSlices; None: engines come from --worker
    # The prefill engines' EndpointSlices (docs/disaggregation.md): with it, ``selector``'s engines
    # decode, these prefill, and each engine's revision is read from its pod's label.
    prefill_selector: str | None = None
    # Or one Service's (or pool's) engines split by this pod label (prefill, decode or both), as llm-d
    # labels them (llm-d.ai/role); each engine's revision is read from its pod too.
    role_label: str | None = None
    revision_label: str = REVISION_LABEL
    pool: str | None = None  # or the pods of this InferencePool, on its target ports
    namespace: str | None = None  # None: the pod's own
    http_port: str = "http"
    kv_port: str | None = None
    replay_port: str | None = None
    dp_size: int = 1
    topic: str = ""
    kubeconfig: str | None = None
    watch_timeout_s: float = 300.0
    # A pod annotation key naming the engine's storage identity (KEY, and KEY-epoch); "": off.
    storage_annotation: str = ""

    @property
    def disaggregated(self) -> bool:
        """Discovery names the engines' roles (docs/disaggregation.md)."""
        return bool(self.prefill_selector or self.role_label)

    def watched_namespace(self) -> str:
        """Where the router watches (its engines' slices, its peers', its pool's objectives): the
        configured namespace, else the pod's own (or the kubeconfig context's)."""
        return self.namespace or default_namespace(self.kubeconfig)

    def engines(self) -> EngineDiscoveryConfig:
        """How an engine pod's slice ports map to a WorkerSpec."""
        return EngineDiscoveryConfig(
            http_port=port_ref(self.http_port),
            kv_port=port_ref(self.kv_port) if self.kv_port else None,
            replay_port=port_ref(self.replay_port) if self.replay_port else None,
            dp_size=self.dp_size,
            topic=self.topic,
        )


def _annotation_key(text: str) -> str:
    try:
        return validate_annotation_key(text.strip()) if text.strip() else ""
    except ValueError as exc:
        raise ValueError(f"not a Kubernetes annotation key: {exc}") from None


FLAGS = (
    Flag(
        "--k8s-selector",
        "discovery.selector",
        Text(),
        metavar="LABELS",
        help="EndpointSlices of the engines' Service, e.g. kubernetes.io/service-name=vllm",
    ),
    Flag(
        "--k8s-prefill-selector",
        "discovery.prefill_selector",
        Text(),
        metavar="LABELS",
        help="EndpointSlices of the prefill engines' Service (same ports): --k8s-selector's engines then"
        " decode (docs/disaggregation.md); each engine's revision is read from its pod (get on pods)",
    ),
    Flag(
        "--k8s-role-label",
        "discovery.role_label",
        Text(),
        metavar="KEY",
        help="the engine pods' label naming each one's role, in llm-d's values (its label is"
        " llm-d.ai/role): --k8s-selector's or the pool's engines split by it, instead of a second Service"
        " (docs/disaggregation.md); a pod without it is a whole engine (get on pods)",
    ),
    Flag(
        "--k8s-revision-label",
        "discovery.revision_label",
        Text(),
        metavar="KEY",
        help="the engine pods' label naming their revision: a prefill and a decode engine pair only when it"
        " is equal on both (unset on both: they pair)",
    ),
    Flag(
        "--k8s-inference-pool",
        "discovery.pool",
        Text(),
        metavar="NAME",
        help="or the pods this InferencePool (inference.networking.k8s.io/v1) selects, on its target"
        " ports, followed as the pool changes (needs get/list/watch on inferencepools and pods)",
    ),
    Flag(
        "--k8s-namespace",
        "discovery.namespace",
        Text(),
        "namespace of those slices",
        default_text="the pod's own",
    ),
    Flag("--k8s-http-port", "discovery.http_port", Text(), "engine HTTP port", metavar="NAME|NUM"),
    Flag(
        "--k8s-kv-port",
        "discovery.kv_port",
        Text(),
        "engine KV event PUB port of rank 0",
        metavar="NAME|NUM",
    ),
    Flag(
        "--k8s-replay-port",
        "discovery.replay_port",
        Text(),
        "engine KV replay port of rank 0",
        metavar="NAME|NUM",
    ),
    Flag("--k8s-dp-size", "discovery.dp_size", Count(1), "DP ranks per engine"),
    Flag("--k8s-topic", "discovery.topic", Text(), "KV event topic prefix", default_text="all"),
    Flag(
        "--kubeconfig",
        "discovery.kubeconfig",
        Text(),
        "kubeconfig",
        default_text="in-cluster, then $KUBECONFIG",
    ),
    Flag(
        "--k8s-watch-timeout-s",
        "discovery.watch_timeout_s",
        Count(1),
        "server-side watch timeout; also how soon a revoked RBAC rule shows as not synced",
    ),
    Flag(
        "--k8s-storage-annotation",
        "discovery.storage_annotation",
        Text(_annotation_key),
        metavar="KEY",
        default_text="off",
        help="read each engine pod's storage identity from its annotations KEY (the id) and KEY-epoch"
        " (default 0), e.g. routerfleet.io/storage-id; needs get on pods",
    ),
)
