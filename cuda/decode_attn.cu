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
// see decode_attn_tc_impl below); this generic kernel serves f32 and every other shape.
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

// ============================================================================================
// Tensor-core path (bf16 / f16, head_dim 64 / 128 / 256, nq = num_rows * group <= 16, block_size
// a multiple of 16). Same contract and arguments as decode_attn_impl (tile_tokens is ignored).
//
// One block of 4 warps per (sequence, KV head, split). A work item is a 16-token chunk of one
// (page, head) entry (or the lookahead row's extra K/V, a one-token item of the last split).
// The block compacts the valid items of its split (kv_indices in range, page_map >= 0, tokens
// left on the last page) into a shared list, LIST_CAP candidates per round; warp w takes items
// w, w + 4, ... of the list. Each warp streams its items through its own STAGES-deep ring of
// shared-memory buffers with cp.async (16-byte copies, rows past the valid tokens zero-filled),
// so STAGES - 1 chunks per warp are in flight while it computes one; only __syncwarp inside
// the loop. Per chunk: S = Q Kᵀ (16 padded query rows × 16 tokens) with mma.m16n8k16 (K
// fragments by ldmatrix), masking, an online softmax in f32 on the accumulator fragments (base
// 2: scores are pre-scaled by sm_scale·log2 e), P rounded to T and O += P V with mma (V
// fragments by ldmatrix.trans). Each warp keeps its own (m, l, O); the four states are merged
// through shared memory at the end. Shared buffers are XOR-swizzled in 16-byte units (unit u
// of token row r lives at u ^ (r & 7)), so the 8 row addresses of every ldmatrix hit distinct
// banks.
//
// Shared memory (bytes; the Rust wrapper computes the same sum in
// oasis_cuda::ops::decode_attn_tc_smem_bytes): staging 4 * STAGES * 64 * D (reused for the
// final merge: 4 * 16 * (D + 8) f32), item list 2 * (LIST_CAP + 1) ints, merge m/l 2 * 64
// floats, scan scratch 36 ints.
// ============================================================================================

#define OASIS_TC_WARPS 4
#define OASIS_TC_LIST_CAP 512

// ---- PTX wrappers (sm_80+) -----------------------------------------------------------------
namespace tc {

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared; only the first `src_bytes` (0 or 16) are read, the rest zero-filled.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}

// d += a · b for one m16n8k16 tile: a row-major 16×16, b column-major 16×8, f32 accumulate.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <>
__device__ __forceinline__ void mma16816<bf16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<f16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 rounded to T (nearest even), `lo` in the low half.
template <typename T>
__device__ __forceinline__ u32 pack2(float lo, float hi);
template <>
__device__ __forceinline__ u32 pack2<bf16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <>
__device__ __forceinline__ u32 pack2<f16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}


// 16 codes (one 16-byte unit) times `scale` as two 16-byte units of T (8 values each).
template <typename T>
__device__ __forceinline__ void dequant16(const uint4& w, float scale, uint4& lo, uint4& hi) {
    const u32 in[4] = {w.x, w.y, w.z, w.w};
    u32 out[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f[4];
        e4m3x4_to_f32(in[i], f);
        out[2 * i] = pack2<T>(f[0] * scale, f[1] * scale);
        out[2 * i + 1] = pack2<T>(f[2] * scale, f[3] * scale);
    }
    lo = make_uint4(out[0], out[1], out[2], out[3]);
    hi = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace tc
// ---- end of PTX wrappers -------------------------------------------------------------------

// How the tensor-core kernel stages a warp's work items. Each warp owns WARP_UNITS 16-byte units
// of shared memory `w`. `issue(w, slot, off, xk, xv, nvalid, lane)` starts the cp.async of a
// 16-token chunk at element `off` of the pages (`nvalid` valid rows, the rest zero-filled), or,
// when off < 0, of the extra K/V row `xk`, `xv`, into ring slot `slot` (0..STAGES). Once the copy
// has landed and the warp has synchronised, `tile(w, slot, e, lane)` returns the chunk's K tile as
// ldmatrix reads it (T, 16 rows of D, 16-byte units XOR-swizzled: unit u of row r at u ^ (r & 7)),
// its V tile CHUNK_UNITS units after it; `e` = page * num_kv_heads + head, < 0 for the extra row.

// T pages: the ring holds the swizzled T tiles themselves.
template <typename T, int D, int STAGES>
struct TcElemPages {
    static constexpr int UPR = D / 8;
    static constexpr int CHUNK_UNITS = 16 * UPR;
    static constexpr int WARP_UNITS = STAGES * 2 * CHUNK_UNITS;
    const T* k;  // [num_pages, num_kv_heads, block_size, head_dim]
    const T* v;  // [num_pages, num_kv_heads, block_size, head_dim]

    __device__ __forceinline__ void issue(uint4* w, int slot, i64 off, const T* xk, const T* xv, int nvalid,
                                          int lane) const {
        const T* ksrc = off >= 0 ? k + off : xk;
        const T* vsrc = off >= 0 ? v + off : xv;
        uint4* kd = w + slot * 2 * CHUNK_UNITS;
        uint4* vd = kd + CHUNK_UNITS;
#pragma unroll
        for (int r = 0; r < CHUNK_UNITS / 32; ++r) {
            const int unit = lane + 32 * r;
            const int row = unit / UPR;
            const int col = unit % UPR;
            const bool ok = row < nvalid;
            const int src = ok ? row * D + col * 8 : 0;
            const int dst = row * UPR + (col ^ (row & 7));
            tc::cp_async_16(kd + dst, ksrc + src, ok ? 16 : 0);
            tc::cp_async_16(vd + dst, vsrc + src, ok ? 16 : 0);
        }
    }
    __device__ __forceinline__ const uint4* tile(uint4* w, int slot, i64, int) const {
        return w + slot * 2 * CHUNK_UNITS;
    }
};

// kv8 pages: the ring holds the chunks' codes as stored (16 rows of D bytes, K then V; the extra
// row as T in the K and V areas); `tile` dequantizes one into the warp's T tile after the ring,
// code * scale, exact in bf16 (a 4-bit significand times 2^e, e in [-120, 120]; f16 would
// overflow, so T is bf16 only). The MMA then sees the twin's dequantized values.
template <typename T, int D, int STAGES>
struct TcKv8Pages {
    static_assert(sizeof(T) == 2 && D % 16 == 0, "kv8 tensor-core pages: bf16, D a multiple of 16");
    static constexpr int UPR = D / 8;
    static constexpr int CHUNK_UNITS = 16 * UPR;  // of the T tile
    static constexpr int CODE_UNITS = D;          // 16 rows x D codes, in 16-byte units
    static constexpr int WARP_UNITS = STAGES * 2 * CODE_UNITS + 2 * CHUNK_UNITS;
    const unsigned char* k;  // [num_pages, num_kv_heads, block_size, head_dim] E4M3 codes
    const unsigned char* v;  // [num_pages, num_kv_heads, block_size, head_dim] E4M3 codes
    const float* ks;         // [num_pages, num_kv_heads]
    const float* vs;         // [num_pages, num_kv_heads]

    __device__ __forceinline__ void issue(uint4* w, int slot, i64 off, const T* xk, const T* xv, int nvalid,
                                          int lane) const {
        uint4* kd = w + slot * 2 * CODE_UNITS;
        uint4* vd = kd + CODE_UNITS;
        if (off < 0) {  // the extra row, T: D / 8 units each
            for (int u = lane; u < UPR; u += 32) {
                tc::cp_async_16(kd + u, xk + u * 8, 16);
                tc::cp_async_16(vd + u, xv + u * 8, 16);
            }
            return;
        }
#pragma unroll
        for (int r = 0; r < CODE_UNITS / 32; ++r) {
            const int unit = lane + 32 * r;
            const int row = unit / (D / 16);
            const bool ok = row < nvalid;
            const i64 src = off + (ok ? unit * 16 : 0);
            tc::cp_async_16(kd + unit, k + src, ok ? 16 : 0);
            tc::cp_async_16(vd + unit, v + src, ok ? 16 : 0);
        }
    }
    __device__ __forceinline__ const uint4* tile(uint4* w, int slot, i64 e, int lane) const {
        const uint4* kc = w + slot * 2 * CODE_UNITS;
        const uint4* vc = kc + CODE_UNITS;
        uint4* kt = w + STAGES * 2 * CODE_UNITS;
        uint4* vt = kt + CHUNK_UNITS;
        if (e >= 0) {
            const float sk = ks[e];
            const float sv = vs[e];
#pragma unroll
            for (int r = 0; r < CODE_UNITS / 32; ++r) {
                const int unit = lane + 32 * r;
                const int row = unit / (D / 16);
                const int col = unit % (D / 16) * 2;  // T units col, col + 1
                const int at = row * UPR;
                uint4 lo, hi;
                tc::dequant16<T>(kc[unit], sk, lo, hi);
                kt[at + (col ^ (row & 7))] = lo;
                kt[at + ((col + 1) ^ (row & 7))] = hi;
                tc::dequant16<T>(vc[unit], sv, lo, hi);
                vt[at + (col ^ (row & 7))] = lo;
                vt[at + ((col + 1) ^ (row & 7))] = hi;
            }
        } else {  // the extra row as row 0 (T already), rows 1..15 zero (masked, and 0 * V must stay 0)
            for (int unit = lane; unit < CHUNK_UNITS; unit += 32) {
                const int row = unit / UPR;
                const int col = unit % UPR;
                const uint4 z = make_uint4(0u, 0u, 0u, 0u);
                kt[row * UPR + (col ^ (row & 7))] = row == 0 ? kc[col] : z;
                vt[row * UPR + (col ^ (row & 7))] = row == 0 ? vc[col] : z;
            }
        }
        __syncwarp();
        return kt;
    }
};

template <typename T, int D, int STAGES, typename P>
__device__ void decode_attn_tc_impl(
    const T* __restrict__ q, P pages,
    const int* __restrict__ kv_indptr, const int* __restrict__ kv_indices,
    const int* __restrict__ kv_last_page_len, const int* __restrict__ page_map, const T* __restrict__ extra_k,
    const T* __restrict__ extra_v, T* __restrict__ out, float* __restrict__ tmp_out, float* __restrict__ tmp_lse,
    int num_rows, int num_qo_heads, int num_kv_heads, int block_size, int num_pages, int nnz, int num_splits,
    float sm_scale) {
    constexpr int WARPS = OASIS_TC_WARPS;
    constexpr int THREADS = WARPS * 32;
    constexpr int CHUNK = 16;                   // tokens per work item
    constexpr int UPR = D / 8;                  // 16-byte units per token row
    constexpr int CHUNK_UNITS = CHUNK * UPR;    // 16-byte units of one K (or V) chunk
    constexpr int LIST_CAP = OASIS_TC_LIST_CAP; // candidates per round
    constexpr int PER_THREAD = LIST_CAP / THREADS;
    constexpr int OSTRIDE = D + 8;              // f32 row stride of the merge buffer
    static_assert(D == 64 || D == 128 || D == 256, "head_dim");
    static_assert(LIST_CAP % THREADS == 0, "list");
    static_assert(P::CHUNK_UNITS == CHUNK_UNITS, "page loader");
    static_assert(WARPS * 16 * OSTRIDE * 4 <= WARPS * P::WARP_UNITS * 16, "merge buffer");

    extern __shared__ __align__(16) unsigned char tc_smem[];
    uint4* stage = (uint4*)tc_smem;  // [WARPS][P::WARP_UNITS]
    int* list_page = (int*)(tc_smem + WARPS * P::WARP_UNITS * 16);  // [LIST_CAP + 1]; -1 = extra
    int* list_info = list_page + (LIST_CAP + 1);  // [LIST_CAP + 1]: (first token << 5) | valid tokens
    float* red_m = (float*)(list_info + (LIST_CAP + 1));  // [WARPS][16]
    float* red_l = red_m + WARPS * 16;                    // [WARPS][16]
    int* scan_scratch = (int*)(red_l + WARPS * 16);       // 33 (+3 pad) ints
    float* red_o = (float*)tc_smem;                       // [WARPS][16][OSTRIDE], after the loop

    const int s = blockIdx.x;
    const int h = blockIdx.y;
    const int split = blockIdx.z;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;  // mma group: rows g and g + 8 of A / C, column g of B
    const int c = lane & 3;   // thread in group
    const int group = num_qo_heads / num_kv_heads;
    const int nq = num_rows * group;
    const float scale_log2 = sm_scale * 1.4426950408889634f;

    // Q fragments (A operand, rows = query vectors qi = row * group + j, padded with zeros to 16).
    u32 qf[D / 16][4];
    {
        const T* qrow[2] = {nullptr, nullptr};
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int qi = g + 8 * hf;
            if (qi < nq) {
                const int row = qi / group;
                const int hq = h * group + (qi - row * group);
                qrow[hf] = q + (((i64)s * num_rows + row) * num_qo_heads + hq) * D;
            }
        }
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const T* base = qrow[r & 1];
                const int x = ks * 16 + 2 * c + 8 * (r >> 1);
                qf[ks][r] = base != nullptr ? *(const u32*)(base + x) : 0u;
            }
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m_r[2] = {neg_inf(), neg_inf()};  // running max (log2 units) of rows g, g + 8
    float l_r[2] = {0.f, 0.f};              // this thread's part of the running sums

    int p_begin;
    int p_end;
    csr_row(kv_indptr, s, nnz, &p_begin, &p_end);  // a malformed row has no pages
    const int n_pages = p_end - p_begin;
    const int per_split = (n_pages + num_splits - 1) / num_splits;
    const int p0 = min(n_pages, split * per_split);
    const int p1 = min(n_pages, p0 + per_split);
    int last_len = kv_last_page_len[s];
    last_len = last_len < 0 ? 0 : (last_len > block_size ? block_size : last_len);
    const int cpp = block_size / CHUNK;  // chunks per page entry
    const int k_lo = p0 * cpp;
    const int k_hi = p1 * cpp;
    const bool with_extra = extra_k != nullptr && extra_v != nullptr && num_rows >= 2 && split == num_splits - 1;
    const i64 entry = (i64)block_size * D;
    uint4* wbuf = stage + warp * P::WARP_UNITS;
    const i64 xoff = ((i64)s * num_kv_heads + h) * D;  // the extra row (read only when with_extra)
    const T* xk = extra_k != nullptr ? extra_k + xoff : nullptr;
    const T* xv = extra_v != nullptr ? extra_v + xoff : nullptr;

    for (int base = k_lo;; base += LIST_CAP) {
        // ---- compact this round's valid items into the shared list
        const int n = min(LIST_CAP, k_hi - base);
        int c_page[PER_THREAD], c_info[PER_THREAD];
        int cnt = 0;
#pragma unroll
        for (int u = 0; u < PER_THREAD; ++u) {
            const int idx = threadIdx.x * PER_THREAD + u;
            c_page[u] = -1;
            c_info[u] = 0;
            if (idx < n) {
                const int kk = base + idx;
                const int p = kk / cpp;
                const int t0 = (kk - p * cpp) * CHUNK;
                const int page = kv_indices[p_begin + p];
                const int n_tok = p == n_pages - 1 ? last_len : block_size;
                if (page >= 0 && page < num_pages && t0 < n_tok &&
                    (page_map == nullptr || page_map[(i64)page * num_kv_heads + h] >= 0)) {
                    c_page[u] = page;
                    c_info[u] = (t0 << 5) | min(CHUNK, n_tok - t0);
                    ++cnt;
                }
            }
        }
        int total;
        int pos = block_exclusive_scan(cnt, scan_scratch, &total);
#pragma unroll
        for (int u = 0; u < PER_THREAD; ++u) {
            if (c_page[u] >= 0) {
                list_page[pos] = c_page[u];
                list_info[pos] = c_info[u];
                ++pos;
            }
        }
        const bool last_round = base + LIST_CAP >= k_hi;
        if (last_round && with_extra) {
            if (threadIdx.x == 0) {
                list_page[total] = -1;
                list_info[total] = 1;  // token 0, one valid token
            }
            ++total;
        }
        __syncthreads();

        // ---- this warp's items: warp, warp + WARPS, ...
        const int my_n = total > warp ? (total - warp + WARPS - 1) / WARPS : 0;
        auto issue = [&](int i) {
            const int j = warp + WARPS * i;
            const int page = list_page[j];
            const int info = list_info[j];
            const i64 off = page >= 0 ? ((i64)page * num_kv_heads + h) * entry + (i64)(info >> 5) * D : -1;
            pages.issue(wbuf, i % STAGES, off, xk, xv, info & 31, lane);
        };
#pragma unroll
        for (int st = 0; st < STAGES - 1; ++st) {
            if (st < my_n) issue(st);
            tc::cp_async_commit();
        }
        for (int i = 0; i < my_n; ++i) {
            tc::cp_async_wait<STAGES - 2>();
            __syncwarp();  // item i visible to the whole warp; everyone done with item i - 1's buffer
            if (i + STAGES - 1 < my_n) issue(i + STAGES - 1);
            tc::cp_async_commit();

            const int j = warp + WARPS * i;
            const int nvalid = list_info[j] & 31;
            const int row_lo = list_page[j] < 0 ? group : 0;  // the extra K/V is not seen by row 0
            const i64 e = list_page[j] >= 0 ? (i64)list_page[j] * num_kv_heads + h : -1;
            const uint4* kb = pages.tile(wbuf, i % STAGES, e, lane);
            const uint4* vb = kb + CHUNK_UNITS;

            // S = Q Kᵀ: two n-tiles of 8 tokens.
            float sc[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                const int tok = ((lane >> 4) << 3) + (lane & 7);
                const int unit = 2 * ks + ((lane >> 3) & 1);
                u32 b[4];
                tc::ldmatrix_x4(b, kb + tok * UPR + (unit ^ (tok & 7)));
                tc::mma16816<T>(sc[0], qf[ks], b[0], b[1]);
                tc::mma16816<T>(sc[1], qf[ks], b[2], b[3]);
            }

            // Mask, scale, online softmax (rows g: elements 0, 1; rows g + 8: elements 2, 3).
            float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int tok = nt * 8 + 2 * c + (e & 1);
                    const int qi = g + 8 * (e >> 1);
                    const bool ok = tok < nvalid && qi >= row_lo;
                    sc[nt][e] = ok ? sc[nt][e] * scale_log2 : neg_inf();
                    mx[e >> 1] = fmaxf(mx[e >> 1], sc[nt][e]);
                }
            }
            float alpha[2], mu[2];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
                mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
                const float m_new = fmaxf(m_r[hf], mx[hf]);
                mu[hf] = m_new == neg_inf() ? 0.f : m_new;  // nothing seen yet: p = alpha = 0
                alpha[hf] = exp2f(m_r[hf] - mu[hf]);
                m_r[hf] = m_new;
            }
            float psum[2] = {0.f, 0.f};
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    sc[nt][e] = exp2f(sc[nt][e] - mu[e >> 1]);
                    psum[e >> 1] += sc[nt][e];
                }
            }
            l_r[0] = l_r[0] * alpha[0] + psum[0];
            l_r[1] = l_r[1] * alpha[1] + psum[1];
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                o[nt][0] *= alpha[0];
                o[nt][1] *= alpha[0];
                o[nt][2] *= alpha[1];
                o[nt][3] *= alpha[1];
            }
            // P as the A operand (k = token): the two S n-tiles are its two k halves.
            u32 pa[4];
            pa[0] = tc::pack2<T>(sc[0][0], sc[0][1]);
            pa[1] = tc::pack2<T>(sc[0][2], sc[0][3]);
            pa[2] = tc::pack2<T>(sc[1][0], sc[1][1]);
            pa[3] = tc::pack2<T>(sc[1][2], sc[1][3]);
            // O += P V: V fragments transposed by ldmatrix, two n-tiles of 8 dims per load.
#pragma unroll
            for (int dn = 0; dn < D / 16; ++dn) {
                const int tok = (((lane >> 3) & 1) << 3) + (lane & 7);
                const int unit = 2 * dn + (lane >> 4);
                u32 b[4];
                tc::ldmatrix_x4_trans(b, vb + tok * UPR + (unit ^ (tok & 7)));
                tc::mma16816<T>(o[2 * dn], pa, b[0], b[1]);
                tc::mma16816<T>(o[2 * dn + 1], pa, b[2], b[3]);
            }
        }
        tc::cp_async_wait<0>();  // only empty groups can be left; keep the ring clean anyway
        __syncthreads();         // the list and the buffers are rewritten next
        if (last_round) break;
    }

    // ---- merge the warps' states (staging buffers reused: every warp passed the barrier above)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        l_r[hf] += __shfl_xor_sync(0xffffffffu, l_r[hf], 1);
        l_r[hf] += __shfl_xor_sync(0xffffffffu, l_r[hf], 2);
    }
    {
        float* ro = red_o + warp * 16 * OSTRIDE;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int x = nt * 8 + 2 * c;
            ro[g * OSTRIDE + x] = o[nt][0];
            ro[g * OSTRIDE + x + 1] = o[nt][1];
            ro[(g + 8) * OSTRIDE + x] = o[nt][2];
            ro[(g + 8) * OSTRIDE + x + 1] = o[nt][3];
        }
        if (c == 0) {
            red_m[warp * 16 + g] = m_r[0];
            red_m[warp * 16 + g + 8] = m_r[1];
            red_l[warp * 16 + g] = l_r[0];
            red_l[warp * 16 + g + 8] = l_r[1];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nq * D; e += THREADS) {
        const int qi = e / D;
        const int x = e - qi * D;
        float mw[WARPS];
        float mall = neg_inf();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            mw[w] = red_m[w * 16 + qi];
            mall = fmaxf(mall, mw[w]);
        }
        // A warp whose l is 0 saw nothing. One whose l is NaN saw a NaN score (its m may still be
        // -inf: fmaxf drops NaN); it is merged, so the NaN reaches the output.
        float l = 0.f, acc = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float lw = red_l[w * 16 + qi];
            if (lw == 0.f) continue;
            const float f = exp2f(mw[w] - mall);
            l += lw * f;
            acc += red_o[(w * 16 + qi) * OSTRIDE + x] * f;
        }
        const float ov = l != 0.f ? acc / l : 0.f;
        const int row = qi / group;
        const int hq = h * group + (qi - row * group);
        const i64 head = ((i64)s * num_rows + row) * num_qo_heads + hq;
        if (num_splits == 1) {
            out[head * D + x] = from_f32<T>(ov);
        } else {
            tmp_out[(head * num_splits + split) * D + x] = ov;
            if (x == 0) tmp_lse[head * num_splits + split] = l != 0.f ? (mall + log2f(l)) * 0.6931471805599453f : neg_inf();
        }
    }
}

}  // namespace oasis

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

#define OASIS_DECODE_ATTN_KV8_TC(NAME, T, D, STAGES)                                                  \
    extern "C" __global__ void __launch_bounds__(OASIS_TC_WARPS * 32)                                 \
        NAME(const __grid_constant__ oasis::DecodeAttnKv8Params<T> p) {                              \
        oasis::decode_attn_tc_impl<T, D, STAGES>(                                                     \
            p.q, oasis::TcKv8Pages<T, D, STAGES>{p.k_codes, p.v_codes, p.k_scales, p.v_scales},       \
            p.kv_indptr, p.kv_indices, p.kv_last_page_len, p.page_map, p.extra_k, p.extra_v, p.out,   \
            p.tmp_out, p.tmp_lse, p.num_rows, p.num_qo_heads, p.num_kv_heads, p.block_size,           \
            p.num_pages, p.nnz, p.num_splits, p.sm_scale);                                            \
    }

// Pipeline depth per head_dim: the bf16 kernel's (oasis_cuda::ops::decode_attn_tc_stages).
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tc_bf16_d64, oasis::bf16, 64, 4)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tc_bf16_d128, oasis::bf16, 128, 3)
OASIS_DECODE_ATTN_KV8_TC(decode_attn_kv8_tc_bf16_d256, oasis::bf16, 256, 2)
