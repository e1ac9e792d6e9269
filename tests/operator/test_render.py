"""The renderers: pure functions of the spec, checked against the router's own command line."""

from __future__ import annotations

import base64
import copy

import pytest

from router_runtime.config import parse_args
from routerfleet_operator.model import (
    ANNOTATION_RESTARTED_AT,
    LABEL_FLEET,
    LABEL_REVISION,
    SEEDED,
    SESSION_STORE_DIR,
    TOKEN_DIR,
)
from routerfleet_operator.render import (
    STARTUP_PERIOD_S,
    OperatorRef,
    names,
    render_all,
    render_controller_revision,
    render_deployment,
    render_network_policy,
    render_pdb,
    render_pod_template,
    render_role,
    render_role_binding,
    render_secret,
    revision_of,
    router_args,
    seeded_condition,
    template_hash,
)
from routerfleet_operator.spec import Fleet, validate

from .helpers import T0, fleet_obj


def fleet(spec=None, **meta) -> Fleet:
    return Fleet.parse(fleet_obj(spec, **meta))


def router_config(f: Fleet, tmp_path):
    """Parse the rendered flags with the router's own parser (the mounted secrets' files present)."""
    files = {f"{TOKEN_DIR}/token": tmp_path / "token", f"{SESSION_STORE_DIR}/password": tmp_path / "password"}
    for path in files.values():
        path.write_text("s3cret\n")
    return parse_args([str(files[a]) if a in files else a for a in router_args(f)])


def test_the_router_listens_on_all_addresses_unless_extra_args_say_otherwise(tmp_path):
    """All addresses, like any container (port-forward and a localhost sidecar reach it); a user's
    ``--host`` in extraArgs comes after the operator's and wins: the pod IP only, or ``::``."""
    assert router_config(fleet(), tmp_path).host == "0.0.0.0"
    pinned = fleet({"router": {"extraArgs": ["--host=$(POD_IP)"]}})
    assert validate(pinned) == []
    args = router_args(pinned)
    assert args[-1] == "--host=$(POD_IP)" and args.index("--host") < len(args) - 1
    v6 = fleet({"router": {"extraArgs": ["--host=::"]}})
    assert router_config(v6, tmp_path).host == "::"


def test_router_flags_parse_with_the_router(tmp_path):
    f = fleet({"engines": {"dpSize": 2, "replayPort": 5658, "topic": "kv@"}, "bootstrap": {"timeout": "90s"}})
    c = router_config(f, tmp_path)
    assert c.host == "0.0.0.0" and c.port == 8080 and c.internal.port == 8081
    d = c.discovery
    assert d.selector == "kubernetes.io/service-name=vllm" and d.namespace == "ns"
    assert (d.http_port, d.kv_port, d.replay_port, d.dp_size, d.topic) == ("http", "kv", "5658", 2, "kv@")
    assert (
        c.peers.selector
        == f"kubernetes.io/service-name={names(f).peer_service}"
        == "kubernetes.io/service-name=rf-peers"
    )
    assert c.peers.port == "internal"
    assert c.bootstrap.enabled and c.bootstrap.timeout_s == 90 and not c.bootstrap.seed_required
    assert c.scheduling.policy == "kv_aware" and c.kv.block_size == 16 and c.tokens.tokenizer == "bytes"


def test_router_flags_without_bootstrap_and_with_extra_args(tmp_path):
    f = fleet(
        {
            "router": {
                "policy": "round_robin",
                "extraArgs": ["--connect-timeout-ms=1000", "--breaker-failures", "5"],
            },
            "engines": {"selector": {"matchLabels": {"app": "vllm"}}, "serviceName": None, "kvPort": None},
            "bootstrap": {"enabled": False},
        }
    )
    c = router_config(f, tmp_path)
    assert not c.bootstrap.enabled and c.internal.token_file  # verdict "disabled"
    assert c.peers.selector == f"kubernetes.io/service-name={names(f).peer_service}"  # load is shared
    assert c.discovery.selector == "app=vllm" and c.discovery.kv_port is None
    assert c.proxy.timeouts.connect_s == 1 and c.health.breaker.failures == 5
    assert c.scheduling.policy == "round_robin"


def test_seed_required_renders_its_flag(tmp_path):
    f = fleet({"bootstrap": {"seedRequired": True, "timeout": "5m"}})
    assert router_config(f, tmp_path).bootstrap.seed_required


def test_deployment_is_surge_only_and_gated():
    f = fleet(
        {"replicas": 3, "rollout": {"maxSurge": "50%", "minReadySeconds": 5, "progressDeadline": "45m"}}
    )
    d = render_deployment(f)
    s = d["spec"]
    assert s["replicas"] == 3 and s["paused"] is False
    assert s["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "50%", "maxUnavailable": 0},
    }
    assert s["minReadySeconds"] == 5 and s["progressDeadlineSeconds"] == 2700
    assert s["selector"] == {"matchLabels": {LABEL_FLEET: "rf"}}
    pod = s["template"]
    assert pod["spec"]["readinessGates"] == [{"conditionType": SEEDED}]
    assert pod["metadata"]["labels"][LABEL_FLEET] == "rf"
    assert pod["metadata"]["labels"][LABEL_REVISION] == revision_of(f)
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["routerfleet-router"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert {m["mountPath"] for m in c["volumeMounts"]} == {TOKEN_DIR}
    assert pod["spec"]["volumes"][0]["secret"]["secretName"] == names(f).secret
    assert pod["spec"]["serviceAccountName"] == names(f).service_account
    assert render_deployment(f, paused=True)["spec"]["paused"] is True


@pytest.mark.parametrize(
    "boot",
    [{"timeout": "1s"}, {"timeout": "10m"}, {"timeout": "1h", "seedRequired": True}, {"enabled": False}],
)
def test_probe_budgets_outlast_the_bootstrap(boot):
    """The startup probe (on /readyz) must outlast the bootstrap hold, or a replica is restarted
    mid-bootstrap; liveness (/healthz) only starts after it."""
    spec = {"bootstrap": boot, "rollout": {"progressDeadline": "24h"}}
    if boot.get("enabled") is False:
        spec["router"] = {"policy": "round_robin"}
    f = fleet(spec)
    c = render_deployment(f)["spec"]["template"]["spec"]["containers"][0]
    startup = c["startupProbe"]
    budget = startup["failureThreshold"] * startup["periodSeconds"]
    hold = f.spec.bootstrap.hold_s if f.spec.bootstrap.enabled else 0
    assert startup["httpGet"]["path"] == "/readyz" and startup["periodSeconds"] == STARTUP_PERIOD_S
    assert budget >= hold + 60
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_everything_is_owned_by_the_fleet():
    f = fleet()
    docs = [*render_all(f, "tok"), render_controller_revision(f, render_pod_template(f), 1)]
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "ServiceAccount", "Role", "RoleBinding", "Secret", "Service", "Service", "NetworkPolicy",
        "PodDisruptionBudget", "Deployment", "ControllerRevision",
    ]  # fmt: skip
    for d in docs:
        assert d["metadata"]["namespace"] == "ns"
        (ref,) = d["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "routerfleet.io/v1alpha1", "kind": "RouterFleet", "name": "rf", "uid": "uid-1",
            "controller": True, "blockOwnerDeletion": True,
        }  # fmt: skip
        assert d["metadata"]["labels"][LABEL_FLEET] == "rf"
    assert len({(d["kind"], d["metadata"]["name"]) for d in docs}) == len(docs)


def test_role_reads_endpointslices_and_gets_pods_and_nothing_more():
    f = fleet()
    assert render_role(f)["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        },
        # --k8s-storage-annotation: get only, never list/watch of pods
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
    ]
    rb = render_role_binding(f)
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "rf-router", "namespace": "ns"}]
    assert rb["roleRef"]["name"] == render_role(f)["metadata"]["name"]


def test_engines_in_another_namespace_get_unowned_rbac_there():
    f = fleet(
        {
            "router": {"policy": "round_robin"},
            "engines": {"namespace": "engines"},
            "bootstrap": {"enabled": False},
        }
    )
    role, rb = render_role(f), render_role_binding(f)
    for d in (role, rb):
        assert d["metadata"]["namespace"] == "engines" and "ownerReferences" not in d["metadata"]
        assert d["metadata"]["labels"]["routerfleet.io/fleet-namespace"] == "ns"
    assert rb["subjects"][0]["namespace"] == "ns"


def test_services_and_network_policy():
    f = fleet(
        {"service": {"type": "LoadBalancer", "port": 443, "annotations": {"a": "b"}, "labels": {"tier": "x"}}}
    )
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for d in render_all(f, "tok", operator=OperatorRef("ops", {"app": "op"}))
    }
    public = docs[("Service", "rf")]
    assert public["spec"]["type"] == "LoadBalancer"
    assert public["spec"]["ports"] == [{"name": "http", "port": 443, "targetPort": "http", "protocol": "TCP"}]
    assert public["metadata"]["annotations"] == {"a": "b"} and public["metadata"]["labels"]["tier"] == "x"
    peers = docs[("Service", "rf-peers")]
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is False
    assert peers["spec"]["ports"][0]["name"] == "internal"
    np = render_network_policy(f, OperatorRef("ops", {"app": "op"}))
    internal, public_rule = np["spec"]["ingress"]
    assert internal["ports"] == [{"port": "internal", "protocol": "TCP"}]
    assert internal["from"] == [
        {"podSelector": {"matchLabels": {LABEL_FLEET: "rf"}}},
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
            "podSelector": {"matchLabels": {"app": "op"}},
        },
    ]
    assert public_rule == {
        "ports": [{"port": "http", "protocol": "TCP"}, {"port": "metrics", "protocol": "TCP"}]
    }


def test_pdb():
    assert render_pdb(fleet())["spec"]["maxUnavailable"] == 1
    assert render_pdb(fleet({"disruption": {"minAvailable": "50%"}}))["spec"] == {
        "selector": {"matchLabels": {LABEL_FLEET: "rf"}},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
        "minAvailable": "50%",
    }
    assert render_pdb(fleet({"disruption": {"enabled": False}})) is None
    assert "PodDisruptionBudget" not in [
        d["kind"] for d in render_all(fleet({"disruption": {"enabled": False}}), "t")
    ]


def test_secret_holds_the_given_token():
    s = render_secret(fleet(), "s3cret")
    assert base64.b64decode(s["data"]["token"]) == b"s3cret" and s["type"] == "Opaque"
    with pytest.raises(ValueError):
        render_secret(fleet(), "  ")


def test_revision_follows_the_template_only():
    base = fleet_obj({"replicas": 2})
    rev = revision_of(Fleet.parse(base))
    same = [
        {"replicas": 5},
        {"paused": True},
        {"rollout": {"maxSurge": 3, "onSeedFailure": "Rollback"}},
        {"service": {"port": 81}},
        {"disruption": {"enabled": False}},
    ]
    for change in same:
        obj = copy.deepcopy(base)
        obj["spec"].update(change)
        assert revision_of(Fleet.parse(obj)) == rev, change
    different = [
        {"router": {"image": "v2"}},
        {"router": {"image": "routerfleet:dev", "extraArgs": ["--breaker-failures=4"]}},
        {"bootstrap": {"timeout": "5m"}},
        {"engines": {"serviceName": "other", "kvPort": "kv"}},
        {"router": {"image": "routerfleet:dev", "tracing": {"endpoint": "http://otel:4318"}}},  # its flags
    ]
    for change in different:
        obj = copy.deepcopy(base)
        obj["spec"].update(change)
        assert revision_of(Fleet.parse(obj)) != rev, change
    restarted = fleet_obj({"replicas": 2}, annotations={ANNOTATION_RESTARTED_AT: "2026-01-02T00:00:00Z"})
    f = Fleet.parse(restarted)
    assert revision_of(f) != rev
    assert (
        render_pod_template(f)["metadata"]["annotations"][ANNOTATION_RESTARTED_AT] == "2026-01-02T00:00:00Z"
    )
    # Stable: the same spec, the same hash, in another process too (canonical JSON).
    assert rev == revision_of(Fleet.parse(copy.deepcopy(base))) and len(rev) == 10


def test_controller_revision_keeps_the_template():
    f = fleet()
    t = render_pod_template(f)
    cr = render_controller_revision(f, t, 7)
    assert cr["data"]["template"] == t and cr["revision"] == 7
    assert cr["metadata"]["name"] == f"rf-{revision_of(f)}" and template_hash(t) == revision_of(f)
    # A rollback renders the Deployment with a stored template, not the spec's.
    old = render_deployment(f, template=t)
    f2 = fleet({"router": {"image": "v2"}})
    assert render_deployment(f2, template=t)["spec"]["template"] == old["spec"]["template"]


def test_tokenizer_from_a_config_map():
    f = fleet({"router": {"tokenizer": {"source": "ConfigMap", "configMapName": "llama-tok"}}})
    spec = render_pod_template(f)["spec"]
    assert {"name": "tokenizer", "configMap": {"name": "llama-tok"}} in spec["volumes"]
    args = spec["containers"][0]["args"]
    assert args[args.index("--tokenizer") + 1] == "/etc/routerfleet/tokenizer"


def test_the_shared_session_store_and_its_password_from_a_secret(tmp_path):
    f = fleet(
        {"router": {"sessionStore": {"url": "redis://redis:6379/0", "passwordSecretRef": {"name": "auth"}}}}
    )
    spec = render_pod_template(f)["spec"]
    secret = {"secretName": "auth", "items": [{"key": "password", "path": "password"}]}
    assert {"name": "session-store", "secret": secret} in spec["volumes"]
    mount = {"name": "session-store", "mountPath": "/var/run/routerfleet/session-store", "readOnly": True}
    assert mount in spec["containers"][0]["volumeMounts"]
    args = spec["containers"][0]["args"]
    assert args[args.index("--session-store-password-file") + 1] == f"{SESSION_STORE_DIR}/password"
    assert router_config(f, tmp_path).store.url == "redis://redis:6379/0"  # the router's parser agrees
    plain = render_pod_template(fleet({"router": {"sessionStore": {"url": "unix:///run/redis.sock"}}}))[
        "spec"
    ]
    assert not any(v["name"] == "session-store" for v in plain["volumes"])
    assert "--session-store-password-file" not in plain["containers"][0]["args"]
    assert validate(fleet({"router": {"sessionStore": {"url": "http://x"}}})) != []


COLLECTOR = "http://otel-collector.observability:4318"
TRACED = {"router": {"tracing": {"endpoint": COLLECTOR, "sampleRatio": 0.25}}}


def test_tracing_renders_the_routers_otlp_flags():
    args = router_args(fleet(TRACED))
    i = args.index("--otlp-traces-endpoint")
    assert args[i : i + 4] == ["--otlp-traces-endpoint", COLLECTOR, "--trace-sample-ratio", "0.25"]
    # No ratio set: the CRD's default, rendered (an int from the API server renders the same).
    for ratio in ({}, {"sampleRatio": 1}):
        f = fleet({"router": {"tracing": {"endpoint": "https://otel.example.com", **ratio}}})
        args = router_args(f)
        assert args[args.index("--trace-sample-ratio") + 1] == "1.0", ratio
    # No endpoint: neither flag (the router builds no exporter).
    for off in (None, {}, {"sampleRatio": 0.5}):
        args = router_args(fleet({"router": {"tracing": off}}))
        assert not {"--otlp-traces-endpoint", "--trace-sample-ratio"} & set(args), off
    refused = fleet({"router": {"extraArgs": ["--otlp-traces-endpoint", "http://elsewhere:4318"]}})
    assert any("may not set flags the operator owns" in p for p in validate(refused))


def test_tracing_flags_parse_with_the_router(tmp_path):
    t = router_config(fleet(TRACED), tmp_path).tracing
    assert (t.endpoint, t.sample_ratio) == (COLLECTOR, 0.25)


def test_tokenizer_from_the_engines(tmp_path):
    f = fleet({"router": {"tokenizer": {"source": "Engine"}}})
    spec = render_pod_template(f)["spec"]
    assert not any(v["name"] == "tokenizer" for v in spec.get("volumes") or [])
    assert router_config(f, tmp_path).tokens.tokenizer == "engine"


def test_scheduling_and_pod_metadata_pass_through():
    f = fleet(
        {
            "router": {
                "scheduling": {
                    "nodeSelector": {"a": "b"},
                    "tolerations": [{"key": "k", "operator": "Exists"}],
                    "affinity": {"nodeAffinity": {}},
                    "topologySpreadConstraints": [{"maxSkew": 1}],
                    "priorityClassName": "high",
                },
                "imagePullSecrets": [{"name": "regcred"}],
                "podLabels": {"team": "x", LABEL_FLEET: "spoofed"},
                "podAnnotations": {"p": "q"},
                "resources": {"limits": {"memory": "1Gi"}},
                "env": [{"name": "A", "value": "1"}],
            }
        }
    )
    t = render_pod_template(f)
    s = t["spec"]
    assert s["nodeSelector"] == {"a": "b"} and s["priorityClassName"] == "high"
    assert s["tolerations"] == [{"key": "k", "operator": "Exists"}] and s["imagePullSecrets"] == [
        {"name": "regcred"}
    ]
    assert t["metadata"]["labels"]["team"] == "x" and t["metadata"]["labels"][LABEL_FLEET] == "rf"
    assert t["metadata"]["annotations"] == {"p": "q"}
    c = s["containers"][0]
    assert c["resources"] == {"limits": {"memory": "1Gi"}} and c["env"][-1] == {"name": "A", "value": "1"}


def test_seeded_condition():
    c = seeded_condition("warm_unwitnessed", T0)
    assert c == {
        "type": SEEDED,
        "status": "True",
        "reason": "VerdictWarmUnwitnessed",
        "message": "bootstrap verdict warm_unwitnessed passed the fleet's policy",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


def test_a_disaggregated_fleet_renders_its_prefill_service_and_protocol(tmp_path):
    f = fleet({"engines": {"disaggregation": {"prefillServiceName": "vllm-prefill"}}})
    d = router_config(f, tmp_path)
    assert d.discovery.selector == "kubernetes.io/service-name=vllm"  # the decode engines
    assert d.discovery.prefill_selector == "kubernetes.io/service-name=vllm-prefill"
    assert (d.disaggregation.protocol, d.disaggregation.threshold_tokens) == ("vllm", 512)
    # Its flags are the spec's then: extraArgs may not set them over it (a fleet without it may).
    over = {"extraArgs": ["--pd-protocol=sglang"]}
    pd = {"disaggregation": {"prefillServiceName": "vllm-prefill"}}
    assert any(
        "may not set flags the operator owns" in p for p in validate(fleet({"engines": pd, "router": over}))
    )
    assert validate(fleet({"router": over})) == []
    assert d.discovery.revision_label == "app.kubernetes.io/version"
    f = fleet(
        {
            "engines": {
                "disaggregation": {"prefillServiceName": "p", "protocol": "sglang", "thresholdTokens": 0}
            }
        }
    )
    d = router_config(f, tmp_path)
    assert (d.disaggregation.protocol, d.disaggregation.threshold_tokens) == ("sglang", 0)
    assert "--k8s-prefill-selector" not in router_args(fleet())  # off unless asked
    for bad in ({"protocol": "vllm"}, {"prefillServiceName": "p", "roleLabel": "llm-d.ai/role"}):
        with pytest.raises(ValueError, match=r"exactly one of prefillServiceName .* and roleLabel"):
            Fleet.parse(fleet_obj({"engines": {"disaggregation": bad}}))
    # One Service's engines split by their pods' role label, as llm-d labels them.
    d = router_config(fleet({"engines": {"disaggregation": {"roleLabel": "llm-d.ai/role"}}}), tmp_path)
    assert (d.discovery.role_label, d.discovery.prefill_selector) == ("llm-d.ai/role", None)
    assert d.discovery.selector == "kubernetes.io/service-name=vllm" and d.discovery.disaggregated
