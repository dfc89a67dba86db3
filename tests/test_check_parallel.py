"""`scrubgate check` over many files reads them in several processes: the report is the one a single process
gives (findings, lines, document indexes, errors, their order), whatever the files hold."""

from __future__ import annotations

import collections
import json
import os
import shutil
from pathlib import Path

import pytest

from scrubgate import reading
from scrubgate.check import run_check
from scrubgate.report import build_report, render_json
from scrubgate.sources import SUFFIXES, manifests_under

DATA = Path(__file__).parent / "data" / "check"
POD = (
    "apiVersion: v1\nkind: Pod\nmetadata:\n  namespace: {ns}\n  name: p{i}\nspec:\n"
    "  terminationGracePeriodSeconds: 30\n  resourceClaims:\n  - name: gpu\n    resourceClaimName: shared\n"
)
CONFIG_WITH_DATE = "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c{i}}}\ndata:\n  when: 2025-01-02\n"
NAMESPACE = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: lab\n  labels: {scrubgate.dev/tenancy: trusted}\n"


def corpus(root: Path) -> Path:
    """Files of every kind `check` meets: findings, errors, Lists, JSON, values marshal cannot carry (a date),
    and a Namespace, read after the pods of its namespace, that makes them trusted."""
    root.mkdir()
    for i in range(40):
        (root / f"pod-{i:03d}.yaml").write_text(POD.format(ns="lab" if i % 2 else "team", i=i))
        (root / f"config-{i:03d}.yaml").write_text(CONFIG_WITH_DATE.format(i=i))
    for name in ("broken.yaml", "claims.json", "lines.yaml", "list.yaml", "shared-trusted.yaml"):
        for i in range(4):
            shutil.copy(DATA / name, root / f"{i}-{name}")
    (root / "junk.yaml").write_bytes(b"\xff\xfe not text")
    (root / "zz-namespace.yaml").write_text(NAMESPACE)
    return root


def report(root: Path, policy) -> dict:
    result = run_check([str(root)], policy)
    out = json.loads(render_json(build_report(result)))
    out["exit"] = result.exit_code
    return out


@pytest.fixture
def in_processes(tmp_path, monkeypatch) -> Path:
    """Two processes read as soon as there are 10 files, 7 files a task; returns the file where each read
    writes the id of the process it ran in."""
    monkeypatch.setattr(reading, "PARALLEL_FILES", 10)
    monkeypatch.setattr(reading, "FILES_PER_TASK", 7)
    monkeypatch.setattr(reading, "cpus", lambda: 2)
    pids = tmp_path / "pids"
    real = reading.read_files

    def read_files(*args):
        with pids.open("a") as out:
            out.write(f"{os.getpid()}\n")
        return real(*args)

    monkeypatch.setattr(reading, "read_files", read_files)
    return pids


def test_many_files_read_in_processes_give_the_report_of_one(tmp_path, policy, monkeypatch, in_processes):
    root = corpus(tmp_path / "corpus")
    monkeypatch.setattr(reading, "cpus", lambda: 1)
    alone = report(root, policy)
    assert alone["summary"]["files"] == 102 and alone["errors"] and alone["findings"]
    assert in_processes.read_text().split() == [str(os.getpid())]
    in_processes.unlink()
    monkeypatch.setattr(reading, "cpus", lambda: 2)
    assert report(root, policy) == alone
    pids = in_processes.read_text().split()
    # 102 files, 7 a task: this process reads every other task, one forked worker the rest.
    counts = collections.Counter(pids)
    assert len(pids) == 15 and counts.pop(str(os.getpid())) == 8 and list(counts.values()) == [7]


def test_a_namespace_read_after_its_documents_still_decides_their_findings_and_lines(tmp_path, policy):
    claim = (
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  namespace: lab\n  name: keep\n"
        "  annotations: {scrubgate.dev/deallocation-policy: Retain}\nspec:\n  devices:\n    requests:\n"
        "    - name: g\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        tolerations:\n"
        "        - {key: scrubgate.dev/unsanitized, operator: Exists}\n"
    )
    (tmp_path / "a-claim.yaml").write_text(claim)
    (tmp_path / "b-namespace.yaml").write_text(NAMESPACE)
    before = run_check([str(tmp_path / "b-namespace.yaml"), str(tmp_path / "a-claim.yaml")], policy)
    after = run_check([str(tmp_path / "a-claim.yaml"), str(tmp_path / "b-namespace.yaml")], policy)

    def found(result) -> list[tuple[str, int]]:
        return sorted((f.rule, o.document.line_of(f.path)) for o in result.objects for f in o.findings)

    # Trusted: Retain (SG001) is allowed; the missing finalizer and the fence toleration are not.
    assert found(before) == found(after) == [("SG004", 3), ("SG005", 14)]


@pytest.mark.parametrize("base", ["", "/", "."])
def test_directories_list_as_pathlib_lists_them(tmp_path, monkeypatch, base):
    for name in ["a.yaml", ".yaml", "..yaml", "b.yml", "c.json", "d.txt", "e.", "sub/f.yaml", ".hidden/g.yaml"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("a: 1\n")
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "dir.yaml" / "h.yml").write_text("a: 1\n")
    (tmp_path / "file-link.yaml").symlink_to(tmp_path / "a.yaml")
    (tmp_path / "broken-link.yaml").symlink_to(tmp_path / "missing")
    (tmp_path / "dir-link").symlink_to(tmp_path / "sub")
    monkeypatch.chdir(tmp_path)
    root = "." if base == "." else str(tmp_path) + base
    expected = sorted(str(p) for p in Path(root).rglob("*") if p.suffix in SUFFIXES and p.is_file())
    found = manifests_under(str(Path(root)))
    assert (found.files, found.templates) == (expected, [])
    assert "sub/f.yaml" in {p.removeprefix(str(tmp_path) + "/") for p in expected}
    assert not any("dir-link" in p or "broken-link" in p for p in expected)
