"""Chat traffic over a RouterFleet's router pods, and the watch of its rolling updates: shared by the
operator demo (e2e/demo.py) and bench/rollout.py.

Everything here talks HTTP at pod IPs and to the API server through ``Kube`` (the local cluster's pods
are reachable from the process that runs it). Every response's ``usage.prompt_tokens_details
.cached_tokens`` is recorded with its time, router pod and revision, so a hit rate can be read for any
window (``hit``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from e2e import fleet as F

GROUP, VERSION, PLURAL = "routerfleet.io", "v1alpha1", "routerfleets"
SEEDED = "routerfleet.io/seeded"

CONVERSATIONS = 48  # live conversations, each visited in turn
WORKERS = 4  # requests in flight
SESSION_TIMEOUT = aiohttp.ClientTimeout(total=60)  # a chat turn, whatever the fleet is doing
PAUSE_S = 0.1  # between a worker's requests
TURNS = 10  # a conversation restarts (fresh text) after this many user turns
SYSTEM_PROMPTS = 4
# The order conversations are visited in: each in turn (they move in step: a window's prompts are all of
# one phase, and a working set larger than the caches thrashes every LRU), or the next one at random.
ORDERS = ("cyclic", "random")


class Kube:
    """The API clients and kubectl of one cluster (``kubeconfig``, else ``$KUBECONFIG``)."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        self.kubeconfig = str(kubeconfig or os.environ["KUBECONFIG"])
        cfg = client.Configuration()
        config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.disc = client.DiscoveryV1Api(self.api)
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

    def run_kubectl(self, *args: str) -> str:
        """kubectl's output; RuntimeError with its message when it fails."""
        p = subprocess.run(
            [self.kubectl, "--kubeconfig", self.kubeconfig, *args],
            capture_output=True,
            text=True,
            timeout=90,
        )
        if p.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

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

    def fleet(self, ns: str, name: str) -> dict:
        return self.crd.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)


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
    """Seeded chat text: SYSTEM_PROMPTS shared system prompts, conversations of TURNS user turns."""

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


class Traffic:
    """Chats round-robin over a fleet's Ready router pods at ``port`` (what its Service would do),
    CONVERSATIONS live, WORKERS requests in flight; and, once ``trigger`` is set, a watch of the replicas
    of the new revision: when each was seen, settled (with its verdict), seeded and Ready."""

    def __init__(
        self,
        kube: Kube,
        ns: str,
        fleet: str,
        token: str,
        seed: int,
        port: int = F.ROUTER_PORT,
        via: str | None = None,
        order: str = "cyclic",
    ):
        self.kube, self.ns, self.fleet, self.token = kube, ns, fleet, token
        self.port = port  # the routers' own proxy, or the standalone gateway's Envoy beside each
        self.via = via  # a Gateway's base URL: every request through it (else to the pods in turn)
        self.sel = f"routerfleet.io/fleet={fleet}"
        self.ready: list[tuple[str, str, str]] = []  # (pod, ip, revision) of Ready router pods
        self.reqs: list[Req] = []
        self.errors = 0
        self.last_error = ""  # the latest failed request's error, for a report
        self.error_at: list[float] = []  # when each failed (monotonic), for a report against the trigger
        self.error_texts: collections.Counter[str] = collections.Counter()  # each error's text, counted
        self.model: str | None = None  # the body's model, when the path needs one
        self.stop = asyncio.Event()
        self.texts = Texts(seed)
        if order not in ORDERS:
            raise ValueError(f"conversation order {order!r}: expected one of {', '.join(ORDERS)}")
        self.order = order
        self.pick = random.Random(seed + 1)  # the random order's own: the texts stay those of the seed
        self.idle = collections.deque(self.texts.conv() for _ in range(CONVERSATIONS))
        self.rr = 0
        self.old_rev: str | None = None
        self.old_pods: list[str] = []  # the Ready pods when the restart was asked for (a test's record)
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
                    obj = await asyncio.to_thread(self.kube.fleet, self.ns, self.fleet)
                    st = obj.get("status") or {}
                    if fleet_ready(obj) and st.get("currentRevision") != self.old_rev:
                        self.done = time.monotonic()
            except (ApiException, OSError) as e:
                print(f"[traffic] monitor: {e!r:.200}", flush=True)
            await asyncio.sleep(0.25)

    async def worker(self, session: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            if not self.ready:
                await asyncio.sleep(0.2)
                continue
            conv = self.take()
            try:
                if conv.i >= TURNS:
                    conv = self.texts.conv()
                conv.messages.append({"role": "user", "content": conv.turns[conv.i]})
                for _attempt in range(3):  # a router going away: the next Ready one, as a Service would
                    pod, ip, rev = self.ready[self.rr % len(self.ready)]
                    self.rr += 1
                    if self.via is not None:  # the Gateway's picker chose; the pod is not known here
                        pod, rev = "gateway", ""
                    try:
                        ttft, answer, prompt, cached = await F.chat_turn(
                            session, self.via or f"http://{ip}:{self.port}", conv.messages, model=self.model
                        )
                    except (TimeoutError, aiohttp.ClientError, AssertionError, OSError) as e:
                        self.errors += 1
                        self.error_at.append(time.monotonic())
                        self.last_error = f"{type(e).__name__}: {e}"[:500]
                        if len(self.error_texts) < 100:
                            self.error_texts[self.last_error] += 1
                        await asyncio.sleep(0.1)
                        continue
                    self.reqs.append(Req(time.monotonic(), pod, rev, prompt, cached, ttft, conv.born))
                    conv.messages.append({"role": "assistant", "content": answer})
                    conv.i += 1
                    break
                else:
                    conv.messages.pop()
            finally:
                self.idle.append(conv)
            await asyncio.sleep(PAUSE_S)

    def take(self) -> Conv:
        """The next idle conversation (there are more than workers): the one idle longest, so the
        conversations move in step (``cyclic``), or any idle one (``random``), each at its own pace."""
        if self.order == "random":
            self.idle.rotate(-self.pick.randrange(len(self.idle)))
        return self.idle.popleft()


def hit(reqs: list[Req]) -> tuple[float, int, float]:
    """(hit rate, requests, TTFT p50 ms)."""
    p = sum(r.prompt for r in reqs)
    c = sum(r.cached for r in reqs)
    return (c / p if p else float("nan"), len(reqs), 1000 * F.percentile([r.ttft for r in reqs], 50))


@contextlib.asynccontextmanager
async def running(traffic: Traffic, session: aiohttp.ClientSession) -> AsyncIterator[None]:
    """``traffic``'s monitor and WORKERS workers, on ``session``, run during the block; stopped and
    awaited after it."""
    await traffic.refresh(session)
    tasks = [asyncio.create_task(traffic.monitor(session))]
    tasks += [asyncio.create_task(traffic.worker(session)) for _ in range(WORKERS)]
    try:
        yield
    finally:
        traffic.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
