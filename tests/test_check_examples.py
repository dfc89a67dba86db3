"""The shipped examples, and real-world DRA manifests nobody on this project wrote, give exactly the expected rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from scrubgate.check import run_check

REPO = Path(__file__).resolve().parents[1]
GOOD = sorted((REPO / "manifests" / "examples" / "good").glob("*.yaml"))
BAD = sorted((REPO / "manifests" / "examples" / "bad").glob("*.yaml"))
# Public DRA demo manifests (NVIDIA's GPU driver, the Kubernetes example driver), kept unmodified with their
# licenses: tests/realworld/README.md.
REALWORLD = REPO / "tests" / "realworld"


def rules_by_action(path: Path, policy) -> tuple[dict[str, set[str]], list]:
    result = run_check([str(path)], policy)
    found: dict[str, set[str]] = {}
    for checked in result.objects:
        for finding in checked.findings:
            found.setdefault(finding.action, set()).add(finding.rule)
    return found, result.errors


def test_there_are_examples():
    assert len(GOOD) >= 5
    assert sorted(p.name[:5] for p in BAD) == [*(f"sg00{i}" for i in range(1, 7)), "sg009"]


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_good_example_has_no_findings(path, policy):
    result = run_check([str(path)], policy)
    assert result.errors == []
    assert result.objects, "an example with no object checks nothing"
    assert [(c.document.obj["metadata"]["name"], f.rule) for c in result.objects for f in c.findings] == []


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_example_yields_exactly_its_rule(path, policy):
    rule = path.name[:5].upper()
    result = run_check([str(path)], policy)
    assert result.errors == []
    assert sorted({f.rule for c in result.objects for f in c.findings}) == [rule]
    assert result.exit_code == (0 if rule == "SG004" else 1)


# file -> deny rules and warn rules. Reasoning, per file, from reading them:
# - dra-example-driver uses gpu.example.com / cpu.example.com / net.example.com, classes defined nowhere in these
#   files: not proven unable to hand out a GPU, so guarded (its named claims lack the finalizer, SG004; its
#   adminAccess template is refused in a namespace not labelled trusted, SG006); every pod with resourceClaims
#   is in scope, and none sets terminationGracePeriodSeconds (SG003).
#   Its namespaces carry no scrubgate.dev/tenancy label, so pods naming a claim by resourceClaimName are SG002.
#   podgroup-resourceclaimtemplate: each PodGroup shares its claim across the group's pods, in a namespace
#   without the tenancy label (SG002).
# - nvidia-dra-driver-gpu uses gpu.nvidia.com and mig.nvidia.com (in scope), vfio.gpu.nvidia.com and
#   imex.nvidia.com (excluded: no agent scrubs them). Its GPU ResourceClaims lack the sanitize finalizer (SG004,
#   a warning in CI; gpu-test3's only, imex-test1's are IMEX channels); its pods and Deployments never set a grace
#   period (SG003), nor do the pods asking for nvidia.com/gpu or a MIG profile as an extended resource
#   (extended-resources__*, whose DeviceClass mig-1g-12gb.gpu.nvidia.com is covered by *.gpu.nvidia.com);
#   gpu-test3 (pods) and imex-test1 (Deployments) name claims by resourceClaimName (SG002); the mig-mps Jobs
#   use the 1.26-1.30 `source: {resourceClaimName}` shape (SG002). resource.k8s.io/v1alpha2 claims,
#   GpuClaimParameters, ComputeDomains, MPIJobs and the mig-parted configs are passed over.
# - a pod without apiVersion (device-taint-pod-noschedule 4) is not an object the API would take: an input error.
NO_API_VERSION = "dra-example-driver/device-taints-tolerations__device-taint-pod-noschedule__4-pod-not-scheduled.yaml"
P3 = ({"SG003"}, set())
P23 = ({"SG002", "SG003"}, set())
P23W4 = ({"SG002", "SG003"}, {"SG004"})
P36 = ({"SG003", "SG006"}, set())
NONE = (set(), set())
EXPECTED: dict[str, tuple[set[str], set[str]]] = {
    # gpu.example.com is known nowhere here: a GPU class, fail closed (its claims get the finalizer; admin access
    # outside a namespace labelled trusted is refused, whatever the class).
    "dra-example-driver/admin-access__admin-access.yaml": P36,
    "dra-example-driver/basic-multiple-requests__basic-multiple-requests.yaml": P3,
    "dra-example-driver/basic-resourceclaim-opaque-config__basic-resourceclaim-opaque-config.yaml": P3,
    "dra-example-driver/basic-resourceclaimtemplate__basic-resourceclaimtemplate.yaml": P3,
    "dra-example-driver/basic-shared-claim-across-containers__basic-shared-claim-across-containers.yaml": P3,
    "dra-example-driver/basic-shared-claim-across-pods__basic-shared-claim-across-pods.yaml": P23W4,
    "dra-example-driver/binding-conditions__binding-conditions.yaml": P3,
    "dra-example-driver/cel-selector__cel-selector.yaml": P3,
    "dra-example-driver/device-taints-tolerations__device-taint-configurable-pod-eviction-time__1-basic-resourceclaimtemplate.yaml": P3,
    "dra-example-driver/device-taints-tolerations__device-taint-configurable-pod-eviction-time__2-device-taint-rule.yaml": NONE,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-noexecute__1-basic-resourceclaimtemplate.yaml": NONE,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-noexecute__2-pod-to-be-evicted.yaml": P3,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-noexecute__3-device-taint-rule.yaml": NONE,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-noexecute__4-pod-no-execute.yaml": P3,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-noschedule__1-basic-resourceclaimtemplate.yaml": NONE,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-noschedule__2-pod-keeps-running.yaml": P3,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-noschedule__3-device-taint-rule.yaml": NONE,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-noschedule__4-pod-not-scheduled.yaml": NONE,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-toleration__1-device-taint-rule.yaml": NONE,
    "dra-example-driver/device-taints-tolerations__device-taint-pod-toleration__2-basic-resourceclaimtemplate.yaml": P3,
    "dra-example-driver/extended-resource-request__extended-resource-request.yaml": P3,
    "dra-example-driver/gpu-allow-multiple-allocations-partitionable__gpu-allow-multiple-allocations-partitionable.yaml": P23W4,
    "dra-example-driver/gpu-allow-multiple-allocations__gpu-allow-multiple-allocations.yaml": P23W4,
    "dra-example-driver/initcontainer-shared-gpu__initcontainer-shared-gpu.yaml": P3,
    "dra-example-driver/native-resource-request__native-resource-request.yaml": P3,
    "dra-example-driver/net-consumable-capacity__net-consumable-capacity.yaml": P3,
    "dra-example-driver/partitionable-devices__partitionable-devices.yaml": P3,
    "dra-example-driver/podgroup-resourceclaimtemplate__podgroup-resourceclaimtemplate.yaml": P23,
    "dra-example-driver/prioritized-alternatives__prioritized-alternatives.yaml": P3,
    "nvidia-dra-driver-gpu/extended-resources__gpu-full.yaml": P3,
    "nvidia-dra-driver-gpu/extended-resources__mig-1g-12gb.yaml": P3,
    "nvidia-dra-driver-gpu/imex__channel-injection-all.yaml": P3,
    "nvidia-dra-driver-gpu/imex__channel-injection.yaml": P3,
    "nvidia-dra-driver-gpu/imex__nvbandwidth-test-job-1.yaml": NONE,
    "nvidia-dra-driver-gpu/imex__nvbandwidth-test-job-2.yaml": NONE,
    "nvidia-dra-driver-gpu/imex__nvbandwidth-test-job.yaml": NONE,
    "nvidia-dra-driver-gpu/imex__nvbandwidth-test-no-compute-domain-job.yaml": NONE,
    "nvidia-dra-driver-gpu/mig-mps__sharing-demo-claims-1.yaml": NONE,
    "nvidia-dra-driver-gpu/mig-mps__sharing-demo-claims.yaml": NONE,
    "nvidia-dra-driver-gpu/mig-mps__sharing-demo-job-1.yaml": P23,
    "nvidia-dra-driver-gpu/mig-mps__sharing-demo-job.yaml": P23,
    "nvidia-dra-driver-gpu/mig-mps__sharing-demo-mig-parted-config.yaml": NONE,
    "nvidia-dra-driver-gpu/mig-mps__sharing-demo-parameters-1.yaml": NONE,
    "nvidia-dra-driver-gpu/mig-mps__sharing-demo-parameters.yaml": NONE,
    "nvidia-dra-driver-gpu/quickstart__gpu-test7.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__gpu-test8.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__mig-parted-config.yaml": NONE,
    "nvidia-dra-driver-gpu/quickstart__v1__gpu-test-mps.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1__gpu-test-vfio-config.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1__gpu-test-vfiopci.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1__gpu-test1.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1__gpu-test2.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1__gpu-test3.yaml": P23W4,
    "nvidia-dra-driver-gpu/quickstart__v1__gpu-test4.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1__gpu-test5.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1__gpu-test6.yaml": P3,
    # Its Deployments name IMEX channel claims, of the file's own, whose class the policy leaves out: no GPU shared.
    "nvidia-dra-driver-gpu/quickstart__v1__imex-test1.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1beta1__gpu-test-mps.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1beta1__gpu-test-vfiopci.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1beta1__gpu-test1.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1beta1__gpu-test2.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1beta1__gpu-test3.yaml": P23W4,
    "nvidia-dra-driver-gpu/quickstart__v1beta1__gpu-test4.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1beta1__gpu-test5.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1beta1__gpu-test6.yaml": P3,
    "nvidia-dra-driver-gpu/quickstart__v1beta1__imex-test1.yaml": P3,
    "nvidia-dra-driver-gpu/selectors__claims.yaml": NONE,
    "nvidia-dra-driver-gpu/selectors__parameters.yaml": NONE,
    "nvidia-dra-driver-gpu/selectors__pods.yaml": P3,
}


def test_the_table_covers_the_whole_corpus():
    on_disk = {
        p.relative_to(REALWORLD).as_posix() for p in REALWORLD.rglob("*") if p.suffix in (".yaml", ".yml", ".json")
    }
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_realworld_manifest_gives_exactly_the_expected_rules(name, policy):
    found, errors = rules_by_action(REALWORLD / name, policy)
    assert [e.message for e in errors] == (
        ["document 0 has kind 'Pod' but no apiVersion: add its apiVersion"] if name == NO_API_VERSION else []
    )
    deny, warn = EXPECTED[name]
    assert (found.get("deny", set()), found.get("warn", set()), found.get("audit", set())) == (deny, warn, set())


def test_realworld_counts_per_object(policy):
    """Rules by file say nothing of how many objects they hit: pin the totals of the whole corpus too."""
    result = run_check([str(REALWORLD)], policy)
    counts: dict[str, int] = {}
    for checked in result.objects:
        for finding in checked.findings:
            counts[finding.rule] = counts.get(finding.rule, 0) + 1
    # SG004: the GPU claim of each gpu-test3, in two API versions (imex-test1's claims are IMEX channels), and the
    # example driver's 5 named claims of gpu.example.com, a class known nowhere here (fail closed).
    # SG002: the example driver's 3 files x 2 pods and its 2 PodGroups; gpu-test3 2 pods x 2 versions; the
    # mig-mps Jobs name 1 and 4 claims (imex-test1's Deployments name IMEX channel claims: no GPU shared).
    # SG006: the example driver's admin-access template, in a namespace not labelled trusted.
    assert counts["SG004"] == 2 + 5
    assert counts["SG002"] == 6 + 2 + 4 + 5
    assert counts["SG006"] == 1
    assert set(counts) == {"SG002", "SG003", "SG004", "SG006"}
    assert [e.file.endswith(NO_API_VERSION) for e in result.errors] == [True] and result.files == 69
