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
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from e2e import fleet as F

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "routerfleet.io_routerfleets.yaml"
GROUP, VERSION, PLURAL = "routerfleet.io", "v1alpha1", "routerfleets"
SEEDED = "routerfleet.io/seeded"
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
CONVERSATIONS = 48  # live conversations, each visited in turn
WORKERS = 4  # requests in flight
PAUSE_S = 0.1  # between a worker's requests
TURNS = 10  # a conversation restarts (fresh text) after this many user turns
SYSTEM_PROMPTS = 4
WARM_S = 30.0  # workload before the rollout
WINDOW_S = 30.0  # "before" and "after" windows
BUCKET_S = 10.0  # the timeline's granularity


def say(msg: str) -> None:
    print(f"[bench.rollout {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ the cluster


class Kube:
    def __init__(self) -> None:
        self.kubeconfig = os.environ["KUBECONFIG"]
        cfg = client.Configuration()
        config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.crd = client.CustomObjectsApi(self.api)
        self.kubectl = self._kubectl_path()

    @staticmethod
    def _kubectl_path() -> str:
        if os.environ.get("ROUTERFLEET_KUBE_BIN"):
            p = Path(os.environ["ROUTERFLEET_KUBE_BIN"]) / "kubectl"
            if p.is_file():
                return str(p)
        if found := shutil.which("kubectl"):
            return found
        from e2e.cluster import kube_bin_dir

        return str(kube_bin_dir(build=False) / "kubectl")

    def run_kubectl(self, *args: str) -> None:
        p = subprocess.run(
            [self.kubectl, "--kubeconfig", self.kubeconfig, *args], capture_output=True, text=True, timeout=90
        )
        if p.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {p.stderr.strip()}")

    def wait(self, what: str, cond, timeout: float, interval: float = 0.3):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                if v := cond():
                    return v
            except (ApiException, OSError, KeyError) as e:
                last = repr(e)[:200]
            time.sleep(interval)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last})")

    def pods(self, ns: str, selector: str) -> list:
        return self.core.list_namespaced_pod(ns, label_selector=selector).items

    def fleet(self, ns: str) -> dict:
        return self.crd.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET)


def conds(p) -> dict[str, str]:
    return {c.type: c.status for c in p.status.conditions or []}


def pod_ready(p) -> bool:
    return (
        p.status.phase == "Running"
        and conds(p).get("Ready") == "True"
        and bool(p.status.pod_ip)
        and p.metadata.deletion_timestamp is None
    )


def fleet_ready(obj: dict) -> bool:
    gen = obj["metadata"]["generation"]
    st = obj.get("status") or {}
    ready = next((c for c in st.get("conditions") or [] if c["type"] == "Ready"), {})
    return (
        ready.get("status") == "True"
        and ready.get("observedGeneration") == gen
        and st.get("observedGeneration") == gen
        and st.get("currentRevision") == st.get("updateRevision")
    )


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


# ------------------------------------------------------------------------------------------ the workload


@dataclass
class Req:
    t: float  # monotonic, at the response's end
    pod: str
    rev: str
    prompt: int
    cached: int
    ttft: float
    born: float  # when its conversation started


@dataclass
class Conv:
    system: str
    turns: list[str]
    messages: list[dict] = field(default_factory=list)
    i: int = 0
    born: float = field(default_factory=time.monotonic)


class Texts:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.words = [
            "".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(self.rng.randrange(2, 9)))
            for _ in range(400)
        ]
        self.systems = [f"You are assistant #{i}. " + self.text(300) for i in range(SYSTEM_PROMPTS)]

    def text(self, n: int) -> str:
        out: list[str] = []
        size = 0
        while size < n:
            w = self.rng.choice(self.words)
            out.append(w)
            size += len(w) + 1
        return " ".join(out)

    def conv(self) -> Conv:
        c = Conv(self.rng.choice(self.systems), [self.text(250) for _ in range(TURNS)])
        c.messages = [{"role": "system", "content": c.system}]
        return c


@dataclass
class Replica:
    name: str
    seen: float
    created: float  # creationTimestamp, mapped to monotonic (1 s resolution)
    ip: str | None = None
    since: float | None = None
    settled: float | None = None  # since + settledAfterSeconds (router clock)
    settled_seen: float | None = None  # when this process first saw settled
    verdict: str | None = None
    seeded: float | None = None
    ready: float | None = None
    deleted: float | None = None


class Run:
    """One mode: the workload plus the monitor of router pods, fleet and bootstrap reports."""

    def __init__(self, kube: Kube, ns: str, token: str, seed: int):
        self.kube, self.ns, self.token = kube, ns, token
        self.sel = f"routerfleet.io/fleet={FLEET}"
        self.ready: list[tuple[str, str, str]] = []  # (pod, ip, revision) of Ready router pods
        self.reqs: list[Req] = []
        self.errors = 0
        self.stop = asyncio.Event()
        self.texts = Texts(seed)
        self.convs: asyncio.Queue[Conv] = asyncio.Queue()
        for _ in range(CONVERSATIONS):
            self.convs.put_nowait(self.texts.conv())
        self.rr = 0
        self.old_rev: str | None = None
        self.replicas: dict[str, Replica] = {}
        self.trigger: float | None = None
        self.done: float | None = None
        self.wall_offset = time.time() - time.monotonic()

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        pods = await asyncio.to_thread(self.kube.pods, self.ns, self.sel)
        now = time.monotonic()
        self.ready = [
            (p.metadata.name, p.status.pod_ip, p.metadata.labels.get("routerfleet.io/revision", ""))
            for p in pods
            if pod_ready(p)
        ]
        if self.trigger is None:
            return
        names = {p.metadata.name for p in pods}
        for r in self.replicas.values():
            if r.name not in names and r.deleted is None:
                r.deleted = now
        for p in pods:
            if p.metadata.labels.get("routerfleet.io/revision") == self.old_rev:
                continue
            r = self.replicas.get(p.metadata.name)
            if r is None:
                created = p.metadata.creation_timestamp.timestamp() - self.wall_offset
                r = self.replicas[p.metadata.name] = Replica(p.metadata.name, now, created)
            r.ip = p.status.pod_ip or r.ip
            c = conds(p)
            if r.seeded is None and c.get(SEEDED) == "True":
                r.seeded = now
            if r.ready is None and pod_ready(p):
                r.ready = now
            if r.settled_seen is None and r.ip:
                try:
                    _, rep = await F.get(
                        session,
                        f"http://{r.ip}:{F.INTERNAL_PORT}/internal/bootstrap",
                        headers={"Authorization": f"Bearer {self.token}"},
                        timeout=aiohttp.ClientTimeout(total=2),
                    )
                except (TimeoutError, aiohttp.ClientError, OSError):
                    continue
                if isinstance(rep, dict) and rep.get("settled"):
                    r.settled_seen = now
                    r.verdict = rep.get("verdict")
                    r.since = rep.get("since")
                    if r.since is not None and rep.get("settledAfterSeconds") is not None:
                        r.settled = r.since + rep["settledAfterSeconds"]

    async def monitor(self, session: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            try:
                await self.refresh(session)
                if self.trigger is not None and self.done is None:
                    obj = await asyncio.to_thread(self.kube.fleet, self.ns)
                    st = obj.get("status") or {}
                    if fleet_ready(obj) and st.get("currentRevision") != self.old_rev:
                        self.done = time.monotonic()
            except (ApiException, OSError) as e:
                say(f"monitor: {e!r:.200}")
            await asyncio.sleep(0.25)

    async def worker(self, session: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            if not self.ready:
                await asyncio.sleep(0.2)
                continue
            conv = await self.convs.get()
            try:
                if conv.i >= TURNS:
                    conv = self.texts.conv()
                conv.messages.append({"role": "user", "content": conv.turns[conv.i]})
                for _attempt in range(3):  # a router going away: the next Ready one, as a Service would
                    pod, ip, rev = self.ready[self.rr % len(self.ready)]
                    self.rr += 1
                    try:
                        ttft, answer, prompt, cached = await F.chat_turn(
                            session, f"http://{ip}:{F.ROUTER_PORT}", conv.messages
                        )
                    except (TimeoutError, aiohttp.ClientError, AssertionError, OSError):
                        self.errors += 1
                        await asyncio.sleep(0.1)
                        continue
                    self.reqs.append(Req(time.monotonic(), pod, rev, prompt, cached, ttft, conv.born))
                    conv.messages.append({"role": "assistant", "content": answer})
                    conv.i += 1
                    break
                else:
                    conv.messages.pop()
            finally:
                self.convs.put_nowait(conv)
            await asyncio.sleep(PAUSE_S)


def hit(reqs: list[Req]) -> tuple[float, int, float]:
    """(hit rate, requests, TTFT p50 ms)."""
    p = sum(r.prompt for r in reqs)
    c = sum(r.cached for r in reqs)
    return (c / p if p else float("nan"), len(reqs), 1000 * F.percentile([r.ttft for r in reqs], 50))


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
        obj = kube.wait("fleet Ready", lambda: o if fleet_ready(o := kube.fleet(ns)) else None, 150, 0.5)
        old_rev = obj["status"]["currentRevision"]
        say(f"[bootstrap {mode}] engines + {REPLICAS} routers Ready after {time.monotonic() - t0:.1f}s")
        sec = kube.core.read_namespaced_secret(f"{FLEET}-internal-token", ns)
        import base64

        token = base64.b64decode(sec.data["token"]).decode()
        run = Run(kube, ns, token, seed=1234)
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
        final = kube.fleet(ns)
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


def summarize(run: Run, mode: str, members: list[dict]) -> dict:
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
