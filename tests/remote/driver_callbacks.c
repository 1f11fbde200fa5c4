/* Host functions (cuLaunchHostFunc, cuStreamAddCallback), as a program sees them: they run in their
 * stream's order, see what the stream did before them, hold the stream's later work until they return,
 * never hold another stream, and synchronization waits for them. Except for `capture` (Gleam refuses host
 * functions in a capture, where CUDA records a host node), what it expects is the real driver's
 * behaviour. No cuda.h on CI: the declarations it needs are here, with the driver's ABI (CUDA 13.0).
 *
 *   driver_callbacks order|hold|streams|backlog|sync|status|fault|capture|exit
 *
 * Prints one line per check and `<mode> ok` at the end; exits non-zero on the first failure. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUevent, *CUmodule, *CUfunction, *CUgraph;
typedef void (*CUhostFn)(void *userData);
typedef void (*CUstreamCallback)(CUstream stream, CUresult status, void *userData);

CUresult cuInit(unsigned flags);
CUresult cuGetErrorName(CUresult error, const char **name);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned value, size_t n);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, CUstream stream, void **params, void **extra);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuStreamQuery(CUstream stream);
CUresult cuStreamBeginCapture_v2(CUstream stream, int mode);
CUresult cuStreamEndCapture(CUstream stream, CUgraph *graph);
CUresult cuEventCreate(CUevent *event, unsigned flags);
CUresult cuEventRecord(CUevent event, CUstream stream);
CUresult cuEventQuery(CUevent event);
CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *userData);
CUresult cuLaunchHostFunc_ptsz(CUstream stream, CUhostFn fn, void *userData);
CUresult cuStreamAddCallback(CUstream stream, CUstreamCallback callback, void *userData, unsigned flags);
CUresult cuStreamAddCallback_ptsz(CUstream stream, CUstreamCallback callback, void *userData,
                                  unsigned flags);

#define NOT_READY 600
#define ILLEGAL_ADDRESS 700
#define INVALID_VALUE 1
#define CAPTURE_UNSUPPORTED 900
#define CAPTURE_INVALIDATED 901

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

static CUfunction add_one;

static void launch_add_one(CUdeviceptr data, unsigned n, CUstream stream) {
    void *params[] = {&data, &n};
    EXPECT(cuLaunchKernel(add_one, 1, 1, 1, 32, 1, 1, 0, stream, params, NULL), 0);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int load(int *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static void store(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }

/* ---- order: kernels, copies and functions on one stream, and on the legacy stream ---- */

#define ROUNDS 6
static int log_values[2 * ROUNDS + 4];
static int log_len;
static int host_copy; /* written by the stream's copy, read by the functions */

static void record_copy(void *unused) {
    (void)unused;
    int at = __atomic_fetch_add(&log_len, 1, __ATOMIC_SEQ_CST);
    log_values[at] = load(&host_copy);
}

static CUstream seen_stream;
static CUresult seen_status = -1;
static void record_copy_cb(CUstream stream, CUresult status, void *unused) {
    seen_stream = stream;
    seen_status = status;
    record_copy(unused);
}

static void order(void) {
    CUstream s;
    CUdeviceptr d;
    EXPECT(cuStreamCreate(&s, 0), 0);
    EXPECT(cuMemAlloc_v2(&d, 4), 0);
    EXPECT(cuMemsetD32_v2(d, 0, 1), 0);
    for (int i = 0; i < ROUNDS; i++) {
        launch_add_one(d, 1, s);
        EXPECT(cuMemcpyDtoHAsync_v2(&host_copy, d, 4, s), 0);
        if (i % 2 == 0) {
            EXPECT(cuLaunchHostFunc(s, record_copy, NULL), 0);
        } else {
            EXPECT(cuStreamAddCallback(s, record_copy_cb, NULL, 0), 0);
        }
        /* Two functions in a row keep their order too. */
        EXPECT(cuLaunchHostFunc(s, record_copy, NULL), 0);
    }
    EXPECT(cuStreamSynchronize(s), 0);
    CHECK(load(&log_len) == 2 * ROUNDS, "%d functions ran", load(&log_len));
    for (int i = 0; i < 2 * ROUNDS; i++) {
        CHECK(log_values[i] == i / 2 + 1, "function %d saw %d", i, log_values[i]);
    }
    CHECK(seen_stream == s && seen_status == 0, "callback got stream %p status %d", seen_stream,
          seen_status);
    printf("functions run in stream order and see the stream's copies ok\n");

    /* The legacy stream (NULL), and the per-thread stream through the _ptsz forms. */
    store(&log_len, 0);
    launch_add_one(d, 1, NULL);
    EXPECT(cuMemcpyDtoHAsync_v2(&host_copy, d, 4, NULL), 0);
    EXPECT(cuLaunchHostFunc(NULL, record_copy, NULL), 0);
    EXPECT(cuLaunchHostFunc_ptsz(NULL, record_copy, NULL), 0);
    EXPECT(cuStreamAddCallback_ptsz(NULL, record_copy_cb, NULL, 0), 0);
    EXPECT(cuCtxSynchronize(), 0);
    CHECK(load(&log_len) == 3, "%d functions ran", load(&log_len));
    CHECK(log_values[0] == ROUNDS + 1, "legacy function saw %d", log_values[0]);
    printf("legacy and per-thread streams ok\n");

    EXPECT(cuLaunchHostFunc(s, NULL, NULL), INVALID_VALUE);
    EXPECT(cuStreamAddCallback(s, record_copy_cb, NULL, 1), INVALID_VALUE);
    printf("bad arguments refused ok\n");
}

/* ---- hold: a function holds its stream's later work until it returns ---- */

static int go, held_done;
static void wait_for_go(void *unused) {
    (void)unused;
    double start = now();
    while (!load(&go) && now() - start < 20) usleep(1000);
    usleep(50000); /* later work must wait for this too */
    store(&held_done, 1);
}

static void hold(void) {
    CUstream s;
    CUevent after;
    CUdeviceptr d;
    int v = 0;
    /* Non-blocking: the synchronous copy below (legacy stream) must not wait for it. */
    EXPECT(cuStreamCreate(&s, 1), 0);
    EXPECT(cuEventCreate(&after, 0), 0);
    EXPECT(cuMemAlloc_v2(&d, 4), 0);
    EXPECT(cuMemsetD32_v2(d, 0, 1), 0);
    EXPECT(cuLaunchHostFunc(s, wait_for_go, NULL), 0);
    launch_add_one(d, 1, s);
    EXPECT(cuEventRecord(after, s), 0);
    usleep(200000);
    EXPECT(cuStreamQuery(s), NOT_READY);
    EXPECT(cuEventQuery(after), NOT_READY);
    /* The kernel after the function has not run. */
    EXPECT(cuMemcpyDtoH_v2(&v, d, 4), 0);
    CHECK(v == 0, "the kernel after a held function ran (value %d)", v);
    printf("a running function holds its stream ok\n");
    store(&go, 1);
    EXPECT(cuStreamSynchronize(s), 0);
    CHECK(load(&held_done), "cuStreamSynchronize returned before the function did");
    EXPECT(cuEventQuery(after), 0);
    EXPECT(cuMemcpyDtoH_v2(&v, d, 4), 0);
    CHECK(v == 1, "value %d after the stream went on", v);
    printf("the stream goes on once it returned ok\n");
}

/* ---- streams: a function on one stream never holds another ---- */

static int b_ran;
static void wait_for_b(void *unused) {
    (void)unused;
    double start = now();
    while (!load(&b_ran) && now() - start < 20) usleep(1000);
    store(&held_done, load(&b_ran) ? 1 : -1);
}
static void mark_b(void *unused) {
    (void)unused;
    store(&b_ran, 1);
}

static void streams(void) {
    CUstream a, b;
    CUdeviceptr d;
    int v = 0;
    EXPECT(cuStreamCreate(&a, 1 /* non-blocking */), 0);
    EXPECT(cuStreamCreate(&b, 1), 0);
    EXPECT(cuMemAlloc_v2(&d, 4), 0);
    EXPECT(cuMemsetD32_v2(d, 41, 1), 0);
    /* A's function waits for B's: if A held B, neither would finish. */
    EXPECT(cuLaunchHostFunc(a, wait_for_b, NULL), 0);
    usleep(100000);
    launch_add_one(d, 1, b);
    EXPECT(cuMemcpyDtoHAsync_v2(&v, d, 4, b), 0);
    CHECK(v == 42, "B's copy gave %d", v);
    EXPECT(cuStreamQuery(a), NOT_READY);
    EXPECT(cuLaunchHostFunc(b, mark_b, NULL), 0);
    EXPECT(cuStreamSynchronize(a), 0);
    CHECK(load(&held_done) == 1, "A's function never saw B's run");
    EXPECT(cuStreamSynchronize(b), 0);
    printf("a function on one stream does not hold another ok\n");
}

/* ---- backlog: a held stream with hundreds of MiB of copies queued behind it does not hold another
 * (whichever buffer they fill: the client's for that stream, the network's, the serving side's) ---- */

#define PIECE (512 << 10) /* under the content-copy threshold: plain asynchronous copies */
#define PIECES 512        /* 256 MiB: more than the serving side and the network buffer for a stream */
static CUcontext the_ctx;
static CUstream backlog_a;
static CUdeviceptr backlog_dst;
static int pieces_queued;

static void *fill_a(void *unused) {
    (void)unused;
    static unsigned char piece[PIECE];
    memset(piece, 7, sizeof piece);
    EXPECT(cuCtxSetCurrent(the_ctx), 0);
    for (int i = 0; i < PIECES; i++) {
        EXPECT(cuMemcpyHtoDAsync_v2(backlog_dst, piece, PIECE, backlog_a), 0);
        store(&pieces_queued, i + 1);
    }
    return NULL;
}

static void backlog(void) {
    CUstream b;
    CUdeviceptr d;
    pthread_t filler;
    int v = 0;
    EXPECT(cuStreamCreate(&backlog_a, 1), 0);
    EXPECT(cuStreamCreate(&b, 1), 0);
    EXPECT(cuMemAlloc_v2(&backlog_dst, PIECE), 0);
    EXPECT(cuMemAlloc_v2(&d, 4), 0);
    EXPECT(cuMemsetD32_v2(d, 41, 1), 0);
    EXPECT(cuCtxSynchronize(), 0);
    /* A is held by a function that waits for B's, and its copies pile up behind it until they are all
     * queued or the thread queueing them has to wait for room. */
    EXPECT(cuLaunchHostFunc(backlog_a, wait_for_b, NULL), 0);
    CHECK(pthread_create(&filler, NULL, fill_a, NULL) == 0, "cannot start the filling thread");
    int last = -1;
    double still_since = now();
    while (load(&pieces_queued) < PIECES && now() - still_since < 0.5) {
        int queued = load(&pieces_queued);
        if (queued != last) {
            last = queued;
            still_since = now();
        }
        usleep(10000);
    }
    printf("%d MiB queued behind the held stream ok\n", load(&pieces_queued) * PIECE >> 20);
    /* B's work goes through now: if A's backlog held B, A's function would give up waiting. */
    launch_add_one(d, 1, b);
    EXPECT(cuMemcpyDtoHAsync_v2(&v, d, 4, b), 0);
    EXPECT(cuLaunchHostFunc(b, mark_b, NULL), 0);
    EXPECT(cuStreamSynchronize(b), 0);
    CHECK(v == 42, "B's copy gave %d", v);
    CHECK(pthread_join(filler, NULL) == 0, "cannot join the filling thread");
    EXPECT(cuStreamSynchronize(backlog_a), 0);
    CHECK(load(&held_done) == 1, "B's work waited for A's backlog");
    printf("a full stream does not hold another ok\n");
}

/* ---- sync: synchronization waits for functions ---- */

static int slow_done;
static void slow(void *unused) {
    (void)unused;
    usleep(300000);
    store(&slow_done, load(&slow_done) + 1);
}

static void sync_waits(void) {
    CUstream s;
    EXPECT(cuStreamCreate(&s, 0), 0);
    double t0 = now();
    EXPECT(cuLaunchHostFunc(s, slow, NULL), 0);
    CHECK(now() - t0 < 0.25, "cuLaunchHostFunc waited %.3f s", now() - t0);
    EXPECT(cuStreamSynchronize(s), 0);
    CHECK(load(&slow_done) == 1, "cuStreamSynchronize returned first");
    printf("cuStreamSynchronize waits ok\n");
    EXPECT(cuLaunchHostFunc(s, slow, NULL), 0);
    EXPECT(cuCtxSynchronize(), 0);
    CHECK(load(&slow_done) == 2, "cuCtxSynchronize returned first");
    printf("cuCtxSynchronize waits ok\n");
    CUevent e;
    EXPECT(cuEventCreate(&e, 0), 0);
    EXPECT(cuLaunchHostFunc(s, slow, NULL), 0);
    EXPECT(cuEventRecord(e, s), 0);
    EXPECT(cuEventQuery(e), NOT_READY);
    EXPECT(cuStreamSynchronize(s), 0);
    EXPECT(cuEventQuery(e), 0);
    printf("events after a function ok\n");
}

/* ---- status: stream callbacks get the stream and CUDA_SUCCESS; fault: the context's error ---- */

static int fault_cb_ran, fault_fn_ran;
static CUresult fault_status = -1;
static void fault_cb(CUstream stream, CUresult status, void *data) {
    (void)stream;
    fault_status = status;
    store(&fault_cb_ran, *(int *)data);
}
static void fault_fn(void *unused) {
    (void)unused;
    store(&fault_fn_ran, 1);
}

static void status(void) {
    CUstream s;
    int tag = 7;
    EXPECT(cuStreamCreate(&s, 0), 0);
    EXPECT(cuStreamAddCallback(s, fault_cb, &tag, 0), 0);
    EXPECT(cuStreamSynchronize(s), 0);
    CHECK(load(&fault_cb_ran) == 7 && fault_status == 0, "status %d, data %d", fault_status,
          load(&fault_cb_ran));
    printf("a callback gets CUDA_SUCCESS and its data ok\n");
}

static void fault(void) {
    CUstream s;
    int tag = 9;
    EXPECT(cuStreamCreate(&s, 0), 0);
    launch_add_one(0x10, 1, s); /* an illegal address: the context is lost */
    EXPECT(cuStreamAddCallback(s, fault_cb, &tag, 0), 0);
    EXPECT(cuLaunchHostFunc(s, fault_fn, NULL), 0);
    CUresult r = cuStreamSynchronize(s);
    CHECK(r == ILLEGAL_ADDRESS, "cuStreamSynchronize: %s", name_of(r));
    double start = now();
    while (!load(&fault_cb_ran) && now() - start < 10) usleep(1000);
    CHECK(load(&fault_cb_ran) == 9, "the callback did not run after a fault");
    CHECK(fault_status == ILLEGAL_ADDRESS, "callback status %s", name_of(fault_status));
    usleep(100000);
    CHECK(!load(&fault_fn_ran), "a host function ran in a failed context");
    printf("after a fault callbacks get the error and host functions do not run ok\n");
}

/* ---- capture: refused (Gleam), the capture invalidated ---- */

static void capture(void) {
    CUstream s;
    CUgraph g = 0;
    EXPECT(cuStreamCreate(&s, 0), 0);
    EXPECT(cuStreamBeginCapture_v2(s, 0), 0);
    EXPECT(cuLaunchHostFunc(s, fault_fn, NULL), CAPTURE_UNSUPPORTED);
    EXPECT(cuStreamEndCapture(s, &g), CAPTURE_INVALIDATED);
    /* Another stream's capture does not affect a function on a stream that is not capturing. */
    CUstream t;
    EXPECT(cuStreamCreate(&t, 1), 0);
    EXPECT(cuStreamBeginCapture_v2(s, 2 /* relaxed */), 0);
    EXPECT(cuLaunchHostFunc(t, fault_fn, NULL), 0);
    EXPECT(cuStreamSynchronize(t), 0);
    CHECK(load(&fault_fn_ran), "the function did not run");
    EXPECT(cuStreamEndCapture(s, &g), 0);
    printf("host functions in a capture are refused ok\n");
}

/* ---- exit: leaving with a function that never returns does not hang ---- */

static void forever(void *unused) {
    (void)unused;
    for (;;) pause();
}

static void leave(void) {
    CUstream s;
    EXPECT(cuStreamCreate(&s, 0), 0);
    EXPECT(cuLaunchHostFunc(s, forever, NULL), 0);
    EXPECT(cuLaunchHostFunc(s, fault_fn, NULL), 0);
    usleep(200000);
    EXPECT(cuStreamQuery(s), NOT_READY);
    printf("exit ok\n");
    fflush(stdout);
    exit(0);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    CUcontext ctx;
    CUmodule module;
    EXPECT(cuInit(0), 0);
    EXPECT(cuDevicePrimaryCtxRetain(&ctx, 0), 0);
    EXPECT(cuCtxSetCurrent(ctx), 0);
    the_ctx = ctx;
    EXPECT(cuModuleLoadData(&module, PTX), 0);
    EXPECT(cuModuleGetFunction(&add_one, module, "add_one"), 0);
    if (strcmp(mode, "order") == 0) {
        order();
    } else if (strcmp(mode, "hold") == 0) {
        hold();
    } else if (strcmp(mode, "streams") == 0) {
        streams();
    } else if (strcmp(mode, "backlog") == 0) {
        backlog();
    } else if (strcmp(mode, "sync") == 0) {
        sync_waits();
    } else if (strcmp(mode, "status") == 0) {
        status();
    } else if (strcmp(mode, "fault") == 0) {
        fault();
    } else if (strcmp(mode, "capture") == 0) {
        capture();
    } else if (strcmp(mode, "exit") == 0) {
        leave();
    } else {
        printf("unknown mode %s\n", mode);
        return 2;
    }
    printf("%s ok\n", mode);
    return 0;
}
