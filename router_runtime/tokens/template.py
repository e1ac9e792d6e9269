"""A chat template as the engines' tokenizer library renders it (Hugging Face transformers), and the
facts about it the engines read before rendering (docs/tokens.md).

Rendering: a sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``, loop controls,
``{% generation %}`` blocks rendered as plain text (they only mark assistant tokens for training masks),
``tojson`` without HTML escaping, ``raise_exception`` and ``strftime_now``. ``continue_final_message``
is done the library's way: a tag appended to the last message's text, the whole chat rendered, the
output cut at the tag.

Facts, each computed once per template:
- ``content_format``: "openai" when the template loops over a message's ``content`` (so it expects a
  list of parts), else "string", the way vLLM detects it: loops over ``messages`` or an alias of it,
  then loops over ``<message>.content``, over a macro parameter bound to it, or over a bare ``content``
  outside macros. SGLang's rule is cruder (``sglang_content_format``).
- ``mentions_developer``: whether the template knows the ``developer`` role.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ContentFormat(enum.StrEnum):
    STRING = "string"  # message content is one string (text parts joined)
    OPENAI = "openai"  # message content stays a list of {"type": ...} parts


class TemplateRenderError(ValueError):
    """The template refused the chat (``raise_exception``, a sandbox violation, a type error, a
    variable that collides with the render's own arguments)."""


class _Generation(jinja2.ext.Extension):
    # ``{% generation %}...{% endgeneration %}``: the body, unchanged.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False):
    # The library's override: non-ASCII kept as is (jinja's own tojson escapes it for HTML).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    """One jinja chat template. Raises jinja2.TemplateSyntaxError when it does not compile."""

    def __init__(self, source: str):
        self.source = source
        self._ast = _ENV.parse(source)
        self._compiled = _ENV.from_string(source)

    @cached_property
    def content_format(self) -> ContentFormat:
        return ContentFormat.OPENAI if _loops_over_content(self._ast) else ContentFormat.STRING

    @cached_property
    def sglang_content_format(self) -> ContentFormat:
        # SGLang: any mention of a media word, else a literal loop over message/msg/m.content.
        if any(w in self.source for w in ("image", "audio", "video", "vision")):
            return ContentFormat.OPENAI
        for loop in self._ast.find_all(nodes.For):
            it = _unwrap(loop.iter)
            if _key_of(it) == "content" and _name_of(_base(it)) in ("message", "msg", "m"):
                return ContentFormat.OPENAI
        return ContentFormat.STRING

    @cached_property
    def mentions_developer(self) -> bool:
        return '"developer"' in self.source or "'developer'" in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        variables: Mapping[str, Any],
        continue_final: bool = False,
    ) -> str:
        """The prompt text; raises TemplateRenderError. With ``continue_final`` the output ends inside
        the last message, which the model is to continue."""
        final = None
        if continue_final:
            messages, final = self._tag_final(messages)
        try:
            text = self._compiled.render(messages=messages, **variables)
        except Exception as e:  # template errors, raise_exception(), sandbox violations
            raise TemplateRenderError(f"chat template failed: {type(e).__name__}") from None
        if final is None:
            return text
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise TemplateRenderError("the template drops the final message it is asked to continue")
        at = text.rindex(tag)
        # A template that strips the message's trailing space also ate the tag's: trim to match.
        return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()

    def _tag_final(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], str]:
        if not messages or messages[-1].get("content") is None:
            raise TemplateRenderError("continue_final_message needs a final message with content")
        if "content" not in self.source:
            raise TemplateRenderError("continue_final_message with a template that never reads content")
        out = [dict(m) for m in messages]
        last = out[-1]
        content = last["content"]
        if isinstance(content, str):
            last["content"] = content + _CONTINUE_TAG
            return out, content
        if isinstance(content, list):
            parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
            for p in reversed(parts):
                if isinstance(p, dict) and "text" in p:
                    final = p["text"]
                    p["text"] = final + _CONTINUE_TAG
                    last["content"] = parts
                    return out, final
        raise TemplateRenderError("continue_final_message found no text to continue")


# --------------------------------------------------------------------------- content-format detection


def _unwrap(node: nodes.Node) -> nodes.Node:
    # ``messages | reverse``, ``messages[1:]``, ``x is defined`` all stand for what they wrap.
    while (isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        node = node.node
    return node


def _key_of(node: nodes.Node) -> str | None:
    """``x.key`` or ``x['key']`` -> "key"."""
    if isinstance(node, nodes.Getattr):
        return node.attr
    if (
        isinstance(node, nodes.Getitem)
        and isinstance(node.arg, nodes.Const)
        and isinstance(node.arg.value, str)
    ):
        return node.arg.value
    return None


def _base(node: nodes.Node) -> nodes.Node:
    return node.node if isinstance(node, (nodes.Getattr, nodes.Getitem)) else node


def _name_of(node: nodes.Node) -> str | None:
    """A variable read as a dotted name: ``messages``, or ``ns.rest`` for a namespace attribute."""
    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, nodes.Getattr) and (base := _name_of(node.node)) is not None:
        return f"{base}.{node.attr}"
    if isinstance(node, nodes.NSRef):
        return f"{node.name}.{node.attr}"
    return None


def _reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
    """``node`` reads one of ``names`` (or its ``key``), through filters, tests and slices."""
    node = _unwrap(node)
    if key is not None:
        if _key_of(node) != key:
            return False
        node = _base(node)
    return _name_of(node) in names


def _aliases(root: nodes.Template, name: str) -> set[str]:
    """``name`` and every variable set from it: ``{% set m = messages[1:] %}``,
    ``namespace(rest=messages)``, ``{% set ns.rest = messages %}``."""
    found = {name}
    grew = True
    while grew:
        grew = False
        for assign in root.find_all(nodes.Assign):
            new: list[str] = []
            value = assign.node
            target = _name_of(assign.target)
            if target is not None and _reads(value, found):
                new.append(target)
            elif (
                isinstance(assign.target, nodes.Name)
                and isinstance(value, nodes.Call)
                and _name_of(value.node) == "namespace"
            ):
                new += [f"{assign.target.name}.{kw.key}" for kw in value.kwargs if _reads(kw.value, found)]
            for n in new:
                if n not in found:
                    found.add(n)
                    grew = True
    return found


def _loop_targets(loops: Iterator[nodes.For], sources: set[str], key: str | None = None) -> set[str]:
    return {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, nodes.Name) and _reads(loop.iter, sources, key)
    }


def _loops_over_content(root: nodes.Template) -> bool:
    message_vars = _loop_targets(root.find_all(nodes.For), _aliases(root, "messages"))
    if any(_reads(loop.iter, message_vars, "content") for loop in root.find_all(nodes.For)):
        return True
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        bound: set[str] = set()  # parameters some call site passes a message's content in
        for call in root.find_all(nodes.Call):
            if _name_of(call.node) != macro.name:
                continue
            bound |= {
                params[i]
                for i, a in enumerate(call.args[: len(params)])
                if _reads(a, message_vars, "content")
            }
            bound |= {
                kw.key for kw in call.kwargs if kw.key in params and _reads(kw.value, message_vars, "content")
            }
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if isinstance(loop.iter, nodes.Name) and loop.iter.name in bound:
                return True
    return any(
        id(loop) not in in_macros and isinstance(loop.iter, nodes.Name) and loop.iter.name == "content"
        for loop in root.find_all(nodes.For)
    )
