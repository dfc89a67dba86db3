"""Stand-in for ``cuda.bindings.driver`` (cuda-bindings 12.x/13.x): the calls scrubgate makes, with
the real names, ``(CUresult, outputs...)`` tuple returns, error codes and argument rules, over the
fake node of ``fakegpu`` (device memory is a file, so processes see each other's leftovers).

What it enforces, as the driver does: cuInit first; ``CUDA_VISIBLE_DEVICES`` decides which device is
ordinal 0 (a GPU in MIG mode is not a CUDA device, its MIG devices are); a current context for memory
and module calls; memory ops inside one allocation; out-of-memory when the device is full (the
module's code needs memory too, so load it before filling the device); PTX NUL-terminated, kernel
names as bytes, kernel parameters matching the PTX entry's parameter list.

Kernels run in Python by name: ``scrubgate_count_nonzero`` and ``scrubgate_count_equal_u32``, with
the semantics documented beside their PTX in sanitizer_agent/gpu/cuda_scrub.py.

Faults, from node.json's ``cuda`` object: ``fail: {call: "CUDA_ERROR_..."}``, ``memsetNoop`` (true,
or a list of memset calls: they return success but write nothing; with ``memsetNoopFrom: n`` only those of
n bytes or more), ``hang: call`` (the call never returns), ``heldBytes: {uuid: n}``
(memory another process holds), ``scrubOnFree`` (freed memory is zeroed, as the kernel driver may),
a file ``obliterate-next-mig`` in the node directory (the next
processes to open a MIG device see NVIDIA's driver tear it down: as many as the file says, else one), ``lazyBytes`` (device memory the
first kernel launch takes, as lazy loading does: out of memory when
the device is already full), ``computeCapability`` ([major, minor], default [9, 0]: which shipped cubin
loads), ``noJit`` (PTX cannot be loaded: no JIT compiler in the container).
"""

from __future__ import annotations

import array
import atexit
import ctypes
import enum
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fakegpu


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_ECC_UNCORRECTABLE = 214
    CUDA_ERROR_INVALID_PTX = 218
    CUDA_ERROR_JIT_COMPILER_NOT_FOUND = 221
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_UNKNOWN = 999


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class _Handle:
    """The bindings' opaque handle classes: constructible from an int, ``int()`` gives it back."""

    def __init__(self, init_value: int = 0) -> None:
        self._value = int(init_value)

    def __int__(self) -> int:
        return self._value

    def getPtr(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._value:#x}>"


class CUdevice(_Handle):
    pass


class CUdeviceptr(_Handle):
    pass


class CUcontext(_Handle):
    pass


class CUmodule(_Handle):
    pass


class CUfunction(_Handle):
    pass


class CUstream(_Handle):
    pass


BASE = 0x7F00_0000_0000  # device addresses start here, so a host pointer is never mistaken for one
ALIGN = 512
_PTX_TYPE_SIZES = {".u64": 8, ".b64": 8, ".s64": 8, ".u32": 4, ".b32": 4, ".s32": 4}
_CTYPE_SIZES = {
    ctypes.c_void_p: 8,
    ctypes.c_size_t: 8,
    ctypes.c_uint64: 8,
    ctypes.c_ulonglong: 8,
    ctypes.c_int64: 8,
    ctypes.c_uint: 4,
    ctypes.c_uint32: 4,
    ctypes.c_int: 4,
}


@dataclass
class _State:
    initialised: bool = False
    device: dict[str, Any] | None = None
    context: bool = False
    allocations: dict[int, int] = field(default_factory=dict)  # offset -> size
    modules: dict[int, dict[str, list[int]]] = field(default_factory=dict)  # id -> entry -> param sizes
    functions: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    next_handle: int = 1
    launched: bool = False


_state = _State()


def _config() -> dict[str, Any]:
    return fakegpu.load().get("cuda", {})


def _visible_device() -> dict[str, Any] | None:
    wanted = os.environ.get("CUDA_VISIBLE_DEVICES")
    node = fakegpu.load()
    for index, gpu in enumerate(node["gpus"]):
        # With MIG on, the GPU itself is no CUDA device; its MIG devices are.
        candidates = gpu["migs"] if gpu.get("migMode") == 1 else [gpu]
        for device in candidates:
            if (wanted is None or wanted == device["uuid"]) and _openable(node, index, device):
                return device
    return None


def _openable(node: dict[str, Any], gpu_index: int, device: dict[str, Any]) -> bool:
    """A MIG device is visible only where the nodes of its capabilities exist in /dev/nvidia-caps."""
    caps = node.get("capabilities")
    if not caps or "gi" not in device:
        return True
    minors = fakegpu.capability_minors(gpu_index, device["gi"], device["ci"])
    return all((Path(caps["dev"]) / f"nvidia-cap{minor}").exists() for minor in minors)


def _fault(call: str) -> CUresult | None:
    config = _config()
    if config.get("hang") == call:
        while True:
            time.sleep(3600)
    code = config.get("fail", {}).get(call)
    return CUresult[code] if code else None


def _ready(call: str, context: bool = True) -> CUresult | None:
    if not _state.initialised:
        return CUresult.CUDA_ERROR_NOT_INITIALIZED
    if context and not _state.context:
        return CUresult.CUDA_ERROR_INVALID_CONTEXT
    return _fault(call)


def _handle(kind: type[_Handle]) -> _Handle:
    _state.next_handle += 1
    return kind(_state.next_handle)


# ---------------------------------------------------------------- device memory


def _size() -> int:
    assert _state.device is not None
    return int(_state.device["memory"])


def _used() -> int:
    assert _state.device is not None
    held = _config().get("heldBytes", {}).get(_state.device["uuid"], 0)
    context = int(_state.device.get("contextBytes", 1 << 20)) if _state.context else 0
    return context + held + sum(_state.allocations.values())


def _publish_usage() -> None:
    # NVML lists this process with what it holds, as the real driver reports contexts.
    assert _state.device is not None
    path = fakegpu.contexts_dir(_state.device["uuid"]) / str(os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(_used()))


def _allocate(size: int) -> int | None:
    """First fit from the bottom of the device's memory, so consecutive processes reuse the same
    bytes as a real allocator does; None when nothing fits."""
    size = -(-size // ALIGN) * ALIGN
    if _used() + size > _size():
        return None
    start = 0
    for offset in sorted(_state.allocations):
        if offset - start >= size:
            break
        start = max(start, offset + _state.allocations[offset])
    if start + size > _size() - _config().get("heldBytes", {}).get(_state.device["uuid"], 0):
        return None
    _state.allocations[start] = size
    return start


def _span(ptr: Any, length: int) -> int | None:
    """Device offset of [ptr, ptr+length) if it lies inside one allocation."""
    offset = int(ptr) - BASE
    for start, size in _state.allocations.items():
        if start <= offset and offset + length <= start + size:
            return offset
    return None


def _read(offset: int, length: int) -> bytes:
    assert _state.device is not None
    with open(fakegpu.device_memory_path(_state.device), "rb") as f:
        f.seek(offset)
        return f.read(length)


def _write(offset: int, data: bytes) -> None:
    assert _state.device is not None
    with open(fakegpu.device_memory_path(_state.device), "r+b") as f:
        f.seek(offset)
        f.write(data)


def _fill(offset: int, length: int, pattern: bytes) -> None:
    block = pattern * ((1 << 20) // len(pattern))
    for start in range(0, length, len(block)):
        _write(offset + start, block[: min(len(block), length - start)])


def _scrub_on_exit() -> None:
    if _state.device is not None and _config().get("scrubOnFree"):
        for offset, size in _state.allocations.items():
            _fill(offset, size, b"\0")
    if _state.device is not None:
        (fakegpu.contexts_dir(_state.device["uuid"]) / str(os.getpid())).unlink(missing_ok=True)


atexit.register(_scrub_on_exit)


# ---------------------------------------------------------------- API


def cuDriverGetVersion() -> tuple[CUresult, int]:
    """The CUDA version the driver supports (1000 * major + 10 * minor); needs no cuInit."""
    return (_fault("cuDriverGetVersion") or CUresult.CUDA_SUCCESS, int(_config().get("driverVersion", 13000)))


def cuInit(Flags: int) -> tuple[CUresult]:
    if Flags != 0:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    device = _visible_device()
    if device is None:
        return (CUresult.CUDA_ERROR_NO_DEVICE,)
    marker = fakegpu.node_dir() / "obliterate-next-mig"
    if "gi" in device and marker.exists():
        # NVIDIA's DRA driver restarts under this process and tears the MIG device down (as many times as the
        # file says, once if it says nothing).
        left = int(marker.read_text() or 1) - 1
        if left:
            marker.write_text(str(left))
        else:
            marker.unlink()
        fakegpu.obliterate(device["uuid"])
        return (CUresult.CUDA_ERROR_NO_DEVICE,)
    _state.initialised, _state.device = True, device
    return (_fault("cuInit") or CUresult.CUDA_SUCCESS,)


def cuDeviceGet(ordinal: int) -> tuple[CUresult, CUdevice | None]:
    err = _ready("cuDeviceGet", context=False)
    if err:
        return (err, None)
    if ordinal != 0:
        return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
    return (CUresult.CUDA_SUCCESS, CUdevice(0))


def cuDeviceGetAttribute(attrib: CUdevice_attribute, dev: CUdevice) -> tuple[CUresult, int]:
    err = _ready("cuDeviceGetAttribute", context=False)
    if err:
        return (err, 0)
    if not isinstance(attrib, CUdevice_attribute) or not isinstance(dev, CUdevice):
        raise TypeError("cuDeviceGetAttribute(attrib: CUdevice_attribute, dev: CUdevice)")
    assert _state.device is not None
    major, minor = _capability()
    values = {
        CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: int(_state.device.get("sms", 1)),
        CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: major,
        CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: minor,
    }
    return (CUresult.CUDA_SUCCESS, values[attrib])


def _capability() -> tuple[int, int]:
    # A MIG device's record has none of its own: its GPU's (an H200's 9.0 by default).
    major, minor = _config().get("computeCapability", [9, 0])
    return int(major), int(minor)


def _cubin_entries(image: bytes) -> dict[str, list[int]] | CUresult:
    """Entries of a cubin (an ELF whose header names its SM) that runs on this device: same major, minor
    not above the device's; the parameter sizes are those of the kernels' PTX."""
    flags = int.from_bytes(image[48:52], "little")
    sm = (flags >> 8) & 0xFF if image[7] == 65 else flags & 0xFF  # the newer and the older cubin ABI
    major, minor = _capability()
    if sm // 10 != major or sm % 10 > minor:
        return CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU
    sizes = {"scrubgate_count_nonzero": [8, 8, 8], "scrubgate_count_equal_u32": [8, 8, 4, 8]}
    return {name: params for name, params in sizes.items() if name.encode() in image}


def cuDevicePrimaryCtxRetain(dev: CUdevice) -> tuple[CUresult, CUcontext | None]:
    err = _ready("cuDevicePrimaryCtxRetain", context=False)
    if err:
        return (err, None)
    if not isinstance(dev, CUdevice) or int(dev) != 0:
        return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
    if not _state.context:
        _state.context = True
        if _used() > _size():
            _state.context = False
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    _publish_usage()
    return (CUresult.CUDA_SUCCESS, CUcontext(1))


def cuCtxSetCurrent(ctx: CUcontext) -> tuple[CUresult]:
    err = _ready("cuCtxSetCurrent", context=False)
    if err:
        return (err,)
    if not isinstance(ctx, CUcontext) or int(ctx) != 1:
        return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
    return (CUresult.CUDA_SUCCESS,)


def cuModuleLoadData(image: Any) -> tuple[CUresult, CUmodule | None]:
    err = _ready("cuModuleLoadData")
    if err:
        return (err, None)
    if isinstance(image, bytes) and image.startswith(b"\x7fELF"):
        entries = _cubin_entries(image)
        if isinstance(entries, CUresult):
            return (entries, None)
        return _load(entries)
    if _config().get("noJit"):
        return (CUresult.CUDA_ERROR_JIT_COMPILER_NOT_FOUND, None)
    if not isinstance(image, bytes) or not image.endswith(b"\0") or image.count(b"\0") != 1:
        return (CUresult.CUDA_ERROR_INVALID_PTX, None)
    text = image[:-1].decode("ascii", errors="replace")
    if not re.search(r"^\s*\.version \d+\.\d+", text, re.M) or ".address_size 64" not in text:
        return (CUresult.CUDA_ERROR_INVALID_PTX, None)
    entries = {}
    for name, params in re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", text):
        sizes = re.findall(r"\.param\s+(\.\w+)\s+\w+", params)
        if any(s not in _PTX_TYPE_SIZES for s in sizes):
            return (CUresult.CUDA_ERROR_INVALID_PTX, None)
        entries[name] = [_PTX_TYPE_SIZES[s] for s in sizes]
    if not entries:
        return (CUresult.CUDA_ERROR_INVALID_PTX, None)
    return _load(entries)


def _load(entries: dict[str, list[int]]) -> tuple[CUresult, CUmodule | None]:
    # The module's code lives in device memory: a full device cannot load a module.
    code = _allocate(int(_config().get("moduleBytes", 256 << 10)))
    if code is None:
        return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    _publish_usage()
    module = _handle(CUmodule)
    _state.modules[int(module)] = entries
    return (CUresult.CUDA_SUCCESS, module)


def cuModuleGetFunction(hmod: CUmodule, name: bytes) -> tuple[CUresult, CUfunction | None]:
    if not isinstance(name, bytes):
        raise TypeError(f"expected bytes, {type(name).__name__} found")
    err = _ready("cuModuleGetFunction")
    if err:
        return (err, None)
    entries = _state.modules.get(int(hmod)) if isinstance(hmod, CUmodule) else None
    if entries is None:
        return (CUresult.CUDA_ERROR_INVALID_HANDLE, None)
    if name.decode() not in entries:
        return (CUresult.CUDA_ERROR_NOT_FOUND, None)
    function = _handle(CUfunction)
    _state.functions[int(function)] = (name.decode(), entries[name.decode()])
    return (CUresult.CUDA_SUCCESS, function)


def cuMemGetInfo() -> tuple[CUresult, int, int]:
    err = _ready("cuMemGetInfo")
    if err:
        return (err, 0, 0)
    return (CUresult.CUDA_SUCCESS, max(_size() - _used(), 0), _size())


def cuMemAlloc(bytesize: int) -> tuple[CUresult, CUdeviceptr | None]:
    err = _ready("cuMemAlloc")
    if err:
        return (err, None)
    if bytesize <= 0:
        return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
    offset = _allocate(bytesize)
    if offset is None:
        return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
    _publish_usage()
    return (CUresult.CUDA_SUCCESS, CUdeviceptr(BASE + offset))


def cuMemFree(dptr: Any) -> tuple[CUresult]:
    err = _ready("cuMemFree")
    if err:
        return (err,)
    offset = int(dptr) - BASE
    size = _state.allocations.pop(offset, None)
    if size is None:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    if _config().get("scrubOnFree"):
        _fill(offset, size, b"\0")
    _publish_usage()
    return (CUresult.CUDA_SUCCESS,)


def _memset(call: str, dstDevice: Any, pattern: bytes, N: int) -> tuple[CUresult]:
    err = _ready(call)
    if err:
        return (err,)
    offset = _span(dstDevice, N * len(pattern))
    if offset is None or (int(dstDevice) % len(pattern)):
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    config = _config()
    noop = config.get("memsetNoop")
    listed = noop is True or (isinstance(noop, list) and call in noop)
    if not (listed and N * len(pattern) >= config.get("memsetNoopFrom", 0)):
        _fill(offset, N * len(pattern), pattern)
    return (CUresult.CUDA_SUCCESS,)


def cuMemsetD8(dstDevice: Any, uc: int, N: int) -> tuple[CUresult]:
    return _memset("cuMemsetD8", dstDevice, bytes([uc]), N)


def cuMemsetD32(dstDevice: Any, ui: int, N: int) -> tuple[CUresult]:
    return _memset("cuMemsetD32", dstDevice, int(ui).to_bytes(4, "little"), N)


def cuMemcpyDtoH(dstHost: Any, srcDevice: Any, ByteCount: int) -> tuple[CUresult]:
    err = _ready("cuMemcpyDtoH")
    if err:
        return (err,)
    offset = _span(srcDevice, ByteCount)
    if offset is None:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    if not isinstance(dstHost, int):
        raise TypeError("fake cuMemcpyDtoH takes the host address as an int")
    ctypes.memmove(dstHost, _read(offset, ByteCount), ByteCount)
    return (CUresult.CUDA_SUCCESS,)


def cuMemcpyDtoD(dstDevice: Any, srcDevice: Any, ByteCount: int) -> tuple[CUresult]:
    err = _ready("cuMemcpyDtoD")
    if err:
        return (err,)
    dst, src = _span(dstDevice, ByteCount), _span(srcDevice, ByteCount)
    if dst is None or src is None:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    _write(dst, _read(src, ByteCount))
    return (CUresult.CUDA_SUCCESS,)


def cuCtxSynchronize() -> tuple[CUresult]:
    return (_ready("cuCtxSynchronize") or CUresult.CUDA_SUCCESS,)


def cuLaunchKernel(
    f: CUfunction,
    gridDimX: int,
    gridDimY: int,
    gridDimZ: int,
    blockDimX: int,
    blockDimY: int,
    blockDimZ: int,
    sharedMemBytes: int,
    hStream: Any,
    kernelParams: Any,
    extra: Any,
) -> tuple[CUresult]:
    err = _ready("cuLaunchKernel")
    if err:
        return (err,)
    function = _state.functions.get(int(f)) if isinstance(f, CUfunction) else None
    if function is None:
        return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    if min(gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ) < 1:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    if blockDimX * blockDimY * blockDimZ > 1024:
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    if extra not in (0, None):
        return (CUresult.CUDA_ERROR_INVALID_VALUE,)
    if not (
        isinstance(kernelParams, tuple)
        and len(kernelParams) == 2
        and all(isinstance(part, tuple) for part in kernelParams)
        and len(kernelParams[0]) == len(kernelParams[1])
    ):
        raise TypeError("fake cuLaunchKernel takes kernelParams as ((values...), (ctypes types...))")
    if not _state.launched and _config().get("lazyBytes"):
        if _allocate(int(_config()["lazyBytes"])) is None:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
        _publish_usage()
    _state.launched = True
    name, param_sizes = function
    values, types = kernelParams
    if [_CTYPE_SIZES.get(t) for t in types] != param_sizes:
        # The real driver copies the bytes blindly: a mismatch is silent memory corruption.
        raise AssertionError(f"kernel {name} takes params of sizes {param_sizes}, got types {types}")
    return (_KERNELS[name](*[int(v) for v in values]),)


def _count_nonzero(p: int, n: int, out: int) -> CUresult:
    offset = _span(p, n * 16)
    if offset is None or _span(out, 8) is None:
        return CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    count = 0
    step = 1 << 20
    for start in range(0, n * 16, step):
        chunk = _read(offset + start, min(step, n * 16 - start))
        if chunk.count(0) == len(chunk):
            continue
        words = array.array("Q", chunk)
        count += sum(1 for i in range(0, len(words), 2) if words[i] or words[i + 1])
    _add(out, count)
    return CUresult.CUDA_SUCCESS


def _count_equal_u32(p: int, n: int, value: int, out: int) -> CUresult:
    offset = _span(p, n * 4)
    if offset is None or _span(out, 8) is None:
        return CUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    count = 0
    step = 1 << 20
    for start in range(0, n * 4, step):
        count += array.array("I", _read(offset + start, min(step, n * 4 - start))).count(value)
    _add(out, count)
    return CUresult.CUDA_SUCCESS


def _add(out: int, count: int) -> None:
    offset = _span(out, 8)
    assert offset is not None
    total = int.from_bytes(_read(offset, 8), "little") + count
    _write(offset, total.to_bytes(8, "little"))


_KERNELS = {"scrubgate_count_nonzero": _count_nonzero, "scrubgate_count_equal_u32": _count_equal_u32}
