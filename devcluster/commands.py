"""The command lines of the installation's host processes: the webhook Service's stand-in, each node, and
scrubgate's webhook, controller and agent as the base's Deployments and DaemonSet run them. Part of the test
and demo harness (devcluster/harness.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from scrubgate.certs.layout import AUDIT_KEY_FILE

from .workdir import NodeFiles, Paths


def _flags(options: dict[str, object]) -> list[str]:
    return [str(item) for option, value in options.items() for item in (option, value)]


def service_argv(paths: Paths) -> list[str]:
    return [
        sys.executable,
        "-m",
        "devcluster.serviceproxy",
        "--port-file",
        str(paths.proxy_port),
        "--endpoints-file",
        str(paths.endpoints),
    ]


def node_argv(paths: Paths, name: str, files: NodeFiles) -> list[str]:
    options = {
        "--node": name,
        "--gpu-root": files.gpus,
        "--kubeconfig": files.kubeconfig,
        "--driver-kubeconfig": paths.driver_kubeconfig,  # one ServiceAccount, as the driver's DaemonSet
    }
    return [sys.executable, "-m", "devcluster.node", *_flags(options)]


def webhook_argv(paths: Paths, port: int, metrics_port: int) -> list[str]:
    p = paths
    options = {
        "--host": "127.0.0.1",
        "--port": port,
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
        "--metrics-port": metrics_port,
    }
    return [sys.executable, "-m", "scrubgate.cli", "webhook", *_flags(options)]


def controller_argv(paths: Paths, namespace: str, metrics_port: int) -> list[str]:
    options = {
        "--kubeconfig": paths.controller_kubeconfig,  # its ServiceAccount's token, written at each start
        "--namespace": namespace,  # its Lease's
        "--identity": "devcluster",
        "--policy": paths.policy,
        # A GPU claim no agent labelled within 5 s (the tests stop agents and wait for the label): past the agent's
        # --record-after (2 s), whose write carries the label, as 10 s is in production.
        "--label-after": 5,
        "--metrics-address": "127.0.0.1",
        "--metrics-port": metrics_port,
    }
    return [sys.executable, "-m", "scrubgate.cli", "controller", *_flags(options)]


def agent_argv(
    paths: Paths, name: str, files: NodeFiles, key_id: str, metrics_port: int, extra: Iterable[str]
) -> list[str]:
    options = {
        "--node": name,
        "--gpu-backend": "simulated",
        "--simulated-root": files.gpus,
        # every node's agent: the one ServiceAccount and key, as the DaemonSet, its token bound to its node
        "--kubeconfig": files.agent_kubeconfig,
        "--signing-key": paths.signing_key,
        "--key-id": key_id,
        "--checkpoint": files.checkpoint,
        "--nvidia-checkpoint": "",  # no NVIDIA driver checkpoint on a simulated node
        "--metrics-address": "127.0.0.1",
        "--metrics-port": metrics_port,  # /healthz tells when the agent is ready
    }
    return [sys.executable, "-m", "scrubgate.cli", "agent", *_flags(options), *extra]
