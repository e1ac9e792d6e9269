"""The objects of manifests/base and the HTTP views of a deployed fleet, shared by the in-cluster demo
(e2e/demo.py) and tests/e2e/test_router_in_cluster.py.

    docs = load_manifests(image="routerfleet:e2e", token=secrets.token_hex(16))
    apply(api_client, namespace, docs)

Everything here that talks HTTP does so at pod IPs (the local cluster's pods are reachable from the
process that runs it; kind's are not).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from router_runtime.kv.decode import normalize_hash
from router_runtime.kv.hashing import hash_set_digest

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests" / "base"

# Names in manifests/base.
ENGINE = "fake-engine"
ROUTER = "router"
PEERS = "router-peers"
TOKEN_SECRET = "routerfleet-fleet-token"
ROUTER_SA = "routerfleet-router"
ROUTER_ROLE = "routerfleet-router"
ENGINE_LABELS = "app.kubernetes.io/name=fake-engine"
ROUTER_LABELS = "app.kubernetes.io/name=routerfleet-router"
ROUTER_PORT, INTERNAL_PORT, METRICS_PORT, ENGINE_PORT = 8080, 8081, 9090, 8000
# The routers the tests deploy name the engine that served each answer (X-RouterFleet-Engine): the
# tests read where requests went. Off by default: it tells clients internal addresses.
ENGINE_HEADER_ARG = "--engine-header"
BLOCK = 16
TIERS = ("device", "host", "disk", "external")


# ------------------------------------------------------------------------------------------ manifests


def load_manifests(
    path: Path = MANIFESTS, *, image: str | None = None, token: str | None = None
) -> list[dict]:
    """The objects of the kustomization at ``path``, in its resources' order. ``image`` replaces every
    container's image; ``token`` the fleet token's placeholder. The router names the engine that served
    (ENGINE_HEADER_ARG)."""
    kust = yaml.safe_load((path / "kustomization.yaml").read_text())
    docs = [d for f in kust["resources"] for d in yaml.safe_load_all((path / f).read_text()) if d]
    for d in docs:
        if image and d["kind"] == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                c["image"] = image
        if d["kind"] == "Deployment" and d["metadata"]["name"] == ROUTER:
            d["spec"]["template"]["spec"]["containers"][0]["args"].append(ENGINE_HEADER_ARG)
        if token and d["kind"] == "Secret" and d["metadata"]["name"] == TOKEN_SECRET:
            d["stringData"] = {"token": token}
    return docs


def find(docs: Iterable[dict], kind: str, name: str) -> dict:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise KeyError(f"{kind}/{name} not in the manifests")


def router_args(docs: Iterable[dict], name: str = ROUTER) -> list[str]:
    return find(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]["args"]


def policy_variant(docs: Iterable[dict], name: str, policy: str) -> list[dict]:
    """A second router Deployment (``name``, its own labels, no Service of the fleet's selecting it)
    with ``--policy policy``. Peer bootstrap and the token only make sense for kv_aware: dropped."""
    dep = copy.deepcopy(find(docs, "Deployment", ROUTER))
    dep["metadata"]["name"] = name
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "routerfleet"}
    dep["metadata"]["labels"] = dict(labels)
    dep["spec"]["selector"] = {"matchLabels": {"app.kubernetes.io/name": name}}
    pod = dep["spec"]["template"]
    pod["metadata"]["labels"] = dict(labels)
    c = pod["spec"]["containers"][0]
    drop = ("--internal-", "--kv-peer", "--kv-bootstrap", "--policy")
    c["args"] = [a for a in c["args"] if not a.startswith(drop)] + [f"--policy={policy}"]
    c["ports"] = [p for p in c["ports"] if p["name"] != "internal"]
    c.pop("volumeMounts", None)
    pod["spec"].pop("volumes", None)
    return [dep]


def apply(api_client, namespace: str, docs: Iterable[dict]) -> None:
    """Create every object in ``namespace`` (a fresh one: create, not apply)."""
    from kubernetes import utils

    for d in docs:
        utils.create_from_dict(api_client, copy.deepcopy(d), namespace=namespace)


# ------------------------------------------------------------------------------------------ HTTP views


def pod_url(pod, port: int) -> str:
    return f"http://{pod.status.pod_ip}:{port}"


def metrics_url(router: str) -> str:
    """The metrics port (/metrics, /debug/*) of the in-cluster router whose public URL is ``router``."""
    base, port = router.rsplit(":", 1)
    assert int(port) == ROUTER_PORT, f"{router} is not a router pod's public URL"
    return f"{base}:{METRICS_PORT}"


def engine_id(pod) -> str:
    """The router's name for an engine discovered from EndpointSlices: <namespace>/<pod name>."""
    return f"{pod.metadata.namespace}/{pod.metadata.name}"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels as printed)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and (m := _SAMPLE.match(line)):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def aio(fn, *args, **kw):
    """Run ``fn(session, *args, **kw)`` (a coroutine function) to completion on a fresh session: for
    synchronous tests that talk HTTP between Kubernetes calls."""

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            return await fn(s, *args, **kw)

    return asyncio.run(go())


async def get(session: aiohttp.ClientSession, url: str, **kw) -> tuple[int, Any]:
    """(status, JSON body or text) of a GET."""
    async with session.get(url, **kw) as r:
        body = await r.read()
    try:
        return r.status, json.loads(body)
    except ValueError:
        return r.status, body.decode(errors="replace")


async def load_idle(session: aiohttp.ClientSession, routers: list[str], timeout: float = 5.0) -> None:
    """Wait until every replica's fleet load view is idle (docs/fleet-load.md): the replicas share
    their load, so a probe through one right after probes through another would rightly see them."""
    deadline = time.monotonic() + timeout
    while True:
        views = [(await get(session, metrics_url(r) + "/debug/load"))[1] for r in routers]
        if all(t["load"] == 0 for v in views for t in v["targets"]):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the fleet's load view never went idle: {views}")
        await asyncio.sleep(0.05)


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """``base``/metrics, parsed (a router's: ``metrics_url(router)``; the operator's: its port)."""
    async with session.get(base + "/metrics") as r:
        return parse_metrics(await r.text())


async def bootstrap_report(session: aiohttp.ClientSession, internal: str, token: str) -> dict:
    status, body = await get(
        session, internal + "/internal/bootstrap", headers={"Authorization": f"Bearer {token}"}
    )
    if status != 200:
        raise AssertionError(f"{internal}/internal/bootstrap: {status} {body}")
    return body


async def index_view(session: aiohttp.ClientSession, router: str) -> dict[tuple[str, int, str], tuple]:
    """{(engine, rank, tier): (blocks, digest)} of what a router's /debug/index routes on: carriers of
    engines that left are kept hidden for re-adoption during the grace window and are skipped (so is
    the node count, which includes their nodes)."""
    _, index = await get(session, metrics_url(router) + "/debug/index")
    view: dict[tuple[str, int, str], tuple] = {}
    for c in index["carriers"]:
        if c.get("state", "ok") != "ok":
            continue
        for tier, t in c["tiers"].items():
            if t["blocks"]:
                view[(c["engine"], c["rank"], tier)] = (t["blocks"], t["digest"])
    return view


async def engines_view(
    session: aiohttp.ClientSession, engines: dict[str, str]
) -> dict[tuple[str, int, str], tuple]:
    """The same view from the engines' own /admin/state (``engines``: engine id -> base URL)."""
    view = {}
    for eid, url in engines.items():
        _, state = await get(session, url + "/admin/state")
        for rank in state["ranks"]:
            for tier, hashes in rank["blocks"].items():
                if hashes:
                    truth = {normalize_hash(h) for h in hashes}
                    view[(eid, rank["rank"], tier)] = (len(truth), hash_set_digest(truth))
    return view


def index_diff(index: dict, truth: dict) -> list[str]:
    """What a router's index view gets wrong against the engines' (node count ignored)."""
    out = []
    for k in sorted(k for k in index.keys() | truth.keys() if k[0] != "nodes"):
        ours, theirs = index.get(k, (0, "")), truth.get(k, (0, ""))
        if ours != theirs:
            same = " (same count, digest differs)" if ours[0] == theirs[0] else ""
            out.append(f"{k[0]} rank {k[1]} {k[2]}: index {ours[0]} blocks, engine {theirs[0]}{same}")
    return out


# ------------------------------------------------------------------------------------------ requests


async def completion(
    session: aiohttp.ClientSession, router: str, tokens: list[int], max_tokens: int = 4, **extra
) -> tuple[int, str | None, dict]:
    """POST /v1/completions with a token-ID prompt: (status, X-RouterFleet-Engine, body)."""
    body = {"prompt": tokens, "max_tokens": max_tokens, **extra}
    async with session.post(router + "/v1/completions", json=body) as r:
        out = await r.json(content_type=None)
        return r.status, r.headers.get("X-RouterFleet-Engine"), out


def chat_body(messages: list[dict], max_tokens: int = 16, model: str | None = None) -> dict:
    """A streamed chat completion that asks for usage (engines stream it only when asked); ``model``
    when the path needs one (the reference picker refuses a body without it)."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return body if model is None else {"model": model, **body}


@dataclass
class StreamedChat:
    """What a streamed chat (or text) completion carried, read to its end."""

    text: str = ""
    usage: dict = field(default_factory=dict)
    done: bool = False  # it ended with [DONE] (else it was cut)
    first_content: float | None = None  # time.monotonic() of the first content chunk
    # An OpenAI-style error event in the stream: the engine failed after its 200 (vLLM does when its
    # engine core stops under a request), then [DONE].
    error: dict | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.usage.get("prompt_tokens", 0)

    @property
    def cached_tokens(self) -> int:
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def read_chat_stream(r: aiohttp.ClientResponse) -> StreamedChat:
    out, text = StreamedChat(), []
    async for raw in r.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            out.done = True
            break
        chunk = json.loads(data)
        if isinstance(chunk.get("error"), dict):
            out.error = chunk["error"]
        for choice in chunk.get("choices") or []:
            if piece := (choice.get("delta") or {}).get("content") or choice.get("text"):
                if out.first_content is None:
                    out.first_content = time.monotonic()
                text.append(piece)
        out.usage = chunk.get("usage") or out.usage
    out.text = "".join(text)
    return out


async def chat_turn(
    session: aiohttp.ClientSession,
    router: str,
    messages: list[dict],
    max_tokens: int = 16,
    model: str | None = None,
) -> tuple[float, str, int, int]:
    """One streamed chat completion: (TTFT seconds, answer text, prompt tokens, cached tokens). TTFT is
    to the first content chunk; usage comes with the last chunk."""
    t0 = time.monotonic()
    async with session.post(
        router + "/v1/chat/completions", json=chat_body(messages, max_tokens, model)
    ) as r:
        if r.status != 200:
            raise AssertionError(f"chat via {router}: {r.status} {(await r.text())[:300]}")
        chat = await read_chat_stream(r)
    if chat.error is not None:
        raise AssertionError(f"chat via {router}: an error in the stream: {chat.error}")
    first = chat.first_content if chat.first_content is not None else time.monotonic()
    return first - t0, chat.text, chat.prompt_tokens, chat.cached_tokens


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]
