"""`scrubgate reports`: keeps PolicyReports of what is already in the cluster up to date.

Each round runs the engine over the cluster's objects (scrubgate/cluster.py) and writes one PolicyReport
named `scrubgate` per namespace with findings plus the ClusterPolicyReport `scrubgate`; a namespace whose
findings are gone loses its report. A result found in an earlier round keeps its timestamp (the time it
was first found), so an unchanged report is not written again. Every `--interval` a round lists every kind;
in between, one watch per kind from its list's resourceVersion keeps those objects current (`Mirror`), and
a change starts a round over them after a short quiet period (a rollout's burst: one round), with no list.

Its own Deployment and ServiceAccount (chart: reports.enabled), not the webhook's pod: the webhook has no
API credentials, and a component that answers the API server should not get list rights on every
workload in the cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from scrubgate.policies.config import PolicyConfig, PolicyError, load_policy

from .cluster import Api, ApiError, KubeApi, Snapshot, check_snapshot, list_all, read_cluster
from .policyreport import CLUSTER_SCOPE, MANAGED_BY, REPORT_APIS, REPORT_NAME, WGPOLICY, ReportKinds, build_reports

log = logging.getLogger(__name__)

SELECTOR = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())


def report_path(namespace: str, kinds: ReportKinds = WGPOLICY) -> str:
    group = f"/apis/{kinds.api_version}"
    if namespace == CLUSTER_SCOPE:
        return f"{group}/{kinds.cluster_plural}/{REPORT_NAME}"
    return f"{group}/namespaces/{quote(namespace, safe='')}/{kinds.plural}/{REPORT_NAME}"


def _collection(namespace: str, kinds: ReportKinds) -> str:
    return report_path(namespace, kinds).rsplit("/", 1)[0]


def _without_time(result: Mapping[str, Any]) -> str:
    # JSON with sorted keys: the API server gives objects back with their keys in another order.
    return json.dumps({k: v for k, v in result.items() if k != "timestamp"}, sort_keys=True)


def _keep_first_seen(new: dict[str, Any], old: Mapping[str, Any] | None) -> None:
    """Results that were already in `old` keep the timestamp they had there."""
    if not old:
        return
    seen = {_without_time(r): r.get("timestamp") for r in old.get("results") or []}
    for result in new["results"]:
        result["timestamp"] = seen.get(_without_time(result), result["timestamp"])


def write_reports(api: Api, reports: Mapping[str, dict[str, Any]], kinds: ReportKinds = WGPOLICY) -> dict[str, str]:
    """Creates, updates or deletes scrubgate's reports so that they are `reports`; returns
    namespace -> what was done (created, updated, unchanged, deleted)."""
    try:
        listed = list_all(api, f"/apis/{kinds.api_version}/{kinds.plural}", query={"labelSelector": SELECTOR})[0]
    except ApiError as exc:
        if exc.status != 404:
            raise
        raise ApiError(
            f"{exc}: the cluster serves no {kinds.api_version} {kinds.kind}s; install their CRDs (a policy engine such "
            "as Kyverno ships them; for wgpolicyk8s.io also manifests/components/reports/crds.yaml, or the chart's "
            "reports.installCRDs), or write the other API with --api",
            404,
        ) from None
    existing = {
        (item.get("metadata") or {}).get("namespace", CLUSTER_SCOPE): item
        for item in listed
        if (item.get("metadata") or {}).get("name") == REPORT_NAME
    }
    try:
        existing[CLUSTER_SCOPE] = api.request("GET", report_path(CLUSTER_SCOPE, kinds))
    except ApiError as exc:
        if exc.status != 404:
            raise
    done = {}
    for namespace, wanted in reports.items():
        old = existing.get(namespace)
        _keep_first_seen(wanted, old)
        if old is None:
            api.request("POST", _collection(namespace, kinds), body=wanted)
            done[namespace] = "created"
        elif (old.get("results") or []) == wanted["results"] and old.get("summary") == wanted["summary"]:
            done[namespace] = "unchanged"
        else:
            body = {**wanted, "metadata": {**wanted["metadata"], "resourceVersion": old["metadata"]["resourceVersion"]}}
            api.request("PUT", report_path(namespace, kinds), body=body)
            done[namespace] = "updated"
    for namespace in existing.keys() - reports.keys():
        api.request("DELETE", report_path(namespace, kinds))
        done[namespace] = "deleted"
    return done


def reconcile(
    api: Api, policy: PolicyConfig, snapshot: Snapshot | None = None, kinds: ReportKinds = WGPOLICY
) -> tuple[Snapshot, dict[str, str]]:
    """One round: read (unless given what was read), check, write. The end-to-end tests call it against the
    real control plane."""
    if snapshot is None:
        snapshot = read_cluster(api)
        for note in snapshot.notes:
            log.warning("reports: %s", note)
    return snapshot, write_reports(api, build_reports(check_snapshot(snapshot, policy), kinds=kinds), kinds)


class Mirror:
    """The cluster as the last full list read it, kept current by watch events (ADDED, MODIFIED, DELETED) from
    each list's resourceVersion, as an informer keeps its cache: a change costs a re-check of what is held,
    not another list of every kind in the cluster."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._lock = threading.Lock()
        self.kinds = dict(snapshot.kinds)
        self.notes = list(snapshot.notes)
        self.versions = dict(snapshot.resource_versions)
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {path: {} for path in self.kinds}
        by_kind = {kind: path for path, (kind, _) in self.kinds.items()}
        for kind, obj in snapshot.objects:
            self.objects[by_kind[kind]][_key(obj)] = obj

    def apply(self, path: str, event: Mapping[str, Any]) -> bool:
        """One watch event of `path`; False when the watch cannot go on from here (ERROR: e.g. 410 Gone)."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            return False
        with self._lock:
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                self.versions[path] = version
            if kind in ("ADDED", "MODIFIED"):
                plural_kind, api_version = self.kinds[path]
                self.objects[path][_key(obj)] = {**obj, "apiVersion": api_version, "kind": plural_kind.kind}
            elif kind == "DELETED":
                self.objects[path].pop(_key(obj), None)
        return True

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(
                objects=[(self.kinds[path][0], obj) for path, held in self.objects.items() for obj in held.values()],
                resource_versions=dict(self.versions),
                notes=list(self.notes),
                kinds=dict(self.kinds),
            )


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def _follow(
    api: Api, mirror: Mirror, path: str, timeout_s: int, changed: threading.Event, done: threading.Event
) -> None:
    """Watches `path` into `mirror` until `done` (a new list, or stop); sets `changed` on each change, and `done`
    itself (with `changed`) when only a new list can go on (410 Gone, an API error)."""
    while not done.is_set():
        query = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        query["resourceVersion"] = mirror.versions.get(path, "")
        began = time.monotonic()
        try:
            for event in api.stream(path, query):
                if done.is_set():
                    return
                if not mirror.apply(path, event):
                    log.warning(
                        "reports: watch of %s: %s; listing again", path, (event.get("object") or {}).get("message")
                    )
                    done.set()
                    changed.set()
                    return
                if event.get("type") != "BOOKMARK":
                    changed.set()
        except ApiError as exc:
            log.warning("reports: watch of %s ended: %s; listing again", path, exc)
            done.set()
            changed.set()
            return
        if time.monotonic() - began < 1.0:
            done.wait(1.0)  # a watch the server ended at once: not a busy loop


def run_rounds(
    api: Api,
    policy_file: Path | None,
    interval_s: float,
    stop: threading.Event,
    *,
    quiet_s: float = 10.0,
    changed: threading.Event | None = None,
    kinds: ReportKinds = WGPOLICY,
) -> None:
    """A full list every `interval_s` (and after a watch broke off); between them, the reports are written again
    from the mirror a short quiet period after a change (a rollout's burst: one write). `changed` wakes the
    loop: the watches set it, and so does whoever sets `stop` (SIGTERM)."""
    changed = changed or threading.Event()
    mirror: Mirror | None = None
    done = threading.Event()  # the current mirror's watches end when it is set
    next_list = 0.0
    while not stop.is_set():
        try:
            policy = load_policy(policy_file)
            held = None
            if mirror is not None and not done.is_set() and time.monotonic() < next_list:
                held = mirror.snapshot()
            changed.clear()
            snapshot, done_writes = reconcile(api, policy, held, kinds)
            if held is None:  # listed: a new mirror, watched from the lists' resourceVersions
                done.set()
                mirror, done, next_list = Mirror(snapshot), threading.Event(), time.monotonic() + interval_s
                for path in mirror.kinds:
                    threading.Thread(
                        target=_follow,
                        args=(api, mirror, path, max(int(interval_s), 1), changed, done),
                        name=f"reports-watch{path}",
                        daemon=True,
                    ).start()
            written = {namespace or "(cluster)": what for namespace, what in done_writes.items() if what != "unchanged"}
            log.info("reports: %d objects checked; reports %s", len(snapshot.objects), written or "unchanged")
        except (ApiError, PolicyError) as exc:
            log.error("reports: round failed: %s; trying again in %.0f s", exc, interval_s)
            done.set()
            mirror = None
            stop.wait(interval_s)
            continue
        if changed.wait(max(next_list - time.monotonic(), 0.0)) and not stop.is_set():
            stop.wait(quiet_s)
    done.set()


def parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration such as 30s, 5m or 1h") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write the findings about objects already in the cluster as wgpolicyk8s.io/v1alpha2 PolicyReports, "
        "every --interval and on change."
    )
    parser.add_argument("--interval", type=parse_duration, default=300.0, help="time between full rounds (default 5m)")
    parser.add_argument("--policy", type=Path, help="policy file (default: the shipped policy); read every round")
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in a pod its service account, else ~/.kube/config)"
    )
    parser.add_argument("--context", help="kubeconfig context")
    parser.add_argument("--once", action="store_true", help="one round, then exit (0: written; 2: failed)")
    parser.add_argument(
        "--api",
        choices=sorted(REPORT_APIS),
        default="wgpolicyk8s.io",
        help="the reports to write: wgpolicyk8s.io PolicyReports, or openreports.io Reports (Kyverno 1.15 and later)",
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    try:
        api = KubeApi.connect(args.kubeconfig, args.context)
        if args.once:
            _, done = reconcile(api, load_policy(args.policy), kinds=REPORT_APIS[args.api])
            for namespace, what in sorted(done.items()):
                print(f"{what}: {REPORT_APIS[args.api].cluster_kind if namespace == CLUSTER_SCOPE else namespace}")
            return 0
    except (ApiError, PolicyError) as exc:
        print(f"scrubgate reports: {exc}", file=sys.stderr)
        return 2
    stop, changed = threading.Event(), threading.Event()

    def stopping(*_: object) -> None:
        # As PID 1 in its container, a process that sets no handler is not ended by SIGTERM at all: the pod
        # would wait out its grace period at every rollout.
        stop.set()
        changed.set()

    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    run_rounds(api, args.policy, args.interval, stop, changed=changed, kinds=REPORT_APIS[args.api])
    log.info("reports: stopped")
    return 0
