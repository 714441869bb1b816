//! The 8-bit Quest bound: each complete block's `[min; max]` summary in FP8 (E4M3), rounded
//! outward, so that the Quest score over it is still an upper bound of every logit in the block,
//! for half the summary's bytes (a quarter of f32's).
//!
//! The fidelity selection's first stage (`KvConfig(score_candidates=...)`) only picks candidates
//! that the 2-bit key codes then rank, so it reads this bound instead of the 16-bit summaries: at
//! 44 requests x 16K on Qwen3-8B shapes the Quest read is ~184 MB per layer and step, the largest
//! read of the selection.
//!
//! Layout, per (host block `b`, KV head `h`):
//! * `bounds8 [num_host_blocks, num_kv_heads, 2, head_dim]` bytes: E4M3 bits of `down(min / s)`
//!   then `up(max / s)` (round toward -inf / +inf onto the E4M3 grid, see [`e4m3_down`]);
//! * `scales [num_host_blocks, num_kv_heads]` f32: `s = 2^e`, the smallest power of two (at least
//!   2^-120) with `max |x| / s <= 448` over the row's `2 head_dim` values; NaN when any summary
//!   value is not finite (the block then scores NaN, which ranks last).
//!
//! With `s` a power of two, `x / s` and the decoded value times `s` are exact in f32 (for the
//! ranges keys have), so `s * decode(down(min / s)) <= min` and `s * decode(up(max / s)) >= max`
//! hold exactly: the bound score is at least the 16-bit Quest score of the same summary, computed
//! exactly. Its looseness per channel is below one E4M3 step (2^-3 relative).

use crate::dtype::KvElem;
use crate::error::{check_len, Result};
use crate::geometry::KvGeometry;
use crate::kernels::score::quest_scores;
use crate::kernels::validate::{all_indices, leading_rows};

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Smallest exponent of a scale (keeps `2^e` a normal f32 for any summary).
pub const BOUND8_MIN_EXP: i32 = -120;

/// The f32 value of E4M3 bits `c` (sign, 4 exponent bits biased by 7, 3 mantissa bits; exponent
/// field 0 is subnormal, `m 2^-9`). `0x7f`/`0xff` (E4M3's NaN) decode as NaN. A table lookup
/// ([`E4M3_VALUES`]): the CPU twins decode every bound, code and page byte through it.
#[inline]
pub fn e4m3_decode(c: u8) -> f32 {
    E4M3_VALUES[c as usize]
}

/// Every E4M3 code's f32 value, indexed by the code (NaN for `0x7f`/`0xff`), built at compile
/// time from the bit layouts: a code of exponent field `e >= 1` is `(8 + m) 2^(e - 10)`, an f32
/// of exponent field `e + 120` and mantissa `m << 20`; a subnormal `m 2^-9` (`m` in 1..=7) is
/// normal in f32, its leading bit at `2^k`, `k = floor(log2 m)`.
pub static E4M3_VALUES: [f32; 256] = e4m3_values();

const fn e4m3_values() -> [f32; 256] {
    let mut out = [0.0f32; 256];
    let mut c = 0usize;
    while c < 256 {
        let sign = ((c as u32) & 0x80) << 24;
        let e = ((c >> 3) & 15) as u32;
        let m = (c & 7) as u32;
        let bits = if e == 15 && m == 7 {
            0x7fc0_0000 // f32::NAN, as e4m3_decode always returned (either sign)
        } else if e > 0 {
            sign | ((e + 120) << 23) | (m << 20)
        } else if m == 0 {
            sign // +-0
        } else {
            let k = 31 - m.leading_zeros(); // 0, 1 or 2
            sign | ((k + 118) << 23) | ((m - (1 << k)) << (23 - k))
        };
        out[c] = f32::from_bits(bits);
        c += 1;
    }
    out
}

/// The largest E4M3 magnitude `<= a`, as bits (`0 <= a <= 448`, finite).
#[inline]
fn mag_down(a: f32) -> u8 {
    if a < 2f32.powi(-6) {
        return (a * 512.0).floor() as u8; // subnormal: m 2^-9, m = 0..=7 (exact scaling)
    }
    let e = ilogb(a); // -6 ..= 8
    let m = (a * 2f32.powi(3 - e)).floor() as i32 - 8; // 0..=7, exact scaling
    (((e + 7) << 3) | m) as u8
}

/// floor(log2(a)) of a positive normal f32.
#[inline]
fn ilogb(a: f32) -> i32 {
    ((a.to_bits() >> 23) & 0xff) as i32 - 127
}

/// The smallest E4M3 magnitude `>= a`, as bits (`0 <= a <= 448`, finite).
#[inline]
fn mag_up(a: f32) -> u8 {
    let d = mag_down(a);
    if e4m3_decode(d) == a {
        d
    } else {
        d + 1 // the next magnitude (codes are ordered by magnitude); <= 0x7e since a < 448
    }
}

/// The largest E4M3 value `<= y` (`|y| <= 448`, finite), as bits.
#[inline]
pub fn e4m3_down(y: f32) -> u8 {
    if y >= 0.0 {
        mag_down(y)
    } else {
        0x80 | mag_up(-y)
    }
}

/// The smallest E4M3 value `>= y` (`|y| <= 448`, finite), as bits.
#[inline]
pub fn e4m3_up(y: f32) -> u8 {
    if y >= 0.0 {
        mag_up(y)
    } else {
        0x80 | mag_down(-y)
    }
}

/// E4M3's NaN code (`0x7f`; `0xff` decodes as NaN too).
pub const E4M3_NAN: u8 = 0x7f;

/// The E4M3 value nearest to `y`, as bits: round to nearest, ties to the even mantissa (the even
/// code), the sign kept (so `-0.0` and negative values that round to zero give `0x80`). Finite
/// magnitudes at or above 448 saturate to `±448` (`0x7e`/`0xfe`); NaN and `±inf` give
/// [`E4M3_NAN`]. The FP8 KV cache's quantizer (see [`crate::kernels::kv8`]).
#[inline]
pub fn e4m3_rne(y: f32) -> u8 {
    if !y.is_finite() {
        return E4M3_NAN;
    }
    let sign = if y.is_sign_negative() { 0x80 } else { 0 };
    let a = y.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    let mag = if a < 2f32.powi(-6) {
        // Subnormal: m 2^-9 with m = round(a 2^9) in 0..=8 (exact scaling); m = 8 is 2^-6, code 8.
        (a * 512.0).round_ties_even() as u8
    } else {
        let e = ilogb(a); // -6 ..= 8
                          // (a 2^(3-e)) in [8, 16), exact; rounding to 16 carries into the exponent field.
        let r = (a * 2f32.powi(3 - e)).round_ties_even() as i32; // 8 ..= 16 (<= 14 when e = 8)
        (((e + 7) << 3) + r - 8) as u8
    };
    sign | mag
}

/// The exponent `e` of a row's scale `2^e`: the smallest with `maxabs / 2^e <= 448`, at least
/// [`BOUND8_MIN_EXP`] (`maxabs` finite, `>= 0`).
#[inline]
pub fn bound8_exponent(maxabs: f32) -> i32 {
    if maxabs.is_nan() || maxabs < 2f32.powi(-126) {
        return BOUND8_MIN_EXP;
    }
    let e = ilogb(maxabs) - 8; // maxabs / 2^e in [256, 512)
    if e < BOUND8_MIN_EXP {
        return BOUND8_MIN_EXP; // (and 2^-e below stays a normal f32)
    }
    if maxabs * pow2(-e) > E4M3_MAX {
        e + 1
    } else {
        e
    }
}

/// 2^e as an f32 (`-126 <= e <= 127`).
#[inline]
pub(crate) fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// One (block, head) row: `mins`/`maxs` (`head_dim` each) -> its bytes (`2 head_dim`) and scale.
fn encode_row(mins: &[f32], maxs: &[f32], out: &mut [u8]) -> f32 {
    let (lo_out, hi_out) = out.split_at_mut(mins.len());
    if mins.iter().chain(maxs).any(|x| !x.is_finite()) {
        lo_out.fill(0);
        hi_out.fill(0);
        return f32::NAN;
    }
    let maxabs = mins.iter().chain(maxs).fold(0.0f32, |a, x| a.max(x.abs()));
    let e = bound8_exponent(maxabs);
    let inv = pow2(-e);
    for (o, &x) in lo_out.iter_mut().zip(mins) {
        *o = e4m3_down(x * inv);
    }
    for (o, &x) in hi_out.iter_mut().zip(maxs) {
        *o = e4m3_up(x * inv);
    }
    pow2(e)
}

/// Write the 8-bit bounds of host blocks `block_ids` (all KV heads) from their `[min; max]`
/// summaries (those of complete blocks). Indexed by block id like the summaries.
///
/// # Errors
/// [`crate::OasisError::Shape`] for a buffer of the wrong size,
/// [`crate::OasisError::IndexOutOfRange`] for a block id outside the summaries. Nothing is written
/// when an error is returned.
pub fn build_bounds8<T: KvElem>(
    geo: &KvGeometry,
    summaries: &[T],    // [num_host_blocks, num_kv_heads, 2, head_dim]
    block_ids: &[i32],  // [n]
    bounds8: &mut [u8], // [num_host_blocks, num_kv_heads, 2, head_dim]
    scales: &mut [f32], // [num_host_blocks, num_kv_heads]
) -> Result<()> {
    geo.validate()?;
    let (h_kv, d) = (geo.num_kv_heads, geo.head_dim);
    let num_host = leading_rows("summaries", summaries.len(), &[h_kv, 2, d])?;
    check_len("bounds8", bounds8.len(), &[num_host, h_kv, 2, d])?;
    check_len("scales", scales.len(), &[num_host, h_kv])?;
    all_indices("block_ids", block_ids, num_host)?;
    let (mut mn, mut mx) = (vec![0.0f32; d], vec![0.0f32; d]);
    for &b in block_ids {
        let b = b as usize; // validated
        for h in 0..h_kv {
            let at = (b * h_kv + h) * 2 * d;
            for x in 0..d {
                mn[x] = summaries[at + x].to_f32();
                mx[x] = summaries[at + d + x].to_f32();
            }
            scales[b * h_kv + h] = encode_row(&mn, &mx, &mut bounds8[at..at + 2 * d]);
        }
    }
    Ok(())
}

/// The number of host blocks of `bounds8 [num_host_blocks, num_kv_heads, 2, head_dim]` and
/// `scales [num_host_blocks, num_kv_heads]`, checked to agree.
pub(crate) fn bound8_rows(geo: &KvGeometry, bounds8: &[u8], scales: &[f32]) -> Result<usize> {
    let (h_kv, d) = (geo.num_kv_heads, geo.head_dim);
    let n = leading_rows("bounds8", bounds8.len(), &[h_kv, 2, d])?;
    check_len("scales", scales.len(), &[n, h_kv])?;
    Ok(n)
}

/// The decoded 8-bit bound of (block, head) row `entry` (`b * num_kv_heads + h`):
/// `lo[x] = e4m3_decode(lo8[x]) * s` and `hi[x] = e4m3_decode(hi8[x]) * s`, `head_dim = lo.len()`
/// channels. Exact in f32 (`s` is a power of two at least 2^-120 and a decoded value has four
/// significant bits), and NaN throughout for a NaN scale (a row with a non-finite summary).
/// The range of the 2-bit key codes ([`crate::kernels::codes`]).
#[inline]
pub fn decode_bound8(bounds8: &[u8], scales: &[f32], entry: usize, lo: &mut [f32], hi: &mut [f32]) {
    let d = lo.len();
    let s = scales[entry];
    let row = &bounds8[entry * 2 * d..][..2 * d];
    for (x, (l, h)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
        *l = e4m3_decode(row[x]) * s;
        *h = e4m3_decode(row[d + x]) * s;
    }
}

/// Quest scores over the 8-bit bounds: `scores[j, h]` = `s * sum over query heads g of KV head h,
/// over d, of max(q[s,g,d] lo'[d], q[s,g,d] hi'[d])` with `lo'`, `hi'` the decoded bytes of block
/// `b = blk_indices[j]` and `s` its scale (f32: each g in d order, then the sum times `s`).
///
/// # Errors
/// As [`crate::kernels::score_blocks`]. `scores` is untouched when an error is returned.
pub fn score_blocks_bound8<T: KvElem>(
    geo: &KvGeometry,
    q: &[T],             // [num_seqs, num_qo_heads, head_dim]
    bounds8: &[u8],      // [num_host_blocks, num_kv_heads, 2, head_dim]
    scales: &[f32],      // [num_host_blocks, num_kv_heads]
    blk_indptr: &[i32],  // [num_seqs + 1]
    blk_indices: &[i32], // [nnz]
    scores: &mut [f32],  // [nnz, num_kv_heads]
) -> Result<()> {
    let (h_kv, d) = (geo.num_kv_heads, geo.head_dim);
    let num_host = || bound8_rows(geo, bounds8, scales);
    quest_scores(
        geo,
        q,
        blk_indptr,
        blk_indices,
        scores,
        num_host,
        |b, h, mn, mx| {
            let at = (b * h_kv + h) * 2 * d;
            for x in 0..d {
                mn[x] = e4m3_decode(bounds8[at + x]);
                mx[x] = e4m3_decode(bounds8[at + d + x]);
            }
            scales[b * h_kv + h]
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every E4M3 value, ascending (no NaN, one zero).
    fn grid() -> Vec<f32> {
        let mut v: Vec<f32> = (0u8..=255)
            .map(e4m3_decode)
            .filter(|x| !x.is_nan())
            .collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v.dedup();
        v
    }

    /// The format's arithmetic definition, which the table replaces.
    fn decode_by_arithmetic(c: u8) -> f32 {
        let ex = i32::from((c >> 3) & 15);
        let m = f32::from(c & 7);
        if ex == 15 && c & 7 == 7 {
            return f32::NAN;
        }
        let mag = if ex == 0 {
            m * 2f32.powi(-9)
        } else {
            (8.0 + m) * 2f32.powi(ex - 10)
        };
        if c & 0x80 != 0 {
            -mag
        } else {
            mag
        }
    }

    #[test]
    fn the_table_is_the_arithmetic_decode_bit_for_bit() {
        for c in 0u8..=255 {
            let (t, a) = (e4m3_decode(c), decode_by_arithmetic(c));
            assert_eq!(t.to_bits(), a.to_bits(), "code {c:#04x}: {t} vs {a}");
        }
    }

    #[test]
    fn decode_matches_the_format() {
        assert_eq!(e4m3_decode(0x7e), 448.0);
        assert_eq!(e4m3_decode(0xfe), -448.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_decode(0x38), 1.0);
        assert!(e4m3_decode(0x7f).is_nan() && e4m3_decode(0xff).is_nan());
        assert_eq!(grid().len(), 253); // 2 x 126 nonzero magnitudes + zero
    }

    #[test]
    fn outward_rounding_is_the_nearest_grid_value_on_each_side() {
        let g = grid();
        let mut next = crate::kernels::xorshift(0x1234_5678);
        let mut ys: Vec<f32> = g.clone();
        for _ in 0..20000 {
            let r = next();
            let mag = (r % 1_000_000) as f32 / 1_000_000.0
                * 448.0
                * 2f32.powi(-(((r >> 32) % 20) as i32));
            ys.push(if r & 1 << 40 != 0 { -mag } else { mag });
        }
        for y in ys {
            let (lo, hi) = (e4m3_decode(e4m3_down(y)), e4m3_decode(e4m3_up(y)));
            let below = g
                .iter()
                .copied()
                .filter(|&x| x <= y)
                .fold(f32::NEG_INFINITY, f32::max);
            let above = g
                .iter()
                .copied()
                .filter(|&x| x >= y)
                .fold(f32::INFINITY, f32::min);
            assert_eq!(lo, below, "down({y})");
            assert_eq!(hi, above, "up({y})");
        }
    }

    #[test]
    fn exponent_is_the_smallest_that_fits() {
        for &m in &[1e-30f32, 0.01, 1.0, 3.5, 447.9, 448.0, 448.1, 1e4, 3e38] {
            let e = bound8_exponent(m);
            assert!(m * pow2(-e) <= E4M3_MAX, "{m}");
            if e > BOUND8_MIN_EXP {
                assert!(m * pow2(1 - e) > E4M3_MAX, "{m}: {e} is not the smallest");
            }
        }
        assert_eq!(bound8_exponent(0.0), BOUND8_MIN_EXP);
    }

    #[test]
    fn the_bound_holds_and_is_tight() {
        let geo = KvGeometry::new(4, 2, 16, 8).unwrap();
        let (h, d) = (2usize, 16usize);
        let nb = 5usize;
        let mut summaries = vec![0.0f32; nb * h * 2 * d];
        let mut rng = 7u64;
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((rng >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        for b in 0..nb {
            for hh in 0..h {
                let at = (b * h + hh) * 2 * d;
                let scale = [1e-3f32, 0.5, 3.0, 100.0, 2e4][b];
                for x in 0..d {
                    let (a, c) = (next() * scale, next() * scale);
                    summaries[at + x] = a.min(c);
                    summaries[at + d + x] = a.max(c);
                }
            }
        }
        let mut b8 = vec![0u8; nb * h * 2 * d];
        let mut sc = vec![0.0f32; nb * h];
        build_bounds8(&geo, &summaries, &[0, 1, 2, 3, 4], &mut b8, &mut sc).unwrap();
        for b in 0..nb {
            for hh in 0..h {
                let at = (b * h + hh) * 2 * d;
                let s = sc[b * h + hh];
                for x in 0..d {
                    let (lo, hi) = (e4m3_decode(b8[at + x]) * s, e4m3_decode(b8[at + d + x]) * s);
                    let (mn, mx) = (summaries[at + x], summaries[at + d + x]);
                    assert!(lo <= mn && hi >= mx, "block {b} head {hh} d {x}");
                    // within one E4M3 step (2^-3 relative) of the value, or of the subnormal step
                    let tol = |v: f32| v.abs() / 8.0 + s * 2f32.powi(-9);
                    assert!(mn - lo <= tol(mn) && hi - mx <= tol(mx));
                }
            }
        }
        // The score over the bound is >= the exact Quest score of the summary.
        let q: Vec<f32> = (0..4 * d).map(|_| next() * 2.0).collect();
        let indptr = [0, 5];
        let idx = [0, 1, 2, 3, 4];
        let mut s8 = vec![0.0f32; 5 * h];
        score_blocks_bound8(&geo, &q, &b8, &sc, &indptr, &idx, &mut s8).unwrap();
        let mut exact = vec![0.0f32; 5 * h];
        crate::kernels::score_blocks(&geo, &q, &summaries, &indptr, &idx, &mut exact).unwrap();
        for (a, e) in s8.iter().zip(&exact) {
            assert!(*a >= *e - 1e-4 * e.abs().max(1.0), "{a} < {e}");
        }
    }

    #[test]
    fn non_finite_rows_score_nan_and_errors_write_nothing() {
        let geo = KvGeometry::new(1, 1, 4, 4).unwrap();
        let mut s = vec![0.0f32, 0.0, 0.0, 0.0, 1.0, f32::INFINITY, 1.0, 1.0];
        let mut b8 = vec![9u8; 8];
        let mut sc = vec![0.0f32; 1];
        build_bounds8(&geo, &s, &[0], &mut b8, &mut sc).unwrap();
        assert!(sc[0].is_nan());
        s[5] = 1.0;
        let mut sc2 = vec![5.0f32; 1];
        assert!(build_bounds8(&geo, &s, &[1], &mut b8, &mut sc2).is_err());
        assert_eq!(sc2[0], 5.0);
        let mut out = vec![-1.0f32; 1];
        let q = [1.0f32, -1.0, 0.5, 0.0];
        score_blocks_bound8(&geo, &q, &b8, &sc, &[0, 1], &[0], &mut out).unwrap();
        assert!(out[0].is_nan());
    }
}
