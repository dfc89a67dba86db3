"""`scrubgate uninstall` against a stand-in API server: what it waits for, the order it removes things in, and
that a teardown starting while the agents stop leaves the guard in place; what counts as a pending teardown once
more on a bare kube-apiserver. The whole path on kube-apiserver is
tests/test_e2e_fence_paths.py::test_uninstall_waits_for_the_pending_teardown_then_leaves_nothing_of_scrubgates."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from k8s_support import api_server
from scrubgate.policies import names

from scrubgate.cluster import ApiError, KubeApi
from scrubgate.uninstall import in_use, teardown_pending, uninstall

DRA = "/apis/resource.k8s.io/v1"
DAEMONSET = "/apis/apps/v1/namespaces/scrubgate-system/daemonsets/scrubgate-agent"
AGENT_LABELS = {"app.kubernetes.io/name": "scrubgate", "app.kubernetes.io/component": "agent"}


ALLOCATION = {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n", "device": "gpu-0"}]}}


def hold(node: str = "n") -> dict[str, str]:
    """A node agent's hold (sanitizer_agent/claims.py hold_entry)."""
    return {"apiGroup": names.RESERVATION_GROUP, "resource": names.RESERVATION_RESOURCE, "name": node, "uid": "h1"}


def claim(
    name: str,
    *,
    reserved: tuple[str, ...] = (),
    finalizers: tuple[str, ...] = (names.FINALIZER,),
    allocated: bool = True,
    held: bool = False,
) -> dict:
    status: dict[str, Any] = {"reservedFor": [{"resource": "pods", "name": p, "uid": p} for p in reserved]}
    if allocated:
        status["allocation"] = copy.deepcopy(ALLOCATION)
    if held:
        status["reservedFor"].append(hold())
    return {
        "metadata": {"namespace": "team", "name": name, "uid": name, "finalizers": list(finalizers)},
        "status": status,
    }


class FakeApi:
    """Lists, GETs, PUTs and DELETEs over a few collections; `on_delete` runs when an object is deleted."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict[str, Any]]] = {
            f"{DRA}/resourceclaims": {},
            f"{DRA}/devicetaintrules": {},
            "/api/v1/pods": {},
            "/api/v1/nodes": {"n": {"metadata": {"name": "n"}, "spec": {}}},
            "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations": {},
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations": {},
            "/api/v1/namespaces/scrubgate-system/pods": {},
        }
        self.daemonset: dict[str, Any] | None = {"spec": {"selector": {"matchLabels": AGENT_LABELS}}}
        self.calls: list[tuple[str, str]] = []
        self.on_agents_stopped: list[Any] = []
        self.refused_puts: ApiError | None = None  # what every claim update gets (SG007 while webhooks linger)

    def request(self, method: str, path: str, query: Mapping[str, str] | None = None, body: Any = None) -> dict:
        self.calls.append((method, path))
        if path == "/apis/resource.k8s.io":
            return {"preferredVersion": {"version": "v1"}, "versions": [{"version": "v1"}]}
        if path == DAEMONSET:
            if self.daemonset is None:
                raise ApiError("not found", 404)
            if method == "DELETE":
                self.daemonset = None
                self.objects["/api/v1/namespaces/scrubgate-system/pods"].clear()
                for change in self.on_agents_stopped:
                    change()
            return self.daemonset or {}
        collection, _, name = path.rpartition("/")
        if path in self.objects and method == "GET":
            items = [copy.deepcopy(o) for o in self.objects[path].values()]
            if (query or {}).get("fieldSelector") == "status.phase!=Succeeded,status.phase!=Failed":
                items = [o for o in items if (o.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
            return {"items": items, "metadata": {}}
        if "/namespaces/team/resourceclaims" in collection:
            store = self.objects[f"{DRA}/resourceclaims"]
            if method == "PUT" and self.refused_puts is not None:
                raise self.refused_puts
            status = name == "status"  # the status subresource: only the status changes
            if status:
                collection, _, name = collection.rpartition("/")
            if method == "PUT":
                sent = copy.deepcopy({k: v for k, v in body.items() if k not in ("apiVersion", "kind")})
                store[name] = (
                    {**store[name], "status": sent["status"]} if status else {**sent, "status": store[name]["status"]}
                )
            return copy.deepcopy(store[name])
        if method == "DELETE":
            del self.objects[collection][name]
            return {}
        raise AssertionError(f"unexpected {method} {path}")


def webhook(api: FakeApi) -> None:
    for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        api.objects[f"/apis/admissionregistration.k8s.io/v1/{kind}"]["scrubgate"] = {"metadata": {"name": "scrubgate"}}


def test_a_claim_reserved_for_an_ended_pod_is_a_pending_teardown() -> None:
    """SG007 keeps the ended pod in reservedFor until the attestation, or the agent's hold keeps the claim."""
    assert in_use(claim("c", reserved=("p",)), {"p"})
    assert not in_use(claim("c", reserved=("p",)), set())
    assert not in_use(claim("c"), {"p"})
    group = claim("g")
    group["status"]["reservedFor"] = [{"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "uid": "g"}]
    assert in_use(group, set())
    assert teardown_pending(claim("c", reserved=("p",)), set())
    assert teardown_pending(claim("h", held=True), set()), "held for pods that ended: the agent owes the scrub"
    assert not teardown_pending(claim("h", reserved=("p",), held=True), {"p"}), "held while its pod runs: in use"


def test_a_claim_being_deleted_is_in_use_while_its_pod_runs() -> None:
    """Deletion only stops new reservations: the pod keeps running on the device, as the agent reads it
    (sanitizer_agent/claims.py release_reason); its teardown starts when the pod ends."""
    deleted = claim("d", reserved=("p",))
    deleted["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    assert in_use(deleted, {"p"}) and not teardown_pending(deleted, {"p"})
    assert teardown_pending(deleted, set())


def test_a_claim_that_holds_no_device_is_no_pending_teardown() -> None:
    """Never allocated (its pod Pending, unschedulable, or never created): nothing a tenant used, so nothing
    to wait for; else any tenant could hold the uninstall with a claim that never gets a device."""
    assert not teardown_pending(claim("never", allocated=False), set())
    assert not teardown_pending(claim("for-pending", reserved=("pending",), allocated=False), {"pending"})
    assert teardown_pending(claim("allocated"), set()), "allocated on a node, reserved for nobody: owed a scrub"
    assert teardown_pending(claim("held", allocated=False, held=True), set()), "a hold counts without allocation"


def test_once_nothing_is_pending_the_agents_stop_then_the_webhooks_go_then_claims_in_use_are_released() -> None:
    api = FakeApi()
    webhook(api)
    api.objects["/api/v1/pods"]["p"] = {"metadata": {"uid": "p"}, "status": {"phase": "Running"}}
    api.objects[f"{DRA}/resourceclaims"]["busy"] = claim("busy", reserved=("p",))
    api.objects[f"{DRA}/resourceclaims"]["other"] = claim("other", finalizers=("example.com/keep",))
    assert uninstall(api, "scrubgate-system", 5, sleep=lambda _: None) == 0
    claims = api.objects[f"{DRA}/resourceclaims"]
    assert claims["busy"]["metadata"]["finalizers"] == [] and claims["other"]["metadata"]["finalizers"] == [
        "example.com/keep"
    ]
    deletes = [path for method, path in api.calls if method == "DELETE"]
    assert deletes[0] == DAEMONSET and all("webhookconfigurations" in d for d in deletes[1:]) and len(deletes) == 3
    assert api.calls.index(("PUT", f"{DRA}/namespaces/team/resourceclaims/busy")) > api.calls.index(
        ("DELETE", deletes[-1])
    )


def test_a_fence_or_a_pending_teardown_keeps_everything_until_the_timeout(capsys) -> None:
    api = FakeApi()
    webhook(api)
    api.objects[f"{DRA}/resourceclaims"]["ended"] = claim("ended", reserved=("gone",))
    api.objects[f"{DRA}/devicetaintrules"]["f"] = {
        "metadata": {"name": "f"},
        "spec": {"taint": {"key": names.TAINT_SCRUB_FAILED, "effect": "NoSchedule"}},
    }
    api.objects["/api/v1/nodes"]["n"]["spec"]["taints"] = [{"key": names.TAINT_UNSANITIZED, "effect": "NoSchedule"}]
    assert uninstall(api, "scrubgate-system", 0, sleep=lambda _: None) == 1
    assert not [call for call in api.calls if call[0] != "GET"], "nothing removed"
    err = capsys.readouterr().err
    assert "claim team/ended: teardown pending (scrub-status not started)" in err
    assert_says_what_recovers(err)
    assert (
        f"DeviceTaintRule f: fence {names.TAINT_SCRUB_FAILED}" in err
        and f"node n: taint {names.TAINT_UNSANITIZED}" in err
    )


def test_a_teardown_that_starts_while_the_agents_stop_keeps_the_guard(capsys) -> None:
    """A pod ending in between: its agent hands the teardown over with a fence on its way out."""
    api = FakeApi()
    webhook(api)
    api.on_agents_stopped.append(
        lambda: api.objects[f"{DRA}/devicetaintrules"].update(
            {"h": {"metadata": {"name": "h"}, "spec": {"taint": {"key": names.TAINT_UNSANITIZED}}}}
        )
    )
    assert uninstall(api, "scrubgate-system", 5, sleep=lambda _: None) == 1
    assert [path for method, path in api.calls if method == "DELETE"] == [DAEMONSET], "the webhooks stay"
    err = capsys.readouterr().err
    assert "a teardown started while the agents stopped; bring them back" in err
    assert_says_what_recovers(err)


def assert_says_what_recovers(err: str) -> None:
    """A failed pre-delete hook leaves the release `uninstalling`, where `helm upgrade` fails ("has no deployed
    releases"): the way back is `helm rollback` to that revision, and `--no-hooks` only once the guard is gone
    (both run with helm on kube-apiserver: test_chart_lifecycle.py::test_a_failed_uninstall_hook_is_recovered_as_its_text_says)."""
    assert "helm rollback RELEASE REVISION" in err and "`helm history RELEASE` shows `uninstalling`" in err
    assert "`helm upgrade` fails on it" in err and "brings" not in err
    assert "--no-hooks` skips this wait: only once `scrubgate uninstall` has succeeded" in err


def test_a_claim_reserved_for_a_pod_that_ended_is_still_a_pending_teardown(capsys) -> None:
    api = FakeApi()
    api.objects["/api/v1/pods"]["done"] = {"metadata": {"uid": "done"}, "status": {"phase": "Succeeded"}}
    api.objects[f"{DRA}/resourceclaims"]["ended"] = claim("ended", reserved=("done",))
    assert uninstall(api, "scrubgate-system", 0, sleep=lambda _: None) == 1
    assert "claim team/ended: teardown pending" in capsys.readouterr().err


def test_a_finalizer_that_cannot_be_removed_is_named_with_what_to_do(capsys) -> None:
    api = FakeApi()
    webhook(api)
    api.objects["/api/v1/pods"]["p"] = {"metadata": {"uid": "p"}, "status": {"phase": "Running"}}
    api.objects[f"{DRA}/resourceclaims"]["busy"] = claim("busy", reserved=("p",))
    api.refused_puts = ApiError("PUT .../busy: HTTP 403: forbidden", 403)
    assert uninstall(api, "scrubgate-system", 0.5, sleep=lambda _: None) == 1
    err = capsys.readouterr().err
    assert "the guard is gone, but scrubgate.dev/sanitize or a node agent's hold" in err
    assert "could not be removed from these claims" in err
    assert "claim team/busy: PUT .../busy: HTTP 403" in err and "kubectl edit resourceclaim" in err


def test_a_never_allocated_claim_and_a_pending_pod_do_not_hold_the_uninstall(capsys) -> None:
    """A tenant's claim that never got a device (its pod Pending: unschedulable, or waiting on a quota), with
    the webhook's finalizer: the uninstall goes through and takes the finalizer off."""
    api = FakeApi()
    webhook(api)
    api.objects["/api/v1/pods"]["pending"] = {"metadata": {"uid": "pending"}, "status": {"phase": "Pending"}}
    api.objects[f"{DRA}/resourceclaims"]["never"] = claim("never", allocated=False)
    api.objects[f"{DRA}/resourceclaims"]["waiting"] = claim("waiting", reserved=("pending",), allocated=False)
    assert uninstall(api, "scrubgate-system", 0, sleep=lambda _: None) == 0, capsys.readouterr().err
    claims = api.objects[f"{DRA}/resourceclaims"]
    assert claims["never"]["metadata"]["finalizers"] == [] and claims["waiting"]["metadata"]["finalizers"] == []


def test_a_claim_held_by_an_agent_for_ended_pods_holds_the_uninstall(capsys) -> None:
    """The resourceclaim controller dropped the ended pod; the agent's hold stays until the attestation."""
    api = FakeApi()
    webhook(api)
    api.objects[f"{DRA}/resourceclaims"]["held"] = claim("held", held=True)
    assert uninstall(api, "scrubgate-system", 0, sleep=lambda _: None) == 1
    assert not [call for call in api.calls if call[0] != "GET"], "nothing removed"
    assert "claim team/held: teardown pending (scrub-status not started)" in capsys.readouterr().err


def test_the_agents_hold_goes_with_the_finalizer_from_a_claim_in_use() -> None:
    """Left on a claim in use, the hold would keep it allocated for good once its pod ends: no agent remains to
    release it, and the resourceclaim controller keeps consumers it does not know."""
    api = FakeApi()
    webhook(api)
    api.objects["/api/v1/pods"]["p"] = {"metadata": {"uid": "p"}, "status": {"phase": "Running"}}
    api.objects[f"{DRA}/resourceclaims"]["busy"] = claim("busy", reserved=("p",), held=True)
    assert uninstall(api, "scrubgate-system", 5, sleep=lambda _: None) == 0
    busy = api.objects[f"{DRA}/resourceclaims"]["busy"]
    assert busy["status"]["reservedFor"] == [{"resource": "pods", "name": "p", "uid": "p"}]
    assert busy["metadata"]["finalizers"] == [] and busy["status"]["allocation"] == ALLOCATION


@pytest.mark.timeout(120)
def test_on_kube_apiserver_only_a_claim_that_holds_a_device_holds_the_uninstall(tmp_path: Path, capsys) -> None:
    """On a real kube-apiserver (no controllers: the test plays the scheduler and the agent), the objects as
    the API server stores them: a claim that never got a device and its Pending pod let the uninstall through;
    a claim an agent holds for a pod that ended keeps it; a claim in use loses the finalizer and the hold."""
    with api_server(tmp_path) as plane:
        api = KubeApi.connect(str(plane.credentials["admin"].kubeconfig))
        api.request("POST", "/api/v1/namespaces", body={"metadata": {"name": "team"}})
        api.request("POST", "/api/v1/namespaces/team/serviceaccounts", body={"metadata": {"name": "default"}})
        claims = f"{DRA}/namespaces/team/resourceclaims"

        def create(name: str, pod: str, node: str | None) -> dict[str, Any]:
            spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}
            made = api.request(
                "POST", claims, body={"metadata": {"name": name, "finalizers": [names.FINALIZER]}, "spec": spec}
            )
            containers = [{"name": "main", "image": "trainer"}]
            pod_spec = {"containers": containers, "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]}
            api.request(
                "POST",
                "/api/v1/namespaces/team/pods",
                body={"metadata": {"name": pod}, "spec": {**pod_spec, **({"nodeName": node} if node else {})}},
            )
            return made

        def allocate(claim: dict[str, Any], *consumers: dict[str, str]) -> None:
            claim["status"] = {"allocation": copy.deepcopy(ALLOCATION), "reservedFor": list(consumers)}
            api.request("PUT", f"{claims}/{claim['metadata']['name']}/status", body=claim)

        create("never", "pending", None)  # unschedulable: never allocated, its pod Pending
        busy = create("busy", "running", "n")
        running = api.request("GET", "/api/v1/namespaces/team/pods/running")
        allocate(busy, {"resource": "pods", "name": "running", "uid": running["metadata"]["uid"]}, hold())
        assert uninstall(api, "scrubgate-system", 0, sleep=lambda _: None) == 0, capsys.readouterr().err
        never, busy = (api.request("GET", f"{claims}/{n}") for n in ("never", "busy"))
        assert names.FINALIZER not in never["metadata"].get("finalizers", [])
        assert names.FINALIZER not in busy["metadata"].get("finalizers", [])
        assert [r["resource"] for r in busy["status"]["reservedFor"]] == ["pods"], "the hold is gone"

        ended = create("ended", "gone", "n")
        allocate(api.request("GET", f"{claims}/ended"), hold())  # the pod ended: the controller dropped it
        assert ended["metadata"]["finalizers"] == [names.FINALIZER]
        assert uninstall(api, "scrubgate-system", 0, sleep=lambda _: None) == 1
        assert "claim team/ended: teardown pending" in capsys.readouterr().err
        assert api.request("GET", f"{claims}/ended")["metadata"]["finalizers"] == [names.FINALIZER]
