"""Approximate (text) prefix routing, after sglang-router's ``cache_aware`` policy: no KV events, the
router remembers which prompt text it sent where, in one character radix tree shared by all targets.

- Imbalanced loads (the same guard as ``kv_aware``): least loaded; the text is still inserted for it.
- Balanced: prefix-match the text. If ``matched / len(text) > cache_threshold``, go to the least
  loaded of the targets holding that longest match; otherwise to the target with the smallest tree
  (the most cache presumably free). Then insert the text for the chosen target.
- After the insert, the chosen target's tree is LRU-evicted down to ``max_tree_size`` characters,
  inline (no background thread): only the chosen target grew, so only it can be over.

A returning session (``request.prefer``, docs/sessions.md): balanced, its remembered target counts as a
holder of the longest match (this replica's tree may never have seen the conversation: another replica
routed it, or its prompts are token IDs), and when nothing matches above the threshold it is the pick
instead of the smallest tree; imbalanced, the guard decides as always. Every tie it is part of goes to
it.

Ties (equal load, equal tree size) break by target order. A LoRA adapter or cache salt prefixes the
stored text with a ``\x00``-delimited namespace, so text only matches text of the same namespace (as
KV blocks do); the namespace's characters never count as matched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..kv.index import RadixIndex
from .load import imbalanced, least_loaded_indices, load_list, pick, preferred_index
from .text_tree import TextTree
from .types import Decision, Reason, RouteRequest, Target


class ApproxPrefixPolicy:
    name = "approx_prefix"
    needs_tokens = False
    needs_text = True

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        max_tree_size: int = 1 << 22,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.max_tree_size = max_tree_size
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = TextTree()

    def remove_target(self, target: Target) -> int:
        """Drop a target's tree (it left discovery, or restarted with an empty cache); returns the
        characters it held."""
        return self.tree.remove_tenant(target)

    def choose(
        self,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, float],
        index: RadixIndex | None,
    ) -> Decision:
        lv = load_list(targets, loads)
        text = request.text or ""
        total = len(text)
        ns = 0
        if text and (request.lora_name is not None or request.cache_salt is not None):
            prefix = f"\x00{request.lora_name or ''}\x00{request.cache_salt or ''}\x00"
            ns = len(prefix)
            text = prefix + text
        tree = self.tree
        match = tree.match(text) if text else None

        p = preferred_index(targets, request.prefer)
        if imbalanced(lv, self.balance_abs_threshold, self.balance_rel_threshold):
            tied = least_loaded_indices(lv)
            i = pick(tied, p)
            i = tied[0] if i is None else i
            reason = Reason.IMBALANCED
        else:
            matched, holders = match.longest(set(targets)) if match is not None else (0, set())
            matched = max(matched - ns, 0)
            if total and matched / total > self.cache_threshold:
                among = [k for k, t in enumerate(targets) if t in holders or k == p]
                tied = least_loaded_indices(lv, among)
                i = pick(tied, p)
                i = tied[0] if i is None else i
                reason = Reason.PREFIX if targets[i] in holders else Reason.SESSION
            elif p is not None:
                i = p
                reason = Reason.SESSION
            else:
                size = tree.size
                i = min(range(len(targets)), key=lambda k: (size(targets[k]), lv[k], k))
                reason = Reason.NO_MATCH
        target = targets[i]
        chars = max(match.chars_for(target) - ns, 0) if match is not None else 0
        if text:
            tree.insert(text, target)
            if tree.size(target) > self.max_tree_size:
                tree.evict(target, self.max_tree_size)
        return Decision(target, reason, matched_chars=chars, total_chars=total)
