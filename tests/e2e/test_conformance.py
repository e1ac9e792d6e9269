"""The Gateway API Inference Extension's conformance suite (v1.3.0, as published: its manifests, its
reference endpoint picker and echo servers) against the local cluster's Envoy Gateway
(e2e/gateway/envoy_gateway.py). Each test's result is printed as a table; a test the suite reports
failed fails this one. The tests in ``GAPS`` are skipped, each for a reason of the Gateway's side (run
them with ``ROUTERFLEET_CONFORMANCE_ALL=1``).

    python -m e2e.cluster pytest -s tests/e2e/test_conformance.py      # the table (make conformance first)
"""

import os
import re
import subprocess

import pytest
from test_envoy_gateway import envoy_gateway  # noqa: F401 (a fixture)
from test_node_agent import _local_only

from e2e.entrypoints import built, entrypoints
from e2e.gateway import envoy_gateway as eg
from e2e.gateway import extension

pytestmark = pytest.mark.timeout(3000)

RESULT = re.compile(r"^\s*--- (PASS|FAIL|SKIP): TestConformance/(\w+)", re.M)

# Tests that fail for a reason of the Gateway's (Envoy Gateway with e2e/gateway/eg-inferencepool), not
# the picker's: each fails with the reference picker too.
GAPS: dict[str, str] = {
    "GatewayDestinationEndpointServed": "the extension does not hand the picker the served endpoint as"
    " envoy.lb metadata (x-gateway-destination-endpoint-served), only as the upstream.address attribute",
    "GatewayWeightedAcrossTwoInferencePools": "Envoy Gateway renders a rule's two pools as one cluster;"
    " the extension sends it to the first pool's picker, so requests meant for the other pool's pods get"
    " 429 and nothing is weighted",
}


def run_suite(cluster, workdir) -> tuple[dict[str, str], int, str]:
    """Every test of the suite by name -> PASS, FAIL or SKIP; its exit code; and its output."""
    suite = built("gateway/build-conformance.sh", "gie-conformance")
    assert suite is not None, "the conformance suite is not built: make conformance"
    argv = [
        str(suite),
        "-test.v",
        "-test.timeout=45m",
        "-test.run=TestConformance",
        f"-gateway-class={eg.CLASS}",
        f"-report-output={workdir / 'report.yaml'}",
    ]
    if not os.environ.get("ROUTERFLEET_CONFORMANCE_ALL"):
        argv.append(f"-skip-tests={','.join(sorted(GAPS))}")
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=2900)
    out = done.stdout + done.stderr
    (workdir / "suite.log").write_text(out)
    return {name: verdict for verdict, name in RESULT.findall(out)}, done.returncode, out


def table(results: dict[str, str]) -> str:
    width = max(map(len, results), default=4)
    return "\n".join(
        f"{name:<{width}}  {verdict}" + (f"  ({GAPS[name]})" if verdict == "SKIP" and name in GAPS else "")
        for name, verdict in sorted(results.items())
    )


def test_the_conformance_suite_with_its_reference_picker(cluster, envoy_gateway, tmp_path):  # noqa: F811
    _local_only(cluster, "runs the suite's images as the binaries built here")
    images = entrypoints()
    for repo in (
        "registry.k8s.io/gateway-api-inference-extension/epp",
        "gcr.io/k8s-staging-gateway-api/echo-basic",
    ):
        assert repo in images, f"{repo} has no binary here: make conformance"
    # The extension's CRDs as its release installs them (the suite checks they are of one bundle).
    p = envoy_gateway(
        "apply", "--server-side", "-f", str(extension.module_dir() / "config" / "crd" / "bases")
    )
    assert p.returncode == 0, p.stderr
    results, rc, out = run_suite(cluster, tmp_path)
    print(f"\n[conformance] the reference picker behind Envoy Gateway:\n{table(results)}")
    assert len(results) == 12, f"the suite's 12 tests, each with a result:\n{out[-6000:]}"
    assert results, f"the suite ran no test:\n{out[-6000:]}"
    # Its setup and cleanup, and any test that never reported (a panic, the deadline), fail it as a whole.
    reported = any(verdict == "FAIL" for verdict in results.values())
    assert rc == 0 or reported, f"the suite failed outside its tests (rc {rc}):\n{out[-6000:]}"
    failed = {name for name, verdict in results.items() if verdict == "FAIL" and name not in GAPS}
    assert not failed, f"failed: {sorted(failed)} (the log: {tmp_path / 'suite.log'})\n{out[-6000:]}"
