"""`scrubgate check --fix`: applies the mechanical patches of the findings to the manifests.

ruamel.yaml's round trip keeps comments, key order and quoting of what the patches do not touch."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import jsonpatch
from ruamel.yaml import YAML

from .check import CheckedObject
from .sources import STDIN_NAME


def _yaml() -> YAML:
    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096
    return yaml


def fix_file(text: str, checked: Iterable[CheckedObject]) -> tuple[str, int]:
    """The file's text with the patches applied, and how many findings they fix."""
    patches: dict[int, list[tuple[tuple[str | int, ...], dict]]] = {}
    fixed = 0
    for item in checked:
        for finding in item.findings:
            if finding.patch:
                fixed += 1
                for op in finding.patch:
                    patches.setdefault(item.document.index, []).append((item.document.prefix, dict(op)))
    if not patches:
        return text, 0
    yaml = _yaml()
    documents = list(yaml.load_all(text))
    for index, ops in patches.items():
        for prefix, op in ops:
            base = "".join(f"/{p}" for p in prefix)
            jsonpatch.apply_patch(documents[index], [{**op, "path": base + op["path"]}], in_place=True)
    out = io.StringIO()
    yaml.dump_all(documents, out)
    return out.getvalue(), fixed


def fix_all(objects: list[CheckedObject], in_place: bool) -> tuple[str, int]:
    """Fixes every file that has patchable findings. In place: rewrites the files and returns ("", n);
    otherwise returns the fixed documents of all files as one YAML stream."""
    by_file: dict[str, list[CheckedObject]] = {}
    for item in objects:
        by_file.setdefault(item.document.file, []).append(item)
    streams, total = [], 0
    for file, items in by_file.items():
        text = items[0].document.text or ""
        new_text, fixed = fix_file(text, items)
        total += fixed
        if in_place:
            if fixed and file != STDIN_NAME:
                Path(file).write_text(new_text, encoding="utf-8")
        else:
            streams.append(new_text if new_text.lstrip().startswith("---") else "---\n" + new_text)
    return "".join(s if s.endswith("\n") else s + "\n" for s in streams), total
