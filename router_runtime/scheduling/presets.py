"""The ``--policy`` presets: each a profile of plugins (framework.py) built from one frozen config of
every routing tunable. Defaults and their reasoning are in docs/routing.md. A new scorer is one file and
one line in a preset here.

    every preset   subset, pinned, preferred_first (filters.py), then:
    kv_aware       prefix_cache + inflight_prefix + eviction_cost + load_cost + lora_affinity
                                            -> lowest_cost (guard, ties spread by request hash)
    approx_prefix  text_prefix              -> lowest_cost (guard, ties by target order)
    round_robin                             -> round_robin (the guard for returning sessions)
    least_loaded                            -> least_loaded
    power_of_two                            -> power_of_two (seeded by ``seed``)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields

from .eviction_cost import EvictionCost
from .filters import EndpointSubset, PinnedTarget, PreferredFirst
from .framework import Profile
from .inflight_prefix import InflightPrefix
from .load_cost import LoadCost
from .lora_affinity import LoraAffinity
from .pickers import Guard, LeastLoaded, LowestCost, PowerOfTwo, RoundRobin, Ties
from .prefix_cache import PrefixCache
from .text_prefix import TextPrefix

POLICY_NAMES = ("kv_aware", "approx_prefix", "round_robin", "least_loaded", "power_of_two")


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    # Imbalance guard (kv_aware, approx_prefix; round_robin for returning sessions): least loaded when
    # max - min > abs AND max > min * rel.
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    # kv_aware: credit per matched block by the best tier holding it (device = 1.0).
    host_weight: float = 0.5
    disk_weight: float = 0.25
    external_weight: float = 0.1
    # kv_aware: one in-flight request costs as much as prefilling this many uncached tokens.
    load_cost_tokens: float = 256.0
    # kv_aware: each block a placement would evict from a full cache costs this much of a device block.
    eviction_weight: float = 1.0
    # kv_aware: a block predicted by a request this router just sent (not yet stored) is credited this
    # much of a device block, for this long at most (0: no predictions).
    inflight_weight: float = 0.9
    inflight_ttl_s: float = 30.0
    inflight_share: bool = True  # with the siblings, over the load reports
    lora_load_cost_tokens: float = 1024.0  # what loading a LoRA adapter weighs (lora_affinity.py); 0: off
    # kv_aware: break full ties by a hash of the request (spreads new conversations); else target order.
    spread_ties: bool = True
    # approx_prefix: route by prefix only above this matched fraction of the text.
    cache_threshold: float = 0.3
    # approx_prefix: characters each target's tree may hold before LRU eviction.
    max_tree_size: int = 1 << 22
    # power_of_two: seed for its random.Random (None: OS entropy).
    seed: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"routing config {name}={getattr(self, name)!r}: {why}")

        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise bad(f.name, "must be finite")
        if self.balance_abs_threshold < 0:
            raise bad("balance_abs_threshold", "must be >= 0")
        if self.balance_rel_threshold < 1:
            raise bad("balance_rel_threshold", "must be >= 1")
        for name in ("host_weight", "disk_weight", "external_weight", "inflight_weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise bad(name, "must be within [0, 1] (a device block is worth 1)")
        if self.inflight_ttl_s < 0:
            raise bad("inflight_ttl_s", "must be >= 0")
        if self.load_cost_tokens < 0:
            raise bad("load_cost_tokens", "must be >= 0")
        if self.eviction_weight < 0:
            raise bad("eviction_weight", "must be >= 0")
        if self.lora_load_cost_tokens < 0:
            raise bad("lora_load_cost_tokens", "must be >= 0")
        if not 0 <= self.cache_threshold <= 1:
            raise bad("cache_threshold", "must be within [0, 1]")
        if self.max_tree_size <= 0:
            raise bad("max_tree_size", "must be positive")


def make_policy(name: str, config: PolicyConfig | None = None) -> Profile:
    c = config if config is not None else PolicyConfig()
    guard = Guard(c.balance_abs_threshold, c.balance_rel_threshold)
    filters = (EndpointSubset(), PinnedTarget(), PreferredFirst())
    if name == "kv_aware":
        prefix = PrefixCache(
            host_weight=c.host_weight, disk_weight=c.disk_weight, external_weight=c.external_weight
        )
        inflight = InflightPrefix(weight=c.inflight_weight, ttl_s=c.inflight_ttl_s, share=c.inflight_share)
        return Profile(
            name,
            filters=filters,
            scorers=(
                prefix,
                inflight,
                EvictionCost(c.eviction_weight),
                LoadCost(c.load_cost_tokens),
                LoraAffinity(load_cost_tokens=c.lora_load_cost_tokens),
            ),
            picker=LowestCost(guard, Ties.SPREAD if c.spread_ties else Ties.FIRST),
            needs_tokens=True,
        )
    if name == "approx_prefix":
        text = TextPrefix(cache_threshold=c.cache_threshold, max_tree_size=c.max_tree_size)
        return Profile(name, filters=filters, scorers=(text,), picker=LowestCost(guard), needs_text=True)
    if name == "round_robin":
        return Profile(name, filters=filters, picker=RoundRobin(guard))
    if name == "least_loaded":
        return Profile(name, filters=filters, picker=LeastLoaded())
    if name == "power_of_two":
        return Profile(name, filters=filters, picker=PowerOfTwo(random.Random(c.seed)))
    raise ValueError(f"unknown routing policy {name!r} (expected one of {', '.join(POLICY_NAMES)})")
