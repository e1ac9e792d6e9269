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

from .events import BlockStored, EventBatch
from .index import Skip, store_skip

# Refusals that mean "this router is configured differently from the engine", not "a bad event" (a
# token count that does not match the block count) or "a prefix we joined after" (an unknown parent).
CONFIG_SKIPS = frozenset({Skip.BLOCK_SIZE_MISMATCH, Skip.OTHER_GROUP, Skip.UNKNOWN_MEDIUM})


@dataclass(frozen=True, slots=True)
class Misfit:
    """Why a rank's stores cannot be indexed, in words a user can act on (no tokens, no hashes)."""

    reason: Skip
    detail: str


def describe(ev: BlockStored, reason: Skip, block_size: int, full_attention_group: int) -> str:
    if reason is Skip.BLOCK_SIZE_MISMATCH:
        return f"the engine publishes block size {ev.block_size}; this router is configured for {block_size}"
    if reason is Skip.OTHER_GROUP:
        kind = ev.kv_cache_spec_kind or "unnamed"
        return (
            f"the engine publishes KV cache group {ev.group_idx} ({kind}) only; this router indexes the "
            f"full-attention group {full_attention_group}"
        )
    return f"the engine publishes medium {ev.medium!r}, which this router does not know"


@dataclass(slots=True)
class FitTally:
    """One rank's stores, by what the index's rule makes of them. Cheap: per event, not per block."""

    accepted: int = 0  # blocks the rule accepts (whatever the trie then makes of them)
    refused: int = 0  # blocks refused for a configuration reason
    last: Misfit | None = None

    def add(self, batch: EventBatch, block_size: int, full_attention_group: int) -> None:
        for ev in batch.events:
            if type(ev) is not BlockStored:
                continue
            skip = store_skip(ev, block_size, full_attention_group)
            if skip is None:
                self.accepted += len(ev.block_hashes)
            elif skip in CONFIG_SKIPS:
                self.refused += len(ev.block_hashes)
                if self.last is None or self.last.reason is not skip:
                    self.last = Misfit(skip, describe(ev, skip, block_size, full_attention_group))

    @property
    def misfit(self) -> Misfit | None:
        """Set once stores were refused for a configuration reason and none was ever accepted."""
        return self.last if self.refused and not self.accepted else None
