"""A real Prometheus (Debian's package, e2e/debian/install.sh) scrapes a helm-installed operator and a
fleet's routers with the shipped scrape jobs (manifests/prometheus/scrape.yaml: Kubernetes service
discovery of the annotated router pods and operator Service), and after a chat workload and a rollout
every PromQL expression of the Grafana dashboard (manifests/grafana/routerfleet.json) returns at
least one series: a panel whose query returns nothing is a defect.

Debian builds Prometheus without its Kubernetes discovery (kubernetes_sd_configs is unknown to it), so
the test stands in for that one part: it lists the pods and the Services' EndpointSlices itself and
writes them as file_sd target groups carrying the same __meta_kubernetes_* labels kubernetes_sd sets.
The jobs' relabel_configs, the part a user copies, are the sample's, unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import aiohttp
import test_operator
import yaml
from test_operator import (
    ENGINE_LABELS,
    FLEET,
    GROUP,
    PLURAL,
    ROOT,
    VERSION,
    _local_only,
    deploy_engines,
    fleet_manifest,
    get_fleet,
    helm_install_operator,
    wait_fleet_ready,
)

from e2e import fleet as F
from tests.support import stop_process

crd = test_operator.crd  # the fixture: the CRD applied

DASHBOARD = ROOT / "manifests" / "grafana" / "routerfleet.json"
SCRAPE = ROOT / "manifests" / "prometheus" / "scrape.yaml"
SEL = f"routerfleet.io/fleet={FLEET}"
RATE_INTERVAL, RANGE = "20s", "10m"  # what Grafana would put for $__rate_interval and $__range


def dashboard_queries(namespace: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel, the dashboard's variables filled as Grafana would."""
    d = json.loads(DASHBOARD.read_text())
    flat = [q for p in d["panels"] for q in (p, *p.get("panels", []))]
    out = []
    for p in flat:
        for t in p.get("targets") or []:
            expr = t["expr"].replace("$__rate_interval", RATE_INTERVAL).replace("$__range", RANGE)
            out.append((p["title"], expr.replace("$namespace", namespace)))
    return out


def scrape_config(sd_dir: Path) -> dict:
    """manifests/prometheus/scrape.yaml scraping every second, each job's kubernetes_sd_configs (one
    role each) replaced by the file this test's discovery writes for that role."""
    cfg = yaml.safe_load(SCRAPE.read_text())
    for job in cfg["scrape_configs"]:
        job["scrape_interval"] = "1s"
        (sd,) = job.pop("kubernetes_sd_configs")
        job["file_sd_configs"] = [{"files": [str(sd_dir / f"{sd['role']}.json")]}]
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, **cfg}


def _meta(prefix: str, items: dict | None) -> dict[str, str]:
    """Labels or annotations as kubernetes_sd names them: non-alphanumerics become underscores."""
    return {prefix + re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in (items or {}).items()}


def discover(cluster, ns: str) -> dict[str, list[dict]]:
    """What kubernetes_sd's pod and endpoints roles would yield for ``ns``, as file_sd target groups."""
    pods = cluster.core.list_namespaced_pod(ns).items
    by_name = {p.metadata.name: p for p in pods}
    pod_groups = []
    for p in pods:
        if not p.status.pod_ip or p.metadata.deletion_timestamp is not None:
            continue
        labels = {
            "__meta_kubernetes_namespace": ns,
            "__meta_kubernetes_pod_name": p.metadata.name,
            **_meta("__meta_kubernetes_pod_annotation_", p.metadata.annotations),
            **_meta("__meta_kubernetes_pod_label_", p.metadata.labels),
        }
        ports = [port.container_port for c in p.spec.containers for port in c.ports or []]
        targets = [f"{p.status.pod_ip}:{port}" for port in ports] or [p.status.pod_ip]
        pod_groups.append({"targets": targets, "labels": labels})
    endpoint_groups = []
    for svc in cluster.core.list_namespaced_service(ns).items:
        slices = cluster.disc.list_namespaced_endpoint_slice(
            ns, label_selector=f"kubernetes.io/service-name={svc.metadata.name}"
        ).items
        for sl in slices:
            for ep in sl.endpoints or []:
                ref = ep.target_ref.name if ep.target_ref is not None else ""
                if ref not in by_name or not (ep.conditions and ep.conditions.ready):
                    continue
                labels = {
                    "__meta_kubernetes_namespace": ns,
                    "__meta_kubernetes_pod_name": ref,
                    **_meta("__meta_kubernetes_service_annotation_", svc.metadata.annotations),
                    **_meta("__meta_kubernetes_service_label_", svc.metadata.labels),
                }
                targets = [f"{a}:{port.port}" for a in ep.addresses for port in sl.ports or []]
                endpoint_groups.append({"targets": targets, "labels": labels})
    return {"pod": pod_groups, "endpoints": endpoint_groups}


@contextlib.contextmanager
def discovery(cluster, ns: str, sd_dir: Path):
    """``discover`` written to ``sd_dir`` now and every half second (Prometheus watches the files)."""
    sd_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()

    def write() -> None:
        for role, groups in discover(cluster, ns).items():
            tmp = sd_dir / f".{role}.json"
            tmp.write_text(json.dumps(groups))
            tmp.replace(sd_dir / f"{role}.json")

    def loop() -> None:
        while not stop.wait(0.5):
            with contextlib.suppress(Exception):  # an API hiccup: the next round writes it
                write()

    write()
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prometheus(cfg: dict, workdir: Path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: run `make prometheus` (make test does)"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    url = f"http://127.0.0.1:{_free_port()}"
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus not ready in 30 s"
            time.sleep(0.2)
        yield url
    finally:
        stop_process(proc)
        log.close()


def query(url: str, expr: str) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def targets_up(url: str) -> dict[str, int]:
    with urllib.request.urlopen(url + "/api/v1/targets?state=active", timeout=10) as r:
        active = json.loads(r.read())["data"]["activeTargets"]
    out: dict[str, int] = {}
    for t in active:
        if t["health"] == "up":
            out[t["labels"]["job"]] = out.get(t["labels"]["job"], 0) + 1
    return out


async def chats(pods: list, seconds: float, seed: int) -> int:
    """Multi-turn chats round-robin over ``pods`` for ``seconds``; returns the requests made."""
    from e2e.fleet_traffic import Texts

    texts = Texts(seed)
    convs = [texts.conv() for _ in range(8)]
    urls = [F.pod_url(p, F.ROUTER_PORT) for p in pods]
    n = 0
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while time.monotonic() < deadline:
            for c in convs:
                c.messages.append({"role": "user", "content": c.turns[c.i % len(c.turns)]})
                _ttft, answer, _p, _c = await F.chat_turn(session, urls[n % len(urls)], c.messages)
                c.messages.append({"role": "assistant", "content": answer})
                c.i += 1
                n += 1
    return n


def test_every_dashboard_query_returns_series(cluster, namespace, crd, tmp_path):
    _local_only(cluster)
    ns = namespace
    t0 = time.monotonic()
    helm_install_operator(cluster, ns)
    deploy_engines(cluster, ns)
    cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    m = fleet_manifest(cluster, ns, 2)
    # as manifests/samples/full.yaml annotates its routers for a Prometheus without the Operator
    m["spec"]["router"]["podAnnotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": "9090"}
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, m)
    obj = wait_fleet_ready(cluster, crd, ns, "fleet Ready")
    with (
        discovery(cluster, ns, tmp_path / "sd"),
        prometheus(scrape_config(tmp_path / "sd"), tmp_path / "prometheus") as url,
    ):
        cluster.wait_for("2 routers and 2 operator replicas scraped", lambda: (
            (up := targets_up(url)).get("routerfleet-routers", 0) >= 2
            and up.get("routerfleet-operator", 0) >= 2 and up
        ), 60)  # fmt: skip
        pods = [
            p for p in cluster.core.list_namespaced_pod(ns, label_selector=SEL).items if cluster.pod_ready(p)
        ]
        n = asyncio.run(chats(pods, 6.0, seed=1))
        print(f"\n[prometheus] {n} chat requests, then a rollout ({time.monotonic() - t0:.1f}s)")
        rev = obj["status"]["currentRevision"]
        stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        crd.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            ns,
            PLURAL,
            FLEET,
            {"metadata": {"annotations": {"routerfleet.io/restartedAt": stamp}}},
        )
        cluster.wait_for(
            "the new revision current",
            lambda: get_fleet(crd, ns)["status"].get("currentRevision") not in (None, rev),
            150,
        )
        wait_fleet_ready(cluster, crd, ns, "Ready on the new revision", timeout=120)
        pods = [
            p for p in cluster.core.list_namespaced_pod(ns, label_selector=SEL).items if cluster.pod_ready(p)
        ]
        n = asyncio.run(chats(pods, 4.0, seed=2))
        time.sleep(3)  # a few more scrapes of the new routers
        empty = []
        queries = dashboard_queries(ns)
        for title, expr in queries:
            if not query(url, expr):
                empty.append(f"{title}: {expr}")
        took = time.monotonic() - t0
        print(
            f"[prometheus] {len(queries) - len(empty)}/{len(queries)} queries returned series ({took:.1f}s)"
        )
    assert not empty, "queries that returned no series:\n" + "\n".join(empty)
