"""What a rule returns: one finding per problem, with the fix as a JSON patch where it is mechanical."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .rules_meta import RULES

Decision = Literal["deny", "warn", "audit"]
# What a rule returns for each problem: (message, JSON pointer of the field, JSON patch of the fix).
Violation = tuple[str, str, tuple[dict[str, Any], ...]]


@dataclass(frozen=True, slots=True)
class Finding:
    rule: str
    action: Decision
    message: str
    # JSON pointer (RFC 6901) to the offending field, so the CLI can name its line.
    path: str = ""
    patch: tuple[dict[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return RULES[self.rule].name

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": {"id": self.rule, "name": self.name},
            "action": self.action,
            "message": self.message,
            "path": self.path,
            "patch": [dict(op) for op in self.patch],
        }


def pointer(*parts: str | int) -> str:
    """Builds a JSON pointer, escaping `~` and `/` in keys (annotation keys contain `/`)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)
