"""`make demo`: two fake engines and one router ingesting their KV event streams under a scripted
workload, printing live what the router's index knows per engine, rank and tier next to what each
engine really holds.

The engines speak two different real dialects (vLLM 0.33 with a host tier, SGLang with two DP ranks),
and the workload includes evictions, a lost batch (filled by replay) and an engine restart, so the
table shows the index following every kind of change. Exits non-zero if the two views disagree once
the workload has settled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp

from router_runtime.kv.decode import normalize_hash
from router_runtime.kv.hashing import hash_set_digest

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


async def main_async(seconds: float, clear: bool) -> int:
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


def main() -> None:
    ap = argparse.ArgumentParser(prog="make demo", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="how long the workload runs (default 15)")
    ap.add_argument("--no-clear", action="store_true", help="append frames instead of redrawing the screen")
    a = ap.parse_args()
    sys.exit(asyncio.run(main_async(a.seconds, clear=not a.no_clear and sys.stdout.isatty())))


if __name__ == "__main__":
    main()
