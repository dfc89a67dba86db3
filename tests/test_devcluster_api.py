"""The API stand-in against the official kubernetes client: CRUD, selectors, conflicts, patches,
status separation, watches, graceful deletion, garbage collection, versions, persistence."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from devcluster.apiserver import ApiServer
from devcluster.resources import Surface

pytestmark = pytest.mark.timeout(60)

CLAIM = {
    "metadata": {"name": "c1"},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
}


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServer]:
    with ApiServer().start() as srv:
        yield srv


@pytest.fixture
def api(server: ApiServer) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=server.url))


@pytest.fixture
def ns(api: client.ApiClient) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name, "labels": {"team": "a"}}})
    return name


def eventually(check: Callable[[], object], timeout: float = 5.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def status_of(e: ApiException) -> dict:
    return json.loads(e.body)


def pod(name: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": labels}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}


# ---------------------------------------------------------------------------- discovery


def test_discovery_lists_every_resource_k8s_io_version_and_subresources(server: ApiServer) -> None:
    groups = httpx.get(f"{server.url}/apis").json()["groups"]
    resource = next(g for g in groups if g["name"] == "resource.k8s.io")
    assert [v["version"] for v in resource["versions"]] == ["v1", "v1beta2", "v1beta1", "v1alpha3"]
    assert resource["preferredVersion"]["version"] == "v1"
    listing = httpx.get(f"{server.url}/apis/resource.k8s.io/v1").json()
    names = {r["name"]: r for r in listing["resources"]}
    assert {"resourceclaims", "resourceclaims/status", "devicetaintrules", "resourceslices"} <= names.keys()
    assert names["resourceclaims"]["namespaced"] and not names["resourceslices"]["namespaced"]
    assert "watch" in names["resourceclaims"]["verbs"]
    assert "devicetaintrules" not in {
        r["name"] for r in httpx.get(f"{server.url}/apis/resource.k8s.io/v1beta1").json()["resources"]
    }
    core = {r["name"] for r in httpx.get(f"{server.url}/api/v1").json()["resources"]}
    assert {"pods", "pods/status", "pods/binding", "nodes", "namespaces", "events"} <= core
    assert httpx.get(f"{server.url}/version").json()["major"] == "1"


def test_a_partial_surface_hides_versions_and_taint_rules() -> None:
    surface = Surface(resource_versions=("v1beta1", "v1alpha3"), taint_rule_versions=())
    with ApiServer(surface=surface).start() as srv:
        resource = next(g for g in httpx.get(f"{srv.url}/apis").json()["groups"] if g["name"] == "resource.k8s.io")
        assert [v["version"] for v in resource["versions"]] == ["v1beta1", "v1alpha3"]
        assert httpx.get(f"{srv.url}/apis/resource.k8s.io/v1").status_code == 404
        alpha = {r["name"] for r in httpx.get(f"{srv.url}/apis/resource.k8s.io/v1alpha3").json()["resources"]}
        assert "devicetaintrules" not in alpha and "resourceclaims" in alpha
        assert httpx.get(f"{srv.url}/apis/resource.k8s.io/v1alpha3/devicetaintrules").status_code == 404


# ---------------------------------------------------------------------------- CRUD and selectors


def test_create_fills_identity_and_generate_name(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    first = core.create_namespaced_pod(ns, {"metadata": {"generateName": "job-"}, "spec": pod("x")["spec"]})
    second = core.create_namespaced_pod(ns, {"metadata": {"generateName": "job-"}, "spec": pod("x")["spec"]})
    assert first.metadata.name.startswith("job-") and len(first.metadata.name) == len("job-") + 5
    assert first.metadata.name != second.metadata.name and first.metadata.uid != second.metadata.uid
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    assert first.metadata.creation_timestamp is not None
    assert first.spec.termination_grace_period_seconds == 30  # defaulted before admission, as the API server does
    assert first.status.phase == "Pending"


def test_errors_are_status_objects(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("nope", ns)
    assert missing.value.status == 404
    assert status_of(missing.value)["reason"] == "NotFound"
    assert status_of(missing.value)["message"] == 'pods "nope" not found'
    core.create_namespaced_pod(ns, pod("p"))
    with pytest.raises(ApiException) as exists:
        core.create_namespaced_pod(ns, pod("p"))
    assert exists.value.status == 409 and status_of(exists.value)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as no_ns:
        core.create_namespaced_pod("no-such-namespace", pod("p"))
    assert no_ns.value.status == 404
    assert status_of(no_ns.value)["message"] == 'namespaces "no-such-namespace" not found'


def test_label_and_field_selectors(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, pod("a", app="web", tier="front"))
    core.create_namespaced_pod(ns, pod("b", app="db"))
    core.create_namespaced_pod(ns, pod("c"))

    def names(**kwargs: str) -> list[str]:
        return sorted(p.metadata.name for p in core.list_namespaced_pod(ns, **kwargs).items)

    assert names(label_selector="app=web") == ["a"]
    assert names(label_selector="app!=web") == ["b", "c"]
    assert names(label_selector="app in (web,db)") == ["a", "b"]
    assert names(label_selector="app notin (web)") == ["b", "c"]
    assert names(label_selector="tier") == ["a"]
    assert names(label_selector="!app") == ["c"]
    assert names(label_selector="app in (web,db),!tier") == ["b"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="status.phase=Pending,metadata.name!=a") == ["b", "c"]
    assert names(field_selector="spec.nodeName=") == ["a", "b", "c"]
    with pytest.raises(ApiException) as bad:
        core.list_namespaced_pod(ns, field_selector="spec.hostname=x")
    assert bad.value.status == 400
    everywhere = core.list_pod_for_all_namespaces(label_selector="app=web").items
    assert [p.metadata.namespace for p in everywhere if p.metadata.name == "a"] == [ns]


def test_list_pages_with_limit_and_continue(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    for i in range(5):
        core.create_namespaced_pod(ns, pod(f"p{i}"))
    first = core.list_namespaced_pod(ns, limit=2)
    assert [p.metadata.name for p in first.items] == ["p0", "p1"] and first.metadata.remaining_item_count == 3
    rest = core.list_namespaced_pod(ns, limit=10, _continue=first.metadata._continue)
    assert [p.metadata.name for p in rest.items] == ["p2", "p3", "p4"]


def test_stale_update_conflicts_and_unconditional_update_wins(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    created = core.create_namespaced_pod(ns, pod("p"))
    fresh = core.read_namespaced_pod("p", ns)
    fresh.metadata.labels = {"v": "1"}
    core.replace_namespaced_pod("p", ns, fresh)
    created.metadata.labels = {"v": "stale"}
    with pytest.raises(ApiException) as stale:
        core.replace_namespaced_pod("p", ns, created)
    assert stale.value.status == 409 and status_of(stale.value)["reason"] == "Conflict"
    assert "the object has been modified" in status_of(stale.value)["message"]
    created.metadata.resource_version = None
    assert core.replace_namespaced_pod("p", ns, created).metadata.labels == {"v": "stale"}


def test_pod_spec_and_claim_spec_are_immutable(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, pod("p"))
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_pod("p", ns, {"spec": {"restartPolicy": "Never"}})
    assert e.value.status == 422
    resource = client.ResourceV1Api(api)
    resource.create_namespaced_resource_claim(ns, CLAIM)
    with pytest.raises(ApiException) as e:
        resource.patch_namespaced_resource_claim(
            "c1", ns, [{"op": "replace", "path": "/spec/devices/requests/0/name", "value": "other"}]
        )
    assert e.value.status == 422 and "immutable" in e.value.body


# ---------------------------------------------------------------------------- patches


def test_json_patch_test_op_fails_with_422_and_stale_resource_version_with_409(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    current = core.create_namespaced_pod(ns, pod("p"))
    rv = current.metadata.resource_version
    guarded = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/annotations", "value": {"a": "1"}},
    ]
    assert core.patch_namespaced_pod("p", ns, guarded).metadata.annotations == {"a": "1"}
    with pytest.raises(ApiException) as failed_test:
        core.patch_namespaced_pod("p", ns, guarded)  # the object changed since rv
    assert failed_test.value.status == 422
    assert core.read_namespaced_pod("p", ns).metadata.annotations == {"a": "1"}
    with pytest.raises(ApiException) as stale:
        core.patch_namespaced_pod("p", ns, {"metadata": {"resourceVersion": rv, "labels": {"x": "y"}}})
    assert stale.value.status == 409


def test_strategic_merge_patch_merges_finalizers_and_reserved_for(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, {**pod("p"), "metadata": {"name": "p", "finalizers": ["a.io/x"]}})
    merged = core.patch_namespaced_pod("p", ns, {"metadata": {"finalizers": ["b.io/y"]}})  # dict body: SMP
    assert merged.metadata.finalizers == ["a.io/x", "b.io/y"]
    removed = core.patch_namespaced_pod("p", ns, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a.io/x"]}})
    assert removed.metadata.finalizers == ["b.io/y"]
    replaced = core.patch_namespaced_pod(
        "p", ns, {"metadata": {"finalizers": []}}, _content_type="application/merge-patch+json"
    )
    assert replaced.metadata.finalizers is None
    resource = client.ResourceV1Api(api)
    resource.create_namespaced_resource_claim(ns, CLAIM)
    allocation = {
        "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"}]}
    }
    resource.patch_namespaced_resource_claim_status(
        "c1", ns, {"status": {"allocation": allocation, "reservedFor": [{"resource": "pods", "name": "a", "uid": "1"}]}}
    )
    status = resource.patch_namespaced_resource_claim_status(
        "c1", ns, {"status": {"reservedFor": [{"resource": "pods", "name": "b", "uid": "2"}]}}
    ).status
    assert [r.uid for r in status.reserved_for] == ["1", "2"]
    status = resource.patch_namespaced_resource_claim_status(
        "c1", ns, {"status": {"reservedFor": [{"uid": "1", "$patch": "delete"}]}}
    ).status
    assert [r.uid for r in status.reserved_for] == ["2"]


def test_status_subresource_is_separate_from_the_main_resource(api: client.ApiClient, ns: str) -> None:
    resource = client.ResourceV1Api(api)
    created = resource.create_namespaced_resource_claim(
        ns, {**CLAIM, "status": {"reservedFor": [{"resource": "pods", "name": "x", "uid": "9"}]}}
    )
    assert created.status is None  # create may not set status
    allocation = {
        "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"}]}
    }
    resource.patch_namespaced_resource_claim(
        "c1", ns, {"status": {"allocation": allocation}, "metadata": {"labels": {"l": "1"}}}
    )
    claim = resource.read_namespaced_resource_claim("c1", ns)
    assert claim.status is None and claim.metadata.labels == {"l": "1"}
    resource.patch_namespaced_resource_claim_status(
        "c1", ns, {"status": {"allocation": allocation}, "metadata": {"labels": {"l": "2"}}}
    )
    claim = resource.read_namespaced_resource_claim("c1", ns)
    assert claim.status.allocation.devices.results[0].device == "gpu-0"
    assert claim.metadata.labels == {"l": "1"}  # /status keeps metadata
    with pytest.raises(ApiException) as e:  # reservedFor without allocation is invalid
        resource.patch_namespaced_resource_claim_status(
            "c1", ns, {"status": {"allocation": None, "reservedFor": [{"resource": "pods", "name": "a", "uid": "1"}]}}
        )
    assert e.value.status == 422


def test_dry_run_is_not_persisted(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    shown = core.create_namespaced_pod(ns, pod("p"), dry_run="All")
    assert shown.metadata.name == "p"
    with pytest.raises(ApiException):
        core.read_namespaced_pod("p", ns)


# ---------------------------------------------------------------------------- watches


def test_watch_streams_resumes_and_follows_selectors(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    listed = core.list_namespaced_pod(ns)
    core.create_namespaced_pod(ns, pod("a", app="web"))
    core.patch_namespaced_pod("a", ns, {"metadata": {"labels": {"app": "db"}}})
    core.delete_namespaced_pod("a", ns)
    seen = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core.list_namespaced_pod, ns, resource_version=listed.metadata.resource_version, timeout_seconds=1
        )
    ]
    assert seen == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    selected = [
        e["type"]
        for e in watch.Watch().stream(
            core.list_namespaced_pod,
            ns,
            label_selector="app=web",
            resource_version=listed.metadata.resource_version,
            timeout_seconds=1,
        )
    ]
    assert selected == ["ADDED", "DELETED"]  # leaving the selection is a deletion for this watcher


def test_watch_delivers_live_events_to_the_official_client(api: client.ApiClient, server: ApiServer, ns: str) -> None:
    import threading

    core = client.CoreV1Api(api)
    got: list[str] = []
    w = watch.Watch()

    def consume() -> None:
        for event in w.stream(core.list_namespaced_pod, ns, timeout_seconds=5):
            got.append(f"{event['type']} {event['object'].metadata.name}")
            if len(got) == 2:
                w.stop()

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(0.2)
    core.create_namespaced_pod(ns, pod("live"))
    core.patch_namespaced_pod("live", ns, {"metadata": {"labels": {"x": "1"}}})
    thread.join(timeout=10)
    assert got == ["ADDED live", "MODIFIED live"]


def test_watch_from_a_compacted_resource_version_is_gone() -> None:
    with ApiServer(history_limit=10).start() as srv:
        core = client.CoreV1Api(client.ApiClient(client.Configuration(host=srv.url)))
        start = core.list_namespaced_pod("default").metadata.resource_version
        for i in range(30):
            core.create_namespaced_pod("default", pod(f"p{i}"))
        raw = httpx.get(
            f"{srv.url}/api/v1/namespaces/default/pods",
            params={"watch": "1", "resourceVersion": start, "timeoutSeconds": "1"},
        )
        event = json.loads(raw.text.splitlines()[0])
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
        assert event["object"]["reason"] == "Expired"
        with pytest.raises(ApiException) as gone:
            list(watch.Watch().stream(core.list_namespaced_pod, "default", resource_version=start, timeout_seconds=1))
        assert gone.value.status == 410


# ---------------------------------------------------------------------------- deletion


def test_pod_deletion_is_graceful_once_scheduled_and_forced_with_grace_zero(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, {**pod("p"), "spec": {**pod("p")["spec"], "terminationGracePeriodSeconds": 45}})
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-1"},
    }
    api.call_api(*api.param_serialize("POST", f"/api/v1/namespaces/{ns}/pods/p/binding", body=binding)).read()
    assert core.read_namespaced_pod("p", ns).spec.node_name == "node-1"
    marked = core.delete_namespaced_pod("p", ns)
    assert marked.metadata.deletion_timestamp is not None and marked.metadata.deletion_grace_period_seconds == 45
    assert core.read_namespaced_pod("p", ns).metadata.deletion_timestamp is not None
    core.delete_namespaced_pod("p", ns, grace_period_seconds=0)  # what the kubelet does when containers stopped
    with pytest.raises(ApiException):
        core.read_namespaced_pod("p", ns)


def test_finalizers_hold_deletion_until_removed(api: client.ApiClient, ns: str) -> None:
    resource = client.ResourceV1Api(api)
    resource.create_namespaced_resource_claim(
        ns, {**CLAIM, "metadata": {"name": "c1", "finalizers": ["scrubgate.dev/sanitize"]}}
    )
    deleted = resource.delete_namespaced_resource_claim("c1", ns)
    assert deleted.metadata.deletion_timestamp is not None
    with pytest.raises(ApiException) as e:
        resource.patch_namespaced_resource_claim("c1", ns, {"metadata": {"finalizers": ["x.io/new"]}})
    assert e.value.status == 403  # no new finalizers while deleting
    resource.patch_namespaced_resource_claim("c1", ns, [{"op": "remove", "path": "/metadata/finalizers"}])
    with pytest.raises(ApiException) as gone:
        resource.read_namespaced_resource_claim("c1", ns)
    assert gone.value.status == 404


def test_delete_preconditions(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, pod("p"))
    with pytest.raises(ApiException) as e:
        core.delete_namespaced_pod("p", ns, body={"preconditions": {"uid": "not-the-uid"}})
    assert e.value.status == 409 and "Precondition failed" in e.value.body


def test_garbage_collector_deletes_dependents_of_a_deleted_owner(api: client.ApiClient, ns: str) -> None:
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    owner = core.create_namespaced_pod(ns, pod("owner"))
    ref = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "owner",
        "uid": owner.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    resource.create_namespaced_resource_claim(ns, {**CLAIM, "metadata": {"name": "owned", "ownerReferences": [ref]}})
    job_ref = {"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "job-uid"}
    core.create_namespaced_pod(ns, {**pod("of-a-job"), "metadata": {"name": "of-a-job", "ownerReferences": [job_ref]}})
    orphan = core.create_namespaced_pod(ns, pod("orphan-owner"))
    resource.create_namespaced_resource_claim(
        ns,
        {
            **CLAIM,
            "metadata": {
                "name": "kept",
                "ownerReferences": [{**ref, "name": "orphan-owner", "uid": orphan.metadata.uid}],
            },
        },
    )
    core.delete_namespaced_pod("owner", ns)
    core.delete_namespaced_pod("orphan-owner", ns, propagation_policy="Orphan")
    names = lambda: {c.metadata.name for c in resource.list_namespaced_resource_claim(ns).items}  # noqa: E731
    assert eventually(lambda: names() == {"kept"})
    assert eventually(lambda: not resource.read_namespaced_resource_claim("kept", ns).metadata.owner_references)
    time.sleep(0.3)  # an owner of a kind the stand-in does not serve is never presumed gone
    assert core.read_namespaced_pod("of-a-job", ns)


def test_namespace_deletion_removes_its_content(api: client.ApiClient, ns: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(ns, {**pod("p"), "spec": {**pod("p")["spec"], "nodeName": "node-1"}})
    core.delete_namespace(ns)
    assert core.read_namespace(ns).status.phase == "Terminating"
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod(ns, pod("q"))
    assert e.value.status == 403
    # The running pod is being deleted gracefully and holds the namespace until the kubelet's final delete.
    assert eventually(lambda: core.read_namespaced_pod("p", ns).metadata.deletion_timestamp)
    assert core.read_namespace(ns).status.phase == "Terminating"
    core.delete_namespaced_pod("p", ns, grace_period_seconds=0)

    def gone() -> bool:
        try:
            core.read_namespace(ns)
        except ApiException as exc:
            return exc.status == 404
        return False

    assert eventually(gone)


# ---------------------------------------------------------------------------- resource.k8s.io versions


def test_one_storage_converted_per_version(api: client.ApiClient, ns: str) -> None:
    v1, v1beta1 = client.ResourceV1Api(api), client.ResourceV1beta1Api(api)
    flat = {
        "metadata": {"name": "c1"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "deviceClassName": "gpu.nvidia.com",
                        "tolerations": [{"key": "k", "effect": "NoSchedule"}],
                    }
                ]
            }
        },
    }
    v1beta1.create_namespaced_resource_claim(ns, flat)
    nested = v1.read_namespaced_resource_claim("c1", ns).spec.devices.requests[0]
    assert nested.exactly.device_class_name == "gpu.nvidia.com" and nested.exactly.count == 1
    assert nested.exactly.tolerations[0].operator == "Equal"
    raw = httpx.get(f"{api.configuration.host}/apis/resource.k8s.io/v1alpha3/namespaces/{ns}/resourceclaims/c1").json()
    assert raw["apiVersion"] == "resource.k8s.io/v1alpha3" and raw["spec"]["devices"]["requests"][0]["deviceClassName"]
    slice_ = {
        "apiVersion": "resource.k8s.io/v1alpha3",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{ns}-s"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "n1",
            "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "basic": {"attributes": {"uuid": {"string": "GPU-1"}}, "capacity": {"memory": "80Gi"}},
                }
            ],
        },
    }
    created = httpx.post(f"{api.configuration.host}/apis/resource.k8s.io/v1alpha3/resourceslices", json=slice_)
    assert created.status_code == 201, created.text
    device = v1.read_resource_slice(f"{ns}-s").spec.devices[0]
    assert device.attributes["uuid"].string == "GPU-1" and device.capacity["memory"].value == "80Gi"
    patched = httpx.patch(
        f"{api.configuration.host}/apis/resource.k8s.io/v1beta1/resourceslices/{ns}-s",
        headers={"Content-Type": "application/json-patch+json"},
        json=[{"op": "add", "path": "/spec/devices/0/basic/attributes/type", "value": {"string": "gpu"}}],
    )
    assert patched.status_code == 200, patched.text
    assert v1.read_resource_slice(f"{ns}-s").spec.devices[0].attributes["type"].string == "gpu"
    mixed = httpx.post(
        f"{api.configuration.host}/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims",
        json={**flat, "apiVersion": "resource.k8s.io/v1beta1"},
    )
    assert mixed.status_code == 400  # a body in another version than the URL's


# ---------------------------------------------------------------------------- identity, persistence, process


def test_tokens_identify_users_and_unknown_tokens_are_rejected() -> None:
    from devcluster.auth import parse_token_file

    tokens = parse_token_file(
        'tok-agent,system:serviceaccount:scrubgate-system:scrubgate-agent,u1,"system:serviceaccounts"\n'
    )
    assert tokens["tok-agent"].groups == ("system:serviceaccounts", "system:authenticated")
    with ApiServer(tokens=tokens).start() as srv:
        assert (
            httpx.get(f"{srv.url}/api/v1/namespaces", headers={"Authorization": "Bearer tok-agent"}).status_code == 200
        )
        denied = httpx.get(f"{srv.url}/api/v1/namespaces", headers={"Authorization": "Bearer wrong"})
        assert denied.status_code == 401 and denied.json()["reason"] == "Unauthorized"


def test_state_dir_keeps_objects_and_resource_versions_across_restarts(tmp_path: Path) -> None:
    with ApiServer(state_dir=tmp_path).start() as srv:
        core = client.CoreV1Api(client.ApiClient(client.Configuration(host=srv.url)))
        core.create_namespaced_pod("default", pod("kept"))
        core.create_namespaced_pod("default", pod("dropped"))
        core.delete_namespaced_pod("dropped", "default")
        rv = int(core.list_namespaced_pod("default").metadata.resource_version)
    with ApiServer(state_dir=tmp_path).start() as srv:
        core = client.CoreV1Api(client.ApiClient(client.Configuration(host=srv.url)))
        listed = core.list_namespaced_pod("default")
        assert [p.metadata.name for p in listed.items] == ["kept"]
        assert int(listed.metadata.resource_version) >= rv
        created = core.create_namespaced_pod("default", pod("new"))
        assert int(created.metadata.resource_version) > rv
        with pytest.raises(ApiException) as gone:  # history does not survive a restart
            list(
                watch.Watch().stream(
                    core.list_namespaced_pod, "default", resource_version=str(rv - 1), timeout_seconds=1
                )
            )
        assert gone.value.status == 410


def test_runs_as_its_own_process(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "devcluster.apiserver", "--port", "0", "--port-file", str(port_file)],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert eventually(port_file.exists, timeout=15)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        namespaces = client.CoreV1Api(client.ApiClient(client.Configuration(host=url))).list_namespace()
        assert "default" in {n.metadata.name for n in namespaces.items}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_bookmarks_and_selector_errors(server: ApiServer) -> None:
    from devcluster.api import Call
    from devcluster.auth import ADMIN
    from devcluster.resources import PODS

    start = server.store.resource_version
    events = server.api.watch(
        Call(ADMIN, PODS, "v1", "default"),
        resource_version=str(start),
        timeout_s=2,
        bookmarks=True,
        bookmark_interval_s=0.1,
    )
    first = next(events)
    assert first["type"] == "BOOKMARK" and int(first["object"]["metadata"]["resourceVersion"]) >= start
    events.close()
    bad = httpx.get(f"{server.url}/api/v1/pods", params={"watch": "1", "fieldSelector": "spec.bogus=1"})
    assert bad.status_code == 400 and bad.json()["message"] == "field label not supported: spec.bogus"


def test_foreground_deletion_waits_for_blocking_dependents(api: client.ApiClient, ns: str) -> None:
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    owner = core.create_namespaced_pod(ns, {**pod("owner"), "metadata": {"name": "owner", "finalizers": ["x.io/hold"]}})
    ref = {"apiVersion": "v1", "kind": "Pod", "name": "owner", "uid": owner.metadata.uid, "blockOwnerDeletion": True}
    resource.create_namespaced_resource_claim(
        ns, {**CLAIM, "metadata": {"name": "dep", "ownerReferences": [ref], "finalizers": ["x.io/hold"]}}
    )
    core.delete_namespaced_pod("owner", ns, propagation_policy="Foreground")
    assert "foregroundDeletion" in core.read_namespaced_pod("owner", ns).metadata.finalizers
    assert eventually(lambda: resource.read_namespaced_resource_claim("dep", ns).metadata.deletion_timestamp)
    time.sleep(0.2)
    assert "foregroundDeletion" in core.read_namespaced_pod("owner", ns).metadata.finalizers  # dependent still there
    resource.patch_namespaced_resource_claim("dep", ns, [{"op": "remove", "path": "/metadata/finalizers"}])
    assert eventually(lambda: core.read_namespaced_pod("owner", ns).metadata.finalizers == ["x.io/hold"])
