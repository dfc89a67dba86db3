"""The simulated control plane: kube-scheduler (with DRA allocation) and kube-controller-manager's
resourceclaim controller. Both write through the API, so admission webhooks see their requests
as they would see the real components'.

The resourceclaim controller clears a claim's allocation as soon as no pod holds it anymore,
whatever other finalizers the claim has: that is the upstream behaviour, and the reason a device
must be fenced by a taint rather than protected by a finalizer. The status write goes through
admission, where scrubgate's deallocation guard refuses it until the claim carries the agent's
attestation; the controller then retries, as upstream's work queue does.
"""

from __future__ import annotations

import copy
import logging
import time

from .allocator import Inventory, Unschedulable, blocking_taints
from .api import Api, Call, now_rfc3339
from .auth import CLAIM_CONTROLLER, SCHEDULER
from .resources import CLAIM_TEMPLATES, CLAIMS, DEVICE_CLASSES, PODS, SLICES, TAINT_RULES
from .worker import Worker

log = logging.getLogger("devcluster.controllers")

POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
DELETE_PROTECTION = "resource.kubernetes.io/delete-protection"


def pod_done(pod: dict) -> bool:
    """No container of the pod runs or will run (upstream ``isPodDone``)."""
    phase = (pod.get("status") or {}).get("phase")
    return phase in ("Succeeded", "Failed") or bool(
        pod["metadata"].get("deletionTimestamp") and not (pod.get("spec") or {}).get("nodeName")
    )


def owning_pod(claim: dict) -> tuple[str, str] | None:
    for ref in claim["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("apiVersion") == "v1" and ref.get("kind") == "Pod":
            return ref.get("name", ""), ref.get("uid", "")
    return None


def _list(api: Api, group: str, plural: str) -> list[dict]:
    return api.store.list(group, plural)[0]


class Scheduler(Worker):
    name = "scheduler"

    def __init__(self, api: Api, interval_s: float = 0.5) -> None:
        super().__init__(api, SCHEDULER, interval_s)
        self._reported: dict[str, str] = {}  # pod uid -> last Unschedulable message written
        self._selections: dict = {}  # what CEL selectors select, kept across passes (see Inventory)

    def sync(self) -> None:
        pending = [p for p in _list(self.api, "", "pods") if _wants_scheduling(p)]
        if not pending:
            return
        claims = _list(self.api, CLAIMS.group, CLAIMS.plural)
        nodes = [n for n in _list(self.api, "", "nodes") if _node_ready(n)]
        if len(self._selections) > 100_000:
            self._selections.clear()
        inventory = Inventory(
            _list(self.api, SLICES.group, SLICES.plural),
            _list(self.api, DEVICE_CLASSES.group, DEVICE_CLASSES.plural),
            _list(self.api, TAINT_RULES.group, TAINT_RULES.plural),
            claims,
            self._selections,
        )
        by_name = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims}
        for pod in sorted(pending, key=lambda p: p["metadata"].get("creationTimestamp", "")):
            self._schedule(pod, nodes, by_name, inventory)

    def _schedule(
        self, pod: dict, nodes: list[dict], claims: dict[tuple[str, str], dict], inventory: Inventory
    ) -> None:
        ns = pod["metadata"]["namespace"]
        needed, waiting = _pod_claims(pod, claims)
        if waiting:
            self._unschedulable(pod, waiting)
            return
        reasons = []
        for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
            node_name = node["metadata"]["name"]
            taints = blocking_taints((node.get("spec") or {}).get("taints") or [], pod["spec"].get("tolerations") or [])
            if taints:
                reasons.append(f"node {node_name} has untolerated taint {taints[0].get('key')}")
                continue
            if any(not _allocated_for(c, node_name) for c in needed if (c.get("status") or {}).get("allocation")):
                reasons.append(f"node {node_name} is not where an already allocated claim's devices are")
                continue
            try:
                allocations = inventory.allocate(
                    [c for c in needed if not (c.get("status") or {}).get("allocation")], node_name
                )
            except Unschedulable as e:
                reasons.append(str(e))
                continue
            if self._reserve(pod, needed, allocations):
                self._bind(pod, node_name)
            return
        self._unschedulable(pod, "; ".join(reasons) or "no ready node")
        log.debug("pod %s/%s unschedulable", ns, pod["metadata"]["name"])

    def _reserve(self, pod: dict, claims: list[dict], allocations: dict[str, dict]) -> bool:
        """Allocate (finalizer first, as upstream) and reserve every claim for the pod."""
        consumer = {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
        for claim in claims:
            claim = copy.deepcopy(claim)
            allocation = allocations.get(claim["metadata"]["uid"])
            if allocation is not None and DELETE_PROTECTION not in (claim["metadata"].get("finalizers") or []):
                claim["metadata"]["finalizers"] = [*(claim["metadata"].get("finalizers") or []), DELETE_PROTECTION]
                claim = self.update(CLAIMS, claim)
                if claim is None:
                    return False
            status = claim.setdefault("status", {})
            if allocation is not None:
                status["allocation"] = allocation
            reserved = status.get("reservedFor") or []
            if any(r.get("uid") == consumer["uid"] for r in reserved) and allocation is None:
                continue
            status["reservedFor"] = [*[r for r in reserved if r.get("uid") != consumer["uid"]], consumer]
            if self.update(CLAIMS, claim, "status") is None:
                return False
        return True

    def _bind(self, pod: dict, node: str) -> None:
        meta = pod["metadata"]
        call = Call(self.user, PODS, "v1", meta["namespace"], meta["name"], "binding")
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        self._attempt(
            call, f"bind pod {meta['namespace']}/{meta['name']} to {node}", lambda: self.api.create(call, binding)
        )
        self._reported.pop(meta["uid"], None)

    def _unschedulable(self, pod: dict, message: str) -> None:
        uid = pod["metadata"]["uid"]
        if self._reported.get(uid) == message:
            return
        pod = copy.deepcopy(pod)
        conditions = [
            c for c in pod.setdefault("status", {}).get("conditions") or [] if c.get("type") != "PodScheduled"
        ]
        pod["status"]["conditions"] = [
            *conditions,
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
                "lastTransitionTime": now_rfc3339(),
            },
        ]
        if self.update(PODS, pod, "status") is not None:
            self._reported[uid] = message


def _wants_scheduling(pod: dict) -> bool:
    spec = pod.get("spec") or {}
    return (
        not spec.get("nodeName")
        and not pod["metadata"].get("deletionTimestamp")
        and spec.get("schedulerName", "default-scheduler") == "default-scheduler"
        and (pod.get("status") or {}).get("phase", "Pending") == "Pending"
    )


def _node_ready(node: dict) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"]
    return not ready or ready[0].get("status") == "True"


def _pod_claims(pod: dict, claims: dict[tuple[str, str], dict]) -> tuple[list[dict], str]:
    """The pod's claims, or why it must wait for them (not generated yet, missing, being deleted)."""
    ns = pod["metadata"]["namespace"]
    generated = {
        s.get("name"): s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    needed = []
    for pod_claim in pod["spec"].get("resourceClaims") or []:
        name = pod_claim.get("resourceClaimName") or generated.get(pod_claim.get("name"))
        if not name:
            return [], f"waiting for the ResourceClaim of pod claim {pod_claim.get('name')!r} to be generated"
        claim = claims.get((ns, name))
        if claim is None:
            return [], f'resourceclaim "{name}" not found'
        if claim["metadata"].get("deletionTimestamp"):
            return [], f'resourceclaim "{name}" is being deleted'
        needed.append(claim)
    return needed, ""


def _allocated_for(claim: dict, node: str) -> bool:
    selector = ((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector")
    if not selector:
        return True
    for term in selector.get("nodeSelectorTerms") or []:
        fields = term.get("matchFields") or []
        if all(
            f.get("key") == "metadata.name" and f.get("operator") == "In" and node in (f.get("values") or [])
            for f in fields
        ):
            return True
    return False


class ClaimController(Worker):
    name = "resourceclaim-controller"
    # Upstream requeues a claim whose sync failed with exponential backoff, and at once on any change to
    # it: a deallocation that an admission webhook denies is retried when the claim changes (e.g. the
    # node agent's attestation lands), else after the backoff.
    max_backoff_s = 30.0

    def __init__(self, api: Api, interval_s: float = 0.5) -> None:
        super().__init__(api, CLAIM_CONTROLLER, interval_s)
        self._backoff: dict[str, tuple[str, float, float]] = {}  # claim uid -> (resourceVersion, retry at, delay)

    def sync(self) -> None:
        generated: dict[tuple[str, str, str, str], dict] = {}  # (namespace, pod, pod uid, pod claim) -> claim
        for claim in _list(self.api, CLAIMS.group, CLAIMS.plural):
            owner = owning_pod(claim)
            if owner is not None:
                pod_claim = (claim["metadata"].get("annotations") or {}).get(POD_CLAIM_NAME_ANNOTATION, "")
                generated.setdefault((claim["metadata"]["namespace"], *owner, pod_claim), claim)
        for pod in _list(self.api, "", "pods"):
            self._sync_pod(pod, generated)
        pods_by_name = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in _list(self.api, "", "pods")}
        now = time.monotonic()
        claims = _list(self.api, CLAIMS.group, CLAIMS.plural)
        present = {c["metadata"]["uid"] for c in claims}
        self._backoff = {uid: b for uid, b in self._backoff.items() if uid in present}
        for claim in claims:
            meta = claim["metadata"]
            backoff = self._backoff.get(meta["uid"])
            if backoff is not None and backoff[0] == meta.get("resourceVersion") and now < backoff[1]:
                continue
            self._sync_claim(claim, pods_by_name)

    def _failed(self, claim: dict) -> None:
        """A status write of `claim` was refused: retry on its next change, or after the backoff."""
        meta = claim["metadata"]
        last = self._backoff.get(meta["uid"], ("", 0.0, 0.0))[2]
        delay = min(last * 2 or self.interval_s, self.max_backoff_s)
        self._backoff[meta["uid"]] = (meta.get("resourceVersion", ""), time.monotonic() + delay, delay)

    def _sync_pod(self, pod: dict, generated: dict[tuple[str, str, str, str], dict]) -> None:
        meta = pod["metadata"]
        if pod_done(pod) or meta.get("deletionTimestamp"):
            return
        statuses = {
            s.get("name"): s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        }
        wanted = dict(statuses)
        for pod_claim in pod["spec"].get("resourceClaims") or []:
            template_name = pod_claim.get("resourceClaimTemplateName")
            if not template_name:
                continue
            existing = generated.get((meta["namespace"], meta["name"], meta["uid"], pod_claim.get("name", "")))
            if existing is None:
                existing = self._generate(pod, pod_claim, template_name)
            if existing is not None:
                wanted[pod_claim["name"]] = existing["metadata"]["name"]
        if wanted != statuses:
            pod = copy.deepcopy(pod)
            pod.setdefault("status", {})["resourceClaimStatuses"] = [
                {"name": k, "resourceClaimName": v} for k, v in wanted.items()
            ]
            self.update(PODS, pod, "status")

    def _generate(self, pod: dict, pod_claim: dict, template_name: str) -> dict | None:
        meta = pod["metadata"]
        template = self.api.store.get((CLAIM_TEMPLATES.group, CLAIM_TEMPLATES.plural, meta["namespace"], template_name))
        if template is None:
            log.info(
                "pod %s/%s: resourceclaimtemplate %s not found yet", meta["namespace"], meta["name"], template_name
            )
            return None
        template_meta = (template.get("spec") or {}).get("metadata") or {}
        annotations = {**(template_meta.get("annotations") or {}), POD_CLAIM_NAME_ANNOTATION: pod_claim["name"]}
        generate_name = f"{meta['name']}-{pod_claim['name']}-"
        if len(generate_name) > 57:  # room for the random suffix in 63 characters, cut in proportion
            base = meta["name"][: len(meta["name"]) * 57 // len(generate_name)]
            generate_name = f"{base}-{pod_claim['name'][: len(pod_claim['name']) * 57 // len(generate_name)]}"
        claim_meta: dict = {
            "generateName": generate_name,
            "namespace": meta["namespace"],
            "annotations": annotations,
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }
        if template_meta.get("labels"):
            claim_meta["labels"] = dict(template_meta["labels"])
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": claim_meta,
            "spec": copy.deepcopy((template.get("spec") or {}).get("spec") or {}),
        }
        return self.create(CLAIMS, claim)

    def _sync_claim(self, claim: dict, pods: dict[tuple[str, str], dict]) -> None:
        meta = claim["metadata"]
        ns = meta["namespace"]
        reserved = (claim.get("status") or {}).get("reservedFor") or []
        valid = []
        for ref in reserved:
            if ref.get("apiGroup") or ref.get("resource") != "pods":
                valid.append(ref)  # upstream errors out on other consumers; keeping them is the safe side
                continue
            pod = pods.get((ns, ref.get("name", "")))
            if pod is not None and pod["metadata"]["uid"] == ref.get("uid") and not pod_done(pod):
                valid.append(ref)
        protected = DELETE_PROTECTION in (meta.get("finalizers") or [])
        if len(valid) < len(reserved):
            claim = copy.deepcopy(claim)
            claim["status"]["reservedFor"] = valid
            if not valid and protected:
                # Deallocate: the scheduler may hand these devices to the next claim right away.
                claim["status"].pop("allocation", None)
            updated = self.update(CLAIMS, claim, "status")
            if updated is None:
                self._failed(claim)
                return
            claim = updated
            if protected and not (claim.get("status") or {}).get("allocation"):
                claim = self._drop_protection(claim)
        elif protected and meta.get("deletionTimestamp") and not valid:
            if (claim.get("status") or {}).get("allocation"):
                deallocated = copy.deepcopy(claim)
                deallocated["status"].pop("allocation")
                claim = self.update(CLAIMS, deallocated, "status")
                if claim is None:
                    self._failed(deallocated)
            if claim is not None:
                claim = self._drop_protection(claim)
        if claim is None or valid:
            return
        owner = owning_pod(claim)
        if owner is not None:
            pod = pods.get((ns, owner[0]))
            if (
                pod is not None
                and (pod["metadata"]["uid"] != owner[1] or pod_done(pod))
                and not claim["metadata"].get("deletionTimestamp")
            ):
                self.delete(CLAIMS, ns, claim["metadata"]["name"])

    def _drop_protection(self, claim: dict) -> dict | None:
        claim = copy.deepcopy(claim)
        claim["metadata"]["finalizers"] = [
            f for f in claim["metadata"].get("finalizers") or [] if f != DELETE_PROTECTION
        ]
        return self.update(CLAIMS, claim)


class ControlPlane:
    """Scheduler and resourceclaim controller, started and stopped together."""

    def __init__(self, api: Api, interval_s: float = 0.5) -> None:
        self.workers: list[Worker] = [ClaimController(api, interval_s), Scheduler(api, interval_s)]

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    def signal_stop(self) -> None:
        for worker in self.workers:
            worker.signal_stop()

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
