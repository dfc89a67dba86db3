"""`scrubgate reports` checks again only what changed: it keeps each object's findings, and validates an object
again when it changed, or when something its findings depend on did:

- the policy (read every round), or any DeviceClass (which claims are guarded): everything;
- a namespace's tenancy: that namespace's objects;
- a ResourceClaim: the pod specs naming it (SG002 tells a pod sharing a GPU from one naming a claim of none).

SG002 across pods (two pods of a trusted namespace naming one claim) is found each round from the pods that name
a claim, as `scrubgate check` finds it across documents. The findings are the engine's, as `check --cluster` gives
them on the same objects (tests/test_cluster_reports.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.engine import DeviceClasses, Finding, shared_claims, validate
from scrubgate.policies.model import kind_of, pod_claims, pod_spec
from scrubgate.policies.selectors import UNKNOWN

from .check import CheckedObject, CheckResult
from .mirror import Key, Mirror, Ref
from .reading import namespace_of, trusted_namespaces
from .sources import Document

NAMESPACE, DEVICE_CLASS, CLAIM = "Namespace", "DeviceClass", "ResourceClaim"


class Claims(Mapping[tuple[str, str], dict[str, Any]]):
    """The mirror's ResourceClaims by (namespace, name), unpacked when looked up (`validate`'s `claims`)."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror, self.path = mirror, mirror.path_of(CLAIM)

    def __getitem__(self, key: tuple[str, str]) -> dict[str, Any]:
        found = self.mirror.get((self.path, key)) if self.path else None
        if found is None:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return (key for _, key in (self.mirror.refs(self.path) if self.path else []))

    def __len__(self) -> int:  # `validate` asks it (`claims or {}`) for each claim a pod names
        return self.mirror.count(self.path) if self.path else 0


class Rechecks:
    """Each object's findings, from one run to the next over the same mirror (`run`: one round)."""

    def __init__(self) -> None:
        self.policy: PolicyConfig | None = None
        self.trusted: set[str] = set()
        self.classes = UNKNOWN
        self.findings: dict[Ref, tuple[list[Finding], bool]] = {}  # only objects with a finding; and trusted
        self.naming: dict[Key, set[Ref]] = {}  # (namespace, claim name) -> the pod specs that name it
        self.named: dict[Ref, set[Key]] = {}
        self.checked = 0  # objects validated by the last run

    def run(self, mirror: Mirror, policy: PolicyConfig) -> CheckResult:
        changed = mirror.take_changes()
        namespaces = mirror.path_of(NAMESPACE)
        documents = [Document("cluster", 0, obj, None) for obj in (mirror.values(namespaces) if namespaces else [])]
        trusted = trusted_namespaces(documents, policy, {})
        classes = mirror.path_of(DEVICE_CLASS)
        if policy != self.policy or any(path == classes for path, _ in changed):
            self.classes = DeviceClasses.of(mirror.values(classes) if classes else [], policy.gpu_drivers)
            dirty = set(mirror.refs()) | set(self.findings) | set(self.named)
        else:
            flipped = trusted ^ self.trusted
            dirty = set(changed)
            if flipped:
                dirty.update(ref for ref in mirror.refs() if _namespace(ref) in flipped)
            claims = mirror.path_of(CLAIM)
            for path, key in changed:
                if path == claims:
                    dirty |= self.naming.get(key, set())
        self.policy, self.trusted = policy, trusted
        known = Claims(mirror)
        self.checked = 0
        for ref in dirty:
            if ref[0] != namespaces:
                self._check(mirror, ref, policy, known)
        return self._result(mirror, policy)

    def _check(self, mirror: Mirror, ref: Ref, policy: PolicyConfig, claims: Claims) -> None:
        for name in self.named.pop(ref, set()):
            self.naming[name].discard(ref)
            if not self.naming[name]:
                del self.naming[name]
        self.findings.pop(ref, None)
        obj = mirror.get(ref)
        if obj is None:
            return
        self.checked += 1
        trusted = namespace_of(obj) in self.trusted
        found = validate(obj, policy, trusted=trusted, stored=True, classes=self.classes, claims=claims)
        if found:
            self.findings[ref] = (found, trusted)
        spec = pod_spec(obj)
        names = {(ref[1][0], c.claim_name) for c in pod_claims(spec) if c.claim_name} if spec else set()
        if names:
            self.named[ref] = names
            for name in names:
                self.naming.setdefault(name, set()).add(ref)

    def _result(self, mirror: Mirror, policy: PolicyConfig) -> CheckResult:
        """The objects with a finding, in the order of the lists, as `build_reports` takes them."""
        pods = {
            ref
            for holders in self.naming.values()
            if len(holders) > 1
            for ref in holders
            if _namespace(ref) in self.trusted
        }
        objects = {ref: mirror.get(ref) for ref in pods | set(self.findings)}
        shared: dict[Ref, list[Finding]] = {}
        pairs = ((ref, obj, True) for ref in pods if (obj := objects[ref]) is not None and kind_of(obj)[1] == "Pod")
        for ref, finding in shared_claims(pairs, policy):
            shared.setdefault(ref, []).append(finding)
        order = {path: index for index, path in enumerate(mirror.kinds)}
        result = CheckResult()
        for ref in sorted(self.findings.keys() | shared.keys(), key=lambda r: (order.get(r[0], 0), r[1])):
            obj = objects.get(ref)
            if obj is None:
                continue
            found, trusted = self.findings.get(ref, ([], _namespace(ref) in self.trusted))
            document = Document("cluster", 0, obj, None)
            result.objects.append(CheckedObject(document, [*found, *shared.get(ref, [])], trusted))
        return result


def _namespace(ref: Ref) -> str:
    """The namespace whose tenancy an object is checked under (`namespace_of`: `default` when it has none)."""
    return ref[1][0] or "default"
