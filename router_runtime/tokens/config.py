"""The tokenizer's configuration section (``RouterConfig.tokens``) and its flags."""

from __future__ import annotations

from dataclasses import dataclass

from ..flags import Count, Flag, Ms, Text
from .chat import Family


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    tokenizer: str = "bytes"  # "bytes", a Hugging Face tokenizer directory, or "engine"
    chat_family: Family = Family.VLLM  # whose chat preprocessing the router reproduces
    chat_template: str | None = None  # the engines' own --chat-template (a file, or a template name)
    engine_timeout_s: float = 0.1  # --tokenizer engine: the deadline of one tokenize call
    threads: int = 0  # 0: min(4, CPUs)
    inline_max_bytes: int = 16 << 10  # larger request bodies tokenize (and parse) on the pool


FLAGS = (
    Flag(
        "--tokenizer",
        "tokens.tokenizer",
        Text(),
        metavar="bytes|PATH",
        help="tokenizer for prefix matching: 'bytes' (the fake engine's), a directory holding a"
        " Hugging Face tokenizer.json (and tokenizer_config.json or chat_template.jinja for the chat"
        " template), or 'engine' (the engines' own tokenize endpoint, under"
        " --engine-tokenize-timeout-ms)",
    ),
    Flag(
        "--engine-tokenize-timeout-ms",
        "tokens.engine_timeout_s",
        Ms(1),
        "with --tokenizer engine: the deadline of one tokenize call; past it the request routes"
        " without tokens",
    ),
    Flag(
        "--chat-family",
        "tokens.chat_family",
        Text(Family, choices=tuple(Family)),
        "whose chat preprocessing to reproduce, as the engines behind the router run it",
    ),
    Flag(
        "--chat-template",
        "tokens.chat_template",
        Text(),
        metavar="FILE|NAME",
        default_text="the tokenizer's own",
        help="the chat template the engines are started with (their --chat-template): a file, or the"
        " name of one of the tokenizer's named templates",
    ),
    Flag(
        "--tokenizer-threads",
        "tokens.threads",
        Count(1),
        "tokenizer thread pool",
        default_text="min(4, CPUs)",
    ),
)
