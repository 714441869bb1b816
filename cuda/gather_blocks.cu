// gather_blocks.cu — execute a selection plan (host pool -> GPU slots, through UVA) and copy
// whole pages between two pools. Both are bit-exact copies: the dtype only sets the entry size.
//
// CPU twins: oasis_core::kernels::gather_blocks and oasis_core::kernels::copy_pages; with kv8
// pages on either side (see the end of the file) gather_blocks_tiers, copy_pages_tiers and
// quantize_kv8.
//
// Why a kernel and not cudaMemcpyAsync: the entries are 4-16 KiB and scattered; one memcpy per
// entry runs at ~0.5 GB/s, a kernel reading pinned host memory with 16-byte loads at ~50 GB/s
// (numbers in shared/DESIGN.md). A plan entry whose indices are out of range is skipped, and so
// is one whose host_indptr row is malformed (start < 0, end < start, end > nnz): the kernel checks
// the row (oasis::csr_row) and never reads outside host_indices.
#include "oasis_common.cuh"
#include "oasis_params.cuh"

// Threads per block of the copy kernels. Tuned for PCIe reads of 4-16 KiB entries.
#define OASIS_COPY_THREADS 128

namespace oasis {

// Loads in flight per lane and array in warp_copy_kv: with K and V together a lane keeps
// 2 * OASIS_GATHER_UNROLL 16-byte loads outstanding, so one warp moves a whole 4 KiB + 4 KiB
// entry in one PCIe round trip.
#define OASIS_GATHER_UNROLL 8

// One warp copies `n` bytes of K and `n` of V (an entry of the host pool) with every load of an
// iteration issued before the first store. 16-byte accesses when all four pointers and `n`
// allow it, else 4-byte or byte ones.
__device__ __forceinline__ void warp_copy_kv(void* __restrict__ dk, const void* __restrict__ sk, void* __restrict__ dv,
                                             const void* __restrict__ sv, u64 n, int lane) {
    const u64 align = (u64)dk | (u64)sk | (u64)dv | (u64)sv | n;
    if ((align & 15) == 0) {
        const uint4* k = (const uint4*)sk;
        const uint4* v = (const uint4*)sv;
        uint4* ok = (uint4*)dk;
        uint4* ov = (uint4*)dv;
        const u64 n16 = n >> 4;
        for (u64 base = 0; base < n16; base += 32 * OASIS_GATHER_UNROLL) {
            uint4 rk[OASIS_GATHER_UNROLL];
            uint4 rv[OASIS_GATHER_UNROLL];
#pragma unroll
            for (int u = 0; u < OASIS_GATHER_UNROLL; ++u) {
                const u64 i = base + (u64)u * 32 + lane;
                if (i < n16) {
                    rk[u] = k[i];
                    rv[u] = v[i];
                }
            }
#pragma unroll
            for (int u = 0; u < OASIS_GATHER_UNROLL; ++u) {
                const u64 i = base + (u64)u * 32 + lane;
                if (i < n16) {
                    ok[i] = rk[u];
                    ov[i] = rv[u];
                }
            }
        }
    } else if ((align & 3) == 0) {
        for (u64 i = lane; i < (n >> 2); i += 32) {
            ((u32*)dk)[i] = ((const u32*)sk)[i];
            ((u32*)dv)[i] = ((const u32*)sv)[i];
        }
    } else {
        for (u64 i = lane; i < n; i += 32) {
            ((unsigned char*)dk)[i] = ((const unsigned char*)sk)[i];
            ((unsigned char*)dv)[i] = ((const unsigned char*)sv)[i];
        }
    }
}

// kv8 -> kv8: the K and V scales of entry `se` (page * num_kv_heads + head) to entry `de`.
__device__ __forceinline__ void copy_scales(const float* __restrict__ sk, const float* __restrict__ sv, i64 se,
                                            float* __restrict__ dk, float* __restrict__ dv, i64 de) {
    dk[de] = sk[se];
    dv[de] = sv[se];
}

// Where plan entry e = (s, h, i) = (e / (H * C), (e / C) % H, e % C) copies from and to, in
// elements of the host pool and of the pages; false (nothing to copy) for an empty or
// out-of-range entry, or one of a malformed host_indptr row.
__device__ __forceinline__ bool gather_entry(
    const int* __restrict__ plan_slots, const int* __restrict__ plan_blocks, const int* __restrict__ slot_pages,
    const int* __restrict__ host_indptr, const int* __restrict__ host_indices, i64 e, int num_kv_heads,
    int fetch_cap, int budget, i64 entry, int num_pages, int num_host_blocks, int nnz, i64* src, i64* dst) {
    const int s = (int)(e / ((i64)num_kv_heads * fetch_cap));
    const int h = (int)((e / fetch_cap) % num_kv_heads);
    const int slot = plan_slots[e];
    if (slot < 0 || slot >= budget) return false;
    const int page = slot_pages[(i64)s * budget + slot];
    const int logical = plan_blocks[e];
    int row_begin;
    int row_end;
    csr_row(host_indptr, s, nnz, &row_begin, &row_end);  // a malformed row has no blocks
    if (page < 0 || page >= num_pages || logical < 0 || logical >= row_end - row_begin) return false;
    const int blk = host_indices[row_begin + logical];
    if (blk < 0 || blk >= num_host_blocks) return false;
    *src = ((i64)blk * num_kv_heads + h) * entry;
    *dst = ((i64)page * num_kv_heads + h) * entry;
    return true;
}

// 16 bytes global -> shared without a register (cp.async, sm_80+): the load stays in flight while
// the warp issues the next ones, and a thread block holds as many as its shared memory has room for.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
    *(uint4*)smem = *(const uint4*)gmem;
#endif
}

// 4 bytes global -> shared (cp.async.ca, sm_80+): a kv8 entry's scale, in flight with its codes.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
#if __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
#else
    *(u32*)smem = *(const u32*)gmem;
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// The cp.async issued since the last commit become one group (sm_80+; before, the copies above
// were synchronous and there is nothing to wait for).
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most one committed group of this thread is still in flight (the newest).
__device__ __forceinline__ void cp_async_wait_one() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
#endif
}

// Any grid of blocks of whole warps, at most OASIS_COPY_THREADS threads (the launcher sizes it):
// the warps stride over the plan's entries, `entries_per_warp` (1-32) at a time. Each of that many
// lanes checks one entry; the warp then copies the valid ones, the whole warp on each.
//
// stage == 0: one entry after another through registers (one PCIe round trip each). Each block
// stays resident for its round trips, and a block resident on an SM keeps a GEMM's whole-SM
// block off it, so this path needs many small blocks and spreads over the GPU.
// stage > 0: `stage` entries at once per warp, K and V staged in the block's dynamic shared memory
// (blockDim / 32 * stage * 2 * entry bytes, 16-byte aligned; the launcher sizes it): one round
// trip for `stage` entries, few registers, so a handful of blocks keep PCIe busy. Falls back to
// the register path when a pointer or the entry size is not a multiple of 16 bytes.
// kv8 -> kv8 (scales non-null) takes only the register path here: its staged path, which stages
// the scales with the codes, is gather_blocks_kv8_staged_impl.
template <typename T>
__device__ void gather_blocks_impl(
    const int* __restrict__ plan_slots,   // [num_seqs, num_kv_heads, fetch_cap] slot index or < 0
    const int* __restrict__ plan_blocks,  // [num_seqs, num_kv_heads, fetch_cap] logical block
    const int* __restrict__ slot_pages,   // [num_seqs, budget]
    const int* __restrict__ host_indptr,  // [num_seqs + 1] CSR over host_indices, checked per row
    const int* __restrict__ host_indices, // [nnz] host block of each logical block of each sequence
    const T* __restrict__ host_k,         // [num_host_blocks, num_kv_heads, block_size, head_dim] host pool (UVA)
    const T* __restrict__ host_v,         // [num_host_blocks, num_kv_heads, block_size, head_dim] host pool (UVA)
    T* __restrict__ k_pages,              // [num_pages, num_kv_heads, block_size, head_dim]
    T* __restrict__ v_pages,              // [num_pages, num_kv_heads, block_size, head_dim]
    int num_seqs, int num_kv_heads, int fetch_cap, int budget, int block_size, int head_dim, int num_pages,
    int num_host_blocks, int nnz, int entries_per_warp, int stage,
    const float* __restrict__ host_k_scales = nullptr, // [num_host_blocks, num_kv_heads] kv8 only, else null
    const float* __restrict__ host_v_scales = nullptr, // [num_host_blocks, num_kv_heads]
    float* __restrict__ k_scales = nullptr,            // [num_pages, num_kv_heads]
    float* __restrict__ v_scales = nullptr) {          // [num_pages, num_kv_heads]
    extern __shared__ uint4 gather_stage[];
    const int lane = threadIdx.x & 31;
    const int per = entries_per_warp < 1 ? 1 : (entries_per_warp > 32 ? 32 : entries_per_warp);
    const i64 warp = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const i64 num_warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 total = (i64)num_seqs * num_kv_heads * fetch_cap;
    const i64 entry = (i64)block_size * head_dim;
    const u64 bytes = (u64)entry * sizeof(T);
    const u64 align = (u64)host_k | (u64)host_v | (u64)k_pages | (u64)v_pages | bytes;
    const bool staged = stage > 0 && (align & 15) == 0;
    const u64 n16 = bytes >> 4;
    // This warp's stage: [stage][K, V][n16].
    uint4* buf = gather_stage + (u64)(threadIdx.x >> 5) * (u64)(stage > 0 ? stage : 0) * 2 * n16;
    for (i64 base = warp * per; base < total; base += num_warps * per) {
        const i64 e = base + lane;
        i64 src = -1;
        i64 dst = -1;
        if (lane < per && e < total &&
            !gather_entry(plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, e, num_kv_heads, fetch_cap,
                          budget, entry, num_pages, num_host_blocks, nnz, &src, &dst)) {
            src = dst = -1;
        }
        unsigned todo = __ballot_sync(0xffffffffu, src >= 0);
        if (!staged) {
            while (todo) {
                const int j = __ffs(todo) - 1;
                todo &= todo - 1;
                const i64 sj = __shfl_sync(0xffffffffu, src, j);
                const i64 dj = __shfl_sync(0xffffffffu, dst, j);
                warp_copy_kv(k_pages + dj, host_k + sj, v_pages + dj, host_v + sj, bytes, lane);
                if (k_scales != nullptr && lane == 0) copy_scales(host_k_scales, host_v_scales, sj / entry, k_scales, v_scales, dj / entry);
            }
            continue;
        }
        while (todo) {
            // The next `stage` valid entries: every load in flight, one wait, then the stores.
            unsigned batch = 0;
            for (int i = 0; i < stage && todo; ++i) {
                const int j = __ffs(todo) - 1;
                todo &= todo - 1;
                batch |= 1u << j;
                const i64 sj = __shfl_sync(0xffffffffu, src, j);
                const uint4* k = (const uint4*)(host_k + sj);
                const uint4* v = (const uint4*)(host_v + sj);
                uint4* bk = buf + (u64)i * 2 * n16;
                for (u64 c = lane; c < n16; c += 32) {
                    cp_async16(bk + c, k + c);
                    cp_async16(bk + n16 + c, v + c);
                }
            }
            cp_async_wait_all();
            __syncwarp();
            for (int i = 0; batch; ++i) {
                const int j = __ffs(batch) - 1;
                batch &= batch - 1;
                const i64 dj = __shfl_sync(0xffffffffu, dst, j);
                uint4* ok = (uint4*)(k_pages + dj);
                uint4* ov = (uint4*)(v_pages + dj);
                const uint4* bk = buf + (u64)i * 2 * n16;
                for (u64 c = lane; c < n16; c += 32) {
                    ok[c] = bk[c];
                    ov[c] = bk[n16 + c];
                }
            }
            __syncwarp();  // the stage is reused by the next batch
        }
    }
}

// grid (n), OASIS_COPY_THREADS threads; block i copies page src_ids[i] -> dst_ids[i], all heads.
template <typename T>
__device__ void copy_pages_impl(
    const T* __restrict__ src_k,   // [num_src_pages, num_kv_heads, block_size, head_dim]
    const T* __restrict__ src_v,   // [num_src_pages, num_kv_heads, block_size, head_dim]
    const int* __restrict__ src_ids, // [n]
    T* __restrict__ dst_k,         // [num_dst_pages, num_kv_heads, block_size, head_dim] (may be pinned host, UVA)
    T* __restrict__ dst_v,         // [num_dst_pages, num_kv_heads, block_size, head_dim]
    const int* __restrict__ dst_ids, // [n]
    i64 page_elems, int num_src_pages, int num_dst_pages,
    const float* __restrict__ src_k_scales = nullptr, // [num_src_pages, num_kv_heads] kv8 only, else null
    const float* __restrict__ src_v_scales = nullptr, // [num_src_pages, num_kv_heads]
    float* __restrict__ dst_k_scales = nullptr,       // [num_dst_pages, num_kv_heads]
    float* __restrict__ dst_v_scales = nullptr, int num_kv_heads = 0) {
    const int i = blockIdx.x;
    const int src = src_ids[i];
    const int dst = dst_ids[i];
    if (src < 0 || src >= num_src_pages || dst < 0 || dst >= num_dst_pages) return;
    const u64 bytes = (u64)page_elems * sizeof(T);
    block_copy_bytes(dst_k + (i64)dst * page_elems, src_k + (i64)src * page_elems, bytes);
    block_copy_bytes(dst_v + (i64)dst * page_elems, src_v + (i64)src * page_elems, bytes);
    if (dst_k_scales == nullptr) return;
    for (int h = threadIdx.x; h < num_kv_heads; h += blockDim.x) {
        copy_scales(src_k_scales, src_v_scales, (i64)src * num_kv_heads + h, dst_k_scales, dst_v_scales,
                    (i64)dst * num_kv_heads + h);
    }
}

// ---- kv8 conversions (oasis_core::kernels::kv8::copy_entry): one warp per (page, head) entry.

// Whole-block quantization of one array's entry (quantize_kv8's rule): the scale from the finite
// absmax over the first `valid` elements (valid rows * head_dim), those quantized, the rest of the
// entry's `n` elements code 0. Four codes per store where aligned (the host pool is written over
// PCIe).
template <typename T>
__device__ void warp_quantize_entry(const T* __restrict__ src, int valid, int n, unsigned char* __restrict__ codes,
                                    float* __restrict__ scale, int lane) {
    float m = 0.f;
    for (int i = lane; i < valid; i += 32) m = fmaxf(m, finite_abs(to_f32(src[i])));
    const int e = kv8_exponent(warp_max(m));
    const float inv = exp2i(-e);
    if ((n & 3) == 0 && ((u64)codes & 3) == 0) {
        for (int i = lane; i < n / 4; i += 32) {
            u32 r = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int x = 4 * i + b;
                if (x < valid) r |= e4m3_rne(__fmul_rn(to_f32(src[x]), inv)) << (8 * b);
            }
            ((u32*)codes)[i] = r;
        }
    } else {
        for (int i = lane; i < n; i += 32) codes[i] = i < valid ? (unsigned char)e4m3_rne(__fmul_rn(to_f32(src[i]), inv)) : 0;
    }
    if (lane == 0) *scale = exp2i(e);
}

// Codes in flight per lane and array in warp_dequant_entry (16 each): one PCIe round trip moves
// a 16 x 128 entry of K and V.
#define OASIS_DEQUANT_UNROLL 4

// 16 codes (one 16-byte word) dequantized with `scale` into the 16 T at `dst` (16-byte aligned),
// sizeof(T) 16-byte stores: the one conversion of the register and the staged gathers. kv8_dequant's
// values bit for bit, the codes decoded four at a time (e4m3x4_to_f32: two hardware conversions
// per pair on sm_89+, where kv8_dequant decodes each code in software).
template <typename T>
__device__ __forceinline__ void dequant16(const uint4& w, float scale, T* __restrict__ dst) {
    uint4 o[sizeof(T)];  // 16 T
    const u32 in[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f[4];
        e4m3x4_to_f32(in[i], f);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const float x = __fmul_rn(f[b], scale);
            ((T*)o)[4 * i + b] = x != x ? twin_nan<T>() : from_f32<T>(x);
        }
    }
#pragma unroll
    for (int c = 0; c < (int)sizeof(T); ++c) ((uint4*)dst)[c] = o[c];
}

// The `n` codes of a K and a V entry dequantized into T (kv8_dequant: exact, NaN as the twin's).
// 16 codes per load when the pointers and `n` allow it.
template <typename T>
__device__ void warp_dequant_entry(const unsigned char* __restrict__ ck, float sk, const unsigned char* __restrict__ cv,
                                   float sv, int n, T* __restrict__ dk, T* __restrict__ dv, int lane) {
    const u64 align = (u64)ck | (u64)cv | (u64)n | (((u64)dk | (u64)dv) / sizeof(T));
    if ((align & 15) != 0) {
        for (int i = lane; i < n; i += 32) {
            dk[i] = kv8_dequant<T>(ck[i], sk);
            dv[i] = kv8_dequant<T>(cv[i], sv);
        }
        return;
    }
    const int n16 = n >> 4;
    for (int base = 0; base < n16; base += 32 * OASIS_DEQUANT_UNROLL) {
        uint4 wk[OASIS_DEQUANT_UNROLL];
        uint4 wv[OASIS_DEQUANT_UNROLL];
#pragma unroll
        for (int u = 0; u < OASIS_DEQUANT_UNROLL; ++u) {
            const int i = base + 32 * u + lane;
            if (i < n16) {
                wk[u] = ((const uint4*)ck)[i];
                wv[u] = ((const uint4*)cv)[i];
            }
        }
#pragma unroll
        for (int u = 0; u < OASIS_DEQUANT_UNROLL; ++u) {
            const int i = base + 32 * u + lane;
            if (i >= n16) continue;
            dequant16<T>(wk[u], sk, dk + 16 * i);
            dequant16<T>(wv[u], sv, dv + 16 * i);
        }
    }
}

// Entry `se` of `src` -> entry `de` of `dst` (entry = page * num_kv_heads + head, `n` elements
// each), K and V, by one warp: kv8 -> T dequantizes, T -> kv8 quantizes the first `valid`
// elements (whole rows).
template <typename T>
__device__ __forceinline__ void warp_copy_entry(Kv8Tier src, i64 se, ElemTier<T> dst, i64 de, int n, int, int lane) {
    warp_dequant_entry<T>(src.k + se * n, src.ks[se], src.v + se * n, src.vs[se], n, dst.k + de * n, dst.v + de * n,
                          lane);
}
template <typename T>
__device__ __forceinline__ void warp_copy_entry(ElemTier<T> src, i64 se, Kv8Tier dst, i64 de, int n, int valid,
                                                int lane) {
    warp_quantize_entry<T>(src.k + se * n, valid, n, dst.k + de * n, dst.ks + de, lane);
    warp_quantize_entry<T>(src.v + se * n, valid, n, dst.v + de * n, dst.vs + de, lane);
}

// gather_blocks with a conversion (S -> D: Kv8Tier -> ElemTier<T> or ElemTier<T> -> Kv8Tier):
// any grid of whole warps; each warp strides over the plan entries `entries_per_warp` at a time
// (as gather_blocks_impl's register path) and converts the valid ones, one after another. Every
// row of a host block is valid (only complete blocks live in the host pool).
template <typename T, typename S, typename D>
__device__ void gather_blocks_conv_impl(
    const int* __restrict__ plan_slots,   // [num_seqs, num_kv_heads, fetch_cap] slot index or < 0
    const int* __restrict__ plan_blocks,  // [num_seqs, num_kv_heads, fetch_cap] logical block
    const int* __restrict__ slot_pages,   // [num_seqs, budget]
    const int* __restrict__ host_indptr,  // [num_seqs + 1] CSR over host_indices, checked per row
    const int* __restrict__ host_indices, // [nnz] host block of each logical block of each sequence
    S host,                               // [num_host_blocks, num_kv_heads, block_size, head_dim] host pool (UVA)
    D gpu,                                // [num_pages, num_kv_heads, block_size, head_dim]
    int num_seqs, int num_kv_heads, int fetch_cap, int budget, int block_size, int head_dim, int num_pages,
    int num_host_blocks, int nnz, int entries_per_warp) {
    const int lane = threadIdx.x & 31;
    const int per = entries_per_warp < 1 ? 1 : (entries_per_warp > 32 ? 32 : entries_per_warp);
    const i64 warp = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const i64 num_warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 total = (i64)num_seqs * num_kv_heads * fetch_cap;
    const int entry = block_size * head_dim;
    for (i64 base = warp * per; base < total; base += num_warps * per) {
        const i64 e = base + lane;
        i64 src = -1;
        i64 dst = -1;
        if (lane < per && e < total &&
            !gather_entry(plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, e, num_kv_heads, fetch_cap,
                          budget, entry, num_pages, num_host_blocks, nnz, &src, &dst)) {
            src = dst = -1;
        }
        unsigned todo = __ballot_sync(0xffffffffu, src >= 0);
        while (todo) {
            const int j = __ffs(todo) - 1;
            todo &= todo - 1;
            const i64 sj = __shfl_sync(0xffffffffu, src, j) / entry;
            const i64 dj = __shfl_sync(0xffffffffu, dst, j) / entry;
            warp_copy_entry<T>(host, sj, gpu, dj, entry, entry, lane);
        }
    }
}

// One staged kv8 entry (codes `bk` = [K, V][n16] words, scales `sk`, `sv`, in shared memory) into
// entry `de` of the GPU tier by one warp: kv8 pages copy codes and scales, T pages dequantize.
__device__ __forceinline__ void store_staged(Kv8Tier dst, i64 de, const uint4* __restrict__ bk, float sk, float sv,
                                             u64 n16, int lane) {
    uint4* ok = (uint4*)(dst.k + de * (i64)(16 * n16));
    uint4* ov = (uint4*)(dst.v + de * (i64)(16 * n16));
    for (u64 c = lane; c < n16; c += 32) {
        ok[c] = bk[c];
        ov[c] = bk[n16 + c];
    }
    if (lane == 0) {
        dst.ks[de] = sk;
        dst.vs[de] = sv;
    }
}
template <typename T>
__device__ __forceinline__ void store_staged(ElemTier<T> dst, i64 de, const uint4* __restrict__ bk, float sk, float sv,
                                             u64 n16, int lane) {
    T* dk = dst.k + de * (i64)(16 * n16);
    T* dv = dst.v + de * (i64)(16 * n16);
    for (u64 c = lane; c < n16; c += 32) {
        dequant16<T>(bk[c], sk, dk + 16 * c);
        dequant16<T>(bk[n16 + c], sv, dv + 16 * c);
    }
}

// 16-byte words of one warp's kv8 stage of `stage` entries of `n16` words of codes per array:
// [stage][K, V][n16] codes, then [stage][K, V] f32 scales rounded up to a word. Must match
// GatherLaunch::kv8_stage_smem_bytes.
__device__ __forceinline__ u64 kv8_stage_words(int stage, u64 n16) {
    return (u64)stage * 2 * n16 + ((u64)stage * 2 + 3) / 4;
}

// Issue the loads of the next (at most) `count` valid entries of `todo` (this pass's lanes whose
// entry is valid; taken off it) into stage slots `at ..`: every 16-byte word of their K and V codes
// and (lane 0) both scales, by cp.async. Returns the lanes issued, in slot order.
__device__ __forceinline__ unsigned kv8_stage_issue(const Kv8Tier& host, i64 src, unsigned& todo, uint4* buf,
                                                    float* sbuf, int at, int count, i64 entry, u64 n16, int lane) {
    unsigned batch = 0;
    for (int i = at; i < at + count && todo; ++i) {
        const int j = __ffs(todo) - 1;
        todo &= todo - 1;
        batch |= 1u << j;
        const i64 sj = __shfl_sync(0xffffffffu, src, j);
        const uint4* k = (const uint4*)(host.k + sj);
        const uint4* v = (const uint4*)(host.v + sj);
        uint4* bk = buf + (u64)i * 2 * n16;
        for (u64 c = lane; c < n16; c += 32) {
            cp_async16(bk + c, k + c);
            cp_async16(bk + n16 + c, v + c);
        }
        if (lane == 0) {
            cp_async4(sbuf + 2 * i, host.ks + sj / entry);
            cp_async4(sbuf + 2 * i + 1, host.vs + sj / entry);
        }
    }
    return batch;
}

// Write out the landed entries of `batch` (kv8_stage_issue's lanes) from stage slots `at ..`.
template <typename D>
__device__ __forceinline__ void kv8_stage_store(D gpu, i64 dst, unsigned batch, const uint4* buf, const float* sbuf,
                                                int at, i64 entry, u64 n16, int lane) {
    for (int i = at; batch; ++i) {
        const int j = __ffs(batch) - 1;
        batch &= batch - 1;
        const i64 dj = __shfl_sync(0xffffffffu, dst, j);
        store_staged(gpu, dj / entry, buf + (u64)i * 2 * n16, sbuf[2 * i], sbuf[2 * i + 1], n16, lane);
    }
}

// The staged gather from a kv8 host pool (gather_blocks_impl's staged path on codes): each warp
// takes the next `stage` valid entries of its pass, issues every 16-byte load of their K and V
// codes and both scales (cp.async, lane 0 for the scales) into its stage, waits once, then writes
// them out (store_staged: kv8 pages copied, T pages dequantized from shared memory). One PCIe
// round trip per `stage` entries; a stage of two or more runs as two halves, one half's loads in
// flight while the other's entries are written out; the launcher sizes `stage` so the bytes in flight match the T
// gather's (GatherLaunch::kv8_stage_for). Needs 16-byte aligned codes and pages and an entry of a
// multiple of 16 codes (the entry points check; else the register paths).
template <typename D>
__device__ void gather_blocks_kv8_staged_impl(
    const int* __restrict__ plan_slots,   // [num_seqs, num_kv_heads, fetch_cap] slot index or < 0
    const int* __restrict__ plan_blocks,  // [num_seqs, num_kv_heads, fetch_cap] logical block
    const int* __restrict__ slot_pages,   // [num_seqs, budget]
    const int* __restrict__ host_indptr,  // [num_seqs + 1] CSR over host_indices, checked per row
    const int* __restrict__ host_indices, // [nnz] host block of each logical block of each sequence
    Kv8Tier host,                         // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned host (UVA)
    D gpu,                                // [num_pages, num_kv_heads, block_size, head_dim]
    int num_seqs, int num_kv_heads, int fetch_cap, int budget, int block_size, int head_dim, int num_pages,
    int num_host_blocks, int nnz, int entries_per_warp, int stage) {
    extern __shared__ uint4 gather_stage[];
    const int lane = threadIdx.x & 31;
    const int per = entries_per_warp < 1 ? 1 : (entries_per_warp > 32 ? 32 : entries_per_warp);
    const i64 warp = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const i64 num_warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 total = (i64)num_seqs * num_kv_heads * fetch_cap;
    const i64 entry = (i64)block_size * head_dim;  // codes (bytes) per array
    const u64 n16 = (u64)entry >> 4;
    uint4* buf = gather_stage + (u64)(threadIdx.x >> 5) * kv8_stage_words(stage, n16);
    float* sbuf = (float*)(buf + (u64)stage * 2 * n16);  // [stage][K, V]
    // A stage of two entries or more is used as two halves (entries [0, half) and [half, 2 half)).
    const int half = stage / 2;
    const bool pipelined = half > 0;
    for (i64 base = warp * per; base < total; base += num_warps * per) {
        const i64 e = base + lane;
        i64 src = -1;
        i64 dst = -1;
        if (lane < per && e < total &&
            !gather_entry(plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, e, num_kv_heads, fetch_cap,
                          budget, entry, num_pages, num_host_blocks, nnz, &src, &dst)) {
            src = dst = -1;
        }
        unsigned todo = __ballot_sync(0xffffffffu, src >= 0);
        if (!pipelined) {
            while (todo) {
                const unsigned batch = kv8_stage_issue(host, src, todo, buf, sbuf, 0, stage, entry, n16, lane);
                cp_async_wait_all();
                __syncwarp();
                kv8_stage_store(gpu, dst, batch, buf, sbuf, 0, entry, n16, lane);
                __syncwarp();  // the stage is reused by the next batch
            }
            continue;
        }
        // Two halves of the stage: the next batch's loads are in flight while this one's entries
        // are written out (a T tier dequantizes them: the warp's conversion no longer stalls its
        // PCIe reads). Drained at the end of each pass.
        unsigned batch = kv8_stage_issue(host, src, todo, buf, sbuf, 0, half, entry, n16, lane);
        cp_async_commit();
        int at = 0;
        while (batch) {
            const unsigned next = kv8_stage_issue(host, src, todo, buf, sbuf, half - at, half, entry, n16, lane);
            cp_async_commit();
            cp_async_wait_one();  // this batch's group has landed; the next one's may still be in flight
            __syncwarp();
            kv8_stage_store(gpu, dst, batch, buf, sbuf, at, entry, n16, lane);
            __syncwarp();  // this half is reused two batches on
            batch = next;
            at = half - at;
        }
    }
}

// Whether a gather from a kv8 host pool takes the staged path: a stage, and codes, pages and the
// entry in whole 16-byte words (the T pages' entries then are too).
__device__ __forceinline__ bool kv8_staged(const GatherBlocksTiersParams& p) {
    const u64 align = (u64)p.host_k | (u64)p.host_v | (u64)p.k_pages | (u64)p.v_pages | (u64)p.block_size * p.head_dim;
    return p.stage_entries > 0 && (align & 15) == 0;
}

// copy_pages with a conversion: grid (n), OASIS_COPY_THREADS threads; block i converts page
// src_ids[i] -> dst_ids[i], warp w heads w, w + 4, ...; T -> kv8 quantizes the page's first
// valid[i] rows (null: all; out-of-range counts skip the page, as the twin rejects them).
template <typename T, typename S, typename D>
__device__ void copy_pages_conv_impl(
    S src,                           // [num_src_pages, num_kv_heads, block_size, head_dim]
    const int* __restrict__ src_ids, // [n]
    D dst,                           // [num_dst_pages, num_kv_heads, block_size, head_dim] (may be pinned host, UVA)
    const int* __restrict__ dst_ids, // [n]
    const int* __restrict__ valid,   // [n] 1..=block_size rows of src page i, or null (all)
    int num_kv_heads, int block_size, int head_dim, int num_src_pages, int num_dst_pages) {
    const int i = blockIdx.x;
    const int sp = src_ids[i];
    const int dp = dst_ids[i];
    const int rows = valid != nullptr ? valid[i] : block_size;
    if (sp < 0 || sp >= num_src_pages || dp < 0 || dp >= num_dst_pages || rows < 1 || rows > block_size) return;
    const int entry = block_size * head_dim;
    for (int h = threadIdx.x >> 5; h < num_kv_heads; h += blockDim.x >> 5) {
        warp_copy_entry<T>(src, (i64)sp * num_kv_heads + h, dst, (i64)dp * num_kv_heads + h, entry, rows * head_dim,
                           threadIdx.x & 31);
    }
}

// quantize_kv8: grid (n), OASIS_COPY_THREADS threads; block b quantizes block b of `src`, warp w
// heads w, w + 4, ... (oasis_core::kernels::quantize_kv8; a valid[b] outside 1..=block_size
// skips the block, where the twin rejects the call).
template <typename T>
__device__ void quantize_kv8_impl(
    const T* __restrict__ src,     // [n, num_kv_heads, block_size, head_dim]
    const int* __restrict__ valid, // [n] 1..=block_size
    unsigned char* __restrict__ codes, // [n, num_kv_heads, block_size, head_dim]
    float* __restrict__ scales,    // [n, num_kv_heads]
    int num_kv_heads, int block_size, int head_dim) {
    const int b = blockIdx.x;
    const int rows = valid[b];
    if (rows < 1 || rows > block_size) return;
    const int entry = block_size * head_dim;
    for (int h = threadIdx.x >> 5; h < num_kv_heads; h += blockDim.x >> 5) {
        const i64 e = (i64)b * num_kv_heads + h;
        warp_quantize_entry<T>(src + e * entry, rows * head_dim, entry, codes + e * entry, scales + e,
                               threadIdx.x & 31);
    }
}

}  // namespace oasis

// Entry points: one parameter struct each (cuda/oasis_params.cuh), unpacked into the impls.
#define OASIS_GATHER_BLOCKS(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(OASIS_COPY_THREADS)                                  \
        NAME(const __grid_constant__ oasis::GatherBlocksParams<T> p) {                               \
        oasis::gather_blocks_impl<T>(p.plan_slots, p.plan_blocks, p.slot_pages, p.host_indptr,        \
                                     p.host_indices, p.host_k, p.host_v, p.k_pages, p.v_pages,        \
                                     p.num_seqs, p.num_kv_heads, p.fetch_cap, p.budget, p.block_size, \
                                     p.head_dim, p.num_pages, p.num_host_blocks, p.nnz,               \
                                     p.entries_per_warp, p.stage_entries);                            \
    }

OASIS_GATHER_BLOCKS(gather_blocks_bf16, oasis::bf16)
OASIS_GATHER_BLOCKS(gather_blocks_f16, oasis::f16)
OASIS_GATHER_BLOCKS(gather_blocks_f32, float)

#define OASIS_COPY_PAGES(NAME, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(OASIS_COPY_THREADS)                                  \
        NAME(const __grid_constant__ oasis::CopyPagesParams<T> p) {                                  \
        oasis::copy_pages_impl<T>(p.src_k, p.src_v, p.src_ids, p.dst_k, p.dst_v, p.dst_ids,           \
                                  p.page_elems, p.num_src_pages, p.num_dst_pages);                    \
    }

OASIS_COPY_PAGES(copy_pages_bf16, oasis::bf16)
OASIS_COPY_PAGES(copy_pages_f16, oasis::f16)
OASIS_COPY_PAGES(copy_pages_f32, float)

// ---- kv8 pages (oasis_core::kernels::{gather_blocks_tiers, copy_pages_tiers, quantize_kv8}).
// Entry names: <verb>_<object>_<source tier>_<destination tier>_<dtype>, each tier `elem` (T pages)
// or `kv8`; kv8 -> kv8 is dtype-free (`gather_blocks_kv8`, `copy_pages_kv8`: codes and scales
// bit-exact, through the byte-copy paths above). Tier buffers arrive untyped (void*).
#define OASIS_GATHER_TIERS_ARGS(HOST, GPU)                                                           \
    p.plan_slots, p.plan_blocks, p.slot_pages, p.host_indptr, p.host_indices,                        \
        HOST::from(p.host_k, p.host_v, p.host_k_scales, p.host_v_scales),                            \
        GPU::from(p.k_pages, p.v_pages, p.k_scales, p.v_scales), p.num_seqs, p.num_kv_heads,         \
        p.fetch_cap, p.budget, p.block_size, p.head_dim, p.num_pages, p.num_host_blocks, p.nnz,      \
        p.entries_per_warp

// From a kv8 host pool: staged (codes and scales through shared memory) when kv8_staged, else the
// register paths (the pool on the device: GatherLaunch::DEVICE_SOURCE stages nothing).
extern "C" __global__ void __launch_bounds__(OASIS_COPY_THREADS)
    gather_blocks_kv8(const __grid_constant__ oasis::GatherBlocksTiersParams p) {
    typedef oasis::fp8e4m3 C;
    if (oasis::kv8_staged(p)) {
        oasis::gather_blocks_kv8_staged_impl<oasis::Kv8Tier>(
            OASIS_GATHER_TIERS_ARGS(oasis::Kv8Tier, oasis::Kv8Tier), p.stage_entries);
        return;
    }
    oasis::gather_blocks_impl<C>(p.plan_slots, p.plan_blocks, p.slot_pages, p.host_indptr, p.host_indices,
                                 (const C*)p.host_k, (const C*)p.host_v, (C*)p.k_pages, (C*)p.v_pages, p.num_seqs,
                                 p.num_kv_heads, p.fetch_cap, p.budget, p.block_size, p.head_dim, p.num_pages,
                                 p.num_host_blocks, p.nnz, p.entries_per_warp, 0, p.host_k_scales,
                                 p.host_v_scales, p.k_scales, p.v_scales);
}

#define OASIS_GATHER_BLOCKS_CONV(NAME, T, HOST, GPU)                                                 \
    extern "C" __global__ void __launch_bounds__(OASIS_COPY_THREADS)                                  \
        NAME(const __grid_constant__ oasis::GatherBlocksTiersParams p) {                             \
        oasis::gather_blocks_conv_impl<T, HOST, GPU>(OASIS_GATHER_TIERS_ARGS(HOST, GPU));            \
    }

#define OASIS_GATHER_BLOCKS_KV8_ELEM(NAME, T)                                                        \
    extern "C" __global__ void __launch_bounds__(OASIS_COPY_THREADS)                                  \
        NAME(const __grid_constant__ oasis::GatherBlocksTiersParams p) {                             \
        typedef oasis::ElemTier<T> G;                                                                 \
        if (oasis::kv8_staged(p)) {                                                                   \
            oasis::gather_blocks_kv8_staged_impl<G>(OASIS_GATHER_TIERS_ARGS(oasis::Kv8Tier, G),      \
                                                    p.stage_entries);                                 \
        } else {                                                                                      \
            oasis::gather_blocks_conv_impl<T, oasis::Kv8Tier, G>(                                     \
                OASIS_GATHER_TIERS_ARGS(oasis::Kv8Tier, G));                                          \
        }                                                                                             \
    }

extern "C" __global__ void __launch_bounds__(OASIS_COPY_THREADS)
    copy_pages_kv8(const __grid_constant__ oasis::CopyPagesTiersParams p) {
    typedef oasis::fp8e4m3 C;
    oasis::copy_pages_impl<C>((const C*)p.src_k, (const C*)p.src_v, p.src_ids, (C*)p.dst_k, (C*)p.dst_v, p.dst_ids,
                              (oasis::i64)p.num_kv_heads * p.block_size * p.head_dim, p.num_src_pages,
                              p.num_dst_pages, p.src_k_scales, p.src_v_scales, p.dst_k_scales, p.dst_v_scales,
                              p.num_kv_heads);
}

#define OASIS_COPY_PAGES_CONV(NAME, T, SRC, DST)                                                     \
    extern "C" __global__ void __launch_bounds__(OASIS_COPY_THREADS)                                  \
        NAME(const __grid_constant__ oasis::CopyPagesTiersParams p) {                                \
        oasis::copy_pages_conv_impl<T, SRC, DST>(                                                     \
            SRC::from(p.src_k, p.src_v, p.src_k_scales, p.src_v_scales), p.src_ids,                  \
            DST::from(p.dst_k, p.dst_v, p.dst_k_scales, p.dst_v_scales), p.dst_ids, p.valid,         \
            p.num_kv_heads, p.block_size, p.head_dim, p.num_src_pages, p.num_dst_pages);             \
    }

#define OASIS_QUANTIZE_KV8(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(OASIS_COPY_THREADS)                                  \
        NAME(const __grid_constant__ oasis::QuantizeKv8Params<T> p) {                                \
        oasis::quantize_kv8_impl<T>(p.src, p.valid, p.codes, p.scales, p.num_kv_heads, p.block_size, \
                                    p.head_dim);                                                      \
    }

OASIS_GATHER_BLOCKS_KV8_ELEM(gather_blocks_kv8_elem_bf16, oasis::bf16)
OASIS_GATHER_BLOCKS_CONV(gather_blocks_elem_kv8_bf16, oasis::bf16, oasis::ElemTier<oasis::bf16>, oasis::Kv8Tier)
OASIS_COPY_PAGES_CONV(copy_pages_kv8_elem_bf16, oasis::bf16, oasis::Kv8Tier, oasis::ElemTier<oasis::bf16>)
OASIS_COPY_PAGES_CONV(copy_pages_elem_kv8_bf16, oasis::bf16, oasis::ElemTier<oasis::bf16>, oasis::Kv8Tier)
OASIS_QUANTIZE_KV8(quantize_kv8_bf16, oasis::bf16)
OASIS_GATHER_BLOCKS_KV8_ELEM(gather_blocks_kv8_elem_f16, oasis::f16)
OASIS_GATHER_BLOCKS_CONV(gather_blocks_elem_kv8_f16, oasis::f16, oasis::ElemTier<oasis::f16>, oasis::Kv8Tier)
OASIS_COPY_PAGES_CONV(copy_pages_kv8_elem_f16, oasis::f16, oasis::Kv8Tier, oasis::ElemTier<oasis::f16>)
OASIS_COPY_PAGES_CONV(copy_pages_elem_kv8_f16, oasis::f16, oasis::ElemTier<oasis::f16>, oasis::Kv8Tier)
OASIS_QUANTIZE_KV8(quantize_kv8_f16, oasis::f16)
OASIS_GATHER_BLOCKS_KV8_ELEM(gather_blocks_kv8_elem_f32, float)
OASIS_GATHER_BLOCKS_CONV(gather_blocks_elem_kv8_f32, float, oasis::ElemTier<float>, oasis::Kv8Tier)
OASIS_COPY_PAGES_CONV(copy_pages_kv8_elem_f32, float, oasis::Kv8Tier, oasis::ElemTier<float>)
OASIS_COPY_PAGES_CONV(copy_pages_elem_kv8_f32, float, oasis::ElemTier<float>, oasis::Kv8Tier)
OASIS_QUANTIZE_KV8(quantize_kv8_f32, float)
