"""What admission adds to creating a GPU ResourceClaim and a GPU Pod, on the real kube-apiserver.

One installation (devcluster.harness: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the real
webhook), three admission set-ups measured one after the other in the same run:

- ``none``: no scrubgate webhook configuration (only Kubernetes' own admission plugins);
- ``webhooks``: scrubgate's webhook configurations as the kustomize base installs them;
- ``vap-sg005``: no webhook, a ValidatingAdmissionPolicy expressing SG005 (no request may tolerate a
  ``scrubgate.dev/`` taint or every taint) in CEL, for comparison with an in-process rule.

Each create is a ``dryRun=All`` POST by a tenant: the API server runs authentication, authorization, defaulting,
mutating and validating admission and validation exactly as for a real create, and persists nothing, so no
controller or scheduler work follows and the figures are admission's. Requests go one at a time (latency,
not throughput) over the official client's keep-alive connection.

    .venv/bin/python bench/admission_latency.py [--creates 2000] [--warmup 200] [--workdir DIR]

Prints a Markdown table: p50/p99 per set-up and object, and the difference to ``none``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

REPO_ROOT = Path(__file__).resolve().parents[1]

VAP_SG005 = """
object.spec.devices.requests.all(r,
  [r].map(x, has(x.exactly) ? [x.exactly] : (has(x.firstAvailable) ? x.firstAvailable : [])).all(alts,
    alts.all(a, !has(a.tolerations) || a.tolerations.all(t,
      !(has(t.key) && t.key.startsWith('scrubgate.dev/')) && !(!has(t.key) && t.operator == 'Exists')))))
""".strip()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def vap_objects() -> list[dict[str, Any]]:
    from devcluster.workloads import admission_policy

    rule = {
        "apiGroups": ["resource.k8s.io"],
        "apiVersions": ["v1"],
        "operations": ["CREATE", "UPDATE"],
        "resources": ["resourceclaims"],
    }
    return admission_policy("sg005-fence-toleration", rule, VAP_SG005, "SG005: a request tolerates scrubgate's fence")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=2000, help="measured creates per object and set-up")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT))
    from lifecycle import machine

    from devcluster import workloads
    from devcluster.harness import (
        Cluster,
        wait_for,
    )
    from devcluster.kubeapi import object_path

    with Cluster(args.workdir, gpus=1) as cluster:
        ns = "bench-admission"
        cluster.create_namespace(ns)
        claim = workloads.resource_claim("bench")
        claim["metadata"] = {"generateName": "bench-"}
        pod = workloads.pod("bench", template="one-gpu", grace=60)
        pod["metadata"] = {"generateName": "bench-"}
        bodies = {
            "ResourceClaim": (cluster.resource_path("resourceclaims", ns), claim),
            "Pod": (f"/api/v1/namespaces/{ns}/pods", pod),
        }
        webhook_configurations = [d for d in yaml.safe_load_all(cluster.paths.webhook_configurations.read_text()) if d]

        def measure(setup: str) -> dict[str, list[float]]:
            out: dict[str, list[float]] = {}
            for kind, (path, body) in bodies.items():
                samples = []
                for i in range(args.warmup + args.creates):
                    start = time.perf_counter()
                    cluster.request("POST", path, body, user="alice", query=[("dryRun", "All")])
                    if i >= args.warmup:
                        samples.append((time.perf_counter() - start) * 1000)
                out[kind] = samples
                print(f"{setup} {kind}: p50 {percentile(samples, 50):.2f} ms", file=sys.stderr, flush=True)
            return out

        def settled(check) -> None:
            # Admission configuration reaches the API server through an informer: wait until it applies.
            wait_for(check, 30, "the admission configuration in force", interval=0.2)

        def denies_tolerating_claim() -> bool:
            bad = workloads.resource_claim(
                "x", tolerations=[{"key": "scrubgate.dev/unsanitized", "operator": "Exists"}]
            )
            try:
                cluster.request("POST", bodies["ResourceClaim"][0], bad, user="alice", query=[("dryRun", "All")])
            except ApiException:  # the denial is what we wait for
                return True
            return False

        cluster.call_webhook_directly()
        results: dict[str, dict[str, list[float]]] = {}
        results["webhooks"] = measure("webhooks")
        for doc in webhook_configurations:
            cluster.request("DELETE", object_path(doc))
        settled(lambda: not denies_tolerating_claim())
        results["none"] = measure("none")
        for doc in vap_objects():
            cluster.apply(doc)
        settled(denies_tolerating_claim)
        results["vap-sg005"] = measure("vap-sg005")
        version = cluster.server_version()["gitVersion"]

    print(f"\nAdmission latency of dryRun=All creates by a tenant, kube-apiserver {version}, {args.creates} each")
    print(f"after {args.warmup} warm-up; {machine()}\n")
    print("| set-up | object | p50 ms | p99 ms | mean ms | p50 added | p99 added |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for setup in ("none", "webhooks", "vap-sg005"):
        for kind in bodies:
            samples = results[setup][kind]
            base = results["none"][kind]
            p50, p99 = percentile(samples, 50), percentile(samples, 99)
            print(
                f"| {setup} | {kind} | {p50:.2f} | {p99:.2f} | {statistics.fmean(samples):.2f} | "
                f"{p50 - percentile(base, 50):+.2f} | {p99 - percentile(base, 99):+.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
