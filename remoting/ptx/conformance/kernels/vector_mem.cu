// Vector and read-only memory accesses: float4 / int2 / uint4 loads and stores (ld/st .v2/.v4),
// __ldg and const __restrict__ (ld.global.nc), and a shared-memory float4 transpose.
// Outputs exact.
extern "C" __global__ void vector_mem(const float4* __restrict__ a, const int2* b, const uint4* c,
                                      float4* out_f, int2* out_i, uint4* out_u, unsigned n)
{
    __shared__ float4 stage[128];
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    float4 va = i < n ? a[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    stage[threadIdx.x] = va;
    __syncthreads();
    if (i >= n) {
        return;
    }
    float4 other = stage[(threadIdx.x + 1u) % blockDim.x];
    out_f[i] = make_float4(va.x + other.w, va.y * other.z, va.z - other.y, fmaf(va.w, other.x, 1.0f));

    int2 vb = __ldg(&b[i]);
    out_i[i] = make_int2(vb.x + vb.y, vb.x ^ vb.y);

    uint4 vc = __ldg(&c[(i * 5u) % n]);
    out_u[i] = make_uint4(vc.w, vc.z + 1u, vc.y * 3u, vc.x >> 4);
}
