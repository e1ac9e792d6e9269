"""Anthropic's Messages API on the fake engine (pure, no I/O), as vLLM serves it: the request becomes
chat messages (``tokens/shapes.py``) rendered by the one chat template, so its prompt tokens are a chat
completion's; the answer and its event stream are Anthropic's, errors included."""

from __future__ import annotations

from typing import Any

from router_runtime.tokens import encode, render_chat
from router_runtime.tokens.chat import Untokenizable
from router_runtime.tokens.shapes import messages_chat

from .openai_api import GenerationRequest, Kind, RequestError, Usage, parse_generation, sse


def error_json(e: RequestError) -> dict[str, Any]:
    kind = "not_found_error" if e.status == 404 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def parse_messages(body: Any) -> GenerationRequest:
    """``POST /v1/messages`` body -> request; ``max_tokens`` is required, as Anthropic's API has it."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if "max_tokens" not in body:
        raise RequestError("max_tokens: Field required", "max_tokens")

    def tokens_of(b: dict) -> tuple[int, ...]:
        try:
            return tuple(encode(render_chat(messages_chat(b)["messages"])))
        except (Untokenizable, ValueError) as e:
            raise RequestError(f"invalid 'messages': {e}", "messages") from None

    return parse_generation(body, Kind.MESSAGES, tokens_of)


def count_tokens(body: Any) -> dict[str, Any]:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as ``/v1/messages`` would count them."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    try:
        n = len(encode(render_chat(messages_chat(body)["messages"])))
    except (Untokenizable, ValueError) as e:
        raise RequestError(f"invalid 'messages': {e}", "messages") from None
    return {"input_tokens": n}


def _usage(u: Usage, output: int | None = None) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt,
        "output_tokens": u.completion if output is None else output,
        "cache_read_input_tokens": u.cached,
        "cache_creation_input_tokens": 0,
    }


class MessagesShape:
    """The message, and its stream: ``message_start``, ``content_block_start``, one
    ``content_block_delta`` per token, ``content_block_stop``, ``message_delta`` with the stop reason and
    the output tokens, ``message_stop``."""

    def __init__(self, message_id: str, model: str) -> None:
        self.id = message_id
        self.model = model

    def _message(self, content: list[dict[str, Any]], usage: dict[str, Any], stop: str | None) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }

    def full(self, text: str, usage: Usage) -> dict[str, Any]:
        return self._message([{"type": "text", "text": text}], _usage(usage), "max_tokens")

    def opening(self, usage: Usage) -> list[bytes]:
        start = self._message([], _usage(usage, 0), None)
        block = {"type": "text", "text": ""}
        return [
            sse({"type": "message_start", "message": start}, "message_start"),
            sse({"type": "content_block_start", "index": 0, "content_block": block}, "content_block_start"),
        ]

    def delta(self, text: str, index: int, last: bool) -> bytes:
        delta = {"type": "text_delta", "text": text}
        return sse({"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta")

    def closing(self, text: str, usage: Usage) -> list[bytes]:
        end = {"stop_reason": "max_tokens", "stop_sequence": None}
        return [
            sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            sse({"type": "message_delta", "delta": end, "usage": _usage(usage)}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop"),
        ]
