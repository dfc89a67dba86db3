"""Reading the inputs of `scrubgate check`: each document is validated as it is read, under the tenancy known
so far, and its findings are located while its node tree is at hand. Many files are read by several processes.
"""

from __future__ import annotations

import dataclasses
import marshal
import multiprocessing
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.engine import Finding, validate
from scrubgate.policies.model import as_dict, as_str, kind_of

from .sources import STDIN, Document, InputError, Span, display_name, read_documents, read_text

DEFAULT_NAMESPACE = "default"
# Reading many files is spread over processes: parsing is most of a run's time.
PARALLEL_FILES = 256  # fewer files are read in this process: starting others would cost more than it saves
FILES_PER_TASK = 64


@dataclass(slots=True)
class CheckedObject:
    document: Document
    findings: list[Finding]
    trusted: bool = False  # the tenancy of its namespace that the findings were found under


def namespace_of(obj: Mapping[str, object]) -> str:
    return as_str(as_dict(obj.get("metadata")).get("namespace")) or DEFAULT_NAMESPACE


def labelled_trusted(doc: Document, policy: PolicyConfig) -> str | None:
    """The name of a Namespace document labelled trusted."""
    if kind_of(doc.obj) != ("v1", "Namespace"):
        return None
    meta = as_dict(doc.obj.get("metadata"))
    if as_dict(meta.get("labels")).get(policy.tenancy.label) != policy.tenancy.trusted_value:
        return None
    return as_str(meta.get("name"))


def trusted_namespaces(documents: list[Document], policy: PolicyConfig, overrides: Mapping[str, bool]) -> set[str]:
    """Policy's trusted namespaces, plus Namespace documents labelled trusted, then the command line's say."""
    trusted = set(policy.tenancy.trusted_namespaces)
    trusted.update(name for doc in documents if (name := labelled_trusted(doc, policy)) is not None)
    for namespace, is_trusted in overrides.items():
        (trusted.add if is_trusted else trusted.discard)(namespace)
    return trusted


@dataclass(slots=True)
class Part:
    """What reading some files gave: their documents, each validated as it was read, and what could not be
    read."""

    files: int = 0
    checked: list[CheckedObject] = field(default_factory=list)
    errors: list[InputError] = field(default_factory=list)


class _Reader:
    def __init__(self, policy: PolicyConfig, overrides: Mapping[str, bool]) -> None:
        self.policy = policy
        self.overrides = overrides
        self.trusted = trusted_namespaces([], policy, overrides)
        self.found: dict[int, CheckedObject] = {}

    def settle(self, doc: Document) -> None:
        if _kind_without_api_version(doc):
            doc.locate([""])  # an input error on its line, not checked
            return
        name = labelled_trusted(doc, self.policy)
        if name is not None and self.overrides.get(name, True):
            self.trusted.add(name)
        is_trusted = namespace_of(doc.obj) in self.trusted
        findings = validate(doc.obj, self.policy, trusted=is_trusted)
        if findings:
            doc.locate(f.path for f in findings)
        self.found[id(doc)] = CheckedObject(doc, findings, is_trusted)


# Told of each document read, for progress: the file's name, where the document ends and the file's size.
Tick = Callable[[str, int, int], None]


def read_files(files: list[str], policy: PolicyConfig, overrides: Mapping[str, bool], tick: Tick | None = None) -> Part:
    part = Part()
    reader = _Reader(policy, overrides)
    for file in files:
        text = read_text(file)
        part.files += 1
        if isinstance(text, InputError):
            part.errors.append(text)
            continue
        reader.found = {}  # a file read again after a syntax error is settled again
        name, settle = display_name(file), reader.settle
        if tick is not None:

            def settle(doc: Document, name: str = name, size: int = len(text)) -> None:
                reader.settle(doc)
                tick(name, doc.span.end if doc.span is not None else size, size)

        documents, errors = read_documents(name, text, settle)
        part.checked += [reader.found[id(doc)] for doc in documents if not _kind_without_api_version(doc)]
        part.errors += errors + [_missing_api_version(doc) for doc in documents if _kind_without_api_version(doc)]
    return part


def _kind_without_api_version(doc: Document) -> bool:
    return "kind" in doc.obj and doc.obj.get("apiVersion") in (None, "")


def _missing_api_version(doc: Document) -> InputError:
    """kubectl refuses an object without apiVersion; passing over it in silence would check less than is applied."""
    where = f"items[{doc.prefix[-1]}] of document {doc.index}" if doc.prefix else f"document {doc.index}"
    return InputError(
        doc.file, doc.line_of(""), f"{where} has kind {doc.obj.get('kind')!r} but no apiVersion: add its apiVersion"
    )


def read_all(
    files: list[str], policy: PolicyConfig, overrides: Mapping[str, bool], tick: Tick | None = None
) -> Iterator[Part]:
    """The files read in their order, by this process and one more per further CPU where there are many. This
    process reads every CPU-th task itself, between taking the others' results: a task read here costs nothing
    to send back, and no third process competes for two CPUs. `tick` hears of the documents read here."""
    workers = min(cpus(), len(files) // FILES_PER_TASK) - 1
    if len(files) < PARALLEL_FILES or workers < 1 or STDIN in files:
        yield read_files(files, policy, overrides, tick)
        return
    tasks = [files[i : i + FILES_PER_TASK] for i in range(0, len(files), FILES_PER_TASK)]
    share = workers + 1
    context = multiprocessing.get_context("fork")  # the policy and the loaded modules come along for free
    with context.Pool(workers, initializer=_set_worker, initargs=(policy, overrides)) as pool:
        sent = pool.imap(_read_in_worker, [task for i, task in enumerate(tasks) if i % share])
        for i, task in enumerate(tasks):
            if i % share == 0:
                yield read_files(task, policy, overrides, tick)
            else:
                part = next(sent)
                yield part if isinstance(part, Part) else _unpack(part)


def cpus() -> int:
    return len(os.sched_getaffinity(0))


_worker_args: tuple[PolicyConfig, Mapping[str, bool]] | None = None


def _set_worker(policy: PolicyConfig, overrides: Mapping[str, bool]) -> None:
    global _worker_args
    _worker_args = (policy, overrides)


def _read_in_worker(files: list[str]) -> bytes | Part:
    assert _worker_args is not None
    part = read_files(files, *_worker_args)
    try:
        return _pack(part)
    except ValueError:  # data marshal cannot write (a YAML timestamp is a datetime): pickled as it is
        return part


# What a worker sends back is plain data, which marshal writes five times and reads twice as fast as pickle
# writes and reads the objects (a document's data costs a fifth of its parse to send back as objects).


_FINDING_FIELDS = tuple(f.name for f in dataclasses.fields(Finding))


def _pack(part: Part) -> bytes:
    checked = []
    for c in part.checked:
        d, span = c.document, c.document.span
        checked.append(
            (
                d.file,
                d.index,
                d.obj,
                None if span is None else (span.start, span.end, span.line),
                d.prefix,
                d.text,
                d.lines,
                [tuple(getattr(f, name) for name in _FINDING_FIELDS) for f in c.findings],
                c.trusted,
            )
        )
    errors = [(e.file, e.line, e.message) for e in part.errors]
    return marshal.dumps((part.files, checked, errors))


def _unpack(data: bytes) -> Part:
    files, checked, errors = marshal.loads(data)
    part = Part(files, errors=[InputError(*e) for e in errors])
    for file, index, obj, span, prefix, text, lines, findings, trusted in checked:
        document = Document(file, index, obj, None if span is None else Span(*span), prefix, text, None, lines)
        found = [Finding(**dict(zip(_FINDING_FIELDS, f, strict=True))) for f in findings]
        part.checked.append(CheckedObject(document, found, trusted))
    return part
