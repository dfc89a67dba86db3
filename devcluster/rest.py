"""Raw JSON requests through the official ``kubernetes`` client, for any API version and any object shape
(the typed client has no v1alpha3 claims and drops fields it does not know). Part of the test harness."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException


def client_from_kubeconfig(path: Path) -> k8s.ApiClient:
    return k8s_config.new_client_from_config(config_file=str(path))


class Rest:
    def __init__(self, api_client: k8s.ApiClient, timeout: float = 30.0) -> None:
        self.api_client = api_client
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """ApiException on an error status, with the API server's Status in ``.body``."""
        params = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or None,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api_client.call_api(*params, _request_timeout=self.timeout)
        data = response.read()
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))
        return json.loads(data) if data else {}

    def get(self, path: str, query: list[tuple[str, str]] | None = None) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", path, query=query)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    def close(self) -> None:
        self.api_client.close()


def status_message(exc: ApiException) -> str:
    """The API server's message in an error response."""
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except ValueError:
        return str(exc.body or exc.reason)
