"""Nodes without a kubelet, and devices shaped as real DRA drivers publish them: what kube-scheduler allocates
from in the differential test of DeviceClass verdicts (tests/test_e2e_device_classes.py).

A Node here is what a kubelet would register, minus the kubelet: kube-scheduler places pods on it and allocates
their claims from the ResourceSlices published for it, and nothing ever runs them. Each device is one of
`SHAPES`, every attribute and capacity its upstream driver sets, so that a selector kube-scheduler evaluates on it
gives what it would give on a real node (a lookup of an attribute the device lacks is a CEL runtime error, which
aborts the allocation on that node). Device names are each driver's own (`gpu-<minor>`,
`gpu-<minor>-mig-<profile>-<profileId>-<placement>`, `gpu-vfio-<index>`, `channel-<id>`, a NIC's PCI address).

A test double, not part of scrubgate (see devcluster/README.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

NVIDIA = "gpu.nvidia.com"
COMPUTE_DOMAIN = "compute-domain.nvidia.com"
DRANET = "dra.net"
INTEL_GPU = "gpu.intel.com"
STANDARD = "resource.kubernetes.io"  # k8s.io/dynamic-resource-allocation/deviceattribute: pciBusID, pcieRoot, ...

# The taints a Node without a kubelet carries: TaintNodesByCondition's not-ready at creation, then the node
# lifecycle controller's unreachable. A pinned pod tolerates them (none is one of scrubgate's).
NODE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


@dataclass(frozen=True, eq=False)  # a constant: the same shape is the same object
class Shape:
    """One device as its driver publishes it: `entry` is the ResourceSlice's device (v1 shape)."""

    variant: str
    driver: str
    entry: dict[str, Any]

    @property
    def type(self) -> str:
        """The `type` attribute in the driver's own domain ("" where the driver sets none)."""
        attribute = self.entry["attributes"].get("type") or {}
        return str(attribute.get("string", ""))


def _strings(**values: str) -> dict[str, dict[str, str]]:
    return {name: {"string": value} for name, value in values.items()}


def _pci(bus_id: str, root: str | None, numa: int | None) -> dict[str, dict[str, Any]]:
    """The standard attributes (deviceattribute.GetPCIBusIDAttribute, GetPCIeRootAttributeByPCIBusID,
    addNumaNodeAttribute): the PCIe root and NUMA node only where the host reports them."""
    out: dict[str, dict[str, Any]] = {f"{STANDARD}/pciBusID": {"string": bus_id}}
    if root is not None:
        out[f"{STANDARD}/pcieRoot"] = {"string": root}
    if numa is not None:
        out[f"{STANDARD}/numaNode"] = {"int": numa}
    return out


@dataclass(frozen=True)
class _Gpu:
    """A physical GPU as GpuInfo holds it (cmd/gpu-kubelet-plugin/deviceinfo.go, nvlib.go)."""

    minor: int
    uuid: str
    product: str
    architecture: str
    compute_capability: str
    memory: str
    bus_id: str
    pcie_root: str | None = None
    numa: int | None = None
    addressing_mode: str | None = None  # coherent-memory systems only
    module_id: int | None = None  # Fabric Manager attributes (FabricManagerPartitioning)

    def attributes(self) -> dict[str, dict[str, Any]]:
        """GpuInfo.Attributes(); `type` and `uuid` are the caller's (a MIG device has its own)."""
        out: dict[str, dict[str, Any]] = _strings(productName=self.product, brand="Nvidia")
        out["architecture"] = {"string": self.architecture}
        out["cudaComputeCapability"] = {"version": self.compute_capability}
        out["driverVersion"] = {"version": "580.95.5"}  # semver.MustParse("580.95.05").String()
        out["cudaDriverVersion"] = {"version": "13.0.0"}
        out.update(_pci(self.bus_id, self.pcie_root, self.numa))
        if self.addressing_mode is not None:
            out["addressingMode"] = {"string": self.addressing_mode}
        if self.module_id is not None:
            out["gpuModuleID"] = {"int": self.module_id}
            out["partition4"] = {"int": 0}
        return out


H100 = _Gpu(0, "GPU-4c9d1f6e-0b1a-4f0e-9a57-2f1d3c0e8a11", "NVIDIA H100 80GB HBM3", "Hopper", "9.0.0", "80Gi",
            "0000:1b:00.0", pcie_root="pci0000:16", numa=0)  # fmt: skip
GH200 = _Gpu(1, "GPU-9e2a7b33-51c4-4d8e-b0f2-6a4c1d9e7f20", "NVIDIA GH200 480GB", "Hopper", "9.0.0", "96Gi",
             "0009:01:00.0", pcie_root="pci0009:00", numa=1, addressing_mode="ATS", module_id=1)  # fmt: skip
A100 = _Gpu(2, "GPU-1f0e3d2c-7a6b-4c5d-8e9f-0a1b2c3d4e5f", "NVIDIA A100-SXM4-40GB", "Ampere", "8.0.0", "40Gi",
            "0000:4f:00.0")  # fmt: skip


def _gpu(gpu: _Gpu, *, shared: bool = False) -> dict[str, Any]:
    """GpuInfo.GetDevice(); `shared`: with consumable shares (applyConsumableShares, consumable_shares.go,
    mode "unlimited"): allowMultipleAllocations, and a memory capacity any claim may take a share of."""
    memory: dict[str, Any] = {"value": gpu.memory}
    if shared:
        policy = {"min": "0", "max": gpu.memory, "step": "1Mi"}
        memory["requestPolicy"] = {"default": "0", "validRange": policy}
    entry: dict[str, Any] = {
        "name": f"gpu-{gpu.minor}",
        "attributes": {**_strings(type="gpu", uuid=gpu.uuid), **gpu.attributes()},
        "capacity": {"memory": memory},
    }
    if shared:
        entry["allowMultipleAllocations"] = True
    return entry


def _mig(parent: _Gpu, profile: str, profile_id: int, placement: int, size: int, memory: str, uuid: str) -> dict:
    """MigDeviceInfo.GetDevice(): CommonAttributesMig (mig.go) of its parent, its own uuid, CommonCapacitiesMig
    and one memorySlice<i> capacity per slice it covers."""
    capacity = {
        name: {"value": str(value)}
        for name, value in (
            ("multiprocessors", 16 * size),
            ("copyEngines", size),
            ("decoders", size),
            ("encoders", 0),
            ("jpegEngines", size),
            ("ofaEngines", 0),
        )
    }
    capacity["memory"] = {"value": memory}
    capacity.update({f"memorySlice{i}": {"value": "1"} for i in range(placement, placement + size)})
    attributes = {**_strings(type="mig", parentUUID=parent.uuid, profile=profile), **parent.attributes()}
    attributes["uuid"] = {"string": uuid}
    name = f"gpu-{parent.minor}-mig-{profile.replace('.', '')}-{profile_id}-{placement}"
    return {"name": name, "attributes": attributes, "capacity": capacity}


def _vfio(index: int, gpu: _Gpu, product: str) -> dict[str, Any]:
    """VfioDeviceInfo.GetDevice(): a GPU bound to vfio-pci, named by the PCI database, not NVML."""
    attributes: dict[str, dict[str, Any]] = _strings(
        type="vfio", uuid=gpu.uuid, deviceID="0x2330", vendorID="0x10de", productName=product
    )
    attributes["iommuFDEnabled"] = {"bool": False}
    attributes.update(_pci(gpu.bus_id, gpu.pcie_root, gpu.numa))
    return {"name": f"gpu-vfio-{index}", "attributes": attributes, "capacity": {"addressableMemory": {"value": "80Gi"}}}


def _channel(kind: str, index: int) -> dict[str, Any]:
    """cmd/compute-domain-kubelet-plugin/deviceinfo.go: an IMEX channel or a ComputeDomain daemon."""
    return {"name": f"{kind}-{index}", "attributes": {"type": {"string": kind}, "id": {"int": index}}}


def _nic() -> dict[str, Any]:
    """A ConnectX-7 port as dranet publishes it (pkg/inventory/db.go, pkg/apis/attributes.go: attributes in the
    dra.net domain, plus the standard pcieRoot and numaNode), on the H100's PCIe root."""
    values: dict[str, Any] = {
        "ifName": "ens1f0np0", "pciAddress": "0000:1c:00.0", "mac": "b8:3f:d2:0a:11:2c", "mtu": 9000,
        "encapsulation": "ether", "alias": "", "state": "up", "type": "device", "ebpf": False, "sriov": True,
        "sriovVfs": 8, "virtual": False, "rdma": True, "rdmaDevice": "mlx5_0", "numaNode": 0,
        "pciVendor": "Mellanox Technologies", "pciDevice": "MT2910 Family [ConnectX-7]",
    }  # fmt: skip
    kinds = {str: "string", bool: "bool", int: "int"}
    attributes = {f"{DRANET}/{name}": {kinds[type(value)]: value} for name, value in values.items()}
    attributes[f"{STANDARD}/pcieRoot"] = {"string": "pci0000:16"}
    attributes[f"{STANDARD}/numaNode"] = {"int": 0}
    return {"name": "pci-0000-1c-00-0", "attributes": attributes}


def _intel_gpu() -> dict[str, Any]:
    """An Intel GPU as intel-resource-drivers-for-kubernetes publishes it (cmd/kubelet-gpu-plugin/
    node_state.go): another vendor's device whose `type` is "gpu" too."""
    attributes: dict[str, dict[str, Any]] = _strings(
        model="Data Center GPU Max 1550", family="Data Center GPU Max", driver="xe", type="gpu",
        pciId="0x0bd5", pciAddress="0000:3a:00.0", health="Healthy", pciRoot="39",
    )  # fmt: skip
    attributes["sriov"] = {"bool": True}
    attributes[f"{STANDARD}/pcieRoot"] = {"string": "pci0000:39"}
    attributes[f"{STANDARD}/pciBusID"] = {"string": "0000:3a:00.0"}
    capacity = {"memory": {"value": "128Gi"}, "millicores": {"value": "1000"}}
    return {"name": "card0-0000-3a-00-0", "attributes": attributes, "capacity": capacity}


SHAPES: tuple[Shape, ...] = (
    Shape("nvidia-gpu", NVIDIA, _gpu(H100)),
    Shape("nvidia-gpu-shared", NVIDIA, _gpu(GH200, shared=True)),
    Shape("nvidia-gpu-bare", NVIDIA, _gpu(A100)),
    Shape("nvidia-mig", NVIDIA, _mig(H100, "1g.10gb", 19, 0, 1, "9856Mi", "MIG-0b7c8d2e-3f4a-5b6c-8d9e-0f1a2b3c4d5e")),
    Shape("nvidia-mig-bare", NVIDIA, _mig(A100, "3g.20gb", 9, 4, 4, "19968Mi", "MIG-7e6d5c4b-3a29-4180-9f8e-7d6c5b4a3921")),
    Shape("nvidia-vfio", NVIDIA, _vfio(0, H100, "GH100 [H100 SXM5 80GB]")),
    Shape("imex-channel", COMPUTE_DOMAIN, _channel("channel", 0)),
    Shape("imex-daemon", COMPUTE_DOMAIN, _channel("daemon", 0)),
    Shape("nic", DRANET, _nic()),
    Shape("intel-gpu", INTEL_GPU, _intel_gpu()),
)  # fmt: skip
BY_VARIANT = {shape.variant: shape for shape in SHAPES}


def node(name: str) -> dict[str, Any]:
    """A Node as a kubelet registers it (devcluster/kubelet.py), status included: room for a few pods."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "16"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
        "status": {"capacity": resources, "allocatable": resources},
    }


def resource_slices(node_name: str, shapes: Iterable[Shape]) -> list[dict[str, Any]]:
    """The node's pools: one per driver, named after the node as NVIDIA's driver names its pool, one slice each."""
    by_driver: dict[str, list[dict[str, Any]]] = {}
    for shape in shapes:
        by_driver.setdefault(shape.driver, []).append(shape.entry)
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node_name}-{driver}"},
            "spec": {
                "driver": driver,
                "nodeName": node_name,
                "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        }
        for driver, devices in by_driver.items()
    ]


def shape_of(driver: str, device: str) -> Shape | None:
    """The shape an allocation result names (driver and device name; the pool is the node)."""
    return next((s for s in SHAPES if s.driver == driver and s.entry["name"] == device), None)


def pinned_pod(name: str, claim: str, node_name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod using `claim`, for kube-scheduler to place on `node_name` only: a required node affinity on the
    node's name (its PreFilter then looks at that node alone), the node's no-kubelet taints tolerated."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": {
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": [{"name": "d"}]}}],
            "resourceClaims": [{"name": "d", "resourceClaimName": claim}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}},
            "tolerations": [{"key": key, "operator": "Exists"} for key in NODE_TAINTS],
        },
    }  # fmt: skip


def all_devices_claim(name: str, device_class: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A claim for every device of `device_class` on the node its pod lands on (allocationMode All): its
    allocation is exactly what the class selects there."""
    request = {"name": "all", "exactly": {"deviceClassName": device_class, "allocationMode": "All"}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": {"devices": {"requests": [request]}},
    }
