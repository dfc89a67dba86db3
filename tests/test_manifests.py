"""The kustomize base in manifests/: renders, validates against Kubernetes >= 1.34, and says what it must."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError, latest_version
from scrubgate.certs import generate as gen
from scrubgate.certs import layout
from scrubgate.certs.inject import count_webhooks, inject_yaml_text
from scrubgate.policies import names
from scrubgate.policies.config import load_policy

from devcluster.install import render_base

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
COMPONENT = MANIFESTS / "components" / "cert-manager"
IMAGE = "ghcr.io/scrubgate/scrubgate:0.1.0"
SYSTEM_NAMESPACES = {"kube-system", names.SYSTEM_NAMESPACE}
K8S_VERSIONS = ["1.34", latest_version()]

Doc = dict[str, Any]
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "PriorityClass",
    "FlowSchema",
    "PriorityLevelConfiguration",
}


def kustomize(directory: Path) -> list[Doc]:
    """`kubectl kustomize`, with the kubectl `make cluster-bins` built."""
    return render_base(directory)


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return kustomize(MANIFESTS)


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def webhooks(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for doc in docs:
        if doc["kind"] in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
            for webhook in doc["webhooks"]:
                yield doc["kind"], webhook


def by_name(docs: list[Doc]) -> dict[str, Doc]:
    return {w["name"]: w for _, w in webhooks(docs)}


# --- schema ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_strictly(docs: list[Doc], version: str):
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field


def test_strict_validation_catches_an_unknown_field(docs: list[Doc]):
    broken = copy.deepcopy(one(docs, "Deployment", "scrubgate-webhook"))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(broken, "1.34", strict=True)


def test_rendered_objects(docs: list[Doc]):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert ("Namespace", names.SYSTEM_NAMESPACE) in kinds
    assert ("ServiceAccount", names.WEBHOOK_SERVICE_ACCOUNT) in kinds
    assert ("ServiceAccount", names.AGENT_SERVICE_ACCOUNT) in kinds
    assert "WebhookSettings" not in {k for k, _ in kinds}  # local-config source of the replacements
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED and not doc["kind"].endswith("WebhookConfiguration"):
            assert doc["metadata"]["namespace"] == names.SYSTEM_NAMESPACE, doc["metadata"]["name"]
        else:
            assert "namespace" not in doc["metadata"], (doc["kind"], doc["metadata"]["name"])


# --- webhook configurations -------------------------------------------------------------------------


def test_tenancy_split_of_the_validating_webhooks(docs: list[Doc]):
    hooks = one(docs, "ValidatingWebhookConfiguration", "scrubgate-validating")["webhooks"]
    assert [w["name"] for w in hooks] == ["validate-multi-tenant.scrubgate.dev", "validate-trusted.scrubgate.dev"]
    multi, trusted = hooks
    tenancy = {"key": names.TENANCY_LABEL, "values": [names.TENANCY_TRUSTED]}
    assert {**tenancy, "operator": "NotIn"} in multi["namespaceSelector"]["matchExpressions"]
    assert {**tenancy, "operator": "In"} in trusted["namespaceSelector"]["matchExpressions"]
    assert multi["clientConfig"]["service"]["path"] == "/validate"
    assert trusted["clientConfig"]["service"]["path"] == "/validate/trusted"
    # Both tenancies must see exactly the same requests, or one would slip past validation.
    assert multi["rules"] == trusted["rules"]
    assert multi["matchConditions"] == trusted["matchConditions"]


def test_one_mutating_webhook(docs: list[Doc]):
    (hook,) = one(docs, "MutatingWebhookConfiguration", "scrubgate-mutating")["webhooks"]
    assert hook["name"] == "mutate.scrubgate.dev"
    assert hook["clientConfig"]["service"]["path"] == "/mutate"
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert all(e["key"] != names.TENANCY_LABEL for e in hook["namespaceSelector"]["matchExpressions"])


def test_every_webhook_fails_closed_and_is_bounded(docs: list[Doc]):
    found = list(webhooks(docs))
    assert len(found) == 4
    for _, hook in found:
        assert hook["failurePolicy"] == "Fail", hook["name"]
        assert hook["sideEffects"] == "None"
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["timeoutSeconds"] == 5
        assert hook["matchPolicy"] == "Equivalent"


def cluster_scoped(hook: Doc) -> bool:
    return all(rule["scope"] == "Cluster" for rule in hook["rules"])


def test_system_namespaces_are_excluded_everywhere(docs: list[Doc]):
    for _, hook in webhooks(docs):
        if cluster_scoped(hook):
            # No namespaceSelector applies to a cluster-scoped object (the API server calls the webhook).
            assert "namespaceSelector" not in hook, hook["name"]
            continue
        expressions = hook["namespaceSelector"]["matchExpressions"]
        assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn"}.items() <= expressions[0].items()
        assert set(expressions[0]["values"]) == SYSTEM_NAMESPACES, hook["name"]


def test_webhooks_call_the_service_which_reaches_the_container(docs: list[Doc]):
    service = one(docs, "Service", names.WEBHOOK_SERVICE)
    (port,) = service["spec"]["ports"]
    for _, hook in webhooks(docs):
        ref = hook["clientConfig"]["service"]
        assert (ref["name"], ref["namespace"], ref["port"]) == (names.WEBHOOK_SERVICE, names.SYSTEM_NAMESPACE, 443)
    container = one(docs, "Deployment", "scrubgate-webhook")["spec"]["template"]["spec"]["containers"][0]
    container_port = next(p for p in container["ports"] if p["name"] == port["targetPort"])
    assert port["port"] == 443 and container_port["containerPort"] == 8443
    template_labels = one(docs, "Deployment", "scrubgate-webhook")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= template_labels.items()


def covered(hook: Doc) -> set[tuple[str, str, str, str]]:
    """(group, version, resource, operation) tuples a webhook's rules match."""
    return {
        (group, version, resource, op)
        for rule in hook["rules"]
        for group in rule["apiGroups"]
        for version in rule["apiVersions"]
        for resource in rule["resources"]
        for op in rule["operations"]
    }


WORKLOADS = [
    ("apps", "deployments"),
    ("apps", "statefulsets"),
    ("apps", "replicasets"),
    ("apps", "daemonsets"),
    ("batch", "jobs"),
    ("batch", "cronjobs"),
    ("", "replicationcontrollers"),
    ("", "podtemplates"),
]


def test_validating_rules(docs: list[Doc]):
    rules = covered(by_name(docs)["validate-multi-tenant.scrubgate.dev"])
    for op in ("CREATE", "UPDATE", "DELETE"):
        assert ("", "v1", "pods", op) in rules
    for resource in ("resourceclaims", "resourceclaimtemplates"):
        for op in ("CREATE", "UPDATE"):
            assert (names.RESOURCE_GROUP, "*", resource, op) in rules  # every DRA version
    for group, resource in WORKLOADS:
        for op in ("CREATE", "UPDATE"):
            assert (group, "v1", resource, op) in rules
    assert ("", "v1", "pods/eviction", "CREATE") in rules  # SG008 through the Eviction API
    assert ("scheduling.k8s.io", "*", "podgroups", "CREATE") in rules  # SG002 for PodGroup-shared claims
    assert all(op != "CONNECT" and resource != "*" for _, _, resource, op in rules)
    # Cluster-scoped kinds: here both tenancy webhooks would be called, and record each decision twice.
    assert all(resource not in ("devicetaintrules", "deviceclasses", "namespaces") for _, _, resource, _ in rules)
    assert {rule["scope"] for rule in by_name(docs)["validate-multi-tenant.scrubgate.dev"]["rules"]} == {"Namespaced"}


def test_cluster_scoped_webhook(docs: list[Doc]):
    """One webhook of its own takes the cluster-scoped kinds, untouched by the replacements that fill in the
    tenancy webhooks' rules: scrubgate's fences (SG007; CREATE is not sent, a new fence only fences more),
    DeviceClasses (SG009) and Namespaces (SG010), through their status and finalize subresources too."""
    (hook,) = one(docs, "ValidatingWebhookConfiguration", "scrubgate-fences")["webhooks"]
    assert hook["name"] == "validate-fences.scrubgate.dev"
    assert hook["clientConfig"]["service"]["path"] == "/validate"
    assert covered(hook) == {
        *((names.RESOURCE_GROUP, "*", "devicetaintrules", op) for op in ("CREATE", "UPDATE", "DELETE")),
        *((names.RESOURCE_GROUP, "*", "deviceclasses", op) for op in ("CREATE", "UPDATE")),  # every DRA version
        *(("", "v1", "namespaces", op) for op in ("CREATE", "UPDATE")),
        ("", "v1", "namespaces/status", "UPDATE"),
        ("", "v1", "namespaces/finalize", "UPDATE"),
        ("", "v1", "nodes", "UPDATE"),  # the fallback fence: a node taint
    }
    assert cluster_scoped(hook)
    assert hook["matchConditions"] == by_name(docs)["validate-multi-tenant.scrubgate.dev"]["matchConditions"]


def test_mutating_rules(docs: list[Doc]):
    """Only GPU claims are mutated (the finalizer, and its removal when kube-scheduler releases a claim of its
    own): the API server defaults a pod's grace period before any webhook, so pods and workloads would only wait
    on the webhook for nothing."""
    assert covered(by_name(docs)["mutate.scrubgate.dev"]) == {
        *((names.RESOURCE_GROUP, "*", "resourceclaims", op) for op in ("CREATE", "UPDATE")),
        (names.RESOURCE_GROUP, "*", "resourceclaims/status", "UPDATE"),  # a held claim's ended pods recorded
    }


# --- matchConditions, evaluated with a CEL implementation (cel-cpp, like the API server's cel-go) ------


@pytest.fixture(scope="module")
def cel_env() -> Any:
    from cel_expr_python import cel

    return cel.NewEnv(variables={v: cel.Type.DYN for v in ("object", "oldObject", "request")})


def pod_spec(claims: bool) -> Doc:
    spec: Doc = {"containers": [{"name": "c", "image": "i"}], "terminationGracePeriodSeconds": 30}
    if claims:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
    return spec


def workload(resource: str, claims: bool) -> Doc:
    template = {"metadata": {}, "spec": pod_spec(claims)}
    if resource == "pods":
        return {"metadata": {"name": "p"}, "spec": pod_spec(claims), "status": {}}
    if resource == "podtemplates":
        return {"metadata": {"name": "t"}, "template": template}
    if resource == "cronjobs":
        return {
            "metadata": {"name": "c"},
            "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": template}}},
        }
    return {"metadata": {"name": "w"}, "spec": {"template": template}, "status": {}}


def admission(
    group: str,
    resource: str,
    operation: str,
    obj: Doc | None,
    old: Doc | None,
    *,
    subresource: str = "",
    options: Doc | None = None,
    user: str = "alice",
    node: str | None = None,
) -> Doc:
    """The CEL variables of a request, as the API server builds them: an empty subResource is left out (its
    JSON field is omitempty), `options` is the operation's options object, `node` the node a ServiceAccount token
    is bound to (userInfo.extra)."""
    request: Doc = {
        "operation": operation,
        "resource": {"group": group, "version": "v1", "resource": resource},
        "userInfo": {"username": user},
    }
    if node is not None:
        request["userInfo"]["extra"] = {names.NODE_NAME_EXTRA: [node]}
    if subresource:
        request["subResource"] = subresource
    if options is not None:
        request["options"] = options
    return {"request": request, "object": obj, "oldObject": old}


def reaches_webhook(cel_env: Any, hook: Doc, data: Doc) -> bool:
    """All matchConditions true. An evaluation error would make the API server reject the request (Fail)."""
    from cel_expr_python import cel

    results = []
    for condition in hook["matchConditions"]:
        value = cel_env.compile(condition["expression"]).eval(data=data)
        assert value.type() == cel.Type.BOOL, f"{condition['name']} gave {value.type().name()}: {value.value()}"
        results.append(value.value())
    return all(results)


CLAIM = {"metadata": {"name": "c", "finalizers": [names.FINALIZER]}, "spec": {"devices": {"requests": []}}}
AGENT_USER = f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}"


def taint_rule(key: str) -> Doc:
    return {
        "metadata": {"name": "r"},
        "spec": {"deviceSelector": {"device": "gpu-0"}, "taint": {"key": key, "effect": "NoSchedule"}},
        "status": {},
    }


def delete_options(grace: int | None) -> Doc:
    options: Doc = {"kind": "DeleteOptions", "apiVersion": "meta.k8s.io/v1"}
    if grace is not None:
        options["gracePeriodSeconds"] = grace
    return options


def gpu_pod(**status: Any) -> Doc:
    pod = workload("pods", True)
    pod["spec"]["nodeName"] = "node-a"
    pod["status"] = {"phase": "Running", "containerStatuses": [{"name": "c", "state": {"running": {}}}], **status}
    return pod


def running(pod: Doc) -> Doc:
    return pod | {"spec": {**pod["spec"], "nodeName": "node-a"}, "status": {"phase": "Running"}}


def extended_pod(resource: str, section: str = "limits", init: bool = False) -> Doc:
    pod = workload("pods", False)
    container = {"name": "x", "image": "i", "resources": {section: {"cpu": "1", resource: 1}}}
    pod["spec"]["initContainers" if init else "containers"] = [container]
    return pod


def pod_deletes() -> Iterator[tuple[str, Doc, bool]]:
    """SG008 decides a DELETE only for a force delete of a pod that may still run (item: outage blast radius)."""
    terminating = gpu_pod(containerStatuses=[{"name": "c", "state": {"terminated": {"exitCode": 0}}}])
    terminating["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    unscheduled = gpu_pod()
    del unscheduled["spec"]["nodeName"]
    shapes = [
        ("force delete of a running GPU pod", gpu_pod(), delete_options(0), True),
        ("plain delete (the API server put the pod's grace in)", gpu_pod(), delete_options(30), False),
        ("namespace deletion", gpu_pod(), delete_options(None), False),
        ("kubelet's final delete of a terminal pod", gpu_pod(phase="Succeeded"), delete_options(0), False),
        ("kubelet's final delete, containers stopped", terminating, delete_options(0), False),
        ("pod GC of a pod it marked Failed", gpu_pod(phase="Failed"), delete_options(0), False),
        ("force delete of an unscheduled pod", unscheduled, delete_options(0), False),
        (
            "force delete of a running pod without GPUs",
            running(workload("pods", False)),
            delete_options(0),
            False,
        ),
        (
            "force delete of a running extended-resource GPU pod",
            running(extended_pod("nvidia.com/gpu")),
            delete_options(0),
            True,
        ),
    ]
    for name, pod, options, expected in shapes:
        yield f"pod DELETE: {name}", admission("", "pods", "DELETE", None, pod, options=options), expected
    yield "pod DELETE without options", admission("", "pods", "DELETE", None, gpu_pod()), False


def claim_status_writes() -> Iterator[tuple[str, Doc, bool]]:
    """A claim's status write reaches the webhook only when it clears or changes an allocation, when a consumer
    leaves a claim no node agent holds or the agent's hold leaves it, or when a consumer that is not a pod is
    added (an agent's hold, a PodGroup)."""
    pending = {**CLAIM, "status": {}}
    pod_ref = {"resource": "pods", "name": "p", "uid": "u"}
    allocation = {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n", "device": "g"}]}}
    allocated = {**CLAIM, "status": {"allocation": allocation, "reservedFor": [pod_ref]}}
    with_devices = {**CLAIM, "status": {**allocated["status"], "devices": [{"driver": "gpu.nvidia.com"}]}}
    released = {**CLAIM, "status": {"allocation": allocation}}
    group = {
        **CLAIM,
        "status": {
            "allocation": allocation,
            "reservedFor": [{**pod_ref, "apiGroup": "scheduling.k8s.io", "resource": "podgroups"}],
        },
    }
    hold = {"apiGroup": "scrubgate.dev", "resource": "nodeagents", "name": "n", "uid": "h"}
    held = {**CLAIM, "status": {"allocation": allocation, "reservedFor": [pod_ref, hold]}}
    held_only = {**CLAIM, "status": {"allocation": allocation, "reservedFor": [hold]}}
    another_pod = {**CLAIM, "status": {"allocation": allocation, "reservedFor": [hold, {**pod_ref, "uid": "v"}]}}
    record = {**pod_ref, "apiGroup": "scrubgate.dev", "resource": "endedpods"}
    recorded = {**CLAIM, "status": {"allocation": allocation, "reservedFor": [record, hold]}}
    forged = {**CLAIM, "status": {"allocation": allocation, "reservedFor": [pod_ref, hold, {**record, "uid": "v"}]}}
    writes = [
        ("the scheduler's allocation in PreBind", pending, allocated, False),
        ("a driver's status.devices", allocated, with_devices, False),
        ("the controller dropping a pod from a claim no agent holds", allocated, released, True),
        ("the agent adding its hold", allocated, held, True),
        ("the controller dropping a pod from a held claim", held, held_only, False),
        ("that drop as /mutate leaves it: the pod's record in its place", held, recorded, False),
        ("a record of a pod the claim was not reserved for", held, forged, True),
        ("a record taken out (the agent's release)", recorded, released, True),
        ("the scheduler reserving a held claim for another pod", held_only, another_pod, False),
        ("the agent releasing its hold", held_only, released, True),
        ("the controller's deallocation", released, pending, True),
        ("a deallocation that drops the whole status", released, {**CLAIM}, True),
        ("a reservation for a PodGroup", released, group, True),
    ]
    for name, old, new, expected in writes:
        data = admission(names.RESOURCE_GROUP, "resourceclaims", "UPDATE", new, old, subresource="status")
        yield f"resourceclaims/status: {name}", data, expected
    # The agent adding its own node's hold where the allocation names that node: proven, not sent.
    placed = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]}
    on_node = {**CLAIM, "status": {"allocation": {**allocation, "nodeSelector": placed}, "reservedFor": [pod_ref]}}
    held_on_node = {**on_node, "status": {**on_node["status"], "reservedFor": [pod_ref, hold]}}
    agent = f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}"
    for name, old, new, user, node, expected in (
        ("the agent adding its own node's hold", on_node, held_on_node, agent, "n", False),
        ("the agent adding another node's hold", on_node, held_on_node, agent, "m", True),
        ("the agent adding a hold where the allocation names no node", allocated, held, agent, "n", True),
        ("another user adding the hold", on_node, held_on_node, "alice", "n", True),
        ("the agent's hold without a node-bound token", on_node, held_on_node, agent, None, True),
    ):
        data = admission(
            names.RESOURCE_GROUP, "resourceclaims", "UPDATE", new, old, subresource="status", user=user, node=node
        )
        yield f"resourceclaims/status: {name}", data, expected


def with_requests(*requests: Doc, template: bool = False) -> Doc:
    spec = {"devices": {"requests": list(requests)}}
    return {"metadata": {"name": "c"}, "spec": {"spec": spec} if template else spec}


def claim_writes() -> Iterator[tuple[str, Doc, bool]]:
    """A claim's or template's CREATE (and a template's UPDATE) reaches the webhooks only when it asks for a
    GPU class: in any API version's shape, or as one of its firstAvailable alternatives."""
    shapes = [
        ("v1 exactly", {"name": "g", "exactly": {"deviceClassName": "gpu.nvidia.com"}}, True),
        ("v1beta1", {"name": "g", "deviceClassName": "mig.nvidia.com"}, True),
        ("a model class by glob", {"name": "g", "exactly": {"deviceClassName": "h100.gpu.nvidia.com"}}, True),
        (
            "a GPU alternative",
            {"name": "g", "firstAvailable": [{"name": "n", "deviceClassName": "nic.example.com"},
                                             {"name": "m", "deviceClassName": "mig-1g.gpu.nvidia.com"}]},
            True,
        ),
        ("a NIC the policy does not exclude", {"name": "n", "exactly": {"deviceClassName": "nic.example.com"}}, True),
        ("an excluded class", {"name": "n", "exactly": {"deviceClassName": "imex.nvidia.com"}}, False),
        ("an excluded class, v1beta1", {"name": "n", "deviceClassName": "vfio.gpu.nvidia.com"}, False),
        (
            "an excluded class with admin access",
            {"name": "n", "exactly": {"deviceClassName": "imex.nvidia.com", "adminAccess": True}},
            True,
        ),
        (
            "an excluded class tolerating a taint",
            {"name": "n", "deviceClassName": "imex.nvidia.com", "tolerations": [{"operator": "Exists"}]},
            True,
        ),
        (
            "excluded alternatives only",
            {"name": "g", "firstAvailable": [{"name": "a", "deviceClassName": "imex.nvidia.com"}]},
            False,
        ),
    ]  # fmt: skip
    for name, request, expected in shapes:
        for resource, template in (("resourceclaims", False), ("resourceclaimtemplates", True)):
            obj = with_requests(request, template=template)
            yield f"{resource} CREATE: {name}", admission(names.RESOURCE_GROUP, resource, "CREATE", obj, None), expected
        obj = with_requests(request, template=True)
        data = admission(names.RESOURCE_GROUP, "resourceclaimtemplates", "UPDATE", obj, obj)
        yield f"resourceclaimtemplates UPDATE: {name}", data, expected
    yield "resourceclaims CREATE: no requests", admission(names.RESOURCE_GROUP, "resourceclaims", "CREATE", CLAIM, None), False  # fmt: skip


def claim_updates() -> Iterator[tuple[str, Doc, bool]]:
    """A claim's own UPDATE reaches the webhook only when it changes annotations, the node label or the sanitize
    finalizer, or removes delete-protection while the claim is allocated."""

    def claim(finalizers: list[str], allocated: bool = False, **annotations: str) -> Doc:
        meta: Doc = {"name": "c", "finalizers": finalizers}
        if annotations:
            meta["annotations"] = annotations
        status = {"allocation": {"devices": {"results": [{"request": "gpu", "device": "gpu-0"}]}}}
        return {"metadata": meta, "spec": CLAIM["spec"], **({"status": status} if allocated else {})}

    ours = [names.FINALIZER]
    protected = [names.FINALIZER, names.DELETE_PROTECTION_FINALIZER]
    status = {names.ANNOTATION_SCRUB_STATUS: names.SCRUB_FENCED}
    updates = [
        ("kube-scheduler adding delete-protection in PreBind", claim(ours), claim(protected), False),
        ("the controller removing delete-protection", claim(protected), claim(ours), False),
        (
            "delete-protection removed from an allocated claim",
            claim(protected, allocated=True),
            claim(ours, allocated=True),
            True,
        ),
        (
            "delete-protection added to an allocated claim",
            claim(ours, allocated=True),
            claim(protected, allocated=True),
            False,
        ),
        (
            "a label only",
            claim(ours),
            {**claim(ours), "metadata": {**claim(ours)["metadata"], "labels": {"a": "b"}}},
            False,
        ),
        (
            "the node label added",
            claim(ours),
            {**claim(ours), "metadata": {**claim(ours)["metadata"], "labels": {names.LABEL_NODE: "n"}}},
            True,
        ),
        (
            "the node label removed, other labels kept",
            {**claim(ours), "metadata": {**claim(ours)["metadata"], "labels": {names.LABEL_NODE: "n", "a": "b"}}},
            {**claim(ours), "metadata": {**claim(ours)["metadata"], "labels": {"a": "b"}}},
            True,
        ),
        (
            "the node label changed",
            {**claim(ours), "metadata": {**claim(ours)["metadata"], "labels": {names.LABEL_NODE: "n"}}},
            {**claim(ours), "metadata": {**claim(ours)["metadata"], "labels": {names.LABEL_NODE: "m"}}},
            True,
        ),
        ("the agent's scrub status", claim(ours), claim(ours, **status), True),
        (
            "the agent's attested release of an allocated claim",
            claim(protected, allocated=True),
            claim([names.DELETE_PROTECTION_FINALIZER], allocated=True, **{names.ANNOTATION_ATTESTATION: "t"}),
            True,
        ),
        ("a Retain annotation", claim(ours), claim(ours, **{names.ANNOTATION_DEALLOCATION_POLICY: "Retain"}), True),
        ("removing the sanitize finalizer", claim(protected), claim([names.DELETE_PROTECTION_FINALIZER]), True),
        ("the agent adding the sanitize finalizer", claim([]), claim(ours), True),
    ]
    for name, old, new, expected in updates:
        yield (
            f"resourceclaims UPDATE: {name}",
            admission(names.RESOURCE_GROUP, "resourceclaims", "UPDATE", new, old),
            expected,
        )
    # The agent labelling a claim with its own node, where the allocation names that node: proven, not sent.
    on_node = claim(protected, allocated=True)
    on_node["status"]["allocation"]["nodeSelector"] = {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]
    }
    labelled = {**on_node, "metadata": {**on_node["metadata"], "labels": {names.LABEL_NODE: "n"}}}
    elsewhere = {**on_node, "metadata": {**on_node["metadata"], "labels": {names.LABEL_NODE: "m"}}}
    unplaced = claim(protected, allocated=True)
    agent = f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}"
    for name, old, new, user, node, expected in (
        ("the agent labelling a claim on its node with it", on_node, labelled, agent, "n", False),
        ("the agent labelling a claim on its node, its token bound to another", on_node, labelled, agent, "m", True),
        ("the agent labelling a claim with another node", on_node, elsewhere, agent, "m", True),
        ("the agent labelling a claim whose allocation names no node", unplaced, {
            **unplaced, "metadata": {**unplaced["metadata"], "labels": {names.LABEL_NODE: "n"}}}, agent, "n", True),
        ("the agent's label without a node-bound token", on_node, labelled, agent, None, True),
        ("a tenant labelling a claim with its node", on_node, labelled, "alice", "n", True),
        ("the agent removing its node's label", labelled, on_node, agent, "n", True),
        ("the agent labelling and annotating at once", on_node, {
            **labelled, "metadata": {**labelled["metadata"], "annotations": status}}, agent, "n", True),
    ):  # fmt: skip
        data = admission(names.RESOURCE_GROUP, "resourceclaims", "UPDATE", new, old, user=user, node=node)
        yield f"resourceclaims UPDATE: {name}", data, expected


def namespace(**labels: str) -> Doc:
    return {"metadata": {"name": "team-a", "labels": labels} if labels else {"name": "team-a"}, "spec": {}}


def node_updates() -> Iterator[tuple[str, Doc, bool]]:
    """A Node UPDATE reaches the webhook only when it lifts or changes one of scrubgate's taints."""
    fence = {"key": names.TAINT_UNSANITIZED, "effect": "NoSchedule"}
    other = {"key": "example.com/maintenance", "effect": "NoSchedule"}

    def node(*taints: Doc, **labels: str) -> Doc:
        spec: Doc = {"taints": list(taints)} if taints else {}
        return {"metadata": {"name": "gpu-1", "labels": labels}, "spec": spec, "status": {}}

    for name, old, new, expected in [
        ("the fence lifted", node(fence, other), node(other), True),
        ("the fence's effect changed", node(fence), node({**fence, "effect": "PreferNoSchedule"}), True),
        ("the fence added", node(other), node(other, fence), False),
        ("a label changed while fenced", node(fence), node(fence, team="a"), False),
        ("another taint lifted", node(fence, other), node(fence), False),
        ("no taints at all", node(), node(team="a"), False),
    ]:
        yield f"nodes UPDATE: {name}", admission("", "nodes", "UPDATE", new, old), expected
        # The agent's every Node write: its own Node, its own taints only.
        yield f"nodes UPDATE by the agent: {name}", admission("", "nodes", "UPDATE", new, old, user=AGENT_USER), True


def namespace_writes() -> Iterator[tuple[str, Doc, bool]]:
    trusted = namespace(**{names.TENANCY_LABEL: names.TENANCY_TRUSTED})
    writes = [
        ("CREATE trusted", "CREATE", trusted, None, True),
        ("CREATE unlabelled", "CREATE", namespace(), None, False),
        ("CREATE with other labels", "CREATE", namespace(team="a"), None, False),
        ("UPDATE adding the label", "UPDATE", trusted, namespace(), True),
        ("UPDATE removing the label", "UPDATE", namespace(team="a"), trusted, True),
        ("UPDATE of other labels", "UPDATE", namespace(team="b"), namespace(team="a"), False),
        ("UPDATE keeping the label", "UPDATE", trusted, trusted, False),
    ]
    for name, op, new, old, expected in writes:
        yield f"namespaces {name}", admission("", "namespaces", op, new, old), expected


def cases() -> Iterator[tuple[str, Doc, bool]]:
    for claims in (True, False):
        yield f"pod CREATE claims={claims}", admission("", "pods", "CREATE", workload("pods", claims), None), claims
        pod = workload("pods", claims)
        # An UPDATE only when the pod spec changes (a toleration added): not a label, nor the Job controller's
        # finalizer removal.
        yield f"pod UPDATE of metadata claims={claims}", admission("", "pods", "UPDATE", pod, pod), False
        tolerating = {**pod, "spec": {**pod["spec"], "tolerations": [{"operator": "Exists"}]}}
        yield (
            f"pod UPDATE adding a toleration claims={claims}",
            admission("", "pods", "UPDATE", tolerating, pod),
            claims,
        )
        for group, resource in WORKLOADS:
            obj = workload(resource, claims)
            yield f"{resource} CREATE claims={claims}", admission(group, resource, "CREATE", obj, None), claims
            yield f"{resource} UPDATE unchanged claims={claims}", admission(group, resource, "UPDATE", obj, obj), False
            changed = copy.deepcopy(obj)
            spec = (
                changed["template"]["spec"]
                if resource == "podtemplates"
                else changed["spec"]["jobTemplate"]["spec"]["template"]["spec"]
                if resource == "cronjobs"
                else changed["spec"]["template"]["spec"]
            )
            spec["terminationGracePeriodSeconds"] = 0
            yield (
                f"{resource} UPDATE of the pod template claims={claims}",
                admission(group, resource, "UPDATE", changed, obj),
                claims,
            )
    # KEP-5004: an extended resource of a GPU vendor's domain is sent (the policy tells GPUs from the rest).
    for name, pod, expected in [
        ("nvidia.com/gpu limits", extended_pod("nvidia.com/gpu"), True),
        (
            "implicit class requests",
            extended_pod("deviceclass.resource.kubernetes.io/gpu.nvidia.com", "requests"),
            True,
        ),
        ("init container", extended_pod("nvidia.com/gpu", init=True), True),
        ("cpu and memory only", extended_pod("memory"), False),
        # Another vendor's device: the pod does not wait on scrubgate (outage blast radius).
        ("another vendor's extended resource", extended_pod("example.com/fpga"), False),
    ]:
        yield f"pod CREATE {name}", admission("", "pods", "CREATE", pod, None), expected
        template = workload("deployments", False)
        template["spec"]["template"]["spec"] = pod["spec"]
        yield f"deployments CREATE {name}", admission("apps", "deployments", "CREATE", template, None), expected
    # A ReplicationController's template is optional.
    bare = {"metadata": {"name": "rc"}, "spec": {"replicas": 0}, "status": {}}
    yield (
        "replicationcontrollers without a template",
        admission("", "replicationcontrollers", "CREATE", bare, None),
        False,
    )
    yield from pod_deletes()
    # An Eviction has no spec: only its deleteOptions decide.
    for options, expected in ((None, False), ({"gracePeriodSeconds": 30}, False), ({"gracePeriodSeconds": 0}, True)):
        eviction: Doc = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "p"}}
        if options is not None:
            eviction["deleteOptions"] = options
        data = admission(
            "", "pods", "CREATE", eviction, None, subresource="eviction", options={"kind": "CreateOptions"}
        )
        yield f"pods/eviction deleteOptions={options}", data, expected
    yield from claim_writes()
    yield from claim_updates()
    yield from claim_status_writes()
    # A DeviceTaintRule when it is scrubgate's fence, or the agent writes it; on DELETE `object` is null.
    for key, expected in ((names.TAINT_UNSANITIZED, True), (names.TAINT_SCRUB_FAILED, True), ("example.com/x", False)):
        rule = taint_rule(key)
        for op, obj in (("UPDATE", rule), ("DELETE", None)):
            yield (
                f"devicetaintrules {op} {key}",
                admission(names.RESOURCE_GROUP, "devicetaintrules", op, obj, rule),
                expected,
            )
        data = admission(names.RESOURCE_GROUP, "devicetaintrules", "CREATE", rule, None)
        yield f"devicetaintrules CREATE {key} by anyone", data, False
        data = admission(names.RESOURCE_GROUP, "devicetaintrules", "CREATE", rule, None, user=AGENT_USER)
        yield f"devicetaintrules CREATE {key} by the agent", data, True
    yield from namespace_writes()
    yield from node_updates()
    device_class = {"metadata": {"name": "h100"}, "spec": {"selectors": []}}
    yield "deviceclasses CREATE", admission(names.RESOURCE_GROUP, "deviceclasses", "CREATE", device_class, None), True
    for claims, expected in (([{"name": "gpu", "resourceClaimTemplateName": "t"}], True), (None, False)):
        group: Doc = {"metadata": {"name": "g"}, "spec": {"schedulingPolicy": {}}}
        if claims is not None:
            group["spec"]["resourceClaims"] = claims
        yield (
            f"podgroups CREATE claims={expected}",
            admission("scheduling.k8s.io", "podgroups", "CREATE", group, None),
            expected,
        )


@pytest.mark.parametrize("name, data, expected", list(cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_match_conditions(cel_env: Any, docs: list[Doc], name: str, data: Doc, expected: bool):
    for kind, hook in webhooks(docs):
        if kind == "ValidatingWebhookConfiguration":
            assert reaches_webhook(cel_env, hook, data) is expected, f"{hook['name']}: {name}"


def test_the_claim_condition_names_the_policys_excluded_classes(docs: list[Doc]):
    """The kustomize base writes the default policy's excludeDeviceClasses into the claim condition (the chart
    writes the policy's); the mutating webhook carries the same condition text as the validating ones."""
    conditions = {
        c["name"]: c["expression"] for c in by_name(docs)["validate-multi-tenant.scrubgate.dev"]["matchConditions"]
    }
    mutating = {c["name"]: c["expression"] for c in by_name(docs)["mutate.scrubgate.dev"]["matchConditions"]}
    name = "claim-may-hold-a-gpu-or-asks-for-access"
    assert mutating[name] == conditions[name]
    written = "[" + ", ".join(f"'{c}'" for c in load_policy(None).exclude_device_classes) + "]"
    assert conditions[name].count(written) == 3, written


def mutations() -> Iterator[tuple[str, Doc, bool]]:
    """/mutate gets every claim CREATE, and of the UPDATEs only delete-protection leaving an allocated claim that
    carries our finalizer (kube-scheduler releasing its own claim), and the resourceclaim controller's drop of an
    ended pod from a claim a node agent holds: never the agent's writes."""
    for name, data, expected in claim_writes():
        if data["request"]["resource"]["resource"] == "resourceclaims":
            yield name, data, expected
    for name, data, expected in claim_updates():
        old, new = data["oldObject"], data["object"]
        releasing = (
            "allocation" in old.get("status", {})
            and {names.FINALIZER, names.DELETE_PROTECTION_FINALIZER} <= set(old["metadata"]["finalizers"])
            and names.DELETE_PROTECTION_FINALIZER not in new["metadata"]["finalizers"]
        )
        assert not releasing or expected, name
        yield name, data, releasing
    # Of the status writes, only the controller's drop of an ended pod from a claim a node agent holds.
    dropping = {
        "resourceclaims/status: the controller dropping a pod from a held claim",
        "resourceclaims/status: the controller dropping a pod from a claim no agent holds",
        "resourceclaims/status: that drop as /mutate leaves it: the pod's record in its place",  # reinvoked
    }
    for name, data, _ in claim_status_writes():
        held = any(
            r.get("apiGroup") == "scrubgate.dev" for r in (data["object"].get("status") or {}).get("reservedFor") or []
        )
        yield name, data, name in dropping and held
    data = next(d for n, d, _ in claim_status_writes() if n.endswith("dropping a pod from a held claim"))
    scheduler = {**data, "request": {**data["request"], "userInfo": {"username": "system:kube-scheduler"}}}
    yield "resourceclaims/status: the scheduler's Unreserve on a held claim", scheduler, False


@pytest.mark.parametrize("name, data, expected", list(mutations()), ids=lambda v: v if isinstance(v, str) else "")
def test_mutating_match_conditions(cel_env: Any, docs: list[Doc], name: str, data: Doc, expected: bool):
    assert reaches_webhook(cel_env, by_name(docs)["mutate.scrubgate.dev"], data) is expected, name


def test_pod_delete_reads_the_old_object(docs: list[Doc]):
    conditions = {
        c["name"]: c["expression"] for c in by_name(docs)["validate-multi-tenant.scrubgate.dev"]["matchConditions"]
    }
    assert "request.operation == 'DELETE' ? oldObject.spec : object.spec" in conditions["pod-spec-may-hold-a-gpu"]


# --- webhook Deployment --------------------------------------------------------------------------------


def test_webhook_deployment(docs: list[Doc]):
    deployment = one(docs, "Deployment", "scrubgate-webhook")
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert pod["serviceAccountName"] == names.WEBHOOK_SERVICE_ACCOUNT
    assert pod["automountServiceAccountToken"] is True  # its DeviceClass watch
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert container["image"] == IMAGE
    assert container["command"] == ["scrubgate"]
    assert container["args"] == [
        "webhook",
        "--tls-cert", "/etc/scrubgate/tls/tls.crt",
        "--tls-key", "/etc/scrubgate/tls/tls.key",
        "--port", "8443",
        "--metrics-port", "9401",  # /metrics and the probes, never on the admission port
        "--policy", "/etc/scrubgate/policy/policy.yaml",
        "--audit-log", "/var/log/scrubgate/audit.jsonl",
        "--audit-signing-key", "/etc/scrubgate/audit-key/ed25519.pem",  # signed checkpoints by default
        "--audit-checkpoint-interval", "60",
        "--client-ca", "/etc/scrubgate/client-ca/ca.crt",
    ]  # fmt: skip
    mount = next(m for m in container["volumeMounts"] if m["name"] == "audit-key")
    volume = next(v for v in pod["volumes"] if v["name"] == "audit-key")
    assert mount["mountPath"] == "/etc/scrubgate/audit-key" and mount["readOnly"]
    assert volume["secret"]["secretName"] == "scrubgate-audit-signing-key"
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"], get["scheme"]) == (path, "metrics", "HTTP")
    assert {"name": "metrics", "containerPort": 9401, "protocol": "TCP"} in container["ports"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]


def assert_restricted(pod: Doc, container: Doc) -> None:
    """The Pod Security Standard "restricted" profile, field by field."""
    context = {**pod.get("securityContext", {}), **container["securityContext"]}
    assert context["runAsNonRoot"] is True and context.get("runAsUser", 1) != 0
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert all(set(v) <= {"name", "secret", "configMap", "emptyDir"} for v in pod["volumes"])


def test_webhook_pod_is_restricted(docs: list[Doc]):
    pod = one(docs, "Deployment", "scrubgate-webhook")["spec"]["template"]["spec"]
    assert_restricted(pod, pod["containers"][0])


def test_webhook_mounts_what_its_arguments_name(docs: list[Doc]):
    pod = one(docs, "Deployment", "scrubgate-webhook")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    tls = volumes[mounts["/etc/scrubgate/tls"]["name"]]
    assert tls["secret"]["secretName"] == layout.TLS_SECRET_NAME
    assert "subPath" not in mounts["/etc/scrubgate/tls"]  # subPath mounts never see a rotated Secret
    policy_volume = volumes[mounts["/etc/scrubgate/policy"]["name"]]
    configmap = one(docs, "ConfigMap", policy_volume["configMap"]["name"])
    assert configmap["data"]["policy.yaml"] == (REPO / "policies" / "default.yaml").read_text()
    assert "emptyDir" in volumes[mounts["/var/log/scrubgate"]["name"]]
    # Only the API server, with a client certificate of this CA, gets admission decisions.
    assert volumes[mounts["/etc/scrubgate/client-ca"]["name"]]["configMap"]["name"] == "scrubgate-webhook-client-ca"


def test_disruption_budget_keeps_a_replica(docs: list[Doc]):
    pdb = one(docs, "PodDisruptionBudget", "scrubgate-webhook")["spec"]
    deployment = one(docs, "Deployment", "scrubgate-webhook")["spec"]
    assert pdb["selector"] == deployment["selector"]
    assert 1 <= pdb["minAvailable"] < deployment["replicas"]


# --- node agent --------------------------------------------------------------------------------------


def test_agent_daemonset(docs: list[Doc]):
    pod = one(docs, "DaemonSet", "scrubgate-agent")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == IMAGE
    assert container["args"] == [
        "agent",
        "--node", "$(NODE_NAME)",
        "--gpu-backend", "nvml",
        "--checkpoint", "/var/lib/scrubgate/checkpoint.json",
        "--signing-key", "/etc/scrubgate/signing/ed25519.pem",
        "--key-id", "$(KEY_ID)",
        "--nvidia-checkpoint", "/var/lib/kubelet/plugins/gpu.nvidia.com/checkpoint.json",
        "--metrics-port", "9400",
    ]  # fmt: skip
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "scrubgate-agent-signing-key"
    assert pod["serviceAccountName"] == names.AGENT_SERVICE_ACCOUNT
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    tolerated = {t["key"] for t in pod["tolerations"] if t["operator"] == "Exists" and "effect" not in t}
    assert {"nvidia.com/gpu", names.TAINT_UNSANITIZED, names.TAINT_SCRUB_FAILED} <= tolerated
    assert container["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]


def test_agent_volumes(docs: list[Doc]):
    pod = one(docs, "DaemonSet", "scrubgate-agent")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}

    def volume(path: str) -> tuple[Doc, Doc]:
        return mounts[path], volumes[mounts[path]["name"]]

    mount, state = volume("/var/lib/scrubgate")
    assert state["hostPath"]["path"] == "/var/lib/scrubgate" and not mount.get("readOnly", False)
    mount, nvidia = volume("/var/lib/kubelet/plugins/gpu.nvidia.com")
    assert nvidia["hostPath"]["path"] == "/var/lib/kubelet/plugins/gpu.nvidia.com" and mount["readOnly"] is True
    mount, key = volume("/etc/scrubgate/signing")
    assert key["secret"]["secretName"] == "scrubgate-agent-signing-key" and mount["readOnly"] is True
    assert key["secret"]["items"] == [{"key": "ed25519.pem", "path": "ed25519.pem"}]


def test_agent_container_is_privileged_for_its_devices_and_says_why(docs: list[Doc]):
    pod = one(docs, "DaemonSet", "scrubgate-agent")["spec"]["template"]["spec"]
    context = pod["containers"][0]["securityContext"]
    assert context["privileged"] is True and context["readOnlyRootFilesystem"] is True
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not pod.get("hostPID") and not pod.get("hostNetwork")
    text = (Path(__file__).parent.parent / "manifests" / "agent-daemonset.yaml").read_text()
    assert "dynamic MIG" in text and "nvidia-caps" in text, "the manifest says why it is privileged"


# --- RBAC --------------------------------------------------------------------------------------------


def grants(role: Doc) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_agent_rbac_is_exactly_what_it_needs(docs: list[Doc]):
    dra = names.RESOURCE_GROUP
    expected = {
        *(("", "pods", v) for v in ("get", "list", "watch")),
        # by name, and its own node's by their label (list, watch)
        *((dra, "resourceclaims", v) for v in ("get", "list", "watch", "patch", "update")),
        # its hold on a claim (status.reservedFor), which 1.36+ also authorizes on resourceclaims/binding
        *((dra, sub, v) for sub in ("resourceclaims/status", "resourceclaims/binding") for v in ("patch", "update")),
        *((dra, "resourceslices", v) for v in ("get", "list", "watch")),
        *((dra, "devicetaintrules", v) for v in ("create", "delete", "get", "list")),
        ("", "nodes", "get"),
        ("", "nodes", "patch"),
        ("", "events", "create"),
        ("events.k8s.io", "events", "create"),
        ("scheduling.k8s.io", "podgroups", "get"),  # a claim reserved for a PodGroup is released when it is gone
    }
    assert grants(one(docs, "ClusterRole", "scrubgate-agent")) == expected
    binding = one(docs, "ClusterRoleBinding", "scrubgate-agent")
    assert binding["roleRef"]["name"] == "scrubgate-agent"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": names.AGENT_SERVICE_ACCOUNT, "namespace": names.SYSTEM_NAMESPACE}
    ]


def test_controller_rbac_is_every_claim_and_its_own_lease(docs: list[Doc]):
    """Every claim (its informer; the label and the finalizer it writes), and the Lease of its leader election in
    its own namespace only; two replicas, one of which acts."""
    claims = {(names.RESOURCE_GROUP, "resourceclaims", v) for v in ("get", "list", "watch", "patch")}
    assert grants(one(docs, "ClusterRole", "scrubgate-controller")) == claims
    lease = one(docs, "Role", "scrubgate-controller-leader-election")
    assert lease["metadata"]["namespace"] == names.SYSTEM_NAMESPACE
    assert grants(lease) == {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}
    for kind, name in (("ClusterRoleBinding", "scrubgate-controller"), ("RoleBinding", lease["metadata"]["name"])):
        subjects = one(docs, kind, name)["subjects"]
        assert subjects == [
            {"kind": "ServiceAccount", "name": names.CONTROLLER_SERVICE_ACCOUNT, "namespace": names.SYSTEM_NAMESPACE}
        ]
    deployment = one(docs, "Deployment", "scrubgate-controller")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == names.CONTROLLER_SERVICE_ACCOUNT
    assert pod["containers"][0]["args"][0] == "controller"
    assert pod["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_webhook_reads_device_classes_and_nothing_else(docs: list[Doc]):
    bound = [
        doc["roleRef"]["name"]
        for doc in docs
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s["name"] == names.WEBHOOK_SERVICE_ACCOUNT for s in doc["subjects"])
    ]
    assert bound == ["scrubgate-webhook"]
    expected = {(names.RESOURCE_GROUP, "deviceclasses", v) for v in ("get", "list", "watch")}
    assert grants(one(docs, "ClusterRole", "scrubgate-webhook")) == expected
    account = one(docs, "ServiceAccount", names.WEBHOOK_SERVICE_ACCOUNT)
    assert account["automountServiceAccountToken"] is True


# --- API Priority and Fairness ------------------------------------------------------------------------

# kube-apiserver's bootstrap FlowSchemas and their levels' shares and lendable percentages (k8s.io/apiserver
# pkg/apis/flowcontrol/bootstrap/default.go, v0.37.2): what scrubgate's level is sized against.
BOOTSTRAP_PRECEDENCE = {
    "exempt": 1,
    "probes": 2,
    "system-leader-election": 100,
    "system-node-high": 400,
    "system-nodes": 500,
    "kube-controller-manager": 800,
    "kube-scheduler": 800,
    "kube-system-service-accounts": 900,
    "service-accounts": 9000,
    "global-default": 9900,
    "catch-all": 10000,
}
BOOTSTRAP_LEVELS = {  # name: (nominalConcurrencyShares, lendablePercent)
    "exempt": (0, 0),
    "catch-all": (5, 0),
    "system": (30, 33),
    "node-high": (40, 25),
    "leader-election": (10, 0),
    "workload-high": (40, 50),
    "workload-low": (100, 90),
    "global-default": (20, 50),
}
SERVER_SEATS = 600  # --max-requests-inflight 400 + --max-mutating-requests-inflight 200, the defaults


def test_the_agents_the_webhook_and_the_controller_have_a_priority_level_of_their_own(docs: list[Doc]):
    """Their requests leave the bootstrap `service-accounts` schema (matched at 9000, level workload-low, shared
    with every tenant's ServiceAccount) for a FlowSchema matched after every system component's schema (none of
    which names them) and before it; every request of theirs, under the identities the pods run as."""
    schema = one(docs, "FlowSchema", "scrubgate")
    level = one(docs, "PriorityLevelConfiguration", schema["spec"]["priorityLevelConfiguration"]["name"])
    precedence = schema["spec"]["matchingPrecedence"]
    system = max(
        v for k, v in BOOTSTRAP_PRECEDENCE.items() if k not in ("service-accounts", "global-default", "catch-all")
    )
    assert system < precedence < BOOTSTRAP_PRECEDENCE["service-accounts"]
    (rule,) = schema["spec"]["rules"]
    accounts = {(s["serviceAccount"]["namespace"], s["serviceAccount"]["name"]) for s in rule["subjects"]}
    webhook = one(docs, "Deployment", "scrubgate-webhook")["spec"]["template"]["spec"]["serviceAccountName"]
    agent = one(docs, "DaemonSet", "scrubgate-agent")["spec"]["template"]["spec"]["serviceAccountName"]
    controller = one(docs, "Deployment", "scrubgate-controller")["spec"]["template"]["spec"]["serviceAccountName"]
    assert accounts == {(names.SYSTEM_NAMESPACE, account) for account in (webhook, agent, controller)}
    assert schema["spec"]["distinguisherMethod"] == {"type": "ByUser"}, "the webhook's flow apart from the agents'"
    everything = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"], "clusterScope": True}
    assert rule["resourceRules"] == [everything]
    assert rule["nonResourceRules"] == [{"verbs": ["*"], "nonResourceURLs": ["*"]}]
    assert level["spec"]["type"] == "Limited" and level["spec"]["limited"]["limitResponse"]["type"] == "Queue"


def test_the_level_keeps_seats_of_its_own_without_taking_the_tenants(docs: list[Doc]):
    """Seats it never lends (never starved), fewer than the controllers' or the kubelets' levels keep, and a
    share of the server far below the tenants' (never starving them: beyond its own, it borrows only what
    others lend while idle)."""
    limited = one(docs, "PriorityLevelConfiguration", "scrubgate")["spec"]["limited"]
    shares, lendable = limited["nominalConcurrencyShares"], limited["lendablePercent"]
    total = sum(s for s, _ in BOOTSTRAP_LEVELS.values()) + shares

    def kept(level_shares: int, level_lendable: int) -> float:
        return SERVER_SEATS * level_shares / total * (100 - level_lendable) / 100

    own = kept(shares, lendable)
    assert own >= 16, f"{own:.1f} seats of its own"
    assert own < min(kept(*BOOTSTRAP_LEVELS[name]) for name in ("system", "workload-high"))
    assert shares * 5 < BOOTSTRAP_LEVELS["workload-low"][0], "the tenants' level keeps most of the server"
    queuing = limited["limitResponse"]["queuing"]
    assert queuing["handSize"] * queuing["queueLengthLimit"] >= 500, "a thousand agents' re-watches queue, not 429"


# --- TLS: certs inject and the cert-manager component ---------------------------------------------------


def test_injected_render_still_validates(docs: list[Doc]):
    ca = gen.generate_ca()
    text, count = inject_yaml_text(yaml.safe_dump_all(docs), ca.cert_pem)
    patched = list(yaml.safe_load_all(text))
    assert count == count_webhooks(patched) == 4
    for doc in patched:
        kubernetes_validate.validate(doc, "1.34", strict=True)


def test_cert_manager_component(tmp_path: Path):
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    # kustomize accepts only relative paths to other kustomizations.
    base, component = (os.path.relpath(p, overlay) for p in (MANIFESTS, COMPONENT))
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [base],
                "components": [component],
            }
        )
    )
    docs = kustomize(overlay)
    certificates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    issuers = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}
    serving = next(c for c in certificates.values() if c["spec"]["secretName"] == layout.TLS_SECRET_NAME)
    assert serving["spec"]["dnsNames"] == gen.service_sans()
    assert "server auth" in serving["spec"]["usages"]
    issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    ca_cert = next(c for c in certificates.values() if c["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"])
    assert ca_cert["spec"]["isCA"] is True
    assert "selfSigned" in issuers[ca_cert["spec"]["issuerRef"]["name"]]["spec"]
    inject_from = f"{names.SYSTEM_NAMESPACE}/{serving['metadata']['name']}"
    configurations = [d for d in docs if d["kind"].endswith("WebhookConfiguration")]
    assert len(configurations) == 3
    for doc in configurations:
        assert doc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == inject_from
    for doc in docs:
        if doc["apiVersion"].startswith("cert-manager.io/"):
            assert doc["metadata"]["namespace"] == names.SYSTEM_NAMESPACE
        else:
            kubernetes_validate.validate(doc, "1.34", strict=True)
