"""`scrubgate reports`: keeps PolicyReports of what is already in the cluster up to date.

Each round runs the engine over the cluster's objects (scrubgate/cluster.py) and writes one PolicyReport
named `scrubgate` per namespace with findings plus the ClusterPolicyReport `scrubgate`; a namespace whose
findings are gone loses its report. A result found in an earlier round keeps its timestamp (the time it
was first found), so an unchanged report is not written again. Every `--interval` a round lists every kind;
in between, one watch per kind from its list's resourceVersion keeps those objects current (mirror.py), and
a change starts a round over them after a short quiet period (a rollout's burst: one round), with no list.

It fits a big cluster: of each object it holds only what the rules read, and only the objects that may matter
(slim.py: no pod that asks for no device, no managedFields, no status), packed; it checks again only what
changed (rechecks.py). bench/reports_memory.py measures it with 100,000 pods (bench/RESULTS.md).

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

from .cluster import Api, ApiError, KubeApi, list_all, read_cluster
from .mirror import Mirror, entry
from .policyreport import CLUSTER_SCOPE, MANAGED_BY, REPORT_APIS, REPORT_NAME, WGPOLICY, ReportKinds, build_reports
from .rechecks import Rechecks

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


def list_into(api: Api, mirror: Mirror) -> int:
    """A full list of every kind into `mirror`; the generation its watches follow."""
    snapshot = read_cluster(api, keep=entry)
    for note in snapshot.notes:
        log.warning("reports: %s", note)
    return mirror.load(snapshot)


def reconcile(
    api: Api,
    policy: PolicyConfig,
    kinds: ReportKinds = WGPOLICY,
    mirror: Mirror | None = None,
    rechecks: Rechecks | None = None,
) -> tuple[Mirror, dict[str, str]]:
    """One round: list (unless `mirror` holds the cluster), check what changed since `rechecks` last ran (all of
    it, without), write. The end-to-end tests call it against the real control plane."""
    if mirror is None:
        mirror = Mirror()
        list_into(api, mirror)
    result = (rechecks or Rechecks()).run(mirror, policy)
    return mirror, write_reports(api, build_reports(result, kinds=kinds), kinds)


def _follow(
    api: Api,
    mirror: Mirror,
    generation: int,
    path: str,
    timeout_s: int,
    changed: threading.Event,
    done: threading.Event,
) -> None:
    """Watches `path` into `mirror` until `done` (a new list, or stop); sets `changed` on each event, and `done`
    itself (with `changed`) when only a new list can go on (410 Gone, an API error)."""
    while not done.is_set():
        query = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        query["resourceVersion"] = mirror.versions.get(path, "")
        began = time.monotonic()
        try:
            for event in api.stream(path, query):
                if done.is_set():
                    return
                if not mirror.apply(generation, path, event):
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
    mirror, rechecks = Mirror(), Rechecks()
    done = threading.Event()  # the current list's watches end when it is set
    done.set()  # nothing listed yet
    next_list = 0.0
    while True:
        # Cleared before stop is read: whoever stops sets stop, then changed, so a stop that comes after this
        # read still ends the wait below.
        changed.clear()
        if stop.is_set():
            break
        try:
            policy = load_policy(policy_file)
            if done.is_set() or time.monotonic() >= next_list:  # a new list, watched from its resourceVersions
                done.set()
                generation = list_into(api, mirror)
                done, next_list = threading.Event(), time.monotonic() + interval_s
                for path in mirror.kinds:
                    threading.Thread(
                        target=_follow,
                        args=(api, mirror, generation, path, max(int(interval_s), 1), changed, done),
                        name=f"reports-watch{path}",
                        daemon=True,
                    ).start()
            _, done_writes = reconcile(api, policy, kinds, mirror, rechecks)
            written = {namespace or "(cluster)": what for namespace, what in done_writes.items() if what != "unchanged"}
            log.info(
                "reports: %d objects held, %d checked again; reports %s",
                len(mirror),
                rechecks.checked,
                written or "unchanged",
            )
        except (ApiError, PolicyError) as exc:
            log.error("reports: round failed: %s; trying again in %.0f s", exc, interval_s)
            done.set()
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
