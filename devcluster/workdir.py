"""The layout of an installation's work directory: where each file of the harness's processes lives. Part of
the test and demo harness (devcluster/harness.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


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

    def create_directories(self) -> None:
        for directory in (
            self.root,
            self.gpus,
            self.logs,
            self.signing_key.parent,
            self.checkpoint.parent,
            self.audit_log.parent,
            self.node_kubeconfig.parent,
            self.webhook_kubeconfig.parent,
            self.controller_kubeconfig.parent,
        ):
            directory.mkdir(parents=True, exist_ok=True)


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
