/* Copies whose byte count does not fit their device range, for Gleam's tests: each must return
 * CUDA_ERROR_INVALID_VALUE, as NVIDIA's driver does, without reading or writing past the 4 KiB host
 * buffer (a read of SIZE_MAX, 64 MiB or 1 TiB from it would abort or crash the program). The same holds for
 * a module global, whose range the shim never allocated. Prints one line per check and `done` at the end;
 * exits non-zero on the first unexpected result. No cuda.h exists on CI: the prototypes are declared here. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUmodule, *CUstream;

CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemFreeHost(void *p);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream);
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleUnload(CUmodule module);
CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule module, const char *name);
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr);
CUresult cuGetErrorName(CUresult error, const char **name);

static const char *PTX =
    ".version 8.0\n.target sm_75\n.address_size 64\n"
    ".global .align 4 .u32 table[4] = {1, 2, 3, 4};\n";

#include "expect.h"

static void expect(const char *what, unsigned long long n, CUresult got, CUresult want) {
    printf("%s n=%llu: %s\n", what, n, name_of(got));
    fflush(stdout);
    if (got != want) {
        printf("FAILED: %s n=%llu returned %s, expected %s\n", what, n, name_of(got), name_of(want));
        exit(1);
    }
}

int main(void) {
    const CUresult OK = 0, INVALID_VALUE = 1;
    CUcontext ctx;
    CUstream stream;
    CUdeviceptr p;
    unsigned char *buf = malloc(4096);
    memset(buf, 7, 4096);
    expect("cuInit", 0, cuInit(0), OK);
    expect("retain", 0, cuDevicePrimaryCtxRetain(&ctx, 0), OK);
    expect("set current", 0, cuCtxSetCurrent(ctx), OK);
    expect("stream", 0, cuStreamCreate(&stream, 0), OK);
    expect("alloc", 4096, cuMemAlloc_v2(&p, 4096), OK);

    const unsigned long long sizes[] = {4097, 64ull << 20, 1ull << 40, SIZE_MAX};
    for (int i = 0; i < 4; i++) {
        unsigned long long n = sizes[i];
        expect("htod", n, cuMemcpyHtoD_v2(p, buf, n), INVALID_VALUE);
        expect("htod async", n, cuMemcpyHtoDAsync_v2(p, buf, n, stream), INVALID_VALUE);
        expect("dtoh", n, cuMemcpyDtoH_v2(buf, p, n), INVALID_VALUE);
        expect("dtoh async", n, cuMemcpyDtoHAsync_v2(buf, p, n, stream), INVALID_VALUE);
        expect("memcpy to device", n, cuMemcpy(p, (CUdeviceptr)buf, n), INVALID_VALUE);
    }
    /* The end of the range, and one byte past it. */
    expect("htod at the end", 96, cuMemcpyHtoD_v2(p + 4000, buf, 96), OK);
    expect("htod past the end", 97, cuMemcpyHtoD_v2(p + 4000, buf, 97), INVALID_VALUE);
    /* Memory nobody allocated. */
    expect("htod unallocated", SIZE_MAX, cuMemcpyHtoD_v2(p + (1ull << 30), buf, SIZE_MAX), INVALID_VALUE);
    expect("htod NULL", 4, cuMemcpyHtoD_v2(0, buf, 4), INVALID_VALUE);

    /* A module global: 16 bytes the shim's allocation table did not make. */
    CUmodule module;
    CUdeviceptr g;
    size_t g_size = 0;
    expect("module", 0, cuModuleLoadData(&module, PTX), OK);
    expect("global", 0, cuModuleGetGlobal_v2(&g, &g_size, module, "table"), OK);
    if (g_size != 16) {
        printf("FAILED: the global has %zu bytes\n", g_size);
        return 1;
    }
    int type = 0;
    expect("global memory type", 0, cuPointerGetAttribute(&type, 2, g), OK);
    if (type != 2) {
        printf("FAILED: the global's memory type is %d, not device (2)\n", type);
        return 1;
    }
    unsigned int values[4] = {0};
    expect("global dtoh", 16, cuMemcpyDtoH_v2(values, g, 16), OK);
    printf("global holds %u %u %u %u\n", values[0], values[1], values[2], values[3]);
    expect("global htod", 16, cuMemcpyHtoD_v2(g, buf, 16), OK);
    expect("global htod async", 8, cuMemcpyHtoDAsync_v2(g + 8, buf, 8, stream), OK);
    expect("global htod past the end", 17, cuMemcpyHtoD_v2(g, buf, 17), INVALID_VALUE);
    expect("global htod", SIZE_MAX, cuMemcpyHtoD_v2(g, buf, SIZE_MAX), INVALID_VALUE);
    expect("global dtoh", 64ull << 20, cuMemcpyDtoH_v2(buf, g, 64ull << 20), INVALID_VALUE);
    expect("free a global", 0, cuMemFree_v2(g), INVALID_VALUE);
    expect("free a global as host memory", 0, cuMemFreeHost((void *)g), INVALID_VALUE);
    expect("sync", 0, cuStreamSynchronize(stream), OK);
    expect("global dtoh", 16, cuMemcpyDtoH_v2(values, g, 16), OK);
    printf("global holds %u %u %u %u\n", values[0], values[1], values[2], values[3]);
    expect("unload", 0, cuModuleUnload(module), OK);
    /* Gone with its module. */
    expect("htod to an unloaded global", 4, cuMemcpyHtoD_v2(g, buf, 4), INVALID_VALUE);

    expect("free", 0, cuMemFree_v2(p), OK);
    /* Nothing above left a deferred error behind. */
    expect("sync", 0, cuCtxSynchronize(), OK);
    printf("done\n");
    return 0;
}
