"""The paths the public port serves besides the prompt-bearing ones, and the rule for the rest.

Engines serve more than generation: embeddings, pooling, classification, scoring and reranking,
tokenization, audio transcription. Those carry no prefix worth routing on, so they go to a healthy
engine by load (``FORWARDED``). Engines also serve administrative paths (vLLM's adapter loading,
``/reset_prefix_cache``, ``/sleep``; SGLang's ``/flush_cache``, weight updates) that a public router
must never pass through: every path not served here is refused with an OpenAI-style 404 naming it,
unless an operator adds it (``--allow-path``, any method, by load as well).
"""

from __future__ import annotations

import re

from ..scheduling.types import Kind

# POST paths forwarded to one engine by load, as vLLM 0.33 and SGLang 0.5 spell them (several have a
# /v1 twin in one engine or the other).
FORWARDED = (
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/tokenize",
    "/detokenize",
    "/v1/tokenize",
    "/v1/detokenize",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/messages/count_tokens",  # Anthropic's: a count, nothing generated
)

# A stored response's own paths, after ``/v1/responses/{response_id}``, and the methods each serves (a
# GET also HEAD): the proxy's routes, and what the endpoint picker checks a path it is shown against.
RESPONSE_ITEM = {"": ("GET", "DELETE"), "/cancel": ("POST",), "/input_items": ("GET",)}

# The POST paths whose prompt is routed on (the API each speaks), for a front door that sees paths
# only (the gateway's endpoint picker); the proxy registers a handler per path.
ROUTED = {
    "/v1/completions": Kind.COMPLETION,
    "/v1/chat/completions": Kind.CHAT,
    "/v1/responses": Kind.RESPONSES,
    "/v1/messages": Kind.MESSAGES,
    "/generate": Kind.GENERATE,
    "/inference/v1/generate": Kind.TOKEN_GENERATE,
}

# The router's own paths on the public port: an allow-list entry may not shadow one.
OWN = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/responses",
    "/v1/messages",
    "/generate",
    "/inference/v1/generate",
    "/healthz",
    "/readyz",
    "/metrics",
)
_OWN_PREFIXES = ("/debug/", "/v1/responses/")

_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/-]{0,255}")


def allowed_path(value: str) -> str:
    """A ``--allow-path`` value, vetted: an absolute path without a query, dot segments or a
    router path; raises ``ValueError`` saying what is wrong."""
    if not _PATH.fullmatch(value):
        raise ValueError(f"{value[:60]!r} is not an absolute URL path (no query, at most 256 characters)")
    if any(seg in (".", "..") for seg in value.split("/")):
        raise ValueError(f"{value!r} has a dot segment")
    if value in OWN or value in FORWARDED or value.startswith(_OWN_PREFIXES):
        raise ValueError(f"{value!r} is served by the router already")
    return value
