/* Contexts, memory pools, virtual memory management, streams and events: CUDA's semantics as a program
 * sees them. Runs unchanged on NVIDIA's driver and through Gleam (emu backend in CI, a real GPU on the GPU
 * machine), so the expectations here are checked against the real driver too. No cuda.h on CI: the few
 * prototypes and structs it needs are declared here with the driver's ABI (CUDA 13.0).
 *
 *   driver_api contexts|pools|vmm|streams|watchdog|many-streams N
 *
 * Prints one line per check and `<mode> ok` at the end; exits non-zero on the first failure. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *CUevent, *CUmemoryPool;

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
typedef struct {
    int allocType, handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;
typedef struct { void *execAffinityParams; int numExecAffinityParams; void *cigParams; } CUctxCreateParams;

CUresult cuInit(unsigned flags);
CUresult cuGetErrorName(CUresult error, const char **name);
CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned *flags, int *active);
CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned flags);
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev);
CUresult cuCtxCreate_v3(CUcontext *ctx, void *params, int n, unsigned flags, CUdevice dev);
CUresult cuCtxCreate_v4(CUcontext *ctx, CUctxCreateParams *params, unsigned flags, CUdevice dev);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *ctx);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *ctx);
CUresult cuCtxGetDevice(CUdevice *dev);
CUresult cuCtxGetFlags(unsigned *flags);
CUresult cuCtxSetFlags(unsigned flags);
CUresult cuCtxGetId(CUcontext ctx, unsigned long long *id);
CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned *version);
CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest);
CUresult cuCtxSynchronize(void);
CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes);
CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned value, size_t n);
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream stream);
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr);
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr);
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream stream);
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool);
CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
CUresult cuMemPoolDestroy(CUmemoryPool pool);
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep);
CUresult cuMemPoolGetAccess(int *flags, CUmemoryPool pool, CUmemLocation *location);
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option);
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location, CUdeviceptr ptr);
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, CUstream stream, void **params, void **extra);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamCreateWithPriority(CUstream *stream, unsigned flags, int priority);
CUresult cuStreamDestroy_v2(CUstream stream);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuStreamSynchronize_ptsz(CUstream stream);
CUresult cuStreamQuery(CUstream stream);
CUresult cuStreamGetFlags(CUstream stream, unsigned *flags);
CUresult cuStreamGetPriority(CUstream stream, int *priority);
CUresult cuStreamGetCtx(CUstream stream, CUcontext *ctx);
CUresult cuStreamGetId(CUstream stream, unsigned long long *id);
CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned flags);
CUresult cuEventCreate(CUevent *event, unsigned flags);
CUresult cuEventRecord(CUevent event, CUstream stream);
CUresult cuEventRecordWithFlags(CUevent event, CUstream stream, unsigned flags);
CUresult cuEventQuery(CUevent event);
CUresult cuEventSynchronize(CUevent event);
CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end);
CUresult cuEventDestroy_v2(CUevent event);

#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define SUCCESS 0
#define INVALID_VALUE 1
#define NOT_READY 600
#define INVALID_HANDLE 400
#define LAUNCH_TIMEOUT 702
#define CONTEXT_IS_DESTROYED 709

static const char *name_of(CUresult r) {
    const char *name = "?";
    cuGetErrorName(r, &name);
    return name;
}

#define CHECK(call)                                                                              \
    do {                                                                                         \
        CUresult r_ = (call);                                                                    \
        if (r_ != SUCCESS) {                                                                     \
            printf("FAIL %s:%d: %s = %s (%d)\n", __FILE__, __LINE__, #call, name_of(r_), r_);    \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

#define EXPECT(cond, ...)                                                                        \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                               \
            printf(__VA_ARGS__);                                                                 \
            printf("\n");                                                                        \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

#define EXPECT_ERR(call, code)                                                                   \
    do {                                                                                         \
        CUresult r_ = (call);                                                                    \
        EXPECT(r_ == (code), "%s returned %s (%d), expected %d", #call, name_of(r_), r_, code);  \
    } while (0)

/* out[i] = in[i] + 1 for i < n: nvcc-style PTX for sm_75. */
static const char *PTX =
    ".version 8.0\n.target sm_75\n.address_size 64\n"
    ".visible .entry add_one(.param .u64 p_in, .param .u64 p_out, .param .u32 p_n)\n{\n"
    "  .reg .pred %p<2>; .reg .b32 %r<8>; .reg .b64 %rd<8>;\n"
    "  ld.param.u64 %rd1, [p_in]; ld.param.u64 %rd2, [p_out]; ld.param.u32 %r1, [p_n];\n"
    "  mov.u32 %r2, %ctaid.x; mov.u32 %r3, %ntid.x; mov.u32 %r4, %tid.x;\n"
    "  mad.lo.s32 %r5, %r2, %r3, %r4;\n"
    "  setp.ge.u32 %p1, %r5, %r1; @%p1 bra DONE;\n"
    "  cvta.to.global.u64 %rd3, %rd1; cvta.to.global.u64 %rd4, %rd2;\n"
    "  mul.wide.u32 %rd5, %r5, 4; add.s64 %rd6, %rd3, %rd5; add.s64 %rd7, %rd4, %rd5;\n"
    "  ld.global.u32 %r6, [%rd6]; add.s32 %r7, %r6, 1; st.global.u32 [%rd7], %r7;\n"
    "DONE:\n  ret;\n}\n"
    /* Never ends (for the watchdog): spins on a flag nobody sets. */
    ".visible .entry spin(.param .u64 p_flag)\n{\n"
    "  .reg .pred %p<2>; .reg .b32 %r<2>; .reg .b64 %rd<3>;\n"
    "  ld.param.u64 %rd1, [p_flag]; cvta.to.global.u64 %rd2, %rd1;\n"
    "AGAIN:\n  ld.volatile.global.u32 %r1, [%rd2]; setp.eq.u32 %p1, %r1, 0; @%p1 bra AGAIN;\n"
    "  ret;\n}\n";

static CUfunction function(const char *name) {
    CUmodule module;
    CUfunction f;
    CHECK(cuModuleLoadData(&module, PTX));
    CHECK(cuModuleGetFunction(&f, module, name));
    return f;
}

static void add_one(CUfunction f, CUdeviceptr in, CUdeviceptr out, unsigned n, CUstream stream) {
    void *params[] = {&in, &out, &n};
    CHECK(cuLaunchKernel(f, (n + 255) / 256, 1, 1, 256, 1, 1, 0, stream, params, NULL));
}

static CUcontext setup(void) {
    CUcontext primary;
    CHECK(cuInit(0));
    CHECK(cuDevicePrimaryCtxRetain(&primary, 0));
    CHECK(cuCtxSetCurrent(primary));
    return primary;
}

static void contexts(void) {
    CUcontext primary = setup(), ctx, cur, popped;
    unsigned long long primary_id, id;
    unsigned flags, version;
    CUdevice dev;

    CHECK(cuCtxGetId(primary, &primary_id));
    CHECK(cuCtxCreate_v2(&ctx, 0, 0));
    CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == ctx, "a created context is current");
    CHECK(cuCtxGetId(ctx, &id));
    EXPECT(id != primary_id, "ids %llu and %llu", id, primary_id);
    CHECK(cuCtxGetDevice(&dev));
    EXPECT(dev == 0, "device %d", dev);
    CHECK(cuCtxGetApiVersion(ctx, &version));
    EXPECT(version >= 3020, "api version %u", version);
    int can = -1;
    CHECK(cuDeviceCanAccessPeer(&can, 0, 0));
    EXPECT(can == 0, "a device is not its own peer: %d", can);
    /* CU_CTX_SCHED_BLOCKING_SYNC */
    CHECK(cuCtxSetFlags(4));
    CHECK(cuCtxGetFlags(&flags));
    EXPECT((flags & 7) == 4, "flags %#x", flags);

    /* The stack: push the primary context over it, pop it off again. */
    CHECK(cuCtxPushCurrent_v2(primary));
    CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == primary, "pushed context is current");
    CHECK(cuCtxPopCurrent_v2(&popped));
    EXPECT(popped == primary, "popped the primary context");
    CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == ctx, "the created context is current again");

    /* Memory belongs to the context current at allocation. */
    CUdeviceptr p;
    CUcontext owner = NULL;
    CHECK(cuMemAlloc_v2(&p, 4096));
    CHECK(cuPointerGetAttribute(&owner, 1 /* CONTEXT */, p));
    EXPECT(owner == ctx, "allocation's context");
    unsigned v = 0x12345678, back = 0;
    CHECK(cuMemcpyHtoD_v2(p, &v, 4));
    CHECK(cuMemcpyDtoH_v2(&back, p, 4));
    EXPECT(back == v, "copy in a created context: %#x", back);

    /* Streams know their context, flags and priority. */
    int least, greatest, prio;
    CUstream s, t;
    CUcontext sctx;
    unsigned long long sid, tid;
    CHECK(cuCtxGetStreamPriorityRange(&least, &greatest));
    EXPECT(greatest <= least, "priority range %d..%d", least, greatest);
    /* Either out-pointer may be NULL (cuDNN passes one; refusing it broke cuDNN on a side stream). */
    int only = 12345;
    CHECK(cuCtxGetStreamPriorityRange(NULL, &only));
    EXPECT(only == greatest, "greatest alone %d", only);
    CHECK(cuCtxGetStreamPriorityRange(&only, NULL));
    EXPECT(only == least, "least alone %d", only);
    CHECK(cuStreamCreateWithPriority(&s, 1, greatest));
    CHECK(cuStreamGetPriority(s, &prio));
    EXPECT(prio == greatest, "priority %d", prio);
    CHECK(cuStreamGetFlags(s, &flags));
    EXPECT(flags == 1, "stream flags %u", flags);
    CHECK(cuStreamGetCtx(s, &sctx));
    EXPECT(sctx == ctx, "stream's context");
    CHECK(cuStreamCreate(&t, 0));
    CHECK(cuStreamGetId(s, &sid));
    CHECK(cuStreamGetId(t, &tid));
    EXPECT(sid != tid, "stream ids %llu %llu", sid, tid);
    CHECK(cuStreamDestroy_v2(t));
    CHECK(cuStreamDestroy_v2(s));
    printf("created context: ids, flags, stack, memory and streams ok\n");

    /* Destroying the current context pops it. */
    CHECK(cuCtxPushCurrent_v2(primary));
    CHECK(cuCtxPopCurrent_v2(&popped));
    CHECK(cuCtxDestroy_v2(ctx));
    CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur != ctx, "a destroyed context is no longer current");

    /* The newer creation calls, without their optional parameters, are cuCtxCreate_v2. */
    CHECK(cuCtxCreate_v3(&ctx, NULL, 0, 0, 0));
    CHECK(cuCtxGetId(ctx, &id));
    EXPECT(id != primary_id, "v3 id");
    CHECK(cuCtxDestroy_v2(ctx));
    CHECK(cuCtxCreate_v4(&ctx, NULL, 0, 0));
    CHECK(cuCtxDestroy_v2(ctx));
    CUctxCreateParams none = {NULL, 0, NULL};
    CHECK(cuCtxCreate_v4(&ctx, &none, 0, 0));
    CHECK(cuCtxDestroy_v2(ctx));
    printf("cuCtxCreate_v3/_v4 ok\n");

    /* Primary context flags and reset: everything in it is gone, the context stays usable. */
    int active;
    CHECK(cuCtxSetCurrent(primary));
    CHECK(cuDevicePrimaryCtxSetFlags_v2(0, 4));
    CHECK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    EXPECT((flags & 7) == 4 && active == 1, "primary state flags %#x active %d", flags, active);
    CHECK(cuMemAlloc_v2(&p, 4096));
    CHECK(cuDevicePrimaryCtxReset_v2(0));
    CUdeviceptr base;
    size_t size;
    EXPECT(cuMemGetAddressRange_v2(&base, &size, p) != SUCCESS, "memory of a reset context is gone");
    /* Measured on NVIDIA's 580 driver: the reset context can be made current, but it is destroyed until
     * the primary context is retained again. */
    CHECK(cuCtxSetCurrent(primary));
    EXPECT_ERR(cuMemAlloc_v2(&p, 4096), CONTEXT_IS_DESTROYED);
    CHECK(cuDevicePrimaryCtxRetain(&primary, 0));
    CHECK(cuCtxSetCurrent(primary));
    CHECK(cuMemAlloc_v2(&p, 4096));
    CHECK(cuMemsetD32_v2(p, 7, 1024));
    CHECK(cuMemcpyDtoH_v2(&back, p, 4));
    EXPECT(back == 7, "after reset: %u", back);
    CHECK(cuMemFree_v2(p));
    CHECK(cuDevicePrimaryCtxRelease(0));
    printf("primary context flags and reset ok\n");
    printf("contexts ok\n");
}

static unsigned long long pool_attr(CUmemoryPool pool, int attr) {
    unsigned long long v = 0;
    CHECK(cuMemPoolGetAttribute(pool, attr, &v));
    return v;
}

static void pools(void) {
    setup();
    int supported = 0;
    CHECK(cuDeviceGetAttribute(&supported, 115 /* MEMORY_POOLS_SUPPORTED */, 0));
    EXPECT(supported == 1, "memory pools supported: %d", supported);
    CUmemoryPool def, cur;
    CHECK(cuDeviceGetDefaultMemPool(&def, 0));
    CHECK(cuDeviceGetMemPool(&cur, 0));
    EXPECT(def == cur, "the default pool is current");

    CUstream s;
    CHECK(cuStreamCreate(&s, 1));
    CUdeviceptr a, b;
    unsigned host[256], back[256];
    for (int i = 0; i < 256; i++) host[i] = i * 3;
    CHECK(cuMemAllocAsync(&a, sizeof host, s));
    CHECK(cuMemAllocAsync(&b, sizeof host, s));
    CUmemoryPool owner = NULL;
    CHECK(cuPointerGetAttribute(&owner, 17 /* MEMPOOL_HANDLE */, a));
    EXPECT(owner == def, "the allocation's pool");
    EXPECT(pool_attr(def, 7 /* USED_MEM_CURRENT */) >= 2 * sizeof host, "used");
    CHECK(cuMemcpyHtoD_v2(a, host, sizeof host));
    CUfunction f = function("add_one");
    add_one(f, a, b, 256, s);
    CHECK(cuMemFreeAsync(a, s));
    CHECK(cuStreamSynchronize(s));
    CHECK(cuMemcpyDtoH_v2(back, b, sizeof back));
    for (int i = 0; i < 256; i++) EXPECT(back[i] == host[i] + 1, "back[%d] = %u", i, back[i]);
    CHECK(cuMemFreeAsync(b, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT(pool_attr(def, 7) == 0, "nothing used: %llu", pool_attr(def, 7));
    /* Release threshold 0 (the default): synchronisation gave everything back. */
    EXPECT(pool_attr(def, 4 /* RELEASE_THRESHOLD */) == 0, "threshold");
    EXPECT(pool_attr(def, 5 /* RESERVED_MEM_CURRENT */) == 0, "reserved after sync: %llu",
           pool_attr(def, 5));
    EXPECT(pool_attr(def, 8 /* USED_MEM_HIGH */) >= 2 * sizeof host, "high-water mark");
    unsigned long long zero = 0;
    CHECK(cuMemPoolSetAttribute(def, 8, &zero));
    EXPECT(pool_attr(def, 8) == 0, "high-water mark reset");
    EXPECT_ERR(cuMemPoolDestroy(def), INVALID_VALUE);
    printf("default pool ok\n");

    /* A pool of our own, with a threshold that keeps memory across synchronisation. */
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = 1; /* PINNED */
    props.location.type = 1; /* DEVICE */
    props.location.id = 0;
    CUmemoryPool pool;
    CHECK(cuMemPoolCreate(&pool, &props));
    unsigned long long keep = 64 << 20;
    CHECK(cuMemPoolSetAttribute(pool, 4, &keep));
    EXPECT(pool_attr(pool, 4) == keep, "threshold set");
    int reuse = 0;
    CHECK(cuMemPoolGetAttribute(pool, 1 /* REUSE_FOLLOW_EVENT_DEPENDENCIES */, &reuse));
    EXPECT(reuse == 1, "reuse policy %d", reuse);
    int flags = 0;
    CUmemLocation dev0 = {1, 0};
    CHECK(cuMemPoolGetAccess(&flags, pool, &dev0));
    EXPECT(flags == 3, "pool access %d", flags);
    CUdeviceptr c;
    CHECK(cuMemAllocFromPoolAsync(&c, 1 << 20, pool, s));
    CHECK(cuMemsetD8Async(c, 0xab, 1 << 20, s));
    unsigned char byte = 0;
    CHECK(cuStreamSynchronize(s));
    CHECK(cuMemcpyDtoH_v2(&byte, c + 12345, 1));
    EXPECT(byte == 0xab, "pool memory holds data: %#x", byte);
    CHECK(cuMemFreeAsync(c, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT(pool_attr(pool, 7) == 0, "nothing used");
    EXPECT(pool_attr(pool, 5) >= (1 << 20), "kept below the threshold: %llu", pool_attr(pool, 5));
    CHECK(cuMemPoolTrimTo(pool, 0));
    CHECK(cuStreamSynchronize(s));
    EXPECT(pool_attr(pool, 5) == 0, "trimmed: %llu", pool_attr(pool, 5));
    /* cuMemAllocAsync follows the device's current pool. */
    CHECK(cuDeviceSetMemPool(0, pool));
    CHECK(cuDeviceGetMemPool(&cur, 0));
    EXPECT(cur == pool, "current pool set");
    CHECK(cuMemAllocAsync(&c, 4096, s));
    CHECK(cuPointerGetAttribute(&owner, 17, c));
    EXPECT(owner == pool, "allocated from the current pool");
    CHECK(cuMemFreeAsync(c, s));
    CHECK(cuStreamSynchronize(s));
    CHECK(cuMemPoolDestroy(pool));
    CHECK(cuDeviceGetMemPool(&cur, 0));
    EXPECT(cur == def, "destroying the current pool makes the default current again");
    CHECK(cuStreamDestroy_v2(s));
    printf("created pool ok\n");
    printf("pools ok\n");
}

static void vmm(void) {
    setup();
    int supported = 0;
    CHECK(cuDeviceGetAttribute(&supported, 102 /* VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED */, 0));
    EXPECT(supported == 1, "VMM supported: %d", supported);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1; /* PINNED */
    prop.location.type = 1; /* DEVICE */
    prop.location.id = 0;
    size_t gran = 0;
    CHECK(cuMemGetAllocationGranularity(&gran, &prop, 0 /* MINIMUM */));
    EXPECT(gran > 0 && (gran & (gran - 1)) == 0, "granularity %zu", gran);
    printf("granularity %zu\n", gran);

    /* Reserve room for three chunks, map two physical allocations side by side. */
    CUdeviceptr va;
    CHECK(cuMemAddressReserve(&va, 3 * gran, 0, 0, 0));
    CUmemGenericAllocationHandle h1, h2, again;
    CHECK(cuMemCreate(&h1, gran, &prop, 0));
    CHECK(cuMemCreate(&h2, gran, &prop, 0));
    CHECK(cuMemMap(va, gran, 0, h1, 0));
    CHECK(cuMemMap(va + gran, gran, 0, h2, 0));
    CUmemAccessDesc rw = {{1, 0}, 3 /* READWRITE */};
    CHECK(cuMemSetAccess(va, 2 * gran, &rw, 1));
    unsigned long long access = 0;
    CHECK(cuMemGetAccess(&access, &rw.location, va + gran + 64));
    EXPECT(access == 3, "access %llu", access);

    /* Data across the boundary between the two mappings: copies and a kernel see one range. */
    unsigned n = 4096;
    CUdeviceptr in = va + gran - n / 2 * 4, out = va + 2 * gran - n * 4;
    unsigned *host = malloc(n * 4), *back = malloc(n * 4);
    for (unsigned i = 0; i < n; i++) host[i] = i ^ 0x5a5a;
    CHECK(cuMemcpyHtoD_v2(in, host, n * 4));
    CUfunction f = function("add_one");
    add_one(f, in, out, n, NULL);
    CHECK(cuCtxSynchronize());
    CHECK(cuMemcpyDtoH_v2(back, out, n * 4));
    for (unsigned i = 0; i < n; i++) EXPECT(back[i] == host[i] + 1, "out[%u] = %u", i, back[i]);
    CHECK(cuMemcpyDtoH_v2(back, in, n * 4));
    for (unsigned i = 0; i < n; i++) EXPECT(back[i] == host[i], "in[%u] = %u", i, back[i]);
    printf("copies and a kernel across two mappings ok\n");

    /* Pointer queries see the mapping. */
    int memtype = 0;
    CHECK(cuPointerGetAttribute(&memtype, 2 /* MEMORY_TYPE */, va + 100));
    EXPECT(memtype == 2, "device memory: %d", memtype);
    CHECK(cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)(va + gran + 4096)));
    EXPECT(again == h2, "retained the second allocation");
    CHECK(cuMemRelease(again));
    CUmemAllocationProp got;
    memset(&got, 0xff, sizeof got);
    CHECK(cuMemGetAllocationPropertiesFromHandle(&got, h1));
    EXPECT(got.type == 1 && got.location.type == 1 && got.location.id == 0, "properties");

    /* The same physical memory mapped twice reads the same. */
    CHECK(cuMemMap(va + 2 * gran, gran, 0, h1, 0));
    CHECK(cuMemSetAccess(va + 2 * gran, gran, &rw, 1));
    unsigned first = 0, alias = 0;
    CHECK(cuMemcpyDtoH_v2(&first, va + 16, 4));
    CHECK(cuMemcpyDtoH_v2(&alias, va + 2 * gran + 16, 4));
    EXPECT(first == alias, "aliases: %u %u", first, alias);

    /* Released handles stay mapped until unmapped; then everything goes. */
    CHECK(cuMemRelease(h1));
    CHECK(cuMemRelease(h2));
    CHECK(cuMemcpyDtoH_v2(&alias, va + 2 * gran + 16, 4));
    EXPECT(first == alias, "still mapped after release");
    CHECK(cuMemUnmap(va, 3 * gran));
    CHECK(cuMemAddressFree(va, 3 * gran));
    free(host);
    free(back);
    printf("vmm ok\n");
}

static void streams(void) {
    setup();
    CUfunction f = function("add_one");
    unsigned n = 1 << 16;
    CUdeviceptr a, b;
    CHECK(cuMemAlloc_v2(&a, n * 4));
    CHECK(cuMemAlloc_v2(&b, n * 4));
    CHECK(cuMemsetD32_v2(a, 41, n));
    CUstream s1, s2;
    CHECK(cuStreamCreate(&s1, 1));
    CHECK(cuStreamCreate(&s2, 1));
    CUevent start, mid, end, sync_event;
    CHECK(cuEventCreate(&start, 0));
    CHECK(cuEventCreate(&mid, 2 /* DISABLE_TIMING */));
    CHECK(cuEventCreate(&end, 0));
    CHECK(cuEventCreate(&sync_event, 1 /* BLOCKING_SYNC */));
    EXPECT(cuEventQuery(start) == SUCCESS, "a never recorded event is complete");
    CHECK(cuCtxSynchronize());

    CHECK(cuEventRecord(start, s1));
    add_one(f, a, b, n, s1);
    CHECK(cuEventRecordWithFlags(mid, s1, 0));
    /* s2 waits for s1's kernel, then adds one more. */
    CHECK(cuStreamWaitEvent(s2, mid, 0));
    add_one(f, b, a, n, s2);
    CHECK(cuEventRecord(end, s2));
    CHECK(cuEventRecord(sync_event, s2));
    CHECK(cuEventSynchronize(sync_event));
    EXPECT(cuEventQuery(end) == SUCCESS, "end complete");
    EXPECT(cuStreamQuery(s2) == SUCCESS, "s2 idle");
    unsigned v = 0;
    CHECK(cuMemcpyDtoH_v2(&v, a + 4 * (n - 1), 4));
    EXPECT(v == 43, "two kernels in event order: %u", v);
    float ms = -1;
    CHECK(cuEventElapsedTime_v2(&ms, start, end));
    EXPECT(ms >= 0, "elapsed %f", ms);
    EXPECT_ERR(cuEventElapsedTime_v2(&ms, start, mid), INVALID_HANDLE);
    printf("events order streams; timing ok\n");

    /* The per-thread default stream. */
    CHECK(cuMemsetD8Async(b, 1, 16, CU_STREAM_PER_THREAD));
    CHECK(cuStreamSynchronize(CU_STREAM_PER_THREAD));
    CHECK(cuStreamSynchronize_ptsz(NULL));
    unsigned flags = 99;
    CHECK(cuStreamGetFlags(CU_STREAM_PER_THREAD, &flags));
    EXPECT(flags == 0, "per-thread stream flags %u", flags);
    CHECK(cuMemcpyDtoH_v2(&v, b, 4));
    EXPECT(v == 0x01010101, "per-thread memset: %#x", v);
    printf("per-thread stream ok\n");

    CHECK(cuEventDestroy_v2(start));
    CHECK(cuEventDestroy_v2(mid));
    CHECK(cuEventDestroy_v2(end));
    CHECK(cuEventDestroy_v2(sync_event));
    CHECK(cuStreamDestroy_v2(s1));
    CHECK(cuStreamDestroy_v2(s2));
    printf("streams ok\n");
}

/* A kernel that never ends: the emu's watchdog stops it, and the error stays (sticky). */
static void watchdog(void) {
    setup();
    CUfunction spin = function("spin");
    CUdeviceptr flag;
    CHECK(cuMemAlloc_v2(&flag, 4));
    CHECK(cuMemsetD32_v2(flag, 0, 1));
    void *params[] = {&flag};
    CHECK(cuLaunchKernel(spin, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL));
    EXPECT_ERR(cuCtxSynchronize(), LAUNCH_TIMEOUT);
    unsigned v;
    EXPECT_ERR(cuMemcpyDtoH_v2(&v, flag, 4), LAUNCH_TIMEOUT);
    printf("watchdog ok\n");
}

/* Many streams, each with work, at once. */
static void many_streams(int count) {
    setup();
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, (size_t)count * 4));
    CUstream *s = calloc(count, sizeof *s);
    for (int i = 0; i < count; i++) CHECK(cuStreamCreate(&s[i], 1));
    for (int i = 0; i < count; i++) CHECK(cuMemsetD8Async(p + 4 * (size_t)i, (unsigned char)i, 4, s[i]));
    CHECK(cuCtxSynchronize());
    unsigned char *back = malloc((size_t)count * 4);
    CHECK(cuMemcpyDtoH_v2(back, p, (size_t)count * 4));
    for (int i = 0; i < count; i++) EXPECT(back[4 * i] == (unsigned char)i, "stream %d's memset", i);
    printf("%d streams did their work\n", count);
    fflush(stdout);
    /* Held a moment, so the test can look at the server meanwhile. */
    usleep(300 * 1000);
    for (int i = 0; i < count; i++) CHECK(cuStreamDestroy_v2(s[i]));
    free(s);
    free(back);
    printf("many-streams ok\n");
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "contexts")) contexts();
    else if (!strcmp(mode, "pools")) pools();
    else if (!strcmp(mode, "vmm")) vmm();
    else if (!strcmp(mode, "streams")) streams();
    else if (!strcmp(mode, "watchdog")) watchdog();
    else if (!strcmp(mode, "many-streams")) many_streams(argc > 2 ? atoi(argv[2]) : 1000);
    else {
        fprintf(stderr, "usage: driver_api contexts|pools|vmm|streams|watchdog|many-streams N\n");
        return 2;
    }
    return 0;
}
