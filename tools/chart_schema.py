"""Writes charts/scrubgate/values.schema.json. The `policy` part is the policy's own schema (pydantic's,
from scrubgate.policies.config.PolicyConfig), so that the chart refuses what `scrubgate webhook` would;
tests/test_chart.py checks that the committed file is this script's output.

    .venv/bin/python tools/chart_schema.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from scrubgate.policies.config import PolicyConfig

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "charts" / "scrubgate" / "values.schema.json"


def _object(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, **extra}


STRING = {"type": "string"}
BOOL = {"type": "boolean"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECTS = {"type": "array", "items": {"type": "object"}}
QUANTITY = {"type": ["string", "number"]}
RESOURCES = _object(
    {
        "requests": {"type": "object", "additionalProperties": QUANTITY},
        "limits": {"type": "object", "additionalProperties": QUANTITY},
    }
)
# A duration above zero, 30s, 5m, 1h or seconds (`scrubgate reports --interval`: 0 would list the whole cluster
# again and again). The pattern is RE2, as Helm's validator reads it (no lookahead); it applies to strings only,
# the minimum to numbers only.
DURATION = {
    "type": ["string", "number"],
    "pattern": r"^([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)[smh]?$",
    "exclusiveMinimum": 0,
}


def _policy() -> tuple[dict[str, Any], dict[str, Any]]:
    """The policy's schema without its $defs, and the $defs (they go to the top, where `#/$defs/` points).
    Values are merged over the shipped default, so nothing in it is required."""
    schema = PolicyConfig.model_json_schema()
    definitions = schema.pop("$defs", {})
    schema.pop("required", None)
    schema["description"] = "Merged over policies/default.yaml (maps merge, lists replace)."
    return schema, definitions


def build() -> dict[str, Any]:
    policy, definitions = _policy()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "scrubgate chart values",
        **_object(
            {
                "image": _object(
                    {"repository": STRING, "tag": STRING, "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}
                ),
                "namespace": _object({"create": BOOL, "allowShared": BOOL}),
                "podAnnotations": STRING_MAP,
                "podLabels": STRING_MAP,
                "imagePullSecrets": {"type": "array", "items": _object({"name": STRING}, required=["name"])},
                "priorityClassName": STRING,
                "policy": policy,
                "webhook": _object(
                    {
                        "deploy": BOOL,
                        "replicas": {"type": "integer", "minimum": 1},
                        "resources": RESOURCES,
                        "url": {"type": "string", "pattern": "^(https://.+)?$"},
                        "clientCA": STRING,
                        "nodeSelector": STRING_MAP,
                        "tolerations": OBJECTS,
                        "affinity": {"type": "object"},
                        "topologySpreadConstraints": OBJECTS,
                        "audit": _object(
                            {
                                "maxBytes": {"type": ["integer", "null"], "minimum": 1024},
                                "backups": {"type": ["integer", "null"], "minimum": 1},
                                "signingKeySecret": STRING,
                                "checkpointIntervalSeconds": {"type": "number", "exclusiveMinimum": 0},
                            }
                        ),
                    }
                ),
                "certs": _object(
                    {
                        "source": {"enum": ["in-cluster", "self-generated", "cert-manager", "provided"]},
                        "validityDays": {"type": "integer", "minimum": 1},
                        "provided": _object({"caBundle": STRING}),
                        "certManager": _object(
                            {
                                "issuerRef": _object(
                                    {
                                        "name": STRING,
                                        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                                        "group": STRING,
                                    }
                                )
                            }
                        ),
                    }
                ),
                "controller": _object(
                    {"deploy": BOOL, "replicas": {"type": "integer", "minimum": 1}, "resources": RESOURCES}
                ),
                "agent": _object(
                    {
                        "deploy": BOOL,
                        "runtimeClassName": STRING,
                        "gpuBackend": {"enum": ["nvml", "simulated"]},
                        "simulatedRoot": {"type": "string", "pattern": "^(/.*)?$"},
                        "nodeSelector": STRING_MAP,
                        "extraTolerations": OBJECTS,
                        "kubeletPluginsPath": {"type": "string", "pattern": "^/"},
                        "signingKeySecret": {"type": "string", "minLength": 1},
                        "resources": RESOURCES,
                    },
                    # The simulated backend keeps its GPUs' state under a directory of the node (`scrubgate agent
                    # --simulated-root`); without one the agent exits at start, again and again.
                    **{
                        "if": {"properties": {"gpuBackend": {"const": "simulated"}}, "required": ["gpuBackend"]},
                        "then": {"properties": {"simulatedRoot": {"minLength": 1}}, "required": ["simulatedRoot"]},
                    },
                ),
                "reports": _object(
                    {
                        "enabled": BOOL,
                        "interval": DURATION,
                        "api": {"enum": ["wgpolicyk8s.io", "openreports.io"]},
                        "installCRDs": BOOL,
                        "resources": RESOURCES,
                    }
                ),
                "uninstall": _object({"waitForTeardowns": BOOL, "timeoutSeconds": {"type": "integer", "minimum": 10}}),
                "metrics": _object(
                    {"enabled": BOOL, "labels": STRING_MAP, "dashboardLabels": STRING_MAP, "dashboardNamespace": STRING}
                ),
                "networkPolicy": _object(
                    {"enabled": BOOL, "apiServer": OBJECTS, "metricsNamespaceSelector": {"type": "object"}}
                ),
            }
        ),
        "$defs": definitions,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


if __name__ == "__main__":
    SCHEMA_FILE.write_text(render())
    print(f"wrote {SCHEMA_FILE}", file=sys.stderr)
