"""A Hugging Face tokenizer for routing: ``tokenizer.json`` through the ``tokenizers`` library, and the
chat template from ``tokenizer_config.json`` rendered in a sandboxed jinja2 environment, as vLLM and
SGLang do (``add_generation_prompt=True``, bos/eos and the other special tokens from the config).

Completions are encoded with the tokenizer's special tokens (a BOS, for most models), as the engines
encode a text prompt; a rendered chat prompt already carries them, so it is encoded without.

``tokenizers``' ``encode`` holds the GIL for the whole call while ``encode_batch`` releases it, so the
thread-pool path (``encode_unlocked``) uses a batch of one: the event loop keeps running meanwhile.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded; the message is fit for the command line."""


class ChatTemplateError(ValueError):
    """A chat request the template cannot render (or no template): route it without tokens."""


def _special(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or a serialized AddedToken object.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any) -> str | None:
    # Either one template string, or a list of {"name", "template"}, of which "default" is the one used.
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
    ):
        # transformers' override: non-ASCII kept as is (jinja's own tojson escapes it for HTML).
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class HFTokenizer:
    """``tokenizer.json`` (+ optional ``tokenizer_config.json``) from one directory."""

    def __init__(
        self, tokenizer: Any, chat_template: str | None, special_tokens: Mapping[str, str], name: str
    ):
        self.name = name
        self._tok = tokenizer
        self._template = _compile_template(chat_template) if chat_template else None
        self._special = dict(special_tokens)

    @classmethod
    def from_dir(cls, path: str) -> HFTokenizer:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - a declared dependency
            raise TokenizerError("the 'tokenizers' package is not installed") from None
        tok_path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isdir(path):
            raise TokenizerError(f"{path!r} is not a directory (expected 'bytes' or a tokenizer directory)")
        if not os.path.isfile(tok_path):
            raise TokenizerError(f"no {TOKENIZER_FILE} in {path!r}")
        try:
            tokenizer = Tokenizer.from_file(tok_path)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load {tok_path!r}: {e}") from None
        template, special = None, {}
        cfg_path = os.path.join(path, CONFIG_FILE)
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise TokenizerError(f"cannot read {cfg_path!r}: {e}") from None
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_path!r} is not a JSON object")
            template = _pick_template(cfg.get("chat_template"))
            special = {k: v for k in _SPECIAL_KEYS if (v := _special(cfg.get(k))) is not None}
        if template is None:  # newer checkpoints ship the template as its own file
            jinja_path = os.path.join(path, "chat_template.jinja")
            if os.path.isfile(jinja_path):
                with open(jinja_path, encoding="utf-8") as f:
                    template = f.read()
        try:
            return cls(tokenizer, template, special, name=os.path.abspath(path))
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise TokenizerError(f"invalid chat template in {path!r}: {e}") from None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_unlocked(self, text: str) -> list[int]:
        """``encode`` that releases the GIL while the Rust side works (for the thread pool)."""
        return self._tok.encode_batch([text], add_special_tokens=True)[0].ids

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
    ) -> str:
        if self._template is None:
            raise ChatTemplateError("the tokenizer has no chat template")
        kwargs = {**self._special, **(template_kwargs or {})}
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **kwargs)
        except Exception as e:  # template errors, raise_exception(), sandbox violations
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}") from None

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        unlocked: bool = False,
    ) -> list[int]:
        text = self.render_chat(messages, template_kwargs)
        if unlocked:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids
