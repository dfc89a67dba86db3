"""Structured-parameters device allocation, as kube-scheduler's DRA plugin does it, for the parts
scrubgate depends on:

- a device is never allocated to two claims (``adminAccess`` requests excepted, as upstream);
- devices share counters (``sharedCounters``/``consumesCounters``): a full GPU and its MIG slices
  draw on the same memory slices, so allocating one blocks the others;
- taints from the ResourceSlice and from DeviceTaintRules (``NoSchedule``/``NoExecute``) keep a
  device from being allocated unless the request tolerates them;
- DeviceClass selectors and request selectors are CEL (``devcluster.cel``) over ``device.driver``,
  ``device.attributes["<domain>"].<name>`` and ``device.capacity``;
- ``exactly`` (``ExactCount``/``All``) and ``firstAvailable`` requests.

Not modelled: ``constraints`` (matchAttribute), capacity requests, binding conditions, node
selectors on slices other than ``nodeName``/``allNodes``, NoExecute eviction of running pods.
All objects here are in storage (v1) form.
"""

from __future__ import annotations

import copy
import datetime as dt
import re
from collections import defaultdict
from dataclasses import dataclass, field

from . import cel

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
CounterKey = tuple[str, str, str]  # driver, pool, counter set


class Unschedulable(Exception):
    pass


@dataclass
class Device:
    driver: str
    pool: str
    name: str
    node: str | None  # None: every node (allNodes)
    spec: dict
    taints: list[dict] = field(default_factory=list)
    revision: str = ""  # its slice's resourceVersion: what selectors saw of it holds while this is unchanged

    @property
    def id(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    def cel_view(self) -> dict:
        attributes: dict[str, dict] = defaultdict(dict)
        for name, value in (self.spec.get("attributes") or {}).items():
            domain, _, short = name.rpartition("/")
            attributes[domain or self.driver][short] = _attribute_value(value)
        capacity: dict[str, dict] = defaultdict(dict)
        for name, value in (self.spec.get("capacity") or {}).items():
            domain, _, short = name.rpartition("/")
            capacity[domain or self.driver][short] = value.get("value") if isinstance(value, dict) else value
        return {"driver": self.driver, "attributes": dict(attributes), "capacity": dict(capacity)}

    def consumption(self) -> dict[CounterKey, dict[str, int]]:
        out: dict[CounterKey, dict[str, int]] = {}
        for entry in self.spec.get("consumesCounters") or []:
            counters = {k: parse_quantity(v.get("value")) for k, v in (entry.get("counters") or {}).items()}
            out[(self.driver, self.pool, entry.get("counterSet", ""))] = counters
        return out


def _attribute_value(value: object) -> object:
    if isinstance(value, dict):
        for kind in ("string", "int", "bool", "version"):
            if kind in value:
                return value[kind]
    return value


_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def parse_quantity(text: object) -> int:
    """A Kubernetes quantity ("1", "40Gi", "500M") as an integer; 0 when absent."""
    if text is None:
        return 0
    m = _QUANTITY.match(str(text).strip())
    if not m or m.group(2) not in _SUFFIXES:
        raise ValueError(f"unsupported quantity {text!r}")
    return int(float(m.group(1)) * _SUFFIXES[m.group(2)])


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        if tol.get("operator", "Equal") == "Exists":
            if not tol.get("key") or tol["key"] == taint.get("key"):
                return True
        elif tol.get("key") == taint.get("key") and (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def blocking_taints(taints: list[dict], tolerations: list[dict]) -> list[dict]:
    return [t for t in taints if t.get("effect") in BLOCKING_EFFECTS and not tolerates(tolerations, t)]


def taint_rule_applies(rule: dict, device: Device) -> bool:
    selector = (rule.get("spec") or {}).get("deviceSelector") or {}
    return all(
        not selector.get(key) or selector[key] == value
        for key, value in (("driver", device.driver), ("pool", device.pool), ("device", device.name))
    )


class Inventory:
    """Everything allocation needs, built from one consistent look at the store."""

    def __init__(
        self,
        slices: list[dict],
        classes: list[dict],
        taint_rules: list[dict],
        claims: list[dict],
        selections: dict | None = None,
    ) -> None:
        """``selections``: where to remember which devices each set of CEL selectors selects, across
        inventories (the scheduler tries every pending pod on every pass, over the same devices)."""
        self.classes = {c["metadata"]["name"]: c for c in classes}
        self.devices: list[Device] = []
        self.counters: dict[CounterKey, dict[str, int]] = {}
        newest: dict[tuple[str, str], int] = {}
        # Rules naming one device (the agent's fences) are looked up by it; the others are tried on each device.
        exact: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
        general: list[dict] = []
        for rule in taint_rules:
            spec = rule.get("spec") or {}
            if not spec.get("taint"):
                continue
            selector = spec.get("deviceSelector") or {}
            if set(selector) == {"driver", "pool", "device"} and all(
                isinstance(v, str) and v for v in selector.values()
            ):
                exact[(selector["driver"], selector["pool"], selector["device"])].append(spec["taint"])
            else:
                general.append(rule)
        for s in slices:
            spec = s.get("spec") or {}
            key = (spec.get("driver", ""), (spec.get("pool") or {}).get("name", ""))
            newest[key] = max(newest.get(key, 0), int((spec.get("pool") or {}).get("generation") or 0))
        for s in slices:
            spec = s.get("spec") or {}
            driver, pool = spec.get("driver", ""), (spec.get("pool") or {}).get("name", "")
            if int((spec.get("pool") or {}).get("generation") or 0) != newest[(driver, pool)]:
                continue  # a stale slice of a pool being republished
            for counter_set in spec.get("sharedCounters") or []:
                self.counters[(driver, pool, counter_set.get("name", ""))] = {
                    k: parse_quantity(v.get("value")) for k, v in (counter_set.get("counters") or {}).items()
                }
            node = None if spec.get("allNodes") else spec.get("nodeName")
            revision = str((s.get("metadata") or {}).get("resourceVersion", ""))
            for raw in spec.get("devices") or []:
                device = Device(driver, pool, raw.get("name", ""), node, raw, list(raw.get("taints") or []), revision)
                device.taints += [dict(t) for t in exact.get(device.id, [])]
                device.taints += [dict(r["spec"]["taint"]) for r in general if taint_rule_applies(r, device)]
                self.devices.append(device)
        self.in_use: set[tuple[str, str, str]] = set()
        self._selections = {} if selections is None else selections
        self.consumed: dict[CounterKey, dict[str, int]] = {}
        by_id = {d.id: d for d in self.devices}
        for claim in claims:
            allocation = (claim.get("status") or {}).get("allocation") or {}
            for result in (allocation.get("devices") or {}).get("results") or []:
                if result.get("adminAccess"):
                    continue
                device_id = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
                self._take(device_id, by_id.get(device_id))

    def _take(self, device_id: tuple[str, str, str], device: Device | None) -> None:
        self.in_use.add(device_id)
        if device is not None:
            for key, counters in device.consumption().items():
                used = self.consumed.setdefault(key, {})
                for name, amount in counters.items():
                    used[name] = used.get(name, 0) + amount

    def _fits(self, device: Device) -> bool:
        for key, counters in device.consumption().items():
            available = self.counters.get(key)
            if available is None:
                return False
            used = self.consumed.get(key, {})
            if any(used.get(name, 0) + amount > available.get(name, 0) for name, amount in counters.items()):
                return False
        return True

    def allocate(self, claims: list[dict], node: str) -> dict[str, dict]:
        """Allocations (claim uid -> ``status.allocation``) for claims not yet allocated, all on ``node``.

        Raises Unschedulable with the reason when one cannot be satisfied; nothing is taken then.
        Taken devices count as in use for later calls on this inventory.
        """
        saved = self._snapshot()
        try:
            return {c["metadata"]["uid"]: self._allocate_claim(c, node) for c in claims}
        except Unschedulable:
            self._restore(saved)
            raise

    def _selected(self, expressions: list[str], device: Device) -> bool:
        key = (tuple(expressions), device.id, device.revision)
        if key not in self._selections:
            self._selections[key] = _selected(expressions, device)
        return self._selections[key]

    def _snapshot(self) -> tuple[set, dict]:
        return set(self.in_use), {key: dict(used) for key, used in self.consumed.items()}

    def _restore(self, saved: tuple[set, dict]) -> None:
        self.in_use, self.consumed = set(saved[0]), {key: dict(used) for key, used in saved[1].items()}

    def _allocate_claim(self, claim: dict, node: str) -> dict:
        devices_spec = (claim.get("spec") or {}).get("devices") or {}
        results: list[dict] = []
        class_configs: list[dict] = []
        for request in devices_spec.get("requests") or []:
            name = request.get("name", "")
            if request.get("exactly") is not None:
                results += self._satisfy(name, request["exactly"], node, claim, class_configs)
                continue
            reasons = []
            for sub in request.get("firstAvailable") or []:
                saved = self._snapshot()
                try:
                    results += self._satisfy(f"{name}/{sub.get('name', '')}", sub, node, claim, class_configs)
                    break
                except Unschedulable as e:
                    self._restore(saved)  # what a failed alternative took is free for the next one
                    reasons.append(str(e))
            else:
                raise Unschedulable("; ".join(reasons) or f"request {name!r} has no subrequests")
        config = class_configs + [{"source": "FromClaim", **entry} for entry in devices_spec.get("config") or []]
        allocation: dict = {
            "devices": {"results": results},
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
            },
            "allocationTimestamp": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        if config:
            allocation["devices"]["config"] = config
        return allocation

    def _satisfy(
        self, request_name: str, request: dict, node: str, claim: dict, class_configs: list[dict]
    ) -> list[dict]:
        class_name = request.get("deviceClassName", "")
        device_class = self.classes.get(class_name)
        where = f"claim {claim['metadata'].get('namespace')}/{claim['metadata'].get('name')} request {request_name!r}"
        if device_class is None:
            raise Unschedulable(f'{where}: device class "{class_name}" does not exist')
        selectors = [
            s["cel"]["expression"]
            for s in ((device_class.get("spec") or {}).get("selectors") or []) + (request.get("selectors") or [])
            if (s.get("cel") or {}).get("expression")
        ]
        tolerations = request.get("tolerations") or []
        admin = bool(request.get("adminAccess"))
        candidates: list[Device] = []
        for device in self.devices:
            if device.node not in (None, node) or not self._selected(selectors, device):
                continue
            if blocking_taints(device.taints, tolerations):
                continue
            candidates.append(device)
        mode = request.get("allocationMode", "ExactCount")
        if mode == "All":
            if not candidates or (not admin and any(d.id in self.in_use for d in candidates)):
                raise Unschedulable(f"{where}: not all devices of class {class_name!r} on node {node} are free")
            chosen = candidates
        else:
            want = int(request.get("count") or 1)
            chosen = []
            for device in candidates:
                if len(chosen) == want:
                    break
                if admin or (device.id not in self.in_use and self._fits(device)):
                    chosen.append(device)
                    if not admin:
                        self._take(device.id, device)
            if len(chosen) < want:
                raise Unschedulable(
                    f"{where}: {len(chosen)} of {want} untainted, free {class_name!r} devices on node {node}"
                )
        if mode == "All" and not admin:
            for device in chosen:
                self._take(device.id, device)
        for entry in (device_class.get("spec") or {}).get("config") or []:
            class_configs.append({"source": "FromClass", "requests": [request_name], **entry})
        results = []
        for device in chosen:
            result = {"request": request_name, "driver": device.driver, "pool": device.pool, "device": device.name}
            if admin:
                result["adminAccess"] = True
            if tolerations:
                result["tolerations"] = copy.deepcopy(tolerations)
            results.append(result)
        return results


def _selected(expressions: list[str], device: Device) -> bool:
    view = {"device": device.cel_view()}
    for expression in expressions:
        try:
            if cel.evaluate(expression, view) is not True:
                return False
        except cel.CelError:
            return False  # a runtime error on one device rules that device out
    return True
