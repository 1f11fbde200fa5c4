// Streams and events: cross-stream ordering through cudaStreamWaitEvent, event timing, queries.
#include "check.h"

__global__ void fill(int *out, int n, int value) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value + i;
}

__global__ void add_from(int *out, const int *in, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += 2 * in[i];
}

int main() {
    const int n = 256;
    int *a = nullptr, *b = nullptr;
    CUDA_OK(cudaMalloc(&a, n * sizeof(int)));
    CUDA_OK(cudaMalloc(&b, n * sizeof(int)));

    cudaStream_t s1, s2;
    CUDA_OK(cudaStreamCreate(&s1));
    CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t start, filled, stop;
    CUDA_OK(cudaEventCreate(&start));
    CUDA_OK(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming));
    CUDA_OK(cudaEventCreate(&stop));

    CUDA_OK(cudaEventRecord(start, s1));
    fill<<<(n + 63) / 64, 64, 0, s1>>>(a, n, 1000);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaEventRecord(filled, s1));
    fill<<<(n + 63) / 64, 64, 0, s2>>>(b, n, 0);
    // s2 must see s1's fill of `a` before adding it.
    CUDA_OK(cudaStreamWaitEvent(s2, filled, 0));
    add_from<<<(n + 63) / 64, 64, 0, s2>>>(b, a, n);
    CUDA_OK(cudaEventRecord(stop, s2));
    CUDA_OK(cudaEventSynchronize(stop));

    CUDA_EXPECT(cudaEventQuery(stop), cudaSuccess);
    CUDA_EXPECT(cudaStreamQuery(s1), cudaSuccess);
    CUDA_EXPECT(cudaStreamQuery(s2), cudaSuccess);
    float ms = -1.0f;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    EXPECT(ms >= 0.0f);
    std::printf("elapsed >= 0: %s\n", ms >= 0.0f ? "yes" : "no");
    // An event created without timing cannot be timed.
    CUDA_EXPECT(cudaEventElapsedTime(&ms, start, filled), cudaErrorInvalidResourceHandle);

    int host[n];
    CUDA_OK(cudaMemcpy(host, b, sizeof host, cudaMemcpyDeviceToHost));
    long long sum = 0;
    int bad = 0;
    for (int i = 0; i < n; i++) {
        sum += host[i];
        bad += host[i] != i + 2 * (1000 + i);
    }
    std::printf("b[0]=%d b[255]=%d sum=%lld\n", host[0], host[n - 1], sum);
    EXPECT(bad == 0);

    // A stream's work is ordered: a copy queued after a kernel sees its result.
    CUDA_OK(cudaMemsetAsync(a, 0, n * sizeof(int), s1));
    fill<<<1, 64, 0, s1>>>(a, 64, 7);
    CUDA_OK(cudaMemcpyAsync(host, a, n * sizeof(int), cudaMemcpyDeviceToHost, s1));
    CUDA_OK(cudaStreamSynchronize(s1));
    std::printf("a[0]=%d a[63]=%d a[64]=%d\n", host[0], host[63], host[64]);
    EXPECT(host[0] == 7 && host[63] == 70 && host[64] == 0);

    CUDA_OK(cudaEventDestroy(start));
    CUDA_OK(cudaEventDestroy(filled));
    CUDA_OK(cudaEventDestroy(stop));
    CUDA_OK(cudaStreamDestroy(s1));
    CUDA_OK(cudaStreamDestroy(s2));
    CUDA_OK(cudaFree(a));
    CUDA_OK(cudaFree(b));
    return finish("streams_events");
}
