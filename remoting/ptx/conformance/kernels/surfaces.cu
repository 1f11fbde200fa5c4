// Surface objects: unformatted loads and stores (suld.b / sust.b) on CUDA arrays, 1D/2D/3D and
// layered, scalar and vector accesses, and the out-of-range modes .zero and .clamp. The surfaces'
// arrays come from the case file (`resource ... surface` and `param surf` directives). The x
// coordinate of a surface access is in bytes.

// dst(x, y) = 3 * src(x, y) + 1 for 32-bit texels.
extern "C" __global__ void surf2d_roundtrip(cudaSurfaceObject_t src, cudaSurfaceObject_t dst, int w, int h)
{
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < w && y < h) {
        unsigned v = surf2Dread<unsigned>(src, x * 4, y);
        surf2Dwrite(v * 3u + 1u, dst, x * 4, y);
    }
}

// 8-byte texels (float2): components swapped and scaled.
extern "C" __global__ void surf1d_roundtrip(cudaSurfaceObject_t src, cudaSurfaceObject_t dst, int w)
{
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    if (x < w) {
        float2 v = surf1Dread<float2>(src, x * 8);
        surf1Dwrite(make_float2(v.y * 2.0f, v.x + 1.0f), dst, x * 8);
    }
}

// 4 x 8-bit texels (uchar4) in a 3D array.
extern "C" __global__ void surf3d_roundtrip(cudaSurfaceObject_t src, cudaSurfaceObject_t dst, int w, int h,
                                            int d)
{
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    int z = blockIdx.z * blockDim.z + threadIdx.z;
    if (x < w && y < h && z < d) {
        uchar4 v = surf3Dread<uchar4>(src, x * 4, y, z);
        surf3Dwrite(make_uchar4(v.w, v.z + 1, v.y ^ 0x5a, v.x), dst, x * 4, y, z);
    }
}

// 16-byte texels (float4) in a layered 2D array: layer z copied to layer (layers - 1 - z).
extern "C" __global__ void surf2d_layered_roundtrip(cudaSurfaceObject_t src, cudaSurfaceObject_t dst, int w,
                                                    int h, int layers)
{
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    int z = blockIdx.z;
    if (x < w && y < h && z < layers) {
        float4 v = surf2DLayeredread<float4>(src, x * 16, y, z);
        surf2DLayeredwrite(make_float4(v.x, -v.y, v.z * 0.5f, v.w), dst, x * 16, y, layers - 1 - z);
    }
}

// Reads over a grid (x0 + i, y0 + j) in texels, larger than the surface, with .zero and .clamp:
// out[2 * (j * nx + i)] (zero) and out[2 * (j * nx + i) + 1] (clamp).
extern "C" __global__ void surf2d_read_oob(cudaSurfaceObject_t s, unsigned* out, int x0, int y0, int nx, int ny)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y * blockDim.y + threadIdx.y;
    if (i < nx && j < ny) {
        int x = (x0 + i) * 4;
        int y = y0 + j;
        out[2 * (j * nx + i)] = surf2Dread<unsigned>(s, x, y, cudaBoundaryModeZero);
        out[2 * (j * nx + i) + 1] = surf2Dread<unsigned>(s, x, y, cudaBoundaryModeClamp);
    }
}

// Writes outside a w x h surface: thread y (< h) writes 1000 + y past the right edge with .clamp
// (it lands on texel (w - 1, y)), and 2000 + y below the bottom edge with .zero (dropped).
extern "C" __global__ void surf2d_write_oob(cudaSurfaceObject_t s, int w, int h)
{
    int y = blockIdx.x * blockDim.x + threadIdx.x;
    if (y < h) {
        surf2Dwrite(1000u + y, s, (w + y) * 4, y, cudaBoundaryModeClamp);
        surf2Dwrite(2000u + y, s, 0, h + y, cudaBoundaryModeZero);
    }
}
