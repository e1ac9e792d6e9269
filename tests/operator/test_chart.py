"""The operator's Helm chart, rendered by a real helm (built like the control plane, e2e/helm): it lints,
manifests/operator is its current rendering, and each value does what values.yaml says. Installing it
into a cluster is tests/e2e/test_operator.py::test_helm_install_and_uninstall."""

from __future__ import annotations

import shlex

import pytest
import yaml

from e2e import chart
from routerfleet_kube.client import KINDS
from routerfleet_operator.apply import OPTIONAL_KINDS
from routerfleet_operator.cli import parser


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def find(objs: list[dict], kind: str) -> list[dict]:
    return [d for d in objs if d["kind"] == kind]


def operator_argv(deploy: dict) -> list[str]:
    """The Deployment's `sh -c` command as the shell would run it, after `exec routerfleet-operator`."""
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["sh", "-c"]
    line = c["args"][0].replace('"$(printf %s "$POD_NAME" | cksum | cut -d\' \' -f1 | cut -c1-9)"', "1234")
    line = line.replace("${POD_IP}", "10.0.0.7")
    words = shlex.split(line)
    assert words[:2] == ["exec", "routerfleet-operator"], words
    return words[2:]


def test_the_chart_lints():
    out = chart.run("lint", "--strict", str(chart.CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in out, out


def test_manifests_operator_is_the_charts_current_rendering():
    assert chart.KUSTOMIZE_MANIFEST.read_text() == chart.kustomize_manifest(), (
        "manifests/operator/operator.yaml is stale: run `make manifests`"
    )
    objs = docs(chart.KUSTOMIZE_MANIFEST.read_text())
    # Nothing in it says Helm manages it: kubectl does.
    assert all(set(d["metadata"].get("labels", {})) == {"app.kubernetes.io/name"} for d in objs), objs
    assert {d["kind"] for d in objs} == {
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering", "Deployment", "Service",
    }  # fmt: skip


def test_the_cluster_role_lets_the_operator_prune_what_a_spec_turned_off():
    (role,) = find(docs(chart.KUSTOMIZE_MANIFEST.read_text()), "ClusterRole")

    def allowed(kind: str, verb: str) -> bool:
        prefix, plural = KINDS[kind]
        group = "" if prefix == "/api/v1" else prefix.split("/")[2]
        return any(
            group in r["apiGroups"] and plural in r["resources"] and verb in r["verbs"] for r in role["rules"]
        )

    verbs = ("list", "delete")
    missing = [(verb, kind) for kind in OPTIONAL_KINDS for verb in verbs if not allowed(kind, verb)]
    assert not missing, missing


def test_defaults_run_two_replicas_cluster_wide_under_the_cluster_peering():
    objs = docs(chart.render("ops", "infra"))
    (deploy,) = find(objs, "Deployment")
    assert deploy["metadata"]["name"] == "ops-routerfleet-operator" and deploy["spec"]["replicas"] == 2
    labels = deploy["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["app.kubernetes.io/instance"] == "ops"
    a = parser().parse_args(operator_argv(deploy))
    assert (a.cmd, a.namespace, a.peering, a.metrics_port) == ("run", [], "routerfleet-operator", 9090)
    assert [p["metadata"]["name"] for p in find(objs, "ClusterKopfPeering")] == ["routerfleet-operator"]
    (binding,) = find(objs, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ops-routerfleet-operator", "namespace": "infra"}
    ]
    crds = {d["metadata"]["name"]: d for d in find(objs, "CustomResourceDefinition")}
    assert set(crds) == {
        "routerfleets.routerfleet.io",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }
    # kept on uninstall by default: deleting the CRD would delete every RouterFleet
    assert all(c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for c in crds.values())
    # the chart's CRD is the repository's (a link, not a copy)
    with (chart.ROOT / "crds" / "routerfleet.io_routerfleets.yaml").open() as f:
        assert crds["routerfleets.routerfleet.io"]["spec"] == yaml.safe_load(f)["spec"]
    assert not find(objs, "ServiceMonitor") and not find(objs, "KopfPeering")
    # a long release name still makes valid object names (at most 63 characters)
    long = docs(chart.render("a-release-name-as-long-as-helm-allows-53-characters-x", "infra"))
    assert all(len(d["metadata"]["name"]) <= 63 for d in long), [d["metadata"]["name"] for d in long]


def test_watched_namespaces_get_a_peering_each_and_the_operator_watches_only_them():
    objs = docs(chart.render("ops", "infra", "watchNamespaces={team-a,team-b}", "replicas=3"))
    (deploy,) = find(objs, "Deployment")
    a = parser().parse_args(operator_argv(deploy))
    assert a.namespace == ["team-a", "team-b"] and deploy["spec"]["replicas"] == 3
    peerings = find(objs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert {p["metadata"]["name"] for p in peerings} == {"routerfleet-operator"}
    assert not find(objs, "ClusterKopfPeering")


@pytest.mark.parametrize(
    ("values", "check"),
    [
        (
            ("image.repository=registry.example.com/routerfleet", "image.tag=0.1.0"),
            lambda o: (
                find(o, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["image"]
                == "registry.example.com/routerfleet:0.1.0"
            ),
        ),
        (
            ("resources.requests.cpu=250m",),
            lambda o: (
                find(o, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
                == {"cpu": "250m", "memory": "128Mi"}
            ),
        ),
        (
            ("metrics.serviceMonitor.enabled=true",),
            lambda o: find(o, "ServiceMonitor")[0]["spec"]["endpoints"][0]["port"] == "metrics",
        ),
        (
            ("metrics.port=9100",),  # the scrape annotation names the port the Service serves
            lambda o: (
                find(o, "Service")[0]["metadata"]["annotations"]["prometheus.io/port"] == "9100"
                and find(o, "Service")[0]["spec"]["ports"][0]["port"] == 9100
            ),
        ),
        (("metrics.service.enabled=false",), lambda o: not find(o, "Service")),
        (("crds.install=false",), lambda o: not find(o, "CustomResourceDefinition")),
        (
            ("crds.keep=false",),
            lambda o: all(
                "helm.sh/resource-policy" not in (c["metadata"].get("annotations") or {})
                for c in find(o, "CustomResourceDefinition")
            ),
        ),
        (
            (),
            lambda o: (
                not any("inference" in c["metadata"]["name"] for c in find(o, "CustomResourceDefinition"))
            ),
        ),
        (
            ("gatewayApi.installCRDs=true",),
            lambda o: (
                {c["metadata"]["name"] for c in find(o, "CustomResourceDefinition")}
                >= {
                    "inferencepools.inference.networking.k8s.io",
                    "inferenceobjectives.inference.networking.x-k8s.io",
                }
            ),
        ),
    ],
    ids=[
        "image",
        "resources",
        "service-monitor",
        "metrics-port",
        "no-service",
        "no-crds",
        "crds-not-kept",
        "no-gateway-crds",
        "gateway-crds",
    ],
)
def test_values(values, check):
    assert check(docs(chart.render("ops", "infra", *values)))


def test_the_operator_waits_for_the_peering_objects_the_chart_renders():
    from routerfleet_operator.peering import peering_paths

    for values, kind in (((), "ClusterKopfPeering"), (("watchNamespaces={a,b}",), "KopfPeering")):
        objs = docs(chart.render("ops", "infra", *values))
        (deploy,) = find(objs, "Deployment")
        a = parser().parse_args(operator_argv(deploy))
        rendered = find(objs, kind)
        paths = peering_paths(a.peering, a.namespace)
        assert len(paths) == len(rendered) and all(
            p.endswith(f"/{o['metadata']['name']}") and o["metadata"].get("namespace", "") in p
            for p, o in zip(paths, rendered, strict=True)
        ), (paths, rendered)
