"""`make demo`: RouterFleet on a real (local) Kubernetes cluster, or without one.

Cluster mode (the default; root, because the cluster lives in a private network namespace):
builds the control plane on first use (e2e/kube, ~7 min on 2 cores, cached), starts it with the
process node agent, and then, with the manifests a user applies, printing each kubectl command:

1. installs the operator: the CRDs (the Gateway API Inference Extension's too), then `kubectl apply -k
   manifests/operator` (two replicas, kopf peering);
2. deploys manifests/base's fake engines (2 engines x 2 DP ranks, a disk tier each), or with
   ``--engines vllm`` (`make demo ENGINES=vllm`) two real vLLM engines as pods: its CPU build serving
   e2e/vllm's tiny model (installed by `make vllm`; a cold start compiles it: a minute or two);
3. applies manifests/samples/demo.yaml (a 3-replica RouterFleet; for vLLM with e2e/vllm's router and
   engines sections: block size 32, tokens from the engines), waits with `kubectl wait
   --for=condition=Ready`, prints `kubectl get rf` and each replica's verdict from the status, and the
   InferencePool the operator rendered (the fleet is its endpoint picker, spec.gateway);
4. runs multi-turn chats through the standalone gateway, round-robin over the Envoys beside the Ready
   routers (as the fleet's gateway Service would; each asks its router's picker), and prints the hit
   rate (usage.prompt_tokens_details.cached_tokens) and TTFT;
   then, the traffic still flowing: a rollout triggered by a spec change (`extraArgs`), live, with its
   hit rate before, during and after;
5. a failed seed: a block-size change the engines do not share; the rollout pauses (condition
   Stalled/ConfigMismatch, the Event) while the old replicas serve, and the revert is Ready at once;
6. the same rollout with peer bootstrap disabled, side by side with the first;
7. kills one engine's container (SIGKILL, as an OOM kill would): it restarts in its pod with its disk
   tier (an emptyDir) intact, and the demo prints how soon after its return the routers re-adopt that
   tier and send the prefixes kept there back to it (local provider and fake engines only: it signals
   the process, and vLLM's CPU build here has no disk tier);
8. stops the cluster, which removes everything (also on Ctrl-C or a failure).

When no cluster can start (not root, no Go to build it, ...) it says why and runs the local demo.

Local mode (`--local`): two fake engines and one router as plain processes on loopback, under a
scripted workload (evictions, a lost batch filled by replay, an engine restart), with a live table of
what the router's index knows per engine, rank and tier next to what each engine really holds.
Exits non-zero if the two views disagree once the workload has settled.

    python -m e2e.demo               # cluster, else local
    python -m e2e.demo --cluster     # cluster or fail
    python -m e2e.demo --local
    python -m e2e.demo --engines vllm    # real vLLM engines (the cluster only)
    python -m e2e.cluster run --node-agent node-1 -- python -m e2e.demo --cluster   # (see below)

The last form runs the demo on a cluster that `e2e.cluster run` started (its netns; as non-root it
makes a user namespace too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass

import aiohttp

from e2e import fleet as F
from e2e import fleet_traffic as T
from e2e.dump import dump_namespace
from router_runtime.kv.decode import normalize_hash
from router_runtime.kv.hashing import hash_set_digest
from routerfleet_operator.model import GATEWAY_PORT

# ================================================================================================ local

BLOCK = 16


def free_port_base(n: int) -> int:
    """A base port with ``n`` consecutive free ports (engines bind base + rank)."""
    for _ in range(100):
        base = random.randrange(20_000, 40_000)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SystemExit("demo: no free ports")


@dataclass
class Engine:
    name: str
    dialect: str
    dp: int
    host_tier: int
    port: int = 0
    kv: int = 0
    replay: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, logdir: str) -> None:
        self.port, self.kv, self.replay = free_port_base(1), free_port_base(self.dp), free_port_base(self.dp)
        log = open(os.path.join(logdir, f"{self.name}.log"), "w")  # noqa: SIM115 (lives with the process)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "routerfleet_fake_engine.cli",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--kv-port",
                str(self.kv),
                "--replay-port",
                str(self.replay),
                "--dp-size",
                str(self.dp),
                "--dialect",
                self.dialect,
                "--block-size",
                str(BLOCK),
                "--capacity-blocks",
                "48",
                "--host-capacity-blocks",
                str(self.host_tier),
                "--decode-tokens-per-s",
                "0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def worker_flag(self) -> str:
        return (
            f"url={self.url},kv=tcp://127.0.0.1:{self.kv},replay=tcp://127.0.0.1:{self.replay},dp={self.dp}"
        )


async def wait_http(session: aiohttp.ClientSession, url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as r:
                if r.status < 500:
                    return
        await asyncio.sleep(0.1)
    raise SystemExit(f"demo: {url} did not come up (see the logs)")


async def views(session: aiohttp.ClientSession, engines: list[Engine], metrics_url: str) -> list[tuple]:
    """Rows of (engine, rank, tier, engine blocks, engine digest, index blocks, index digest); the
    router's index from its metrics port."""
    async with session.get(metrics_url + "/debug/index") as r:
        index = await r.json()
    held = {(c["engine"], c["rank"]): c["tiers"] for c in index["carriers"]}
    rows = []
    for e in engines:
        async with session.get(e.url + "/admin/state") as r:
            state = await r.json()
        for rank in state["ranks"]:
            for tier in ("device", "host"):
                truth = {normalize_hash(h) for h in rank["blocks"].get(tier, [])}
                ours = held.get((e.url, rank["rank"]), {}).get(
                    tier, {"blocks": 0, "digest": hash_set_digest([])}
                )
                rows.append(
                    (
                        e.name,
                        rank["rank"],
                        tier,
                        len(truth),
                        hash_set_digest(truth),
                        ours["blocks"],
                        ours["digest"],
                    )
                )
    return rows


COUNTERS = {
    "routerfleet_kv_batches_total": "batches",
    "routerfleet_kv_gaps_total": "gaps",
    'routerfleet_kv_replays_total{outcome="filled"}': "replays filled",
    'routerfleet_kv_ranks_cleared_total{reason="publisher_restart"}': "ranks reset by a restart",
    "routerfleet_kv_index_nodes": "index nodes",
}


async def counters(session: aiohttp.ClientSession, metrics_url: str) -> str:
    async with session.get(metrics_url + "/metrics") as r:
        text = await r.text()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return "   ".join(f"{label}: {float(values.get(name, 0)):.0f}" for name, label in COUNTERS.items())


def render(rows: list[tuple], phase: str, clear: bool, footer: str = "") -> str:
    out = ["\x1b[H\x1b[2J" if clear else "", f"RouterFleet demo: KV index vs engines   [{phase}]", ""]
    out.append(f"{'engine':<16}{'rank':>5} {'tier':<7}{'engine holds':>14}{'index knows':>13}  agree")
    for name, rank, tier, n_true, d_true, n_ours, d_ours in rows:
        ok = "yes" if (n_true, d_true) == (n_ours, d_ours) else "NO"
        out.append(f"{name:<16}{rank:>5} {tier:<7}{n_true:>14}{n_ours:>13}  {ok}")
    out += ["", f"router: {footer}"] if footer else []
    return "\n".join(out)


def prompt(rng: random.Random, system: list[int], turns: int) -> list[int]:
    return system + [rng.randrange(32, 127) for _ in range(BLOCK * turns + rng.randrange(BLOCK))]


async def workload(session: aiohttp.ClientSession, engines: list[Engine], seconds: float, show) -> None:
    rng = random.Random(7)
    systems = [[rng.randrange(32, 127) for _ in range(BLOCK * 4)] for _ in range(3)]
    t_end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < t_end:
        e = engines[step % len(engines)]
        body = {"prompt": prompt(rng, rng.choice(systems), rng.randrange(1, 6)), "max_tokens": 4}
        async with session.post(e.url + "/v1/completions", json=body) as r:
            await r.read()
        step += 1
        if step == 40:  # a batch lost on the wire: the router sees the gap and replays it
            await session.post(engines[0].url + "/admin/skip_seq", json={"rank": 0, "n": 1})
        if step == 80:  # an engine restarts: a new incarnation whose blocks are gone
            await session.post(engines[1].url + "/admin/restart", json={})
        if step % 10 == 0:
            await show(f"workload: {step} requests")
        await asyncio.sleep(0.02)


async def local_main_async(seconds: float, clear: bool) -> int:
    engines = [
        Engine("vllm-0.33", "vllm-0.33", dp=1, host_tier=32),
        Engine("sglang", "sglang", dp=2, host_tier=0),
    ]
    logdir = os.path.join(os.getcwd(), ".cache", "demo")
    os.makedirs(logdir, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        for e in engines:
            e.start(logdir)
            procs.append(e.proc)
        router_port = free_port_base(2)  # the public port, then the metrics port
        router_log = open(os.path.join(logdir, "router.log"), "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "router_runtime.cli",
                    "--port",
                    str(router_port),
                    "--metrics-port",
                    str(router_port + 1),
                    "--block-size",
                    str(BLOCK),
                    *[a for e in engines for a in ("--worker", e.worker_flag())],
                ],
                stdout=router_log,
                stderr=subprocess.STDOUT,
            )
        )
        router_url = f"http://127.0.0.1:{router_port}"
        metrics_url = f"http://127.0.0.1:{router_port + 1}"
        async with aiohttp.ClientSession() as session:
            for url in [e.url + "/health" for e in engines] + [router_url + "/healthz"]:
                await wait_http(session, url)
            await wait_http(session, router_url + "/readyz")
            # Subscriptions need a moment to reach the publishers (ZMQ drops what a PUB sends earlier).
            await asyncio.sleep(1.0)

            async def show(phase: str) -> None:
                rows = await views(session, engines, metrics_url)
                print(render(rows, phase, clear, await counters(session, metrics_url)), flush=True)

            await workload(session, engines, seconds, show)
            await asyncio.sleep(1.0)  # let the last batches land
            rows = await views(session, engines, metrics_url)
            print(render(rows, "settled", clear, await counters(session, metrics_url)))
            agree = all((r[3], r[4]) == (r[5], r[6]) for r in rows)
            print(
                "\nthe router's index agrees with every engine"
                if agree
                else "\nMISMATCH (see .cache/demo/*.log)"
            )
            return 0 if agree else 1
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


# ================================================================================================ cluster

NODE = "node-1"
SAMPLE = F.ROOT / "manifests" / "samples" / "demo.yaml"  # the RouterFleet the demo applies
FLEET = "demo"
OPERATOR_NS = "routerfleet-system"  # manifests/operator's namespace
OPERATOR_LABELS = "app.kubernetes.io/name=routerfleet-operator"
VLLM_PODS = "app.kubernetes.io/name=vllm"  # e2e/vllm's engine_manifests
# Engines keep this many batches per rank for replay: a long-running engine's buffer no longer reaches
# sequence 0, so a new replica cannot rebuild from the engines (from_origin) and inherits a sibling's
# index instead, the path this demo shows. (The manifests keep the engine's default, 10000.)
DEMO_REPLAY_BUFFER = 8
# The engines keep a disk tier in an emptyDir (it survives a container restart, not the pod), and
# this many conversation prefixes of DISK_PREFIX_BLOCKS blocks are put on the victim's.
STORAGE_DIR = "/var/lib/routerfleet-kv"
DISK_PREFIXES, DISK_PREFIX_BLOCKS = 40, 4
STEADY_S = 12.0  # traffic before the first rollout
AFTER_S = 8.0  # traffic after a rollout completes, in its "after" window
T0 = time.monotonic()


class DemoError(RuntimeError):
    pass


class NoCluster(RuntimeError):
    """The cluster could not start: fall back to the local demo."""


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def shell(cmd: str) -> None:
    """Show a command as the user would type it (the demo runs its equivalent)."""
    print(f"{'':9}$ {cmd}", flush=True)


def wrap(text: str, first: str, rest: str) -> str:
    return textwrap.fill(text, 96, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def indent(text: str) -> None:
    for line in text.rstrip().splitlines():
        print(f"{'':11}{line}", flush=True)


async def wait_until(what: str, fn, timeout: float, interval: float = 0.2):
    """Poll ``fn`` (sync, run in a thread, or async) until truthy; errors count as not yet."""
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            v = await fn() if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn)
            if v:
                return v
        except (ApiException, aiohttp.ClientError, OSError, KeyError, ValueError, TimeoutError) as e:
            last = repr(e)[:200]
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last})")
        await asyncio.sleep(interval)


class Demo:
    """The demo's cluster: its clients, the namespace it works in, and the traffic it drives."""

    def __init__(self, kube: T.Kube, provider, ns: str, engines: str = "fake") -> None:
        self.kube, self.provider, self.ns, self.engines = kube, provider, ns, engines
        self.core = kube.core

    @property
    def vllm(self) -> bool:
        return self.engines == "vllm"

    @property
    def block(self) -> int:
        """The engines' block size, and the fleet's."""
        from e2e import vllm

        return vllm.BLOCK_SIZE if self.vllm else BLOCK

    def kubectl(self, *args: str, output: bool = False) -> str:
        """Run kubectl, shown as typed (``output``: its output too)."""
        shell("kubectl " + " ".join(args))
        out = self.kube.run_kubectl(*args)
        if output:
            indent(out)
        return out

    def fleet(self) -> dict:
        return self.kube.fleet(self.ns, FLEET)

    def patch(self, merge: str) -> None:
        self.kubectl("-n", self.ns, "patch", f"rf/{FLEET}", "--type", "merge", "-p", merge)

    def pods(self, ns: str, selector: str) -> list:
        return sorted(self.kube.pods(ns, selector), key=lambda p: p.metadata.name)

    async def ready_pods(self, ns: str, selector: str, n: int, timeout: float = 90) -> list:
        def cond():
            pods = self.pods(ns, selector)
            return pods if len(pods) == n and all(T.pod_ready(p) for p in pods) else None

        return await wait_until(f"{n} pods {selector} Ready in {ns}", cond, timeout)

    def condition(self, obj: dict, type_: str) -> dict:
        return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})

    def dump(self) -> None:
        """Each namespace's events, workloads, pod states and container log tails (after a failure)."""
        for ns in (self.ns, OPERATOR_NS):
            print(dump_namespace(self.kube.api, ns, self.container_log, log_lines=12))

    def container_log(self, ns: str, pod: str, container: str) -> str:
        return self.provider.container_log(ns, pod, container) or ""


async def node_ready(demo: Demo) -> None:
    def cond():
        n = demo.core.read_node(NODE)
        taints = [t for t in n.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
        return T.conds(n).get("Ready") == "True" and not taints

    await wait_until(f"node {NODE} Ready", cond, 90)


def members_table(obj: dict) -> None:
    st = obj.get("status") or {}
    print(f"{'':11}{'router pod':<28}{'revision':<12}{'verdict':<18}{'seeded':<8}{'index blocks':>12}")
    for m in sorted(st.get("members") or [], key=lambda m: m["pod"]):
        print(
            f"{'':11}{m['pod']:<28}{m.get('revision', '-'):<12}{m.get('verdict') or '-':<18}"
            f"{'yes' if m.get('gate') else 'no':<8}{m.get('indexNodes', 0):>12}"
        )


def traffic_line(traffic: T.Traffic, since: float) -> str:
    recent = [r for r in traffic.reqs if r.t >= time.monotonic() - 3]
    h, n, _ = T.hit(recent)
    revs: dict[str, int] = {}
    for _pod, _ip, rev in traffic.ready:
        revs[rev] = revs.get(rev, 0) + 1
    ready = ", ".join(f"{n} of {rev}" for rev, n in sorted(revs.items())) or "none"
    t = time.monotonic() - since
    return f"+{t:4.1f}s  Ready routers: {ready:<28} last 3 s: {n:>3} requests, hit {h:6.1%}"


async def rollout(demo: Demo, traffic: T.Traffic, patch: dict, what: str) -> dict:
    """Patch the fleet (a rollout), show its progress under traffic, and return the hit-rate windows."""
    obj = await asyncio.to_thread(demo.fleet)
    traffic.old_rev = obj["status"]["currentRevision"]
    traffic.replicas, traffic.done = {}, None
    traffic.trigger = time.monotonic()
    demo.patch(json.dumps(patch))
    say(f"rolling out ({what}); traffic keeps flowing, round-robin over the Ready routers' Envoys")
    limit = 300 if demo.vllm else 120  # a new router rebuilding from vLLM's replay asks it for every batch
    deadline = time.monotonic() + limit
    while traffic.done is None:
        if time.monotonic() > deadline:
            raise DemoError(f"the rollout ({what}) did not complete in {limit} s")
        await asyncio.sleep(2)
        print(f"{'':11}{traffic_line(traffic, traffic.trigger)}", flush=True)
    took = traffic.done - traffic.trigger
    say(f"  rollout complete in {took:.1f}s; {AFTER_S:.0f} s more traffic on the new revision ...")
    await asyncio.sleep(AFTER_S)
    members_table(await asyncio.to_thread(demo.fleet))
    T0_, D = traffic.trigger, traffic.done
    reqs = traffic.reqs
    verdicts = sorted({r.verdict or "-" for r in traffic.replicas.values()})
    return {
        "what": what,
        "took": took,
        "verdicts": verdicts,
        "before": T.hit([r for r in reqs if T0_ - STEADY_S <= r.t < T0_]),
        "during": T.hit([r for r in reqs if T0_ <= r.t < D]),
        "new": T.hit([r for r in reqs if T0_ <= r.t < D and r.rev != traffic.old_rev]),
        "after": T.hit([r for r in reqs if D <= r.t < D + AFTER_S]),
    }


def rollout_table(results: list[dict]) -> None:
    print()
    cols = [r["what"] for r in results]
    print(f"{'':11}{'hit rate / TTFT p50':<34}" + "".join(f"{c:<30}" for c in cols))

    def cell(x):
        h, n, p50 = x
        return f"{h:6.1%} / {p50:5.1f} ms ({n} req)" if n else "-"

    for key, label in (
        ("before", f"before ({STEADY_S:.0f} s)"),
        ("during", "during the rollout"),
        ("new", "  ... via new-revision routers"),
        ("after", f"after ({AFTER_S:.0f} s)"),
    ):
        print(f"{'':11}{label:<34}" + "".join(f"{cell(r[key]):<30}" for r in results))
    print(f"{'':11}{'rollout took':<34}" + "".join(f"{r['took']:.1f} s{'':<24}" for r in results))
    label = "new replicas' verdicts"
    print(f"{'':11}{label:<34}" + "".join(f"{', '.join(r['verdicts']):<30}" for r in results))
    print()


async def install_operator(demo: Demo) -> None:
    say("1. the operator, as a user installs it (the CRDs, then manifests/operator)")
    crds = ["crds/", "manifests/operator/crds/", "manifests/gateway/crds/"]
    shell("kubectl apply --server-side " + " ".join(f"-f {c}" for c in crds))
    demo.kube.run_kubectl("apply", "--server-side", *(a for c in crds for a in ("-f", str(F.ROOT / c))))
    established = (
        "crd/routerfleets.routerfleet.io",
        "crd/clusterkopfpeerings.kopf.dev",
        "crd/inferencepools.inference.networking.k8s.io",
    )
    demo.kube.run_kubectl("wait", "--for=condition=Established", *established)
    shell("kubectl apply --server-side -k manifests/operator")
    demo.kube.run_kubectl("apply", "--server-side", "-k", str(F.ROOT / "manifests" / "operator"))
    ops = await demo.ready_pods(OPERATOR_NS, OPERATOR_LABELS, 2, timeout=90)
    say(f"  {len(ops)} operator pods Ready in {OPERATOR_NS} (kopf peering: one active, one standing by)")


async def deploy_engines(demo: Demo) -> list:
    await asyncio.to_thread(demo.core.create_namespace, {"metadata": {"name": demo.ns}})
    await wait_until(
        f"default ServiceAccount in {demo.ns}",
        lambda: demo.core.read_namespaced_service_account("default", demo.ns),
        30,
    )
    if demo.vllm:
        return await deploy_vllm(demo)
    docs = F.load_manifests()
    engine = F.find(docs, "Deployment", F.ENGINE)
    pod = engine["spec"]["template"]["spec"]
    c = pod["containers"][0]
    c["args"] += [f"--replay-buffer={DEMO_REPLAY_BUFFER}", f"--storage-dir={STORAGE_DIR}"]
    c["args"].append("--disk-capacity-blocks=4096")
    c.setdefault("volumeMounts", []).append({"name": "kv-storage", "mountPath": STORAGE_DIR})
    pod.setdefault("volumes", []).append({"name": "kv-storage", "emptyDir": {}})
    await asyncio.to_thread(F.apply, demo.kube.api, demo.ns, [engine, F.find(docs, "Service", F.ENGINE)])
    say(f"2. engines: manifests/base's fake engines in {demo.ns} (2 engines x 2 DP ranks, a disk tier each)")
    engines = await demo.ready_pods(demo.ns, F.ENGINE_LABELS, 2)
    for p in engines:
        say(f"  engine {p.metadata.name} at {p.status.pod_ip}")
    return engines


async def deploy_vllm(demo: Demo) -> list:
    from e2e import vllm

    say(f"2. engines: 2 real vLLM engines in {demo.ns} (its CPU build, e2e/vllm's tiny Qwen3 model, block")
    say(f"   size {vllm.BLOCK_SIZE}); vLLM compiles the model as it starts: a minute or two on 2 cores ...")
    await asyncio.to_thread(F.apply, demo.kube.api, demo.ns, vllm.engine_manifests(vllm.install()))
    t = time.monotonic()
    engines = await demo.ready_pods(demo.ns, VLLM_PODS, 2, timeout=vllm.START_TIMEOUT_S)
    for p in engines:
        say(f"  engine {p.metadata.name} at {p.status.pod_ip} (Ready after {time.monotonic() - t:.0f}s)")
    return engines


def apply_fleet(demo: Demo) -> None:
    """manifests/samples/demo.yaml, applied as a user would; for vLLM with e2e/vllm's router and engines
    sections (``fleet_spec``: its block size, tokens from the engines, vLLM's chats), shown first."""
    if not demo.vllm:
        say("3. a RouterFleet: manifests/samples/demo.yaml (3 routers, peer bootstrap on)")
        shell(f"kubectl -n {demo.ns} apply -f manifests/samples/demo.yaml")
        demo.kube.run_kubectl("-n", demo.ns, "apply", "-f", str(SAMPLE))
        return
    import yaml

    from e2e import vllm

    fleet = yaml.safe_load(SAMPLE.read_text())
    fleet["spec"].update(vllm.fleet_spec(fleet["spec"]["router"]["image"]))
    text = yaml.safe_dump(fleet, sort_keys=False)
    say("3. a RouterFleet: manifests/samples/demo.yaml with vLLM's router and engines sections")
    say("   (3 routers, peer bootstrap on):")
    indent(text)
    shell(f"kubectl -n {demo.ns} apply -f demo-vllm.yaml")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        demo.kube.run_kubectl("-n", demo.ns, "apply", "-f", f.name)


async def show_pool(demo: Demo) -> None:
    """The InferencePool the operator rendered for the fleet (spec.gateway), and what GatewayReady says."""
    pool = await asyncio.to_thread(
        demo.kube.crd.get_namespaced_custom_object,
        "inference.networking.k8s.io",
        "v1",
        demo.ns,
        "inferencepools",
        FLEET,
    )
    spec = pool["spec"]
    ref = spec["endpointPickerRef"]
    ports = ", ".join(str(p["number"]) for p in spec["targetPorts"])
    engines = spec["selector"]["matchLabels"]
    say(f"  InferencePool {FLEET} (spec.gateway): engine pods {engines}, port {ports};")
    say(f"  its endpoint picker: Service {ref['name']}:{ref['port']['number']}, the routers' picker port")
    c = demo.condition(await asyncio.to_thread(demo.fleet), "GatewayReady")
    say(f"  GatewayReady={c.get('status')} {c.get('reason')}: no Gateway implementation in this cluster,")
    say(f"  so the standalone gateway serves: an Envoy beside each router, Service {FLEET}-gateway")


async def failed_seed(demo: Demo, traffic: T.Traffic) -> bool:
    """A block-size change the engines do not share: the new replica's seed fails, the rollout pauses
    saying why, the old replicas keep serving; the revert is Ready again at once."""
    block = demo.block
    say(f"5. a failed seed: the routers' block size changed to {2 * block} (the engines use {block})")
    obj = await asyncio.to_thread(demo.fleet)
    rev = obj["status"]["currentRevision"]
    demo.patch(json.dumps({"spec": {"router": {"blockSize": 2 * demo.block}}}))
    t = time.monotonic()

    def paused():
        o = demo.fleet()
        c = demo.condition(o, "Stalled")
        return o if c.get("status") == "True" and c.get("reason") == "ConfigMismatch" else None

    obj = await wait_until("the rollout to pause with ConfigMismatch", paused, 90)
    say(f"  paused after {time.monotonic() - t:.1f}s, the old replicas still serving:")
    demo.kubectl("-n", demo.ns, "get", f"rf/{FLEET}", output=True)
    c = demo.condition(obj, "Stalled")
    print(f"{'':11}condition Stalled=True, reason {c['reason']}:")
    indent(wrap(c["message"], "  ", "  "))
    events = demo.kubectl(
        "-n", demo.ns, "get", "events", "--field-selector", f"involvedObject.name={FLEET}",
        "--sort-by=.lastTimestamp", "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message",
    )  # fmt: skip
    lines = [ln for ln in events.rstrip().splitlines()[1:] if "Pause" in ln or "Mismatch" in ln]
    print(f"{'':11}the Event (type, reason, message):")
    for ln in lines[-1:]:
        indent(wrap(" ".join(ln.split()), "  ", "    "))
    serving = {p for p, _ip, r in traffic.ready if r == rev}
    say(f"  {len(serving)} routers of the old revision still Ready and routing; reverting the spec ...")
    t = time.monotonic()
    demo.patch(json.dumps({"spec": {"router": {"blockSize": demo.block}}}))

    def reverted():
        o = demo.fleet()
        ready = demo.condition(o, "Ready")
        fresh = ready.get("observedGeneration") == o["metadata"]["generation"]
        same = o["status"]["currentRevision"] == rev
        return o if ready.get("status") == "True" and fresh and same else None

    await wait_until("Ready again after the revert", reverted, 60)
    took = time.monotonic() - t
    say(f"  Ready again {took:.1f}s after the revert, on the same revision (nothing rebooted)")
    return True


async def cluster_demo(demo: Demo) -> int:
    import base64

    await install_operator(demo)
    engines = await deploy_engines(demo)
    apply_fleet(demo)
    demo.kubectl("-n", demo.ns, "wait", "--for=condition=Ready", f"rf/{FLEET}", "--timeout=150s")
    demo.kubectl("-n", demo.ns, "get", "rf", output=True)
    members_table(await asyncio.to_thread(demo.fleet))
    print(
        f"{'':11}(the first replicas boot together: nothing to inherit yet, so abandoned/no_peers/fleet_cold;"
        f"\n{'':11} each holds a readiness gate until its bootstrap settles)"
    )
    await show_pool(demo)
    sec = await asyncio.to_thread(demo.core.read_namespaced_secret, f"{FLEET}-internal-token", demo.ns)
    token = base64.b64decode(sec.data["token"]).decode()
    traffic = T.Traffic(demo.kube, demo.ns, FLEET, token, seed=7, port=GATEWAY_PORT)
    ok = True
    async with aiohttp.ClientSession(timeout=T.SESSION_TIMEOUT) as session:
        async with T.running(traffic, session):
            chats = f"{T.CONVERSATIONS} conversations, {T.WORKERS} in flight"
            through = f"through the Envoys (port {GATEWAY_PORT})"
            say(f"4. multi-turn chats ({chats}) for {STEADY_S:.0f} s, {through}")
            t = time.monotonic()
            await asyncio.sleep(STEADY_S)
            steady = [r for r in traffic.reqs if r.t >= t]
            h, n, p50 = T.hit(steady)
            p90 = 1000 * F.percentile([r.ttft for r in steady], 90)
            say(f"  {n} requests: hit rate {h:.1%}, TTFT p50 {p50:.1f} ms, p90 {p90:.1f} ms")
            # A flag that changes nothing the demo measures (a routing tunable would): only the rollout.
            # (A merge patch replaces a list: the fleet's own arguments go in again.)
            args = (await asyncio.to_thread(demo.fleet))["spec"]["router"].get("extraArgs", [])
            warm = {"router": {"extraArgs": [*args, "--first-byte-timeout-ms=120000"]}}
            on = await rollout(demo, traffic, {"spec": warm}, "bootstrap on")
            ok &= await failed_seed(demo, traffic)
            say("6. the same rollout with peer bootstrap disabled (the new routers start cold)")
            cold = {
                "bootstrap": {"enabled": False},
                "router": {"extraArgs": [*args, "--first-byte-timeout-ms=150000"]},
            }
            off = await rollout(demo, traffic, {"spec": cold}, "bootstrap off")
            rollout_table([on, off])
            seeded = (
                "rebuilt its index\nexactly from the engines' own replay (from_origin)"
                if on["verdicts"] == ["from_origin"]
                else "grafted\na warm sibling's index beneath its live stream"
            )
            indent(
                "bootstrap off: a new router indexes only what the engines store after it joins; a block"
                "\nchained under a prefix it never saw is skipped (see its index blocks), so the shared"
                f"\nprefixes look uncached to it and it scatters them. bootstrap on: each new router {seeded}"
                " before it went Ready.\n"
            )
            ok &= on["after"][0] > off["after"][0]
        if demo.vllm:
            say("7. (an engine's disk tier re-adopted after a kill: fake engines only; the vLLM CPU build")
            say("   here has none. tests/e2e/test_vllm.py kills and restarts a vLLM engine: no false hit)")
            return 0 if ok else 1
        say("7. an engine's container killed (SIGKILL, as an OOM kill would), its disk tier intact")
        routers = [f"http://{ip}:{F.ROUTER_PORT}" for _p, ip, _r in traffic.ready]
        ok &= await engine_restart(demo, session, routers, engines[0])
    return 0 if ok else 1


async def _routes(session, router: str, prompts: list[list[int]], fleet: list[str]) -> list[str | None]:
    """Where the router sends each prompt, side-effect free: the engine refuses ``n: 2`` after the
    router has chosen it (nothing is cached). First the ``fleet``'s shared load view must be idle: a
    sibling's probes just before would count as load."""
    await F.load_idle(session, fleet)
    out = []
    for tokens in prompts:
        status, chosen, _ = await F.completion(session, router, [*tokens, 7], max_tokens=1, n=2)
        out.append(chosen if status == 400 else None)
    return out


async def engine_restart(demo: Demo, session, routers: list[str], victim) -> bool:
    if not getattr(demo.provider, "reaches_pod_ips", False):
        say("  (needs the local provider: skipped)")
        return True
    name, eid = victim.metadata.name, F.engine_id(victim)
    url = F.pod_url(victim, F.ENGINE_PORT)
    rng = random.Random(3)
    prompts = [
        [rng.randrange(1000, 30000) for _ in range(DISK_PREFIX_BLOCKS * BLOCK)] for _ in range(DISK_PREFIXES)
    ]
    for i, tokens in enumerate(prompts):  # as an offloading connector (LMCache, HiCache) keeps them
        async with session.post(
            url + "/admin/store", json={"rank": i % 2, "token_ids": tokens, "medium": "STORAGE"}
        ) as r:
            r.raise_for_status()

    async def all_routed():
        where = [await _routes(session, r, prompts, routers) for r in routers]
        return where if all(w.count(eid) == len(prompts) for w in where) else None

    await wait_until("every replica to route the disk prefixes to their engine", all_routed, 30)
    status = (await asyncio.to_thread(demo.core.read_namespaced_pod, name, demo.ns)).status
    cs = status.container_statuses[0]
    say(f"{DISK_PREFIXES} prefixes on {name}'s disk tier; killing its container (SIGKILL) ...")
    t_kill = time.monotonic()
    os.kill(int(cs.container_id.removeprefix("process://")), signal.SIGKILL)

    def back():
        p = demo.core.read_namespaced_pod(name, demo.ns)
        c = (p.status.container_statuses or [None])[0]
        return p if T.pod_ready(p) and c is not None and c.restart_count > cs.restart_count else None

    await wait_until(f"{name} restarted in its pod and Ready", back, 90, interval=0.02)
    t_back = time.monotonic()
    say(f"  {name} Ready again {t_back - t_kill:.1f}s after the kill (same pod, a new process)")

    async def readopted(router: str):
        while True:
            _, index = await F.get(session, F.metrics_url(router) + "/debug/index")
            mine = [c for c in index["carriers"] if c["engine"] == eid]
            if mine and all(c.get("state", "ok") == "ok" for c in mine):
                return time.monotonic() - t_back, sum(c["tiers"]["disk"]["blocks"] for c in mine)
            await asyncio.sleep(0.005)

    adopted = await asyncio.wait_for(asyncio.gather(*(readopted(r) for r in routers)), 30)
    routed = [(await _routes(session, r, prompts, routers)).count(eid) for r in routers]
    hits = 0
    misses = []
    await F.load_idle(session, routers)  # the probes just above must not count as load any more
    for i, tokens in enumerate(prompts):
        status, chosen, body = await F.completion(session, routers[0], [*tokens, 7], max_tokens=1)
        cached = (body.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
        hit = status == 200 and chosen == eid and cached >= DISK_PREFIX_BLOCKS * BLOCK
        hits += hit
        if not hit:
            misses.append(f"prefix {i} (rank {i % 2}): HTTP {status}, to {chosen}, {cached} tokens cached")
    print()
    print(f"  {'replica':<10}{'disk tier shown again':>24}{'disk blocks':>13}{'prefixes routed back':>23}")
    for i, ((dt, blocks), n) in enumerate(zip(adopted, routed, strict=True)):
        print(f"  {i + 1:<10}{dt * 1000:>18.0f} ms after{blocks:>13}{n:>17}/{len(prompts)}")
    print(
        f"\n  then {hits}/{len(prompts)} completions through the first replica reused the whole prefix from"
        "\n  the engine's disk (its GPU tier died with the process and was dropped; the disk was re-adopted"
        "\n  because /server_info proved the same storage identity and epoch).\n"
    )
    for m in misses:
        print(f"  missed: {m}")
    return hits == len(prompts) and all(n == len(prompts) for n in routed)


def start_cluster(provider_name: str):
    """The provider, started; NoCluster when it cannot be."""
    from e2e.cluster import in_private_netns
    from e2e.provider import WORKDIR_ENV, LocalProvider

    if provider_name == "kind":
        have = {t: bool(shutil.which(t)) for t in ("docker", "kind")}
        raise NoCluster(
            "CLUSTER=kind is not available here: the demo talks to the routers at their pod IPs, which "
            "a kind cluster does not expose to the host "
            f"(docker on PATH: {have['docker']}, kind: {have['kind']})"
        )
    reused = bool(os.environ.get(WORKDIR_ENV)) and in_private_netns()
    if not reused and os.geteuid() != 0:
        raise NoCluster(
            "the local cluster needs root here (it runs in a private network namespace); as non-root try "
            "`python -m e2e.cluster run --node-agent node-1 -- python -m e2e.demo --cluster`"
        )
    for tool in ("unshare", "ip"):
        if not reused and shutil.which(tool) is None:
            raise NoCluster(f"'{tool}' is not on PATH")
    if reused:
        say("using the cluster `python -m e2e.cluster run` started")
    else:
        say("starting the local Kubernetes cluster (control plane + process node agent) ...")
        say("control plane binaries: e2e/kube/build.sh (a no-op once built; the first build takes ~7 min)")
    provider = LocalProvider(NODE)
    try:
        kubeconfig = provider.up()
    except (RuntimeError, OSError) as e:  # ProviderError, ClusterError, a failed build
        provider.down()
        raise NoCluster(f"{type(e).__name__}: {e}") from e
    return provider, kubeconfig


def run_cluster(provider_name: str, keep_ns: bool, engines: str) -> int:
    provider, kubeconfig = start_cluster(provider_name)
    ns = f"routerfleet-demo-{uuid.uuid4().hex[:5]}"
    demo = None
    try:
        say(f"cluster up ({provider.describe()})")
        demo = Demo(T.Kube(kubeconfig), provider, ns, engines)
        asyncio.run(node_ready(demo))
        return asyncio.run(cluster_demo(demo))
    except (DemoError, RuntimeError) as e:  # RuntimeError: a kubectl that failed
        print(f"\ndemo failed: {e}", flush=True)
        if demo is not None:
            demo.dump()
        return 1
    finally:
        # The cluster is the demo's own: stopping it removes everything (the namespaces, the
        # cluster-scoped CRDs and RBAC, every pod's process).
        say("tearing down (the cluster and everything in it) ...")
        if keep_ns:
            say(f"  (--keep-namespace: not deleting {ns} first)")
        provider.down()
        say("done")


def _sigterm(signum, frame):  # SIGTERM unwinds through the finally blocks, like Ctrl-C
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m e2e.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="no cluster: processes on loopback")
    mode.add_argument("--cluster", action="store_true", help="the cluster demo, without the local fallback")
    ap.add_argument(
        "--provider",
        default="local",
        choices=("local", "kind"),
        help="cluster provider (make demo CLUSTER=...; default local)",
    )
    ap.add_argument(
        "--engines",
        default="fake",
        choices=("fake", "vllm"),
        help="the cluster's engines: fake, or real vLLM (make demo ENGINES=vllm; the cluster only)",
    )
    ap.add_argument("--keep-namespace", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=15.0, help="local mode: workload duration (default 15)")
    ap.add_argument("--no-clear", action="store_true", help="local mode: append frames, do not redraw")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    clear = not a.no_clear and sys.stdout.isatty()
    if a.local and a.engines == "vllm":
        ap.error("argument --engines: vllm runs on the cluster only (the local demo drives fake engines)")
    if a.local:
        sys.exit(asyncio.run(local_main_async(a.seconds, clear)))
    if a.engines == "vllm":
        from e2e import vllm

        vllm.install()  # before the cluster's private network namespace: a first install downloads
    try:
        sys.exit(run_cluster(a.provider, a.keep_namespace, a.engines))
    except KeyboardInterrupt:
        print("\n[demo] interrupted; cleaned up", flush=True)
        sys.exit(130)
    except NoCluster as e:
        print(f"\n[demo] no cluster: {e}", flush=True)
        if a.cluster or a.engines == "vllm":
            sys.exit(2)
        print("[demo] running the local demo instead (python -m e2e.demo --local)\n", flush=True)
        sys.exit(asyncio.run(local_main_async(a.seconds, clear)))


if __name__ == "__main__":
    main()
