"""An InferencePool and its pods -> engines (discovery/inference_pool.py), without I/O."""

from __future__ import annotations

import pytest

from router_runtime.discovery.endpointslices import EngineDiscoveryConfig
from router_runtime.discovery.inference_pool import map_pool_pods, pod_state, pool_shape
from router_runtime.worker import Role


def pool(labels=None, ports=(8000,), **spec):
    return {
        "metadata": {"name": "p", "namespace": "llm"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"} if labels is None else labels},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
            **spec,
        },
    }


def pod(name, ip="10.0.0.1", labels=None, ready=True, deleting=False, uid=None, ports=None):
    labels = labels or {"app": "vllm"}
    meta = {"name": name, "namespace": "llm", "uid": uid or f"uid-{name}", "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-05T10:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "engine", "ports": ports or []}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_the_pods_a_pool_selects_become_its_engines_on_its_target_port():
    pods = [pod("b", "10.0.0.2"), pod("a", "10.0.0.1"), pod("other", "10.0.0.3", labels={"app": "sglang"})]
    m = map_pool_pods(pool_shape(pool()), pods, EngineDiscoveryConfig(kv_port=5557))
    assert [(w.engine, w.url, w.kv, w.incarnation) for w in m.workers] == [
        ("llm/a", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "uid-a"),
        ("llm/b", "http://10.0.0.2:8000", "tcp://10.0.0.2:5557", "uid-b"),
    ]
    assert dict(m.states) == {"routable": 2}  # a pod the pool does not select is not counted


def test_a_pools_engines_take_their_role_and_revision_from_their_pods_labels():
    role, version = "llm-d.ai/role", "app.kubernetes.io/version"
    pods = [
        pod("a", "10.0.0.1", labels={"app": "vllm", role: "prefill", version: "v2"}),
        pod("b", "10.0.0.2", labels={"app": "vllm", role: "decode", version: "v2"}),
        pod("c", "10.0.0.3", labels={"app": "vllm", role: "prefill-decode"}),  # llm-d's "both"
        pod("d", "10.0.0.4"),  # unlabelled: a whole engine, as llm-d's decode filter keeps it
        pod("e", "10.0.0.5", labels={"app": "vllm", role: "encode-prefill"}),
        pod("f", "10.0.0.6", labels={"app": "vllm", role: "encode"}),  # answers no client: not routed
        pod("g", "10.0.0.7", labels={"app": "vllm", role: "Decode"}),  # no role it knows: not routed
    ]
    m = map_pool_pods(pool_shape(pool()), pods, EngineDiscoveryConfig(), version, role)
    assert [(w.engine, w.role, w.revision) for w in m.workers] == [
        ("llm/a", Role.PREFILL, "v2"),
        ("llm/b", Role.DECODE, "v2"),
        ("llm/c", Role.BOTH, ""),
        ("llm/d", Role.BOTH, ""),
        ("llm/e", Role.PREFILL, ""),
    ]
    assert dict(m.states) == {"routable": 5, "role_unknown": 2}
    # Without the label asked for, every engine is whole, whatever its pod says.
    assert {w.role for w in map_pool_pods(pool_shape(pool()), pods, EngineDiscoveryConfig()).workers} == {
        Role.BOTH
    }


def test_several_target_ports_are_one_engine_each_with_its_own_kv_port():
    ports = [{"name": "kv", "containerPort": 5557}]
    m = map_pool_pods(
        pool_shape(pool(ports=(3000, 3002))), [pod("a", ports=ports)], EngineDiscoveryConfig(kv_port="kv")
    )
    assert [(w.engine, w.url, w.kv) for w in m.workers] == [
        ("llm/a:3000", "http://10.0.0.1:3000", "tcp://10.0.0.1:5557"),
        ("llm/a:3002", "http://10.0.0.1:3002", "tcp://10.0.0.1:5558"),
    ]
    # A KV port name the pod does not declare makes it unusable, never guessed.
    missing = map_pool_pods(pool_shape(pool()), [pod("a")], EngineDiscoveryConfig(kv_port="kv"))
    assert missing.workers == [] and dict(missing.states) == {"port_missing:kv": 1}
    none = map_pool_pods(pool_shape(pool()), [pod("a")], EngineDiscoveryConfig())
    assert none.workers[0].kv is None  # engines that publish no events


@pytest.mark.parametrize(
    ("p", "state"),
    [
        (pod("a"), "routable"),
        (pod("a", ready=False), "not_ready"),
        (pod("a", deleting=True), "terminating"),
        (pod("a", ip=""), "no_address"),
        ({"metadata": {"name": "a"}}, "not_ready"),
    ],
)
def test_pod_states(p, state):
    assert pod_state(p) == state


def test_an_ipv6_pod_is_dialled_in_brackets():
    (w,) = map_pool_pods(pool_shape(pool()), [pod("a", ip="fd00::5")], EngineDiscoveryConfig()).workers
    assert w.url == "http://[fd00::5]:8000"


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({"metadata": {}}, "no spec"),
        (pool(labels={}), "matchLabels is empty"),
        (pool(ports=()), "targetPorts is empty"),
        (pool(ports=(0,)), "not a port number"),
        (pool(selector={"matchLabels": {"a": "b"}, "matchExpressions": [{"key": "a"}]}), "matchExpressions"),
    ],
)
def test_a_pool_that_cannot_say_which_pods_are_its_engines_is_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        pool_shape(bad)
