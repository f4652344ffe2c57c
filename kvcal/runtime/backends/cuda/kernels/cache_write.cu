// Cache write: quantize and pack tokens into their page slots, with (scale, zero), score and position metadata.
//
//   write_tokens        one warp per token, per-token formats: K (unless per-channel or write_keys == 0) and V as
//                       packed codes + fp16 (scale, zero) per channel group, or raw floats; then score and pos.
//   write_channel_keys  one block per page, per-channel keys (KIVI): (scale, zero) per channel over the page's T
//                       tokens, then the packed codes. The page's values/score/pos go through write_tokens with
//                       write_keys = 0.
//
// Where each token goes (page byte offset, slot, descriptor row) is computed in Python (kvcal/runtime/cuda/plan.py
// `write_plan`) from the store's page tables; segment offsets come from PageDesc (page_desc.cuh). Rounding follows
// kvcal.runtime.quant exactly: fp32 min/max, scale = fp16((max - min) / (2^bits - 1)), zero = fp16(min) (meta8
// formats: their 8-bit codes, quant.meta8_encode), codes = clamp(rint((x - zero) / scale), 0, 2^bits - 1), 0 where
// scale == 0; IEEE division, round-half-even (= torch.round); calibrated sides: the nearest level (`encode`).
// Checked on a GPU by tests/test_cuda_backend.py and tests/test_levels.py (`-m gpu`), on the CPU through its
// emulation (kvcal/runtime/backends/cuda/emulate.py).
#include "page_desc.cuh"

#define WARPS 4
#define MAX_GROUPS 32          // per-token (scale, zero) groups per vector; the plan checks it
#define MAX_RANK 256           // per-channel keys: channels per page

// lut: the head's calibrated levels of this side (level_row), or null for the uniform grid. With levels the code is
// the nearest level, ties to the lower: the number of midpoints (lut[k] + lut[k + 1]) / 2 below u, as
// quant.nearest_level counts them
__device__ __forceinline__ unsigned encode(float x, float s, float z, int bits, const float* lut)
{
    if (s == 0.f) return 0u;
    const float u = __fdiv_rn(__fsub_rn(x, z), s);
    if (lut) {
        unsigned c = 0;
        for (int k = 0; k + 1 < (1 << bits); ++k) c += u > __fmul_rn(__fadd_rn(lut[k], lut[k + 1]), 0.5f);
        return c;
    }
    return (unsigned)fminf(fmaxf(rintf(u), 0.f), (float)((1 << bits) - 1));
}

// The part of a code that lands in one byte of the packed row, `shift` = the code's first bit minus the byte's first
// bit (negative for the high part of a code that straddles into this byte from the one before; kvcal.runtime.storage
// .quant.pack's bit stream)
__device__ __forceinline__ unsigned code_bits(unsigned code, int shift)
{
    return (shift >= 0 ? code << shift : code >> -shift) & 0xFFu;
}

// (scale, zero) of [mn, mx] at `bits`, written as pair `i` of the meta segment at `meta`: two fp16, or
// quant.meta8_encode's codes (the smallest grid scale whose grid covers [mn, mx] from an int8 zero code)
__device__ __forceinline__ float2 put_meta(unsigned char* meta, int i, int meta8, int bits, float mn, float mx)
{
    const float levels = (float)((1 << bits) - 1);
    const float step = __fdiv_rn(__fsub_rn(mx, mn), levels);
    if (!meta8) {
        const __half hs = __float2half_rn(step), hz = __float2half_rn(mn);
        reinterpret_cast<__half*>(meta)[2 * i] = hs;
        reinterpret_cast<__half*>(meta)[2 * i + 1] = hz;
        return make_float2(__half2float(hs), __half2float(hz));
    }
    const float unit = meta8_unit(bits);
    int c = 0;
    while (c < 255 && meta8_scale(c) < step) ++c;
    float s, zc;
    for (;; ++c) {
        s = meta8_scale(c);
        const float u = __fmul_rn(s, unit);
        zc = floorf(__fdiv_rn(mn, u));
        const bool covered = !(__fadd_rn(__fmul_rn(zc, u), __fmul_rn(levels, s)) < mx) && zc >= -128.f && zc <= 127.f;
        if (covered || c == 255) break;
    }
    zc = fminf(fmaxf(zc, -128.f), 127.f);
    meta[2 * i] = (unsigned char)c;
    meta[2 * i + 1] = (unsigned char)(signed char)zc;
    return make_float2(s, __fmul_rn(zc, __fmul_rn(s, unit)));
}

// One warp writes one token's vector x [r] at slot t: codes into `off`, (scale, zero) pairs into `meta_off`
__device__ __forceinline__ void put_vector(unsigned char* page, int off, int meta_off, int nbytes, int bits,
                                           int group, int groups, int raw_bf16, int meta8, int t, const float* x,
                                           int r, const float* lut, float2* sz_warp)
{
    const int lane = threadIdx.x & 31;
    unsigned char* row = page + off + t * nbytes;
    if (bits >= 16) {
        for (int d = lane; d < r; d += 32) {
            if (bits == 32) reinterpret_cast<float*>(row)[d] = x[d];
            else if (raw_bf16) reinterpret_cast<__nv_bfloat16*>(row)[d] = __float2bfloat16_rn(x[d]);
            else reinterpret_cast<__half*>(row)[d] = __float2half_rn(x[d]);
        }
        return;
    }
    unsigned char* meta = page + meta_off + t * groups * (meta8 ? 2 : 4);
    for (int gi = 0; gi < groups; ++gi) {
        float mn = __int_as_float(0x7f800000), mx = -mn;
        for (int d = gi * group + lane; d < (gi + 1) * group; d += 32) { mn = fminf(mn, x[d]); mx = fmaxf(mx, x[d]); }
        mn = warp_min(mn);
        mx = warp_max(mx);
        if (lane == 0) sz_warp[gi] = put_meta(meta, gi, meta8, bits, mn, mx);
    }
    __syncwarp();
    for (int b = lane; b < nbytes; b += 32) {     // one lane per output byte, whatever the groups
        unsigned byte = 0;
        for (int d = 8 * b / bits; d < r && d * bits < 8 * b + 8; ++d) {
            const float2 sz = sz_warp[d / group];
            byte |= code_bits(encode(x[d], sz.x, sz.y, bits, lut), d * bits - 8 * b);
        }
        row[b] = (unsigned char)byte;             // a trailing partial byte is zero-padded
    }
    __syncwarp();                                 // sz_warp is reused by the next vector
}

// at least 4 blocks per SM, as decode_split: without it ptxas held this kernel to 56 registers and spilled
extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) write_tokens(
    unsigned char* __restrict__ arena,
    const int* __restrict__ descs,                // [n_desc, sizeof(PageDesc) / 4]
    const long long* __restrict__ tok_page_off,   // [n] byte offset of the page holding each token
    const int* __restrict__ tok_slot,             // [n] slot within that page
    const int* __restrict__ tok_desc,             // [n] descriptor row
    const float* __restrict__ keys,               // [n, k_stride] rotated keys (first r_k channels are stored)
    const float* __restrict__ values,             // [n, v_stride] projected values
    const int* __restrict__ pos,                  // [n]
    const float* __restrict__ score,              // [n]
    const float* __restrict__ levels,             // [2, H, 2, LEVEL_ROW] calibrated levels, or null (page_desc.cuh)
    const int* __restrict__ tok_head,             // [n] KV head of each token (its level rows)
    int n_tokens, int k_stride, int v_stride, int write_keys, int H)
{
    __shared__ float2 sz[WARPS][MAX_GROUPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.x * WARPS + warp;
    if (i >= n_tokens) return;                    // whole warps exit together: the __syncwarp()s stay legal
    const PageDesc L = reinterpret_cast<const PageDesc*>(descs)[tok_desc[i]];
    unsigned char* page = arena + tok_page_off[i];
    const int t = tok_slot[i], h = tok_head[i];
    if (write_keys && !L.k_channel)
        put_vector(page, L.k_off, L.k_meta_off, L.k_bytes, L.k_bits, L.k_group, L.k_groups, L.raw_bf16, L.meta8,
                   t, keys + (long long)i * k_stride, L.r_k, level_row(levels, L, H, h, 0), sz[warp]);
    put_vector(page, L.v_off, L.v_meta_off, L.v_bytes, L.v_bits, L.v_group, L.v_groups, L.raw_bf16, L.meta8, t,
               values + (long long)i * v_stride, L.r_v, level_row(levels, L, H, h, 1), sz[warp]);
    if (lane == 0 && L.pos_off >= 0) {          // untracked tiers keep no score or position
        reinterpret_cast<float*>(page + L.score_off)[t] = score[i];
        reinterpret_cast<int*>(page + L.pos_off)[t] = pos[i];
    }
}

extern "C" __global__ void __launch_bounds__(128) write_channel_keys(
    unsigned char* __restrict__ arena,
    const int* __restrict__ descs,
    const long long* __restrict__ page_off,       // [n_pages] byte offset of each whole page written
    const int* __restrict__ page_desc,            // [n_pages]
    const float* __restrict__ keys,               // [n_pages, T, k_stride] the page's keys, slot order
    const float* __restrict__ levels,             // as write_tokens
    const int* __restrict__ page_head,            // [n_pages] KV head of each page
    int n_pages, int k_stride, int H)
{
    __shared__ float2 sz[MAX_RANK];
    __shared__ PageDesc L;
    const int pg = blockIdx.x;
    if (pg >= n_pages) return;
    if (threadIdx.x == 0) L = reinterpret_cast<const PageDesc*>(descs)[page_desc[pg]];
    __syncthreads();
    unsigned char* page = arena + page_off[pg];
    const float* x = keys + (long long)pg * L.tokens * k_stride;
    const float* lut = level_row(levels, L, H, page_head[pg], 0);
    for (int d = threadIdx.x; d < L.r_k; d += blockDim.x) {                  // one thread per channel
        float mn = __int_as_float(0x7f800000), mx = -mn;
        for (int t = 0; t < L.tokens; ++t) { mn = fminf(mn, x[t * k_stride + d]); mx = fmaxf(mx, x[t * k_stride + d]); }
        sz[d] = put_meta(page + L.k_meta_off, d, L.meta8, L.k_bits, mn, mx);   // [r_k] pairs
    }
    __syncthreads();
    for (int e = threadIdx.x; e < L.tokens * L.k_bytes; e += blockDim.x) {  // one thread per output byte
        const int t = e / L.k_bytes, b = e % L.k_bytes;
        unsigned byte = 0;
        for (int d = 8 * b / L.k_bits; d < L.r_k && d * L.k_bits < 8 * b + 8; ++d)
            byte |= code_bits(encode(x[t * k_stride + d], sz[d].x, sz[d].y, L.k_bits, lut), d * L.k_bits - 8 * b);
        page[L.k_off + t * L.k_bytes + b] = (unsigned char)byte;
    }
}
