// Shared-memory tree reduction (f32), one partial sum per block, no atomics: the addition order
// is fixed, so the per-block results are exact. Uses dynamic shared memory (blockDim.x floats);
// blockDim.x must be a power of two.
extern "C" __global__ void reduce_shared(const float* in, float* block_sums, unsigned n)
{
    extern __shared__ float sdata[];

    unsigned tid = threadIdx.x;
    unsigned i = blockIdx.x * blockDim.x * 2 + tid;
    float v = 0.0f;
    if (i < n) {
        v = in[i];
    }
    if (i + blockDim.x < n) {
        v += in[i + blockDim.x];
    }
    sdata[tid] = v;
    __syncthreads();

    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) {
            sdata[tid] += sdata[tid + s];
        }
        __syncthreads();
    }
    if (tid == 0) {
        block_sums[blockIdx.x] = sdata[0];
    }
}
