"""Reading manifests for `scrubgate check`: files, directories, stdin; multi-document YAML, JSON and
`kind: List`, each object with where it is in the text, which gives its findings a line number.

rapidyaml parses where it reads as PyYAML does (`fastyaml`), PyYAML's libyaml loader everywhere else. A reader
that checks documents as they are read (`scrubgate check`) locates the findings of each document while its
node tree is at hand (`settle`), and the tree is then let go: keeping every document's tree would cost four
times the memory. A line asked for later is found by parsing the document's text again, with PyYAML.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import fastyaml

# PyYAML's safe loader, in C where libyaml is there (without it: correct, only slower).
try:
    from yaml import CSafeLoader as SafeLoader
except ImportError:
    from yaml import SafeLoader  # type: ignore[assignment]


class _Loader(SafeLoader):
    """The safe loader minus work that cannot change its result. A node without an explicit tag is tagged
    with `slice(kind, value, implicit)`, the arguments of PyYAML's `resolve`, and its tag is resolved when the
    node is read (`_tag`): the composer (C in libyaml's loader) then calls no Python code per node, which was
    a third of the parse time. The path bookkeeping that only path resolvers (the safe loader has none) use
    is skipped."""

    resolve = slice  # type: ignore[assignment]
    # Nothing to do, called twice per node: C callables of the same arguments cost a fifth of a Python no-op.
    descend_resolver = slice  # type: ignore[assignment]
    ascend_resolver = tuple  # type: ignore[assignment]


_resolver = yaml.resolver.Resolver()
_PLAIN_TAGS: dict[str, str] = {}  # a plain scalar's tag, for each distinct short value


def _tag(node: yaml.Node) -> str:
    """The node's tag as PyYAML's safe loader resolves it."""
    tag = node.tag
    if tag.__class__ is not slice:
        return tag
    kind, value, implicit = tag.start, tag.stop, tag.step
    if kind is not yaml.ScalarNode or not implicit[0]:
        return _resolver.resolve(kind, value, implicit)  # no regular expression runs: the default tag
    resolved = _PLAIN_TAGS.get(value)
    if resolved is None:
        resolved = _resolver.resolve(kind, value, implicit)
        if len(value) <= 64 and len(_PLAIN_TAGS) < 100_000:
            _PLAIN_TAGS[value] = resolved
    return resolved


def _resolve_tree(node: yaml.Node, seen: set[int]) -> None:
    """Resolves every tag of the tree, for PyYAML's own constructor."""
    if id(node) in seen:
        return
    seen.add(id(node))
    node.tag = _tag(node)
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _resolve_tree(item, seen)
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            _resolve_tree(key, seen)
            _resolve_tree(value, seen)


assert not _Loader.yaml_path_resolvers, "the shortcuts above assume no path resolvers"

SUFFIXES = (".yaml", ".yml", ".json")
STDIN = "-"
STDIN_NAME = "<stdin>"
# A line that starts a new YAML document; at column 0 it cannot be part of a block scalar.
DOCUMENT_START = re.compile(r"^---(?:[ \t]|$)", re.MULTILINE)


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
    node: yaml.Node | fastyaml.Located | None = field(default=None, repr=False, compare=False)  # only while read
    lines: dict[str, int] | None = field(default=None, repr=False, compare=False)  # pointers located then

    def locate(self, json_pointers: Iterable[str]) -> None:
        """Finds the lines of `json_pointers` now, from the node tree of the first parse, for `line_of`."""
        if self.node is not None:
            self.lines = {p: self._line_in(self.node, p) for p in json_pointers}

    def line_of(self, json_pointer: str) -> int:
        """The 1-based line of the deepest node on `json_pointer` that exists (a missing field is reported
        on its parent's line)."""
        if self.lines is not None and json_pointer in self.lines:
            return self.lines[json_pointer]
        node = self.node
        if node is None and self.span is not None and self.text is not None:
            node = _node_tree(self.text, self.span.start, self.span.end)
        if node is None:
            return (self.span.line if self.span is not None else 0) + 1
        return self._line_in(node, json_pointer)

    def _line_in(self, top: yaml.Node | fastyaml.Located, json_pointer: str) -> int:
        """The line of `json_pointer` below `top`, the document's node (from any parse of it: lines are
        counted from its own)."""
        if isinstance(top, fastyaml.Located):
            return top.line_of([*self.prefix, *_split_pointer(json_pointer)])
        node, line = top, top.start_mark.line
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
        assert self.span is not None  # a node comes from YAML, which has a span
        return self.span.line + line - top.start_mark.line + 1


@functools.lru_cache(maxsize=8)
def _node_tree(text: str, start: int, end: int) -> yaml.Node | None:
    """The YAML node tree of text[start:end], parsed again, for a line not located while the document was read
    (rare: a finding across documents). A document's findings are located one after the other, so a small
    cache parses each once."""
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
        int(p) if p.isascii() and p.isdigit() else p.replace("~1", "/").replace("~0", "~")
        for p in json_pointer.lstrip("/").split("/")
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


Parsed = tuple[Any, Span | None, yaml.Node | fastyaml.Located | None]  # a document's data, where it is and its node;
# (None, None, None) for one that cannot be read
Settle = Callable[["Document"], None]  # told of each document while its node tree is at hand

_TAG = "tag:yaml.org,2002:"
_STR, _MAP, _SEQ = _TAG + "str", _TAG + "map", _TAG + "seq"
_SCALAR_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float", "binary", "timestamp"))


class _Unusual(Exception):
    """A node the shortcut in `_construct` leaves to PyYAML's constructor."""


def _construct(loader: _Loader, document: yaml.Node, anchors: bool) -> Any:
    """What `loader.construct_document(document)` returns, three times as fast for what manifests are made of
    (string-keyed mappings, sequences, plain scalars). Anchors, merge keys, other tags or keys are left to
    PyYAML's constructor. A scalar that its tag's constructor cannot read (`2025-02-30` resolves to a date)
    is a ConstructorError on its line, not a crash."""
    constructors = loader.yaml_constructors
    seen: set[int] | None = set() if anchors else None  # without anchors there is no alias to look for
    scalar, mapping_node, sequence_node, plain_tag = (
        yaml.ScalarNode,
        yaml.MappingNode,
        yaml.SequenceNode,
        _PLAIN_TAGS.get,
    )

    def build(node: yaml.Node) -> Any:
        cls, tag = node.__class__, node.tag
        if cls is scalar:
            if tag.__class__ is slice:
                if not tag.step[0]:  # quoted or a block scalar, without a tag: a string
                    return node.value
                tag = plain_tag(node.value) or _tag(node)
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
        if seen is not None:
            if id(node) in seen:  # an alias: PyYAML shares the object
                raise _Unusual
            seen.add(id(node))
        implicit = tag.__class__ is slice  # a collection without a tag: a plain map or sequence
        if cls is mapping_node and (implicit or tag == _MAP):
            mapping = {}
            for key, value in node.value:
                if key.__class__ is not scalar:
                    raise _Unusual
                key_tag = key.tag
                if key_tag.__class__ is slice:
                    if key_tag.step[0] and (plain_tag(key.value) or _tag(key)) != _STR:  # also merge keys (<<)
                        raise _Unusual
                elif key_tag != _STR:
                    raise _Unusual
                mapping[key.value] = build(value)
            return mapping
        if cls is sequence_node and (implicit or tag == _SEQ):
            return [build(item) for item in node.value]
        raise _Unusual

    try:
        return build(document)
    except _Unusual:
        pass
    _resolve_tree(document, set())
    try:
        return loader.construct_document(document)
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise yaml.constructor.ConstructorError(
            None, None, f"cannot read a value: {exc}", document.start_mark
        ) from None


def _parse_chunk(chunk: str, begin: int, line_offset: int) -> Iterator[Parsed]:
    """The documents of `chunk`, which starts at character `begin` and line `line_offset` of its file."""
    loader = _Loader(chunk)
    anchors = "&" in chunk
    try:
        while loader.check_node():
            node = loader.get_node()
            mark = node.start_mark
            span = Span(begin + mark.index - mark.column, begin + node.end_mark.index, line_offset + mark.line)
            yield _construct(loader, node, anchors), span, node
    finally:
        loader.dispose()


def _parse_by_document(file: str, text: str) -> tuple[list[Parsed], list[InputError]]:
    """After a syntax error: the file parsed again document by document, so that the error loses only the
    document it is in; a document that cannot be read keeps its place (as an empty one) so that the documents
    after it keep their index."""
    documents: list[Parsed] = []
    errors: list[InputError] = []
    starts = [0] + [m.start() for m in DOCUMENT_START.finditer(text) if m.start() > 0]
    for begin, end in zip(starts, [*starts[1:], len(text)], strict=True):
        offset = text.count("\n", 0, begin)
        chunk = text[begin:end]
        try:
            documents += list(_parse_chunk(chunk, begin, offset))
        except yaml.YAMLError as exc:
            errors.append(_yaml_error(file, exc, chunk, offset))
            documents.append((None, None, None))
        except RecursionError:
            errors.append(InputError(file, offset + 1, "document is nested too deeply to read"))
            documents.append((None, None, None))
    return documents, errors


def _parse_json(file: str, text: str) -> tuple[list[Parsed], list[InputError]]:
    """JSON that YAML cannot read (tabs, say) still reads as JSON, without line numbers below the top."""
    try:
        return [(json.loads(text), None, None)], []
    except json.JSONDecodeError as exc:
        return [], [InputError(file, exc.lineno, f"invalid JSON: {exc.msg}")]
    except RecursionError:
        return [], [InputError(file, 1, "document is nested too deeply to read")]


def read_documents(file: str, text: str, settle: Settle | None = None) -> tuple[list[Document], list[InputError]]:
    """The file's objects and what cannot be read. `settle` is told of each object while its node tree is at
    hand (it may `locate` lines then); after a syntax error the file is read again and told again, as it is
    when rapidyaml leaves the file to PyYAML (see fastyaml), even while it is being told."""
    try:
        parsed = [(data, Span(*span), node) for data, span, node in fastyaml.parse(text)]
        return _documents(file, text, parsed, settle)
    except fastyaml.Unsupported:
        pass
    try:
        return _documents(file, text, _parse_chunk(text, 0, 0), settle)
    except (yaml.YAMLError, RecursionError):
        pass
    parsed, errors = _parse_by_document(file, text)
    if errors and file.endswith(".json"):
        parsed, errors = _parse_json(file, text)
    documents, more = _documents(file, text, parsed, settle)
    return documents, errors + more


def _documents(
    file: str, text: str, parsed: Iterable[Parsed], settle: Settle | None
) -> tuple[list[Document], list[InputError]]:
    """Documents from parsed data, one at a time: a document's node tree is let go once it is settled."""
    documents: list[Document] = []
    errors: list[InputError] = []
    for index, (data, span, node) in enumerate(parsed):
        if data is None:
            continue
        line = span.line + 1 if span is not None else 1
        if isinstance(data, list):
            # A YAML sequence: no manifest kubectl applies, but the objects in it are checked; entries that are
            # no Kubernetes object (a list-shaped config file) are not manifests, and are left alone.
            items = [
                Document(file, index, item, span, (item_index,), text, node)
                for item_index, item in enumerate(data)
                if isinstance(item, dict) and "apiVersion" in item and "kind" in item
            ]
        elif not isinstance(data, dict):
            errors.append(
                InputError(file, line, f"document {index} is a {type(data).__name__}, not a Kubernetes object")
            )
            continue
        elif data.get("kind") == "List" and isinstance(data.get("items"), list):
            items = []
            for item_index, item in enumerate(data["items"]):
                if isinstance(item, dict):
                    items.append(Document(file, index, item, span, ("items", item_index), text, node))
                else:
                    errors.append(InputError(file, line, f"document {index}: items[{item_index}] is not an object"))
        else:
            items = [Document(file, index, data, span, (), text, node)]
        for document in items:
            if settle is not None:
                settle(document)
            document.node = None
        documents += items
    return documents, errors


# Directories a walk never enters (tools' own trees, where no manifest of the repository lives), as linters do.
DEFAULT_EXCLUDES = (
    ".git", ".hg", ".svn", ".venv", "venv", ".tox", ".nox", "node_modules", "__pycache__",
    ".mypy_cache", ".pytest_cache", ".ruff_cache",
)  # fmt: skip


@dataclass
class Expanded:
    """What the PATHs name: the files to read, those that do not exist, the Helm chart templates left out (Go
    templates, not manifests: `helm template CHART | scrubgate check -` checks what they render), and the
    directories met again through a symbolic link, each with the path it was read under."""

    files: list[str] = field(default_factory=list)
    errors: list[InputError] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)
    repeats: list[tuple[str, str]] = field(default_factory=list)


def expand_paths(paths: list[str], exclude: Iterable[str] = ()) -> Expanded:
    """Files to read, in a stable order: directories recursively (`*.yaml`, `*.yml`, `*.json`), but not into
    DEFAULT_EXCLUDES or what matches an `exclude` glob (a name, or a path as given); files named explicitly are
    read whatever their directory, except a Helm chart's templates."""
    out = Expanded()
    skip = (*DEFAULT_EXCLUDES, *(os.path.normpath(p) if "/" in p else p for p in exclude))
    for raw in paths:
        if raw == STDIN:
            out.files.append(STDIN)
            continue
        path = Path(raw)
        if path.is_dir():
            found = manifests_under(str(path), skip)
            out.files += found.files
            out.templates += found.templates
            out.repeats += found.repeats
        elif not path.exists():
            out.errors.append(InputError(raw, None, "no such file or directory"))
        elif path.parent.name == "templates" and (path.parent.parent / "Chart.yaml").is_file():
            out.templates.append(raw)
        else:
            out.files.append(raw)
    return out


def _identity(directory: str) -> tuple[int, int] | None:
    try:
        status = os.stat(directory)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def manifests_under(directory: str, skip: tuple[str, ...] = DEFAULT_EXCLUDES) -> Expanded:
    """What `sorted(str(p) for p in Path(directory).rglob("*") if p.suffix in SUFFIXES and p.is_file())` gives
    (unreadable directories skipped), without a Path per entry: a fifth of the time of a run over many small
    files; but not under a directory `skip` matches, and the `templates` of a Helm chart apart. Symbolic links
    to directories are followed once the tree itself is walked, each directory read once whatever leads to it:
    a link back up the tree cannot loop, and a directory is not read (nor its objects counted) twice."""
    out = Expanded()
    walked: list[str] = []  # the tree's own directories
    links: list[str] = []  # symbolic links to directories, followed after the tree
    seen: set[tuple[int, int]] | None = None  # the directories read, once links are followed
    first: dict[tuple[int, int], str] = {}  # ... and the path each was read under
    pending = [directory]
    while pending or links:
        if pending:
            top = pending.pop()
        else:
            if seen is None:  # the tree has no loops: identities are needed only once a link is followed
                first = {ident: d for d in walked if (ident := _identity(d)) is not None}
                seen = set(first)
            links.sort()
            top = links.pop(0)
        if seen is None:
            walked.append(top)
        else:
            ident = _identity(top)
            if ident is None or ident in seen:
                if ident is not None:
                    out.repeats.append((top, first[ident]))
                continue
            seen.add(ident)
            first[ident] = top
        prefix = "" if top == "." else top.rstrip("/") + "/"
        try:
            with os.scandir(top) as listing:
                entries = list(listing)
        except OSError:
            continue
        chart = any(e.name == "Chart.yaml" and e.is_file() for e in entries)
        for entry in entries:
            name = entry.name
            if entry.is_dir():
                where = os.path.normpath(prefix + name)
                if any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(where, p) for p in skip):
                    continue
                if chart and name == "templates":
                    out.templates.append(prefix + name)
                else:
                    (links if entry.is_symlink() else pending).append(prefix + name)
            elif (dot := name.rfind(".")) > 0 and name[dot:] in SUFFIXES and entry.is_file():
                out.files.append(prefix + name)
    out.files.sort()
    out.templates.sort()
    return out


def read_text(file: str) -> str | InputError:
    """The file's text, or the reason it cannot be read."""
    try:
        data = sys.stdin.buffer.read() if file == STDIN else _read_bytes(file)
    except OSError as exc:
        return InputError(display_name(file), None, f"cannot read: {exc.strerror or exc}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return InputError(display_name(file), None, f"not UTF-8 text (byte {exc.start}): is this a manifest?")


def _read_bytes(file: str) -> bytes:
    """The file's bytes, through the system calls alone: for thousands of small files, a Python file object
    each costs a third of reading them."""
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        status = os.fstat(fd)
        size = status.st_size + 1  # one more: a regular file read short has ended, no empty read needed
        chunks = [os.read(fd, size)]
        if not stat.S_ISREG(status.st_mode) or len(chunks[0]) == size:  # a pipe, or a file that grew
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def display_name(file: str) -> str:
    return STDIN_NAME if file == STDIN else file
