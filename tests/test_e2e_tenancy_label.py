"""SG010 end to end (real kube-apiserver, real webhook): the tenancy label of a namespace is set only by the
policy's admin groups, whichever write carries it. A Namespace's `status` and `finalize` subresources write
its labels too (their update strategies keep only the spec, or only the status, of the stored object), so the
fence webhook is sent those as well: an operator whom RBAC lets write them cannot mark a namespace trusted."""

from __future__ import annotations

import e2e_support
import pytest
from e2e_support import expect_denied, grant
from scrubgate.policies import names

from devcluster.harness import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

cluster_factory_fixture = e2e_support.cluster_factory_fixture
cluster_fixture = e2e_support.cluster_fixture

SUBRESOURCES = ("", "status", "finalize")


def label_records(cluster: Cluster, namespace: str) -> list[tuple[str, str, str]]:
    """(decision, user, subresource) of the webhook's audit records about `namespace`."""
    return [
        (r["decision"], r["user"], r.get("subResource") or "")
        for r in cluster.audit_records()
        if r["kind"] == "Namespace" and r["name"] == namespace
    ]


def labelled(cluster: Cluster, namespace: str, value: str) -> dict:
    body = cluster.request("GET", f"/api/v1/namespaces/{namespace}")
    body["metadata"].setdefault("labels", {})[names.TENANCY_LABEL] = value
    return body


def test_the_tenancy_label_is_an_admins_through_every_namespace_write(cluster: Cluster) -> None:
    namespace = "tenancy-target"
    cluster.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    )
    rules = [
        {
            "apiGroups": [""],
            "resources": [f"namespaces{'/' + s if s else ''}" for s in SUBRESOURCES],
            "verbs": ["get", "update"],
        }
    ]
    grant(cluster, "bob", "namespace-writer-bob", rules)
    bob = cluster.users["bob"].name

    for subresource in SUBRESOURCES:
        path = f"/api/v1/namespaces/{namespace}" + (f"/{subresource}" if subresource else "")
        body = labelled(cluster, namespace, names.TENANCY_TRUSTED)
        message = expect_denied(lambda path=path, body=body: cluster.request("PUT", path, body, user="bob"), "SG010")
        assert 'admission webhook "validate-fences.scrubgate.dev"' in message, message
        labels = cluster.request("GET", f"/api/v1/namespaces/{namespace}")["metadata"].get("labels") or {}
        assert names.TENANCY_LABEL not in labels, f"set through {subresource or 'the namespace itself'}"
    assert label_records(cluster, namespace) == [("deny", bob, s) for s in SUBRESOURCES]

    # An admin may, through a subresource too, and it is recorded.
    cluster.request(
        "PUT", f"/api/v1/namespaces/{namespace}/status", labelled(cluster, namespace, names.TENANCY_TRUSTED)
    )
    labels = cluster.request("GET", f"/api/v1/namespaces/{namespace}")["metadata"]["labels"]
    assert labels[names.TENANCY_LABEL] == names.TENANCY_TRUSTED
    assert label_records(cluster, namespace)[-1] == ("audit", cluster.users["admin"].name, "status")
