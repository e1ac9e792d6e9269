"""An engine's storage identity from its pod's annotation (--k8s-storage-annotation): the pure reading
and key validation, the flag, the watcher reading each new pod UID once (found, absent, malformed,
forbidden, timeout) and merging the identity before it publishes, and KubeSlices.get_pod over a real
socket. No cluster; tests/e2e/test_discovery.py runs it against a real API server with RBAC."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

import pytest
from aiohttp import web

from router_runtime.config import parse_args
from router_runtime.discovery import kubernetes as kubernetes_discovery
from router_runtime.discovery.kubernetes import POD_METADATA_ACCEPT, KubeSlices
from router_runtime.discovery.storage_annotation import (
    Reading,
    Result,
    read_pod_storage,
    read_storage_annotation,
    validate_annotation_key,
)
from router_runtime.kv.adoption import StorageIdentity
from router_runtime.worker import Role
from routerfleet_kube import ApiError
from tests.support import eventually
from tests.test_discovery_mapping import NS, FakeApi, Harness, ep, ev, sl, spec

KEY = "routerfleet.io/storage-id"
EPOCH = KEY + "-epoch"
MAX = 2**63 - 1

# ------------------------------------------------------------------------------------------ pure


@pytest.mark.parametrize(
    ("annotations", "want"),
    [
        ({KEY: "pv-a", EPOCH: "4"}, Reading(Result.FOUND, StorageIdentity("pv-a", 4))),
        ({KEY: "pv-a"}, Reading(Result.FOUND, StorageIdentity("pv-a", 0))),
        ({KEY: "pv-a", EPOCH: " 7\n"}, Reading(Result.FOUND, StorageIdentity("pv-a", 7))),
        (
            {KEY: "x" * 253, EPOCH: str(2**63 - 1)},
            Reading(Result.FOUND, StorageIdentity("x" * 253, 2**63 - 1)),
        ),
        (None, Reading(Result.ABSENT)),
        ({}, Reading(Result.ABSENT)),
        ({"other/storage-id": "pv-a", "storage-id": "pv-b"}, Reading(Result.ABSENT)),
    ],
)
def test_annotation_readings(annotations, want):
    assert read_storage_annotation(annotations, KEY) == want


@pytest.mark.parametrize(
    "annotations",
    [
        {EPOCH: "3"},  # an epoch without an id
        {KEY: ""},
        {KEY: "pv a"},
        {KEY: "pv-node3\n"},  # a trailing newline: not the id "pv-node3"
        {KEY: "pv-\u00e9"},
        {KEY: "x" * 254},
        {KEY: 5},
        {KEY: "pv-a", EPOCH: "x"},
        {KEY: "pv-a", EPOCH: "-1"},
        {KEY: "pv-a", EPOCH: "+1"},
        {KEY: "pv-a", EPOCH: "1.5"},
        {KEY: "pv-a", EPOCH: "1_000"},
        {KEY: "pv-a", EPOCH: ""},
        {KEY: "pv-a", EPOCH: str(2**63)},
        {KEY: "pv-a", EPOCH: 3},
    ],
)
def test_malformed_annotations_give_no_identity_and_say_why_without_the_value(annotations):
    r = read_storage_annotation(annotations, KEY)
    assert r.result is Result.MALFORMED and r.identity is None and r.why
    value = annotations.get(KEY)
    assert not (isinstance(value, str) and len(value) > 1 and value in r.why)


def test_a_pod_of_another_uid_says_nothing_about_ours():
    pod = {"kind": "PartialObjectMetadata", "metadata": {"uid": "u1", "annotations": {KEY: "pv-a"}}}
    assert read_pod_storage(pod, KEY, "u1") == Reading(Result.FOUND, StorageIdentity("pv-a", 0))
    assert read_pod_storage(pod, KEY, "u2").result is Result.ERROR
    assert read_pod_storage({"metadata": {"uid": "u1"}}, KEY, "u1").result is Result.ABSENT
    assert read_pod_storage({}, KEY, "u1").result is Result.ERROR


@pytest.mark.parametrize(
    "key",
    ["routerfleet.io/storage-id", "storage-id", "s", "Example.COM/Storage_ID.v1", "a.b-c.d/" + "n" * 57],
)
def test_valid_annotation_keys(key):
    assert validate_annotation_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        "",
        "/storage-id",
        "routerfleet.io/",
        "a/b/c",
        "-storage",
        "storage-",
        "storage id",
        "storage-id\n",
        "under_score.io/x",
        "-bad.io/x",
        "a..b/x",
        "n" * 58,  # n-epoch would exceed 63
        "p" * 254 + "/x",
    ],
)
def test_invalid_annotation_keys(key):
    with pytest.raises(ValueError, match="'"):
        validate_annotation_key(key)


# ------------------------------------------------------------------------------------------ the flag


def test_the_flag_maps_onto_the_config():
    assert parse_args(["--k8s-selector", "app=e"]).discovery.storage_annotation == ""
    c = parse_args(["--k8s-selector", "app=e", "--k8s-storage-annotation", KEY])
    assert c.discovery.storage_annotation == KEY
    assert (
        parse_args(["--k8s-selector", "app=e", "--k8s-storage-annotation", ""]).discovery.storage_annotation
        == ""
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--k8s-selector", "app=e", "--k8s-storage-annotation", "a/b/c"],
        ["--k8s-selector", "app=e", "--k8s-storage-annotation", "bad key"],
        ["--k8s-storage-annotation", KEY],  # nothing to read it from: refused, not ignored
    ],
)
def test_bad_flag_fails_with_one_line_naming_it(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("routerfleet-router: error: argument --k8s-storage-annotation"), err[-1]


async def test_the_router_passes_the_key_to_its_engine_watcher_only():
    from router_runtime.app import Router

    router = Router(
        parse_args(["--k8s-selector", "app=e", "--k8s-namespace", NS, "--k8s-storage-annotation", KEY])
    )
    try:
        assert router.engine_watcher is not None and router.engine_watcher.storage_annotation == KEY
        assert router.peer_watcher is None
    finally:
        await router.stop()


# ------------------------------------------------------------------------------------------ the watcher


class PodApi(FakeApi):
    """FakeApi plus pods: ``pods[name]`` is the pod dict, an exception to raise, or "hang"."""

    def __init__(self, items=(), pods=None):
        super().__init__(items)
        self.pods: dict = dict(pods or {})
        self.gets: list[str] = []

    async def get_pod(self, namespace, name, *, timeout_s):
        assert namespace == NS and timeout_s > 0
        self.gets.append(name)
        pod = self.pods.get(name)
        if pod is None:
            raise ApiError(404, f'pods "{name}" not found')
        if pod == "hang":
            await asyncio.sleep(3600)
        if isinstance(pod, Exception):
            raise pod
        return pod


def pod(name, annotations=None, uid=None):
    meta = {"name": name, "namespace": NS, "uid": uid or f"uid-{name}"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": meta}


def with_storage(s, sid, epoch):
    return replace(s, storage_id=sid, storage_epoch=epoch)


def results(h):
    return {
        r.value: h.metric("routerfleet_discovery_storage_annotation_total", result=r.value) for r in Result
    }


async def test_identity_is_merged_before_publication_and_each_uid_read_once():
    api = PodApi(
        [sl("s1", ep("a", "10.0.0.1"), ep("b", "10.0.0.2"), ep("c", "10.0.0.3"), rv="11")],
        {
            "a": pod("a", {KEY: "pv-a", EPOCH: "3"}),
            "b": pod("b", {"unrelated": "x"}),
            "c": pod("c", {KEY: "pv-c", EPOCH: "three"}),
        },
    )
    async with Harness(api, storage_annotation=KEY) as h:
        await eventually(lambda: api.watching, what="watch")
        a, b, c = spec("a", "10.0.0.1"), spec("b", "10.0.0.2"), spec("c", "10.0.0.3")
        assert h.calls == [[with_storage(a, "pv-a", 3), b, c]]  # the first publication has it
        assert sorted(api.gets) == ["a", "b", "c"]
        assert results(h) == {
            "found": 1, "absent": 1, "malformed": 1, "forbidden": 0, "timeout": 0, "error": 0
        }  # fmt: skip
        # slices change, pods do not: no new reads, identities stay
        await api.events.put(ev("ADDED", sl("s2", ep("d", "10.0.0.4"), rv="12")))
        await eventually(lambda: len(h.calls) == 2, what="d added")
        assert h.calls[-1][:3] == h.calls[0] and sorted(api.gets) == ["a", "b", "c", "d"]
        assert results(h)["error"] == 1  # d has no pod: 404
        # a replaced under its name (new UID): read again, with the new pod's annotation
        api.pods["a"] = pod("a", {KEY: "pv-a", EPOCH: "4"}, uid="u-a2")
        await api.events.put(
            ev("MODIFIED", sl("s1", ep("a", "10.0.0.5", uid="u-a2"), ep("b", "10.0.0.2"), rv="13"))
        )
        await eventually(lambda: len(h.calls) == 3, what="a replaced")
        assert h.calls[-1][0] == with_storage(spec("a", "10.0.0.5", "u-a2"), "pv-a", 4)
        assert api.gets.count("a") == 2
        # what left every slice is forgotten (c left s1 above)
        assert set(h.w.pods.readings) == {"u-a2", "uid-b", "uid-d"}


async def test_forbidden_pods_still_publish_without_identity_and_log_once(caplog):
    forbidden = ApiError(403, 'pods "x" is forbidden: User "system:serviceaccount:llm:router" cannot get')
    api = PodApi(
        [sl("s1", *(ep(p, f"10.0.0.{i + 1}") for i, p in enumerate("abc")))],
        {p: forbidden for p in "abc"},
    )
    with caplog.at_level(logging.WARNING, logger=kubernetes_discovery.__name__):
        async with Harness(api, storage_annotation=KEY) as h:
            await eventually(lambda: h.calls, what="publish")
            assert h.calls == [[spec(p, f"10.0.0.{i + 1}") for i, p in enumerate("abc")]]
            assert results(h)["forbidden"] == 3
            assert h.w.synced and h.errors("forbidden") == 0  # discovery itself is fine
    lines = [r.getMessage() for r in caplog.records if "storage identity from annotation" in r.getMessage()]
    assert len(lines) == 1 and "forbidden" in lines[0] and "needs get on pods" in lines[0], lines


async def test_a_slow_pod_read_is_bounded_and_never_changes_the_spec_later():
    api = PodApi(
        [sl("s1", ep("a", "10.0.0.1"), ep("slow", "10.0.0.2"), rv="11")],
        {"a": pod("a", {KEY: "pv-a"}), "slow": "hang"},
    )
    async with Harness(api, storage_annotation=KEY, storage_timeout_s=0.1) as h:
        await eventually(lambda: api.watching, what="watch")
        assert h.calls == [[with_storage(spec("a", "10.0.0.1"), "pv-a", 0), spec("slow", "10.0.0.2")]]
        assert results(h)["timeout"] == 1 and results(h)["found"] == 1
        # the pod would answer now; its incarnation was decided: no re-read, no spec change
        api.pods["slow"] = pod("slow", {KEY: "pv-s"})
        await api.events.put(ev("ADDED", sl("s2", ep("b", "10.0.0.3"), rv="12")))
        await eventually(lambda: len(h.calls) == 2, what="b added")
        assert h.calls[-1][2] == spec("slow", "10.0.0.2") and api.gets.count("slow") == 1


async def test_stop_while_reading_pods_is_prompt():
    api = PodApi([sl("s1", ep("a", "10.0.0.1"))], {"a": "hang"})
    h = Harness(api, storage_annotation=KEY, storage_timeout_s=60)
    await h.w.start()
    await eventually(lambda: api.gets, what="pod read started")
    await asyncio.wait_for(h.w.stop(), 1)
    assert h.calls == []


async def test_without_the_flag_no_pod_is_read():
    api = PodApi([sl("s1", ep("a", "10.0.0.1"))], {"a": pod("a", {KEY: "pv-a"})})
    async with Harness(api) as h:
        await eventually(lambda: h.calls, what="publish")
        assert h.calls == [[spec("a", "10.0.0.1")]] and api.gets == [] and h.w.pods is None


def test_a_bad_key_fails_when_the_watcher_is_made():
    with pytest.raises(ValueError):
        Harness(FakeApi(), storage_annotation="a/b/c")


# ------------------------------------------------------------------------------------------ KubeSlices


async def test_get_pod_asks_for_metadata_only_with_the_credentials(tmp_path):
    seen: list = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Accept"), request.headers.get("Authorization")))
        name = request.match_info["name"]
        if name == "secret-pod":
            return web.json_response({"kind": "Status", "message": "pods is forbidden"}, status=403)
        return web.json_response(pod(name, {KEY: "pv-a"}))

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    kc = tmp_path / "kc"
    kc.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t0k"}}],
                "contexts": [{"name": "a", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "a",
            }
        )
    )
    api = await KubeSlices.connect(str(kc))
    try:
        body = await api.get_pod(NS, "a", timeout_s=2)
        assert body["metadata"]["annotations"] == {KEY: "pv-a"}
        assert seen == [(f"/api/v1/namespaces/{NS}/pods/a", POD_METADATA_ACCEPT, "Bearer t0k")]
        with pytest.raises(ApiError) as e:
            await api.get_pod(NS, "secret-pod", timeout_s=2)
        assert e.value.status == 403 and e.value.reason == "forbidden"
    finally:
        await api.close()
        await runner.cleanup()


async def test_a_disaggregated_fleet_reads_each_engines_revision_from_its_pods_label():
    label = "app.kubernetes.io/version"
    labelled = pod("a")
    labelled["metadata"]["labels"] = {label: "v7", "pod-template-hash": "abc"}
    replaced = pod("b", uid="uid-old")  # another incarnation under b's name: its labels are not b's
    replaced["metadata"]["labels"] = {label: "v6"}
    api = PodApi(
        [sl("s1", ep("a", "10.0.0.1"), ep("b", "10.0.0.2"), rv="11")], {"a": labelled, "b": replaced}
    )
    async with Harness(api, revision_label=label) as h:
        await eventually(lambda: api.watching, what="watch")
        a, b = spec("a", "10.0.0.1"), spec("b", "10.0.0.2")
        # b's own pod could not be read: its revision is unknown, which pairs with nothing
        assert h.calls == [[replace(a, revision="v7"), replace(b, revision="unread:uid-b")]]
        assert results(h)["found"] == 0  # no storage annotation asked for: none counted


async def test_a_role_labelled_fleet_reads_each_engines_role_and_revision_from_its_pod(caplog, monkeypatch):
    """One Service, its engines split by a pod label (llm-d's): a pod without it is a whole engine,
    never paired; one whose label names no role the router serves, or that could not be read, is not
    routed at all (it may be a prefill or an encode engine, which must never get a client's request);
    the unread one is read again, without waiting for a slice to change (none may for hours)."""
    monkeypatch.setattr(kubernetes_discovery, "UNREAD_RETRY_S", 0.05)
    role, version = "llm-d.ai/role", "app.kubernetes.io/version"
    pods = {name: pod(name) for name in "abce"}
    for name, labels in (
        ("a", {role: "prefill", version: "v7"}),
        ("b", {role: "decode", version: "v7"}),
        ("c", {role: "encode", version: "v7"}),
        ("e", {version: "v7"}),
    ):
        pods[name]["metadata"]["labels"] = labels
    endpoints = [ep(n, f"10.0.0.{i}") for i, n in enumerate("abcde", 1)]
    api = PodApi([sl("s1", *endpoints, rv="11")], pods)  # d's pod cannot be read
    with caplog.at_level(logging.WARNING, logger=kubernetes_discovery.__name__):
        async with Harness(api, revision_label=version, role_label=role) as h:
            await eventually(lambda: api.watching, what="watch")
            a, b, _c, d, e = (spec(n, f"10.0.0.{i}") for i, n in enumerate("abcde", 1))
            read = [
                replace(a, revision="v7", role=Role.PREFILL),
                replace(b, revision="v7", role=Role.DECODE),
                replace(e, revision="v7", role=Role.BOTH),
            ]
            assert h.calls == [read]
            api.pods["d"] = pod("d")
            api.pods["d"]["metadata"]["labels"] = {role: "prefill", version: "v7"}
            await eventually(lambda: len(h.calls) == 2, what="read again, and published")
            d = replace(d, revision="v7", role=Role.PREFILL)
            assert sorted(h.calls[-1], key=lambda w: w.engine) == [*read[:2], d, read[2]]
    lines = [r.getMessage() for r in caplog.records if "not routed" in r.getMessage()]
    assert len(lines) == 2, lines  # once each, however often published
    assert f"engine {NS}/c not routed" in lines[0] and "names no role" in lines[0], lines
    assert f"engine {NS}/d not routed" in lines[1] and "could not be read" in lines[1], lines


async def test_the_router_splits_one_services_engines_by_their_role_label():
    from router_runtime.app import Router

    router = Router(
        parse_args(["--k8s-selector", "app=e", "--k8s-role-label", "llm-d.ai/role", "--k8s-namespace", NS])
    )
    try:
        w = router.engine_watcher
        assert router.prefill_watcher is None and w is not None
        assert (w.role_label, w.revision_label) == ("llm-d.ai/role", "app.kubernetes.io/version")
        w.on_change(
            [
                replace(spec("a", "10.0.0.1"), role=Role.DECODE),
                replace(spec("b", "10.0.0.2"), role=Role.PREFILL),
            ]
        )
        assert router.targets.disaggregated
        assert {t.engine for t in router.targets.candidates()} == {f"{NS}/a"}
        assert {t.engine for t in router.targets.prefill_candidates()} == {f"{NS}/b"}
    finally:
        await router.stop()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--k8s-selector", "a=b", "--k8s-prefill-selector", "a=p"], "not with --k8s-prefill-selector"),
        ([], "needs --k8s-selector or --k8s-inference-pool"),
    ],
)
def test_a_role_label_needs_pods_and_is_the_only_way_roles_are_named(flags, said, capsys):
    with pytest.raises(SystemExit):
        parse_args([*flags, "--k8s-role-label", "llm-d.ai/role"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("routerfleet-router: error: argument --k8s-role-label: " + said), last


async def test_the_router_watches_the_prefill_engines_beside_the_decode_engines():
    from router_runtime.app import Router

    router = Router(
        parse_args(["--k8s-selector", "app=d", "--k8s-prefill-selector", "app=p", "--k8s-namespace", NS])
    )
    try:
        d, p = router.engine_watcher, router.prefill_watcher
        assert d is not None and p is not None and (d.label_selector, p.label_selector) == ("app=d", "app=p")
        assert d.revision_label == p.revision_label == "app.kubernetes.io/version"
        d.on_change([spec("a", "10.0.0.1")])
        assert router.targets.candidates() == ()  # one role synced: nothing published yet
        p.on_change([spec("b", "10.0.0.2")])
        assert {t.engine for t in router.targets.candidates()} == {f"{NS}/a"}  # (per DP rank)
        assert {t.engine for t in router.targets.prefill_candidates()} == {f"{NS}/b"}
    finally:
        await router.stop()
