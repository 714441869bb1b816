// oasis_common.cuh — what every OasisKV kernel shares: storage types, f32 conversions, warp and
// block helpers, a shared-memory bitonic sort and a block-wide byte copy.
//
// No framework and no CUDA toolkit header is included on purpose (flashinfer's rule): NVRTC
// compiles these files with nothing but this header, passed to it explicitly by oasis-cuda, so
// the build does not depend on which cuda_fp16.h / cuda_bf16.h a machine happens to have.
// Storage types are plain 16-bit wrappers; arithmetic is always f32.
#pragma once

namespace oasis {

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

// 16-bit storage types: bit patterns only, converted to f32 for every arithmetic operation.
struct __align__(2) bf16 {
    unsigned short bits;
};
struct __align__(2) f16 {
    unsigned short bits;
};

// 8-bit storage of the Quest bound (oasis_core::kernels::bound8): E4M3 bits (sign, 4 exponent
// bits biased by 7, 3 mantissa bits; 0x7f / 0xff NaN, no infinities).
struct fp8e4m3 {
    unsigned char bits;
};

// 2^e as an f32 (-126 <= e <= 127).
__device__ __forceinline__ float exp2i(int e) { return __uint_as_float((u32)(e + 127) << 23); }

// The f32 value of E4M3 bits c, as oasis_core::kernels::bound8::e4m3_decode.
__device__ __forceinline__ float e4m3_decode(u32 c) {
    const u32 ex = (c >> 3) & 15u;
    const u32 m = c & 7u;
    float mag = ex == 0u ? (float)m * 0.001953125f : __uint_as_float(((ex + 120u) << 23) | (m << 20));
    if (ex == 15u && m == 7u) mag = __int_as_float(0x7fc00000);
    return (c & 0x80u) ? -mag : mag;
}
__device__ __forceinline__ float to_f32(fp8e4m3 x) { return e4m3_decode(x.bits); }

// ---- the FP8 (E4M3) KV cache, "kv8" (oasis_core::kernels::kv8 defines it bit for bit) --------
// Codes u8 [pages, kv_heads, block_size, head_dim]; one f32 scale 2^e per (page, KV head), K and V
// apart; a value is e4m3_decode(code) * scale. All of it in software, on purpose: the PTX
// cvt.rn.satfinite.e4m3x2.f32 saturates +-inf to +-448 where the twin stores NaN (0x7f), and a
// plain integer path is bit-identical to the twin on every architecture (NVRTC compiles without
// -ftz, so subnormal f32 inputs round as on the CPU).
#define OASIS_KV8_MIN_EXP (-120)
#define OASIS_KV8_MAX_EXP 120
#define OASIS_KV8_REQUANT_MIN_SHIFT (-24)
#define OASIS_E4M3_NAN 0x7fu

__device__ __forceinline__ bool is_finite_f32(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// oasis_core::kernels::bound8::e4m3_rne: nearest E4M3 value, ties to the even code, sign kept;
// finite magnitudes >= 448 saturate to +-448; NaN and +-inf give OASIS_E4M3_NAN.
__device__ __forceinline__ u32 e4m3_rne(float y) {
    const u32 u = __float_as_uint(y);
    if ((u & 0x7f800000u) == 0x7f800000u) return OASIS_E4M3_NAN;
    const u32 sign = (u >> 24) & 0x80u;
    const float a = __uint_as_float(u & 0x7fffffffu);
    if (a >= 448.f) return sign | 0x7eu;
    if (a < 0.015625f) return sign | (u32)rintf(__fmul_rn(a, 512.f));  // subnormal m 2^-9; m = 8 is 2^-6
    const int e = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;    // -6 ..= 8
    const int r = (int)rintf(__fmul_rn(a, exp2i(3 - e)));              // 8 ..= 16: 16 carries
    return sign | (u32)(((e + 7) << 3) + r - 8);
}

// oasis_core::kernels::kv8::kv8_exponent: the smallest e with absmax <= 448 * 2^e, clamped to
// [OASIS_KV8_MIN_EXP, OASIS_KV8_MAX_EXP]; absmax is finite and >= 0 (0 or subnormal: the minimum).
__device__ __forceinline__ int kv8_exponent(float absmax) {
    if (!(absmax >= 1.17549435e-38f)) return OASIS_KV8_MIN_EXP;
    int e = (int)((__float_as_uint(absmax) >> 23) & 0xffu) - 127 - 8;
    if (e < OASIS_KV8_MIN_EXP) return OASIS_KV8_MIN_EXP;
    if (__fmul_rn(absmax, exp2i(-e)) > 448.f) ++e;
    return e > OASIS_KV8_MAX_EXP ? OASIS_KV8_MAX_EXP : e;
}

// oasis_core::kernels::kv8::kv8_scale_exponent: a stored scale's exponent field, clamped.
__device__ __forceinline__ int kv8_scale_exponent(float scale) {
    const int e = (int)((__float_as_uint(scale) >> 23) & 0xffu) - 127;
    return e < OASIS_KV8_MIN_EXP ? OASIS_KV8_MIN_EXP : (e > OASIS_KV8_MAX_EXP ? OASIS_KV8_MAX_EXP : e);
}

// |x| when x is finite, else 0 (the kv8 absmax leaves NaN and +-inf out).
__device__ __forceinline__ float finite_abs(float x) { return is_finite_f32(x) ? fabsf(x) : 0.f; }

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

// Round to nearest even, like half::bf16::from_f32 / half::f16::from_f32 in the CPU twins.
template <typename T>
__device__ __forceinline__ T from_f32(float x);

template <>
__device__ __forceinline__ float from_f32<float>(float x) {
    return x;
}

template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    u32 u = __float_as_uint(x);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN
        r.bits = (unsigned short)((u >> 16) | 0x0040u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
    return r;
}

template <>
__device__ __forceinline__ f16 from_f32<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// The NaN the CPU twins store for a NaN code dequantized to T (half's from_f32 of f32::NAN, and
// f32::NAN itself): a dequantized kv8 -> T copy is then byte-identical to its twin, NaNs included.
template <typename T>
__device__ __forceinline__ T twin_nan();
template <>
__device__ __forceinline__ float twin_nan<float>() { return __uint_as_float(0x7fc00000u); }
template <>
__device__ __forceinline__ bf16 twin_nan<bf16>() { return bf16{0x7fc0}; }
template <>
__device__ __forceinline__ f16 twin_nan<f16>() { return f16{0x7e00}; }

// Four E4M3 codes (byte b of w is code b) as f32, NaN codes as NaN. sm_89+: two cvt per pair
// (exact: every E4M3 value is an f16, so the values are e4m3_decode's); elsewhere e4m3_decode. The
// gather's dequantization (cuda/gather_blocks.cu) and the tensor-core attention's (decode_attn.cu).
__device__ __forceinline__ void e4m3x4_to_f32(u32 w, float (&out)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n"
        " .reg .b16 a, b, c, d, e, f;\n"
        " .reg .b32 lo, hi;\n"
        " mov.b32 {a, b}, %4;\n"
        " cvt.rn.f16x2.e4m3x2 lo, a;\n"
        " cvt.rn.f16x2.e4m3x2 hi, b;\n"
        " mov.b32 {c, d}, lo;\n"
        " mov.b32 {e, f}, hi;\n"
        " cvt.f32.f16 %0, c;\n"
        " cvt.f32.f16 %1, d;\n"
        " cvt.f32.f16 %2, e;\n"
        " cvt.f32.f16 %3, f;\n"
        "}\n"
        : "=f"(out[0]), "=f"(out[1]), "=f"(out[2]), "=f"(out[3])
        : "r"(w));
#else
#pragma unroll
    for (int b = 0; b < 4; ++b) out[b] = e4m3_decode((w >> (8 * b)) & 0xffu);
#endif
}

// Two f32 as an f16x2, rounded to nearest even (`lo` in the low half).
__device__ __forceinline__ u32 f16x2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Four E4M3 codes (byte b of w is code b) as two f16x2: `lo` codes 0 (low half) and 1, `hi` codes
// 2 and 3. Exact (every E4M3 value is an f16), NaN codes as NaN. sm_89+: one cvt per pair; the
// tensor-core paths that take codes as MMA operands (oasis_attn_tc.cuh, score_blocks.cu).
__device__ __forceinline__ void e4m3x4_to_f16x2(u32 w, u32& lo, u32& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n"
        " .reg .b16 a, b;\n"
        " mov.b32 {a, b}, %2;\n"
        " cvt.rn.f16x2.e4m3x2 %0, a;\n"
        " cvt.rn.f16x2.e4m3x2 %1, b;\n"
        "}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
#else
    float f[4];
    e4m3x4_to_f32(w, f);
    lo = f16x2_rn(f[0], f[1]);
    hi = f16x2_rn(f[2], f[3]);
#endif
}

// d += a . b for one m16n8k16 tile in f16 with f32 accumulation (sm_80+): a row-major 16 x 16
// (registers as PTX's fragment layout), b column-major 16 x 8.
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One kv8 code as T: T(e4m3_decode(c) * scale) (the product is exact in f32), twin_nan for a NaN
// (a NaN code 0x7f / 0xff, or a corrupt scale).
template <typename T>
__device__ __forceinline__ T kv8_dequant(u32 c, float scale) {
    const float x = __fmul_rn(e4m3_decode(c), scale);
    return x != x ? twin_nan<T>() : from_f32<T>(x);
}

// Row `s` of a CSR table over `nnz` indices, checked in the kernel: the table lives on the device
// and a launch wrapper cannot read it without a host synchronisation. A well-formed row has
// 0 <= indptr[s] <= indptr[s + 1] <= nnz; it is returned as [*begin, *end) with true. Any other
// row (start negative, end before start, end past the table) reads as the empty row [0, 0) and
// returns false, so no malformed table makes a kernel read outside it. Two scalar loads and three
// compares per row: no extra pass over global memory.
__device__ __forceinline__ bool csr_row(const int* __restrict__ indptr, int s, int nnz, int* begin, int* end) {
    const int b = indptr[s];
    const int e = indptr[s + 1];
    const bool ok = 0 <= b && b <= e && e <= nnz;
    *begin = ok ? b : 0;
    *end = ok ? e : 0;
    return ok;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Max of `v` over the whole thread block (blockDim.x a multiple of 32); `red` holds 32 floats of
// shared memory. Every thread must call it; it ends with a barrier, so it can be called again.
__device__ __forceinline__ float block_max(float v, float* red) {
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = red[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}

// The storage of one tier of the paged KV (GPU pages or the host pool), as the kv8-aware append,
// gather and copy kernels take it: `T` pages, or kv8 pages (codes + per-(page, head) scales).
// Both are [num_pages, num_kv_heads, block_size, head_dim]; scales [num_pages, num_kv_heads].
// `from` builds one from the untyped pointers of a parameter struct (scales unused for T).
template <typename T>
struct ElemTier {
    T* k;
    T* v;
    static constexpr bool KV8 = false;
    __device__ static ElemTier from(const void* k, const void* v, const float*, const float*) {
        return ElemTier{(T*)k, (T*)v};
    }
};
struct Kv8Tier {
    unsigned char* k;
    unsigned char* v;
    float* ks;
    float* vs;
    static constexpr bool KV8 = true;
    __device__ static Kv8Tier from(const void* k, const void* v, const float* ks, const float* vs) {
        return Kv8Tier{(unsigned char*)k, (unsigned char*)v, (float*)ks, (float*)vs};
    }
};

// Exclusive prefix sum of `v` over the whole thread block (blockDim.x a multiple of 32, at most
// 1024); `*total` receives the block sum. Every thread must call it; `scratch` holds 33 ints of
// shared memory. Ends with a barrier, so it can be called again right away.
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int* total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nwarps ? scratch[lane] : 0;
        int wincl = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int n = __shfl_up_sync(0xffffffffu, wincl, o);
            if (lane >= o) wincl += n;
        }
        if (lane < nwarps) scratch[lane] = wincl - w;  // exclusive prefix of the warp totals
        if (lane == nwarps - 1) scratch[32] = wincl;
    }
    __syncthreads();
    const int excl = scratch[warp] + incl - v;
    *total = scratch[32];
    __syncthreads();
    return excl;
}

// Ascending in-place bitonic sort of `n` keys in shared memory, `n` a power of two. Every thread
// of the block must call it, after a barrier that published the keys; ends with a barrier.
template <typename K>
__device__ void block_bitonic_sort(K* a, int n) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int ixj = i ^ j;
                if (ixj > i) {
                    const K x = a[i];
                    const K y = a[ixj];
                    const bool ascending = (i & k) == 0;
                    if ((x > y) == ascending) {
                        a[i] = y;
                        a[ixj] = x;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// Ascending in-place sort of `n` DISTINCT keys in shared memory by rank counting, n <= blockDim.x
// (a power of two, as every launch here): each key's rank is the number of keys below it, counted
// by `sub` threads (the largest power of two <= 32 with sub * n <= blockDim.x) over strided
// parts and summed with shuffles; one barrier between the counts and the scatter, where a bitonic
// sort of 256 keys takes 36. Every thread of the block must call it, after a barrier that
// published the keys; ends with a barrier.
template <typename K>
__device__ void block_rank_sort(K* a, int n) {
    int sub = 1;
    while (sub < 32 && 2 * sub * n <= (int)blockDim.x) sub <<= 1;
    const int e = threadIdx.x / sub;
    const int part = threadIdx.x & (sub - 1);
    const bool mine = e < n;
    const K x = mine ? a[e] : K(0);
    int rank = 0;
    if (mine) {
        for (int j = part; j < n; j += sub) rank += a[j] < x ? 1 : 0;
    }
    for (int o = 1; o < sub; o <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
    __syncthreads();
    if (mine && part == 0) a[rank] = x;
    __syncthreads();
}

__device__ __forceinline__ int next_pow2(int n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}

// Number of 16-byte loads each thread keeps in flight in block_copy_bytes. Tuned for reads of
// pinned host memory through UVA, where every load pays a PCIe round trip.
#define OASIS_COPY_UNROLL 4

// Block-cooperative copy of `n` bytes; 16-byte accesses when both pointers and `n` allow it,
// else 4-, 2- or 1-byte ones. Either side may be pinned host memory reached through UVA.
__device__ __forceinline__ void block_copy_bytes(void* __restrict__ dst, const void* __restrict__ src, u64 n) {
    const u64 align = (u64)dst | (u64)src | n;
    const u64 tid = threadIdx.x;
    const u64 nt = blockDim.x;
    if ((align & 15) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        const u64 n16 = n >> 4;
        u64 i = tid;
        for (; i + (OASIS_COPY_UNROLL - 1) * nt < n16; i += OASIS_COPY_UNROLL * nt) {
            uint4 r[OASIS_COPY_UNROLL];
#pragma unroll
            for (int u = 0; u < OASIS_COPY_UNROLL; ++u) r[u] = s[i + u * nt];
#pragma unroll
            for (int u = 0; u < OASIS_COPY_UNROLL; ++u) d[i + u * nt] = r[u];
        }
        for (; i < n16; i += nt) d[i] = s[i];
    } else if ((align & 3) == 0) {
        const u32* s = (const u32*)src;
        u32* d = (u32*)dst;
        for (u64 i = tid; i < (n >> 2); i += nt) d[i] = s[i];
    } else if ((align & 1) == 0) {
        const unsigned short* s = (const unsigned short*)src;
        unsigned short* d = (unsigned short*)dst;
        for (u64 i = tid; i < (n >> 1); i += nt) d[i] = s[i];
    } else {
        const unsigned char* s = (const unsigned char*)src;
        unsigned char* d = (unsigned char*)dst;
        for (u64 i = tid; i < n; i += nt) d[i] = s[i];
    }
}

}  // namespace oasis
