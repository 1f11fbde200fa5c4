// 256-bin byte histograms: one kernel with atomicAdd straight on global memory, one with
// per-block shared-memory bins merged into global memory. Counts are order-independent.
extern "C" __global__ void histogram_global(const unsigned char* in, unsigned* bins, unsigned n)
{
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        atomicAdd(&bins[in[i]], 1u);
    }
}

extern "C" __global__ void histogram_shared(const unsigned char* in, unsigned* bins, unsigned n)
{
    __shared__ unsigned local[256];
    for (unsigned b = threadIdx.x; b < 256; b += blockDim.x) {
        local[b] = 0;
    }
    __syncthreads();
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        atomicAdd(&local[in[i]], 1u);
    }
    __syncthreads();
    for (unsigned b = threadIdx.x; b < 256; b += blockDim.x) {
        if (local[b] != 0) {
            atomicAdd(&bins[b], local[b]);
        }
    }
}
