"""Tracing test support: a real OpenTelemetry Collector (collector.py)."""
