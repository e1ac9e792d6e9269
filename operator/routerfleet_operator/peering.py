"""The replicas' peering objects must exist before kopf starts.

kopf announces a replica in its peering object once at start, then about every 50 s. When the object
appears after that first announcement (Helm creates custom resources after Deployments; on a fast
node the pods are up by then), each replica sees no peer and runs as if alone until its next
announcement: two active operators. So `run --peering` waits for the objects first, bounded: a
missing one past the bound is an installation error, said in one line, not a silent standalone run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from routerfleet_kube import ApiError, KubeClient

GROUP_PATH = "/apis/kopf.dev/v1"
WAIT_S = 120.0
POLL_S = 0.5


def peering_paths(name: str, namespaces: Sequence[str]) -> list[str]:
    """The API paths of the peering objects kopf will use: the ClusterKopfPeering when the operator
    watches the whole cluster, else a KopfPeering in each watched namespace."""
    if not namespaces:
        return [f"{GROUP_PATH}/clusterkopfpeerings/{name}"]
    return [f"{GROUP_PATH}/namespaces/{ns}/kopfpeerings/{name}" for ns in namespaces]


class PeeringMissing(RuntimeError):
    pass


async def wait_for_peering(
    kube: KubeClient,
    name: str,
    namespaces: Sequence[str],
    *,
    timeout_s: float = WAIT_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Return once every peering object exists; PeeringMissing naming the ones that do not after
    ``timeout_s``. Other API errors (not yet authorized while RBAC propagates) count as not yet."""
    missing = peering_paths(name, namespaces)
    deadline = clock() + timeout_s
    while True:
        still = []
        for p in missing:
            try:
                await kube.request("GET", p)
            except ApiError:
                still.append(p)
        missing = still
        if not missing:
            return
        if clock() >= deadline:
            raise PeeringMissing(
                f"peering object(s) not found after {timeout_s:.0f}s: {', '.join(missing)} "
                "(install them with the operator, or run without --peering)"
            )
        await asyncio.sleep(POLL_S)
