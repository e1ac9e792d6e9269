"""`python -m e2e.soak`: a seeded chaos soak of an operator-managed fleet on the local cluster.

The operator (manifests/operator) runs a 3-replica RouterFleet over 4 fake engines (2 DP ranks each,
two speaking vLLM's wire dialect and two SGLang's, a disk tier each), or with ``--engines vllm`` over 2
real vLLM engines (its CPU build serving e2e/vllm's tiny model, one rank each, as pods). Multi-turn
chats flow the whole time, round-robin over the Ready router pods as the fleet's Service would send
them, every request asking for the router's prediction (``X-RouterFleet-Debug-Prediction``) and for
usage. Meanwhile a seeded schedule injects faults, one at a time, each followed by a wait for the fleet
to converge:

    engine_pod_deleted   an engine pod deleted (its Deployment makes a new one, new IP, cold cache)
    engine_killed        an engine's process SIGKILLed; it restarts in its pod, disk tier intact
    router_pod_deleted   a router pod deleted (a new one boots and seeds from a sibling)
    rollout              a spec change (extraArgs) rolled out mid-traffic
    operator_killed      a rollout started, then every operator pod deleted at once
    kv_stream_dropped    an engine's KV event traffic dropped (iptables, in the engine pod's netns), then
                         restored: a stall, then gaps the routers fill by replay (on vLLM, whose
                         held batches TCP delivers late: the routers must see the stall, then its end)
    replay_unanswered    the same, with the engine's replay socket dropped too: the gap cannot be
                         filled, so the rank must go cold, visibly
    apiserver_restart    the API server stopped and started again
    readiness_flap       an engine's /health fails long enough for its EndpointSlice to say not ready
                         (fake engines only, as is replay_unanswered: each needs an engine-side switch)
    peer_killed_seeding  a router pod deleted, and a sibling's process SIGKILLed as the replacement
                         boots and seeds (at this tree size a transfer takes milliseconds, so the kill
                         lands before, during or after it: the verdict is printed)

Converged means: the RouterFleet Ready for its generation on one revision, 3 router pods and every
engine pod Ready, and every router's index holding each engine rank as live (`/debug/index`). A fault that
does not converge within ``--converge-timeout`` is a deadlock: the soak records it and stops. The
timeline gives each fault's own time (a drop held, the API server stopped and started), then how long
the fleet took to converge after it, and what it waited for meanwhile.

At the end it prints a timeline and the figures, and exits non-zero unless:

- no false-hit tokens outside doubtful predictions (the router's own label: a rank in hold, a graft
  being proved, an engine being re-adopted, a gap being replayed, a stream silent while its engine
  stores blocks); inside them, reported. A false hit on an engine whose KV stream went silent less
  than the router's stall threshold (+1 s) before is reported apart: the router cannot know yet;
- no request lost: every request got a complete response or an OpenAI-style error naming its cause;
  a response cut mid-stream counts as lost unless a fault killed or deleted the engine it was on, or
  SIGKILLed the router process it was on (a router pod deleted is asked to stop, and must drain). A
  connection refused by a router pod that just went away (or a connect that times out: its network
  went with it) is retried on the next Ready one (a client's retry; counted per phase), and lost only
  if no pod accepts it;
- every fault converged;
- router memory and open files flat (reported; a replica whose RSS grew by more than 50% over its
  life, past its first minute, fails the run).

    python -m e2e.soak                          # 20 minutes, seed 1
    python -m e2e.soak --minutes 3 --seed 7     # a short one
    python -m e2e.soak --faults rollout,engine_killed --minutes 5
    python -m e2e.soak --engines vllm --minutes 10      # real vLLM (installs it first: make vllm)

It needs root (the cluster lives in a private network namespace) and the local provider (it signals
processes and sets iptables rules in an engine pod's namespace). The short soak of ``make test`` is
tests/e2e/test_soak.py, on the test run's cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from kubernetes.client.exceptions import ApiException

from e2e import fleet as F
from e2e import fleet_traffic as T
from e2e.dump import dump_namespace
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.headers import (
    DEBUG_PREDICTION_HEADER,
    DOUBTFUL_HEADER,
    ENGINE_HEADER,
    PREDICTED_HEADER,
)

FLEET = "soak"
ROUTER_PODS = f"routerfleet.io/fleet={FLEET}"  # the fleet's router pods, every revision
OPERATOR_NS = "routerfleet-system"  # manifests/operator's namespace
OPERATOR_LABELS = "app.kubernetes.io/name=routerfleet-operator"
DIALECTS = ("vllm-0.33", "sglang")  # fake engines: one Deployment of two engines each, behind one Service
ROUTERS = 3
DEBUG_ARG = "--debug-prediction"  # the routers answer the prediction header to the fleet token
STORAGE_DIR = "/var/lib/routerfleet-kv"
KV_PORT, REPLAY_PORT = 5557, 5657
FAULTS = (
    "engine_pod_deleted",
    "engine_killed",
    "router_pod_deleted",
    "rollout",
    "operator_killed",
    "kv_stream_dropped",
    "replay_unanswered",
    "apiserver_restart",
    "readiness_flap",
    "peer_killed_seeding",
)
ENGINE_FAULTS = {"engine_pod_deleted", "engine_killed"}


@dataclass(frozen=True)
class Engines:
    """What the fleet runs over."""

    kind: str  # --engines
    count: int  # engine pods
    dp: int  # ranks per engine
    selector: str  # their pods' labels
    converge_s: float  # a fault's default convergence bound (a vLLM pod takes minutes to start)
    not_here: dict[str, str]  # fault classes that do not apply, and why


FAKE = Engines("fake", 4, 2, F.ENGINE_LABELS, 150.0, {})
VLLM = Engines(
    "vllm", 2, 1, "app.kubernetes.io/name=vllm", 480.0,
    {
        "replay_unanswered": "a certain gap needs a sequence number skipped, which only the fake engine does",
        "readiness_flap": "vLLM has no switch that fails its /health alone",
    },
)  # fmt: skip
ENGINE_KINDS = {e.kind: e for e in (FAKE, VLLM)}
WORKERS = 4
AFTER_S = 10.0  # a fault's window extends this long past its convergence ("after" figures)
# A silent stream is known to the router (its predictions doubtful) once the engine has owed it a batch
# for its stall threshold (--kv-stall-ms); a false hit before that, on that engine, it cannot know of.
UNKNOWABLE_S = KvConfig().stall_s + 1.0
# Router counters that show what a fault did to the KV plane.
EVIDENCE = (
    "routerfleet_kv_gaps",
    "routerfleet_kv_replays",
    "routerfleet_kv_ranks_cleared",
)
STALLED = "routerfleet_kv_stalled_ranks"  # engine ranks owing a batch past the stall threshold


def say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ the records


@dataclass
class Outcome:
    """One request, as the client saw it."""

    t0: float
    t1: float
    router: str
    kind: str  # ok | error (an OpenAI-style error body) | cut (the stream ended early) | refused
    status: int = 0
    cause: str = ""
    engine: str = ""
    prompt: int = 0
    cached: int = 0
    predicted: int | None = None
    doubtful: bool = False
    audited: bool = False  # the engine's usage came back: its cached tokens can be held to the prediction

    @property
    def false_hit(self) -> int:
        return max(0, (self.predicted or 0) - self.cached) if self.kind == "ok" and self.audited else 0

    @property
    def missed_hit(self) -> int:
        return max(0, self.cached - (self.predicted or 0)) if self.kind == "ok" and self.audited else 0


@dataclass
class Fault:
    kind: str
    target: str
    t0: float
    injected: float = 0.0  # when the fault's own action ended (a drop restored, a flap over)
    converged: float | None = None
    note: str = ""
    effect: str = ""  # what the routers' counters show it did (gaps, replays, cleared ranks)
    # Engines (their router-side ids) and router pods whose process this fault killed: a stream cut on
    # one of them is the fault's own doing (nothing can answer from a SIGKILLed process).
    killed: set[str] = field(default_factory=set)
    problem: str = ""  # the fault did not have the effect it must have
    waits: list[tuple[float, str]] = field(default_factory=list)  # (since, what convergence waited for)
    silent: tuple[str, float] | None = None  # (engine, since): its KV stream dropped from then

    def recovery(self) -> str:
        """What convergence waited for, and from when to when (seconds after the injection)."""
        spans = []
        for (t, why), nxt in zip(self.waits, [*self.waits[1:], (self.converged, "")], strict=True):
            end = f"{nxt[0] - self.injected:.1f}" if nxt[0] is not None else "..."
            spans.append(f"{why} {t - self.injected:.1f}-{end}s")
        return "; ".join(spans)

    def window(self, end: float) -> tuple[float, float]:
        return self.t0, (self.converged if self.converged is not None else end) + AFTER_S


@dataclass
class Sample:
    t: float
    rss_kib: int
    fds: int


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    samples: dict[str, list[Sample]] = field(default_factory=dict)  # router pod -> samples
    start: float = field(default_factory=time.monotonic)


# ------------------------------------------------------------------------------------------ the cluster


class Soak:
    def __init__(
        self, kube: T.Kube, cluster, ns: str, seed: int, converge_timeout: float, engines: Engines = FAKE
    ) -> None:
        self.kube, self.cluster, self.ns, self.engines = kube, cluster, ns, engines
        self.core = kube.core
        self.rng = random.Random(seed)
        self.converge_timeout = converge_timeout
        self.run = Run()
        self.ready: list[tuple[str, str]] = []  # (pod, ip) of Ready router pods
        self.rr = 0
        self.texts = T.Texts(seed)
        self.convs: asyncio.Queue[T.Conv] = asyncio.Queue()
        for _ in range(T.CONVERSATIONS):
            self.convs.put_nowait(self.texts.conv())
        self.stop = asyncio.Event()
        self.token = ""
        self.router_args: list[str] = []  # the fleet's extraArgs; a rollout adds one that changes nothing
        self.rollouts = 0
        self.seeding: list[str] = []  # replicas booted under peer_killed_seeding (their verdicts reported)

    # ---- setup ---------------------------------------------------------------------------------

    def install_operator(self) -> None:
        root = F.ROOT
        self.kube.run_kubectl(
            "apply", "--server-side", "-f", str(root / "crds"), "-f", str(root / "manifests/operator/crds")
        )
        self.kube.run_kubectl(
            "wait", "--for=condition=Established", "crd/routerfleets.routerfleet.io",
            "crd/clusterkopfpeerings.kopf.dev",
        )  # fmt: skip
        self.kube.run_kubectl("apply", "--server-side", "-k", str(root / "manifests/operator"))
        self.kube.wait(
            "the operator pods Ready", lambda: self._ready_count(OPERATOR_NS, OPERATOR_LABELS) == 2, 120
        )

    def uninstall_operator(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.kube.run_kubectl("delete", "--wait=false", "-k", str(F.ROOT / "manifests/operator"))

    def deploy(self) -> None:
        self.core.create_namespace({"metadata": {"name": self.ns}})
        self.kube.wait(
            f"default ServiceAccount in {self.ns}",
            lambda: self.core.read_namespaced_service_account("default", self.ns),
            30,
        )
        spec = self.deploy_vllm() if self.engines is VLLM else self.deploy_fake()
        args = spec["router"].get("extraArgs", [])
        self.router_args = [*args, DEBUG_ARG, *{F.ENGINE_HEADER_ARG} - set(args)]
        # The soak checks every prediction (its requests present the fleet token for it) against the
        # engine that served it.
        spec["router"]["extraArgs"] = self.router_args
        fleet = {
            "apiVersion": f"{T.GROUP}/{T.VERSION}",
            "kind": "RouterFleet",
            "metadata": {"name": FLEET},
            "spec": {"replicas": ROUTERS, **spec, "bootstrap": {"timeout": "30s"}},
        }
        self.kube.crd.create_namespaced_custom_object(T.GROUP, T.VERSION, self.ns, T.PLURAL, fleet)
        self.kube.run_kubectl("-n", self.ns, "wait", "--for=condition=Ready", f"rf/{FLEET}", "--timeout=180s")
        sec = self.core.read_namespaced_secret(f"{FLEET}-internal-token", self.ns)
        self.token = base64.b64decode(sec.data["token"]).decode()

    def deploy_vllm(self) -> dict:
        """e2e/vllm's engines as pods, Ready (a cold start compiles the model: minutes); the fleet's
        router and engines sections."""
        from e2e import vllm

        F.apply(self.kube.api, self.ns, vllm.engine_manifests(vllm.install(), self.engines.count))
        self.kube.wait(
            f"{self.engines.count} vLLM pods Ready",
            lambda: self._ready_count(self.ns, self.engines.selector) == self.engines.count,
            vllm.START_TIMEOUT_S,
        )
        return vllm.fleet_spec("routerfleet:dev")

    def deploy_fake(self) -> dict:
        """manifests/base's fake engine, two Deployments (one per dialect) behind its Service; the
        fleet's router and engines sections."""
        docs = F.load_manifests()
        base = F.find(docs, "Deployment", F.ENGINE)
        objs = []
        for dialect in DIALECTS:
            d = json.loads(json.dumps(base))
            name = F.ENGINE if dialect == DIALECTS[0] else f"{F.ENGINE}-{dialect.split('-')[0]}"
            d["metadata"]["name"] = name
            labels = {"app.kubernetes.io/name": F.ENGINE, "routerfleet.io/soak-engine": name}
            d["spec"]["selector"] = {"matchLabels": labels}
            d["spec"]["template"]["metadata"]["labels"] = {
                **labels,
                "app.kubernetes.io/part-of": "routerfleet",
            }
            d["spec"]["replicas"] = self.engines.count // len(DIALECTS)
            pod = d["spec"]["template"]["spec"]
            c = pod["containers"][0]
            c["args"] = [a for a in c["args"] if not a.startswith("--dialect=")]
            c["args"] += [
                f"--dialect={dialect}", f"--storage-dir={STORAGE_DIR}", "--disk-capacity-blocks=4096",
                "--replay-buffer=64",
            ]  # fmt: skip
            c.setdefault("volumeMounts", []).append({"name": "kv-storage", "mountPath": STORAGE_DIR})
            pod.setdefault("volumes", []).append({"name": "kv-storage", "emptyDir": {}})
            objs.append(d)
        objs.append(F.find(docs, "Service", F.ENGINE))
        F.apply(self.kube.api, self.ns, objs)
        return {
            "router": {"image": "routerfleet:dev"},
            "engines": {
                "serviceName": F.ENGINE, "kvPort": "kv", "replayPort": "replay", "dpSize": self.engines.dp,
            },
        }  # fmt: skip

    def _ready_count(self, ns: str, selector: str) -> int:
        return sum(
            1 for p in self.kube.pods(ns, selector) if T.pod_ready(p) and not p.metadata.deletion_timestamp
        )

    def engine_pods(self) -> list:
        return live(self.kube.pods(self.ns, self.engines.selector))

    def router_pods(self) -> list:
        """The fleet's router pods that are not terminating. A rollout's old pods drain for seconds
        after the fleet is Ready again: deleting one of them replaces nothing, killing one cuts nothing."""
        return live(self.kube.pods(self.ns, ROUTER_PODS))

    # ---- traffic -------------------------------------------------------------------------------

    async def refresh(self) -> None:
        while not self.stop.is_set():
            try:
                pods = await asyncio.to_thread(self.kube.pods, self.ns, ROUTER_PODS)
                self.ready = [
                    (p.metadata.name, p.status.pod_ip)
                    for p in pods
                    if T.pod_ready(p) and not p.metadata.deletion_timestamp
                ]
            except Exception:  # urllib3's errors too: the API server may be the fault. Keep the last
                pass  # view, as kube-proxy would, and try again
            await asyncio.sleep(0.25)

    async def worker(self, session: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            if not self.ready:
                await asyncio.sleep(0.1)
                continue
            conv = await self.convs.get()
            try:
                if conv.i >= T.TURNS:
                    conv = self.texts.conv()
                conv.messages.append({"role": "user", "content": conv.turns[conv.i]})
                refused: set[str] = set()
                for attempt in range(5):  # a refused connection: another Ready pod, as a client would
                    # A killed pod stays listed Ready until its probe fails: never try it twice (other
                    # workers move the shared round robin, so it alone could land there every time).
                    pods = [p for p in self.ready if p[0] not in refused] or self.ready
                    pod, ip = pods[self.rr % len(pods)]
                    self.rr += 1
                    out, answer = await self.request(session, pod, ip, conv.messages)
                    self.run.outcomes.append(out)
                    if out.kind != "refused":
                        break
                    refused.add(pod)
                    await asyncio.sleep(0.05 * (attempt + 1))
                else:
                    out.kind, out.cause = "lost", "no Ready router pod accepted the connection"
                if out.kind == "ok":
                    conv.messages.append({"role": "assistant", "content": answer})
                    conv.i += 1
                else:
                    conv.messages.pop()
            finally:
                self.convs.put_nowait(conv)
            await asyncio.sleep(T.PAUSE_S)

    async def request(self, session, pod: str, ip: str, messages: list[dict]) -> tuple[Outcome, str]:
        out = Outcome(time.monotonic(), 0.0, pod, "cut")
        text = ""
        try:
            async with session.post(
                f"http://{ip}:{F.ROUTER_PORT}/v1/chat/completions",
                json=F.chat_body(messages),
                headers={DEBUG_PREDICTION_HEADER: self.token},
            ) as r:
                out.status = r.status
                out.engine = r.headers.get(ENGINE_HEADER, "")
                if PREDICTED_HEADER in r.headers:
                    out.predicted = int(r.headers[PREDICTED_HEADER])
                    out.doubtful = r.headers.get(DOUBTFUL_HEADER) == "true"
                if r.status != 200:
                    raw = await r.read()
                    try:
                        err = json.loads(raw)["error"]
                        out.kind, out.cause = "error", f"{r.status} {err.get('code') or err.get('type')}"
                    except (ValueError, KeyError, TypeError):
                        out.kind, out.cause = "cut", f"{r.status} not an OpenAI error: {raw[:80]!r}"
                    return out, ""
                chat = await F.read_chat_stream(r)
                if chat.error is not None:  # after its 200: an OpenAI-style error all the same
                    err = chat.error
                    out.kind, out.cause = "error", f"in the stream: {err.get('code') or err.get('type')}"
                elif chat.done:
                    out.kind, out.prompt, out.cached = "ok", chat.prompt_tokens, chat.cached_tokens
                    out.audited = bool(chat.usage)
                else:
                    out.cause = "stream ended before [DONE]"
                text = chat.text
        except aiohttp.ClientConnectorError as e:
            out.kind, out.cause = "refused", f"{ip}: {e.os_error!r:.60}"
        except aiohttp.ConnectionTimeoutError:  # a pod gone with its network: nothing was sent either
            out.kind, out.cause = "refused", f"{ip}: connect timed out"
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            out.cause = type(e).__name__
        out.t1 = time.monotonic()
        return out, text

    async def sampler(self) -> None:
        """Router pods' RSS and open files, every 5 s (the node agent's processes: /proc)."""
        while not self.stop.is_set():
            with contextlib.suppress(Exception):  # the API server may be down: next time
                pods = await asyncio.to_thread(self.kube.pods, self.ns, ROUTER_PODS)
                for p in pods:
                    pid = container_pid(p)
                    if pid is None:
                        continue
                    with contextlib.suppress(OSError, ValueError):
                        status = open(f"/proc/{pid}/status").read()  # noqa: SIM115
                        rss = int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1])
                        fds = len(os.listdir(f"/proc/{pid}/fd"))
                        self.run.samples.setdefault(p.metadata.name, []).append(
                            Sample(time.monotonic(), rss, fds)
                        )
            await asyncio.sleep(5)

    # ---- convergence ---------------------------------------------------------------------------

    async def converged(self, session) -> str | None:
        """None when the fleet has converged, else what it still waits for."""
        try:
            obj = await asyncio.to_thread(self.kube.fleet, self.ns, FLEET)
            routers = await asyncio.to_thread(self.router_pods)
            engines = await asyncio.to_thread(self.engine_pods)
        except Exception as e:  # urllib3's errors are not OSErrors
            return f"the API server ({type(e).__name__})"
        if not T.fleet_ready(obj):
            return "the RouterFleet Ready on one revision"
        if len(routers) != ROUTERS or not all(T.pod_ready(p) for p in routers):
            return f"{ROUTERS} router pods Ready"
        n = self.engines.count
        if len(engines) != n or not all(T.pod_ready(p) for p in engines):
            return f"{n} engine pods Ready"
        want = {(F.engine_id(p), r) for p in engines for r in range(self.engines.dp)}
        for p in routers:
            try:
                _, index = await F.get(session, f"http://{p.status.pod_ip}:{F.METRICS_PORT}/debug/index")
            except (aiohttp.ClientError, TimeoutError, OSError):
                return f"{p.metadata.name}'s /debug/index"
            live = {(s["engine"], s["rank"]) for s in index.get("subscriptions", []) if s.get("connected")}
            states = {(c["engine"], c["rank"]): c.get("state", "ok") for c in index.get("carriers", [])}
            missing = [k for k in want if k not in live or states.get(k, "ok") != "ok"]
            if missing:
                return f"{p.metadata.name} to hold {len(missing)} engine rank(s) live"
        return None

    async def wait_converged(self, session, fault: Fault) -> bool:
        deadline = time.monotonic() + self.converge_timeout
        why = None
        while time.monotonic() < deadline:
            why = await self.converged(session)
            if why is None:
                fault.converged = time.monotonic()
                return True
            if not fault.waits or fault.waits[-1][1] != why:
                fault.waits.append((time.monotonic(), why))
            await asyncio.sleep(0.5)
        fault.note += f" NOT CONVERGED after {self.converge_timeout:.0f}s: waiting for {why}"
        return False

    async def counters(self, session) -> Counter:
        """The KV plane's fault counters summed over the Ready routers (a replaced router's are lost)."""
        total: Counter = Counter()
        for _pod, ip in list(self.ready):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                for k, v in (await F.metrics(session, f"http://{ip}:{F.METRICS_PORT}")).items():
                    if k.startswith(EVIDENCE) and "_created" not in k:
                        total[k.removeprefix("routerfleet_kv_").removesuffix("_total")] += v
        return total

    # ---- faults --------------------------------------------------------------------------------

    async def inject(self, kind: str, session) -> Fault:
        engines = await asyncio.to_thread(self.engine_pods)
        victim = self.rng.choice(engines)
        fault = Fault(kind, victim.metadata.name, time.monotonic())
        if kind in ENGINE_FAULTS:
            fault.killed.add(F.engine_id(victim))
        if kind == "engine_pod_deleted":
            await asyncio.to_thread(self.core.delete_namespaced_pod, victim.metadata.name, self.ns)
        elif kind == "engine_killed":
            pid, restarts = container_pid(victim), restart_count(victim)
            if pid is None:
                fault.note = "no process"
            else:
                os.kill(pid, signal.SIGKILL)
                # Its own time runs until the container is back (then the fleet converges on it): else
                # the fleet would look converged before anyone noticed the kill.
                name = victim.metadata.name

                def restarted():
                    return restart_count(self.core.read_namespaced_pod(name, self.ns)) > restarts

                await asyncio.to_thread(self.kube.wait, f"{name} restarted", restarted, 60, 0.1)
                fault.note = f"its container restarted {time.monotonic() - fault.t0:.1f}s after the kill"
        elif kind == "router_pod_deleted":
            pod = self.rng.choice(await asyncio.to_thread(self.router_pods))
            fault.target = pod.metadata.name
            await asyncio.to_thread(self.core.delete_namespaced_pod, pod.metadata.name, self.ns)
        elif kind in ("rollout", "operator_killed"):
            fault.target = f"rf/{FLEET}"
            await asyncio.to_thread(self.start_rollout)
            if kind == "operator_killed":
                await asyncio.sleep(self.rng.uniform(1.0, 6.0))  # the rollout under way
                ops = await asyncio.to_thread(self.kube.pods, OPERATOR_NS, OPERATOR_LABELS)
                for p in ops:
                    await asyncio.to_thread(
                        self.core.delete_namespaced_pod, p.metadata.name, OPERATOR_NS, grace_period_seconds=0
                    )
                fault.note = f"{len(ops)} operator pods deleted"
        elif kind in ("kv_stream_dropped", "replay_unanswered"):
            ip, pid = victim.status.pod_ip, container_pid(victim)
            if pid is None:
                raise RuntimeError(f"{victim.metadata.name} has no process to cut off")
            pub = [KV_PORT + r for r in range(self.engines.dp)]
            replay = [REPLAY_PORT + r for r in range(self.engines.dp)] if kind == "replay_unanswered" else []
            hold = self.rng.uniform(4.0, 10.0)
            engine = f"http://{ip}:{F.ENGINE_PORT}"
            # Every router must be following rank 0 (a cursor) first: a router that has heard nothing
            # from a rank yet cannot tell a lost first batch from one sent before it subscribed.
            await self.store(session, engine)
            await self.wait_following(session, victim)
            base = await self.counters(session)
            stalled = 0
            with blocked(pid, replay):
                with blocked(pid, pub):
                    fault.silent = (F.engine_id(victim), time.monotonic())
                    # Requests go on meanwhile: the engine stores blocks nobody hears of yet.
                    if self.engines is VLLM:
                        stalled = await self.max_stalled(session, hold)
                    else:  # a seq only replay carries makes the gap certain (TCP alone would catch up)
                        await asyncio.sleep(hold)
                        await self.admin(session, engine, "skip_seq", {"rank": 0, "n": 1})
                fault.note = f"{ip}'s PUB dropped for {hold:.1f}s" + (", its replay too" if replay else "")
                if self.engines is VLLM:
                    await self.check_stall(session, fault, stalled)
                else:
                    # The next batch shows the gap, once TCP's backed-off retransmission gets it
                    # through: replay fills it, or (its socket silent) the rank goes cold at the
                    # replay deadline.
                    await self.store(session, engine)
                    outcome = 'replays_total{outcome="timeout"}' if kind == "replay_unanswered" else "gaps"
                    seen = await self.wait_counter(session, outcome, base[outcome] + len(self.ready), 60)
                    if seen is None:
                        fault.problem = f"the routers did not count the gap ({outcome}) within 60s: "
                        fault.problem += await self.stream_state(session, victim)
                    else:
                        fault.note += f"; the routers counted the gap ({outcome}) {seen:.1f}s after"
        elif kind == "peer_killed_seeding":
            every = await asyncio.to_thread(self.kube.pods, self.ns, ROUTER_PODS)
            routers = live(every)
            gone, *siblings = self.rng.sample(routers, len(routers))
            fault.target = gone.metadata.name
            await asyncio.to_thread(self.core.delete_namespaced_pod, gone.metadata.name, self.ns)
            # New: not among the pods before the delete, terminating ones included (their process runs on).
            fresh = await asyncio.to_thread(self._new_router_process, {p.metadata.name for p in every})
            peer = self.rng.choice(siblings)
            fault.killed.add(peer.metadata.name)
            if (pid := container_pid(peer)) is not None:
                os.kill(pid, signal.SIGKILL)
            fault.note = f"{peer.metadata.name} killed as {fresh} booted"
            self.seeding.append(fresh)
        elif kind == "apiserver_restart":
            fault.target = "kube-apiserver"
            down = self.rng.uniform(1.0, 5.0)
            t_stop = time.monotonic()
            await asyncio.to_thread(self.cluster.stop_apiserver)
            stopped = time.monotonic() - t_stop
            await asyncio.sleep(down)
            # Started on this (the main) thread: a component dies with the thread that spawned it.
            t_start = time.monotonic()
            self.cluster.start_apiserver()
            await asyncio.to_thread(self.cluster.wait_apiserver)
            ready = time.monotonic() - t_start
            fault.note = f"stopped {stopped:.1f}s after SIGTERM, down {down:.1f}s, Ready {ready:.1f}s after"
        elif kind == "readiness_flap":
            ms = int(self.rng.uniform(8000, 12000))
            async with session.post(
                f"http://{victim.status.pod_ip}:{F.ENGINE_PORT}/admin/health_fault", json={"ms": ms}
            ) as r:
                r.raise_for_status()
            await asyncio.sleep(ms / 1000)
            fault.note = f"/health 503 for {ms / 1000:.1f}s"
        else:
            raise ValueError(f"unknown fault {kind!r}")
        fault.injected = time.monotonic()
        return fault

    async def verdict(self, session, pod: str) -> str:
        with contextlib.suppress(ApiException, aiohttp.ClientError, TimeoutError, OSError, KeyError):
            p = await asyncio.to_thread(self.core.read_namespaced_pod, pod, self.ns)
            rep = await F.bootstrap_report(session, f"http://{p.status.pod_ip}:{F.INTERNAL_PORT}", self.token)
            return f"verdict {rep.get('verdict')}"
        return "verdict unknown"

    def _new_router_process(self, old: set[str]) -> str:
        """The replacement router pod, once its process runs (the moment it starts to seed)."""

        def started():
            for p in self.kube.pods(self.ns, ROUTER_PODS):
                if p.metadata.name not in old and container_pid(p) is not None:
                    return p.metadata.name
            return None

        return self.kube.wait("the replacement router's process", started, 60, interval=0.05)

    async def wait_counter(self, session, name: str, at_least: float, timeout: float) -> float | None:
        """Seconds until the routers' summed counter ``name`` reaches ``at_least`` (None: it did not)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if (await self.counters(session))[name] >= at_least:
                return time.monotonic() - t0
            await asyncio.sleep(0.2)
        return None

    async def wait_following(self, session, victim, timeout: float = 30) -> None:
        """Until every Ready router has a cursor on ``victim``'s rank 0."""
        eid, t0 = F.engine_id(victim), time.monotonic()
        while time.monotonic() - t0 < timeout:
            cursors = []
            for _pod, ip in list(self.ready):
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, KeyError):
                    _, index = await F.get(session, f"http://{ip}:{F.METRICS_PORT}/debug/index")
                    subs = index["subscriptions"]
                    cursors += [x["cursor"] for x in subs if x["engine"] == eid and x["rank"] == 0]
            if len(cursors) == len(self.ready) and None not in cursors:
                return
            await asyncio.sleep(0.2)

    async def stream_state(self, session, victim) -> str:
        """The engine's last seq per rank against each router's cursor and connection for it."""
        eid, out = F.engine_id(victim), []
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, KeyError):
            _, st = await F.get(session, f"http://{victim.status.pod_ip}:{F.ENGINE_PORT}/admin/state")
            out.append("engine last_seq " + ",".join(str(r["last_seq"]) for r in st["ranks"]))
        for pod, ip in list(self.ready):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, KeyError):
                _, index = await F.get(session, f"http://{ip}:{F.METRICS_PORT}/debug/index")
                subs = [x for x in index["subscriptions"] if x["engine"] == eid]
                out.append(pod + " " + ",".join(f"r{x['rank']}:{x['cursor']}/{x['connected']}" for x in subs))
        return "; ".join(out)

    async def store(self, session, engine: str) -> None:
        """``engine`` stores new blocks on rank 0 (its stream publishes them): a fake engine is told to,
        vLLM computes a fresh prompt."""
        tokens = [self.rng.randrange(1000, 30000) for _ in range(2 * F.BLOCK + 1)]
        if self.engines is not VLLM:
            return await self.admin(session, engine, "store", {"rank": 0, "token_ids": tokens})
        async with session.post(f"{engine}/v1/completions", json={"prompt": tokens, "max_tokens": 1}) as r:
            r.raise_for_status()

    async def stalled_ranks(self, session) -> int:
        """``routerfleet_kv_stalled_ranks`` summed over the Ready routers."""
        total = 0
        for _pod, ip in list(self.ready):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                total += int((await F.metrics(session, f"http://{ip}:{F.METRICS_PORT}")).get(STALLED, 0))
        return total

    async def max_stalled(self, session, seconds: float) -> int:
        """The most stalled ranks the routers counted at once, sampled for ``seconds``."""
        top, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            top = max(top, await self.stalled_ranks(session))
            await asyncio.sleep(0.25)
        return top

    async def check_stall(self, session, fault: Fault, stalled: int) -> None:
        """A vLLM stream dropped: it has no gap to show (TCP delivers the held batches late), so the
        routers must have seen it stall while it owed them batches for requests they routed there, and
        must see it catch up once it flows again."""
        eid, since = fault.silent
        owed = [
            o for o in self.run.outcomes
            if o.engine == eid and o.kind == "ok" and since <= o.t0 and o.t1 + UNKNOWABLE_S < time.monotonic()
        ]  # fmt: skip
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60 and await self.stalled_ranks(session):
            await asyncio.sleep(0.25)
        caught_up = time.monotonic() - t0
        fault.note += f"; {len(owed)} requests served there meanwhile, up to {stalled} stalled ranks seen"
        if len(owed) >= 2 and not stalled:
            fault.problem = "no router saw the silent stream stall though requests were served there"
        elif caught_up >= 60:
            fault.problem = "the routers still count a stalled rank 60s after the stream came back"
        else:
            fault.note += f", clear {caught_up:.1f}s after it came back"

    async def admin(self, session, engine: str, what: str, body: dict) -> None:
        async with session.post(f"{engine}/admin/{what}", json=body) as r:
            r.raise_for_status()

    def start_rollout(self) -> None:
        self.rollouts += 1
        args = [*self.router_args, f"--first-byte-timeout-ms={120000 + self.rollouts}"]
        patch = {"spec": {"router": {"extraArgs": args}}}
        self.kube.crd.patch_namespaced_custom_object(T.GROUP, T.VERSION, self.ns, T.PLURAL, FLEET, patch)

    # ---- the run -------------------------------------------------------------------------------

    async def main(self, schedule: list[str], seconds: float, settle_s: float) -> None:
        timeout = aiohttp.ClientTimeout(total=60, sock_connect=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = [asyncio.create_task(self.refresh()), asyncio.create_task(self.sampler())]
            tasks += [asyncio.create_task(self.worker(session)) for _ in range(WORKERS)]
            try:
                say(f"steady traffic for {settle_s:.0f}s before the first fault")
                await asyncio.sleep(settle_s)
                end = self.run.start + seconds
                for i, kind in enumerate(schedule):
                    if time.monotonic() > end:
                        say(f"time is up after {i} faults")
                        break
                    before = await self.counters(session)
                    try:
                        fault = await self.inject(kind, session)
                    except RuntimeError as e:  # a wait inside the injection timed out: the fleet is stuck
                        fault = Fault(kind, "?", time.monotonic(), problem=f"while injecting: {e}")
                        self.run.faults.append(fault)
                        say(f"{i + 1}/{len(schedule)} {kind}: {fault.problem}; stopping")
                        break
                    self.run.faults.append(fault)
                    ok = await self.wait_converged(session, fault)
                    delta = (await self.counters(session)) - before
                    fault.effect = ", ".join(f"{k} +{v:g}" for k, v in sorted(delta.items()))
                    for pod in self.seeding:
                        fault.effect += f"; {pod}: {await self.verdict(session, pod)}"
                    self.seeding.clear()
                    own = fault.injected - fault.t0
                    took = (fault.converged or time.monotonic()) - fault.injected
                    n, what = f"{i + 1}/{len(schedule)}", f"{kind} on {fault.target} ({own:.1f}s)"
                    say(f"{n} {what}, converged {took:.1f}s later; {fault.note}")
                    if fault.waits:
                        say(f"    waited for: {fault.recovery()}")
                    if not ok:
                        break
                    await asyncio.sleep(self.rng.uniform(2.0, 6.0))
                await asyncio.sleep(AFTER_S)
            finally:
                self.stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)


def live(pods: list) -> list:
    """``pods`` without the terminating ones, by name."""
    return sorted((p for p in pods if not p.metadata.deletion_timestamp), key=lambda p: p.metadata.name)


def restart_count(pod) -> int:
    cs = (pod.status.container_statuses or [None])[0]
    return getattr(cs, "restart_count", 0) or 0


def container_pid(pod) -> int | None:
    cs = (pod.status.container_statuses or [None])[0]
    cid = getattr(cs, "container_id", None) or ""
    return int(cid.removeprefix("process://")) if cid.startswith("process://") else None


@contextlib.contextmanager
def blocked(pid: int, ports: list[int]):
    """Drop TCP traffic to and from ``ports`` in the network namespace of process ``pid`` (a pod's),
    both directions: nothing is refused, the packets just vanish, as on a partitioned network."""
    iptables = ["nsenter", f"--net=/proc/{pid}/ns/net", "--", "iptables"]
    rules = []
    for port in ports:
        rules.append(["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"])
        rules.append(["OUTPUT", "-p", "tcp", "--sport", str(port), "-j", "DROP"])
    for r in rules:
        subprocess.run([*iptables, "-I", *r], check=True, capture_output=True)
    try:
        yield
    finally:
        for r in rules:
            subprocess.run([*iptables, "-D", *r], check=False, capture_output=True)


def plan(seed: int, faults: list[str], rounds: int) -> list[str]:
    """Every class ``rounds`` times, in a seeded order."""
    rng = random.Random(seed)
    out = [f for _ in range(rounds) for f in faults]
    rng.shuffle(out)
    return out


# ------------------------------------------------------------------------------------------ the report


def hit_rate(outs: list[Outcome]) -> float:
    p = sum(o.prompt for o in outs)
    return sum(o.cached for o in outs) / p if p else float("nan")


def report(run: Run) -> list[str]:
    """Print the timeline and the figures; return the failures."""
    end = max([o.t1 for o in run.outcomes] + [time.monotonic()])
    failures: list[str] = []
    t = run.start
    print("\n## timeline (s from the start)")
    for f in run.faults:
        conv = f"{f.converged - f.injected:5.1f}s" if f.converged is not None else "never"
        own = f"{f.injected - f.t0:4.1f}s" if f.injected else "  ? "
        print(f"  {f.t0 - t:7.1f}  {f.kind:<20} {f.target:<40} {own}, converged {conv} later {f.note}")
        if f.effect:
            print(f"  {'':7}  {'':<20} {f.effect}")
        if f.waits:
            print(f"  {'':7}  {'':<20} waited for: {f.recovery()}")
        if f.converged is None:
            failures.append(f"{f.kind} on {f.target} did not converge")
        if f.problem:
            print(f"  {'':7}  {'':<20} PROBLEM: {f.problem}")
            failures.append(f"{f.kind} on {f.target}: {f.problem}")
    ok = [o for o in run.outcomes if o.kind == "ok"]
    windows = [(f, *f.window(end)) for f in run.faults]

    def in_window(o: Outcome, kinds=None) -> Fault | None:
        for f, a, b in windows:
            if a <= o.t0 <= b and (kinds is None or f.kind in kinds):
                return f
        return None

    kinds = Counter(o.kind for o in run.outcomes)
    print(f"\n## requests: {len(run.outcomes)} sent; {dict(kinds)}")
    shares = Counter(o.engine.rsplit("-", 2)[0].split("/")[-1] for o in ok)  # per engine Deployment
    print("  served by " + ", ".join(f"{d}: {n}" for d, n in sorted(shares.items())))
    causes = Counter(o.cause for o in run.outcomes if o.kind != "ok")
    for cause, n in causes.most_common():
        print(f"  {n:5d}  {cause}")

    def killed_under(o: Outcome) -> bool:
        # Overlap, not start: a stream begun just before the kill is the one the kill cuts.
        return any(
            o.t0 <= b and o.t1 >= a and (o.engine in f.killed or o.router in f.killed) for f, a, b in windows
        )

    excused = 0
    for o in run.outcomes:
        if o.kind == "cut" and killed_under(o):
            excused += 1
        elif o.kind in ("cut", "lost"):
            failures.append(f"a request to {o.router} lost at {o.t0 - t:.1f}s: {o.cause}")
    if excused:
        print(f"  ({excused} cut on the process a fault killed under them)")

    def unknowable(o: Outcome) -> bool:
        """On an engine whose stream had gone silent too recently for the router to know."""
        return any(
            f.silent is not None and o.engine == f.silent[0] and 0 <= o.t0 - f.silent[1] <= UNKNOWABLE_S
            for f in run.faults
        )

    steady = [o for o in ok if in_window(o) is None]
    blind = sum(o.false_hit for o in ok if not o.doubtful and unknowable(o))
    false_plain = sum(o.false_hit for o in ok if not o.doubtful) - blind
    false_doubt = sum(o.false_hit for o in ok if o.doubtful)
    predicted = sum(o.predicted or 0 for o in ok)
    unaudited = sum(not o.audited for o in ok)
    print(
        f"\n## the audit: {len(ok) - unaudited} audited ({unaudited} answered without usage); predicted"
        f" {predicted} cached tokens; false-hit tokens {false_plain} outside doubtful predictions,"
        f" {false_doubt} inside"
        f" ({sum(o.doubtful for o in ok)} doubtful requests), {blind} in a silent stream's first"
        f" {UNKNOWABLE_S:g}s (before the router's stall threshold, it cannot know);"
        f" missed-hit tokens {sum(o.missed_hit for o in ok)}"
    )
    if not predicted:  # without predictions the audit above proves nothing
        failures.append("no prediction came back: the routers did not answer the prediction header")
    if unaudited > max(5, len(ok) // 100):  # nor without the engines' figures to hold them to
        failures.append(f"{unaudited} of {len(ok)} answers came without usage: the audit is blind")
    if false_plain:
        bad = [o for o in ok if o.false_hit and not o.doubtful and not unknowable(o)]
        for o in bad[:10]:
            f = in_window(o)
            print(
                f"  false hit at {o.t0 - t:.1f}s via {o.router} to {o.engine}: predicted {o.predicted},"
                f" cached {o.cached} ({f.kind + ' on ' + f.target if f else 'steady'})"
            )
        failures.append(f"{false_plain} false-hit tokens outside doubtful predictions")
    print("\n## hit rate per phase")
    refused = [o for o in run.outcomes if o.kind == "refused"]

    def refused_in(kind: str | None) -> int:
        n = 0
        for o in refused:
            w = in_window(o)
            n += (w is None) if kind is None else (w is not None and w.kind == kind)
        return n

    print(
        f"  {'phase':<22}{'requests':>9}{'hit rate':>10}{'false-hit tok':>15}{'refused':>9}"
        f"{'fault s (med)':>14}{'recovery s (med/max)':>22}"
    )
    print(
        f"  {'steady':<22}{len(steady):>9}{hit_rate(steady):>10.1%}{sum(o.false_hit for o in steady):>15}"
        f"{refused_in(None):>9}"
    )
    for kind in FAULTS:
        fs = [f for f in run.faults if f.kind == kind]
        if not fs:
            continue
        during = [o for o in ok if (w := in_window(o)) is not None and w.kind == kind]
        # The fault's own time (a drop held, an API server stopped and started), then the fleet's.
        own = sorted((f.injected or end) - f.t0 for f in fs)
        rec = sorted((f.converged or end) - (f.injected or f.t0) for f in fs)
        print(
            f"  {kind:<22}{len(during):>9}{hit_rate(during):>10.1%}{sum(o.false_hit for o in during):>15}"
            f"{refused_in(kind):>9}{own[len(own) // 2]:>14.1f}{rec[len(rec) // 2]:>13.1f} / {rec[-1]:.1f}"
        )
    print("\n## router processes (RSS MiB and open files, first -> last sample, pods that lived > 60 s)")
    for pod, ss in sorted(run.samples.items()):
        if ss[-1].t - ss[0].t < 60:
            continue
        first = next((s for s in ss if s.t - ss[0].t >= 60), ss[0])  # past the first minute
        last = ss[-1]
        print(
            f"  {pod:<40} {first.rss_kib / 1024:7.1f} -> {last.rss_kib / 1024:7.1f} MiB,"
            f" {first.fds:4d} -> {last.fds:4d} fds, over {last.t - first.t:5.0f}s"
        )
        if last.rss_kib > 1.5 * first.rss_kib and last.t - first.t > 120:
            failures.append(f"{pod}: RSS grew from {first.rss_kib} to {last.rss_kib} KiB")
    return failures


def soak(kube: T.Kube, provider, ns: str, *, seed: int, faults: list[str], rounds: int, minutes: float,
         converge_timeout: float | None = None, settle_s: float = 20.0, engines: Engines = FAKE,
         ) -> list[str]:  # fmt: skip
    """Set up in ``ns`` (the operator cluster-wide) on the local ``provider``'s cluster, run, report;
    the failures (empty: passed). A failed run leaves a dump of both namespaces in a file it names."""
    for f in faults:
        if f in engines.not_here:
            raise ValueError(f"fault {f!r} does not apply to {engines.kind} engines: {engines.not_here[f]}")
    if "kv_stream_dropped" in faults and shutil.which("iptables") is None:
        raise RuntimeError(
            "iptables not found: the kv_stream_dropped fault drops packets with it (make iptables)"
        )
    s = Soak(kube, provider.cluster, ns, seed, converge_timeout or engines.converge_s, engines)
    say("installing the operator (manifests/operator) ...")
    s.install_operator()
    try:
        what = ", ".join(DIALECTS) if engines is FAKE else "real vLLM, CPU"
        say(f"deploying {engines.count} engines ({what}) and a {ROUTERS}-replica RouterFleet in {ns} ...")
        s.deploy()
        schedule = plan(seed, faults, rounds)
        say(f"seed {seed}: {len(schedule)} faults, at most {minutes:g} minutes: {', '.join(schedule)}")
        asyncio.run(s.main(schedule, minutes * 60, settle_s))
        failures = report(s.run)
        if failures:
            failures.append(f"the cluster's state at the end: {write_dump(kube, provider, ns)}")
        return failures
    finally:
        s.uninstall_operator()


def write_dump(kube: T.Kube, provider, ns: str) -> str:
    path = os.path.join(tempfile.gettempdir(), f"{ns}-dump.txt")

    def log(namespace: str, pod: str, container: str) -> str:
        return provider.container_log(namespace, pod, container) or ""

    with open(path, "w") as f:
        for n in (ns, OPERATOR_NS):
            f.write(dump_namespace(kube.api, n, log, log_lines=200) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m e2e.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="stop injecting after this long (default 20)")
    ap.add_argument("--seed", type=int, default=1, help="the schedule's and the traffic's seed (default 1)")
    ap.add_argument(
        "--engines",
        default="fake",
        choices=sorted(ENGINE_KINDS),
        help="what the fleet runs over (default fake)",
    )
    ap.add_argument(
        "--faults", help=f"classes to draw from (default all that apply to the engines: {','.join(FAULTS)})"
    )
    ap.add_argument(
        "--rounds", type=int, default=0, help="faults per class (default: enough to fill the time)"
    )
    ap.add_argument(
        "--converge-timeout",
        type=float,
        help="seconds a fault may take to converge (default 150; 480 for vllm: its pods start in minutes)",
    )
    a = ap.parse_args()
    engines = ENGINE_KINDS[a.engines]
    if a.faults is None:
        faults = [f for f in FAULTS if f not in engines.not_here]
    else:
        faults = [f.strip() for f in a.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"argument --faults: unknown class {unknown[0]!r} (choose from {', '.join(FAULTS)})")
    if elsewhere := [f for f in faults if f in engines.not_here]:
        ap.error(f"argument --faults: {elsewhere[0]!r} does not apply to {engines.kind} engines:"
                 f" {engines.not_here[elsewhere[0]]}")  # fmt: skip
    if engines is VLLM:
        from e2e import vllm

        vllm.install()  # before the cluster's private network namespace: it may download
    rounds = a.rounds or max(1, int(a.minutes * 60 / 40 / len(faults)) + 1)  # ~40 s per fault
    from e2e.demo import NoCluster, start_cluster

    try:
        provider, kubeconfig = start_cluster("local")
    except NoCluster as e:
        print(f"[soak] no cluster: {e}", flush=True)
        sys.exit(2)
    try:
        ns = f"routerfleet-soak-{uuid.uuid4().hex[:5]}"
        failures = soak(
            T.Kube(kubeconfig), provider, ns, seed=a.seed, faults=faults, rounds=rounds,
            minutes=a.minutes, converge_timeout=a.converge_timeout, engines=engines,
        )  # fmt: skip
    finally:
        say("tearing down the cluster ...")
        provider.down()
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures[:20]), flush=True)
        sys.exit(1)
    print("\npassed", flush=True)


if __name__ == "__main__":
    main()
