"""Whether a DeviceClass can hand out a GPU, decided from what its CEL selectors select, not from its name.

Each selector is evaluated (cel-expr-python: cel-cpp, the same language as the API server's cel-go) against
the devices a GPU driver publishes: for each of the policy's GPU drivers, a whole GPU and a MIG device with the
attributes NVIDIA's DRA driver gives them under the driver's domain. A class selects what every one of its
selectors selects. As in the API server, `device.attributes[<domain>]` of a domain the device does not have is
an empty map; a missing attribute is an error. A selector that does not compile here (Kubernetes' own CEL
functions, `semver()` or `quantity()`) or errors on a device, where no other selector rules that device out,
leaves the class undecided: SG009 refuses it rather than guess.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

_DOMAIN_LOOKUP = re.compile(r"""\b(?:attributes|capacity)\s*\[\s*(['"])(?P<domain>[^'"]+)\1\s*\]""")

_GPU = {"index": 0, "minor": 0, "productName": "NVIDIA H200", "brand": "Nvidia", "architecture": "Hopper"}
_UUID = "GPU-00000000-0000-4000-8000-000000000000"


def sample_devices(driver: str) -> list[tuple[str, dict[str, Any]]]:
    """(what, device) for the devices a GPU driver publishes, as CEL sees them: with no attributes (what a
    selector on the driver alone selects), a whole GPU and a MIG device with NVIDIA's attributes."""
    whole = {**_GPU, "type": "gpu", "uuid": _UUID}
    mig = {**_GPU, "type": "mig", "uuid": "MIG-00000000-0000-4000-8000-000000000000", "parentUUID": _UUID}
    mig["profile"] = "1g.18gb"
    return [
        (f"{driver} devices", {"driver": driver, "attributes": {}, "capacity": {}}),
        (f"{driver} whole GPUs", {"driver": driver, "attributes": {driver: whole}, "capacity": {driver: {}}}),
        (f"{driver} MIG devices", {"driver": driver, "attributes": {driver: mig}, "capacity": {driver: {}}}),
    ]


def domains(expression: str) -> set[str]:
    """The attribute and capacity domains an expression looks up by a literal name."""
    return {match.group("domain") for match in _DOMAIN_LOOKUP.finditer(expression)}


@dataclass(frozen=True)
class Verdict:
    outcome: Literal["selects", "undecided", "no"]
    what: str  # what it selects, or why it cannot be told
    path: str  # the selector it is about
    driver: str = ""  # the GPU driver of the devices it selects


# Kubernetes' CEL libraries a selector may call (quantity, semver and their methods): declared so that a
# selector using them compiles, with no value: on a device its other conjuncts do not rule out, the class
# stays undecided, as it should; on one they do (another driver), it is rightly not a GPU class.
_KUBERNETES_FUNCTIONS = ("quantity", "isQuantity", "semver", "isSemver")
_KUBERNETES_METHODS = (
    "compareTo", "isGreaterThan", "isLessThan", "add", "sub", "asInteger", "asApproximateFloat", "sign",
    "isInteger", "major", "minor", "patch",
)  # fmt: skip


_NO_VALUE = "a Kubernetes CEL function, which scrubgate does not evaluate"


def _no_value(*_: object) -> object:
    raise ValueError(_NO_VALUE)


@functools.cache
def _environment() -> Any:
    from cel_expr_python import cel

    dyn = cel.Type.DYN
    declarations = [
        cel.FunctionDecl(
            name,
            [
                cel.Overload(f"{name}_string", dyn, [cel.Type.STRING], impl=_no_value),
                cel.Overload(f"{name}_string_bool", dyn, [cel.Type.STRING, cel.Type.BOOL], impl=_no_value),
            ],
        )
        for name in _KUBERNETES_FUNCTIONS
    ] + [
        cel.FunctionDecl(
            name,
            [
                cel.Overload(f"dyn_{name}_{arity}", dyn, [dyn] * (arity + 1), is_member=True, impl=_no_value)
                for arity in (0, 1)
            ],
        )
        for name in _KUBERNETES_METHODS
    ]
    return cel.NewEnv(variables={"device": dyn}, functions=declarations)


@functools.lru_cache(maxsize=512)
def _program(expression: str) -> tuple[Any, str | None]:
    try:
        return _environment().compile(expression), None
    except Exception as exc:  # the compiler's message says what it does not know
        return None, str(exc).splitlines()[0]


def _evaluate(expression: str, device: dict[str, Any]) -> bool | str:
    """True or False, or why it could not be evaluated."""
    from cel_expr_python import cel

    program, problem = _program(expression)
    if program is None:
        return f"does not compile here ({problem})"
    view = {**device, "attributes": dict(device["attributes"]), "capacity": dict(device["capacity"])}
    for domain in domains(expression):
        view["attributes"].setdefault(domain, {})
        view["capacity"].setdefault(domain, {})
    value = program.eval(data={"device": view})
    if value.type() == cel.Type.BOOL:
        return bool(value.value())
    if _NO_VALUE in str(value.value()):
        return "calls a Kubernetes CEL function (quantity, semver) that scrubgate does not evaluate"
    return f"gives {value.type().name()} {value.value()}"


def gpu_verdict(selectors: Iterable[tuple[str, str]], gpu_drivers: Iterable[str]) -> Verdict:
    """Whether a class with `selectors` ((CEL expression, JSON pointer) pairs) selects a device of one of the
    `gpu_drivers`. Beyond the samples: a selector that looks up a GPU driver's own attribute domain picks among
    that driver's devices by their attributes (a model, a memory size), whose values no sample can cover."""
    selectors = list(selectors)
    drivers = list(gpu_drivers)
    if not selectors:
        return Verdict("selects", "every device of every driver (it has no selector)", "/spec", ", ".join(drivers))
    undecided: Verdict | None = None
    for driver in drivers:
        for what, device in sample_devices(driver):
            results = [(_evaluate(expression, device), path) for expression, path in selectors]
            if any(result is False for result, _ in results):
                continue
            problems = [(result, path) for result, path in results if result is not True]
            if not problems:
                return Verdict("selects", what, selectors[0][1], driver)
            undecided = undecided or Verdict("undecided", f"on {what} its selector {problems[0][0]}", problems[0][1])
    for expression, path in selectors:
        for driver in sorted(domains(expression) & set(drivers)):
            return Verdict("selects", f"{driver} devices, by their attributes", path, driver)
    return undecided or Verdict("no", "", "")
