//! The decoder's per-token elementwise work, fused (issue 10): RMSNorm with an optional residual
//! add, and the attention prologue that turns the fused QKV projection into the `q`, `k`, `v` the
//! attention takes (Qwen3's per-head q/k RMSNorm, rotate-half RoPE, the V copy).
//!
//! Numerics are Hugging Face's, rounding for rounding, as `oasiskv.models.transformer` writes them
//! in torch (`rms_norm`, `rope_cos_sin`, `apply_rope`):
//!
//! ```text
//! rms_norm:  xf = f32(x);  r = 1 / sqrt(sum(xf * xf) / hidden + eps);  y = T(xf * r);
//!            out = T(f32(weight) * f32(y))                      (with a residual: x = T(x + residual))
//! rope:      freq = f32(pos) * inv_freq[i];  cos = T(f32(cos(freq)) * s),  sin = T(f32(sin(freq)) * s), s = rope_scale
//!            out[i]     = T(T(x[i] * cos) + T(-x[i + D/2] * sin))        i <  D/2
//!            out[i+D/2] = T(T(x[i+D/2] * cos) + T(x[i] * sin))
//! ```
//!
//! where `T(..)` rounds an f32 to the storage type (nearest even; the identity for f32). Two
//! choices make the CPU twins and the CUDA kernels (`cuda/norm_rope.cu`) agree bit for bit:
//!
//! * the sum of squares is taken in one fixed order, the kernels' ([`tree_sum`]): `threads`
//!   partial sums over a strided split of the row, then xor-butterfly trees over 32 lanes. torch
//!   sums in another order, so against torch the result can differ in the last bit of `r`;
//! * cos and sin are evaluated in f64 and rounded to f32, which is the correctly rounded f32
//!   value (up to double rounding with odds of about 2^-28): torch's f32 `cos` (SLEEF on the CPU,
//!   CUDA's `cosf`) is within 1 ulp of it, and the two differ in a few percent of f32 values;
//!   rounded to bf16/f16 they almost never differ.
//!
//! Every product and sum is a separately rounded f32 operation (no fused multiply-add), as in
//! torch's elementwise kernels.

use crate::dtype::KvElem;
use crate::error::{check_len, try_vec, OasisError, Result};
use crate::kernels::validate::leading_rows;

/// Lanes of a warp: the width of every butterfly of [`tree_sum`].
pub const WARP_LANES: usize = 32;
/// Row elements per thread that [`rms_norm_threads`] aims for. Arbitrary.
pub const RMS_NORM_ELEMS_PER_THREAD: usize = 4;
/// Most threads of one `rms_norm` block (CUDA's limit per block).
pub const RMS_NORM_MAX_THREADS: usize = 1024;

/// Threads of the CUDA kernel `rms_norm_*` for rows of `hidden` elements, which fixes the order of
/// its sum of squares ([`tree_sum`]): about [`RMS_NORM_ELEMS_PER_THREAD`] elements each, a
/// multiple of 32 in `32..=1024`.
pub fn rms_norm_threads(hidden: usize) -> usize {
    hidden
        .div_ceil(RMS_NORM_ELEMS_PER_THREAD)
        .div_ceil(WARP_LANES)
        .saturating_mul(WARP_LANES)
        .clamp(WARP_LANES, RMS_NORM_MAX_THREADS)
}

/// The xor butterfly of `warp_sum` (cuda/oasis_common.cuh): at each step `o` = 16, 8, 4, 2, 1
/// every lane `i` adds lane `i ^ o`. Every lane ends with the same value (f32 addition is
/// commutative); lane 0's is returned.
fn butterfly(mut v: [f32; WARP_LANES]) -> f32 {
    let mut o = WARP_LANES / 2;
    while o > 0 {
        let prev = v;
        for (i, x) in v.iter_mut().enumerate() {
            *x = prev[i] + prev[i ^ o];
        }
        o /= 2;
    }
    v[0]
}

/// `sum(term(i) for i in 0..n)` in the order of a CUDA block of `threads` threads (a multiple of
/// 32, at most 1024): thread `t` adds `term(t)`, `term(t + threads)`, ... to a partial sum that
/// starts at 0; each warp sums its 32 partial sums with [`butterfly`]; then, with more than one
/// warp, the warp totals padded with zeros to 32 lanes go through one more butterfly.
pub fn tree_sum(term: impl Fn(usize) -> f32, n: usize, threads: usize) -> f32 {
    debug_assert!(threads.is_multiple_of(WARP_LANES) && (WARP_LANES..=1024).contains(&threads));
    let warps = threads / WARP_LANES;
    let mut totals = [0.0f32; WARP_LANES];
    for (w, total) in totals.iter_mut().enumerate().take(warps) {
        let mut lanes = [0.0f32; WARP_LANES];
        for (lane, acc) in lanes.iter_mut().enumerate() {
            let mut i = w * WARP_LANES + lane;
            while i < n {
                *acc += term(i);
                i += threads;
            }
        }
        *total = butterfly(lanes);
    }
    if warps == 1 {
        totals[0]
    } else {
        butterfly(totals)
    }
}

/// `1 / sqrt(mean + eps)` of a row's sum of squares, as the kernels round it: the mean divides
/// (torch's `mean` on the CPU), the reciprocal and the square root are IEEE operations.
#[inline]
fn inv_rms(sum_squares: f32, len: usize, eps: f32) -> f32 {
    1.0 / (sum_squares / len as f32 + eps).sqrt()
}

/// Normalise one row: `out[i] = T(w[i] * T(src[i] * r))`, the sum of squares over `threads`.
fn norm_row<T: KvElem>(src: &[T], weight: &[T], eps: f32, threads: usize, out: &mut [T]) {
    let r = inv_rms(
        tree_sum(
            |i| {
                let v = src[i].to_f32();
                v * v
            },
            src.len(),
            threads,
        ),
        src.len(),
        eps,
    );
    for ((o, &s), &w) in out.iter_mut().zip(src).zip(weight) {
        let y = T::from_f32(s.to_f32() * r);
        *o = T::from_f32(w.to_f32() * y.to_f32());
    }
}

/// Elements a buffer of `n` rows of `cols` elements, `stride` apart, spans (the last row ends
/// after its `cols` elements); `None` on overflow.
pub fn rows_span(n: usize, stride: usize, cols: usize) -> Option<usize> {
    match n {
        0 => Some(0),
        _ => (n - 1).checked_mul(stride)?.checked_add(cols),
    }
}

/// Check a row-strided input: `stride >= cols` and `len` is exactly the span of `n` rows
/// ([`rows_span`]).
///
/// # Errors
/// [`OasisError::Invalid`] for a stride below `cols`, [`OasisError::Shape`] for another length.
pub fn check_rows(
    what: &'static str,
    len: usize,
    n: usize,
    stride: usize,
    cols: usize,
) -> Result<()> {
    if stride < cols {
        return Err(OasisError::Invalid(format!(
            "{what}: row stride {stride} is below the row length {cols} (rows would overlap)"
        )));
    }
    match rows_span(n, stride, cols) {
        Some(span) if span == len => Ok(()),
        span => Err(OasisError::Shape {
            what,
            expected: format!(
                "{n} rows of {cols} elements, {stride} apart ({} elements)",
                span.map_or_else(|| "overflowing".to_string(), |s| s.to_string())
            ),
            got: format!("{len} elements"),
        }),
    }
}

/// The residual stream of a fused [`rms_norm`]: `h = T(x + residual)` is written to the residual
/// output and normalised instead of `x`.
#[derive(Debug)]
pub enum Residual<'a, T> {
    /// Read `residual` [n, hidden], write `residual_out` [n, hidden] (separate buffers).
    Separate {
        residual: &'a [T],
        residual_out: &'a mut [T],
    },
    /// Read the residual [n, hidden] and overwrite it with `h` (the residual output aliasing the
    /// residual: each element is read before it is written, by the same thread on the GPU).
    InPlace(&'a mut [T]),
}

/// HF RMSNorm of `n` rows (see the module doc for the rounding), with an optional fused residual
/// add: with `residual`, each row first becomes `h = T(f32(x) + f32(residual))` (torch's
/// `residual + x` in the storage type), `h` is written to the residual output and normalised.
///
/// `x` holds `n` rows of `hidden = weight.len()` elements, `x_stride` elements apart (a row-strided
/// view: `x_stride >= hidden`; the slice ends with the last row); `n` is implied by `out`.
///
/// # Errors
/// * [`OasisError::Config`] for an empty `weight` (hidden 0);
/// * [`OasisError::Shape`] for a buffer of the wrong size, [`OasisError::Invalid`] for a row stride
///   below `hidden`.
///
/// Nothing is written when an error is returned.
pub fn rms_norm<T: KvElem>(
    x: &[T], // [n, x_stride] (rows of hidden elements)
    x_stride: usize,
    weight: &[T], // [hidden]
    eps: f32,
    residual: Option<Residual<'_, T>>,
    out: &mut [T], // [n, hidden]
) -> Result<()> {
    let hidden = weight.len();
    if hidden == 0 {
        return Err(OasisError::Config(
            "rms_norm needs a non-empty weight (hidden > 0)".into(),
        ));
    }
    let n = leading_rows("out", out.len(), &[hidden])?;
    check_rows("x", x.len(), n, x_stride, hidden)?;
    match &residual {
        Some(Residual::Separate {
            residual,
            residual_out,
        }) => {
            check_len("residual", residual.len(), &[n, hidden])?;
            check_len("residual_out", residual_out.len(), &[n, hidden])?;
        }
        Some(Residual::InPlace(r)) => check_len("residual", r.len(), &[n, hidden])?,
        None => {}
    }

    let threads = rms_norm_threads(hidden);
    let mut residual = residual;
    for r in 0..n {
        let xr = &x[r * x_stride..r * x_stride + hidden];
        let row = r * hidden..(r + 1) * hidden;
        let o = &mut out[row.clone()];
        let src: &[T] = match &mut residual {
            None => xr,
            Some(Residual::Separate {
                residual,
                residual_out,
            }) => {
                let ho = &mut residual_out[row.clone()];
                for ((h, &a), &b) in ho.iter_mut().zip(xr).zip(&residual[row.clone()]) {
                    *h = T::from_f32(a.to_f32() + b.to_f32());
                }
                ho
            }
            Some(Residual::InPlace(res)) => {
                let ho = &mut res[row.clone()];
                for (h, &a) in ho.iter_mut().zip(xr) {
                    *h = T::from_f32(a.to_f32() + h.to_f32());
                }
                ho
            }
        };
        norm_row(src, weight, eps, threads, o);
    }
    Ok(())
}

/// The heads of a fused QKV row: `num_heads` query heads, then `num_kv_heads` key heads, then
/// `num_kv_heads` value heads, `head_dim` elements each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadLayout {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl HeadLayout {
    /// Elements of the query part of a row, `num_heads * head_dim`.
    pub fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Elements of the key part (and of the value part), `num_kv_heads * head_dim`.
    pub fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Elements of a whole QKV row, `q_size + 2 * kv_size`.
    pub fn width(&self) -> usize {
        self.q_size() + 2 * self.kv_size()
    }

    /// Positive counts, an even head_dim, and sizes that fit the kernels' i32 indices.
    pub fn validate(&self) -> Result<()> {
        let HeadLayout {
            num_heads,
            num_kv_heads,
            head_dim,
        } = *self;
        if num_heads == 0 || num_kv_heads == 0 || head_dim == 0 || head_dim % 2 != 0 {
            return Err(OasisError::Config(format!(
                "qk_norm_rope needs num_heads, num_kv_heads > 0 and an even head_dim > 0, got \
                 num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )));
        }
        let width = num_heads
            .checked_add(num_kv_heads.saturating_mul(2))
            .and_then(|h| h.checked_mul(head_dim));
        if !matches!(width, Some(w) if w <= i32::MAX as usize) {
            return Err(OasisError::Config(format!(
                "qk_norm_rope: (num_heads + 2 * num_kv_heads) * head_dim overflows, got \
                 num_heads={num_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )));
        }
        Ok(())
    }
}

/// Token positions, as the caller stores them (torch's int64 `positions`, or int32 tables).
#[derive(Debug, Clone, Copy)]
pub enum Positions<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl Positions<'_> {
    pub fn len(&self) -> usize {
        match self {
            Positions::I32(p) => p.len(),
            Positions::I64(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Position `i` as f32, rounded to nearest (torch's `positions.to(torch.float32)`).
    fn f32_at(&self, i: usize) -> f32 {
        match self {
            Positions::I32(p) => p[i] as f32,
            Positions::I64(p) => p[i] as f32,
        }
    }
}

/// Qwen3's per-head RMSNorm of queries and keys, before RoPE: weights `[head_dim]`.
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a, T> {
    pub q_weight: &'a [T], // [head_dim]
    pub k_weight: &'a [T], // [head_dim]
    pub eps: f32,
}

/// `kv_groups` of [`qk_norm_rope`] for `n` rows: at least 1, and dividing `n`.
///
/// # Errors
/// [`OasisError::Invalid`] otherwise.
pub fn check_kv_groups(n: usize, kv_groups: usize) -> Result<()> {
    if kv_groups == 0 || !n.is_multiple_of(kv_groups) {
        return Err(OasisError::Invalid(format!(
            "qk_norm_rope: kv_groups must be >= 1 and divide the {n} rows, got {kv_groups}"
        )));
    }
    Ok(())
}

/// The row of `k_out` / `v_out` that row `t` of `n` goes to under `kv_groups` = G (see
/// [`qk_norm_rope`]): `t` itself for G = 1, else `(t % G) * (n / G) + t / G`.
pub fn kv_group_row(t: usize, n: usize, kv_groups: usize) -> usize {
    if kv_groups <= 1 {
        t
    } else {
        (t % kv_groups) * (n / kv_groups) + t / kv_groups
    }
}

/// Rotate-half RoPE of one head in place (`x` holds f32 values of T), with the row's tables.
fn rope_head<T: KvElem>(x: &[f32], cos: &[f32], sin: &[f32], out: &mut [T]) {
    let half = cos.len();
    for (d, o) in out.iter_mut().enumerate() {
        let (i, rot) = if d < half {
            (d, -x[d + half])
        } else {
            (d - half, x[d - half])
        };
        let a = T::from_f32(x[d] * cos[i]).to_f32();
        let b = T::from_f32(rot * sin[i]).to_f32();
        *o = T::from_f32(a + b);
    }
}

/// The attention prologue of one decoder layer, fused: from the QKV projection `qkv` (`n` rows
/// of `layout.width()` elements, `qkv_stride` apart), write
///
/// * `q_out` [n, num_heads, head_dim]: each query head, RMS-normalised with `norm.q_weight` when
///   `norm` is given (per head, over head_dim, the same rounding as [`rms_norm`] with the
///   butterfly of one warp), then rotated by RoPE at `positions[t]`;
/// * `k_out` [n, num_kv_heads, head_dim]: the same for the key heads with `norm.k_weight`;
/// * `v_out` [n, num_kv_heads, head_dim]: a copy of the value heads.
///
/// With `kv_groups` = G > 1 the `n` rows are `n / G` groups of `G` consecutive rows (row
/// `t = s * G + r`: a decode step's rows of request `s`), and row `t`'s key and value heads go to
/// row `r * (n / G) + s` of `k_out` and `v_out` ([`kv_group_row`]): row `r` of every request
/// contiguous, which the paged append and the attention's extra rows read without a copy.
/// `q_out` keeps row `t`.
///
/// RoPE is the rotate-half form with tables `concat(freqs, freqs)`, `freqs[i] = f32(pos) *
/// inv_freq[i]` (see the module doc for the rounding). Positions may be any integers.
///
/// # Errors
/// * [`OasisError::Config`] for a layout [`HeadLayout::validate`] rejects;
/// * [`OasisError::Shape`] for a buffer of the wrong size (`n` = `positions.len()`),
///   [`OasisError::Invalid`] for a row stride below the row width.
///
/// Nothing is written when an error is returned.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope<T: KvElem>(
    layout: &HeadLayout,
    qkv: &[T], // [n, qkv_stride] rows of q_size + 2 * kv_size elements
    qkv_stride: usize,
    positions: Positions<'_>, // [n]
    inv_freq: &[f32],         // [head_dim / 2]
    rope_scale: f32,          // cos and sin times this (YaRN's attention factor; 1 otherwise)
    norm: Option<&QkNorm<'_, T>>,
    q_out: &mut [T], // [n, num_heads, head_dim]
    k_out: &mut [T], // [n, num_kv_heads, head_dim]
    v_out: &mut [T], // [n, num_kv_heads, head_dim]
    kv_groups: usize,
) -> Result<()> {
    layout.validate()?;
    let HeadLayout {
        num_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
    } = *layout;
    let n = positions.len();
    check_rows("qkv", qkv.len(), n, qkv_stride, layout.width())?;
    check_len("inv_freq", inv_freq.len(), &[d / 2])?;
    if let Some(nw) = norm {
        check_len("q_norm", nw.q_weight.len(), &[d])?;
        check_len("k_norm", nw.k_weight.len(), &[d])?;
    }
    check_len("q_out", q_out.len(), &[n, hq, d])?;
    check_len("k_out", k_out.len(), &[n, hkv, d])?;
    check_len("v_out", v_out.len(), &[n, hkv, d])?;
    check_kv_groups(n, kv_groups)?;

    if n == 0 {
        return Ok(());
    }
    let half = d / 2;
    let mut cos: Vec<f32> = try_vec("rope tables", half)?;
    let mut sin: Vec<f32> = try_vec("rope tables", half)?;
    cos.resize(half, 0.0);
    sin.resize(half, 0.0);
    let mut head: Vec<f32> = try_vec("a head", d)?;
    head.resize(d, 0.0);
    let (q_size, kv_size) = (layout.q_size(), layout.kv_size());
    for t in 0..n {
        let pos = positions.f32_at(t);
        for i in 0..half {
            let (s, c) = f64::from(pos * inv_freq[i]).sin_cos();
            // Scaled in f32, then rounded to T: transformers' `cos * attention_scaling`, `.to(dtype)`.
            cos[i] = T::from_f32(c as f32 * rope_scale).to_f32();
            sin[i] = T::from_f32(s as f32 * rope_scale).to_f32();
        }
        let row = &qkv[t * qkv_stride..t * qkv_stride + layout.width()];
        let t_kv = kv_group_row(t, n, kv_groups);
        let (qs, rest) = row.split_at(q_size);
        let (ks, vs) = rest.split_at(kv_size);
        for (src, dst, weight) in [
            (
                qs,
                &mut q_out[t * q_size..(t + 1) * q_size],
                norm.map(|nw| nw.q_weight),
            ),
            (
                ks,
                &mut k_out[t_kv * kv_size..(t_kv + 1) * kv_size],
                norm.map(|nw| nw.k_weight),
            ),
        ] {
            for (x, o) in src.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
                match (weight, norm) {
                    (Some(w), Some(nw)) => {
                        let r = inv_rms(
                            tree_sum(
                                |i| {
                                    let v = x[i].to_f32();
                                    v * v
                                },
                                d,
                                WARP_LANES,
                            ),
                            d,
                            nw.eps,
                        );
                        for ((hv, &xv), &wv) in head.iter_mut().zip(x).zip(w) {
                            let y = T::from_f32(xv.to_f32() * r);
                            *hv = T::from_f32(wv.to_f32() * y.to_f32()).to_f32();
                        }
                    }
                    _ => {
                        for (hv, &xv) in head.iter_mut().zip(x) {
                            *hv = xv.to_f32();
                        }
                    }
                }
                rope_head(&head, &cos, &sin, o);
            }
        }
        v_out[t_kv * kv_size..(t_kv + 1) * kv_size].copy_from_slice(vs);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn threads_per_row() {
        assert_eq!(rms_norm_threads(1), 32);
        assert_eq!(rms_norm_threads(64), 32);
        assert_eq!(rms_norm_threads(576), 160);
        assert_eq!(rms_norm_threads(4096), 1024);
        assert_eq!(rms_norm_threads(100_000), 1024);
        for h in 1..5000 {
            let t = rms_norm_threads(h);
            assert!(t.is_multiple_of(32) && (32..=1024).contains(&t), "{h}: {t}");
        }
    }

    /// The butterfly order is not the sequential one: (1 + 2^-24 * ...) cases show the
    /// difference, and the tree is what the kernels compute.
    #[test]
    fn tree_sum_orders() {
        assert_eq!(tree_sum(|i| i as f32, 100, 32), 4950.0);
        assert_eq!(tree_sum(|i| i as f32, 5000, 1024), 12_497_500.0);
        assert_eq!(tree_sum(|_| 1.0, 0, 64), 0.0);
        // One large term and many tiny ones: sequentially the tiny ones vanish one by one; in the
        // tree the lanes first add them up among themselves.
        let term = |i: usize| if i == 0 { 1.0 } else { f32::EPSILON / 4.0 };
        let seq: f32 = (0..64).map(term).sum();
        assert_eq!(seq, 1.0);
        assert!(tree_sum(term, 64, 32) > 1.0);
    }

    #[test]
    fn rms_norm_matches_the_formula() {
        let hidden = 6;
        let x: Vec<f32> = vec![
            1.0, -2.0, 3.0, 0.5, 0.0, 4.0, /* pad */ 9.0, 9.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0,
        ];
        let w: Vec<f32> = vec![1.0, 2.0, 0.5, 1.0, 1.0, -1.0];
        let mut out = vec![0.0f32; 2 * hidden];
        rms_norm(&x, 8, &w, 1e-6, None, &mut out).unwrap();
        let ms = (1.0 + 4.0 + 9.0 + 0.25 + 16.0) / 6.0f32;
        let r = 1.0 / (ms + 1e-6f32).sqrt();
        for i in 0..hidden {
            assert_eq!(out[i], w[i] * (x[i] * r));
        }
        let r2 = 1.0 / (4.0f32 + 1e-6).sqrt();
        for i in 0..hidden {
            assert_eq!(out[hidden + i], w[i] * (2.0 * r2));
        }
    }

    #[test]
    fn residual_in_place_equals_separate() {
        let hidden = 37;
        let n = 3;
        let x: Vec<bf16> = (0..n * hidden)
            .map(|i| bf16::from_f32((i as f32 * 0.37).sin()))
            .collect();
        let res: Vec<bf16> = (0..n * hidden)
            .map(|i| bf16::from_f32((i as f32 * 0.11).cos() * 3.0))
            .collect();
        let w: Vec<bf16> = (0..hidden)
            .map(|i| bf16::from_f32(1.0 + i as f32 / 100.0))
            .collect();
        let (mut o1, mut o2) = (vec![bf16::ZERO; n * hidden], vec![bf16::ZERO; n * hidden]);
        let mut h1 = vec![bf16::ZERO; n * hidden];
        rms_norm(
            &x,
            hidden,
            &w,
            1e-5,
            Some(Residual::Separate {
                residual: &res,
                residual_out: &mut h1,
            }),
            &mut o1,
        )
        .unwrap();
        let mut h2 = res.clone();
        rms_norm(
            &x,
            hidden,
            &w,
            1e-5,
            Some(Residual::InPlace(&mut h2)),
            &mut o2,
        )
        .unwrap();
        assert_eq!(h1, h2);
        assert_eq!(o1, o2);
        for i in 0..n * hidden {
            assert_eq!(h1[i], bf16::from_f32(x[i].to_f32() + res[i].to_f32()));
        }
        // Normalising h directly gives the same output.
        let mut o3 = vec![bf16::ZERO; n * hidden];
        rms_norm(&h1, hidden, &w, 1e-5, None, &mut o3).unwrap();
        assert_eq!(o1, o3);
    }

    #[test]
    fn rms_norm_rejects_bad_shapes_without_writing() {
        let w = [1.0f32; 4];
        let mut out = [7.0f32; 8];
        let x = [1.0f32; 8];
        assert!(matches!(
            rms_norm(&x, 3, &w, 1e-6, None, &mut out),
            Err(OasisError::Invalid(_))
        ));
        assert!(matches!(
            rms_norm(&x[..7], 4, &w, 1e-6, None, &mut out),
            Err(OasisError::Shape { .. })
        ));
        assert!(matches!(
            rms_norm(&x, 4, &[], 1e-6, None, &mut out),
            Err(OasisError::Config(_))
        ));
        let mut short = [0.0f32; 7];
        let res = [0.0f32; 8];
        assert!(rms_norm(
            &x,
            4,
            &w,
            1e-6,
            Some(Residual::Separate {
                residual: &res,
                residual_out: &mut short
            }),
            &mut out
        )
        .is_err());
        assert_eq!(out, [7.0; 8]);
        // Rows 6 apart: the last row ends at its 4th element.
        let xs = [1.0f32; 10];
        rms_norm(&xs, 6, &w, 1e-6, None, &mut out).unwrap();
    }

    #[test]
    fn rope_rotates_pairs() {
        // f32, no norm: one head of 4 at position 1 with inv_freq [1, 0]: pair 0 rotates by
        // 1 radian, pair 1 not at all.
        let layout = HeadLayout {
            num_heads: 1,
            num_kv_heads: 1,
            head_dim: 4,
        };
        let qkv = [
            1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0,
        ];
        let (mut q, mut k, mut v) = ([0.0f32; 4], [0.0f32; 4], [0.0f32; 4]);
        qk_norm_rope(
            &layout,
            &qkv,
            12,
            Positions::I64(&[1]),
            &[1.0, 0.0],
            1.0,
            None,
            &mut q,
            &mut k,
            &mut v,
            1,
        )
        .unwrap();
        let (c, s) = ((1.0f64).cos() as f32, (1.0f64).sin() as f32);
        assert_eq!(q, [1.0 * c - 3.0 * s, 2.0, 3.0 * c + 1.0 * s, 4.0]);
        assert_eq!(k, [5.0 * c - 7.0 * s, 6.0, 7.0 * c + 5.0 * s, 8.0]);
        assert_eq!(v, [9.0, 10.0, 11.0, 12.0]);
        // rope_scale (YaRN's attention factor) scales cos and sin, the unrotated pair too.
        let f = 1.25f32;
        qk_norm_rope(
            &layout,
            &qkv,
            12,
            Positions::I64(&[1]),
            &[1.0, 0.0],
            f,
            None,
            &mut q,
            &mut k,
            &mut v,
            1,
        )
        .unwrap();
        let (c, s) = (c * f, s * f);
        assert_eq!(q, [1.0 * c - 3.0 * s, 2.0 * f, 3.0 * c + 1.0 * s, 4.0 * f]);
        assert_eq!(v, [9.0, 10.0, 11.0, 12.0]);
        // Position 0 is the identity; int32 positions read the same.
        qk_norm_rope(
            &layout,
            &qkv,
            12,
            Positions::I32(&[0]),
            &[1.0, 0.0],
            1.0,
            None,
            &mut q,
            &mut k,
            &mut v,
            1,
        )
        .unwrap();
        assert_eq!(q, [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn qk_norm_is_rms_norm_per_head() {
        let layout = HeadLayout {
            num_heads: 3,
            num_kv_heads: 1,
            head_dim: 40,
        };
        let n = 2;
        let stride = layout.width() + 3;
        let qkv: Vec<bf16> = (0..(n - 1) * stride + layout.width())
            .map(|i| bf16::from_f32((i as f32 * 0.7).sin() * 2.0))
            .collect();
        let qw: Vec<bf16> = (0..40)
            .map(|i| bf16::from_f32(0.5 + i as f32 / 40.0))
            .collect();
        let kw: Vec<bf16> = (0..40)
            .map(|i| bf16::from_f32(1.5 - i as f32 / 40.0))
            .collect();
        let norm = QkNorm {
            q_weight: &qw,
            k_weight: &kw,
            eps: 1e-6,
        };
        let zeros = vec![0.0f32; 20]; // inv_freq 0: RoPE is the identity at any position
        let mut q = vec![bf16::ZERO; n * 120];
        let mut k = vec![bf16::ZERO; n * 40];
        let mut v = vec![bf16::ZERO; n * 40];
        qk_norm_rope(
            &layout,
            &qkv,
            stride,
            Positions::I64(&[5, 40000]),
            &zeros,
            1.0,
            Some(&norm),
            &mut q,
            &mut k,
            &mut v,
            1,
        )
        .unwrap();
        for t in 0..n {
            let row = &qkv[t * stride..];
            for h in 0..3 {
                let mut want = vec![bf16::ZERO; 40];
                rms_norm(&row[h * 40..(h + 1) * 40], 40, &qw, 1e-6, None, &mut want).unwrap();
                assert_eq!(&q[(t * 3 + h) * 40..(t * 3 + h + 1) * 40], &want[..]);
            }
            let mut want = vec![bf16::ZERO; 40];
            rms_norm(&row[120..160], 40, &kw, 1e-6, None, &mut want).unwrap();
            assert_eq!(&k[t * 40..(t + 1) * 40], &want[..]);
            assert_eq!(&v[t * 40..(t + 1) * 40], &row[160..200]);
        }
    }

    #[test]
    fn qk_norm_rope_rejects_bad_layouts() {
        let mut o = [0.0f32; 0];
        let mut o2 = [0.0f32; 0];
        let mut o3 = [0.0f32; 0];
        for (h, hk, d) in [
            (0, 1, 4),
            (1, 0, 4),
            (1, 1, 3),
            (1, 1, 0),
            (usize::MAX, 1, 2),
        ] {
            let layout = HeadLayout {
                num_heads: h,
                num_kv_heads: hk,
                head_dim: d,
            };
            let r = qk_norm_rope::<f32>(
                &layout,
                &[],
                0,
                Positions::I64(&[]),
                &[],
                1.0,
                None,
                &mut o,
                &mut o2,
                &mut o3,
                1,
            );
            assert!(matches!(r, Err(OasisError::Config(_))), "{layout:?}");
        }
    }

    /// kv_groups reorders the key and value rows, and only them: each row of a group-ordered
    /// call equals the token-ordered call's row it maps to, bit for bit; q is unchanged; bad
    /// group counts are refused before anything is written.
    #[test]
    fn kv_groups_move_key_and_value_rows_only() {
        let layout = HeadLayout {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
        };
        let n = 6;
        let w = layout.width();
        let qkv: Vec<bf16> = (0..n * w)
            .map(|i| bf16::from_f32((i as f32 * 0.37).sin() * 3.0))
            .collect();
        let pos: Vec<i64> = (0..n as i64).map(|t| 100 + 7 * t).collect();
        let inv = [1.0f32, 0.1, 0.01, 0.001];
        let run = |g: usize| {
            let mut q = vec![bf16::ZERO; n * 32];
            let mut k = vec![bf16::ZERO; n * 16];
            let mut v = vec![bf16::ZERO; n * 16];
            let r = qk_norm_rope(
                &layout,
                &qkv,
                w,
                Positions::I64(&pos),
                &inv,
                1.0,
                None,
                &mut q,
                &mut k,
                &mut v,
                g,
            );
            (r, q, k, v)
        };
        let (r1, q1, k1, v1) = run(1);
        r1.unwrap();
        for g in [2, 3] {
            let (r, q, k, v) = run(g);
            r.unwrap();
            assert_eq!(q, q1, "q keeps the token order");
            for t in 0..n {
                let to = kv_group_row(t, n, g);
                assert_eq!(to, (t % g) * (n / g) + t / g);
                assert_eq!(
                    &k[to * 16..(to + 1) * 16],
                    &k1[t * 16..(t + 1) * 16],
                    "g {g} row {t}"
                );
                assert_eq!(
                    &v[to * 16..(to + 1) * 16],
                    &v1[t * 16..(t + 1) * 16],
                    "g {g} row {t}"
                );
            }
        }
        for g in [0, 4, 5] {
            let (r, q, k, v) = run(g);
            assert!(matches!(r, Err(OasisError::Invalid(_))), "kv_groups {g}");
            assert!(q.iter().chain(&k).chain(&v).all(|x| *x == bf16::ZERO));
        }
    }
}
