"""OpenAI's Responses API on the fake engine (pure, no I/O): parsing, the response store, the answer.

As vLLM serves it: the input becomes chat messages (``tokens/shapes.py``) rendered by the one chat
template, so the prompt's tokens (and its cache hits) are a chat completion's. A stored response keeps
its conversation; a request naming it as ``previous_response_id`` continues that conversation, on this
engine only: ids are valid where they were made, and a restart forgets them (vLLM's store is in memory).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from router_runtime.tokens import encode, render_chat
from router_runtime.tokens.chat import Untokenizable
from router_runtime.tokens.shapes import responses_chat

from .openai_api import GenerationRequest, Kind, RequestError, Usage, parse_generation, sse

MAX_STORED = 10_000


def not_found(response_id: str, param: str | None = None) -> RequestError:
    return RequestError(f"Response with id '{response_id}' not found.", param, "response_not_found", 404)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    history: tuple[dict[str, Any], ...]  # the conversation so far, the answer included, without instructions
    body: dict[str, Any]  # the response object, as GET answers it


class ResponseStore:
    """The engine's stored responses, newest last, at most ``max_entries`` (the oldest go first)."""

    def __init__(self, max_entries: int = MAX_STORED) -> None:
        self.max_entries = max_entries
        self._d: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._d.get(response_id)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._d[response_id] = stored
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._d.pop(response_id, None) is not None

    def clear(self) -> None:
        self._d.clear()


CHOSEN_ID = "request_id"  # the request's own id for the response, as vLLM takes it (not echoed)
_ECHOED = ("instructions", "previous_response_id", "metadata", "max_output_tokens", "temperature", "top_p")


def parse_responses(body: Any, store: ResponseStore) -> GenerationRequest:
    """``POST /v1/responses`` body -> request. A ``previous_response_id`` this engine does not hold
    answers 404, as vLLM does."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    previous = body.get("previous_response_id")
    history: tuple[dict[str, Any], ...] = ()
    if previous is not None:
        if not isinstance(previous, str):
            raise RequestError("'previous_response_id' must be a string", "previous_response_id")
        stored = store.get(previous)
        if stored is None:
            raise not_found(previous, "previous_response_id")
        history = stored.history
    try:
        turn = responses_chat({k: v for k, v in body.items() if k != "previous_response_id"})["messages"]
    except Untokenizable as e:
        raise RequestError(f"unsupported input: {e}", "input") from None
    # The instructions lead the prompt; a previous turn's instructions are not carried over.
    lead = 1 if body.get("instructions") is not None else 0
    conversation = (*history, *turn[lead:])
    messages = (*turn[:lead], *conversation)

    def tokens_of(_b: dict) -> tuple[int, ...]:
        try:
            return tuple(encode(render_chat(messages)))
        except ValueError as e:
            raise RequestError(f"invalid 'input': {e}", "input") from None

    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise RequestError("'store' must be a boolean", "store")
    fields = {k: body.get(k) for k in _ECHOED} | {"store": store_it}
    chosen = body.get(CHOSEN_ID)  # vLLM makes it the response's id
    if chosen is not None:
        if not isinstance(chosen, str) or not chosen:
            raise RequestError(f"'{CHOSEN_ID}' must be a non-empty string", CHOSEN_ID)
        fields[CHOSEN_ID] = chosen
    return parse_generation(
        body,
        Kind.RESPONSES,
        tokens_of,
        "max_output_tokens",
        messages=conversation,
        fields=fields,
    )


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt,
        "input_tokens_details": {"cached_tokens": u.cached},
        "output_tokens": u.completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt + u.completion,
    }


class ResponsesShape:
    """The response object, and its stream: ``response.created``, ``response.in_progress``, the output
    item and content part opened, one ``response.output_text.delta`` per token, their ``.done`` events,
    then ``response.completed`` with the usage."""

    def __init__(self, response_id: str, model: str, fields: dict[str, Any]) -> None:
        self.id = response_id
        self.item_id = "msg_" + response_id.removeprefix("resp_")
        self.model = model
        self.fields = {k: v for k, v in fields.items() if k != CHOSEN_ID}
        self.created_at = int(time.time())
        self._seq = 0

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content if status == "completed" else [],
        }

    def response(self, status: str, text: str | None = None, usage: Usage | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [] if text is None else [self._message(text, "completed")],
            "usage": None if usage is None else _usage(usage),
            "error": None,
            "incomplete_details": None,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            **self.fields,
        }

    def _event(self, kind: str, **data: Any) -> bytes:
        self._seq += 1
        return sse({"type": kind, "sequence_number": self._seq - 1, **data}, kind)

    def full(self, text: str, usage: Usage) -> dict[str, Any]:
        return self.response("completed", text, usage)

    def opening(self, usage: Usage) -> list[bytes]:
        at = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
            self._event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
            self._event("response.content_part.added", **at, part=part),
        ]

    def delta(self, text: str, index: int, last: bool) -> bytes:
        at = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        return self._event("response.output_text.delta", **at, delta=text, logprobs=[])

    def closing(self, text: str, usage: Usage) -> list[bytes]:
        at = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return [
            self._event("response.output_text.done", **at, text=text, logprobs=[]),
            self._event("response.content_part.done", **at, part=part),
            self._event("response.output_item.done", output_index=0, item=self._message(text, "completed")),
            self._event("response.completed", response=self.full(text, usage)),
        ]
