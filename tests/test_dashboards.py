"""The Grafana dashboard and the PrometheusRule name only metrics the webhook and the agent export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from scrubgate.sanitizer_agent.metrics import AgentMetrics
from scrubgate.webhook.metrics import Metrics

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"
# Series Prometheus itself makes for every scrape target.
PROMETHEUS_SERIES = {"up"}
# PromQL words an expression may hold besides series names.
_PROMQL = re.compile(
    r"\b(?:sum|min|max|count|avg|unless|and|or|rate|increase|histogram_quantile|"
    r"sum_over_time|min_over_time|max_over_time|absent|time|vector)\b"
)


def exported() -> set[str]:
    """Every sample name the two registries expose once each metric has a value."""
    webhook = Metrics()
    webhook.admission.count("validate", "CREATE", "Pod", "deny", 0.001)
    webhook.admission.hit("SG007", "deny")
    webhook.refusals.labels(rule="SG007", reason="metadata.finalizers").inc()  # labelled: no sample before
    agent = AgentMetrics()
    agent.scrub_duration.observe(1.0)
    agent.teardown_overhead.observe(0.1)
    names = set()
    for registry in (webhook.registry, agent.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            names.update(sample.name for sample in family.samples)
    return names


def series_names(expr: str) -> set[str]:
    stripped = re.sub(r'"[^"]*"', '""', expr)  # label values
    stripped = re.sub(r"\{[^}]*\}", "{}", stripped)  # label matchers
    stripped = re.sub(r"\[[^\]]*\]", "[]", stripped)  # ranges
    stripped = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", stripped)  # grouping labels
    stripped = _PROMQL.sub(" ", stripped)
    return {name for name in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped) if not name.startswith("__")}


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    dashboard = json.loads((DASHBOARDS / "scrubgate.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(SERIES, LABEL): the series only.
            series = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["query"]["query"])
            assert series, f"variable {variable['name']}: expected label_values(SERIES, LABEL)"
            yield f"variable {variable['name']}", series[1]


def rule_exprs() -> Iterator[tuple[str, str]]:
    rule = yaml.safe_load((DASHBOARDS / "prometheus-rules.yaml").read_text())
    for group in rule["spec"]["groups"]:
        for entry in group["rules"]:
            yield f"alert {entry['alert']}", entry["expr"]


def unknown(exprs: Iterator[tuple[str, str]], known: set[str]) -> list[str]:
    problems = []
    for where, expr in exprs:
        names = series_names(expr)
        assert names, f"{where}: no series found in {expr!r}"
        problems += [f"{where}: {name}" for name in sorted(names - known - PROMETHEUS_SERIES)]
    return problems


def test_series_names_reads_promql():
    expr = 'histogram_quantile(0.95, sum by (le) (rate(scrubgate_agent_scrub_duration_seconds_bucket{node=~"$node"}[15m])))'
    assert series_names(expr) == {"scrubgate_agent_scrub_duration_seconds_bucket"}
    assert series_names("min(foo_seconds) - time() < 7 * 24 * 3600 unless on (node) bar_total > 0") == {
        "foo_seconds",
        "bar_total",
    }


@pytest.fixture(scope="module")
def known() -> set[str]:
    return exported()


def test_dashboard_names_only_exported_metrics(known):
    assert unknown(dashboard_exprs(), known) == []


def test_alerts_name_only_exported_metrics(known):
    assert unknown(rule_exprs(), known) == []


def test_a_renamed_metric_is_caught(known):
    assert unknown(iter([("alert X", "sum(rate(scrubgate_agent_scrubs_total[5m]))")]), known) == [
        "alert X: scrubgate_agent_scrubs_total"
    ]


@pytest.fixture(scope="module")
def promtool() -> str:
    """Prometheus' promtool, built from its Go module by tools/build-go-tool.sh (cached by version)."""
    result = subprocess.run(
        [str(REPO / "tools" / "build-go-tool.sh"), "promtool"],
        capture_output=True,
        text=True,
        timeout=1700,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_every_alert_fires_when_it_should_and_not_otherwise(promtool: str, tmp_path: Path):
    """`promtool test rules` over the PrometheusRule's groups (dashboards/prometheus-rules.tests.yaml): each
    alert has a case where it fires, with its labels and annotations, and one where it must not."""
    rules = yaml.safe_load((DASHBOARDS / "prometheus-rules.yaml").read_text())["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    shutil.copy(DASHBOARDS / "prometheus-rules.tests.yaml", tmp_path)
    result = subprocess.run(
        [promtool, "test", "rules", "prometheus-rules.tests.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    cases = [
        case
        for test in yaml.safe_load((DASHBOARDS / "prometheus-rules.tests.yaml").read_text())["tests"]
        for case in test["alert_rule_test"]
    ]
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule}
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == alerts, "an alert never tested firing"
    assert {c["alertname"] for c in cases if not c["exp_alerts"]} == alerts, "an alert never tested quiet"


def test_monitoring_objects_are_well_formed():
    for name in ("podmonitors.yaml", "prometheus-rules.yaml"):
        for doc in yaml.safe_load_all((DASHBOARDS / name).read_text()):
            assert (
                doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["metadata"]["namespace"] == "scrubgate-system"
            )
    kustomization = yaml.safe_load((DASHBOARDS / "kustomization.yaml").read_text())
    # The ConfigMap must be valid for the API server as well (its files exist and it names them).
    for generator in kustomization["configMapGenerator"]:
        for file in generator["files"]:
            configmap = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"], "labels": generator["options"]["labels"]},
                "data": {file: (DASHBOARDS / file).read_text()},
            }
            kubernetes_validate.validate(configmap, "1.34", strict=True)
