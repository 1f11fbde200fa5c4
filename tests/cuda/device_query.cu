// Device queries through the runtime: count, properties, attributes, versions, memory info, bad ordinals.
// Prints only what every correct driver answers the same way (the values differ between GPUs).
#include "check.h"

int main() {
    int count = 0;
    CUDA_OK(cudaGetDeviceCount(&count));
    EXPECT(count >= 1);
    std::printf("devices >= 1: %s\n", count >= 1 ? "yes" : "no");

    int runtime = 0, driver = 0;
    CUDA_OK(cudaRuntimeGetVersion(&runtime));
    CUDA_OK(cudaDriverGetVersion(&driver));
    std::printf("runtime version: %d\n", runtime);
    EXPECT(driver >= runtime);

    CUDA_OK(cudaSetDevice(0));
    int dev = -1;
    CUDA_OK(cudaGetDevice(&dev));
    EXPECT(dev == 0);

    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    EXPECT(prop.name[0] != '\0');
    EXPECT(prop.major >= 7);
    EXPECT(prop.warpSize == 32);
    EXPECT(prop.maxThreadsPerBlock >= 512 && prop.maxThreadsPerBlock <= 1024);
    EXPECT(prop.maxThreadsDim[0] >= 512 && prop.maxThreadsDim[2] >= 1);
    EXPECT(prop.maxGridSize[0] >= 65535);
    EXPECT(prop.multiProcessorCount >= 1);
    EXPECT(prop.totalGlobalMem >= (64u << 20));
    EXPECT(prop.sharedMemPerBlock >= 16384);
    EXPECT(prop.totalConstMem >= 65536);
    std::printf("warp size: %d\n", prop.warpSize);

    int major = -1, minor = -1, threads = -1;
    CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
    CUDA_OK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerBlock, 0));
    EXPECT(major == prop.major && minor == prop.minor);
    EXPECT(threads == prop.maxThreadsPerBlock);
    std::printf("attributes agree with properties: %s\n",
                major == prop.major && minor == prop.minor && threads == prop.maxThreadsPerBlock ? "yes" : "no");

    size_t free_bytes = 0, total_bytes = 0;
    CUDA_OK(cudaMemGetInfo(&free_bytes, &total_bytes));
    EXPECT(free_bytes <= total_bytes && total_bytes > 0);

    CUDA_EXPECT(cudaGetDeviceProperties(&prop, count), cudaErrorInvalidDevice);
    CUDA_EXPECT(cudaSetDevice(count + 7), cudaErrorInvalidDevice);
    // The failed calls above set the last error; reading it clears it.
    CUDA_EXPECT(cudaGetLastError(), cudaErrorInvalidDevice);
    CUDA_EXPECT(cudaGetLastError(), cudaSuccess);
    return finish("device_query");
}
