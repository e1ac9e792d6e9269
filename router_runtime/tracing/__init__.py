"""Request tracing: W3C trace context in, OpenTelemetry spans of each request's stages out (OTLP/HTTP).

``context.py`` reads and writes the ``traceparent`` header and decides sampling; ``spans.py`` records one
request's spans (nothing at all for a request not sampled); ``wire.py`` writes a finished trace as OTLP
protobuf bytes (its spans by the native core); ``export.py`` sends them to a collector in batches.
docs/tracing.md lists the spans and their attributes.
"""
