// A CUDA C++ runtime-API program for the GPU machine: two streams, events with timing, and cuBLAS
// (SGEMM on one stream, HGEMM on the other) checked against a CPU reference.
//
// stdout is deterministic on one GPU (results, checksums of the output bits); timings go to stderr, so
// `local | diff - gleam` compares results only. Exit 1 if a result is off the CPU reference.
//
//   nvcc -O2 -o streams_cublas examples/cuda/streams_cublas.cu -lcublas
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define CUDA_OK(call)                                                                                     \
    do {                                                                                                  \
        cudaError_t e_ = (call);                                                                          \
        if (e_ != cudaSuccess) {                                                                          \
            std::printf("FAIL %s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));        \
            std::exit(1);                                                                                 \
        }                                                                                                 \
    } while (0)
#define CUBLAS_OK(call)                                                                                   \
    do {                                                                                                  \
        cublasStatus_t s_ = (call);                                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                \
            std::printf("FAIL %s:%d %s: cuBLAS status %d\n", __FILE__, __LINE__, #call, (int)s_);         \
            std::exit(1);                                                                                 \
        }                                                                                                 \
    } while (0)

// Values in [-0.5, 0.5] on a 1/64 grid: exact in fp16 and fp32.
static float value(uint32_t &state) {
    state = state * 1664525u + 1013904223u;
    return (float)((int)(state >> 25) - 64) / 128.0f;
}

static uint64_t fnv1a(const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

// With GLEAM_PRINT_MAPS=1: one "maps: PATH" line on stderr per mapped driver library (libcuda.so*,
// libgleamcuda*, libnvidia-*), as the PyTorch examples print (scripts/gpu/compare-pytorch.sh checks them).
static void print_driver_maps() {
    const char *flag = std::getenv("GLEAM_PRINT_MAPS");
    if (!flag || std::strcmp(flag, "1") != 0) return;
    FILE *maps = std::fopen("/proc/self/maps", "r");
    if (!maps) return;
    char line[4096];
    std::vector<std::string> seen;
    while (std::fgets(line, sizeof line, maps)) {
        char *path = std::strchr(line, '/');
        if (!path) continue;
        path[std::strcspn(path, "\n")] = 0;
        const char *base = std::strrchr(path, '/') + 1;
        bool driver = std::strncmp(base, "libcuda.so", 10) == 0 || std::strncmp(base, "libgleamcuda", 12) == 0 ||
                      std::strncmp(base, "libnvidia-", 10) == 0;
        bool known = false;
        for (auto &s : seen) known |= s == path;
        if (driver && !known) {
            seen.emplace_back(path);
            std::fprintf(stderr, "maps: %s\n", path);
        }
    }
    std::fclose(maps);
}

// Column-major C = A * B, A is m x k, B is k x n, in double.
static void reference(int m, int n, int k, const std::vector<float> &a, const std::vector<float> &b,
                      std::vector<double> &c) {
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double s = 0;
            for (int p = 0; p < k; p++) s += (double)a[i + p * m] * (double)b[p + j * k];
            c[i + j * m] = s;
        }
}

int main() {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);  // results survive a crash in the driver's teardown
    const int m = 256, n = 192, k = 128, reps = 10;
    uint32_t state = 12345;
    std::vector<float> a(m * k), b(k * n);
    for (auto &x : a) x = value(state);
    for (auto &x : b) x = value(state);
    std::vector<double> ref(m * n);
    reference(m, n, k, a, b, ref);

    std::vector<__half> ah(a.size()), bh(b.size());
    for (size_t i = 0; i < a.size(); i++) ah[i] = __float2half(a[i]);
    for (size_t i = 0; i < b.size(); i++) bh[i] = __float2half(b[i]);

    float *da, *db, *dc;
    __half *dah, *dbh, *dch;
    CUDA_OK(cudaMalloc(&da, a.size() * sizeof(float)));
    CUDA_OK(cudaMalloc(&db, b.size() * sizeof(float)));
    CUDA_OK(cudaMalloc(&dc, (size_t)m * n * sizeof(float)));
    CUDA_OK(cudaMalloc(&dah, ah.size() * sizeof(__half)));
    CUDA_OK(cudaMalloc(&dbh, bh.size() * sizeof(__half)));
    CUDA_OK(cudaMalloc(&dch, (size_t)m * n * sizeof(__half)));

    cudaStream_t s1, s2;
    CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t e1[2], e2[2], joined;
    for (int i = 0; i < 2; i++) {
        CUDA_OK(cudaEventCreate(&e1[i]));
        CUDA_OK(cudaEventCreate(&e2[i]));
    }
    CUDA_OK(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming));

    cublasHandle_t h1, h2;
    CUBLAS_OK(cublasCreate(&h1));
    CUBLAS_OK(cublasCreate(&h2));
    CUBLAS_OK(cublasSetStream(h1, s1));
    CUBLAS_OK(cublasSetStream(h2, s2));

    // Pinned staging buffers and asynchronous uploads, one stream each.
    float *pa, *pb;
    CUDA_OK(cudaMallocHost(&pa, a.size() * sizeof(float)));
    CUDA_OK(cudaMallocHost(&pb, b.size() * sizeof(float)));
    std::memcpy(pa, a.data(), a.size() * sizeof(float));
    std::memcpy(pb, b.data(), b.size() * sizeof(float));
    CUDA_OK(cudaMemcpyAsync(da, pa, a.size() * sizeof(float), cudaMemcpyHostToDevice, s1));
    CUDA_OK(cudaMemcpyAsync(db, pb, b.size() * sizeof(float), cudaMemcpyHostToDevice, s1));
    CUDA_OK(cudaMemcpyAsync(dah, ah.data(), ah.size() * sizeof(__half), cudaMemcpyHostToDevice, s2));
    CUDA_OK(cudaMemcpyAsync(dbh, bh.data(), bh.size() * sizeof(__half), cudaMemcpyHostToDevice, s2));

    const float one = 1.0f, zero = 0.0f;
    const __half one_h = __float2half(1.0f), zero_h = __float2half(0.0f);
    CUDA_OK(cudaEventRecord(e1[0], s1));
    for (int r = 0; r < reps; r++)
        CUBLAS_OK(cublasSgemm(h1, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, da, m, db, k, &zero, dc, m));
    CUDA_OK(cudaEventRecord(e1[1], s1));
    CUDA_OK(cudaEventRecord(e2[0], s2));
    for (int r = 0; r < reps; r++)
        CUBLAS_OK(cublasHgemm(h2, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one_h, dah, m, dbh, k, &zero_h, dch, m));
    CUDA_OK(cudaEventRecord(e2[1], s2));
    // Join: s1 waits for s2's GEMMs, then both results come back on s1.
    CUDA_OK(cudaEventRecord(joined, s2));
    CUDA_OK(cudaStreamWaitEvent(s1, joined, 0));
    std::vector<float> c(m * n);
    std::vector<__half> ch(m * n);
    CUDA_OK(cudaMemcpyAsync(c.data(), dc, c.size() * sizeof(float), cudaMemcpyDeviceToHost, s1));
    CUDA_OK(cudaMemcpyAsync(ch.data(), dch, ch.size() * sizeof(__half), cudaMemcpyDeviceToHost, s1));
    CUDA_OK(cudaStreamSynchronize(s1));
    CUDA_OK(cudaStreamQuery(s2));

    float t1 = -1, t2 = -1;
    CUDA_OK(cudaEventElapsedTime(&t1, e1[0], e1[1]));
    CUDA_OK(cudaEventElapsedTime(&t2, e2[0], e2[1]));
    std::fprintf(stderr, "time: sgemm %.3f ms, hgemm %.3f ms for %d each (%dx%dx%d)\n", t1, t2, reps, m, n, k);

    double err_s = 0, err_h = 0, sum_s = 0, sum_h = 0;
    for (int i = 0; i < m * n; i++) {
        err_s = std::fmax(err_s, std::fabs(c[i] - ref[i]));
        double hv = __half2float(ch[i]);
        err_h = std::fmax(err_h, std::fabs(hv - ref[i]));
        sum_s += c[i];
        sum_h += hv;
    }
    int bad = 0;
    std::printf("sgemm %dx%dx%d: sum %.6f, c[0] %.9g, c[last] %.9g, bits %016llx\n", m, n, k, sum_s, c[0],
                c[m * n - 1], (unsigned long long)fnv1a(c.data(), c.size() * sizeof(float)));
    std::printf("hgemm %dx%dx%d: sum %.4f, c[0] %.6g, bits %016llx\n", m, n, k, sum_h, __half2float(ch[0]),
                (unsigned long long)fnv1a(ch.data(), ch.size() * sizeof(__half)));
    std::printf("sgemm within 1e-4 of the CPU: %s\n", err_s <= 1e-4 ? "yes" : "NO");
    std::printf("hgemm within 0.0625 of the CPU: %s\n", err_h <= 0.0625 ? "yes" : "NO");
    std::printf("timed: %s\n", t1 >= 0 && t2 >= 0 ? "yes" : "NO");
    bad += err_s > 1e-4;
    bad += err_h > 0.0625;
    bad += !(t1 >= 0 && t2 >= 0);
    std::fprintf(stderr, "max error: sgemm %.3g hgemm %.3g\n", err_s, err_h);

    CUBLAS_OK(cublasDestroy(h1));
    CUBLAS_OK(cublasDestroy(h2));
    for (int i = 0; i < 2; i++) {
        CUDA_OK(cudaEventDestroy(e1[i]));
        CUDA_OK(cudaEventDestroy(e2[i]));
    }
    CUDA_OK(cudaEventDestroy(joined));
    CUDA_OK(cudaStreamDestroy(s1));
    CUDA_OK(cudaStreamDestroy(s2));
    CUDA_OK(cudaFreeHost(pa));
    CUDA_OK(cudaFreeHost(pb));
    for (void *p : {(void *)da, (void *)db, (void *)dc, (void *)dah, (void *)dbh, (void *)dch}) CUDA_OK(cudaFree(p));
    print_driver_maps();
    std::printf("%s streams_cublas\n", bad ? "FAIL" : "PASS");
    return bad ? 1 : 0;
}
