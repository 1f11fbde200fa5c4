// Atomic coverage. Every accumulator slot is hit by all threads; the operations are
// commutative (or applied identically by every thread), so final values are order-independent
// and exact. Exceptions: the f32 add slot 0 (rounding depends on order, compared with a tolerance).
// Inputs: vals (u32 random), acc_u / acc_s / acc_u64 (random initial values), slots (random).
//
// acc_u (u32, 12): min, max, and, or, xor, inc(limit 1000), dec(limit 1000), add, sub,
//                  CAS-loop add, shared-memory max of each block folded with atomicMax, and
//                  shared-memory and of each block folded with atomicAnd.
// acc_s (s32, 3): signed min, max, add.
// acc_u64 (u64, 4): add, min, max, CAS-loop xor.
// acc_f (f32, 2): [0] sum of vals as floats in [-1, 1) (order-dependent rounding),
//                 [1] sum of multiples of 1/256 (exactly representable: order-independent).
// slots/exch_old/cas_old: per-thread atomicExch and atomicCAS (success on odd values).
extern "C" __global__ void atomics(const unsigned* vals, unsigned* acc_u, int* acc_s,
                                   unsigned long long* acc_u64, float* acc_f, unsigned* slots,
                                   unsigned* slots2, unsigned* exch_old, unsigned* cas_old,
                                   unsigned n)
{
    __shared__ unsigned s_max;
    __shared__ unsigned s_and;

    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (threadIdx.x == 0) {
        s_max = 0u;
        s_and = 0xffffffffu;
    }
    __syncthreads();

    if (i < n) {
        unsigned v = vals[i];
        int sv = (int)v;
        atomicMin(&acc_u[0], v);
        atomicMax(&acc_u[1], v);
        atomicAnd(&acc_u[2], v | 0x00ff00ffu);
        atomicOr(&acc_u[3], v & 0x11111111u);
        atomicXor(&acc_u[4], v);
        atomicInc(&acc_u[5], 1000u);
        atomicDec(&acc_u[6], 1000u);
        atomicAdd(&acc_u[7], v);
        atomicSub(&acc_u[8], v >> 4);

        unsigned old = acc_u[9];
        unsigned assumed;
        do {
            assumed = old;
            old = atomicCAS(&acc_u[9], assumed, assumed + (v & 0xffffu));
        } while (old != assumed);

        atomicMax(&s_max, v >> 3);
        atomicAnd(&s_and, v | 0x0f0f0f0fu);

        atomicMin(&acc_s[0], sv);
        atomicMax(&acc_s[1], sv);
        atomicAdd(&acc_s[2], sv >> 8);

        unsigned long long w = ((unsigned long long)v << 17) ^ (unsigned long long)i;
        atomicAdd(&acc_u64[0], w);
        atomicMin(&acc_u64[1], w);
        atomicMax(&acc_u64[2], w);
        unsigned long long old64 = acc_u64[3];
        unsigned long long assumed64;
        do {
            assumed64 = old64;
            old64 = atomicCAS(&acc_u64[3], assumed64, assumed64 ^ w);
        } while (old64 != assumed64);

        float f = (float)(v >> 8) * (1.0f / 8388608.0f) - 1.0f;  // [-1, 1)
        atomicAdd(&acc_f[0], f);
        atomicAdd(&acc_f[1], floorf(f * 256.0f) * (1.0f / 256.0f));

        exch_old[i] = atomicExch(&slots[i], v);
        unsigned cur = slots2[i];
        unsigned expect = (v & 1u) ? cur : cur ^ 1u;
        cas_old[i] = atomicCAS(&slots2[i], expect, v);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicMax(&acc_u[10], s_max);
        atomicAnd(&acc_u[11], s_and);
    }
}
