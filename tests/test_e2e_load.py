"""The whole lifecycle under load: 200 claims (MIG slices and whole GPUs) on 8 simulated GPUs x 7 MIG slices,
through the real webhook and the real agent on the real control plane (devcluster.load's workload, shared with
bench/lifecycle.py, which reports the figures). Every claim must end recorded, scrubbed, attested and released,
kept from other claims by its own allocation until then, with no DeviceTaintRule made for any of them; the
observer must see no dirty allocation and no unattested finalizer removal; no tenant may
find an earlier tenant's canary; and a tenant stripping finalizers meanwhile is denied every time, with
every denial in an audit log whose chain verifies. The wait is bounded; no time is asserted."""

from __future__ import annotations

import json
import threading
from collections import Counter

import e2e_support
import pytest
from e2e_support import assert_invariant, patch_claim
from kubernetes.client.exceptions import ApiException
from scrubgate.policies import names

from devcluster.harness import CLAIM_CONTROLLER_USER, Cluster
from devcluster.load import LoadRun, LoadSpec

# The `cluster_factory` fixture.
cluster_factory_fixture = e2e_support.cluster_factory_fixture

SPEC = LoadSpec(claims=200, parallelism=24, run_seconds=4.0, timeout_s=240.0)


def strip_finalizers(cluster: Cluster, run: LoadRun, stop: threading.Event) -> Counter[str]:
    """While the load runs: each tenant in turn tries to remove the finalizer from one of its claims.
    Returns how each attempt ended (``denied``, ``gone``, ``raced`` or ``owed no scrub`` are fine; ``accepted``
    is not)."""
    outcomes: Counter[str] = Counter()
    turn = 0
    while not stop.wait(0.5):
        namespace, user = run.namespaces[turn % len(run.namespaces)]
        turn += 1
        claims = [c for c in cluster.claims(namespace) if names.FINALIZER in c["metadata"].get("finalizers", [])]
        if not claims:
            continue
        finalizers = claims[0]["metadata"]["finalizers"]
        ops = [
            {"op": "test", "path": "/metadata/finalizers", "value": finalizers},  # not one the agent just changed
            {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in finalizers if f != names.FINALIZER]},
        ]
        try:
            patch_claim(cluster, user, namespace, claims[0]["metadata"]["name"], ops)
            # Allowed by design only for a claim being deleted that never held a device (nothing to scrub).
            outcomes["owed no scrub" if owes_no_scrub(claims[0]) else "accepted"] += 1
        except ApiException as exc:
            message = json.loads(exc.body or "{}").get("message", "")
            if exc.status == 404:
                outcomes["gone"] += 1
            elif exc.status == 422 and "SG007" not in message:
                # The `test` op failed (kube-apiserver: "the server rejected our request due to an error in
                # our request"): the agent changed the finalizers first.
                outcomes["raced"] += 1
            elif "SG007" in message:
                outcomes["denied"] += 1
            else:
                outcomes[f"HTTP {exc.status}: {message}"] += 1
    return outcomes


CLAIM_CONTROLLER = CLAIM_CONTROLLER_USER


def owes_no_scrub(claim: dict) -> bool:
    meta = claim["metadata"]
    return bool(
        meta.get("deletionTimestamp")
        and not (claim.get("status") or {}).get("allocation")
        and names.ANNOTATION_DEVICES not in (meta.get("annotations") or {})
    )


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_200_claims_through_their_whole_lifecycle(cluster_factory) -> None:
    cluster = cluster_factory(gpus=8, mig_per_gpu=7)
    cluster.call_webhook_directly()  # as bench/lifecycle.py measures it: no Python forwarder in each call
    run = LoadRun(cluster, SPEC)
    stop = threading.Event()
    attacks: Counter[str] = Counter()
    attacker = threading.Thread(target=lambda: attacks.update(strip_finalizers(cluster, run, stop)), daemon=True)
    attacker.start()
    try:
        result = run.run()
    finally:
        stop.set()
        attacker.join(timeout=30)

    problems = result.problems()
    assert not problems, f"{len(problems)} problems under load:\n" + "\n".join(problems[:40]) + "\n" + result.table()
    assert len(result.claims) == SPEC.claims and {c.wants for c in result.claims} == {"mig", "gpu"}
    # The canary check means something: devices went from one tenant to the next.
    assert result.reallocations >= SPEC.claims - result.devices, result.table()
    # The table's scheduler rows are the real kube-scheduler's counters over the run: it scheduled every pod.
    assert result.scheduling is not None and result.scheduling["attempts/scheduled"] >= SPEC.claims, result.table()

    # Every finalizer strip was denied, and every denial is in the audit log, whose chain verifies. Beside
    # them: the resourceclaim controller's deallocations, refused until the agent's attestation.
    assert attacks["denied"] > 0 and set(attacks) <= {"denied", "gone", "raced", "owed no scrub"}, attacks
    denials = [r for namespace, _ in run.namespaces for r in cluster.audit_denials("SG007", namespace=namespace)]
    strips = [r for r in denials if r["subResource"] == ""]
    # At least one record per refusal: kube-apiserver retries a patch that met a conflict (the agent wrote the
    # claim meanwhile) and runs admission, and so the audit, once more for it.
    assert len(strips) >= attacks["denied"], (len(strips), attacks)
    assert {r["user"] for r in strips} <= {user for _, user in run.namespaces}
    # (Of the resourceclaim controller: a pod that ended before the agent held its claim; none with the hold.)
    assert {(r["subResource"], r["user"]) for r in denials if r not in strips} <= {("status", CLAIM_CONTROLLER)}
    assert_invariant(cluster)

    # The agent's API client kept a connection for each call it made at once: none was closed for want of room
    # (urllib3 warns of each; a later call would pay for a new TLS handshake).
    assert "Connection pool is full" not in cluster.agent.log_path.read_text()

    # No fence was needed: each claim's allocation held its devices until its attestation. Nothing is left
    # behind: no fence of the run, and the agent has no teardown left.
    assert not [c for c in result.claims if c.fenced_at is not None], result.table()
    assert not result.leftover_fences
    status, detail = cluster.agent_healthz()
    assert status == 200 and detail.startswith("ok: 0 teardown(s)"), detail
