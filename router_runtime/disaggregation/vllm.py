"""vLLM's disaggregated prefill on the wire (pure): the two requests a router makes, as vLLM's own
example proxy makes them, and the one vetting of the prefill engine's answer.

    prefill leg:  the client's body, non-streaming, one output token, with
                  ``kv_transfer_params: {"do_remote_decode": true, ...}`` -> the prefill engine
                  its answer's ``kv_transfer_params`` say where the KV is (engine id, block ids, host,
                  port: whatever its KV connector needs)
    decode leg:   the client's body with those ``kv_transfer_params`` -> the decode engine, which pulls
                  the KV it lacks and generates; its answer goes to the client

Both legs carry the same ``X-Request-Id``. Only completions and chat completions take
``kv_transfer_params``. A client's own ``kv_transfer_params`` never reaches an engine of a
disaggregated fleet: it would tell a decode engine where to pull KV from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..proxy.rewrite import encode, with_member, without_member
from ..scheduling.types import Kind

PARAMS = "kv_transfer_params"
KINDS = frozenset({Kind.COMPLETION, Kind.CHAT})

# What the prefill leg asks for: the KV computed and held for a remote decode.
_ASK = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields a one-token prefill cannot honour (vLLM's example proxy drops them from the prefill leg).
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
MAX_PARAMS_BYTES = 64 << 10  # a connector's parameters: block ids and an address, never the prompt


@dataclass(frozen=True, slots=True)
class TransferParams:
    """A prefill engine's ``kv_transfer_params``, vetted: a JSON object that says the decode engine
    prefills remotely. Opaque beyond that (each KV connector has its own fields); passed on as it came."""

    value: dict[str, Any]


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill leg's body for a client's ``body``."""
    leg = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    leg[PARAMS] = dict(_ASK)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return encode(leg)


def vet_answer(answer: bytes) -> TransferParams | None:
    """The transfer parameters in a prefill engine's answer, or None: not JSON, no object, too large, or
    not a remote prefill's (the decode engine then prefills itself)."""
    try:
        doc = json.loads(answer)
        params = doc.get(PARAMS) if isinstance(doc, dict) else None
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return None
        if len(encode(params)) > MAX_PARAMS_BYTES:  # and encodable: no lone surrogate in it
            return None
    except (ValueError, RecursionError):  # not JSON (UnicodeError too), or nested past the parser
        return None
    return TransferParams(params)


def decode_body(raw: bytes, body: dict[str, Any], params: TransferParams | None) -> bytes:
    """The decode leg's body: the client's (as the router sends it), with the prefill's transfer
    parameters, or without any (the decode engine prefills itself)."""
    if params is None:
        return without_member(raw, body, PARAMS)[0]
    return with_member(raw, body, PARAMS, params.value)[0]  # over the client's own, if any
