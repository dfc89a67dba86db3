"""Fixtures and helpers for the end-to-end tests: a whole installation (the real control plane, webhook,
agent as separate processes; devcluster.harness) and what tenants do on it.

In a test module (pytest finds fixtures among the module's attributes; the fixtures are named
``cluster_factory`` and ``cluster``, so test parameters of those names shadow no import)::

    import e2e_support
    from e2e_support import assert_invariant, tenant_job, tenant_namespace, ...

    cluster_factory_fixture = e2e_support.cluster_factory_fixture
    cluster_fixture = e2e_support.cluster_fixture

    @pytest.mark.e2e
    def test_something(cluster):
        ns = tenant_namespace(cluster, "team-a")
        create_template(cluster, "alice", ns, "one-gpu", "v1beta1")
        pod = tenant_job(cluster, "alice", ns, template="one-gpu", canary="SECRET", run_seconds=1)
        ...
        assert_invariant(cluster)

Every cluster's process logs are attached to the test report (pytest shows them when the test fails).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from scrubgate.policies import names
from scrubgate.policies.attestation import check_claim_attestation

from devcluster import workloads
from devcluster.harness import Cluster, HarnessError, Observed, denial, wait_for
from devcluster.kubelet import CANARY_FOUND

WAIT_S = 30.0
_seq = itertools.count()


@pytest.fixture(name="cluster_factory")
def cluster_factory_fixture(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Cluster]]:
    """``cluster_factory(gpus=8, mig_per_gpu=7, resource_versions=["v1beta1"], agent_args=[...])`` starts a
    cluster (keyword arguments of ``Cluster``); all are stopped at teardown, their logs attached."""
    started: list[Cluster] = []

    def start(**kwargs: Any) -> Cluster:
        workdir = tmp_path / f"cluster-{len(started)}"
        cluster = Cluster(workdir, **kwargs)
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in started:
        request.node.add_report_section("teardown", f"devcluster logs ({cluster.paths.root})", cluster.diagnostics(60))
        cluster.stop()


@pytest.fixture(name="cluster")
def cluster_fixture(cluster_factory: Callable[..., Cluster]) -> Cluster:
    """A fresh installation: one node with 2 simulated GPUs, tenants alice and bob."""
    return cluster_factory(gpus=2)


# ---------------------------------------------------------------------- tenants


def tenant_namespace(
    cluster: Cluster, prefix: str = "team", trusted: bool = False, labels: dict[str, str] | None = None
) -> str:
    """A new namespace (multi-tenant unless ``trusted``); the name is unique within the cluster."""
    name = f"{prefix}-{next(_seq)}"
    cluster.create_namespace(name, trusted=trusted, labels=labels)
    return name


def create_template(
    cluster: Cluster, user: str, namespace: str, name: str, version: str = "v1", **request: Any
) -> dict:
    """A ResourceClaimTemplate created by ``user`` in ``version`` (raw JSON through the official client,
    which has no typed v1alpha3 claim API)."""
    body = workloads.claim_template(name, version, **request)
    return cluster.request(
        "POST", cluster.resource_path("resourceclaimtemplates", namespace, version=version), body, user=user
    )


def patch_claim(cluster: Cluster, user: str, namespace: str, name: str, ops: list[dict], version: str = "v1") -> dict:
    """A JSON patch of a ResourceClaim by ``user`` in ``version``."""
    path = cluster.resource_path("resourceclaims", namespace, name, version=version)
    return cluster.request("PATCH", path, ops, user=user, content_type="application/json-patch+json")


def tenant_job(
    cluster: Cluster,
    user: str,
    namespace: str,
    *,
    template: str,
    name: str = "job",
    canary: str | None = None,
    look_for: str | None = None,
    run_seconds: float | None = None,
    grace: int = 60,
) -> str:
    """A Job created by ``user``; returns the name of the pod kube-controller-manager's Job controller made."""
    annotations = workloads.workload_annotations(canary, look_for, run_seconds)
    job = workloads.job(name, namespace, template=template, grace=grace, annotations=annotations)
    return cluster.create_job(user, job)


def tenant_pod(
    cluster: Cluster,
    user: str,
    namespace: str,
    name: str,
    *,
    template: str,
    canary: str | None = None,
    look_for: str | None = None,
    run_seconds: float | None = None,
    grace: int = 60,
) -> str:
    annotations = workloads.workload_annotations(canary, look_for, run_seconds)
    body = workloads.pod(name, template=template, grace=grace, annotations=annotations)
    return cluster.core(user).create_namespaced_pod(namespace, body).metadata.name


def wait_phase(cluster: Cluster, namespace: str, pod: str, *phases: str, timeout: float = WAIT_S) -> dict:
    return wait_for(
        lambda: (p := cluster.pod(namespace, pod)) and p.get("status", {}).get("phase") in phases and p,
        timeout,
        f"pod {namespace}/{pod} in phase {' or '.join(phases)}",
    )


def wait_gone(cluster: Cluster, namespace: str, claim: str, timeout: float = WAIT_S) -> None:
    wait_for(lambda: cluster.claim(namespace, claim) is None, timeout, f"claim {namespace}/{claim} deleted")


def allocated_device(claim: dict) -> tuple[str, str, str]:
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return result["driver"], result["pool"], result["device"]


def running_claim(cluster: Cluster, namespace: str, pod: str) -> dict:
    """The pod's (generated) claim once the pod runs."""
    wait_phase(cluster, namespace, pod, "Running", "Succeeded")
    name = wait_for(lambda: cluster.pod_claim(namespace, pod), WAIT_S, f"the claim of pod {namespace}/{pod}")
    claim = cluster.claim(namespace, name)
    assert claim is not None, f"claim {namespace}/{name} of running pod {pod} does not exist"
    return claim


def canary_found(pod: dict) -> bool | None:
    """The kubelet's verdict for a pod with ``look_for``: True, False, or None when not reported."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond["type"] == CANARY_FOUND:
            return cond["status"] == "True"
    return None


def grant(cluster: Cluster, user: str, name: str, rules: list[dict]) -> None:
    """A ClusterRole with `rules`, bound to `user` (an operator role given too widely)."""
    rbac = "rbac.authorization.k8s.io"
    cluster.apply({"apiVersion": f"{rbac}/v1", "kind": "ClusterRole", "metadata": {"name": name}, "rules": rules})
    cluster.apply(
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": name},
            "subjects": [{"apiGroup": rbac, "kind": "User", "name": cluster.users[user].name}],
        }
    )


def expect_denied(call: Callable[[], object], rule: str) -> str:
    """Runs a request that the webhook must deny under ``rule``; returns the API server's message."""
    status, message = denial(call)
    assert status >= 400 and rule in message, f"expected a {rule} denial, got HTTP {status}: {message}"
    return message


# ---------------------------------------------------------------------- what the observer saw


def claim_history(cluster: Cluster, uid: str) -> list[Observed]:
    return [e for e in cluster.observer.claims() if e.obj["metadata"].get("uid") == uid]


def fence_history(cluster: Cluster, claim_uid: str) -> list[Observed]:
    """The agent's DeviceTaintRules for one claim (it labels each with the claim's UID)."""
    return [
        e
        for e in cluster.observer.taint_rules()
        if (e.obj["metadata"].get("labels") or {}).get("scrubgate.dev/claim-uid") == claim_uid
    ]


def verified_attestation(cluster: Cluster, uid: str) -> dict:
    """The payload of the first attestation seen on claim ``uid`` that verifies against the agent's key (waited
    for: callers know it was written from a direct read, which the observer's watch may trail)."""

    def first_attested() -> Observed | None:
        return next(
            (
                e
                for e in claim_history(cluster, uid)
                if names.ANNOTATION_ATTESTATION in (e.obj["metadata"].get("annotations") or {})
            ),
            None,
        )

    try:
        event = wait_for(first_attested, WAIT_S, f"the observer to see an attestation on claim uid {uid}")
    except HarnessError as exc:
        raise AssertionError(f"no attestation was ever seen on claim uid {uid}") from exc
    token = event.obj["metadata"]["annotations"][names.ANNOTATION_ATTESTATION]
    return check_claim_attestation(token, event.obj, cluster.public_keys)


def assert_invariant(cluster: Cluster) -> None:
    """No device allocated while dirty and no finalizer removed without a verified attestation, over
    everything the observer saw (up to now); and the audit log's chain verifies."""
    cluster.observer.sync()
    violations = cluster.observer.violations(cluster.public_keys)
    assert not violations, "scrubgate's invariant broke:\n" + "\n".join(violations)
    result = cluster.verify_audit()
    assert result.returncode == 0, f"scrubgate audit verify: {result.stdout}{result.stderr}"
