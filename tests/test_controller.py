"""scrubgate's controller (sanitizer_agent/controller.py): one informer over every claim labels a GPU claim that no
agent labelled with its node, and removes the sanitize finalizer of a claim deleted before it held a device; a node
agent then finds what it never saw a pod of by its own node's list."""

from __future__ import annotations

import threading

from agent_support import NODE, eventually, make_node
from memcluster import InMemoryCluster
from scrubgate.policies import names
from scrubgate.sanitizer_agent.controller import ClaimController, ControllerSettings
from scrubgate.sanitizer_agent.informer import Backoff

OTHER_DRIVER = "example.com/nic"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def controller(cluster: InMemoryCluster, clock: Clock, label_after_s: float = 10.0) -> ClaimController:
    settings = ControllerSettings(label_after_s=label_after_s, backoff=Backoff(watch_timeout_s=1, initial_s=0.05))
    found = ClaimController(cluster, settings, clock=clock)
    found.relist(cluster.list_all_claims()[0])
    return found


def label(cluster: InMemoryCluster, name: str) -> str | None:
    return (cluster.claims[("team-a", name)]["metadata"].get("labels") or {}).get(names.LABEL_NODE)


def test_a_gpu_claim_no_agent_labelled_gets_its_nodes_label_after_a_while():
    cluster, clock = InMemoryCluster(), Clock()
    cluster.add_claim("team-a", "gpu", [("gpu.nvidia.com", NODE, "gpu-0")], labelled=False)
    cluster.add_claim("team-a", "nic", [(OTHER_DRIVER, NODE, "nic-0")], labelled=False)
    found = controller(cluster, clock)
    found.act()
    assert label(cluster, "gpu") is None, "its agent labels it soon: no second write meanwhile"
    clock.now += 10
    assert found.act() == 10.0, "nothing else due"
    assert label(cluster, "gpu") == NODE
    assert label(cluster, "nic") is None, "not a GPU driver's device: no agent scrubs it"
    assert found.metrics.labelled._value.get() == 1


def test_a_claim_its_agent_labelled_in_time_costs_the_controller_no_write():
    cluster, clock = InMemoryCluster(), Clock()
    cluster.add_claim("team-a", "gpu", [("gpu.nvidia.com", NODE, "gpu-0")], labelled=False)
    found = controller(cluster, clock)
    cluster.claims[("team-a", "gpu")]["metadata"]["labels"] = {names.LABEL_NODE: NODE}  # the agent's first write of it
    found.observe("MODIFIED", cluster.claims[("team-a", "gpu")])
    clock.now += 60
    found.act()
    assert "patch_claim" not in cluster.calls


def test_a_claim_deleted_before_it_held_a_device_loses_the_finalizer_at_once():
    """kube-controller-manager makes a claim from the template for a pod that had ended and deletes it, often after
    the pod's last event (no agent's pod event names it then): the controller's informer sees the deletion."""
    cluster, clock = InMemoryCluster(), Clock()
    cluster.add_claim("team-a", "never", [])
    del cluster.claims[("team-a", "never")]["status"]["allocation"]
    cluster.add_claim("team-a", "held", [("gpu.nvidia.com", NODE, "gpu-0")])
    found = controller(cluster, clock)
    found.act()
    assert ("team-a", "never") in cluster.claims, "not being deleted: kept"
    for name in ("never", "held"):
        cluster.delete_claim("team-a", name)
        found.observe("MODIFIED", cluster.claims[("team-a", name)])
    found.act()
    assert ("team-a", "never") not in cluster.claims, "its finalizer was the last: it is gone"
    assert names.FINALIZER in cluster.claims[("team-a", "held")]["metadata"]["finalizers"], "only after its scrub"
    assert found.metrics.finalizers_removed._value.get() == 1


def test_the_agent_finds_a_claim_allocated_and_released_while_it_was_down(tmp_path):
    """The controller runs (its informer and its loop); the agent is down while a pod runs on its claim and is
    deleted. Started again, the agent lists its node's claims: the controller's label brings the claim in, and it
    is scrubbed and released."""
    node = make_node(tmp_path)
    settings = ControllerSettings(label_after_s=0.0, backoff=Backoff(watch_timeout_s=1, initial_s=0.05))
    running = ClaimController(node.cluster, settings)
    stop = threading.Event()
    thread = threading.Thread(target=running.run, args=(stop,), daemon=True)
    thread.start()
    try:
        eventually(lambda: running.healthy()[0], "the controller's first list")
        claim = node.cluster.add_claim("team-a", "job", [node.key(0)], labelled=False)
        pod = node.cluster.add_pod("team-a", "job-pod", NODE, ["job"])
        node.cluster.delete_pod(pod["metadata"]["uid"])
        eventually(lambda: label(node.cluster, "job") == NODE, "the controller's label")
    finally:
        stop.set()
        thread.join(timeout=10)
    before = len(node.cluster.calls)
    agent = node.agent()
    agent.start()
    node.settle(agent)
    assert node.clean(0) and claim["metadata"]["uid"] not in agent.store.teardowns
    assert names.FINALIZER not in node.cluster.claims[("team-a", "job")]["metadata"]["finalizers"]
    assert node.violations.found == []
    assert not {"list_all_claims", "watch_all_claims"} & set(node.cluster.calls[before:]), "the agent's own claims only"


def test_the_controller_is_unhealthy_until_it_has_listed_and_when_its_informer_falls_silent():
    cluster, clock = InMemoryCluster(), Clock()
    found = ClaimController(cluster, ControllerSettings(stale_after_s=300.0), clock=clock)
    assert not found.healthy()[0]
    found.relist([])
    assert found.healthy()[0]
    clock.now += 301
    ok, detail = found.healthy()
    assert not ok and "301s" in detail
