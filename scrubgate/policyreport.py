"""Findings as `wgpolicyk8s.io/v1alpha2` PolicyReports (one per namespace) and a ClusterPolicyReport (for
cluster-scoped objects), the format Kyverno and Kubewarden write and policy-reporter shows.

Fields follow the CRD of kubernetes-sigs/wg-policy-prototypes (policy-report/crd/v1alpha2): results
carry `policy` (required), `rule`, `category`, `message`, `properties` (string values), `resources`
(object references), `result` (pass, fail, warn, error, skip), `scored`, `severity` (high, medium, low),
`source` and `timestamp` ({seconds, nanos}); `summary` counts results. Only findings are listed: objects
without one add no `pass` result, so that a report stays the size of what needs doing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import yaml

from scrubgate.policies.engine import Finding

from .check import CheckResult, namespace_of

REPORT_NAME = "scrubgate"
SOURCE = "scrubgate"
MANAGED_BY = {"app.kubernetes.io/managed-by": "scrubgate"}
CATEGORY = "GPU isolation"
# deny: the webhook refuses such a write; audit: recorded, not enforced, still a requirement not met.
RESULT = {"deny": "fail", "warn": "warn", "audit": "fail"}
SEVERITY = {"deny": "high", "warn": "medium", "audit": "low"}
CLUSTER_SCOPE = ""


@dataclass(frozen=True)
class ReportKinds:
    """One of the two report APIs policy engines write: wgpolicyk8s.io's PolicyReports (Kyverno before 1.15,
    Kubewarden) and openreports.io's Reports (Kyverno 1.15 and later), whose results have the same fields."""

    api_version: str
    kind: str
    cluster_kind: str
    plural: str
    cluster_plural: str


WGPOLICY = ReportKinds(
    "wgpolicyk8s.io/v1alpha2", "PolicyReport", "ClusterPolicyReport", "policyreports", "clusterpolicyreports"
)
OPENREPORTS = ReportKinds("openreports.io/v1alpha1", "Report", "ClusterReport", "reports", "clusterreports")
REPORT_APIS = {"wgpolicyk8s.io": WGPOLICY, "openreports.io": OPENREPORTS}


def _result(finding: Finding, obj: dict[str, Any], moment: datetime) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    resource = {"apiVersion": obj.get("apiVersion", ""), "kind": obj.get("kind", ""), "name": meta.get("name", "")}
    if meta.get("namespace"):
        resource["namespace"] = meta["namespace"]
    if meta.get("uid"):
        resource["uid"] = meta["uid"]
    properties = {"rule-name": finding.name, "action": finding.action}
    if finding.path:
        properties["path"] = finding.path
    return {
        "policy": SOURCE,
        "rule": finding.rule,
        "category": CATEGORY,
        "message": finding.message,
        "properties": properties,
        "resources": [resource],
        "result": RESULT[finding.action],
        "scored": True,
        "severity": SEVERITY[finding.action],
        "source": SOURCE,
        "timestamp": {"seconds": int(moment.timestamp()), "nanos": 0},
    }


def _summary(results: list[dict[str, Any]]) -> dict[str, int]:
    summary = dict.fromkeys(("pass", "fail", "warn", "error", "skip"), 0)
    for result in results:
        summary[result["result"]] += 1
    return summary


def report(namespace: str, results: list[dict[str, Any]], kinds: ReportKinds = WGPOLICY) -> dict[str, Any]:
    """The report of `namespace`, or the cluster-wide report for CLUSTER_SCOPE."""
    metadata: dict[str, Any] = {"name": REPORT_NAME, "labels": dict(MANAGED_BY)}
    if namespace != CLUSTER_SCOPE:
        metadata["namespace"] = namespace
    body: dict[str, Any] = {
        "apiVersion": kinds.api_version,
        "kind": kinds.kind if namespace != CLUSTER_SCOPE else kinds.cluster_kind,
        "metadata": metadata,
    }
    if kinds is OPENREPORTS:
        body["source"] = SOURCE  # openreports.io names the report's one engine at the top as well
    return {**body, "results": results, "summary": _summary(results)}


def build_reports(
    result: CheckResult, now: datetime | None = None, kinds: ReportKinds = WGPOLICY
) -> dict[str, dict[str, Any]]:
    """Namespace ("" for the cluster) -> its report, for every namespace with a finding; the
    ClusterPolicyReport is always there, so that a reader sees the scan ran."""
    moment = now or datetime.now(UTC)
    by_namespace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for checked in result.objects:
        obj = checked.document.obj
        # A manifest without a namespace: where kubectl would create it.
        namespace = namespace_of(obj) if _namespaced(obj) else CLUSTER_SCOPE
        for finding in checked.findings:
            by_namespace[namespace].append(_result(finding, obj, moment))
    by_namespace.setdefault(CLUSTER_SCOPE, [])
    return {namespace: report(namespace, results, kinds) for namespace, results in sorted(by_namespace.items())}


def _namespaced(obj: dict[str, Any]) -> bool:
    # Every kind the rules read is namespaced except DeviceClasses and scrubgate's fences (DeviceTaintRules).
    return obj.get("kind") not in ("DeviceClass", "DeviceTaintRule", "Namespace")


def render_policyreport(result: CheckResult, now: datetime | None = None) -> str:
    """`scrubgate check --format policyreport`: the reports as a YAML stream, ready for `kubectl apply -f -`."""
    reports = build_reports(result, now).values()
    return yaml.safe_dump_all(list(reports), sort_keys=False, default_flow_style=False).rstrip("\n")
