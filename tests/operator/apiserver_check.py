"""The RouterFleet CRD against a real API server (not collected by pytest: it needs a cluster).

    python -m e2e.cluster run -- .venv/bin/python tests/operator/apiserver_check.py

With KUBECONFIG pointing at a throwaway cluster and kubectl on PATH: applies the CRD, checks that the
samples are accepted with their defaults filled, that invalid specs are refused with the CRD's CEL
messages, that a status written by ``rollout.decide`` round-trips through the status subresource with
nothing pruned, and that the scale subresource works. Prints one line per check; exits 1 on a failure.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml

from routerfleet_operator.model import Verdict
from routerfleet_operator.render import (
    render_all,
    render_controller_revision,
    render_pod_template,
    revision_of,
)
from routerfleet_operator.rollout import BootstrapReport, PodView, decide
from routerfleet_operator.spec import Fleet

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "routerfleet.io_routerfleets.yaml"
SAMPLES = ROOT / "manifests" / "samples"
NS = "rf-check"
failures: list[str] = []


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {p.stderr.strip()}")
    return p


def ok(name: str, cond: bool, detail: str = "") -> None:
    print(f"{'PASS' if cond else 'FAIL'} {name}{': ' + detail if detail and not cond else ''}", flush=True)
    if not cond:
        failures.append(name)


def minimal(**spec_overrides) -> dict:
    obj = yaml.safe_load((SAMPLES / "minimal.yaml").read_text())
    obj["metadata"]["namespace"] = NS
    for path, value in spec_overrides.items():
        node = obj["spec"]
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return obj


def refused(name: str, obj: dict, *expect: str) -> None:
    p = kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(obj), check=False)
    msg = p.stderr.strip()
    ok(f"refused: {name}", p.returncode != 0 and all(e in msg for e in expect), msg or "accepted")
    if p.returncode != 0:
        print(f"     {msg[:400]}")


def main() -> int:
    kubectl("apply", "--server-side", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/routerfleets.routerfleet.io")
    kubectl("create", "namespace", NS)
    print("CRD established")

    # ---- samples: accepted, defaults filled --------------------------------------------------------
    for path in sorted(SAMPLES.glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        obj["metadata"]["namespace"] = NS
        p = kubectl("create", "-f", "-", stdin=json.dumps(obj), check=False)
        ok(f"sample accepted: {path.name}", p.returncode == 0, p.stderr.strip())
    got = json.loads(kubectl("get", "rf", "routers", "-n", NS, "-o", "json").stdout)
    spec = got["spec"]
    print("     defaulted minimal spec:", json.dumps(spec, sort_keys=True))
    ok(
        "defaults filled",
        spec.get("replicas") == 2
        and spec["router"]["policy"] == "kv_aware"
        and spec["router"]["tokenizer"]["source"] == "Bytes"
        and spec["bootstrap"]["timeout"] == "10m"
        and spec["bootstrap"]["passVerdicts"]
        == ["warm", "from_origin", "warm_unwitnessed", "no_peers", "fleet_cold", "disabled"]
        and spec["rollout"]
        == {"maxSurge": 1, "onSeedFailure": "Pause", "progressDeadline": "1h", "minReadySeconds": 0}
        and spec["engines"]["httpPort"] == "http"
        and spec["service"] == {"type": "ClusterIP", "port": 80}
        and spec["disruption"] == {"enabled": True},
    )
    # The operator's parser reads the defaulted object exactly as the undefaulted one.
    ok(
        "operator defaults == CRD defaults",
        Fleet.parse(got).spec == Fleet.parse(minimal()).spec,
    )

    # ---- invalid specs: refused with the CEL messages -----------------------------------------------
    refused(
        "passVerdicts without no_peers",
        minimal(bootstrap__passVerdicts=["warm", "fleet_cold"]),
        "must include no_peers and fleet_cold",
        "missing: no_peers",
    )
    refused(
        "extraArgs --internal-token-file",
        minimal(router__extraArgs=["--load-cost-tokens=64", "--internal-token-file=/tmp/t"]),
        "may not set a flag the operator owns",
        "extraArgs[1]",
        "--internal-token-file=/tmp/t",
    )
    refused(
        "extraArgs abbreviation --internal-tok",
        minimal(router__extraArgs=["--internal-tok", "/tmp/t"]),
        "may not set a flag the operator owns",
    )
    refused(
        "negative bootstrap timeout",
        minimal(bootstrap__timeout="-5s"),
        "bootstrap.timeout must be a duration between 1s and 1h",
        "got -5s",
    )
    refused("bootstrap timeout over 1h", minimal(bootstrap__timeout="2h"), "between 1s and 1h")
    refused(
        "progressDeadline not a duration", minimal(rollout__progressDeadline="30"), "rollout.progressDeadline"
    )
    refused(
        "progressDeadline shorter than the bootstrap hold",
        minimal(bootstrap__timeout="20m", bootstrap__seedRequired=True, rollout__progressDeadline="45m"),
        "must exceed the bootstrap hold",
    )
    refused(
        "bootstrap with round_robin", minimal(router__policy="round_robin"), "needs router.policy kv_aware"
    )
    refused(
        "both serviceName and selector", minimal(engines__selector={"matchLabels": {"a": "b"}}), "exactly one"
    )
    refused("env POD_IP", minimal(router__env=[{"name": "POD_IP", "value": "x"}]), "may not set POD_NAME")
    refused("maxSurge 0", minimal(rollout__maxSurge=0), "rollout.maxSurge")
    refused("onSeedFailure enum", minimal(rollout__onSeedFailure="Abort"), "Unsupported value")
    no_kv = minimal()
    del no_kv["spec"]["engines"]["kvPort"]
    refused("bootstrap without kvPort", no_kv, "needs engines.kvPort")
    long_name = minimal()
    long_name["metadata"]["name"] = "x" * 51
    refused("name too long", long_name, "may not be more than 50")
    bad_name = minimal()
    bad_name["metadata"]["name"] = "9routers"
    refused("name not a DNS-1035 label", bad_name, "DNS-1035 label")

    # ---- status: a decided status round-trips, nothing pruned ---------------------------------------
    fleet = Fleet.parse(got)
    rev = revision_of(fleet)
    now = datetime.now(UTC)
    report = BootstrapReport(settled=True, verdict=Verdict.NO_PEERS, index_nodes=3, peers_synced=True)
    pods = [PodView(f"routers-{i}", rev, created=f"2026-01-01T00:00:0{i}Z", report=report) for i in range(2)]
    d = decide(got, pods, now)
    d2 = decide(
        {**got, "status": d.status},
        [
            PodView(p.name, rev, p.created, gate=True, ready=True, ready_since=now, report=p.report)
            for p in pods
        ],
        now,
    )
    status = copy.deepcopy(d2.status)
    status["rollout"]["hold"] = {
        "reason": "SeedFailed",
        "revision": rev,
        "pods": ["x"],
        "since": "2026-01-01T00:00:00Z",
        "message": "m",
    }
    status["membersOmitted"] = 1
    kubectl(
        "patch", "rf", "routers", "-n", NS, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    back = json.loads(kubectl("get", "rf", "routers", "-n", NS, "-o", "json").stdout)["status"]
    ok("status round-trips unpruned", back == status, json.dumps(back, sort_keys=True)[:600])

    # ---- rendered manifests: accepted by the API server (server-side apply, dry run) -----------------
    kubectl("create", "namespace", "engines")
    for name in ("routers", "chat-routers", "rr-routers"):
        live = json.loads(kubectl("get", "rf", name, "-n", NS, "-o", "json").stdout)
        f = Fleet.parse(live)
        docs = [*render_all(f, "t0ken"), render_controller_revision(f, render_pod_template(f), 1)]
        for doc in docs:
            p = kubectl(
                "apply", "--server-side", "--dry-run=server", "--field-manager=routerfleet-operator",
                "-f", "-", stdin=json.dumps(doc), check=False,
            )  # fmt: skip
            ok(f"rendered {name} {doc['kind']} accepted", p.returncode == 0, p.stderr.strip())

    # ---- scale subresource and printer columns ------------------------------------------------------
    kubectl("scale", "rf", "routers", "-n", NS, "--replicas=4")
    scale = json.loads(
        kubectl(
            "get", "--raw", f"/apis/routerfleet.io/v1alpha1/namespaces/{NS}/routerfleets/routers/scale"
        ).stdout
    )
    ok(
        "scale subresource",
        scale["spec"]["replicas"] == 4 and scale["status"]["selector"] == "routerfleet.io/fleet=routers",
        json.dumps(scale),
    )
    table = kubectl("get", "rf", "-n", NS, "-o", "wide").stdout
    print(table)
    ok(
        "printer columns",
        table.split("\n")[0].split()
        == ["NAME", "DESIRED", "READY", "WARM", "UPDATED", "PHASE", "STATUS", "REASON", "AGE"],
    )
    ok("short name rf", kubectl("get", "rf", "-n", NS, check=False).returncode == 0)
    time.sleep(0)
    print(f"{len(failures)} failure(s)" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
