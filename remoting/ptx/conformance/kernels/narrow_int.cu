// Narrow integer coverage: u8/s8/u16/s16 loads and stores, sign and zero extension, 16-bit
// arithmetic with wrap-around, and the SIMD-in-a-word intrinsics (__vadd2, __vsub4, __vabsdiffu4,
// __vcmpgtu4, __vmaxs2, __vsads4). Inputs: bytes (u8), halves (u16, read also as s16), words (u32).
// Outputs: o8 (u8, 4 per thread), o16 (u16, 4 per thread), o32 (u32, 8 per thread). All exact.
extern "C" __global__ void narrow_int(const unsigned char* bytes, const unsigned short* halves,
                                      const unsigned* words, unsigned char* o8, unsigned short* o16,
                                      unsigned* o32, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    unsigned char b = bytes[i];
    signed char sb = (signed char)bytes[(i * 7u) % n];
    unsigned short h = halves[i];
    short sh = (short)halves[(i + 3u) % n];
    unsigned w = words[i];
    unsigned w2 = words[(i * 13u + 5u) % n];

    o8[i * 4 + 0] = (unsigned char)(b + sb);
    o8[i * 4 + 1] = (unsigned char)(b * 3u);
    o8[i * 4 + 2] = (unsigned char)(sb >> 2);
    o8[i * 4 + 3] = (unsigned char)(b > (unsigned char)sb ? b : sb);

    o16[i * 4 + 0] = (unsigned short)(h + (unsigned short)sh);
    o16[i * 4 + 1] = (unsigned short)(h * (unsigned short)b);
    o16[i * 4 + 2] = (unsigned short)(sh / (short)((b & 7u) + 1u));
    o16[i * 4 + 3] = (unsigned short)((int)sh * (int)sb >> 3);

    unsigned* o = o32 + (size_t)i * 8;
    o[0] = (unsigned)(int)sb;
    o[1] = (unsigned)(int)sh;
    o[2] = __vadd2(w, w2);
    o[3] = __vsub4(w, w2);
    o[4] = __vabsdiffu4(w, w2);
    o[5] = __vcmpgtu4(w, w2);
    o[6] = __vmaxs2(w, w2);
    o[7] = __vsads4(w, w2);
}
