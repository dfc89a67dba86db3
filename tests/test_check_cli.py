"""`scrubgate check`: inputs (files, directories, stdin, multi-document YAML, List, JSON), lines, tenancy,
SG002 across documents, exit codes."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "check"


def findings(out: str) -> list[tuple]:
    report = json.loads(out)
    return [
        (f["rule"]["id"], f["action"], f["location"]["line"], f["location"]["document"], f["object"]["name"])
        for f in report["findings"]
    ]


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    """A copy of tests/data/check as the working directory, so reported file names are short and stable."""
    shutil.copytree(DATA, tmp_path / "check")
    monkeypatch.chdir(tmp_path / "check")
    return tmp_path / "check"


def test_findings_carry_exact_lines_and_document_indexes(run_cli, data):
    code, out, _ = run_cli("check", "--format", "json", "lines.yaml")
    assert code == 1
    assert sorted(findings(out)) == [
        ("SG001", "deny", 16, 1, "keep-gpu"),  # spec.metadata.annotations[deallocation-policy]
        ("SG002", "deny", 51, 3, "shared"),  # the resourceClaimName line
        ("SG003", "deny", 29, 2, "no-grace"),  # the field is missing: its parent `spec:`
        ("SG004", "warn", 55, 4, "inspector"),  # finalizers missing: `metadata:`
        ("SG005", "deny", 65, 4, "inspector"),  # the toleration item
        ("SG006", "deny", 63, 4, "inspector"),  # adminAccess
    ]
    report = json.loads(out)
    assert {f["location"]["file"] for f in report["findings"]} == {"lines.yaml"}
    assert report["summary"] == {"files": 1, "documents": 5, "deny": 5, "warn": 1, "audit": 0}


def test_directories_are_read_recursively_yaml_yml_json_only(run_cli, data):
    code, out, _ = run_cli("check", "--format", "json", "tree")
    assert code == 1
    report = json.loads(out)
    assert sorted(f["location"]["file"] for f in report["findings"]) == [
        "tree/a.yaml",
        "tree/nested/b.yml",
        "tree/nested/deeper/c.json",
    ]
    assert {f["rule"]["id"] for f in report["findings"]} == {"SG003"}
    assert report["summary"]["files"] == 3 and report["errors"] == []


def test_stdin_with_several_documents(run_cli, data, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((data / "lines.yaml").read_bytes())))
    code, out, _ = run_cli("check", "--format", "json", "-")
    assert code == 1
    report = json.loads(out)
    assert {f["location"]["file"] for f in report["findings"]} == {"<stdin>"}
    assert sorted(findings(out)) == sorted(findings(run_cli("check", "--format", "json", "lines.yaml")[1]))


def test_kind_list_items_are_checked_one_by_one(run_cli, data):
    code, out, _ = run_cli("check", "--format", "json", "list.yaml")
    assert code == 1
    report = json.loads(out)
    assert findings(out) == [("SG006", "deny", 21, 0, "listed")]
    assert report["findings"][0]["object"] == {
        "apiVersion": "resource.k8s.io/v1beta2",
        "kind": "ResourceClaimTemplate",
        "namespace": "team-b",
        "name": "listed",
    }
    assert report["summary"]["documents"] == 2


def test_json_files(run_cli, data):
    code, out, _ = run_cli("check", "--format", "json", "claims.json")
    assert code == 1
    assert findings(out) == [("SG001", "deny", 7, 0, "json-template")]


def test_json_that_yaml_cannot_read_is_read_as_json(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # A tab before a value is fine in JSON, and not in YAML's flow style after a line break.
    Path("tabbed.json").write_text(
        '{"apiVersion": "v1", "kind": "Pod",\n\t"metadata": {"name": "p"},\n\t"spec": {"resourceClaims":'
        '\n\t\t[{"name": "g", "resourceClaimName": "c"}], "terminationGracePeriodSeconds": 30}}\n'
    )
    code, out, _ = run_cli("check", "--format", "json", "tabbed.json")
    assert code == 1
    assert [f[0] for f in findings(out)] == ["SG002"]


def test_bad_yaml_in_one_document_keeps_the_others_and_other_files(run_cli, data):
    code, out, _ = run_cli("check", "--format", "json", "broken.yaml", "claims.json", "missing.yaml")
    assert code == 2
    report = json.loads(out)
    assert sorted(findings(out)) == [
        ("SG001", "deny", 7, 0, "json-template"),
        ("SG003", "deny", 7, 0, "before"),
        ("SG003", "deny", 23, 2, "after"),
    ]
    errors = sorted((e["file"], e["line"]) for e in report["errors"])
    assert errors[0][0] == "broken.yaml" and errors[0][1] in (14, 15)
    assert errors[1] == ("missing.yaml", None)
    messages = {e["file"]: e["message"] for e in report["errors"]}
    assert messages["broken.yaml"].startswith("invalid YAML: ")
    assert messages["missing.yaml"] == "no such file or directory"


def test_exit_codes(run_cli, repo_root, tmp_path):
    examples = repo_root / "manifests" / "examples"
    assert run_cli("check", str(examples / "good"))[0] == 0
    assert run_cli("check", str(examples / "bad" / "sg001-retain-deallocation.yaml"))[0] == 1
    # SG004 only warns in CI.
    assert run_cli("check", str(examples / "bad" / "sg004-claim-finalizer.yaml"))[0] == 0
    assert run_cli("check", str(tmp_path / "absent.yaml"))[0] == 2
    code, _, err = run_cli("check", "--in-place", str(examples / "good"))
    assert code == 2 and "--in-place needs --fix" in err
    code, _, err = run_cli("check", "--fix", "--in-place", "-")
    assert code == 2 and "stdin" in err
    with pytest.raises(SystemExit) as usage:
        run_cli("check", "--format", "xml", str(examples / "good"))
    assert usage.value.code == 2
    with pytest.raises(SystemExit) as usage:
        run_cli("check", "--namespace-tenancy", "team-a", str(examples / "good"))
    assert usage.value.code == 2


def test_bad_policy_is_a_usage_error(run_cli, repo_root, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("gracePeriod: {minimumSeconds: 100}\n")
    code, out, err = run_cli("check", "--policy", str(policy), str(repo_root / "manifests" / "examples" / "good"))
    assert code == 2 and out == ""
    assert f"{policy}: invalid policy: gracePeriod" in err


def test_policy_changes_the_verdict(run_cli, data):
    Path("policy.yaml").write_text(
        "rules:\n  SG006: {action: audit}\n  SG005: {action: 'off'}\ntenancy:\n  trustedNamespaces: [other]\n"
    )
    code, out, _ = run_cli("check", "--format", "json", "--policy", "policy.yaml", "list.yaml", "lines.yaml")
    assert code == 1
    assert sorted((f[0], f[1]) for f in findings(out)) == [
        ("SG001", "deny"),
        ("SG002", "deny"),
        ("SG003", "deny"),
        ("SG004", "warn"),
        ("SG006", "audit"),
        ("SG006", "audit"),
    ]
    assert json.loads(out)["summary"]["audit"] == 2
    Path("policy.yaml").write_text("tenancy:\n  trustedNamespaces: [team-b]\n")
    code, out, _ = run_cli("check", "--format", "json", "--policy", "policy.yaml", "list.yaml")
    assert (code, findings(out)) == (0, [])


def test_namespace_tenancy_option(run_cli, data):
    code, out, _ = run_cli("check", "--format", "json", "--namespace-tenancy", "team-a=trusted", "lines.yaml")
    assert code == 1
    # Retain and adminAccess are a trusted namespace's right; shared workload claims, missing grace periods
    # and fence tolerations are not.
    assert sorted(f[0] for f in findings(out)) == ["SG002", "SG003", "SG004", "SG005"]


def test_namespace_document_labelled_trusted_changes_the_verdict(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("claim.yaml").write_text(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {namespace: lab, name: keep}\n"
        "spec:\n  metadata:\n    annotations: {scrubgate.dev/deallocation-policy: Retain}\n"
        "  spec: {devices: {requests: [{name: g, exactly: {deviceClassName: gpu.nvidia.com, adminAccess: true}}]}}\n"
    )
    Path("ns.yaml").write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: lab\n  labels: {scrubgate.dev/tenancy: trusted}\n"
    )
    Path("ns-other.yaml").write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: lab\n  labels: {scrubgate.dev/tenancy: shared}\n"
    )
    code, out, _ = run_cli("check", "--format", "json", "claim.yaml")
    assert (code, sorted(f[0] for f in findings(out))) == (1, ["SG001", "SG006"])
    code, out, _ = run_cli("check", "--format", "json", "claim.yaml", "ns.yaml")
    assert (code, findings(out)) == (0, [])
    assert findings(run_cli("check", "--format", "json", "ns.yaml", "claim.yaml")[1]) == []
    assert [f[0] for f in findings(run_cli("check", "--format", "json", "ns-other.yaml", "claim.yaml")[1])] == [
        "SG001",
        "SG006",
    ]
    # The command line has the last word.
    overridden = run_cli(
        "check", "--format", "json", "--namespace-tenancy", "lab=multi-tenant", "ns.yaml", "claim.yaml"
    )
    assert [f[0] for f in findings(overridden[1])] == ["SG001", "SG006"]


def test_two_pods_in_a_trusted_namespace_naming_one_claim(run_cli, data):
    code, out, _ = run_cli("check", "--format", "json", "shared-trusted.yaml")
    assert code == 1
    assert sorted(findings(out)) == [("SG002", "deny", 17, 1, "writer"), ("SG002", "deny", 28, 2, "reader")]
    messages = {f["object"]["name"]: f["message"] for f in json.loads(out)["findings"]}
    assert "reader" in messages["writer"] and "writer" in messages["reader"]
    # Across files too, and in a multi-tenant namespace every pod naming a claim is reported by itself.
    code, out, _ = run_cli(
        "check", "--format", "json", "--namespace-tenancy", "lab=multi-tenant", "shared-trusted.yaml"
    )
    assert sorted(f[4] for f in findings(out)) == ["alone", "reader", "writer"]


def test_two_pods_naming_one_claim_across_files(run_cli, data):
    text = (data / "shared-trusted.yaml").read_text().split("---\n")
    Path("ns.yaml").write_text(text[0])
    Path("writer.yaml").write_text(text[1])
    Path("reader.yaml").write_text(text[2])
    code, out, _ = run_cli("check", "--format", "json", "ns.yaml", "writer.yaml", "reader.yaml")
    assert code == 1
    assert sorted((f[0], f[4]) for f in findings(out)) == [("SG002", "reader"), ("SG002", "writer")]


def test_console_script_as_a_process(repo_root):
    script = Path(sys.executable).with_name("scrubgate")
    done = subprocess.run(
        [str(script), "check", "--format", "json", str(DATA / "lines.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert done.returncode == 1, done.stderr
    assert len(json.loads(done.stdout)["findings"]) == 6
    piped = subprocess.run(
        [str(script), "check", "-"],
        input=(repo_root / "manifests" / "examples" / "bad" / "sg006-admin-access.yaml").read_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert piped.returncode == 1
    assert "<stdin>" in piped.stdout and "SG006" in piped.stdout and "Traceback" not in piped.stderr


# --- in pipelines and pre-commit -----------------------------------------------------------------------------

CLAIM = """apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: inspector
  namespace: team-a
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.nvidia.com
        adminAccess: true
"""


def test_a_pipe_that_brought_nothing_fails(repo_root):
    """`helm template ... | scrubgate check -` where helm failed: nothing on stdin is no pass."""
    script = Path(sys.executable).with_name("scrubgate")
    for text in ("", "# helm wrote nothing but this\n"):
        done = subprocess.run([str(script), "check", "-"], input=text, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stdout
        assert "no Kubernetes object on standard input" in done.stdout


def test_a_walk_leaves_tool_directories_and_what_exclude_names_alone(run_cli, tmp_path, monkeypatch):
    for where in (".venv/lib/site-packages/x", "node_modules/pkg", ".git/refs", "vendor/chart", "deploy"):
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "claim.yaml").write_text(CLAIM)
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli("check", "--format", "json", ".")
    assert code == 1
    assert sorted(f["location"]["file"] for f in json.loads(out)["findings"] if f["rule"]["id"] == "SG006") == [
        "deploy/claim.yaml",
        "vendor/chart/claim.yaml",
    ]
    code, out, _ = run_cli("check", "--format", "json", "--exclude", "vendor", ".")
    assert [f["location"]["file"] for f in json.loads(out)["findings"] if f["rule"]["id"] == "SG006"] == [
        "deploy/claim.yaml"
    ]
    code, out, _ = run_cli("check", "--format", "json", "--exclude", "./deploy", ".")
    assert [f["location"]["file"] for f in json.loads(out)["findings"] if f["rule"]["id"] == "SG006"] == [
        "vendor/chart/claim.yaml"
    ]


def test_helm_chart_templates_are_left_out_with_a_note(run_cli, tmp_path, monkeypatch):
    """pre-commit passes every changed YAML file, a chart's Go templates among them: they are no manifests."""
    chart = tmp_path / "charts" / "app"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: app\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("replicas: 1\n")
    (chart / "templates" / "pod.yaml").write_text("apiVersion: v1\nkind: Pod\nmetadata:\n  name: {{ .Release.Name }}\n")
    (tmp_path / "templates").mkdir()  # not a chart's: checked
    (tmp_path / "templates" / "claim.yaml").write_text(CLAIM)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("check", "charts/app/templates/pod.yaml", "charts/app/values.yaml")
    assert code == 0, out
    assert "left out Helm chart templates (charts/app/templates/pod.yaml)" in err
    code, out, err = run_cli("check", "--format", "json", ".")
    assert code == 1 and "left out Helm chart templates (charts/app/templates)" in err
    assert {f["location"]["file"] for f in json.loads(out)["findings"]} == {"templates/claim.yaml"}


def test_list_shaped_yaml_is_no_error_and_objects_in_a_list_are_checked(run_cli, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("- name: a\n  value: 1\n- name: b\n")
    assert run_cli("check", str(config))[0] == 0
    listed = tmp_path / "listed.yaml"
    listed.write_text("- " + CLAIM.replace("\n", "\n  ").rstrip() + "\n- just: config\n")
    code, out, _ = run_cli("check", "--format", "json", str(listed))
    assert code == 1
    assert sorted((f["rule"]["id"], f["location"]["line"]) for f in json.loads(out)["findings"]) == [
        ("SG004", 3),
        ("SG006", 12),
    ]


def test_sarif_locations_are_valid_uri_references(run_cli, tmp_path, monkeypatch):
    (tmp_path / "with space").mkdir()
    (tmp_path / "with space" / "claim.yaml").write_text(CLAIM)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(CLAIM.encode())))
    _, out, _ = run_cli("check", "--format", "sarif", "with space/claim.yaml", "-", str(tmp_path / "with space"))
    uris = {
        location["physicalLocation"]["artifactLocation"]["uri"]
        for result in json.loads(out)["runs"][0]["results"]
        for location in result["locations"]
    }
    assert uris == {"with%20space/claim.yaml", "%3Cstdin%3E", (tmp_path / "with space" / "claim.yaml").as_uri()}
    assert all(" " not in uri and "<" not in uri for uri in uris)


def test_a_reader_that_stops_early_gets_no_traceback(repo_root):
    script = Path(sys.executable).with_name("scrubgate")
    done = subprocess.run(
        f"{script} check --format sarif {DATA / 'lines.yaml'} | head -c 10",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
