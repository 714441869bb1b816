// score_blocks.cu — Quest block scores of the lookahead query, and per (sequence, KV head) top-k.
//
// CPU twins: oasis_core::kernels::score_blocks and oasis_core::kernels::topk_blocks.
#include "oasis_common.cuh"

// Threads per block of score_blocks_* (8 warps, one (block, head) score per warp). Arbitrary.
#define OASIS_SCORE_THREADS 256
// Threads per block of topk_blocks_f32, and the largest k it supports (the selected entries are
// sorted in shared memory: k rounded up to a power of two must fit the sort buffer).
#define OASIS_TOPK_THREADS 512
#define OASIS_MAX_TOPK 512

namespace oasis {

// Warp w scores entry (j, h) = (w / num_kv_heads, w % num_kv_heads):
//   sum over query heads g of KV head h, over d, of max(q[s,g,d] * min[b,h,d], q[s,g,d] * max[b,h,d])
// with b = blk_indices[j] and s the sequence whose CSR range holds j. An out-of-range block id
// scores -inf (never selected).
template <typename T>
__device__ void score_blocks_impl(
    const T* __restrict__ q,             // [num_seqs, num_qo_heads, head_dim] (the lookahead row)
    const T* __restrict__ summaries,     // [num_host_blocks, num_kv_heads, 2, head_dim]
    const int* __restrict__ blk_indptr,  // [num_seqs + 1]
    const int* __restrict__ blk_indices, // [nnz] host block of each logical block, logical order
    float* __restrict__ scores,          // [nnz, num_kv_heads]
    int num_seqs, int nnz, int num_qo_heads, int num_kv_heads, int head_dim, int num_host_blocks) {
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= (i64)nnz * num_kv_heads) return;  // warp-uniform
    const int j = (int)(w / num_kv_heads);
    const int h = (int)(w - (i64)j * num_kv_heads);
    // Largest s with blk_indptr[s] <= j: then j < blk_indptr[s + 1] (empty sequences are skipped).
    int lo = 0;
    int hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (blk_indptr[mid] <= j) lo = mid; else hi = mid - 1;
    }
    const int s = lo;
    const int b = blk_indices[j];
    if (b < 0 || b >= num_host_blocks) {
        if (lane == 0) scores[w] = neg_inf();
        return;
    }
    const int group = num_qo_heads / num_kv_heads;
    const T* mn = summaries + ((i64)b * num_kv_heads + h) * 2 * head_dim;
    const T* mx = mn + head_dim;
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
    if (lane == 0) scores[w] = acc;
}

// Order-preserving map of a score to an unsigned key (larger score, larger key). -0 and +0 are
// the same key (they compare equal in the CPU twin); NaN maps to the smallest key.
__device__ __forceinline__ u32 score_key(float f) {
    if (f != f) return 0u;
    if (f == 0.f) f = 0.f;
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Sort key of a selected entry: ascending order = descending score, then ascending index.
__device__ __forceinline__ u64 rank_key(u32 key, int i) { return ((u64)(~key) << 32) | (u32)i; }

// grid (num_seqs, num_kv_heads), OASIS_TOPK_THREADS threads. For each (s, h): the k best logical
// blocks of s (0-based within s) by score, best first, ties to the lower index, -1 padding.
// Radix select (4 passes of 8 bits) finds the k-th largest key T; entries above T are taken in
// any order and entries equal to T in index order until k are taken; a bitonic sort orders them.
__device__ void topk_blocks_impl(
    const float* __restrict__ scores,   // [nnz, num_kv_heads]
    const int* __restrict__ blk_indptr, // [num_seqs + 1]
    int* __restrict__ out,              // [num_seqs, num_kv_heads, k]
    int num_kv_heads, int k) {
    __shared__ int hist[256];
    __shared__ u64 sel[OASIS_MAX_TOPK];
    __shared__ int scan_scratch[33];
    __shared__ u32 s_prefix;
    __shared__ int s_remaining;
    __shared__ int s_count;

    const int s = blockIdx.x;
    const int h = blockIdx.y;
    const int base = blk_indptr[s];
    const int n = blk_indptr[s + 1] - base;
    const float* col = scores + (i64)base * num_kv_heads + h;  // entry i at col[i * num_kv_heads]
    const int take = min(n, k);
    const int sort_n = next_pow2(take < 1 ? 1 : take);

    for (int i = threadIdx.x; i < sort_n; i += blockDim.x) sel[i] = ~0ull;
    __syncthreads();

    if (n <= k) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) sel[i] = rank_key(score_key(col[(i64)i * num_kv_heads]), i);
    } else {
        u32 prefix = 0;
        u32 mask = 0;
        int remaining = k;  // how many of the entries matching prefix/mask are still to be taken
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const u32 key = score_key(col[(i64)i * num_kv_heads]);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                int above = 0;
                int bin = 255;
                for (; bin > 0; --bin) {
                    if (above + hist[bin] >= remaining) break;
                    above += hist[bin];
                }
                s_prefix = prefix | ((u32)bin << shift);
                s_remaining = remaining - above;
            }
            __syncthreads();
            prefix = s_prefix;
            remaining = s_remaining;
            mask |= 255u << shift;
            __syncthreads();
        }
        // prefix is now the k-th largest key; `remaining` entries equal to it are taken.
        const u32 kth = prefix;
        const int n_above = k - remaining;
        if (threadIdx.x == 0) s_count = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const u32 key = score_key(col[(i64)i * num_kv_heads]);
            if (key > kth) sel[atomicAdd(&s_count, 1)] = rank_key(key, i);
        }
        // Ties at the threshold: the lowest indices first (ordered compaction, chunk by chunk).
        int taken = 0;
        for (int c0 = 0; c0 < n && taken < remaining; c0 += blockDim.x) {
            const int i = c0 + threadIdx.x;
            const int flag = (i < n && score_key(col[(i64)i * num_kv_heads]) == kth) ? 1 : 0;
            int total;
            const int pos = taken + block_exclusive_scan(flag, scan_scratch, &total);
            if (flag && pos < remaining) sel[n_above + pos] = rank_key(kth, i);
            taken += total;
        }
    }
    __syncthreads();
    block_bitonic_sort(sel, sort_n);
    int* dst = out + ((i64)s * num_kv_heads + h) * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) dst[i] = i < take ? (int)(u32)(sel[i] & 0xffffffffull) : -1;
}

}  // namespace oasis

#define OASIS_SCORE_BLOCKS(NAME, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(OASIS_SCORE_THREADS)                                 \
        NAME(const T* q, const T* summaries, const int* blk_indptr, const int* blk_indices, float* scores, \
             int num_seqs, int nnz, int num_qo_heads, int num_kv_heads, int head_dim, int num_host_blocks) { \
        oasis::score_blocks_impl<T>(q, summaries, blk_indptr, blk_indices, scores, num_seqs, nnz,    \
                                    num_qo_heads, num_kv_heads, head_dim, num_host_blocks);           \
    }

OASIS_SCORE_BLOCKS(score_blocks_bf16, oasis::bf16)
OASIS_SCORE_BLOCKS(score_blocks_f16, oasis::f16)
OASIS_SCORE_BLOCKS(score_blocks_f32, float)

extern "C" __global__ void __launch_bounds__(OASIS_TOPK_THREADS)
    topk_blocks_f32(const float* scores, const int* blk_indptr, int* out, int num_kv_heads, int k) {
    oasis::topk_blocks_impl(scores, blk_indptr, out, num_kv_heads, k);
}
