"""Label and field selectors: the query-string forms of LIST/WATCH and the LabelSelector objects
of webhook ``namespaceSelector``/``objectSelector``."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from .errors import bad_request
from .resources import ResourceType

Labels = Mapping[str, str]
Matcher = Callable[[Labels], bool]

_SET_OP = re.compile(r"^\s*(!?[A-Za-z0-9_./-]+)\s+(in|notin)\s*\((.*)\)\s*$")
_EQ_OP = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|!=|=)\s*([A-Za-z0-9_.-]*)\s*$")
_EXISTS = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``(...)``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def parse_label_selector(text: str) -> Matcher:
    """``a=b,c!=d,e in (x,y),f notin (z),g,!h`` -> a predicate over labels; 400 when malformed."""
    requirements: list[Matcher] = []
    for part in _split_top_level(text or ""):
        requirements.append(_parse_requirement(part))
    return lambda labels: all(req(labels) for req in requirements)


def _parse_requirement(part: str) -> Matcher:
    if m := _SET_OP.match(part):
        key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if m := _EQ_OP.match(part):
        key, op, value = m.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: key in labels and labels[key] == value
    if m := _EXISTS.match(part):
        negate, key = m.group(1) == "!", m.group(2)
        return lambda labels: (key in labels) != negate
    raise bad_request(f"unable to parse requirement: {part.strip()!r}")


def label_selector_matcher(selector: Mapping | None) -> Matcher:
    """A ``metav1.LabelSelector`` object; an absent selector matches everything, like the API server."""
    if selector is None:
        return lambda labels: True
    match_labels = dict(selector.get("matchLabels") or {})
    expressions = []
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), set(expr.get("values") or [])
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"label selector operator {op!r} is not one of In, NotIn, Exists, DoesNotExist")
        expressions.append((key, op, values))

    def match(labels: Labels) -> bool:
        if any(labels.get(k) != v for k, v in match_labels.items()):
            return False
        for key, op, values in expressions:
            present = key in labels
            if op == "In" and not (present and labels[key] in values):
                return False
            if op == "NotIn" and present and labels[key] in values:
                return False
            if op == "Exists" and not present:
                return False
            if op == "DoesNotExist" and present:
                return False
        return True

    return match


def field_value(obj: Mapping, path: str) -> str:
    node: object = obj
    for part in path.split("."):
        if not isinstance(node, Mapping):
            return ""
        node = node.get(part)
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


def parse_field_selector(rt: ResourceType, text: str) -> Callable[[Mapping], bool]:
    """``metadata.name=x,spec.nodeName!=`` -> a predicate; 400 for fields the resource doesn't index."""
    requirements: list[tuple[str, bool, str]] = []
    for part in _split_top_level(text or ""):
        m = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|!=|=)\s*(.*?)\s*$", part)
        if not m:
            raise bad_request(f"invalid field selector: {part.strip()!r}")
        label, op, value = m.groups()
        if not rt.supports_field(label):
            raise bad_request(f"field label not supported: {label}")
        requirements.append((label, op == "!=", value))
    return lambda obj: all((field_value(obj, label) == value) != negate for label, negate, value in requirements)
