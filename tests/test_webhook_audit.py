"""The audit log: hash chain, rotation that keeps the chain, resume, durability errors, verification."""

from __future__ import annotations

import argparse
import asyncio
import errno
import itertools
import json
import os
import threading
from pathlib import Path

import pytest
from scrubgate.webhook import audit as audit_mod
from scrubgate.webhook.audit import GENESIS, AuditLog, AuditLogError, record_hash, verify_files
from scrubgate.webhook.cli import add_audit_arguments, run_audit


def _fields(i: int) -> dict:
    return {"uid": f"req-{i}", "decision": "deny", "findings": [{"rule": {"id": "SG001"}}], "note": "é ✓"}


def _write(path: Path, count: int, **kwargs) -> AuditLog:
    log = AuditLog(path, **kwargs)
    log.open()
    try:
        for future in [log.submit(_fields(i)) for i in range(count)]:
            future.result(timeout=10)
    finally:
        log.close()
    return log


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _all_files(path: Path) -> list[Path]:
    return sorted(path.parent.glob(path.name + "*"))


def test_records_are_chained_from_genesis(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write(path, 3)
    records = _lines(path)
    assert [r["seq"] for r in records] == [1, 2, 3]
    assert records[0]["prev"] == GENESIS
    assert [r["prev"] for r in records[1:]] == [r["hash"] for r in records[:-1]]
    assert all(r["hash"] == record_hash(r) for r in records)
    assert records[0]["note"] == "é ✓"
    assert verify_files([path]).intact


def test_rotation_keeps_the_chain_across_files_and_drops_the_oldest(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write(path, 60, max_bytes=2048, backups=3)
    files = _all_files(path)
    assert [f.name for f in files] == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2", "audit.jsonl.3"]
    assert all(f.stat().st_size <= 2048 for f in files)
    oldest_first = [
        path.with_name("audit.jsonl.3"),
        path.with_name("audit.jsonl.2"),
        path.with_name("audit.jsonl.1"),
        path,
    ]
    chain = [record for f in oldest_first for record in _lines(f)]
    assert [r["seq"] for r in chain] == list(range(chain[0]["seq"], 61))
    # The first record of each newer file points at the last record of the file before it.
    for older, newer in itertools.pairwise(oldest_first):
        assert _lines(newer)[0]["prev"] == _lines(older)[-1]["hash"]
    result = verify_files(files)  # glob order (newest first): verify orders rotated files itself
    assert result.intact, result.problem
    assert result.last_seq == 60
    assert not result.starts_at_genesis  # the oldest records were rotated away


def test_restart_resumes_the_chain_from_disk(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write(path, 2)
    _write(path, 2)
    records = _lines(path)
    assert [r["seq"] for r in records] == [1, 2, 3, 4]
    assert records[2]["prev"] == records[1]["hash"]
    assert verify_files([path]).intact


def test_restart_right_after_rotation_resumes_from_the_rotated_file(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write(path, 3)
    os.replace(path, path.with_name("audit.jsonl.1"))
    path.touch()
    _write(path, 1)
    assert _lines(path)[0]["seq"] == 4
    assert verify_files(_all_files(path)).intact


def test_a_torn_last_line_is_cut_and_the_chain_goes_on(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write(path, 2)
    with path.open("ab") as handle:
        handle.write(b'{"seq": 3, "partial')
    _write(path, 1)
    records = _lines(path)
    assert [r["seq"] for r in records] == [1, 2, 3]
    assert verify_files([path]).intact


def test_a_tampered_last_record_stops_the_start(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write(path, 2)
    path.write_text(path.read_text().replace('"decision":"deny"', '"decision":"allow"'))
    log = AuditLog(path)
    with pytest.raises(AuditLogError, match="audit verify"):
        log.open()


def test_concurrent_writers_get_one_contiguous_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.open()
    results: list[dict] = []

    def writer(n: int) -> None:
        for i in range(25):
            results.append(log.submit(_fields(n * 100 + i)).result(timeout=10))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    assert sorted(r["seq"] for r in results) == list(range(1, 101))
    assert verify_files([path]).intact


def test_async_append_resolves_after_the_record_is_on_disk(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.open()

    async def main() -> dict:
        record = await log.append(_fields(1))
        assert _lines(path)[-1] == record
        return record

    try:
        assert asyncio.run(main())["seq"] == 1
    finally:
        log.close()


def test_a_failed_write_fails_its_records_and_the_chain_stays_intact(tmp_path, monkeypatch):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.open()
    try:
        log.submit(_fields(1)).result(timeout=10)
        real_write = os.write
        calls = {"n": 0}

        def full_disk(fd: int, data) -> int:
            if fd == log._fd and calls["n"] == 0:
                calls["n"] += 1
                real_write(fd, bytes(data[:10]))  # a partial line, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(audit_mod.os, "write", full_disk)
        with pytest.raises(OSError, match="No space"):
            log.submit(_fields(2)).result(timeout=10)
        assert log.submit(_fields(3)).result(timeout=10)["seq"] == 2
    finally:
        log.close()
    assert [r["uid"] for r in _lines(path)] == ["req-1", "req-3"]
    assert verify_files([path]).intact


def test_an_unserialisable_record_fails_alone(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.open()
    try:
        bad = log.submit({"uid": object()})
        good = log.submit(_fields(2))
        with pytest.raises(TypeError):
            bad.result(timeout=10)
        assert good.result(timeout=10)["seq"] == 1
    finally:
        log.close()


# -- verification ----------------------------------------------------------------------------------


@pytest.fixture
def rotated(tmp_path) -> list[Path]:
    path = tmp_path / "audit.jsonl"
    _write(path, 30, max_bytes=2048, backups=9)
    return _all_files(path)


def _file_with_seq(files: list[Path], seq: int) -> tuple[Path, int]:
    for f in files:
        for number, record in enumerate(_lines(f), start=1):
            if record["seq"] == seq:
                return f, number
    raise AssertionError(seq)


def _edit(path: Path, edit) -> None:
    lines = path.read_text().splitlines()
    path.write_text("\n".join(edit(lines)) + "\n")


def test_verify_names_an_altered_record(rotated):
    f, line = _file_with_seq(rotated, 12)

    def alter(lines):
        lines[line - 1] = lines[line - 1].replace('"decision":"deny"', '"decision":"allow"')
        return lines

    _edit(f, alter)
    result = verify_files(rotated)
    assert result.problem is not None
    assert (result.problem.file, result.problem.line, result.problem.seq) == (str(f), line, 12)
    assert result.problem.what.startswith("altered")
    assert result.records == 11


def test_verify_names_a_record_rehashed_after_alteration(rotated):
    """Recomputing the altered record's own hash does not help: the next record's prev gives it away."""
    f, line = _file_with_seq(rotated, 12)

    def alter(lines):
        record = json.loads(lines[line - 1])
        record["decision"] = "allow"
        record["hash"] = record_hash(record)
        lines[line - 1] = json.dumps(record, sort_keys=True, separators=(",", ":"))
        return lines

    _edit(f, alter)
    problem = verify_files(rotated).problem
    assert problem is not None and problem.seq == 13
    assert "prev does not match" in problem.what


def test_verify_names_a_dropped_record(rotated):
    f, line = _file_with_seq(rotated, 7)
    _edit(f, lambda lines: lines[: line - 1] + lines[line:])
    problem = verify_files(rotated).problem
    assert problem is not None and problem.seq == 8
    assert problem.what == "dropped: seq 7 missing before this record"


def test_verify_names_reordered_records(rotated):
    f, line = _file_with_seq(rotated, 20)
    if line == len(_lines(f)):
        f, line = _file_with_seq(rotated, 19)

    def swap(lines):
        lines[line - 1], lines[line] = lines[line], lines[line - 1]
        return lines

    _edit(f, swap)
    problem = verify_files(rotated).problem
    assert problem is not None and problem.what.startswith("reordered")
    assert problem.file == str(f) and problem.line == line


def test_verify_names_a_duplicated_record(rotated):
    f, line = _file_with_seq(rotated, 5)
    _edit(f, lambda lines: [*lines[:line], lines[line - 1], *lines[line:]])
    problem = verify_files(rotated).problem
    assert problem is not None and problem.line == line + 1
    assert problem.what == "reordered or duplicated: seq 5 follows seq 5"


def test_verify_names_a_line_that_is_not_json(rotated):
    f, line = _file_with_seq(rotated, 3)

    def garble(lines):
        lines[line - 1] = lines[line - 1][:-5]
        return lines

    _edit(f, garble)
    problem = verify_files(rotated).problem
    assert problem is not None and (problem.file, problem.line) == (str(f), line)
    assert "not valid JSON" in problem.what


def test_verify_notices_a_missing_middle_file(rotated):
    problem = verify_files([p for p in rotated if not p.name.endswith(".2")]).problem
    assert problem is not None and problem.what.startswith("dropped")


def _run_cli(*files: Path) -> int:
    parser = argparse.ArgumentParser()
    add_audit_arguments(parser)
    return run_audit(parser.parse_args(["verify", *map(str, files)]))


def test_cli_exit_codes(rotated, tmp_path, capsys):
    assert _run_cli(*rotated) == 0
    out = capsys.readouterr().out
    assert out.startswith("intact: 30 record(s)")
    assert "starts at seq" not in out  # 9 backups kept everything, down to the genesis record
    f, line = _file_with_seq(rotated, 9)
    _edit(f, lambda lines: lines[: line - 1] + lines[line:])
    assert _run_cli(*rotated) == 1
    assert f"BROKEN at {f}:{line} (seq 10): dropped" in capsys.readouterr().out
    assert _run_cli(tmp_path / "missing.jsonl") == 2
    assert "cannot read" in capsys.readouterr().err
