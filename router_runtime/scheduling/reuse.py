"""What of a prompt an engine serves from its prefix cache: the engines' own rules, which every
prediction models. A block the engine will not reuse is no cache hit, whatever the index holds, so
crediting it would be a false hit (the audit counts one on real vLLM without these rules).

- The last prompt token is always computed: the engine needs its logits to sample (vLLM's KV cache
  manager caps a hit at ``len - 1`` tokens, SGLang's ``max_prefix_len`` is ``input_len - 1``). A fully
  cached, block-aligned prompt reuses one block fewer than the engine holds.
- Positions whose prompt logprobs the request asks for are computed too: vLLM reads nothing from the
  cache for a request with ``prompt_logprobs`` (it still stores the blocks); SGLang's ``/generate`` with
  ``return_logprob`` reuses at most ``logprob_start_len`` tokens.
"""

from __future__ import annotations


def reusable_tokens(prompt_tokens: int, logprobs_from: int | None = None) -> int:
    """The longest prefix, in tokens, an engine may serve from its cache for a prompt of
    ``prompt_tokens``; ``logprobs_from``: the first position whose prompt logprob is asked for."""
    limit = prompt_tokens - 1
    if logprobs_from is not None:
        limit = min(limit, logprobs_from)
    return max(limit, 0)
