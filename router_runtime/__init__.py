"""RouterFleet router runtime: KV event ingestion, the radix index, routing and the fake engine."""

__version__ = "0.1.0"
