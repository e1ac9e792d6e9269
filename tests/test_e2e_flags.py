"""The demo's and the soak's flags: a choice that cannot run says so in one line naming the flag, and
exits 2 before it starts a cluster or installs anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

from e2e.fleet import ROOT


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ("e2e.soak", "--engines", "vllm", "--faults", "rollout,readiness_flap"),
            "'readiness_flap' does not apply",
        ),
        (
            ("e2e.soak", "--engines", "vllm", "--faults", "replay_unanswered"),
            "'replay_unanswered' does not apply",
        ),
        (("e2e.soak", "--faults", "rollout,nope"), "unknown class 'nope'"),
        (("e2e.soak", "--engines", "sglang"), "invalid choice: 'sglang'"),
        (("e2e.demo", "--local", "--engines", "vllm"), "vllm runs on the cluster only"),
    ],
)
def test_a_choice_that_cannot_run_is_one_line_naming_its_flag(argv, says):
    r = run(*argv)
    assert r.returncode == 2, r
    last = r.stderr.strip().splitlines()[-1]
    flag = "--faults" if "--faults" in argv else "--engines"
    assert f"argument {flag}" in last and says in last, r.stderr


def test_the_vllm_soak_draws_only_faults_that_apply_to_it():
    from e2e.soak import FAKE, FAULTS, VLLM, soak

    assert set(VLLM.not_here) < set(FAULTS) and not FAKE.not_here
    with pytest.raises(ValueError, match="readiness_flap"):
        soak(None, None, "ns", seed=1, faults=["readiness_flap"], rounds=1, minutes=1, engines=VLLM)
