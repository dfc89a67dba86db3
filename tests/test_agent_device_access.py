"""The agent refuses to start, saying which device and what to do, when it cannot reach a GPU it guards; and its
health check fails when it can no longer watch what a teardown's health check needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
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


def capability_nodes(tmp_path: Path, made: list[tuple[int, int]]) -> CapabilityNodes:
    """Nodes under tmp_path, made as regular files that say which device they stand for."""

    def mknod(path: Path, major: int, minor: int) -> None:
        made.append((major, minor))
        path.write_text(f"{major}:{minor}")

    def device_of(path: Path) -> tuple[int, int] | None:
        major, _, minor = path.read_text().partition(":") if path.exists() else ("", "", "")
        return (int(major), int(minor)) if major else None

    return CapabilityNodes(
        proc=tmp_path / "capabilities",
        dev=tmp_path / "dev",
        devices=tmp_path / "devices",
        mknod=mknod,
        device_of=device_of,
    )


def test_mig_config_capability_is_read_from_proc_made_when_missing_and_opened(tmp_path):
    made: list[tuple[int, int]] = []
    nodes = capability_nodes(tmp_path, made)
    proc, dev, devices = nodes.proc, nodes.dev, nodes.devices
    assert "cannot read" in (nodes.config_problem() or "")
    (proc / "mig").mkdir(parents=True)
    (proc / "mig" / "config").write_text("DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
    assert "names no nvidia-caps device major" in (nodes.config_problem() or "")
    devices.write_text("Character devices:\n195 nvidia\n509 nvidia-caps\n")
    assert nodes.config_problem() is None and made == [(509, 1)] and (dev / "nvidia-cap1").exists()
    assert nodes.config_problem() is None and made == [(509, 1)], "an existing node is not made again"
    (proc / "mig" / "config").write_text("garbage\n")
    assert "names no DeviceFileMinor" in (nodes.config_problem() or "")


def test_a_capability_node_made_before_a_driver_reload_is_made_again(tmp_path):
    """The nvidia-caps major is the kernel's choice at each load of the driver: a node the agent made before a
    reload names another device now."""
    made: list[tuple[int, int]] = []
    nodes = capability_nodes(tmp_path, made)
    (nodes.proc / "mig").mkdir(parents=True)
    (nodes.proc / "mig" / "config").write_text("DeviceFileMinor: 1\nDeviceFileMode: 256\n")
    nodes.devices.write_text("Character devices:\n195 nvidia\n509 nvidia-caps\n")
    assert nodes.config_problem() is None and made == [(509, 1)]
    nodes.devices.write_text("Character devices:\n195 nvidia\n236 nvidia-caps\n")  # the driver reloaded
    assert nodes.config_problem() is None and made == [(509, 1), (236, 1)]
    assert (nodes.dev / "nvidia-cap1").read_text() == "236:1"


def test_without_the_capabilities_tree_the_agent_names_nvidia_mig_config_devices(tmp_path):
    """NVIDIA's container runtime (the legacy hook) shows a container /proc/driver/nvidia/capabilities only with
    NVIDIA_MIG_CONFIG_DEVICES=all (libnvidia-container's MIG config devices; NVIDIA's own kubelet plugin sets it:
    k8s-dra-driver-gpu deployments/helm/dra-driver-nvidia-gpu/templates/kubeletplugin.yaml)."""
    nodes = capability_nodes(tmp_path, [])
    assert "NVIDIA_MIG_CONFIG_DEVICES=all" in (nodes.config_problem() or "")


def test_the_daemonset_shows_the_agent_the_mig_capabilities():
    """The base and the chart (which renders the same file) give the agent's container the capabilities tree."""
    manifest = Path(__file__).resolve().parents[1] / "manifests" / "agent-daemonset.yaml"
    daemonset = yaml.safe_load(manifest.read_text())
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_MIG_CONFIG_DEVICES"] == "all"


class NoCuda(SimulatedGpu):
    def cuda_problem(self) -> str | None:
        return "scrub of GPU-0 failed: cuInit failed: CUDA_ERROR_NO_DEVICE"


def test_cuda_that_cannot_open_a_context_stops_the_agent(tmp_path):
    node = make_node(tmp_path, gpus=1)
    with pytest.raises(DeviceAccessError, match=r"cannot use CUDA.*CUDA_ERROR_NO_DEVICE.*Refusing to start"):
        node.agent(backend=NoCuda(node.root)).start()
    node.cluster.slices[:] = []  # no GPU published here: nothing to scrub, no CUDA needed
    node.agent(backend=NoCuda(node.root)).start()


class DeadXidWatch(SimulatedGpu):
    def watch_error(self) -> str | None:
        return "reading /dev/kmsg: [Errno 5] Input/output error"


def test_a_dead_xid_watch_fails_the_agents_health_check(tmp_path):
    node = make_node(tmp_path, gpus=1)
    agent = node.agent(backend=DeadXidWatch(node.root))
    agent.start()
    agent.tick()
    healthy, why = agent.healthy()
    assert not healthy and "XID watch stopped" in why and "Input/output error" in why
    fine = node.agent()
    fine.start()
    fine.tick()
    assert fine.healthy()[0]
