"""Shared pieces of the request-plane benchmarks (``routing_quality``, ``overhead``).

- processes: fake engines and routers (ours, vllm-router, sglang-router) as child processes, each in a
  session of its own so that stopping one stops everything it spawned, optionally pinned to CPUs;
  the CPU time of a process group read from /proc;
- a lean HTTP/1.1 client over asyncio protocols (keep-alive, Content-Length or chunked bodies), so the
  load generator costs little next to what it measures and timestamps the first body byte;
- small statistics and report helpers.

Everything listens on and talks to 127.0.0.1 only. The anchors are told not to reach Hugging Face
(``HF_HUB_OFFLINE=1`` and ``HF_ENDPOINT`` on a closed local port): sglang-router otherwise tries to
download a tokenizer named after the engine's model id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
BIN = Path(sys.executable).parent  # the venv's bin: routerfleet-*, vllm-router, sglang-router
MODEL = "routerfleet/fake-model"
ANCHOR_ENV = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://{HOST}:9", "NO_COLOR": "1", "RUST_LOG": "warn"}

# ---------------------------------------------------------------------------------------------------
# Machine, versions


def machine() -> str:
    model = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{model}, {os.cpu_count()} cores, load {load:.1f}, Linux {platform.release()},"
        f" Python {platform.python_version()}"
    )


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_rev() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def anchor_status(kind: str) -> tuple[bool, str]:
    """(usable, version or why not) for ``vllm-router`` and ``sglang-router``."""
    exe = BIN / kind
    v = version(kind)
    if v is None or not exe.exists():
        return False, f"{kind} is not installed in {BIN.parent} (pip install {kind})"
    return True, v


# ---------------------------------------------------------------------------------------------------
# Ports and processes


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return idle, sum(v[:8])


def wait_quiet(max_s: float, idle: float = 0.8, window: float = 0.5) -> tuple[float, float]:
    """Wait (up to ``max_s``) until the machine was at least ``idle`` idle over one ``window``: other
    tenants' builds on a shared VM swing these figures by 2x. Returns (seconds waited, idle share
    seen last)."""
    t0 = time.monotonic()
    seen = 0.0
    while True:
        i0, a0 = _cpu_times()
        time.sleep(window)
        i1, a1 = _cpu_times()
        seen = (i1 - i0) / max(1, a1 - a0)
        if seen >= idle or time.monotonic() - t0 >= max_s:
            return time.monotonic() - t0, seen


def cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


class Proc:
    """A child process in a session of its own (pgid = pid): ``stop`` signals the whole group, so a
    launcher that forks its server (vllm-router's Python entry point) is stopped with it."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        logdir: str,
        *,
        cpus: set[int] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = os.path.join(logdir, f"{name}.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        pin = None
        if cpus:

            def pin() -> None:  # runs in the child before exec: every thread it starts inherits it
                os.sched_setaffinity(0, cpus)

        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            preexec_fn=pin,
        )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 3.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace)
        # The group may outlive its leader (a forked server): make sure nothing of it is left.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(2)
        self._log.close()

    def tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def run_seconds(self) -> float:
        """CPU time of every thread of every live process in this group, to the nanosecond (the
        scheduler's own account, /proc/PID/task/TID/schedstat; ``cpu_seconds`` counts in clock ticks,
        too coarse for a few hundred requests)."""
        total = 0
        for pid in self._group_pids():
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
        return total / 1e9

    def _group_stats(self) -> list[tuple[str, list[str]]]:
        """(pid, the fields of /proc/PID/stat after the command) of every live process in this group."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == self.pid:  # pgrp
                out.append((entry, fields))
        return out

    def _group_pids(self) -> list[str]:
        return [pid for pid, _ in self._group_stats()]

    def cpu_seconds(self) -> float:
        """User + system CPU of every live process in this group (threads included)."""
        ticks = sum(int(fields[11]) + int(fields[12]) for _, fields in self._group_stats())  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def http_post(url: str, body: Any, timeout: float = 5.0) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError) as e:
        return 0, str(e)


def wait_until(check: Callable[[], bool], timeout: float, what: str, procs: Sequence[Proc] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited ({p.popen.returncode}) before {what}:\n{p.tail()}")
        if check():
            return
        time.sleep(0.05)
    tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")


# ---------------------------------------------------------------------------------------------------
# Fake engines and routers


@dataclass
class EngineOpts:
    block_size: int = 16
    capacity_blocks: int = 4096
    prefill_us_per_token: float = 20.0
    decode_tokens_per_s: float = 2000.0
    max_concurrency: int = 0
    shared_compute: bool = False  # a rank's prefills one at a time, its decodes stalled meanwhile
    cache_generated: bool = False
    max_loras: int = 0  # LoRA adapter slots (0: adapters cost nothing)
    lora_load_ms: float = 0.0
    publish_delay_ms: float = 0.0  # a request's blocks announced this long after admission
    kv_transfer: bool = False  # serve disaggregated prefill legs (vLLM's kv_transfer_params)
    transfer_us_per_block: float = 0.0  # what a decode leg's pull costs per block
    disaggregation_mode: str = ""  # SGLang's: "prefill" or "decode" (a bootstrap room's leg)
    pd_sidecar: bool = False  # llm-d's routing sidecar in front (a picker's x-prefiller-host-port)


@dataclass
class Engine:
    proc: Proc
    port: int
    kv_port: int
    replay_port: int

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def kv(self) -> str:
        return f"tcp://{HOST}:{self.kv_port}"

    @property
    def replay(self) -> str:
        return f"tcp://{HOST}:{self.replay_port}"


def start_engines(n: int, opts: EngineOpts, logdir: str, *, cpus: set[int] | None = None) -> list[Engine]:
    ports = free_ports(3 * n)
    engines = []
    try:
        for i in range(n):
            port, kv, replay = ports[3 * i : 3 * i + 3]
            argv = [
                str(BIN / "routerfleet-fake-engine"),
                *("--host", HOST, "--port", str(port), "--kv-port", str(kv), "--replay-port", str(replay)),
                *("--block-size", str(opts.block_size), "--capacity-blocks", str(opts.capacity_blocks)),
                *("--prefill-us-per-token", str(opts.prefill_us_per_token)),
                *("--decode-tokens-per-s", str(opts.decode_tokens_per_s)),
                *("--max-concurrency", str(opts.max_concurrency), "--model", MODEL),
                *("--log-level", "WARNING"),
                *(["--cache-generated"] if opts.cache_generated else []),
                *(["--shared-compute"] if opts.shared_compute else []),
                *("--max-loras", str(opts.max_loras), "--lora-load-ms", str(opts.lora_load_ms)),
                *("--publish-delay-ms", str(opts.publish_delay_ms)),
                *(["--kv-transfer"] if opts.kv_transfer else []),
                *(["--pd-sidecar"] if opts.pd_sidecar else []),
                *("--transfer-us-per-block", str(opts.transfer_us_per_block)),
                *(("--disaggregation-mode", opts.disaggregation_mode) if opts.disaggregation_mode else ()),
            ]
            engines.append(Engine(Proc(f"engine-{i}", argv, logdir, cpus=cpus), port, kv, replay))
        for e in engines:
            wait_until(lambda e=e: http_get(e.url + "/health")[0] == 200, 20, f"{e.proc.name}", [e.proc])
    except BaseException:
        stop_all(engines)
        raise
    return engines


def stop_all(items: Sequence[Engine | Router | Proc]) -> None:
    for item in items:
        (item if isinstance(item, Proc | Router) else item.proc).stop()


@dataclass
class Router:
    kind: str  # "ours", "ours-epp", "vllm-router", "sglang-router"
    label: str
    proc: Proc
    port: int
    flags: list[str] = field(default_factory=list)  # the flags as run, for the report (ports elided)
    ready_path: str = "/readyz"
    # Behind a gateway (our endpoint picker): ``port`` is Envoy's, and the router's own port only answers
    # its probes; ``sidecar`` is Envoy's process (on one of a picker fleet's routers).
    own_port: int | None = None
    sidecar: Proc | None = None
    model: str = MODEL  # the engines' model name, for the warm-up completion
    metrics_port: int | None = None  # ours: /metrics and /debug/*; the anchors: their Prometheus port

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def procs(self) -> list[Proc]:
        return [self.proc] if self.sidecar is None else [self.proc, self.sidecar]

    def cpu_seconds(self) -> float:
        """CPU of every router-side process: the router, and Envoy when it fronts the picker."""
        return sum(p.cpu_seconds() for p in self.procs)

    def run_seconds(self) -> float:
        """The same, to the nanosecond (``Proc.run_seconds``)."""
        return sum(p.run_seconds() for p in self.procs)

    def alive(self) -> bool:
        return all(p.alive() for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def ours_argv(
    engines: Sequence[Engine],
    port: int,
    metrics_port: int,
    policy: str,
    extra: Sequence[str] = (),
    *,
    events: bool = True,
    block_size: int = 16,
    worker_keys: Sequence[str] | None = None,
) -> list[str]:
    """``events`` False: the workers are given without their KV event endpoints (the index stays empty).
    ``worker_keys``: more keys of each engine's ``--worker``, in order (``role=prefill``, ...)."""
    argv = [str(BIN / "routerfleet-router"), "--host", HOST, "--port", str(port)]
    argv += ["--metrics-port", str(metrics_port)]
    argv += [
        "--policy",
        policy,
        "--block-size",
        str(block_size),
        "--tokenizer",
        "bytes",
        "--log-level",
        "warning",
    ]
    for i, e in enumerate(engines):
        worker = f"url={e.url},kv={e.kv},replay={e.replay}" if events else f"url={e.url}"
        argv += ["--worker", worker + (f",{worker_keys[i]}" if worker_keys and worker_keys[i] else "")]
    return argv + list(extra)


def vllm_router_argv(
    engines: Sequence[Engine],
    port: int,
    metrics_port: int,
    block_size: int,
    extra: Sequence[str] = (),
    model: str = MODEL,
) -> list[str]:
    argv = [str(BIN / "vllm-router"), "--host", HOST, "--port", str(port), "--policy", "kv_aware"]
    argv += ["--worker-urls", *(e.url for e in engines)]
    for e in engines:
        argv += ["--kv-event-source", f"{e.url}={e.kv}", "--kv-event-replay-source", f"{e.url}={e.replay}"]
    argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    argv += ["--prometheus-host", HOST, "--prometheus-port", str(metrics_port), "--log-level", "warning"]
    return argv + list(extra)


def sglang_router_argv(
    engines: Sequence[Engine], port: int, metrics_port: int, extra: Sequence[str] = ()
) -> list[str]:
    argv = [str(BIN / "sglang-router"), "launch", "--host", HOST, "--port", str(port)]
    argv += ["--worker-urls", *(e.url for e in engines), "--policy", "cache_aware"]
    argv += ["--prometheus-host", HOST, "--prometheus-port", str(metrics_port), "--log-level", "warn"]
    argv += ["--shutdown-grace-period-secs", "1"]
    return argv + list(extra)


def shown_flags(argv: Sequence[str], engines: Sequence[Engine]) -> list[str]:
    """The flags of a command line with engine addresses and ports replaced by placeholders."""
    out: list[str] = []
    subs = {}
    drop = {"--host", "--port", "--metrics-port", "--prometheus-host", "--prometheus-port"}
    for i, e in enumerate(engines):
        subs[e.url] = f"http://E{i}"
        subs[e.kv] = f"tcp://E{i}:kv"
        subs[e.replay] = f"tcp://E{i}:replay"
    skip = False
    for a in argv[1:]:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        for k in sorted(subs, key=len, reverse=True):
            a = a.replace(k, subs[k])
        out.append(a)
    return out


def start_router(
    kind: str,
    engines: Sequence[Engine],
    logdir: str,
    *,
    policy: str = "kv_aware",
    label: str | None = None,
    cpus: set[int] | None = None,
    extra: Sequence[str] = (),
    events: bool = True,
    wait: bool = True,
    block_size: int = 16,
    model: str = MODEL,
    worker_keys: Sequence[str] | None = None,
    duplex: bool = False,
    command: Sequence[str] | None = None,
) -> Router:
    """Start one router in front of ``engines`` and wait until it answers. For ours that is /readyz
    (an engine known and healthy and, for kv_aware, its subscriptions connected); for the anchors
    their /health, then one completion through them. ``block_size`` and ``model``: the engines';
    ``worker_keys``: more keys of each engine's ``--worker`` (ours only); ``duplex``: "ours-epp"'s
    Envoy sends bodies FULL_DUPLEX_STREAMED (as Envoy Gateway does), not BUFFERED / STREAMED;
    ``command``: what runs ours in place of ``routerfleet-router`` (its arguments the same)."""
    port, metrics_port = free_ports(2)
    name = label or (kind if kind != "ours" else f"ours-{policy}")
    if kind == "ours-epp":
        pickers = start_pickers(
            engines, logdir, [extra], policy=policy, label=name, cpus=cpus, wait=wait, duplex=duplex
        )
        return pickers[0]
    if kind == "ours":
        keys = worker_keys
        argv = ours_argv(
            engines, port, metrics_port, policy, extra, events=events, block_size=block_size, worker_keys=keys
        )
        shown = shown_flags(argv, engines)  # ours' flags, whatever runs it
        if command is not None:
            argv = [*command, *argv[1:]]
        env = None
        ready_path = "/readyz"
    elif kind == "vllm-router":
        argv = vllm_router_argv(engines, port, metrics_port, block_size, extra, model)
        shown = shown_flags(argv, engines)
        env = ANCHOR_ENV
        ready_path = "/health"
    elif kind == "sglang-router":
        argv = sglang_router_argv(engines, port, metrics_port, extra)
        shown = shown_flags(argv, engines)
        env = ANCHOR_ENV
        ready_path = "/health"
    else:
        raise ValueError(kind)
    proc = Proc(name, argv, logdir, cpus=cpus, env=env)
    router = Router(kind, name, proc, port, shown, ready_path, model=model, metrics_port=metrics_port)
    if wait:
        await_router(router)
    return router


def start_pickers(
    engines: Sequence[Engine],
    logdir: str,
    extras: Sequence[Sequence[str]],
    *,
    policy: str,
    label: str,
    cpus: set[int] | None,
    wait: bool = True,
    worker_keys: Sequence[str] | None = None,
    pool: Sequence[Engine] | None = None,
    duplex: bool = False,
) -> list[Router]:
    """Our routers as a Gateway's endpoint picker (TLS, its default), one per ``extras`` (its own extra
    flags), with one real Envoy in front of them all (e2e/gateway/envoy.yaml): each request's ext_proc
    stream goes to one replica. Every Router's ``port`` is Envoy's; the first carries Envoy's process.
    ``worker_keys``: as ``ours_argv``'s; ``pool``: the engines Envoy sends requests to (default all: a
    disaggregated fleet's pool is its decode engines); ``duplex``: bodies FULL_DUPLEX_STREAMED both ways."""
    from e2e.gateway import envoy_argv, envoy_config  # the Envoy binary is a test extra

    port = free_ports(1)[0]
    ports = free_ports(3 * len(extras))
    routers: list[Router] = []
    try:
        for i, extra in enumerate(extras):
            own, epp, metrics = ports[3 * i : 3 * i + 3]
            name = label if len(extras) == 1 else f"{label}-{i}"
            argv = ours_argv(
                engines, own, metrics, policy, [*extra, "--epp-port", str(epp)], worker_keys=worker_keys
            )
            proc = Proc(name, argv, logdir, cpus=cpus)
            flags = shown_flags(argv, engines)
            routers.append(Router("ours-epp", name, proc, port, flags, own_port=own, metrics_port=metrics))
        config = os.path.join(logdir, f"{label}-envoy.yaml")
        pickers = [f"{HOST}:{ports[3 * i + 1]}" for i in range(len(extras))]
        with open(config, "w") as f:
            pooled = [e.url for e in (engines if pool is None else pool)]
            f.write(envoy_config(port, pickers, pooled, duplex=duplex))
        routers[0].sidecar = Proc(f"{label}-envoy", envoy_argv(config), logdir, cpus=cpus)
        if wait:
            for r in routers:
                await_router(r)
    except BaseException:
        stop_all(routers)
        raise
    return routers


def await_router(router: Router) -> None:
    """Wait until a started router is ready and serves one completion (stopped if it never does); behind
    Envoy the readiness probe is the router's own port, the completion goes through Envoy."""
    try:
        ready = (
            f"http://{HOST}:{router.own_port}/readyz" if router.own_port else router.url + router.ready_path
        )
        wait_until(lambda: http_get(ready)[0] == 200, 60, f"{router.label} ready", router.procs)
        body = {"model": router.model, "prompt": "warm-up", "max_tokens": 1}
        wait_until(
            lambda: http_post(router.url + "/v1/completions", body)[0] == 200,
            30,
            f"{router.label} serving",
            router.procs,
        )
    except BaseException:
        router.stop()
        raise


def start_fleet(
    n: int,
    engines: Sequence[Engine],
    logdir: str,
    *,
    kind: str = "ours",
    policy: str = "kv_aware",
    label: str = "ours",
    cpus: set[int] | None = None,
    extra: Sequence[str] = (),
    block_size: int = 16,
    model: str = MODEL,
) -> list[Router]:
    """``n`` of our routers in front of the same engines, as the operator deploys them: one fleet token,
    each replica's internal port listed as a static peer of the others (what EndpointSlices give a
    replica in a cluster). ``kind`` "ours-epp": each is an endpoint picker, behind one Envoy (fake
    engines only). One replica is started as ``start_router`` starts it."""
    engine = {"block_size": block_size, "model": model}
    if n == 1:
        return [
            start_router(kind, engines, logdir, policy=policy, label=label, cpus=cpus, extra=extra, **engine)
        ]
    token = Path(logdir) / "fleet-token"
    token.write_text("bench-fleet-token\n")
    internal = free_ports(n)
    extras = []
    for i in range(n):
        peers = [a for j, p in enumerate(internal) if j != i for a in ("--kv-peer", f"http://{HOST}:{p}")]
        extras.append(
            ["--internal-token-file", str(token), "--internal-port", str(internal[i]), *peers, *extra]
        )
    if kind == "ours-epp":  # launched together: each one's bootstrap asks the others
        return start_pickers(engines, logdir, extras, policy=policy, label=label, cpus=cpus)
    routers: list[Router] = []
    try:
        for i in range(n):
            routers.append(
                start_router(
                    kind,
                    engines,
                    logdir,
                    policy=policy,
                    label=f"{label}-{i}",
                    cpus=cpus,
                    extra=extras[i],
                    wait=False,
                    **engine,
                )
            )
        for r in routers:  # all launched first: each one's bootstrap asks the others
            await_router(r)
    except BaseException:
        stop_all(routers)
        raise
    return routers


@contextlib.contextmanager
def fleet_over_engines(
    engines: int, opts: EngineOpts, replicas: int, logdir: str, *, label: str, extra: Sequence[str] = ()
) -> Iterator[tuple[list[Engine], list[Router]]]:
    """Fresh fake engines and ``replicas`` of our routers over them (``start_fleet``), for one row of a
    bench; all stopped after it, however it ends."""
    started = start_engines(engines, opts, logdir)
    routers: list[Router] = []
    try:
        routers = start_fleet(replicas, started, logdir, label=label, extra=extra)
        yield started, routers
    finally:
        stop_all([*routers, *started])


# ---------------------------------------------------------------------------------------------------
# A lean HTTP/1.1 client


class HttpError(Exception):
    pass


@dataclass(slots=True)
class Reply:
    status: int
    t_first: float  # perf_counter when the first body byte arrived (headers time if no body)
    t_end: float
    body: bytes | None  # None unless keep_body
    headers: dict[str, str] | None = None  # lower-case names; None unless keep_body


class _Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, quickack: bool = False) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._quickack = quickack
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._fut: asyncio.Future[Reply] | None = None
        self._keep = False
        self._reset()

    def _reset(self) -> None:
        self._state = 0  # 0 head, 1 length body, 2 chunk size line, 3 chunk data, 4 final CRLF
        self._status = 0
        self._remaining = 0
        self._body = bytearray()
        self._t_first = 0.0
        self._close_after = False
        self._headers: dict[str, str] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._quickack:
                self._sock = sock
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._fut is not None and not self._fut.done():
            self._fut.set_exception(HttpError(f"connection lost: {exc}"))

    def send(self, data: bytes, keep_body: bool) -> asyncio.Future[Reply]:
        self._reset()
        self._keep = keep_body
        self._fut = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(data)
        return self._fut

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._sock is not None:  # Linux turns quick ACKs off again by itself: re-arm on every read
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        buf = self._buf
        buf += data
        try:
            self._parse(buf, now)
        except Exception as e:  # a malformed response: fail this request, drop the connection
            if self._fut is not None and not self._fut.done():
                self._fut.set_exception(HttpError(f"bad response: {e}"))
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def _body_bytes(self, chunk: bytes | bytearray, now: float) -> None:
        if chunk and not self._t_first:
            self._t_first = now
        if self._keep:
            self._body += chunk

    def _parse(self, buf: bytearray, now: float) -> None:
        while True:
            if self._state == 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end]).decode("latin-1").split("\r\n")
                del buf[: end + 4]
                self._status = int(head[0].split(" ", 2)[1])
                length = None
                chunked = False
                if self._keep:
                    self._headers = {}
                for line in head[1:]:
                    k, _, v = line.partition(":")
                    k = k.strip().lower()
                    if self._headers is not None:
                        self._headers[k] = v.strip()
                    if k == "content-length":
                        length = int(v)
                    elif k == "transfer-encoding" and "chunked" in v.lower():
                        chunked = True
                    elif k == "connection" and v.strip().lower() == "close":
                        self._close_after = True
                if chunked:
                    self._state = 2
                elif length is not None:
                    self._remaining = length
                    self._state = 1
                    if length == 0:
                        return self._done(now)
                else:
                    raise HttpError("response without a length (read-to-close is not supported)")
            elif self._state == 1:
                take = min(len(buf), self._remaining)
                if take:
                    self._body_bytes(buf[:take], now)
                    del buf[:take]
                    self._remaining -= take
                if self._remaining == 0:
                    return self._done(now)
                return
            elif self._state == 2:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                del buf[: end + 2]
                if size == 0:
                    self._state = 4
                else:
                    self._remaining = size
                    self._state = 3
            elif self._state == 3:
                take = min(len(buf), self._remaining)
                if take:
                    self._body_bytes(buf[:take], now)
                    del buf[:take]
                    self._remaining -= take
                if self._remaining:
                    return
                if len(buf) < 2:
                    self._state = 5  # the CRLF after the data
                    return
                del buf[:2]
                self._state = 2
            elif self._state == 5:
                if len(buf) < 2:
                    return
                del buf[:2]
                self._state = 2
            elif self._state == 4:  # trailers (none expected), then the empty line
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    return self._done(now)
            else:  # no request outstanding: ignore stray bytes
                buf.clear()
                return

    def _done(self, now: float) -> None:
        body = bytes(self._body) if self._keep else None
        reply = Reply(self._status, self._t_first or now, now, body, self._headers)
        self._state = -1
        fut, self._fut = self._fut, None
        if self._close_after:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        if fut is not None and not fut.done():
            fut.set_result(reply)


class HttpClient:
    """Keep-alive connections to one ``host:port``; ``post`` takes a free one or opens one."""

    def __init__(self, url: str, *, quickack: bool = False) -> None:
        self.quickack = quickack
        hostport = url.split("://", 1)[1].rstrip("/")
        host, _, port = hostport.partition(":")
        self.host, self.port = host, int(port or 80)
        self._idle: list[_Conn] = []
        self._all: list[_Conn] = []

    async def _conn(self) -> _Conn:
        while self._idle:
            c = self._idle.pop()
            if not c.closed:
                return c
        loop = asyncio.get_running_loop()
        _, c = await loop.create_connection(lambda: _Conn(self.quickack), self.host, self.port)
        self._all.append(c)
        return c

    def request_bytes(self, path: str, body: bytes, headers: str = "") -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{headers}\r\n"
        ).encode() + body

    async def send(self, raw: bytes, *, keep_body: bool = False) -> tuple[float, Reply]:
        """Send one prepared request; returns (send time, reply). Raises HttpError or OSError."""
        c = await self._conn()
        t0 = time.perf_counter()
        try:
            reply = await c.send(raw, keep_body)
        except BaseException:
            c.closed = True
            if c.transport is not None:
                c.transport.close()
            raise
        if not c.closed:
            self._idle.append(c)
        return t0, reply

    def close(self) -> None:
        for c in self._all:
            if c.transport is not None:
                c.transport.close()
        self._all.clear()
        self._idle.clear()


async def streamed(session: Any, url: str, body: dict[str, Any]) -> tuple[float, Any]:
    """POST one streamed request with ``session`` (aiohttp's): its TTFT in ms (send to the first body
    byte) and the response headers; a status other than 200 raises."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
        async for _ in r.content.iter_any():
            first = first or time.perf_counter()
    return ((first or time.perf_counter()) - t0) * 1e3, r.headers


def sse_events(body: bytes) -> list[dict[str, Any]]:
    """The JSON objects of an SSE body (``data: {...}`` lines; ``[DONE]`` skipped)."""
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload and payload != b"[DONE]":
                out.append(json.loads(payload))
    return out


def read_completion(reply: Reply, expected: str, res: Any) -> dict[str, Any] | None:
    """A streamed completion's usage, or None after counting why not on ``res`` (``errors``); a reply
    whose text is not ``expected`` is counted in ``res.wrong_replies`` but still measured."""
    if reply.status != 200:
        res.errors[f"HTTP {reply.status}"] += 1
        return None
    events = sse_events(reply.body or b"")
    got = "".join(e["choices"][0].get("text") or "" for e in events if e.get("choices"))
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
    if usage is None:
        res.errors["no usage"] += 1
        return None
    if got != expected:
        res.wrong_replies += 1
    return usage


def engine_incarnations(engines: Sequence[Engine]) -> dict[str, int]:
    """Each engine's incarnation id (its X-Engine-Incarnation response header) -> its index."""
    out = {}
    for i, e in enumerate(engines):
        _, state = http_get(e.url + "/admin/state")
        out[json.loads(state)["incarnation"]] = i
    return out


def evicted_blocks(engine: Engine) -> int:
    """Blocks the engine has evicted so far: its BlockRemoved events (one per block)."""
    _, text = http_get(engine.url + "/metrics")
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.decode().splitlines()
        if line.startswith("routerfleet_fake_engine_kv_events_total{") and 'event="BlockRemoved"' in line
    )


def false_hit_tokens(router: Router) -> int | None:
    """Our router's audited false-hit tokens outside doubtful predictions so far (None: not ours, or its
    metrics did not answer)."""
    if router.kind != "ours" or router.metrics_port is None:
        return None
    status, text = http_get(f"http://{HOST}:{router.metrics_port}/metrics")
    if status != 200:
        return None
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.decode().splitlines()
        if line.startswith("routerfleet_audit_false_hit_tokens_total{") and 'doubtful="false"' in line
    )


def print_flags_and_logs(
    results: dict[str, list[Any]], labels: dict[str, str], logdir: str, t_start: float
) -> None:
    """The exact flags each router row ran with (from its first result that has them), and where the
    logs are."""
    print("\n# flags (E0..E3 = the engines' HTTP URL, KV PUB and replay endpoints):")
    for name, rs in results.items():
        shown = next((r.flags for r in rs if r.flags), None)
        if shown:
            print(f"#   {labels[name]}: {' '.join(shown)}")
    print(f"# logs: {logdir}\n# total {time.perf_counter() - t_start:.0f}s")


def use_uvloop() -> str:
    try:
        import uvloop

        uvloop.install()
        return "uvloop"
    except ImportError:
        return "asyncio"


# ---------------------------------------------------------------------------------------------------
# Statistics and report


def pct(xs: Sequence[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def med(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float], fmt: str) -> str:
    xs = [x for x in xs if x == x]
    if len(xs) < 2:
        return ""
    return f" ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def cell(xs: Sequence[float], fmt: str) -> str:
    """A table cell: the median of several runs, then their range."""
    return f"{format(med(xs), fmt)}{spread(xs, fmt)}"


def ratio(a: float, b: float) -> str:
    if not b or a != a or b != b:
        return "n/a"
    return f"{a / b:.2f}x"


def logdir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=f"routerfleet-{prefix}-")


def table(rows: list[list[str]], header: list[str]) -> str:
    """A Markdown table with padded columns."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])
