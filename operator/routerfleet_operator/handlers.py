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
  subresource), ``pod_changed`` (any pod labelled ``routerfleet.io/fleet``: created, Running,
  Ready, deleted) and ``pool_changed`` (a fleet's InferencePool, as a Gateway reports on it) kick the
  fleet's loop.

Shared state lives in kopf's memo (the API client, each loop's wake-up), not in module globals.
Nothing is kept in memory that matters: the rollout state machine is in the fleet's status, so a
restarted operator resumes where it stopped. kopf's own bookkeeping is kept out of the user-visible
status: progress and diff-base go to ``kopf.routerfleet.io/*`` annotations; handlers return None.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import kopf

from routerfleet_kube import KubeClient

from .apply import reconcile, release_foreign
from .model import FIELD_MANAGER, GROUP, LABEL_FLEET, PLURAL, VERSION
from .render import OperatorRef

log = logging.getLogger(__name__)
FINALIZER = f"{GROUP}/operator"  # kopf's marker for its daemon: removed as soon as the loop stopped
KOPF_PREFIX = f"kopf.{GROUP}"
ERROR_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
DEBOUNCE_S = 0.2  # a burst of pod events makes one reconcile


async def connect() -> KubeClient:
    """The operator's API client: its writes under its one field manager."""
    return await KubeClient.connect(user_agent=FIELD_MANAGER, field_manager=FIELD_MANAGER)


def kick(memo: kopf.Memo, namespace: str | None, name: str | None) -> None:
    if namespace and name and (ev := memo.kicks.get((namespace, name))) is not None:
        ev.set()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # our own Events mark the rollout's steps
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # The operator-wide memo (cli.py passes ``operator`` in it): kopf hands each object's handlers a
    # shallow copy, so they all share this client and the loops' wake-ups, by (namespace, name).
    memo.setdefault("operator", OperatorRef())
    memo.kicks = {}
    memo.kube = await connect()


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    if (kube := memo.get("kube")) is not None:
        await kube.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
def fleet_changed(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    kick(memo, namespace, name)


@kopf.on.event("", "v1", "pods", labels={LABEL_FLEET: kopf.PRESENT})
def pod_changed(namespace: str, labels: dict[str, str], memo: kopf.Memo, **_: Any) -> None:
    kick(memo, namespace, labels.get(LABEL_FLEET))


@kopf.on.event("inference.networking.k8s.io", "v1", "inferencepools", labels={LABEL_FLEET: kopf.PRESENT})
def pool_changed(namespace: str, labels: dict[str, str], memo: kopf.Memo, **_: Any) -> None:
    """A fleet's InferencePool (spec.gateway) changed, its status.parents as a Gateway reports them: the
    GatewayReady condition follows. kopf watches the resource only while its CRD is installed."""
    kick(memo, namespace, labels.get(LABEL_FLEET))


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def fleet_deleted(body: Any, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """What the garbage collector cannot remove: RBAC in the engines' namespace when it is another one.
    kopf holds the fleet's deletion (its finalizer) until this succeeds, retrying on failure."""
    for what in await release_foreign(memo.kube, body):
        logger.info("deleted %s", what)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0)
async def fleet_loop(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Reconcile, then sleep until a kick or the decided delay; forever. kopf cancels it when the fleet
    is deleted, the operator stops or a peer takes over: a reconcile cut at any await is what a killed
    operator leaves, which the next one resumes from status (its steps are ordered for that)."""
    key = (namespace, name)
    wake = memo.kicks[key] = asyncio.Event()
    errors = 0
    try:
        while True:
            wake.clear()
            try:
                delay = await reconcile(memo.kube, namespace, name, operator=memo.operator)
                errors = 0
            except Exception as exc:  # the loop must outlive any one failure: log it and back off
                delay = ERROR_BACKOFF_S[min(errors, len(ERROR_BACKOFF_S) - 1)]
                errors += 1
                logger.warning("reconcile of %s/%s failed (retry in %.0fs): %r", namespace, name, delay, exc)
            if delay is None:
                return  # deleted: kopf stops the daemon too
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), delay)
            if wake.is_set():
                await asyncio.sleep(DEBOUNCE_S)
    finally:
        if memo.kicks.get(key) is wake:
            del memo.kicks[key]
