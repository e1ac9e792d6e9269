"""Fixtures of the end-to-end tests: one cluster per test run, one namespace per test.

    def test_x(cluster, namespace):                 # any test using `cluster` is marked e2e
        cluster.core.create_namespaced_pod(namespace, {...})
        pods = cluster.wait_pods_ready(namespace, "app=x", 2)

The cluster comes from e2e/provider.py ($ROUTERFLEET_E2E_PROVIDER: local, the default, or kind). The
local one runs inside a private network namespace: as root the session fixture moves pytest into a
fresh one itself; otherwise start pytest with `python -m e2e.cluster pytest ...`. When a test fails,
its report gets the namespace's events, pod statuses and container logs.

Waiting is by watching (list, then watch from its resourceVersion, re-evaluating a condition on
every event); plain polling is kept for things that have no watch (an HTTP answer, a file).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from e2e.dump import describe_pod, dump_namespace
from e2e.fleet_traffic import conds, pod_ready
from e2e.provider import get_provider

NODE = "node-1"


# ------------------------------------------------------------------------------------------ pure helpers


# A pod's conditions and readiness: the demo's and the benches' definitions (e2e/fleet_traffic.py).
conditions = conds


def deployment_available(d) -> bool:
    s, want = d.status, d.spec.replicas
    return (
        (s.observed_generation or 0) >= d.metadata.generation
        and (s.updated_replicas or 0) == want
        and (s.available_replicas or 0) == want
        and (s.replicas or 0) == want
    )


# ------------------------------------------------------------------------------------------ the cluster


class E2ECluster:
    """API clients for one cluster plus the waiting and dumping helpers."""

    conditions = staticmethod(conditions)
    pod_ready = staticmethod(pod_ready)

    def __init__(self, provider, kubeconfig):
        self.provider = provider
        self.kubeconfig = kubeconfig
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.disc = client.DiscoveryV1Api(self.api)
        self.rbac = client.RbacAuthorizationV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)

    # -------------------------------------------------------------------- waiting

    def wait_for(
        self,
        what: str,
        cond: Callable[..., Any],
        timeout: float = 60.0,
        watch_list: tuple[Callable, dict] | None = None,
    ) -> Any:
        """Return the first truthy value of `cond`, or fail after `timeout` seconds naming `what`.

        With `watch_list=(list_fn, kwargs)` (e.g. `(core.list_namespaced_pod, {"namespace": ns})`),
        `cond(objects)` gets the current objects by name and is re-evaluated on each watch event.
        Without it `cond()` is polled (for things no watch reports, like an HTTP answer)."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        if watch_list is None:
            last = None
            while time.monotonic() < deadline:
                self._check_alive()
                try:
                    if v := cond():
                        return v
                except (ApiException, OSError) as e:
                    last = repr(e)[:300]
                time.sleep(0.2)
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last})")
        list_fn, kw = watch_list
        objs: dict[str, Any] = {}
        rv = None
        while True:
            if rv is None:  # (re)list
                lst = list_fn(**kw)
                objs = {o.metadata.name: o for o in lst.items}
                rv = lst.metadata.resource_version
                if v := cond(objs):
                    return v
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._check_alive()
            w = watch.Watch()
            try:
                for ev in w.stream(
                    list_fn, resource_version=rv, timeout_seconds=max(1, min(int(remaining), 10)), **kw
                ):
                    o = ev["object"]
                    rv = o.metadata.resource_version
                    if ev["type"] == "DELETED":
                        objs.pop(o.metadata.name, None)
                    else:
                        objs[o.metadata.name] = o
                    if v := cond(objs):
                        w.stop()
                        return v
                    if time.monotonic() > deadline:
                        break
            except ApiException as e:
                if e.status != 410:  # 410 Gone: resourceVersion too old, list again
                    raise
                rv = None
        state = "\n".join(
            describe_pod(o) if isinstance(o, client.V1Pod) else o.metadata.name for o in objs.values()
        )
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last state:\n{state}")

    def _check_alive(self) -> None:
        if hasattr(self.provider, "check_alive"):
            self.provider.check_alive()

    def wait_pods_ready(self, ns: str, selector: str, n: int, timeout: float = 90.0) -> list:
        """Exactly `n` pods matching `selector`, all Ready (and none terminating)."""

        def cond(objs):
            pods = list(objs.values())
            return pods if len(pods) == n and all(pod_ready(p) for p in pods) else None

        return self.wait_for(
            f"{n} pods {selector!r} Ready in {ns}",
            cond,
            timeout,
            (self.core.list_namespaced_pod, {"namespace": ns, "label_selector": selector}),
        )

    def wait_pod(self, ns: str, name: str, cond: Callable, what: str, timeout: float = 60.0):
        """The pod `name` once `cond(pod)` holds."""
        return self.wait_for(
            f"pod {ns}/{name}: {what}",
            lambda objs: objs[name] if name in objs and cond(objs[name]) else None,
            timeout,
            (self.core.list_namespaced_pod, {"namespace": ns, "field_selector": f"metadata.name={name}"}),
        )

    def wait_pod_gone(self, ns: str, name: str, timeout: float = 60.0) -> None:
        self.wait_for(
            f"pod {ns}/{name} deleted",
            lambda objs: name not in objs,
            timeout,
            (self.core.list_namespaced_pod, {"namespace": ns, "field_selector": f"metadata.name={name}"}),
        )

    def wait_deployment_available(self, ns: str, name: str, timeout: float = 90.0):
        return self.wait_for(
            f"deployment {ns}/{name} available",
            lambda objs: objs.get(name) if name in objs and deployment_available(objs[name]) else None,
            timeout,
            (
                self.apps.list_namespaced_deployment,
                {"namespace": ns, "field_selector": f"metadata.name={name}"},
            ),
        )

    # -------------------------------------------------------------------- logs and dumps

    def container_log(self, ns: str, pod: str, container: str) -> str:
        text = self.provider.container_log(ns, pod, container)
        if text is None:
            try:
                text = self.core.read_namespaced_pod_log(pod, ns, container=container)
            except ApiException as e:
                text = f"(no log: {e.status} {e.reason})"
        return text

    def dump_namespace(self, ns: str, log_lines: int = 40) -> str:
        """Events, workloads, pod statuses and the tail of every container's log in `ns`."""
        dump = dump_namespace(self.api, ns, self.container_log, log_lines)
        return f"cluster: {self.provider.describe()}\n{dump}"


# ------------------------------------------------------------------------------------------ fixtures


# An e2e test's time bound unless it sets its own: the first one also starts the cluster.
E2E_TIMEOUT_S = 600


def pytest_collection_modifyitems(items):
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        item.session.e2e_failed = True
    ns_info = getattr(item, "e2e_namespace", None)
    if rep.when == "call" and rep.failed and ns_info:
        kube, ns = ns_info
        try:
            dump = kube.dump_namespace(ns)
        except Exception as e:  # the dump must never hide the failure itself
            dump = f"(dump failed: {e!r})"
        rep.sections.append((f"e2e dump of namespace {ns}", dump))


@pytest.fixture(scope="session")
def cluster(request) -> E2ECluster:
    """One cluster for the whole run, with node-1 Ready and untainted."""
    provider = get_provider()
    try:
        kubeconfig = provider.up()
    except RuntimeError as e:  # ProviderError, ClusterError, a failed build of the binaries
        provider.down(keep=True)
        pytest.fail(f"{type(e).__name__}: {e}", pytrace=False)
    kube = E2ECluster(provider, kubeconfig)
    if provider.name == "local":
        kube.wait_for(
            f"node {NODE} Ready without taints",
            lambda objs: (
                (n := objs.get(NODE))
                and conditions(n).get("Ready") == "True"
                and not [t for t in n.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
            ),
            90,
            (kube.core.list_node, {}),
        )
    yield kube
    keep = getattr(request.session, "e2e_failed", False)
    provider.down(keep=keep)
    if keep:
        print(f"\n[e2e] a test failed; kept {provider.describe()}")


def _ns_name(test_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"{base}-{uuid.uuid4().hex[:5]}"


@pytest.fixture
def namespace(cluster: E2ECluster, request) -> str:
    """A fresh namespace (with its default ServiceAccount, so bare pods are admitted), deleted after
    the test; on failure the test report carries a dump of it."""
    ns = _ns_name(request.node.name)
    cluster.core.create_namespace({"metadata": {"name": ns, "labels": {"routerfleet.e2e/test": "true"}}})
    request.node.e2e_namespace = (cluster, ns)
    cluster.wait_for(
        f"default ServiceAccount in {ns}",
        lambda objs: "default" in objs,
        30,
        (cluster.core.list_namespaced_service_account, {"namespace": ns}),
    )
    yield ns
    try:
        cluster.core.delete_namespace(ns)
    except ApiException as e:
        if e.status != 404:
            raise
