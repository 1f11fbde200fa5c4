/* Managed memory, host memory the device maps, arrays, textures and surfaces through the CUDA driver API,
 * for Gleam's tests. No cuda.h exists on CI: the prototypes and structs needed are declared here with the
 * ABI of NVIDIA's driver. The kernels are mem_kernels.ptx (from mem_kernels.cu), whose path is the second
 * argument. Every result is checked against a computation on the CPU; the first failure exits non-zero.
 *
 *   driver_memory managed|host|arrays|textures|pending PTX_FILE
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *CUarray;
typedef unsigned long long CUtexObject, CUsurfObject;

typedef struct {
    size_t Width, Height;
    unsigned Format, NumChannels;
} CUDA_ARRAY_DESCRIPTOR;
typedef struct {
    size_t Width, Height, Depth;
    unsigned Format, NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR;
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
        struct { CUdeviceptr devPtr; unsigned format, numChannels; size_t sizeInBytes; } linear;
        struct { CUdeviceptr devPtr; unsigned format, numChannels; size_t width, height, pitchInBytes; } pitch2D;
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

enum { MEM_HOST = 1, MEM_DEVICE = 2, MEM_ARRAY = 3, MEM_UNIFIED = 4 };
enum { FMT_U16 = 0x02, FMT_U32 = 0x03, FMT_FLOAT = 0x20 };
enum { RES_ARRAY = 0, RES_LINEAR = 2, RES_PITCH2D = 3 };
enum { ADDR_WRAP = 0, ADDR_CLAMP = 1 };
enum { FILTER_POINT = 0, FILTER_LINEAR = 1 };
#define TRSF_NORMALIZED 0x02
#define ARRAY3D_SURFACE_LDST 0x02

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDeviceGetAttribute(int *value, int attrib, CUdevice dev);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned elem);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t bytes);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t bytes);
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream);
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t bytes);
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream stream);
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned flags);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream);
CUresult cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dst, CUstream stream);
CUresult cuMemAdvise(CUdeviceptr p, size_t n, int advice, CUdevice dev);
CUresult cuMemRangeGetAttribute(void *data, size_t size, int attribute, CUdeviceptr p, size_t n);
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr);
CUresult cuMemHostAlloc(void **pp, size_t bytes, unsigned flags);
CUresult cuMemAllocHost_v2(void **pp, size_t bytes);
CUresult cuMemFreeHost(void *p);
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *dptr, void *p, unsigned flags);
CUresult cuMemHostGetFlags(unsigned *flags, void *p);
CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned flags);
CUresult cuMemHostUnregister(void *p);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *f, CUmodule module, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned smem, CUstream stream, void **params, void **extra);
CUresult cuGetErrorName(CUresult error, const char **name);
CUresult cuArrayCreate_v2(CUarray *array, const CUDA_ARRAY_DESCRIPTOR *desc);
CUresult cuArray3DCreate_v2(CUarray *array, const CUDA_ARRAY3D_DESCRIPTOR *desc);
CUresult cuArrayGetDescriptor_v2(CUDA_ARRAY_DESCRIPTOR *desc, CUarray array);
CUresult cuArray3DGetDescriptor_v2(CUDA_ARRAY3D_DESCRIPTOR *desc, CUarray array);
CUresult cuArrayDestroy(CUarray array);
CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *copy);
CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *copy, CUstream stream);
CUresult cuMemcpy3D_v2(const CUDA_MEMCPY3D *copy);
CUresult cuMemcpyHtoA_v2(CUarray dst, size_t offset, const void *src, size_t n);
CUresult cuMemcpyAtoH_v2(void *dst, CUarray src, size_t offset, size_t n);
CUresult cuMemcpyAtoA_v2(CUarray dst, size_t dst_offset, CUarray src, size_t src_offset, size_t n);
CUresult cuMemcpyDtoA_v2(CUarray dst, size_t offset, CUdeviceptr src, size_t n);
CUresult cuMemcpyAtoD_v2(CUdeviceptr dst, CUarray src, size_t offset, size_t n);
CUresult cuTexObjectCreate(CUtexObject *t, const CUDA_RESOURCE_DESC *res, const CUDA_TEXTURE_DESC *tex,
                           const void *view);
CUresult cuTexObjectDestroy(CUtexObject t);
CUresult cuTexObjectGetTextureDesc(CUDA_TEXTURE_DESC *tex, CUtexObject t);
CUresult cuTexObjectGetResourceDesc(CUDA_RESOURCE_DESC *res, CUtexObject t);
CUresult cuSurfObjectCreate(CUsurfObject *s, const CUDA_RESOURCE_DESC *res);
CUresult cuSurfObjectDestroy(CUsurfObject s);

/* floor and fabs without libm (the test links only the driver). */
static double floor_(double v) {
    double t = (double)(long long)v;
    return t > v ? t - 1 : t;
}
static double fabs_(double v) { return v < 0 ? -v : v; }

static const char *name_of(CUresult r) {
    const char *name = "?";
    cuGetErrorName(r, &name);
    return name;
}

#define EXPECT(call, want)                                                                  \
    do {                                                                                    \
        CUresult got_ = (call);                                                             \
        if (got_ != (want)) {                                                               \
            printf("FAIL line %d %s: got %s (%d), want %d\n", __LINE__, #call, name_of(got_), got_, (want)); \
            fflush(stdout);                                                                 \
            exit(10);                                                                       \
        }                                                                                   \
    } while (0)
#define OK(call) EXPECT(call, 0)
#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            printf("FAIL line %d: %s\n", __LINE__, #cond);                          \
            fflush(stdout);                                                          \
            exit(11);                                                                \
        }                                                                            \
    } while (0)

static CUmodule module;

static CUfunction fn(const char *name) {
    CUfunction f;
    OK(cuModuleGetFunction(&f, module, name));
    return f;
}

static void launch1d(const char *name, int n, void **params, CUstream s) {
    OK(cuLaunchKernel(fn(name), (n + 127) / 128, 1, 1, 128, 1, 1, 0, s, params, NULL));
}

static void launch2d(const char *name, int w, int h, void **params) {
    OK(cuLaunchKernel(fn(name), (w + 7) / 8, (h + 7) / 8, 1, 8, 8, 1, 0, NULL, params, NULL));
}

/* ---- managed memory ------------------------------------------------------------------------------ */

static void managed(CUdevice dev) {
    int attr = 0;
    OK(cuDeviceGetAttribute(&attr, 83 /* MANAGED_MEMORY */, dev));
    CHECK(attr == 1);
    OK(cuDeviceGetAttribute(&attr, 89 /* CONCURRENT_MANAGED_ACCESS */, dev));
    printf("concurrent managed access: %d\n", attr);

    const int n = 5000; /* several pages */
    CUdeviceptr m;
    OK(cuMemAllocManaged(&m, n * sizeof(float), 1 /* GLOBAL */));
    float *x = (float *)(uintptr_t)m;
    for (int i = 0; i < n; i++) x[i] = (float)i;
    float a = 2.0f, b = 1.0f;
    int nn = n;
    void *params[] = {&m, &nn, &a, &b};
    launch1d("scale_add", n, params, NULL);
    OK(cuCtxSynchronize());
    for (int i = 0; i < n; i++) CHECK(x[i] == 2.0f * i + 1.0f);
    printf("managed: host writes, kernel, host reads ok\n");

    /* The host updates a few elements; the next launch sees them, the rest is untouched. */
    x[7] = 100.0f;
    x[4999] = -1.0f;
    launch1d("scale_add", n, params, NULL);
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    OK(cuStreamSynchronize(NULL));
    CHECK(x[7] == 201.0f && x[4999] == -1.0f && x[8] == 2.0f * (2.0f * 8 + 1.0f) + 1.0f);

    /* Device-side operations on managed memory: a memset on a stream, copies in both directions. */
    OK(cuMemsetD8Async(m, 0, 16 * sizeof(float), s));
    OK(cuStreamSynchronize(s));
    CHECK(x[0] == 0.0f && x[15] == 0.0f && x[16] != 0.0f);
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, n * sizeof(float)));
    x[20] = 42.0f;
    OK(cuMemcpyHtoD_v2(d, x, n * sizeof(float))); /* managed as a host source */
    float *back = malloc(n * sizeof(float));
    OK(cuMemcpyDtoH_v2(back, d, n * sizeof(float)));
    CHECK(back[20] == 42.0f && back[0] == 0.0f);
    for (int i = 0; i < n; i++) back[i] = 3.0f;
    OK(cuMemcpyHtoD_v2(d, back, n * sizeof(float)));
    OK(cuMemcpyDtoH_v2(x, d, n * sizeof(float))); /* managed as a host destination */
    CHECK(x[0] == 3.0f && x[n - 1] == 3.0f);
    launch1d("scale_add", n, params, NULL); /* the kernel sees what the copy put there */
    OK(cuCtxSynchronize());
    CHECK(x[1234] == 7.0f);
    OK(cuMemcpy((CUdeviceptr)(uintptr_t)back, m, 64)); /* unified copy out of managed memory */
    CHECK(back[3] == 7.0f);
    printf("managed: memsets and copies ok\n");

    /* Pointer and range attributes, advice, prefetches. */
    unsigned int is_managed = 7; /* an int, written whole */
    OK(cuPointerGetAttribute(&is_managed, 8 /* IS_MANAGED */, m + 40));
    CHECK(is_managed == 1);
    /* A device allocation is not managed: the whole int says so (cudart reads it into an uninitialised
     * int; a one-byte answer left garbage above and cudaPointerGetAttributes said "managed"). */
    is_managed = 0xffffffffu;
    OK(cuPointerGetAttribute(&is_managed, 8 /* IS_MANAGED */, d));
    CHECK(is_managed == 0);
    CUdeviceptr range_start = 0;
    OK(cuPointerGetAttribute(&range_start, 11 /* RANGE_START_ADDR */, m + 40));
    CHECK(range_start == m);
    OK(cuMemAdvise(m, n * sizeof(float), 1 /* SET_READ_MOSTLY */, 0));
    int value = -9;
    OK(cuMemRangeGetAttribute(&value, 4, 1 /* READ_MOSTLY */, m, n * sizeof(float)));
    CHECK(value == 1);
    OK(cuMemAdvise(m, 4096, 3 /* SET_PREFERRED_LOCATION */, -1 /* CPU */));
    OK(cuMemRangeGetAttribute(&value, 4, 2 /* PREFERRED_LOCATION */, m, 4096));
    CHECK(value == -1);
    OK(cuMemRangeGetAttribute(&value, 4, 2 /* PREFERRED_LOCATION */, m, n * sizeof(float)));
    CHECK(value == -2);
    OK(cuMemPrefetchAsync(m, n * sizeof(float), 0, s));
    launch1d("scale_add", n, params, s);
    OK(cuMemPrefetchAsync(m, n * sizeof(float), -1, s));
    OK(cuStreamSynchronize(s));
    OK(cuMemRangeGetAttribute(&value, 4, 4 /* LAST_PREFETCH_LOCATION */, m, n * sizeof(float)));
    CHECK(value == -1);
    CHECK(x[1234] == 15.0f);
    EXPECT(cuMemPrefetchAsync(d, 16, 0, s), 1 /* INVALID_VALUE: not managed */);
    EXPECT(cuMemAdvise(m, 16, 77, 0), 1);
    printf("managed: attributes, advice and prefetches ok\n");

    OK(cuMemFree_v2(m));
    OK(cuMemFree_v2(d));
    free(back);
    EXPECT(cuMemAllocManaged(&m, 0, 1), 1);
    EXPECT(cuMemAllocManaged(&m, 64, 3), 1);
    printf("managed ok\n");
}

/* ---- host memory the device maps ---------------------------------------------------------------- */

static void host(CUdevice dev) {
    int attr = 0;
    OK(cuDeviceGetAttribute(&attr, 19 /* CAN_MAP_HOST_MEMORY */, dev));
    CHECK(attr == 1);
    OK(cuDeviceGetAttribute(&attr, 99 /* HOST_REGISTER_SUPPORTED */, dev));
    CHECK(attr == 1);

    const int n = 3000;
    unsigned *p = NULL;
    OK(cuMemHostAlloc((void **)&p, n * sizeof(unsigned), 0x2 /* DEVICEMAP */));
    for (int i = 0; i < n; i++) p[i] = (unsigned)i;
    CUdeviceptr dp;
    OK(cuMemHostGetDevicePointer_v2(&dp, p, 0));
    CHECK(dp == (CUdeviceptr)(uintptr_t)p); /* unified addressing: the same pointer */
    unsigned flags = 0;
    OK(cuMemHostGetFlags(&flags, p + 10));
    CHECK(flags & 0x2);
    unsigned v = 5;
    int nn = n;
    void *params[] = {&dp, &nn, &v};
    launch1d("add_u32", n, params, NULL);
    OK(cuCtxSynchronize());
    for (int i = 0; i < n; i++) CHECK(p[i] == (unsigned)i + 5);
    printf("host: mapped page-locked memory ok\n");

    /* cuMemAllocHost memory is reachable by kernels at its host address too. */
    unsigned *q = NULL;
    OK(cuMemAllocHost_v2((void **)&q, 64 * sizeof(unsigned)));
    memset(q, 0, 64 * sizeof(unsigned));
    CUdeviceptr dq = (CUdeviceptr)(uintptr_t)q;
    int n64 = 64;
    void *qparams[] = {&dq, &n64, &v};
    launch1d("add_u32", 64, qparams, NULL);
    OK(cuCtxSynchronize());
    CHECK(q[0] == 5 && q[63] == 5);
    /* As a staging buffer: copies to and from device memory. */
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, 64 * sizeof(unsigned)));
    OK(cuMemcpyHtoD_v2(d, q, 64 * sizeof(unsigned)));
    for (int i = 0; i < 64; i++) q[i] = 0;
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    OK(cuMemcpyDtoHAsync_v2(q, d, 64 * sizeof(unsigned), s));
    OK(cuStreamSynchronize(s));
    CHECK(q[0] == 5 && q[63] == 5);
    OK(cuMemFreeHost(q));
    OK(cuMemFreeHost(p));
    OK(cuMemFreeHost(NULL)); /* as NVIDIA's driver 580 answers */
    EXPECT(cuMemFreeHost(p), 1);
    printf("host: page-locked staging ok\n");

    /* Registered memory: an unaligned malloc'd buffer, its neighbours untouched. */
    char *block = malloc(5 * 4096 + 300);
    unsigned *r = (unsigned *)(block + 200);
    const int m = 4096;
    block[199] = 0x5a;
    for (int i = 0; i < m; i++) r[i] = 2 * (unsigned)i;
    OK(cuMemHostRegister_v2(r, m * sizeof(unsigned), 0x2 /* DEVICEMAP */));
    EXPECT(cuMemHostRegister_v2(r + 8, 64, 0), 712 /* HOST_MEMORY_ALREADY_REGISTERED */);
    CUdeviceptr dr;
    OK(cuMemHostGetDevicePointer_v2(&dr, r, 0));
    CUdeviceptr dr4;
    OK(cuMemHostGetDevicePointer_v2(&dr4, r + 4, 0));
    CHECK(dr4 == dr + 16);
    void *host_of = NULL;
    OK(cuPointerGetAttribute(&host_of, 4 /* HOST_POINTER */, dr));
    CHECK(host_of == r);
    int nm = m;
    void *rparams[] = {&dr, &nm, &v};
    launch1d("add_u32", m, rparams, NULL);
    OK(cuCtxSynchronize());
    for (int i = 0; i < m; i++) CHECK(r[i] == 2 * (unsigned)i + 5);
    CHECK(block[199] == 0x5a);
    r[100] = 7; /* a host write the next kernel sees */
    launch1d("add_u32", m, rparams, NULL);
    OK(cuCtxSynchronize());
    CHECK(r[100] == 12 && r[101] == 2 * 101 + 10);
    OK(cuMemHostUnregister(r));
    EXPECT(cuMemHostUnregister(r), 713 /* HOST_MEMORY_NOT_REGISTERED */);
    r[0] += 1; /* plain memory again */
    CHECK(r[0] == 11 && r[m - 1] == 2 * (unsigned)(m - 1) + 10);
    free(block);
    printf("host ok\n");
}

/* ---- arrays and copies --------------------------------------------------------------------------- */

static void arrays(void) {
    /* A 2D float array filled from a pitched host image (rows padded), read back in a sub-rectangle. */
    enum { W = 13, H = 7, HP = 16 };
    float img[H][HP];
    for (int y = 0; y < H; y++)
        for (int x = 0; x < HP; x++) img[y][x] = x < W ? (float)(100 * y + x) : -1.0f;
    CUDA_ARRAY_DESCRIPTOR ad = {W, H, FMT_FLOAT, 1};
    CUarray a;
    OK(cuArrayCreate_v2(&a, &ad));
    CUDA_ARRAY_DESCRIPTOR got;
    OK(cuArrayGetDescriptor_v2(&got, a));
    CHECK(got.Width == W && got.Height == H && got.Format == FMT_FLOAT && got.NumChannels == 1);
    CUDA_MEMCPY2D c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = MEM_HOST;
    c.srcHost = img;
    c.srcPitch = sizeof img[0];
    c.dstMemoryType = MEM_ARRAY;
    c.dstArray = a;
    c.WidthInBytes = W * sizeof(float);
    c.Height = H;
    OK(cuMemcpy2D_v2(&c));
    float sub[3][4];
    memset(&c, 0, sizeof c);
    c.srcMemoryType = MEM_ARRAY;
    c.srcArray = a;
    c.srcXInBytes = 5 * sizeof(float);
    c.srcY = 2;
    c.dstMemoryType = MEM_HOST;
    c.dstHost = sub;
    c.dstPitch = sizeof sub[0];
    c.WidthInBytes = 4 * sizeof(float);
    c.Height = 3;
    OK(cuMemcpy2D_v2(&c));
    for (int y = 0; y < 3; y++)
        for (int x = 0; x < 4; x++) CHECK(sub[y][x] == (float)(100 * (y + 2) + x + 5));
    /* An offset inside an element is accepted by NVIDIA's driver 580, and a copy past the array's row
     * crashes it (both recorded on the H200): Gleam refuses the latter (remoting/protocol/src/copy.rs). */

    /* Array to pitched device memory and back to the host, asynchronously on a stream. */
    CUdeviceptr pitched;
    size_t pitch;
    OK(cuMemAllocPitch_v2(&pitched, &pitch, W * sizeof(float), H, 4));
    CHECK(pitch >= W * sizeof(float));
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    memset(&c, 0, sizeof c);
    c.srcMemoryType = MEM_ARRAY;
    c.srcArray = a;
    c.dstMemoryType = MEM_DEVICE;
    c.dstDevice = pitched;
    c.dstPitch = pitch;
    c.WidthInBytes = W * sizeof(float);
    c.Height = H;
    OK(cuMemcpy2DAsync_v2(&c, s));
    float round[H][W];
    memset(&c, 0, sizeof c);
    c.srcMemoryType = MEM_UNIFIED;
    c.srcDevice = pitched;
    c.srcPitch = pitch;
    c.dstMemoryType = MEM_UNIFIED;
    c.dstDevice = (CUdeviceptr)(uintptr_t)round;
    c.dstPitch = sizeof round[0];
    c.WidthInBytes = W * sizeof(float);
    c.Height = H;
    OK(cuMemcpy2DAsync_v2(&c, s));
    OK(cuStreamSynchronize(s));
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) CHECK(round[y][x] == img[y][x]);
    printf("arrays: 2D copies ok\n");

    /* A 3D array of u16: host -> array -> device -> host, through cuMemcpy3D. */
    enum { X = 5, Y = 4, Z = 3 };
    unsigned short vol[Z][Y][X], vol_back[Z][Y][X];
    for (int z = 0; z < Z; z++)
        for (int y = 0; y < Y; y++)
            for (int x = 0; x < X; x++) vol[z][y][x] = (unsigned short)(1000 * z + 10 * y + x);
    CUDA_ARRAY3D_DESCRIPTOR d3 = {X, Y, Z, FMT_U16, 1, 0};
    CUarray a3;
    OK(cuArray3DCreate_v2(&a3, &d3));
    CUDA_ARRAY3D_DESCRIPTOR got3;
    OK(cuArray3DGetDescriptor_v2(&got3, a3));
    CHECK(got3.Width == X && got3.Height == Y && got3.Depth == Z && got3.Format == FMT_U16);
    CUDA_MEMCPY3D c3;
    memset(&c3, 0, sizeof c3);
    c3.srcMemoryType = MEM_HOST;
    c3.srcHost = vol;
    c3.srcPitch = X * 2;
    c3.srcHeight = Y;
    c3.dstMemoryType = MEM_ARRAY;
    c3.dstArray = a3;
    c3.WidthInBytes = X * 2;
    c3.Height = Y;
    c3.Depth = Z;
    OK(cuMemcpy3D_v2(&c3));
    CUdeviceptr lin;
    OK(cuMemAlloc_v2(&lin, sizeof vol));
    memset(&c3, 0, sizeof c3);
    c3.srcMemoryType = MEM_ARRAY;
    c3.srcArray = a3;
    c3.dstMemoryType = MEM_DEVICE;
    c3.dstDevice = lin;
    c3.dstPitch = X * 2;
    c3.dstHeight = Y;
    c3.WidthInBytes = X * 2;
    c3.Height = Y;
    c3.Depth = Z;
    OK(cuMemcpy3D_v2(&c3));
    OK(cuMemcpyDtoH_v2(vol_back, lin, sizeof vol));
    CHECK(memcmp(vol, vol_back, sizeof vol) == 0);
    /* One slice out of the middle, straight to the host. */
    unsigned short slice[Y][X];
    memset(&c3, 0, sizeof c3);
    c3.srcMemoryType = MEM_ARRAY;
    c3.srcArray = a3;
    c3.srcZ = 1;
    c3.dstMemoryType = MEM_HOST;
    c3.dstHost = slice;
    c3.dstPitch = X * 2;
    c3.dstHeight = Y;
    c3.WidthInBytes = X * 2;
    c3.Height = Y;
    c3.Depth = 1;
    OK(cuMemcpy3D_v2(&c3));
    CHECK(slice[2][3] == 1023);
    printf("arrays: 3D copies ok\n");

    /* 1D arrays and the array copies. */
    CUDA_ARRAY_DESCRIPTOR d1 = {64, 0, FMT_U32, 1};
    CUarray a1, b1;
    OK(cuArrayCreate_v2(&a1, &d1));
    OK(cuArrayCreate_v2(&b1, &d1));
    unsigned words[64], words_back[64];
    for (int i = 0; i < 64; i++) words[i] = 0xabc00000u + i;
    OK(cuMemcpyHtoA_v2(a1, 0, words, sizeof words));
    OK(cuMemcpyAtoA_v2(b1, 16, a1, 0, 32 * 4));
    OK(cuMemcpyAtoH_v2(words_back, b1, 16, 32 * 4));
    CHECK(memcmp(words, words_back, 32 * 4) == 0);
    CUdeviceptr dw;
    OK(cuMemAlloc_v2(&dw, sizeof words));
    OK(cuMemcpyAtoD_v2(dw, a1, 8 * 4, 16 * 4));
    OK(cuMemcpyDtoA_v2(b1, 0, dw, 16 * 4));
    OK(cuMemcpyAtoH_v2(words_back, b1, 0, 16 * 4));
    CHECK(words_back[0] == words[8] && words_back[15] == words[23]);
    EXPECT(cuMemcpyHtoA_v2(a1, 60 * 4, words, 8 * 4), 1); /* past the end */
    OK(cuArrayDestroy(b1));
    EXPECT(cuArrayDestroy(b1), 400 /* INVALID_HANDLE */);
    printf("arrays: 1D copies ok\n");

    OK(cuArrayDestroy(a1));
    OK(cuArrayDestroy(a3));
    OK(cuArrayDestroy(a));
    OK(cuMemFree_v2(pitched));
    OK(cuMemFree_v2(lin));
    OK(cuMemFree_v2(dw));
    printf("arrays ok\n");
}

/* ---- textures and surfaces --------------------------------------------------------------------- */

enum { TW = 16, TH = 8 };

static float texel(const float *t, int x, int y) {
    x = x < 0 ? 0 : x >= TW ? TW - 1 : x;
    y = y < 0 ? 0 : y >= TH ? TH - 1 : y;
    return t[y * TW + x];
}

/* CUDA's bilinear filtering with clamping, unnormalized coordinates: taps at x - 0.5, weights in 1/256
 * steps (the test's coordinates fall on such steps, so the weights are exact). */
static float bilinear(const float *t, float u, float v) {
    double xb = u - 0.5, yb = v - 0.5;
    double x0 = floor_(xb), y0 = floor_(yb);
    double a = xb - x0, b = yb - y0;
    int i = (int)x0, j = (int)y0;
    double r = (1 - a) * (1 - b) * texel(t, i, j) + a * (1 - b) * texel(t, i + 1, j) +
               (1 - a) * b * texel(t, i, j + 1) + a * b * texel(t, i + 1, j + 1);
    return (float)r;
}

static void textures(void) {
    float t[TH * TW];
    for (int y = 0; y < TH; y++)
        for (int x = 0; x < TW; x++) t[y * TW + x] = (float)(x * x) + 3.0f * y;
    CUDA_ARRAY_DESCRIPTOR ad = {TW, TH, FMT_FLOAT, 1};
    CUarray a;
    OK(cuArrayCreate_v2(&a, &ad));
    CUDA_MEMCPY2D c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = MEM_HOST;
    c.srcHost = t;
    c.srcPitch = TW * sizeof(float);
    c.dstMemoryType = MEM_ARRAY;
    c.dstArray = a;
    c.WidthInBytes = TW * sizeof(float);
    c.Height = TH;
    OK(cuMemcpy2D_v2(&c));

    CUDA_RESOURCE_DESC res;
    memset(&res, 0, sizeof res);
    res.resType = RES_ARRAY;
    res.res.array.hArray = a;
    CUDA_TEXTURE_DESC td;
    memset(&td, 0, sizeof td);
    td.addressMode[0] = td.addressMode[1] = ADDR_CLAMP;
    td.filterMode = FILTER_LINEAR;
    CUtexObject lin;
    OK(cuTexObjectCreate(&lin, &res, &td, NULL));
    CUDA_TEXTURE_DESC td_back;
    OK(cuTexObjectGetTextureDesc(&td_back, lin));
    CHECK(td_back.filterMode == FILTER_LINEAR && td_back.addressMode[1] == ADDR_CLAMP);
    CUDA_RESOURCE_DESC res_back;
    OK(cuTexObjectGetResourceDesc(&res_back, lin));
    CHECK(res_back.resType == RES_ARRAY && res_back.res.array.hArray == a);

    /* Sample a 20 x 10 grid reaching past the texture's edges (clamped). */
    enum { SW = 20, SH = 10 };
    CUdeviceptr out;
    OK(cuMemAlloc_v2(&out, SW * SH * sizeof(float)));
    int sw = SW, sh = SH;
    float sx = 0.75f, ox = 0.25f, sy = 0.875f, oy = 0.125f;
    void *params[] = {&lin, &out, &sw, &sh, &sx, &ox, &sy, &oy};
    launch2d("sample2d", SW, SH, params);
    float got[SH][SW];
    OK(cuMemcpyDtoH_v2(got, out, sizeof got));
    double worst = 0;
    for (int y = 0; y < SH; y++)
        for (int x = 0; x < SW; x++) {
            float want = bilinear(t, x * sx + ox, y * sy + oy);
            double err = fabs_(got[y][x] - want) / (fabs_(want) + 1.0);
            if (err > worst) worst = err;
            if (err > 1e-5) {
                printf("FAIL linear sample (%d, %d): got %.6f, want %.6f\n", x, y, got[y][x], want);
                exit(12);
            }
        }
    printf("textures: bilinear filtering matches the CPU reference (worst relative error %.2g)\n", worst);

    /* Point sampling with normalized, wrapped coordinates. */
    td.addressMode[0] = td.addressMode[1] = ADDR_WRAP;
    td.filterMode = FILTER_POINT;
    td.flags = TRSF_NORMALIZED;
    CUtexObject wrap;
    OK(cuTexObjectCreate(&wrap, &res, &td, NULL));
    float nsx = 1.5f / TW, nox = 0.1f / TW, nsy = 1.25f / TH, noy = 0.5f / TH;
    void *wparams[] = {&wrap, &out, &sw, &sh, &nsx, &nox, &nsy, &noy};
    launch2d("sample2d", SW, SH, wparams);
    OK(cuMemcpyDtoH_v2(got, out, sizeof got));
    for (int y = 0; y < SH; y++)
        for (int x = 0; x < SW; x++) {
            float u = x * nsx + nox, v = y * nsy + noy;
            int i = ((int)floor_(u * TW) % TW + TW) % TW, j = ((int)floor_(v * TH) % TH + TH) % TH;
            CHECK(got[y][x] == t[j * TW + i]);
        }
    printf("textures: wrapped point sampling ok\n");

    /* tex1Dfetch from linear device memory (aligned to the texture alignment). */
    int align = 0;
    OK(cuDeviceGetAttribute(&align, 14 /* TEXTURE_ALIGNMENT */, 0));
    CUdeviceptr raw;
    OK(cuMemAlloc_v2(&raw, 64 * sizeof(float) + align));
    CUdeviceptr base = (raw + align - 1) / align * align;
    float ramp[64];
    for (int i = 0; i < 64; i++) ramp[i] = 0.5f * i;
    OK(cuMemcpyHtoD_v2(base, ramp, sizeof ramp));
    memset(&res, 0, sizeof res);
    res.resType = RES_LINEAR;
    res.res.linear.devPtr = base;
    res.res.linear.format = FMT_FLOAT;
    res.res.linear.numChannels = 1;
    res.res.linear.sizeInBytes = sizeof ramp;
    memset(&td, 0, sizeof td);
    CUtexObject fetch;
    OK(cuTexObjectCreate(&fetch, &res, &td, NULL));
    int n64 = 64;
    void *fparams[] = {&fetch, &out, &n64};
    launch1d("fetch1d", 64, fparams, NULL);
    float fetched[64];
    OK(cuMemcpyDtoH_v2(fetched, out, sizeof fetched));
    for (int i = 0; i < 64; i++) CHECK(fetched[i] == ramp[i]);
    res.res.linear.devPtr = base + 4; /* misaligned */
    EXPECT(cuTexObjectCreate(&fetch, &res, &td, NULL), 1);
    printf("textures: linear memory fetches ok\n");

    /* A surface: read, modify, write in place. */
    enum { SWD = 8, SHT = 4 };
    CUDA_ARRAY3D_DESCRIPTOR sd = {SWD, SHT, 0, FMT_FLOAT, 1, ARRAY3D_SURFACE_LDST};
    CUarray sa;
    OK(cuArray3DCreate_v2(&sa, &sd));
    float simg[SHT][SWD];
    for (int y = 0; y < SHT; y++)
        for (int x = 0; x < SWD; x++) simg[y][x] = (float)(10 * y + x);
    memset(&c, 0, sizeof c);
    c.srcMemoryType = MEM_HOST;
    c.srcHost = simg;
    c.srcPitch = sizeof simg[0];
    c.dstMemoryType = MEM_ARRAY;
    c.dstArray = sa;
    c.WidthInBytes = sizeof simg[0];
    c.Height = SHT;
    OK(cuMemcpy2D_v2(&c));
    memset(&res, 0, sizeof res);
    res.resType = RES_ARRAY;
    res.res.array.hArray = sa;
    CUsurfObject surf;
    OK(cuSurfObjectCreate(&surf, &res));
    int swi = SWD, shi = SHT;
    void *sparams[] = {&surf, &swi, &shi};
    launch2d("surf_rmw", SWD, SHT, sparams);
    float sback[SHT][SWD];
    memset(&c, 0, sizeof c);
    c.srcMemoryType = MEM_ARRAY;
    c.srcArray = sa;
    c.dstMemoryType = MEM_HOST;
    c.dstHost = sback;
    c.dstPitch = sizeof sback[0];
    c.WidthInBytes = sizeof sback[0];
    c.Height = SHT;
    OK(cuMemcpy2D_v2(&c));
    for (int y = 0; y < SHT; y++)
        for (int x = 0; x < SWD; x++) CHECK(sback[y][x] == simg[y][x] * 2.0f + x);
    res.res.array.hArray = a; /* created without SURFACE_LDST: NVIDIA's driver 580 makes the surface anyway */
    CUsurfObject plain_surf = 0;
    OK(cuSurfObjectCreate(&plain_surf, &res));
    OK(cuSurfObjectDestroy(plain_surf));
    printf("textures: surface read-modify-write ok\n");

    OK(cuTexObjectDestroy(lin)); /* a second destroy: NVIDIA's driver 580 answers success, Gleam 400 */
    OK(cuTexObjectDestroy(wrap));
    OK(cuTexObjectDestroy(fetch));
    OK(cuSurfObjectDestroy(surf));
    OK(cuArrayDestroy(sa));
    OK(cuArrayDestroy(a));
    OK(cuMemFree_v2(out));
    OK(cuMemFree_v2(raw));
    printf("textures ok\n");
}

/* ---- timings (not a test: figures for the report) ------------------------------------------------ */

#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void bench(void) {
    const int n = 16 << 20 >> 2; /* 16 MiB of floats */
    CUdeviceptr m;
    OK(cuMemAllocManaged(&m, (size_t)n * 4, 1));
    float *x = (float *)(uintptr_t)m;
    double t0 = now();
    for (int i = 0; i < n; i++) x[i] = 1.0f;
    double t1 = now();
    /* A one-thread kernel: what is timed is moving the data, not the emulator's kernels. */
    float a = 1.0f, b = 1.0f;
    int nn = 1;
    void *params[] = {&m, &nn, &a, &b};
    launch1d("scale_add", 1, params, NULL);
    OK(cuCtxSynchronize());
    double t2 = now();
    double sum = 0;
    for (int i = 0; i < n; i++) sum += x[i];
    double t3 = now();
    x[12345] = 5.0f;
    launch1d("scale_add", 1, params, NULL);
    OK(cuCtxSynchronize());
    float one = x[12345];
    double t4 = now();
    printf("managed 16 MiB: host writes %.1f ms, launch+sync (push) %.1f ms, host reads %.1f ms (sum %.0f), "
           "one element written, launch, sync, read %.1f ms (%g)\n",
           (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, sum, (t4 - t3) * 1e3, one);
    OK(cuMemFree_v2(m));

    /* Staging through page-locked memory vs pageable memory: 4 MiB up, a kernel, 4 MiB down. */
    const size_t bytes = 4 << 20;
    CUdeviceptr d;
    OK(cuMemAlloc_v2(&d, bytes));
    CUstream s;
    OK(cuStreamCreate(&s, 0));
    for (int pinned = 0; pinned < 2; pinned++) {
        float *up, *down;
        if (pinned) {
            OK(cuMemHostAlloc((void **)&up, bytes, 0));
            OK(cuMemHostAlloc((void **)&down, bytes, 0));
        } else {
            up = malloc(bytes);
            down = malloc(bytes);
        }
        int k = (int)(bytes / 4), one = 1;
        void *p2[] = {&d, &one, &a, &b};
        double best = 1e9;
        for (int it = 0; it < 5; it++) {
            double s0 = now();
            for (int i = 0; i < k; i++) up[i] = (float)(i + it);
            OK(cuMemcpyHtoDAsync_v2(d, up, bytes, s));
            launch1d("scale_add", 1, p2, s);
            OK(cuMemcpyDtoHAsync_v2(down, d, bytes, s));
            OK(cuStreamSynchronize(s));
            double acc = 0;
            for (int i = 0; i < k; i++) acc += down[i];
            double s1 = now();
            if (s1 - s0 < best) best = s1 - s0;
            CHECK(acc > 0);
        }
        printf("staging 4 MiB up + one-thread kernel + 4 MiB down, %s: best %.1f ms per round\n",
               pinned ? "page-locked (mirrored)" : "pageable", best * 1e3);
        if (pinned) {
            OK(cuMemFreeHost(up));
            OK(cuMemFreeHost(down));
        } else {
            free(up);
            free(down);
        }
    }
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("FAIL cannot open %s\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc(n + 1);
    if (fread(buf, 1, n, f) != (size_t)n) exit(2);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* Mirrored memory freed while an earlier asynchronous call's error is pending (fuzz finding
 * device-memory-not-returned): the peer's copies must be freed all the same, and the error must still
 * reach the application at its next synchronization. */
static void pending(void) {
    size_t free0 = 0, free1 = 0, total = 0;
    OK(cuCtxSynchronize());
    OK(cuMemGetInfo_v2(&free0, &total));
    void *pinned = NULL, *mapped = NULL;
    CUdeviceptr managed_ptr = 0;
    OK(cuMemAllocHost_v2(&pinned, 57521));
    OK(cuMemHostAlloc(&mapped, 5000, 0x2 /* DEVICEMAP */));
    OK(cuMemAllocManaged(&managed_ptr, 4096, 1 /* GLOBAL */));
    memset(pinned, 7, 57521);
    /* Copies from and to NULL: refused by the peer, after the calls returned. */
    CUresult first = cuMemcpyDtoDAsync_v2(0, 0, 64, NULL);
    CUresult second = cuMemsetD8Async(0, 1, 64, NULL);
    printf("pending: async calls on NULL returned %d and %d\n", first, second);
    OK(cuMemFreeHost(pinned));
    OK(cuMemFreeHost(mapped));
    OK(cuMemFree_v2(managed_ptr));
    CUresult reported = cuCtxSynchronize();
    printf("pending: next synchronization returned %d\n", reported);
    if (first == 0 && second == 0) CHECK(reported != 0); /* the error is still the application's */
    OK(cuCtxSynchronize());
    OK(cuMemGetInfo_v2(&free1, &total));
    printf("pending: free before %zu, after %zu\n", free0, free1);
    CHECK(free1 == free0);
    printf("pending: mirrored memory freed under a pending error ok\n");
}

int main(int argc, char **argv) {
    if (argc < 3) {
        printf("usage: driver_memory managed|host|arrays|textures PTX_FILE\n");
        return 2;
    }
    CUdevice dev;
    CUcontext ctx;
    OK(cuInit(0));
    OK(cuDeviceGet(&dev, 0));
    OK(cuDevicePrimaryCtxRetain(&ctx, dev));
    OK(cuCtxSetCurrent(ctx));
    char *ptx = read_file(argv[2]);
    OK(cuModuleLoadData(&module, ptx));
    const char *mode = argv[1];
    if (!strcmp(mode, "managed")) managed(dev);
    else if (!strcmp(mode, "host")) host(dev);
    else if (!strcmp(mode, "arrays")) arrays();
    else if (!strcmp(mode, "textures")) textures();
    else if (!strcmp(mode, "bench")) bench();
    else if (!strcmp(mode, "pending")) pending();
    else {
        printf("unknown mode %s\n", mode);
        return 2;
    }
    free(ptx);
    printf("all ok\n");
    return 0;
}
