"""The router's tokenizers for prefix matching, and their off-loop use.

``--tokenizer bytes`` is the byte tokenizer and its one chat template (what the fake engine uses);
``--tokenizer PATH`` is a Hugging Face tokenizer directory (``hf.py``), whose chat requests are prepared
by the engine family's rules (``--chat-family``, ``chat.py``) and rendered with the engine's template
(``--chat-template`` when the engine has one). Either way the router only tokenizes when its policy
matches tokens, and a prompt larger than ``inline_max_bytes`` is tokenized on a thread pool so a long
prompt never stalls the event loop.

A chat request the router cannot tokenize exactly as the engine would (no template, media parts, a
template error, a request the engine rejects) raises ``Untokenizable`` with its reason: it is routed
without tokens and counted. The engine is the judge of what is valid, not the router.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

from . import bytes_tokenizer
from .chat import Family, Reason, Untokenizable, malformed_is_rejected
from .hf import HFTokenizer, TokenizerError

ENGINE_TOKENIZER = "engine"  # --tokenizer engine: the engines tokenize (engine.py)

__all__ = [
    "ENGINE_TOKENIZER",
    "AsyncTokenizer",
    "BytesTokenizer",
    "ChatTemplateSpecError",
    "Family",
    "Reason",
    "Tokenizer",
    "TokenizerError",
    "Untokenizable",
    "load_tokenizer",
]


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> Sequence[int]:
        """A text's token IDs with the tokenizer's special tokens (a completion's, by default)."""
        ...

    def prompt_ids(self, text: str, body: Mapping[str, Any], *, unlocked: bool = False) -> Sequence[int]:
        """A completion prompt's token IDs as the engine computes them for this request body (its
        ``add_special_tokens``, ...); ``unlocked`` for a worker thread (releases the GIL where the
        implementation can). Raises Untokenizable."""
        ...

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """A chat request's prompt text, as the engine renders it; raises Untokenizable."""
        ...

    def chat_ids(self, body: Mapping[str, Any], *, unlocked: bool = False) -> Sequence[int]:
        """A chat request's token IDs, as the engine computes them; raises Untokenizable."""
        ...


class BytesTokenizer:
    """The byte tokenizer (token IDs = UTF-8 bytes) with the shared trivial chat template."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return bytes_tokenizer.encode(text)

    def prompt_ids(self, text: str, body: Mapping[str, Any], *, unlocked: bool = False) -> list[int]:
        return bytes_tokenizer.encode(text)

    def render_chat(self, body: Mapping[str, Any]) -> str:
        try:
            return bytes_tokenizer.render_chat(body["messages"])
        except ValueError as e:
            raise Untokenizable(Reason.REJECTED, str(e)) from None

    def chat_ids(self, body: Mapping[str, Any], *, unlocked: bool = False) -> list[int]:
        return bytes_tokenizer.encode(self.render_chat(body))


class ChatTemplateSpecError(TokenizerError):
    """A ``--chat-template`` that cannot be used (the message names no flag)."""


def _chat_template(spec: str | None) -> str | None:
    """``--chat-template``: a file's text, else the name of one of the tokenizer's named templates."""
    if spec is None or not os.path.isfile(spec):
        return spec
    try:
        with open(spec, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateSpecError(f"cannot read {spec!r}: {e}") from None


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str, family: Family = Family.VLLM, chat_template: str | None = None) -> Tokenizer:
    """``"bytes"`` or a Hugging Face tokenizer directory, with the engine family whose chat rules apply
    and the engine's own ``--chat-template`` (a file, or a template name). Raises TokenizerError. Cached,
    so the command line can validate the flags and the router reuse the loaded tokenizer."""
    if spec == "bytes":
        if chat_template is not None:
            raise ChatTemplateSpecError("needs a tokenizer directory (--tokenizer PATH)")
        return BytesTokenizer()
    tok = HFTokenizer.from_dir(spec, family=family, chat_template=_chat_template(chat_template))
    if chat_template is not None and not os.path.isfile(chat_template) and not tok.has_named(chat_template):
        raise ChatTemplateSpecError(f"{chat_template!r} is neither a file nor a named template of {spec!r}")
    return tok


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

    async def prompt(self, text: str, body: Mapping[str, Any], size: int) -> Sequence[int]:
        """A completion's text prompt; raises Untokenizable, or UnicodeEncodeError for a prompt that is
        not valid Unicode (a 400: no engine can take it)."""
        tok = self.tokenizer
        with malformed_is_rejected(UnicodeEncodeError):
            if self._offload(size):
                fn = functools.partial(tok.prompt_ids, text, body, unlocked=True)
                return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
            return tok.prompt_ids(text, body)

    async def chat_ids(self, body: Mapping[str, Any], size: int) -> Sequence[int]:
        """Raises Untokenizable."""
        tok = self.tokenizer
        with malformed_is_rejected():
            if self._offload(size):
                fn = functools.partial(tok.chat_ids, body, unlocked=True)
                return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
            return tok.chat_ids(body)

    async def chat_text(self, body: Mapping[str, Any], size: int) -> str:
        """Raises Untokenizable."""
        tok = self.tokenizer
        with malformed_is_rejected():
            if self._offload(size):
                return await asyncio.get_running_loop().run_in_executor(self.executor, tok.render_chat, body)
            return tok.render_chat(body)
