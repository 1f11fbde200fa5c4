// Warp-shuffle reductions. Every warp reduces 32 values with __shfl_down_sync (sum, f32, fixed
// order so exact) and with __shfl_xor_sync (butterfly max and u32 sum, every lane ends with the
// result). Outputs one entry per warp.
extern "C" __global__ void reduce_warp(const float* in, const unsigned* in_u, float* warp_sum,
                                       float* warp_max, unsigned* warp_usum, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n ? in[i] : 0.0f;
    float m = i < n ? in[i] : -3.0e38f;
    unsigned u = i < n ? in_u[i] : 0u;

    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_down_sync(0xffffffffu, v, offset);
    }
    for (int mask = 1; mask < 32; mask <<= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, mask));
        u += __shfl_xor_sync(0xffffffffu, u, mask);
    }

    unsigned lane = threadIdx.x & 31u;
    unsigned warp = i >> 5;
    if (lane == 0) {
        warp_sum[warp] = v;
    }
    // All lanes hold the butterfly result; lane 31 writes it to check that they agree.
    if (lane == 31) {
        warp_max[warp] = m;
        warp_usum[warp] = u;
    }
}
