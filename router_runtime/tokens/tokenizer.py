"""The router's tokenizers for prefix matching, and their off-loop use.

``--tokenizer bytes`` is the byte tokenizer and its one chat template (what the fake engine uses);
``--tokenizer PATH`` is a Hugging Face tokenizer directory (``hf.py``). Either way the router only
tokenizes when its policy matches tokens, and a prompt larger than ``inline_max_bytes`` is tokenized
on a thread pool so a long prompt never stalls the event loop.

A chat request the tokenizer cannot render (no template, a template error, content parts it cannot
carry) is routed without tokens: the engine is the judge of what is valid, not the router.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

from . import bytes_tokenizer
from .hf import ChatTemplateError, HFTokenizer, TokenizerError

__all__ = [
    "AsyncTokenizer",
    "BytesTokenizer",
    "ChatTemplateError",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> Sequence[int]:
        """A completion prompt's token IDs (with the special tokens the engine adds)."""
        ...

    def encode_unlocked(self, text: str) -> Sequence[int]:
        """``encode``, for a worker thread (releases the GIL where the implementation can)."""
        ...

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
    ) -> str:
        """The chat prompt text; raises ChatTemplateError (or ValueError) when it cannot render."""
        ...

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        unlocked: bool = False,
    ) -> Sequence[int]: ...


class BytesTokenizer:
    """The byte tokenizer (token IDs = UTF-8 bytes) with the shared trivial chat template."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return bytes_tokenizer.encode(text)

    encode_unlocked = encode

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
    ) -> str:
        return bytes_tokenizer.render_chat(messages)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        unlocked: bool = False,
    ) -> list[int]:
        return bytes_tokenizer.encode(bytes_tokenizer.render_chat(messages))


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"`` or a Hugging Face tokenizer directory. Raises TokenizerError. Cached, so the command
    line can validate the flag and the router reuse the loaded tokenizer."""
    if spec == "bytes":
        return BytesTokenizer()
    return HFTokenizer.from_dir(spec)


class AsyncTokenizer:
    """A tokenizer used from the event loop: inline for small prompts, on ``executor`` for large ones.

    ``size`` is what the caller knows cheaply about the prompt's size (the request body's length);
    above ``inline_max_bytes`` the work moves to the pool."""

    def __init__(self, tokenizer: Tokenizer, executor: Executor | None, inline_max_bytes: int = 16 << 10):
        self.tokenizer = tokenizer
        self.executor = executor
        self.inline_max_bytes = inline_max_bytes

    def _offload(self, size: int) -> bool:
        return self.executor is not None and size > self.inline_max_bytes

    async def prompt(self, text: str, size: int) -> Sequence[int]:
        tok = self.tokenizer
        if self._offload(size):
            return await asyncio.get_running_loop().run_in_executor(self.executor, tok.encode_unlocked, text)
        return tok.encode(text)

    async def chat_tokens(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None, size: int
    ) -> Sequence[int] | None:
        """None when the tokenizer cannot render these messages."""
        tok = self.tokenizer
        try:
            if self._offload(size):
                fn = functools.partial(tok.encode_chat, messages, template_kwargs, unlocked=True)
                return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
            return tok.encode_chat(messages, template_kwargs)
        except ValueError:  # ChatTemplateError included
            return None

    async def chat_text(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None, size: int
    ) -> str | None:
        tok = self.tokenizer
        try:
            if self._offload(size):
                fn = functools.partial(tok.render_chat, messages, template_kwargs)
                return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
            return tok.render_chat(messages, template_kwargs)
        except ValueError:
            return None
