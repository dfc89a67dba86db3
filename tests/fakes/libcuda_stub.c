/* A stand-in libcuda.so.1 for checking scrubgate's calls through the REAL cuda-bindings package on a
 * machine without a GPU: the bindings resolve every driver function through cuGetProcAddress_v2, so
 * this library answers that and implements, on host memory, the few calls scrubgate makes (with the
 * driver API's C signatures). Kernels are recognised by name and run on the host. Each call is
 * logged to $FAKE_CUDA_LOG. STUB_MEMSET_NOOP=1 makes cuMemsetD8 write nothing.
 * Used by tests/test_gpu_real_bindings.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
enum { SUCCESS = 0, OUT_OF_MEMORY = 2, NOT_FOUND = 500 };
static const size_t LIMIT = 64u << 20;
static size_t used = 0;
static void *const NONZERO = (void *)1, *const EQUAL = (void *)2;

static void logcall(const char *fmt, ...) {
  const char *path = getenv("FAKE_CUDA_LOG");
  FILE *f = fopen(path ? path : "/dev/null", "a");
  va_list args;
  va_start(args, fmt);
  vfprintf(f, fmt, args);
  va_end(args);
  fputc('\n', f);
  fclose(f);
}

CUresult cuDriverGetVersion(int *v) { *v = 13000; return SUCCESS; }
CUresult cuInit(unsigned flags) { logcall("cuInit %u", flags); return SUCCESS; }
CUresult cuDeviceGet(int *dev, int ordinal) { logcall("cuDeviceGet %d", ordinal); *dev = 0; return SUCCESS; }
CUresult cuDeviceGetAttribute(int *value, int attrib, int dev) {
  logcall("cuDeviceGetAttribute %d %d", attrib, dev);
  /* 75/76: compute capability major/minor, an H100's 9.0 (the scrub then loads the sm_90 cubin). */
  *value = attrib == 75 ? 9 : attrib == 76 ? 0 : 2;
  return SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { logcall("cuDevicePrimaryCtxRetain %d", dev); *ctx = (void *)0x1234; return SUCCESS; }
CUresult cuCtxSetCurrent(void *ctx) { logcall("cuCtxSetCurrent %p", ctx); return SUCCESS; }
CUresult cuModuleLoadData(void **module, const void *image) {
  logcall("cuModuleLoadData %zu", strlen(image));
  *module = (void *)0x2345;
  return SUCCESS;
}
CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
  logcall("cuModuleGetFunction %s", name);
  if (strcmp(name, "scrubgate_count_nonzero") == 0) *function = NONZERO;
  else if (strcmp(name, "scrubgate_count_equal_u32") == 0) *function = EQUAL;
  else return NOT_FOUND;
  return SUCCESS;
}
CUresult cuMemGetInfo(size_t *free_bytes, size_t *total) { *free_bytes = LIMIT - used; *total = LIMIT; return SUCCESS; }
CUresult cuMemAlloc(uint64_t *ptr, size_t size) {
  if (used + size > LIMIT) { logcall("cuMemAlloc %zu OOM", size); return OUT_OF_MEMORY; }
  void *p = aligned_alloc(256, (size + 255) / 256 * 256);
  /* Bulk memory holds a previous tenant's bytes; small buffers (the verify counter) start at 0. */
  memset(p, size > 64 ? 0x77 : 0, size);
  used += size;
  *ptr = (uint64_t)p;
  logcall("cuMemAlloc %zu", size);
  return SUCCESS;
}
CUresult cuMemFree(uint64_t ptr) { logcall("cuMemFree"); free((void *)ptr); return SUCCESS; }
CUresult cuMemsetD8(uint64_t ptr, unsigned char value, size_t n) {
  logcall("cuMemsetD8 %u %zu", value, n);
  if (!getenv("STUB_MEMSET_NOOP")) memset((void *)ptr, value, n);
  return SUCCESS;
}
CUresult cuMemsetD32(uint64_t ptr, unsigned value, size_t n) {
  logcall("cuMemsetD32 %x %zu", value, n);
  for (size_t i = 0; i < n; i++) ((uint32_t *)ptr)[i] = value;
  return SUCCESS;
}
CUresult cuMemcpyDtoH(void *dst, uint64_t src, size_t n) { memcpy(dst, (void *)src, n); return SUCCESS; }
CUresult cuMemcpyDtoD(uint64_t dst, uint64_t src, size_t n) { memcpy((void *)dst, (void *)src, n); return SUCCESS; }
CUresult cuCtxSynchronize(void) { return SUCCESS; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
  uint64_t base = *(uint64_t *)params[0], n = *(uint64_t *)params[1], count = 0;
  uint64_t *out;
  if (f == NONZERO) {
    const uint64_t *words = (const uint64_t *)base;
    out = (uint64_t *)*(uint64_t *)params[2];
    for (uint64_t i = 0; i < n; i++) count += (words[2 * i] | words[2 * i + 1]) != 0;
  } else {
    const uint32_t *words = (const uint32_t *)base, value = *(uint32_t *)params[2];
    out = (uint64_t *)*(uint64_t *)params[3];
    for (uint64_t i = 0; i < n; i++) count += words[i] == value;
  }
  *out += count;
  logcall("cuLaunchKernel %s grid=%u,%u,%u block=%u,%u,%u n=%lu count=%lu", f == NONZERO ? "nonzero" : "equal",
          gx, gy, gz, bx, by, bz, (unsigned long)n, (unsigned long)count);
  return SUCCESS;
}
CUresult cuGetErrorName(CUresult e, const char **s) { *s = "CUDA_ERROR_STUB"; return SUCCESS; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "stub"; return SUCCESS; }
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
  void *self = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  *pfn = self ? dlsym(self, symbol) : NULL;
  if (status) *status = *pfn ? 0 : 1;
  return *pfn ? SUCCESS : NOT_FOUND;
}
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
