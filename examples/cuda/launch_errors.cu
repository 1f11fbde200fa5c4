// What NVIDIA's driver answers an impossible launch configuration, to a driver-API caller and to the CUDA
// runtime (on the H200, driver 580: CUDA_ERROR_INVALID_VALUE to both, which the runtime reports as
// cudaErrorInvalidValue). Run locally and through Gleam (scripts/gpu/compare-pytorch.sh, case launch_errors):
// the lines must be identical.
//
//   nvcc -O2 -o launch_errors examples/cuda/launch_errors.cu -lcuda
#include <cstdio>
#include <cuda.h>
#include <cuda_runtime.h>

__global__ void touch(int *p) { p[threadIdx.x] = (int)threadIdx.x; }

int main() {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    int *d = nullptr;
    if (cudaMalloc(&d, 1 << 20) != cudaSuccess) {
        std::printf("FAIL cudaMalloc\n");
        return 1;
    }
    cudaFunction_t f = nullptr;
    if (cudaGetFuncBySymbol(&f, (const void *)touch) != cudaSuccess) {
        std::printf("FAIL cudaGetFuncBySymbol\n");
        return 1;
    }
    struct Case {
        const char *name;
        dim3 grid, block;
    } cases[] = {
        {"2048 threads", dim3(1), dim3(2048)},
        {"zero grid", dim3(0), dim3(32)},
        {"block z 128", dim3(1), dim3(1, 1, 128)},
        {"fine", dim3(1), dim3(32)},
    };
    for (const Case &c : cases) {
        void *args[] = {&d};
        CUresult drv = cuLaunchKernel((CUfunction)f, c.grid.x, c.grid.y, c.grid.z, c.block.x, c.block.y,
                                      c.block.z, 0, nullptr, args, nullptr);
        const char *drv_name = "?";
        cuGetErrorName(drv, &drv_name);
        (void)cudaGetLastError();
        cudaError_t rt = cudaLaunchKernel((const void *)touch, c.grid, c.block, args, 0, nullptr);
        (void)cudaGetLastError();
        std::printf("%-13s driver API: %d %s | runtime: %d %s\n", c.name, (int)drv, drv_name, (int)rt,
                    cudaGetErrorName(rt));
    }
    cudaError_t sync = cudaDeviceSynchronize();
    std::printf("after: %s\n", cudaGetErrorName(sync));
    return sync == cudaSuccess ? 0 : 1;
}
