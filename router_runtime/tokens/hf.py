"""A Hugging Face tokenizer for routing: ``tokenizer.json`` through the ``tokenizers`` library, and the
chat template chosen and rendered as the engines' tokenizer library does (``template.py``), after the
engine family's own request normalization (``chat.py``; docs/tokens.md).

Completions are encoded with the tokenizer's special tokens (a BOS, for most models), as the engines
encode a text prompt; a rendered chat prompt already carries them, so it is encoded without unless the
request asks (``add_special_tokens``).

``tokenizers``' ``encode`` holds the GIL for the whole call while ``encode_batch`` releases it, so the
thread-pool path (``unlocked``) uses a batch of one: the event loop keeps running meanwhile.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import Any

from .chat import ChatPrompt, Family, Reason, Untokenizable, completion_flags, prepare
from .template import ChatTemplate, TemplateRenderError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
# The library's named special tokens; a config's other ``*_token`` keys join them as template variables.
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be loaded; the message is fit for the command line."""


def _special(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or a serialized AddedToken object.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _specials(cfg: Mapping[str, Any]) -> dict[str, str]:
    out = {k: v for k in _SPECIAL_KEYS if (v := _special(cfg.get(k))) is not None}
    for k, v in cfg.items():  # model-specific ones (image_token, ...)
        if k.endswith("_token") and k not in out and (v := _special(v)) is not None:
            out[k] = v
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        out.update({k: v for k, raw in extra.items() if (v := _special(raw)) is not None})
    return out


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read {path!r}: {e}") from None


def _templates(path: str, cfg: Mapping[str, Any]) -> dict[str, str]:
    """The directory's chat templates by name, as the library loads them: ``chat_template.jinja`` and
    ``additional_chat_templates/*.jinja`` take priority over the config's ``chat_template`` (a string,
    or a list of ``{"name", "template"}``). A single template is named "default"."""
    files: dict[str, str] = {}
    if os.path.isfile(os.path.join(path, TEMPLATE_FILE)):
        files["default"] = _read(os.path.join(path, TEMPLATE_FILE))
    extra_dir = os.path.join(path, TEMPLATE_DIR)
    if os.path.isdir(extra_dir):
        for name in sorted(os.listdir(extra_dir)):
            if name.endswith(".jinja"):
                files[name.removesuffix(".jinja")] = _read(os.path.join(extra_dir, name))
    if files:
        return files
    value = cfg.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, Mapping)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
    return {}


class HFTokenizer:
    """``tokenizer.json`` (+ optional ``tokenizer_config.json`` and template files) from one directory.

    ``chat_template``: the engine's own override (vLLM and SGLang ``--chat-template``), a template or the
    name of one of the directory's named templates; it wins over the directory's."""

    def __init__(
        self,
        tokenizer: Any,
        templates: Mapping[str, str],
        special_tokens: Mapping[str, str],
        name: str,
        *,
        family: Family = Family.VLLM,
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ):
        self.name = name
        self.family = family
        self._tok = tokenizer
        self._special = dict(special_tokens)
        self._add_bos = add_bos_token  # the config's; only SGLang's tokenizer classes act on it
        sources = dict(templates)
        if chat_template is not None and chat_template not in sources:
            sources = {"default": chat_template}  # a literal override replaces the directory's set
        self._given = chat_template if chat_template in templates else None
        self._templates = {k: ChatTemplate(v) for k, v in sources.items()}

    @classmethod
    def from_dir(
        cls, path: str, *, family: Family = Family.VLLM, chat_template: str | None = None
    ) -> HFTokenizer:
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
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(path, CONFIG_FILE)
        if os.path.isfile(cfg_path):
            try:
                cfg = json.loads(_read(cfg_path))
            except json.JSONDecodeError as e:
                raise TokenizerError(f"cannot read {cfg_path!r}: {e}") from None
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_path!r} is not a JSON object")
        try:
            return cls(
                tokenizer,
                _templates(path, cfg),
                _specials(cfg),
                name=os.path.abspath(path),
                family=family,
                chat_template=chat_template,
                add_bos_token=cfg.get("add_bos_token") is True,
            )
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise TokenizerError(f"invalid chat template in {path!r}: {e}") from None

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def has_named(self, name: str) -> bool:
        return self._given == name

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def _encode(self, text: str, specials: bool, unlocked: bool) -> list[int]:
        try:
            if unlocked:  # encode_batch releases the GIL while the Rust side works (for the thread pool)
                return self._tok.encode_batch([text], add_special_tokens=specials)[0].ids
            return self._tok.encode(text, add_special_tokens=specials).ids
        except TypeError:  # the library's answer to a lone surrogate: say what it is
            text.encode("utf-8")
            raise

    @functools.cached_property
    def _adds_to_empty(self) -> bool:
        return bool(self._tok.encode("", add_special_tokens=True).ids)

    @functools.cached_property
    def _class_bos(self) -> int | None:
        """The BOS SGLang's tokenizer class adds on top of ``tokenizer.json`` when the config says
        ``add_bos_token`` and the file's post-processor does not add it (DeepSeek-V3's files)."""
        bos = self._special.get("bos_token")
        bos_id = self._tok.token_to_id(bos) if bos is not None and self._add_bos else None
        if bos_id is None or self._tok.encode("a", add_special_tokens=True).ids[:1] == [bos_id]:
            return None
        return bos_id

    def prompt_ids(self, text: str, body: Mapping[str, Any], *, unlocked: bool = False) -> list[int]:
        flags = completion_flags(body, self.family)
        ids = self._encode(text, flags.add_special_tokens, unlocked)
        if flags.forced_bos and self._class_bos is not None:
            ids = [self._class_bos, *ids]
        return ids

    def template_for(self, tools: bool) -> ChatTemplate:
        """The template the engine would use: the override, else "tool_use" when tools are sent (vLLM),
        else "default" (SGLang: the first, for lack of its --hf-chat-template-name)."""
        t = self._templates
        if not t:
            raise Untokenizable(Reason.NO_TEMPLATE, "the tokenizer has no chat template")
        if self._given is not None:
            return t[self._given]
        if len(t) == 1 or self.family is Family.SGLANG:
            return next(iter(t.values()))
        if tools and "tool_use" in t:
            return t["tool_use"]
        if "default" in t:
            return t["default"]
        raise Untokenizable(Reason.NO_TEMPLATE, "several chat templates and none named 'default'")

    def prepare(self, body: Mapping[str, Any]) -> tuple[ChatTemplate, ChatPrompt]:
        template = self.template_for(body.get("tools") is not None)
        return template, prepare(body, self.family, template, self._special)

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The prompt text the engine renders for this chat request; raises Untokenizable."""
        template, prompt = self.prepare(body)
        return self._render(template, prompt) + (prompt.suffix or "")  # SGLang appends the continuation

    def _render(self, template: ChatTemplate, prompt: ChatPrompt) -> str:
        try:
            return template.render(prompt.messages, prompt.variables, prompt.continue_final)
        except TemplateRenderError as e:
            raise Untokenizable(Reason.TEMPLATE_ERROR, str(e)) from None

    def chat_ids(self, body: Mapping[str, Any], *, unlocked: bool = False) -> list[int]:
        """The token IDs the engine computes for this chat request; raises Untokenizable."""
        template, prompt = self.prepare(body)
        text = self._render(template, prompt)
        specials = prompt.add_special_tokens
        if specials is None:  # SGLang: only for a tokenizer that adds nothing to an empty text
            specials = not self._adds_to_empty and self._class_bos is None
        ids = self._encode(text, specials, unlocked)
        if prompt.suffix:
            tail = self._encode(prompt.suffix, True, unlocked)
            bos = self._special.get("bos_token")
            if tail and bos is not None and tail[0] == self._tok.token_to_id(bos):
                tail = tail[1:]
            ids = [*ids, *tail]
        return ids
