"""Throughput of `scrubgate check` (issue 2, item 7; issue 13).

Generates a corpus of DRA manifests (every resource.k8s.io version, every pod-carrying kind, unrelated kinds)
in each of two shapes: `multi-document` (files of 25 documents, ~10% violations) and `many-small` (one
document a file, ~half of them violating a rule, as in a repository of hand-written manifests). Then, per
shape, it times:

  * policy evaluation alone, in process, on one core: objects/s (goal >= 50,000);
  * YAML parsing + evaluation, in process, on one core: documents/s;
  * `scrubgate check --format json CORPUS` as a whole process: documents/s (goal >= 10,000);
  * `checkov -d CORPUS --framework kubernetes --quiet` on the same corpus, where checkov is installed in
    bench/.checkov-venv (see bench/README.md): the ratio (goal: scrubgate >= 20x faster).

Run: .venv/bin/python bench/check_throughput.py [--docs 12000 ...] [--shape multi-document many-small]
                                                [--repeat 3] [--no-checkov]
Prints a table per shape; exits 1 when a goal is missed.

Installs side by side (issue 31): `--installs VENV [VENV ...]` times the `scrubgate` of each virtualenv instead,
in alternating rounds, on each corpus: the size of its site-packages, its start-up (`check` of one small
document) and `check --format json CORPUS` (wall and CPU). For example, the checker alone against the same
with the server extra:

  python3 -m venv /tmp/light && /tmp/light/bin/pip install .
  python3 -m venv /tmp/full && /tmp/full/bin/pip install '.[server]'
  .venv/bin/python bench/check_throughput.py --shape many-small --docs 1440 13440 --installs /tmp/light /tmp/full
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from scrubgate.policies.config import load_policy
from scrubgate.policies.engine import shared_claims, validate
from scrubgate.policies.model import POD_SPEC_PATHS

from scrubgate.check import run_check

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CHECKOV = BENCH / ".checkov-venv" / "bin" / "checkov"
SCRUBGATE = Path(sys.executable).with_name("scrubgate")
GOALS = {"evaluation": 50_000, "end_to_end": 10_000, "checkov_ratio": 20}

# --- corpus ----------------------------------------------------------------------------------------------------

# kind -> (apiVersion, path to its PodSpec), from the policy core's own table (first, current version).
WORKLOADS = {kind: (sorted(versions)[0], path) for kind, (versions, path) in POD_SPEC_PATHS.items()}
CLASSES = ("gpu.nvidia.com", "mig.nvidia.com", "gpu.nvidia.com", "vfio.gpu.nvidia.com", "gpu.example.com")
VIOLATIONS = ("retain", "admin", "fence", "shared", "short-grace", "no-grace")


def _request(version: str, device_class: str, rng: random.Random) -> dict[str, Any]:
    fields: dict[str, Any] = {"deviceClassName": device_class}
    if rng.random() < 0.3:
        fields["selectors"] = [{"cel": {"expression": f"device.attributes['{device_class}'].productName == 'H100'"}}]
    if version in ("v1beta1", "v1alpha3"):
        return {"name": "gpu", **fields, "allocationMode": "ExactCount", "count": 1}
    if rng.random() < 0.2:
        return {
            "name": "gpu",
            "firstAvailable": [{"name": "big", **fields}, {"name": "small", "deviceClassName": "mig.nvidia.com"}],
        }
    return {"name": "gpu", "exactly": {**fields, "allocationMode": "ExactCount", "count": 1}}


def _claim(i: int, rng: random.Random, violation: str | None) -> dict[str, Any]:
    version = rng.choice(("v1", "v1", "v1beta2", "v1beta1", "v1alpha3"))
    kind = rng.choice(("ResourceClaim", "ResourceClaimTemplate", "ResourceClaimTemplate"))
    device_class = "gpu.nvidia.com" if violation else rng.choice(CLASSES)
    request = _request(version, device_class, rng)
    target = request
    if "exactly" in request:
        target = request["exactly"]
    elif "firstAvailable" in request:
        target = request["firstAvailable"][0]
    if violation == "admin":
        if "firstAvailable" in request:
            request = {"name": "gpu", "exactly": {"deviceClassName": device_class}}
            target = request["exactly"]
        target["adminAccess"] = True
    elif violation == "fence":
        target["tolerations"] = [{"key": "scrubgate.dev/unsanitized", "operator": "Exists", "effect": "NoSchedule"}]
    meta: dict[str, Any] = {"name": f"gpu-{i}", "namespace": f"team-{i % 40}", "labels": {"app": f"app-{i % 97}"}}
    devices = {"devices": {"requests": [request]}}
    annotations = {"scrubgate.dev/deallocation-policy": "Retain"} if violation == "retain" else {}
    if kind == "ResourceClaim":
        meta["finalizers"] = ["scrubgate.dev/sanitize"]
        if annotations:
            meta["annotations"] = annotations
        spec: dict[str, Any] = devices
    else:
        spec = {"metadata": {"labels": {"app": f"app-{i % 97}"}, "annotations": annotations}, "spec": devices}
    return {"apiVersion": f"resource.k8s.io/{version}", "kind": kind, "metadata": meta, "spec": spec}


def _workload(i: int, rng: random.Random, violation: str | None) -> dict[str, Any]:
    kind = rng.choice(list(WORKLOADS))
    api_version, path = WORKLOADS[kind]
    claim_ref = (
        {"resourceClaimName": f"gpu-{i}"} if violation == "shared" else {"resourceClaimTemplateName": f"gpu-{i}"}
    )
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 5 if violation == "short-grace" else rng.choice((30, 60, 120)),
        "restartPolicy": "Never" if kind in ("Pod", "Job", "CronJob") else "Always",
        "containers": [
            {
                "name": "main",
                "image": f"nvcr.io/nvidia/pytorch:25.0{i % 9}-py3",
                "command": ["python", "train.py", f"--shard={i}"],
                "env": [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "SHARD", "value": str(i)}],
                "resources": {"claims": [{"name": "gpu"}], "requests": {"cpu": "4", "memory": "32Gi"}},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }
        ],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": f"data-{i % 50}"}}],
        "resourceClaims": [{"name": "gpu", **claim_ref}],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    if violation == "no-grace":
        del spec["terminationGracePeriodSeconds"]
    if violation == "fence":
        spec["tolerations"].append({"key": "scrubgate.dev/unsanitized", "operator": "Exists"})
    obj: dict[str, Any] = {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": f"train-{i}", "namespace": f"team-{i % 40}", "labels": {"app": f"app-{i % 97}"}},
    }
    node = obj
    for key in path[:-1]:
        node = node.setdefault(key, {})
        if key == "template":
            node["metadata"] = {"labels": {"app": f"app-{i % 97}"}}
    node[path[-1]] = spec
    if kind in ("Deployment", "StatefulSet", "ReplicaSet", "DaemonSet"):
        obj["spec"]["selector"] = {"matchLabels": {"app": f"app-{i % 97}"}}
        if kind != "DaemonSet":
            obj["spec"]["replicas"] = 1 + i % 4
    return obj


def _other(i: int, rng: random.Random) -> dict[str, Any]:
    meta = {"name": f"other-{i}", "namespace": f"team-{i % 40}"}
    return rng.choice(
        [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": meta,
                "data": {"config.yaml": f"shard: {i}\nlr: 0.001\n"},
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": meta,
                "spec": {"selector": {"app": f"app-{i % 97}"}, "ports": [{"port": 80, "targetPort": 8080}]},
            },
            {"apiVersion": "resource.k8s.io/v1alpha2", "kind": "ResourceClaim", "metadata": meta, "spec": {}},
        ]
    )


# The two corpus shapes: (documents per file, share of documents breaking a deny rule). Multi-document files of
# generated manifests with few findings, and a repository of small hand-written files, half of them with one.
SHAPES = {"multi-document": (25, 0.10), "many-small": (1, 0.50)}


def generate(corpus: Path, docs: int, shape: str = "multi-document", seed: int = 2025) -> int:
    """Writes `docs` documents into `corpus` in the given shape (multi-document YAML files and single-object JSON
    files); returns how many of them violate a deny rule."""
    docs_per_file, violating_share = SHAPES[shape]
    rng = random.Random(seed)
    if corpus.is_dir() and any(corpus.iterdir()) and not (corpus / "meta.txt").exists():
        raise SystemExit(f"{corpus} is not empty and not a corpus this benchmark wrote: refusing to replace it")
    shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir(parents=True)
    objects, violating = [], 0
    for i in range(docs):
        roll = rng.random()
        violation = rng.choice(VIOLATIONS) if rng.random() < violating_share else None
        if roll < 0.35:
            if violation in ("shared", "short-grace", "no-grace"):
                violation = "retain"
            objects.append(_claim(i, rng, violation))
        elif roll < 0.90:
            if violation in ("retain", "admin"):
                violation = "shared"
            objects.append(_workload(i, rng, violation))
        else:
            violation = None
            objects.append(_other(i, rng))
        violating += violation is not None
    index = 0
    for number, start in enumerate(range(0, docs, docs_per_file)):
        chunk = objects[start : start + docs_per_file]
        team = corpus / f"team-{number % 20:02d}"
        team.mkdir(exist_ok=True)
        if number % 10 == 9:  # some JSON: one object per file
            for obj in chunk:
                (team / f"object-{index:06d}.json").write_text(json.dumps(obj, indent=2))
                index += 1
        else:
            text = yaml.dump_all(chunk, Dumper=yaml.CSafeDumper, sort_keys=False, explicit_start=docs_per_file > 1)
            (team / f"manifests-{number:05d}.yaml").write_text(text)
            index += len(chunk)
    (corpus / "meta.txt").write_text(f"{docs} {violating} {seed} {shape}\n")  # not read by either tool (not yaml/json)
    return violating


# --- timing ----------------------------------------------------------------------------------------------------


def best_of(repeat: int, run: Callable[[], Any]) -> tuple[float, float, Any]:
    """(best, median) wall seconds over `repeat` runs, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), result


def load_objects(corpus: Path) -> list[dict[str, Any]]:
    objects = []
    for path in sorted(corpus.rglob("*")):
        if path.suffix == ".yaml":
            objects += [d for d in yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader) if isinstance(d, dict)]
        elif path.suffix == ".json":
            objects.append(json.loads(path.read_text()))
    return objects


def evaluate(objects: list[dict[str, Any]], policy) -> int:
    """What `check` does per object after parsing: validate, then SG002 across the documents."""
    findings = 0
    for obj in objects:
        findings += len(validate(obj, policy, trusted=False))
    findings += len(shared_claims(((i, o, False) for i, o in enumerate(objects)), policy))
    return findings


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_scrubgate(corpus: Path, out: Path, cpu: list[float]) -> dict[str, Any]:
    """Runs the command; appends the CPU seconds it used to `cpu` (on a shared machine, the steadier measure)."""
    before = children_cpu()
    with out.open("w") as sink:
        done = subprocess.run([str(SCRUBGATE), "check", "--format", "json", str(corpus)], stdout=sink, check=False)
    cpu.append(children_cpu() - before)
    if done.returncode not in (0, 1):
        raise SystemExit(f"scrubgate check failed with exit {done.returncode}")
    return json.loads(out.read_text())["summary"]


def run_checkov(corpus: Path) -> int:
    """Failed checks that checkov reports: proof that it read the corpus. --skip-download: no network here
    (and it would time the Prisma Cloud API, not checkov)."""
    done = subprocess.run(
        [str(CHECKOV), "-d", str(corpus), "--framework", "kubernetes", "--quiet", "--compact", "--skip-download"],
        capture_output=True,
        text=True,
        check=False,
    )
    failed = sum(1 for line in done.stdout.splitlines() if line.startswith("Check: "))
    if not failed:
        raise SystemExit(f"checkov reported nothing (exit {done.returncode}): {done.stderr[-2000:]}")
    return failed


def site_packages_mb(venv: Path) -> float:
    """What a virtualenv's site-packages hold on disk (pip included: every fresh virtualenv has it)."""
    total = 0
    for root, _, files in os.walk(next(venv.glob("lib/python*/site-packages"))):
        total += sum(os.lstat(os.path.join(root, name)).st_blocks * 512 for name in files)
    return total / 2**20


def timed_check(scrubgate: Path, target: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of `scrubgate check --format json TARGET`."""
    before, start = children_cpu(), time.perf_counter()
    done = subprocess.run([str(scrubgate), "check", "--format", "json", str(target)], capture_output=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{scrubgate} check {target} failed with exit {done.returncode}: {done.stderr[-2000:]!r}")
    return wall, children_cpu() - before


def compare_installs(args: argparse.Namespace, corpus: Path, shape: str, docs: int) -> None:
    """Each install's size, start-up and run over the corpus, rounds alternating between installs (on a shared
    machine only alternating runs compare); best and median of `--repeat` rounds."""
    generate(corpus, docs, shape)
    one = min(corpus.glob("*/*.yaml"))
    installs = [(venv, venv / "bin" / "scrubgate") for venv in args.installs]
    startup: dict[Path, list[tuple[float, float]]] = {venv: [] for venv, _ in installs}
    runs: dict[Path, list[tuple[float, float]]] = {venv: [] for venv, _ in installs}
    for _ in range(args.repeat):
        for venv, scrubgate in installs:
            startup[venv] += [timed_check(scrubgate, one) for _ in range(3)]
            runs[venv].append(timed_check(scrubgate, corpus))
    print(f"\n{shape} corpus, {docs:,} documents: {corpus}")
    print("| install | site-packages | start-up: check of one document | check --format json CORPUS |")
    print("| --- | ---: | ---: | ---: |")
    for venv, _ in installs:
        walls = sorted(w for w, _ in runs[venv])
        print(
            f"| {venv} | {site_packages_mb(venv):.0f} MB | {min(w for w, _ in startup[venv]):.3f} s "
            f"(median {statistics.median(w for w, _ in startup[venv]):.3f} s) | {walls[0]:.2f} s "
            f"(median {statistics.median(walls):.2f} s), {min(c for _, c in runs[venv]):.2f} CPU-s |"
        )


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), {platform.python_implementation()} {platform.python_version()}, {platform.system()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--docs", type=int, nargs="+", default=[12_000], help="documents in the corpus, one corpus each (default 12000)"
    )
    parser.add_argument(
        "--installs",
        type=Path,
        nargs="+",
        metavar="VENV",
        help="time the scrubgate of these virtualenvs side by side instead (see above)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per scrubgate measurement; the best counts")
    parser.add_argument(
        "--corpus",
        type=Path,
        help="where to write the corpus and keep it (default: a temporary directory; not a hidden one, which "
        "checkov skips)",
    )
    parser.add_argument("--no-checkov", action="store_true", help="skip checkov even where it is installed")
    parser.add_argument(
        "--shape", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="corpus shapes (default: both)"
    )
    args = parser.parse_args()
    print(f"machine: {machine()}")
    failed = 0
    for shape in args.shape:
        for docs in args.docs:
            with tempfile.TemporaryDirectory(prefix="scrubgate-bench-") as tmp:
                corpus = (args.corpus / shape) if args.corpus else Path(tmp) / "corpus"
                if args.installs:
                    compare_installs(args, corpus, shape, docs)
                else:
                    failed |= bench(args, corpus, shape, docs)
    return failed


def bench(args: argparse.Namespace, corpus: Path, shape: str, docs: int) -> int:
    violating = generate(corpus, docs, shape)
    policy = load_policy()
    rows: list[tuple[str, str, str, str]] = []
    missed = []

    # In-process parts on one core: Python runs one thread anyway; pinning keeps the scheduler from moving it.
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if affinity:
        os.sched_setaffinity(0, {min(affinity)})
    objects = load_objects(corpus)
    rounds = max(1, 200_000 // len(objects))
    best, median, _ = best_of(args.repeat, lambda: [evaluate(objects, policy) for _ in range(rounds)])
    evaluation = rounds * len(objects) / best
    rows.append(
        ("policy evaluation (in process, 1 core)", f"{evaluation:,.0f} objects/s", f">= {GOALS['evaluation']:,}", "")
    )
    if evaluation < GOALS["evaluation"]:
        missed.append("evaluation")

    best, median, result = best_of(args.repeat, lambda: run_check([str(corpus)], policy))
    documents = len(result.objects)
    rows.append(
        ("YAML parsing + evaluation (in process, 1 core)", f"{documents / best:,.0f} docs/s", "", f"{best:.2f} s")
    )
    if affinity:
        os.sched_setaffinity(0, affinity)

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cpu: list[float] = []
        best, median, summary = best_of(args.repeat, lambda: run_scrubgate(corpus, out, cpu))
    end_to_end = summary["documents"] / best
    rows.append(
        (
            "scrubgate check --format json (process)",
            f"{end_to_end:,.0f} docs/s",
            f">= {GOALS['end_to_end']:,}",
            f"{best:.2f} s (median {median:.2f} s)",
        )
    )
    rows.append(
        (
            "the same, per CPU second of the process",
            f"{summary['documents'] / min(cpu):,.0f} docs/CPU-s",
            "",
            f"{min(cpu):.2f} CPU-s",
        )
    )
    if end_to_end < GOALS["end_to_end"]:
        missed.append("end_to_end")
    scrubgate_seconds = best

    if args.no_checkov:
        rows.append(("checkov", "skipped (--no-checkov)", "", ""))
    elif not CHECKOV.exists():
        rows.append(("checkov", f"not installed ({CHECKOV.relative_to(REPO)}; see bench/README.md)", "", ""))
    else:
        seconds, _, failed = best_of(1, lambda: run_checkov(corpus))
        ratio = seconds / scrubgate_seconds
        rows.append(
            (
                "checkov -d CORPUS --framework kubernetes --quiet",
                f"{summary['documents'] / seconds:,.0f} docs/s",
                "",
                f"{seconds:.2f} s ({failed:,} failed checks)",
            )
        )
        rows.append(("scrubgate speed-up over checkov", f"{ratio:,.1f}x", f">= {GOALS['checkov_ratio']}x", ""))
        if ratio < GOALS["checkov_ratio"]:
            missed.append("checkov_ratio")

    print(
        f"\n{shape} corpus: {corpus} - {summary['files']} files, {summary['documents']} documents, "
        f"{violating} violating a deny rule ({violating / summary['documents']:.0%}); scrubgate found "
        f"{summary['deny']} deny, {summary['warn']} warn"
    )
    widths = [max(len(r[i]) for r in [("measure", "rate", "goal", "time"), *rows]) for i in range(4)]
    for row in [("measure", "rate", "goal", "time"), tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |")
    if missed:
        print(f"goals missed: {', '.join(missed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
