// Tiled 16x16 shared-memory matmul, C = A * B for square row-major n x n matrices.
// Launch with block (16, 16, 1) and grid (ceil(n/16), ceil(n/16), 1); any n works thanks to the
// bounds checks (out-of-range tile entries are loaded as 0). Each output is accumulated with fmaf
// in ascending k, so the result is fixed by PTX (fma.rn) and a CPU reference using fused
// multiply-add in the same order reproduces it bit for bit.
#define TILE 16

extern "C" __global__ void matmul(const float* A, const float* B, float* C, int n)
{
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];

    int tx = threadIdx.x;
    int ty = threadIdx.y;
    int row = blockIdx.y * TILE + ty;
    int col = blockIdx.x * TILE + tx;
    float acc = 0.0f;

    for (int t = 0; t < n; t += TILE) {
        int a_col = t + tx;
        int b_row = t + ty;
        As[ty][tx] = (row < n && a_col < n) ? A[row * n + a_col] : 0.0f;
        Bs[ty][tx] = (b_row < n && col < n) ? B[b_row * n + col] : 0.0f;
        __syncthreads();
        int kmax = min(TILE, n - t);
        for (int k = 0; k < kmax; ++k) {
            acc = fmaf(As[ty][k], Bs[k][tx], acc);
        }
        __syncthreads();
    }
    if (row < n && col < n) {
        C[row * n + col] = acc;
    }
}
