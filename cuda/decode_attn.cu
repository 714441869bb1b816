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
// A (page, head) entry whose page_map value is negative is skipped. A query with no valid key
// gets a zero output (and lse = -inf in the split workspace).
//
// With num_splits == 1 the result is written to `out` directly; otherwise each split writes its
// normalised partial output and log-sum-exp to the workspace and merge_attn_states_* combines
// them. The split of a sequence's page list is by equal page counts.
#include "oasis_common.cuh"

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
        const float m_new = fmaxf(m_old, warp_max(sv));
        if (m_new == neg_inf()) continue;  // nothing visible yet: state stays empty (warp-uniform)
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
// laid out in DecodeSmem for nq = num_rows * group; tile_tokens in 1..=32.
template <typename T>
__device__ void decode_attn_impl(
    const T* __restrict__ q,                  // [num_seqs, num_rows, num_qo_heads, head_dim]
    const T* __restrict__ k_pages,            // [num_pages, num_kv_heads, block_size, head_dim]
    const T* __restrict__ v_pages,            // [num_pages, num_kv_heads, block_size, head_dim]
    const int* __restrict__ kv_indptr,        // [num_seqs + 1] CSR over kv_indices
    const int* __restrict__ kv_indices,       // [nnz] GPU page ids, in sequence order
    const int* __restrict__ kv_last_page_len, // [num_seqs] 1..=block_size valid tokens of the last page
    const int* __restrict__ page_map,         // [num_pages, num_kv_heads] logical block held, < 0 empty; or null
    const T* __restrict__ extra_k,            // [num_seqs, num_kv_heads, head_dim] or null
    const T* __restrict__ extra_v,            // [num_seqs, num_kv_heads, head_dim] or null
    T* __restrict__ out,                      // [num_seqs, num_rows, num_qo_heads, head_dim] (num_splits == 1)
    float* __restrict__ tmp_out,              // [num_seqs, num_rows, num_qo_heads, num_splits, head_dim] (num_splits > 1)
    float* __restrict__ tmp_lse,              // [num_seqs, num_rows, num_qo_heads, num_splits] (num_splits > 1)
    int num_rows, int num_qo_heads, int num_kv_heads, int head_dim, int block_size, int num_pages,
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

    const int p_begin = kv_indptr[s];
    const int n_pages = kv_indptr[s + 1] - p_begin;
    const int per_split = (n_pages + num_splits - 1) / num_splits;
    const int p0 = min(n_pages, split * per_split);
    const int p1 = min(n_pages, p0 + per_split);
    int last_len = kv_last_page_len[s];
    last_len = last_len < 0 ? 0 : (last_len > block_size ? block_size : last_len);
    const i64 entry = (i64)block_size * d;

    // Tiles fill across page entries (a 16-token page is half a 32-token tile).
    int fill = 0;
    for (int p = p0; p < p1; ++p) {
        const int page = kv_indices[p_begin + p];
        if (page < 0 || page >= num_pages) continue;
        if (page_map != nullptr && page_map[(i64)page * num_kv_heads + h] < 0) continue;
        const int n_tok = p == n_pages - 1 ? last_len : block_size;
        const i64 base = ((i64)page * num_kv_heads + h) * entry;
        for (int t0 = 0; t0 < n_tok;) {
            const int take = min(tt - fill, n_tok - t0);
            stage_kv_rows<T>(k_pages + base + (i64)t0 * d, v_pages + base + (i64)t0 * d, take, fill, d, sm);
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
        const float l = sm.l[qi];
        const float o = l > 0.f ? sm.acc[e] / l : 0.f;
        const i64 head = ((i64)s * num_rows + row) * num_qo_heads + g;
        if (num_splits == 1) {
            out[head * d + x] = from_f32<T>(o);
        } else {
            tmp_out[(head * num_splits + split) * d + x] = o;
            if (x == 0) tmp_lse[head * num_splits + split] = l > 0.f ? sm.m[qi] + logf(l) : neg_inf();
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
    for (int i = 0; i < num_splits; ++i) m = fmaxf(m, lse[i]);
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
        out[head * head_dim + x] = from_f32<T>(wsum > 0.f ? acc / wsum : 0.f);
    }
}

}  // namespace oasis

#define OASIS_DECODE_ATTN(NAME, T)                                                                    \
    extern "C" __global__ void NAME(const T* q, const T* k_pages, const T* v_pages, const int* kv_indptr, \
                                    const int* kv_indices, const int* kv_last_page_len,               \
                                    const int* page_map, const T* extra_k, const T* extra_v, T* out,  \
                                    float* tmp_out, float* tmp_lse, int num_rows, int num_qo_heads,   \
                                    int num_kv_heads, int head_dim, int block_size, int num_pages,    \
                                    int num_splits, int tile_tokens, float sm_scale) {                \
        oasis::decode_attn_impl<T>(q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len,     \
                                   page_map, extra_k, extra_v, out, tmp_out, tmp_lse, num_rows,       \
                                   num_qo_heads, num_kv_heads, head_dim, block_size, num_pages,       \
                                   num_splits, tile_tokens, sm_scale);                                \
    }

OASIS_DECODE_ATTN(decode_attn_bf16, oasis::bf16)
OASIS_DECODE_ATTN(decode_attn_f16, oasis::f16)
OASIS_DECODE_ATTN(decode_attn_f32, float)

#define OASIS_MERGE_ATTN_STATES(NAME, T)                                                             \
    extern "C" __global__ void NAME(const float* tmp_out, const float* tmp_lse, T* out, int num_splits, \
                                    int head_dim) {                                                  \
        oasis::merge_attn_states_impl<T>(tmp_out, tmp_lse, out, num_splits, head_dim);              \
    }

OASIS_MERGE_ATTN_STATES(merge_attn_states_bf16, oasis::bf16)
OASIS_MERGE_ATTN_STATES(merge_attn_states_f16, oasis::f16)
OASIS_MERGE_ATTN_STATES(merge_attn_states_f32, float)
