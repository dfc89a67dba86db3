"""Where kube-apiserver's CPU goes per claim, with scrubgate and without it, under the same load.

bench/lifecycle.py says how much more CPU per claim the control plane spends with scrubgate; this says on what.
Each run starts a fresh local installation (devcluster, as bench/lifecycle.py does, with kube-apiserver's
/debug/pprof served), puts devcluster.load's workload through it, and after `--warmup` seconds takes a CPU profile
of kube-apiserver over `--seconds`. The profile's samples are split by what they were doing (the first matching
row of CATEGORIES, in order, so each sample counts once) and divided by the claims created within the profile's
window (kube-apiserver's own apiserver_request_total). `--pairs N` alternates N runs with scrubgate and N without.

    .venv/bin/python bench/apiserver_cpu.py [--claims 400] [--parallelism 48] [--run-seconds 1] [--pairs 1]
                                            [--warmup 5] [--seconds 15] [--gpus 8] [--mig 7] [--kube-api-qps 200]

Prints one table: CPU milliseconds per claim by category, with scrubgate, without, the difference, and each
category's share of the difference. Exits 1 when a run with scrubgate did not end clean.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# (row, substrings of function names in a sampled stack); the first row that matches takes the sample.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("admission webhooks: matchConditions (CEL)", ("matchconditions.(*matcher).Match",)),
    (
        "admission webhooks: the calls (AdmissionReview, TLS, patches)",
        # persistConn: kube-apiserver's own HTTP client, whose only server here is the webhook
        ("(*validatingDispatcher).Dispatch", "(*mutatingDispatcher).Dispatch", "net/http.(*persistConn)"),
    ),
    ("writes: managedFields", ("managedfields/internal.(*FieldManager)",)),
    ("writes: applying a PATCH", ("applyPatchToCurrentObject",)),
    # a write's storage work runs in a goroutine of finishRequest's, whose stack starts there, not in the handler
    (
        "writes: the rest (decode, validation, etcd, encode)",
        (
            "finisher.finishRequest",
            "handlers.UpdateResource",
            "handlers.PatchResource",
            "handlers.(*patcher)",
            "createHandler",
            "handlers.DeleteResource",
        ),
    ),
    ("watches served", ("(*WatchServer)", "(*cacheWatcher)", "(*Cacher).dispatchEvent")),
    ("reads (GET, LIST)", ("handlers.GetResource", "handlers.ListResource")),
    # the handler chain's filters (the inner ones run in a goroutine of the timeout filter's)
    (
        "every request: TLS, authentication, authorization, priority and fairness",
        ("net/http.(*conn).serve", "http2", "(*timeoutHandler)"),
    ),
    ("etcd client and watch cache", ("go.etcd.io/etcd", "google.golang.org/grpc", "storage/cacher", "storage/etcd3")),
    ("garbage collection", ("runtime.gcBgMarkWorker", "runtime.bgsweep", "runtime.bgscavenge")),
]
OTHER = "other"
CLAIMS_CREATED = "claims-created"
WANTED = {
    "apiserver_request_total": lambda labels: (
        (CLAIMS_CREATED,)
        if (labels.get("resource"), labels.get("subresource", ""), labels.get("verb"), labels.get("code"))
        == ("resourceclaims", "", "POST", "201")
        else ()
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=400)
    parser.add_argument("--parallelism", type=int, default=48, help="pods at once")
    parser.add_argument("--run-seconds", type=float, default=1.0, help="mean pod run time (spread +-25%%)")
    parser.add_argument("--pairs", type=int, default=1, help="runs with scrubgate and as many without, alternating")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the profile starts")
    parser.add_argument("--seconds", type=int, default=15, help="length of the profile")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--mig", type=int, default=7, help="MIG slices per GPU")
    parser.add_argument("--timeout", type=float, default=300.0, help="bounded wait per run, seconds")
    parser.add_argument("--kube-api-qps", type=float, default=200.0, help="as bench/lifecycle.py's")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO_ROOT))  # devcluster and bench are at the repo root, not installed packages
    from bench.lifecycle import machine

    print(f"{time.strftime('%Y-%m-%d')}; {machine()}")
    print(f"command: python bench/apiserver_cpu.py {' '.join(sys.argv[1:])}".rstrip())
    per_claim: dict[bool, list[Counter[str]]] = {True: [], False: []}
    failed = []
    with tempfile.TemporaryDirectory(prefix="sg-apiserver-cpu-") as base:
        for i in range(2 * args.pairs):
            scrubgate = i % 2 == 0
            split, claims, problems = profile_run(Path(base) / f"run-{i + 1}", scrubgate, args)
            label = "with scrubgate" if scrubgate else "without"
            print(f"run {i + 1} ({label}): {claims} claims created in the profile's window", file=sys.stderr)
            if claims:
                per_claim[scrubgate].append(Counter({k: v * 1000 / claims for k, v in split.items()}))
            if scrubgate and problems:
                failed.append(f"run {i + 1}: {len(problems)} problems, first: {problems[0]}")
    print()
    print(table(mean(per_claim[True]), mean(per_claim[False])))
    for line in failed:
        print(f"\n{line}")
    return 1 if failed else 0


def profile_run(workdir: Path, scrubgate: bool, args: argparse.Namespace) -> tuple[Counter[str], int, list[str]]:
    """One installation under load: kube-apiserver's CPU seconds by category over the profile, the claims created
    within it, and what did not end clean."""
    from bench.pprof import read
    from devcluster.harness import Cluster
    from devcluster.load import LoadSpec, counters, run_load

    spec = LoadSpec(
        claims=args.claims,
        parallelism=args.parallelism,
        run_seconds=args.run_seconds,
        timeout_s=args.timeout,
        refused_claim=False,
    )
    with Cluster(
        workdir, gpus=args.gpus, mig_per_gpu=args.mig, client_qps=args.kube_api_qps or None, apiserver_profiling=True
    ) as cluster:
        if scrubgate:
            cluster.call_webhook_directly()
        else:
            cluster.uninstall_scrubgate()
        plane = cluster.control_plane
        results = []
        load = threading.Thread(target=lambda: results.append(run_load(cluster, spec, lambda _: None)))
        load.start()
        time.sleep(args.warmup)
        before = counters(plane.apiserver_metrics(), WANTED)
        profile = read(plane.cpu_profile(args.seconds))
        after = counters(plane.apiserver_metrics(), WANTED)
        load.join()
    problems = results[0].problems() if results else ["the load did not finish"]
    split = profile.split(CATEGORIES, OTHER)
    return split, int(after[CLAIMS_CREATED] - before[CLAIMS_CREATED]), problems


def mean(runs: list[Counter[str]]) -> Counter[str]:
    total: Counter[str] = Counter()
    for run in runs:
        total.update(run)
    return Counter({k: v / len(runs) for k, v in total.items()}) if runs else total


def table(mine: Counter[str], bare: Counter[str]) -> str:
    """Milliseconds of kube-apiserver's CPU per claim by category: with, without, the difference, its share."""
    rows = [label for label, _ in CATEGORIES] + [OTHER]
    extra = sum(mine.values()) - sum(bare.values())
    lines = [
        "| kube-apiserver CPU per claim | with scrubgate | without | difference | share of the difference |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        diff = mine[row] - bare[row]
        share = f"{100 * diff / extra:.0f}%" if extra > 0 else "n/a"
        lines.append(f"| {row} | {mine[row]:.1f} ms | {bare[row]:.1f} ms | {diff:+.1f} ms | {share} |")
    total_mine, total_bare = sum(mine.values()), sum(bare.values())
    ratio = f"{total_mine / total_bare:.2f}x" if total_bare else "n/a"
    lines.append(f"| in all | {total_mine:.1f} ms | {total_bare:.1f} ms | {extra:+.1f} ms ({ratio}) | 100% |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
