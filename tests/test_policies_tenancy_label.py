"""SG010: `scrubgate.dev/tenancy=trusted` switches the multi-tenant rules off in a namespace, so setting,
changing or removing it is for the policy's admin groups only, and every change is recorded."""

from __future__ import annotations

from typing import Any

import pytest
from scrubgate.policies import names
from scrubgate.policies.config import parse_policy
from scrubgate.policies.engine import Admission, validate

PATH = "/metadata/labels/scrubgate.dev~1tenancy"


def namespace(tenancy: str | None = None, **labels: str) -> dict[str, Any]:
    if tenancy is not None:
        labels[names.TENANCY_LABEL] = tenancy
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a", "labels": labels}}


def write(new, old, policy, groups=("tenant-admins",), user="alice"):
    operation = "CREATE" if old is None else "UPDATE"
    return validate(new, policy, trusted=False, admission=Admission(operation, user, tuple(groups), old_object=old))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (None, namespace(names.TENANCY_TRUSTED)),
        (namespace(), namespace(names.TENANCY_TRUSTED)),
        (namespace(names.TENANCY_TRUSTED), namespace()),
        (namespace("shared"), namespace(names.TENANCY_TRUSTED)),
        (namespace(names.TENANCY_TRUSTED), namespace("")),
    ],
    ids=["create-trusted", "add", "remove", "change", "blank"],
)
def test_a_tenancy_change_by_a_non_admin_is_denied(policy, old, new):
    (finding,) = write(new, old, policy)
    assert (finding.rule, finding.action, finding.path) == ("SG010", "deny", PATH)
    assert "user 'alice' changed scrubgate.dev/tenancy of namespace 'team-a'" in finding.message
    assert "admin groups (system:masters)" in finding.message


@pytest.mark.parametrize("action", ["deny", "warn", "audit", "off"])
def test_an_admins_change_is_allowed_and_always_audited(action):
    policy = parse_policy({"rules": {"SG010": {"action": action}}})
    found = write(namespace(names.TENANCY_TRUSTED), namespace(), policy, groups=("system:masters",), user="root")
    expected = [] if action == "off" else [("SG010", "audit")]
    assert [(f.rule, f.action) for f in found] == expected
    if found:
        assert "admin 'root' changed scrubgate.dev/tenancy of namespace 'team-a' from None to 'trusted'" in (
            found[0].message
        )


def test_other_namespace_writes_pass(policy):
    assert write(namespace(team="a"), None, policy) == []
    assert write(namespace(names.TENANCY_TRUSTED, team="b"), namespace(names.TENANCY_TRUSTED, team="a"), policy) == []


def test_the_policy_names_the_label():
    policy = parse_policy({"tenancy": {"label": "example.com/single-tenant"}})
    relabelled = namespace()
    relabelled["metadata"]["labels"]["example.com/single-tenant"] = "trusted"
    assert [f.rule for f in write(relabelled, namespace(), policy)] == ["SG010"]


def test_namespaces_in_ci_have_no_author_to_check(policy):
    assert validate(namespace(names.TENANCY_TRUSTED), policy, trusted=True) == []
