/* What NVIDIA's driver answers to the pre-CUDA-12 names of the stream memory operations and to the
 * pre-3.2 cuCtxCreate (fixtures for Gleam's answers; see tests/remote/driver_streams.c, old-names).
 *   gcc -o v1_names tools/gpu/v1_names.c -ldl && ./v1_names */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
typedef void *CUcontext;

int main(void) {
    void *d = dlopen("libcuda.so.1", RTLD_NOW);
    if (!d) { printf("no driver: %s\n", dlerror()); return 1; }
#define SYM(R, n, ...) R (*n)(__VA_ARGS__) = (R(*)(__VA_ARGS__))dlsym(d, #n)
    SYM(CUresult, cuInit, unsigned);
    SYM(CUresult, cuDevicePrimaryCtxRetain, CUcontext *, int);
    SYM(CUresult, cuCtxSetCurrent, CUcontext);
    SYM(CUresult, cuMemAlloc_v2, CUdeviceptr *, size_t);
    SYM(CUresult, cuStreamCreate, CUstream *, unsigned);
    SYM(CUresult, cuStreamSynchronize, CUstream);
    SYM(CUresult, cuCtxCreate, CUcontext *, unsigned, int);
    SYM(CUresult, cuStreamWriteValue32, CUstream, CUdeviceptr, unsigned, unsigned);
    SYM(CUresult, cuStreamWaitValue32, CUstream, CUdeviceptr, unsigned, unsigned);
    SYM(CUresult, cuStreamWriteValue64, CUstream, CUdeviceptr, unsigned long long, unsigned);
    SYM(CUresult, cuStreamWaitValue64, CUstream, CUdeviceptr, unsigned long long, unsigned);
    SYM(CUresult, cuStreamBatchMemOp, CUstream, unsigned, void *, unsigned);
    SYM(CUresult, cuStreamWriteValue32_v2, CUstream, CUdeviceptr, unsigned, unsigned);
    SYM(CUresult, cuDeviceGetAttribute, int *, int, int);
    CUcontext ctx, c1 = 0;
    CUstream s;
    CUdeviceptr p;
    int v = -1;
    printf("cuInit %d\n", cuInit(0));
    printf("cuDevicePrimaryCtxRetain %d\n", cuDevicePrimaryCtxRetain(&ctx, 0));
    printf("cuCtxSetCurrent %d\n", cuCtxSetCurrent(ctx));
    cuDeviceGetAttribute(&v, 76 /* CAN_USE_STREAM_MEM_OPS_V1 */, 0);
    printf("attribute 76 (stream mem ops v1) %d\n", v);
    printf("cuMemAlloc_v2 %d\n", cuMemAlloc_v2(&p, 64));
    printf("cuStreamCreate %d\n", cuStreamCreate(&s, 1));
    printf("cuStreamWriteValue32 %d\n", cuStreamWriteValue32 ? cuStreamWriteValue32(s, p, 4, 0) : -1);
    printf("cuStreamWaitValue32 %d\n", cuStreamWaitValue32 ? cuStreamWaitValue32(s, p, 4, 1) : -1);
    printf("cuStreamWriteValue64 %d\n", cuStreamWriteValue64 ? cuStreamWriteValue64(s, p + 8, 4, 0) : -1);
    printf("cuStreamWaitValue64 %d\n", cuStreamWaitValue64 ? cuStreamWaitValue64(s, p + 8, 4, 1) : -1);
    unsigned long long op[6];
    memset(op, 0, sizeof op);
    op[0] = 2; /* CU_STREAM_MEM_OP_WRITE_VALUE_32 */
    op[1] = p;
    op[2] = 5;
    printf("cuStreamBatchMemOp %d\n", cuStreamBatchMemOp ? cuStreamBatchMemOp(s, 1, op, 0) : -1);
    printf("cuStreamWriteValue32_v2 %d\n", cuStreamWriteValue32_v2(s, p, 4, 0));
    printf("cuStreamSynchronize %d\n", cuStreamSynchronize(s));
    printf("cuCtxCreate (pre-3.2) %d\n", cuCtxCreate(&c1, 0, 0));
    printf("cuCtxCreate flags 4 %d\n", cuCtxCreate(&c1, 4, 0));
    return 0;
}
