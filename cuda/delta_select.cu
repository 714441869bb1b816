// delta_select.cu — delta selection with capped eviction, one thread block per (sequence, KV head).
//
// CPU twin: oasis_core::kernels::delta_select. The five steps, per (s, h), over the sequence's
// `budget` slots (slot i lives in GPU page slot_pages[s, i]; its entry is page_map[page, h]):
//  1. S = predicted[s, h, :] without negative entries (distinct logical blocks, best first).
//  2. Every slot whose block is in S: page_last_selected[page, h] = step (kept, no traffic).
//  3. missing = blocks of S not resident, in prediction order.
//  4. victims = slots whose block is not in S, ordered by (occupied, page_last_selected, slot):
//     empty slots (< 0) first, each class by ascending page_last_selected, ties by slot index.
// Stats per (s, h): pairs = n, kept = distinct blocks of S already resident, missing =
// len(missing) before the cap.
//  5. n = min(len(missing), len(victims), fetch_cap); for i < n: page_map[victim_i page, h] =
//     missing[i], page_last_selected = step, plan_slots[s,h,i] = victim slot, plan_blocks[s,h,i] =
//     missing[i]. Remaining plan entries = -1.
// Membership tests use sorted copies in shared memory (binary search), orders use bitonic sorts
// and an ordered compaction. A duplicate in `predicted` counts once (its first position); a slot
// whose page is out of range takes no part (neither kept nor victim).
#include "oasis_common.cuh"

// Threads per block of delta_select_i32. Arbitrary (a multiple of 32, at most 1024).
#define OASIS_SELECT_THREADS 256
// Largest budget (slots per sequence) the kernel supports: slot indices are packed in 16 bits of
// the victim sort key, and shared memory grows as 20 bytes per slot. Arbitrary below 65536.
#define OASIS_MAX_SELECT_BUDGET 4096

namespace oasis {

__device__ __forceinline__ bool sorted_contains_i32(const int* a, int n, int v) {
    int lo = 0;
    int hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (a[mid] < v) lo = mid + 1; else hi = mid;
    }
    return lo < n && a[lo] == v;
}

// S pairs are sorted as (block << 32 | position), padding ~0 last: search by block in the high
// half, compared unsigned so that the padding stays above every block.
__device__ __forceinline__ bool sorted_contains_block(const u64* a, int n, int v) {
    const u32 key = (u32)v;
    int lo = 0;
    int hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if ((u32)(a[mid] >> 32) < key) lo = mid + 1; else hi = mid;
    }
    return lo < n && a[lo] != ~0ull && (u32)(a[lo] >> 32) == key;
}

// slot_state[i] first holds the block the slot holds (-1 empty, OASIS_NO_SLOT when its page is out
// of range), then one of the OASIS_STATE_* codes.
#define OASIS_NO_SLOT (-2147483647 - 1)
#define OASIS_STATE_NONE 0
#define OASIS_STATE_KEPT 1
#define OASIS_STATE_VICTIM_EMPTY 2
#define OASIS_STATE_VICTIM 3

// grid (num_seqs, num_kv_heads), OASIS_SELECT_THREADS threads; dynamic shared memory
// 8*B2 + 4*B2 + 4*budget + 4*P2 bytes with B2 = next_pow2(budget), P2 = next_pow2(num_pred)
// (the Rust wrapper computes the same: oasis_cuda::ops::delta_select_smem_bytes).
__device__ void delta_select_impl(
    const int* __restrict__ predicted,    // [num_seqs, num_kv_heads, num_pred] logical blocks, best first, < 0 = none
    const int* __restrict__ slot_pages,   // [num_seqs, budget] GPU page of each slot
    int* __restrict__ page_map,           // [num_pages, num_kv_heads] logical block held, < 0 = empty
    int* __restrict__ page_last_selected, // [num_pages, num_kv_heads] step last selected
    int* __restrict__ plan_slots,         // [num_seqs, num_kv_heads, fetch_cap] victim slot or -1
    int* __restrict__ plan_blocks,        // [num_seqs, num_kv_heads, fetch_cap] missing block or -1
    int* __restrict__ stats,              // [num_seqs, num_kv_heads, 3] (pairs, kept, missing) or null
    int num_kv_heads, int num_pred, int budget, int num_pages, int step, int fetch_cap) {
    extern __shared__ u64 smem_u64[];
    __shared__ int scan_scratch[33];
    __shared__ int s_kept;
    __shared__ int s_victims;

    const int s = blockIdx.x;
    const int h = blockIdx.y;
    const int b2 = next_pow2(budget < 1 ? 1 : budget);
    const int p2 = next_pow2(num_pred < 1 ? 1 : num_pred);
    u64* sorted = smem_u64;                  // [b2]: S pairs, later victim keys
    int* resident = (int*)(sorted + b2);     // [b2]: sorted resident blocks, later the missing list
    int* slot_state = resident + b2;         // [budget]: block held, then OASIS_STATE_*
    int* miss_flag = slot_state + budget;    // [p2]: 1 where S[p] is a first occurrence not resident

    const int* pred = predicted + ((i64)s * num_kv_heads + h) * num_pred;
    const int* pages = slot_pages + (i64)s * budget;
    if (threadIdx.x == 0) {
        s_kept = 0;
        s_victims = 0;
    }

    // Resident blocks of this head, and S as (block, position) pairs; both sorted.
    for (int i = threadIdx.x; i < b2; i += blockDim.x) {
        int blk = 0x7fffffff;
        if (i < budget) {
            const int page = pages[i];
            const bool ok = page >= 0 && page < num_pages;
            const int held = ok ? page_map[(i64)page * num_kv_heads + h] : -1;
            slot_state[i] = ok ? (held < 0 ? -1 : held) : OASIS_NO_SLOT;
            if (ok && held >= 0) blk = held;
        }
        resident[i] = blk;
    }
    for (int i = threadIdx.x; i < p2; i += blockDim.x) {
        const int v = i < num_pred ? pred[i] : -1;
        sorted[i] = v >= 0 ? (((u64)(u32)v << 32) | (u32)i) : ~0ull;
        miss_flag[i] = 0;
    }
    __syncthreads();
    block_bitonic_sort(resident, b2);
    block_bitonic_sort(sorted, p2);

    // Step 3 (flags): first occurrences of S not resident; the resident ones are kept.
    for (int i = threadIdx.x; i < p2; i += blockDim.x) {
        const u64 key = sorted[i];
        if (key == ~0ull) continue;
        const int v = (int)(key >> 32);
        if (i > 0 && (int)(sorted[i - 1] >> 32) == v) continue;  // a duplicate: counted once
        if (sorted_contains_i32(resident, budget, v)) {
            atomicAdd(&s_kept, 1);
        } else {
            miss_flag[(int)(key & 0xffffffffull)] = 1;
        }
    }
    // Step 2: keep the slots whose block is in S; the others are victims.
    for (int i = threadIdx.x; i < budget; i += blockDim.x) {
        const int held = slot_state[i];
        if (held == OASIS_NO_SLOT) {
            slot_state[i] = OASIS_STATE_NONE;
        } else if (held >= 0 && sorted_contains_block(sorted, p2, held)) {
            page_last_selected[(i64)pages[i] * num_kv_heads + h] = step;
            slot_state[i] = OASIS_STATE_KEPT;
        } else {
            slot_state[i] = held < 0 ? OASIS_STATE_VICTIM_EMPTY : OASIS_STATE_VICTIM;
        }
    }
    __syncthreads();

    // Step 3 (list): ordered compaction of the flags into `resident` (no longer needed).
    int* missing = resident;
    int n_missing = 0;
    for (int c0 = 0; c0 < num_pred; c0 += blockDim.x) {
        const int p = c0 + threadIdx.x;
        const int flag = p < num_pred ? miss_flag[p] : 0;
        int total;
        const int pos = n_missing + block_exclusive_scan(flag, scan_scratch, &total);
        if (flag) missing[pos] = pred[p];
        n_missing += total;
    }

    // Step 4: victim keys (bit 63: occupied | page_last_selected biased to unsigned in bits
    // 16..47 | slot index in bits 0..15), sorted ascending; non-victims (~0) sort last.
    for (int i = threadIdx.x; i < b2; i += blockDim.x) {
        u64 key = ~0ull;
        if (i < budget) {
            const int st = slot_state[i];
            if (st == OASIS_STATE_VICTIM_EMPTY || st == OASIS_STATE_VICTIM) {
                const int ls = page_last_selected[(i64)pages[i] * num_kv_heads + h];
                const u64 occupied = st == OASIS_STATE_VICTIM ? 1ull : 0ull;
                key = (occupied << 63) | ((u64)((u32)ls ^ 0x80000000u) << 16) | (u64)i;
                atomicAdd(&s_victims, 1);
            }
        }
        sorted[i] = key;
    }
    __syncthreads();
    block_bitonic_sort(sorted, b2);

    // Step 5: pair the first n missing blocks with the first n victims.
    const int n_victims = s_victims;
    const int n = min(min(n_missing, n_victims), fetch_cap);
    const i64 plan = ((i64)s * num_kv_heads + h) * fetch_cap;
    for (int i = threadIdx.x; i < fetch_cap; i += blockDim.x) {
        if (i < n) {
            const int slot = (int)(sorted[i] & 0xffffull);
            const i64 e = (i64)pages[slot] * num_kv_heads + h;
            page_map[e] = missing[i];
            page_last_selected[e] = step;
            plan_slots[plan + i] = slot;
            plan_blocks[plan + i] = missing[i];
        } else {
            plan_slots[plan + i] = -1;
            plan_blocks[plan + i] = -1;
        }
    }
    if (stats != nullptr && threadIdx.x == 0) {
        int* st = stats + ((i64)s * num_kv_heads + h) * 3;
        st[0] = n;
        st[1] = s_kept;
        st[2] = n_missing;
    }
}

}  // namespace oasis

extern "C" __global__ void __launch_bounds__(OASIS_SELECT_THREADS)
    delta_select_i32(const int* predicted, const int* slot_pages, int* page_map, int* page_last_selected,
                     int* plan_slots, int* plan_blocks, int* stats, int num_kv_heads, int num_pred, int budget,
                     int num_pages, int step, int fetch_cap) {
    oasis::delta_select_impl(predicted, slot_pages, page_map, page_last_selected, plan_slots, plan_blocks, stats,
                             num_kv_heads, num_pred, budget, num_pages, step, fetch_cap);
}
