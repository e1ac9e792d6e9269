"""RouterFleet's endpoint picker head to head with the Gateway API Inference Extension's reference
picker (``cmd/epp`` v1.3.0, the picker llm-d grew from, with its chart's default plugins: queue,
KV-cache-utilization and prefix-cache scorers), through the same gateway, on the same fake engines and
chat workload: hit rate, TTFT p50/p99 and requests per engine, in steady state and through a rolling
update of the pickers.

    .venv/bin/python -m e2e.cluster run --node-agent node-1 -- .venv/bin/python -m bench.pickers

Runs inside the local e2e cluster (``KUBECONFIG`` set by ``e2e.cluster run``, pod IPs reachable), one
picker at a time, each in a namespace of its own with fresh engines (3 fake engines, ``--engines``; one
rank each: the reference picker knows pods, not ranks; by default a cache that holds the whole run, so
misses come from routing only, ``--capacity-blocks`` for one that evicts):

- ours: the operator (a subprocess) and a 3-replica RouterFleet with ``spec.gateway`` (the pool's
  picker Service ``rf-epp``); a rolling update is a restart annotation (seed-gated);
- reference: its binary (``e2e/gateway/build-epp.sh``, cached) as a 1-replica Deployment, as its chart
  runs it, for an InferencePool over the same engines; a rolling update is a restart of its Deployment.

The gateway is one Envoy on loopback (this process's network namespace), with the configuration the
operator renders for its standalone gateway (``standalone.envoy_config``: ext_proc, an ORIGINAL_DST
cluster on the picker's header), whose picker cluster follows the picker Service's ready endpoints as
a Gateway's control plane would (EDS from a file this bench rewrites). The workload: ``WORKERS`` chats in
flight over ``CONVERSATIONS`` live multi-turn conversations sharing system prompts
(``e2e.fleet_traffic``), for ``--steady`` seconds, then a rolling update of the pickers, then ``--after``
seconds. Hit rate = cached over prompt tokens (``usage.prompt_tokens_details``). By default the
conversations move in step (each visited in turn), so a window's hit rate depends on their phase as well
as on the picker: with caches that evict, a window the late turns fill hits little under any picker, and
a working set larger than the caches thrashes every LRU; ``--order random`` visits them at random. The
rows "during" and "after" the rollout cover different spans per picker (its rollout's length);
``--window`` seconds from the rollout's start cover the same phase for each and are the row to compare.
Before the chats, the gateway's added latency over calling an engine directly (``--latency`` tiny
requests each way, one at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from kubernetes.client.exceptions import ApiException

from bench import routing_quality as RQ
from bench.rollout import Operator
from e2e import fleet as F
from e2e.fleet_traffic import (
    GROUP,
    ORDERS,
    PLURAL,
    VERSION,
    WORKERS,
    Kube,
    Req,
    Traffic,
    fleet_ready,
    hit,
    pod_ready,
)
from e2e.gateway import ENVOY
from routerfleet_operator.model import ANNOTATION_RESTARTED_AT, EPP_PORT
from routerfleet_operator.spec import Fleet
from routerfleet_operator.standalone import envoy_config

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "routerfleet:e2e"
ENGINES = 3
REPLICAS = 3
POOL_CRDS = ROOT / "manifests" / "gateway" / "crds"
ENGINE_ARGS = {
    "--dp-size": "1",  # the reference picker knows pods, not ranks
    "--prefill-us-per-token": "100",
}
# Blocks per engine: 40000 holds a whole run (misses come from routing only); a smaller cache evicts,
# which a picker learns only from the engines' KV events (ours) or not at all (an approximate index).
CAPACITY_BLOCKS = 40000
# The quality workload's engines, as bench.routing_quality runs them (RQ.Params; the rest as above).
QUALITY = RQ.Params()
QUALITY_ENGINE_ARGS = {
    "--prefill-us-per-token": str(QUALITY.prefill_us_per_token),
    "--decode-tokens-per-s": str(QUALITY.decode_tokens_per_s),
    "--max-concurrency": str(QUALITY.engine_slots),
}
# Its schedule: conversations enough to outlast a run (about 4 turns each; running out is an error).
QUALITY_CONVERSATIONS = 6000
# The added latency: tiny requests each way, in alternating blocks (bench.overhead's method).
LATENCY_REQUESTS = 1000
LATENCY_BLOCK = 100
# The reference chart's default plugins (config/charts/inferencepool, epp-config.yaml).
REFERENCE_CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
"""


def say(msg: str) -> None:
    print(f"[bench.pickers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def reference_binary() -> str:
    done = subprocess.run(
        ["bash", str(ROOT / "e2e" / "gateway" / "build-epp.sh")],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return str(Path(done.stdout.strip().splitlines()[-1]) / "epp")


# ------------------------------------------------------------------------------------------ the gateway


class Gateway:
    """One Envoy with the standalone gateway's configuration, its picker cluster fed by EDS from a file
    that ``follow`` keeps equal to the ready endpoints of the picker Service."""

    def __init__(self, workdir: Path, listen: int):
        self.dir = workdir / "eds"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.eds = self.dir / "picker.json"
        self.listen = listen
        self.written: list[str] | None = None
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "envoy.log"

    def config(self) -> dict:
        spec = {
            "router": {"image": IMAGE},
            "engines": {"serviceName": F.ENGINE, "kvPort": "kv"},
            "gateway": {"enabled": True, "standalone": {"enabled": True}},
        }
        config = envoy_config(Fleet.parse({"metadata": {"name": "bench"}, "spec": spec}))
        config["admin"]["address"]["socket_address"]["port_value"] = 0
        config["node"] = {"id": "bench-gateway", "cluster": "bench"}  # xDS (the file's EDS) asks for both
        listener = config["static_resources"]["listeners"][0]
        listener["address"]["socket_address"].update(address="127.0.0.1", port_value=self.listen)
        picker = config["static_resources"]["clusters"][1]
        del picker["load_assignment"]
        picker["type"] = "EDS"
        source = {"path_config_source": {"path": str(self.eds), "watched_directory": {"path": str(self.dir)}}}
        picker["eds_cluster_config"] = {"eds_config": {**source, "resource_api_version": "V3"}}
        return config

    def write(self, endpoints: list[str]) -> None:
        if endpoints == self.written:
            return
        lb = [
            {"endpoint": {"address": {"socket_address": {"address": ip, "port_value": EPP_PORT}}}}
            for ip in endpoints
        ]
        doc = {
            "version_info": str(time.monotonic_ns()),
            "resources": [
                {
                    "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                    "cluster_name": "picker",
                    "endpoints": [{"lb_endpoints": lb}],
                }
            ],
        }
        tmp = self.dir / ".picker.json.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.eds)  # Envoy reloads on the move
        self.written = endpoints

    def start(self) -> None:
        self.write([])
        path = self.dir.parent / "envoy.json"
        path.write_text(json.dumps(self.config()))
        argv = [str(ENVOY), "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "-l", "warning"]
        self.proc = subprocess.Popen(argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    async def follow(self, kube: Kube, ns: str, service: str, stop: asyncio.Event) -> None:
        """The picker Service's ready endpoints, as a Gateway's control plane reads them."""
        while not stop.is_set():
            try:
                slices = await asyncio.to_thread(
                    kube.disc.list_namespaced_endpoint_slice,
                    ns,
                    label_selector=f"kubernetes.io/service-name={service}",
                )
                ips = sorted(
                    a
                    for s in slices.items
                    for e in s.endpoints or []
                    if e.conditions and e.conditions.ready
                    for a in e.addresses
                )
                self.write(ips)
            except (ApiException, OSError) as e:
                say(f"follow {service}: {e!r:.200}")
            await asyncio.sleep(0.25)


class Through(Traffic):
    """The chat workload, every request to the gateway (one address), not round-robin over pods."""

    def __init__(self, kube: Kube, ns: str, listen: int, seed: int, order: str):
        super().__init__(kube, ns, "none", "", seed, port=listen, order=order)
        self.model = "m"  # the reference picker refuses a body without one

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        self.ready = [("gateway", "127.0.0.1", "")]

    async def start(self, session: aiohttp.ClientSession) -> list[asyncio.Task]:
        await self.refresh(session)
        return [asyncio.create_task(self.worker(session)) for _ in range(WORKERS)]


ANSWER_ERRORS = (ValueError, LookupError, TypeError)  # a stream chunk or usage not as the engines send it


class Replay:
    """``bench.routing_quality``'s workload through the gateway: its schedule (conversations in
    system-prompt groups, each turn sent once the previous one is answered, ``concurrency`` in flight),
    each turn a streamed completion. The schedule is built to outlast the run; running out raises
    (a window would cover less than it says)."""

    def __init__(self, listen: int, seed: int):
        self.url = f"http://127.0.0.1:{listen}/v1/completions"
        self.params = dataclasses.replace(QUALITY, convs=QUALITY_CONVERSATIONS, seed=seed)
        self.schedule = RQ.build_workload(self.params)
        self.reqs: list[Req] = []
        self.errors = 0
        self.last_error = ""
        self.stop = asyncio.Event()

    async def start(self, session: aiohttp.ClientSession) -> list[asyncio.Task]:
        return [asyncio.create_task(self._dispatch(session))]

    async def _dispatch(self, session: aiohttp.ClientSession) -> None:
        done = [asyncio.Event() for _ in self.schedule]
        slots = asyncio.Semaphore(self.params.concurrency)
        sent: set[asyncio.Task] = set()
        for pos, turn in enumerate(self.schedule):
            if turn.prev >= 0:
                await done[turn.prev].wait()
            await slots.acquire()
            if self.stop.is_set():
                break
            task = asyncio.create_task(self._one(session, turn, done[pos], slots))
            sent.add(task)
            task.add_done_callback(sent.discard)
        else:
            raise RuntimeError(f"the schedule ({len(self.schedule)} turns) ran out before the run ended")
        await asyncio.gather(*sent)

    async def _one(
        self, session: aiohttp.ClientSession, turn: RQ.Turn, done: asyncio.Event, slots: asyncio.Semaphore
    ) -> None:
        body = {
            "model": "m",
            "prompt": turn.prompt,
            "max_tokens": self.params.reply_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.monotonic()
        try:
            async with session.post(self.url, json=body) as r:
                if r.status != 200:
                    raise AssertionError(f"{r.status} {(await r.text())[:300]}")
                answer = await F.read_chat_stream(r)
            if answer.error is not None or not answer.usage:
                raise AssertionError(f"an error in the stream, or no usage: {answer.error}")
            usage = answer.usage
            prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
            now = time.monotonic()
            self.reqs.append(Req(now, "gateway", "", prompt, cached, (answer.first_content or now) - t0, t0))
        except (TimeoutError, aiohttp.ClientError, OSError, AssertionError, *ANSWER_ERRORS) as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"[:500]
        finally:
            slots.release()
            done.set()

    async def monitor(self, session: aiohttp.ClientSession) -> None:
        await self.refresh(session)


# ------------------------------------------------------------------------------------------ the pickers


def deploy_engines(kube: Kube, ns: str, engines: int, capacity_blocks: int, workload: str) -> None:
    docs = F.load_manifests(image=IMAGE)
    engine = F.find(docs, "Deployment", F.ENGINE)
    engine["spec"]["replicas"] = engines
    c = engine["spec"]["template"]["spec"]["containers"][0]
    given = {**ENGINE_ARGS, **(QUALITY_ENGINE_ARGS if workload == "quality" else {})}
    given["--capacity-blocks"] = str(capacity_blocks)
    args = [a for a in c["args"] if a.split("=", 1)[0] not in given]
    c["args"] = args + [f"{k}={v}" for k, v in given.items()]
    F.apply(kube.api, ns, [engine, F.find(docs, "Service", F.ENGINE)])


def ours(ns: str, replicas: int = REPLICAS, extra_args: tuple[str, ...] = ()) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RouterFleet",
        "metadata": {"name": "rf", "namespace": ns},
        "spec": {
            "replicas": replicas,
            "router": {"image": IMAGE, "extraArgs": list(extra_args)},
            "engines": {"serviceName": F.ENGINE, "kvPort": "kv", "replayPort": "replay", "dpSize": 1},
            "bootstrap": {"timeout": "30s"},
            "gateway": {"enabled": True},
        },
    }


def reference(ns: str, binary: str, selector: dict[str, str]) -> list[dict]:
    """The reference picker as its chart runs it (one replica, a Service, the RBAC it reads with) and
    the InferencePool it picks for."""
    name, labels = "ref-epp", {"app": "ref-epp"}
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
        {
            "apiGroups": ["inference.networking.x-k8s.io"],
            "resources": ["inferenceobjectives", "inferencemodelrewrites", "inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    args = [
        "--pool-name", "ref", "--pool-namespace", ns, "--grpc-port", str(EPP_PORT), "--grpc-health-port",
        "9003", "--metrics-port", "9090", "--metrics-endpoint-auth=false", "--config-text", REFERENCE_CONFIG,
    ]  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": name},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": name,
                        "containers": [
                            {
                                "name": "epp",
                                "image": "registry.k8s.io/gateway-api-inference-extension/epp:v1.3.0",
                                "command": [binary, *args],
                                "ports": [{"name": "grpc", "containerPort": EPP_PORT}],
                                "readinessProbe": {"tcpSocket": {"port": EPP_PORT}, "periodSeconds": 2},
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name},
            "spec": {"selector": labels, "ports": [{"name": "grpc", "port": EPP_PORT, "targetPort": "grpc"}]},
        },
        {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "ref"},
            "spec": {
                "selector": {"matchLabels": selector},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": name, "port": {"number": EPP_PORT}},
            },
        },
    ]


def apply_all(kube: Kube, ns: str, docs: list[dict]) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        f.flush()
        kube.run_kubectl("-n", ns, "apply", "--server-side", "-f", f.name)


@dataclass
class Row:
    picker: str
    steady: tuple[float, int, float]
    ttft_p99: float
    during: tuple[float, int, float]
    after: tuple[float, int, float]
    window: tuple[float, int, float]  # the --window seconds from the rollout's start
    rollout_s: float
    errors: int
    per_engine: list[int]
    added: tuple[float, float]  # added latency p50, p99 in us (nan: --latency 0)


def p99(reqs) -> float:
    return 1000 * F.percentile([r.ttft for r in reqs], 99)


async def added_latency(session: aiohttp.ClientSession, kube: Kube, ns: str, listen: int, n: int):
    """The gateway's added latency over calling an engine directly, one tiny request at a time (the
    bench.overhead method): ``n`` requests each way, in alternating blocks of ``LATENCY_BLOCK`` so that
    drift hits both alike; direct calls cycle over the engines the picker chooses among. Returns the
    p50 and p99 of the gateway's minus the direct calls', in us."""
    body = {"model": "m", "prompt": "what is the added latency of this gateway", "max_tokens": 1}
    engines = [F.pod_url(p, 8000) + "/v1/completions" for p in kube.pods(ns, F.ENGINE_LABELS)]
    gateway = f"http://127.0.0.1:{listen}/v1/completions"

    async def one(url: str) -> float:
        t = time.perf_counter()
        async with session.post(url, json=body) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}: {r.status}")
        return time.perf_counter() - t

    for url in [*engines, gateway] * 10:  # connections open, the prompt's full blocks cached everywhere
        await one(url)
    direct: list[float] = []
    through: list[float] = []
    for i in range(0, n, LATENCY_BLOCK):
        for _ in range(min(LATENCY_BLOCK, n - i)):
            direct.append(await one(engines[len(direct) % len(engines)]))
        for _ in range(min(LATENCY_BLOCK, n - i)):
            through.append(await one(gateway))
    return tuple(1e6 * (F.percentile(through, q) - F.percentile(direct, q)) for q in (50, 99))


async def engine_requests(session: aiohttp.ClientSession, kube: Kube, ns: str) -> dict[str, int]:
    """Requests each engine has served so far, by pod."""
    out = {}
    for p in kube.pods(ns, F.ENGINE_LABELS):
        async with session.get(F.pod_url(p, 8000) + "/metrics") as r:
            page = F.parse_metrics(await r.text())
        total = sum(v for k, v in page.items() if k.startswith("routerfleet_fake_engine_requests_total"))
        out[p.metadata.name] = int(total)
    return out


async def run_picker(kube: Kube, name: str, args, workdir: Path, listen: int) -> Row:
    ns = f"pickers-{name}-{workdir.name}"  # a namespace per run: the last one may still be going
    kube.core.create_namespace({"metadata": {"name": ns}})
    kube.wait(
        f"default ServiceAccount in {ns}",
        lambda: kube.core.read_namespaced_service_account("default", ns),
        30,
    )
    workdir.mkdir(parents=True, exist_ok=True)
    op = Operator(kube, ns, workdir / f"operator-{name}.log") if name == "ours" else None
    gateway = Gateway(workdir / name, listen)
    try:
        deploy_engines(kube, ns, args.engines, args.capacity_blocks, args.workload)
        kube.wait(
            f"{args.engines} engines Ready",
            lambda: len([p for p in kube.pods(ns, F.ENGINE_LABELS) if pod_ready(p)]) == args.engines,
            90,
        )
        if op is not None:
            op.start()
            fleet = ours(ns, args.replicas, tuple(args.router_args.split()))
            kube.crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet)
            kube.wait("the fleet Ready", lambda: fleet_ready(kube.fleet(ns, "rf")), 180, 0.5)
            service = "rf-epp"
        else:
            selector = kube.core.read_namespaced_service(F.ENGINE, ns).spec.selector
            apply_all(kube, ns, reference(ns, args.binary, selector))
            kube.wait(
                "the reference picker Ready",
                lambda: any(pod_ready(p) for p in kube.pods(ns, "app=ref-epp")),
                120,
            )
            service = "ref-epp"
        gateway.start()
        if args.workload == "quality":
            traffic: Through | Replay = Replay(listen, seed=args.seed)
        else:
            traffic = Through(kube, ns, listen, seed=args.seed, order=args.order)
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            follow = asyncio.create_task(gateway.follow(kube, ns, service, stop))
            await wait_for_gateway(session, listen, gateway)
            added = (math.nan, math.nan)
            if args.latency:
                say(f"[{name}] added latency: {args.latency} tiny requests each way, one at a time ...")
                added = await added_latency(session, kube, ns, listen, args.latency)
            before = await engine_requests(session, kube, ns)  # the chats' own count starts here
            workers = await traffic.start(session)
            say(f"[{name}] {args.steady:.0f} s of {args.workload} through the gateway ...")
            t0 = time.monotonic()
            await asyncio.sleep(args.steady)
            trigger = time.monotonic()
            stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            if op is not None:
                patch = {"metadata": {"annotations": {ANNOTATION_RESTARTED_AT: stamp}}}
                await asyncio.to_thread(
                    kube.crd.patch_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, "rf", patch
                )
                old = kube.fleet(ns, "rf")["status"]["currentRevision"]

                def rolled() -> bool:
                    obj = kube.fleet(ns, "rf")
                    return fleet_ready(obj) and obj["status"]["currentRevision"] != old
            else:
                await asyncio.to_thread(
                    kube.run_kubectl, "-n", ns, "rollout", "restart", "deployment/ref-epp"
                )
                await asyncio.sleep(1)

                def rolled() -> bool:
                    pods = kube.pods(ns, "app=ref-epp")
                    return len(pods) == 1 and pod_ready(pods[0])

            say(f"[{name}] rolling update of the pickers under traffic ...")
            deadline = time.monotonic() + 240
            while not await asyncio.to_thread(rolled):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: the pickers' rolling update did not complete within 240 s")
                await asyncio.sleep(0.5)
            done = time.monotonic()
            more = max(args.after, trigger + args.window - done)
            say(f"[{name}] rolled in {done - trigger:.1f} s; {more:.0f} s more ...")
            await asyncio.sleep(more)
            traffic.stop.set()
            stop.set()
            for ended in await asyncio.gather(*workers, follow, return_exceptions=True):
                if isinstance(ended, RuntimeError):  # the workload ran out: its windows would be short
                    raise ended
            after = await engine_requests(session, kube, ns)
            per_engine = sorted((n - before.get(pod, 0) for pod, n in after.items()), reverse=True)
        if traffic.errors:
            say(f"[{name}] {traffic.errors} failed requests; the last: {traffic.last_error}")
        reqs = traffic.reqs
        steady = [r for r in reqs if t0 <= r.t < trigger]
        return Row(
            picker=name,
            steady=hit(steady),
            ttft_p99=p99(steady),
            during=hit([r for r in reqs if trigger <= r.t < done]),
            after=hit([r for r in reqs if r.t >= done]),
            window=hit([r for r in reqs if trigger <= r.t < trigger + args.window]),
            rollout_s=done - trigger,
            errors=traffic.errors,
            per_engine=per_engine,
            added=added,
        )
    finally:
        gateway.stop()
        if op is not None:
            op.stop()
        with contextlib.suppress(ApiException):
            kube.core.delete_namespace(ns)


async def wait_for_gateway(session: aiohttp.ClientSession, listen: int, gateway: Gateway) -> None:
    """Until a request goes through (Envoy up, the picker's endpoints fed, the picker answering)."""
    deadline = time.monotonic() + 60
    body = {"model": "m", "prompt": "warm up the gateway path", "max_tokens": 1}
    last = "no answer"
    while True:
        if gateway.proc is not None and gateway.proc.poll() is not None:
            raise RuntimeError(f"envoy exited: {gateway.log.read_text()[-1500:]}")
        try:
            async with session.post(f"http://127.0.0.1:{listen}/v1/completions", json=body) as r:
                if r.status == 200:
                    return
                last = f"{r.status} {(await r.text())[:300]}"
        except (aiohttp.ClientError, OSError) as e:
            last = repr(e)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"no request went through the gateway within 60 s (last: {last}; see {gateway.log})"
            )
        await asyncio.sleep(0.5)


def report(runs: dict[str, list[Row]]) -> None:
    """Per picker, the median of its runs (min-max when there are several)."""

    def med(rows: list[Row], f, fmt: str, unit: str = "") -> str:
        values = sorted(f(r) for r in rows)
        mid = statistics.median(values)
        spread = f" ({fmt.format(values[0])}-{fmt.format(values[-1])})" if len(values) > 1 else ""
        return f"{fmt.format(mid)}{unit}{spread}"

    print()
    print(f"medians of {max(len(v) for v in runs.values())} run(s), (min-max)")
    print(f"{'':2}{'':30}" + "".join(f"{name:<34}" for name in runs))
    lines = [
        ("steady: hit rate", lambda rs: med(rs, lambda r: 100 * r.steady[0], "{:.1f}", "%")),
        ("steady: TTFT p50", lambda rs: med(rs, lambda r: r.steady[2], "{:.1f}", " ms")),
        ("steady: TTFT p99", lambda rs: med(rs, lambda r: r.ttft_p99, "{:.1f}", " ms")),
        ("steady: requests", lambda rs: med(rs, lambda r: r.steady[1], "{:.0f}")),
        ("pickers' rollout: hit rate", lambda rs: med(rs, lambda r: 100 * r.during[0], "{:.1f}", "%")),
        ("after it: hit rate", lambda rs: med(rs, lambda r: 100 * r.after[0], "{:.1f}", "%")),
        ("from its start, --window s", lambda rs: med(rs, lambda r: 100 * r.window[0], "{:.1f}", "%")),
        ("rollout took", lambda rs: med(rs, lambda r: r.rollout_s, "{:.1f}", " s")),
        ("failed requests", lambda rs: med(rs, lambda r: r.errors, "{:.0f}")),
        ("added latency p50", lambda rs: med(rs, lambda r: r.added[0], "{:+,.0f}", " us")),
        ("added latency p99", lambda rs: med(rs, lambda r: r.added[1], "{:+,.0f}", " us")),
        ("requests per engine (run 1)", lambda rs: " / ".join(map(str, rs[0].per_engine))),
    ]
    measured = any(not math.isnan(r.added[0]) for rows in runs.values() for r in rows)
    for label, f in lines:
        if label.startswith("added latency") and not measured:  # --latency 0
            continue
        print(f"{'':2}{label:<30}" + "".join(f"{f(rows):<34}" for rows in runs.values()))
    print()


async def main_async(args) -> int:
    kube = Kube()
    kube.run_kubectl("apply", "--server-side", "-f", str(ROOT / "crds"), "-f", str(POOL_CRDS))
    for crd in ("routerfleets.routerfleet.io", "inferencepools.inference.networking.k8s.io"):
        kube.run_kubectl("wait", "--for=condition=Established", f"crd/{crd}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-pickers-"))
    say(f"logs in {workdir}")
    runs: dict[str, list[Row]] = {name: [] for name in args.pickers}
    for i in range(args.runs):  # the pickers in turn, run after run: drift in the machine hits both
        for name in args.pickers:
            say(f"run {i + 1} of {args.runs}: {name}")
            runs[name].append(await run_picker(kube, name, args, workdir / f"run{i + 1}", args.port))
    report(runs)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--pickers", default="ours,reference", help="which, in order (default ours,reference)")
    ap.add_argument("--steady", type=float, default=45.0, help="seconds of traffic before the rollout (45)")
    ap.add_argument("--after", type=float, default=20.0, help="seconds of traffic after it (20)")
    ap.add_argument(
        "--window",
        type=float,
        default=30.0,
        help="seconds from the rollout's start measured alike for every picker (30): the workload's\n"
        "phase is then the same for each, whatever its rollout takes",
    )
    ap.add_argument("--seed", type=int, default=5, help="the workload's seed (5)")
    ap.add_argument(
        "--workload",
        choices=("chats", "quality"),
        default="chats",
        help="chats: e2e.fleet_traffic's live chats; quality: bench.routing_quality's schedule\n"
        f"(its engines: {QUALITY.engines}, {QUALITY.capacity_blocks} blocks each; "
        f"{QUALITY.concurrency} in flight)",
    )
    ap.add_argument(
        "--order",
        choices=ORDERS,
        default="cyclic",
        help="the chats' order (cyclic: in step, each in turn; random: the next idle one at random)",
    )
    ap.add_argument("--port", type=int, default=18088, help="the gateway's loopback port (18088)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each picker, medians reported (3)")
    ap.add_argument(
        "--capacity-blocks",
        type=int,
        help=f"each engine's cache, in blocks (chats: {CAPACITY_BLOCKS}, no eviction; smaller evicts;\n"
        f"quality: {QUALITY.capacity_blocks})",
    )
    ap.add_argument(
        "--latency",
        type=int,
        default=LATENCY_REQUESTS,
        help=f"tiny requests each way (gateway, direct) for the added latency, one at a time, before the\n"
        f"chats ({LATENCY_REQUESTS}; 0: skip)",
    )
    ap.add_argument(
        "--engines",
        type=int,
        help=f"fake engines (chats: {ENGINES}, quality: {QUALITY.engines}; 1: the workload's ceiling, every\n"
        "prompt on one cache)",
    )
    ap.add_argument(
        "--replicas", type=int, default=REPLICAS, help=f"our fleet's replicas ({REPLICAS}, as deployed)"
    )
    ap.add_argument(
        "--router-args",
        default="",
        help="more flags for our routers (spec.router.extraArgs), space-separated",
    )
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error("argument --replicas: expected at least 1")
    quality = args.workload == "quality"
    if args.engines is None:
        args.engines = QUALITY.engines if quality else ENGINES
    if args.capacity_blocks is None:
        args.capacity_blocks = QUALITY.capacity_blocks if quality else CAPACITY_BLOCKS
    if args.engines < 1:
        ap.error("argument --engines: expected at least 1")
    args.pickers = [p.strip() for p in args.pickers.split(",") if p.strip()]
    if args.runs < 1:
        ap.error("argument --runs: expected at least 1")
    if args.latency < 0:
        ap.error("argument --latency: expected at least 0")
    if args.capacity_blocks < 1:
        ap.error("argument --capacity-blocks: expected at least 1")
    bad = [p for p in args.pickers if p not in ("ours", "reference")]
    if bad:
        ap.error(f"argument --pickers: unknown picker {bad[0]!r} (ours, reference)")
    if "KUBECONFIG" not in os.environ:
        ap.error("needs the local cluster: run under `python -m e2e.cluster run --node-agent node-1 -- ...`")
    if "reference" in args.pickers:
        say("the reference picker: e2e/gateway/build-epp.sh (cached; about 2 minutes the first time)")
        args.binary = reference_binary()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
