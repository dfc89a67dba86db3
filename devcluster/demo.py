"""``make demo``: scrubgate's lifecycle on one machine, told step by step, each step checked.

The real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler built from their Go
modules), a simulated GPU node, the real webhook and the real agent run as separate processes
(devcluster.harness).
A tenant's Job gets a GPU and writes a canary into its memory; the claim's own allocation keeps the device
from everyone else (no DeviceTaintRule) until the agent has scrubbed and attested it; the next tenant gets
the same device and finds nothing. Then six things a tenant
must not do are each rejected with their rule, and the audit log that recorded them is verified.

Every step prints PASS or FAIL with the object it is about; the exit status is 1 if any step failed.

    python -m devcluster.demo [--workdir DIR]   # DIR keeps the logs, certificates and audit log
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException
from scrubgate.policies import names
from scrubgate.policies.attestation import AttestationError, check_claim_attestation

from . import workloads
from .harness import Cluster, HarnessError, Observed, denial, wait_for
from .kubelet import CANARY_FOUND
from .observer import first_rv, is_allocated, is_attested

TENANT_A, TENANT_B = "alice", "bob"
NS_A, NS_B = "team-a", "team-b"
CANARY = "TEAM-A-SECRET-WEIGHTS-7f3a"
JOB_SECONDS = 4  # long enough to look at the canary and the agent's record while the Job runs
FENCE_CLAIM_LABEL = "scrubgate.dev/claim-uid"  # the agent labels each fence with the claim it guards
WAIT_S = 30.0


@dataclass(frozen=True)
class Rejection:
    """Something a tenant must not do: who does it, to which object, and the rule that must deny it."""

    rule: str
    user: str
    namespace: str
    name: str
    what: str
    call: Callable[[], object]


class StepFailed(Exception):
    """The step did not behave as told; the message says what was seen instead."""


@dataclass
class Story:
    """Numbered steps; each prints one PASS/FAIL line (what happened, to which object) and details."""

    out: Any = sys.stdout
    results: list[tuple[int, bool, str]] = field(default_factory=list)

    def step(self, title: str, run: Callable[[], list[str]]) -> bool:
        number = len(self.results) + 1
        try:
            details, ok = run(), True
        except (StepFailed, HarnessError, AttestationError, ApiException) as exc:
            details, ok = [f"expected: {title}", f"got: {exc}"], False
        self.results.append((number, ok, title))
        print(f"[{number:2d}] {'PASS' if ok else 'FAIL'}  {title}", file=self.out)
        for line in details:
            print(f"       {line}", file=self.out)
        self.out.flush()
        return ok

    @property
    def failed(self) -> list[tuple[int, bool, str]]:
        return [r for r in self.results if not r[1]]


def expect(condition: object, message: str) -> None:
    if not condition:
        raise StepFailed(message)


def device_of(claim: dict[str, Any]) -> tuple[str, str, str]:
    results = claim["status"]["allocation"]["devices"]["results"]
    expect(len(results) == 1, f"claim holds {len(results)} devices, expected 1")
    return results[0]["driver"], results[0]["pool"], results[0]["device"]


class Demo:
    def __init__(self, cluster: Cluster, story: Story) -> None:
        self.cluster = cluster
        self.story = story
        self.job_pod = ""
        self.job_claim = ""
        self.job_claim_uid = ""
        self.device: tuple[str, str, str] = ("", "", "")
        self.device_uuid = ""
        self.next_claim = ""

    # ------------------------------------------------------------------ the lifecycle

    def compliant_job(self) -> list[str]:
        c = self.cluster
        job = workloads.job(
            "train",
            NS_A,
            template="one-gpu",
            grace=60,
            annotations=workloads.workload_annotations(canary=CANARY, run_seconds=JOB_SECONDS),
        )
        template = {**workloads.claim_template("one-gpu"), "metadata": {"name": "one-gpu", "namespace": NS_A}}
        manifest = c.paths.root / "train-job.yaml"
        manifest.write_text(yaml.safe_dump_all([template, job], sort_keys=False))
        check = subprocess.run(
            [sys.executable, "-m", "scrubgate.cli", "check", "--format", "json", str(manifest)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        findings = json.loads(check.stdout or "{}").get("findings")
        expect(
            check.returncode == 0 and findings == [],
            f"scrubgate check {manifest} exited {check.returncode}: {check.stdout}{check.stderr}",
        )
        c.resource(TENANT_A).create_namespaced_resource_claim_template(NS_A, workloads.claim_template("one-gpu"))
        self.job_pod = c.create_job(TENANT_A, job)
        wait_for(
            lambda: (c.pod(NS_A, self.job_pod) or {}).get("status", {}).get("phase") == "Running",
            WAIT_S,
            f"pod {NS_A}/{self.job_pod} Running",
        )
        self.job_claim = c.pod_claim(NS_A, self.job_pod) or ""
        claim = c.claim(NS_A, self.job_claim) or {}
        self.job_claim_uid = claim["metadata"]["uid"]
        self.device = device_of(claim)
        self.device_uuid = c.device_uuid(self.device[2])
        expect(
            names.FINALIZER in claim["metadata"].get("finalizers", []),
            f"claim {NS_A}/{self.job_claim} has no {names.FINALIZER} finalizer",
        )
        return [
            f"scrubgate check {manifest.name}: no findings (grace 60 s, claims from ResourceClaimTemplate one-gpu)",
            f"Job {NS_A}/train -> pod {self.job_pod} Running on {c.node}",
            f"claim {NS_A}/{self.job_claim} allocated {'/'.join(self.device)} ({self.device_uuid})",
            f"the mutating webhook added finalizer {names.FINALIZER} to the claim",
        ]

    def canary_written(self) -> list[str]:
        memory = self.cluster.gpu_memory(self.device_uuid)
        expect(CANARY.encode() in memory, f"canary not in the memory of {self.device_uuid}")
        return [f"{self.device_uuid} memory at offset {memory.index(CANARY.encode())}: {CANARY!r}"]

    def recorded(self) -> list[str]:
        def annotations() -> dict[str, str] | None:
            found = ((self.cluster.claim(NS_A, self.job_claim) or {}).get("metadata") or {}).get("annotations") or {}
            return found if found.get(names.ANNOTATION_SCRUB_STATUS) == names.SCRUB_FENCED else None

        recorded = wait_for(annotations, WAIT_S, f"the agent's record on claim {NS_A}/{self.job_claim}")
        expect(not self._fence_rules(), f"a DeviceTaintRule fences {'/'.join(self.device)}")
        return [
            f"claim {NS_A}/{self.job_claim}: {names.ANNOTATION_DEVICES}={recorded[names.ANNOTATION_DEVICES]}, "
            f"{names.ANNOTATION_SCRUB_STATUS}={names.SCRUB_FENCED}",
            f"no DeviceTaintRule: the claim's allocation keeps {'/'.join(self.device)} from every other claim, and "
            "SG007 keeps that allocation until the agent's attestation is on the claim",
        ]

    def _fence_rules(self) -> list[dict[str, Any]]:
        """The agent's fences on the Job's device for the Job's claim (there should be none)."""
        return [r for r in self.cluster.taint_rules() if self._is_job_fence(r)]

    def _is_job_fence(self, rule: dict[str, Any]) -> bool:
        driver, pool, device = self.device
        return (
            rule["spec"]["deviceSelector"] == {"driver": driver, "pool": pool, "device": device}
            and rule["spec"]["taint"]["key"] == names.TAINT_UNSANITIZED
            and (rule["metadata"].get("labels") or {}).get(FENCE_CLAIM_LABEL) == self.job_claim_uid
        )

    def next_tenant_waits(self) -> list[str]:
        c = self.cluster
        template = workloads.claim_template("same-gpu", selectors=[workloads.uuid_selector(self.device_uuid)])
        c.resource(TENANT_B).create_namespaced_resource_claim_template(NS_B, template)
        annotations = workloads.workload_annotations(look_for=CANARY)
        c.core(TENANT_B).create_namespaced_pod(
            NS_B, workloads.pod("next", template="same-gpu", annotations=annotations)
        )

        def outcome() -> str:
            pod = c.pod(NS_B, "next") or {}
            if pod["spec"].get("nodeName"):
                return "bound"
            for cond in pod.get("status", {}).get("conditions") or []:
                if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                    return cond.get("message", "")
            return ""

        message = wait_for(outcome, WAIT_S, f"the scheduler's verdict on pod {NS_B}/next")
        if message == "bound":  # a slow machine: the Job was over before the scheduler looked
            expect(self._attestation_seen(), f"pod {NS_B}/next was bound before the Job's claim was attested")
            return [f"bob's pod {NS_B}/next was bound at once: the Job had ended and the device was attested"]
        return [f"bob's pod {NS_B}/next asks for {self.device_uuid} and waits: {message}"]

    def job_ends_and_device_is_scrubbed(self) -> list[str]:
        c = self.cluster
        wait_for(
            lambda: (c.pod(NS_A, self.job_pod) or {}).get("status", {}).get("phase") == "Succeeded",
            WAIT_S,
            f"pod {NS_A}/{self.job_pod} Succeeded",
        )
        token = wait_for(lambda: self._attestation_seen(), WAIT_S, f"an attestation on claim {NS_A}/{self.job_claim}")
        statuses = self._scrub_statuses()
        expect(names.SCRUB_VERIFIED in statuses, f"scrub-status went {statuses}, never {names.SCRUB_VERIFIED}")
        claim = self._last_seen_claim()
        payload = check_claim_attestation(token, claim, c.public_keys)
        device = payload["devices"][0]
        return [
            f"pod {NS_A}/{self.job_pod} Succeeded; claim {NS_A}/{self.job_claim} released",
            f"scrub-status: {' -> '.join(statuses)}",
            f"attestation verifies with key {c.key_id}: claim uid {payload['claim']['uid']}, "
            f"{device['device']} {device['bytesScrubbed']}/{device['bytesTotal']} bytes, {device['method']}, "
            f"verified={device['verified']}",
        ]

    def _claim_observations(self) -> list[Observed]:
        return [e for e in self.cluster.observer.claims() if e.obj["metadata"].get("uid") == self.job_claim_uid]

    def _claim_events(self) -> list[dict[str, Any]]:
        return [e.obj for e in self._claim_observations()]

    def _last_seen_claim(self) -> dict[str, Any]:
        return self._claim_events()[-1]

    def _attestation_seen(self) -> str:
        for claim in self._claim_events():
            token = (claim["metadata"].get("annotations") or {}).get(names.ANNOTATION_ATTESTATION)
            if token:
                return token
        return ""

    def _scrub_statuses(self) -> list[str]:
        seen: list[str] = []
        for claim in self._claim_events():
            status = (claim["metadata"].get("annotations") or {}).get(names.ANNOTATION_SCRUB_STATUS)
            if status and (not seen or seen[-1] != status):
                seen.append(status)
        return seen

    def released(self) -> list[str]:
        c = self.cluster
        wait_for(lambda: c.claim(NS_A, self.job_claim) is None, WAIT_S, f"claim {NS_A}/{self.job_claim} deleted")
        c.observer.sync()  # the deletion was read from the API server; the observer's watch may lag behind it
        deleted = [e.rv for e in self._claim_observations() if e.type == "DELETED"]
        expect(deleted, f"the observer saw no deletion of claim {NS_A}/{self.job_claim}")
        memory = c.gpu_memory(self.device_uuid)
        expect(CANARY.encode() not in memory, f"the canary is still in {self.device_uuid}'s memory")
        return [
            f"finalizer {names.FINALIZER} removed by the agent with the attestation, in one write",
            f"the resourceclaim controller's deallocation, refused until then, goes through: claim {NS_A}/"
            f"{self.job_claim} deleted at rv {deleted[0]}",
            f"{self.device_uuid}: {memory.count(0)}/{len(memory)} bytes zero, canary gone",
        ]

    def next_tenant_finds_nothing(self) -> list[str]:
        c = self.cluster

        def running() -> dict[str, Any] | None:
            pod = c.pod(NS_B, "next") or {}
            return pod if pod.get("status", {}).get("phase") == "Running" else None

        pod = wait_for(running, WAIT_S, f"pod {NS_B}/next Running")
        self.next_claim = c.pod_claim(NS_B, "next") or ""
        claim = c.claim(NS_B, self.next_claim) or {}
        expect(device_of(claim) == self.device, f"bob got {device_of(claim)}, not {self.device}")
        found = {cond["type"]: cond for cond in pod["status"].get("conditions") or []}.get(CANARY_FOUND)
        expect(found is not None and found["status"] == "False", f"condition {CANARY_FOUND}: {found}")
        c.observer.sync()  # so that "no DeviceTaintRule" below covers everything up to now
        events = c.observer.events()
        mine = [e for e in events if e.obj["metadata"].get("uid") == self.job_claim_uid]
        held = first_rv(mine, is_allocated) or 0
        attested = first_rv(mine, is_attested)
        deallocated = first_rv(mine, lambda e: e.rv > held and not is_allocated(e))
        fences = [e for e in events if e.resource == "devicetaintrules" and self._is_job_fence(e.obj)]
        allocated = first_rv(
            events,
            lambda e: (
                e.resource == "resourceclaims" and e.obj["metadata"].get("name") == self.next_claim and is_allocated(e)
            ),
        )
        order = f"attested {attested}, deallocated {deallocated}, reallocated {allocated}"
        expect(None not in (attested, deallocated, allocated), f"rv order {order}")
        # The attestation, then the deallocation the webhook refused until then, then the reuse.
        expect(attested < deallocated < allocated, f"rv order {order}")  # type: ignore[operator]
        expect(not fences, f"{len(fences)} DeviceTaintRule event(s) for the Job's claim")
        violations = c.observer.violations(c.public_keys)
        expect(not violations, "; ".join(violations))
        return [
            f"resourceVersion order: {NS_A}/{self.job_claim} attested {attested} < deallocated {deallocated} < "
            f"{NS_B}/{self.next_claim} allocated {'/'.join(self.device)} {allocated}; no DeviceTaintRule on the way",
            f"pod {NS_B}/next looked for the canary in {self.device_uuid}: {found['message']}",
            "observer: no device allocated while dirty, no finalizer removed without a verified attestation",
        ]

    # ------------------------------------------------------------------ what a tenant must not do

    def rejected(self, case: Rejection) -> list[str]:
        expect(case.name, f"no object for {case.rule} to be tried on in namespace {case.namespace}")
        status, message = denial(case.call)
        expect(status >= 400 and case.rule in message, f"HTTP {status}: {message}")
        user = self.cluster.users[case.user].name
        records = wait_for(
            lambda: self.cluster.audit_denials(case.rule, namespace=case.namespace, name=case.name, user=user),
            10,
            f"an audit record of {case.rule} for {case.namespace}/{case.name}",
        )
        return [
            f"API server: HTTP {status}: {message}",
            f"audit log: seq {records[-1]['seq']}, decision deny, {case.rule}",
        ]

    def rejections(self) -> None:
        c = self.cluster
        if not self.next_claim:  # the lifecycle stopped early: bob's pod, if made, has its claim all the same
            with contextlib.suppress(HarnessError):
                self.next_claim = wait_for(lambda: c.pod_claim(NS_B, "next"), WAIT_S, f"the claim of pod {NS_B}/next")
        retain = workloads.claim_template(
            "keep-my-gpu", claim_annotations={names.ANNOTATION_DEALLOCATION_POLICY: names.DEALLOCATION_RETAIN}
        )
        toleration = {"key": names.TAINT_UNSANITIZED, "operator": "Exists", "effect": "NoSchedule"}
        tolerating = workloads.claim_template("ignore-fence", tolerations=[toleration])
        finalizers = self._next_claim_finalizers()
        strip = [
            {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
            {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in finalizers if f != names.FINALIZER]},
        ]
        no_grace = workloads.pod("no-grace", template="one-gpu", grace=0)
        cases = [
            Rejection(
                "SG001", TENANT_A, NS_A, "keep-my-gpu",
                f"Retain: {TENANT_A} creates ResourceClaimTemplate {NS_A}/keep-my-gpu with "
                f"{names.ANNOTATION_DEALLOCATION_POLICY}: Retain",
                lambda: c.resource(TENANT_A).create_namespaced_resource_claim_template(NS_A, retain),
            ),
            Rejection(
                "SG002", TENANT_A, NS_A, "shared",
                f"shared claim: {TENANT_A} creates pod {NS_A}/shared naming resourceClaimName team-gpu",
                lambda: c.core(TENANT_A).create_namespaced_pod(NS_A, workloads.pod("shared", claim="team-gpu")),
            ),
            Rejection(
                "SG003", TENANT_A, NS_A, "no-grace",
                f"grace 0: {TENANT_A} creates pod {NS_A}/no-grace with terminationGracePeriodSeconds: 0",
                lambda: c.core(TENANT_A).create_namespaced_pod(NS_A, no_grace),
            ),
            Rejection(
                "SG005", TENANT_A, NS_A, "ignore-fence",
                f"tolerated fence: {TENANT_A} creates ResourceClaimTemplate {NS_A}/ignore-fence tolerating "
                f"{names.TAINT_UNSANITIZED}",
                lambda: c.resource(TENANT_A).create_namespaced_resource_claim_template(NS_A, tolerating),
            ),
            Rejection(
                "SG007", TENANT_B, NS_B, self.next_claim,
                f"finalizer strip: {TENANT_B} removes {names.FINALIZER} from claim {NS_B}/{self.next_claim}",
                lambda: c.resource(TENANT_B).patch_namespaced_resource_claim(self.next_claim, NS_B, strip),
            ),
            Rejection(
                "SG008", TENANT_B, NS_B, "next",
                f"force delete: {TENANT_B} deletes pod {NS_B}/next with grace period 0",
                lambda: c.core(TENANT_B).delete_namespaced_pod("next", NS_B, grace_period_seconds=0),
            ),
        ]  # fmt: skip
        for case in cases:
            self.story.step(f"{case.rule} {case.what} -> rejected", lambda case=case: self.rejected(case))

    def _next_claim_finalizers(self) -> list[str]:
        claim = self.cluster.claim(NS_B, self.next_claim) if self.next_claim else None
        return list((claim or {}).get("metadata", {}).get("finalizers") or [])

    def audit_verified(self) -> list[str]:
        c = self.cluster
        denied = c.audit_denials()
        rules = sorted({f["rule"]["id"] for r in denied for f in r["findings"] if f["action"] == "deny"})
        expect(set(rules) >= {"SG001", "SG002", "SG003", "SG005", "SG007", "SG008"}, f"denials recorded: {rules}")
        # The webhook signs the chain's head within a checkpoint interval (1 s here) of its last record.
        head = f"(seq {c.audit_records()[-1]['seq']}) matches"
        results: list[subprocess.CompletedProcess[str]] = []
        what = f"scrubgate audit verify to say: the checkpoint {head}"
        wait_for(lambda: results.append(c.verify_audit()) or head in results[-1].stdout, 15, what, interval=0.5)
        result = results[-1]
        expect(
            result.returncode == 0, f"scrubgate audit verify exited {result.returncode}: {result.stdout}{result.stderr}"
        )
        early = [r for r in denied if r.get("subResource") == "status"]
        return [
            f"{c.paths.audit_log}: {len(denied)} denial(s), rules {', '.join(rules)}; {len(early)} of them the "
            f"resourceclaim controller's deallocation of {NS_A}/{self.job_claim} before the attestation",
            f"scrubgate audit verify: {result.stdout.strip()}",
        ]


def play(cluster: Cluster, story: Story) -> None:
    demo = Demo(cluster, story)
    cluster.create_namespace(NS_A)
    cluster.create_namespace(NS_B)
    lifecycle = [
        ("compliant Job team-a/train gets a GPU through a ResourceClaimTemplate (grace 60 s)", demo.compliant_job),
        ("the Job writes a canary into the GPU's memory", demo.canary_written),
        ("the agent records the device; the claim's own allocation keeps it from other claims", demo.recorded),
        ("the next tenant asks for that same device and waits", demo.next_tenant_waits),
        ("the Job ends; the agent drains, scrubs, verifies and attests", demo.job_ends_and_device_is_scrubbed),
        ("the agent releases the claim: attestation and finalizer removal in one write", demo.released),
        (
            "the next tenant gets the device only after the attestation, and finds no canary",
            demo.next_tenant_finds_nothing,
        ),
    ]
    for title, run in lifecycle:
        if not story.step(title, run):
            break  # later lifecycle steps build on this one
    demo.rejections()
    story.step(
        "every rejection is in the audit log, its hash chain and the signed checkpoints on the webhook's stdout verify",
        demo.audit_verified,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devcluster.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workdir", type=Path, help="keep the installation's files here (default: a temp dir, removed)"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    story = Story()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        cluster = Cluster(args.workdir, gpus=2)
    except HarnessError as exc:
        print(f"scrubgate demo: {exc}", file=sys.stderr)
        return 1
    print(
        "scrubgate demo: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, a simulated GPU node, "
        f"the webhook and the agent as separate processes in {cluster.paths.root}",
        flush=True,
    )
    try:
        with cluster.start():
            version = cluster.server_version()
            print(
                f"ready in {time.monotonic() - started:.1f}s: kube-apiserver {cluster.url} reports gitVersion "
                f"{version.get('gitVersion')}; webhook https://127.0.0.1:{cluster.webhook_port} behind the "
                f"manifests' webhook configurations; agent on node {cluster.node} with {len(cluster.gpus())} "
                "simulated GPUs",
                flush=True,
            )
            play(cluster, story)
            if story.failed:
                print(cluster.diagnostics(), file=sys.stderr)
    except HarnessError as exc:
        print(f"scrubgate demo: the installation did not come up: {exc}", file=sys.stderr)
        return 1
    summary = {
        "steps": len(story.results),
        "failed": [n for n, _, _ in story.failed],
        "workdir": str(cluster.paths.root) if cluster.keep else None,  # None: removed (--workdir keeps it)
        "audit_log": str(cluster.paths.audit_log) if cluster.keep else None,
    }
    verdict = "all steps PASS" if not story.failed else f"{len(story.failed)} step(s) FAILED"
    print(f"scrubgate demo: {verdict} in {time.monotonic() - started:.1f}s {json.dumps(summary)}")
    return 1 if story.failed else 0


if __name__ == "__main__":
    sys.exit(main())
