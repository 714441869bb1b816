// append_kv.cu — append one decoded token per sequence (with write-through to the host pool and
// an incremental summary update) and rebuild block summaries.
//
// CPU twins: oasis_core::kernels::append_kv (append_kv_tiers for the kv8 variants
// append_kv_<gpu tier>_<host tier>_<dtype>, each tier `elem` (T pages) or `kv8`) and
// oasis_core::kernels::build_summaries.
// Host rows and block ids: host_k/host_v are indexed by host rows, the summaries by host block ids
// (a staged request's block may have an id, and a summary, but no row). A null row table means
// row = id (both pools indexed alike).
// Table entries out of range are skipped here (the wrappers cannot read device tables without a
// host synchronisation); the CPU twins reject them. Two sequences naming the same slot race.
#include "oasis_common.cuh"
#include "oasis_params.cuh"

namespace oasis {

// One token's row `x` (head_dim) into entry `e` = page * num_kv_heads + head of a tier, at row
// `off`: a copy into T pages; into kv8 pages the incremental append of oasis_core::kernels::kv8
// (scale from the row's finite absmax; when it grows past the stored one, rows 0..off are first
// requantized by 2^max(e_old - e_new, -24); the scale never shrinks within a block). Block-
// cooperative: every thread calls it with the same arguments (`red`: 32 floats of shared memory).
template <typename T>
__device__ __forceinline__ void append_row(ElemTier<T> t, i64 e, int off, const T* __restrict__ k,
                                           const T* __restrict__ v, int d, int bs, float*) {
    const i64 at = e * bs * d + (i64)off * d;
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        t.k[at + x] = k[x];
        t.v[at + x] = v[x];
    }
}

// Words of codes each thread keeps in flight in requant_codes: one round trip requantizes rows
// 0..off of a 32 x 128 entry with 128 threads (4 KiB). Arbitrary beyond that.
#define OASIS_REQUANT_UNROLL 8

// The scale growth's requantization of the `n` codes before the new row (rows 0..off, `d` per
// row), each times `f`. Block-cooperative; every load of a chunk is issued before the first
// store: a host tier is read over PCIe, so one round trip per OASIS_REQUANT_UNROLL words per
// thread, not one per word.
__device__ __forceinline__ void requant_codes(unsigned char* __restrict__ codes, int n, int d, float f) {
    if ((d & 3) == 0 && ((u64)codes & 3) == 0) {  // four codes per access where the rows allow it
        u32* w = (u32*)codes;
        const int nw = n / 4;
        for (int base = 0; base < nw; base += OASIS_REQUANT_UNROLL * blockDim.x) {
            u32 c[OASIS_REQUANT_UNROLL];
#pragma unroll
            for (int u = 0; u < OASIS_REQUANT_UNROLL; ++u) {
                const int i = base + u * blockDim.x + threadIdx.x;
                if (i < nw) c[u] = w[i];
            }
#pragma unroll
            for (int u = 0; u < OASIS_REQUANT_UNROLL; ++u) {
                const int i = base + u * blockDim.x + threadIdx.x;
                if (i >= nw) continue;
                u32 r = 0;
#pragma unroll
                for (int b = 0; b < 4; ++b) r |= e4m3_rne(__fmul_rn(e4m3_decode((c[u] >> (8 * b)) & 0xffu), f)) << (8 * b);
                w[i] = r;
            }
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) codes[i] = (unsigned char)e4m3_rne(__fmul_rn(e4m3_decode(codes[i]), f));
    }
}

// The incremental kv8 append of row `off` of one array's entry (`codes`, `scale`), given the
// entry's current scale `old` (read by the caller: see append_row for why; unused when off == 0).
template <typename T>
__device__ void append_row_kv8(unsigned char* __restrict__ codes, float* __restrict__ scale, float old, int off,
                               const T* __restrict__ x, int d, float* red) {
    float m = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) m = fmaxf(m, finite_abs(to_f32(x[i])));
    const int e_row = kv8_exponent(block_max(m, red));
    int e = e_row;
    if (off > 0) {
        const int e_old = kv8_scale_exponent(old);
        if (e_row > e_old) {
            const int shift = e_old - e_row;
            requant_codes(codes, off * d, d,
                          exp2i(shift < OASIS_KV8_REQUANT_MIN_SHIFT ? OASIS_KV8_REQUANT_MIN_SHIFT : shift));
        } else {
            e = e_old;
        }
    }
    __syncthreads();  // every thread has used the old scale before thread 0 rewrites it
    const float inv = exp2i(-e);
    unsigned char* row = codes + (i64)off * d;
    if ((d & 3) == 0 && ((u64)row & 3) == 0) {
        for (int i = threadIdx.x; i < d / 4; i += blockDim.x) {
            u32 r = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) r |= e4m3_rne(__fmul_rn(to_f32(x[4 * i + b]), inv)) << (8 * b);
            ((u32*)row)[i] = r;
        }
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) row[i] = (unsigned char)e4m3_rne(__fmul_rn(to_f32(x[i]), inv));
    }
    if (threadIdx.x == 0) *scale = exp2i(e);
}

// The K and V scales are read together, before either row's maximum: for the host tier (pinned,
// over PCIe) one round trip where reading each where it is used took two, in sequence.
template <typename T>
__device__ __forceinline__ void append_row(Kv8Tier t, i64 e, int off, const T* __restrict__ k, const T* __restrict__ v,
                                           int d, int bs, float* red) {
    float sk = 0.f;
    float sv = 0.f;
    if (off > 0) {
        sk = t.ks[e];
        sv = t.vs[e];
    }
    append_row_kv8<T>(t.k + e * bs * d, t.ks + e, sk, off, k, d, red);
    append_row_kv8<T>(t.v + e * bs * d, t.vs + e, sv, off, v, d, red);
}

// grid (num_seqs, num_kv_heads); blockDim.x a multiple of 32, threads stride over head_dim. One
// block per (sequence, KV head) owns that (page, head) entry of each tier: the kv8 scale update
// and requantization need no atomics. G, H: the GPU and the host tier (ElemTier<T> or Kv8Tier).
template <typename T, typename G, typename H>
__device__ void append_kv_impl(
    const T* __restrict__ k_new,            // [num_seqs, num_kv_heads, head_dim]
    const T* __restrict__ v_new,            // [num_seqs, num_kv_heads, head_dim]
    const int* __restrict__ page_ids,       // [num_seqs]
    const int* __restrict__ page_offsets,   // [num_seqs] 0..block_size
    const int* __restrict__ host_block_ids, // [num_seqs] < 0 = dense (no write-through)
    const int* __restrict__ host_rows,      // [num_seqs] host row of the write-through; null: the id
    G gpu,                                  // [num_pages, num_kv_heads, block_size, head_dim]
    H host,                                 // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host, UVA
    T* __restrict__ summaries,              // [num_host_blocks, num_kv_heads, 2, head_dim] row 0 min, row 1 max
    int num_kv_heads, int head_dim, int block_size, int num_pages, int num_host_blocks,
    int num_host_rows) {
    __shared__ float red[32];
    const int s = blockIdx.x;
    const int h = blockIdx.y;
    const int page = page_ids[s];
    const int off = page_offsets[s];
    if (page < 0 || page >= num_pages || off < 0 || off >= block_size) return;  // block-uniform
    const int blk = host_block_ids[s];
    const int hrow = host_rows != nullptr ? host_rows[s] : blk;
    const bool write_through = blk >= 0 && blk < num_host_blocks && hrow >= 0 && hrow < num_host_rows;

    const T* k = k_new + ((i64)s * num_kv_heads + h) * head_dim;
    const T* v = v_new + ((i64)s * num_kv_heads + h) * head_dim;
    append_row<T>(gpu, (i64)page * num_kv_heads + h, off, k, v, head_dim, block_size, red);
    if (!write_through) return;  // block-uniform
    append_row<T>(host, (i64)hrow * num_kv_heads + h, off, k, v, head_dim, block_size, red);
    // The summary comes from the unquantized row, whatever the tiers.
    const i64 sum = ((i64)blk * num_kv_heads + h) * 2 * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        const T kx = k[d];
        if (off == 0) {
            summaries[sum + d] = kx;
            summaries[sum + head_dim + d] = kx;
        } else {
            const float kf = to_f32(kx);
            summaries[sum + d] = from_f32<T>(fminf(to_f32(summaries[sum + d]), kf));
            summaries[sum + head_dim + d] = from_f32<T>(fmaxf(to_f32(summaries[sum + head_dim + d]), kf));
        }
    }
}

// grid (n, num_kv_heads); any block size, threads stride over head_dim and walk the tokens.
template <typename T>
__device__ void build_summaries_impl(
    const T* __restrict__ host_k,       // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host (UVA) or device
    const int* __restrict__ block_ids,  // [n]
    const int* __restrict__ block_rows, // [n] host row of each block; null: the id
    const int* __restrict__ block_lens, // [n] 1..=block_size
    T* __restrict__ summaries,          // [num_host_blocks, num_kv_heads, 2, head_dim]
    int num_kv_heads, int head_dim, int block_size, int num_host_blocks, int num_host_rows) {
    const int i = blockIdx.x;
    const int h = blockIdx.y;
    const int blk = block_ids[i];
    const int row = block_rows != nullptr ? block_rows[i] : blk;
    const int len = block_lens[i];
    if (blk < 0 || blk >= num_host_blocks || row < 0 || row >= num_host_rows || len < 1 || len > block_size) return;
    const T* keys = host_k + ((i64)row * num_kv_heads + h) * block_size * head_dim;
    const i64 sum = ((i64)blk * num_kv_heads + h) * 2 * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float mn = to_f32(keys[d]);
        float mx = mn;
        for (int t = 1; t < len; ++t) {
            const float x = to_f32(keys[(i64)t * head_dim + d]);
            mn = fminf(mn, x);
            mx = fmaxf(mx, x);
        }
        // Min and max of values of T are values of T: the round trip is exact.
        summaries[sum + d] = from_f32<T>(mn);
        summaries[sum + head_dim + d] = from_f32<T>(mx);
    }
}

}  // namespace oasis

// Entry points: one parameter struct each (cuda/oasis_params.cuh), unpacked into the impls.
#define OASIS_APPEND_KV(NAME, T)                                                                     \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::AppendKvParams<T> p) {            \
        oasis::append_kv_impl<T>(p.k_new, p.v_new, p.page_ids, p.page_offsets, p.host_block_ids,    \
                                 p.host_rows, oasis::ElemTier<T>{p.k_pages, p.v_pages},             \
                                 oasis::ElemTier<T>{p.host_k, p.host_v}, p.summaries,               \
                                 p.num_kv_heads, p.head_dim, p.block_size, p.num_pages,              \
                                 p.num_host_blocks, p.num_host_rows);                                \
    }

OASIS_APPEND_KV(append_kv_bf16, oasis::bf16)
OASIS_APPEND_KV(append_kv_f16, oasis::f16)
OASIS_APPEND_KV(append_kv_f32, float)

// kv8 tiers (oasis_core::kernels::append_kv_tiers): G, H = the GPU and host tier types.
#define OASIS_APPEND_KV_TIERS(NAME, T, G, H)                                                         \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::AppendKvTiersParams<T> p) {       \
        oasis::append_kv_impl<T>(p.k_new, p.v_new, p.page_ids, p.page_offsets, p.host_block_ids,    \
                                 p.host_rows, G::from(p.k_pages, p.v_pages, p.k_scales, p.v_scales), \
                                 H::from(p.host_k, p.host_v, p.host_k_scales, p.host_v_scales),     \
                                 p.summaries, p.num_kv_heads, p.head_dim, p.block_size,              \
                                 p.num_pages, p.num_host_blocks, p.num_host_rows);                   \
    }
OASIS_APPEND_KV_TIERS(append_kv_kv8_kv8_bf16, oasis::bf16, oasis::Kv8Tier, oasis::Kv8Tier)
OASIS_APPEND_KV_TIERS(append_kv_elem_kv8_bf16, oasis::bf16, oasis::ElemTier<oasis::bf16>, oasis::Kv8Tier)
OASIS_APPEND_KV_TIERS(append_kv_kv8_elem_bf16, oasis::bf16, oasis::Kv8Tier, oasis::ElemTier<oasis::bf16>)
OASIS_APPEND_KV_TIERS(append_kv_kv8_kv8_f16, oasis::f16, oasis::Kv8Tier, oasis::Kv8Tier)
OASIS_APPEND_KV_TIERS(append_kv_elem_kv8_f16, oasis::f16, oasis::ElemTier<oasis::f16>, oasis::Kv8Tier)
OASIS_APPEND_KV_TIERS(append_kv_kv8_elem_f16, oasis::f16, oasis::Kv8Tier, oasis::ElemTier<oasis::f16>)
OASIS_APPEND_KV_TIERS(append_kv_kv8_kv8_f32, float, oasis::Kv8Tier, oasis::Kv8Tier)
OASIS_APPEND_KV_TIERS(append_kv_elem_kv8_f32, float, oasis::ElemTier<float>, oasis::Kv8Tier)
OASIS_APPEND_KV_TIERS(append_kv_kv8_elem_f32, float, oasis::Kv8Tier, oasis::ElemTier<float>)

#define OASIS_BUILD_SUMMARIES(NAME, T)                                                               \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::BuildSummariesParams<T> p) {      \
        oasis::build_summaries_impl<T>(p.host_k, p.block_ids, p.block_rows, p.block_lens,           \
                                       p.summaries, p.num_kv_heads, p.head_dim, p.block_size,        \
                                       p.num_host_blocks, p.num_host_rows);                          \
    }

OASIS_BUILD_SUMMARIES(build_summaries_bf16, oasis::bf16)
OASIS_BUILD_SUMMARIES(build_summaries_f16, oasis::f16)
OASIS_BUILD_SUMMARIES(build_summaries_f32, float)
