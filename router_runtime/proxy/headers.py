"""Header filtering between the client and the engine (pure).

Hop-by-hop headers (RFC 9110 7.6.1: Connection, Keep-Alive, Proxy-*, TE, Trailer, Transfer-Encoding,
Upgrade, and every header the Connection header names) belong to one connection and are stripped
both ways. Host and Content-Length are the client session's to set; Content-Encoding no longer holds
once the body is decoded; the DP rank header is the router's to set (a client cannot pin a rank of an
engine it did not choose).
"""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict

RANK_HEADER = "X-Data-Parallel-Rank"
# Request Content-Encodings the server side decodes (aiohttp; br and zstd would need extra packages).
DECODED_ENCODINGS = frozenset({"identity", "gzip", "x-gzip", "deflate"})
ENGINE_HEADER = "X-RouterFleet-Engine"
# Opt-in (request header "1" or "true"): the response says what the router predicted was cached on the
# engine it chose, in tokens, by tier ("device=32,host=16,disk=0,external=0"), and whether that
# prediction was made in a doubtful state (proxy/audit.py).
DEBUG_PREDICTION_HEADER = "X-RouterFleet-Debug-Prediction"
PREDICTED_HEADER = "X-RouterFleet-Predicted-Cached-Tokens"
PREDICTED_TIERS_HEADER = "X-RouterFleet-Predicted-Tiers"
DOUBTFUL_HEADER = "X-RouterFleet-Prediction-Doubtful"

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Content-Encoding: the server side already inflated a gzip/deflate body (aiohttp decodes request
# bodies), so the engine gets the decoded bytes, and must not be told they are still encoded.
# Accept-Encoding: the router reads what the engine answers (the usage it scans and strips): an answer
# the engine compressed would pass unread, the added usage chunk with it.
_REQUEST_DROP = HOP_BY_HOP | {
    "host", "content-length", "content-encoding", "accept-encoding", RANK_HEADER.lower(),
    DEBUG_PREDICTION_HEADER.lower(),
}  # fmt: skip
_RESPONSE_DROP = HOP_BY_HOP | {"content-length"}


def _connection_named(values: Iterable[str]) -> set[str]:
    return {token.strip().lower() for value in values for token in value.split(",") if token.strip()}


def _filter(headers: CIMultiDict | dict, drop: frozenset[str]) -> CIMultiDict:
    out: CIMultiDict = CIMultiDict()
    named = None
    if "Connection" in headers:
        getall = getattr(headers, "getall", None)
        named = _connection_named(getall("Connection") if getall else [headers["Connection"]])
    for name, value in headers.items():
        low = name.lower()
        if low in drop or low.startswith("proxy-") or (named and low in named):
            continue
        out.add(name, value)
    return out


def request_headers(headers, extra_drop: frozenset[str] = frozenset()) -> CIMultiDict:
    """What to send the engine of the client's request headers; ``extra_drop`` (lower-case names) are
    the router's own request headers (the session hint), never forwarded."""
    return _filter(headers, _REQUEST_DROP | extra_drop if extra_drop else _REQUEST_DROP)


def response_headers(headers) -> CIMultiDict:
    """What to send the client of the engine's response headers (Content-Length is set separately)."""
    return _filter(headers, _RESPONSE_DROP)
