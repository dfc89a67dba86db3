"""Request semantics: what GET, LIST, WATCH, CREATE, UPDATE, PATCH and DELETE do to the store,
with admission around every write. The HTTP layer (``apiserver``) and the in-process
controllers both come through here, so both see the same behaviour and the same webhooks.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import strategy
from .admission import Admission, Attributes
from .auth import UserInfo
from .convert import from_hub, hub_version, to_hub
from .errors import STALE, ApiError, already_exists, bad_request, conflict, forbidden, invalid, not_found
from .patching import apply_patch
from .resources import NAMESPACES, PODS, ResourceType, Surface, subresource_allowed
from .selectors import parse_field_selector, parse_label_selector
from .store import Exists, Expired, Key, Missing, Stale, Store

META_V1 = "meta.k8s.io/v1"
_RETRIES = 20
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # apimachinery's SimpleNameGenerator alphabet
_SYSTEM_FIELDS = (
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "selfLink",
    "managedFields",
)
_KEPT_ON_UPDATE = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "namespace",
    "name",
)


def now_rfc3339(offset_s: float = 0) -> str:
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=offset_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Call:
    """Who asks for what: the parts of a request that every verb needs."""

    user: UserInfo
    rt: ResourceType
    version: str
    namespace: str = ""
    name: str = ""
    subresource: str = ""
    dry_run: bool = False

    @property
    def key(self) -> Key:
        return (self.rt.group, self.rt.plural, self.namespace if self.rt.namespaced else "", self.name)


Result = tuple[dict, list[str]]  # object (in the request's version) and admission warnings


class Api:
    def __init__(self, store: Store, surface: Surface, admission: Admission) -> None:
        self.store = store
        self.surface = surface
        self.admission = admission

    # ------------------------------------------------------------------ reads

    def get(self, call: Call) -> dict:
        obj = self.store.get(call.key)
        if obj is None:
            raise not_found(call.rt, call.name)
        return from_hub(call.rt, call.version, obj)

    def list(
        self, call: Call, label_selector: str = "", field_selector: str = "", limit: int = 0, continue_token: str = ""
    ) -> dict:
        rt = call.rt
        match = self._matcher(rt, label_selector, field_selector)
        items, rv = self.store.list(rt.group, rt.plural, call.namespace if rt.namespaced and call.namespace else None)
        items = [i for i in items if match(i)]
        meta: dict = {"resourceVersion": str(rv)}
        if continue_token:
            try:
                after = json.loads(base64.urlsafe_b64decode(continue_token))
            except ValueError as e:
                raise bad_request(f"invalid continue token: {e}") from e
            items = [i for i in items if _sort_key(i) > tuple(after)]
        if limit and len(items) > limit:
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(list(_sort_key(items[-1]))).encode()).decode()
        out_items = []
        for item in items:
            converted = from_hub(rt, call.version, item)
            converted.pop("kind", None)
            converted.pop("apiVersion", None)
            out_items.append(converted)
        return {
            "kind": f"{rt.kind}List",
            "apiVersion": rt.api_version(call.version),
            "metadata": meta,
            "items": out_items,
        }

    def _matcher(self, rt: ResourceType, label_selector: str, field_selector: str) -> Callable[[dict], bool]:
        labels = parse_label_selector(label_selector)
        fields = parse_field_selector(rt, field_selector)
        return lambda obj: labels((obj.get("metadata") or {}).get("labels") or {}) and fields(obj)

    def watch(
        self,
        call: Call,
        label_selector: str = "",
        field_selector: str = "",
        resource_version: str = "",
        timeout_s: float = 1800,
        bookmarks: bool = False,
        stopped: Callable[[], bool] = lambda: False,
        bookmark_interval_s: float = 5.0,
    ) -> Iterator[dict]:
        """Watch events as dicts ``{"type", "object"}``; an expired resourceVersion ends with an ERROR event.

        Bad selectors or resourceVersions raise here, before the first event is asked for.
        """
        match = self._matcher(call.rt, label_selector, field_selector)
        start = None if resource_version in ("", "0") else _parse_rv(resource_version)
        return self._events(call, match, start, timeout_s, bookmarks, stopped, bookmark_interval_s)

    def _events(
        self,
        call: Call,
        match: Callable[[dict], bool],
        start: int | None,
        timeout_s: float,
        bookmarks: bool,
        stopped: Callable[[], bool],
        bookmark_interval_s: float,
    ) -> Iterator[dict]:
        rt = call.rt
        namespace = call.namespace if rt.namespaced else ""
        try:
            if start is None:
                items, pos = self.store.list(rt.group, rt.plural, namespace or None)
                for item in items:
                    if match(item):
                        yield {"type": "ADDED", "object": from_hub(rt, call.version, item)}
            else:
                pos = start
                if pos > self.store.resource_version:
                    # Newer than anything this server has: it lost its history (restarted without
                    # --state-dir). 410 makes the client relist instead of silently missing events.
                    raise Expired(pos, self.store.resource_version)
                self.store.check_resumable(pos)
            deadline = time.monotonic() + timeout_s
            last_bookmark = time.monotonic()
            while not stopped() and not self.store.closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                events = self.store.events_after(pos, min(remaining, bookmark_interval_s if bookmarks else 1.0))
                for ev in events:
                    pos = ev.rv
                    if ev.key[0] != rt.group or ev.key[1] != rt.plural or (namespace and ev.key[2] != namespace):
                        continue
                    kind = _watch_type(
                        ev.type, ev.type != "DELETED" and match(ev.obj), ev.old is not None and match(ev.old)
                    )
                    if kind:
                        yield {"type": kind, "object": from_hub(rt, call.version, ev.obj)}
                if bookmarks and not events and time.monotonic() - last_bookmark >= bookmark_interval_s:
                    last_bookmark = time.monotonic()
                    yield {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": rt.kind,
                            "apiVersion": rt.api_version(call.version),
                            "metadata": {"resourceVersion": str(pos)},
                        },
                    }
        except Expired as e:
            yield {"type": "ERROR", "object": ApiError(410, "Expired", str(e)).status()}

    # ------------------------------------------------------------------ create

    def create(self, call: Call, body: object) -> Result:
        rt = call.rt
        if call.subresource == "binding" and rt is PODS:
            return self._bind(call, body)
        if call.subresource:
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on {call.subresource}")
        obj = self._decode(call, body)
        meta = obj.setdefault("metadata", {})
        for system in _SYSTEM_FIELDS:
            meta.pop(system, None)
        if not meta.get("name") and not meta.get("generateName"):
            raise invalid(rt, "", [("metadata.name", "Required value: name or generateName is required")])
        self._check_namespace_open(call, meta.get("name") or meta.get("generateName", ""))
        strategy.apply_defaults(rt, obj)
        attrs = Attributes(
            "CREATE",
            rt,
            call.version,
            call.namespace,
            meta.get("name", ""),
            call.user,
            obj,
            None,
            _options("CreateOptions", call.dry_run),
            dry_run=call.dry_run,
        )
        mutated, warnings = self.admission.mutate(attrs)
        # What mutation may not touch, then BeforeCreate: the generated name, defaults, status reset.
        obj = self._keep_identity(mutated or obj, meta)
        meta = obj["metadata"]
        if not meta.get("name"):
            meta["name"] = meta["generateName"] + "".join(random.choice(_NAME_CHARS) for _ in range(5))
        strategy.apply_defaults(rt, obj)
        strategy.initial_status(rt, obj)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        strategy.drop_empty(obj)
        self._validate(rt, obj, None)
        call = _with_name(call, meta["name"])
        attrs.obj = obj
        warnings += self.admission.validate(attrs)
        if call.dry_run:
            return from_hub(rt, call.version, obj), warnings
        try:
            stored = self.store.create(call.key, obj)
        except Exists:
            raise already_exists(rt, meta["name"]) from None
        return from_hub(rt, call.version, stored), warnings

    def _bind(self, call: Call, body: object) -> Result:
        if not isinstance(body, dict) or body.get("kind", "Binding") != "Binding":
            raise bad_request("pods/binding takes a Binding")
        node = ((body.get("target") or {}).get("name")) or ""
        if not node:
            raise invalid(PODS, call.name, [("target.name", "Required value")])
        attrs = Attributes(
            "CREATE",
            PODS,
            call.version,
            call.namespace,
            call.name,
            call.user,
            body,
            None,
            _options("CreateOptions", call.dry_run),
            subresource="binding",
            dry_run=call.dry_run,
            kind_override=("", "v1", "Binding"),
        )
        _, warnings = self.admission.mutate(attrs)
        warnings += self.admission.validate(attrs)
        for _ in range(_RETRIES):
            pod = self.store.get(call.key)
            if pod is None:
                raise not_found(PODS, call.name)
            if pod["metadata"].get("deletionTimestamp"):
                raise conflict(PODS, call.name, "pod is being deleted, cannot be assigned to a host")
            if pod.get("spec", {}).get("nodeName"):
                raise conflict(
                    PODS, call.name, f'pod {call.name} is already assigned to node "{pod["spec"]["nodeName"]}"'
                )
            pod["spec"]["nodeName"] = node
            conditions = [
                c for c in pod.setdefault("status", {}).get("conditions") or [] if c.get("type") != "PodScheduled"
            ]
            pod["status"]["conditions"] = [
                *conditions,
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()},
            ]
            if call.dry_run:
                break
            try:
                self.store.replace(call.key, pod, pod["metadata"]["resourceVersion"])
                break
            except Stale:
                continue
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, warnings

    # ------------------------------------------------------------------ update and patch

    def update(self, call: Call, body: object) -> Result:
        new_body = self._decode(call, body)
        body_name = new_body.get("metadata", {}).get("name")
        if body_name and body_name != call.name:
            raise bad_request(f"the name of the object ({body_name}) does not match the name on the URL ({call.name})")
        return self._update(call, lambda _old: copy.deepcopy(new_body), "UpdateOptions")

    def patch(self, call: Call, content_type: str, body: object) -> Result:
        rt = call.rt

        def patched(old: dict) -> dict:
            current = from_hub(rt, call.version, old)
            result = apply_patch(content_type, rt.plural, current, body)
            if not isinstance(result, dict):
                raise bad_request("patch result is not an object")
            return to_hub(rt, call.version, result)

        return self._update(call, patched, "UpdateOptions")

    def _update(self, call: Call, compute: Callable[[dict], dict], options_kind: str) -> Result:
        rt = call.rt
        if call.subresource and (call.subresource == "binding" or not subresource_allowed(rt, call.subresource)):
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on {call.subresource}")
        for _ in range(_RETRIES):
            old = self.store.get(call.key)
            if old is None:
                raise not_found(rt, call.name)
            old_rv = old["metadata"]["resourceVersion"]
            new = compute(old)
            new_rv = str((new.get("metadata") or {}).get("resourceVersion") or "")
            if new_rv and new_rv != old_rv:
                raise conflict(rt, call.name, STALE)
            body_uid = (new.get("metadata") or {}).get("uid")
            if body_uid and body_uid != old["metadata"]["uid"]:
                raise conflict(
                    rt,
                    call.name,
                    f"Precondition failed: UID in precondition: {body_uid}, "
                    f"UID in object meta: {old['metadata']['uid']}",
                )
            new = self._prepare_update(call, old, new)
            attrs = Attributes(
                "UPDATE",
                rt,
                call.version,
                call.namespace,
                call.name,
                call.user,
                new,
                old,
                _options(options_kind, call.dry_run),
                subresource=call.subresource,
                dry_run=call.dry_run,
            )
            mutated, warnings = self.admission.mutate(attrs)
            new = self._prepare_update(call, old, mutated or new)
            strategy.drop_empty(new)
            self._validate(rt, new, old)
            attrs.obj = new
            warnings += self.admission.validate(attrs)
            if call.dry_run:
                return from_hub(rt, call.version, new), warnings
            try:
                if _deletion_complete(new):
                    stored = self.store.remove(call.key, old_rv)
                else:
                    stored = self.store.replace(call.key, new, old_rv)
            except Stale:
                continue  # changed meanwhile: redo against the newer object (a stale client RV conflicts above)
            except Missing:
                raise not_found(rt, call.name) from None
            return from_hub(rt, call.version, stored), warnings
        raise conflict(rt, call.name, STALE)

    def _prepare_update(self, call: Call, old: dict, new: dict) -> dict:
        rt = call.rt
        new = copy.deepcopy(new)
        if call.subresource == "status":
            # Only status changes through /status (ResetObjectMetaForStatus keeps all metadata).
            result = copy.deepcopy(old)
            if "status" in new:
                result["status"] = new["status"]
            else:
                result.pop("status", None)
            return result
        meta = new.setdefault("metadata", {})
        old_meta = old["metadata"]
        for name in _KEPT_ON_UPDATE:
            if name in old_meta:
                meta[name] = old_meta[name]
            else:
                meta.pop(name, None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        meta.pop("managedFields", None)
        if rt.status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        strategy.apply_defaults(rt, new)
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise forbidden(
                    rt,
                    call.name,
                    f"no new finalizers can be added if the object is being deleted, "
                    f"found new finalizers {sorted(added)}",
                )
        if _spec_of(new) != _spec_of(old):
            meta["generation"] = int(old_meta.get("generation") or 1) + 1
        return new

    # ------------------------------------------------------------------ delete

    def delete(self, call: Call, options: dict | None) -> Result:
        rt = call.rt
        options = dict(options or {})
        if call.subresource:
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on {call.subresource}")
        for _ in range(_RETRIES):
            old = self.store.get(call.key)
            if old is None:
                raise not_found(rt, call.name)
            _check_preconditions(rt, call.name, old, options.get("preconditions") or {})
            attrs = Attributes(
                "DELETE",
                rt,
                call.version,
                call.namespace,
                call.name,
                call.user,
                None,
                old,
                {**options, "kind": "DeleteOptions", "apiVersion": META_V1},
                dry_run=call.dry_run,
            )
            _, warnings = self.admission.mutate(attrs)
            warnings += self.admission.validate(attrs)
            new = _mark_deleted(rt, old, options)
            if call.dry_run:
                return from_hub(rt, call.version, new or old), warnings
            try:
                if new is None:
                    stored = self.store.remove(call.key, old["metadata"]["resourceVersion"])
                elif new == old:
                    stored = old
                else:
                    stored = self.store.replace(call.key, new, old["metadata"]["resourceVersion"])
            except Stale:
                continue
            except Missing:
                raise not_found(rt, call.name) from None
            return from_hub(rt, call.version, stored), warnings
        raise conflict(rt, call.name, STALE)

    def finalize_namespace(self, name: str) -> None:
        """The namespace controller's last step: drop the ``kubernetes`` finalizer once it is empty."""
        key: Key = ("", "namespaces", "", name)
        for _ in range(_RETRIES):
            ns = self.store.get(key)
            if ns is None or not ns["metadata"].get("deletionTimestamp"):
                return
            ns.setdefault("spec", {})["finalizers"] = [
                f for f in ns["spec"].get("finalizers") or [] if f != "kubernetes"
            ]
            try:
                if _deletion_complete(ns):
                    self.store.remove(key, ns["metadata"]["resourceVersion"])
                else:
                    self.store.replace(key, ns, ns["metadata"]["resourceVersion"])
                return
            except Stale:
                continue

    # ------------------------------------------------------------------ helpers

    def _decode(self, call: Call, body: object) -> dict:
        rt = call.rt
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        expected = rt.api_version(call.version)
        if body.get("apiVersion") and body["apiVersion"] != expected:
            raise bad_request(
                f"the API version in the data ({body['apiVersion']}) does not match the expected "
                f"API version ({expected})"
            )
        if body.get("kind") and body["kind"] != rt.kind:
            raise bad_request(f"the kind in the data ({body['kind']}) does not match the expected kind ({rt.kind})")
        obj = to_hub(rt, call.version, body)
        obj["kind"] = rt.kind
        obj["apiVersion"] = rt.api_version(hub_version(rt))
        meta = obj.setdefault("metadata", {})
        if rt.namespaced:
            if meta.get("namespace") and meta["namespace"] != call.namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = call.namespace
        else:
            meta.pop("namespace", None)
        return obj

    def _keep_identity(self, obj: dict, original_meta: dict) -> dict:
        """Mutating webhooks may not move an object to another name or namespace."""
        meta = obj.setdefault("metadata", {})
        for name in ("name", "generateName", "namespace"):
            if name in original_meta:
                meta[name] = original_meta[name]
            else:
                meta.pop(name, None)
        for system in _SYSTEM_FIELDS:
            meta.pop(system, None)
        return obj

    def _check_namespace_open(self, call: Call, name: str) -> None:
        if not call.rt.namespaced:
            return
        ns = self.store.get(("", "namespaces", "", call.namespace))
        if ns is None:
            raise not_found(NAMESPACES, call.namespace)
        if ns["metadata"].get("deletionTimestamp"):
            raise forbidden(
                call.rt,
                name,
                f"unable to create new content in namespace {call.namespace} because it is being terminated",
            )

    def _validate(self, rt: ResourceType, obj: dict, old: dict | None) -> None:
        causes = strategy.validate(rt, obj, old)
        if causes:
            raise invalid(rt, obj.get("metadata", {}).get("name", ""), causes)


def _options(kind: str, dry_run: bool) -> dict:
    options: dict = {"kind": kind, "apiVersion": META_V1}
    if dry_run:
        options["dryRun"] = ["All"]
    return options


def _with_name(call: Call, name: str) -> Call:
    return Call(call.user, call.rt, call.version, call.namespace, name, call.subresource, call.dry_run)


def _sort_key(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


def _parse_rv(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise bad_request(f"invalid resourceVersion {text!r}") from None


def _watch_type(event: str, new_matches: bool, old_matches: bool) -> str | None:
    """What a filtered watch sees: objects moving into or out of the selection appear/disappear."""
    if event == "ADDED":
        return "ADDED" if new_matches else None
    if event == "DELETED":
        return "DELETED" if old_matches else None
    if new_matches:
        return "MODIFIED" if old_matches else "ADDED"
    return "DELETED" if old_matches else None


def _spec_of(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _deletion_complete(obj: dict) -> bool:
    meta = obj.get("metadata") or {}
    if not meta.get("deletionTimestamp") or meta.get("finalizers"):
        return False
    if obj.get("kind") == "Namespace" and (obj.get("spec") or {}).get("finalizers"):
        return False
    # A pod in its grace period waits for the kubelet's final delete even without finalizers.
    return not meta.get("deletionGracePeriodSeconds")


def _check_preconditions(rt: ResourceType, name: str, old: dict, preconditions: dict) -> None:
    meta = old["metadata"]
    if preconditions.get("uid") and preconditions["uid"] != meta.get("uid"):
        raise conflict(
            rt,
            name,
            f"Precondition failed: UID in precondition: {preconditions['uid']}, UID in object meta: {meta.get('uid')}",
        )
    rv = preconditions.get("resourceVersion")
    if rv and rv != meta.get("resourceVersion"):
        raise conflict(
            rt,
            name,
            f"Precondition failed: ResourceVersion in precondition: {rv}, "
            f"ResourceVersion in object meta: {meta.get('resourceVersion')}",
        )


def _mark_deleted(rt: ResourceType, old: dict, options: dict) -> dict | None:
    """The object after a DELETE, or None when it goes away now (graceful deletion, finalizers)."""
    new = copy.deepcopy(old)
    meta = new["metadata"]
    already = meta.get("deletionTimestamp")
    grace = 0
    if rt is PODS:
        requested = options.get("gracePeriodSeconds")
        spec, phase = old.get("spec") or {}, (old.get("status") or {}).get("phase")
        grace = int(spec.get("terminationGracePeriodSeconds", 30) if requested is None else requested)
        if grace < 0:
            grace = 1
        if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
            grace = 0  # nothing runs it: no kubelet will finish the deletion
    if not already:
        policy = options.get("propagationPolicy") or ("Orphan" if options.get("orphanDependents") else "Background")
        extra = {"Orphan": "orphan", "Foreground": "foregroundDeletion"}.get(policy)
        if extra and extra not in (meta.get("finalizers") or []):
            meta["finalizers"] = [*(meta.get("finalizers") or []), extra]
    if rt is NAMESPACES:
        new.setdefault("status", {})["phase"] = "Terminating"
        if not already:
            meta["deletionTimestamp"] = now_rfc3339()
            meta["deletionGracePeriodSeconds"] = 0
        return new
    if grace > 0:
        current = meta.get("deletionGracePeriodSeconds")
        if already and current is not None and current <= grace:
            return new  # a deletion already under way with a shorter grace period stays as it is
        meta["deletionTimestamp"] = now_rfc3339(grace)
        meta["deletionGracePeriodSeconds"] = grace
        return new
    if meta.get("finalizers"):
        meta.setdefault("deletionTimestamp", now_rfc3339())
        meta["deletionGracePeriodSeconds"] = 0
        return new
    return None
