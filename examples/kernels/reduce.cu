// Sum reduction of u32 values (wrapping mod 2^32, so the result does not depend on the order in
// which blocks add their partials). Grid-stride loop, warp reduction with __shfl_down_sync, a
// second warp reduction over the per-warp sums, then one atomicAdd per block into *out.
// blockDim.x must be a multiple of 32 (at most 1024); *out must be zeroed before the launch.
extern "C" __global__ void reduce_sum(const unsigned* in, unsigned* out, unsigned n)
{
    __shared__ unsigned warp_sums[32];

    unsigned sum = 0;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        sum += in[i];
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, offset);
    }

    unsigned lane = threadIdx.x & 31u;
    unsigned warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_sums[warp] = sum;
    }
    __syncthreads();

    if (warp == 0) {
        unsigned warps = (blockDim.x + 31u) >> 5;
        sum = lane < warps ? warp_sums[lane] : 0u;
        for (int offset = 16; offset > 0; offset >>= 1) {
            sum += __shfl_down_sync(0xffffffffu, sum, offset);
        }
        if (lane == 0) {
            atomicAdd(out, sum);
        }
    }
}
