// Fused decode attention and token writes over kvcal's page arena, for CPUs (C ABI, loaded with ctypes).
//
// Pages are read in place: keys and values are dequantized a page at a time into a small buffer, so no dequantized
// K/V of the layer exists at any time. Every byte offset comes from the descriptor table built in Python from
// kvcal.runtime.layout.PageLayout (struct Desc mirrors kvcal/runtime/cpu/backend.py DESC_FIELDS, all int32).
//
// decode: one layer, W = B * H items (item = b * H + h), qn = g * n query rows per item (row = gi * n + i).
//   split  tasks of up to `chunk` pages of one item, in parallel: online softmax (m, l, acc) over their pages,
//          logits kept per page for the score pass.
//   merge  per item: partials + the m exact tokens (the window, every query sees; then the n new tokens, causal
//          among themselves) -> out, the exact tokens' scores, and
//          score += sum over the n queries of max over g of each stored token's probability, in the page.
// write: per-token formats, one token per (b, h, slot) request; quantization is kvcal.runtime.quant's, bit for bit
//   (fp32 min/max, scale and zero rounded to fp16 first, or their 8-bit codes (meta8_encode) for `meta8` formats,
//   codes = clamp(rint((x - zero) / scale))). A side with calibrated levels (Desc k_levels / v_levels) reads its codes
//   through its KV head's row of the layer's level table `luts` [2 sides, H, 2 (K, V), 256] float32 (x = zero + scale *
//   lut[code]) and writes the nearest level to u = (x - zero) / scale, ties to the lower (quant.nearest_level).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef __F16C__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

struct Desc {
    int32_t tokens, r_k, r_v, k_bits, v_bits, k_channel, k_group, v_group, k_bytes, v_bytes, k_groups, v_groups,
        k_off, k_meta_off, v_off, v_meta_off, score_off, pos_off, raw_bf16, meta8, k_levels, v_levels;
};
constexpr int DESC_INTS = sizeof(Desc) / sizeof(int32_t);
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int HIGH = 0;
constexpr int LUT = 256;           // floats per level row of the table (kvcal.runtime.storage.levels.KERNEL_ROW)

// The level row of side `which` (0 = K, 1 = V) of KV head h in tier `side` (descriptor row & 1), or nullptr for a
// uniform side (its fast path: the code is the level).
inline const float* level_row(const float* luts, const Desc& D, int side, int64_t H, int64_t h, int which) {
    if (!luts || !(which ? D.v_levels : D.k_levels)) return nullptr;
    return luts + ((side * H + h) * 2 + which) * LUT;
}

inline float bits_f32(uint32_t w) { float f; std::memcpy(&f, &w, 4); return f; }
inline uint32_t f32_bits(float f) { uint32_t w; std::memcpy(&w, &f, 4); return w; }

// IEEE half <-> float (c10's fp16_ieee_{to,from}_fp32_value: exact, round to nearest even). Reading uses the F16C
// instruction where the CPU has it (exact too; -march=native turns it on), since every token's metadata goes through
// it.
#ifdef __F16C__
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
}
#endif
inline uint16_t float_to_half(float f) {
    float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
inline float bf16_to_float(uint16_t h) { return bits_f32((uint32_t)h << 16); }
inline uint16_t float_to_bf16(float f) {
    if (std::isnan(f)) return 0x7FC0;
    const uint32_t u = f32_bits(f);
    return (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// 8-bit (scale, zero) pairs: kvcal.runtime.quant.LOG_SCALES[:16] * 2**10, META8_MIN_EXP, META8_ZERO_UNITS. Both decoded values
// are exact products, so they equal the torch reference's.
constexpr float LOG_MANTISSAS[16] = {0x1p+0f, 0x1.0b4p+0f, 0x1.174p+0f, 0x1.238p+0f, 0x1.308p+0f, 0x1.3ep+0f, 0x1.4cp+0f, 0x1.5acp+0f,
                                     0x1.6ap+0f, 0x1.7ap+0f, 0x1.8acp+0f, 0x1.9c4p+0f, 0x1.ae8p+0f, 0x1.c18p+0f, 0x1.d58p+0f, 0x1.ea4p+0f};
// Every scale code's scale, made once: std::ldexp is a library call, and values read one (scale, zero) pair per group
// and token.
const std::array<float, 256> META8_SCALES = [] {
    std::array<float, 256> scales{};
    for (int c = 0; c < 256; ++c) scales[c] = std::ldexp(LOG_MANTISSAS[c & 15], (c >> 4) - 10);
    return scales;
}();
inline float meta8_scale(int c) { return META8_SCALES[c]; }
inline float meta8_unit(int bits) { return (float)(1 << bits) * 0x1p-5f; }   // zero code unit in steps (2**(bits-5))

// One (scale, zero) pair of a page: two fp16, or 8-bit codes (uint8 scale code, int8 zero code).
inline void read_meta(const uint8_t* pair, bool meta8, int bits, float* s, float* z) {
    if (meta8) {
        *s = meta8_scale(pair[0]);
        *z = (float)(int8_t)pair[1] * (*s * meta8_unit(bits));
    } else {
        *s = half_to_float(load_u16(pair));
        *z = half_to_float(load_u16(pair + 2));
    }
}

// quant.meta8_encode for one group: the smallest grid scale whose grid covers [mn, mx] from an int8 zero code.
inline void meta8_encode(float mn, float mx, int bits, uint8_t* pair, float* s, float* z) {
    const int top = (1 << bits) - 1;
    const float unit = meta8_unit(bits), step = (mx - mn) / (float)top;
    // the first scale code whose scale reaches step (the table rises), as quant's searchsorted finds it
    int c = (int)(std::lower_bound(META8_SCALES.begin(), META8_SCALES.begin() + 255, step) - META8_SCALES.begin());
    float zc;
    for (;; ++c) {
        *s = meta8_scale(c);
        zc = std::floor(mn / (*s * unit));
        const bool covered = !(zc * (*s * unit) + (float)top * *s < mx) && zc >= -128.f && zc <= 127.f;
        if (covered || c == 255) break;
    }
    zc = std::min(127.f, std::max(-128.f, zc));
    pair[0] = (uint8_t)c;
    pair[1] = (uint8_t)(int8_t)zc;
    *z = zc * (*s * unit);
}

// Code i of a packed row: bits [i * bits, (i + 1) * bits) of its little-endian bit stream (kvcal.runtime.storage.quant
// .pack). A 3-bit code may straddle two bytes; the second is read only then, so a row is never read past its end.
inline unsigned code_at(const uint8_t* src, int i, int bits) {
    const int bit = i * bits, b = bit >> 3, off = bit & 7;
    const unsigned word = off + bits > 8 ? (unsigned)src[b] | ((unsigned)src[b + 1] << 8) : (unsigned)src[b];
    return (word >> off) & ((1u << bits) - 1u);
}

// Code i into a packed row whose bytes start zeroed (`code_at`'s layout).
inline void put_code(uint8_t* dst, int i, int bits, unsigned code) {
    const int bit = i * bits, b = bit >> 3, off = bit & 7;
    dst[b] |= (uint8_t)(code << off);
    if (off + bits > 8) dst[b + 1] |= (uint8_t)(code >> (8 - off));
}

// The little-endian word of three packed bytes: eight 3-bit codes, code k in bits [3k, 3k + 3)
inline uint32_t three_bytes(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
}

// Unpacked codes of one token (`code_at`). Written a whole byte (or at 3 bits three bytes) at a time so that the
// compiler vectorizes the loops.
inline void unpack(const uint8_t* src, int bits, int r, float* codes) {
    int done = 0;
    if (bits == 8) {
        for (int i = 0; i < r; ++i) codes[i] = (float)src[i];
        return;
    } else if (bits == 4) {
        const int whole = r / 2;
        for (int j = 0; j < whole; ++j) {
            codes[2 * j] = (float)(src[j] & 0xF);
            codes[2 * j + 1] = (float)(src[j] >> 4);
        }
        done = 2 * whole;
    } else if (bits == 3) {
        const int whole = r / 8;
        for (int j = 0; j < whole; ++j) {
            const uint32_t w = three_bytes(src + 3 * j);
            for (int k = 0; k < 8; ++k) codes[8 * j + k] = (float)((w >> (3 * k)) & 0x7);
        }
        done = 8 * whole;
    } else if (bits == 2) {
        const int whole = r / 4;
        for (int j = 0; j < whole; ++j) {
            codes[4 * j] = (float)(src[j] & 0x3);
            codes[4 * j + 1] = (float)((src[j] >> 2) & 0x3);
            codes[4 * j + 2] = (float)((src[j] >> 4) & 0x3);
            codes[4 * j + 3] = (float)(src[j] >> 6);
        }
        done = 4 * whole;
    }
    for (int i = done; i < r; ++i) codes[i] = (float)code_at(src, i, bits);
}

// Every byte's levels at 2 or 4 bits: table[b * per + k] = lut[(b >> (k * bits)) & mask], per = 8 / bits codes in
// a byte; at 3 bits every pair of codes' (6 bits): table[p * 2 + k] = lut[(p >> (3 * k)) & 7]. The dequantizer then
// moves a byte's (a pair's) levels with one copy, where converting each code to an index and reading the level one at
// a time was most of a decode layer's time.
std::vector<float> byte_levels(const float* lut, int bits) {
    const int per = bits == 3 ? 2 : 8 / bits, span = bits == 3 ? 64 : 256, mask = (1 << bits) - 1;
    std::vector<float> table(span * per);
    for (int b = 0; b < span; ++b)
        for (int k = 0; k < per; ++k) table[b * per + k] = lut[(b >> (k * bits)) & mask];
    return table;
}

// One token's codes -> their levels (out [r]): lut [2**bits] the side's level row; table: its `byte_levels`, or
// nullptr (then each code is read through lut).
inline void unpack_levels(const uint8_t* src, int bits, int r, const float* lut, const float* table, float* out) {
    int done = 0;
    if (bits == 8) {
        for (int i = 0; i < r; ++i) out[i] = lut[src[i]];
        return;
    }
    if (table && bits == 4) {
        for (int j = 0; j < r / 2; ++j) std::memcpy(out + 2 * j, table + 2 * src[j], 2 * sizeof(float));
        done = r / 2 * 2;
    } else if (table && bits == 2) {
        for (int j = 0; j < r / 4; ++j) std::memcpy(out + 4 * j, table + 4 * src[j], 4 * sizeof(float));
        done = r / 4 * 4;
    } else if (table && bits == 3) {                      // eight codes in three bytes, a pair of codes per copy
        for (int j = 0; j < r / 8; ++j) {
            const uint32_t w = three_bytes(src + 3 * j);
            for (int k = 0; k < 4; ++k)
                std::memcpy(out + 8 * j + 2 * k, table + 2 * ((w >> (6 * k)) & 63), 2 * sizeof(float));
        }
        done = r / 8 * 8;
    }
    for (int i = done; i < r; ++i) out[i] = lut[code_at(src, i, bits)];
}

// x * s + z. Exact: the product rounded before the sum, as torch's two operations round it (for what is re-encoded
// from a read, where a fused multiply-add, rounding once, could move a code off the torch writer's); else as the
// compiler contracts it.
template <bool Exact>
inline float scale_add(float x, float s, float z) {
    if constexpr (!Exact) {
        return x * s + z;
    } else {
        float m = x * s;
#if defined(__x86_64__) || defined(__i386__)
        __asm__ volatile("" : "+x"(m));
#else
        volatile float kept = m;
        m = kept;
#endif
        return m + z;
    }
}

// Vectors of tokens first .. first + count - 1 of segment k (which = 0) or v (which = 1) of one page -> out [count, r].
// lut: the side's level row, nullptr for uniform codes; table: its `byte_levels` or nullptr. Exact: `scale_add`'s.
template <bool Exact = false>
void dequantize(const uint8_t* page, const Desc& D, int which, int64_t first, int count, float* out, const float* lut,
                const float* table) {
    const int r = which ? D.r_v : D.r_k, bits = which ? D.v_bits : D.k_bits, nbytes = which ? D.v_bytes : D.k_bytes;
    const uint8_t* data = page + (which ? D.v_off : D.k_off) + first * nbytes;
    if (bits == 32) {
        std::memcpy(out, data, sizeof(float) * count * r);
        return;
    }
    if (bits == 16) {
        for (int t = 0; t < count; ++t)
            for (int i = 0; i < r; ++i) {
                const uint16_t v = load_u16(data + 2 * (t * r + i));
                out[t * r + i] = D.raw_bf16 ? bf16_to_float(v) : half_to_float(v);
            }
        return;
    }
    const uint8_t* meta = page + (which ? D.v_meta_off : D.k_meta_off);
    const int pair = D.meta8 ? 2 : 4;
    if (!which && D.k_channel) {                          // (scale, zero) per channel over the page's tokens
        float s[512], z[512];
        for (int i = 0; i < r; ++i) read_meta(meta + pair * i, D.meta8, bits, &s[i], &z[i]);
        for (int t = 0; t < count; ++t) {
            float* o = out + t * r;
            if (lut) unpack_levels(data + t * nbytes, bits, r, lut, table, o);
            else unpack(data + t * nbytes, bits, r, o);
            for (int i = 0; i < r; ++i) o[i] = scale_add<Exact>(o[i], s[i], z[i]);
        }
        return;
    }
    const int groups = which ? D.v_groups : D.k_groups, group = r / groups;
    for (int t = 0; t < count; ++t) {
        float* o = out + t * r;
        if (lut) unpack_levels(data + t * nbytes, bits, r, lut, table, o);
        else unpack(data + t * nbytes, bits, r, o);
        for (int gi = 0; gi < groups; ++gi) {
            float s, z;
            read_meta(meta + pair * ((first + t) * groups + gi), D.meta8, bits, &s, &z);
            float* og = o + gi * group;
            for (int i = 0; i < group; ++i) og[i] = scale_add<Exact>(og[i], s, z);
        }
    }
}

// Lane-wise partial sums, then a halving tree: gcc folds `omp simd reduction` lane by lane in order (16 dependent
// scalar adds per dot at AVX-512), which was a third of a decode layer's time.
inline float dot(const float* a, const float* b, int r) {
    float acc[16] = {0.f};
    int i = 0;
    for (; i + 16 <= r; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i + j < r; ++j) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 8; ++j) acc[j] += acc[j + 8];
    for (int j = 0; j < 4; ++j) acc[j] += acc[j + 4];
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

// acc [NR, a_stride] += e [NR, t_stride] . v [cnt, rv] over a page's tokens, 16 columns at a time: each load of
// v serves every row, and the partial sums stay in registers (GCC vectorized the token loop instead when written as
// plain loops, with gathers). The rows of holes must be zero in v: their weights are 0, but stale bytes may be NaN.
typedef float v8f __attribute__((vector_size(32)));    // 8 floats: GCC/Clang lower it to what the CPU has

inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

template <int NR>
inline void weighted_rows(float* acc, int64_t a_stride, const float* e, int64_t t_stride, const float* v, int cnt,
                          int rv) {
    int c = 0;
    for (; c + 16 <= rv; c += 16) {
        v8f s[NR][2];
        for (int i = 0; i < NR; ++i) {
            s[i][0] = load8(acc + i * a_stride + c);
            s[i][1] = load8(acc + i * a_stride + c + 8);
        }
        for (int t = 0; t < cnt; ++t) {
            const v8f a = load8(v + t * rv + c), b = load8(v + t * rv + c + 8);
            for (int i = 0; i < NR; ++i) {
                const float et = e[i * t_stride + t];
                s[i][0] += et * a;
                s[i][1] += et * b;
            }
        }
        for (int i = 0; i < NR; ++i) {
            store8(acc + i * a_stride + c, s[i][0]);
            store8(acc + i * a_stride + c + 8, s[i][1]);
        }
    }
    for (; c < rv; ++c)
        for (int i = 0; i < NR; ++i)
            for (int t = 0; t < cnt; ++t) acc[i * a_stride + c] += e[i * t_stride + t] * v[t * rv + c];
}

// Sum of a vector's 8 lanes, as a halving tree.
inline float hsum8(v8f v) {
    float a[8];
    std::memcpy(a, &v, sizeof a);
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// x [NR, t_stride] = scale * q [NR, q_stride] . k [cnt, rk] over a page's tokens, NEG_INF for holes: two tokens at a
// time against NR query rows, 8 channels a step, so each key load serves every row and 2 * NR independent sums hide
// the multiply-add latency (one dot at a time was a chain of dependent adds and a reduction per row and token).
template <int NR>
inline void logit_rows(float* x, int64_t t_stride, const float* q, int64_t q_stride, const float* k, int rk,
                       int cnt, const char* valid, float scale) {
    const int body = rk / 8 * 8;
    for (int t = 0; t < cnt; t += 2) {
        const int tn = std::min(2, cnt - t);
        v8f s[2][NR];
        for (int u = 0; u < 2; ++u)
            for (int i = 0; i < NR; ++i) s[u][i] = v8f{};
        for (int c = 0; c < body; c += 8) {
            const v8f k0 = load8(k + t * rk + c), k1 = tn > 1 ? load8(k + (t + 1) * rk + c) : v8f{};
            for (int i = 0; i < NR; ++i) {
                const v8f qi = load8(q + i * q_stride + c);
                s[0][i] += qi * k0;
                s[1][i] += qi * k1;
            }
        }
        for (int u = 0; u < tn; ++u)
            for (int i = 0; i < NR; ++i) {
                float d = hsum8(s[u][i]);
                for (int c = body; c < rk; ++c) d += q[i * q_stride + c] * k[(t + u) * rk + c];
                x[i * t_stride + t + u] = valid[t + u] ? d * scale : NEG_INF;
            }
    }
}

// f(rows, row) over qn query rows in blocks of up to 4, rows a compile-time constant (std::integral_constant), so
// that the kernels above keep a block's sums in registers.
template <class F>
inline void by_row_blocks(int64_t qn, F f) {
    int64_t row = 0;
    for (; row + 4 <= qn; row += 4) f(std::integral_constant<int, 4>{}, row);
    switch (qn - row) {
        case 3: f(std::integral_constant<int, 3>{}, row); break;
        case 2: f(std::integral_constant<int, 2>{}, row); break;
        case 1: f(std::integral_constant<int, 1>{}, row); break;
        default: break;
    }
}

// exp(x) for x <= 0 (softmax weights), 0 below -87 (and for -inf). Cephes' expf: x = n ln2 + f, |f| <= ln2 / 2,
// exp(f) by a degree-6 polynomial, 2^n through the exponent bits; within 2 ulp of std::exp. Pure arithmetic with no
// call and no branch, so that loops over a page's tokens vectorize (std::exp stays a scalar libm call per token).
// Below -87 the arithmetic gives garbage that the final mask clears; no clamp before it and no select after it,
// since gcc threads the two comparisons into branches that keep the loop scalar on AVX2 (AVX-512's masks hid that).
// 2^n: t's low mantissa bits hold n + 0x400000, as t = 1.5 * 2^23 + n.
inline float exp_le0(float x) {
    const float t = x * 1.44269504088896341f + 12582912.f;           // 1.5 * 2^23: rounds x / ln 2 to an integer
    const float n = t - 12582912.f;
    const float f = (x - n * 0.693359375f) + n * 2.12194440e-4f;      // ln 2 split in two (Cody-Waite)
    float y = 1.9875691500e-4f;
    y = y * f + 1.3981999507e-3f;
    y = y * f + 8.3334519073e-3f;
    y = y * f + 4.1665795894e-2f;
    y = y * f + 1.6666665459e-1f;
    y = y * f + 5.0000001201e-1f;
    y = y * f * f + f + 1.f;
    const float two_n = bits_f32((f32_bits(t) - 0x4B400000u + 127u) << 23);
    return bits_f32(f32_bits(y * two_n) & (x < -87.f ? 0u : ~0u));
}

inline float exp_diff(float a, float b) {        // exp(a - b), 0 where a = -inf (also when b = -inf)
    return a == NEG_INF ? 0.f : std::exp(a - (b == NEG_INF ? 0.f : b));
}

struct PageRef {
    int64_t off;      // byte offset of the page in the arena
    int32_t desc;     // descriptor row
    int32_t count;    // slots written in the page
};

struct Layer {        // where the layer's pages are: page_table [slots, L, H, P] int32, fill [L, slots, H, 2] int64
    const int32_t* table;
    const int64_t* fill;
    const int32_t* head_group;
    int64_t L, H, P, layer, batch, page_bytes;

    int32_t page(int64_t b, int64_t h, int side, int64_t k) const {
        const int64_t col = side == HIGH ? k : P - 1 - k;
        return table[((b * L + layer) * H + h) * P + col];
    }
    int64_t filled(int64_t b, int64_t h, int side) const { return fill[((layer * batch + b) * H + h) * 2 + side]; }
};

// (scale, zero) of one group from its min and max, stored at `pair` (8-bit codes or two fp16): quant._scale_zero_meta.
inline void put_meta(float mn, float mx, int bits, bool meta8, uint8_t* pair, float* s, float* z) {
    if (meta8) {
        meta8_encode(mn, mx, bits, pair, s, z);
        return;
    }
    const uint16_t s16 = float_to_half((mx - mn) / (float)((1 << bits) - 1)), z16 = float_to_half(mn);
    std::memcpy(pair, &s16, 2);
    std::memcpy(pair + 2, &z16, 2);
    *s = half_to_float(s16);
    *z = half_to_float(z16);
}

// quant._encode of one element: its code, 0 where the scale is 0. With levels (lut [top + 1], sorted): the number of
// midpoints below u, i.e. the nearest level with ties to the lower (quant.nearest_level's searchsorted).
inline int encode(float x, float s, float z, int top, const float* lut = nullptr) {
    if (s == 0.f) return 0;
    const float u = (x - z) / s;
    if (!lut) return (int)std::min((float)top, std::max(0.f, std::nearbyint(u)));
    int lo = 0, hi = top;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if ((lut[mid] + lut[mid + 1]) / 2.f < u) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Vector x of token t (segment k: which = 0, v: which = 1) into its slot of a page, per-token formats: raw, or
// quantized per group with the group's (scale, zero) next to it (CompressedStore.write); lut: the side's level row or
// nullptr.
void write_token(uint8_t* page, const Desc& D, int which, int64_t t, const float* x, const float* lut) {
    const int r = which ? D.r_v : D.r_k, bits = which ? D.v_bits : D.k_bits;
    const int nbytes = which ? D.v_bytes : D.k_bytes;
    uint8_t* data = page + (which ? D.v_off : D.k_off) + t * nbytes;
    if (bits == 32) {
        std::memcpy(data, x, sizeof(float) * r);
        return;
    }
    if (bits == 16) {
        for (int c = 0; c < r; ++c) {
            const uint16_t v = D.raw_bf16 ? float_to_bf16(x[c]) : float_to_half(x[c]);
            std::memcpy(data + 2 * c, &v, 2);
        }
        return;
    }
    const int groups = which ? D.v_groups : D.k_groups, group = r / groups, top = (1 << bits) - 1;
    const int pair = D.meta8 ? 2 : 4;
    uint8_t* meta = page + (which ? D.v_meta_off : D.k_meta_off) + t * groups * pair;
    std::memset(data, 0, nbytes);
    for (int gi = 0; gi < groups; ++gi) {
        const float* xg = x + gi * group;
        float mn = xg[0], mx = xg[0];
        for (int c = 1; c < group; ++c) { mn = std::min(mn, xg[c]); mx = std::max(mx, xg[c]); }
        float s, z;
        put_meta(mn, mx, bits, D.meta8, meta + pair * gi, &s, &z);
        for (int c = 0; c < group; ++c) {
            const int e = gi * group + c;
            put_code(data, e, bits, encode(xg[c], s, z, top, lut));
        }
    }
}

// quant._check_values of a vector the page quantizes (raw tiers are not checked): 0, 1 (not finite) or 2 (beyond the
// float16 range of scale / zero), with the bad value.
inline int check_vector(const float* x, int r, int bits, float* bad_value) {
    if (bits >= 16) return 0;
    for (int c = 0; c < r; ++c) {
        if (!std::isfinite(x[c])) { *bad_value = x[c]; return 1; }
        if (std::fabs(x[c]) > 65504.f) { *bad_value = std::fabs(x[c]); return 2; }
    }
    return 0;
}

// One per-token row of a sliding window (kvcal.runtime.hf.sliding) into x [d]: `nbytes` of packed codes, then one
// (scale, zero) pair per `group` channels. lut: the side's level row (nullptr: uniform codes), table its
// `byte_levels`.
inline void dequantize_row(const uint8_t* row, int bits, int64_t d, int64_t group, int64_t nbytes, bool meta8,
                           float* x, const float* lut = nullptr, const float* table = nullptr) {
    const int pair = meta8 ? 2 : 4;
    if (lut) unpack_levels(row, bits, (int)d, lut, table, x);
    else unpack(row, bits, (int)d, x);
    for (int64_t c0 = 0; c0 < d; c0 += group) {
        float s, z;
        read_meta(row + nbytes + (c0 / group) * pair, meta8, bits, &s, &z);
        for (int64_t c = c0; c < c0 + group; ++c) x[c] = x[c] * s + z;
    }
}

// The prefill's register blocks: acc[PF_PAIRS][PF_TILE] logits and acc[PF_PV][PF_VW] outputs stay in vector registers
// (32 of 16 floats with AVX-512, 16 of 8 without: the AVX-512 blocks would spill there). Without AVX-512 the logits
// take 6 rows x 16 keys, 12 registers beside the tile's two loads and the query's broadcast (6 x 16 is the shape
// of the usual AVX2 matrix-multiply kernel). Neither changes float order:
// every logit and output is summed in the same order whatever the block, so the results are the same bits (a test
// builds both: -DKVCAL_PREFILL_WIDE=1 or 0 chooses them whatever the CPU).
#if !defined(KVCAL_PREFILL_WIDE)
#if defined(__AVX512F__)
#define KVCAL_PREFILL_WIDE 1
#else
#define KVCAL_PREFILL_WIDE 0
#endif
#endif
#if KVCAL_PREFILL_WIDE
constexpr int PF_TILE = 64, PF_PAIRS = 4, PF_VW = 64, PF_PV = 6;
#else
constexpr int PF_TILE = 16, PF_PAIRS = 6, PF_VW = 16, PF_PV = 6;
#endif
constexpr int PF_ROWS = 4, PF_CHUNK = 32, PF_GROUPS = 16;

// acc[p][0..W) += sum_j s[p][j] * v[j][c0 .. c0 + W) over j < L, for P rows of probabilities: the value rows are
// read once for P query rows (W floats of P rows: P * W / 16 vector registers with AVX-512, P * W / 8 with AVX2).
template <int P, int W>
inline void pv_block(const float* const* s, const float* inv, const float* v, int64_t L, int64_t rv, int64_t c0,
                     float* const* out) {
    alignas(64) float acc[P][W] = {};
    for (int64_t j = 0; j < L; ++j) {
        const float* vj = v + j * rv + c0;
        for (int p = 0; p < P; ++p) {
            const float w = s[p][j];
#pragma omp simd
            for (int c = 0; c < W; ++c) acc[p][c] += w * vj[c];
        }
    }
    for (int p = 0; p < P; ++p)
#pragma omp simd
        for (int c = 0; c < W; ++c) out[p][c0 + c] = acc[p][c] * inv[p];
}

template <int P>
inline void pv_rows(const float* const* s, const float* inv, const float* v, int64_t L, int64_t rv,
                    float* const* out) {
    int64_t c0 = 0;
    for (; c0 + PF_VW <= rv; c0 += PF_VW) pv_block<P, PF_VW>(s, inv, v, L, rv, c0, out);
    switch (rv - c0) {          // rv is a multiple of 16
        case 16: pv_block<P, 16>(s, inv, v, L, rv, c0, out); break;
        case 32: pv_block<P, 32>(s, inv, v, L, rv, c0, out); break;
        case 48: pv_block<P, 48>(s, inv, v, L, rv, c0, out); break;
        default: break;
    }
}

}  // namespace

extern "C" {

int kvcal_desc_ints() { return DESC_INTS; }

// Returns 0, or -1 when a page the fill counts promise is missing from the page table.
int kvcal_decode(uint8_t* arena, const int32_t* descs_raw, const int32_t* table, const int64_t* fill,
                 const int32_t* head_group, int64_t L, int64_t B, int64_t H, int64_t P, int64_t layer,
                 int64_t page_bytes, const float* query, const float* exact_keys, const float* exact_values,
                 const int64_t* exact_from, int64_t g, int64_t n, int64_t m, int64_t r, int64_t rv, float scale,
                 int track_scores, int threads, int64_t grain, float* out, float* exact_score, const float* luts) {
    const Desc* descs = reinterpret_cast<const Desc*>(descs_raw);
    const Layer lay{table, fill, head_group, L, H, P, layer, B, page_bytes};
    const int64_t W = B * H, qn = g * n;

    // ---- the byte tables of the level rows at 2, 3 and 4 bits, per (tier side, KV head, K or V): level_row's order
    std::vector<std::vector<float>> tables(4 * H);
    for (int side = 0; side < 2; ++side)
        for (int64_t h = 0; h < H; ++h)
            for (int which = 0; which < 2; ++which) {
                const Desc& D = descs[2 * head_group[h] + side];
                const float* lut = level_row(luts, D, side, H, h, which);
                const int bits = which ? D.v_bits : D.k_bits;
                if (lut && bits <= 4) tables[(side * H + h) * 2 + which] = byte_levels(lut, bits);
            }
    auto table_of = [&](int side, int64_t h, int which) -> const float* {
        const std::vector<float>& t = tables[(side * H + h) * 2 + which];
        return t.empty() ? nullptr : t.data();
    };

    // ---- the pages of every item, high section then low, and their tasks (split-K when items are few)
    std::vector<PageRef> pages;
    std::vector<int64_t> item_start(W + 1, 0);
    int t_max = 1;
    for (int64_t w = 0; w < W; ++w) {
        const int64_t b = w / H, h = w % H;
        for (int side = 0; side < 2; ++side) {
            const int32_t row = 2 * head_group[h] + side;
            const int64_t T = descs[row].tokens, filled = lay.filled(b, h, side);
            t_max = std::max<int>(t_max, (int)T);
            for (int64_t k = 0; k * T < filled; ++k) {
                const int32_t id = lay.page(b, h, side, k);
                if (id < 0) return -1;
                pages.push_back({(int64_t)id * page_bytes, row, (int32_t)std::min<int64_t>(T, filled - k * T)});
            }
        }
        item_start[w + 1] = (int64_t)pages.size();
    }
    const int64_t total = (int64_t)pages.size();
    // a thread team costs microseconds to wake (far more on a loaded machine): one thread per `grain` multiply-adds
    int64_t work = 0;
    for (const PageRef& ref : pages) work += (int64_t)ref.count * (r + rv) * qn;
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, work / std::max<int64_t>(1, grain)));
    const int64_t want = std::max<int64_t>(1, 4 * (int64_t)threads);
    const int64_t chunk = std::max<int64_t>(1, (total + want - 1) / want);
    std::vector<int64_t> task_item, task_begin, item_task(W + 1, 0);
    for (int64_t w = 0; w < W; ++w) {
        for (int64_t p = item_start[w]; p < item_start[w + 1]; p += chunk) {
            task_item.push_back(w);
            task_begin.push_back(p);
        }
        item_task[w + 1] = (int64_t)task_item.size();
    }
    const int64_t NT = (int64_t)task_item.size();
    std::vector<float> part_m(NT * qn, NEG_INF), part_l(NT * qn, 0.f), part_acc(NT * qn * rv, 0.f);
    // logits are kept only for the pages whose scores the merge updates (tracked tiers): an untracked low tier is
    // most of a long context, and its logits would be zeroed and copied for nothing
    std::vector<int64_t> kept(total, -1);
    int64_t n_kept = 0;
    if (track_scores)
        for (int64_t p = 0; p < total; ++p)
            if (descs[pages[p].desc].score_off >= 0) kept[p] = n_kept++;
    std::vector<float> logits(n_kept * t_max * qn);

    // ---- split: online softmax over each task's pages
#pragma omp parallel num_threads(threads)
    {
        // x, e: logits and softmax weights of a page, row-major [qn, t_max] (a row's tokens contiguous: vectorized)
        std::vector<float> kbuf(t_max * r), vbuf(t_max * rv), x(t_max * qn), e(t_max * qn);
        std::vector<char> valid(t_max);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < NT; ++task) {
            const int64_t w = task_item[task];
            const int64_t end = std::min(task_begin[task] + chunk, item_start[w + 1]);
            float* m = &part_m[task * qn];
            float* l = &part_l[task * qn];
            float* acc = &part_acc[task * qn * rv];
            const float* q = query + w * qn * r;
            for (int64_t p = task_begin[task]; p < end; ++p) {
                const PageRef& ref = pages[p];
                const Desc& D = descs[ref.desc];
                const uint8_t* page = arena + ref.off;
                const int cnt = ref.count, side = ref.desc & 1;
                dequantize(page, D, 0, 0, cnt, kbuf.data(), level_row(luts, D, side, H, w % H, 0), table_of(side, w % H, 0));
                bool any = false, holes = false;
                if (D.pos_off < 0) {                                  // untracked tier: no holes below the fill
                    for (int t = 0; t < cnt; ++t) valid[t] = true;
                    any = cnt > 0;
                } else {
                    const int32_t* pos = reinterpret_cast<const int32_t*>(page + D.pos_off);
                    for (int t = 0; t < cnt; ++t) any |= (valid[t] = pos[t] >= 0);
                    for (int t = 0; t < cnt; ++t) holes |= !valid[t];
                }
                by_row_blocks(qn, [&](auto rows, int64_t row) {
                    logit_rows<decltype(rows)::value>(&x[row * t_max], t_max, q + row * r, r, kbuf.data(), D.r_k,
                                                      cnt, valid.data(), scale);
                });
                if (kept[p] >= 0) std::memcpy(&logits[kept[p] * t_max * qn], x.data(), sizeof(float) * t_max * qn);
                if (!any) continue;                                   // a page of holes adds nothing
                dequantize(page, D, 1, 0, cnt, vbuf.data(), level_row(luts, D, side, H, w % H, 1), table_of(side, w % H, 1));
                for (int64_t row = 0; row < qn; ++row) {
                    const float* xr = &x[row * t_max];
                    float* er = &e[row * t_max];
                    float page_max = NEG_INF;
                    for (int t = 0; t < cnt; ++t) page_max = std::max(page_max, xr[t]);
                    const float m_new = std::max(m[row], page_max);  // finite: the page has a valid token
                    const float alpha = exp_diff(m[row], m_new);
                    float* a = acc + row * rv;
                    if (alpha != 1.f)
                        for (int64_t c = 0; c < rv; ++c) a[c] *= alpha;
                    float sum = 0.f;
                    for (int t = 0; t < cnt; ++t) {
                        er[t] = exp_le0(xr[t] - m_new);               // holes: -inf -> 0
                        sum += er[t];
                    }
                    l[row] = l[row] * alpha + sum;
                    m[row] = m_new;
                }
                if (holes)
                    for (int t = 0; t < cnt; ++t)
                        if (!valid[t]) std::fill(&vbuf[t * D.r_v], &vbuf[(t + 1) * D.r_v], 0.f);
                by_row_blocks(qn, [&](auto rows, int64_t row) {
                    weighted_rows<decltype(rows)::value>(acc + row * rv, rv, &e[row * t_max], t_max, vbuf.data(),
                                                         cnt, D.r_v);
                });
            }
        }

        // ---- merge: partials + new tokens, output, fused score update
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < W; ++w) {
            const float* q = query + w * qn * r;
            const float* kn = exact_keys + w * m * r;
            const float* vn = exact_values + w * m * rv;
            const int64_t from = exact_from ? exact_from[w / H] : 0, prior = m - n;
            std::vector<float> M(qn), Linv(qn), xn(qn * m), pr(qn * t_max);
            for (int64_t row = 0; row < qn; ++row) {
                const int64_t last = prior + row % n;                 // the row's own token in the exact block
                float mx = NEG_INF;
                for (int64_t j = 0; j < m; ++j) {
                    xn[row * m + j] = j >= from && j <= last ? dot(q + row * r, kn + j * r, (int)r) * scale : NEG_INF;
                    mx = std::max(mx, xn[row * m + j]);
                }
                for (int64_t task = item_task[w]; task < item_task[w + 1]; ++task)
                    mx = std::max(mx, part_m[task * qn + row]);
                float L = 0.f;
                float* o = out + (w * qn + row) * rv;
                std::fill(o, o + rv, 0.f);
                for (int64_t task = item_task[w]; task < item_task[w + 1]; ++task) {
                    const float s = exp_diff(part_m[task * qn + row], mx);
                    if (s == 0.f) continue;
                    L += part_l[task * qn + row] * s;
                    const float* a = &part_acc[(task * qn + row) * rv];
                    for (int64_t c = 0; c < rv; ++c) o[c] += a[c] * s;
                }
                for (int64_t j = from; j <= last; ++j) {
                    const float e = exp_diff(xn[row * m + j], mx);
                    xn[row * m + j] = e;
                    L += e;
                    for (int64_t c = 0; c < rv; ++c) o[c] += e * vn[j * rv + c];
                }
                const float inv = 1.f / L;
                for (int64_t c = 0; c < rv; ++c) o[c] *= inv;
                M[row] = mx;
                Linv[row] = inv;
            }
            if (!track_scores) {
                for (int64_t j = 0; j < m; ++j) exact_score[w * m + j] = 0.f;
                continue;
            }
            for (int64_t j = 0; j < m; ++j) {                         // exact token j: sum over i of max over g
                float s = 0.f;
                for (int64_t i = std::max<int64_t>(0, j - prior); i < n && j >= from; ++i) {
                    float best = 0.f;
                    for (int64_t gi = 0; gi < g; ++gi) {
                        const int64_t row = gi * n + i;
                        best = std::max(best, xn[row * m + j] * Linv[row]);
                    }
                    s += best;
                }
                exact_score[w * m + j] = s;
            }
            for (int64_t p = item_start[w]; p < item_start[w + 1]; ++p) {
                const PageRef& ref = pages[p];
                const Desc& D = descs[ref.desc];
                uint8_t* page = arena + ref.off;
                if (D.score_off < 0) continue;                            // untracked tier: no scores to keep
                const int32_t* pos = reinterpret_cast<const int32_t*>(page + D.pos_off);
                float* score = reinterpret_cast<float*>(page + D.score_off);
                const float* x = &logits[kept[p] * t_max * qn];          // [qn, t_max]
                for (int64_t row = 0; row < qn; ++row)                    // probabilities, vectorized over tokens
                    for (int t = 0; t < ref.count; ++t)
                        pr[row * t_max + t] = exp_le0(x[row * t_max + t] - M[row]) * Linv[row];
                for (int t = 0; t < ref.count; ++t) {
                    if (pos[t] < 0) continue;
                    float delta = 0.f;
                    for (int64_t i = 0; i < n; ++i) {
                        float best = 0.f;
                        for (int64_t gi = 0; gi < g; ++gi) best = std::max(best, pr[(gi * n + i) * t_max + t]);
                        delta += best;
                    }
                    score[t] += delta;
                }
            }
        }
    }
    return 0;
}

// Quantize and write n tokens, token i into slot slot[i] of section `side` of entry (b[i], h[i]) of `layer`.
// keys [n, k_stride], values [n, v_stride] float32; pos int64 [n]; score float32 [n].
// Returns 0; 1 if a vector to quantize is not finite; 2 if it exceeds the float16 range of scale / zero (nothing is
// written then); -1 if a slot has no page.
int kvcal_write(uint8_t* arena, const int32_t* descs_raw, const int32_t* table, const int64_t* fill,
                const int32_t* head_group, int64_t L, int64_t B, int64_t H, int64_t P, int64_t layer,
                int64_t page_bytes, int side, int64_t n, const int64_t* b, const int64_t* h, const int64_t* slot,
                const float* keys, int64_t k_stride, const float* values, int64_t v_stride, const int64_t* pos,
                const float* score, float* bad_value, const float* luts) {
    const Desc* descs = reinterpret_cast<const Desc*>(descs_raw);
    const Layer lay{table, fill, head_group, L, H, P, layer, B, page_bytes};
    // checks first, so that a refused batch leaves the arena untouched (quant._check_values)
    for (int64_t i = 0; i < n; ++i) {
        const Desc& D = descs[2 * head_group[h[i]] + side];
        if (lay.page(b[i], h[i], side, slot[i] / D.tokens) < 0) return -1;
        for (int which = 0; which < 2; ++which) {
            if ((which ? D.v_bits : D.k_bits) >= 16) continue;
            const float* x = which ? values + i * v_stride : keys + i * k_stride;
            const int r = which ? D.r_v : D.r_k;
            for (int c = 0; c < r; ++c) {
                if (!std::isfinite(x[c])) { *bad_value = x[c]; return 1; }
                if (std::fabs(x[c]) > 65504.f) { *bad_value = std::fabs(x[c]); return 2; }
            }
        }
    }
    for (int64_t i = 0; i < n; ++i) {
        const Desc& D = descs[2 * head_group[h[i]] + side];
        const int64_t t = slot[i] % D.tokens;
        uint8_t* page = arena + (int64_t)lay.page(b[i], h[i], side, slot[i] / D.tokens) * page_bytes;
        for (int which = 0; which < 2; ++which)
            write_token(page, D, which, t, which ? values + i * v_stride : keys + i * k_stride,
                        level_row(luts, D, side, H, h[i], which));
        if (D.pos_off >= 0) {                                         // tracked tiers keep score and position
            std::memcpy(page + D.score_off + 4 * t, &score[i], 4);
            const int32_t p32 = (int32_t)pos[i];
            std::memcpy(page + D.pos_off + 4 * t, &p32, 4);
        }
    }
    return 0;
}

// The decode step's insert (CompressedStore.insert): one token for every entry w = b * H + h of `layer`, into its
// first hole on `side` where it has one (the lowest slot below fill whose position is -1; holes -= 1), else at fill
// (fill += 1). holes, fill [L, B, H, 2] int64; used: num_pages_used [B, L, H, 2] int32. An appending entry whose slot
// has no page yet takes one from the arena's free list (free_list [num_pages] int32, a ring from *start with *num_free
// ids; refs [num_pages] int32), in head-group order and entry order within a group, as PageArena._place takes them
// for CompressedStore.reserve_pages; *placed counts them. Where the free list or an entry's page-table row is too
// short, nothing changes: those entries are listed in need[] (w, ascending; *n_need of them), the return value is 3,
// and the caller grows the arena, reserves their pages and calls again. Otherwise returns as kvcal_write.
int kvcal_insert_every(uint8_t* arena, const int32_t* descs_raw, int32_t* table, int64_t* fill,
                       const int32_t* head_group, int64_t L, int64_t B, int64_t H, int64_t P, int64_t layer,
                       int64_t page_bytes, int side, int64_t* holes, int32_t* used, const float* keys,
                       int64_t k_stride, const float* values, int64_t v_stride, int64_t pos, const float* score,
                       float* bad_value, int64_t* need, int64_t* n_need, const float* luts, int32_t* free_list,
                       int64_t num_pages, int64_t* start, int64_t* num_free, int32_t* refs, int64_t* placed) {
    const Desc* descs = reinterpret_cast<const Desc*>(descs_raw);
    const Layer lay{table, fill, head_group, L, H, P, layer, B, page_bytes};
    const int64_t W = B * H;
    std::vector<int64_t> b(W), h(W), slot(W), position(W, pos);
    std::vector<char> hole(W, 0);
    *n_need = 0;
    *placed = 0;
    bool fits = true;                               // the pages needed can come from the free list as it is
    int32_t groups = 0;
    for (int64_t w = 0; w < W; ++w) {
        b[w] = w / H;
        h[w] = w % H;
        groups = std::max(groups, head_group[h[w]] + 1);
        const Desc& D = descs[2 * head_group[h[w]] + side];
        const int64_t filled = lay.filled(b[w], h[w], side);
        slot[w] = filled;
        const bool holey = holes[((layer * B + b[w]) * H + h[w]) * 2 + side] > 0;   // else: no slot to scan for
        for (int64_t k = 0; holey && D.pos_off >= 0 && k * D.tokens < filled && !hole[w]; ++k) {
            const int32_t id = lay.page(b[w], h[w], side, k);
            if (id < 0) return -1;
            const int32_t* p = reinterpret_cast<const int32_t*>(arena + (int64_t)id * page_bytes + D.pos_off);
            for (int64_t t = 0; t < D.tokens && k * D.tokens + t < filled; ++t)
                if (p[t] < 0) {
                    slot[w] = k * D.tokens + t;
                    hole[w] = 1;
                    break;
                }
        }
        const int32_t* row_used = used + ((b[w] * L + layer) * H + h[w]) * 2;
        if (!hole[w] && filled >= row_used[side] * D.tokens) {
            need[(*n_need)++] = w;
            fits = fits && row_used[0] + row_used[1] < P;
        }
    }
    if (*n_need > *num_free || !fits) return 3;
    for (int32_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < *n_need; ++i) {
            const int64_t w = need[i];
            if (head_group[h[w]] != g) continue;
            const int32_t id = free_list[*start];
            *start = (*start + 1) % num_pages;
            *num_free -= 1;
            refs[id] = 1;
            int32_t* row_used = used + ((b[w] * L + layer) * H + h[w]) * 2;
            const int64_t col = side == HIGH ? row_used[side] : P - 1 - row_used[side];
            table[((b[w] * L + layer) * H + h[w]) * P + col] = id;
            row_used[side] += 1;
            *placed += 1;
        }
    const int rc = kvcal_write(arena, descs_raw, table, fill, head_group, L, B, H, P, layer, page_bytes, side, W,
                               b.data(), h.data(), slot.data(), keys, k_stride, values, v_stride, position.data(),
                               score, bad_value, luts);
    if (rc == 0)
        for (int64_t w = 0; w < W; ++w) {
            const int64_t at = ((layer * B + b[w]) * H + h[w]) * 2 + side;
            if (hole[w]) holes[at] -= 1; else fill[at] += 1;
        }
    return rc;
}

// Close the holes of entries i < n (b[i], h[i], distinct) in their high sections (Scores.compact): each entry's live
// tokens at or past its live count move, bytes as stored (codes, their (scale, zero) pairs, score, position), into its
// holes below that count, the k-th hole taking the k-th such token in slot order, so that the section is dense again.
// count[i] receives the live count (the new fill; the caller frees the pages past it). Returns -1 where the high tier
// keeps no positions or a page is missing (nothing has moved).
int kvcal_compact_high(uint8_t* arena, const int32_t* descs_raw, const int32_t* table, const int64_t* fill,
                       const int32_t* head_group, int64_t L, int64_t B, int64_t H, int64_t P, int64_t layer,
                       int64_t page_bytes, int64_t n, const int64_t* b, const int64_t* h, int64_t* count) {
    const Desc* descs = reinterpret_cast<const Desc*>(descs_raw);
    const Layer lay{table, fill, head_group, L, H, P, layer, B, page_bytes};
    for (int64_t i = 0; i < n; ++i) {                 // checks first: a refused call moves nothing
        const Desc& D = descs[2 * head_group[h[i]] + HIGH];
        if (D.pos_off < 0) return -1;
        for (int64_t k = 0; k * D.tokens < lay.filled(b[i], h[i], HIGH); ++k)
            if (lay.page(b[i], h[i], HIGH, k) < 0) return -1;
    }
    for (int64_t i = 0; i < n; ++i) {
        const Desc& D = descs[2 * head_group[h[i]] + HIGH];
        const int64_t filled = lay.filled(b[i], h[i], HIGH), T = D.tokens;
        auto slot_page = [&](int64_t s) { return arena + (int64_t)lay.page(b[i], h[i], HIGH, s / T) * page_bytes; };
        auto position = [&](int64_t s) {
            int32_t p;
            std::memcpy(&p, slot_page(s) + D.pos_off + 4 * (s % T), 4);
            return p;
        };
        int64_t live = 0;
        for (int64_t s = 0; s < filled; ++s) live += position(s) >= 0;
        count[i] = live;
        const int pair = D.meta8 ? 2 : 4;
        const int64_t rows[6][2] = {{D.k_off, D.k_bytes}, {D.k_meta_off, (int64_t)D.k_groups * pair},
                                    {D.v_off, D.v_bytes}, {D.v_meta_off, (int64_t)D.v_groups * pair},
                                    {D.score_off, 4}, {D.pos_off, 4}};
        int64_t tail = live;
        for (int64_t hole = 0; hole < live; ++hole) {
            if (position(hole) >= 0) continue;
            while (position(tail) < 0) ++tail;                 // the next live token past the count
            uint8_t *dst = slot_page(hole), *src = slot_page(tail);
            for (const auto& row : rows)
                if (row[1]) std::memcpy(dst + row[0] + (hole % T) * row[1], src + row[0] + (tail % T) * row[1], row[1]);
            ++tail;
        }
    }
    return 0;
}

// Per-channel low pages, one whole new page per entry i < n (CompressedStore.write_pages_torch): the page at byte
// offset base[i] (reserved by the caller), head h[i]; keys [n, T, k_stride], values [n, T, v_stride] float32, pos
// int64 and score float32 [n, T]. Keys per channel over the page's T tokens, values per token. Returns as kvcal_write
// (the checks run first: a refused batch writes nothing).
int kvcal_write_pages(uint8_t* arena, const int32_t* descs_raw, const int32_t* head_group, int64_t n,
                      const int64_t* base, const int64_t* h, const float* keys, int64_t k_stride, const float* values,
                      int64_t v_stride, const int64_t* pos, const float* score, float* bad_value, const float* luts,
                      int64_t H) {
    const Desc* descs = reinterpret_cast<const Desc*>(descs_raw);
    for (int which = 0; which < 2; ++which)         // keys first, then values, as the torch writer checks them
        for (int64_t i = 0; i < n; ++i) {
            const Desc& D = descs[2 * head_group[h[i]] + 1];
            for (int64_t t = 0; t < D.tokens; ++t) {
                const int64_t row = i * D.tokens + t;
                const float* x = which ? values + row * v_stride : keys + row * k_stride;
                const int rc = check_vector(x, which ? D.r_v : D.r_k, which ? D.v_bits : D.k_bits, bad_value);
                if (rc) return rc;
            }
        }
    for (int64_t i = 0; i < n; ++i) {
        const Desc& D = descs[2 * head_group[h[i]] + 1];
        const int64_t T = D.tokens;
        uint8_t* page = arena + base[i];
        const float* k = keys + i * T * k_stride;
        const int bits = D.k_bits, top = (1 << bits) - 1, pair = D.meta8 ? 2 : 4;
        const float* k_lut = level_row(luts, D, 1, H, h[i], 0);
        uint8_t* meta = page + D.k_meta_off;
        for (int64_t t = 0; t < T; ++t) std::memset(page + D.k_off + t * D.k_bytes, 0, D.k_bytes);
        for (int c = 0; c < D.r_k; ++c) {                    // one (scale, zero) per channel over the page's tokens
            float mn = k[c], mx = k[c];
            for (int64_t t = 1; t < T; ++t) {
                mn = std::min(mn, k[t * k_stride + c]);
                mx = std::max(mx, k[t * k_stride + c]);
            }
            float s, z;
            put_meta(mn, mx, bits, D.meta8, meta + pair * c, &s, &z);
            for (int64_t t = 0; t < T; ++t)
                put_code(page + D.k_off + t * D.k_bytes, c, bits, encode(k[t * k_stride + c], s, z, top, k_lut));
        }
        for (int64_t t = 0; t < T; ++t)
            write_token(page, D, 1, t, values + (i * T + t) * v_stride, level_row(luts, D, 1, H, h[i], 1));
        if (D.pos_off >= 0)
            for (int64_t t = 0; t < T; ++t) {
                std::memcpy(page + D.score_off + 4 * t, &score[i * T + t], 4);
                const int32_t p32 = (int32_t)pos[i * T + t];
                std::memcpy(page + D.pos_off + 4 * t, &p32, 4);
            }
    }
    return 0;
}

// A new per-channel low page from high tokens (DiffKVTiers._seal_pending): for each entry i < n (b[i], h[i],
// distinct), its T high slots slots[i * T ..] (T: the LOW descriptor's tokens) are read as the torch store reads them
// and written as one low page at byte offset base[i] (reserved by the caller) as kvcal_write_pages writes it; those
// high slots are then emptied (position -1, holes += T) for the caller's compaction. Returns as kvcal_write_pages (a
// refused batch changes nothing), or -1 where the high keys are not per-token or positions are not kept, or a page is
// missing (nothing changes).
int kvcal_seal_low_pages(uint8_t* arena, const int32_t* descs_raw, const int32_t* table, const int64_t* fill,
                         const int32_t* head_group, int64_t L, int64_t B, int64_t H, int64_t P, int64_t layer,
                         int64_t page_bytes, int64_t n, const int64_t* b, const int64_t* h, const int64_t* slots,
                         const int64_t* base, int64_t* holes, const float* luts, float* bad_value) {
    const Desc* descs = reinterpret_cast<const Desc*>(descs_raw);
    const Layer lay{table, fill, head_group, L, H, P, layer, B, page_bytes};
    int64_t T = 0, rk = 0, rv = 0;
    for (int64_t i = 0; i < n; ++i) {
        const Desc& hi = descs[2 * head_group[h[i]] + HIGH];
        const Desc& lo = descs[2 * head_group[h[i]] + 1];
        if (hi.k_channel || hi.pos_off < 0 || (T && lo.tokens != T)) return -1;
        T = lo.tokens;
        rk = std::max<int64_t>(rk, hi.r_k);
        rv = std::max<int64_t>(rv, hi.r_v);
        for (int64_t t = 0; t < T; ++t)
            if (slots[i * T + t] >= lay.filled(b[i], h[i], HIGH) ||
                lay.page(b[i], h[i], HIGH, slots[i * T + t] / hi.tokens) < 0) return -1;
    }
    std::vector<float> keys(n * T * rk, 0.f), values(n * T * rv, 0.f), score(n * T);
    std::vector<int64_t> pos(n * T);
    for (int64_t i = 0; i < n; ++i) {
        const Desc& hi = descs[2 * head_group[h[i]] + HIGH];
        for (int64_t t = 0; t < T; ++t) {
            const int64_t slot = slots[i * T + t], row = i * T + t;
            const uint8_t* page = arena + (int64_t)lay.page(b[i], h[i], HIGH, slot / hi.tokens) * page_bytes;
            const int64_t at = slot % hi.tokens;
            // read as CompressedStore._read_slots reads them: the product rounded before the zero is added
            dequantize<true>(page, hi, 0, at, 1, keys.data() + row * rk, level_row(luts, hi, HIGH, H, h[i], 0),
                             nullptr);
            dequantize<true>(page, hi, 1, at, 1, values.data() + row * rv, level_row(luts, hi, HIGH, H, h[i], 1),
                             nullptr);
            std::memcpy(&score[row], page + hi.score_off + 4 * at, 4);
            int32_t p32;
            std::memcpy(&p32, page + hi.pos_off + 4 * at, 4);
            pos[row] = p32;
        }
    }
    const int rc = kvcal_write_pages(arena, descs_raw, head_group, n, base, h, keys.data(), rk, values.data(), rv,
                                     pos.data(), score.data(), bad_value, luts, H);
    if (rc) return rc;
    for (int64_t i = 0; i < n; ++i) {
        const Desc& hi = descs[2 * head_group[h[i]] + HIGH];
        for (int64_t t = 0; t < T; ++t) {
            const int64_t slot = slots[i * T + t];
            uint8_t* page = arena + (int64_t)lay.page(b[i], h[i], HIGH, slot / hi.tokens) * page_bytes;
            const int32_t empty = -1;
            std::memcpy(page + hi.pos_off + 4 * (slot % hi.tokens), &empty, 4);
        }
        holes[((layer * B + b[i]) * H + h[i]) * 2 + HIGH] += T;
    }
    return 0;
}

// Whether a decode step may have a per-channel low page to seal (DiffKVTiers._seal_pending): the number of entries
// w = b * H + h of `layer` whose high section holds at least a low page's worth (the LOW descriptor's tokens) of
// pending tokens: out of the window (position < length - window), mean significance score / max(length - position,
// 1) below alpha_high / base and at or above alpha_low / base, with base = max(length - n_pad[b], 1) ("length") or
// max(position - n_pad[b] + 1, 1) (position_base); each bound is (1 / base) * alpha, as torch's `alpha / tensor`
// rounds it. slack widens both bounds by that relative amount, so that the count never falls below the torch
// policy's own: 0 means no entry has a page due. counts [B * H], if not null, receives each entry's pending tokens.
// Returns -1 where the high tier keeps no positions or a page is missing (the caller then takes the torch path).
int64_t kvcal_low_pages_due(uint8_t* arena, const int32_t* descs_raw, const int32_t* table, const int64_t* fill,
                            const int32_t* head_group, int64_t L, int64_t B, int64_t H, int64_t P, int64_t layer,
                            int64_t page_bytes, const int64_t* n_pad, int64_t length, int64_t window,
                            float alpha_high, float alpha_low, int position_base, float slack, int64_t* counts) {
    const Desc* descs = reinterpret_cast<const Desc*>(descs_raw);
    const Layer lay{table, fill, head_group, L, H, P, layer, B, page_bytes};
    int64_t due = 0;
    for (int64_t w = 0; w < B * H; ++w) {
        const int64_t b = w / H, h = w % H;
        const Desc& D = descs[2 * head_group[h] + HIGH];
        const int64_t low_tokens = descs[2 * head_group[h] + 1].tokens, filled = lay.filled(b, h, HIGH);
        if (D.pos_off < 0) return -1;
        int64_t pending = 0;
        for (int64_t k = 0; k * D.tokens < filled; ++k) {
            const int32_t id = lay.page(b, h, HIGH, k);
            if (id < 0) return -1;
            const uint8_t* page = arena + (int64_t)id * page_bytes;
            const int32_t* pos = reinterpret_cast<const int32_t*>(page + D.pos_off);
            const float* score = reinterpret_cast<const float*>(page + D.score_off);
            for (int64_t t = 0; t < D.tokens && k * D.tokens + t < filled; ++t) {
                const int64_t p = pos[t];
                if (p < 0 || p >= length - window) continue;
                const float base = (float)std::max<int64_t>(position_base ? p - n_pad[b] + 1 : length - n_pad[b], 1);
                const float mean = score[t] / (float)std::max<int64_t>(length - p, 1), inv = 1.0f / base;
                pending += mean < inv * alpha_high * (1 + slack) && mean >= inv * alpha_low * (1 - slack);
            }
        }
        due += pending >= low_tokens;
        if (counts) counts[w] = pending;
    }
    return due;
}

// Quantize and dequantize without a page (quant.round_trip_per_token / round_trip_per_channel, bit for bit up to
// the one rounding an FMA may save in zero + scale * level): what the calibration's quality model and coded probe
// ask of every candidate format. x [blocks, T, n] float32: channel = 1 codes each block's n channels over its T
// tokens (per-channel key pages), channel = 0 each of its T tokens in groups of `group` channels. luts: one level
// row per block [blocks, 2**bits] (nullptr: uniform codes). out (if not null) receives x as coded [blocks, T, n];
// err (if not null) each token's sum over channels of g2 * (coded - x)^2, g2 float64 [blocks, T, n]. Returns 0, or
// 1 (an entry not finite) / 2 (beyond the float16 range of scale and zero) with the bad value, as quant._check_values
// finds them, and writes nothing. Each block is coded by one thread: the result does not depend on `threads`.
int kvcal_round_trip(const float* x, int64_t blocks, int64_t T, int64_t n, int32_t channel, int32_t group,
                     int32_t bits, int32_t meta8, const float* luts, const double* g2,
                     double* err, float* out, int32_t threads, float* bad_value) {
    const int64_t count = blocks * T * n;
    int bad = 0;               // any entry not finite or beyond fp16 (NaN fails the comparison), in one vector pass
#pragma omp parallel for num_threads(threads) reduction(| : bad) schedule(static)
    for (int64_t i = 0; i < count; ++i) bad |= !(std::fabs(x[i]) <= 65504.f);
    if (bad) {                 // as quant._check_values words it: not finite anywhere first, else the largest value
        float largest = 0.f;
        for (int64_t i = 0; i < count; ++i) {
            if (!std::isfinite(x[i])) { *bad_value = x[i]; return 1; }
            largest = std::max(largest, std::fabs(x[i]));
        }
        *bad_value = largest;
        return 2;
    }
    const int top = (1 << bits) - 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const float* lut = luts ? luts + b * (top + 1) : nullptr;
        const float* xb = x + b * T * n;
        std::vector<float> s(n), z(n), coded(n), u(n), mid(lut ? top : 0);
        std::vector<int32_t> code(n);
        for (int k = 0; k < (int)mid.size(); ++k) mid[k] = (lut[k] + lut[k + 1]) / 2.f;     // as encode's search
        uint8_t pair[4];
        if (channel)
            for (int64_t c = 0; c < n; ++c) {
                float mn = xb[c], mx = xb[c];
                for (int64_t t = 1; t < T; ++t) {
                    mn = std::min(mn, xb[t * n + c]);
                    mx = std::max(mx, xb[t * n + c]);
                }
                put_meta(mn, mx, bits, meta8, pair, &s[c], &z[c]);
            }
        for (int64_t t = 0; t < T; ++t) {
            const float* xt = xb + t * n;
            if (!channel)
                for (int64_t g0 = 0; g0 < n; g0 += group) {
                    float mn = xt[g0], mx = xt[g0];
                    for (int64_t c = g0 + 1; c < g0 + group; ++c) { mn = std::min(mn, xt[c]); mx = std::max(mx, xt[c]); }
                    float sg, zg;
                    put_meta(mn, mx, bits, meta8, pair, &sg, &zg);
                    for (int64_t c = g0; c < g0 + group; ++c) { s[c] = sg; z[c] = zg; }
                }
            // encode's code without its branches (the number of midpoints below u, or u rounded), so that the loops
            // vectorize; 0 where the scale is 0
            if (lut) {
                for (int64_t c = 0; c < n; ++c) {
                    u[c] = (xt[c] - z[c]) / (s[c] == 0.f ? 1.f : s[c]);
                    code[c] = 0;
                }
                for (int k = 0; k < top; ++k)
                    for (int64_t c = 0; c < n; ++c) code[c] += u[c] > mid[k];
                for (int64_t c = 0; c < n; ++c) coded[c] = lut[s[c] == 0.f ? 0 : code[c]] * s[c] + z[c];
            } else
                for (int64_t c = 0; c < n; ++c) {
                    const float u = (xt[c] - z[c]) / (s[c] == 0.f ? 1.f : s[c]);
                    const float code = std::min((float)top, std::max(0.f, std::nearbyint(u)));
                    coded[c] = (s[c] == 0.f ? 0.f : code) * s[c] + z[c];
                }
            const int64_t row = b * T + t;
            if (out) std::memcpy(out + row * n, coded.data(), sizeof(float) * n);
            if (err) {
                const double* g = g2 + row * n;
                double e = 0.0;
                for (int64_t c = 0; c < n; ++c) {
                    const double d = (double)coded[c] - (double)xt[c];
                    e += g[c] * d * d;
                }
                err[row] = e;
            }
        }
    }
    return 0;
}


// The prefill's attention and significance in one pass over the scores: for each query row gi (head g of a KV head's
// group, position i), p_gi(j) = softmax_j<=i(scale * q_gi . k_j), out_gi = sum_j p_gi(j) v_j, and for each KV head
// score[j] = sum over the queries i >= j of max over the group of p_gi(j). q [B, H, G, n, d], k [B, H, n, d],
// v [B, H, n, rv_pad] (rows padded with zeros to a multiple of 16), out [B, H, G, n, rv_pad], score [B, H, n], all
// float32 and contiguous. A block of PF_ROWS positions times the G heads holds its rows' logits against keys 0..i
// (PF_ROWS * G rows of n floats, cache-sized at 4k), so each logit is computed and exponentiated once and serves both
// the output and the significance. Keys are transposed once per (b, h) into tiles of PF_TILE, so a row's logits
// against a tile are PF_TILE-wide FMAs.
// Work: PF_GROUPS tasks per (b, h), task r taking the chunks of PF_CHUNK positions c = r, r + PF_GROUPS, ... (about
// equal causal work) and summing their significance into its own row of `partial` [B, H, PF_GROUPS, n]; the rows are
// then added in task order, so the result does not depend on the number of threads.
int kvcal_prefill(const float* q, const float* k, const float* v, float* out, float* score, int64_t B, int64_t H,
                  int64_t G, int64_t n, int64_t d, int64_t rv, float scale, int threads) {
    if (rv % 16 != 0) return 1;
    const int64_t tiles = (n + PF_TILE - 1) / PF_TILE, BH = B * H, chunks = (n + PF_CHUNK - 1) / PF_CHUNK;
    const int64_t npad = tiles * PF_TILE;
    std::vector<float> kt(BH * tiles * d * PF_TILE), partial(BH * PF_GROUPS * n);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < BH * tiles; ++task) {        // keys transposed: kt [BH, tiles, d, PF_TILE]
            const int64_t bh = task / tiles, t = task % tiles, j0 = t * PF_TILE, w = std::min<int64_t>(PF_TILE, n - j0);
            const float* kb = k + (bh * n + j0) * d;
            float* dst = kt.data() + task * d * PF_TILE;
            for (int64_t c = 0; c < d; ++c)
                for (int64_t j = 0; j < PF_TILE; ++j) dst[c * PF_TILE + j] = j < w ? kb[j * d + c] : 0.f;
        }
        std::vector<float> logits(PF_ROWS * G * npad), qs(PF_PAIRS * d), rmax(PF_ROWS * G), rinv(PF_ROWS * G);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < BH * PF_GROUPS; ++task) {
            const int64_t bh = task / PF_GROUPS, r = task % PF_GROUPS;
            float* part = partial.data() + task * n;
            std::fill(part, part + n, 0.f);
            for (int64_t c = r; c < chunks; c += PF_GROUPS) {
                for (int64_t i0 = c * PF_CHUNK; i0 < std::min<int64_t>((c + 1) * PF_CHUNK, n); i0 += PF_ROWS) {
                    const int64_t R = std::min<int64_t>(PF_ROWS, n - i0), L = i0 + R, T = (L + PF_TILE - 1) / PF_TILE;
                    const int64_t rows = R * G;                        // row p = rr * G + g: position i0 + rr
                    std::fill(rmax.begin(), rmax.end(), NEG_INF);
                    // logits, PF_PAIRS rows at a time against each tile of keys; keys after a row's position: -inf
                    for (int64_t p0 = 0; p0 < rows; p0 += PF_PAIRS) {
                        const int np = (int)std::min<int64_t>(PF_PAIRS, rows - p0);
                        for (int pp = 0; pp < PF_PAIRS; ++pp) {
                            const int64_t p = std::min<int64_t>(p0 + pp, rows - 1), rr = p / G, g = p % G;
                            const float* qi = q + ((bh * G + g) * n + i0 + rr) * d;
                            for (int64_t c2 = 0; c2 < d; ++c2) qs[pp * d + c2] = qi[c2] * scale;
                        }
                        for (int64_t t = 0; t < T; ++t) {
                            const float* kc = kt.data() + (bh * tiles + t) * d * PF_TILE;
                            alignas(64) float acc[PF_PAIRS][PF_TILE] = {};
                            for (int64_t c2 = 0; c2 < d; ++c2) {
                                const float* kr = kc + c2 * PF_TILE;
                                for (int pp = 0; pp < PF_PAIRS; ++pp) {
                                    const float qc = qs[pp * d + c2];
#pragma omp simd
                                    for (int j = 0; j < PF_TILE; ++j) acc[pp][j] += qc * kr[j];
                                }
                            }
                            for (int pp = 0; pp < np; ++pp) {
                                const int64_t last = i0 + (p0 + pp) / G - t * PF_TILE;    // the row's position
                                float* dst = logits.data() + (p0 + pp) * npad + t * PF_TILE;
                                float m = rmax[p0 + pp];
#pragma omp simd reduction(max : m)
                                for (int j = 0; j < PF_TILE; ++j) {
                                    dst[j] = j <= last ? acc[pp][j] : NEG_INF;
                                    m = std::max(m, dst[j]);
                                }
                                rmax[p0 + pp] = m;
                            }
                        }
                    }
                    // unnormalised probabilities in place, each logit exponentiated once; 1 / their sum per row
                    const int64_t Lp = T * PF_TILE;
                    for (int64_t p = 0; p < rows; ++p) {
                        float* x = logits.data() + p * npad;
                        const float m = rmax[p];
                        alignas(64) float lane[16] = {};
                        for (int64_t j = 0; j < Lp; j += 16) {
#pragma omp simd
                            for (int u = 0; u < 16; ++u) {
                                const float e = exp_le0(x[j + u] - m);
                                x[j + u] = e;
                                lane[u] += e;
                            }
                        }
                        float sum = 0.f;
                        for (int u = 0; u < 16; ++u) sum += lane[u];
                        rinv[p] = 1.f / sum;
                    }
                    // significance: max over the group, summed over the block's positions
                    for (int64_t rr = 0; rr < R; ++rr) {
                        const float* x0 = logits.data() + rr * G * npad;
                        const float* inv = rinv.data() + rr * G;
                        const int64_t Li = i0 + rr + 1;
#pragma omp simd
                        for (int64_t j = 0; j < Li; ++j) {
                            float best = x0[j] * inv[0];
                            for (int64_t g = 1; g < G; ++g) best = std::max(best, x0[g * npad + j] * inv[g]);
                            part[j] += best;
                        }
                    }
                    // outputs, PF_PV rows at a time over the value rows
                    for (int64_t p0 = 0; p0 < rows; p0 += PF_PV) {
                        const int np = (int)std::min<int64_t>(PF_PV, rows - p0);
                        const float* sp[PF_PV];
                        float* op[PF_PV];
                        for (int pp = 0; pp < np; ++pp) {
                            const int64_t p = p0 + pp, rr = p / G, g = p % G;
                            sp[pp] = logits.data() + p * npad;
                            op[pp] = out + ((bh * G + g) * n + i0 + rr) * rv;
                        }
                        const float* vb = v + bh * n * rv;
                        const float* iv = rinv.data() + p0;
                        switch (np) {
                            case 6: pv_rows<6>(sp, iv, vb, L, rv, op); break;
                            case 5: pv_rows<5>(sp, iv, vb, L, rv, op); break;
                            case 4: pv_rows<4>(sp, iv, vb, L, rv, op); break;
                            case 3: pv_rows<3>(sp, iv, vb, L, rv, op); break;
                            case 2: pv_rows<2>(sp, iv, vb, L, rv, op); break;
                            default: pv_rows<1>(sp, iv, vb, L, rv, op); break;
                        }
                    }
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < BH; ++bh) {                       // the tasks' rows added in task order
            float* sc = score + bh * n;
            const float* pb = partial.data() + bh * PF_GROUPS * n;
            std::memcpy(sc, pb, n * sizeof(float));
            for (int r = 1; r < PF_GROUPS; ++r)
#pragma omp simd
                for (int64_t j = 0; j < n; ++j) sc[j] += pb[r * n + j];
        }
    }
    return 0;
}

// A sliding layer's decode step (kvcal.runtime.hf.sliding.SlidingWindow), read in place from its codes: the G query
// heads of each KV head attend to the window's n coded tokens and then its r exact ones (the tail), in the stored
// bases, with no dequantized window in memory. q [B, H, G, d] float32, rotated into the key basis; keys uint8
// [B, H, m, k_row], whole blocks, the window's coded tokens the last n rows; key_scales uint8 [B, H, m / block,
// pair * d], one (scale, zero) per channel and block (per-channel keys; per-token keys carry one pair per k_group
// channels after each row's codes instead); values uint8 [B, H, n, v_row], codes then one pair per v_group channels;
// tail_k, tail_v float32 [B, H, r, d]; visible uint8 [B, n + r] or NULL: which of the window's tokens each sequence
// sees (0 for its left padding); out float32 [B, H, G, d], in the value basis. Group 0: the whole vector. k_levels,
// v_levels float32 [H, 2**bits]: a calibrated side's levels per KV head, or NULL for uniform codes. Items (b, h) in
// parallel.
int kvcal_sliding_decode(const float* q, const uint8_t* keys, const uint8_t* key_scales, const uint8_t* values,
                         const float* tail_k, const float* tail_v, const uint8_t* visible, float* out, int64_t B,
                         int64_t H, int64_t G, int64_t d, int64_t m, int64_t n, int64_t r, int32_t k_bits,
                         int32_t k_channel, int32_t k_group, int32_t v_bits, int32_t v_group, int32_t meta8,
                         int64_t block, float scale, int threads, const float* k_levels, const float* v_levels) {
    const int pair = meta8 ? 2 : 4;
    const int64_t k_bytes = (d * k_bits + 7) / 8, v_bytes = (d * v_bits + 7) / 8;
    const int64_t kg = k_group ? k_group : d, vg = v_group ? v_group : d;
    const int64_t k_row = k_bytes + (k_channel ? 0 : pair * (d / kg)), v_row = v_bytes + pair * (d / vg);
    const int64_t blocks = k_channel ? m / block : 0, S = n + r;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < B * H; ++item) {
        std::vector<float> x(d), s(d), z(d), w(G * S);
        const float* qi = q + item * G * d;
        const int64_t h = item % H;
        const float* k_lut = k_levels ? k_levels + h * ((int64_t)1 << k_bits) : nullptr;
        const float* v_lut = v_levels ? v_levels + h * ((int64_t)1 << v_bits) : nullptr;
        const std::vector<float> k_table = k_lut && k_bits < 8 ? byte_levels(k_lut, k_bits) : std::vector<float>();
        const std::vector<float> v_table = v_lut && v_bits < 8 ? byte_levels(v_lut, v_bits) : std::vector<float>();
        const float* k_tab = k_table.empty() ? nullptr : k_table.data();
        const float* v_tab = v_table.empty() ? nullptr : v_table.data();
        for (int64_t t = 0; t < n; ++t) {
            const int64_t j = m - n + t;                                  // the token's row among the key rows
            const uint8_t* row = keys + (item * m + j) * k_row;
            if (k_channel) {
                if (t == 0 || j % block == 0) {                           // a new block: its channels' pairs
                    const uint8_t* meta = key_scales + (item * blocks + j / block) * pair * d;
                    for (int64_t c = 0; c < d; ++c) read_meta(meta + c * pair, meta8, k_bits, &s[c], &z[c]);
                }
                if (k_lut) unpack_levels(row, k_bits, (int)d, k_lut, k_tab, x.data());
                else unpack(row, k_bits, (int)d, x.data());
                for (int64_t c = 0; c < d; ++c) x[c] = x[c] * s[c] + z[c];
            } else {
                dequantize_row(row, k_bits, d, kg, k_bytes, meta8, x.data(), k_lut, k_tab);
            }
            for (int64_t g = 0; g < G; ++g) w[g * S + t] = scale * dot(qi + g * d, x.data(), (int)d);
        }
        const float* tk = tail_k + item * r * d;
        for (int64_t t = 0; t < r; ++t)
            for (int64_t g = 0; g < G; ++g) w[g * S + n + t] = scale * dot(qi + g * d, tk + t * d, (int)d);
        if (visible != nullptr) {                                          // padding: weight 0
            const uint8_t* seen = visible + (item / H) * S;
            for (int64_t g = 0; g < G; ++g)
                for (int64_t t = 0; t < S; ++t)
                    if (!seen[t]) w[g * S + t] = NEG_INF;
        }
        std::vector<float> inv(G);
        for (int64_t g = 0; g < G; ++g) {                                 // softmax weights, unnormalised
            float* wg = w.data() + g * S, mx = NEG_INF, sum = 0.f;
            for (int64_t t = 0; t < S; ++t) mx = std::max(mx, wg[t]);
            for (int64_t t = 0; t < S; ++t) sum += (wg[t] = exp_le0(wg[t] - mx));
            inv[g] = 1.f / sum;
        }
        float* o = out + item * G * d;
        std::fill(o, o + G * d, 0.f);
        for (int64_t t = 0; t < n; ++t) {
            dequantize_row(values + (item * n + t) * v_row, v_bits, d, vg, v_bytes, meta8, x.data(), v_lut, v_tab);
            for (int64_t g = 0; g < G; ++g) {
                const float wt = w[g * S + t];
                for (int64_t c = 0; c < d; ++c) o[g * d + c] += wt * x[c];
            }
        }
        const float* tv = tail_v + item * r * d;
        for (int64_t t = 0; t < r; ++t)
            for (int64_t g = 0; g < G; ++g) {
                const float wt = w[g * S + n + t];
                for (int64_t c = 0; c < d; ++c) o[g * d + c] += wt * tv[t * d + c];
            }
        for (int64_t g = 0; g < G; ++g)
            for (int64_t c = 0; c < d; ++c) o[g * d + c] *= inv[g];
    }
    return 0;
}

}  // extern "C"
