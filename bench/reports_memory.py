"""Memory and time of `scrubgate reports` on a big cluster (issue 29, item 4): 100,000 pods within the chart's
default memory limit (512 MiB).

A stand-in API server (this script with `--serve`, a process of its own, plain HTTP on 127.0.0.1) answers paged
LISTs (`limit`/`continue`), watches and the PolicyReport writes. Its objects are built as kube-apiserver returns
them: pods with managedFields, status, containers with env, probes and mounts (about 7 KB of JSON each); a
fraction of them GPU pods (a claim from a template; 1% of them with a 5 s grace period, SG003), each with its
generated ResourceClaim (allocated, reserved, with the webhook's finalizer); the rest pods of no device; in 200
namespaces; the DeviceClass `gpu.nvidia.com`. The pages are made as they are asked for, so the stand-in holds
none of it.

Then it runs the real `scrubgate reports` as a process, through the same code path as the chart's Deployment
(the official client, paged LISTs of 500, one watch per kind, the reports written):

  1. `reports --once`: one full list, the check, the reports written: its peak RSS (`wait4`'s ru_maxrss) and wall
     time;
  2. `reports` as the Deployment runs it: the first round, then a burst of `--events` watch events (pods' status
     written, GPU pods added and deleted), and the round they start: how many objects it checked again (its
     log), the time from the burst to that round's end, and the peak RSS of the whole run.

Run:  .venv/bin/python bench/reports_memory.py [--pods 100000] [--gpu-fraction 0.1] [--events 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

NAMESPACES = 200
MEMORY_LIMIT_MIB = 512  # the chart's reports.resources.limits.memory


# --- the objects, as kube-apiserver returns them ------------------------------------------------------------------


def _managed(manager: str, operation: str, fields: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
    entry = {"manager": manager, "operation": operation, "apiVersion": "v1", "time": "2026-12-04T10:00:00Z"}
    entry |= {"fieldsType": "FieldsV1", "fieldsV1": fields}
    return entry | ({"subresource": subresource} if subresource else {})


def _container(name: str, gpu: bool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": f"registry.example.com/team/{name}:v1.2.3",
        "command": ["/bin/server"],
        "args": ["--port=8080", "--log-level=info", "--metrics"],
        "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
        "env": [{"name": f"SETTING_{i}", "value": f"value-{i}-" + "x" * 24} for i in range(12)],
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "kube-api-access", "readOnly": True, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
        ],
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080, "scheme": "HTTP"}, "periodSeconds": 10},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080, "scheme": "HTTP"}, "periodSeconds": 5},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
    }
    if gpu:
        container["resources"]["claims"] = [{"name": "gpu"}]
    return container


def pod(gpu: bool) -> dict[str, Any]:
    """A running pod with placeholders @NS@, @NAME@, @UID@ (and @GRACE@ for a GPU pod)."""
    containers = [_container("main", gpu), _container("sidecar", False)]
    spec: dict[str, Any] = {
        "volumes": [
            {"name": "data", "emptyDir": {}},
            {
                "name": "kube-api-access",
                "projected": {
                    "defaultMode": 420,
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {
                            "downwardAPI": {
                                "items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]
                            }
                        },
                    ],
                },
            },
        ],
        "containers": containers,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": "@GRACE@" if gpu else 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "nodeName": "node-17",
        "securityContext": {},
        "schedulerName": "default-scheduler",
        "tolerations": [
            {"key": f"node.kubernetes.io/{t}", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            for t in ("not-ready", "unreachable")
        ],
        "priority": 0,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
    }
    if gpu:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu"}]
    statuses = [
        {
            "name": c["name"],
            "state": {"running": {"startedAt": "2026-12-04T10:00:05Z"}},
            "lastState": {},
            "ready": True,
            "restartCount": 0,
            "image": c["image"],
            "imageID": f"registry.example.com/team/{c['name']}@sha256:" + "0" * 64,
            "containerID": "containerd://" + "1" * 64,
            "started": True,
        }
        for c in containers
    ]
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            {"type": t, "status": "True", "lastProbeTime": None, "lastTransitionTime": "2026-12-04T10:00:06Z"}
            for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
        ],
        "hostIP": "10.0.3.17",
        "hostIPs": [{"ip": "10.0.3.17"}],
        "podIP": "10.244.17.9",
        "podIPs": [{"ip": "10.244.17.9"}],
        "startTime": "2026-12-04T10:00:00Z",
        "containerStatuses": statuses,
        "qosClass": "Burstable",
    }
    if gpu:
        status["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": "@NAME@-gpu-7x2kq"}]
    spec_fields = {f"f:{k}": {} for k in spec}
    spec_fields["f:containers"] = {f'k:{{"name":"{c["name"]}"}}': {f"f:{k}": {} for k in c} for c in containers}
    return {
        "metadata": {
            "name": "@NAME@",
            "generateName": "@NAME@-",
            "namespace": "@NS@",
            "uid": "@UID@",
            "resourceVersion": "123456",
            "creationTimestamp": "2026-12-04T10:00:00Z",
            "labels": {"app": "trainer" if gpu else "web", "pod-template-hash": "6d8f9c7b5", "team": "@NS@"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-12-01T09:00:00Z"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "@NAME@-rs",
                    "uid": "@UID@",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "managedFields": [
                _managed("kube-controller-manager", "Update", {"f:metadata": {"f:labels": {}}, "f:spec": spec_fields}),
                _managed("kubelet", "Update", {"f:status": {f"f:{k}": {} for k in status}}, "status"),
            ],
        },
        "spec": spec,
        "status": status,
    }


def claim() -> dict[str, Any]:
    """A GPU pod's generated claim, allocated and reserved (placeholders @NS@, @NAME@, @UID@)."""
    device = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-17", "device": "gpu-3"}
    return {
        "metadata": {
            "name": "@NAME@-gpu-7x2kq",
            "generateName": "@NAME@-gpu-",
            "namespace": "@NS@",
            "uid": "c-@UID@",
            "resourceVersion": "123457",
            "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
            "finalizers": ["resource.kubernetes.io/delete-protection", "scrubgate.dev/sanitize"],
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": "@NAME@",
                    "uid": "@UID@",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "managedFields": [_managed("kube-controller-manager", "Update", {"f:spec": {"f:devices": {}}})],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1},
                    }
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {"results": [device]},
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-17"]}]}
                    ]
                },
                "allocationTimestamp": "2026-12-04T10:00:01Z",
            },
            "reservedFor": [{"resource": "pods", "name": "@NAME@", "uid": "@UID@"}],
        },
    }


# --- the stand-in API server ---------------------------------------------------------------------------------------


class Cluster:
    """N pods (every `stride`-th a GPU pod), one claim per GPU pod, the namespaces; pages made on demand."""

    def __init__(self, pods: int, gpu_fraction: float, events: int) -> None:
        self.pods = pods
        self.stride = max(1, round(1 / gpu_fraction)) if gpu_fraction > 0 else 0
        self.gpu_pods = len(range(0, pods, self.stride)) if self.stride else 0
        self.events = events
        self.templates = {
            kind: json.dumps(build())
            for kind, build in (("gpu", lambda: pod(True)), ("web", lambda: pod(False)), ("claim", claim))
        }
        self.fire = threading.Event()
        self.reports: dict[str, dict[str, Any]] = {}
        self.version = 1000

    def _fill(self, template: str, index: int, grace: int = 60) -> str:
        text = template.replace("@NS@", f"team-{index % NAMESPACES}").replace("@NAME@", f"pod-{index}")
        return text.replace("@UID@", f"uid-{index}").replace('"@GRACE@"', str(grace))

    def pod_json(self, index: int, grace: int | None = None) -> str:
        if self.stride and index % self.stride == 0:
            if grace is None:
                grace = 5 if (index // self.stride) % 100 == 0 else 60
            return self._fill(self.templates["gpu"], index, grace)
        return self._fill(self.templates["web"], index)

    def page(self, path: str, start: int, limit: int) -> tuple[list[str], bool]:
        if path == "/api/v1/pods":
            end = min(start + limit, self.pods)
            return [self.pod_json(i) for i in range(start, end)], end < self.pods
        if path == "/apis/resource.k8s.io/v1/resourceclaims":
            end = min(start + limit, self.gpu_pods)
            return [
                self._fill(self.templates["claim"], i * self.stride) for i in range(start, end)
            ], end < self.gpu_pods
        if path == "/api/v1/namespaces":
            return [json.dumps({"metadata": {"name": f"team-{i}", "labels": {}}}) for i in range(NAMESPACES)], False
        if path == "/apis/resource.k8s.io/v1/deviceclasses":
            selector = {"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}
            return [json.dumps({"metadata": {"name": "gpu.nvidia.com"}, "spec": {"selectors": [selector]}})], False
        return [], False

    def watch_events(self) -> list[str]:
        """A burst as a busy cluster sends it: half of it pods' status written (by the kubelet: nothing the rules
        read), a quarter new GPU pods (a tenth of them with a 5 s grace period), a quarter GPU pods deleted."""
        found = []
        for n in range(self.events):
            index = ((n * 7919) % max(self.gpu_pods, 1)) * self.stride
            if n % 4 < 2:
                text = self.pod_json(index).replace('"phase": "Running"', '"phase": "Running", "message": "probe"')
                found.append(f'{{"type":"MODIFIED","object":{text}}}')
            elif n % 4 == 2:
                added = self.pods + n  # beyond the listed ones
                text = self._fill(self.templates["gpu"], added, 5 if n % 40 == 2 else 60)
                found.append(f'{{"type":"ADDED","object":{text}}}')
            else:
                found.append(f'{{"type":"DELETED","object":{self.pod_json(index)}}}')
        return found


def handler(cluster: Cluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked watches; every other answer has a Content-Length

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            if url.path == "/bench/fire":
                cluster.fire.set()
                return self._send(200, "{}")
            if url.path == "/apis/resource.k8s.io":
                return self._send(200, '{"versions":[{"version":"v1"}],"preferredVersion":{"version":"v1"}}')
            if url.path in cluster.reports:
                return self._send(200, json.dumps(cluster.reports[url.path]))
            if "report" in url.path.rsplit("/", 1)[-1]:
                items = [r for p, r in cluster.reports.items() if "/namespaces/" in p]
                return self._send(200, json.dumps({"metadata": {"resourceVersion": "1"}, "items": items}))
            if "/policyreports/" in url.path or "/clusterpolicyreports/" in url.path:
                return self._send(404, '{"message":"not found"}')
            if query.get("watch") == "true":
                return self._watch(url.path, float(query.get("timeoutSeconds", "60")))
            start, limit = int(query.get("continue") or 0), int(query.get("limit") or 500)
            items, more = cluster.page(url.path, start, limit)
            meta = f'{{"resourceVersion":"{cluster.version}"' + (f',"continue":"{start + limit}"}}' if more else "}")
            self._send(200, f'{{"metadata":{meta},"items":[{",".join(items)}]}}')

        def _watch(self, path: str, timeout_s: float) -> None:
            """Events as kube-apiserver sends them: one chunk each (a client reads each as it comes)."""
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            deadline = time.monotonic() + min(timeout_s, 300)
            if path == "/api/v1/pods" and cluster.fire.wait(max(deadline - time.monotonic(), 0)):
                cluster.fire.clear()
                for event in cluster.watch_events():
                    data = event.encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            while time.monotonic() < deadline:
                time.sleep(1)
            self.wfile.write(b"0\r\n\r\n")

        def _store(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            path = urlparse(self.path).path
            if self.command == "POST":
                path = f"{path}/{body['metadata']['name']}"
            body["metadata"]["resourceVersion"] = str(cluster.version)
            cluster.version += 1
            cluster.reports[path] = body
            self._send(201 if self.command == "POST" else 200, json.dumps(body))

        do_POST = do_PUT = _store

        def do_DELETE(self) -> None:
            cluster.reports.pop(urlparse(self.path).path, None)
            self._send(200, "{}")

    return Handler


def serve(args: argparse.Namespace) -> None:
    cluster = Cluster(args.pods, args.gpu_fraction, args.events)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(cluster))
    server.daemon_threads = True
    sizes = {k: len(v) for k, v in cluster.templates.items()}
    print(json.dumps({"port": server.server_address[1], "gpu_pods": cluster.gpu_pods, "json_bytes": sizes}), flush=True)
    server.serve_forever()


# --- the measurement -----------------------------------------------------------------------------------------------


def run_reports(argv: list[str], kubeconfig: Path, on_line: Any = None) -> tuple[subprocess.Popen, list[str]]:
    command = [sys.executable, "-m", "scrubgate.cli", "reports", "--kubeconfig", str(kubeconfig), *argv]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in process.stderr:
            lines.append(line.rstrip())
            if on_line is not None:
                on_line(line)

    threading.Thread(target=read, daemon=True).start()
    return process, lines


def wait_peak(process: subprocess.Popen) -> tuple[int, float]:
    """(exit status, peak RSS in MiB) of a child, from wait4."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, usage.ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=100_000)
    parser.add_argument("--gpu-fraction", type=float, default=0.1, help="share of the pods that are GPU pods")
    parser.add_argument("--events", type=int, default=1000, help="watch events of the burst")
    parser.add_argument(
        "--once-only", action="store_true", help="measure `reports --once` alone (e.g. of an older version)"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return 0
    stand_in = [sys.executable, __file__, "--serve", "--pods", str(args.pods), "--gpu-fraction", str(args.gpu_fraction)]
    server = subprocess.Popen([*stand_in, "--events", str(args.events)], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(server.stdout.readline())
        base = f"http://127.0.0.1:{info['port']}"
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(
                json.dumps(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "current-context": "bench",
                        "clusters": [{"name": "bench", "cluster": {"server": base}}],
                        "users": [{"name": "bench", "user": {"token": "bench"}}],
                        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}],
                    }
                )
            )
            print(
                f"stand-in API server: {args.pods:,} pods ({info['gpu_pods']:,} GPU pods, as many claims), "
                f"{NAMESPACES} namespaces; JSON per pod {info['json_bytes']['web']:,} B (GPU pod "
                f"{info['json_bytes']['gpu']:,} B, claim {info['json_bytes']['claim']:,} B)"
            )
            began = time.monotonic()
            once, lines = run_reports(["--once"], kubeconfig)
            code, peak = wait_peak(once)
            wall = time.monotonic() - began
            if code != 0:
                print("\n".join(lines[-20:]))
                return 1
            print(f"reports --once: peak RSS {peak:.0f} MiB (limit {MEMORY_LIMIT_MIB} MiB), {wall:.1f} s")
            if args.once_only:
                return 0 if peak < MEMORY_LIMIT_MIB else 1

            rounds: list[tuple[float, str]] = []
            round_done = threading.Condition()

            def on_line(line: str) -> None:
                if "objects held" in line:
                    with round_done:
                        rounds.append((time.monotonic(), line.strip()))
                        round_done.notify_all()

            began = time.monotonic()
            controller, lines = run_reports(["--interval", "1h"], kubeconfig, on_line)
            with round_done:
                if not round_done.wait_for(lambda: len(rounds) >= 1 or controller.poll() is not None, timeout=1800):
                    raise SystemExit("no first round")
            first = rounds[0][0] - began
            fired = time.monotonic()
            urllib.request.urlopen(f"{base}/bench/fire", timeout=10).read()
            with round_done:
                if not round_done.wait_for(lambda: len(rounds) >= 2 or controller.poll() is not None, timeout=600):
                    raise SystemExit("no round after the burst")
            after = rounds[1][0] - fired
            controller.send_signal(signal.SIGTERM)
            code, peak_run = wait_peak(controller)
            checked = [int(m.group(1)) for _, line in rounds if (m := re.search(r"(\d+) checked again", line))]
            print(f"reports (controller): first round {first:.1f} s, checked {checked[0]:,} objects")
            print(
                f"  a burst of {args.events:,} watch events: the next round checked {checked[1]:,} objects, "
                f"{after:.1f} s from the burst to its end (a 10 s quiet period included)"
            )
            print(f"  peak RSS of the whole run {peak_run:.0f} MiB (limit {MEMORY_LIMIT_MIB} MiB); exit {code}")
            print(f"  log: {rounds[0][1]}\n       {rounds[1][1]}")
    finally:
        server.terminate()
        server.wait()
    return 0 if max(peak, peak_run) < MEMORY_LIMIT_MIB else 1


if __name__ == "__main__":
    sys.exit(main())
