"""Claims the agent had no pod event for: allocated and released while it was down. The webhook keeps such
a GPU claim allocated (its deallocation is refused until the attestation), so the agent finds it in its
list of claims at start and on resync; pods that ended unseen are asked for by name."""

from __future__ import annotations

import contextlib

import pytest
from agent_support import CANARY, NODE, Crash, make_node
from scrubgate.policies import names
from scrubgate.policies.attestation import check_claim_attestation, verify
from scrubgate.sanitizer_agent.checkpoint import State
from scrubgate.sanitizer_agent.gpu import simulated


def test_a_claim_allocated_and_released_while_the_agent_was_down_is_scrubbed_at_start(tmp_path):
    node = make_node(tmp_path)
    claim, pod = node.tenant("job", [0])
    node.cluster.delete_pod(pod["metadata"]["uid"])  # no agent ran: no pod event, no annotation, no checkpoint
    assert node.canary_present(0)

    agent = node.agent()
    agent.start()
    assert "get_pod" in node.cluster.calls, "the consumer was looked up: it is in neither the list nor a watch"
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules
    after = node.cluster.claims[("team-a", "job")]
    assert names.FINALIZER not in after["metadata"]["finalizers"]
    payload = check_claim_attestation(
        after["metadata"]["annotations"][names.ANNOTATION_ATTESTATION], after, node.signer.public_keys
    )
    assert payload["claim"]["uid"] == claim["metadata"]["uid"]
    assert node.violations.found == []


def test_a_claim_found_on_the_resync_list_of_the_nodes_claims_is_torn_down(tmp_path):
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    # Allocated and released between two resyncs, with the pod's events lost (a watch that broke); the controller
    # labelled it with its node.
    claim, pod = node.tenant("job", [1])
    node.cluster.delete_pod(pod["metadata"]["uid"])
    agent.resync()
    assert node.cluster.calls.count("list_node_claims") == 2, "at start and at the resync"
    node.settle(agent)
    assert node.clean(1) and not node.cluster.rules
    assert claim["metadata"]["uid"] not in agent.store.teardowns
    assert node.violations.found == []


def test_a_claim_the_controller_has_not_labelled_is_not_seen_until_it_is(tmp_path):
    """Fail closed: an unlabelled claim whose pod ended unseen stays allocated (SG007) and dirty until it carries its
    node's label; then the next list finds it."""
    node = make_node(tmp_path)
    claim, pod = node.tenant("job", [0])
    node.cluster.claims[("team-a", "job")]["metadata"].pop("labels")
    node.cluster.delete_pod(pod["metadata"]["uid"])
    agent = node.agent()
    agent.start()
    node.settle(agent)
    assert node.canary_present(0) and node.held(0) and not agent.store.teardowns
    node.cluster.claims[("team-a", "job")]["metadata"]["labels"] = {names.LABEL_NODE: NODE}
    agent.resync()
    node.settle(agent)
    assert node.clean(0) and claim["metadata"]["uid"] not in agent.store.teardowns
    assert node.violations.found == []


def test_claim_events_and_lists_drive_the_checks_without_a_read_per_resync(tmp_path):
    """The claim's events (a watch of the node's claims) start its teardown; resyncs list the node's claims from the
    watch cache and read no claim by name while the claims are in the list; a release reads the claim as it is
    now, once. No request lists every claim, or a namespace's."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claims = [node.tenant(f"job-{i}", [i])[0] for i in range(2)]
    for claim in claims:
        agent.observe_claim("ADDED", node.cluster.claims[("team-a", claim["metadata"]["name"])])
    node.settle(agent)
    assert len(agent.store.teardowns) == 2
    reads = node.cluster.requests()["get_claim"]
    for _ in range(3):
        agent.resync()
        node.settle(agent)
    assert node.cluster.requests()["get_claim"] == reads, "no read of a tracked claim per resync"
    # The pod goes, unseen (its watch broke): the resync's list of pods misses it, and the release check, on the
    # claim as listed, reads the claim as it is now before the release, once.
    pod = next(p for p in node.cluster.pods.values() if p["metadata"]["name"] == "job-0-pod")
    node.cluster.delete_pod(pod["metadata"]["uid"])
    agent.resync()
    node.settle(agent)
    assert node.clean(0) and not node.clean(1)
    assert node.cluster.requests()["get_claim"] == reads + 1, "the release reads the claim as it is now"
    assert set(node.cluster.requests()) & {"list_claims", "list_namespace_claims"} == set()
    assert node.violations.found == []


def test_a_claim_whose_pod_still_runs_is_tracked_and_kept(tmp_path):
    """Listed before its pod reached the agent (bound since its last list of pods): the API says the pod
    runs, so the claim is tracked and not released."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, _ = node.tenant("live", [0])
    agent.resync()
    td = agent.store.teardowns[claim["metadata"]["uid"]]
    assert td.state == State.ALLOCATED
    assert node.held(0) and node.canary_present(0)


def test_a_pod_replaced_under_the_same_name_counts_as_ended(tmp_path):
    node = make_node(tmp_path)
    claim, pod = node.tenant("job", [0])
    node.cluster.delete_pod(pod["metadata"]["uid"])
    node.cluster.add_claim("team-a", "other", [node.key(1)])
    node.cluster.add_pod("team-a", pod["metadata"]["name"], NODE, ["other"])  # same name, new UID
    agent = node.agent()
    agent.start()
    node.settle(agent)
    assert node.clean(0)
    assert claim["metadata"]["uid"] not in agent.store.teardowns
    assert node.violations.found == []


def test_claims_of_other_nodes_are_left_alone(tmp_path):
    node = make_node(tmp_path)
    node.cluster.add_claim("team-a", "elsewhere", [("gpu.nvidia.com", "gpu-node-2", "gpu-0")])
    agent = node.agent()
    agent.start()
    assert agent.store.teardowns == {} and not node.cluster.rules
    assert "patch_claim" not in node.cluster.calls


def test_a_released_claim_awaiting_deallocation_is_not_torn_down_twice(tmp_path):
    """The pod's end starts the teardown; its deletion arrives after the teardown is done, while the claim is
    still allocated (the controller deallocates once the attestation is on it): nothing starts again. A new
    pod on the same claim does start a new teardown."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.job_ends(agent)
    node.settle(agent)
    assert node.clean(0) and agent.store.teardowns == {}
    fences_created = node.cluster.calls.count("create_device_taint_rule")
    agent.observe_pod("DELETED", node.cluster.delete_pod(pod["metadata"]["uid"]))
    agent.resync()
    assert agent.store.teardowns == {} and node.cluster.calls.count("create_device_taint_rule") == fences_created

    again = node.cluster.add_pod("team-a", "job-again", NODE, ["job"])
    agent.observe_pod("ADDED", again)
    assert agent.store.teardowns[claim["metadata"]["uid"]].state == State.ALLOCATED and node.held(0)


def test_after_a_restart_an_attested_claim_still_allocated_is_scrubbed_again(tmp_path):
    """A restarted agent cannot tell which pods an attestation on a still-allocated claim was for (the claim
    may have been used again while it was down): it takes the safe side and tears it down once more."""
    node = make_node(tmp_path)
    _, pod = node.tenant("job", [0])
    first = node.agent()
    first.start()
    first.observe_pod("MODIFIED", node.finish(pod, controller=False))
    node.settle(first)
    assert node.clean(0)
    node.cluster.delete_pod(pod["metadata"]["uid"])
    simulated.fill(node.root, node.gpus[0].uuid, CANARY)  # used again while the agent was down
    second = node.agent()
    second.start()
    node.settle(second)
    assert node.clean(0) and not node.cluster.rules
    assert node.violations.found == []


def test_a_pod_missing_from_a_new_list_is_asked_for(tmp_path):
    """A pod deleted while the watch was down: the next list no longer has it; the agent asks the API
    rather than trust a running pod it saw before."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    assert pod["metadata"]["uid"] in agent.view.live_pods
    node.cluster.delete_pod(pod["metadata"]["uid"])  # the DELETED event is lost
    agent.resync()
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules
    assert node.violations.found == []


def test_a_claim_deleted_while_it_held_a_device_keeps_the_finalizer_until_its_scrub(tmp_path):
    """(One deleted before it held a device loses the finalizer through scrubgate's controller.)"""
    node = make_node(tmp_path)
    node.cluster.add_claim("team-a", "held", [node.key(0)])
    node.cluster.delete_claim("team-a", "held")
    assert not node.cluster.deallocate("team-a", "held"), "refused until the attestation; retried then"
    agent = node.agent()
    agent.start()
    node.settle(agent)
    assert ("team-a", "held") not in node.cluster.claims and node.clean(0), "only after its scrub"
    assert node.violations.found == []


def test_the_attestation_names_the_pods_the_claim_was_released_by(tmp_path):
    """So that it does not cover a later use of the same claim (see the deallocation guard)."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    _, pod = node.job_ends(agent)
    node.settle(agent)
    claim = node.cluster.claims[("team-a", "job")]
    payload = check_claim_attestation(
        claim["metadata"]["annotations"][names.ANNOTATION_ATTESTATION], claim, node.signer.public_keys
    )
    assert payload["consumers"] == [{"name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]


def test_an_attestation_with_no_claim_left_is_kept_in_an_event_on_the_node(tmp_path):
    """Break-glass: an admin let the claim go while the agent was away; the agent still scrubs its device, and
    the attestation it signs goes into a Normal Event on the Node."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    del node.cluster.claims[("team-a", "job")]  # finalizer removed by break-glass, claim deleted
    agent.observe_pod("DELETED", node.cluster.delete_pod(pod["metadata"]["uid"]))
    node.settle(agent)
    assert node.clean(0) and not node.cluster.rules
    (event,) = [e for e in node.cluster.events if e["reason"] == "ScrubAttested"]
    assert event["type"] == "Normal" and event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE}
    payload = verify(event["metadata"]["annotations"][names.ANNOTATION_ATTESTATION], node.signer.public_keys)
    assert payload["claim"]["uid"] == claim["metadata"]["uid"] and payload["devices"][0]["verified"] is True


def test_a_list_older_than_a_running_pod_does_not_release_its_claim(tmp_path):
    """The watch's list can be older than a pod the agent already saw: a pod missing from it is asked for,
    not taken as gone."""
    node = make_node(tmp_path)
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    agent._handle(("POD-LIST", []))  # a list taken before the pod was bound
    assert "get_pod" in node.cluster.calls
    assert agent.store.teardowns[claim["metadata"]["uid"]].state == State.ALLOCATED
    assert node.held(0) and node.canary_present(0)


@pytest.mark.parametrize("crash_at", [State.ATTESTED, State.DONE])
def test_a_restart_after_the_scrub_then_a_new_use_gets_its_own_teardown(tmp_path, crash_at):
    """Killed after the first use's verified scrub, before removing the finalizer; the claim was then used by
    another pod: at start the old attestation does not cover that pod, so the claim is torn down again."""
    node = make_node(tmp_path)
    agent = node.agent(on_transition=lambda td, state: _crash_at(state, crash_at))
    agent.start()
    with contextlib.suppress(Crash):
        node.job_ends(agent)
    (pod,) = node.cluster.pods.values()
    assert agent.store.teardowns and next(iter(agent.store.teardowns.values())).state == crash_at
    node.cluster.delete_pod(pod["metadata"]["uid"])
    again = node.cluster.add_pod("team-a", "job-again", NODE, ["job"])
    simulated.fill(node.root, node.gpus[0].uuid, CANARY)
    node.cluster.delete_pod(again["metadata"]["uid"])
    restarted = node.agent()
    restarted.start()
    node.settle(restarted)
    assert node.clean(0) and not node.cluster.rules
    claim = node.cluster.claims[("team-a", "job")]
    payload = check_claim_attestation(
        claim["metadata"]["annotations"][names.ANNOTATION_ATTESTATION], claim, node.signer.public_keys
    )
    assert {c["name"] for c in payload["consumers"]} == {"job-pod", "job-again"}


def _crash_at(state: State, crash_at: State) -> None:
    if state == crash_at:
        raise Crash(f"killed in {state.value}, before the finalizer's removal")


@pytest.mark.parametrize("crash_at", [State.ATTESTED, State.DONE])
def test_a_restart_after_the_scrub_finishes_it_and_starts_nothing_new(tmp_path, crash_at):
    """The same restart with no later use: the teardown ends (finalizer removed) and the claim, still
    allocated until the controller deallocates it, is not fenced and scrubbed a second time."""
    node = make_node(tmp_path)
    agent = node.agent(on_transition=lambda td, state: _crash_at(state, crash_at))
    agent.start()
    with contextlib.suppress(Crash):
        node.job_ends(agent)
    (pod,) = node.cluster.pods.values()
    node.cluster.delete_pod(pod["metadata"]["uid"])
    fences_created = node.cluster.calls.count("create_device_taint_rule")
    restarted = node.agent()
    restarted.start()
    node.settle(restarted)
    assert restarted.store.teardowns == {} and not node.cluster.rules
    assert names.FINALIZER not in node.cluster.claims[("team-a", "job")]["metadata"]["finalizers"]
    assert node.cluster.calls.count("create_device_taint_rule") == fences_created
