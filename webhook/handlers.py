"""Admission decisions: an AdmissionRequest and the policy in, an AdmissionResponse and the findings out.

Pure functions over the policy core; transport.py decodes, app.py wires, audits and measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.engine import Admission, DeviceClasses, default, validate
from scrubgate.policies.findings import Finding
from scrubgate.policies.names import FINALIZER

from . import responses
from .defaults import MAX_FINDINGS_SHOWN
from .review import AdmissionRequest, AdmissionResponse

Decision = Literal["allow", "deny", "warn", "audit", "patch", "error"]


@dataclass(frozen=True, slots=True)
class Outcome:
    response: AdmissionResponse
    decision: Decision
    findings: Sequence[Finding] = ()

    @property
    def audited(self) -> bool:
        """DESIGN.md: a record for every deny, warn and audit decision."""
        return self.decision in ("deny", "warn", "audit")


def describe(request: AdmissionRequest) -> str:
    """`Kind namespace/name` of the request's object, for messages and logs."""
    name = request.name or _generate_name(request) or "<unnamed>"
    return f"{request.kind_name} {request.namespace}/{name}" if request.namespace else f"{request.kind_name} {name}"


def _generate_name(request: AdmissionRequest) -> str:
    meta = (request.object or {}).get("metadata") or {}
    generate_name = meta.get("generateName")
    return f"{generate_name}<generated>" if generate_name else ""


def _label(finding: Finding) -> str:
    return f"{finding.rule} {finding.name}"


def more(shown: int, total: int) -> str:
    """The note for findings left out of an answer or record (which still count in the metrics)."""
    return f" (and {total - shown} more findings)" if total > shown else ""


def _deny_message(request: AdmissionRequest, denials: list[Finding]) -> str:
    shown = denials[:MAX_FINDINGS_SHOWN]
    fixes = "; ".join(f"{_label(finding)}: {finding.message}" for finding in shown)
    return f"scrubgate denied {request.operation} of {describe(request)}: {fixes}{more(len(shown), len(denials))}"


def handle_validate(
    request: AdmissionRequest, policy: PolicyConfig, classes: DeviceClasses, *, trusted: bool
) -> Outcome:
    """SG001-SG010 on the request; `trusted` comes from the webhook path (the namespaceSelector split),
    never from the request, so a namespace the webhook cannot place is multi-tenant; `classes` are the cluster's
    DeviceClasses as the webhook's watch knows them. Kinds the policy does not know get no findings from the
    engine, hence a plain allow."""
    admission = Admission(
        operation=request.operation,
        username=request.username,
        groups=request.groups,
        old_object=request.old_object,
        options=request.options,
        dry_run=request.dry_run,
        subresource=request.sub_resource,
        node=request.node,
    )
    findings = validate(request.object, policy, trusted=trusted, admission=admission, classes=classes)
    if not findings:
        return Outcome(responses.allowed(request.uid), "allow")
    denials = [finding for finding in findings if finding.action == "deny"]
    warnings = [f"[{_label(finding)}] {finding.message}" for finding in findings if finding.action == "warn"]
    if len(warnings) > MAX_FINDINGS_SHOWN:
        warnings = [*warnings[:MAX_FINDINGS_SHOWN], f"[scrubgate]{more(MAX_FINDINGS_SHOWN, len(warnings))}"]
    if denials:
        return Outcome(
            responses.denied(request.uid, _deny_message(request, denials), warnings=warnings), "deny", findings
        )
    if warnings:
        return Outcome(responses.allowed(request.uid, warnings), "warn", findings)
    return Outcome(responses.allowed(request.uid), "audit", findings)


def handle_mutate(request: AdmissionRequest, policy: PolicyConfig, classes: DeviceClasses) -> Outcome:
    """SG004 finalizer on CREATE of a GPU claim, and its removal when kube-scheduler releases a claim of its own
    that no container used. The engine patches only what is absent, so a reinvocation (reinvocationPolicy:
    IfNeeded) adds nothing twice; it finds nothing to default in other operations and kinds (the API server has
    defaulted a pod's grace period before any webhook runs)."""
    admission = Admission(
        operation=request.operation,
        username=request.username,
        groups=request.groups,
        old_object=request.old_object,
        subresource=request.sub_resource,
    )
    findings = default(request.object, policy, request.operation, admission, classes)
    ops = [op for finding in findings for op in finding.patch]
    unsafe = [op for op in ops if not _safe(op, ops)]
    if unsafe:
        # Mutation may only add, or remove scrubgate's own finalizer: a replace or another remove could undo what
        # the user or another webhook set.
        raise ValueError(f"policy produced unsafe patch operations {unsafe!r} for {describe(request)}")
    if not ops:
        return Outcome(responses.allowed(request.uid), "allow", findings)
    return Outcome(responses.patched(request.uid, ops), "patch", findings)


def _safe(op: dict[str, object], ops: list[dict[str, object]]) -> bool:
    """An add, the removal of a finalizer entry the same patch first tests to be scrubgate's, or a held claim's
    reservation rewritten or, with its attestation, released (policies/release_guard.kept_consumers_patch: it puts
    a record of each ended pod in the pod's place, or empties the reservation and with it the allocation)."""
    if op.get("op") in ("add", "test"):
        return True
    if op.get("op") == "replace" and op.get("path") == "/status/reservedFor":
        return True
    if op == {"op": "remove", "path": "/status/allocation"}:
        return {"op": "replace", "path": "/status/reservedFor", "value": []} in ops
    ours = {"op": "test", "path": op.get("path"), "value": FINALIZER}
    return op.get("op") == "remove" and str(op.get("path", "")).startswith("/metadata/finalizers/") and ours in ops
