"""Prometheus metrics of one fake engine, read from its state at scrape time.

A custom collector on the engine's own registry (several engines share a test process, so the global
registry is out), which also means resident-block gauges can never drift from the cache.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router_runtime.kv.events import Dialect, Tier

if TYPE_CHECKING:
    from routerfleet_fake_engine.adapters import AdapterSlots
    from routerfleet_fake_engine.server import FakeEngine

_P = "routerfleet_fake_engine_"


class EngineCollector(Collector):
    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine
        self._lora_series: OrderedDict[tuple[str, str, str], float] = OrderedDict()

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        cfg = engine.config
        info = GaugeMetricFamily(
            _P + "info", "Fake engine identity", labels=["incarnation", "dialect", "model"]
        )
        info.add_metric([engine.incarnation, str(cfg.dialect), cfg.model], 1)
        yield info

        requests = CounterMetricFamily(
            _P + "requests", "Generation requests admitted", labels=["rank", "endpoint"]
        )
        prompt = CounterMetricFamily(_P + "prompt_tokens", "Prompt tokens admitted", labels=["rank"])
        cached = CounterMetricFamily(_P + "cached_tokens", "Prompt tokens served from cache", labels=["rank"])
        generated = CounterMetricFamily(_P + "generation_tokens", "Tokens generated", labels=["rank"])
        blocks = GaugeMetricFamily(_P + "blocks_resident", "Blocks resident", labels=["rank", "tier"])
        batches = CounterMetricFamily(
            _P + "kv_batches", "KV event batches sequenced (including dropped)", labels=["rank"]
        )
        events = CounterMetricFamily(_P + "kv_events", "KV events published", labels=["rank", "event"])
        replays = CounterMetricFamily(_P + "kv_replay_requests", "Replay requests served", labels=["rank"])
        legs = CounterMetricFamily(
            _P + "pd_legs", "Disaggregated requests served (transfer.py), by leg", labels=["rank", "leg"]
        )
        received = CounterMetricFamily(
            _P + "pd_received_blocks", "KV blocks decode legs pulled from a prefill engine", labels=["rank"]
        )
        cross = CounterMetricFamily(
            _P + "pd_cross_revision",
            "Decode legs refused: prefilled by an engine of another revision",
            labels=["rank"],
        )
        for rank, (stats, cache) in enumerate(zip(engine.rank_stats, engine.caches, strict=True)):
            r = str(rank)
            for endpoint, n in sorted(stats.requests.items()):
                requests.add_metric([r, str(endpoint)], n)
            prompt.add_metric([r], stats.prompt_tokens)
            cached.add_metric([r], stats.cached_tokens)
            generated.add_metric([r], stats.generation_tokens)
            legs.add_metric([r, "prefill"], stats.prefill_legs)
            legs.add_metric([r, "decode"], stats.decode_legs)
            received.add_metric([r], stats.received_blocks)
            cross.add_metric([r], stats.cross_revision)
            blocks.add_metric([r, "device"], cache.resident(Tier.DEVICE))
            blocks.add_metric([r, "host"], cache.resident(Tier.HOST))
            if cache.config.disk_capacity:
                blocks.add_metric([r, "disk"], cache.resident(Tier.DISK))
            if engine.publishing:
                pstats = engine.publisher.stats(rank)
                batches.add_metric([r], pstats.batches)
                replays.add_metric([r], pstats.replays)
                for name, n in sorted(pstats.events.items()):
                    events.add_metric([r, name], n)
        yield from (
            requests,
            prompt,
            cached,
            generated,
            blocks,
            batches,
            events,
            replays,
            legs,
            received,
            cross,
        )

        running = GaugeMetricFamily(_P + "requests_running", "Requests holding a running slot")
        running.add_metric([], engine.load.running)
        waiting = GaugeMetricFamily(_P + "requests_waiting", "Requests queued for a slot (--max-concurrency)")
        waiting.add_metric([], engine.load.waiting)
        yield from (running, waiting)
        yield from _engine_dialect(engine)
        if engine.adapters is not None:
            yield from self._adapters(engine.adapters, cfg.dialect)

    def _adapters(self, slots: AdapterSlots, dialect: Dialect) -> Iterator[Metric]:
        loads = CounterMetricFamily(_P + "lora_loads", "LoRA adapters loaded (not resident when asked for)")
        loads.add_metric([], slots.loads)
        yield loads
        if dialect is Dialect.SGLANG:
            return  # SGLang publishes no adapter residency
        # vLLM sets the current label set to the time of each step; the label sets it had before stay on
        # the page with their last time (a reader takes the newest). Kept here: the last 16.
        state = (str(slots.max_loras), ",".join(slots.waiting), ",".join(slots.running()))
        self._lora_series[state] = time.time()
        self._lora_series.move_to_end(state)
        while len(self._lora_series) > 16:
            self._lora_series.popitem(last=False)
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        for labels, at in self._lora_series.items():
            info.add_metric(list(labels), at)
        yield info


# The load series real engines export, per DP rank, under their own names and rank label, for routers
# that read engine load (fleet/engine_metrics.py) and dashboards: (running, waiting, KV usage, prompt
# tokens) names, and the rank label.
_DIALECT_NAMES = {
    "vllm": (
        (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens",
        ),
        "engine",
    ),
    "sglang": (
        ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:prompt_tokens"),
        "dp_rank",
    ),
}


def _engine_dialect(engine: FakeEngine) -> Iterator[Metric]:
    cfg = engine.config
    (n_run, n_wait, n_usage, n_prompt), rank_label = _DIALECT_NAMES[
        "sglang" if cfg.dialect is Dialect.SGLANG else "vllm"
    ]
    labels = ["model_name", rank_label]
    running = GaugeMetricFamily(n_run, "Requests running", labels=labels)
    waiting = GaugeMetricFamily(n_wait, "Requests waiting for a slot", labels=labels)
    usage = GaugeMetricFamily(n_usage, "Share of the device KV cache in use (0-1)", labels=labels)
    prompt = CounterMetricFamily(n_prompt, "Prompt tokens processed", labels=labels)
    for rank, (load, cache, stats) in enumerate(
        zip(engine.rank_load, engine.caches, engine.rank_stats, strict=True)
    ):
        lv = [cfg.model, str(rank)]
        running.add_metric(lv, load.running)
        waiting.add_metric(lv, load.waiting)
        usage.add_metric(lv, cache.resident(Tier.DEVICE) / cache.config.device_capacity)
        prompt.add_metric(lv, stats.prompt_tokens)
    yield from (running, waiting, usage, prompt)
