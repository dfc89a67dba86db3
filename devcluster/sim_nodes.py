"""The simulated GPU nodes of an installation (``SimNode``: its process, its GPUs and the scrubgate agent on
it) and what is there before scrubgate: NVIDIA's DeviceClasses and driver identity, and each node's
credentials. Part of the test and demo harness (devcluster/harness.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scrubgate.policies import names
from scrubgate.sanitizer_agent.gpu import GpuDevice, simulated

from . import driver
from .commands import agent_argv, node_argv
from .controlplane import ControlPlane
from .credentials import Credentials
from .kubeapi import KubeApi
from .probes import http_get, probe
from .processes import ManagedProcess, free_port, wait_for
from .workdir import NodeFiles, Paths


def node_name(index: int) -> str:
    """The name of node ``index`` (0-based): gpu-node-1, gpu-node-2, ..."""
    return f"gpu-node-{index + 1}"


@dataclass
class SimNode:
    """One simulated GPU node: its process (the kubelet stand-in and the DRA driver, devcluster/node.py), its
    GPUs, and the scrubgate agent the DaemonSet runs on it. Its DRA pool is its name; device names (gpu-0, ...)
    repeat across nodes, UUIDs do not."""

    name: str
    files: NodeFiles
    process: ManagedProcess
    agent: ManagedProcess
    agent_metrics_port: int
    ready_timeout: float

    @classmethod
    def build(
        cls,
        index: int,
        paths: Paths,
        env: dict[str, str],
        ready_timeout: float,
        key_id: str,
        agent_args: Iterable[str],
        credentials: Credentials,
    ) -> SimNode:
        """Node ``index``, its processes not started yet; each start of its agent gets a fresh token first."""
        name = node_name(index)
        tag = f"-{name}" if index else ""  # the first node's files and processes keep their one-node names
        files = NodeFiles.of(paths, name, tag)
        port = free_port()
        return cls(
            name,
            files,
            process=ManagedProcess(f"node{tag}", node_argv(paths, name, files), files.node_log, env),
            agent=ManagedProcess(
                f"agent{tag}",
                agent_argv(paths, name, files, key_id, port, agent_args),
                files.agent_log,
                env,
                before_start=lambda: credentials.agent(name, files),
            ),
            agent_metrics_port=port,
            ready_timeout=ready_timeout,
        )

    @property
    def gpu_dir(self) -> Path:
        return self.files.gpus

    def wait_agent_ready(self, timeout: float | None = None) -> None:
        wait_for(
            lambda: self.agent_healthz()[0] == 200 or self.agent.check_alive(),
            timeout or self.ready_timeout,
            f"the agent's /healthz on 127.0.0.1:{self.agent_metrics_port} (node {self.name})",
        )

    def agent_healthz(self) -> tuple[int, str]:
        """(0, reason) when the agent does not answer."""
        return probe(self.agent_metrics_port, "/healthz")

    def agent_metrics(self) -> str:
        return http_get(self.agent_metrics_port, "/metrics")[1]

    def gpus(self) -> list[GpuDevice]:
        return simulated.SimulatedGpu(self.gpu_dir).list_devices()

    def device_name(self, device_uuid: str) -> str:
        """The DRA device name (gpu-0, gpu-0-mig-1, ...) the driver publishes for a UUID."""
        return driver.device_names(self.gpus())[device_uuid]

    def device_uuid(self, device_name: str) -> str:
        return {v: k for k, v in driver.device_names(self.gpus()).items()}[device_name]

    def gpu_memory(self, device_uuid: str) -> bytes:
        """The device's memory as a tenant (or an attacker with the device) would read it."""
        return simulated.read(self.gpu_dir, device_uuid)

    def inject_fault(self, device_uuid: str, kind: simulated.FaultKind, value: Any = True) -> None:
        simulated.inject_fault(self.gpu_dir, device_uuid, kind, value)

    def clear_faults(self, device_uuid: str | None = None) -> None:
        simulated.clear_faults(self.gpu_dir, device_uuid)


def install_nodes(nodes: list[SimNode], kube: KubeApi, control_plane: ControlPlane, credentials: Credentials) -> None:
    """What is there before scrubgate: NVIDIA's DeviceClasses and driver identity, and the GPU nodes, each
    with its own client certificate (the Node authorizer lets it at its own Node and pods only)."""
    for device_class in driver.device_classes():
        kube.apply(device_class)
    _install_driver_identity(kube, credentials)
    for node in nodes:
        credential = control_plane.pki.client(
            f"node-{node.name}", f"system:node:{node.name}", ("system:nodes",), control_plane.url
        )
        shutil.copyfile(credential.kubeconfig, node.files.kubeconfig)
        node.process.start()


def _install_driver_identity(kube: KubeApi, credentials: Credentials) -> None:
    ns, sa = driver.DRIVER_NAMESPACE, driver.DRIVER_SERVICE_ACCOUNT
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    kube.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}})
    rbac = "rbac.authorization.k8s.io/v1"
    kube.apply({"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": sa}, "rules": driver.DRIVER_RULES})
    kube.apply(
        {
            "apiVersion": rbac,
            "kind": "ClusterRoleBinding",
            "metadata": {"name": sa},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        }
    )
    credentials.driver()


def wait_slices_published(kube: KubeApi, nodes: list[SimNode], timeout: float) -> None:
    """Until every node's driver has published its ResourceSlices."""

    def published() -> bool:
        body = kube.request("GET", f"/apis/{names.RESOURCE_GROUP}/v1/resourceslices")
        nodes_published = {(s.get("spec") or {}).get("nodeName") for s in body.get("items") or []}
        return {n.name for n in nodes} <= nodes_published

    wait_for(published, timeout, "a ResourceSlice of every node")
