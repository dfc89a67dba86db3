"""What tenants submit, in the shape each resource.k8s.io version wants: claim templates, claims, pods
and Jobs. Shared by the demo and the end-to-end tests.

``v1``/``v1beta2`` nest a request's fields under ``exactly``; ``v1beta1``/``v1alpha3`` keep them flat
on the request (the official client refuses the other shape for a version).
"""

from __future__ import annotations

from typing import Any

from scrubgate.policies import names

from .kubelet import CANARY, LOOK_FOR, RUN_SECONDS

GROUP = names.RESOURCE_GROUP
VERSIONS = names.RESOURCE_VERSIONS  # v1, v1beta2, v1beta1, v1alpha3
NESTED_VERSIONS = frozenset({"v1", "v1beta2"})
GPU_CLASS = "gpu.nvidia.com"
MIG_CLASS = "mig.nvidia.com"
DRIVER = "gpu.nvidia.com"


def uuid_selector(device_uuid: str) -> dict[str, Any]:
    """A CEL selector for exactly one device (the next tenant asks for the GPU the last one used)."""
    return {"cel": {"expression": f'device.attributes["{DRIVER}"].uuid == "{device_uuid}"'}}


def device_request(
    version: str,
    *,
    name: str = "gpu",
    device_class: str = GPU_CLASS,
    selectors: list[dict[str, Any]] | None = None,
    tolerations: list[dict[str, Any]] | None = None,
    admin_access: bool = False,
) -> dict[str, Any]:
    fields: dict[str, Any] = {"deviceClassName": device_class}
    if selectors:
        fields["selectors"] = selectors
    if tolerations:
        fields["tolerations"] = tolerations
    if admin_access:
        fields["adminAccess"] = True
    if version in NESTED_VERSIONS:
        return {"name": name, "exactly": fields}
    if version in VERSIONS:
        return {"name": name, **fields}
    raise ValueError(f"unknown resource.k8s.io version {version!r}; known: {', '.join(VERSIONS)}")


def claim_template(
    name: str,
    version: str = "v1",
    *,
    claim_annotations: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    **request: Any,
) -> dict[str, Any]:
    """A ResourceClaimTemplate with one request; ``claim_annotations`` go into ``spec.metadata`` (copied
    into each generated claim), ``annotations`` onto the template itself."""
    spec: dict[str, Any] = {"spec": {"devices": {"requests": [device_request(version, **request)]}}}
    if claim_annotations:
        spec["metadata"] = {"annotations": dict(claim_annotations)}
    metadata: dict[str, Any] = {"name": name}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {"apiVersion": f"{GROUP}/{version}", "kind": "ResourceClaimTemplate", "metadata": metadata, "spec": spec}


def resource_claim(
    name: str, version: str = "v1", *, annotations: dict[str, str] | None = None, **request: Any
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "ResourceClaim",
        "metadata": metadata,
        "spec": {"devices": {"requests": [device_request(version, **request)]}},
    }


def workload_annotations(
    canary: str | None = None, look_for: str | None = None, run_seconds: float | None = None
) -> dict[str, str]:
    """The simulated kubelet's workload knobs (see devcluster/kubelet.py)."""
    out: dict[str, str] = {}
    if canary is not None:
        out[CANARY] = canary
    if look_for is not None:
        out[LOOK_FOR] = look_for
    if run_seconds is not None:
        out[RUN_SECONDS] = str(run_seconds)
    return out


def pod_spec(
    *,
    template: str | None = None,
    claim: str | None = None,
    grace: int | None = 60,
    restart_policy: str = "Never",
    node: str | None = None,
) -> dict[str, Any]:
    """A one-container pod spec using one claim: from ``template`` (compliant) or the named ``claim``
    (shared, SG002). ``grace=None`` leaves terminationGracePeriodSeconds out; ``node`` pins it to that node
    (a nodeSelector on the hostname label the kubelet stand-in sets, so the scheduler still allocates)."""
    if (template is None) == (claim is None):
        raise ValueError("give exactly one of template= or claim=")
    source = {"resourceClaimTemplateName": template} if template else {"resourceClaimName": claim}
    spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "containers": [
            {"name": "cuda", "image": "nvcr.io/nvidia/cuda:12.6.0-base", "resources": {"claims": [{"name": "gpu"}]}}
        ],
        "resourceClaims": [{"name": "gpu", **source}],
    }
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return spec


def pod(name: str, *, annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec(**spec)}


def job(name: str, namespace: str, *, annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    """A batch/v1 Job whose pod takes its GPU from a claim template (restartPolicy Never, no retries)."""
    template: dict[str, Any] = {"metadata": {}, "spec": pod_spec(**spec)}
    if annotations:
        template["metadata"]["annotations"] = dict(annotations)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"backoffLimit": 0, "template": template},
    }


def admission_policy(
    name: str, rule: dict[str, Any], expression: str, message: str, namespace: str | None = None
) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy refusing what `rule` matches unless `expression` holds, and its binding
    (Deny; to `namespace` only, when given)."""
    api = "admissionregistration.k8s.io/v1"
    binding: dict[str, Any] = {"policyName": name, "validationActions": ["Deny"]}
    if namespace is not None:
        binding["matchResources"] = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}
    return [
        {
            "apiVersion": api,
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [rule]},
                "validations": [{"expression": expression, "message": message}],
            },
        },
        {"apiVersion": api, "kind": "ValidatingAdmissionPolicyBinding", "metadata": {"name": name}, "spec": binding},
    ]
