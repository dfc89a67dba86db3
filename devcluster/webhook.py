"""scrubgate's webhook as a host process behind the stand-in of its Service (devcluster/serviceproxy.py): their
ports, the API server's client certificate for them, readiness, metrics, the Service's endpoint, calls past
the Service, and certificate rotation. Part of the test and demo harness (devcluster/harness.py)."""

from __future__ import annotations

import json

import yaml
from kubernetes.client.exceptions import ApiException
from scrubgate.certs.generate import generate_ca, rotate_serving_cert, service_sans
from scrubgate.policies import names

from . import workloads
from .commands import service_argv, webhook_argv
from .kubeapi import KubeApi
from .pki import issue_client_cert
from .probes import https_get, probe
from .processes import ManagedProcess, free_port, wait_for
from .serviceproxy import applied_file
from .workdir import Paths

WEBHOOK_HOST = f"{names.WEBHOOK_SERVICE}.{names.SYSTEM_NAMESPACE}.svc"


class WebhookHost:
    """The webhook (``process``, serving on ``port``, metrics on ``metrics_port``) and its Service's stand-in
    (``service``, on ``service_port`` once started)."""

    def __init__(self, paths: Paths, kube: KubeApi, env: dict[str, str], ready_timeout: float) -> None:
        self.paths = paths
        self.kube = kube
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.metrics_port = free_port()
        self.service_port = 0
        self.service = ManagedProcess("webhook Service", service_argv(paths), paths.logs / "service.log", env)
        self.process = ManagedProcess(
            "webhook", webhook_argv(paths, self.port, self.metrics_port), paths.logs / "webhook.log", env
        )

    def start_service(self) -> None:
        """The Service's stand-in, once it has told its port."""
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

    def write_client_credentials(self) -> None:
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
                for port in (self.service_port, self.port)
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

    def wait_ready(self, timeout: float | None = None) -> None:
        wait_for(
            lambda: self.get("/readyz")[0] == 200 or self.process.check_alive(),
            timeout or self.ready_timeout,
            f"the webhook's /readyz on 127.0.0.1:{self.port}",
        )

    def wait_device_classes(self) -> None:
        """Until the webhook has read the DeviceClasses (until then it guards every claim)."""
        wait_for(
            lambda: '"deviceClasses": true' in self.get("/readyz")[1] or self.process.check_alive(),
            self.ready_timeout,
            "the webhook's list of DeviceClasses",
        )

    def get(self, path: str) -> tuple[int, str]:
        """GET over HTTPS as the API server connects: to 127.0.0.1, verifying the CA and the service name.
        (0, reason) when it cannot connect."""
        return https_get(self.port, path, self.paths.certs / "ca.crt", WEBHOOK_HOST)

    def metrics(self) -> tuple[int, str]:
        """GET /metrics from the webhook's metrics port (plain HTTP, as Prometheus scrapes it); (0, reason) when
        it cannot connect."""
        return probe(self.metrics_port, "/metrics")

    def set_port(self, port: int | None) -> None:
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

    def call_directly(self) -> None:
        """The webhook configurations pointed at the webhook's own port, past the Service stand-in: its Python
        forwarder adds tens of milliseconds to each call under load, where kube-proxy forwards in the kernel. For
        the benchmarks, which measure scrubgate, not the harness. Returns once the API server calls it that way
        (a dry-run GPU claim passes while the Service has no endpoints)."""
        configurations = list(yaml.safe_load_all(self.paths.webhook_configurations.read_text()))
        for doc in configurations:
            for webhook in doc.get("webhooks") or []:
                config = webhook["clientConfig"]
                config["url"] = config["url"].replace(f":{self.service_port}/", f":{self.port}/", 1)
            doc["metadata"].pop("resourceVersion", None)
            self.kube.apply(doc)
        claim = workloads.resource_claim("direct-call-probe")
        path = f"/apis/{names.RESOURCE_GROUP}/v1/namespaces/default/resourceclaims"

        def passes() -> bool:
            try:
                self.kube.request("POST", path, claim, query=[("dryRun", "All")])
            except ApiException:
                return False
            return True

        self.set_port(None)
        try:
            wait_for(passes, self.ready_timeout, "the API server calling the webhook at its own port")
        finally:
            self.set_port(self.port)

    def rotate_cert(self) -> None:
        """A new serving certificate from the same CA, written in place (the webhook reloads it)."""
        rotate_serving_cert(self.paths.certs, [*service_sans(), "127.0.0.1"])
