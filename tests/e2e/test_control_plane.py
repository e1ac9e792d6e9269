"""The real control plane (e2e/kube + e2e/cluster) comes up and its controllers act.

Runs `python -m e2e.cluster run -- python -m e2e.cluster.smoke` in a subprocess: a cluster of its own,
without a node (the smoke checks that the scheduler finds no node, then plays a node itself), in a
netns of its own nested in the tests' one, so it never meets the session cluster of conftest.py.
Binaries come from $ROUTERFLEET_KUBE_BIN or e2e/kube/build.sh: a no-op once built, tens of minutes
cold. Deselect with `-m "not e2e"`.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_control_plane_smoke(tmp_path):
    work = tmp_path / "cluster"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "e2e.cluster",
            "run",
            "--workdir",
            str(work),
            "--",
            sys.executable,
            "-m",
            "e2e.cluster.smoke",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if r.returncode != 0:
        logs = "".join(
            f"\n--- {p.name} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted((work / "logs").glob("*.log"))
        )
        pytest.fail(f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-4000:]}{logs}")
    assert "smoke: all checks passed" in r.stdout
