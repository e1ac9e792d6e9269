"""Disaggregated prefill as vLLM's KV connectors serve it (``--kv-transfer-config``, kv_role kv_both),
by ``kv_transfer_params`` in a completion or chat request (pure):

    do_remote_decode   the prefill leg: compute the prompt, answer one token and, in the answer's
                       ``kv_transfer_params``, where a decode engine pulls its KV (this engine's id, the
                       prompt's full block ids, host and port)
    do_remote_prefill  the decode leg: take the full blocks this rank lacks from the named engine (a
                       simulated transfer time per block), store and publish them as vLLM's decode side
                       does once they arrive, and count them as cached, as vLLM reports the tokens it did
                       not compute

An engine without the connector ignores the field, as vLLM does.

llm-d's routing sidecar (``--pd-sidecar``), in front of a decode engine, runs vLLM's flow itself: a
request with ``SIDECAR_HEADER`` (set by an endpoint picker) goes to that prefill engine first as the
prefill leg (``sidecar_prefill_body``), then here with the answer's ``kv_transfer_params``; a prefill
that fails answers the client with its status. Without the header the engine prefills the prompt itself.

SGLang's flow (``--disaggregation-mode``, ``Room``): the same request goes to the prefill and the decode
engine at once with a ``bootstrap_room``; the prefill engine computes the prompt and marks the room
ready; the decode engine waits for the room on the prefill engine's bootstrap port (here its HTTP port,
``/fake/rooms/{room}``), then pulls the blocks it lacks as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PARAMS = "kv_transfer_params"
# The fake's stand-in for a KV connector's handshake, which refuses a peer of another model or KV layout:
# a prefill engine's --revision travels with its transfer parameters (and its room), and a decode engine
# of another revision refuses the KV (``compatible``).
REVISION = "fake_engine_revision"


@dataclass(frozen=True, slots=True)
class Remote:
    """What a request's ``kv_transfer_params`` ask of this engine."""

    decode: bool  # a prefill leg: hold the KV for a remote decode
    prefill_blocks: int | None  # a decode leg: the full blocks the prefill engine offers (None: not one)
    engine_id: str | None = None
    revision: str = ""  # the prefill engine's (REVISION)


SIDECAR_HEADER = "x-prefiller-host-port"
SIDECAR_PATHS = ("/v1/completions", "/v1/chat/completions")


def sidecar_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The sidecar's prefill leg: the request, not streamed, one token, held for a remote decode."""
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg[PARAMS] = {"do_remote_decode": True, "do_remote_prefill": False}
    leg["stream"] = False
    leg["max_tokens"] = 1
    return leg


class TransferError(ValueError):
    pass


def remote_of(body: Any) -> Remote | None:
    """The request's ask, or None (no ``kv_transfer_params``); raises TransferError on a malformed one."""
    params = body.get(PARAMS) if isinstance(body, dict) else None
    if params is None:
        return None
    if not isinstance(params, dict):
        raise TransferError(f"'{PARAMS}' must be an object")
    if params.get("do_remote_decode") is True:
        return Remote(decode=True, prefill_blocks=None)
    if params.get("do_remote_prefill") is True:
        ids, engine = params.get("remote_block_ids"), params.get("remote_engine_id")
        if not isinstance(ids, list) or not isinstance(engine, str) or not engine:
            raise TransferError(f"'{PARAMS}' of a remote prefill needs remote_block_ids and remote_engine_id")
        revision = params.get(REVISION)
        return Remote(False, len(ids), engine, revision if isinstance(revision, str) else "")
    return None


@dataclass(frozen=True, slots=True)
class Room:
    """A request's SGLang bootstrap fields."""

    host: str
    port: int
    room: int


def room_of(body: Any) -> Room | None:
    """The request's bootstrap room, or None; raises TransferError on malformed fields."""
    if not isinstance(body, dict) or body.get("bootstrap_room") is None:
        return None
    host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
    if not isinstance(host, str) or type(port) is not int or type(room) is not int or not 0 <= room < 1 << 63:
        raise TransferError(
            "bootstrap_host, bootstrap_port and bootstrap_room must be a host, a port and a room"
        )
    return Room(host, port, room)


def compatible(ours: str, theirs: str) -> bool:
    """Whether a decode engine of revision ``ours`` can take KV prefilled by one of ``theirs``."""
    return not ours or not theirs or ours == theirs


def answer_params(
    engine_id: str, host: str, port: int, n_prompt: int, block_size: int, revision: str = ""
) -> dict[str, Any]:
    """The prefill leg's answer: where the decode engine pulls the prompt's full blocks from."""
    return {
        REVISION: revision,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(range(n_prompt // block_size)),
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


def received_blocks(n_prompt: int, cached_tokens: int, offered: int, block_size: int) -> int:
    """Full blocks a decode leg takes from the prefill engine: those past its own cached prefix, of the
    ones offered."""
    return max(min(n_prompt // block_size, offered) - cached_tokens // block_size, 0)
