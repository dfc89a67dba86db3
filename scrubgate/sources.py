"""Reading manifests for `scrubgate check`: files, directories, stdin; multi-document YAML, JSON and
`kind: List`, each object with where it is in the text, which gives its findings a line number.

PyYAML's libyaml loader parses; each document keeps where it is in the text, and its node tree is parsed
again to turn a finding's JSON pointer into a line only when there is a finding (most objects have none).
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

try:
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # libyaml missing: correct, only slower
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]


class _Loader(_SafeLoader):
    """The safe loader minus work that cannot change its result: a plain scalar's tag is resolved once per
    distinct short value, and the path bookkeeping that only path resolvers (the safe loader has none) use
    is skipped. About a tenth of the parse time."""

    _tags: ClassVar[dict[tuple[str, tuple[bool, bool]], str]] = {}

    def resolve(self, kind: type[yaml.Node], value: Any, implicit: Any) -> str:
        if kind is not yaml.ScalarNode or len(value) > 64:
            return super().resolve(kind, value, implicit)
        key = (value, implicit)
        tag = self._tags.get(key)
        if tag is None:
            tag = super().resolve(kind, value, implicit)
            if len(self._tags) < 100_000:
                self._tags[key] = tag
        return tag

    def descend_resolver(self, current_node: Any, current_index: Any) -> None:
        pass

    def ascend_resolver(self) -> None:
        pass


assert not _Loader.yaml_path_resolvers, "the shortcuts above assume no path resolvers"

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


@dataclass(frozen=True, slots=True)
class Span:
    """Where a document's top node is in its file's text: characters [start, end), `start` at the beginning
    of the node's first line, which is `line` (0-based)."""

    start: int
    end: int
    line: int


@dataclass(slots=True)
class Document:
    """One object to check: a YAML document, or one item of a `kind: List` document."""

    file: str
    index: int  # the document's position in its file, from 0
    obj: dict[str, Any]
    span: Span | None  # None: read as JSON, no line numbers below the top
    prefix: tuple[str | int, ...] = ()  # path of the object inside the document (items/N for List items)
    text: str | None = field(default=None, repr=False)  # the file text, for line numbers and --fix

    def _top_node(self) -> yaml.Node | None:
        if self.span is None or self.text is None:
            return None
        return _node_tree(self.text, self.span.start, self.span.end)

    def line_of(self, json_pointer: str) -> int:
        """The 1-based line of the deepest node on `json_pointer` that exists (a missing field is reported
        on its parent's line)."""
        first = self.span.line if self.span is not None else 0
        node = self._top_node()
        if node is None:
            return first + 1
        line = node.start_mark.line
        for part in [*self.prefix, *_split_pointer(json_pointer)]:
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
        return first + line + 1


@functools.lru_cache(maxsize=8)
def _node_tree(text: str, start: int, end: int) -> yaml.Node | None:
    """The YAML node tree of text[start:end], parsed again. Keeping every document's tree from the first parse
    would cost four times the memory, for the few documents that have findings; a document's findings are
    located one after the other, so a small cache parses each once."""
    loader = _Loader(text[start:end])
    try:
        return loader.get_node() if loader.check_node() else None
    except (yaml.YAMLError, RecursionError):
        return None  # cannot happen for text that parsed once; the document's first line still holds
    finally:
        loader.dispose()


def _split_pointer(json_pointer: str) -> list[str | int]:
    if not json_pointer:
        return []
    return [
        int(p) if p.isdigit() else p.replace("~1", "/").replace("~0", "~") for p in json_pointer.lstrip("/").split("/")
    ]


def _yaml_error(file: str, exc: yaml.YAMLError, chunk: str, line_offset: int) -> InputError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line = line_offset + mark.line + 1 if mark is not None else None
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML refuses: it has a position, not a mark
        line = line_offset + chunk.count("\n", 0, exc.position) + 1
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    message = f"invalid YAML: {problem}" + (f" ({context})" if context else "")
    return InputError(file, line, message)


Parsed = tuple[Any, Span | None]  # a document's data and where it is; (None, None) for one that cannot be read

_TAG = "tag:yaml.org,2002:"
_STR, _MAP, _SEQ = _TAG + "str", _TAG + "map", _TAG + "seq"
_SCALAR_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float", "binary", "timestamp"))


class _Unusual(Exception):
    """A node the shortcut in `_construct` leaves to PyYAML's constructor."""


def _construct(loader: _Loader, document: yaml.Node) -> Any:
    """What `loader.construct_document(document)` returns, three times as fast for what manifests are made of
    (string-keyed mappings, sequences, plain scalars). Anchors, merge keys, other tags or keys are left to
    PyYAML's constructor. A scalar that its tag's constructor cannot read (`2025-02-30` resolves to a date)
    is a ConstructorError on its line, not a crash."""
    constructors = loader.yaml_constructors
    seen: set[int] = set()

    def build(node: yaml.Node) -> Any:
        cls, tag = node.__class__, node.tag
        if cls is yaml.ScalarNode:
            if tag == _STR:
                return node.value
            if tag not in _SCALAR_TAGS:
                raise _Unusual
            try:
                return constructors[tag](loader, node)
            except (ValueError, TypeError, AttributeError, OverflowError) as exc:
                raise yaml.constructor.ConstructorError(
                    None, None, f"cannot read {node.value!r} as {tag.removeprefix(_TAG)}: {exc}", node.start_mark
                ) from None
        if id(node) in seen:  # an alias: PyYAML shares the object
            raise _Unusual
        seen.add(id(node))
        if cls is yaml.MappingNode and tag == _MAP:
            mapping = {}
            for key, value in node.value:
                if key.__class__ is not yaml.ScalarNode or key.tag != _STR:  # also merge keys (<<)
                    raise _Unusual
                mapping[key.value] = build(value)
            return mapping
        if cls is yaml.SequenceNode and tag == _SEQ:
            return [build(item) for item in node.value]
        raise _Unusual

    try:
        return build(document)
    except _Unusual:
        pass
    try:
        return loader.construct_document(document)
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise yaml.constructor.ConstructorError(
            None, None, f"cannot read a value: {exc}", document.start_mark
        ) from None


def _parse_chunk(chunk: str, begin: int, line_offset: int) -> Iterator[Parsed]:
    """The documents of `chunk`, which starts at character `begin` and line `line_offset` of its file."""
    loader = _Loader(chunk)
    try:
        while loader.check_node():
            node = loader.get_node()
            mark = node.start_mark
            span = Span(begin + mark.index - mark.column, begin + node.end_mark.index, line_offset + mark.line)
            yield _construct(loader, node), span
    finally:
        loader.dispose()


def _parse(file: str, text: str) -> tuple[list[Parsed], list[InputError]]:
    """(data, span) per document. A syntax error loses only the document it is in: the file is then parsed
    again document by document, and a document that cannot be read keeps its place (as an empty one) so
    that the documents after it keep their index."""
    try:
        return list(_parse_chunk(text, 0, 0)), []
    except (yaml.YAMLError, RecursionError):
        pass
    documents: list[Parsed] = []
    errors: list[InputError] = []
    starts = [0] + [m.start() for m in _DOCUMENT_START.finditer(text) if m.start() > 0]
    for begin, end in zip(starts, [*starts[1:], len(text)], strict=True):
        offset = text.count("\n", 0, begin)
        chunk = text[begin:end]
        try:
            documents += list(_parse_chunk(chunk, begin, offset))
        except yaml.YAMLError as exc:
            errors.append(_yaml_error(file, exc, chunk, offset))
            documents.append((None, None))
        except RecursionError:
            errors.append(InputError(file, offset + 1, "document is nested too deeply to read"))
            documents.append((None, None))
    return documents, errors


def _parse_json(file: str, text: str) -> tuple[list[Parsed], list[InputError]]:
    """JSON that YAML cannot read (tabs, say) still reads as JSON, without line numbers below the top."""
    try:
        return [(json.loads(text), None)], []
    except json.JSONDecodeError as exc:
        return [], [InputError(file, exc.lineno, f"invalid JSON: {exc.msg}")]
    except RecursionError:
        return [], [InputError(file, 1, "document is nested too deeply to read")]


def read_documents(file: str, text: str) -> tuple[list[Document], list[InputError]]:
    parsed, errors = _parse(file, text)
    if errors and file.endswith(".json"):
        parsed, errors = _parse_json(file, text)
    documents: list[Document] = []
    for index, (data, span) in enumerate(parsed):
        if data is None:
            continue
        line = span.line + 1 if span is not None else 1
        if not isinstance(data, dict):
            errors.append(
                InputError(file, line, f"document {index} is a {type(data).__name__}, not a Kubernetes object")
            )
            continue
        if data.get("kind") == "List" and isinstance(data.get("items"), list):
            for item_index, item in enumerate(data["items"]):
                if isinstance(item, dict):
                    documents.append(Document(file, index, item, span, ("items", item_index), text))
                else:
                    errors.append(InputError(file, line, f"document {index}: items[{item_index}] is not an object"))
            continue
        documents.append(Document(file, index, data, span, (), text))
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
