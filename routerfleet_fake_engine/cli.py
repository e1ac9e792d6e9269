"""``routerfleet-fake-engine``: run one fake vLLM/SGLang engine until SIGTERM/SIGINT.

Bad flag values are argparse errors (one line naming the flag, exit 2). Logs go to stderr and never
contain prompts, token IDs or hashes. On startup one INFO line reports the URL, dialect and the actual
ZMQ port bases (useful with port 0, which picks free ports).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

import zmq

from router_runtime.flags import Count, Real
from router_runtime.kv.events import Dialect
from routerfleet_fake_engine.config import (
    DEFAULT_KV_PORT,
    DEFAULT_REPLAY_PORT,
    ConfigError,
    FakeEngineConfig,
)
from routerfleet_fake_engine.server import FakeEngine

log = logging.getLogger("routerfleet_fake_engine")


def build_parser() -> argparse.ArgumentParser:
    d = FakeEngineConfig()
    p = argparse.ArgumentParser(
        prog="routerfleet-fake-engine",
        description="A deterministic fake vLLM/SGLang engine: OpenAI HTTP API plus real-wire ZMQ KV events.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    port = Count(0, 65535).parse
    p.add_argument("--host", default="0.0.0.0", help="bind host for HTTP and ZMQ (0.0.0.0 binds ZMQ on *)")
    p.add_argument("--port", type=port, default=8000, help="HTTP port (0 = ephemeral)")
    p.add_argument("--kv-port", type=port, default=DEFAULT_KV_PORT, help="PUB base port; rank r uses base+r")
    p.add_argument("--replay-port", type=port, default=DEFAULT_REPLAY_PORT, help="replay ROUTER base port")
    p.add_argument("--dp-size", type=Count(1, 256).parse, default=d.dp_size, help="data-parallel ranks")
    p.add_argument("--block-size", type=Count(1).parse, default=d.block_size, help="tokens per block")
    p.add_argument(
        "--capacity-blocks", type=Count(1).parse, default=d.capacity_blocks, help="device blocks per rank"
    )
    p.add_argument(
        "--host-capacity-blocks",
        type=Count(0).parse,
        default=d.host_capacity_blocks,
        help="host-tier blocks per rank (0 = no host tier)",
    )
    p.add_argument(
        "--storage-dir",
        default=None,
        help="directory of the disk tier (kept across restarts, with a storage identity marker)",
    )
    p.add_argument(
        "--disk-capacity-blocks",
        type=Count(0).parse,
        default=d.disk_capacity_blocks,
        help="disk-tier blocks per rank (needs --storage-dir; 0 = no disk tier)",
    )
    p.add_argument("--dialect", choices=[x.value for x in Dialect], default=d.dialect.value)
    p.add_argument("--topic", default=d.topic, help="ZMQ topic (default empty, like vLLM)")
    p.add_argument(
        "--replay-buffer", type=Count(1).parse, default=d.replay_buffer, help="batches kept for replay"
    )
    p.add_argument(
        "--prefill-us-per-token",
        type=Real(0).parse,
        default=d.prefill_us_per_token,
        help="simulated prefill time per uncached prompt token",
    )
    p.add_argument(
        "--decode-tokens-per-s",
        type=Real(0).parse,
        default=d.decode_tokens_per_s,
        help="simulated decode rate (0 = instant)",
    )
    p.add_argument(
        "--max-concurrency",
        type=Count(0).parse,
        default=d.max_concurrency,
        help="requests running at once; the rest queue (0 = unlimited)",
    )
    p.add_argument(
        "--shared-compute",
        action="store_true",
        help="a rank's prefills run one at a time, and its decodes wait while one runs (one accelerator's"
        " steps); default: every request computes alone",
    )
    p.add_argument(
        "--kv-transfer",
        action="store_true",
        help="serve disaggregated prefill as vLLM with a KV connector does: a request's kv_transfer_params"
        " make it a prefill or a decode leg",
    )
    p.add_argument(
        "--pd-sidecar",
        action="store_true",
        help="play llm-d's routing sidecar in front of this decode engine (vLLM's flow, with --kv-transfer):"
        " a request with x-prefiller-host-port is prefilled on that engine first",
    )
    p.add_argument(
        "--transfer-us-per-block",
        type=Real(0).parse,
        default=d.transfer_us_per_block,
        help="simulated time a decode leg takes per KV block it pulls from the prefill engine",
    )
    p.add_argument(
        "--disaggregation-mode",
        choices=("prefill", "decode"),
        default=None,
        help="SGLang's disaggregated serving: a request with a bootstrap room is this leg (the decode leg"
        " waits for the room on the prefill engine, then pulls the blocks it lacks)",
    )
    p.add_argument(
        "--revision",
        default=d.revision,
        help="this engine's revision (model and KV layout): a disaggregated decode leg prefilled by an engine"
        " of another revision is refused (HTTP 500), as a KV connector refuses an incompatible peer",
    )
    p.add_argument(
        "--max-loras",
        type=Count(0).parse,
        default=d.max_loras,
        help="LoRA adapters resident at once, least recently used out; a request's adapter loads first"
        " (0 = adapters cost nothing)",
    )
    p.add_argument(
        "--lora-load-ms",
        type=Real(0).parse,
        default=d.lora_load_ms,
        help="simulated time to load an adapter that is not resident",
    )
    p.add_argument(
        "--lora-modules",
        type=lambda v: tuple(n for n in v.split(",") if n),
        default=d.lora_modules,
        help="adapter names served, comma-separated, as vLLM's --lora-modules: a request whose model names"
        " one runs in its KV namespace",
    )
    p.add_argument(
        "--max-model-len",
        type=Count(1).parse,
        default=d.max_model_len,
        help=f"prompt + max_tokens must fit in this many tokens, as in vLLM (default {d.max_model_len})",
    )
    p.add_argument("--model", default=d.model, help="model name served")
    p.add_argument(
        "--cache-generated",
        action="store_true",
        help="also cache the full blocks of prompt+output when a request finishes (like a real engine)",
    )
    p.add_argument(
        "--publish-delay-ms",
        type=Real(0).parse,
        default=d.publish_delay_ms,
        help="announce a request's stored blocks this long after its admission (a real engine announces"
        " them once computed)",
    )
    p.add_argument(
        "--lazy-clear",
        action="store_true",
        help="announce a prefix-cache reset only with the next step's events, as vLLM does",
    )
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> FakeEngineConfig:
    return FakeEngineConfig(
        host=args.host,
        port=args.port,
        kv_port=args.kv_port,
        replay_port=args.replay_port,
        dp_size=args.dp_size,
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        host_capacity_blocks=args.host_capacity_blocks,
        storage_dir=args.storage_dir,
        disk_capacity_blocks=args.disk_capacity_blocks,
        dialect=Dialect(args.dialect),
        topic=args.topic,
        replay_buffer=args.replay_buffer,
        prefill_us_per_token=args.prefill_us_per_token,
        decode_tokens_per_s=args.decode_tokens_per_s,
        max_concurrency=args.max_concurrency,
        shared_compute=args.shared_compute,
        kv_transfer=args.kv_transfer,
        transfer_us_per_block=args.transfer_us_per_block,
        pd_sidecar=args.pd_sidecar,
        disaggregation_mode=args.disaggregation_mode or "",
        revision=args.revision,
        max_loras=args.max_loras,
        lora_load_ms=args.lora_load_ms,
        lora_modules=args.lora_modules,
        max_model_len=args.max_model_len,
        model=args.model,
        cache_generated=args.cache_generated,
        publish_delay_ms=args.publish_delay_ms,
        lazy_clear=args.lazy_clear,
    )


async def serve(config: FakeEngineConfig) -> None:
    """Run until SIGTERM or SIGINT, then close HTTP and ZMQ sockets."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = FakeEngine(config)
    await engine.start()
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        await engine.stop()
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(args)
    try:
        config.validate()  # cross-flag checks (overlapping port ranges)
    except ConfigError as e:
        parser.error(f"argument --{e.field.replace('_', '-')}: {e.message.replace('_', '-')}")
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(config))
    except (OSError, zmq.ZMQError) as e:
        log.error("cannot start: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
