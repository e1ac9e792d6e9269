"""The request plane: the OpenAI-compatible HTTP proxy in front of the engines.

``request`` parses and validates bodies (pure), ``headers`` filters hop-by-hop headers (pure),
``load`` counts the router's in-flight requests per target, ``health`` is the per-engine circuit
breaker (pure) and its active checker (thin shell), ``metrics`` the Prometheus series, and ``proxy``
the aiohttp handlers that tie them to a policy and one shared client session.
"""
