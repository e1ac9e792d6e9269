"""OpenAI-compatible request parsing and response shapes for the fake engine (pure, no I/O).

Parsing turns a JSON body into a typed ``GenerationRequest`` or raises ``RequestError``, which the
server renders as OpenAI's error JSON with status 400. Generated text is a deterministic function of
the prompt tokens, one ASCII letter per token, so the byte tokenizer round-trips it exactly.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from router_runtime.tokens import decode, encode, render_chat
from routerfleet_fake_engine.hashing import Namespace

DEFAULT_MAX_TOKENS = 16
_MAX_TOKEN_ID = (1 << 32) - 1  # SGLang hashes tokens as u32, so anything larger cannot be cached


class RequestError(ValueError):
    """A client error: becomes HTTP ``status`` (400 unless said) with OpenAI's error shape."""

    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status

    def to_json(self) -> dict[str, Any]:
        return error_json(self.message, param=self.param, code=self.code)


def error_json(
    message: str, *, type_: str = "invalid_request_error", param=None, code=None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def parse_json_body(raw: bytes) -> Any:
    """A request body as JSON; RequestError (-> 400) when it is not valid UTF-8 JSON."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # also integers beyond Python's digit limit
        raise RequestError("request body is not valid JSON") from None


class Kind(enum.StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"
    RESPONSES = "responses"  # OpenAI's Responses API (responses_api.py)
    MESSAGES = "messages"  # Anthropic's Messages API (messages_api.py)
    GENERATE = "generate"  # SGLang's native /generate (generate_api.py)
    TOKEN_GENERATE = "token_generate"  # vLLM's /inference/v1/generate (generate_api.py)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Kind
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    stream: bool
    include_usage: bool  # stream_options.include_usage: also send OpenAI's usage-only final chunk
    namespace: Namespace
    rank: int | None  # body data_parallel_rank; the server also checks the header and validates range
    model: str | None
    messages: tuple[
        dict[str, Any], ...
    ] = ()  # a conversation's chat messages (the Responses store keeps them)
    fields: dict[str, Any] = field(default_factory=dict)  # request fields an API's answer echoes


# ------------------------------------------------------------------------------------------ parsing


def _is_int(v: Any) -> bool:
    return type(v) is int  # bool is an int subclass and must not pass


def _token_list(v: list, param: str) -> tuple[int, ...]:
    if not all(_is_int(t) and 0 <= t <= _MAX_TOKEN_ID for t in v):
        raise RequestError(f"'{param}' token IDs must be integers in [0, 2**32)", param)
    return tuple(v)


def prompt_tokens(prompt: Any) -> tuple[int, ...]:
    # Accepted: "text", [ids...], ["text"], [[ids...]]. Several prompts in one request are not.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = tuple(encode(prompt))
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        tokens = _token_list(prompt, "prompt")
    elif isinstance(prompt, list):
        raise RequestError(
            "'prompt' must be a string, a list of token IDs, or a list of one of those", "prompt"
        )
    else:
        raise RequestError("'prompt' must be a string or a list of token IDs", "prompt")
    if not tokens:
        raise RequestError("'prompt' must not be empty", "prompt")
    return tokens


def _opt_str(body: Mapping[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise RequestError(f"'{key}' must be a non-empty string", key)
    return v


def parse_generation(
    body: Any, kind: Kind, tokens_of, max_tokens_key: str = "max_tokens", **extra: Any
) -> GenerationRequest:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    tokens = tokens_of(body)
    max_tokens = body.get(max_tokens_key)
    param = max_tokens_key
    if max_tokens is None and kind is Kind.CHAT:
        max_tokens, param = body.get("max_completion_tokens"), "max_completion_tokens"
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 0:
        raise RequestError(f"'{param}' must be a non-negative integer", param)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    rank = body.get("data_parallel_rank")
    if rank is not None and (not _is_int(rank) or rank < 0):
        raise RequestError("'data_parallel_rank' must be a non-negative integer", "data_parallel_rank")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model")
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError("the fake engine only supports n=1", "n")
    return GenerationRequest(
        kind=kind,
        prompt_tokens=tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        namespace=Namespace(lora_name=_opt_str(body, "lora_name"), cache_salt=_opt_str(body, "cache_salt")),
        rank=rank,
        model=model,
        **extra,
    )


def parse_completion(body: Any) -> GenerationRequest:
    """``POST /v1/completions`` body -> request. ``prompt``: a string, token IDs, or a list of one."""

    def tokens_of(b: dict) -> tuple[int, ...]:
        if "prompt" not in b:
            raise RequestError("'prompt' is required", "prompt")
        return prompt_tokens(b["prompt"])

    return parse_generation(body, Kind.COMPLETION, tokens_of)


def parse_chat(body: Any) -> GenerationRequest:
    """``POST /v1/chat/completions`` body -> request, tokenized as ``encode(render_chat(messages))``."""

    def tokens_of(b: dict) -> tuple[int, ...]:
        try:
            return tuple(encode(render_chat(b.get("messages"))))
        except ValueError as e:
            raise RequestError(f"invalid 'messages': {e}", "messages") from None

    return parse_generation(body, Kind.CHAT, tokens_of)


def tokenize_request(body: Any) -> list[int]:
    """A tokenize endpoint's body -> token IDs: ``prompt`` (a string) as a completion encodes it, or
    ``messages`` as a chat completion renders and encodes them."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if isinstance(body.get("prompt"), str):
        return encode(body["prompt"])
    if "messages" in body:
        try:
            return encode(render_chat(body["messages"]))
        except ValueError as e:
            raise RequestError(f"invalid 'messages': {e}", "messages") from None
    raise RequestError("'prompt' (a string) or 'messages' is required", "prompt")


def detokenize_request(body: Any) -> str:
    """A detokenize endpoint's body (``{"tokens": [...]}``) -> the text."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list):
        raise RequestError("'tokens' (a list of token IDs) is required", "tokens")
    return decode(_token_list(tokens, "tokens"))


# ----------------------------------------------------------------------------------------- output


def generate_tokens(prompt_tokens: tuple[int, ...], n: int) -> list[int]:
    """The deterministic "generation": lowercase letters counting up from a letter picked by the
    prompt, so different prompts give different (but reproducible) text."""
    start = (sum(prompt_tokens) + len(prompt_tokens)) % 26
    return [ord("a") + (start + i) % 26 for i in range(n)]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt: int
    completion: int
    cached: int


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt,
        "completion_tokens": u.completion,
        "total_tokens": u.prompt + u.completion,
        "prompt_tokens_details": {"cached_tokens": u.cached},
    }


def sse(obj: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event (with an ``event:`` line where the API names its events)."""
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


class Shape(Protocol):
    """How one API spells a generation's answer, whole or as a stream of events."""

    def full(self, text: str, usage: Usage) -> dict[str, Any]: ...

    def opening(self, usage: Usage) -> list[bytes]: ...

    def delta(self, text: str, index: int, last: bool) -> bytes: ...

    def closing(self, text: str, usage: Usage) -> list[bytes]: ...


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What every response or chunk of one request shares."""

    id: str
    created: int
    model: str
    kind: Kind

    @property
    def object(self) -> str:
        return "text_completion" if self.kind is Kind.COMPLETION else "chat.completion"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        if self.kind is Kind.COMPLETION:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        return {**self._base(self.object), "choices": [choice], "usage": usage}

    def chunk(self, text: str, *, first: bool = False, finish_reason: str | None = None) -> dict[str, Any]:
        if self.kind is Kind.COMPLETION:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            return {**self._base("text_completion"), "choices": [choice]}
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's ``include_usage`` chunk: no choices, just usage."""
        obj = "text_completion" if self.kind is Kind.COMPLETION else "chat.completion.chunk"
        return {**self._base(obj), "choices": [], "usage": usage}


class ChatShape:
    """Completions and chat completions: one chunk per token, the last with ``finish_reason``; the
    usage-only chunk if ``stream_options.include_usage`` asked for it; then ``[DONE]``."""

    def __init__(self, header: ResponseHeader, include_usage: bool) -> None:
        self.header = header
        self.include_usage = include_usage

    def full(self, text: str, usage: Usage) -> dict[str, Any]:
        return self.header.full(text, "length", usage_json(usage))

    def opening(self, usage: Usage) -> list[bytes]:
        return []

    def delta(self, text: str, index: int, last: bool) -> bytes:
        return sse(self.header.chunk(text, first=index == 0, finish_reason="length" if last else None))

    def closing(self, text: str, usage: Usage) -> list[bytes]:
        out = [] if text else [sse(self.header.chunk("", first=True, finish_reason="length"))]
        if self.include_usage:
            out.append(sse(self.header.usage_chunk(usage_json(usage))))
        return [*out, b"data: [DONE]\n\n"]
