"""The agent refuses to start, saying which device and what to do, when it cannot reach a GPU it guards."""

from __future__ import annotations

import pytest
from agent_support import DRIVER, NODE, make_node
from scrubgate.sanitizer_agent.device_access import DeviceAccessError
from scrubgate.sanitizer_agent.gpu import simulated
from scrubgate.sanitizer_agent.gpu.mig import CapabilityNodes
from scrubgate.sanitizer_agent.gpu.simulated import SimulatedGpu
from test_agent_dynamic_mig import nvidia_slice


def test_a_published_gpu_the_backend_cannot_see_stops_the_agent_before_it_fences(tmp_path):
    node = make_node(tmp_path, gpus=1)
    node.cluster.add_slice(NODE, DRIVER, NODE, {"gpu-7": {"uuid": "GPU-not-visible"}})
    agent = node.agent()
    with pytest.raises(DeviceAccessError) as failure:
        agent.start()
    message = str(failure.value)
    assert "GPU-not-visible (gpu.nvidia.com/gpu-node-1/gpu-7)" in message and "Refusing to start" in message
    assert "privileged" in message and "nvidia-smi -L" in message
    assert node.gpus[0].uuid not in message, "the visible GPU is not named"


def test_devices_of_other_drivers_are_not_the_agents(tmp_path):
    node = make_node(tmp_path, gpus=1)
    node.cluster.add_slice(NODE, "nic.example.com", NODE, {"nic-0": {"uuid": "NIC-0"}})
    node.agent().start()


def test_nvml_that_cannot_list_gpus_stops_the_agent(tmp_path):
    node = make_node(tmp_path, gpus=1)
    simulated.inject_fault(node.root, "*", "nvml_error", "Insufficient Permissions")
    with pytest.raises(DeviceAccessError, match=r"cannot list its GPUs.*Insufficient Permissions"):
        node.agent().start()


class NoMigManagement(SimulatedGpu):
    def mig_management_problem(self) -> str | None:
        return "cannot open /dev/nvidia-caps/nvidia-cap1 (Permission denied)"


def test_dynamic_mig_without_mig_management_stops_the_agent(tmp_path):
    node = make_node(tmp_path, gpus=1)
    node.cluster.slices[:] = [nvidia_slice(node.gpus[0].uuid)]
    with pytest.raises(DeviceAccessError, match="cannot manage MIG: cannot open /dev/nvidia-caps/nvidia-cap1"):
        node.agent(backend=NoMigManagement(node.root)).start()
    # Without dynamic MIG devices the same backend is good enough.
    node.cluster.slices[:] = []
    node.cluster.add_slice(NODE, DRIVER, NODE, {"gpu-0": {"uuid": node.gpus[0].uuid}})
    node.agent(backend=NoMigManagement(node.root)).start()


def test_mig_config_capability_is_read_from_proc_made_when_missing_and_opened(tmp_path):
    proc, dev, devices = tmp_path / "capabilities", tmp_path / "dev", tmp_path / "devices"
    made: list[tuple[int, int]] = []

    def mknod(path, major, minor):
        made.append((major, minor))
        path.write_text("")

    nodes = CapabilityNodes(proc=proc, dev=dev, devices=devices, mknod=mknod)
    assert "cannot read" in (nodes.config_problem() or "")
    (proc / "mig").mkdir(parents=True)
    (proc / "mig" / "config").write_text("DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
    assert "names no nvidia-caps device major" in (nodes.config_problem() or "")
    devices.write_text("Character devices:\n195 nvidia\n509 nvidia-caps\n")
    assert nodes.config_problem() is None and made == [(509, 1)] and (dev / "nvidia-cap1").exists()
    assert nodes.config_problem() is None and made == [(509, 1)], "an existing node is not made again"
    (proc / "mig" / "config").write_text("garbage\n")
    assert "names no DeviceFileMinor" in (nodes.config_problem() or "")
