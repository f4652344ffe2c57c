// Page descriptors and element access shared by cache_write.cu and decode_attention.cu.
//
// A PageDesc is one kvcal.runtime.layout.PageLayout flattened to ints. The Python side builds the descriptor table
// (int32 [n_desc, sizeof(PageDesc) / 4]) from PageLayout by parsing the field names below, so the byte layout is
// computed once, in Python, and never re-derived here. Field order here = column order there (kvcal/runtime/cuda/
// plan.py `desc_fields`); add a field here and give it a value in `plan._desc_values`.
//
// The loader inlines this file in place of its #include (kvcal/runtime/cuda/backend.py `kernel_text`), so the NVRTC
// cache key covers it.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

struct PageDesc {
    int tokens;       // T: token slots per page
    int r_k;          // stored key rank of the head (rotated, truncated K)
    int r_v;          // stored value rank (projected V)
    int k_bits;       // 2, 3, 4, 8: packed codes; 16, 32: raw floats
    int v_bits;
    int k_channel;    // 1: per-channel key (scale, zero) [r_k, 2] over the page's tokens (KIVI); 0: per token
    int k_group;      // channels per per-token key (scale, zero) group (r_k when ungrouped)
    int v_group;      // channels per value group
    int k_bytes;      // bytes per token of the k segment
    int v_bytes;
    int k_groups;     // per-token key groups (0 for per-channel or raw keys)
    int v_groups;     // value groups (0 for raw values)
    int k_off;        // segment offsets, bytes from the page start
    int k_meta_off;
    int v_off;
    int v_meta_off;
    int score_off;
    int pos_off;      // score_off, pos_off: -1 when the tier keeps no score or position (untracked)
    int end;          // bytes of the page in use
    int raw_bf16;     // 1: 16-bit raw tiers hold bfloat16 (the store's `raw16`), 0: float16
    int meta8;        // 1: (scale, zero) pairs are 8-bit codes (kvcal.runtime.quant.meta8_encode), 0: two fp16
    int side;         // the tier (0 high, 1 low): which half of the layer's level table its rows are in
    int k_levels;     // 1: key codes index the head's calibrated levels (level table), 0: the uniform grid
    int v_levels;
};

// The layer's calibrated levels, float [2 tiers, H, 2 (K, V), LEVEL_ROW] (kvcal.runtime.storage.levels
// .kernel_table): a code c of a calibrated side means levels[c] instead of c. Null when every side is uniform.
#define LEVEL_ROW 256
__device__ __forceinline__ const float* level_row(const float* levels, const PageDesc& L, int H, int h, int which)
{
    const int on = which ? L.v_levels : L.k_levels;
    return on ? levels + (((long long)L.side * H + h) * 2 + which) * LEVEL_ROW : nullptr;
}

// 8-bit (scale, zero) codes: kvcal.runtime.quant.LOG_SCALES, META8_ZERO_UNITS. A scale is the fp16 rounding of
// 2^((c % 16) / 16) times 2^(c / 16 - 10): exp2f is within 2 fp32 ulps and every 2^(k/16) lies at least 800 ulps from
// an fp16 rounding boundary, so the rounding is exact and both decoded values equal the torch reference's.
__device__ __forceinline__ float pow2(int e) { return __int_as_float((e + 127) << 23); }     // normal e only
__device__ __forceinline__ float meta8_scale(int c)
{
    return __fmul_rn(__half2float(__float2half_rn(exp2f((float)(c & 15) * 0.0625f))), pow2((c >> 4) - 10));
}
__device__ __forceinline__ float meta8_unit(int bits) { return pow2(bits - 5); }     // zero code unit, in steps

// code (or lut[code], calibrated levels) * (scale, zero) pair `i` of the meta segment at `meta`: level * scale + zero,
// fp32 multiply then fp32 add (no FMA), what quant.dequantize_* computes
template <bool META8>
__device__ __forceinline__ float dequant(unsigned code, const float* lut, const unsigned char* meta, int i, int bits)
{
    float s, z;
    if (META8) {
        s = meta8_scale(meta[2 * i]);
        z = __fmul_rn((float)(signed char)meta[2 * i + 1], __fmul_rn(s, meta8_unit(bits)));
    } else {
        const __half* h = reinterpret_cast<const __half*>(meta) + 2 * i;
        s = __half2float(h[0]);
        z = __half2float(h[1]);
    }
    return __fadd_rn(__fmul_rn(lut ? lut[code] : (float)code, s), z);
}

// bits-wide code d of a packed row: bits [d * bits, (d + 1) * bits) of its little-endian bit stream
// (kvcal.runtime.storage.quant.pack); a 3-bit code may straddle two bytes, and the second is read only then
__device__ __forceinline__ unsigned code_at(const unsigned char* row, int d, int bits)
{
    const int bit = d * bits, off = bit & 7;
    unsigned code = row[bit >> 3] >> off;
    if (off + bits > 8) code |= (unsigned)row[(bit >> 3) + 1] << (8 - off);
    return code & ((1u << bits) - 1u);
}

__device__ __forceinline__ float raw_at(const unsigned char* row, int d, int bits, int bf16)
{
    if (bits == 32) return reinterpret_cast<const float*>(row)[d];
    const unsigned short u = reinterpret_cast<const unsigned short*>(row)[d];
    return bf16 ? __bfloat162float(__ushort_as_bfloat16(u)) : __half2float(__ushort_as_half(u));
}

// Key channel d of token slot t in `page`; lut: the head's key levels (level_row) or null (META8 = L.meta8: callers
// branch once, outside their loops)
template <bool META8>
__device__ __forceinline__ float key_at(const unsigned char* page, const PageDesc& L, int t, int d, const float* lut)
{
    const unsigned char* row = page + L.k_off + t * L.k_bytes;
    if (L.k_bits >= 16) return raw_at(row, d, L.k_bits, L.raw_bf16);
    const int pair = L.k_channel ? d : t * L.k_groups + d / L.k_group;   // [r_k, 2] or [T, k_groups, 2]
    return dequant<META8>(code_at(row, d, L.k_bits), lut, page + L.k_meta_off, pair, L.k_bits);
}

// Value channel d of token slot t in `page` (values are always per token; lut and META8 as key_at)
template <bool META8>
__device__ __forceinline__ float value_at(const unsigned char* page, const PageDesc& L, int t, int d, const float* lut)
{
    const unsigned char* row = page + L.v_off + t * L.v_bytes;
    if (L.v_bits >= 16) return raw_at(row, d, L.v_bits, L.raw_bf16);
    return dequant<META8>(code_at(row, d, L.v_bits), lut, page + L.v_meta_off, t * L.v_groups + d / L.v_group,
                          L.v_bits);
}

__device__ __forceinline__ float warp_max(float x)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_min(float x)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
