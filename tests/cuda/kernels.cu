// Kernels the way runtime programs write them: atomics, a grid-stride loop, dynamic shared memory,
// struct arguments by value through <<<>>> and through cudaLaunchKernel.
#include "check.h"

struct Affine {
    float scale;
    int offset;
    double bias;  // forces 8-byte alignment and padding inside the argument
    short tag;
};

__global__ void histogram(const int *values, int n, unsigned *bins, int *maxv, unsigned *cas_slot) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int v = values[i];
        atomicAdd(&bins[v % 8], 1u);
        atomicMax(maxv, v);
        // Every thread tries to claim the slot; exactly one succeeds.
        atomicCAS(cas_slot, 0u, (unsigned)(i + 1));
    }
}

__global__ void grid_stride(float *x, int n, Affine a) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        x[i] = x[i] * a.scale + (float)a.offset + (float)a.bias + (float)a.tag;
}

// Block-wide sum in dynamic shared memory (blockDim.x a power of two).
__global__ void block_sums(const int *in, int n, int *out) {
    extern __shared__ int cache[];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    cache[threadIdx.x] = i < n ? in[i] : 0;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) cache[threadIdx.x] += cache[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = cache[0];
}

__global__ void float_atomics(float *acc, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(acc, 0.25f);  // exact in any order: 0.25 * n stays representable
}

int main() {
    const int n = 300;
    int hv[n];
    for (int i = 0; i < n; i++) hv[i] = (i * 37) % 101;
    int *values, *maxv, *sums, *dsum_in;
    unsigned *bins, *slot;
    float *x, *acc;
    CUDA_OK(cudaMalloc(&values, sizeof hv));
    CUDA_OK(cudaMalloc(&bins, 8 * sizeof(unsigned)));
    CUDA_OK(cudaMalloc(&maxv, sizeof(int)));
    CUDA_OK(cudaMalloc(&slot, sizeof(unsigned)));
    CUDA_OK(cudaMemcpy(values, hv, sizeof hv, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(bins, 0, 8 * sizeof(unsigned)));
    CUDA_OK(cudaMemset(maxv, 0, sizeof(int)));
    CUDA_OK(cudaMemset(slot, 0, sizeof(unsigned)));

    histogram<<<(n + 63) / 64, 64>>>(values, n, bins, maxv, slot);
    CUDA_OK(cudaGetLastError());
    unsigned hb[8], hslot = 0;
    int hmax = -1;
    CUDA_OK(cudaMemcpy(hb, bins, sizeof hb, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&hmax, maxv, sizeof hmax, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&hslot, slot, sizeof hslot, cudaMemcpyDeviceToHost));
    unsigned want[8] = {0};
    int wmax = 0;
    for (int i = 0; i < n; i++) {
        want[hv[i] % 8]++;
        wmax = hv[i] > wmax ? hv[i] : wmax;
    }
    std::printf("bins:");
    for (int b = 0; b < 8; b++) {
        std::printf(" %u", hb[b]);
        EXPECT(hb[b] == want[b]);
    }
    std::printf("\nmax=%d cas claimed: %s\n", hmax, hslot >= 1 && hslot <= (unsigned)n ? "yes" : "no");
    EXPECT(hmax == wmax);
    EXPECT(hslot >= 1 && hslot <= (unsigned)n);

    // Grid-stride loop: 3 blocks of 32 threads cover 1000 elements.
    const int m = 1000;
    float hx[m];
    for (int i = 0; i < m; i++) hx[i] = (float)i;
    CUDA_OK(cudaMalloc(&x, sizeof hx));
    CUDA_OK(cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice));
    Affine a = {2.0f, -5, 0.5, 3};
    grid_stride<<<3, 32>>>(x, m, a);
    CUDA_OK(cudaGetLastError());
    // The same kernel through cudaLaunchKernel, with the struct passed by pointer in the argument array.
    Affine b = {0.5f, 1, 0.25, -1};
    int mm = m;
    void *args[] = {&x, &mm, &b};
    CUDA_OK(cudaLaunchKernel((const void *)grid_stride, dim3(2), dim3(64), args, 0, nullptr));
    CUDA_OK(cudaMemcpy(hx, x, sizeof hx, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < m; i++) {
        float v = (float)i * 2.0f + -5.0f + 0.5f + 3.0f;
        v = v * 0.5f + 1.0f + 0.25f + -1.0f;
        bad += hx[i] != v;
    }
    std::printf("grid-stride: x[0]=%.3f x[999]=%.3f\n", hx[0], hx[m - 1]);
    EXPECT(bad == 0);

    // Dynamic shared memory: 128 ints per block.
    const int k = 1000, threads = 128, blocks = (k + threads - 1) / threads;
    int hin[k], hsums[blocks];
    for (int i = 0; i < k; i++) hin[i] = i % 17;
    CUDA_OK(cudaMalloc(&dsum_in, sizeof hin));
    CUDA_OK(cudaMalloc(&sums, sizeof hsums));
    CUDA_OK(cudaMemcpy(dsum_in, hin, sizeof hin, cudaMemcpyHostToDevice));
    block_sums<<<blocks, threads, threads * sizeof(int)>>>(dsum_in, k, sums);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(hsums, sums, sizeof hsums, cudaMemcpyDeviceToHost));
    long total = 0;
    for (int bidx = 0; bidx < blocks; bidx++) {
        int w = 0;
        for (int i = bidx * threads; i < k && i < (bidx + 1) * threads; i++) w += hin[i];
        EXPECT(hsums[bidx] == w);
        total += hsums[bidx];
    }
    std::printf("block sums: %d blocks, total %ld\n", blocks, total);

    CUDA_OK(cudaMalloc(&acc, sizeof(float)));
    CUDA_OK(cudaMemset(acc, 0, sizeof(float)));
    float_atomics<<<4, 64>>>(acc, 200);
    float hacc = 0;
    CUDA_OK(cudaMemcpy(&hacc, acc, sizeof hacc, cudaMemcpyDeviceToHost));
    std::printf("float atomics: %.2f\n", hacc);
    EXPECT(hacc == 50.0f);

    CUDA_OK(cudaDeviceSynchronize());
    for (void *p : {(void *)values, (void *)bins, (void *)maxv, (void *)slot, (void *)x, (void *)sums,
                    (void *)dsum_in, (void *)acc})
        CUDA_OK(cudaFree(p));
    return finish("kernels");
}
