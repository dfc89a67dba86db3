"""Zero and verify one GPU's free memory through the CUDA driver API, in a process of its own.

Run as ``python cuda_scrub.py`` with ``CUDA_VISIBLE_DEVICES=<GPU or MIG UUID>``: it prints one JSON
object on stdout (see ``scrub``) and exits 0 when it could report, 1 otherwise. With ``--check`` it only opens
the context and runs the kernels on a small buffer (``check``): the agent's start-up check. A child process per
scrub keeps the agent free of CUDA state: a crashed or hung scrub is killed without taking the agent
along, and the driver releases everything the scrub held when the child exits.

This file imports nothing of scrubgate's (the agent runs it by path, without importing the package);
``tests/gpu/gpu_check.py`` reuses its helpers.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The kernels (kernels/scrub.ptx says what they do): precompiled cubins per architecture major, built
# from that PTX by tests/gpu/build_cubins.py and shipped as package data; the PTX itself only where no
# cubin fits (the driver's JIT compiles it); and without any kernel, a memset and a read back to the host.
KERNELS = Path(__file__).resolve().with_name("kernels")
PTX_SOURCE = (KERNELS / "scrub.ptx").read_text()
# cuModuleLoadData takes PTX as a NUL-terminated string.
PTX = PTX_SOURCE.encode() + b"\0"

COUNT_NONZERO = b"scrubgate_count_nonzero"
COUNT_EQUAL_U32 = b"scrubgate_count_equal_u32"
THREADS_PER_BLOCK = 256
# 8 blocks of 256 threads fill an SM's 2048 thread slots: enough loads in flight to saturate HBM.
BLOCKS_PER_SM = 8
WORD = 16  # bytes per word the verify kernel reads

NO_KERNELS = "none (memset, read back to the host)"
# Host buffer of the kernel-free verification.
READ_BACK_BYTES = 64 << 20

DEFAULT_CHUNK_BYTES = 4 << 30
DEFAULT_MIN_CHUNK_BYTES = 2 << 20
# Left free by the first pass, for whatever the driver still allocates on its own account; the second
# pass frees as much of the (verified) first pass and then takes everything, margin included.
DEFAULT_MARGIN_BYTES = 256 << 20
# The warm-up buffer: the first memset, kernel launch and copy back happen before the fill.
WARM_UP_BYTES = 2 << 20


class CudaError(Exception):
    """A CUDA driver call failed; ``code`` is the CUresult's name (e.g. CUDA_ERROR_OUT_OF_MEMORY)."""

    def __init__(self, call: str, code: str) -> None:
        super().__init__(f"{call} failed: {code}")
        self.call = call
        self.code = code


def load_driver() -> Any:
    """The CUDA driver bindings module: ``cuda.bindings.driver`` (cuda-bindings >= 12.6), else the
    older ``cuda.cuda`` of cuda-python."""
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


class Cuda:
    """Thin checked access to the driver API: ``call`` raises CudaError, returns the outputs."""

    def __init__(self, driver: Any) -> None:
        self.drv = driver
        self.success = driver.CUresult.CUDA_SUCCESS
        self.out_of_memory = driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY

    def call(self, name: str, *args: Any) -> Any:
        result = getattr(self.drv, name)(*args)
        err, outputs = result[0], result[1:]
        if err != self.success:
            raise CudaError(name, getattr(err, "name", str(err)))
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else outputs

    def open(self, warm_up: bool = True) -> Context:
        """cuInit, the primary context of device 0 (the one CUDA_VISIBLE_DEVICES names), and the
        kernels, loaded before any allocation so the JIT and the module never lack memory; then a warm-up
        (memset, both kernels, a copy back) so that whatever the driver loads lazily is in place before
        the fill takes the memory it would need."""
        self.call("cuInit", 0)
        device = self.call("cuDeviceGet", 0)
        context = self.call("cuDevicePrimaryCtxRetain", device)
        self.call("cuCtxSetCurrent", context)
        attribute = self.drv.CUdevice_attribute
        sms = self.call("cuDeviceGetAttribute", attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)
        capability = (
            int(self.call("cuDeviceGetAttribute", attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)),
            int(self.call("cuDeviceGetAttribute", attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)),
        )
        module, kernels, tried = self.load_kernels(capability)
        counter = self.call("cuMemAlloc", 8)
        ctx = Context(
            cuda=self,
            device=device,
            nonzero_kernel=self.call("cuModuleGetFunction", module, COUNT_NONZERO) if module else None,
            equal_kernel=self.call("cuModuleGetFunction", module, COUNT_EQUAL_U32) if module else None,
            blocks=max(int(sms), 1) * BLOCKS_PER_SM,
            counter=counter,
            kernels=kernels,
            kernel_errors=tried,
        )
        if warm_up:
            ctx.warm_up()
        return ctx

    def load_kernels(self, capability: tuple[int, int]) -> tuple[Any, str, list[str]]:
        """(module, which kernels, why the better ones did not load): the cubin for this architecture,
        else the PTX through the driver's JIT, else none (module None: memset and read back)."""
        errors: list[str] = []
        images = [(f"cubin {path.stem.removeprefix('scrub_')}", path.read_bytes()) for path in cubin_for(capability)]
        for name, image in [*images, ("ptx", PTX)]:
            try:
                return self.call("cuModuleLoadData", image), name, errors
            except CudaError as exc:
                errors.append(f"{name}: {exc.code}")
        return None, NO_KERNELS, errors


def cubin_for(capability: tuple[int, int]) -> list[Path]:
    """The shipped cubin that runs on a GPU of this compute capability: same major, the highest minor
    not above the GPU's ([] when none does)."""
    major, minor = capability
    fitting = []
    for path in KERNELS.glob("scrub_sm_*.cubin"):
        number = int(path.stem.rpartition("_")[2])
        if number // 10 == major and number % 10 <= minor:
            fitting.append((number, path))
    return [max(fitting)[1]] if fitting else []


@dataclass
class Context:
    cuda: Cuda
    device: Any
    nonzero_kernel: Any
    equal_kernel: Any
    blocks: int
    counter: Any
    kernels: str = NO_KERNELS  # what verifies: "cubin sm_90", "ptx", or NO_KERNELS
    kernel_errors: list[str] = field(default_factory=list)
    chunks: list[tuple[int, int]] = field(default_factory=list)

    def mem_info(self) -> tuple[int, int]:
        free, total = self.cuda.call("cuMemGetInfo")
        return int(free), int(total)

    def warm_up(self, zero: bool = True, keep: bool = False) -> None:
        """Memset (unless not ``zero``: a probe must not wipe what it looks for), both kernels and a copy
        back on a small buffer, freed afterwards unless ``keep`` (then it is one of the held chunks)."""
        ptr = int(self.cuda.call("cuMemAlloc", WARM_UP_BYTES))
        try:
            if zero:
                self.cuda.call("cuMemsetD8", ptr, 0, WARM_UP_BYTES)
            self.count_nonzero_words([(ptr, WARM_UP_BYTES)])
            self.count_equal_u32(0, [(ptr, WARM_UP_BYTES)])
        finally:
            if keep:
                self.chunks.append((ptr, WARM_UP_BYTES))
            else:
                self.cuda.call("cuMemFree", ptr)

    def allocate_all(self, chunk_bytes: int, min_chunk_bytes: int, keep_free: int = 0) -> list[tuple[int, int]]:
        """Allocate every byte the driver will give but ``keep_free``, in chunks of ``chunk_bytes``
        halving on out-of-memory down to ``min_chunk_bytes``; all chunks are held at once so no byte is
        handed out twice. Returns the chunks this call allocated (also added to ``chunks``)."""
        new: list[tuple[int, int]] = []
        size = chunk_bytes
        while size >= min_chunk_bytes:
            if keep_free:
                room = (self.mem_info()[0] - keep_free) // WORD * WORD
                if room < min_chunk_bytes:
                    break
                size = min(size, room)
            result = self.cuda.drv.cuMemAlloc(size)
            if result[0] == self.cuda.out_of_memory:
                size = (size // 2) // WORD * WORD
                continue
            if result[0] != self.cuda.success:
                raise CudaError("cuMemAlloc", getattr(result[0], "name", str(result[0])))
            new.append((int(result[1]), size))
        self.chunks += new
        return new

    def release(self, at_least: int) -> int:
        """Free held chunks, last first, until ``at_least`` bytes are free again; returns the bytes freed."""
        freed = 0
        while self.chunks and freed < at_least:
            ptr, size = self.chunks.pop()
            self.cuda.call("cuMemFree", ptr)
            freed += size
        return freed

    def free_all(self) -> None:
        self.release(sum(size for _, size in self.chunks))

    def _launch(self, function: Any, args: tuple[Any, ...], types: tuple[Any, ...]) -> None:
        self.cuda.call("cuLaunchKernel", function, self.blocks, 1, 1, THREADS_PER_BLOCK, 1, 1, 0, 0, (args, types), 0)

    def _read_counter(self) -> int:
        self.cuda.call("cuCtxSynchronize")
        host = ctypes.c_uint64(0)
        self.cuda.call("cuMemcpyDtoH", ctypes.addressof(host), int(self.counter), 8)
        return int(host.value)

    def _read_back(self, chunks: list[tuple[int, int]], count: Callable[[bytes], int]) -> int:
        """The path without kernels: every chunk copied to the host in blocks, ``count`` over each block."""
        block = ctypes.create_string_buffer(READ_BACK_BYTES)
        found = 0
        for ptr, size in chunks:
            for offset in range(0, size, READ_BACK_BYTES):
                length = min(READ_BACK_BYTES, size - offset)
                self.cuda.call("cuMemcpyDtoH", ctypes.addressof(block), ptr + offset, length)
                found += count(block.raw[:length])
        return found

    def count_nonzero_words(self, chunks: list[tuple[int, int]] | None = None) -> int:
        """16-byte words in ``chunks`` (default: all held chunks) that are not zero."""
        if self.nonzero_kernel is None:
            return self._read_back(self.chunks if chunks is None else chunks, _nonzero_words)
        self.cuda.call("cuMemsetD8", int(self.counter), 0, 8)
        for ptr, size in self.chunks if chunks is None else chunks:
            self._launch(
                self.nonzero_kernel,
                (ptr, size // WORD, int(self.counter)),
                (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p),
            )
        return self._read_counter()

    def count_equal_u32(self, value: int, chunks: list[tuple[int, int]] | None = None) -> int:
        """32-bit words in ``chunks`` (default: all held chunks) equal to ``value``."""
        if self.equal_kernel is None:
            return self._read_back(
                self.chunks if chunks is None else chunks, lambda b: array.array("I", b).count(value)
            )
        self.cuda.call("cuMemsetD8", int(self.counter), 0, 8)
        for ptr, size in self.chunks if chunks is None else chunks:
            self._launch(
                self.equal_kernel,
                (ptr, size // 4, value, int(self.counter)),
                (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_void_p),
            )
        return self._read_counter()


def _nonzero_words(data: bytes) -> int:
    if data.count(0) == len(data):
        return 0
    words = array.array("Q", data)
    return sum(1 for i in range(0, len(words), 2) if words[i] or words[i + 1])


def zero_and_verify(ctx: Context, chunks: list[tuple[int, int]]) -> int:
    """Zero ``chunks`` and count the 16-byte words that do not read back zero."""
    for ptr, size in chunks:
        ctx.cuda.call("cuMemsetD8", ptr, 0, size)
    return ctx.count_nonzero_words(chunks)


def scrub(
    cuda: Cuda, chunk_bytes: int, min_chunk_bytes: int, margin_bytes: int = DEFAULT_MARGIN_BYTES
) -> dict[str, Any]:
    """Allocate all free memory but a margin, zero and verify it; then free as much of it as the margin,
    take everything that is free (the margin included), zero and verify that; free it all.

    Memory covered: every byte of the first pass, and of the second pass what is not the first pass's
    freed (and verified) part again: first + max(second - freed, 0), a lower bound whatever addresses the
    allocator hands out."""
    ctx = cuda.open()
    free_before, total = ctx.mem_info()
    started = time.perf_counter()
    report: dict[str, Any] = {}
    try:
        first = ctx.allocate_all(chunk_bytes, min_chunk_bytes, keep_free=margin_bytes)
        allocated_at = time.perf_counter()
        nonzero = zero_and_verify(ctx, first)
        first_bytes = sum(size for _, size in first)
        freed = ctx.release(margin_bytes)
        try:
            second = ctx.allocate_all(chunk_bytes, min_chunk_bytes)
            nonzero += zero_and_verify(ctx, second)
            second_bytes = sum(size for _, size in second)
        except CudaError as exc:  # the first pass stands; the coverage check judges what is left
            report["secondPassError"] = str(exc)
            second_bytes = 0
        verified_at = time.perf_counter()
        free_after = ctx.mem_info()[0]
        chunks = len(ctx.chunks)
    finally:
        ctx.free_all()
    report.update(
        {
            "bytesScrubbed": first_bytes + max(second_bytes - freed, 0),
            "bytesFirstPass": first_bytes,
            "bytesSecondPass": second_bytes,
            "bytesFreeBefore": free_before,
            "bytesFreeAfter": free_after,
            "bytesTotal": total,
            "nonzeroWords": nonzero,
            "wordBytes": WORD,
            "kernels": ctx.kernels,
            "kernelErrors": ctx.kernel_errors,
            "chunks": chunks,
            "allocS": allocated_at - started,
            "scrubS": verified_at - allocated_at,
            "deviceS": time.perf_counter() - started,
        }
    )
    return report


def check(cuda: Cuda) -> dict[str, Any]:
    """The context, the kernels (and which loaded), a warm-up on 2 MiB: what a scrub needs before it allocates."""
    ctx = cuda.open()
    return {"kernels": ctx.kernels, "kernelErrors": ctx.kernel_errors}


def max_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--min-chunk-bytes", type=int, default=DEFAULT_MIN_CHUNK_BYTES)
    parser.add_argument("--margin-bytes", type=int, default=DEFAULT_MARGIN_BYTES)
    parser.add_argument("--check", action="store_true", help="open the context and run the kernels only")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"device": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if args.min_chunk_bytes < WORD or args.chunk_bytes < args.min_chunk_bytes or args.chunk_bytes % WORD:
        report["error"] = f"bad chunk sizes: chunk {args.chunk_bytes}, floor {args.min_chunk_bytes}"
        print(json.dumps(report))
        return 1
    try:
        cuda = Cuda(load_driver())
    except ImportError as exc:
        report["error"] = f"CUDA driver bindings not importable ({exc}); install scrubgate[gpu]"
        print(json.dumps(report))
        return 1
    try:
        report["cudaDriverVersion"] = cuda.call("cuDriverGetVersion")
        if args.check:
            report.update(check(cuda))
        else:
            report.update(scrub(cuda, args.chunk_bytes, args.min_chunk_bytes, args.margin_bytes))
    except CudaError as exc:
        report.update(error=str(exc), code=exc.code)
    except Exception as exc:  # the bindings raise their own types, e.g. when libcuda is missing
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["maxRssBytes"] = max_rss_bytes()
    print(json.dumps(report))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
