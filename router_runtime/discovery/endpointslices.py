"""EndpointSlices -> WorkerSpecs: the pure half of Kubernetes discovery (no I/O; see ``kubernetes.py``).

One WorkerSpec per *pod* (identity ``<namespace>/<pod name>``, incarnation = the pod UID); its DP ranks
are ``(engine, rank)`` carriers with KV ports base + rank, as vLLM and SGLang bind them.

Routing rule: an endpoint is routable when it is ready, serving and not terminating, where a missing
``ready``/``serving`` counts as true and a missing ``terminating`` as false (the API's reading of nil).
``serving`` matters for Services with ``publishNotReadyAddresses`` (there ``ready`` is always true); a
terminating pod still serving its in-flight requests gets no new ones.

Ports: a name is looked up in the slice's ``ports`` (the pods' target ports, which is what we dial); a
number is used as is (the usual case for ZMQ ports, which the Service need not expose). A configured name
missing from a slice makes that slice's endpoints unusable (a misconfiguration, reported, never guessed).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..worker import WorkerSpec

PortRef = str | int

# Preferred address family when a pod is in several slices of a dual-stack Service.
_FAMILY_ORDER = {"IPv4": 0, "IPv6": 1, "FQDN": 2}


def port_ref(text: str) -> PortRef:
    """A command-line port reference: digits are a port number, anything else a port name."""
    text = text.strip()
    return int(text) if text.isdigit() else text


@dataclass(frozen=True, slots=True)
class EngineDiscoveryConfig:
    """How an engine pod's ports map to a WorkerSpec. ``kv_port``/``replay_port`` are rank 0's port
    (a slice port name or a number); ``None``: the engines publish no events / have no replay socket."""

    http_port: PortRef = "http"
    kv_port: PortRef | None = None
    replay_port: PortRef | None = None
    dp_size: int = 1
    topic: str = ""
    scheme: str = "http"

    def __post_init__(self) -> None:
        if self.scheme not in ("http", "https"):
            raise ValueError(f"scheme must be http or https, got {self.scheme!r}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        for name in ("http_port", "kv_port", "replay_port"):
            ref = getattr(self, name)
            if isinstance(ref, bool) or not isinstance(ref, str | int | None):
                raise ValueError(f"{name} must be a port name or number, got {ref!r}")
            if isinstance(ref, int) and not 1 <= ref <= 65535:
                raise ValueError(f"{name} must be in [1, 65535], got {ref}")
        for name in ("kv_port", "replay_port"):  # rank r uses base + r: the last rank must fit too
            ref = getattr(self, name)
            if isinstance(ref, int) and ref + self.dp_size - 1 > 65535:
                raise ValueError(f"{name} {ref} + dp_size {self.dp_size} - 1 exceeds 65535")


@dataclass(slots=True)
class SliceMapping:
    """The mapped worker set plus a count of endpoints per state, for metrics and logs.

    States: routable, not_ready, terminating, not_a_pod (no Pod targetRef), no_address (none, or not a
    valid address of the slice's type), and
    ``port_missing:<name>`` (a configured port name the slice does not list)."""

    workers: list[WorkerSpec]
    states: Counter[str] = field(default_factory=Counter)


def as_dict(obj: Any) -> Any:
    """A kubernetes-client model (snake_case attributes) as its API JSON (camelCase), recursively; dicts and
    scalars pass through. Mirrors ``ApiClient.sanitize_for_serialization`` without needing a client."""
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    if isinstance(obj, Mapping):
        return {k: as_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [as_dict(v) for v in obj]
    attribute_map = getattr(obj, "attribute_map", None)
    if attribute_map is not None:
        return {
            attribute_map[attr]: as_dict(getattr(obj, attr))
            for attr in attribute_map
            if getattr(obj, attr) is not None
        }
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    raise TypeError(f"cannot convert {type(obj).__name__} to API JSON")


def endpoint_state(conditions: Mapping[str, Any] | None) -> str:
    """``routable``, ``terminating`` or ``not_ready`` for an endpoint's ``conditions`` (nil-aware)."""
    c = conditions or {}
    if c.get("terminating") is True:
        return "terminating"
    if c.get("ready") is False or c.get("serving") is False:
        return "not_ready"
    return "routable"


def url_host(address: str, address_type: str = "IPv4") -> str | None:
    """An address as it goes in a URL (IPv6 in brackets); None if it is not a valid address."""
    try:
        if address_type == "FQDN":
            return address if address and "/" not in address and ":" not in address else None
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _resolve(ref: PortRef, ports: Mapping[str, int]) -> int | None:
    if isinstance(ref, int):
        return ref
    return ports.get(ref)


def _slice_ports(sl: Mapping[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in sl.get("ports") or []:
        if p.get("port") is None or (p.get("protocol") or "TCP") != "TCP":
            continue
        out.setdefault(p.get("name") or "", int(p["port"]))
    return out


def map_slices(slices: Iterable[Any], config: EngineDiscoveryConfig) -> SliceMapping:
    """Map EndpointSlices (API dicts or kubernetes-client models) to one WorkerSpec per routable pod,
    sorted by engine. An endpoint listed in several slices (mid-update, or dual-stack) counts once: a
    routable copy wins over an unroutable one, then the preferred address family (IPv4, IPv6, FQDN),
    then the slice name, so the result does not depend on the slices' order."""
    states: Counter[str] = Counter()
    best: dict[str, tuple[tuple, WorkerSpec]] = {}  # pod -> (preference, spec); lower wins
    pod_states: dict[str, tuple[tuple, str]] = {}  # pod -> (preference, state) of its best copy
    for raw in slices:
        sl = as_dict(raw)
        meta = sl.get("metadata") or {}
        slice_ns = meta.get("namespace") or ""
        slice_name = meta.get("name") or ""
        family = sl.get("addressType") or "IPv4"
        ports = _slice_ports(sl)
        refs = {"http": config.http_port, "kv": config.kv_port, "replay": config.replay_port}
        resolved = {k: _resolve(v, ports) if v is not None else None for k, v in refs.items()}
        missing = [str(refs[k]) for k in refs if refs[k] is not None and resolved[k] is None]
        for ep in sl.get("endpoints") or []:
            ref = ep.get("targetRef") or {}
            if ref.get("kind") != "Pod" or not ref.get("name"):
                states["not_a_pod"] += 1
                continue
            key = f"{ref.get('namespace') or slice_ns}/{ref['name']}"
            state = endpoint_state(ep.get("conditions"))
            addresses = ep.get("addresses") or []
            host = url_host(addresses[0], family) if addresses else None
            if state == "routable" and host is None:
                state = "no_address"
            if state == "routable" and missing:
                state = f"port_missing:{missing[0]}"
            pref = (state != "routable", _FAMILY_ORDER.get(family, 3), slice_name)
            if key not in pod_states or pref < pod_states[key][0]:
                pod_states[key] = (pref, state)
            if state != "routable":
                continue
            spec = WorkerSpec(
                engine=key,
                url=f"{config.scheme}://{host}:{resolved['http']}",
                kv=f"tcp://{host}:{resolved['kv']}" if resolved["kv"] is not None else None,
                replay=f"tcp://{host}:{resolved['replay']}" if resolved["replay"] is not None else None,
                dp_size=config.dp_size,
                topic=config.topic.encode(),
                incarnation=ref.get("uid") or "",
            )
            if key not in best or pref < best[key][0]:
                best[key] = (pref, spec)
    states.update(state for _pref, state in pod_states.values())
    return SliceMapping(sorted((spec for _pref, spec in best.values()), key=lambda w: w.engine), states)


def workers_from_slices(slices: Iterable[Any], config: EngineDiscoveryConfig) -> list[WorkerSpec]:
    """The complete worker set described by ``slices`` (see ``map_slices``)."""
    return map_slices(slices, config).workers
