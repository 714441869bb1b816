// key_codes.cu — 2-bit key codes of whole host blocks, and the block score they give: the largest
// approximate logit of each listed block, summed over the GQA group.
//
// CPU twins: oasis_core::kernels::build_key_codes and oasis_core::kernels::score_blocks_codes
// (crates/oasis-core/src/kernels/codes.rs, which defines the encoding and the layout).
//
// Layout: codes [num_host_blocks, num_kv_heads, block_size, head_dim / 4] bytes; channel 4i + j of
// a token is bits 2j .. 2j + 2 of byte i; c = round(3 (k - min) / (max - min)) clamped to 0..=3
// (0 for an empty range or a NaN), k ~ min + c (max - min) / 3.
//
// As in score_blocks.cu, blk_indptr is checked row by row in the kernel (the CPU twin rejects a
// malformed table): an entry whose row is malformed (start < 0, end < start, end > nnz) or that
// lies in no row scores -inf, and so does an out-of-range block id. Nothing is read outside
// blk_indices, q, the summaries or the codes. Out-of-range ids of build_key_codes are skipped.
#include "oasis_common.cuh"
#include "oasis_params.cuh"

// Threads per block of build_key_codes_* (one thread per code byte of a (block, head)). Arbitrary.
#define OASIS_CODES_BUILD_THREADS 128
// Threads per block of score_blocks_codes_*; oasis_cuda::ops::SCORE_CODES_THREADS must match.
#define OASIS_CODES_THREADS 128
// Consecutive entries of blk_indices one warp scores for one KV head (one block id per lane).
// oasis_cuda::ops::SCORE_CODES_TILE must match.
#define OASIS_CODES_TILE 32
// NOTE: performance hazard. score_blocks_codes_* below is the exact path only (each logit the CPU
// twin's bit for bit): one warp per entry, serial f32 sums per (g, t), half the lanes idle at
// block_size 16. It is far from the issue-12 target (score + top-K <= 1.5 x score_blocks at 32K,
// batch 64). That target is bandwidth-bound from below: the codes score reads the summaries AND
// the codes (2 x the bytes), and at Qwen3-8B shapes it also needs 16 x 128 x group FMAs per
// (block, head) (8192 for group 4: ~245 us of f32 FMA issue for 1M block-heads on an H200 at
// 100 % of peak), so the fast path must be a tensor-core one: per (block, head) one
// mma.m16n8k16 per 16 channels, A = the 16 tokens' keys decoded from the codes, B = the group's
// query (static per sequence, in registers), C = 16 tokens x up to 8 query heads; see the report
// of the commit that added this file.

namespace oasis {

// The code of x in [lo, hi], exactly as oasis_core::kernels::codes::encode: IEEE f32 operations
// (the _rn intrinsics keep NVRTC from contracting or approximating them), round half away from
// zero, clamped to 0..=3, 0 when the range is empty or the value NaN.
__device__ __forceinline__ u32 encode_code(float x, float lo, float hi) {
    const float w = __fsub_rn(hi, lo);
    if (!(w > 0.f)) return 0u;
    const float v = roundf(__fmul_rn(__fdiv_rn(__fsub_rn(x, lo), w), 3.f));
    if (!(v > 0.f)) return 0u;  // negative, zero or NaN
    return v >= 3.f ? 3u : (u32)v;
}

// grid (n, num_kv_heads); thread e of the block writes code bytes e, e + blockDim.x, ... of the
// (block, head) entry: byte e is channels 4i .. 4i + 3 of token e / (head_dim / 4), read as four
// consecutive keys (a warp reads consecutive bytes of host_k: coalesced over UVA too).
template <typename T>
__device__ void build_key_codes_impl(
    const T* __restrict__ host_k,        // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned host (UVA) or device
    const T* __restrict__ summaries,     // [num_host_blocks, num_kv_heads, 2, head_dim]
    const int* __restrict__ block_ids,   // [n]
    unsigned char* __restrict__ codes,   // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    int num_kv_heads, int head_dim, int block_size, int num_host_blocks) {
    const int blk = block_ids[blockIdx.x];
    const int h = blockIdx.y;
    if (blk < 0 || blk >= num_host_blocks) return;
    const i64 entry = (i64)blk * num_kv_heads + h;
    const int row = head_dim >> 2;  // bytes per token
    const T* keys = host_k + entry * block_size * head_dim;
    const T* mn = summaries + entry * 2 * head_dim;
    const T* mx = mn + head_dim;
    unsigned char* out = codes + entry * block_size * row;
    const int total = block_size * row;
    for (int e = threadIdx.x; e < total; e += blockDim.x) {
        const int t = e / row;
        const int i = e - t * row;
        const T* k = keys + (i64)t * head_dim + 4 * i;
        u32 v = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int x = 4 * i + j;
            v |= encode_code(to_f32(k[j]), to_f32(mn[x]), to_f32(mx[x])) << (2 * j);
        }
        out[e] = (unsigned char)v;
    }
}

// Largest s with blk_indptr[s] <= j (as score_blocks.cu's score_seq_of): then j < blk_indptr[s + 1]
// when the row is well formed (empty sequences are skipped).
__device__ __forceinline__ int score_codes_seq_of(const int* __restrict__ blk_indptr, int num_seqs, int j) {
    int lo = 0;
    int hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (blk_indptr[mid] <= j) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// max that propagates NaN, as the CPU twin's running maximum: a block whose estimate is NaN ranks
// last in top-K.
__device__ __forceinline__ float nan_max(float a, float b) {
    return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

__device__ __forceinline__ float warp_nan_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Shared memory of one warp of the scalar path, in floats: q of the current sequence and the
// weights w[g][d] = q[g][d] (max[d] - min[d]) / 3 of the current block (group * head_dim each),
// the block's min row (head_dim) and the base q[g] . min (group).
__host__ __device__ __forceinline__ int codes_scalar_warp_floats(int group, int head_dim) {
    return 2 * group * head_dim + head_dim + group;
}

// Scalar path (any head_dim divisible by 4, any block size and group), the same f32 operations
// in the same order as the CPU twin for each (g, t), so each logit is the twin's bit for bit:
// the warp stages q (per sequence) and w, min (per block) in shared memory; lane g computes the
// base of query head g in d order; lane t walks token t's codes for every g; NaN-propagating max
// over the tokens, then the sum over g in order.
template <typename T>
__device__ void score_codes_scalar_entry(
    float* __restrict__ sm, const T* __restrict__ summaries, const unsigned char* __restrict__ codes, float* __restrict__ out,
    int b, int h, int group, int num_kv_heads, int head_dim, int block_size) {
    const int lane = threadIdx.x & 31;
    const int gd = group * head_dim;
    float* sq = sm;
    float* sw = sm + gd;
    float* slo = sm + 2 * gd;
    float* sbase = slo + head_dim;
    const i64 entry = (i64)b * num_kv_heads + h;
    const T* mn = summaries + entry * 2 * head_dim;
    const T* mx = mn + head_dim;
    for (int d = lane; d < head_dim; d += 32) {
        const float lo = to_f32(mn[d]);
        const float r = __fsub_rn(to_f32(mx[d]), lo);
        slo[d] = lo;
        for (int g = 0; g < group; ++g) sw[g * head_dim + d] = __fdiv_rn(__fmul_rn(sq[g * head_dim + d], r), 3.f);
    }
    __syncwarp();
    for (int g = lane; g < group; g += 32) {
        float base = 0.f;
        for (int d = 0; d < head_dim; ++d) base = __fadd_rn(base, __fmul_rn(sq[g * head_dim + d], slo[d]));
        sbase[g] = base;
    }
    __syncwarp();
    const int row = head_dim >> 2;
    const unsigned char* blk = codes + entry * block_size * row;
    float acc = 0.f;
    for (int g = 0; g < group; ++g) {
        const float* w = sw + g * head_dim;
        float best = neg_inf();
        for (int t = lane; t < block_size; t += 32) {
            const unsigned char* c = blk + (i64)t * row;
            float logit = sbase[g];
            for (int i = 0; i < row; ++i) {
                const u32 byte = c[i];
#pragma unroll
                for (int j = 0; j < 4; ++j) logit = __fadd_rn(logit, __fmul_rn(w[4 * i + j], (float)((byte >> (2 * j)) & 3u)));
            }
            best = nan_max(best, logit);
        }
        acc = __fadd_rn(acc, warp_nan_max(best));  // warp-uniform after the reduction
    }
    if (lane == 0) *out = acc;
    __syncwarp();  // sw / sbase are rewritten by the next entry
}

// The query of sequence s for KV head h, as f32, into the warp's shared memory (scalar path).
template <typename T>
__device__ __forceinline__ void codes_load_q_scalar(float* __restrict__ sq, const T* __restrict__ q, int s, int h, int group,
                                                    int num_qo_heads, int head_dim) {
    const int lane = threadIdx.x & 31;
    const T* qs = q + ((i64)s * num_qo_heads + (i64)h * group) * head_dim;
    __syncwarp();
    for (int x = lane; x < group * head_dim; x += 32) sq[x] = to_f32(qs[x]);
    __syncwarp();
}

// grid: thread block c scores OASIS_CODES_THREADS / 32 consecutive tiles of OASIS_CODES_TILE
// entries for head c % num_kv_heads (as score_blocks_* with OASIS_SCORE_HEAD_MAJOR); dynamic
// shared memory: codes_scalar_warp_floats(group, head_dim) floats per warp.
// Entry (j, h) = sum over query heads g of KV head h of max over tokens t of
//   sum_d q[s,g,d] (min[b,h,d] + c[b,h,t,d] (max[b,h,d] - min[b,h,d]) / 3)
// with b = blk_indices[j] and s the sequence whose CSR range holds j. An out-of-range block id,
// and an entry outside every well-formed row, scores -inf (never selected).
template <typename T>
__device__ void score_blocks_codes_impl(
    const T* __restrict__ q,                 // [num_seqs, num_qo_heads, head_dim] (the lookahead row)
    const T* __restrict__ summaries,         // [num_host_blocks, num_kv_heads, 2, head_dim]
    const unsigned char* __restrict__ codes, // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    const int* __restrict__ blk_indptr,      // [num_seqs + 1]
    const int* __restrict__ blk_indices,     // [nnz] host block of each logical block, logical order
    float* __restrict__ scores,              // [nnz, num_kv_heads]
    int num_seqs, int nnz, int num_qo_heads, int num_kv_heads, int head_dim, int block_size, int num_host_blocks) {
    extern __shared__ float codes_smem[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const i64 num_tiles = ((i64)nnz + OASIS_CODES_TILE - 1) / OASIS_CODES_TILE;
    const int h = (int)(blockIdx.x % (unsigned)num_kv_heads);
    const i64 tile_l = (i64)(blockIdx.x / (unsigned)num_kv_heads) * (blockDim.x >> 5) + warp;
    if (tile_l >= num_tiles) return;  // warp-uniform
    const int t0 = (int)tile_l * OASIS_CODES_TILE;
    const int t1 = min(nnz, t0 + OASIS_CODES_TILE);
    if (num_seqs <= 0) {  // no row at all (blk_indptr = [x]): every entry scores -inf
        if (t0 + lane < t1) scores[(i64)(t0 + lane) * num_kv_heads + h] = neg_inf();
        return;
    }
    const int group = num_qo_heads / num_kv_heads;
    float* sm = codes_smem + (i64)warp * codes_scalar_warp_floats(group, head_dim);
    // One block id per lane for the whole tile, handed out with shuffles.
    const int tile_idx = t0 + lane < t1 ? blk_indices[t0 + lane] : -1;
    int s = score_codes_seq_of(blk_indptr, num_seqs, t0);
    int loaded = -1;  // sequence whose query the warp holds
    for (int j = t0; j < t1; ++j) {
        while (s + 1 < num_seqs && blk_indptr[s + 1] <= j) ++s;
        const int row_b = blk_indptr[s];
        const int row_e = blk_indptr[s + 1];
        const bool row_ok = 0 <= row_b && row_b <= j && j < row_e && row_e <= nnz;
        const int b = __shfl_sync(0xffffffffu, tile_idx, j - t0);
        float* out = scores + (i64)j * num_kv_heads + h;
        if (!row_ok || b < 0 || b >= num_host_blocks) {
            if (lane == 0) *out = neg_inf();
            continue;
        }
        if (s != loaded) {
            codes_load_q_scalar<T>(sm, q, s, h, group, num_qo_heads, head_dim);
            loaded = s;
        }
        score_codes_scalar_entry<T>(sm, summaries, codes, out, b, h, group, num_kv_heads, head_dim, block_size);
    }
}

}  // namespace oasis

// Entry points: one parameter struct each (cuda/oasis_params.cuh), unpacked into the impls.
#define OASIS_BUILD_KEY_CODES(NAME, T)                                                               \
    extern "C" __global__ void __launch_bounds__(OASIS_CODES_BUILD_THREADS)                          \
        NAME(const __grid_constant__ oasis::BuildKeyCodesParams<T> p) {                              \
        oasis::build_key_codes_impl<T>(p.host_k, p.summaries, p.block_ids, p.codes, p.num_kv_heads,  \
                                       p.head_dim, p.block_size, p.num_host_blocks);                 \
    }

OASIS_BUILD_KEY_CODES(build_key_codes_bf16, oasis::bf16)
OASIS_BUILD_KEY_CODES(build_key_codes_f16, oasis::f16)
OASIS_BUILD_KEY_CODES(build_key_codes_f32, float)

#define OASIS_SCORE_BLOCKS_CODES(NAME, T)                                                            \
    extern "C" __global__ void __launch_bounds__(OASIS_CODES_THREADS)                                \
        NAME(const __grid_constant__ oasis::ScoreBlocksCodesParams<T> p) {                           \
        oasis::score_blocks_codes_impl<T>(p.q, p.summaries, p.codes, p.blk_indptr, p.blk_indices,    \
                                          p.scores, p.num_seqs, p.nnz, p.num_qo_heads,               \
                                          p.num_kv_heads, p.head_dim, p.block_size,                  \
                                          p.num_host_blocks);                                        \
    }

OASIS_SCORE_BLOCKS_CODES(score_blocks_codes_bf16, oasis::bf16)
OASIS_SCORE_BLOCKS_CODES(score_blocks_codes_f16, oasis::f16)
OASIS_SCORE_BLOCKS_CODES(score_blocks_codes_f32, float)
