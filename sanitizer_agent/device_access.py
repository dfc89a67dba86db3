"""Start-up check: the agent can reach every GPU it is supposed to guard, or it does not start.

An agent that cannot see a GPU would fence it and then fail every scrub of it, or, worse, not know it is
there. Where the container's device access is wrong (an unprivileged container with
`NVIDIA_VISIBLE_DEVICES` refused, a GPU or MIG capability node not mounted, the capabilities hidden without
`NVIDIA_MIG_CONFIG_DEVICES=all`, CUDA that cannot open a context), saying so at start is the only useful answer.
"""

from __future__ import annotations

from collections.abc import Mapping

from .claims import DeviceKey, SliceDevice, key_str, unscrubbable
from .gpu import GpuBackend, GpuError

ADVICE = (
    "run the agent as manifests/agent-daemonset.yaml does (privileged, runtimeClassName nvidia, "
    "NVIDIA_VISIBLE_DEVICES=all), and check that `nvidia-smi -L` on the node lists the GPU"
)


class DeviceAccessError(GpuError):
    """The agent cannot reach a device it must guard."""


def require_device_access(node: str, slices: Mapping[DeviceKey, SliceDevice], backend: GpuBackend) -> None:
    """Raises DeviceAccessError naming every GPU this node's ResourceSlices publish, of those the agent guards,
    that the backend cannot see, and the MIG management access dynamic MIG needs where the backend cannot use
    it."""
    wanted: dict[str, str] = {}
    dynamic = False
    for key, device in slices.items():
        if unscrubbable(key, device):
            continue  # not guarded (vfio passthrough, another driver's device): nothing to open
        if device.uuid:
            wanted.setdefault(device.uuid, key_str(key))
        if device.placement is not None:
            wanted.setdefault(device.placement.parent_uuid, key_str(key))
            dynamic = True
    try:
        seen = {d.uuid for d in backend.list_devices()}
    except GpuError as exc:
        raise DeviceAccessError(
            f"node {node}: the agent cannot list its GPUs ({exc}). Refusing to start: {ADVICE}"
        ) from exc
    problems = [f"{uuid} ({where})" for uuid, where in sorted(wanted.items()) if uuid not in seen]
    if problems:
        raise DeviceAccessError(
            f"node {node}: the agent cannot open GPU devices its ResourceSlices publish: {', '.join(problems)}; "
            f"it would not be able to scrub them. Refusing to start: {ADVICE}"
        )
    check = getattr(backend, "mig_management_problem", None)
    problem = check() if dynamic and check is not None else None
    if problem:
        raise DeviceAccessError(
            f"node {node}: dynamic MIG devices are published here, and the agent scrubs a released one through "
            f"a GPU instance it creates, but it cannot manage MIG: {problem}. Refusing to start: {ADVICE}"
        )
    # Once at start: CUDA, which every scrub runs through, opens a context and runs the kernels.
    cuda = getattr(backend, "cuda_problem", None)
    problem = cuda() if wanted and cuda is not None else None
    if problem:
        raise DeviceAccessError(
            f"node {node}: the agent cannot use CUDA, which every scrub needs ({problem}). Refusing to start: "
            f"{ADVICE}, and that the image's CUDA bindings (scrubgate[gpu]) match the node's driver"
        )
