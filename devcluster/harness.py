"""A whole scrubgate installation on one machine, for the end-to-end tests and ``make demo``.

Separate processes, as on a real cluster: the real control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler; devcluster/controlplane.py), one or more simulated GPU nodes (each
the kubelet stand-in and an NVIDIA-like DRA driver over simulated GPUs; devcluster/node.py), the real webhook
(``scrubgate webhook``, HTTPS with a certificate from ``scrubgate.certs``) behind a stand-in of its Service
(devcluster/serviceproxy.py), the real controller (``scrubgate controller``, one replica, leader-elected on its
Lease as the Deployment's are) and the real node agent on each node (``scrubgate agent``, the official
``kubernetes`` client, a ServiceAccount token, the simulated GPU backend). scrubgate is installed from the
kustomize base as the built kubectl renders it: its namespace, ServiceAccounts, RBAC and webhook
configurations (caBundle injected; ``service:`` replaced by ``url:`` for the host process). Everything binds
to 127.0.0.1 on ephemeral ports and lives in one work directory; processes write their logs there.

    with Cluster(gpus=2).start() as cluster:
        cluster.create_namespace("team-a")
        core = cluster.core("alice")            # the official client, as tenant alice
        ...
        cluster.agent.kill()                    # kill -9; .start(), .stop(), .restart() likewise
        cluster.observer.violations()           # dirty allocations, unattested finalizer removals

    with Cluster(gpus=1, nodes=2).start() as cluster:
        cluster.nodes[1].agent.kill()           # SimNode gpu-node-2: its process, GPUs and agent

A test and demo harness, not part of scrubgate (see devcluster/README.md).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import http.client
import json
import logging
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from scrubgate.certs.generate import (
    generate_ca,
    issue_serving_cert,
    rotate_serving_cert,
    service_sans,
    write_audit_key,
    write_tls_dir,
)
from scrubgate.certs.inject import inject_ca_bundle, is_webhook_configuration
from scrubgate.certs.layout import AUDIT_KEY_FILE, AUDIT_PUBLIC_KEY_FILE
from scrubgate.policies import names
from scrubgate.policies.attestation import public_key_pem, without_scrubgate
from scrubgate.policies.config import DEFAULT_POLICY_PATH, parse_policy
from scrubgate.sanitizer_agent.gpu import GpuDevice, simulated

from . import driver, workloads
from .controlplane import ControlPlane, StaticUser, binaries
from .observer import Observed, Observer, invariant_violations
from .pki import issue_client_cert, write_kubeconfig
from .processes import REPO_ROOT, HarnessError, ManagedProcess, free_port, wait_for
from .rest import Rest
from .serviceproxy import applied_file

__all__ = [
    "CLAIM_CONTROLLER_USER",
    "Cluster",
    "HarnessError",
    "ManagedProcess",
    "Observed",
    "Observer",
    "SimNode",
    "User",
    "denial",
    "invariant_violations",
    "render_webhook_configurations",
    "wait_for",
]

log = logging.getLogger("devcluster.harness")

MANIFESTS = REPO_ROOT / "manifests"
KEY_ID = "scrubgate-agent-devcluster"
AGENT_USER = f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}"
# kube-controller-manager runs with --use-service-account-credentials: each controller is its own account.
CLAIM_CONTROLLER_USER = "system:serviceaccount:kube-system:resource-claim-controller"
WEBHOOK_HOST = f"{names.WEBHOOK_SERVICE}.{names.SYSTEM_NAMESPACE}.svc"


# ---------------------------------------------------------------------- manifests


def render_base(manifests: Path = MANIFESTS, kubectl: str | None = None) -> list[dict[str, Any]]:
    """The kustomize base as the built `kubectl kustomize` renders it."""
    kubectl = kubectl or binaries()["kubectl"]
    result = subprocess.run(
        [kubectl, "kustomize", str(manifests)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise HarnessError(f"kubectl kustomize {manifests} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_webhook_configurations(manifests: Path = MANIFESTS) -> list[dict[str, Any]]:
    """The webhook configurations of the kustomize base."""
    return [doc for doc in render_base(manifests) if is_webhook_configuration(doc)]


def webhook_url_overlay(docs: list[dict[str, Any]], port: int) -> list[dict[str, Any]]:
    """The local overlay: each webhook's ``service:`` becomes ``url: https://127.0.0.1:<port><path>`` (the
    Service's stand-in, devcluster/serviceproxy.py), since no cluster network reaches the host process."""
    out = copy.deepcopy(docs)
    for doc in out:
        for webhook in doc.get("webhooks") or []:
            service = webhook["clientConfig"].pop("service")
            webhook["clientConfig"]["url"] = f"https://127.0.0.1:{port}{service.get('path') or '/'}"
    return out


def policy_with_key(public_pem: str, kid: str = KEY_ID, base: Path = DEFAULT_POLICY_PATH) -> dict[str, Any]:
    """The shipped default policy with the agent's attestation key added (validated before use)."""
    data = yaml.safe_load(base.read_text())
    data["attestationKeys"] = [*(data.get("attestationKeys") or []), {"kid": kid, "publicKey": public_pem}]
    parse_policy(data, f"{base} + attestation key {kid}")
    return data


# ---------------------------------------------------------------------- users


@dataclass
class User:
    name: str
    token: str
    groups: tuple[str, ...] = ()


def _flags(options: dict[str, object]) -> list[str]:
    return [str(item) for option, value in options.items() for item in (option, value)]


# ---------------------------------------------------------------------- the cluster


@dataclass
class Paths:
    root: Path
    gpus: Path = field(init=False)
    certs: Path = field(init=False)
    signing_key: Path = field(init=False)
    policy: Path = field(init=False)
    endpoints: Path = field(init=False)
    proxy_port: Path = field(init=False)
    checkpoint: Path = field(init=False)
    kubeconfig: Path = field(init=False)
    webhook_kubeconfig: Path = field(init=False)
    controller_kubeconfig: Path = field(init=False)
    node_kubeconfig: Path = field(init=False)
    driver_kubeconfig: Path = field(init=False)
    audit_log: Path = field(init=False)
    webhook_configurations: Path = field(init=False)
    client_ca: Path = field(init=False)
    admission_config: Path = field(init=False)
    logs: Path = field(init=False)

    def __post_init__(self) -> None:
        r = self.root
        self.gpus = r / "gpus"
        self.certs = r / "certs"
        self.signing_key = r / "attestation" / "ed25519.pem"
        self.policy = r / "policy.yaml"
        self.endpoints = r / "webhook-endpoints.json"
        self.proxy_port = r / "webhook-service.port"
        self.checkpoint = r / "agent" / "checkpoint.json"
        self.kubeconfig = r / "agent" / "kubeconfig.yaml"
        self.webhook_kubeconfig = r / "webhook" / "kubeconfig.yaml"
        self.controller_kubeconfig = r / "controller" / "kubeconfig.yaml"
        self.node_kubeconfig = r / "node" / "kubeconfig.yaml"
        self.driver_kubeconfig = r / "node" / "driver-kubeconfig.yaml"
        self.audit_log = r / "audit" / "audit.jsonl"
        self.webhook_configurations = r / "webhook-configurations.yaml"
        self.client_ca = r / "webhook-client" / "ca.crt"
        self.admission_config = r / "webhook-client" / "admission-configuration.yaml"
        self.logs = r / "logs"


# What the harness installs from the kustomize base: scrubgate's namespace, identities and RBAC, and the
# webhook configurations (overlaid). The webhook, the controller and the agent run as host processes instead of
# the base's Deployments and DaemonSet.
INSTALLED_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
TOKEN_SECONDS = 24 * 3600


# ---------------------------------------------------------------------- the nodes


def node_name(index: int) -> str:
    """The name of node ``index`` (0-based): gpu-node-1, gpu-node-2, ..."""
    return f"gpu-node-{index + 1}"


@dataclass(frozen=True)
class NodeFiles:
    """One node's files: the first node's are where a one-node cluster has them (``Paths``), the others' carry
    the node's name (``tag``) beside them."""

    gpus: Path
    kubeconfig: Path  # the node's own credentials (system:node:<name>)
    agent_kubeconfig: Path  # its agent's: the agent's ServiceAccount, with a token bound to this Node
    checkpoint: Path  # its agent's
    node_log: Path
    agent_log: Path

    @classmethod
    def of(cls, paths: Paths, name: str, tag: str) -> NodeFiles:
        def beside(path: Path) -> Path:
            return path.with_name(f"{path.stem}{tag}{path.suffix}")

        return cls(
            gpus=paths.gpus / name,
            kubeconfig=beside(paths.node_kubeconfig),
            agent_kubeconfig=beside(paths.kubeconfig),
            checkpoint=beside(paths.checkpoint),
            node_log=beside(paths.logs / "node.log"),
            agent_log=beside(paths.logs / "agent.log"),
        )


def _http_get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


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
        try:
            return _http_get(self.agent_metrics_port, "/healthz")
        except (OSError, http.client.HTTPException) as exc:
            return 0, str(exc)

    def agent_metrics(self) -> str:
        return _http_get(self.agent_metrics_port, "/metrics")[1]

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

    def gpu_processes(self, device_uuid: str) -> list[int]:
        return [p.pid for p in simulated.SimulatedGpu(self.gpu_dir).processes(device_uuid)]

    def inject_fault(self, device_uuid: str, kind: simulated.FaultKind, value: Any = True) -> None:
        simulated.inject_fault(self.gpu_dir, device_uuid, kind, value)

    def clear_faults(self, device_uuid: str | None = None) -> None:
        simulated.clear_faults(self.gpu_dir, device_uuid)


class Cluster:
    """The installation. ``start()`` brings it up (and stops what it started if that fails), ``stop()`` /
    the context manager takes it down and removes the work directory unless ``keep`` (or it was given).

    Users: ``admin`` (system:masters) and one per name in ``tenants`` (static tokens; each may `edit` in the
    namespaces of ``create_namespace``); ``agent``, the agent's ServiceAccount (a TokenRequest token).

    ``nodes`` simulated GPU nodes (``self.nodes``, gpu-node-1, ...), each with ``gpus`` GPUs of ``mig_per_gpu``
    MIG slices and its own agent. ``audit_policy``: kube-apiserver's audit log by that policy (see ControlPlane).
    The single-node attributes (``node``, ``agent``, ``node_process``, ``gpu_dir``,
    ``gpus()``, ``wait_agent_ready()``, ...) are the first node's.
    """

    def __init__(
        self,
        workdir: Path | str | None = None,
        *,
        nodes: int = 1,
        gpus: int = 2,
        mig_per_gpu: int = 0,
        memory_bytes: int = 1 << 20,
        tenants: Iterable[str] = ("alice", "bob"),
        agent_args: Iterable[str] = ("--resync", "5", "--retry-backoff", "1", "--drain-timeout", "10"),
        keep: bool = False,
        ready_timeout: float = 120.0,
        version: str | None = None,
        installer: str = "kustomize",
        namespace: str = names.SYSTEM_NAMESPACE,
        client_qps: float | None = None,
        helm_set: Iterable[str] = (),
        audit_policy: Path | None = None,
    ) -> None:
        self.paths = Paths(Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="scrubgate-devcluster-")))
        self.keep = keep or workdir is not None
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: a cluster needs at least one node")
        self._inventory = {"gpus": gpus, "mig_per_gpu": mig_per_gpu, "memory_bytes": memory_bytes}
        self.ready_timeout = ready_timeout
        self.users: dict[str, User] = {"admin": User("kubernetes-admin", secrets.token_hex(16), ("system:masters",))}
        self.tenants = list(tenants)
        for name in self.tenants:
            self.users[name] = User(name, secrets.token_hex(16))
        # scrubgate's namespace: the base's, or any other with the chart (which names it wherever the base does)
        self.namespace = namespace
        agent = f"system:serviceaccount:{namespace}:{names.AGENT_SERVICE_ACCOUNT}"
        self.users["agent"] = User(agent, "")  # its token comes from the TokenRequest API at start
        self.key_id = KEY_ID
        self._signing_key = Ed25519PrivateKey.generate()
        self.public_keys: dict[str, Ed25519PublicKey] = {KEY_ID: self._signing_key.public_key()}
        self.webhook_port = free_port()
        self.webhook_metrics_port = free_port()
        self.service_port = 0
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        self._env = env
        self.control_plane = ControlPlane(
            self.paths.root / "control-plane",
            users=[StaticUser(u.name, u.token, u.groups) for k, u in self.users.items() if k != "agent"],
            version=version,
            admission_config=self.paths.admission_config,
            client_qps=client_qps,
            audit_policy=audit_policy,
            ready_timeout=ready_timeout,
        )
        self._agent_args = list(agent_args)
        if installer not in ("kustomize", "helm"):
            raise ValueError(f"installer {installer!r}: kustomize or helm")
        if installer == "kustomize" and namespace != names.SYSTEM_NAMESPACE:
            raise ValueError(f"namespace {namespace!r}: the kustomize base installs into {names.SYSTEM_NAMESPACE}")
        self.installer = installer
        self.helm_set = list(helm_set)  # `--set` values of the helm install, after the harness's own
        self.api = self.control_plane.apiserver
        self.service = ManagedProcess("webhook Service", self._service_argv(), self.paths.logs / "service.log", env)
        self.webhook = ManagedProcess("webhook", self._webhook_argv(), self.paths.logs / "webhook.log", env)
        self.controller_metrics_port = free_port()
        self.controller = ManagedProcess(
            "controller",
            self._controller_argv(),
            self.paths.logs / "controller.log",
            env,
            before_start=self._controller_credentials,
        )
        self.nodes = [self._sim_node(i) for i in range(nodes)]
        self.observer = Observer(lambda: self.control_plane.port, self.users["admin"].token, self._ca_file)
        self._clients: dict[str, k8s.ApiClient] = {}
        self._started = False

    @property
    def _ca_file(self) -> Path:
        return self.control_plane.pki.ca_cert

    @property
    def version(self) -> str:
        return self.control_plane.version

    # ------------------------------------------------------------------ the nodes

    def _sim_node(self, index: int) -> SimNode:
        """Node ``index``, its processes not started yet."""
        name = node_name(index)
        tag = f"-{name}" if index else ""  # the first node's files and processes keep their one-node names
        files = NodeFiles.of(self.paths, name, tag)
        port = free_port()
        return SimNode(
            name,
            files,
            process=ManagedProcess(f"node{tag}", self._node_argv(name, files), files.node_log, self._env),
            agent=ManagedProcess(
                f"agent{tag}",
                self._agent_argv(name, files, port),
                files.agent_log,
                self._env,
                before_start=lambda: self._agent_credentials(name, files),
            ),
            agent_metrics_port=port,
            ready_timeout=self.ready_timeout,
        )

    def node_named(self, name: str) -> SimNode:
        """The node of that name (a device's DRA pool)."""
        return next(n for n in self.nodes if n.name == name)

    # One-node tests use the first node through the cluster: these are ``nodes[0]``'s.

    @property
    def node(self) -> str:
        return self.nodes[0].name

    @property
    def agent(self) -> ManagedProcess:
        return self.nodes[0].agent

    @property
    def node_process(self) -> ManagedProcess:
        return self.nodes[0].process

    @property
    def gpu_dir(self) -> Path:
        return self.nodes[0].gpu_dir

    @property
    def agent_metrics_port(self) -> int:
        return self.nodes[0].agent_metrics_port

    def wait_agent_ready(self, timeout: float | None = None) -> None:
        self.nodes[0].wait_agent_ready(timeout)

    def agent_healthz(self) -> tuple[int, str]:
        return self.nodes[0].agent_healthz()

    def agent_metrics(self) -> str:
        return self.nodes[0].agent_metrics()

    def gpus(self) -> list[GpuDevice]:
        return self.nodes[0].gpus()

    def device_name(self, device_uuid: str) -> str:
        return self.nodes[0].device_name(device_uuid)

    def device_uuid(self, device_name: str) -> str:
        return self.nodes[0].device_uuid(device_name)

    def gpu_memory(self, device_uuid: str) -> bytes:
        return self.nodes[0].gpu_memory(device_uuid)

    def gpu_processes(self, device_uuid: str) -> list[int]:
        return self.nodes[0].gpu_processes(device_uuid)

    def inject_fault(self, device_uuid: str, kind: simulated.FaultKind, value: Any = True) -> None:
        self.nodes[0].inject_fault(device_uuid, kind, value)

    def clear_faults(self, device_uuid: str | None = None) -> None:
        self.nodes[0].clear_faults(device_uuid)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Cluster:
        try:
            self._prepare()
            self.service.start()
            self.service_port = int(
                wait_for(
                    lambda: (
                        (self.paths.proxy_port.is_file() and self.paths.proxy_port.read_text())
                        or self.service.check_alive()
                    ),
                    self.ready_timeout,
                    "the webhook Service's port",
                )
            )
            self._webhook_client_credentials()
            self.control_plane.start()
            self._install_nodes()
            self.webhook.start()
            self.wait_webhook_ready()
            self._install()
            self._webhook_credentials()
            self.controller.start()
            self.wait_controller_ready()
            for node in self.nodes:
                node.agent.start()
            for node in self.nodes:
                node.wait_agent_ready()
            wait_for(self._slices_published, self.ready_timeout, "a ResourceSlice of every node")
            self.observer.start()
        except BaseException:
            print(self.diagnostics(), file=sys.stderr)
            self.stop()
            raise
        self._started = True
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Stops the agents, the webhook, the nodes (and their containers), then the control plane."""
        atexit.unregister(self.stop)
        self.observer.stop()
        if self.keep and self.paths.root.is_dir():
            self.observer.dump(self.paths.root / "observed.jsonl")
        for process in (
            *(n.agent for n in self.nodes),
            self.controller,
            self.webhook,
            *(n.process for n in self.nodes),
            self.service,
        ):
            process.stop()
        self.control_plane.stop()
        for api_client in self._clients.values():
            api_client.close()
        self._clients.clear()
        if not self.keep:
            shutil.rmtree(self.paths.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self if self._started else self.start()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and exc[0] is not KeyboardInterrupt:
            print(self.diagnostics(), file=sys.stderr)
        self.stop()

    @property
    def processes(self) -> tuple[ManagedProcess, ...]:
        return (
            *self.control_plane.processes,
            self.service,
            *(n.process for n in self.nodes),
            self.webhook,
            self.controller,
            *(n.agent for n in self.nodes),
        )

    def diagnostics(self, lines: int = 30) -> str:
        """The last lines of every process log, for a failure message."""
        return "\n".join(
            f"===== {p.name} ({p.log_path}, {'running' if p.running else f'exit {p.returncode}'}) =====\n"
            f"{p.tail(lines)}"
            for p in self.processes
        )

    # ------------------------------------------------------------------ set-up

    def _prepare(self) -> None:
        p = self.paths
        for directory in (
            p.root,
            p.gpus,
            p.logs,
            p.signing_key.parent,
            p.checkpoint.parent,
            p.audit_log.parent,
            p.node_kubeconfig.parent,
            p.webhook_kubeconfig.parent,
            p.controller_kubeconfig.parent,
        ):
            directory.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:  # UUIDs are random (uuid4): no two nodes share one
            simulated.create_inventory(node.gpu_dir, **self._inventory)
        ca = generate_ca()
        write_tls_dir(p.certs, ca, issue_serving_cert(ca, [*service_sans(), "127.0.0.1"]))
        write_audit_key(p.certs)  # as `scrubgate certs generate` makes it for the base's Deployment
        p.signing_key.write_bytes(
            self._signing_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        p.signing_key.chmod(0o600)
        policy = policy_with_key(public_key_pem(self._signing_key))
        policy["agent"] = {"identities": [self.users["agent"].name]}  # as the chart's policy names it
        controller = f"system:serviceaccount:{self.namespace}:{names.CONTROLLER_SERVICE_ACCOUNT}"
        policy["controller"] = {"identities": [controller]}
        self.write_policy(policy)
        self.set_webhook_port(self.webhook_port)

    def _webhook_client_credentials(self) -> None:
        """The API server's client certificate for webhooks, from a CA of its own (the ConfigMap
        scrubgate-webhook-client-ca of the base; docs/install.md, "With kustomize", step 4), given to kube-apiserver
        through --admission-control-config-file for the host it dials; the webhook runs with --client-ca."""
        directory = self.paths.client_ca.parent
        directory.mkdir(parents=True, exist_ok=True)
        ca = generate_ca("scrubgate-apiserver-client-ca")
        pair = issue_client_cert(ca, "kube-apiserver")
        (directory / "client.crt").write_bytes(pair.cert_pem)
        (directory / "client.key").write_bytes(pair.key_pem)
        self.paths.client_ca.write_bytes(ca.cert_pem)
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            # By the host:port a webhook configuration's url names: the Service stand-in, and the webhook itself
            # (bench/admission_latency.py bypasses the Python forwarder).
            "users": [
                {
                    "name": f"127.0.0.1:{port}",
                    "user": {
                        "client-certificate": str(directory / "client.crt"),
                        "client-key": str(directory / "client.key"),
                    },
                }
                for port in (self.service_port, self.webhook_port)
            ],
        }
        (directory / "kubeconfig.yaml").write_text(yaml.safe_dump(kubeconfig))
        plugin = {
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "WebhookAdmissionConfiguration",
            "kubeConfigFile": str(directory / "kubeconfig.yaml"),
        }
        admission = {
            "apiVersion": "apiserver.config.k8s.io/v1",
            "kind": "AdmissionConfiguration",
            "plugins": [
                {"name": name, "configuration": plugin}
                for name in ("ValidatingAdmissionWebhook", "MutatingAdmissionWebhook")
            ],
        }
        self.paths.admission_config.write_text(yaml.safe_dump(admission))

    def write_policy(self, policy: dict[str, Any]) -> None:
        """Replace the webhook's policy file (the webhook reloads it on change)."""
        tmp = self.paths.policy.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(policy, sort_keys=False))
        tmp.replace(self.paths.policy)

    def policy(self) -> dict[str, Any]:
        return yaml.safe_load(self.paths.policy.read_text())

    def _install_nodes(self) -> None:
        """What is there before scrubgate: NVIDIA's DeviceClasses and driver identity, and the GPU nodes, each
        with its own client certificate (the Node authorizer lets it at its own Node and pods only)."""
        for device_class in driver.device_classes():
            self.apply(device_class)
        self._install_driver_identity()
        for node in self.nodes:
            credential = self.control_plane.pki.client(
                f"node-{node.name}", f"system:node:{node.name}", ("system:nodes",), self.control_plane.url
            )
            shutil.copyfile(credential.kubeconfig, node.files.kubeconfig)
            node.process.start()

    def _install(self) -> None:
        """scrubgate as a user installs it, once the webhook serves, then the agent's credentials."""
        if self.installer == "helm":
            self._install_with_helm()
        else:
            self._install_with_kustomize()

    def uninstall_scrubgate(self) -> None:
        """Removes scrubgate from the running installation, in the order docs/operations.md's "Uninstalling" gives: the
        agents first (each fences, on its way out, the teardowns it still owes, which the webhook's guard kept
        until then), then the webhook configurations, then the webhook. Fences and finalizers already placed
        stay. Also the baseline of bench/lifecycle.py: the control plane and the harness alone."""
        for node in self.nodes:
            node.agent.stop()
        self.controller.stop()
        for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            path = f"/apis/admissionregistration.k8s.io/v1/{kind}"
            for item in self.request("GET", path)["items"]:
                if any(w.get("name", "").endswith(".scrubgate.dev") for w in item.get("webhooks") or []):
                    self.request("DELETE", f"{path}/{item['metadata']['name']}")
        self._release_holds()
        self.webhook.stop()

    def _release_holds(self) -> None:
        """What `scrubgate uninstall` does last: the agents' holds come off the claims (their devices fenced by the
        agents on their way out), so that Kubernetes deallocates them as ever."""
        path = self.resource_path("resourceclaims")
        for claim in self.request("GET", path)["items"]:
            reserved = (claim.get("status") or {}).get("reservedFor") or []
            kept = without_scrubgate(claim)
            if kept != reserved:
                meta = claim["metadata"]
                claim["status"]["reservedFor"] = kept
                self.request(
                    "PUT", self.resource_path("resourceclaims", meta["namespace"], meta["name"]) + "/status", claim
                )

    def reinstall_scrubgate(self) -> None:
        """scrubgate installed again after `uninstall_scrubgate`: the webhook, its configurations, the agents
        (which pick up what their checkpoints still owe)."""
        self.webhook.start()
        self.wait_webhook_ready()
        self._install()
        self.controller.start()
        self.wait_controller_ready()
        for node in self.nodes:
            node.agent.start()
        for node in self.nodes:
            node.wait_agent_ready()

    def _install_with_helm(self) -> None:
        """`helm install` of charts/scrubgate with its values for host processes (values-local.yaml): the
        webhook configurations call the Service stand-in; the namespace is created first, as docs/install.md says."""
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})
        keys = self.paths.root / "helm-keys.yaml"
        keys.write_text(yaml.safe_dump({"policy": {"attestationKeys": self.policy()["attestationKeys"]}}))
        self.helm(
            "install", "scrubgate", str(REPO_ROOT / "charts" / "scrubgate"),
            "-f", str(REPO_ROOT / "charts" / "scrubgate" / "values-local.yaml"),
            "--set", f"webhook.url=https://127.0.0.1:{self.service_port}",
            "--set-file", f"certs.provided.caBundle={self.paths.certs / 'ca.crt'}",
            "--set", "reports.installCRDs=true",  # no policy engine here brings them
            "-f", str(keys),
            *(arg for value in self.helm_set for arg in ("--set", value)),
        )  # fmt: skip

    def helm(self, *args: str) -> str:
        """helm as the admin, in scrubgate's namespace; its output (logged to logs/helm.log)."""
        argv = [helm_binary(), *args, "--namespace", self.namespace]
        argv += ["--kubeconfig", str(self.control_plane.credentials["admin"].kubeconfig)]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False, env=self._env)
        with (self.paths.logs / "helm.log").open("a") as log_file:
            log_file.write(f"--- {' '.join(args)}\n{result.stdout}{result.stderr}")
        if result.returncode != 0:
            raise HarnessError(f"helm {args[0]} failed (exit {result.returncode}):\n{result.stdout}{result.stderr}")
        return result.stdout

    def _install_with_kustomize(self) -> None:
        """The kustomize base: its identities and RBAC, then the webhook configurations (with the caBundle and
        the local overlay)."""
        base = render_base(kubectl=self.control_plane.bins["kubectl"])
        for doc in base:
            if doc["kind"] in INSTALLED_KINDS:
                self.apply(doc)
        configurations = inject_ca_bundle(
            [d for d in base if is_webhook_configuration(d)], (self.paths.certs / "ca.crt").read_bytes()
        )
        configurations = webhook_url_overlay(configurations, self.service_port)
        self.paths.webhook_configurations.write_text(yaml.safe_dump_all(configurations, sort_keys=False))
        for doc in configurations:
            self.apply(doc)

    def _install_driver_identity(self) -> None:
        ns, sa = driver.DRIVER_NAMESPACE, driver.DRIVER_SERVICE_ACCOUNT
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        self.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}})
        rbac = "rbac.authorization.k8s.io/v1"
        self.apply({"apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": sa}, "rules": driver.DRIVER_RULES})
        self.apply(
            {
                "apiVersion": rbac,
                "kind": "ClusterRoleBinding",
                "metadata": {"name": sa},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": sa},
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
            }
        )
        token = self.service_account_token(ns, sa)
        self._write_token_kubeconfig(self.paths.driver_kubeconfig, "driver", token)

    def service_account_token(self, namespace: str, name: str, node: str | None = None) -> str:
        """A token for a ServiceAccount from the TokenRequest API, as a projected token volume gets one; with
        `node`, bound to that Node, so that the API server names the node in the user's extra
        (authentication.kubernetes.io/node-name), as it does for a DaemonSet pod's projected token."""
        spec: dict[str, Any] = {"expirationSeconds": TOKEN_SECONDS}
        if node is not None:
            uid = wait_for(lambda: self._node_uid(node), self.ready_timeout, f"node {node} registered")
            spec["boundObjectRef"] = {"kind": "Node", "apiVersion": "v1", "name": node, "uid": uid}
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        reply = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", body)
        return reply["status"]["token"]

    def _agent_credentials(self, node: str, files: NodeFiles) -> None:
        """What a new agent pod gets: a token of the agent's ServiceAccount bound to its node (to the Node object
        as it is now: one deleted and registered again invalidates the tokens bound to the old one, as pod GC
        and the DaemonSet replace the pod). `agent` in the tests is the first node's. With the API server down,
        the agent starts with the token it had."""
        try:
            token = self.service_account_token(self.namespace, names.AGENT_SERVICE_ACCOUNT, node)
        except Exception as exc:  # the API server down or stopping: whatever the client raised
            log.warning("no new token for the agent of %s (%s): it starts with the one it had", node, exc)
            return
        self._write_token_kubeconfig(files.agent_kubeconfig, "agent", token)
        if node == self.nodes[0].name:
            self.users["agent"].token = token

    def _node_uid(self, node: str) -> str | None:
        found = Rest(self.client()).get(f"/api/v1/nodes/{node}")
        return found["metadata"]["uid"] if found else None

    def _write_token_kubeconfig(self, path: Path, user: str, token: str) -> None:
        write_kubeconfig(path, self.url, self._ca_file, user, {"token": token})

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Create ``doc`` as the admin, or replace it when it exists (kubectl apply's outcome)."""
        path = object_path(doc)
        try:
            return self.request("POST", path.rsplit("/", 1)[0], doc)
        except ApiException as exc:
            if exc.status != 409:
                raise
        current = self.request("GET", path)
        doc = {
            **copy.deepcopy(doc),
            "metadata": {**doc["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]},
        }
        return self.request("PUT", path, doc)

    def _service_argv(self) -> list[str]:
        p = self.paths
        return [
            sys.executable,
            "-m",
            "devcluster.serviceproxy",
            "--port-file",
            str(p.proxy_port),
            "--endpoints-file",
            str(p.endpoints),
        ]

    def _node_argv(self, name: str, files: NodeFiles) -> list[str]:
        options = {
            "--node": name,
            "--gpu-root": files.gpus,
            "--kubeconfig": files.kubeconfig,
            "--driver-kubeconfig": self.paths.driver_kubeconfig,  # one ServiceAccount, as the driver's DaemonSet
        }
        return [sys.executable, "-m", "devcluster.node", *_flags(options)]

    def _webhook_argv(self) -> list[str]:
        p = self.paths
        options = {
            "--host": "127.0.0.1",
            "--port": self.webhook_port,
            "--tls-cert": p.certs / "tls.crt",
            "--tls-key": p.certs / "tls.key",
            "--policy": p.policy,
            "--audit-log": p.audit_log,
            # Signed checkpoints of the chain head on stdout, as the base's Deployment writes them; every
            # second here, so that `verify_audit` checks the file against checkpoints of most of it.
            "--audit-signing-key": p.certs / AUDIT_KEY_FILE,
            "--audit-checkpoint-interval": 1,
            "--client-ca": p.client_ca,  # as the base's Deployment: only the API server may ask
            "--kubeconfig": p.webhook_kubeconfig,  # its ServiceAccount's token, written once installed
            "--metrics-port": self.webhook_metrics_port,
        }
        return [sys.executable, "-m", "scrubgate.cli", "webhook", *_flags(options)]

    def _controller_argv(self) -> list[str]:
        options = {
            "--kubeconfig": self.paths.controller_kubeconfig,  # its ServiceAccount's token, written at each start
            "--namespace": self.namespace,  # its Lease's
            "--identity": "devcluster",
            "--policy": self.paths.policy,
            # A GPU claim no agent labelled within 2 s: the tests stop agents and wait for the label.
            "--label-after": 2,
            "--metrics-address": "127.0.0.1",
            "--metrics-port": self.controller_metrics_port,
        }
        return [sys.executable, "-m", "scrubgate.cli", "controller", *_flags(options)]

    def _agent_argv(self, name: str, files: NodeFiles, metrics_port: int) -> list[str]:
        p = self.paths
        options = {
            "--node": name,
            "--gpu-backend": "simulated",
            "--simulated-root": files.gpus,
            # every node's agent: the one ServiceAccount and key, as the DaemonSet, its token bound to its node
            "--kubeconfig": files.agent_kubeconfig,
            "--signing-key": p.signing_key,
            "--key-id": self.key_id,
            "--checkpoint": files.checkpoint,
            "--nvidia-checkpoint": "",  # no NVIDIA driver checkpoint on a simulated node
            "--metrics-address": "127.0.0.1",
            "--metrics-port": metrics_port,  # /healthz tells when the agent is ready
        }
        return [sys.executable, "-m", "scrubgate.cli", "agent", *_flags(options), *self._agent_args]

    # ------------------------------------------------------------------ the processes

    @property
    def url(self) -> str:
        return self.control_plane.url

    def start_api(self) -> None:
        """Start kube-apiserver again (same port, same etcd) and wait until it is ready."""
        self.control_plane.start_apiserver()

    def stop_api(self, crash: bool = False) -> None:
        """kube-apiserver down: kill -9 with ``crash``, else SIGTERM; returns once it no longer answers."""
        self.control_plane.stop_apiserver(crash)

    def restart_api(self, crash: bool = False) -> None:
        """Stop (or kill -9 with ``crash``) and start kube-apiserver; its objects survive in etcd."""
        self.control_plane.restart_apiserver(crash)

    def server_version(self) -> dict[str, str]:
        """What the API server's /version reports."""
        return self.control_plane.server_version()

    def wait_webhook_ready(self, timeout: float | None = None) -> None:
        wait_for(
            lambda: self.webhook_get("/readyz")[0] == 200 or self.webhook.check_alive(),
            timeout or self.ready_timeout,
            f"the webhook's /readyz on 127.0.0.1:{self.webhook_port}",
        )

    def _controller_credentials(self) -> None:
        """What the controller's pod mounts: a token of its ServiceAccount."""
        token = self.service_account_token(self.namespace, names.CONTROLLER_SERVICE_ACCOUNT)
        self._write_token_kubeconfig(self.paths.controller_kubeconfig, "controller", token)

    def wait_controller_ready(self, timeout: float | None = None) -> None:
        """Until the controller leads and has listed every claim (a follower's /healthz says "following")."""

        def leads() -> bool:
            try:
                status, body = _http_get(self.controller_metrics_port, "/healthz")
            except (OSError, http.client.HTTPException):
                return False
            return status == 200 and "following" not in body

        wait_for(
            lambda: leads() or self.controller.check_alive(),
            timeout or self.ready_timeout,
            f"the controller's /healthz on 127.0.0.1:{self.controller_metrics_port}",
        )

    def controller_metrics(self) -> str:
        return _http_get(self.controller_metrics_port, "/metrics")[1]

    def _webhook_credentials(self) -> None:
        """What the webhook's pod mounts once installed: a token of its ServiceAccount, whose RBAC reads
        DeviceClasses; then it has read them (until then it guards every claim)."""
        token = self.service_account_token(self.namespace, names.WEBHOOK_SERVICE_ACCOUNT)
        self._write_token_kubeconfig(self.paths.webhook_kubeconfig, "webhook", token)
        wait_for(
            lambda: '"deviceClasses": true' in self.webhook_get("/readyz")[1] or self.webhook.check_alive(),
            self.ready_timeout,
            "the webhook's list of DeviceClasses",
        )

    def webhook_get(self, path: str) -> tuple[int, str]:
        """GET over HTTPS as the API server connects: to 127.0.0.1, verifying the CA and the service name.
        (0, reason) when it cannot connect."""
        context = ssl.create_default_context(cafile=str(self.paths.certs / "ca.crt"))
        try:
            with (
                socket.create_connection(("127.0.0.1", self.webhook_port), timeout=5) as raw,
                context.wrap_socket(raw, server_hostname=WEBHOOK_HOST) as tls,
            ):
                tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {WEBHOOK_HOST}\r\nConnection: close\r\n\r\n".encode())
                resp = http.client.HTTPResponse(tls)  # type: ignore[arg-type]
                resp.begin()
                return resp.status, resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as exc:
            return 0, str(exc)

    def webhook_metrics(self) -> tuple[int, str]:
        """GET /metrics from the webhook's metrics port (plain HTTP, as Prometheus scrapes it); (0, reason) when
        it cannot connect."""
        try:
            return _http_get(self.webhook_metrics_port, "/metrics")
        except (OSError, http.client.HTTPException) as exc:
            return 0, str(exc)

    def set_webhook_port(self, port: int | None) -> None:
        """The webhook Service's endpoint; None: no endpoints (the webhook unreachable for the API server).
        Returns once the Service stand-in has applied it (and cut connections to the old endpoint)."""
        tmp = self.paths.endpoints.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": port}))
        tmp.replace(self.paths.endpoints)
        if self.service.running:
            applied = applied_file(self.paths.endpoints)
            wait_for(
                lambda: applied.is_file() and json.loads(applied.read_text() or "{}").get("port", -1) == port,
                self.ready_timeout,
                f"the webhook Service's endpoint set to {port}",
            )

    def call_webhook_directly(self) -> None:
        """The webhook configurations pointed at the webhook's own port, past the Service stand-in: its Python
        forwarder adds tens of milliseconds to each call under load, where kube-proxy forwards in the kernel. For
        the benchmarks, which measure scrubgate, not the harness. Returns once the API server calls it that way
        (a dry-run GPU claim passes while the Service has no endpoints)."""
        configurations = list(yaml.safe_load_all(self.paths.webhook_configurations.read_text()))
        for doc in configurations:
            for webhook in doc.get("webhooks") or []:
                config = webhook["clientConfig"]
                config["url"] = config["url"].replace(f":{self.service_port}/", f":{self.webhook_port}/", 1)
            doc["metadata"].pop("resourceVersion", None)
            self.apply(doc)
        claim = workloads.resource_claim("direct-call-probe")
        path = f"/apis/{names.RESOURCE_GROUP}/v1/namespaces/default/resourceclaims"

        def passes() -> bool:
            try:
                self.request("POST", path, claim, query=[("dryRun", "All")])
            except ApiException:
                return False
            return True

        self.set_webhook_port(None)
        try:
            wait_for(passes, self.ready_timeout, "the API server calling the webhook at its own port")
        finally:
            self.set_webhook_port(self.webhook_port)

    def rotate_webhook_cert(self) -> None:
        """A new serving certificate from the same CA, written in place (the webhook reloads it)."""
        rotate_serving_cert(self.paths.certs, [*service_sans(), "127.0.0.1"])

    def _slices_published(self) -> bool:
        body = self.request("GET", f"/apis/{names.RESOURCE_GROUP}/v1/resourceslices")
        published = {(s.get("spec") or {}).get("nodeName") for s in body.get("items") or []}
        return {n.name for n in self.nodes} <= published

    def served_versions(self) -> list[str]:
        """The resource.k8s.io versions that serve ResourceClaims, newest first."""
        groups = self.request("GET", f"/apis/{names.RESOURCE_GROUP}")
        served = {v["version"] for v in groups["versions"]}
        return [
            v
            for v in names.RESOURCE_VERSIONS
            if v in served
            and any(
                r["name"] == "resourceclaims"
                for r in self.request("GET", f"/apis/{names.RESOURCE_GROUP}/{v}")["resources"]
            )
        ]

    # ------------------------------------------------------------------ clients

    def client(self, user: str = "admin") -> k8s.ApiClient:
        """The official client, authenticated as ``user`` (a key of ``users``)."""
        if user not in self._clients:
            configuration = k8s.Configuration(
                host=self.url,
                api_key={"authorization": self.users[user].token},
                api_key_prefix={"authorization": "Bearer"},
            )
            configuration.ssl_ca_cert = str(self._ca_file)
            self._clients[user] = k8s.ApiClient(configuration)
        return self._clients[user]

    def core(self, user: str = "admin") -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.client(user))

    def resource(self, user: str = "admin", version: str = "v1") -> Any:
        """ResourceV1Api, ResourceV1beta2Api, ResourceV1beta1Api or ResourceV1alpha3Api."""
        return getattr(k8s, f"Resource{version[0].upper()}{version[1:]}Api")(self.client(user))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        user: str = "admin",
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """A raw JSON request through the official client (any version, any shape); ApiException on an
        error status, with the API server's Status in ``.body``."""
        return Rest(self.client(user)).request(method, path, body, query=query, content_type=content_type)

    def create_namespace(self, name: str, trusted: bool = False, labels: dict[str, str] | None = None) -> None:
        """A namespace (created by the admin) where every tenant may `edit` (the bootstrap ClusterRole), ready
        for pods (its `default` ServiceAccount exists)."""
        labels = {**(labels or {}), **({names.TENANCY_LABEL: names.TENANCY_TRUSTED} if trusted else {})}
        self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels}})
        if self.tenants:
            self.request(
                "POST",
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{name}/rolebindings",
                {
                    "metadata": {"name": "tenants-edit"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
                    "subjects": [
                        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": self.users[t].name}
                        for t in self.tenants
                    ],
                },
            )
        wait_for(
            lambda: Rest(self.client()).get(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
            self.ready_timeout,
            f"the default ServiceAccount of namespace {name}",
            interval=0.1,
        )
        for tenant in self.tenants:
            # The RoleBinding, and the `edit` rules the role-aggregation controller adds after start-up, reach
            # the RBAC authorizer through informers: wait until the API server says the tenant may work here.
            wait_for(
                lambda tenant=tenant: self._may(tenant, name, "create", "resource.k8s.io", "resourceclaimtemplates"),
                self.ready_timeout,
                f"RBAC letting {tenant} edit namespace {name}",
                interval=0.1,
            )

    def _may(self, user: str, namespace: str, verb: str, group: str, resource: str) -> bool:
        """The API server's answer (a SubjectAccessReview) to: may ``user`` do this?"""
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": self.users[user].name,
                "resourceAttributes": {"namespace": namespace, "verb": verb, "group": group, "resource": resource},
            },
        }
        reply = self.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
        return bool((reply.get("status") or {}).get("allowed"))

    def create_job(self, user: str, job: dict[str, Any]) -> str:
        """Create the Job as ``user``; returns the name of the pod the Job controller creates for it."""
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        self.request("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", job, user=user)
        query = [("labelSelector", f"batch.kubernetes.io/job-name={name}")]
        pods = wait_for(
            lambda: self.request("GET", f"/api/v1/namespaces/{namespace}/pods", query=query)["items"],
            self.ready_timeout,
            f"the pod of Job {namespace}/{name}",
            interval=0.1,
        )
        return pods[0]["metadata"]["name"]

    def resource_path(self, plural: str, namespace: str = "", name: str = "", version: str | None = None) -> str:
        """The URL path of a resource.k8s.io collection or object, in ``version`` (default v1). For versions
        the official client has no typed API for (v1alpha3), use it with ``request``."""
        path = f"/apis/{names.RESOURCE_GROUP}/{version or 'v1'}"
        path += f"/namespaces/{namespace}/{plural}" if namespace else f"/{plural}"
        return f"{path}/{name}" if name else path

    def claims(self, namespace: str) -> list[dict[str, Any]]:
        return self.request("GET", self.resource_path("resourceclaims", namespace))["items"]

    def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return Rest(self.client()).get(self.resource_path("resourceclaims", namespace, name))

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return Rest(self.client()).get(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def pod_claim(self, namespace: str, pod_name: str, claim: str = "gpu") -> str | None:
        """The name of the claim generated for ``pod_name``'s pod claim ``claim`` (or, for a pod that asks
        for an extended resource, the claim the scheduler created), once there is one."""
        status = (self.pod(namespace, pod_name) or {}).get("status") or {}
        for entry in status.get("resourceClaimStatuses") or []:
            if entry.get("name") == claim:
                return entry.get("resourceClaimName")
        return (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")

    def taint_rule_version(self) -> str | None:
        """The newest resource.k8s.io version that serves DeviceTaintRule (v1 from 1.37, v1alpha3 on 1.34)."""
        for version in ("v1", "v1beta2", "v1alpha3"):
            with contextlib.suppress(ApiException):
                resources = self.request("GET", f"/apis/{names.RESOURCE_GROUP}/{version}")["resources"]
                if any(r["name"] == "devicetaintrules" for r in resources):
                    return version
        return None

    def taint_rules(self) -> list[dict[str, Any]]:
        version = self.taint_rule_version()
        if version is None:
            return []
        return self.request("GET", f"/apis/{names.RESOURCE_GROUP}/{version}/devicetaintrules")["items"]

    # ------------------------------------------------------------------ the audit log

    def audit_records(self) -> list[dict[str, Any]]:
        """Every record of the webhook's audit log (current file only), in order."""
        try:
            lines = self.paths.audit_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def audit_denials(self, rule: str | None = None, **match: str) -> list[dict[str, Any]]:
        """Denied records with a finding of ``rule``, whose fields equal ``match`` (e.g. namespace=, user=)."""
        return [
            r
            for r in self.audit_records()
            if r.get("decision") == "deny"
            and (rule is None or any(f["rule"]["id"] == rule for f in r.get("findings") or []))
            and all(r.get(k) == v for k, v in match.items())
        ]

    def verify_audit(self) -> subprocess.CompletedProcess[str]:
        """`scrubgate audit verify` over the audit log and against the signed checkpoints in the webhook's
        stdout, as an operator would run it."""
        checkpoints = [
            "--checkpoints",
            str(self.webhook.log_path),
            "--public-key",
            str(self.paths.certs / AUDIT_PUBLIC_KEY_FILE),
        ]
        return subprocess.run(
            [sys.executable, "-m", "scrubgate.cli", "audit", "verify", str(self.paths.audit_log), *checkpoints],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=self._env,
        )


def helm_binary() -> str:
    """helm, as `make helm-bin` (tools/build-go-tool.sh) builds it from its Go module; builds it when missing."""
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "tools" / "build-go-tool.sh"), "helm"],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if result.returncode != 0:
        raise HarnessError(f"tools/build-go-tool.sh helm failed:\n{result.stderr}")
    return result.stdout.strip().splitlines()[-1]


def object_path(doc: dict[str, Any]) -> str:
    """The URL path of ``doc`` (kinds whose plural is the regular English one, as for every kind here)."""
    api_version, kind, meta = doc["apiVersion"], doc["kind"], doc["metadata"]
    lower = kind.lower()
    plural = lower[:-1] + "ies" if lower.endswith("y") else lower + ("es" if lower.endswith("s") else "s")
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    namespace = meta.get("namespace")
    return (
        f"{prefix}/namespaces/{namespace}/{plural}/{meta['name']}" if namespace else f"{prefix}/{plural}/{meta['name']}"
    )


def denial(call: Callable[[], object]) -> tuple[int, str]:
    """Runs an API call that should be refused; returns (HTTP status, the API server's message).
    HarnessError when it went through."""
    try:
        call()
    except ApiException as exc:
        try:
            message = json.loads(exc.body or "{}").get("message") or exc.reason
        except ValueError:
            message = exc.body or exc.reason
        return exc.status, str(message)
    raise HarnessError("the API server accepted a request that should have been rejected")
