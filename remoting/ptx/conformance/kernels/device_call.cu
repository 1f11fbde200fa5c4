// Calls to __noinline__ device functions: by-value scalars, a pointer out-parameter, a float
// function, and a recursive function (Euclid's gcd, recursion depth < 50 for u32).
// Output: CALL_RESULTS u32 per thread.
#define CALL_RESULTS 4

__device__ __noinline__ unsigned mix(unsigned a, unsigned b, unsigned* side)
{
    unsigned h = a * 0x9e3779b9u ^ (b + 0x7f4a7c15u);
    h ^= h >> 15;
    *side = h + b;
    return h * 0x85ebca6bu;
}

__device__ __noinline__ float poly(float x, float c0, float c1, float c2)
{
    return fmaf(fmaf(c2, x, c1), x, c0);
}

__device__ __noinline__ unsigned gcd(unsigned a, unsigned b)
{
    if (b == 0u) {
        return a;
    }
    return gcd(b, a % b);
}

extern "C" __global__ void device_call(const unsigned* in, unsigned* out, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    unsigned v = in[i];
    unsigned side = 0;
    unsigned* o = out + (size_t)i * CALL_RESULTS;
    o[0] = mix(v, i, &side);
    o[1] = side;
    float x = (float)(v >> 8) * (1.0f / 16777216.0f);
    o[2] = __float_as_uint(poly(x, 0.5f, -1.25f, 3.0f));
    o[3] = gcd(v, (v >> 7) * 12u + 36u);
}
