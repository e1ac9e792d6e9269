"""The project's Kubernetes client (routerfleet_kube) without a cluster: watch bodies split into
events, credentials and the default namespace from small kubeconfig files written under tmp_path, and
requests over a real socket to a small aiohttp server standing in for the API server's answers.
tests/e2e runs it against a real API server (discovery, the operator, the node agent)."""

from __future__ import annotations

import json
import ssl

import pytest
from aiohttp import web

from routerfleet_kube import (
    APPLY,
    STRATEGIC,
    ApiError,
    KubeClient,
    credentials,
    default_namespace,
    path,
    watch_events,
)
from routerfleet_kube import client as kube_client
from tests.test_discovery_mapping import ep, ev, sl


async def test_watch_events_split_lines_across_chunks():
    events = [ev("ADDED", sl(f"s{i}", ep("a", "10.0.0.1"))) for i in range(3)]
    body = b"".join(json.dumps(e).encode() + b"\n" for e in events) + b"\n"  # a blank line is skipped

    async def chunks(size):
        for i in range(0, len(body), size):
            yield body[i : i + size]

    for size in (1, 7, 100, len(body)):
        assert [e async for e in watch_events(chunks(size))] == events
    trailing = body.rstrip(b"\n")  # the last event without its newline

    async def one():
        yield trailing

    assert [e async for e in watch_events(one())] == events
    for bad in (b"not json\n", b'{"type": "ADDED"}\n', b'["x"]\n'):

        async def single(b=bad):
            yield b

        with pytest.raises(ApiError) as e:
            [x async for x in watch_events(single())]
        assert e.value.reason == "decode"


async def test_watch_event_size_is_bounded(monkeypatch):
    monkeypatch.setattr(kube_client, "MAX_EVENT_BYTES", 10)

    async def endless():
        yield b"x" * 11

    with pytest.raises(ApiError, match="longer than 10 bytes"):
        [x async for x in watch_events(endless())]


def test_default_namespace(monkeypatch, tmp_path):
    kc = tmp_path / "kubeconfig"  # a file we wrote: the only I/O, local
    kc.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "a", "context": {"cluster": "c", "user": "u", "namespace": "ns-a"}},
                    {"name": "b", "context": {"cluster": "c", "user": "u", "namespace": "ns-b"}},
                    {"name": "none", "context": {"cluster": "c", "user": "u"}},
                ],
                "current-context": "a",
            }
        )
    )
    monkeypatch.setattr(credentials, "SA_NAMESPACE_FILE", str(tmp_path / "absent"))
    monkeypatch.setenv("POD_NAMESPACE", "from-env")
    assert default_namespace(str(kc)) == "from-env"
    monkeypatch.delenv("POD_NAMESPACE")
    assert default_namespace(str(kc)) == "ns-a"
    assert default_namespace(str(kc), "b") == "ns-b"
    assert default_namespace(str(kc), "none") == "default"
    assert default_namespace(str(tmp_path / "missing")) == "default"
    (tmp_path / "sa-ns").write_text("from-sa\n")
    monkeypatch.setattr(credentials, "SA_NAMESPACE_FILE", str(tmp_path / "sa-ns"))
    assert default_namespace(str(kc)) == "from-sa"


def _kubeconfig(tmp_path, user: dict, cluster_extra: dict | None = None):
    kc = tmp_path / "kc"
    kc.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": "https://10.0.0.1:6443/", **(cluster_extra or {})}}
                ],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "a", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "a",
            }
        )
    )
    return str(kc)


async def test_kube_api_credentials_from_a_kubeconfig(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    kc = _kubeconfig(
        tmp_path, {"token": "s3cret"}, {"insecure-skip-tls-verify": True, "tls-server-name": "api"}
    )
    api = KubeClient.from_environment(kc, user_agent="test")
    assert api.host == "https://10.0.0.1:6443" and api.server_hostname == "api"
    assert await api.headers() == {"Authorization": "Bearer s3cret"}
    assert (
        api.host + path("EndpointSlice", "llm")
        == "https://10.0.0.1:6443/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
    )
    assert (
        api.host + path("EndpointSlice", None)
        == "https://10.0.0.1:6443/apis/discovery.k8s.io/v1/endpointslices"
    )
    assert api.ssl.verify_mode == ssl.CERT_NONE
    await api.close()
    monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, {"username": "a", "password": "b"}))
    api = KubeClient.from_environment(user_agent="test")
    assert (await api.headers())["Authorization"].startswith("Basic ")


async def test_objects_by_kind_over_a_socket(tmp_path):
    """What each write says (server-side apply under the field manager, taking over conflicts; a patch
    with its content type), what a missing object reads as, and a failure as one ApiError naming the
    request and the API's message."""
    seen: list[tuple[str, str, str | None, dict]] = []
    objects = {"/api/v1/namespaces/ns/secrets/s": {"kind": "Secret", "metadata": {"name": "s"}}}

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, request.path, request.content_type, dict(request.query)))
        if request.method == "DELETE":
            return web.json_response({"kind": "Status", "message": "uid precondition failed"}, status=409)
        if request.method == "GET" and request.path not in objects:
            return web.json_response({"kind": "Status", "message": f"{request.path} not found"}, status=404)
        if request.method == "POST":
            return web.json_response({"kind": "Status", "message": "events is forbidden"}, status=403)
        return web.json_response(objects.get(request.path) or await request.json())

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    kc = _kubeconfig(tmp_path, {"token": "t"}, {"server": f"http://127.0.0.1:{runner.addresses[0][1]}"})
    kube = await KubeClient.connect(kc, user_agent="test", field_manager="fm")
    try:
        assert (await kube.get("Secret", "ns", "s"))["metadata"]["name"] == "s"
        assert await kube.get("Secret", "ns", "absent") is None
        manifest = {"kind": "Service", "metadata": {"name": "svc", "namespace": "ns"}}
        assert await kube.apply(manifest) == manifest
        await kube.patch("Pod", "ns", "p", {"status": {}}, ctype=STRATEGIC, sub="status")
        assert await kube.delete("Pod", "ns", "p", uid="u-1") is False  # replaced: not ours to delete
        with pytest.raises(ApiError) as e:
            await kube.create({"kind": "Event", "metadata": {"name": "e", "namespace": "ns"}})
        assert e.value.status == 403 and e.value.reason == "forbidden"
        assert "POST /api/v1/namespaces/ns/events" in str(e.value) and "events is forbidden" in str(e.value)
    finally:
        await kube.close()
        await runner.cleanup()
    assert seen[2:4] == [
        ("PATCH", "/api/v1/namespaces/ns/services/svc", APPLY, {"fieldManager": "fm", "force": "true"}),
        ("PATCH", "/api/v1/namespaces/ns/pods/p/status", STRATEGIC, {"fieldManager": "fm"}),
    ]
