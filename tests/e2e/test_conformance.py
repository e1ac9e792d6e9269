"""The Gateway API Inference Extension's conformance suite (v1.3.0, as published: its manifests, its
echo servers) against the local cluster's Envoy Gateway (e2e/gateway/envoy_gateway.py), first with its
reference endpoint picker, then with RouterFleet's in its place (e2e/gateway/conformance_suite.py). The
results are printed side by side; a test the suite reports failed fails these. A test in ``GAPS``
(none now) is skipped for a reason of the Gateway's side (run it with ``ROUTERFLEET_CONFORMANCE_ALL=1``);
a test in ``CHANCE`` that fails runs once more, alone, and that verdict counts (both are printed).

    python -m e2e.cluster pytest -s tests/e2e/test_conformance.py      # the table (make conformance first)
"""

import pytest
from test_envoy_gateway import envoy_gateway  # noqa: F401 (a fixture)
from test_node_agent import _local_only

from e2e.entrypoints import entrypoints
from e2e.gateway import extension
from e2e.gateway.conformance_suite import CHANCE, GAPS, REFERENCE_IMAGE, TESTS, run_suite, table

pytestmark = pytest.mark.timeout(3000)

NAMESPACES = ("inference-conformance-infra", "inference-conformance-app-backend")  # the suite's
RESULTS: dict[str, dict[str, str]] = {}  # picker -> its results, for the side-by-side table


@pytest.fixture
def suite(cluster, envoy_gateway):  # noqa: F811
    _local_only(cluster, "runs the suite's images as the binaries built here")
    images = entrypoints()
    for repo in (REFERENCE_IMAGE, "gcr.io/k8s-staging-gateway-api/echo-basic"):
        assert repo in images, f"{repo} has no binary here: make conformance"
    # The extension's CRDs as its release installs them (the suite checks they are of one bundle).
    p = envoy_gateway(
        "apply", "--server-side", "-f", str(extension.module_dir() / "config" / "crd" / "bases")
    )
    assert p.returncode == 0, p.stderr

    def attempt(picker: str, workdir, only: str | None = None):
        # A run's cleanup ends with its namespaces terminating: the next one starts once they are gone.
        gone = envoy_gateway(
            "wait", "--for=delete", "--timeout=240s", *(f"namespace/{n}" for n in NAMESPACES)
        )
        assert gone.returncode == 0, gone.stderr
        return run_suite(cluster.kubeconfig, workdir, picker=picker, only=only)

    def run(picker: str, workdir) -> dict[str, str]:
        results, rc, out = attempt(picker, workdir)
        assert len(results) == TESTS, f"the suite's {TESTS} tests, each with a result:\n{out[-6000:]}"
        # Its setup and cleanup, and any test that never reported (a panic, the deadline), fail it whole.
        reported = any(verdict == "FAIL" for verdict in results.values())
        assert rc == 0 or reported, f"the suite failed outside its tests (rc {rc}):\n{out[-6000:]}"
        for name in sorted(n for n in CHANCE if results.get(n) == "FAIL"):
            again = workdir / name
            again.mkdir()
            rerun, _, rerun_out = attempt(picker, again, only=name)
            print(f"\n[conformance] {name} failed ({CHANCE[name]}); alone again: {rerun.get(name)}")
            if rerun.get(name) == "PASS":
                results[name] = "PASS"
            else:
                out += rerun_out
        RESULTS[picker] = results
        print(f"\n[conformance] behind Envoy Gateway:\n{table(RESULTS)}")
        failed = {name for name, verdict in results.items() if verdict == "FAIL" and name not in GAPS}
        assert not failed, f"failed: {sorted(failed)} (the log: {workdir / 'suite.log'})\n{out[-6000:]}"
        return results

    return run


def test_the_conformance_suite_with_its_reference_picker(suite, tmp_path):
    suite("reference", tmp_path)


def test_the_conformance_suite_with_routerfleets_picker(suite, tmp_path):
    """Every test that passes with the reference picker passes with RouterFleet's."""
    ours = suite("routerfleet", tmp_path)
    reference = RESULTS.get("reference")
    if reference is not None:
        behind = [n for n, v in reference.items() if v == "PASS" and ours.get(n) != "PASS"]
        assert not behind, f"pass with the reference picker, not with ours: {behind}"
