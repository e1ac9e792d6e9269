"""The spec: parsing with the CRD's defaults, durations, validation, and the operator-owned flags kept
in step with the router's command line."""

from __future__ import annotations

import argparse
import operator as stdlib_operator
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router_runtime.bootstrap.state import Verdict as RouterVerdict
from router_runtime.config import build_parser
from router_runtime.scheduling.presets import POLICY_NAMES
from router_runtime.tracing.config import _endpoint as tracing_endpoint
from routerfleet_operator.model import OWNED_FLAGS, Verdict, owned_flag_in
from routerfleet_operator.spec import (
    POLICIES,
    Fleet,
    SpecError,
    Tracing,
    format_duration,
    parse_duration,
    selector_string,
    validate,
)

from .helpers import fleet_obj


def test_the_stdlib_operator_module_is_not_shadowed():
    assert (
        stdlib_operator.__file__.startswith(sys.base_prefix)
        or "site-packages" not in stdlib_operator.__file__
    )
    assert stdlib_operator.__file__.endswith("operator.py") and hasattr(stdlib_operator, "itemgetter")


def test_verdicts_and_policies_match_the_router():
    assert [v.value for v in Verdict] == [v.value for v in RouterVerdict]
    assert POLICIES == POLICY_NAMES


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("10m", 600),
        ("1h30m", 5400),
        ("90s", 90),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        ("1h", 3600),
        ("2m30s", 150),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10", "-5s", "5 s", "1d", "m", "1.s", "+1s", None, 5])
def test_bad_durations(text):
    with pytest.raises(SpecError):
        parse_duration(text)


@given(st.integers(0, 10**6))
def test_duration_round_trip(seconds):
    assert parse_duration(format_duration(seconds)) == seconds


def test_defaults():
    s = Fleet.parse(fleet_obj()).spec
    assert (s.replicas, s.paused, s.router.policy, s.router.block_size, s.router.tokenizer.source) == (
        2, False, "kv_aware", 16, "Bytes",
    )  # fmt: skip
    assert s.bootstrap.enabled and s.bootstrap.timeout_s == 600 and not s.bootstrap.seed_required
    assert s.bootstrap.pass_verdicts == {
        "warm",
        "from_origin",
        "warm_unwitnessed",
        "no_peers",
        "fleet_cold",
        "disabled",
    }
    assert (s.rollout.max_surge, s.rollout.on_seed_failure, s.rollout.progress_deadline_s) == (
        1,
        "Pause",
        3600,
    )
    assert s.engines.http_port == "http" and s.engines.dp_size == 1
    assert s.service.type == "ClusterIP" and s.service.port == 80 and s.disruption.enabled
    assert validate(Fleet.parse(fleet_obj())) == []


def test_selector_string():
    assert selector_string({"matchLabels": {"b": "2", "a": "1"}}) == "a=1,b=2"
    assert (
        selector_string(
            {
                "matchExpressions": [
                    {"key": "tier", "operator": "In", "values": ["y", "x"]},
                    {"key": "env", "operator": "NotIn", "values": ["dev"]},
                    {"key": "gpu", "operator": "Exists"},
                    {"key": "old", "operator": "DoesNotExist"},
                ]
            }
        )
        == "tier in (x,y),env notin (dev),gpu,!old"
    )


@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        ({"bootstrap": {"passVerdicts": ["warm", "fleet_cold"]}}, "must include no_peers and fleet_cold"),
        ({"router": {"extraArgs": ["--internal-token-file=/x"]}}, "extraArgs may not set"),
        ({"router": {"env": [{"name": "POD_IP", "value": "1"}]}}, "may not set POD_IP"),
        ({"router": {"policy": "round_robin"}}, "needs spec.router.policy kv_aware"),
        ({"engines": {"kvPort": None}}, "needs spec.engines.kvPort"),
        ({"engines": {"namespace": "elsewhere"}}, "engines in the fleet's namespace"),
        ({"engines": {"selector": {"matchLabels": {"a": "b"}}}}, "exactly one of serviceName and selector"),
        ({"engines": {"serviceName": None, "selector": {"matchLabels": {}}}}, "selects nothing"),
        (
            {"bootstrap": {"timeout": "20m", "seedRequired": True}, "rollout": {"progressDeadline": "59m"}},
            "must exceed",
        ),
        (
            {"rollout": {"progressDeadline": "2m", "minReadySeconds": 300}, "bootstrap": {"timeout": "1m"}},
            "minReadySeconds",
        ),
        ({"router": {"tokenizer": {"source": "Path"}}}, "needs tokenizer.path"),
        ({"router": {"volumes": [{"name": "internal-token", "emptyDir": {}}]}}, "may not use the names"),
        ({"disruption": {"maxUnavailable": 1, "minAvailable": 1}}, "at most one"),
        ({"router": {"extraArgs": ["--otlp-traces-endpoint=http://c:4318"]}}, "extraArgs may not set"),
        ({"router": {"extraArgs": ["--trace-sample-ratio", "0.5"]}}, "extraArgs may not set"),
        ({"router": {"extraArgs": ["--otlp"]}}, "extraArgs may not set"),  # argparse would expand it
    ],
)
def test_validate(spec, expect):
    problems = validate(Fleet.parse(fleet_obj(spec)))
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        ({"bootstrap": {"timeout": "-5s"}}, "spec.bootstrap.timeout"),
        ({"bootstrap": {"timeout": "2h"}}, "between 1s and 1h"),
        ({"rollout": {"progressDeadline": "30"}}, "not a duration"),
        ({"rollout": {"onSeedFailure": "Abort"}}, "Abort"),
        ({"replicas": -1}, "spec.replicas"),
        ({"router": {"image": ""}}, "image is required"),
        ({"bootstrap": {"passVerdicts": ["lukewarm"]}}, "lukewarm"),
        ({"router": {"tracing": "http://c:4318"}}, "spec.router.tracing must be an object"),
        ({"router": {"tracing": {"endpoint": 4318}}}, "tracing.endpoint must be a string"),
        ({"router": {"tracing": {"endpoint": "http://c:4318", "sampleRatio": 1.5}}}, r"in 0.0..1.0, got 1.5"),
        ({"router": {"tracing": {"endpoint": "http://c:4318", "sampleRatio": -0.1}}}, "sampleRatio"),
        ({"router": {"tracing": {"endpoint": "http://c:4318", "sampleRatio": "0.5"}}}, "must be a number"),
        ({"router": {"tracing": {"endpoint": "http://c:4318", "sampleRatio": True}}}, "must be a number"),
        ({"router": {"tracing": {"endpoint": "http://c:4318", "sampleRatio": float("nan")}}}, "sampleRatio"),
        ({"router": {"tracing": {"sampleRatio": 2}}}, "sampleRatio"),  # no endpoint: refused too (the CRD)
    ],
)
def test_parse_refuses(spec, expect):
    with pytest.raises(SpecError, match=expect):
        Fleet.parse(fleet_obj(spec))


def test_tracing_is_off_without_an_endpoint_and_samples_everything_by_default():
    for off in ({}, {"tracing": None}, {"tracing": {}}, {"tracing": {"sampleRatio": 0.5}}):
        assert Fleet.parse(fleet_obj({"router": off})).spec.router.tracing is None, off
    on = Fleet.parse(fleet_obj({"router": {"tracing": {"endpoint": "https://otel.obs:4318"}}}))
    assert on.spec.router.tracing == Tracing("https://otel.obs:4318", 1.0) and validate(on) == []
    # The API server hands a whole number back as an int: the same float either way.
    whole = Fleet.parse(fleet_obj({"router": {"tracing": {"endpoint": "http://c:4318", "sampleRatio": 0}}}))
    assert type(whole.spec.router.tracing.sample_ratio) is float


@pytest.mark.parametrize(
    "endpoint",
    ["http://otel-collector.observability:4318", "https://otel.example.com", "http://10.0.0.7:4318/",
     "http://[fd00::1]:4318", "http://otel-collector:4318/v1/traces", "https://gw.example/otlp/v1/traces"],
)  # fmt: skip
def test_tracing_endpoints_accepted(endpoint):
    assert validate(Fleet.parse(fleet_obj({"router": {"tracing": {"endpoint": endpoint}}}))) == []
    assert tracing_endpoint(endpoint) == endpoint  # and the router takes it as it is rendered


@pytest.mark.parametrize(
    "endpoint",
    [
        "",
        "otel-collector:4318",  # no scheme
        "grpc://otel-collector:4318",
        "unix:///run/otel.sock",
        "http://otel-collector:4318/v1/traces#spans",
        "http://user:secret@otel-collector:4318",  # credentials in the pod's args
        "http://otel-collector:4318?x=1",
        "http://",
        "http://otel collector:4318",
        "http://otel-collector:4318\n",  # Python's $ allows a final newline, CEL's does not
        "http://otel-collector:99999",  # as the router refuses them (a crash-loop, not InvalidSpec)
        "http://otel-collector:abc",
        "http://:4318",
    ],
)
def test_tracing_endpoints_refused(endpoint):
    problems = validate(Fleet.parse(fleet_obj({"router": {"tracing": {"endpoint": endpoint}}})))
    assert any("spec.router.tracing.endpoint must be an http:// or https:// URL" in p for p in problems)


def _router_options() -> dict[str, argparse.Action]:
    return {s: a for a in build_parser()._actions for s in a.option_strings}


def test_owned_flags_exist_in_the_router():
    options = _router_options()
    for flag in OWNED_FLAGS:
        assert flag in options, f"{flag} is not a routerfleet-router flag"


def _argparse_resolves(parser: argparse.ArgumentParser, name: str) -> set[str]:
    """Which options argparse would take ``name`` for (exact, else every option it abbreviates)."""
    options = _router_options()
    if name in options:
        return {name}
    return {o for o in options if o.startswith("--") and o.startswith(name)}


def test_no_prefix_of_an_owned_flag_slips_through():
    """argparse expands a unique prefix of a long option ("--internal-tok" -> --internal-token-file):
    every item that would set an owned flag is refused, with or without "=value"."""
    parser = build_parser()
    options = _router_options()
    for option in options:
        if not option.startswith("--"):
            continue
        for i in range(2, len(option) + 1):
            name = option[:i]
            resolved = _argparse_resolves(parser, name)
            owned = {options[o].dest for o in resolved} & {options[f].dest for f in OWNED_FLAGS}
            if len(resolved) == 1 and owned:
                assert owned_flag_in(name) and owned_flag_in(f"{name}=x"), name
    # The flags extraArgs exists for stay allowed.
    allowed = [
        "--breaker-failures",
        "--connect-timeout-ms=5",
        "--tokenizer-threads",
        "--kv-queue-batches",
        "--seed=1",
    ]
    for a in [*allowed, "7", "value", "-x"]:
        assert not owned_flag_in(a), a
    for a in ["-h", "--", "--help", "--port=1", "--internal-tok", "--k8s-sel=x", "--no-kv"]:
        assert owned_flag_in(a), a
