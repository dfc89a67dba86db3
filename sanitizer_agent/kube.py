"""What the agent needs from the Kubernetes API, behind a small interface.

`ClusterClient` is all the state machine sees, so it is tested against an in-memory double;
`KubernetesClusterClient` implements it with the official `kubernetes` client. It speaks raw JSON
through `ApiClient` rather than the typed models: the agent reads several `resource.k8s.io` versions
(DeviceTaintRule is v1, v1beta2 or v1alpha3 depending on the cluster) and works on plain dicts, the
same ones the policy core reads.

At scale each agent lists and watches only its own node's pods (field selector `spec.nodeName`) and its own
node's claims (label selector `scrubgate.dev/node=<node>`: claims cannot be field-selected by node; the agent
labels a claim at first sight, scrubgate's controller labels those allocated while no agent looked), and gets
claims by name where a decision needs the latest. No request of an agent reads what grows with the cluster.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

from scrubgate.policies import names

log = logging.getLogger(__name__)

T = TypeVar("T")

GROUP = names.RESOURCE_GROUP
# DeviceTaintRule: v1 where served, else v1beta2, else v1alpha3 (DESIGN.md, "Why the agent must fence").
TAINT_RULE_VERSIONS = ("v1", "v1beta2", "v1alpha3")
CLAIM_VERSIONS = names.RESOURCE_VERSIONS
TRANSIENT_STATUS = frozenset({0, 408, 429, 500, 502, 503, 504})


class ClusterError(Exception):
    """An API call failed; `status` is the HTTP status (0 when the server could not be reached)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class NotFound(ClusterError):
    pass


class Conflict(ClusterError):
    """The object changed under us (409), or a JSON-patch `test` failed (422): re-read and decide again."""


class ClusterClient(Protocol):
    def list_node_pods(self, node: str) -> tuple[list[dict[str, Any]], str]:
        """The pods bound to `node` and the list's resourceVersion (to watch from)."""
        ...

    def watch_node_pods(self, node: str, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict]]:
        """(event type, pod) for pods bound to `node` from `resource_version`; ends after `timeout_s`.
        Raises ClusterError with status 410 when the version is too old (list again)."""
        ...

    def get_claim(self, namespace: str, name: str, not_older_than: str = "") -> dict[str, Any] | None:
        """The ResourceClaim, or None when it does not exist. Read from etcd (a quorum read), or, given
        `not_older_than` (the resourceVersion of an event that came after what the caller must see, such as the
        binding of a pod that uses the claim), from the API server's watch cache, as of that version or later."""
        ...

    def list_node_claims(self, node: str) -> tuple[list[dict[str, Any]], str]:
        """The claims labelled with `node` (names.LABEL_NODE) as the API server's watch cache has them
        (resourceVersion "0": possibly a little behind, never a read of etcd), and the list's resourceVersion."""
        ...

    def watch_node_claims(self, node: str, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict]]:
        """(event type, claim) for the claims labelled with `node` from `resource_version`, as `watch_node_pods`.
        A claim whose label goes comes as DELETED."""
        ...

    def patch_claim(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """Applies a JSON patch (RFC 6902) to the claim's metadata; Conflict when a `test` op fails."""
        ...

    def patch_claim_status(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """JSON patch of the claim's status subresource (the agent's hold: status.reservedFor)."""
        ...

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod, or None when it does not exist."""
        ...

    def get_consumer(self, namespace: str, api_group: str, resource: str, name: str) -> dict[str, Any] | None:
        """A claim's consumer that is not a pod (a PodGroup), by its reservedFor entry: None when it does not
        exist, or its API is not served at all."""
        ...

    def list_node_slices(self, node: str) -> list[dict[str, Any]]:
        """The ResourceSlices that publish `node`'s devices."""
        ...

    def device_taint_rule_version(self) -> str | None:
        """The resource.k8s.io version serving DeviceTaintRule (v1, v1beta2, v1alpha3), None if none is."""
        ...

    def create_device_taint_rule(self, version: str, rule: dict[str, Any]) -> None:
        """Creates the rule; one that already exists under that name counts as created if it fences the same
        device with the same taint, and is replaced otherwise (someone took the fence's name first)."""
        ...

    def delete_device_taint_rule(self, version: str, name: str) -> None:
        """Deletes the rule; one that does not exist counts as deleted."""
        ...

    def get_node(self, name: str) -> dict[str, Any]: ...

    def patch_node(self, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """Applies a JSON patch to the Node; Conflict when a `test` op fails."""
        ...

    def create_event(self, namespace: str, event: dict[str, Any]) -> None: ...


def with_retries(
    what: str,
    call: Callable[[], T],
    *,
    attempts: int = 4,
    backoff_s: float = 0.2,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Runs `call`, retrying transient API errors (unreachable, 429, 5xx) with exponential backoff."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except ClusterError as exc:
            if exc.status not in TRANSIENT_STATUS or attempt == attempts:
                raise
            delay = backoff_s * 2 ** (attempt - 1)
            log.warning("%s failed (%s); retrying in %.1fs (attempt %d of %d)", what, exc, delay, attempt, attempts)
            sleep(delay)
    raise AssertionError("unreachable")


def _error(what: str, status: int, body: bytes | str | None) -> ClusterError:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    try:
        message = json.loads(text).get("message") or text
    except (json.JSONDecodeError, AttributeError):
        message = text
    detail = f"{what}: HTTP {status}: {message.strip()[:500]}"
    if status == 404:
        return NotFound(detail, status)
    if status in (409, 422):
        return Conflict(detail, status)
    return ClusterError(detail, status)


def same_fence(existing: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether a stored DeviceTaintRule does what `wanted` does: the same device selector and taint (key, value,
    effect; the API server adds `timeAdded`)."""
    have, want = existing.get("spec") or {}, wanted.get("spec") or {}
    taint_fields = ("key", "value", "effect")
    return have.get("deviceSelector") == want.get("deviceSelector") and all(
        (have.get("taint") or {}).get(f) == (want.get("taint") or {}).get(f) for f in taint_fields
    )


def taint_rule_path(version: str, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{version}/devicetaintrules"
    return base if name is None else f"{base}/{quote(name, safe='')}"


class KubernetesClusterClient:
    """ClusterClient over the official client's ApiClient (kubeconfig or in-cluster service account)."""

    def __init__(self, api_client: Any, *, request_timeout_s: float = 30.0) -> None:
        self.api = api_client
        self.request_timeout_s = request_timeout_s
        self._versions: dict[str, str | None] = {}
        self._group_versions: dict[str, str | None] = {}  # API group -> its preferred version (None: not served)

    @classmethod
    def from_config(cls, kubeconfig: str | None = None, connections: int | None = None) -> KubernetesClusterClient:
        """`connections`: API calls made at once (the agent's lanes); kept open, not reopened per call."""
        from kubernetes import client, config

        if kubeconfig:
            configuration = type.__call__(client.Configuration)  # as new_client_from_config: not the shared default
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
        if connections is not None:
            configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize, connections)
        return cls(client.ApiClient(configuration))

    # ------------------------------------------------------------------ transport

    def _send(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        stream: bool = False,
        timeout_s: float | None = None,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        what = f"{method} {path}"
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or None,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api.call_api(*request, _request_timeout=timeout_s or self.request_timeout_s)
        except ApiException as exc:
            raise _error(what, exc.status or 0, exc.body or exc.reason) from exc
        except (HTTPError, OSError) as exc:
            raise ClusterError(f"{what}: cannot reach the API server: {exc}", 0) from exc
        if not 200 <= response.status <= 299:
            raise _error(what, response.status, response.read())
        if stream:
            return response.response
        data = response.read()
        return json.loads(data) if data else None

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        return with_retries(f"{method} {path}", lambda: self._send(method, path, **kwargs))

    def _list(self, path: str, query: list[tuple[str, str]]) -> tuple[list[dict[str, Any]], str]:
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            page = self._call("GET", path, query=[*query, ("limit", "500")] + ([("continue", token)] if token else []))
            items.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return items, (page.get("metadata") or {}).get("resourceVersion") or ""

    def _served_version(self, resource: str, candidates: tuple[str, ...]) -> str | None:
        """The first of `candidates` under resource.k8s.io that serves `resource` (discovery, cached)."""
        if resource not in self._versions:
            found = None
            for version in candidates:
                try:
                    listing = self._call("GET", f"/apis/{GROUP}/{version}")
                except NotFound:
                    continue
                if any(r.get("name") == resource for r in listing.get("resources") or []):
                    found = version
                    break
            self._versions[resource] = found
        return self._versions[resource]

    def _claims_path(self, namespace: str | None = None, name: str = "") -> str:
        """The claims of all namespaces (namespace None), those of `namespace`, or the claim `name` in it."""
        version = self._served_version("resourceclaims", CLAIM_VERSIONS)
        if version is None:
            raise ClusterError(f"the API server serves no {GROUP} version with resourceclaims", 404)
        if namespace is None:
            return f"/apis/{GROUP}/{version}/resourceclaims"
        path = f"/apis/{GROUP}/{version}/namespaces/{quote(namespace, safe='')}/resourceclaims"
        return f"{path}/{quote(name, safe='')}" if name else path

    # ------------------------------------------------------------------ ClusterClient

    def list_node_pods(self, node: str) -> tuple[list[dict[str, Any]], str]:
        return self._list("/api/v1/pods", [("fieldSelector", f"spec.nodeName={node}")])

    def watch_node_pods(self, node: str, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict]]:
        selector = ("fieldSelector", f"spec.nodeName={node}")
        return self._watch("/api/v1/pods", selector, resource_version, timeout_s, f"pods on {node}")

    def list_node_claims(self, node: str) -> tuple[list[dict[str, Any]], str]:
        # One page: resourceVersion "0" is served from the watch cache, and one node has few claims.
        query = [("labelSelector", f"{names.LABEL_NODE}={node}"), ("resourceVersion", "0")]
        found = self._call("GET", self._claims_path(), query=query)
        return found.get("items") or [], (found.get("metadata") or {}).get("resourceVersion") or ""

    def watch_node_claims(self, node: str, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict]]:
        selector = ("labelSelector", f"{names.LABEL_NODE}={node}")
        return self._watch(self._claims_path(), selector, resource_version, timeout_s, f"claims of {node}")

    # scrubgate's controller only: the one cluster-wide view of claims (no agent lists or watches them all).
    def list_all_claims(self) -> tuple[list[dict[str, Any]], str]:
        return self._list(self._claims_path(), [])

    def watch_all_claims(self, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict]]:
        return self._watch(self._claims_path(), None, resource_version, timeout_s, "every claim")

    def _watch(
        self, path: str, selector: tuple[str, str] | None, resource_version: str, timeout_s: int, what: str
    ) -> Iterator[tuple[str, dict]]:
        from urllib3.exceptions import HTTPError

        query = [
            *([selector] if selector else []),
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", str(timeout_s)),
        ]
        response = self._send("GET", path, query=query, stream=True, timeout_s=timeout_s + 10)
        try:
            for line in _lines(response):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ClusterError(f"watch of {what}: {obj.get('message')}", int(obj.get("code") or 0))
                yield kind, obj
        except (HTTPError, OSError) as exc:  # the stream broke (an API server restart): an outage, not a bug
            raise ClusterError(f"watch of {what}: connection to the API server lost: {exc}", 0) from exc
        finally:
            response.release_conn()

    def get_claim(self, namespace: str, name: str, not_older_than: str = "") -> dict[str, Any] | None:
        path = self._claims_path(namespace, name)

        def read() -> dict[str, Any]:
            if not_older_than:
                # Served from the watch cache, which kube-apiserver guarantees at least as fresh as the version
                # (k8s.io/apiserver CacheDelegator.Get). One that cannot catch up within its wait answers 504 (Too
                # large resource version): etcd answers then, as it does where no version is given.
                try:
                    return self._send("GET", path, query=[("resourceVersion", not_older_than)])
                except ClusterError as exc:
                    if exc.status != 504:
                        raise
                    log.info("GET %s from the watch cache failed (%s); reading it from etcd", path, exc)
            return self._send("GET", path)

        try:
            return with_retries(f"GET {path}", read)
        except NotFound:
            return None

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}")
        except NotFound:
            return None

    def get_consumer(self, namespace: str, api_group: str, resource: str, name: str) -> dict[str, Any] | None:
        if api_group not in self._group_versions:
            try:
                group = self._call("GET", f"/apis/{quote(api_group, safe='')}")
            except NotFound:
                group = {}
            self._group_versions[api_group] = (group.get("preferredVersion") or {}).get("version")
        version = self._group_versions[api_group]
        if version is None:
            return None  # no such API: no such consumer
        path = f"/apis/{api_group}/{version}/namespaces/{quote(namespace, safe='')}/{quote(resource, safe='')}"
        try:
            return self._call("GET", f"{path}/{quote(name, safe='')}")
        except NotFound:
            return None

    def patch_claim(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        # No retry on Conflict: the caller re-reads and decides again.
        return self._call(
            "PATCH", self._claims_path(namespace, name), body=ops, content_type="application/json-patch+json"
        )

    def patch_claim_status(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        path = f"{self._claims_path(namespace, name)}/status"
        return self._call("PATCH", path, body=ops, content_type="application/json-patch+json")

    def list_node_slices(self, node: str) -> list[dict[str, Any]]:
        version = self._served_version("resourceslices", CLAIM_VERSIONS)
        if version is None:
            return []
        return self._list(f"/apis/{GROUP}/{version}/resourceslices", [("fieldSelector", f"spec.nodeName={node}")])[0]

    def device_taint_rule_version(self) -> str | None:
        return self._served_version("devicetaintrules", TAINT_RULE_VERSIONS)

    def create_device_taint_rule(self, version: str, rule: dict[str, Any]) -> None:
        body = {**rule, "apiVersion": f"{GROUP}/{version}", "kind": "DeviceTaintRule"}
        name = rule["metadata"]["name"]
        try:
            self._call("POST", taint_rule_path(version), body=body)
            return
        except Conflict as exc:
            if exc.status != 409:
                raise
        existing = self._call("GET", taint_rule_path(version, name))
        if same_fence(existing, rule):
            return
        log.warning(
            "DeviceTaintRule %s exists but does not fence what scrubgate's fence of that name must (%s); "
            "replacing it. Check who created it: only the scrubgate agent should",
            name,
            json.dumps(existing.get("spec"), sort_keys=True),
        )
        self.delete_device_taint_rule(version, name)
        self._call("POST", taint_rule_path(version), body=body)

    def delete_device_taint_rule(self, version: str, name: str) -> None:
        with contextlib.suppress(NotFound):
            self._call("DELETE", taint_rule_path(version, name))

    def get_node(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/api/v1/nodes/{quote(name, safe='')}")

    def patch_node(self, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        return self._call(
            "PATCH", f"/api/v1/nodes/{quote(name, safe='')}", body=ops, content_type="application/json-patch+json"
        )

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        self._call("POST", f"/api/v1/namespaces/{quote(namespace, safe='')}/events", body=event)


def _lines(response: Any) -> Iterator[str]:
    """Newline-delimited JSON from a streamed urllib3 response."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=True):
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line.decode("utf-8", "replace")
    if buffer.strip():
        yield buffer.decode("utf-8", "replace")
