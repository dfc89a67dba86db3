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

``Cluster`` starts, stops and composes the parts, each in its own module: the work directory
(devcluster/workdir.py), the API as the admin or a tenant (``cluster.kube``, devcluster/kubeapi.py), the webhook
and its Service (``cluster.webhook_host``, devcluster/webhook.py) and audit log (``cluster.audit``,
devcluster/audit.py), the controller (``cluster.controller_host``, devcluster/controller.py), the nodes
(devcluster/sim_nodes.py), the pods' tokens (devcluster/credentials.py) and scrubgate's installation
(``cluster.installation``, devcluster/install.py); the names tests call on the cluster forward to them.

A test and demo harness, not part of scrubgate (see devcluster/README.md).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from scrubgate.certs.layout import AUDIT_PUBLIC_KEY_FILE
from scrubgate.policies import names
from scrubgate.sanitizer_agent.gpu import simulated

from .audit import AuditLog
from .controller import ControllerHost
from .controlplane import ControlPlane, StaticUser
from .credentials import Credentials
from .install import KEY_ID, Installation
from .kubeapi import CLAIM_CONTROLLER_USER, KubeApi, cluster_users, denial
from .observer import Observed, Observer, invariant_violations
from .processes import REPO_ROOT, HarnessError, ManagedProcess, wait_for
from .sim_nodes import SimNode, install_nodes, node_name, wait_slices_published
from .webhook import WebhookHost
from .workdir import Paths

# Cluster, and what many tests and the demo import from here (defined in the modules they come from).
__all__ = [
    "CLAIM_CONTROLLER_USER",
    "Cluster",
    "HarnessError",
    "Observed",
    "denial",
    "invariant_violations",
    "wait_for",
]


class Cluster:
    """The installation. ``start()`` brings it up (and stops what it started if that fails), ``stop()`` /
    the context manager takes it down and removes the work directory unless ``keep`` (or it was given).

    Users: ``admin`` (system:masters) and one per name in ``tenants`` (static tokens; each may `edit` in the
    namespaces of ``create_namespace``); ``agent``, the agent's ServiceAccount (a TokenRequest token).

    ``nodes`` simulated GPU nodes (``self.nodes``, gpu-node-1, ...), each with ``gpus`` GPUs of ``mig_per_gpu``
    MIG slices and its own agent. ``audit_policy``: kube-apiserver's audit log by that policy (see ControlPlane);
    ``apiserver_profiling``: kube-apiserver serves /debug/pprof (``control_plane.cpu_profile``).
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
        apiserver_profiling: bool = False,
    ) -> None:
        self.paths = Paths(Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="scrubgate-devcluster-")))
        self.keep = keep or workdir is not None
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: a cluster needs at least one node")
        self._inventory = {"gpus": gpus, "mig_per_gpu": mig_per_gpu, "memory_bytes": memory_bytes}
        self.ready_timeout = ready_timeout
        tenants = list(tenants)
        # scrubgate's namespace: the base's, or any other with the chart (which names it wherever the base does)
        self.namespace = namespace
        self.users = cluster_users(tenants, namespace)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        self.control_plane = ControlPlane(
            self.paths.root / "control-plane",
            users=[StaticUser(u.name, u.token, u.groups) for k, u in self.users.items() if k != "agent"],
            version=version,
            admission_config=self.paths.admission_config,
            client_qps=client_qps,
            audit_policy=audit_policy,
            ready_timeout=ready_timeout,
            profiling=apiserver_profiling,
        )
        ca_file = self.control_plane.pki.ca_cert
        self.kube = KubeApi(self.control_plane.url, ca_file, self.users, tenants, ready_timeout)
        self.webhook_host = WebhookHost(self.paths, self.kube, env, ready_timeout)
        self.credentials = Credentials(self.kube, self.paths, namespace, node_name(0))
        self.controller_host = ControllerHost(self.paths, namespace, env, ready_timeout, self.credentials.controller)
        agent_args = list(agent_args)  # every node's agent gets them
        self.nodes = [
            SimNode.build(i, self.paths, env, ready_timeout, KEY_ID, agent_args, self.credentials) for i in range(nodes)
        ]
        self.installation = Installation(
            self.paths,
            self.kube,
            self.control_plane,
            self.credentials,
            self.webhook_host,
            self.controller_host,
            self.nodes,
            installer=installer,
            namespace=namespace,
            helm_set=helm_set,
            env=env,
        )
        self.audit = AuditLog(
            self.paths.audit_log, self.webhook_host.process.log_path, self.paths.certs / AUDIT_PUBLIC_KEY_FILE, env
        )
        self.observer = Observer(lambda: self.control_plane.port, self.users["admin"].token, ca_file)
        self._started = False
        self._forward_to_parts()

    def _forward_to_parts(self) -> None:
        """The names the tests use on the cluster, each the part's that holds it. The single-node ones are the
        first node's."""
        first = self.nodes[0]
        self.node = first.name
        self.agent = first.agent
        self.node_process = first.process
        self.gpu_dir = first.gpu_dir
        self.wait_agent_ready = first.wait_agent_ready
        self.agent_healthz = first.agent_healthz
        self.agent_metrics = first.agent_metrics
        self.gpus = first.gpus
        self.device_name = first.device_name
        self.device_uuid = first.device_uuid
        self.gpu_memory = first.gpu_memory
        self.inject_fault = first.inject_fault
        self.clear_faults = first.clear_faults

        plane = self.control_plane
        self.api = plane.apiserver
        self.url = plane.url
        self.version = plane.version
        self.start_api = plane.start_apiserver
        self.stop_api = plane.stop_apiserver
        self.restart_api = plane.restart_apiserver
        self.server_version = plane.server_version

        kube = self.kube
        self.client = kube.client
        self.core = kube.core
        self.resource = kube.resource
        self.request = kube.request
        self.apply = kube.apply
        self.create_namespace = kube.create_namespace
        self.create_job = kube.create_job
        self.service_account_token = kube.service_account_token
        self.resource_path = kube.resource_path
        self.claims = kube.claims
        self.claim = kube.claim
        self.pod = kube.pod
        self.pod_claim = kube.pod_claim
        self.served_versions = kube.served_versions
        self.taint_rule_version = kube.taint_rule_version
        self.taint_rules = kube.taint_rules

        webhook = self.webhook_host
        self.webhook = webhook.process
        self.webhook_port = webhook.port
        self.wait_webhook_ready = webhook.wait_ready
        self.webhook_metrics = webhook.metrics
        self.set_webhook_port = webhook.set_port
        self.call_webhook_directly = webhook.call_directly
        self.rotate_webhook_cert = webhook.rotate_cert
        self.audit_records = self.audit.records
        self.audit_denials = self.audit.denials
        self.verify_audit = self.audit.verify

        self.controller = self.controller_host.process
        self.controller_metrics = self.controller_host.metrics

        installation = self.installation
        self.key_id = installation.key_id
        self.public_keys = installation.public_keys
        self.write_policy = installation.write_policy
        self.policy = installation.policy
        self.helm = installation.helm
        self.uninstall_scrubgate = installation.uninstall
        self.reinstall_scrubgate = installation.reinstall

    def node_named(self, name: str) -> SimNode:
        """The node of that name (a device's DRA pool)."""
        return next(n for n in self.nodes if n.name == name)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Cluster:
        try:
            self._prepare()
            self.webhook_host.start_service()
            self.webhook_host.write_client_credentials()
            self.control_plane.start()
            install_nodes(self.nodes, self.kube, self.control_plane, self.credentials)
            self.installation.install()
            wait_slices_published(self.kube, self.nodes, self.ready_timeout)
            self.observer.start()
        except BaseException:
            print(self.diagnostics(), file=sys.stderr)
            self.stop()
            raise
        self._started = True
        atexit.register(self.stop)
        return self

    def _prepare(self) -> None:
        self.paths.create_directories()
        for node in self.nodes:  # UUIDs are random (uuid4): no two nodes share one
            simulated.create_inventory(node.gpu_dir, **self._inventory)
        self.installation.write_secrets()
        self.webhook_host.set_port(self.webhook_host.port)

    def stop(self) -> None:
        """Stops the agents, the webhook, the nodes (and their containers), then the control plane."""
        atexit.unregister(self.stop)
        self.observer.stop()
        if self.keep and self.paths.root.is_dir():
            self.observer.dump(self.paths.root / "observed.jsonl")
        for process in (
            *(n.agent for n in self.nodes),
            self.controller_host.process,
            self.webhook_host.process,
            *(n.process for n in self.nodes),
            self.webhook_host.service,
        ):
            process.stop()
        self.control_plane.stop()
        self.kube.close()
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
            self.webhook_host.service,
            *(n.process for n in self.nodes),
            self.webhook_host.process,
            self.controller_host.process,
            *(n.agent for n in self.nodes),
        )

    def diagnostics(self, lines: int = 30) -> str:
        """The last lines of every process log, for a failure message."""
        return "\n".join(
            f"===== {p.name} ({p.log_path}, {'running' if p.running else f'exit {p.returncode}'}) =====\n"
            f"{p.tail(lines)}"
            for p in self.processes
        )
