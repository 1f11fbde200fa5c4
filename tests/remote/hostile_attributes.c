/* Function attributes an application may not set, for Gleam's tests. NVIDIA's driver lets
 * cuFuncSetAttribute change only the maximum dynamic shared memory, the shared memory carveout and the
 * cluster settings; any other attribute (the maximum threads per block, the register count...) is
 * CUDA_ERROR_INVALID_VALUE at once and changes nothing. The shim answers cuFuncGetAttribute from its cache,
 * so a refused set must not reach the cache either: the shim's fuzz target set the maximum threads per block
 * to 1.5 billion, and cuOccupancyMaxPotentialBlockSize then walked 47 million block sizes. Prints one line
 * per check and `done` at the end; exits non-zero on the first unexpected result. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext, *CUmodule, *CUfunction;

CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name);
CUresult cuFuncGetAttribute(int *value, int attribute, CUfunction f);
CUresult cuFuncSetAttribute(CUfunction f, int attribute, int value);
CUresult cuOccupancyMaxPotentialBlockSize(int *min_grid, int *block, CUfunction f, void *smem_of,
                                          size_t smem, int limit);
CUresult cuGetErrorName(CUresult error, const char **name);

static const char *PTX = ".version 8.0\n.target sm_75\n.address_size 64\n"
                         ".visible .entry k() { ret; }\n";

#include "expect.h"

/* One line per check, so the log shows how far the program got. */
static void expect(const char *what, int attribute, CUresult got, CUresult want) {
    printf("%s %d: %s\n", what, attribute, name_of(got));
    fflush(stdout);
    if (got != want) {
        printf("FAILED: %s %d returned %s, expected %s\n", what, attribute, name_of(got), name_of(want));
        exit(1);
    }
}

int main(void) {
    const CUresult OK = 0, INVALID_VALUE = 1;
    const int MAX_THREADS_PER_BLOCK = 0, MAX_DYNAMIC_SHARED = 8, CARVEOUT = 9;
    CUcontext ctx;
    CUmodule module;
    CUfunction f;
    expect("cuInit", 0, cuInit(0), OK);
    expect("retain", 0, cuDevicePrimaryCtxRetain(&ctx, 0), OK);
    expect("set current", 0, cuCtxSetCurrent(ctx), OK);
    expect("module", 0, cuModuleLoadData(&module, PTX), OK);
    expect("function", 0, cuModuleGetFunction(&f, module, "k"), OK);

    int before[8];
    for (int a = 0; a < 8; a++)
        expect("get", a, cuFuncGetAttribute(&before[a], a, f), OK);
    /* Read-only: refused at once, whatever the value. */
    const int read_only[] = {0, 1, 2, 3, 4, 5, 6, 7, 10};
    for (int i = 0; i < 9; i++)
        expect("set read-only", read_only[i], cuFuncSetAttribute(f, read_only[i], 1549679775), INVALID_VALUE);
    expect("set unknown", 99, cuFuncSetAttribute(f, 99, 1), INVALID_VALUE);
    expect("set negative", -1, cuFuncSetAttribute(f, -1, 1), INVALID_VALUE);
    for (int a = 0; a < 8; a++) {
        int now = -1;
        expect("get again", a, cuFuncGetAttribute(&now, a, f), OK);
        if (now != before[a]) {
            printf("FAILED: attribute %d was %d, now %d\n", a, before[a], now);
            return 1;
        }
    }
    printf("max threads per block %d\n", before[MAX_THREADS_PER_BLOCK]);

    /* Settable ones still set, and read back. */
    int v = -1;
    expect("set", MAX_DYNAMIC_SHARED, cuFuncSetAttribute(f, MAX_DYNAMIC_SHARED, 1024), OK);
    expect("get", MAX_DYNAMIC_SHARED, cuFuncGetAttribute(&v, MAX_DYNAMIC_SHARED, f), OK);
    if (v != 1024) {
        printf("FAILED: max dynamic shared memory reads %d after setting 1024\n", v);
        return 1;
    }
    expect("set", CARVEOUT, cuFuncSetAttribute(f, CARVEOUT, 50), OK);

    /* The occupancy walk stays within the device's block sizes, however large the limit asked for. */
    int min_grid = 0, block = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    expect("potential block size", 0,
           cuOccupancyMaxPotentialBlockSize(&min_grid, &block, f, NULL, 0, 1549679775), OK);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
    printf("potential block size %d (min grid %d) in %.0f ms\n", block, min_grid, ms);
    if (block < 1 || block > before[MAX_THREADS_PER_BLOCK]) {
        printf("FAILED: potential block size %d\n", block);
        return 1;
    }
    expect("sync", 0, cuCtxSynchronize(), OK);
    printf("done\n");
    return 0;
}
