"""The images e2e manifests name without a command, and the binary each stands for: built from the same
Go module as the image (each build cached outside the tree by its script), run by the node agent
(``--entrypoint``) as a container runtime would run the image's entrypoint.

The cluster is given the ones already built: a build is slow (Envoy Gateway's takes 6 minutes cold), so
it is ``make``'s to run before the tests that need it (``make envoy-gateway``, ``make conformance``),
never a side effect of starting a cluster (the demo needs none of them)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# image repository -> (its build script, the binary in the bin dir the script prints)
BUILDS = {
    "docker.io/envoyproxy/gateway": ("gateway/build-envoy-gateway.sh", "envoy-gateway"),
    # Not an image anyone publishes: the local cluster's Envoy Gateway extension (envoy_gateway.py).
    "routerfleet.dev/e2e/envoy-gateway-inferencepool": (
        "gateway/build-eg-inferencepool.sh",
        "eg-inferencepool",
    ),
    # What the inference extension's conformance manifests deploy.
    "registry.k8s.io/gateway-api-inference-extension/epp": ("gateway/build-epp.sh", "epp"),
    "gcr.io/k8s-staging-gateway-api/echo-basic": ("gateway/build-echo-basic.sh", "echo-basic"),
}


def built(script: str, binary: str) -> Path | None:
    """``binary`` as ``script`` (under e2e/) built it, or None while it is not built."""
    argv = ["bash", str(ROOT / script)]
    env = {**os.environ, "ROUTERFLEET_NO_BUILD": "1"}
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=env, timeout=60)
    if done.returncode == 3:
        return None
    if done.returncode != 0:
        raise RuntimeError(f"e2e/{script} failed with exit code {done.returncode}")
    return Path(done.stdout.strip().splitlines()[-1]) / binary


def entrypoints() -> dict[str, str]:
    """image repository -> binary, for each build that is done (none without Go: nothing was built)."""
    out: dict[str, str] = {}
    if shutil.which("go") is None:
        return out
    for repo, (script, binary) in BUILDS.items():
        path = built(script, binary)
        if path is not None:
            out[repo] = str(path)
    return out
