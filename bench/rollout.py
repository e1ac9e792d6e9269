"""A rolling update of a RouterFleet under a live chat workload: the operator's overhead per replica
and the prefix-cache hit rate clients see, with peer bootstrap enabled and then disabled.

    .venv/bin/python -m e2e.cluster run --node-agent node-1 -- .venv/bin/python -m bench.rollout

Runs inside the local e2e cluster (`KUBECONFIG` set by `e2e.cluster run`, pod IPs reachable). For
each mode (bootstrap on, then off), in a namespace of its own: 2 fake engines (2 DP ranks, a short
replay buffer so a new router cannot rebuild its index from the engines), the operator as a
subprocess, a 3-replica RouterFleet. A multi-turn chat workload goes round-robin over the Ready
router pods (what the fleet's Service would do) while the fleet warms up; then the
`routerfleet.io/restartedAt` annotation rolls the fleet replica by replica and the workload keeps
running until WINDOW_S after the rollout completed. Every response's
`usage.prompt_tokens_details.cached_tokens` is recorded with its time and router pod.

Per new replica: pod seen -> first engine rank discovered (`since` of /internal/bootstrap, the
router's CLOCK_MONOTONIC, shared with this process) -> bootstrap settled (`since +
settledAfterSeconds`) -> seeded gate True (written by the operator) -> pod Ready (kubelet readiness
probe, every 5 s). Ends with one table per mode and a side-by-side hit-rate table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from kubernetes.client.exceptions import ApiException

from e2e import fleet as F
from e2e.fleet_traffic import (
    GROUP,
    PLURAL,
    VERSION,
    WORKERS,
    Kube,
    Traffic,
    conds,
    fleet_ready,
    hit,
    pod_ready,
)

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "routerfleet.io_routerfleets.yaml"
RESTARTED_AT = "routerfleet.io/restartedAt"
FLEET = "rf"
IMAGE = "routerfleet:e2e"
NODE = "node-1"
REPLICAS = 3

ENGINE_ARGS = {
    "--replay-buffer": "8",  # batches per rank: once warm, replay no longer reaches sequence 0
    "--capacity-blocks": "40000",  # no eviction during the run: misses come from routing only
    "--prefill-us-per-token": "100",
}
WARM_S = 30.0  # workload before the rollout
WINDOW_S = 30.0  # "before" and "after" windows
BUCKET_S = 10.0  # the timeline's granularity


def say(msg: str) -> None:
    print(f"[bench.rollout {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ the cluster


class Operator:
    def __init__(self, kube: Kube, ns: str, log_path: Path):
        self.args = [
            sys.executable, "-m", "routerfleet_operator.cli", "run", "--namespace", ns,
            "--operator-namespace", ns, "--verbose",
        ]  # fmt: skip
        self.env = {**os.environ, "KUBECONFIG": kube.kubeconfig, "PYTHONUNBUFFERED": "1"}
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "operator"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        )
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def deploy_engines(kube: Kube, ns: str) -> None:
    docs = F.load_manifests(image=IMAGE)
    engine = F.find(docs, "Deployment", F.ENGINE)
    c = engine["spec"]["template"]["spec"]["containers"][0]
    args = [a for a in c["args"] if a.split("=", 1)[0] not in ENGINE_ARGS]
    c["args"] = args + [f"{k}={v}" for k, v in ENGINE_ARGS.items()]
    F.apply(kube.api, ns, [engine, F.find(docs, "Service", F.ENGINE)])


def fleet_manifest(ns: str, bootstrap: bool) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RouterFleet",
        "metadata": {"name": FLEET, "namespace": ns},
        "spec": {
            "replicas": REPLICAS,
            "router": {"image": IMAGE},
            "engines": {"serviceName": F.ENGINE, "kvPort": "kv", "replayPort": "replay", "dpSize": 2},
            "bootstrap": {"enabled": bootstrap, "timeout": "30s"},
        },
    }


async def run_mode(kube: Kube, bootstrap: bool, logdir: Path) -> dict:
    mode = "on" if bootstrap else "off"
    ns = f"rollout-bootstrap-{mode}"
    kube.core.create_namespace({"metadata": {"name": ns}})
    kube.wait(
        f"default ServiceAccount in {ns}",
        lambda: kube.core.read_namespaced_service_account("default", ns),
        30,
    )
    op = Operator(kube, ns, logdir / f"operator-{mode}.log")
    op.start()
    t0 = time.monotonic()
    try:
        deploy_engines(kube, ns)
        kube.wait(
            "2 engines Ready",
            lambda: len([p for p in kube.pods(ns, F.ENGINE_LABELS) if pod_ready(p)]) == 2,
            90,
        )
        kube.crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet_manifest(ns, bootstrap))
        obj = kube.wait(
            "fleet Ready", lambda: o if fleet_ready(o := kube.fleet(ns, FLEET)) else None, 150, 0.5
        )
        old_rev = obj["status"]["currentRevision"]
        say(f"[bootstrap {mode}] engines + {REPLICAS} routers Ready after {time.monotonic() - t0:.1f}s")
        sec = kube.core.read_namespaced_secret(f"{FLEET}-internal-token", ns)
        import base64

        token = base64.b64decode(sec.data["token"]).decode()
        run = Traffic(kube, ns, FLEET, token, seed=1234)
        run.old_rev = old_rev
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            await run.refresh(session)
            tasks = [asyncio.create_task(run.monitor(session))]
            tasks += [asyncio.create_task(run.worker(session)) for _ in range(WORKERS)]
            await asyncio.sleep(WARM_S)
            say(
                f"[bootstrap {mode}] warm: {len(run.reqs)} requests, hit rate {hit(run.reqs)[0]:.1%}; rolling"
            )
            run.trigger = time.monotonic()
            stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            await asyncio.to_thread(
                kube.crd.patch_namespaced_custom_object,
                GROUP, VERSION, ns, PLURAL, FLEET, {"metadata": {"annotations": {RESTARTED_AT: stamp}}},
            )  # fmt: skip
            deadline = time.monotonic() + 240
            while run.done is None and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            if run.done is None:
                say(f"[bootstrap {mode}] rollout did not complete within 240s")
            else:
                say(f"[bootstrap {mode}] rollout complete after {run.done - run.trigger:.1f}s")
                await asyncio.sleep(WINDOW_S)
            run.stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        final = kube.fleet(ns, FLEET)
        members = (final.get("status") or {}).get("members") or []
        return summarize(run, mode, members)
    finally:
        op.stop()
        try:
            kube.crd.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET)
            kube.apps.delete_namespaced_deployment(F.ENGINE, ns)
            kube.core.delete_namespace(ns)
        except ApiException:
            pass


def summarize(run: Traffic, mode: str, members: list[dict]) -> dict:
    T, D = run.trigger, run.done
    end = D if D is not None else time.monotonic()
    reqs = run.reqs
    out: dict = {
        "mode": mode,
        "errors": run.errors,
        "members": [(m["pod"], m.get("verdict")) for m in members],
    }
    out["wall"] = (D - T) if D is not None else None
    reps = sorted(run.replicas.values(), key=lambda r: r.seen)
    rows = []
    for r in reps:

        def rel(x):
            return None if x is None else x - T

        rows.append(
            {
                "pod": r.name,
                "verdict": r.verdict,
                "created": rel(r.created),
                "seen": rel(r.seen),
                "since": rel(r.since),
                "settled": rel(r.settled),
                "settled_seen": rel(r.settled_seen),
                "bootstrap_s": (r.settled - r.since)
                if r.settled is not None and r.since is not None
                else None,
                "seeded": rel(r.seeded),
                "ready": rel(r.ready),
            }
        )
    out["replicas"] = rows
    out["windows"] = {
        "before": hit([r for r in reqs if T - WINDOW_S <= r.t < T]),
        "during": hit([r for r in reqs if T <= r.t < end]),
        "during, new routers": hit([r for r in reqs if T <= r.t < end and r.rev != run.old_rev]),
        "during, old routers": hit([r for r in reqs if T <= r.t < end and r.rev == run.old_rev]),
        "after": hit([r for r in reqs if end <= r.t < end + WINDOW_S]),
        "after, chats begun after the rollout": hit(
            [r for r in reqs if end <= r.t < end + WINDOW_S and r.born >= end]
        ),
    }
    buckets = []
    t = T - 2 * BUCKET_S
    while t < end + WINDOW_S:
        sel = [r for r in reqs if t <= r.t < t + BUCKET_S]
        buckets.append((t - T, *hit(sel)))
        t += BUCKET_S
    out["buckets"] = buckets
    return out


# ------------------------------------------------------------------------------------------ reporting


def f(x, spec=".1f", none="-") -> str:
    return none if x is None else format(x, spec)


def report(results: list[dict]) -> None:
    print()
    for res in results:
        print(
            f"=== bootstrap {res['mode']}: rollout of {REPLICAS} replicas, wall {f(res['wall'])} s "
            f"({f(res['wall'] / REPLICAS if res['wall'] else None)} s per replica), "
            f"{res['errors']} failed requests (retried)"
        )
        print(
            "times in s from the restartedAt patch; bootstrap = settled - first rank discovered "
            "(router clock); gate = seeded - settled; probe = ready - seeded"
        )
        hdr = (
            "pod",
            "verdict",
            "created",
            "1st rank",
            "settled",
            "seeded",
            "ready",
            "bootstrap",
            "create>settle",
            "gate",
            "probe",
        )
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
        for r in res["replicas"]:
            settled = r["settled"] if r["settled"] is not None else r["settled_seen"]
            mark = "" if r["settled"] is not None else " (polled)"
            cs = (settled - r["created"]) if settled is not None else None
            gate = (
                (r["seeded"] - r["settled"]) if r["seeded"] is not None and r["settled"] is not None else None
            )
            probe = (r["ready"] - r["seeded"]) if r["ready"] is not None and r["seeded"] is not None else None
            cells = [
                r["pod"], r["verdict"] or "-", f(r["created"]), f(r["since"]), f(settled) + mark,
                f(r["seeded"]), f(r["ready"]), f(r["bootstrap_s"], ".2f"), f(cs), f(gate), f(probe),
            ]  # fmt: skip
            print("| " + " | ".join(cells) + " |")
        if res["wall"]:
            rs = res["replicas"]
            boot = sum(r["bootstrap_s"] or 0 for r in rs)
            c2s = sum(
                ((r["settled"] if r["settled"] is not None else r["settled_seen"]) - r["created"])
                for r in rs
                if (r["settled"] if r["settled"] is not None else r["settled_seen"]) is not None
            )
            print(
                f"sum of bootstrap {boot:.1f} s, sum of create->settled {c2s:.1f} s, "
                f"wall {res['wall']:.1f} s: "
                f"operator + probes + pod churn = {res['wall'] - c2s:.1f} s "
                f"({(res['wall'] - c2s) / REPLICAS:.1f} s per replica)"
            )
        print(f"final members: {res['members']}")
        print()
    print("=== hit rate (cached / prompt tokens) seen through the routers, by window")
    hdr = ["window"] + [f"bootstrap {r['mode']}: hit / reqs / TTFT p50 ms" for r in results]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for w in results[0]["windows"]:
        cells = []
        for r in results:
            h, n, p50 = r["windows"][w]
            cells.append(f"{h:.1%} / {n} / {p50:.0f}" if n else "- / 0 / -")
        print(f"| {w} | " + " | ".join(cells) + " |")
    print()
    print(
        f"=== hit rate timeline, {BUCKET_S:.0f} s buckets (t from the patch; rollout ends at "
        + ", ".join(f"{f(r['wall'])} s ({r['mode']})" for r in results)
        + ")"
    )
    n = max(len(r["buckets"]) for r in results)
    hdr = ["t"] + [f"bootstrap {r['mode']}" for r in results]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for i in range(n):
        t = next(r["buckets"][i][0] for r in results if i < len(r["buckets"]))
        cells = []
        for r in results:
            if i < len(r["buckets"]) and r["buckets"][i][2]:
                _, h, k, _ = r["buckets"][i]
                cells.append(f"{h:.1%} ({k})")
            else:
                cells.append("-")
        last = i == n - 1
        print(f"| {t:+.0f}{' (partial)' if last else ''} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="on,off", help="bootstrap modes to run, in order (default on,off)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--logdir", type=Path, default=Path("/tmp/bench-rollout"), help="operator logs")
    a = ap.parse_args()
    if "KUBECONFIG" not in os.environ:
        print(
            "run it inside the local cluster: .venv/bin/python -m e2e.cluster run --node-agent node-1 -- "
            ".venv/bin/python -m bench.rollout",
            file=sys.stderr,
        )
        return 2
    a.logdir.mkdir(parents=True, exist_ok=True)
    kube = Kube()
    t0 = time.monotonic()
    kube.wait(
        f"node {NODE} Ready without taints",
        lambda: (
            (n := kube.core.read_node(NODE))
            and conds(n).get("Ready") == "True"
            and not [t for t in n.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
        ),
        90,
    )
    kube.run_kubectl("apply", "--server-side", "-f", str(CRD))
    kube.run_kubectl("wait", "--for=condition=Established", "crd/routerfleets.routerfleet.io")
    results = []
    for m in a.modes.split(","):
        results.append(asyncio.run(run_mode(kube, m.strip() == "on", a.logdir)))
    report(results)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    say(f"done in {time.monotonic() - t0:.0f}s (operator logs in {a.logdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
