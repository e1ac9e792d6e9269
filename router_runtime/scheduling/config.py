"""The scheduler's configuration section (``RouterConfig.scheduling``) and its flags: which preset
profile routes, and the presets' tunables."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..flags import Count, Flag, Real, Switch, Text
from .presets import POLICY_NAMES, PolicyConfig


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    policy: str = "kv_aware"
    tuning: PolicyConfig = field(default_factory=PolicyConfig)


# each tunable's help names the policies it tunes
FLAGS = (
    Flag("--policy", "scheduling.policy", Text(choices=POLICY_NAMES), "routing policy"),
    Flag(
        "--balance-abs-threshold",
        "scheduling.tuning.balance_abs_threshold",
        Count(0),
        "imbalance guard: least loaded when the in-flight spread max - min exceeds this and"
        " max > min * --balance-rel-threshold",
    ),
    Flag(
        "--balance-rel-threshold",
        "scheduling.tuning.balance_rel_threshold",
        Real(1.0),
        "imbalance guard: see --balance-abs-threshold",
    ),
    Flag(
        "--host-weight",
        "scheduling.tuning.host_weight",
        Real(0.0, hi=1.0),
        "kv_aware: credit of a block held in host memory (device = 1)",
    ),
    Flag(
        "--disk-weight",
        "scheduling.tuning.disk_weight",
        Real(0.0, hi=1.0),
        "kv_aware: credit of a block held on disk",
    ),
    Flag(
        "--external-weight",
        "scheduling.tuning.external_weight",
        Real(0.0, hi=1.0),
        "kv_aware: credit of a block held in an external store",
    ),
    Flag(
        "--load-cost-tokens",
        "scheduling.tuning.load_cost_tokens",
        Real(0.0),
        "kv_aware: one in-flight request costs as much as prefilling this many tokens",
    ),
    Flag(
        "--eviction-weight",
        "scheduling.tuning.eviction_weight",
        Real(0.0),
        "kv_aware: each block a placement would evict from a full cache (one that has evicted before)"
        " costs this much of a device block's credit",
        zero="evictions not priced",
    ),
    Flag(
        "--inflight-weight",
        "scheduling.tuning.inflight_weight",
        Real(0.0, hi=1.0),
        "kv_aware: credit of a block predicted by a request this router just sent there, not yet stored"
        " (a fan-out's copies; device = 1)",
    ),
    Flag(
        "--inflight-ttl-s",
        "scheduling.tuning.inflight_ttl_s",
        Real(0.0),
        "kv_aware: how long such a prediction lasts at most (it ends with its request; this bounds one"
        " whose end is never seen; 0: no predictions)",
    ),
    Flag(
        "--lora-load-cost-tokens",
        "scheduling.tuning.lora_load_cost_tokens",
        Real(0.0),
        "kv_aware: loading a LoRA adapter an engine does not hold weighs as much as prefilling this many"
        " tokens (what engines report of their adapters, and what this router sent where)",
        zero="adapters ignored",
    ),
    Flag(
        "--share-predictions",
        "scheduling.tuning.inflight_share",
        Switch(),
        "kv_aware: send those predictions to the siblings with the load reports, and count theirs (needs"
        " the fleet's load reports: --internal-token-file and peers)",
    ),
    Flag(
        "--spread-ties",
        "scheduling.tuning.spread_ties",
        Switch(),
        "kv_aware: break ties by a hash of the request (else target order)",
    ),
    Flag(
        "--cache-threshold",
        "scheduling.tuning.cache_threshold",
        Real(0.0, hi=1.0),
        "approx_prefix: route by prefix above this matched fraction of the text",
    ),
    Flag(
        "--max-tree-size",
        "scheduling.tuning.max_tree_size",
        Count(1),
        "approx_prefix: characters per target's text tree before LRU eviction",
    ),
    Flag(
        "--seed",
        "scheduling.tuning.seed",
        Count(None),
        "power_of_two: random seed",
        default_text="OS entropy",
    ),
)
