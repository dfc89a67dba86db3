"""Shared helpers of the webhook tests: certificates, a real server on 127.0.0.1, API-server-shaped
AdmissionReviews. Plain functions (no fixtures) so that each test module owns its server's scope."""

from __future__ import annotations

import copy
import json
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.certs.generate import KeyPair, TlsFiles, generate_ca, issue_serving_cert, write_tls_dir
from scrubgate.policies import names
from scrubgate.policies.attestation import build_payload, public_key_pem, sign
from scrubgate.webhook.app import create_app, create_metrics_app
from scrubgate.webhook.http11 import ASGIApp
from scrubgate.webhook.server import Settings, build, build_server

from devcluster.pki import issue_client_cert

SANS = ["scrubgate-webhook.scrubgate-system.svc", "localhost", "127.0.0.1"]


def make_tls_dir(directory: Path) -> TlsFiles:
    ca = generate_ca()
    return write_tls_dir(directory, ca, issue_serving_cert(ca, SANS))


@dataclass
class RunningWebhook:
    url: str
    port: int
    ca_file: Path
    state: Any
    metrics_port: int = 0

    # With --client-ca (serving_api_server_only): the API server's client certificate and key.
    api_server_cert: tuple[Path, Path] | None = None

    def client(self, cert: tuple[Path, Path] | None = None, **kwargs: Any) -> httpx.Client:
        """A client of the admission port; `cert`: the client certificate and key it presents."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if cert is not None:
            context.load_cert_chain(*cert)
        return httpx.Client(base_url=self.url, verify=context, timeout=10, **kwargs)

    def metrics(self) -> str:
        """/metrics, from the metrics port (plain HTTP)."""
        response = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10)
        assert response.status_code == 200, response.text
        return response.text


@contextmanager
def running_webhook(
    settings: Settings, ca_file: Path, metrics_app: ASGIApp | None = None, **timeouts: float
) -> Iterator[RunningWebhook]:
    """The real apps and server with TLS, on ephemeral loopback ports, in a thread; `timeouts` as build_server's;
    `metrics_app` in place of the metrics port's (for tests of the server itself)."""
    state, audit = build(settings)
    metrics_app = metrics_app or create_metrics_app(state)
    server = build_server(state, create_app(state), metrics_app, ("127.0.0.1", 0, 0), **timeouts)
    thread = threading.Thread(target=server.run, name="webhook-under-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started.wait(0.05):
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the webhook under test did not start")
    port, metrics_port = server.ports
    try:
        running = RunningWebhook(f"https://127.0.0.1:{port}", port, ca_file, state, metrics_port)
        running.server = server  # type: ignore[attr-defined]
        yield running
    finally:
        server.stop()
        thread.join(timeout=30)
        if audit is not None:
            audit.close()


@contextmanager
def serving(directory: Path, policy: dict[str, Any] | None = None, **timeouts: float) -> Iterator[RunningWebhook]:
    """A webhook under test with its audit log (`audit_path`) and a client (`http`). `policy` holds the
    PolicyConfig fields to write to its policy file; without it, the shipped default policy applies."""
    tls = make_tls_dir(directory / "tls")
    policy_file = None
    if policy is not None:
        policy_file = directory / "policy.yaml"
        policy_file.write_text(yaml.safe_dump({"apiVersion": "scrubgate.dev/v1", "kind": "PolicyConfig", **policy}))
    audit_log = directory / "audit" / "audit.jsonl"
    settings = Settings(tls_cert=tls.tls_cert, tls_key=tls.tls_key, policy=policy_file, audit_log=audit_log)
    with running_webhook(settings, tls.ca_cert, **timeouts) as running, running.client() as client:
        running.audit_path = audit_log  # type: ignore[attr-defined]
        running.http = client  # type: ignore[attr-defined]
        yield running


def client_cert(ca: KeyPair, directory: Path, name: str) -> tuple[Path, Path]:
    """A client certificate of `ca` whose subject CN is `name`, as devcluster gives kube-apiserver its own."""
    pair = issue_client_cert(ca, name)
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    cert.write_bytes(pair.cert_pem)
    key.write_bytes(pair.key_pem)
    return cert, key


@contextmanager
def serving_api_server_only(
    directory: Path, *, client_names: tuple[str, ...] | None = None, **timeouts: float
) -> Iterator[RunningWebhook]:
    """A webhook with --client-ca (and `client_names`, else the default), its audit log (`audit_path`), and
    `api_server_cert`: a client certificate of that CA for kube-apiserver; `client_ca` signs others."""
    tls = make_tls_dir(directory / "tls")
    client_ca = generate_ca("scrubgate-apiserver-client-ca")
    (directory / "client-ca.crt").write_bytes(client_ca.cert_pem)
    audit_log = directory / "audit" / "audit.jsonl"
    settings = Settings(
        tls_cert=tls.tls_cert,
        tls_key=tls.tls_key,
        client_ca=directory / "client-ca.crt",
        client_names=client_names,
        audit_log=audit_log,
    )
    with running_webhook(settings, tls.ca_cert, **timeouts) as running:
        running.audit_path = audit_log  # type: ignore[attr-defined]
        running.client_ca = client_ca  # type: ignore[attr-defined]
        running.api_server_cert = client_cert(client_ca, directory / "clients", "kube-apiserver")
        yield running


# -- API-server-shaped payloads -------------------------------------------------------------------

USER = {"username": "alice", "uid": "u-1", "groups": ["team-a", "system:authenticated"]}
AGENT = "system:serviceaccount:scrubgate-system:scrubgate-agent"
# The agent as its DaemonSet pod's projected token names it: bound to its node, node-1 (where DEVICE is).
AGENT_ON_NODE_1 = {"username": AGENT, "extra": {"authentication.kubernetes.io/node-name": ["node-1"]}}

_RESOURCES = {
    "Pod": ("", "v1", "pods"),
    "ResourceClaim": ("resource.k8s.io", "v1", "resourceclaims"),
    "ResourceClaimTemplate": ("resource.k8s.io", "v1", "resourceclaimtemplates"),
    "Deployment": ("apps", "v1", "deployments"),
    "ConfigMap": ("", "v1", "configmaps"),
    "DeviceTaintRule": ("resource.k8s.io", "v1", "devicetaintrules"),
    "DeviceClass": ("resource.k8s.io", "v1", "deviceclasses"),
    "Namespace": ("", "v1", "namespaces"),
    "Eviction": ("", "v1", "pods"),  # the pods/eviction subresource; callers set subResource and kind
}


def review(
    obj: dict[str, Any] | None,
    *,
    operation: str = "CREATE",
    old: dict[str, Any] | None = None,
    user: dict[str, Any] | None = None,
    dry_run: bool = False,
    options: dict[str, Any] | None = None,
    uid: str | None = None,
) -> dict[str, Any]:
    """An AdmissionReview as kube-apiserver sends it (admission.k8s.io/v1, every field it fills)."""
    subject = obj if obj is not None else old
    assert subject is not None
    kind = subject["kind"]
    group, version, resource = _RESOURCES[kind]
    meta = subject.get("metadata", {})
    if options is None:
        options = {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.capitalize()}Options"}
    request = {
        "uid": uid or str(uuid.uuid4()),
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": resource},
        "requestKind": {"group": group, "version": version, "kind": kind},
        "requestResource": {"group": group, "version": version, "resource": resource},
        "name": meta.get("name", ""),
        "namespace": meta.get("namespace", ""),
        "operation": operation,
        "userInfo": user or USER,
        "object": obj,
        "oldObject": old,
        "dryRun": dry_run,
        "options": options,
    }
    request = copy.deepcopy(request)  # callers may mutate the review; shared constants stay intact
    if not request["name"]:
        del request["name"]  # generateName: the API server sends no name
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def gpu_claim(
    name: str | None = "train-0",
    namespace: str = "team-a",
    *,
    annotations: dict[str, str] | None = None,
    finalizers: list[str] | None = None,
    uid: str = "c1a1m000-0000-4000-8000-000000000001",
    **request_fields: Any,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": namespace, "uid": uid, "creationTimestamp": "2025-01-01T00:00:00Z"}
    if name:
        meta["name"] = name
    else:
        meta["generateName"] = "trainer-7d9f-gpu-"
    if annotations:
        meta["annotations"] = annotations
    if finalizers is not None:
        meta["finalizers"] = finalizers
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", **request_fields}}]
            }
        },
    }


def generated_claim(pod_name: str = "trainer-7d9f", namespace: str = "team-a") -> dict[str, Any]:
    """A claim as the resourceclaim controller creates it from a pod's template: generateName, no name,
    the pod as controlling owner and the pod-claim-name annotation."""
    claim = gpu_claim(None, namespace)
    claim["metadata"].pop("uid")
    claim["metadata"]["generateName"] = f"{pod_name}-gpu-"
    claim["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpu"}
    claim["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod_name,
            "uid": "p0d00000-0000-4000-8000-000000000001",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return claim


def gpu_pod(
    name: str = "trainer-7d9f",
    namespace: str = "team-a",
    *,
    grace: int | None = 30,
    claim_ref: dict[str, str] | None = None,
    tolerations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {"name": "main", "image": "registry.example/trainer:1", "resources": {"claims": [{"name": "gpu"}]}}
        ],
        "resourceClaims": [{"name": "gpu", **(claim_ref or {"resourceClaimTemplateName": "one-gpu"})}],
        "restartPolicy": "Never",
    }
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    if tolerations is not None:
        spec["tolerations"] = tolerations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": "p0d00000-0000-4000-8000-000000000001"},
        "spec": spec,
    }


def with_changes(obj: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    changed["metadata"].update(metadata)
    return changed


# ---------------------------------------------------------------- admission calls and the claims they carry

# The node agent's key: the test webhooks' policies trust it under kid node-agent-1.
SIGNING_KEY = Ed25519PrivateKey.generate()
AGENT_KEYS = [{"kid": "node-agent-1", "publicKey": public_key_pem(SIGNING_KEY)}]
ADMIN = {"username": "root-admin", "groups": ["system:masters", "system:authenticated"]}


def post_review(webhook, path: str, body: dict) -> dict:
    response = webhook.http.post(path, json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == body["request"]["uid"]
    return out["response"]


def audit_records(webhook) -> list[dict]:
    return [json.loads(line) for line in Path(webhook.audit_path).read_text().splitlines()]


def record_for(webhook, uid: str) -> dict:
    matches = [r for r in audit_records(webhook) if r["uid"] == uid]
    assert len(matches) == 1, matches
    return matches[0]


DEVICE = {"driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0"}


def allocated_claim() -> dict:
    claim = gpu_claim(
        finalizers=[names.FINALIZER],
        annotations={names.ANNOTATION_DEVICES: json.dumps([{**DEVICE, "uuid": "GPU-1"}])},
    )
    claim["status"] = {"allocation": {"devices": {"results": [{**DEVICE, "request": "gpu"}]}}}
    return claim


def attestation(claim: dict, *, uid: str | None = None) -> str:
    now = datetime.now(UTC)
    payload = build_payload(
        namespace=claim["metadata"]["namespace"],
        name=claim["metadata"]["name"],
        uid=uid or claim["metadata"]["uid"],
        node="node-1",
        devices=[
            {
                **DEVICE,
                "uuid": "GPU-1",
                "bytesScrubbed": 80 << 30,
                "bytesTotal": 80 << 30,
                "method": names.ATTESTATION_METHOD,
                "verified": True,
            }
        ],
        started_at=now,
        finished_at=now,
        health={"eccUncorrectable": 0, "remapPending": False, "xids": []},
    )
    return sign(payload, SIGNING_KEY, "node-agent-1")
