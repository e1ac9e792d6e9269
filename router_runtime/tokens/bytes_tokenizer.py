"""The deterministic byte tokenizer and the one chat template shared by the fake engine and the router.

Token IDs are the prompt's UTF-8 bytes (0..255), so both sides tokenize any text identically with no
vocabulary file, and a token list always decodes back to the text it came from. The chat template is
deliberately trivial; what matters is that there is exactly one, so a chat request hashes to the same
blocks in the router and in the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

VOCAB_SIZE = 256

# The template's markers. Plain text (not special tokens): they tokenize as their bytes like the content.
ROLE_OPEN = "<|"
ROLE_CLOSE = "|>\n"
ASSISTANT_PROMPT = "<|assistant|>\n"


def encode(text: str) -> list[int]:
    """Text to token IDs: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(token_ids: Iterable[int]) -> str:
    """Token IDs to text. IDs outside 0..255 (possible when a client sent raw IDs) are dropped, and
    invalid UTF-8 sequences become U+FFFD rather than raising: decoding must never fail a request."""
    return bytes(t for t in token_ids if 0 <= t < VOCAB_SIZE).decode("utf-8", errors="replace")


def _content_text(content: Any) -> str:
    # OpenAI allows a string, null (assistant tool-call turns), or a list of content parts; only text
    # parts carry tokens here, other part types (images...) are rejected so nothing is silently dropped.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError("message content must be a string, a list of text parts, or null")


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """Render OpenAI chat messages into the prompt text both the router and the engine tokenize.

    Each message becomes ``<|{role}|>\\n{content}\\n``, then ``<|assistant|>\\n`` opens the reply::

        render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        == "<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n"

    A later turn repeats earlier messages verbatim, so it extends the earlier prompt as a prefix (the
    property prefix caching relies on). Raises ValueError on a malformed message list.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise ValueError("messages must be a non-empty list")
    out: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError("each message needs a non-empty string role")
        out.append(f"{ROLE_OPEN}{role}{ROLE_CLOSE}{_content_text(message.get('content'))}\n")
    out.append(ASSISTANT_PROMPT)
    return "".join(out)


def tokenize_chat(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """``encode(render_chat(messages))``: the token IDs of a chat request."""
    return encode(render_chat(messages))
