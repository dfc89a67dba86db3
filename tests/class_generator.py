"""A seeded generator of DeviceClasses from the DRA CEL grammar: driver comparisons and `in`, `has()`, attribute
and capacity lookups through literals, through `device.driver` and through comprehensions, string extensions,
optional syntax, `allowMultipleAllocations`, `cel.bind`, `||`, `!`, `?:`, comments, every string literal form and
escape. Values come from the devices devcluster/fakenode.py publishes, so that many selectors do select something.

Each class keeps what its construction proves, on the generator's own tree (never by parsing its text): the drivers
a top-level conjunct `device.driver == "x"` / `in [...]` restricts it to, and the `type` values a top-level
conjunct on `device.attributes[<domain>].type` restricts it to (issue 28's rule). `Generated.proves` states the
verdict that rule gives; tests/test_policies_class_generator.py holds the parser to it, and
tests/test_e2e_device_classes.py holds both to what kube-scheduler allocates.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from devcluster import fakenode

OWN = "<own>"  # `device.attributes[device.driver]`
MEMORY_TYPES = frozenset({"gpu", "mig"})
DECOY_DRIVERS = ("gpu.nvidia.co", "GPU.nvidia.com", "nvidia.com", "gpu.nvidia.com.", "tpu.google.com")
TYPES = ("gpu", "mig", "vfio", "channel", "daemon", "imex-channel", "device")
EXTENDED_RESOURCES = ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "example.com/accel", "example.com/nic")
VERSIONS = ("v1", "v1", "v1", "v1beta2", "v1beta1")


# ---------------------------------------------------------------- the generator's tree


@dataclass(frozen=True)
class Expr:
    """`op`: "atom", "&&", "||", "!" or "?:". An atom may prove the device's driver (`drivers`) or its type in a
    domain (`types`); that counts only where the atom is a top-level conjunct."""

    text: str
    op: str = "atom"
    parts: tuple[Expr, ...] = ()
    drivers: frozenset[str] | None = None
    types: tuple[str, frozenset[str]] | None = None


def _wrapped(expr: Expr) -> str:
    return expr.text if expr.op == "atom" else f"({expr.text})"


def both(parts: list[Expr], joiner: str = " && ") -> Expr:
    return Expr(joiner.join(_wrapped(p) for p in parts), "&&", tuple(parts))


def either(left: Expr, right: Expr) -> Expr:
    return Expr(f"{_wrapped(left)} || {_wrapped(right)}", "||", (left, right))


def negated(operand: Expr) -> Expr:
    return Expr(f"!({operand.text})", "!", (operand,))


def choice(test: Expr, then: Expr, otherwise: Expr) -> Expr:
    return Expr(f"{_wrapped(test)} ? {_wrapped(then)} : {_wrapped(otherwise)}", "?:", (test, then, otherwise))


def top_conjuncts(expr: Expr) -> list[Expr]:
    if expr.op == "&&":
        return [c for part in expr.parts for c in top_conjuncts(part)]
    return [expr]


# ---------------------------------------------------------------- what the devices carry


def _catalog() -> tuple[dict[str, dict[str, list[tuple[str, Any]]]], dict[str, dict[str, list[str]]]]:
    """domain -> attribute -> [(kind, value)], and domain -> capacity -> [quantity], over every shape."""
    attributes: dict[str, dict[str, list[tuple[str, Any]]]] = {}
    capacities: dict[str, dict[str, list[str]]] = {}
    for shape in fakenode.SHAPES:
        for name, value in shape.entry["attributes"].items():
            domain, _, ident = name.rpartition("/")
            ((kind, raw),) = value.items()
            attributes.setdefault(domain or shape.driver, {}).setdefault(ident, []).append((kind, raw))
        for name, value in (shape.entry.get("capacity") or {}).items():
            domain, _, ident = name.rpartition("/")
            capacities.setdefault(domain or shape.driver, {}).setdefault(ident, []).append(value["value"])
    return attributes, capacities


ATTRIBUTES, CAPACITIES = _catalog()
DRIVERS = tuple(sorted({shape.driver for shape in fakenode.SHAPES}))


# ---------------------------------------------------------------- literals


def string(rng: random.Random, value: str) -> str:
    """A CEL string literal whose value is `value`, in one of CEL's spellings."""
    plain = value.replace("\\", "\\\\")
    roll = rng.random()
    if roll < 0.1 and "'" not in value:
        return f"'''{plain}'''" if rng.random() < 0.5 else f'"""{plain.replace(chr(34), chr(92) + chr(34))}"""'
    if roll < 0.2 and '"' not in value and "\\" not in value:
        return f'{rng.choice("rR")}"{value}"'
    if roll < 0.4 and value:
        at = rng.randrange(len(value))
        code = ord(value[at])
        forms = [f"\\u{code:04x}", f"\\U{code:08X}"]
        if code < 256:
            forms += [f"\\x{code:02x}", f"\\X{code:02X}", f"\\{code:03o}"]
        escaped = value[:at].replace("\\", "\\\\") + rng.choice(forms) + value[at + 1 :].replace("\\", "\\\\")
        return f'"{escaped.replace(chr(34), chr(92) + chr(34))}"'
    if "'" not in value and rng.random() < 0.5:
        return f"'{plain}'"
    return f'"{plain.replace(chr(34), chr(92) + chr(34))}"'


def driver_value(rng: random.Random, bias: str | None = None) -> str:
    if bias is not None and rng.random() < 0.6:
        return bias
    return rng.choice(DRIVERS) if rng.random() < 0.8 else rng.choice(DECOY_DRIVERS)


def value_of(rng: random.Random, kind: str, values: list[Any]) -> str:
    """A literal of `kind` (string, int, bool, version): usually one a device has, sometimes another."""
    real = rng.choice(values)
    if kind == "string":
        return string(rng, real if rng.random() < 0.85 else real + "x")
    if kind == "int":
        return str(real if rng.random() < 0.85 else real + 1)
    if kind == "bool":
        return "true" if (real if rng.random() < 0.85 else not real) else "false"
    return f"semver({string(rng, real)})"


# ---------------------------------------------------------------- atoms


def driver_proof(rng: random.Random, drivers: list[str]) -> Expr:
    """`device.driver == "x"` (either side) or `device.driver in [...]`: proves the driver is one of `drivers`."""
    if len(drivers) == 1 and rng.random() < 0.7:
        literal = string(rng, drivers[0])
        text = f"device.driver == {literal}" if rng.random() < 0.7 else f"{literal} == device.driver"
        return Expr(text, drivers=frozenset(drivers))
    return Expr(f"device.driver in [{', '.join(string(rng, d) for d in drivers)}]", drivers=frozenset(drivers))


def raw_decoy() -> Expr:
    """A raw string keeps its backslash: this driver is `gpu\\x2envidia.com`, which no device has."""
    return Expr('device.driver == r"gpu\\x2envidia.com"', drivers=frozenset({"gpu\\x2envidia.com"}))


def type_proof(rng: random.Random, driver: str, types: list[str]) -> Expr:
    """`device.attributes[<driver or device.driver>].type == "t"` or `["type"] in [...]`."""
    own = rng.random() < 0.4
    holder = "device.attributes[device.driver]" if own else f"device.attributes[{string(rng, driver)}]"
    subject = f"{holder}.type" if rng.random() < 0.6 else f'{holder}["type"]'
    if len(types) == 1 and rng.random() < 0.7:
        text = f"{subject} == {string(rng, types[0])}"
    else:
        text = f"{subject} in [{', '.join(string(rng, t) for t in types)}]"
    return Expr(text, types=(OWN if own else driver, frozenset(types)))


def _domain(rng: random.Random, target: str | None) -> tuple[str, str]:
    """(the text of a domain, the domain it reads): a literal, or `device.driver` (the device's own)."""
    domain = target if target in ATTRIBUTES and rng.random() < 0.7 else rng.choice(sorted(ATTRIBUTES))
    if domain in DRIVERS and rng.random() < 0.3:
        return "device.driver", domain
    return string(rng, domain), domain


def _lookup(rng: random.Random, holder: str, ident: str) -> str:
    return f"{holder}.{ident}" if rng.random() < 0.75 else f"{holder}[{string(rng, ident)}]"


def attribute_atom(rng: random.Random, target: str | None) -> Expr:
    text_domain, domain = _domain(rng, target)
    ident = rng.choice(sorted(ATTRIBUTES[domain]))
    kind, _ = ATTRIBUTES[domain][ident][0]
    values = [v for _, v in ATTRIBUTES[domain][ident]]
    holder = f"device.attributes[{text_domain}]"
    roll = rng.random()
    if roll < 0.15:
        return Expr(
            rng.choice(
                [
                    f"has({holder}.{ident})",
                    f"{holder}.?{ident}.hasValue()",
                    f"device.attributes[?{text_domain}].?{ident}.hasValue()",
                    f"{string(rng, ident)} in {holder}",
                    f"{text_domain} in device.attributes",
                ]
            )
        )
    if roll < 0.25 and kind != "version":  # comparing an optional's version exceeds the cost limit
        default = value_of(rng, kind, values)
        return Expr(f"{holder}.?{ident}.orValue({default}) == {value_of(rng, kind, values)}")
    if roll < 0.32:
        return Expr(f"cel.bind(a, {holder}, a.{ident} == {value_of(rng, kind, values)})")
    if ident == "type" and rng.random() < 0.5:  # `==` or `in` on a type is a proof, as it is written
        return type_proof(rng, domain, rng.sample(TYPES, rng.randint(1, 2)))
    subject = _lookup(rng, holder, ident)
    if kind == "string":
        real = rng.choice(values)
        head = real[: rng.randint(1, max(1, len(real)))]
        equal = (
            []
            if ident == "type"
            else [
                f"{subject} == {value_of(rng, kind, values)}",
                f"{subject} in [{value_of(rng, kind, values)}, {value_of(rng, kind, values)}]",
            ]
        )
        return Expr(
            rng.choice(
                [
                    *equal,
                    f"{subject} != {value_of(rng, kind, values)}",
                    f"{subject}.startsWith({string(rng, head)})",
                    f"{subject}.endsWith({string(rng, real[-3:])})",
                    f"{subject}.lowerAscii().contains({string(rng, head.lower())})",
                    f"{subject}.upperAscii() == {string(rng, real.upper())}",
                    f"{subject}.matches({string(rng, '^' + re.split(r'[^A-Za-z0-9 ]', head)[0])})",
                    f"{subject}.split(' ').size() > 2",
                    f"{subject}.substring(0, {len(head)}) == {string(rng, head)}",
                    f"{subject}.indexOf({string(rng, head[:1])}) >= 0",
                    f"{subject}.size() > {rng.randint(0, 12)}",
                    f"[{string(rng, head)}, {string(rng, 'NVIDIA A')}].exists(p, {subject}.startsWith(p))",
                ]
            )
        )
    if kind == "int":
        return Expr(f"{subject} {rng.choice(['==', '>=', '<', '!='])} {value_of(rng, kind, values)}")
    if kind == "bool":
        return Expr(rng.choice([subject, f"{subject} == {value_of(rng, kind, values)}", f"!{subject}"]))
    return Expr(
        rng.choice(
            [
                f"{subject}.isGreaterThan({value_of(rng, kind, values)})",
                f"{subject}.compareTo({value_of(rng, kind, values)}) >= 0",
                f"{subject}.isLessThan(semver('100.0.0'))",
                f"{subject}.major() >= 9",
            ]
        )
    )


def capacity_atom(rng: random.Random, target: str | None) -> Expr:
    domain = target if target in CAPACITIES and rng.random() < 0.7 else rng.choice(sorted(CAPACITIES))
    text_domain = "device.driver" if rng.random() < 0.3 else string(rng, domain)
    ident = rng.choice(sorted(CAPACITIES[domain]))
    holder = f"device.capacity[{text_domain}]"
    threshold = string(rng, rng.choice([*CAPACITIES[domain][ident], "1Gi", "40Gi", "100Gi"]))
    return Expr(
        rng.choice(
            [
                f"{_lookup(rng, holder, ident)}.compareTo(quantity({threshold})) >= 0",
                f"{holder}.{ident}.isGreaterThan(quantity({threshold}))",
                f"{holder}.{ident}.isLessThan(quantity({threshold}))",
                f"has({holder}.{ident})",
                f"{holder}.?{ident}.hasValue()",
            ]
        )
    )


def comprehension_atom(rng: random.Random, target: str | None) -> Expr:
    domain = target if target in ATTRIBUTES and rng.random() < 0.7 else rng.choice(sorted(ATTRIBUTES))
    ident = rng.choice(sorted(ATTRIBUTES[domain]))
    lit = string(rng, domain)
    return Expr(
        rng.choice(
            [
                f"device.attributes.exists(d, d == {lit})",
                f"device.attributes.exists(d, has(device.attributes[d].{ident}))",
                f"device.attributes.all(d, d != {lit})",
                f"device.attributes.exists_one(d, d.endsWith({string(rng, domain[-4:])}))",
                f"device.attributes.exists(d, v, has(v.{ident}))",
                f"device.attributes.filter(d, d.startsWith({string(rng, domain[:3])})).size() > 0",
                f"device.attributes.map(d, d).exists(d, d == {lit})",
                f"device.attributes.transformList(d, v, d).exists(x, x == {lit})",
                f"device.attributes[{lit}].exists(k, k == {string(rng, ident)})",
                f"device.attributes[device.driver].all(k, k != {string(rng, ident)})",
                "device.capacity.exists(d, has(device.capacity[d].memory))",
            ]
        )
    )


def driver_atom(rng: random.Random, target: str | None) -> Expr:
    """About the driver, but not a proof of it (however much it looks like one)."""
    driver = driver_value(rng, target)
    lit = string(rng, driver)
    return Expr(
        rng.choice(
            [
                f"device.driver != {lit}",
                f"device.driver.startsWith({string(rng, driver[:4])})",
                f"device.driver.endsWith({string(rng, driver[-4:])})",
                f"device.driver.contains({string(rng, driver.split('.')[0])})",
                f"device.driver.matches({string(rng, '^' + driver.split('.')[0])})",
                f"device.driver.lowerAscii() == {string(rng, driver.lower())}",
                f"device.driver.split('.')[0] == {string(rng, driver.split('.')[0])}",
                "device.driver in device.attributes",
                f"[{lit}, {string(rng, driver_value(rng))}].exists(x, x == device.driver)",
                f"device.?driver.orValue('') == {lit}",
                f"cel.bind(x, device.driver, x == {lit})",
                f"{{{lit}: true}}[?device.driver].orValue(false)",
                f"device.driver in {{{lit}: 1}}",
                f"device.driver + '' == {lit}",
                f"(device.driver == {lit}) == true",
            ]
        )
    )


def other_atom(rng: random.Random) -> Expr:
    return Expr(
        rng.choice(
            [
                "device.allowMultipleAllocations",
                "!device.allowMultipleAllocations",
                "has(device.allowMultipleAllocations)",
                "device.allowMultipleAllocations == true",
                "device.?allowMultipleAllocations.orValue(false)",
                "true",
                "1 == 1",
                "size('ab') == 2",
            ]
        )
    )


def atom(rng: random.Random, target: str | None) -> Expr:
    kind = rng.choices(
        (attribute_atom, capacity_atom, comprehension_atom, driver_atom, None), weights=(45, 12, 13, 18, 12)
    )[0]
    return other_atom(rng) if kind is None else kind(rng, target)


def proof_like(rng: random.Random, target: str | None) -> Expr:
    """A proof-shaped atom, for places where it proves nothing (under `||`, `!`, `?:`)."""
    if rng.random() < 0.5:
        return driver_proof(rng, [driver_value(rng, target)])
    return type_proof(rng, driver_value(rng, target), [rng.choice(TYPES)])


def filter_expr(rng: random.Random, target: str | None, depth: int = 0) -> Expr:
    roll = rng.random() if depth < 2 else 1.0

    def part() -> Expr:
        return proof_like(rng, target) if rng.random() < 0.35 else filter_expr(rng, target, depth + 1)

    if roll < 0.12:
        return either(part(), part())
    if roll < 0.18:
        return negated(part())
    if roll < 0.23:
        return choice(part(), filter_expr(rng, target, depth + 1), filter_expr(rng, target, depth + 1))
    if roll < 0.30:  # parenthesised, yet still a top-level conjunct where it stands in the top-level chain
        return both([part(), filter_expr(rng, target, depth + 1)])
    return atom(rng, target)


# ---------------------------------------------------------------- classes


@dataclass(frozen=True)
class Generated:
    name: str
    version: str
    selectors: tuple[Expr, ...]
    extended_resource: str | None = None
    excluded: bool = False  # named in the test policy's excludeDeviceClasses
    plan: str = ""

    def obj(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"selectors": [{"cel": {"expression": s.text}} for s in self.selectors]}
        if self.extended_resource:
            spec["extendedResourceName"] = self.extended_resource
        return {
            "apiVersion": f"resource.k8s.io/{self.version}",
            "kind": "DeviceClass",
            "metadata": {"name": self.name},
            "spec": spec,
        }

    def proves(self, gpu_drivers: Iterable[str]) -> tuple[bool, bool]:
        """(may hand out a device of a GPU driver, may hand out a `gpu` or `mig` one), by the construction."""
        return proven(self.selectors, gpu_drivers)


def proven(selectors: Iterable[Expr], gpu_drivers: Iterable[str]) -> tuple[bool, bool]:
    drivers: frozenset[str] | None = None
    types: dict[str, frozenset[str]] = {}
    for conjunct in (c for s in selectors for c in top_conjuncts(s)):
        if conjunct.drivers is not None:
            drivers = conjunct.drivers if drivers is None else drivers & conjunct.drivers
        if conjunct.types is not None:
            domain, allowed = conjunct.types
            types[domain] = types[domain] & allowed if domain in types else allowed
    gpu = frozenset(gpu_drivers) if drivers is None else drivers & frozenset(gpu_drivers)

    def may_hold_memory(driver: str) -> bool:
        known = [types[d] for d in (driver, OWN) if d in types]
        return not known or bool(frozenset.intersection(*known) & MEMORY_TYPES)

    return bool(gpu), any(may_hold_memory(d) for d in gpu)


def _decorated(rng: random.Random, conjuncts: list[Expr]) -> Expr:
    """The top-level chain, sometimes nested in parentheses, split over lines, or commented."""
    if len(conjuncts) > 2 and rng.random() < 0.3:
        cut = rng.randint(1, len(conjuncts) - 1)
        conjuncts = [both(conjuncts[:cut]), both(conjuncts[cut:])]
    if len(conjuncts) == 1:
        return conjuncts[0]
    roll = rng.random()
    if roll < 0.1:
        joiner = " // && device.driver == 'dra.net'\n  && "
    elif roll < 0.3:
        joiner = "\n  && "
    else:
        joiner = " && "
    return both(conjuncts, joiner)


def _plan(rng: random.Random, excluded: bool) -> tuple[str, list[Expr], str | None]:
    """(plan, proofs, the domain its filters aim at)."""
    roll = rng.random()
    if excluded:  # most prove they hand out no GPU memory (by their driver or type); a few prove nothing
        roll = rng.choice([0.1, 0.1, 0.4, 0.9])
    if roll < 0.35:
        driver = driver_value(rng)
        if rng.random() < 0.05:
            return "vendor", [raw_decoy()], None
        drivers = [driver] if rng.random() < 0.8 else [driver, driver_value(rng)]
        if excluded and fakenode.NVIDIA in drivers:
            drivers = [fakenode.DRANET]
        return "vendor", [driver_proof(rng, drivers)], driver
    if roll < 0.5:
        kinds = rng.choice([["vfio"], ["mig"], ["gpu"], ["vfio", "channel"], ["imex-channel"], ["gpu", "vfio"]])
        if excluded:
            kinds = rng.choice([["vfio"], ["vfio", "channel"], ["imex-channel"]])
        drivers = [fakenode.NVIDIA] if rng.random() < 0.8 else [fakenode.NVIDIA, fakenode.COMPUTE_DOMAIN]
        return "typed", [driver_proof(rng, drivers), type_proof(rng, fakenode.NVIDIA, kinds)], fakenode.NVIDIA
    target = rng.choice([fakenode.NVIDIA, fakenode.NVIDIA, fakenode.STANDARD, fakenode.DRANET, None])
    return "free", [], target


def generate(seed: int, count: int) -> list[Generated]:
    """`count` classes; the same ones for the same seed."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        excluded = rng.random() < 0.06
        plan, proofs, target = _plan(rng, excluded)
        conjuncts = [*proofs, *(filter_expr(rng, target) for _ in range(rng.randint(0 if proofs else 1, 2)))]
        rng.shuffle(conjuncts)
        selectors = [conjuncts]
        if len(conjuncts) > 1 and rng.random() < 0.2:  # a second selector takes some of the conjuncts
            cut = rng.randint(1, len(conjuncts) - 1)
            selectors = [conjuncts[:cut], conjuncts[cut:]]
        trees = tuple(_decorated(rng, s) for s in selectors)
        if excluded:
            name = f"excluded-{index:03d}.diff.example.com"
        elif rng.random() < 0.06:
            name = f"g{index:03d}-{plan}.gpu.nvidia.com"  # a name gpuDeviceClasses matches
        else:
            name = f"g{index:03d}-{plan}.diff.example.com"
        extended = rng.choice(EXTENDED_RESOURCES) if rng.random() < 0.04 else None
        out.append(Generated(name, rng.choice(VERSIONS), trees, extended, excluded, plan))
    return out


def excluded_names(classes: Iterable[Generated]) -> list[str]:
    return [c.name for c in classes if c.excluded]
