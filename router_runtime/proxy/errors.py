"""Errors the router answers itself, in OpenAI's error shape."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class ProxyError(Exception):
    """An error the router answers itself: ``status`` and OpenAI's ``{"error": {...}}`` body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        outcome: str = "invalid",
        close: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.close = close  # the connection cannot carry another request (a body left half-read)
        self.headers = headers or {}  # sent with the error (Retry-After)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.outcome = outcome  # the requests_total label

    def to_json(self) -> dict[str, Any]:
        return error_json(self.message, type_=self.type, param=self.param, code=self.code)

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        resp = web.Response(
            status=self.status,
            body=json.dumps(self.to_json()).encode(),
            content_type="application/json",
            headers={**self.headers, **(headers or {})},
        )
        if self.close:
            resp.force_close()
        return resp


def error_json(
    message: str, *, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code="invalid_request")


def too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"request body exceeds {limit} bytes", code="request_too_large")


def slow_body(budget_s: float) -> ProxyError:
    return ProxyError(
        408, f"the request body did not arrive within {budget_s:.0f}s", code="request_timeout", close=True
    )


def unsupported_encoding(encoding: str, supported: frozenset[str]) -> ProxyError:
    return ProxyError(
        415,
        f"Content-Encoding {encoding[:40]!r} is not supported (use {', '.join(sorted(supported))})",
        code="unsupported_encoding",
    )


def no_engine(why: str) -> ProxyError:
    return ProxyError(503, why, type_="service_unavailable", code="no_engine_available", outcome="no_engine")


def shed(objective: str) -> ProxyError:
    """A sheddable request turned away while the pool is saturated (scheduling/admission.py)."""
    return ProxyError(
        429,
        f"every engine is saturated and this request's objective {objective[:128]!r} is sheddable"
        " (priority below 0); retry later",
        type_="rate_limit_error",
        code="shed",
        outcome="shed",
    )


def bad_gateway(message: str, code: str) -> ProxyError:
    return ProxyError(502, message, type_="upstream_error", code=code, outcome="upstream_error")


def gateway_timeout(message: str, code: str) -> ProxyError:
    return ProxyError(504, message, type_="upstream_timeout", code=code, outcome="timeout")


def not_found(method: str, path: str) -> ProxyError:
    return ProxyError(
        404,
        f"{method} {path[:200]} is not served by this router (engines' administrative paths never are;"
        " an operator may add one with --allow-path)",
        code="not_found",
    )


def method_not_allowed(method: str, path: str, allowed: set[str]) -> ProxyError:
    return ProxyError(
        405,
        f"{method} is not allowed on {path[:200]} (use {', '.join(sorted(allowed))})",
        code="method_not_allowed",
        headers={"Allow": ",".join(sorted(allowed))},
    )


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own 404 and 405 (no route, or not that method) in OpenAI's error shape."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as e:
        return method_not_allowed(request.method, request.path, e.allowed_methods).response()
    except web.HTTPNotFound:
        return not_found(request.method, request.path).response()
