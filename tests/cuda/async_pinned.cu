// Pinned host memory (cudaMallocHost, cudaHostAlloc) with asynchronous copies on a stream.
#include "check.h"

__global__ void square_plus(float *x, int n, float c) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * x[i] + c;
}

int main() {
    const int n = 1000;
    float *in = nullptr, *out = nullptr, *dev = nullptr;
    CUDA_OK(cudaMallocHost(&in, n * sizeof(float)));
    CUDA_OK(cudaHostAlloc(&out, n * sizeof(float), cudaHostAllocDefault));
    CUDA_OK(cudaMalloc(&dev, n * sizeof(float)));
    for (int i = 0; i < n; i++) {
        in[i] = 0.5f * (float)i;
        out[i] = -1.0f;
    }
    cudaPointerAttributes attr;
    CUDA_OK(cudaPointerGetAttributes(&attr, in));
    if (attr.type != cudaMemoryTypeHost)
        std::printf("pinned pointer %p: type %d device %d host %p device pointer %p\n", (void *)in,
                    (int)attr.type, attr.device, attr.hostPointer, attr.devicePointer);
    EXPECT(attr.type == cudaMemoryTypeHost);
    CUDA_OK(cudaPointerGetAttributes(&attr, dev));
    if (attr.type != cudaMemoryTypeDevice)
        std::printf("device pointer %p: type %d device %d host %p device pointer %p\n", (void *)dev,
                    (int)attr.type, attr.device, attr.hostPointer, attr.devicePointer);
    EXPECT(attr.type == cudaMemoryTypeDevice);
    std::printf("pointer kinds: host=%s device=%s\n", "ok", attr.type == cudaMemoryTypeDevice ? "ok" : "wrong");

    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    CUDA_OK(cudaMemcpyAsync(dev, in, n * sizeof(float), cudaMemcpyHostToDevice, s));
    square_plus<<<(n + 127) / 128, 128, 0, s>>>(dev, n, 1.0f);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpyAsync(out, dev, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaStreamSynchronize(s));

    double sum = 0.0;
    int bad = 0;
    for (int i = 0; i < n; i++) {
        float want = in[i] * in[i] + 1.0f;
        bad += out[i] != want;
        sum += out[i];
    }
    std::printf("out[0]=%.1f out[999]=%.2f sum=%.2f\n", out[0], out[n - 1], sum);
    EXPECT(bad == 0);

    // cudaMemcpyDefault infers the direction from the pointers (unified addressing).
    CUDA_OK(cudaMemsetAsync(dev, 0, n * sizeof(float), s));
    CUDA_OK(cudaMemcpyAsync(out, dev, 16 * sizeof(float), cudaMemcpyDefault, s));
    CUDA_OK(cudaStreamSynchronize(s));
    EXPECT(out[0] == 0.0f && out[15] == 0.0f && out[16] != 0.0f);
    std::printf("default-direction copy: %s\n", out[0] == 0.0f && out[16] != 0.0f ? "ok" : "wrong");

    CUDA_OK(cudaStreamDestroy(s));
    CUDA_OK(cudaFree(dev));
    CUDA_OK(cudaFreeHost(in));
    CUDA_OK(cudaFreeHost(out));
    return finish("async_pinned");
}
