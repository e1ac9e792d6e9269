"""The router's configuration and its command line. Bad values fail with one line naming the flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from .discovery.static import parse_worker
from .kv.plane import WorkerSpec


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    workers: tuple[WorkerSpec, ...] = field(default_factory=tuple)
    block_size: int = 16
    replay_idle_timeout_s: float = 1.0
    replay_timeout_s: float = 10.0
    queue_batches: int = 10_000
    queue_bytes: int = 256 << 20
    log_level: str = "info"


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _port(text: str) -> int:
    v = _positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"expected a port (1-65535), got {v}")
    return v


def _worker(text: str) -> WorkerSpec:
    try:
        return parse_worker(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="routerfleet-router",
        description="KV-cache-aware router: ingests engines' KV event streams into a radix index.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8080, help="public HTTP port (default 8080)")
    p.add_argument(
        "--worker",
        type=_worker,
        action="append",
        default=[],
        metavar="SPEC",
        help="a static engine: url=http://H:P[,kv=tcp://H:P][,replay=tcp://H:P][,dp=N][,topic=T]; repeat",
    )
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (default 16)")
    p.add_argument(
        "--replay-idle-timeout-ms",
        type=_positive_int,
        default=1000,
        help="silence that ends a gap replay (default 1000)",
    )
    p.add_argument(
        "--replay-timeout-ms",
        type=_positive_int,
        default=10_000,
        help="total bound on one gap replay (default 10000)",
    )
    p.add_argument(
        "--kv-queue-batches",
        type=_positive_int,
        default=10_000,
        help="batches the index writer may hold before a rank overflows (default 10000)",
    )
    p.add_argument(
        "--kv-queue-bytes",
        type=_positive_int,
        default=256 << 20,
        help="payload bytes the index writer may hold (default 256 MiB)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    a = build_parser().parse_args(argv)
    engines = [w.engine for w in a.worker]
    if len(set(engines)) != len(engines):
        build_parser().error("argument --worker: the same url is listed twice")
    return RouterConfig(
        host=a.host,
        port=a.port,
        workers=tuple(a.worker),
        block_size=a.block_size,
        replay_idle_timeout_s=a.replay_idle_timeout_ms / 1000,
        replay_timeout_s=a.replay_timeout_ms / 1000,
        queue_batches=a.kv_queue_batches,
        queue_bytes=a.kv_queue_bytes,
        log_level=a.log_level,
    )
