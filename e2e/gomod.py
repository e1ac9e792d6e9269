"""A pinned Go module's files, as the tests use them (CRDs, charts, manifests): the module a wrapper in
this tree pins (its go.sum verifies what the Go module proxy serves), in Go's module cache after the
first download."""

from __future__ import annotations

import json
import os
import subprocess
from functools import cache
from pathlib import Path


@cache
def module_dir(module: str, wrapper: Path) -> Path:
    """Where ``module``, at the version ``wrapper``'s go.mod pins, is unpacked."""
    env = {**os.environ, "GOFLAGS": "-mod=readonly", "GOWORK": "off", "GOTOOLCHAIN": "local"}
    argv = ["go", "mod", "download", "-json", module]
    done = subprocess.run(argv, cwd=wrapper, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"go mod download {module}: {done.stderr.strip()[-2000:] or done.stdout[-2000:]}")
    return Path(json.loads(done.stdout)["Dir"])
