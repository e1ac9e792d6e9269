"""The images e2e manifests name without a command, and the binary each stands for: built from the same
Go module as the image (each build cached outside the tree by its script), run by the node agent
(``--entrypoint``) as a container runtime would run the image's entrypoint.

The cluster is given the ones already built: a build is slow (Envoy Gateway's takes 6 minutes cold), so
it is ``make``'s to run before the tests that need it (``make envoy-gateway``), never a side effect of
starting a cluster (the demo needs none of them)."""

from __future__ import annotations

import os
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
}


def entrypoints() -> dict[str, str]:
    """image repository -> binary, for each build that is done."""
    out = {}
    env = {**os.environ, "ROUTERFLEET_NO_BUILD": "1"}
    for repo, (script, binary) in BUILDS.items():
        done = subprocess.run(
            ["bash", str(ROOT / script)], stdout=subprocess.PIPE, text=True, env=env, timeout=60
        )
        if done.returncode == 0:
            out[repo] = str(Path(done.stdout.strip().splitlines()[-1]) / binary)
        elif done.returncode != 3:  # 3: not built
            raise RuntimeError(f"e2e/{script} failed with exit code {done.returncode}")
    return out
