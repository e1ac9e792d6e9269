"""Tokenization shared by the router and the fake engine: a byte tokenizer and the one chat template."""

from router_runtime.tokens.bytes_tokenizer import VOCAB_SIZE, decode, encode, render_chat, tokenize_chat

__all__ = ["VOCAB_SIZE", "decode", "encode", "render_chat", "tokenize_chat"]
