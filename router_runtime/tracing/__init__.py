"""Request tracing: W3C trace context in, OpenTelemetry spans of each request's stages out (OTLP/gRPC).

``context.py`` reads and writes the ``traceparent`` header and decides sampling; ``spans.py`` records one
request's spans (nothing at all for a request not sampled); ``export.py`` encodes finished traces as OTLP
and sends them to a collector. docs/tracing.md lists the spans and their attributes.
"""
