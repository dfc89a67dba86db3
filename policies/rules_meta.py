"""The rule table (DESIGN.md, "Rules"): stable ids, names, default actions and the help text that the
SARIF output, the docs and the webhook's messages share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RuleMeta:
    id: str
    name: str
    default_action: Literal["deny", "warn", "audit", "off"]
    summary: str
    help: str


RULES: dict[str, RuleMeta] = {
    rule.id: rule
    for rule in (
        RuleMeta(
            "SG001",
            "retain-deallocation",
            "deny",
            "GPU claim or claim template keeps its device (Retain) in a multi-tenant namespace",
            "Set the annotation scrubgate.dev/deallocation-policy to Delete (or remove it) so the device is "
            "scrubbed before the next tenant gets it; Retain is allowed only in namespaces labelled "
            "scrubgate.dev/tenancy=trusted.",
        ),
        RuleMeta(
            "SG002",
            "shared-claim",
            "deny",
            "pod template or multi-tenant pod shares one ResourceClaim across pods",
            "Use resourceClaimTemplateName so that each pod replica gets its own claim, which is scrubbed when "
            "that pod ends; a claim named by resourceClaimName outlives and crosses pod lifecycles.",
        ),
        RuleMeta(
            "SG003",
            "grace-period",
            "deny",
            "GPU pod has no (in manifests), or too short or too long, terminationGracePeriodSeconds",
            "Set spec.terminationGracePeriodSeconds between the policy's minimum and maximum so the containers "
            "stop and the driver unprepares the device before the pod is reported terminal (the API server sets "
            "30 where it is absent; `scrubgate check --fix` writes the policy's defaultSeconds).",
        ),
        RuleMeta(
            "SG004",
            "claim-finalizer",
            "warn",
            "GPU ResourceClaim without the scrubgate.dev/sanitize finalizer",
            "Add the finalizer scrubgate.dev/sanitize (the admission webhook adds it on create; `scrubgate "
            "check --fix` adds it in manifests) so the claim object stays until the node agent attests the scrub.",
        ),
        RuleMeta(
            "SG005",
            "fence-toleration",
            "deny",
            "device request tolerates scrubgate's fence taint",
            "Remove tolerations of scrubgate.dev/ taint keys (and key-less operator: Exists tolerations) from "
            "device requests: the fence keeps devices that may hold another tenant's data from being allocated.",
        ),
        RuleMeta(
            "SG006",
            "admin-access",
            "deny",
            "adminAccess to GPU devices in a multi-tenant namespace",
            "Remove adminAccess: true from the device request; admin access reaches devices in use by other "
            "claims and is allowed only in namespaces labelled scrubgate.dev/tenancy=trusted.",
        ),
        RuleMeta(
            "SG007",
            "finalizer-guard",
            "deny",
            "removal of the sanitize finalizer, deallocation of a GPU claim or change of scrubgate annotations "
            "without a valid attestation, or deletion or change of scrubgate's fence (DeviceTaintRule)",
            "Only the scrubgate node agent removes scrubgate.dev/sanitize and writes scrubgate.dev/ annotations, "
            "with a signed attestation of a verified scrub, and a GPU claim's allocation is cleared only once "
            "that attestation is on the claim; for a lost node, an admin sets scrubgate.dev/break-glass with a "
            "reason first. Only the agent, after that scrub, deletes or changes the spec of a DeviceTaintRule "
            "with a scrubgate.dev/ taint (the fence that keeps the device from the next claim); an admin may, "
            "and is audited.",
        ),
        RuleMeta(
            "SG008",
            "force-delete",
            "deny",
            "force delete (grace period 0) of a pod that holds GPU claims",
            "Delete the pod with a grace period (omit --grace-period=0 --force) so the device is unprepared and "
            "scrubbed; only the policy's admin groups may force-delete such pods.",
        ),
        RuleMeta(
            "SG009",
            "gpu-class-coverage",
            "deny",
            "DeviceClass that selects a GPU driver's devices, or offers them as an extended resource, unknown to "
            "the policy",
            "Add the class to gpuDeviceClasses in the scrubgate policy (or to excludeDeviceClasses if no agent can "
            "scrub its devices), and its extendedResourceName to gpuExtendedResources, so that its claims and "
            "pods get scrubgate's guards.",
        ),
        RuleMeta(
            "SG010",
            "tenancy-label",
            "deny",
            "change of a namespace's scrubgate.dev/tenancy label by anyone but the policy's admin groups",
            "Ask a member of the policy's admin groups to set or remove scrubgate.dev/tenancy: trusted turns the "
            "multi-tenant rules (SG001, SG006, SG002 for pods) off in the namespace. Every change is audited.",
        ),
    )
}
