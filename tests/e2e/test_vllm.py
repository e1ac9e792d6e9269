"""RouterFleet on real vLLM (issue 36): two vLLM engines (the CPU build serving a tiny Qwen3 model made at
setup, e2e/vllm) behind routers started as a user would (``--tokenizer`` the model's directory,
``--chat-family vllm``), and every request's prediction held to vLLM's own ``cached_tokens``.

    .venv/bin/python -m e2e.cluster pytest tests/e2e/test_vllm.py

The engines bind their KV event sockets on every interface (vLLM binds only a wildcard endpoint), so
these tests run only in the e2e run's private network namespace. Two engines start once for the module
(a minute or two: vLLM compiles the model on start). Between requests a test waits until every router's
view of the engines' streams has been quiet for a moment, so a prediction is made on the blocks the
previous request stored (a missed hit from a late event would be a flaky test, not a routing fault).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import test_operator
from test_operator import FLEET, GROUP, PLURAL, VERSION, _local_only, wait_fleet_ready

from e2e.cluster import in_private_netns
from e2e.fleet import ROUTER_PORT, apply, get, metrics_url, parse_metrics, pod_url
from e2e.vllm import (
    BLOCK_SIZE,
    MODEL,
    VllmEngine,
    engine_manifests,
    fleet_spec,
    install,
    start_engines,
    wait_ready,
)
from router_runtime.tokens.tokenizer import Family, load_tokenizer
from tests.support import free_port
from tests.test_chat_vectors import VLLM as CHAT_VECTORS
from tests.test_chat_vectors import router_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
crd = test_operator.crd  # the fixtures: the CRD applied, and the operator as a subprocess
operator = test_operator.operator

TOKEN = secrets.token_hex(16)  # the fleet token: the prediction header is answered to it alone
DEBUG_HEADER = "X-RouterFleet-Debug-Prediction"
PREDICTED = "X-RouterFleet-Predicted-Cached-Tokens"
QUIET_S = 0.3  # a router's streams unchanged this long: the last request's events are in
GROUPS = 4  # system prompts shared by the conversations


@pytest.fixture(scope="module")
def home() -> Path:
    if not in_private_netns():
        pytest.fail(
            "vLLM binds its KV event socket on every interface: run in a private network namespace, "
            "python -m e2e.cluster pytest tests/e2e/test_vllm.py"
        )
    return install()


@pytest.fixture(scope="module")
def engines(home, tmp_path_factory) -> Iterator[list[VllmEngine]]:
    engines = start_engines(2, tmp_path_factory.mktemp("vllm"), home)
    yield engines
    for e in engines:
        e.stop()


@dataclass
class Router:
    url: str
    internal: str
    metrics: str  # the metrics port: /metrics, /debug/*
    proc: subprocess.Popen | None = None  # None: a router pod (the operator's)
    token: str = TOKEN  # the fleet token, which the prediction header must carry


@contextlib.contextmanager
def routers(
    home: Path, engines: list[VllmEngine], tmp: Path, n: int = 1, *extra: str
) -> Iterator[list[Router]]:
    """``n`` routers in front of ``engines``, each knowing the others as static peers (the fleet token),
    all ready (/readyz) before this yields."""
    tmp.mkdir(parents=True, exist_ok=True)
    token = tmp / "token"
    token.write_text(TOKEN)
    ports = [(free_port(), free_port(), free_port()) for _ in range(n)]
    out: list[Router] = []
    try:
        for i, (port, internal, metrics) in enumerate(ports):
            argv = [
                sys.executable, "-m", "router_runtime.cli", "--host", "127.0.0.1", "--port", str(port),
                "--internal-port", str(internal), "--internal-token-file", str(token),
                "--metrics-port", str(metrics), "--engine-header",
                "--block-size", str(BLOCK_SIZE), "--tokenizer", str(home / "model"), "--chat-family", "vllm",
                "--debug-prediction", "--log-level", "info",
                *(a for e in engines for a in ("--worker", e.worker)),
                *(a for j, (_, peer, _) in enumerate(ports) if j != i for a in ("--kv-peer", f"http://127.0.0.1:{peer}")),
                *extra,
            ]  # fmt: skip
            log = open(tmp / f"router-{i}.log", "ab")  # noqa: SIM115 (closed with the process)
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )
            log.close()
            local = "http://127.0.0.1"
            out.append(Router(f"{local}:{port}", f"{local}:{internal}", f"{local}:{metrics}", proc))
        asyncio.run(_until_ready(out))
        yield out
    finally:
        for r in out:
            r.proc.terminate()
        for r in out:
            try:
                r.proc.wait(20)
            except subprocess.TimeoutExpired:
                r.proc.kill()


async def _until_ready(rs: list[Router], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        for r in rs:
            while True:
                assert r.proc.poll() is None, f"router {r.url} exited"
                with contextlib.suppress(aiohttp.ClientError):
                    if (await get(s, r.url + "/readyz"))[0] == 200:
                        break
                assert time.monotonic() < deadline, f"router {r.url} not ready in {timeout:.0f}s"
                await asyncio.sleep(0.1)


async def _quiet(s: aiohttp.ClientSession, rs: list[Router], timeout: float = 10) -> None:
    """Until every router's stream cursors have stood still for QUIET_S."""

    async def cursors():
        out = []
        for r in rs:
            _, index = await get(s, r.metrics + "/debug/index")
            out.append(sorted((x["engine"], x["rank"], x["cursor"]) for x in index["subscriptions"]))
        return out

    deadline = time.monotonic() + timeout
    last, since = await cursors(), time.monotonic()
    while time.monotonic() - since < QUIET_S:
        assert time.monotonic() < deadline, "the routers' KV streams never went quiet"
        await asyncio.sleep(0.05)
        now = await cursors()
        if now != last:
            last, since = now, time.monotonic()


@dataclass
class Outcome:
    what: str
    engine: str
    predicted: int | None
    cached: int | None
    prompt: int = 0
    doubtful: bool = False

    @property
    def false_hit(self) -> bool:
        """Predicted beyond what vLLM had cached, in no doubt: the one thing a router must never do."""
        return (
            self.predicted is not None
            and self.cached is not None
            and self.predicted > self.cached
            and not self.doubtful
        )


def _cached(usage: dict | None) -> int | None:
    """vLLM's cached prompt tokens in any API's usage."""
    if not usage:
        return None
    if "cache_read_input_tokens" in usage:  # Anthropic Messages
        return usage["cache_read_input_tokens"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return details.get("cached_tokens")


async def _send(
    s: aiohttp.ClientSession, router: Router, path: str, body: dict, what: str, headers: dict | None = None
) -> tuple[Outcome, dict]:
    """One request with the prediction header asked for; (its outcome, the final body or last chunk)."""
    headers = {DEBUG_HEADER: router.token, **(headers or {})}
    async with s.post(router.url + path, json=body, headers=headers) as r:
        assert r.status == 200, (what, r.status, await r.text())
        predicted = r.headers.get(PREDICTED)
        doubtful = r.headers.get("X-RouterFleet-Prediction-Doubtful") == "true"
        engine = r.headers.get("X-RouterFleet-Engine", "")
        if not body.get("stream"):
            answer = await r.json()
            usage = answer.get("usage")
        else:
            usage, answer, text = None, {}, []
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or ():
                    text.append((c.get("delta") or {}).get("content") or c.get("text") or "")
            answer = {"text": "".join(text)}
    prompt = (usage or {}).get("prompt_tokens") or 0
    outcome = Outcome(
        what, engine, None if predicted is None else int(predicted), _cached(usage), prompt, doubtful
    )
    return outcome, answer


def _system(group: int) -> str:
    return f"You are assistant {group} of the fleet. " + " ".join(
        f"rule {group}.{i}: be exact." for i in range(40)
    )


async def _chats(s, rs: list[Router], conversations: int, turns: int, seed: int) -> list[Outcome]:
    """Multi-turn chats in GROUPS system-prompt groups, streamed and not in turn, each request through
    the next router."""
    rng, out, k = random.Random(seed), [], 0
    for c in range(conversations):
        messages = [{"role": "system", "content": _system(c % GROUPS)}]
        for t in range(turns):
            messages.append(
                {"role": "user", "content": f"Question {seed}.{c}.{t}: " + "why " * rng.randrange(4, 30)}
            )
            body = {"model": MODEL, "messages": messages, "max_tokens": 6, "stream": t % 2 == 1}
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            outcome, answer = await _send(s, rs[k % len(rs)], "/v1/chat/completions", body, f"chat {c}.{t}")
            k += 1
            out.append(outcome)
            text = answer["text"] if body["stream"] else answer["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": text})
            await _quiet(s, rs)
    return out


async def _completions(s, rs: list[Router], seed: int) -> list[Outcome]:
    """Completions by token IDs and by text, each sent twice: block-aligned prompts (the second time
    wholly cached, which vLLM reuses but for the last token's block), unaligned ones, and prompts asking
    for prompt logprobs, directly or by echo (which vLLM reads no cache for)."""
    rng, out = random.Random(seed), []
    prompts: list[tuple[str, object, dict]] = [
        (f"ids x{n}", [rng.randrange(100, 100_000) for _ in range(n)], {})
        for n in (2 * BLOCK_SIZE, 3 * BLOCK_SIZE + 5)
    ]
    prompts.append(("text", f"Once upon a time {seed} " + "and then " * 40, {}))
    prompts.append(
        (
            "prompt_logprobs",
            [rng.randrange(100, 100_000) for _ in range(2 * BLOCK_SIZE + 3)],
            {"prompt_logprobs": 1},
        )
    )
    prompts.append(
        (
            "echo logprobs",
            [rng.randrange(100, 100_000) for _ in range(BLOCK_SIZE + 2)],
            {"echo": True, "logprobs": 1},
        )
    )
    for i, (what, prompt, extra) in enumerate(prompts):
        for rep in range(2):
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 4,
                "stream": rep == 1 and not extra,
                **extra,
            }
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            outcome, _ = await _send(
                s, rs[(i + rep) % len(rs)], "/v1/completions", body, f"completion {what} #{rep}"
            )
            out.append(outcome)
            await _quiet(s, rs)
    return out


async def _false_hit_tokens(s, rs: list[Router]) -> float:
    total = 0.0
    for r in rs:
        async with s.get(r.metrics + "/metrics") as resp:
            m = parse_metrics(await resp.text())
        total += sum(v for k, v in m.items() if k.startswith("routerfleet_audit_false_hit_tokens_total"))
    return total


def _mismatches(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.predicted != o.cached or o.cached is None]


# The router's vllm chat family is vLLM 0.33's (tests/data/chat); the CPU build here is 0.32, which
# differs from it in these shapes of the chat vectors.
NOT_0_32 = {
    "reasoning_content_on_tool_turn": "0.33 renders an assistant tool-call turn's reasoning; 0.32 does not",
    "reasoning_effort_none": "0.33 turns reasoning_effort none into enable_thinking false; 0.32 does not",
}


def _run(coro_fn, *args):
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            return await coro_fn(s, *args)

    return asyncio.run(go())


async def _traffic(s, rs: list[Router], seed: int) -> list[Outcome]:
    return [*await _chats(s, rs, conversations=6, turns=3, seed=seed), *await _completions(s, rs, seed)]


def test_every_prediction_equals_vllms_cached_tokens(home, engines, tmp_path):
    """One router, then three (each request through the next): every prediction is vLLM's own figure,
    hits included, and the audit counts no false-hit token."""
    for n, seed in ((1, 1), (3, 2)):
        with routers(home, engines, tmp_path / f"{n}", n) as rs:
            outcomes = _run(_traffic, rs, seed)
            assert not _mismatches(outcomes), _mismatches(outcomes)
            assert sum(o.cached for o in outcomes) > 0, "nothing was cached: the test would prove nothing"
            assert len({o.engine for o in outcomes}) == len(engines), "one engine took every request"
            assert _run(_false_hit_tokens, rs) == 0


def test_tenant_cache_salts_part_vllms_cache_and_the_prediction_follows(home, engines, tmp_path):
    """--tenant-cache-salt on real vLLM: a second tenant's copy of a prompt is computed anew (vLLM's own
    figure), a client's own salt parts its requests within its tenant, and every prediction, hits
    included, is vLLM's figure: the router reads vLLM's salt out of its events' extra keys."""
    tenancy = ("--tenant-header", "Authorization", "--tenant-cache-salt")
    prompt = [random.Random(7).randrange(100, 100_000) for _ in range(3 * BLOCK_SIZE + 5)]

    async def traffic(s, rs: list[Router]) -> list[Outcome]:
        out = []
        for key, own in (("alice", None), ("bob", None), ("alice", "per-user")):
            for rep in range(2):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                if own:
                    body["cache_salt"] = own
                auth = {"Authorization": f"Bearer {key}"}
                what = f"{key}/{own} #{rep}"
                out.append((await _send(s, rs[0], "/v1/completions", body, what, auth))[0])
                await _quiet(s, rs)
        return out

    with routers(home, engines, tmp_path, 1, *tenancy) as rs:
        outcomes = _run(traffic, rs)
    assert not _mismatches(outcomes), _mismatches(outcomes)
    cached = [o.cached for o in outcomes]
    assert cached[0::2] == [0, 0, 0] and all(c >= 3 * BLOCK_SIZE for c in cached[1::2]), outcomes


def test_a_late_joiner_predicts_from_vllms_replay(home, engines, tmp_path):
    """A router started after the engines served learns what they hold from vLLM's own replay: the same
    completions sent again through it are predicted warm at once, and exactly (wholly cached ones too)."""
    with routers(home, engines, tmp_path / "early") as rs:
        first = _run(_completions, rs, 3)
    assert not _mismatches(first), _mismatches(first)
    with routers(home, engines, tmp_path / "late") as rs:
        again = _run(_completions, rs, 3)
    assert not _mismatches(again), _mismatches(again)
    # The first send of each prompt, now through a router that served none of them: warm from the replay
    # (but the prompt asking for prompt logprobs, which vLLM serves cold whatever it holds).
    firsts = again[0::2]
    assert all(o.predicted > 0 for o in firsts if "logprobs" not in o.what), firsts


def test_a_cache_reset_clears_the_routers_view(home, engines, tmp_path):
    """vLLM's /reset_prefix_cache (dev mode). Through the fleet (``POST /internal/flush_cache``) the
    routers clear the engines' blocks as the engines reset: the request that hit before is predicted
    cold, as vLLM serves it. Sent to an engine directly, vLLM announces the reset only with its next
    step's events (docs/kv-plane.md): that first request is a false hit, counted by the audit, and the
    rank is withheld; the next is exact again."""
    rng = random.Random(4)
    bodies = [
        {
            "model": MODEL,
            "prompt": [rng.randrange(100, 100_000) for _ in range(3 * BLOCK_SIZE + 1)],
            "max_tokens": 2,
        }
        for _ in range(2)
    ]

    async def warm(s, rs, body) -> Outcome:
        await _send(s, rs[0], "/v1/completions", body, "first")
        await _quiet(s, rs)
        hit, _ = await _send(s, rs[0], "/v1/completions", body, "hit")
        await _quiet(s, rs)
        return hit

    async def flushed(s, rs):
        hit = await warm(s, rs, bodies[0])
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with s.post(rs[0].internal + "/internal/flush_cache", json={}, headers=auth) as r:
            assert r.status == 200, await r.text()
        cold, _ = await _send(s, rs[0], "/v1/completions", bodies[0], "after the flush")
        return hit, cold

    async def direct(s, rs):
        hit = await warm(s, rs, bodies[1])
        for e in engines:
            async with s.post(e.url + "/reset_prefix_cache") as r:
                assert r.status == 200, await r.text()
        unannounced, _ = await _send(s, rs[0], "/v1/completions", bodies[1], "after the direct reset")
        await _quiet(s, rs)
        after, _ = await _send(s, rs[0], "/v1/completions", bodies[1], "the next")
        return hit, unannounced, after

    with routers(home, engines, tmp_path) as rs:
        hit, cold = _run(flushed, rs)
        assert hit.predicted == hit.cached == 3 * BLOCK_SIZE, hit
        assert cold.predicted == cold.cached == 0, cold
        assert _run(_false_hit_tokens, rs) == 0
        hit, unannounced, after = _run(direct, rs)
        assert hit.predicted == hit.cached == 3 * BLOCK_SIZE, hit
        assert (unannounced.predicted, unannounced.cached) == (3 * BLOCK_SIZE, 0), unannounced
        assert _run(_false_hit_tokens, rs) == 3 * BLOCK_SIZE  # seen, and said
        assert after.predicted == after.cached, after


def test_responses_and_messages_on_vllm(home, engines, tmp_path):
    """The Responses API (a stored response continued by id) and an Anthropic Messages request through
    the router, on vLLM itself: answered, predicted exactly."""

    async def go(s, rs):
        r = rs[0]
        system = _system(9)
        out = []
        for turn in range(2):
            body = {
                "model": MODEL,
                "max_tokens": 4,
                "system": system,
                "messages": [{"role": "user", "content": f"hi {turn}"}],
            }
            o, answer = await _send(s, r, "/v1/messages", body, f"messages {turn}")
            assert answer["type"] == "message", answer
            out.append(o)
            await _quiet(s, rs)
        first, answer = await _send(
            s,
            r,
            "/v1/responses",
            {"model": MODEL, "input": system, "max_output_tokens": 4, "store": True},
            "response",
        )
        out.append(first)
        await _quiet(s, rs)
        body = {
            "model": MODEL,
            "input": "and then?",
            "previous_response_id": answer["id"],
            "max_output_tokens": 4,
        }
        async with s.post(r.url + "/v1/responses", json=body) as resp:
            follow = await resp.json()
            assert resp.status == 200, follow
            assert follow["previous_response_id"] == answer["id"], follow
            assert resp.headers["X-RouterFleet-Engine"] == first.engine  # where the stored response lives
        return out

    with routers(home, engines, tmp_path) as rs:
        outcomes = _run(go, rs)
        assert not _mismatches(outcomes), outcomes
        assert outcomes[1].cached > 0, outcomes  # the second Messages request hit the system prompt


def test_the_router_renders_chats_as_vllm_does(home, engines):
    """Every chat shape of the vLLM vectors (roles, names, content parts, tools and tool calls, reasoning
    fields, template kwargs) tokenized by the router from the model's directory, as a user would run it,
    equals what vLLM itself makes of it (its /tokenize), but the shapes 0.32 renders as 0.33 did not."""
    tokenizer = load_tokenizer(str(home / "model"), Family.VLLM, None)
    vectors = [v for v in CHAT_VECTORS if v["tokenizer"] == "qwen3" and "token_ids" in v]

    async def go(s):
        differ = []
        for v in vectors:
            async with s.post(engines[0].url + "/tokenize", json={"model": MODEL, **v["request"]}) as r:
                assert r.status == 200, (v["case"], await r.text())
                engine = (await r.json())["tokens"]
            if await router_ids(tokenizer, v["request"]) != engine:
                differ.append(v["case"])
        return differ

    assert len(vectors) > 60
    assert sorted(_run(go)) == sorted(NOT_0_32)


def test_a_killed_engine_is_never_a_false_hit_and_comes_back(home, engines, tmp_path):
    """An engine killed (SIGKILL, as an OOM kill would) and restarted on the same ports, empty: no request
    is predicted on the blocks it held, none fails while it is gone, and once back it takes requests
    again, predicted exactly."""
    victim = engines[1]
    rng = random.Random(6)

    def body() -> dict:
        return {
            "model": MODEL,
            "prompt": [rng.randrange(100, 100_000) for _ in range(2 * BLOCK_SIZE + 1)],
            "max_tokens": 2,
        }

    async def warm_on_victim(s, rs) -> list[dict]:
        held = []
        while len(held) < 2:  # prompts the victim served, then hit
            b = body()
            first, _ = await _send(s, rs[0], "/v1/completions", b, "warm")
            await _quiet(s, rs)
            if first.engine == victim.url:
                hit, _ = await _send(s, rs[0], "/v1/completions", b, "hit")
                assert hit.engine == victim.url and hit.predicted == hit.cached == 2 * BLOCK_SIZE, hit
                held.append(b)
                await _quiet(s, rs)
        return held

    async def send_all(s, rs, bodies, what) -> list[Outcome]:
        out = []
        for b in bodies:
            out.append((await _send(s, rs[0], "/v1/completions", b, what))[0])
            await _quiet(s, rs)
        return out

    with routers(home, engines, tmp_path) as rs:
        held = _run(warm_on_victim, rs)
        victim.kill()
        gone = _run(send_all, rs, held, "while gone")
        assert all(o.engine != victim.url for o in gone), gone
        victim.start(home)
        wait_ready([victim])
        back = _run(send_all, rs, [*held, *(body() for _ in range(8))], "back")
        # The router takes it back within a health check (5 s) and its stream's return: fresh prompts
        # until one goes there, bounded.
        deadline = time.monotonic() + 30
        while not any(o.engine == victim.url for o in back) and time.monotonic() < deadline:
            back += _run(send_all, rs, [body()], "back, later")
            time.sleep(0.5)
        assert not _mismatches([*gone, *back]), _mismatches([*gone, *back])
        assert any(o.engine == victim.url for o in back), "the restarted engine never took a request"
        assert _run(_false_hit_tokens, rs) == 0


# ------------------------------------------------------------------------------------------ the cluster

ENGINE_PODS = "app.kubernetes.io/name=vllm"


class Chats:
    """Chats through the fleet's Ready router pods from a thread, each outcome tagged with the phase
    the test is in; a request to a router going away is counted, not raised."""

    def __init__(self, cluster, ns: str) -> None:
        self.cluster, self.ns = cluster, ns
        secret = cluster.core.read_namespaced_secret(f"{FLEET}-internal-token", ns)
        self.token = base64.b64decode(secret.data["token"]).decode()
        self.phase, self.outcomes, self.failed = "before", [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def routers(self) -> list[Router]:
        pods = self.cluster.core.list_namespaced_pod(
            self.ns, label_selector=f"routerfleet.io/fleet={FLEET}"
        ).items
        ready = [p for p in pods if self.cluster.pod_ready(p) and p.metadata.deletion_timestamp is None]
        urls = [pod_url(p, ROUTER_PORT) for p in ready]
        return [Router(u, "", metrics_url(u), token=self.token) for u in urls]

    def _run(self) -> None:
        seed = 100
        while not self.stop.is_set():
            seed += 1
            phase = self.phase
            try:  # small rounds: a round's requests are counted in the phase it began in
                out = _run(_chats, self.routers(), 2, 3, seed)
                self.outcomes += [(phase, o) for o in out]
            except Exception:  # a router going away mid-round, an API hiccup: counted, and on
                self.failed += 1
                time.sleep(0.5)

    def hit_rate(self, phase: str) -> float:
        """The engines' cached share of the prompt tokens of the requests of ``phase`` (from vLLM's usage);
        conversations within a phase reuse its system prompts, so a warm fleet hits from the start."""
        mine = [o for p, o in self.outcomes if p == phase and o.cached is not None]
        return sum(o.cached for o in mine) / max(1, sum(o.prompt for o in mine))

    def __enter__(self) -> Chats:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(300)


def test_an_operator_managed_fleet_over_vllm_pods(cluster, namespace, crd, operator, home):
    """vLLM engines as pods of the local cluster (the node agent runs the install's server), a
    RouterFleet over them (block size 32, tokens from the engines' /tokenize), under chats: a rollout
    with bootstrap (every new replica seeded exact before it serves), then one without (cold), hit
    rate before, during and after each (printed); no request predicted beyond vLLM's figure in no
    doubt, anywhere in the fleet."""
    _local_only(cluster)
    ns = namespace
    apply(cluster.api, ns, engine_manifests(home))
    cluster.wait_pods_ready(ns, ENGINE_PODS, 2, timeout=600)
    fleet = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RouterFleet",
        "metadata": {"name": FLEET, "namespace": ns},
        "spec": {
            "replicas": 2,
            **fleet_spec(getattr(cluster.provider, "image", "routerfleet:dev")),
            "bootstrap": {"timeout": "30s"},
        },
    }
    fleet["spec"]["router"]["extraArgs"].append("--debug-prediction")
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet)
    wait_fleet_ready(cluster, crd, ns, "the fleet Ready over vLLM pods", timeout=300)

    def roll(phase: str, spec: dict, generation: int) -> list[dict]:
        chats.phase = phase
        crd.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET, {"spec": spec})

        def rolled():
            o = crd.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET)
            r = next((c for c in o.get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})
            return o if r.get("status") == "True" and r.get("observedGeneration") == generation else None

        obj = cluster.wait_for(f"the {phase} rollout done", rolled, 300)
        return obj["status"]["members"]

    with Chats(cluster, ns) as chats:
        time.sleep(30)
        env = [{"name": "ROUTERFLEET_E2E_ROLL", "value": "1"}]
        warm = roll("rollout, bootstrap on", {"router": {"env": env}}, 2)
        chats.phase = "after, bootstrap on"
        time.sleep(30)
        env = [{"name": "ROUTERFLEET_E2E_ROLL", "value": "2"}]
        cold = roll("rollout, bootstrap off", {"router": {"env": env}, "bootstrap": {"enabled": False}}, 3)
        chats.phase = "after, bootstrap off"
        time.sleep(30)
    phases = dict.fromkeys(p for p, _ in chats.outcomes)
    rates = {p: round(chats.hit_rate(p), 3) for p in phases}
    print(f"\n[vllm fleet] hit rate by phase: {rates}; failed chat rounds {chats.failed}")
    verdicts = {"on": [m["verdict"] for m in warm], "off": [m["verdict"] for m in cold]}
    print(f"[vllm fleet] verdicts by bootstrap: {verdicts}")
    # seeded exact: from a sibling (warm) or, while the engines' replay buffers reach back to their first
    # event, rebuilt from vLLM's own replay (from_origin)
    assert all(m["verdict"] in ("warm", "from_origin") for m in warm), warm
    assert all(m["verdict"] != "warm" for m in cold), cold
    assert all(chats.hit_rate(p) > 0 for p in phases), rates
    false_hits = [o for _, o in chats.outcomes if o.false_hit]
    assert not false_hits and len(chats.outcomes) > 50, (false_hits, len(chats.outcomes))
