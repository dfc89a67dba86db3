"""A whole scrubgate installation on one machine, for the end-to-end tests and ``make demo``.

Three separate processes, as on a real cluster: the API stand-in (``python -m devcluster.apiserver``
with the simulated control plane and one simulated GPU node), the real webhook (``scrubgate webhook``,
HTTPS with a certificate from ``scrubgate.certs``) and the real node agent (``scrubgate agent``, the
official ``kubernetes`` client, the simulated GPU backend). The webhook configurations are the
manifests' own, rendered by kustomize, with the caBundle injected. Everything binds to 127.0.0.1 on
ephemeral ports and lives in one work directory; processes write their logs there.

    with Cluster(gpus=2).start() as cluster:
        cluster.create_namespace("team-a")
        core = cluster.core("alice")            # the official client, as tenant alice
        ...
        cluster.agent.kill()                    # kill -9; .start(), .stop(), .restart() likewise
        cluster.observer.violations()           # dirty allocations, unattested finalizer removals

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
from scrubgate.certs.generate import generate_ca, issue_serving_cert, rotate_serving_cert, service_sans, write_tls_dir
from scrubgate.certs.inject import inject_ca_bundle, is_webhook_configuration
from scrubgate.policies import names
from scrubgate.policies.attestation import public_key_pem
from scrubgate.policies.config import DEFAULT_POLICY_PATH, parse_policy
from scrubgate.sanitizer_agent.gpu import GpuDevice, simulated

from .observer import Observed, Observer, invariant_violations
from .processes import REPO_ROOT, HarnessError, ManagedProcess, free_port, wait_for

__all__ = [
    "Cluster",
    "HarnessError",
    "ManagedProcess",
    "Observed",
    "Observer",
    "User",
    "denial",
    "invariant_violations",
    "render_webhook_configurations",
    "render_without_kustomize",
    "wait_for",
]

log = logging.getLogger("devcluster.harness")

MANIFESTS = REPO_ROOT / "manifests"
NODE = "gpu-node-1"
KEY_ID = "scrubgate-agent-devcluster"
AGENT_USER = f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}"
WEBHOOK_HOST = f"{names.WEBHOOK_SERVICE}.{names.SYSTEM_NAMESPACE}.svc"
WEBHOOK_CONFIG_PLURALS = {
    "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
    "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
}


# ---------------------------------------------------------------------- manifests


def render_webhook_configurations(manifests: Path = MANIFESTS) -> list[dict[str, Any]]:
    """The webhook configurations of the kustomize base, as `kubectl kustomize` renders them; on a machine
    without kubectl (``make demo`` needs only Python and make), `render_without_kustomize` builds the same."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return render_without_kustomize(manifests)
    result = subprocess.run(
        [kubectl, "kustomize", str(manifests)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise HarnessError(f"kubectl kustomize {manifests} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if is_webhook_configuration(doc)]


def render_without_kustomize(manifests: Path = MANIFESTS) -> list[dict[str, Any]]:
    """What kustomization.yaml does to webhook-configurations.yaml, read from kustomization.yaml itself:
    its ``labels`` pairs go onto each configuration, and each ``replacements`` entry copies a top-level
    field of the WebhookSettings document into ``webhooks.*.<field>`` of the selected configurations.
    The namespace transformer changes nothing here (the webhooks already name scrubgate-system).
    Anything else in those transformers is refused rather than approximated; the lifecycle tests check
    that the result equals kubectl's render."""
    kustomization = yaml.safe_load((manifests / "kustomization.yaml").read_text())
    docs = [doc for doc in yaml.safe_load_all((manifests / "webhook-configurations.yaml").read_text()) if doc]
    settings = {
        (doc["kind"], doc["metadata"]["name"]): doc
        for doc in yaml.safe_load_all((manifests / "webhook-settings.yaml").read_text())
        if doc
    }
    for entry in kustomization.get("labels") or []:
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(entry.get("pairs") or {})
    for replacement in kustomization.get("replacements") or []:
        source = replacement["source"]
        if "." in source["fieldPath"] or (source["kind"], source["name"]) not in settings:
            raise HarnessError(f"replacement source {source} is beyond render_without_kustomize; install kubectl")
        value = settings[(source["kind"], source["name"])][source["fieldPath"]]
        for target in replacement["targets"]:
            select = target["select"]
            for path in target["fieldPaths"]:
                parts = path.split(".")
                if len(parts) != 3 or parts[:2] != ["webhooks", "*"]:
                    raise HarnessError(
                        f"replacement target {path!r} is beyond render_without_kustomize; install kubectl"
                    )
                for doc in docs:
                    if doc["kind"] == select["kind"] and doc["metadata"]["name"] == select["name"]:
                        for webhook in doc["webhooks"]:
                            webhook[parts[2]] = copy.deepcopy(value)
    return docs


def policy_with_key(public_pem: str, kid: str = KEY_ID, base: Path = DEFAULT_POLICY_PATH) -> dict[str, Any]:
    """The shipped default policy with the agent's attestation key added (validated before use)."""
    data = yaml.safe_load(base.read_text())
    data["attestationKeys"] = [*(data.get("attestationKeys") or []), {"kid": kid, "publicKey": public_pem}]
    parse_policy(data, f"{base} + attestation key {kid}")
    return data


# ---------------------------------------------------------------------- users


@dataclass(frozen=True)
class User:
    name: str
    token: str
    groups: tuple[str, ...] = ()


def _flags(options: dict[str, object]) -> list[str]:
    return [str(item) for option, value in options.items() for item in (option, value)]


def _token_line(user: User) -> str:
    groups = ",".join(user.groups)
    return f'{user.token},{user.name},uid-{user.name.replace(":", "-")},"{groups}"'


# ---------------------------------------------------------------------- the cluster


@dataclass
class Paths:
    root: Path
    gpus: Path = field(init=False)
    certs: Path = field(init=False)
    signing_key: Path = field(init=False)
    policy: Path = field(init=False)
    tokens: Path = field(init=False)
    services: Path = field(init=False)
    api_state: Path = field(init=False)
    api_port: Path = field(init=False)
    checkpoint: Path = field(init=False)
    kubeconfig: Path = field(init=False)
    audit_log: Path = field(init=False)
    webhook_configurations: Path = field(init=False)
    logs: Path = field(init=False)

    def __post_init__(self) -> None:
        r = self.root
        self.gpus = r / "gpus"
        self.certs = r / "certs"
        self.signing_key = r / "attestation" / "ed25519.pem"
        self.policy = r / "policy.yaml"
        self.tokens = r / "tokens.csv"
        self.services = r / "services.json"
        self.api_state = r / "api"
        self.api_port = r / "api.port"
        self.checkpoint = r / "agent" / "checkpoint.json"
        self.kubeconfig = r / "agent" / "kubeconfig.yaml"
        self.audit_log = r / "audit" / "audit.jsonl"
        self.webhook_configurations = r / "webhook-configurations.yaml"
        self.logs = r / "logs"


class Cluster:
    """The installation. ``start()`` brings it up (and stops what it started if that fails), ``stop()`` /
    the context manager takes it down and removes the work directory unless ``keep`` (or it was given).

    Users (bearer tokens in the stand-in's token file): ``admin`` (system:masters), ``agent`` (the agent's
    ServiceAccount) and one per name in ``tenants`` (no special groups).
    """

    def __init__(
        self,
        workdir: Path | str | None = None,
        *,
        node: str = NODE,
        gpus: int = 2,
        mig_per_gpu: int = 0,
        memory_bytes: int = 1 << 20,
        tenants: Iterable[str] = ("alice", "bob"),
        resource_versions: Iterable[str] | None = None,
        taint_rule_versions: Iterable[str] | None = None,
        agent_args: Iterable[str] = ("--resync", "5", "--retry-backoff", "1", "--drain-timeout", "10"),
        keep: bool = False,
        ready_timeout: float = 60.0,
    ) -> None:
        self.paths = Paths(Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="scrubgate-devcluster-")))
        self.keep = keep or workdir is not None
        self.node = node
        self.gpu_dir = self.paths.gpus / node
        self._inventory = {"gpus": gpus, "mig_per_gpu": mig_per_gpu, "memory_bytes": memory_bytes}
        self.ready_timeout = ready_timeout
        self.users: dict[str, User] = {
            "admin": User("kubernetes-admin", secrets.token_hex(16), ("system:masters",)),
            "agent": User(
                AGENT_USER,
                secrets.token_hex(16),
                ("system:serviceaccounts", f"system:serviceaccounts:{names.SYSTEM_NAMESPACE}"),
            ),
        }
        for name in tenants:
            self.users[name] = User(name, secrets.token_hex(16))
        self.key_id = KEY_ID
        self._signing_key = Ed25519PrivateKey.generate()
        self.public_keys: dict[str, Ed25519PublicKey] = {KEY_ID: self._signing_key.public_key()}
        self.api_port = 0
        self.webhook_port = free_port()
        self.agent_metrics_port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        self._env = env
        self._extra_api_args: list[str] = []  # an older or partial cluster (see apiserver --help)
        if resource_versions is not None:
            self._extra_api_args += ["--resource-versions", ",".join(resource_versions) or "none"]
        if taint_rule_versions is not None:
            self._extra_api_args += ["--taint-rule-versions", ",".join(taint_rule_versions) or "none"]
        self._agent_args = list(agent_args)
        self.api = ManagedProcess("API stand-in", [], self.paths.logs / "apiserver.log", env)
        self.webhook = ManagedProcess("webhook", self._webhook_argv(), self.paths.logs / "webhook.log", env)
        self.agent = ManagedProcess("agent", self._agent_argv(), self.paths.logs / "agent.log", env)
        self.observer = Observer(lambda: self.api_port, self.users["admin"].token)
        self._clients: dict[str, k8s.ApiClient] = {}
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Cluster:
        try:
            self._prepare()
            self.start_api()
            self.webhook.start()
            self._install()
            self.agent.start()
            self.wait_webhook_ready()
            self.wait_agent_ready()
            wait_for(self._slice_published, self.ready_timeout, f"the ResourceSlice of node {self.node}")
            self.observer.start()
        except BaseException:
            self.stop()
            raise
        self._started = True
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Stops the agent, the webhook and the API stand-in (which stops its containers), in that order."""
        atexit.unregister(self.stop)
        self.observer.stop()
        for process in (self.agent, self.webhook, self.api):
            process.stop()
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

    def diagnostics(self, lines: int = 30) -> str:
        """The last lines of every process log, for a failure message."""
        return "\n".join(
            f"===== {p.name} ({p.log_path}, {'running' if p.running else f'exit {p.returncode}'}) =====\n"
            f"{p.tail(lines)}"
            for p in (self.api, self.webhook, self.agent)
        )

    # ------------------------------------------------------------------ set-up

    def _prepare(self) -> None:
        p = self.paths
        for directory in (p.root, p.gpus, p.logs, p.signing_key.parent, p.checkpoint.parent, p.audit_log.parent):
            directory.mkdir(parents=True, exist_ok=True)
        simulated.create_inventory(self.gpu_dir, **self._inventory)
        ca = generate_ca()
        write_tls_dir(p.certs, ca, issue_serving_cert(ca, service_sans()))
        p.signing_key.write_bytes(
            self._signing_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        p.signing_key.chmod(0o600)
        self.write_policy(policy_with_key(public_key_pem(self._signing_key)))
        p.tokens.write_text("".join(_token_line(u) + "\n" for u in self.users.values()))
        self.set_webhook_port(self.webhook_port)

    def write_policy(self, policy: dict[str, Any]) -> None:
        """Replace the webhook's policy file (the webhook reloads it on change)."""
        tmp = self.paths.policy.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(policy, sort_keys=False))
        tmp.replace(self.paths.policy)

    def policy(self) -> dict[str, Any]:
        return yaml.safe_load(self.paths.policy.read_text())

    def _install(self) -> None:
        """The system namespace, then the manifests' webhook configurations with the caBundle."""
        self.request("POST", "/api/v1/namespaces", {"metadata": {"name": names.SYSTEM_NAMESPACE}})
        docs = inject_ca_bundle(render_webhook_configurations(), (self.paths.certs / "ca.crt").read_bytes())
        self.paths.webhook_configurations.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        for doc in docs:
            self.request("POST", f"/apis/admissionregistration.k8s.io/v1/{WEBHOOK_CONFIG_PLURALS[doc['kind']]}", doc)

    def _api_argv(self) -> list[str]:
        p = self.paths
        options = {
            "--port": self.api_port,
            "--port-file": p.api_port,
            "--state-dir": p.api_state,
            "--token-file": p.tokens,
            "--services-file": p.services,
            "--node": f"{self.node}={self.gpu_dir}",
        }
        return [
            sys.executable,
            "-m",
            "devcluster.apiserver",
            "--control-plane",
            *_flags(options),
            *self._extra_api_args,
        ]

    def _webhook_argv(self) -> list[str]:
        p = self.paths
        options = {
            "--host": "127.0.0.1",
            "--port": self.webhook_port,
            "--tls-cert": p.certs / "tls.crt",
            "--tls-key": p.certs / "tls.key",
            "--policy": p.policy,
            "--audit-log": p.audit_log,
        }
        return [sys.executable, "-m", "scrubgate.cli", "webhook", *_flags(options)]

    def _agent_argv(self) -> list[str]:
        p = self.paths
        options = {
            "--node": self.node,
            "--gpu-backend": "simulated",
            "--simulated-root": self.gpu_dir,
            "--kubeconfig": p.kubeconfig,
            "--signing-key": p.signing_key,
            "--key-id": self.key_id,
            "--checkpoint": p.checkpoint,
            "--nvidia-checkpoint": "",  # no NVIDIA driver checkpoint on a simulated node
            "--metrics-address": "127.0.0.1",
            "--metrics-port": self.agent_metrics_port,  # /healthz tells when the agent is ready
        }
        return [sys.executable, "-m", "scrubgate.cli", "agent", *_flags(options), *self._agent_args]

    def _write_kubeconfig(self) -> None:
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "devcluster", "cluster": {"server": self.url}}],
            "users": [{"name": "agent", "user": {"token": self.users["agent"].token}}],
            "contexts": [{"name": "agent", "context": {"cluster": "devcluster", "user": "agent"}}],
            "current-context": "agent",
        }
        self.paths.kubeconfig.write_text(yaml.safe_dump(kubeconfig))
        self.paths.kubeconfig.chmod(0o600)

    # ------------------------------------------------------------------ the processes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def start_api(self) -> None:
        """Start the stand-in (again, on the same port and state after the first start) and wait for it."""
        self.paths.api_port.unlink(missing_ok=True)
        self.api.argv = self._api_argv()
        self.api.start()
        port = wait_for(lambda: self._read_port() or self.api.check_alive(), self.ready_timeout, "the API port file")
        self.api_port = int(port)
        self._write_kubeconfig()
        wait_for(lambda: self._api_answers() or self.api.check_alive(), self.ready_timeout, "the API stand-in")

    def restart_api(self, crash: bool = False) -> None:
        """Stop (or kill -9 with ``crash``) and start the stand-in; its objects survive in the state dir."""
        self.api.kill() if crash else self.api.stop()
        self.start_api()

    def _read_port(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return self.paths.api_port.read_text().strip()
        return ""

    def _api_answers(self) -> bool:
        try:
            self.request("GET", "/version")
        except (OSError, ApiException, HarnessError):
            return False
        return True

    def wait_webhook_ready(self, timeout: float | None = None) -> None:
        wait_for(
            lambda: self.webhook_get("/readyz")[0] == 200 or self.webhook.check_alive(),
            timeout or self.ready_timeout,
            f"the webhook's /readyz on 127.0.0.1:{self.webhook_port}",
        )

    def wait_agent_ready(self, timeout: float | None = None) -> None:
        wait_for(
            lambda: self.agent_healthz()[0] == 200 or self.agent.check_alive(),
            timeout or self.ready_timeout,
            f"the agent's /healthz on 127.0.0.1:{self.agent_metrics_port}",
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

    def agent_healthz(self) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.agent_metrics_port, timeout=5)
        try:
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as exc:
            return 0, str(exc)
        finally:
            conn.close()

    def agent_metrics(self) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.agent_metrics_port, timeout=5)
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def set_webhook_port(self, port: int | None) -> None:
        """Where the stand-in dials the webhook Service; None: no endpoints (the webhook unreachable)."""
        mapping = {} if port is None else {f"{names.SYSTEM_NAMESPACE}/{names.WEBHOOK_SERVICE}": port}
        tmp = self.paths.services.with_suffix(".tmp")
        tmp.write_text(json.dumps(mapping))
        tmp.replace(self.paths.services)

    def rotate_webhook_cert(self) -> None:
        """A new serving certificate from the same CA, written in place (the webhook reloads it)."""
        rotate_serving_cert(self.paths.certs, service_sans())

    def _slice_published(self) -> bool:
        body = self.request("GET", f"/apis/{names.RESOURCE_GROUP}/{self._served_version()}/resourceslices")
        return any((s.get("spec") or {}).get("nodeName") == self.node for s in body.get("items") or [])

    def _served_version(self) -> str:
        groups = self.request("GET", f"/apis/{names.RESOURCE_GROUP}")
        return groups["preferredVersion"]["version"]

    # ------------------------------------------------------------------ clients

    def client(self, user: str = "admin") -> k8s.ApiClient:
        """The official client, authenticated as ``user`` (a key of ``users``)."""
        if user not in self._clients:
            configuration = k8s.Configuration(
                host=self.url,
                api_key={"authorization": self.users[user].token},
                api_key_prefix={"authorization": "Bearer"},
            )
            self._clients[user] = k8s.ApiClient(configuration)
        api_client = self._clients[user]
        api_client.configuration.host = self.url  # the port is kept across restarts, but be sure
        return api_client

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
        api_client = self.client(user)
        params = api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or None,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = api_client.call_api(*params, _request_timeout=30)
        data = response.read()
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))
        return json.loads(data) if data else {}

    def create_namespace(self, name: str, trusted: bool = False) -> None:
        labels = {names.TENANCY_LABEL: names.TENANCY_TRUSTED} if trusted else {}
        self.request("POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": labels}})

    def resource_path(self, plural: str, namespace: str = "", name: str = "", version: str | None = None) -> str:
        """The URL path of a resource.k8s.io collection or object, in ``version`` (default: the preferred
        one). For versions the official client has no typed API for (v1alpha3 claims), use it with
        ``request``."""
        path = f"/apis/{names.RESOURCE_GROUP}/{version or self._served_version()}"
        path += f"/namespaces/{namespace}/{plural}" if namespace else f"/{plural}"
        return f"{path}/{name}" if name else path

    def claims(self, namespace: str) -> list[dict[str, Any]]:
        return self.request("GET", self.resource_path("resourceclaims", namespace))["items"]

    def claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", self.resource_path("resourceclaims", namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def pod_claim(self, namespace: str, pod_name: str, claim: str = "gpu") -> str | None:
        """The name of the claim generated for ``pod_name``'s pod claim ``claim``, once there is one."""
        pod = self.pod(namespace, pod_name) or {}
        for status in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if status.get("name") == claim:
                return status.get("resourceClaimName")
        return None

    def taint_rules(self) -> list[dict[str, Any]]:
        for version in ("v1", "v1beta2", "v1alpha3"):
            with contextlib.suppress(ApiException):
                return self.request("GET", f"/apis/{names.RESOURCE_GROUP}/{version}/devicetaintrules")["items"]
        return []

    # ------------------------------------------------------------------ the node's GPUs

    def gpus(self) -> list[GpuDevice]:
        return simulated.SimulatedGpu(self.gpu_dir).list_devices()

    def device_name(self, device_uuid: str) -> str:
        """The DRA device name (gpu-0, gpu-0-mig-1, ...) the driver publishes for a UUID."""
        from .driver import device_names

        return device_names(self.gpus())[device_uuid]

    def device_uuid(self, device_name: str) -> str:
        from .driver import device_names

        return {v: k for k, v in device_names(self.gpus()).items()}[device_name]

    def gpu_memory(self, device_uuid: str) -> bytes:
        """The device's memory as a tenant (or an attacker with the device) would read it."""
        return simulated.read(self.gpu_dir, device_uuid)

    def gpu_processes(self, device_uuid: str) -> list[int]:
        return [p.pid for p in simulated.SimulatedGpu(self.gpu_dir).processes(device_uuid)]

    def inject_fault(self, device_uuid: str, kind: simulated.FaultKind, value: Any = True) -> None:
        simulated.inject_fault(self.gpu_dir, device_uuid, kind, value)

    def clear_faults(self, device_uuid: str | None = None) -> None:
        simulated.clear_faults(self.gpu_dir, device_uuid)

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
        """`scrubgate audit verify` over the audit log, as an operator would run it."""
        return subprocess.run(
            [sys.executable, "-m", "scrubgate.cli", "audit", "verify", str(self.paths.audit_log)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=self._env,
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
