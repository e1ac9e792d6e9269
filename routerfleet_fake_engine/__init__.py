"""A deterministic fake vLLM/SGLang engine for tests, the demo and benchmarks.

It serves an OpenAI-compatible HTTP API and publishes real-wire KV events (any ``Dialect``) over ZMQ
PUB with a replay ROUTER per data-parallel rank, from a simulated prefix cache.

Layout (functional core, imperative shell):

- ``hashing``: engine block hashes per dialect (SGLang's and vLLM 0.33's real sha256 chains). Pure.
- ``cache``: per-rank prefix cache (device + optional host tier, LRU) returning KV events. Pure.
- ``openai_api``: request parsing/validation and response shapes. Pure.
- ``config``: ``FakeEngineConfig``.
- ``publisher``: ZMQ PUB + replay ROUTER per rank, sequencing and replay buffers.
- ``server``: ``FakeEngine`` (aiohttp app) and ``run_fake_engine``, the in-process helper for tests.
- ``admin``: the ``/admin/*`` endpoints that drive events deterministically.
- ``metrics``: the Prometheus collector.
- ``cli``: the ``routerfleet-fake-engine`` console script.
"""

from routerfleet_fake_engine.config import FakeEngineConfig
from routerfleet_fake_engine.server import FakeEngine, run_fake_engine

__all__ = ["FakeEngine", "FakeEngineConfig", "run_fake_engine"]
