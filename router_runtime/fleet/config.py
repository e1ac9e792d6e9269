"""The fleet load view's configuration section (``RouterConfig.fleet``) and its flags: siblings'
reports over the internal port, and reads of the engines' own metrics (docs/fleet-load.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..flags import Flag, Ms
from .engine_metrics import ScrapeConfig
from .gossip import GossipConfig
from .view import Bounds


@dataclass(frozen=True, slots=True)
class FleetConfig:
    gossip: GossipConfig = field(default_factory=GossipConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    bounds: Bounds = field(default_factory=Bounds)


FLAGS = (
    Flag(
        "--fleet-gossip-window-ms",
        "fleet.gossip.window_s",
        Ms(0),
        "after this replica's load changes, wait this long for more, then tell the siblings (needs"
        " --internal-token-file and peers)",
        zero="off",
    ),
    Flag(
        "--fleet-heartbeat-ms",
        "fleet.gossip.heartbeat_s",
        Ms(10, 60_000),
        "tell the siblings at least this often",
    ),
    Flag(
        "--fleet-peer-max-age-ms",
        "fleet.bounds.peer_max_age_s",
        Ms(10, 600_000),
        "a sibling's report counts this long after it arrived (above the heartbeat)",
    ),
    Flag(
        "--engine-load-interval-ms",
        "fleet.scrape.interval_s",
        Ms(0),
        "read each engine's /metrics (running and waiting requests) this often",
        zero="off",
    ),
    Flag(
        "--engine-load-timeout-ms",
        "fleet.scrape.timeout_s",
        Ms(1, 60_000),
        "the deadline of one engine read",
    ),
    Flag(
        "--engine-load-max-age-ms",
        "fleet.bounds.engine_max_age_s",
        Ms(10, 600_000),
        "an engine read counts this long",
    ),
)
