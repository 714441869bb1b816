// append_kv.cu — append one decoded token per sequence (with write-through to the host pool and
// an incremental summary update) and rebuild block summaries.
//
// CPU twins: oasis_core::kernels::append_kv and oasis_core::kernels::build_summaries.
// Host rows and block ids: host_k/host_v are indexed by host rows, the summaries by host block ids
// (a staged request's block may have an id, and a summary, but no row). A null row table means
// row = id (both pools indexed alike).
// Table entries out of range are skipped here (the wrappers cannot read device tables without a
// host synchronisation); the CPU twins reject them. Two sequences naming the same slot race.
#include "oasis_common.cuh"
#include "oasis_params.cuh"

namespace oasis {

// grid (num_seqs, num_kv_heads); any block size, threads stride over head_dim.
template <typename T>
__device__ void append_kv_impl(
    const T* __restrict__ k_new,            // [num_seqs, num_kv_heads, head_dim]
    const T* __restrict__ v_new,            // [num_seqs, num_kv_heads, head_dim]
    const int* __restrict__ page_ids,       // [num_seqs]
    const int* __restrict__ page_offsets,   // [num_seqs] 0..block_size
    const int* __restrict__ host_block_ids, // [num_seqs] < 0 = dense (no write-through)
    const int* __restrict__ host_rows,      // [num_seqs] host row of the write-through; null: the id
    T* __restrict__ k_pages,                // [num_pages, num_kv_heads, block_size, head_dim]
    T* __restrict__ v_pages,                // [num_pages, num_kv_heads, block_size, head_dim]
    T* __restrict__ host_k,                 // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host, UVA
    T* __restrict__ host_v,                 // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host, UVA
    T* __restrict__ summaries,              // [num_host_blocks, num_kv_heads, 2, head_dim] row 0 min, row 1 max
    int num_kv_heads, int head_dim, int block_size, int num_pages, int num_host_blocks,
    int num_host_rows) {
    const int s = blockIdx.x;
    const int h = blockIdx.y;
    const int page = page_ids[s];
    const int off = page_offsets[s];
    if (page < 0 || page >= num_pages || off < 0 || off >= block_size) return;
    const int blk = host_block_ids[s];
    const int hrow = host_rows != nullptr ? host_rows[s] : blk;
    const bool write_through = blk >= 0 && blk < num_host_blocks && hrow >= 0 && hrow < num_host_rows;

    const i64 src = ((i64)s * num_kv_heads + h) * head_dim;
    const i64 entry = (i64)block_size * head_dim;
    const i64 dst = ((i64)page * num_kv_heads + h) * entry + (i64)off * head_dim;
    const i64 hdst = ((i64)hrow * num_kv_heads + h) * entry + (i64)off * head_dim;
    const i64 sum = ((i64)blk * num_kv_heads + h) * 2 * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        const T k = k_new[src + d];
        const T v = v_new[src + d];
        k_pages[dst + d] = k;
        v_pages[dst + d] = v;
        if (!write_through) continue;
        host_k[hdst + d] = k;
        host_v[hdst + d] = v;
        if (off == 0) {
            summaries[sum + d] = k;
            summaries[sum + head_dim + d] = k;
        } else {
            const float kf = to_f32(k);
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
                                 p.host_rows, p.k_pages, p.v_pages, p.host_k, p.host_v, p.summaries, \
                                 p.num_kv_heads, p.head_dim, p.block_size, p.num_pages,              \
                                 p.num_host_blocks, p.num_host_rows);                                \
    }

OASIS_APPEND_KV(append_kv_bf16, oasis::bf16)
OASIS_APPEND_KV(append_kv_f16, oasis::f16)
OASIS_APPEND_KV(append_kv_f32, float)

#define OASIS_BUILD_SUMMARIES(NAME, T)                                                               \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::BuildSummariesParams<T> p) {      \
        oasis::build_summaries_impl<T>(p.host_k, p.block_ids, p.block_rows, p.block_lens,           \
                                       p.summaries, p.num_kv_heads, p.head_dim, p.block_size,        \
                                       p.num_host_blocks, p.num_host_rows);                          \
    }

OASIS_BUILD_SUMMARIES(build_summaries_bf16, oasis::bf16)
OASIS_BUILD_SUMMARIES(build_summaries_f16, oasis::f16)
OASIS_BUILD_SUMMARIES(build_summaries_f32, float)
