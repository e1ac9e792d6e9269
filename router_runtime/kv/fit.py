"""Whether a rank's stream fits this router's configuration: a mismatch told apart from an empty cache.

A router configured for another block size (or KV cache group) than its engines indexes nothing, and
an index that holds nothing looks like a cold cache. The tally below counts, per rank, what the index's
own rule (``index.store_skip``) accepts and what it refuses for a configuration reason. A rank whose
stores were refused for such a reason and never once accepted is a *misfit*: the bootstrap verdict
says ``config_mismatch``, readiness and metrics say so too, and the operator pauses the rollout that
brought it. A rank that has published nothing yet is not a misfit: there is no evidence either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import routerfleet_index

from .events import EventBatch
from .index import Skip, as_native

# Refusals that mean "this router is configured differently from the engine" (the core's list), not
# "a bad event" (a token count that does not match the block count) or "a prefix we joined after".
CONFIG_SKIPS = frozenset(Skip(r) for r in routerfleet_index.CONFIG_SKIPS)


@dataclass(frozen=True, slots=True)
class Misfit:
    """Why a rank's stores cannot be indexed, in words a user can act on (no tokens, no hashes)."""

    reason: Skip
    detail: str


def describe(
    reason: Skip,
    seen: tuple[int, int | None, str | None, str | None],
    block_size: int,
    full_attention_group: int,
) -> str:
    """``seen``: the refused store's (block size, group, cache spec kind, medium)."""
    ev_block_size, group_idx, kind, medium = seen
    if reason is Skip.BLOCK_SIZE_MISMATCH:
        return f"the engine publishes block size {ev_block_size}; this router is configured for {block_size}"
    if reason is Skip.OTHER_GROUP:
        return (
            f"the engine publishes KV cache group {group_idx} ({kind or 'unnamed'}) only; this router "
            f"indexes the full-attention group {full_attention_group}"
        )
    return f"the engine publishes medium {medium!r}, which this router does not know"


@dataclass(slots=True)
class FitTally:
    """One rank's stores, by what the index's rule makes of them. Cheap: per event, not per block."""

    accepted: int = 0  # blocks the rule accepts (whatever the trie then makes of them)
    refused: int = 0  # blocks refused for a configuration reason
    last: Misfit | None = None

    def add(
        self, batch: EventBatch | routerfleet_index.Batch, block_size: int, full_attention_group: int
    ) -> None:
        # The core applies the index's rule and returns the runs of CONFIG_SKIPS refusals, each
        # described by its first store.
        accepted, refusals = as_native(batch).fit(block_size, full_attention_group)
        self.accepted += accepted
        for reason, blocks, *seen in refusals:
            skip = Skip(reason)
            self.refused += blocks
            if self.last is None or self.last.reason is not skip:
                self.last = Misfit(skip, describe(skip, tuple(seen), block_size, full_attention_group))

    @property
    def misfit(self) -> Misfit | None:
        """Set once stores were refused for a configuration reason and none was ever accepted."""
        return self.last if self.refused and not self.accepted else None
