"""API Priority and Fairness on a real kube-apiserver (tests/k8s_support.py): the base's FlowSchema and
PriorityLevelConfiguration (manifests/flowcontrol.yaml) are accepted, and the API server classifies the agents'
and the webhook's requests, made with their ServiceAccounts' tokens, by them, and a tenant's by its bootstrap
`service-accounts` schema. Classification comes before authorization (k8s.io/apiserver pkg/server/config.go,
DefaultBuildHandlerChain), and the filter names what it chose in the `X-Kubernetes-PF-FlowSchema-UID` and
`X-Kubernetes-PF-PriorityLevel-UID` response headers (pkg/server/filters/priority-and-fairness.go): so whatever
the identity may do, the headers tell where its request went."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from k8s_support import api_server
from scrubgate.policies import names

from devcluster.install import render_base
from devcluster.processes import wait_for
from scrubgate.kubeapi import KubeApi

pytestmark = pytest.mark.timeout(120)

FLOWCONTROL = "/apis/flowcontrol.apiserver.k8s.io/v1"
COLLECTIONS = {
    "Namespace": "/api/v1/namespaces",
    "PriorityLevelConfiguration": f"{FLOWCONTROL}/prioritylevelconfigurations",
    "FlowSchema": f"{FLOWCONTROL}/flowschemas",
}


def token(api: KubeApi, namespace: str, account: str) -> str:
    """A bound token of the ServiceAccount (TokenRequest), as the kubelet mounts into its pods."""
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    return api.request("POST", path, body=body)["status"]["token"]


def classified(url: str, context: ssl.SSLContext, bearer: str, path: str) -> tuple[str, str]:
    """(FlowSchema UID, PriorityLevelConfiguration UID) the API server put the request in, whatever it answered."""
    request = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {bearer}"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            headers = response.headers
    except urllib.error.HTTPError as exc:  # a 403: authorization comes after classification
        headers = exc.headers
    return headers.get("X-Kubernetes-PF-FlowSchema-UID", ""), headers.get("X-Kubernetes-PF-PriorityLevel-UID", "")


def test_the_agents_and_the_webhooks_requests_go_to_scrubgates_priority_level(tmp_path: Path) -> None:
    base = render_base()
    with api_server(tmp_path) as plane:
        api = KubeApi.connect(str(plane.credentials["admin"].kubeconfig))
        for kind in ("Namespace", "PriorityLevelConfiguration", "FlowSchema"):
            for doc in (d for d in base if d["kind"] == kind):
                api.request("POST", COLLECTIONS[kind], body=doc)
        for doc in (d for d in base if d["kind"] == "ServiceAccount"):
            api.request("POST", f"/api/v1/namespaces/{doc['metadata']['namespace']}/serviceaccounts", body=doc)
        api.request("POST", "/api/v1/namespaces", body={"metadata": {"name": "team"}})
        api.request("POST", "/api/v1/namespaces/team/serviceaccounts", body={"metadata": {"name": "trainer"}})
        schemas: dict[str, Any] = {
            d["metadata"]["name"]: d for d in api.request("GET", f"{FLOWCONTROL}/flowschemas")["items"]
        }
        levels = {
            d["metadata"]["name"]: d for d in api.request("GET", f"{FLOWCONTROL}/prioritylevelconfigurations")["items"]
        }
        ours = (schemas["scrubgate"]["metadata"]["uid"], levels["scrubgate"]["metadata"]["uid"])
        tenants = (schemas["service-accounts"]["metadata"]["uid"], levels["workload-low"]["metadata"]["uid"])

        context = ssl.create_default_context(cafile=str(plane.pki.ca_cert))
        agent = token(api, names.SYSTEM_NAMESPACE, names.AGENT_SERVICE_ACCOUNT)
        webhook = token(api, names.SYSTEM_NAMESPACE, names.WEBHOOK_SERVICE_ACCOUNT)
        tenant = token(api, "team", "trainer")
        claims = "/apis/resource.k8s.io/v1/namespaces/team/resourceclaims"
        # The API server's flow-control configuration takes new objects from its watch, a moment after the create.
        wait_for(
            lambda: classified(plane.url, context, agent, claims) == ours,
            30,
            "the agent's requests classified by the scrubgate FlowSchema",
            interval=0.2,
        )
        assert classified(plane.url, context, agent, "/apis/resource.k8s.io/v1/resourceslices") == ours
        assert classified(plane.url, context, agent, "/apis") == ours, "discovery too: a non-resource URL"
        assert classified(plane.url, context, webhook, "/apis/resource.k8s.io/v1/deviceclasses?watch=false") == ours
        assert classified(plane.url, context, tenant, claims) == tenants, "tenants stay where they were"
