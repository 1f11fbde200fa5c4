// Reading results back the way PyTorch's `tensor.item()` does: a kernel, an asynchronous device-to-host
// copy into pageable memory, then a synchronization of the same stream; and the same with work of
// another stream (and of this one) in between, where the synchronization must really wait.
#include "check.h"

__global__ void count_up(int *x, int step) { *x += step; }

__global__ void spin_then_add(int *x, int step, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
    *x += step;
}

int main() {
    int *dev = nullptr, *other = nullptr;
    CUDA_OK(cudaMalloc(&dev, sizeof(int)));
    CUDA_OK(cudaMalloc(&other, sizeof(int)));
    CUDA_OK(cudaMemset(dev, 0, sizeof(int)));
    CUDA_OK(cudaMemset(other, 0, sizeof(int)));
    cudaStream_t s, side;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));

    // The item() loop: every value read back is the one the kernels made.
    int value = 0, sum = 0;
    for (int i = 1; i <= 50; i++) {
        count_up<<<1, 1, 0, s>>>(dev, i);
        CUDA_OK(cudaMemcpyAsync(&value, dev, sizeof value, cudaMemcpyDeviceToHost, s));
        CUDA_OK(cudaStreamSynchronize(s));
        sum += i;
        EXPECT(value == sum);
    }
    std::printf("item loop: %d\n", value);

    // The same into page-locked memory (PyTorch's item() reads into its pinned staging buffer).
    int *pinned = nullptr;
    CUDA_OK(cudaMallocHost(&pinned, sizeof(int)));
    for (int i = 1; i <= 20; i++) {
        count_up<<<1, 1, 0, s>>>(dev, i);
        CUDA_OK(cudaMemcpyAsync(pinned, dev, sizeof(int), cudaMemcpyDeviceToHost, s));
        CUDA_OK(cudaStreamSynchronize(s));
        sum += i;
        EXPECT(*pinned == sum);
    }
    std::printf("pinned loop: %d\n", *pinned);
    CUDA_OK(cudaFreeHost(pinned));

    // Work queued on the stream after the copy: the synchronization waits for it.
    CUDA_OK(cudaMemcpyAsync(&value, dev, sizeof value, cudaMemcpyDeviceToHost, s));
    spin_then_add<<<1, 1, 0, s>>>(dev, 1000, 1000);
    CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaMemcpy(&value, dev, sizeof value, cudaMemcpyDeviceToHost));
    EXPECT(value == sum + 1000);

    // Work of another stream between the copy and the synchronization: this stream stays idle, the
    // other one's work is still its own, and its result arrives with its own synchronization.
    CUDA_OK(cudaMemcpyAsync(&value, dev, sizeof value, cudaMemcpyDeviceToHost, s));
    spin_then_add<<<1, 1, 0, side>>>(other, 7, 1000);
    CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaStreamSynchronize(side));
    int seen = 0;
    CUDA_OK(cudaMemcpy(&seen, other, sizeof seen, cudaMemcpyDeviceToHost));
    EXPECT(seen == 7);
    std::printf("after the other stream: %d %d\n", value, seen);

    // Limits read again and again (GPT-2 in fp16 through PyTorch reads one hundreds of times): the
    // values stay right across a set.
    size_t fifo = 0, stack = 0, fifo_after = 0, stack_after = 0;
    for (int i = 0; i < 10; i++) {
        CUDA_OK(cudaDeviceGetLimit(&fifo, cudaLimitPrintfFifoSize));
        CUDA_OK(cudaDeviceGetLimit(&stack, cudaLimitStackSize));
    }
    EXPECT(fifo > 0 && stack > 0);
    CUDA_OK(cudaDeviceSetLimit(cudaLimitPrintfFifoSize, 2 * fifo));
    CUDA_OK(cudaDeviceGetLimit(&fifo_after, cudaLimitPrintfFifoSize));
    EXPECT(fifo_after >= 2 * fifo);
    CUDA_OK(cudaDeviceSetLimit(cudaLimitStackSize, 2 * stack));
    CUDA_OK(cudaDeviceGetLimit(&stack_after, cudaLimitStackSize));
    EXPECT(stack_after >= 2 * stack);
    std::printf("limits: printf fifo %s, stack %s\n", fifo_after >= 2 * fifo ? "raised" : "same",
                stack_after >= 2 * stack ? "raised" : "same");

    CUDA_OK(cudaStreamDestroy(s));
    CUDA_OK(cudaStreamDestroy(side));
    CUDA_OK(cudaFree(dev));
    CUDA_OK(cudaFree(other));
    return finish("readback");
}
