// oasis_topk.cuh — the two-stage score's last top-K (topk_candidates_core, and
// topk_candidates_impl with dynamic buffers) and the order of
// scores every top-K kernel shares (score_key, rank_key). Included by score_blocks.cu
// (topk_candidates_f32, the top-K alone) and key_codes.cu (rescore_topk_codes_*, the codes score
// of the candidates and this top-K in one launch), so that both run the same selection.
//
// CPU twin: oasis_core::kernels::topk_candidates. Include it after oasis_common.cuh (it uses its
// helpers; it includes nothing itself, so that experiments/exp_score.py can inline the headers).
#pragma once

namespace oasis {

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

// Largest row of topk_candidates_f32: m candidates plus the appended successors.
// oasis_core::limits::MAX_CANDIDATES, defined by oasis_cuda::nvrtc::compile_options.
#ifndef OASIS_CAND_MAX
#error "OASIS_CAND_MAX is undefined: compile through oasis_cuda::nvrtc (-DOASIS_CAND_MAX=...)"
#endif

// grid (num_seqs, num_kv_heads), any multiple of 32 threads (the result does not depend on it);
// m + successors <= OASIS_CAND_MAX. The thread block (s, h) = (blockIdx.x, blockIdx.y) reads the
// scores of its m candidates at scores[i * stride]: topk_candidates_f32 passes its row of the
// [num_seqs * m, num_kv_heads] scores, rescore_topk_codes_* the scores it left in shared memory.
// The two-stage score's last step (CPU twin: oasis_core::kernels::topk_candidates): the
// successors of the `successors` best candidates by score, the forced blocks at +inf, the
// successors that are no candidates appended at +inf, then the k best as their blocks.
// One sort (the candidates by their own scores) serves both the successors' sources and the
// result, which is that order merged: the twin's sort of the m + successors entries puts the +inf
// candidates first (by position), then the fresh successors (positions m + a), then the other
// candidates in sorted order, with the successor slots that are no blocks (-inf, output -1) ahead
// of the NaN scores only. Three block scans place them (a second sort cost the H200 ~6 us).
__device__ void topk_candidates_core(
    const float* scores,                // entry i of this (s, h) at scores[i * stride]; global or shared
    int stride,
    const int* __restrict__ cand,       // [num_seqs, num_kv_heads, m]; < 0: none
    const int* __restrict__ blk_indptr, // [num_seqs + 1]: the requests' rows (successors stay inside)
    const int* __restrict__ forced,     // [num_seqs, num_kv_heads, n_forced], or null
    int* __restrict__ out,              // [num_seqs, num_kv_heads, k]
    int num_kv_heads, int nnz, int m, int k, int successors, int n_forced,
    // Shared memory: sel [next_pow2(max(1, m))], keys and res [m + successors], vals [m], succ
    // [successors], scan_scratch [33].
    u64* sel, u32* keys, int* vals, int* succ, int* res, int* scan_scratch) {
    const int s = blockIdx.x;
    const int h = blockIdx.y;
    int base;
    int end;
    csr_row(blk_indptr, s, nnz, &base, &end);
    const int row_len = end - base;
    const i64 row = (i64)s * num_kv_heads + h;
    const int* cs = cand + row * m;
    const int width = m + successors;
    const u32 key_inf = score_key(__int_as_float(0x7f800000));
    const u32 key_ninf = score_key(__int_as_float(0xff800000));
    const int sort_n = next_pow2(max(1, m));
    for (int i = threadIdx.x; i < sort_n; i += blockDim.x) {
        if (i < m) {
            keys[i] = score_key(scores[(i64)i * stride]);
            vals[i] = cs[i];
            sel[i] = rank_key(keys[i], i);
        } else {
            sel[i] = ~0ull;
        }
    }
    __syncthreads();
    if (m <= (int)blockDim.x) {
        block_rank_sort(sel, m);
    } else {
        block_bitonic_sort(sel, sort_n);
    }
    __syncthreads();
    // The successors of the best candidates by their own scores (before any forcing).
    for (int a = threadIdx.x; a < successors; a += blockDim.x) {
        const int v = a < m ? vals[(int)(u32)(sel[a] & 0xffffffffull)] : -1;
        succ[a] = (v >= 0 && v + 1 < row_len) ? v + 1 : -1;
        keys[m + a] = 0u;  // set below when the successor is a candidate (the slot is unused else)
    }
    __syncthreads();
    // A candidate that is a successor or forced goes to +inf; a successor that is a candidate is
    // no block of its own (candidates are distinct, so one writer per successor).
    const int* fs = forced != nullptr ? forced + row * n_forced : nullptr;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
        const int v = vals[i];
        if (v < 0) continue;
        bool hit = false;
        for (int a = 0; a < successors; ++a) {
            if (succ[a] == v) {  // successors are distinct (their sources are): at most one
                hit = true;
                keys[m + a] = 1u;
                break;
            }
        }
        for (int f = 0; f < n_forced && !hit; ++f) hit = fs[f] == v;
        if (hit) keys[i] = key_inf;
    }
    for (int i = threadIdx.x; i < width; i += blockDim.x) res[i] = -1;
    __syncthreads();
    // +inf candidates by position, then the fresh successors by position.
    int n_inf = 0;
    for (int c0 = 0; c0 < m; c0 += blockDim.x) {
        const int i = c0 + threadIdx.x;
        const int flag = (i < m && keys[i] == key_inf) ? 1 : 0;
        int total;
        const int pos = n_inf + block_exclusive_scan(flag, scan_scratch, &total);
        if (flag) res[pos] = vals[i];
        n_inf += total;
    }
    int n_fresh = 0;
    for (int c0 = 0; c0 < successors; c0 += blockDim.x) {
        const int a = c0 + threadIdx.x;
        const int flag = (a < successors && succ[a] >= 0 && keys[m + a] == 0u) ? 1 : 0;
        int total;
        const int pos = n_inf + n_fresh + block_exclusive_scan(flag, scan_scratch, &total);
        if (flag) res[pos] = succ[a];
        n_fresh += total;
    }
    // The other candidates in sorted order; the empty successor slots (already -1 in res) sit
    // between the numbers and the NaN scores.
    const int n_empty = successors - n_fresh;
    int n_rest = 0;
    for (int c0 = 0; c0 < m; c0 += blockDim.x) {
        const int j = c0 + threadIdx.x;
        const int i = j < m ? (int)(u32)(sel[j] & 0xffffffffull) : 0;
        const int flag = (j < m && keys[i] != key_inf) ? 1 : 0;
        int total;
        const int p = n_rest + block_exclusive_scan(flag, scan_scratch, &total);
        if (flag) res[n_inf + n_fresh + p + (keys[i] < key_ninf ? n_empty : 0)] = vals[i];
        n_rest += total;
    }
    __syncthreads();
    const int take = min(k, width);
    int* dst = out + row * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) dst[i] = i < take ? res[i] : -1;
}

// topk_candidates_core with its buffers in dynamic shared memory, topk_candidates_bytes(m,
// successors) of it in that function's order (sel, keys, vals, succ, res, scan_scratch):
// topk_candidates_f32. Sized to the row rather than to OASIS_CAND_MAX, so that the launch (on a
// background stream, beside the step's GEMMs and attention) holds no more of an SM than it uses.
__device__ void topk_candidates_impl(
    const float* scores, int stride, const int* __restrict__ cand, const int* __restrict__ blk_indptr,
    const int* __restrict__ forced, int* __restrict__ out, int num_kv_heads, int nnz, int m, int k, int successors,
    int n_forced) {
    extern __shared__ __align__(16) unsigned char topk_smem[];
    const int sort_n = next_pow2(max(1, m));
    u64* sel = reinterpret_cast<u64*>(topk_smem);   // [sort_n]
    u32* keys = reinterpret_cast<u32*>(sel + sort_n);  // [m + successors]
    int* vals = reinterpret_cast<int*>(keys + m + successors);  // [m]
    int* succ = vals + m;                              // [successors]
    int* res = succ + successors;                      // [m + successors]
    int* scan_scratch = res + m + successors;          // [33]
    topk_candidates_core(scores, stride, cand, blk_indptr, forced, out, num_kv_heads, nnz, m, k, successors, n_forced,
                         sel, keys, vals, succ, res, scan_scratch);
}

// Bytes of topk_candidates_core's buffers for m candidates and `successors`, as
// rescore_topk_codes_impl (cuda/key_codes.cu) lays them out in its dynamic shared memory
// (oasis_cuda::ops::rescore_topk_codes_smem_bytes counts them the same way).
__host__ __device__ __forceinline__ int topk_candidates_bytes(int m, int successors) {
    int p = 1;
    while (p < m) p <<= 1;
    return 8 * p + 4 * (2 * (m + successors) + m + successors + 33);
}

}  // namespace oasis
