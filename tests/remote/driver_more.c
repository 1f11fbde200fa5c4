/* Less common driver calls real programs make: 2D memsets, peer copies and peer access on one device.
 * Runs unchanged on NVIDIA's driver and through Gleam, so what it expects is the real driver's
 * behaviour. No cuda.h on CI: the declarations it needs are here, with the driver's ABI (CUDA 13.0).
 *
 *   driver_more memset2d|peer|pci
 *
 * Prints one line per check and `<mode> ok` at the end; exits non-zero on the first failure. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream;

CUresult cuInit(unsigned flags);
CUresult cuGetErrorName(CUresult error, const char **name);
CUresult cuDeviceGetCount(int *count);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                            unsigned element);
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char value, size_t n);
CUresult cuMemsetD2D8_v2(CUdeviceptr dst, size_t pitch, unsigned char value, size_t width, size_t height);
CUresult cuMemsetD2D16_v2(CUdeviceptr dst, size_t pitch, unsigned short value, size_t width,
                          size_t height);
CUresult cuMemsetD2D32_v2(CUdeviceptr dst, size_t pitch, unsigned value, size_t width, size_t height);
CUresult cuMemsetD2D8Async(CUdeviceptr dst, size_t pitch, unsigned char value, size_t width, size_t height,
                           CUstream stream);
CUresult cuMemsetD2D16Async(CUdeviceptr dst, size_t pitch, unsigned short value, size_t width,
                            size_t height, CUstream stream);
CUresult cuMemsetD2D32Async(CUdeviceptr dst, size_t pitch, unsigned value, size_t width, size_t height,
                            CUstream stream);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx, size_t bytes);
CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src, CUcontext src_ctx,
                           size_t bytes, CUstream stream);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuDeviceCanAccessPeer(int *can, CUdevice dev, CUdevice peer);
CUresult cuCtxEnablePeerAccess(CUcontext peer, unsigned flags);
CUresult cuCtxDisablePeerAccess(CUcontext peer);
CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice dev);
CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *id);

#define INVALID_VALUE 1
#define INVALID_DEVICE 101
#define PEER_ACCESS_NOT_ENABLED 705

#include "expect.h"

/* Checks a 2D fill of `rows` x `width` elements of `esize` bytes with `value`, rows `pitch` apart, the
 * rest of each row (and everything after) still 0xee. */
static void check_fill(const unsigned char *host, size_t pitch, size_t rows, size_t width, size_t esize,
                       unsigned value, size_t total, const char *what) {
    for (size_t i = 0; i < total; i++) {
        size_t r = i / pitch, c = i % pitch;
        int inside = r < rows && c < width * esize;
        unsigned char want = inside ? (unsigned char)(value >> (8 * (c % esize))) : 0xee;
        CHECK(host[i] == want, "%s: byte %zu (row %zu, col %zu) is %#x, want %#x", what, i, r, c, host[i],
              want);
    }
}

static void memset2d(void) {
    enum { W = 10, H = 6, PITCH = 64, TOTAL = PITCH * H };
    static unsigned char host[TOTAL];
    CUdeviceptr d;
    CUstream s;
    EXPECT(cuMemAlloc_v2(&d, TOTAL), 0);
    EXPECT(cuStreamCreate(&s, 0), 0);

    EXPECT(cuMemsetD8_v2(d, 0xee, TOTAL), 0);
    EXPECT(cuMemsetD2D8_v2(d, PITCH, 0x5a, W, H - 1), 0);
    EXPECT(cuMemcpyDtoH_v2(host, d, TOTAL), 0);
    check_fill(host, PITCH, H - 1, W, 1, 0x5a, TOTAL, "D2D8");

    EXPECT(cuMemsetD8_v2(d, 0xee, TOTAL), 0);
    EXPECT(cuMemsetD2D16_v2(d, PITCH, 0x1234, W, H), 0);
    EXPECT(cuMemcpyDtoH_v2(host, d, TOTAL), 0);
    check_fill(host, PITCH, H, W, 2, 0x1234, TOTAL, "D2D16");

    EXPECT(cuMemsetD8_v2(d, 0xee, TOTAL), 0);
    EXPECT(cuMemsetD2D32_v2(d, PITCH, 0xdeadbeef, W, H), 0);
    EXPECT(cuMemcpyDtoH_v2(host, d, TOTAL), 0);
    check_fill(host, PITCH, H, W, 4, 0xdeadbeef, TOTAL, "D2D32");
    printf("2D memsets ok\n");

    EXPECT(cuMemsetD8_v2(d, 0xee, TOTAL), 0);
    EXPECT(cuMemsetD2D8Async(d, PITCH, 0x77, W, 2, s), 0);
    EXPECT(cuMemsetD2D16Async(d + 2 * PITCH, PITCH, 0xabcd, W, 2, s), 0);
    EXPECT(cuMemsetD2D32Async(d + 4 * PITCH, PITCH, 0x01020304, W, 2, s), 0);
    EXPECT(cuStreamSynchronize(s), 0);
    EXPECT(cuMemcpyDtoH_v2(host, d, TOTAL), 0);
    check_fill(host, PITCH, 2, W, 1, 0x77, 2 * PITCH, "D2D8Async");
    check_fill(host + 2 * PITCH, PITCH, 2, W, 2, 0xabcd, 2 * PITCH, "D2D16Async");
    check_fill(host + 4 * PITCH, PITCH, 2, W, 4, 0x01020304, 2 * PITCH, "D2D32Async");
    printf("2D memsets on a stream ok\n");

    /* A pitched allocation, filled whole. */
    CUdeviceptr p;
    size_t pitch = 0;
    EXPECT(cuMemAllocPitch_v2(&p, &pitch, 100, 3, 4), 0);
    EXPECT(cuMemsetD2D32_v2(p, pitch, 7, 25, 3), 0);
    unsigned row[25];
    EXPECT(cuMemcpyDtoH_v2(row, p + 2 * pitch, sizeof row), 0);
    for (int i = 0; i < 25; i++) CHECK(row[i] == 7, "pitched row element %d is %u", i, row[i]);
    printf("2D memset of a pitched allocation ok\n");

    /* Misaligned 16/32-bit fills and rows wider than their pitch are refused. */
    EXPECT(cuMemsetD2D16_v2(d + 1, PITCH, 1, W, 2), INVALID_VALUE);
    EXPECT(cuMemsetD2D32_v2(d + 2, PITCH, 1, W, 2), INVALID_VALUE);
    EXPECT(cuMemsetD2D8_v2(d, 4, 1, 8, 2), INVALID_VALUE);
    printf("bad 2D memsets refused ok\n");
}

static void peer(void) {
    CUcontext a, b;
    CUstream s;
    CUdeviceptr x, y;
    int count = 0, can = -1;
    unsigned char in[256], out[256];
    EXPECT(cuDeviceGetCount(&count), 0);
    EXPECT(cuDevicePrimaryCtxRetain(&a, 0), 0);
    EXPECT(cuCtxCreate_v2(&b, 0, 0), 0);
    EXPECT(cuCtxSetCurrent(a), 0);
    EXPECT(cuMemAlloc_v2(&x, sizeof in), 0);
    EXPECT(cuCtxSetCurrent(b), 0);
    EXPECT(cuMemAlloc_v2(&y, sizeof in), 0);
    EXPECT(cuStreamCreate(&s, 0), 0);
    for (int i = 0; i < 256; i++) in[i] = (unsigned char)(i * 7 + 1);
    EXPECT(cuMemcpyHtoD_v2(x, in, sizeof in), 0);
    EXPECT(cuMemcpyPeer(y, b, x, a, sizeof in), 0);
    EXPECT(cuMemcpyDtoH_v2(out, y, sizeof out), 0);
    CHECK(memcmp(in, out, sizeof in) == 0, "cuMemcpyPeer copied other bytes");
    EXPECT(cuMemsetD8_v2(x, 0, sizeof in), 0);
    EXPECT(cuMemcpyPeerAsync(x, a, y, b, 128, s), 0);
    EXPECT(cuStreamSynchronize(s), 0);
    EXPECT(cuMemcpyDtoH_v2(out, x, sizeof out), 0);
    CHECK(memcmp(in, out, 128) == 0, "cuMemcpyPeerAsync copied other bytes");
    for (int i = 128; i < 256; i++) CHECK(out[i] == 0, "byte %d beyond the copy is %d", i, out[i]);
    printf("peer copies between two contexts of one device ok\n");

    /* One device is not its own peer: no peer access to enable. */
    EXPECT(cuDeviceCanAccessPeer(&can, 0, 0), 0);
    CHECK(can == 0, "cuDeviceCanAccessPeer(0, 0) = %d", can);
    EXPECT(cuCtxEnablePeerAccess(a, 0), INVALID_DEVICE);
    EXPECT(cuCtxDisablePeerAccess(a), PEER_ACCESS_NOT_ENABLED);
    EXPECT(cuDeviceCanAccessPeer(&can, 0, count), INVALID_DEVICE);
    printf("peer access on one device ok\n");
    EXPECT(cuCtxSetCurrent(a), 0);
    EXPECT(cuCtxDestroy_v2(b), 0);
}

static void pci(void) {
    char id[64], other[64];
    unsigned domain = 0, bus = 0, device = 0, function = 0;
    CUdevice dev = -1;
    EXPECT(cuDeviceGetPCIBusId(id, sizeof id, 0), 0);
    EXPECT(cuDeviceGetByPCIBusId(&dev, id), 0);
    CHECK(dev == 0, "%s is device %d", id, dev);
    CHECK(sscanf(id, "%x:%x:%x.%x", &domain, &bus, &device, &function) == 4, "bus id %s", id);
    /* The short form without the domain names the same device. */
    snprintf(other, sizeof other, "%02x:%02x.%x", bus, device, function);
    dev = -1;
    EXPECT(cuDeviceGetByPCIBusId(&dev, other), 0);
    CHECK(dev == 0, "%s is device %d", other, dev);
    snprintf(other, sizeof other, "%04x:%02x:%02x.0", domain, (bus + 1) & 0xff, device);
    EXPECT(cuDeviceGetByPCIBusId(&dev, other), INVALID_DEVICE);
    EXPECT(cuDeviceGetByPCIBusId(&dev, "not a bus id"), INVALID_VALUE);
    EXPECT(cuDeviceGetByPCIBusId(&dev, NULL), INVALID_VALUE);
    printf("device by PCI bus id ok\n");
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    CUcontext ctx;
    EXPECT(cuInit(0), 0);
    EXPECT(cuDevicePrimaryCtxRetain(&ctx, 0), 0);
    EXPECT(cuCtxSetCurrent(ctx), 0);
    if (strcmp(mode, "memset2d") == 0) {
        memset2d();
    } else if (strcmp(mode, "peer") == 0) {
        peer();
    } else if (strcmp(mode, "pci") == 0) {
        pci();
    } else {
        printf("unknown mode %s\n", mode);
        return 2;
    }
    printf("%s ok\n", mode);
    return 0;
}
