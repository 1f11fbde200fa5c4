// Integer instruction coverage. Inputs a, b are full-range random u32 (also read as s32).
// Every thread writes INT32_RESULTS u32 results and INT64_RESULTS u64 results; all exact.
#define INT32_RESULTS 40
#define INT64_RESULTS 12

__device__ __forceinline__ unsigned bfe_u32(unsigned x, unsigned pos, unsigned len)
{
    unsigned r;
    asm("bfe.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(pos), "r"(len));
    return r;
}

__device__ __forceinline__ int bfe_s32(int x, unsigned pos, unsigned len)
{
    int r;
    asm("bfe.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(pos), "r"(len));
    return r;
}

__device__ __forceinline__ unsigned bfi_b32(unsigned insert, unsigned base, unsigned pos, unsigned len)
{
    unsigned r;
    asm("bfi.b32 %0, %1, %2, %3, %4;" : "=r"(r) : "r"(insert), "r"(base), "r"(pos), "r"(len));
    return r;
}

// PTX shifts clamp amounts above the register width (unlike C), so test that through asm.
__device__ __forceinline__ unsigned shl_raw(unsigned x, unsigned s)
{
    unsigned r;
    asm("shl.b32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(s));
    return r;
}

__device__ __forceinline__ unsigned shr_u_raw(unsigned x, unsigned s)
{
    unsigned r;
    asm("shr.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(s));
    return r;
}

__device__ __forceinline__ int shr_s_raw(int x, unsigned s)
{
    int r;
    asm("shr.s32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(s));
    return r;
}

extern "C" __global__ void int_ops(const unsigned* a_in, const unsigned* b_in, unsigned* out32,
                                   unsigned long long* out64, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    unsigned a = a_in[i];
    unsigned b = b_in[i];
    int sa = (int)a;
    int sb = (int)b;
    // Small values too, so that division and comparisons see negative and small operands.
    int small_a = sa >> 20;          // [-2048, 2047]
    int small_b = (sb >> 28) | 1;    // odd, in [-7, 7], never 0
    unsigned ub = b == 0u ? 1u : b;  // no division by zero
    int sbd = (sb == 0 || (sb == -1 && sa == (int)0x80000000)) ? 3 : sb;  // no overflow
    unsigned* o = out32 + (size_t)i * INT32_RESULTS;
    unsigned long long* o64 = out64 + (size_t)i * INT64_RESULTS;

    o[0] = a * b;
    o[1] = __umulhi(a, b);
    o[2] = (unsigned)__mulhi(sa, sb);
    o[3] = a / ub;
    o[4] = a % ub;
    o[5] = (unsigned)(sa / sbd);
    o[6] = (unsigned)(sa % sbd);
    o[7] = (unsigned)(small_a / small_b);
    o[8] = (unsigned)(small_a % small_b);
    o[9] = min(a, b);
    o[10] = max(a, b);
    o[11] = (unsigned)min(sa, sb);
    o[12] = (unsigned)max(sa, sb);
    o[13] = (unsigned)abs(sa);
    o[14] = a << (b & 31u);
    o[15] = a >> (b & 31u);
    o[16] = (unsigned)(sa >> (b & 31u));
    o[17] = shl_raw(a, b & 63u);
    o[18] = shr_u_raw(a, b & 63u);
    o[19] = (unsigned)shr_s_raw(sa, b & 63u);
    o[20] = (unsigned)__popc(a);
    o[21] = (unsigned)__clz(sa);
    o[22] = __brev(a);
    o[23] = __byte_perm(a, b, b & 0x7777u);
    o[24] = bfe_u32(a, b & 31u, (b >> 5) & 31u);
    o[25] = (unsigned)bfe_s32(sa, b & 31u, (b >> 5) & 31u);
    o[26] = bfi_b32(a, b, (a >> 8) & 31u, (a >> 16) & 31u);
    // Bit-field extract written in plain C (the compiler may pick bfe or shifts).
    o[27] = (a >> 7) & 0x3ffu;
    o[28] = (a & ~(0xffu << 12)) | ((b & 0xffu) << 12);
    o[29] = (unsigned)__ffs(sa);
    o[30] = __sad(a, b, 5u);
    o[31] = (unsigned)__mul24(sa, sb);
    o[32] = __umul24(a, b);
    o[33] = __usad(a & 0xffffu, b & 0xffffu, a >> 16);
    o[34] = (unsigned)(a < b) | ((unsigned)(sa < sb) << 1) | ((unsigned)(a == b) << 2) | ((unsigned)(sa >= sb) << 3);
    o[35] = ~a ^ (b | 0x0f0f0f0fu);
    o[36] = (unsigned)__hadd(sa, sb);
    o[37] = (unsigned)__rhadd(sa, sb);
    o[38] = __uhadd(a, b);
    o[39] = (unsigned)(-sa) + (unsigned)(small_a * small_b);

    unsigned long long wa = ((unsigned long long)a << 32) | b;
    unsigned long long wb = ((unsigned long long)b << 32) | (a ^ 0x5a5a5a5au);
    long long swa = (long long)wa;
    long long swb = (long long)wb;
    unsigned long long wbd = wb == 0ull ? 1ull : wb;
    long long swbd = (swb == 0 || swb == -1) ? 5 : swb;
    o64[0] = (unsigned long long)a * (unsigned long long)b;  // mul.wide.u32
    o64[1] = (unsigned long long)((long long)sa * (long long)sb);  // mul.wide.s32
    o64[2] = wa * wb;
    o64[3] = __umul64hi(wa, wb);
    o64[4] = (unsigned long long)__mul64hi(swa, swb);
    o64[5] = wa / wbd;
    o64[6] = wa % wbd;
    o64[7] = (unsigned long long)(swa / swbd);
    o64[8] = (unsigned long long)(swa % swbd);
    o64[9] = (unsigned long long)__popcll(wa) | ((unsigned long long)__clzll(swb) << 8)
           | ((unsigned long long)__ffsll(swa) << 16);
    o64[10] = __brevll(wa);
    o64[11] = (wa >> (b & 63u)) ^ (unsigned long long)(swb >> (a & 63u)) ^ (wa << (a & 63u));
}
