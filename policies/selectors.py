"""Whether a DeviceClass can hand out a GPU, proven from its parsed CEL selectors, never from its name.

A class selects a device when every one of its selectors is true for it, and a selector is true only when every
top-level conjunct of its `&&` chain is (policies/cel.py). scrubgate reads two kinds of conjunct, wherever they
stand in the chain, in any selector:

- the driver: `device.driver == "x"` (either side) or `device.driver in ["x", "y"]`;
- a device's `type` in its own driver's domain, as NVIDIA's driver publishes it (`gpu`, `mig`, `vfio`):
  `device.attributes["gpu.nvidia.com"].type == "vfio"`, `device.attributes[device.driver]["type"] in [...]`.

Nothing else counts, however it is written: a class is **able to hand out a GPU unless these conjuncts prove it
cannot** (no driver it may select is a GPU driver). That is the fail-closed direction: a class that selects a GPU
by model, by `pcieRoot`, by `allowMultipleAllocations` or by no selector at all is a GPU class; so is one whose
selector this parser cannot read. Other vendors' classes prove their driver as NVIDIA's own classes do
(`device.driver == "..." && ...`), whatever else they say.

An excluded class (the policy's `excludeDeviceClasses`: devices no agent scrubs) must prove more: that it selects
no `gpu` or `mig` device of a GPU driver, through its driver or through the type conjunct.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .cel import Binary, CelError, Ident, Index, ListLit, Lit, Node, Select, conjuncts, parse
from .findings import pointer

# The device types NVIDIA's driver publishes whose memory a tenant writes (cmd/gpu-kubelet-plugin/deviceinfo.go:
# `gpu` and `mig`; `vfio` is a GPU bound to vfio-pci, out of NVML's and CUDA's reach).
MEMORY_TYPES = frozenset({"gpu", "mig"})
_OWN_DOMAIN = "<the device's driver>"  # `device.attributes[device.driver]`


@dataclass
class _Constraints:
    drivers: frozenset[str] | None = None  # None: any driver
    types: dict[str, frozenset[str]] = field(default_factory=dict)  # domain (or _OWN_DOMAIN) -> allowed types

    def narrow_drivers(self, allowed: frozenset[str]) -> None:
        self.drivers = allowed if self.drivers is None else self.drivers & allowed

    def narrow_types(self, domain: str, allowed: frozenset[str]) -> None:
        self.types[domain] = self.types[domain] & allowed if domain in self.types else allowed

    def types_of(self, driver: str) -> frozenset[str] | None:
        """The types a device of `driver` may have, as far as the conjuncts say (None: any)."""
        found = [self.types[d] for d in (driver, _OWN_DOMAIN) if d in self.types]
        return frozenset.intersection(*found) if found else None


def _is_device(node: Node) -> bool:
    return isinstance(node, Ident) and node.name == "device"


def _is_driver(node: Node) -> bool:
    return isinstance(node, Select) and not node.optional and node.field == "driver" and _is_device(node.operand)


def _string(node: Node) -> str | None:
    return node.value if isinstance(node, Lit) and node.kind == "string" else None


def _strings(node: Node) -> frozenset[str] | None:
    """The strings of a list literal of string literals only, else None."""
    if not isinstance(node, ListLit) or any(node.optional):
        return None
    values = [_string(item) for item in node.items]
    return None if any(v is None for v in values) else frozenset(v for v in values if v is not None)


def _type_domain(node: Node) -> str | None:
    """The domain of `device.attributes[<domain>].type` (or `["type"]`): a literal, or the device's own driver."""
    named_type = (isinstance(node, Select) and node.field == "type") or (
        isinstance(node, Index) and _string(node.index) == "type"
    )
    if not named_type or not isinstance(node, Select | Index) or node.optional:
        return None
    holder = node.operand
    if not isinstance(holder, Index) or holder.optional:
        return None
    attributes = holder.operand
    if not (isinstance(attributes, Select) and attributes.field == "attributes" and not attributes.optional):
        return None
    if not _is_device(attributes.operand):
        return None
    if _is_driver(holder.index):
        return _OWN_DOMAIN
    return _string(holder.index)


def _read(conjunct: Node, found: _Constraints) -> None:
    """Narrows `found` by one top-level conjunct, where it is one of the two kinds scrubgate reads."""
    if not isinstance(conjunct, Binary) or conjunct.op not in ("==", "in"):
        return
    pairs = [(conjunct.left, conjunct.right)]
    if conjunct.op == "==":
        pairs.append((conjunct.right, conjunct.left))
    for subject, value in pairs:
        if conjunct.op == "==":
            literal = _string(value)
            allowed = None if literal is None else frozenset({literal})
        else:
            allowed = _strings(value)
        if allowed is None:
            continue
        if _is_driver(subject):
            found.narrow_drivers(allowed)
            return
        domain = _type_domain(subject)
        if domain is not None:
            found.narrow_types(domain, allowed)
            return


@dataclass(frozen=True)
class ClassVerdict:
    """What a DeviceClass may hand out, as far as its selectors prove.

    `gpu`: it may select a device of a GPU driver (not proven otherwise): its claims are guarded.
    `gpu_memory`: it may select a `gpu` or `mig` device of a GPU driver: an excluded class must not.
    `why`: for messages, what the selectors prove or why they prove nothing; `path` the field it is about."""

    gpu: bool
    gpu_memory: bool
    why: str
    path: str = "/spec/selectors"
    extended_resource: str = ""


def class_verdict(device_class: Mapping[str, Any], gpu_drivers: Iterable[str]) -> ClassVerdict:
    """The verdict on a DeviceClass object (any resource.k8s.io version: the selectors' shape is the same)."""
    spec = device_class.get("spec") if isinstance(device_class.get("spec"), dict) else {}
    raw = spec.get("selectors") if isinstance(spec, dict) else None
    extended = spec.get("extendedResourceName") if isinstance(spec, dict) else None
    extended = extended if isinstance(extended, str) else ""
    selectors = []
    for index, selector in enumerate(raw if isinstance(raw, list) else []):
        cel = selector.get("cel") if isinstance(selector, dict) else None
        expression = cel.get("expression") if isinstance(cel, dict) else None
        selectors.append((expression if isinstance(expression, str) else "", pointer("spec", "selectors", index)))
    return verdict(selectors, gpu_drivers, extended)


def verdict(selectors: Iterable[tuple[str, str]], gpu_drivers: Iterable[str], extended: str = "") -> ClassVerdict:
    """The verdict on a class with these (CEL expression, JSON pointer) selectors."""
    gpu_drivers = frozenset(gpu_drivers)
    found = _Constraints()
    unread: list[tuple[str, str]] = []
    for expression, path in selectors:
        try:
            tree = parse(expression)
        except CelError as exc:
            unread.append((path, str(exc)))
            continue
        for conjunct in conjuncts(tree):
            _read(conjunct, found)
    drivers = found.drivers
    gpu = sorted(gpu_drivers if drivers is None else drivers & gpu_drivers)
    if not gpu:
        listed = ", ".join(sorted(drivers or ())) or "no driver at all"
        return ClassVerdict(False, False, f"its selectors admit only {listed}", extended_resource=extended)
    memory = [d for d in gpu if (found.types_of(d) is None or found.types_of(d) & MEMORY_TYPES)]
    if drivers is None:
        why = 'no selector restricts device.driver (`device.driver == "..."` or `in [...]`, a top-level conjunct)'
        if unread:
            path, problem = unread[0]
            why += f"; scrubgate could not read the selector at {path}: {problem}"
    else:
        why = f"its selectors admit devices of the GPU driver {', '.join(gpu)}"
    if not memory:
        why += " of types " + ", ".join(sorted(set().union(*(found.types_of(d) or () for d in gpu)))) + " only"
    return ClassVerdict(True, bool(memory), why, extended_resource=extended)


@dataclass(frozen=True)
class DeviceClasses:
    """The DeviceClasses a decision knows (a cluster's, through the webhook's watch; a manifest set's, in CI), with
    their verdicts. A class it does not know may hand out anything: unknown is a GPU class."""

    verdicts: Mapping[str, ClassVerdict] = field(default_factory=dict)

    def may_hand_out_gpus(self, name: str) -> bool:
        known = self.verdicts.get(name)
        return known is None or known.gpu

    def by_extended_resource(self, resource: str) -> list[str]:
        return [name for name, v in self.verdicts.items() if v.extended_resource == resource]

    @classmethod
    def of(cls, objects: Iterable[Mapping[str, Any]], gpu_drivers: Iterable[str]) -> DeviceClasses:
        drivers = tuple(gpu_drivers)
        verdicts = {}
        for obj in objects:
            meta = obj.get("metadata")
            name = meta.get("name") if isinstance(meta, dict) else None
            if isinstance(name, str) and name:
                verdicts[name] = class_verdict(obj, drivers)
        return cls(verdicts)


UNKNOWN = DeviceClasses()
