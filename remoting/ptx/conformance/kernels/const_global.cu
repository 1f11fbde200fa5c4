// Module-scope data: a __constant__ table read at data-dependent indices, initialized
// __device__ globals (scalar and array) read, and a __device__ scratch array written and read
// back across threads of the block (one block of at most 64 threads).
// Output: CONST_RESULTS u32 per thread (floats stored as bits).
#define CONST_RESULTS 4

__constant__ float coeffs[16] = {
    0.5f, -1.0f, 2.25f, 3.0f, -0.125f, 8.0f, 1.5f, -2.5f,
    0.75f, 4.0f, -6.0f, 0.0625f, 10.0f, -0.5f, 1.0f, 7.5f,
};
__constant__ unsigned const_mask = 0x00ff00ffu;
__device__ unsigned dev_scalar = 12345u;
__device__ unsigned dev_table[8] = {3u, 1u, 4u, 1u, 5u, 9u, 2u, 6u};
__device__ unsigned dev_scratch[64];

extern "C" __global__ void const_global(const unsigned* in, unsigned* out, unsigned n)
{
    unsigned t = threadIdx.x;
    unsigned v = t < n ? in[t] : 0u;
    float c = coeffs[v & 15u];
    unsigned* o = out + (size_t)t * CONST_RESULTS;
    dev_scratch[t] = v ^ dev_scalar;
    __syncthreads();
    if (t < n) {
        o[0] = __float_as_uint(c * (float)(v >> 24));
        o[1] = (v & const_mask) + dev_table[(v >> 4) & 7u];
        o[2] = dev_scratch[(t + 1u) % blockDim.x];
        o[3] = dev_scalar + coeffs[(t * 3u) & 15u] * 2.0f;
    }
}
