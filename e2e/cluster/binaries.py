"""Where the control-plane binaries are: $ROUTERFLEET_KUBE_BIN, else whatever e2e/kube/build.sh
prints (a no-op taking a second once built; a cold build takes tens of minutes)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

BUILD_SH = Path(__file__).resolve().parents[1] / "kube" / "build.sh"
ENV = "ROUTERFLEET_KUBE_BIN"


def kube_bin_dir(build: bool = True) -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if not build:
        raise RuntimeError(f"set {ENV} or run {BUILD_SH}")
    # stderr (progress) passes through; the last stdout line is the bin dir
    out = subprocess.run(["bash", str(BUILD_SH)], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{BUILD_SH} failed with exit code {out.returncode}")
    return Path(out.stdout.strip().splitlines()[-1])
