"""What each node agent asks of kube-apiserver as the cluster grows, at the same claims per node.

Per-agent requests/s and objects/s at N = 10, 100, 1,000 nodes.

One local installation (devcluster.harness: the real control plane, the real webhook, `--agents` simulated GPU
nodes with the kubelet stand-in, the driver and the real agent), grown to each N in turn with nodes that are
only objects: a Node, its driver's ResourceSlices (`--gpus` GPUs, with `--mig` 7 MIG slices each), and on every
leaf device (GPU, or MIG slice) a claim allocated and reserved for a pod bound to the node, all written straight
to the API server by a few parallel connections (bench/scale_objects.py). The real nodes get the same claims
and pods, so their agents track as many claims as any node would.

Production intervals, in a shortened window: the agents run with their production resync (30 s) times `--window` /
600, and each N is measured over a window of `--window` seconds, which stands for 10 minutes of production time;
rates are per production second. Each window starts as the agents, killed, start again: an agent's start-up reads
are counted once per 10 minutes (agents that listed every claim at start and every 10 minutes did so once per
window, as in production; one that reads only its own node's claims pays its start-up list once per window, more
than in production).

What is counted comes from kube-apiserver itself: its audit log (a policy the bench writes, bench/scale_audit.py)
records every request of the agents' ServiceAccount (each agent told apart by the node its token is bound to) and
of scrubgate's controller (or of each `--central-user`), with the response of their reads; requests are counted
by when they were received, objects returned are the items of a list and one per get (a watch's events are not
in the audit log: the agents watch only their own node's pods and claims, which do not change here). The central component is not restarted and keeps its own intervals (leader election renewals every 2 s),
so its rates are per second of the window itself, and its start-up list of every claim (once per leader) is not in
them. scrubgate's total is the per-agent rate times N plus the central component's; beside it, the kubelets'
periodic requests at that N (bench/scale_report.py states the model and its sources).

    .venv/bin/python bench/scale.py [--nodes 10 100 1000] [--mig] [--window 60] [--agents 3]
                                    [--central-user NAME ...] [--workers 8] [--workdir DIR]

Prints a Markdown table (and one agent's requests by call); exits 1 when the bar is not met: per-agent requests/s
and objects/s at the largest N no more than 1.25x those at the smallest.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

# devcluster and bench are at the repo root, not installed packages
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scrubgate.policies import names

from bench.lifecycle import machine
from bench.scale_audit import audit_policy, count
from bench.scale_objects import allocated, claim, devices, leaf_devices, node_object, pod
from bench.scale_report import PRODUCTION_WINDOW_S, Step, bar, calls_table, table
from devcluster import driver
from devcluster.harness import Cluster, wait_for

NAMESPACE = "scale"
NODE_LABEL = "bench.scrubgate.dev/node"  # on the bench's claims: the node they are allocated on
SETTLE_TIMEOUT_S = 300.0
# What a write may meet under the bench's own load and is worth trying again: a webhook call that failed (a
# connection the webhook closed as kube-apiserver reused it), API Priority and Fairness turning it away.
TRANSIENT = (429, 500, 503, 504)
ATTEMPTS = 5


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ScaleCluster:
    """The installation, grown node by node: `grow(n)` adds nodes of objects until there are `n` nodes."""

    def __init__(self, cluster: Cluster, *, gpus: int, mig: bool, workers: int) -> None:
        self.cluster = cluster
        self.gpus = gpus
        self.mig = mig
        self.workers = workers
        self.nodes = 0
        self.claims = 0

    def set_up(self) -> None:
        """The namespace (trusted: pods name their claims directly, as the bench binds them), then the real
        nodes' claims and pods."""
        self.cluster.create_namespace(NAMESPACE, trusted=True)
        real = [node.name for node in self.cluster.nodes]
        self.claims += sum(self._in_parallel(self._populate_real, real))
        self.nodes = len(real)

    def grow(self, nodes: int) -> None:
        names = [f"scale-node-{i:05d}" for i in range(self.nodes, nodes)]

        def add(name: str) -> int:
            self._create("/api/v1/nodes", node_object(name))
            slices = driver.resource_slices(name, devices(self.gpus, 7 if self.mig else 0))
            for body in slices:
                self._create(driver.SLICES_PATH, body)
            return self._populate(name, slices)

        self.claims += sum(self._in_parallel(add, names))
        self.nodes = max(self.nodes, nodes)

    def _populate_real(self, node: str) -> int:
        query = [("fieldSelector", f"spec.nodeName={node}")]
        return self._populate(node, self.cluster.request("GET", driver.SLICES_PATH, query=query)["items"])

    def _populate(self, node: str, slices: list[dict[str, Any]]) -> int:
        """A pod bound to `node` and a claim allocated for it on each leaf device of its slices; how many."""
        leaves = leaf_devices(slices, self.mig)
        path = self.cluster.resource_path("resourceclaims", NAMESPACE)
        for device in leaves:
            name = f"{node}-{device}"
            created_pod = self._create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod(name, NAMESPACE, node, name))
            created = self._create(path, claim(name, NAMESPACE, self.mig, {NODE_LABEL: node}))
            body = allocated(created, node, device, name, created_pod["metadata"]["uid"])
            self._retried(lambda body=body, name=name: self.cluster.request("PUT", f"{path}/{name}/status", body))
        return len(leaves)

    def _create(self, collection: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST, tried again on a transient failure; an object an earlier try created is read back."""

        def create() -> dict[str, Any]:
            try:
                return self.cluster.request("POST", collection, body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                return self.cluster.request("GET", f"{collection}/{body['metadata']['name']}")

        return self._retried(create)

    @staticmethod
    def _retried(call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        attempt = 1
        while True:
            try:
                return call()
            except ApiException as exc:
                if exc.status not in TRANSIENT or attempt == ATTEMPTS:
                    raise
                time.sleep(0.1 * 2**attempt)
                attempt += 1

    def _in_parallel(self, work: Callable[[str], int], items: list[str]) -> list[int]:
        with ThreadPoolExecutor(self.workers, thread_name_prefix="scale") as pool:
            return list(pool.map(work, items))

    def wait_settled(self) -> None:
        """Until scrubgate's first writes are done: every claim on a real node carries its agent's record of its
        devices, and every claim its node's label (the agent's, or scrubgate's controller's for the others)."""
        real = ",".join(node.name for node in self.cluster.nodes)
        path = self.cluster.resource_path("resourceclaims", NAMESPACE)

        def settled() -> bool:
            ours = self.cluster.request("GET", path, query=[("labelSelector", f"{NODE_LABEL} in ({real})")])["items"]
            unlabelled = self.cluster.request("GET", path, query=[("labelSelector", f"!{names.LABEL_NODE}")])
            return (
                bool(ours)
                and all(names.ANNOTATION_DEVICES in (c["metadata"].get("annotations") or {}) for c in ours)
                and not unlabelled["items"]
            )

        wait_for(settled, SETTLE_TIMEOUT_S, "scrubgate's first writes on the bench's claims", interval=1.0)


def measure(scale: ScaleCluster, window_s: float, audit_log: Path, agent_user: str, central: list[str]) -> Step:
    """Restart the agents, count over `window_s` seconds; the Step of this size. Killed (-9), not stopped: a
    stopping agent fences what it still owes, which is not what an agent does while it runs."""
    for node in scale.cluster.nodes:
        node.agent.kill()
    start = datetime.now(UTC)
    began = time.monotonic()
    for node in scale.cluster.nodes:
        node.agent.start()
    for node in scale.cluster.nodes:
        node.wait_agent_ready()
    time.sleep(max(0.0, window_s - (time.monotonic() - began)))
    end = datetime.now(UTC)
    time.sleep(1.0)  # requests received before the end and still being answered
    with audit_log.open() as lines:
        traffic = count(lines, start, end)
    agents = {c: (traffic.requests[c], traffic.objects[c]) for c in traffic.clients(agent_user)}
    calls: Counter[str] = Counter()
    for client in agents:
        calls.update(traffic.calls[client])
    central_counts = [(traffic.requests[c], traffic.objects[c]) for u in central for c in traffic.clients(u)]
    return Step(
        nodes=scale.nodes,
        claims=scale.claims,
        agents=agents,
        window_s=window_s,
        central=(sum(r for r, _ in central_counts), sum(o for _, o in central_counts)),
        calls=calls,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 1000], help="cluster sizes, measured in turn")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--mig", action="store_true", help="7 MIG slices per GPU, a claim on each slice")
    parser.add_argument("--agents", type=int, default=3, help="real simulated nodes, each with its agent")
    parser.add_argument(
        "--window", type=float, default=60.0, help="seconds measured per size, standing for 10 production minutes"
    )
    parser.add_argument(
        "--central-user",
        action="append",
        help="a central component's user name (default: scrubgate's controller's ServiceAccount)",
    )
    parser.add_argument("--workers", type=int, default=8, help="parallel connections creating the objects")
    parser.add_argument("--workdir", type=Path, help="where the installation lives (default: a temporary dir)")
    args = parser.parse_args()
    sizes = sorted(set(args.nodes))
    if sizes[0] < args.agents:
        parser.error(f"--nodes {sizes[0]}: fewer nodes than --agents {args.agents}")

    factor = args.window / PRODUCTION_WINDOW_S
    agent_args = ["--resync", f"{30 * factor:g}"]
    print(f"{time.strftime('%Y-%m-%d')}; {machine()}")
    print(f"command: python bench/scale.py {' '.join(sys.argv[1:])}".rstrip())
    print(
        f"{args.gpus} GPUs per node{', 7 MIG slices each, a claim on each slice' if args.mig else ', a claim on each'}"
        f"; {args.agents} real agents (`{' '.join(agent_args)}`: production intervals x {factor:g}); "
        f"a window of {args.window:g} s per size stands for {PRODUCTION_WINDOW_S:g} s"
    )
    agent_user = f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}"
    central = args.central_user or [
        f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.CONTROLLER_SERVICE_ACCOUNT}"
    ]
    steps = []
    with tempfile.TemporaryDirectory(prefix="sg-scale-bench-", dir=args.workdir) as base:
        policy = Path(base) / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(audit_policy([agent_user, *central])))
        with Cluster(
            Path(base) / "cluster",
            nodes=args.agents,
            gpus=args.gpus,
            mig_per_gpu=7 if args.mig else 0,
            agent_args=agent_args,
            audit_policy=policy,
        ) as cluster:
            cluster.call_webhook_directly()
            scale = ScaleCluster(cluster, gpus=args.gpus, mig=args.mig, workers=args.workers)
            began = time.monotonic()
            scale.set_up()
            for nodes in sizes:
                scale.grow(nodes)
                setup = time.monotonic() - began
                log(f"{scale.nodes} nodes, {scale.claims} claims after {setup:.0f}s; measuring {args.window:g}s")
                scale.wait_settled()
                step = measure(scale, args.window, cluster.control_plane.audit_log, agent_user, central)
                steps.append(step)
                log(json.dumps({"nodes": step.nodes, "agents": step.agents, "central": step.central}))
                began = time.monotonic()
    print()
    print(table(steps))
    print()
    print(calls_table(steps))
    met, verdict = bar(steps)
    print()
    print(verdict)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
