/* Records, on a real GPU, what NVIDIA's driver answers where Gleam's managed memory, host memory, array,
 * texture and surface support had to choose (pointer attributes, alignments, flags, error codes of edge
 * cases). One `name: value` line per fact, on stdout; compare with the emu backend's answers.
 *
 *   cc -O1 -o mem_facts tools/gpu/mem_facts.c -lcuda && ./mem_facts > mem-facts.txt
 *
 * Declares what it needs itself (no cuda.h needed), like tests/remote/driver_memory.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUarray, *CUstream;
typedef unsigned long long CUtexObject, CUsurfObject;
typedef struct { size_t Width, Height; unsigned Format, NumChannels; } CUDA_ARRAY_DESCRIPTOR;
typedef struct { size_t Width, Height, Depth; unsigned Format, NumChannels, Flags; } CUDA_ARRAY3D_DESCRIPTOR;
typedef struct {
    size_t srcXInBytes, srcY;
    unsigned srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    CUarray srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    unsigned dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    CUarray dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;
typedef struct {
    size_t srcXInBytes, srcY, srcZ, srcLOD;
    unsigned srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    CUarray srcArray;
    void *reserved0;
    size_t srcPitch, srcHeight;
    size_t dstXInBytes, dstY, dstZ, dstLOD;
    unsigned dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    CUarray dstArray;
    void *reserved1;
    size_t dstPitch, dstHeight;
    size_t WidthInBytes, Height, Depth;
} CUDA_MEMCPY3D;
typedef struct {
    unsigned resType;
    union {
        struct { CUarray hArray; } array;
        int reserved[32];
    } res;
    unsigned flags;
} CUDA_RESOURCE_DESC;
typedef struct {
    unsigned addressMode[3];
    unsigned filterMode, flags, maxAnisotropy, mipmapFilterMode;
    float mipmapLevelBias, minMipmapLevelClamp, maxMipmapLevelClamp;
    float borderColor[4];
    int reserved[12];
} CUDA_TEXTURE_DESC;

CUresult cuInit(unsigned);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceGetAttribute(int *, int, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemHostAlloc(void **, size_t, unsigned);
CUresult cuMemAllocHost_v2(void **, size_t);
CUresult cuMemHostRegister_v2(void *, size_t, unsigned);
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *, void *, unsigned);
CUresult cuMemHostGetFlags(unsigned *, void *);
CUresult cuPointerGetAttribute(void *, int, CUdeviceptr);
CUresult cuMemGetAddressRange_v2(CUdeviceptr *, size_t *, CUdeviceptr);
CUresult cuMemRangeGetAttribute(void *, size_t, int, CUdeviceptr, size_t);
CUresult cuMemPrefetchAsync(CUdeviceptr, size_t, CUdevice, CUstream);
CUresult cuMemAdvise(CUdeviceptr, size_t, int, CUdevice);
CUresult cuStreamAttachMemAsync(CUstream, CUdeviceptr, size_t, unsigned);
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArray3DCreate_v2(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR *, CUarray);
CUresult cuMemcpyHtoA_v2(CUarray, size_t, const void *, size_t);
CUresult cuMemcpyAtoH_v2(void *, CUarray, size_t, size_t);
CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *);
CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D *);
CUresult cuTexObjectCreate(CUtexObject *, const CUDA_RESOURCE_DESC *, const CUDA_TEXTURE_DESC *, const void *);
CUresult cuSurfObjectCreate(CUsurfObject *, const CUDA_RESOURCE_DESC *);

static void code(const char *fact, CUresult r) { printf("%s: %d\n", fact, r); }

static void alignment(const char *fact, uintptr_t p) {
    int shift = 0;
    while (shift < 40 && (p & ((uintptr_t)1 << shift)) == 0) shift++;
    printf("%s: 2^%d (address %#llx)\n", fact, shift, (unsigned long long)p);
}

/* Every pointer attribute of `p`: the result code, how many bytes the driver wrote (the buffer is filled
 * twice, with 0xee and 0x11, so a written byte equal to the fill still counts) and the value's bytes. */
static void attributes(const char *what, CUdeviceptr p) {
    for (int a = 1; a <= 21; a++) {
        unsigned char v[16], w[16];
        memset(v, 0xee, sizeof v);
        memset(w, 0x11, sizeof w);
        CUresult r = cuPointerGetAttribute(v, a, p);
        cuPointerGetAttribute(w, a, p);
        int width = 0;
        for (int i = 0; i < 16; i++)
            if (v[i] != 0xee || w[i] != 0x11) width = i + 1;
        printf("pointer %s attribute %d: result %d width %d value", what, a, r, width);
        for (int i = width - 1; i >= 0; i--) printf("%s%02x", i == width - 1 ? " 0x" : "", v[i]);
        printf("\n");
    }
}

int main(void) {
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        printf("no GPU\n");
        return 1;
    }
    static const int attrs[] = {14, 19, 21, 22, 23, 24, 25, 26, 27, 28, 29, 42, 43, 45, 46, 51, 52, 53, 54,
                                55, 56, 57, 58, 61, 62, 63, 64, 65, 69, 70, 71, 72, 83, 88, 89, 91, 99,
                                100, 101, 113};
    for (size_t i = 0; i < sizeof attrs / sizeof attrs[0]; i++) {
        int v = -1;
        cuDeviceGetAttribute(&v, attrs[i], dev);
        printf("device attribute %d: %d\n", attrs[i], v);
    }

    /* Managed memory: addresses, alignment, attributes, range attributes. */
    size_t sizes[] = {1, 100, 4096, 1 << 20, 3 << 20};
    CUdeviceptr managed[5];
    for (int i = 0; i < 5; i++) {
        CUresult r = cuMemAllocManaged(&managed[i], sizes[i], 1);
        char fact[64];
        snprintf(fact, sizeof fact, "managed alloc of %zu bytes alignment", sizes[i]);
        if (r) code(fact, r);
        else alignment(fact, managed[i]);
    }
    CUdeviceptr m0;
    code("cuMemAllocManaged size 0", cuMemAllocManaged(&m0, 0, 1));
    code("cuMemAllocManaged flags 3", cuMemAllocManaged(&m0, 64, 3));
    code("cuMemAllocManaged flags SINGLE", cuMemAllocManaged(&m0, 64, 4));
    attributes("managed+16", managed[2] + 16);
    CUdeviceptr base;
    size_t size;
    code("cuMemGetAddressRange managed", cuMemGetAddressRange_v2(&base, &size, managed[2] + 16));
    printf("managed range: base-offset %lld size %zu\n", (long long)(base - managed[2]), size);
    for (int a = 1; a <= 8; a++) {
        int v = -99;
        CUresult r = cuMemRangeGetAttribute(&v, a == 3 ? 4 : 4, a, managed[3], sizes[3]);
        printf("fresh managed range attribute %d: result %d value %d\n", a, r, v);
    }
    CUdeviceptr d;
    cuMemAlloc_v2(&d, 1 << 20);
    code("cuMemPrefetchAsync on device memory", cuMemPrefetchAsync(d, 4096, 0, NULL));
    code("cuMemAdvise on device memory", cuMemAdvise(d, 4096, 1, 0));
    code("cuMemAdvise read-mostly device 7", cuMemAdvise(managed[3], 4096, 1, 7));
    code("cuMemAdvise preferred device 7", cuMemAdvise(managed[3], 4096, 3, 7));
    code("cuMemPrefetchAsync to CPU", cuMemPrefetchAsync(managed[3], 4096, -1, NULL));
    code("cuStreamAttachMemAsync on legacy stream", cuStreamAttachMemAsync(NULL, managed[3], 0, 4));
    code("cuStreamAttachMemAsync interior pointer", cuStreamAttachMemAsync(NULL, managed[3] + 64, 0, 1));
    attributes("device+16", d + 16);

    /* Page-locked host memory. */
    unsigned kinds[] = {0, 1, 2, 4, 7};
    for (int i = 0; i < 5; i++) {
        void *p = NULL;
        CUresult r = cuMemHostAlloc(&p, 10000, kinds[i]);
        char fact[96];
        snprintf(fact, sizeof fact, "cuMemHostAlloc flags %u alignment", kinds[i]);
        if (r) {
            code(fact, r);
            continue;
        }
        alignment(fact, (uintptr_t)p);
        CUdeviceptr dp = 0;
        r = cuMemHostGetDevicePointer_v2(&dp, (char *)p + 8, 0);
        printf("cuMemHostAlloc flags %u: device pointer result %d, device - host = %lld\n", kinds[i], r,
               (long long)(dp - (CUdeviceptr)(uintptr_t)p));
        unsigned f = 0xdead;
        r = cuMemHostGetFlags(&f, (char *)p + 8);
        printf("cuMemHostAlloc flags %u: cuMemHostGetFlags result %d flags %#x\n", kinds[i], r, f);
        snprintf(fact, sizeof fact, "hostalloc(%u)+8", kinds[i]);
        attributes(fact, (CUdeviceptr)(uintptr_t)p + 8);
    }
    void *ah = NULL;
    cuMemAllocHost_v2(&ah, 10000);
    alignment("cuMemAllocHost alignment", (uintptr_t)ah);
    unsigned af = 0xdead;
    code("cuMemHostGetFlags on cuMemAllocHost", cuMemHostGetFlags(&af, ah));
    printf("cuMemAllocHost flags: %#x\n", af);
    CUdeviceptr adp = 0;
    code("cuMemHostGetDevicePointer on cuMemAllocHost", cuMemHostGetDevicePointer_v2(&adp, ah, 0));

    /* Registered memory: unaligned, flags, overlaps. */
    char *block = malloc(5 * 4096 + 300);
    char *r0 = block + 200;
    code("cuMemHostRegister unaligned", cuMemHostRegister_v2(r0, 4 * 4096, 0));
    code("cuMemHostRegister overlapping", cuMemHostRegister_v2(r0 + 64, 64, 0));
    code("cuMemHostRegister sharing a page", cuMemHostRegister_v2(r0 + 4 * 4096 + 8, 16, 0));
    CUdeviceptr rdp = 0;
    code("cuMemHostGetDevicePointer registered", cuMemHostGetDevicePointer_v2(&rdp, r0 + 4, 0));
    printf("registered: device - host = %lld\n", (long long)(rdp - (CUdeviceptr)(uintptr_t)(r0 + 4)));
    unsigned rf = 0xdead;
    code("cuMemHostGetFlags registered", cuMemHostGetFlags(&rf, r0));
    attributes("registered+4", (CUdeviceptr)(uintptr_t)(r0 + 4));
    code("cuMemHostRegister IOMEMORY on malloc", cuMemHostRegister_v2(malloc(8192), 8192, 4));

    /* Arrays and copies. */
    CUDA_ARRAY_DESCRIPTOR ad = {16, 4, 0x20, 1};
    CUarray a2;
    cuArrayCreate_v2(&a2, &ad);
    float row[40];
    for (int i = 0; i < 40; i++) row[i] = (float)i;
    code("cuMemcpyHtoA on 2D array, one row", cuMemcpyHtoA_v2(a2, 0, row, 16 * 4));
    code("cuMemcpyHtoA on 2D array, across rows", cuMemcpyHtoA_v2(a2, 8 * 4, row, 16 * 4));
    float back[64];
    memset(back, 0, sizeof back);
    CUresult r = cuMemcpyAtoH_v2(back, a2, 0, 32 * 4);
    printf("cuMemcpyAtoH on 2D array, two rows: result %d values [16]=%g [17]=%g\n", r, back[16], back[17]);
    CUDA_ARRAY3D_DESCRIPTOR l1 = {8, 0, 3, 0x20, 1, 1 /* LAYERED */};
    CUarray a1l;
    code("cuArray3DCreate 1D layered", cuArray3DCreate_v2(&a1l, &l1));
    CUDA_MEMCPY3D c3;
    memset(&c3, 0, sizeof c3);
    c3.srcMemoryType = 1;
    c3.srcHost = row;
    c3.srcPitch = 8 * 4;
    c3.srcHeight = 1;
    c3.dstMemoryType = 3;
    c3.dstArray = a1l;
    c3.WidthInBytes = 8 * 4;
    c3.Height = 1;
    c3.Depth = 3;
    code("cuMemcpy3D to 1D layered, height 1 depth 3", cuMemcpy3D_v2(&c3));
    c3.Height = 3;
    c3.Depth = 1;
    c3.srcHeight = 3;
    code("cuMemcpy3D to 1D layered, height 3 depth 1", cuMemcpy3D_v2(&c3));
    CUDA_ARRAY3D_DESCRIPTOR v3 = {4, 4, 4, 0x20, 1, 0};
    CUarray a3;
    cuArray3DCreate_v2(&a3, &v3);
    CUDA_ARRAY_DESCRIPTOR ad3;
    code("cuArrayGetDescriptor of a 3D array", cuArrayGetDescriptor_v2(&ad3, a3));
    CUDA_MEMCPY2D c2;
    memset(&c2, 0, sizeof c2);
    c2.srcMemoryType = 3;
    c2.srcArray = a2;
    c2.srcXInBytes = 2;
    c2.dstMemoryType = 1;
    c2.dstHost = back;
    c2.dstPitch = 64;
    c2.WidthInBytes = 8;
    c2.Height = 1;
    code("cuMemcpy2D array x not on an element", cuMemcpy2D_v2(&c2));

    /* Texture and surface objects. */
    CUDA_RESOURCE_DESC res;
    memset(&res, 0, sizeof res);
    res.resType = 0;
    res.res.array.hArray = a2;
    CUDA_TEXTURE_DESC td;
    memset(&td, 0, sizeof td);
    CUtexObject t;
    CUsurfObject s;
    td.addressMode[0] = td.addressMode[1] = 0; /* wrap, unnormalized */
    code("cuTexObjectCreate wrap with unnormalized coordinates", cuTexObjectCreate(&t, &res, &td, NULL));
    printf("first texture object handle: %llu\n", t);
    CUDA_ARRAY_DESCRIPTOR ai = {16, 4, 0x0a, 1};
    CUarray aint;
    cuArrayCreate_v2(&aint, &ai);
    res.res.array.hArray = aint;
    td.filterMode = 1;
    code("cuTexObjectCreate linear filter on int32", cuTexObjectCreate(&t, &res, &td, NULL));
    CUDA_ARRAY_DESCRIPTOR a8 = {16, 4, 0x01, 1};
    CUarray au8;
    cuArrayCreate_v2(&au8, &a8);
    res.res.array.hArray = au8;
    td.flags = 1; /* READ_AS_INTEGER */
    code("cuTexObjectCreate linear filter on u8 read as integer", cuTexObjectCreate(&t, &res, &td, NULL));
    td.flags = 0;
    code("cuTexObjectCreate linear filter on u8 normalized float", cuTexObjectCreate(&t, &res, &td, NULL));
    code("cuSurfObjectCreate without SURFACE_LDST", cuSurfObjectCreate(&s, &res));
    printf("done\n");
    return 0;
}
