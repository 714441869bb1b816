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
// Two kernels compute the same thing. delta_select_warp_i32 (budget <= OASIS_SELECT_WARP_MAX):
// one warp per (s, h), everything in registers and a little per-warp shared memory, no block
// barrier: membership by brute-force comparison, victims by rounds of warp arg-min. Above that,
// delta_select_i32: one thread block per (s, h); membership tests use sorted copies in shared
// memory (binary search), orders use bitonic sorts and an ordered compaction. In both, a
// duplicate in `predicted` counts once (its first position); a slot whose page is out of range
// takes no part (neither kept nor victim).
#include "oasis_common.cuh"
#include "oasis_params.cuh"

// Threads per block of delta_select_i32. Arbitrary (a multiple of 32, at most 1024).
#define OASIS_SELECT_THREADS 256
// Largest budget (slots per sequence) the kernel supports: slot indices are packed in 16 bits of
// the victim sort key, and shared memory grows as 20 bytes per slot. Arbitrary below 65536.
// oasis_core::limits::MAX_SELECT_BUDGET, defined by oasis_cuda::nvrtc::compile_options.
#ifndef OASIS_MAX_SELECT_BUDGET
#error "OASIS_MAX_SELECT_BUDGET is undefined: compile through oasis_cuda::nvrtc (-DOASIS_MAX_SELECT_BUDGET=...)"
#endif
#if OASIS_MAX_SELECT_BUDGET > 65535
#error "OASIS_MAX_SELECT_BUDGET must stay below 65536: slot indices are 16 bits of the sort key"
#endif
// Threads per block of delta_select_warp_i32 (one (sequence, KV head) per warp). Arbitrary (a
// multiple of 32).
#define OASIS_SELECT_WARP_THREADS 128
// Largest budget of delta_select_warp_i32: budget / 32 slots per lane in registers, and 3 ints of
// shared memory per slot per warp. A multiple of 32, at most 8 * 32 (the largest instantiation).
#define OASIS_SELECT_WARP_MAX 256

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


// One warp per (s, h) for budget <= 32 * K (num_pred <= budget). Lane l holds slots and
// predictions k * 32 + l, k < K. `sm` is this warp's shared memory: 3 * OASIS_SELECT_WARP_MAX ints.
#define OASIS_SEL_EMPTY (-2)  // a valid empty slot (never equals a prediction, padding included)
template <int K>
__device__ void delta_select_warp_impl(
    const int* __restrict__ predicted, const int* __restrict__ slot_pages, int* __restrict__ page_map,
    int* __restrict__ page_last_selected, int* __restrict__ plan_slots, int* __restrict__ plan_blocks,
    int* __restrict__ stats, int* __restrict__ sm, int s, int h, int num_kv_heads, int num_pred, int budget,
    int num_pages, int step, int fetch_cap) {
    const int lane = threadIdx.x & 31;
    const u32 lt_mask = (1u << lane) - 1u;
    int* spred = sm;                              // [round4(num_pred)] predictions, < 0 -> -1
    int* sheld = sm + OASIS_SELECT_WARP_MAX;      // [round4(budget)] block held, else EMPTY
    int* smiss = sm + 2 * OASIS_SELECT_WARP_MAX;  // [n_missing] missing blocks, prediction order
    const int* pred = predicted + ((i64)s * num_kv_heads + h) * num_pred;
    const int* pages = slot_pages + (i64)s * budget;

    int page[K];
    int held[K];  // block held (>= 0), OASIS_SEL_EMPTY, or OASIS_NO_SLOT (no part)
    int ls[K];
    int mp[K];    // prediction, -1 for none
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int i = k * 32 + lane;
        page[k] = i < budget ? pages[i] : -1;
        mp[k] = i < num_pred ? pred[i] : -1;
        if (mp[k] < 0) mp[k] = -1;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int i = k * 32 + lane;
        const bool ok = i < budget && page[k] >= 0 && page[k] < num_pages;
        held[k] = OASIS_NO_SLOT;
        ls[k] = 0;
        if (ok) {
            const i64 e = (i64)page[k] * num_kv_heads + h;
            const int v = page_map[e];
            held[k] = v < 0 ? OASIS_SEL_EMPTY : v;
            ls[k] = page_last_selected[e];
        }
        spred[i] = mp[k];
        sheld[i] = held[k] >= 0 ? held[k] : OASIS_SEL_EMPTY;
    }
    __syncwarp();

    // Slots whose block is predicted; predictions seen at an earlier position (duplicates).
    bool in_s[K];
    bool dup[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        in_s[k] = false;
        dup[k] = false;
    }
    const int np4 = (num_pred + 3) & ~3;  // <= 32 * K: the padding up to there holds -1
    for (int p = 0; p < np4; p += 4) {
        const int4 v = *(const int4*)(spred + p);
        const int vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
            for (int k = 0; k < K; ++k) {
                in_s[k] |= held[k] == vv[c];
                dup[k] |= (mp[k] == vv[c]) & (p + c < k * 32 + lane);
            }
        }
    }
    // Predictions resident in some slot.
    bool res[K];
#pragma unroll
    for (int k = 0; k < K; ++k) res[k] = false;
    const int nb4 = (budget + 3) & ~3;
    for (int p = 0; p < nb4; p += 4) {
        const int4 v = *(const int4*)(sheld + p);
        const int vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
            for (int k = 0; k < K; ++k) res[k] |= mp[k] == vv[c];
        }
    }
    __syncwarp();  // spred / sheld reads done before smiss is written (disjoint, but cheap)

    // Step 3: kept count and the missing list, in prediction order (first occurrences only).
    int kept = 0;
    int n_missing = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const bool first = mp[k] >= 0 && !dup[k];
        const bool is_kept = first && res[k];
        const bool is_miss = first && !res[k];
        kept += __popc(__ballot_sync(0xffffffffu, is_kept));
        const u32 m = __ballot_sync(0xffffffffu, is_miss);
        if (is_miss) smiss[n_missing + __popc(m & lt_mask)] = mp[k];
        n_missing += __popc(m);
    }
    // Steps 2 and 4: keep predicted resident slots; victim keys (occupied, last selected, slot).
    u64 key[K];
    int n_victims = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const bool keep = held[k] >= 0 && in_s[k];
        const bool victim = held[k] != OASIS_NO_SLOT && !keep;
        if (keep) page_last_selected[(i64)page[k] * num_kv_heads + h] = step;
        const u64 occupied = held[k] >= 0 ? 1ull : 0ull;
        key[k] = victim ? (occupied << 63) | ((u64)((u32)ls[k] ^ 0x80000000u) << 16) | (u64)(k * 32 + lane) : ~0ull;
        n_victims += __popc(__ballot_sync(0xffffffffu, victim));
    }
    __syncwarp();  // smiss visible to the whole warp

    // Step 5: the i-th smallest victim key takes missing[i].
    const int n = min(min(n_missing, n_victims), fetch_cap);
    const i64 plan = ((i64)s * num_kv_heads + h) * fetch_cap;
    for (int i = 0; i < n; ++i) {
        u64 mk = key[0];
#pragma unroll
        for (int k = 1; k < K; ++k) mk = key[k] < mk ? key[k] : mk;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const u64 other = __shfl_xor_sync(0xffffffffu, mk, o);
            mk = other < mk ? other : mk;
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (key[k] == mk) {  // exactly one lane and k: slot indices are distinct
                key[k] = ~0ull;
                const int slot = k * 32 + lane;
                const int blk = smiss[i];
                const i64 e = (i64)page[k] * num_kv_heads + h;
                page_map[e] = blk;
                page_last_selected[e] = step;
                plan_slots[plan + i] = slot;
                plan_blocks[plan + i] = blk;
            }
        }
    }
    for (int i = n + lane; i < fetch_cap; i += 32) {
        plan_slots[plan + i] = -1;
        plan_blocks[plan + i] = -1;
    }
    if (stats != nullptr && lane == 0) {
        int* st = stats + ((i64)s * num_kv_heads + h) * 3;
        st[0] = n;
        st[1] = kept;
        st[2] = n_missing;
    }
}

// grid ceil(num_seqs * num_kv_heads / warps per block), OASIS_SELECT_WARP_THREADS threads, no
// dynamic shared memory; budget <= OASIS_SELECT_WARP_MAX, num_pred <= budget.
__device__ void delta_select_warp_entry(
    const int* predicted, const int* slot_pages, int* page_map, int* page_last_selected, int* plan_slots,
    int* plan_blocks, int* stats, int num_kv_heads, int num_pred, int budget, int num_pages, int step, int fetch_cap,
    int num_seqs) {
    __shared__ __align__(16) int smem[OASIS_SELECT_WARP_THREADS / 32][3 * OASIS_SELECT_WARP_MAX];
    const int warp = threadIdx.x >> 5;
    const i64 w = (i64)blockIdx.x * (blockDim.x >> 5) + warp;
    if (w >= (i64)num_seqs * num_kv_heads) return;  // warp-uniform
    const int s = (int)(w / num_kv_heads);
    const int h = (int)(w - (i64)s * num_kv_heads);
    int* sm = smem[warp];
    const int kk = (budget + 31) / 32;
    if (kk <= 1) {
        delta_select_warp_impl<1>(predicted, slot_pages, page_map, page_last_selected, plan_slots, plan_blocks, stats,
                                  sm, s, h, num_kv_heads, num_pred, budget, num_pages, step, fetch_cap);
    } else if (kk <= 2) {
        delta_select_warp_impl<2>(predicted, slot_pages, page_map, page_last_selected, plan_slots, plan_blocks, stats,
                                  sm, s, h, num_kv_heads, num_pred, budget, num_pages, step, fetch_cap);
    } else if (kk <= 4) {
        delta_select_warp_impl<4>(predicted, slot_pages, page_map, page_last_selected, plan_slots, plan_blocks, stats,
                                  sm, s, h, num_kv_heads, num_pred, budget, num_pages, step, fetch_cap);
    } else {
        delta_select_warp_impl<8>(predicted, slot_pages, page_map, page_last_selected, plan_slots, plan_blocks, stats,
                                  sm, s, h, num_kv_heads, num_pred, budget, num_pages, step, fetch_cap);
    }
}

}  // namespace oasis

// Entry points: one parameter struct for both (cuda/oasis_params.cuh), unpacked into the impls.
extern "C" __global__ void __launch_bounds__(OASIS_SELECT_THREADS)
    delta_select_i32(const __grid_constant__ oasis::DeltaSelectParams p) {
    const int step = p.step_now ? *p.step_now : p.step;
    oasis::delta_select_impl(p.predicted, p.slot_pages, p.page_map, p.page_last_selected, p.plan_slots,
                             p.plan_blocks, p.stats, p.num_kv_heads, p.num_pred, p.budget, p.num_pages, step,
                             p.fetch_cap);
}

extern "C" __global__ void __launch_bounds__(OASIS_SELECT_WARP_THREADS)
    delta_select_warp_i32(const __grid_constant__ oasis::DeltaSelectParams p) {
    const int step = p.step_now ? *p.step_now : p.step;
    oasis::delta_select_warp_entry(p.predicted, p.slot_pages, p.page_map, p.page_last_selected, p.plan_slots,
                                   p.plan_blocks, p.stats, p.num_kv_heads, p.num_pred, p.budget, p.num_pages,
                                   step, p.fetch_cap, p.num_seqs);
}
