"""What `scrubgate check` prints: the JSON contract of DESIGN.md as pydantic models, and the text, SARIF
2.1.0 and JUnit renderings of the same report."""

from __future__ import annotations

import json
import re
from pathlib import PurePath
from typing import Any
from urllib.parse import quote
from xml.etree import ElementTree

from pydantic import BaseModel

from scrubgate.policies.engine import Finding, object_ref
from scrubgate.policies.rules_meta import RULES

from . import __version__
from .check import CheckedObject, CheckResult

INFORMATION_URI = "https://github.com/scrubgate/scrubgate"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_LEVEL = {"deny": "error", "warn": "warning", "audit": "note", "off": "none"}
# Each rule's CVSS-like score for SARIF's `security-severity` (docs/rules.md gives each one's reason): what a
# breach of the rule lets one tenant do to another's GPU memory.
SECURITY_SEVERITY = {
    "SG001": "8.1",  # the device goes to the next claim unscrubbed
    "SG002": "7.5",  # one claim's device crosses pods, and tenants
    "SG003": "5.3",  # the device may be unprepared before its containers have stopped
    "SG004": "3.1",  # the webhook adds the finalizer; a manifest without it only depends on the webhook
    "SG005": "8.1",  # a fenced device, still holding a tenant's data, can be allocated
    "SG006": "8.1",  # admin access reaches devices in use by other claims
    "SG007": "9.1",  # the scrub's proof, or the fence, is bypassed: the guard itself is off
    "SG008": "7.1",  # the pod is gone before its device is unprepared and scrubbed
    "SG009": "8.1",  # a GPU class outside the policy: none of its claims is guarded
    "SG010": "8.1",  # a namespace made trusted turns the multi-tenant rules off for it
}


class RuleRef(BaseModel):
    id: str
    name: str


class ObjectRef(BaseModel):
    apiVersion: str
    kind: str
    namespace: str
    name: str


class Location(BaseModel):
    file: str
    line: int
    document: int


class FindingOut(BaseModel):
    rule: RuleRef
    action: str
    message: str
    object: ObjectRef
    location: Location
    patch: list[dict[str, Any]]


class ErrorOut(BaseModel):
    file: str
    line: int | None
    message: str


class Summary(BaseModel):
    files: int
    documents: int
    deny: int
    warn: int
    audit: int


class Report(BaseModel):
    version: int = 1
    findings: list[FindingOut]
    errors: list[ErrorOut]
    summary: Summary


def _finding_out(checked: CheckedObject, f: Finding) -> FindingOut:
    return FindingOut(
        rule=RuleRef(id=f.rule, name=f.name),
        action=f.action,
        message=f.message,
        object=ObjectRef(**object_ref(checked.document.obj)),
        location=Location(
            file=checked.document.file, line=checked.document.line_of(f.path), document=checked.document.index
        ),
        patch=[dict(op) for op in f.patch],
    )


def _by_place(f: FindingOut) -> tuple[str, int, int, str, str]:
    """Findings in the order of the text: by file, line, document, then rule."""
    return f.location.file, f.location.line, f.location.document, f.rule.id, f.message


def build_report(result: CheckResult) -> Report:
    return Report(
        findings=sorted((_finding_out(c, f) for c in result.objects for f in c.findings), key=_by_place),
        errors=[
            ErrorOut(file=e.file, line=e.line, message=e.message)
            for e in sorted(result.errors, key=lambda e: (e.file, e.line or 0))
        ],
        summary=Summary(
            files=result.files,
            documents=len(result.objects),
            deny=result.count("deny"),
            warn=result.count("warn"),
            audit=result.count("audit"),
        ),
    )


def render_json(report: Report) -> str:
    return report.model_dump_json(indent=2)


_COLORS = {"deny": "\033[31m", "warn": "\033[33m", "audit": "\033[36m", "error": "\033[35m"}
_BOLD, _RESET = "\033[1m", "\033[0m"


def _describe(obj: ObjectRef) -> str:
    where = f"{obj.namespace}/" if obj.namespace else ""
    return f"{obj.kind or '?'} {where}{obj.name or '<unnamed>'}"


def render_text(report: Report, color: bool) -> str:
    def paint(text: str, key: str) -> str:
        return f"{_COLORS[key]}{text}{_RESET}" if color else text

    entries = [
        (e.file, e.line or 0, f"  {e.line or '-':>5}  {paint('error', 'error'):<5}  {e.message}") for e in report.errors
    ]
    entries += [
        (
            f.location.file,
            f.location.line,
            f"  {f.location.line:>5}  {paint(f.action, f.action)}{' ' * (5 - len(f.action))}  "
            f"{f.rule.id} {f.rule.name}  {_describe(f.object)}: {f.message}",
        )
        for f in report.findings
    ]
    by_file: dict[str, list[str]] = {}
    for file, _, text in sorted(entries, key=lambda entry: entry[:2]):
        by_file.setdefault(file, []).append(text)
    lines = []
    for file, texts in by_file.items():
        lines.append(f"{_BOLD}{file}{_RESET}" if color else file)
        lines += texts
        lines.append("")
    s = report.summary
    lines.append(
        f"{s.files} file(s), {s.documents} object(s) checked: {s.deny} deny, {s.warn} warn, {s.audit} audit, "
        f"{len(report.errors)} input error(s)"
    )
    return "\n".join(lines)


def artifact_uri(name: str) -> str:
    """A file name as SARIF's artifactLocation.uri wants it, a valid URI reference: a relative path with `/`
    separators, percent-encoded (spaces, `<stdin>`), or a file: URI for an absolute path."""
    path = PurePath(name)
    return path.as_uri() if path.is_absolute() else quote(path.as_posix())


def rule_help_uri(rule_id: str) -> str:
    """The rule's section in docs/rules.md, of this version's tag (its anchor is the id in lower case)."""
    return f"{INFORMATION_URI}/blob/v{__version__}/docs/rules.md#{rule_id.lower()}"


def render_sarif(report: Report) -> str:
    rule_ids = list(RULES)
    rules = [
        {
            "id": meta.id,
            "name": meta.name,
            "shortDescription": {"text": meta.summary},
            "fullDescription": {"text": meta.help},
            "help": {"text": meta.help},
            "helpUri": rule_help_uri(meta.id),
            "defaultConfiguration": {"level": SARIF_LEVEL[meta.default_action]},
            # GitHub code scanning shows a security rule's severity from this score: over 9.0 critical, 7.0 to
            # 8.9 high, 4.0 to 6.9 medium, under 4.0 low.
            "properties": {
                "tags": ["security", "kubernetes", "dra", "gpu"],
                "security-severity": SECURITY_SEVERITY[meta.id],
            },
        }
        for meta in RULES.values()
    ]
    results = [
        {
            "ruleId": f.rule.id,
            "ruleIndex": rule_ids.index(f.rule.id),
            "level": SARIF_LEVEL[f.action],
            "message": {"text": f"{_describe(f.object)}: {f.message}"},
            "locations": [
                {
                    "physicalLocation": {
                        "artifactLocation": {"uri": artifact_uri(f.location.file)},
                        "region": {"startLine": f.location.line},
                    }
                }
            ],
            "properties": {"action": f.action, "document": f.location.document},
        }
        for f in report.findings
    ]
    notifications = [
        {
            "level": "error",
            "message": {"text": e.message},
            "locations": [
                {
                    "physicalLocation": {
                        "artifactLocation": {"uri": artifact_uri(e.file)},
                        **({"region": {"startLine": e.line}} if e.line else {}),
                    }
                }
            ],
        }
        for e in report.errors
    ]
    log = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "scrubgate",
                        "version": __version__,
                        "informationUri": INFORMATION_URI,
                        "rules": rules,
                    }
                },
                "invocations": [
                    {"executionSuccessful": not report.errors, "toolExecutionNotifications": notifications}
                ],
                "results": results,
            }
        ],
    }
    return json.dumps(log, indent=2)


# Characters XML 1.0 cannot carry even escaped; a manifest's names and values may hold them.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_safe(element: ElementTree.Element) -> None:
    """Writes characters that XML cannot carry as \\xNN, so the report stays well-formed."""

    def clean(text: str) -> str:
        return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)

    for node in element.iter():
        node.attrib = {k: clean(v) for k, v in node.attrib.items()}
        if node.text:
            node.text = clean(node.text)


def render_junit(result: CheckResult, report: Report) -> str:
    """One testcase per checked object (failed by its deny findings), one errored testcase per input error."""
    suite = ElementTree.Element("testsuite", name="scrubgate check")
    failures = errors = 0
    for checked in result.objects:
        doc, ref = checked.document, object_ref(checked.document.obj)
        case = ElementTree.SubElement(
            suite,
            "testcase",
            classname=doc.file,
            name=f"{ref['kind'] or '?'} {ref['namespace'] + '/' if ref['namespace'] else ''}{ref['name'] or '<unnamed>'}"
            f" (document {doc.index})",
        )
        mine = sorted((_finding_out(checked, f) for f in checked.findings), key=_by_place)
        denied = [f for f in mine if f.action == "deny"]
        if denied:
            failures += 1
            failure = ElementTree.SubElement(
                case, "failure", message="; ".join(f"{f.rule.id} {f.message}" for f in denied), type="deny"
            )
            failure.text = "\n".join(f"{f.location.file}:{f.location.line}: {f.rule.id} {f.message}" for f in denied)
        others = [f for f in mine if f.action != "deny"]
        if others:
            out = ElementTree.SubElement(case, "system-out")
            out.text = "\n".join(
                f"{f.action}: {f.location.file}:{f.location.line}: {f.rule.id} {f.message}" for f in others
            )
    for e in report.errors:
        errors += 1
        case = ElementTree.SubElement(suite, "testcase", classname=e.file, name=f"read {e.file}")
        ElementTree.SubElement(
            case, "error", message=e.message, type="input"
        ).text = f"{e.file}:{e.line or '-'}: {e.message}"
    suite.set("tests", str(len(result.objects) + len(report.errors)))
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    _xml_safe(suite)
    ElementTree.indent(suite)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ElementTree.tostring(suite, encoding="unicode")
