"""The CRD manifest, kept in step with the operator's code and the router. (That the API server accepts
it, its CEL rules and defaults, is checked by tests/e2e/test_operator_failures.py on a real one.)"""

from __future__ import annotations

import re

import pytest
import yaml

from router_runtime.kv.events import Dialect
from routerfleet_operator.model import (
    DEFAULT_PASS_VERDICTS,
    NEVER_PASS,
    OWNED_FLAGS,
    RESERVED_ENV,
    RESERVED_VOLUMES,
    PauseReason,
    Phase,
    Verdict,
)
from routerfleet_operator.rollout import SEED_FAILED_COUNT, VERDICT_COUNTS
from routerfleet_operator.spec import OTLP_ENDPOINT, POLICIES, Fleet, validate

from .helpers import SAMPLES, apply_defaults, crd, schema, schema_errors

SPEC = schema()["properties"]["spec"]
STATUS = schema()["properties"]["status"]


def _rules(node) -> list[str]:
    """Every CEL rule (and messageExpression) in the schema."""
    out = []
    if isinstance(node, dict):
        for r in node.get("x-kubernetes-validations") or ():
            out += [r["rule"], r.get("messageExpression", "")]
        for v in node.values():
            out += _rules(v)
    elif isinstance(node, list):
        for v in node:
            out += _rules(v)
    return out


def test_identity_and_subresources():
    c = crd()
    assert c["metadata"]["name"] == "routerfleets.routerfleet.io"
    assert c["spec"]["group"] == "routerfleet.io" and c["spec"]["scope"] == "Namespaced"
    assert c["spec"]["names"]["kind"] == "RouterFleet" and c["spec"]["names"]["shortNames"] == ["rf"]
    (v,) = c["spec"]["versions"]
    assert v["name"] == "v1alpha1" and v["served"] and v["storage"]
    assert v["subresources"]["status"] == {}
    assert v["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert STATUS["properties"]["selector"]["type"] == "string"  # a string, or an HPA never acts
    assert STATUS["properties"]["replicas"]["type"] == "integer"
    assert STATUS["properties"]["observedGeneration"]["type"] == "integer"  # kstatus needs an int


def test_printer_columns():
    cols = {c["name"]: c for c in crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert list(cols) == ["Desired", "Ready", "Warm", "Updated", "Phase", "Status", "Reason", "Age"]
    assert cols["Status"]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert cols["Phase"]["jsonPath"] == ".status.rollout.phase"


def test_conditions_are_a_map_list():
    cond = STATUS["properties"]["conditions"]
    assert cond["x-kubernetes-list-type"] == "map" and cond["x-kubernetes-list-map-keys"] == ["type"]
    assert set(cond["items"]["required"]) == {"type", "status", "lastTransitionTime", "reason", "message"}


def test_enums_match_the_code():
    boot = SPEC["properties"]["bootstrap"]["properties"]
    assert boot["passVerdicts"]["items"]["enum"] == [v.value for v in Verdict if v not in NEVER_PASS]
    assert set(boot["passVerdicts"]["default"]) == DEFAULT_PASS_VERDICTS
    assert boot["passVerdicts"]["maxItems"] == len(Verdict) - len(NEVER_PASS)
    router = SPEC["properties"]["router"]["properties"]
    assert tuple(router["policy"]["enum"]) == POLICIES
    engines = SPEC["properties"]["engines"]["properties"]
    assert engines["eventDialect"]["enum"] == ["auto", *(d.value for d in Dialect)]
    rollout = STATUS["properties"]["rollout"]["properties"]
    assert rollout["phase"]["enum"] == [p.value for p in Phase]
    assert rollout["pauseReason"]["enum"] == [r.value for r in PauseReason]
    counts = set(STATUS["properties"]["verdicts"]["properties"])
    camel = {re.sub(r"_(\w)", lambda m: m.group(1).upper(), v.value) for v in Verdict}
    assert counts == camel | {"unknown", "seedFailed"}
    # The status writes every verdict's count under its own key, and nothing else.
    assert set(VERDICT_COUNTS) == {"unknown", *(v.value for v in Verdict)}
    assert {*VERDICT_COUNTS.values(), SEED_FAILED_COUNT} == counts


def test_cel_rules_carry_the_code_lists():
    rules = "\n".join(_rules(SPEC))
    listed = re.findall(r"'(--[a-z0-9-]+)'", rules)
    assert set(listed) == set(OWNED_FLAGS)
    for name in RESERVED_ENV:
        assert f"'{name}'" in rules
    for name in RESERVED_VOLUMES:
        assert f"'{name}'" in rules
    assert "'no_peers' in self && 'fleet_cold' in self" in rules


def test_the_tracing_schema_matches_the_parser():
    tracing = SPEC["properties"]["router"]["properties"]["tracing"]
    endpoint, ratio = tracing["properties"]["endpoint"], tracing["properties"]["sampleRatio"]
    (rule,) = endpoint["x-kubernetes-validations"]
    # The CEL string literal, unescaped, is the parser's regular expression.
    (literal,) = re.findall(r"self\.matches\('(.*)'\)", rule["rule"])
    assert literal.replace("\\\\", "\\") == OTLP_ENDPOINT.pattern
    assert (ratio["type"], ratio["minimum"], ratio["maximum"], ratio["default"]) == ("number", 0, 1, 1.0)
    assert "required" not in tracing and "default" not in tracing  # no endpoint: off
    spec = {"router": {"image": "x", "tracing": {"endpoint": "http://c"}}, "engines": {"serviceName": "e"}}
    assert schema_errors(spec, SPEC, "spec") == []
    for bad in (1.5, -0.1, "0.5", True):
        spec["router"]["tracing"]["sampleRatio"] = bad
        assert schema_errors(spec, SPEC, "spec") != [], bad


def test_every_list_and_string_in_a_rule_is_bounded():
    """CEL's cost estimate needs maxItems/maxLength where a rule iterates (else the CRD is refused)."""
    router = SPEC["properties"]["router"]["properties"]
    assert router["extraArgs"]["maxItems"] and router["extraArgs"]["items"]["maxLength"]
    assert router["env"]["maxItems"] and router["volumes"]["maxItems"]
    assert router["sessionStore"]["properties"]["url"]["maxLength"]
    assert router["tracing"]["properties"]["endpoint"]["maxLength"]


def _spec_paths(sch, prefix=""):
    for k, sub in (sch.get("properties") or {}).items():
        path = f"{prefix}.{k}"
        yield path
        if (
            sub.get("type") == "object"
            and "properties" in sub
            and not sub.get("x-kubernetes-preserve-unknown-fields")
        ):
            yield from _spec_paths(sub, path)


def _has(obj, path):
    node = obj
    for k in path.strip(".").split("."):
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True


def test_the_full_sample_shows_every_field():
    full = yaml.safe_load((SAMPLES / "full.yaml").read_text())["spec"]
    alternatives = {".engines.serviceName", ".disruption.minAvailable", ".router.tokenizer.configMapName",
                    ".engines.namespace", ".router.scheduling.affinity",
                    ".engines.selector.matchExpressions"}  # fmt: skip
    # A disaggregated fleet has its own sample, which shows that section whole.
    disaggregated = yaml.safe_load((SAMPLES / "disaggregated.yaml").read_text())["spec"]
    elsewhere = [p for p in _spec_paths(SPEC) if p.startswith(".engines.disaggregation")]
    shown = [p for p in elsewhere if p != ".engines.disaggregation.roleLabel"]  # prefillServiceName's twin
    assert shown and all(_has(disaggregated, p) for p in shown)
    missing = [
        p for p in _spec_paths(SPEC) if not _has(full, p) and p not in alternatives and p not in elsewhere
    ]
    assert missing == []


@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_samples_are_valid_and_defaults_agree(path):
    obj = yaml.safe_load(path.read_text())
    assert schema_errors(obj["spec"], SPEC, "spec") == []
    fleet = Fleet.parse(obj)
    assert validate(fleet) == []
    # The API server's defaults (applied from the schema) and the parser's mean the same fleet.
    defaulted = {**obj, "spec": apply_defaults(obj["spec"], SPEC)}
    assert Fleet.parse(defaulted) == fleet


def test_defaults_of_an_empty_spec_agree():
    bare = {"router": {"image": "x"}, "engines": {"serviceName": "e", "kvPort": 1}}
    obj = {"apiVersion": "routerfleet.io/v1alpha1", "kind": "RouterFleet", "metadata": {"name": "a"}}
    assert Fleet.parse({**obj, "spec": apply_defaults(bare, SPEC)}) == Fleet.parse({**obj, "spec": bare})
    filled = apply_defaults(bare, SPEC)
    assert filled["bootstrap"]["timeout"] == "10m" and filled["rollout"]["progressDeadline"] == "1h"
    assert filled["router"]["tokenizer"] == {"source": "Bytes"}


def _undescribed(node: dict, path: str, named: bool) -> list[str]:
    """Every named field (a key under ``properties``) below ``node`` without a description: what
    ``kubectl explain`` would show as ``<no description>``. Array items and map values are reached
    through their field, which carries the description."""
    # The API server allows nothing but name and generateName in a CRD's metadata schema.
    exempt = path == "rf.metadata"
    out = [path] if named and not exempt and not node.get("description") else []
    for key, child in (node.get("properties") or {}).items():
        out += _undescribed(child, f"{path}.{key}", True)
    for inner, suffix in ((node.get("items"), "[]"), (node.get("additionalProperties"), "{}")):
        if isinstance(inner, dict):
            out += _undescribed(inner, path + suffix, False)
    return out


def test_every_crd_field_has_a_description():
    for version in crd()["spec"]["versions"]:
        root = version["schema"]["openAPIV3Schema"]
        assert root.get("description")
        assert _undescribed(root, "rf", False) == [], version["name"]


SCHEMA_KEYWORDS = {
    "type", "properties", "description", "items", "enum", "default", "format", "maxItems", "minItems",
    "maxLength", "minLength", "minimum", "maximum", "pattern", "required", "additionalProperties",
    "nullable", "x-kubernetes-validations", "x-kubernetes-int-or-string", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-map-type", "anyOf",
}  # fmt: skip


def _schema_nodes(node: dict, path: str):
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _schema_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _schema_nodes(node["additionalProperties"], f"{path}{{}}")


def test_every_schema_node_uses_only_openapi_keywords():
    """A comma inside a YAML flow mapping (``{type: string, description: a, b}``) silently makes a
    keyword out of the rest of the text; the API server refuses the CRD, this test says where."""
    for version in crd()["spec"]["versions"]:
        for path, node in _schema_nodes(version["schema"]["openAPIV3Schema"], "rf"):
            assert set(node) <= SCHEMA_KEYWORDS, (path, set(node) - SCHEMA_KEYWORDS)
