"""docs/rules.md, where SARIF's helpUri points: a section per rule under a stable anchor, with what, why, an
example and the fix, and every manifest example it gives found by `scrubgate check` as its rule."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from scrubgate.policies.rules_meta import RULES

DOC = Path(__file__).resolve().parents[1] / "docs" / "rules.md"


def sections() -> dict[str, str]:
    text = DOC.read_text()
    found = re.findall(r'<a id="(sg\d{3})"></a>\n## (SG\d{3}) ([a-z-]+)\n(.*?)(?=\n<a id=|\Z)', text, re.DOTALL)
    for anchor, rule, name, _ in found:
        assert anchor == rule.lower() and RULES[rule].name == name, (anchor, rule, name)
    return {rule: body for _, rule, _, body in found}


def test_one_section_per_rule_in_order_with_what_why_example_and_fix():
    found = sections()
    assert list(found) == list(RULES)
    for rule, body in found.items():
        parts = re.findall(r"^\*\*(What|Why|Example|Fix)\.\*\*", body, re.MULTILINE)
        assert parts == ["What", "Why", "Example", "Fix"], rule


def test_the_table_links_every_section_with_its_default_action():
    table = re.findall(r"^\| \[(SG\d{3})\]\(#(sg\d{3})\) \| ([a-z-]+) \| (\w+) \|", DOC.read_text(), re.MULTILINE)
    assert [(rule, anchor, name, action) for rule, anchor, name, action in table] == [
        (meta.id, meta.id.lower(), meta.name, meta.default_action) for meta in RULES.values()
    ]


EXAMPLES = [
    (rule, example)
    for rule, body in sections().items()
    for example in re.findall(r"```yaml\n(.*?)```", body, re.DOTALL)
]


@pytest.mark.parametrize(("rule", "example"), EXAMPLES, ids=[rule for rule, _ in EXAMPLES])
def test_each_manifest_example_is_found_as_its_rule(run_cli, monkeypatch, rule, example):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(example.encode())))
    code, out, _ = run_cli("check", "--format", "json", "-")
    findings = json.loads(out)["findings"]
    assert [f["rule"]["id"] for f in findings] == [rule]
    assert code == (1 if RULES[rule].default_action == "deny" else 0)


def test_rules_that_manifests_can_break_have_a_manifest_example():
    """The admission-only rules (a force delete, a label change) have a command as their example instead."""
    assert {rule for rule, _ in EXAMPLES} == set(RULES) - {"SG008", "SG010"}
