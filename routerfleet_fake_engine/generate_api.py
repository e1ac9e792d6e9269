"""SGLang's native ``POST /generate`` on the fake engine (pure, no I/O): ``text`` or ``input_ids`` and
``sampling_params``; the answer is ``{"text", "meta_info"}``, streamed as events whose ``text`` is the
whole output so far, then ``[DONE]``."""

from __future__ import annotations

from typing import Any

from router_runtime.tokens import encode

from .openai_api import (
    GenerationRequest,
    Kind,
    RequestError,
    Usage,
    parse_generation,
    prompt_tokens,
    sse,
    usage_json,
)


def parse_generate(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError("'sampling_params' must be an object", "sampling_params")

    def tokens_of(b: dict) -> tuple[int, ...]:
        if b.get("input_ids") is not None:
            return prompt_tokens(b["input_ids"])
        if b.get("text") is not None:
            return prompt_tokens(b["text"])
        raise RequestError("Either text or input_ids should be provided.", "text")

    view = {**body, "max_new_tokens": params.get("max_new_tokens"), "lora_name": body.get("lora_path")}
    return parse_generation(view, Kind.GENERATE, tokens_of, "max_new_tokens")


class GenerateShape:
    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self._text = ""
        self._usage = Usage(0, 0, 0)

    def _answer(self, text: str, usage: Usage, done: bool) -> dict[str, Any]:
        meta = {
            "id": self.id,
            "finish_reason": {"type": "length", "length": usage.completion} if done else None,
            "prompt_tokens": usage.prompt,
            "completion_tokens": usage.completion,
            "cached_tokens": usage.cached,
        }
        return {"text": text, "meta_info": meta}

    def full(self, text: str, usage: Usage) -> dict[str, Any]:
        return self._answer(text, usage, True)

    def opening(self, usage: Usage) -> list[bytes]:
        self._usage = usage
        return []

    def delta(self, text: str, index: int, last: bool) -> bytes:
        self._text += text
        u = self._usage
        return sse(self._answer(self._text, Usage(u.prompt, index + 1, u.cached), last))

    def closing(self, text: str, usage: Usage) -> list[bytes]:
        out = [] if text else [sse(self._answer("", usage, True))]
        return [*out, b"data: [DONE]\n\n"]


def parse_token_generate(body: Any) -> GenerationRequest:
    """vLLM's token-in ``POST /inference/v1/generate``: ``token_ids`` and ``sampling_params``."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise RequestError("'sampling_params' is required (an object)", "sampling_params")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise RequestError("'token_ids' must be a list of token IDs", "token_ids")
    view = {**body, "stream": False, "max_tokens": params.get("max_tokens")}
    return parse_generation(view, Kind.TOKEN_GENERATE, lambda _b: prompt_tokens(ids))


class TokenGenerateShape:
    """Its answer: the generated token IDs in one choice (vLLM streams none of it yet)."""

    def __init__(self, request_id: str) -> None:
        self.id = request_id

    def full(self, text: str, usage: Usage) -> dict[str, Any]:
        choice = {"index": 0, "logprobs": None, "finish_reason": "length", "token_ids": encode(text)}
        return {"request_id": self.id, "choices": [choice], "usage": usage_json(usage)}

    def opening(self, usage: Usage) -> list[bytes]:
        return []

    def delta(self, text: str, index: int, last: bool) -> bytes:
        return b""

    def closing(self, text: str, usage: Usage) -> list[bytes]:
        return []
