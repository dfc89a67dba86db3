"""`scrubgate check` on the inputs a CI job or a person at a terminal gives it: stdin from a terminal, symbolic
links to directories (loops included), inputs without any Kubernetes object, and progress on long reads."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from scrubgate import check
from scrubgate.check import Progress

CLAIM = """apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: NAME, namespace: team-a, finalizers: [scrubgate.dev/sanitize]}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {deviceClassName: gpu.nvidia.com, adminAccess: true}
"""


def claim(name: str) -> str:
    return CLAIM.replace("NAME", name)


def denied(out: str) -> list[tuple[str, str]]:
    return [(f["location"]["file"], f["object"]["name"]) for f in json.loads(out)["findings"]]


class Terminal(io.TextIOWrapper):
    def isatty(self) -> bool:
        return True


# --- stdin from a terminal ---------------------------------------------------------------------------------


def test_reading_stdin_from_a_terminal_says_so_on_stderr(run_cli, monkeypatch):
    monkeypatch.setattr(sys, "stdin", Terminal(io.BytesIO(claim("typed").encode())))
    code, out, err = run_cli("check", "--format", "json")
    assert code == 1 and denied(out) == [("<stdin>", "typed")]
    assert "reading manifests from standard input (end with Ctrl-D)" in err
    assert "scrubgate check ." in err


def test_stdin_from_a_pipe_gets_no_hint(run_cli, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(claim("piped").encode())))
    code, _, err = run_cli("check", "--format", "json", "-")
    assert code == 1 and "standard input" not in err


# --- symbolic links to directories ---------------------------------------------------------------------------


def test_a_symlinked_directory_is_followed(run_cli, tmp_path, monkeypatch):
    elsewhere = tmp_path / "shared" / "gpu"
    elsewhere.mkdir(parents=True)
    (elsewhere / "claim.yaml").write_text(claim("linked"))
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "own.yaml").write_text(claim("own"))
    (repo / "common").symlink_to(elsewhere)
    monkeypatch.chdir(repo)
    code, out, err = run_cli("check", "--format", "json", ".")
    assert code == 1
    assert denied(out) == [("common/claim.yaml", "linked"), ("own.yaml", "own")]
    assert "note" not in err


def test_a_link_back_up_the_tree_is_read_once(run_cli, tmp_path, monkeypatch):
    (tmp_path / "deploy" / "team").mkdir(parents=True)
    (tmp_path / "deploy" / "top.yaml").write_text(claim("top"))
    (tmp_path / "deploy" / "team" / "claim.yaml").write_text(claim("team"))
    (tmp_path / "deploy" / "team" / "up").symlink_to("..")  # a loop
    (tmp_path / "deploy" / "team" / "self").symlink_to(".")  # another
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("check", "--format", "json", "deploy")
    assert code == 1
    assert denied(out) == [("deploy/team/claim.yaml", "team"), ("deploy/top.yaml", "top")]
    assert "not read twice: deploy/team/self is deploy/team, read already" in err
    assert "not read twice: deploy/team/up is deploy, read already" in err


def test_a_directory_reached_by_its_name_and_a_link_is_read_under_its_name(run_cli, tmp_path, monkeypatch):
    """`current -> v2` beside `v2/`: the claims are read once (SG002 would otherwise see two pods where there
    is one), under v2, whatever the order of the names."""
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "claim.yaml").write_text(claim("once"))
    (tmp_path / "a-current").symlink_to("v2")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("check", "--format", "json", ".")
    assert code == 1 and denied(out) == [("v2/claim.yaml", "once")]
    assert "a-current is v2" in err


def test_two_links_to_one_directory_outside_are_read_once_under_the_first_name(run_cli, tmp_path, monkeypatch):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "claim.yaml").write_text(claim("shared"))
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "b").symlink_to(tmp_path / "outside")
    (tmp_path / "repo" / "a").symlink_to(tmp_path / "outside")
    monkeypatch.chdir(tmp_path / "repo")
    code, out, err = run_cli("check", "--format", "json", ".")
    assert code == 1 and denied(out) == [("a/claim.yaml", "shared")]
    assert "b is a, read already" in err


def test_a_broken_link_and_an_excluded_link_are_left_alone(run_cli, tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "claim.yaml").write_text(claim("real"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "node_modules").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("check", "--format", "json", ".")
    assert code == 1 and denied(out) == [("real/claim.yaml", "real")]
    assert json.loads(out)["errors"] == [] and "note" not in err


# --- no Kubernetes object found ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "files",
    [
        {},  # an empty directory
        {"notes.txt": "apiVersion: v1\nkind: Pod\n"},  # no manifest file name
        {"values.yaml": "replicas: 3\nimage: {tag: latest}\n"},  # YAML, but no Kubernetes object
    ],
    ids=["empty", "no-yaml", "values-only"],
)
def test_no_object_found_warns_and_with_the_flag_fails(run_cli, tmp_path, monkeypatch, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("check", "--format", "json", ".")
    assert code == 0 and json.loads(out)["errors"] == []
    assert "warning: no Kubernetes object in .: nothing was checked" in err
    assert "--fail-if-no-objects-found makes this an error" in err
    code, out, err = run_cli("check", "--format", "json", "--fail-if-no-objects-found", ".")
    assert code == 2
    [error] = json.loads(out)["errors"]
    assert error["file"] == "." and error["message"].startswith("no Kubernetes object found")
    assert "warning" not in err


def test_objects_found_give_no_warning_and_the_flag_changes_nothing(run_cli, tmp_path):
    (tmp_path / "claim.yaml").write_text(claim("c"))
    for flags in ([], ["--fail-if-no-objects-found"]):
        code, out, err = run_cli("check", "--format", "json", *flags, str(tmp_path))
        assert code == 1 and json.loads(out)["errors"] == [] and "warning" not in err


def test_no_object_and_unreadable_input_report_the_unreadable_input_only(run_cli, tmp_path):
    code, out, err = run_cli("check", "--format", "json", "--fail-if-no-objects-found", str(tmp_path / "missing"))
    assert code == 2
    assert [e["message"] for e in json.loads(out)["errors"]] == ["no such file or directory"]
    assert "warning" not in err


def test_the_flag_does_not_go_with_cluster(run_cli):
    code, _, err = run_cli("check", "--cluster", "--fail-if-no-objects-found")
    assert code == 2 and "goes with PATHs" in err


# --- progress ------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_short_run_shows_no_progress():
    stream, clock = io.StringIO(), Clock()
    progress = Progress(stream, terminal=True, clock=clock)
    progress.total = 2
    clock.now += check.PROGRESS_AFTER - 0.1
    progress.files_read(2)
    progress.done()
    assert stream.getvalue() == ""


def test_progress_stays_silent_for_a_short_run_then_rewrites_one_terminal_line():
    stream, clock = io.StringIO(), Clock()
    progress = Progress(stream, terminal=True, clock=clock)
    progress.total = 1000
    progress.files_read(64)
    clock.now += check.PROGRESS_AFTER - 0.1
    progress.reading("big.yaml", 5_000_000, 20_000_000)
    assert stream.getvalue() == ""
    clock.now += 0.2
    progress.reading("big.yaml", 10_000_000, 20_000_000)
    assert stream.getvalue() == (
        "\rscrubgate check: 64 of 1,000 file(s) read, 3 s; reading big.yaml (50% of 20.0 MB)\x1b[K"
    )
    progress.files_read(1)  # within PROGRESS_EVERY: nothing new
    assert stream.getvalue().count("\r") == 1
    clock.now += check.PROGRESS_EVERY[True]
    progress.files_read(935)
    assert stream.getvalue().endswith("\rscrubgate check: 1,000 of 1,000 file(s) read, 4 s\x1b[K")
    clock.now += 1.0
    progress.done()  # the last line stays, the report follows it
    assert stream.getvalue().endswith("\rscrubgate check: 1,000 of 1,000 file(s) read in 5 s\x1b[K\n")


def test_progress_into_a_log_writes_whole_lines_less_often():
    stream, clock = io.StringIO(), Clock()
    progress = Progress(stream, terminal=False, clock=clock)
    progress.total = 10
    clock.now += check.PROGRESS_AFTER
    progress.files_read(1)
    clock.now += check.PROGRESS_EVERY[True]  # a terminal's interval: too soon for a log
    progress.files_read(1)
    clock.now += check.PROGRESS_EVERY[False]
    progress.files_read(1)
    progress.done()
    assert stream.getvalue().splitlines() == [
        "scrubgate check: 1 of 10 file(s) read, 3 s",
        "scrubgate check: 3 of 10 file(s) read, 14 s",
        "scrubgate check: 3 of 10 file(s) read in 14 s",
    ]
    assert "\r" not in stream.getvalue()


def _many_files(tmp_path: Path, count: int) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(count):
        (corpus / f"c{i:03d}.yaml").write_text(claim(f"c{i}"))
    return corpus


def test_progress_shows_only_on_a_terminal_or_when_asked(run_cli, tmp_path, monkeypatch, capsys):
    corpus = _many_files(tmp_path, 3)
    monkeypatch.setattr(check, "PROGRESS_AFTER", 0.0)  # a run of three files is no long run
    monkeypatch.setattr(check, "PROGRESS_EVERY", {True: 0.0, False: 0.0})
    code, _, err = run_cli("check", "--format", "json", str(corpus))
    assert code == 1 and "file(s) read" not in err  # stderr is no terminal here
    code, out, err = run_cli("check", "--format", "json", "--progress", str(corpus))
    assert code == 1 and "scrubgate check: 3 of 3 file(s) read" in err
    assert len(json.loads(out)["findings"]) == 3  # the report is unchanged
    monkeypatch.setattr(type(sys.stderr), "isatty", lambda self: True)
    code, _, err = run_cli("check", "--format", "json", str(corpus))
    assert "\rscrubgate check: 3 of 3 file(s) read in 0 s\x1b[K\n" in err
    code, _, err = run_cli("check", "--format", "json", "--no-progress", str(corpus))
    assert "file(s) read" not in err


def test_progress_counts_files_read_by_other_processes(run_cli, tmp_path, monkeypatch):
    from scrubgate import reading

    monkeypatch.setattr(reading, "cpus", lambda: 2)  # the other process, on any machine
    corpus = _many_files(tmp_path, reading.PARALLEL_FILES)
    monkeypatch.setattr(check, "PROGRESS_AFTER", 0.0)
    monkeypatch.setattr(check, "PROGRESS_EVERY", {True: 0.0, False: 0.0})
    code, out, err = run_cli("check", "--format", "json", "--progress", str(corpus))
    assert code == 1 and len(json.loads(out)["findings"]) == reading.PARALLEL_FILES
    assert f"{reading.PARALLEL_FILES} of {reading.PARALLEL_FILES} file(s) read" in err.splitlines()[-1]
