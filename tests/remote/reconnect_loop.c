/* A CUDA driver-API program that keeps working for a while, for the drop tests (tests/reconnect.rs): each
 * iteration launches a kernel that adds one to every element of a counter (on a stream of its own, fire and
 * forget) and a host function after it on the same stream (which counts on the host), then copies a fresh
 * pattern to the device and back and checks it. A launch or host function that ran twice, or not at all,
 * shows in the counters at the end; a copy that went wrong shows at once. Prints one line per
 * iteration ("iter N") and "done iterations=N counter=ok" at the end; on a failed call prints
 * "FAIL <call> <error name>" and exits 10. Usage: reconnect_loop ITERATIONS PAUSE_MS [COPY_KIB] (default 1024;
 * copies of several MiB travel in several pieces, so a drop catches some in flight each way). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int value, size_t n);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, CUstream stream, void **params, void **extra);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuCtxSynchronize(void);
CUresult cuGetErrorName(CUresult error, const char **name);
typedef void (*CUhostFn)(void *user);
CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *user);

static int host_calls = 0;

static void count_call(void *user) { __atomic_fetch_add((int *)user, 1, __ATOMIC_SEQ_CST); }

#define N 4096

static void check(CUresult r, const char *call) {
    if (r != 0) {
        const char *name = "?";
        cuGetErrorName(r, &name);
        printf("FAIL %s %s\n", call, name);
        fflush(stdout);
        exit(10);
    }
}

#define CHECK(call) check((call), #call)

static const char PTX[] =
    ".version 7.0\n"
    ".target sm_50\n"
    ".address_size 64\n"
    ".visible .entry add_one(.param .u64 data, .param .u32 n)\n"
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
    int iterations = argc > 1 ? atoi(argv[1]) : 20;
    int pause_ms = argc > 2 ? atoi(argv[2]) : 100;
    size_t words = (size_t)(argc > 3 ? atoi(argv[3]) : 1024) * 1024 / sizeof(unsigned int);
    size_t bytes = words * sizeof(unsigned int);
    unsigned int *pattern = malloc(bytes), *back = malloc(bytes);
    static unsigned int result[N];
    CUdevice dev;
    CUcontext ctx;
    CUmodule module;
    CUfunction add_one;
    CUstream stream;
    CUdeviceptr counter, scratch;

    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuModuleLoadData(&module, PTX));
    CHECK(cuModuleGetFunction(&add_one, module, "add_one"));
    CHECK(cuStreamCreate(&stream, 1 /* non-blocking */));
    CHECK(cuMemAlloc_v2(&counter, N * sizeof(unsigned int)));
    if (pattern == NULL || back == NULL || words == 0) {
        printf("FAIL cannot allocate %zu bytes\n", bytes);
        return 13;
    }
    CHECK(cuMemAlloc_v2(&scratch, bytes));
    CHECK(cuMemsetD32_v2(counter, 0, N));
    /* The stream does not synchronize with the legacy stream: the zeroing must be done first. */
    CHECK(cuCtxSynchronize());
    for (int i = 0; i < iterations; i++) {
        unsigned int n = N;
        void *params[] = {&counter, &n};
        CHECK(cuLaunchKernel(add_one, N / 256, 1, 1, 256, 1, 1, 0, stream, params, NULL));
        CHECK(cuLaunchHostFunc(stream, count_call, &host_calls));
        for (size_t j = 0; j < words; j++) pattern[j] = (unsigned int)(i * 2654435761u + j);
        CHECK(cuMemcpyHtoD_v2(scratch, pattern, bytes));
        CHECK(cuMemcpyDtoH_v2(back, scratch, bytes));
        if (memcmp(pattern, back, bytes) != 0) {
            printf("FAIL iteration %d: the copy came back different\n", i);
            return 11;
        }
        printf("iter %d\n", i);
        fflush(stdout);
        usleep(pause_ms * 1000);
    }
    CHECK(cuStreamSynchronize(stream));
    CHECK(cuMemcpyDtoH_v2(result, counter, sizeof result));
    for (int j = 0; j < N; j++) {
        if (result[j] != (unsigned int)iterations) {
            printf("FAIL counter[%d] = %u after %d launches\n", j, result[j], iterations);
            return 12;
        }
    }
    int calls = __atomic_load_n(&host_calls, __ATOMIC_SEQ_CST);
    if (calls != iterations) {
        printf("FAIL %d host functions ran for %d launched\n", calls, iterations);
        return 14;
    }
    printf("done iterations=%d counter=ok\n", iterations);
    return 0;
}
