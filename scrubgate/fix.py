"""`scrubgate check --fix`: applies the mechanical patches of the findings to the manifests.

ruamel.yaml's round trip keeps comments, key order, quoting and flow or block style; it lays the text out
its own way (spaces inside brackets, a flow collection over several lines, the indentation of block sequences
where no file-wide one is found). So the lines that the patches leave as they were are taken from the
file itself (`_keep_untouched`): a fix changes only the lines it must."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterable
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

import jsonpatch
import yaml
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from .check import CheckedObject
from .sources import DOCUMENT_START, STDIN_NAME, SafeLoader

# Comment and blank lines before the first `---`: ruamel.yaml drops them, so they are carried over by hand.
_LEADING_COMMENTS = re.compile(r"(?:[ \t]*(?:#[^\n]*)?\n)*")
# A line holding only a key (and a comment), then the first content line below it.
_KEY_THEN_LINE = re.compile(
    r"^( *)[^\s#-][^\n]*:[ \t]*(?:#[^\n]*)?\n(?:[ \t]*(?:#[^\n]*)?\n)*( *)(- +)?(\S)", re.MULTILINE
)


def _split_head(text: str) -> tuple[str, str]:
    """(comment and blank lines before the first document, the rest)."""
    head = _LEADING_COMMENTS.match(text).group()  # type: ignore[union-attr]  # the pattern matches ""
    return head, text[len(head) :]


def _starts_with_marker(text: str) -> bool:
    """Whether the first document of `text` opens with `---` (after comments and blank lines)."""
    return _split_head(text)[1].startswith("---")


class FixError(ValueError):
    """A file whose patches cannot be applied; it is left as it is."""


def _indentation(text: str) -> tuple[int, int, int]:
    """The file's indentation as ruamel.yaml's `indent` takes it (mapping, sequence, offset), from the first
    nested mapping and the first block sequence under a key; ruamel's defaults where it has none."""
    mapping = sequence = offset = None
    for match in _KEY_THEN_LINE.finditer(text):
        step = len(match.group(2)) - len(match.group(1))
        if match.group(3) is None and mapping is None and step > 0:
            mapping = step
        elif match.group(3) is not None and sequence is None and step >= 0:
            offset, sequence = step, step + len(match.group(3))
        if mapping is not None and sequence is not None:
            break
    return mapping or 2, sequence or 2, offset or 0


def _yaml(text: str) -> YAML:
    yaml_ = YAML(typ="rt")
    yaml_.preserve_quotes = True
    yaml_.width = 4096
    yaml_.brace_single_entry_mapping_in_flow_sequence = True  # `[{name: gpu}]`, not `[name: gpu]`
    mapping, sequence, offset = _indentation(text)
    yaml_.indent(mapping=mapping, sequence=sequence, offset=offset)
    return yaml_


def _dump(yaml_: YAML, documents: list[Any], text: str) -> str:
    out = io.StringIO()
    yaml_.dump_all(documents, out)
    dumped = out.getvalue()
    head, rest = _split_head(text)
    if rest.startswith("---"):
        dumped = head + (dumped if dumped.startswith("---") else "---\n" + dumped)
    return dumped


def _load_yaml(text: str) -> list[Any]:
    return list(yaml.load_all(text, Loader=SafeLoader))


def _load_json(text: str) -> list[Any]:
    return [json.loads(text)]


def _keep_untouched(original: str, unchanged: str, patched: str, load: Callable[[str], list[Any]]) -> str:
    """`patched` with the original's lines wherever the patches changed nothing. `unchanged` is ruamel's text
    of the same documents unpatched: it differs from `original` only in layout. Document by document where
    the three have as many (a document the patches left alone is the original's as it is), line by line in
    the others (`_merge`). What does not read back as `patched` does is not used."""
    documents = [_split_documents(text) for text in (original, unchanged, patched)]
    if len({len(d) for d in documents}) == 1:
        merged = "".join(o if u == p else _merge(o, u, p) for o, u, p in zip(*documents, strict=True))
    else:
        merged = _merge(original, unchanged, patched)
    try:
        if load(merged) == load(patched):
            return merged
    except (yaml.YAMLError, ValueError):
        pass
    return patched


def _split_documents(text: str) -> list[str]:
    starts = [0] + [m.start() for m in DOCUMENT_START.finditer(text) if m.start() > 0]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def _merge(original: str, unchanged: str, patched: str) -> str:
    """A three-way merge by lines: between lines that all three share, the original's lines where the patched
    text is as unchanged, the patched lines otherwise."""
    o, u, p = (s.splitlines(keepends=True) for s in (original, unchanged, patched))
    o_of = _matched(u, o)
    p_of = _matched(u, p)
    merged: list[str] = []
    last_o = last_u = last_p = -1
    for j in [*(j for j in range(len(u)) if j in o_of and j in p_of), len(u)]:
        i, k = (o_of[j], p_of[j]) if j < len(u) else (len(o), len(p))
        between_u, between_p = u[last_u + 1 : j], p[last_p + 1 : k]
        merged += o[last_o + 1 : i] if between_p == between_u else between_p
        if j < len(u):
            merged.append(o[i])
        last_o, last_u, last_p = i, j, k
    return "".join(merged)


def _matched(a: list[str], b: list[str]) -> dict[int, int]:
    """For each line of `a` that a matching of `a` and `b` pairs, its line in `b` (in order: a line paired
    after another in `a` is so in `b`)."""
    pairs: dict[int, int] = {}
    for block in SequenceMatcher(None, a, b).get_matching_blocks():
        pairs.update((block.a + n, block.b + n) for n in range(block.size))
    return pairs


def _json(text: str) -> Any:
    """The data of a JSON file, which stays JSON (kubectl reads a file that opens with `{` as JSON only); None
    for YAML."""
    if not text.lstrip().startswith(("{", "[")):
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def fix_file(text: str, checked: Iterable[CheckedObject]) -> tuple[str, int]:
    """The file's text with the patches applied, and how many findings they fix. The fixed findings are
    removed from `checked`; on FixError nothing is."""
    checked = list(checked)
    patched = [(item, finding) for item in checked for finding in item.findings if finding.patch]
    if not patched:
        return text, 0
    data = _json(text)
    dump: Callable[[list[Any]], str]
    if data is not None:
        indent = len(found.group(1)) if (found := re.search(r"\n( +)\S", text)) else 2
        documents, load = [data], _load_json
        dump = lambda documents: json.dumps(documents[0], indent=indent, ensure_ascii=False) + "\n"  # noqa: E731
    else:
        yaml_, load = _yaml(text), _load_yaml
        dump = lambda documents: _dump(yaml_, documents, text)  # noqa: E731
    try:
        if data is None:
            documents = list(yaml_.load_all(text))
        unchanged = dump(documents)
        for item, finding in patched:
            base = "".join(f"/{p}" for p in item.document.prefix)
            ops = [{**op, "path": base + op["path"]} for op in finding.patch]
            jsonpatch.apply_patch(documents[item.document.index], ops, in_place=True)
    except (YAMLError, jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, IndexError) as exc:
        # ruamel.yaml is stricter than the checker's parser in places (duplicate keys, for one).
        raise FixError(f"cannot apply the fixes, file left as it is: {str(exc).splitlines()[0]}") from None
    new_text = _keep_untouched(text, unchanged, dump(documents), load)
    for item in checked:
        item.findings = [f for f in item.findings if not f.patch]
    return new_text, len(patched)


def fix_all(objects: list[CheckedObject], in_place: bool) -> tuple[str, int, list[str]]:
    """Fixes every file that has patchable findings. In place: rewrites the files and returns ("", n, problems);
    otherwise returns the fixed documents of all files as one YAML stream. Fixed findings are removed from
    `objects`; `problems` names the files that could not be fixed, and why."""
    by_file: dict[str, list[CheckedObject]] = {}
    for item in objects:
        by_file.setdefault(item.document.file, []).append(item)
    streams, total, problems = [], 0, []
    for file, items in by_file.items():
        text = items[0].document.text or ""
        try:
            new_text, fixed = fix_file(text, items)
        except FixError as exc:
            problems.append(f"{file}: {exc}")
            new_text, fixed = text, 0
        total += fixed
        if in_place:
            if fixed and file != STDIN_NAME:
                Path(file).write_text(new_text, encoding="utf-8")
        else:
            streams.append(new_text if _starts_with_marker(new_text) else "---\n" + new_text)
    return "".join(s if s.endswith("\n") else s + "\n" for s in streams), total, problems
