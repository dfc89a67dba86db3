"""SG007's fence guard: a DeviceTaintRule with a scrubgate.dev/ taint (the node agent's fence) is deleted,
or its spec changed, only by the agent; an admin may, recorded as an audit finding; anyone else is denied.
Creating one only fences more, and a write that leaves its spec alone moves no fence: both allowed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from scrubgate.policies import names
from scrubgate.policies.config import PolicyConfig, load_policy, parse_policy
from scrubgate.policies.engine import Admission, Operation, validate
from scrubgate.policies.findings import Finding
from scrubgate.policies.model import fence_key

POLICY = load_policy()
AGENT = POLICY.agent.identities[0]
TENANT, TENANT_GROUPS = "ns-admin", ("team-a", "system:authenticated")
ADMIN, ADMIN_GROUPS = "root-admin", ("system:masters", "system:authenticated")
VERSIONS = ("v1", "v1beta2", "v1alpha3")
SELECTOR = {"driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0"}


def fence(version: str = "v1", key: str = names.TAINT_UNSANITIZED, **spec: Any) -> dict[str, Any]:
    """A DeviceTaintRule in the agent's shape (sanitizer_agent/fences.py) as the API server stores it."""
    return {
        "apiVersion": f"{names.RESOURCE_GROUP}/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": "scrubgate-unsanitized-0123456789abcdef0123",
            "uid": "d7r00000-0000-4000-8000-000000000001",
            "resourceVersion": "42",
            "labels": {"app.kubernetes.io/managed-by": "scrubgate-agent", "scrubgate.dev/claim-uid": "uid-1"},
            "annotations": {"scrubgate.dev/node": "node-1", "scrubgate.dev/claim": "team-a/train-0"},
        },
        "spec": {
            "deviceSelector": dict(SELECTOR),
            "taint": {"key": key, "value": "uid-1", "effect": "NoSchedule", "timeAdded": "2025-01-01T00:00:00Z"},
            **spec,
        },
    }


def admit(
    operation: Operation,
    old: dict[str, Any] | None,
    new: dict[str, Any] | None = None,
    user: str = TENANT,
    groups: tuple[str, ...] = TENANT_GROUPS,
    policy: PolicyConfig = POLICY,
    subresource: str = "",
    node: str = "node-1",
) -> list[Finding]:
    """`user`'s request, its credentials bound to `node` (where the fence's agent runs)."""
    admission = Admission(operation, user, groups, old_object=old, subresource=subresource, node=node)
    return validate(new, policy, trusted=False, admission=admission)


def respecced(old: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """`old` with spec fields replaced (deviceSelector, taint)."""
    new = copy.deepcopy(old)
    new["spec"].update(changes)
    return new


def only(findings: list[Finding], path: str = "/spec") -> Finding:
    assert len(findings) == 1, findings
    finding = findings[0]
    assert (finding.rule, finding.path, finding.patch) == ("SG007", path, ())
    return finding


# ---------------------------------------------------------------------- DELETE


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("key", [names.TAINT_UNSANITIZED, names.TAINT_SCRUB_FAILED])
def test_a_user_deleting_a_fence_is_denied(version: str, key: str):
    finding = only(admit("DELETE", fence(version, key)))
    assert finding.action == "deny"
    assert finding.message.startswith(
        f"user {TENANT!r} deleted DeviceTaintRule 'scrubgate-unsanitized-0123456789abcdef0123', scrubgate's fence "
        f"({key}) on gpu.nvidia.com/node-1/gpu-0: only the scrubgate node agent lifts or changes its fences"
    )
    assert "system:masters" in finding.message  # who may, for the operator reading the denial


def test_the_agent_lifts_its_fences():
    for key in (names.TAINT_UNSANITIZED, names.TAINT_SCRUB_FAILED):
        assert admit("DELETE", fence(key=key), user=AGENT, groups=("system:serviceaccounts",)) == []


def test_an_admin_may_lift_a_fence_and_is_recorded():
    finding = only(admit("DELETE", fence(), user=ADMIN, groups=ADMIN_GROUPS))
    assert finding.action == "audit"
    assert finding.message == (
        f"admin {ADMIN!r} deleted DeviceTaintRule 'scrubgate-unsanitized-0123456789abcdef0123', scrubgate's fence "
        f"({names.TAINT_UNSANITIZED}) on gpu.nvidia.com/node-1/gpu-0; the device is not attested clean"
    )


def test_the_agents_name_alone_is_not_enough():
    """Identity is the username the policy names, not a look-alike group or a username in a group."""
    assert only(admit("DELETE", fence(), user="scrubgate-agent", groups=(AGENT,))).action == "deny"


def test_admin_groups_come_from_the_policy():
    policy = parse_policy({"adminGroups": ["gpu-admins"]})
    assert only(admit("DELETE", fence(), user=ADMIN, groups=ADMIN_GROUPS, policy=policy)).action == "deny"
    assert only(admit("DELETE", fence(), user="ops", groups=("gpu-admins",), policy=policy)).action == "audit"


def test_rules_that_are_not_scrubgates_are_left_alone():
    other = fence(key="example.com/maintenance")
    assert admit("DELETE", other) == []
    assert admit("UPDATE", other, respecced(other, deviceSelector={"driver": "other"})) == []
    # A look-alike domain is not scrubgate's.
    assert admit("DELETE", fence(key="scrubgate.dev.example.com/unsanitized")) == []


@pytest.mark.parametrize(
    "shape",
    [
        {"apiVersion": "example.com/v1", "kind": "DeviceTaintRule"},
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice"},
        {"spec": "not a mapping"},
        {"spec": {"taint": "not a mapping"}},
        {"spec": {"taint": {"key": 7}}},
    ],
    ids=["other-group", "other-kind", "spec-not-a-map", "taint-not-a-map", "key-not-a-string"],
)
def test_objects_without_a_scrubgate_taint_key_are_not_fences(shape: dict[str, Any]):
    obj = {**fence(), **shape}
    assert fence_key(obj) == ""
    assert admit("DELETE", obj) == []


def test_the_fence_key():
    assert fence_key(fence()) == names.TAINT_UNSANITIZED
    assert all(fence_key(fence(version)) for version in VERSIONS)


# ---------------------------------------------------------------------- UPDATE


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "change",
    [
        {"deviceSelector": {**SELECTOR, "device": "gpu-1"}},  # the fence moves to another device
        {"deviceSelector": {}},
        {"taint": {"key": "example.com/other", "effect": "NoSchedule"}},  # no longer scrubgate's
        {"taint": {"key": names.TAINT_UNSANITIZED, "effect": "None"}},  # still there, no effect
        {"taint": {"key": names.TAINT_UNSANITIZED, "value": "x", "effect": "NoSchedule"}},
    ],
    ids=["other-device", "empty-selector", "other-key", "effect-none", "value-changed"],
)
def test_a_user_changing_a_fences_spec_is_denied(version: str, change: dict[str, Any]):
    old = fence(version)
    finding = only(admit("UPDATE", old, respecced(old, **change)))
    assert finding.action == "deny"
    assert finding.message.startswith(f"user {TENANT!r} changed the spec of DeviceTaintRule")
    # The agent may, where the result is still a NoSchedule fence of one device of its node (it never does: it
    # creates and deletes); an admin may, recorded.
    still_a_fence = "deviceSelector" not in change or change["deviceSelector"]
    still_a_fence = still_a_fence and change.get("taint", {}).get("effect", "NoSchedule") == "NoSchedule"
    still_a_fence = still_a_fence and change.get("taint", {}).get("key", names.TAINT_UNSANITIZED).startswith(
        "scrubgate.dev/"
    )
    by_agent = admit("UPDATE", old, respecced(old, **change), user=AGENT)
    assert by_agent == [] if still_a_fence else [f.rule for f in by_agent] == ["SG007"]
    admin = only(admit("UPDATE", old, respecced(old, **change), user=ADMIN, groups=ADMIN_GROUPS))
    assert admin.action == "audit" and "changed the spec of" in admin.message


def test_a_spec_dropped_altogether_is_a_change():
    old = fence()
    new = copy.deepcopy(old)
    del new["spec"]
    assert only(admit("UPDATE", old, new)).action == "deny"


def test_an_update_that_leaves_the_spec_alone_is_allowed():
    old = fence()
    new = copy.deepcopy(old)
    new["metadata"]["labels"]["team"] = "a"
    new["metadata"]["annotations"] = {}
    new["metadata"]["finalizers"] = ["example.com/keep"]
    assert admit("UPDATE", old, new) == []
    # A write through the status subresource keeps spec, too.
    status = {**copy.deepcopy(old), "status": {"conditions": [{"type": "EvictionInProgress", "status": "False"}]}}
    assert admit("UPDATE", old, status, subresource="status") == []


def test_an_update_that_makes_a_rule_a_fence_only_fences_more():
    old = fence(key="example.com/maintenance")
    assert admit("UPDATE", old, respecced(old, taint={"key": names.TAINT_UNSANITIZED, "effect": "NoSchedule"})) == []


def test_a_malformed_new_object_is_a_change():
    """Fail closed: an UPDATE whose object cannot be read does not slip past as "spec unchanged"."""
    assert only(admit("UPDATE", fence(), None)).action == "deny"  # type: ignore[arg-type]


# ---------------------------------------------------------------------- CREATE, CI and the policy's action


def test_creating_a_fence_is_allowed_to_anyone():
    assert admit("CREATE", None, fence()) == []
    assert validate(fence(), POLICY, trusted=False) == []  # in a manifest (CI), too


def test_the_rules_action_applies_to_the_denial_but_not_to_the_admins_record():
    warn = parse_policy({"rules": {"SG007": {"action": "warn"}}})
    assert only(admit("DELETE", fence(), policy=warn)).action == "warn"
    assert only(admit("DELETE", fence(), user=ADMIN, groups=ADMIN_GROUPS, policy=warn)).action == "audit"
    off = parse_policy({"rules": {"SG007": {"action": "off"}}})
    assert admit("DELETE", fence(), policy=off) == []
    assert admit("DELETE", fence(), user=ADMIN, groups=ADMIN_GROUPS, policy=off) == []


def test_a_pod_delete_still_goes_to_the_force_delete_rule():
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team-a"},
        "spec": {"nodeName": "node-1", "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]},
        "status": {"phase": "Running"},
    }
    admission = Admission("DELETE", TENANT, TENANT_GROUPS, old_object=pod, options={"gracePeriodSeconds": 0})
    assert [f.rule for f in validate(None, POLICY, trusted=False, admission=admission)] == ["SG008"]


def test_an_agent_lifts_only_its_own_nodes_fences():
    """The node the agent named on the fence (else its device's pool) must be the one its credentials name."""
    agent = {"user": AGENT, "groups": ("system:serviceaccounts",)}
    assert admit("DELETE", fence(), **agent, node="node-1") == []
    assert "the agent of node 'node-2' acted on fence" in only(admit("DELETE", fence(), **agent, node="node-2")).message
    unnamed = fence()
    del unnamed["metadata"]["annotations"]["scrubgate.dev/node"]
    pool = unnamed["spec"]["deviceSelector"]["pool"]
    assert admit("DELETE", unnamed, **agent, node=pool) == []
    assert only(admit("DELETE", unnamed, **agent, node=f"not-{pool}")).action == "deny"


def gpu_node(*taints: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}, "spec": {"taints": list(taints)}}


NODE_FENCE = {"key": names.TAINT_UNSANITIZED, "effect": "NoSchedule"}


def test_only_the_nodes_agent_lifts_its_node_taint_fence():
    """The fallback fence (no DeviceTaintRule API served) is guarded as a DeviceTaintRule is: its node's
    agent, an admin (audited), nobody else; adding one, or another taint's change, is no business of SG007."""
    fenced, lifted = gpu_node(NODE_FENCE), gpu_node()
    agent = {"user": AGENT, "groups": ("system:serviceaccounts",)}
    assert admit("UPDATE", fenced, lifted, **agent, node="node-1") == []
    assert (
        "the agent of node 'node-2' acted on the taints of node 'node-1'"
        in only(admit("UPDATE", fenced, lifted, **agent, node="node-2"), "/spec/taints").message
    )
    assert only(admit("UPDATE", fenced, lifted), "/spec/taints").message.startswith(
        f"user {TENANT!r} lifted scrubgate's fence"
    )
    admin = only(admit("UPDATE", fenced, lifted, user="root", groups=("system:masters",)), "/spec/taints")
    assert admin.action == "audit" and "lifted scrubgate's fence" in admin.message
    other = {"key": "example.com/maintenance", "effect": "NoSchedule"}
    assert admit("UPDATE", lifted, fenced) == [], "fencing more"
    assert admit("UPDATE", gpu_node(NODE_FENCE, other), gpu_node(NODE_FENCE)) == []


# ---------------------------------------------------------------------- what an agent's token may write (issue 28.4)

AGENT_AT = {"user": AGENT, "groups": ("system:serviceaccounts",)}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"taint": {"key": names.TAINT_UNSANITIZED, "effect": "NoExecute"}}, "not a scrubgate.dev/ NoSchedule fence"),
        ({"taint": {"key": "example.com/evict", "effect": "NoSchedule"}}, "not a scrubgate.dev/ NoSchedule fence"),
        ({"deviceSelector": {"driver": "gpu.nvidia.com"}}, "does not name exactly one device"),
        ({"deviceSelector": {**SELECTOR, "pool": "node-2"}}, "acted on the device pool 'node-2'"),
    ],
    ids=["no-execute", "other-key", "every-gpu", "other-node"],
)
def test_an_agent_creates_only_noschedule_fences_of_its_own_nodes_devices(change, problem):
    """One node's token must not evict every GPU workload (a NoExecute rule over every GPU) or fence another
    node's devices."""
    assert admit("CREATE", None, fence(), **AGENT_AT) == []
    wanted = fence()
    wanted["spec"] = {**wanted["spec"], **change}
    (finding,) = admit("CREATE", None, wanted, **AGENT_AT)
    assert finding.rule == "SG007" and problem in finding.message
    assert admit("CREATE", None, wanted) == [], "anyone else's rule only fences more"


def test_an_agent_changes_nothing_of_a_node_but_its_own_fence_taints():
    plain = gpu_node()
    assert admit("UPDATE", plain, gpu_node(NODE_FENCE), **AGENT_AT, node="node-1") == []
    labelled = copy.deepcopy(plain)
    labelled["metadata"]["labels"] = {"gpu": "none"}
    assert "beyond its own scrubgate.dev/ taints" in only(admit("UPDATE", plain, labelled, **AGENT_AT)).message
    cordoned = copy.deepcopy(plain)
    cordoned["spec"]["unschedulable"] = True
    assert "beyond its own" in only(admit("UPDATE", plain, cordoned, **AGENT_AT)).message
    evicting = {"key": names.TAINT_UNSANITIZED, "effect": "NoExecute"}
    assert "NoSchedule only" in only(admit("UPDATE", plain, gpu_node(evicting), **AGENT_AT), "/spec/taints").message
    other = only(admit("UPDATE", plain, gpu_node(NODE_FENCE), **AGENT_AT, node="node-2"), "/metadata/name")
    assert "the agent of node 'node-2' acted on node 'node-1'" in other.message
    assert admit("UPDATE", plain, labelled, user="kubelet") == [], "other writers' node changes are not SG007's"
