"""`scrubgate controller`: the cluster-wide claim controller (controller.py), leader-elected on a
coordination.k8s.io Lease with the official client's `kubernetes.leaderelection`, so that of its replicas one acts
and another takes over within a lease when it goes.

    scrubgate controller [--kubeconfig F] [--namespace NS] [--lease NAME] [--metrics-port N] [--policy F]

Only argparse is imported at module level: the top-level CLI imports `add_arguments` at start-up.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

LEASE = "scrubgate-controller"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Label GPU claims allocated while no node agent saw them with their node, and remove scrubgate.dev/sanitize "
        "from claims deleted before they held a device; one replica acts (leader election on a Lease)."
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    parser.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE", "scrubgate-system"),
        help="namespace of the leader election's Lease (default: $POD_NAMESPACE, else scrubgate-system)",
    )
    parser.add_argument("--lease", default=LEASE, help="name of the Lease (default %(default)s)")
    parser.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="this replica's name in the Lease (default: $POD_NAME, else the host name)",
    )
    parser.add_argument("--policy", help="policy file, for its gpuDrivers (default: the shipped policy)")
    parser.add_argument(
        "--label-after",
        type=float,
        default=10.0,
        help="seconds a GPU claim may stay allocated without its node's label before the controller writes it "
        "(its node's agent labels it at first sight; default %(default)s)",
    )
    parser.add_argument("--metrics-port", type=int, default=9402, help="port for /metrics and /healthz (0: none)")
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address for /metrics and /healthz")
    parser.add_argument("--lease-duration", type=int, default=15, help="seconds a leader's lease lasts")
    parser.add_argument("--renew-deadline", type=int, default=10, help="seconds a leader keeps trying to renew")
    parser.add_argument("--retry-period", type=int, default=2, help="seconds between tries to acquire or renew")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from kubernetes import client, config
    from kubernetes.leaderelection import electionconfig, leaderelection
    from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock
    from scrubgate.policies.config import PolicyError, load_policy

    from .controller import ClaimController, ControllerMetrics, ControllerSettings
    from .kube import KubernetesClusterClient
    from .metrics import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("scrubgate.controller")
    try:
        policy = load_policy(args.policy)
        # The default configuration, which LeaseLock's CoordinationV1Api uses too.
        if args.kubeconfig:
            config.load_kube_config(config_file=args.kubeconfig)
        else:
            config.load_incluster_config()
    except (PolicyError, config.ConfigException, OSError) as exc:
        print(f"scrubgate controller: {exc}", file=sys.stderr)
        return 2
    metrics = ControllerMetrics()
    controller = ClaimController(
        KubernetesClusterClient(client.ApiClient()),
        ControllerSettings(gpu_drivers=policy.gpu_drivers, label_after_s=args.label_after),
        metrics,
    )
    stop, lost = threading.Event(), threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    leading = threading.Event()

    def healthy() -> tuple[bool, str]:
        return controller.healthy() if leading.is_set() else (True, "ok: following, ready to take over")

    if args.metrics_port:
        server = serve(metrics, healthy, args.metrics_address, args.metrics_port)
        log.info("serving /metrics and /healthz on %s:%d", *server.server_address[:2])

    def lead() -> None:
        leading.set()
        metrics.leader.set(1)
        log.info("%s leads (Lease %s/%s)", args.identity, args.namespace, args.lease)
        controller.run(stop)

    def stopped_leading() -> None:
        # Another replica may act now: this one must not go on as if it led. It exits; restarted, it follows.
        if not stop.is_set():
            log.error(
                "%s lost the Lease %s/%s; exiting so that it restarts as a follower",
                args.identity,
                args.namespace,
                args.lease,
            )
            lost.set()
            stop.set()

    election = electionconfig.Config(
        LeaseLock(args.lease, args.namespace, args.identity),
        lease_duration=args.lease_duration,
        renew_deadline=args.renew_deadline,
        retry_period=args.retry_period,
        onstarted_leading=lead,
        onstopped_leading=stopped_leading,
    )
    threading.Thread(target=leaderelection.LeaderElection(election).run, name="leader-election", daemon=True).start()
    stop.wait()
    return 1 if lost.is_set() else 0
