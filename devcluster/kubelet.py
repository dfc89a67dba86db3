"""A kubelet for one simulated node: runs the pods bound to it as real processes attached to the
simulated GPUs their claims were allocated.

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

Container processes outlive the stand-in process (their own sessions); a restarted kubelet adopts
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
from dataclasses import dataclass, field
from pathlib import Path

from scrubgate.sanitizer_agent.gpu import simulated

from .api import Api, Call, now_rfc3339
from .auth import node_user
from .controllers import pod_done
from .driver import Driver
from .resources import CLAIMS, NODES, PODS
from .worker import Worker

log = logging.getLogger("devcluster.kubelet")

ANNOTATION_PREFIX = "devcluster.scrubgate.dev/"
CANARY = ANNOTATION_PREFIX + "canary"
LOOK_FOR = ANNOTATION_PREFIX + "look-for"
RUN_SECONDS = ANNOTATION_PREFIX + "run-seconds"
CANARY_FOUND = ANNOTATION_PREFIX + "CanaryFound"
CONTAINER_ID_PREFIX = "devcluster://"


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


class Kubelet(Worker):
    name = "kubelet"

    def __init__(self, api: Api, node: str, gpu_root: Path, driver: Driver, interval_s: float = 0.5) -> None:
        super().__init__(api, node_user(node), interval_s)
        self.node = node
        self.gpu_root = Path(gpu_root)
        self.driver = driver
        self._running: dict[str, _Running] = {}  # pod uid -> its container process

    def start(self) -> None:
        self._register()
        super().start()

    def _register(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node}},
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now_rfc3339()}
                ]
            },
        }
        if self.api.store.get(("", "nodes", "", self.node)) is None:
            self.create(NODES, node)

    def sync(self) -> None:
        pods = [p for p in self.api.store.list("", "pods")[0] if (p.get("spec") or {}).get("nodeName") == self.node]
        seen = set()
        for pod in pods:
            seen.add(pod["metadata"]["uid"])
            self._sync_pod(pod)
        for uid in list(self._running):
            if uid not in seen:  # force-deleted behind our back: stop what still runs
                log.info("node %s: pod %s is gone from the API; killing its container", self.node, uid)
                self._stop_container(uid)

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
        ns = pod["metadata"]["namespace"]
        generated = {
            s.get("name"): s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        }
        claims = []
        for pod_claim in pod["spec"].get("resourceClaims") or []:
            name = pod_claim.get("resourceClaimName") or generated.get(pod_claim.get("name"))
            claim = self.api.store.get((CLAIMS.group, CLAIMS.plural, ns, name or ""))
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
        status.update({"phase": "Running", "startTime": now_rfc3339(), "hostIP": "127.0.0.1", "podIP": "127.0.0.1"})
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
        self.update(PODS, pod, "status")

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
            # Adopted: normally init reaps it; if it is our own child (a stand-in restarted in the
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
        meta = pod["metadata"]
        stopped = meta["uid"] in self._running
        self._stop_container(meta["uid"])
        if stopped and not pod_done(pod):
            pod = self._report_terminal(pod, "Failed", 137) or pod
        if meta.get("deletionGracePeriodSeconds") == 0:
            return  # our delete went through; finalizers hold the pod now
        call = Call(self.user, PODS, "v1", meta["namespace"], meta["name"])
        self._attempt(
            call,
            f"delete pod {meta['namespace']}/{meta['name']}",
            lambda: self.api.delete(call, {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}),
        )

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
        return self.update(PODS, pod, "status")

    def shutdown_containers(self) -> None:
        """Kill every container this kubelet runs (the node goes away for good)."""
        for uid in list(self._running):
            self._stop_container(uid)


class SimulatedNode:
    """A node: its DRA driver (publishing slices) and its kubelet."""

    def __init__(self, api: Api, name: str, gpu_root: Path, interval_s: float = 0.5) -> None:
        self.driver = Driver(api, name, simulated.SimulatedGpu(gpu_root))
        self.kubelet = Kubelet(api, name, gpu_root, self.driver, interval_s)

    def start(self) -> None:
        self.kubelet.start()
        self.driver.start()

    def signal_stop(self) -> None:
        self.kubelet.signal_stop()
        self.driver.signal_stop()

    def stop(self, keep_containers: bool = False) -> None:
        """A clean shutdown also stops the containers; a crash leaves them to be adopted."""
        self.kubelet.stop()
        self.driver.stop()
        if not keep_containers:
            self.shutdown_containers()

    def shutdown_containers(self) -> None:
        self.kubelet.shutdown_containers()
