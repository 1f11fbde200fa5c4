// Float math coverage. Inputs x, y: random f32 in [-1, 1).
//
// float_exact: operations whose results PTX fixes bit for bit (rn add/mul/fma/div/sqrt, min/max,
// rounding to integral values, copysign, abs). FLOAT_EXACT_RESULTS per thread.
// float_approx: the approximate instructions; one output per function so each gets its own
// tolerance in the case file.
#define FLOAT_EXACT_RESULTS 20

extern "C" __global__ void float_exact(const float* xs, const float* ys, float* out, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    float x = xs[i];
    float y = ys[i];
    float big = x * 1000.0f;
    float* o = out + (size_t)i * FLOAT_EXACT_RESULTS;

    o[0] = __fadd_rn(x, y);
    o[1] = __fmul_rn(x, y);
    o[2] = fmaf(x, y, 0.25f);
    o[3] = x / (y * 0.5f + 1.5f);  // div.rn (full precision by default)
    o[4] = sqrtf(fabsf(x));        // sqrt.rn (full precision by default)
    o[5] = fminf(x, y);
    o[6] = fmaxf(x, y);
    o[7] = floorf(big);
    o[8] = ceilf(big);
    o[9] = truncf(big);
    o[10] = rintf(big);
    o[11] = copysignf(x, y);
    o[12] = fabsf(x) - y;
    o[13] = __fsub_rn(x, y);
    o[14] = __fmaf_rz(x, y, 1.0f);
    o[15] = __fmaf_rd(x, y, 1.0f);
    o[16] = __fmaf_ru(x, y, 1.0f);
    o[17] = __fdiv_rn(y, x * 0.25f + 2.0f);
    o[18] = __frcp_rn(x * 0.5f + 1.5f);
    o[19] = __fsqrt_rn(fabsf(y) + 1.0f);
}

extern "C" __global__ void float_approx(const float* xs, const float* ys, float* fdiv, float* rsq,
                                        float* fexp, float* fexp2, float* flog2, float* fsin,
                                        float* fcos, float* ftanh, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    float x = xs[i];
    float y = ys[i];

    fdiv[i] = __fdividef(x, y * 0.5f + 1.5f);       // denominator in [1, 2)
    rsq[i] = rsqrtf(fabsf(x) + 0.01f);
    fexp[i] = __expf(x * 4.0f);
    fexp2[i] = exp2f(x * 8.0f);
    flog2[i] = __log2f(fabsf(x) + 0.5f);            // argument in [0.5, 1.5)
    fsin[i] = __sinf(x * 3.14159265f);
    fcos[i] = __cosf(x * 3.14159265f);
    ftanh[i] = tanhf(x * 3.0f);
}
