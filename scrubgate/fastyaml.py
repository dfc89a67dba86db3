"""Reading manifests with rapidyaml, for the text where it gives exactly what PyYAML's safe loader gives.

rapidyaml parses in C++ and writes each document out as JSON, which `json` reads back: about a fifth of the
time PyYAML's libyaml loader takes to build the same data. It reads YAML 1.2, PyYAML (like Kubernetes' own
parser) YAML 1.1, and it keeps no tags; so a file goes to PyYAML (`Unsupported`) wherever the two could differ:

- the text holds a tag (`!`), a tab, a line break only YAML 1.1 knows (NEL, LS, PS, a lone CR), or a character
  PyYAML refuses (its error is the one to report); rapidyaml cannot parse it;
- a plain scalar that YAML 1.1 reads as something other than a string (`yes`, `012`, `1_000`, `2025-01-01`,
  `~`, `<<`, ...) where rapidyaml wrote a string, a key that YAML 1.1 could read as anything but a string, or
  any float (rapidyaml writes `1e3` and `-.5` as numbers, YAML 1.1 reads both as strings);
- an anchor or alias, text rapidyaml reads on where libyaml refuses it (found by fuzzing; see `_LENIENT`), a
  document that is not a non-empty mapping, or a line this module cannot place as PyYAML does.

Lines come from where rapidyaml's scalars lie in the parsed buffer, found along a finding's path only.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import ryml
import yaml

__all__ = ["Located", "Unsupported", "parse"]


class Unsupported(Exception):
    """Text, or a part of it, that PyYAML must read."""


# What sends text to PyYAML: a character it refuses (not printable; its error is the one to report), a tab
# (YAML 1.1 and 1.2 differ on them), a tag (`!`), a line break only YAML 1.1 knows (NEL, LS, PS, a CR that is
# not part of CRLF), a BOM inside the text. Checked in two steps: most manifests are ASCII.
_LEAVE_ASCII = re.compile("[\x00-\x09\x0b\x0c\x0e-\x1f\x7f!]")  # one class: searched at C speed
_LEAVE_OTHER = re.compile("[^\n\r\x20-\x7e\xa0-\ud7ff\ue000-\ufefe\uff00-\ufffd\U00010000-\U0010ffff]|[!\u2028\u2029]")
_LONE_CR = re.compile("\r(?!\n)")
# Where rapidyaml reads on and YAML 1.1 (or libyaml) refuses or reads otherwise, as fuzzing both showed, at a
# place where a scalar may start (a line's first character; after `- ` or `: `; in a flow collection, after
# its bracket or a comma): a directive (`%YAML 2.0` is refused); a reserved backtick or `@`; `]`, `}`, `,` or
# `:` in block context; an anchor or alias (names differ: `&a:` is an anchor and a key for libyaml), so no
# alias is left for the JSON to hide; in a flow collection, any indicator, `- `, and `:` right before a flow
# indicator or `?`. Also a flow collection left open at the end of its line, and `- ` after a quoted scalar
# on its line. Inside a scalar these characters are characters like others. Valid JSON is let through (its
# lines start and end with brackets), since `json` has read it strictly first.
# Each pattern starts with a character Python's re looks for at C speed, and its repeats are possessive (no
# backtracking): one pattern with alternatives would try each of them at every character, several times the
# cost of the parse itself.
_LENIENT_BLOCK = tuple(
    re.compile(pattern)
    for pattern in (
        r"\n *+[\]},%@`:&*?]",
        r"- ++[\]},%@`:&*?]",
        r": ++[\]},%@`:&*?]",
        r"\? ++[\]},%@`:&*?]",
        r":[,\[\]{}?%@`&*]",
        r"\n *+\.\.\.",  # a document end marker: libyaml wants `---` before more content
        r"\|[-+]?[0-9]|>[-+]?[0-9]",  # a block scalar's indentation indicator (and what may follow it)
        r"\\\r?\n",  # an escaped line break in a double-quoted scalar
    )
)
_LENIENT_FLOW = tuple(
    re.compile(pattern)
    for pattern in (
        r"\[ *+(?:[?:%@`&*|>!]|-\s)",
        r"\{ *+(?:[?:%@`&*|>!]|-\s)",
        r", *+(?:[?:%@`&*|>!]|-\s)",
        r"\[[^\]}\n]*+\n",
        r"\{[^\]}\n]*+\n",
        r"\[[^\n#]*+#(?<= #)",  # a comment after a flow collection opened on its line
        r"\{[^\n#]*+#(?<= #)",
    )
)
_LENIENT_QUOTED = (re.compile(r'" ++- '), re.compile(r"' ++- "))
# What a comment line says is no YAML to look at. (Not a comment after a value: ` #` may be inside a quoted
# scalar, and what follows it on the line would be hidden.)
_COMMENT = re.compile(r"\n *+#[^\n]*+")
# PyYAML refuses a key more than 1,024 characters long (YAML's limit on implicit keys), rapidyaml reads it; a
# key lies on one line, so a line that long is left to PyYAML.
_LONG_LINE = re.compile(r"\n[^\n]{1025}")
# What libyaml refuses in JSON as well: an escaped surrogate (rapidyaml writes it out as bytes that are not
# UTF-8), a key's `:` on the line after it.
_EVEN_IN_JSON = (re.compile(r"\\u[dD][89a-fA-F]|\\U0000[dD][89a-fA-F]"), re.compile(r'"[ \t]*+\r?\n\s*+:'))
# A key that starts with a space in what rapidyaml wrote: it took a line libyaml refuses (more indented than
# its siblings, after a comment) for a key.
_INDENTED_KEY = re.compile(r'" [^"\n]*+":')


def _lenient(padded: str) -> bool:
    """Whether the text, a line break added before and after it (every line starts after one and ends with one),
    holds a place where rapidyaml reads on and YAML 1.1 does not (see above)."""
    if "#" in padded:
        padded = _COMMENT.sub("\n", padded)
    patterns = _LENIENT_BLOCK
    if "[" in padded or "{" in padded:
        patterns += _LENIENT_FLOW
    if '"' in padded or "'" in padded:
        patterns += _LENIENT_QUOTED
    return any(pattern.search(padded) for pattern in patterns)


# PyYAML's resolver for `!`, `&` and `*` (tag `yaml`) is its own note that no plain scalar can be one of them:
# a string `"*"` (an RBAC rule's) was quoted.
_NO_PLAIN_SCALAR = "yaml"


def _yaml11_patterns() -> dict[str, str]:
    """PyYAML's patterns for plain scalars it reads as anything but a string, by tag (bool, int, float, null,
    timestamp, merge, value), each as a pattern of a string's content, verbose as PyYAML writes them."""
    return {
        tag.rpartition(":")[2]: regexp.pattern.strip().removeprefix("^").removesuffix("$")
        for resolvers in yaml.resolver.Resolver.yaml_implicit_resolvers.values()
        for tag, regexp in resolvers
        if tag.rpartition(":")[2] != _NO_PLAIN_SCALAR
    }


def _suspect() -> re.Pattern[str]:
    """A JSON string whose content YAML 1.1 would read as something else were it a plain scalar, then `:` if it
    is a key. The lookahead skips, at C speed, the strings that cannot match: words that are not booleans or
    nulls, and what starts with none of the characters PyYAML's other patterns start with. A match that starts
    inside a string (at an escaped quote) only sends more to PyYAML; none can hide a string that follows."""
    patterns = _yaml11_patterns()
    words = "|".join(f"(?:{patterns[tag]})" for tag in ("bool", "null"))
    firsts = {
        first
        for first, resolvers in yaml.resolver.Resolver.yaml_implicit_resolvers.items()
        if first and any(tag.rpartition(":")[2] not in ("bool", "null", _NO_PLAIN_SCALAR) for tag, _ in resolvers)
    }
    anything = "|".join(f"(?:{pattern})" for _, pattern in sorted(patterns.items()))
    lookahead = f'(?=[{re.escape("".join(sorted(firsts)))}]|(?x:{words})")'
    return re.compile(f'"{lookahead}((?x:{anything}))"(:?)')


_SUSPECT = _suspect()
# What rapidyaml writes unquoted when plain: a string with this content was quoted in the text.
_WRITTEN_BARE = re.compile(r"-?(?:0|[1-9][0-9]*)|true|false|null|")


def _no_float(text: str) -> float:
    raise Unsupported(f"float {text}")


_decode = json.JSONDecoder(parse_float=_no_float, strict=False).decode


class _Py_buffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_Py_buffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_Py_buffer)]


_view = _Py_buffer()  # one, reused: check reads files in one thread per process
_view_ref = ctypes.byref(_view)


def _address(view: memoryview) -> int:
    """Where a scalar rapidyaml returns lies in memory (its memoryview has no owner to ask)."""
    _get_buffer(view, _view_ref, 0)
    try:
        return _view.buf or 0
    finally:
        _release_buffer(_view_ref)


_devnull: int | None = None


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """rapidyaml prints a parse error to file descriptor 2 before raising it; PyYAML then reads the file again
    and reports the error itself, so the print would only say it twice, differently."""
    global _devnull
    if _devnull is None:
        _devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    saved = os.dup(2)
    try:
        os.dup2(_devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass(slots=True)
class _Buffer:
    """A file's UTF-8 text, the copy rapidyaml parsed in place (quoted and folded scalars rewritten there)
    and its tree."""

    raw: bytes
    data: bytearray
    tree: Any
    base: int  # the address of data[0]

    def offset(self, view: memoryview | None) -> int:
        if view is None or not len(view):
            raise Unsupported("an empty scalar has no place of its own")
        offset = _address(view) - self.base
        if not 0 <= offset < len(self.data):
            raise Unsupported("a scalar outside the parsed text")
        return offset

    def start(self, node: int) -> int:
        """The offset at which PyYAML's node for `node` starts (its start mark): a container's first scalar, or
        its opening bracket; a block scalar's indicator."""
        tree = self.tree
        kind = tree.type(node)  # one call into rapidyaml, then bits
        if kind & (ryml.MAP | ryml.SEQ):
            child = tree.first_child(node)
            if child == ryml.NONE:
                raise Unsupported("an empty collection")
            offset = self.offset(tree.key(child)) if kind & ryml.MAP else self.start(child)
            if kind & _FLOW:
                offset = self.raw.rfind(b"{" if kind & ryml.MAP else b"[", 0, offset)
                if offset < 0:
                    raise Unsupported("a flow collection without its bracket")
            return offset
        offset = self.offset(tree.val(node))
        if kind & _BLOCK_SCALAR:
            offset = max(self.raw.rfind(b"|", 0, offset), self.raw.rfind(b">", 0, offset))
            if offset < 0:
                raise Unsupported("a block scalar without its indicator")
        return offset


_FLOW = ryml.FLOW_SL | ryml.FLOW_ML
_BLOCK_SCALAR = ryml.VAL_LITERAL | ryml.VAL_FOLDED


@dataclass(slots=True)
class Located:
    """A document's node in rapidyaml's tree: finds the line of a path below it as PyYAML's nodes would."""

    buffer: _Buffer
    node: int
    start: int  # the byte offset of its first line
    line: int  # that line, 0-based

    def line_of(self, parts: Iterable[str | int]) -> int:
        """The 1-based line of the deepest node on `parts` that exists; for a mapping's value, its key's."""
        buffer, tree, node = self.buffer, self.buffer.tree, self.node
        offset = self.start  # the document's own line, until a node below it is found
        for part in parts:
            kind = tree.type(node)
            if kind & ryml.MAP:
                child = tree.find_child(node, str(part).encode())
                if child == ryml.NONE:
                    break
                node, offset = child, buffer.offset(tree.key(child))
            elif kind & ryml.SEQ and isinstance(part, int) and 0 <= part < tree.num_children(node):
                node = tree.child(node, part)
                offset = buffer.start(node)
            else:
                break
        return self.line + buffer.raw.count(b"\n", self.start, offset) + 1


Parsed = tuple[Any, tuple[int, int, int], Located]  # data, (start, end, line) in the text, its node


def parse(text: str) -> list[Parsed]:
    """Every document of `text`: its data, where it lies (str offsets) and its node. Raises Unsupported."""
    if (_LEAVE_ASCII if text.isascii() else _LEAVE_OTHER).search(text) or ("\r" in text and _LONE_CR.search(text)):
        raise Unsupported("text PyYAML reads otherwise")
    if not text:
        return []
    padded = f"\n{text}\n"
    if (len(text) > 1024 and _LONG_LINE.search(padded)) or any(p.search(text) for p in _EVEN_IN_JSON):
        raise Unsupported("a line longer than PyYAML allows a key, a surrogate, a key's `:` on the next line")
    whole = _json_object(text)
    if whole is None:
        if _lenient(padded):
            raise Unsupported("text where rapidyaml is more lenient than YAML")
        if not text.endswith("\n") and ("|" in text or ">" in text):
            raise Unsupported("a block scalar may end the text without a line break, which rapidyaml adds")
    raw = text.encode()
    data = bytearray(raw)
    tree = ryml.Tree()
    with _quiet_stderr():
        try:
            ryml.parse_in_place(data, tree)
            documents = [_document(tree, node, whole) for node in _documents(tree)]
        except ryml.ExceptionBasic as exc:  # a syntax error, nesting deeper than rapidyaml writes out
            raise Unsupported(f"rapidyaml cannot read it: {exc.msg}") from None
    buffer = _Buffer(raw, data, tree, ctypes.addressof(ctypes.c_char.from_buffer(data)))
    return _placed(text, buffer, documents)


def _json_object(text: str) -> Any:
    """The text's data where it is JSON (None otherwise), read by `json` alone: JSON is read alike by YAML 1.1
    but for floats (refused here as in `_document`), and the lenient places above (brackets opening and closing
    lines) do not concern it, since `json` refuses what is not JSON."""
    if text.lstrip()[:1] not in ("{", "["):
        return None
    try:
        return _decode(text)
    except (ValueError, RecursionError):
        return None


def _documents(tree: Any) -> list[int]:
    root = tree.root_id()
    if tree.is_stream(root):
        return list(ryml.children(tree, root))
    if tree.type(root) == ryml.NOTYPE:
        return []  # no document: only comments
    return [root]


def _document(tree: Any, node: int, whole: Any = None) -> tuple[Any, int]:
    """The document's data, and its node; None for an empty document, which keeps its place. `whole`: the
    text's data already read as JSON, for its one document."""
    if tree.is_doc(node) and tree.is_val(node) and tree.val_is_null(node):
        return None, node
    if not (tree.is_map(node) and tree.num_children(node)):
        raise Unsupported("a document that is not a mapping")
    if whole is not None:
        return whole, node
    written = ryml.emit_json_malloc(tree, node)
    if _INDENTED_KEY.search(written):
        raise Unsupported("a key that starts with a space")
    for match in _SUSPECT.finditer(written):
        if match[2] or not _WRITTEN_BARE.fullmatch(match[1]):
            raise Unsupported(f"a scalar YAML 1.1 may read otherwise: {match[1]!r}")
    try:
        return _decode(written), node
    except (ValueError, RecursionError) as exc:  # rapidyaml wrote what JSON is not (`+1`, `0x1F`): PyYAML's call
        raise Unsupported(f"not JSON: {exc}") from None


def _placed(text: str, buffer: _Buffer, documents: list[tuple[Any, int]]) -> list[Parsed]:
    """Each document with its span: from the start of its node's first line to the start of the next
    document's, as str offsets (the text's bytes and characters differ where it is not ASCII)."""
    data = buffer.raw
    starts = []
    for obj, node in documents:
        offset = buffer.start(node) if obj is not None else None
        starts.append(None if offset is None else data.rfind(b"\n", 0, offset) + 1)
    ends, following = [], len(data)
    for start in reversed(starts):
        ends.append(following)
        following = following if start is None else start
    ends.reverse()
    ascii_text = text.isascii()
    parsed: list[Parsed] = []
    line = chars = done = 0  # the line and str offset of byte offset `done`
    for (obj, node), start, end in zip(documents, starts, ends, strict=True):
        if start is None:
            parsed.append((None, (0, 0, 0), Located(buffer, node, 0, 0)))
            continue
        line += data.count(b"\n", done, start)
        chars += start - done if ascii_text else len(data[done:start].decode())
        done = start
        if not ascii_text:
            end = chars + len(data[start:end].decode())
        parsed.append((obj, (chars, end, line), Located(buffer, node, start, line)))
    return parsed
