// Errors come back as errors: launch configuration, bad copies, failed allocations, and the
// cudaGetLastError / cudaPeekAtLastError semantics (the last error is read once; peeking keeps it).
#include "check.h"

__global__ void touch(int *p) { p[threadIdx.x] = (int)threadIdx.x; }

int main() {
    int *d = nullptr;
    CUDA_OK(cudaMalloc(&d, 4096));
    CUDA_EXPECT(cudaGetLastError(), cudaSuccess);

    // More threads per block than any GPU allows: refused at launch, the context stays usable. The driver
    // answers CUDA_ERROR_INVALID_VALUE, which the runtime reports as is (measured on the H200).
    touch<<<1, 2048>>>(d);
    CUDA_EXPECT(cudaPeekAtLastError(), cudaErrorInvalidValue);
    CUDA_EXPECT(cudaPeekAtLastError(), cudaErrorInvalidValue);
    CUDA_EXPECT(cudaGetLastError(), cudaErrorInvalidValue);
    CUDA_EXPECT(cudaGetLastError(), cudaSuccess);
    // A block dimension over its own limit (z at most 64).
    touch<<<1, dim3(1, 1, 128)>>>(d);
    CUDA_EXPECT(cudaGetLastError(), cudaErrorInvalidValue);
    // A zero-sized grid.
    touch<<<0, 32>>>(d);
    CUDA_EXPECT(cudaGetLastError(), cudaErrorInvalidValue);

    // The device still works after those (they are not sticky).
    touch<<<1, 32>>>(d);
    CUDA_OK(cudaGetLastError());
    int host[32];
    CUDA_OK(cudaMemcpy(host, d, sizeof host, cudaMemcpyDeviceToHost));
    EXPECT(host[31] == 31);
    std::printf("after launch errors: d[31]=%d\n", host[31]);

    // Copies to or from memory that is not allocated fail.
    char buffer[256] = {0};
    CUDA_EXPECT(cudaMemcpy((char *)d + (1ull << 40), buffer, sizeof buffer, cudaMemcpyHostToDevice),
                cudaErrorInvalidValue);
    CUDA_EXPECT(cudaGetLastError(), cudaErrorInvalidValue);
    CUDA_EXPECT(cudaMemcpy(buffer, (char *)d + (1ull << 40), sizeof buffer, cudaMemcpyDeviceToHost),
                cudaErrorInvalidValue);
    CUDA_EXPECT(cudaGetLastError(), cudaErrorInvalidValue);

    // An allocation no GPU can satisfy: cudaErrorMemoryAllocation, recorded as the last error, not sticky.
    void *huge = nullptr;
    CUDA_EXPECT(cudaMalloc(&huge, (size_t)1 << 50), cudaErrorMemoryAllocation);
    CUDA_EXPECT(cudaGetLastError(), cudaErrorMemoryAllocation);
    CUDA_EXPECT(cudaGetLastError(), cudaSuccess);

    // Freeing something that was never allocated.
    CUDA_EXPECT(cudaFree((char *)d + 8), cudaErrorInvalidValue);
    CUDA_EXPECT(cudaGetLastError(), cudaErrorInvalidValue);

    // Error names and strings are answered locally.
    std::printf("name of 9: %s\n", cudaGetErrorName(cudaErrorInvalidConfiguration));
    EXPECT(cudaGetErrorString(cudaErrorMemoryAllocation) != nullptr);

    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaFree(d));
    return finish("errors");
}
