"""The KV event plane's configuration section (``RouterConfig.kv``) and its flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..flags import Bytes, Count, Flag, Ms, Seconds
from .subscription import ReplayTimeouts


@dataclass(frozen=True, slots=True)
class KvConfig:
    block_size: int = 16
    replay: ReplayTimeouts = field(default_factory=ReplayTimeouts)
    # The index writer's bounds: past them a rank overflows (and resyncs) rather than memory growing.
    queue_batches: int = 10_000
    queue_bytes: int = 256 << 20
    # Carrier lifecycle: an engine that leaves or fails health stays DISCONNECTED (hidden) this long
    # before its blocks are removed; 0: removed at once (no re-adoption).
    disconnect_grace_s: float = 600.0
    adoption_cap: int = 3  # re-adoptions per storage identity per window (0: no cap)
    adoption_window_s: float = 3600.0
    # A rank whose engine stored blocks for a request and sent no batch for this long is doubtful.
    stall_s: float = 2.0
    withhold_s: float = 10.0


FLAGS = (
    Flag("--block-size", "kv.block_size", Count(1), "tokens per KV block"),
    Flag("--replay-idle-timeout-ms", "kv.replay.idle_s", Ms(1), "silence that ends a gap replay"),
    Flag("--replay-timeout-ms", "kv.replay.total_s", Ms(1), "total bound on one gap replay"),
    Flag(
        "--kv-stall-ms",
        "kv.stall_s",
        Ms(0),
        "a rank whose engine stored new blocks for a request (its usage says so) and sent no batch"
        " for this long counts as stalled: its predictions are doubtful until a batch comes"
        " (routerfleet_kv_stalled_ranks)",
        zero="off",
    ),
    Flag(
        "--kv-withhold-ms",
        "kv.withhold_s",
        Ms(1),
        "a rank whose engine denied a credited prefix, or that a flush is resetting, routes cold"
        " until its engine's events show what it lost (or the flush ends); after this long the"
        " rank is cleared instead (routerfleet_kv_rank_withholds_total)",
    ),
    Flag(
        "--kv-disconnect-grace-s",
        "kv.disconnect_grace_s",
        Seconds(0),
        "how long a departed or unhealthy engine's blocks are kept hidden for re-adoption before they"
        " are removed",
        zero="removed at once",
    ),
    Flag(
        "--kv-adoption-cap",
        "kv.adoption_cap",
        Count(0),
        "re-adoptions allowed per storage identity per --kv-adoption-window-s",
        zero="no cap",
    ),
    Flag(
        "--kv-adoption-window-s",
        "kv.adoption_window_s",
        Seconds(0, strict=True),
        "sliding window of the adoption cap",
    ),
    Flag(
        "--kv-queue-batches",
        "kv.queue_batches",
        Count(1),
        "batches the index writer may hold before a rank overflows",
    ),
    Flag("--kv-queue-bytes", "kv.queue_bytes", Bytes(1), "payload bytes the index writer may hold"),
)
