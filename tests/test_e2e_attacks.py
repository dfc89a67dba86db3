"""Attacks end to end on one installation (real control plane, real webhook, real agent; devcluster.harness):
what a tenant, or someone holding the agent's token, must not do to a claim that holds a GPU (or was just
released) is denied by the API server through the webhook, with its rule in the message, and leaves exactly
one audit record naming the rule, the user and the object. Break-glass is the one sanctioned exception: an
admin may release a stuck claim object, audited, and its allocation still keeps the device until it is scrubbed.

The module shares one cluster; each test cleans up its own GPUs. The last test checks everything the
module did: one audit record per provoked denial (and per break-glass), an intact chain, and the
observer's invariant over every claim it saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from e2e_support import (
    WAIT_S,
    assert_invariant,
    canary_found,
    claim_history,
    create_template,
    expect_denied,
    fence_history,
    running_claim,
    tenant_namespace,
    tenant_pod,
    verified_attestation,
    wait_gone,
    wait_phase,
)
from kubernetes import client as k8s
from scrubgate.policies import names
from scrubgate.policies.attestation import (
    agent_reservations,
    allocation_identity,
    build_payload,
    check_claim_attestation,
    load_private_key,
    reserved_pods,
    sign,
)

from devcluster import workloads
from devcluster.harness import CLAIM_CONTROLLER_USER, Cluster, denial, wait_for
from devcluster.kubeapi import User
from devcluster.observer import first_rv, is_allocated, is_attested

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CANARY = "VICTIM-SECRET-7781"
MEMORY = 1 << 20
GPUS = 3  # the victim's, and two for the claim with two devices
PATCH_TYPES = {
    "json": "application/json-patch+json",
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
}


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


ATTESTATION = f"/metadata/annotations/{_pointer(names.ANNOTATION_ATTESTATION)}"
SCRUB_STATUS = f"/metadata/annotations/{_pointer(names.ANNOTATION_SCRUB_STATUS)}"
BREAK_GLASS_OP = {"op": "add", "path": f"/metadata/annotations/{_pointer(names.ANNOTATION_BREAK_GLASS)}", "value": "x"}


# ---------------------------------------------------------------------- what the attacks must leave behind


@dataclass(frozen=True)
class Record:
    """What an audit record says about one admission: enough to tell which attack it was."""

    rules: tuple[str, ...]
    decision: str
    user: str
    operation: str
    namespace: str
    name: str


CLAIM_CONTROLLER = CLAIM_CONTROLLER_USER


def deallocation(record: dict) -> bool:
    """A status write of the resourceclaim controller that admission refused or audited: a release before the
    agent's attestation, which the agent's hold on every used claim keeps it from trying. Not an attack."""
    return record.get("subResource") == "status" and record["user"] == CLAIM_CONTROLLER


def namespace_set_up(record: dict) -> bool:
    """The admin creating a trusted namespace for a test: SG010 audits every change of the tenancy label."""
    return record["kind"] == "Namespace" and record["decision"] == "audit" and record["user"] == "kubernetes-admin"


def attack_records(cluster: Cluster) -> list[dict]:
    return [r for r in cluster.audit_records() if not deallocation(r) and not namespace_set_up(r)]


def summary(record: dict) -> Record:
    return Record(
        tuple(sorted({f["rule"]["id"] for f in record.get("findings") or []})),
        record["decision"],
        record["user"],
        record["operation"],
        record["namespace"],
        record["name"],
    )


@dataclass
class AuditBook:
    """The audit records the module's attacks must have written, in order. Each attack is checked as it
    happens (exactly its record, nothing else); the last test checks the whole log against the book, which
    also catches records written between attacks."""

    cluster: Cluster
    expected: list[Record] = field(default_factory=list)

    def denied(
        self, call: Callable[[], object], rule: str, *, user: str, operation: str, namespace: str, name: str
    ) -> str:
        """Runs an attack that the webhook must deny under ``rule``; returns the API server's message."""
        before = len(attack_records(self.cluster))
        message = expect_denied(call, rule)
        assert 'admission webhook "validate-' in message, f"denied, but not by scrubgate's webhook: {message}"
        self._expect(before, Record((rule,), "deny", self.cluster.users[user].name, operation, namespace, name))
        return message

    def allowed(self, call: Callable[[], Any], audited: Record | None = None) -> Any:
        """Runs a request that must go through, with the one audit record ``audited`` or none."""
        before = len(attack_records(self.cluster))
        result = call()
        self._expect(before, audited)
        return result

    def _expect(self, before: int, record: Record | None) -> None:
        want = [record] if record else []
        written = [summary(r) for r in attack_records(self.cluster)[before:]]
        # One request may be decided twice: kube-apiserver applies an update to the object in its watch cache
        # first and, where admission refuses it on that possibly stale copy, tries again on the stored one
        # (k8s.io/apiserver storage/etcd3 store.go GuaranteedUpdate, "working with stale data"): two calls of
        # the webhook, two records of the same refusal. Any other count or record is wrong.
        twice = record is not None and record.decision == "deny" and written == [record, record]
        self.expected += written if twice else want  # first: a wrong record also shows in the last test's count
        assert written == want or twice, f"audit records written: {written}, expected: {want}"


# ---------------------------------------------------------------------- claims and writes


def patch(cluster: Cluster, user: str, claim: dict, body: Any, patch_type: str = "json", dry_run: bool = False) -> dict:
    """PATCH a ResourceClaim as ``user`` (json, merge or strategic); ``dry_run`` stores nothing."""
    meta = claim["metadata"]
    return cluster.request(
        "PATCH",
        cluster.resource_path("resourceclaims", meta["namespace"], meta["name"], version="v1"),
        body,
        user=user,
        content_type=PATCH_TYPES[patch_type],
        query=[("dryRun", "All")] if dry_run else None,
    )


def current(cluster: Cluster, claim: dict) -> dict:
    found = cluster.claim(claim["metadata"]["namespace"], claim["metadata"]["name"])
    assert found is not None and found["metadata"]["uid"] == claim["metadata"]["uid"], "the claim is gone"
    return found


def devices_of(claim: dict) -> list[tuple[str, str, str]]:
    results = claim["status"]["allocation"]["devices"]["results"]
    return [(r["driver"], r["pool"], r["device"]) for r in results]


def fenced_claim(cluster: Cluster, namespace: str, pod: str) -> dict:
    """The pod's claim once the agent has fenced it (its own writes to the claim are done until release)."""
    name = running_claim(cluster, namespace, pod)["metadata"]["name"]
    return wait_for(
        lambda: (
            (c := cluster.claim(namespace, name))
            and (c["metadata"].get("annotations") or {}).get(names.ANNOTATION_SCRUB_STATUS) == names.SCRUB_FENCED
            and c
        ),
        WAIT_S,
        f"the agent's fence on claim {namespace}/{name}",
    )


def stripping(claim: dict, attestation: str | None = None) -> list[dict]:
    """JSON patch that removes the sanitize finalizer (after presenting ``attestation``, if given)."""
    index = claim["metadata"]["finalizers"].index(names.FINALIZER)
    ops = [
        {"op": "test", "path": f"/metadata/finalizers/{index}", "value": names.FINALIZER},
        {"op": "remove", "path": f"/metadata/finalizers/{index}"},
    ]
    if attestation is not None:
        ops.insert(0, {"op": "add", "path": ATTESTATION, "value": attestation})
    return ops


def claim_write_denied(cluster: Cluster, book: AuditBook, user: str, claim: dict, ops: list[dict]) -> str:
    """`user`'s JSON patch of `claim`, which SG007 must refuse and record; the API server's message."""
    meta = claim["metadata"]
    return book.denied(
        lambda: patch(cluster, user, claim, ops),
        "SG007",
        user=user,
        operation="UPDATE",
        namespace=meta["namespace"],
        name=meta["name"],
    )


def attestation_for(
    cluster: Cluster,
    claim: dict,
    key: Ed25519PrivateKey,
    kid: str,
    devices: list[tuple[str, str, str]] | None = None,
) -> str:
    """An attestation in the agent's exact format for ``claim``: its UID, node, ``devices`` (default: all
    it holds) each scrubbed and verified, the pods it is reserved for, signed with ``key`` under ``kid``."""
    meta = claim["metadata"]
    now = datetime.now(UTC)
    payload = build_payload(
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta["uid"],
        node=cluster.node,
        devices=[
            {
                "driver": driver,
                "pool": pool,
                "device": device,
                "uuid": cluster.device_uuid(device),
                "bytesScrubbed": MEMORY,
                "bytesTotal": MEMORY,
                "method": names.ATTESTATION_METHOD,
                "verified": True,
            }
            for driver, pool, device in (devices if devices is not None else devices_of(claim))
        ],
        started_at=now,
        finished_at=now,
        health={"eccUncorrectable": 0, "remapPending": False, "xids": []},
        consumers=reserved_pods(claim),
        allocation=allocation_identity(claim, cluster.node),
    )
    return sign(payload, key, kid)


def agent_key(cluster: Cluster) -> Ed25519PrivateKey:
    """The agent's real signing key (an attacker with it could attest anything: used for the controls)."""
    return load_private_key(cluster.paths.signing_key.read_bytes())


def release(cluster: Cluster, user: str, namespace: str, pod: str, claim: dict) -> dict:
    """The tenant deletes its pod the proper way; the claim goes once attested. Returns the attestation."""
    cluster.core(user).delete_namespaced_pod(pod, namespace)
    wait_gone(cluster, namespace, claim["metadata"]["name"])
    return verified_attestation(cluster, claim["metadata"]["uid"])


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(tmp_path_factory.mktemp("attacks"), gpus=GPUS, memory_bytes=MEMORY).start() as cluster:
        yield cluster


@pytest.fixture
def cluster(shared_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    yield shared_cluster
    request.node.add_report_section("teardown", "devcluster logs", shared_cluster.diagnostics(60))


@pytest.fixture(scope="module")
def book(shared_cluster: Cluster) -> AuditBook:
    return AuditBook(shared_cluster)


@dataclass(frozen=True)
class Victim:
    namespace: str
    pod: str
    claim: dict


@pytest.fixture(scope="module")
def victim(shared_cluster: Cluster) -> Victim:
    """alice's pod, running on a GPU with a secret in its memory, for the whole module."""
    ns = tenant_namespace(shared_cluster, "victim")
    create_template(shared_cluster, "alice", ns, "one-gpu")
    tenant_pod(shared_cluster, "alice", ns, "trainer", template="one-gpu", canary=CANARY)
    return Victim(ns, "trainer", fenced_claim(shared_cluster, ns, "trainer"))


@pytest.fixture(scope="module")
def replayable(shared_cluster: Cluster) -> str:
    """A valid attestation of another, finished claim (bob's): what a replay attacker would copy."""
    ns = tenant_namespace(shared_cluster, "donor")
    create_template(shared_cluster, "bob", ns, "one-gpu")
    tenant_pod(shared_cluster, "bob", ns, "short", template="one-gpu", run_seconds=2)
    claim = running_claim(shared_cluster, ns, "short")
    wait_gone(shared_cluster, ns, claim["metadata"]["name"])
    shared_cluster.observer.sync()
    for event in claim_history(shared_cluster, claim["metadata"]["uid"]):
        token = (event.obj["metadata"].get("annotations") or {}).get(names.ANNOTATION_ATTESTATION)
        if token:
            check_claim_attestation(token, event.obj, shared_cluster.public_keys)  # valid, for its own claim
            return token
    raise AssertionError(f"claim {ns}/{claim['metadata']['name']} went without an attestation")


# ---------------------------------------------------------------------- a tenant and the finalizer


def _strips(claim: dict) -> dict[str, tuple[str, Any]]:
    others = [f for f in claim["metadata"]["finalizers"] if f != names.FINALIZER]
    return {
        "json-patch remove": ("json", stripping(claim)),
        "json-patch replace": ("json", [{"op": "replace", "path": "/metadata/finalizers", "value": others}]),
        "merge-patch list": ("merge", {"metadata": {"finalizers": others}}),
        "merge-patch null": ("merge", {"metadata": {"finalizers": None}}),
        "strategic deleteFromPrimitiveList": (
            "strategic",
            {"metadata": {"$deleteFromPrimitiveList/finalizers": [names.FINALIZER]}},
        ),
        "strategic null": ("strategic", {"metadata": {"finalizers": None}}),
    }


def test_a_tenant_cannot_remove_the_finalizer(cluster: Cluster, book: AuditBook, victim: Victim) -> None:
    ns, name = victim.namespace, victim.claim["metadata"]["name"]
    claim = current(cluster, victim.claim)
    for how, (patch_type, body) in _strips(claim).items():
        message = book.denied(
            lambda patch_type=patch_type, body=body: patch(cluster, "alice", claim, body, patch_type),
            "SG007",
            user="alice",
            operation="UPDATE",
            namespace=ns,
            name=name,
        )
        assert "removed the scrubgate.dev/sanitize finalizer" in message, f"{how}: {message}"
    # PUT of the whole object, as `kubectl edit` or a client's replace does.
    edited = current(cluster, victim.claim)
    edited["metadata"]["finalizers"].remove(names.FINALIZER)
    path = cluster.resource_path("resourceclaims", ns, name, version="v1")
    book.denied(
        lambda: cluster.request("PUT", path, edited, user="alice"),
        "SG007",
        user="alice",
        operation="UPDATE",
        namespace=ns,
        name=name,
    )
    # The status subresource is not a tenant's to write: RBAC (`edit` grants no resourceclaims/status) refuses
    # before admission, so nothing reaches the webhook or its audit log.
    status_path = cluster.resource_path("resourceclaims", ns, name, version="v1") + "/status"
    status, message = denial(
        lambda: cluster.request("PATCH", status_path, stripping(claim), user="alice", content_type=PATCH_TYPES["json"])
    )
    assert status == 403 and "resourceclaims/status" in message, message
    assert names.FINALIZER in current(cluster, victim.claim)["metadata"]["finalizers"]
    # Another tenant gets no further.
    claim_write_denied(cluster, book, "bob", claim, stripping(claim))
    assert names.FINALIZER in current(cluster, victim.claim)["metadata"]["finalizers"]


def test_a_tenant_cannot_remove_kubernetes_delete_protection_from_a_claim_holding_a_gpu(
    cluster: Cluster, book: AuditBook, victim: Victim
) -> None:
    """Without it, the resourceclaim controller drops a released claim's reservation and keeps its allocation;
    reserved for nobody, the claim would look like one the scheduler allocated and never used."""
    claim = current(cluster, victim.claim)
    index = claim["metadata"]["finalizers"].index(names.DELETE_PROTECTION_FINALIZER)
    remove = [
        {"op": "test", "path": f"/metadata/finalizers/{index}", "value": names.DELETE_PROTECTION_FINALIZER},
        {"op": "remove", "path": f"/metadata/finalizers/{index}"},
    ]
    message = claim_write_denied(cluster, book, "alice", claim, remove)
    assert f"removed {names.DELETE_PROTECTION_FINALIZER} from a claim that still holds a GPU" in message
    assert names.DELETE_PROTECTION_FINALIZER in current(cluster, victim.claim)["metadata"]["finalizers"]


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        (names.ANNOTATION_ATTESTATION, "eyJhbGciOiJFZERTQSJ9.e30.c2ln"),
        (names.ANNOTATION_SCRUB_STATUS, names.SCRUB_VERIFIED),
        (names.ANNOTATION_SCRUB_STATUS, None),
        (names.ANNOTATION_DEVICES, "[]"),
        (names.ANNOTATION_DEVICES, None),
    ],
    ids=["forge-attestation", "claim-verified", "drop-status", "empty-devices", "drop-devices"],
)
def test_a_tenant_cannot_write_the_agents_annotations(
    cluster: Cluster, book: AuditBook, victim: Victim, annotation: str, value: str | None
) -> None:
    ns, name = victim.namespace, victim.claim["metadata"]["name"]
    before = current(cluster, victim.claim)["metadata"]["annotations"]
    message = book.denied(
        lambda: patch(cluster, "alice", victim.claim, {"metadata": {"annotations": {annotation: value}}}, "merge"),
        "SG007",
        user="alice",
        operation="UPDATE",
        namespace=ns,
        name=name,
    )
    assert annotation in message and "only the scrubgate node agent" in message
    assert current(cluster, victim.claim)["metadata"]["annotations"] == before


# ---------------------------------------------------------------------- attestations that do not hold


def test_a_replayed_attestation_is_refused(cluster: Cluster, book: AuditBook, victim: Victim, replayable: str) -> None:
    ns, name = victim.namespace, victim.claim["metadata"]["name"]
    claim = current(cluster, victim.claim)
    for body in ([{"op": "add", "path": ATTESTATION, "value": replayable}], stripping(claim, replayable)):
        book.denied(
            lambda body=body: patch(cluster, "alice", claim, body),
            "SG007",
            user="alice",
            operation="UPDATE",
            namespace=ns,
            name=name,
        )
    # With the agent's token (a compromised node), the annotations may be written, but the attestation is
    # another claim's.
    message = claim_write_denied(cluster, book, "agent", claim, stripping(claim, replayable))
    assert f"not this claim's '{claim['metadata']['uid']}'" in message, message
    assert names.FINALIZER in current(cluster, victim.claim)["metadata"]["finalizers"]


@pytest.mark.parametrize("agents_kid", [False, True], ids=["unknown-kid", "agents-kid"])
def test_an_attestation_signed_with_a_wrong_key_is_refused(
    cluster: Cluster, book: AuditBook, victim: Victim, agents_kid: bool
) -> None:
    claim = current(cluster, victim.claim)
    kid = cluster.key_id if agents_kid else "attacker-key"
    forged = attestation_for(cluster, claim, Ed25519PrivateKey.generate(), kid)
    message = claim_write_denied(cluster, book, "agent", claim, stripping(claim, forged))
    expected = "does not verify" if agents_kid else "is not among the policy's attestation keys"
    assert expected in message, message
    assert names.FINALIZER in current(cluster, victim.claim)["metadata"]["finalizers"]


def test_the_agents_own_attestation_would_pass(cluster: Cluster, book: AuditBook, victim: Victim) -> None:
    """The control for the attestation attacks: the same patch with the agent's real key, for this claim
    and all its devices, is accepted (as a dry run: nothing is stored, nothing audited)."""
    claim = current(cluster, victim.claim)
    genuine = attestation_for(cluster, claim, agent_key(cluster), cluster.key_id)
    stored = book.allowed(lambda: patch(cluster, "agent", claim, stripping(claim, genuine), dry_run=True))
    assert names.FINALIZER not in stored["metadata"]["finalizers"]
    assert names.FINALIZER in current(cluster, victim.claim)["metadata"]["finalizers"]


def test_another_nodes_agent_cannot_release_this_nodes_claim(cluster: Cluster, book: AuditBook, victim: Victim) -> None:
    """Every agent has the one ServiceAccount and key; its token is bound to its node (a DaemonSet pod's
    projected token is), and the API server names that node in its user info. An agent elsewhere, with the
    genuine key and a genuine attestation, is refused: it acts on its own node's claims only."""
    cluster.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "elsewhere"}})
    token = cluster.service_account_token(cluster.namespace, names.AGENT_SERVICE_ACCOUNT, "elsewhere")
    cluster.users["agent-elsewhere"] = User(cluster.users["agent"].name, token)
    ns, name = victim.namespace, victim.claim["metadata"]["name"]
    claim = current(cluster, victim.claim)
    genuine = attestation_for(cluster, claim, agent_key(cluster), cluster.key_id)
    message = claim_write_denied(cluster, book, "agent-elsewhere", claim, stripping(claim, genuine))
    assert f"the agent of node 'elsewhere' acted on claim {ns}/{name} of node {cluster.node}" in message, message
    assert names.FINALIZER in current(cluster, victim.claim)["metadata"]["finalizers"]

    # Nor does it lift this node's fallback fence (a node taint); this node's own agent does.
    fence = {"key": names.TAINT_SCRUB_FAILED, "value": "test", "effect": "NoSchedule"}
    path = f"/api/v1/nodes/{cluster.node}"
    taints = (cluster.request("GET", path)["spec"] or {}).get("taints") or []
    merge = "application/merge-patch+json"
    cluster.request("PATCH", path, {"spec": {"taints": [*taints, fence]}}, content_type=merge)
    lift = {"spec": {"taints": taints}}
    message = book.denied(
        lambda: cluster.request("PATCH", path, lift, user="agent-elsewhere", content_type=merge),
        "SG007",
        user="agent-elsewhere",
        operation="UPDATE",
        namespace="",
        name=cluster.node,
    )
    assert f"the agent of node 'elsewhere' acted on the taints of node '{cluster.node}'" in message, message
    book.allowed(lambda: cluster.request("PATCH", path, lift, user="agent", content_type=merge))
    assert fence not in (cluster.request("GET", path)["spec"].get("taints") or [])


def test_an_attestation_must_cover_every_device(cluster: Cluster, book: AuditBook) -> None:
    ns = tenant_namespace(cluster, "pair")
    template = workloads.claim_template("two-gpus", "v1")
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"].update(allocationMode="ExactCount", count=2)
    cluster.request("POST", cluster.resource_path("resourceclaimtemplates", ns, version="v1"), template, user="alice")
    tenant_pod(cluster, "alice", ns, "pair", template="two-gpus", canary=CANARY)
    claim = fenced_claim(cluster, ns, "pair")
    devices = devices_of(claim)
    assert len(devices) == 2
    key = agent_key(cluster)

    partial = attestation_for(cluster, claim, key, cluster.key_id, devices[:1])
    message = claim_write_denied(cluster, book, "agent", claim, stripping(claim, partial))
    assert "does not cover the claim's devices" in message and "/".join(devices[1]) in message, message
    # Nor does shrinking the agent's record of the devices help: the allocation still names both.
    shrink = {"op": "replace", "path": f"/metadata/annotations/{_pointer(names.ANNOTATION_DEVICES)}", "value": "[]"}
    claim_write_denied(cluster, book, "agent", claim, [shrink, *stripping(claim, partial)])
    whole = attestation_for(cluster, claim, key, cluster.key_id)
    book.allowed(lambda: patch(cluster, "agent", claim, stripping(claim, whole), dry_run=True))

    release(cluster, "alice", ns, "pair", claim)


# ---------------------------------------------------------------------- what a tenant may not ask for


TOLERATIONS = {
    "unsanitized": {"key": names.TAINT_UNSANITIZED, "operator": "Exists"},
    "unsanitized-equal": {"key": names.TAINT_UNSANITIZED, "operator": "Equal", "effect": "NoSchedule"},
    "scrub-failed": {"key": names.TAINT_SCRUB_FAILED, "operator": "Exists", "effect": "NoSchedule"},
    "every-taint": {"operator": "Exists"},
}


def _tolerating(kind: str, name: str, shape: str, toleration: dict) -> dict:
    """A claim or template whose request tolerates ``toleration``, in a version's shape (v1-firstAvailable: a subrequest)."""
    version = shape.partition("-")[0]
    build = workloads.claim_template if kind == "resourceclaimtemplates" else workloads.resource_claim
    body = build(name, version, tolerations=[toleration])
    if shape == "v1-firstAvailable":
        spec = body["spec"]["spec"] if kind == "resourceclaimtemplates" else body["spec"]
        (request,) = spec["devices"]["requests"]
        request["firstAvailable"] = [{"name": "whole", **request.pop("exactly")}]
    return body


@pytest.mark.parametrize("shape", ["v1", "v1beta2", "v1beta1", "v1alpha3", "v1-firstAvailable"])
def test_a_tenant_cannot_tolerate_the_fence(cluster: Cluster, book: AuditBook, shape: str) -> None:
    ns, trusted = tenant_namespace(cluster, "tol"), tenant_namespace(cluster, "tol-trusted", trusted=True)
    version = shape.partition("-")[0]
    if version not in cluster.served_versions():
        # No claims in this version on this release (v1alpha3 keeps only DeviceTaintRule): no path around.
        for kind in ("resourceclaimtemplates", "resourceclaims"):
            body = _tolerating(kind, "x", shape, TOLERATIONS["every-taint"])
            status, _ = denial(lambda kind=kind, body=body: cluster.request(
                "POST", cluster.resource_path(kind, ns, version=version), body, user="alice"))  # fmt: skip
            assert status == 404
        return
    for namespace in (ns, trusted):  # tenancy does not matter: a tolerated fence lets in another's data
        for kind in ("resourceclaimtemplates", "resourceclaims"):
            for label, toleration in TOLERATIONS.items():
                name = f"{kind[:-1].lower()}-{label}"
                body = _tolerating(kind, name, shape, toleration)
                path = cluster.resource_path(kind, namespace, version=version)
                message = book.denied(
                    lambda path=path, body=body: cluster.request("POST", path, body, user="alice"),
                    "SG005",
                    user="alice",
                    operation="CREATE",
                    namespace=namespace,
                    name=name,
                )
                assert "tolerates" in message
                assert "every taint" in message if label == "every-taint" else toleration["key"] in message


def test_a_pod_cannot_tolerate_the_node_fence(cluster: Cluster, book: AuditBook) -> None:
    """Where no DeviceTaintRule API is served the agent fences with a node taint during teardown."""
    ns = tenant_namespace(cluster, "tol-pod")
    body = workloads.pod("sneaky", template="one-gpu")
    body["spec"]["tolerations"] = [{"key": names.TAINT_UNSANITIZED, "operator": "Exists", "effect": "NoSchedule"}]
    message = book.denied(
        lambda: cluster.core("alice").create_namespaced_pod(ns, body),
        "SG005",
        user="alice",
        operation="CREATE",
        namespace=ns,
        name="sneaky",
    )
    assert f"pod tolerates the node taint {names.TAINT_UNSANITIZED}" in message


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_admin_access_only_in_a_trusted_namespace(cluster: Cluster, book: AuditBook, version: str) -> None:
    # Kubernetes (1.34+) itself refuses adminAccess outside namespaces an admin labelled for it; SG006 decides
    # in those: only a single-tenant one may have it.
    allowed = {"resource.kubernetes.io/admin-access": "true"}
    shared = tenant_namespace(cluster, "adm", labels=allowed)
    trusted = tenant_namespace(cluster, "adm-trusted", trusted=True, labels=allowed)
    for kind, build in (
        ("resourceclaimtemplates", workloads.claim_template),
        ("resourceclaims", workloads.resource_claim),
    ):
        body = build("debug", version, admin_access=True)
        message = book.denied(
            lambda kind=kind, body=body: cluster.request(
                "POST", cluster.resource_path(kind, shared, version=version), body, user="alice"
            ),
            "SG006",
            user="alice",
            operation="CREATE",
            namespace=shared,
            name="debug",
        )
        assert "adminAccess in a multi-tenant namespace" in message
        created = book.allowed(
            lambda kind=kind, body=body: cluster.request(
                "POST", cluster.resource_path(kind, trusted, version=version), body, user="alice"
            )
        )
        assert created["metadata"]["namespace"] == trusted


# ---------------------------------------------------------------------- force deletion


def test_a_tenant_cannot_force_delete_its_running_pod_but_an_admin_can(cluster: Cluster, book: AuditBook) -> None:
    ns = tenant_namespace(cluster, "force")
    create_template(cluster, "alice", ns, "one-gpu")
    tenant_pod(cluster, "alice", ns, "stuck", template="one-gpu", canary=CANARY)
    claim = fenced_claim(cluster, ns, "stuck")
    core = cluster.core("alice")
    attempts = (
        lambda: core.delete_namespaced_pod("stuck", ns, grace_period_seconds=0),  # kubectl --grace-period=0
        lambda: core.delete_namespaced_pod("stuck", ns, body=k8s.V1DeleteOptions(grace_period_seconds=0)),
    )
    for attempt in attempts:
        message = book.denied(attempt, "SG008", user="alice", operation="DELETE", namespace=ns, name="stuck")
        assert "grace period 0" in message
    pod = cluster.pod(ns, "stuck")
    assert pod is not None and pod["status"]["phase"] == "Running" and not pod["metadata"].get("deletionTimestamp")

    # system:masters may (a node that is gone); the pod goes at once, its process possibly after its claim.
    book.allowed(lambda: cluster.core("admin").delete_namespaced_pod("stuck", ns, grace_period_seconds=0))
    assert cluster.pod(ns, "stuck") is None
    wait_gone(cluster, ns, claim["metadata"]["name"])
    payload = verified_attestation(cluster, claim["metadata"]["uid"])
    assert [d["device"] for d in payload["devices"]] == [d for _, _, d in devices_of(claim)]
    assert CANARY.encode() not in cluster.gpu_memory(cluster.device_uuid(devices_of(claim)[0][2]))


# ---------------------------------------------------------------------- break-glass


def test_break_glass_releases_the_claim_object_only(
    cluster: Cluster, book: AuditBook, replayable: str, victim: Victim
) -> None:
    """Takes ``victim`` so that its claim is allocated before this test: afterwards no claim but the one
    checked here gets the orphan's device."""
    ns = tenant_namespace(cluster, "bg")
    create_template(cluster, "alice", ns, "one-gpu")
    tenant_pod(cluster, "alice", ns, "orphan", template="one-gpu", canary=CANARY)
    claim = fenced_claim(cluster, ns, "orphan")
    name, uid = claim["metadata"]["name"], claim["metadata"]["uid"]
    (device,) = devices_of(claim)
    uuid = cluster.device_uuid(device[2])
    reason = {"metadata": {"annotations": {names.ANNOTATION_BREAK_GLASS: "node agent lost (test)"}}}
    denied = {"user": "alice", "operation": "UPDATE", "namespace": ns, "name": name}

    # Only admins may break glass: not the tenant, not the agent's identity.
    book.denied(lambda: patch(cluster, "alice", claim, reason, "merge"), "SG007", **denied)
    message = book.denied(
        lambda: patch(cluster, "agent", claim, [BREAK_GLASS_OP, *stripping(claim)]),
        "SG007",
        **{**denied, "user": "agent"},
    )
    assert names.ANNOTATION_BREAK_GLASS in message

    # The agent is lost (kill -9: it fences nothing on the way out); the tenant's pod ends, the claim is
    # released and waits on the finalizer, still allocated: the agent's hold in its reservedFor keeps the
    # resourceclaim controller from deallocating it, and that allocation keeps the device from the next tenant.
    next_ns = tenant_namespace(cluster, "bg-next")
    with agent_lost(cluster):
        cluster.core("alice").delete_namespaced_pod("orphan", ns)
        released = wait_for(
            lambda: (c := cluster.claim(ns, name)) and c["metadata"].get("deletionTimestamp") and c,
            WAIT_S,
            f"claim {ns}/{name} released, waiting on {names.FINALIZER}",
        )
        assert (released.get("status") or {}).get("allocation"), f"claim {ns}/{name} deallocated unattested"
        assert agent_reservations(released), f"claim {ns}/{name} lost the agent's hold"
        # A just-released claim is where a forged status or a replay would matter most: still refused.
        for user, body in (
            ("alice", stripping(released)),
            ("alice", [{"op": "add", "path": SCRUB_STATUS, "value": names.SCRUB_VERIFIED}]),
            ("alice", stripping(released, replayable)),
            ("agent", stripping(released, replayable)),
            ("admin", stripping(released)),  # an admin, too, must say why first
        ):
            book.denied(
                lambda user=user, body=body: patch(cluster, user, released, body), "SG007", **{**denied, "user": user}
            )

        # The next tenant asks for exactly that device; the allocation holds it back.
        create_template(cluster, "bob", next_ns, "same-gpu", selectors=[workloads.uuid_selector(uuid)])
        tenant_pod(cluster, "bob", next_ns, "next", template="same-gpu", look_for=CANARY)
        wait_for(lambda: _unschedulable(cluster, next_ns, "next"), WAIT_S, f"pod {next_ns}/next turned away")

        # An admin breaks glass: allowed, and audited; it lets the claim object go, not the allocation, which
        # the agent's hold keeps until its attestation (nothing fenced the device).
        book.allowed(lambda: patch(cluster, "admin", released, reason, "merge"))
        glass = current(cluster, released)
        assert agent_reservations(glass), f"break-glass on claim {ns}/{name} let the agent's hold go"
        book.allowed(
            lambda: patch(cluster, "admin", glass, stripping(glass)),
            Record(("SG007",), "audit", cluster.users["admin"].name, "UPDATE", ns, name),
        )
        (record,) = [r for r in attack_records(cluster) if r["decision"] == "audit" and r["name"] == name]
        assert "break-glass" in record["findings"][0]["message"] and record["findings"][0]["action"] == "audit"
        # The claim object stays: Kubernetes' delete-protection holds it until the allocation goes.
        stuck = current(cluster, released)
        assert stuck["metadata"]["finalizers"] == [names.DELETE_PROTECTION_FINALIZER]
        cluster.observer.sync()
        assert stuck["status"]["allocation"] and agent_reservations(stuck) and not fence_history(cluster, uid)
        assert cluster.pod(next_ns, "next")["status"]["phase"] == "Pending"

    # The agent came back; it scrubs and attests on the claim, and only then does the allocation go.
    wait_gone(cluster, ns, name)
    next_pod = wait_phase(cluster, next_ns, "next", "Running")
    assert canary_found(next_pod) is False and CANARY.encode() not in cluster.gpu_memory(uuid)
    next_claim = running_claim(cluster, next_ns, "next")
    assert devices_of(next_claim) == [device]
    cluster.observer.sync()
    history = claim_history(cluster, uid)
    broken = first_rv(history, lambda e: names.FINALIZER not in (e.obj["metadata"].get("finalizers") or []))
    attested = first_rv(history, is_attested)
    reused = first_rv(claim_history(cluster, next_claim["metadata"]["uid"]), is_allocated)
    assert broken is not None and attested is not None and reused is not None
    assert broken < attested < reused, (broken, attested, reused)
    payload = verified_attestation(cluster, uid)
    assert [(d["device"], d["verified"]) for d in payload["devices"]] == [(device[2], True)]

    release(cluster, "bob", next_ns, "next", next_claim)


@contextlib.contextmanager
def agent_lost(cluster: Cluster) -> Iterator[None]:
    """The node agent is gone (kill -9) for the block, and back (ready) after it, whatever happens in it."""
    cluster.agent.kill()
    try:
        yield
    finally:
        cluster.agent.start()
        cluster.wait_agent_ready()


def _unschedulable(cluster: Cluster, namespace: str, pod: str) -> bool:
    conditions = ((cluster.pod(namespace, pod) or {}).get("status") or {}).get("conditions") or []
    # Turned away for want of an untainted device, not while its claim was still being generated.
    return any(
        c["type"] == "PodScheduled"
        and c.get("reason") == "Unschedulable"
        and "cannot allocate all claims" in c.get("message", "")
        for c in conditions
    )


def _fences(rule: dict, claim_uid: str, device: str) -> bool:
    """Whether a DeviceTaintRule is the agent's unsanitized fence of ``device`` for claim ``claim_uid``."""
    labels = rule["metadata"].get("labels") or {}
    spec = rule.get("spec") or {}
    return (
        labels.get("scrubgate.dev/claim-uid") == claim_uid
        and (spec.get("deviceSelector") or {}).get("device") == device
        and (spec.get("taint") or {}).get("key") == names.TAINT_UNSANITIZED
    )


# ---------------------------------------------------------------------- after all of them


def test_every_attack_left_its_audit_record_and_no_trace_on_the_gpus(
    cluster: Cluster, book: AuditBook, victim: Victim
) -> None:
    # One last attack of its own, so that the book below is never empty, whichever of the tests above ran.
    claim_write_denied(cluster, book, "bob", victim.claim, stripping(current(cluster, victim.claim)))
    # The victim, attacked all along, still leaves the proper way: torn down, attested, scrubbed.
    payload = release(cluster, "alice", victim.namespace, victim.pod, victim.claim)
    (device,) = devices_of(victim.claim)
    assert [(d["device"], d["verified"]) for d in payload["devices"]] == [(device[2], True)]
    assert CANARY.encode() not in cluster.gpu_memory(cluster.device_uuid(device[2]))

    # One record per denial (and per break-glass), in order: none lost, none extra. The resourceclaim
    # controller never tried to release a claim before its attestation: the agent's hold kept it from that.
    assert book.expected, "no attack ran"
    assert [summary(r) for r in attack_records(cluster)] == book.expected
    assert [summary(r) for r in cluster.audit_records() if deallocation(r)] == []
    result = cluster.verify_audit()
    assert result.returncode == 0, f"scrubgate audit verify: {result.stdout}{result.stderr}"

    # No dirty allocation, no unattested finalizer removal (the observer exempts break-glass removals).
    assert_invariant(cluster)


@pytest.mark.parametrize(
    ("name", "expression"),
    [
        ("by-model", "device.driver in device.attributes && has(device.attributes[device.driver].productName)"),
        ("shared", "device.driver == 'gpu.nvidia.com' && has(device.allowMultipleAllocations)"),
        ("pcie-root", "has(device.attributes['resource.kubernetes.io'].pcieRoot)"),
        ("escaped", "device.driver == 'gpu\\x2envidia.com'"),
        ("no-selector", None),
    ],
)
def test_a_class_not_proven_unable_to_hand_out_gpus_guards_its_claims(
    cluster: Cluster, book: AuditBook, name: str, expression: str | None
) -> None:
    """Issue 28, on kube-apiserver: a class a platform admin might well write, picking GPUs by model, by
    `allowMultipleAllocations`, by `pcieRoot` or by nothing at all, is a GPU class whatever its name: the webhook
    (which watches the cluster's DeviceClasses) gives its claims the finalizer and refuses admin access in them in
    a multi-tenant namespace. Under a name the policy leaves out (its claims would skip the webhook), SG009
    refuses it."""
    spec = {"selectors": [{"cel": {"expression": expression}}]} if expression else {}
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": f"picks-{name}"},
        "spec": spec,
    }
    book.allowed(lambda: cluster.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", body, user="admin"))
    ns = tenant_namespace(cluster, f"picks-{name}", labels={"resource.kubernetes.io/admin-access": "true"})
    claim = workloads.resource_claim("c")
    claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = f"picks-{name}"
    created = book.allowed(
        lambda: cluster.request("POST", cluster.resource_path("resourceclaims", ns), claim, user="alice")
    )
    assert names.FINALIZER in created["metadata"]["finalizers"], "a GPU class: its claims are guarded"
    claim["metadata"]["name"] = "admin"
    claim["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
    book.denied(
        lambda: cluster.request("POST", cluster.resource_path("resourceclaims", ns), claim, user="alice"),
        "SG006",
        user="alice",
        operation="CREATE",
        namespace=ns,
        name="admin",
    )
    excluded = {**body, "metadata": {"name": "imex.nvidia.com"}}
    message = book.denied(
        lambda: cluster.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", excluded, user="admin"),
        "SG009",
        user="admin",
        operation="CREATE",
        namespace="",
        name="imex.nvidia.com",
    )
    assert "excludeDeviceClasses" in message, message
