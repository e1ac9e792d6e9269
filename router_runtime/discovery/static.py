"""Static workers from the command line:
``--worker url=URL[,kv=tcp://H:P][,replay=tcp://H:P][,dp=N][,role=prefill|decode|both][,rev=R]
[,bootstrap=PORT]`` (``bootstrap``: a prefill engine's SGLang KV bootstrap port).

``kv`` and ``replay`` are rank 0's endpoints; rank r uses port + r, as vLLM and SGLang bind them.
A worker without ``kv`` publishes no events (only text-prefix policies can use it).
"""

from __future__ import annotations

from urllib.parse import urlparse

from ..worker import Role, WorkerSpec

_KEYS = {"url", "kv", "replay", "dp", "topic", "role", "rev", "bootstrap"}


def _port(text: str) -> bool:
    return text.isdigit() and 0 < int(text) <= 65535


def parse_worker(text: str) -> WorkerSpec:
    """Parse one ``--worker`` value; raises ValueError with a message fit for the command line."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep:
            if "url" in fields or "://" not in part:
                raise ValueError(f"expected key=value, got {part!r}")
            key, value = "url", part  # a bare URL is the url field
        if key not in _KEYS:
            raise ValueError(f"unknown key {key!r} (known: {', '.join(sorted(_KEYS))})")
        fields[key] = value.strip()
    url = fields.get("url")
    parts = urlparse(url or "")
    try:
        port = parts.port  # raises on one that is not a number in range
    except ValueError:
        port = 0
    if not url or parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise ValueError(f"url must be an http(s) URL with a host (and a port in range), got {url!r}")
    if parts.username is not None or parts.password is not None:
        # The URL is the engine's id: in metrics' labels, logs and traces.
        raise ValueError("url may not carry credentials")
    for key in ("kv", "replay"):
        ep = fields.get(key)
        if ep is not None and not (ep.startswith("tcp://") and _port(ep.rpartition(":")[2])):
            raise ValueError(f"{key} must be tcp://host:port, got {ep!r}")
    try:
        dp = int(fields.get("dp", "1"))
    except ValueError:
        raise ValueError(f"dp must be a positive integer, got {fields['dp']!r}") from None
    if dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp}")
    bootstrap = fields.get("bootstrap")
    if bootstrap is not None and not _port(bootstrap):
        raise ValueError(f"bootstrap must be a port number, got {bootstrap!r}")
    try:
        role = Role(fields.get("role", Role.BOTH))
    except ValueError:
        raise ValueError(f"role must be one of {', '.join(Role)}, got {fields['role']!r}") from None
    return WorkerSpec(
        engine=url.rstrip("/"),
        url=url.rstrip("/"),
        kv=fields.get("kv"),
        replay=fields.get("replay"),
        dp_size=dp,
        topic=fields.get("topic", "").encode(),
        role=role,
        revision=fields.get("rev", ""),
        bootstrap_port=int(bootstrap) if bootstrap is not None else None,
    )
