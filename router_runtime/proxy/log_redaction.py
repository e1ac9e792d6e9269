"""No request bytes in the logs: aiohttp's server logs a request it could not parse with the exception,
whose message quotes the offending bytes (a request line, a header value such as an Authorization
token, a chunk of an unframed body: prompt text). This filter on aiohttp's server logger keeps the
event and drops the bytes: the record says which kind of error, from where, and nothing the client
sent. Installed once per process by ``install``; it applies to every server in it.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

_LOGGER = "aiohttp.server"


class RedactRequestBytes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, RequestPayloadError)):
            cause = exc.__cause__ or exc.__context__
            kind = type(exc).__name__ + (f" ({type(cause).__name__})" if cause is not None else "")
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg, record.args = "refused a malformed request from %s: %s", (remote, kind)
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = logging.INFO, "INFO"  # a client's fault, not ours
        return True


_FILTER = RedactRequestBytes()


def install() -> None:
    logger = logging.getLogger(_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
