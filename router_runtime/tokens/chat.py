"""A chat request turned into what the engine's chat template renders, by that engine's own rules
(pure; docs/tokens.md). The engines normalize a request before their template sees it, and every
normalization changes the token IDs: how content parts are flattened, tool calls and tools rewritten,
roles mapped, request fields merged into the template's variables. vLLM and SGLang differ in most of
these, so each family has its own ``prepare_*``.

A request the router cannot reproduce exactly raises ``Untokenizable`` with a reason: it is routed
without tokens and counted, never on a guessed sequence. That includes requests the engine itself
rejects (it answers 400; the router forwards them untouched).
"""

from __future__ import annotations

import contextlib
import copy
import enum
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .schema_types import normalize_schema_types
from .template import ChatTemplate, ContentFormat


class Family(enum.StrEnum):
    """Whose chat preprocessing the router reproduces."""

    VLLM = "vllm"  # vLLM 0.33
    SGLANG = "sglang"  # SGLang 0.5.23


class Reason(enum.StrEnum):
    """Why a chat request is routed without tokens (``routerfleet_untokenized_requests_total``)."""

    NO_TEMPLATE = "no_template"  # the tokenizer has no chat template
    REQUEST_TEMPLATE = "request_template"  # the request brings its own template
    MULTIMODAL = "multimodal"  # image/audio/video parts: the engine's placeholder expansion
    UNSUPPORTED = "unsupported"  # a construct the router does not reproduce
    REJECTED = "rejected"  # a request the engine answers 400 (malformed message, conflicting flags)
    TEMPLATE_ERROR = "template_error"  # the template raised
    ENGINE_TIMEOUT = "engine_timeout"  # --tokenizer engine: the engine's answer missed its deadline
    ENGINE_ERROR = "engine_error"  # --tokenizer engine: no engine, an error, an answer that does not vet


class Untokenizable(ValueError):
    def __init__(self, reason: Reason, detail: str):
        super().__init__(detail)
        self.reason = reason


# What hostile input makes the rules fail with (nesting deeper than the stack, a list where a string
# was due, a lone surrogate): the engine refuses such a request too, so it is a refusal, not a 500.
MALFORMED = (RecursionError, TypeError, ValueError, UnicodeError)


@contextlib.contextmanager
def malformed_is_rejected(*passthrough: type[BaseException]) -> Iterator[None]:
    """Turn a MALFORMED failure inside into Untokenizable (rejected); ``passthrough`` ones go on."""
    try:
        yield
    except (Untokenizable, *passthrough):
        raise
    except MALFORMED as e:
        raise Untokenizable(Reason.REJECTED, f"a malformed request: {type(e).__name__}") from None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Everything the template render and the encode take, as the engine would give it."""

    messages: list[dict[str, Any]]
    variables: dict[str, Any]  # the template's other variables (tools, add_generation_prompt, ...)
    continue_final: bool  # the output ends inside the last message (the library's tag-and-cut)
    add_special_tokens: bool | None  # with the tokenizer's special tokens; None: unless it adds some to ""
    suffix: str | None = None  # SGLang: text encoded on its own and appended (BOS dropped)


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if type(v) is not bool:
        raise Untokenizable(Reason.REJECTED, f"'{key}' must be a boolean")
    return v


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise Untokenizable(Reason.REJECTED, "'chat_template_kwargs' must be an object")
    return kw


def _no_request_template(body: Mapping[str, Any], kwargs: Mapping[str, Any]) -> None:
    # vLLM refuses one unless started with --trust-request-chat-template; SGLang has no such field.
    if body.get("chat_template") is not None or kwargs.get("chat_template") is not None:
        raise Untokenizable(Reason.REQUEST_TEMPLATE, "the request brings its own chat template")


# Content parts: the text-like types and where their text is; everything else the engines know is media.
_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_TYPES = frozenset(
    {
        "image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio", "audio_embeds",
        "video_url", "video_embeds", "prompt_embeds", "file",
    }
)  # fmt: skip
# Part keys the OpenAI shapes define (vLLM keeps any other key on an "openai"-format text part).
_KNOWN_PART_KEYS = frozenset(
    {
        "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
        "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
        "video_embeds", "video_url",
    }
)  # fmt: skip
BILLING_HEADER = "x-anthropic-billing-header"


# The Responses API's text part types: vLLM's chat completion request model refuses them.
_RESPONSES_TEXT = frozenset({"input_text", "output_text"})


def _part_type(part: Mapping[str, Any]) -> str:
    t = part.get("type")
    if isinstance(t, str) and part.get("uuid") is None:
        if t in _RESPONSES_TEXT:
            raise Untokenizable(Reason.REJECTED, f"a {t!r} part in a chat completion")
        if t in _TEXT_KEYS:
            return t
        if t in _MEDIA_TYPES:
            raise Untokenizable(Reason.MULTIMODAL, f"a {t!r} content part")
        if t == "tool_reference":
            raise Untokenizable(Reason.UNSUPPORTED, "a 'tool_reference' content part")
        raise Untokenizable(Reason.REJECTED, f"unknown content part type {t!r}")
    if any(k in part for k in _MEDIA_TYPES):  # a media part may omit its type
        raise Untokenizable(Reason.MULTIMODAL, "a media content part")
    raise Untokenizable(Reason.REJECTED, "a content part without a known 'type'")


def _vllm_texts(parts: Sequence[Any], openai: bool) -> list[Any]:
    """The parts vLLM keeps: str or {"type": "text", "text": ...} (+ unknown keys) in "openai" format."""
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            out.append({"type": "text", "text": part} if openai else part)
            continue
        if not isinstance(part, Mapping):
            raise Untokenizable(Reason.REJECTED, "a content part must be a string or an object")
        t = _part_type(part)
        text = part.get(_TEXT_KEYS[t])
        if text is None and t in ("text", "refusal"):
            continue  # skipped, as the engine skips it
        if not isinstance(text, str):
            raise Untokenizable(Reason.REJECTED, f"a {t!r} part without its text")
        if openai:
            out.append(
                {"type": "text", "text": text, **{k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}}
            )
        else:
            out.append(text)
    return out


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    # A Claude Code attribution line changes on every request: vLLM drops it from system text parts so the
    # rest of the prompt still hits the cache.
    out = []
    for part in parts:
        text = (
            part
            if isinstance(part, str)
            else part.get("text")
            if isinstance(part, Mapping) and part.get("type") == "text"
            else None
        )
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _vllm_tool_calls(calls: Any) -> list[dict] | None:
    """Tool calls as vLLM's request model rebuilds them (``id``, ``function`` with ``arguments`` then
    ``name``, ``type``, then any other keys: the order a template's ``tojson`` shows), ``arguments``
    parsed from its JSON into an object (``{}`` when it is not one)."""
    if not isinstance(calls, list):
        raise Untokenizable(Reason.REJECTED, "'tool_calls' must be a list")
    if not calls:
        return None  # an empty list is dropped: the template takes the plain assistant path
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise Untokenizable(Reason.REJECTED, "each tool call must be an object")
        fn = call.get("function")
        if call.get("type") != "function" or not isinstance(fn, dict) or not isinstance(call.get("id"), str):
            raise Untokenizable(Reason.REJECTED, "tool calls need an 'id', type 'function' and a 'function'")
        name, args = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str) or not isinstance(args, str):
            raise Untokenizable(
                Reason.REJECTED, "a tool call's function needs a 'name' and 'arguments' string"
            )
        try:
            parsed = json.loads(args) if args else {}
        except ValueError:
            parsed = {}
        function = {"arguments": parsed if isinstance(parsed, dict) else {}, "name": name}
        function |= {k: v for k, v in fn.items() if k not in function}
        rebuilt = {"id": call["id"], "function": function, "type": "function"}
        out.append(rebuilt | {k: v for k, v in call.items() if k not in rebuilt})
    return out


def _vllm_message(m: Mapping[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    role = m["role"]
    openai = fmt is ContentFormat.OPENAI
    content = m.get("content")
    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = list(content)
    else:
        raise Untokenizable(Reason.REJECTED, "message 'content' must be a string, a list of parts or null")
    if role == "system":
        parts = _strip_billing_header(parts)
    kept = _vllm_texts(parts, openai)
    out: dict[str, Any] = {"role": role, "content": kept if openai else "\n".join(kept)}
    reasoning = m.get("reasoning")
    if role == "assistant":
        if m.get("tool_calls") is not None:
            calls = _vllm_tool_calls(m["tool_calls"])
            if calls is not None:
                out["tool_calls"] = calls
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        if isinstance(out["content"], list):  # tool results as text parts: one string, whatever the format
            out["content"] = "\n".join(p["text"] for p in out["content"])
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if isinstance(m.get("task"), str):
        out["task"] = m["task"]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def _system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM, for a template without a developer role: developer messages become system ones, and all
    system messages are merged into one at the start (parts by newline, messages by a blank line)."""
    messages = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
        for m in messages
    ]
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(messages):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        c = m.get("content", "")
        if isinstance(c, list):
            c = "\n".join(
                p["text"] if isinstance(p, dict) else p for p in c if isinstance(p, str) or "text" in p
            )
        if c:
            texts.append(c)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else messages


def _vllm_tool(tool: Any) -> dict[str, Any]:
    """One tool as vLLM's request model dumps it: fixed key order, absent description and parameters as
    null, unknown keys dropped."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or tool.get("type", "function") != "function"
    ):
        raise Untokenizable(
            Reason.REJECTED, "each tool must be {'type': 'function', 'function': {'name': ...}}"
        )
    out_fn = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
    if fn.get("strict") is not None:
        out_fn["strict"] = fn["strict"]
    defer = fn.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")
    if defer is not None:
        out_fn["defer_loading"] = defer
    out = {"type": "function", "function": out_fn}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    # vLLM's layering: a null or "auto" leaves the layer below as it is.
    return base | {
        k: v for k, v in over.items() if v is not None and not (isinstance(v, str) and v == "auto")
    }


# ``apply_chat_template``'s own parameters: never template variables, except the three it passes on to
# the template itself (``_RENDERED_PARAMS``).
_LIBRARY_PARAMS = frozenset(
    {
        "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
        "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
_RENDERED_PARAMS = ("tools", "documents", "add_generation_prompt")
_VLLM_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})


def prepare_vllm(body: Mapping[str, Any], template: ChatTemplate, specials: Mapping[str, str]) -> ChatPrompt:
    """A chat completion request as vLLM 0.33 hands it to its template and tokenizer."""
    if body.get("truncate_prompt_tokens") is not None:
        raise Untokenizable(Reason.UNSUPPORTED, "'truncate_prompt_tokens' keeps the prompt's end")
    kwargs = _template_kwargs(body)
    _no_request_template(body, kwargs)
    add_generation = _bool(body, "add_generation_prompt", True)
    continue_final = _bool(body, "continue_final_message", False)
    if add_generation and continue_final:
        raise Untokenizable(Reason.REJECTED, "add_generation_prompt and continue_final_message together")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise Untokenizable(Reason.REJECTED, "'tools' must be a list")
        tools = [_vllm_tool(t) for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise Untokenizable(Reason.REJECTED, "the tool named in 'tool_choice' is not among 'tools'")
    fmt = template.content_format
    messages = []
    for m in body["messages"]:
        m = dict(m)
        if m.get("reasoning") is None and m.get("reasoning_content") is not None:
            m["reasoning"] = m["reasoning_content"]
        messages.append(_vllm_message(m, fmt))
    if any(m["role"] == "developer" for m in messages) and not template.mentions_developer:
        messages = _system_first(messages)

    # The layers, lowest first: tools, the request's chat_template_kwargs, the request's own fields.
    effort = body.get("reasoning_effort")
    if effort is not None and (not isinstance(effort, str) or effort not in _VLLM_EFFORTS):
        raise Untokenizable(Reason.REJECTED, "'reasoning_effort' is not one of vLLM's levels")
    fields: dict[str, Any] = {
        "add_generation_prompt": add_generation,
        "continue_final_message": continue_final,
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in kwargs:
        fields["enable_thinking"] = effort != "none"
    if "tokenize" in kwargs:
        raise Untokenizable(Reason.UNSUPPORTED, "'tokenize' in chat_template_kwargs")
    merged = _merge(_merge({"tools": tools, "tokenize": False}, kwargs), fields)
    if merged.get("sanitize_control_tokens") or merged.get("return_assistant_tokens_mask"):
        raise Untokenizable(Reason.REJECTED, "a library flag that needs tokenize=True")
    # vLLM then drops the keys the template never reads, which changes nothing it renders.
    documents = merged.get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise Untokenizable(Reason.REJECTED, "'documents' must be a list of objects")
    variables = {**specials, **{k: v for k, v in merged.items() if k not in _LIBRARY_PARAMS}}
    variables.update({k: merged.get(k) for k in _RENDERED_PARAMS})
    variables["add_generation_prompt"] = bool(variables["add_generation_prompt"])
    return ChatPrompt(
        messages=messages,
        variables=variables,
        continue_final=bool(merged.get("continue_final_message")),
        add_special_tokens=_bool(body, "add_special_tokens", False),
    )


# SGLang's message roles besides "user" (matched lower-cased), and the keys its request model keeps on them.
_SGLANG_ROLES = frozenset({"system", "assistant", "tool", "function", "developer", "latest_reminder", "root"})
_SGLANG_KEYS = ("tool_call_id", "name", "reasoning_content")
_SGLANG_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"})
# Template kwargs that collide with the library's own arguments: SGLang's render fails (a 500).
_SGLANG_COLLIDING = frozenset(
    {"add_generation_prompt", "tools", "tokenize", "conversation", "return_dict", "chat_template"}
)


def _sglang_content(content: Any, role: str, fmt: ContentFormat) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Untokenizable(Reason.REJECTED, "message 'content' must be a string, a list of parts or null")
    texts: list[str] = []
    for part in content:
        t = part.get("type") if isinstance(part, dict) else None
        if t == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif t in ("thinking", "reasoning") and role == "assistant":
            continue  # kept out of the prompt
        elif t in _MEDIA_TYPES or t in ("image", "video", "audio"):
            raise Untokenizable(Reason.MULTIMODAL, f"a {t!r} content part")
        elif t == "tool_reference":
            raise Untokenizable(Reason.UNSUPPORTED, "a 'tool_reference' content part")
        else:
            raise Untokenizable(Reason.REJECTED, "a content part SGLang's request model refuses")
    if fmt is ContentFormat.OPENAI:
        if role == "tool":
            return " ".join(texts)  # tool results as text parts: one string
        return [{"type": "text", "text": t} for t in texts]
    return " ".join(texts) if texts else ""


def _sglang_message(m: Mapping[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    role = m["role"]
    if role == "user":
        if "content" not in m or m["content"] is None:
            raise Untokenizable(Reason.REJECTED, "a user message needs 'content'")
        return {"role": "user", "content": _sglang_content(m["content"], role, fmt)}  # name dropped
    role = role.lower()
    if role not in _SGLANG_ROLES:
        raise Untokenizable(Reason.REJECTED, "a message role SGLang does not know")
    if any(m.get(k) is not None for k in ("tools", "phase", "prefix")):
        raise Untokenizable(Reason.UNSUPPORTED, "SGLang's message tools, phase and prefix fields")
    out: dict[str, Any] = {"role": role, "content": _sglang_content(m.get("content"), role, fmt)}
    for k in _SGLANG_KEYS:
        v = m.get(k)
        if v is not None:
            if not isinstance(v, str):
                raise Untokenizable(Reason.REJECTED, f"'{k}' must be a string")
            out[k] = v
    if m.get("tool_calls") is not None:
        calls = [_sglang_tool_call(c) for c in _list(m["tool_calls"], "tool_calls")]
        if role == "assistant":
            for c in calls:
                c["function"]["arguments"] = _sglang_arguments(c["function"]["arguments"])
        out["tool_calls"] = calls
    return out


def _list(v: Any, key: str) -> list:
    if not isinstance(v, list):
        raise Untokenizable(Reason.REJECTED, f"'{key}' must be a list")
    return v


def _opt(d: Mapping[str, Any], key: str, *types: type) -> Any:
    """``d[key]``, null when absent; of one of ``types`` exactly (a bool is not an int), else a 400."""
    v = d.get(key)
    if v is not None and type(v) not in types:
        raise Untokenizable(Reason.REJECTED, f"'{key}' has the wrong type")
    return v


def _sglang_tool_call(call: Any) -> dict[str, Any]:
    """A tool call as SGLang's request model dumps it: ``id``, ``index``, ``type``, ``function`` with
    ``name`` and ``arguments``, absent ones null, other keys dropped."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise Untokenizable(Reason.REJECTED, "each tool call must be an object with a 'function'")
    if call.get("type", "function") != "function":
        raise Untokenizable(Reason.REJECTED, "tool calls must be of type 'function'")
    fn = call["function"]
    return {
        "id": _opt(call, "id", str),
        "index": _opt(call, "index", int),
        "type": "function",
        "function": {"name": _opt(fn, "name", str), "arguments": _opt(fn, "arguments", str, dict)},
    }


def _sglang_arguments(args: Any) -> Any:
    # A JSON string must hold an object (a 400 otherwise); an object or null stays as it is.
    if not isinstance(args, str):
        return args
    try:
        parsed = json.loads(args, parse_constant=_no_constant)
    except ValueError:
        raise Untokenizable(Reason.REJECTED, "tool call arguments that are not valid JSON") from None
    if not isinstance(parsed, dict):
        raise Untokenizable(Reason.REJECTED, "tool call arguments that are not a JSON object")
    if _has_wide_int(parsed):  # SGLang's parser (orjson) refuses integers beyond 64 bits
        raise Untokenizable(Reason.UNSUPPORTED, "tool call arguments with integers beyond 64 bits")
    return parsed


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: orjson refuses them


def _has_wide_int(v: Any) -> bool:
    if isinstance(v, dict):
        return any(_has_wide_int(x) for x in v.values())
    if isinstance(v, list):
        return any(_has_wide_int(x) for x in v)
    return isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**64


def _sglang_tool(tool: Any) -> dict[str, Any]:
    """One tool as SGLang's request model dumps it: ``type``, ``function`` in the client's key order
    (absent ``description`` and ``parameters`` appended as null; ``strict`` and ``defer_loading`` only
    when set; unknown keys dropped), then ``defer_loading`` (null when absent). Parameter types written
    the database way ("varchar(64)", "int") become JSON Schema types, as SGLang rewrites them."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise Untokenizable(Reason.REJECTED, "each tool must be an object with a 'function'")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str):
        raise Untokenizable(Reason.REJECTED, "a tool's function needs a 'name'")
    kind = tool.get("type", "function")
    if not isinstance(kind, str):
        raise Untokenizable(Reason.REJECTED, "a tool's 'type' must be a string")
    defer = _opt(tool, "defer_loading", bool)
    fields = {
        "description": _opt(fn, "description", str),
        "name": fn["name"],
        "parameters": copy.deepcopy(fn.get("parameters")),
        "strict": _opt(fn, "strict", bool),
        "defer_loading": _opt(fn, "defer_loading", bool),
    }
    if fields["defer_loading"] is None:
        fields["defer_loading"] = defer
    for k in ("defer_loading", "strict"):
        if fields[k] is None:
            del fields[k]
    if fields["parameters"] is not None and not normalize_schema_types(fields["parameters"]):
        raise Untokenizable(Reason.REJECTED, "a tool's parameters name a type JSON Schema does not have")
    order = [k for k in fn if k in fields]
    function = {k: fields[k] for k in order} | {k: v for k, v in fields.items() if k not in order}
    return {"type": kind, "function": function, "defer_loading": defer}


def _sglang_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools SGLang renders: none for ``tool_choice: "none"``, only the named one for a named
    choice (a 400 when it is not among them)."""
    tools = body.get("tools")
    if tools is None:
        return None
    dumped = [_sglang_tool(t) for t in _list(tools, "tools")]
    choice = body.get("tool_choice", "auto" if dumped else "none")
    if choice == "none" or not dumped:
        return None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        named = [t for t in dumped if t["function"]["name"] == name]
        if not named:
            raise Untokenizable(Reason.REJECTED, "the tool named in 'tool_choice' is not among 'tools'")
        return named
    if choice not in ("auto", "required"):
        raise Untokenizable(Reason.REJECTED, "'tool_choice' must be none, auto, required or a named tool")
    return dumped


def prepare_sglang(
    body: Mapping[str, Any], template: ChatTemplate, specials: Mapping[str, str]
) -> ChatPrompt:
    """A chat completion request as SGLang 0.5.23 hands it to a jinja template and its tokenizer.

    Not reproduced (Untokenizable, unsupported): tools on messages, ``phase``, ``prefix``,
    ``reasoning``, a ``reasoning_effort`` that is a number rather than a level. Of the JSON Schema
    validity SGLang checks in a tool's parameters only the type names are checked here (it answers 400
    to the rest; the router routes those as if they were valid)."""
    kwargs = dict(_template_kwargs(body))
    continue_final = _bool(body, "continue_final_message", False)
    tools = _sglang_tools(body)
    effort = body.get("reasoning_effort")
    if body.get("reasoning") is not None or not (effort is None or effort in _SGLANG_EFFORTS):
        raise Untokenizable(Reason.UNSUPPORTED, "SGLang's reasoning fields beyond a reasoning_effort level")
    fmt = template.sglang_content_format
    messages = [_sglang_message(m, fmt) for m in body["messages"]]
    suffix = None
    last = messages[-1]
    if last["role"] == "assistant" and isinstance(last["content"], str):
        if continue_final:  # rendered without it, then its text encoded and appended
            suffix, messages = last["content"], messages[:-1]
        else:  # SGLang makes the last message a user one
            messages[-1] = {"role": "user", "content": last["content"]}
    if effort is not None:
        kwargs.setdefault("thinking", effort != "none")
        kwargs.setdefault("enable_thinking", effort != "none")
        kwargs = {"reasoning_effort": effort, **kwargs}
    if _SGLANG_COLLIDING & kwargs.keys():
        raise Untokenizable(Reason.REJECTED, "chat_template_kwargs collide with the render's own arguments")
    variables = {**specials, **kwargs, "tools": tools, "documents": None, "add_generation_prompt": True}
    return ChatPrompt(messages, variables, continue_final=False, add_special_tokens=None, suffix=suffix)


@dataclass(frozen=True, slots=True)
class CompletionFlags:
    """How the engine encodes a completion's text prompt."""

    add_special_tokens: bool
    forced_bos: bool = False  # SGLang: a BOS the tokenizer class adds (``add_bos_token``) on top


def completion_flags(body: Mapping[str, Any], family: Family) -> CompletionFlags:
    """A text completion request's encode flags, by the engine family's rules. Raises Untokenizable:
    vLLM refuses an empty prompt and ``suffix``, and keeps only the last ``truncate_prompt_tokens``
    tokens (not reproduced: a prefix match on the whole prompt would be a false hit). SGLang ignores
    ``add_special_tokens``, ``suffix`` and truncation, and its tokenizer class adds a BOS where the
    checkpoint's config asks (``add_bos_token``)."""
    if body.get("prompt") == "":
        raise Untokenizable(Reason.REJECTED, "an empty prompt")
    if family is Family.SGLANG:
        return CompletionFlags(add_special_tokens=True, forced_bos=True)
    if body.get("suffix") is not None:
        raise Untokenizable(Reason.REJECTED, "'suffix' (vLLM renders no fill-in-the-middle)")
    if body.get("truncate_prompt_tokens") is not None:
        raise Untokenizable(Reason.UNSUPPORTED, "'truncate_prompt_tokens' keeps the prompt's end")
    return CompletionFlags(add_special_tokens=_bool(body, "add_special_tokens", True))


def prepare(
    body: Mapping[str, Any], family: Family, template: ChatTemplate, specials: Mapping[str, str]
) -> ChatPrompt:
    if family is Family.VLLM:
        return prepare_vllm(body, template, specials)
    return prepare_sglang(body, template, specials)
