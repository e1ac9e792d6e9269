"""spec.gateway: the InferencePool's target resolved from the engines' objects, the rendered pool and
picker Service (checked against the extension's own CRD and the router's parser), and GatewayReady."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from e2e.gateway import ENVOY, extension
from routerfleet_operator.gateway import (
    ParentView,
    PoolProblem,
    PoolView,
    gateway_condition,
    resolve_target,
)
from routerfleet_operator.model import ENVOY_VOLUME, EPP_PORT, EPP_PORT_NAME, GATEWAY_PORT, GATEWAY_PORT_NAME
from routerfleet_operator.render import (
    PoolTarget,
    names,
    render_all,
    render_envoy_config_map,
    render_gateway_service,
    render_inference_pool,
    render_network_policy,
    render_picker_service,
    render_pod_template,
    render_role,
    router_args,
)
from routerfleet_operator.rollout import PodView, decide
from routerfleet_operator.spec import Fleet, validate
from routerfleet_operator.standalone import STOP_DELAY_S, envoy_config

from .helpers import ROOT, T0, fleet_obj, schema_errors
from .test_render import router_config

POOL_CRDS = ROOT / "manifests" / "gateway" / "crds"
ON = {"gateway": {"enabled": True}}


def fleet(spec=None) -> Fleet:
    return Fleet.parse(fleet_obj(spec))


def pool_schema() -> dict:
    crd = yaml.safe_load((POOL_CRDS / "inference.networking.k8s.io_inferencepools.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def slice_of(service: str, **ports: int) -> dict:
    return {
        "metadata": {"labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
    }


VLLM = {"spec": {"selector": {"app": "vllm"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}


# ---- the target ---------------------------------------------------------------------------------------


def test_the_pool_selects_the_engines_pods_at_the_number_their_slices_give_the_named_port():
    target = resolve_target(fleet(ON), [slice_of("vllm", http=8000, kv=5557)], {"vllm": VLLM})
    assert target == PoolTarget({"app": "vllm"}, (8000,))


def test_engines_found_by_slice_labels_follow_each_slices_service():
    f = fleet({**ON, "engines": {"serviceName": None, "selector": {"matchLabels": {"tier": "engines"}}}})
    slices = [slice_of("a", http=8000), slice_of("b", http=8001)]
    assert resolve_target(f, slices, {"a": VLLM, "b": VLLM}) == PoolTarget({"app": "vllm"}, (8000, 8001))
    other = {"spec": {"selector": {"app": "sglang"}}}
    with pytest.raises(PoolProblem) as err:
        resolve_target(f, slices, {"a": VLLM, "b": other})
    assert err.value.reason == "EngineSelectorUnknown" and "engineSelector" in err.value.message


def test_a_numeric_http_port_is_the_pool_port_as_it_is():
    f = fleet({**ON, "engines": {"httpPort": 8000}})
    assert resolve_target(f, [], {"vllm": VLLM}).ports == (8000,)


def test_the_spec_may_say_the_selector_and_ports_outright():
    f = fleet({"gateway": {"enabled": True, "engineSelector": {"pool": "a"}, "targetPorts": [9000, 9001]}})
    assert resolve_target(f, [], {}) == PoolTarget({"pool": "a"}, (9000, 9001))


def test_target_ports_must_list_the_port_the_routers_pick_the_engines_on():
    """The routers pick each engine on its httpPort: a pool that does not target it gets picks for no
    endpoint of its own (a number: refused with the spec; a name: when the slices resolve it)."""
    numbered = fleet({"gateway": {"enabled": True, "targetPorts": [9000]}, "engines": {"httpPort": 8000}})
    assert any("must list spec.engines.httpPort (8000)" in p for p in validate(numbered))
    off = fleet({"gateway": {"enabled": False, "targetPorts": [9000, 9000]}, "engines": {"httpPort": 8000}})
    assert not any("targetPorts" in p for p in validate(off))  # no pool rendered: nothing to refuse
    named = fleet({"gateway": {"enabled": True, "engineSelector": {"pool": "a"}, "targetPorts": [9000]}})
    with pytest.raises(PoolProblem) as e:
        resolve_target(named, [slice_of("vllm", http=8000)], {})
    assert e.value.reason == "TargetPortsUnpicked" and "8000" in e.value.message
    both = fleet({"gateway": {"enabled": True, "engineSelector": {"pool": "a"}, "targetPorts": [8000, 9000]}})
    assert resolve_target(both, [slice_of("vllm", http=8000)], {}).ports == (8000, 9000)


@pytest.mark.parametrize(
    ("slices", "services", "reason"),
    [
        ([], {"vllm": None}, "EnginesNotFound"),  # the Service is missing
        ([], {"vllm": VLLM}, "EnginesNotFound"),  # no slice resolves the port yet
        ([slice_of("vllm", http=8000)], {"vllm": {"spec": {}}}, "EngineSelectorUnknown"),  # no selector
        ([slice_of("vllm", **{"http": 8000 + i}) for i in range(9)], {"vllm": VLLM}, "EngineSelectorUnknown"),
    ],
    ids=["no-service", "no-port", "no-selector", "too-many-ports"],
)
def test_what_cannot_be_resolved_says_why(slices, services, reason):
    with pytest.raises(PoolProblem) as err:
        resolve_target(fleet(ON), slices, services)
    assert err.value.reason == reason


# ---- what is rendered ---------------------------------------------------------------------------------


def test_the_pool_is_valid_for_the_extensions_own_crd_and_names_the_picker_service():
    f = fleet({"gateway": {"enabled": True, "failureMode": "FailOpen", "pickerPort": 9443}})
    pool = render_inference_pool(f, PoolTarget({"app": "vllm"}, (8000,)))
    assert schema_errors(pool["spec"], pool_schema()["properties"]["spec"], "spec") == []
    ref = pool["spec"]["endpointPickerRef"]
    svc = render_picker_service(f)
    assert (ref["name"], ref["port"]["number"], ref["failureMode"]) == (
        svc["metadata"]["name"],
        9443,
        "FailOpen",
    )
    assert svc["spec"]["ports"] == [
        {"name": EPP_PORT_NAME, "port": 9443, "protocol": "TCP", "targetPort": EPP_PORT_NAME}
    ]
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "RouterFleet"
    assert pool["metadata"]["name"] == names(f).pool == "rf"


def test_the_vendored_crds_are_the_extensions_own():
    for path in POOL_CRDS.glob("*.yaml"):
        assert path.read_bytes() == extension.crd(path.name).read_bytes(), path.name


def test_the_routers_serve_the_pools_picks_as_the_router_parses_them(tmp_path):
    f = fleet({"gateway": {"enabled": True, "poolName": "chat"}})
    assert validate(f) == []
    c = router_config(f, tmp_path)
    assert (c.gateway.port, c.gateway.pool, c.gateway.plaintext) == (EPP_PORT, "chat", False)
    plain = router_config(fleet({"gateway": {"enabled": True, "tls": False}}), tmp_path)
    assert plain.gateway.plaintext
    container = render_pod_template(f)["spec"]["containers"][0]
    assert {"name": EPP_PORT_NAME, "containerPort": EPP_PORT, "protocol": "TCP"} in container["ports"]
    ingress = render_network_policy(f)["spec"]["ingress"][1]["ports"]
    assert {"port": EPP_PORT_NAME, "protocol": "TCP"} in ingress
    rules = render_role(f)["rules"]
    assert any(r["resources"] == ["inferenceobjectives"] and "watch" in r["verbs"] for r in rules)


def test_without_the_gateway_nothing_of_it_is_rendered():
    f = fleet()
    assert render_picker_service(f) is None
    assert not any(a.startswith("--epp") for a in router_args(f))
    assert all(p["name"] != EPP_PORT_NAME for p in render_pod_template(f)["spec"]["containers"][0]["ports"])
    assert len(render_role(f)["rules"]) == 2
    assert [m["metadata"]["name"] for m in render_all(fleet(ON), "t") if m["kind"] == "Service"] == [
        "rf",
        "rf-peers",
        "rf-epp",
    ]
    assert [m["metadata"]["name"] for m in render_all(f, "t") if m["kind"] == "Service"] == ["rf", "rf-peers"]


def test_the_gateway_needs_the_engines_in_the_fleets_namespace():
    f = fleet({**ON, "engines": {"namespace": "elsewhere"}, "bootstrap": {"enabled": False}})
    assert any("spec.gateway.enabled needs the engines" in p for p in validate(f))
    repeated = fleet({"gateway": {"enabled": True, "targetPorts": [80, 80]}, "engines": {"httpPort": 80}})
    assert any("must not repeat" in p for p in validate(repeated))


# ---- GatewayReady -------------------------------------------------------------------------------------


def parents(*conds: dict) -> dict:
    return {
        "metadata": {"namespace": "ns"},
        "status": {"parents": [{"parentRef": {"name": "gw"}, "conditions": list(conds)}]},
    }


def cond(type_: str, status: str, message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": "R", "message": message}


def picker_slices(ready: int, not_ready: int = 0) -> list[dict]:
    """The picker Service's EndpointSlices: ``ready`` replicas listed ready, ``not_ready`` not."""
    eps = [
        {"addresses": [f"10.0.0.{i}"], "conditions": {"ready": i < ready}} for i in range(ready + not_ready)
    ]
    return [{"endpoints": eps}]


ACCEPTED = parents(cond("Accepted", "True"), cond("ResolvedRefs", "True"))


def test_the_picker_replicas_are_counted_by_pod_not_by_address():
    """A dual-stack replica is in one slice per family; a ready condition left out means ready."""
    pod = {"kind": "Pod", "name": "rf-0", "uid": "u0"}
    v4 = {"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}, "targetRef": pod}]}
    v6 = {"endpoints": [{"addresses": ["fd00::1"], "conditions": {"ready": True}, "targetRef": pod}]}
    unsaid = {"endpoints": [{"addresses": ["10.0.0.2"], "conditions": {}}]}
    assert PoolView.of(ACCEPTED, [v4, v6]).pickers == 1
    assert PoolView.of(ACCEPTED, [unsaid]).pickers == 1


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        (None, ("Unknown", "PoolNotSynced")),
        (PoolView(problem=PoolProblem("CRDNotInstalled", "x")), ("False", "CRDNotInstalled")),
        (PoolView(pickers=2), ("False", "NoGateway")),
        (
            PoolView.of(parents(cond("Accepted", "False", "no such listener")), picker_slices(2)),
            ("False", "NotAccepted"),
        ),
        (
            PoolView.of(
                parents(cond("Accepted", "True"), cond("ResolvedRefs", "False", "no Service")),
                picker_slices(2),
            ),
            ("False", "NotAccepted"),
        ),
        # Ready pods that serve no picks (an older revision's) are not in the picker Service's ready set.
        (PoolView.of(ACCEPTED, picker_slices(0, not_ready=2)), ("False", "PickerNotReady")),
        (PoolView.of(ACCEPTED, picker_slices(2, not_ready=1)), ("True", "Accepted")),
    ],
    ids=["unsynced", "problem", "no-gateway", "refused", "unresolved", "no-picker", "ready"],
)
def test_gateway_ready_says_where_the_path_stops(pool, expected):
    status, reason, message = gateway_condition(fleet(ON), pool)
    assert (status, reason) == expected
    assert "InferencePool rf" in message
    if expected[0] == "True":
        assert "2 router replica(s) picking" in message


def test_a_gateways_refusal_is_quoted():
    view = PoolView.of(parents(cond("Accepted", "True"), cond("ResolvedRefs", "False", "no Service rf-epp")))
    assert view.parents == (ParentView("ns/gw", "True", "False", "no Service rf-epp"),)
    assert "Gateway ns/gw: no Service rf-epp" in gateway_condition(fleet(ON), view)[2]


def test_the_condition_is_in_the_status_only_with_the_gateway():
    pods = [PodView(name="p", revision="r")]
    with_gateway = decide(fleet_obj(ON), pods, T0, PoolView())
    types = [c["type"] for c in with_gateway.status["conditions"]]
    assert "GatewayReady" in types
    without = decide(fleet_obj(), pods, T0, None)
    assert "GatewayReady" not in [c["type"] for c in without.status["conditions"]]


# ---- the standalone gateway ---------------------------------------------------------------------------

STANDALONE = {"gateway": {"enabled": True, "standalone": {"enabled": True}}}


def test_the_standalone_gateway_is_an_envoy_beside_each_router_and_a_service_to_them(tmp_path):
    f = fleet(STANDALONE)
    assert validate(f) == []
    pod = render_pod_template(f)["spec"]
    _router, envoy = pod["containers"]
    assert envoy["image"] == "envoyproxy/envoy:v1.40.0" and "setsid envoy -c" in envoy["command"][2]
    assert envoy["ports"] == [{"name": GATEWAY_PORT_NAME, "containerPort": GATEWAY_PORT, "protocol": "TCP"}]
    config_map = render_envoy_config_map(f)
    assert {"name": ENVOY_VOLUME, "configMap": {"name": config_map["metadata"]["name"]}} in pod["volumes"]
    assert json.loads(config_map["data"]["envoy.yaml"]) == envoy_config(f)
    svc = render_gateway_service(f)
    assert (svc["metadata"]["name"], svc["spec"]["ports"][0]["targetPort"]) == (
        "rf-gateway",
        GATEWAY_PORT_NAME,
    )
    assert {"port": GATEWAY_PORT_NAME, "protocol": "TCP"} in render_network_policy(f)["spec"]["ingress"][1][
        "ports"
    ]
    # Another Envoy configuration is another ConfigMap, named by its content: the pods of the old
    # revision keep theirs through the rollout (and a rollback), and the new template names the new one.
    plain = fleet({"gateway": {"enabled": True, "tls": False, "standalone": {"enabled": True}}})
    assert "transport_socket" not in envoy_config(plain)["static_resources"]["clusters"][1]
    plain_map = render_envoy_config_map(plain)["metadata"]["name"]
    assert plain_map != config_map["metadata"]["name"] and plain_map.startswith("rf-envoy-")
    volumes = render_pod_template(plain)["spec"]["volumes"]
    assert {"name": ENVOY_VOLUME, "configMap": {"name": plain_map}} in volumes
    # The router answers picks until after its Envoy stopped.
    assert router_config(f, tmp_path).proxy.shutdown_drain_s > STOP_DELAY_S
    # Its Envoy dials the picker on loopback: a --host of one address (docs/operator.md shows
    # --host=$(POD_IP)) would leave it nothing to reach; every address of either family is fine.
    for host, refused in (("$(POD_IP)", True), ("10.1.2.3", True), ("0.0.0.0", False), ("::", False)):
        f_host = fleet({**STANDALONE, "router": {"extraArgs": [f"--host={host}"]}})
        assert any("must listen on every address" in p for p in validate(f_host)) is refused, host
    # The drain it relies on is the operator's then; a fleet without it may set its own.
    assert validate(fleet({**STANDALONE, "router": {"extraArgs": ["--shutdown-drain-ms=1000"]}}))
    assert validate(fleet({**ON, "router": {"extraArgs": ["--shutdown-drain-ms=1000"]}})) == []
    assert render_gateway_service(fleet(ON)) is None and render_envoy_config_map(fleet(ON)) is None


def test_the_standalone_gateway_needs_the_gateway_and_one_endpoint_per_pick():
    f = fleet({"gateway": {"standalone": {"enabled": True}}})
    assert any("standalone needs spec.gateway.enabled" in p for p in validate(f))
    for args in (["--epp-fallbacks=2"], ["--epp-fallbacks", "1"]):
        listed = fleet({**STANDALONE, "router": {"extraArgs": args}})
        assert any("--epp-fallbacks must be 0" in p for p in validate(listed)), args
    assert validate(fleet({**STANDALONE, "router": {"extraArgs": ["--epp-fallbacks=0"]}})) == []
    assert validate(fleet({**ON, "router": {"extraArgs": ["--epp-fallbacks=2"]}})) == []


def test_the_real_envoy_accepts_the_rendered_configuration(tmp_path):
    path = tmp_path / "envoy.yaml"
    path.write_text(render_envoy_config_map(fleet(STANDALONE))["data"]["envoy.yaml"])
    done = subprocess.run(
        [str(ENVOY), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "OK" in done.stdout + done.stderr, done.stderr[-2000:]
