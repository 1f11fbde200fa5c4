// A per-thread array indexed with data-dependent indices, so it must live in local memory:
// filled from the input, permuted, insertion-sorted, then read at data-dependent positions.
// Output: LOCAL_RESULTS u32 per thread.
#define LOCAL_LEN 24
#define LOCAL_RESULTS 4

extern "C" __global__ void local_array(const unsigned* in, unsigned* out, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    unsigned v = in[i];
    unsigned arr[LOCAL_LEN];
    unsigned h = v;
    for (int j = 0; j < LOCAL_LEN; ++j) {
        h = h * 1664525u + 1013904223u;
        arr[j] = h >> 8;
    }
    // Data-dependent swaps.
    for (int j = 0; j < LOCAL_LEN; ++j) {
        unsigned k = (arr[j] ^ v) % LOCAL_LEN;
        unsigned t = arr[j];
        arr[j] = arr[k];
        arr[k] = t;
    }
    unsigned* o = out + (size_t)i * LOCAL_RESULTS;
    o[0] = arr[v % LOCAL_LEN];
    for (int j = 1; j < LOCAL_LEN; ++j) {
        unsigned key = arr[j];
        int m = j - 1;
        while (m >= 0 && arr[m] > key) {
            arr[m + 1] = arr[m];
            --m;
        }
        arr[m + 1] = key;
    }
    o[1] = arr[0];
    o[2] = arr[(v >> 8) % LOCAL_LEN];
    o[3] = arr[LOCAL_LEN - 1];
}
