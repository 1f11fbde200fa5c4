// Warp shuffle coverage: __shfl_sync, __shfl_up_sync, __shfl_down_sync, __shfl_xor_sync with
// width 32 and narrower widths (16, 8, 4), on u32 and f32 values. Output: SHFL_RESULTS u32 per
// thread (floats stored as their bits).
#define SHFL_RESULTS 16

extern "C" __global__ void shuffle(const unsigned* in, unsigned* out, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned lane = threadIdx.x & 31u;
    unsigned v = in[i];  // the case launches exactly n threads
    float f = (float)(int)v * (1.0f / 2147483648.0f);
    const unsigned full = 0xffffffffu;
    unsigned* o = out + (size_t)i * SHFL_RESULTS;

    o[0] = __shfl_sync(full, v, 0);
    o[1] = __shfl_sync(full, v, (int)(31u - lane));
    o[2] = __shfl_sync(full, v, (int)(v & 63u));        // source lane taken modulo width
    o[3] = __shfl_sync(full, v, 3, 16);
    o[4] = __shfl_sync(full, v, (int)(lane + 5u), 8);
    o[5] = __shfl_up_sync(full, v, 1);
    o[6] = __shfl_up_sync(full, v, 3, 8);
    o[7] = __shfl_down_sync(full, v, 1);
    o[8] = __shfl_down_sync(full, v, 5, 16);
    o[9] = __shfl_down_sync(full, v, 2, 4);
    o[10] = __shfl_xor_sync(full, v, 1);
    o[11] = __shfl_xor_sync(full, v, 16);
    o[12] = __shfl_xor_sync(full, v, 6, 8);
    o[13] = __float_as_uint(__shfl_sync(full, f, (int)((lane * 7u) & 31u)));
    o[14] = __float_as_uint(__shfl_down_sync(full, f, 4, 16));
    o[15] = __float_as_uint(__shfl_xor_sync(full, f, 3, 4));
    (void)n;
}
