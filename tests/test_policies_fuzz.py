"""Wrong types anywhere never make the policy core raise: random JSON-like values put at random paths of valid
objects, through validate() (manifest and admission) and default()."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scrubgate.policies import names
from scrubgate.policies.attestation import build_payload, public_key_pem, sign
from scrubgate.policies.config import parse_policy
from scrubgate.policies.engine import Admission, Finding, default, validate
from scrubgate.policies.rules_meta import RULES

AGENT = f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}"
KEY = Ed25519PrivateKey.generate()
POLICY = parse_policy({"attestationKeys": [{"kid": "k", "publicKey": public_key_pem(KEY)}]})
MOMENT = datetime(2025, 1, 1, tzinfo=UTC)
DEVICE = {"driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0", "uuid": "GPU-0"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def seeds(dra) -> list[dict[str, Any]]:
    """Valid objects that reach every rule: claims in all versions and shapes, every pod carrier, a claim as the
    agent releases it (with a signed attestation)."""
    objects: list[dict[str, Any]] = []
    fence = [{"key": names.TAINT_UNSANITIZED, "operator": "Exists"}]
    retain = {names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN}
    for version in ("v1", "v1beta2", "v1beta1", "v1alpha3"):
        for shape in ("exactly", "firstAvailable"):
            request = dra.device_request(version, shape=shape, admin_access=True, tolerations=fence)
            objects.append(dra.claim(version, requests=[request], annotations=retain, finalizers=[names.FINALIZER]))
            objects.append(dra.claim(version, "ResourceClaimTemplate", requests=[request], template_annotations=retain))
    for kind in ("Pod", "PodTemplate", "ReplicationController", "Deployment", "StatefulSet", "ReplicaSet"):
        objects.append(dra.carrier(kind, dra.pod_spec(claim_name="shared", grace=None, tolerations=fence)))
    for kind in ("DaemonSet", "Job", "CronJob"):
        objects.append(dra.carrier(kind, dra.pod_spec(old_source=True, grace=5)))
    released = dra.claim("v1", finalizers=[names.FINALIZER])
    released["metadata"]["uid"] = "uid-1"
    released["metadata"]["annotations"] = {names.ANNOTATION_DEVICES: json.dumps([DEVICE])}
    released["status"] = {"allocation": {"devices": {"results": [{"request": "gpu", **DEVICE}]}}}
    objects.append(released)
    pod = dra.carrier("Pod", dra.pod_spec())
    pod["spec"]["nodeName"] = "node-a"
    pod["status"] = {"phase": "Running", "containerStatuses": [{"state": {"terminated": {}}}]}
    pod["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    objects.append(pod)
    return objects


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += paths(value, (*prefix, index))
    return found


def substitute(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    obj = copy.deepcopy(obj)
    node = obj
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return obj


def attestation() -> str:
    payload = build_payload(
        namespace="team-a",
        name="gpu-claim",
        uid="uid-1",
        node="node-a",
        devices=[{**DEVICE, "bytesScrubbed": 1, "bytesTotal": 1, "method": names.ATTESTATION_METHOD, "verified": True}],
        started_at=MOMENT,
        finished_at=MOMENT,
        health={},
    )
    return sign(payload, KEY, "k")


TOKEN = attestation()


def released_by_agent(obj: Any) -> Any:
    """The agent's update of `obj`: finalizer gone, attestation written (if `obj` still has that shape)."""
    new = copy.deepcopy(obj)
    meta = new.get("metadata") if isinstance(new, dict) else None
    if isinstance(meta, dict):
        if isinstance(meta.get("finalizers"), list):
            meta["finalizers"] = [f for f in meta["finalizers"] if f != names.FINALIZER]
        if isinstance(meta.get("annotations"), dict):
            meta["annotations"][names.ANNOTATION_ATTESTATION] = TOKEN
            meta["annotations"][names.ANNOTATION_BREAK_GLASS] = "node gone"
    return new


def well_formed(findings: Any) -> None:
    assert isinstance(findings, list)
    for finding in findings:
        assert isinstance(finding, Finding)
        assert finding.rule in RULES and finding.action in ("deny", "warn", "audit")
        assert isinstance(finding.message, str) and finding.message
        assert isinstance(finding.path, str)
        json.dumps(list(finding.patch))


@pytest.fixture(scope="module")
def seed_objects(dra):
    return seeds(dra)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), value=json_values, trusted=st.booleans())
def test_wrong_types_never_raise_in_ci_or_defaulting(seed_objects, data, value, trusted):
    seed = data.draw(st.sampled_from(seed_objects))
    path = data.draw(st.sampled_from(paths(seed)))
    obj = substitute(seed, path, value)
    well_formed(validate(obj, POLICY, trusted=trusted))
    well_formed(default(obj, POLICY))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    value=json_values,
    mutate_old=st.booleans(),
    user=st.sampled_from([(AGENT, ()), ("oncall", ("system:masters",)), ("alice", ("team-a",))]),
    options=st.one_of(st.none(), json_values, st.fixed_dictionaries({"gracePeriodSeconds": json_values})),
)
def test_wrong_types_never_raise_in_admission(seed_objects, data, value, mutate_old, user, options):
    # The last two seeds are what admission reads most of: the claim the agent releases (UPDATE, SG007) and
    # the terminating pod (DELETE, SG008). Every other seed goes through CREATE and UPDATE.
    seed = data.draw(st.sampled_from(seed_objects[-2:]) | st.sampled_from(seed_objects[:-2]))
    path = data.draw(st.sampled_from(paths(seed)))
    mutated = substitute(seed, path, value)
    old, new = (mutated, released_by_agent(seed)) if mutate_old else (seed, released_by_agent(mutated))
    if seed is seed_objects[-1]:
        admission = Admission("DELETE", user[0], user[1], old, options)
        well_formed(validate(None, POLICY, trusted=False, admission=admission))
        return
    for operation in ("CREATE", "UPDATE"):
        admission = Admission(operation, user[0], user[1], old, options)
        well_formed(validate(new, POLICY, trusted=False, admission=admission))
