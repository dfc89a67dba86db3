"""The `admission.k8s.io/v1` AdmissionReview envelope, as the API server sends and expects it.

Strict models: a field of the wrong JSON type is a malformed request (400), never coerced into
something the rules then misread. Unknown fields are ignored so that a newer API server's
additions do not break admission.

The request side is on every admission call's path, so it is kept lean: one pydantic model, the
request; the parts around and inside it are strict TypedDicts, which pydantic validates at half the
cost of a model. The object, oldObject and options stay plain dicts: the policy core reads them
defensively, and transport.py checks the metadata fields the rules rely on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter
from scrubgate.policies import names
from typing_extensions import TypedDict  # pydantic needs this one on Python < 3.12

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"

Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]
NonEmpty = Annotated[str, StringConstraints(min_length=1)]

# On the TypedDicts as `__pydantic_config__` (pydantic.with_config needs pydantic 2.7; pyproject allows 2.6).
_STRICT = ConfigDict(strict=True, extra="ignore")

# The wire format: compact JSON. One encoder for every answer (json.dumps with separators builds a new
# JSONEncoder on each call).
compact_json = json.JSONEncoder(separators=(",", ":")).encode


class GroupVersionKind(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]

    group: NotRequired[str]
    version: NonEmpty
    kind: NonEmpty


class GroupVersionResource(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]

    group: NotRequired[str]
    version: NonEmpty
    resource: NonEmpty


class UserInfo(TypedDict, total=False):
    __pydantic_config__ = _STRICT  # type: ignore[misc]

    username: str
    uid: str
    groups: list[str]
    extra: dict[str, list[str]]


class AdmissionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=True)

    uid: str = Field(min_length=1)
    kind: GroupVersionKind
    resource: GroupVersionResource
    sub_resource: str = Field("", alias="subResource")
    request_kind: GroupVersionKind | None = Field(None, alias="requestKind")
    request_resource: GroupVersionResource | None = Field(None, alias="requestResource")
    request_sub_resource: str = Field("", alias="requestSubResource")
    name: str = ""
    namespace: str = ""
    operation: Operation
    user_info: UserInfo = Field(alias="userInfo")
    object: dict[str, Any] | None = None
    old_object: dict[str, Any] | None = Field(None, alias="oldObject")
    dry_run: bool = Field(False, alias="dryRun")
    options: dict[str, Any] | None = None

    @property
    def kind_name(self) -> str:
        """The object's kind, e.g. `Pod`."""
        return self.kind["kind"]

    @property
    def api_version(self) -> str:
        """The object's apiVersion, e.g. `resource.k8s.io/v1` (the core group has none: `v1`)."""
        group = self.kind.get("group")
        return f"{group}/{self.kind['version']}" if group else self.kind["version"]

    @property
    def username(self) -> str:
        return self.user_info.get("username", "")

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(self.user_info.get("groups", ()))

    @property
    def node(self) -> str:
        """The node the requester's credentials are bound to (a pod's projected token, or a token bound to a
        Node), as the API server puts it in the user's extra; "" when they name none."""
        return next(iter(self.user_info.get("extra", {}).get(names.NODE_NAME_EXTRA, [])), "")


class AdmissionReview(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]

    apiVersion: Literal["admission.k8s.io/v1"]
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest


# Validates a parsed AdmissionReview (transport.decode parses the JSON first).
ADMISSION_REVIEW = TypeAdapter(AdmissionReview)


@dataclass(frozen=True, slots=True)
class Status:
    """The subset of metav1.Status that admission responses use."""

    code: int
    message: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AdmissionResponse:
    """What the webhook answers. Built only by responses.py from values it controls, so a dataclass
    (no validation to pay for on every answer); transport.encode writes it out."""

    uid: str
    allowed: bool
    status: Status | None = None
    patch: str | None = None  # base64 of the JSON Patch document
    patch_type: Literal["JSONPatch"] | None = None
    warnings: tuple[str, ...] = ()

    def to_review(self) -> dict[str, Any]:
        """The AdmissionReview the API server expects back (same apiVersion and kind as the request)."""
        response: dict[str, Any] = {"uid": self.uid, "allowed": self.allowed}
        if self.status is not None:
            response["status"] = {"code": self.status.code, "message": self.status.message}
            if self.status.reason:
                response["status"]["reason"] = self.status.reason
        if self.patch is not None:
            response["patch"], response["patchType"] = self.patch, self.patch_type
        if self.warnings:
            response["warnings"] = list(self.warnings)
        return {"apiVersion": API_VERSION, "kind": KIND, "response": response}
