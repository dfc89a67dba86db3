"""What the real control plane does that scrubgate's guards must hold against, end to end (devcluster.harness on
kube-apiserver, kube-controller-manager and kube-scheduler): a tenant's eviction (what `kubectl drain` sends),
the pod garbage collector after a node is deleted, a claim deleted while its pod still runs, a pod asking for
`nvidia.com/gpu` as an extended resource (the scheduler creates its claim), and kube-scheduler's PostFilter
facing a claim held for its scrub. After each: no device given to a new claim while dirty,
no finalizer removed without a valid attestation, the audit chain intact."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from e2e_support import (
    WAIT_S,
    allocated_device,
    assert_invariant,
    canary_found,
    create_template,
    expect_denied,
    running_claim,
    tenant_namespace,
    tenant_pod,
    verified_attestation,
    wait_gone,
    wait_phase,
)
from kubernetes.client.exceptions import ApiException
from scrubgate.policies import names

from devcluster import workloads
from devcluster.harness import Cluster, denial, wait_for
from devcluster.kubeapi import object_path

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

CANARY = "UPSTREAM-BEHAVIOUR-CANARY-5120"


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(tmp_path_factory.mktemp("kubernetes"), gpus=2).start() as cluster:
        yield cluster


@pytest.fixture
def cluster(shared_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    yield shared_cluster
    request.node.add_report_section("teardown", "devcluster logs", shared_cluster.diagnostics(60))
    shared_cluster.set_webhook_port(shared_cluster.webhook_port)
    for process in (shared_cluster.node_process, shared_cluster.agent):
        if not process.running:
            process.start()
    shared_cluster.wait_agent_ready()


def evict(cluster: Cluster, user: str, namespace: str, pod: str, grace: int | None = None) -> dict:
    """What `kubectl drain` (and `kubectl evict`) send: a policy/v1 Eviction, through pods/eviction."""
    body: dict = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
    if grace is not None:
        body["deleteOptions"] = {"gracePeriodSeconds": grace}
    return cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", body, user=user)


def next_tenant_finds_nothing(cluster: Cluster, namespace: str, uuid: str, device: tuple[str, str, str]) -> None:
    """bob asks for exactly that GPU; he gets it only once it is clean, and finds no canary."""
    create_template(cluster, "bob", namespace, "same-gpu", selectors=[workloads.uuid_selector(uuid)])
    tenant_pod(cluster, "bob", namespace, "next", template="same-gpu", look_for=CANARY)
    claim = running_claim(cluster, namespace, "next")
    assert allocated_device(claim) == device
    assert canary_found(cluster.pod(namespace, "next") or {}) is False, "the next tenant found the canary"
    cluster.core("bob").delete_namespaced_pod("next", namespace)
    wait_gone(cluster, namespace, claim["metadata"]["name"])


def test_a_tenants_eviction_cannot_force_delete_but_a_drain_is_scrubbed(cluster: Cluster) -> None:
    ns, next_ns = tenant_namespace(cluster, "evict"), tenant_namespace(cluster, "evict-next")
    create_template(cluster, "alice", ns, "one-gpu")
    tenant_pod(cluster, "alice", ns, "trainer", template="one-gpu", canary=CANARY)
    claim = running_claim(cluster, ns, "trainer")
    device = allocated_device(claim)
    # An eviction with grace period 0 is a force delete that no pod DELETE admission would see.
    expect_denied(lambda: evict(cluster, "alice", ns, "trainer", grace=0), "SG008")
    assert cluster.audit_denials("SG008", namespace=ns, user="alice")
    assert (cluster.pod(ns, "trainer") or {}).get("status", {}).get("phase") == "Running"
    # A drain's eviction with the pod's own grace period goes through; the device is scrubbed first.
    evict(cluster, "alice", ns, "trainer")
    wait_gone(cluster, ns, claim["metadata"]["name"])
    verified_attestation(cluster, claim["metadata"]["uid"])
    next_tenant_finds_nothing(cluster, next_ns, cluster.device_uuid(device[2]), device)
    assert_invariant(cluster)


@pytest.mark.timeout(300)
def test_pods_of_a_deleted_node_are_collected_and_their_devices_still_scrubbed(cluster: Cluster) -> None:
    """The node goes away (its kubelet stops, an admin deletes the Node): the pod GC marks its pods Failed and
    deletes them with grace 0. Their claims keep their devices allocated until the agent has scrubbed them."""
    ns = tenant_namespace(cluster, "podgc")
    create_template(cluster, "alice", ns, "one-gpu")
    tenant_pod(cluster, "alice", ns, "trainer", template="one-gpu", canary=CANARY)
    claim = running_claim(cluster, ns, "trainer")
    device = allocated_device(claim)
    uuid = cluster.device_uuid(device[2])
    cluster.agent.stop()
    cluster.node_process.stop()  # the kubelet is gone (its containers with it)
    cluster.request("DELETE", f"/api/v1/nodes/{cluster.node}")
    # kube-controller-manager's pod GC looks for orphaned pods every 20 s and quarantines them 40 s first.
    wait_for(lambda: cluster.pod(ns, "trainer") is None, WAIT_S * 4, f"the pod GC deleting {ns}/trainer")
    # No agent: the agent's hold, a consumer the resourceclaim controller keeps, leaves the allocation alone (the
    # controller attempts no deallocation: nothing refused, no retry, no backoff); /mutate puts its record of the
    # gone pod in the pod's place for the attestation to name (or, once the garbage collector deletes the claim,
    # which then takes no new entry, lets the drop through: the hold alone keeps it used).
    name = claim["metadata"]["name"]

    def dropped() -> dict | None:
        found = cluster.claim(ns, name) or {}
        reserved = (found.get("status") or {}).get("reservedFor") or []
        return found if all(r["resource"] != "pods" for r in reserved) else None

    held = wait_for(dropped, WAIT_S, f"the resourceclaim controller's drop of {ns}/trainer")
    assert held["status"].get("allocation"), "deallocated without a scrub"
    resources = {r["resource"] for r in held["status"]["reservedFor"]}
    assert names.RESERVATION_RESOURCE in resources, "held"
    assert resources <= {names.RESERVATION_RESOURCE, names.ENDED_POD_RESOURCE}
    assert not cluster.audit_denials("SG007", namespace=ns, name=name, subResource="status")
    assert CANARY.encode() in cluster.gpu_memory(uuid)
    cluster.node_process.start()  # the node comes back and registers again
    cluster.agent.start()
    wait_gone(cluster, ns, claim["metadata"]["name"])
    verified_attestation(cluster, claim["metadata"]["uid"])
    assert CANARY.encode() not in cluster.gpu_memory(uuid)
    assert_invariant(cluster)


def test_a_claim_deleted_while_its_pod_runs_is_not_scrubbed_under_it(cluster: Cluster) -> None:
    """Deletion is not release: the API server keeps the pod reserved and running; the agent waits for it."""
    ns = tenant_namespace(cluster, "deleting", trusted=True)  # a named claim: single-tenant namespaces only
    cluster.request(
        "POST", cluster.resource_path("resourceclaims", ns), workloads.resource_claim("shared-gpu"), user="alice"
    )
    body = workloads.pod("trainer", claim="shared-gpu", annotations=workloads.workload_annotations(canary=CANARY))
    cluster.core("alice").create_namespaced_pod(ns, body)
    claim = named_claim_running(cluster, ns, "trainer", "shared-gpu")
    uuid = cluster.device_uuid(allocated_device(claim)[2])
    wait_for(lambda: fenced(cluster, ns, "shared-gpu"), WAIT_S, "the fence")
    cluster.request("DELETE", cluster.resource_path("resourceclaims", ns, "shared-gpu"), user="alice")
    deleting = wait_for(
        lambda: (c := cluster.claim(ns, "shared-gpu")) and c["metadata"].get("deletionTimestamp") and c,
        WAIT_S,
        "the claim being deleted",
    )
    reserved = deleting["status"]["reservedFor"]
    assert [r["name"] for r in reserved if r["resource"] == "pods"] == ["trainer"]
    assert [r["name"] for r in reserved if r["resource"] == names.RESERVATION_RESOURCE] == [cluster.node], "held"
    # Through two of the agent's resyncs (--resync 5): still fenced, nothing attested, the pod's memory intact.
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        now = cluster.claim(ns, "shared-gpu") or {}
        assert scrub_status(now) == names.SCRUB_FENCED, f"scrubbed under a running pod: {scrub_status(now)}"
        assert names.ANNOTATION_ATTESTATION not in (now["metadata"].get("annotations") or {})
        assert CANARY.encode() in cluster.gpu_memory(uuid), "the running pod's memory was scrubbed under it"
        time.sleep(0.5)
    cluster.core("alice").delete_namespaced_pod("trainer", ns)
    wait_gone(cluster, ns, "shared-gpu")
    verified_attestation(cluster, claim["metadata"]["uid"])
    assert CANARY.encode() not in cluster.gpu_memory(uuid)
    assert_invariant(cluster)


def test_a_pod_asking_for_nvidia_com_gpu_is_guarded_like_any_gpu_claim(cluster: Cluster) -> None:
    """KEP-5004: no spec.resourceClaims; kube-scheduler creates the claim (DeviceClass gpu.nvidia.com has
    extendedResourceName nvidia.com/gpu) and names it in status.extendedResourceClaimStatus."""
    ns, next_ns = tenant_namespace(cluster, "extended"), tenant_namespace(cluster, "extended-next")
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer", "annotations": workloads.workload_annotations(canary=CANARY)},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 60,
            "containers": [{"name": "cuda", "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        },
    }
    cluster.core("alice").create_namespaced_pod(ns, body)
    wait_phase(cluster, ns, "trainer", "Running")
    name = wait_for(lambda: cluster.pod_claim(ns, "trainer"), WAIT_S, "the scheduler's claim")
    claim = cluster.claim(ns, name)
    assert claim is not None and names.FINALIZER in claim["metadata"]["finalizers"]
    device = allocated_device(claim)
    wait_for(lambda: fenced(cluster, ns, name), WAIT_S, "the fence")
    expect_denied(lambda: cluster.core("alice").delete_namespaced_pod("trainer", ns, grace_period_seconds=0), "SG008")
    cluster.core("alice").delete_namespaced_pod("trainer", ns)
    wait_gone(cluster, ns, name)
    verified_attestation(cluster, claim["metadata"]["uid"])
    next_tenant_finds_nothing(cluster, next_ns, cluster.device_uuid(device[2]), device)
    assert_invariant(cluster)


def refuse_binding(namespace: str, pod: str) -> list[dict]:
    """A ValidatingAdmissionPolicy (and its binding) refusing the scheduler's Binding of ``pod``: how a binding
    fails on a real cluster (a node gone, an admission check) without one here."""
    rule = {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods/binding"]}
    expression = f"object.metadata.name != '{pod}'"
    return workloads.admission_policy(f"refuse-binding-{namespace}", rule, expression, "binding refused", namespace)


def binding_refused(cluster: Cluster, namespace: str, pod: str, node: str | None = None) -> bool:
    """Whether the API server refuses a Binding of ``pod`` (a dry run: admission runs before the pod is looked
    up, so the answer is the policy's, or NotFound while it is not in force yet)."""
    target = {"name": node or cluster.node}
    body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod}, "target": target}
    try:
        cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods/{pod}/binding", body, query=[("dryRun", "All")])
    except ApiException as exc:
        return "binding refused" in (exc.body or "")
    return False


def test_the_schedulers_claim_of_a_failed_binding_does_not_hold_the_gpus(cluster: Cluster) -> None:
    """KEP-5004: kube-scheduler creates, allocates and reserves the claim of a pod asking for nvidia.com/gpu in
    PreBind; when the binding fails, its Unreserve removes delete-protection and deletes the claim. No container
    used it: /mutate takes the sanitize finalizer away in that update, so the claim goes and the pod's next
    attempt gets the GPUs (both of the node's: a claim left behind would hold them, and the pod Pending)."""
    ns = tenant_namespace(cluster, "unbound")
    refusal = refuse_binding(ns, "trainer")
    for doc in refusal:
        cluster.apply(doc)
    try:
        wait_for(lambda: binding_refused(cluster, ns, "trainer"), WAIT_S, "the Binding refusal in force")
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "trainer"},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 60,
                "containers": [{"name": "cuda", "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": "2"}}}],
            },
        }
        cluster.core("alice").create_namespaced_pod(ns, body)

        def failed_binding() -> bool:
            conditions = ((cluster.pod(ns, "trainer") or {}).get("status") or {}).get("conditions") or []
            return any("binding refused" in (c.get("message") or "") for c in conditions)

        wait_for(failed_binding, WAIT_S, "kube-scheduler's binding refused")
        wait_for(lambda: not cluster.claims(ns), WAIT_S, "the claim of the failed cycle deleted")
    finally:
        for doc in reversed(refusal):
            cluster.request("DELETE", object_path(doc))
    pod = wait_phase(cluster, ns, "trainer", "Running")
    assert pod["spec"]["nodeName"] == cluster.node
    released = [
        r
        for r in cluster.audit_records()
        if r.get("namespace") == ns and r.get("decision") == "audit" and r.get("user") == "system:kube-scheduler"
    ]
    assert released and "binding failed" in released[0]["findings"][0]["message"], released
    name = wait_for(lambda: cluster.pod_claim(ns, "trainer"), WAIT_S, "the scheduler's new claim")
    claim = cluster.claim(ns, name)
    assert claim is not None and names.FINALIZER in claim["metadata"]["finalizers"], "the used claim is guarded"
    cluster.core("alice").delete_namespaced_pod("trainer", ns)
    wait_gone(cluster, ns, name)
    verified_attestation(cluster, claim["metadata"]["uid"])
    assert_invariant(cluster)


def test_postfilter_does_not_clear_a_claim_held_for_its_scrub(cluster: Cluster) -> None:
    """A named claim whose pod ended while the agent was down: the agent's hold, a consumer the resourceclaim
    controller keeps, leaves the claim allocated and reserved for the hold and the ended pod (the controller
    attempts no deallocation). A new pod naming it, schedulable nowhere, does not make kube-scheduler's PostFilter clear
    it (PostFilter clears only claims reserved for nobody or the pending pod): the device stays allocated until
    the agent is back, scrubs, attests and releases it."""
    ns, next_ns = tenant_namespace(cluster, "postfilter", trusted=True), tenant_namespace(cluster, "pf-next")
    cluster.request(
        "POST", cluster.resource_path("resourceclaims", ns), workloads.resource_claim("named"), user="alice"
    )
    body = workloads.pod("first", claim="named", annotations=workloads.workload_annotations(canary=CANARY))
    cluster.core("alice").create_namespaced_pod(ns, body)
    claim = named_claim_running(cluster, ns, "first", "named")
    device = allocated_device(claim)
    uuid = cluster.device_uuid(device[2])
    wait_for(lambda: fenced(cluster, ns, "named"), WAIT_S, "the fence")
    cluster.agent.stop()
    cluster.core("alice").delete_namespaced_pod("first", ns)
    wait_for(lambda: cluster.pod(ns, "first") is None, WAIT_S, "the first pod gone")
    assert not cluster.audit_denials("SG007", namespace=ns, name="named", subResource="status"), "nothing refused"
    second = workloads.pod("second", claim="named")
    second["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "no-such-node"}
    cluster.core("alice").create_namespaced_pod(ns, second)
    wait_for(lambda: unschedulable(cluster, ns, "second"), WAIT_S, "the second pod unschedulable")
    create_template(cluster, "bob", next_ns, "same-gpu", selectors=[workloads.uuid_selector(uuid)])
    tenant_pod(cluster, "bob", next_ns, "next", template="same-gpu", look_for=CANARY)
    wait_for(lambda: unschedulable(cluster, next_ns, "next"), WAIT_S, "the next tenant turned away")
    held = cluster.claim(ns, "named") or {}
    assert allocated_device(held) == device, "the claim's dirty device was deallocated"
    assert sorted(r["name"] for r in held["status"]["reservedFor"]) == sorted([cluster.node, "first"])  # held
    assert CANARY.encode() in cluster.gpu_memory(uuid)
    cluster.core("alice").delete_namespaced_pod("second", ns)
    cluster.agent.start()  # scrubs, attests; the controller then deallocates
    pod = wait_phase(cluster, next_ns, "next", "Running", timeout=WAIT_S * 2)
    assert canary_found(pod) is False and CANARY.encode() not in cluster.gpu_memory(uuid)
    next_claim = running_claim(cluster, next_ns, "next")
    assert allocated_device(next_claim) == device
    cluster.core("bob").delete_namespaced_pod("next", next_ns)
    wait_gone(cluster, next_ns, next_claim["metadata"]["name"])
    cluster.request("DELETE", cluster.resource_path("resourceclaims", ns, "named"), user="alice")
    wait_gone(cluster, ns, "named")
    assert_invariant(cluster)


def named_claim_running(cluster: Cluster, namespace: str, pod: str, claim: str) -> dict:
    """The claim ``pod`` names (resourceClaimName), once the pod runs."""
    wait_phase(cluster, namespace, pod, "Running")
    found = cluster.claim(namespace, claim)
    assert found is not None, f"claim {namespace}/{claim} of running pod {pod} does not exist"
    return found


def test_with_the_webhook_down_gpu_pods_still_schedule_and_end(cluster: Cluster) -> None:
    """The matchConditions send only what a rule decides: the scheduler's allocation, the kubelet's status and
    final delete, the pod's graceful delete reach no webhook. Only the deallocation waits (fail closed), and the
    agent's writes, until the webhook is back; then the device is scrubbed and released as ever."""
    ns = tenant_namespace(cluster, "outage")
    create_template(cluster, "alice", ns, "one-gpu")
    body = workloads.pod("gated", template="one-gpu", annotations=workloads.workload_annotations(canary=CANARY))
    # Held until the outage: no node carries this label yet.
    body["spec"]["nodeSelector"] = {"scrubgate.test/outage": ns}
    cluster.core("alice").create_namespaced_pod(ns, body)
    name = wait_for(lambda: cluster.pod_claim(ns, "gated"), WAIT_S, "the pod's claim")  # created, mutated
    cluster.set_webhook_port(None)
    # What no rule decides does not wait on the webhook: a GPU pod's label, another vendor's device.
    relabel = {"metadata": {"labels": {"team": "a"}}}
    pod_path = f"/api/v1/namespaces/{ns}/pods/gated"
    cluster.request("PATCH", pod_path, relabel, user="alice", content_type="application/merge-patch+json")
    container = {"name": "c", "image": "example.com/fpga-job", "resources": {"limits": {"example.com/fpga": "1"}}}
    fpga = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "fpga"}, "spec": {"containers": [container]}}
    cluster.core("alice").create_namespaced_pod(ns, fpga)
    claims = cluster.resource_path("resourceclaims", ns)
    channel = workloads.resource_claim("channel")
    channel["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "imex.nvidia.com"
    cluster.request("POST", claims, channel, user="alice")  # a class the policy leaves out: no webhook
    status, message = denial(lambda: cluster.request("POST", claims, workloads.resource_claim("gpu"), user="alice"))
    assert status == 500 and "failed calling webhook" in message, message  # a GPU claim waits for its finalizer
    # What a rule decides does: a toleration added to a GPU pod (SG005) is refused while it is down.
    tolerate = {"spec": {"tolerations": [{"key": "scrubgate.dev/unsanitized", "operator": "Exists"}]}}
    status, message = denial(
        lambda: cluster.request(
            "PATCH", pod_path, tolerate, user="alice", content_type="application/strategic-merge-patch+json"
        )
    )
    assert status == 500 and "failed calling webhook" in message, message
    cluster.core("alice").delete_namespaced_pod("fpga", ns)
    label = {"metadata": {"labels": {"scrubgate.test/outage": ns}}}
    path = f"/api/v1/nodes/{cluster.node}"
    cluster.request("PATCH", path, label, content_type="application/merge-patch+json")
    wait_phase(cluster, ns, "gated", "Running")
    claim = cluster.claim(ns, name) or {}
    assert allocated_device(claim), "scheduled without an allocation"
    cluster.core("alice").delete_namespaced_pod("gated", ns)  # graceful: no webhook asked
    wait_for(lambda: cluster.pod(ns, "gated") is None, WAIT_S, "the pod's final delete")
    held = cluster.claim(ns, name) or {}
    assert (held.get("status") or {}).get("allocation"), "deallocated while the webhook was down"
    cluster.set_webhook_port(cluster.webhook_port)
    unlabel = {"metadata": {"labels": {"scrubgate.test/outage": None}}}
    cluster.request("PATCH", path, unlabel, content_type="application/merge-patch+json")
    wait_gone(cluster, ns, name, timeout=WAIT_S * 4)  # the agent's writes backed off while the webhook was down
    verified_attestation(cluster, claim["metadata"]["uid"])
    assert CANARY.encode() not in cluster.gpu_memory(cluster.device_uuid(allocated_device(claim)[2]))
    assert_invariant(cluster)


def scrub_status(claim: dict) -> str | None:
    return ((claim.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_SCRUB_STATUS)


def fenced(cluster: Cluster, namespace: str, name: str) -> bool:
    return scrub_status(cluster.claim(namespace, name) or {}) == names.SCRUB_FENCED


def unschedulable(cluster: Cluster, namespace: str, pod: str) -> bool:
    conditions = ((cluster.pod(namespace, pod) or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)


def test_the_observer_has_every_change_made_before_a_sync(cluster: Cluster) -> None:
    """What the checks above assert from the observer's watch-fed history holds only for what it has received:
    after `observer.sync()`, a DeviceTaintRule (not scrubgate's) created and deleted at once is in it, and the
    watches of the resources that changed since (none, here: pods and claims) stand at least at that rv too."""
    path = cluster.resource_path("devicetaintrules", version=cluster.taint_rule_version())
    rule = {
        "metadata": {"name": "observer-probe"},
        "spec": {
            "deviceSelector": {"driver": "example.com"},
            "taint": {"key": "example.com/probe", "value": "x", "effect": "NoSchedule"},
        },
    }
    created = cluster.request("POST", path, rule)
    cluster.request("DELETE", f"{path}/observer-probe")
    synced = cluster.observer.sync()
    seen = [e for e in cluster.observer.taint_rules() if e.obj["metadata"]["name"] == "observer-probe"]
    # (kube-controller-manager's taint eviction controller may write its status in between)
    assert seen and (seen[0].type, seen[-1].type) == ("ADDED", "DELETED"), [e.type for e in seen]
    assert int(created["metadata"]["resourceVersion"]) < seen[-1].rv <= synced
