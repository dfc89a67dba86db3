"""An in-memory ClusterClient: the API objects the agent touches, with the API's semantics where the agent
relies on them (JSON patch with `test` ops, resourceVersion bumps, finalizers holding a deleted object,
idempotent create/delete of DeviceTaintRules, discovery of the served DeviceTaintRule version), and the
resourceclaim controller's deallocation as the webhook's SG007 lets it through (`guard`): refused until the
claim may go, and retried at every change of the claim, as the controller requeues it. A claim allocated here
carries its node's label (`scrubgate.dev/node`), as scrubgate's controller labels it, unless `add_claim` is told
otherwise. `requests()` counts the calls by operation (tests assert what an agent does not ask).

A test double for the agent's unit tests and its overhead benchmark (bench/agent_overhead.py); not shipped.
`hook(operation, args)` runs before every call and may raise (an API error, or a simulated crash). The real
client is exercised against a real kube-apiserver (tests/k8s_support.py, devcluster/).
"""

from __future__ import annotations

import collections
import copy
import itertools
import queue
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from typing import Any

import jsonpatch
import jsonpointer
import kube_json_patch
from scrubgate.policies import names
from scrubgate.policies.attestation import ended_pod_entry
from scrubgate.sanitizer_agent.kube import TAINT_RULE_VERSIONS, Conflict, NotFound, same_fence

Hook = Callable[[str, tuple[Any, ...]], None]
# Whether the stored claim's allocation may be cleared now (SG007's verdict on the controller's status write).
Guard = Callable[[dict[str, Any]], bool]


class InMemoryCluster:
    def __init__(
        self, *, taint_rule_versions: tuple[str, ...] = ("v1",), hook: Hook | None = None, guard: Guard | None = None
    ) -> None:
        self.served = taint_rule_versions
        self.hook = hook
        self.guard = guard
        self.refused_deallocations = 0
        self._deallocating: set[tuple[str, str]] = set()  # claims the controller keeps trying to deallocate
        self.pods: dict[str, dict[str, Any]] = {}  # by UID
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.slices: list[dict[str, Any]] = []
        self.rules: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        # Consumers that are not pods (PodGroups), by (API group, resource, namespace, name)
        self.consumers: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.calls: list[str] = []
        self._lock = threading.RLock()
        self._versions = itertools.count(1)
        self._watchers: list[queue.Queue[tuple[str, dict[str, Any]]]] = []
        self._claim_watchers: list[queue.Queue[tuple[str, dict[str, Any]]]] = []

    def requests(self) -> collections.Counter[str]:
        """How many calls of each operation the agent made."""
        return collections.Counter(self.calls)

    # ---------------------------------------------------------------- plumbing

    def _call(self, operation: str, *args: Any) -> None:
        self.calls.append(operation)
        if self.hook:
            self.hook(operation, args)

    def _bump(self, obj: dict[str, Any]) -> None:
        obj.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))

    def _notify(self, kind: str, pod: dict[str, Any]) -> None:
        for watcher in list(self._watchers):
            watcher.put((kind, copy.deepcopy(pod)))

    def _claim_changed(self, namespace: str, name: str, kind: str = "MODIFIED") -> None:
        claim = self.claims.get((namespace, name))
        if claim is not None:
            for watcher in list(self._claim_watchers):
                watcher.put((kind, copy.deepcopy(claim)))

    @staticmethod
    def _labelled(claim: dict[str, Any], node: str) -> bool:
        return (claim["metadata"].get("labels") or {}).get(names.LABEL_NODE) == node

    @staticmethod
    def _watch(
        watchers: list[queue.Queue[tuple[str, dict[str, Any]]]],
        lock: threading.RLock,
        timeout_s: int,
        wanted: Callable[[dict[str, Any]], bool],
    ) -> Iterator[tuple[str, dict]]:
        watcher: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        with lock:
            watchers.append(watcher)
        try:
            while True:
                try:
                    kind, obj = watcher.get(timeout=timeout_s)
                except queue.Empty:
                    return
                if wanted(obj):
                    yield kind, obj
        finally:
            with lock:
                watchers.remove(watcher)

    @staticmethod
    def _patch(obj: dict[str, Any], ops: list[dict[str, Any]], what: str) -> dict[str, Any]:
        try:
            patched = kube_json_patch.apply_patch(obj, ops)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
            raise Conflict(f"PATCH {what}: HTTP 422: {exc}", 422) from exc
        if patched["metadata"].get("uid") != obj["metadata"].get("uid"):
            raise Conflict(f"PATCH {what}: HTTP 422: metadata.uid: field is immutable", 422)
        return patched

    # ---------------------------------------------------------------- ClusterClient

    def list_node_pods(self, node: str) -> tuple[list[dict[str, Any]], str]:
        self._call("list_node_pods", node)
        with self._lock:
            pods = [copy.deepcopy(p) for p in self.pods.values() if p["spec"].get("nodeName") == node]
            return pods, str(next(self._versions))

    def watch_node_pods(self, node: str, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict]]:
        self._call("watch_node_pods", node, resource_version)
        return self._watch(self._watchers, self._lock, timeout_s, lambda pod: pod["spec"].get("nodeName") == node)

    def list_node_claims(self, node: str) -> tuple[list[dict[str, Any]], str]:
        self._call("list_node_claims", node)
        with self._lock:
            found = [copy.deepcopy(c) for c in self.claims.values() if self._labelled(c, node)]
            return found, str(next(self._versions))

    def watch_node_claims(self, node: str, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict]]:
        self._call("watch_node_claims", node, resource_version)
        return self._watch(self._claim_watchers, self._lock, timeout_s, lambda claim: self._labelled(claim, node))

    def list_all_claims(self) -> tuple[list[dict[str, Any]], str]:
        """The controller's: every claim (no agent lists them all)."""
        self._call("list_all_claims")
        with self._lock:
            return [copy.deepcopy(c) for c in self.claims.values()], str(next(self._versions))

    def watch_all_claims(self, resource_version: str, timeout_s: int) -> Iterator[tuple[str, dict]]:
        self._call("watch_all_claims", resource_version)
        return self._watch(self._claim_watchers, self._lock, timeout_s, lambda claim: True)

    def get_claim(self, namespace: str, name: str, not_older_than: str = "") -> dict[str, Any] | None:
        """Always the latest (what a quorum read gets, and the watch cache once it reached `not_older_than`)."""
        self._call("get_claim", namespace, name, not_older_than)
        with self._lock:
            claim = self.claims.get((namespace, name))
            return copy.deepcopy(claim) if claim else None

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._call("get_pod", namespace, name)
        with self._lock:
            found = [
                p
                for p in self.pods.values()
                if (p["metadata"]["namespace"], p["metadata"]["name"]) == (namespace, name)
            ]
            return copy.deepcopy(found[0]) if found else None

    def get_consumer(self, namespace: str, api_group: str, resource: str, name: str) -> dict[str, Any] | None:
        self._call("get_consumer", namespace, api_group, resource, name)
        with self._lock:
            found = self.consumers.get((api_group, resource, namespace, name))
            return copy.deepcopy(found) if found else None

    def patch_claim(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        self._call("patch_claim", namespace, name, ops)
        with self._lock:
            claim = self.claims.get((namespace, name))
            if claim is None:
                raise NotFound(f"PATCH resourceclaim {namespace}/{name}: HTTP 404", 404)
            patched = self._patch(claim, ops, f"resourceclaim {namespace}/{name}")
            self._bump(patched)
            self.claims[(namespace, name)] = patched
            self._claim_changed(namespace, name)
            self._settle_claim(namespace, name)
            return copy.deepcopy(patched)

    def patch_claim_status(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """As the API server's status subresource: only status changes; a consumer added to a claim being deleted
        is refused (validateResourceClaimStatusUpdate)."""
        self._call("patch_claim_status", namespace, name, ops)
        with self._lock:
            claim = self.claims.get((namespace, name))
            if claim is None:
                raise NotFound(f"PATCH resourceclaim {namespace}/{name}/status: HTTP 404", 404)
            patched = self._patch(claim, ops, f"resourceclaim {namespace}/{name}/status")
            before = claim.get("status", {}).get("reservedFor") or []
            added = [c for c in patched.get("status", {}).get("reservedFor") or [] if c not in before]
            if added and claim["metadata"].get("deletionTimestamp"):
                raise Conflict(
                    f"PATCH resourceclaim {namespace}/{name}/status: HTTP 422: reservedFor: new entries", 422
                )
            stored = {**claim, "status": patched.get("status", {})}
            self._bump(stored)
            self.claims[(namespace, name)] = stored
            self._claim_changed(namespace, name)
            self._settle_claim(namespace, name)
            return copy.deepcopy(stored)

    def _settle_claim(self, namespace: str, name: str) -> None:
        """After a change of the claim: the controller's deallocation retried, and a deleted claim that holds
        no finalizer any more goes."""
        key = (namespace, name)
        if key in self._deallocating:
            self.deallocate(namespace, name)
        claim = self.claims.get(key)
        if claim is not None and claim["metadata"].get("deletionTimestamp") and not claim["metadata"].get("finalizers"):
            self._claim_changed(namespace, name, "DELETED")
            del self.claims[key]
            self._deallocating.discard(key)

    def list_node_slices(self, node: str) -> list[dict[str, Any]]:
        self._call("list_node_slices", node)
        with self._lock:
            return [copy.deepcopy(s) for s in self.slices if s["spec"].get("nodeName") == node]

    def device_taint_rule_version(self) -> str | None:
        self._call("device_taint_rule_version")
        return next((v for v in TAINT_RULE_VERSIONS if v in self.served), None)

    def _check_version(self, version: str) -> None:
        if version not in self.served:
            raise NotFound(f"{names.RESOURCE_GROUP}/{version} devicetaintrules: HTTP 404: not served", 404)

    def create_device_taint_rule(self, version: str, rule: dict[str, Any]) -> None:
        self._call("create_device_taint_rule", version, rule)
        self._check_version(version)
        with self._lock:
            name = rule["metadata"]["name"]
            if name not in self.rules or not same_fence(self.rules[name], rule):
                stored = {
                    **copy.deepcopy(rule),
                    "apiVersion": f"{names.RESOURCE_GROUP}/{version}",
                    "kind": "DeviceTaintRule",
                }
                self._bump(stored)
                self.rules[name] = stored

    def delete_device_taint_rule(self, version: str, name: str) -> None:
        self._call("delete_device_taint_rule", version, name)
        self._check_version(version)
        with self._lock:
            self.rules.pop(name, None)

    def get_node(self, name: str) -> dict[str, Any]:
        self._call("get_node", name)
        with self._lock:
            if name not in self.nodes:
                raise NotFound(f"GET node {name}: HTTP 404", 404)
            return copy.deepcopy(self.nodes[name])

    def patch_node(self, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        self._call("patch_node", name, ops)
        with self._lock:
            if name not in self.nodes:
                raise NotFound(f"PATCH node {name}: HTTP 404", 404)
            patched = self._patch(self.nodes[name], ops, f"node {name}")
            self._bump(patched)
            self.nodes[name] = patched
            return copy.deepcopy(patched)

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        self._call("create_event", namespace, event)
        with self._lock:
            self.events.append(copy.deepcopy(event))

    # ---------------------------------------------------------------- what the rest of the cluster does

    def add_node(self, name: str) -> dict[str, Any]:
        with self._lock:
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "uid": str(uuidlib.uuid4())},
                "spec": {},
            }
            self._bump(node)
            self.nodes[name] = node
            return node

    def add_slice(
        self,
        node: str,
        driver: str,
        pool: str,
        devices: dict[str, dict[str, str]],
        counters: dict[str, tuple[str, list[int]]] | None = None,
    ) -> None:
        """A ResourceSlice (v1 shape) with `devices` {name: {attribute: string value}}; `counters` {name:
        (counter set, memory slices)}: what each device consumes, as NVIDIA's driver publishes dynamic MIG."""
        consumes = {
            name: [{"counterSet": counter_set, "counters": {f"memory-slice-{i}": {"value": "1"} for i in slices}}]
            for name, (counter_set, slices) in (counters or {}).items()
        }
        with self._lock:
            self.slices.append(
                {
                    "apiVersion": f"{names.RESOURCE_GROUP}/v1",
                    "kind": "ResourceSlice",
                    "metadata": {"name": f"{node}-{driver}-{len(self.slices)}"},
                    "spec": {
                        "driver": driver,
                        "nodeName": node,
                        "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                        "devices": [
                            {
                                "name": n,
                                "attributes": {k: {"string": v} for k, v in attrs.items()},
                                **({"consumesCounters": consumes[n]} if n in consumes else {}),
                            }
                            for n, attrs in devices.items()
                        ],
                    },
                }
            )

    def add_claim(
        self,
        namespace: str,
        name: str,
        devices: list[tuple[str, str, str]],
        *,
        finalizer: bool = True,
        annotations: dict[str, str] | None = None,
        admin_access: bool = False,
        labelled: bool = True,
    ) -> dict[str, Any]:
        """An allocated ResourceClaim (as the scheduler leaves it), with the webhook's finalizer unless not
        `finalizer`, and the label of its devices' node (their pool, as NVIDIA's driver names it) unless not
        `labelled` (scrubgate's controller has not labelled it, nor an agent)."""
        with self._lock:
            claim: dict[str, Any] = {
                "apiVersion": f"{names.RESOURCE_GROUP}/v1",
                "kind": "ResourceClaim",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": str(uuidlib.uuid4()),
                    "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    # kube-scheduler adds delete-protection with the allocation; the controller removes it after.
                    "finalizers": [
                        *([names.FINALIZER] if finalizer else []),
                        *([names.DELETE_PROTECTION_FINALIZER] if devices else []),
                    ],
                },
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [
                                {
                                    "request": "gpu",
                                    "driver": d,
                                    "pool": p,
                                    "device": v,
                                    **({"adminAccess": True} if admin_access else {}),
                                }
                                for d, p, v in devices
                            ]
                        }
                    },
                    "reservedFor": [],
                },
            }
            if annotations:
                claim["metadata"]["annotations"] = dict(annotations)
            if labelled and devices:
                claim["metadata"]["labels"] = {names.LABEL_NODE: devices[0][1]}
            self._bump(claim)
            self.claims[(namespace, name)] = claim
            self._claim_changed(namespace, name, "ADDED")
            return copy.deepcopy(claim)

    def add_pod(self, namespace: str, name: str, node: str, claims: list[str]) -> dict[str, Any]:
        """A running pod bound to `node` using `claims` (as generated claims), which get reserved for it."""
        with self._lock:
            uid = str(uuidlib.uuid4())
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "uid": uid},
                "spec": {
                    "nodeName": node,
                    "resourceClaims": [{"name": f"c{i}", "resourceClaimTemplateName": "t"} for i in range(len(claims))],
                },
                "status": {
                    "phase": "Running",
                    "resourceClaimStatuses": [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)],
                },
            }
            for claim_name in claims:
                claim = self.claims[(namespace, claim_name)]
                claim["status"]["reservedFor"].append({"resource": "pods", "name": name, "uid": uid})
                self._bump(claim)
                self._claim_changed(namespace, claim_name)
            self._bump(pod)
            self.pods[uid] = pod
            self._notify("ADDED", pod)
            return copy.deepcopy(pod)

    def set_pod_phase(self, uid: str, phase: str) -> dict[str, Any]:
        with self._lock:
            pod = self.pods[uid]
            pod["status"]["phase"] = phase
            self._bump(pod)
            self._notify("MODIFIED", pod)
            return copy.deepcopy(pod)

    def delete_pod(self, uid: str) -> dict[str, Any]:
        with self._lock:
            pod = self.pods.pop(uid)
            self._notify("DELETED", pod)
            return copy.deepcopy(pod)

    def deallocate(self, namespace: str, name: str, *, bypass: bool = False) -> bool:
        """What kube-controller-manager's resourceclaim controller does once a claim's pods have ended
        (pkg/controller/resourceclaim/controller.go, syncClaim), through the webhook: drop them from its reservation
        and clear the allocation once nobody is left, where the `guard` lets it (else it is retried at the claim's
        next change). While a node agent holds the claim, /mutate (kept_consumers_patch) puts a record of each ended
        pod in its place (on a claim being deleted, the drop goes through) until the claim carries the attestation,
        and then makes the drop the release: holds, records, pods and allocation go in the controller's write. `bypass`: the guard is not asked (a webhook bypassed or
        uninstalled, whoever clears the allocation then clears every consumer with it). Returns whether the
        allocation went."""
        with self._lock:
            key = (namespace, name)
            claim = self.claims[key]
            status = claim.setdefault("status", {})
            reserved = status.get("reservedFor") or []
            kept = [c for c in reserved if c.get("resource") != "pods" or c.get("apiGroup")]
            holds_only = all(c.get("apiGroup") == names.RESERVATION_GROUP for c in kept)
            released = holds_only and len(kept) < len(reserved) and self.guard is not None
            if kept and not bypass and not (released and self.guard(copy.deepcopy(claim))):
                # Held, not yet attested (or reserved for something the controller does not drop): /mutate puts
                # a record of each ended pod in its place (on a claim being deleted, which takes no new entry, the
                # drop goes through as it is); the controller has nothing left to drop until the agent's release.
                held = any(c.get("resource") == names.RESERVATION_RESOURCE for c in kept)
                if held and len(kept) < len(reserved):
                    deleting = claim["metadata"].get("deletionTimestamp")
                    status["reservedFor"] = [
                        c if c in kept else ended_pod_entry(c) for c in reserved if c in kept or not deleting
                    ]
                    self._bump(claim)
                    self._claim_changed(namespace, name)
                self._deallocating.add(key)
                return False
            allocated = status.get("allocation")
            if not bypass and self.guard is not None and allocated and not self.guard(copy.deepcopy(claim)):
                self.refused_deallocations += 1
                self._deallocating.add(key)
                return False
            self._deallocating.discard(key)
            claim["status"] = {}
            finalizers = claim["metadata"].get("finalizers") or []
            claim["metadata"]["finalizers"] = [f for f in finalizers if f != names.DELETE_PROTECTION_FINALIZER]
            self._bump(claim)
            self._claim_changed(namespace, name)
            self._settle_claim(namespace, name)
            return True

    def delete_claim(self, namespace: str, name: str) -> None:
        with self._lock:
            claim = self.claims[(namespace, name)]
            if claim["metadata"].get("finalizers"):
                claim["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
                self._bump(claim)
                self._claim_changed(namespace, name)
            else:
                self._claim_changed(namespace, name, "DELETED")
                del self.claims[(namespace, name)]

    def taints_on(self, driver: str, pool: str, device: str) -> list[str]:
        """Taint keys the DeviceTaintRules put on one device."""
        with self._lock:
            return sorted(
                r["spec"]["taint"]["key"]
                for r in self.rules.values()
                if r["spec"]["deviceSelector"] == {"driver": driver, "pool": pool, "device": device}
            )

    def node_taints(self, node: str) -> list[str]:
        with self._lock:
            return sorted(t["key"] for t in self.nodes[node]["spec"].get("taints") or [])
