// Kernels used by the streams example. Both use fmaf explicitly so results are exact and a CPU
// reference with fused multiply-add (f32::mul_add) matches bit for bit.

// y[i] = a * x[i] + b
extern "C" __global__ void scale_add(const float* x, float* y, float a, float b, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = fmaf(a, x[i], b);
    }
}

// y[i] = a * x[i] + y[i]
extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = fmaf(a, x[i], y[i]);
    }
}
