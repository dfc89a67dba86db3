"""The simulated control plane: DRA allocation, scheduling, and the resourceclaim controller."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from scrubgate.sanitizer_agent.gpu.base import GpuDevice

from devcluster.allocator import Inventory, Unschedulable
from devcluster.apiserver import ApiServer
from devcluster.controllers import DELETE_PROTECTION, POD_CLAIM_NAME_ANNOTATION
from devcluster.driver import device_classes, resource_slice

pytestmark = pytest.mark.timeout(60)


def gpus(node: str, count: int, migs: int = 0) -> list[GpuDevice]:
    devices = []
    for i in range(count):
        parent = f"GPU-{node}-{i}"
        devices.append(GpuDevice(parent, i, "Simulated H200", None, 1 << 30, 1 << 20, 1 << 29))
        devices += [GpuDevice(f"MIG-{node}-{i}-{m}", m, "MIG", parent, 1 << 27, 0, 1 << 27) for m in range(migs)]
    return devices


def claim(name: str, device_class: str = "gpu.nvidia.com", count: int = 1, **request: object) -> dict:
    exactly = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count, **request}
    return {
        "metadata": {"name": name, "namespace": "t", "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def allocated(inventory: Inventory, claims: list[dict], node: str = "n1") -> list[list[str]]:
    result = inventory.allocate(claims, node)
    return [[r["device"] for r in result[c["metadata"]["uid"]]["devices"]["results"]] for c in claims]


def inventory(
    devices: list[GpuDevice],
    taint_rules: list[dict] | None = None,
    claims: list[dict] | None = None,
    slice_taints: dict[str, list[dict]] | None = None,
) -> Inventory:
    slice_ = resource_slice("n1", devices)
    for device in slice_["spec"]["devices"]:
        device["taints"] = (slice_taints or {}).get(device["name"], [])
    return Inventory([slice_], device_classes(), taint_rules or [], claims or [])


# ---------------------------------------------------------------------------- allocation


def test_no_device_is_allocated_twice() -> None:
    inv = inventory(gpus("n1", 2))
    assert allocated(inv, [claim("a"), claim("b")]) == [["gpu-0"], ["gpu-1"]]
    with pytest.raises(Unschedulable, match="0 of 1"):
        inv.allocate([claim("c")], "n1")
    existing = {
        **claim("held"),
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"}]
                }
            }
        },
    }
    assert allocated(inventory(gpus("n1", 2), claims=[existing]), [claim("a")]) == [["gpu-1"]]


def test_a_gpu_and_its_mig_slices_exclude_each_other() -> None:
    inv = inventory(gpus("n1", 1, migs=2))
    assert allocated(inv, [claim("mig", "mig.nvidia.com")]) == [["gpu-0-mig-0"]]
    with pytest.raises(Unschedulable):
        inv.allocate([claim("full")], "n1")  # slice 0 of its memory is taken
    assert allocated(inv, [claim("mig2", "mig.nvidia.com")]) == [["gpu-0-mig-1"]]
    whole = inventory(gpus("n1", 1, migs=2))
    assert allocated(whole, [claim("full")]) == [["gpu-0"]]
    with pytest.raises(Unschedulable):
        whole.allocate([claim("mig", "mig.nvidia.com")], "n1")


def test_taints_from_rules_and_slices_block_unless_tolerated() -> None:
    fence = {
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"},
            "taint": {"key": "scrubgate.dev/unsanitized", "effect": "NoSchedule"},
        }
    }
    inv = inventory(
        gpus("n1", 2),
        taint_rules=[fence],
        slice_taints={"gpu-1": [{"key": "hw/broken", "value": "yes", "effect": "NoExecute"}]},
    )
    with pytest.raises(Unschedulable):
        inv.allocate([claim("a")], "n1")
    tolerant = claim(
        "t", tolerations=[{"key": "hw/broken", "operator": "Equal", "value": "yes", "effect": "NoExecute"}]
    )
    assert allocated(inv, [tolerant]) == [["gpu-1"]]
    result = inventory(gpus("n1", 1), taint_rules=[fence]).allocate(
        [claim("all", tolerations=[{"operator": "Exists"}])], "n1"
    )
    assert result["uid-all"]["devices"]["results"][0]["tolerations"] == [{"operator": "Exists"}]
    info_only = {"spec": {"deviceSelector": {"device": "gpu-0"}, "taint": {"key": "k", "effect": "None"}}}
    assert allocated(inventory(gpus("n1", 1), taint_rules=[info_only]), [claim("a")]) == [["gpu-0"]]


def test_selectors_first_available_all_and_admin_access() -> None:
    inv = inventory(gpus("n1", 2, migs=1))
    by_uuid = claim("pick", selectors=[{"cel": {"expression": 'device.attributes["gpu.nvidia.com"].index == 1'}}])
    assert allocated(inv, [by_uuid]) == [["gpu-1"]]
    fallback = {
        "metadata": {"name": "fa", "uid": "uid-fa"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "r",
                        "firstAvailable": [
                            {
                                "name": "big",
                                "deviceClassName": "gpu.nvidia.com",
                                "allocationMode": "ExactCount",
                                "count": 2,
                            },
                            {
                                "name": "small",
                                "deviceClassName": "mig.nvidia.com",
                                "allocationMode": "ExactCount",
                                "count": 1,
                            },
                        ],
                    }
                ]
            }
        },
    }
    result = inv.allocate([fallback], "n1")["uid-fa"]["devices"]["results"]
    assert [(r["request"], r["device"]) for r in result] == [("r/small", "gpu-0-mig-0")]
    admin = claim("admin", adminAccess=True)
    assert allocated(inv, [admin]) == [["gpu-0"]]  # in use elsewhere does not matter with admin access
    assert allocated(inventory(gpus("n1", 2)), [claim("every", allocationMode="All")]) == [["gpu-0", "gpu-1"]]
    with pytest.raises(Unschedulable, match="does not exist"):
        inv.allocate([claim("x", "tpu.example.com")], "n1")
    with pytest.raises(Unschedulable):
        inv.allocate([claim("elsewhere")], "n2")


# ---------------------------------------------------------------------------- the control plane


@pytest.fixture
def cluster() -> Iterator[tuple[ApiServer, client.ApiClient]]:
    with ApiServer(control_plane=True).start() as srv:
        api = client.ApiClient(client.Configuration(host=srv.url))
        core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
        core.create_namespace({"metadata": {"name": "team-a"}})
        core.create_node({"metadata": {"name": "n1"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        for device_class in device_classes():
            resource.create_device_class(device_class)
        resource.create_resource_slice(resource_slice("n1", gpus("n1", 1)))
        resource.create_namespaced_resource_claim_template(
            "team-a",
            {
                "metadata": {"name": "one-gpu"},
                "spec": {
                    "metadata": {
                        "labels": {"app": "train"},
                        "annotations": {"scrubgate.dev/deallocation-policy": "Delete"},
                    },
                    "spec": {
                        "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}
                    },
                },
            },
        )
        yield srv, api


def eventually(check: Callable[[], object], timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def job_pod(name: str) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
        },
    }


def finish(core: client.CoreV1Api, name: str) -> None:
    core.patch_namespaced_pod_status(name, "team-a", {"status": {"phase": "Succeeded"}})


def test_template_claims_are_generated_allocated_reserved_and_released(
    cluster: tuple[ApiServer, client.ApiClient],
) -> None:
    _, api = cluster
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    pod = core.create_namespaced_pod("team-a", job_pod("job-1"))
    assert eventually(lambda: core.read_namespaced_pod("job-1", "team-a").spec.node_name == "n1")
    status = core.read_namespaced_pod("job-1", "team-a").status.resource_claim_statuses
    claim_name = status[0].resource_claim_name
    assert status[0].name == "gpu" and claim_name.startswith("job-1-gpu-")
    generated = resource.read_namespaced_resource_claim(claim_name, "team-a")
    assert generated.metadata.annotations[POD_CLAIM_NAME_ANNOTATION] == "gpu"
    assert generated.metadata.annotations["scrubgate.dev/deallocation-policy"] == "Delete"
    assert generated.metadata.labels == {"app": "train"}
    owner = generated.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.uid, owner.controller) == ("Pod", "job-1", pod.metadata.uid, True)
    assert DELETE_PROTECTION in generated.metadata.finalizers
    assert [(r.driver, r.pool, r.device) for r in generated.status.allocation.devices.results] == [
        ("gpu.nvidia.com", "n1", "gpu-0")
    ]
    assert [(r.resource, r.name, r.uid) for r in generated.status.reserved_for] == [("pods", "job-1", pod.metadata.uid)]
    finish(core, "job-1")

    def claim_gone() -> bool:
        try:
            resource.read_namespaced_resource_claim(claim_name, "team-a")
        except ApiException as e:
            return e.status == 404
        return False

    assert eventually(claim_gone)


def test_a_claim_finalizer_does_not_stop_deallocation_but_a_device_taint_does(
    cluster: tuple[ApiServer, client.ApiClient],
) -> None:
    """The gap scrubgate closes: upstream frees the device whatever other finalizers the claim has."""
    _, api = cluster
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    core.create_namespaced_pod("team-a", job_pod("first"))
    assert eventually(lambda: core.read_namespaced_pod("first", "team-a").spec.node_name)
    name = core.read_namespaced_pod("first", "team-a").status.resource_claim_statuses[0].resource_claim_name
    resource.patch_namespaced_resource_claim(name, "team-a", {"metadata": {"finalizers": ["scrubgate.dev/sanitize"]}})
    fence = {
        "metadata": {"name": "fence-gpu-0"},
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"},
            "taint": {"key": "scrubgate.dev/unsanitized", "effect": "NoSchedule"},
        },
    }
    resource.create_device_taint_rule(fence)
    finish(core, "first")
    released = lambda: resource.read_namespaced_resource_claim(name, "team-a")  # noqa: E731
    assert eventually(lambda: released().status.allocation is None and released().metadata.deletion_timestamp)
    assert released().metadata.finalizers == ["scrubgate.dev/sanitize"]  # the claim object stays, its device is free
    core.create_namespaced_pod("team-a", job_pod("second"))
    assert eventually(lambda: (core.read_namespaced_pod("second", "team-a").status.conditions or [None])[0])
    condition = core.read_namespaced_pod("second", "team-a").status.conditions[0]
    assert (condition.type, condition.status, condition.reason) == ("PodScheduled", "False", "Unschedulable")
    assert core.read_namespaced_pod("second", "team-a").spec.node_name is None
    resource.delete_device_taint_rule("fence-gpu-0")
    assert eventually(lambda: core.read_namespaced_pod("second", "team-a").spec.node_name == "n1")


def test_deleted_pods_release_their_claims(cluster: tuple[ApiServer, client.ApiClient]) -> None:
    _, api = cluster
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    core.create_namespaced_pod("team-a", job_pod("p"))
    assert eventually(lambda: core.read_namespaced_pod("p", "team-a").spec.node_name)
    core.delete_namespaced_pod("p", "team-a", grace_period_seconds=0)  # force: no kubelet involved
    assert eventually(lambda: resource.list_namespaced_resource_claim("team-a").items == [])


def test_node_taints_keep_pods_off_unless_tolerated(cluster: tuple[ApiServer, client.ApiClient]) -> None:
    _, api = cluster
    core = client.CoreV1Api(api)
    core.patch_node("n1", {"spec": {"taints": [{"key": "scrubgate.dev/unsanitized", "effect": "NoSchedule"}]}})
    core.create_namespaced_pod("team-a", job_pod("blocked"))
    tolerant = job_pod("tolerant")
    tolerant["spec"]["tolerations"] = [{"key": "scrubgate.dev/unsanitized", "operator": "Exists"}]
    core.create_namespaced_pod("team-a", tolerant)
    assert eventually(lambda: core.read_namespaced_pod("tolerant", "team-a").spec.node_name == "n1")
    assert core.read_namespaced_pod("blocked", "team-a").spec.node_name is None
