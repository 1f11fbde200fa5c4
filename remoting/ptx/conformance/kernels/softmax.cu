// Row-wise softmax: one block per row, shared-memory max and sum reductions, expf and an IEEE
// division. expf goes through ex2.approx, so results are compared with a relative tolerance.
// blockDim.x must be a power of two, at most 256.
extern "C" __global__ void softmax(const float* in, float* out, unsigned cols)
{
    __shared__ float red[256];

    const float* x = in + (size_t)blockIdx.x * cols;
    float* y = out + (size_t)blockIdx.x * cols;
    unsigned tid = threadIdx.x;

    float m = __int_as_float(0xff800000);  // -inf
    for (unsigned c = tid; c < cols; c += blockDim.x) {
        m = fmaxf(m, x[c] * 4.0f);
    }
    red[tid] = m;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) {
            red[tid] = fmaxf(red[tid], red[tid + s]);
        }
        __syncthreads();
    }
    float row_max = red[0];
    __syncthreads();

    float sum = 0.0f;
    for (unsigned c = tid; c < cols; c += blockDim.x) {
        sum += expf(x[c] * 4.0f - row_max);
    }
    red[tid] = sum;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) {
            red[tid] += red[tid + s];
        }
        __syncthreads();
    }
    float total = red[0];

    for (unsigned c = tid; c < cols; c += blockDim.x) {
        y[c] = expf(x[c] * 4.0f - row_max) / total;
    }
}
