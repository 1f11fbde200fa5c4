// Shared by the runtime-API test programs: each prints deterministic lines and exits non-zero on a mismatch.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

static int g_failures = 0;

// Line-buffered stdout: a crash at exit (in the driver's teardown) must not swallow the results printed.
static const int g_line_buffered = std::setvbuf(stdout, nullptr, _IOLBF, 0);

// A CUDA call that must succeed.
#define CUDA_OK(call)                                                                               \
    do {                                                                                            \
        cudaError_t err_ = (call);                                                                  \
        if (err_ != cudaSuccess) {                                                                  \
            std::printf("FAIL %s:%d %s -> %s (%d)\n", __FILE__, __LINE__, #call,                    \
                        cudaGetErrorName(err_), (int)err_);                                         \
            std::exit(1);                                                                           \
        }                                                                                           \
    } while (0)

// A CUDA call that must fail with exactly `expected`.
#define CUDA_EXPECT(call, expected)                                                                 \
    do {                                                                                            \
        cudaError_t err_ = (call);                                                                  \
        std::printf("%s -> %s\n", #call, cudaGetErrorName(err_));                                   \
        if (err_ != (expected)) {                                                                   \
            std::printf("FAIL %s:%d expected %s\n", __FILE__, __LINE__, cudaGetErrorName(expected)); \
            g_failures++;                                                                           \
        }                                                                                           \
    } while (0)

// A condition on results.
#define EXPECT(cond)                                                                                \
    do {                                                                                            \
        if (!(cond)) {                                                                              \
            std::printf("FAIL %s:%d %s\n", __FILE__, __LINE__, #cond);                              \
            g_failures++;                                                                           \
        }                                                                                           \
    } while (0)

static int finish(const char *name) {
    if (g_failures) {
        std::printf("FAIL %s: %d check(s) failed\n", name, g_failures);
        return 1;
    }
    std::printf("PASS %s\n", name);
    return 0;
}
