//! 2-bit key codes: a block score that estimates each block's largest logit.
//!
//! Each complete host block keeps every key quantised to 2 bits per channel inside the block's
//! 8-bit bound ([`crate::kernels::bound8`]: its `[min; max]` summary in E4M3 rounded outward, with
//! a power-of-two scale per (block, head)), decoded: `lo = e4m3_decode(lo8) s`,
//! `hi = e4m3_decode(hi8) s` ([`decode_bound8`], exact in f32), `c = round(3 (k - lo) / (hi - lo))`,
//! `k ≈ lo + c (hi - lo) / 3`. The score of a block for KV head `h` is the sum over the group's
//! query heads `g` of the largest approximate logit `max_t q_g · k̃_t`. On SmolLM2 this ranks
//! blocks within half a point of the exact max logit (docs/EVAL.md), and as well as codes inside
//! the 16-bit summary did (`int2/b8` there): the second stage of the two-stage selection reads the
//! codes and the bound (which its first stage reads too), `block_size head_dim / 4 + 2 head_dim`
//! bytes (and a 4-byte scale) per candidate and head, not the summaries.
//!
//! The bound holds every key of the block (it is rounded outward from their min/max), so every
//! code's level 0 and 3 lie at or outside the keys' range. A block whose keys are not all finite
//! has a NaN scale: its codes are 0 and it scores NaN, which ranks last in top-K.
//!
//! The logit's code part uses f16 weights (see [`code_weight`]): the GPU feeds them to one
//! tensor-core MMA per 16 channels with the codes as the other operand, and their rounding
//! (relative 2^-11, three times) is far below the 2-bit codes' own error.
//!
//! Layout: `codes [num_host_blocks, num_kv_heads, block_size, head_dim / 4]` bytes; channel
//! `4 i + j` of a token is bits `2 j .. 2 j + 2` of byte `i`. `head_dim` must be a multiple of 4.
//! The codes are indexed by block id like the bound they are encoded in.

use half::f16;

use crate::dtype::KvElem;
use crate::error::{check_len, OasisError, Result};
use crate::geometry::KvGeometry;
use crate::kernels::bound8::{bound8_rows, decode_bound8};
use crate::kernels::validate::{all_indices, csr, csr_range, index, leading_rows};

/// Levels of a 2-bit code.
pub const CODE_LEVELS: f32 = 3.0;

/// The weight of code `c` of channel `d` for a query value `q` and the block's `[lo, hi]` range
/// in that channel (the decoded bound): `f16(f16(q / 3) * f16(hi - lo))` (IEEE round to nearest
/// even at each f16 conversion, subnormals kept; the product of two f16 is exact in f32), as an
/// f32. The logit of token t is `sum_d q_d lo_d + sum_d c_{t,d} w_d`; the CUDA kernel computes
/// the same products.
#[inline]
pub fn code_weight(q: f32, lo: f32, hi: f32) -> f32 {
    weight_of(query_third(q), range_f16(lo, hi))
}

/// `f16(q / 3)` as an f32: [`code_weight`]'s query factor (once per query value).
#[inline]
fn query_third(q: f32) -> f32 {
    f16::from_f32(q / CODE_LEVELS).to_f32()
}

/// `f16(hi - lo)` as an f32: [`code_weight`]'s range factor (once per block, head and channel).
#[inline]
fn range_f16(lo: f32, hi: f32) -> f32 {
    f16::from_f32(hi - lo).to_f32()
}

/// `f16(q3 r)` as an f32: [`code_weight`] from its two factors.
#[inline]
fn weight_of(q3: f32, r: f32) -> f32 {
    f16::from_f32(q3 * r).to_f32()
}

/// Bytes of one token's codes.
pub fn code_row_bytes(head_dim: usize) -> usize {
    head_dim / 4
}

fn check_head_dim(geo: &KvGeometry) -> Result<()> {
    if !geo.head_dim.is_multiple_of(4) {
        return Err(OasisError::Config(format!(
            "2-bit key codes need head_dim divisible by 4, got {}",
            geo.head_dim
        )));
    }
    Ok(())
}

/// The code of `x` in `[lo, hi]`: 0..=3 (0 when the range is empty or NaN, or `x` is NaN).
#[inline]
pub fn encode(x: f32, lo: f32, hi: f32) -> u8 {
    let w = hi - lo;
    // Not `!(w > 0.0)`: clippy prefers the NaN case spelled out.
    if w.is_nan() || w <= 0.0 {
        return 0;
    }
    // `as u8` saturates and maps NaN to 0.
    ((x - lo) / w * CODE_LEVELS).round().clamp(0.0, CODE_LEVELS) as u8
}

/// Write the codes of complete host blocks `block_ids` (all KV heads) from their keys, in host
/// rows `block_rows` (`None`: the row is the block id), inside their 8-bit bounds (`bounds8` and
/// `scales` of [`crate::kernels::build_bounds8`], which must be those of the same, complete
/// block: build the bound first, as [`crate::kernels::encode_blocks`] does). Bounds and codes are
/// indexed by block id.
///
/// # Errors
/// [`OasisError::Shape`] for a buffer of the wrong size, [`OasisError::IndexOutOfRange`] for a
/// block id outside the bounds or a row outside the host pool, [`OasisError::Config`] for a
/// head_dim not divisible by 4. Nothing is written when an error is returned.
#[allow(clippy::too_many_arguments)]
pub fn build_key_codes<T: KvElem>(
    geo: &KvGeometry,
    host_k: &[T],               // [num_host_rows, num_kv_heads, block_size, head_dim]
    bounds8: &[u8],             // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3
    scales: &[f32],             // [num_host_blocks, num_kv_heads]
    block_ids: &[i32],          // [n]
    block_rows: Option<&[i32]>, // [n] host row of each block; None: the id
    codes: &mut [u8],           // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
) -> Result<()> {
    geo.validate()?;
    check_head_dim(geo)?;
    let (h_kv, bs, d) = (geo.num_kv_heads, geo.block_size, geo.head_dim);
    let num_rows = leading_rows("host_k", host_k.len(), &[h_kv, bs, d])?;
    let num_host = bound8_rows(geo, bounds8, scales)?;
    check_len("codes", codes.len(), &[num_host, h_kv, bs, d / 4])?;
    if let Some(rows) = block_rows {
        check_len("block_rows", rows.len(), &[block_ids.len()])?;
    }
    let row_of = |i: usize| block_rows.map_or(block_ids[i], |r| r[i]);
    for (i, &b) in block_ids.iter().enumerate() {
        index("block_ids", b, num_host)?;
        let what = if block_rows.is_some() {
            "block_rows"
        } else {
            "block_ids"
        };
        index(what, row_of(i), num_rows)?;
    }
    let row = d / 4;
    let (mut lo, mut hi) = (vec![0.0f32; d], vec![0.0f32; d]);
    for (i, &b) in block_ids.iter().enumerate() {
        let (b, r) = (b as usize, row_of(i) as usize); // validated
        for h in 0..h_kv {
            decode_bound8(bounds8, scales, b * h_kv + h, &mut lo, &mut hi);
            let keys = &host_k[(r * h_kv + h) * bs * d..][..bs * d];
            let out = &mut codes[(b * h_kv + h) * bs * row..][..bs * row];
            for (k, o) in keys.chunks_exact(d).zip(out.chunks_exact_mut(row)) {
                for (i, byte) in o.iter_mut().enumerate() {
                    let mut v = 0u8;
                    for j in 0..4 {
                        let x = 4 * i + j;
                        v |= encode(k[x].to_f32(), lo[x], hi[x]) << (2 * j);
                    }
                    *byte = v;
                }
            }
        }
    }
    Ok(())
}

/// Scores from the codes: `scores[j, h]` = sum over query heads g of KV head h of
/// `max_t (sum_d q[s,g,d] lo[b,h,d] + sum_d c[b,h,t,d] w[g,d])` with
/// `w[g,d] = code_weight(q[s,g,d], lo[b,h,d], hi[b,h,d])` (≈ `q (hi - lo) / 3`), `lo`, `hi` the
/// decoded 8-bit bound ([`decode_bound8`]), `b = blk_indices[j]`, j in seq s's range. f32: the
/// base in d order, then the codes' terms in d order for each (g, t). NaN for a block whose
/// bound is NaN (a non-finite key): it ranks last in top-K.
///
/// # Errors
/// As [`crate::kernels::score_blocks`], plus [`OasisError::Config`] for a head_dim not divisible
/// by 4. `scores` is untouched when an error is returned.
#[allow(clippy::too_many_arguments)]
pub fn score_blocks_codes<T: KvElem>(
    geo: &KvGeometry,
    q: &[T],             // [num_seqs, num_qo_heads, head_dim]
    bounds8: &[u8],      // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3
    scales: &[f32],      // [num_host_blocks, num_kv_heads]
    codes: &[u8],        // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    blk_indptr: &[i32],  // [num_seqs + 1]
    blk_indices: &[i32], // [nnz]
    scores: &mut [f32],  // [nnz, num_kv_heads]
) -> Result<()> {
    let basis = CodesBasis {
        bounds8,
        scales,
        codes,
    };
    let (_, num_host) = check_inputs(geo, q, &basis, blk_indptr, blk_indices)?;
    let h_kv = geo.num_kv_heads;
    check_len("scores", scores.len(), &[blk_indices.len(), h_kv])?;
    all_indices("blk_indices", blk_indices, num_host)?;
    let mut scratch = Scratch::new(geo.head_dim);
    for_each_query(geo, q, |s, query| {
        for j in csr_range(blk_indptr, s) {
            let b = blk_indices[j] as usize; // validated
            for h in 0..h_kv {
                scores[j * h_kv + h] = entry_score(geo, query, &basis, b, h, &mut scratch);
            }
        }
    });
    Ok(())
}

/// What a codes score reads of the pool: the 8-bit bounds, their scales and the codes.
struct CodesBasis<'a> {
    bounds8: &'a [u8],
    scales: &'a [f32],
    codes: &'a [u8],
}

/// Per-call buffers of [`entry_score`]: the decoded bound of one (block, head) and the code
/// weights of one query head, `head_dim` values each, and the block's tokens' logits.
struct Scratch {
    lo: Vec<f32>,
    hi: Vec<f32>,
    r: Vec<f32>,
    w: Vec<f32>,
    logits: Vec<f32>,
}

impl Scratch {
    fn new(d: usize) -> Self {
        Self {
            lo: vec![0.0; d],
            hi: vec![0.0; d],
            r: vec![0.0; d],
            w: vec![0.0; d],
            logits: Vec::new(),
        }
    }
}

/// The checks [`score_blocks_codes`] and [`rescore_blocks_codes`] share, before the scores':
/// geometry, head_dim, the CSR, and the shapes of `q`, the bounds and the codes. Returns
/// `(num_seqs, num_host_blocks)`.
fn check_inputs<T: KvElem>(
    geo: &KvGeometry,
    q: &[T],
    basis: &CodesBasis<'_>,
    blk_indptr: &[i32],
    blk_indices: &[i32],
) -> Result<(usize, usize)> {
    geo.validate()?;
    check_head_dim(geo)?;
    let (hq, h_kv, bs, d) = (
        geo.num_qo_heads,
        geo.num_kv_heads,
        geo.block_size,
        geo.head_dim,
    );
    let num_seqs = csr("blk_indptr", blk_indptr, "blk_indices", blk_indices.len())?;
    check_len("q", q.len(), &[num_seqs, hq, d])?;
    let num_host = bound8_rows(geo, basis.bounds8, basis.scales)?;
    check_len("codes", basis.codes.len(), &[num_host, h_kv, bs, d / 4])?;
    Ok((num_seqs, num_host))
}

/// `f(s, Query)` for every sequence `s` of `q` `[num_seqs, num_qo_heads, head_dim]`: its
/// queries as f32 and their code factors `f16(q / 3)` (buffers refilled per sequence).
fn for_each_query<T: KvElem>(geo: &KvGeometry, q: &[T], mut f: impl FnMut(usize, Query<'_>)) {
    let row = geo.num_qo_heads * geo.head_dim;
    let (mut qf, mut q3) = (vec![0.0f32; row], vec![0.0f32; row]);
    for (s, qs) in q.chunks_exact(row).enumerate() {
        for ((x, t), &v) in qf.iter_mut().zip(q3.iter_mut()).zip(qs) {
            *x = v.to_f32();
            *t = query_third(*x);
        }
        f(s, Query { qf: &qf, q3: &q3 });
    }
}

/// One sequence's queries `[num_qo_heads, head_dim]` as f32 (`qf`) and their code factors
/// `f16(q / 3)` (`q3`, [`code_weight`]).
#[derive(Clone, Copy)]
struct Query<'a> {
    qf: &'a [f32],
    q3: &'a [f32],
}

/// The codes score of host block `b` for KV head `h` (the sum over the group of the block's
/// largest approximate logit), from the sequence's `query` (its queries `[num_qo_heads, head_dim]`
/// as f32 and their code factors).
/// Shapes and `b` are the caller's to check.
fn entry_score(
    geo: &KvGeometry,
    query: Query<'_>,
    basis: &CodesBasis<'_>,
    b: usize,
    h: usize,
    scratch: &mut Scratch,
) -> f32 {
    let (h_kv, bs, d, gs) = (
        geo.num_kv_heads,
        geo.block_size,
        geo.head_dim,
        geo.group_size(),
    );
    let row = d / 4;
    let Scratch {
        lo,
        hi,
        r,
        w,
        logits,
    } = scratch;
    decode_bound8(basis.bounds8, basis.scales, b * h_kv + h, lo, hi);
    for x in 0..d {
        r[x] = range_f16(lo[x], hi[x]);
    }
    let blk = &basis.codes[(b * h_kv + h) * bs * row..][..bs * row];
    let mut acc = 0.0f32;
    for g in h * gs..(h + 1) * gs {
        let (qg, q3) = (&query.qf[g * d..(g + 1) * d], &query.q3[g * d..(g + 1) * d]);
        let mut base = 0.0f32;
        for x in 0..d {
            base += qg[x] * lo[x];
            w[x] = weight_of(q3[x], r[x]); // code_weight(qg[x], lo[x], hi[x])
        }
        // Each token's logit is `base` plus its codes' terms in d order, as one chain; the
        // tokens' chains advance side by side (the same sums, bit for bit, without one add
        // waiting on the last across the whole block).
        logits.clear();
        logits.resize(bs, base);
        for (i, wq) in w.chunks_exact(4).enumerate() {
            for (jj, &wv) in wq.iter().enumerate() {
                for (logit, t) in logits.iter_mut().zip(blk.chunks_exact(row)) {
                    *logit += wv * ((t[i] >> (2 * jj)) & 3) as f32;
                }
            }
        }
        let mut best = f32::NEG_INFINITY;
        for &logit in logits.iter() {
            // NaN propagates: a block whose estimate is NaN ranks last in top-K.
            best = if logit.is_nan() || best.is_nan() {
                f32::NAN
            } else {
                best.max(logit)
            };
        }
        acc += best;
    }
    acc
}

/// The codes score of a few candidate blocks per (sequence, KV head): the second stage of
/// `KvConfig(score_candidates=F)`, after the Quest bound's top-`m` per head.
/// `scores[(s m + i), h]` is [`score_blocks_codes`]'s value of the logical block `cand[s, h, i]`
/// of sequence `s` (its host block `blk_indices[blk_indptr[s] + cand[s, h, i]]`) for head `h`,
/// and -inf for a negative candidate (top-K padding). The layout is a CSR of `m` entries per
/// sequence, so `topk_blocks(num_kv_heads, scores, [0, m, 2 m, ..], k)` ranks them; its
/// positions index `cand`.
///
/// # Errors
/// As [`score_blocks_codes`], plus [`OasisError::IndexOutOfRange`] for a candidate outside its
/// sequence's row. `scores` is untouched when an error is returned.
#[allow(clippy::too_many_arguments)]
pub fn rescore_blocks_codes<T: KvElem>(
    geo: &KvGeometry,
    q: &[T],             // [num_seqs, num_qo_heads, head_dim]
    bounds8: &[u8],      // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3
    scales: &[f32],      // [num_host_blocks, num_kv_heads]
    codes: &[u8],        // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    blk_indptr: &[i32],  // [num_seqs + 1]
    blk_indices: &[i32], // [nnz]
    cand: &[i32],        // [num_seqs, num_kv_heads, m] logical blocks, negative = none
    m: usize,
    scores: &mut [f32], // [num_seqs * m, num_kv_heads]
) -> Result<()> {
    let basis = CodesBasis {
        bounds8,
        scales,
        codes,
    };
    let (num_seqs, num_host) = check_inputs(geo, q, &basis, blk_indptr, blk_indices)?;
    let h_kv = geo.num_kv_heads;
    check_len("cand", cand.len(), &[num_seqs, h_kv, m])?;
    check_len("scores", scores.len(), &[num_seqs * m, h_kv])?;
    all_indices("blk_indices", blk_indices, num_host)?;
    for s in 0..num_seqs {
        let n = csr_range(blk_indptr, s).len();
        for &c in &cand[s * h_kv * m..(s + 1) * h_kv * m] {
            if c >= 0 {
                index("cand", c, n)?;
            }
        }
    }
    let mut scratch = Scratch::new(geo.head_dim);
    for_each_query(geo, q, |s, query| {
        let row0 = csr_range(blk_indptr, s).start;
        for h in 0..h_kv {
            for i in 0..m {
                let c = cand[(s * h_kv + h) * m + i];
                scores[(s * m + i) * h_kv + h] = if c < 0 {
                    f32::NEG_INFINITY
                } else {
                    let b = blk_indices[row0 + c as usize] as usize; // validated
                    entry_score(geo, query, &basis, b, h, &mut scratch)
                };
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{build_bounds8, build_summaries, e4m3_decode, score_blocks_bound8};

    fn geo() -> KvGeometry {
        KvGeometry::new(4, 2, 8, 4).unwrap()
    }

    /// The 8-bit bounds (bytes, scales) of host blocks `0..n` whose keys are `host_k` (complete
    /// blocks): their summaries, then the bound of those.
    fn bounds_of(g: &KvGeometry, host_k: &[f32], n: usize) -> (Vec<f32>, Vec<u8>, Vec<f32>) {
        let (hk, d) = (g.num_kv_heads, g.head_dim);
        let ids: Vec<i32> = (0..n as i32).collect();
        let mut summ = vec![0.0f32; n * hk * 2 * d];
        build_summaries(
            g,
            host_k,
            &ids,
            None,
            &vec![g.block_size as i32; n],
            &mut summ,
        )
        .unwrap();
        let (mut b8, mut sc) = (vec![0u8; n * hk * 2 * d], vec![0.0f32; n * hk]);
        build_bounds8(g, &summ, &ids, &mut b8, &mut sc).unwrap();
        (summ, b8, sc)
    }

    /// [`entry_score`] as it was written first: one token's logit after another, each one add
    /// chain over the codes in d order.
    fn entry_score_token_by_token(
        geo: &KvGeometry,
        qf: &[f32],
        basis: &CodesBasis<'_>,
        b: usize,
        h: usize,
    ) -> f32 {
        let (h_kv, bs, d, gs) = (
            geo.num_kv_heads,
            geo.block_size,
            geo.head_dim,
            geo.group_size(),
        );
        let row = d / 4;
        let (mut lo, mut hi, mut w) = (vec![0.0f32; d], vec![0.0f32; d], vec![0.0f32; d]);
        decode_bound8(basis.bounds8, basis.scales, b * h_kv + h, &mut lo, &mut hi);
        let blk = &basis.codes[(b * h_kv + h) * bs * row..][..bs * row];
        let mut acc = 0.0f32;
        for g in h * gs..(h + 1) * gs {
            let qg = &qf[g * d..(g + 1) * d];
            let mut base = 0.0f32;
            for x in 0..d {
                base += qg[x] * lo[x];
                w[x] = code_weight(qg[x], lo[x], hi[x]);
            }
            let mut best = f32::NEG_INFINITY;
            for t in blk.chunks_exact(row) {
                let mut logit = base;
                for (i, &byte) in t.iter().enumerate() {
                    for jj in 0..4 {
                        logit += w[4 * i + jj] * ((byte >> (2 * jj)) & 3) as f32;
                    }
                }
                best = if logit.is_nan() || best.is_nan() {
                    f32::NAN
                } else {
                    best.max(logit)
                };
            }
            acc += best;
        }
        acc
    }

    #[test]
    fn side_by_side_token_chains_are_the_token_by_token_sums_bit_for_bit() {
        // Random bounds, scales and codes (any bytes: the score reads them as they are), a NaN
        // scale among them; GQA 4, head_dim 64 and 128, blocks of 16 and 8.
        let mut next = crate::kernels::xorshift(0x9e37_79b9_7f4a_7c15);
        for (d, bs) in [(64, 16), (128, 8), (128, 16)] {
            let g = KvGeometry::new(8, 2, d, bs).unwrap();
            let n = 24;
            let b8: Vec<u8> = (0..n * 2 * 2 * d)
                .map(|_| (next() % 0x7e) as u8 | (next() as u8 & 0x80))
                .collect();
            let mut sc: Vec<f32> = (0..n * 2).map(|i| 2f32.powi((i % 9) as i32 - 4)).collect();
            sc[5] = f32::NAN;
            let codes: Vec<u8> = (0..n * 2 * bs * d / 4).map(|_| next() as u8).collect();
            let basis = CodesBasis {
                bounds8: &b8,
                scales: &sc,
                codes: &codes,
            };
            let qf: Vec<f32> = (0..8 * d)
                .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let q3: Vec<f32> = qf.iter().map(|&x| query_third(x)).collect();
            let mut scratch = Scratch::new(d);
            for b in 0..n {
                for h in 0..2 {
                    let (a, r) = (
                        entry_score(&g, Query { qf: &qf, q3: &q3 }, &basis, b, h, &mut scratch),
                        entry_score_token_by_token(&g, &qf, &basis, b, h),
                    );
                    assert!(
                        a.to_bits() == r.to_bits() || (a.is_nan() && r.is_nan()),
                        "{a} vs {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn encode_rounds_into_four_levels() {
        assert_eq!(encode(0.0, 0.0, 3.0), 0);
        assert_eq!(encode(1.4, 0.0, 3.0), 1);
        assert_eq!(encode(1.6, 0.0, 3.0), 2);
        assert_eq!(encode(3.0, 0.0, 3.0), 3);
        assert_eq!(encode(9.0, 0.0, 3.0), 3);
        assert_eq!(encode(5.0, 2.0, 2.0), 0); // empty range
        assert_eq!(encode(f32::NAN, 0.0, 1.0), 0);
        assert_eq!(encode(0.5, f32::NAN, f32::NAN), 0); // a NaN bound
    }

    #[test]
    fn codes_score_the_largest_approximate_logit() {
        let g = geo(); // 4 query heads, 2 kv heads, d 8, block 4
        let (hk, bs, d) = (2, 4, 8);
        let n_host = 3;
        // Keys on the code grid of their block, with a min and max the 8-bit bound holds exactly
        // (±0.75 and ±0.25 are E4M3 values times 2^-9), so the estimate is exact.
        let mut host_k = vec![0.0f32; n_host * hk * bs * d];
        for (i, x) in host_k.iter_mut().enumerate() {
            *x = ((i * 7 + 3) % 4) as f32 * 0.5 - 0.75;
        }
        let (summ, b8, sc) = bounds_of(&g, &host_k, n_host);
        let (mut lo, mut hi) = (vec![0.0f32; d], vec![0.0f32; d]);
        for e in 0..n_host * hk {
            decode_bound8(&b8, &sc, e, &mut lo, &mut hi);
            assert_eq!(
                lo,
                summ[e * 2 * d..][..d],
                "row {e}: the bound is the summary"
            );
            assert_eq!(hi, summ[e * 2 * d + d..][..d]);
        }
        let mut codes = vec![0u8; n_host * hk * bs * d / 4];
        build_key_codes(&g, &host_k, &b8, &sc, &[0, 1, 2], None, &mut codes).unwrap();
        let q: Vec<f32> = (0..2 * 4 * d).map(|i| ((i * 5) % 9) as f32 - 4.0).collect();
        let (indptr, idx) = ([0, 2, 3], [2, 0, 1]);
        let mut scores = vec![0.0f32; 3 * hk];
        score_blocks_codes(&g, &q, &b8, &sc, &codes, &indptr, &idx, &mut scores).unwrap();
        for (j, &b) in idx.iter().enumerate() {
            let (b, s) = (b as usize, if j < 2 { 0 } else { 1 });
            for h in 0..hk {
                let mut want = 0.0f32;
                // The f16 weights (three roundings of 2^-11 each) bound the error by this.
                let mut tol = 1e-5f32;
                for gq in 2 * h..2 * h + 2 {
                    let qg = &q[(s * 4 + gq) * d..][..d];
                    let sm = &summ[(b * hk + h) * 2 * d..][..2 * d];
                    tol += (0..d)
                        .map(|x| 2e-3 * (qg[x] * (sm[d + x] - sm[x])).abs())
                        .sum::<f32>();
                    let best = (0..bs)
                        .map(|t| {
                            let k = &host_k[((b * hk + h) * bs + t) * d..][..d];
                            qg.iter().zip(k).map(|(a, b)| a * b).sum::<f32>()
                        })
                        .fold(f32::NEG_INFINITY, f32::max);
                    want += best;
                }
                let got = scores[j * hk + h];
                assert!(
                    (got - want).abs() < tol,
                    "entry {j} head {h}: {got} vs {want} (tolerance {tol})"
                );
            }
        }
    }

    #[test]
    fn codes_are_each_key_inside_the_decoded_bound_within_a_sixth_of_its_range() {
        // Random keys at magnitudes from 2^-100 to 2^100 (the bound's scale moves with them):
        // every code is `encode` of the key in [e4m3_decode(lo8) s, e4m3_decode(hi8) s], the
        // bound holds every key, so each key is within a sixth of the bound's range of its
        // level (a relative 2^-20 of the range for the f32 arithmetic).
        let g = KvGeometry::new(6, 3, 12, 5).unwrap();
        let (hk, bs, d) = (3, 5, 12);
        let n_host = 7;
        let mut rng = crate::kernels::xorshift(0x2545_f491_4f6c_dd1d);
        let mut unit = || (rng() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        let mags = [
            2f32.powi(-100),
            1e-3,
            0.7,
            1.0,
            37.0,
            2f32.powi(40),
            2f32.powi(100),
        ];
        let mut host_k = vec![0.0f32; n_host * hk * bs * d];
        for (i, x) in host_k.iter_mut().enumerate() {
            *x = unit() * mags[i / (hk * bs * d)] + mags[i / (hk * bs * d)] * 0.25;
        }
        let (summ, b8, sc) = bounds_of(&g, &host_k, n_host);
        let ids: Vec<i32> = (0..n_host as i32).rev().collect();
        let mut codes = vec![0xa5u8; n_host * hk * bs * d / 4];
        build_key_codes(&g, &host_k, &b8, &sc, &ids, None, &mut codes).unwrap();
        for b in 0..n_host {
            for h in 0..hk {
                let e = b * hk + h;
                let s = sc[e];
                for t in 0..bs {
                    for x in 0..d {
                        let k = host_k[(e * bs + t) * d + x];
                        let lo = e4m3_decode(b8[e * 2 * d + x]) * s;
                        let hi = e4m3_decode(b8[e * 2 * d + d + x]) * s;
                        assert!(lo <= summ[e * 2 * d + x] && hi >= summ[e * 2 * d + d + x]);
                        let c = (codes[(e * bs + t) * (d / 4) + x / 4] >> (2 * (x % 4))) & 3;
                        assert_eq!(c, encode(k, lo, hi), "block {b} head {h} token {t} d {x}");
                        let level = lo + f32::from(c) * (hi - lo) / CODE_LEVELS;
                        let err = (k - level).abs();
                        assert!(
                            err <= (hi - lo) * (1.0 / 6.0 + 2f32.powi(-20)),
                            "block {b} head {h} token {t} d {x}: |{k} - {level}| vs [{lo}, {hi}]"
                        );
                    }
                }
            }
        }
        // Each approximate logit lies in the bound's box: the codes score is at most the Quest
        // score of the same 8-bit bound, but for the f16 weights' rounding and the f32 sums.
        let q: Vec<f32> = (0..2 * 6 * d).map(|_| unit() * 3.0).collect();
        // Blocks whose weights fit f16 (block 6's range does not: inf weights, NaN logits).
        let (indptr, idx) = ([0, 3, 5], [1, 2, 3, 4, 0]);
        let mut codes_s = vec![0.0f32; 5 * hk];
        score_blocks_codes(&g, &q, &b8, &sc, &codes, &indptr, &idx, &mut codes_s).unwrap();
        let mut quest = vec![0.0f32; 5 * hk];
        score_blocks_bound8(&g, &q, &b8, &sc, &indptr, &idx, &mut quest).unwrap();
        for (j, (&c, &u)) in codes_s.iter().zip(&quest).enumerate() {
            let b = idx[j / hk] as usize;
            let slack = 4e-3 * mags[b] * (0..2 * 6 * d).map(|i| q[i].abs()).sum::<f32>();
            assert!(
                c <= u + slack,
                "entry {j}: codes {c} above the bound's Quest {u}"
            );
        }
    }

    #[test]
    fn a_nan_bound_gives_zero_codes_and_a_nan_score_that_ranks_last() {
        let g = geo(); // 4 query heads, 2 kv heads, d 8, block 4
        let (hk, bs, d) = (2, 4, 8);
        let n_host = 4;
        let mut host_k: Vec<f32> = (0..n_host * hk * bs * d)
            .map(|i| ((i * 37) % 23) as f32 * 0.25 - 2.5)
            .collect();
        // Block 2, head 1: a key overflowed (inf), so its summary is not finite: a NaN bound.
        host_k[((2 * hk + 1) * bs + 3) * d + 5] = f32::INFINITY;
        let (_, b8, sc) = bounds_of(&g, &host_k, n_host);
        assert!(sc[2 * hk + 1].is_nan());
        assert!(sc
            .iter()
            .enumerate()
            .all(|(e, s)| e == 2 * hk + 1 || s.is_finite()));
        let ids: Vec<i32> = (0..n_host as i32).collect();
        let mut codes = vec![0xffu8; n_host * hk * bs * d / 4];
        build_key_codes(&g, &host_k, &b8, &sc, &ids, None, &mut codes).unwrap();
        let row = bs * d / 4;
        assert!(codes[(2 * hk + 1) * row..][..row].iter().all(|&c| c == 0));
        // Every block of one sequence.
        let q = vec![1.0f32; 4 * d];
        let (indptr, idx) = ([0, 4], [0, 1, 2, 3]);
        let mut scores = vec![0.0f32; 4 * hk];
        score_blocks_codes(&g, &q, &b8, &sc, &codes, &indptr, &idx, &mut scores).unwrap();
        for (j, s) in scores.iter().enumerate() {
            assert_eq!(s.is_nan(), j == 2 * hk + 1, "entry {j}: {s}");
        }
        let mut top = vec![0i32; hk * 4];
        crate::kernels::topk_blocks(hk, &scores, &indptr, 4, &mut top).unwrap();
        assert_eq!(top[4 + 3], 2, "head 1 ranks the NaN block last: {top:?}");
        assert!(!top[4..7].contains(&2));
        // The rescoring of the same block: NaN too, and -inf only for padding.
        let mut re = vec![0.0f32; 2 * hk];
        let cand = [2, -1, 2, -1];
        rescore_blocks_codes(&g, &q, &b8, &sc, &codes, &indptr, &idx, &cand, 2, &mut re).unwrap();
        assert!(re[0].is_finite() && re[1].is_nan());
        assert_eq!(re[2..], [f32::NEG_INFINITY, f32::NEG_INFINITY]);
    }

    #[test]
    fn code_weights_are_f16_products_of_f16_operands() {
        // q / 3 = 1/3 -> f16 0.33325195; (hi - lo) = 3 exact; their product 0.99975586 rounds
        // (to even) once more, to 1.
        let w = code_weight(1.0, -1.0, 2.0);
        assert_eq!(
            w,
            f16::from_f32(f16::from_f32(1.0 / 3.0).to_f32() * 3.0).to_f32()
        );
        assert_eq!(
            code_weight(2.0, 0.0, 1.5),
            f16::from_f32(f16::from_f32(2.0 / 3.0).to_f32() * 1.5).to_f32()
        );
        assert!((code_weight(0.7, 0.1, 1.3) - 0.7 * 1.2 / 3.0).abs() < 1e-3);
        // A product below f16's normal range rounds to a subnormal, not to zero.
        let tiny = code_weight(3.0e-4, 0.0, 3.0e-4);
        assert!(tiny > 0.0 && tiny < 6.2e-5, "{tiny}");
        assert_eq!(tiny, f16::from_f32(tiny).to_f32());
        // Overflow is inf, NaN stays NaN: the GPU's exact path gives the same.
        assert!(code_weight(3.0e5, 0.0, 1.0e3).is_infinite());
        assert!(code_weight(f32::NAN, 0.0, 1.0).is_nan());
        assert_eq!(code_weight(5.0, 1.0, 1.0), 0.0);
    }

    #[test]
    fn codes_read_keys_by_row_and_write_by_id() {
        // Block ids 0..3 whose keys sit in rows 2, 0, 1 of a 3-row pool give the codes of the
        // pool with the keys moved to rows = ids.
        let g = geo();
        let (hk, bs, d) = (2, 4, 8);
        let pe = hk * bs * d;
        let host_k: Vec<f32> = (0..3 * pe).map(|i| ((i * 37) % 23) as f32 - 11.0).collect();
        let rows = [2, 0, 1];
        let mut moved = vec![0.0f32; 3 * pe];
        for (id, &r) in rows.iter().enumerate() {
            moved[id * pe..][..pe].copy_from_slice(&host_k[r as usize * pe..][..pe]);
        }
        let (_, b8, sc) = bounds_of(&g, &moved, 3);
        let mut want = vec![0u8; 3 * pe / 4];
        build_key_codes(&g, &moved, &b8, &sc, &[0, 1, 2], None, &mut want).unwrap();
        let mut got = vec![0u8; 3 * pe / 4];
        build_key_codes(&g, &host_k, &b8, &sc, &[0, 1, 2], Some(&rows), &mut got).unwrap();
        assert_eq!(got, want);
        // A one-row pool: ids up to 2 with row 0 are fine, row 1 is not.
        let one = &host_k[..pe];
        build_key_codes(&g, one, &b8, &sc, &[2], Some(&[0]), &mut got).unwrap();
        assert!(build_key_codes(&g, one, &b8, &sc, &[2], Some(&[1]), &mut got).is_err());
    }

    #[test]
    fn rescoring_candidates_matches_the_full_scores_and_pads_with_neg_inf() {
        let g = geo(); // 4 query heads, 2 kv heads, d 8, block 4
        let (hk, bs, d) = (2, 4, 8);
        let n_host = 5;
        let host_k: Vec<f32> = (0..n_host * hk * bs * d)
            .map(|i| ((i * 37) % 23) as f32 * 0.25 - 2.5)
            .collect();
        let ids: Vec<i32> = (0..n_host as i32).collect();
        let (_, b8, sc) = bounds_of(&g, &host_k, n_host);
        let mut codes = vec![0u8; n_host * hk * bs * d / 4];
        build_key_codes(&g, &host_k, &b8, &sc, &ids, None, &mut codes).unwrap();
        let q: Vec<f32> = (0..2 * 4 * d).map(|i| ((i * 5) % 9) as f32 - 4.0).collect();
        // Sequence 0: logical blocks 0..3 (host 4, 2, 0); sequence 1: 0..2 (host 1, 3).
        let (indptr, idx) = ([0, 3, 5], [4, 2, 0, 1, 3]);
        let mut full = vec![0.0f32; 5 * hk];
        score_blocks_codes(&g, &q, &b8, &sc, &codes, &indptr, &idx, &mut full).unwrap();
        let m = 2;
        // [seq, head, m]: per-head candidates, -1 padding.
        let cand = [2, 0, 1, -1, 1, 0, -1, -1];
        let mut got = vec![7.0f32; 2 * m * hk];
        let basis = (&b8[..], &sc[..], &codes[..]);
        let rescore = |cand: &[i32], out: &mut [f32]| {
            let (b8, sc, codes) = basis;
            rescore_blocks_codes(&g, &q, b8, sc, codes, &indptr, &idx, cand, m, out)
        };
        rescore(&cand, &mut got).unwrap();
        for s in 0..2 {
            for h in 0..hk {
                for i in 0..m {
                    let c = cand[(s * hk + h) * m + i];
                    let v = got[(s * m + i) * hk + h];
                    if c < 0 {
                        assert_eq!(v, f32::NEG_INFINITY);
                    } else {
                        let j = indptr[s] as usize + c as usize;
                        assert_eq!(v.to_bits(), full[j * hk + h].to_bits(), "s {s} h {h} i {i}");
                    }
                }
            }
        }
        // A candidate past its sequence's row (sequence 1 has 2 blocks) is an error; nothing written.
        let mut untouched = vec![7.0f32; 2 * m * hk];
        let r = rescore(&[2, 0, 1, -1, 1, 2, -1, -1], &mut untouched);
        assert!(
            matches!(r, Err(OasisError::IndexOutOfRange { .. })),
            "{r:?}"
        );
        assert!(untouched.iter().all(|&x| x == 7.0));
        assert!(rescore(&cand[..7], &mut got).is_err());
    }

    #[test]
    fn bad_calls_are_errors_and_write_nothing() {
        let g = geo();
        let host_k = vec![0.0f32; 2 * 2 * 4 * 8];
        let (b8, sc) = (vec![0u8; 2 * 2 * 2 * 8], vec![1.0f32; 2 * 2]);
        let mut codes = vec![7u8; 2 * 2 * 4 * 2];
        assert!(build_key_codes(&g, &host_k, &b8, &sc, &[2], None, &mut codes).is_err());
        // Scales of another pool than the bytes.
        assert!(build_key_codes(&g, &host_k, &b8, &sc[..2], &[0], None, &mut codes).is_err());
        assert!(codes.iter().all(|&c| c == 7));
        let odd = KvGeometry::new(2, 1, 6, 4).unwrap();
        assert!(matches!(
            build_key_codes(&odd, &[0.0f32; 24], &[0u8; 12], &[1.0], &[], None, &mut []),
            Err(OasisError::Config(_))
        ));
        let mut scores = vec![5.0f32; 2];
        let q = vec![0.0f32; 4 * 8];
        let (ip, ix) = ([0, 2], [0]);
        assert!(score_blocks_codes(&g, &q, &b8, &sc, &codes, &ip, &ix, &mut scores).is_err());
        let (ip, ix) = ([0, 1], [5]);
        assert!(score_blocks_codes(&g, &q, &b8, &sc, &codes, &ip, &ix, &mut scores).is_err());
        let (ip, ix) = ([0, 1], [0]);
        assert!(score_blocks_codes(&g, &q, &b8, &sc[1..], &codes, &ip, &ix, &mut scores).is_err());
        assert_eq!(scores, vec![5.0, 5.0]);
    }
}
