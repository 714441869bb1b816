//! The fidelity selection's fused steps (issue 33): each is a composition of other twins that
//! the GPU runs as one launch, so that the two-stage codes score (`KvConfig(score_candidates=...)`)
//! costs few launches per layer and step.
//!
//! ```text
//! every step, the blocks it completed:   encode_blocks      = build_bounds8 ; build_key_codes
//! every selection, the candidates:       rescore_topk_codes = rescore_blocks_codes ; topk_candidates
//! ```
//!
//! This module owns only the compositions: the encodings, the scores and the selection rules
//! stay defined where they were ([`super::codes`], [`super::bound8`], [`super::score`]), and the
//! results here are theirs bit for bit (tests below; the GPU tests compare the fused launches to
//! the separate ones). The engine applies no reduction between the two steps of the second
//! composition on one GPU; with KV-head replicas (tensor parallelism, `Engine.score_reduce`) it
//! runs the two launches apart, the reduction between them.

use crate::dtype::KvElem;
use crate::error::{check_len, OasisError, Result};
use crate::geometry::KvGeometry;
use crate::kernels::validate::{all_indices, leading_rows};
use crate::kernels::{build_bounds8, build_key_codes, rescore_blocks_codes, topk_candidates};

/// [`build_bounds8`] then [`build_key_codes`] of the same blocks: the 8-bit bound of complete
/// host blocks `block_ids` from their final `[min; max]` summaries, then the 2-bit codes of their
/// keys (in host rows `block_rows`, `None`: the id) inside that bound.
///
/// # Errors
/// As the two twins; every check runs before the first write, so nothing is written when an
/// error is returned.
#[allow(clippy::too_many_arguments)]
pub fn encode_blocks<T: KvElem>(
    geo: &KvGeometry,
    host_k: &[T],               // [num_host_rows, num_kv_heads, block_size, head_dim]
    summaries: &[T],            // [num_host_blocks, num_kv_heads, 2, head_dim]
    block_ids: &[i32],          // [n]
    block_rows: Option<&[i32]>, // [n] host row of each block; None: the id
    codes: &mut [u8],           // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    bounds8: &mut [u8],         // [num_host_blocks, num_kv_heads, 2, head_dim]
    scales: &mut [f32],         // [num_host_blocks, num_kv_heads]
) -> Result<()> {
    geo.validate()?;
    let (h_kv, bs, d) = (geo.num_kv_heads, geo.block_size, geo.head_dim);
    // build_key_codes' own checks that build_bounds8 does not make (the ids against the same
    // pool it checks), so that the codes' build below cannot fail after the bound is written.
    if !d.is_multiple_of(4) {
        return Err(OasisError::Config(format!(
            "2-bit key codes need head_dim divisible by 4, got {d}"
        )));
    }
    let num_rows = leading_rows("host_k", host_k.len(), &[h_kv, bs, d])?;
    let num_host = leading_rows("summaries", summaries.len(), &[h_kv, 2, d])?;
    check_len("codes", codes.len(), &[num_host, h_kv, bs, d / 4])?;
    match block_rows {
        Some(rows) => {
            check_len("block_rows", rows.len(), &[block_ids.len()])?;
            all_indices("block_rows", rows, num_rows)?;
        }
        None => all_indices("block_ids", block_ids, num_rows)?,
    }
    build_bounds8(geo, summaries, block_ids, bounds8, scales)?;
    build_key_codes(geo, host_k, bounds8, scales, block_ids, block_rows, codes)
}

/// [`rescore_blocks_codes`] then [`topk_candidates`]: the two-stage codes score's last step for
/// the candidates `cand [num_seqs, num_kv_heads, m]` (the Quest bound's top-`m`, logical blocks,
/// negative: none) of the queries `q`: their codes scores, then the `k` best as blocks, with the
/// next block of each of the `successors` best and the blocks of `forced` first (see
/// [`topk_candidates`]).
///
/// # Errors
/// As the two twins. `out` is untouched when an error is returned.
#[allow(clippy::too_many_arguments)]
pub fn rescore_topk_codes<T: KvElem>(
    geo: &KvGeometry,
    q: &[T],             // [num_seqs, num_qo_heads, head_dim]
    bounds8: &[u8],      // [num_host_blocks, num_kv_heads, 2, head_dim] E4M3
    scales: &[f32],      // [num_host_blocks, num_kv_heads]
    codes: &[u8],        // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
    blk_indptr: &[i32],  // [num_seqs + 1]
    blk_indices: &[i32], // [nnz]
    cand: &[i32],        // [num_seqs, num_kv_heads, m] logical blocks, negative = none
    m: usize,
    k: usize,
    successors: usize,
    forced: &[i32], // [num_seqs, num_kv_heads, n_forced]
    n_forced: usize,
    out: &mut [i32], // [num_seqs, num_kv_heads, k]
) -> Result<()> {
    let num_seqs = blk_indptr.len().saturating_sub(1);
    let h_kv = geo.num_kv_heads;
    let mut scores = vec![0f32; num_seqs * m * h_kv];
    rescore_blocks_codes(
        geo,
        q,
        bounds8,
        scales,
        codes,
        blk_indptr,
        blk_indices,
        cand,
        m,
        &mut scores,
    )?;
    topk_candidates(
        h_kv, &scores, cand, m, blk_indptr, k, successors, forced, n_forced, out,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift), so that the tests need no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    fn geometry(h_kv: usize, group: usize, bs: usize, d: usize) -> KvGeometry {
        KvGeometry {
            num_qo_heads: h_kv * group,
            num_kv_heads: h_kv,
            head_dim: d,
            block_size: bs,
        }
    }

    /// min / max over each block's keys, per head and channel.
    fn summaries_of(geo: &KvGeometry, keys: &[f32], n: usize) -> Vec<f32> {
        let (h, bs, d) = (geo.num_kv_heads, geo.block_size, geo.head_dim);
        let mut s = vec![0f32; n * h * 2 * d];
        for b in 0..n {
            for hh in 0..h {
                for x in 0..d {
                    let col = (0..bs).map(|t| keys[((b * h + hh) * bs + t) * d + x]);
                    let at = (b * h + hh) * 2 * d;
                    s[at + x] = col.clone().fold(f32::INFINITY, f32::min);
                    s[at + d + x] = col.fold(f32::NEG_INFINITY, f32::max);
                }
            }
        }
        s
    }

    #[test]
    fn encode_is_the_two_builds() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        for &(bs, d, h) in &[(16, 64, 2), (8, 128, 1), (32, 64, 3)] {
            let geo = geometry(h, 1, bs, d);
            let n_host = 7;
            let keys: Vec<f32> = (0..n_host * h * bs * d).map(|_| rng.unit() * 3.0).collect();
            let summ = summaries_of(&geo, &keys, n_host);
            let ids = [4, 0, 6];
            let rows = [6, 2, 1]; // keys of block 4 in host row 6, ...
            for block_rows in [None, Some(&rows[..])] {
                let (mut c1, mut b1, mut s1) = (
                    vec![0u8; n_host * h * bs * d / 4],
                    vec![0u8; n_host * h * 2 * d],
                    vec![0f32; n_host * h],
                );
                let (mut c2, mut b2, mut s2) = (c1.clone(), b1.clone(), s1.clone());
                encode_blocks(
                    &geo, &keys, &summ, &ids, block_rows, &mut c1, &mut b1, &mut s1,
                )
                .unwrap();
                build_bounds8(&geo, &summ, &ids, &mut b2, &mut s2).unwrap();
                build_key_codes(&geo, &keys, &b2, &s2, &ids, block_rows, &mut c2).unwrap();
                assert_eq!(c1, c2);
                assert_eq!(b1, b2);
                assert_eq!(
                    s1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    s2.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    #[test]
    fn encode_writes_nothing_on_error() {
        let geo = geometry(1, 1, 8, 8);
        let keys = vec![0.5f32; 2 * 8 * 8];
        let summ = summaries_of(&geo, &keys, 2);
        let (mut c, mut b, mut s) = (vec![7u8; 2 * 8 * 2], vec![7u8; 2 * 2 * 8], vec![7f32; 1]);
        let untouched = |c: &[u8], b: &[u8], s: &[f32]| {
            c.iter().all(|&x| x == 7) && b.iter().all(|&x| x == 7) && s.iter().all(|&x| x == 7.0)
        };
        // scales of the wrong size: the codes must stay untouched.
        assert!(encode_blocks(&geo, &keys, &summ, &[0], None, &mut c, &mut b, &mut s).is_err());
        assert!(untouched(&c, &b, &s));
        let mut s = vec![7f32; 2];
        // an id outside the pool: nothing written either.
        assert!(encode_blocks(&geo, &keys, &summ, &[0, 2], None, &mut c, &mut b, &mut s).is_err());
        assert!(untouched(&c, &b, &s));
        // a key row outside the host pool (which only the codes read): the bound stays unwritten.
        let rows = Some(&[0, 2][..]);
        assert!(encode_blocks(&geo, &keys, &summ, &[0, 1], rows, &mut c, &mut b, &mut s).is_err());
        assert!(untouched(&c, &b, &s));
        // codes of the wrong size, or a head_dim the codes cannot take: the same.
        let mut short = vec![7u8; 2 * 8 * 2 - 1];
        assert!(encode_blocks(&geo, &keys, &summ, &[0], None, &mut short, &mut b, &mut s).is_err());
        assert!(untouched(&c, &b, &s));
        let odd = geometry(1, 1, 2, 6);
        let (k6, s6) = (vec![0.5f32; 2 * 2 * 6], vec![0.5f32; 2 * 2 * 6]);
        let (mut b6, mut c6) = (vec![7u8; 2 * 2 * 6], vec![7u8; 0]);
        let r = encode_blocks(&odd, &k6, &s6, &[0], None, &mut c6, &mut b6, &mut s);
        assert!(matches!(r, Err(OasisError::Config(_))), "{r:?}");
        assert!(b6.iter().all(|&x| x == 7) && s.iter().all(|&x| x == 7.0));
    }

    #[test]
    fn rescore_topk_is_the_composition() {
        let mut rng = Rng(0x2545f4914f6cdd1d);
        for case in 0..60 {
            let bs = [8, 16, 32][case % 3];
            let d = [64, 128][case / 3 % 2];
            let group = 1 + rng.below(8);
            let h = 1 + rng.below(3);
            let geo = geometry(h, group, bs, d);
            let num_seqs = 1 + rng.below(3);
            let lens: Vec<usize> = (0..num_seqs).map(|_| rng.below(40)).collect();
            let mut indptr = vec![0i32];
            for &l in &lens {
                indptr.push(indptr.last().unwrap() + l as i32);
            }
            let nnz = *indptr.last().unwrap() as usize;
            let n_host = nnz.max(1) + 3;
            let keys: Vec<f32> = (0..n_host * h * bs * d).map(|_| rng.unit()).collect();
            let summ = summaries_of(&geo, &keys, n_host);
            let ids: Vec<i32> = (0..n_host as i32).collect();
            let (mut b8, mut sc) = (vec![0u8; n_host * h * 2 * d], vec![0f32; n_host * h]);
            let mut codes = vec![0u8; n_host * h * bs * d / 4];
            encode_blocks(&geo, &keys, &summ, &ids, None, &mut codes, &mut b8, &mut sc).unwrap();
            // Each sequence's logical blocks map to distinct host blocks.
            let indices: Vec<i32> = (0..nnz).map(|j| ((j * 7 + 3) % n_host) as i32).collect();
            let q: Vec<f32> = (0..num_seqs * h * group * d).map(|_| rng.unit()).collect();
            let m = 1 + rng.below(24);
            let k = 1 + rng.below(m + 4);
            let successors = [0, 8][rng.below(2)];
            let n_forced = [0, 3][rng.below(2)];
            // Distinct candidates inside each row (fewer than m when the row is short: -1).
            let mut cand = vec![-1i32; num_seqs * h * m];
            for s in 0..num_seqs {
                for hh in 0..h {
                    let mut pool: Vec<i32> = (0..lens[s] as i32).collect();
                    for i in 0..m.min(pool.len()) {
                        let j = i + rng.below(pool.len() - i);
                        pool.swap(i, j);
                        cand[(s * h + hh) * m + i] = pool[i];
                    }
                }
            }
            let forced: Vec<i32> = (0..num_seqs * h * n_forced)
                .map(|_| rng.below(45) as i32 - 2)
                .collect();
            let mut fused = vec![0i32; num_seqs * h * k];
            rescore_topk_codes(
                &geo, &q, &b8, &sc, &codes, &indptr, &indices, &cand, m, k, successors, &forced,
                n_forced, &mut fused,
            )
            .unwrap();
            let mut scores = vec![0f32; num_seqs * m * h];
            rescore_blocks_codes(
                &geo,
                &q,
                &b8,
                &sc,
                &codes,
                &indptr,
                &indices,
                &cand,
                m,
                &mut scores,
            )
            .unwrap();
            let mut two = vec![0i32; num_seqs * h * k];
            topk_candidates(
                h, &scores, &cand, m, &indptr, k, successors, &forced, n_forced, &mut two,
            )
            .unwrap();
            assert_eq!(fused, two, "case {case}");
        }
    }
}
