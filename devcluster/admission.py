"""The admission chain: registered mutating webhooks, then validating webhooks, called over HTTPS.

Follows the API server's webhook dispatchers (k8s.io/apiserver/pkg/admission/plugin/webhook):
configurations sorted by name, webhooks in order; ``rules`` with ``*`` and subresources, ``scope``;
``matchPolicy: Equivalent`` sends a request made in one resource.k8s.io version to a webhook that
registered another served version, converted; ``namespaceSelector`` (the namespace's labels; for a
Namespace its own), ``objectSelector`` (object or old object), ``matchConditions`` (a CEL subset,
``devcluster.cel``), ``failurePolicy``, ``timeoutSeconds``, ``reinvocationPolicy: IfNeeded``,
``sideEffects`` with dry run, JSONPatch responses, warnings, and denials as Status errors
(code from the webhook's ``status.code``, at least 400, as ``webhookerrors.ToStatusErr`` does).

Simplifications: validating webhooks run one after another (the API server runs them in
parallel; the outcome is the same); the ``authorizer`` CEL variable does not exist; webhook
configurations are read from the store on every request (no informer lag).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import select
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import jsonpatch

from . import cel
from .auth import UserInfo
from .convert import from_hub, to_hub
from .errors import ApiError, bad_request, internal
from .resources import MUTATING_WEBHOOKS, NAMESPACES, VALIDATING_WEBHOOKS, ResourceType, Surface
from .selectors import label_selector_matcher
from .store import Store

log = logging.getLogger("devcluster.admission")

REVIEW_API_VERSION = "admission.k8s.io/v1"


@dataclass
class Attributes:
    """One request as admission sees it; objects are in storage form."""

    operation: str  # CREATE, UPDATE, DELETE
    rt: ResourceType
    version: str
    namespace: str
    name: str
    user: UserInfo
    obj: dict | None
    old: dict | None
    options: dict
    subresource: str = ""
    dry_run: bool = False
    # pods/binding carries a Binding, not a Pod: (group, version, kind) of what is sent.
    kind_override: tuple[str, str, str] | None = None


class ServiceMap:
    """Where a webhook Service lives: (namespace, name) -> a port on 127.0.0.1.

    There is no cluster DNS; the TLS handshake still names ``<name>.<namespace>.svc`` so the
    serving certificate is checked exactly as the API server would. Entries come from the
    constructor, ``set()`` and a JSON file ``{"namespace/name": port}`` re-read when it changes.
    """

    def __init__(self, static: dict[tuple[str, str], int] | None = None, path: Path | None = None) -> None:
        self._static = dict(static or {})
        self._path = path
        self._file: dict[tuple[str, str], int] = {}
        self._mtime: float | None = None
        self._lock = threading.Lock()

    def set(self, namespace: str, name: str, port: int | None) -> None:
        with self._lock:
            if port is None:
                self._static.pop((namespace, name), None)
            else:
                self._static[(namespace, name)] = port

    def port(self, namespace: str, name: str) -> int | None:
        with self._lock:
            self._reload()
            return self._static.get((namespace, name), self._file.get((namespace, name)))

    def _reload(self) -> None:
        if self._path is None:
            return
        try:
            mtime = self._path.stat().st_mtime
        except FileNotFoundError:
            self._file, self._mtime = {}, None
            return
        if mtime == self._mtime:
            return
        raw = json.loads(self._path.read_text(encoding="utf-8"))
        self._file = {tuple(k.split("/", 1)): int(v) for k, v in raw.items()}  # type: ignore[misc]
        self._mtime = mtime


class WebhookCallError(Exception):
    """The webhook could not be asked or did not answer properly; failurePolicy decides."""


@dataclass
class _Hook:
    config: str
    spec: dict

    @property
    def name(self) -> str:
        return str(self.spec.get("name", ""))

    @property
    def fail_open(self) -> bool:
        return self.spec.get("failurePolicy", "Fail") == "Ignore"


class Admission:
    def __init__(self, store: Store, surface: Surface, services: ServiceMap) -> None:
        self.store = store
        self.surface = surface
        self.services = services
        self._connections = _Connections()

    # ------------------------------------------------------------------ the two phases

    def mutate(self, attrs: Attributes) -> tuple[dict | None, list[str]]:
        """Run mutating webhooks; returns the (possibly patched) object and the warnings."""
        warnings: list[str] = []
        obj = attrs.obj
        hooks = list(self._hooks(MUTATING_WEBHOOKS))
        ran_at: dict[int, int] = {}
        last_change = -1
        step = 0
        for i, hook in enumerate(hooks):
            called, new = self._run(hook, attrs, obj, warnings, mutating=True)
            if not called:
                continue
            ran_at[i] = step
            if new != obj:
                obj, last_change = new, step
            step += 1
        # reinvocationPolicy IfNeeded: once more for webhooks whose view was changed by a later one.
        for i, hook in enumerate(hooks):
            if i in ran_at and hook.spec.get("reinvocationPolicy") == "IfNeeded" and last_change > ran_at[i]:
                _, obj = self._run(hook, attrs, obj, warnings, mutating=True)
        return obj, warnings

    def validate(self, attrs: Attributes) -> list[str]:
        warnings: list[str] = []
        for hook in self._hooks(VALIDATING_WEBHOOKS):
            self._run(hook, attrs, attrs.obj, warnings, mutating=False)
        return warnings

    def _hooks(self, rt: ResourceType) -> Iterator[_Hook]:
        configs, _ = self.store.list(rt.group, rt.plural)
        for config in sorted(configs, key=lambda c: c["metadata"]["name"]):
            for spec in config.get("webhooks") or []:
                yield _Hook(config["metadata"]["name"], spec)

    # ------------------------------------------------------------------ one webhook

    def _run(
        self, hook: _Hook, attrs: Attributes, obj: dict | None, warnings: list[str], mutating: bool
    ) -> tuple[bool, dict | None]:
        version = self._matching_version(hook.spec, attrs)
        if version is None or not self._selectors_match(hook.spec, attrs, obj):
            return False, obj
        sent_obj = self._as_version(attrs, version, obj)
        sent_old = self._as_version(attrs, version, attrs.old)
        review = self._review(attrs, version, sent_obj, sent_old)
        try:
            if not self._conditions_hold(hook, review["request"], sent_obj, sent_old):
                return False, obj
            if attrs.dry_run and hook.spec.get("sideEffects") not in ("None", "NoneOnDryRun"):
                raise bad_request(f'admission webhook "{hook.name}" does not support dry run')
            response = self._call(hook.spec, review)
        except WebhookCallError as e:
            if hook.fail_open:
                log.warning(
                    "webhook %s (%s) failed, failurePolicy Ignore lets %s %s/%s through: %s",
                    hook.name,
                    hook.config,
                    attrs.operation,
                    attrs.namespace,
                    attrs.name,
                    e,
                )
                return True, obj
            raise internal(f'failed calling webhook "{hook.name}": {e}') from e
        warnings.extend(str(w) for w in response.get("warnings") or [])
        if not response.get("allowed"):
            raise _denied(hook.name, response.get("status") or {})
        if not response.get("patch"):
            return True, obj
        if not mutating:
            return True, obj  # the API server ignores patches from validating webhooks
        if response.get("patchType") != "JSONPatch":
            return self._fail(hook, attrs, obj, f"unsupported patchType {response.get('patchType')!r}")
        if sent_obj is None:
            return True, obj  # nothing to patch on DELETE
        try:
            ops = json.loads(base64.b64decode(response["patch"]))
            patched = jsonpatch.JsonPatch(ops).apply(sent_obj)
        except Exception as e:  # any malformed patch is the webhook's failure, as in the API server
            return self._fail(hook, attrs, obj, f"cannot apply its JSONPatch: {e}")
        return True, self._from_version(attrs, version, patched)

    def _fail(self, hook: _Hook, attrs: Attributes, obj: dict | None, why: str) -> tuple[bool, dict | None]:
        if hook.fail_open:
            log.warning("webhook %s: %s; failurePolicy Ignore", hook.name, why)
            return True, obj
        raise internal(f'failed calling webhook "{hook.name}": {why}')

    def _as_version(self, attrs: Attributes, version: str, obj: dict | None) -> dict | None:
        if obj is None or attrs.kind_override is not None:
            return obj
        return from_hub(attrs.rt, version, obj)

    def _from_version(self, attrs: Attributes, version: str, obj: dict) -> dict:
        if attrs.kind_override is not None:
            return obj
        return to_hub(attrs.rt, version, obj)

    # ------------------------------------------------------------------ matching

    def _matching_version(self, spec: dict, attrs: Attributes) -> str | None:
        """The version to send in, or None when no rule matches (``matchPolicy``)."""
        rt = attrs.rt
        candidates = [attrs.version]
        if spec.get("matchPolicy", "Equivalent") == "Equivalent" and attrs.kind_override is None:
            candidates += [v for v in self.surface.versions_of(rt) if v != attrs.version]
        for version in candidates:
            for rule in spec.get("rules") or []:
                if _rule_matches(rule, rt, version, attrs.subresource, attrs.operation):
                    return version
        return None

    def _selectors_match(self, spec: dict, attrs: Attributes, obj: dict | None) -> bool:
        try:
            object_match = label_selector_matcher(spec.get("objectSelector"))
            ns_match = label_selector_matcher(spec.get("namespaceSelector"))
        except ValueError as e:
            raise internal(f'webhook "{spec.get("name")}" has an invalid selector: {e}') from e
        candidates = [o for o in (obj, attrs.old) if o is not None]
        if not any(object_match(_labels(o)) for o in candidates):
            return False
        if attrs.rt is NAMESPACES:
            return any(ns_match(_labels(o)) for o in candidates)
        if not attrs.rt.namespaced:
            return True
        namespace = self.store.get(("", "namespaces", "", attrs.namespace))
        return ns_match(_labels(namespace) if namespace else {})

    def _conditions_hold(self, hook: _Hook, request: dict, obj: dict | None, old: dict | None) -> bool:
        """False when a matchCondition is false; WebhookCallError when one cannot be evaluated."""
        errors = []
        variables = {"object": obj, "oldObject": old, "request": request}
        for condition in hook.spec.get("matchConditions") or []:
            try:
                result = cel.evaluate(condition["expression"], variables)
            except (cel.CelError, KeyError) as e:
                errors.append(f"matchCondition {condition.get('name')!r}: {e}")
                continue
            if result is False:
                return False
            if result is not True:
                errors.append(f"matchCondition {condition.get('name')!r} evaluated to {result!r}, not a bool")
        if errors:
            raise WebhookCallError("; ".join(errors))
        return True

    # ------------------------------------------------------------------ the call

    def _review(self, attrs: Attributes, version: str, obj: dict | None, old: dict | None) -> dict:
        rt = attrs.rt
        if attrs.kind_override is not None:
            group, kind_version, kind = attrs.kind_override
        else:
            group, kind_version, kind = rt.group, version, rt.kind
        request: dict = {
            "uid": str(uuid.uuid4()),  # one per webhook call, as CreateAdmissionObjects does
            "kind": {"group": group, "version": kind_version, "kind": kind},
            "resource": {"group": rt.group, "version": version, "resource": rt.plural},
            "requestKind": {
                "group": group,
                "version": attrs.version if attrs.kind_override is None else kind_version,
                "kind": kind,
            },
            "requestResource": {"group": rt.group, "version": attrs.version, "resource": rt.plural},
            "name": attrs.name,
            "operation": attrs.operation,
            "userInfo": attrs.user.to_json(),
            "object": obj,
            "oldObject": old,
            "dryRun": attrs.dry_run,
            "options": attrs.options,
        }
        if attrs.namespace:
            request["namespace"] = attrs.namespace
        if attrs.subresource:
            request["subResource"] = attrs.subresource
            request["requestSubResource"] = attrs.subresource
        return {"apiVersion": REVIEW_API_VERSION, "kind": "AdmissionReview", "request": request}

    def _call(self, spec: dict, review: dict) -> dict:
        if "v1" not in (spec.get("admissionReviewVersions") or []):
            raise WebhookCallError("admissionReviewVersions does not include v1, the only version devcluster speaks")
        timeout = float(spec.get("timeoutSeconds") or 10)
        target = self._target(spec.get("clientConfig") or {}, timeout)
        url = f"https://{target.host}:{target.port}{target.path}"
        body = json.dumps(review).encode()
        try:
            resp, payload = self._connections.post(target, body, timeout)
        except TimeoutError as e:
            raise WebhookCallError(f'failed to call webhook: Post "{url}": context deadline exceeded') from e
        except (OSError, http.client.HTTPException, ssl.SSLError) as e:
            raise WebhookCallError(f'failed to call webhook: Post "{url}": {e}') from e
        if resp.status != 200:
            raise WebhookCallError(f"received invalid webhook response: HTTP {resp.status}: {payload[:200]!r}")
        try:
            answer = json.loads(payload)
        except ValueError as e:
            raise WebhookCallError(f"received invalid webhook response: {e}") from e
        response = answer.get("response") if isinstance(answer, dict) else None
        if (
            not isinstance(response, dict)
            or answer.get("apiVersion") != REVIEW_API_VERSION
            or answer.get("kind") != "AdmissionReview"
        ):
            raise WebhookCallError("received invalid webhook response: not an admission.k8s.io/v1 AdmissionReview")
        if response.get("uid") != review["request"]["uid"]:
            raise WebhookCallError(f"expected response.uid={review['request']['uid']!r}, got {response.get('uid')!r}")
        if not isinstance(response.get("allowed"), bool):
            raise WebhookCallError("received invalid webhook response: response.allowed is not a bool")
        return response

    def _target(self, client_config: dict, timeout: float) -> _Target:
        try:
            ca = base64.b64decode(client_config.get("caBundle") or "").decode()
            tls = self._connections.tls_context(ca)
        except (ValueError, ssl.SSLError) as e:
            raise WebhookCallError(f"invalid caBundle: {e}") from e
        if "url" in client_config:
            parts = urlsplit(client_config["url"])
            host, port = parts.hostname or "", parts.port or 443
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            address = (host, port)
        elif "service" in client_config:
            svc = client_config["service"]
            host = f"{svc['name']}.{svc['namespace']}.svc"
            port = int(svc.get("port") or 443)
            path = svc.get("path") or "/"
            local = self.services.port(svc["namespace"], svc["name"])
            if local is None:
                raise WebhookCallError(
                    f'service "{svc["namespace"]}/{svc["name"]}" has no endpoints '
                    "(devcluster: no --service mapping for it)"
                )
            address = ("127.0.0.1", local)
        else:
            raise WebhookCallError("clientConfig has neither url nor service")
        sep = "&" if "?" in path else "?"
        path = f"{path}{sep}timeout={int(timeout)}s"
        return _Target(host, port, path, tls, address, ca)


@dataclass
class _Target:
    host: str  # what TLS verifies (the service's DNS name)
    port: int
    path: str
    tls: ssl.SSLContext
    address: tuple[str, int]  # where to dial
    ca: str

    def dial(self, _address: object, timeout: float, source: object = None) -> socket.socket:
        return socket.create_connection(self.address, timeout, source)  # type: ignore[arg-type]


class _Connections:
    """Kept-alive HTTPS connections to webhooks, as the API server keeps its connections to them open
    (a TLS handshake per call costs more than the call). A connection is reused only while it is young
    and was used a moment ago; idle ones are closed soon, and at once when the webhook closes its end (a
    webhook shutting down waits for the peer's TLS close); a rotated serving certificate reaches new
    handshakes within ``MAX_AGE_S``. A kept connection the webhook closed just as it was reused fails
    before any answer; the request is then sent once more on a fresh one (Go's transport does the same
    for a connection the server closed). TLS contexts are kept per caBundle."""

    MAX_IDLE_S = 1.0
    MAX_AGE_S = 10.0
    REAP_S = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple, list[tuple[http.client.HTTPSConnection, float, float]]] = {}
        self._contexts: dict[str, ssl.SSLContext] = {}
        self._reaping = False

    def tls_context(self, ca: str) -> ssl.SSLContext:
        with self._lock:
            context = self._contexts.get(ca)
        if context is None:
            context = ssl.create_default_context(cadata=ca) if ca.strip() else ssl.create_default_context()
            with self._lock:
                if len(self._contexts) > 16:
                    self._contexts.clear()
                self._contexts[ca] = context
        return context

    def post(self, target: _Target, body: bytes, timeout: float) -> tuple[http.client.HTTPResponse, bytes]:
        key = (target.address, target.host, target.ca)
        while True:
            conn, born = self._take(key)
            reused = conn is not None
            if conn is None:
                conn = http.client.HTTPSConnection(target.host, target.port, timeout=timeout, context=target.tls)
                # Dial the mapped local address while TLS still verifies the service's DNS name.
                conn._create_connection = target.dial  # type: ignore[attr-defined]
                born = time.monotonic()
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request(
                    "POST",
                    target.path,
                    body=body,
                    headers={"Content-Type": "application/json", "Accept": "application/json"},
                )
                resp = conn.getresponse()
                payload = resp.read()
            except (ConnectionError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
                conn.close()
                if reused:
                    continue  # the webhook had closed it: once more on a fresh connection
                raise
            except BaseException:
                conn.close()
                raise
            if resp.will_close:
                conn.close()
            else:
                self._keep(key, conn, born)
            return resp, payload

    def _usable(self, conn: http.client.HTTPSConnection, born: float, used: float, now: float) -> bool:
        if now - used >= self.MAX_IDLE_S or now - born >= self.MAX_AGE_S or conn.sock is None:
            return False
        try:  # an idle connection has nothing to read: readable means the webhook closed it
            return not select.select([conn.sock], [], [], 0)[0]
        except (OSError, ValueError):
            return False

    def _take(self, key: tuple) -> tuple[http.client.HTTPSConnection | None, float]:
        now = time.monotonic()
        stale = []
        found: tuple[http.client.HTTPSConnection | None, float] = (None, now)
        with self._lock:
            idle = self._idle.get(key) or []
            while idle:
                conn, born, used = idle.pop()
                if self._usable(conn, born, used, now):
                    found = (conn, born)
                    break
                stale.append(conn)
        for conn in stale:
            conn.close()
        return found

    def _keep(self, key: tuple, conn: http.client.HTTPSConnection, born: float) -> None:
        with self._lock:
            self._idle.setdefault(key, []).append((conn, born, time.monotonic()))
            if self._reaping:
                return
            self._reaping = True
        threading.Thread(target=self._reap, name="devcluster-webhook-connections", daemon=True).start()

    def _reap(self) -> None:
        """Closes connections that went idle, until none is left open (then the thread ends)."""
        while True:
            time.sleep(self.REAP_S)
            now = time.monotonic()
            stale = []
            with self._lock:
                for key, idle in list(self._idle.items()):
                    usable = [entry for entry in idle if self._usable(*entry, now)]
                    stale += [entry[0] for entry in idle if entry not in usable]
                    idle[:] = usable
                    if not idle:
                        del self._idle[key]
                done = not self._idle
                if done:
                    self._reaping = False
            for conn in stale:
                conn.close()
            if done:
                return


def _labels(obj: dict | None) -> dict:
    return dict(((obj or {}).get("metadata") or {}).get("labels") or {})


def _rule_matches(rule: dict, rt: ResourceType, version: str, subresource: str, operation: str) -> bool:
    def listed(values: list | None, value: str) -> bool:
        return bool(values) and ("*" in values or value in values)

    if not listed(rule.get("operations"), operation):
        return False
    if not listed(rule.get("apiGroups"), rt.group) or not listed(rule.get("apiVersions"), version):
        return False
    scope = rule.get("scope", "*")
    if (scope == "Namespaced" and not rt.namespaced) or (scope == "Cluster" and rt.namespaced):
        return False
    for entry in rule.get("resources") or []:
        resource, _, sub = entry.partition("/")
        if resource in ("*", rt.plural) and (sub == subresource or (sub == "*" and "/" in entry)):
            return True
    return False


def _denied(name: str, status: dict) -> ApiError:
    code = int(status.get("code") or 0)
    code = max(code, 400)
    reason = str(status.get("reason") or "")
    prefix = f'admission webhook "{name}" denied the request'
    if status.get("message"):
        message = f"{prefix}: {status['message']}"
    elif reason:
        message = f"{prefix}: {reason}"
    else:
        message = f"{prefix} without explanation"
    return ApiError(code, reason, message, status.get("details"))
