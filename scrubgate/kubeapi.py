"""A thin layer over the official client's ApiClient (kubeconfig or, inside a pod, the service account): plain
JSON requests, line-delimited watch streams, paginated lists. `check --cluster`, `reports`, `uninstall` and the
webhook's DeviceClass watch use it; tests give a fake with the same `request` and `stream`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from scrubgate.policies.names import RESOURCE_VERSIONS

DRA_GROUP = "resource.k8s.io"
PAGE_SIZE = 500


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


def pages(
    api: Api, path: str, page_size: int = PAGE_SIZE, query: Mapping[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    """The list under `path` (with `query`, e.g. a labelSelector), a page of `page_size` items at a time: a
    caller that keeps only part of each item never holds more than one page in full."""
    token = ""
    while True:
        page_query = {**(query or {}), "limit": str(page_size), **({"continue": token} if token else {})}
        page = api.request("GET", path, page_query)
        yield page
        token = (page.get("metadata") or {}).get("continue") or ""
        if not token:
            return


def list_all(
    api: Api, path: str, page_size: int = PAGE_SIZE, query: Mapping[str, str] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Every item under `path` (with `query`), in pages; and the list's resourceVersion (for a watch from
    there)."""
    items: list[dict[str, Any]] = []
    version = ""
    for page in pages(api, path, page_size, query):
        items.extend(page.get("items") or [])
        version = (page.get("metadata") or {}).get("resourceVersion") or ""
    return items, version


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
