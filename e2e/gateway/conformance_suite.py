"""The Gateway API Inference Extension's conformance suite (e2e/gateway/conformance: v1.3.0 as published,
built by build-conformance.sh) run against a Gateway of the local cluster, with the suite's reference
endpoint picker or with RouterFleet's in its place.

RouterFleet's picker replaces the reference one in the suite's own base manifests and nowhere else
(``routerfleet_base``): each picker Deployment runs ``routerfleet-router`` for the same pool, on the same
ports and probes (ext_proc 9002 over self-signed TLS; gRPC health 9003, plaintext, service
``inference-extension``), engines found from the pool itself (``--k8s-inference-pool``). The suite
drives picks with a request header, so the router runs its test-only ``--epp-conformance-test`` (never
on by default), and its echo servers serve the suite's own paths, which the router forwards by load
(``--allow-path``: every path the suite's HTTPRoutes match)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

import yaml

from e2e.entrypoints import built
from e2e.gateway import envoy_gateway as eg
from e2e.gateway import extension

REFERENCE_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp"
RESULT = re.compile(r"^\s*--- (PASS|FAIL|SKIP): TestConformance/(\w+)", re.M)
TESTS = 12  # the suite's tests in v1.3.0

# Tests that fail for a reason of the Gateway's (Envoy Gateway with e2e/gateway/eg-inferencepool), not
# the picker's, each with its reason: skipped unless ROUTERFLEET_CONFORMANCE_ALL is set. None now.
GAPS: dict[str, str] = {}

# Tests whose verdict depends on the Gateway's random draw, not on the picker, each with why: run once
# more, alone, when they fail. GatewayWeightedAcrossTwoInferencePools warms up by asking for each pod of
# both pools and needs 3 answers in a row within 200 s, at one request a second, while the route sends
# 30% of them to the secondary pool, whose picker rightly answers 503 for the primary's pods: about 1 in
# 50 per secondary pod times out, with either picker.
CHANCE: dict[str, str] = {
    "GatewayWeightedAcrossTwoInferencePools": "its warm-up needs 3 picks in a row through a 30% weight"
}


def suite_paths(module: Path) -> list[str]:
    """Every path the suite's HTTPRoutes match (each test sends its requests to exactly one)."""
    paths: set[str] = set()
    for f in [
        module / "conformance" / "resources" / "base.yaml",
        *(module / "conformance" / "tests").glob("*.yaml"),
    ]:
        for doc in yaml.safe_load_all(f.read_text()):
            if not doc or doc.get("kind") != "HTTPRoute":
                continue
            for rule in doc["spec"].get("rules") or []:
                for match in rule.get("matches") or []:
                    value = (match.get("path") or {}).get("value")
                    if value and value != "/":
                        paths.add(value)
    return sorted(paths)


def _reference_flags(args: list[str]) -> dict[str, str]:
    """The reference picker's ``--flag value`` pairs."""
    return {args[i].lstrip("-"): args[i + 1] for i in range(0, len(args) - 1, 2) if args[i].startswith("--")}


def routerfleet_container(reference: Mapping, paths: list[str]) -> dict:
    """RouterFleet's picker in place of the reference one's container ``reference``: same pool, ports
    and probes."""
    flags = _reference_flags(list(reference.get("args") or []))
    args = [
        "--host=0.0.0.0",
        "--port=8000",
        "--metrics-port=9090",
        f"--epp-port={flags['grpc-port']}",
        f"--epp-health-port={flags['grpc-health-port']}",
        f"--k8s-inference-pool={flags['pool-name']}",
        f"--k8s-namespace={flags['pool-namespace']}",
        "--epp-conformance-test",
        *(f"--allow-path={p}" for p in paths),
    ]
    ours = {k: copy.deepcopy(v) for k, v in reference.items() if k not in ("args", "volumeMounts")}
    ours.update(image="routerfleet:dev", command=["routerfleet-router"], args=args)
    return ours


def routerfleet_base(module: Path) -> list[dict]:
    """The suite's base manifests with RouterFleet's picker in every picker Deployment."""
    docs = [
        d for d in yaml.safe_load_all((module / "conformance" / "resources" / "base.yaml").read_text()) if d
    ]
    paths = suite_paths(module)
    replaced = 0
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        containers = d["spec"]["template"]["spec"]["containers"]
        for i, c in enumerate(containers):
            if c.get("image", "").split(":", 1)[0] == REFERENCE_IMAGE:
                containers[i] = routerfleet_container(c, paths)
                replaced += 1
    if not replaced:
        raise ValueError("the suite's base manifests deploy no reference picker: a new layout?")
    return docs


def run_suite(
    kubeconfig: Path, workdir: Path, *, picker: str = "reference", only: str | None = None
) -> tuple[dict[str, str], int, str]:
    """The suite with ``picker`` (``reference`` or ``routerfleet``), every test but ``GAPS`` (all of
    them with ROUTERFLEET_CONFORMANCE_ALL=1), or test ``only``: each test's name -> PASS, FAIL or SKIP;
    its exit code; its output (also in ``workdir``/suite.log)."""
    suite = built("gateway/build-conformance.sh", "gie-conformance")
    if suite is None:
        raise RuntimeError("the conformance suite is not built: make conformance")
    argv = [
        str(suite),
        "-test.v",
        "-test.timeout=45m",
        "-test.run=TestConformance",
        f"-gateway-class={eg.CLASS}",
        f"-report-output={workdir / 'report.yaml'}",
    ]
    if picker == "routerfleet":
        (workdir / "routerfleet-base.yaml").write_text(
            yaml.safe_dump_all(routerfleet_base(extension.module_dir()))
        )
        argv += [f"-manifests-dir={workdir}", "-base-manifests=routerfleet-base.yaml"]
    elif picker != "reference":
        raise ValueError(f"picker {picker!r}: reference or routerfleet")
    if only is not None:
        argv.append(f"-run-test={only}")
    elif GAPS and not os.environ.get("ROUTERFLEET_CONFORMANCE_ALL"):
        argv.append(f"-skip-tests={','.join(sorted(GAPS))}")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=2900)
    out = done.stdout + done.stderr
    (workdir / "suite.log").write_text(out)
    return {name: verdict for verdict, name in RESULT.findall(out)}, done.returncode, out


def table(columns: Mapping[str, Mapping[str, str]]) -> str:
    """Results side by side: one row per test, one column per picker, a skipped gap's reason after."""
    names = sorted({n for results in columns.values() for n in results})
    width = max(map(len, names), default=4)
    head = f"{'test':<{width}}  " + "  ".join(f"{c:<11}" for c in columns)
    rows = [head]
    for n in names:
        verdicts = [results.get(n, "-") for results in columns.values()]
        gap = f"  ({GAPS[n]})" if n in GAPS and "SKIP" in verdicts else ""
        rows.append(f"{n:<{width}}  " + "  ".join(f"{v:<11}" for v in verdicts) + gap)
    return "\n".join(rows)
