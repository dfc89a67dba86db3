"""scrubgate installed on the local cluster as a user installs it, from the kustomize base (as the built kubectl
renders it) or the Helm chart, with its secrets and policy; uninstalled and installed again in the order
docs/operations.md gives. Part of the test and demo harness (devcluster/harness.py)."""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from scrubgate.certs.generate import generate_ca, issue_serving_cert, service_sans, write_audit_key, write_tls_dir
from scrubgate.certs.inject import inject_ca_bundle, is_webhook_configuration
from scrubgate.policies import names
from scrubgate.policies.attestation import public_key_pem, without_scrubgate
from scrubgate.policies.config import DEFAULT_POLICY_PATH, parse_policy

from .controller import ControllerHost
from .controlplane import ControlPlane, binaries
from .credentials import Credentials
from .kubeapi import KubeApi
from .processes import REPO_ROOT, HarnessError
from .sim_nodes import SimNode
from .webhook import WebhookHost
from .workdir import Paths

MANIFESTS = REPO_ROOT / "manifests"
KEY_ID = "scrubgate-agent-devcluster"

# What the harness installs from the kustomize base: scrubgate's namespace, identities and RBAC, and the
# webhook configurations (overlaid). The webhook, the controller and the agent run as host processes instead of
# the base's Deployments and DaemonSet.
INSTALLED_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def render_base(manifests: Path = MANIFESTS, kubectl: str | None = None) -> list[dict[str, Any]]:
    """The kustomize base as the built `kubectl kustomize` renders it."""
    kubectl = kubectl or binaries()["kubectl"]
    result = subprocess.run(
        [kubectl, "kustomize", str(manifests)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise HarnessError(f"kubectl kustomize {manifests} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


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


class Installation:
    """scrubgate on the cluster: its manifests (``installer``: kustomize or helm, into ``namespace``), secrets and
    policy, and its processes: the webhook, the controller and each node's agent."""

    def __init__(
        self,
        paths: Paths,
        kube: KubeApi,
        control_plane: ControlPlane,
        credentials: Credentials,
        webhook: WebhookHost,
        controller: ControllerHost,
        nodes: list[SimNode],
        *,
        installer: str,
        namespace: str,
        helm_set: Iterable[str],
        env: dict[str, str],
    ) -> None:
        if installer not in ("kustomize", "helm"):
            raise ValueError(f"installer {installer!r}: kustomize or helm")
        if installer == "kustomize" and namespace != names.SYSTEM_NAMESPACE:
            raise ValueError(f"namespace {namespace!r}: the kustomize base installs into {names.SYSTEM_NAMESPACE}")
        self.paths = paths
        self.kube = kube
        self.control_plane = control_plane
        self.credentials = credentials
        self.webhook = webhook
        self.controller = controller
        self.nodes = nodes
        self.installer = installer
        self.namespace = namespace
        self.helm_set = list(helm_set)  # `--set` values of the helm install, after the harness's own
        self._env = env
        self.key_id = KEY_ID
        self._signing_key = Ed25519PrivateKey.generate()
        self.public_keys: dict[str, Ed25519PublicKey] = {KEY_ID: self._signing_key.public_key()}

    def write_secrets(self) -> None:
        """The webhook's serving certificate and audit key, the agents' signing key, and the policy that trusts it."""
        p = self.paths
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
        policy["agent"] = {"identities": [self.kube.users["agent"].name]}  # as the chart's policy names it
        controller = f"system:serviceaccount:{self.namespace}:{names.CONTROLLER_SERVICE_ACCOUNT}"
        policy["controller"] = {"identities": [controller]}
        self.write_policy(policy)

    def write_policy(self, policy: dict[str, Any]) -> None:
        """Replace the webhook's policy file (the webhook reloads it on change)."""
        tmp = self.paths.policy.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(policy, sort_keys=False))
        tmp.replace(self.paths.policy)

    def policy(self) -> dict[str, Any]:
        return yaml.safe_load(self.paths.policy.read_text())

    # ------------------------------------------------------------------ install, uninstall

    def install(self) -> None:
        """scrubgate on a new cluster: its manifests once the webhook serves, the webhook's token, then the
        controller and the agents."""
        self._webhook_and_manifests()
        self.credentials.webhook()
        self.webhook.wait_device_classes()
        self._controller_and_agents()

    def uninstall(self) -> None:
        """Removes scrubgate from the running installation, in the order docs/operations.md's "Uninstalling" gives: the
        agents first (each fences, on its way out, the teardowns it still owes, which the webhook's guard kept
        until then), then the webhook configurations, then the webhook. Fences and finalizers already placed
        stay. Also the baseline of bench/lifecycle.py: the control plane and the harness alone."""
        for node in self.nodes:
            node.agent.stop()
        self.controller.process.stop()
        for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            path = f"/apis/admissionregistration.k8s.io/v1/{kind}"
            for item in self.kube.request("GET", path)["items"]:
                if any(w.get("name", "").endswith(".scrubgate.dev") for w in item.get("webhooks") or []):
                    self.kube.request("DELETE", f"{path}/{item['metadata']['name']}")
        self._release_holds()
        self.webhook.process.stop()

    def reinstall(self) -> None:
        """scrubgate installed again after `uninstall`: the webhook, its configurations, the agents (which pick
        up what their checkpoints still owe)."""
        self._webhook_and_manifests()
        self._controller_and_agents()

    def _webhook_and_manifests(self) -> None:
        self.webhook.process.start()
        self.webhook.wait_ready()
        if self.installer == "helm":
            self._install_with_helm()
        else:
            self._install_with_kustomize()

    def _controller_and_agents(self) -> None:
        self.controller.process.start()
        self.controller.wait_ready()
        for node in self.nodes:
            node.agent.start()
        for node in self.nodes:
            node.wait_agent_ready()

    def _release_holds(self) -> None:
        """What `scrubgate uninstall` does last: the agents' holds come off the claims (their devices fenced by the
        agents on their way out), so that Kubernetes deallocates them as ever."""
        path = self.kube.resource_path("resourceclaims")
        for claim in self.kube.request("GET", path)["items"]:
            reserved = (claim.get("status") or {}).get("reservedFor") or []
            kept = without_scrubgate(claim)
            if kept != reserved:
                meta = claim["metadata"]
                claim["status"]["reservedFor"] = kept
                self.kube.request(
                    "PUT", self.kube.resource_path("resourceclaims", meta["namespace"], meta["name"]) + "/status", claim
                )

    # ------------------------------------------------------------------ the installers

    def _install_with_helm(self) -> None:
        """`helm install` of charts/scrubgate with its values for host processes (values-local.yaml): the
        webhook configurations call the Service stand-in; the namespace is created first, as docs/install.md says."""
        self.kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})
        keys = self.paths.root / "helm-keys.yaml"
        keys.write_text(yaml.safe_dump({"policy": {"attestationKeys": self.policy()["attestationKeys"]}}))
        self.helm(
            "install", "scrubgate", str(REPO_ROOT / "charts" / "scrubgate"),
            "-f", str(REPO_ROOT / "charts" / "scrubgate" / "values-local.yaml"),
            "--set", f"webhook.url=https://127.0.0.1:{self.webhook.service_port}",
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
                self.kube.apply(doc)
        configurations = inject_ca_bundle(
            [d for d in base if is_webhook_configuration(d)], (self.paths.certs / "ca.crt").read_bytes()
        )
        configurations = webhook_url_overlay(configurations, self.webhook.service_port)
        self.paths.webhook_configurations.write_text(yaml.safe_dump_all(configurations, sort_keys=False))
        for doc in configurations:
            self.kube.apply(doc)
