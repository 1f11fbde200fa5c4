// Double precision coverage. Inputs x, y: random f64 in [-1, 1).
// float64_exact: correctly rounded operations (rn and directed-rounding intrinsics), min/max,
//   rounding to integral values, and an atomicAdd(double) of multiples of 1/256 (exact in any order).
// float64_libm: exp, log, sin, cos, tanh, pow from libdevice: software sequences of f64 fma/mul/add
//   (and integer ops), so the PTX fixes their results; compared with a 1-ulp allowance in case an
//   .approx seed instruction feeds a refinement.
#define F64_EXACT_RESULTS 18
#define F64_LIBM_RESULTS 6

extern "C" __global__ void float64_exact(const double* xs, const double* ys, double* out, double* acc, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    double x = xs[i];
    double y = ys[i];
    double big = x * 1000.0;
    double* o = out + (size_t)i * F64_EXACT_RESULTS;

    o[0] = x + y;
    o[1] = x * y;
    o[2] = fma(x, y, 0.125);
    o[3] = x / (y * 0.5 + 1.5);
    o[4] = sqrt(fabs(x));
    o[5] = fmin(x, y);
    o[6] = fmax(x, y);
    o[7] = floor(big);
    o[8] = ceil(big);
    o[9] = trunc(big);
    o[10] = rint(big);
    o[11] = copysign(x, y);
    o[12] = __dadd_rz(x, y);
    o[13] = __dmul_ru(x, y);
    o[14] = __fma_rd(x, y, 1.0);
    o[15] = __drcp_rn(y * 0.5 + 1.5);
    o[16] = __dsqrt_ru(fabs(y) + 1.0);
    o[17] = __ddiv_rz(x, y * 0.25 + 2.0);
    atomicAdd(&acc[i & 3u], floor(x * 256.0) / 256.0);
}

extern "C" __global__ void float64_libm(const double* xs, double* out, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    double x = xs[i];
    double* o = out + (size_t)i * F64_LIBM_RESULTS;
    o[0] = exp(x * 10.0);
    o[1] = log(fabs(x) + 0.001);
    o[2] = sin(x * 100.0);
    o[3] = cos(x * 3.0);
    o[4] = tanh(x * 4.0);
    o[5] = pow(fabs(x) + 0.5, x * 7.0);
}
