"""bench/scale.py's reading of kube-apiserver's audit log and its figures: which requests count, whose they are,
how many objects a read returned, and the bar."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime, timedelta

from bench.scale_audit import audit_policy, call_of, client_of, count, objects_returned
from bench.scale_objects import allocated, devices, leaf_devices
from bench.scale_report import PRODUCTION_WINDOW_S, Step, bar, calls_table, kubelet_requests_per_s, table
from devcluster import driver

AGENT = "system:serviceaccount:scrubgate-system:scrubgate-agent"
START = datetime(2026, 12, 5, 8, 0, 0, tzinfo=UTC)


def event(
    verb: str,
    *,
    node: str | None = "gpu-node-1",
    user: str = AGENT,
    stage: str = "ResponseComplete",
    at: timedelta = timedelta(seconds=1),
    code: int = 200,
    namespace: str | None = "team-a",
    resource: str = "resourceclaims",
    body: dict | None = None,
    audit_id: str = "id",
) -> dict:
    """An audit.k8s.io/v1 Event as kube-apiserver's log backend writes it."""
    extra = {"authentication.kubernetes.io/node-name": [node]} if node else {}
    ref = {"resource": resource, "apiGroup": "resource.k8s.io", "apiVersion": "v1"}
    if namespace:
        ref["namespace"] = namespace
    received = (START + at).isoformat(timespec="microseconds").replace("+00:00", "Z")
    out = {
        "kind": "Event",
        "apiVersion": "audit.k8s.io/v1",
        "level": "RequestResponse",
        "auditID": audit_id,
        "stage": stage,
        "requestURI": f"/apis/resource.k8s.io/v1/{resource}",
        "verb": verb,
        "user": {"username": user, "groups": ["system:serviceaccounts"], "extra": extra},
        "objectRef": ref,
        "responseStatus": {"metadata": {}, "code": code},
        "requestReceivedTimestamp": received,
        "stageTimestamp": received,
    }
    if body is not None:
        out["responseObject"] = body
    return out


def lines(*events: dict) -> list[str]:
    return [json.dumps(e) for e in events]


def items(n: int) -> dict:
    return {"kind": "ResourceClaimList", "items": [{"metadata": {"name": f"c{i}"}} for i in range(n)]}


def test_agents_are_told_apart_by_the_node_their_token_is_bound_to() -> None:
    assert client_of(event("get")["user"]) == f"{AGENT}@gpu-node-1"
    assert client_of(event("get", node="gpu-node-2")["user"]) == f"{AGENT}@gpu-node-2"
    assert client_of(event("get", node=None, user="scrubgate-controller")["user"]) == "scrubgate-controller"


def test_a_list_returns_its_items_a_get_one_object_a_write_or_failure_none() -> None:
    assert objects_returned(event("list", body=items(3))) == 3
    assert objects_returned(event("get", body={"metadata": {}})) == 1
    assert objects_returned(event("get", code=404)) == 0
    assert objects_returned(event("patch", body={"metadata": {}})) == 0
    assert objects_returned(event("watch", stage="ResponseStarted")) == 0


def test_each_request_counts_once_in_the_window_watches_when_they_start() -> None:
    traffic = count(
        [
            *lines(
                event("list", body=items(5), audit_id="a"),
                event("get", body={}, audit_id="b"),
                event("watch", stage="ResponseStarted", resource="pods", audit_id="c"),
                event("watch", stage="ResponseComplete", resource="pods", audit_id="c"),  # the same watch, ended
                event("get", body={}, at=timedelta(seconds=-1), audit_id="d"),  # before the window
                event("get", body={}, at=timedelta(seconds=60), audit_id="e"),  # at its end: outside
                event("get", node="gpu-node-2", body={}, audit_id="f"),
            ),
            '{"kind": "Event", "auditID": "half a line',
        ],
        START,
        START + timedelta(seconds=60),
    )
    first, second = f"{AGENT}@gpu-node-1", f"{AGENT}@gpu-node-2"
    assert traffic.requests == Counter({first: 3, second: 1})
    assert traffic.objects == Counter({first: 6, second: 1})
    assert traffic.clients(AGENT) == [first, second]
    assert traffic.calls[first] == Counter(
        {
            "list resourceclaims (one namespace; latest)": 1,
            "get resourceclaims (latest)": 1,
            "watch pods (one namespace)": 1,
        }
    )


def test_a_call_names_the_scope_of_a_list() -> None:
    assert call_of(event("list", namespace=None)) == "list resourceclaims (all namespaces; latest)"
    assert call_of(event("list")) == "list resourceclaims (one namespace; latest)"
    assert call_of(event("watch", namespace=None, resource="resourceslices")) == "watch resourceslices (cluster)"
    assert call_of({**event("patch"), "objectRef": {**event("get")["objectRef"], "subresource": "status"}}) == (
        "patch resourceclaims/status"
    )
    assert call_of({"verb": "get", "requestURI": "/version?timeout=5s"}) == "get /version"


def test_the_policy_records_the_measured_users_reads_whole_and_nothing_of_anyone_else() -> None:
    policy = audit_policy([AGENT, "scrubgate-controller", AGENT])
    users = ["scrubgate-controller", AGENT]  # each once
    rules = policy["rules"]
    assert rules[0] == {"level": "RequestResponse", "users": users, "verbs": ["get", "list"]}
    assert rules[1] == {"level": "Metadata", "users": users}
    assert rules[-1] == {"level": "None"}
    assert "RequestReceived" in policy["omitStages"]


def step(nodes: int, per_agent: tuple[int, int], central: tuple[int, int] = (0, 0), window_s: float = 60) -> Step:
    agents = {f"{AGENT}@gpu-node-{i}": per_agent for i in range(1, 4)}
    return Step(nodes=nodes, claims=8 * nodes, agents=agents, window_s=window_s, central=central)


def test_agents_rates_are_per_production_second_the_central_ones_per_second_and_the_total_at_every_node() -> None:
    s = step(1000, (600, 6000), central=(120, 6), window_s=60)
    assert s.per_agent() == (600 / PRODUCTION_WINDOW_S, 6000 / PRODUCTION_WINDOW_S)
    assert s.central_rates() == (2.0, 0.1)  # not shortened: the window's own seconds
    assert s.total() == (1000 * 1.0 + 2.0, 1000 * 10.0 + 0.1)
    assert "| 1000 | 8000 | 1.000 | 10.00 | 2.000, 0.10 | 1002.0 | 10000 | 103.3 |" in table([s])


def test_the_kubelets_renew_their_lease_every_10_s_and_report_status_every_5_min() -> None:
    assert kubelet_requests_per_s(1000) == 1000 * (1 / 10 + 1 / 300)


def test_the_bar_holds_per_agent_rates_at_the_largest_size_to_125_percent_of_the_smallest() -> None:
    met, verdict = bar([step(10, (100, 800)), step(1000, (125, 1000))])
    assert met, verdict
    met, verdict = bar([step(1000, (100, 80_000)), step(10, (100, 800))])
    assert not met
    assert "N=1000" in verdict and "100.00x" in verdict and "NOT met" in verdict


def test_the_breakdown_is_per_agent() -> None:
    s = step(10, (30, 30))
    s.calls = Counter({"get resourceclaims": 60, "list resourceclaims (all namespaces)": 3})
    assert "| get resourceclaims | 20.0 |" in calls_table([s])
    assert "| list resourceclaims (all namespaces) | 1.0 |" in calls_table([s])


def test_every_leaf_device_of_a_node_gets_a_claim_allocated_on_its_pool() -> None:
    slices = driver.resource_slices("n1", devices(8, 7))
    assert len(leaf_devices(slices, mig=True)) == 56
    assert leaf_devices(slices, mig=False) == [f"gpu-{i}" for i in range(8)]
    assert len(leaf_devices(driver.resource_slices("n2", devices(8, 0)), mig=False)) == 8
    claim = allocated({"metadata": {"name": "c"}, "status": {}}, "n1", "gpu-3", "p", "uid-1")
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert (result["pool"], result["device"], result["request"]) == ("n1", "gpu-3", "gpu")
    assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "p", "uid": "uid-1"}]


def test_a_call_names_what_selects_a_list_but_not_the_value() -> None:
    listed = event("list", namespace=None, resource="pods")
    listed["requestURI"] = "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-node-1&limit=500"
    assert call_of(listed) == "list pods (all namespaces; by spec.nodeName; latest)"
    listed["requestURI"] = "/api/v1/pods?labelSelector=app%21%3Dx%2Ctier%3Dweb&resourceVersion=0"
    assert call_of(listed) == "list pods (all namespaces; by app, tier; cache)"


def test_a_read_says_whether_it_asked_for_the_latest_or_a_cached_version() -> None:
    got = event("get")
    got["requestURI"] = "/apis/resource.k8s.io/v1/namespaces/a/resourceclaims/c?resourceVersion=0"
    assert call_of(got) == "get resourceclaims (cache)"
    got["requestURI"] = "/apis/resource.k8s.io/v1/namespaces/a/resourceclaims/c?resourceVersion=42"
    assert call_of(got) == "get resourceclaims (at a version)"
