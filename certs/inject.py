"""Put the CA bundle into every webhook of the Validating/MutatingWebhookConfiguration documents.

The API server verifies the webhook's serving certificate against ``clientConfig.caBundle`` (base64 of the
PEM). Files are rewritten with ruamel.yaml's round trip, so comments and the other documents stay as
they were.
"""

from __future__ import annotations

import base64
import copy
import io
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from ruamel.yaml import YAML

from .files import write_atomic

WEBHOOK_CONFIGURATION_KINDS = frozenset({"ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"})
_GROUP = "admissionregistration.k8s.io"


@dataclass(frozen=True)
class InjectedFile:
    source: Path
    written: Path
    webhooks: int


def ca_bundle(ca_pem: bytes) -> str:
    """The ``caBundle`` value for ``ca_pem``; refuses anything that is not PEM certificates."""
    try:
        x509.load_pem_x509_certificates(ca_pem)
    except ValueError as e:
        raise ValueError(f"the CA bundle is not PEM-encoded X.509 certificates: {e}") from e
    return base64.b64encode(ca_pem).decode("ascii")


def is_webhook_configuration(doc: object) -> bool:
    if not isinstance(doc, Mapping):
        return False
    api_version = doc.get("apiVersion")
    return (
        isinstance(api_version, str)
        and api_version.split("/")[0] == _GROUP
        and doc.get("kind") in WEBHOOK_CONFIGURATION_KINDS
    )


def inject_ca_bundle(docs: Iterable[Any], ca_pem: bytes) -> list[Any]:
    """Copies of ``docs`` with ``clientConfig.caBundle`` set on every webhook of every webhook configuration.

    Other documents are returned unchanged (as copies). A webhook configuration whose ``webhooks`` are not
    a list of objects each with a ``clientConfig`` object is an error, not something to skip.
    """
    bundle = ca_bundle(ca_pem)
    patched = [copy.deepcopy(doc) for doc in docs]
    for doc in patched:
        for webhook in _webhooks(doc):
            webhook["clientConfig"]["caBundle"] = bundle
    return patched


def count_webhooks(docs: Iterable[Any]) -> int:
    return sum(1 for doc in docs for _ in _webhooks(doc))


def inject_yaml_text(text: str, ca_pem: bytes) -> tuple[str, int]:
    """Inject into a multi-document YAML text; returns the new text and how many webhooks got the bundle."""
    yaml = _round_trip_yaml()
    docs = [doc for doc in yaml.load_all(text) if doc is not None]
    patched = inject_ca_bundle(docs, ca_pem)
    out = io.StringIO()
    yaml.dump_all(patched, out)
    return out.getvalue(), count_webhooks(patched)


def inject_files(source: Path, ca_pem: bytes, out_dir: Path | None = None) -> list[InjectedFile]:
    """Inject into ``source`` (a YAML file, or the ``*.yaml``/``*.yml`` files directly in a directory).

    Files without a webhook configuration are left alone. Patched files go to ``out_dir`` under their own
    names, or replace the originals when ``out_dir`` is None. Finding no webhook at all is an error: the
    caller expected the webhooks to trust this CA.
    """
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix in {".yaml", ".yml"} and p.is_file())
    elif source.is_file():
        files = [source]
    else:
        raise ValueError(f"{source}: no such file or directory")
    results = []
    for path in files:
        text, webhooks = inject_yaml_text(path.read_text(), ca_pem)
        if not webhooks:
            continue
        dest = path if out_dir is None else out_dir / path.name
        write_atomic(dest, text.encode(), path.stat().st_mode & 0o777)
        results.append(InjectedFile(source=path, written=dest, webhooks=webhooks))
    if not results:
        raise ValueError(
            f"{source}: no webhook in a ValidatingWebhookConfiguration or MutatingWebhookConfiguration; "
            "point --manifests at the file or directory that holds them"
        )
    return results


def _webhooks(doc: Any) -> Iterator[MutableMapping[str, Any]]:
    """The webhooks of a webhook configuration (none for any other document), checked for shape."""
    if not is_webhook_configuration(doc):
        return
    metadata = doc.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    where = f"{doc['kind']} {name or '<unnamed>'}"
    webhooks = doc.get("webhooks") or []
    if not isinstance(webhooks, list):
        raise ValueError(f"{where}: 'webhooks' must be a list")
    for i, webhook in enumerate(webhooks):
        if not isinstance(webhook, MutableMapping):
            raise ValueError(f"{where}: webhooks[{i}] must be an object")
        if not isinstance(webhook.get("clientConfig"), MutableMapping):
            raise ValueError(
                f"{where}: webhook {webhook.get('name', i)!r} has no clientConfig object to put the caBundle in"
            )
        yield webhook


def _round_trip_yaml() -> YAML:
    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap long CEL expressions or the base64 bundle
    return yaml
