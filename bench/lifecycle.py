"""The whole lifecycle under load, end to end: claims/s and release-to-clean latency.

Each run starts a fresh local installation (devcluster.harness: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler; the kubelet stand-in and NVIDIA-like driver over simulated GPUs; the real webhook and the real
agent as separate processes) and puts devcluster.load's workload through it: Job pods, each with a claim
from a ResourceClaimTemplate (MIG slices, every 8th a whole GPU), each looking for earlier tenants' canaries,
writing its own and ending after a few seconds; at most --parallelism pods at once.

    .venv/bin/python bench/lifecycle.py [--claims 200] [--gpus 8] [--mig 7] [--parallelism 24 48]
                                        [--run-seconds 4] [--timeout 300] [--workdir DIR]
                                        [--kube-api-qps 200] [--without-scrubgate]

kube-controller-manager and kube-scheduler run with --kube-api-qps 200 (burst 400), as clusters that run
bursts of short jobs set them: at their defaults (20 and 50 requests/s) the resourceclaim controller, which
makes four to six requests per pod with a claim, caps the whole cluster at about 5 claims/s with or without
scrubgate (`--kube-api-qps 0` keeps the defaults). `--without-scrubgate` runs the same load with scrubgate's
admission configurations deleted and its webhook and agent stopped: what the control plane and the harness
do alone on the machine. No claim is scrubbed then: its invariant columns show what scrubgate prevents, and
the exit status does not depend on them.

Prints a Markdown table, one column per --parallelism value. Release is the pod's end (the claim's reservedFor
is emptied in the update that clears its allocation, which the webhook refuses until the attestation); devices
allocatable is the later of the claim's allocation cleared (or the claim deleted) and the last of our
DeviceTaintRules for it deleted, where it had any; finalizer removed is the claim object released. A claim
gets a DeviceTaintRule ("fence") only on rare paths (a failed scrub, a bypassed guard, admin access, shared
devices, the agent's shutdown): the fence rows say how many claims had one, and n/a when none did. Times come
from the observer's watch of claims, fences and pods; the kube-scheduler rows from its /metrics before and
after the run (failed attempts, and the pods that ResourceSlice updates, DeviceTaintRules included, and claim
updates put back into its queue). API requests per claim come from kube-apiserver's /metrics read the same
way: all it received (apiserver_request_total), and scrubgate's share, those it received only because
scrubgate is installed: the agent's (counted by API Priority and Fairness under a FlowSchema of their own,
`scrubgate-agent`, created for the run with the priority level they had, so they are served as before), those
scrubgate's webhooks rejected (the resourceclaim controller's deallocation, retried until the attestation),
and the status writes of fences (kube-controller-manager's).
The invariant is part of the result: the script exits 1 when any run did not end clean (a violation,
a canary found, a claim not torn down), and lists why.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {len(os.sched_getaffinity(0))} CPUs visible, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}; load average before the run {load}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--mig", type=int, default=7, help="MIG slices per GPU")
    parser.add_argument("--parallelism", type=int, nargs="+", default=[24, 48], help="pods at once (one run each)")
    parser.add_argument("--run-seconds", type=float, default=4.0, help="mean pod run time (spread +-25%%)")
    parser.add_argument("--timeout", type=float, default=300.0, help="bounded wait per run, seconds")
    parser.add_argument("--workdir", type=Path, help="where the installations live (default: a temporary dir)")
    parser.add_argument(
        "--kube-api-qps",
        type=float,
        default=200.0,
        help="client rate limit of kube-controller-manager and kube-scheduler (0: their defaults, 20 and 50)",
    )
    parser.add_argument(
        "--without-scrubgate",
        action="store_true",
        help="the same load with scrubgate's webhooks, policy and agent removed first (a baseline)",
    )
    args = parser.parse_args()

    sys.path.insert(0, str(REPO_ROOT))  # devcluster is a harness at the repo root, not an installed package
    from devcluster.harness import Cluster
    from devcluster.load import LoadSpec, markdown_table, run_load

    print(f"{time.strftime('%Y-%m-%d')}; {machine()}")
    print(f"command: python bench/lifecycle.py {' '.join(sys.argv[1:])}".rstrip())
    qps = f"--kube-api-qps={args.kube_api_qps:g}" if args.kube_api_qps else "their default client rate limits"
    print(f"kube-controller-manager and kube-scheduler with {qps}")
    if args.without_scrubgate:
        print("WITHOUT scrubgate (a baseline): no webhook, no policy, no agent; every claim is left dirty")
    results = []
    with tempfile.TemporaryDirectory(prefix="sg-lifecycle-bench-", dir=args.workdir) as base:
        for i, parallelism in enumerate(args.parallelism):
            spec = LoadSpec(
                claims=args.claims, parallelism=parallelism, run_seconds=args.run_seconds, timeout_s=args.timeout
            )
            with Cluster(
                Path(base) / f"run-{i + 1}", gpus=args.gpus, mig_per_gpu=args.mig, client_qps=args.kube_api_qps or None
            ) as cluster:
                if args.without_scrubgate:
                    cluster.uninstall_scrubgate()
                print(f"run {i + 1}: {spec}", file=sys.stderr, flush=True)
                results.append(run_load(cluster, spec, lambda line: print(f"  {line}", file=sys.stderr, flush=True)))
    print()
    print(markdown_table(results))
    failed = False
    for i, result in enumerate(results):
        if args.without_scrubgate:
            break  # nothing was meant to end clean
        problems = result.problems()
        if problems:
            failed = True
            print(f"\nrun {i + 1} did not end clean ({len(problems)} problems):")
            print("\n".join(f"- {p}" for p in problems[:20]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
