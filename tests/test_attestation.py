"""The attestation format of DESIGN.md: compact JWS, EdDSA over Ed25519, payload checks for a claim."""

from __future__ import annotations

import base64
import contextlib
import json
import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.policies import names
from scrubgate.policies.attestation import (
    AttestationError,
    build_payload,
    check_claim_attestation,
    claimed_devices,
    load_private_key,
    load_public_key,
    public_key_pem,
    rfc3339,
    sign,
    verify,
)

KID = "node-agent-1"
DEVICE = {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0", "uuid": "GPU-1234"}


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def keys(key):
    return {KID: load_public_key(public_key_pem(key))}


def payload(uid="uid-1", devices=(DEVICE,), verified=True, consumers=(), allocation=None) -> dict:
    start = datetime(2025, 6, 1, 14, 0, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
    return build_payload(
        namespace="team-a",
        name="c",
        uid=uid,
        node="node-a",
        devices=[
            {**d, "bytesScrubbed": 10, "bytesTotal": 10, "method": names.ATTESTATION_METHOD, "verified": verified}
            for d in devices
        ],
        started_at=start,
        finished_at=start + timedelta(seconds=42),
        health={"eccUncorrectable": 0, "remapPending": False, "xids": []},
        consumers=consumers,
        allocation=allocation,
    )


def claim(uid="uid-1", devices=(DEVICE,)) -> dict:
    return {
        "metadata": {"uid": uid, "annotations": {names.ANNOTATION_DEVICES: json.dumps(list(devices))}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", **{k: d[k] for k in ("driver", "pool", "device")}} for d in devices]
                }
            }
        },
    }


def test_token_is_a_compact_jws_with_the_design_header(key, keys):
    token = sign(payload(), key, KID)
    header, body, signature = token.split(".")
    assert json.loads(unb64(header)) == {"alg": "EdDSA", "kid": KID, "typ": "scrubgate-attestation+jws"}
    assert "=" not in token
    assert len(unb64(signature)) == 64
    assert verify(token, keys) == json.loads(unb64(body)) == payload()


def test_payload_has_the_design_shape():
    p = payload()
    # DESIGN's fields, and the pods the claim was released by (empty here).
    # DESIGN's fields, the pods the claim was released by, and the allocation it attests.
    assert set(p) == {"v", "claim", "node", "devices", "consumers", "allocation", "startedAt", "finishedAt", "health"}
    assert p["consumers"] == []
    assert p["allocation"] == {"reservation": None, "allocatedAt": None}
    assert p["v"] == 1 and p["claim"] == {"namespace": "team-a", "name": "c", "uid": "uid-1"}
    assert p["startedAt"] == "2025-06-01T12:00:00.123Z"
    assert p["finishedAt"] == "2025-06-01T12:00:42.123Z"
    assert set(p["devices"][0]) == {
        "driver",
        "pool",
        "device",
        "uuid",
        "bytesScrubbed",
        "bytesTotal",
        "method",
        "verified",
    }


def test_rfc3339_is_utc_with_z():
    assert rfc3339(datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2025-01-02T03:04:05.000Z"


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t + "x",
        lambda t: t.rsplit(".", 1)[0],
        lambda t: t.replace(".", "..", 1),
        lambda t: "é" + t,
        lambda t: "",
        lambda t: "a.b.c",
    ],
    ids=["sig-suffix", "two-parts", "four-parts", "non-ascii", "empty", "not-base64-json"],
)
def test_malformed_tokens_are_refused(key, keys, mangle):
    with pytest.raises(AttestationError):
        verify(mangle(sign(payload(), key, KID)), keys)


def test_non_string_token_is_refused(keys):
    with pytest.raises(AttestationError):
        verify(None, keys)  # type: ignore[arg-type]


def test_tampered_payload_is_refused(key, keys):
    header, _, signature = sign(payload(), key, KID).split(".")
    forged = b64(json.dumps(payload(uid="uid-2"), separators=(",", ":"), sort_keys=True).encode())
    with pytest.raises(AttestationError, match="signature does not verify"):
        verify(f"{header}.{forged}.{signature}", keys)


@pytest.mark.parametrize(
    "header",
    [
        {"alg": "none", "kid": KID, "typ": names.ATTESTATION_TYPE},
        {"alg": "HS256", "kid": KID, "typ": names.ATTESTATION_TYPE},
        {"alg": "EdDSA", "kid": KID, "typ": "JWT"},
        {"alg": "EdDSA", "kid": "other", "typ": names.ATTESTATION_TYPE},
        {"alg": "EdDSA", "kid": 1, "typ": names.ATTESTATION_TYPE},
    ],
)
def test_headers_other_than_ours_are_refused(key, keys, header):
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload()).encode())}"
    token = f"{signing_input}.{b64(key.sign(signing_input.encode()))}"
    with pytest.raises(AttestationError):
        verify(token, keys)


def test_signature_of_another_key_is_refused(keys):
    with pytest.raises(AttestationError, match="does not verify"):
        verify(sign(payload(), Ed25519PrivateKey.generate(), KID), keys)


@pytest.mark.parametrize("version", [2, "1", None])
def test_unknown_payload_version_is_refused(key, keys, version):
    body = {**payload(), "v": version}
    with pytest.raises(AttestationError, match="version"):
        verify(sign(body, key, KID), keys)


def test_claim_attestation_accepts_a_clean_cover(key, keys):
    assert check_claim_attestation(sign(payload(), key, KID), claim(), keys)["node"] == "node-a"


def test_claim_attestation_checks_uid_devices_and_verification(key, keys):
    with pytest.raises(AttestationError, match="claim UID 'uid-1', not this claim's 'uid-2'"):
        check_claim_attestation(sign(payload(), key, KID), claim(uid="uid-2"), keys)
    no_uid = claim()
    del no_uid["metadata"]["uid"]
    with pytest.raises(AttestationError, match="claim UID"):
        check_claim_attestation(sign(payload(), key, KID), no_uid, keys)
    other = {**DEVICE, "device": "gpu-1"}
    with pytest.raises(AttestationError, match=re.escape("gpu.nvidia.com/node-a/gpu-1")):
        check_claim_attestation(sign(payload(), key, KID), claim(devices=(DEVICE, other)), keys)
    with pytest.raises(AttestationError, match="not verified clean"):
        check_claim_attestation(sign(payload(verified=False), key, KID), claim(), keys)
    with pytest.raises(AttestationError, match="lists no devices"):
        check_claim_attestation(sign(payload(devices=()), key, KID), claim(devices=()), keys)
    with pytest.raises(AttestationError, match="not verified clean"):
        check_claim_attestation(sign(payload(verified="true"), key, KID), claim(), keys)


def test_required_devices_override_the_claims_own(key, keys):
    token = sign(payload(), key, KID)
    with pytest.raises(AttestationError, match="does not cover"):
        check_claim_attestation(token, claim(), keys, required={("gpu.nvidia.com", "node-b", "gpu-0")})
    assert check_claim_attestation(token, claim(), keys, required=set())["claim"]["uid"] == "uid-1"


def test_claimed_devices_from_allocation_and_annotation():
    both = claim()
    other = {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-7", "uuid": "GPU-7"}
    both["metadata"]["annotations"][names.ANNOTATION_DEVICES] = json.dumps([DEVICE, other])
    assert claimed_devices(both) == {("gpu.nvidia.com", "node-a", "gpu-0"), ("gpu.nvidia.com", "node-a", "gpu-7")}
    assert claimed_devices({}) == set()


@pytest.mark.parametrize("recorded", ["{not json", '{"a": 1}', "42"])
def test_malformed_devices_annotation_fails_closed(recorded):
    with pytest.raises(AttestationError, match=names.ANNOTATION_DEVICES):
        claimed_devices({"metadata": {"annotations": {names.ANNOTATION_DEVICES: recorded}}})


@pytest.mark.parametrize(
    "obj",
    [
        {"status": "weird"},
        {"status": {"allocation": ["x"]}},
        {"status": {"allocation": {"devices": "x"}}},
        {"metadata": "x"},
        {"metadata": {"annotations": ["x"]}},
    ],
)
def test_claimed_devices_of_malformed_objects_never_crash(obj):
    with contextlib.suppress(AttestationError):
        assert claimed_devices(obj) == set()


def test_non_string_devices_annotation_fails_closed():
    with pytest.raises(AttestationError, match=names.ANNOTATION_DEVICES):
        claimed_devices({"metadata": {"annotations": {names.ANNOTATION_DEVICES: [DEVICE]}}})


def test_private_key_round_trip_and_wrong_key_types(key):
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    assert public_key_pem(load_private_key(pem)) == public_key_pem(key)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ec_pem = ec_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(ValueError, match="not an Ed25519 private key"):
        load_private_key(ec_pem)
    ec_public = ec_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with pytest.raises(ValueError, match="not an Ed25519 key"):
        load_public_key(ec_public)


def test_an_attestation_covers_only_the_pods_the_claim_was_released_by(key, keys):
    """A claim used again (by a pod the scrub did not follow) is not covered by its earlier attestation."""
    used = claim()
    used["status"]["reservedFor"] = [{"resource": "pods", "name": "p1", "uid": "pod-1"}]
    token = sign(payload(consumers=[("p1", "pod-1")]), key, KID)
    assert check_claim_attestation(token, used, keys)["consumers"] == [{"name": "p1", "uid": "pod-1"}]
    used["status"]["reservedFor"].append({"resource": "pods", "name": "p2", "uid": "pod-2"})
    with pytest.raises(AttestationError, match=r"predates the claim's use by pod\(s\) p2 \(pod-2\)"):
        check_claim_attestation(token, used, keys)
    with pytest.raises(AttestationError, match="predates"):
        check_claim_attestation(sign(payload(), key, KID), used, keys)
