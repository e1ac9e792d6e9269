"""Prefill/decode disaggregation (docs/disaggregation.md): the decode engine is chosen first, as for any
request; then its uncached suffix decides whether a prefill engine computes the prompt's KV remotely,
and which one, by what it holds and its load."""
