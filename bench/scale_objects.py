"""The objects bench/scale.py writes for each node of its cluster: what a kubelet, NVIDIA's DRA driver and
kube-scheduler would have made of a busy GPU node, without any of them running.

A node without a kubelet is its Node object and its driver's ResourceSlices (devcluster.driver's shape: the
names, attributes and counter sets NVIDIA's driver publishes). Every leaf device (each GPU, or with MIG each
MIG slice) has a claim allocated on it and a pod bound to the node that holds it: the pod is created with
`spec.nodeName` (as the scheduler's binding leaves it), the claim's status gets the allocation and the pod in
`reservedFor` (as the scheduler writes them). The pods tolerate the taints a node without a kubelet gets, so
that neither the node lifecycle controller nor taint eviction touches them.
"""

from __future__ import annotations

import uuid
from typing import Any

from scrubgate.sanitizer_agent.gpu.base import GpuDevice

from devcluster import driver
from devcluster.fakenode import NODE_TAINTS

REQUEST = "gpu"
MEMORY = 80 << 30  # what each simulated GPU reports; the figure does not matter here


def devices(gpus: int, mig_per_gpu: int) -> list[GpuDevice]:
    """A node's GPUs (and their MIG slices) as the simulated backend lists them, each with a fresh UUID."""
    out: list[GpuDevice] = []
    for i in range(gpus):
        parent = f"GPU-{uuid.uuid4()}"
        out.append(GpuDevice(parent, i, "Simulated H200", None, MEMORY, 0, MEMORY))
        out += [
            GpuDevice(f"MIG-{uuid.uuid4()}", m, "Simulated H200 MIG slice", parent, MEMORY // 8, 0, MEMORY // 8)
            for m in range(mig_per_gpu)
        ]
    return out


def node_object(name: str) -> dict[str, Any]:
    """The Node a kubelet registers, room for every pod the bench binds to it."""
    resources = {"cpu": "128", "memory": "2Ti", "pods": "256"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
        "status": {"capacity": resources, "allocatable": resources},
    }


def leaf_devices(slices: list[dict[str, Any]], mig: bool) -> list[str]:
    """The devices of a node's slices that get a claim each: the MIG slices with `mig`, else the whole GPUs."""
    wanted = "mig" if mig else "gpu"
    return sorted(
        d["name"]
        for s in slices
        for d in (s.get("spec") or {}).get("devices") or []
        if ((d.get("attributes") or {}).get("type") or {}).get("string") == wanted
    )


def device_class(mig: bool) -> str:
    return "mig.nvidia.com" if mig else "gpu.nvidia.com"


def claim(name: str, namespace: str, mig: bool, labels: dict[str, str]) -> dict[str, Any]:
    request = {"name": REQUEST, "exactly": {"deviceClassName": device_class(mig)}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {"devices": {"requests": [request]}},
    }


def pod(name: str, namespace: str, node_name: str, claim_name: str) -> dict[str, Any]:
    """A pod bound to `node_name` using `claim_name`, tolerating the taints of a node without a kubelet."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": node_name,
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {"name": "cuda", "image": "nvcr.io/nvidia/cuda:12.6.0-base", "resources": {"claims": [{"name": "gpu"}]}}
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
            "tolerations": [{"key": key, "operator": "Exists"} for key in NODE_TAINTS],
        },
    }


def allocated(created: dict[str, Any], node_name: str, device: str, pod_name: str, pod_uid: str) -> dict[str, Any]:
    """The claim as kube-scheduler leaves it: `device` of the node's pool allocated, reserved for the pod."""
    out = {**created, "status": dict(created.get("status") or {})}
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
    out["status"]["allocation"] = {
        "devices": {"results": [{"request": REQUEST, "driver": driver.DRIVER, "pool": node_name, "device": device}]},
        "nodeSelector": {"nodeSelectorTerms": [term]},
    }
    out["status"]["reservedFor"] = [{"resource": "pods", "name": pod_name, "uid": pod_uid}]
    return out
