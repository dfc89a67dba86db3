"""The `admission.k8s.io/v1` AdmissionReview envelope, as the API server sends and expects it.

Strict models: a field of the wrong JSON type is a malformed request (400), never coerced into
something the rules then misread. Unknown fields are ignored so that a newer API server's
additions do not break admission.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"

Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=True)


class GroupVersionKind(_Model):
    group: str = ""
    version: str = Field(min_length=1)
    kind: str = Field(min_length=1)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


class GroupVersionResource(_Model):
    group: str = ""
    version: str = Field(min_length=1)
    resource: str = Field(min_length=1)


class UserInfo(_Model):
    username: str = ""
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: dict[str, tuple[str, ...]] = {}


class AdmissionRequest(_Model):
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


class AdmissionReview(_Model):
    api_version: Literal["admission.k8s.io/v1"] = Field(alias="apiVersion")
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest


class Status(BaseModel):
    """The subset of metav1.Status that admission responses use."""

    code: int
    message: str = ""
    reason: str = ""


class AdmissionResponse(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    uid: str
    allowed: bool
    status: Status | None = None
    patch: str | None = None  # base64 of the JSON Patch document
    patch_type: Literal["JSONPatch"] | None = Field(None, alias="patchType")
    warnings: tuple[str, ...] = ()

    def to_review(self) -> dict[str, Any]:
        """The AdmissionReview the API server expects back (same apiVersion and kind as the request).
        Built by hand: it is on every request's path, and model_dump costs more than the rest of encoding."""
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
