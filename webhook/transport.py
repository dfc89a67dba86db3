"""Decoding and encoding AdmissionReviews over HTTP; no policy here (handlers.py decides).

Every malformed request is refused with an HTTP 4xx and a message, which the API server treats as
a failed call (failurePolicy: Fail rejects the object): never an allow.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import ValidationError

from .review import AdmissionRequest, AdmissionResponse, AdmissionReview

_MAX_ERRORS_SHOWN = 3


class TransportError(Exception):
    """A request the webhook cannot decode; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_content_type(value: str | None) -> None:
    media_type = (value or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise TransportError(415, f"Content-Type must be application/json, got {value or 'none'!r}")


async def read_body(
    content_length: str | None, receive: Callable[[], Awaitable[Mapping[str, Any]]], limit: int
) -> bytes:
    """Reads the ASGI request body, at most `limit` bytes: a declared or actual larger body is refused
    before it is buffered."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise TransportError(400, f"Content-Length {content_length!r} is not a number") from None
        if declared > limit:
            raise TransportError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise TransportError(400, "the client disconnected before the body was complete")
        body += message.get("body", b"")
        if len(body) > limit:
            raise TransportError(413, f"request body exceeds the limit of {limit} bytes")
        if not message.get("more_body", False):
            return bytes(body)


def _describe(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    if any(err["type"] == "json_invalid" for err in errors):
        return "malformed JSON: " + next(err["msg"] for err in errors if err["type"] == "json_invalid")
    shown = "; ".join(
        f"{'.'.join(str(part) for part in err['loc']) or '(top level)'}: {err['msg']}"
        for err in errors[:_MAX_ERRORS_SHOWN]
    )
    more = len(errors) - _MAX_ERRORS_SHOWN
    return f"not an admission.k8s.io/v1 AdmissionReview: {shown}" + (f" (and {more} more)" if more > 0 else "")


_METADATA_STRINGS = ("name", "namespace", "generateName", "uid", "resourceVersion")
_METADATA_STRING_MAPS = ("labels", "annotations")


def _metadata_problem(metadata: Any) -> str | None:
    """The metadata fields the rules read must have their Kubernetes types: a value of another type
    would be read as absent, and a claim's Retain annotation or finalizers would slip past the rules."""
    if not isinstance(metadata, Mapping):
        return "metadata is not an object"
    for field in _METADATA_STRINGS:
        if field in metadata and not isinstance(metadata[field], str):
            return f"metadata.{field} is not a string"
    for field in _METADATA_STRING_MAPS:
        value = metadata.get(field)
        if value is not None and not (isinstance(value, Mapping) and all(isinstance(v, str) for v in value.values())):
            return f"metadata.{field} is not a map of strings"
    finalizers = metadata.get("finalizers")
    if finalizers is not None and not (isinstance(finalizers, list) and all(isinstance(f, str) for f in finalizers)):
        return "metadata.finalizers is not a list of strings"
    owners = metadata.get("ownerReferences")
    if owners is not None and not (isinstance(owners, list) and all(isinstance(o, Mapping) for o in owners)):
        return "metadata.ownerReferences is not a list of objects"
    return None


def _typed(obj: dict[str, Any], request: AdmissionRequest, field: str) -> dict[str, Any]:
    """`obj` with apiVersion/kind of the request's kind (the API server sends the object in that
    version); refuses an object that claims another type."""
    api_version, kind = request.kind.api_version, request.kind.kind
    if obj.get("apiVersion", api_version) != api_version or obj.get("kind", kind) != kind:
        raise TransportError(
            400,
            f"request.{field} is {obj.get('apiVersion')!r} {obj.get('kind')!r} but request.kind is "
            f"{api_version!r} {kind!r}",
        )
    if "metadata" in obj:
        problem = _metadata_problem(obj["metadata"])
        if problem:
            raise TransportError(400, f"request.{field}: {problem}")
    if "apiVersion" in obj and "kind" in obj:
        return obj
    return {"apiVersion": api_version, "kind": kind, **obj}


def decode(body: bytes) -> AdmissionRequest:
    try:
        review = AdmissionReview.model_validate_json(body)
    except ValidationError as exc:
        raise TransportError(400, _describe(exc)) from None
    request = review.request
    if request.operation in ("CREATE", "UPDATE") and request.object is None:
        raise TransportError(400, f"{request.operation} request {request.uid} has no request.object")
    if request.operation in ("UPDATE", "DELETE") and request.old_object is None:
        raise TransportError(400, f"{request.operation} request {request.uid} has no request.oldObject")
    update: dict[str, Any] = {}
    for field, alias in (("object", "object"), ("old_object", "oldObject")):
        value = getattr(request, field)
        if value is not None:
            typed = _typed(value, request, alias)
            if typed is not value:
                update[field] = typed
    return request.model_copy(update=update) if update else request


def encode(response: AdmissionResponse) -> bytes:
    return json.dumps(response.to_review(), separators=(",", ":")).encode()


def encode_error(error: TransportError) -> bytes:
    """The body of a 4xx answer: an AdmissionReview that refuses, so that even a client that ignored
    the HTTP status could not read an allow out of it."""
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": "",
                "allowed": False,
                "status": {"code": error.status, "message": error.message},
            },
        },
        separators=(",", ":"),
    ).encode()
