"""Reading manifests for `scrubgate check`: files, directories, stdin; multi-document YAML, JSON and
`kind: List`, each object with the YAML nodes that give its findings a line number.

PyYAML's libyaml loader parses; the node tree is kept so that a finding's JSON pointer is turned into a
line only when there is a finding (most objects have none).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

try:
    from yaml import CSafeLoader as _Loader
except ImportError:  # libyaml missing: correct, only slower
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

SUFFIXES = (".yaml", ".yml", ".json")
STDIN = "-"
STDIN_NAME = "<stdin>"
# A line that starts a new YAML document; at column 0 it cannot be part of a block scalar.
_DOCUMENT_START = re.compile(r"^---(?:[ \t]|$)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class InputError:
    file: str
    line: int | None
    message: str


@dataclass(slots=True)
class Document:
    """One object to check: a YAML document, or one item of a `kind: List` document."""

    file: str
    index: int  # the document's position in its file, from 0
    obj: dict[str, Any]
    node: yaml.Node | None
    line_offset: int  # lines before the chunk this node was parsed from
    prefix: tuple[str | int, ...] = ()  # path of the object inside the document (items/N for List items)
    text: str | None = field(default=None, repr=False)  # the file text, for --fix

    def line_of(self, json_pointer: str) -> int:
        """The 1-based line of the deepest node on `json_pointer` that exists (a missing field is reported
        on its parent's line)."""
        parts = [*self.prefix, *_split_pointer(json_pointer)]
        node, line = self.node, None
        if node is None:
            return self.line_offset + 1
        line = node.start_mark.line
        for part in parts:
            if isinstance(node, yaml.MappingNode):
                for key, value in node.value:
                    if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                        node, line = value, key.start_mark.line
                        break
                else:
                    break
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
                node = node.value[part]
                line = node.start_mark.line
            else:
                break
        return self.line_offset + line + 1


def _split_pointer(json_pointer: str) -> list[str | int]:
    if not json_pointer:
        return []
    return [
        int(p) if p.isdigit() else p.replace("~1", "/").replace("~0", "~") for p in json_pointer.lstrip("/").split("/")
    ]


def _yaml_error(file: str, exc: yaml.YAMLError, line_offset: int) -> InputError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line = line_offset + mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    message = f"invalid YAML: {problem}" + (f" ({context})" if context else "")
    return InputError(file, line, message)


def _parse_chunk(text: str) -> Iterator[tuple[yaml.Node, Any]]:
    loader = _Loader(text)
    try:
        while loader.check_node():
            node = loader.get_node()
            yield node, loader.construct_document(node)
    finally:
        loader.dispose()


def _parse(file: str, text: str) -> tuple[list[tuple[yaml.Node | None, Any, int]], list[InputError]]:
    """(node, data, line offset) per document. A syntax error loses only the document it is in: the file
    is then parsed again document by document."""
    try:
        return [(node, data, 0) for node, data in _parse_chunk(text)], []
    except (yaml.YAMLError, RecursionError):
        pass
    documents: list[tuple[yaml.Node | None, Any, int]] = []
    errors: list[InputError] = []
    starts = [0] + [m.start() for m in _DOCUMENT_START.finditer(text) if m.start() > 0]
    for begin, end in zip(starts, [*starts[1:], len(text)], strict=True):
        offset = text.count("\n", 0, begin)
        try:
            documents += [(node, data, offset) for node, data in _parse_chunk(text[begin:end])]
        except yaml.YAMLError as exc:
            errors.append(_yaml_error(file, exc, offset))
        except RecursionError:
            errors.append(InputError(file, offset + 1, "document is nested too deeply to read"))
    return documents, errors


def _parse_json(file: str, text: str) -> tuple[list[tuple[yaml.Node | None, Any, int]], list[InputError]]:
    """JSON that YAML cannot read (tabs, say) still reads as JSON, without line numbers below the top."""
    try:
        return [(None, json.loads(text), 0)], []
    except json.JSONDecodeError as exc:
        return [], [InputError(file, exc.lineno, f"invalid JSON: {exc.msg}")]
    except RecursionError:
        return [], [InputError(file, 1, "document is nested too deeply to read")]


def read_documents(file: str, text: str) -> tuple[list[Document], list[InputError]]:
    parsed, errors = _parse(file, text)
    if errors and file.endswith(".json"):
        parsed, errors = _parse_json(file, text)
    documents: list[Document] = []
    for index, (node, data, offset) in enumerate(parsed):
        if data is None:
            continue
        line = offset + (node.start_mark.line + 1 if node is not None else 1)
        if not isinstance(data, dict):
            errors.append(
                InputError(file, line, f"document {index} is a {type(data).__name__}, not a Kubernetes object")
            )
            continue
        if data.get("kind") == "List" and isinstance(data.get("items"), list):
            for item_index, item in enumerate(data["items"]):
                if isinstance(item, dict):
                    documents.append(Document(file, index, item, node, offset, ("items", item_index), text))
                else:
                    errors.append(InputError(file, line, f"document {index}: items[{item_index}] is not an object"))
            continue
        documents.append(Document(file, index, data, node, offset, (), text))
    return documents, errors


def expand_paths(paths: list[str]) -> tuple[list[str], list[InputError]]:
    """Files to read, in a stable order: directories recursively (`*.yaml`, `*.yml`, `*.json`)."""
    files: list[str] = []
    errors: list[InputError] = []
    for raw in paths:
        if raw == STDIN:
            files.append(STDIN)
            continue
        path = Path(raw)
        if path.is_dir():
            files += sorted(str(p) for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        elif path.exists():
            files.append(raw)
        else:
            errors.append(InputError(raw, None, "no such file or directory"))
    return files, errors


def read_text(file: str) -> str | InputError:
    """The file's text, or the reason it cannot be read."""
    try:
        data = sys.stdin.buffer.read() if file == STDIN else Path(file).read_bytes()
    except OSError as exc:
        return InputError(display_name(file), None, f"cannot read: {exc.strerror or exc}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return InputError(display_name(file), None, f"not UTF-8 text (byte {exc.start}): is this a manifest?")


def display_name(file: str) -> str:
    return STDIN_NAME if file == STDIN else file
