"""Admission responses, controller-runtime style (pkg/webhook/admission/response.go).

`errored` follows controller-runtime's `Errored`: an HTTP 200 AdmissionReview with `allowed: false`
and status code 500. The API server turns any `allowed: false` into a rejection of the request
(apiserver webhook/errors.ToStatusErr), whatever the webhook's failurePolicy says, so an internal
error can never become an allow, not even where an operator set `failurePolicy: Ignore`. An HTTP
500 instead would hand the decision to failurePolicy.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

from .review import AdmissionResponse, Status, compact_json

MAX_WARNING_CHARS = 120


def _warnings(warnings: Iterable[str]) -> tuple[str, ...]:
    return tuple(truncate(warning, MAX_WARNING_CHARS) for warning in warnings) if warnings else ()


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def allowed(uid: str, warnings: Iterable[str] = ()) -> AdmissionResponse:
    if not warnings:  # the plain allow, most answers
        return AdmissionResponse(uid, True)
    return AdmissionResponse(uid=uid, allowed=True, warnings=_warnings(warnings))


def denied(uid: str, message: str, code: int = 403, warnings: Iterable[str] = ()) -> AdmissionResponse:
    return AdmissionResponse(
        uid=uid,
        allowed=False,
        status=Status(code=code, message=message, reason="Forbidden" if code == 403 else ""),
        warnings=_warnings(warnings),
    )


def patched(uid: str, ops: Iterable[Mapping[str, Any]], warnings: Iterable[str] = ()) -> AdmissionResponse:
    """Allows with a JSON Patch; no patch fields at all when `ops` is empty (a reinvocation that has
    nothing left to add)."""
    ops = list(ops)
    if not ops:
        return allowed(uid, warnings)
    document = compact_json(ops).encode()
    return AdmissionResponse(
        uid=uid,
        allowed=True,
        patch=base64.b64encode(document).decode("ascii"),
        patch_type="JSONPatch",
        warnings=_warnings(warnings),
    )


def errored(uid: str, error: BaseException | str, code: int = 500) -> AdmissionResponse:
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return AdmissionResponse(
        uid=uid,
        allowed=False,
        status=Status(code=code, message=message, reason="InternalError" if code >= 500 else "BadRequest"),
    )
