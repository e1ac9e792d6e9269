"""The router's command line: the request-plane flags map onto RouterConfig, every policy tunable has
a flag, bad values fail with one line naming the flag, and the real process serves requests."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import sys

import aiohttp
import pytest

from router_runtime.config import FLAGS, RouterConfig, parse_args
from router_runtime.proxy.config import Timeouts
from router_runtime.proxy.health import BreakerConfig, HealthConfig
from router_runtime.scheduling.presets import PolicyConfig
from routerfleet_fake_engine.server import run_fake_engine

from .support import eventually, free_port
from .test_tokens_hf import build_tokenizer_dir


def test_defaults_keep_the_existing_behaviour_and_add_the_request_plane():
    c = parse_args([])
    assert c == RouterConfig()
    assert c.scheduling.policy == "kv_aware" and c.scheduling.tuning == PolicyConfig()
    assert c.tokens.tokenizer == "bytes" and c.proxy.max_body_bytes == 32 << 20
    assert c.health.interval_s == 5 and c.health.breaker.failures == 3


def test_every_policy_tunable_has_a_flag():
    """A PolicyConfig field without a Flag could only be set in code; each one is declared in FLAGS."""
    declared = {flag.path for _title, flags in FLAGS for flag in flags}
    tunables = {f"scheduling.tuning.{f.name}" for f in dataclasses.fields(PolicyConfig)}
    assert tunables - declared == set()


def test_every_flag_sets_a_field_of_its_section():
    """Each flag's path names a RouterConfig field, or a field of one of its sections (nested configs in
    turn); no two flags set the same field."""
    paths = [flag.path for _title, flags in FLAGS for flag in flags]
    assert len(paths) == len(set(paths))
    for path in paths:
        config: object = RouterConfig
        *sections, name = path.split(".")
        for section in sections:
            assert dataclasses.is_dataclass(config), path
            config = {f.name: f for f in dataclasses.fields(config)}[section].default_factory
        assert name in {f.name for f in dataclasses.fields(config)}, path


def test_flags_map_onto_the_config(tmp_path):
    build_tokenizer_dir(tmp_path / "tok")
    c = parse_args(
        [
            "--port", "9000",
            "--worker", "url=http://e1:8000,kv=tcp://e1:5557,dp=2",
            "--block-size", "32",
            "--policy", "power_of_two",
            "--balance-abs-threshold", "8",
            "--balance-rel-threshold", "2.5",
            "--host-weight", "0.75",
            "--load-cost-tokens", "128",
            "--no-spread-ties",
            "--cache-threshold", "0.5",
            "--max-tree-size", "1000",
            "--seed", "7",
            "--tokenizer", str(tmp_path / "tok"),
            "--tokenizer-threads", "2",
            "--connect-timeout-ms", "250",
            "--first-byte-timeout-ms", "1500",
            "--total-timeout-ms", "60000",
            "--idle-timeout-ms", "2000",
            "--upstream-keepalive-ms", "1000",
            "--max-body-bytes", "1024",
            "--health-interval-ms", "0",
            "--health-timeout-ms", "300",
            "--breaker-failures", "5",
            "--breaker-cooldown-ms", "0",
        ]
    )  # fmt: skip
    assert (c.port, c.kv.block_size, c.workers[0].dp_size) == (9000, 32, 2)
    assert c.scheduling.policy == "power_of_two"
    assert c.scheduling.tuning == PolicyConfig(
        balance_abs_threshold=8,
        balance_rel_threshold=2.5,
        host_weight=0.75,
        load_cost_tokens=128.0,
        spread_ties=False,
        cache_threshold=0.5,
        max_tree_size=1000,
        seed=7,
    )
    assert c.tokens.tokenizer == str(tmp_path / "tok") and c.tokens.threads == 2
    assert c.proxy.timeouts == Timeouts(connect_s=0.25, first_byte_s=1.5, total_s=60, idle_s=2)
    assert (c.proxy.upstream_keepalive_s, c.proxy.max_body_bytes) == (1, 1024)
    assert c.health == HealthConfig(
        interval_s=0, timeout_s=0.3, breaker=BreakerConfig(failures=5, cooldown_s=0)
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--policy", "fastest"], "--policy"),
        (["--host-weight", "1.5"], "--host-weight"),
        (["--balance-rel-threshold", "0.5"], "--balance-rel-threshold"),
        (["--balance-abs-threshold", "x"], "--balance-abs-threshold"),
        (["--cache-threshold", "nan"], "--cache-threshold"),
        (["--tokenizer", "/no/such/dir"], "--tokenizer"),
        (["--chat-template", "/no/such/file.jinja"], "--chat-template"),
        (["--chat-family", "tgi"], "--chat-family"),
        (["--connect-timeout-ms", "0"], "--connect-timeout-ms"),
        (["--max-body-bytes", "-5"], "--max-body-bytes"),
        (["--health-interval-ms", "-1"], "--health-interval-ms"),
        (["--breaker-failures", "0"], "--breaker-failures"),
        (["--breaker-cooldown-ms", "soon"], "--breaker-cooldown-ms"),
        (["--worker", "url=http://a", "--worker", "url=http://a"], "--worker"),
        (["--worker", "url=http://h:abc"], "--worker"),
        (["--worker", "url=http://h:99999"], "--worker"),
        (["--worker", "url=http://user:secret@h:8000"], "--worker"),  # an engine id shows everywhere
        (["--worker", "url=http://h:8000,kv=tcp://h:99999"], "--worker"),
        (["--epp-pool", "pool"], "--epp-pool"),  # no picker
        (["--epp-port", "0", "--epp-pool", "pool", "--engine-load-interval-ms", "0"], "--epp-pool"),
        (["--epp-saturation-kv-usage", "1.5"], "--epp-saturation-kv-usage"),
        (["--port", "9090"], "--metrics-port"),  # the metrics port's default
    ],
)
def test_bad_flags_fail_with_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"routerfleet-router: error: argument {flag}"), err[-1]


def test_a_body_budget_below_one_body_fails_with_one_line_naming_both_flags(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--body-budget-bytes", "1000"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("routerfleet-router: error: proxy: --body-budget-bytes must be 0"), last
    assert "--max-body-bytes" in last


def test_a_tenant_cache_salt_without_a_tenant_header_fails_with_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--tenant-cache-salt"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "routerfleet-router: error: proxy: --tenant-cache-salt needs --tenant-header" + (
        " (whose tenant is it?)"
    )


@pytest.mark.parametrize("name", ["X Tenant", "X-Tenant:", "X-T\u00e9nant"])
def test_a_tenant_header_that_is_no_header_name_fails_with_one_line(capsys, name):
    """No request carries such a header: every request would be one tenant, isolation silently gone."""
    with pytest.raises(SystemExit):
        parse_args(["--tenant-header", name, "--tenant-cache-salt"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("routerfleet-router: error: proxy: --tenant-header") and "header name" in last, (
        last
    )


def test_two_listeners_on_one_port_fail_with_one_line_naming_both(capsys, tmp_path):
    token = tmp_path / "token"
    token.write_text("t")
    for argv, flag, other in (
        (
            ["--port", "18731", "--internal-port", "18731", "--internal-token-file", str(token)],
            "--internal-port",
            "--port",
        ),
        (["--port", "18731", "--epp-port", "18731"], "--epp-port", "--port"),
        (
            ["--metrics-port", "9099", "--epp-port", "9002", "--epp-health-port", "9099"],
            "--epp-health-port",
            "--metrics-port",
        ),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--worker", "url=http://127.0.0.1:1", *argv])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"routerfleet-router: error: argument {flag}: the same port as {other}"), last
    # The internal port is off without a token: its number is free for another.
    parse_args(["--worker", "url=http://127.0.0.1:1", "--metrics-port", "8081"])
    # Every address and one of them: one port (the bind would fail).
    with pytest.raises(SystemExit):
        parse_args(
            [
                "--worker",
                "url=http://127.0.0.1:1",
                "--host",
                "127.0.0.1",
                "--metrics-host",
                "0.0.0.0",
                "--metrics-port",
                "8080",
            ]
        )
    assert "argument --metrics-port: the same port as --port" in capsys.readouterr().err
    # On two different addresses, one number is two listeners.
    parse_args(
        ["--worker", "url=http://127.0.0.1:1", "--metrics-host", "127.0.0.2", "--metrics-port", "8080"]
    )


def test_engine_reads_that_age_out_before_the_next_fail_with_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--worker", "url=http://127.0.0.1:1", "--engine-load-interval-ms", "5000"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("routerfleet-router: error: argument --engine-load-max-age-ms: must exceed"), last
    parse_args(
        [
            "--worker",
            "url=http://127.0.0.1:1",
            "--engine-load-interval-ms",
            "5000",
            "--engine-load-max-age-ms",
            "8000",
        ]
    )


async def start_router(engine, *flags: str) -> tuple[asyncio.subprocess.Process, str, str]:
    """``routerfleet-router`` in front of ``engine``, as a process; (the process, its URL, its metrics
    port's URL)."""
    port, metrics = free_port(), free_port()
    worker = f"url={engine.http_url},kv={engine.kv_endpoint(0)},replay={engine.replay_endpoint(0)}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router_runtime.cli", "--port", str(port), "--metrics-port", str(metrics),
        "--worker", worker, *flags,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}"


async def until_readyz(s: aiohttp.ClientSession, proc, url: str, want: int) -> None:
    """Poll /readyz until it answers ``want`` (an async ``eventually``)."""

    async def status() -> int:
        try:
            async with s.get(url + "/readyz") as r:
                return r.status
        except aiohttp.ClientConnectionError:
            return 0

    async def poll() -> None:
        while await status() != want:
            assert proc.returncode is None, "the router exited"
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), 20)


async def test_the_router_process_serves_requests():
    async with run_fake_engine(block_size=16) as engine:
        proc, url, metrics = await start_router(
            engine, "--health-interval-ms", "100", "--shutdown-drain-ms", "0"
        )
        try:
            async with aiohttp.ClientSession() as s:
                await until_readyz(s, proc, url, 200)
                async with s.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}) as r:
                    # a client learns nothing of the engines' addresses
                    assert r.status == 200 and "X-RouterFleet-Engine" not in r.headers
                    assert len((await r.json())["choices"][0]["text"]) == 3
                for page in ("/metrics", "/debug/index", "/debug/load"):  # on the metrics port alone
                    async with s.get(url + page) as r:
                        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found", page
                    async with s.get(metrics + page) as r:
                        assert r.status == 200, page
                        text = await r.text()
                assert engine.http_url in text  # /debug/load names the engines
                async with s.get(metrics + "/metrics") as r:
                    text = await r.text()
                    assert (
                        'routerfleet_requests_total{outcome="ok",policy="kv_aware",status="200"} 1.0' in text
                    )
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, stderr.decode()[-2000:]
        log = stderr.decode()
        assert "policy kv_aware" in log and "hello" not in log  # never log prompts


async def test_sigterm_drains_while_requests_still_arrive_then_stops_by_itself():
    """On SIGTERM the router stays up at least --shutdown-drain-ms, and longer while requests still arrive
    (a gateway whose xDS lags, a client that has not moved off): /readyz says it is shutting down, each
    request is still served, with Connection: close (no idle keep-alive connection for the final close
    to catch a client's next request on); once nothing has arrived for a second it exits 0 by itself,
    and says what arrived while it drained."""
    async with run_fake_engine(block_size=16) as engine:
        proc, url, _metrics = await start_router(
            engine, "--shutdown-drain-ms", "500", "--shutdown-drain-max-ms", "30000"
        )
        try:
            async with aiohttp.ClientSession() as s:
                await until_readyz(s, proc, url, 200)
                async with s.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}) as r:
                    assert r.status == 200 and "close" not in r.headers.get("Connection", "").lower()
                proc.send_signal(signal.SIGTERM)
                await until_readyz(s, proc, url, 503)
                async with s.get(url + "/readyz") as r:
                    assert (await r.json())["reason"] == "shutting down"
                loop = asyncio.get_running_loop()
                t0, sent = loop.time(), 0
                while loop.time() - t0 < 3:  # six times the minimum drain, a request every 0.3 s
                    async with s.post(url + "/v1/completions", json={"prompt": "b", "max_tokens": 1}) as r:
                        assert r.status == 200 and r.headers["Connection"].lower() == "close"
                    sent += 1
                    await asyncio.sleep(0.3)
                _, stderr = await asyncio.wait_for(proc.communicate(), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        log = stderr.decode()
        assert proc.returncode == 0, log[-2000:]
        said = r"drained ([\d.]+)s: (\d+) requests and 0 picks arrived, the last ([\d.]+)s in"
        summary = re.search(said, log)
        assert summary is not None, log[-2000:]
        took, requests, last = float(summary[1]), int(summary[2]), float(summary[3])
        assert requests == sent and last > 2 and took >= last + 0.9, log[-2000:]  # 4x past the minimum


async def test_a_second_sigterm_ends_the_drain():
    async with run_fake_engine(block_size=16) as engine:
        proc, url, _metrics = await start_router(engine, "--shutdown-drain-ms", "30000")
        try:
            async with aiohttp.ClientSession() as s:
                await until_readyz(s, proc, url, 200)
                proc.send_signal(signal.SIGTERM)
                await until_readyz(s, proc, url, 503)
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, stderr.decode()[-2000:]
        assert "0 requests and 0 picks arrived" in stderr.decode()


GRACE_MARGIN_S = 5.0  # what a loaded node may add between the kubelet's SIGTERM and the process's exit


async def test_sigterm_under_load_exits_within_the_pods_grace_period():
    """SIGTERM with streams in flight that would outlast any grace period (an engine decoding 5 tokens
    a second, 2000 asked for each): the router, with the flags the operator renders (the defaults),
    exits 0 before the grace period the operator gives its pods runs out, with a margin. It drains,
    then gives what is still in flight --shutdown-timeout-ms and cuts it, then stops, each bounded;
    aiohttp's own wait for requests in flight (a minute) ended in the kubelet's SIGKILL."""
    from routerfleet_operator.render import render_pod_template
    from routerfleet_operator.spec import Fleet

    from .operator.helpers import fleet_obj

    grace = render_pod_template(Fleet.parse(fleet_obj()))["spec"]["terminationGracePeriodSeconds"]
    streaming = 0

    async def stream(s: aiohttp.ClientSession, url: str) -> None:
        nonlocal streaming
        body = {"prompt": "a long answer", "max_tokens": 2000, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()
            streaming += 1
            async for _line in r.content:  # until the router cuts it
                pass

    async with run_fake_engine(block_size=16, decode_tokens_per_s=5) as engine:
        proc, url, _metrics = await start_router(engine)
        try:
            async with aiohttp.ClientSession() as s:
                await until_readyz(s, proc, url, 200)
                streams = [asyncio.create_task(stream(s, url)) for _ in range(8)]
                await eventually(lambda: streaming == 8, timeout=20, what="8 streams in flight")
                proc.send_signal(signal.SIGTERM)
                t0 = asyncio.get_running_loop().time()
                _, stderr = await asyncio.wait_for(proc.communicate(), grace + 30)
                took = asyncio.get_running_loop().time() - t0
                await asyncio.gather(*streams, return_exceptions=True)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, stderr.decode()[-2000:]
    assert took < grace - GRACE_MARGIN_S, f"exited {took:.1f}s after SIGTERM; the pod's grace is {grace}s"


def test_client_connection_flags_reach_the_server_limits():
    from router_runtime.config import parse_args
    from router_runtime.proxy.serving import ServerLimits

    base = ["--worker", "url=http://127.0.0.1:1"]
    assert parse_args(base).server == ServerLimits()
    c = parse_args(
        [
            *base,
            "--client-header-timeout-ms=2500",
            "--client-idle-timeout-ms=7000",
            "--client-body-base-timeout-ms=3000",
            "--client-body-min-rate=1024",
            "--max-connections=9",
        ]
    )
    assert c.server == ServerLimits(2.5, 7.0, 9, 1024, 3.0)
    assert c.server.body_timeout_s(2048, 1 << 20) == 5.0
    assert c.server.body_timeout_s(None, 4096) == 7.0  # chunked: as long as the largest allowed body
