// Kernels of tests/remote/driver_memory.c (compiled to PTX for compute_75 and kept as a fixture).
extern "C" __global__ void scale_add(float *x, int n, float a, float b) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * a + b;
}

extern "C" __global__ void add_u32(unsigned *x, int n, unsigned v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}

// out[y * w + x] = tex2D(t, x * sx + ox, y * sy + oy): samples a texture on a grid of coordinates.
extern "C" __global__ void sample2d(cudaTextureObject_t t, float *out, int w, int h,
                                    float sx, float ox, float sy, float oy) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < w && y < h) out[y * w + x] = tex2D<float>(t, x * sx + ox, y * sy + oy);
}

// out[i] = tex1Dfetch(t, i): integer fetches from linear memory.
extern "C" __global__ void fetch1d(cudaTextureObject_t t, float *out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = tex1Dfetch<float>(t, i);
}

// Surface read-modify-write: s(x, y) = s(x, y) * 2 + x, on a 2D float surface.
extern "C" __global__ void surf_rmw(cudaSurfaceObject_t s, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < w && y < h) {
        float v = surf2Dread<float>(s, x * 4, y);
        surf2Dwrite(v * 2.0f + (float)x, s, x * 4, y);
    }
}
