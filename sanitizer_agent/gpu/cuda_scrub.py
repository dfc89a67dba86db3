"""Zero and verify one GPU's free memory through the CUDA driver API, in a process of its own.

Run as ``python cuda_scrub.py`` with ``CUDA_VISIBLE_DEVICES=<GPU or MIG UUID>``: it prints one JSON
object on stdout (see ``scrub``) and exits 0 when it could report, 1 otherwise. A child process per
scrub keeps the agent free of CUDA state: a crashed or hung scrub is killed without taking the agent
along, and the driver releases everything the scrub held when the child exits.

This file imports nothing of scrubgate's (the agent runs it by path, without importing the package);
``tests/gpu/gpu_check.py`` reuses its helpers.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

# The kernels, hand-written PTX so that no compiler is needed on the node: the driver JIT-compiles it
# for whatever GPU it finds (PTX ISA 7.0 / sm_70: Volta and every later architecture).
#
# scrubgate_count_nonzero(p, n, out): *out += number of 16-byte words in p[0..n) that are not zero.
#   Grid-stride loop of 128-bit loads, four independent ones per iteration (then a one-load tail) so
#   enough reads are in flight to run at memory bandwidth; a thread touches the counter only if it
#   found something, so a clean chunk costs no atomics.
# scrubgate_count_equal_u32(p, n, value, out): *out += number of 32-bit words in p[0..n) equal to
#   value (the GPU check's canary probe).
PTX_SOURCE = """
.version 7.0
.target sm_70
.address_size 64

.visible .entry scrubgate_count_nonzero(
    .param .u64 param_p,
    .param .u64 param_n,
    .param .u64 param_out
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<5>;
    .reg .b64 %rd<32>;

    ld.param.u64 %rd1, [param_p];
    ld.param.u64 %rd2, [param_n];
    ld.param.u64 %rd3, [param_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r4, %r2;
    mov.u64 %rd7, 0;
    shl.b64 %rd14, %rd6, 2;
    shl.b64 %rd15, %rd6, 4;
NZ_LOOP4:
    mad.lo.u64 %rd16, %rd6, 3, %rd4;
    setp.ge.u64 %p1, %rd16, %rd2;
    @%p1 bra NZ_LOOP;
    shl.b64 %rd8, %rd4, 4;
    add.u64 %rd8, %rd1, %rd8;
    add.u64 %rd17, %rd8, %rd15;
    add.u64 %rd18, %rd17, %rd15;
    add.u64 %rd19, %rd18, %rd15;
    ld.global.v2.u64 {%rd20, %rd21}, [%rd8];
    ld.global.v2.u64 {%rd22, %rd23}, [%rd17];
    ld.global.v2.u64 {%rd24, %rd25}, [%rd18];
    ld.global.v2.u64 {%rd26, %rd27}, [%rd19];
    or.b64 %rd20, %rd20, %rd21;
    setp.ne.u64 %p2, %rd20, 0;
    selp.u64 %rd28, 1, 0, %p2;
    add.u64 %rd7, %rd7, %rd28;
    or.b64 %rd22, %rd22, %rd23;
    setp.ne.u64 %p2, %rd22, 0;
    selp.u64 %rd28, 1, 0, %p2;
    add.u64 %rd7, %rd7, %rd28;
    or.b64 %rd24, %rd24, %rd25;
    setp.ne.u64 %p2, %rd24, 0;
    selp.u64 %rd28, 1, 0, %p2;
    add.u64 %rd7, %rd7, %rd28;
    or.b64 %rd26, %rd26, %rd27;
    setp.ne.u64 %p2, %rd26, 0;
    selp.u64 %rd28, 1, 0, %p2;
    add.u64 %rd7, %rd7, %rd28;
    add.u64 %rd4, %rd4, %rd14;
    bra NZ_LOOP4;
NZ_LOOP:
    setp.ge.u64 %p1, %rd4, %rd2;
    @%p1 bra NZ_DONE;
    shl.b64 %rd8, %rd4, 4;
    add.u64 %rd8, %rd1, %rd8;
    ld.global.v2.u64 {%rd9, %rd10}, [%rd8];
    or.b64 %rd11, %rd9, %rd10;
    setp.ne.u64 %p2, %rd11, 0;
    selp.u64 %rd12, 1, 0, %p2;
    add.u64 %rd7, %rd7, %rd12;
    add.u64 %rd4, %rd4, %rd6;
    bra NZ_LOOP;
NZ_DONE:
    setp.eq.u64 %p3, %rd7, 0;
    @%p3 bra NZ_END;
    atom.global.add.u64 %rd13, [%rd3], %rd7;
NZ_END:
    ret;
}

.visible .entry scrubgate_count_equal_u32(
    .param .u64 param_p,
    .param .u64 param_n,
    .param .u32 param_value,
    .param .u64 param_out
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<7>;
    .reg .b64 %rd<13>;

    ld.param.u64 %rd1, [param_p];
    ld.param.u64 %rd2, [param_n];
    ld.param.u32 %r5, [param_value];
    ld.param.u64 %rd3, [param_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r4, %r2;
    mov.u64 %rd7, 0;
EQ_LOOP:
    setp.ge.u64 %p1, %rd4, %rd2;
    @%p1 bra EQ_DONE;
    shl.b64 %rd8, %rd4, 2;
    add.u64 %rd8, %rd1, %rd8;
    ld.global.u32 %r6, [%rd8];
    setp.eq.u32 %p2, %r6, %r5;
    selp.u64 %rd9, 1, 0, %p2;
    add.u64 %rd7, %rd7, %rd9;
    add.u64 %rd4, %rd4, %rd6;
    bra EQ_LOOP;
EQ_DONE:
    setp.eq.u64 %p3, %rd7, 0;
    @%p3 bra EQ_END;
    atom.global.add.u64 %rd10, [%rd3], %rd7;
EQ_END:
    ret;
}
"""
# cuModuleLoadData takes PTX as a NUL-terminated string.
PTX = PTX_SOURCE.encode() + b"\0"

COUNT_NONZERO = b"scrubgate_count_nonzero"
COUNT_EQUAL_U32 = b"scrubgate_count_equal_u32"
THREADS_PER_BLOCK = 256
# 8 blocks of 256 threads fill an SM's 2048 thread slots: enough loads in flight to saturate HBM.
BLOCKS_PER_SM = 8
WORD = 16  # bytes per word the verify kernel reads

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
        module = self.call("cuModuleLoadData", PTX)
        sms = self.call(
            "cuDeviceGetAttribute", self.drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device
        )
        counter = self.call("cuMemAlloc", 8)
        ctx = Context(
            cuda=self,
            device=device,
            nonzero_kernel=self.call("cuModuleGetFunction", module, COUNT_NONZERO),
            equal_kernel=self.call("cuModuleGetFunction", module, COUNT_EQUAL_U32),
            blocks=max(int(sms), 1) * BLOCKS_PER_SM,
            counter=counter,
        )
        if warm_up:
            ctx.warm_up()
        return ctx


@dataclass
class Context:
    cuda: Cuda
    device: Any
    nonzero_kernel: Any
    equal_kernel: Any
    blocks: int
    counter: Any
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

    def count_nonzero_words(self, chunks: list[tuple[int, int]] | None = None) -> int:
        """16-byte words in ``chunks`` (default: all held chunks) that are not zero."""
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
        self.cuda.call("cuMemsetD8", int(self.counter), 0, 8)
        for ptr, size in self.chunks if chunks is None else chunks:
            self._launch(
                self.equal_kernel,
                (ptr, size // 4, value, int(self.counter)),
                (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_void_p),
            )
        return self._read_counter()


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
            "chunks": chunks,
            "allocS": allocated_at - started,
            "scrubS": verified_at - allocated_at,
            "deviceS": time.perf_counter() - started,
        }
    )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--min-chunk-bytes", type=int, default=DEFAULT_MIN_CHUNK_BYTES)
    parser.add_argument("--margin-bytes", type=int, default=DEFAULT_MARGIN_BYTES)
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
        report.update(scrub(cuda, args.chunk_bytes, args.min_chunk_bytes, args.margin_bytes))
    except CudaError as exc:
        report.update(error=str(exc), code=exc.code)
    except Exception as exc:  # the bindings raise their own types, e.g. when libcuda is missing
        report["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
