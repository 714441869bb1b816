// norm_rope.cu — the decoder's per-token elementwise work in one launch each (issue 10): RMSNorm
// with an optional fused residual add, the attention prologue (Qwen3's per-head q/k RMSNorm,
// rotate-half RoPE, the V copy) straight from the fused QKV projection, and the MLP's SwiGLU
// activation (silu(gate) * up) straight from the fused gate/up projection.
//
// CPU twins: oasis_core::kernels::rms_norm, oasis_core::kernels::qk_norm_rope and
// oasis_core::kernels::silu_mul, which compute the same bits (their module docs give the
// formulas): every product and sum is one separately rounded f32 operation (__fmul_rn /
// __fadd_rn, so nothing is contracted into an FMA), the sum of squares takes the twins' order
// (block_tree_sum below), the division and square root are IEEE, and cos/sin/exp are evaluated
// in double and rounded to f32 (the correctly rounded value, which the twin also computes).
#include "oasis_common.cuh"
#include "oasis_params.cuh"

// Warps per qk_norm_rope block, one head each; must match QK_ROPE_WARPS in
// crates/oasis-cuda/src/ops/mod.rs. Arbitrary.
#define OASIS_QK_ROPE_WARPS 4

namespace oasis {

// Sum of `v` over the whole block (blockDim.x a multiple of 32, at most 1024), in the order of
// oasis_core::kernels::norm::tree_sum: each warp's xor butterfly (warp_sum), then one more
// butterfly over the warp totals padded with zeros to 32 lanes, done by every warp so that every
// thread gets the total without a second barrier. `scratch` holds 32 floats of shared memory.
// Every thread must call it.
__device__ __forceinline__ float block_tree_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (nwarps == 1) return v;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < nwarps ? scratch[lane] : 0.0f);
}

// 1 / sqrt(sum / len + eps), IEEE-rounded at each step (torch's mean divides on the CPU).
__device__ __forceinline__ float inv_rms(float sum_squares, int len, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_squares, (float)len), eps)));
}

// grid (n), blockDim.x = oasis_core::kernels::norm::rms_norm_threads(hidden) (the twin's order of
// the sum of squares depends on it). `residual` and `residual_out` may be the same buffer (each
// element is read before it is written, by the thread that writes it), so neither is __restrict__;
// both null, or both set.
template <typename T>
__device__ void rms_norm_impl(
    const T* __restrict__ x,      // [n, x_stride] rows of hidden elements
    const T* __restrict__ weight, // [hidden]
    const T* residual,            // [n, hidden] or null
    T* residual_out,              // [n, hidden] or null; may be `residual` itself
    T* __restrict__ out,          // [n, hidden]
    i64 x_stride, int hidden, float eps) {
    __shared__ float scratch[32];
    const i64 row = blockIdx.x;
    const T* xr = x + row * x_stride;
    const i64 base = row * hidden;
    float acc = 0.0f;
    if (residual_out != nullptr) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            // torch's `residual + x` in the storage type: an f32 sum rounded once.
            const T h = from_f32<T>(__fadd_rn(to_f32(xr[i]), to_f32(residual[base + i])));
            residual_out[base + i] = h;
            const float v = to_f32(h);
            acc = __fadd_rn(acc, __fmul_rn(v, v));
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            const float v = to_f32(xr[i]);
            acc = __fadd_rn(acc, __fmul_rn(v, v));
        }
    }
    const float r = inv_rms(block_tree_sum(acc, scratch), hidden, eps);
    // The second pass reads back what this thread wrote (the rounded h) or x again.
    const T* src = residual_out != nullptr ? residual_out + base : xr;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const T y = from_f32<T>(__fmul_rn(to_f32(src[i]), r));
        out[base + i] = from_f32<T>(__fmul_rn(to_f32(weight[i]), to_f32(y)));
    }
}

// grid (n, ceil((num_heads + 2 * num_kv_heads) / OASIS_QK_ROPE_WARPS)), OASIS_QK_ROPE_WARPS warps
// of 32 threads, OASIS_QK_ROPE_WARPS * head_dim floats of dynamic shared memory. Warp w of block
// (t, b) takes head j = b * WARPS + w of row t: a query head (j < num_heads), a key head, or a
// value head (copied). Only warp-level synchronisation, so a warp past the last head just leaves.
// With kv_groups = G > 1 the n rows are n / G groups of G (row t = s * G + r), and row t's key and
// value heads go to row r * (n / G) + s of k_out, v_out: each of a decode step's rows (the token,
// the lookahead draft) contiguous for the attention, without a copy; q_out keeps row t.
template <typename T>
__device__ void qk_norm_rope_impl(
    const T* __restrict__ qkv,             // [n, qkv_stride] rows of (num_heads + 2 * num_kv_heads) * head_dim
    const long long* __restrict__ pos64,   // [n] or null (then pos32)
    const int* __restrict__ pos32,         // [n] or null (then pos64)
    const float* __restrict__ inv_freq,    // [head_dim / 2]
    const T* __restrict__ q_norm,          // [head_dim] or null (no q/k norm)
    const T* __restrict__ k_norm,          // [head_dim] or null, null exactly when q_norm is
    T* __restrict__ q_out,                 // [n, num_heads, head_dim]
    T* __restrict__ k_out,                 // [n, num_kv_heads, head_dim]
    T* __restrict__ v_out,                 // [n, num_kv_heads, head_dim]
    i64 qkv_stride, int num_heads, int num_kv_heads, int head_dim, float eps, int kv_groups, int num_rows,
    float rope_scale) {
    extern __shared__ float qk_smem[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int j = blockIdx.y * OASIS_QK_ROPE_WARPS + warp;
    if (j >= num_heads + 2 * num_kv_heads) return;
    const i64 t = blockIdx.x;
    const i64 t_kv = kv_groups > 1 ? (t % kv_groups) * (num_rows / kv_groups) + t / kv_groups : t;
    const T* src = qkv + t * qkv_stride + (i64)j * head_dim;
    if (j >= num_heads + num_kv_heads) {
        const int hv = j - num_heads - num_kv_heads;
        T* dst = v_out + (t_kv * num_kv_heads + hv) * head_dim;
        for (int d = lane; d < head_dim; d += 32) dst[d] = src[d];
        return;
    }
    const bool is_q = j < num_heads;
    T* dst = is_q ? q_out + (t * num_heads + j) * head_dim
                  : k_out + (t_kv * num_kv_heads + (j - num_heads)) * head_dim;
    const T* w = is_q ? q_norm : k_norm;

    // The head in f32 (normalised and rounded to T when there is a norm), for the partner reads.
    float* buf = qk_smem + warp * head_dim;
    float acc = 0.0f;
    for (int d = lane; d < head_dim; d += 32) {
        const float v = to_f32(src[d]);
        buf[d] = v;
        acc = __fadd_rn(acc, __fmul_rn(v, v));
    }
    if (w != nullptr) {
        // One warp: its butterfly is the twin's tree_sum over 32 threads.
        const float r = inv_rms(warp_sum(acc), head_dim, eps);
        for (int d = lane; d < head_dim; d += 32) {
            const T y = from_f32<T>(__fmul_rn(buf[d], r));
            buf[d] = to_f32(from_f32<T>(__fmul_rn(to_f32(w[d]), to_f32(y))));
        }
    }
    __syncwarp();

    const float pos = pos64 != nullptr ? (float)pos64[t] : (float)pos32[t];
    const int half = head_dim >> 1;
    for (int d = lane; d < head_dim; d += 32) {
        const bool lo = d < half;
        const int i = lo ? d : d - half;
        double s, c;
        sincos((double)__fmul_rn(pos, inv_freq[i]), &s, &c);
        // Scaled in f32, then rounded to T: transformers' cos * attention_scaling, .to(dtype).
        const float cs = to_f32(from_f32<T>(__fmul_rn(__double2float_rn(c), rope_scale)));
        const float sn = to_f32(from_f32<T>(__fmul_rn(__double2float_rn(s), rope_scale)));
        const float rot = lo ? -buf[d + half] : buf[d - half];
        const float a = to_f32(from_f32<T>(__fmul_rn(buf[d], cs)));
        const float b = to_f32(from_f32<T>(__fmul_rn(rot, sn)));
        dst[d] = from_f32<T>(__fadd_rn(a, b));
    }
}

// silu_mul: out[r, c] = T(f32(T(silu(g))) * u) with g = gu[r, c], u = gu[r, inter + c] and
// silu(g) = g / (1 + f32(exp(-g))), exp in double (the twin's). Grid-stride over n * inter.
template <typename T>
__device__ void silu_mul_impl(const T* __restrict__ gu, T* __restrict__ out, long long n, int inter) {
    const long long total = n * (long long)inter;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const long long r = i / inter;
        const long long c = i - r * inter;
        const T* row = gu + r * 2 * (long long)inter;
        const float g = to_f32(row[c]);
        const float u = to_f32(row[inter + c]);
        const float e = __double2float_rn(exp(-(double)g));
        const float s = to_f32(from_f32<T>(__fdiv_rn(g, __fadd_rn(1.0f, e))));
        out[i] = from_f32<T>(__fmul_rn(s, u));
    }
}

}  // namespace oasis

// Entry points: one parameter struct each (cuda/oasis_params.cuh), unpacked into the impls.
#define OASIS_RMS_NORM(NAME, T)                                                                     \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::RmsNormParams<T> p) {            \
        oasis::rms_norm_impl<T>(p.x, p.weight, p.residual, p.residual_out, p.out, p.x_stride,       \
                                p.hidden, p.eps);                                                   \
    }

OASIS_RMS_NORM(rms_norm_bf16, oasis::bf16)
OASIS_RMS_NORM(rms_norm_f16, oasis::f16)
OASIS_RMS_NORM(rms_norm_f32, float)

#define OASIS_SILU_MUL(NAME, T)                                                                     \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::SiluMulParams<T> p) {            \
        oasis::silu_mul_impl<T>(p.gu, p.out, p.n, p.inter);                                         \
    }

OASIS_SILU_MUL(silu_mul_bf16, oasis::bf16)
OASIS_SILU_MUL(silu_mul_f16, oasis::f16)
OASIS_SILU_MUL(silu_mul_f32, float)

#define OASIS_QK_NORM_ROPE(NAME, T)                                                                 \
    extern "C" __global__ void NAME(const __grid_constant__ oasis::QkNormRopeParams<T> p) {         \
        oasis::qk_norm_rope_impl<T>(p.qkv, p.positions_i64, p.positions_i32, p.inv_freq, p.q_norm,  \
                                    p.k_norm, p.q_out, p.k_out, p.v_out, p.qkv_stride, p.num_heads, \
                                    p.num_kv_heads, p.head_dim, p.eps, p.kv_groups, p.num_rows,     \
                                    p.rope_scale);                                                  \
    }

OASIS_QK_NORM_ROPE(qk_norm_rope_bf16, oasis::bf16)
OASIS_QK_NORM_ROPE(qk_norm_rope_f16, oasis::f16)
OASIS_QK_NORM_ROPE(qk_norm_rope_f32, float)
