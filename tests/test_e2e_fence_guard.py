"""The fence guard end to end (real control plane, real webhook, real agent; devcluster.harness): a user who is
neither the agent nor an admin, but whom RBAC lets delete DeviceTaintRules, cannot lift the agent's fence
on a GPU that a claim holds. The API server calls the fence webhook for the cluster-scoped rule and it
refuses, under SG007, with one audit record; the agent itself still lifts the fence after its scrub. The GPU
is taken with admin access (in a single-tenant namespace an admin opened to it), beside which other claims may
be allocated it: its claim's allocation keeps it from nobody, so the agent fences it from first sight.

In a module of its own: test_e2e_attacks.py accounts for every audit record its shared cluster holds."""

from __future__ import annotations

import e2e_support
import pytest
from e2e_support import (
    WAIT_S,
    assert_invariant,
    create_template,
    expect_denied,
    grant,
    running_claim,
    tenant_namespace,
    tenant_pod,
    verified_attestation,
    wait_gone,
)
from scrubgate.policies import names

from devcluster.harness import Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

cluster_factory_fixture = e2e_support.cluster_factory_fixture
cluster_fixture = e2e_support.cluster_fixture


def fence_of(cluster: Cluster, claim_uid: str) -> dict | None:
    """The agent's unsanitized fence for the claim, once it exists."""
    for rule in cluster.taint_rules():
        labels = rule["metadata"].get("labels") or {}
        if (
            labels.get("scrubgate.dev/claim-uid") == claim_uid
            and rule["spec"]["taint"]["key"] == names.TAINT_UNSANITIZED
        ):
            return rule
    return None


def fence_records(cluster: Cluster) -> list[dict]:
    return [r for r in cluster.audit_records() if r["kind"] == "DeviceTaintRule"]


def fence_deletions(cluster: Cluster, decision: str) -> float:
    """How many DeviceTaintRule DELETEs the webhook decided so (its metrics): the agent's, too, are asked."""
    status, text = cluster.webhook_metrics()
    assert status == 200, text
    labels = ('operation="DELETE"', 'kind="DeviceTaintRule"', f'decision="{decision}"')
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("scrubgate_admission_requests_total{") and all(label in line for label in labels)
    )


def grant_taint_rule_deletion(cluster: Cluster, user: str) -> None:
    """RBAC that lets ``user`` delete any DeviceTaintRule (an operator role given too widely)."""
    rules = [{"apiGroups": ["resource.k8s.io"], "resources": ["devicetaintrules"], "verbs": ["get", "list", "delete"]}]
    grant(cluster, user, f"devicetaintrule-deleter-{user}", rules)


def test_a_user_cannot_lift_the_agents_fence_but_the_agent_does(cluster: Cluster) -> None:
    grant_taint_rule_deletion(cluster, "bob")
    ns = tenant_namespace(cluster, "fence", trusted=True, labels={"resource.kubernetes.io/admin-access": "true"})
    create_template(cluster, "alice", ns, "one-gpu", admin_access=True)
    tenant_pod(cluster, "alice", ns, "trainer", template="one-gpu", canary="FENCE-SECRET-4411")
    claim = running_claim(cluster, ns, "trainer")
    uid = claim["metadata"]["uid"]
    rule = wait_for(
        lambda: fence_of(cluster, uid), WAIT_S, f"the agent's fence for claim {ns}/{claim['metadata']['name']}"
    )
    name = rule["metadata"]["name"]
    path = cluster.resource_path("devicetaintrules", name=name, version=cluster.taint_rule_version())

    message = expect_denied(lambda: cluster.request("DELETE", path, user="bob"), "SG007")
    assert 'admission webhook "validate-fences.scrubgate.dev" denied the request' in message
    assert f"user 'bob' deleted DeviceTaintRule {name!r}, scrubgate's fence" in message
    assert fence_of(cluster, uid) == rule  # still there, unchanged

    # One record, from the one webhook that guards fences (a tenancy webhook would have written a second).
    (record,) = fence_records(cluster)
    assert (record["decision"], record["operation"], record["user"], record["name"], record["namespace"]) == (
        "deny",
        "DELETE",
        "bob",
        name,
        "",
    )
    assert [f["rule"]["id"] for f in record["findings"]] == ["SG007"]

    # The tenant leaves the proper way: the agent scrubs, attests and lifts its fence, unrecorded.
    cluster.core("alice").delete_namespaced_pod("trainer", ns)
    wait_gone(cluster, ns, claim["metadata"]["name"])
    verified_attestation(cluster, uid)
    wait_for(lambda: fence_of(cluster, uid) is None, WAIT_S, f"the agent lifting its fence {name}")
    assert fence_records(cluster) == [record]
    assert fence_deletions(cluster, "deny") == 1 and fence_deletions(cluster, "allow") >= 1
    assert_invariant(cluster)
