"""SG007 on a claim or template that arrives already carrying the agent's annotations or a break-glass reason."""

import pytest
from scrubgate.policies import names
from scrubgate.policies.config import load_policy
from scrubgate.policies.engine import Admission, validate

POLICY = load_policy()
AGENT = POLICY.agent.identities[0]


def claim(annotations: dict[str, str]) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "team-a", "annotations": annotations},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }


def template(annotations: dict[str, str]) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "team-a"},
        "spec": {
            "metadata": {"annotations": annotations},
            "spec": {"devices": {"requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com"}]}},
        },
    }


def sg007(obj: dict, admission: Admission | None) -> list:
    return [f for f in validate(obj, POLICY, trusted=True, admission=admission) if f.rule == "SG007"]


@pytest.mark.parametrize("key", [names.ANNOTATION_SCRUB_STATUS, names.ANNOTATION_ATTESTATION, names.ANNOTATION_DEVICES])
@pytest.mark.parametrize("build", [claim, template])
def test_tenant_cannot_create_with_agent_annotations(key: str, build) -> None:
    found = sg007(build({key: "verified"}), Admission("CREATE", username="alice", groups=("system:authenticated",)))
    assert len(found) == 1 and found[0].action == "deny"
    assert key in found[0].message and "alice" in found[0].message
    assert found[0].path.endswith("annotations/" + key.replace("/", "~1"))


def test_template_annotations_are_checked_where_they_are_copied_from() -> None:
    found = sg007(template({names.ANNOTATION_SCRUB_STATUS: "verified"}), Admission("CREATE", username="alice"))
    assert found[0].path.startswith("/spec/metadata/annotations/")


def test_break_glass_on_create_needs_an_admin() -> None:
    obj = claim({names.ANNOTATION_BREAK_GLASS: "node lost"})
    assert sg007(obj, Admission("CREATE", username="alice", groups=("tenants",)))
    assert not sg007(obj, Admission("CREATE", username="root", groups=("system:masters",)))


def test_agent_and_plain_annotations_pass() -> None:
    assert not sg007(claim({names.ANNOTATION_SCRUB_STATUS: "fenced"}), Admission("CREATE", username=AGENT))
    assert not sg007(claim({names.ANNOTATION_DEALLOCATION_POLICY: "Delete"}), Admission("CREATE", username="alice"))


def test_manifests_carrying_agent_annotations_are_findings() -> None:
    assert sg007(claim({names.ANNOTATION_ATTESTATION: "x.y.z"}), None)


def test_rule_off_disables_the_check() -> None:
    from scrubgate.policies.config import parse_policy

    policy = parse_policy({"rules": {"SG007": {"action": "off"}}})
    obj = claim({names.ANNOTATION_SCRUB_STATUS: "verified"})
    assert not [
        f for f in validate(obj, policy, trusted=True, admission=Admission("CREATE", "alice")) if f.rule == "SG007"
    ]
