"""The one spelling of every name scrubgate shares with the cluster (DESIGN.md, "Names")."""

from typing import Final

DOMAIN: Final = "scrubgate.dev"

FINALIZER: Final = "scrubgate.dev/sanitize"
ANNOTATION_DEALLOCATION_POLICY: Final = "scrubgate.dev/deallocation-policy"
ANNOTATION_DEVICES: Final = "scrubgate.dev/devices"
ANNOTATION_SCRUB_STATUS: Final = "scrubgate.dev/scrub-status"
ANNOTATION_ATTESTATION: Final = "scrubgate.dev/attestation"
ANNOTATION_BREAK_GLASS: Final = "scrubgate.dev/break-glass"
TENANCY_LABEL: Final = "scrubgate.dev/tenancy"
TENANCY_TRUSTED: Final = "trusted"

TAINT_UNSANITIZED: Final = "scrubgate.dev/unsanitized"
ANNOTATION_FENCE_NODE: Final = "scrubgate.dev/node"  # on a fence: the node whose agent placed it
# On a claim allocated devices of a node: that node. Each agent lists and watches its own node's claims by it (claims
# cannot be field-selected by node); its agent sets it at first sight, the controller for claims no agent saw.
LABEL_NODE: Final = "scrubgate.dev/node"
ANNOTATION_FENCE_CLAIM: Final = "scrubgate.dev/claim"  # on a fence: the claim whose teardown placed it
# The user's extra in which the API server names the node a token is bound to (a DaemonSet pod's, since 1.32).
NODE_NAME_EXTRA: Final = "authentication.kubernetes.io/node-name"
TAINT_SCRUB_FAILED: Final = "scrubgate.dev/scrub-failed"
# The consumer a node agent adds to a GPU claim's `status.reservedFor` once a pod on its node may have used the
# claim (`{apiGroup: scrubgate.dev, resource: nodeagents, name: <node>, uid: <one per hold>}`), and removes with
# its attested release. Kubernetes' resourceclaim controller keeps consumers it does not know, so a claim holding
# one is never deallocated, nor deleted, by anyone else meanwhile: the used claim never looks unused.
RESERVATION_GROUP: Final = DOMAIN
RESERVATION_RESOURCE: Final = "nodeagents"
# An ended pod of a held claim, as /mutate records it in `status.reservedFor` when the resourceclaim controller drops
# the pod (`{apiGroup: scrubgate.dev, resource: endedpods, name: <pod>, uid: <pod's UID>}`): it still shows the claim
# used, the controller keeps it (a consumer it does not know), and, carrying the pod's UID, keeps the controller from
# reserving the claim for that pod again (resourceclaim.IsReservedForPod compares UIDs only). It goes with the hold.
ENDED_POD_RESOURCE: Final = "endedpods"

DEALLOCATION_DELETE: Final = "Delete"
DEALLOCATION_RETAIN: Final = "Retain"

SYSTEM_NAMESPACE: Final = "scrubgate-system"
WEBHOOK_SERVICE_ACCOUNT: Final = "scrubgate-webhook"
AGENT_SERVICE_ACCOUNT: Final = "scrubgate-agent"
CONTROLLER_SERVICE_ACCOUNT: Final = "scrubgate-controller"
WEBHOOK_SERVICE: Final = "scrubgate-webhook"

# Kubernetes' own names that the rules and the agent read.
RESOURCE_GROUP: Final = "resource.k8s.io"
RESOURCE_VERSIONS: Final = ("v1", "v1beta2", "v1beta1", "v1alpha3")
SCHEDULING_GROUP: Final = "scheduling.k8s.io"
POD_CLAIM_NAME_ANNOTATION: Final = "resource.kubernetes.io/pod-claim-name"
DELETE_PROTECTION_FINALIZER: Final = "resource.kubernetes.io/delete-protection"
# KEP-5004: a pod may ask for the devices of DeviceClass <class> as the extended resource `<prefix><class>`.
IMPLICIT_EXTENDED_RESOURCE_PREFIX: Final = "deviceclass.resource.kubernetes.io/"

# Scrub states written to ANNOTATION_SCRUB_STATUS; failures are "failed:<reason>".
SCRUB_FENCED: Final = "fenced"
SCRUB_DRAINING: Final = "draining"
SCRUB_SCRUBBING: Final = "scrubbing"
SCRUB_VERIFIED: Final = "verified"
SCRUB_FAILED_PREFIX: Final = "failed:"

ATTESTATION_TYPE: Final = "scrubgate-attestation+jws"
ATTESTATION_METHOD: Final = "cuda-memset-verify"
