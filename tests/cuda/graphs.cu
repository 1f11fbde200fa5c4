// CUDA graphs through stream capture: a capture with a fork and join across two streams (kernels, a
// memset, a device-to-device copy), counted, instantiated and replayed several times; capture state queries; an
// illegal call during capture invalidates it.
#include "check.h"

__global__ void add(float *x, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}

__global__ void scale(float *y, const float *x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}

int main() {
    const int n = 256;
    float *x, *y, *z;
    CUDA_OK(cudaMalloc(&x, n * sizeof(float)));
    CUDA_OK(cudaMalloc(&y, n * sizeof(float)));
    CUDA_OK(cudaMalloc(&z, n * sizeof(float)));
    CUDA_OK(cudaMemset(x, 0, n * sizeof(float)));
    cudaStream_t s, side;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaEvent_t fork, join;
    CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));

    cudaStreamCaptureStatus status;
    CUDA_OK(cudaStreamIsCapturing(s, &status));
    EXPECT(status == cudaStreamCaptureStatusNone);

    // x += 1; y = 0; fork: y += 2 * x on the side stream; join; z = y.
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CUDA_OK(cudaStreamIsCapturing(s, &status));
    EXPECT(status == cudaStreamCaptureStatusActive);
    unsigned long long id = 0;
    CUDA_OK(cudaStreamGetCaptureInfo(s, &status, &id));
    EXPECT(status == cudaStreamCaptureStatusActive && id != 0);
    add<<<(n + 127) / 128, 128, 0, s>>>(x, 1.0f, n);
    CUDA_OK(cudaMemsetAsync(y, 0, n * sizeof(float), s));
    CUDA_OK(cudaEventRecord(fork, s));
    CUDA_OK(cudaStreamWaitEvent(side, fork, 0));
    scale<<<(n + 127) / 128, 128, 0, side>>>(y, x, 2.0f, n);
    CUDA_OK(cudaEventRecord(join, side));
    CUDA_OK(cudaStreamWaitEvent(s, join, 0));
    CUDA_OK(cudaMemcpyAsync(z, y, n * sizeof(float), cudaMemcpyDeviceToDevice, s));
    cudaGraph_t graph;
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    CUDA_OK(cudaStreamIsCapturing(s, &status));
    EXPECT(status == cudaStreamCaptureStatusNone);

    // Four nodes (two kernels, the memset, the copy), one root; events became edges, not nodes.
    size_t nodes = 0, roots = 0, edges = 0;
    CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
    CUDA_OK(cudaGraphGetRootNodes(graph, nullptr, &roots));
    CUDA_OK(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &edges));
    EXPECT(nodes == 4 && roots == 1 && edges >= 3);

    // Nothing ran during capture.
    float hx[n];
    CUDA_OK(cudaMemcpy(hx, x, sizeof hx, cudaMemcpyDeviceToHost));
    EXPECT(hx[0] == 0.0f);

    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; i++) CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    float hz[n];
    CUDA_OK(cudaMemcpy(hx, x, sizeof hx, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(hz, z, sizeof hz, cudaMemcpyDeviceToHost));
    std::printf("after 3 replays: x[0]=%.1f z[0]=%.1f z[%d]=%.1f\n", hx[0], hz[0], n - 1, hz[n - 1]);
    EXPECT(hx[0] == 3.0f && hx[n - 1] == 3.0f);
    EXPECT(hz[0] == 6.0f && hz[n - 1] == 6.0f);

    // Synchronizing a capturing stream is illegal: the call fails and the capture is invalidated.
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    add<<<1, 32, 0, s>>>(x, 1.0f, 32);
    CUDA_EXPECT(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
    cudaGraph_t broken = nullptr;
    CUDA_EXPECT(cudaStreamEndCapture(s, &broken), cudaErrorStreamCaptureInvalidated);
    EXPECT(broken == nullptr);
    (void)cudaGetLastError();
    CUDA_OK(cudaStreamIsCapturing(s, &status));
    EXPECT(status == cudaStreamCaptureStatusNone);

    // The graph still replays after all that.
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaMemcpy(hx, x, sizeof hx, cudaMemcpyDeviceToHost));
    std::printf("after 4 replays: x[0]=%.1f\n", hx[0]);
    EXPECT(hx[0] == 4.0f);

    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(s));
    CUDA_OK(cudaStreamDestroy(side));
    CUDA_OK(cudaFree(x));
    CUDA_OK(cudaFree(y));
    CUDA_OK(cudaFree(z));
    return finish("graphs");
}
