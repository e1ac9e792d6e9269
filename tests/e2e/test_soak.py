"""The short chaos soak (e2e/soak.py) on the test run's cluster: the operator-managed fleet under
continuous chats, one fault of every class in a seeded order, each followed by convergence; no false
hit outside a doubtful prediction, no request lost, every fault converged. The long soak is
``python -m e2e.soak`` (20 minutes)."""

from __future__ import annotations

import uuid

import pytest
from test_operator import _local_only

from e2e import fleet_traffic as T
from e2e.soak import FAULTS, soak


@pytest.mark.timeout(1200)  # the soak caps itself at 8 minutes, each fault's convergence on top
def test_short_soak(cluster):
    _local_only(cluster)
    if getattr(cluster.provider, "cluster", None) is None:
        pytest.skip("the soak restarts the API server: it needs the run's own control plane")
    ns = f"soak-{uuid.uuid4().hex[:5]}"
    try:
        failures = soak(
            T.Kube(cluster.kubeconfig), cluster.provider, ns, seed=11, faults=list(FAULTS), rounds=1,
            minutes=8, settle_s=10,
        )  # fmt: skip
    finally:
        cluster.core.delete_namespace(ns)
    assert not failures, "\n".join(failures)
