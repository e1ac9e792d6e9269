"""Request bodies: validate what the router needs and extract the prompt for matching (pure).

The router checks what it must read to route (the prompt or the messages, ``stream``) and leaves
everything else to the engine, whose 4xx answers are passed through. The body itself is forwarded as
the client's original bytes; nothing here re-serializes it.

Prompts: ``"text"``, ``[ids...]``, ``["text", ...]`` or ``[[ids...], ...]``; a batch of several prompts
is routed by its first. Token IDs must be integers in [0, 2**32) (converted in C by ``array``, so a
100k-token prompt costs microseconds; JSON ``true``/``false`` slip through as 1/0 and are left to the
engine to reject).
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..scheduling.types import Kind
from .errors import ProxyError, bad_request

# The kinds whose prompt is a completion's (text or token IDs); the others are rendered as chat.
PROMPT_KINDS = frozenset({Kind.COMPLETION, Kind.GENERATE, Kind.TOKEN_GENERATE})


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Kind
    stream: bool
    text: str | None = None  # a completion's text prompt
    tokens: array | None = None  # a completion's token-ID prompt (array('I'))
    body: dict[str, Any] | None = None  # the request body: the engine's tokenization rules read its fields
    lora_name: str | None = None
    cache_salt: str | None = None
    previous_response_id: str | None = None  # Responses: the stored response it continues
    logprobs_from: int | None = None  # the first prompt position whose logprob is asked for


# Where each prompt kind carries its prompt (the first present is read).
_PROMPT_FIELDS = {
    Kind.COMPLETION: ("prompt",),
    Kind.GENERATE: ("text", "input_ids"),
    Kind.TOKEN_GENERATE: ("token_ids",),
}
MAX_RESPONSE_ID = 256


# A lone surrogate can only come from a \uD800-\uDFFF escape (raw UTF-8 cannot encode one), so a UTF-8
# body without such an escape needs no walk; a UTF-16/32 one (json reads those too, NULs in its first
# bytes) can carry one raw.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> Any:
    """The body, decoded. A string holding a lone surrogate (valid JSON, but text no encoder, tokenizer
    or native call can take) is a 400 naming where it is."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # ValueError: also an integer beyond Python's 4,300 digits
        raise bad_request("request body is not valid JSON") from None
    walk = b"\x00" in raw[:4] or _SURROGATE_ESCAPE.search(raw)
    if walk and (where := _lone_surrogate(body)) is not None:
        raise bad_request(
            f"'{where}' holds a lone surrogate: not text", where.split("[", 1)[0].split(".", 1)[0]
        )
    return body


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) in ``value`` that is not encodable text."""
    stack = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return at or "(body)"
        elif isinstance(v, dict):
            for k, item in v.items():
                key_at = f"{at}.{k}" if at else str(k)
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return at or "(body)"
                stack.append((item, key_at))
        elif isinstance(v, list):
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(v))
    return None


def _ids(value: list, param: str) -> array:
    try:
        return array("I", value)
    except (TypeError, OverflowError):
        raise bad_request(f"'{param}' token IDs must be integers in [0, 2**32)", param) from None


def _prompt(prompt: Any, param: str = "prompt") -> tuple[str | None, array | None]:
    if isinstance(prompt, str):
        return prompt, None
    if not isinstance(prompt, list):
        raise bad_request(f"'{param}' must be a string or a list of token IDs", param)
    if not prompt:
        raise bad_request(f"'{param}' must not be empty", param)
    first = prompt[0]
    if type(first) is int:
        return None, _ids(prompt, param)
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise bad_request(f"'{param}' must not mix strings and other values", param)
        return first, None
    if isinstance(first, list):
        if not all(isinstance(p, list) for p in prompt):
            raise bad_request(f"'{param}' must not mix token lists and other values", param)
        for p in prompt[1:]:
            _ids(p, param)
        return None, _ids(first, param)
    raise bad_request(
        f"'{param}' must be a string, a list of token IDs, or a list of strings or token-ID lists", param
    )


def _messages(messages: Any) -> list:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict):
            raise bad_request("each message must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request("each message needs a non-empty string 'role'", "messages")
    return messages


def _opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(f"'{key}' must be a string", key)
    return v or None


def _logprobs_from(body: dict, kind: Kind) -> int | None:
    """The first prompt position whose logprob the request asks for (None: none); the engine computes
    those positions rather than reuse their cached KV (scheduling/reuse.py). Any of vLLM's asks from the
    start: ``prompt_logprobs``; ``echo`` with a completion's ``logprobs`` or a chat's ``top_logprobs``
    (0 unless null), which vLLM turns into prompt logprobs; in a token-in generate's ``sampling_params``,
    ``prompt_logprobs`` or ``prompt_logprob_token_ids``, unless ``skip_reading_prefix_cache`` says
    otherwise. SGLang's ``/generate``: ``return_logprob`` from ``logprob_start_len`` (its default, -1,
    asks for none); its completions' ``echo`` with ``logprobs`` asks from the start, as vLLM's."""
    if kind is Kind.GENERATE:
        start = body.get("logprob_start_len")
        return start if body.get("return_logprob") is True and type(start) is int and start >= 0 else None
    if kind is Kind.TOKEN_GENERATE:
        params = body.get("sampling_params")
        if not isinstance(params, dict):
            return None
        skip = params.get("skip_reading_prefix_cache")
        if skip is not None:
            return 0 if skip is True else None
        asks = params.get("prompt_logprobs") is not None or params.get("prompt_logprob_token_ids") is not None
        return 0 if asks else None
    if body.get("prompt_logprobs") is not None:
        return 0
    if body.get("echo") is True:
        echoed = body.get("logprobs") if kind is Kind.COMPLETION else body.get("top_logprobs", 0)
        return 0 if echoed is not None and kind in (Kind.COMPLETION, Kind.CHAT) else None
    return None


def truncated(body: Mapping[str, Any], kind: Kind) -> bool:
    """Whether the engine may cut the prompt's start (vLLM's ``truncate_prompt_tokens``; a token-in
    generate's, in its ``sampling_params``): what it caches is then not the prompt's prefix, so the
    prompt's tokens predict nothing (SGLang ignores the field; the router cannot tell the two apart
    here, and routing cold is never wrong)."""
    where = body.get("sampling_params") if kind is Kind.TOKEN_GENERATE else body
    return isinstance(where, dict) and where.get("truncate_prompt_tokens") is not None


def names_rank(body: Mapping[str, Any]) -> bool:
    """Whether the body names its own data-parallel rank (``data_parallel_rank``, which SGLang follows
    over the router's ``X-Data-Parallel-Rank``): the request may then run on another rank than the one
    its prediction is for, so its tokens predict nothing (a client chooses no rank by the header
    either: proxy/headers.py)."""
    return body.get("data_parallel_rank") is not None


def other_adapter(body: Mapping[str, Any], kind: Kind) -> bool:
    """Whether an OpenAI-shaped request names an adapter by SGLang's ``lora_path`` (other than its
    ``lora_name``): SGLang runs it under that adapter, whose blocks are another namespace, and vLLM
    ignores the field; which kind of engine takes it is not known here, so its tokens predict nothing.
    (On SGLang's ``/generate`` it is the adapter, read as such.)"""
    path = body.get("lora_path")  # "" (or null): the base model, as SGLang reads it
    return kind is not Kind.GENERATE and path not in (None, "") and path != body.get("lora_name")


def parse_request(body: Any, kind: Kind) -> ParsedRequest:
    """A decoded JSON body -> what routing needs. Raises ProxyError (400)."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif type(stream) is not bool:
        raise bad_request("'stream' must be a boolean", "stream")
    lora_name, cache_salt = _opt_str(body, "lora_name"), _opt_str(body, "cache_salt")
    if kind in PROMPT_KINDS:
        field = _PROMPT_FIELDS[kind]
        name = next((f for f in field if body.get(f) is not None), None)
        if name is None:
            raise bad_request(f"'{field[0]}' is required", field[0])
        text, tokens = _prompt(body[name], name)
        if kind is Kind.TOKEN_GENERATE and tokens is None:
            raise bad_request("'token_ids' must be a list of token IDs", name)
        if kind is Kind.GENERATE:
            lora_name = _opt_str(body, "lora_path")
        return ParsedRequest(
            kind,
            stream,
            text=text,
            tokens=tokens,
            body=body,
            lora_name=lora_name,
            cache_salt=cache_salt,
            logprobs_from=_logprobs_from(body, kind),
        )
    if kind is Kind.RESPONSES:
        previous = _opt_str(body, "previous_response_id")
        if previous is not None and len(previous) > MAX_RESPONSE_ID:
            raise bad_request("'previous_response_id' is not a response id", "previous_response_id")
        return ParsedRequest(
            kind, stream, body=body, lora_name=lora_name, cache_salt=cache_salt, previous_response_id=previous
        )
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages")
    _messages(body["messages"])
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return ParsedRequest(
        kind,
        stream,
        body=body,
        lora_name=lora_name,
        cache_salt=cache_salt,
        logprobs_from=_logprobs_from(body, kind),
    )


__all__ = ["Kind", "ParsedRequest", "ProxyError", "parse_json", "parse_request"]
