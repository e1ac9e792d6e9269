"""The approximate (text) prefix scorer, after sglang-router's ``cache_aware`` policy: no KV events; the
router remembers which prompt text it sent where, in one character radix tree shared by all candidates.

- Prefix-match the text. If ``matched / len(text) > cache_threshold``, the candidates holding that
  longest match cost 0 and the rest 1 (the picker takes the least loaded holder); otherwise each
  candidate costs the size of its tree (the most cache presumably free), in characters.
- After the decision (``pre_request``) the text is inserted for the chosen target, whatever decided it
  (the imbalance guard too), and that target's tree is LRU-evicted down to ``max_tree_size`` characters,
  inline: only the chosen target grew, so only it can be over.

Its costs are a rank, not blocks: it is the only scorer of the ``approx_prefix`` preset. A returning
session (``request.prefer``, docs/sessions.md): its remembered target counts as a holder of the longest
match (this replica's tree may never have seen the conversation: another replica routed it, or its
prompts are token IDs), and when nothing matches above the threshold it alone costs 0.

A LoRA adapter or cache salt prefixes the stored text with a ``\x00``-delimited namespace, so text only
matches text of the same namespace (as KV blocks do); the namespace's characters never count as matched.
"""

from __future__ import annotations

from .framework import Cycle, Evidence, Measure, Scores
from .text_tree import TextTree
from .types import Decision, RouteRequest, Target


def _namespaced(request: RouteRequest) -> tuple[str, int]:
    """The text as stored (namespace first) and the namespace's length."""
    text = request.text or ""
    if text and (request.lora_name is not None or request.cache_salt is not None):
        prefix = f"\x00{request.lora_name or ''}\x00{request.cache_salt or ''}\x00"
        return prefix + text, len(prefix)
    return text, 0


class TextPrefix:
    name = "text_prefix"

    def __init__(self, *, cache_threshold: float = 0.3, max_tree_size: int = 1 << 22) -> None:
        self.cache_threshold = cache_threshold
        self.max_tree_size = max_tree_size
        self.tree = TextTree()

    def score(self, cycle: Cycle) -> Scores:
        targets, p = cycle.targets, cycle.prefer
        total = len(cycle.request.text or "")
        text, ns = _namespaced(cycle.request)
        match = self.tree.match(text) if text else None

        def measure(t: Target) -> Measure:
            chars = max(match.chars_for(t) - ns, 0) if match is not None else 0
            return Measure(matched_chars=chars, total_chars=total)

        matched, holders = match.longest(set(targets)) if match is not None else (0, set())
        matched = max(matched - ns, 0)
        if total and matched / total > self.cache_threshold:
            evidence = [
                Evidence.CACHED if t in holders else Evidence.SESSION if k == p else Evidence.NONE
                for k, t in enumerate(targets)
            ]
            return Scores([0.0 if e else 1.0 for e in evidence], evidence, measure)
        if p is not None:
            evidence = [Evidence.SESSION if k == p else Evidence.NONE for k in range(len(targets))]
            return Scores([0.0 if k == p else 1.0 for k in range(len(targets))], evidence, measure)
        size = self.tree.size
        return Scores([float(size(t)) for t in targets], None, measure)

    def pre_request(self, cycle: Cycle, decision: Decision) -> None:
        text, _ns = _namespaced(cycle.request)
        if text:
            target, tree = decision.target, self.tree
            tree.insert(text, target)
            if tree.size(target) > self.max_tree_size:
                tree.evict(target, self.max_tree_size)

    def remove_target(self, target: Target) -> int:
        """Drop a target's tree; returns the characters it held."""
        return self.tree.remove_tenant(target)
