//! The FP8 (E4M3) KV cache ("kv8"): its format, the whole-block quantizer, and the storage
//! types through which append, attention, the gather and the page copies read and write either
//! tier (GPU pages or the host pool) as `T` pages or as kv8 pages. This module owns the
//! definitions the CUDA kernels follow bit for bit; the kernels that use them stay in their own
//! modules ([`crate::kernels::append`], [`crate::kernels::attention`], [`crate::kernels::gather`]).
//!
//! ## Format
//! * codes `[num_pages, num_kv_heads, block_size, head_dim]` `u8`: E4M3 bits (OCP e4m3fn: sign,
//!   4 exponent bits biased by 7, 3 mantissa bits; exponent field 0 is subnormal `m 2^-9`;
//!   `0x7f`/`0xff` are NaN; the largest magnitude is 448), the same layout as `T` pages;
//! * scales `[num_pages, num_kv_heads]` `f32`, one array for K and one for V: a scale is always an
//!   exact power of two `2^e` with `e` in `[KV8_MIN_EXP, KV8_MAX_EXP]` = `[-120, 120]`;
//! * a value is `e4m3_decode(code) * scale` (exact in f32: a 4-bit significand times `2^e`).
//!
//! ## Exponent rule ([`kv8_exponent`])
//! `e` is the smallest integer with `absmax <= 448 * 2^e`, clamped to `[KV8_MIN_EXP,
//! KV8_MAX_EXP]`, where `absmax` is the largest `|x|` over the FINITE values the scale covers
//! (NaN and `±inf` are left out: they are stored as the NaN code whatever the scale, see below);
//! `absmax == 0` (or no finite value) gives `KV8_MIN_EXP`. The bounds keep `2^e` and `2^-e` normal
//! f32, so `x * 2^-e` in f32 is exact unless it falls below 2^-126, far under E4M3's smallest
//! rounding boundary (2^-10): `e4m3_rne` of the f32 product is the rounding of the exact one for
//! every f32, bf16 or f16 `x`. Any finite f32 needs `e <= 120`, so the upper clamp only bounds
//! what a corrupt scale can say.
//!
//! The rule is [`crate::kernels::bound8`]'s ([`bound8_exponent`]: same minimum, -120, NaN to the
//! minimum) plus the explicit upper clamp; [`kv8_exponent`] is that function clamped, so the two
//! 8-bit formats cannot drift apart.
//!
//! ## Quantization of a value
//! `code = e4m3_rne(x * 2^-e)` ([`e4m3_rne`]): round to nearest, ties to the even mantissa, sign
//! kept; finite magnitudes above 448 saturate to `±448` (cannot happen with a correct scale);
//! NaN and `±inf` become the NaN code `0x7f`, so a non-finite K or V propagates NaN through
//! attention as it does with `T` pages.
//!
//! ## Whole-block quantization ([`quantize_kv8`]; prefill, dense -> sparse copies)
//! Per (page, KV head): `e` from the absmax over the block's `valid` rows (`1..=block_size`);
//! rows `0..valid` quantized with it; rows `>= valid` written as code 0.
//!
//! ## Incremental append (decode: one row at offset `o` of a page, per KV head, K and V apart)
//! * `o == 0`: `e = kv8_exponent(absmax of the new row)`; the page's earlier contents are ignored.
//! * `o > 0`: `e_old` = the stored scale's exponent ([`kv8_scale_exponent`]: its f32 exponent
//!   field minus 127, clamped to the bounds, so a zero or corrupt scale reads as a bound) and
//!   `e_row = kv8_exponent(absmax of the new row)`. If `e_row > e_old`, rows `0..o` are first
//!   requantized: `code' = e4m3_rne(e4m3_decode(code) * 2^(e_old - e_row))`, and `e = e_row`;
//!   else `e = e_old` (the scale never shrinks within a block).
//! * then `scale = 2^e` and the new row is `e4m3_rne(x * 2^-e)`.
//!
//! With power-of-two scales the requantization is exact (each code keeps its value) except for
//! values that fall into E4M3's subnormal range (below `2^-6 * 2^e_row`), which are rounded to
//! nearest even there: a block that grows its scale loses low bits only of its smallest values.
//! A shift below [`REQUANT_MIN_SHIFT`] is computed as that minimum: every code then rounds to
//! (signed) zero either way, and `2^shift` stays a normal f32.

use crate::dtype::KvElem;
use crate::error::{check_len, Result};
use crate::geometry::KvGeometry;
use crate::kernels::bound8::{bound8_exponent, e4m3_decode, e4m3_rne, pow2, BOUND8_MIN_EXP};
use crate::kernels::validate::{leading_rows, length};

/// Smallest exponent of a kv8 scale (bound8's: `2^e` and `2^-e` stay normal f32).
pub const KV8_MIN_EXP: i32 = BOUND8_MIN_EXP;
/// Largest exponent of a kv8 scale (448 * 2^120 exceeds every finite f32).
pub const KV8_MAX_EXP: i32 = 120;
/// Requantization shifts below this are computed as this: `448 * 2^-20 < 2^-10`, half of E4M3's
/// smallest subnormal, so every code rounds to zero at any shift `<= -20` (arbitrary margin).
pub const REQUANT_MIN_SHIFT: i32 = -24;

/// The exponent `e` of a kv8 scale `2^e` for a row set whose largest finite magnitude is
/// `absmax`: the smallest with `absmax <= 448 * 2^e`, clamped to `[KV8_MIN_EXP, KV8_MAX_EXP]`.
/// NaN gives the minimum.
#[inline]
pub fn kv8_exponent(absmax: f32) -> i32 {
    bound8_exponent(absmax).clamp(KV8_MIN_EXP, KV8_MAX_EXP)
}

/// The exponent of a stored scale: its f32 exponent field minus 127, clamped to
/// `[KV8_MIN_EXP, KV8_MAX_EXP]`. Exact for every scale these kernels write.
#[inline]
pub fn kv8_scale_exponent(scale: f32) -> i32 {
    (((scale.to_bits() >> 23) & 0xff) as i32 - 127).clamp(KV8_MIN_EXP, KV8_MAX_EXP)
}

/// The largest `|x|` over the finite values of `xs` (0 when there are none).
#[inline]
fn finite_absmax<T: KvElem>(xs: &[T]) -> f32 {
    xs.iter()
        .map(|x| x.to_f32())
        .filter(|x| x.is_finite())
        .fold(0.0f32, |a, x| a.max(x.abs()))
}

/// Every E4M3 code's value (`e4m3_decode`, NaN for `0x7f`/`0xff`), indexed by the code.
pub(crate) fn e4m3_table() -> [f32; 256] {
    crate::kernels::bound8::E4M3_VALUES
}

/// One tier's kv8 pages: E4M3 codes plus a power-of-two scale per (page, KV head), K and V apart.
#[derive(Debug, Clone, Copy)]
pub struct Kv8Pages<'a> {
    /// `[num_pages, num_kv_heads, block_size, head_dim]` E4M3 bits
    pub k_codes: &'a [u8],
    /// `[num_pages, num_kv_heads, block_size, head_dim]` E4M3 bits
    pub v_codes: &'a [u8],
    /// `[num_pages, num_kv_heads]` powers of two
    pub k_scales: &'a [f32],
    /// `[num_pages, num_kv_heads]` powers of two
    pub v_scales: &'a [f32],
}

/// [`Kv8Pages`] to write.
#[derive(Debug)]
pub struct Kv8PagesMut<'a> {
    /// `[num_pages, num_kv_heads, block_size, head_dim]` E4M3 bits
    pub k_codes: &'a mut [u8],
    /// `[num_pages, num_kv_heads, block_size, head_dim]` E4M3 bits
    pub v_codes: &'a mut [u8],
    /// `[num_pages, num_kv_heads]` powers of two
    pub k_scales: &'a mut [f32],
    /// `[num_pages, num_kv_heads]` powers of two
    pub v_scales: &'a mut [f32],
}

/// The storage of one tier (GPU pages or host pool): `T` pages or kv8 pages, both
/// `[num_pages, num_kv_heads, block_size, head_dim]`.
#[derive(Debug, Clone, Copy)]
pub enum KvTier<'a, T> {
    Elem { k: &'a [T], v: &'a [T] },
    Kv8(Kv8Pages<'a>),
}

/// [`KvTier`] to write.
#[derive(Debug)]
pub enum KvTierMut<'a, T> {
    Elem { k: &'a mut [T], v: &'a mut [T] },
    Kv8(Kv8PagesMut<'a>),
}

/// The names a tier's buffers go by in errors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TierNames {
    pub k: &'static str,
    pub v: &'static str,
    pub k_scales: &'static str,
    pub v_scales: &'static str,
}

pub(crate) const GPU_NAMES: TierNames = TierNames {
    k: "k_pages",
    v: "v_pages",
    k_scales: "k_scales",
    v_scales: "v_scales",
};
pub(crate) const HOST_NAMES: TierNames = TierNames {
    k: "host_k",
    v: "host_v",
    k_scales: "host_k_scales",
    v_scales: "host_v_scales",
};

/// The number of pages of a tier given its buffers' lengths (`scales`: kv8's K and V scales).
fn tier_pages(
    geo: &KvGeometry,
    names: &TierNames,
    k: usize,
    v: usize,
    scales: Option<(usize, usize)>,
) -> Result<usize> {
    let (h_kv, bs, d) = (geo.num_kv_heads, geo.block_size, geo.head_dim);
    let n = leading_rows(names.k, k, &[h_kv, bs, d])?;
    check_len(names.v, v, &[n, h_kv, bs, d])?;
    if let Some((ks, vs)) = scales {
        check_len(names.k_scales, ks, &[n, h_kv])?;
        check_len(names.v_scales, vs, &[n, h_kv])?;
    }
    Ok(n)
}

impl<T> KvTier<'_, T> {
    /// Check the buffers' shapes; the number of pages.
    pub(crate) fn num_pages(&self, geo: &KvGeometry, names: &TierNames) -> Result<usize> {
        match self {
            KvTier::Elem { k, v } => tier_pages(geo, names, k.len(), v.len(), None),
            KvTier::Kv8(p) => tier_pages(
                geo,
                names,
                p.k_codes.len(),
                p.v_codes.len(),
                Some((p.k_scales.len(), p.v_scales.len())),
            ),
        }
    }
}

impl<T: KvElem> KvTierMut<'_, T> {
    /// Check the buffers' shapes; the number of pages.
    pub(crate) fn num_pages(&self, geo: &KvGeometry, names: &TierNames) -> Result<usize> {
        match self {
            KvTierMut::Elem { k, v } => tier_pages(geo, names, k.len(), v.len(), None),
            KvTierMut::Kv8(p) => tier_pages(
                geo,
                names,
                p.k_codes.len(),
                p.v_codes.len(),
                Some((p.k_scales.len(), p.v_scales.len())),
            ),
        }
    }

    /// Write one token's K,V row at offset `off` of entry `e = page * num_kv_heads + head`: a
    /// copy into `T` pages, the incremental append (module doc) into kv8 pages.
    #[inline]
    pub(crate) fn append_row(&mut self, geo: &KvGeometry, e: usize, off: usize, k: &[T], v: &[T]) {
        let d = geo.head_dim;
        let entry = e * geo.entry_elems()..(e + 1) * geo.entry_elems();
        match self {
            KvTierMut::Elem { k: kp, v: vp } => {
                let at = entry.start + off * d;
                kp[at..at + d].copy_from_slice(k);
                vp[at..at + d].copy_from_slice(v);
            }
            KvTierMut::Kv8(p) => {
                append_row_kv8(&mut p.k_codes[entry.clone()], &mut p.k_scales[e], off, k);
                append_row_kv8(&mut p.v_codes[entry], &mut p.v_scales[e], off, v);
            }
        }
    }
}

/// The incremental append of one row `x` (`head_dim`) at offset `off` of one (page, head) entry
/// `codes` (`[block_size, head_dim]`) with scale `scale` (module doc).
fn append_row_kv8<T: KvElem>(codes: &mut [u8], scale: &mut f32, off: usize, x: &[T]) {
    let d = x.len();
    let e_row = kv8_exponent(finite_absmax(x));
    let e = if off == 0 {
        e_row
    } else {
        let e_old = kv8_scale_exponent(*scale);
        if e_row > e_old {
            let f = pow2((e_old - e_row).max(REQUANT_MIN_SHIFT));
            for c in &mut codes[..off * d] {
                *c = e4m3_rne(e4m3_decode(*c) * f);
            }
            e_row
        } else {
            e_old
        }
    };
    *scale = pow2(e);
    let inv = pow2(-e);
    for (c, &v) in codes[off * d..][..d].iter_mut().zip(x) {
        *c = e4m3_rne(v.to_f32() * inv);
    }
}

/// Whole-block quantization of one (page, head) entry: rows `src` (`valid * head_dim`) into
/// `codes` (`[block_size, head_dim]`, rows past `valid` zeroed); returns the scale.
pub(crate) fn quantize_entry<T: KvElem>(src: &[T], codes: &mut [u8]) -> f32 {
    let e = kv8_exponent(finite_absmax(src));
    let inv = pow2(-e);
    let (head, tail) = codes.split_at_mut(src.len());
    for (c, &x) in head.iter_mut().zip(src) {
        *c = e4m3_rne(x.to_f32() * inv);
    }
    tail.fill(0);
    pow2(e)
}

/// Copy one (page, head) entry `se` of `src` into entry `de` of `dst`, K and V: `T` -> `T` and
/// kv8 -> kv8 bit-exact (codes and scales), kv8 -> `T` dequantized (`T::from_f32(decode * s)`),
/// `T` -> kv8 whole-block quantized over the first `valid` rows. `table`: [`e4m3_table`].
pub(crate) fn copy_entry<T: KvElem>(
    geo: &KvGeometry,
    src: &KvTier<T>,
    se: usize,
    dst: &mut KvTierMut<T>,
    de: usize,
    valid: usize,
    table: &[f32; 256],
) {
    let n = geo.entry_elems();
    let (s, t) = (se * n..(se + 1) * n, de * n..(de + 1) * n);
    match (src, dst) {
        (KvTier::Elem { k, v }, KvTierMut::Elem { k: dk, v: dv }) => {
            dk[t.clone()].copy_from_slice(&k[s.clone()]);
            dv[t].copy_from_slice(&v[s]);
        }
        (KvTier::Kv8(p), KvTierMut::Kv8(q)) => {
            q.k_codes[t.clone()].copy_from_slice(&p.k_codes[s.clone()]);
            q.v_codes[t].copy_from_slice(&p.v_codes[s]);
            q.k_scales[de] = p.k_scales[se];
            q.v_scales[de] = p.v_scales[se];
        }
        (KvTier::Kv8(p), KvTierMut::Elem { k: dk, v: dv }) => {
            let deq = |out: &mut [T], codes: &[u8], sc: f32| {
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = T::from_f32(table[usize::from(c)] * sc);
                }
            };
            deq(&mut dk[t.clone()], &p.k_codes[s.clone()], p.k_scales[se]);
            deq(&mut dv[t], &p.v_codes[s], p.v_scales[se]);
        }
        (KvTier::Elem { k, v }, KvTierMut::Kv8(q)) => {
            let rows = s.start..s.start + valid * geo.head_dim;
            q.k_scales[de] = quantize_entry(&k[rows.clone()], &mut q.k_codes[t.clone()]);
            q.v_scales[de] = quantize_entry(&v[rows], &mut q.v_codes[t]);
        }
    }
}

/// Whole-block kv8 quantization of `n` blocks of one array (K or V): for every block `b` and KV
/// head `h`, `scales[b, h] = 2^e` from the absmax over the block's first `valid[b]` rows of that
/// head, those rows `e4m3_rne(x * 2^-e)`, the rows past `valid[b]` code 0 (module doc).
///
/// # Errors
/// * [`crate::OasisError::Shape`] for a buffer of the wrong size;
/// * [`crate::OasisError::Invalid`] for a `valid` entry outside `1..=block_size`.
///
/// Nothing is written when an error is returned.
pub fn quantize_kv8<T: KvElem>(
    geo: &KvGeometry,
    src: &[T],          // [n, num_kv_heads, block_size, head_dim]
    valid: &[i32],      // [n] 1..=block_size
    codes: &mut [u8],   // [n, num_kv_heads, block_size, head_dim]
    scales: &mut [f32], // [n, num_kv_heads]
) -> Result<()> {
    geo.validate()?;
    let (h_kv, bs, d) = (geo.num_kv_heads, geo.block_size, geo.head_dim);
    let n = leading_rows("src", src.len(), &[h_kv, bs, d])?;
    check_len("valid", valid.len(), &[n])?;
    check_len("codes", codes.len(), &[n, h_kv, bs, d])?;
    check_len("scales", scales.len(), &[n, h_kv])?;
    for (i, &v) in valid.iter().enumerate() {
        length("valid", i, v, bs)?;
    }
    let entry = geo.entry_elems();
    for (b, &v) in valid.iter().enumerate() {
        let rows = v as usize * d; // validated
        for h in 0..h_kv {
            let e = b * h_kv + h;
            let at = e * entry;
            scales[e] = quantize_entry(&src[at..at + rows], &mut codes[at..at + entry]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponent_bounds() {
        assert_eq!(kv8_exponent(0.0), KV8_MIN_EXP);
        assert_eq!(kv8_exponent(f32::NAN), KV8_MIN_EXP);
        assert_eq!(kv8_exponent(f32::MAX), KV8_MAX_EXP);
        assert_eq!(kv8_exponent(f32::INFINITY), KV8_MAX_EXP);
        assert_eq!(kv8_exponent(448.0), 0);
        assert_eq!(kv8_exponent(448.5), 1);
        assert_eq!(kv8_exponent(224.0), -1);
        for e in KV8_MIN_EXP..=KV8_MAX_EXP {
            assert_eq!(kv8_scale_exponent(pow2(e)), e);
        }
        assert_eq!(kv8_scale_exponent(0.0), KV8_MIN_EXP);
        assert_eq!(kv8_scale_exponent(f32::NAN), KV8_MAX_EXP);
    }

    #[test]
    fn requantization_keeps_values_above_the_subnormals() {
        // A row at scale 2^-8, then a row that needs 2^3: old normal values keep their value.
        let (bs, d) = (4, 2);
        let mut codes = vec![0u8; bs * d];
        let mut scale = 0.0f32;
        append_row_kv8(&mut codes, &mut scale, 0, &[1.5f32, -0.25]);
        assert_eq!(scale, 2f32.powi(-8)); // 1.5 <= 448 2^-8
        assert_eq!(e4m3_decode(codes[0]) * scale, 1.5);
        append_row_kv8(&mut codes, &mut scale, 1, &[3000.0f32, 1.0]);
        assert_eq!(scale, 8.0);
        assert_eq!(e4m3_decode(codes[0]) * scale, 1.5);
        assert_eq!(e4m3_decode(codes[1]) * scale, -0.25);
        assert_eq!(e4m3_decode(codes[2]) * scale, 3072.0);
        // A smaller row never shrinks the scale.
        append_row_kv8(&mut codes, &mut scale, 2, &[0.5f32, 0.5]);
        assert_eq!(scale, 8.0);
    }
}
