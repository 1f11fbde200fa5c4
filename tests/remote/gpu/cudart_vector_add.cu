// A plain CUDA runtime program (static cudart, nvcc's default): exercises cudart's loader path
// (cuGetProcAddress, cuGetExportTable, fatbin registration through the library API) through Gleam's shim.
// Built and run on the GPU machine by tests/remote/gpu/check.sh; CI has no nvcc.
#include <cstdio>
#include <cstdlib>

__global__ void add(const float *a, const float *b, float *c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

#define CHECK(x)                                                                        \
    do {                                                                                \
        cudaError_t e_ = (x);                                                           \
        if (e_ != cudaSuccess) {                                                        \
            printf("FAIL %s: %s (%s)\n", #x, cudaGetErrorName(e_), cudaGetErrorString(e_)); \
            return 1;                                                                   \
        }                                                                               \
    } while (0)

int main() {
    int count = 0, version = 0;
    CHECK(cudaGetDeviceCount(&count));
    CHECK(cudaDriverGetVersion(&version));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("devices=%d driver=%d name=%s sm_%d%d\n", count, version, prop.name, prop.major, prop.minor);
    const int n = 1 << 20;
    float *a = (float *)malloc(n * sizeof(float)), *b = (float *)malloc(n * sizeof(float)),
          *c = (float *)malloc(n * sizeof(float));
    for (int i = 0; i < n; i++) { a[i] = i * 0.5f; b[i] = 1.0f - i; }
    float *da, *db, *dc;
    CHECK(cudaMalloc(&da, n * sizeof(float)));
    CHECK(cudaMalloc(&db, n * sizeof(float)));
    CHECK(cudaMalloc(&dc, n * sizeof(float)));
    CHECK(cudaMemcpy(da, a, n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, b, n * sizeof(float), cudaMemcpyHostToDevice));
    add<<<(n + 255) / 256, 256>>>(da, db, dc, n);
    CHECK(cudaGetLastError());
    add<<<1, 4096>>>(da, db, dc, n);  // too many threads: must fail at launch
    cudaError_t bad = cudaGetLastError();
    printf("oversized launch: %s\n", cudaGetErrorName(bad));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(c, dc, n * sizeof(float), cudaMemcpyDeviceToHost));
    double sum = 0;
    for (int i = 0; i < n; i++) {
        if (c[i] != a[i] + b[i]) { printf("FAIL at %d\n", i); return 2; }
        sum += c[i];
    }
    printf("sum=%.1f\n", sum);
    CHECK(cudaFree(da));
    CHECK(cudaFree(db));
    CHECK(cudaFree(dc));
    printf("OK\n");
    return 0;
}
