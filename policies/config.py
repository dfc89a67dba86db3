"""The policy configuration: one YAML file, validated by pydantic, refused whole when any field is wrong."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import names
from .attestation import load_public_key
from .rules_meta import RULES

Action = Literal["deny", "warn", "audit", "off"]

DEFAULT_POLICY_PATH = Path(__file__).with_name("default.yaml")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


class PolicyError(ValueError):
    """A policy file that cannot be used; the message names the file, the field path and the reason."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Tenancy(_Model):
    label: str = names.TENANCY_LABEL
    trusted_value: str = Field(names.TENANCY_TRUSTED, alias="trustedValue")
    trusted_namespaces: tuple[str, ...] = Field((), alias="trustedNamespaces")


class GracePeriod(_Model):
    # 30 s is also what the API server sets where a pod spec has none, before any webhook sees it.
    minimum_seconds: int = Field(30, alias="minimumSeconds", ge=0)
    # What `scrubgate check --fix` writes into a manifest that has none; nothing sets it at admission.
    default_seconds: int = Field(60, alias="defaultSeconds", ge=1)
    maximum_seconds: int = Field(3600, alias="maximumSeconds", ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> GracePeriod:
        if not self.minimum_seconds <= self.default_seconds <= self.maximum_seconds:
            raise ValueError("needs minimumSeconds <= defaultSeconds <= maximumSeconds")
        return self


class RuleSettings(_Model):
    action: Action

    @field_validator("action", mode="before")
    @classmethod
    def _unquoted_off(cls, value: object) -> object:
        # YAML 1.1 reads an unquoted `off` as false; that is what the user meant.
        return "off" if value is False else value


class Agent(_Model):
    identities: tuple[str, ...] = (f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.AGENT_SERVICE_ACCOUNT}",)
    # An agent's writes count only for its own node's claims and fences: the node its credentials are bound to
    # (userInfo.extra authentication.kubernetes.io/node-name, in a DaemonSet pod's projected token since
    # Kubernetes 1.32), as the Node authorizer binds a kubelet to its node.
    node_binding: bool = Field(True, alias="nodeBinding")


class Scheduler(_Model):
    # Its deallocations undo an allocation of its own that no pod used (rules._scheduler_may_clear says when).
    identities: tuple[str, ...] = ("system:kube-scheduler",)


class Controller(_Model):
    # `scrubgate controller`: labels claims allocated while no agent saw them with their node (names.LABEL_NODE),
    # which only it and the node's own agent may set, change or remove (policies/node_label.py).
    identities: tuple[str, ...] = (
        f"system:serviceaccount:{names.SYSTEM_NAMESPACE}:{names.CONTROLLER_SERVICE_ACCOUNT}",
    )


class ScrubCoverage(_Model):
    """What an attestation must show of each GPU's memory before SG007 takes the device as clean: every byte
    accounted for (scrubbed, the driver's reserve, or unreached) and at most this much unreached (the scrub's
    own CUDA context), as a share of the usable memory and in bytes, whichever is less (the agent's defaults)."""

    max_unreachable_percent: float = Field(2.0, alias="maxUnreachablePercent", ge=0, le=100)
    max_unreachable_bytes: int = Field(1 << 30, alias="maxUnreachableBytes", ge=0)


ED25519_PEM_PATTERN = (
    r"^\s*-----BEGIN PUBLIC KEY-----\s*MCowBQYDK2VwAyEA[A-Za-z0-9+/]{43}=\s*-----END PUBLIC KEY-----\s*$"
)


class AttestationKey(_Model):
    kid: str = Field(min_length=1)
    # Ed25519 SubjectPublicKeyInfo PEM: its DER always starts with the same 12 bytes (MCowBQYDK2VwAyEA in
    # base64); the pattern lets `helm install` refuse another key type or a damaged key, as the webhook does.
    public_key: str = Field(alias="publicKey", json_schema_extra={"pattern": ED25519_PEM_PATTERN})

    @field_validator("public_key")
    @classmethod
    def _is_ed25519(cls, pem: str) -> str:
        load_public_key(pem)
        return pem


class PolicyConfig(_Model):
    api_version: Literal["scrubgate.dev/v1"] = Field("scrubgate.dev/v1", alias="apiVersion")
    kind: Literal["PolicyConfig"] = "PolicyConfig"
    # Classes always guarded, whatever their selectors prove (globs). A class is guarded anyway unless its selectors
    # prove it hands out no GPU (policies/scope.py): a name here can only add to that, never take away.
    gpu_device_classes: tuple[str, ...] = Field(
        ("gpu.nvidia.com", "mig.nvidia.com", "*.gpu.nvidia.com"), alias="gpuDeviceClasses"
    )
    # Classes left out of every guard, whose claims never wait on the webhook: devices no agent scrubs (IMEX
    # channels of ComputeDomains, a GPU bound to vfio-pci), and other vendors' classes. A guard on them would never
    # be lifted. Each must prove by its selectors that it hands out no `gpu` or `mig` device of a GPU driver (SG009
    # refuses it otherwise, and the webhook guards its claims). Exact names: a glob could take any class out.
    exclude_device_classes: tuple[str, ...] = Field(
        (
            "compute-domain-daemon.nvidia.com",
            "compute-domain-default-channel.nvidia.com",
            "imex.nvidia.com",
            "vfio.gpu.nvidia.com",
        ),
        alias="excludeDeviceClasses",
        # DeviceClass names (DNS subdomains): helm install refuses globs too, and the chart writes them into CEL.
        json_schema_extra={"items": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}},
    )
    # Drivers whose allocated devices the agent scrubs: a claim holding one is a GPU claim whatever its class.
    gpu_drivers: tuple[str, ...] = Field(("gpu.nvidia.com",), alias="gpuDrivers")
    # Extended resource names (KEP-5004) that stand for GPUs; `deviceclass.resource.kubernetes.io/<class>` is
    # one whenever <class> is a GPU class.
    gpu_extended_resources: tuple[str, ...] = Field(
        ("nvidia.com/gpu", "nvidia.com/mig-*"), alias="gpuExtendedResources"
    )
    tenancy: Tenancy = Tenancy()
    grace_period: GracePeriod = Field(GracePeriod(), alias="gracePeriod")
    # The chart's schema names the known ids too, so that `helm install` refuses a typo as the webhook would.
    rules: dict[str, RuleSettings] = Field({}, json_schema_extra={"propertyNames": {"enum": list(RULES)}})
    agent: Agent = Agent()
    scheduler: Scheduler = Scheduler()
    controller: Controller = Controller()
    admin_groups: tuple[str, ...] = Field(("system:masters",), alias="adminGroups")
    attestation_keys: tuple[AttestationKey, ...] = Field((), alias="attestationKeys")
    scrub_coverage: ScrubCoverage = Field(ScrubCoverage(), alias="scrubCoverage")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, ignored_types=(cached_property,))

    @field_validator("exclude_device_classes")
    @classmethod
    def _exact_names(cls, excluded: tuple[str, ...]) -> tuple[str, ...]:
        globs = [name for name in excluded if any(c in name for c in "*?[")]
        if globs:
            raise ValueError(
                f"{', '.join(map(repr, globs))}: a glob; name each excluded class exactly (`kubectl get "
                "deviceclasses`), since an exclusion takes every class it matches out of the scrub guard, GPU "
                "classes that happen to match it included"
            )
        invalid = [name for name in excluded if not _DNS_SUBDOMAIN.fullmatch(name)]
        if invalid:
            raise ValueError(f"{', '.join(map(repr, invalid))}: not a DeviceClass name (a DNS subdomain)")
        return excluded

    @field_validator("rules")
    @classmethod
    def _known_rules(cls, rules: dict[str, RuleSettings]) -> dict[str, RuleSettings]:
        unknown = sorted(set(rules) - set(RULES))
        if unknown:
            raise ValueError(f"unknown rule id(s) {', '.join(unknown)}; known: {', '.join(RULES)}")
        return rules

    @cached_property
    def actions(self) -> dict[str, Action]:
        """Every rule's effective action; computed once, since the webhook asks for each request."""
        return {
            rule_id: settings.action if (settings := self.rules.get(rule_id)) else meta.default_action
            for rule_id, meta in RULES.items()
        }

    def action(self, rule_id: str) -> Action:
        return self.actions[rule_id]

    @cached_property
    def _gpu_class_memo(self) -> dict[str, bool]:
        return {}

    def names_gpu_class(self, device_class: str) -> bool:
        """Whether gpuDeviceClasses names the class (a glob). Names only ever add to what is guarded: whether a
        class may hand out GPUs is decided from its selectors (policies/scope.py)."""
        # Clusters have a handful of device classes: remember each answer instead of matching globs per request.
        memo = self._gpu_class_memo
        known = memo.get(device_class)
        if known is None:
            known = _matches(device_class, self.gpu_device_classes)
            if len(memo) < 1024:
                memo[device_class] = known
        return known

    def is_excluded_class(self, device_class: str) -> bool:
        return device_class in self.exclude_device_classes

    def names_gpu_extended_resource(self, name: str) -> bool:
        """Whether gpuExtendedResources names the extended resource (a glob)."""
        return _matches(name, self.gpu_extended_resources)

    @cached_property
    def public_keys(self) -> dict[str, Ed25519PublicKey]:
        return {key.kid: load_public_key(key.public_key) for key in self.attestation_keys}

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the effective policy, recorded in audit records so a decision can be traced to its policy."""
        canonical = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def parse_policy(data: Any, source: str = "<policy>") -> PolicyConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: the policy must be a YAML mapping, not {type(data).__name__}")
    try:
        return PolicyConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{_field_path(err['loc'])}: {err['msg']}" for err in exc.errors())
        raise PolicyError(f"{source}: invalid policy: {problems}") from None


def load_policy(path: str | Path | None = None) -> PolicyConfig:
    """Loads `path`, or the shipped default policy when `path` is None."""
    path = Path(path) if path is not None else DEFAULT_POLICY_PATH
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read the policy file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise PolicyError(f"{path}{where}: the policy is not valid YAML: {exc}") from None
    return parse_policy(data, str(path))
