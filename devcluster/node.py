"""One simulated GPU node as its own process, a client of the real API server: the kubelet stand-in (with
the node's client certificate) and the NVIDIA-like DRA driver (with its ServiceAccount's token), over the
simulated GPUs under ``--gpu-root``.

    python -m devcluster.node --node gpu-node-1 --gpu-root DIR \\
        --kubeconfig node.kubeconfig --driver-kubeconfig driver.kubeconfig

SIGTERM: a clean shutdown that also stops the node's containers. kill -9: the containers keep running and a
restarted node adopts them from the pods' status, as a restarted kubelet does.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path

import urllib3
from kubernetes.client.exceptions import ApiException
from scrubgate.sanitizer_agent.gpu import simulated

from .driver import Driver
from .kubelet import Kubelet
from .rest import Rest, client_from_kubeconfig, status_message

log = logging.getLogger("devcluster.node")

DRIVER_SYNC_S = 2.0
HEARTBEAT_S = 5.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devcluster.node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpu-root", required=True, type=Path)
    parser.add_argument("--kubeconfig", required=True, type=Path, help="the node's credentials (system:node:NAME)")
    parser.add_argument("--driver-kubeconfig", required=True, type=Path, help="the DRA driver's credentials")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between the kubelet's passes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())

    driver = Driver(
        Rest(client_from_kubeconfig(args.driver_kubeconfig)), args.node, simulated.SimulatedGpu(args.gpu_root)
    )
    kubelet = Kubelet(Rest(client_from_kubeconfig(args.kubeconfig)), args.node, args.gpu_root, driver)
    _until_done(stopping, kubelet.register, "register the Node")
    next_driver_sync = next_heartbeat = 0.0
    while not stopping.is_set():
        if time.monotonic() >= next_heartbeat:
            _attempt(kubelet.heartbeat, "renew the node's Lease")
            next_heartbeat = time.monotonic() + HEARTBEAT_S
        if time.monotonic() >= next_driver_sync:
            _attempt(driver.sync, "publish the ResourceSlices")
            next_driver_sync = time.monotonic() + DRIVER_SYNC_S
        _attempt(kubelet.sync, "sync pods")
        stopping.wait(args.interval)
    kubelet.shutdown_containers()
    log.info("node %s: stopped, with its containers", args.node)
    return 0


def _attempt(step: object, what: str) -> bool:
    try:
        step()  # type: ignore[operator]
    except ApiException as exc:
        log.warning("node: %s: HTTP %s: %s", what, exc.status, status_message(exc))
    except (OSError, urllib3.exceptions.HTTPError) as exc:  # the API server restarting: the next pass retries
        log.warning("node: %s: %s", what, exc)
    else:
        return True
    return False


def _until_done(stopping: threading.Event, step: object, what: str) -> None:
    while not stopping.is_set() and not _attempt(step, what):
        stopping.wait(1.0)


if __name__ == "__main__":
    raise SystemExit(main())
