// oasis_codes_tc.cuh — the codes scores' tensor-core path and the two score bodies built on it:
// score_codes_mma_entry (one mma.m16n8k16 per 16 channels of a (block, head)) with its cp.async
// staging and MMA fragments, score_codes_tile (one warp's tile of entries: the copies pipelined
// OASIS_CODES_STAGES - 1 ahead, each entry on the tensor cores or the exact scalar path), and the
// bodies of score_blocks_codes_* and rescore_topk_codes_* (score_blocks_codes_impl,
// rescore_topk_codes_impl). Its knobs (#ifndef, for experiments/exp_codes.py): OASIS_CODES_STAGES,
// OASIS_CODES_MIN_BLOCKS and OASIS_RESCORE_TOPK_THREADS. CPU twins: oasis_core::kernels::
// score_blocks_codes, rescore_blocks_codes and rescore_topk_codes.
//
// Included by key_codes.cu only (at file scope), after the helpers it uses: from key_codes.cu
// OASIS_CODES_TILE, nan_max, codes_round_f16, codes_scalar_warp_floats, score_codes_seq_of and
// score_codes_scalar_entry (the exact scalar path); from oasis_common.cuh mma_f16_16816,
// f16x2_rn, e4m3x4_to_f32, to_f32, neg_inf and next_pow2; from oasis_topk.cuh
// topk_candidates_core. It includes nothing itself (experiments/exp_score.py inlines it as text).
#pragma once

namespace oasis {

// ---- tensor-core path ---------------------------------------------------------------------------
// For block_size 16, head_dim 64 or 128, at most 8 query heads per KV head and 16-byte aligned
// bounds and codes (the engine's shapes), one warp scores one (block, head) with one
// mma.m16n8k16 per 16 channels: A = the 16 tokens' codes 0..3 (exact in f16), B[d][g] = the code
// weights w[g][d] = f16(q3[g][d] x rho[d]) with q3 = f16(q / 3) built once per sequence (in
// registers) and rho = f16(hi - lo) per block (one cvt and one f16x2 multiply per two channels
// of B), C = 16 tokens x 8 query heads in f32. Every product c x w is exact in f32, so the
// logits are the CPU twin's up to the order (and the tensor core's handling) of the f32 sums.
// Then the NaN-propagating max over the tokens, plus q[g] . lo in f32, summed over the group.
// lo and hi are the decoded bound: four E4M3 bytes per lane and row (e4m3x4_to_f32), times the
// entry's scale, exactly the scalar path's values.
//
// The warp copies the next entries' bounds (and scales) and codes into shared memory with cp.async
// while it computes the current one (OASIS_CODES_STAGES buffers per warp). The MMA's k positions
// are permuted so that each lane reads contiguous bytes: lane tig covers channels tig * 4 KC ..
// tig * 4 KC + 4 KC - 1 (one word of codes per 16 channels), and the two channels of an f16x2
// register sit at bits (s, s + 16) of a code word: channel p and p + 8 of the word's 16 are bits
// 2p and 2p + 16, so one shift, one lop3 and one subtraction give a register of two codes. k-step
// kc, word u = kc / 4, m = kc % 4: A/B rows 2 tig, 2 tig + 1 are channels c + 2m, c + 2m + 8 and
// rows 2 tig + 8, 2 tig + 9 are c + 2m + 1, c + 2m + 9 (c = tig * 4 KC + 16 u).
//
// A block with a weight that may not fit f16 (|hi - lo| > OASIS_CODES_F16_SAFE / max(1, max |q3|),
// or NaN / inf: a NaN scale), and a sequence with a q3 that does not (|q3| > 65504 or NaN), take
// the exact scalar path instead (warp-uniform votes): the definition is the same, so only speed
// differs.

// Buffers per warp of the tensor-core path (oasis_cuda::ops::SCORE_CODES_STAGES must match): the
// warp has OASIS_CODES_STAGES - 1 entries in flight while it computes one. The #ifndef guards let
// experiments/exp_codes.py compile variants.
#ifndef OASIS_CODES_STAGES
#define OASIS_CODES_STAGES 3
#endif
// Thread blocks per SM the register allocation must allow (__launch_bounds__): 6 (at most 80
// registers, no spills) rescored the two-stage candidates 12 % faster than 4 on the H200
// (24 warps per SM hide more of the copies' latency; experiments/exp_codes.py, docs/PERF.md).
#ifndef OASIS_CODES_MIN_BLOCKS
#define OASIS_CODES_MIN_BLOCKS 6
#endif
// Bound on max |q3| x |hi - lo| under which every weight is a finite f16 (65504 less the
// rounding of rho and of the product).
#define OASIS_CODES_F16_SAFE 65000.0f

__device__ __forceinline__ u32 codes_mul_f16x2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// Two codes at bits s and s + 16 of w as f16x2 (bit s low): 1024 + c is exact in f16.
__device__ __forceinline__ u32 codes_f16x2_at(u32 w, int s) {
    const u32 x = ((w >> s) & 0x00030003u) | 0x64006400u;
    u32 c;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(c) : "r"(x), "r"(0x64006400u));
    return c;
}

// The epilogue: C holds sum_d c x w for tokens (rows gid, gid + 8) and query heads (columns
// 2 tig, 2 tig + 1); `base` this lane's share of (sum over g of q[g]) . min. Writes the entry's
// score (sum over the group's query heads of the max over the block's tokens, plus the base)
// from lane 0.
__device__ __forceinline__ void codes_mma_epilogue(const float (&c)[4], float base, int gid, int tig, int lane,
                                                   int group, float* __restrict__ out) {
    // Max over the 16 tokens of columns 2 tig and 2 tig + 1: rows gid and gid + 8 here, then over gid.
    float m0 = nan_max(c[0], c[2]);
    float m1 = nan_max(c[1], c[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        m0 = nan_max(m0, __shfl_xor_sync(0xffffffffu, m0, o));
        m1 = nan_max(m1, __shfl_xor_sync(0xffffffffu, m1, o));
    }
    // Lanes with gid 0 add their two query heads' maxima (those in the group) to their share of
    // the base, and the warp sums those terms.
    float term = base;
    if (gid == 0) {
        if (2 * tig < group) term += m0;
        if (2 * tig + 1 < group) term += m1;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) term += __shfl_xor_sync(0xffffffffu, term, o);
    if (lane == 0) *out = term;
}

// Bytes of one entry in a buffer: a (block, head)'s bound rows (2 head_dim E4M3 bytes), its 16
// tokens' codes (4 head_dim bytes), then its scale (4 bytes, padded to 16).
__host__ __device__ __forceinline__ constexpr int codes_stage_bytes(int head_dim) { return 6 * head_dim + 16; }

__device__ __forceinline__ void codes_cp_async16(void* smem, const void* gmem) {
    const u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void codes_cp_async4(void* smem, const void* gmem) {
    const u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void codes_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void codes_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The warp copies entry (b, h) into `buf` (codes_stage_bytes(HD): 16-byte chunks of the bound and
// the codes, lanes round-robin, and the scale by lane 31) and commits a group. HD: the head_dim of
// the tensor-core path, known at compile time so that the copy is two or three unrolled cp.async
// per lane with no loop (the only caller is that path).
template <int HD>
__device__ __forceinline__ void codes_stage_entry(unsigned char* __restrict__ buf,
                                                  const unsigned char* __restrict__ bounds8,
                                                  const float* __restrict__ scales,
                                                  const unsigned char* __restrict__ codes, int b, int h,
                                                  int num_kv_heads) {
    constexpr int b8_chunks = (2 * HD) >> 4;
    constexpr int all_chunks = b8_chunks + (HD >> 2);  // 16 tokens x HD / 4 bytes / 16
    const int lane = threadIdx.x & 31;
    const i64 entry = (i64)b * num_kv_heads + h;
    const unsigned char* src_b = bounds8 + entry * 2 * HD;
    const unsigned char* src_c = codes + entry * 4 * HD;
#pragma unroll
    for (int c0 = 0; c0 < all_chunks; c0 += 32) {
        const int c = c0 + lane;
        if (c < all_chunks) {
            const unsigned char* src = c < b8_chunks ? src_b + 16 * c : src_c + 16 * (c - b8_chunks);
            codes_cp_async16(buf + 16 * c, src);
        }
    }
    if (lane == 31) codes_cp_async4(buf + 6 * HD, scales + entry);
    codes_cp_async_commit();
}

// The channels of lane tig at k-step kc (the B rows 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9, as
// described above), in this order: c + 2m, c + 2m + 8, c + 2m + 1, c + 2m + 9.
template <int KC>
__device__ __forceinline__ int codes_channel(int kc, int tig, int i) {
    const int c = tig * 4 * KC + 16 * (kc >> 2) + 2 * (kc & 3);
    return c + (i & 1) * 8 + (i >> 1);
}

// Lane (gid, tig)'s part of the sequence's query at k-step kc: q3[0] = f16x2 of q[gid] / 3 at
// channels (0, 1) of codes_channel, q3[1] at (2, 3); 0 for a column beyond the group. `q3max`:
// the largest |q / 3| so far, NaN-propagating through `fits` (false for |q3| > 65504).
template <int KC>
__device__ __forceinline__ void codes_q_fragment(const float* __restrict__ sq, int kc, int gid, int tig, int group,
                                                 int head_dim, u32 (&q3)[2], float& q3max, bool& fits) {
    float w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float qv = gid < group ? sq[gid * head_dim + codes_channel<KC>(kc, tig, i)] : 0.f;
        w[i] = codes_round_f16(__fdiv_rn(qv, 3.f));
        fits = fits && fabsf(w[i]) <= 65504.f;  // false for NaN / inf
        q3max = fmaxf(q3max, fabsf(w[i]));
    }
    q3[0] = f16x2_rn(w[0], w[1]);  // exact: w is an f16 already
    q3[1] = f16x2_rn(w[2], w[3]);
}

// The group-summed query (sum over g of q[g], f32 in g order) at the channels whose ranges lane
// (gid, tig) computes in score_codes_mma_entry: k-step gid's (0 for gid >= KC, whose k-step
// another lane already covers).
template <int KC>
__device__ __forceinline__ void codes_qsum_fragment(const float* __restrict__ sq, int gid, int tig, int group,
                                                    int head_dim, float (&qs)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int d = codes_channel<KC>(gid & (KC - 1), tig, i);
        float v = 0.f;
        for (int g = 0; g < group; ++g) v += sq[g * head_dim + d];
        qs[i] = gid < KC ? v : 0.f;
    }
}

// Four E4M3 bytes of a staged bound row as f32, times the entry's scale `sc` (exact, as
// codes_load_bound): channels e0, e0 + 1, e0 + 8, e0 + 9 (e0 even: two 2-byte loads).
__device__ __forceinline__ void codes_bound4(const unsigned char* __restrict__ row, int e0, float sc,
                                             float (&out)[4]) {
    const u32 w = (u32)*reinterpret_cast<const unsigned short*>(row + e0) |
                  ((u32)*reinterpret_cast<const unsigned short*>(row + e0 + 8) << 16);
    e4m3x4_to_f32(w, out);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __fmul_rn(out[i], sc);
}

// One (block, head) from its staged copy `buf` (returns false, writing nothing, when a channel's
// range may give a weight outside f16: |hi - lo| > lim, or NaN / inf). The ranges are computed
// once per channel: lane (gid, tig) computes k-step gid's four (8 lanes share a tig's channels),
// and each k-step fetches its two f16x2 registers of ranges from lane (kc, tig) with a shuffle;
// the same lane adds its channels' share of (sum over g of q[g]) . lo, reduced over the warp
// in the epilogue.
template <int KC>
__device__ bool score_codes_mma_entry(const unsigned char* __restrict__ buf, const float (&qs)[4],
                                      const u32 (&q3)[KC][2], float lim, float* __restrict__ out, int group,
                                      int head_dim) {
    const int lane = threadIdx.x & 31;
    const int gid = lane >> 2;
    const int tig = lane & 3;
    const float sc = *reinterpret_cast<const float*>(buf + 6 * head_dim);
    const int e0 = codes_channel<KC>(gid & (KC - 1), tig, 0);  // channels e0, e0 + 1, e0 + 8, e0 + 9
    float lp[4], hp[4];
    codes_bound4(buf, e0, sc, lp);
    codes_bound4(buf + head_dim, e0, sc, hp);
    // In codes_channel's order: e0, e0 + 8, e0 + 1, e0 + 9.
    const float lo[4] = {lp[0], lp[2], lp[1], lp[3]};
    const float hi[4] = {hp[0], hp[2], hp[1], hp[3]};
    float r[4];
    bool fits = true;
    float base = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        r[i] = __fsub_rn(hi[i], lo[i]);
        fits = fits && fabsf(r[i]) <= lim;  // false for NaN / inf
        base = fmaf(qs[i], lo[i], base);
    }
    if (!__all_sync(0xffffffffu, fits)) return false;
    const u32 rr0 = f16x2_rn(r[0], r[1]);
    const u32 rr1 = f16x2_rn(r[2], r[3]);
    // Codes: token t's row of head_dim / 4 bytes; this lane's KC bytes (KC / 4 words) of rows gid, gid + 8.
    const unsigned char* cb = buf + 2 * head_dim + tig * KC;
    u32 wl[KC / 4], wh[KC / 4];
#pragma unroll
    for (int u = 0; u < KC / 4; ++u) {
        wl[u] = *reinterpret_cast<const u32*>(cb + gid * (head_dim >> 2) + 4 * u);
        wh[u] = *reinterpret_cast<const u32*>(cb + (gid + 8) * (head_dim >> 2) + 4 * u);
    }
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        const int u = kc >> 2;
        const int m = kc & 3;
        const int src = kc * 4 + tig;
        const u32 b0 = codes_mul_f16x2(q3[kc][0], __shfl_sync(0xffffffffu, rr0, src));
        const u32 b1 = codes_mul_f16x2(q3[kc][1], __shfl_sync(0xffffffffu, rr1, src));
        const u32 a[4] = {codes_f16x2_at(wl[u], 4 * m), codes_f16x2_at(wh[u], 4 * m), codes_f16x2_at(wl[u], 4 * m + 2),
                          codes_f16x2_at(wh[u], 4 * m + 2)};
        mma_f16_16816(c, a, b0, b1);
    }
    codes_mma_epilogue(c, base, gid, tig, lane, group, out);
    return true;
}

// The query of sequence s for KV head h, as f32, into the warp's shared memory.
template <typename T>
__device__ __forceinline__ void codes_load_q(float* __restrict__ sq, const T* __restrict__ q, int s, int h, int group,
                                             int num_qo_heads, int head_dim) {
    const int lane = threadIdx.x & 31;
    const T* qs = q + ((i64)s * num_qo_heads + (i64)h * group) * head_dim;
    __syncwarp();
    for (int x = lane; x < group * head_dim; x += 32) sq[x] = to_f32(qs[x]);
    __syncwarp();
}

// One warp's tile of entries t0 .. t1 for KV head h: lane i holds entry t0 + i's block id
// (tile_idx, -1 when the entry scores -inf: a bad id, a malformed row or an invalid candidate) and
// sequence (tile_seq); entry j's score goes to scores[j * stride] (global memory, or the shared
// scores of rescore_topk_codes_*). KC 4 or 8: the tensor-core path (head_dim 64 or 128), with the entries'
// copies OASIS_CODES_STAGES - 1 ahead; 0: the scalar path only.
template <typename T, int KC>
__device__ void score_codes_tile(float* __restrict__ sm, unsigned char* __restrict__ stage, const T* __restrict__ q,
                                 const unsigned char* __restrict__ bounds8, const float* __restrict__ scales,
                                 const unsigned char* __restrict__ codes, float* __restrict__ scores, int stride,
                                 int tile_idx, int tile_seq, int t0, int t1,
                                 int h, int num_qo_heads, int num_kv_heads, int head_dim, int block_size) {
    constexpr int S = OASIS_CODES_STAGES;
    constexpr int NR = KC > 0 ? KC : 4;  // the scalar-only instance never runs the MMA code
    constexpr int SB = codes_stage_bytes(16 * NR);  // a staged entry of the MMA path
    const int lane = threadIdx.x & 31;
    const int gid = lane >> 2;
    const int tig = lane & 3;
    const int group = num_qo_heads / num_kv_heads;
    const bool mine = lane < t1 - t0;
    if (mine && tile_idx < 0) scores[(i64)(t0 + lane) * stride] = neg_inf();
    const u32 valid = __ballot_sync(0xffffffffu, mine && tile_idx >= 0);
    if (valid == 0u) return;
    float qs[4];
    u32 q3[NR][2];
    bool q_fits = false;  // the held sequence's q3 fit f16 (warp-uniform)
    float lim = 0.f;      // the largest |hi - lo| the tensor-core path takes for that sequence
    int loaded = -1;      // sequence whose query the warp holds
    u32 pending = valid;  // entries not yet copied (warp-uniform)
    // The next entry not yet copied into buffer `buf`, one commit group per call (an empty group
    // once every entry is copied, so that a wait counts entries either way).
    auto copy_next = [&](int buf) {
        if (pending != 0u) {
            const int e = __ffs(pending) - 1;
            pending &= pending - 1u;
            codes_stage_entry<16 * NR>(stage + buf * SB, bounds8, scales, codes,
                                       __shfl_sync(0xffffffffu, tile_idx, e), h, num_kv_heads);
        } else {
            codes_cp_async_commit();
        }
    };
    if (KC > 0) {
#pragma unroll
        for (int i = 0; i < S - 1; ++i) copy_next(i);
    }
    int slot = 0;
    for (u32 todo = valid; todo != 0u; todo &= todo - 1u) {  // warp-uniform
        const int cur = __ffs(todo) - 1;
        if (KC > 0) {
            copy_next(slot == 0 ? S - 1 : slot - 1);  // S - 1 ahead, into the buffer the previous entry used
            codes_cp_async_wait<S - 1>();  // this entry's group is complete
            __syncwarp();
        }
        const int b = __shfl_sync(0xffffffffu, tile_idx, cur);
        const int s = __shfl_sync(0xffffffffu, tile_seq, cur);
        float* out = scores + (i64)(t0 + cur) * stride;
        if (s != loaded) {
            codes_load_q<T>(sm, q, s, h, group, num_qo_heads, head_dim);
            loaded = s;
            if (KC > 0) {
                bool fits = true;
                float q3max = 0.f;
#pragma unroll
                for (int kc = 0; kc < NR; ++kc)
                    codes_q_fragment<NR>(sm, kc, gid, tig, group, head_dim, q3[kc], q3max, fits);
                codes_qsum_fragment<NR>(sm, gid, tig, group, head_dim, qs);
                q_fits = __all_sync(0xffffffffu, fits);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) q3max = fmaxf(q3max, __shfl_xor_sync(0xffffffffu, q3max, o));
                lim = OASIS_CODES_F16_SAFE / fmaxf(q3max, 1.f);
            }
        }
        if (!(KC > 0 && q_fits &&
              score_codes_mma_entry<NR>(stage + slot * SB, qs, q3, lim, out, group, 16 * NR))) {
            score_codes_scalar_entry(sm, bounds8, scales, codes, out, b, h, group, num_kv_heads, head_dim, block_size);
        }
        if (KC > 0) {
            __syncwarp();  // every lane is done with this buffer before a copy into it
            slot = slot == S - 1 ? 0 : slot + 1;
        }
    }
}

// The tensor-core path's alignment: its 16-byte copies of the bound rows and the codes, and its
// 4-byte copy of the scale (a misaligned view takes the exact scalar path).
__device__ __forceinline__ bool codes_mma_aligned(const unsigned char* bounds8, const float* scales,
                                                  const unsigned char* codes) {
    const unsigned long long b = reinterpret_cast<unsigned long long>(bounds8);
    const unsigned long long c = reinterpret_cast<unsigned long long>(codes);
    const unsigned long long f = reinterpret_cast<unsigned long long>(scales);
    return ((b | c) & 15ull) == 0ull && (f & 3ull) == 0ull;
}

// grid: thread block c scores OASIS_CODES_THREADS / 32 consecutive tiles of `tile` (at most
// OASIS_CODES_TILE) entries for head c % num_kv_heads (as score_blocks_* with OASIS_SCORE_HEAD_MAJOR); dynamic
// shared memory (oasis_cuda::ops::score_blocks_codes_smem_bytes): each warp's
// OASIS_CODES_STAGES staging buffers, then codes_scalar_warp_floats(group, head_dim) floats per
// warp. Entry (j, h) = sum over query heads g of KV head h of max over tokens t of
//   sum_d q[s,g,d] lo[b,h,d] + sum_d c[b,h,t,d] w[g,d],  w = codes_weight(q[s,g,d], lo, hi)
// with [lo, hi] the decoded bound of b = blk_indices[j] and s the sequence whose CSR range holds j
// (NaN for a NaN scale). An out-of-range block id, and an entry outside every well-formed row,
// scores -inf (never selected). With cand (the second
// stage of KvConfig(score_candidates)): entry (s cand_m + i, h) scores the logical block
// cand[s, h, i] of sequence s for head h alone, -inf for a negative candidate or one outside s's
// row (CPU twin: oasis_core::kernels::rescore_blocks_codes).
template <typename T>
__device__ void score_blocks_codes_impl(
    const T* __restrict__ q,                   // [num_seqs, num_qo_heads, head_dim] (the lookahead row)
    const unsigned char* __restrict__ bounds8, // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3
    const float* __restrict__ scales,          // [num_host_blocks, num_kv_heads]
    const unsigned char* __restrict__ codes,   // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    const int* __restrict__ blk_indptr,      // [num_seqs + 1]
    const int* __restrict__ blk_indices,     // [nnz] host block of each logical block, logical order
    float* __restrict__ scores,              // [nnz, num_kv_heads]; with cand [num_seqs * cand_m, num_kv_heads]
    const int* __restrict__ cand,            // [num_seqs, num_kv_heads, cand_m] logical blocks, or null
    int num_seqs, int nnz, int num_qo_heads, int num_kv_heads, int head_dim, int block_size, int num_host_blocks,
    int cand_m, int tile_arg) {
    extern __shared__ __align__(16) float codes_smem[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    // With candidates, entry j = s cand_m + i is candidate i of sequence s for this head.
    const bool staged = cand != nullptr && cand_m > 0;
    const int n_out = staged ? num_seqs * cand_m : nnz;
    // Entries per warp: at most a lane each (each lane resolves one entry's block id below).
    const int tile = max(1, min(tile_arg, OASIS_CODES_TILE));
    const i64 num_tiles = ((i64)n_out + tile - 1) / tile;
    const int h = (int)(blockIdx.x % (unsigned)num_kv_heads);
    const i64 tile_l = (i64)(blockIdx.x / (unsigned)num_kv_heads) * (blockDim.x >> 5) + warp;
    if (tile_l >= num_tiles) return;  // warp-uniform
    const int t0 = (int)tile_l * tile;
    const int t1 = min(n_out, t0 + tile);
    if (num_seqs <= 0) {  // no row at all (blk_indptr = [x]): every entry scores -inf
        if (t0 + lane < t1) scores[(i64)(t0 + lane) * num_kv_heads + h] = neg_inf();
        return;
    }
    const int group = num_qo_heads / num_kv_heads;
    const int sb = codes_stage_bytes(head_dim);
    unsigned char* smem_bytes = reinterpret_cast<unsigned char*>(codes_smem);
    unsigned char* stage = smem_bytes + (i64)warp * OASIS_CODES_STAGES * sb;
    float* sm = reinterpret_cast<float*>(smem_bytes + (i64)(blockDim.x >> 5) * OASIS_CODES_STAGES * sb) +
                (i64)warp * codes_scalar_warp_floats(group, head_dim);
    // The tensor-core path's shapes (warp-uniform); anything else takes the exact scalar path.
    const bool mma = block_size == 16 && (head_dim == 128 || head_dim == 64) && group <= 8 &&
                     codes_mma_aligned(bounds8, scales, codes);
    // Each lane resolves its own entry: sequence, row check and block id (-1: scores -inf). A
    // candidate outside its sequence's well-formed row (or negative) gets -1.
    int tile_idx = -1;
    int tile_seq = 0;
    const int jl = t0 + lane;
    if (jl < t1 && staged) {
        tile_seq = jl / cand_m;
        const int c = cand[((i64)tile_seq * num_kv_heads + h) * cand_m + (jl - tile_seq * cand_m)];
        const int row_b = blk_indptr[tile_seq];
        const int row_e = blk_indptr[tile_seq + 1];
        if (c >= 0 && 0 <= row_b && row_b <= row_e && row_e <= nnz && c < row_e - row_b) tile_idx = blk_indices[row_b + c];
    } else if (jl < t1) {
        tile_seq = score_codes_seq_of(blk_indptr, num_seqs, jl);
        const int row_b = blk_indptr[tile_seq];
        const int row_e = blk_indptr[tile_seq + 1];
        if (0 <= row_b && row_b <= jl && jl < row_e && row_e <= nnz) tile_idx = blk_indices[jl];
    }
    if (tile_idx >= num_host_blocks) tile_idx = -1;
#define OASIS_CODES_TILE_ARGS                                                                               \
    sm, stage, q, bounds8, scales, codes, scores + h, num_kv_heads, tile_idx, tile_seq, t0, t1, h,           \
        num_qo_heads, num_kv_heads, head_dim, block_size
    if (mma && head_dim == 128) {
        score_codes_tile<T, 8>(OASIS_CODES_TILE_ARGS);
    } else if (mma) {
        score_codes_tile<T, 4>(OASIS_CODES_TILE_ARGS);
    } else {
        score_codes_tile<T, 0>(OASIS_CODES_TILE_ARGS);
    }
#undef OASIS_CODES_TILE_ARGS
}

// ---- the candidates' codes score and their top-K in one launch ---------------------------------

// Threads per block of rescore_topk_codes_* (a multiple of 32; oasis_cuda::ops::RESCORE_TOPK_THREADS
// must match): score_blocks_codes_*'s shape (and its register bound, OASIS_CODES_MIN_BLOCKS), so
// that the rescoring keeps as many warps per SM; the top-K's buffers reuse the staging memory.
#ifndef OASIS_RESCORE_TOPK_THREADS
#define OASIS_RESCORE_TOPK_THREADS 128
#endif

// grid (num_seqs, num_kv_heads, splits), blockDim.x a multiple of 32; m + successors <=
// OASIS_CAND_MAX. Thread block (s, h, c) computes score_blocks_codes_impl's scores of the
// candidates cand[s, h, c chunk .. (c + 1) chunk) (the same per-entry code, one tile of `tile`
// entries per warp, so the same bits) into scratch[s, h, .]; the last of the row's `splits`
// blocks to finish (a ticket on counters[s, h], which it sets back to 0 for the next launch)
// copies the row's m scores into shared memory and runs topk_candidates_core over them: exactly
// rescore_blocks_codes followed by topk_candidates_f32, in one launch with the rescoring spread
// over as many warps (the reduction between them is the identity; oasis_core::kernels::
// rescore_topk_codes is the CPU twin). Dynamic shared memory
// (oasis_cuda::ops::rescore_topk_codes_smem_bytes): each warp's OASIS_CODES_STAGES staging
// buffers, then codes_scalar_warp_floats(group, head_dim) floats per warp; once every warp has
// scored, the last block reuses it from the start for topk_candidates_core's sel buffer, the m
// scores and its other buffers (topk_candidates_bytes).
template <typename T>
__device__ void rescore_topk_codes_impl(
    const T* __restrict__ q,                   // [num_seqs, num_qo_heads, head_dim] (the lookahead row)
    const unsigned char* __restrict__ bounds8, // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3
    const float* __restrict__ scales,          // [num_host_blocks, num_kv_heads]
    const unsigned char* __restrict__ codes,   // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    const int* __restrict__ blk_indptr,      // [num_seqs + 1]
    const int* __restrict__ blk_indices,     // [nnz] host block of each logical block, logical order
    const int* __restrict__ cand,            // [num_seqs, num_kv_heads, m] logical blocks, < 0: none
    const int* __restrict__ forced,          // [num_seqs, num_kv_heads, n_forced], or null
    int* __restrict__ out,                   // [num_seqs, num_kv_heads, k]
    float* scratch,                          // [num_seqs, num_kv_heads, m] the scores
    int* counters,                           // [num_seqs, num_kv_heads] 0 before and after
    int nnz, int num_qo_heads, int num_kv_heads, int head_dim, int block_size, int num_host_blocks, int m, int k,
    int successors, int n_forced, int tile) {
    extern __shared__ __align__(16) float codes_smem[];
    __shared__ int s_last;
    const int s = blockIdx.x;
    const int h = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int group = num_qo_heads / num_kv_heads;
    const int sb = codes_stage_bytes(head_dim);
    unsigned char* smem_bytes = reinterpret_cast<unsigned char*>(codes_smem);
    unsigned char* stage = smem_bytes + (i64)warp * OASIS_CODES_STAGES * sb;
    float* scalar = reinterpret_cast<float*>(smem_bytes + (i64)warps * OASIS_CODES_STAGES * sb);
    float* sm = scalar + (i64)warp * codes_scalar_warp_floats(group, head_dim);
    const bool mma = block_size == 16 && (head_dim == 128 || head_dim == 64) && group <= 8 &&
                     codes_mma_aligned(bounds8, scales, codes);
    // The row check of score_blocks_codes_impl's candidates (against the indices' length).
    const int row_b = blk_indptr[s];
    const int row_e = blk_indptr[s + 1];
    const bool row_ok = 0 <= row_b && row_b <= row_e && row_e <= nnz;
    const i64 row = (i64)s * num_kv_heads + h;
    const int* cs = cand + row * m;
    float* sc = scratch + row * m;
    // This block's tile: warp w scores candidates t0 .. t1 (warp-uniform).
    tile = max(1, min(tile, OASIS_CODES_TILE));
    const int t0 = ((int)blockIdx.z * warps + warp) * tile;
    if (t0 < m) {
        const int t1 = min(m, t0 + tile);
        int tile_idx = -1;
        const int i = t0 + lane;
        if (i < t1 && row_ok) {
            const int c = cs[i];
            if (c >= 0 && c < row_e - row_b) tile_idx = blk_indices[row_b + c];
        }
        if (tile_idx >= num_host_blocks) tile_idx = -1;
#define OASIS_CODES_TILE_ARGS                                                                                 \
    sm, stage, q, bounds8, scales, codes, sc, 1, tile_idx, s, t0, t1, h, num_qo_heads, num_kv_heads, head_dim,  \
        block_size
        if (mma && head_dim == 128) {
            score_codes_tile<T, 8>(OASIS_CODES_TILE_ARGS);
        } else if (mma) {
            score_codes_tile<T, 4>(OASIS_CODES_TILE_ARGS);
        } else {
            score_codes_tile<T, 0>(OASIS_CODES_TILE_ARGS);
        }
#undef OASIS_CODES_TILE_ARGS
    }
    // The last of the row's blocks selects (the threadFenceReduction pattern): every score
    // written above is visible device-wide before this block takes its ticket.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int ticket = atomicAdd(counters + row, 1);
        s_last = ticket == (int)gridDim.z - 1;
        if (s_last) counters[row] = 0;  // for the next launch (stream order)
    }
    __syncthreads();
    if (!s_last) return;  // block-uniform
    __threadfence();
    // The top-K's buffers over the (now unused) staging memory, in topk_candidates_bytes' order.
    const int sort_n = next_pow2(max(1, m));
    u64* sel = reinterpret_cast<u64*>(smem_bytes);
    float* s_scores = reinterpret_cast<float*>(sel + sort_n);  // [m]
    u32* keys = reinterpret_cast<u32*>(s_scores + m);        // [m + successors]
    int* res = reinterpret_cast<int*>(keys + m + successors);  // [m + successors]
    int* vals = res + m + successors;                          // [m]
    int* succ = vals + m;                                      // [successors]
    int* scan_scratch = succ + successors;                     // [33]
    for (int i = threadIdx.x; i < m; i += blockDim.x) s_scores[i] = __ldcg(sc + i);  // past L1: other SMs wrote them
    __syncthreads();
    // topk_candidates_f32's launch bounds the rows by i32::MAX only (the successors stay inside
    // each row's length): the same here.
    topk_candidates_core(s_scores, 1, cand, blk_indptr, forced, out, num_kv_heads, 0x7fffffff, m, k, successors,
                         n_forced, sel, keys, vals, succ, res, scan_scratch);
}

}  // namespace oasis
