"""`make demo`: RouterFleet on a real (local) Kubernetes cluster, or without one.

Cluster mode (the default; root, because the cluster lives in a private network namespace):
builds the control plane on first use (e2e/kube, ~7 min on 2 cores, cached), starts it with the
process node agent, deploys manifests/base (two fake engines with 2 DP ranks each, a kv_aware
router) plus a round_robin router, and then

1. drives the same short multi-turn chat workload through the kv_aware router and, after clearing
   the engines' caches, through the round_robin router, and prints hit rate (from
   usage.prompt_tokens_details.cached_tokens) and TTFT side by side;
2. scales the kv_aware router 1 -> 3 while traffic keeps flowing and prints each replica's bootstrap
   verdict (from /internal/bootstrap) and whether its index equals the first replica's;
3. kills one engine's container (SIGKILL, as an OOM kill would): it restarts in its pod with its disk
   tier (an emptyDir) intact, and the demo prints how soon after its return the routers re-adopt that
   tier and send the prefixes kept there back to it, and how many hit (local provider only: it
   signals the container's process);
4. deletes everything and stops the cluster (also on Ctrl-C or a failure).

When no cluster can start (not root, no Go to build it, ...) it says why and runs the local demo.

Local mode (`--local`): two fake engines and one router as plain processes on loopback, under a
scripted workload (evictions, a lost batch filled by replay, an engine restart), with a live table of
what the router's index knows per engine, rank and tier next to what each engine really holds.
Exits non-zero if the two views disagree once the workload has settled.

    python -m e2e.demo               # cluster, else local
    python -m e2e.demo --cluster     # cluster or fail
    python -m e2e.demo --local
    python -m e2e.cluster run --node-agent node-1 -- python -m e2e.demo --cluster   # (see below)

The last form runs the demo on a cluster that `e2e.cluster run` started (its netns; as non-root it
makes a user namespace too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

from e2e import fleet as F
from router_runtime.kv.decode import normalize_hash
from router_runtime.kv.hashing import hash_set_digest

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
                "router_runtime.fake_engine.cli",
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


async def views(session: aiohttp.ClientSession, engines: list[Engine], router_url: str) -> list[tuple]:
    """Rows of (engine, rank, tier, engine blocks, engine digest, index blocks, index digest)."""
    async with session.get(router_url + "/debug/index") as r:
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


async def counters(session: aiohttp.ClientSession, router_url: str) -> str:
    async with session.get(router_url + "/metrics") as r:
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
        router_port = free_port_base(1)
        router_log = open(os.path.join(logdir, "router.log"), "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "router_runtime.cli",
                    "--port",
                    str(router_port),
                    "--block-size",
                    str(BLOCK),
                    *[a for e in engines for a in ("--worker", e.worker_flag())],
                ],
                stdout=router_log,
                stderr=subprocess.STDOUT,
            )
        )
        router_url = f"http://127.0.0.1:{router_port}"
        async with aiohttp.ClientSession() as session:
            for url in [e.url + "/health" for e in engines] + [router_url + "/healthz"]:
                await wait_http(session, url)
            await wait_http(session, router_url + "/readyz")
            # Subscriptions need a moment to reach the publishers (ZMQ drops what a PUB sends earlier).
            await asyncio.sleep(1.0)

            async def show(phase: str) -> None:
                rows = await views(session, engines, router_url)
                print(render(rows, phase, clear, await counters(session, router_url)), flush=True)

            await workload(session, engines, seconds, show)
            await asyncio.sleep(1.0)  # let the last batches land
            rows = await views(session, engines, router_url)
            print(render(rows, "settled", clear, await counters(session, router_url)))
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
CHATS, TURNS, CONCURRENCY = 40, 6, 8
SYSTEM_PROMPTS = 4
# Engines keep this many batches per rank for replay: a long-running engine's buffer no longer reaches
# sequence 0, so a new replica cannot rebuild from the engines (from_origin) and inherits a sibling's
# index instead, the path this demo shows. (The manifests keep the engine's default, 10000.)
DEMO_REPLAY_BUFFER = 64
# Step 3: the engines keep a disk tier in an emptyDir (it survives a container restart, not the pod),
# and this many conversation prefixes of DISK_PREFIX_BLOCKS blocks are put on the victim's.
STORAGE_DIR = "/var/lib/routerfleet-kv"
DISK_PREFIXES, DISK_PREFIX_BLOCKS = 40, 4
T0 = time.monotonic()


class DemoError(RuntimeError):
    pass


class NoCluster(RuntimeError):
    """The cluster could not start: fall back to the local demo."""


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


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


def _ready(p) -> bool:
    conds = {c.type: c.status for c in p.status.conditions or []}
    return (
        p.status.phase == "Running"
        and conds.get("Ready") == "True"
        and bool(p.status.pod_ip)
        and p.metadata.deletion_timestamp is None
    )


@dataclass
class Chat:
    system: str
    turns: list[str]
    messages: list[dict] = field(default_factory=list)


def make_chats(seed: int) -> list[Chat]:
    """CHATS conversations of TURNS user turns; each opens with one of SYSTEM_PROMPTS long system
    prompts (~800 tokens with the byte tokenizer), turns of ~300 tokens."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 9)))
        for _ in range(400)
    ]

    def text(n_chars: int) -> str:
        out: list[str] = []
        while sum(len(w) + 1 for w in out) < n_chars:
            out.append(rng.choice(words))
        return " ".join(out)

    systems = [f"You are assistant #{i}. " + text(800) for i in range(SYSTEM_PROMPTS)]
    return [Chat(rng.choice(systems), [text(300) for _ in range(TURNS)]) for _ in range(CHATS)]


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    prompt: int = 0
    cached: int = 0

    def add(self, ttft: float, prompt: int, cached: int) -> None:
        self.ttft.append(ttft)
        self.prompt += prompt
        self.cached += cached

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


async def run_chat(session, router: str, chat: Chat, stats: Stats) -> None:
    chat.messages = [{"role": "system", "content": chat.system}]
    for user in chat.turns:
        chat.messages.append({"role": "user", "content": user})
        ttft, answer, prompt, cached = await F.chat_turn(session, router, chat.messages)
        stats.add(ttft, prompt, cached)
        chat.messages.append({"role": "assistant", "content": answer})


async def chat_workload(session, router: str, seed: int) -> Stats:
    """Every chat of ``make_chats(seed)``, CONCURRENCY conversations at a time, turns in order."""
    stats = Stats()
    queue = list(make_chats(seed))

    async def worker():
        while queue:
            await run_chat(session, router, queue.pop(0), stats)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return stats


async def background(session, router: str, stop: asyncio.Event) -> int:
    """Chats through ``router`` until ``stop``; returns the number of requests."""
    stats = Stats()
    seed = 1000
    while not stop.is_set():
        chat = make_chats(seed)[0]
        seed += 1
        await run_chat(session, router, chat, stats)
    return len(stats.ttft)


class Fleet:
    """The demo's namespace on a cluster: kubernetes clients and the objects' pod views."""

    def __init__(self, kubeconfig, namespace: str, provider) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.ns = namespace
        self.provider = provider

    def pods(self, selector: str) -> list:
        return sorted(
            self.core.list_namespaced_pod(self.ns, label_selector=selector).items,
            key=lambda p: p.metadata.name,
        )

    async def ready_pods(self, selector: str, n: int, timeout: float = 90) -> list:
        def cond():
            pods = self.pods(selector)
            return pods if len(pods) == n and all(_ready(p) for p in pods) else None

        return await wait_until(f"{n} pods {selector} ready", cond, timeout)

    def dump(self) -> None:
        """Pod states and the tail of each container's log (after a failure)."""
        try:
            pods = self.core.list_namespaced_pod(self.ns).items
        except Exception as e:
            print(f"(cannot list pods: {e!r})")
            return
        for p in pods:
            conds = {c.type: c.status for c in p.status.conditions or []}
            print(
                f"--- pod {p.metadata.name}: {p.status.phase} ip={p.status.pod_ip} ready={conds.get('Ready')}"
            )
            for c in p.spec.containers:
                log = self.provider.container_log(self.ns, p.metadata.name, c.name) or ""
                for line in log.splitlines()[-12:]:
                    print(f"    {line[:200]}")


async def node_ready(fleet: Fleet) -> None:
    def cond():
        n = fleet.core.read_node(NODE)
        conds = {c.type: c.status for c in n.status.conditions or []}
        taints = [t for t in n.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
        return conds.get("Ready") == "True" and not taints

    await wait_until(f"node {NODE} Ready", cond, 90)


def print_table(rows: list[tuple]) -> None:
    print()
    print(f"  {'policy':<13}{'requests':>9}{'hit rate':>10}{'TTFT p50':>11}{'TTFT p90':>11}")
    for name, s in rows:
        print(
            f"  {name:<13}{len(s.ttft):>9}{s.hit_rate:>10.1%}"
            f"{F.percentile(s.ttft, 50) * 1000:>8.1f} ms{F.percentile(s.ttft, 90) * 1000:>8.1f} ms"
        )
    print()


async def cluster_demo(fleet: Fleet) -> int:
    ns = fleet.ns
    token = secrets.token_hex(16)
    docs = F.load_manifests(token=token)
    engine_args = F.find(docs, "Deployment", F.ENGINE)["spec"]["template"]["spec"]["containers"][0]["args"]
    engine_args.append(f"--replay-buffer={DEMO_REPLAY_BUFFER}")
    engine_args += [f"--storage-dir={STORAGE_DIR}", "--disk-capacity-blocks=4096"]
    engine_pod = F.find(docs, "Deployment", F.ENGINE)["spec"]["template"]["spec"]
    engine_pod["containers"][0].setdefault("volumeMounts", []).append(
        {"name": "kv-storage", "mountPath": STORAGE_DIR}
    )
    engine_pod.setdefault("volumes", []).append({"name": "kv-storage", "emptyDir": {}})
    rr = F.policy_variant(docs, "router-rr", "round_robin")
    await asyncio.to_thread(fleet.core.create_namespace, {"metadata": {"name": ns}})
    await wait_until(
        f"default ServiceAccount in {ns}",
        lambda: fleet.core.read_namespaced_service_account("default", ns),
        30,
    )
    await asyncio.to_thread(F.apply, fleet.api, ns, docs + rr)
    say(
        f"namespace {ns}: manifests/base (2 fake engines x 2 DP ranks, a kv_aware router)"
        " + a round_robin router"
    )

    engines = await fleet.ready_pods(F.ENGINE_LABELS, 2)
    (kv_pod,) = await fleet.ready_pods(F.ROUTER_LABELS, 1, timeout=120)
    (rr_pod,) = await fleet.ready_pods("app.kubernetes.io/name=router-rr", 1, timeout=120)
    for p in engines:
        say(f"  engine {p.metadata.name} at {p.status.pod_ip}")
    say(f"  router {kv_pod.metadata.name} (kv_aware) at {kv_pod.status.pod_ip}")
    say(f"  router {rr_pod.metadata.name} (round_robin) at {rr_pod.status.pod_ip}")
    kv_url, rr_url = F.pod_url(kv_pod, F.ROUTER_PORT), F.pod_url(rr_pod, F.ROUTER_PORT)
    engine_urls = [F.pod_url(p, F.ENGINE_PORT) for p in engines]

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # 1. kv_aware vs round_robin on the same engines, each from empty caches
        what = f"{CHATS} chats x {TURNS} turns, {CONCURRENCY} at a time"
        say(f"workload ({what}) via the kv_aware router ...")
        t = time.monotonic()
        kv = await chat_workload(session, kv_url, seed=1)
        say(f"  {len(kv.ttft)} requests in {time.monotonic() - t:.1f}s")
        for url in engine_urls:
            async with session.post(url + "/admin/clear", json={}) as r:
                r.raise_for_status()
        say("engines' caches cleared; the same workload via the round_robin router ...")
        t = time.monotonic()
        rr_stats = await chat_workload(session, rr_url, seed=1)
        say(f"  {len(rr_stats.ttft)} requests in {time.monotonic() - t:.1f}s")
        print_table([("kv_aware", kv), ("round_robin", rr_stats)])

        # 2. scale the kv_aware router 1 -> 3 under traffic
        say("scaling the kv_aware router 1 -> 3 (chats keep flowing through the first replica) ...")
        stop = asyncio.Event()
        traffic = asyncio.create_task(background(session, kv_url, stop))
        t = time.monotonic()
        try:
            await asyncio.to_thread(
                fleet.apps.patch_namespaced_deployment_scale, F.ROUTER, ns, {"spec": {"replicas": 3}}
            )
            pods = await fleet.ready_pods(F.ROUTER_LABELS, 3, timeout=120)
            say(f"  3 replicas ready {time.monotonic() - t:.1f}s after the scale-up")
        finally:
            stop.set()
            n_bg = await traffic
        say(f"  {n_bg} requests served by the first replica meanwhile")
        others = [p for p in pods if p.metadata.uid != kv_pod.metadata.uid]
        replicas = [(kv_pod, "first"), *((p, "new") for p in others)]
        urls = [F.pod_url(p, F.ROUTER_PORT) for p, _ in replicas]

        async def converged():
            views = [await F.index_view(session, u) for u in urls]
            return views if all(v == views[0] for v in views) else None

        try:
            views = await wait_until("the three indexes to agree", converged, 15)
        except DemoError:
            views = [await F.index_view(session, u) for u in urls]
        print()
        print(
            f"  {'replica':<36}{'verdict':<18}{'rank outcomes':<24}{'index blocks':>13}  same index as first"
        )
        for (p, role), view in zip(replicas, views, strict=True):
            rep = await F.bootstrap_report(session, F.pod_url(p, F.INTERNAL_PORT), token)
            outcomes: dict[str, int] = {}
            for k in rep["ranks"]:
                o = k["outcome"] or k["state"]  # no outcome yet: recovered (proving its graft) or pending
                outcomes[o] = outcomes.get(o, 0) + 1
            ranks = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())) or "-"
            same = "-" if role == "first" else ("yes" if view == views[0] else "NO")
            print(
                f"  {p.metadata.name + f' ({role})':<36}{rep['verdict']:<18}{ranks:<24}"
                f"{rep['index']['blocks']:>13}  {same}"
            )
        print(
            "\n  warm: a sibling's index grafted and joined by the live stream; recovered: grafted, waiting"
            "\n  for the rank's next live batch; abandoned: nothing to inherit (the first replica booted"
            "\n  alone); from_origin: rebuilt from the engine's own replay buffer.\n"
        )
        all_same = all(v == views[0] for v in views)

        # 3. an engine's container dies and restarts in its pod, its disk tier intact
        readopted = await engine_restart(fleet, session, urls, engines[0])
    return 0 if all_same and kv.hit_rate > rr_stats.hit_rate and readopted else 1


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


async def engine_restart(fleet: Fleet, session, routers: list[str], victim) -> bool:
    if not getattr(fleet.provider, "reaches_pod_ips", False):
        say("step 3 (an engine container killed) needs the local provider: skipped")
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
    status = (await asyncio.to_thread(fleet.core.read_namespaced_pod, name, fleet.ns)).status
    cs = status.container_statuses[0]
    say(f"{DISK_PREFIXES} prefixes on {name}'s disk tier; killing its container (SIGKILL) ...")
    t_kill = time.monotonic()
    os.kill(int(cs.container_id.removeprefix("process://")), signal.SIGKILL)

    def back():
        p = fleet.core.read_namespaced_pod(name, fleet.ns)
        c = (p.status.container_statuses or [None])[0]
        return p if _ready(p) and c is not None and c.restart_count > cs.restart_count else None

    await wait_until(f"{name} restarted in its pod and Ready", back, 90, interval=0.02)
    t_back = time.monotonic()
    say(f"  {name} Ready again {t_back - t_kill:.1f}s after the kill (same pod, a new process)")

    async def readopted(router: str):
        while True:
            _, index = await F.get(session, router + "/debug/index")
            mine = [c for c in index["carriers"] if c["engine"] == eid]
            if mine and all(c.get("state", "ok") == "ok" for c in mine):
                return time.monotonic() - t_back, sum(c["tiers"]["disk"]["blocks"] for c in mine)
            await asyncio.sleep(0.005)

    adopted = await asyncio.wait_for(asyncio.gather(*(readopted(r) for r in routers)), 30)
    routed = [(await _routes(session, r, prompts, routers)).count(eid) for r in routers]
    hits = 0
    for tokens in prompts:
        status, chosen, body = await F.completion(session, routers[0], [*tokens, 7], max_tokens=1)
        cached = (body.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
        hits += status == 200 and chosen == eid and cached >= DISK_PREFIX_BLOCKS * BLOCK
    print()
    print(f"  {'replica':<10}{'disk tier shown again':>24}{'disk blocks':>13}{'prefixes routed back':>23}")
    for i, ((dt, blocks), n) in enumerate(zip(adopted, routed, strict=True)):
        print(f"  {i + 1:<10}{dt * 1000:>18.0f} ms after{blocks:>13}{n:>17}/{len(prompts)}")
    print(
        f"\n  then {hits}/{len(prompts)} completions through the first replica reused the whole prefix from"
        "\n  the engine's disk (its GPU tier died with the process and was dropped; the disk was re-adopted"
        "\n  because /server_info proved the same storage identity and epoch).\n"
    )
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


def run_cluster(provider_name: str, keep_ns: bool) -> int:
    provider, kubeconfig = start_cluster(provider_name)
    ns = f"routerfleet-demo-{uuid.uuid4().hex[:5]}"
    rc = 1
    fleet = None
    try:
        say(f"cluster up ({provider.describe()})")
        fleet = Fleet(kubeconfig, ns, provider)
        asyncio.run(node_ready(fleet))
        rc = asyncio.run(cluster_demo(fleet))
        return rc
    except DemoError as e:
        print(f"\ndemo failed: {e}", flush=True)
        if fleet is not None:
            fleet.dump()
        return 1
    finally:
        say("tearing down (namespace, then the cluster) ...")
        if fleet is not None and not keep_ns:
            with contextlib.suppress(Exception):
                fleet.core.delete_namespace(ns)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and fleet.pods(""):
                    time.sleep(0.2)
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
    ap.add_argument("--keep-namespace", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=15.0, help="local mode: workload duration (default 15)")
    ap.add_argument("--no-clear", action="store_true", help="local mode: append frames, do not redraw")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    clear = not a.no_clear and sys.stdout.isatty()
    if a.local:
        sys.exit(asyncio.run(local_main_async(a.seconds, clear)))
    try:
        sys.exit(run_cluster(a.provider, a.keep_namespace))
    except KeyboardInterrupt:
        print("\n[demo] interrupted; cleaned up", flush=True)
        sys.exit(130)
    except NoCluster as e:
        print(f"\n[demo] no cluster: {e}", flush=True)
        if a.cluster:
            sys.exit(2)
        print("[demo] running the local demo instead (python -m e2e.demo --local)\n", flush=True)
        sys.exit(asyncio.run(local_main_async(a.seconds, clear)))


if __name__ == "__main__":
    main()
