// Fused decode attention over the compressed page arena: split pass + merge pass (flash-decoding), with the
// significance-score update fused into the merge.
//
// Work items are (sequence, KV head) pairs, item = b * H + h; each serves its g query heads and n new tokens, i.e.
// qn = g * n query rows (row j = gi * n + ni). An item's pages are listed high pages first, then low pages, in the
// plan built by kvcal/runtime/cuda/plan.py; a page's PageDesc (page_desc.cuh) gives its tier format, the head's
// ranks and every segment offset. Long items are cut into tasks of at most `chunk` pages (split-K); tasks are
// ordered longest first, so the block scheduler, which issues blocks in index order, approximates FDC's greedy
// longest-task-first assignment.
//
//   decode_split  grid = n_tasks, block = THREADS. One task: online softmax over its pages, for every query row,
//                 -> partial (m, l, acc[r_v]) per (task, row); logits of every slot go to the `logits` scratch.
//   decode_merge  grid = n_items, block = THREADS. Combines the item's partials with the m exact tokens (the window,
//                 which every query sees, then the n new tokens, causal among themselves), writes out [item, g, n, rv]
//                 and the exact tokens' scores, then adds to every stored
//                 token's score its probability (sum over n of the max over g), read back from `logits`.
//
// Query rows are pre-scaled by `scale`. Everything is fp32; dequantization is bit-exact with kvcal.runtime.quant.
// Checked on a GPU by tests/test_cuda_backend.py and tests/test_levels.py (`-m gpu`); the same plan and math run on
// the CPU in kvcal/runtime/backends/cuda/emulate.py, tested against the torch reference.
#include "page_desc.cuh"

#define THREADS 128           // 4 warps
#define QT 8                  // query rows per pass; items with more rows loop over row tiles
#define DIMS_PER_THREAD 2     // value channels each thread accumulates: ranks up to THREADS * 2 = 256
#define NEG_INF (-__int_as_float(0x7f800000))

// exp(a - b) where b may be -inf (nothing seen yet): 0 for a = -inf, 1 when both are -inf handled by the caller
__device__ __forceinline__ float exp_diff(float a, float b) { return a == NEG_INF ? 0.f : expf(a - b); }

// at least 4 blocks per SM: ptxas may then use up to 128 registers a thread (it held this kernel to 64 otherwise, and
// spilled once 3-bit codes could straddle a byte)
extern "C" __global__ void __launch_bounds__(THREADS, 4) decode_split(
    const unsigned char* __restrict__ arena,     // the page arena, flat bytes
    const int* __restrict__ descs,               // [n_desc, sizeof(PageDesc) / 4]
    const long long* __restrict__ page_off,      // [P] byte offset of each plan page in the arena
    const int* __restrict__ page_desc,           // [P] descriptor row of each plan page
    const int* __restrict__ page_fill,           // [P] slots written in the page (<= tokens)
    const int* __restrict__ task_item,           // [NT] item of each task
    const int* __restrict__ task_begin,          // [NT] first plan page of the task
    const int* __restrict__ task_end,            // [NT] one past its last plan page
    const float* __restrict__ query,             // [W, qn, r] rotated queries (rank r = the layer's largest)
    float* __restrict__ logits,                  // [P, t_max, qn] scaled logits, -inf where masked
    float* __restrict__ part_m,                  // [NT, qn] running max
    float* __restrict__ part_l,                  // [NT, qn] running sum of exp(logit - m)
    float* __restrict__ part_acc,                // [NT, qn, rv] unnormalized sum of p * v
    const float* __restrict__ levels,            // [2, H, 2, LEVEL_ROW] calibrated levels, or null (page_desc.cuh)
    int qn, int r, int rv, int t_max, float scale, int H)
{
    extern __shared__ float smem[];
    float* q_s = smem;                           // [QT, r] scaled query rows of this tile
    float* p_s = q_s + QT * r;                   // [QT, t_max] logits, then probabilities, of the current page
    int* pos_s = reinterpret_cast<int*>(p_s + QT * t_max);   // [t_max] positions (-1 = masked)
    __shared__ float m_s[QT], l_s[QT], alpha_s[QT];
    __shared__ PageDesc L;

    const int task = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int item = task_item[task];
    const unsigned char* pages = arena;

    for (int row0 = 0; row0 < qn; row0 += QT) {
        const int rows = min(QT, qn - row0);
        for (int i = tid; i < QT * r; i += THREADS) {
            const int j = i / r, d = i % r;
            q_s[i] = j < rows ? query[((long long)item * qn + row0 + j) * r + d] * scale : 0.f;
        }
        if (tid < QT) { m_s[tid] = NEG_INF; l_s[tid] = 0.f; alpha_s[tid] = 1.f; }
        float acc[QT][DIMS_PER_THREAD];
#pragma unroll
        for (int j = 0; j < QT; ++j)
#pragma unroll
            for (int k = 0; k < DIMS_PER_THREAD; ++k) acc[j][k] = 0.f;

        for (int p = task_begin[task]; p < task_end[task]; ++p) {
            __syncthreads();                     // previous page fully consumed before L / p_s are overwritten
            if (tid == 0) L = reinterpret_cast<const PageDesc*>(descs)[page_desc[p]];
            __syncthreads();
            const unsigned char* page = pages + page_off[p];
            const int fill = page_fill[p];
            // an untracked tier (pos_off < 0) has no position segment and no holes below the fill
            const bool tracked = L.pos_off >= 0;
            const int* pos = reinterpret_cast<const int*>(page + L.pos_off);
            const float* k_lut = level_row(levels, L, H, item % H, 0);
            const float* v_lut = level_row(levels, L, H, item % H, 1);

            // A: one thread per slot -> logits of the QT rows (q_s reads are warp broadcasts)
            for (int t = tid; t < fill; t += THREADS) {
                const int ps = tracked ? pos[t] : 0;
                pos_s[t] = ps;
                float dot[QT];
#pragma unroll
                for (int j = 0; j < QT; ++j) dot[j] = 0.f;
                if (ps >= 0 && L.meta8) {
                    for (int d = 0; d < L.r_k; ++d) {
                        const float k = key_at<true>(page, L, t, d, k_lut);
#pragma unroll
                        for (int j = 0; j < QT; ++j) dot[j] += q_s[j * r + d] * k;
                    }
                } else if (ps >= 0) {
                    for (int d = 0; d < L.r_k; ++d) {
                        const float k = key_at<false>(page, L, t, d, k_lut);
#pragma unroll
                        for (int j = 0; j < QT; ++j) dot[j] += q_s[j * r + d] * k;
                    }
                }
#pragma unroll
                for (int j = 0; j < QT; ++j) {
                    const float x = ps >= 0 ? dot[j] : NEG_INF;
                    p_s[j * t_max + t] = x;
                    if (logits != nullptr && j < rows) logits[((long long)p * t_max + t) * qn + row0 + j] = x;
                }
            }
            __syncthreads();

            // B: one warp per row -> page max, rescale factor, probabilities in place, running sum
            for (int j = warp; j < rows; j += THREADS / 32) {
                float mx = NEG_INF;
                for (int t = lane; t < fill; t += 32) mx = fmaxf(mx, p_s[j * t_max + t]);
                mx = warp_max(mx);
                const float m_old = m_s[j], m_new = fmaxf(m_old, mx);
                float sum = 0.f;
                for (int t = lane; t < fill; t += 32) {
                    const float e = m_new == NEG_INF ? 0.f : exp_diff(p_s[j * t_max + t], m_new);
                    p_s[j * t_max + t] = e;
                    sum += e;
                }
                sum = warp_sum(sum);
                if (lane == 0) {
                    const float alpha = m_new == NEG_INF ? 1.f : exp_diff(m_old, m_new);
                    alpha_s[j] = alpha;
                    l_s[j] = l_s[j] * alpha + sum;
                    m_s[j] = m_new;
                }
            }
            __syncthreads();

            // C: one thread per value channel -> acc = acc * alpha + sum_t p[t] * v[t]; masked slots are skipped
            // (raw tiers may hold stale NaN bytes there, and 0 * NaN would poison the sum)
#pragma unroll
            for (int k = 0; k < DIMS_PER_THREAD; ++k) {
                const int d = tid + k * THREADS;
                if (d >= L.r_v) continue;
#pragma unroll
                for (int j = 0; j < QT; ++j) acc[j][k] *= alpha_s[j];
                for (int t = 0; t < fill; ++t) {
                    if (pos_s[t] < 0) continue;
                    const float v = L.meta8 ? value_at<true>(page, L, t, d, v_lut)
                                            : value_at<false>(page, L, t, d, v_lut);
#pragma unroll
                    for (int j = 0; j < QT; ++j) acc[j][k] += p_s[j * t_max + t] * v;
                }
            }
        }
        __syncthreads();
        if (tid < rows) {
            part_m[(long long)task * qn + row0 + tid] = m_s[tid];
            part_l[(long long)task * qn + row0 + tid] = l_s[tid];
        }
#pragma unroll
        for (int k = 0; k < DIMS_PER_THREAD; ++k) {
            const int d = tid + k * THREADS;
            if (d >= rv) continue;               // channels past the head's rank stay exactly 0
#pragma unroll
            for (int j = 0; j < QT; ++j)
                if (j < rows) part_acc[((long long)task * qn + row0 + j) * rv + d] = acc[j][k];
        }
        __syncthreads();                         // m_s / q_s are reused by the next row tile
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) decode_merge(
    unsigned char* __restrict__ arena,           // scores are updated in place
    const int* __restrict__ descs,
    const long long* __restrict__ page_off,
    const int* __restrict__ page_desc,
    const int* __restrict__ page_fill,
    const int* __restrict__ item_page_start,     // [W + 1] the item's plan pages
    const int* __restrict__ item_task_start,     // [W + 1] into item_tasks
    const int* __restrict__ item_tasks,          // [NT] task indices of each item
    const float* __restrict__ part_m, const float* __restrict__ part_l, const float* __restrict__ part_acc,
    const float* __restrict__ logits,            // [P, t_max, qn]
    const float* __restrict__ query,             // [W, g, n, r]
    const float* __restrict__ exact_keys,        // [W, m, r]: the window, then the n new tokens
    const float* __restrict__ exact_values,      // [W, m, rv]
    const long long* __restrict__ exact_from,    // [B] first visible exact token (left padding before), or null
    float* __restrict__ out,                     // [W, g, n, rv]
    float* __restrict__ exact_score,             // [W, m]
    int g, int n, int m, int H, int r, int rv, int t_max, float scale, int track_scores)
{
    extern __shared__ float smem[];
    const int qn = g * n, prior = m - n;
    float* M = smem;                             // [qn] final max
    float* Linv = M + qn;                        // [qn] 1 / final sum
    float* p_new = Linv + qn;                    // [qn, m] probabilities of the exact tokens
    __shared__ PageDesc L;

    const int item = blockIdx.x, tid = threadIdx.x;
    const int t0 = item_task_start[item], t1 = item_task_start[item + 1];
    const int from = exact_from ? (int)exact_from[item / H] : 0;

    // 1. per row: max and sum over the item's partials and the exact tokens it may see (from <= i <= prior + ni)
    for (int j = tid; j < qn; j += THREADS) {
        const int last = prior + j % n;
        const float* q = query + ((long long)item * qn + j) * r;
        float mx = NEG_INF;
        for (int s = t0; s < t1; ++s) mx = fmaxf(mx, part_m[(long long)item_tasks[s] * qn + j]);
        for (int i = 0; i < m; ++i) {
            float x = NEG_INF;
            if (i >= from && i <= last) {
                const float* k = exact_keys + ((long long)item * m + i) * r;
                x = 0.f;
                for (int d = 0; d < r; ++d) x += (q[d] * scale) * k[d];
            }
            p_new[j * m + i] = x;
            mx = fmaxf(mx, x);
        }
        float l = 0.f;                           // mx is finite: the row's own token is always visible
        for (int s = t0; s < t1; ++s) {
            const long long ts = (long long)item_tasks[s] * qn + j;
            l += part_l[ts] * exp_diff(part_m[ts], mx);
        }
        for (int i = 0; i < m; ++i) {
            const float e = exp_diff(p_new[j * m + i], mx);
            p_new[j * m + i] = e;
            l += e;
        }
        M[j] = mx;
        Linv[j] = 1.f / l;
        for (int i = 0; i < m; ++i) p_new[j * m + i] *= Linv[j];
    }
    __syncthreads();

    // 2. out = (sum_s acc_s * exp(m_s - M)) / L + sum_i p_new * v_new
    for (int e = tid; e < qn * rv; e += THREADS) {
        const int j = e / rv, d = e % rv;
        float o = 0.f;
        for (int s = t0; s < t1; ++s) {
            const long long ts = (long long)item_tasks[s] * qn + j;
            o += part_acc[ts * rv + d] * exp_diff(part_m[ts], M[j]);
        }
        o *= Linv[j];
        for (int i = 0; i < m; ++i) o += p_new[j * m + i] * exact_values[((long long)item * m + i) * rv + d];
        out[((long long)item * qn + j) * rv + d] = o;
    }

    // 3. the exact tokens' own scores: sum over the query tokens of the max over query heads (0 where not visible)
    for (int i = tid; i < m; i += THREADS) {
        float s = 0.f;
        if (track_scores)
            for (int ni = 0; ni < n; ++ni) {
                float mx = 0.f;
                for (int gi = 0; gi < g; ++gi) mx = fmaxf(mx, p_new[(gi * n + ni) * m + i]);
                s += mx;
            }
        exact_score[(long long)item * m + i] = s;
    }
    if (!track_scores || logits == nullptr) return;

    // 4. fused score update of the stored tokens: score += sum_ni max_gi exp(logit - M) / L. Each slot belongs to one
    //    item, so plain read-modify-writes do not race.
    for (int p = item_page_start[item]; p < item_page_start[item + 1]; ++p) {
        __syncthreads();
        if (tid == 0) L = reinterpret_cast<const PageDesc*>(descs)[page_desc[p]];
        __syncthreads();
        if (L.score_off < 0) continue;           // untracked tier: no scores (L is shared: uniform over the block)
        unsigned char* page = arena + page_off[p];
        const int* pos = reinterpret_cast<const int*>(page + L.pos_off);
        float* score = reinterpret_cast<float*>(page + L.score_off);
        for (int t = tid; t < page_fill[p]; t += THREADS) {
            if (pos[t] < 0) continue;
            const float* x = logits + ((long long)p * t_max + t) * qn;
            float delta = 0.f;
            for (int ni = 0; ni < n; ++ni) {
                float mx = 0.f;
                for (int gi = 0; gi < g; ++gi) {
                    const int j = gi * n + ni;
                    mx = fmaxf(mx, expf(x[j] - M[j]) * Linv[j]);
                }
                delta += mx;
            }
            score[t] += delta;
        }
    }
}
