"""manifests/grafana/routerfleet.json: valid JSON, every panel has PromQL, and every metric (and every
label it groups by) exists in the code. Metric names are built from a prefix in each metrics class
(``p + "ranks"``), so the names are taken from the classes themselves, registered on fresh registries,
rather than grepped as whole strings."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from router_runtime.bootstrap.metrics import BootstrapMetrics
from router_runtime.kv.metrics import KVMetrics
from router_runtime.proxy.metrics import ProxyMetrics
from routerfleet_operator.metrics import OperatorMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "manifests" / "grafana" / "routerfleet.json"
# Added by the scrape (Kubernetes service discovery and relabelling), or by PromQL itself.
TARGET_LABELS = {"namespace", "pod", "instance", "job", "le", "state"}
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def known_metrics() -> dict[str, set[str]]:
    """Every exposed sample name of the operator's and the routers' metrics -> its label names."""
    out: dict[str, set[str]] = {}
    for cls in (OperatorMetrics, BootstrapMetrics, KVMetrics, ProxyMetrics):
        reg = CollectorRegistry()
        cls(reg)
        for collector in list(reg._collector_to_names):
            name, labels = collector._name, set(collector._labelnames)
            for n in (name, *(name + s for s in SUFFIXES)):
                out[n] = labels
    return out


def panels() -> list[dict]:
    d = json.loads(DASHBOARD.read_text())
    flat = []
    for p in d["panels"]:
        flat += [p, *p.get("panels", [])]
    return [p for p in flat if p["type"] != "row"]


def test_dashboard_parses_and_every_panel_has_promql():
    d = json.loads(DASHBOARD.read_text())
    assert d["title"] == "RouterFleet" and d["uid"]
    ps = panels()
    assert len(ps) >= 20
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for p in ps:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), (p["title"], t["expr"])


def test_every_metric_and_grouping_label_exists():
    known = known_metrics()
    used: set[str] = set()
    for p in panels():
        for t in p["targets"]:
            names = set(re.findall(r"\brouterfleet_[a-z_]+\b", t["expr"]))
            assert names, (p["title"], t["expr"])
            missing = names - known.keys()
            assert not missing, (p["title"], missing)
            used |= names
            labels = set().union(*(known[n] for n in names)) | TARGET_LABELS
            for group in re.findall(r"\bby \(([^)]*)\)", t["expr"]):
                for label in (x.strip() for x in group.split(",")):
                    assert label in labels, (p["title"], label, t["expr"])

    def covered(prefix: str) -> bool:
        return any(n.startswith(prefix) for n in used)

    # the brief's coverage: operator metrics, and the routers' bootstrap, routing and KV series
    for family in (
        "routerfleet_operator_reconciles_total",
        "routerfleet_operator_reconcile_duration_seconds_bucket",
        "routerfleet_operator_rollouts_total",
        "routerfleet_operator_seeded_total",
        "routerfleet_operator_fleet_phase",
        "routerfleet_requests_total",
        "routerfleet_inflight",
    ):
        assert family in used, family
    for prefix in ("routerfleet_bootstrap_", "routerfleet_routing_", "routerfleet_kv_"):
        assert covered(prefix), prefix


def test_the_alert_rules_use_only_metrics_that_exist():
    import yaml

    doc = yaml.safe_load((ROOT / "manifests" / "prometheus" / "routerfleet-rules.yaml").read_text())
    known = known_metrics()
    records = set()
    for group in doc["spec"]["groups"]:
        for rule in group["rules"]:
            names = set(re.findall(r"\brouterfleet_[a-z_]+\b", rule["expr"]))
            assert names - known.keys() == set(), rule
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule
            records |= {rule["record"]} if "record" in rule else set()
            for used in re.findall(r"\brouterfleet:[a-z_:0-9]+", rule["expr"]):
                assert used in records, (used, "is not recorded above")
