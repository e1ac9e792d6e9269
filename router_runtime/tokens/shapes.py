"""The other prompt-bearing request shapes as the chat request the engine renders for them (pure).

vLLM serves OpenAI's Responses API and Anthropic's Messages API by turning the request into chat
messages and rendering them with the chat template, as a chat completion: so the router tokenizes
them by building that chat body and handing it to the chat rules (``chat.py``). Only what the router
can reproduce exactly is converted: text content, the roles as given, the instructions or system
prompt first. Anything else (tools, tool calls and results, reasoning items, media, a
``previous_response_id`` whose history only the engine holds) raises ``Untokenizable`` and the request
is routed without tokens, counted, never on a guessed sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .chat import BILLING_HEADER, Reason, Untokenizable

# The Responses API's text parts and what carries their text.
_RESPONSES_TEXT_PARTS = ("input_text", "output_text")
_RESPONSES_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
_ANTHROPIC_MEDIA_BLOCKS = ("image", "document")


def _text_part(text: Any, where: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise Untokenizable(Reason.REJECTED, f"a {where} without its text")
    return {"type": "text", "text": text}


def _responses_content(content: Any) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Untokenizable(Reason.REJECTED, "a message's 'content' must be a string or a list of parts")
    parts = []
    for part in content:
        t = part.get("type") if isinstance(part, Mapping) else None
        if t in _RESPONSES_TEXT_PARTS:
            parts.append(_text_part(part.get("text"), f"{t!r} part"))
        elif t in _RESPONSES_MEDIA_PARTS:
            raise Untokenizable(Reason.MULTIMODAL, f"a {t!r} part")
        else:
            raise Untokenizable(Reason.UNSUPPORTED, "a content part that is not text")
    return parts


def _assistant_text(content: Any) -> str:
    # vLLM keeps an assistant item's first part only (its output_text)
    if isinstance(content, str):
        return content
    first = content[0] if isinstance(content, list) and content else None
    if not isinstance(first, Mapping) or first.get("type") not in _RESPONSES_TEXT_PARTS:
        raise Untokenizable(Reason.UNSUPPORTED, "an assistant item without output text")
    return _text_part(first.get("text"), "output_text part")["text"]


def responses_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses API request body -> the chat body vLLM renders for it (``construct_input_messages``:
    the instructions as a system message, then the input items; the generation prompt added); raises
    Untokenizable."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        raise Untokenizable(Reason.UNSUPPORTED, "a conversation whose history the engine holds")
    if body.get("tools") or body.get("prompt") is not None or body.get("reasoning") is not None:
        raise Untokenizable(Reason.UNSUPPORTED, "tools, reasoning options or a stored prompt template")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise Untokenizable(Reason.REJECTED, "'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list) and items:
        for item in items:
            if not isinstance(item, Mapping) or item.get("type", "message") != "message":
                raise Untokenizable(Reason.UNSUPPORTED, "an input item that is not a message")
            role = item.get("role")
            if not isinstance(role, str) or not role:
                raise Untokenizable(Reason.REJECTED, "an input message without a role")
            if role != "assistant":
                messages.append({"role": role, "content": _responses_content(item.get("content"))})
            elif item.get("status") in ("in_progress", "incomplete"):  # vLLM continues it instead
                raise Untokenizable(Reason.UNSUPPORTED, "an unfinished assistant item")
            else:
                messages.append({"role": role, "content": _assistant_text(item.get("content"))})
    else:
        raise Untokenizable(Reason.REJECTED, "'input' must be a string or a non-empty list of items")
    return {"messages": messages}


def _anthropic_blocks(content: Any) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise Untokenizable(Reason.REJECTED, "'content' must be a string or a list of blocks")
    blocks = []
    for block in content:
        t = block.get("type") if isinstance(block, Mapping) else None
        if t == "text":
            blocks.append(_text_part(block.get("text"), "text block"))
        elif t in _ANTHROPIC_MEDIA_BLOCKS:
            raise Untokenizable(Reason.MULTIMODAL, f"a {t!r} block")
        else:
            raise Untokenizable(Reason.UNSUPPORTED, "a content block that is not text")
    return blocks


def _anthropic_content(content: Any) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    blocks = _anthropic_blocks(content)
    return blocks[0]["text"] if len(blocks) == 1 else blocks  # one text block is sent as a string


def messages_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request body -> the chat body vLLM renders for it (the system prompt first,
    its text blocks joined without a separator, a Claude Code attribution block left out; one text
    block sent as a string); raises Untokenizable."""
    if body.get("tools") or body.get("thinking") is not None:
        raise Untokenizable(Reason.UNSUPPORTED, "tools or extended thinking")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        if not isinstance(system, str):
            texts = [b["text"] for b in _anthropic_blocks(system)]
            system = "".join(t for t in texts if not t.startswith(BILLING_HEADER))
        messages.append({"role": "system", "content": system})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise Untokenizable(Reason.REJECTED, "'messages' must be a non-empty list")
    for m in turns:
        role = m.get("role") if isinstance(m, Mapping) else None
        if role == "system":  # vLLM folds it into the leading system message
            raise Untokenizable(Reason.UNSUPPORTED, "a system message among the turns")
        if role not in ("user", "assistant"):
            raise Untokenizable(Reason.REJECTED, "each message needs the role 'user' or 'assistant'")
        messages.append({"role": role, "content": _anthropic_content(m.get("content"))})
    return {"messages": messages}
