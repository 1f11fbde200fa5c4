// Conversion coverage: float <-> int with every rounding mode (including saturation of
// out-of-range values), f64, f16 and bf16. Inputs: x f32 in [-1, 1), k s32 full range,
// d f64 in [-1, 1), h f16 in [-1, 1), bh bf16 in [-1, 1). All results exact.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define CVT_S32 12
#define CVT_U32 6
#define CVT_F32 12
#define CVT_F64 4
#define CVT_S64 4
#define CVT_F16 6
#define CVT_BF16 4

extern "C" __global__ void conversions(const float* xs, const int* ks, const double* ds,
                                       const __half* hs, const __nv_bfloat16* bhs,
                                       int* o_s32, unsigned* o_u32, float* o_f32, double* o_f64,
                                       long long* o_s64, __half* o_f16, __nv_bfloat16* o_bf16,
                                       unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    float x = xs[i];
    int k = ks[i];
    double d = ds[i];
    __half h = hs[i];
    __nv_bfloat16 bh = bhs[i];
    float mid = x * 1000.5f;  // many non-integers, some .5 ties
    float huge = x * 3.0e9f;  // beyond s32 range for |x| > ~0.72: saturates
    float tie = rintf(x * 64.0f) + 0.5f;  // exact .5 ties

    int* s = o_s32 + (size_t)i * CVT_S32;
    s[0] = __float2int_rn(mid);
    s[1] = __float2int_rz(mid);
    s[2] = __float2int_rd(mid);
    s[3] = __float2int_ru(mid);
    s[4] = __float2int_rn(huge);
    s[5] = __float2int_rz(huge);
    s[6] = __float2int_rn(tie);
    s[7] = (int)mid;  // C cast: rz
    s[8] = __double2int_rn(d * 1.0e4);
    s[9] = __double2int_rz(d * 1.0e4);
    s[10] = __half2int_rn(__hmul(h, __float2half(100.0f)));
    s[11] = (int)(signed char)(k >> 3);  // sign-extension from 8 bits

    unsigned* u = o_u32 + (size_t)i * CVT_U32;
    u[0] = __float2uint_rn(mid);   // negative values saturate to 0
    u[1] = __float2uint_rz(huge);
    u[2] = __float2uint_rd(fabsf(mid));
    u[3] = __float2uint_ru(fabsf(mid));
    u[4] = (unsigned)(unsigned short)k;  // truncation
    u[5] = __double2uint_rn(fabs(d) * 5.0e9);

    float* f = o_f32 + (size_t)i * CVT_F32;
    f[0] = __int2float_rn(k);
    f[1] = __int2float_rz(k);
    f[2] = __int2float_rd(k);
    f[3] = __int2float_ru(k);
    f[4] = __uint2float_rn((unsigned)k);
    f[5] = __uint2float_rz((unsigned)k);
    f[6] = __double2float_rn(d * 3.0);
    f[7] = __double2float_rz(d * 3.0);
    f[8] = __double2float_rd(d * 3.0);
    f[9] = __double2float_ru(d * 3.0);
    f[10] = __half2float(h);
    f[11] = __bfloat162float(bh);

    double* g = o_f64 + (size_t)i * CVT_F64;
    g[0] = (double)x;
    g[1] = (double)k;
    g[2] = __ll2double_rn((long long)k * 1234567891ll);
    g[3] = d * (double)x + 1.0;

    long long* l = o_s64 + (size_t)i * CVT_S64;
    l[0] = __float2ll_rn(huge);
    l[1] = __float2ll_rz(mid * 1.0e6f);
    l[2] = __double2ll_rn(d * 1.0e15);
    l[3] = (long long)k * -3;

    __half* hh = o_f16 + (size_t)i * CVT_F16;
    hh[0] = __float2half_rn(x * 3.0f);
    hh[1] = __float2half_rz(x * 3.0f);
    hh[2] = __hadd(h, __float2half(0.5f));
    hh[3] = __hmul(h, h);
    hh[4] = __hfma(h, __float2half(1.5f), __float2half(-0.25f));
    hh[5] = __float2half_rn(mid * 100.0f);  // overflows to inf for |mid| > ~655

    __nv_bfloat16* bb = o_bf16 + (size_t)i * CVT_BF16;
    bb[0] = __float2bfloat16_rn(x * 3.0f);
    bb[1] = __float2bfloat16_rz(x * 3.0f);
    bb[2] = __float2bfloat16_rn(__bfloat162float(bh) + x);
    bb[3] = __float2bfloat16_rn(mid);
}
