"""A real kube-apiserver (with etcd, no controllers) for tests of the agent's Kubernetes client: objects are
what the API server accepts and returns, not what a fake believes. The full installation for end-to-end tests
is devcluster.harness.Cluster (e2e_support.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from devcluster.controlplane import ControlPlane


@contextlib.contextmanager
def api_server(root: Path, runtime_config: tuple[str, ...] = (), profiling: bool = False) -> Iterator[ControlPlane]:
    """etcd and kube-apiserver under ``root``; ``admin_client()`` talks to it as kubernetes-admin; with
    ``profiling`` it serves /debug/pprof (``cpu_profile``)."""
    with ControlPlane(
        root / "control-plane", users=[], controllers=False, runtime_config=runtime_config, profiling=profiling
    ) as plane:
        yield plane
