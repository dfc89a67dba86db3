"""A kubelet for one simulated node, as a client of the real API server with the node's credentials
(``system:node:<name>`` in ``system:nodes``, so the Node authorizer and NodeRestriction apply to it as to a
kubelet): it registers its Node, runs the pods bound to it as real processes attached to the simulated GPUs
their claims were allocated, and reports their status.

- A pod starts once every claim is allocated and reserved for it; the driver prepares the claims,
  one shell process per pod stands in for its containers and is attached to each device.
- Annotations drive the workload: ``devcluster.scrubgate.dev/canary: <text>`` writes the text
  into device memory at offset 0 (a tenant's data); ``devcluster.scrubgate.dev/look-for: <text>``
  reports, as pod condition ``devcluster.scrubgate.dev/CanaryFound``, whether the text is anywhere
  in the memory the pod got (looked at before its own canary is written);
  ``devcluster.scrubgate.dev/run-seconds: <n>`` makes it finish (phase Succeeded) after n seconds.
- Deletion: containers stop (SIGKILL, immediately -- within any grace period), processes detach,
  the driver unprepares, the pod is reported terminal, then deleted with grace 0 and a UID
  precondition as ``system:node:<node>`` -- the real kubelet's order. A pod that disappears from
  the API without that (force deletion) still has its process killed on the next pass, as the
  real kubelet does, possibly after its devices were already released.

Container processes outlive the node process (their own sessions); a restarted kubelet adopts
them from the pod status (``containerID: devcluster://<pid>``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes.client.exceptions import ApiException
from scrubgate.sanitizer_agent.gpu import simulated

from .driver import Driver
from .rest import Rest, status_message

log = logging.getLogger("devcluster.kubelet")

ANNOTATION_PREFIX = "devcluster.scrubgate.dev/"
CANARY = ANNOTATION_PREFIX + "canary"
LOOK_FOR = ANNOTATION_PREFIX + "look-for"
RUN_SECONDS = ANNOTATION_PREFIX + "run-seconds"
CANARY_FOUND = ANNOTATION_PREFIX + "CanaryFound"
CONTAINER_ID_PREFIX = "devcluster://"
LEASE_SECONDS = 40
POD_WORKERS = 8  # pods synced side by side, as the kubelet's pod workers do; one pod by one worker per pass


@dataclass
class _Running:
    pid: int
    devices: list[str]
    claim_uids: list[str]
    started: float = field(default_factory=time.monotonic)
    process: subprocess.Popen | None = None
    conditions: list[dict] = field(default_factory=list)  # what the workload reported at start

    def alive(self) -> bool:
        # Our own child: a wait (no /proc read on every pass); an adopted one: look it up.
        return self.process.poll() is None if self.process is not None else _alive(self.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def pod_done(pod: dict) -> bool:
    """No container of the pod runs or will run (upstream ``isPodDone``)."""
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def pod_claim_refs(pod: dict) -> list[str]:
    """The names of the claims the pod uses: named, generated from a template (``resourceClaimStatuses``), or
    created by the scheduler for its extended resources (``extendedResourceClaimStatus``). None for a claim
    whose name is not known yet."""
    status = pod.get("status") or {}
    generated = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []}
    refs = [
        ref.get("resourceClaimName") or generated.get(ref.get("name"))
        for ref in (pod.get("spec") or {}).get("resourceClaims") or []
    ]
    if _requests_extended_resources(pod):
        refs.append((status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName"))
    return refs


def _requests_extended_resources(pod: dict) -> bool:
    containers = [*(pod["spec"].get("initContainers") or []), *(pod["spec"].get("containers") or [])]
    return any(
        "/" in name and not name.startswith(("kubernetes.io/", "hugepages-"))
        for c in containers
        for name in {
            **((c.get("resources") or {}).get("limits") or {}),
            **((c.get("resources") or {}).get("requests") or {}),
        }
    )


class Kubelet:
    name = "kubelet"

    def __init__(self, rest: Rest, node: str, gpu_root: Path, driver: Driver) -> None:
        self.rest = rest
        self.node = node
        self.gpu_root = Path(gpu_root)
        self.driver = driver
        self._running: dict[str, _Running] = {}  # pod uid -> its container process
        self._workers = ThreadPoolExecutor(POD_WORKERS, thread_name_prefix="pod-worker")

    def register(self) -> None:
        """Create the Node (once) and report it Ready, with room for many pods."""
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node,
                "labels": {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux"},
            },
        }
        try:
            self.rest.request("POST", "/api/v1/nodes", node)
        except ApiException as exc:
            if exc.status != 409:
                raise
        resources = {"cpu": "64", "memory": "512Gi", "pods": "500", "ephemeral-storage": "1Ti"}
        heartbeat = now_rfc3339()
        status = {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "devcluster kubelet stand-in",
                    "lastHeartbeatTime": heartbeat,
                    "lastTransitionTime": heartbeat,
                }
            ],
            "nodeInfo": {
                "machineID": self.node,
                "systemUUID": self.node,
                "bootID": self.node,
                "kernelVersion": "",
                "osImage": "devcluster",
                "containerRuntimeVersion": "devcluster://1",
                "kubeletVersion": "v0.0.0-devcluster",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
        self.rest.merge_patch(f"/api/v1/nodes/{self.node}/status", {"status": status})

    def heartbeat(self) -> None:
        """Renew the node's Lease in kube-node-lease, as the kubelet does every 10 s: the node lifecycle
        controller reads the node as Ready while it is renewed."""
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}"
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now}
        try:
            self.rest.merge_patch(path, {"spec": spec})
        except ApiException as exc:
            if exc.status != 404:
                raise
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.node},
                "spec": spec,
            }
            self.rest.request("POST", path.rsplit("/", 1)[0], lease)

    def sync(self) -> None:
        pods = self.rest.request("GET", "/api/v1/pods", query=[("fieldSelector", f"spec.nodeName={self.node}")])
        items = pods.get("items") or []
        futures = [self._workers.submit(self._sync_one, pod) for pod in items]
        # The pass ends when every pod's sync has (the next pass may sync the same pods); then the first error.
        failed = [error for error in (f.exception() for f in futures) if error is not None]
        if failed:
            raise failed[0]
        seen = {pod["metadata"]["uid"] for pod in items}
        for uid in list(self._running):
            if uid not in seen:  # force-deleted behind our back: stop what still runs
                log.info("node %s: pod %s is gone from the API; killing its container", self.node, uid)
                self._stop_container(uid)

    def _sync_one(self, pod: dict) -> None:
        try:
            self._sync_pod(pod)
        except ApiException as exc:
            # Conflicts and NotFound are ordinary races: the next pass sees the new state and retries.
            if exc.status not in (404, 409):
                log.warning("node %s: pod %s: %s", self.node, pod["metadata"]["name"], status_message(exc))

    def _sync_pod(self, pod: dict) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        uid = meta["uid"]
        if uid not in self._running and status.get("phase") == "Running":
            self._adopt(pod)
        if meta.get("deletionTimestamp"):
            self._terminate(pod)
            return
        if pod_done(pod):
            return
        running = self._running.get(uid)
        if running is None:
            running = self._start(pod)
            if running is None:
                return
        if status.get("phase", "Pending") == "Pending":
            self._report_running(pod, running)  # again on the next pass if this write lost a race
            return
        run_seconds = float((meta.get("annotations") or {}).get(RUN_SECONDS) or 0)
        if run_seconds and time.monotonic() - running.started >= run_seconds:
            self._stop_container(uid)
            self._report_terminal(pod, "Succeeded", 0)
        elif not running.alive():
            self._stop_container(uid)
            self._report_terminal(pod, "Failed", 137)

    # ------------------------------------------------------------------ start

    def _claims_ready(self, pod: dict) -> list[dict] | None:
        """The pod's claims once each is allocated and reserved for it (None before)."""
        ns = pod["metadata"]["namespace"]
        claims = []
        for name in pod_claim_refs(pod):
            claim = self.rest.get(f"/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}") if name else None
            if claim is None or not (claim.get("status") or {}).get("allocation"):
                return None
            if not any(r.get("uid") == pod["metadata"]["uid"] for r in claim["status"].get("reservedFor") or []):
                return None
            claims.append(claim)
        return claims

    def _start(self, pod: dict) -> _Running | None:
        claims = self._claims_ready(pod)
        if claims is None:
            return None
        devices = [uuid for claim in claims for uuid in self.driver.prepare(claim)]
        # The container outlives this process (a restarted kubelet adopts it) but not its node: it
        # exits once the simulated GPU directory is gone, so a killed harness leaves nothing behind.
        process = subprocess.Popen(
            ["sh", "-c", 'while [ -e "$1" ]; do sleep 2; done', "container", str(self.gpu_root / "inventory.json")],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        running = _Running(process.pid, devices, [c["metadata"]["uid"] for c in claims], process=process)
        self._running[pod["metadata"]["uid"]] = running
        for uuid in devices:
            simulated.attach(self.gpu_root, uuid, process.pid)
        annotations = pod["metadata"].get("annotations") or {}
        # Look first: what the pod got is the memory as the previous tenant left it, before its own canary.
        if annotations.get(LOOK_FOR):
            needle = annotations[LOOK_FOR].encode()
            found = [u for u in devices if needle in simulated.read(self.gpu_root, u)]
            running.conditions.append(
                {
                    "type": CANARY_FOUND,
                    "status": "True" if found else "False",
                    "message": f"found in {found}" if found else f"not in {devices}",
                    "lastTransitionTime": now_rfc3339(),
                }
            )
        if annotations.get(CANARY):
            for uuid in devices:
                simulated.write(self.gpu_root, uuid, 0, annotations[CANARY].encode())
        log.info(
            "node %s: started pod %s/%s on %s",
            self.node,
            pod["metadata"]["namespace"],
            pod["metadata"]["name"],
            devices,
        )
        return running

    def _report_running(self, pod: dict, running: _Running) -> None:
        pod = copy.deepcopy(pod)
        status = pod.setdefault("status", {})
        status.update({"phase": "Running", "startTime": now_rfc3339()})
        status["conditions"] = [
            *[c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"],
            {"type": "Ready", "status": "True", "lastTransitionTime": now_rfc3339()},
            *running.conditions,
        ]
        status["containerStatuses"] = [
            {
                "name": c.get("name", ""),
                "image": c.get("image", ""),
                "imageID": f"devcluster://{c.get('image', '')}",
                "ready": True,
                "restartCount": 0,
                "containerID": f"{CONTAINER_ID_PREFIX}{running.pid}",
                "state": {"running": {"startedAt": now_rfc3339()}},
            }
            for c in pod["spec"].get("containers") or []
        ]
        self._write_status(pod)

    def _adopt(self, pod: dict) -> None:
        """After a restart: take over a container process recorded in the pod's status."""
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            container_id = container.get("containerID") or ""
            if container_id.startswith(CONTAINER_ID_PREFIX):
                claims = self._claims_ready(pod) or []
                devices = [uuid for claim in claims for uuid in self.driver.prepare(claim)]
                self._running[pod["metadata"]["uid"]] = _Running(
                    int(container_id[len(CONTAINER_ID_PREFIX) :]), devices, [c["metadata"]["uid"] for c in claims]
                )
                return

    # ------------------------------------------------------------------ stop

    def _stop_container(self, uid: str) -> None:
        """Kill the container, detach it from its devices, then unprepare its claims."""
        running = self._running.pop(uid, None)
        if running is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(running.pid, signal.SIGKILL)
        if running.process is not None:
            running.process.wait()
        else:
            # Adopted: normally init reaps it; if it is our own child (a node restarted in the
            # same process), reap it here so no zombie is left.
            with contextlib.suppress(ChildProcessError):
                os.waitpid(running.pid, 0)
            deadline = time.monotonic() + 5
            while _alive(running.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        for uuid in running.devices:
            simulated.detach(self.gpu_root, uuid, running.pid)
        for claim_uid in running.claim_uids:
            self.driver.unprepare(claim_uid)

    def _terminate(self, pod: dict) -> None:
        """Stop the containers, unprepare, report the pod terminal, then the kubelet's final delete."""
        meta = pod["metadata"]
        stopped = meta["uid"] in self._running
        self._stop_container(meta["uid"])
        if stopped and not pod_done(pod):
            pod = self._report_terminal(pod, "Failed", 137) or pod
        if meta.get("deletionGracePeriodSeconds") == 0:
            return  # our delete went through; finalizers hold the pod now
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        self.rest.request("DELETE", path, {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})

    def _report_terminal(self, pod: dict, phase: str, exit_code: int) -> dict | None:
        pod = copy.deepcopy(pod)
        status = pod.setdefault("status", {})
        status["phase"] = phase
        status["conditions"] = [
            {**c, "status": "False"} if c.get("type") == "Ready" else c for c in status.get("conditions") or []
        ]
        for container in status.get("containerStatuses") or []:
            container["ready"] = False
            container["state"] = {
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "finishedAt": now_rfc3339(),
                    "containerID": container.get("containerID", ""),
                }
            }
        return self._write_status(pod)

    def _write_status(self, pod: dict) -> dict:
        """PUT pods/status, conditional on the resourceVersion read (a lost race is retried on the next pass)."""
        meta = pod["metadata"]
        return self.rest.request("PUT", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status", pod)

    def shutdown_containers(self) -> None:
        """Kill every container this kubelet runs (the node goes away for good)."""
        for uid in list(self._running):
            self._stop_container(uid)
