"""PATCH bodies: JSON patch (RFC 6902), JSON merge patch (RFC 7386) and strategic merge patch.

Strategic merge patch follows apimachinery's ``strategicpatch`` for the list fields scrubgate's
components and the simulated control plane write (``SMP_LISTS``); every other list is replaced, as
in a merge patch. Directives: ``$patch: replace|delete`` (maps and list elements),
``$deleteFromPrimitiveList/<field>``, ``$retainKeys``; ``$setElementOrder/<field>`` is accepted and
ignored (the merged order is the original's, new elements appended).
"""

from __future__ import annotations

import copy

import jsonpatch
import jsonpointer

from .errors import ApiError, bad_request

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

PRIMITIVE = ""  # a list of scalars merged as a set (patchStrategy: merge without a key)

_METADATA_LISTS: dict[tuple[str, ...], str] = {
    ("metadata", "finalizers"): PRIMITIVE,
    ("metadata", "ownerReferences"): "uid",
}

# (resource plural) -> {path of map keys from the object root: merge key}; from the Go types' tags.
SMP_LISTS: dict[str, dict[tuple[str, ...], str]] = {
    "pods": {
        ("spec", "containers"): "name",
        ("spec", "initContainers"): "name",
        ("spec", "containers", "env"): "name",
        ("spec", "containers", "ports"): "containerPort",
        ("spec", "containers", "volumeMounts"): "mountPath",
        ("spec", "volumes"): "name",
        ("spec", "resourceClaims"): "name",
        ("spec", "schedulingGates"): "name",
        ("status", "conditions"): "type",
        ("status", "resourceClaimStatuses"): "name",
    },
    "nodes": {
        ("status", "conditions"): "type",
        ("status", "addresses"): "type",
    },
    "namespaces": {("status", "conditions"): "type"},
    "resourceclaims": {("status", "reservedFor"): "uid"},
}


def apply_patch(content_type: str, plural: str, original: dict, body: object) -> dict:
    """Apply a PATCH body to ``original`` (not modified); ApiError 400/415/422 as the API server."""
    kind = content_type.split(";")[0].strip().lower()
    if kind == JSON_PATCH:
        return _json_patch(original, body)
    if not isinstance(body, dict):
        raise bad_request("patch body must be a JSON object for merge and strategic merge patches")
    if kind == MERGE_PATCH:
        return merge_patch(original, body)
    if kind == STRATEGIC_MERGE_PATCH:
        lists = {**_METADATA_LISTS, **SMP_LISTS.get(plural, {})}
        merged = _smp_map(copy.deepcopy(original), body, (), lists)
        return merged if merged is not None else {}
    raise ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{JSON_PATCH}, {MERGE_PATCH}, {STRATEGIC_MERGE_PATCH}"
        + (" (server-side apply is not supported by devcluster)" if kind == APPLY_PATCH else ""),
    )


def _json_patch(original: dict, body: object) -> dict:
    if not isinstance(body, list):
        raise bad_request("json patch must be a JSON array of operations")
    try:
        patch = jsonpatch.JsonPatch(body)
        return patch.apply(copy.deepcopy(original))
    except jsonpatch.InvalidJsonPatch as e:
        raise bad_request(f"invalid json patch: {e}") from e
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
        # apimachinery answers every failed application (including a failed `test`) with 422.
        raise ApiError(422, "Invalid", str(e)) from e


def merge_patch(original: object, patch: object) -> object:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _smp_map(original: object, patch: dict, path: tuple[str, ...], lists: dict[tuple[str, ...], str]) -> dict | None:
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive is not None:
        raise bad_request(f"unknown patch directive $patch: {directive!r}")
    result = dict(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(result.get(name), list):
                result[name] = [x for x in result[name] if x not in (value or [])]
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        sub = (*path, key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = _smp_map(result.get(key), value, sub, lists)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and sub in lists:
            result[key] = _smp_list(result.get(key) or [], value, sub, lists)
        else:
            result[key] = copy.deepcopy(value)
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(original: list, patch: list, path: tuple[str, ...], lists: dict[tuple[str, ...], str]) -> list:
    key = lists[path]
    if key == PRIMITIVE:
        merged: list = []
        for item in [*original, *patch]:
            if item not in merged:
                merged.append(copy.deepcopy(item))
        return merged
    result = [copy.deepcopy(x) for x in original]
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(x) for x in patch if not (isinstance(x, dict) and "$patch" in x)]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise bad_request(f"strategic merge patch: element of {'.'.join(path)} lacks merge key {key!r}")
        index = next((i for i, x in enumerate(result) if isinstance(x, dict) and x.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
            continue
        if index is None:
            result.append({k: copy.deepcopy(v) for k, v in item.items() if k != "$patch"})
        else:
            merged = _smp_map(result[index], item, path, lists)
            result[index] = merged if merged is not None else result[index]
    return result
