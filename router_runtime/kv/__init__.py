"""The KV event plane: wire decoding, per-rank subscriptions, and the radix index."""
