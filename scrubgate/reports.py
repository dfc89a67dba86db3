"""`scrubgate reports`: keeps PolicyReports of what is already in the cluster up to date.

Each round reads the cluster (scrubgate/cluster.py), runs the engine, and writes one PolicyReport named
`scrubgate` per namespace with findings plus the ClusterPolicyReport `scrubgate`; a namespace whose
findings are gone loses its report. A result found in an earlier round keeps its timestamp (the time it
was first found), so an unchanged report is not written again. Rounds run every `--interval` and, sooner,
after a change: one watch per listed kind from the list's resourceVersion; the first event ends the
wait, and a short quiet period gathers the burst a rollout makes into one round.

Its own Deployment and ServiceAccount (chart: reports.enabled), not the webhook's pod: the webhook has no
API credentials, and a component that answers the API server should not get list rights on every
workload in the cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from scrubgate.policies.config import PolicyConfig, PolicyError, load_policy

from .cluster import Api, ApiError, KubeApi, Snapshot, check_snapshot, list_all, read_cluster
from .policyreport import API_VERSION, CLUSTER_SCOPE, MANAGED_BY, REPORT_NAME, build_reports

log = logging.getLogger(__name__)

GROUP_PATH = f"/apis/{API_VERSION}"
SELECTOR = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())


def report_path(namespace: str) -> str:
    if namespace == CLUSTER_SCOPE:
        return f"{GROUP_PATH}/clusterpolicyreports/{REPORT_NAME}"
    return f"{GROUP_PATH}/namespaces/{quote(namespace, safe='')}/policyreports/{REPORT_NAME}"


def _collection(namespace: str) -> str:
    return report_path(namespace).rsplit("/", 1)[0]


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


def write_reports(api: Api, reports: Mapping[str, dict[str, Any]]) -> dict[str, str]:
    """Creates, updates or deletes scrubgate's reports so that they are `reports`; returns
    namespace -> what was done (created, updated, unchanged, deleted)."""
    try:
        listed = list_all(api, f"{GROUP_PATH}/policyreports", query={"labelSelector": SELECTOR})[0]
    except ApiError as exc:
        if exc.status != 404:
            raise
        raise ApiError(
            f"{exc}: the cluster serves no {API_VERSION} PolicyReports; install the CRDs "
            "(manifests/components/reports/crds.yaml, or the chart, which ships them)",
            404,
        ) from None
    existing = {
        (item.get("metadata") or {}).get("namespace", CLUSTER_SCOPE): item
        for item in listed
        if (item.get("metadata") or {}).get("name") == REPORT_NAME
    }
    try:
        existing[CLUSTER_SCOPE] = api.request("GET", report_path(CLUSTER_SCOPE))
    except ApiError as exc:
        if exc.status != 404:
            raise
    done = {}
    for namespace, wanted in reports.items():
        old = existing.get(namespace)
        _keep_first_seen(wanted, old)
        if old is None:
            api.request("POST", _collection(namespace), body=wanted)
            done[namespace] = "created"
        elif (old.get("results") or []) == wanted["results"] and old.get("summary") == wanted["summary"]:
            done[namespace] = "unchanged"
        else:
            body = {**wanted, "metadata": {**wanted["metadata"], "resourceVersion": old["metadata"]["resourceVersion"]}}
            api.request("PUT", report_path(namespace), body=body)
            done[namespace] = "updated"
    for namespace in existing.keys() - reports.keys():
        api.request("DELETE", report_path(namespace))
        done[namespace] = "deleted"
    return done


def reconcile(api: Api, policy: PolicyConfig) -> tuple[Snapshot, dict[str, str]]:
    """One round: read, check, write. The end-to-end tests call it against the real control plane."""
    snapshot = read_cluster(api)
    for note in snapshot.notes:
        log.warning("reports: %s", note)
    return snapshot, write_reports(api, build_reports(check_snapshot(snapshot, policy)))


def _watch(api: Api, path: str, resource_version: str, timeout_s: int, changed: threading.Event) -> None:
    query = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
    if resource_version:
        query["resourceVersion"] = resource_version
    try:
        for event in api.stream(path, query):
            if event.get("type") != "BOOKMARK":  # ERROR (e.g. 410 Gone) also calls for a new list
                changed.set()
                return
    except ApiError as exc:
        log.warning("reports: watch of %s ended: %s; the next round lists again", path, exc)
        changed.set()


def run_rounds(
    api: Api, policy_file: Path | None, interval_s: float, stop: threading.Event, *, quiet_s: float = 10.0
) -> None:
    while not stop.is_set():
        try:
            policy = load_policy(policy_file)
            snapshot, done = reconcile(api, policy)
            written = {namespace or "(cluster)": what for namespace, what in done.items() if what != "unchanged"}
            log.info("reports: %d objects read; reports %s", len(snapshot.objects), written or "unchanged")
        except (ApiError, PolicyError) as exc:
            log.error("reports: round failed: %s; trying again in %.0f s", exc, interval_s)
            stop.wait(interval_s)
            continue
        # Watches of this round; those of earlier rounds end at their timeout and set an Event no one reads.
        changed = threading.Event()
        for path, resource_version in snapshot.resource_versions.items():
            threading.Thread(
                target=_watch,
                args=(api, path, resource_version, max(int(interval_s), 1), changed),
                name=f"reports-watch{path}",
                daemon=True,
            ).start()
        if changed.wait(interval_s) and not stop.is_set():
            stop.wait(quiet_s)


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


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    try:
        api = KubeApi.connect(args.kubeconfig, args.context)
        if args.once:
            _, done = reconcile(api, load_policy(args.policy))
            for namespace, what in sorted(done.items()):
                print(f"{what}: {'ClusterPolicyReport' if namespace == CLUSTER_SCOPE else namespace}")
            return 0
    except (ApiError, PolicyError) as exc:
        print(f"scrubgate reports: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    try:
        run_rounds(api, args.policy, args.interval, stop)
    except KeyboardInterrupt:
        stop.set()
    return 0
