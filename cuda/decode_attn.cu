// decode_attn.cu — decode attention for stacked query rows over a paged (and optionally
// head-wise mapped) KV pool, split-KV ("flash-decoding") with a merge kernel.
//
// CPU twin: oasis_core::kernels::decode_attention.
//
// One thread block per (sequence, KV head, split). It serves every query vector that reads this
// KV head: the num_rows stacked rows times the GQA group, so each K/V tile is read from HBM once
// for all of them. Tiles of up to `tile_tokens` tokens (filled across page entries) are staged in
// shared memory as f32; scores are computed per (query, token) pair, then one warp per query
// updates an online softmax (running max m, running sum l, unnormalised accumulator).
//
// Row 0 is the current token; rows >= 1 are lookahead rows that also attend to the extra K/V
// (the lookahead token's own key and value), handled as a one-token tile in the last split.
// A (page, head) entry whose page_map value is negative is skipped, and so is a page id outside
// the pool. A malformed kv_indptr row (start < 0, end < start or end > nnz, the length of
// kv_indices) is read as a sequence with no pages (oasis::csr_row), never outside kv_indices. A
// query with no valid key gets a zero output (and lse = -inf in the split workspace). NaN
// propagates: a NaN score (a NaN in q or K, or an infinite one) makes that query's output NaN
// (lse NaN in the split workspace, which the merge carries through), never a silent zero.
//
// With num_splits == 1 the result is written to `out` directly; otherwise each split writes its
// normalised partial output and log-sum-exp to the workspace and merge_attn_states_* combines
// them. The split of a sequence's page list is by equal page counts.
//
// bf16 / f16 storage with head_dim 64/128/256, num_rows * group <= 16 and block_size a multiple
// of 16 goes to the tensor-core kernels decode_attn_tc_* instead (same contract and arguments,
// see decode_attn_tc_impl in oasis_attn_tc.cuh); this generic kernel serves f32 and every other
// shape.
#include "oasis_common.cuh"
#include "oasis_params.cuh"

namespace oasis {

// Shared memory of one block, in floats (the Rust wrapper computes the same sum in
// oasis_cuda::ops::decode_attn_smem_bytes): nq*(d+1) + tt*(d+1) + tt*d + nq*tt + nq*d + 2*nq.
struct DecodeSmem {
    float* q;    // [nq, d + 1] (padded: conflict-free column reads)
    float* k;    // [tt, d + 1]
    float* v;    // [tt, d]
    float* s;    // [nq, tt] scores, then probabilities
    float* acc;  // [nq, d]
    float* m;    // [nq]
    float* l;    // [nq]
};

// Stage `nt` tokens of K and V (rows of `d` contiguous elements) as f32 into tile rows
// `row0 ..`. No barrier: the next attend_staged() starts with one.
template <typename T>
__device__ __forceinline__ void stage_kv_rows(const T* __restrict__ ksrc, const T* __restrict__ vsrc, int nt,
                                              int row0, int d, DecodeSmem sm) {
    constexpr int EPV = 16 / sizeof(T);  // elements per 16-byte vector
    const bool vec = ((d * (int)sizeof(T)) % 16 == 0) && ((((u64)ksrc) | ((u64)vsrc)) & 15) == 0;
    if (vec) {
        const int nvec = nt * d / EPV;
        const uint4* kv4 = (const uint4*)ksrc;
        const uint4* vv4 = (const uint4*)vsrc;
        for (int c = threadIdx.x; c < nvec; c += blockDim.x) {
            const uint4 kr = kv4[c];
            const uint4 vr = vv4[c];
            const T* ke = (const T*)&kr;
            const T* ve = (const T*)&vr;
            const int e = c * EPV;
            const int t = row0 + e / d;
            const int x = e % d;
#pragma unroll
            for (int u = 0; u < EPV; ++u) {
                sm.k[t * (d + 1) + x + u] = to_f32(ke[u]);
                sm.v[t * d + x + u] = to_f32(ve[u]);
            }
        }
    } else {
        for (int e = threadIdx.x; e < nt * d; e += blockDim.x) {
            const int t = row0 + e / d;
            const int x = e % d;
            sm.k[t * (d + 1) + x] = to_f32(ksrc[e]);
            sm.v[t * d + x] = to_f32(vsrc[e]);
        }
    }
}

// Where the generic kernel reads its pages: `stage` puts `nt` tokens of entry `e` (page *
// num_kv_heads + head) from token `t0` into tile rows `row0 ..` as f32. T pages convert; kv8
// pages (oasis_core::kernels::kv8) dequantize, e4m3_decode(code) * scale: exact in f32, the
// twin's value (its Kv8Rows), so the rest of the kernel is the T kernel's.
template <typename T>
struct ElemPages {
    const T* k;  // [num_pages, num_kv_heads, block_size, head_dim]
    const T* v;  // [num_pages, num_kv_heads, block_size, head_dim]
    __device__ __forceinline__ void stage(i64 e, int t0, int nt, int row0, int d, int bs, DecodeSmem sm) const {
        const i64 at = e * bs * d + (i64)t0 * d;
        stage_kv_rows<T>(k + at, v + at, nt, row0, d, sm);
    }
};

struct Kv8Pages {
    const unsigned char* k;  // [num_pages, num_kv_heads, block_size, head_dim] E4M3 codes
    const unsigned char* v;  // [num_pages, num_kv_heads, block_size, head_dim] E4M3 codes
    const float* ks;         // [num_pages, num_kv_heads] powers of two
    const float* vs;         // [num_pages, num_kv_heads] powers of two
    __device__ __forceinline__ void stage(i64 e, int t0, int nt, int row0, int d, int bs, DecodeSmem sm) const {
        const i64 at = e * bs * d + (i64)t0 * d;
        const unsigned char* kc = k + at;
        const unsigned char* vc = v + at;
        const float sk = ks[e];
        const float sv = vs[e];
        if ((d & 15) == 0 && (((u64)kc | (u64)vc) & 15) == 0) {
            for (int c = threadIdx.x; c < nt * d / 16; c += blockDim.x) {
                const uint4 kr = ((const uint4*)kc)[c];
                const uint4 vr = ((const uint4*)vc)[c];
                const unsigned char* kb = (const unsigned char*)&kr;
                const unsigned char* vb = (const unsigned char*)&vr;
                const int t = row0 + c * 16 / d;
                const int x = c * 16 % d;
#pragma unroll
                for (int u = 0; u < 16; ++u) {
                    sm.k[t * (d + 1) + x + u] = __fmul_rn(e4m3_decode(kb[u]), sk);
                    sm.v[t * d + x + u] = __fmul_rn(e4m3_decode(vb[u]), sv);
                }
            }
        } else {
            for (int c = threadIdx.x; c < nt * d; c += blockDim.x) {
                const int t = row0 + c / d;
                const int x = c % d;
                sm.k[t * (d + 1) + x] = __fmul_rn(e4m3_decode(kc[c]), sk);
                sm.v[t * d + x] = __fmul_rn(e4m3_decode(vc[c]), sv);
            }
        }
    }
};

// One staged tile of `nt` tokens: score every (query, token) pair, update the online softmax of
// every query. `mask_rows_below`: queries of rows < it do not see this tile (0 = all see it).
// Block-uniform; starts and ends with a barrier.
__device__ void attend_staged(int nt, int nq, int group, int d, int tt, float sm_scale, int mask_rows_below,
                              DecodeSmem sm) {
    __syncthreads();
    for (int p = threadIdx.x; p < nq * nt; p += blockDim.x) {
        const int qi = p / nt;
        const int t = p - qi * nt;
        float score;
        if (qi / group < mask_rows_below) {
            score = neg_inf();
        } else {
            const float* qr = sm.q + qi * (d + 1);
            const float* kr = sm.k + t * (d + 1);
            float dot = 0.f;
            for (int x = 0; x < d; ++x) dot += qr[x] * kr[x];
            score = dot * sm_scale;
        }
        sm.s[qi * tt + t] = score;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int nwarps = blockDim.x >> 5;
    for (int qi = threadIdx.x >> 5; qi < nq; qi += nwarps) {
        float* srow = sm.s + qi * tt;
        const float sv = lane < nt ? srow[lane] : neg_inf();
        const float m_old = sm.m[qi];
        const float m_new = fmaxf(m_old, warp_max(sv));  // fmaxf drops NaN: l and acc carry it
        // Nothing visible yet: the state stays empty (warp-uniform). A NaN score is not nothing.
        if (m_new == neg_inf() && !__any_sync(0xffffffffu, sv != sv)) continue;
        const float p = (lane < nt && sv != neg_inf()) ? expf(sv - m_new) : 0.f;
        const float alpha = m_old == neg_inf() ? 0.f : expf(m_old - m_new);
        const float psum = warp_sum(p);
        if (lane < nt) srow[lane] = p;
        __syncwarp();
        float* arow = sm.acc + qi * d;
        for (int x = lane; x < d; x += 32) {
            float a = arow[x] * alpha;
            for (int t = 0; t < nt; ++t) a += srow[t] * sm.v[t * d + x];
            arow[x] = a;
        }
        if (lane == 0) {
            sm.m[qi] = m_new;
            sm.l[qi] = sm.l[qi] * alpha + psum;
        }
        __syncwarp();
    }
    __syncthreads();
}

// grid (num_seqs, num_kv_heads, num_splits); blockDim.x a multiple of 32; dynamic shared memory as
// laid out in DecodeSmem for nq = num_rows * group; tile_tokens in 1..=32. P: ElemPages<T> or
// Kv8Pages.
template <typename T, typename P>
__device__ void decode_attn_impl(
    const T* __restrict__ q,                  // [num_seqs, num_rows, num_qo_heads, head_dim]
    P pages,                                  // [num_pages, num_kv_heads, block_size, head_dim]
    const int* __restrict__ kv_indptr,        // [num_seqs + 1] CSR over kv_indices
    const int* __restrict__ kv_indices,       // [nnz] GPU page ids, in sequence order
    const int* __restrict__ kv_last_page_len, // [num_seqs] 1..=block_size valid tokens of the last page
    const int* __restrict__ page_map,         // [num_pages, num_kv_heads] logical block held, < 0 empty; or null
    const T* __restrict__ extra_k,            // [num_seqs, num_kv_heads, head_dim] or null
    const T* __restrict__ extra_v,            // [num_seqs, num_kv_heads, head_dim] or null
    T* __restrict__ out,                      // [num_seqs, num_rows, num_qo_heads, head_dim] (num_splits == 1)
    float* __restrict__ tmp_out,              // [num_seqs, num_rows, num_qo_heads, num_splits, head_dim] (num_splits > 1)
    float* __restrict__ tmp_lse,              // [num_seqs, num_rows, num_qo_heads, num_splits] (num_splits > 1)
    int num_rows, int num_qo_heads, int num_kv_heads, int head_dim, int block_size, int num_pages, int nnz,
    int num_splits, int tile_tokens, float sm_scale) {
    extern __shared__ float smem[];
    const int s = blockIdx.x;
    const int h = blockIdx.y;
    const int split = blockIdx.z;
    const int d = head_dim;
    const int group = num_qo_heads / num_kv_heads;
    const int nq = num_rows * group;  // query vector qi = row * group + j reads qo head h * group + j
    const int tt = tile_tokens;

    DecodeSmem sm;
    sm.q = smem;
    sm.k = sm.q + nq * (d + 1);
    sm.v = sm.k + tt * (d + 1);
    sm.s = sm.v + tt * d;
    sm.acc = sm.s + nq * tt;
    sm.m = sm.acc + nq * d;
    sm.l = sm.m + nq;

    for (int e = threadIdx.x; e < nq * d; e += blockDim.x) {
        const int qi = e / d;
        const int x = e - qi * d;
        const int row = qi / group;
        const int g = h * group + (qi - row * group);
        sm.q[qi * (d + 1) + x] = to_f32(q[(((i64)s * num_rows + row) * num_qo_heads + g) * d + x]);
        sm.acc[e] = 0.f;
    }
    for (int qi = threadIdx.x; qi < nq; qi += blockDim.x) {
        sm.m[qi] = neg_inf();
        sm.l[qi] = 0.f;
    }
    __syncthreads();

    int p_begin;
    int p_end;
    csr_row(kv_indptr, s, nnz, &p_begin, &p_end);  // a malformed row has no pages
    const int n_pages = p_end - p_begin;
    const int per_split = (n_pages + num_splits - 1) / num_splits;
    const int p0 = min(n_pages, split * per_split);
    const int p1 = min(n_pages, p0 + per_split);
    int last_len = kv_last_page_len[s];
    last_len = last_len < 0 ? 0 : (last_len > block_size ? block_size : last_len);

    // Tiles fill across page entries (a 16-token page is half a 32-token tile).
    int fill = 0;
    for (int p = p0; p < p1; ++p) {
        const int page = kv_indices[p_begin + p];
        if (page < 0 || page >= num_pages) continue;
        if (page_map != nullptr && page_map[(i64)page * num_kv_heads + h] < 0) continue;
        const int n_tok = p == n_pages - 1 ? last_len : block_size;
        const i64 e = (i64)page * num_kv_heads + h;
        for (int t0 = 0; t0 < n_tok;) {
            const int take = min(tt - fill, n_tok - t0);
            pages.stage(e, t0, take, fill, d, block_size, sm);
            fill += take;
            t0 += take;
            if (fill == tt) {
                attend_staged(fill, nq, group, d, tt, sm_scale, 0, sm);
                fill = 0;
            }
        }
    }
    if (fill > 0) attend_staged(fill, nq, group, d, tt, sm_scale, 0, sm);
    if (extra_k != nullptr && extra_v != nullptr && num_rows >= 2 && split == num_splits - 1) {
        const i64 off = ((i64)s * num_kv_heads + h) * d;
        stage_kv_rows<T>(extra_k + off, extra_v + off, 1, 0, d, sm);
        attend_staged(1, nq, group, d, tt, sm_scale, 1, sm);
    }

    for (int e = threadIdx.x; e < nq * d; e += blockDim.x) {
        const int qi = e / d;
        const int x = e - qi * d;
        const int row = qi / group;
        const int g = h * group + (qi - row * group);
        const float l = sm.l[qi];  // 0: nothing attended; NaN: a NaN score (kept, not zeroed)
        const float o = l != 0.f ? sm.acc[e] / l : 0.f;
        const i64 head = ((i64)s * num_rows + row) * num_qo_heads + g;
        if (num_splits == 1) {
            out[head * d + x] = from_f32<T>(o);
        } else {
            tmp_out[(head * num_splits + split) * d + x] = o;
            if (x == 0) tmp_lse[head * num_splits + split] = l != 0.f ? sm.m[qi] + logf(l) : neg_inf();
        }
    }
}

// grid (num_seqs * num_rows * num_qo_heads); any block size, threads stride over head_dim.
template <typename T>
__device__ void merge_attn_states_impl(
    const float* __restrict__ tmp_out, // [num_heads_total, num_splits, head_dim]
    const float* __restrict__ tmp_lse, // [num_heads_total, num_splits]
    T* __restrict__ out,               // [num_heads_total, head_dim]
    int num_splits, int head_dim) {
    const i64 head = blockIdx.x;
    const float* lse = tmp_lse + head * num_splits;
    float m = neg_inf();
    for (int i = 0; i < num_splits; ++i) m = (lse[i] != lse[i] || m != m) ? lse[i] + m : fmaxf(m, lse[i]);  // NaN sticks
    for (int x = threadIdx.x; x < head_dim; x += blockDim.x) {
        float acc = 0.f;
        float wsum = 0.f;
        if (m != neg_inf()) {
            for (int i = 0; i < num_splits; ++i) {
                if (lse[i] == neg_inf()) continue;
                const float w = expf(lse[i] - m);
                wsum += w;
                acc += w * tmp_out[(head * num_splits + i) * head_dim + x];
            }
        }
        out[head * head_dim + x] = from_f32<T>(wsum != 0.f ? acc / wsum : 0.f);
    }
}

}  // namespace oasis

#include "oasis_attn_tc.cuh"

// Entry points: one parameter struct each (cuda/oasis_params.cuh), unpacked into the impls.
#define OASIS_DECODE_ATTN(NAME, T)                                                                    \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::DecodeAttnParams<T> p) {          \
        oasis::decode_attn_impl<T>(p.q, oasis::ElemPages<T>{p.k_pages, p.v_pages}, p.kv_indptr,        \
                                   p.kv_indices,                                                      \
                                   p.kv_last_page_len, p.page_map, p.extra_k, p.extra_v, p.out,       \
                                   p.tmp_out, p.tmp_lse, p.num_rows, p.num_qo_heads, p.num_kv_heads,  \
                                   p.head_dim, p.block_size, p.num_pages, p.nnz, p.num_splits,        \
                                   p.tile_tokens, p.sm_scale);                                        \
    }

OASIS_DECODE_ATTN(decode_attn_bf16, oasis::bf16)
OASIS_DECODE_ATTN(decode_attn_f16, oasis::f16)
OASIS_DECODE_ATTN(decode_attn_f32, float)

#define OASIS_MERGE_ATTN_STATES(NAME, T)                                                             \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::MergeAttnStatesParams<T> p) {     \
        oasis::merge_attn_states_impl<T>(p.tmp_out, p.tmp_lse, p.out, p.num_splits, p.head_dim);    \
    }

OASIS_MERGE_ATTN_STATES(merge_attn_states_bf16, oasis::bf16)
OASIS_MERGE_ATTN_STATES(merge_attn_states_f16, oasis::f16)
OASIS_MERGE_ATTN_STATES(merge_attn_states_f32, float)

// head_dim is the template parameter D here (the wrapper only picks this kernel when they agree);
// tile_tokens is the generic kernel's.
#define OASIS_DECODE_ATTN_TC(NAME, T, D, STAGES)                                                      \
    extern "C" __global__ void __launch_bounds__(OASIS_TC_WARPS * 32)                                 \
        NAME(const __grid_constant__ oasis::DecodeAttnParams<T> p) {                                 \
        oasis::decode_attn_tc_impl<T, D, STAGES>(p.q, oasis::TcElemPages<T, D, STAGES>{p.k_pages, p.v_pages}, \
                                                 p.kv_indptr, p.kv_indices,                           \
                                                 p.kv_last_page_len, p.page_map, p.extra_k, p.extra_v, \
                                                 p.out, p.tmp_out, p.tmp_lse, p.num_rows,             \
                                                 p.num_qo_heads, p.num_kv_heads, p.block_size,        \
                                                 p.num_pages, p.nnz, p.num_splits, p.sm_scale);       \
    }

// Pipeline depth per head_dim (must match oasis_cuda::ops::decode_attn_tc_stages).
OASIS_DECODE_ATTN_TC(decode_attn_tc_bf16_d64, oasis::bf16, 64, 4)
OASIS_DECODE_ATTN_TC(decode_attn_tc_bf16_d128, oasis::bf16, 128, 3)
OASIS_DECODE_ATTN_TC(decode_attn_tc_bf16_d256, oasis::bf16, 256, 2)
OASIS_DECODE_ATTN_TC(decode_attn_tc_f16_d64, oasis::f16, 64, 4)
OASIS_DECODE_ATTN_TC(decode_attn_tc_f16_d128, oasis::f16, 128, 3)
OASIS_DECODE_ATTN_TC(decode_attn_tc_f16_d256, oasis::f16, 256, 2)

// ---- kv8 pages (oasis_core::kernels::decode_attention_kv8): the same kernels over E4M3 codes
// and per-(page, KV head) scales; q, the extra K/V and out stay T, and split-KV merges with
// merge_attn_states_* as above. The generic kernel dequantizes into its f32 tile (any dtype and
// head_dim); the tensor-core one into its bf16 tile (bf16 only: see TcKv8Pages).
#define OASIS_DECODE_ATTN_KV8(NAME, T)                                                                \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::DecodeAttnKv8Params<T> p) {       \
        oasis::decode_attn_impl<T>(p.q, oasis::Kv8Pages{p.k_codes, p.v_codes, p.k_scales, p.v_scales}, \
                                   p.kv_indptr, p.kv_indices, p.kv_last_page_len, p.page_map,         \
                                   p.extra_k, p.extra_v, p.out, p.tmp_out, p.tmp_lse, p.num_rows,     \
                                   p.num_qo_heads, p.num_kv_heads, p.head_dim, p.block_size,          \
                                   p.num_pages, p.nnz, p.num_splits, p.tile_tokens, p.sm_scale);      \
    }

OASIS_DECODE_ATTN_KV8(decode_attn_kv8_bf16, oasis::bf16)
OASIS_DECODE_ATTN_KV8(decode_attn_kv8_f16, oasis::f16)
OASIS_DECODE_ATTN_KV8(decode_attn_kv8_f32, float)

#define OASIS_DECODE_ATTN_KV8_TC(NAME, T, D, STAGES, PAGES)                                           \
    extern "C" __global__ void __launch_bounds__(OASIS_TC_WARPS * 32)                                 \
        NAME(const __grid_constant__ oasis::DecodeAttnKv8Params<T> p) {                              \
        oasis::decode_attn_tc_impl<T, D, STAGES>(                                                     \
            p.q, oasis::PAGES<T, D, STAGES>{p.k_codes, p.v_codes, p.k_scales, p.v_scales},            \
            p.kv_indptr, p.kv_indices, p.kv_last_page_len, p.page_map, p.extra_k, p.extra_v, p.out,   \
            p.tmp_out, p.tmp_lse, p.num_rows, p.num_qo_heads, p.num_kv_heads, p.block_size,           \
            p.num_pages, p.nnz, p.num_splits, p.sm_scale);                                            \
    }

// Pipeline depth per head_dim: the bf16 kernel's (oasis_cuda::ops::decode_attn_tc_stages).
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tc_bf16_d64, oasis::bf16, 64, 4, TcKv8Pages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tc_bf16_d128, oasis::bf16, 128, 3, TcKv8Pages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tc_bf16_d256, oasis::bf16, 256, 2, TcKv8Pages)

// The same over kv8 pages read by the tensor cores from their codes (TcKv8RegPages: no
// dequantized tile, f16 MMA, so f16 queries too). Chosen by oasis_cuda's Kv8AttnKernel.
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcr_bf16_d64, oasis::bf16, 64, 4, TcKv8RegPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcr_bf16_d128, oasis::bf16, 128, 3, TcKv8RegPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcr_bf16_d256, oasis::bf16, 256, 2, TcKv8RegPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcr_f16_d64, oasis::f16, 64, 4, TcKv8RegPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcr_f16_d128, oasis::f16, 128, 3, TcKv8RegPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcr_f16_d256, oasis::f16, 256, 2, TcKv8RegPages)

// The same with twice the pipeline depth and no tile room (TcKv8DeepPages, Kv8AttnKernel::
// RegistersDeep; oasis_cuda::ops::decode_attn_kv8_deep_stages): the bf16 kernel's bytes in flight.
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcd_bf16_d64, oasis::bf16, 64, 8, TcKv8DeepPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcd_bf16_d128, oasis::bf16, 128, 6, TcKv8DeepPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcd_bf16_d256, oasis::bf16, 256, 3, TcKv8DeepPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcd_f16_d64, oasis::f16, 64, 8, TcKv8DeepPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcd_f16_d128, oasis::f16, 128, 6, TcKv8DeepPages)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tcd_f16_d256, oasis::f16, 256, 3, TcKv8DeepPages)
