/* Host-to-device uploads for Gleam's content-cache tests and measurements. No cuda.h exists on CI, so the
 * few prototypes it needs are declared here (with the ABI of NVIDIA's driver).
 *
 *   upload MIB SEED MODE [KIND [CHANGE...]]
 *
 * Fills MIB MiB of host memory from SEED (KIND `random`: incompressible bytes, the default; `weights`:
 * fp16-like values whose high bytes repeat, which zstd shrinks), flips one byte at each CHANGE offset
 * (in bytes), uploads it and reads it back, and checks that the device holds exactly the host's bytes.
 * MODE: `sync` (cuMemcpyHtoD), `async` (cuMemcpyHtoDAsync on a created stream, between two memsets of
 * that stream, which must land before and after it; the host buffer is overwritten as soon as the call
 * returns, which must not change what arrives), `unified` (cuMemcpy with a host source), or `all`.
 * Prints `upload MODE: N MiB in S s (R MiB/s)` per upload (the upload call alone; for `async` until the
 * stream is synchronized) and `all ok` at the end; exits non-zero on the first mismatch. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream;

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes);
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream stream);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuStreamDestroy_v2(CUstream stream);

#define CHECK(call)                                                                                \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != 0) {                                                                             \
            fprintf(stderr, "upload: %s failed: %d\n", #call, r_);                                 \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void fill(unsigned char *buf, size_t n, uint64_t seed, int weights) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    if (!weights) {
        size_t i = 0;
        for (; i + 8 <= n; i += 8) {
            uint64_t v = next(&s);
            memcpy(buf + i, &v, 8);
        }
        for (; i < n; i++) buf[i] = (unsigned char)next(&s);
        return;
    }
    /* fp16 of small values: a random mantissa byte, a high byte from a few exponents. */
    for (size_t i = 0; i < n; i += 2) {
        uint64_t v = next(&s);
        buf[i] = (unsigned char)v;
        if (i + 1 < n) buf[i + 1] = (unsigned char)(0x20 + ((v >> 8) & 3) + ((v >> 10) & 1 ? 0x80 : 0));
    }
}

static int same(const char *what, const unsigned char *want, const unsigned char *got, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (want[i] != got[i]) {
            fprintf(stderr, "upload %s: byte %zu is %u on the device, %u on the host\n", what, i, got[i],
                    want[i]);
            return 0;
        }
    }
    return 1;
}

static void report(const char *mode, size_t n, double secs) {
    double mib = (double)n / (1 << 20);
    printf("upload %s: %.0f MiB in %.3f s (%.1f MiB/s)\n", mode, mib, secs, mib / secs);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: upload MIB SEED sync|async|unified|all [random|weights [CHANGE...]]\n");
        return 2;
    }
    size_t n = (size_t)(atof(argv[1]) * (1 << 20));
    uint64_t seed = strtoull(argv[2], NULL, 10);
    const char *mode = argv[3];
    int weights = argc > 4 && strcmp(argv[4], "weights") == 0;
    int all = strcmp(mode, "all") == 0;

    unsigned char *host = malloc(n), *back = malloc(n), *want = malloc(n);
    if (!host || !back || !want) return 2;
    fill(host, n, seed, weights);
    for (int i = 5; i < argc; i++) {
        size_t at = strtoull(argv[i], NULL, 10);
        if (at < n) host[at] ^= 0x5a;
    }
    memcpy(want, host, n);

    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CUdeviceptr d;
    CHECK(cuMemAlloc_v2(&d, n));

    if (all || strcmp(mode, "sync") == 0) {
        double t = now();
        CHECK(cuMemcpyHtoD_v2(d, host, n));
        report("sync", n, now() - t);
        memset(back, 0, n);
        CHECK(cuMemcpyDtoH_v2(back, d, n));
        if (!same("sync", want, back, n)) return 1;
    }
    if (all || strcmp(mode, "async") == 0) {
        CUstream s;
        CHECK(cuStreamCreate(&s, 0));
        size_t edge = n < 64 ? n : 64;
        double t = now();
        CHECK(cuMemsetD8Async(d, 0xee, n, s));
        CHECK(cuMemcpyHtoDAsync_v2(d, host, n, s));
        /* The source is the caller's again: what arrives must be what it held at the call. */
        memset(host, 0x33, n);
        CHECK(cuMemsetD8Async(d + n - edge, 0x77, edge, s));
        CHECK(cuStreamSynchronize(s));
        report("async", n, now() - t);
        memset(want + n - edge, 0x77, edge);
        memset(back, 0, n);
        CHECK(cuMemcpyDtoH_v2(back, d, n));
        if (!same("async", want, back, n)) return 1;
        CHECK(cuStreamDestroy_v2(s));
        /* The original bytes again, for the next mode. */
        fill(want, n, seed, weights);
        for (int i = 5; i < argc; i++) {
            size_t at = strtoull(argv[i], NULL, 10);
            if (at < n) want[at] ^= 0x5a;
        }
        memcpy(host, want, n);
    }
    if (all || strcmp(mode, "unified") == 0) {
        double t = now();
        CHECK(cuMemcpy(d, (CUdeviceptr)(uintptr_t)host, n));
        report("unified", n, now() - t);
        memset(back, 0, n);
        CHECK(cuMemcpyDtoH_v2(back, d, n));
        if (!same("unified", want, back, n)) return 1;
    }
    CHECK(cuMemFree_v2(d));
    printf("all ok\n");
    return 0;
}
