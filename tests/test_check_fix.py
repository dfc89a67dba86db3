"""`scrubgate check --fix` and `--fix --in-place`: the mechanical patches applied to the manifests, with the
comments and order of what they do not touch kept."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

DATA = Path(__file__).parent / "data" / "check"


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    shutil.copytree(DATA, tmp_path / "check")
    monkeypatch.chdir(tmp_path / "check")
    return tmp_path / "check"


def check_json(run_cli, *args):
    code, out, _ = run_cli("check", "--format", "json", *args)
    return code, json.loads(out)


def test_fix_prints_the_patched_documents_and_reports_the_rest(run_cli, work):
    code, out, err = run_cli("check", "--fix", "lines.yaml")
    # SG002, SG005 and SG006 have no mechanical fix and still deny.
    assert code == 1
    assert "fixed 3 finding(s)" in err
    assert "SG002" in err and "SG003" not in err and "SG001" not in err
    assert out.startswith("# Hand-written for test_check_cli: every finding's line is asserted exactly.\n---\n")
    docs = list(yaml.safe_load_all(out))
    assert [d["metadata"]["name"] for d in docs] == ["team-a", "keep-gpu", "no-grace", "shared", "inspector"]
    assert docs[1]["spec"]["metadata"]["annotations"]["scrubgate.dev/deallocation-policy"] == "Delete"
    assert docs[2]["spec"]["terminationGracePeriodSeconds"] == 60
    assert docs[4]["metadata"]["finalizers"] == ["scrubgate.dev/sanitize"]
    # Untouched documents come out as they went in.
    original = (work / "lines.yaml").read_text().split("---\n")
    fixed = out.split("---\n")
    assert fixed[1] == original[1] and fixed[4] == original[4]
    assert (work / "lines.yaml").read_text() == (DATA / "lines.yaml").read_text()


def test_fixed_output_checks_clean_of_what_was_fixed(run_cli, work, monkeypatch):
    _, out, _ = run_cli("check", "--fix", "lines.yaml", "list.yaml", "claims.json")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(out.encode())))
    code, report = check_json(run_cli, "-")
    assert code == 1
    assert report["summary"]["documents"] == 8
    assert sorted(f["rule"]["id"] for f in report["findings"]) == ["SG002", "SG005", "SG006", "SG006"]


def test_fix_keeps_comments_quotes_and_key_order(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = (
        "# leading comment\n"
        "---\n"
        "# the pod\n"
        "apiVersion: v1\n"
        "kind: Pod\n"
        "metadata:\n"
        "  name: 'quoted'   # trailing comment\n"
        "  namespace: team-a\n"
        "spec:\n"
        "  resourceClaims:\n"
        "  - name: gpu\n"
        '    resourceClaimTemplateName: "t"\n'
        "---\n"
        "# untouched config\n"
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata: {name: cfg}   # flow style\n"
        "data:\n"
        "  z: 1\n"
        "  a: 2\n"
    )
    Path("pod.yaml").write_text(text)
    code, out, _ = run_cli("check", "--fix", "pod.yaml")
    assert code == 0
    assert out == text.replace('"t"\n', '"t"\n  terminationGracePeriodSeconds: 60\n', 1)


def test_fix_in_place_rewrites_only_the_files_it_fixes(run_cli, work):
    before = {p: p.read_text() for p in work.rglob("*") if p.is_file()}
    code, out, err = run_cli("check", "--fix", "--in-place", "--format", "json", ".")
    assert code == 2  # broken.yaml cannot be read whole
    assert out == ""
    assert "fixed" in err
    report = json.loads(err[err.index("{") :])
    assert all(f["patch"] == [] for f in report["findings"])
    changed = {p for p, text in before.items() if p.read_text() != text}
    assert {p.relative_to(work).as_posix() for p in changed} == {
        "lines.yaml",
        "claims.json",
        "tree/a.yaml",
        "tree/nested/b.yml",
        "tree/nested/deeper/c.json",
    }
    _code, report = check_json(run_cli, ".")
    assert all(f["patch"] == [] for f in report["findings"])
    assert (work / "lines.yaml").read_text().startswith("# Hand-written")
    assert json.loads(json.dumps(yaml.safe_load((work / "claims.json").read_text())))["metadata"]["annotations"] == {
        "scrubgate.dev/deallocation-policy": "Delete"
    }


def test_fix_from_stdin(run_cli, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((DATA / "tree" / "a.yaml").read_bytes())))
    code, out, err = run_cli("check", "--fix", "-")
    assert code == 0 and "fixed 1 finding(s)" in err
    assert yaml.safe_load(out)["spec"]["terminationGracePeriodSeconds"] == 60


def test_fix_list_items(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("list.yaml").write_text(
        "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: ConfigMap\n  metadata: {name: c}\n"
        "- apiVersion: resource.k8s.io/v1\n  kind: ResourceClaim\n  metadata: {name: r, namespace: n}\n"
        "  spec: {devices: {requests: [{name: g, exactly: {deviceClassName: gpu.nvidia.com}}]}}\n"
    )
    code, out, _ = run_cli("check", "--fix", "list.yaml")
    assert code == 0
    assert yaml.safe_load(out)["items"][1]["metadata"]["finalizers"] == ["scrubgate.dev/sanitize"]


def test_fix_of_a_file_with_an_unreadable_document_leaves_it_and_keeps_its_findings(run_cli, work):
    broken = (work / "broken.yaml").read_text() + "---\n" + (work / "tree" / "a.yaml").read_text()
    (work / "broken.yaml").write_text(broken)
    code, _out, err = run_cli("check", "--fix", "--in-place", "broken.yaml", "tree/a.yaml")
    assert code == 2
    assert (work / "broken.yaml").read_text() == broken
    assert "broken.yaml: cannot apply the fixes, file left as it is" in err
    # The finding that was not fixed is still reported; the other file was fixed.
    assert "SG003 grace-period  Pod t/a: GPU pod spec has no terminationGracePeriodSeconds" in err
    assert "terminationGracePeriodSeconds: 60" in (work / "tree" / "a.yaml").read_text()


def test_fix_of_a_file_with_duplicate_keys_does_not_crash(run_cli, tmp_path, monkeypatch):
    # PyYAML reads duplicate keys (the last wins); ruamel.yaml refuses them.
    monkeypatch.chdir(tmp_path)
    Path("dup.yaml").write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nmetadata: {name: p}\n"
        "spec:\n  resourceClaims: [{name: g, resourceClaimTemplateName: t}]\n"
    )
    code, _out, err = run_cli("check", "--fix", "dup.yaml")
    assert code == 1
    assert "cannot apply the fixes" in err
    assert "SG003" in err


# --- the layout of what the fixes do not touch ----------------------------------------------------------------

FLOW = """apiVersion: v1
kind: Pod
metadata:
  name: p
  namespace: team-a
  labels: { app: trainer, tier: gpu }
spec:
  resourceClaims: [{name: gpu, resourceClaimTemplateName: t}]
  containers:
    - name: c
      image: nvcr.io/nvidia/pytorch:25.01-py3
      command: [ python, train.py ]
      args: [
        "--epochs", '3',
      ]
      resources: {claims: [{name: gpu}]}
      env: [{name: A, value: "1"}, {name: B, value: '2'}]
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: c, namespace: team-a}
spec:
  devices:
    requests: [{name: g, exactly: {deviceClassName: gpu.nvidia.com}}]
"""


def test_fix_in_place_keeps_flow_style_spacing_and_indentation_of_untouched_nodes(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("flow.yaml").write_text(FLOW)
    code, _, err = run_cli("check", "--fix", "--in-place", "flow.yaml")
    assert code == 0 and "fixed 2 finding(s)" in err
    # Every line as it was (`[{name: gpu}]` stays so, not `[name: gpu]`; the indented block sequence stays
    # indented), plus the two fixes: a line for SG003, the finalizer in the flow mapping for SG004.
    assert Path("flow.yaml").read_text() == FLOW.replace(
        "      env: [{name: A, value: \"1\"}, {name: B, value: '2'}]\n",
        "      env: [{name: A, value: \"1\"}, {name: B, value: '2'}]\n  terminationGracePeriodSeconds: 60\n",
    ).replace(
        "metadata: {name: c, namespace: team-a}\n",
        "metadata: {name: c, namespace: team-a, finalizers: [scrubgate.dev/sanitize]}\n",
    )


def test_fix_keeps_four_space_indentation(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = (
        "apiVersion: v1\nkind: Pod\nmetadata:\n    name: p\n    namespace: team-a\nspec:\n    resourceClaims:\n"
        "        -   name: gpu\n            resourceClaimTemplateName: t\n    containers:\n        -   name: c\n"
        "            image: i\n"
    )
    Path("pod.yaml").write_text(text)
    code, _, _ = run_cli("check", "--fix", "--in-place", "pod.yaml")
    assert code == 0
    assert Path("pod.yaml").read_text() == text + "    terminationGracePeriodSeconds: 60\n"


def test_fix_of_a_json_file_writes_json(run_cli, tmp_path, monkeypatch):
    """kubectl reads a file that opens with `{` as JSON only: the fix must not turn it into YAML flow style."""
    monkeypatch.chdir(tmp_path)
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "team-a", "labels": {"app": "x"}},
        "spec": {"devices": {"requests": [{"name": "g", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }
    Path("claim.json").write_text(json.dumps(claim, indent=4) + "\n")
    code, _, _ = run_cli("check", "--fix", "--in-place", "claim.json")
    assert code == 0
    fixed = json.loads(Path("claim.json").read_text())
    assert fixed == {**claim, "metadata": {**claim["metadata"], "finalizers": ["scrubgate.dev/sanitize"]}}
    assert Path("claim.json").read_text() == json.dumps(fixed, indent=4) + "\n"


def test_a_layout_the_merge_cannot_keep_still_fixes_the_data(run_cli, tmp_path, monkeypatch):
    """Where the file's own lines and the fix cannot be told apart, ruamel.yaml's layout of the touched part
    stands; the data is the fixed data whatever the layout."""
    monkeypatch.chdir(tmp_path)
    text = "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: team-a}\nspec: {resourceClaims: [\n  {name: g, resourceClaimTemplateName: t}]}\n"
    Path("pod.yaml").write_text(text)
    code, _, _ = run_cli("check", "--fix", "--in-place", "pod.yaml")
    assert code == 0
    fixed = yaml.safe_load(Path("pod.yaml").read_text())
    original = yaml.safe_load(text)
    original["spec"]["terminationGracePeriodSeconds"] = 60
    assert fixed == original
    assert (
        Path("pod.yaml").read_text().startswith("apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: team-a}\n")
    )
