"""The agent's Kubernetes side: reading claims, pods and slices; fence discovery and its fallbacks; the real
KubernetesClusterClient against a real kube-apiserver (tests/k8s_support.py), including a whole teardown."""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import urllib.request

import jsonpatch
import kube_json_patch
import pytest
from agent_support import CANARY, DRIVER, NODE, claim_annotations, eventually, finalizer_removed, make_node, seed_api
from k8s_support import api_server
from kubernetes import client
from scrubgate.policies import names
from scrubgate.policies.attestation import check_claim_attestation
from scrubgate.sanitizer_agent import claims
from scrubgate.sanitizer_agent.agent import Agent, AgentSettings
from scrubgate.sanitizer_agent.checkpoint import CheckpointStore, State
from scrubgate.sanitizer_agent.gpu import simulated
from scrubgate.sanitizer_agent.kube import ClusterError, Conflict, KubernetesClusterClient
from scrubgate.sanitizer_agent.metrics import serve

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- reading the API's objects


def test_release_reasons():
    claim = {
        "metadata": {"uid": "u1"},
        "status": {"allocation": {"devices": {}}, "reservedFor": [{"resource": "pods", "name": "p", "uid": "p1"}]},
    }
    assert claims.release_reason(claim, "u1", set()) is None
    assert claims.release_reason(claim, "u1", {"p1"}) == "pod p terminal or deleted"
    assert claims.release_reason(None, "u1", set()) == "claim deleted"
    assert claims.release_reason({**claim, "metadata": {"uid": "u2"}}, "u1", set()).startswith("claim deleted")
    # Deletion only stops new reservations: the reserved pod keeps running on the device.
    deleting = {**claim, "metadata": {"uid": "u1", "deletionTimestamp": "2025-01-01T00:00:00Z"}}
    assert claims.release_reason(deleting, "u1", set()) is None
    assert claims.release_reason(deleting, "u1", {"p1"}) == "pod p terminal or deleted"
    assert claims.release_reason({**claim, "status": {"reservedFor": claim["status"]["reservedFor"]}}, "u1", set()) == (
        "allocation cleared"
    )
    assert claims.release_reason({**claim, "status": {"allocation": {"x": 1}}}, "u1", set()) == (
        "no longer reserved for any pod"
    )
    # A consumer that is not a pod (a PodGroup) holds the claim until the agent has found it gone.
    group = {"resource": "podgroups", "apiGroup": "scheduling.k8s.io", "name": "g", "uid": "g1"}
    held_by_group = {**claim, "status": {"allocation": {"x": 1}, "reservedFor": [group]}}
    assert claims.release_reason(held_by_group, "u1", {"p1"}) is None
    assert claims.release_reason(held_by_group, "u1", {"g1"}) == "podgroups.scheduling.k8s.io g ended or deleted"
    # The webhook's record of an ended pod counts as that pod: ended once the agent knows it ended, not before
    # (whoever writes the claim's status could write one for a pod that still runs).
    record = {"apiGroup": names.RESERVATION_GROUP, "resource": names.ENDED_POD_RESOURCE, "name": "p", "uid": "p1"}
    recorded = {**claim, "status": {"allocation": {"x": 1}, "reservedFor": [record]}}
    assert claims.release_reason(recorded, "u1", set()) is None
    assert claims.release_reason(recorded, "u1", {"p1"}) == "pod p terminal or deleted"


def test_slice_devices_read_every_shape():
    v1 = {"spec": {"driver": "gpu.nvidia.com", "pool": {"name": "n1"}, "devices": [
        {"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-0"}}},
        {"name": "mig-1", "attributes": {"gpu.nvidia.com/uuid": {"string": "MIG-1"}, "parentUUID": {"string": "GPU-0"}}},
        {"name": "nic-0", "attributes": {"index": {"int": 0}}},
    ]}}  # fmt: skip
    v1beta1 = {"spec": {"driver": "gpu.nvidia.com", "pool": {"name": "n1"}, "devices": [
        {"name": "gpu-1", "basic": {"attributes": {"uuid": {"string": "GPU-1"}}}},
    ]}}  # fmt: skip
    found = claims.slice_devices([v1, v1beta1, {"spec": "garbage"}])
    assert found[("gpu.nvidia.com", "n1", "gpu-0")] == claims.SliceDevice("GPU-0", None)
    assert found[("gpu.nvidia.com", "n1", "mig-1")] == claims.SliceDevice("MIG-1", "GPU-0")
    assert found[("gpu.nvidia.com", "n1", "nic-0")] == claims.SliceDevice(None, None)
    assert found[("gpu.nvidia.com", "n1", "gpu-1")].uuid == "GPU-1"


def test_pod_claim_names_cover_named_and_generated_claims():
    pod = {
        "spec": {
            "resourceClaims": [
                {"name": "a", "resourceClaimName": "shared"},
                {"name": "b", "resourceClaimTemplateName": "t"},
            ]
        },
        "status": {"resourceClaimStatuses": [{"name": "b", "resourceClaimName": "pod-b-xyz"}, {"name": "c"}]},
    }
    assert claims.pod_claim_names(pod) == ["shared", "pod-b-xyz"]
    extended = {"status": {"extendedResourceClaimStatus": {"resourceClaimName": "pod-gpu-4xq", "requestMappings": []}}}
    assert claims.pod_claim_names(extended) == ["pod-gpu-4xq"]


def test_finalizer_addition_keeps_other_finalizers_and_fails_on_a_change():
    bare = {"metadata": {"uid": "u", "resourceVersion": "5"}}  # the API omits an empty list
    ops = claims.finalizer_addition_ops(bare)
    assert kube_json_patch.apply_patch(bare, ops)["metadata"]["finalizers"] == [names.FINALIZER]
    # Another write since the read does not fail it; another writer's finalizer added meanwhile does.
    assert kube_json_patch.apply_patch({"metadata": {"uid": "u", "resourceVersion": "6"}}, ops)["metadata"][
        "finalizers"
    ] == [names.FINALIZER]
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        kube_json_patch.apply_patch({"metadata": {"uid": "u", "finalizers": ["theirs"]}}, ops)
    theirs = {"metadata": {"uid": "u", "finalizers": ["theirs"]}}
    ops = claims.finalizer_addition_ops(theirs)
    assert kube_json_patch.apply_patch(theirs, ops)["metadata"]["finalizers"] == ["theirs", names.FINALIZER]
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        kube_json_patch.apply_patch({"metadata": {"uid": "u", "finalizers": ["theirs", "new"]}}, ops)
    assert claims.finalizer_addition_ops({"metadata": {"uid": "u", "finalizers": [names.FINALIZER]}}) is None
    assert (
        claims.finalizer_addition_ops({"metadata": {"uid": "u", "deletionTimestamp": "2025-01-01T00:00:00Z"}}) is None
    )


def test_annotation_and_label_ops_never_drop_a_concurrent_writers_key():
    bare = {"metadata": {"uid": "u", "resourceVersion": "5"}}
    ops = claims.annotation_ops(bare, {names.ANNOTATION_SCRUB_STATUS: "fenced"})
    assert kube_json_patch.apply_patch(bare, ops)["metadata"]["annotations"] == {
        names.ANNOTATION_SCRUB_STATUS: "fenced"
    }
    raced = {"metadata": {"uid": "u", "resourceVersion": "6", "annotations": {"theirs": "x"}}}
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        kube_json_patch.apply_patch(raced, ops)
    ops = claims.annotation_ops(raced, {names.ANNOTATION_SCRUB_STATUS: "verified"})
    assert kube_json_patch.apply_patch(raced, ops)["metadata"]["annotations"] == {
        "theirs": "x",
        names.ANNOTATION_SCRUB_STATUS: "verified",
    }
    label = claims.node_label_ops(bare, NODE)
    moved = {"metadata": {"uid": "u", "resourceVersion": "7"}}  # written since, by the resourceclaim controller
    assert kube_json_patch.apply_patch(moved, label)["metadata"]["labels"] == {names.LABEL_NODE: NODE}
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        kube_json_patch.apply_patch({"metadata": {"uid": "u", "labels": {"team": "a"}}}, label)


def test_the_agent_labels_only_a_claim_allocated_on_its_node():
    """SG007 refuses an agent's label on a claim not allocated on its node, and with it the whole write it rides in
    (the attestation, a missing finalizer): the agent adds it only where the allocation is on its node."""
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}
    allocated = {"metadata": {"uid": "u"}, "status": {"allocation": {"devices": {"results": [result]}}}}
    assert claims.own_node_label_ops(allocated, NODE) == claims.node_label_ops(allocated, NODE) is not None
    assert claims.own_node_label_ops(allocated, "gpu-node-2") is None
    assert claims.own_node_label_ops({"metadata": {"uid": "u"}}, NODE) is None, "deallocated"


def test_the_finalizers_removal_rests_on_the_allocation_not_on_other_writes():
    reserved = [{"resource": "pods", "name": "p", "uid": "pod-1"}]
    claim = {
        "metadata": {"uid": "u", "resourceVersion": "5", "finalizers": [names.FINALIZER]},
        "status": {"allocation": {"devices": {"results": [{"device": "gpu-0"}]}}, "reservedFor": reserved},
    }
    ops = claims.finalizer_removal_ops(claim, None)
    # The garbage collector deleted the generated claim since the read: the removal still applies.
    deleted = {**claim, "metadata": {**claim["metadata"], "resourceVersion": "9", "deletionTimestamp": "t"}}
    assert kube_json_patch.apply_patch(deleted, ops)["metadata"]["finalizers"] == []
    # The controller's drop of the ended pod since the read (its record in the pod's place): it still applies.
    ended = {"apiGroup": names.RESERVATION_GROUP, "resource": names.ENDED_POD_RESOURCE, "name": "p", "uid": "pod-1"}
    dropped = {**claim, "status": {**claim["status"], "reservedFor": [ended]}}
    assert kube_json_patch.apply_patch(dropped, ops)["metadata"]["finalizers"] == []
    # Another allocation: it fails. (A consumer since that the attestation does not cover is SG007's to refuse.)
    other = {**claim, "status": {**claim["status"], "allocation": {"devices": {"results": [{"device": "gpu-1"}]}}}}
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        kube_json_patch.apply_patch(other, ops)
    # A claim that never held a device is tested on its resourceVersion.
    pending = {"metadata": {"uid": "u", "resourceVersion": "5", "finalizers": [names.FINALIZER]}}
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        kube_json_patch.apply_patch(
            {"metadata": {**pending["metadata"], "resourceVersion": "6"}}, claims.finalizer_removal_ops(pending, None)
        )


def test_the_last_holds_release_deallocates_as_the_controller_would():
    """The agent's release takes the allocation with its hold where nothing else is left and delete-protection is
    on the claim (the resourceclaim controller never sees the claim's last consumer go: the hold and the records of
    ended pods are not its to drop); a claim still reserved for another consumer, or without delete-protection,
    keeps its allocation."""
    hold = claims.hold_entry(NODE, "hold-1")
    pod = {"resource": "pods", "name": "p", "uid": "pod-1"}
    claim = {
        "metadata": {"uid": "u", "resourceVersion": "5", "finalizers": [names.DELETE_PROTECTION_FINALIZER]},
        "status": {"allocation": {"devices": {"results": [{"device": "gpu-0"}]}}, "reservedFor": [hold]},
    }
    released = kube_json_patch.apply_patch(claim, claims.hold_release_ops(claim, NODE))
    assert released["status"] == {"reservedFor": []}
    # The webhook's records of ended pods go with the hold: they are the attestation's to cover.
    ended = {"apiGroup": names.RESERVATION_GROUP, "resource": names.ENDED_POD_RESOURCE, "name": "p", "uid": "pod-1"}
    recorded = {**claim, "status": {**claim["status"], "reservedFor": [ended, hold]}}
    assert kube_json_patch.apply_patch(recorded, claims.hold_release_ops(recorded, NODE))["status"] == {
        "reservedFor": []
    }
    shared = {**claim, "status": {**claim["status"], "reservedFor": [pod, hold]}}
    kept = kube_json_patch.apply_patch(shared, claims.hold_release_ops(shared, NODE))
    assert kept["status"] == {"allocation": claim["status"]["allocation"], "reservedFor": [pod]}
    unprotected = {**claim, "metadata": {**claim["metadata"], "finalizers": []}}
    kept = kube_json_patch.apply_patch(unprotected, claims.hold_release_ops(unprotected, NODE))
    assert kept["status"] == {"allocation": claim["status"]["allocation"], "reservedFor": []}


def test_claim_prepared_by_nvidia_but_unknown_to_the_agent_is_fenced_and_scrubbed(tmp_path):
    """The claim was deleted while the agent was away; only NVIDIA's checkpoint still shows it."""
    node = make_node(tmp_path)
    simulated.fill(node.root, node.gpus[1].uuid, CANARY)
    prepared = tmp_path / "nvidia.json"
    prepared.write_text(json.dumps({"v2": {"preparedClaims": {"gone-uid": {
        "name": "gone", "namespace": "team-a",
        "preparedDevices": [{"devices": [{"gpu": {"info": {"uuid": node.gpus[1].uuid}}}]}],
    }}}}))  # fmt: skip
    agent = node.agent(nvidia_checkpoint=prepared)
    fences: list[str] = []
    monitor = node.cluster.hook

    def hook(operation, args):
        monitor(operation, args)
        if operation == "create_device_taint_rule":
            fences.append(args[1]["spec"]["deviceSelector"]["device"])

    node.cluster.hook = hook
    agent.start()
    assert fences == ["gpu-1"], "mapped through the slice's uuid attribute, and fenced"
    node.settle(agent)
    assert node.clean(1) and not node.cluster.rules and agent.store.teardowns == {}


# ---------------------------------------------------------------- fences: discovery and the weak fallback


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1alpha3"])
def test_fence_uses_the_newest_served_device_taint_rule_version(tmp_path, version):
    node = make_node(tmp_path, versions=(version,))
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [0], admin_access=True)  # its allocation does not keep the device
    agent.observe_pod("ADDED", pod)
    (rule,) = node.cluster.rules.values()
    assert rule["apiVersion"] == f"resource.k8s.io/{version}"
    assert rule["spec"] == {
        "deviceSelector": {"driver": DRIVER, "pool": NODE, "device": "gpu-0"},
        "taint": {"key": names.TAINT_UNSANITIZED, "value": claim["metadata"]["uid"], "effect": "NoSchedule"},
    }
    assert agent.metrics.registry.get_sample_value("scrubgate_agent_weak_fence") == 0
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    assert not node.cluster.rules and node.clean(0)


def test_without_device_taint_rules_the_node_taint_fences_the_teardown_and_says_so(tmp_path, caplog):
    """Where a fence is needed (here: admin access) the node taint stands in for it, during the teardown only:
    it keeps the whole node from other claims. A claim whose allocation holds its device needs none."""
    node = make_node(tmp_path, versions=())
    agent = node.agent()
    agent.start()
    assert "WEAK FENCE" in caplog.text
    assert agent.metrics.registry.get_sample_value("scrubgate_agent_weak_fence") == 1
    _, held = node.tenant("held", [1])
    agent.observe_pod("ADDED", held)
    agent.observe_pod("MODIFIED", node.finish(held, controller=False))
    assert node.clean(1) and agent.metrics.registry.get_sample_value("scrubgate_agent_node_taint_fences_total") == 0

    _, pod = node.tenant("job", [0], admin_access=True)
    agent.observe_pod("ADDED", pod)
    assert node.cluster.node_taints(NODE) == [], "not while the device is allocated: it would keep the whole node"
    assert claim_annotations(node, "job")[names.ANNOTATION_SCRUB_STATUS] == names.SCRUB_FENCED

    seen: list[list[str]] = []
    backend = node.backend()
    original = backend.scrub

    def scrub(uuid: str):
        seen.append(node.cluster.node_taints(NODE))
        return original(uuid)

    backend.scrub = scrub
    agent.backend = agent.engine.gpu_steps.backend = backend
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    assert seen == [[names.TAINT_UNSANITIZED]], "the node was tainted while the device was scrubbed"
    assert node.cluster.node_taints(NODE) == [] and node.clean(0)
    assert agent.metrics.registry.get_sample_value("scrubgate_agent_node_taint_fences_total") == 1


def test_weak_fence_failure_keeps_both_node_taints(tmp_path):
    node = make_node(tmp_path, versions=())
    agent = node.agent()
    agent.start()
    claim, pod = node.tenant("job", [0])
    agent.observe_pod("ADDED", pod)
    simulated.inject_fault(node.root, node.gpus[0].uuid, "verify_mismatch")
    agent.observe_pod("MODIFIED", node.cluster.set_pod_phase(pod["metadata"]["uid"], "Succeeded"))
    assert agent.store.teardowns[claim["metadata"]["uid"]].state == State.FAILED
    assert node.cluster.node_taints(NODE) == [names.TAINT_SCRUB_FAILED, names.TAINT_UNSANITIZED]


# ---------------------------------------------------------------- the real client over HTTP


TAINT_RULE_VERSIONS = ("v1", "v1beta2", "v1alpha3")


@pytest.mark.parametrize("disabled", [0, 1, 2, 3], ids=["all", "no-v1", "v1alpha3-only", "none"])
def test_real_client_discovers_the_device_taint_rule_version(tmp_path, disabled):
    """DeviceTaintRule switched off in the newest ``disabled`` versions (--runtime-config): the agent picks the
    newest version the API server still serves it in, as its discovery documents show."""
    off = tuple(f"resource.k8s.io/{v}/devicetaintrules=false" for v in TAINT_RULE_VERSIONS[:disabled])
    with api_server(tmp_path, off) as plane:
        api = plane.admin_client()
        served = [
            v
            for v in TAINT_RULE_VERSIONS
            if any(
                r["name"] == "devicetaintrules"
                # A version left with no resource at all is not served: 404, no resource list.
                for r in json.loads(api.call_api(*api.param_serialize("GET", f"/apis/resource.k8s.io/{v}")).read()).get(
                    "resources", []
                )
            )
        ]
        assert not set(served) & set(TAINT_RULE_VERSIONS[:disabled])
        assert KubernetesClusterClient(api).device_taint_rule_version() == (served[0] if served else None)


def test_real_client_whole_teardown_against_the_api_server(tmp_path):
    node = make_node(tmp_path)  # its GPUs; the cluster is a real kube-apiserver
    with api_server(tmp_path) as plane:
        api = plane.admin_client()
        cluster = KubernetesClusterClient(api)
        core = client.CoreV1Api(api)
        claim = seed_api(node, cluster, core)
        agent = Agent(
            AgentSettings(node=NODE, nvidia_checkpoint=None, resync_s=0.2),
            cluster=cluster,
            backend=node.backend(),
            store=CheckpointStore(node.checkpoint, NODE),
            signer=node.signer,
        )
        http = serve(agent.metrics, agent.healthy, "127.0.0.1", 0)
        stop = threading.Event()
        runner = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        runner.start()
        try:
            rules = f"/apis/resource.k8s.io/{cluster.device_taint_rule_version()}/devicetaintrules"
            eventually(
                lambda: (
                    names.ANNOTATION_DEVICES in cluster.get_claim("team-a", "train")["metadata"].get("annotations", {})
                ),
                "the record of the allocation",
            )
            simulated.fill(node.root, node.gpus[0].uuid, CANARY)
            eventually(lambda: agent.healthy()[0], "the first tick")
            with urllib.request.urlopen(f"http://127.0.0.1:{http.server_address[1]}/healthz") as reply:
                assert reply.status == 200 and reply.read().startswith(b"ok: 1 teardown(s), 0 device(s) fenced")
            assert cluster._call("GET", rules)["items"] == [], "the claim's allocation keeps the device"

            core.patch_namespaced_pod_status("train-0", "team-a", {"status": {"phase": "Succeeded"}})
            done = eventually(finalizer_removed(cluster), "the finalizer's removal")
            assert node.clean(0)
            assert cluster._call("GET", rules)["items"] == []
            check_claim_attestation(
                done["metadata"]["annotations"][names.ANNOTATION_ATTESTATION], done, node.signer.public_keys
            )
            with urllib.request.urlopen(f"http://127.0.0.1:{http.server_address[1]}/metrics") as reply:
                text = reply.read().decode()
            assert "scrubgate_agent_scrubbed_bytes_total 262144.0" in text
            assert "scrubgate_agent_teardown_overhead_seconds_count 1.0" in text
            with pytest.raises(Conflict):  # a stale finalizer removal fails on the server, not silently
                cluster.patch_claim("team-a", "train", claims.finalizer_removal_ops(
                    {**claim, "metadata": {**claim["metadata"], "finalizers": [names.FINALIZER]}}, "token"))  # fmt: skip
        finally:
            stop.set()
            http.shutdown()
            runner.join(timeout=10)


def test_real_client_reads_a_claim_as_of_a_version_from_the_watch_cache(tmp_path, caplog):
    """get_claim with `not_older_than` (what the agent passes at first sight: its pod's resourceVersion):
    kube-apiserver answers from its watch cache, with no read of etcd, and with the claim at least as of that
    version; a version it cannot reach in time (504) is read from etcd instead; a claim that is not there is None."""
    node = make_node(tmp_path)
    with api_server(tmp_path) as plane:
        api = plane.admin_client()
        cluster = KubernetesClusterClient(api)
        claim = seed_api(node, cluster, client.CoreV1Api(api))
        patched = cluster.patch_claim("team-a", "train", claims.annotation_ops(claim, {"example.com/seen": "yes"}))
        version = patched["metadata"]["resourceVersion"]

        def etcd_reads() -> int:
            text = api.call_api(*api.param_serialize("GET", "/metrics")).read().decode()
            found = re.search(
                r'^etcd_requests_total\{group="resource.k8s.io",operation="get",resource="resourceclaims"\} (\d+)',
                text,
                re.MULTILINE,
            )
            return int(found.group(1)) if found else 0

        before = etcd_reads()
        for _ in range(5):
            read = cluster.get_claim("team-a", "train", not_older_than=version)
            assert read["metadata"]["annotations"]["example.com/seen"] == "yes", "as of the version or later"
        assert cluster.get_claim("team-a", "absent", not_older_than=version) is None
        assert etcd_reads() == before, "the watch cache answered"
        assert cluster.get_claim("team-a", "train")["metadata"]["resourceVersion"] == version
        assert etcd_reads() == before + 1, "a read without a version goes to etcd"
        with caplog.at_level(logging.INFO):
            ahead = cluster.get_claim("team-a", "train", not_older_than=str(int(version) + 10**9))
        assert ahead["metadata"]["resourceVersion"] == version and "reading it from etcd" in caplog.text
        assert etcd_reads() == before + 2


def test_real_client_finds_a_claim_whose_pod_ended_while_the_agent_was_down(tmp_path):
    """list_node_claims and watch_node_claims (the node's label) and get_pod (404 is None) over HTTP: the pod is
    deleted before the agent ever runs, and its claim, still allocated and labelled by scrubgate's controller, is
    found, scrubbed and released at start. Claims of other nodes, or of none, are not listed."""
    node = make_node(tmp_path)
    with api_server(tmp_path) as plane:
        api = plane.admin_client()
        cluster = KubernetesClusterClient(api)
        core = client.CoreV1Api(api)
        claim = seed_api(node, cluster, core)
        simulated.fill(node.root, node.gpus[0].uuid, CANARY)
        core.create_namespace({"metadata": {"name": "team-b"}})
        for name, labels in (("other", {names.LABEL_NODE: "gpu-node-2"}), ("unplaced", {})):
            cluster._call("POST", "/apis/resource.k8s.io/v1/namespaces/team-b/resourceclaims", body={
                "metadata": {"name": name, "labels": labels}, "spec": {"devices": {"requests": []}},
            })  # fmt: skip
        assert cluster.list_node_claims(NODE)[0] == []
        _, version = cluster.list_node_claims(NODE)
        label = [{"op": "add", "path": "/metadata/labels", "value": {names.LABEL_NODE: NODE}}]
        cluster.patch_claim("team-a", "train", label)  # what the controller does
        (event,) = itertools.islice(cluster.watch_node_claims(NODE, version, 10), 1)
        assert event[0] == "ADDED" and event[1]["metadata"]["name"] == "train", "its label brings it in"
        listed, _ = cluster.list_node_claims(NODE)
        assert [c["metadata"]["name"] for c in listed] == ["train"]
        assert cluster.get_pod("team-a", "train-0")["metadata"]["uid"] == claim["status"]["reservedFor"][0]["uid"]
        core.delete_namespaced_pod("train-0", "team-a", grace_period_seconds=0)
        assert cluster.get_pod("team-a", "train-0") is None

        agent = Agent(
            AgentSettings(node=NODE, nvidia_checkpoint=None),
            cluster=cluster,
            backend=node.backend(),
            store=CheckpointStore(node.checkpoint, NODE),
            signer=node.signer,
        )
        agent.start()
        for _ in range(20):
            agent.tick()
        done = finalizer_removed(cluster)()
        assert done is not None and node.clean(0)
        check_claim_attestation(
            done["metadata"]["annotations"][names.ANNOTATION_ATTESTATION], done, node.signer.public_keys
        )


def test_real_client_replaces_a_rule_that_took_a_fences_name_with_another_spec(tmp_path, caplog):
    """Fence names are predictable: one created first under that name, doing something else, must not pass
    for the fence. The same fence created again is left as it is."""
    fence = {
        "metadata": {"name": "scrubgate-unsanitized-test"},
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": NODE, "device": "gpu-0"},
            "taint": {"key": names.TAINT_UNSANITIZED, "value": "uid-1", "effect": "NoSchedule"},
        },
    }
    decoy = {**fence, "spec": {**fence["spec"], "taint": {"key": "example.com/harmless", "effect": "NoSchedule"}}}
    with api_server(tmp_path) as plane:
        cluster = KubernetesClusterClient(plane.admin_client())
        version = cluster.device_taint_rule_version()  # v1 from 1.37, v1alpha3 on 1.34
        path = f"/apis/resource.k8s.io/{version}/devicetaintrules/scrubgate-unsanitized-test"
        cluster.create_device_taint_rule(version, decoy)
        cluster.create_device_taint_rule(version, fence)
        stored = cluster._call("GET", path)
        assert stored["spec"]["taint"]["key"] == names.TAINT_UNSANITIZED
        assert "replacing it" in caplog.text
        cluster.create_device_taint_rule(version, fence)
        assert cluster._call("GET", path)["metadata"]["uid"] == stored["metadata"]["uid"]


def test_a_watch_broken_mid_stream_is_an_api_outage_not_a_crash(monkeypatch):
    """kube-apiserver restarting cuts the watch's chunked stream: the agent sees a ClusterError (a warning and
    a relist), not urllib3's ProtocolError (logged as a crash with its traceback)."""
    from urllib3.exceptions import ProtocolError

    class Cut:
        def stream(self, amt=None, decode_content=True):
            yield b'{"type": "ADDED", "object": {"metadata": {"name": "p"}}}\n'
            raise ProtocolError("Response ended prematurely")

        def release_conn(self):
            pass

    cluster = KubernetesClusterClient(client.ApiClient(client.Configuration(host="https://127.0.0.1:1")))
    monkeypatch.setattr(cluster, "_send", lambda *args, **kwargs: Cut())
    events = cluster.watch_node_pods(NODE, "1", 5)
    assert next(events) == ("ADDED", {"metadata": {"name": "p"}})
    with pytest.raises(ClusterError, match="connection to the API server lost"):
        next(events)
