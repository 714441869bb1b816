// key_codes.cu — 2-bit key codes of whole host blocks, and the block score they give: the largest
// approximate logit of each listed block, summed over the GQA group.
//
// CPU twins: oasis_core::kernels::build_key_codes, encode_blocks (the 8-bit bound, then the codes
// inside it, in one launch) and score_blocks_codes (crates/oasis-core/src/kernels/codes.rs, which
// defines the encoding and the layout; crates/oasis-core/src/kernels/bound8.rs the bound).
//
// Layout: codes [num_host_blocks, num_kv_heads, block_size, head_dim / 4] bytes; channel 4i + j of
// a token is bits 2j .. 2j + 2 of byte i; c = round(3 (k - lo) / (hi - lo)) clamped to 0..=3 (0 for
// an empty or NaN range or a NaN key), k ~ lo + c (hi - lo) / 3, where [lo, hi] is the block's
// decoded 8-bit bound: lo = e4m3_decode(bounds8[b, h, 0, d]) * scales[b, h], hi likewise from row
// 1 (exact in f32). The scores read the bound and the codes, never the summaries: 2 head_dim +
// block_size head_dim / 4 bytes (and a 4-byte scale) per (block, head). A NaN scale (a block whose
// keys are not all finite) gives codes 0 and a NaN score, which ranks last in top-K.
//
// As in score_blocks.cu, blk_indptr is checked row by row in the kernel (the CPU twin rejects a
// malformed table): an entry whose row is malformed (start < 0, end < start, end > nnz) or that
// lies in no row scores -inf, and so does an out-of-range block id. Nothing is read outside
// blk_indices, q, the bounds, the scales or the codes. Out-of-range ids (or rows) of
// build_key_codes are skipped. build_key_codes reads host_k by host row (block_rows; null: the id)
// and the bounds and codes by block id.
#include "oasis_common.cuh"
#include "oasis_params.cuh"
#include "oasis_topk.cuh"

// Threads per block of build_key_codes_* (one thread per code byte of a (block, head)). Arbitrary.
#define OASIS_CODES_BUILD_THREADS 128
// Threads per block of score_blocks_codes_*; oasis_cuda::ops::SCORE_CODES_THREADS must match.
#define OASIS_CODES_THREADS 128
// Consecutive entries of blk_indices one warp scores for one KV head (one block id per lane).
// oasis_cuda::ops::SCORE_CODES_TILE must match.
#ifndef OASIS_CODES_TILE
#define OASIS_CODES_TILE 32
#endif
// NOTE: performance. score_blocks_codes_* has two paths: the tensor-core one (oasis_codes_tc.cuh;
// block_size 16, head_dim 64 or 128, group <= 8, 16-byte aligned buffers: the engine's shapes; one
// mma.m16n8k16 per 16 channels, the codes as A and the f16 code weights as B) and an exact scalar
// one for anything else (each logit the CPU twin's bit for bit: one warp per entry, serial f32
// sums per (g, t)). Timings against the Quest score: docs/PERF.md, "2-bit key codes".

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

// The decoded 8-bit bound of one (block, head) row (`b8`: its 2 head_dim E4M3 bytes, `s` its scale)
// into `lo`, `hi` (head_dim floats each, shared memory), as oasis_core::kernels::bound8::
// decode_bound8: e4m3_decode(byte) * s, exact in f32 (NaN throughout for a NaN scale). The caller
// synchronises the block before reading them.
__device__ __forceinline__ void codes_load_bound(const unsigned char* __restrict__ b8, float s, float* __restrict__ lo,
                                                 float* __restrict__ hi, int head_dim) {
    for (int x = threadIdx.x; x < head_dim; x += blockDim.x) {
        lo[x] = __fmul_rn(e4m3_decode(b8[x]), s);
        hi[x] = __fmul_rn(e4m3_decode(b8[head_dim + x]), s);
    }
}

// The codes of one (block, head) entry from its keys (`keys`, block_size x head_dim) inside the
// decoded bound `lo`, `hi` (shared memory): thread e of the block writes code bytes e, e +
// blockDim.x, ...; byte e is channels 4i .. 4i + 3 of token e / (head_dim / 4), read as four
// consecutive keys (a warp reads consecutive bytes of host_k: coalesced over UVA too).
template <typename T>
__device__ void codes_encode_entry(const T* __restrict__ keys, const float* __restrict__ lo, const float* __restrict__ hi,
                                   unsigned char* __restrict__ out, int head_dim, int block_size) {
    const int row = head_dim >> 2;  // bytes per token
    const int total = block_size * row;
    for (int e = threadIdx.x; e < total; e += blockDim.x) {
        const int t = e / row;
        const int i = e - t * row;
        const T* k = keys + (i64)t * head_dim + 4 * i;
        u32 v = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int x = 4 * i + j;
            v |= encode_code(to_f32(k[j]), lo[x], hi[x]) << (2 * j);
        }
        out[e] = (unsigned char)v;
    }
}

// grid (n, num_kv_heads): the codes of one (block, head) entry inside its 8-bit bound, which
// build_bounds8 wrote before (queue it first on the same stream). Dynamic shared memory
// (oasis_cuda::ops::codes_build_smem_bytes): the decoded bound, 2 head_dim floats.
template <typename T>
__device__ void build_key_codes_impl(
    const T* __restrict__ host_k,              // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host (UVA) or device
    const unsigned char* __restrict__ bounds8, // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3
    const float* __restrict__ scales,          // [num_host_blocks, num_kv_heads]
    const int* __restrict__ block_ids,         // [n]
    const int* __restrict__ block_rows,        // [n] host row of each block; null: the id
    unsigned char* __restrict__ codes,         // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    int num_kv_heads, int head_dim, int block_size, int num_host_blocks, int num_host_rows) {
    extern __shared__ __align__(16) float codes_smem[];
    const int blk = block_ids[blockIdx.x];
    const int hrow = block_rows != nullptr ? block_rows[blockIdx.x] : blk;
    const int h = blockIdx.y;
    if (blk < 0 || blk >= num_host_blocks || hrow < 0 || hrow >= num_host_rows) return;  // block-uniform
    const i64 entry = (i64)blk * num_kv_heads + h;
    float* lo = codes_smem;
    float* hi = codes_smem + head_dim;
    codes_load_bound(bounds8 + entry * 2 * head_dim, scales[entry], lo, hi, head_dim);
    __syncthreads();
    const T* keys = host_k + ((i64)hrow * num_kv_heads + h) * block_size * head_dim;
    codes_encode_entry<T>(keys, lo, hi, codes + entry * block_size * (head_dim >> 2), head_dim, block_size);
}

// ---- the 8-bit Quest bound (oasis_core::kernels::bound8 defines it and is the CPU twin)

// floor(log2(a)) of a positive normal f32.
__device__ __forceinline__ int f32_ilogb(float a) { return (int)((__float_as_uint(a) >> 23) & 0xffu) - 127; }

// The largest E4M3 magnitude <= a (0 <= a <= 448), as bits.
__device__ __forceinline__ u32 e4m3_mag_down(float a) {
    if (a < 0.015625f) return (u32)floorf(__fmul_rn(a, 512.f));  // subnormal: m 2^-9
    const int e = f32_ilogb(a);
    const int m = (int)floorf(__fmul_rn(a, exp2i(3 - e))) - 8;
    return (u32)(((e + 7) << 3) | m);
}

// The smallest E4M3 magnitude >= a (0 <= a <= 448), as bits.
__device__ __forceinline__ u32 e4m3_mag_up(float a) {
    const u32 d = e4m3_mag_down(a);
    return e4m3_decode(d) == a ? d : d + 1u;
}

// Outward rounding onto the E4M3 grid (|y| <= 448): the largest value <= y, the smallest >= y.
__device__ __forceinline__ u32 e4m3_down(float y) { return y >= 0.f ? e4m3_mag_down(y) : 0x80u | e4m3_mag_up(-y); }
__device__ __forceinline__ u32 e4m3_up(float y) { return y >= 0.f ? e4m3_mag_up(y) : 0x80u | e4m3_mag_down(-y); }

// The exponent of a row's scale 2^e: the smallest e >= OASIS_BOUND8_MIN_EXP with maxabs / 2^e <= 448.
#define OASIS_BOUND8_MIN_EXP (-120)
__device__ __forceinline__ int bound8_exponent(float maxabs) {
    if (!(maxabs >= 1.17549435e-38f)) return OASIS_BOUND8_MIN_EXP;  // zero (or subnormal)
    const int e = f32_ilogb(maxabs) - 8;
    if (e < OASIS_BOUND8_MIN_EXP) return OASIS_BOUND8_MIN_EXP;
    return __fmul_rn(maxabs, exp2i(-e)) > 448.f ? e + 1 : e;
}

// grid (n, num_kv_heads), blockDim.x a multiple of 32 (<= 1024): the bytes and scale of one (block,
// head) row. Out-of-range ids are skipped. With `lo`, `hi` (shared memory, head_dim floats each;
// encode_blocks_*) the row is also left there decoded (codes_load_bound's values, NaN for a NaN
// scale) for the codes; the caller synchronises the block before reading them.
template <typename T>
__device__ void build_bounds8_impl(
    const T* __restrict__ summaries,   // [num_host_blocks, num_kv_heads, 2, head_dim]
    const int* __restrict__ block_ids, // [n]
    unsigned char* __restrict__ bounds8, // [num_host_blocks, num_kv_heads, 2, head_dim]
    float* __restrict__ scales,        // [num_host_blocks, num_kv_heads]
    int num_kv_heads, int head_dim, int num_host_blocks, float* __restrict__ lo = nullptr,
    float* __restrict__ hi = nullptr) {
    __shared__ float s_max[32];
    __shared__ int s_bad[32];
    const int blk = block_ids[blockIdx.x];
    const int h = blockIdx.y;
    if (blk < 0 || blk >= num_host_blocks) return;  // block-uniform
    const i64 entry = (i64)blk * num_kv_heads + h;
    const T* row = summaries + entry * 2 * head_dim;
    float mx = 0.f;
    int bad = 0;
    for (int i = threadIdx.x; i < 2 * head_dim; i += blockDim.x) {
        const float x = to_f32(row[i]);
        if ((__float_as_uint(x) & 0x7f800000u) == 0x7f800000u) bad = 1;  // inf or NaN
        else mx = fmaxf(mx, fabsf(x));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    bad = __any_sync(0xffffffffu, bad);
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    if ((threadIdx.x & 31) == 0) {
        s_max[warp] = mx;
        s_bad[warp] = bad;
    }
    __syncthreads();
    mx = 0.f;
    bad = 0;
    for (int w = 0; w < warps; ++w) {
        mx = fmaxf(mx, s_max[w]);
        bad |= s_bad[w];
    }
    unsigned char* out = bounds8 + entry * 2 * head_dim;
    if (bad) {
        for (int i = threadIdx.x; i < 2 * head_dim; i += blockDim.x) {
            out[i] = 0;
            if (lo != nullptr) (i < head_dim ? lo[i] : hi[i - head_dim]) = __int_as_float(0x7fc00000);
        }
        if (threadIdx.x == 0) scales[entry] = __int_as_float(0x7fc00000);
        return;
    }
    const int e = bound8_exponent(mx);
    const float inv = exp2i(-e);
    const float s = exp2i(e);
    for (int i = threadIdx.x; i < 2 * head_dim; i += blockDim.x) {
        const float y = __fmul_rn(to_f32(row[i]), inv);
        const u32 c = i < head_dim ? e4m3_down(y) : e4m3_up(y);
        out[i] = (unsigned char)c;
        if (lo != nullptr) (i < head_dim ? lo[i] : hi[i - head_dim]) = __fmul_rn(e4m3_decode(c), s);
    }
    if (threadIdx.x == 0) scales[entry] = s;
}

// encode_blocks_*: build_bounds8_impl, then the codes of the same (block, head) inside the bound
// it just wrote, read back decoded from shared memory (not from bounds8: no reader of global memory
// this launch writes). An out-of-range id writes nothing; an out-of-range row writes the bound but
// not the codes (as the two kernels would). Dynamic shared memory: codes_build_smem_bytes.
template <typename T>
__device__ void encode_blocks_impl(
    const T* __restrict__ host_k,        // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host (UVA) or device
    const T* __restrict__ summaries,     // [num_host_blocks, num_kv_heads, 2, head_dim]
    const int* __restrict__ block_ids,   // [n]
    const int* __restrict__ block_rows,  // [n] host row of each block; null: the id
    unsigned char* __restrict__ codes,   // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    unsigned char* __restrict__ bounds8, // [num_host_blocks, num_kv_heads, 2, head_dim]
    float* __restrict__ scales,          // [num_host_blocks, num_kv_heads]
    int num_kv_heads, int head_dim, int block_size, int num_host_blocks, int num_host_rows) {
    extern __shared__ __align__(16) float codes_smem[];
    const int blk = block_ids[blockIdx.x];
    const int hrow = block_rows != nullptr ? block_rows[blockIdx.x] : blk;
    const int h = blockIdx.y;
    if (blk < 0 || blk >= num_host_blocks) return;  // block-uniform
    float* lo = codes_smem;
    float* hi = codes_smem + head_dim;
    build_bounds8_impl<T>(summaries, block_ids, bounds8, scales, num_kv_heads, head_dim, num_host_blocks, lo, hi);
    if (hrow < 0 || hrow >= num_host_rows) return;  // block-uniform
    __syncthreads();
    const i64 entry = (i64)blk * num_kv_heads + h;
    const T* keys = host_k + ((i64)hrow * num_kv_heads + h) * block_size * head_dim;
    codes_encode_entry<T>(keys, lo, hi, codes + entry * block_size * (head_dim >> 2), head_dim, block_size);
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
// weights w[g][d] (code_weight) of the current block (group * head_dim each), the block's min
// row (head_dim) and the base q[g] . min (group).
__host__ __device__ __forceinline__ int codes_scalar_warp_floats(int group, int head_dim) {
    return 2 * group * head_dim + head_dim + group;
}

// x rounded to f16 (nearest even, subnormals kept; +-inf past f16's range), as an f32.
__device__ __forceinline__ float codes_round_f16(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
    float r;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(r) : "h"(h));
    return r;
}

// The weight of a code, exactly as oasis_core::kernels::codes::code_weight:
// f16(f16(q / 3) x f16(hi - lo)) (the product of two f16 is exact in f32).
__device__ __forceinline__ float codes_weight(float q, float lo, float hi) {
    const float q3 = codes_round_f16(__fdiv_rn(q, 3.f));
    const float r = codes_round_f16(__fsub_rn(hi, lo));
    return codes_round_f16(__fmul_rn(q3, r));
}

// Scalar path (any head_dim divisible by 4, any block size and group, and any block whose weights
// do not all fit f16), the same f32 operations in the same order as the CPU twin for each (g, t),
// so each logit is the twin's bit for bit: the warp stages q (per sequence) and w, lo (per block:
// the decoded bound) in shared memory; lane g computes the base of query head g in d order; lane t
// walks token t's codes for every g; NaN-propagating max over the tokens, then the sum over g in
// order.
__device__ void score_codes_scalar_entry(
    float* __restrict__ sm, const unsigned char* __restrict__ bounds8, const float* __restrict__ scales,
    const unsigned char* __restrict__ codes, float* __restrict__ out, int b, int h, int group, int num_kv_heads,
    int head_dim, int block_size) {
    const int lane = threadIdx.x & 31;
    const int gd = group * head_dim;
    float* sq = sm;
    float* sw = sm + gd;
    float* slo = sm + 2 * gd;
    float* sbase = slo + head_dim;
    const i64 entry = (i64)b * num_kv_heads + h;
    const unsigned char* b8 = bounds8 + entry * 2 * head_dim;
    const float s = scales[entry];
    for (int d = lane; d < head_dim; d += 32) {
        const float lo = __fmul_rn(e4m3_decode(b8[d]), s);
        const float hi = __fmul_rn(e4m3_decode(b8[head_dim + d]), s);
        slo[d] = lo;
        for (int g = 0; g < group; ++g) sw[g * head_dim + d] = codes_weight(sq[g * head_dim + d], lo, hi);
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

}  // namespace oasis

// The tensor-core path, score_codes_tile and the score impls (score_blocks_codes_impl,
// rescore_topk_codes_impl): after the helpers above that they use.
#include "oasis_codes_tc.cuh"

// Entry points: one parameter struct each (cuda/oasis_params.cuh), unpacked into the impls.
#define OASIS_BUILD_KEY_CODES(NAME, T)                                                               \
    extern "C" __global__ void __launch_bounds__(OASIS_CODES_BUILD_THREADS)                          \
        NAME(const __grid_constant__ oasis::BuildKeyCodesParams<T> p) {                              \
        oasis::build_key_codes_impl<T>(p.host_k, p.bounds8, p.scales, p.block_ids, p.block_rows,     \
                                       p.codes, p.num_kv_heads, p.head_dim, p.block_size,            \
                                       p.num_host_blocks, p.num_host_rows);                          \
    }

#define OASIS_BUILD_BOUNDS8(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(OASIS_CODES_BUILD_THREADS)                           \
        NAME(const __grid_constant__ oasis::BuildBounds8Params<T> p) {                                 \
        oasis::build_bounds8_impl<T>(p.summaries, p.block_ids, p.bounds8, p.scales, p.num_kv_heads,    \
                                     p.head_dim, p.num_host_blocks);                                   \
    }

OASIS_BUILD_BOUNDS8(build_bounds8_bf16, oasis::bf16)
OASIS_BUILD_BOUNDS8(build_bounds8_f16, oasis::f16)
OASIS_BUILD_BOUNDS8(build_bounds8_f32, float)

OASIS_BUILD_KEY_CODES(build_key_codes_bf16, oasis::bf16)
OASIS_BUILD_KEY_CODES(build_key_codes_f16, oasis::f16)
OASIS_BUILD_KEY_CODES(build_key_codes_f32, float)

// encode_blocks_*: build_bounds8 and build_key_codes of the same blocks in one launch (the
// engine's per-step encode of the blocks a step completed: one launch per layer, not two). Each
// (block, head) thread block writes the bound (skipped for an out-of-range id) and then the codes
// inside it (skipped for an out-of-range id or row), exactly what the two kernels write. CPU twin:
// oasis_core::kernels::encode_blocks.
#define OASIS_ENCODE_BLOCKS(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(OASIS_CODES_BUILD_THREADS)                           \
        NAME(const __grid_constant__ oasis::EncodeBlocksParams<T> p) {                                \
        oasis::encode_blocks_impl<T>(p.host_k, p.summaries, p.block_ids, p.block_rows, p.codes,       \
                                     p.bounds8, p.scales, p.num_kv_heads, p.head_dim, p.block_size,   \
                                     p.num_host_blocks, p.num_host_rows);                             \
    }

OASIS_ENCODE_BLOCKS(encode_blocks_bf16, oasis::bf16)
OASIS_ENCODE_BLOCKS(encode_blocks_f16, oasis::f16)
OASIS_ENCODE_BLOCKS(encode_blocks_f32, float)

#define OASIS_SCORE_BLOCKS_CODES(NAME, T)                                                            \
    extern "C" __global__ void __launch_bounds__(OASIS_CODES_THREADS, OASIS_CODES_MIN_BLOCKS)        \
        NAME(const __grid_constant__ oasis::ScoreBlocksCodesParams<T> p) {                           \
        oasis::score_blocks_codes_impl<T>(p.q, p.bounds8, p.scales, p.codes, p.blk_indptr,           \
                                          p.blk_indices,                                             \
                                          p.scores, p.cand, p.num_seqs, p.nnz, p.num_qo_heads,       \
                                          p.num_kv_heads, p.head_dim, p.block_size,                  \
                                          p.num_host_blocks, p.cand_m, p.tile);                      \
    }

OASIS_SCORE_BLOCKS_CODES(score_blocks_codes_bf16, oasis::bf16)
OASIS_SCORE_BLOCKS_CODES(score_blocks_codes_f16, oasis::f16)
OASIS_SCORE_BLOCKS_CODES(score_blocks_codes_f32, float)

#define OASIS_RESCORE_TOPK_CODES(NAME, T)                                                             \
    extern "C" __global__ void __launch_bounds__(OASIS_RESCORE_TOPK_THREADS, OASIS_CODES_MIN_BLOCKS)  \
        NAME(const __grid_constant__ oasis::RescoreTopkCodesParams<T> p) {                            \
        oasis::rescore_topk_codes_impl<T>(p.q, p.bounds8, p.scales, p.codes, p.blk_indptr,            \
                                          p.blk_indices,                                              \
                                          p.cand, p.forced, p.out, p.scratch, p.counters, p.nnz,      \
                                          p.num_qo_heads, p.num_kv_heads, p.head_dim, p.block_size,   \
                                          p.num_host_blocks, p.m, p.k, p.successors, p.n_forced,      \
                                          p.tile);                                                    \
    }

OASIS_RESCORE_TOPK_CODES(rescore_topk_codes_bf16, oasis::bf16)
OASIS_RESCORE_TOPK_CODES(rescore_topk_codes_f16, oasis::f16)
OASIS_RESCORE_TOPK_CODES(rescore_topk_codes_f32, float)
