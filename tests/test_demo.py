"""`make demo`'s story is true: run it as a user would (a subprocess, on a PATH with nothing but sh and sleep:
the control plane comes from `make cluster-bins`' cache), then re-check what it printed against the files it
leaves: every version of the claims, fences and pods the real API server's watches delivered, the audit log,
the attestation key and the simulated GPU's memory."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from scrubgate.certs.inject import ca_bundle
from scrubgate.policies import names
from scrubgate.policies.attestation import check_claim_attestation, load_private_key
from scrubgate.sanitizer_agent.gpu import simulated
from scrubgate.webhook.audit import verify_files

from devcluster.demo import CANARY

REPO_ROOT = Path(__file__).resolve().parents[1]
RULES = ("SG001", "SG002", "SG003", "SG005", "SG007", "SG008")
STEP = re.compile(r"^\[\s*(\d+)\] (PASS|FAIL)  (.*)$")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    workdir: Path

    def lines(self) -> list[str]:
        return self.stdout.splitlines()

    def detail(self, pattern: str) -> re.Match[str]:
        """The first output line matching ``pattern`` (the demo's indented details included)."""
        for line in self.lines():
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"the demo printed no line matching {pattern!r}:\n{self.stdout}")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("demo")
    # Nothing on PATH but what the container stand-ins need: kubectl and the control plane come from the cache.
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "sleep"):
        found = shutil.which(tool)
        assert found, f"{tool} is not on PATH"
        (bin_dir / tool).symlink_to(found)
    env = {**os.environ, "PATH": str(bin_dir)}
    workdir = tmp / "work"
    result = subprocess.run(
        [sys.executable, "-m", "devcluster.demo", "--workdir", str(workdir)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    yield Run(result.returncode, result.stdout, result.stderr, workdir)


def journal(run: Run) -> list[dict[str, Any]]:
    """Every object version the API server's watches delivered, in resourceVersion order."""
    path = run.workdir / "observed.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def versions_of(run: Run, resource: str, namespace: str, name: str) -> list[dict[str, Any]]:
    return [e for e in journal(run) if e["key"] == [names.RESOURCE_GROUP, resource, namespace, name]]


def test_exits_zero_and_every_step_passes(demo: Run) -> None:
    assert demo.returncode == 0, f"demo failed:\n{demo.stdout}\n{demo.stderr}"
    steps = [STEP.match(line) for line in demo.lines() if STEP.match(line)]
    assert [int(s.group(1)) for s in steps] == list(range(1, len(steps) + 1))
    assert len(steps) == 7 + len(RULES) + 1, demo.stdout
    assert all(s.group(2) == "PASS" for s in steps), demo.stdout
    last = demo.lines()[-1]
    assert last.startswith("scrubgate demo: all steps PASS")
    summary = json.loads(last[last.index("{") :])
    assert summary["failed"] == [] and summary["steps"] == len(steps)
    assert summary["workdir"] == str(demo.workdir)
    assert summary["audit_log"] == str(demo.workdir / "audit" / "audit.jsonl")


def test_it_installed_the_manifests_webhook_configurations(demo: Run) -> None:
    docs = list(yaml.safe_load_all((demo.workdir / "webhook-configurations.yaml").read_text()))
    bundle = ca_bundle((demo.workdir / "certs" / "ca.crt").read_bytes())
    webhooks = [w for d in docs for w in d["webhooks"]]
    assert {d["kind"] for d in docs} == {"ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"}
    assert webhooks and all(w["clientConfig"]["caBundle"] == bundle for w in webhooks)
    assert all(w.get("matchConditions") for w in webhooks), "webhook-settings.yaml was not applied"
    # The local overlay: the Service stand-in on 127.0.0.1 instead of the in-cluster Service.
    assert all(w["clientConfig"]["url"].startswith("https://127.0.0.1:") for w in webhooks)


def test_it_ran_on_the_real_api_server(demo: Run) -> None:
    version = demo.detail(r"kube-apiserver https://127\.0\.0\.1:\d+ reports gitVersion (v\d+\.\d+\.\d+)").group(1)
    assert version.startswith("v1.3"), version


def test_the_lifecycle_it_printed_is_in_the_api_servers_history(demo: Run) -> None:
    claim_line = demo.detail(r"claim (team-a)/(\S+) allocated (\S+)/(\S+)/(\S+) \((\S+)\)")
    namespace, claim, driver, pool, device, uuid = claim_line.groups()
    versions = versions_of(demo, "resourceclaims", namespace, claim)
    assert versions and versions[-1]["obj"] is None, "the Job's claim was not deleted"
    stored = [v["obj"] for v in versions if v["obj"] is not None]
    assert names.FINALIZER in stored[0]["metadata"]["finalizers"], "the finalizer was not there from creation"

    # Step 5: the attestation it showed is on the claim and verifies with the agent's key.
    uid = demo.detail(r"attestation verifies with key \S+: claim uid ([-0-9a-f]+)").group(1)
    assert stored[-1]["metadata"]["uid"] == uid
    key = load_private_key((demo.workdir / "attestation" / "ed25519.pem").read_bytes())
    token = stored[-1]["metadata"]["annotations"][names.ANNOTATION_ATTESTATION]
    payload = check_claim_attestation(token, stored[-1], {"scrubgate-agent-devcluster": key.public_key()})
    assert [(d["driver"], d["pool"], d["device"]) for d in payload["devices"]] == [(driver, pool, device)]

    # Step 7: the resourceVersion order it printed.
    order = demo.detail(
        r"order: \S+ attested (\d+) < deallocated (\d+) < (team-b)/(\S+) allocated \S+ (\d+); no DeviceTaintRule"
    ).groups()
    attested, deallocated, reallocated = (int(order[i]) for i in (0, 1, 4))
    assert attested < deallocated < reallocated
    by_rv = {v["rv"]: v["obj"] for v in versions}
    assert not (by_rv[deallocated].get("status") or {}).get("allocation")
    # Allocated in every version before the one it printed: never deallocated before the attestation.
    held = min(rv for rv, obj in by_rv.items() if obj and (obj.get("status") or {}).get("allocation"))
    assert all((obj.get("status") or {}).get("allocation") for rv, obj in by_rv.items() if held <= rv < deallocated)
    assert names.ANNOTATION_ATTESTATION in by_rv[attested]["metadata"]["annotations"]
    assert (
        min(
            rv
            for rv, obj in by_rv.items()
            if obj and names.ANNOTATION_ATTESTATION in obj["metadata"].get("annotations", {})
        )
        == attested
    )
    assert not [e for e in journal(demo) if e["key"][1] == "devicetaintrules"], "no fence was needed"
    next_versions = versions_of(demo, "resourceclaims", order[2], order[3])
    first_allocation = min(
        v["rv"] for v in next_versions if v["obj"] and (v["obj"].get("status") or {}).get("allocation")
    )
    assert first_allocation == reallocated
    results = next(v["obj"] for v in next_versions if v["rv"] == reallocated)["status"]["allocation"]["devices"][
        "results"
    ]
    assert [(r["driver"], r["pool"], r["device"]) for r in results] == [(driver, pool, device)]

    # The canary is not in the device's memory (nothing wrote to it since the scrub).
    assert CANARY.encode() not in simulated.read(demo.workdir / "gpus" / "gpu-node-1", uuid)


def test_each_rejection_it_printed_is_in_the_audit_log_which_verifies(demo: Run) -> None:
    records = {r["seq"]: r for r in map(json.loads, (demo.workdir / "audit" / "audit.jsonl").read_text().splitlines())}
    for rule in RULES:
        step = demo.detail(rf"^\[\s*\d+\] PASS  {rule} ")
        after = demo.lines()[demo.lines().index(step.string) :]
        message = next(line for line in after if "API server: HTTP" in line)
        assert re.search(rf"HTTP 4\d\d: admission webhook \S+ denied the request: .*{rule}", message), message
        audit_line = next(line for line in after if "audit log: seq" in line)
        seq = int(re.search(r"audit log: seq (\d+), decision deny", audit_line).group(1))
        assert records[seq]["decision"] == "deny"
        assert rule in [f["rule"]["id"] for f in records[seq]["findings"]]
    result = verify_files([demo.workdir / "audit" / "audit.jsonl"])
    assert result.problem is None and result.records == len(records)
    denials = int(demo.detail(r"audit\.jsonl: (\d+) denial\(s\)").group(1))
    assert denials == sum(1 for r in records.values() if r["decision"] == "deny")
    early = int(demo.detail(r"(\d+) of them the resourceclaim controller's deallocation").group(1))
    assert early == sum(1 for r in records.values() if r["decision"] == "deny" and r["subResource"] == "status")
