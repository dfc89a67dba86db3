"""Faults end to end, on the whole installation (the real control plane, real webhook, real agent as separate
processes; devcluster.harness): kill -9 of the agent at each teardown step, an API outage mid-teardown, an unreachable
webhook, every simulated GPU fault, a rotated serving certificate. After each: no device allocated to a new
claim while dirty, no finalizer removed without a valid attestation, the audit chain intact and every
denial the webhook made in it. Until its attestation, a released claim's own allocation keeps its device from
the next tenant; the agent fences (DeviceTaintRules) only a failed teardown's devices.

The agent is held at a teardown step by something it waits on: a process that does not leave the GPU
(draining), a scrub that takes ten minutes (scrubbing), an admission webhook that cannot be reached (its
attestation write), a policy that does not trust its key yet (the finalizer removal once the attestation is
written). The checkpoint then says where it is, and kill -9 lands exactly there.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import e2e_support
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from e2e_support import (
    WAIT_S,
    allocated_device,
    assert_invariant,
    canary_found,
    create_template,
    expect_denied,
    patch_claim,
    running_claim,
    tenant_namespace,
    tenant_pod,
    verified_attestation,
    wait_gone,
    wait_phase,
)
from scrubgate.policies import names
from scrubgate.policies.attestation import check_claim_attestation
from scrubgate.sanitizer_agent.checkpoint import State, Teardown, read
from scrubgate.sanitizer_agent.gpu import simulated

from devcluster import workloads
from devcluster.harness import (
    CLAIM_CONTROLLER_USER,
    Cluster,
    denial,
    wait_for,
)
from devcluster.kubeapi import AGENT_USER
from devcluster.webhook import WEBHOOK_HOST

pytestmark = pytest.mark.e2e

# The `cluster_factory` fixture (the GPU fault test starts a cluster of its own).
cluster_factory_fixture = e2e_support.cluster_factory_fixture

CANARY = "TENANT-A-FAULT-CANARY-7731"


@dataclass(frozen=True)
class Held:
    """A tenant's pod holding a GPU, and its claim."""

    namespace: str
    pod: str
    claim: str
    uid: str
    device: str  # the DRA device name (gpu-N)
    uuid: str
    canary: str


# ---------------------------------------------------------------------- helpers


def hold_gpu(cluster: Cluster, namespace: str, pod: str, template: str, canary: str = CANARY) -> Held:
    """Alice's pod on a GPU of ``template``, its canary in device memory, recorded by the agent."""
    tenant_pod(cluster, "alice", namespace, pod, template=template, canary=canary)
    return held_gpu(cluster, namespace, pod, canary)


def held_gpu(cluster: Cluster, namespace: str, pod: str, canary: str = CANARY) -> Held:
    """What ``pod`` (created with ``canary``) holds, once it runs and the agent has recorded its device."""
    claim = running_claim(cluster, namespace, pod)
    device = allocated_device(claim)[2]
    uuid = cluster.device_uuid(device)
    held = Held(namespace, pod, claim["metadata"]["name"], claim["metadata"]["uid"], device, uuid, canary)
    wait_fenced(cluster, held)
    assert canary.encode() in cluster.gpu_memory(uuid), "the tenant's canary did not reach device memory"
    return held


def scrub_status(cluster: Cluster, held: Held) -> str | None:
    claim = cluster.claim(held.namespace, held.claim) or {}
    return ((claim.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_SCRUB_STATUS)


def wait_fenced(cluster: Cluster, held: Held) -> None:
    """Until the agent has recorded the claim's allocation (`scrub-status: fenced`: kept from other claims)."""
    wait_for(lambda: scrub_status(cluster, held) == names.SCRUB_FENCED, WAIT_S, f"claim {held.claim} fenced")


def teardown(cluster: Cluster, uid: str) -> Teardown | None:
    """The agent's checkpointed teardown of claim ``uid`` (the file is replaced atomically: read any time)."""
    checkpoint = read(cluster.paths.checkpoint)
    return checkpoint.teardowns.get(uid) if checkpoint else None


def wait_teardown(cluster: Cluster, held: Held, state: State, *, operator: bool = False) -> Teardown:
    """Until the checkpoint has the claim's teardown in ``state`` (with ``operator``: failed, reported, and
    waiting for an operator)."""

    def reached() -> Teardown | None:
        td = teardown(cluster, held.uid)
        if td is None or td.state != state:
            return None
        if operator and (td.retry_at is not None or not td.failure_reported):
            return None
        return td

    return wait_for(reached, WAIT_S, f"the agent's teardown of claim {held.claim} in state {state.value}")


def fences(cluster: Cluster, held: Held, taint: str = names.TAINT_UNSANITIZED) -> list[dict[str, Any]]:
    """The DeviceTaintRules with ``taint`` the agent keeps on the held device for this claim."""
    return [
        rule
        for rule in cluster.taint_rules()
        if (rule["metadata"].get("labels") or {}).get("scrubgate.dev/claim-uid") == held.uid
        and rule["spec"]["taint"]["key"] == taint
        and rule["spec"]["deviceSelector"]["device"] == held.device
    ]


def deallocated(cluster: Cluster, held: Held) -> bool:
    claim = cluster.claim(held.namespace, held.claim)
    return claim is None or not (claim.get("status") or {}).get("allocation")


def deallocation_refused(cluster: Cluster, held: Held) -> bool:
    """The webhook has refused (and audited) a deallocation of the claim: it carries no attestation yet."""
    return bool(cluster.audit_denials("SG007", namespace=held.namespace, name=held.claim, subResource="status"))


def kept_for_its_scrub(cluster: Cluster, held: Held) -> bool:
    """The claim's pod is gone or ended and its allocation stays: the agent's hold keeps the resourceclaim controller
    from even trying to deallocate it; or, where the agent had not held it yet, the webhook refused its try."""
    if deallocation_refused(cluster, held):
        return True
    claim = cluster.claim(held.namespace, held.claim) or {}
    pod = cluster.pod(held.namespace, held.pod)
    ended = pod is None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    holds = any(r.get("apiGroup") == names.RESERVATION_GROUP for r in reserved)
    return ended and holds and bool((claim.get("status") or {}).get("allocation"))


def attested_on_claim(cluster: Cluster, held: Held) -> bool:
    claim = cluster.claim(held.namespace, held.claim) or {}
    return names.ANNOTATION_ATTESTATION in ((claim.get("metadata") or {}).get("annotations") or {})


def strip_finalizer(cluster: Cluster, user: str, held: Held) -> dict:
    claim = cluster.claim(held.namespace, held.claim)
    assert claim is not None, f"claim {held.namespace}/{held.claim} is gone"
    # By its index, tested: a replace of the whole list could race the resourceclaim controller's removal of
    # its own finalizer (and be refused for adding that back to a claim being deleted, before any webhook).
    index = claim["metadata"]["finalizers"].index(names.FINALIZER)
    path = f"/metadata/finalizers/{index}"
    ops = [{"op": "test", "path": path, "value": names.FINALIZER}, {"op": "remove", "path": path}]
    return patch_claim(cluster, user, held.namespace, held.claim, ops)


def expect_strip_denied(cluster: Cluster, held: Held) -> None:
    """Alice tries to take the finalizer off her own claim: denied (SG007) and audited."""
    expect_denied(lambda: strip_finalizer(cluster, "alice", held), "SG007")
    records = cluster.audit_denials("SG007", namespace=held.namespace, name=held.claim, user="alice")
    assert records, f"no audit record of the SG007 denial on {held.namespace}/{held.claim}"


def next_tenant(cluster: Cluster, namespace: str, name: str, uuid: str | None, look_for: str = CANARY) -> str:
    """Bob's pod asking for the GPU ``uuid`` (any GPU when None), looking for the previous tenant's canary."""
    selectors = [workloads.uuid_selector(uuid)] if uuid else None
    create_template(cluster, "bob", namespace, name, selectors=selectors)
    return tenant_pod(cluster, "bob", namespace, name, template=name, look_for=look_for)


def wait_unschedulable(cluster: Cluster, namespace: str, pod: str) -> str:
    """kube-scheduler's verdict that no device it may allocate (untainted, free) fits the pod: its DRA plugin
    says "cannot allocate all claims"; fails at once if the pod is bound."""

    def verdict() -> str:
        found = cluster.pod(namespace, pod) or {}
        assert not found["spec"].get("nodeName"), f"pod {namespace}/{pod} was given a device that must stay fenced"
        for cond in (found.get("status") or {}).get("conditions") or []:
            if cond["type"] == "PodScheduled" and "cannot allocate all claims" in cond.get("message", ""):
                return cond["message"]
        return ""

    return wait_for(verdict, WAIT_S, f"the scheduler's Unschedulable verdict on pod {namespace}/{pod}")


def next_tenants_find_nothing(cluster: Cluster, namespace: str, devices: dict[str, str]) -> None:
    """Each pod runs on its device (pod -> device name), finds no canary, leaves once the agent has fenced
    its device (see test_a_claim_the_agent_never_saw_is_still_scrubbed), and its claim is torn down."""
    found = []
    for pod, device in devices.items():
        claim = running_claim(cluster, namespace, pod)
        assert allocated_device(claim)[2] == device, f"pod {namespace}/{pod} did not get {device}"
        assert canary_found(cluster.pod(namespace, pod) or {}) is False, f"pod {namespace}/{pod} found a canary"
        found.append(Held(namespace, pod, claim["metadata"]["name"], claim["metadata"]["uid"], device, "", ""))
    for held in found:
        wait_fenced(cluster, held)
        cluster.core("bob").delete_namespaced_pod(held.pod, namespace)
    for held in found:
        wait_gone(cluster, namespace, held.claim)
        verified_attestation(cluster, held.uid)


def released_clean(cluster: Cluster, held: Held) -> None:
    """The held claim is gone with a verified attestation for its device, its fences lifted (right after the
    attestation), no canary left."""
    wait_gone(cluster, held.namespace, held.claim)
    payload = verified_attestation(cluster, held.uid)
    assert [(d["device"], d["verified"]) for d in payload["devices"]] == [(held.device, True)]
    wait_for(
        lambda: not fences(cluster, held) and not fences(cluster, held, names.TAINT_SCRUB_FAILED),
        WAIT_S,
        f"the fences of claim {held.claim} lifted",
    )
    assert held.canary.encode() not in cluster.gpu_memory(held.uuid)


def wait_observer_watching(cluster: Cluster) -> None:
    """After an API restart: until the observer watches claims again (it relists, and what changed before the
    relist it never sees). A claim in the system namespace, where no webhook intervenes, marks the moment."""
    path = cluster.resource_path("resourceclaims", names.SYSTEM_NAMESPACE)
    mark = cluster.request("POST", path, workloads.resource_claim(f"observer-mark-{os.urandom(4).hex()}"))["metadata"]

    def seen() -> bool:
        return any(e.obj["metadata"].get("uid") == mark["uid"] for e in cluster.observer.claims())

    wait_for(seen, WAIT_S, "the observer watching claims again")
    cluster.request("DELETE", f"{path}/{mark['name']}")


def webhook_counter(cluster: Cluster, name: str) -> float:
    status, text = cluster.webhook_metrics()
    assert status == 200, f"webhook /metrics: {status} {text}"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} "))


def set_policy(cluster: Cluster, policy: dict[str, Any]) -> None:
    """Replace the webhook's policy file and wait until the running webhook has loaded it."""
    before = webhook_counter(cluster, "scrubgate_policy_reloads_total")
    cluster.write_policy(policy)
    wait_for(lambda: webhook_counter(cluster, "scrubgate_policy_reloads_total") > before, WAIT_S, "the policy reload")


def served_certificate(cluster: Cluster) -> bytes:
    """The certificate the webhook presents, verified as the API server verifies it (CA and service name)."""
    context = ssl.create_default_context(cafile=str(cluster.paths.certs / "ca.crt"))
    with (
        socket.create_connection(("127.0.0.1", cluster.webhook_port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=WEBHOOK_HOST) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def certificate_on_disk(cluster: Cluster) -> bytes:
    cert = x509.load_pem_x509_certificates((cluster.paths.certs / "tls.crt").read_bytes())[0]
    return cert.public_bytes(serialization.Encoding.DER)


def undo_holds(cluster: Cluster, policy: dict[str, Any]) -> None:
    """Lift every hold `hold_agent_at` can put on the agent: the webhook answers again, at its address, with
    ``policy``; no GPU fault is left."""
    cluster.set_webhook_port(cluster.webhook_port)
    cluster.clear_faults()
    if cluster.policy() != policy:
        cluster.wait_webhook_ready()
        set_policy(cluster, policy)


def heal(cluster: Cluster, policy: dict[str, Any]) -> None:
    """After a test on the shared cluster (also a failed one): every process up, no hold left."""
    for process in (cluster.api, cluster.webhook, cluster.agent):
        if not process.running:
            cluster.start_api() if process is cluster.api else process.start()
    undo_holds(cluster, policy)
    cluster.wait_webhook_ready()
    cluster.wait_agent_ready()


# ---------------------------------------------------------------------- one installation for most tests


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """2 simulated GPUs, the harness's agent settings (drain timeout 10 s: long enough to hold it draining)."""
    with Cluster(tmp_path_factory.mktemp("faults"), gpus=2).start() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shared_policy(shared_cluster: Cluster) -> dict[str, Any]:
    """The webhook's policy as the installation came up (it trusts the agent's key)."""
    return shared_cluster.policy()


@pytest.fixture
def cluster(
    shared_cluster: Cluster, shared_policy: dict[str, Any], request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    yield shared_cluster
    request.node.add_report_section("teardown", "devcluster logs", shared_cluster.diagnostics(60))
    heal(shared_cluster, shared_policy)


# ---------------------------------------------------------------------- kill -9 of the agent at each step


@dataclass(frozen=True)
class Step:
    state: State  # where the checkpoint has the teardown when the agent dies
    dirty: bool  # the tenant's canary still in device memory then


STEPS = {
    "fenced": Step(State.ALLOCATED, dirty=True),
    "draining": Step(State.DRAINING, dirty=True),
    "scrubbing": Step(State.SCRUBBING, dirty=True),
    # `verified` signs; `attested` writes the attestation (and removes the finalizer where it holds).
    "attested": Step(State.ATTESTED, dirty=False),
    # The attestation written, the finalizer's removal refused: `done` removes it.
    "done": Step(State.DONE, dirty=False),
}


def hold_agent_at(cluster: Cluster, held: Held, step: str) -> None:
    """Releases the claim and keeps the agent at ``step`` of its teardown (see the module docstring)."""
    if step == "fenced":
        return  # the pod still holds the claim: the agent waits for the release
    if step == "done":
        set_policy(cluster, {**cluster.policy(), "attestationKeys": []})  # the agent's removal is refused
    cluster.inject_fault(held.uuid, "linger")  # a process that never leaves the GPU: the drain waits
    cluster.core("alice").delete_namespaced_pod(held.pod, held.namespace)
    wait_teardown(cluster, held, State.DRAINING)
    wait_for(lambda: scrub_status(cluster, held) == names.SCRUB_DRAINING, WAIT_S, "the draining announcement")
    if step == "draining":
        return
    if step == "scrubbing":
        cluster.inject_fault(held.uuid, "slow_scrub", 600)  # the scrub takes its time
    elif step == "attested":
        cluster.set_webhook_port(None)  # the attestation cannot be written
    cluster.inject_fault(held.uuid, "linger", False)  # the process leaves the GPU: the drain ends


@pytest.mark.timeout(120)
@pytest.mark.parametrize("step", list(STEPS))
def test_agent_killed_at_each_teardown_step(cluster: Cluster, shared_policy: dict[str, Any], step: str) -> None:
    expected = STEPS[step]
    ns_a, ns_b = tenant_namespace(cluster, "kill-a"), tenant_namespace(cluster, "kill-b")
    create_template(cluster, "alice", ns_a, "one-gpu")
    held = hold_gpu(cluster, ns_a, "a", "one-gpu")

    hold_agent_at(cluster, held, step)
    wait_teardown(cluster, held, expected.state)
    if step == "done":
        what = f"the webhook's denial of the agent's finalizer removal on {held.claim}"
        wait_for(lambda: cluster.audit_denials("SG007", name=held.claim, user=AGENT_USER), WAIT_S, what)
    assert cluster.agent.kill() == -9
    undo_holds(cluster, shared_policy)

    # At the crash: the claim's allocation keeps its device, dirty or not, from every other claim; no fence.
    assert (CANARY.encode() in cluster.gpu_memory(held.uuid)) == expected.dirty
    assert not deallocated(cluster, held) and not fences(cluster, held)
    if cluster.pod(ns_a, "a") is not None:
        cluster.core("alice").delete_namespaced_pod("a", ns_a)  # released while the agent is down
    expect_strip_denied(cluster, held)

    # The claim keeps its device until its attestation is on it: held, or its deallocation refused.
    what = f"claim {held.claim} deallocated, or kept for its scrub"
    wait_for(lambda: deallocated(cluster, held) or kept_for_its_scrub(cluster, held), WAIT_S, what)
    assert attested_on_claim(cluster, held) or not deallocated(cluster, held), "deallocated with no attestation"
    # The next tenant asks for exactly that device while the agent is down: not while it is unattested.
    next_tenant(cluster, ns_b, "next", held.uuid)
    if not attested_on_claim(cluster, held):
        wait_unschedulable(cluster, ns_b, "next")

    cluster.agent.start()
    cluster.wait_agent_ready()
    next_tenants_find_nothing(cluster, ns_b, {"next": held.device})
    released_clean(cluster, held)
    assert_invariant(cluster)


@pytest.mark.timeout(120)
def test_a_named_claim_used_again_while_the_agent_is_down_is_scrubbed_again(cluster_factory: Any) -> None:
    """A bare pod's named claim (allowed in a single-tenant namespace) keeps the attestation of its first
    use. A second pod uses it while the agent is down and ends: the attestation names only the first pod,
    so the deallocation stays refused until the agent, back, has scrubbed the second pod's data too."""
    cluster = cluster_factory(gpus=1)
    ns = tenant_namespace(cluster, "named", trusted=True)
    ns_next = tenant_namespace(cluster, "named-next")
    cluster.request("POST", cluster.resource_path("resourceclaims", ns), workloads.resource_claim("mine"), user="alice")

    def use(pod: str, canary: str) -> Held:
        body = workloads.pod(pod, claim="mine", annotations=workloads.workload_annotations(canary))
        cluster.core("alice").create_namespaced_pod(ns, body)
        wait_phase(cluster, ns, pod, "Running", "Succeeded")
        claim = cluster.claim(ns, "mine") or {}
        device = allocated_device(claim)[2]
        held = Held(ns, pod, "mine", claim["metadata"]["uid"], device, cluster.device_uuid(device), canary)
        assert canary.encode() in cluster.gpu_memory(held.uuid)
        cluster.core("alice").delete_namespaced_pod(pod, ns)
        wait_for(lambda: cluster.pod(ns, pod) is None, WAIT_S, f"pod {ns}/{pod} deleted")
        return held

    first = use("first", f"{CANARY}-first")
    wait_for(lambda: deallocated(cluster, first), WAIT_S, "the first use attested and deallocated")
    assert cluster.agent.kill() == -9
    second = use("second", f"{CANARY}-second")

    def refused_for_the_second_pod() -> bool:
        records = cluster.audit_denials("SG007", namespace=ns, name="mine", subResource="status")
        return any("predates the claim's use by pod(s) second" in f["message"] for r in records for f in r["findings"])

    what = "the deallocation after the second use refused: the attestation is the first pod's"
    wait_for(refused_for_the_second_pod, WAIT_S, what)
    assert attested_on_claim(cluster, second) and not deallocated(cluster, second)

    cluster.agent.start()
    cluster.wait_agent_ready()
    wait_for(lambda: deallocated(cluster, second), WAIT_S, "the second use attested and deallocated")
    assert second.canary.encode() not in cluster.gpu_memory(second.uuid)
    stored = cluster.claim(ns, "mine") or {}
    token = stored["metadata"]["annotations"][names.ANNOTATION_ATTESTATION]
    assert [c["name"] for c in check_claim_attestation(token, stored, cluster.public_keys)["consumers"]] == ["second"]
    next_tenant(cluster, ns_next, "next", second.uuid, look_for=second.canary)
    next_tenants_find_nothing(cluster, ns_next, {"next": second.device})
    assert_invariant(cluster)


@pytest.mark.timeout(120)
def test_a_claim_the_agent_never_saw_is_still_scrubbed(cluster_factory: Any) -> None:
    """kill -9 before the agent sees the allocation at all: a whole claim lifetime while it is down. The
    webhook keeps the claim allocated (the claim controller's deallocation is denied, and audited) until
    the agent, back up, finds it in its list of claims, fences, scrubs and attests it."""
    cluster = cluster_factory(gpus=1)
    ns_a, ns_b = tenant_namespace(cluster, "unseen-a"), tenant_namespace(cluster, "unseen-b")
    create_template(cluster, "alice", ns_a, "one-gpu")
    assert cluster.agent.kill() == -9
    tenant_pod(cluster, "alice", ns_a, "a", template="one-gpu", canary=CANARY)
    claim = running_claim(cluster, ns_a, "a")
    device = allocated_device(claim)[2]
    held = Held(
        ns_a, "a", claim["metadata"]["name"], claim["metadata"]["uid"], device, cluster.device_uuid(device), CANARY
    )
    assert CANARY.encode() in cluster.gpu_memory(held.uuid)
    cluster.core("alice").delete_namespaced_pod("a", ns_a)
    wait_for(lambda: cluster.pod(ns_a, "a") is None, WAIT_S, f"pod {ns_a}/a deleted")
    refused = wait_for(
        lambda: cluster.audit_denials("SG007", namespace=ns_a, name=held.claim, subResource="status"),
        WAIT_S,
        f"the deallocation of {held.claim} refused",
    )
    assert refused[0]["user"] == CLAIM_CONTROLLER_USER
    assert not deallocated(cluster, held), "the claim was deallocated with no attestation"

    cluster.agent.start()
    cluster.wait_agent_ready()
    next_tenant(cluster, ns_b, "next", held.uuid)
    next_tenants_find_nothing(cluster, ns_b, {"next": device})
    released_clean(cluster, held)
    assert_invariant(cluster)


# ---------------------------------------------------------------------- kube-apiserver goes away mid-teardown


@pytest.mark.timeout(120)
@pytest.mark.parametrize("crash", [True, False], ids=["kill-9", "stop"])
def test_api_outage_mid_teardown(cluster: Cluster, crash: bool) -> None:
    ns_a, ns_b = tenant_namespace(cluster, "outage-a"), tenant_namespace(cluster, "outage-b")
    create_template(cluster, "alice", ns_a, "one-gpu")
    held = hold_gpu(cluster, ns_a, "a", "one-gpu")
    hold_agent_at(cluster, held, "draining")

    cluster.stop_api(crash=crash)
    cluster.clear_faults(held.uuid)
    # Without the API the agent scrubs and signs, then cannot write the attestation: it waits, the claim's
    # allocation keeping the (clean) device.
    wait_teardown(cluster, held, State.ATTESTED)
    assert CANARY.encode() not in cluster.gpu_memory(held.uuid)
    assert cluster.agent.running and cluster.agent_healthz()[0] == 200
    cluster.set_webhook_port(None)  # the agent's writes wait until the observer can see them
    cluster.start_api()
    wait_observer_watching(cluster)
    cluster.set_webhook_port(cluster.webhook_port)

    released_clean(cluster, held)
    next_tenant(cluster, ns_b, "next", held.uuid)
    next_tenants_find_nothing(cluster, ns_b, {"next": held.device})
    assert_invariant(cluster)


# ---------------------------------------------------------------------- the webhook cannot be reached


@pytest.mark.timeout(120)
@pytest.mark.parametrize("outage", ["no-endpoints", "process-stopped"])
def test_unreachable_webhook_denies_then_recovers(cluster: Cluster, outage: str) -> None:
    ns = tenant_namespace(cluster, "no-webhook")
    create_template(cluster, "alice", ns, "one-gpu")
    held = hold_gpu(cluster, ns, "a", "one-gpu")
    records = len(cluster.audit_records())

    if outage == "no-endpoints":
        cluster.set_webhook_port(None)
    else:
        cluster.webhook.stop()
    attempts = {
        "a GPU claim": lambda: cluster.resource("alice").create_namespaced_resource_claim(
            ns, workloads.resource_claim("direct")
        ),
        "a pod with a GPU claim": lambda: tenant_pod(cluster, "alice", ns, "b", template="one-gpu"),
        "a finalizer strip": lambda: strip_finalizer(cluster, "alice", held),
    }
    for what, call in attempts.items():
        status, message = denial(call)
        assert status == 500 and "failed calling webhook" in message, f"{what}: HTTP {status}: {message}"
    assert cluster.claim(ns, "direct") is None and cluster.pod(ns, "b") is None
    assert names.FINALIZER in (cluster.claim(ns, held.claim) or {})["metadata"]["finalizers"]
    # The API server refused them without the webhook seeing them: nothing to audit, nothing lost.
    assert len(cluster.audit_records()) == records

    if outage == "no-endpoints":
        cluster.set_webhook_port(cluster.webhook_port)
    else:
        cluster.webhook.start()
        cluster.wait_webhook_ready()
    second = hold_gpu(cluster, ns, "b", "one-gpu")
    assert names.FINALIZER in (cluster.claim(ns, second.claim) or {})["metadata"]["finalizers"]
    expect_strip_denied(cluster, held)
    for pod in ("a", "b"):
        cluster.core("alice").delete_namespaced_pod(pod, ns)
    released_clean(cluster, held)
    released_clean(cluster, second)
    assert_invariant(cluster)


# ---------------------------------------------------------------------- the serving certificate is rotated


@pytest.mark.timeout(120)
def test_certificate_rotation_mid_run(cluster: Cluster) -> None:
    pid, starts = cluster.webhook.pid, cluster.webhook.starts
    ns = tenant_namespace(cluster, "rotation")
    create_template(cluster, "alice", ns, "one-gpu")
    held = hold_gpu(cluster, ns, "a", "one-gpu")
    old = served_certificate(cluster)

    cluster.rotate_webhook_cert()
    new = certificate_on_disk(cluster)
    assert new != old
    # New handshakes get the new certificate, verified as the API server verifies it (connections it keeps
    # alive from before may still carry the old one for a few seconds).
    wait_for(lambda: served_certificate(cluster) == new, WAIT_S, "the webhook serving the rotated certificate")

    retain = {names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN}
    expect_denied(lambda: create_template(cluster, "alice", ns, "keep", claim_annotations=retain), "SG001")
    assert cluster.audit_denials("SG001", namespace=ns, name="keep", user="alice")
    expect_strip_denied(cluster, held)
    second = hold_gpu(cluster, ns, "b", "one-gpu")  # mutated (finalizer) and admitted through the new certificate
    assert names.FINALIZER in (cluster.claim(ns, second.claim) or {})["metadata"]["finalizers"]
    for pod in ("a", "b"):
        cluster.core("alice").delete_namespaced_pod(pod, ns)
    released_clean(cluster, held)  # the agent's finalizer removals passed the rotated webhook too
    released_clean(cluster, second)
    assert (cluster.webhook.pid, cluster.webhook.starts) == (pid, starts), "the webhook was restarted"
    assert_invariant(cluster)


# ---------------------------------------------------------------------- every simulated GPU fault


# kind: (value injected, failure category in the status annotation, the canary survives the failed teardown)
FAULTS: dict[str, tuple[object, str, bool]] = {
    "scrub_error": ("CUDA_ERROR_ILLEGAL_ADDRESS", "scrub-failed", True),
    "verify_mismatch": (True, "scrub-failed", False),
    "nvml_error": ("NVML_ERROR_GPU_IS_LOST", "gpu-error", True),
    "ecc_error": (2, "unhealthy", False),
    "remap_pending": (True, "unhealthy", False),
    "remap_failed": (True, "unhealthy", False),
    "recovery_action": (1, "unhealthy", False),
    "xid": (79, "unhealthy", False),
    "linger": (True, "drain-timeout", True),
}


def pod_name(fault: str) -> str:
    return fault.replace("_", "-")


def warning_events(cluster: Cluster, held: Held) -> list[dict[str, Any]]:
    events = cluster.request("GET", f"/api/v1/namespaces/{held.namespace}/events")["items"]
    return [
        e
        for e in events
        if e.get("type") == "Warning"
        and e.get("reason") == "ScrubFailed"
        and e["involvedObject"].get("name") == held.claim
    ]


def rescrub(cluster: Cluster, devices: list[str]) -> None:
    """`scrubgate agent rescrub --device ...` against the agent's checkpoint, as an operator on the node."""
    argv = [sys.executable, "-m", "scrubgate.cli", "agent", "rescrub", "--checkpoint", str(cluster.paths.checkpoint)]
    runs = [
        subprocess.Popen([*argv, "--device", device], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for device in devices
    ]
    for device, run in zip(devices, runs, strict=True):
        output = run.communicate(timeout=60)[0]
        assert run.returncode == 0 and f"rescrub requested for {device}" in output, output


@pytest.mark.timeout(120)
def test_every_gpu_fault_keeps_the_device_fenced_until_an_operator_rescrubs(cluster_factory: Any) -> None:
    """All faults at once, one GPU each, and one spare GPU; the agent gives up after 2 attempts."""
    # slow_scrub fails nothing (the kill -9 test holds the agent in its scrub with it).
    assert set(FAULTS) == simulated.FAULT_KINDS - {"slow_scrub"}, "a simulated fault kind is not covered here"
    agent_args = ("--resync", "2", "--retry-backoff", "0.2", "--max-attempts", "2", "--drain-timeout", "2")
    cluster = cluster_factory(gpus=len(FAULTS) + 1, agent_args=agent_args)
    ns_a, ns_b = tenant_namespace(cluster, "faulty"), tenant_namespace(cluster, "next")
    create_template(cluster, "alice", ns_a, "one-gpu")
    for kind in FAULTS:
        tenant_pod(cluster, "alice", ns_a, pod_name(kind), template="one-gpu", canary=f"{CANARY}-{kind}")
    held = {kind: held_gpu(cluster, ns_a, pod_name(kind), f"{CANARY}-{kind}") for kind in FAULTS}
    for kind, (value, _, _) in FAULTS.items():
        cluster.inject_fault(held[kind].uuid, kind, value)  # type: ignore[arg-type]
        cluster.core("alice").delete_namespaced_pod(held[kind].pod, ns_a)

    for kind, (_, category, dirty) in FAULTS.items():
        h = held[kind]
        td = wait_teardown(cluster, h, State.FAILED, operator=True)
        assert td.attempts == 2 and (td.reason or "").startswith(f"{category}:"), (kind, td.reason)
        status = scrub_status(cluster, h) or ""
        assert status.startswith(f"{names.SCRUB_FAILED_PREFIX}{category}:"), (kind, status)
        assert fences(cluster, h) and fences(cluster, h, names.TAINT_SCRUB_FAILED), f"{kind}: fence missing"
        messages = [e["message"] for e in warning_events(cluster, h)]
        key = f"{workloads.DRIVER}/{cluster.node}/{h.device}"
        assert any(key in m and f"rescrub --device {h.uuid}" in m for m in messages), (kind, messages)
        assert (h.canary.encode() in cluster.gpu_memory(h.uuid)) == dirty, kind
        expect_strip_denied(cluster, h)  # the tenant cannot get a failed claim out of the way either

    # Next tenants: one per failed GPU asking for exactly it (refused), one for any GPU (gets the spare).
    # The failed claims keep their devices: held, the controller never tries, until a scrub is attested.
    what = "each failed claim kept for its scrub"
    wait_for(lambda: all(kept_for_its_scrub(cluster, h) for h in held.values()), WAIT_S, what)
    assert not any(deallocated(cluster, h) for h in held.values())
    for kind, h in held.items():
        next_tenant(cluster, ns_b, f"next-{pod_name(kind)}", h.uuid)
    next_tenant(cluster, ns_b, "any", None)
    for kind in FAULTS:
        wait_unschedulable(cluster, ns_b, f"next-{pod_name(kind)}")
    (spare,) = {g.uuid for g in cluster.gpus()} - {h.uuid for h in held.values()}
    next_tenants_find_nothing(cluster, ns_b, {"any": cluster.device_name(spare)})

    # The operator fixes the GPUs and asks for another attempt: each is scrubbed, attested and released.
    cluster.clear_faults()
    rescrub(cluster, [h.uuid for h in held.values()])
    for h in held.values():
        released_clean(cluster, h)
    next_tenants_find_nothing(cluster, ns_b, {f"next-{pod_name(kind)}": h.device for kind, h in held.items()})
    assert_invariant(cluster)
