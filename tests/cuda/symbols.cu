// __constant__ and __device__ symbols: cudaMemcpyToSymbol / FromSymbol, cudaGetSymbolAddress / Size.
#include "check.h"

__constant__ float coef[4];
__device__ int hits;
__device__ float table[8] = {1, 2, 3, 4, 5, 6, 7, 8};

__global__ void poly(float *y, const float *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = coef[0] + v * (coef[1] + v * (coef[2] + v * coef[3])) + table[i % 8];
        atomicAdd(&hits, 1);
    }
}

int main() {
    const int n = 100;
    const float c[4] = {1.0f, -2.0f, 0.5f, 0.25f};
    CUDA_OK(cudaMemcpyToSymbol(coef, c, sizeof c));
    int zero = 0;
    CUDA_OK(cudaMemcpyToSymbol(hits, &zero, sizeof zero));
    float back[4] = {0};
    CUDA_OK(cudaMemcpyFromSymbol(back, coef, sizeof back));
    EXPECT(back[0] == 1.0f && back[3] == 0.25f);

    size_t size = 0;
    void *addr = nullptr;
    CUDA_OK(cudaGetSymbolSize(&size, table));
    CUDA_OK(cudaGetSymbolAddress(&addr, table));
    std::printf("table: %zu bytes, address %s\n", size, addr ? "non-null" : "NULL");
    EXPECT(size == 8 * sizeof(float) && addr != nullptr);
    // Write through the symbol's address: the kernel sees it.
    const float eight = 80.0f;
    CUDA_OK(cudaMemcpy((float *)addr + 7, &eight, sizeof eight, cudaMemcpyHostToDevice));

    float hx[n], hy[n];
    for (int i = 0; i < n; i++) hx[i] = (float)(i % 10) * 0.5f;
    float *x, *y;
    CUDA_OK(cudaMalloc(&x, sizeof hx));
    CUDA_OK(cudaMalloc(&y, sizeof hy));
    CUDA_OK(cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice));
    poly<<<4, 32>>>(y, x, n);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(hy, y, sizeof hy, cudaMemcpyDeviceToHost));
    int count = -1;
    CUDA_OK(cudaMemcpyFromSymbol(&count, hits, sizeof count));

    const float t[8] = {1, 2, 3, 4, 5, 6, 7, 80};
    int bad = 0;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        float v = hx[i];
        float want = c[0] + v * (c[1] + v * (c[2] + v * c[3])) + t[i % 8];
        bad += hy[i] != want;
        sum += hy[i];
    }
    std::printf("y[0]=%.4f y[7]=%.4f y[99]=%.4f sum=%.4f hits=%d\n", hy[0], hy[7], hy[99], sum, count);
    EXPECT(bad == 0);
    EXPECT(count == n);
    CUDA_OK(cudaFree(x));
    CUDA_OK(cudaFree(y));
    return finish("symbols");
}
