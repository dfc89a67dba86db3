"""The webhook's ASGI apps: the admission endpoints (decode, decide, audit, measure, answer), the probes, /metrics.

Tenancy without API calls: the API server does not send namespace labels, so the
ValidatingWebhookConfiguration has two webhooks split by a namespaceSelector on
`scrubgate.dev/tenancy`: namespaces labelled trusted call `/validate/trusted`, every other namespace
calls `/validate`. The path is the only source of trust; `/validate` is multi-tenant (fail closed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any, Protocol

from scrubgate.policies.attestation import rfc3339
from scrubgate.policies.config import PolicyConfig
from scrubgate.policies.selectors import UNKNOWN, DeviceClasses

from . import handlers, responses
from .defaults import (
    HEAVY_BODY_BYTES,
    MAX_BODY_BYTES,
    MAX_FINDINGS_SHOWN,
    REPEAT_KEYS,
    REPEAT_WINDOW_S,
)
from .fairlane import FairLane, tenant
from .handlers import Outcome
from .http11 import Receive, Scope, Send
from .metrics import CONTENT_TYPE, Metrics
from .policy_reload import PolicySource
from .repeats import RepeatedRefusals, refusal_key
from .review import AdmissionRequest
from .tls import CLIENT_VERDICT, ServingTLS
from .transport import (
    TransportError,
    check_content_type,
    decode,
    encode,
    encode_error,
    read_body,
    request_timeout,
)

log = logging.getLogger(__name__)
audit_log = logging.getLogger("scrubgate.audit")

JSON = b"application/json"


class AuditSink(Protocol):
    @property
    def ready(self) -> bool: ...

    async def append(self, fields: Mapping[str, Any]) -> Mapping[str, Any]: ...


class LogAuditSink:
    """Without --audit-log, records go to the structured log only: unchained, as durable as the log."""

    ready = True

    async def append(self, fields: Mapping[str, Any]) -> Mapping[str, Any]:
        audit_log.info("audit record", extra={"audit": dict(fields)})
        return fields


@dataclass
class WebhookState:
    policy: PolicySource
    metrics: Metrics
    tls: ServingTLS
    audit: AuditSink
    max_body_bytes: int = MAX_BODY_BYTES
    require_client_cert: bool = False
    watch_interval: float = 2.0
    heavy_body_bytes: int = HEAVY_BODY_BYTES
    heavy_lane: FairLane = field(default_factory=FairLane)
    repeats: RepeatedRefusals = field(default_factory=lambda: RepeatedRefusals(REPEAT_WINDOW_S, REPEAT_KEYS))
    # The cluster's DeviceClasses under a policy (device_classes.py); without them every class is unknown, hence
    # every claim guarded.
    classes: Callable[[PolicyConfig], DeviceClasses] = lambda _policy: UNKNOWN
    classes_synced: Callable[[], bool] = lambda: False


def audit_fields(
    request: AdmissionRequest, outcome: Outcome, policy: PolicyConfig, webhook: str, repeats_unrecorded: int = 0
) -> dict[str, Any]:
    """The record of one decision. Of many findings it keeps the first MAX_FINDINGS_SHOWN and counts all by rule,
    so that one request's record stays small; `repeatsUnrecorded` counts identical refusals left out before it."""
    meta = (request.object or request.old_object or {}).get("metadata") or {}
    findings = outcome.findings
    fields = {
        "time": rfc3339(datetime.now(UTC)),
        "uid": request.uid,
        "webhook": webhook,
        "operation": request.operation,
        "apiVersion": request.api_version,
        "kind": request.kind_name,
        "subResource": request.sub_resource,
        "namespace": request.namespace,
        "name": request.name or meta.get("name") or "",
        "generateName": meta.get("generateName") or "",
        "user": request.username,
        "groups": list(request.groups),
        "decision": outcome.decision,
        "dryRun": request.dry_run,
        "findings": [finding.to_dict() for finding in findings[:MAX_FINDINGS_SHOWN]],
        "policyDigest": policy.digest,
    }
    if len(findings) > MAX_FINDINGS_SHOWN:
        fields["findingsOmitted"] = len(findings) - MAX_FINDINGS_SHOWN
        fields["findingsByRule"] = dict(Counter(finding.rule for finding in findings))
    if repeats_unrecorded:
        fields["repeatsUnrecorded"] = repeats_unrecorded
    return fields


_INDEX = re.compile(r"/[0-9]+(?=/|$)")


def refusal_reason(path: str) -> str:
    """A finding's field as a metric label: list indices as `*`, so that the label set stays small."""
    return _INDEX.sub("/*", path) or "(object)"


Handler = Callable[[AdmissionRequest, PolicyConfig, DeviceClasses], Outcome]
EXPIRED = 503  # the HTTP status of a request not evaluated because its caller stopped waiting


@dataclass(frozen=True, slots=True)
class Decided:
    """A decision and what the event loop needs of it: the findings counted, by (rule, action) and, of the deny
    findings, by (rule, reason), so that the loop does not walk thousands of them."""

    request: AdmissionRequest
    outcome: Outcome
    policy: PolicyConfig
    hits: Counter[tuple[str, str]]
    refusals: Counter[tuple[str, str]]


def _metadata_only(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if obj is None else {"metadata": obj.get("metadata") or {}}


class AdmissionEndpoint:
    """POST handler of one admission path: decode, decide, audit, measure, answer."""

    def __init__(self, state: WebhookState, webhook: str, handler: Handler) -> None:
        self.state, self.webhook, self.handler = state, webhook, handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status, body = await self.admit(scope, receive)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def admit(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        state, metrics, webhook = self.state, self.state.metrics, self.webhook
        started = time.perf_counter()
        try:
            if state.require_client_cert:
                # The server's verdict on the connection's client certificate (listeners.py).
                client = scope.get("state", {}).get(CLIENT_VERDICT)
                if client is None or not client.allowed:
                    raise TransportError(403, client.refusal if client else "a client certificate is required")
            headers = dict(scope["headers"])
            check_content_type(headers.get(b"content-type"))
            body = await read_body(headers.get(b"content-length"), receive, state.max_body_bytes)
            if len(body) > state.heavy_body_bytes:
                # Decoding and evaluating a big object takes long enough to hold up every small request behind
                # it: a worker thread does it (and frees the object), the event loop keeps serving; tenants
                # take turns there (fairlane.py), so that one tenant's flood does not hold up the others.
                timeout = request_timeout(scope.get("query_string", b""))
                deadline = started + timeout if timeout is not None else None
                work = partial(self.decide, body, deadline, heavy=True)
                decided = await asyncio.wrap_future(state.heavy_lane.submit(tenant(body), work))
            else:
                decided = self.decide(body)
        except TransportError as err:
            decision = "expired" if err.status == EXPIRED else "invalid"
            metrics.admission.count(webhook, "", "", decision, time.perf_counter() - started)
            log.warning(
                "refused a malformed admission request on %s: %s", webhook, err.message, extra={"status": err.status}
            )
            return err.status, encode_error(err)

        request, outcome, policy = decided.request, decided.outcome, decided.policy
        for (rule, action), count in decided.hits.items():
            metrics.admission.hit(rule, action, count)
        for (rule, reason), count in decided.refusals.items():
            metrics.refusals.labels(rule, reason).inc(count)
        if outcome.audited:
            left_out = state.repeats.record(refusal_key(request, outcome.findings)) if outcome.decision == "deny" else 0
            if left_out is None:
                metrics.audit_repeats_unrecorded.inc()
            else:
                outcome = await self._audit(request, outcome, policy, left_out)
        metrics.admission.count(
            webhook, request.operation, request.kind_name, outcome.decision, time.perf_counter() - started
        )
        if outcome.decision in ("deny", "warn", "audit"):
            log.info(
                "%s %s %s: %s",
                outcome.decision,
                request.operation,
                handlers.describe(request),
                ", ".join(sorted({f"{f.rule}/{f.action}" for f in outcome.findings})),
                extra={"uid": request.uid, "user": request.username, "dry_run": request.dry_run},
            )
        return 200, encode(outcome.response)

    def decide(self, body: bytes, deadline: float | None = None, *, heavy: bool = False) -> Decided:
        """Decodes and evaluates; raises TransportError for a malformed request, or one whose `deadline` (the
        API server's timeout, on the perf_counter clock) passed while it waited. Touches no shared state but the
        policy in force, so it may run on a worker thread; `heavy` keeps only the objects' metadata (all that
        the audit record reads), so that the big objects are freed on that thread."""
        if deadline is not None and time.perf_counter() > deadline:
            # Nobody waits for the answer any more (the API server has refused the request): leave the worker
            # to the requests that may still be answered in time.
            raise TransportError(EXPIRED, "the API server's timeout passed while this request waited; not evaluated")
        request = decode(body)
        policy = self.state.policy.policy
        try:
            outcome = self.handler(request, policy, self.state.classes(policy))
        except Exception as exc:
            log.exception(
                "policy evaluation failed for %s %s (uid %s); refusing it (fail closed)",
                request.operation,
                handlers.describe(request),
                request.uid,
            )
            outcome = Outcome(
                responses.errored(
                    request.uid,
                    f"scrubgate could not evaluate {handlers.describe(request)} ({type(exc).__name__}: {exc}); "
                    "the request is refused until the webhook can evaluate it; see the webhook's logs",
                ),
                "error",
            )
        findings = outcome.findings
        refusals = (
            Counter((f.rule, refusal_reason(f.path)) for f in findings if f.action == "deny")
            if outcome.decision == "deny"
            else Counter()
        )
        if heavy:
            slim = {"object": _metadata_only(request.object), "old_object": _metadata_only(request.old_object)}
            request = request.model_copy(update=slim)
        return Decided(request, outcome, policy, Counter((f.rule, f.action) for f in findings), refusals)

    async def _audit(self, request: AdmissionRequest, outcome: Outcome, policy: PolicyConfig, left_out: int) -> Outcome:
        fields = audit_fields(request, outcome, policy, self.webhook, left_out)
        try:
            await self.state.audit.append(fields)
        except Exception as exc:
            self.state.metrics.audit_write_errors.inc()
            log.error(
                "audit record for %s (uid %s) could not be written: %s; record follows in this log",
                handlers.describe(request),
                request.uid,
                exc,
                extra={"audit": fields},
            )
            if outcome.decision == "deny":
                return outcome  # still refused; the record survives in the log line above
            # An allow must not go unrecorded: refuse until the audit log can be written.
            return Outcome(
                responses.errored(request.uid, f"scrubgate cannot write its audit log ({exc}); request refused"),
                "error",
                outcome.findings,
            )
        self.state.metrics.audit_records.inc()
        return outcome


Page = Callable[[], tuple[int, bytes, bytes]]  # (status, content type, body)


async def _answer(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class WebhookApp:
    """The ASGI app of one port: admission paths (POST, straight to their AdmissionEndpoint) and pages (GET)."""

    def __init__(self, admission: Mapping[str, AdmissionEndpoint], pages: Mapping[str, Page]) -> None:
        self.admission, self.pages = admission, pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        endpoint = self.admission.get(path)
        if endpoint is not None:
            if method == "POST":
                await endpoint(scope, receive, send)
            else:
                await _answer(send, 405, [(b"allow", b"POST")])
            return
        page = self.pages.get(path)
        if page is None:
            await _answer(send, 404, [(b"content-type", JSON)], b'{"status":"not found"}')
        elif method not in ("GET", "HEAD"):
            await _answer(send, 405, [(b"allow", b"GET, HEAD")])
        else:
            status, content_type, body = page()
            await _answer(send, status, [(b"content-type", content_type)], body)


def _probes(state: WebhookState) -> dict[str, Page]:
    def healthz() -> tuple[int, bytes, bytes]:
        return 200, JSON, b'{"status":"ok"}'

    def readyz() -> tuple[int, bytes, bytes]:
        # Policy and certificate are loaded before the server starts (it refuses to start otherwise); what
        # can fail later is the audit writer, without which no deny or warn can be answered.
        problems = []
        if not state.tls.loaded:
            problems.append("no serving certificate loaded")
        if not state.audit.ready:
            problems.append("the audit log writer is not running")
        if problems:
            return 503, JSON, json.dumps({"status": "not ready", "problems": problems}).encode()
        # Informational, not a readiness condition: before the DeviceClasses are read, every claim is guarded
        # (more, never less), which is better than refusing every guarded write for want of an endpoint.
        return 200, JSON, json.dumps({"status": "ready", "deviceClasses": state.classes_synced()}).encode()

    return {"/healthz": healthz, "/readyz": readyz}


def create_app(state: WebhookState) -> WebhookApp:
    """The admission port's app: the admission paths, and the probes (for callers without a client certificate,
    such as `helm test`); not /metrics, which is the metrics port's."""
    admission = {
        "/validate": AdmissionEndpoint(state, "/validate", partial(handlers.handle_validate, trusted=False)),
        "/validate/trusted": AdmissionEndpoint(
            state, "/validate/trusted", partial(handlers.handle_validate, trusted=True)
        ),
        "/mutate": AdmissionEndpoint(state, "/mutate", handlers.handle_mutate),
    }
    return WebhookApp(admission, _probes(state))


def create_metrics_app(state: WebhookState) -> WebhookApp:
    """The metrics port's app: /metrics and the probes."""
    metrics = state.metrics

    def metrics_page() -> tuple[int, bytes, bytes]:
        return 200, CONTENT_TYPE.encode(), metrics.render()

    return WebhookApp({}, {**_probes(state), "/metrics": metrics_page})
