/* Stream capture, stream attributes, stream memory operations and the CUDA 3.x names of a few calls, as a
 * program sees them. Runs unchanged on NVIDIA's driver and through Gleam (emu backend in CI, a real GPU on
 * the GPU machine: scripts/gpu/driver-api.sh), so what it expects is the real driver's behaviour. No cuda.h
 * on CI: the prototypes and structs it needs are declared here with the driver's ABI (CUDA 13.0).
 *
 *   driver_streams capture|attributes|memops|old-names
 *
 * Prints one line per check (`note:` lines report values it does not check) and `<mode> ok` at the end;
 * exits non-zero on the first failure. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUevent, *CUgraph, *CUgraphExec;

/* CUlaunchAttributeValue (= CUstreamAttrValue): a 64-byte union. */
typedef union {
    char pad[64];
    struct {
        void *base_ptr;
        size_t num_bytes;
        float hitRatio;
        int hitProp;
        int missProp;
    } accessPolicyWindow;
    int syncPolicy;
    int priority;
    struct { unsigned char default_, remote; } memSyncDomainMap;
    int memSyncDomain;
} CUstreamAttrValue;

/* CUstreamBatchMemOpParams: a 48-byte union. */
typedef union {
    int operation;
    struct {
        int operation;
        CUdeviceptr address;
        union { unsigned value; unsigned long long value64; };
        unsigned flags;
        CUdeviceptr alias;
    } waitValue, writeValue;
    struct { int operation; unsigned flags; } memoryBarrier;
    unsigned long long pad[6];
} CUstreamBatchMemOpParams;

CUresult cuInit(unsigned flags);
CUresult cuGetErrorName(CUresult error, const char **name);
CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *ctx);
CUresult cuCtxCreate(CUcontext *ctx, unsigned flags, CUdevice dev);
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev);
CUresult cuCtxDestroy(CUcontext ctx);
CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned value, size_t n);
CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned value, size_t n, CUstream stream);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamCreateWithPriority(CUstream *stream, unsigned flags, int priority);
CUresult cuStreamDestroy(CUstream stream);
CUresult cuStreamDestroy_v2(CUstream stream);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuStreamQuery(CUstream stream);
CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned flags);
CUresult cuStreamBeginCapture_v2(CUstream stream, int mode);
CUresult cuStreamEndCapture(CUstream stream, CUgraph *graph);
CUresult cuStreamIsCapturing(CUstream stream, int *status);
CUresult cuStreamGetAttribute(CUstream stream, int attr, CUstreamAttrValue *value);
CUresult cuStreamSetAttribute(CUstream stream, int attr, const CUstreamAttrValue *value);
CUresult cuStreamCopyAttributes(CUstream dst, CUstream src);
CUresult cuStreamWaitValue32(CUstream stream, CUdeviceptr addr, unsigned value, unsigned flags);
CUresult cuStreamWriteValue32(CUstream stream, CUdeviceptr addr, unsigned value, unsigned flags);
CUresult cuStreamWaitValue64(CUstream stream, CUdeviceptr addr, unsigned long long value, unsigned flags);
CUresult cuStreamWriteValue64(CUstream stream, CUdeviceptr addr, unsigned long long value, unsigned flags);
CUresult cuStreamBatchMemOp(CUstream stream, unsigned count, void *ops, unsigned flags);
CUresult cuStreamWaitValue32_v2(CUstream stream, CUdeviceptr addr, unsigned value, unsigned flags);
CUresult cuStreamWriteValue32_v2(CUstream stream, CUdeviceptr addr, unsigned value, unsigned flags);
CUresult cuStreamWaitValue64_v2(CUstream stream, CUdeviceptr addr, unsigned long long value, unsigned flags);
CUresult cuStreamWriteValue64_v2(CUstream stream, CUdeviceptr addr, unsigned long long value, unsigned flags);
CUresult cuStreamBatchMemOp_v2(CUstream stream, unsigned count, CUstreamBatchMemOpParams *ops, unsigned flags);
CUresult cuEventCreate(CUevent *event, unsigned flags);
CUresult cuEventRecord(CUevent event, CUstream stream);
CUresult cuEventQuery(CUevent event);
CUresult cuEventSynchronize(CUevent event);
CUresult cuEventDestroy(CUevent event);
CUresult cuEventDestroy_v2(CUevent event);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream);
CUresult cuGraphExecDestroy(CUgraphExec exec);
CUresult cuGraphDestroy(CUgraph graph);

#define SUCCESS 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define NOT_SUPPORTED 801
#define INVALID_HANDLE 400
#define NOT_READY 600
#define STREAM_CAPTURE_UNSUPPORTED 900
#define STREAM_CAPTURE_INVALIDATED 901
#define CAPTURED_EVENT 907

#define CAPTURE_STATUS_NONE 0
#define CAPTURE_STATUS_ACTIVE 1
#define CAPTURE_STATUS_INVALIDATED 2
#define CAPTURE_MODE_THREAD_LOCAL 1

#define ATTR_ACCESS_POLICY_WINDOW 1
#define ATTR_COOPERATIVE 2
#define ATTR_SYNCHRONIZATION_POLICY 3
#define ATTR_PRIORITY 8
#define ATTR_MEM_SYNC_DOMAIN_MAP 9
#define ATTR_MEM_SYNC_DOMAIN 10

#define WAIT_GEQ 0
#define WAIT_EQ 1
#define WAIT_AND 2
#define WAIT_NOR 3

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

static void setup(void) {
    CUcontext primary;
    CHECK(cuInit(0));
    CHECK(cuDevicePrimaryCtxRetain(&primary, 0));
    CHECK(cuCtxSetCurrent(primary));
}

static unsigned read32(CUdeviceptr p) {
    unsigned v = 0;
    CHECK(cuMemcpyDtoH_v2(&v, p, 4));
    return v;
}

static int capture_status(CUstream s) {
    int status = -1;
    CHECK(cuStreamIsCapturing(s, &status));
    return status;
}

/* Captures and the events recorded in them. */
static void capture(void) {
    setup();
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 16));
    CHECK(cuMemsetD32_v2(p, 1, 4));
    CUstream a, b;
    CHECK(cuStreamCreate(&a, 1));
    CHECK(cuStreamCreate(&b, 1));
    CUevent fork, join;
    CHECK(cuEventCreate(&fork, 0));
    CHECK(cuEventCreate(&join, 0));

    /* Fork/join: b joins a's capture by waiting for an event recorded in it. */
    EXPECT(capture_status(a) == CAPTURE_STATUS_NONE, "a is not capturing");
    CHECK(cuStreamBeginCapture_v2(a, CAPTURE_MODE_THREAD_LOCAL));
    EXPECT(capture_status(a) == CAPTURE_STATUS_ACTIVE, "a captures");
    EXPECT(capture_status(b) == CAPTURE_STATUS_NONE, "b not yet");
    CHECK(cuMemsetD32Async(p, 2, 2, a));
    CHECK(cuEventRecord(fork, a));
    CHECK(cuStreamWaitEvent(b, fork, 0));
    EXPECT(capture_status(b) == CAPTURE_STATUS_ACTIVE, "b joined a's capture");
    CHECK(cuMemsetD32Async(p + 8, 3, 2, b));
    CHECK(cuEventRecord(join, b));
    CHECK(cuStreamWaitEvent(a, join, 0));
    CUgraph graph;
    CHECK(cuStreamEndCapture(a, &graph));
    EXPECT(capture_status(a) == CAPTURE_STATUS_NONE, "a's capture ended");
    EXPECT(capture_status(b) == CAPTURE_STATUS_NONE, "b left with it");
    unsigned v = read32(p);
    EXPECT(v == 1, "captured work did not run: %u", v);

    /* A graph launched from the device cannot free its memory on launch. */
    CUgraphExec exec;
    EXPECT_ERR(cuGraphInstantiateWithFlags(&exec, graph, 1 | 4), INVALID_VALUE);
    CHECK(cuGraphInstantiateWithFlags(&exec, graph, 0));
    CHECK(cuGraphLaunch(exec, a));
    CHECK(cuStreamSynchronize(a));
    unsigned back[4];
    CHECK(cuMemcpyDtoH_v2(back, p, 16));
    EXPECT(back[0] == 2 && back[1] == 2 && back[2] == 3 && back[3] == 3, "graph replayed: %u %u %u %u",
           back[0], back[1], back[2], back[3]);
    CHECK(cuGraphExecDestroy(exec));
    CHECK(cuGraphDestroy(graph));
    printf("fork/join capture and replay ok\n");

    /* An event recorded in a capture marks a point of the graph: asking about it during the capture is
     * illegal and invalidates the capture. */
    CHECK(cuStreamBeginCapture_v2(a, CAPTURE_MODE_THREAD_LOCAL));
    CHECK(cuEventRecord(fork, a));
    EXPECT_ERR(cuEventQuery(fork), CAPTURED_EVENT);
    EXPECT(capture_status(a) == CAPTURE_STATUS_INVALIDATED, "capture invalidated");
    EXPECT_ERR(cuStreamEndCapture(a, &graph), STREAM_CAPTURE_INVALIDATED);
    EXPECT(capture_status(a) == CAPTURE_STATUS_NONE, "capture over");
    CUresult after = cuEventQuery(fork);
    printf("note: cuEventQuery on an event recorded in an ended capture: %s\n", name_of(after));

    CHECK(cuStreamBeginCapture_v2(a, CAPTURE_MODE_THREAD_LOCAL));
    CHECK(cuEventRecord(join, a));
    EXPECT_ERR(cuEventSynchronize(join), CAPTURED_EVENT);
    EXPECT_ERR(cuStreamEndCapture(a, &graph), STREAM_CAPTURE_INVALIDATED);

    /* Synchronizing a capturing stream is illegal too. */
    CHECK(cuStreamBeginCapture_v2(a, CAPTURE_MODE_THREAD_LOCAL));
    EXPECT_ERR(cuStreamSynchronize(a), STREAM_CAPTURE_UNSUPPORTED);
    EXPECT(capture_status(a) == CAPTURE_STATUS_INVALIDATED, "capture invalidated by a synchronize");
    EXPECT_ERR(cuStreamEndCapture(a, &graph), STREAM_CAPTURE_INVALIDATED);
    /* A recording outside capture makes the event ordinary again. */
    CHECK(cuEventRecord(join, a));
    CHECK(cuEventSynchronize(join));
    CHECK(cuEventQuery(join));
    printf("captured events ok\n");

    CHECK(cuEventDestroy_v2(fork));
    CHECK(cuEventDestroy_v2(join));
    CHECK(cuStreamDestroy_v2(a));
    CHECK(cuStreamDestroy_v2(b));
    CHECK(cuMemFree_v2(p));
    printf("capture ok\n");
}

static CUstreamAttrValue attr(CUstream s, int id) {
    CUstreamAttrValue v;
    memset(&v, 0xab, sizeof v);
    CHECK(cuStreamGetAttribute(s, id, &v));
    return v;
}

/* Stream attributes: hints for a GPU's caches and scheduler, kept per stream. */
static void attributes(void) {
    setup();
    int least, greatest;
    CHECK(cuCtxGetStreamPriorityRange(&least, &greatest));
    CUstream s, t;
    CHECK(cuStreamCreateWithPriority(&s, 1, greatest));
    CHECK(cuStreamCreate(&t, 1));
    CUstreamAttrValue v;

    EXPECT(attr(s, ATTR_PRIORITY).priority == greatest, "priority attribute is the stream's");
    EXPECT(attr(t, ATTR_PRIORITY).priority == least, "a default stream has the least priority");
    memset(&v, 0, sizeof v);
    v.priority = least;
    CHECK(cuStreamSetAttribute(s, ATTR_PRIORITY, &v));
    EXPECT(attr(s, ATTR_PRIORITY).priority == least, "priority set");

    printf("note: default synchronization policy %d\n", attr(s, ATTR_SYNCHRONIZATION_POLICY).syncPolicy);
    memset(&v, 0, sizeof v);
    v.syncPolicy = 3; /* CU_SYNC_POLICY_YIELD */
    CHECK(cuStreamSetAttribute(s, ATTR_SYNCHRONIZATION_POLICY, &v));
    EXPECT(attr(s, ATTR_SYNCHRONIZATION_POLICY).syncPolicy == 3, "sync policy set");
    v.syncPolicy = 9;
    EXPECT_ERR(cuStreamSetAttribute(s, ATTR_SYNCHRONIZATION_POLICY, &v), INVALID_VALUE);
    EXPECT(attr(s, ATTR_SYNCHRONIZATION_POLICY).syncPolicy == 3, "a refused value changes nothing");

    int max_window = 0;
    CHECK(cuDeviceGetAttribute(&max_window, 109 /* MAX_ACCESS_POLICY_WINDOW_SIZE */, 0));
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 1 << 20));
    if (max_window > 0) {
        memset(&v, 0, sizeof v);
        v.accessPolicyWindow.base_ptr = (void *)(uintptr_t)p;
        v.accessPolicyWindow.num_bytes = (size_t)(max_window < (1 << 20) ? max_window : (1 << 20));
        v.accessPolicyWindow.hitRatio = 0.5f;
        v.accessPolicyWindow.hitProp = 2;  /* PERSISTING */
        v.accessPolicyWindow.missProp = 1; /* STREAMING */
        CHECK(cuStreamSetAttribute(s, ATTR_ACCESS_POLICY_WINDOW, &v));
        CUstreamAttrValue w = attr(s, ATTR_ACCESS_POLICY_WINDOW);
        EXPECT(w.accessPolicyWindow.base_ptr == v.accessPolicyWindow.base_ptr &&
                   w.accessPolicyWindow.num_bytes == v.accessPolicyWindow.num_bytes &&
                   w.accessPolicyWindow.hitRatio == 0.5f && w.accessPolicyWindow.hitProp == 2 &&
                   w.accessPolicyWindow.missProp == 1,
               "window kept");
        v.accessPolicyWindow.hitRatio = 1.5f;
        EXPECT_ERR(cuStreamSetAttribute(s, ATTR_ACCESS_POLICY_WINDOW, &v), INVALID_VALUE);
        v.accessPolicyWindow.hitRatio = 0.5f;
        v.accessPolicyWindow.num_bytes = (size_t)max_window + 1;
        EXPECT_ERR(cuStreamSetAttribute(s, ATTR_ACCESS_POLICY_WINDOW, &v), INVALID_VALUE);
        printf("access policy window ok (at most %d bytes)\n", max_window);
    }

    CUstreamAttrValue map = attr(s, ATTR_MEM_SYNC_DOMAIN_MAP);
    printf("note: default memory sync domain map: default %u, remote %u\n", map.memSyncDomainMap.default_,
           map.memSyncDomainMap.remote);
    EXPECT(attr(s, ATTR_MEM_SYNC_DOMAIN).memSyncDomain == 0, "default domain");
    memset(&v, 0, sizeof v);
    v.memSyncDomain = 1; /* REMOTE */
    CHECK(cuStreamSetAttribute(s, ATTR_MEM_SYNC_DOMAIN, &v));
    EXPECT(attr(s, ATTR_MEM_SYNC_DOMAIN).memSyncDomain == 1, "domain set");
    v.memSyncDomain = 7;
    EXPECT_ERR(cuStreamSetAttribute(s, ATTR_MEM_SYNC_DOMAIN, &v), INVALID_VALUE);

    /* Launch-only attributes are not stream attributes. */
    EXPECT_ERR(cuStreamGetAttribute(s, ATTR_COOPERATIVE, &v), INVALID_VALUE);

    /* cuStreamCopyAttributes copies them all to another stream. */
    CHECK(cuStreamCopyAttributes(t, s));
    EXPECT(attr(t, ATTR_SYNCHRONIZATION_POLICY).syncPolicy == 3, "policy copied");
    EXPECT(attr(t, ATTR_MEM_SYNC_DOMAIN).memSyncDomain == 1, "domain copied");
    if (max_window > 0)
        EXPECT(attr(t, ATTR_ACCESS_POLICY_WINDOW).accessPolicyWindow.num_bytes > 0, "window copied");
    printf("note: priority after cuStreamCopyAttributes: %d (source %d)\n", attr(t, ATTR_PRIORITY).priority,
           attr(s, ATTR_PRIORITY).priority);

    /* Work still runs on a stream with attributes. */
    CHECK(cuMemsetD32Async(p, 5, 1, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT(read32(p) == 5, "work on an attributed stream");
    CHECK(cuMemFree_v2(p));
    CHECK(cuStreamDestroy_v2(s));
    CHECK(cuStreamDestroy_v2(t));
    printf("attributes ok\n");
}

/* Checks that work queued after a wait has not run after a moment, then releases it. */
static void expect_blocked(CUstream s, CUdeviceptr marker) {
    usleep(50 * 1000);
    EXPECT_ERR(cuStreamQuery(s), NOT_READY);
    EXPECT(read32(marker) == 0, "work after a wait that is not satisfied ran");
}

static void expect_released(CUstream s, CUdeviceptr marker, unsigned value) {
    CHECK(cuStreamSynchronize(s));
    EXPECT(read32(marker) == value, "work after a satisfied wait: %u", read32(marker));
    CHECK(cuMemsetD32_v2(marker, 0, 1));
}

/* Stream memory operations: streams waiting on and writing 32/64-bit values in device memory. */
static void memops(void) {
    setup();
    int has64 = 0, nor = 0;
    CHECK(cuDeviceGetAttribute(&has64, 122 /* CAN_USE_64_BIT_STREAM_MEM_OPS */, 0));
    CHECK(cuDeviceGetAttribute(&nor, 123 /* CAN_USE_STREAM_WAIT_VALUE_NOR */, 0));
    printf("64-bit memops %d, wait NOR %d\n", has64, nor);
    CUdeviceptr flag, marker, wide;
    CHECK(cuMemAlloc_v2(&flag, 16));
    CHECK(cuMemAlloc_v2(&marker, 4));
    CHECK(cuMemAlloc_v2(&wide, 8));
    CHECK(cuMemsetD32_v2(flag, 0, 4));
    CHECK(cuMemsetD32_v2(marker, 0, 1));
    CHECK(cuMemsetD32_v2(wide, 0, 2));
    /* A memset of device memory may return before it is done: the waits below must see its values. */
    CHECK(cuCtxSynchronize());
    /* Non-blocking: the legacy stream's copies below never wait for them. */
    CUstream waiter, writer;
    CHECK(cuStreamCreate(&waiter, 1));
    CHECK(cuStreamCreate(&writer, 1));

    /* EQ, released by another stream's write. */
    CHECK(cuStreamWaitValue32_v2(waiter, flag, 1, WAIT_EQ));
    CHECK(cuMemsetD32Async(marker, 7, 1, waiter));
    expect_blocked(waiter, marker);
    CHECK(cuStreamWriteValue32_v2(writer, flag, 1, 0));
    expect_released(waiter, marker, 7);
    printf("wait EQ released by a stream write ok\n");

    /* GEQ is a cyclic comparison: 0xfffffff0 is "before" 5; released by a host copy. */
    CHECK(cuStreamWriteValue32_v2(writer, flag, 0xfffffff0u, 0));
    CHECK(cuStreamSynchronize(writer));
    CHECK(cuStreamWaitValue32_v2(waiter, flag, 5, WAIT_GEQ));
    CHECK(cuMemsetD32Async(marker, 8, 1, waiter));
    expect_blocked(waiter, marker);
    unsigned six = 6;
    CHECK(cuMemcpyHtoD_v2(flag, &six, 4));
    expect_released(waiter, marker, 8);
    printf("wait GEQ (cyclic) released by a host copy ok\n");

    /* AND: any common bit. */
    CHECK(cuStreamWaitValue32_v2(waiter, flag, 0x10, WAIT_AND));
    CHECK(cuMemsetD32Async(marker, 9, 1, waiter));
    expect_blocked(waiter, marker);
    CHECK(cuStreamWriteValue32_v2(writer, flag, 0x30, 0));
    expect_released(waiter, marker, 9);
    printf("wait AND ok\n");

    if (nor) {
        /* NOR: ~(*addr | value) != 0, here: bit 0 of *addr clear. */
        CHECK(cuStreamWriteValue32_v2(writer, flag, 1, 0));
        CHECK(cuStreamSynchronize(writer));
        CHECK(cuStreamWaitValue32_v2(waiter, flag, 0xfffffffeu, WAIT_NOR));
        CHECK(cuMemsetD32Async(marker, 10, 1, waiter));
        expect_blocked(waiter, marker);
        CHECK(cuStreamWriteValue32_v2(writer, flag, 2, 0));
        expect_released(waiter, marker, 10);
        printf("wait NOR ok\n");
    }

    if (has64) {
        unsigned long long big = 0x100000001ull, back = 0;
        CHECK(cuStreamWaitValue64_v2(waiter, wide, big, WAIT_EQ));
        CHECK(cuMemsetD32Async(marker, 11, 1, waiter));
        expect_blocked(waiter, marker);
        CHECK(cuStreamWriteValue64_v2(writer, wide, big, 0));
        expect_released(waiter, marker, 11);
        CHECK(cuMemcpyDtoH_v2(&back, wide, 8));
        EXPECT(back == big, "64-bit write: %#llx", back);
        EXPECT_ERR(cuStreamWriteValue64_v2(writer, wide + 4, 1, 0), INVALID_VALUE);
        printf("64-bit wait and write ok\n");
    }

    /* Misaligned addresses and unknown flags are refused. */
    EXPECT_ERR(cuStreamWriteValue32_v2(writer, flag + 2, 1, 0), INVALID_VALUE);
    EXPECT_ERR(cuStreamWaitValue32_v2(writer, flag + 2, 1, WAIT_EQ), INVALID_VALUE);

    /* A batch: the operations run in order. */
    CUstreamBatchMemOpParams ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].writeValue.operation = 2; /* WRITE_VALUE_32 */
    ops[0].writeValue.address = flag + 4;
    ops[0].writeValue.value = 21;
    ops[1].waitValue.operation = 1; /* WAIT_VALUE_32 */
    ops[1].waitValue.address = flag + 4;
    ops[1].waitValue.value = 21;
    ops[1].waitValue.flags = WAIT_EQ;
    ops[2].memoryBarrier.operation = 6; /* BARRIER */
    CHECK(cuStreamBatchMemOp_v2(writer, 3, ops, 0));
    CHECK(cuStreamSynchronize(writer));
    EXPECT(read32(flag + 4) == 21, "batch write: %u", read32(flag + 4));
    EXPECT_ERR(cuStreamBatchMemOp_v2(writer, 3, ops, 1), INVALID_VALUE);
    ops[0].operation = 77;
    EXPECT_ERR(cuStreamBatchMemOp_v2(writer, 1, ops, 0), INVALID_VALUE);
    printf("batch ok\n");

    /* A write captured into a graph is made again at every launch. */
    CHECK(cuStreamBeginCapture_v2(writer, CAPTURE_MODE_THREAD_LOCAL));
    CHECK(cuStreamWriteValue32_v2(writer, flag + 8, 33, 0));
    CUgraph graph;
    CUgraphExec exec;
    CHECK(cuStreamEndCapture(writer, &graph));
    EXPECT(read32(flag + 8) == 0, "a captured write did not run");
    CHECK(cuGraphInstantiateWithFlags(&exec, graph, 0));
    CHECK(cuGraphLaunch(exec, writer));
    CHECK(cuStreamSynchronize(writer));
    EXPECT(read32(flag + 8) == 33, "graph write: %u", read32(flag + 8));
    CHECK(cuGraphExecDestroy(exec));
    CHECK(cuGraphDestroy(graph));
    printf("captured write ok\n");

    CHECK(cuStreamDestroy_v2(waiter));
    CHECK(cuStreamDestroy_v2(writer));
    CHECK(cuMemFree_v2(flag));
    CHECK(cuMemFree_v2(marker));
    CHECK(cuMemFree_v2(wide));
    printf("memops ok\n");
}

/* The CUDA 3.x names binaries built against old headers still call: the same calls as their successors
 * (but for the pre-3.2 cuCtxCreate, below). */
static void old_names(void) {
    setup();
    CUcontext primary, ctx, current;
    CHECK(cuCtxGetCurrent(&primary));
    /* The pre-3.2 cuCtxCreate asks for 32-bit device pointers: NVIDIA's 580 driver refuses it. */
    EXPECT_ERR(cuCtxCreate(&ctx, 0, 0), OUT_OF_MEMORY);
    CHECK(cuCtxCreate_v2(&ctx, 0, 0));
    CHECK(cuCtxGetCurrent(&current));
    EXPECT(current == ctx, "cuCtxCreate makes the new context current");
    CUstream s;
    CUevent e;
    CHECK(cuStreamCreate(&s, 1));
    CHECK(cuEventCreate(&e, 0));
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 4));
    CHECK(cuMemsetD32_v2(p, 0, 1));
    CHECK(cuCtxSynchronize());
    /* CUDA 12 took the v1 stream memory operations out: NVIDIA's 580 driver answers NOT_SUPPORTED to
     * each (tools/gpu/v1_names.c), and the stream is untouched. */
    unsigned long long batch[6] = {2 /* WRITE_VALUE_32 */, p, 9, 0, 0, 0};
    EXPECT_ERR(cuStreamWriteValue32(s, p, 4, 0), NOT_SUPPORTED);
    EXPECT_ERR(cuStreamWaitValue32(s, p, 4, WAIT_EQ), NOT_SUPPORTED);
    EXPECT_ERR(cuStreamWriteValue64(s, p, 4, 0), NOT_SUPPORTED);
    EXPECT_ERR(cuStreamWaitValue64(s, p, 4, WAIT_EQ), NOT_SUPPORTED);
    EXPECT_ERR(cuStreamBatchMemOp(s, 1, batch, 0), NOT_SUPPORTED);
    CHECK(cuStreamWriteValue32_v2(s, p, 4, 0));
    CHECK(cuEventRecord(e, s));
    CHECK(cuEventSynchronize(e));
    EXPECT(read32(p) == 4, "v2 stream memory operations after the v1 ones");
    CHECK(cuEventDestroy(e));
    CHECK(cuStreamDestroy(s));
    CHECK(cuCtxDestroy(ctx));
    CHECK(cuCtxSetCurrent(primary));
    CHECK(cuCtxSynchronize());
    printf("old-names ok\n");
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "capture")) capture();
    else if (!strcmp(mode, "attributes")) attributes();
    else if (!strcmp(mode, "memops")) memops();
    else if (!strcmp(mode, "old-names")) old_names();
    else {
        fprintf(stderr, "usage: driver_streams capture|attributes|memops|old-names\n");
        return 2;
    }
    return 0;
}
