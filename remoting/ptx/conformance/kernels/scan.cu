// Block-level inclusive prefix sum (Hillis-Steele, double-buffered in dynamic shared memory:
// 2 * blockDim.x u32). Each block scans its own segment independently; a second output gets the
// exclusive scan. u32 arithmetic wraps, so results are exact.
extern "C" __global__ void scan_block(const unsigned* in, unsigned* inclusive, unsigned* exclusive, unsigned n)
{
    extern __shared__ unsigned buf[];

    unsigned tid = threadIdx.x;
    unsigned i = blockIdx.x * blockDim.x + tid;
    unsigned v = i < n ? in[i] : 0u;
    unsigned* src = buf;
    unsigned* dst = buf + blockDim.x;
    src[tid] = v;
    __syncthreads();

    for (unsigned offset = 1; offset < blockDim.x; offset <<= 1) {
        unsigned t = src[tid];
        if (tid >= offset) {
            t += src[tid - offset];
        }
        dst[tid] = t;
        __syncthreads();
        unsigned* tmp = src;
        src = dst;
        dst = tmp;
    }
    if (i < n) {
        inclusive[i] = src[tid];
        exclusive[i] = src[tid] - v;
    }
}
