"""The API server as the tests use it: the official client as the admin or a tenant, raw JSON requests, the
paths and reads of the objects they look at, and the set-up they need (namespaces tenants may edit, Jobs,
ServiceAccount tokens). Part of the test and demo harness (devcluster/harness.py)."""

from __future__ import annotations

import contextlib
import copy
import json
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from scrubgate.policies import names

from .processes import HarnessError, wait_for
from .rest import Rest

TOKEN_SECONDS = 24 * 3600
AGENT_USER = f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}"
# kube-controller-manager runs with --use-service-account-credentials: each controller is its own account.
CLAIM_CONTROLLER_USER = "system:serviceaccount:kube-system:resource-claim-controller"


@dataclass
class User:
    name: str
    token: str
    groups: tuple[str, ...] = ()


def cluster_users(tenants: Iterable[str], namespace: str) -> dict[str, User]:
    """``admin`` (system:masters), one static-token user per tenant, and ``agent``: the agent's ServiceAccount
    in scrubgate's ``namespace``, whose token comes from the TokenRequest API at start."""
    users = {"admin": User("kubernetes-admin", secrets.token_hex(16), ("system:masters",))}
    for name in tenants:
        users[name] = User(name, secrets.token_hex(16))
    users["agent"] = User(f"system:serviceaccount:{namespace}:{names.AGENT_SERVICE_ACCOUNT}", "")
    return users


class KubeApi:
    """The API server at ``url`` (CA ``ca_file``) for the ``users`` (keys: admin, the tenants, agent)."""

    def __init__(
        self, url: str, ca_file: Path, users: dict[str, User], tenants: list[str], ready_timeout: float
    ) -> None:
        self.url = url
        self.ca_file = ca_file
        self.users = users
        self.tenants = tenants
        self.ready_timeout = ready_timeout
        self._clients: dict[str, k8s.ApiClient] = {}

    def client(self, user: str = "admin") -> k8s.ApiClient:
        """The official client, authenticated as ``user`` (a key of ``users``)."""
        if user not in self._clients:
            configuration = k8s.Configuration(
                host=self.url,
                api_key={"authorization": self.users[user].token},
                api_key_prefix={"authorization": "Bearer"},
            )
            configuration.ssl_ca_cert = str(self.ca_file)
            self._clients[user] = k8s.ApiClient(configuration)
        return self._clients[user]

    def close(self) -> None:
        for api_client in self._clients.values():
            api_client.close()
        self._clients.clear()

    def core(self, user: str = "admin") -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.client(user))

    def resource(self, user: str = "admin", version: str = "v1") -> Any:
        """ResourceV1Api, ResourceV1beta2Api, ResourceV1beta1Api or ResourceV1alpha3Api."""
        return getattr(k8s, f"Resource{version[0].upper()}{version[1:]}Api")(self.client(user))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        user: str = "admin",
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """A raw JSON request through the official client (any version, any shape); ApiException on an
        error status, with the API server's Status in ``.body``."""
        return Rest(self.client(user)).request(method, path, body, query=query, content_type=content_type)

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Create ``doc`` as the admin, or replace it when it exists (kubectl apply's outcome)."""
        path = object_path(doc)
        try:
            return self.request("POST", path.rsplit("/", 1)[0], doc)
        except ApiException as exc:
            if exc.status != 409:
                raise
        current = self.request("GET", path)
        doc = {
            **copy.deepcopy(doc),
            "metadata": {**doc["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]},
        }
        return self.request("PUT", path, doc)

    # ------------------------------------------------------------------ set-up

    def create_namespace(self, name: str, trusted: bool = False, labels: dict[str, str] | None = None) -> None:
        """A namespace (created by the admin) where every tenant may `edit` (the bootstrap ClusterRole), ready
        for pods (its `default` ServiceAccount exists)."""
        labels = {**(labels or {}), **({names.TENANCY_LABEL: names.TENANCY_TRUSTED} if trusted else {})}
        self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels}})
        if self.tenants:
            self.request(
                "POST",
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{name}/rolebindings",
                {
                    "metadata": {"name": "tenants-edit"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
                    "subjects": [
                        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": self.users[t].name}
                        for t in self.tenants
                    ],
                },
            )
        wait_for(
            lambda: Rest(self.client()).get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
            self.ready_timeout,
            f"the default ServiceAccount of namespace {name}",
            interval=0.1,
        )
        for tenant in self.tenants:
            # The RoleBinding, and the `edit` rules the role-aggregation controller adds after start-up, reach
            # the RBAC authorizer through informers: wait until the API server says the tenant may work here.
            wait_for(
                lambda tenant=tenant: self._may(tenant, name, "create", "resource.k8s.io", "resourceclaimtemplates"),
                self.ready_timeout,
                f"RBAC letting {tenant} edit namespace {name}",
                interval=0.1,
            )

    def _may(self, user: str, namespace: str, verb: str, group: str, resource: str) -> bool:
        """The API server's answer (a SubjectAccessReview) to: may ``user`` do this?"""
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": self.users[user].name,
                "resourceAttributes": {"namespace": namespace, "verb": verb, "group": group, "resource": resource},
            },
        }
        reply = self.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
        return bool((reply.get("status") or {}).get("allowed"))

    def create_job(self, user: str, job: dict[str, Any]) -> str:
        """Create the Job as ``user``; returns the name of the pod the Job controller creates for it."""
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        self.request("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", job, user=user)
        query = [("labelSelector", f"batch.kubernetes.io/job-name={name}")]
        pods = wait_for(
            lambda: self.request("GET", f"/api/v1/namespaces/{namespace}/pods", query=query)["items"],
            self.ready_timeout,
            f"the pod of Job {namespace}/{name}",
            interval=0.1,
        )
        return pods[0]["metadata"]["name"]

    def service_account_token(self, namespace: str, name: str, node: str | None = None) -> str:
        """A token for a ServiceAccount from the TokenRequest API, as a projected token volume gets one; with
        `node`, bound to that Node, so that the API server names the node in the user's extra
        (authentication.kubernetes.io/node-name), as it does for a DaemonSet pod's projected token."""
        spec: dict[str, Any] = {"expirationSeconds": TOKEN_SECONDS}
        if node is not None:
            uid = wait_for(lambda: self._node_uid(node), self.ready_timeout, f"node {node} registered")
            spec["boundObjectRef"] = {"kind": "Node", "apiVersion": "v1", "name": node, "uid": uid}
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        reply = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", body)
        return reply["status"]["token"]

    def _node_uid(self, node: str) -> str | None:
        found = Rest(self.client()).get(f"/api/v1/nodes/{node}")
        return found["metadata"]["uid"] if found else None

    # ------------------------------------------------------------------ reads

    def resource_path(self, plural: str, namespace: str = "", name: str = "", version: str | None = None) -> str:
        """The URL path of a resource.k8s.io collection or object, in ``version`` (default v1). For versions
        the official client has no typed API for (v1alpha3), use it with ``request``."""
        path = f"/apis/{names.RESOURCE_GROUP}/{version or 'v1'}"
        path += f"/namespaces/{namespace}/{plural}" if namespace else f"/{plural}"
        return f"{path}/{name}" if name else path

    def claims(self, namespace: str) -> list[dict[str, Any]]:
        return self.request("GET", self.resource_path("resourceclaims", namespace))["items"]

    def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return Rest(self.client()).get(self.resource_path("resourceclaims", namespace, name))

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return Rest(self.client()).get(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def pod_claim(self, namespace: str, pod_name: str, claim: str = "gpu") -> str | None:
        """The name of the claim generated for ``pod_name``'s pod claim ``claim`` (or, for a pod that asks
        for an extended resource, the claim the scheduler created), once there is one."""
        status = (self.pod(namespace, pod_name) or {}).get("status") or {}
        for entry in status.get("resourceClaimStatuses") or []:
            if entry.get("name") == claim:
                return entry.get("resourceClaimName")
        return (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")

    def served_versions(self) -> list[str]:
        """The resource.k8s.io versions that serve ResourceClaims, newest first."""
        groups = self.request("GET", f"/apis/{names.RESOURCE_GROUP}")
        served = {v["version"] for v in groups["versions"]}
        return [
            v
            for v in names.RESOURCE_VERSIONS
            if v in served
            and any(
                r["name"] == "resourceclaims"
                for r in self.request("GET", f"/apis/{names.RESOURCE_GROUP}/{v}")["resources"]
            )
        ]

    def taint_rule_version(self) -> str | None:
        """The newest resource.k8s.io version that serves DeviceTaintRule (v1 from 1.37, v1alpha3 on 1.34)."""
        for version in ("v1", "v1beta2", "v1alpha3"):
            with contextlib.suppress(ApiException):
                resources = self.request("GET", f"/apis/{names.RESOURCE_GROUP}/{version}")["resources"]
                if any(r["name"] == "devicetaintrules" for r in resources):
                    return version
        return None

    def taint_rules(self) -> list[dict[str, Any]]:
        version = self.taint_rule_version()
        if version is None:
            return []
        return self.request("GET", f"/apis/{names.RESOURCE_GROUP}/{version}/devicetaintrules")["items"]


def object_path(doc: dict[str, Any]) -> str:
    """The URL path of ``doc`` (kinds whose plural is the regular English one, as for every kind here)."""
    api_version, kind, meta = doc["apiVersion"], doc["kind"], doc["metadata"]
    lower = kind.lower()
    plural = lower[:-1] + "ies" if lower.endswith("y") else lower + ("es" if lower.endswith("s") else "s")
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    namespace = meta.get("namespace")
    return (
        f"{prefix}/namespaces/{namespace}/{plural}/{meta['name']}" if namespace else f"{prefix}/{plural}/{meta['name']}"
    )


def denial(call: Callable[[], object]) -> tuple[int, str]:
    """Runs an API call that should be refused; returns (HTTP status, the API server's message).
    HarnessError when it went through."""
    try:
        call()
    except ApiException as exc:
        try:
            message = json.loads(exc.body or "{}").get("message") or exc.reason
        except ValueError:
            message = exc.body or exc.reason
        return exc.status, str(message)
    raise HarnessError("the API server accepted a request that should have been rejected")
