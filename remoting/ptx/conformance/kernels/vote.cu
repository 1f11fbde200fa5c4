// Warp vote coverage: __all_sync, __any_sync, __ballot_sync with the full mask and with a
// half-warp mask inside a divergent branch. Input: random u32. Output: VOTE_RESULTS u32 per thread.
#define VOTE_RESULTS 8

extern "C" __global__ void vote(const unsigned* in, unsigned* out, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned lane = threadIdx.x & 31u;
    unsigned v = in[i];  // the case launches exactly n threads, all in range
    bool odd = (v & 1u) != 0;
    bool rare = (v & 0x1fu) == 0;   // true for ~1/32 of lanes
    bool common = (v & 0x1fu) != 0; // false for ~1/32 of lanes
    unsigned* o = out + (size_t)i * VOTE_RESULTS;

    o[0] = __ballot_sync(0xffffffffu, odd);
    o[1] = (unsigned)__all_sync(0xffffffffu, common);
    o[2] = (unsigned)__any_sync(0xffffffffu, rare);
    o[3] = (unsigned)__all_sync(0xffffffffu, lane < 32u);
    o[4] = (unsigned)__any_sync(0xffffffffu, false);
    if (lane < 16u) {
        o[5] = __ballot_sync(0x0000ffffu, odd);
        o[6] = (unsigned)__all_sync(0x0000ffffu, common);
    } else {
        o[5] = __ballot_sync(0xffff0000u, !odd);
        o[6] = (unsigned)__any_sync(0xffff0000u, rare);
    }
    o[7] = __popc(__ballot_sync(0xffffffffu, (v >> 4) & 1u));
    (void)n;
}
