"""NVIDIA's DRA checkpoint as the driver writes it: Go field names in v1/v2, JSON names in v3, checksums.

`data/nvidia/checkpoint-v1-v2.json` was written by Go (encoding/json, go-spew, hash/fnv) with the shapes
of k8s-dra-driver-gpu's checkpoint types; `make_checkpoint.go.txt` beside it is the program.
"""

from __future__ import annotations

import json
from pathlib import Path

from scrubgate.sanitizer_agent import nvidia

GOLDEN = Path(__file__).parent / "data" / "nvidia" / "checkpoint-v1-v2.json"
POOL = "node-1"
EXPECTED = {
    ("gpu.nvidia.com", POOL, "gpu-0"): "GPU-0",
    ("gpu.nvidia.com", POOL, "gpu-1-mig-1g10gb-19-2"): "MIG-3",
}


def test_go_written_checkpoint_is_read_with_its_checksums(tmp_path):
    raw = GOLDEN.read_bytes().strip()
    assert nvidia.checksum_holds(raw, "v1") and nvidia.checksum_holds(raw, "v2")
    path = tmp_path / "checkpoint.json"
    path.write_bytes(raw)
    (claim,) = nvidia.read_prepared_claims(path)
    assert claim.uid == "uid-1" and (claim.namespace, claim.name) == ("team-a", "train")
    assert claim.devices == EXPECTED
    assert claim.loose_uuids == set()


def test_go_checksum_matches_kubelets_for_a_known_input():
    # Computed by Go: fnv32a over spew's %#v of these bytes (json.Marshal escapes '<' as \u003c).
    data = b'{"checksum":0,"preparedClaims":{"u\\u003c1":[{"PoolName":"n1","DeviceName":"gpu-0"}]}}'
    assert nvidia.go_checksum(data) == 4108224440


def test_v1_alone_with_go_field_names(tmp_path):
    data = json.loads(GOLDEN.read_bytes())
    del data["v2"]
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps(data, separators=(",", ":")))
    assert nvidia.checksum_holds(path.read_bytes(), "v1"), "dropping v2 leaves v1's checksum intact"
    (claim,) = nvidia.read_prepared_claims(path)
    assert claim.devices == EXPECTED and claim.name == "", "v1 has no claim name"


def test_v3_with_json_names_is_preferred():
    v3 = {"checksum": 0, "preparedClaims": {"uid-9": {"name": "x", "namespace": "y", "preparedDevices": [
        {"devices": [{"gpu": {"info": {"uuid": "GPU-9"}, "device": {"poolName": POOL, "deviceName": "gpu-9"}}}]}]}}}  # fmt: skip
    body = json.dumps(v3, separators=(",", ":")).encode()
    v3["checksum"] = nvidia.go_checksum(body)
    data = {**json.loads(GOLDEN.read_bytes()), "v3": v3}
    raw = json.dumps(data, separators=(",", ":")).encode()
    (claim,) = nvidia.parse_prepared_claims(data, raw)
    assert claim.devices == {("gpu.nvidia.com", POOL, "gpu-9"): "GPU-9"}


def test_a_damaged_checkpoint_is_read_whole_and_fences_more(tmp_path, caplog):
    data = json.loads(GOLDEN.read_bytes())
    data["v2"]["preparedClaims"]["uid-2"] = {"preparedDevices": [{"devices": [{"gpu": {"info": {"uuid": "GPU-5"}}}]}]}
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps(data, separators=(",", ":")))
    found = {c.uid: c for c in nvidia.read_prepared_claims(path)}
    assert set(found) == {"uid-1", "uid-2"}, "v2's checksum fails: every version is read"
    assert found["uid-1"].devices == EXPECTED and found["uid-2"].loose_uuids == {"GPU-5"}
    assert "the checksum of v2 does not hold" in caplog.text


def test_unreadable_parts_are_skipped_not_fatal(tmp_path):
    data = {"v2": {"preparedClaims": {"uid-1": "not an object", "uid-2": {"preparedDevices": [
        {"devices": [{"vfio": {"info": {"uuid": "GPU-7"}}}]}]}}}}  # fmt: skip
    found = {c.uid: c for c in nvidia.parse_prepared_claims(data)}
    assert found["uid-1"].devices == {} and found["uid-2"].loose_uuids == {"GPU-7"}
    path = tmp_path / "checkpoint.json"
    path.write_text("{torn")
    assert nvidia.read_prepared_claims(path) == []
    assert nvidia.read_prepared_claims(tmp_path / "absent.json") == []
