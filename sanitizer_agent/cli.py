"""`scrubgate agent`: run the node agent, show its checkpoint, or ask it to try a failed device again.

    scrubgate agent --node NAME [--gpu-backend nvml|simulated] [--simulated-root DIR] [--checkpoint F]
                    [--signing-key F] [--key-id ID] [--nvidia-checkpoint F] [--metrics-port N] [--kubeconfig F]
    scrubgate agent status [--checkpoint F] [--format text|json]
    scrubgate agent rescrub --device UUID|driver/pool/device [--checkpoint F]

Only argparse is imported at module level: the top-level CLI imports `add_arguments` at start-up.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_CHECKPOINT = "/var/lib/scrubgate/agent-checkpoint.json"
DEFAULT_NVIDIA_CHECKPOINT = "/var/lib/kubelet/plugins/gpu.nvidia.com/checkpoint.json"
DEFAULT_SIGNING_KEY = "/etc/scrubgate/attestation/key.pem"
DEFAULT_KEY_ID = "scrubgate-agent"


def _workers(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 256:
        raise argparse.ArgumentTypeError(f"{value}: give 0 to 256 teardowns at once")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (default: $NODE_NAME)")
    parser.add_argument("--gpu-backend", choices=("nvml", "simulated"), default="nvml")
    parser.add_argument("--simulated-root", help="state directory of the simulated GPU backend")
    parser.add_argument(
        "--max-unreachable",
        type=float,
        default=0.02,
        help="nvml: share of a device's usable memory the scrub may leave unreached (its own CUDA context) and "
        "still verify (default 0.02)",
    )
    parser.add_argument(
        "--max-parallel-scrubs",
        type=int,
        default=4,
        help="nvml: scrub processes at once (each a CUDA context of a few hundred MB of host memory); the other "
        "teardowns wait for a slot (default %(default)s)",
    )
    parser.add_argument(
        "--max-unreachable-bytes",
        type=int,
        default=1 << 30,
        help="nvml: and at most this many bytes (default 1 GiB; the policy's scrubCoverage refuses more)",
    )
    parser.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="the agent's checkpoint file (hostPath)")
    parser.add_argument("--signing-key", default=DEFAULT_SIGNING_KEY, help="Ed25519 private key (PEM) for attestations")
    parser.add_argument("--key-id", default=DEFAULT_KEY_ID, help="key id in the attestation header (the policy's kid)")
    parser.add_argument(
        "--nvidia-checkpoint",
        default=DEFAULT_NVIDIA_CHECKPOINT,
        help="NVIDIA DRA driver checkpoint to reconcile from at start ('' to skip)",
    )
    parser.add_argument("--metrics-port", type=int, default=8080, help="port for /metrics and /healthz (0: none)")
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address for /metrics and /healthz")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    parser.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to wait for processes to exit")
    parser.add_argument(
        "--scrub-timeout",
        type=float,
        default=900.0,
        help="seconds a drain poll or a scrub may run in the GPU driver before the devices are fenced, marked "
        "failed and /healthz fails (a GPU fallen off the bus hangs those calls)",
    )
    parser.add_argument("--max-attempts", type=int, default=3, help="failed attempts before waiting for an operator")
    parser.add_argument("--retry-backoff", type=float, default=30.0, help="seconds before the first retry (doubles)")
    parser.add_argument(
        "--record-after",
        type=float,
        default=2.0,
        help="seconds an allocation lasts before its record (scrubgate.dev/devices) goes on the claim; one "
        "released sooner gets it with its attestation (default %(default)s)",
    )
    parser.add_argument(
        "--resync",
        type=float,
        default=30.0,
        help="seconds between full resyncs (lists of this node's pods and claims, from the API server's cache)",
    )
    parser.add_argument(
        "--max-concurrent-teardowns",
        type=_workers,
        default=16,
        help="claims torn down at once (drain, scrub, attestation, API writes), each in a thread; fencing new "
        "allocations never waits for them (default %(default)s; 0: one step at a time in the agent's loop)",
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="agent_command", metavar="{status,rescrub}")
    status = sub.add_parser("status", help="device states from the checkpoint")
    status.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    status.add_argument("--format", choices=("text", "json"), default="text")
    again = sub.add_parser("rescrub", help="ask the running agent to try a failed device again")
    again.add_argument("--device", required=True, help="GPU/MIG UUID or driver/pool/device")
    again.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)


def _fail(message: str) -> None:
    print(f"scrubgate agent: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    if args.agent_command == "status":
        return _status(Path(args.checkpoint), args.format)
    if args.agent_command == "rescrub":
        return _rescrub(Path(args.checkpoint), args.device)
    return _run_agent(args)


def _rows(checkpoint: Any) -> list[dict[str, Any]]:
    rows = []
    for td in checkpoint.teardowns.values():
        for device in td.devices:
            rows.append(
                {
                    "claim": f"{td.claim.namespace}/{td.claim.name}",
                    "claimUID": td.claim.uid,
                    "device": device.key,
                    "uuid": device.uuid,
                    "state": td.state.value,
                    "attempts": td.attempts,
                    "retryAt": td.retry_at,
                    "reason": td.reason,
                }
            )
    return rows


def _status(path: Path, fmt: str) -> int:
    import json

    from .checkpoint import CheckpointError, read

    try:
        checkpoint = read(path)
    except CheckpointError as exc:
        _fail(str(exc))
        return 2
    if checkpoint is None:
        _fail(f"no checkpoint at {path} (is the agent running on this node, with this --checkpoint?)")
        return 2
    rows = _rows(checkpoint)
    if fmt == "json":
        print(json.dumps({"version": 1, "node": checkpoint.node, "devices": rows}, indent=2))
        return 0
    print(f"node {checkpoint.node}: {len(rows)} device(s) in teardown or fenced")
    columns = ("claim", "device", "uuid", "state", "attempts", "reason")
    table = [columns, *[tuple(str(r[c] if r[c] is not None else "-") for c in columns) for r in rows]]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _rescrub(path: Path, device: str) -> int:
    from . import rescrub
    from .checkpoint import CheckpointError, State, read

    try:
        checkpoint = read(path)
    except CheckpointError as exc:
        _fail(str(exc))
        return 2
    teardowns = list(checkpoint.teardowns.values()) if checkpoint else []
    failed = [td for td in teardowns if td.state == State.FAILED and rescrub.matches(td, device)]
    if not failed:
        states = ", ".join(
            f"{td.claim.namespace}/{td.claim.name}: {td.state.value}" for td in teardowns if rescrub.matches(td, device)
        )
        _fail(f"no failed teardown holds device {device} in {path}" + (f" ({states})" if states else ""))
        return 1
    request = rescrub.submit(path, device)
    for td in failed:
        print(f"rescrub requested for {device}: claim {td.claim} (last failure: {td.reason})")
    print(f"request {request}; the running agent takes it at its next tick and starts from draining")
    return 0


def _run_agent(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from .agent import Agent, AgentSettings, api_connections
    from .checkpoint import CheckpointError, CheckpointStore
    from .device_access import DeviceAccessError
    from .gpu import open_backend
    from .kube import ClusterError, KubernetesClusterClient
    from .metrics import AgentMetrics, serve
    from .rescrub import request_dir
    from .signing import Signer
    from .teardown import TeardownSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("scrubgate.agent")
    if not args.node:
        _fail("--node is required (or set NODE_NAME, e.g. from the downward API)")
        return 2
    if args.gpu_backend == "simulated" and not args.simulated_root:
        _fail("--gpu-backend simulated needs --simulated-root DIR")
        return 2
    try:
        signer = Signer.from_file(args.signing_key, args.key_id)
    except ValueError as exc:
        _fail(str(exc))
        return 2
    try:
        options: dict[str, object] = (
            {"root": args.simulated_root}
            if args.gpu_backend == "simulated"
            else {
                "max_unreachable_fraction": args.max_unreachable,
                "max_unreachable_bytes": args.max_unreachable_bytes,
                "max_parallel_scrubs": args.max_parallel_scrubs,
                # Beside the checkpoint: the ECC baselines of allocations made before a restart.
                "ecc_history_path": Path(args.checkpoint).with_name("ecc-history.json"),
            }
        )
        backend = open_backend(args.gpu_backend, **options)
        cluster = KubernetesClusterClient.from_config(args.kubeconfig, api_connections(args.max_concurrent_teardowns))
    except Exception as exc:  # GpuError, OSError, and the kubernetes config loaders' own types
        log.critical("cannot start the agent on node %s: %s", args.node, exc)
        return 1
    disabled = backend.scrub_on_free_disabled()
    log.info(
        "kernel driver scrub-on-free: %s (the agent scrubs and verifies regardless)",
        {True: "DISABLED (RMDisableScrubOnFree)", False: "enabled", None: "unknown"}[disabled],
    )
    checkpoint = Path(args.checkpoint)
    settings = AgentSettings(
        node=args.node,
        teardown=TeardownSettings(
            drain_timeout_s=args.drain_timeout,
            scrub_timeout_s=args.scrub_timeout,
            max_attempts=args.max_attempts,
            retry_backoff_s=args.retry_backoff,
            record_after_s=args.record_after,
        ),
        nvidia_checkpoint=Path(args.nvidia_checkpoint) if args.nvidia_checkpoint else None,
        rescrub_dir=request_dir(checkpoint),
        resync_s=args.resync,
        max_concurrent_teardowns=args.max_concurrent_teardowns,
    )
    metrics = AgentMetrics()
    agent = Agent(
        settings,
        cluster=cluster,
        backend=backend,
        store=CheckpointStore(checkpoint, args.node),
        signer=signer,
        metrics=metrics,
    )
    if args.metrics_port:
        server = serve(metrics, agent.healthy, args.metrics_address, args.metrics_port)
        log.info("serving /metrics and /healthz on %s:%d", *server.server_address[:2])
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        agent.run(stop)
    except CheckpointError as exc:
        log.critical("%s", exc)
        return 1
    except ClusterError as exc:
        log.critical("cannot reach the API server at start-up on node %s: %s", args.node, exc)
        return 1
    except DeviceAccessError as exc:
        log.critical("%s", exc)
        return 1
    finally:
        backend.close()
    return 0
