"""The Kubernetes API-server double, driven through the real client (``KubeClient`` on
kubernetes_asyncio) and, where the client has no call for it, raw HTTP.

These pin the server behaviour remediation depends on: optimistic concurrency, how strategic
merge treats taints, annotations and conditions, subresource separation, watch and 410 semantics,
leases, events, authentication and faults, plus config loading of the client.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.errors import ConfigError
from aggregator.kube.client import KubeClient, _error
from aggregator.kube.objects import (
    Condition,
    EventRecord,
    KubeConflict,
    KubeError,
    KubeForbidden,
    KubeGone,
    KubeNotFound,
    KubeUnavailable,
    Lease,
    NodeEvent,
    Taint,
    WatchBookmark,
)
from tests.kube_double import JSON_PATCH, MERGE, STRATEGIC, KubeApiDouble

OURS = "gpuwarden.io/quarantine"


@pytest.fixture
async def kube() -> AsyncIterator[KubeApiDouble]:
    async with KubeApiDouble() as api:
        yield api


@pytest.fixture
async def client(kube: KubeApiDouble, tmp_path: Path) -> AsyncIterator[KubeClient]:
    kube_client = await KubeClient.from_kubeconfig(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    yield kube_client
    await kube_client.close()


async def raw(
    kube: KubeApiDouble,
    method: str,
    path: str,
    body: Any = None,
    *,
    content_type: str = "application/json",
    token: str | None = "default",
) -> tuple[int, Any]:
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {kube.token if token == 'default' else token}"
    data = None if body is None else json.dumps(body)
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, kube.url + path, data=data, headers=headers) as response,
    ):
        return response.status, await response.json(content_type=None)


def taint_keys(node: dict[str, Any]) -> list[str]:
    return [t["key"] for t in node.get("spec", {}).get("taints", [])]


# -- nodes: patches -------------------------------------------------------------------------------


async def test_stale_resource_version_is_a_conflict_and_changes_nothing(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-1")
    read = await client.get_node("gpu-1")
    kube.update_node("gpu-1", lambda n: n["metadata"].setdefault("labels", {}).update(drained="yes"))
    before = kube.node("gpu-1")

    with pytest.raises(KubeConflict) as caught:
        await client.patch_node(
            "gpu-1", resource_version=read.resource_version, taints=[Taint(OURS, "NoSchedule")]
        )

    assert caught.value.status == 409
    assert "gpu-1" in str(caught.value)
    assert kube.node("gpu-1") == before


async def test_strategic_merge_replaces_taints_whole_and_keeps_other_metadata(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node(
        "gpu-1",
        labels={"pool": "a100"},
        annotations={"other.io/note": "keep"},
        taints=[{"key": "other.io/maintenance", "effect": "NoSchedule"}],
    )
    node = await client.get_node("gpu-1")
    patched = await client.patch_node(
        "gpu-1",
        resource_version=node.resource_version,
        taints=[*node.taints, Taint(OURS, "NoExecute", value="xid-79")],
        annotations={"gpuwarden.io/reason": "xid 79"},
    )
    assert [t.key for t in patched.taints] == ["other.io/maintenance", OURS]
    assert patched.taints[1].value == "xid-79"
    assert patched.labels == {"pool": "a100"}
    assert patched.annotations == {"other.io/note": "keep", "gpuwarden.io/reason": "xid 79"}
    assert kube.writes() == [("PATCH", "/api/v1/nodes/gpu-1", STRATEGIC)]

    # The list has no merge key: what we send is the whole list, so leaving a taint out removes it.
    only_ours = await client.patch_node(
        "gpu-1", resource_version=patched.resource_version, taints=[Taint(OURS, "NoExecute", value="xid-79")]
    )
    assert [t.key for t in only_ours.taints] == [OURS]

    # null deletes our annotation only.
    cleared = await client.patch_node(
        "gpu-1",
        resource_version=only_ours.resource_version,
        taints=[],
        annotations={"gpuwarden.io/reason": None},
    )
    assert cleared.annotations == {"other.io/note": "keep"}
    assert cleared.taints == ()
    assert "taints" not in kube.node("gpu-1")["spec"]


async def test_a_patch_that_changes_nothing_keeps_the_resource_version(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-1", annotations={"gpuwarden.io/reason": "x"})
    node = await client.get_node("gpu-1")
    same = await client.patch_node(
        "gpu-1", resource_version=node.resource_version, annotations={"gpuwarden.io/reason": "x"}
    )
    assert same.resource_version == node.resource_version


async def test_duplicate_taints_are_invalid(kube: KubeApiDouble, client: KubeClient) -> None:
    kube.add_node("gpu-1")
    node = await client.get_node("gpu-1")
    with pytest.raises(KubeError) as caught:
        await client.patch_node(
            "gpu-1", resource_version=node.resource_version, taints=[Taint(OURS, "NoSchedule")] * 2
        )
    assert caught.value.status == 422
    assert not isinstance(caught.value, KubeConflict)


async def test_condition_merges_by_type_and_keeps_the_kubelets_ready(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-1")
    first = Condition("GpuwardenHealthy", "False", "XidError", "xid 79 on GPU 3", "2025-01-01T00:00:00Z")
    await client.patch_node_condition("gpu-1", first)
    node = await client.patch_node_condition(
        "gpu-1", Condition("GpuwardenHealthy", "True", "Recovered", "ok", "2025-01-01T01:00:00Z")
    )

    by_type = {c.type: c for c in node.conditions}
    assert [c.type for c in node.conditions] == ["Ready", "GpuwardenHealthy"]
    assert by_type["Ready"].status == "True"
    assert by_type["Ready"].reason == "KubeletReady"
    assert by_type["GpuwardenHealthy"].status == "True"
    assert by_type["GpuwardenHealthy"].last_transition_time == "2025-01-01T01:00:00Z"
    assert kube.writes()[-1] == ("PATCH", "/api/v1/nodes/gpu-1/status", STRATEGIC)


async def test_status_subresource_changes_only_status_and_main_resource_never_status(
    kube: KubeApiDouble,
) -> None:
    kube.add_node("gpu-1", taints=[{"key": "a", "effect": "NoSchedule"}])
    status_patch = {
        "spec": {"taints": [{"key": "sneaky", "effect": "NoExecute"}]},
        "status": {"conditions": [{"type": "GpuwardenHealthy", "status": "False"}]},
    }
    code, body = await raw(kube, "PATCH", "/api/v1/nodes/gpu-1/status", status_patch, content_type=STRATEGIC)
    assert code == 200
    assert taint_keys(body) == ["a"]
    assert [c["type"] for c in body["status"]["conditions"]] == ["Ready", "GpuwardenHealthy"]

    main_patch = {
        "metadata": {"labels": {"x": "1"}},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]},
    }
    code, body = await raw(kube, "PATCH", "/api/v1/nodes/gpu-1", main_patch, content_type=STRATEGIC)
    assert code == 200
    assert body["metadata"]["labels"] == {"x": "1"}
    ready = next(c for c in kube.node("gpu-1")["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"


async def test_json_patch_failed_test_is_422_and_the_client_reads_it_as_conflict(kube: KubeApiDouble) -> None:
    kube.add_node("gpu-1")
    rv = kube.node("gpu-1")["metadata"]["resourceVersion"]
    stale: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
        {"op": "add", "path": "/spec/taints", "value": [{"key": OURS, "effect": "NoSchedule"}]},
    ]
    code, body = await raw(kube, "PATCH", "/api/v1/nodes/gpu-1", stale, content_type=JSON_PATCH)
    assert code == 422
    assert body["kind"] == "Status"
    assert body["reason"] == "Invalid"
    assert "test failed" in body["message"]
    assert taint_keys(kube.node("gpu-1")) == []
    mapped = _error("patch node 'gpu-1'", code, json.dumps(body).encode())
    assert isinstance(mapped, KubeConflict)

    fresh = [{**stale[0], "value": rv}, stale[1]]
    code, body = await raw(kube, "PATCH", "/api/v1/nodes/gpu-1", fresh, content_type=JSON_PATCH)
    assert code == 200
    assert taint_keys(body) == [OURS]


async def test_merge_patch_replaces_lists_and_null_deletes(kube: KubeApiDouble) -> None:
    kube.add_node("gpu-1", annotations={"a": "1", "b": "2"}, taints=[{"key": "t1", "effect": "NoSchedule"}])
    patch = {
        "metadata": {"annotations": {"a": None}},
        "spec": {"taints": [{"key": "t2", "effect": "NoSchedule"}]},
    }
    code, body = await raw(kube, "PATCH", "/api/v1/nodes/gpu-1", patch, content_type=MERGE)
    assert code == 200
    assert body["metadata"]["annotations"] == {"b": "2"}
    assert taint_keys(body) == ["t2"]

    stale = {"metadata": {"resourceVersion": "1"}, "spec": {"unschedulable": True}}
    code, body = await raw(kube, "PATCH", "/api/v1/nodes/gpu-1", stale, content_type=MERGE)
    assert (code, body["reason"]) == (409, "Conflict")


async def test_unknown_node_is_not_found(client: KubeClient) -> None:
    with pytest.raises(KubeNotFound) as caught:
        await client.get_node("nope")
    assert caught.value.status == 404


# -- list and watch -------------------------------------------------------------------------------


async def test_list_with_label_selectors(kube: KubeApiDouble, client: KubeClient) -> None:
    kube.add_node("a1", labels={"pool": "a", "gpu": "h100"})
    kube.add_node("b1", labels={"pool": "b"})
    kube.add_node("c1", labels={"pool": "c", "gpu": "a100"})

    async def names(selector: str | None) -> list[str]:
        return [n.name for n in (await client.list_nodes(label_selector=selector)).items]

    assert await names(None) == ["a1", "b1", "c1"]
    assert await names("pool=a") == ["a1"]
    assert await names("pool!=a") == ["b1", "c1"]
    assert await names("gpu") == ["a1", "c1"]
    assert await names("!gpu") == ["b1"]
    assert await names("pool in (a,b),gpu") == ["a1"]
    assert await names("pool notin (a)") == ["b1", "c1"]
    listed = await client.list_nodes()
    assert listed.resource_version == kube.node("c1")["metadata"]["resourceVersion"]
    with pytest.raises(KubeError) as caught:
        await client.list_nodes(label_selector="pool in (a")
    assert caught.value.status == 400


async def test_watch_delivers_changes_in_order_after_a_resource_version(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-0")
    start = (await client.list_nodes()).resource_version
    kube.add_node("gpu-1")
    kube.update_node("gpu-1", lambda n: n["metadata"].setdefault("labels", {}).update(step="1"))

    seen: list[NodeEvent] = []
    async with aclosing(client.watch_nodes(resource_version=start, timeout_seconds=10)) as events:
        async for event in events:
            seen.append(event)
            if len(seen) == 2:
                kube.delete_node("gpu-1")  # while the watch is open
            if len(seen) == 3:
                break

    assert [(e.type, e.node.name) for e in seen] == [
        ("ADDED", "gpu-1"),
        ("MODIFIED", "gpu-1"),
        ("DELETED", "gpu-1"),
    ]
    assert seen[1].node.labels == {"step": "1"}
    versions = [int(e.node.resource_version) for e in seen]
    assert versions == sorted(versions)
    assert versions[0] > int(start)


async def test_watch_with_selector_sees_objects_leave_and_enter(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-1", labels={"pool": "a"})
    start = (await client.list_nodes()).resource_version
    kube.update_node("gpu-1", lambda n: n["metadata"].setdefault("labels", {}).update(pool="b"))
    kube.add_node("gpu-2", labels={"pool": "b"})
    kube.update_node("gpu-1", lambda n: n["metadata"].setdefault("labels", {}).update(pool="a"))

    seen: list[tuple[str, str]] = []
    async with aclosing(
        client.watch_nodes(resource_version=start, timeout_seconds=10, label_selector="pool=a")
    ) as events:
        async for event in events:
            seen.append((event.type, event.node.name))
            if len(seen) == 2:
                break
    assert seen == [("DELETED", "gpu-1"), ("ADDED", "gpu-1")]


async def test_watch_ends_at_its_timeout_with_a_bookmark_of_where_it_got(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-1")
    start = (await client.list_nodes()).resource_version
    events = [e async for e in client.watch_nodes(resource_version=start, timeout_seconds=1)]
    assert events == [WatchBookmark(resource_version=start)]


async def a_lease(client: KubeClient, holder: str) -> None:
    """A write to an object other than a Node: it moves the server's resourceVersion on."""
    await client.create_lease(
        Lease(
            name=f"lease-{holder}",
            namespace="gpuwarden",
            resource_version="",
            holder=holder,
            lease_duration_seconds=15,
            acquire_time="2025-01-01T00:00:00.000000Z",
            renew_time="2025-01-01T00:00:00.000000Z",
        )
    )


async def test_a_bookmark_lets_a_quiet_watch_resume_after_a_compaction(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    # No Node changed, other objects did, the history was compacted: resuming from the LIST's
    # resourceVersion is 410 (a LIST of every Node again), from the bookmark's it is not.
    kube.add_node("gpu-1")
    start = (await client.list_nodes()).resource_version
    kube.bookmark_every(0.05)
    async with aclosing(client.watch_nodes(resource_version=start, timeout_seconds=10)) as events:
        await a_lease(client, "a")
        await a_lease(client, "b")
        while True:
            event = await anext(events)
            assert isinstance(event, WatchBookmark)  # no Node changed: bookmarks only
            if int(event.resource_version) > int(start):
                break
    kube.compact()
    with pytest.raises(KubeGone):
        async for _ in client.watch_nodes(resource_version=start, timeout_seconds=5):
            pass
    kube.update_node("gpu-1", _label("x", "1"))
    async with aclosing(client.watch_nodes(resource_version=event.resource_version, timeout_seconds=5)) as w:
        changed = await anext(w)
    assert isinstance(changed, NodeEvent) and changed.node.labels["x"] == "1"


async def test_a_bookmark_never_skips_a_change_not_yet_sent(kube: KubeApiDouble, client: KubeClient) -> None:
    kube.add_node("gpu-1")
    start = (await client.list_nodes()).resource_version
    kube.bookmark_every(0.01)
    seen: list[str] = []
    last_bookmark = int(start)
    async with aclosing(client.watch_nodes(resource_version=start, timeout_seconds=10)) as events:
        for i in range(20):
            kube.update_node("gpu-1", _label("x", str(i)))
            await a_lease(client, f"h{i}")
        async for event in events:
            if isinstance(event, WatchBookmark):
                last_bookmark = int(event.resource_version)
                continue
            # Every change after a bookmark is newer than the bookmark.
            assert int(event.node.resource_version) > last_bookmark
            seen.append(event.node.labels["x"])
            if len(seen) == 20:
                break
    assert seen == [str(i) for i in range(20)]


@asynccontextmanager
async def served(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]], tmp_path: Path
) -> AsyncIterator[KubeClient]:
    """The real client against one hand-written answer to every request: for answers the
    double never gives (malformed ones)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "x", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "x", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "x", "user": "x"}}],
        "current-context": "x",
    }
    (tmp_path / "hand.kubeconfig").write_text(json.dumps(config))
    client = await KubeClient.from_kubeconfig(tmp_path / "hand.kubeconfig")
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_bookmark_without_a_resource_version_is_an_error(tmp_path: Path) -> None:
    async def bad_watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"type": "BOOKMARK", "object": {"kind": "Node", "metadata": {}}}\n')
        await response.write_eof()
        return response

    async with served(bad_watch, tmp_path) as client:
        with pytest.raises(KubeError, match="BOOKMARK without a resourceVersion"):
            async for _ in client.watch_nodes(resource_version="5", timeout_seconds=5):
                pass


async def test_compacted_resource_version_is_gone(kube: KubeApiDouble, client: KubeClient) -> None:
    kube.add_node("gpu-1")
    old = (await client.list_nodes()).resource_version
    kube.update_node("gpu-1", lambda n: n["metadata"].setdefault("labels", {}).update(x="1"))
    kube.compact()

    with pytest.raises(KubeGone) as caught:
        async for _ in client.watch_nodes(resource_version=old, timeout_seconds=5):
            pass
    assert caught.value.status == 410
    assert "too old resource version" in str(caught.value)

    # Listing again gives a version the watch accepts.
    fresh = (await client.list_nodes()).resource_version
    kube.update_node("gpu-1", lambda n: n["metadata"].setdefault("labels", {}).update(x="2"))
    async with aclosing(client.watch_nodes(resource_version=fresh, timeout_seconds=5)) as events:
        event = await anext(events)
    assert (event.type, event.node.labels["x"]) == ("MODIFIED", "2")


# -- a busy control plane: latency, 429s, watch restarts -------------------------------------------


def _label(key: str, value: str) -> Any:
    return lambda n: n["metadata"].setdefault("labels", {}).update({key: value})


async def _timed(call: Any) -> tuple[float, Any]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await call
    return loop.time() - started, result


async def test_a_slow_list_answers_late_with_the_cluster_as_of_its_start(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-1")
    kube.set_latency("list", 0.6, path_regex=r"^/api/v1/nodes$")
    listing = asyncio.create_task(_timed(client.list_nodes()))
    await asyncio.sleep(0.2)
    kube.add_node("gpu-2")  # while the LIST is on its way
    elapsed, listed = await listing
    assert elapsed >= 0.6
    assert [n.name for n in listed.items] == ["gpu-1"]
    # Its resourceVersion is the start's: a watch from it sees what changed meanwhile.
    async with aclosing(client.watch_nodes(resource_version=listed.resource_version, timeout_seconds=5)) as w:
        event = await anext(w)
    assert (event.type, event.node.name) == ("ADDED", "gpu-2")
    # Only LISTs are slow: a GET is answered at once.
    elapsed, _ = await _timed(client.get_node("gpu-1"))
    assert elapsed < 0.5


async def test_latency_is_per_verb_and_a_range_is_drawn_from(kube: KubeApiDouble, client: KubeClient) -> None:
    kube.add_node("gpu-1")
    kube.set_latency("get", (0.05, 0.3))
    kube.set_latency("watch", 0.4)
    times = [(await _timed(client.get_node("gpu-1")))[0] for _ in range(6)]
    assert all(0.05 <= t < 0.6 for t in times)
    assert max(times) - min(times) > 0.02  # drawn, not fixed
    elapsed, listed = await _timed(client.list_nodes())
    assert elapsed < 0.3
    kube.update_node("gpu-1", _label("x", "1"))
    async with aclosing(client.watch_nodes(resource_version=listed.resource_version, timeout_seconds=5)) as w:
        elapsed, event = await _timed(anext(w))
    assert elapsed >= 0.4 and event.type == "MODIFIED"
    kube.set_latency("get", 0)
    assert (await _timed(client.get_node("gpu-1")))[0] < 0.3


async def test_a_list_slower_than_the_request_timeout_still_succeeds(
    kube: KubeApiDouble, tmp_path: Path
) -> None:
    # A cluster-wide LIST may take 30 s on a busy control plane: a client that gives it only the
    # request timeout never lists, and an informer that needs the list never syncs.
    kube.add_node("gpu-1")
    quick = await KubeClient.from_kubeconfig(
        kube.write_kubeconfig(tmp_path / "kubeconfig"), request_timeout=0.3
    )
    try:
        kube.set_latency("list", 0.9)
        assert [n.name for n in (await quick.list_nodes()).items] == ["gpu-1"]
        kube.set_latency("get", 0.9)
        with pytest.raises(KubeUnavailable):
            await quick.get_node("gpu-1")
    finally:
        await quick.close()


async def test_throttle_burst_is_429_with_retry_after_as_priority_and_fairness(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-1")
    kube.throttle(burst=2, retry_after=3)
    headers = {"Authorization": f"Bearer {kube.token}"}
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.get(kube.url + "/api/v1/nodes", headers=headers) as response:
                assert response.status == 429
                assert response.headers["Retry-After"] == "3"
                body = await response.json()
            assert body["reason"] == "TooManyRequests"
            assert body["details"] == {"retryAfterSeconds": 3}
            assert body["message"] == "Too many requests, please try again later."
        async with session.get(kube.url + "/api/v1/nodes", headers=headers) as response:
            assert response.status == 200
    kube.throttle(burst=1)
    with pytest.raises(KubeUnavailable) as caught:
        await client.patch_node("gpu-1", resource_version="1", annotations={"a": "b"})
    assert caught.value.status == 429
    assert "a" not in kube.node("gpu-1")["metadata"].get("annotations", {})  # shed before any work
    assert kube.throttled == 3
    assert caught.value.retry_after == 1.0  # the wait the server asked for travels with the error


@pytest.mark.parametrize(
    ("headers", "details", "wanted"),
    [
        ({"Retry-After": "3"}, {}, 3.0),
        ({}, {"retryAfterSeconds": 2}, 2.0),  # the Status alone says it
        ({"Retry-After": "3"}, {"retryAfterSeconds": 9}, 3.0),  # the header first
        ({"Retry-After": "3600"}, {}, 30.0),  # capped: a proxy's hour must not park a quarantine
        ({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, {}, None),  # a date: not what APF sends
        ({"Retry-After": "-1"}, {}, None),
        ({}, {}, None),
    ],
)
async def test_retry_after_is_read_from_the_header_or_the_status(
    tmp_path: Path, headers: dict[str, str], details: dict[str, Any], wanted: float | None
) -> None:
    async def shed(request: web.Request) -> web.StreamResponse:
        body = {"kind": "Status", "status": "Failure", "reason": "TooManyRequests", "code": 429}
        if details:
            body["details"] = details
        return web.json_response(body, status=429, headers=headers)

    async with served(shed, tmp_path) as client:
        for call in (client.get_node("gpu-1"), client.list_nodes()):
            with pytest.raises(KubeUnavailable) as caught:
                await call
            assert caught.value.status == 429
            assert caught.value.retry_after == wanted
            assert caught.value.wait_s(1.0) == max(1.0, wanted or 0.0)
        with pytest.raises(KubeUnavailable) as caught:
            async for _ in client.watch_nodes(resource_version="5", timeout_seconds=5):
                pass
        assert caught.value.retry_after == wanted


async def test_throttle_sheds_a_seeded_share_of_its_verbs_only(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-1")
    kube.throttle(share=0.5, verbs=["list"])
    shed = 0
    for _ in range(40):
        try:
            await client.list_nodes()
        except KubeUnavailable as exc:
            assert exc.status == 429
            shed += 1
        assert (await client.get_node("gpu-1")).name == "gpu-1"  # GETs are never shed
    assert 8 <= shed <= 32
    assert kube.throttled == shed
    kube.throttle()
    await client.list_nodes()
    assert kube.throttled == shed


async def test_restarted_watches_end_and_resuming_from_before_the_restart_is_gone(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    kube.add_node("gpu-1")
    listed = await client.list_nodes()
    seen: list[NodeEvent] = []

    async def consume() -> None:
        async for event in client.watch_nodes(resource_version=listed.resource_version, timeout_seconds=30):
            seen.append(event)

    watching = asyncio.create_task(consume())
    kube.update_node("gpu-1", _label("x", "1"))
    while not seen:
        await asyncio.sleep(0.01)
    kube.update_node("gpu-1", _label("x", "2"))
    assert kube.restart_watches() == 1  # in the same turn: the stream ends before "2" is sent
    await asyncio.wait_for(watching, 2.0)  # the stream just ends: no error, no bookmark
    assert [e.node.labels["x"] for e in seen] == ["1"]
    last = seen[-1].node.resource_version
    with pytest.raises(KubeGone):
        async for _ in client.watch_nodes(resource_version=last, timeout_seconds=5):
            pass
    # What a reflector does next: list again, watch from there.
    relisted = await client.list_nodes()
    assert relisted.items[0].labels["x"] == "2"
    kube.update_node("gpu-1", _label("x", "3"))
    async with aclosing(
        client.watch_nodes(resource_version=relisted.resource_version, timeout_seconds=5)
    ) as w:
        event = await anext(w)
    assert event.node.labels["x"] == "3"


async def test_a_restart_without_expiry_lets_a_watch_resume(kube: KubeApiDouble, client: KubeClient) -> None:
    kube.add_node("gpu-1")
    rv = (await client.list_nodes()).resource_version
    watch = client.watch_nodes(resource_version=rv, timeout_seconds=30)
    ending = asyncio.create_task(anext(watch))
    await asyncio.sleep(0.2)
    assert kube.restart_watches(expire=False) == 1
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(ending, 2.0)
    kube.update_node("gpu-1", _label("x", "1"))
    async with aclosing(client.watch_nodes(resource_version=rv, timeout_seconds=5)) as w:
        event = await anext(w)
    assert event.node.labels["x"] == "1"


# -- leases and events ----------------------------------------------------------------------------


async def test_lease_create_conflict_and_replace(kube: KubeApiDouble, client: KubeClient) -> None:
    with pytest.raises(KubeNotFound):
        await client.get_lease("gpuwarden", "aggregator-leader")
    wanted = Lease(
        name="aggregator-leader",
        namespace="gpuwarden",
        resource_version="",
        holder="replica-a",
        lease_duration_seconds=15,
        acquire_time="2025-01-01T00:00:00.000000Z",
        renew_time="2025-01-01T00:00:00.000000Z",
    )
    created = await client.create_lease(wanted)
    assert created.resource_version
    assert created.holder == "replica-a"

    with pytest.raises(KubeConflict) as exists:
        await client.create_lease(wanted)
    assert exists.value.status == 409
    assert "already exists" in str(exists.value)

    from dataclasses import replace

    renewed = await client.replace_lease(replace(created, renew_time="2025-01-01T00:00:05.000000Z"))
    assert int(renewed.resource_version) > int(created.resource_version)
    with pytest.raises(KubeConflict):
        await client.replace_lease(replace(created, holder="replica-b", transitions=1))
    stored = kube.lease("gpuwarden", "aggregator-leader")
    assert stored is not None
    assert stored["spec"]["holderIdentity"] == "replica-a"
    assert stored["spec"]["renewTime"] == "2025-01-01T00:00:05.000000Z"
    assert await client.get_lease("gpuwarden", "aggregator-leader") == renewed


async def test_lease_put_without_resource_version_is_invalid(kube: KubeApiDouble) -> None:
    path = "/apis/coordination.k8s.io/v1/namespaces/gpuwarden/leases/l"
    lease = {"metadata": {"name": "l"}, "spec": {"holderIdentity": "a"}}
    assert (await raw(kube, "PUT", path, lease))[0] == 201  # leases may be created by PUT
    code, body = await raw(kube, "PUT", path, lease)
    assert (code, body["reason"]) == (422, "Invalid")


async def test_events_about_a_node_are_recorded(kube: KubeApiDouble, client: KubeClient) -> None:
    node = kube.add_node("gpu-1")
    record = EventRecord(
        node="gpu-1",
        node_uid=node["metadata"]["uid"],
        type="Warning",
        reason="GpuwardenQuarantined",
        message="xid 79 on GPU 3",
    )
    await client.create_event("default", record)

    assert len(kube.events) == 1
    event = kube.events[0]
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "gpu-1",
        "uid": node["metadata"]["uid"],
    }
    assert (event["type"], event["reason"], event["message"]) == (
        "Warning",
        "GpuwardenQuarantined",
        "xid 79 on GPU 3",
    )
    assert event["source"] == {"component": "gpuwarden-aggregator"}
    assert event["metadata"]["name"].startswith("gpu-1.")

    # The API server keeps Node events in "default": elsewhere is a 422, not something to retry.
    with pytest.raises(KubeError) as caught:
        await client.create_event("gpuwarden", record)
    assert caught.value.status == 422
    assert len(kube.events) == 1


# -- auth, faults, transport ----------------------------------------------------------------------


async def test_missing_or_wrong_token_is_forbidden(kube: KubeApiDouble, client: KubeClient) -> None:
    kube.add_node("gpu-1")
    code, body = await raw(kube, "GET", "/api/v1/nodes/gpu-1", token=None)
    assert (code, body["kind"], body["reason"]) == (401, "Status", "Unauthorized")
    kube.token = "rotated"
    with pytest.raises(KubeForbidden) as caught:
        await client.get_node("gpu-1")
    assert caught.value.status == 401


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (500, KubeUnavailable),
        (503, KubeUnavailable),
        (429, KubeUnavailable),
        (409, KubeConflict),
        (403, KubeForbidden),
    ],
)
async def test_injected_faults_map_to_errors_and_are_consumed(
    kube: KubeApiDouble, client: KubeClient, status: int, error: type[KubeError]
) -> None:
    kube.add_node("gpu-1")
    kube.fail_next("GET", r"^/api/v1/nodes/gpu-1$", status)
    with pytest.raises(error) as caught:
        await client.get_node("gpu-1")
    assert caught.value.status == status
    assert (await client.get_node("gpu-1")).name == "gpu-1"


async def test_no_server_is_unavailable(tmp_path: Path) -> None:
    async with KubeApiDouble() as gone:
        config = gone.write_kubeconfig(tmp_path / "kubeconfig")
    kube_client = await KubeClient.from_kubeconfig(config)
    try:
        with pytest.raises(KubeUnavailable) as caught:
            await kube_client.get_node("gpu-1")
        assert caught.value.status == 0
    finally:
        await kube_client.close()


# -- configuration --------------------------------------------------------------------------------


async def test_from_environment_uses_the_given_kubeconfig_then_KUBECONFIG(
    kube: KubeApiDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube.add_node("gpu-1")
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # an explicit file wins over in-cluster
    explicit = await KubeClient.from_environment(kubeconfig=config)
    try:
        assert (await explicit.get_node("gpu-1")).name == "gpu-1"
    finally:
        await explicit.close()

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{config}")
    from_env = await KubeClient.from_environment()
    try:
        assert [n.name for n in (await from_env.list_nodes()).items] == ["gpu-1"]
    finally:
        await from_env.close()


async def test_from_environment_with_nothing_configured_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="no Kubernetes configuration"):
        await KubeClient.from_environment()

    (tmp_path / "broken").write_text("clusters: [")
    with pytest.raises(ConfigError, match="broken"):
        await KubeClient.from_kubeconfig(tmp_path / "broken")


async def test_in_cluster_without_a_service_account_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ConfigError, match="in-cluster"):
        await KubeClient.from_environment(service_account_dir=tmp_path / "none")


async def test_in_cluster_uses_the_service_account_and_the_service_address(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    (tmp_path / "token").write_text("sa-token-0123456789")
    openssl = shutil.which("openssl")
    assert openssl is not None, "openssl not installed: scripts/setup installs it"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kube-ca"),
            *("-keyout", str(tmp_path / "ca.key"), "-out", str(tmp_path / "ca.crt")),
        ],
        check=True,
        capture_output=True,
    )
    client = await KubeClient.from_environment(service_account_dir=tmp_path)
    try:
        conf = client.configuration
        assert conf.host == "https://10.0.0.1:6443"
        assert conf.ssl_ca_cert == str(tmp_path / "ca.crt")
        assert conf.api_key == {"BearerToken": "Bearer sa-token-0123456789"}
    finally:
        await client.close()


# -- TokenReview ----------------------------------------------------------------------------------


async def test_token_review_of_a_pod_bound_token_names_the_account_the_pod_and_its_node(
    kube: KubeApiDouble, client: KubeClient
) -> None:
    token = kube.issue_token("gpuwarden", "agent", audiences=["gpuwarden"], pod="agent-x7k2p", node="gpu-1")
    status = await client.create_token_review(token, ["gpuwarden", "other"])
    assert status.authenticated and status.error == ""
    assert status.audiences == ("gpuwarden",)  # what the token and the review have in common
    assert status.user is not None
    assert status.user.username == "system:serviceaccount:gpuwarden:agent"
    assert status.user.groups == (
        "system:serviceaccounts",
        "system:serviceaccounts:gpuwarden",
        "system:authenticated",
    )
    extra = status.user.extra
    assert (
        extra["authentication.kubernetes.io/pod-name"],
        extra["authentication.kubernetes.io/node-name"],
    ) == (
        ("agent-x7k2p",),
        ("gpu-1",),
    )
    assert extra["authentication.kubernetes.io/credential-id"][0].startswith("JTI=")
    # The same account's next token has the same uid; an unbound token has no pod or node.
    unbound = await client.create_token_review(
        kube.issue_token("gpuwarden", "agent", audiences=["gpuwarden"]), ["gpuwarden"]
    )
    assert unbound.user is not None and unbound.user.uid == status.user.uid
    assert set(unbound.user.extra) == {"authentication.kubernetes.io/credential-id"}


async def test_token_review_refusals_are_answers_not_errors(kube: KubeApiDouble, client: KubeClient) -> None:
    token = kube.issue_token("gpuwarden", "agent", audiences=["gpuwarden"], pod="agent-x7k2p", node="gpu-1")
    wrong = await client.create_token_review(token, ["vault"])
    assert (wrong.authenticated, wrong.user, wrong.audiences) == (False, None, None)
    assert 'token audiences ["gpuwarden"] is invalid for the target audiences ["vault"]' in wrong.error
    # No audiences asked: the API server's own, which this token is not for.
    assert not (await client.create_token_review(token, [])).authenticated
    kube.revoke_token(token)  # its pod is gone
    gone = await client.create_token_review(token, ["gpuwarden"])
    assert (gone.authenticated, gone.error) == (False, "invalid bearer token")
    with pytest.raises(KubeError, match="token is required") as err:
        await client.create_token_review("", ["gpuwarden"])
    assert err.value.status == 400
    status, body = await raw(
        kube,
        "POST",
        "/apis/authentication.k8s.io/v1/tokenreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": "forged"}},
    )
    assert status == 201 and body["status"] == {"user": {}, "error": "invalid bearer token"}
    kube.fail_next("POST", "tokenreviews", 403)
    with pytest.raises(KubeForbidden):
        await client.create_token_review(token, ["gpuwarden"])


# -- concurrent writers ---------------------------------------------------------------------------


async def test_concurrent_read_modify_write_loses_no_taint(kube: KubeApiDouble, client: KubeClient) -> None:
    """Two writers add taints with read-modify-write and retry on conflict while a third controller
    writes directly; both writers are forced to read the same version before anyone writes."""
    kube.add_node("gpu-1", labels={"pool": "a"}, taints=[{"key": "preexisting", "effect": "NoSchedule"}])
    read_done = {"a": asyncio.Event(), "b": asyncio.Event()}
    go = asyncio.Event()
    conflicts = {"a": 0, "b": 0}

    async def add_taints(writer: str) -> None:
        for i in range(4):
            key = f"{writer}/{i}"
            for _attempt in range(50):
                node = await client.get_node("gpu-1")
                if i == 0 and not go.is_set():
                    read_done[writer].set()
                    await go.wait()
                try:
                    await client.patch_node(
                        "gpu-1",
                        resource_version=node.resource_version,
                        taints=[*node.taints, Taint(key, "NoSchedule")],
                    )
                    break
                except KubeConflict:
                    conflicts[writer] += 1
            else:
                pytest.fail(f"writer {writer} never got {key} in")

    writers = [asyncio.create_task(add_taints("a")), asyncio.create_task(add_taints("b"))]
    await asyncio.gather(*(e.wait() for e in read_done.values()))
    kube.update_node(
        "gpu-1", lambda n: n["spec"]["taints"].append({"key": "other-controller", "effect": "NoExecute"})
    )
    go.set()
    await asyncio.gather(*writers)

    final = kube.node("gpu-1")
    assert sorted(taint_keys(final)) == sorted(
        ["preexisting", "other-controller", *(f"{w}/{i}" for w in "ab" for i in range(4))]
    )
    assert final["metadata"]["labels"] == {"pool": "a"}
    # Both first writes were made against the version from before the other controller's write.
    assert conflicts["a"] >= 1
    assert conflicts["b"] >= 1


# -- paginated lists ----------------------------------------------------------------------------


@asynccontextmanager
async def paging_client(kube: KubeApiDouble, tmp_path: Path, page: int) -> AsyncIterator[KubeClient]:
    c = await KubeClient.from_kubeconfig(
        kube.write_kubeconfig(tmp_path / "paging.kubeconfig"), list_page_size=page
    )
    try:
        yield c
    finally:
        await c.close()


async def test_a_node_list_is_read_in_pages_as_one_list(kube: KubeApiDouble, tmp_path: Path) -> None:
    for i in range(7):
        kube.add_node(f"n{i}", labels={"pool": "a" if i % 2 else "b"})
    async with paging_client(kube, tmp_path, 3) as c:
        listed = await c.list_nodes()
        assert [n.name for n in listed.items] == [f"n{i}" for i in range(7)]
        assert listed.resource_version == kube.node("n6")["metadata"]["resourceVersion"]
        assert kube.list_pages == 3
        selected = await c.list_nodes(label_selector="pool=a")
        assert [n.name for n in selected.items] == ["n1", "n3", "n5"]
        # Four nodes in pages of three: two requests.
        before = kube.list_pages
        assert len((await c.list_nodes(label_selector="pool=b")).items) == 4
        assert kube.list_pages == before + 2


async def test_pages_read_while_the_cluster_changes_are_the_list_as_of_the_first(
    kube: KubeApiDouble, tmp_path: Path
) -> None:
    for i in range(6):
        kube.add_node(f"n{i}")
    at_start = kube.node("n5")["metadata"]["resourceVersion"]
    kube.set_latency("list", 0.3)
    async with paging_client(kube, tmp_path, 2) as c:
        listing = asyncio.create_task(c.list_nodes())
        await asyncio.sleep(0.1)  # the first page is served, its answer on the way
        kube.delete_node("n5")
        kube.add_node("n2a")
        kube.update_node("n4", lambda n: n["metadata"].setdefault("labels", {}).update(moved="yes"))
        listed = await listing
        assert [n.name for n in listed.items] == [f"n{i}" for i in range(6)]
        assert listed.resource_version == at_start and kube.list_pages == 3
        assert "moved" not in next(n for n in listed.items if n.name == "n4").labels
        # A watch from the list's version sees what changed while it was read, in order.
        seen: list[tuple[str, str]] = []
        async with aclosing(
            c.watch_nodes(resource_version=listed.resource_version, timeout_seconds=1)
        ) as events:
            async for event in events:
                if isinstance(event, NodeEvent):
                    seen.append((event.type, event.node.name))
                    if len(seen) == 3:
                        break
        assert seen == [("DELETED", "n5"), ("ADDED", "n2a"), ("MODIFIED", "n4")]


async def test_an_expired_continue_token_means_one_whole_list(kube: KubeApiDouble, tmp_path: Path) -> None:
    for i in range(5):
        kube.add_node(f"n{i}")
    kube.set_latency("list", 0.3)
    async with paging_client(kube, tmp_path, 2) as c:
        listing = asyncio.create_task(c.list_nodes())
        await asyncio.sleep(0.1)
        kube.add_node("n5")
        kube.compact()  # the first page's revision is history now
        listed = await listing
        assert [n.name for n in listed.items] == [f"n{i}" for i in range(6)]
        assert listed.resource_version == kube.node("n5")["metadata"]["resourceVersion"]
    lists = [path for method, path, _ in kube.requests if method == "GET" and path == "/api/v1/nodes"]
    assert len(lists) == 3  # the first page, the expired second, the whole list


async def test_the_double_refuses_a_mangled_continue_token(kube: KubeApiDouble) -> None:
    kube.add_node("a")
    status, body = await raw(kube, "GET", "/api/v1/nodes?limit=1&continue=bm90LWEta2V5")
    assert status == 400 and body["reason"] == "BadRequest" and "continue key is not valid" in body["message"]
    status, body = await raw(kube, "GET", "/api/v1/nodes?limit=x")
    assert status == 400


async def test_a_server_that_repeats_its_continue_token_is_refused(tmp_path: Path) -> None:
    async def stuck(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"kind": "NodeList", "metadata": {"resourceVersion": "9", "continue": "same"}, "items": []}
        )

    async with served(stuck, tmp_path) as c:
        with pytest.raises(KubeError, match="continue token it was given"):
            await c.list_nodes()


async def test_a_shed_page_is_asked_for_again_with_its_token_not_the_whole_list(tmp_path: Path) -> None:
    asked: list[str] = []

    async def paging(request: web.Request) -> web.StreamResponse:
        token = request.query.get("continue", "")
        asked.append(token)
        if not token:
            page = {"metadata": {"resourceVersion": "7", "continue": "t1"}, "items": [_node_json("a")]}
            return web.json_response({"kind": "NodeList", **page})
        if asked.count("t1") == 1:  # shed once, as API Priority and Fairness does
            status = {
                "kind": "Status",
                "code": 429,
                "reason": "TooManyRequests",
                "message": "Too many requests",
            }
            return web.json_response(status, status=429, headers={"Retry-After": "1"})
        return web.json_response(
            {"kind": "NodeList", "metadata": {"resourceVersion": "7"}, "items": [_node_json("b")]}
        )

    async with served(paging, tmp_path) as c:
        took, listed = await _timed(c.list_nodes())
    assert [n.name for n in listed.items] == ["a", "b"] and listed.resource_version == "7"
    assert asked == ["", "t1", "t1"] and took >= 1.0  # the server's wait, then the same page


async def test_a_shed_first_page_is_the_callers_to_retry(tmp_path: Path) -> None:
    async def shed(request: web.Request) -> web.StreamResponse:
        return web.json_response({"kind": "Status", "code": 503, "message": "busy"}, status=503)

    async with served(shed, tmp_path) as c:
        with pytest.raises(KubeUnavailable):
            await c.list_nodes()


def _node_json(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "7"},
        "spec": {},
        "status": {},
    }
