"""Decoding and encoding AdmissionReviews over HTTP; no policy here (handlers.py decides).

Every malformed request is refused with an HTTP 4xx and a message, which the API server treats as
a failed call (failurePolicy: Fail rejects the object): never an allow.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qs

from pydantic import ValidationError
from pydantic_core import from_json

from . import deepjson
from .review import ADMISSION_REVIEW, API_VERSION, KIND, AdmissionRequest, AdmissionResponse, compact_json

_MAX_ERRORS_SHOWN = 3


class TransportError(Exception):
    """A request the webhook cannot decode; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_DURATION = re.compile(r"(?:(\d+)m)?(\d+(?:\.\d+)?)(ms|s)")


def request_timeout(query_string: bytes) -> float | None:
    """Seconds the API server waits for the answer: it passes the webhook's timeoutSeconds as the `timeout` query
    parameter, a Go duration (`5s`, `1m0s`, `500ms`); None when absent or unreadable."""
    for value in parse_qs(query_string.decode("latin-1")).get("timeout", []):
        match = _DURATION.fullmatch(value)
        if match:
            minutes, amount, unit = match.groups()
            return int(minutes or 0) * 60 + float(amount) / (1000 if unit == "ms" else 1)
    return None


def check_content_type(value: bytes | None) -> None:
    """`value` is the raw header, as ASGI passes it."""
    if value == b"application/json":  # what the API server sends: nothing to parse
        return
    text = value.decode("latin-1") if value is not None else ""
    media_type = text.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise TransportError(415, f"Content-Type must be application/json, got {text or 'none'!r}")


async def read_body(
    content_length: bytes | None, receive: Callable[[], Awaitable[Mapping[str, Any]]], limit: int
) -> bytes:
    """Reads the ASGI request body, at most `limit` bytes: a declared or actual larger body is refused
    before it is buffered. `content_length` is the raw header."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            shown = content_length.decode("latin-1")
            raise TransportError(400, f"Content-Length {shown!r} is not a number") from None
        if declared > limit:
            raise TransportError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise TransportError(400, "the client disconnected before the body was complete")
        chunk = message.get("body", b"")
        if len(body) + len(chunk) > limit:
            raise TransportError(413, f"request body exceeds the limit of {limit} bytes")
        if not message.get("more_body", False):
            # The usual case, a body in one message, is returned as it came, without a copy.
            return bytes(body + chunk) if body else chunk
        body += chunk


def _describe(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    shown = "; ".join(
        f"{'.'.join(str(part) for part in err['loc']) or '(top level)'}: {err['msg']}"
        for err in errors[:_MAX_ERRORS_SHOWN]
    )
    more = len(errors) - _MAX_ERRORS_SHOWN
    return f"not an admission.k8s.io/v1 AdmissionReview: {shown}" + (f" (and {more} more)" if more > 0 else "")


_METADATA_STRINGS = ("name", "namespace", "generateName", "uid", "resourceVersion")
_METADATA_STRING_MAPS = ("labels", "annotations")


def _all_of(values: Any, kind: type) -> bool:
    # A plain loop: all() over a generator costs twice as much, and this runs on every request.
    for value in values:  # noqa: SIM110
        if not isinstance(value, kind):
            return False
    return True


def _metadata_problem(metadata: Any) -> str | None:
    """The metadata fields the rules read must have their Kubernetes types: a value of another type
    would be read as absent, and a claim's Retain annotation or finalizers would slip past the rules."""
    if not isinstance(metadata, dict):
        return "metadata is not an object"
    for field in _METADATA_STRINGS:
        if field in metadata and not isinstance(metadata[field], str):
            return f"metadata.{field} is not a string"
    for field in _METADATA_STRING_MAPS:
        value = metadata.get(field)
        if value is not None and not (isinstance(value, dict) and _all_of(value.values(), str)):
            return f"metadata.{field} is not a map of strings"
    finalizers = metadata.get("finalizers")
    if finalizers is not None and not (isinstance(finalizers, list) and _all_of(finalizers, str)):
        return "metadata.finalizers is not a list of strings"
    owners = metadata.get("ownerReferences")
    if owners is not None and not (isinstance(owners, list) and _all_of(owners, dict)):
        return "metadata.ownerReferences is not a list of objects"
    return None


def _typed(obj: dict[str, Any], api_version: str, kind: str, field: str) -> dict[str, Any]:
    """`obj` with apiVersion/kind of the request's kind (the API server sends the object in that
    version); refuses an object that claims another type."""
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
    """Parses with pydantic-core's JSON parser straight into Python objects, then validates the
    envelope in Python mode: validating the whole document in JSON mode builds the object twice
    (once as JSON values, once as Python), which cost more than the policy itself."""
    try:
        document = from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        if "recursion limit exceeded" not in str(exc):
            raise TransportError(400, f"malformed JSON: {exc}") from None
        # Legal, only deeper than pydantic-core parses (opaque driver parameters): the slower decoder.
        try:
            document = deepjson.loads(body)
        except deepjson.DeepJSONError as deep:
            raise TransportError(400, f"malformed JSON: {deep}") from None
    try:
        request = ADMISSION_REVIEW.validate_python(document)["request"]
    except ValidationError as exc:
        raise TransportError(400, _describe(exc)) from None
    if request.operation in ("CREATE", "UPDATE") and request.object is None:
        raise TransportError(400, f"{request.operation} request {request.uid} has no request.object")
    if request.operation in ("UPDATE", "DELETE") and request.old_object is None:
        raise TransportError(400, f"{request.operation} request {request.uid} has no request.oldObject")
    api_version, kind = request.api_version, request.kind_name
    obj, old = request.object, request.old_object
    typed_obj = _typed(obj, api_version, kind, "object") if obj is not None else None
    typed_old = _typed(old, api_version, kind, "oldObject") if old is not None else None
    if typed_obj is obj and typed_old is old:
        return request
    return request.model_copy(update={"object": typed_obj, "old_object": typed_old})


_ALLOWED_HEAD = f'{{"apiVersion":"{API_VERSION}","kind":"{KIND}","response":{{"uid":'.encode()
_ALLOWED_TAIL = b',"allowed":true}}'


def encode(response: AdmissionResponse) -> bytes:
    if response.allowed and response.patch is None and not response.warnings and response.status is None:
        # The plain allow, most answers: the constant parts are encoded once.
        return b"".join((_ALLOWED_HEAD, compact_json(response.uid).encode(), _ALLOWED_TAIL))
    return compact_json(response.to_review()).encode()


def encode_error(error: TransportError) -> bytes:
    """The body of a 4xx answer: an AdmissionReview that refuses, so that even a client that ignored
    the HTTP status could not read an allow out of it."""
    return compact_json(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "response": {
                "uid": "",
                "allowed": False,
                "status": {"code": error.status, "message": error.message},
            },
        }
    ).encode()
