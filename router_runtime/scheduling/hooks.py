"""Request hooks: what happens around a dispatched request besides relaying it, one concern a module.

The proxy (and any other front door) makes an ``Exchange`` for each dispatch (the request as the hooks
need it, and the decision) and asks each hook whether it watches it (``pre_request``, before the request
is sent). A ``ResponseWatch`` then sees the response pass, in order:

    response_received(status, headers)  the engine's status and headers; may add headers (the client
                                        has seen nothing yet)
    response_streaming(chunk) -> chunk  each body chunk, before the client gets it; may rewrite it; the
                                        chunk as ``bytes``, or an awaitable of it when the watch must
                                        wait (a binding stored)
    response_ended() -> bytes           the engine's body ended: anything still to pass on
    response_complete()                 the client has it all (not called on a cut or a timeout)

The hooks of a router, in their order: health (proxy/health.py), session memory (sessions/affinity.py),
the prediction debug headers (proxy/debug.py), the usage strip and the audit (proxy/audit.py),
response-id binding (sessions/bindings.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .types import Kind, Target

if TYPE_CHECKING:  # the request plane's shapes, named here only
    from ..proxy.audit import Prediction
    from ..sessions.affinity import SessionCtx
    from ..tracing.spans import Trace


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request dispatched to its chosen target, as the hooks see it."""

    target: Target
    started: float  # loop time at dispatch (time.monotonic())
    headers: Mapping[str, str]  # the client's request headers
    tenant: str = ""
    kind: Kind | None = None  # the API (None: a path routed without parsing, by response id or load)
    session: SessionCtx | None = None
    prediction: Prediction | None = None  # what the decision credits the target with (KV policies)
    usage_asked: bool = False  # the router asked the engine for stream usage the client did not
    trace: Trace | None = None  # the request's trace, when it is sampled (tracing/)
    unstored: bool = False  # a Responses request with store: false (its answer is kept nowhere)


class ResponseWatch:
    """One hook's view of one response; every step does nothing unless overridden."""

    rewrites_body = False  # set by response_received when the body will change length

    def response_received(self, status: int, headers: MutableMapping[str, str]) -> None:
        return None

    def response_streaming(self, chunk: bytes) -> bytes | Awaitable[bytes]:
        return chunk

    def response_ended(self) -> bytes:
        return b""

    def response_complete(self) -> None:
        return None


class RequestHook(Protocol):
    name: str

    def pre_request(self, exchange: Exchange) -> ResponseWatch | None:
        """This exchange's watch (None: the hook has nothing to do with it)."""
        ...


def watching(hooks: Sequence[RequestHook], exchange: Exchange) -> list[ResponseWatch]:
    """The watches of the hooks that watch this exchange, in the hooks' order."""
    return [w for hook in hooks if (w := hook.pre_request(exchange)) is not None]


def chunk_watchers(watches: Sequence[ResponseWatch]) -> list[ResponseWatch]:
    """The watches that look at body chunks: one that leaves them alone is not called per chunk."""
    return [w for w in watches if type(w).response_streaming is not ResponseWatch.response_streaming]
