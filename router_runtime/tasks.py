"""Ending a component's background tasks at its stop, bounded.

A task that is cancelled and not awaited runs its ``finally`` (closing its sockets) only at some later
turn of the loop, after its owner may have gone on to end what those sockets belong to. So an owner
that cancels a task keeps it until it ends, and its stop cancels and awaits every task it still has,
with a bound: a task that ignores its cancellation is named, never waited for forever."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

STOP_BOUND_S = 2.0  # cancelled tasks end within a few turns of the loop; this is for one that does not


def retire(task: asyncio.Task, owned: set[asyncio.Task]) -> None:
    """Cancel ``task`` and keep it in ``owned`` until it has ended (its owner's stop awaits it)."""
    task.cancel()
    if not task.done():
        owned.add(task)
        task.add_done_callback(owned.discard)


async def end_tasks(
    tasks: Iterable[asyncio.Task | None], owner: str, bound_s: float = STOP_BOUND_S
) -> list[str]:
    """Cancel ``tasks`` and wait up to ``bound_s`` for them to end. A failure of one is logged, never
    raised (the stop goes on); those still running at the bound are named in a warning and returned."""
    tasks = {t for t in tasks if t is not None}
    for t in tasks:
        t.cancel()
    pending: set[asyncio.Task] = set()
    if tasks:
        _done, pending = await asyncio.wait(tasks, timeout=bound_s)
    for t in tasks - pending:
        if not t.cancelled() and (exc := t.exception()) is not None:
            log.error("%s: task %s failed", owner, t.get_name(), exc_info=exc)
    left = sorted(t.get_name() for t in pending)
    if left:
        log.warning("%s stopped with %d tasks still running after %.1fs: %s", owner, len(left), bound_s, left)
    return left
