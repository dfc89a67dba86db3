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


# --- runbooks ---------------------------------------------------------------------------------------------


def github_anchors(markdown: str) -> dict[str, str]:
    """Each heading's anchor as GitHub makes it (lower case, punctuation other than - and _ dropped, spaces as -,
    a repeated one numbered), with the section's text up to the next heading of the same or a higher level."""
    anchors: dict[str, str] = {}
    lines = markdown.splitlines()
    headings = [(i, len(m[1]), m[2]) for i, line in enumerate(lines) if (m := re.match(r"^(#{1,6})\s+(.*?)\s*$", line))]
    for n, (i, level, title) in enumerate(headings):
        anchor = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        base, count = anchor, 0
        while anchor in anchors:
            count += 1
            anchor = f"{base}-{count}"
        end = next((j for j, lvl, _ in headings[n + 1 :] if lvl <= level), len(lines))
        anchors[anchor] = "\n".join(lines[i + 1 : end])
    return anchors


def alert_rules() -> list[dict]:
    rules = yaml.safe_load((DASHBOARDS / "prometheus-rules.yaml").read_text())["spec"]["groups"]
    return [rule for group in rules for rule in group["rules"] if "alert" in rule]


def test_github_anchors_reads_headings_as_github_does():
    anchors = github_anchors("# A b\n\n## Audit evidence\ntext\n### ScrubgateX\nmore\n## Audit evidence\n")
    assert list(anchors) == ["a-b", "audit-evidence", "scrubgatex", "audit-evidence-1"]
    assert anchors["audit-evidence"] == "text\n### ScrubgateX\nmore"


def test_every_alert_has_a_runbook_that_exists():
    """Each alert links its own section of docs/operations.md (under the repository's address, Chart.yaml's home),
    and the section says what the alert means, how to check and what to do."""
    home = yaml.safe_load((REPO / "charts" / "scrubgate" / "Chart.yaml").read_text())["home"]
    sections = github_anchors((REPO / "docs" / "operations.md").read_text())
    for rule in alert_rules():
        url = rule["annotations"].get("runbook_url", "")
        assert url == f"{home}/blob/main/docs/operations.md#{rule['alert'].lower()}", rule["alert"]
        section = sections.get(url.partition("#")[2])
        assert section is not None, f"{rule['alert']}: no section {url.partition('#')[2]} in docs/operations.md"
        for part in ("**What it means.**", "**How to check.**", "**What to do.**"):
            assert part in section, f"{rule['alert']}'s runbook has no {part}"


def test_what_the_alerts_point_to_exists():
    """A README section or a file an alert's text names must exist (one pointed at README "Operating", which did
    not)."""
    readme = github_anchors((REPO / "README.md").read_text())
    for rule in alert_rules():
        text = " ".join(str(value) for value in rule["annotations"].values())
        for section in re.findall(r'README "([^"]+)"', text):
            assert github_anchors(f"# {section}").popitem()[0] in readme, f"{rule['alert']}: README {section!r}"
        for path in re.findall(r"\b(?:docs|dashboards|manifests|charts)/[\w./-]+\.\w+", text):
            assert (REPO / path).exists(), f"{rule['alert']}: {path}"


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
