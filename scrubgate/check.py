"""`scrubgate check`: the policy core over manifests, as a CI step."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.engine import Finding, shared_claims, validate
from scrubgate.policies.model import as_dict, as_str, kind_of

from .sources import Document, InputError, display_name, expand_paths, read_documents, read_text

DEFAULT_NAMESPACE = "default"


@dataclass(slots=True)
class CheckedObject:
    document: Document
    findings: list[Finding]


@dataclass(slots=True)
class CheckResult:
    files: int = 0
    objects: list[CheckedObject] = field(default_factory=list)
    errors: list[InputError] = field(default_factory=list)

    def count(self, action: str) -> int:
        return sum(1 for o in self.objects for f in o.findings if f.action == action)

    @property
    def exit_code(self) -> int:
        """0: no deny finding; 1: a deny finding; 2: some input could not be read."""
        if self.errors:
            return 2
        return 1 if self.count("deny") else 0


def namespace_of(obj: Mapping[str, object]) -> str:
    return as_str(as_dict(obj.get("metadata")).get("namespace")) or DEFAULT_NAMESPACE


def trusted_namespaces(documents: list[Document], policy: PolicyConfig, overrides: Mapping[str, bool]) -> set[str]:
    """Policy's trusted namespaces, plus Namespace documents labelled trusted, then the command line's say."""
    trusted = set(policy.tenancy.trusted_namespaces)
    for doc in documents:
        if kind_of(doc.obj) == ("v1", "Namespace"):
            meta = as_dict(doc.obj.get("metadata"))
            if as_dict(meta.get("labels")).get(policy.tenancy.label) == policy.tenancy.trusted_value:
                trusted.add(as_str(meta.get("name")))
    for namespace, is_trusted in overrides.items():
        (trusted.add if is_trusted else trusted.discard)(namespace)
    return trusted


def check_documents(
    documents: list[Document], policy: PolicyConfig, overrides: Mapping[str, bool] | None = None
) -> list[CheckedObject]:
    trusted = trusted_namespaces(documents, policy, overrides or {})
    checked = []
    for doc in documents:
        checked.append(CheckedObject(doc, validate(doc.obj, policy, trusted=namespace_of(doc.obj) in trusted)))
    keyed = ((i, c.document.obj, namespace_of(c.document.obj) in trusted) for i, c in enumerate(checked))
    for index, finding in shared_claims(keyed, policy):
        checked[index].findings.append(finding)
    return checked


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """A run builds millions of objects (every document's data) that are never cyclic garbage; the cyclic
    collector would rescan them again and again, and once more at exit: up to three quarters of the run time.
    So it is off while reading, and what the run built is then frozen out of its reach (freed, as usual,
    when the last reference goes)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def run_check(paths: list[str], policy: PolicyConfig, overrides: Mapping[str, bool] | None = None) -> CheckResult:
    with _no_cyclic_gc():
        return _run_check(paths, policy, overrides)


def _run_check(paths: list[str], policy: PolicyConfig, overrides: Mapping[str, bool] | None) -> CheckResult:
    result = CheckResult()
    files, result.errors = expand_paths(paths)
    documents: list[Document] = []
    for file in files:
        text = read_text(file)
        result.files += 1
        if isinstance(text, InputError):
            result.errors.append(text)
            continue
        docs, errors = read_documents(display_name(file), text)
        documents += [d for d in docs if not _kind_without_api_version(d)]
        result.errors += errors + [_missing_api_version(d) for d in docs if _kind_without_api_version(d)]
    result.objects = check_documents(documents, policy, overrides)
    return result


def _kind_without_api_version(doc: Document) -> bool:
    return "kind" in doc.obj and doc.obj.get("apiVersion") in (None, "")


def _missing_api_version(doc: Document) -> InputError:
    """kubectl refuses an object without apiVersion; passing over it in silence would check less than is applied."""
    where = f"items[{doc.prefix[-1]}] of document {doc.index}" if doc.prefix else f"document {doc.index}"
    return InputError(
        doc.file, doc.line_of(""), f"{where} has kind {doc.obj.get('kind')!r} but no apiVersion: add its apiVersion"
    )
