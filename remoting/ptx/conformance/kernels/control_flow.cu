// Control-flow coverage: divergent data-dependent loops with break/continue, a dense switch (nvcc
// may emit a jump table, brx.idx), nested divergence with __syncwarp, early exits, a loop with a
// warp-uniform trip count around __syncthreads, and __threadfence. Input: random u32.
// Output: CF_RESULTS u32 per thread.
#define CF_RESULTS 6

__device__ __forceinline__ unsigned collatz_steps(unsigned v)
{
    unsigned steps = 0;
    unsigned long long x = (v & 0xffffu) | 1u;
    while (x != 1ull && steps < 500u) {
        x = (x & 1ull) ? 3ull * x + 1ull : x >> 1;
        ++steps;
    }
    return steps;
}

extern "C" __global__ void control_flow(const unsigned* in, unsigned* out, unsigned n)
{
    __shared__ unsigned tile[256];
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned v = i < n ? in[i] : 0u;
    unsigned* o = out + (size_t)i * CF_RESULTS;

    // Uniform loop with a barrier inside: rotate the tile a data-independent number of times.
    tile[threadIdx.x] = v;
    __syncthreads();
    unsigned rotated = v;
    for (unsigned r = 1; r <= 3; ++r) {
        rotated = tile[(threadIdx.x + r * 7u) % blockDim.x];
        __syncthreads();
        tile[threadIdx.x] = rotated ^ r;
        __syncthreads();
    }

    if (i >= n) {
        return;  // early exit after the last barrier
    }

    // Data-dependent trip count.
    unsigned steps = collatz_steps(v);

    // break/continue in a divergent loop.
    unsigned acc = 0;
    for (unsigned k = 0; k < 64u; ++k) {
        unsigned bit = (v >> (k & 31u)) & 1u;
        if (bit == 0u) {
            continue;
        }
        acc += k * k;
        if (acc > (v >> 20)) {
            break;
        }
    }

    // Dense switch.
    unsigned sw;
    switch (v % 11u) {
    case 0: sw = v + 1u; break;
    case 1: sw = v * 3u; break;
    case 2: sw = v ^ 0xdeadbeefu; break;
    case 3: sw = v >> 3; break;
    case 4: sw = ~v; break;
    case 5: sw = v * v; break;
    case 6: sw = v - 12345u; break;
    case 7: sw = (v << 5) | (v >> 27); break;
    case 8: sw = v & 0xff00ff00u; break;
    case 9: sw = v | 0x10101010u; break;
    default: sw = 42u; break;
    }

    // Nested divergence, reconverged with __syncwarp before a shuffle.
    unsigned nested;
    if (v & 1u) {
        if (v & 2u) {
            nested = v * 5u;
        } else {
            nested = v + 7u;
        }
    } else {
        nested = (v & 4u) ? v >> 1 : v << 1;
    }
    // Lanes past n have exited: name only the live ones (n is even, so xor-1 partners are live).
    unsigned warp_base = i & ~31u;
    unsigned live = n - warp_base >= 32u ? 0xffffffffu : (1u << (n - warp_base)) - 1u;
    __syncwarp(live);
    unsigned neighbour = __shfl_xor_sync(live, nested, 1);

    __threadfence();
    o[0] = rotated;
    o[1] = steps;
    o[2] = acc;
    o[3] = sw;
    o[4] = nested;
    o[5] = neighbour;
}
