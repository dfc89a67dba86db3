"""Stand-in for nvidia-ml-py's ``pynvml`` (checked against 13.615): the functions scrubgate calls,
with the real names, argument shapes, return shapes, constants and error classes, over the fake node
of ``fakegpu``. It is strict where the real library is: calls before ``nvmlInit`` fail with
Uninitialized, queries about the physical GPU fail on MIG handles, ``version`` must be
``nvmlMemory_v2``, a ``NVMLError(value)`` becomes its ``NVMLError_<Name>`` subclass. node.json's ``nvmlErrors``
makes a call fail, ``nvmlHang`` (a function's name) makes it never return.

A handle lookup attaches GPUs as nvml.h says (nvmlInit_v2 none; nvmlDeviceGetHandleByIndex and
nvmlDeviceGetHandleByPciBusId_v2 their target; nvmlDeviceGetHandleByUUID every GPU up to its target's, as it
"may initialize additional GPUs as it searches"), recorded per process until nvmlShutdown
(``fakegpu.attached``). While another process has a GPU attached, ``nvmlDeviceSetMigMode`` of it succeeds as a call
and reports IN_USE in its returned activationStatus, as NVML does (nvml.h: "activationStatus would return the
appropriate error code upon unsuccessful activation"), and as NVIDIA's DRA driver's long-lived session makes it
for everyone else with DynamicMIG. Before Hopper a MIG mode change is only pending until a GPU reset.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import string
import sys
import time
import uuid as uuidlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import fakegpu

NVML_SUCCESS = 0
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_MIG_DISABLE = 0x0
NVML_DEVICE_MIG_ENABLE = 0x1
NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_HOPPER = 9
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x8
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0x0
# Compute slices of each NVML_COMPUTE_INSTANCE_PROFILE_* (1, 2, 3, 4, 7, 8, 6 slices, 1 slice rev1).
_CI_PROFILE_SLICES = (1, 2, 3, 4, 7, 8, 6, 1)
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
nvmlMemory_v2 = 0x02000028

NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_FI_DEV_ECC_DBE_VOL_TOTAL = 4
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3
NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET = 4


class NVMLError(Exception):
    _valClassMapping: dict[int, type] = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_IN_USE: "In use by another client",
        NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient resources",
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return NVMLError._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def _make_error_classes() -> None:
    # As pynvml does: NVML_ERROR_NOT_SUPPORTED -> class NVMLError_NotSupported(NVMLError).
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        value = getattr(module, name)
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def new(cls: type, *args: Any, _value: int = value) -> NVMLError:
            return NVMLError.__new__(cls, _value)

        error_class = type(class_name, (NVMLError,), {"__new__": new})
        setattr(module, class_name, error_class)
        NVMLError._valClassMapping[value] = error_class


_make_error_classes()

# ---------------------------------------------------------------- library state

_refcount = 0


@dataclass(frozen=True)
class c_nvmlDevice_t:
    """pynvml's device handle; opaque to callers."""

    uuid: str
    parent_uuid: str | None


@dataclass(frozen=True)
class c_nvmlGpuInstance_t:
    gpu_uuid: str
    gi_id: int


@dataclass(frozen=True)
class c_nvmlComputeInstance_t:
    gpu_uuid: str
    gi_id: int
    ci_id: int


class c_nvmlGpuInstancePlacement_t(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


def _check(function: str, handle: c_nvmlDevice_t | None = None) -> None:
    if _refcount == 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if fakegpu.load().get("nvmlHang") == function:
        # A call into the driver that never returns, where no signal reaches (a task in D state).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGINT})
        while True:
            time.sleep(3600)
    errors = fakegpu.load().get("nvmlErrors", {})
    for key in ("*", handle.uuid if handle else None):
        code = errors.get(key, {}).get(function) if key else None
        if code is not None:
            raise NVMLError(globals()[code] if isinstance(code, str) else code)


def _gpus() -> list[dict[str, Any]]:
    return fakegpu.load()["gpus"]


def _record(handle: c_nvmlDevice_t) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the device's record, its GPU's record if it is a MIG device)."""
    for gpu in _gpus():
        if gpu["uuid"] == handle.uuid:
            return gpu, None
        for mig in gpu["migs"]:
            if mig["uuid"] == handle.uuid:
                return mig, gpu
    raise NVMLError(NVML_ERROR_GPU_IS_LOST)  # the handle's device is gone


def _physical(handle: Any, function: str) -> dict[str, Any]:
    # Queries about the physical GPU (ECC, row remapping, fields, PCI) refuse MIG handles.
    if not isinstance(handle, c_nvmlDevice_t):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    _check(function, handle)
    record, parent = _record(handle)
    if parent is not None:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return record


def _device(handle: Any, function: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if not isinstance(handle, c_nvmlDevice_t):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    _check(function, handle)
    return _record(handle)


# ---------------------------------------------------------------- API


def nvmlInit() -> None:
    global _refcount
    fakegpu.load()  # the real call fails when the driver is missing
    if _refcount == 0:
        fakegpu.own_session().mkdir(parents=True, exist_ok=True)  # attaches no GPU (nvmlInit_v2)
    _refcount += 1


def nvmlShutdown() -> None:
    global _refcount
    _check("nvmlShutdown")
    _refcount -= 1
    if _refcount == 0:
        shutil.rmtree(fakegpu.own_session(), ignore_errors=True)


def nvmlSystemGetDriverVersion() -> str:
    _check("nvmlSystemGetDriverVersion")
    return str(fakegpu.load().get("driverVersion", "595.45.04"))


def nvmlSystemGetNVMLVersion() -> str:
    _check("nvmlSystemGetNVMLVersion")
    return f"13.{nvmlSystemGetDriverVersion()}"


def nvmlSystemGetCudaDriverVersion() -> int:
    _check("nvmlSystemGetCudaDriverVersion")
    return int(fakegpu.load().get("cuda", {}).get("driverVersion", 13000))


def nvmlDeviceGetCount() -> int:
    _check("nvmlDeviceGetCount")
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> c_nvmlDevice_t:
    _check("nvmlDeviceGetHandleByIndex")
    gpus = _gpus()
    if not isinstance(index, int) or not 0 <= index < len(gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    handle = c_nvmlDevice_t(gpus[index]["uuid"], None)
    fakegpu.attach(handle.uuid)
    _check("nvmlDeviceGetHandleByIndex", handle)
    return handle


def nvmlDeviceGetHandleByUUID(uuid: str) -> c_nvmlDevice_t:
    _check("nvmlDeviceGetHandleByUUID")
    for gpu in _gpus():
        fakegpu.attach(gpu["uuid"])  # NVML "may initialize additional GPUs as it searches"
        if gpu["uuid"] == uuid:
            return c_nvmlDevice_t(uuid, None)
        if any(m["uuid"] == uuid for m in gpu["migs"]):
            return c_nvmlDevice_t(uuid, gpu["uuid"])
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetHandleByPciBusId(pciBusId: str) -> c_nvmlDevice_t:
    """domain:bus:device[.function] in hex (nvml.h, nvmlDeviceGetHandleByPciBusId_v2); attaches the target only."""
    _check("nvmlDeviceGetHandleByPciBusId")
    parts = str(pciBusId).split(".")[0].split(":")
    try:
        domain, bus, device = (int(p, 16) for p in parts) if len(parts) == 3 else (0, *(int(p, 16) for p in parts))
    except ValueError:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT) from None
    for gpu in _gpus():
        if (domain, bus, device) == (gpu.get("pciDomain", 0), gpu["pciBus"], 0):
            fakegpu.attach(gpu["uuid"])
            return c_nvmlDevice_t(gpu["uuid"], None)
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceIsMigDeviceHandle(device: c_nvmlDevice_t) -> ctypes.c_uint:
    """nvidia-ml-py 13.615 returns the c_uint itself, not its value."""
    _, parent = _device(device, "nvmlDeviceIsMigDeviceHandle")
    return ctypes.c_uint(1 if parent is not None else 0)


def nvmlDeviceGetPciInfo(handle: c_nvmlDevice_t) -> SimpleNamespace:
    record = _physical(handle, "nvmlDeviceGetPciInfo")
    domain, bus = record.get("pciDomain", 0), record["pciBus"]
    return SimpleNamespace(domain=domain, bus=bus, device=0, busId=f"{domain:08X}:{bus:02X}:00.0")


def nvmlDeviceGetUUID(handle: c_nvmlDevice_t) -> str:
    record, _ = _device(handle, "nvmlDeviceGetUUID")
    return record["uuid"]


def nvmlDeviceGetName(handle: c_nvmlDevice_t) -> str:
    record, parent = _device(handle, "nvmlDeviceGetName")
    return f"{parent['name']} MIG {record['memory'] >> 20}MiB" if parent else record["name"]


def nvmlDeviceGetMemoryInfo(handle: c_nvmlDevice_t, version: int | None = None) -> SimpleNamespace:
    record, parent = _device(handle, "nvmlDeviceGetMemoryInfo")
    gpu = parent or record
    reserved = record["reserved"]
    total = record["memory"] + reserved
    used = reserved + sum(b for _, b in fakegpu.context_holders(record["uuid"]))
    free = max(total - used, 0)
    if not version:
        # c_nvmlMemory_t: "used" includes the reserved memory.
        return SimpleNamespace(total=total, free=free, used=used)
    if not gpu.get("memoryV2", True):
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
    if version != nvmlMemory_v2:
        raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return SimpleNamespace(version=version, total=total, reserved=reserved, free=free, used=used - reserved)


def nvmlDeviceGetPersistenceMode(device: c_nvmlDevice_t) -> int:
    return int(_physical(device, "nvmlDeviceGetPersistenceMode").get("persistenceMode", NVML_FEATURE_ENABLED))


def nvmlDeviceGetArchitecture(device: c_nvmlDevice_t) -> int:
    return int(_physical(device, "nvmlDeviceGetArchitecture").get("architecture", NVML_DEVICE_ARCH_HOPPER))


def nvmlDeviceGetGspFirmwareMode(handle: c_nvmlDevice_t) -> list[int]:
    """[isEnabled, defaultMode]."""
    enabled = int(_physical(handle, "nvmlDeviceGetGspFirmwareMode").get("gspFirmware") is not None)
    return [enabled, enabled]


def nvmlDeviceGetGspFirmwareVersion(handle: c_nvmlDevice_t) -> bytes:
    """nvidia-ml-py 13.615 returns the char array's bytes."""
    version = _physical(handle, "nvmlDeviceGetGspFirmwareVersion").get("gspFirmware")
    if version is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return str(version).encode()


def nvmlDeviceGetMigMode(device: c_nvmlDevice_t) -> list[int]:
    """[current, pending]."""
    record = _physical(device, "nvmlDeviceGetMigMode")
    if record.get("migMode") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return [record["migMode"], record.get("migModePending", record["migMode"])]


def nvmlDeviceSetMigMode(device: c_nvmlDevice_t, mode: int) -> int:
    """The activationStatus, as nvidia-ml-py returns it: IN_USE while another process has the GPU attached (the
    call itself succeeds); on Hopper and later the mode changes at once, before Hopper it is pending until a GPU
    reset. A GPU instance left is refused outright."""
    record = _physical(device, "nvmlDeviceSetMigMode")
    if record.get("migMode") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if record["gis"]:
        raise NVMLError(NVML_ERROR_IN_USE)
    if fakegpu.attached_by_others(record["uuid"]):
        return NVML_ERROR_IN_USE
    if record.get("architecture", NVML_DEVICE_ARCH_HOPPER) >= NVML_DEVICE_ARCH_HOPPER:
        record["migMode"] = mode
    record["migModePending"] = mode
    _save_gpu(record)
    return NVML_SUCCESS


def nvmlDeviceGetMaxMigDeviceCount(device: c_nvmlDevice_t) -> int:
    record = _physical(device, "nvmlDeviceGetMaxMigDeviceCount")
    if record.get("migMode") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return record["maxMig"]


def nvmlDeviceGetMigDeviceHandleByIndex(device: c_nvmlDevice_t, index: int) -> c_nvmlDevice_t:
    record = _physical(device, "nvmlDeviceGetMigDeviceHandleByIndex")
    if record.get("migMode") != NVML_DEVICE_MIG_ENABLE or not 0 <= index < record["maxMig"]:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    for mig in record["migs"]:
        if mig["slot"] == index:
            return c_nvmlDevice_t(mig["uuid"], record["uuid"])
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: c_nvmlDevice_t) -> c_nvmlDevice_t:
    _, parent = _device(migDevice, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
    if parent is None:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return c_nvmlDevice_t(parent["uuid"], None)


def _processes(handle: c_nvmlDevice_t, kind: str, function: str) -> list[SimpleNamespace]:
    record, parent = _device(handle, function)
    if parent is not None and kind == "graphics":
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    listed = [tuple(p) for p in record.get("processes", {}).get(kind, [])]
    if kind == "compute":
        listed += fakegpu.context_holders(record["uuid"])
    # As nvidia-ml-py: objects with the c_nvmlProcessInfo_v3_t fields; usedGpuMemory None when N/A.
    return [
        SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
        for pid, used in listed
    ]


def nvmlDeviceGetComputeRunningProcesses(handle: c_nvmlDevice_t) -> list[SimpleNamespace]:
    return _processes(handle, "compute", "nvmlDeviceGetComputeRunningProcesses")


def nvmlDeviceGetGraphicsRunningProcesses(handle: c_nvmlDevice_t) -> list[SimpleNamespace]:
    return _processes(handle, "graphics", "nvmlDeviceGetGraphicsRunningProcesses")


def nvmlDeviceGetMPSComputeRunningProcesses(handle: c_nvmlDevice_t) -> list[SimpleNamespace]:
    return _processes(handle, "mps", "nvmlDeviceGetMPSComputeRunningProcesses")


def nvmlDeviceGetTotalEccErrors(handle: c_nvmlDevice_t, errorType: int, counterType: int) -> int:
    record = _physical(handle, "nvmlDeviceGetTotalEccErrors")
    if errorType not in (0, 1) or counterType not in (0, 1):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if record.get("ecc") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return record["ecc"] if errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0


def nvmlDeviceGetEccMode(handle: c_nvmlDevice_t) -> list[int]:
    record = _physical(handle, "nvmlDeviceGetEccMode")
    if record.get("eccMode") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return list(record["eccMode"])


def nvmlDeviceGetRemappedRows(device: c_nvmlDevice_t) -> tuple[int, int, int, int]:
    record = _physical(device, "nvmlDeviceGetRemappedRows")
    if record.get("remappedRows") is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    corrected, uncorrected, pending, failure = record["remappedRows"]
    return (corrected, uncorrected, pending, failure)


def nvmlDeviceGetFieldValues(handle: c_nvmlDevice_t, fieldIds: list[Any]) -> list[SimpleNamespace]:
    record = _physical(handle, "nvmlDeviceGetFieldValues")
    values = []
    for field in fieldIds:
        field_id, scope = field if isinstance(field, tuple) else (field, 0)
        value = SimpleNamespace(dVal=0.0, uiVal=0, ulVal=0, ullVal=0, sllVal=0, siVal=0, usVal=0)
        ret, value_type = NVML_ERROR_NOT_SUPPORTED, NVML_VALUE_TYPE_UNSIGNED_INT
        if field_id == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and record.get("recoveryAction") is not None:
            ret, value.uiVal = NVML_SUCCESS, record["recoveryAction"]
        elif field_id == NVML_FI_DEV_ECC_DBE_VOL_TOTAL and record.get("ecc") is not None:
            ret, value_type, value.ullVal = NVML_SUCCESS, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, record["ecc"]
        values.append(
            SimpleNamespace(
                fieldId=field_id,
                scopeId=scope,
                timestamp=0,
                latencyUsec=0,
                valueType=value_type,
                nvmlReturn=ret,
                value=value,
            )
        )
    return values


# ---------------------------------------------------------------- MIG: GPU and compute instances


def _save_gpu(gpu: dict[str, Any]) -> None:
    node = fakegpu.load()
    node["gpus"] = [gpu if g["uuid"] == gpu["uuid"] else g for g in node["gpus"]]
    path = fakegpu.node_dir() / "node.json"
    tmp = path.with_name("node.json.tmp")
    tmp.write_text(json.dumps(node, indent=1))
    os.replace(tmp, path)


def _index(gpu: dict[str, Any]) -> int:
    return next(i for i, g in enumerate(_gpus()) if g["uuid"] == gpu["uuid"])


def nvmlDeviceGetMinorNumber(device: c_nvmlDevice_t) -> int:
    """/dev/nvidia<minor> of a physical GPU: its index here."""
    return _index(_physical(device, "nvmlDeviceGetMinorNumber"))


def _mig_record(handle: Any, function: str) -> tuple[dict[str, Any], dict[str, Any]]:
    record, parent = _device(handle, function)
    if parent is None:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # a full GPU has no GPU instance
    return record, parent


def _gi(handle: Any, function: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if not isinstance(handle, c_nvmlGpuInstance_t):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    _check(function)
    gpu = next((g for g in _gpus() if g["uuid"] == handle.gpu_uuid), None)
    gi = next((g for g in (gpu or {}).get("gis", []) if g["id"] == handle.gi_id), None)
    if gpu is None or gi is None:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return gi, gpu


def nvmlDeviceGetGpuInstanceId(device: c_nvmlDevice_t) -> int:
    return int(_mig_record(device, "nvmlDeviceGetGpuInstanceId")[0]["gi"])


def nvmlDeviceGetComputeInstanceId(device: c_nvmlDevice_t) -> int:
    return int(_mig_record(device, "nvmlDeviceGetComputeInstanceId")[0]["ci"])


def nvmlDeviceGetGpuInstanceById(device: c_nvmlDevice_t, gpuInstanceId: int) -> c_nvmlGpuInstance_t:
    gpu = _physical(device, "nvmlDeviceGetGpuInstanceById")
    if not any(g["id"] == gpuInstanceId for g in gpu.get("gis", [])):
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return c_nvmlGpuInstance_t(gpu["uuid"], gpuInstanceId)


def nvmlGpuInstanceGetInfo(gpuInstance: c_nvmlGpuInstance_t) -> SimpleNamespace:
    gi, gpu = _gi(gpuInstance, "nvmlGpuInstanceGetInfo")
    return SimpleNamespace(
        device=c_nvmlDevice_t(gpu["uuid"], None),
        id=gi["id"],
        profileId=gi["profileId"],
        placement=SimpleNamespace(start=gi["start"], size=gi["size"]),
    )


def nvmlDeviceCreateGpuInstanceWithPlacement(
    device: c_nvmlDevice_t, profileId: int, placement: Any
) -> c_nvmlGpuInstance_t:
    gpu = _physical(device, "nvmlDeviceCreateGpuInstanceWithPlacement")
    # The C API takes a pointer: pynvml passes the argument through, so callers must pass byref(...).
    wanted = getattr(placement, "_obj", None)
    if not isinstance(wanted, c_nvmlGpuInstancePlacement_t):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if gpu.get("migMode") != NVML_DEVICE_MIG_ENABLE:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if gpu.get("noMigPermission"):
        raise NVMLError(NVML_ERROR_NO_PERMISSION)
    profile = gpu["giProfiles"].get(str(profileId))
    if profile is None or wanted.size != profile[0] or wanted.start % profile[0]:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    taken = {s for g in gpu["gis"] for s in range(g["start"], g["start"] + g["size"])}
    if taken & set(range(wanted.start, wanted.start + wanted.size)) or wanted.start + wanted.size > gpu["memorySlices"]:
        raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)
    gi_id = max([g["id"] for g in gpu["gis"]], default=0) + 1
    gpu["gis"].append({"id": gi_id, "profileId": profileId, "start": wanted.start, "size": wanted.size})
    _save_gpu(gpu)
    fakegpu.grant_capability(fakegpu.load(), _index(gpu), gi_id)
    return c_nvmlGpuInstance_t(gpu["uuid"], gi_id)


def nvmlGpuInstanceGetComputeInstanceProfileInfo(
    device: c_nvmlGpuInstance_t, profile: int, engProfile: int, version: int = 2
) -> SimpleNamespace:
    gi, gpu = _gi(device, "nvmlGpuInstanceGetComputeInstanceProfileInfo")
    if not 0 <= profile < NVML_COMPUTE_INSTANCE_PROFILE_COUNT or engProfile != 0:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    compute = gpu["giProfiles"][str(gi["profileId"])][1]
    if _CI_PROFILE_SLICES[profile] > compute:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return SimpleNamespace(id=profile, sliceCount=_CI_PROFILE_SLICES[profile], instanceCount=1)


def nvmlGpuInstanceCreateComputeInstance(gpuInstance: c_nvmlGpuInstance_t, profileId: int) -> c_nvmlComputeInstance_t:
    gi, gpu = _gi(gpuInstance, "nvmlGpuInstanceCreateComputeInstance")
    if any(m.get("gi") == gi["id"] for m in gpu["migs"]):
        raise NVMLError(NVML_ERROR_INSUFFICIENT_RESOURCES)  # one compute instance per GPU instance here
    slot = min(set(range(gpu["maxMig"])) - {m["slot"] for m in gpu["migs"]})
    memory = gpu["giProfiles"][str(gi["profileId"])][2]
    mig = {
        "slot": slot,
        "uuid": f"MIG-{uuidlib.uuid4()}",
        "memory": memory,
        "reserved": 0,
        "sms": 1,
        "gi": gi["id"],
        "ci": 0,
        "memoryFile": fakegpu.placement_file(gpu["uuid"], gi["start"], gi["size"]),
    }
    path = fakegpu.device_memory_path(mig)
    if not path.exists():
        with open(path, "wb") as f:
            f.truncate(memory)
    gpu["migs"].append(mig)
    _save_gpu(gpu)
    fakegpu.grant_capability(fakegpu.load(), _index(gpu), gi["id"], 0)
    return c_nvmlComputeInstance_t(gpu["uuid"], gi["id"], 0)


def nvmlGpuInstanceGetComputeInstanceById(
    gpuInstance: c_nvmlGpuInstance_t, computeInstanceId: int
) -> c_nvmlComputeInstance_t:
    gi, gpu = _gi(gpuInstance, "nvmlGpuInstanceGetComputeInstanceById")
    if not any(m.get("gi") == gi["id"] and m["ci"] == computeInstanceId for m in gpu["migs"]):
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return c_nvmlComputeInstance_t(gpu["uuid"], gi["id"], computeInstanceId)


def nvmlComputeInstanceGetInfo(computeInstance: c_nvmlComputeInstance_t) -> SimpleNamespace:
    _check("nvmlComputeInstanceGetInfo")
    return SimpleNamespace(id=computeInstance.ci_id, profileId=0)


def nvmlComputeInstanceDestroy(computeInstance: c_nvmlComputeInstance_t) -> None:
    gi, gpu = _gi(c_nvmlGpuInstance_t(computeInstance.gpu_uuid, computeInstance.gi_id), "nvmlComputeInstanceDestroy")
    mig = next((m for m in gpu["migs"] if m.get("gi") == gi["id"] and m["ci"] == computeInstance.ci_id), None)
    if mig is None:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if fakegpu.context_holders(mig["uuid"]):
        raise NVMLError(NVML_ERROR_IN_USE)
    gpu["migs"].remove(mig)
    _save_gpu(gpu)
    fakegpu.revoke_capability(fakegpu.load(), _index(gpu), gi["id"], computeInstance.ci_id)


def nvmlGpuInstanceDestroy(gpuInstance: c_nvmlGpuInstance_t) -> None:
    gi, gpu = _gi(gpuInstance, "nvmlGpuInstanceDestroy")
    if any(m.get("gi") == gi["id"] for m in gpu["migs"]):
        raise NVMLError(NVML_ERROR_IN_USE)
    gpu["gis"].remove(gi)
    _save_gpu(gpu)
    fakegpu.revoke_capability(fakegpu.load(), _index(gpu), gi["id"])
