"""Shared fixtures: the default policy, the repo's paths, and builders of DRA objects in every API version."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from scrubgate.policies.config import PolicyConfig, load_policy

REPO_ROOT = Path(__file__).resolve().parents[1]

RESOURCE_VERSIONS = ("v1", "v1beta2", "v1beta1", "v1alpha3")
# v1 and v1beta2 put the device fields under `exactly` (or `firstAvailable`); v1beta1 and v1alpha3 on the request.
STRUCTURED_VERSIONS = ("v1", "v1beta2")
FLAT_VERSIONS = ("v1beta1", "v1alpha3")

# kind -> (apiVersion, path from the object to its PodSpec)
POD_CARRIERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Pod": ("v1", ("spec",)),
    "PodTemplate": ("v1", ("template", "spec")),
    "ReplicationController": ("v1", ("spec", "template", "spec")),
    "Deployment": ("apps/v1", ("spec", "template", "spec")),
    "StatefulSet": ("apps/v1", ("spec", "template", "spec")),
    "ReplicaSet": ("apps/v1", ("spec", "template", "spec")),
    "DaemonSet": ("apps/v1", ("spec", "template", "spec")),
    "Job": ("batch/v1", ("spec", "template", "spec")),
    "CronJob": ("batch/v1", ("spec", "jobTemplate", "spec", "template", "spec")),
}


def device_request(
    version: str,
    device_class: str = "gpu.nvidia.com",
    *,
    shape: str = "exactly",
    admin_access: bool | None = None,
    tolerations: list[dict[str, Any]] | None = None,
    name: str = "gpu",
) -> dict[str, Any]:
    """One request in the shape of `version`; `shape` is `exactly` or `firstAvailable` (v1/v1beta2 only)."""
    fields: dict[str, Any] = {"deviceClassName": device_class}
    if admin_access is not None:
        fields["adminAccess"] = admin_access
    if tolerations is not None:
        fields["tolerations"] = tolerations
    if version in FLAT_VERSIONS:
        return {"name": name, **fields}
    if shape == "firstAvailable":
        # adminAccess is not a field of a subrequest; the first alternative is a non-GPU class on purpose.
        sub = {k: v for k, v in fields.items() if k != "adminAccess"}
        return {
            "name": name,
            "firstAvailable": [{"name": "other", "deviceClassName": "cpu.example.com"}, {"name": "a", **sub}],
        }
    return {"name": name, "exactly": fields}


def claim(
    version: str = "v1",
    kind: str = "ResourceClaim",
    *,
    requests: list[dict[str, Any]] | None = None,
    namespace: str = "team-a",
    name: str = "gpu-claim",
    annotations: dict[str, Any] | None = None,
    template_annotations: dict[str, Any] | None = None,
    finalizers: list[str] | None = None,
) -> dict[str, Any]:
    """A ResourceClaim or ResourceClaimTemplate; a template carries `template_annotations` in spec.metadata."""
    meta: dict[str, Any] = {"namespace": namespace, "name": name}
    if annotations is not None:
        meta["annotations"] = annotations
    if finalizers is not None:
        meta["finalizers"] = finalizers
    devices = {"devices": {"requests": requests if requests is not None else [device_request(version)]}}
    if kind == "ResourceClaimTemplate":
        spec: dict[str, Any] = {"spec": devices}
        if template_annotations is not None:
            spec["metadata"] = {"annotations": template_annotations}
    else:
        spec = devices
    return {"apiVersion": f"resource.k8s.io/{version}", "kind": kind, "metadata": meta, "spec": spec}


def pod_spec(
    *,
    template: str | None = "gpu-template",
    claim_name: str | None = None,
    grace: Any = 60,
    tolerations: list[dict[str, Any]] | None = None,
    old_source: bool = False,
) -> dict[str, Any]:
    """A PodSpec with one DRA claim entry (by template or by name); `grace=None` leaves the field out;
    `old_source` nests the reference under `source` as Kubernetes 1.26-1.30 did."""
    ref = {"resourceClaimTemplateName": template} if claim_name is None else {"resourceClaimName": claim_name}
    entry = {"name": "gpu", "source": ref} if old_source else {"name": "gpu", **ref}
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": [entry],
    }
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    if tolerations is not None:
        spec["tolerations"] = tolerations
    return spec


def carrier(kind: str, spec: dict[str, Any], *, namespace: str = "team-a", name: str = "workload") -> dict[str, Any]:
    """`spec` as the PodSpec of a Pod or of the pod template of a workload kind."""
    api_version, path = POD_CARRIERS[kind]
    obj: dict[str, Any] = {"apiVersion": api_version, "kind": kind, "metadata": {"namespace": namespace, "name": name}}
    node = obj
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = spec
    return obj


@pytest.fixture(scope="session")
def policy() -> PolicyConfig:
    return load_policy()


@pytest.fixture(scope="session")
def dra() -> SimpleNamespace:
    """The builders above, for test modules (conftest is not imported directly)."""
    return SimpleNamespace(
        claim=claim,
        device_request=device_request,
        pod_spec=pod_spec,
        carrier=carrier,
        spec_path=lambda kind: POD_CARRIERS[kind][1],
    )


# Parametrizing fixtures: a test that takes one runs once per value.
@pytest.fixture(params=RESOURCE_VERSIONS)
def resource_version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=STRUCTURED_VERSIONS)
def structured_version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=FLAT_VERSIONS)
def flat_version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=("ResourceClaim", "ResourceClaimTemplate"))
def claim_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=tuple(POD_CARRIERS))
def carrier_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=tuple(k for k in POD_CARRIERS if k != "Pod"))
def workload_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]):
    """`scrubgate ARGS...` in this process: returns (exit code, stdout, stderr)."""
    from scrubgate.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run
