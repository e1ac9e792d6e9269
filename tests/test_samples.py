"""The real-engine samples (manifests/samples/engines) against what the engines and the router accept:
every engine flag is one of that engine release's options and every ``--kv-events-config`` key one of
its configuration's fields (both recorded from the engines' source by tests/data/engine_config/record.py);
the events are on and their endpoints bind the ports the Service and the RouterFleet name; the block
sizes agree; the RouterFleet passes the CRD's schema and the operator's validation, and the flags the
operator renders for it parse with the router's own parser."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from router_runtime.config import parse_args
from routerfleet_operator.render import TOKEN_DIR, router_args
from routerfleet_operator.spec import Fleet, validate

from .operator.helpers import schema, schema_errors

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "manifests" / "samples" / "engines"
ENGINES = json.loads((ROOT / "tests" / "data" / "engine_config" / "engines.json").read_text())
RELEASE = {"vllm.yaml": "vllm-0.33.0", "sglang.yaml": "sglang-0.5.23"}
BLOCK_FLAG = {"vllm-0.33.0": "block_size", "sglang-0.5.23": "page_size"}


def _docs(path: Path) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text())}


def _flags(args: list[str]) -> dict[str, str | None]:
    """``--name=value`` / ``--name value`` / ``--flag`` -> {snake_name: value or None}."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        a = args[i]
        assert a.startswith("--"), f"not a flag: {a!r}"
        name, eq, value = a[2:].partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        out[name.replace("-", "_")] = value if (eq or value) else None
        i += 1
    return out


def _port(endpoint: str) -> int:
    port = urlsplit(endpoint).port
    assert port is not None, endpoint
    return port


@pytest.mark.parametrize("name", sorted(RELEASE))
def test_a_real_engine_sample_agrees_with_the_engine_and_the_fleet(name, tmp_path):
    docs = _docs(SAMPLES / name)
    release = ENGINES[RELEASE[name]]
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    flags = _flags(container["args"])
    assert set(flags) <= set(release["options"]), set(flags) - set(release["options"])

    events = json.loads(flags["kv_events_config"])
    assert set(events) <= set(release["fields"]), set(events) - set(release["fields"])
    assert events["publisher"] == "zmq" and events.get("enable_kv_cache_events", True) is True
    fleet_obj = docs["RouterFleet"]
    engines = fleet_obj["spec"]["engines"]
    service_ports = {p["name"]: p["port"] for p in docs["Service"]["spec"]["ports"]}
    assert _port(events["endpoint"]) == service_ports[engines["kvPort"]]
    assert _port(events["replay_endpoint"]) == service_ports[engines["replayPort"]]
    assert events.get("topic", "") == engines.get("topic", "")
    assert docs["Service"]["metadata"]["name"] == engines["serviceName"]
    assert int(flags[BLOCK_FLAG[RELEASE[name]]]) == fleet_obj["spec"]["router"]["blockSize"]
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]

    assert schema_errors(fleet_obj["spec"], schema()["properties"]["spec"], "spec") == []
    fleet = Fleet.parse(fleet_obj)
    assert validate(fleet) == []
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    rendered = [str(token) if a == f"{TOKEN_DIR}/token" else a for a in router_args(fleet)]
    config = parse_args(rendered)
    assert config.tokens.tokenizer == "engine" and config.kv.block_size == fleet.spec.router.block_size
    assert str(config.tokens.chat_family) == RELEASE[name].split("-")[0]


def test_the_recorded_engine_facts_name_what_the_samples_rely_on():
    for release in ENGINES.values():
        assert {"publisher", "endpoint", "replay_endpoint", "topic", "buffer_steps"} <= set(release["fields"])
        assert {"kv_events_config", "port", "host"} <= set(release["options"])
    assert {"block_size", "enable_prefix_caching", "model"} <= set(ENGINES["vllm-0.33.0"]["options"])
    assert {"page_size", "model_path"} <= set(ENGINES["sglang-0.5.23"]["options"])


def test_the_disaggregated_vllm_sample_agrees_with_vllm_and_its_fleet(tmp_path):
    docs = list(yaml.safe_load_all((SAMPLES / "vllm-disaggregated.yaml").read_text()))
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    (fleet_obj,) = (d for d in docs if d["kind"] == "RouterFleet")
    engines = fleet_obj["spec"]["engines"]
    pd = engines["disaggregation"]
    assert set(deployments) == set(services) == {engines["serviceName"], pd["prefillServiceName"]}
    release = ENGINES["vllm-0.33.0"]
    revisions = set()
    for name, dep in deployments.items():
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        flags = _flags(container["args"])
        assert set(flags) <= set(release["options"]), set(flags) - set(release["options"])
        transfer = json.loads(flags["kv_transfer_config"])
        assert set(transfer) <= set(release["transfer_fields"]), set(transfer) - set(
            release["transfer_fields"]
        )
        # kv_both: a decode engine prefills a short suffix itself (the decider's skip), a prefill
        # engine hands its KV on
        assert transfer["kv_role"] == "kv_both"
        events = json.loads(flags["kv_events_config"])
        ports = {p["name"]: p["port"] for p in services[name]["spec"]["ports"]}
        assert _port(events["endpoint"]) == ports[engines["kvPort"]]
        assert int(flags["block_size"]) == fleet_obj["spec"]["router"]["blockSize"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert services[name]["spec"]["selector"].items() <= labels.items()
        revisions.add(labels[pd["revisionLabel"]])
    assert len(revisions) == 1  # one revision on both: they pair
    assert schema_errors(fleet_obj["spec"], schema()["properties"]["spec"], "spec") == []
    fleet = Fleet.parse(fleet_obj)
    assert validate(fleet) == []
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    config = parse_args([str(token) if a == f"{TOKEN_DIR}/token" else a for a in router_args(fleet)])
    assert config.discovery.prefill_selector == f"kubernetes.io/service-name={pd['prefillServiceName']}"
    assert config.discovery.revision_label == pd["revisionLabel"]
