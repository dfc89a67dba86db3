"""``scrubgate certs generate|inject`` through the argparse plumbing the top-level CLI uses."""

from __future__ import annotations

import argparse
import base64
import io
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from scrubgate.certs import generate as gen
from scrubgate.certs.cli import add_arguments, run
from scrubgate.certs.inject import count_webhooks
from scrubgate.policies.attestation import load_private_key, public_key_pem

REPO = Path(__file__).resolve().parents[1]
WEBHOOK_CONFIGURATIONS = REPO / "manifests" / "webhook-configurations.yaml"


def certs(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="scrubgate certs")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _bundles(path: Path) -> set[bytes]:
    docs = list(yaml.safe_load_all(path.read_text()))
    return {base64.b64decode(w["clientConfig"]["caBundle"]) for d in docs for w in d.get("webhooks", [])}


def test_generate_writes_certs_secret_and_patched_copies(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    original = WEBHOOK_CONFIGURATIONS.read_text()
    assert certs("generate", "--out", str(out), "--manifests", str(WEBHOOK_CONFIGURATIONS)) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "audit-key-secret.yaml", "audit-key.pem", "audit.pub",
        "ca.crt", "ca.key", "tls-secret.yaml", "tls.crt", "tls.key", "webhook-configurations.yaml",
    ]  # fmt: skip
    assert WEBHOOK_CONFIGURATIONS.read_text() == original
    patched = out / "webhook-configurations.yaml"
    assert count_webhooks(yaml.safe_load_all(patched.read_text())) == 4
    assert _bundles(patched) == {(out / "ca.crt").read_bytes()}
    secret = yaml.safe_load((out / "tls-secret.yaml").read_text())
    assert base64.b64decode(secret["data"]["tls.crt"]) == (out / "tls.crt").read_bytes()
    assert "new CA" in capsys.readouterr().out


def test_generate_makes_the_webhooks_audit_key_once(tmp_path: Path):
    """The key that signs audit checkpoints (the Deployment mounts its Secret): made once, then reused, so
    checkpoints signed so far keep verifying with the public key given to `scrubgate audit verify`."""
    assert certs("generate", "--out", str(tmp_path)) == 0
    pem = (tmp_path / "audit-key.pem").read_bytes()
    key = load_private_key(pem)
    assert (tmp_path / "audit.pub").read_text() == public_key_pem(key)
    assert (tmp_path / "audit-key.pem").stat().st_mode & 0o077 == 0
    secret = yaml.safe_load((tmp_path / "audit-key-secret.yaml").read_text())
    assert (secret["metadata"]["name"], secret["metadata"]["namespace"]) == (
        "scrubgate-audit-signing-key",
        "scrubgate-system",
    )
    assert base64.b64decode(secret["data"]["ed25519.pem"]) == pem
    assert certs("generate", "--out", str(tmp_path), "--new-ca") == 0
    assert (tmp_path / "audit-key.pem").read_bytes() == pem


def test_generate_again_reuses_the_ca_and_renews_the_serving_cert(tmp_path: Path):
    assert certs("generate", "--out", str(tmp_path)) == 0
    ca, leaf = (tmp_path / "ca.crt").read_bytes(), (tmp_path / "tls.crt").read_bytes()
    assert certs("generate", "--out", str(tmp_path), "--days", "30") == 0
    assert (tmp_path / "ca.crt").read_bytes() == ca
    assert (tmp_path / "tls.crt").read_bytes() != leaf
    assert certs("generate", "--out", str(tmp_path), "--new-ca") == 0
    assert (tmp_path / "ca.crt").read_bytes() != ca


def test_generate_with_extra_sans_for_loopback_and_another_service(tmp_path: Path):
    argv = ["--service", "gate", "--namespace", "ops", "--extra-san", "localhost", "--extra-san", "127.0.0.1"]
    assert certs("generate", "--out", str(tmp_path), *argv) == 0
    from cryptography import x509

    leaf = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["gate.ops.svc", "gate.ops.svc.cluster.local", "localhost"]
    assert yaml.safe_load((tmp_path / "tls-secret.yaml").read_text())["metadata"]["namespace"] == "ops"


def test_generate_in_place_patches_the_given_file(tmp_path: Path):
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text(WEBHOOK_CONFIGURATIONS.read_text())
    out = tmp_path / "out"
    assert certs("generate", "--out", str(out), "--manifests", str(hooks), "--in-place") == 0
    assert _bundles(hooks) == {(out / "ca.crt").read_bytes()}
    assert not (out / "hooks.yaml").exists()


def test_generate_refuses_a_ca_certificate_without_its_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "ca.crt").write_bytes(gen.generate_ca().cert_pem)
    assert certs("generate", "--out", str(tmp_path)) == 1
    assert "ca.key does not" in capsys.readouterr().err
    assert not (tmp_path / "tls.crt").exists()


def test_generate_fails_when_the_manifests_hold_no_webhook(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    assert certs("generate", "--out", str(tmp_path / "out"), "--manifests", str(tmp_path)) == 1
    assert "no webhook" in capsys.readouterr().err


def test_inject_filters_a_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    ca = tmp_path / "ca.crt"
    ca.write_bytes(gen.generate_ca().cert_pem)
    monkeypatch.setattr(sys, "stdin", io.StringIO(WEBHOOK_CONFIGURATIONS.read_text()))
    assert certs("inject", "--ca", str(ca), "-") == 0
    captured = capsys.readouterr()
    docs = list(yaml.safe_load_all(captured.out))
    assert {base64.b64decode(w["clientConfig"]["caBundle"]) for d in docs for w in d["webhooks"]} == {ca.read_bytes()}
    assert "4 webhook(s)" in captured.err


def test_inject_into_files_needs_a_destination(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    ca = tmp_path / "ca.crt"
    ca.write_bytes(gen.generate_ca().cert_pem)
    assert certs("inject", "--ca", str(ca), str(WEBHOOK_CONFIGURATIONS)) == 1
    assert "--out DIR or --in-place" in capsys.readouterr().err
    assert certs("inject", "--ca", str(ca), str(WEBHOOK_CONFIGURATIONS), "--out", str(tmp_path / "o")) == 0
    assert _bundles(tmp_path / "o" / "webhook-configurations.yaml") == {ca.read_bytes()}


def test_inject_refuses_a_file_that_is_not_a_certificate(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    key = tmp_path / "ca.key"
    key.write_bytes(gen.generate_ca().key_pem)
    assert certs("inject", "--ca", str(key), str(WEBHOOK_CONFIGURATIONS), "--out", str(tmp_path)) == 1
    assert "not PEM-encoded X.509" in capsys.readouterr().err


def test_importing_the_cli_module_loads_no_heavy_dependency():
    # Measured against what the shared names module loads anyway: the certs CLI itself must add nothing heavy.
    code = (
        "import sys, scrubgate.policies.names; before = set(sys.modules); import scrubgate.certs.cli; "
        "print(sorted(m for m in set(sys.modules) - before if m.startswith(('cryptography', 'ruamel', 'yaml'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
