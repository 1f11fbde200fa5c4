// Tiled matmul C (m x p) = A (m x k) * B (k x p), row-major, 16x16 tiles in shared memory,
// bounds checks for sizes that are not tile multiples. Accumulation with fmaf in ascending k:
// exact under PTX's fma.rn. Block (16, 16, 1), grid (ceil(p/16), ceil(m/16), 1).
#define TILE 16

extern "C" __global__ void matmul_tiled(const float* A, const float* B, float* C, int m, int k, int p)
{
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE + 1];  // padded: a different shared layout than As

    int tx = threadIdx.x;
    int ty = threadIdx.y;
    int row = blockIdx.y * TILE + ty;
    int col = blockIdx.x * TILE + tx;
    float acc = 0.0f;

    for (int t = 0; t < k; t += TILE) {
        As[ty][tx] = (row < m && t + tx < k) ? A[row * k + t + tx] : 0.0f;
        Bs[ty][tx] = (t + ty < k && col < p) ? B[(t + ty) * p + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
            acc = fmaf(As[ty][j], Bs[j][tx], acc);
        }
        __syncthreads();
    }
    if (row < m && col < p) {
        C[row * p + col] = acc;
    }
}
