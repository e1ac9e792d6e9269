"""The shapes a decision is made of and reported in: a target, the request as the scheduler sees it, the
decision and its reason."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..worker import Carrier


class Kind(enum.StrEnum):
    """The API a request came in on (the proxy's paths; an endpoint picker reads it from the path)."""

    COMPLETION = "completion"
    CHAT = "chat"
    RESPONSES = "responses"  # OpenAI's Responses API: rendered as chat (tokens/shapes.py)
    MESSAGES = "messages"  # Anthropic's Messages API: rendered as chat
    GENERATE = "generate"  # SGLang's native /generate: ``text`` or ``input_ids``, as a completion's prompt
    TOKEN_GENERATE = "token_generate"  # vLLM's /inference/v1/generate: ``token_ids``


@dataclass(frozen=True, slots=True, order=True)
class Target:
    """Where a request can go: one engine, optionally pinned to one DP rank (sent to the engine as the
    ``X-Data-Parallel-Rank`` header). KV-aware routing targets (engine, rank) pairs, since each rank
    has its own cache; other policies may target whole engines (``rank=None``)."""

    engine: str
    url: str
    rank: int | None = None

    @property
    def carrier(self) -> Carrier:
        return Carrier(self.engine, self.rank or 0)

    @property
    def endpoint(self) -> str:
        """``host:port`` of the engine's URL, as a gateway names endpoints (an IPv6 host in brackets)."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class RouteRequest:
    tokens: Sequence[int] | None = None  # token IDs for KV matching (None: not tokenized)
    text: str | None = None  # the prompt text (chat: the rendered template) for text-prefix policies
    lora_name: str | None = None
    cache_salt: str | None = None
    # The first prompt position whose logprob the request asks for (None: none): the engine computes it,
    # so reuses no cached KV from there on (reuse.py).
    logprobs_from: int | None = None
    # A returning session's remembered target (one of the targets, moved to their front): the policy
    # prefers it unless its load guard says otherwise (docs/sessions.md, "The promotion rule").
    prefer: Target | None = None
    # ``prefer`` kept everything since it served the session's last turn (no eviction seen there since):
    # kv_aware may credit it the request's whole prefix, beyond what the index shows.
    prefer_vouched: bool = False
    # Where the request must go (the engine holding the stored response it continues): not a choice.
    pinned: Target | None = None
    # The endpoints (``Target.endpoint``) a gateway allows for this request; None: any.
    subset: frozenset[str] | None = None


class Reason(enum.StrEnum):
    """Why a target was chosen; a metric label."""

    PREFIX = "prefix"  # the best cached prefix won
    NO_MATCH = "no_match"  # nothing useful cached: least loaded (or smallest tree)
    IMBALANCED = "imbalanced"  # the imbalance guard switched to least loaded
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"
    POWER_OF_TWO = "power_of_two"
    SESSION = "session"  # a returning session's remembered target, which the policy alone would not pick
    INFLIGHT = "inflight"  # a prefix this router just sent there, not yet stored (a fan-out's copies)
    RESPONSE = "response"  # the engine holding the stored response the request continues (not a choice)


@dataclass(frozen=True, slots=True)
class Candidate:
    """How one candidate stood when a decision was made (only when asked: a trace explains it)."""

    target: Target
    load: float  # the fleet's in-flight requests there
    cost: float | None  # the scorers' summed cost, in blocks (None: no scorer spoke)
    matched_blocks: int = 0
    tier_blocks: tuple[int, int, int, int] = (0, 0, 0, 0)  # device, host, disk, external


@dataclass(frozen=True, slots=True)
class Decision:
    target: Target
    reason: Reason
    matched_blocks: int = 0  # the chosen target's matched prefix (KV policies)
    total_blocks: int = 0  # full blocks in the request
    tier_blocks: tuple[int, int, int, int] = (0, 0, 0, 0)  # of matched_blocks: device, host, disk, external
    # matched / total characters for text-prefix routing
    matched_chars: int = 0
    total_chars: int = 0
    # Blocks of the prefix predicted there by a request just sent (beyond matched_blocks): not stored yet.
    inflight_blocks: int = 0
    # Every candidate the picker weighed, with ``Profile.choose(..., explain=True)``; else empty.
    candidates: tuple[Candidate, ...] = ()


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a request in flight on ``carrier`` will have stored there (``inflight_prefix.py``; siblings
    exchange these): the index's chained keys of its prompt's blocks ``start``, ``start + 1``, ..."""

    carrier: Carrier
    start: int
    keys: Sequence[int]


@dataclass(frozen=True, slots=True)
class Adapters:
    """The engine's LoRA adapters as it reports them (vLLM's ``vllm:lora_requests_info``): those with
    requests running or waiting are resident (or about to be), out of ``max_loras`` slots."""

    max_loras: int
    running: frozenset[str]
    waiting: frozenset[str]

    @property
    def active(self) -> frozenset[str]:
        return self.running | self.waiting


@dataclass(frozen=True, slots=True)
class Shared:
    """What a replica's plugins tell its siblings with each load report (``fleet/gossip.py``), each
    plugin its own part: predictions of requests in flight (``inflight_prefix.py``), and the LoRA
    adapters sent to each engine lately, newest last (``lora_affinity.py``)."""

    predictions: tuple[Prediction, ...] = ()
    adapters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
