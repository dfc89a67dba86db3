"""The whole lifecycle under load, end to end: claims/s and release-to-clean latency.

Each run starts a fresh local installation (devcluster.harness: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler; the kubelet stand-in and NVIDIA-like driver over simulated GPUs; the real webhook and the real
agent as separate processes; the API server calls the webhook at its own port, as kube-proxy forwards a Service
in the kernel, not through the harness's Python stand-in for the Service) and puts devcluster.load's workload
through it: Job pods, each with a claim
from a ResourceClaimTemplate (MIG slices, every 8th a whole GPU), each looking for earlier tenants' canaries,
writing its own and ending after a few seconds; at most --parallelism pods at once.

    .venv/bin/python bench/lifecycle.py [--claims 200] [--gpus 8] [--mig 7] [--parallelism 24 48]
                                        [--run-seconds 4] [--timeout 300] [--workdir DIR]
                                        [--kube-api-qps 200] [--without-scrubgate | --alternate PAIRS]

kube-controller-manager and kube-scheduler run with --kube-api-qps 200 (burst 400), as clusters that run
bursts of short jobs set them: at their defaults (20 and 50 requests/s) the resourceclaim controller, which
makes four to six requests per pod with a claim, caps the whole cluster at about 5 claims/s with or without
scrubgate (`--kube-api-qps 0` keeps the defaults). `--without-scrubgate` runs the same load with scrubgate's
admission configurations deleted and its webhook and agent stopped: what the control plane and the harness
do alone on the machine. No claim is scrubbed then: its invariant columns show what scrubgate prevents, and
the exit status does not depend on them. `--alternate PAIRS` measures what scrubgate costs in one invocation:
PAIRS runs with it and as many without, alternating (so that a machine getting busier or quieter weighs on
both alike), then each pair's claims/s and failed scheduling attempts per pod as a ratio to the bare control
plane's, and their mean. The row `CPU per claim` (from /proc) splits the CPU time over the run between the
control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) and scrubgate's own processes,
which a cluster runs on its GPU nodes and workers.

Prints a Markdown table per --parallelism value, one column per run. Release is the pod's end (the claim's
reservedFor is emptied in the update that clears its allocation, which the webhook refuses until the
attestation); devices allocatable is the later of the claim's allocation cleared (or the claim deleted) and
the last of our DeviceTaintRules for it deleted, where it had any; finalizer removed is the claim object released. A claim
gets a DeviceTaintRule ("fence") only on rare paths (a failed scrub, a bypassed guard, admin access, shared
devices, the agent's shutdown): the fence rows say how many claims had one, and n/a when none did. Times come
from the observer's watch of claims, fences and pods; the kube-scheduler rows from its /metrics before and
after the run (failed attempts, and the pods that ResourceSlice updates, DeviceTaintRules included, and claim
updates put back into its queue). Failed syncs per claim of kube-controller-manager's resourceclaim controller come
from its /metrics read the same way (workqueue_retries_total of its queue `resource_claim`: each sync that failed and
was put back rate-limited, as a deallocation refused until the attestation or a conflicting write is; every retry
shares the controller's one token bucket). API requests per claim come from kube-apiserver's /metrics read the same
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
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--without-scrubgate",
        action="store_true",
        help="the same load with scrubgate's webhooks, policy and agent removed first (a baseline)",
    )
    what.add_argument(
        "--alternate",
        type=int,
        metavar="PAIRS",
        help="per --parallelism value, PAIRS runs with scrubgate and as many without, alternating, and their ratios",
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
    # (parallelism, with scrubgate, column header) of each run, in the order they run
    plan = [
        (parallelism, scrubgate, header)
        for parallelism in args.parallelism
        for pair in range(args.alternate or 1)
        for scrubgate, header in (
            [(True, f"scrubgate {pair + 1}"), (False, f"without {pair + 1}")]
            if args.alternate
            else [(not args.without_scrubgate, f"{parallelism} at once")]
        )
    ]
    results = []
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sg-lifecycle-bench-", dir=args.workdir) as base:
        for i, (parallelism, scrubgate, header) in enumerate(plan):
            spec = LoadSpec(
                claims=args.claims,
                parallelism=parallelism,
                run_seconds=args.run_seconds,
                timeout_s=args.timeout,
                refused_claim=True,
            )
            with Cluster(
                Path(base) / f"run-{i + 1}", gpus=args.gpus, mig_per_gpu=args.mig, client_qps=args.kube_api_qps or None
            ) as cluster:
                if scrubgate:
                    cluster.call_webhook_directly()
                else:
                    cluster.uninstall_scrubgate()
                print(f"run {i + 1} ({header}): {spec}", file=sys.stderr, flush=True)
                results.append(run_load(cluster, spec, lambda line: print(f"  {line}", file=sys.stderr, flush=True)))
    failed = False
    for parallelism in args.parallelism:
        runs = [
            (r, scrubgate, header) for r, (p, scrubgate, header) in zip(results, plan, strict=True) if p == parallelism
        ]
        print(f"\n{parallelism} pods at once\n")
        print(markdown_table([r for r, _, _ in runs], [header for _, _, header in runs]))
        if args.alternate:
            print()
            print(ratio_table([r for r, _, _ in runs]))
        for result, scrubgate, header in runs:
            problems = result.problems() if scrubgate else []  # nothing is meant to end clean without scrubgate
            if problems:
                failed = True
                print(f"\n{header} did not end clean ({len(problems)} problems):")
                print("\n".join(f"- {p}" for p in problems[:20]))
    return 1 if failed else 0


def ratio_table(runs: list) -> str:
    """Each pair's ratios, scrubgate's to the bare control plane's (runs: with, without, with, without, ...), and
    their mean."""
    from devcluster.load import CONTROL_PLANE

    rows = []
    for pair, (mine, bare) in enumerate(zip(runs[::2], runs[1::2], strict=True)):
        attempts = (mine.failed_attempts_per_pod, bare.failed_attempts_per_pod)
        plane = (mine.cpu_per_claim(CONTROL_PLANE), bare.cpu_per_claim(CONTROL_PLANE))
        rows.append(
            (
                str(pair + 1),
                mine.claims_per_s / bare.claims_per_s if bare.claims_per_s else None,
                attempts[0] / attempts[1] if None not in attempts and attempts[1] else None,
                plane[0] / plane[1] if plane[1] else None,
            )
        )

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    rows.append(("mean", *(mean([r[i] for r in rows]) for i in (1, 2, 3))))
    lines = [
        "| pair | claims/s | failed attempts per pod | control plane CPU per claim |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {row[0]} | {' | '.join(_ratio(v) for v in row[1:])} |" for row in rows]
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
