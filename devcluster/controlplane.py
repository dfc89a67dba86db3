"""A real Kubernetes control plane on one machine: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, built from their Go modules by ``make cluster-bins`` (devcluster/k8s/build.sh), each its own
process with its own identity, as kubeadm would set them up.

- kube-apiserver: a serving certificate from the cluster CA, a service-account signing key,
  ``--authorization-mode=Node,RBAC``, the NodeRestriction admission plugin, every ``resource.k8s.io``
  version the release has, and the DRA feature gates it knows (device taints and DeviceTaintRules,
  extended resources, partitionable devices); static tokens for the test's human users.
- kube-controller-manager with ``--use-service-account-credentials`` (the resourceclaim controller acts as
  ``system:serviceaccount:kube-system:resource-claim-controller``, as in production) and the controllers a
  GPU workload touches.
- kube-scheduler as ``system:kube-scheduler``.

Everything listens on 127.0.0.1 on ephemeral ports and lives under one directory; logs stay there.
Part of the test and demo harness (see devcluster/README.md), not of scrubgate.
"""

from __future__ import annotations

import functools
import json
import os
import re
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client as k8s
from kubernetes import config as k8s_config

from .pki import Credential, Pki
from .processes import REPO_ROOT, HarnessError, ManagedProcess, free_port, wait_for

BUILD_SCRIPT = REPO_ROOT / "devcluster" / "k8s" / "build.sh"
GO_MOD = REPO_ROOT / "devcluster" / "k8s" / "go.mod"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")

# What a GPU workload touches, by the names kube-controller-manager's --controllers takes.
CONTROLLERS = (
    "serviceaccount-controller",  # the `default` ServiceAccount a pod needs to be admitted
    "clusterrole-aggregation-controller",  # the aggregated admin/edit/view roles tenants are bound to
    "root-ca-certificate-publisher-controller",
    "garbage-collector-controller",  # a generated claim goes with its pod
    "pod-garbage-collector-controller",  # pods of a deleted node
    # Lifts the not-ready taint the TaintNodesByCondition admission plugin puts on every new Node (a node may
    # not edit its own taints), from the kubelet's Ready condition and Lease heartbeats.
    "node-lifecycle-controller",
    "namespace-controller",
    "job-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "disruption-controller",  # PodDisruptionBudgets, which the Eviction API consults
    "resourceclaim-controller",
    "device-taint-eviction-controller",
)

# DRA feature gates we want on; each is passed only where the release lists it as alpha or beta.
FEATURE_GATES = (
    "DynamicResourceAllocation",
    "DRADeviceTaints",
    "DRADeviceTaintRules",
    "DRAExtendedResource",
    "DRAPartitionableDevices",
    "DRAPrioritizedList",
    "DRAAdminAccess",
    "DRAResourceClaimDeviceStatus",
)

RESOURCE_VERSIONS = ("v1beta1", "v1beta2", "v1alpha3")  # v1 is on by default from 1.34


def pinned_version() -> str:
    """The release devcluster/k8s/go.mod pins: the default."""
    match = re.search(r"^\tk8s\.io/kubernetes v(\S+)", GO_MOD.read_text(), re.M)
    if match is None:
        raise HarnessError(f"{GO_MOD} does not require k8s.io/kubernetes")
    return match.group(1)


def cache_root() -> Path:
    return Path(os.environ.get("SCRUBGATE_CACHE") or Path.home() / ".cache" / "scrubgate")


@dataclass(frozen=True)
class Binaries:
    version: str
    dir: Path

    def __getitem__(self, name: str) -> str:
        return str(self.dir / name)


def binaries(version: str | None = None) -> Binaries:
    """The built binaries of ``version`` (default: $K8S_VERSION, else the pinned release). A missing build is
    an error that says how to make it: never a fallback to something else."""
    version = (version or os.environ.get("K8S_VERSION") or pinned_version()).removeprefix("v")
    directory = cache_root() / "k8s" / f"v{version}" / "bin"
    missing = [name for name in BINARIES if not (directory / name).is_file()]
    if missing or not (directory / ".complete").is_file():
        raise HarnessError(
            f"the Kubernetes v{version} control plane is not built ({', '.join(missing) or 'build unfinished'} "
            f"missing in {directory}); run `make cluster-bins` (K8S_VERSION={version}), which builds etcd, "
            "kube-apiserver, kube-controller-manager, kube-scheduler and kubectl from their Go modules (needs Go)"
        )
    return Binaries(version, directory)


@functools.cache
def known_feature_gates(apiserver: str) -> frozenset[str]:
    """The alpha and beta feature gates this kube-apiserver build lists in its own --help (GA gates are not
    listed: they are on, and setting a locked one is an error)."""
    result = subprocess.run([apiserver, "--help"], capture_output=True, text=True, timeout=60, check=False)
    return frozenset(re.findall(r"^\s+(?:kube:)?([A-Z][A-Za-z0-9]+)=true\|false", result.stdout, re.M))


@dataclass(frozen=True)
class StaticUser:
    """A human user of the API server's static token file."""

    name: str
    token: str
    groups: tuple[str, ...] = ()


class ControlPlane:
    """``start()`` brings up etcd, kube-apiserver (ready), kube-controller-manager and kube-scheduler (or,
    with ``controllers=False``, only the first two: an API to talk to and nothing acting on it);
    ``stop()`` stops them in reverse. The data directory survives restarts of any of them.
    ``runtime_config`` adds ``--runtime-config`` entries (``resource.k8s.io/v1/devicetaintrules=false``).
    ``client_qps`` sets the client rate limit of kube-controller-manager and kube-scheduler (``--kube-api-qps``,
    burst twice that); None keeps their defaults (20 and 50 requests/s), which bound a cluster's pod churn:
    the resourceclaim controller makes four to six requests for every pod with a claim.
    ``audit_policy``: kube-apiserver writes an audit log (JSON lines, ``audit_log``) by that policy file; None
    (the default): no audit log."""

    def __init__(
        self,
        root: Path,
        *,
        users: list[StaticUser],
        version: str | None = None,
        admission_config: Path | None = None,
        runtime_config: tuple[str, ...] = (),
        controllers: bool = True,
        client_qps: float | None = None,
        audit_policy: Path | None = None,
        ready_timeout: float = 120.0,
        profiling: bool = False,
    ) -> None:
        self.root = root
        self.audit_policy = audit_policy
        self.profiling = profiling  # kube-apiserver serves /debug/pprof (bench/apiserver_cpu.py)
        self.client_qps = client_qps
        self.runtime_config = runtime_config
        self.controllers = controllers
        self.bins = binaries(version)
        self.pki = Pki(root / "pki")
        self.users = users
        self.admission_config = admission_config
        self.ready_timeout = ready_timeout
        self.logs = root / "logs"
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.port = free_port()
        self.scheduler_port = free_port()  # kube-scheduler's /metrics (its queue's counters)
        self.controller_manager_port = free_port()  # kube-controller-manager's /metrics (its workqueues' retries)
        self.credentials: dict[str, Credential] = {}
        self.etcd = ManagedProcess("etcd", [], self.logs / "etcd.log")
        self.apiserver = ManagedProcess("kube-apiserver", [], self.logs / "kube-apiserver.log")
        self.controller_manager = ManagedProcess(
            "kube-controller-manager", [], self.logs / "kube-controller-manager.log"
        )
        self.scheduler = ManagedProcess("kube-scheduler", [], self.logs / "kube-scheduler.log")

    @property
    def processes(self) -> tuple[ManagedProcess, ...]:
        return (self.etcd, self.apiserver, self.controller_manager, self.scheduler)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def version(self) -> str:
        return self.bins.version

    @property
    def audit_log(self) -> Path:
        """kube-apiserver's audit log, written where ``audit_policy`` is given."""
        return self.logs / "audit.jsonl"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> ControlPlane:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pki.create()
        self.credentials = {
            "admin": self.pki.client("admin", "kubernetes-admin", ("system:masters",), self.url),
            "controller-manager": self.pki.client("controller-manager", "system:kube-controller-manager", (), self.url),
            "scheduler": self.pki.client("scheduler", "system:kube-scheduler", (), self.url),
        }
        (self.root / "tokens.csv").write_text(
            "".join(f'{u.token},{u.name},uid-{u.name},"{",".join(u.groups)}"\n' for u in self.users)
        )
        self.etcd.argv = self._etcd_argv()
        self.apiserver.argv = self._apiserver_argv()
        self.controller_manager.argv = self._controller_manager_argv()
        self.scheduler.argv = self._scheduler_argv()
        self.start_etcd()
        self.start_apiserver()
        if self.controllers:
            self.controller_manager.start()
            self.scheduler.start()
        return self

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def admin_client(self) -> k8s.ApiClient:
        """The official client as kubernetes-admin (client certificate)."""
        return k8s_config.new_client_from_config(config_file=str(self.credentials["admin"].kubeconfig))

    def start_etcd(self) -> None:
        self.etcd.start()
        wait_for(lambda: self._etcd_healthy() or self.etcd.check_alive(), self.ready_timeout, "etcd's /health")

    def start_apiserver(self) -> None:
        self.apiserver.stop()  # one shutting down (stop_apiserver) finishes first
        self.apiserver.start()
        wait_for(
            lambda: self.get("/readyz")[0] == 200 or self.apiserver.check_alive(),
            self.ready_timeout,
            f"kube-apiserver's /readyz on {self.url}",
            interval=0.2,
        )
        # After an outage, kube-controller-manager's and kube-scheduler's informers would list again only after
        # client-go's reflector backoff (up to [30, 60) s after repeated failures, reset only after 2 minutes
        # without one), and every test after this one would wait that out too, with its pods unscheduled and its
        # claims never deallocated. Restarted, as a cluster restarts them once they lose their leader lease,
        # they list at once.
        for process in (self.controller_manager, self.scheduler):
            if process.running:
                process.restart()

    def stop_apiserver(self, crash: bool = False) -> None:
        """kill -9, or SIGTERM; returns once it no longer answers (a graceful shutdown may take a while longer to
        exit: ``start_apiserver`` waits for that)."""
        if crash:
            self.apiserver.kill()
            return
        self.apiserver.terminate()
        wait_for(lambda: self.get("/readyz")[0] == 0, self.ready_timeout, "kube-apiserver to stop answering")

    def restart_apiserver(self, crash: bool = False) -> None:
        self.apiserver.kill() if crash else self.apiserver.stop()
        self.start_apiserver()

    def restart_etcd(self, crash: bool = False) -> None:
        self.etcd.kill() if crash else self.etcd.stop()
        self.start_etcd()
        wait_for(lambda: self.get("/readyz")[0] == 200, self.ready_timeout, "kube-apiserver ready after etcd's restart")

    def diagnostics(self, lines: int = 30) -> list[tuple[ManagedProcess, str]]:
        return [(p, p.tail(lines)) for p in self.processes]

    # ------------------------------------------------------------------ requests as the admin

    def ssl_context(self, credential: str = "admin") -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        cred = self.credentials[credential]
        context.load_cert_chain(str(cred.cert), str(cred.key))
        return context

    def get(self, path: str, port: int | None = None) -> tuple[int, str]:
        """GET as the admin, from kube-apiserver or the component serving on `port`; (0, reason) when nothing
        answers."""
        base = f"https://127.0.0.1:{port}" if port else self.url
        try:
            with urllib.request.urlopen(base + path, context=self.ssl_context(), timeout=5) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (OSError, ValueError) as exc:
            return 0, str(exc)

    def cpu_profile(self, seconds: int) -> bytes:
        """kube-apiserver's CPU profile over the next `seconds` (pprof's format, gzipped), read as the admin; it
        serves one only when started with `profiling`."""
        url = f"{self.url}/debug/pprof/profile?seconds={seconds}"
        try:
            with urllib.request.urlopen(url, context=self.ssl_context(), timeout=seconds + 30) as resp:
                return resp.read()
        except OSError as exc:  # HTTPError included
            raise HarnessError(f"kube-apiserver's CPU profile ({url}): {exc}") from exc

    def server_version(self) -> dict[str, str]:
        status, body = self.get("/version")
        if status != 200:
            raise HarnessError(f"GET /version: HTTP {status}: {body}")
        return json.loads(body)

    def _etcd_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health", timeout=2) as resp:
                return resp.status == 200
        except (OSError, ValueError):
            return False

    # ------------------------------------------------------------------ command lines

    def _etcd_argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        return [
            self.bins["etcd"],
            "--name=devcluster",
            f"--data-dir={self.root / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=devcluster={peer}",
            "--log-level=warn",
            # Progress notifications every second (default 10 min) keep kube-apiserver's watch caches current
            # while their resource does not change, so the bookmarks the observer's sync waits for advance.
            "--watch-progress-notify-interval=1s",
            # As envtest does: a throwaway cluster on a shared disk; a crash test kills etcd, not the machine.
            "--unsafe-no-fsync",
        ]

    def _feature_gates(self) -> str:
        known = known_feature_gates(self.bins["kube-apiserver"])
        return ",".join(f"{gate}=true" for gate in FEATURE_GATES if gate in known)

    def _apiserver_argv(self) -> list[str]:
        pki = self.pki
        runtime = ",".join([*(f"resource.k8s.io/{v}=true" for v in RESOURCE_VERSIONS), *self.runtime_config])
        argv = [
            self.bins["kube-apiserver"],
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.root / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}",
            f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--token-auth-file={self.root / 'tokens.csv'}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--endpoint-reconciler-type=none",  # no kube-proxy here: nothing reads the kubernetes Service
            "--allow-privileged=true",
            f"--runtime-config={runtime}",
            f"--feature-gates={self._feature_gates()}",
            f"--profiling={str(self.profiling).lower()}",
        ]
        if self.admission_config is not None:
            argv.append(f"--admission-control-config-file={self.admission_config}")
        if self.audit_policy is not None:
            # blocking mode (the default of the log backend): every event is on disk when its request is answered
            argv += [
                f"--audit-policy-file={self.audit_policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--audit-log-maxsize=0",  # one file, never rotated: the bench reads it whole
            ]
        return argv

    def _controller_manager_argv(self) -> list[str]:
        return self._component_argv(
            "kube-controller-manager",
            "controller-manager",
            "--use-service-account-credentials",
            f"--root-ca-file={self.pki.ca_cert}",
            f"--controllers={','.join(CONTROLLERS)}",
            *self._serving_flags(),
            secure_port=self.controller_manager_port,
        )

    def _scheduler_argv(self) -> list[str]:
        return self._component_argv(
            "kube-scheduler", "scheduler", *self._serving_flags(), secure_port=self.scheduler_port
        )

    def _serving_flags(self) -> tuple[str, ...]:
        """A component's serving port (its /metrics): the API server's certificate, the cluster CA's client
        certificates (not looked up in kube-system: no front proxy here), and kube-apiserver asked who may read
        what (the admin: /metrics)."""
        return (
            f"--tls-cert-file={self.pki.serving_cert}",
            f"--tls-private-key-file={self.pki.serving_key}",
            f"--client-ca-file={self.pki.ca_cert}",
            "--authentication-skip-lookup",
        )

    def scheduler_metrics(self) -> str:
        """kube-scheduler's /metrics (Prometheus text), read as the admin."""
        return self._metrics("kube-scheduler", self.scheduler_port)

    def controller_manager_metrics(self) -> str:
        """kube-controller-manager's /metrics (Prometheus text), read as the admin."""
        return self._metrics("kube-controller-manager", self.controller_manager_port)

    def apiserver_metrics(self) -> str:
        """kube-apiserver's own /metrics (Prometheus text), read as the admin."""
        return self._metrics("kube-apiserver", self.port)

    def _metrics(self, component: str, port: int) -> str:
        status, body = self.get("/metrics", port=port)
        if status != 200:
            raise HarnessError(f"GET {component}'s /metrics on port {port}: HTTP {status}: {body}")
        return body

    def _component_argv(self, binary: str, credential: str, *flags: str, secure_port: int = 0) -> list[str]:
        """A control-plane component with its own kubeconfig (for its API calls and for checking callers of its
        own serving port, disabled unless `secure_port`), no leader election, the same feature gates as the API
        server."""
        kubeconfig = self.credentials[credential].kubeconfig
        return [
            self.bins[binary],
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            *flags,
            *(
                (f"--kube-api-qps={self.client_qps:g}", f"--kube-api-burst={int(2 * self.client_qps)}")
                if self.client_qps
                else ()
            ),
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={secure_port}",
            f"--feature-gates={self._feature_gates()}",
        ]
