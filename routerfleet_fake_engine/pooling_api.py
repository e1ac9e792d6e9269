"""The pooling endpoints of the fake engine (pure, no I/O): embeddings, pooling, classify, score and
rerank, in the response shapes of vLLM 0.33. Vectors and scores are deterministic functions of the
input's tokens (the byte tokenizer), so a test can check that an answer belongs to its request."""

from __future__ import annotations

import base64
import struct
from typing import Any

from router_runtime.tokens import encode

from .openai_api import RequestError

DIM = 8  # embedding width


def _texts(body: Any, field: str = "input") -> list[str | list[int]]:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    v = body.get(field)
    if isinstance(v, str) or (isinstance(v, list) and v and all(type(t) is int for t in v)):
        return [v]
    if isinstance(v, list) and v and all(isinstance(x, str | list) for x in v):
        return v
    raise RequestError(
        f"'{field}' must be a string, a list of token IDs, or a non-empty list of those", field
    )


def _tokens(x: str | list[int]) -> list[int]:
    if isinstance(x, str):
        return encode(x)
    if not x or not all(type(t) is int and t >= 0 for t in x):
        raise RequestError("token IDs must be non-negative integers", "input")
    return list(x)


def vector(tokens: list[int]) -> list[float]:
    """The fake model's embedding of ``tokens``: a unit-free function of their sum and length."""
    s = sum(tokens) + len(tokens)
    return [((s * (i + 1)) % 1000) / 1000 for i in range(DIM)]


def _encoded(v: list[float], fmt: str) -> list[float] | str:
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if fmt == "base64" else v


def _score(a: list[int], b: list[int]) -> float:
    """Shared tokens over all tokens (a toy relevance in [0, 1])."""
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 0.0


def _usage(n: int) -> dict[str, Any]:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


def _model(body: dict, default: str) -> str:
    """The request's model name, else the engine's."""
    return body["model"] if isinstance(body.get("model"), str) else default


def _listing(kind: str, body: dict, model: str, data: list, tokens: int) -> dict[str, Any]:
    """vLLM's envelope of a pooling answer: a list of ``data`` with the usage of ``tokens``."""
    return {
        "id": f"{kind}-fake",
        "object": "list",
        "created": 0,
        "model": _model(body, model),
        "data": data,
        "usage": _usage(tokens),
    }


def embeddings(body: Any, model: str) -> dict[str, Any]:
    """``encoding_format`` ``base64`` (the OpenAI SDK's default) packs each vector as little-endian
    float32, as vLLM does."""
    inputs = [_tokens(x) for x in _texts(body)]
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    data = [
        {"index": i, "object": "embedding", "embedding": _encoded(vector(t), fmt)}
        for i, t in enumerate(inputs)
    ]
    return _listing("embd", body, model, data, sum(map(len, inputs)))


def pooling(body: Any, model: str) -> dict[str, Any]:
    inputs = [_tokens(x) for x in _texts(body)]
    data = [{"index": i, "object": "pooling", "data": vector(t)} for i, t in enumerate(inputs)]
    return _listing("pool", body, model, data, sum(map(len, inputs)))


def classify(body: Any, model: str) -> dict[str, Any]:
    inputs = [_tokens(x) for x in _texts(body)]
    data = []
    for i, t in enumerate(inputs):
        p = vector(t)[0]
        data.append(
            {"index": i, "label": "LABEL_1" if p >= 0.5 else "LABEL_0", "probs": [1 - p, p], "num_classes": 2}
        )
    return _listing("classify", body, model, data, sum(map(len, inputs)))


def score(body: Any, model: str) -> dict[str, Any]:
    """``text_1`` against each of ``text_2`` (either may be one text or a list)."""
    queries = [_tokens(x) for x in _texts(body, "text_1")]
    docs = [_tokens(x) for x in _texts(body, "text_2")]
    if len(queries) == 1:
        queries *= len(docs)
    if len(queries) != len(docs):
        raise RequestError("'text_1' must be one text or as many as 'text_2'", "text_1")
    pairs = enumerate(zip(queries, docs, strict=True))
    data = [{"index": i, "object": "score", "score": _score(q, d)} for i, (q, d) in pairs]
    return _listing("score", body, model, data, sum(map(len, queries)) + sum(map(len, docs)))


def rerank(body: Any, model: str) -> dict[str, Any]:
    """``documents`` ordered by relevance to ``query``, the ``top_n`` first (default all)."""
    if not isinstance(body, dict) or not isinstance(body.get("query"), str):
        raise RequestError("'query' (a string) is required", "query")
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise RequestError("'documents' must be a non-empty list of strings", "documents")
    top_n = body.get("top_n", len(docs))
    if type(top_n) is not int or top_n < 1:
        raise RequestError("'top_n' must be a positive integer", "top_n")
    q = encode(body["query"])
    scored = sorted(((_score(q, encode(d)), i) for i, d in enumerate(docs)), key=lambda x: (-x[0], x[1]))
    results = [{"index": i, "document": {"text": docs[i]}, "relevance_score": s} for s, i in scored[:top_n]]
    usage = {"total_tokens": len(q) + sum(len(encode(d)) for d in docs)}
    return {"id": "rerank-fake", "model": _model(body, model), "usage": usage, "results": results}
