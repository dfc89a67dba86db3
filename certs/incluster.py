"""``scrubgate certs ensure``: the webhook's certificates made in the cluster, as Kyverno and Gatekeeper make
theirs, so that what the chart renders holds no key and two renders are the same (a GitOps controller sees no
drift; a CA generated at render time would change at each).

It makes, when absent, the Secret ``scrubgate-webhook-tls`` (a CA of its own and the serving certificate of
the webhook's Service: ca.crt, tls.crt, tls.key) and the webhook's audit checkpoint key Secret, and sets every
webhook's ``caBundle`` in the webhook configurations named to that Secret's ca.crt. What exists is kept: the
CA, and with it every caBundle, outlives upgrades; a Secret made by someone else is used as it is. The chart
runs it before each install and upgrade (the webhook's pods need their Secrets; the configurations are not
there yet on a first install) and after (the caBundle of the configurations just applied: Helm and Argo CD
leave a field they never set alone, so later upgrades keep it).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Any

from scrubgate.cluster import Api, ApiError

from . import generate as gen
from .inject import inject_ca_bundle, is_webhook_configuration
from .layout import CA_CERT_FILE, TLS_CERT_FILE, TLS_KEY_FILE, TLS_SECRET_NAME

WEBHOOK_CONFIGURATION_RESOURCES = ("validatingwebhookconfigurations", "mutatingwebhookconfigurations")
_ADMISSION = "/apis/admissionregistration.k8s.io/v1"
_CONFLICT_RETRIES = 5


def ensure_secret(api: Api, namespace: str, name: str, make: Callable[[], dict[str, Any]]) -> tuple[dict, bool]:
    """The Secret `namespace/name`, created from `make()` when absent; (it, whether this call created it). Two
    runs at once: the second's create fails with 409 and it reads the first's."""
    path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
    try:
        return api.request("GET", path), False
    except ApiError as exc:
        if exc.status != 404:
            raise
    try:
        return api.request("POST", f"/api/v1/namespaces/{namespace}/secrets", body=make()), True
    except ApiError as exc:
        if exc.status != 409:
            raise
    return api.request("GET", path), False


def tls_secret(namespace: str, service: str, days: int) -> dict[str, Any]:
    """A new CA and the serving certificate of `service` in `namespace`, as the Secret the webhook mounts."""
    ca = gen.generate_ca(days=days)
    serving = gen.issue_serving_cert(ca, gen.service_sans(service, namespace), days=days)
    return gen.secret_manifest(ca, serving, namespace=namespace)


def secret_ca(secret: dict[str, Any]) -> bytes:
    """The ca.crt of the TLS Secret; a Secret without one (made by hand for another source) is refused, naming
    it, rather than guessed at."""
    meta = secret.get("metadata") or {}
    data = secret.get("data") or {}
    where = f"Secret {meta.get('namespace')}/{meta.get('name')}"
    missing = [key for key in (CA_CERT_FILE, TLS_CERT_FILE, TLS_KEY_FILE) if not data.get(key)]
    if missing:
        raise ValueError(
            f"{where} has no {', '.join(missing)}: it was not made by `scrubgate certs ensure`. Delete it to have "
            "one made, or keep it and give its CA instead (the chart's certs.source=provided, certs.provided.caBundle)"
        )
    return base64.b64decode(data[CA_CERT_FILE])


def set_ca_bundles(api: Api, configurations: Sequence[str], ca_pem: bytes) -> list[str]:
    """Sets the caBundle of every webhook in each `resource/name` configuration; a line for each. One that
    is not there yet (before a first install) is left for the next run. An update that lost a race with
    another writer is read again and retried."""
    lines = []
    for configuration in configurations:
        path = f"{_ADMISSION}/{configuration}"
        for _ in range(_CONFLICT_RETRIES):
            try:
                current = api.request("GET", path)
            except ApiError as exc:
                if exc.status != 404:
                    raise
                lines.append(f"{configuration}: not there yet; its caBundle is set by the next run")
                break
            if not is_webhook_configuration(current):
                raise ApiError(f"GET {path}: the answer is not a webhook configuration")
            (wanted,) = inject_ca_bundle([current], ca_pem)
            if wanted == current:
                lines.append(f"{configuration}: caBundle already set")
                break
            try:
                api.request("PUT", path, body=wanted)
            except ApiError as exc:
                if exc.status != 409:
                    raise
                continue
            lines.append(f"{configuration}: caBundle set in {len(wanted.get('webhooks') or [])} webhook(s)")
            break
        else:
            raise ApiError(f"PUT {path}: changed by another writer {_CONFLICT_RETRIES} times in a row; run it again")
    return lines


def ensure(
    api: Api,
    namespace: str,
    *,
    service: str,
    days: int,
    configurations: Sequence[str],
    audit_key_secret: str | None,
) -> list[str]:
    """What one run did: a line per Secret and per webhook configuration, for the log."""
    for configuration in configurations:
        resource, _, name = configuration.partition("/")
        if resource not in WEBHOOK_CONFIGURATION_RESOURCES or not name:
            raise ValueError(
                f"--webhook-configuration {configuration!r}: expected validatingwebhookconfigurations/NAME or "
                "mutatingwebhookconfigurations/NAME"
            )
    tls, made = ensure_secret(api, namespace, TLS_SECRET_NAME, lambda: tls_secret(namespace, service, days))
    ca_pem = secret_ca(tls)
    lines = [f"Secret {namespace}/{TLS_SECRET_NAME}: {'made (a new CA)' if made else 'kept'}"]
    if audit_key_secret:
        _, made = ensure_secret(
            api,
            namespace,
            audit_key_secret,
            lambda: gen.audit_key_secret(gen.new_audit_key_pem(), name=audit_key_secret, namespace=namespace),
        )
        lines.append(f"Secret {namespace}/{audit_key_secret}: {'made (a new audit key)' if made else 'kept'}")
    return lines + set_ca_bundles(api, configurations, ca_pem)
