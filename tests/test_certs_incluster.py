"""`scrubgate certs ensure` where its writes race with another writer, against a stand-in API server; the whole
run, with the chart's hook identity on kube-apiserver, is
tests/test_chart_lifecycle.py::test_the_certificates_hook_makes_them_in_the_cluster_with_its_own_rights."""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from typing import Any

import pytest
from scrubgate.certs.incluster import ensure, tls_secret

from scrubgate.cluster import ApiError

SECRETS = "/api/v1/namespaces/ns/secrets"
VALIDATING = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/scrubgate-validating"


class RacingApi:
    """Secrets and one webhook configuration; `before_create` and `before_put` run just before such a write
    lands, as another writer's change would."""

    def __init__(self) -> None:
        self.secrets: dict[str, dict[str, Any]] = {}
        self.configuration = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "scrubgate-validating", "resourceVersion": "1"},
            "webhooks": [{"name": "a", "clientConfig": {"service": {"name": "s"}}}],
        }
        self.before_create: list[Any] = []
        self.before_put: list[Any] = []
        self.puts = 0

    def request(self, method: str, path: str, query: Mapping[str, str] | None = None, body: Any = None) -> dict:
        if path.startswith(SECRETS):
            name = path.rpartition("/")[2]
            if method == "GET":
                if name not in self.secrets:
                    raise ApiError("not found", 404)
                return copy.deepcopy(self.secrets[name])
            for change in self.before_create:
                change()
            if body["metadata"]["name"] in self.secrets:
                raise ApiError("already exists", 409)
            self.secrets[body["metadata"]["name"]] = copy.deepcopy(body)
            return body
        assert path == VALIDATING
        if method == "GET":
            return copy.deepcopy(self.configuration)
        for change in self.before_put:
            change()
        self.before_put.clear()
        if body["metadata"]["resourceVersion"] != self.configuration["metadata"]["resourceVersion"]:
            raise ApiError("the object has been modified", 409)
        self.puts += 1
        self.configuration = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.puts + 1)}}
        return self.configuration


def run(api: RacingApi) -> list[str]:
    return ensure(
        api,
        "ns",
        service="scrubgate-webhook",
        days=30,
        configurations=["validatingwebhookconfigurations/scrubgate-validating"],
        audit_key_secret="audit",
    )


def test_a_secret_made_meanwhile_by_another_run_is_the_one_used() -> None:
    """Two hooks at once (an install retried): the second's create is refused, and it uses the first's CA."""
    api = RacingApi()
    theirs = tls_secret("ns", "scrubgate-webhook", 30)
    api.before_create.append(lambda: api.secrets.setdefault("scrubgate-webhook-tls", theirs))
    lines = run(api)
    assert "Secret ns/scrubgate-webhook-tls: kept" in lines
    (webhook,) = api.configuration["webhooks"]
    assert base64.b64decode(webhook["clientConfig"]["caBundle"]) == base64.b64decode(theirs["data"]["ca.crt"])


def test_a_configuration_changed_meanwhile_is_read_again() -> None:
    """An apply of the configuration between the read and the update: the update is refused (its
    resourceVersion), read again and made on what is there now."""
    api = RacingApi()

    def applied() -> None:
        api.configuration["metadata"]["resourceVersion"] = "7"
        api.configuration["webhooks"][0]["timeoutSeconds"] = 5

    api.before_put.append(applied)
    lines = run(api)
    assert "validatingwebhookconfigurations/scrubgate-validating: caBundle set in 1 webhook(s)" in lines
    (webhook,) = api.configuration["webhooks"]
    assert webhook["timeoutSeconds"] == 5 and webhook["clientConfig"]["caBundle"]
    assert run(api)[-1] == "validatingwebhookconfigurations/scrubgate-validating: caBundle already set"


def test_a_configuration_named_wrong_is_refused_before_anything_is_made() -> None:
    api = RacingApi()
    with pytest.raises(ValueError, match="expected validatingwebhookconfigurations/NAME"):
        ensure(api, "ns", service="s", days=30, configurations=["scrubgate-validating"], audit_key_secret=None)
    assert api.secrets == {}
