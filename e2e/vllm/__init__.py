"""Real vLLM engines, its CPU build serving the tiny model (install.sh, model.py), as processes: for the
real-engine tests (tests/e2e/test_vllm.py) and anything else that wants vLLM itself.

What a vLLM deployment needs for RouterFleet, and what these engines run with (docs/vllm.md):
- ``--kv-events-config`` with a wildcard endpoint (``tcp://*:PORT``): vLLM binds its PUB socket only
  when the endpoint has one, and with a plain address connects instead, so no router can subscribe. A
  wildcard binds every interface: run these where that is private (the e2e run's network namespace).
- a ``replay_endpoint`` (a late joiner catches up from it), ``--enable-prefix-caching``, and
  ``--enable-prompt-tokens-details`` (else no ``cached_tokens`` in the usage: nothing to audit);
- ``--block-size`` a multiple of 32 on CPU (its attention refuses 16), and the fleet's the same;
- ``VLLM_SERVER_DEV_MODE=1`` for ``/reset_prefix_cache``, ``VLLM_ENABLE_RESPONSES_API_STORE=1`` for
  stored responses (``previous_response_id``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only
MODEL = "tiny"  # the served model name
MAX_MODEL_LEN = 4096
TOPIC = "kv-events"  # the engines' KV event topic, and the fleet's
# The pods' named ports (engine_manifests) the fleet's engines section names (fleet_spec).
PORTS = {"http": 8000, "kv": 5557, "kv-replay": 5657}
START_TIMEOUT_S = 600  # a cold start compiles the model (~70 s alone on 2 cores, more side by side)

# The engines' environment: a small KV cache, no thread pinning and one OpenMP thread (two engines share
# 2 cores), no hub, and the dev-mode and Responses-store endpoints the tests use.
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
    "VLLM_ENABLE_RESPONSES_API_STORE": "1",  # previous_response_id
}


def server_argv(home: Path, host: str, port: int, kv_port: int, replay_port: int) -> list[str]:
    """vLLM's OpenAI server for the tiny model, with what RouterFleet needs (the module docstring)."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{kv_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": TOPIC,
    }
    return [
        str(home / "venv/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(home / "model"), "--served-model-name", MODEL,
        "--host", host, "--port", str(port),
        "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "bfloat16",
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(events),
    ]  # fmt: skip


def engine_manifests(home: Path, replicas: int = 2, name: str = "vllm") -> list[dict]:
    """A Deployment of vLLM engines and its Service, shaped like manifests/samples/engines/vllm.yaml, for
    the local cluster: its node agent runs a container's command, not its image, so the command is this
    install's Python. Each pod has its own network namespace: the wildcard binds stay inside it."""
    labels = {"app.kubernetes.io/name": name}
    ports = [{"name": name, "containerPort": port} for name, port in PORTS.items()]
    container = {
        "name": "vllm",
        "image": "vllm-cpu:local",  # never pulled: the node agent runs the command
        "command": server_argv(home, "0.0.0.0", *PORTS.values()),
        "env": [{"name": k, "value": v} for k, v in ENV.items()],
        "ports": ports,
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2},
    }
    template = {"metadata": {"labels": labels}, "spec": {"containers": [container]}}
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": template},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "selector": labels,
                "ports": [
                    {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports
                ],
            },
        },
    ]


def fleet_spec(image: str, name: str = "vllm") -> dict:
    """A RouterFleet spec's ``router`` and ``engines`` sections for ``engine_manifests``' engines: the
    engines' block size, tokens from their own ``/tokenize``, vLLM's chat rendering."""
    return {
        "router": {
            "image": image,
            "blockSize": BLOCK_SIZE,
            "tokenizer": {"source": "Engine"},
            "extraArgs": ["--chat-family=vllm", "--engine-header"],  # the demo and tests read who served
        },
        "engines": {
            "serviceName": name,
            "httpPort": "http",
            "kvPort": "kv",
            "replayPort": "kv-replay",
            "dpSize": 1,
            "topic": TOPIC,
        },
    }


def install() -> Path:
    """The install's directory (``venv/``, ``model/``), installing on first use (progress on stderr)."""
    out = subprocess.run(["bash", str(HERE / "install.sh")], stdout=subprocess.PIPE, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (bound together, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@dataclass
class VllmEngine:
    """One vLLM server process: its HTTP API on 127.0.0.1, its KV event sockets on every interface
    (reached at 127.0.0.1)."""

    name: str
    port: int
    kv_port: int
    replay_port: int
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def worker(self) -> str:
        """The router's ``--worker`` value for this engine."""
        return f"url={self.url},kv={self.kv},replay={self.replay}"

    def start(self, home: Path) -> None:
        argv = server_argv(home, "127.0.0.1", self.port, self.kv_port, self.replay_port)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, start_new_session=True
            )

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM to the server's process group (the API server and its engine core), SIGKILL after
        ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL the whole server, as an OOM kill or a node loss would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)


def start_engines(n: int, logdir: Path, home: Path | None = None) -> list[VllmEngine]:
    """``n`` engines started side by side, each answering /health (or RuntimeError with its log's tail).
    Progress on stderr: a cold start takes minutes."""
    home = home or install()
    ports = _free_ports(3 * n)
    engines = [VllmEngine(f"vllm-{i}", *ports[3 * i : 3 * i + 3], logdir / f"vllm-{i}.log") for i in range(n)]
    try:
        for e in engines:
            e.start(home)
        wait_ready(engines)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


def wait_ready(engines: list[VllmEngine], timeout: float = START_TIMEOUT_S) -> None:
    t0 = time.monotonic()
    waiting = list(engines)
    while waiting:
        for e in list(waiting):
            if not e.alive():
                raise RuntimeError(f"{e.name} exited ({e.proc.returncode}):\n{_tail(e.log)}")
            if e.ready():
                waiting.remove(e)
                print(f"[vllm] {e.name} ready after {time.monotonic() - t0:.0f}s", file=sys.stderr)
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{waiting[0].name} not ready after {timeout:.0f}s:\n{_tail(waiting[0].log)}")
        time.sleep(1)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
