"""The lifecycle end to end, in every resource.k8s.io version the API server serves: real webhook, real agent,
real control plane, as separate processes (devcluster.harness). A tenant's Job writes a canary; the device is
kept by the claim's own allocation (no DeviceTaintRule), scrubbed, attested and released; the next tenant gets
the same device only after the attestation and finds nothing; what a tenant must not do is denied and
audited."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import e2e_support
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from e2e_support import (
    allocated_device,
    assert_invariant,
    canary_found,
    claim_history,
    create_template,
    expect_denied,
    fence_history,
    patch_claim,
    running_claim,
    tenant_job,
    tenant_namespace,
    tenant_pod,
    verified_attestation,
    wait_gone,
    wait_phase,
)
from scrubgate.policies import names
from scrubgate.policies.attestation import sign

from devcluster import workloads
from devcluster.harness import (
    Cluster,
    Observed,
    denial,
    invariant_violations,
)
from devcluster.observer import first_rv, is_allocated, is_attested

# The `cluster_factory` and `cluster` fixtures.
cluster_factory_fixture = e2e_support.cluster_factory_fixture
cluster_fixture = e2e_support.cluster_fixture

CANARY = "TENANT-A-SECRET-0451"
RETAIN = {names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN}


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One installation for the four versions (each test cleans up after itself): 2 simulated GPUs."""
    with Cluster(tmp_path_factory.mktemp("lifecycle"), gpus=2).start() as cluster:
        yield cluster


@pytest.fixture
def lifecycle_cluster(shared_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    yield shared_cluster
    request.node.add_report_section("teardown", "devcluster logs", shared_cluster.diagnostics(60))


def first(events: list[Observed], predicate: Callable[[Observed], bool]) -> int:
    rv = first_rv(events, predicate)
    assert rv is not None, "the observer never saw the event this test is about"
    return rv


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", workloads.VERSIONS)
def test_lifecycle(lifecycle_cluster: Cluster, version: str) -> None:
    cluster = lifecycle_cluster
    ns_a, ns_b = tenant_namespace(cluster, "team-a"), tenant_namespace(cluster, "team-b")
    if version not in cluster.served_versions():
        # A version this release no longer serves claims in (v1alpha3 keeps only DeviceTaintRule): the API
        # server itself refuses it, so no workload can take that path around the webhook.
        status, _ = denial(lambda: create_template(cluster, "alice", ns_a, "one-gpu", version))
        assert status == 404, f"resource.k8s.io/{version} templates: HTTP {status}"
        return

    # A compliant Job: its pod takes a GPU through a template created in this version, and writes a canary.
    create_template(cluster, "alice", ns_a, "one-gpu", version)
    job_pod = tenant_job(cluster, "alice", ns_a, template="one-gpu", canary=CANARY, run_seconds=4)
    claim = running_claim(cluster, ns_a, job_pod)
    uid, device = claim["metadata"]["uid"], allocated_device(claim)
    uuid = cluster.device_uuid(device[2])
    assert names.FINALIZER in claim["metadata"]["finalizers"], "the mutating webhook did not add the finalizer"
    assert CANARY.encode() in cluster.gpu_memory(uuid), "the tenant's canary did not reach device memory"

    # The next tenant asks for exactly that device (its template also in this version).
    create_template(cluster, "bob", ns_b, "same-gpu", version, selectors=[workloads.uuid_selector(uuid)])
    tenant_pod(cluster, "bob", ns_b, "next", template="same-gpu", look_for=CANARY)

    wait_phase(cluster, ns_a, job_pod, "Succeeded")
    wait_gone(cluster, ns_a, claim["metadata"]["name"])
    next_pod = wait_phase(cluster, ns_b, "next", "Running")
    next_claim = running_claim(cluster, ns_b, "next")
    assert allocated_device(next_claim) == device, "the next tenant did not get the device the Job used"
    assert canary_found(next_pod) is False, "the next tenant found the previous tenant's canary"
    assert CANARY.encode() not in cluster.gpu_memory(uuid)

    # The release was attested for this claim and device, and everything happened in the right order.
    payload = verified_attestation(cluster, uid)
    assert payload["claim"]["uid"] == uid and payload["node"] == cluster.node
    assert [(d["driver"], d["pool"], d["device"], d["verified"]) for d in payload["devices"]] == [(*device, True)]
    history = claim_history(cluster, uid)
    allocated = first(history, is_allocated)
    attested = first(history, is_attested)
    deallocated = first(history, lambda e: e.rv > allocated and (e.type == "DELETED" or not is_allocated(e)))
    deleted = first(history, lambda e: e.type == "DELETED")
    reallocated = first(claim_history(cluster, next_claim["metadata"]["uid"]), is_allocated)
    # The claim's allocation is the fence: it goes only once the attestation is on the claim.
    assert allocated < attested < deallocated < reallocated, (allocated, attested, deallocated, reallocated)
    assert attested < deleted
    assert fence_history(cluster, uid) == [], "no DeviceTaintRule while the allocation holds the device"

    # What a tenant must not do, in this version: each denied with its rule and audited.
    retain = {"claim_annotations": RETAIN}
    tolerating = {"tolerations": [{"key": names.TAINT_UNSANITIZED, "operator": "Exists"}]}
    finalizers = next_claim["metadata"]["finalizers"]
    strip = [
        {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in finalizers if f != names.FINALIZER]}
    ]
    claim_b = next_claim["metadata"]["name"]
    denied = {
        ("SG001", "keep"): lambda: create_template(cluster, "bob", ns_b, "keep", version, **retain),
        ("SG005", "ignore-fence"): lambda: create_template(cluster, "bob", ns_b, "ignore-fence", version, **tolerating),
        ("SG007", claim_b): lambda: patch_claim(cluster, "bob", ns_b, claim_b, strip, version),
        ("SG008", "next"): lambda: cluster.core("bob").delete_namespaced_pod("next", ns_b, grace_period_seconds=0),
    }
    for (rule, name), call in denied.items():
        expect_denied(call, rule)
        records = cluster.audit_denials(rule, namespace=ns_b, name=name, user="bob")
        assert records, f"no audit record of the {rule} denial of {ns_b}/{name}"
        assert records[-1]["groups"] and records[-1]["dryRun"] is False

    # bob leaves the proper way; his claim is torn down and attested too, leaving the cluster clean.
    cluster.core("bob").delete_namespaced_pod("next", ns_b)
    wait_gone(cluster, ns_b, next_claim["metadata"]["name"])
    verified_attestation(cluster, next_claim["metadata"]["uid"])
    assert_invariant(cluster)


# ---------------------------------------------------------------------- the checks the lifecycle relies on


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_each_process_can_be_killed_and_restarted(cluster: Cluster) -> None:
    """The harness's own controls, which the fault tests build on: kill -9 and restart the agent and
    kube-apiserver mid-claim, take the webhook away (failurePolicy Fail denies), rotate its certificate and
    restart it; the claim is still torn down and attested, and the audit chain survives."""
    ns = tenant_namespace(cluster, "ops")
    create_template(cluster, "alice", ns, "one-gpu")
    claim = running_claim(cluster, ns, tenant_pod(cluster, "alice", ns, "p", template="one-gpu", canary=CANARY))
    assert cluster.agent.kill() == -9 and not cluster.agent.running
    cluster.agent.start()
    cluster.wait_agent_ready()
    cluster.restart_api(crash=True)
    assert cluster.api.starts == 2 and cluster.pod(ns, "p")["status"]["phase"] == "Running"
    cluster.set_webhook_port(None)
    status, message = denial(lambda: create_template(cluster, "alice", ns, "unchecked"))
    assert status == 500 and "failed calling webhook" in message
    cluster.set_webhook_port(cluster.webhook_port)
    expect_denied(lambda: create_template(cluster, "alice", ns, "keep", claim_annotations=RETAIN), "SG001")
    cluster.rotate_webhook_cert()
    cluster.webhook.restart()
    cluster.wait_webhook_ready()
    expect_denied(lambda: create_template(cluster, "alice", ns, "keep", claim_annotations=RETAIN), "SG001")
    assert len(cluster.audit_denials("SG001", namespace=ns, name="keep")) == 2
    cluster.core("alice").delete_namespaced_pod("p", ns)
    wait_gone(cluster, ns, claim["metadata"]["name"])
    verified_attestation(cluster, claim["metadata"]["uid"])
    assert CANARY.encode() not in cluster.gpu_memory(cluster.device_uuid(allocated_device(claim)[2]))
    assert_invariant(cluster)


def _claim(uid: str, device: str | None, finalizers: list[str], token: str | None = None) -> dict:
    annotations = {names.ANNOTATION_DEVICES: f'[{{"driver":"d","pool":"p","device":"{device or "g0"}"}}]'}
    if token:
        annotations[names.ANNOTATION_ATTESTATION] = token
    claim: dict = {
        "metadata": {"namespace": "t", "name": uid, "uid": uid, "finalizers": finalizers, "annotations": annotations}
    }
    if device:
        claim["status"] = {
            "allocation": {"devices": {"results": [{"driver": "d", "pool": "p", "device": device}]}},
            "reservedFor": [{"resource": "pods", "name": f"pod-{uid}", "uid": f"pod-{uid}"}],
        }
    return claim


def _pod(uid: str, node: str | None = "n") -> dict:
    return {"metadata": {"namespace": "t", "name": uid, "uid": uid}, "spec": {"nodeName": node} if node else {}}


def _token(key: Ed25519PrivateKey, uid: str, verified: bool = True) -> str:
    payload = {
        "v": 1,
        "claim": {"namespace": "t", "name": uid, "uid": uid},
        "node": "n",
        "devices": [{"driver": "d", "pool": "p", "device": "g0", "verified": verified}],
    }
    return sign(payload, key, "k")


def test_the_invariant_check_sees_a_dirty_allocation_and_an_unattested_release() -> None:
    key = Ed25519PrivateKey.generate()
    keys = {"k": key.public_key()}
    fin = [names.FINALIZER]

    def stream(*claims: tuple[str, dict], bound: tuple[str, ...] = ("pod-a", "pod-b")) -> list[Observed]:
        """The claims' changes, after the pods that used them were bound to a node."""
        pods = [Observed(rv, "pods", "ADDED", _pod(uid)) for rv, uid in enumerate(bound, 1)]
        return pods + [
            Observed(rv, "resourceclaims", kind, copy.deepcopy(obj))
            for rv, (kind, obj) in enumerate(claims, len(pods) + 1)
        ]

    clean = stream(
        ("ADDED", _claim("a", "g0", fin)),
        ("MODIFIED", _claim("a", None, fin, _token(key, "a"))),
        ("DELETED", _claim("a", None, fin, _token(key, "a"))),
        ("ADDED", _claim("b", "g0", fin)),
    )
    assert invariant_violations(clean, keys) == []
    dirty = stream(
        ("ADDED", _claim("a", "g0", fin)), ("MODIFIED", _claim("a", None, fin)), ("ADDED", _claim("b", "g0", fin))
    )
    assert [v for v in invariant_violations(dirty, keys) if "allocated to claim t/b" in v]
    unverified = stream(
        ("ADDED", _claim("a", "g0", fin)),
        ("MODIFIED", _claim("a", None, fin, _token(key, "a", verified=False))),
        ("DELETED", _claim("a", None, fin, _token(key, "a", verified=False))),
        ("ADDED", _claim("b", "g0", fin)),
    )
    found = invariant_violations(unverified, keys)
    assert any("removed from claim t/a" in v for v in found) and any("allocated to claim t/b" in v for v in found)
    replayed = stream(("ADDED", _claim("a", "g0", fin)), ("DELETED", _claim("a", None, fin, _token(key, "other"))))
    assert any("removed from claim t/a" in v for v in invariant_violations(replayed, keys))
    # The allocation of a guarded claim cleared before an attestation covers it: caught at that very change.
    early = stream(("ADDED", _claim("a", "g0", fin)), ("MODIFIED", _claim("a", None, fin)))
    assert [v for v in invariant_violations(early, keys) if "claim t/a (uid a) deallocated while d/p/g0" in v]
    glass = _claim("a", None, fin)
    glass["metadata"]["annotations"][names.ANNOTATION_BREAK_GLASS] = "node lost"
    assert invariant_violations(stream(("ADDED", _claim("a", "g0", fin)), ("MODIFIED", glass)), keys) == []
    # An allocation no pod ever ran with holds no tenant's data: kube-scheduler's PostFilter may clear it, and
    # the device go to another claim, unattested.
    unused = stream(
        ("ADDED", _claim("a", "g0", fin)),
        ("MODIFIED", _claim("a", None, fin)),
        ("ADDED", _claim("b", "g0", fin)),
        bound=("pod-b",),
    )
    assert invariant_violations(unused, keys) == []
    # kube-scheduler deleting its extended-resource claim after a failed binding: allocated, reserved for a
    # pod never bound, gone with the finalizer and no attestation. A used claim going that way still counts.
    deleted_unused = [("ADDED", _claim("a", "g0", fin)), ("DELETED", _claim("a", "g0", fin))]
    assert invariant_violations(stream(*deleted_unused, bound=("pod-b",)), keys) == []
    assert any("removed from claim t/a" in v for v in invariant_violations(stream(*deleted_unused), keys))
    # ... and its pod, bound at the next attempt with the scheduler's new claim, did not use the first one.
    rebound = [
        Observed(1, "resourceclaims", "ADDED", _claim("a", "g0", fin)),
        Observed(2, "resourceclaims", "DELETED", _claim("a", "g0", fin)),
        Observed(3, "pods", "ADDED", _pod("pod-a")),
        Observed(4, "resourceclaims", "ADDED", _claim("b", "g0", fin)),
    ]
    assert invariant_violations(rebound, keys) == []
