"""What bench/scale.py reads from kube-apiserver's audit log: the requests each client made in a window, and the
objects its reads returned.

kube-apiserver's metrics count requests by resource and verb, not by who made them, and no metric counts the
objects a LIST returned per client; its audit log names the user of every request (a ServiceAccount token bound
to a node carries the node's name in `user.extra`, so each agent of a DaemonSet is told apart) and, at level
RequestResponse, holds the object or list a read returned. The policy `audit_policy` writes asks for exactly
that of the measured users and nothing of anyone else.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs, urlsplit

# kube-apiserver puts the node a ServiceAccount token is bound to here (pkg/serviceaccount/claims.go).
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
READS = ("get", "list")
# The stage at which a request is counted: a watch has started (it may outlast the window), anything else has
# been answered (its response, with the objects it returned, is in that event).
COUNTED_STAGE = {"watch": "ResponseStarted"}
DEFAULT_STAGE = "ResponseComplete"


def audit_policy(users: Iterable[str]) -> dict[str, Any]:
    """An audit policy (audit.k8s.io/v1) that records every request of `users` (Metadata), their reads with the
    response (RequestResponse, without managedFields: the count of objects is what is read), and nothing else."""
    measured = sorted(set(users))
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "omitManagedFields": True,
        "rules": [
            {"level": "RequestResponse", "users": measured, "verbs": list(READS)},
            {"level": "Metadata", "users": measured},
            {"level": "None"},
        ],
    }


def client_of(user: dict[str, Any]) -> str:
    """The client an audit event's user stands for: the user name, and the node its token is bound to, if any."""
    name = str(user.get("username") or "?")
    nodes = (user.get("extra") or {}).get(NODE_NAME_EXTRA) or []
    return f"{name}@{nodes[0]}" if nodes else name


# Cluster-scoped resources the measured clients may read.
CLUSTER_SCOPED = frozenset({"nodes", "resourceslices", "deviceclasses", "devicetaintrules", "namespaces"})


def call_of(event: dict[str, Any]) -> str:
    """What a request did, for the breakdown: verb, resource[/subresource], and for a list or watch its scope
    (`one namespace`, `all namespaces`, or `cluster` for a cluster-scoped resource) and what selects its objects."""
    verb = str(event.get("verb") or "?")
    ref = event.get("objectRef") or {}
    if not ref:
        return f"{verb} {str(event.get('requestURI') or '?').split('?', 1)[0]}"
    resource = str(ref.get("resource") or "?")
    call = f"{verb} {resource}" + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    query = parse_qs(urlsplit(str(event.get("requestURI") or "")).query)
    notes = []
    if verb in ("list", "watch"):
        notes.append(
            "cluster" if resource in CLUSTER_SCOPED else "one namespace" if ref.get("namespace") else "all namespaces"
        )
        # which fields and labels select, not their values: one agent's node is another's
        selected = sorted(
            term.split("=", 1)[0].rstrip("!")
            for key in ("fieldSelector", "labelSelector")
            for value in query.get(key, [])
            for term in value.split(",")
        )
        if selected:
            notes.append(f"by {', '.join(selected)}")
    if verb in READS:
        notes.append(read_from(query.get("resourceVersion", [""])[0]))
    return f"{call} ({'; '.join(notes)})" if notes else call


def read_from(resource_version: str) -> str:
    """Where kube-apiserver serves a read from: no resourceVersion asks for the latest (a GET goes to etcd, a LIST
    to etcd or, with ConsistentListFromCache, to the watch cache once it has caught up); "0", any cached version."""
    if not resource_version:
        return "latest"
    return "cache" if resource_version == "0" else "at a version"


def objects_returned(event: dict[str, Any]) -> int:
    """The objects a read returned: the items of a list, one for a get that succeeded; none for anything else
    (a watch's events are not in the audit log)."""
    code = int((event.get("responseStatus") or {}).get("code") or 0)
    if event.get("verb") not in READS or not 200 <= code < 300:
        return 0
    body = event.get("responseObject")
    if event.get("verb") == "list":
        return len((body or {}).get("items") or [])
    return 1


def received_at(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(str(event["requestReceivedTimestamp"]).replace("Z", "+00:00"))


@dataclass
class Traffic:
    """Per client: requests, objects their reads returned, and requests by call (verb and resource)."""

    requests: Counter[str] = field(default_factory=Counter)
    objects: Counter[str] = field(default_factory=Counter)
    calls: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, event: dict[str, Any]) -> None:
        client = client_of(event.get("user") or {})
        self.requests[client] += 1
        self.objects[client] += objects_returned(event)
        self.calls.setdefault(client, Counter())[call_of(event)] += 1

    def clients(self, prefix: str) -> list[str]:
        """The clients whose user name is `prefix` (with or without a node)."""
        return sorted(c for c in self.requests if c == prefix or c.startswith(f"{prefix}@"))


def count(lines: Iterable[str], start: datetime, end: datetime) -> Traffic:
    """The requests received in [start, end) among the audit events (JSON lines), each counted once (see
    COUNTED_STAGE). Lines that are not JSON (a line being written as the file is read) are skipped."""
    traffic = Traffic()
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("stage") != COUNTED_STAGE.get(event.get("verb", ""), DEFAULT_STAGE):
            continue
        if start <= received_at(event) < end:
            traffic.add(event)
    return traffic
