"""KV-aware routing: score each (engine, rank) target by the prefix the radix index says it holds,
weighted by tier, against its in-flight load. The rationale and a worked example are in docs/routing.md.

    credit(t) = device + host_weight * host + disk_weight * disk + external_weight * external   [blocks]
    cost(t)   = load_cost_tokens / block_size * load(t) - credit(t)                              [blocks]

The lowest cost wins: a cached block saves its prefill, and one in-flight request is priced as
``load_cost_tokens`` tokens of prefill. Before scoring, sglang-router's imbalance guard sends the
request to the least-loaded target when the loads are skewed. Ties break by lower load, then by a hash
of the request's tokens over the tied targets (``spread_ties``; otherwise target order), so at low
concurrency new conversations spread over the fleet instead of all landing on the first target.

A returning session (``request.prefer``, docs/sessions.md) changes two things and nothing else: every
tie the remembered target is part of goes to it; and, when it is vouched for (``prefer_vouched``: the
index saw it evict nothing since it served the conversation's previous turn), it is credited as
holding the request's whole prefix (its full blocks, at device weight) when the index credits it less,
because the index may not have seen that turn yet (events off or lagging). Once it has evicted, the
index is the better witness of what is left. The imbalance guard and the load price apply unchanged,
so an overloaded remembered target is not forced.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence

import xxhash

from ..kv.index import RadixIndex
from .load import imbalanced, least_loaded_indices, load_list, pick, preferred_index
from .types import Decision, KeepsNoTargetState, Reason, RouteRequest, Target

_h = xxhash.xxh3_64_intdigest


_TIE_HASH_TOKENS = 256


def request_hash(tokens: Sequence[int] | None) -> int:
    """A stable (cross-process, cross-replica) hash of a request, for tie-breaking: its length and last
    256 tokens, where conversations differ (the latest turn), in a few microseconds whatever the length
    (hashing all of an 8k-token prompt would cost ~175 us)."""
    if not tokens:
        return 0
    tail = tokens[-_TIE_HASH_TOKENS:]
    try:
        return _h(array("q", tail), seed=len(tokens))
    except (OverflowError, TypeError):
        return hash((len(tokens), *tail)) & 0xFFFF_FFFF_FFFF_FFFF


class KvAwarePolicy(KeepsNoTargetState):
    name = "kv_aware"
    needs_tokens = True
    needs_text = False

    def __init__(
        self,
        *,
        host_weight: float = 0.5,
        disk_weight: float = 0.25,
        external_weight: float = 0.1,
        load_cost_tokens: float = 256.0,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
        spread_ties: bool = True,
    ) -> None:
        self.host_weight = host_weight
        self.disk_weight = disk_weight
        self.external_weight = external_weight
        self.load_cost_tokens = load_cost_tokens
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.spread_ties = spread_ties

    def choose(
        self,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, float],
        index: RadixIndex | None,
    ) -> Decision:
        lv = load_list(targets, loads)
        tokens = request.tokens
        total = 0
        matches: dict = {}
        load_cost = 0.0
        if index is not None and tokens:
            total = len(tokens) // index.block_size
            if total:
                matches = index.match(tokens, lora_name=request.lora_name, cache_salt=request.cache_salt)
            load_cost = self.load_cost_tokens / index.block_size

        p = preferred_index(targets, request.prefer)
        credits: list[float] | None = None
        if matches:
            # A target the index does not know (new, cold, or another rank) gets nothing: never invent.
            wh, ws, we = self.host_weight, self.disk_weight, self.external_weight
            credits = []
            for t in targets:
                m = matches.get(t.carrier)
                if m is None:
                    credits.append(0.0)
                else:
                    d, h, s, e = m.tier_blocks
                    credits.append(d + wh * h + ws * s + we * e)
            if max(credits) <= 0:
                credits = None
        boosted = False  # the remembered target's credit was raised to the whole prefix
        real_p = 0.0
        if p is not None and request.prefer_vouched and total and (credits is None or credits[p] < total):
            credits = list(credits) if credits is not None else [0.0] * len(targets)
            real_p = credits[p]
            credits[p] = float(total)
            boosted = True

        if imbalanced(lv, self.balance_abs_threshold, self.balance_rel_threshold):
            tied = least_loaded_indices(lv)
            reason = Reason.IMBALANCED
        elif credits is None:
            tied = least_loaded_indices(lv)
            reason = Reason.NO_MATCH
        else:
            # Rounded so that equal tier mixes tie exactly despite float sums.
            costs = [round(load_cost * load - c, 6) for load, c in zip(lv, credits, strict=True)]
            best = min(costs)
            tied = least_loaded_indices(lv, [i for i, c in enumerate(costs) if c == best])
            reason = None  # set once the target is known

        i = pick(tied, p)
        if i is None:
            spread = len(tied) > 1 and self.spread_ties
            i = tied[request_hash(tokens) % len(tied)] if spread else tied[0]
        target = targets[i]
        if reason is None:
            if boosted and i == p and real_p <= 0:
                reason = Reason.SESSION  # only the session's memory put a prefix there
            else:
                # PREFIX: the winner's cache counted; LEAST_LOADED: another target had a prefix but
                # load won.
                reason = Reason.PREFIX if credits[i] > 0 else Reason.LEAST_LOADED
        m = matches.get(target.carrier) if matches else None
        if m is None:
            return Decision(target, reason, 0, total)
        return Decision(target, reason, m.blocks, total, m.tier_blocks)
