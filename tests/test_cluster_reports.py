"""`scrubgate check --cluster`, `--format policyreport` and the `scrubgate reports` rounds, over an
in-memory API (tests/kube_fake.py)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kube_fake import FakeApi
from scrubgate.policies.config import load_policy
from test_manifests import kustomize

from scrubgate import __version__, cli, reports
from scrubgate.check import run_check
from scrubgate.cluster import CHECKED_KINDS, ApiError, KubeApi, check_cluster, read_cluster
from scrubgate.cluster import NAMESPACES as NAMESPACE_KIND
from scrubgate.mirror import Mirror, entry
from scrubgate.policyreport import OPENREPORTS, build_reports
from scrubgate.rechecks import Rechecks

CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
PODS = "/api/v1/pods"
NAMESPACES = "/api/v1/namespaces"
POLICY_REPORTS = "/apis/wgpolicyk8s.io/v1alpha2/policyreports"


def claim(namespace: str, name: str, *, retain: bool = False, finalizer: bool = True) -> dict:
    meta: dict = {"namespace": namespace, "name": name, "uid": f"uid-{namespace}-{name}"}
    if retain:
        meta["annotations"] = {"scrubgate.dev/deallocation-policy": "Retain"}
    if finalizer:
        meta["finalizers"] = ["scrubgate.dev/sanitize"]
    return {
        "metadata": meta,
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }


def namespace(name: str, trusted: bool = False) -> dict:
    return {"metadata": {"name": name, "labels": {"scrubgate.dev/tenancy": "trusted"} if trusted else {}}}


@pytest.fixture
def api() -> FakeApi:
    """Objects created before the webhook: a Retain claim in a multi-tenant namespace (SG001), a claim
    without the finalizer (SG004), the same Retain claim in a trusted namespace (allowed), and a bad
    claim in kube-system (left alone, as the webhooks leave it)."""
    fake = FakeApi()
    for ns in (namespace("team-a"), namespace("lab", trusted=True), namespace("kube-system")):
        fake.add(NAMESPACES, ns)
    fake.add(CLAIMS, claim("team-a", "sticky", retain=True))
    fake.add(CLAIMS, claim("team-a", "old", finalizer=False))
    fake.add(CLAIMS, claim("lab", "sticky", retain=True))
    fake.add(CLAIMS, claim("kube-system", "sticky", retain=True))
    for i in range(5):
        fake.add(PODS, {"metadata": {"namespace": "team-a", "name": f"web-{i}"}, "spec": {"containers": []}})
    return fake


def findings(result) -> set[tuple[str, str, str]]:
    return {
        (c.document.obj["metadata"]["namespace"], c.document.obj["metadata"]["name"], f.rule)
        for c in result.objects
        for f in c.findings
    }


def test_check_cluster_reports_what_was_there_before_the_webhook(api):
    result, notes = check_cluster(api, load_policy(None))
    assert findings(result) == {("team-a", "sticky", "SG001"), ("team-a", "old", "SG004")}
    assert notes == []
    assert result.exit_code == 1  # SG001 denies
    assert api.writes() == []  # read-only


def test_a_gpu_device_class_outside_the_policy_goes_to_the_cluster_report(api):
    """SG009 in a cluster: a DeviceClass the policy excludes (its claims skip every guard) whose selectors do not
    prove it hands out no GPU memory (created while no webhook ran) is found, and reported cluster-wide; a class
    that may hand out GPUs under any other name is guarded, no finding."""
    selector = {"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}
    for name in ("h100-80gb", "imex.nvidia.com"):
        api.add(
            "/apis/resource.k8s.io/v1/deviceclasses", {"metadata": {"name": name}, "spec": {"selectors": [selector]}}
        )
    result, _ = check_cluster(api, load_policy(None))
    classes = [
        (c.document.obj["metadata"]["name"], [f.rule for f in c.findings])
        for c in result.objects
        if c.document.obj["kind"] == "DeviceClass"
    ]
    assert sorted(classes) == [("h100-80gb", []), ("imex.nvidia.com", ["SG009"])]
    cluster_report = build_reports(result)[""]
    assert cluster_report["kind"] == "ClusterPolicyReport"
    assert [(r["rule"], r["resources"][0]["kind"], r["resources"][0]["name"]) for r in cluster_report["results"]] == [
        ("SG009", "DeviceClass", "imex.nvidia.com")
    ]


def test_a_stored_claims_agent_annotations_are_not_a_finding_as_in_a_manifest(api, tmp_path):
    """The agent writes scrubgate.dev/devices and scrub-status on the claims it tears down; in the cluster that
    is its job, in a manifest it is a forgery (SG007)."""
    torn_down = claim("team-a", "in-use")
    torn_down["metadata"]["annotations"] = {
        "scrubgate.dev/devices": '[{"driver":"gpu.nvidia.com","pool":"n","device":"gpu-0"}]',
        "scrubgate.dev/scrub-status": "fenced",
    }
    api.add(CLAIMS, torn_down)
    result, _ = check_cluster(api, load_policy(None))
    assert ("team-a", "in-use", "SG007") not in findings(result)
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", **torn_down}))
    checked = run_check([str(manifest)], load_policy(None))
    assert [f.rule for o in checked.objects for f in o.findings] == ["SG007"]


def test_lists_are_paginated_with_limit_and_continue(api):
    snapshot = read_cluster(api, page_size=2)
    pod_calls = [query for method, path, query in api.calls if path == PODS]
    assert [q.get("continue") for q in pod_calls] == [None, "2", "4"]
    assert all(q["limit"] == "2" for q in pod_calls)
    assert sum(1 for kind, _ in snapshot.objects if kind.kind == "Pod") == 5
    # List items come without apiVersion and kind; the engine gets both.
    assert {(o["apiVersion"], o["kind"]) for kind, o in snapshot.objects if kind.plural == "resourceclaims"} == {
        ("resource.k8s.io/v1", "ResourceClaim")
    }


def test_the_served_dra_version_is_the_one_listed():
    api = FakeApi(dra_versions=("v1beta2", "v1beta1"))
    api.add("/apis/resource.k8s.io/v1beta2/resourceclaims", claim("team-a", "sticky", retain=True))
    result, _ = check_cluster(api, load_policy(None))
    assert findings(result) == {("team-a", "sticky", "SG001")}


def test_a_cluster_without_dra_is_checked_without_claims():
    api = FakeApi(dra_versions=())
    result, notes = check_cluster(api, load_policy(None))
    assert result.objects == [] and result.exit_code == 0
    assert notes and "claims not checked" in notes[0]
    assert not any("resource.k8s.io/" in path for _, path, _ in api.calls)


def test_policyreports_follow_the_v1alpha2_crd(api):
    result, _ = check_cluster(api, load_policy(None))
    moment = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
    built = build_reports(result, moment)
    assert set(built) == {"", "team-a"}
    cluster, team = built[""], built["team-a"]
    assert (cluster["kind"], cluster["results"], "namespace" in cluster["metadata"]) == (
        "ClusterPolicyReport",
        [],
        False,
    )
    assert team["kind"] == "PolicyReport" and team["metadata"]["namespace"] == "team-a"
    assert team["summary"] == {"pass": 0, "fail": 1, "warn": 1, "error": 0, "skip": 0}
    sg001 = next(r for r in team["results"] if r["rule"] == "SG001")
    assert sg001["result"] == "fail" and sg001["severity"] == "high" and sg001["policy"] == "scrubgate"
    assert sg001["resources"] == [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "name": "sticky",
            "namespace": "team-a",
            "uid": "uid-team-a-sticky",
        }
    ]
    assert sg001["timestamp"] == {"seconds": int(moment.timestamp()), "nanos": 0}
    assert all(isinstance(v, str) for v in sg001["properties"].values())


def test_reports_are_created_kept_updated_and_deleted(api):
    policy = load_policy(None)
    _, done = reports.reconcile(api, policy)
    assert done == {"": "created", "team-a": "created"}
    first = api.request("GET", "/apis/wgpolicyk8s.io/v1alpha2/namespaces/team-a/policyreports/scrubgate")
    api.calls.clear()
    time.sleep(1.1)  # a later second: only a changed result may carry a new timestamp
    _, done = reports.reconcile(api, policy)
    assert done == {"": "unchanged", "team-a": "unchanged"} and api.writes() == []
    # A new finding: the report is updated, the old results keep the time they were first found.
    api.add(CLAIMS, claim("team-a", "another", retain=True))
    _, done = reports.reconcile(api, policy)
    assert done["team-a"] == "updated"
    second = api.request("GET", "/apis/wgpolicyk8s.io/v1alpha2/namespaces/team-a/policyreports/scrubgate")
    old_times = {r["resources"][0]["name"] + r["rule"]: r["timestamp"] for r in first["results"]}
    for result in second["results"]:
        key = result["resources"][0]["name"] + result["rule"]
        if key in old_times:
            assert result["timestamp"] == old_times[key]
        else:
            assert result["timestamp"]["seconds"] > next(iter(old_times.values()))["seconds"]
    # The namespace's violations are fixed: its report goes.
    api.collections[CLAIMS] = [c for c in api.collections[CLAIMS] if c["metadata"]["namespace"] != "team-a"]
    _, done = reports.reconcile(api, policy)
    assert done == {"": "unchanged", "team-a": "deleted"}
    assert api.collections[POLICY_REPORTS] == []


def rounds(api: FakeApi, until: Callable[[], bool], what: str) -> None:
    """reports.run_rounds (an hour between lists, no quiet period) until `until()`, then stopped."""
    stop, changed = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=reports.run_rounds, args=(api, None, 3600.0, stop), kwargs={"quiet_s": 0.0, "changed": changed}
    )
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not until():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)
    finally:
        stop.set()
        changed.set()
        thread.join(timeout=20)
    assert not thread.is_alive(), "run_rounds did not stop"


class StopDuringCheck(threading.Event):
    """A stop that SIGTERM sets at the worst moment: just after the loop read it as unset."""

    def __init__(self, changed: threading.Event) -> None:
        super().__init__()
        self.changed, self.reads = changed, 0

    def is_set(self) -> bool:
        seen = super().is_set()
        self.reads += 1
        if self.reads == 1:
            self.set()
            self.changed.set()
        return seen


def test_a_stop_right_after_the_loop_read_it_still_ends_the_wait(api):
    changed = threading.Event()
    stop = StopDuringCheck(changed)
    thread = threading.Thread(
        target=reports.run_rounds,
        args=(api, None, 3600.0, stop),
        kwargs={"quiet_s": 0.0, "changed": changed},
        daemon=True,  # a lost stop would otherwise hold pytest for the hour
    )
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the stop was lost: run_rounds waits out its hour"


def lists_of_namespaces(api: FakeApi) -> int:
    return sum(1 for m, p, _ in api.calls if (m, p) == ("GET", NAMESPACES))


def test_a_change_is_reported_from_the_watch_without_listing_again(api):
    """Between full lists, the watches keep the objects current: a claim added and one deleted change the
    reports at once, and no kind is listed again."""
    added = claim("team-b", "late", retain=True)
    added["metadata"]["resourceVersion"] = "900"
    api.add(NAMESPACES, namespace("team-b"))
    gone = {**claim("team-a", "sticky", retain=True), "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim"}
    api.events[CLAIMS] = [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "899"}}},
                          {"type": "ADDED", "object": added}, {"type": "DELETED", "object": gone}]  # fmt: skip
    report = "/apis/wgpolicyk8s.io/v1alpha2/namespaces/team-b/policyreports/scrubgate"

    def reported() -> bool:
        try:
            api.request("GET", report)
        except ApiError:
            return False
        return True

    rounds(api, reported, "no report of the claim the watch added")
    assert lists_of_namespaces(api) == 1
    watches = [q for m, p, q in api.calls if (m, p) == ("WATCH", CLAIMS)]
    assert watches[0]["watch"] == "true" and watches[0]["resourceVersion"]
    team_a = api.request("GET", "/apis/wgpolicyk8s.io/v1alpha2/namespaces/team-a/policyreports/scrubgate")
    assert {(r["resources"][0]["name"], r["rule"]) for r in team_a["results"]} == {("old", "SG004")}


def test_a_watch_that_breaks_off_lists_again(api):
    api.events[PODS] = [{"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}]
    rounds(api, lambda: lists_of_namespaces(api) >= 2, "no new list after the watch's 410")


def test_sigterm_ends_reports_as_pid_1_would_need(api, monkeypatch):
    """In a container the process is PID 1, which SIGTERM does not end unless it handles it: `reports` does, and
    stops within a moment rather than the pod's grace period."""
    monkeypatch.setattr(reports.KubeApi, "connect", classmethod(lambda cls, *a: api))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    args = argparse.Namespace(
        kubeconfig=None, context=None, once=False, policy=None, interval=3600.0, api="wgpolicyk8s.io"
    )
    # SIGTERM once the first round's list is made: the run is then in its hour's wait, which it must leave.
    sender = threading.Thread(target=term_after_first_list, args=(api,), daemon=True)
    sender.start()
    try:
        assert reports.run(args) == 0
    finally:
        sender.join(timeout=30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert lists_of_namespaces(api) == 1, "stopped in its wait, before any second round"


def term_after_first_list(api: FakeApi) -> None:
    while not lists_of_namespaces(api):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)


def test_check_cluster_cli(api, monkeypatch, capsys):
    connected = []
    monkeypatch.setattr(KubeApi, "connect", classmethod(lambda cls, kc, ctx: connected.append((kc, ctx)) or api))
    code = cli.main(["check", "--cluster", "--kubeconfig", "kc.yaml", "--context", "lab", "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and connected == [("kc.yaml", "lab")]
    assert {(f["object"]["name"], f["rule"]["id"]) for f in out["findings"]} == {("sticky", "SG001"), ("old", "SG004")}
    assert cli.main(["check", "--cluster", "--format", "policyreport"]) == 1
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ClusterPolicyReport", "PolicyReport"]


def test_check_cluster_refuses_paths_and_fix(capsys):
    assert cli.main(["check", "--cluster", "manifests/"]) == 2
    assert "--cluster reads the cluster only" in capsys.readouterr().err
    assert cli.main(["check", "--kubeconfig", "kc.yaml", "manifests/"]) == 2


REPORTS_COMPONENT = Path(__file__).resolve().parents[1] / "manifests" / "components" / "reports"


def component_docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((REPORTS_COMPONENT / name).read_text()) if d]


def test_reports_validate_against_the_shipped_crds(api):
    result, _ = check_cluster(api, load_policy(None))
    schemas = {
        crd["spec"]["names"]["kind"]: crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for crd in component_docs("crds.yaml")
    }
    built = build_reports(result)
    for report in built.values():
        jsonschema.validate(report, schemas[report["kind"]])
    broken = {**built["team-a"], "results": [{**built["team-a"]["results"][0], "result": "deny"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schemas["PolicyReport"])


def test_the_reports_role_lists_and_watches_every_kind_it_reads():
    role = next(d for d in component_docs("rbac.yaml") if d["kind"] == "ClusterRole")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for kind in (NAMESPACE_KIND, *CHECKED_KINDS):
        assert {(kind.group, kind.plural, "list"), (kind.group, kind.plural, "watch")} <= granted, kind
    assert not {verb for group, _, verb in granted if group not in ("wgpolicyk8s.io", "openreports.io")} - {
        "list",
        "watch",
    }


@pytest.mark.parametrize("name", ["crds.yaml", "rbac.yaml", "deployment.yaml"])
def test_reports_component_validates(name):
    for doc in component_docs(name):
        kubernetes_validate.validate(doc, "1.34", strict=True)


def test_reports_component_renders_with_the_base(tmp_path):
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    base, component = (os.path.relpath(p, overlay) for p in (REPORTS_COMPONENT.parents[1], REPORTS_COMPONENT))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [base], "components": [component]}))
    docs = kustomize(overlay)
    reports = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "scrubgate-reports")
    pod = reports["spec"]["template"]["spec"]
    policy = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("scrubgate-policy"))
    # The base's image tag and the base's (hashed) policy ConfigMap reach the reports Deployment too.
    assert pod["containers"][0]["image"].endswith(":" + __version__)
    assert pod["volumes"][0]["configMap"]["name"] == policy["metadata"]["name"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.34", strict=True)


def test_policyreport_format_for_files_in_ci(tmp_path, capsys):
    manifest = tmp_path / "claim.yaml"
    bad = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", **claim("x", "sticky", retain=True)}
    del bad["metadata"]["namespace"]  # created where kubectl points: reported in default
    manifest.write_text(yaml.safe_dump(bad))
    assert cli.main(["check", "--format", "policyreport", str(manifest)]) == 1
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(d["kind"], d["metadata"].get("namespace")) for d in docs] == [
        ("ClusterPolicyReport", None),
        ("PolicyReport", "default"),
    ]
    assert [r["rule"] for r in docs[1]["results"]] == ["SG001"]


def test_reports_without_the_crds_say_what_to_install():
    api = FakeApi(served=("/apis/resource.k8s.io", "/apis/apps/", "/apis/batch/"))
    with pytest.raises(ApiError, match=r"serves no wgpolicyk8s.io/v1alpha2 PolicyReports; install their CRDs.*--api"):
        reports.reconcile(api, load_policy(None))


def test_openreports_reports_for_kyverno_1_15_and_later(api):
    """The same results as openreports.io Reports and a ClusterReport (the API Kyverno 1.15+ uses), with the
    report's one source named at the top as that API has it."""
    policy = load_policy(None)
    _, done = reports.reconcile(api, policy, kinds=OPENREPORTS)
    assert done == {"": "created", "team-a": "created"}
    report = api.request("GET", "/apis/openreports.io/v1alpha1/namespaces/team-a/reports/scrubgate")
    assert (report["apiVersion"], report["kind"], report["source"]) == (
        "openreports.io/v1alpha1",
        "Report",
        "scrubgate",
    )
    assert {(r["rule"], r["resources"][0]["name"]) for r in report["results"]} == {
        ("SG001", "sticky"),
        ("SG004", "old"),
    }
    cluster = api.request("GET", "/apis/openreports.io/v1alpha1/clusterreports/scrubgate")
    assert cluster["kind"] == "ClusterReport"
    assert not [c for c in api.calls if "wgpolicyk8s.io" in c[1]], "nothing written to the other API"


# --- what reports holds, and what it checks again --------------------------------------------------------

DEPLOYMENTS = "/apis/apps/v1/deployments"
CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"


def gpu_pod(namespace: str, name: str, *, claim_name: str | None = None, grace: int = 60) -> dict:
    ref = {"resourceClaimName": claim_name} if claim_name else {"resourceClaimTemplateName": "gpu"}
    return {
        "metadata": {"namespace": namespace, "name": name, "uid": f"uid-{name}", "managedFields": [{"m": "x"}]},
        "spec": {
            "containers": [{"name": "main", "image": "trainer", "env": [{"name": "A", "value": "b" * 200}]}],
            "resourceClaims": [{"name": "gpu", **ref}],
            "terminationGracePeriodSeconds": grace,
        },
        "status": {"phase": "Running"},
    }


@pytest.fixture
def busy(api: FakeApi) -> FakeApi:
    """The fixture's cluster and: GPU pods, a short grace period (SG003), two pods of a trusted namespace naming
    one claim (SG002 across pods), a pod naming a claim, a Deployment of no device."""
    for i in range(3):
        api.add(PODS, gpu_pod("team-a", f"train-{i}", grace=5 if i == 0 else 60))
    api.add(PODS, gpu_pod("team-a", "named", claim_name="old"))
    for name in ("a", "b"):
        api.add(PODS, gpu_pod("lab", f"shared-{name}", claim_name="sticky"))
    api.add(PODS, gpu_pod("kube-system", "system", grace=5))
    web = {"metadata": {"namespace": "team-a", "name": "web"}, "spec": {"template": {"spec": {"containers": []}}}}
    api.add(DEPLOYMENTS, web)
    return api


def report_results(result) -> dict:
    """Each report's results, in an order of their own (a list's order is the API server's, by key)."""
    moment = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
    built = build_reports(result, moment).items()
    return {ns: sorted(json.dumps(x, sort_keys=True) for x in r["results"]) for ns, r in built}


def test_reports_find_what_check_cluster_finds_holding_only_what_may_matter(busy):
    """The slim, packed objects and the per-object findings give the reports `check --cluster` gives over the
    whole objects; pods of no device (the web pods), the Deployment of none and kube-system are not held."""
    policy = load_policy(None)
    whole, _ = check_cluster(busy, policy)
    mirror = Mirror()
    reports.list_into(busy, mirror)
    assert report_results(Rechecks().run(mirror, policy)) == report_results(whole)
    rules = {(r["resources"][0]["name"], r["rule"]) for rs in build_reports(whole).values() for r in rs["results"]}
    assert {("train-0", "SG003"), ("shared-a", "SG002"), ("shared-b", "SG002"), ("named", "SG002")} <= rules
    held = {key for path, key in mirror.refs() if path in (PODS, DEPLOYMENTS)}
    assert held == {("team-a", f"train-{i}") for i in range(3)} | {
        ("team-a", "named"),
        ("lab", "shared-a"),
        ("lab", "shared-b"),
    }


def test_only_what_changed_is_checked_again(busy):
    """After the first round each object is checked again only when it, or what its findings depend on, changed;
    and the findings are those of a check of everything."""
    policy = load_policy(None)
    mirror, rechecks = Mirror(), Rechecks()
    generation = reports.list_into(busy, mirror)
    rechecks.run(mirror, policy)
    assert rechecks.checked == len(mirror) - 3  # not the Namespaces

    def event(path: str, kind: str, obj: dict) -> None:
        assert mirror.apply(generation, path, {"type": kind, "object": obj})

    def run_and_compare() -> int:
        incremental = report_results(rechecks.run(mirror, policy))
        assert incremental == report_results(Rechecks().run(mirror, policy))
        return rechecks.checked

    assert run_and_compare() == 0, "nothing changed"
    event(PODS, "MODIFIED", gpu_pod("team-a", "train-1", grace=5))
    event(PODS, "MODIFIED", {**gpu_pod("team-a", "train-2"), "status": {"phase": "Succeeded"}})  # nothing read
    assert run_and_compare() == 1
    event(PODS, "ADDED", {"metadata": {"namespace": "team-a", "name": "web-9"}, "spec": {"containers": []}})
    assert run_and_compare() == 0, "a pod of no device is not held"
    event(CLAIMS, "MODIFIED", claim("team-a", "old", finalizer=True))
    assert run_and_compare() == 2, "the claim and the pod naming it"
    event(NAMESPACES, "MODIFIED", namespace("team-a", trusted=True))
    assert run_and_compare() == sum(1 for _, key in mirror.refs() if key[0] == "team-a")
    event(PODS, "DELETED", gpu_pod("team-a", "train-0"))
    assert run_and_compare() == 0
    event(CLASSES, "ADDED", {"metadata": {"name": "nic"}, "spec": {"selectors": []}})
    assert run_and_compare() == len(mirror) - 3, "a DeviceClass: every object but the Namespaces"
    policy = load_policy(None).model_copy(update={"admin_groups": ["other"]})
    assert run_and_compare() == len(mirror) - 3, "a new policy: everything"


def test_a_new_list_checks_again_only_what_differs(busy):
    policy = load_policy(None)
    mirror, rechecks = Mirror(), Rechecks()
    reports.list_into(busy, mirror)
    rechecks.run(mirror, policy)
    busy.collections[PODS] = [p for p in busy.collections[PODS] if p["metadata"]["name"] != "train-0"]
    old_generation = mirror.generation
    reports.list_into(busy, mirror)
    assert not mirror.apply(old_generation, PODS, {"type": "ADDED", "object": gpu_pod("team-a", "late")})
    rechecks.run(mirror, policy)
    assert rechecks.checked == 0  # train-0 went: its findings with it, nothing to validate
    assert ("team-a", "train-0") not in {key for _, key in mirror.refs(PODS)}
    assert all(key != ("team-a", "train-0") for _, key in rechecks.findings)


def test_an_object_sent_again_unchanged_is_no_change():
    """The packed form is the same bytes for the same content however the object was built (a list page and a
    watch event share strings differently), so that an unchanged object is not checked again."""
    name = "".join(["tr", "ain"])
    shared = gpu_pod("team-a", name, claim_name=name)  # one string object, named twice
    apart = gpu_pod("team-a", "".join(["tra", "in"]), claim_name="".join(["t", "rain"]))
    assert shared == apart
    assert entry({"apiVersion": "v1", "kind": "Pod", **shared}) == entry({"apiVersion": "v1", "kind": "Pod", **apart})
