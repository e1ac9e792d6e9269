"""Kubernetes discovery without a cluster: EndpointSlices -> WorkerSpecs (pure), /server_info parsing
(pure), and the list/watch state machine driven by an in-memory fake API server. No network; the
client's own tests (watch bodies, credentials) are in test_kube_client.py."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime

import aiohttp
import pytest
from kubernetes.client import DiscoveryV1EndpointPort, V1EndpointSlice, V1ObjectMeta, V1ObjectReference
from kubernetes.client import V1Endpoint as V1Ep
from kubernetes.client import V1EndpointConditions as V1Cond
from kubernetes.config import ConfigException
from prometheus_client import CollectorRegistry

from router_runtime.discovery.endpointslices import (
    EngineDiscoveryConfig,
    as_dict,
    endpoint_state,
    map_slices,
    port_ref,
    workers_from_slices,
)
from router_runtime.discovery.kubernetes import EndpointSliceWatcher
from router_runtime.discovery.reflector import Backoff
from router_runtime.discovery.server_info import parse_server_info
from router_runtime.worker import WorkerSpec
from routerfleet_kube import ApiError
from tests.support import eventually

NS = "llm"
CFG = EngineDiscoveryConfig(http_port="http", kv_port="kv", replay_port=5657, dp_size=2, topic="t")
PORTS = [{"name": "http", "port": 8000, "protocol": "TCP"}, {"name": "kv", "port": 5557, "protocol": "TCP"}]


def ep(pod, ip, uid=None, ready=True, serving=None, terminating=None, ns=None, kind="Pod", addresses=None):
    cond = {
        k: v
        for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating))
        if v is not None
    }
    ref = {"kind": kind, "name": pod, "uid": uid or f"uid-{pod}"}
    if ns:
        ref["namespace"] = ns
    return {"addresses": [ip] if addresses is None else addresses, "conditions": cond, "targetRef": ref}


def sl(name, *endpoints, ports=PORTS, family="IPv4", ns=NS, rv="1"):
    return {
        "metadata": {"name": name, "namespace": ns, "resourceVersion": rv},
        "addressType": family,
        "ports": ports,
        "endpoints": list(endpoints),
    }


def spec(pod, ip, uid=None, cfg=CFG, host=None):
    host = host or ip
    return WorkerSpec(
        engine=f"{NS}/{pod}",
        url=f"http://{host}:8000",
        kv=f"tcp://{host}:5557",
        replay=f"tcp://{host}:5657",
        dp_size=cfg.dp_size,
        topic=cfg.topic.encode(),
        incarnation=uid or f"uid-{pod}",
    )


# ------------------------------------------------------------------------------------------ mapping


def test_ready_endpoints_become_workers_sorted_by_engine():
    got = workers_from_slices([sl("s1", ep("b", "10.0.0.2"), ep("a", "10.0.0.1"))], CFG)
    assert got == [spec("a", "10.0.0.1"), spec("b", "10.0.0.2")]
    assert got[0].carriers()[1].rank == 1 and got[0].topic == b"t"


def test_empty_and_missing_fields():
    assert workers_from_slices([], CFG) == []
    assert workers_from_slices([{"metadata": {"name": "x"}}], CFG) == []  # no endpoints, no ports
    assert workers_from_slices([sl("s", ports=PORTS)], CFG) == []


@pytest.mark.parametrize(
    ("conds", "state"),
    [
        ({}, "routable"),  # nil ready/serving = true, nil terminating = false
        ({"ready": True}, "routable"),
        ({"ready": True, "serving": True, "terminating": False}, "routable"),
        ({"ready": False}, "not_ready"),
        ({"ready": False, "serving": False}, "not_ready"),
        ({"ready": True, "serving": False}, "not_ready"),  # publishNotReadyAddresses: ready is always true
        ({"ready": False, "serving": True, "terminating": True}, "terminating"),  # draining: no new requests
        ({"ready": True, "serving": True, "terminating": True}, "terminating"),  # publishNotReadyAddresses
        ({"serving": True, "terminating": True}, "terminating"),
    ],
)
def test_conditions(conds, state):
    assert endpoint_state(conds) == state
    e = ep("a", "10.0.0.1", ready=None)
    e["conditions"] = conds
    m = map_slices([sl("s", e)], CFG)
    assert m.states == {state: 1}
    assert m.workers == ([spec("a", "10.0.0.1")] if state == "routable" else [])
    assert endpoint_state(None) == "routable"


def test_endpoints_without_a_pod_target_are_skipped():
    e_none = ep("x", "10.0.0.9")
    del e_none["targetRef"]
    e_node = ep("n", "10.0.0.8", kind="Node")
    e_noname = ep("", "10.0.0.7")
    m = map_slices([sl("s", e_none, e_node, e_noname, ep("a", "10.0.0.1"))], CFG)
    assert m.workers == [spec("a", "10.0.0.1")]
    assert m.states == {"routable": 1, "not_a_pod": 3}


def test_bad_or_missing_addresses():
    m = map_slices(
        [
            sl(
                "s",
                ep("a", "", addresses=[]),
                ep("b", "not-an-ip"),
                ep("c", "10.0.0.3", addresses=["10.0.0.3", "x"]),
            )
        ],
        CFG,
    )
    assert m.workers == [spec("c", "10.0.0.3")]  # the first address is used; the others are fungible
    assert m.states == {"no_address": 2, "routable": 1}
    # an unroutable endpoint needs no address
    assert map_slices([sl("s", ep("a", "", addresses=[], ready=False))], CFG).states == {"not_ready": 1}


def test_ports_by_name_or_number():
    cfg = EngineDiscoveryConfig(http_port=8080, kv_port=6000, replay_port=None, dp_size=1)
    (w,) = workers_from_slices([sl("s", ep("a", "10.0.0.1"), ports=[])], cfg)
    assert (w.url, w.kv, w.replay, w.dp_size, w.topic) == (
        "http://10.0.0.1:8080",
        "tcp://10.0.0.1:6000",
        None,
        1,
        b"",
    )
    (w,) = workers_from_slices([sl("s", ep("a", "10.0.0.1"))], EngineDiscoveryConfig())  # defaults
    assert (w.url, w.kv, w.replay) == ("http://10.0.0.1:8000", None, None)
    # a Service with one unnamed port: its slice port has the name ""
    unnamed = [{"name": "", "port": 9000}]
    (w,) = workers_from_slices(
        [sl("s", ep("a", "10.0.0.1"), ports=unnamed)], EngineDiscoveryConfig(http_port="")
    )
    assert w.url == "http://10.0.0.1:9000"
    # same name on UDP does not count; a port without a number is ignored
    udp = [{"name": "http", "port": 53, "protocol": "UDP"}, {"name": "http"}, {"name": "http", "port": 8001}]
    (w,) = workers_from_slices([sl("s", ep("a", "10.0.0.1"), ports=udp)], EngineDiscoveryConfig())
    assert w.url == "http://10.0.0.1:8001"
    cfg = EngineDiscoveryConfig(scheme="https", kv_port="kv", replay_port="kv")
    (w,) = workers_from_slices([sl("s", ep("a", "10.0.0.1"))], cfg)
    assert (w.url, w.replay) == ("https://10.0.0.1:8000", "tcp://10.0.0.1:5557")


def test_missing_named_port_makes_the_slice_unusable():
    only_http = [{"name": "http", "port": 8000}]
    m = map_slices([sl("s", ep("a", "10.0.0.1"), ep("b", "10.0.0.2", ready=False), ports=only_http)], CFG)
    assert m.workers == []
    assert m.states == {"port_missing:kv": 1, "not_ready": 1}
    m = map_slices([sl("s", ep("a", "10.0.0.1"), ports=[{"name": "kv", "port": 1}])], CFG)
    assert m.states == {"port_missing:http": 1}
    # ... but only that slice: another slice that lists the port still maps
    m = map_slices([sl("s1", ep("a", "10.0.0.1"), ports=only_http), sl("s2", ep("b", "10.0.0.2"))], CFG)
    assert m.workers == [spec("b", "10.0.0.2")]


def test_namespace_from_target_ref_or_slice():
    m = map_slices([sl("s", ep("a", "10.0.0.1", ns="other"), ep("b", "10.0.0.2"))], CFG)
    assert [w.engine for w in m.workers] == ["llm/b", "other/a"]


def test_duplicates_across_slices_are_merged_order_independently():
    ready = sl("s-b", ep("a", "10.0.0.1"), ep("b", "10.0.0.2"))
    stale = sl("s-a", ep("a", "10.0.0.1", ready=False, terminating=True), ep("c", "10.0.0.3"))
    dup = sl("s-c", ep("b", "10.0.0.2"))
    want = [spec("a", "10.0.0.1"), spec("b", "10.0.0.2"), spec("c", "10.0.0.3")]
    for perm in itertools.permutations([ready, stale, dup]):
        m = map_slices(perm, CFG)
        assert m.workers == want
        assert m.states == {"routable": 3}  # each pod counted once, by its best copy


def test_same_pod_name_new_uid_ready_copy_wins():
    """A StatefulSet pod re-created under its name: the old copy terminating, the new one ready."""
    old = sl("s1", ep("engine-0", "10.0.0.1", uid="old", ready=False, terminating=True))
    new = sl("s2", ep("engine-0", "10.0.0.5", uid="new"))
    for perm in ([old, new], [new, old]):
        (w,) = workers_from_slices(perm, CFG)
        assert (w.engine, w.incarnation, w.url) == ("llm/engine-0", "new", "http://10.0.0.5:8000")
    # both ready (a stale copy mid-update): deterministic, by slice name
    a = sl("s1", ep("engine-0", "10.0.0.1", uid="old"))
    b = sl("s2", ep("engine-0", "10.0.0.5", uid="new"))
    assert (
        workers_from_slices([b, a], CFG)
        == workers_from_slices([a, b], CFG)
        == [spec("engine-0", "10.0.0.1", "old")]
    )


def test_dual_stack_prefers_ipv4_and_brackets_ipv6():
    v6 = sl("s6", ep("a", "fd00::1"), ep("b", "fd00::2"), family="IPv6")
    v4 = sl("s4", ep("a", "10.0.0.1"))
    for perm in ([v6, v4], [v4, v6]):
        assert workers_from_slices(perm, CFG) == [
            spec("a", "10.0.0.1"),
            spec("b", "fd00::2", host="[fd00::2]"),
        ]
    fqdn = sl("sf", ep("f", "engine-f.example"), ep("g", "bad:name"), family="FQDN")
    m = map_slices([fqdn], CFG)
    assert [w.url for w in m.workers] == ["http://engine-f.example:8000"] and m.states["no_address"] == 1


def test_kubernetes_client_models_map_like_dicts():
    model = V1EndpointSlice(
        address_type="IPv4",
        metadata=V1ObjectMeta(name="s", namespace=NS, creation_timestamp=datetime(2026, 1, 1, tzinfo=UTC)),
        ports=[
            DiscoveryV1EndpointPort(name="http", port=8000, protocol="TCP"),
            DiscoveryV1EndpointPort(name="kv", port=5557),
        ],
        endpoints=[
            V1Ep(
                addresses=["10.0.0.1"],
                conditions=V1Cond(ready=True),
                target_ref=V1ObjectReference(kind="Pod", name="a", uid="uid-a"),
            ),
            V1Ep(
                addresses=["10.0.0.2"],
                conditions=V1Cond(ready=False),
                target_ref=V1ObjectReference(kind="Pod", name="b", uid="uid-b"),
            ),
        ],
    )
    assert workers_from_slices([model], CFG) == [spec("a", "10.0.0.1")]
    assert as_dict(model)["metadata"]["creationTimestamp"] == "2026-01-01T00:00:00+00:00"
    assert as_dict(model)["endpoints"][0]["targetRef"] == {"kind": "Pod", "name": "a", "uid": "uid-a"}
    with pytest.raises(TypeError):
        as_dict(object())


@pytest.mark.parametrize(
    "kw",
    [
        {"scheme": "tcp"},
        {"dp_size": 0},
        {"http_port": 0},
        {"kv_port": 70000},
        {"replay_port": True},
        {"kv_port": 1.5},
        {"kv_port": 65535, "dp_size": 2},
    ],
)
def test_config_validation(kw):
    with pytest.raises(ValueError):
        EngineDiscoveryConfig(**kw)


# ------------------------------------------------------------------------------------------ /server_info

FAKE_INFO = {
    "kv_events": {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "replay_port_base": 5657,
        "topic": "kv",
        "block_size": 16,
        "dp_size": 2,
        "dialect": "sglang",
    },
    "incarnation": "inc-1",
    "page_size": 16,
}


def test_server_info_wildcard_host_is_the_url_host():
    info = parse_server_info("http://10.0.0.1:30000/", FAKE_INFO)
    assert info.spec == WorkerSpec(
        engine="http://10.0.0.1:30000",
        url="http://10.0.0.1:30000",
        kv="tcp://10.0.0.1:5557",
        replay="tcp://10.0.0.1:5657",
        dp_size=2,
        topic=b"kv",
        incarnation="inc-1",
    )
    assert (info.block_size, info.dialect) == (16, "sglang")
    for wildcard in ("0.0.0.0", "::", "", None):
        body = {"kv_events": {**FAKE_INFO["kv_events"], "endpoint_host": wildcard}}
        assert parse_server_info("http://[fd00::1]:30000", body).spec.kv == "tcp://[fd00::1]:5557"


def test_server_info_variants():
    body = {"kv_events": {**FAKE_INFO["kv_events"], "endpoint_host": "10.9.9.9"}}
    s = parse_server_info("http://e:1", body, engine="llm/e", incarnation="uid").spec
    assert (s.engine, s.kv, s.incarnation) == ("llm/e", "tcp://10.9.9.9:5557", "uid")
    s = parse_server_info(
        "http://e:1", {"kv_events": {"endpoint_host": "fd00::9", "endpoint_port_base": "7"}}
    ).spec
    assert (s.kv, s.replay, s.dp_size, s.topic) == ("tcp://[fd00::9]:7", None, 1, b"")
    for bracketed in (
        {"endpoint_host": "[fd00::9]", "endpoint_port_base": 7},
        {"endpoint": "tcp://[fd00::9]:7"},
    ):
        assert parse_server_info("http://e:1", {"kv_events": bracketed}).spec.kv == "tcp://[fd00::9]:7"
    s = parse_server_info("http://e:1", {"kv_events": '{"endpoint": "tcp://*:5557"}', "dp_size": 4}).spec
    assert (s.kv, s.dp_size) == ("tcp://e:5557", 4)
    info = parse_server_info("http://e:1", {"kv_events": {"publisher": "null", "endpoint_port_base": 1}})
    assert info.spec.kv is None and info.block_size is None and info.dialect is None
    assert parse_server_info("http://e:1", {}).spec == WorkerSpec(engine="http://e:1", url="http://e:1")
    assert parse_server_info("http://e:1", {"kv_events": ""}).spec.kv is None
    bad_ports = (
        {"endpoint_port_base": 0},
        {"endpoint_port_base": 70000},
        {"endpoint_port_base": 5557, "replay_port_base": -1},
        {"endpoint_port_base": 65535, "dp_size": 2},  # rank 1 would be past the last port
    )
    for bad in ({"endpoint_port_base": "x"}, {"endpoint_port_base": True}, {"dp_size": -1}, *bad_ports):
        with pytest.raises(ValueError):
            parse_server_info("http://e:1", {"kv_events": {"endpoint_host": "*", **bad}})
    with pytest.raises(ValueError):
        parse_server_info("/no-host", {"kv_events": {"endpoint_host": "*", "endpoint_port_base": 1}})


# ------------------------------------------------------------------------------------------ the watcher

END = object()  # the server closes the watch normally


class FakeApi:
    """An in-memory API server: ``items`` are listed in pages; ``events`` feed the current watch;
    ``list_errors`` / ``watch_errors`` are raised by the next calls, in order."""

    def __init__(self, items=(), rv="10"):
        self.items = list(items)
        self.rv = rv
        self.events: asyncio.Queue = asyncio.Queue()
        self.list_errors: list[Exception] = []
        self.watch_errors: list[Exception] = []
        self.list_calls: list[str | None] = []
        self.watch_calls: list[str] = []
        self.watching = 0
        self.closed = False

    async def list_slices(self, namespace, label_selector, *, limit, continue_token):
        assert namespace == NS and label_selector == "app=engine"
        self.list_calls.append(continue_token)
        if self.list_errors:
            raise self.list_errors.pop(0)
        start = int(continue_token or 0)
        page = self.items[start : start + limit]
        meta = {"resourceVersion": self.rv}
        if start + limit < len(self.items):
            meta["continue"] = str(start + limit)
        return {"metadata": meta, "items": page}

    async def watch_slices(self, namespace, label_selector, *, resource_version, timeout_s):
        assert timeout_s >= 1
        self.watch_calls.append(resource_version)
        if self.watch_errors:
            raise self.watch_errors.pop(0)
        self.watching += 1
        try:
            while True:
                item = await self.events.get()
                if item is END:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.watching -= 1

    async def close(self):
        self.closed = True


def ev(kind, obj):
    return {"type": kind, "object": obj}


class Harness:
    def __init__(self, api: FakeApi, **kw):
        self.api = api
        self.calls: list[list[WorkerSpec]] = []
        self.registry = CollectorRegistry()
        self.w = EndpointSliceWatcher(
            NS,
            "app=engine",
            self.calls.append,
            config=CFG,
            api=api,
            registry=self.registry,
            backoff_initial_s=0.001,
            backoff_max_s=0.01,
            **kw,
        )

    def metric(self, name, **labels):
        return self.registry.get_sample_value(name, labels)

    def errors(self, reason):
        return self.metric("routerfleet_discovery_errors_total", reason=reason)

    async def __aenter__(self):
        await self.w.start()
        return self

    async def __aexit__(self, *exc):
        await self.w.stop()


def names(specs):
    return [w.engine.split("/")[1] for w in specs]


async def test_synced_and_empty_is_published_once():
    api = FakeApi()
    h = Harness(api)
    assert not h.w.synced and h.w.workers is None and h.metric("routerfleet_discovery_synced") == 0
    assert h.errors("forbidden") == 0  # reasons exist before the first error
    async with h:
        assert await h.w.wait_synced(2)
        await eventually(lambda: api.watching, what="watch started")
        assert h.calls == [[]] and h.w.workers == [] and h.w.last_error is None
        assert (
            h.metric("routerfleet_discovery_synced") == 1 and h.metric("routerfleet_discovery_workers") == 0
        )
        assert api.watch_calls == ["10"]
    assert api.closed and not h.w.synced


async def test_paged_list_publishes_only_the_complete_set():
    slices = [sl(f"s{i}", ep(f"p{i}", f"10.0.0.{i + 1}")) for i in range(5)]
    api = FakeApi(slices)
    # page 3 of the first list fails: nothing may be published from pages 1-2
    h = Harness(api, page_limit=2)
    orig = api.list_slices
    failed = []

    async def flaky(namespace, label_selector, *, limit, continue_token):
        if continue_token == "4" and not failed:
            failed.append(1)
            raise ApiError(500, "etcd hiccup")
        return await orig(namespace, label_selector, limit=limit, continue_token=continue_token)

    api.list_slices = flaky
    async with h:
        await eventually(lambda: h.calls, what="first publish")
        assert h.calls == [[spec(f"p{i}", f"10.0.0.{i + 1}") for i in range(5)]]  # one call, all five
        assert api.list_calls == [None, "2", None, "2", "4"]  # failed at "4", relisted from scratch
        assert h.errors("server_error") == 1 and h.w.errors["server_error"] == 1
        assert h.metric("routerfleet_discovery_lists_total") == 1


async def test_expired_continue_token_relists_from_scratch_without_unsyncing():
    api = FakeApi([sl("s0", ep("a", "10.0.0.1")), sl("s1", ep("b", "10.0.0.2"))])
    orig = api.list_slices

    async def expiring(namespace, label_selector, *, limit, continue_token):
        if continue_token and api.list_calls.count("1") == 0:
            api.list_calls.append(continue_token)
            raise ApiError(410, "The provided continue parameter is too old")
        return await orig(namespace, label_selector, limit=limit, continue_token=continue_token)

    api.list_slices = expiring
    async with Harness(api, page_limit=1) as h:
        await eventually(lambda: h.calls, what="publish")
        assert names(h.calls[-1]) == ["a", "b"] and len(h.calls) == 1
        assert h.w.errors["gone"] == 1 and h.w.synced


async def test_watch_events_update_the_set_and_unchanged_sets_are_not_republished():
    s1 = sl("s1", ep("a", "10.0.0.1"), rv="11")
    api = FakeApi([s1])
    async with Harness(api) as h:
        await eventually(lambda: api.watching, what="watch")
        assert names(h.calls[-1]) == ["a"]
        await api.events.put(ev("ADDED", sl("s2", ep("b", "10.0.0.2"), rv="12")))
        await eventually(lambda: len(h.calls) == 2, what="b added")
        assert names(h.calls[-1]) == ["a", "b"] and h.metric("routerfleet_discovery_workers") == 2
        # b terminating: dropped at once; a re-labelled copy of s1 changing nothing: no call
        await api.events.put(
            ev("MODIFIED", sl("s2", ep("b", "10.0.0.2", ready=False, terminating=True), rv="13"))
        )
        await api.events.put(ev("MODIFIED", {**s1, "metadata": {**s1["metadata"], "resourceVersion": "14"}}))
        await api.events.put(ev("BOOKMARK", {"metadata": {"resourceVersion": "15"}}))
        await eventually(lambda: len(h.calls) == 3, what="b dropped")
        assert names(h.calls[-1]) == ["a"]
        assert h.metric("routerfleet_discovery_endpoints", state="terminating") == 1
        # a replaced by a new pod (new uid = new incarnation) in the same slice
        await api.events.put(ev("MODIFIED", sl("s1", ep("a2", "10.0.0.3", uid="u-new"), rv="16")))
        await eventually(lambda: len(h.calls) == 4, what="a replaced")
        assert h.calls[-1] == [spec("a2", "10.0.0.3", "u-new")]
        await api.events.put(ev("DELETED", sl("s1", rv="17")))
        await api.events.put(ev("DELETED", sl("s2", rv="18")))
        await eventually(lambda: len(h.calls) == 5, what="all gone")
        assert h.calls[-1] == [] and h.w.synced
        # the server ends the watch: resumed from the last resourceVersion, no relist
        await api.events.put(END)
        await eventually(lambda: len(api.watch_calls) == 2, what="re-watch")
        assert api.watch_calls == ["10", "18"] and api.list_calls == [None]


async def test_watch_expired_relists_and_stays_synced():
    api = FakeApi([sl("s1", ep("a", "10.0.0.1"))])
    async with Harness(api) as h:
        await eventually(lambda: api.watching, what="watch")
        unsynced = []
        api.items = [sl("s1", ep("a", "10.0.0.1")), sl("s2", ep("b", "10.0.0.2"))]  # changed while expired
        api.rv = "20"
        orig = api.list_slices

        async def spy(*a, **kw):
            unsynced.append(not h.w.synced)
            return await orig(*a, **kw)

        api.list_slices = spy
        await api.events.put(
            ev("ERROR", {"kind": "Status", "code": 410, "message": "too old resource version"})
        )
        await eventually(lambda: len(h.calls) == 2, what="relisted set")
        assert names(h.calls[-1]) == ["a", "b"] and unsynced == [False]
        assert h.w.errors["gone"] == 1 and h.w.last_error is None
        await eventually(lambda: api.watch_calls[-1:] == ["20"], what="watch from the new list")
        # 410 as an HTTP status on the watch request: the same
        api.watch_errors = [ApiError(410, "gone")]
        await api.events.put(END)
        await eventually(lambda: h.w.errors["gone"] == 2, what="second 410")
        assert h.w.synced


async def test_repeated_gone_backs_off():
    api = FakeApi()
    api.list_errors = [ApiError(410, "expired")] * 3
    async with Harness(api) as h:
        await eventually(lambda: h.calls, what="publish")
        assert h.w.errors["gone"] == 3 and h.w.last_error is None


async def test_forbidden_is_visible_and_never_synced():
    api = FakeApi([sl("s1", ep("a", "10.0.0.1"))])
    msg = 'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:llm:router" cannot list'
    api.list_errors = [ApiError(403, msg)] * 1000
    async with Harness(api) as h:
        await eventually(lambda: h.w.errors["forbidden"] >= 3, what="forbidden retried")
        assert not h.w.synced and h.w.workers is None and h.calls == []
        assert (
            h.w.last_error.startswith("forbidden: HTTP 403: endpointslices")
            and "cannot list" in h.w.last_error
        )
        assert h.errors("forbidden") >= 3 and h.metric("routerfleet_discovery_synced") == 0
        assert not await h.w.wait_synced(0.01)
        api.list_errors = []  # RBAC fixed
        assert await h.w.wait_synced(2)
        assert names(h.calls[-1]) == ["a"] and h.w.last_error is None


async def test_failure_after_sync_keeps_the_last_set_and_unsyncs():
    api = FakeApi([sl("s1", ep("a", "10.0.0.1"))])
    async with Harness(api) as h:
        await eventually(lambda: api.watching, what="watch")
        api.list_errors = [ApiError(403, "forbidden")] * 1000
        api.watch_errors = [ApiError(403, "forbidden")]
        await api.events.put(END)  # the running watch ends; the next one is refused
        await eventually(lambda: not h.w.synced, what="unsynced")
        await eventually(lambda: h.w.errors["forbidden"] >= 2, what="relist refused too")
        assert h.calls == [[spec("a", "10.0.0.1")]] and h.w.workers == [spec("a", "10.0.0.1")]
        assert h.metric("routerfleet_discovery_workers") == 1


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (aiohttp.ClientConnectionError("refused"), "connection"),
        (ConnectionResetError(), "connection"),
        (TimeoutError(), "timeout"),
        (ApiError(401, "Unauthorized"), "unauthorized"),
        (ApiError(404, "no such API"), "not_found"),
        (ApiError(429, "slow down"), "throttled"),
        (ApiError(503, "unavailable"), "server_error"),
        (ApiError(400, "bad selector"), "http_error"),
        (ApiError(0, "not json", "decode"), "decode"),
        (RuntimeError("bug"), "internal"),
    ],
)
async def test_error_reasons(exc, reason):
    api = FakeApi([sl("s1", ep("a", "10.0.0.1"))])
    async with Harness(api) as h:
        await eventually(lambda: api.watching, what="watch")
        await api.events.put(exc)  # breaks the running watch
        await eventually(lambda: h.w.errors[reason] == 1, what=reason)
        assert h.errors(reason) == 1
        assert await h.w.wait_synced(2)  # relisted after the backoff
        assert len(api.list_calls) == 2 and len(h.calls) == 1  # same set: not republished


async def test_watch_error_event_and_bad_events():
    api = FakeApi([sl("s1", ep("a", "10.0.0.1"))])
    async with Harness(api) as h:
        await eventually(lambda: api.watching, what="watch")
        await api.events.put(ev("ERROR", {"code": 500, "message": "internal"}))
        await eventually(lambda: h.w.errors["watch_error"] == 1, what="watch_error")
        await eventually(lambda: api.watching, what="watch again")
        await api.events.put(ev("WEIRD", {"metadata": {"name": "x"}}))
        await eventually(lambda: h.w.errors["decode"] == 1, what="unknown type")
        await eventually(lambda: api.watching, what="watch again")
        await api.events.put(ev("ADDED", {"metadata": {}}))  # no name
        await eventually(lambda: h.w.errors["decode"] == 2, what="nameless slice")
        assert await h.w.wait_synced(2)


async def test_list_without_resource_version_is_an_error():
    api = FakeApi(rv="")
    async with Harness(api) as h:
        await eventually(lambda: h.w.errors["decode"] >= 1, what="decode error")
        assert h.calls == [] and not h.w.synced


async def test_callback_failure_is_counted_and_retried_on_the_next_change():
    api = FakeApi([sl("s1", ep("a", "10.0.0.1"))])
    got: list = []
    fail = [True]

    def on_change(specs):
        if fail.pop() if fail else False:
            raise RuntimeError("plane refused")
        got.append(specs)

    h = Harness(api)
    h.w.on_change = on_change
    async with h:
        await eventually(lambda: api.watching, what="watch")
        assert got == [] and h.w.errors["callback"] == 1 and h.w.workers is None
        assert h.w.synced and h.w.last_error.startswith("callback:")
        await api.events.put(ev("ADDED", sl("s2", ep("b", "10.0.0.2"))))
        await eventually(lambda: got, what="retried publish")
        assert names(got[-1]) == ["a", "b"]


async def test_watch_closing_at_once_does_not_spin():
    api = FakeApi()
    for _ in range(5):
        api.events.put_nowait(END)
    async with Harness(api) as h:
        await eventually(lambda: len(api.watch_calls) >= 6, what="re-watches")
        assert h.w.synced and api.list_calls == [None] and sum(h.w.errors.values()) == 0


async def test_stop_is_prompt_mid_watch_and_start_twice_fails():
    api = FakeApi()
    h = Harness(api)
    await h.w.start()
    with pytest.raises(RuntimeError):
        await h.w.start()
    await eventually(lambda: api.watching, what="watch")
    await asyncio.wait_for(h.w.stop(), 1)
    assert api.watching == 0 and api.closed and not h.w.synced
    await h.w.stop()  # idempotent


def test_backoff_is_bounded_and_resets():
    b = Backoff(1.0, 8.0, reset_after=3600)
    delays = [b.next() for _ in range(8)]
    assert all(0.5 <= d <= 8.0 for d in delays) and max(delays[-3:]) > 4.0
    b._last -= 7200  # a quiet hour later
    assert b.next() <= 1.0


def test_port_ref():
    assert port_ref("8000") == 8000 and port_ref(" kv ") == "kv" and port_ref("") == ""


async def test_start_without_credentials_raises(tmp_path):
    w = EndpointSliceWatcher(NS, "app=engine", lambda s: None, kubeconfig=str(tmp_path / "absent"))
    with pytest.raises(ConfigException):
        await w.start()
    assert not w.synced
