"""caBundle injection into webhook configurations: every webhook gets it, nothing else changes."""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import pytest
import yaml
from scrubgate.certs import generate as gen
from scrubgate.certs.inject import count_webhooks, inject_ca_bundle, inject_files, inject_yaml_text


@pytest.fixture(scope="module")
def ca_pem() -> bytes:
    return gen.generate_ca().cert_pem


def _webhook(name: str) -> dict:
    return {"name": name, "clientConfig": {"service": {"name": "s", "namespace": "n", "path": "/validate"}}}


VALIDATING = {
    "apiVersion": "admissionregistration.k8s.io/v1",
    "kind": "ValidatingWebhookConfiguration",
    "metadata": {"name": "v"},
    "webhooks": [_webhook("a.example.dev"), _webhook("b.example.dev")],
}
MUTATING = {
    "apiVersion": "admissionregistration.k8s.io/v1",
    "kind": "MutatingWebhookConfiguration",
    "metadata": {"name": "m"},
    "webhooks": [_webhook("m.example.dev")],
}
OTHERS = [
    {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": 443}]}},
    # Same kind name in another group: not a webhook configuration.
    {"apiVersion": "example.dev/v1", "kind": "ValidatingWebhookConfiguration", "webhooks": [{"name": "x"}]},
]


def test_every_webhook_gets_the_bundle_and_other_documents_stay(ca_pem: bytes):
    docs = [VALIDATING, *OTHERS, MUTATING]
    original = copy.deepcopy(docs)
    patched = inject_ca_bundle(docs, ca_pem)
    assert docs == original  # inputs untouched
    bundles = [w["clientConfig"]["caBundle"] for d in (patched[0], patched[3]) for w in d["webhooks"]]
    assert len(bundles) == 3 and {base64.b64decode(b) for b in bundles} == {ca_pem}
    assert patched[1:3] == OTHERS
    assert count_webhooks(patched) == 3


def test_an_existing_bundle_is_replaced(ca_pem: bytes):
    old = gen.generate_ca().cert_pem
    once = inject_ca_bundle([VALIDATING], old)
    twice = inject_ca_bundle(once, ca_pem)
    assert {base64.b64decode(w["clientConfig"]["caBundle"]) for w in twice[0]["webhooks"]} == {ca_pem}


@pytest.mark.parametrize(
    "webhooks, message",
    [
        ({"name": "a"}, "must be a list"),
        (["a"], "must be an object"),
        ([{"name": "a.example.dev"}], "no clientConfig"),
    ],
)
def test_malformed_webhook_configurations_are_errors(ca_pem: bytes, webhooks: object, message: str):
    doc = {**VALIDATING, "webhooks": webhooks}
    with pytest.raises(ValueError, match=message):
        inject_ca_bundle([doc], ca_pem)


def test_a_bundle_that_is_not_pem_certificates_is_refused():
    with pytest.raises(ValueError, match="not PEM-encoded"):
        inject_ca_bundle([VALIDATING], b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")


YAML_TEXT = """\
# The Service.
apiVersion: v1
kind: Service
metadata:
  name: s  # keep me
spec:
  ports:
  - port: 443
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: v
webhooks:
- name: a.example.dev
  # where the API server calls
  clientConfig:
    service: {name: s, namespace: n, path: /validate}
  matchConditions:
  - name: c
    expression: |-
      request.resource.resource != 'pods' ||
      has(object.spec.resourceClaims)
"""


def test_yaml_round_trip_keeps_comments_and_other_documents(ca_pem: bytes):
    text, count = inject_yaml_text(YAML_TEXT, ca_pem)
    assert count == 1
    for line in ("# The Service.", "  name: s  # keep me", "  # where the API server calls"):
        assert line in text.splitlines()
    before, after = list(yaml.safe_load_all(YAML_TEXT)), list(yaml.safe_load_all(text))
    assert after[0] == before[0]
    assert after[1]["webhooks"][0]["matchConditions"] == before[1]["webhooks"][0]["matchConditions"]
    assert base64.b64decode(after[1]["webhooks"][0]["clientConfig"]["caBundle"]) == ca_pem


def test_inject_files_copies_only_files_with_webhooks(tmp_path: Path, ca_pem: bytes):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "hooks.yaml").write_text(YAML_TEXT)
    (src / "deploy.yml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    (src / "notes.txt").write_text("kind: ValidatingWebhookConfiguration\n")
    injected = inject_files(src, ca_pem, out)
    assert [(i.written, i.webhooks) for i in injected] == [(out / "hooks.yaml", 1)]
    assert (src / "hooks.yaml").read_text() == YAML_TEXT
    assert sorted(p.name for p in out.iterdir()) == ["hooks.yaml"]


def test_inject_files_in_place_keeps_the_file_mode(tmp_path: Path, ca_pem: bytes):
    path = tmp_path / "hooks.yaml"
    path.write_text(YAML_TEXT)
    path.chmod(0o640)
    inject_files(path, ca_pem)
    assert path.stat().st_mode & 0o777 == 0o640
    assert count_webhooks(yaml.safe_load_all(path.read_text())) == 1
    assert "caBundle" in path.read_text()


def test_no_webhook_configuration_at_all_is_an_error(tmp_path: Path, ca_pem: bytes):
    (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    with pytest.raises(ValueError, match="no webhook"):
        inject_files(tmp_path, ca_pem, tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        inject_files(tmp_path / "missing", ca_pem)
