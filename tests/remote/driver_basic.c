/* A small CUDA driver-API program for Gleam's tests. No cuda.h exists on CI, so the few prototypes it
 * needs are declared here (with the ABI of NVIDIA's driver). Prints one line per check, exits non-zero on
 * the first failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;

CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *version);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev);
CUresult cuDeviceGetExecAffinitySupport(int *pi, int type, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *ctx);
CUresult cuCtxGetDevice(CUdevice *dev);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int value, size_t n);
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr);
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, CUstream stream, void **params, void **extra);
CUresult cuGetErrorName(CUresult error, const char **name);
CUresult cuOccupancyMaxPotentialBlockSize(int *min_grid, int *block, CUfunction f, size_t (*smem_of)(int),
                                          size_t smem, int limit);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status);
CUresult cuTexRefCreate(void **texref);
typedef void *CUevent;
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamDestroy_v2(CUstream stream);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuEventCreate(CUevent *event, unsigned flags);
CUresult cuEventRecord(CUevent event, CUstream stream);
CUresult cuEventSynchronize(CUevent event);
CUresult cuEventDestroy_v2(CUevent event);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);

static int failures = 0;

/* An occupancy callback: 16 bytes of dynamic shared memory per thread. */
static size_t smem_per_block(int block) { return (size_t)block * 16; }

#include "expect.h"

static const char PTX[] =
    ".version 7.0\n"
    ".target sm_50\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry add_one(\n"
    "    .param .u64 data,\n"
    "    .param .u32 n\n"
    ")\n"
    "{\n"
    "    .reg .pred %p<2>;\n"
    "    .reg .b32 %r<6>;\n"
    "    .reg .b64 %rd<5>;\n"
    "    ld.param.u64 %rd1, [data];\n"
    "    ld.param.u32 %r2, [n];\n"
    "    mov.u32 %r3, %ctaid.x;\n"
    "    mov.u32 %r4, %ntid.x;\n"
    "    mov.u32 %r5, %tid.x;\n"
    "    mad.lo.s32 %r1, %r3, %r4, %r5;\n"
    "    setp.ge.u32 %p1, %r1, %r2;\n"
    "    @%p1 bra DONE;\n"
    "    cvta.to.global.u64 %rd2, %rd1;\n"
    "    mul.wide.u32 %rd3, %r1, 4;\n"
    "    add.s64 %rd4, %rd2, %rd3;\n"
    "    ld.global.u32 %r3, [%rd4];\n"
    "    add.s32 %r3, %r3, 1;\n"
    "    st.global.u32 [%rd4], %r3;\n"
    "DONE:\n"
    "    ret;\n"
    "}\n";

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    int with_kernel = strcmp(mode, "kernel") == 0;
    int version = 0, count = 0, major = 0;
    char name[256];
    size_t total = 0;
    CUdevice dev;
    CUcontext ctx = 0, cur = 0;

    EXPECT(cuMemAlloc_v2(&(CUdeviceptr){0}, 16), 3 /* NOT_INITIALIZED before cuInit */);
    if (strcmp(mode, "init") == 0) {
        /* Only report what cuInit says (the unreachable-peer test). */
        CUresult r = cuInit(0);
        printf("cuInit=%s\n", name_of(r));
        r = cuDeviceGetCount(&count);
        printf("cuDeviceGetCount=%s\n", name_of(r));
        return 0;
    }
    EXPECT(cuInit(0), 0);
    EXPECT(cuDriverGetVersion(&version), 0);
    EXPECT(cuDeviceGetCount(&count), 0);
    EXPECT(cuDeviceGet(&dev, 0), 0);
    EXPECT(cuDeviceGet(&dev, count), 101 /* INVALID_DEVICE */);
    EXPECT(cuDeviceGetName(name, sizeof name, dev), 0);
    EXPECT(cuDeviceTotalMem_v2(&total, dev), 0);
    EXPECT(cuDeviceGetAttribute(&major, 75 /* COMPUTE_CAPABILITY_MAJOR */, dev), 0);
    printf("driver %d, %d device(s), device 0: %s, %zu MiB, sm_%d\n", version, count, name, total >> 20, major);
    /* A call forwarded by one line of the declaration list (driver-api.list). */
    int affinity = -1;
    EXPECT(cuDeviceGetExecAffinitySupport(&affinity, 0 /* CU_EXEC_AFFINITY_TYPE_SM_COUNT */, dev), 0);
    if (affinity != 0 && affinity != 1) { printf("FAIL exec affinity support %d\n", affinity); return 12; }
    printf("exec affinity (SM count) supported: %d\n", affinity);
    EXPECT(cuDeviceGetExecAffinitySupport(&affinity, 0, count), 101 /* INVALID_DEVICE */);

    EXPECT(cuDevicePrimaryCtxRetain(&ctx, dev), 0);
    EXPECT(cuCtxSetCurrent(ctx), 0);
    EXPECT(cuCtxGetCurrent(&cur), 0);
    if (cur != ctx) { printf("FAIL current context\n"); return 11; }
    EXPECT(cuCtxGetDevice(&dev), 0);

    if (strcmp(mode, "fork") == 0) {
        /* A fork()ed child must be refused (the connection is the parent's), and its exit must not end
         * the parent's session. */
        CUdeviceptr p = 0;
        unsigned word = 42, got = 0;
        EXPECT(cuMemAlloc_v2(&p, 4096), 0);
        pid_t pid = fork();
        if (pid == 0) {
            CUdeviceptr q = 0;
            CUresult a = cuMemAlloc_v2(&q, 16), b = cuInit(0);
            printf("child: %s %s\n", name_of(a), name_of(b));
            fflush(stdout);
            exit(a == 3 && b == 3 ? 0 : 1);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) { printf("FAIL child\n"); return 21; }
        EXPECT(cuMemcpyHtoD_v2(p, &word, sizeof word), 0);
        EXPECT(cuMemcpyDtoH_v2(&got, p, sizeof got), 0);
        if (got != 42) { printf("FAIL parent after fork\n"); return 22; }
        printf("fork ok\n");
        return 0;
    }

    if (strcmp(mode, "wait") == 0) {
        /* The killed-server test: the session is up; the test kills the server, then lets us go on. */
        CUdeviceptr p = 0;
        unsigned word = 0;
        char line[16];
        EXPECT(cuMemAlloc_v2(&p, 4096), 0);
        printf("ready\n");
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin)) return 20;
        CUresult a = cuMemcpyDtoH_v2(&word, p, sizeof word);
        CUresult b = cuCtxSynchronize();
        printf("after: %s %s\n", name_of(a), name_of(b));
        return 0;
    }

    enum { N = 3 << 20 }; /* 12 MiB: several copy chunks */
    unsigned *host = malloc(N * sizeof *host), *back = malloc(N * sizeof *back);
    for (unsigned i = 0; i < N; i++) host[i] = i * 2654435761u;
    CUdeviceptr d = 0, base = 0;
    size_t size = 0;
    EXPECT(cuMemAlloc_v2(&d, N * sizeof *host), 0);
    EXPECT(cuMemcpyHtoD_v2(d, host, N * sizeof *host), 0);
    memset(back, 0, N * sizeof *back);
    EXPECT(cuMemcpyDtoH_v2(back, d, N * sizeof *back), 0);
    if (memcmp(host, back, N * sizeof *host) != 0) { printf("FAIL round trip\n"); return 12; }
    printf("copied %zu bytes there and back\n", N * sizeof *host);
    EXPECT(cuMemGetAddressRange_v2(&base, &size, d + 100), 0);
    if (base != d || size != N * sizeof *host) { printf("FAIL address range\n"); return 13; }
    unsigned memtype = 0;
    EXPECT(cuPointerGetAttribute(&memtype, 2 /* MEMORY_TYPE */, d + 8), 0);
    if (memtype != 2) { printf("FAIL memory type %u\n", memtype); return 14; }
    EXPECT(cuMemsetD32_v2(d, 7, 16), 0);
    EXPECT(cuMemcpyDtoH_v2(back, d, 16 * sizeof *back), 0);
    if (back[0] != 7 || back[15] != 7) { printf("FAIL memset\n"); return 15; }

    /* Error paths: a bad handle, a pointer that was never allocated, a stubbed call, NULL outs. */
    CUfunction f = 0;
    /* NVIDIA's driver may crash on a made-up module handle: only a server that validates handles (emu)
     * survives this, so the GPU machine's check skips it. */
    if (!getenv("GLEAM_TEST_NO_BOGUS_MODULE")) {
        CUmodule bogus = (CUmodule)0xdeadbeef;
        CUresult r = cuModuleGetFunction(&f, bogus, "add_one");
        if (r == 0) { printf("FAIL bogus module accepted\n"); return 16; }
        printf("bad module handle: %s\n", name_of(r));
    }
    EXPECT(cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0), 400 /* INVALID_HANDLE */);
    EXPECT(cuMemFree_v2(0x1000), 1 /* INVALID_VALUE */);
    /* NULL is freed with success (NVIDIA's driver 580; cuBLAS's cublasCreate relies on it). */
    EXPECT(cuMemFree_v2(0), 0);
    EXPECT(cuTexRefCreate(0), 801 /* NOT_SUPPORTED */);
    EXPECT(cuMemAlloc_v2(0, 16), 1);
    void *pfn = 0;
    int status = -1;
    EXPECT(cuGetProcAddress_v2("cuMemAlloc", &pfn, 12000, 0, &status), 0);
    if (pfn != (void *)cuMemAlloc_v2 || status != 0) { printf("FAIL cuGetProcAddress\n"); return 17; }
    EXPECT(cuGetProcAddress_v2("", 0, 0, 0, 0), 500 /* NOT_FOUND */);
    CUstream stream = 0;
    CUevent event = 0;
    EXPECT(cuStreamCreate(&stream, 1), 0);
    EXPECT(cuEventCreate(&event, 0), 0);
    EXPECT(cuMemcpyHtoDAsync_v2(d, host, 4096, stream), 0);
    EXPECT(cuEventRecord(event, stream), 0);
    EXPECT(cuEventSynchronize(event), 0);
    EXPECT(cuEventRecord((CUevent)0x999, stream), 400 /* INVALID_HANDLE, at the call */);
    EXPECT(cuEventRecord(event, (CUstream)0x999), 400);
    EXPECT(cuMemcpyHtoDAsync_v2(d, host, 16, (CUstream)0x999), 400);
    EXPECT(cuEventDestroy_v2(event), 0);
    EXPECT(cuEventDestroy_v2(event), 400 /* already destroyed */);
    EXPECT(cuStreamSynchronize(stream), 0);
    EXPECT(cuStreamDestroy_v2(stream), 0);
    printf("error paths ok\n");

    if (with_kernel) {
        CUmodule module = 0;
        unsigned n = 1000;
        EXPECT(cuModuleLoadData(&module, PTX), 0);
        EXPECT(cuModuleGetFunction(&f, module, "add_one"), 0);
        EXPECT(cuMemcpyHtoD_v2(d, host, n * sizeof *host), 0);
        void *params[] = {&d, &n};
        EXPECT(cuLaunchKernel(f, (n + 255) / 256, 1, 1, 2048, 1, 1, 0, 0, params, 0), 1 /* too many threads */);
        EXPECT(cuLaunchKernel(f, (n + 255) / 256, 1, 1, 256, 1, 1, 0, 0, params, 0), 0);
        EXPECT(cuCtxSynchronize(), 0);
        EXPECT(cuMemcpyDtoH_v2(back, d, n * sizeof *back), 0);
        for (unsigned i = 0; i < n; i++)
            if (back[i] != host[i] + 1) { printf("FAIL kernel result at %u\n", i); return 18; }
        printf("kernel ok\n");
        int min_grid = 0, block = 0;
        EXPECT(cuOccupancyMaxPotentialBlockSize(&min_grid, &block, f, 0, 0, 0), 0);
        if (block < 32 || block > 1024 || block % 32 || min_grid < 1) {
            printf("FAIL occupancy: block %d, min grid %d\n", block, min_grid);
            return 19;
        }
        EXPECT(cuOccupancyMaxPotentialBlockSize(&min_grid, &block, f, smem_per_block, 0, 96), 0);
        if (block < 32 || block > 96 || block % 32) { printf("FAIL occupancy limit: block %d\n", block); return 20; }
        EXPECT(cuOccupancyMaxPotentialBlockSize(&min_grid, 0, f, 0, 0, 0), 1 /* INVALID_VALUE */);
        printf("occupancy ok\n");
    }

    EXPECT(cuMemFree_v2(d), 0);
    EXPECT(cuMemFree_v2(d), 1 /* double free */);
    EXPECT(cuCtxSynchronize(), 0);
    printf("all ok\n");
    return failures;
}
