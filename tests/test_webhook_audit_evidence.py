"""Audit evidence beyond the file: each record on the stdout stream, signed checkpoints of the chain
head, and `scrubgate audit verify --checkpoints` catching a truncated tail, a rewritten chain, gaps and
records lost to rotation."""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.policies.attestation import public_key_pem
from scrubgate.webhook.audit import GENESIS, AuditLog, record_hash, verify_files
from scrubgate.webhook.audit_checkpoints import STREAM_KEY, Checkpointer
from scrubgate.webhook.cli import add_audit_arguments, run_audit

KEY = Ed25519PrivateKey.generate()


def _fields(i: int) -> dict:
    return {"uid": f"req-{i}", "decision": "deny", "findings": [{"rule": {"id": "SG001"}}]}


def _session(path: Path, stream: io.StringIO, count: int, *, start: int = 0, host: str = "webhook-a", **kwargs) -> None:
    """One webhook process's life: open, `count` records, close (checkpoints at open and close)."""
    log = AuditLog(path, stream=stream, checkpointer=Checkpointer(KEY, interval=3600, host=host), **kwargs)
    log.open()
    try:
        for future in [log.submit(_fields(start + i)) for i in range(count)]:
            future.result(timeout=10)
    finally:
        log.close()


def _stream_entries(stream: io.StringIO, kind: str) -> list[dict]:
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    return [e[kind] for e in entries if e[STREAM_KEY] == kind]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _verify(tmp_path: Path, capsys, files: list[Path], stream: io.StringIO, *extra: str) -> tuple[int, str]:
    checkpoints = tmp_path / "webhook-stdout.log"
    # What `kubectl logs --timestamps` gives: a prefix, and the webhook's other lines around the stream.
    checkpoints.write_text(
        "".join(f"2026-12-03T08:00:00.000000000Z {line}\n" for line in stream.getvalue().splitlines())
        + '{"level": "info", "message": "serving"}\n'
    )
    public = tmp_path / "audit-key.pub"
    public.write_text(public_key_pem(KEY))
    parser = argparse.ArgumentParser()
    add_audit_arguments(parser)
    if "--stream" in extra:  # the capture is the FILE; its checkpoints are read with it
        argv = ["verify", *map(str, files), str(checkpoints), "--public-key", str(public), *extra]
    else:
        argv = ["verify", *map(str, files), "--checkpoints", str(checkpoints), "--public-key", str(public), *extra]
    code = run_audit(parser.parse_args(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_each_record_goes_to_the_stream_as_written_to_the_file(tmp_path):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 3)
    assert _stream_entries(stream, "record") == [json.loads(line) for line in _lines(path)]


def test_checkpoints_at_open_and_close_name_the_head(tmp_path):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 2)
    _session(path, stream, 0)  # a restart with nothing new: one checkpoint at open, none at close
    checkpoints = _stream_entries(stream, "checkpoint")
    last = json.loads(_lines(path)[-1])
    assert [(c["seq"], c["head"]) for c in checkpoints] == [(0, GENESIS), (2, last["hash"]), (2, last["hash"])]
    assert {c["host"] for c in checkpoints} == {"webhook-a"}


def test_a_checkpoint_is_signed_while_the_webhook_runs(tmp_path):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    log = AuditLog(path, stream=stream, checkpointer=Checkpointer(KEY, interval=0.05, host="webhook-a"))
    log.open()
    try:
        log.submit(_fields(1)).result(timeout=10)
        deadline = time.monotonic() + 10
        while not any(c["seq"] == 1 for c in _stream_entries(stream, "checkpoint")):
            assert time.monotonic() < deadline, "no checkpoint of seq 1 while the log stayed open"
            time.sleep(0.02)
    finally:
        log.close()


def test_intact_files_match_their_checkpoints(tmp_path, capsys):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 3)
    _session(path, stream, 2, start=3)
    code, out = _verify(tmp_path, capsys, [path], stream)
    assert code == 0, out
    assert "signed checkpoint(s) match the files; the latest: the checkpoint of" in out and "(seq 5) matches" in out
    assert out.splitlines()[-1].startswith("intact: 5 record(s)")


def test_a_truncated_tail_is_caught_though_the_chain_is_intact(tmp_path, capsys):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 5)
    path.write_text("\n".join(_lines(path)[:3]) + "\n")
    assert verify_files([path]).intact  # the hash chain alone cannot see it
    code, out = _verify(tmp_path, capsys, [path], stream)
    assert code == 1
    assert "BROKEN" in out and "truncated" in out and "files end at seq 3; records 4..5" in out


def _rewrite_from(path: Path, seq: int) -> None:
    """What someone with write access does: change a record and recompute the chain from there on."""
    records = [json.loads(line) for line in _lines(path)]
    for index, record in enumerate(records):
        if record["seq"] == seq:
            record["decision"] = "allow"
        if record["seq"] >= seq:
            record["prev"] = records[index - 1]["hash"] if index else GENESIS
            record["hash"] = record_hash(record)
    path.write_text("".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records))


def test_a_rewritten_chain_is_caught_though_the_chain_is_intact(tmp_path, capsys):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 4)
    _rewrite_from(path, 2)
    assert verify_files([path]).intact
    code, out = _verify(tmp_path, capsys, [path], stream)
    assert code == 1
    assert "BROKEN" in out and "rewritten: seq 4" in out


def test_records_lost_to_rotation_are_reported_not_failed(tmp_path, capsys):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 2, max_bytes=1024, backups=1)
    _session(path, stream, 30, start=2, max_bytes=1024, backups=1)
    files = sorted(tmp_path.glob("audit.jsonl*"))
    first = verify_files(files).first_seq
    assert first is not None and first > 2
    code, out = _verify(tmp_path, capsys, files, stream)
    assert code == 0, out
    assert "lost to rotation: the checkpoint of" in out and f"records up to seq {first - 1} existed" in out


def test_a_dropped_middle_file_is_a_gap_under_a_checkpoint(tmp_path, capsys):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 12, max_bytes=1024, backups=9)
    _session(path, stream, 12, start=12, max_bytes=1024, backups=9)
    files = sorted(tmp_path.glob("audit.jsonl*"))
    holder = next(f for f in files if any(json.loads(line)["seq"] == 12 for line in _lines(f)))
    assert holder not in (files[0], files[-1])  # a middle file: not the newest, not the oldest
    code, out = _verify(tmp_path, capsys, [f for f in files if f != holder], stream)
    assert code == 1
    assert "gap: the checkpoint of" in out and "vouches for seq 12" in out


def test_a_checkpoint_signed_by_another_key_is_refused(tmp_path, capsys):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 2)
    _session(tmp_path / "scratch.jsonl", io.StringIO(), 0)
    forged = io.StringIO()
    other = Checkpointer(Ed25519PrivateKey.generate(), interval=60, host="webhook-a")
    log = AuditLog(tmp_path / "other.jsonl", stream=forged, checkpointer=other)
    log.open()
    log.close()
    stream.write(forged.getvalue())
    code, out = _verify(tmp_path, capsys, [path], stream)
    assert code == 1
    assert "not among the --public-key keys" in out


def test_checkpoints_of_several_replicas_need_host(tmp_path, capsys):
    a, b, stream = tmp_path / "a.jsonl", tmp_path / "b.jsonl", io.StringIO()
    _session(a, stream, 2, host="webhook-a")
    _session(b, stream, 3, host="webhook-b")
    code, out = _verify(tmp_path, capsys, [a], stream)
    assert code == 2 and "webhook-a, webhook-b" in out and "--host" in out
    code, out = _verify(tmp_path, capsys, [a], stream, "--host", "webhook-a")
    assert code == 0, out


def test_the_stream_verifies_records_the_files_lost_to_rotation(tmp_path, capsys):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 30, max_bytes=1024, backups=1)
    assert verify_files(sorted(tmp_path.glob("audit.jsonl*"))).first_seq > 1  # the files lost the oldest
    other = io.StringIO()
    _session(tmp_path / "b.jsonl", other, 3, host="webhook-b")  # another replica in the same capture
    stream.write(other.getvalue())
    code, out = _verify(tmp_path, capsys, [], stream, "--stream", "--host", "webhook-a")
    assert code == 0, out
    assert "intact: 30 record(s)" in out and "seq 1..30" in out and "starts at seq" not in out
    assert "(seq 30) matches" in out


def test_an_altered_record_in_the_stream_is_named(tmp_path, capsys):
    path, stream = tmp_path / "audit.jsonl", io.StringIO()
    _session(path, stream, 3)
    text = stream.getvalue().replace('"uid":"req-1"', '"uid":"req-x"')
    code, out = _verify(tmp_path, capsys, [], io.StringIO(text), "--stream")
    assert code == 1 and "(seq 2): altered: the record does not match its hash" in out


def test_a_bad_signing_key_is_refused_naming_the_file(tmp_path):
    key = tmp_path / "audit.pem"
    key.write_text("not a key")
    with pytest.raises(ValueError, match=r"audit signing key .*audit\.pem: .*Ed25519 key in PEM"):
        Checkpointer.from_file(key, interval=60)
    with pytest.raises(ValueError, match="cannot read it"):
        Checkpointer.from_file(tmp_path / "missing.pem", interval=60)
