"""`scrubgate check --cluster`: the objects already in a cluster through the same engine as manifests.

Read-only: list calls only, paginated with `limit` and `continue`, so that a large cluster is read in
pages rather than in one response the API server must build in memory. The engine runs in manifest mode
(no admission request): what it reports is what the object says, whoever wrote it, and whenever; e.g. a
GPU claim created before the webhook and missing its finalizer (SG004).

The API is reached through `kubeapi.KubeApi`; tests give a fake with the same `request` and `stream`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.names import SYSTEM_NAMESPACE

from .check import CheckResult, check_documents
from .kubeapi import DRA_GROUP, PAGE_SIZE, Api, ApiError, KubeApi, dra_version, list_all, pages
from .sources import Document

__all__ = ["DRA_GROUP", "Api", "ApiError", "KubeApi", "dra_version", "list_all"]  # imported from here too

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


@dataclass
class Snapshot:
    """What one scan read: the objects (with their Kind), the list resourceVersions, and notes."""

    objects: list[tuple[Kind, Any]] = field(default_factory=list)  # what `keep` made of each object listed
    resource_versions: dict[str, str] = field(default_factory=dict)  # path -> resourceVersion
    notes: list[str] = field(default_factory=list)
    kinds: dict[str, tuple[Kind, str]] = field(default_factory=dict)  # path -> its Kind and apiVersion


def read_cluster(
    api: Api, page_size: int = PAGE_SIZE, keep: Callable[[dict[str, Any]], Any] = lambda obj: obj
) -> Snapshot:
    """Lists every kind the rules read. `keep` turns each object listed (with its apiVersion and kind) into what
    the snapshot holds of it, or None to hold nothing, as each page arrives: `scrubgate reports` keeps only what
    the rules read (slim.py), and holds one page of whole objects at a time."""
    snapshot = Snapshot()
    version = dra_version(api)
    if version is None:
        snapshot.notes.append(f"the API server serves no {DRA_GROUP} version scrubgate reads: claims not checked")
    for kind in (NAMESPACES, *CHECKED_KINDS):
        if kind.group == DRA_GROUP and version is None:
            continue
        path = kind.path(version)
        api_version = f"{kind.group}/{version or kind.version}" if kind.group else kind.version
        snapshot.kinds[path] = (kind, api_version)
        for page in pages(api, path, page_size):
            for item in page.get("items") or []:
                # List items carry no apiVersion and kind; the engine needs both.
                kept = keep({"apiVersion": api_version, "kind": kind.kind, **item})
                if kept is not None:
                    snapshot.objects.append((kind, kept))
            snapshot.resource_versions[path] = (page.get("metadata") or {}).get("resourceVersion") or ""
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
