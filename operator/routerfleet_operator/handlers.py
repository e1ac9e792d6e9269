"""The kopf shell: which events start a reconcile, and the loop that runs it for each fleet.

    routerfleet-operator run [--namespace NS]...       (cli.py; kopf.run in-process)

- ``fleet_loop`` (a kopf daemon, one per RouterFleet; kopf starts it on create and on resume after an
  operator restart, and stops it on deletion or when a higher-priority peer takes over): runs
  ``apply.reconcile`` then sleeps until a kick or the decided requeue delay: about 2 s while a rollout
  is not Complete, 60 s once it is. One task per fleet, so reconciles of a fleet never overlap.
- ``fleet_deleted`` (kopf's deletion handler, behind its finalizer): deletes the fleet's Role and
  RoleBinding in the engines' namespace when that is another one (an ownerReference cannot cross
  namespaces, so the garbage collector never would).
- ``fleet_changed`` (any watch event of a RouterFleet: spec, annotations such as the retry, the scale
  subresource) and ``pod_changed`` (any pod labelled ``routerfleet.io/fleet``: created, Running,
  Ready, deleted) kick the fleet's loop.

Nothing is kept in memory that matters: the rollout state machine is in the fleet's status, so a
restarted operator resumes where it stopped. kopf's own bookkeeping is kept out of the user-visible
status: progress and diff-base go to ``kopf.routerfleet.io/*`` annotations; handlers return None.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from .apply import reconcile, release_foreign
from .kube import Kube
from .model import GROUP, LABEL_FLEET, PLURAL, VERSION
from .render import OperatorRef

log = logging.getLogger(__name__)
FINALIZER = f"{GROUP}/operator"  # kopf's marker for its daemon: removed as soon as the loop stopped
KOPF_PREFIX = f"kopf.{GROUP}"
ERROR_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
DEBOUNCE_S = 0.2  # a burst of pod events makes one reconcile


@dataclass
class Config:
    operator: OperatorRef = field(default_factory=OperatorRef)


CONFIG = Config()
_kicks: dict[tuple[str, str], asyncio.Event] = {}
_kube: Kube | None = None


def kick(namespace: str | None, name: str | None) -> None:
    if namespace and name and (ev := _kicks.get((namespace, name))) is not None:
        ev.set()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # our own Events mark the rollout's steps
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    global _kube
    if _kube is not None:
        await _kube.close()
        _kube = None


@kopf.on.event(GROUP, VERSION, PLURAL)
def fleet_changed(namespace: str, name: str, **_: Any) -> None:
    kick(namespace, name)


@kopf.on.event("", "v1", "pods", labels={LABEL_FLEET: kopf.PRESENT})
def pod_changed(namespace: str, labels: dict[str, str], **_: Any) -> None:
    kick(namespace, labels.get(LABEL_FLEET))


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def fleet_deleted(body: Any, logger: logging.Logger, **_: Any) -> None:
    """What the garbage collector cannot remove: RBAC in the engines' namespace when it is another one.
    kopf holds the fleet's deletion (its finalizer) until this succeeds, retrying on failure."""
    global _kube
    if _kube is None:
        _kube = Kube()
    for what in await release_foreign(_kube, body):
        logger.info("deleted %s", what)


async def _until(stopped: Any) -> None:
    await stopped.wait()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=5.0, cancellation_timeout=10.0)
async def fleet_loop(stopped: Any, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
    global _kube
    if _kube is None:
        _kube = Kube()
    kube = _kube
    key = (namespace, name)
    wake = _kicks[key] = asyncio.Event()
    errors = 0
    try:
        while not stopped:
            wake.clear()
            try:
                delay = await reconcile(kube, namespace, name, operator=CONFIG.operator)
                errors = 0
            except Exception as exc:  # the loop must outlive any one failure: log it and back off
                delay = ERROR_BACKOFF_S[min(errors, len(ERROR_BACKOFF_S) - 1)]
                errors += 1
                logger.warning("reconcile of %s/%s failed (retry in %.0fs): %r", namespace, name, delay, exc)
            if delay is None:
                return  # deleted: kopf stops the daemon too
            waiter = asyncio.ensure_future(wake.wait())
            stopper = asyncio.ensure_future(_until(stopped))
            try:
                await asyncio.wait({waiter, stopper}, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (waiter, stopper):
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
            if wake.is_set() and not stopped:
                await asyncio.sleep(DEBOUNCE_S)
    finally:
        if _kicks.get(key) is wake:
            del _kicks[key]
