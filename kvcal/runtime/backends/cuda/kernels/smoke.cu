// Smoke kernel for the NVRTC toolchain: dequantize 4-bit per-token codes to fp16.
//
//   codes: uint8 [T, n / 2]   two codes per byte, element 0 in the low nibble (as kvcal.runtime.quant.pack, bits=4)
//   scale: fp16  [T]          per-token step
//   zero:  fp16  [T]          per-token offset
//   out:   fp16  [T, n]       out[t, i] = code[t, i] * scale[t] + zero[t]
//
// Arithmetic is fp32 multiply, then fp32 add (no FMA contraction), then round to fp16: bit for bit what
// kvcal.runtime.quant.dequantize_per_token(...).half() computes, so the GPU test can demand exact equality.
//
// Each thread handles 8 codes: one 4-byte load, one 16-byte store. Assumes n % 8 == 0 and 16-byte aligned rows of
// `out` (true for contiguous torch tensors with n % 8 == 0); the launcher checks n. Launch a 1-D grid covering
// T * n / 8 threads (kvcal.runtime.cuda.launch.grid_for).
#include <cuda_fp16.h>

extern "C" __global__ void dequant_u4_per_token(const unsigned int* __restrict__ codes,  // [T, n / 8] as u32 words
                                                const __half* __restrict__ scale, const __half* __restrict__ zero,
                                                __half* __restrict__ out, int n_tokens, int n)
{
    const int words_per_row = n >> 3;                                   // 8 codes per u32 word
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // 64-bit: T * n / 8 may exceed 2^31
    if (g >= (long long)n_tokens * words_per_row) return;
    const int t = (int)(g / words_per_row);

    const unsigned int w = __ldg(codes + g);
    const float s = __half2float(scale[t]);
    const float z = __half2float(zero[t]);

    __half2 h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {                                       // nibbles 2j (low) and 2j+1 (high)
        const float lo = (float)((w >> (8 * j)) & 0xFu);
        const float hi = (float)((w >> (8 * j + 4)) & 0xFu);
        h[j] = __floats2half2_rn(__fadd_rn(__fmul_rn(lo, s), z), __fadd_rn(__fmul_rn(hi, s), z));
    }
    reinterpret_cast<uint4*>(out)[g] = *reinterpret_cast<const uint4*>(h);   // 8 halves = 16 bytes
}
