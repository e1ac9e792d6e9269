"""The Gateway API Inference Extension's own files, as the tests use them: the module pinned in
``extension/go.mod`` (its go.sum verifies what the Go module proxy serves), in Go's module cache after
the first download."""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path

MODULE = "sigs.k8s.io/gateway-api-inference-extension"
HERE = Path(__file__).with_name("extension")


@cache
def module_dir() -> Path:
    env = {**os.environ, "GOFLAGS": "-mod=readonly", "GOWORK": "off", "GOTOOLCHAIN": "local"}
    done = subprocess.run(
        ["go", "mod", "download", "-json", MODULE],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"go mod download {MODULE}: {done.stderr.strip()[-2000:] or done.stdout[-2000:]}")
    return Path(json.loads(done.stdout)["Dir"])


def crd(name: str) -> Path:
    """One of the extension's CRDs, e.g. ``inference.networking.x-k8s.io_inferenceobjectives.yaml``."""
    path = module_dir() / "config" / "crd" / "bases" / name
    if not path.is_file():
        raise FileNotFoundError(path)
    return path
