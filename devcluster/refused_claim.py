"""How long a pod waits for its claim when kube-controller-manager's first try to create it was refused, right
after a burst: the resourceclaim controller puts a failed sync back in its workqueue through one rate limiter
for the whole controller (the item's exponential backoff, and a token bucket of 10/s, burst 100:
workqueue.DefaultTypedControllerRateLimiter, pkg/controller/resourceclaim/controller.go v1.37.2), so every failed
sync of the burst's claims delays this retry. Part of bench/lifecycle.py's load (``LoadSpec.refused_claim``).

The refusal: a namespace whose ResourceQuota allows no ResourceClaim (kube-apiserver's ResourceQuota admission
refuses the create; it reads the limits from the quota's status, written here as no quota controller runs). The pod is scheduling-gated, so
the scheduler never tries it. Once the controller's refusal is on record (its FailedResourceClaimCreation Event),
the quota goes; the wait is from then until the claim exists: the controller's retry delay.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from . import workloads
from .harness import Cluster
from .processes import wait_for

QUOTA = "no-claims"
REFUSED = "FailedResourceClaimCreation"  # the Event syncPod records on the pod when handleClaim fails
GATE = "scrubgate.dev/load-probe"


class RefusedClaim:
    """One probe pod in a namespace of its own; ``prepare`` before the load, ``start`` after its burst, ``wait``
    at the end. ``waited_s``: the controller's retry delay (None with ``problem`` saying why)."""

    def __init__(self, cluster: Cluster, namespace: str, user: str, timeout_s: float) -> None:
        self.cluster, self.namespace, self.user, self.timeout_s = cluster, namespace, user, timeout_s
        self.waited_s: float | None = None
        self.problem: str | None = None
        self._thread: threading.Thread | None = None

    def prepare(self) -> None:
        self.cluster.create_namespace(self.namespace)
        quota = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": QUOTA, "namespace": self.namespace},
            "spec": {"hard": {"count/resourceclaims.resource.k8s.io": "0"}},
        }
        created = self.cluster.request("POST", f"/api/v1/namespaces/{self.namespace}/resourcequotas", quota)
        # Admission enforces the hard limits of a quota's status, which no quota controller fills in here.
        created["status"] = {"hard": dict(quota["spec"]["hard"]), "used": {"count/resourceclaims.resource.k8s.io": "0"}}
        self.cluster.request("PUT", f"/api/v1/namespaces/{self.namespace}/resourcequotas/{QUOTA}/status", created)
        template = workloads.claim_template("gpu-claim", device_class=workloads.GPU_CLASS)
        path = self.cluster.resource_path("resourceclaimtemplates", self.namespace)
        self.cluster.request("POST", path, template, user=self.user)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="refused-claim", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join(self.timeout_s + 10)

    def _run(self) -> None:
        try:
            self.waited_s = self._measure()
        except Exception as exc:  # a broken probe is reported in the table, not raised in its thread
            self.problem = f"{type(exc).__name__}: {exc}"

    def _measure(self) -> float:
        pod = workloads.pod("probe", template="gpu-claim")
        pod["spec"]["schedulingGates"] = [{"name": GATE}]
        self.cluster.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", pod, user=self.user)
        wait_for(
            self._refused,
            self.timeout_s,
            f"the resourceclaim controller's {REFUSED} Event in {self.namespace}",
            interval=0.02,
        )
        self.cluster.request("DELETE", f"/api/v1/namespaces/{self.namespace}/resourcequotas/{QUOTA}")
        lifted = time.monotonic()
        wait_for(self._claims, self.timeout_s, f"the probe's claim in {self.namespace}", interval=0.02)
        waited = time.monotonic() - lifted
        self.cluster.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/probe")
        return waited

    def _refused(self) -> bool:
        events = self.cluster.request("GET", f"/api/v1/namespaces/{self.namespace}/events")["items"]
        return any(e.get("reason") == REFUSED for e in events)

    def _claims(self) -> list[dict[str, Any]]:
        return self.cluster.request("GET", self.cluster.resource_path("resourceclaims", self.namespace))["items"]
