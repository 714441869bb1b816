// score_blocks.cu — Quest block scores of the lookahead query, and per (sequence, KV head) top-k.
//
// CPU twins: oasis_core::kernels::score_blocks and oasis_core::kernels::topk_blocks.
//
// blk_indptr is checked row by row in the kernels (the CPU twins reject a malformed table): an
// entry of score_blocks whose row is malformed (start < 0, end < start, end > nnz) or that lies
// in no row scores -inf, and a malformed row of topk_blocks has no blocks (all -1). Neither reads
// outside blk_indices, the scores or q.
#include "oasis_common.cuh"
#include "oasis_params.cuh"
#include "oasis_topk.cuh"

// Launch shape of score_blocks_*, chosen by experiments/exp_score.py on the H200 (docs/PERF.md): 8
// warps per thread block, 4 blocks per SM (<= 64 registers), 8 summaries in flight per warp, and
// the warps of a block on consecutive tiles of ONE KV head. That is 0.84 x copy bandwidth where
// (2 blocks, 16 in flight, heads across the warps of a block) reached 0.66: more resident warps
// hide the per-warp prologue and the shuffle reductions behind other warps' loads. The #ifndef
// guards let that script compile variants; oasis-cuda builds the defaults, and
// oasis_cuda::ops::SCORE_THREADS / the grid in Gpu::score_blocks must match them.
#ifndef OASIS_SCORE_THREADS
#define OASIS_SCORE_THREADS 256
#endif
#ifndef OASIS_SCORE_MIN_BLOCKS
#define OASIS_SCORE_MIN_BLOCKS 4
#endif
// Most summaries one unit of lanes loads before using any (a power of two <= 16).
#ifndef OASIS_SCORE_UMAX
#define OASIS_SCORE_UMAX 8
#endif
// 1: thread block c scores OASIS_SCORE_THREADS / 32 consecutive tiles of head c % H (grid:
// ceil(tiles / warps per block) * H). 0: warp w scores tile w / H for head w % H.
#ifndef OASIS_SCORE_HEAD_MAJOR
#define OASIS_SCORE_HEAD_MAJOR 1
#endif
// Consecutive entries j of blk_indices one warp of score_blocks_* scores, for one KV head: the
// grid has ceil(nnz / OASIS_SCORE_TILE) * num_kv_heads warps. One index per lane: must be 32.
#define OASIS_SCORE_TILE 32
// Threads per block of topk_blocks_f32, and the largest k it supports (the selected entries are
// sorted in shared memory: k rounded up to a power of two must fit the sort buffer).
#ifndef OASIS_TOPK_THREADS
#define OASIS_TOPK_THREADS 512
#endif
// OASIS_MAX_TOPK is oasis_core::limits::MAX_TOP_K_BLOCKS, defined on the command line by
// oasis_cuda::nvrtc::compile_options (one source for the kernels, the wrappers and Python).
#ifndef OASIS_MAX_TOPK
#error "OASIS_MAX_TOPK is undefined: compile through oasis_cuda::nvrtc (-DOASIS_MAX_TOPK=...)"
#endif
// Keys of one (sequence, head) kept in shared memory across the radix passes (the scores are
// strided by num_kv_heads in global memory: read once, not once per pass). Longer sequences read
// global memory each pass. Arbitrary: 32 KiB of static shared memory.
#define OASIS_TOPK_CACHE 8192

namespace oasis {

// Largest s with blk_indptr[s] <= j: then j < blk_indptr[s + 1] (empty sequences are skipped).
__device__ __forceinline__ int score_seq_of(const int* __restrict__ blk_indptr, int num_seqs, int j) {
    int lo = 0;
    int hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (blk_indptr[mid] <= j) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// The 8 (16-bit types) or 4 (f32) values of a 16-byte word, as f32.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& w, float* out);
template <>
__device__ __forceinline__ void unpack16<bf16>(const uint4& w, float* out) {
    const u32 v[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(v[i] << 16);
        out[2 * i + 1] = __uint_as_float(v[i] & 0xffff0000u);
    }
}
template <>
__device__ __forceinline__ void unpack16<f16>(const uint4& w, float* out) {
    const u32 v[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f16 a;
        f16 b;
        a.bits = (unsigned short)(v[i] & 0xffffu);
        b.bits = (unsigned short)(v[i] >> 16);
        out[2 * i] = to_f32(a);
        out[2 * i + 1] = to_f32(b);
    }
}
template <>
__device__ __forceinline__ void unpack16<float>(const uint4& w, float* out) {
    out[0] = __uint_as_float(w.x);
    out[1] = __uint_as_float(w.y);
    out[2] = __uint_as_float(w.z);
    out[3] = __uint_as_float(w.w);
}

// E4M3 bytes are exact in f16 and f32. sm_89+ converts two per instruction (e4m3x4_to_f32, in
// oasis_common.cuh); elsewhere the byte's exponent and mantissa bits are moved under an f32
// exponent and rebiased by 2^120 (exact, subnormals included: NVRTC compiles without -ftz).
// Finite codes only (the bound never stores E4M3's NaN; a row with a non-finite value has a NaN
// scale instead).
template <>
__device__ __forceinline__ void unpack16<fp8e4m3>(const uint4& w, float* out) {
    const u32 v[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        float f[4];
        e4m3x4_to_f32(v[i], f);
#pragma unroll
        for (int b = 0; b < 4; ++b) out[4 * i + b] = f[b];
#else
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const u32 x = v[i] << (24 - 8 * b);  // byte b on top
            out[4 * i + b] = __uint_as_float((x & 0x80000000u) | ((x >> 4) & 0x07f00000u)) * exp2i(120);
        }
#endif
    }
}

// A row's score: times its scale for the 8-bit bound (score_blocks_bound8), as is otherwise.
template <typename S>
__device__ __forceinline__ float bound_scaled(float acc, const float* __restrict__ scales, i64 entry) {
    if constexpr (sizeof(S) == 1) {
        return acc * scales[entry];
    } else {
        return acc;
    }
}

// Vector path of score_blocks_impl: warp `w` scores entries j of [tile * 32, tile * 32 + 32)
// (tile = w / num_kv_heads) for head h = w % num_kv_heads, with 16-byte loads of the summaries.
// One (block, head) summary is 2*V 16-byte words (V = head_dim * sizeof(T) / 16: min row then
// max row). V <= 16: a "unit" of 2V lanes holds one summary, one word per lane (lanes r < V the
// min, r >= V the max of the same d's); 32 / 2V units per warp, each over its own slice of the
// tile. V >= 32: the whole warp holds a summary, V/32 words of each row per lane. The query of the
// current sequence lives in registers as the two group-summed coefficient vectors P and N (see
// load_q), so any GQA group costs one FMA per summary value; `U` summaries are loaded before any
// is used. Scores are reduced over the unit's lanes with xor shuffles.
template <typename T, typename S, int V>
__device__ void score_blocks_vec(
    const T* __restrict__ q, const S* __restrict__ summaries, const int* __restrict__ blk_indptr,
    const int* __restrict__ blk_indices, float* __restrict__ scores, int num_seqs, int nnz, int num_qo_heads,
    int num_kv_heads, int head_dim, int num_host_blocks, int tile, int h, const float* __restrict__ scales) {
    constexpr int E = 16 / (int)sizeof(S);           // values per 16-byte word of the summaries
    constexpr bool SPLIT = V <= 16;                  // min and max rows on different lanes
    constexpr int LPU = SPLIT ? 2 * V : 32;          // lanes per unit
    constexpr int NSUB = 32 / LPU;                   // units per warp
    constexpr int NV = SPLIT ? 1 : V / 32;           // words of each row per lane
    constexpr int LOADS = SPLIT ? 1 : 2 * NV;        // 16-byte loads per lane per summary
    constexpr int U0 = LOADS >= 16 ? 1 : 16 / LOADS;
    // The 8-bit bound carries twice the values per load: half as many in flight keep the bytes
    // in flight per SM far above what the bandwidth needs, and the registers under the bounds.
    constexpr int UCAP = sizeof(S) == 1 ? (OASIS_SCORE_UMAX > 1 ? OASIS_SCORE_UMAX / 2 : 1) : OASIS_SCORE_UMAX;
    constexpr int U = U0 < UCAP ? U0 : UCAP;  // summaries in flight per unit
    // SPLIT lanes use the coefficients of one row only; for the 8-bit bound (16 per word) only
    // those are kept (cmin holds N or P by the lane's row; cmax is unused).
    constexpr bool ONE_COEF = SPLIT && sizeof(S) == 1;
    constexpr int SUBT = OASIS_SCORE_TILE / NSUB;    // entries per unit

    const int lane = threadIdx.x & 31;
    const int sub = lane / LPU;
    const int r = lane % LPU;
    const int half = SPLIT ? r / V : 0;
    const int group = num_qo_heads / num_kv_heads;

    const int t0 = tile * OASIS_SCORE_TILE;
    const int t1 = min(nnz, t0 + OASIS_SCORE_TILE);
    // One block id per lane for the whole tile, handed out with shuffles.
    const int tile_idx = t0 + lane < t1 ? blk_indices[t0 + lane] : -1;
    int j = min(t1, t0 + sub * SUBT);
    const int jend = min(t1, t0 + (sub + 1) * SUBT);

    // Because min <= max, max(q * lo, q * hi) = max(q, 0) * hi + min(q, 0) * lo, so the score
    // summed over the GQA group is one dot product of the summary with two vectors of the query:
    // P = sum_g max(q_g, 0) (against the max row) and N = sum_g min(q_g, 0) (against the min row).
    // Each lane keeps the coefficients of the words it loads: one FMA per summary value.
    float cmin[NV][E];  // N on this lane's min words
    float cmax[NV][E];  // P on this lane's max words
    int s = 0;
    int seq_end = 0;
    const uint4* sum4 = (const uint4*)summaries;
    const i64 row_words = (i64)V;  // 16-byte words per row
    // d offset (in words) of word k of this lane's row
    auto word_of = [&](int k) { return SPLIT ? (r % V) : (r + 32 * k); };
    auto load_q = [&]() {
        const T* qs = q + ((i64)s * num_qo_heads + (i64)h * group) * head_dim;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
#pragma unroll
            for (int e = 0; e < E; ++e) {
                float pos = 0.f;
                float neg = 0.f;
                for (int g = 0; g < group; ++g) {
                    const float qv = to_f32(qs[(i64)g * head_dim + word_of(k) * E + e]);
                    pos += fmaxf(qv, 0.f);
                    neg += fminf(qv, 0.f);
                }
                if constexpr (ONE_COEF) {
                    cmin[k][e] = half ? pos : neg;
                } else {
                    cmin[k][e] = neg;
                    cmax[k][e] = pos;
                }
            }
        }
    };
    // Enter row s at entry j, checked: 0 <= blk_indptr[s] <= j < blk_indptr[s + 1] <= nnz. Entries
    // outside such a row score -inf here, one by one, until one is inside (or the unit's entries
    // run out), so a malformed table can neither be read outside nor stall the loop below (whose
    // body is unchanged: the check costs two loads per row). No shuffle here: the units of a warp
    // may diverge.
    auto enter_row = [&]() {
        while (j < jend) {
            const int b = blk_indptr[s];
            seq_end = blk_indptr[s + 1];
            if (0 <= b && b <= j && j < seq_end && seq_end <= nnz) {
                load_q();
                return;
            }
            if (r == 0) scores[(i64)j * num_kv_heads + h] = neg_inf();
            ++j;
            while (s + 1 < num_seqs && blk_indptr[s + 1] <= j) ++s;
        }
    };
    if (j < jend) s = score_seq_of(blk_indptr, num_seqs, j);
    seq_end = j;  // enter the first row at the top of the loop

    while (__any_sync(0xffffffffu, j < jend)) {
        if (j < jend && j >= seq_end) {  // next non-empty sequence
            while (s + 1 < num_seqs && blk_indptr[s + 1] <= j) ++s;
            enter_row();
        }
        const int cnt = j < jend ? min(U, min(jend, seq_end) - j) : 0;
        int bid[U];
        uint4 raw[U][LOADS];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            bid[u] = __shfl_sync(0xffffffffu, tile_idx, (j - t0 + u) & 31);
            const bool ok = u < cnt && bid[u] >= 0 && bid[u] < num_host_blocks;
            const uint4* base = sum4 + ((i64)bid[u] * num_kv_heads + h) * 2 * row_words;
#pragma unroll
            for (int l = 0; l < LOADS; ++l) {
                if (ok) {
                    // SPLIT: word r of the unit (min row r < V, max row after). Else: min words
                    // r + 32k, then max words V + r + 32k.
                    const int wi = SPLIT ? r : (l < NV ? r + 32 * l : V + r + 32 * (l - NV));
                    raw[u][l] = base[wi];
                } else {
                    raw[u][l].x = 0u;
                    raw[u][l].y = 0u;
                    raw[u][l].z = 0u;
                    raw[u][l].w = 0u;
                }
            }
        }
        float part[U];  // this lane's share of each summary's score
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float acc = 0.f;
            if (SPLIT) {
                // Lanes r < V hold a min word, lanes r >= V the max word of the same d's.
                float v[E];
                unpack16<S>(raw[u][0], v);
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    if constexpr (ONE_COEF) {
                        acc += cmin[0][e] * v[e];
                    } else {
                        acc += (half ? cmax[0][e] : cmin[0][e]) * v[e];
                    }
                }
            } else {
#pragma unroll
                for (int k = 0; k < NV; ++k) {
                    float lo[E];
                    float hi[E];
                    unpack16<S>(raw[u][k], lo);
                    unpack16<S>(raw[u][NV + k], hi);
#pragma unroll
                    for (int e = 0; e < E; ++e) acc += cmin[k][e] * lo[e] + cmax[k][e] * hi[e];
                }
            }
            part[u] = acc;
        }
        if constexpr (LPU == 32 && U >= 2) {
            // Reduce-scatter over the warp: each xor step halves the summaries a lane carries, so
            // U summaries cost about U shuffles instead of 5 each. After log2(U) steps lane l
            // carries summary (l >> (5 - log2 U)) & (U - 1); the lanes sharing it then sum.
            constexpr int LOGU = U >= 16 ? 4 : U >= 8 ? 3 : U >= 4 ? 2 : 1;
#pragma unroll
            for (int o = 16, n = U / 2; n >= 1; o >>= 1, n >>= 1) {
                const bool upper = (lane & o) != 0;
#pragma unroll
                for (int i = 0; i < n; ++i) {
                    const float send = upper ? part[i] : part[i + n];
                    const float keep = upper ? part[i + n] : part[i];
                    part[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                }
            }
            float acc = part[0];
#pragma unroll
            for (int o = 1; o < (32 >> LOGU); o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            const int u = (lane >> (5 - LOGU)) & (U - 1);
            const int b = __shfl_sync(0xffffffffu, tile_idx, (j - t0 + u) & 31);
            if ((lane & ((32 >> LOGU) - 1)) == 0 && u < cnt) {
                const bool ok = b >= 0 && b < num_host_blocks;
                scores[(i64)(j + u) * num_kv_heads + h] =
                    ok ? bound_scaled<S>(acc, scales, (i64)b * num_kv_heads + h) : neg_inf();
            }
        } else {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float acc = part[u];
#pragma unroll
                for (int o = 1; o < LPU; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                if (r == 0 && u < cnt) {
                    const bool ok = bid[u] >= 0 && bid[u] < num_host_blocks;
                    scores[(i64)(j + u) * num_kv_heads + h] =
                        ok ? bound_scaled<S>(acc, scales, (i64)bid[u] * num_kv_heads + h) : neg_inf();
                }
            }
        }
        j += cnt;
    }
}

// Scalar path (any head_dim, any alignment): warp w scores the entries of its tile
// one by one for head h, lanes striding over d.
template <typename T, typename S>
__device__ void score_blocks_scalar(
    const T* __restrict__ q, const S* __restrict__ summaries, const int* __restrict__ blk_indptr,
    const int* __restrict__ blk_indices, float* __restrict__ scores, int num_seqs, int nnz, int num_qo_heads,
    int num_kv_heads, int head_dim, int num_host_blocks, int tile, int h, const float* __restrict__ scales) {
    const int lane = threadIdx.x & 31;
    const int t0 = tile * OASIS_SCORE_TILE;
    const int t1 = min(nnz, t0 + OASIS_SCORE_TILE);
    const int group = num_qo_heads / num_kv_heads;
    int s = score_seq_of(blk_indptr, num_seqs, t0);
    for (int j = t0; j < t1; ++j) {
        while (s + 1 < num_seqs && blk_indptr[s + 1] <= j) ++s;
        const int row_b = blk_indptr[s];
        const int row_e = blk_indptr[s + 1];
        const bool row_ok = 0 <= row_b && row_b <= j && j < row_e && row_e <= nnz;  // as in the vector path
        const int b = blk_indices[j];
        if (!row_ok || b < 0 || b >= num_host_blocks) {
            if (lane == 0) scores[(i64)j * num_kv_heads + h] = neg_inf();
            continue;
        }
        const S* mn = summaries + ((i64)b * num_kv_heads + h) * 2 * head_dim;
        const S* mx = mn + head_dim;
        const T* qs = q + ((i64)s * num_qo_heads + (i64)h * group) * head_dim;
        float acc = 0.f;
        for (int x = lane; x < head_dim; x += 32) {
            const float lo_k = to_f32(mn[x]);
            const float hi_k = to_f32(mx[x]);
            for (int g = 0; g < group; ++g) {
                const float qv = to_f32(qs[(i64)g * head_dim + x]);
                acc += fmaxf(qv * lo_k, qv * hi_k);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) scores[(i64)j * num_kv_heads + h] = bound_scaled<S>(acc, scales, (i64)b * num_kv_heads + h);
    }
}

// ---- The 8-bit bound on the tensor cores (score_blocks_bound8_tc_*) ---------------------------
// The same grid, tiles and contract as score_blocks_impl over the 8-bit bound, for head_dim 64,
// 128 and 256 with 16-byte aligned bounds. The score is one dot product (see score_blocks_vec):
// [N | P] . [min row | max row], so one m16n8k16 MMA per 16 of the 2 * head_dim codes takes 8
// entries at once: B = their codes, exact in f16 (one cvt per two codes, no f32 conversion: the
// FMA kernel is bound by those), A = the coefficients, row 0 in f16 and row 1 the remainder
// coef - f16(coef) (together 22 significant bits; rows 2-15 zero), f32 accumulation; the score
// is C[0] + C[1] times the row's scale. Lane (g, c) loads 16 bytes of entry g's bound per 64-byte
// chunk kk (8 entries x 64 contiguous bytes per load); its word w is k-step 4 kk + w, bytes
// p..p+3 (p = 64 kk + 16 c + 4 w) serving as the MMA's k = (2c, 2c+1) and (2c+8, 2c+9). The
// coefficients are laid out in that order in the warp's shared memory (per k-step: rows 0 and 1
// x 4 lanes, two f16x2 each), built once per sequence the warp meets; an 8-entry n-tile that
// holds several sequences takes one pass per sequence. The coefficients are stored in units of
// a power of two 2^e >= their largest magnitude (the score multiplied back), so f16's range
// bounds neither large nor small queries.
template <typename T, int D>
__device__ void score_bound8_tc(
    const T* __restrict__ q, const unsigned char* __restrict__ bounds, const int* __restrict__ blk_indptr,
    const int* __restrict__ blk_indices, float* __restrict__ scores, int num_seqs, int nnz, int num_qo_heads,
    int num_kv_heads, int num_host_blocks, int tile, int h, const float* __restrict__ scales,
    uint2* __restrict__ coef) {  // [D / 8][8] of this warp
    constexpr int KSTEPS = D / 8;  // 2 * D codes, 16 per MMA
    constexpr int CHUNKS = D / 32; // 64-byte chunks of one (min; max) bound
    constexpr unsigned FULL = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int c = lane & 3;
    const int group = num_qo_heads / num_kv_heads;
    const int t0 = tile * OASIS_SCORE_TILE;
    const int t1 = min(nnz, t0 + OASIS_SCORE_TILE);

    // This lane's entry: in a well-formed row (my_s) with a block in range (my_b), else -inf now.
    int my_s = -1;
    int my_b = -1;
    {
        const int j = t0 + lane;
        if (j < t1) {
            const int s = score_seq_of(blk_indptr, num_seqs, j);
            const int rb = blk_indptr[s];
            const int re = blk_indptr[s + 1];
            const int b = blk_indices[j];
            if (0 <= rb && rb <= j && j < re && re <= nnz && b >= 0 && b < num_host_blocks) {
                my_s = s;
                my_b = b;
            } else {
                scores[(i64)j * num_kv_heads + h] = neg_inf();
            }
        }
    }
    const unsigned live = __ballot_sync(FULL, my_s >= 0);
    // This lane's column g of n-tile nt: its entry's bound, 16 bytes of each 64-byte chunk (zero
    // for an entry scored -inf above). The next n-tile's loads are issued before this one's MMAs.
    auto load_tile = [&](int nt, uint4 (&dst)[CHUNKS]) {
        const int col_s = __shfl_sync(FULL, my_s, 8 * nt + g);
        const int col_b = __shfl_sync(FULL, my_b, 8 * nt + g);
        const uint4* src = (const uint4*)(bounds + ((i64)max(col_b, 0) * num_kv_heads + h) * 2 * D);
#pragma unroll
        for (int kk = 0; kk < CHUNKS; ++kk) dst[kk] = col_s >= 0 ? src[4 * kk + c] : make_uint4(0u, 0u, 0u, 0u);
    };
    uint4 raw[CHUNKS];
    load_tile(0, raw);
    int coef_s = -1;
    float coef_pow = 1.f;  // the coefficients' power-of-two unit (see the build below)
#pragma unroll 1
    for (int nt = 0; nt < OASIS_SCORE_TILE / 8; ++nt) {
        uint4 nxt[CHUNKS];
        const bool more = nt + 1 < OASIS_SCORE_TILE / 8 && ((live >> (8 * (nt + 1))) != 0u);  // warp-uniform
        if (more) load_tile(nt + 1, nxt);
        unsigned pending = (live >> (8 * nt)) & 0xffu;
        // The two columns this lane writes (2c, 2c + 1), when g == 0.
        int out_s[2];
        int out_b[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            out_s[e] = __shfl_sync(FULL, my_s, 8 * nt + 2 * c + e);
            out_b[e] = __shfl_sync(FULL, my_b, 8 * nt + 2 * c + e);
        }
        while (pending != 0u) {
            const int s = __shfl_sync(FULL, my_s, 8 * nt + __ffs(pending) - 1);
            if (s != coef_s) {  // warp-uniform: the coefficients of sequence s
                // Each lane's share (positions of its i = lane + 32 t), then the warp's largest
                // |coefficient| as 2^e: the f16 rows hold coef x 2^-e (at most 1 in magnitude),
                // so neither a large nor a small query leaves f16's normal range; the score is
                // multiplied back by 2^e (exact).
                constexpr int PER_LANE = KSTEPS * 4 / 32;  // 1, 2 or 4
                const T* qs = q + ((i64)s * num_qo_heads + (i64)h * group) * D;
                float cv[PER_LANE][4];
                float amax = 0.f;
#pragma unroll
                for (int t = 0; t < PER_LANE; ++t) {
                    const int i = lane + 32 * t;
                    const int ks = i >> 2;
                    const int p = 64 * (ks >> 2) + 16 * (i & 3) + 4 * (ks & 3);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int x = p + e;  // < D: the min row (N), else the max row (P)
                        const int d = x < D ? x : x - D;
                        float acc = 0.f;
                        for (int gq = 0; gq < group; ++gq) {
                            const float qv = to_f32(qs[(i64)gq * D + d]);
                            acc += x < D ? fminf(qv, 0.f) : fmaxf(qv, 0.f);
                        }
                        cv[t][e] = acc;
                        amax = fmaxf(amax, fabsf(acc));  // NaN is dropped here and stays in cv
                    }
                }
                amax = warp_max(amax);
                int ex = 0;
                if (amax > 0.f && amax <= 3.4e38f) frexpf(amax, &ex);  // amax = f 2^ex, f in [0.5, 1)
                ex = max(-126, min(127, ex));
                coef_pow = ldexpf(1.f, ex);
                const float down = ldexpf(1.f, -ex);
                __syncwarp();
#pragma unroll
                for (int t = 0; t < PER_LANE; ++t) {
                    const int i = lane + 32 * t;
                    const int ks = i >> 2;
                    const int cc = i & 3;
                    float v[4];
                    float r[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float x = cv[t][e] * down;  // exact: a power of two
                        v[e] = to_f32(from_f32<f16>(x));
                        r[e] = x - v[e];
                    }
                    coef[ks * 8 + cc] = make_uint2(f16x2_rn(v[0], v[1]), f16x2_rn(v[2], v[3]));
                    coef[ks * 8 + 4 + cc] = make_uint2(f16x2_rn(r[0], r[1]), f16x2_rn(r[2], r[3]));
                }
                __syncwarp();
                coef_s = s;
            }
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
                const uint4 w4 = raw[ks >> 2];
                const u32 w = (ks & 3) == 0 ? w4.x : (ks & 3) == 1 ? w4.y : (ks & 3) == 2 ? w4.z : w4.w;
                u32 b0;
                u32 b1;
                e4m3x4_to_f16x2(w, b0, b1);
                const uint2 a = lane < 8 ? coef[ks * 8 + lane] : make_uint2(0u, 0u);  // rows 0, 1
                const u32 af[4] = {a.x, 0u, a.y, 0u};
                mma_f16_16816(acc, af, b0, b1);
            }
            // Row 1 (lanes 4..7) onto row 0 (lanes 0..3): columns 2c, 2c + 1.
            const float r0 = __shfl_down_sync(FULL, acc[0], 4);
            const float r1 = __shfl_down_sync(FULL, acc[1], 4);
            if (g == 0) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (out_s[e] == s) {
                        const float sc =
                            (e == 0 ? acc[0] + r0 : acc[1] + r1) * coef_pow * scales[(i64)out_b[e] * num_kv_heads + h];
                        scores[(i64)(t0 + 8 * nt + 2 * c + e) * num_kv_heads + h] = sc;
                    }
                }
            }
            pending &= ~((__ballot_sync(FULL, my_s == s) >> (8 * nt)) & 0xffu);
        }
        if (!more) break;  // no live entry in the rest of the tile
#pragma unroll
        for (int kk = 0; kk < CHUNKS; ++kk) raw[kk] = nxt[kk];
    }
}

// grid: see OASIS_SCORE_HEAD_MAJOR (tiles = ceil(nnz / OASIS_SCORE_TILE)).
// Entry (j, h) = sum over query heads g of KV head h, over d, of
//   max(q[s,g,d] * min[b,h,d], q[s,g,d] * max[b,h,d])
// with b = blk_indices[j] and s the sequence whose CSR range holds j. An out-of-range block id,
// and an entry outside every well-formed row, scores -inf (never selected).
template <typename T, typename S>
__device__ void score_blocks_impl(
    const T* __restrict__ q,             // [num_seqs, num_qo_heads, head_dim] (the lookahead row)
    const S* __restrict__ summaries,     // [num_host_blocks, num_kv_heads, 2, head_dim] (S = T, or the 8-bit bound)
    const int* __restrict__ blk_indptr,  // [num_seqs + 1]
    const int* __restrict__ blk_indices, // [nnz] host block of each logical block, logical order
    float* __restrict__ scores,          // [nnz, num_kv_heads]
    int num_seqs, int nnz, int num_qo_heads, int num_kv_heads, int head_dim, int num_host_blocks,
    const float* __restrict__ scales) {  // [num_host_blocks, num_kv_heads] with the 8-bit bound, else null
    const i64 num_tiles = ((i64)nnz + OASIS_SCORE_TILE - 1) / OASIS_SCORE_TILE;
#if OASIS_SCORE_HEAD_MAJOR
    const int h = (int)(blockIdx.x % (unsigned)num_kv_heads);
    const i64 tile_l = (i64)(blockIdx.x / (unsigned)num_kv_heads) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (tile_l >= num_tiles) return;  // warp-uniform
    const int tile = (int)tile_l;
#else
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= num_tiles * num_kv_heads) return;  // warp-uniform
    const int tile = (int)(w / num_kv_heads);
    const int h = (int)(w - (i64)tile * num_kv_heads);
#endif
    if (num_seqs <= 0) {  // no row at all (blk_indptr = [x]): every entry scores -inf
        const int j = tile * OASIS_SCORE_TILE + (threadIdx.x & 31);
        if (j < nnz) scores[(i64)j * num_kv_heads + h] = neg_inf();
        return;
    }
    const int bytes = head_dim * (int)sizeof(S);
    const int v = bytes % 16 == 0 ? bytes / 16 : 0;
    const bool aligned = ((u64)summaries & 15) == 0;
    bool done = false;
    if (aligned) {
        if (sizeof(S) == 1 && v == 4) {  // the 8-bit bound of head_dim 64
            score_blocks_vec<T, S, 4>(q, summaries, blk_indptr, blk_indices, scores, num_seqs, nnz, num_qo_heads,
                                      num_kv_heads, head_dim, num_host_blocks, tile, h, scales);
            done = true;
        } else if (v == 8) {
            score_blocks_vec<T, S, 8>(q, summaries, blk_indptr, blk_indices, scores, num_seqs, nnz, num_qo_heads,
                                     num_kv_heads, head_dim, num_host_blocks, tile, h, scales);
            done = true;
        } else if (v == 16) {
            score_blocks_vec<T, S, 16>(q, summaries, blk_indptr, blk_indices, scores, num_seqs, nnz, num_qo_heads,
                                     num_kv_heads, head_dim, num_host_blocks, tile, h, scales);
            done = true;
        } else if (v == 32) {
            score_blocks_vec<T, S, 32>(q, summaries, blk_indptr, blk_indices, scores, num_seqs, nnz, num_qo_heads,
                                     num_kv_heads, head_dim, num_host_blocks, tile, h, scales);
            done = true;
        } else if (v == 64) {
            score_blocks_vec<T, S, 64>(q, summaries, blk_indptr, blk_indices, scores, num_seqs, nnz, num_qo_heads,
                                     num_kv_heads, head_dim, num_host_blocks, tile, h, scales);
            done = true;
        }
    }
    if (!done) {
        score_blocks_scalar<T, S>(q, summaries, blk_indptr, blk_indices, scores, num_seqs, nnz, num_qo_heads,
                                  num_kv_heads, head_dim, num_host_blocks, tile, h, scales);
    }
}

// grid (num_seqs, num_kv_heads), OASIS_TOPK_THREADS threads. For each (s, h): the k best logical
// blocks of s (0-based within s) by score, best first, ties to the lower index, -1 padding; with
// index_map, each through index_map[s, h, .] (CPU twin: oasis_core::kernels::topk_blocks_mapped).
// Radix select (up to 4 passes of 8 bits) finds the k-th largest key T; entries above T are taken
// in any order and entries equal to T in index order until k are taken (a pass whose chosen bin
// holds exactly the entries still to take ends the select early: every key in or above it is
// taken); a rank sort (bitonic past blockDim.x entries) orders them.
// A row of at most OASIS_MAX_TOPK entries is sorted whole instead (the same order).
__device__ void topk_blocks_impl(
    float* __restrict__ scores,         // [nnz, num_kv_heads]; written only with `forced`
    const int* __restrict__ blk_indptr, // [num_seqs + 1]; a malformed row has no blocks
    int* __restrict__ out,              // [num_seqs, num_kv_heads, k]
    const int* __restrict__ index_map,  // [num_seqs, num_kv_heads, map_m], or null
    const int* __restrict__ forced,     // [num_seqs, num_kv_heads, n_forced], or null
    int num_kv_heads, int nnz, int k, int map_m, int n_forced) {
    __shared__ int hist[256];
    __shared__ u64 sel[OASIS_MAX_TOPK];
    __shared__ u32 kcache[OASIS_TOPK_CACHE];
    __shared__ int scan_scratch[33];
    __shared__ u32 s_prefix;
    __shared__ int s_remaining;
    __shared__ int s_count;
    __shared__ int s_exact;

    const int s = blockIdx.x;
    const int h = blockIdx.y;
    int base;
    int end;
    csr_row(blk_indptr, s, nnz, &base, &end);
    const int n = end - base;
    // Entry i at col[i * num_kv_heads]. Reads go through the read-only path (the fill below comes
    // before this block's forced writes, and no other block writes this row and head); the
    // uncached rows read past those writes through L2 instead (__ldcg).
    const float* __restrict__ col = scores + (i64)base * num_kv_heads + h;
    const int take = min(n, k);
    // A short row (the two-stage score's candidates) is sorted whole: no radix passes.
    const bool whole = n <= OASIS_MAX_TOPK;
    const int sort_n = next_pow2(max(1, whole ? n : take));

    for (int i = threadIdx.x; i < sort_n; i += blockDim.x) sel[i] = ~0ull;
    const bool cached = n <= OASIS_TOPK_CACHE;
    if (cached) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) kcache[i] = score_key(__ldg(col + (i64)i * num_kv_heads));
    }
    if (forced != nullptr && n_forced > 0) {
        // force_scores_f32 folded in (the two-stage score's kept blocks): +inf in the scores, as
        // that kernel leaves them, and in the key cache, after its fill.
        __syncthreads();
        const int* fs = forced + ((i64)s * num_kv_heads + h) * n_forced;
        const float inf = __int_as_float(0x7f800000);
        for (int t = threadIdx.x; t < n_forced; t += blockDim.x) {
            const int f = fs[t];
            if (f >= 0 && f < n) {
                scores[(i64)(base + f) * num_kv_heads + h] = inf;
                if (cached) kcache[f] = score_key(inf);
            }
        }
    }
    __syncthreads();
    auto key_at = [&](int i) -> u32 { return cached ? kcache[i] : score_key(__ldcg(col + (i64)i * num_kv_heads)); };

    if (whole) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) sel[i] = rank_key(key_at(i), i);
    } else {
        u32 prefix = 0;
        u32 mask = 0;
        int remaining = k;  // how many of the entries matching prefix/mask are still to be taken
        // Set when the chosen bin holds exactly the entries still to be taken: then the k best are
        // the keys >= prefix (its lower bits 0), and the passes below it are skipped.
        bool exact = false;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const u32 key = key_at(i);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
            }
            __syncthreads();
            if (threadIdx.x < 32) {
                // The highest bin where the count from the top reaches `remaining`: lane l owns
                // bins [8l, 8l + 8); a suffix sum over the lanes finds the owning lane.
                const int lane = threadIdx.x;
                int cnt = 0;
#pragma unroll
                for (int b = 0; b < 8; ++b) cnt += hist[lane * 8 + b];
                int suffix = cnt;  // inclusive count of bins >= 8 * lane
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const int v = __shfl_down_sync(0xffffffffu, suffix, o);
                    if (lane + o < 32) suffix += v;
                }
                const int above_lane = suffix - cnt;  // bins above this lane's
                const bool owner =
                    (suffix >= remaining && above_lane < remaining) || (lane == 0 && suffix < remaining);
                if (owner) {
                    int above = above_lane;
                    int bin = lane * 8 + 7;
                    for (; bin > lane * 8; --bin) {
                        if (above + hist[bin] >= remaining) break;
                        above += hist[bin];
                    }
                    s_prefix = prefix | ((u32)bin << shift);
                    s_remaining = remaining - above;
                    s_exact = above + hist[bin] == remaining ? 1 : 0;
                }
            }
            __syncthreads();
            prefix = s_prefix;
            remaining = s_remaining;
            mask |= 255u << shift;
            exact = s_exact != 0;
            __syncthreads();
            if (exact) break;  // block-uniform
        }
        // Without `exact`, prefix is now the k-th largest key and `remaining` entries equal to it
        // are taken; with it, every key >= prefix is (exactly k of them).
        const u32 kth = prefix;
        const int n_above = exact ? k : k - remaining;
        if (threadIdx.x == 0) s_count = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const u32 key = key_at(i);
            if (key > kth || (exact && key == kth)) sel[atomicAdd(&s_count, 1)] = rank_key(key, i);
        }
        // Ties at the threshold: the lowest indices first (ordered compaction, chunk by chunk).
        int taken = 0;
        for (int c0 = 0; c0 < n && !exact && taken < remaining; c0 += blockDim.x) {
            const int i = c0 + threadIdx.x;
            const int flag = (i < n && key_at(i) == kth) ? 1 : 0;
            int total;
            const int pos = taken + block_exclusive_scan(flag, scan_scratch, &total);
            if (flag && pos < remaining) sel[n_above + pos] = rank_key(kth, i);
            taken += total;
        }
    }
    __syncthreads();
    // The entries are distinct (rank_key holds the index), the padding (~0) above all of them.
    const int filled = whole ? n : take;
    if (filled <= (int)blockDim.x) {
        block_rank_sort(sel, filled);
    } else {
        block_bitonic_sort(sel, sort_n);
    }
    int* dst = out + ((i64)s * num_kv_heads + h) * k;
    // With index_map, position i of this row stands for index_map[s, h, i] (the two-stage codes
    // score: candidates' logical blocks); past the map it is -1.
    const int* map = index_map != nullptr ? index_map + ((i64)s * num_kv_heads + h) * map_m : nullptr;
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        int v = i < take ? (int)(u32)(sel[i] & 0xffffffffull) : -1;
        if (map != nullptr && v >= 0) v = v < map_m ? map[v] : -1;
        dst[i] = v;
    }
}

// grid ceil(num_seqs * num_kv_heads * n_forced / blockDim.x): each thread one forced entry.
// CPU twin: oasis_core::kernels::force_scores (scores of the forced blocks set to +inf in place).
__device__ void force_scores_impl(
    float* __restrict__ scores,         // [nnz, num_kv_heads]
    const int* __restrict__ blk_indptr, // [num_seqs + 1]; a malformed row has no blocks
    const int* __restrict__ forced,     // [num_seqs, num_kv_heads, n_forced]; < 0 or past the row: none
    int num_seqs, int num_kv_heads, int nnz, int n_forced) {
    const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (n_forced <= 0 || t >= (i64)num_seqs * num_kv_heads * n_forced) return;
    const int row = (int)(t / n_forced);
    const int s = row / num_kv_heads;
    const int h = row - s * num_kv_heads;
    int base;
    int end;
    csr_row(blk_indptr, s, nnz, &base, &end);
    const int f = forced[t];
    if (f >= 0 && f < end - base) scores[(i64)(base + f) * num_kv_heads + h] = __int_as_float(0x7f800000);
}

}  // namespace oasis

// Entry points: one parameter struct each (cuda/oasis_params.cuh), unpacked into the impls.
#define OASIS_SCORE_BLOCKS(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(OASIS_SCORE_THREADS, OASIS_SCORE_MIN_BLOCKS)         \
        NAME(const __grid_constant__ oasis::ScoreBlocksParams<T> p) {                                \
        oasis::score_blocks_impl<T, T>(p.q, p.summaries, p.blk_indptr, p.blk_indices, p.scores,       \
                                       p.num_seqs, p.nnz, p.num_qo_heads, p.num_kv_heads, p.head_dim, \
                                       p.num_host_blocks, nullptr);                                   \
    }

OASIS_SCORE_BLOCKS(score_blocks_bf16, oasis::bf16)
OASIS_SCORE_BLOCKS(score_blocks_f16, oasis::f16)
OASIS_SCORE_BLOCKS(score_blocks_f32, float)

// The 8-bit bound (oasis_core::kernels::bound8): the same kernel over E4M3 bytes, times each row's scale.
#define OASIS_SCORE_BOUND8(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(OASIS_SCORE_THREADS, OASIS_SCORE_MIN_BLOCKS)         \
        NAME(const __grid_constant__ oasis::ScoreBlocksBound8Params<T> p) {                          \
        oasis::score_blocks_impl<T, oasis::fp8e4m3>(                                                  \
            p.q, (const oasis::fp8e4m3*)p.bounds8, p.blk_indptr, p.blk_indices, p.scores, p.num_seqs, \
            p.nnz, p.num_qo_heads, p.num_kv_heads, p.head_dim, p.num_host_blocks, p.scales);          \
    }

OASIS_SCORE_BOUND8(score_blocks_bound8_bf16, oasis::bf16)
OASIS_SCORE_BOUND8(score_blocks_bound8_f16, oasis::f16)
OASIS_SCORE_BOUND8(score_blocks_bound8_f32, float)

// The 8-bit bound on the tensor cores (score_bound8_tc): the same grid; head_dim 64 / 128 / 256
// and 16-byte aligned bounds (oasis_cuda checks both), else the FMA kernel above. Chosen by
// oasis_cuda's Bound8ScoreKernel. The warps' coefficients: D / 8 x 8 uint2 each in shared memory.
namespace oasis {
template <typename T>
__device__ void score_bound8_tc_entry(const ScoreBlocksBound8Params<T>& p) {
    __shared__ uint2 coef_all[(OASIS_SCORE_THREADS / 32) * (256 / 8) * 8];
    uint2* coef = coef_all + (threadIdx.x >> 5) * (p.head_dim / 8) * 8;
    const i64 num_tiles = ((i64)p.nnz + OASIS_SCORE_TILE - 1) / OASIS_SCORE_TILE;
#if OASIS_SCORE_HEAD_MAJOR
    const int h = (int)(blockIdx.x % (unsigned)p.num_kv_heads);
    const i64 tile_l = (i64)(blockIdx.x / (unsigned)p.num_kv_heads) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (tile_l >= num_tiles) return;  // warp-uniform
    const int tile = (int)tile_l;
#else
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= num_tiles * p.num_kv_heads) return;  // warp-uniform
    const int tile = (int)(w / p.num_kv_heads);
    const int h = (int)(w - (i64)tile * p.num_kv_heads);
#endif
    if (p.num_seqs <= 0) {  // no row at all: every entry scores -inf
        const int j = tile * OASIS_SCORE_TILE + (threadIdx.x & 31);
        if (j < p.nnz) p.scores[(i64)j * p.num_kv_heads + h] = neg_inf();
        return;
    }
#define OASIS_B8TC_ARGS                                                                                 \
    p.q, (const unsigned char*)p.bounds8, p.blk_indptr, p.blk_indices, p.scores, p.num_seqs, p.nnz,   \
        p.num_qo_heads, p.num_kv_heads, p.num_host_blocks, tile, h, p.scales, coef
    switch (p.head_dim) {  // the wrapper launches only these
        case 64: score_bound8_tc<T, 64>(OASIS_B8TC_ARGS); break;
        case 128: score_bound8_tc<T, 128>(OASIS_B8TC_ARGS); break;
        case 256: score_bound8_tc<T, 256>(OASIS_B8TC_ARGS); break;
        default: break;
    }
#undef OASIS_B8TC_ARGS
}
}  // namespace oasis

#define OASIS_SCORE_BOUND8_TC(NAME, T)                                                                \
    extern "C" __global__ void __launch_bounds__(OASIS_SCORE_THREADS, 2)                              \
        NAME(const __grid_constant__ oasis::ScoreBlocksBound8Params<T> p) {                          \
        oasis::score_bound8_tc_entry<T>(p);                                                           \
    }

OASIS_SCORE_BOUND8_TC(score_blocks_bound8_tc_bf16, oasis::bf16)
OASIS_SCORE_BOUND8_TC(score_blocks_bound8_tc_f16, oasis::f16)
OASIS_SCORE_BOUND8_TC(score_blocks_bound8_tc_f32, float)

extern "C" __global__ void __launch_bounds__(OASIS_TOPK_THREADS)
    topk_blocks_f32(const __grid_constant__ oasis::TopkBlocksParams p) {
    oasis::topk_blocks_impl(p.scores, p.blk_indptr, p.out, p.index_map, p.forced, p.num_kv_heads, p.nnz, p.k,
                            p.map_m, p.n_forced);
}

extern "C" __global__ void force_scores_f32(const __grid_constant__ oasis::ForceScoresParams p) {
    oasis::force_scores_impl(p.scores, p.blk_indptr, p.forced, p.num_seqs, p.num_kv_heads, p.nnz, p.n_forced);
}

extern "C" __global__ void __launch_bounds__(OASIS_TOPK_THREADS)
    topk_candidates_f32(const __grid_constant__ oasis::TopkCandidatesParams p) {
    // Entry i of (s, h) at scores[(s m + i) num_kv_heads + h].
    oasis::topk_candidates_impl(p.scores + ((oasis::i64)blockIdx.x * p.m * p.num_kv_heads + blockIdx.y),
                                p.num_kv_heads, p.cand, p.blk_indptr, p.forced, p.out, p.num_kv_heads, p.nnz, p.m,
                                p.k, p.successors, p.n_forced);
}
