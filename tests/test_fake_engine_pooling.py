"""The fake engine's pooling shapes (pooling_api.py) and detokenize, as pure functions: the fields
vLLM 0.33 answers with, deterministic values, and a 400 for what vLLM refuses."""

from __future__ import annotations

import base64
import struct

import pytest

from router_runtime.tokens import encode
from routerfleet_fake_engine import pooling_api as P
from routerfleet_fake_engine.openai_api import RequestError, detokenize_request


def test_embeddings_one_vector_per_input_and_the_same_for_the_same_tokens():
    out = P.embeddings({"input": ["fox", encode("fox"), "dog"]}, "m")
    assert out["object"] == "list" and out["model"] == "m"
    vecs = [d["embedding"] for d in out["data"]]
    assert [d["index"] for d in out["data"]] == [0, 1, 2] and all(len(v) == P.DIM for v in vecs)
    assert vecs[0] == vecs[1] != vecs[2]
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == 9


def test_pooling_and_classify_shapes():
    assert P.pooling({"input": "x", "model": "p"}, "m")["data"][0]["data"] == P.vector(encode("x"))
    c = P.classify({"input": ["a", "b"]}, "m")["data"]
    assert [x["num_classes"] for x in c] == [2, 2] and all(abs(sum(x["probs"]) - 1) < 1e-9 for x in c)


def test_score_pairs_one_query_with_each_document():
    out = P.score({"text_1": "fox", "text_2": ["fox", "zzz"]}, "m")["data"]
    assert [d["score"] for d in out] == [1.0, 0.0]
    with pytest.raises(RequestError, match="as many"):
        P.score({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "m")


def test_rerank_orders_by_relevance_and_keeps_top_n():
    out = P.rerank({"query": "fox", "documents": ["dog", "the fox", "fox"], "top_n": 2}, "m")
    assert [r["index"] for r in out["results"]] == [2, 1]
    assert out["results"][0]["document"] == {"text": "fox"}
    for bad in (
        {"documents": ["a"]},
        {"query": "q", "documents": []},
        {"query": "q", "documents": ["a"], "top_n": 0},
    ):
        with pytest.raises(RequestError):
            P.rerank(bad, "m")


@pytest.mark.parametrize("body", [{}, {"input": 3}, {"input": []}, {"input": [[1, -2]]}, [1]])
def test_bad_inputs_are_request_errors(body):
    with pytest.raises(RequestError):
        P.embeddings(body, "m")


def test_detokenize_inverts_tokenize():
    assert detokenize_request({"tokens": encode("héllo")}) == "héllo"
    with pytest.raises(RequestError, match="tokens"):
        detokenize_request({"tokens": "x"})


def test_embeddings_in_base64_are_little_endian_float32():
    b64 = P.embeddings({"input": "fox", "encoding_format": "base64"}, "m")["data"][0]["embedding"]
    as_float32 = struct.unpack(f"<{P.DIM}f", struct.pack(f"<{P.DIM}f", *P.vector(encode("fox"))))
    assert struct.unpack(f"<{P.DIM}f", base64.b64decode(b64)) == as_float32
    with pytest.raises(RequestError, match="encoding_format"):
        P.embeddings({"input": "fox", "encoding_format": "int8"}, "m")
