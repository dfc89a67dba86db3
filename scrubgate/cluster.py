"""`scrubgate check --cluster`: the objects already in a cluster through the same engine as manifests.

Read-only: list calls only, paginated with `limit` and `continue`, so that a large cluster is read in
pages rather than in one response the API server must build in memory. The engine runs in manifest mode
(no admission request): what it reports is what the object says, whoever wrote it, and whenever; e.g. a
GPU claim created before the webhook and missing its finalizer (SG004).

The API is reached through `KubeApi`, a thin layer over the official client's ApiClient (kubeconfig or,
inside a pod, the service account); tests give a fake with the same `request` and `stream`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.names import RESOURCE_VERSIONS, SYSTEM_NAMESPACE

from .check import CheckResult, check_documents
from .sources import Document

DRA_GROUP = "resource.k8s.io"
PAGE_SIZE = 500
# The namespaces the webhooks leave alone (manifests/webhook-configurations.yaml): reported the same way.
SKIPPED_NAMESPACES = frozenset({"kube-system", SYSTEM_NAMESPACE})


@dataclass(frozen=True)
class Kind:
    group: str  # "" for the core group
    version: str  # "" for resource.k8s.io: the version the server prefers
    plural: str
    kind: str

    def path(self, version: str | None = None) -> str:
        if not self.group:
            return f"/api/{self.version}/{self.plural}"
        return f"/apis/{self.group}/{version or self.version}/{self.plural}"


# Every kind the rules read (policies/model.py, and DeviceClasses), and Namespaces for their tenancy label.
NAMESPACES = Kind("", "v1", "namespaces", "Namespace")
CHECKED_KINDS = (
    Kind("", "v1", "pods", "Pod"),
    Kind("", "v1", "replicationcontrollers", "ReplicationController"),
    Kind("", "v1", "podtemplates", "PodTemplate"),
    Kind("apps", "v1", "deployments", "Deployment"),
    Kind("apps", "v1", "statefulsets", "StatefulSet"),
    Kind("apps", "v1", "replicasets", "ReplicaSet"),
    Kind("apps", "v1", "daemonsets", "DaemonSet"),
    Kind("batch", "v1", "jobs", "Job"),
    Kind("batch", "v1", "cronjobs", "CronJob"),
    Kind(DRA_GROUP, "", "resourceclaims", "ResourceClaim"),
    Kind(DRA_GROUP, "", "resourceclaimtemplates", "ResourceClaimTemplate"),
    # Cluster-scoped: SG009 (a class handing out GPU devices under a name the policy does not count as a GPU
    # class); its findings go to the ClusterPolicyReport.
    Kind(DRA_GROUP, "", "deviceclasses", "DeviceClass"),
)


class ApiError(Exception):
    """An API call failed; the message names the call, the HTTP status and the server's message."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Api(Protocol):
    def request(
        self, method: str, path: str, query: Mapping[str, str] | None = None, body: Any = None
    ) -> dict[str, Any]: ...

    def stream(self, path: str, query: Mapping[str, str]) -> Iterator[dict[str, Any]]: ...


class KubeApi:
    """`Api` over the official client (kubernetes.client.ApiClient)."""

    def __init__(self, api_client: Any, *, timeout_s: float = 60.0) -> None:
        self.client = api_client
        self.timeout_s = timeout_s

    @classmethod
    def connect(cls, kubeconfig: str | None = None, context: str | None = None) -> KubeApi:
        """The kubeconfig (KUBECONFIG or ~/.kube/config unless named) and context; inside a pod with
        neither given, the pod's service account."""
        from kubernetes import client, config

        if kubeconfig is None and context is None and "KUBERNETES_SERVICE_HOST" in os.environ:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            return cls(client.ApiClient(configuration))
        try:
            return cls(config.new_client_from_config(config_file=kubeconfig, context=context))
        except (config.ConfigException, OSError) as exc:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise ApiError(f"kubeconfig {where}: {exc}; pass --kubeconfig FILE and --context NAME") from None

    def _send(self, method: str, path: str, query: Mapping[str, str] | None, body: Any, stream: bool) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        what = f"{method} {path}"
        request = self.client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()) or None,
            header_params={"Accept": "application/json", "Content-Type": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.client.call_api(*request, _request_timeout=None if stream else self.timeout_s)
        except ApiException as exc:
            raise _api_error(what, exc.status or 0, exc.body or exc.reason) from None
        except (HTTPError, OSError) as exc:
            raise ApiError(f"{what}: cannot reach the API server: {exc}") from None
        if not 200 <= response.status <= 299:
            raise _api_error(what, response.status, response.read())
        return response

    def request(
        self, method: str, path: str, query: Mapping[str, str] | None = None, body: Any = None
    ) -> dict[str, Any]:
        data = self._send(method, path, query, body, stream=False).read()
        return json.loads(data) if data else {}

    def stream(self, path: str, query: Mapping[str, str]) -> Iterator[dict[str, Any]]:
        response = self._send("GET", path, query, None, stream=True).response
        try:
            for line in response:
                if line.strip():
                    yield json.loads(line)
        finally:
            response.release_conn()


def _api_error(what: str, status: int, body: bytes | str | None) -> ApiError:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    try:
        message = json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        message = text
    hint = " (the identity lacks list rights on it: see the chart's reports RBAC)" if status == 403 else ""
    return ApiError(f"{what}: HTTP {status}: {str(message).strip()[:300]}{hint}", status)


def list_all(
    api: Api, path: str, page_size: int = PAGE_SIZE, query: Mapping[str, str] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Every item under `path` (with `query`, e.g. a labelSelector), a page of `page_size` at a time; and
    the list's resourceVersion (for a watch from there)."""
    items: list[dict[str, Any]] = []
    token = ""
    while True:
        page_query = {**(query or {}), "limit": str(page_size), **({"continue": token} if token else {})}
        page = api.request("GET", path, page_query)
        items.extend(page.get("items") or [])
        meta = page.get("metadata") or {}
        token = meta.get("continue") or ""
        if not token:
            return items, meta.get("resourceVersion") or ""


def dra_version(api: Api) -> str | None:
    """The resource.k8s.io version the server prefers, if it is one the engine reads; None without DRA."""
    try:
        group = api.request("GET", f"/apis/{DRA_GROUP}")
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise
    served = [v.get("version") for v in group.get("versions") or []]
    preferred = (group.get("preferredVersion") or {}).get("version")
    if preferred in RESOURCE_VERSIONS:
        return preferred
    return next((v for v in RESOURCE_VERSIONS if v in served), None)


@dataclass
class Snapshot:
    """What one scan read: the objects (with their Kind), the list resourceVersions, and notes."""

    objects: list[tuple[Kind, dict[str, Any]]] = field(default_factory=list)
    resource_versions: dict[str, str] = field(default_factory=dict)  # path -> resourceVersion
    notes: list[str] = field(default_factory=list)
    kinds: dict[str, tuple[Kind, str]] = field(default_factory=dict)  # path -> its Kind and apiVersion


def read_cluster(api: Api, page_size: int = PAGE_SIZE) -> Snapshot:
    snapshot = Snapshot()
    version = dra_version(api)
    if version is None:
        snapshot.notes.append(f"the API server serves no {DRA_GROUP} version scrubgate reads: claims not checked")
    for kind in (NAMESPACES, *CHECKED_KINDS):
        if kind.group == DRA_GROUP and version is None:
            continue
        path = kind.path(version)
        items, resource_version = list_all(api, path, page_size)
        snapshot.resource_versions[path] = resource_version
        api_version = f"{kind.group}/{version or kind.version}" if kind.group else kind.version
        snapshot.kinds[path] = (kind, api_version)
        for item in items:
            # List items carry no apiVersion and kind; the engine needs both.
            snapshot.objects.append((kind, {"apiVersion": api_version, "kind": kind.kind, **item}))
    return snapshot


def check_snapshot(
    snapshot: Snapshot, policy: PolicyConfig, overrides: Mapping[str, bool] | None = None
) -> CheckResult:
    """The engine over a snapshot, as `scrubgate check` runs it over files: Namespaces give tenancy."""
    documents = []
    for index, (_, obj) in enumerate(snapshot.objects):
        namespace = (obj.get("metadata") or {}).get("namespace")
        if namespace in SKIPPED_NAMESPACES:
            continue
        documents.append(Document(file="cluster", index=index, obj=obj, span=None))
    result = CheckResult()
    checked = check_documents(documents, policy, overrides, stored=True)
    result.objects = [c for c in checked if c.document.obj["kind"] != "Namespace"]
    return result


def check_cluster(
    api: Api, policy: PolicyConfig, overrides: Mapping[str, bool] | None = None
) -> tuple[CheckResult, list[str]]:
    """Reads the cluster and runs the engine; the notes say what could not be checked (no DRA API)."""
    snapshot = read_cluster(api)
    return check_snapshot(snapshot, policy, overrides), snapshot.notes
