// oasis_attn_tc.cuh — the tensor-core decode attention (decode_attn_tc_impl) and its page
// loaders: T pages, kv8 pages dequantized into a bf16 tile, kv8 pages read by the tensor cores
// from their codes. Included by decode_attn.cu only (its entry points); CPU twins:
// oasis_core::kernels::decode_attention and decode_attention_kv8.
#pragma once
#include "oasis_common.cuh"

namespace oasis {

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
// floats, scan scratch 36 ints; kv8 pages (SCALED) then the items' scales, 2 * (LIST_CAP + 1)
// floats (oasis_cuda::ops::decode_attn_kv8_tc_smem_bytes).
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
    mma_f16_16816(d, a, b0, b1);  // oasis_common.cuh
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
    return f16x2_rn(lo, hi);  // oasis_common.cuh
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

// Bytes 0 and 2 of w into the low half, 1 and 3 into the high half (prmt).
__device__ __forceinline__ u32 bytes_0213(u32 w) {
    u32 r;
    asm("prmt.b32 %0, %1, 0, 0x3120;\n" : "=r"(r) : "r"(w));
    return r;
}

// Two consecutive T values times `down` (a power of two) as an f16x2 (the first in the low half):
// the tensor cores' A operand over E4M3 codes. Exact while the products stay in f16's normal
// range, which the caller's `down` (2^-e, 2^e >= the largest |q|) keeps for all but values 2^-14
// below the largest.
template <typename T>
__device__ __forceinline__ u32 f16x2_of(const T* p, float down) {
    return pack2<f16>(to_f32(p[0]) * down, to_f32(p[1]) * down);
}

// The two f32 of an f16x2.
__device__ __forceinline__ void f16x2_to_f32(u32 w, float& lo, float& hi) {
    asm("{\n"
        " .reg .b16 a, b;\n"
        " mov.b32 {a, b}, %2;\n"
        " cvt.f32.f16 %0, a;\n"
        " cvt.f32.f16 %1, b;\n"
        "}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(w));
}

}  // namespace tc
// ---- end of PTX wrappers -------------------------------------------------------------------

// How the tensor-core kernel stages a warp's work items. Each warp owns WARP_UNITS 16-byte units
// of shared memory `w`. `issue(w, slot, off, xk, xv, nvalid, lane)` starts the cp.async of a
// 16-token chunk at element `off` of the pages (`nvalid` valid rows, the rest zero-filled), or,
// when off < 0, of the extra K/V row `xk`, `xv`, into ring slot `slot` (0..STAGES). Once the copy
// has landed and the warp has synchronised, `tile(w, slot, e, sk, sv, lane)` returns the chunk's K tile as
// ldmatrix reads it (T, 16 rows of D, 16-byte units XOR-swizzled: unit u of row r at u ^ (r & 7)),
// its V tile CHUNK_UNITS units after it; `e` = page * num_kv_heads + head, < 0 for the extra row.
// SCALED loaders (kv8 pages) have per-(page, head) K and V scales: the kernel reads them with the
// item list (`scales`, every item of a round's list at once, so no chunk waits on a scattered
// global load of its own) and hands them to `tile` / the MMA as `sk`, `sv`.

// T pages: the ring holds the swizzled T tiles themselves.
template <typename T, int D, int STAGES>
struct TcElemPages {
    static constexpr bool DIRECT = false;
    static constexpr bool SCALED = false;
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
    __device__ __forceinline__ const uint4* tile(uint4* w, int slot, i64, float, float, int) const {
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
    static constexpr bool DIRECT = false;
    static constexpr bool SCALED = true;
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
    __device__ __forceinline__ void scales(i64 e, float& sk, float& sv) const {
        sk = ks[e];
        sv = vs[e];
    }
    __device__ __forceinline__ const uint4* tile(uint4* w, int slot, i64 e, float sk, float sv, int lane) const {
        const uint4* kc = w + slot * 2 * CODE_UNITS;
        const uint4* vc = kc + CODE_UNITS;
        uint4* kt = w + STAGES * 2 * CODE_UNITS;
        uint4* vt = kt + CHUNK_UNITS;
        if (e >= 0) {
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

// kv8 pages read by the tensor cores from their codes (DIRECT): no dequantized tile. The ring
// holds each chunk's K and V codes as stored (16 rows of D bytes), 16-byte units XOR-swizzled
// (`swz`) so that the 8 row addresses of an ldmatrix hit distinct banks. The kernel takes its
// fragments from the codes themselves: ldmatrix of K's rows gives a thread bytes 4c..4c+3 of a
// token's 16 dims, two f16x2 by one cvt each, which serve as the B operand's k = (2c, 2c+1) and
// (2c+8, 2c+9) once Q's fragments are loaded in the same permuted order; ldmatrix.trans of V's
// rows gives dims (2g, 2g+1) of tokens (2c, 2c+1), which prmt regroups by dim into two B
// operands (even dims, odd dims: the output's columns permuted, undone when it is stored). The
// MMA runs in f16 (Q in units of a power of two at least its largest magnitude, and P, rounded
// to f16; the codes exact); each chunk's K scale multiplies its
// scores and its V scale is carried as the unit of the accumulator (rescaled with the online
// softmax's factor). The extra row (T) is read from global memory by the kernel. TILE: T tiles'
// room kept after the ring (2: the same shared memory as TcKv8Pages, the measured `registers`
// kernel; 0: none, TcKv8DeepPages).
template <typename T, int D, int STAGES, int TILE = 2>
struct TcKv8RegPages {
    static_assert(sizeof(T) == 2 && D % 16 == 0, "kv8 tensor-core pages: 16-bit T, D a multiple of 16");
    static constexpr bool DIRECT = true;
    static constexpr bool SCALED = true;
    static constexpr int UPR = D / 8;
    static constexpr int CHUNK_UNITS = 16 * UPR;   // of a T tile (the kernel's own checks)
    static constexpr int CODE_UPR = D / 16;        // 16-byte units per code row
    static constexpr int CODE_UNITS = 16 * CODE_UPR;
    static constexpr int WARP_UNITS = STAGES * 2 * CODE_UNITS + TILE * CHUNK_UNITS;
    const unsigned char* k;  // [num_pages, num_kv_heads, block_size, head_dim] E4M3 codes
    const unsigned char* v;  // [num_pages, num_kv_heads, block_size, head_dim] E4M3 codes
    const float* ks;         // [num_pages, num_kv_heads]
    const float* vs;         // [num_pages, num_kv_heads]

    // Unit `col` of code row `row` in the ring: 8 consecutive rows of one unit in 8 bank slots.
    static __device__ __forceinline__ int swz(int row, int col) {
        return CODE_UPR >= 8 ? col ^ (row & 7) : col ^ ((row >> 1) & 3);
    }
    __device__ __forceinline__ void issue(uint4* w, int slot, i64 off, const T*, const T*, int nvalid,
                                          int lane) const {
        if (off < 0) return;  // the extra row: read by the kernel
        uint4* kd = w + slot * 2 * CODE_UNITS;
        uint4* vd = kd + CODE_UNITS;
#pragma unroll
        for (int r = 0; r < CODE_UNITS / 32; ++r) {
            const int unit = lane + 32 * r;
            const int row = unit / CODE_UPR;
            const int col = unit % CODE_UPR;
            const bool ok = row < nvalid;
            const i64 src = off + (ok ? unit * 16 : 0);
            const int dst = row * CODE_UPR + swz(row, col);
            tc::cp_async_16(kd + dst, k + src, ok ? 16 : 0);
            tc::cp_async_16(vd + dst, v + src, ok ? 16 : 0);
        }
    }
    __device__ __forceinline__ void scales(i64 e, float& sk, float& sv) const {
        sk = ks[e];
        sv = vs[e];
    }
    // The chunk's K codes (V's CODE_UNITS after).
    __device__ __forceinline__ const uint4* codes(const uint4* w, int slot) const {
        return w + slot * 2 * CODE_UNITS;
    }
};

// The `registers-deep` kernel's pages: TcKv8RegPages with no tile room, instantiated with twice
// the bf16 kernel's pipeline depth, so that a warp keeps the bf16 kernel's bytes in flight (a
// chunk of codes is half a bf16 chunk's bytes) in the shared memory the tile kernel held.
template <typename T, int D, int STAGES>
using TcKv8DeepPages = TcKv8RegPages<T, D, STAGES, 0>;

// Q's fragments (the A operand: rows = query vectors qi = row * group + j of sequence s and KV
// head h, padded with zeros to 16) in P's order; DIRECT: in f16, in units of q_pow.
template <typename T, int D, typename P>
__device__ __forceinline__ void tc_q_fragments(const T* __restrict__ q, int s, int h, int num_rows, int num_qo_heads,
                                               int group, int g, int c, u32 (&qf)[D / 16][4], float& q_pow) {
    const int nq = num_rows * group;
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
    float down = 1.f;  // DIRECT: Q in units of q_pow = 1 / down (see below)
    if constexpr (P::DIRECT) {
        // The largest |q| over the 16 rows, as 2^e: the f16 fragments hold q x 2^-e, so f16's
        // range bounds neither large nor small queries; the scores are multiplied back (s_mul).
        float amax = 0.f;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            if (qrow[hf] != nullptr) {
                for (int x = c; x < D; x += 4) amax = fmaxf(amax, fabsf(to_f32(qrow[hf][x])));
            }
        }
        amax = warp_max(amax);
        int ex = 0;
        if (amax > 0.f && amax <= 3.4e38f) frexpf(amax, &ex);
        ex = max(-126, min(127, ex));
        q_pow = ldexpf(1.f, ex);
        down = ldexpf(1.f, -ex);
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const T* base = qrow[r & 1];
            if constexpr (P::DIRECT) {  // f16, k = (2c, 2c+1) / (2c+8, 2c+9) at dims 4c.. / 4c+2..
                const int x = ks * 16 + 4 * c + 2 * (r >> 1);
                qf[ks][r] = base != nullptr ? tc::f16x2_of<T>(base + x, down) : 0u;
            } else {
                const int x = ks * 16 + 2 * c + 8 * (r >> 1);
                qf[ks][r] = base != nullptr ? *(const u32*)(base + x) : 0u;
            }
        }
    }
}

// S = Q K^T of one 16-token chunk (two n-tiles of 8 tokens) into `sc` (zeroed by the caller),
// from ring slot `slot` of the warp's buffers `wbuf`; `e` = page * num_kv_heads + head, < 0 for
// the extra row `xk`; `sk`, `sv` its K and V scales (SCALED pages). DIRECT: multiplies `s_mul` by
// `sk` and sets `v_scale` to `sv`. Returns the chunk's K tile (T pages: the T tile; DIRECT: the K
// codes), V after it.
template <typename T, int D, typename P>
__device__ __forceinline__ const uint4* tc_chunk_scores(const P& pages, uint4* wbuf, int slot, i64 e, float sk,
                                                        float sv, const u32 (&qf)[D / 16][4], const T* __restrict__ xk,
                                                        int lane, int c, float& s_mul, float& v_scale,
                                                        float (&sc)[2][4]) {
    constexpr int UPR = D / 8;
    const uint4* kb = nullptr;
    if constexpr (P::DIRECT) {
        kb = pages.codes(wbuf, slot);
        if (e >= 0) {
            s_mul *= sk;
            v_scale = sv;
            // ldmatrix x4: tokens 0-7 / 8-15 of units ks and ks + 1.
#pragma unroll
            for (int ks = 0; ks < D / 16; ks += 2) {
                const int tok = (((lane >> 3) & 1) << 3) + (lane & 7);
                const int unit = ks + (lane >> 4);
                u32 b[4];
                tc::ldmatrix_x4(b, kb + tok * P::CODE_UPR + P::swz(tok, unit));
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    u32 b0, b1;
                    e4m3x4_to_f16x2(b[m], b0, b1);
                    tc::mma16816<f16>(sc[m & 1], qf[ks + (m >> 1)], b0, b1);
                }
            }
        } else {  // the extra row: token 0's score, q . xk over this thread's dims
            float d0 = 0.f, d1 = 0.f;
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int x = ks * 16 + 4 * c + 2 * (r >> 1);
                    float q0, q1;
                    tc::f16x2_to_f32(qf[ks][r], q0, q1);
                    const float d = q0 * to_f32(xk[x]) + q1 * to_f32(xk[x + 1]);
                    if (r & 1) d1 += d; else d0 += d;
                }
            }
            d0 += __shfl_xor_sync(0xffffffffu, d0, 1);
            d0 += __shfl_xor_sync(0xffffffffu, d0, 2);
            d1 += __shfl_xor_sync(0xffffffffu, d1, 1);
            d1 += __shfl_xor_sync(0xffffffffu, d1, 2);
            sc[0][0] = d0;  // token 2c = 0 where c == 0; the mask drops every other token
            sc[0][2] = d1;
        }
    } else {
        kb = pages.tile(wbuf, slot, e, sk, sv, lane);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const int tok = ((lane >> 4) << 3) + (lane & 7);
            const int unit = 2 * ks + ((lane >> 3) & 1);
            u32 b[4];
            tc::ldmatrix_x4(b, kb + tok * UPR + (unit ^ (tok & 7)));
            tc::mma16816<T>(sc[0], qf[ks], b[0], b[1]);
            tc::mma16816<T>(sc[1], qf[ks], b[2], b[3]);
        }
    }
    return kb;
}

// O += P V for one chunk: `pa` = P as the A operand (k = token), `kb` the chunk's K tile / codes
// (V after it), `e` < 0 for the extra row `xv` (DIRECT: P from `sc`, token 0). DIRECT: o's tiles
// 2u, 2u + 1 hold the even / odd dims of unit u (element j at dim 16u + 4c + 2j, + 1 if odd).
template <typename T, int D, typename P>
__device__ __forceinline__ void tc_chunk_pv(const uint4* kb, i64 e, const u32 (&pa)[4], const float (&sc)[2][4],
                                            const T* __restrict__ xv, int lane, int c, float (&o)[D / 8][4]) {
    constexpr int UPR = D / 8;
    constexpr int CHUNK_UNITS = 16 * UPR;
    if constexpr (P::DIRECT) {
        // o[2u] / o[2u + 1]: the even / odd dims of unit u (16 dims), element j of the
        // accumulator at dim 16u + 4c + 2j (even) or + 1 (odd).
        if (e >= 0) {
            const uint4* vb = kb + P::CODE_UNITS;
#pragma unroll
            for (int dn = 0; dn < D / 16; dn += 2) {
                const int tok = (((lane >> 3) & 1) << 3) + (lane & 7);
                const int unit = dn + (lane >> 4);
                u32 b[4];  // tokens 0-7 / 8-15 of units dn and dn + 1, transposed
                tc::ldmatrix_x4_trans(b, vb + tok * P::CODE_UPR + P::swz(tok, unit));
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    u32 ev0, od0, ev1, od1;
                    e4m3x4_to_f16x2(tc::bytes_0213(b[2 * hf]), ev0, od0);
                    e4m3x4_to_f16x2(tc::bytes_0213(b[2 * hf + 1]), ev1, od1);
                    tc::mma16816<f16>(o[2 * (dn + hf)], pa, ev0, ev1);
                    tc::mma16816<f16>(o[2 * (dn + hf) + 1], pa, od0, od1);
                }
            }
        } else {  // the extra row: o += p(token 0) * xv, p from the group's thread c == 0
            const float p0 = __shfl_sync(0xffffffffu, sc[0][0], lane & ~3);
            const float p1 = __shfl_sync(0xffffffffu, sc[0][2], lane & ~3);
#pragma unroll
            for (int u = 0; u < D / 16; ++u) {
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const float xvv = to_f32(xv[u * 16 + 4 * c + jj]);
                    o[2 * u + (jj & 1)][jj >> 1] += p0 * xvv;
                    o[2 * u + (jj & 1)][(jj >> 1) + 2] += p1 * xvv;
                }
            }
        }
    } else {
        const uint4* vb = kb + CHUNK_UNITS;
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
}

// One chunk's online-softmax step on the accumulator fragments (rows g: elements 0, 1; rows
// g + 8: elements 2, 3): mask (tokens past `nvalid`, rows below `row_lo`), scale by `s_mul`
// (log2 units), the running max `m_r` and sums `l_r`, o rescaled; P into `sc` and, as the MMA's A
// operand, into `pa`. DIRECT: o is carried in units of the last chunk's V scale (`o_unit`).
template <typename T, int D, typename P>
__device__ __forceinline__ void tc_softmax_step(float (&sc)[2][4], int nvalid, int row_lo, float s_mul, float v_scale,
                                                int g, int c, float (&m_r)[2], float (&l_r)[2], float& o_unit,
                                                float (&o)[D / 8][4], u32 (&pa)[4]) {
    // Mask, scale, online softmax (rows g: elements 0, 1; rows g + 8: elements 2, 3).
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int tok = nt * 8 + 2 * c + (e & 1);
            const int qi = g + 8 * (e >> 1);
            const bool ok = tok < nvalid && qi >= row_lo;
            sc[nt][e] = ok ? sc[nt][e] * s_mul : neg_inf();
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
    float p_mul = 1.f;  // DIRECT: 0 for a chunk whose V scale is 0 (its codes add nothing)
    if constexpr (P::DIRECT) {
        if (v_scale != 0.f) {  // o to the unit of this chunk's V scale
            const float ratio = o_unit / v_scale;  // alpha 0 (nothing yet) stays 0
            alpha[0] = alpha[0] == 0.f ? 0.f : alpha[0] * ratio;
            alpha[1] = alpha[1] == 0.f ? 0.f : alpha[1] * ratio;
            o_unit = v_scale;
        } else {
            p_mul = 0.f;
        }
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        o[nt][0] *= alpha[0];
        o[nt][1] *= alpha[0];
        o[nt][2] *= alpha[1];
        o[nt][3] *= alpha[1];
    }
    // P as the A operand (k = token): the two S n-tiles are its two k halves.
    if constexpr (P::DIRECT) {
        pa[0] = tc::pack2<f16>(sc[0][0] * p_mul, sc[0][1] * p_mul);
        pa[1] = tc::pack2<f16>(sc[0][2] * p_mul, sc[0][3] * p_mul);
        pa[2] = tc::pack2<f16>(sc[1][0] * p_mul, sc[1][1] * p_mul);
        pa[3] = tc::pack2<f16>(sc[1][2] * p_mul, sc[1][3] * p_mul);
    } else {
        pa[0] = tc::pack2<T>(sc[0][0], sc[0][1]);
        pa[1] = tc::pack2<T>(sc[0][2], sc[0][3]);
        pa[2] = tc::pack2<T>(sc[1][0], sc[1][1]);
        pa[3] = tc::pack2<T>(sc[1][2], sc[1][3]);
    }
}

// This warp's state into the merge buffers: o (DIRECT: its columns back in place, in units of 1)
// into red_o rows [16][D + 8], m and l (the group's four lanes summed by the caller) into red_m /
// red_l.
template <int D, typename P>
__device__ __forceinline__ void tc_store_warp_state(float* red_o, float* red_m, float* red_l, int warp, int g, int c,
                                                    const float (&o)[D / 8][4], float o_unit, const float (&m_r)[2],
                                                    const float (&l_r)[2]) {
    constexpr int OSTRIDE = D + 8;
        float* ro = red_o + warp * 16 * OSTRIDE;
        if constexpr (P::DIRECT) {  // the permuted columns back in place, in units of 1
#pragma unroll
            for (int u = 0; u < D / 16; ++u) {
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const int x = u * 16 + 4 * c + jj;
                    ro[g * OSTRIDE + x] = o[2 * u + (jj & 1)][jj >> 1] * o_unit;
                    ro[(g + 8) * OSTRIDE + x] = o[2 * u + (jj & 1)][(jj >> 1) + 2] * o_unit;
                }
            }
        } else {
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                const int x = nt * 8 + 2 * c;
                ro[g * OSTRIDE + x] = o[nt][0];
                ro[g * OSTRIDE + x + 1] = o[nt][1];
                ro[(g + 8) * OSTRIDE + x] = o[nt][2];
                ro[(g + 8) * OSTRIDE + x + 1] = o[nt][3];
            }
        }
        if (c == 0) {
            red_m[warp * 16 + g] = m_r[0];
            red_m[warp * 16 + g + 8] = m_r[1];
            red_l[warp * 16 + g] = l_r[0];
            red_l[warp * 16 + g + 8] = l_r[1];
        }
}

// The warps' states merged per (query vector, dim): the output (one split) or the split's
// normalised partial output and log-sum-exp (several), as decode_attn_impl writes them.
template <typename T, int D>
__device__ __forceinline__ void tc_merge_warps(const float* red_o, const float* red_m, const float* red_l, int nq,
                                               int group, int s, int h, int num_rows, int num_qo_heads, int split,
                                               int num_splits, T* __restrict__ out, float* __restrict__ tmp_out,
                                               float* __restrict__ tmp_lse) {
    constexpr int WARPS = OASIS_TC_WARPS;
    constexpr int THREADS = WARPS * 32;
    constexpr int OSTRIDE = D + 8;
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
    // SCALED pages: the items' K and V scales, [LIST_CAP + 1] each (not there for T pages)
    float* list_sk = (float*)(scan_scratch + 36);
    float* list_sv = list_sk + (LIST_CAP + 1);
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
    float q_pow = 1.f;  // DIRECT: the fragments hold q / q_pow
    tc_q_fragments<T, D, P>(q, s, h, num_rows, num_qo_heads, group, g, c, qf, q_pow);

    float o[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m_r[2] = {neg_inf(), neg_inf()};  // running max (log2 units) of rows g, g + 8
    float l_r[2] = {0.f, 0.f};              // this thread's part of the running sums
    float o_unit = 1.f;  // DIRECT: o holds O / o_unit (the last chunk's V scale)

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
        float c_sk[PER_THREAD], c_sv[PER_THREAD];
        int cnt = 0;
#pragma unroll
        for (int u = 0; u < PER_THREAD; ++u) {
            const int idx = threadIdx.x * PER_THREAD + u;
            c_page[u] = -1;
            c_info[u] = 0;
            c_sk[u] = c_sv[u] = 1.f;
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
                    if constexpr (P::SCALED) pages.scales((i64)page * num_kv_heads + h, c_sk[u], c_sv[u]);
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
                if constexpr (P::SCALED) {
                    list_sk[pos] = c_sk[u];
                    list_sv[pos] = c_sv[u];
                }
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

            // S = Q Kᵀ: two n-tiles of 8 tokens.
            float sc[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
            float s_mul = scale_log2 * q_pow;
            float v_scale = 1.f;  // DIRECT: this chunk's V scale (1 for the extra row, which is T)
            const float sk = P::SCALED && e >= 0 ? list_sk[j] : 1.f;
            const float sv = P::SCALED && e >= 0 ? list_sv[j] : 1.f;
            const uint4* kb = tc_chunk_scores<T, D, P>(pages, wbuf, i % STAGES, e, sk, sv, qf, xk, lane, c, s_mul,
                                                       v_scale, sc);

            u32 pa[4];
            tc_softmax_step<T, D, P>(sc, nvalid, row_lo, s_mul, v_scale, g, c, m_r, l_r, o_unit, o, pa);
            // O += P V: V fragments transposed by ldmatrix, two n-tiles of 8 dims per load.
            tc_chunk_pv<T, D, P>(kb, e, pa, sc, xv, lane, c, o);
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
    tc_store_warp_state<D, P>(red_o, red_m, red_l, warp, g, c, o, o_unit, m_r, l_r);
    __syncthreads();
    tc_merge_warps<T, D>(red_o, red_m, red_l, nq, group, s, h, num_rows, num_qo_heads, split, num_splits, out,
                         tmp_out, tmp_lse);
}

}  // namespace oasis
