/* The library API through Gleam (driver API): lazy libraries and kernels kept on the client, kernel
 * parameter layouts read from the image, optional out-pointers, CUkernel in place of CUfunction, client-side
 * answers. Prints one line per check group; exits non-zero on the first failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *CUlibrary, *CUkernel;

CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, int dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuLibraryLoadData(CUlibrary *lib, const void *code, void *jit_opts, void **jit_vals, unsigned n_jit,
                           void *lib_opts, void **lib_vals, unsigned n_lib);
CUresult cuLibraryUnload(CUlibrary lib);
CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary lib, const char *name);
CUresult cuLibraryGetKernelCount(unsigned *count, CUlibrary lib);
CUresult cuLibraryEnumerateKernels(CUkernel *ks, unsigned n, CUlibrary lib);
CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary lib, const char *name);
CUresult cuLibraryGetModule(CUmodule *m, CUlibrary lib);
CUresult cuKernelGetName(const char **name, CUkernel k);
CUresult cuKernelGetParamInfo(CUkernel k, size_t index, size_t *offset, size_t *size);
CUresult cuKernelGetAttribute(int *value, int attrib, CUkernel k, int dev);
CUresult cuKernelSetAttribute(int attrib, int value, CUkernel k, int dev);
CUresult cuKernelGetFunction(CUfunction *f, CUkernel k);
CUresult cuKernelGetLibrary(CUlibrary *lib, CUkernel k);
CUresult cuFuncGetParamInfo(CUfunction f, size_t index, size_t *offset, size_t *size);
CUresult cuFuncGetName(const char **name, CUfunction f);
CUresult cuModuleGetFunctionCount(unsigned *count, CUmodule m);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name);
CUresult cuModuleGetLoadingMode(int *mode);
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block, size_t smem);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, CUstream stream, void **params, void **extra);
CUresult cuGetErrorName(CUresult error, const char **name);

static const char *name_of(CUresult r) {
    const char *name = "?";
    cuGetErrorName(r, &name);
    return name;
}

#define EXPECT(call, want)                                                                  \
    do {                                                                                    \
        CUresult got_ = (call);                                                             \
        if (got_ != (want)) {                                                               \
            printf("FAIL %s: got %s (%d), want %d\n", #call, name_of(got_), got_, (want)); \
            fflush(stdout);                                                                 \
            exit(10);                                                                       \
        }                                                                                   \
    } while (0)
#define CHECK(cond)                                  \
    do {                                             \
        if (!(cond)) {                               \
            printf("FAIL %s\n", #cond);              \
            fflush(stdout);                          \
            exit(11);                                \
        }                                            \
    } while (0)

static const char PTX[] =
    ".version 7.0\n.target sm_50\n.address_size 64\n"
    ".visible .global .align 4 .u32 counter;\n"
    ".visible .entry add_one(.param .u64 data, .param .u32 n)\n"
    "{\n"
    "    .reg .pred %p<2>;\n    .reg .b32 %r<6>;\n    .reg .b64 %rd<5>;\n"
    "    ld.param.u64 %rd1, [data];\n    ld.param.u32 %r2, [n];\n"
    "    mov.u32 %r3, %ctaid.x;\n    mov.u32 %r4, %ntid.x;\n    mov.u32 %r5, %tid.x;\n"
    "    mad.lo.s32 %r1, %r3, %r4, %r5;\n    setp.ge.u32 %p1, %r1, %r2;\n    @%p1 bra DONE;\n"
    "    cvta.to.global.u64 %rd2, %rd1;\n    mul.wide.u32 %rd3, %r1, 4;\n    add.s64 %rd4, %rd2, %rd3;\n"
    "    ld.global.u32 %r3, [%rd4];\n    add.s32 %r3, %r3, 1;\n    st.global.u32 [%rd4], %r3;\n"
    "DONE:\n    ret;\n}\n"
    ".visible .entry bump(.param .u32 by)\n"
    "{\n    .reg .b32 %r<3>;\n    ld.param.u32 %r1, [by];\n    atom.global.add.u32 %r2, [counter], %r1;\n"
    "    ret;\n}\n";

/* Another image, loaded and unloaded without use: lazily loaded, it never reaches the peer. */
static const char UNUSED_PTX[] =
    ".version 7.0\n.target sm_50\n.address_size 64\n"
    ".visible .entry never(.param .u32 x)\n{\n    ret;\n}\n";

int main(void) {
    EXPECT(cuInit(0), 0);
    CUcontext ctx;
    EXPECT(cuDevicePrimaryCtxRetain(&ctx, 0), 0);
    EXPECT(cuCtxSetCurrent(ctx), 0);
    int mode = 0;
    EXPECT(cuModuleGetLoadingMode(&mode), 0);
    printf("loading mode %d\n", mode);

    CUlibrary unused;
    EXPECT(cuLibraryLoadData(&unused, UNUSED_PTX, 0, 0, 0, 0, 0, 0), 0);
    CUkernel never;
    EXPECT(cuLibraryGetKernel(&never, unused, "never"), 0);
    EXPECT(cuLibraryUnload(unused), 0);

    CUlibrary lib;
    EXPECT(cuLibraryLoadData(&lib, PTX, 0, 0, 0, 0, 0, 0), 0);
    unsigned count = 0;
    EXPECT(cuLibraryGetKernelCount(&count, lib), 0);
    CHECK(count == 2);
    CUkernel all[2];
    EXPECT(cuLibraryEnumerateKernels(all, 2, lib), 0);
    CUkernel k, again, bump;
    EXPECT(cuLibraryGetKernel(&k, lib, "add_one"), 0);
    EXPECT(cuLibraryGetKernel(&again, lib, "add_one"), 0);
    CHECK(k == again);
    EXPECT(cuLibraryGetKernel(&bump, lib, "bump"), 0);
    CHECK((all[0] == k && all[1] == bump) || (all[0] == bump && all[1] == k));
    EXPECT(cuLibraryGetKernel(&again, lib, "nope"), 500);
    CUlibrary owner = 0;
    EXPECT(cuKernelGetLibrary(&owner, k), 0);
    CHECK(owner == lib);
    const char *name = 0;
    EXPECT(cuKernelGetName(&name, k), 0);
    CHECK(name && strcmp(name, "add_one") == 0);
    size_t offset = 99, size = 99;
    EXPECT(cuKernelGetParamInfo(k, 1, &offset, &size), 0);
    CHECK(offset == 8 && size == 4);
    EXPECT(cuKernelGetParamInfo(k, 2, &offset, &size), 1);
    printf("kernels: %u, add_one(param 1 at %zu, %zu bytes)\n", count, offset, size);

    /* A kernel in place of a function: launch, attributes, occupancy. */
    int n = 1000, host[1000];
    for (int i = 0; i < n; i++) host[i] = i;
    CUdeviceptr data;
    EXPECT(cuMemAlloc_v2(&data, sizeof host), 0);
    EXPECT(cuMemcpyHtoD_v2(data, host, sizeof host), 0);
    void *params[] = {&data, &n};
    EXPECT(cuLaunchKernel((CUfunction)k, (n + 127) / 128, 1, 1, 128, 1, 1, 0, 0, params, 0), 0);
    EXPECT(cuMemcpyDtoH_v2(host, data, sizeof host), 0);
    CHECK(host[0] == 1 && host[999] == 1000);
    int max_threads = 0, again_threads = 0;
    EXPECT(cuKernelGetAttribute(&max_threads, 0, k, 0), 0);
    EXPECT(cuKernelGetAttribute(&again_threads, 0, k, 0), 0);
    CHECK(max_threads > 0 && again_threads == max_threads);
    int blocks = 0, again_blocks = 0;
    EXPECT(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, (CUfunction)k, 128, 0), 0);
    EXPECT(cuOccupancyMaxActiveBlocksPerMultiprocessor(&again_blocks, (CUfunction)k, 128, 0), 0);
    CHECK(blocks > 0 && blocks == again_blocks);
    EXPECT(cuKernelSetAttribute(8, 1024, k, 0), 0);
    printf("launched through the kernel: max threads %d, %d blocks of 128 per SM\n", max_threads, blocks);

    CUfunction f, f_again;
    EXPECT(cuKernelGetFunction(&f, k), 0);
    EXPECT(cuKernelGetFunction(&f_again, k), 0);
    CHECK(f == f_again);
    EXPECT(cuFuncGetParamInfo(f, 0, &offset, &size), 0);
    CHECK(offset == 0 && size == 8);
    EXPECT(cuFuncGetName(&name, f), 0);
    CHECK(strcmp(name, "add_one") == 0);
    EXPECT(cuLaunchKernel(f, (n + 127) / 128, 1, 1, 128, 1, 1, 0, 0, params, 0), 0);
    EXPECT(cuMemcpyDtoH_v2(host, data, sizeof host), 0);
    CHECK(host[0] == 2 && host[999] == 1001);

    /* Globals: one of the out-pointers may be NULL (not both). */
    CUdeviceptr counter = 0;
    size_t bytes = 0;
    EXPECT(cuLibraryGetGlobal(&counter, 0, lib, "counter"), 0);
    EXPECT(cuLibraryGetGlobal(0, &bytes, lib, "counter"), 0);
    EXPECT(cuLibraryGetGlobal(0, 0, lib, "counter"), 1);
    EXPECT(cuLibraryGetGlobal(&counter, &bytes, lib, "nope"), 500);
    CHECK(counter != 0 && bytes == 4);
    unsigned zero = 0, by = 5, total = 0;
    EXPECT(cuMemcpyHtoD_v2(counter, &zero, sizeof zero), 0);
    void *bump_params[] = {&by};
    EXPECT(cuLaunchKernel((CUfunction)bump, 1, 1, 1, 2, 1, 1, 0, 0, bump_params, 0), 0);
    EXPECT(cuMemcpyDtoH_v2(&total, counter, sizeof total), 0);
    CHECK(total == 10);
    printf("global counter: %zu bytes, %u after two bumps of %u\n", bytes, total, by);

    CUmodule m;
    EXPECT(cuLibraryGetModule(&m, lib), 0);
    EXPECT(cuModuleGetFunctionCount(&count, m), 0);
    CHECK(count == 2);
    CUfunction fb;
    EXPECT(cuModuleGetFunction(&fb, m, "bump"), 0);
    EXPECT(cuModuleGetFunction(&fb, m, "nope"), 500);

    EXPECT(cuLibraryUnload(lib), 0);
    EXPECT(cuKernelGetName(&name, k), 400);
    EXPECT(cuLaunchKernel((CUfunction)k, 1, 1, 1, 1, 1, 1, 0, 0, params, 0), 400);
    EXPECT(cuCtxSynchronize(), 0);
    printf("library ok\n");
    return 0;
}
