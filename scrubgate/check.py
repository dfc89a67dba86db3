"""`scrubgate check`: the policy core over manifests, as a CI step."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.engine import DeviceClasses, shared_claims, validate
from scrubgate.policies.model import as_str, is_claim, is_device_class, is_known, kind_of, metadata

from .reading import CheckedObject, namespace_of, read_all, trusted_namespaces
from .sources import STDIN, STDIN_NAME, Document, InputError, expand_paths

__all__ = ["CheckResult", "CheckedObject", "Progress", "check_documents", "run_check"]


@dataclass(slots=True)
class CheckResult:
    files: int = 0
    objects: list[CheckedObject] = field(default_factory=list)
    errors: list[InputError] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)  # Helm chart templates left out (see expand_paths)
    repeats: list[tuple[str, str]] = field(default_factory=list)  # directories met again (see expand_paths)

    def count(self, action: str) -> int:
        return sum(1 for o in self.objects for f in o.findings if f.action == action)

    @property
    def kubernetes_objects(self) -> int:
        """The objects that have an apiVersion and a kind (a Helm values file, say, has neither)."""
        return sum(1 for o in self.objects if is_kubernetes_object(o.document))

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
    classes, claims = known_from(documents, policy)
    # What was validated as it was read knew neither the classes nor the claims among the documents: where there
    # are some, the claims and workloads are validated again with them.
    context = bool(classes.verdicts or claims)
    done = {id(c.document): c for c in checked or ()}
    out = []
    for doc in documents:
        is_trusted = namespace_of(doc.obj) in trusted
        found = done.get(id(doc))
        if found is None or found.trusted != is_trusted or (context and is_known(doc.obj)):
            findings = validate(doc.obj, policy, trusted=is_trusted, stored=stored, classes=classes, claims=claims)
            found = CheckedObject(doc, findings, is_trusted)
        out.append(found)
    keyed = ((i, c.document.obj, c.trusted) for i, c in enumerate(out))
    for index, finding in shared_claims(keyed, policy):
        out[index].findings.append(finding)
    return out


def known_from(
    documents: list[Document], policy: PolicyConfig
) -> tuple[DeviceClasses, dict[tuple[str, str], dict[str, object]]]:
    """The DeviceClasses among the documents (a claim of one proven to hand out no GPU is not guarded) and the
    ResourceClaims, by (namespace, name) (a workload naming one that holds no GPU shares none, SG002)."""
    classes = DeviceClasses.of((d.obj for d in documents if is_device_class(d.obj)), policy.gpu_drivers)
    claims = {
        (namespace_of(d.obj), name): d.obj
        for d in documents
        if is_claim(d.obj) and kind_of(d.obj)[1] == "ResourceClaim" and (name := as_str(metadata(d.obj).get("name")))
    }
    return classes, claims


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


def is_kubernetes_object(document: Document) -> bool:
    return all(kind_of(document.obj))


# Progress appears once reading has taken this long, and is then written again this often: on a terminal in
# place, else (--progress into a CI log) a line at a time.
PROGRESS_AFTER = 3.0
PROGRESS_EVERY = {True: 0.5, False: 10.0}


class Progress:
    """How far a long read has come, on stderr: as checkov does, only on a terminal unless asked for
    (`--progress`), and, unlike checkov, not at all for the runs that end within PROGRESS_AFTER seconds."""

    def __init__(self, stream: TextIO, terminal: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.terminal, self.clock = stream, terminal, clock
        self.start = clock()
        self.due = self.start + PROGRESS_AFTER
        self.total = self.files = 0
        self.current: tuple[str, int, int] | None = None  # a file being read: its name, where, its size
        self.shown = False

    def files_read(self, count: int) -> None:
        self.files += count
        self.current = None
        self._show()

    def reading(self, file: str, position: int, size: int) -> None:
        """Told at each document of a file read in this process (`position` and `size` in characters)."""
        self.current = (file, position, size)
        self._show()

    def _show(self) -> None:
        now = self.clock()
        if now < self.due:
            return
        self.due = now + PROGRESS_EVERY[self.terminal]
        line = f"scrubgate check: {self.files:,} of {self.total:,} file(s) read, {now - self.start:.0f} s"
        if self.current is not None:
            file, position, size = self.current
            line += f"; reading {file} ({position / max(size, 1):.0%} of {size / 1e6:.1f} MB)"
        self._write(line, end="")
        self.shown = True

    def done(self) -> None:
        """Where progress was shown, its last line: all read (the checks across documents and the report
        follow)."""
        if self.shown:
            elapsed = self.clock() - self.start
            self._write(f"scrubgate check: {self.files:,} of {self.total:,} file(s) read in {elapsed:.0f} s", end="\n")

    def _write(self, line: str, end: str) -> None:
        """On a terminal the line replaces the last one; in a log each is a line of its own."""
        self.stream.write(f"\r{line}\033[K{end}" if self.terminal else line + "\n")
        self.stream.flush()


def run_check(
    paths: list[str],
    policy: PolicyConfig,
    overrides: Mapping[str, bool] | None = None,
    exclude: tuple[str, ...] = (),
    *,
    require_objects: bool = False,
    progress: Progress | None = None,
) -> CheckResult:
    """Checks the PATHs; `require_objects`: finding no Kubernetes object in them is an input error."""
    with _no_cyclic_gc():
        result = _run_check(paths, policy, overrides, exclude, progress)
    if progress is not None:
        progress.done()
    if require_objects and not result.kubernetes_objects and not result.errors:
        result.errors += [
            InputError(
                path,
                None,
                "no Kubernetes object found (--fail-if-no-objects-found): directories are searched for *.yaml, "
                "*.yml and *.json files, and a document needs apiVersion and kind",
            )
            for path in paths
        ]
    return result


def _run_check(
    paths: list[str],
    policy: PolicyConfig,
    overrides: Mapping[str, bool] | None,
    exclude: tuple[str, ...],
    progress: Progress | None,
) -> CheckResult:
    result = CheckResult()
    expanded = expand_paths(paths, exclude)
    result.errors, result.templates, result.repeats = expanded.errors, expanded.templates, expanded.repeats
    checked: list[CheckedObject] = []
    if progress is not None:
        progress.total = len(expanded.files)
    tick = progress.reading if progress is not None else None
    for part in read_all(expanded.files, policy, overrides or {}, tick):
        result.files += part.files
        result.errors += part.errors
        checked += part.checked
        if progress is not None:
            progress.files_read(part.files)
    # In every format by file name, whatever the order of the PATHs (a directory's files are sorted already).
    checked.sort(key=lambda c: (c.document.file, c.document.index))
    result.objects = check_documents([c.document for c in checked], policy, overrides, checked)
    piped = STDIN in expanded.files
    if (
        piped
        and not any(o.document.file == STDIN_NAME and is_kubernetes_object(o.document) for o in result.objects)
        and not result.errors
    ):
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
