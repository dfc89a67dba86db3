"""JSON patch as kube-apiserver applies it (gopkg.in/evanphx/json-patch.v4, `Patch.test`): a `test` of null
passes where the path is missing, which python-jsonpatch refuses. The in-memory API servers apply patches with
this, so that the agent's tests of a map it adds whole behave as on the real one."""

from __future__ import annotations

from typing import Any

import jsonpatch
import jsonpointer


def apply_patch(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The patched copy of `obj`; raises jsonpatch.JsonPatchTestFailed (or another JsonPatchException) where an
    op fails, leaving `obj` as it was."""
    doc = obj
    for op in ops:
        if op.get("op") == "test" and op.get("value") is None:
            try:
                found = jsonpointer.resolve_pointer(doc, op["path"])
            except jsonpointer.JsonPointerException:
                continue  # missing: as null
            if found is not None:
                raise jsonpatch.JsonPatchTestFailed(f"{op['path']} is {found!r}, not null")
            continue
        doc = jsonpatch.apply_patch(doc, [op])
    return doc
