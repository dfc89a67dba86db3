"""Reading pods, ResourceClaims and ResourceSlices, and building the agent's patches: plain functions on
the dicts the API returns (resource.k8s.io v1, v1beta2 and v1beta1 shapes alike)."""

from __future__ import annotations

import json
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from scrubgate.policies import names
from scrubgate.policies.attestation import is_ended_pod_record
from scrubgate.policies.node_label import node_label
from scrubgate.policies.release_guard import claim_nodes

from .gpu.base import MigPlacement
from .partitions import Partition, partition_of, placement_of

DeviceKey = tuple[str, str, str]  # (driver, pool, device)

# NVIDIA's DRA driver publishes every GPU under this driver name; its `type` attribute tells a GPU or MIG
# device (memory the agent scrubs through NVML and CUDA) from a GPU bound to vfio-pci for passthrough (no
# NVML, no CUDA: the agent cannot reach its memory). ComputeDomain channels come from another driver.
GPU_DRIVER = "gpu.nvidia.com"
SCRUBBABLE_TYPES = frozenset({"gpu", "mig"})


@dataclass(frozen=True)
class SliceDevice:
    """A device this node publishes: its GPU UUID and, for a MIG device, the parent GPU's; `type` as NVIDIA's
    driver publishes it (`gpu`, `mig`, `vfio`), None where the slice has none."""

    uuid: str | None
    parent_uuid: str | None
    type: str | None = None
    # Partitionable devices (dynamic MIG): the memory slices it consumes, and where a MIG device not
    # created yet would live (see partitions.py).
    partition: Partition | None = None
    placement: MigPlacement | None = None
    # `allowMultipleAllocations` (KEP-5075, consumable capacity): several claims may be allocated it at once.
    shared: bool = False


def unscrubbable(key: DeviceKey, device: SliceDevice) -> str | None:
    """Why the agent cannot scrub this device of its node, or None when it can."""
    if key[0] != GPU_DRIVER:
        return f"driver {key[0]} is not NVIDIA's GPU driver ({GPU_DRIVER}): no GPU memory the agent can reach"
    if device.type is not None and device.type not in SCRUBBABLE_TYPES:
        return f"type {device.type} (a GPU bound to vfio-pci for passthrough): NVML and CUDA cannot reach its memory"
    if not device.uuid and device.placement is None:
        return "no uuid attribute and no MIG placement in this node's ResourceSlices: the agent cannot tell which GPU it is"
    return None


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def key_str(key: DeviceKey) -> str:
    return "/".join(key)


def parse_device_ref(text: str) -> DeviceKey | None:
    """`driver/pool/device` as an operator types it; None when it is not three non-empty parts.
    (Pool names may contain slashes; driver and device names cannot.)"""
    driver, _, rest = text.partition("/")
    pool, _, device = rest.rpartition("/")
    return (driver, pool, device) if driver and pool and device else None


# ---------------------------------------------------------------- pods


def pod_claim_names(pod: dict[str, Any]) -> list[str]:
    """Names of the ResourceClaims a pod uses: the ones it names, the ones generated for it from templates
    (`status.resourceClaimStatuses`, filled in by the resourceclaim controller), and the one the scheduler
    created for its extended resources (`nvidia.com/gpu`, KEP-5004: `status.extendedResourceClaimStatus`, one
    object; such a pod has no `spec.resourceClaims`)."""
    status = _dict(pod.get("status"))
    entries = [
        *_list(_dict(pod.get("spec")).get("resourceClaims")),
        *_list(status.get("resourceClaimStatuses")),
        status.get("extendedResourceClaimStatus"),
    ]
    found: list[str] = []
    for entry in entries:
        name = _dict(entry).get("resourceClaimName")
        if isinstance(name, str) and name:
            found.append(name)
    return list(dict.fromkeys(found))


def pod_finished(pod: dict[str, Any]) -> bool:
    return _dict(pod.get("status")).get("phase") in ("Succeeded", "Failed")


# ---------------------------------------------------------------- claims


def allocated_devices(claim: dict[str, Any]) -> list[DeviceKey]:
    results = _list(_dict(_dict(_dict(claim.get("status")).get("allocation")).get("devices")).get("results"))
    keys = []
    for result in results:
        r = _dict(result)
        if all(isinstance(r.get(k), str) and r.get(k) for k in ("driver", "pool", "device")):
            keys.append((r["driver"], r["pool"], r["device"]))
    return list(dict.fromkeys(keys))


def holds_devices(claim: dict[str, Any] | None, uid: str, keys: Iterable[DeviceKey]) -> bool:
    """Whether the claim (still the one of this UID) is allocated every device of `keys`: then its allocation
    keeps them from other claims."""
    return claim is not None and _meta(claim).get("uid") == uid and set(keys) <= set(allocated_devices(claim))


def unheld_devices(
    claim: dict[str, Any], keys: Iterable[DeviceKey], slices: Mapping[DeviceKey, SliceDevice]
) -> list[str]:
    """Why the claim's allocation does not keep some of `keys` from other claims: a device allocated with admin
    access (the scheduler allocates it to other claims beside it) or one several claims may be allocated at once
    (`allowMultipleAllocations`, a shared allocation)."""
    wanted = set(keys)
    found = []
    results = _list(_dict(_dict(_dict(claim.get("status")).get("allocation")).get("devices")).get("results"))
    for result in results:
        r = _dict(result)
        key = (r.get("driver"), r.get("pool"), r.get("device"))
        if key not in wanted:
            continue
        if r.get("adminAccess") is True:
            found.append(f"{key_str(key)} is allocated with admin access, beside which other claims may get it")
        elif r.get("shareID") or (key in slices and slices[key].shared):
            found.append(f"{key_str(key)} may be allocated to several claims at once")
    return list(dict.fromkeys(found))


def recorded_devices(claim: dict[str, Any]) -> list[tuple[DeviceKey, str | None]]:
    """The agent's own record in the `scrubgate.dev/devices` annotation (kept after the allocation is gone);
    an unreadable annotation yields nothing here (the attestation check reports it)."""
    raw = _dict(_meta(claim).get("annotations")).get(names.ANNOTATION_DEVICES)
    try:
        entries = json.loads(raw) if isinstance(raw, str) else []
    except json.JSONDecodeError:
        return []
    found = []
    for entry in _list(entries):
        e = _dict(entry)
        if all(isinstance(e.get(k), str) and e.get(k) for k in ("driver", "pool", "device")):
            uuid = e.get("uuid")
            found.append(((e["driver"], e["pool"], e["device"]), uuid if isinstance(uuid, str) and uuid else None))
    return found


def created_at(obj: dict[str, Any]) -> float | None:
    """`metadata.creationTimestamp` as unix time; None when absent or unreadable."""
    stamp = _meta(obj).get("creationTimestamp")
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if isinstance(stamp, str) else None
    except ValueError:
        return None


def scrub_status(claim: dict[str, Any]) -> str | None:
    value = _dict(_meta(claim).get("annotations")).get(names.ANNOTATION_SCRUB_STATUS)
    return value if isinstance(value, str) else None


def release_reason(claim: dict[str, Any] | None, uid: str, ended: Container[str]) -> str | None:
    """Why the claim no longer holds its devices, or None while it does.

    Released: the claim is gone (or replaced by a new one of that name), deallocated, reserved for nobody,
    or reserved only for consumers that have ended (`ended`: UIDs of pods terminal or deleted, and of other
    consumers, a PodGroup, deleted). A record of an ended pod counts as that pod, known ended only by its UID. A claim being deleted is not released by that: the
    API server only stops new reservations, and the pods already reserved keep running on its devices.
    """
    if claim is None:
        return "claim deleted"
    meta = _meta(claim)
    if meta.get("uid") != uid:
        return "claim deleted (a new claim now has its name)"
    status = _dict(claim.get("status"))
    if not status.get("allocation"):
        return "allocation cleared"
    # A node agent's hold is no consumer of the devices: it keeps the claim held until the attested release.
    consumers = [c for c in map(_dict, _list(status.get("reservedFor"))) if not _is_hold(c)]
    if not consumers:
        return "no longer reserved for any pod"
    if all(c.get("uid") in ended for c in consumers):
        if all((c.get("resource") == "pods" and not c.get("apiGroup")) or is_ended_pod_record(c) for c in consumers):
            return f"pod {', '.join(str(c.get('name')) for c in consumers)} terminal or deleted"
        return f"{', '.join(_consumer(c) for c in consumers)} ended or deleted"
    return None


def _consumer(ref: dict[str, Any]) -> str:
    resource = f"{ref.get('resource')}.{ref.get('apiGroup')}" if ref.get("apiGroup") else str(ref.get("resource"))
    return f"{resource} {ref.get('name')}"


def annotation_ops(claim: dict[str, Any], updates: dict[str, str]) -> list[dict[str, Any]]:
    """JSON patch setting `updates` on the claim, guarded by its UID. Where the claim has no annotations
    yet, the map is added whole, guarded by a test that it still has none, so that no concurrent writer's key is
    lost."""
    meta = _meta(claim)
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": meta.get("uid")}]
    if isinstance(meta.get("annotations"), dict):
        ops += [{"op": "add", "path": f"/metadata/annotations/{_escape(k)}", "value": v} for k, v in updates.items()]
    else:
        ops += added_whole("/metadata/annotations", dict(updates))
    return ops


def added_whole(path: str, value: Any) -> list[dict[str, Any]]:
    """JSON patch adding a map or list that the object does not have, failing if a concurrent writer added it
    meanwhile. kube-apiserver's JSON patch (evanphx/json-patch, `test`) passes a test of null on a missing path;
    a test of the resourceVersion instead would fail on any other write since the read (the resourceclaim
    controller's, the garbage collector's), each failure costing a read and a second patch."""
    return [{"op": "test", "path": path, "value": None}, {"op": "add", "path": path, "value": value}]


def _is_hold(entry: dict[str, Any], node: str | None = None) -> bool:
    """Whether a `status.reservedFor` entry is a node agent's hold (of `node`'s agent, where given)."""
    return (
        entry.get("apiGroup") == names.RESERVATION_GROUP
        and entry.get("resource") == names.RESERVATION_RESOURCE
        and node in (None, entry.get("name"))
    )


def hold_entry(node: str, uid: str) -> dict[str, str]:
    """A node agent's hold on a claim, as a `status.reservedFor` consumer."""
    return {"apiGroup": names.RESERVATION_GROUP, "resource": names.RESERVATION_RESOURCE, "name": node, "uid": uid}


def node_hold(claim: dict[str, Any], node: str) -> str | None:
    """The UID of `node`'s agent's hold on the claim, if it has one."""
    for entry in map(_dict, _list(_dict(claim.get("status")).get("reservedFor"))):
        if _is_hold(entry, node) and isinstance(entry.get("uid"), str):
            return entry["uid"]
    return None


def hold_ops(claim: dict[str, Any], node: str, uid: str) -> list[dict[str, Any]] | None:
    """JSON patch of the claim's status adding `node`'s hold, guarded by the claim's UID and, while the claim is
    reserved for nobody, a test that it still is (no consumer of a concurrent writer lost); None when it has it, or
    the claim cannot take it (not allocated: nothing to hold; being deleted: the API server refuses new
    consumers then)."""
    meta, status = _meta(claim), _dict(claim.get("status"))
    if node_hold(claim, node) is not None or not status.get("allocation") or meta.get("deletionTimestamp"):
        return None
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": meta.get("uid")}]
    entry = hold_entry(node, uid)
    if isinstance(status.get("reservedFor"), list):
        return [*ops, {"op": "add", "path": "/status/reservedFor/-", "value": entry}]
    return [*ops, *added_whole("/status/reservedFor", [entry])]


def hold_release_ops(claim: dict[str, Any], node: str) -> list[dict[str, Any]] | None:
    """JSON patch of the claim's status removing `node`'s hold and the records of ended pods (which the attestation
    covers), on the claim as read; and the allocation with them where nothing else is left and Kubernetes'
    delete-protection finalizer is on the claim: the deallocation the resourceclaim controller makes when the last
    consumer goes (syncClaim, v1.37), which it does not make here, as it never sees that transition (holds and
    records are not its to drop). None when the claim has no hold of `node`'s."""
    status = _dict(claim.get("status"))
    reserved = _list(status.get("reservedFor"))
    if node_hold(claim, node) is None:
        return None
    left = [e for e in reserved if not _is_hold(_dict(e), node) and not is_ended_pod_record(_dict(e))]
    # The resourceVersion too: kube-apiserver applies a patch to the object in its watch cache first, and on a stale
    # one the webhook would see no attestation yet, refuse (and audit) before the API server retries with the stored
    # object. A failing test stops it before admission.
    ops = [
        {"op": "test", "path": "/metadata/uid", "value": _meta(claim).get("uid")},
        {"op": "test", "path": "/metadata/resourceVersion", "value": _meta(claim).get("resourceVersion")},
        {"op": "test", "path": "/status/reservedFor", "value": reserved},
        {"op": "replace", "path": "/status/reservedFor", "value": left},
    ]
    protected = names.DELETE_PROTECTION_FINALIZER in _list(_meta(claim).get("finalizers"))
    if not left and protected and status.get("allocation"):
        ops.append({"op": "remove", "path": "/status/allocation"})
    return ops


def allocation_stamp(claim: dict[str, Any]) -> str | None:
    """The allocation's `allocationTimestamp` (the scheduler writes it in 1.37 with its binding-condition gates)."""
    stamp = _dict(_dict(claim.get("status")).get("allocation")).get("allocationTimestamp")
    return stamp if isinstance(stamp, str) and stamp else None


def finalizer_removal_ops(claim: dict[str, Any], attestation: str | None) -> list[dict[str, Any]] | None:
    """JSON patch removing `scrubgate.dev/sanitize`, failing if the claim changed since it was read (UID,
    allocation and consumers, finalizers, or the attestation it carries, unless None: a claim that never held a
    device, or a patch that writes the attestation itself); None when the finalizer is not there."""
    meta = _meta(claim)
    finalizers = _list(meta.get("finalizers"))
    if names.FINALIZER not in finalizers:
        return None
    attested = [
        {"op": "test", "path": f"/metadata/annotations/{_escape(names.ANNOTATION_ATTESTATION)}", "value": attestation}
    ]
    return [
        {"op": "test", "path": "/metadata/uid", "value": meta.get("uid")},
        *_as_read(claim),
        *(attested if attestation is not None else []),
        {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
        {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in finalizers if f != names.FINALIZER]},
    ]


def _as_read(claim: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON patch tests that what a release rests on is as read: the allocation. Not the consumers it is reserved
    for: the resourceclaim controller's drop of the ended pod (its record in the pod's place) lands while the scrub
    runs, nearly every time, and SG007 refuses the removal where a consumer since is one the attestation does not
    cover. Nor the resourceVersion: the garbage collector's delete of a generated claim, or the controller's writes,
    change it too; each such failure cost a read and a second patch. A claim holding no allocation (deleted before
    it held a device) is tested on its resourceVersion."""
    status = _dict(claim.get("status"))
    if status.get("allocation"):
        return [{"op": "test", "path": "/status/allocation", "value": status["allocation"]}]
    return [{"op": "test", "path": "/metadata/resourceVersion", "value": _meta(claim).get("resourceVersion")}]


def finalizer_addition_ops(claim: dict[str, Any]) -> list[dict[str, Any]] | None:
    """JSON patch adding `scrubgate.dev/sanitize`, failing if the claim's finalizers changed since it was read
    (where it has none, if one was added); None when it is there already, or the claim is being deleted (the
    API server refuses new finalizers then)."""
    meta = _meta(claim)
    finalizers = meta.get("finalizers")
    if (isinstance(finalizers, list) and names.FINALIZER in finalizers) or meta.get("deletionTimestamp"):
        return None
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": meta.get("uid")}]
    if isinstance(finalizers, list):
        return [
            *ops,
            {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
            {"op": "add", "path": "/metadata/finalizers/-", "value": names.FINALIZER},
        ]
    return [*ops, *added_whole("/metadata/finalizers", [names.FINALIZER])]


def node_label_ops(claim: dict[str, Any], node: str) -> list[dict[str, Any]] | None:
    """JSON patch labelling the claim with its node (`scrubgate.dev/node`, by which that node's agent lists and
    watches its claims), guarded by its UID and, where it has no labels yet, a test that it still has none; None
    when it has the label already."""
    meta = _meta(claim)
    if node_label(meta) == node:
        return None
    labels = meta.get("labels")
    ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": meta.get("uid")}]
    if isinstance(labels, dict):
        return [*ops, {"op": "add", "path": f"/metadata/labels/{_escape(names.LABEL_NODE)}", "value": node}]
    return [*ops, *added_whole("/metadata/labels", {names.LABEL_NODE: node})]


def own_node_label_ops(claim: dict[str, Any], node: str) -> list[dict[str, Any]] | None:
    """`node_label_ops` where the claim's allocation is on `node`, as an agent writes it (SG007 lets an agent label
    only a claim allocated on its own node: a label in any other write would have admission refuse that write)."""
    return node_label_ops(claim, node) if node in claim_nodes(claim) else None


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def devices_annotation(devices: Iterable[tuple[DeviceKey, str | None]]) -> str:
    return json.dumps(
        [{"driver": k[0], "pool": k[1], "device": k[2], "uuid": uuid} for k, uuid in devices],
        separators=(",", ":"),
    )


# ---------------------------------------------------------------- slices


def _string_attribute(attributes: dict[str, Any], driver: str, name: str) -> str | None:
    # Attribute names are unqualified (in the driver's domain) or qualified with the domain.
    for key in (name, f"{driver}/{name}"):
        value = _dict(attributes.get(key)).get("string")
        if isinstance(value, str) and value:
            return value
    return None


def slice_devices(slices: Iterable[dict[str, Any]]) -> dict[DeviceKey, SliceDevice]:
    """Every device in the slices, keyed (driver, pool, device), with the `uuid` and `parentUUID` NVIDIA's
    driver publishes (`{"string": "GPU-..."}`); v1/v1beta2 keep attributes on the device, v1beta1 under `basic`."""
    found: dict[DeviceKey, SliceDevice] = {}
    for resource_slice in slices:
        spec = _dict(resource_slice.get("spec"))
        driver, pool = spec.get("driver"), _dict(spec.get("pool")).get("name")
        if not isinstance(driver, str) or not isinstance(pool, str):
            continue
        for device in _list(spec.get("devices")):
            d = _dict(device)
            name = d.get("name")
            if not isinstance(name, str):
                continue
            attributes = _dict(d.get("attributes")) or _dict(_dict(d.get("basic")).get("attributes"))
            parent_uuid = _string_attribute(attributes, driver, "parentUUID")
            partition = partition_of(d)
            found[(driver, pool, name)] = SliceDevice(
                uuid=_string_attribute(attributes, driver, "uuid"),
                parent_uuid=parent_uuid,
                type=_string_attribute(attributes, driver, "type"),
                partition=partition,
                placement=placement_of(name, parent_uuid, partition),
                shared=(d.get("allowMultipleAllocations") or _dict(d.get("basic")).get("allowMultipleAllocations"))
                is True,
            )
    return found


def overlapping(key: DeviceKey, slices: Mapping[DeviceKey, SliceDevice]) -> list[DeviceKey]:
    """The devices in `slices` whose memory overlaps `key`'s: the GPU it is carved from (the one whose
    `uuid` is its `parentUUID`), the MIG devices carved from it (whose `parentUUID` is its `uuid`), and the
    partitionable devices consuming one of its memory slices (dynamic MIG placements that overlap).
    A MIG device not yet created may publish no `uuid` of its own, so children match on theirs alone."""
    device = slices.get(key)
    if device is None:
        return []
    return [
        other
        for other, d in slices.items()
        if other != key
        and (
            (device.parent_uuid and d.uuid == device.parent_uuid)
            or (device.uuid and d.parent_uuid == device.uuid)
            or (device.partition is not None and device.partition.overlaps(d.partition))
        )
    ]


# ---------------------------------------------------------------- events


def node_event(
    *,
    node: str,
    namespace: str,
    involved: dict[str, Any],
    reason: str,
    message: str,
    now: float,
    kind: str = "Warning",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A core/v1 Event of `kind` (Warning or Normal) about `involved` (a claim, or the Node when the claim is
    gone), from this node's agent."""
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # metav1.Time: whole seconds
    metadata: dict[str, Any] = {"generateName": "scrubgate-agent-", "namespace": namespace}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": metadata,
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": kind,
        "source": {"component": "scrubgate-agent", "host": node},
        "reportingComponent": "scrubgate.dev/agent",
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
