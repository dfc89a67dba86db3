"""Where a claim's allocation cannot keep its device from the next tenant, the agent fences it with a
DeviceTaintRule; one scenario per such path, on the whole installation (the real control plane, webhook and
agent; devcluster.harness). Normally no fence is made at all: SG007 keeps a released GPU claim allocated
until the agent's attestation lands (test_e2e_lifecycle.py). Each test here lets the allocation go before
that, the ways it can go, and shows the next tenant waiting until the device is verified clean:

- a failed teardown, and break-glass letting its claim go (the fence made when it failed stays);
- an allocation cleared behind the webhook's back while the teardown runs (fenced at once, a Warning Event,
  a metric);
- scrubgate uninstalled with a teardown pending (the agents fence on their way out, before the webhook goes).

Admin access (an allocation beside which other claims may be allocated the device) is fenced from first sight:
test_e2e_fence_guard.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import e2e_support
import pytest
from e2e_support import (
    WAIT_S,
    assert_invariant,
    claim_history,
    create_template,
    fence_history,
    tenant_namespace,
    wait_gone,
)
from kubernetes.client.exceptions import ApiException
from scrubgate.policies import names
from scrubgate.policies.attestation import verify
from scrubgate.sanitizer_agent.checkpoint import State
from test_e2e_faults import (
    Held,
    deallocated,
    fences,
    hold_gpu,
    next_tenant,
    next_tenants_find_nothing,
    released_clean,
    rescrub,
    scrub_status,
    wait_teardown,
    wait_unschedulable,
)

from devcluster.harness import REPO_ROOT, Cluster, wait_for
from devcluster.observer import first_rv, is_allocated

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

cluster_factory_fixture = e2e_support.cluster_factory_fixture

BREAK_GLASS = "node under repair (test)"


def break_glass(cluster: Cluster, held: Held) -> None:
    body = {"metadata": {"annotations": {names.ANNOTATION_BREAK_GLASS: BREAK_GLASS}}}
    path = cluster.resource_path("resourceclaims", held.namespace, held.claim)
    cluster.request("PATCH", path, body, content_type="application/merge-patch+json")


def strip_finalizer_as_admin(cluster: Cluster, held: Held) -> None:
    """`kubectl patch --type=json` removing scrubgate's finalizer by its index (tested first: the resourceclaim
    controller removes its own finalizer around then), read again where the claim changed."""
    path = cluster.resource_path("resourceclaims", held.namespace, held.claim)

    def strip() -> bool:
        claim = cluster.claim(held.namespace, held.claim)
        assert claim is not None, f"claim {held.namespace}/{held.claim} is gone"
        index = claim["metadata"]["finalizers"].index(names.FINALIZER)
        ops = [
            {"op": "test", "path": f"/metadata/finalizers/{index}", "value": names.FINALIZER},
            {"op": "remove", "path": f"/metadata/finalizers/{index}"},
        ]
        try:
            cluster.request("PATCH", path, ops, content_type="application/json-patch+json")
        except ApiException as exc:
            if exc.status != 422:  # the `test` op failed: the claim changed
                raise
            return False
        return True

    wait_for(strip, WAIT_S, f"the admin's removal of {names.FINALIZER} from claim {held.claim}")


def audited(cluster: Cluster, held: Held, user: str, fragment: str) -> list[dict]:
    return [
        r
        for r in cluster.audit_records()
        if r["decision"] == "audit"
        and r["name"] == held.claim
        and r["user"] == user
        and any(fragment in f["message"] for f in r["findings"])
    ]


def reused_after_the_fence_went(cluster: Cluster, held: Held, next_uid: str) -> None:
    """The next claim got the device only after the agent lifted its fence, which it does only after a
    verified scrub."""
    cluster.observer.sync()
    lifted = first_rv(fence_history(cluster, held.uid), lambda e: e.type == "DELETED")
    reused = first_rv(claim_history(cluster, next_uid), is_allocated)
    assert lifted is not None and reused is not None and lifted < reused, (lifted, reused)


def agent_counter(cluster: Cluster, name: str) -> float:
    return sum(float(line.split()[-1]) for line in cluster.agent_metrics().splitlines() if line.startswith(f"{name} "))


def draining(cluster_factory: Callable[..., Cluster], prefix: str) -> tuple[Cluster, Held, str]:
    """A cluster whose agent holds alice's released claim in its drain (a process that does not leave the GPU),
    and a namespace for the next tenant."""
    cluster = cluster_factory(gpus=1, agent_args=("--resync", "1", "--drain-timeout", "120"))
    ns_a, ns_b = tenant_namespace(cluster, f"{prefix}-a"), tenant_namespace(cluster, f"{prefix}-b")
    create_template(cluster, "alice", ns_a, "one-gpu")
    held = hold_gpu(cluster, ns_a, "a", "one-gpu")
    cluster.inject_fault(held.uuid, "linger")
    cluster.core("alice").delete_namespaced_pod("a", ns_a)
    wait_teardown(cluster, held, State.DRAINING)
    return cluster, held, ns_b


def test_a_failed_teardown_is_fenced_and_break_glass_lets_its_claim_go_while_the_fence_stays(
    cluster_factory: Callable[..., Cluster],
) -> None:
    agent_args = ("--resync", "1", "--retry-backoff", "0.2", "--max-attempts", "1", "--drain-timeout", "10")
    cluster = cluster_factory(gpus=1, agent_args=agent_args)
    ns_a, ns_b = tenant_namespace(cluster, "failed-a"), tenant_namespace(cluster, "failed-b")
    create_template(cluster, "alice", ns_a, "one-gpu")
    held = hold_gpu(cluster, ns_a, "a", "one-gpu")
    cluster.observer.sync()
    assert not fence_history(cluster, held.uid), "while the claim's allocation holds it, no fence"

    cluster.inject_fault(held.uuid, "scrub_error", "CUDA_ERROR_ILLEGAL_ADDRESS")
    cluster.core("alice").delete_namespaced_pod("a", ns_a)
    wait_teardown(cluster, held, State.FAILED, operator=True)
    assert fences(cluster, held) and fences(cluster, held, names.TAINT_SCRUB_FAILED)
    assert (scrub_status(cluster, held) or "").startswith(names.SCRUB_FAILED_PREFIX)
    assert not deallocated(cluster, held), "the failed claim keeps its allocation too"

    # The claim must go (its namespace is being cleaned up, say): an admin breaks glass. The agent's fence
    # stands, so the agent lets its hold go, and the allocation with it (the controller, at rest since the pod's
    # record took its place, drops nothing), audited; the admin strips the finalizer.
    break_glass(cluster, held)
    wait_for(lambda: deallocated(cluster, held), WAIT_S, f"claim {held.claim} deallocated after break-glass")
    assert audited(cluster, held, cluster.users["agent"].name, "devices fenced after a failed scrub")
    strip_finalizer_as_admin(cluster, held)
    wait_gone(cluster, held.namespace, held.claim)

    # The device is free of any claim, and dirty: the fence keeps the next tenant away.
    assert held.canary.encode() in cluster.gpu_memory(held.uuid)
    next_tenant(cluster, ns_b, "next", held.uuid)
    wait_unschedulable(cluster, ns_b, "next")

    # The operator fixes the GPU and asks for another attempt: scrubbed, fence lifted, then the next tenant.
    cluster.clear_faults()
    rescrub(cluster, [held.uuid])
    next_claim = e2e_support.running_claim(cluster, ns_b, "next")
    reused_after_the_fence_went(cluster, held, next_claim["metadata"]["uid"])
    next_tenants_find_nothing(cluster, ns_b, {"next": held.device})
    # With no claim left to carry it, the attestation of that scrub is in an Event on the node.
    events = cluster.request("GET", "/api/v1/namespaces/default/events")["items"]
    tokens = [
        e["metadata"]["annotations"][names.ANNOTATION_ATTESTATION] for e in events if e["reason"] == "ScrubAttested"
    ]
    assert [
        (p["claim"]["uid"], p["devices"][0]["verified"]) for p in map(lambda t: verify(t, cluster.public_keys), tokens)
    ] == [(held.uid, True)]
    # The observer reads attestations on claims only: it sees the device reused while the break-glass claim
    # had none. That is the one thing it reports, and the fence's order above is what made it safe.
    cluster.observer.sync()
    violations = cluster.observer.violations(cluster.public_keys)
    assert len(violations) == 1 and f"(uid {held.uid}) that held it has no verified attestation" in violations[0]


def test_an_allocation_cleared_behind_scrubgates_back_is_fenced_at_once(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster, held, ns_b = draining(cluster_factory, "bypass")

    # An admin, taking the node for lost, clears the allocation personally (break-glass, audited): nothing
    # but the agent can keep the dirty device from the scheduler now.
    break_glass(cluster, held)
    path = cluster.resource_path("resourceclaims", held.namespace, held.claim) + "/status"
    cleared = {"status": {"allocation": None, "reservedFor": None}}
    cluster.request("PATCH", path, cleared, content_type="application/merge-patch+json")
    assert audited(cluster, held, cluster.users["admin"].name, "devices neither fenced nor attested clean")
    wait_for(lambda: fences(cluster, held), WAIT_S, "the agent's fence once it sees the allocation gone")

    # The agent posts the Event after the fence (and after counting it): waited for, then read for the counts.
    def unattested_events() -> list[dict]:
        return [
            e
            for e in cluster.request("GET", f"/api/v1/namespaces/{held.namespace}/events")["items"]
            if e["reason"] == "UnattestedDeallocation" and e["involvedObject"].get("name") == held.claim
        ]

    warnings = wait_for(unattested_events, WAIT_S, f"the agent's UnattestedDeallocation Event about claim {held.claim}")
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
    assert "lost its allocation before the scrub of" in warnings[0]["message"]
    assert agent_counter(cluster, "scrubgate_agent_unattested_deallocations_total") == 1
    assert agent_counter(cluster, 'scrubgate_agent_fences_total{reason="allocation-lost"}') == 1

    next_tenant(cluster, ns_b, "next", held.uuid)
    wait_unschedulable(cluster, ns_b, "next")
    cluster.clear_faults(held.uuid)  # the process leaves; the agent drains, scrubs, lifts the fence
    released_clean(cluster, held)
    next_claim = e2e_support.running_claim(cluster, ns_b, "next")
    reused_after_the_fence_went(cluster, held, next_claim["metadata"]["uid"])
    next_tenants_find_nothing(cluster, ns_b, {"next": held.device})
    assert_invariant(cluster)  # the deallocation was break-glass; the reuse came after the attestation


def test_uninstall_mid_teardown_fences_before_the_guard_goes_and_a_reinstall_finishes(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster, held, ns_b = draining(cluster_factory, "uninstall")
    assert not fences(cluster, held)

    # The agents go first, each fencing what it still owes; then the webhook configurations, then the webhook.
    cluster.uninstall_scrubgate()
    (fence,) = fences(cluster, held)
    taint = fence["spec"]["taint"]
    assert (taint["key"], taint["value"], taint["effect"]) == (names.TAINT_UNSANITIZED, held.uid, "NoSchedule")
    # No guard now: the resourceclaim controller deallocates the unattested claim (at its next retry: its backoff
    # grew with each refusal while the agent drained). The fence keeps the device.
    wait_for(lambda: deallocated(cluster, held), 3 * WAIT_S, f"claim {held.claim} deallocated without the webhook")
    next_tenant(cluster, ns_b, "next", held.uuid)
    wait_unschedulable(cluster, ns_b, "next")

    # Installed again, the agent finishes the teardown its checkpoint still owes, then lifts the fence.
    cluster.clear_faults(held.uuid)
    cluster.reinstall_scrubgate()
    released_clean(cluster, held)
    next_claim = e2e_support.running_claim(cluster, ns_b, "next")
    reused_after_the_fence_went(cluster, held, next_claim["metadata"]["uid"])
    next_tenants_find_nothing(cluster, ns_b, {"next": held.device})
    # What the observer reports is the deallocation made while scrubgate was not installed, and nothing else.
    cluster.observer.sync()
    violations = cluster.observer.violations(cluster.public_keys)
    assert len(violations) == 1 and f"(uid {held.uid}) deallocated while" in violations[0], violations


def test_uninstall_waits_for_the_pending_teardown_then_leaves_nothing_of_scrubgates(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    """`scrubgate uninstall` (the chart's pre-delete hook): the guard stays while a teardown is pending, and
    goes once it has ended, with no claim Terminating and no fence left; cut short, it removes nothing."""
    cluster, held, _ = draining(cluster_factory, "waited")
    kubeconfig = str(cluster.control_plane.credentials["admin"].kubeconfig)
    command = [sys.executable, "-m", "scrubgate.cli", "uninstall", "--kubeconfig", kubeconfig]
    command += ["--namespace", cluster.namespace]
    refused = subprocess.run(
        [*command, "--timeout", "2"], capture_output=True, text=True, timeout=60, check=False, cwd=REPO_ROOT
    )
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"claim {held.namespace}/{held.claim}: teardown pending (scrub-status draining)" in refused.stderr
    assert len(webhook_configurations(cluster)) == 3, "nothing removed while a teardown is pending"

    log = tmp_path / "uninstall.log"
    with log.open("w") as out:
        waiting = subprocess.Popen([*command, "--timeout", "120"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        try:
            wait_for(lambda: "waiting for pending teardowns" in log.read_text(), WAIT_S, "the uninstall waiting")
            assert len(webhook_configurations(cluster)) == 3
            cluster.clear_faults(held.uuid)  # the process leaves the GPU: drained, scrubbed, attested
            assert waiting.wait(timeout=150) == 0, log.read_text()
        finally:
            waiting.kill()
    released_clean(cluster, held)
    assert webhook_configurations(cluster) == []
    scrubgates = [r for r in cluster.taint_rules() if r["spec"]["taint"]["key"].startswith(f"{names.DOMAIN}/")]
    assert scrubgates == []
    claims = cluster.request("GET", f"/apis/{names.RESOURCE_GROUP}/v1/resourceclaims")["items"]
    assert not [c for c in claims if c["metadata"].get("deletionTimestamp")], "a claim left Terminating"
    assert not [c for c in claims if names.FINALIZER in c["metadata"].get("finalizers", [])]
    assert_invariant(cluster)


def webhook_configurations(cluster: Cluster) -> list[str]:
    found = []
    for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        items = cluster.request("GET", f"/apis/admissionregistration.k8s.io/v1/{kind}")["items"]
        found += [i["metadata"]["name"] for i in items if i["metadata"]["name"].startswith("scrubgate-")]
    return found
