"""Disaggregation's configuration section (``RouterConfig.disaggregation``) and its flags. They matter
only when discovery finds prefill engines (``role=prefill``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..flags import Count, Flag, Ms, Text


class Protocol(enum.StrEnum):
    """How the engines disaggregate (docs/disaggregation.md)."""

    VLLM = "vllm"  # a prefill leg, then the decode leg with its kv_transfer_params (vllm.py)
    SGLANG = "sglang"  # both legs at once, paired by a bootstrap room (sglang.py)


@dataclass(frozen=True, slots=True)
class DisaggregationConfig:
    protocol: Protocol = Protocol.VLLM
    # A decode engine missing fewer prompt tokens than this prefills them itself (docs/disaggregation.md:
    # a transfer costs a round trip and the prefill engine's queue; a short suffix costs less locally).
    threshold_tokens: int = 512
    prefill_timeout_s: float = 60.0  # one prefill leg, from dispatch to its whole answer

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0:
            raise ValueError("threshold_tokens must be >= 0")
        if not self.prefill_timeout_s > 0:
            raise ValueError("prefill_timeout_s must be positive")


FLAGS = (
    Flag(
        "--pd-protocol",
        "disaggregation.protocol",
        Text(Protocol, choices=tuple(Protocol)),
        "the engines' disaggregation protocol: vllm (a KV connector's kv_transfer_params) or sglang (a"
        " bootstrap room; decode engines cannot prefill, so every request is prefilled remotely)",
    ),
    Flag(
        "--pd-threshold-tokens",
        "disaggregation.threshold_tokens",
        Count(0),
        "a decode engine missing fewer prompt tokens than this (by the index) prefills them itself; at or"
        " above it, a prefill engine does (0: always remote)",
    ),
    Flag(
        "--pd-prefill-timeout-ms",
        "disaggregation.prefill_timeout_s",
        Ms(1),
        "one remote prefill's deadline; past it (or on a failure) another prefill engine is asked once,"
        " then the decode engine prefills itself",
    ),
)
