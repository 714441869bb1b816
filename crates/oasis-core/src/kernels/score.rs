//! Block scoring (Quest upper bound from the min/max summaries) and per-head top-K.
//!
//! The lookahead query scores every logical block of its sequence per KV head:
//! `score = sum over the group's query heads g, sum over d of max(q_g[d] * min[d], q_g[d] * max[d])`,
//! an upper bound on `q_g · k` for every key `k` of the block, summed over the GQA group because
//! the selection is per KV head. Then [`topk_blocks`] picks the best `k` logical blocks per head.

use std::cmp::Ordering;

use crate::dtype::KvElem;
use crate::error::{check_len, OasisError, Result};
use crate::geometry::KvGeometry;
use crate::kernels::validate::{all_indices, csr, csr_range, leading_rows};

/// Quest scores: `scores[j, h]` = sum over query heads g of KV head h of
/// `sum_d max(q[s,g,d] * min[b,h,d], q[s,g,d] * max[b,h,d])`, `b = blk_indices[j]`, j in seq s's
/// range. Accumulated in f32: for each g of the group in order, d in order, into one sum.
///
/// # Errors
/// * [`OasisError::Shape`] for a buffer of the wrong size;
/// * [`OasisError::Invalid`] for a malformed `blk_indptr`;
/// * [`OasisError::IndexOutOfRange`] for a host block id outside the summaries (negative ids
///   included: every logical block of a sparse sequence has a host block).
///
/// `scores` is untouched when an error is returned.
pub fn score_blocks<T: KvElem>(
    geo: &KvGeometry,
    q: &[T],             // [num_seqs, num_qo_heads, head_dim]  (the lookahead row)
    summaries: &[T],     // [num_host_blocks, num_kv_heads, 2, head_dim]
    blk_indptr: &[i32],  // [num_seqs + 1]
    blk_indices: &[i32], // [nnz] host block of logical block (j - blk_indptr[s]) of seq s
    scores: &mut [f32],  // [nnz, num_kv_heads]
) -> Result<()> {
    let (h_kv, d) = (geo.num_kv_heads, geo.head_dim);
    let num_host = || leading_rows("summaries", summaries.len(), &[h_kv, 2, d]);
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
                mn[x] = summaries[at + x].to_f32();
                mx[x] = summaries[at + d + x].to_f32();
            }
            1.0
        },
    )
}

/// The Quest score loop of [`score_blocks`] and
/// [`crate::kernels::bound8::score_blocks_bound8`]: validates `q`, the CSR and `scores` (with
/// `num_host`, the host blocks the bound has, checked between `q` and `scores`), then per entry
/// `j` (block `b`) and KV head `h` lets `row(b, h, min, max)` fill the bound's rows (`head_dim`
/// each) and return the factor its sum is multiplied by; the sum is in f32, each g of the group
/// in order, d in order.
pub(crate) fn quest_scores<T: KvElem>(
    geo: &KvGeometry,
    q: &[T],
    blk_indptr: &[i32],
    blk_indices: &[i32],
    scores: &mut [f32],
    num_host: impl FnOnce() -> Result<usize>,
    mut row: impl FnMut(usize, usize, &mut [f32], &mut [f32]) -> f32,
) -> Result<()> {
    geo.validate()?;
    let (hq, h_kv, d) = (geo.num_qo_heads, geo.num_kv_heads, geo.head_dim);
    let gs = geo.group_size();
    let num_seqs = csr("blk_indptr", blk_indptr, "blk_indices", blk_indices.len())?;
    check_len("q", q.len(), &[num_seqs, hq, d])?;
    let num_host = num_host()?;
    check_len("scores", scores.len(), &[blk_indices.len(), h_kv])?;
    all_indices("blk_indices", blk_indices, num_host)?;
    if num_seqs == 0 {
        return Ok(()); // and `hq * d` below is bounded by `q.len()`
    }

    // Entries go LANES at a time: each one's sum is one chain (each g of the group in d order,
    // as the GPU kernels add), and the LANES chains advance side by side, so that no add waits
    // on the previous one across a whole entry. The same sums, bit for bit. The bounds of a
    // group are kept channel-major (`[x][lane]`); lanes past the last entry add zeros, unread.
    const LANES: usize = 4;
    let mut qf = vec![0.0f32; hq * d];
    let (mut mn, mut mx) = (vec![0.0f32; d], vec![0.0f32; d]);
    let (mut mn4, mut mx4) = (vec![[0.0f32; LANES]; d], vec![[0.0f32; LANES]; d]);
    for s in 0..num_seqs {
        for (x, &v) in qf.iter_mut().zip(&q[s * hq * d..(s + 1) * hq * d]) {
            *x = v.to_f32();
        }
        let range = csr_range(blk_indptr, s);
        for h in 0..h_kv {
            for first in range.clone().step_by(LANES) {
                let n = LANES.min(range.end - first);
                let mut factor = [1.0f32; LANES];
                for k in 0..LANES {
                    if k < n {
                        let b = blk_indices[first + k] as usize; // validated
                        factor[k] = row(b, h, &mut mn, &mut mx);
                    } else {
                        mn.fill(0.0);
                        mx.fill(0.0);
                    }
                    for x in 0..d {
                        mn4[x][k] = mn[x];
                        mx4[x][k] = mx[x];
                    }
                }
                let mut acc = [0.0f32; LANES];
                for g in h * gs..(h + 1) * gs {
                    for ((&qv, lo), hi) in qf[g * d..(g + 1) * d].iter().zip(&mn4).zip(&mx4) {
                        for k in 0..LANES {
                            acc[k] += (qv * lo[k]).max(qv * hi[k]);
                        }
                    }
                }
                for k in 0..n {
                    scores[(first + k) * h_kv + h] = acc[k] * factor[k]; // times 1.0 is exact
                }
            }
        }
    }
    Ok(())
}

/// "`a` ranks before `b`": higher score first, NaN last, ties by lower logical index.
#[inline]
fn ranks_before(scores: &[f32], stride: usize, a: u32, b: u32) -> Ordering {
    let (sa, sb) = (scores[a as usize * stride], scores[b as usize * stride]);
    let by_score = match (sa.is_nan(), sb.is_nan()) {
        (false, false) => sb.partial_cmp(&sa).unwrap_or(Ordering::Equal),
        (false, true) => Ordering::Less,
        (true, false) => Ordering::Greater,
        (true, true) => Ordering::Equal,
    };
    by_score.then(a.cmp(&b))
}

/// `order[..take]` := the `take` best of entries `0..n` by `scores[i * stride]` under
/// [`ranks_before`], best first (`order` is refilled; `take <= n`). The partial sort of every
/// top-k here.
fn best_first(order: &mut Vec<u32>, scores: &[f32], stride: usize, n: usize, take: usize) {
    order.clear();
    order.extend(0..n as u32);
    let cmp = |a: &u32, b: &u32| ranks_before(scores, stride, *a, *b);
    if take > 0 && take < n {
        // The comparator is a total order, so the partition is deterministic.
        order.select_nth_unstable_by(take - 1, cmp);
    }
    order[..take].sort_unstable_by(cmp);
}

/// [`OasisError::Config`] unless `num_kv_heads > 0`.
fn positive_heads(num_kv_heads: usize) -> Result<()> {
    if num_kv_heads == 0 {
        return Err(OasisError::Config(
            "num_kv_heads must be positive".to_string(),
        ));
    }
    Ok(())
}

/// Per (seq, kv head) top-k logical block indices (0-based within the seq), best first; ties ->
/// lower logical index first; padded with -1 when the sequence has fewer than k blocks.
/// NaN scores rank below every number (and `-0.0 == 0.0` is a tie).
///
/// # Errors
/// * [`OasisError::Config`] for `num_kv_heads == 0`;
/// * [`OasisError::Invalid`] for a malformed `blk_indptr`;
/// * [`OasisError::Shape`] when `scores` is not `[blk_indptr[-1], num_kv_heads]` or `out` not
///   `[num_seqs, num_kv_heads, k]`.
///
/// `out` is untouched when an error is returned.
pub fn topk_blocks(
    num_kv_heads: usize,
    scores: &[f32],     // [nnz, num_kv_heads]
    blk_indptr: &[i32], // [num_seqs + 1]
    k: usize,
    out: &mut [i32], // [num_seqs, num_kv_heads, k]
) -> Result<()> {
    positive_heads(num_kv_heads)?;
    let nnz = leading_rows("scores", scores.len(), &[num_kv_heads])?;
    let num_seqs = csr("blk_indptr", blk_indptr, "scores", nnz)?;
    check_len("out", out.len(), &[num_seqs, num_kv_heads, k])?;
    if k == 0 {
        return Ok(());
    }
    let mut order: Vec<u32> = Vec::new();
    for s in 0..num_seqs {
        let range = csr_range(blk_indptr, s);
        let n = range.len();
        // n <= nnz <= i32::MAX: logical indices fit u32 and i32.
        for h in 0..num_kv_heads {
            let dst = &mut out[(s * num_kv_heads + h) * k..][..k];
            if n == 0 {
                dst.fill(-1);
                continue;
            }
            // n >= 1, so this start is < scores.len().
            let col = &scores[range.start * num_kv_heads + h..];
            let take = k.min(n);
            best_first(&mut order, col, num_kv_heads, n, take);
            for (o, i) in dst.iter_mut().zip(
                order[..take]
                    .iter()
                    .map(|&i| i as i32)
                    .chain(std::iter::repeat(-1)),
            ) {
                *o = i;
            }
        }
    }
    Ok(())
}

/// [`topk_blocks`], then each chosen position `i` of sequence `s`, head `h` replaced by
/// `index_map[s, h, i]` (`index_map`: `[num_seqs, num_kv_heads, map_m]`); a position at or past
/// `map_m` and the -1 padding give -1. The two-stage codes score's last step: the top-K over a
/// (sequence, head)'s `map_m` candidates, answered as the candidates' logical blocks.
///
/// # Errors
/// Those of [`topk_blocks`], and [`OasisError::Shape`] when `index_map` is not
/// `[num_seqs, num_kv_heads, map_m]`. `out` is untouched when an error is returned.
pub fn topk_blocks_mapped(
    num_kv_heads: usize,
    scores: &[f32],     // [nnz, num_kv_heads]
    blk_indptr: &[i32], // [num_seqs + 1]
    k: usize,
    index_map: &[i32], // [num_seqs, num_kv_heads, map_m]
    map_m: usize,
    out: &mut [i32], // [num_seqs, num_kv_heads, k]
) -> Result<()> {
    let num_seqs = blk_indptr.len().saturating_sub(1);
    check_len(
        "index_map",
        index_map.len(),
        &[num_seqs, num_kv_heads, map_m],
    )?;
    topk_blocks(num_kv_heads, scores, blk_indptr, k, out)?;
    // Each position maps on its own, so in place.
    for (row, o) in out.chunks_mut(k.max(1)).enumerate() {
        let map = &index_map[row * map_m..][..map_m];
        for o in o {
            *o = usize::try_from(*o)
                .ok()
                .and_then(|i| map.get(i).copied())
                .unwrap_or(-1);
        }
    }
    Ok(())
}

/// Each forced entry of `scores` (`[nnz, num_kv_heads]`) set to +inf, in place: `forced`
/// (`[num_seqs, num_kv_heads, n_forced]`) holds, per sequence of `blk_indptr` and KV head,
/// logical blocks (positions within the row) that every top-k then takes first; -1 and positions
/// past the row are ignored. The two-stage score's kept blocks (`KvConfig.sticky_candidates`,
/// sinks, pins) in one launch on the GPU.
///
/// # Errors
/// [`OasisError::Config`] for `num_kv_heads == 0`; [`OasisError::Invalid`] for a malformed
/// `blk_indptr`; [`OasisError::Shape`] when `scores` or `forced` does not match.
pub fn force_scores(
    num_kv_heads: usize,
    scores: &mut [f32], // [nnz, num_kv_heads]
    blk_indptr: &[i32], // [num_seqs + 1]
    forced: &[i32],     // [num_seqs, num_kv_heads, n_forced]
    n_forced: usize,
) -> Result<()> {
    positive_heads(num_kv_heads)?;
    let nnz = leading_rows("scores", scores.len(), &[num_kv_heads])?;
    let num_seqs = csr("blk_indptr", blk_indptr, "scores", nnz)?;
    check_len("forced", forced.len(), &[num_seqs, num_kv_heads, n_forced])?;
    for s in 0..num_seqs {
        let range = csr_range(blk_indptr, s);
        for h in 0..num_kv_heads {
            for &f in &forced[(s * num_kv_heads + h) * n_forced..][..n_forced] {
                if let Ok(f) = usize::try_from(f) {
                    if f < range.len() {
                        scores[(range.start + f) * num_kv_heads + h] = f32::INFINITY;
                    }
                }
            }
        }
    }
    Ok(())
}

/// The two-stage score's last step. Per (sequence `s`, KV head `h`), the `m` candidates
/// `cand[s, h, i]` (logical blocks, < 0: none) with scores `scores[s * m + i, h]`:
/// 1. the `successors` best candidates by score (ties to the lower position, NaN last) give their
///    next logical blocks `v + 1`, kept where `v >= 0` and `v + 1 < ` the length of row `s` of
///    `blk_indptr` (the request's blocks);
/// 2. a candidate whose block is one of those successors or of `forced[s, h, ..]` ranks above
///    every score (+inf); a successor that is no candidate is appended as entry `m + a` (`a` its
///    rank), also at +inf; the other appended entries are none (-inf);
/// 3. the `k` best of the `m + successors` entries, best first, ties to the lower position,
///    written as their blocks; -1 for none and the padding.
///
/// The engine's `two_stage_top_k` composed of device ops is the definition this fuses
/// (`tests/engine/test_engine.py`).
///
/// # Errors
/// [`OasisError::Config`] for `num_kv_heads == 0`; [`OasisError::Invalid`] for a malformed
/// `blk_indptr`; [`OasisError::Shape`] when a buffer does not match its shape.
#[allow(clippy::too_many_arguments)]
pub fn topk_candidates(
    num_kv_heads: usize,
    scores: &[f32], // [num_seqs * m, num_kv_heads]
    cand: &[i32],   // [num_seqs, num_kv_heads, m]
    m: usize,
    blk_indptr: &[i32], // [num_seqs + 1]: the requests' rows (their lengths bound the successors)
    k: usize,
    successors: usize,
    forced: &[i32], // [num_seqs, num_kv_heads, n_forced]
    n_forced: usize,
    out: &mut [i32], // [num_seqs, num_kv_heads, k]
) -> Result<()> {
    positive_heads(num_kv_heads)?;
    let num_seqs = blk_indptr.len().saturating_sub(1);
    let nnz = usize::try_from(*blk_indptr.last().unwrap_or(&0)).unwrap_or(0);
    csr("blk_indptr", blk_indptr, "blocks", nnz)?;
    check_len("scores", scores.len(), &[num_seqs * m, num_kv_heads])?;
    check_len("cand", cand.len(), &[num_seqs, num_kv_heads, m])?;
    check_len("forced", forced.len(), &[num_seqs, num_kv_heads, n_forced])?;
    check_len("out", out.len(), &[num_seqs, num_kv_heads, k])?;
    let width = m + successors;
    let mut key = vec![0f32; width];
    let mut val = vec![-1i32; width];
    let mut order: Vec<u32> = Vec::with_capacity(width);
    for s in 0..num_seqs {
        let row_len = csr_range(blk_indptr, s).len();
        for h in 0..num_kv_heads {
            let row = s * num_kv_heads + h;
            let cs = &cand[row * m..][..m];
            for i in 0..m {
                key[i] = scores[(s * m + i) * num_kv_heads + h];
                val[i] = cs[i];
            }
            let best = successors.min(m);
            best_first(&mut order, &key, 1, m, best);
            let succ: Vec<i32> = (0..successors)
                .map(|a| {
                    let v = if a < best { cs[order[a] as usize] } else { -1 };
                    match usize::try_from(v) {
                        Ok(v) if v + 1 < row_len => v as i32 + 1,
                        _ => -1,
                    }
                })
                .collect();
            let fs = &forced[row * n_forced..][..n_forced];
            for i in 0..m {
                let v = cs[i];
                if v >= 0 && (succ.contains(&v) || fs.contains(&v)) {
                    key[i] = f32::INFINITY;
                }
            }
            for (a, &sv) in succ.iter().enumerate() {
                let new = sv >= 0 && !cs.contains(&sv);
                val[m + a] = if new { sv } else { -1 };
                key[m + a] = if new {
                    f32::INFINITY
                } else {
                    f32::NEG_INFINITY
                };
            }
            let take = k.min(width);
            best_first(&mut order, &key, 1, width, take);
            let dst = &mut out[row * k..][..k];
            for (j, o) in dst.iter_mut().enumerate() {
                *o = if j < take { val[order[j] as usize] } else { -1 };
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn score_matches_naive() {
        let g = KvGeometry::new(6, 2, 5, 4).unwrap();
        let (hq, h_kv, d) = (6, 2, 5);
        let num_host = 7;
        let val = |i: usize| ((i * 37 + 11) % 23) as f32 / 4.0 - 2.7;
        let q: Vec<bf16> = (0..2 * hq * d)
            .map(|i| bf16::from_f32(val(i * 3)))
            .collect();
        let mut sm = vec![bf16::ZERO; num_host * h_kv * 2 * d];
        for b in 0..num_host {
            for h in 0..h_kv {
                for x in 0..d {
                    let (a, c) = (val(b * 31 + h * 7 + x), val(b * 13 + h * 5 + x + 100));
                    sm[(b * h_kv + h) * 2 * d + x] = bf16::from_f32(a.min(c));
                    sm[((b * h_kv + h) * 2 + 1) * d + x] = bf16::from_f32(a.max(c));
                }
            }
        }
        let indptr = [0, 3, 3, 5];
        let indices = [6, 0, 2, 2, 5];
        let mut scores = vec![f32::NAN; 5 * h_kv];
        // Seq 1 has no blocks: q has 3 rows.
        let q3: Vec<bf16> = q.iter().chain(&q[..hq * d]).copied().collect();
        score_blocks(&g, &q3, &sm, &indptr, &indices, &mut scores).unwrap();
        for s in 0..3 {
            for j in indptr[s] as usize..indptr[s + 1] as usize {
                let b = indices[j] as usize;
                for h in 0..h_kv {
                    let mut want = 0.0f64;
                    for gq in 0..hq {
                        if gq / (hq / h_kv) != h {
                            continue;
                        }
                        for x in 0..d {
                            let qv = q3[(s * hq + gq) * d + x].to_f32() as f64;
                            let lo = sm[(b * h_kv + h) * 2 * d + x].to_f32() as f64;
                            let hi = sm[((b * h_kv + h) * 2 + 1) * d + x].to_f32() as f64;
                            want += (qv * lo).max(qv * hi);
                        }
                    }
                    let got = scores[j * h_kv + h] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 + 1e-5 * want.abs(),
                        "{got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn side_by_side_entries_are_the_one_chain_sums_bit_for_bit() {
        // Random queries and summaries (some NaN), sequences of 0..=9 blocks (so every count of
        // lanes in the last group), GQA 3 and 1; against one f32 chain per entry, in the order
        // the loop documents (each g of the group in d order).
        let mut rng = crate::kernels::xorshift(0x2545_f491_4f6c_dd1d);
        let mut next = move || (rng() % 20001) as f32 / 1000.0 - 10.0;
        for (hq, h_kv, d) in [(6, 2, 40), (4, 4, 64)] {
            let g = KvGeometry::new(hq, h_kv, d, 16).unwrap();
            let num_host = 11;
            let mut sm: Vec<f32> = (0..num_host * h_kv * 2 * d).map(|_| next()).collect();
            sm[17] = f32::NAN;
            let lens = [0usize, 1, 2, 3, 4, 5, 9];
            let mut indptr = vec![0i32];
            let mut indices = Vec::new();
            for (s, &n) in lens.iter().enumerate() {
                indices.extend((0..n).map(|i| ((s * 5 + i * 3) % num_host) as i32));
                indptr.push(indices.len() as i32);
            }
            let q: Vec<f32> = (0..lens.len() * hq * d).map(|_| next()).collect();
            let mut scores = vec![0.0f32; indices.len() * h_kv];
            score_blocks(&g, &q, &sm, &indptr, &indices, &mut scores).unwrap();
            let gs = hq / h_kv;
            for s in 0..lens.len() {
                for j in indptr[s] as usize..indptr[s + 1] as usize {
                    let b = indices[j] as usize;
                    for h in 0..h_kv {
                        let mut acc = 0.0f32;
                        for gq in h * gs..(h + 1) * gs {
                            for x in 0..d {
                                let qv = q[(s * hq + gq) * d + x];
                                let (lo, hi) = (
                                    sm[(b * h_kv + h) * 2 * d + x],
                                    sm[((b * h_kv + h) * 2 + 1) * d + x],
                                );
                                acc += (qv * lo).max(qv * hi);
                            }
                        }
                        let got = scores[j * h_kv + h];
                        assert!(
                            got.to_bits() == acc.to_bits() || (got.is_nan() && acc.is_nan()),
                            "{got} vs {acc}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn score_validation() {
        let g = KvGeometry::new(2, 1, 2, 4).unwrap();
        let q = [1.0f32; 4];
        let sm = [0.0f32; 2 * 2 * 2];
        let mut sc = [0.0f32; 2];
        let r = score_blocks(&g, &q, &sm, &[0, 2], &[0, 2], &mut sc);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "blk_indices",
                index: 2,
                bound: 2
            })
        ));
        let r = score_blocks(&g, &q, &sm, &[0, 2], &[0, -1], &mut sc);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "blk_indices",
                index: -1,
                ..
            })
        ));
        let r = score_blocks(&g, &q[1..], &sm, &[0, 2], &[0, 1], &mut sc);
        assert!(matches!(r, Err(OasisError::Shape { what: "q", .. })));
        let r = score_blocks(&g, &q, &sm[1..], &[0, 2], &[0, 1], &mut sc);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "summaries",
                ..
            })
        ));
        let r = score_blocks(&g, &q, &sm, &[0, 2], &[0, 1], &mut sc[1..]);
        assert!(matches!(r, Err(OasisError::Shape { what: "scores", .. })));
        let r = score_blocks(&g, &q, &sm, &[0, 1], &[0, 1], &mut sc);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "blk_indices",
                ..
            })
        ));
        let r = score_blocks(&g, &q, &sm, &[1, 2], &[0, 1], &mut sc);
        assert!(matches!(r, Err(OasisError::Invalid(_))));
        assert_eq!(sc, [0.0; 2]);
        score_blocks(&g, &q, &sm, &[0, 2], &[0, 1], &mut sc).unwrap();
    }

    /// Reference: full sort of (score desc, NaN last, index asc).
    fn naive_topk(col: &[f32], k: usize) -> Vec<i32> {
        let mut idx: Vec<usize> = (0..col.len()).collect();
        idx.sort_by(|&a, &b| {
            let key = |i: usize| {
                if col[i].is_nan() {
                    f32::NEG_INFINITY
                } else {
                    col[i]
                }
            };
            let nan = |i: usize| col[i].is_nan();
            nan(a)
                .cmp(&nan(b))
                .then(key(b).partial_cmp(&key(a)).unwrap())
                .then(a.cmp(&b))
        });
        let mut out: Vec<i32> = idx.into_iter().take(k).map(|i| i as i32).collect();
        out.resize(k, -1);
        out
    }

    #[test]
    fn topk_matches_naive_with_ties_nan_and_padding() {
        let h_kv = 2;
        let indptr = [0, 6, 6, 9];
        let col0 = [1.0, 3.0, 3.0, -0.0, f32::NAN, 0.0];
        let col1 = [2.0, 2.0, 2.0, f32::NEG_INFINITY, 5.0, 2.0];
        let s2 = [[7.0, f32::NAN, 7.0], [-1.0, -2.0, -1.0]];
        let mut scores = Vec::new();
        for j in 0..6 {
            scores.extend([col0[j], col1[j]]);
        }
        for (a, b) in s2[0].iter().zip(&s2[1]) {
            scores.extend([*a, *b]);
        }
        for k in [1, 2, 3, 4, 6, 8] {
            let mut out = vec![99; 3 * h_kv * k];
            topk_blocks(h_kv, &scores, &indptr, k, &mut out).unwrap();
            assert_eq!(&out[..k], naive_topk(&col0, k).as_slice(), "k={k}");
            assert_eq!(&out[k..2 * k], naive_topk(&col1, k).as_slice(), "k={k}");
            assert!(out[2 * k..4 * k].iter().all(|&x| x == -1));
            assert_eq!(&out[4 * k..5 * k], naive_topk(&s2[0], k).as_slice());
            assert_eq!(&out[5 * k..6 * k], naive_topk(&s2[1], k).as_slice());
        }
        let mut out = vec![0; 6];
        topk_blocks(h_kv, &scores, &indptr, 1, &mut out).unwrap();
        assert_eq!(out, [1, 4, -1, -1, 0, 0]);
        // k = 0 is an empty output.
        topk_blocks(h_kv, &scores, &indptr, 0, &mut []).unwrap();
    }

    #[test]
    fn topk_validation() {
        let scores = [1.0f32; 6];
        let mut out = [5i32; 4];
        assert!(matches!(
            topk_blocks(0, &scores, &[0, 3], 2, &mut out),
            Err(OasisError::Config(_))
        ));
        let r = topk_blocks(2, &scores[1..], &[0, 3], 2, &mut out);
        assert!(matches!(r, Err(OasisError::Shape { what: "scores", .. })));
        let r = topk_blocks(2, &scores, &[0, 2], 2, &mut out);
        assert!(matches!(r, Err(OasisError::Shape { what: "scores", .. })));
        let r = topk_blocks(2, &scores, &[0, 3], 2, &mut out[1..]);
        assert!(matches!(r, Err(OasisError::Shape { what: "out", .. })));
        assert!(matches!(
            topk_blocks(2, &scores, &[0, 4, 3], 1, &mut out),
            Err(OasisError::Invalid(_))
        ));
        assert!(matches!(
            topk_blocks(2, &scores, &[], 1, &mut out),
            Err(OasisError::Shape { .. })
        ));
        assert_eq!(out, [5; 4]);
    }

    #[test]
    fn topk_mapped_is_topk_then_the_map() {
        // Two sequences of 3 and 5 candidates (map_m 5), two heads; k 4 pads the first.
        let h = 2;
        let indptr = [0, 3, 8];
        let scores: Vec<f32> = (0..8 * h).map(|i| ((i * 7 + 3) % 11) as f32).collect();
        let map: Vec<i32> = (0..2 * h * 5).map(|i| 100 + i as i32).collect();
        let k = 4;
        let mut pos = vec![0; 2 * h * k];
        topk_blocks(h, &scores, &indptr, k, &mut pos).unwrap();
        let mut out = vec![0; 2 * h * k];
        topk_blocks_mapped(h, &scores, &indptr, k, &map, 5, &mut out).unwrap();
        for (row, (o, p)) in out.chunks(k).zip(pos.chunks(k)).enumerate() {
            for (&o, &p) in o.iter().zip(p) {
                let want = if p < 0 { -1 } else { map[row * 5 + p as usize] };
                assert_eq!(o, want);
            }
        }
        assert!(out[..k].contains(&-1), "3 candidates, k 4: padded");
        // A row longer than the map: positions past it give -1.
        let mut short = vec![0; 2 * h * k];
        topk_blocks_mapped(h, &scores, &indptr, k, &map[..2 * h * 3], 3, &mut short).unwrap();
        for (o, p) in short.iter().zip(&pos) {
            assert!(*p >= 3 || *p < 0 || *o >= 100);
            if *p >= 3 {
                assert_eq!(*o, -1);
            }
        }
        // A map of the wrong shape is an error and leaves out untouched.
        let mut keep = vec![7; 2 * h * k];
        assert!(topk_blocks_mapped(h, &scores, &indptr, k, &map[..5], 5, &mut keep).is_err());
        assert!(keep.iter().all(|&v| v == 7));
    }

    /// One row of blocks 0..9, candidates 2, 7, 4 scoring 1, 3, 2: one successor (8, of 7) is
    /// no candidate and goes first; a forced block goes ahead of it; a successor past the row is
    /// none; the padding is -1.
    #[test]
    fn topk_candidates_takes_successors_and_forced_blocks_first() {
        let indptr = [0, 10];
        let scores = [1.0, 3.0, 2.0];
        let mut out = [0; 3];
        topk_candidates(1, &scores, &[2, 7, 4], 3, &indptr, 3, 1, &[], 0, &mut out).unwrap();
        assert_eq!(out, [8, 7, 4]);
        topk_candidates(1, &scores, &[2, 7, 4], 3, &indptr, 3, 1, &[4], 1, &mut out).unwrap();
        assert_eq!(out, [4, 8, 7]);
        let mut out = [0; 4];
        topk_candidates(1, &scores, &[2, 9, 4], 3, &indptr, 4, 1, &[], 0, &mut out).unwrap();
        assert_eq!(out, [9, 4, 2, -1]);
        assert!(topk_candidates(
            1,
            &scores[..2],
            &[2, 9, 4],
            3,
            &indptr,
            4,
            1,
            &[],
            0,
            &mut out
        )
        .is_err());
    }

    #[test]
    fn force_scores_sets_the_forced_entries_of_each_row() {
        // Two rows of 2 and 3 blocks, 2 heads; forced (row, head): (0,0) block 1, (0,1) none,
        // (1,0) block 5 (past the row: ignored), (1,1) block 0.
        let indptr = [0, 2, 5];
        let mut scores = [0.0f32; 10];
        force_scores(2, &mut scores, &indptr, &[1, -1, 5, 0], 1).unwrap();
        let inf = f32::INFINITY;
        assert_eq!(scores, [0.0, 0.0, inf, 0.0, 0.0, inf, 0.0, 0.0, 0.0, 0.0]);
        assert!(force_scores(2, &mut scores, &indptr, &[1, -1, 5], 1).is_err());
    }
}
