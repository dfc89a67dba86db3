"""Real DeviceClasses (tests/data/deviceclasses/, sources in its README): scrubgate's verdict on each, under the
default policy. Other vendors' classes (NICs, CPUs, TPUs, NPUs, other GPUs) prove their driver, so SG009 lets
them in and their claims skip every guard; NVIDIA's GPU and MIG classes are guarded; NVIDIA's excluded classes
(vfio, IMEX channels, ComputeDomain daemons) prove they hand out no GPU memory; the classes issue 28 got GPU
claims past the guard with are guarded, or refused under an excluded name. tests/test_e2e_device_classes.py
checks the same verdicts against kube-scheduler's allocations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from scrubgate.policies.engine import Admission, default, validate
from scrubgate.policies.scope import Scope
from scrubgate.policies.selectors import DeviceClasses, class_verdict

CORPUS = Path(__file__).parent / "data" / "deviceclasses"


def corpus() -> dict[tuple[str, str], dict[str, Any]]:
    """(file stem, class name) -> the DeviceClass."""
    found = {}
    for path in sorted(CORPUS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "DeviceClass":
                key = (path.stem, doc["metadata"]["name"])
                assert key not in found, f"{path}: two classes named {key[1]!r}"
                found[key] = doc
    return found


GPU, MEMORY, NONE = "may hand out GPUs and GPU memory", "GPU driver, no GPU memory", "no GPU"
# (file stem, class) -> (verdict, refused by SG009 under the default policy)
EXPECTED: dict[tuple[str, str], tuple[str, bool]] = {
    ("kubernetes-sigs__dra-driver-nvidia-gpu", "gpu.nvidia.com"): (GPU, False),  # nvidia.com/gpu is listed
    ("kubernetes-sigs__dra-driver-nvidia-gpu", "mig.nvidia.com"): (GPU, False),
    ("kubernetes-sigs__dra-driver-nvidia-gpu", "vfio.gpu.nvidia.com"): (MEMORY, False),
    ("kubernetes-sigs__dra-driver-nvidia-gpu", "compute-domain-daemon.nvidia.com"): (NONE, False),
    ("kubernetes-sigs__dra-driver-nvidia-gpu", "compute-domain-default-channel.nvidia.com"): (NONE, False),
    ("NVIDIA__k8s-dra-driver", "gpu.nvidia.com"): (GPU, False),
    ("NVIDIA__k8s-dra-driver", "mig.nvidia.com"): (GPU, False),
    ("NVIDIA__k8s-dra-driver", "imex.nvidia.com"): (MEMORY, False),  # type imex-channel of the GPU driver
    ("kubernetes-sigs__dranet", "erdma.alibaba.dra.net"): (NONE, False),  # the proof in its first selector
    ("kubernetes-sigs__dranet", "efa.networking.k8s.aws"): (NONE, False),
    ("kubernetes-sigs__dranet", "multinic"): (NONE, False),
    ("kubernetes-sigs__dranet", "dranet-rdma-for-mpi"): (NONE, False),
    ("kubernetes-sigs__dranet", "rdma"): (NONE, False),
    ("kubernetes-sigs__dranet", "dra.net"): (NONE, False),
    ("intel__intel-resource-drivers-for-kubernetes", "gpu.intel.com"): (NONE, False),
    ("intel__intel-resource-drivers-for-kubernetes", "gpu-vfio.intel.com"): (NONE, False),
    ("intel__intel-resource-drivers-for-kubernetes", "gpu-vfio-unmanaged.intel.com"): (NONE, False),
    ("intel__intel-resource-drivers-for-kubernetes", "gaudi.intel.com"): (NONE, False),
    ("intel__intel-resource-drivers-for-kubernetes", "qat.intel.com"): (NONE, False),
    ("ROCm__k8s-gpu-dra-driver", "gpu.amd.com"): (NONE, False),
    ("kubernetes-sigs__dra-driver-google-tpu", "tpu.google.com"): (NONE, False),
    ("kubernetes-sigs__dra-driver-cpu", "dra.cpu"): (NONE, False),
    ("k8snetworkplumbingwg__dra-driver-sriov", "sriovnetwork.k8snetworkplumbingwg.io"): (NONE, False),
    ("k8snetworkplumbingwg__dra-driver-sriov", "sriov-port1"): (NONE, False),  # unlisted extended resource: no GPU
    ("k8snetworkplumbingwg__dra-driver-sriov", "sriov-port2"): (NONE, False),
    ("k8snetworkplumbingwg__dra-driver-sriov", "vf-test2"): (NONE, False),
    ("kubernetes-sigs__dra-example-driver", "gpu.example.com"): (NONE, False),
    ("RBLN-SW__rbln-k8s-dra-driver", "npu.rebellions.ai"): (NONE, False),  # rebellions.ai/npu, unlisted
    ("ibm-aiu__dra-driver-spyre", "spyre.ibm.com"): (NONE, False),
    ("scrubgate__issue-28", "h100-by-model"): (GPU, False),
    ("scrubgate__issue-28", "shared-gpus"): (GPU, False),
    ("scrubgate__issue-28", "on-a-pcie-root"): (GPU, False),
    ("scrubgate__issue-28", "imex.nvidia.com"): (GPU, True),  # an excluded name that selects GPUs
}
GPU_DRIVERS = ("gpu.nvidia.com",)


def test_every_corpus_class_has_an_expectation():
    assert sorted(corpus()) == sorted(EXPECTED)


@pytest.mark.parametrize("key", sorted(EXPECTED), ids="/".join)
def test_verdict_on_a_real_class(policy, key):
    obj = corpus()[key]
    expected, refused = EXPECTED[key]
    verdict = class_verdict(obj, policy.gpu_drivers)
    assert (verdict.gpu, verdict.gpu_memory) == {GPU: (True, True), MEMORY: (True, False), NONE: (False, False)}[
        expected
    ], verdict.why
    admission = Admission("CREATE", "driver-installer", ("system:masters",))
    findings = validate(obj, policy, trusted=False, admission=admission)
    assert [f.rule for f in findings] == (["SG009"] if refused else []), [f.message for f in findings]


@pytest.mark.parametrize("key", sorted(EXPECTED), ids="/".join)
def test_claims_of_a_real_class_are_guarded_exactly_when_it_may_hand_out_gpu_memory_or_is_not_excluded(policy, key):
    """Known to the decision (the webhook's watch, or the manifests `scrubgate check` reads): a claim of a class
    that proves it hands out no GPU gets no finalizer and skips every guard; one of a GPU class gets it. An
    excluded class that proves it hands out no GPU memory (vfio, IMEX channels) is left out too."""
    obj = corpus()[key]
    name = obj["metadata"]["name"]
    scope = Scope(policy, DeviceClasses.of([obj], policy.gpu_drivers))
    expected, _ = EXPECTED[key]
    guarded = expected == GPU or (expected == MEMORY and not policy.is_excluded_class(name))
    assert scope.is_gpu_class(name) == guarded
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "team-a"},
        "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": name}}]}},
    }
    classes = DeviceClasses.of([obj], GPU_DRIVERS)
    assert [f.rule for f in default(claim, policy, classes=classes)] == (["SG004"] if guarded else [])
