"""`scrubgate check` reports a document with a kind but no apiVersion as an input error naming its file and
line (kubectl refuses it), instead of passing over it in silence."""

from __future__ import annotations

from pathlib import Path

from scrubgate.check import run_check

MANIFEST = """apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
# a GPU pod someone forgot the apiVersion of
kind: Pod
metadata: {name: p, namespace: team-a}
spec:
  containers: [{name: c, image: cuda}]
  resourceClaims: [{name: gpu, resourceClaimName: shared}]
---
apiVersion: v1
kind: List
items:
- kind: ConfigMap
  metadata: {name: cm}
"""


def test_a_kind_without_api_version_is_an_input_error_with_its_line(tmp_path: Path, policy):
    path = tmp_path / "app.yaml"
    path.write_text(MANIFEST)
    result = run_check([str(path)], policy)
    assert [(e.file, e.line, e.message) for e in result.errors] == [
        (str(path), 6, "document 1 has kind 'Pod' but no apiVersion: add its apiVersion"),
        (str(path), 15, "items[0] of document 2 has kind 'ConfigMap' but no apiVersion: add its apiVersion"),
    ]
    assert result.exit_code == 2
    assert [c.document.obj["kind"] for c in result.objects] == ["Namespace"]


def test_documents_without_a_kind_are_not_this_error(tmp_path: Path, policy):
    path = tmp_path / "values.yaml"
    path.write_text("replicas: 3\n")
    assert run_check([str(path)], policy).errors == []
