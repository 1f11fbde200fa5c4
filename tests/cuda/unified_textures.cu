// Managed memory, mapped host memory, CUDA arrays, a texture with linear filtering and a surface, through
// the runtime API (cudaMallocManaged, cudaHostAlloc, cudaHostRegister, cudaMallocArray, cudaMemcpy2D*,
// cudaCreateTextureObject, cudaCreateSurfaceObject). Results are checked against the CPU.
#include "check.h"

__global__ void scale(float *x, int n, float a) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a;
}

__global__ void sample(cudaTextureObject_t t, float *out, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    // Halfway between texels along x, a quarter along y: bilinear weights 1/2 and 1/4.
    if (x < w && y < h) out[y * w + x] = tex2D<float>(t, x + 1.0f, y + 0.75f);
}

__global__ void invert(cudaSurfaceObject_t s, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < w && y < h) {
        uchar4 v = surf2Dread<uchar4>(s, x * 4, y);
        surf2Dwrite(make_uchar4(255 - v.x, 255 - v.y, 255 - v.z, v.w), s, x * 4, y);
    }
}

static float at(const float *t, int w, int h, int x, int y) {
    x = x < 0 ? 0 : x >= w ? w - 1 : x;
    y = y < 0 ? 0 : y >= h ? h - 1 : y;
    return t[y * w + x];
}

int main() {
    // Managed memory: written by the host, scaled by a kernel, read by the host.
    const int n = 10000;
    float *m = nullptr;
    CUDA_OK(cudaMallocManaged(&m, n * sizeof(float)));
    for (int i = 0; i < n; i++) m[i] = (float)i;
    scale<<<(n + 255) / 256, 256>>>(m, n, 3.0f);
    CUDA_OK(cudaDeviceSynchronize());
    int bad = 0;
    for (int i = 0; i < n; i++) bad += m[i] != 3.0f * i;
    EXPECT(bad == 0);
    cudaPointerAttributes attr;
    CUDA_OK(cudaPointerGetAttributes(&attr, m));
    EXPECT(attr.type == cudaMemoryTypeManaged);
    std::printf("managed: %d mismatches, type %d\n", bad, (int)attr.type);
    CUDA_OK(cudaFree(m));

    // Mapped page-locked memory, written by a kernel through its device pointer.
    float *h = nullptr, *hd = nullptr;
    CUDA_OK(cudaHostAlloc(&h, 256 * sizeof(float), cudaHostAllocMapped));
    for (int i = 0; i < 256; i++) h[i] = 1.0f;
    CUDA_OK(cudaHostGetDevicePointer(&hd, h, 0));
    scale<<<1, 256>>>(hd, 256, 5.0f);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT(h[0] == 5.0f && h[255] == 5.0f);
    CUDA_OK(cudaFreeHost(h));
    float *reg = (float *)std::malloc(3000 * sizeof(float)), *regd = nullptr;
    for (int i = 0; i < 3000; i++) reg[i] = 2.0f;
    CUDA_OK(cudaHostRegister(reg, 3000 * sizeof(float), cudaHostRegisterMapped));
    CUDA_OK(cudaHostGetDevicePointer(&regd, reg, 0));
    scale<<<(3000 + 255) / 256, 256>>>(regd, 3000, 0.5f);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT(reg[0] == 1.0f && reg[2999] == 1.0f);
    CUDA_OK(cudaHostUnregister(reg));
    std::free(reg);
    std::printf("host memory: mapped and registered ok\n");

    // A float texture with linear filtering.
    const int W = 12, H = 6;
    float img[H][W];
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) img[y][x] = (float)(x * x) + 10.0f * y;
    cudaChannelFormatDesc fdesc = cudaCreateChannelDesc<float>();
    cudaArray_t a = nullptr;
    CUDA_OK(cudaMallocArray(&a, &fdesc, W, H));
    CUDA_OK(cudaMemcpy2DToArray(a, 0, 0, img, sizeof img[0], sizeof img[0], H, cudaMemcpyHostToDevice));
    cudaResourceDesc res = {};
    res.resType = cudaResourceTypeArray;
    res.res.array.array = a;
    cudaTextureDesc td = {};
    td.addressMode[0] = td.addressMode[1] = cudaAddressModeClamp;
    td.filterMode = cudaFilterModeLinear;
    td.readMode = cudaReadModeElementType;
    cudaTextureObject_t t = 0;
    CUDA_OK(cudaCreateTextureObject(&t, &res, &td, nullptr));
    float *out = nullptr;
    CUDA_OK(cudaMalloc(&out, W * H * sizeof(float)));
    sample<<<dim3(2, 1), dim3(8, 8)>>>(t, out, W, H);
    float got[H][W];
    CUDA_OK(cudaMemcpy(got, out, sizeof got, cudaMemcpyDeviceToHost));
    int off = 0;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            // Taps at x + 0.5 and x + 1.5 (weight 1/2), y + 0.25 and y + 1.25 (weights 3/4, 1/4).
            float want = 0.375f * at(&img[0][0], W, H, x, y) + 0.375f * at(&img[0][0], W, H, x + 1, y) +
                         0.125f * at(&img[0][0], W, H, x, y + 1) + 0.125f * at(&img[0][0], W, H, x + 1, y + 1);
            float err = got[y][x] - want;
            if (err > 1e-3f || err < -1e-3f) off++;
        }
    EXPECT(off == 0);
    std::printf("texture: %d samples off the CPU reference\n", off);
    CUDA_OK(cudaDestroyTextureObject(t));

    // A uchar4 surface, inverted in place.
    cudaChannelFormatDesc cdesc = cudaCreateChannelDesc<uchar4>();
    cudaArray_t sa = nullptr;
    CUDA_OK(cudaMallocArray(&sa, &cdesc, 16, 4, cudaArraySurfaceLoadStore));
    unsigned char px[4][16][4];
    for (int y = 0; y < 4; y++)
        for (int x = 0; x < 16; x++)
            for (int c = 0; c < 4; c++) px[y][x][c] = (unsigned char)(16 * y + x + 60 * c);
    CUDA_OK(cudaMemcpy2DToArray(sa, 0, 0, px, sizeof px[0], sizeof px[0], 4, cudaMemcpyHostToDevice));
    res.res.array.array = sa;
    cudaSurfaceObject_t s = 0;
    CUDA_OK(cudaCreateSurfaceObject(&s, &res));
    invert<<<dim3(2, 1), dim3(8, 8)>>>(s, 16, 4);
    unsigned char back[4][16][4];
    CUDA_OK(cudaMemcpy2DFromArray(back, sizeof back[0], sa, 0, 0, sizeof back[0], 4, cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (int y = 0; y < 4; y++)
        for (int x = 0; x < 16; x++)
            for (int c = 0; c < 4; c++) wrong += back[y][x][c] != (c == 3 ? px[y][x][c] : 255 - px[y][x][c]);
    EXPECT(wrong == 0);
    std::printf("surface: %d wrong bytes\n", wrong);
    CUDA_OK(cudaDestroySurfaceObject(s));
    CUDA_OK(cudaFreeArray(sa));
    CUDA_OK(cudaFreeArray(a));
    CUDA_OK(cudaFree(out));
    return finish("unified_textures");
}
