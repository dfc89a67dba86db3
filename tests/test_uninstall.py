"""`scrubgate uninstall` against a stand-in API server: what it waits for, the order it removes things in, and
that a teardown starting while the agents stop leaves the guard in place. The whole path on kube-apiserver is
tests/test_e2e_fence_paths.py::test_uninstall_waits_for_the_pending_teardown_then_leaves_nothing_of_scrubgates."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from scrubgate.policies import names

from scrubgate.cluster import ApiError
from scrubgate.uninstall import in_use, uninstall

DRA = "/apis/resource.k8s.io/v1"
DAEMONSET = "/apis/apps/v1/namespaces/scrubgate-system/daemonsets/scrubgate-agent"
AGENT_LABELS = {"app.kubernetes.io/name": "scrubgate", "app.kubernetes.io/component": "agent"}


def claim(name: str, *, reserved: tuple[str, ...] = (), finalizers: tuple[str, ...] = (names.FINALIZER,)) -> dict:
    return {
        "metadata": {"namespace": "team", "name": name, "uid": name, "finalizers": list(finalizers)},
        "status": {"reservedFor": [{"resource": "pods", "name": p, "uid": p} for p in reserved]},
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
            if method == "PUT":
                store[name] = copy.deepcopy({k: v for k, v in body.items() if k not in ("apiVersion", "kind")})
            return copy.deepcopy(store[name])
        if method == "DELETE":
            del self.objects[collection][name]
            return {}
        raise AssertionError(f"unexpected {method} {path}")


def webhook(api: FakeApi) -> None:
    for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        api.objects[f"/apis/admissionregistration.k8s.io/v1/{kind}"]["scrubgate"] = {"metadata": {"name": "scrubgate"}}


def test_a_claim_reserved_for_an_ended_pod_is_a_pending_teardown() -> None:
    """SG007 keeps the ended pod in reservedFor until the attestation."""
    assert in_use(claim("c", reserved=("p",)), {"p"})
    assert not in_use(claim("c", reserved=("p",)), set())
    assert not in_use(claim("c"), {"p"})
    group = claim("g")
    group["status"]["reservedFor"] = [{"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "uid": "g"}]
    assert in_use(group, set())
    deleted = claim("d", reserved=("p",))
    deleted["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    assert not in_use(deleted, {"p"})


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
    assert "the guard is gone, but scrubgate.dev/sanitize could not be removed" in err
    assert "claim team/busy: PUT .../busy: HTTP 403" in err and "kubectl edit resourceclaim" in err
