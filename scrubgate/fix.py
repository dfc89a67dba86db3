"""`scrubgate check --fix`: applies the mechanical patches of the findings to the manifests.

ruamel.yaml's round trip keeps comments, key order and quoting of what the patches do not touch."""

from __future__ import annotations

import io
import re
from collections.abc import Iterable
from pathlib import Path

import jsonpatch
import jsonpointer
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from .check import CheckedObject
from .sources import STDIN_NAME

# Comment and blank lines before the first `---`: ruamel.yaml drops them, so they are carried over by hand.
_LEADING_COMMENTS = re.compile(r"(?:[ \t]*(?:#[^\n]*)?\n)*")


def _split_head(text: str) -> tuple[str, str]:
    """(comment and blank lines before the first document, the rest)."""
    head = _LEADING_COMMENTS.match(text).group()  # type: ignore[union-attr]  # the pattern matches ""
    return head, text[len(head) :]


def _starts_with_marker(text: str) -> bool:
    """Whether the first document of `text` opens with `---` (after comments and blank lines)."""
    return _split_head(text)[1].startswith("---")


class FixError(ValueError):
    """A file whose patches cannot be applied; it is left as it is."""


def _yaml() -> YAML:
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096
    return yaml


def fix_file(text: str, checked: Iterable[CheckedObject]) -> tuple[str, int]:
    """The file's text with the patches applied, and how many findings they fix. The fixed findings are
    removed from `checked`; on FixError nothing is."""
    checked = list(checked)
    patched = [(item, finding) for item in checked for finding in item.findings if finding.patch]
    if not patched:
        return text, 0
    yaml = _yaml()
    try:
        documents = list(yaml.load_all(text))
        for item, finding in patched:
            base = "".join(f"/{p}" for p in item.document.prefix)
            ops = [{**op, "path": base + op["path"]} for op in finding.patch]
            jsonpatch.apply_patch(documents[item.document.index], ops, in_place=True)
    except (YAMLError, jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, IndexError) as exc:
        # ruamel.yaml is stricter than the checker's parser in places (duplicate keys, for one).
        raise FixError(f"cannot apply the fixes, file left as it is: {str(exc).splitlines()[0]}") from None
    out = io.StringIO()
    yaml.dump_all(documents, out)
    new_text = out.getvalue()
    head, rest = _split_head(text)
    if rest.startswith("---"):
        new_text = head + (new_text if new_text.startswith("---") else "---\n" + new_text)
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
