"""`scrubgate check`: the policy core over manifests, as a CI step."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.engine import shared_claims, validate

from .reading import CheckedObject, namespace_of, read_all, trusted_namespaces
from .sources import STDIN, STDIN_NAME, Document, InputError, expand_paths

__all__ = ["CheckResult", "CheckedObject", "check_documents", "run_check"]


@dataclass(slots=True)
class CheckResult:
    files: int = 0
    objects: list[CheckedObject] = field(default_factory=list)
    errors: list[InputError] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)  # Helm chart templates left out (see expand_paths)

    def count(self, action: str) -> int:
        return sum(1 for o in self.objects for f in o.findings if f.action == action)

    @property
    def exit_code(self) -> int:
        """0: no deny finding; 1: a deny finding; 2: some input could not be read."""
        if self.errors:
            return 2
        return 1 if self.count("deny") else 0


def check_documents(
    documents: list[Document],
    policy: PolicyConfig,
    overrides: Mapping[str, bool] | None = None,
    checked: list[CheckedObject] | None = None,
    *,
    stored: bool = False,
) -> list[CheckedObject]:
    """Findings for every document. `checked` holds documents already validated as they were read, under the
    tenancy known then; one whose namespace turned out otherwise (a Namespace document read after it) is
    validated again. `stored`: the documents were read from a cluster, not from manifests."""
    trusted = trusted_namespaces(documents, policy, overrides or {})
    done = {id(c.document): c for c in checked or ()}
    out = []
    for doc in documents:
        is_trusted = namespace_of(doc.obj) in trusted
        found = done.get(id(doc))
        if found is None or found.trusted != is_trusted:
            found = CheckedObject(doc, validate(doc.obj, policy, trusted=is_trusted, stored=stored), is_trusted)
        out.append(found)
    keyed = ((i, c.document.obj, c.trusted) for i, c in enumerate(out))
    for index, finding in shared_claims(keyed, policy):
        out[index].findings.append(finding)
    return out


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


def run_check(
    paths: list[str],
    policy: PolicyConfig,
    overrides: Mapping[str, bool] | None = None,
    exclude: tuple[str, ...] = (),
) -> CheckResult:
    with _no_cyclic_gc():
        return _run_check(paths, policy, overrides, exclude)


def _run_check(
    paths: list[str], policy: PolicyConfig, overrides: Mapping[str, bool] | None, exclude: tuple[str, ...]
) -> CheckResult:
    result = CheckResult()
    expanded = expand_paths(paths, exclude)
    result.errors, result.templates = expanded.errors, expanded.templates
    checked: list[CheckedObject] = []
    for part in read_all(expanded.files, policy, overrides or {}):
        result.files += part.files
        result.errors += part.errors
        checked += part.checked
    result.objects = check_documents([c.document for c in checked], policy, overrides, checked)
    piped = STDIN in expanded.files
    if piped and not any(o.document.file == STDIN_NAME for o in result.objects) and not result.errors:
        # In `helm template ... | scrubgate check -`, a command that failed writes nothing: passing would
        # hide that nothing was checked.
        result.errors.append(
            InputError(
                STDIN_NAME,
                None,
                "no Kubernetes object on standard input: did the command that renders the manifests (helm "
                "template, kustomize build) fail? Its own error is above",
            )
        )
    return result
