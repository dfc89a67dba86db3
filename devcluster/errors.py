"""API errors as the API server reports them: ``Status`` objects with code, reason and message."""

from __future__ import annotations

from .resources import ResourceType


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict:
        out = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            out["details"] = self.details
        return out


def _details(rt: ResourceType, name: str) -> dict:
    details = {"name": name, "kind": rt.plural}
    if rt.group:
        details["group"] = rt.group
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.group_resource} "{name}" not found', _details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{rt.group_resource} "{name}" already exists', _details(rt, name))


def conflict(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(
        409, "Conflict", f'Operation cannot be fulfilled on {rt.group_resource} "{name}": {why}', _details(rt, name)
    )


STALE = "the object has been modified; please apply your changes to the latest version and try again"


def invalid(rt: ResourceType, name: str, causes: list[tuple[str, str]]) -> ApiError:
    """422 Invalid; ``causes`` are (field path, message) pairs."""
    text = "; ".join(f"{path}: {msg}" for path, msg in causes)
    details = _details(rt, name)
    details["kind"] = rt.kind
    details["causes"] = [{"reason": "FieldValueInvalid", "message": msg, "field": path} for path, msg in causes]
    return ApiError(422, "Invalid", f'{rt.group_kind} "{name}" is invalid: {text}', details)


def forbidden(rt: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(403, "Forbidden", f'{rt.group_resource} "{name}" is forbidden: {why}', _details(rt, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def internal(message: str) -> ApiError:
    return ApiError(500, "InternalError", f"Internal error occurred: {message}", {"causes": [{"message": message}]})


def path_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})
