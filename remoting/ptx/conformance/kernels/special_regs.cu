// 3-D grid and block: every thread writes its special registers. Output: SREG_RESULTS u32 per
// thread, at the thread's linear index (blocks in x-fastest order, threads x-fastest in a block).
#define SREG_RESULTS 14

extern "C" __global__ void special_regs(unsigned* out)
{
    unsigned block_linear = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    unsigned threads_per_block = blockDim.x * blockDim.y * blockDim.z;
    unsigned thread_linear = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    unsigned lane;
    asm("mov.u32 %0, %%laneid;" : "=r"(lane));
    unsigned* o = out + ((size_t)block_linear * threads_per_block + thread_linear) * SREG_RESULTS;
    o[0] = threadIdx.x;
    o[1] = threadIdx.y;
    o[2] = threadIdx.z;
    o[3] = blockIdx.x;
    o[4] = blockIdx.y;
    o[5] = blockIdx.z;
    o[6] = blockDim.x;
    o[7] = blockDim.y;
    o[8] = blockDim.z;
    o[9] = gridDim.x;
    o[10] = gridDim.y;
    o[11] = gridDim.z;
    o[12] = lane;
    o[13] = warpSize;
}
