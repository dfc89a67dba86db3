"""`scrubgate uninstall`: what `helm uninstall` runs first (the chart's pre-delete hook), and what an operator
runs before `kubectl delete -k manifests/`. The guard stays until no teardown is pending, then everything of
scrubgate's that would outlive it goes, in an order that never leaves a released device unguarded:

1. wait, at most --timeout, until no teardown is pending: no claim carrying `scrubgate.dev/sanitize` holds
   a device a tenant may have used (allocated on a node, or held by a node agent) with no consumer left that
   has not ended, and no fence of scrubgate's stands (a DeviceTaintRule or a node taint with a `scrubgate.dev/`
   key: a failed or handed-over teardown). A claim never allocated holds nothing, nor does a pod still
   Pending: neither holds the uninstall, or any tenant could hold it forever;
2. stop the agents: delete the DaemonSet `scrubgate-agent` and wait until its pods are gone;
3. look again: a pod that ended meanwhile left a teardown its agent handed over (fenced) on its way out;
4. delete the webhook configurations (label app.kubernetes.io/name=scrubgate);
5. take `scrubgate.dev/sanitize`, and the node agents' holds in `status.reservedFor`, off the claims still
   carrying them: claims in use, which nothing will scrub once scrubgate is gone (that is what uninstalling
   means), and which would otherwise stay Terminating, or allocated for good once their pods end.

Any of 1-3 that does not end well exits 1 with the guard still in place and says what holds it; nothing has
been removed then but the DaemonSet. A failed pre-delete hook leaves the Helm release `uninstalling`, where
`helm upgrade` fails ("has no deployed releases"): `helm rollback RELEASE REVISION` (the revision `helm
history` shows `uninstalling`) deploys it again, agents included, to finish the teardowns.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from scrubgate.policies import names
from scrubgate.policies.attestation import (
    agent_reservations,
    claim_consumers,
    is_ended_pod,
    is_scrubgate_entry,
    without_scrubgate,
)

from .cluster import DRA_GROUP, Api, ApiError, KubeApi, dra_version, list_all

WEBHOOK_LABEL = "app.kubernetes.io/name=scrubgate"
AGENT_DAEMONSET = "scrubgate-agent"
POLL_S = 2.0


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("metadata") or {}


def _name(obj: dict[str, Any]) -> str:
    meta = _meta(obj)
    return f"{meta.get('namespace')}/{meta.get('name')}" if meta.get("namespace") else str(meta.get("name"))


def _live_pods(api: Api) -> set[str]:
    """UIDs of the pods that exist and have not ended (the API server leaves the ended ones out)."""
    pods, _ = list_all(api, "/api/v1/pods", query={"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"})
    return {_meta(p).get("uid", "") for p in pods}


def holds_a_device(claim: dict[str, Any]) -> bool:
    """Whether the claim may hold a device a tenant used: it is allocated (on a node), or a node agent holds
    it (its `scrubgate.dev/nodeagents` consumer, until the attested release). A claim never allocated holds
    nothing; a device its claim let go of that still needs a scrub is fenced, which `pending` finds."""
    return bool((claim.get("status") or {}).get("allocation")) or bool(agent_reservations(claim))


def in_use(claim: dict[str, Any], live_pods: set[str]) -> bool:
    """A consumer that has not ended: a pod that exists and has not ended (a Pending one included: it ran
    nothing yet), or a consumer other than a pod (a PodGroup: the agent releases it once the group is gone,
    which this command does not look up). A node agent's hold is no consumer: it stays until the attestation,
    so a claim held for ended pods only is a teardown pending. A claim being deleted is still in use while its
    pods run (deletion only stops new reservations), as the agent reads it."""
    return any(
        (resource != "pods" and not is_ended_pod(resource)) or uid in live_pods
        for resource, _, uid in claim_consumers(claim)
    )


def teardown_pending(claim: dict[str, Any], live_pods: set[str]) -> bool:
    """A claim the agent still owes a scrub: it carries the finalizer, holds a device, and nothing uses it."""
    finalizers = _meta(claim).get("finalizers") or []
    return names.FINALIZER in finalizers and holds_a_device(claim) and not in_use(claim, live_pods)


def pending(api: Api, version: str | None) -> list[str]:
    """What holds the uninstall: claims whose teardown is pending, and scrubgate's fences."""
    found = []
    if version is not None:
        live = _live_pods(api)
        claims, _ = list_all(api, f"/apis/{DRA_GROUP}/{version}/resourceclaims")
        for claim in claims:
            if teardown_pending(claim, live):
                status = (_meta(claim).get("annotations") or {}).get(names.ANNOTATION_SCRUB_STATUS, "not started")
                found.append(f"claim {_name(claim)}: teardown pending (scrub-status {status})")
        rules, _ = list_all(api, f"/apis/{DRA_GROUP}/{version}/devicetaintrules")
        for rule in rules:
            key = ((rule.get("spec") or {}).get("taint") or {}).get("key", "")
            if key.startswith(f"{names.DOMAIN}/"):
                found.append(f"DeviceTaintRule {_name(rule)}: fence {key}")
    nodes, _ = list_all(api, "/api/v1/nodes")
    for node in nodes:
        for taint in (node.get("spec") or {}).get("taints") or []:
            if str(taint.get("key", "")).startswith(f"{names.DOMAIN}/"):
                found.append(f"node {_name(node)}: taint {taint['key']}")
    return found


def _wait(what: str, done: Callable[[], bool], deadline: float, sleep: Callable[[float], None]) -> bool:
    while not done():
        if time.monotonic() >= deadline:
            return False
        print(f"scrubgate uninstall: waiting for {what}", file=sys.stderr, flush=True)
        sleep(POLL_S)
    return True


def stop_agents(api: Api, namespace: str, deadline: float, sleep: Callable[[float], None]) -> str | None:
    """Deletes the agents' DaemonSet and waits for its pods to go; why not, or None."""
    path = f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{AGENT_DAEMONSET}"
    try:
        daemonset = api.request("GET", path)
    except ApiError as exc:
        if exc.status == 404:
            print(f"scrubgate uninstall: no DaemonSet {namespace}/{AGENT_DAEMONSET}: no agents to stop", flush=True)
            return None
        raise
    labels = ((daemonset.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    api.request("DELETE", path, body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
    pods = f"/api/v1/namespaces/{namespace}/pods"
    if not _wait(
        "the agents to stop", lambda: not list_all(api, pods, query={"labelSelector": selector})[0], deadline, sleep
    ):
        return f"the agents' pods ({selector}) in {namespace} did not stop in time"
    print(f"scrubgate uninstall: agents stopped (DaemonSet {namespace}/{AGENT_DAEMONSET} deleted)", flush=True)
    return None


def release_claims(
    api: Api, version: str, deadline: float, sleep: Callable[[float], None]
) -> tuple[list[str], list[str]]:
    """Takes scrubgate off every claim still carrying it: the node agents' holds off its status, then the
    sanitize finalizer off it (each an update carrying the resourceVersion it read, read again after a
    failure); (the claims released, those that could not be and why). Left there, a hold would keep the claim
    allocated for good once its pods end (the resourceclaim controller keeps consumers it does not know, and
    no agent remains to release it). The API server drops the deleted webhook configurations a moment later:
    until then SG007 refuses, and the update is tried again until the deadline."""
    released, kept = [], []
    claims, _ = list_all(api, f"/apis/{DRA_GROUP}/{version}/resourceclaims")
    for claim in claims:
        meta = _meta(claim)
        path = f"/apis/{DRA_GROUP}/{version}/namespaces/{meta.get('namespace')}/resourceclaims/{meta.get('name')}"
        while claim is not None and _carries_scrubgate(claim):
            try:
                _release(api, path, f"{DRA_GROUP}/{version}", claim)
                released.append(_name(claim))
                break
            except ApiError as exc:
                if exc.status == 404:
                    break
                if time.monotonic() >= deadline:
                    kept.append(f"claim {_name(claim)}: {exc}")
                    break
            sleep(POLL_S / 4)
            claim = _get(api, path)
    return released, kept


def _carries_scrubgate(claim: dict[str, Any]) -> bool:
    return names.FINALIZER in (_meta(claim).get("finalizers") or []) or bool(agent_reservations(claim))


def _release(api: Api, path: str, api_version: str, claim: dict[str, Any]) -> None:
    status = claim.get("status") or {}
    reserved = status.get("reservedFor") or []
    if any(is_scrubgate_entry(entry) for entry in reserved):
        status["reservedFor"] = without_scrubgate(claim)
        body = {"apiVersion": api_version, "kind": "ResourceClaim", **claim, "status": status}
        claim = api.request("PUT", f"{path}/status", body=body)
    finalizers = _meta(claim).get("finalizers") or []
    if names.FINALIZER in finalizers:
        claim["metadata"]["finalizers"] = [f for f in finalizers if f != names.FINALIZER]
        api.request("PUT", path, body={"apiVersion": api_version, "kind": "ResourceClaim", **claim})


def _get(api: Api, path: str) -> dict[str, Any] | None:
    """The object at `path`, or None when it is gone."""
    try:
        return api.request("GET", path)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def uninstall(api: Api, namespace: str, timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> int:
    deadline = time.monotonic() + timeout_s
    version = dra_version(api)
    holding: list[str] = []

    def clear() -> bool:
        holding[:] = pending(api, version)
        return not holding

    if not _wait("pending teardowns", clear, deadline, sleep):
        return _refuse(f"within {timeout_s:.0f}s these teardowns did not end", holding)
    problem = stop_agents(api, namespace, deadline, sleep)
    if problem is not None:
        return _refuse(problem, pending(api, version))
    if not clear():
        return _refuse(
            "a teardown started while the agents stopped; bring them back to end it (Helm: the `helm rollback` "
            "below; kustomize: apply the base again as you installed it)",
            holding,
        )
    for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        path = f"/apis/admissionregistration.k8s.io/v1/{kind}"
        for item in list_all(api, path, query={"labelSelector": WEBHOOK_LABEL})[0]:
            api.request("DELETE", f"{path}/{_meta(item)['name']}")
            print(f"scrubgate uninstall: deleted {kind} {_meta(item)['name']}", flush=True)
    removed, kept = release_claims(api, version, deadline, sleep) if version is not None else ([], [])
    for claim in removed:
        print(
            f"scrubgate uninstall: {names.FINALIZER} and any node agent's hold taken off claim {claim} (in use or "
            "never allocated: nothing will scrub it)"
        )
    if kept:
        print(
            f"scrubgate uninstall: the guard is gone, but {names.FINALIZER} or a node agent's hold (a "
            f"{names.RESERVATION_RESOURCE}.{names.RESERVATION_GROUP} entry of status.reservedFor) could not be "
            "removed from these claims; remove them from each (kubectl edit resourceclaim -n NAMESPACE NAME, with "
            "--subresource=status for the hold), or they stay allocated, and Terminating once deleted:",
            file=sys.stderr,
        )
        for line in kept:
            print(f"  - {line}", file=sys.stderr)
        return 1
    print(
        f"scrubgate uninstall: done; no teardown pending, no fence of scrubgate's left, {len(removed)} claims released"
    )
    return 0


def _refuse(why: str, holding: list[str]) -> int:
    print(f"scrubgate uninstall: not uninstalling, the guard stays: {why}:", file=sys.stderr)
    for line in holding:
        print(f"  - {line}", file=sys.stderr)
    print(
        "  See each claim's Events and `scrubgate agent status` on its node; a failed teardown ends with "
        f"`scrubgate agent rescrub` or an admin's {names.ANNOTATION_BREAK_GLASS}. Then run the uninstall again.\n"
        '  With Helm the release stays `uninstalling` (`helm upgrade` fails on it: "has no deployed releases"): '
        "`helm rollback RELEASE REVISION`, the revision `helm history RELEASE` shows `uninstalling`, deploys it "
        "again with its values; or, once what holds it is done, `helm uninstall RELEASE` again. `helm uninstall "
        "--no-hooks` skips this wait: only once `scrubgate uninstall` has succeeded (the guard gone).",
        file=sys.stderr,
    )
    return 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Remove scrubgate from a cluster without leaving a device unguarded or a claim Terminating: wait for "
        "pending teardowns, stop the agents, delete the webhook configurations, release the claims still in use."
    )
    parser.add_argument("--namespace", default=names.SYSTEM_NAMESPACE, help="where scrubgate is installed")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for it all (default 240)")
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in a pod its service account, else ~/.kube/config)"
    )
    parser.add_argument("--context", help="kubeconfig context")


def run(args: argparse.Namespace) -> int:
    try:
        return uninstall(KubeApi.connect(args.kubeconfig, args.context), args.namespace, args.timeout)
    except ApiError as exc:
        print(f"scrubgate uninstall: {exc}; nothing more was removed", file=sys.stderr)
        return 2
