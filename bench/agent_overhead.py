"""The node agent's own overhead: release seen -> attestation written, minus the scrub itself.

Goal (issue 4): <= 100 ms. Runs the real agent (state machine, checkpoint with fsync, signing) on the
simulated GPU backend and the in-memory cluster; an optional per-call delay stands in for the API
server's round trip, so the table also shows what a real cluster adds (API calls on the path x RTT).

    .venv/bin/python bench/agent_overhead.py [--runs 20] [--memory-mib 16] [--gpus 1 2 8] [--rtt-ms 0 2]

Prints a Markdown table. The end is the claim write that carries the attestation (and, in the same patch, the
finalizer's removal), which lets the resourceclaim controller deallocate the claim: its devices are allocatable
again then (no fence is made while the claim's allocation holds them).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scrubgate.policies import names
from scrubgate.sanitizer_agent.agent import Agent, AgentSettings
from scrubgate.sanitizer_agent.checkpoint import CheckpointStore
from scrubgate.sanitizer_agent.gpu import simulated
from scrubgate.sanitizer_agent.gpu.simulated import SimulatedGpu
from scrubgate.sanitizer_agent.signing import Signer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from memcluster import InMemoryCluster

NODE = "bench-node"
DRIVER = "gpu.nvidia.com"


class TimedBackend:
    """The simulated backend, with the time spent inside scrub() recorded (that part is not overhead)."""

    def __init__(self, inner: SimulatedGpu) -> None:
        self.inner = inner
        self.scrub_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def scrub(self, uuid: str):
        started = time.perf_counter()
        try:
            return self.inner.scrub(uuid)
        finally:
            self.scrub_s += time.perf_counter() - started


def one_run(tmp: Path, gpus: int, memory: int, rtt_s: float) -> tuple[float, float, int]:
    """(overhead s, scrub s, API calls from release to the attestation) for one claim holding `gpus` GPUs."""
    devices = simulated.create_inventory(tmp / "sim", gpus=gpus, memory_bytes=memory)
    cluster = InMemoryCluster()
    cluster.add_node(NODE)
    cluster.add_slice(NODE, DRIVER, NODE, {f"gpu-{i}": {"uuid": d.uuid} for i, d in enumerate(devices)})
    cluster.add_claim("bench", "claim", [(DRIVER, NODE, f"gpu-{i}") for i in range(gpus)])
    pod = cluster.add_pod("bench", "pod", NODE, ["claim"])
    backend = TimedBackend(SimulatedGpu(tmp / "sim"))
    agent = Agent(
        AgentSettings(node=NODE, nvidia_checkpoint=None),
        cluster=cluster,
        backend=backend,
        store=CheckpointStore(tmp / "checkpoint.json", NODE),
        signer=Signer(Ed25519PrivateKey.generate(), "bench"),
    )
    agent.start()
    agent.observe_pod("ADDED", pod)
    for d in devices:
        simulated.fill(tmp / "sim", d.uuid, b"CANARY")

    attested: list[float] = []
    key = "/metadata/annotations/" + names.ANNOTATION_ATTESTATION.replace("/", "~1")

    def writes_attestation(op: dict[str, Any]) -> bool:
        # The key alone, or the claim's first annotations, all at once.
        whole = op["path"] == "/metadata/annotations" and names.ANNOTATION_ATTESTATION in op.get("value", {})
        return op["path"] == key or whole

    def hook(operation: str, args: tuple[Any, ...]) -> None:
        if rtt_s:
            time.sleep(rtt_s)
        if operation == "patch_claim" and any(writes_attestation(op) for op in args[2]):
            attested.append(time.perf_counter())

    cluster.hook = hook
    finished = cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded")
    calls_at_release = len(cluster.calls)
    started = time.perf_counter()
    agent.observe_pod("MODIFIED", finished)
    if len(attested) != 1 or cluster.rules:
        raise RuntimeError("the teardown did not write its attestation once, fence-free")
    calls = cluster.calls[calls_at_release:]
    on_path = calls.index("patch_claim") + 1
    return attested[0] - started - backend.scrub_s, backend.scrub_s, on_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--memory-mib", type=int, default=16, help="simulated memory per GPU")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 8], help="GPUs per claim")
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 2.0], help="simulated API round trip")
    args = parser.parse_args()
    print(f"agent overhead, release -> attestation written minus scrub; {args.runs} runs each; {platform.python_version()}, "
          f"{platform.machine()}; simulated GPUs of {args.memory_mib} MiB, checkpoint fsync'ed on the local disk\n")  # fmt: skip
    print("| GPUs/claim | API RTT | API calls on path | overhead median | p95 | max | scrub median |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for gpus in args.gpus:
        for rtt in args.rtt_ms:
            overheads, scrubs, calls = [], [], 0
            for _ in range(args.runs):
                with tempfile.TemporaryDirectory(prefix="sg-agent-bench-") as tmp:
                    overhead, scrub, calls = one_run(Path(tmp), gpus, args.memory_mib << 20, rtt / 1000)
                overheads.append(overhead * 1000)
                scrubs.append(scrub * 1000)
            overheads.sort()
            p95 = overheads[min(len(overheads) - 1, round(0.95 * (len(overheads) - 1)))]
            print(
                f"| {gpus} | {rtt:g} ms | {calls} | {statistics.median(overheads):.1f} ms | {p95:.1f} ms "
                f"| {overheads[-1]:.1f} ms | {statistics.median(scrubs):.1f} ms |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
