"""A simulated node (DRA driver + kubelet) over the simulated GPU backend: without scrubgate, the
next tenant reads the previous tenant's canary -- the leak the project exists to stop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from scrubgate.sanitizer_agent.gpu import simulated

from devcluster.apiserver import ApiServer
from devcluster.kubelet import CANARY, CANARY_FOUND, LOOK_FOR, RUN_SECONDS

pytestmark = pytest.mark.timeout(60)


def eventually(check: Callable[[], object], timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[client.ApiClient, Path]]:
    root = tmp_path / "n1"
    simulated.create_inventory(root, gpus=1, mig_per_gpu=2, memory_bytes=1 << 16)
    with ApiServer(control_plane=True, nodes={"n1": root}).start() as srv:
        api = client.ApiClient(client.Configuration(host=srv.url))
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": "team-a"}})
        client.ResourceV1Api(api).create_namespaced_resource_claim_template(
            "team-a",
            {
                "metadata": {"name": "one-gpu"},
                "spec": {
                    "spec": {
                        "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}
                    }
                },
            },
        )
        yield api, root


def tenant_pod(name: str, **annotations: str) -> dict:
    return {
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "containers": [{"name": "c", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
        },
    }


def test_driver_publishes_slices_and_classes(node: tuple[client.ApiClient, Path]) -> None:
    api, root = node
    resource = client.ResourceV1Api(api)
    assert eventually(lambda: resource.list_resource_slice().items)
    (slice_,) = resource.list_resource_slice().items
    assert slice_.spec.driver == "gpu.nvidia.com" and slice_.spec.pool.name == "n1" and slice_.spec.node_name == "n1"
    by_name = {d.name: d for d in slice_.spec.devices}
    assert set(by_name) == {"gpu-0", "gpu-0-mig-0", "gpu-0-mig-1"}
    inventory = {d.uuid: d for d in simulated.SimulatedGpu(root).list_devices()}
    mig = by_name["gpu-0-mig-1"].attributes
    assert mig["type"].string == "mig" and mig["parentUUID"].string == by_name["gpu-0"].attributes["uuid"].string
    assert inventory[mig["uuid"].string].parent_uuid == mig["parentUUID"].string
    assert {c.metadata.name for c in resource.list_device_class().items} >= {"gpu.nvidia.com", "mig.nvidia.com"}
    assert client.CoreV1Api(api).read_node("n1").status.conditions[0].type == "Ready"


def test_a_tenant_runs_writes_its_canary_and_the_next_tenant_can_read_it(node: tuple[client.ApiClient, Path]) -> None:
    api, root = node
    core = client.CoreV1Api(api)
    core.create_namespaced_pod("team-a", tenant_pod("first", **{CANARY: "SECRET-OF-A", RUN_SECONDS: "0.5"}))
    assert eventually(lambda: core.read_namespaced_pod("first", "team-a").status.phase == "Running")
    gpu = next(d for d in simulated.SimulatedGpu(root).list_devices() if not d.is_mig)
    assert simulated.SimulatedGpu(root).processes(gpu.uuid)  # the tenant's process holds the device
    assert b"SECRET-OF-A" in simulated.read(root, gpu.uuid)
    assert eventually(lambda: core.read_namespaced_pod("first", "team-a").status.phase == "Succeeded")
    assert simulated.SimulatedGpu(root).processes(gpu.uuid) == []
    # Nothing scrubs: upstream releases the device, the next tenant gets it with the canary inside.
    core.create_namespaced_pod("team-a", tenant_pod("second", **{LOOK_FOR: "SECRET-OF-A"}))
    assert eventually(lambda: core.read_namespaced_pod("second", "team-a").status.phase == "Running")
    conditions = {c.type: c for c in core.read_namespaced_pod("second", "team-a").status.conditions}
    assert conditions[CANARY_FOUND].status == "True"


def test_deleting_a_running_pod_stops_it_unprepares_and_removes_it(node: tuple[client.ApiClient, Path]) -> None:
    api, root = node
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    core.create_namespaced_pod("team-a", tenant_pod("p"))
    assert eventually(lambda: core.read_namespaced_pod("p", "team-a").status.phase == "Running")
    pid = int(core.read_namespaced_pod("p", "team-a").status.container_statuses[0].container_id.split("//")[1])
    core.delete_namespaced_pod("p", "team-a")  # graceful: the kubelet finishes it

    def gone() -> bool:
        try:
            core.read_namespaced_pod("p", "team-a")
        except ApiException as e:
            return e.status == 404
        return False

    assert eventually(gone)
    gpu = next(d for d in simulated.SimulatedGpu(root).list_devices() if not d.is_mig)
    assert simulated.SimulatedGpu(root).processes(gpu.uuid) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert eventually(lambda: resource.list_namespaced_resource_claim("team-a").items == [])


def test_a_restarted_stand_in_adopts_running_containers(tmp_path: Path) -> None:
    root, state = tmp_path / "n1", tmp_path / "state"
    simulated.create_inventory(root, gpus=1, memory_bytes=1 << 16)
    srv = ApiServer(control_plane=True, nodes={"n1": root}, state_dir=state).start()
    core = client.CoreV1Api(client.ApiClient(client.Configuration(host=srv.url)))
    core.create_namespace({"metadata": {"name": "team-a"}})
    client.ResourceV1Api(core.api_client).create_namespaced_resource_claim_template(
        "team-a",
        {
            "metadata": {"name": "one-gpu"},
            "spec": {
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}
            },
        },
    )
    core.create_namespaced_pod("team-a", tenant_pod("p"))
    assert eventually(lambda: core.read_namespaced_pod("p", "team-a").status.phase == "Running")
    srv.stop(keep_containers=True)  # as if killed: the workload keeps running
    (gpu,) = simulated.SimulatedGpu(root).list_devices()
    (process,) = simulated.SimulatedGpu(root).processes(gpu.uuid)
    with ApiServer(control_plane=True, nodes={"n1": root}, state_dir=state).start() as again:
        core = client.CoreV1Api(client.ApiClient(client.Configuration(host=again.url)))
        assert core.read_namespaced_pod("p", "team-a").status.phase == "Running"
        core.delete_namespaced_pod("p", "team-a")
        assert eventually(lambda: not core.list_namespaced_pod("team-a").items)
        assert simulated.SimulatedGpu(root).processes(gpu.uuid) == []
    with pytest.raises(ProcessLookupError):
        os.kill(process.pid, 0)
