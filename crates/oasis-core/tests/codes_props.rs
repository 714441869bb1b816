//! Property tests for the 2-bit key codes inside the 8-bit bound (`encode_blocks`,
//! `build_key_codes`, `score_blocks_codes`, `rescore_blocks_codes`) on random geometries, key
//! magnitudes and overflowed keys: every code is its key's level inside the decoded bound, the
//! score never passes the Quest score of that bound but by the f16 weights' rounding, the
//! rescoring is the score of its candidates bit for bit, and a block with a non-finite key has
//! codes 0 and a NaN score, which ranks last.

use oasis_core::kernels::bound8::decode_bound8;
use oasis_core::kernels::codes::encode;
use oasis_core::kernels::{
    build_summaries, encode_blocks, rescore_blocks_codes, score_blocks_bound8, score_blocks_codes,
    topk_blocks,
};
use oasis_core::KvGeometry;
use proptest::prelude::*;

mod common;
use common::Rng;

/// A random pool: keys of `max(lens) + 2` complete host blocks (block b at magnitude
/// `2^exps[b]`, a few keys made infinite when `overflow`), encoded by `encode_blocks` from host
/// rows in shuffled order, and one query row per sequence of `lens` blocks (distinct host blocks
/// per sequence).
struct Case {
    geo: KvGeometry,
    keys: Vec<f32>,
    summ: Vec<f32>,
    b8: Vec<u8>,
    sc: Vec<f32>,
    codes: Vec<u8>,
    exps: Vec<i32>,
    q: Vec<f32>,
    indptr: Vec<i32>,
    indices: Vec<i32>,
    bad: Vec<bool>, // per (block, head): a key is not finite
}

fn make_case(
    seed: u64,
    h: usize,
    group: usize,
    d: usize,
    bs: usize,
    lens: &[usize],
    overflow: bool,
) -> Case {
    let mut rng = Rng(seed);
    let geo = KvGeometry::new(h * group, h, d, bs).unwrap();
    let n = lens.iter().copied().max().unwrap_or(0) + 2;
    // 2^-12 .. 2^10: every code weight (about q (hi - lo) / 3) a finite f16.
    let exps: Vec<i32> = (0..n).map(|_| rng.below(23) as i32 - 12).collect();
    let mut keys = vec![0f32; n * h * bs * d];
    let per_block = h * bs * d;
    for (i, k) in keys.iter_mut().enumerate() {
        let m = 2f32.powi(exps[i / per_block]);
        *k = (rng.f32() + 0.3 * rng.f32()) * m;
    }
    let mut bad = vec![false; n * h];
    if overflow {
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(keys.len());
            keys[at] = if rng.below(2) == 0 {
                f32::INFINITY
            } else {
                f32::NEG_INFINITY
            };
            bad[at / (bs * d)] = true;
        }
    }
    let ids: Vec<i32> = (0..n as i32).collect();
    let mut summ = vec![0f32; n * h * 2 * d];
    build_summaries(&geo, &keys, &ids, None, &vec![bs as i32; n], &mut summ).unwrap();
    let (mut b8, mut sc) = (vec![0xa5u8; n * h * 2 * d], vec![7f32; n * h]);
    let mut codes = vec![0xa5u8; n * h * bs * d / 4];
    // Keys in host rows other than their ids: row r holds block perm[r].
    let mut perm: Vec<i32> = ids.clone();
    rng.shuffle(&mut perm);
    let mut rows = vec![0i32; n];
    let mut moved = vec![0f32; keys.len()];
    for (r, &b) in perm.iter().enumerate() {
        rows[b as usize] = r as i32;
        moved[r * per_block..][..per_block]
            .copy_from_slice(&keys[b as usize * per_block..][..per_block]);
    }
    let mut order = ids.clone();
    rng.shuffle(&mut order);
    let order_rows: Vec<i32> = order.iter().map(|&b| rows[b as usize]).collect();
    encode_blocks(
        &geo,
        &moved,
        &summ,
        &order,
        Some(&order_rows),
        &mut codes,
        &mut b8,
        &mut sc,
    )
    .unwrap();
    let mut indptr = vec![0i32];
    let mut indices = Vec::new();
    for &l in lens {
        let mut pick: Vec<i32> = (0..n as i32).collect();
        rng.shuffle(&mut pick);
        indices.extend_from_slice(&pick[..l]);
        indptr.push(indices.len() as i32);
    }
    let q: Vec<f32> = (0..lens.len() * h * group * d)
        .map(|_| rng.f32() * 2.0)
        .collect();
    Case {
        geo,
        keys,
        summ,
        b8,
        sc,
        codes,
        exps,
        q,
        indptr,
        indices,
        bad,
    }
}

/// The code of token `t`, channel `x` of (block, head) row `e`.
fn code_at(c: &Case, e: usize, t: usize, x: usize) -> u8 {
    let (bs, d) = (c.geo.block_size, c.geo.head_dim);
    (c.codes[(e * bs + t) * (d / 4) + x / 4] >> (2 * (x % 4))) & 3
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn codes_are_their_keys_levels_inside_the_decoded_bound(
        seed in any::<u64>(),
        h in 1usize..4,
        d in prop::sample::select(vec![4usize, 8, 12, 32]),
        bs in 1usize..7,
        overflow in any::<bool>(),
    ) {
        let c = make_case(seed, h, 1, d, bs, &[3], overflow);
        let (mut lo, mut hi) = (vec![0f32; d], vec![0f32; d]);
        for e in 0..c.sc.len() {
            decode_bound8(&c.b8, &c.sc, e, &mut lo, &mut hi);
            if c.bad[e] {
                prop_assert!(c.sc[e].is_nan(), "row {} has a non-finite key", e);
                for t in 0..bs {
                    for x in 0..d {
                        prop_assert_eq!(code_at(&c, e, t, x), 0);
                    }
                }
                continue;
            }
            prop_assert!(c.sc[e].is_finite());
            for x in 0..d {
                // The bound holds the summary, hence every key.
                prop_assert!(lo[x] <= c.summ[e * 2 * d + x] && hi[x] >= c.summ[e * 2 * d + d + x]);
                for t in 0..bs {
                    let k = c.keys[(e * bs + t) * d + x];
                    let code = code_at(&c, e, t, x);
                    prop_assert_eq!(code, encode(k, lo[x], hi[x]));
                    let w = hi[x] - lo[x];
                    let level = lo[x] + f32::from(code) * w / 3.0;
                    prop_assert!(
                        (k - level).abs() <= w * (1.0 / 6.0 + 1e-6),
                        "row {} token {} channel {}: {} vs level {} of [{}, {}]",
                        e, t, x, k, level, lo[x], hi[x]
                    );
                }
            }
        }
    }

    #[test]
    fn scores_stay_under_the_bound_and_rescoring_is_the_score(
        seed in any::<u64>(),
        h in 1usize..3,
        group in 1usize..5,
        d in prop::sample::select(vec![4usize, 16, 32]),
        bs in 1usize..6,
        n0 in 0usize..9,
        n1 in 1usize..9,
        overflow in any::<bool>(),
    ) {
        let c = make_case(seed, h, group, d, bs, &[n0, n1], overflow);
        let nnz = c.indices.len();
        let g = &c.geo;
        let mut codes_s = vec![0f32; nnz * h];
        score_blocks_codes(g, &c.q, &c.b8, &c.sc, &c.codes, &c.indptr, &c.indices, &mut codes_s)
            .unwrap();
        let mut quest = vec![0f32; nnz * h];
        score_blocks_bound8(g, &c.q, &c.b8, &c.sc, &c.indptr, &c.indices, &mut quest).unwrap();
        for j in 0..nnz {
            let s = usize::from(j as i32 >= c.indptr[1]);
            let b = c.indices[j] as usize;
            for hh in 0..h {
                let (v, u) = (codes_s[j * h + hh], quest[j * h + hh]);
                prop_assert_eq!(v.is_nan(), c.bad[b * h + hh], "entry {} head {}", j, hh);
                if v.is_nan() {
                    continue;
                }
                // Each decoded key lies in the bound's box; the f16 weights move a logit by at
                // most 2e-3 of sum_d |q| (hi - lo) (three roundings of 2^-11 relative).
                let qg = &c.q[(s * g.num_qo_heads + hh * group) * d..][..group * d];
                let mag = 2f32.powi(c.exps[b]) * 4.0 * qg.iter().map(|x| x.abs()).sum::<f32>();
                prop_assert!(v <= u + 2e-3 * mag + 1e-30, "entry {} head {}: {} > {}", j, hh, v, u);
            }
        }
        // The candidates: every block of each sequence in reverse order, then -1 padding.
        let m = n0.max(n1) + 1;
        let mut cand = vec![-1i32; 2 * h * m];
        for (s, n) in [n0, n1].into_iter().enumerate() {
            for hh in 0..h {
                for i in 0..n {
                    cand[(s * h + hh) * m + i] = (n - 1 - i) as i32;
                }
            }
        }
        let mut re = vec![0f32; 2 * m * h];
        rescore_blocks_codes(
            g, &c.q, &c.b8, &c.sc, &c.codes, &c.indptr, &c.indices, &cand, m, &mut re,
        )
        .unwrap();
        for s in 0..2 {
            for hh in 0..h {
                for i in 0..m {
                    let cd = cand[(s * h + hh) * m + i];
                    let v = re[(s * m + i) * h + hh];
                    if cd < 0 {
                        prop_assert_eq!(v, f32::NEG_INFINITY);
                    } else {
                        let j = c.indptr[s] as usize + cd as usize;
                        prop_assert_eq!(v.to_bits(), codes_s[j * h + hh].to_bits());
                    }
                }
            }
        }
        // Top-K over the scores takes every finite block before any NaN one.
        let k = n0.max(n1);
        let mut top = vec![0i32; 2 * h * k];
        topk_blocks(h, &codes_s, &c.indptr, k, &mut top).unwrap();
        for s in 0..2 {
            for hh in 0..h {
                let row = &top[(s * h + hh) * k..][..k];
                let nan = |i: i32| {
                    i >= 0 && codes_s[(c.indptr[s] as usize + i as usize) * h + hh].is_nan()
                };
                let first_nan = row.iter().position(|&i| nan(i)).unwrap_or(k);
                prop_assert!(row[first_nan..].iter().all(|&i| i < 0 || nan(i)), "{:?}", row);
            }
        }
    }
}
