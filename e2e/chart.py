"""The operator's Helm chart (charts/routerfleet-operator): the helm binary the tests use, rendering the
chart, and manifests/operator/operator.yaml, which is the chart rendered for `kubectl apply -k`.

    python -m e2e.chart > manifests/operator/operator.yaml     # what `make manifests` runs

helm is built from the Go module proxy like the control plane (e2e/helm/build.sh, cached outside the
tree); ROUTERFLEET_HELM_BIN names a directory holding one instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "routerfleet-operator"
KUSTOMIZE_MANIFEST = ROOT / "manifests" / "operator" / "operator.yaml"
ENV = "ROUTERFLEET_HELM_BIN"
# What manifests/operator is: the chart in routerfleet-system, without Helm's release labels, and
# without the CRDs (applied apart, first: `kubectl apply --server-side -f crds/ -f manifests/operator/crds/`).
KUSTOMIZE_RELEASE = ("routerfleet-operator", "routerfleet-system")
KUSTOMIZE_VALUES = ("releaseLabels=false", "crds.install=false")
HEADER = (
    "# Generated from charts/routerfleet-operator by `make manifests` (python -m e2e.chart): edit the\n"
    "# chart, then regenerate; tests/operator/test_chart.py checks this is its current rendering.\n"
)


def helm() -> str:
    """The helm binary: $ROUTERFLEET_HELM_BIN/helm, else e2e/helm/build.sh's (built on first use)."""
    if os.environ.get(ENV):
        return str(Path(os.environ[ENV]) / "helm")
    out = subprocess.run(["bash", str(ROOT / "e2e" / "helm" / "build.sh")], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"e2e/helm/build.sh failed with exit code {out.returncode}")
    return str(Path(out.stdout.strip().splitlines()[-1]) / "helm")


def run(*args: str) -> str:
    """helm's output; RuntimeError with its message when it fails."""
    p = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def render(release: str, namespace: str, *values: str) -> str:
    """`helm template` of the chart; ``values`` as for ``--set``."""
    sets = [a for v in values for a in ("--set", v)]
    return run("template", release, str(CHART), "--namespace", namespace, *sets)


def kustomize_manifest() -> str:
    """manifests/operator/operator.yaml as the chart renders it now."""
    return HEADER + render(*KUSTOMIZE_RELEASE, *KUSTOMIZE_VALUES)


if __name__ == "__main__":
    sys.stdout.write(kustomize_manifest())
