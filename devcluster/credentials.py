"""What the pods of scrubgate and of NVIDIA's driver mount: a token of their ServiceAccount from the
TokenRequest API, written here as a kubeconfig for the host process. Part of the test and demo harness
(devcluster/harness.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from scrubgate.policies import names

from . import driver
from .kubeapi import KubeApi
from .pki import write_kubeconfig
from .workdir import NodeFiles, Paths

log = logging.getLogger("devcluster.credentials")


class Credentials:
    """The tokens of scrubgate's ServiceAccounts in ``namespace`` and of the driver's; the agent's of
    ``first_node`` is also the ``agent`` user's of ``kube``."""

    def __init__(self, kube: KubeApi, paths: Paths, namespace: str, first_node: str) -> None:
        self.kube = kube
        self.paths = paths
        self.namespace = namespace
        self.first_node = first_node

    def agent(self, node: str, files: NodeFiles) -> None:
        """What a new agent pod gets: a token of the agent's ServiceAccount bound to its node (to the Node object
        as it is now: one deleted and registered again invalidates the tokens bound to the old one, as pod GC
        and the DaemonSet replace the pod). `agent` in the tests is the first node's. With the API server down,
        the agent starts with the token it had."""
        try:
            token = self.kube.service_account_token(self.namespace, names.AGENT_SERVICE_ACCOUNT, node)
        except Exception as exc:  # the API server down or stopping: whatever the client raised
            log.warning("no new token for the agent of %s (%s): it starts with the one it had", node, exc)
            return
        self._write(files.agent_kubeconfig, "agent", token)
        if node == self.first_node:
            self.kube.users["agent"].token = token

    def controller(self) -> None:
        """What the controller's pod mounts: a token of its ServiceAccount."""
        token = self.kube.service_account_token(self.namespace, names.CONTROLLER_SERVICE_ACCOUNT)
        self._write(self.paths.controller_kubeconfig, "controller", token)

    def webhook(self) -> None:
        """What the webhook's pod mounts once installed: a token of its ServiceAccount, whose RBAC reads
        DeviceClasses."""
        token = self.kube.service_account_token(self.namespace, names.WEBHOOK_SERVICE_ACCOUNT)
        self._write(self.paths.webhook_kubeconfig, "webhook", token)

    def driver(self) -> None:
        """What the DRA driver's kubelet plugin mounts (its ServiceAccount installed first)."""
        token = self.kube.service_account_token(driver.DRIVER_NAMESPACE, driver.DRIVER_SERVICE_ACCOUNT)
        self._write(self.paths.driver_kubeconfig, "driver", token)

    def _write(self, path: Path, user: str, token: str) -> None:
        write_kubeconfig(path, self.kube.url, self.kube.ca_file, user, {"token": token})
