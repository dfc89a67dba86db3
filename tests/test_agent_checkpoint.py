"""The agent's checkpoint: atomic replacement, and loud refusal of anything it cannot read for sure."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
from agent_support import NODE, Crash, make_node
from scrubgate.policies import names
from scrubgate.sanitizer_agent import checkpoint as ck
from scrubgate.sanitizer_agent.checkpoint import (
    CheckpointError,
    CheckpointStore,
    ClaimRef,
    DeviceRecord,
    FenceReason,
    State,
    Teardown,
)
from scrubgate.sanitizer_agent.gpu import simulated


def _store(tmp_path, node="n1") -> CheckpointStore:
    store = CheckpointStore(tmp_path / "ck.json", node)
    store.teardowns["uid-1"] = Teardown(
        claim=ClaimRef(namespace="ns", name="c", uid="uid-1"),
        devices=[DeviceRecord(driver="d", pool="p", device="g0", uuid="GPU-1", fence_rule="r1", failed_rule="r2")],
        state=State.SCRUBBING,
        fence="rule",
        allocated_at=1.0,
    )
    return store


def test_round_trip(tmp_path):
    _store(tmp_path).save()
    again = CheckpointStore(tmp_path / "ck.json", "n1")
    again.load()
    assert again.teardowns["uid-1"].state == State.SCRUBBING
    assert again.teardowns["uid-1"].devices[0].key == "d/p/g0"


def test_missing_file_is_an_empty_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "absent.json", "n1")
    store.load()
    assert store.teardowns == {}


def test_torn_temp_file_never_corrupts_the_real_one(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.save()
    before = (tmp_path / "ck.json").read_bytes()

    # A crash mid-write leaves a torn temp file next to the checkpoint.
    (tmp_path / ".ck.json.tmp").write_bytes(b'{"version": 1, "node": "n1", "teardo')
    again = CheckpointStore(tmp_path / "ck.json", "n1")
    again.load()
    assert again.teardowns["uid-1"].state == State.SCRUBBING

    # A crash between writing the temp file and the rename: the old checkpoint stands.
    store.teardowns["uid-1"].state = State.VERIFIED

    def die(*_):
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", die)
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        store.save()
    assert (tmp_path / "ck.json").read_bytes() == before
    monkeypatch.undo()
    store.save()
    assert json.loads((tmp_path / "ck.json").read_text())["teardowns"]["uid-1"]["state"] == "verified"
    assert not (tmp_path / ".ck.json.tmp").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"version": 5, "node": "n1", "teardowns": {}}', "version 5; this agent reads versions 1 to 4"),
        ('{"node": "n1"}', "version None"),
        ("{not json", "is not JSON"),
        ('{"version": 1, "node": "n1", "teardowns": {"u": {"state": "sideways"}}}', "damaged"),
        ('{"version": 1, "node": "other-node", "teardowns": {}}', "belongs to node 'other-node'"),
    ],
    ids=["future-version", "no-version", "not-json", "unknown-state", "other-node"],
)
def test_unreadable_checkpoint_is_refused_loudly(tmp_path, content, message):
    (tmp_path / "ck.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        CheckpointStore(tmp_path / "ck.json", "n1").load()


def test_agent_refuses_to_start_on_a_future_checkpoint_and_touches_nothing(tmp_path):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    data = json.loads(node.checkpoint.read_text())
    data["version"] = 99
    node.checkpoint.write_text(json.dumps(data))
    node.finish(pod)
    calls = len(node.cluster.calls)
    with pytest.raises(CheckpointError, match="version 99"):
        node.agent().start()
    assert node.cluster.calls[calls:] == [], "not a single API call"
    assert node.held(0) and node.canary_present(0), "the claim's allocation still keeps the dirty device"


def test_write_atomic_fsyncs_file_and_directory(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_mode), real(fd)))
    ck.write_atomic(tmp_path / "f.json", b"{}")
    import stat

    assert [stat.S_ISREG(m) for m in synced] == [True, False], "the file, then its directory"


def test_a_version_1_checkpoint_resumes_with_its_fences_lifted(tmp_path):
    """Version 1 wrote the attestation before it lifted the fences: its `unfenced` still had them up. Read as
    version 2's `unfenced` (fences lifted, attestation next) the fences would stand for ever."""
    node = make_node(tmp_path)

    def crash(_td, state):
        if state == State.ATTESTED:
            raise Crash("killed with the attestation signed, the fences up")

    agent = node.agent(on_transition=crash)
    agent.start()
    with contextlib.suppress(Crash):
        node.job_ends(agent)
    fence_as_version_1_did(node, as_older_version(node, 1, state="unfenced"))
    assert node.fenced(0) and node.clean(0)

    restarted = node.agent()
    restarted.start()
    node.settle(restarted)
    assert not node.fenced(0) and restarted.store.teardowns == {}
    claim = node.cluster.claims[("team-a", "job")]
    assert names.ANNOTATION_ATTESTATION in claim["metadata"]["annotations"]
    assert names.FINALIZER not in claim["metadata"]["finalizers"]
    assert json.loads(node.checkpoint.read_text())["version"] == 4


def as_older_version(node, version: int, **changes: str) -> dict:
    """Rewrites the node's checkpoint, of one teardown, as `version` wrote it (with `changes`); returns it."""
    data = json.loads(node.checkpoint.read_text())
    (teardown,) = data["teardowns"].values()
    data["version"] = version
    for field in ("fenced", "not_held", "seen_at", "hold", "allocated_stamp"):  # not in versions 1 and 2
        del teardown[field]
    teardown.update(changes)
    node.checkpoint.write_text(json.dumps(data))
    return teardown


def fence_as_version_1_did(node, teardown: dict) -> None:
    """The DeviceTaintRules versions 1 and 2 put up at first sight of an allocation."""
    for device in teardown["devices"]:
        selector = {"driver": device["driver"], "pool": device["pool"], "device": device["device"]}
        rule = {"metadata": {"name": device["fence_rule"], "labels": {}, "annotations": {}}, "spec": {
            "deviceSelector": selector, "taint": {"key": names.TAINT_UNSANITIZED, "effect": "NoSchedule"},
        }}  # fmt: skip
        node.cluster.create_device_taint_rule("v1", rule)


def test_a_version_2_teardown_keeps_its_fences_until_its_scrub(tmp_path):
    """Version 2 fenced every allocation from first sight; its fences stand, and go after the verified scrub,
    not at the restart (which would hand a dirty device over if the claim's allocation is already gone)."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    fence_as_version_1_did(node, as_older_version(node, 2))

    restarted = node.agent()
    restarted.start()
    (td,) = restarted.store.teardowns.values()
    assert td.fenced == FenceReason.HAND_OVER and node.fenced(0)
    restarted.observe_pod("MODIFIED", node.finish(pod))
    node.settle(restarted)
    assert node.clean(0) and not node.cluster.rules and restarted.store.teardowns == {}
    assert ("team-a", "job") not in node.cluster.claims
    assert node.violations.found == []


def _states_written(monkeypatch) -> list[dict[str, str]]:
    """Every checkpoint write from now on, as {claim name: state} of what it holds."""
    writes: list[dict[str, str]] = []
    real = ck.write_atomic

    def spy(path, content):
        teardowns = json.loads(content)["teardowns"].values()
        writes.append({td["claim"]["name"]: td["state"] for td in teardowns})
        real(path, content)

    monkeypatch.setattr(ck, "write_atomic", spy)
    return writes


def test_a_teardown_writes_the_states_a_restart_needs_and_passes_through_the_others(tmp_path, monkeypatch):
    """First sight, the signed attestation before it is published, and the teardown's end: three writes. The
    release, the drain, the scrub and `done` are passed through (a restart from the last written state redoes
    them), so they cost no fsync."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    writes = _states_written(monkeypatch)
    node.job_ends(agent, "job")
    assert writes == [{"job": "allocated"}, {"job": "attested"}, {}]
    assert node.clean(0) and names.FINALIZER not in node.cluster.claims[("team-a", "job")]["metadata"]["finalizers"]


def test_a_state_the_teardown_stays_in_is_written(tmp_path, monkeypatch):
    """A drain that has to wait is written (a restart knows the release was seen), once."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    writes = _states_written(monkeypatch)
    simulated.attach(node.root, node.gpus[0].uuid, pid=4_000_000)
    simulated.inject_fault(node.root, node.gpus[0].uuid, "linger")
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    agent.tick()
    node.clock.advance(1.0)
    agent.tick()
    assert writes == [{"job": "draining"}]
    on_disk = CheckpointStore(node.checkpoint, NODE)
    on_disk.load()
    assert on_disk.teardowns[claim["metadata"]["uid"]].state == State.DRAINING
