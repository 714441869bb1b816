//! `decode_attention_kv8` against the f64 reference over randomized geometries (block sizes,
//! head dims, GQA group sizes, holes in the head-wise mapping, lookahead rows), its errors, and
//! NaN propagation from a non-finite stored value.

use half::bf16;
use oasis_core::kernels::{
    decode_attention, decode_attention_kv8, ExtraKv, Kv8Pages, PagedKv, PagedKv8,
};
use oasis_core::{KvElem, KvGeometry, OasisError};

mod common;
mod kv8_ref;
use common::Rng;

const BLOCK_SIZES: [usize; 3] = [8, 16, 32];
const HEAD_DIMS: [usize; 3] = [64, 96, 128];
const GROUP_SIZES: [usize; 4] = [1, 2, 4, 8];

/// (atol, rtol) by output dtype: the house table. The stored values are exact in f32
/// (dequantization is exact), so the error against the f64 reference is the twin's f32
/// accumulation alone, as for `T` pages (dots over up to 128 products, softmax over up to
/// 4 * 32 + 1 columns): observed max abs error ~1.3e-6 for f32 outputs of magnitude <= 4.
fn tol<T: KvElem>() -> (f64, f64) {
    match T::DTYPE {
        oasis_core::DType::F32 => (1e-5, 1.3e-6),
        oasis_core::DType::F16 => (1e-3, 1e-3),
        oasis_core::DType::BF16 => (1e-3, 1.6e-2),
    }
}

/// A kv8 pool quantized by the reference from random values, each (page, head) at its own
/// magnitude (so scales differ), with its f64 dequantized values.
struct Pool {
    k: Vec<u8>,
    v: Vec<u8>,
    ks: Vec<f32>,
    vs: Vec<f32>,
}

impl Pool {
    fn random(g: &KvGeometry, num_pages: usize, rng: &mut Rng) -> Pool {
        let e = g.entry_elems();
        let n = num_pages * g.num_kv_heads;
        let mut p = Pool {
            k: Vec::new(),
            v: Vec::new(),
            ks: Vec::new(),
            vs: Vec::new(),
        };
        for _ in 0..n {
            for (codes, scales) in [(&mut p.k, &mut p.ks), (&mut p.v, &mut p.vs)] {
                let mag = 2f64.powi(rng.below(7) as i32 - 4);
                let rows: Vec<f64> = (0..e).map(|_| f64::from(rng.f32()) * mag).collect();
                let (c, ex) = kv8_ref::quantize_block(&rows, e);
                codes.extend(c);
                scales.push(2f64.powi(ex) as f32);
            }
        }
        p
    }
    fn pages(&self) -> Kv8Pages<'_> {
        Kv8Pages {
            k_codes: &self.k,
            v_codes: &self.v,
            k_scales: &self.ks,
            v_scales: &self.vs,
        }
    }
    /// The reference's dequantized K and V row (page, head, token).
    fn row(&self, g: &KvGeometry, page: usize, h: usize, t: usize) -> (Vec<f64>, Vec<f64>) {
        let e = page * g.num_kv_heads + h;
        let at = e * g.entry_elems() + t * g.head_dim;
        let deq = |codes: &[u8], s: f32| {
            codes[at..at + g.head_dim]
                .iter()
                .map(|&c| kv8_ref::value(c).unwrap_or(f64::NAN) * f64::from(s))
                .collect::<Vec<f64>>()
        };
        (deq(&self.k, self.ks[e]), deq(&self.v, self.vs[e]))
    }
}

/// A random batch on `g`: its table (pages shared between sequences allowed), a page_map with
/// holes when `holes`, queries, lookahead K,V.
struct Batch {
    indptr: Vec<i32>,
    indices: Vec<i32>,
    last: Vec<i32>,
    page_map: Vec<i32>,
    num_rows: usize,
}

fn batch(g: &KvGeometry, num_pages: usize, rng: &mut Rng) -> Batch {
    let num_seqs = 1 + rng.below(3);
    let mut b = Batch {
        indptr: vec![0],
        indices: Vec::new(),
        last: Vec::new(),
        page_map: (0..num_pages * g.num_kv_heads)
            .map(|_| rng.below(8) as i32 - 2) // ~1/4 holes
            .collect(),
        num_rows: 1 + rng.below(3),
    };
    for _ in 0..num_seqs {
        for _ in 0..1 + rng.below(4) {
            b.indices.push(rng.below(num_pages) as i32);
        }
        b.indptr.push(b.indices.len() as i32);
        b.last.push(1 + rng.below(g.block_size) as i32);
    }
    b
}

fn check_close<T: KvElem>(got: &[T], want: &[f64], what: &str) -> f64 {
    let (atol, rtol) = tol::<T>();
    let mut worst = 0.0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(g.to_f32());
        let err = (g - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what} element {i}: got {g}, want {w} ({:?})",
            T::DTYPE
        );
        worst = worst.max(err);
    }
    worst
}

fn grid_case<T: KvElem>(bs: usize, d: usize, gs: usize, seed: u64) -> f64 {
    let mut rng = Rng(seed);
    let h_kv = 1 + rng.below(2);
    let g = KvGeometry::new(h_kv * gs, h_kv, d, bs).unwrap();
    let num_pages = 6;
    let pool = Pool::random(&g, num_pages, &mut rng);
    let b = batch(&g, num_pages, &mut rng);
    let num_seqs = b.last.len();
    let rand = |rng: &mut Rng, n: usize| (0..n).map(|_| T::from_f32(rng.f32())).collect::<Vec<T>>();
    let q = rand(&mut rng, num_seqs * b.num_rows * g.num_qo_heads * d);
    let ek = rand(&mut rng, num_seqs * h_kv * d);
    let ev = rand(&mut rng, num_seqs * h_kv * d);
    let f = |x: &[T]| {
        x.iter()
            .map(|y| f64::from(y.to_f32()))
            .collect::<Vec<f64>>()
    };
    let (qf, ekf, evf) = (f(&q), f(&ek), f(&ev));
    let sm_scale = 1.0 / (d as f32).sqrt();
    let mut worst = 0.0f64;
    for holes in [false, true] {
        let page_map = holes.then_some(&b.page_map[..]);
        let extra = ExtraKv { k: &ek, v: &ev };
        let extra = (b.num_rows >= 2).then_some(&extra);
        let kv = PagedKv8 {
            pages: pool.pages(),
            kv_indptr: &b.indptr,
            kv_indices: &b.indices,
            kv_last_page_len: &b.last,
            page_map,
        };
        let mut out = vec![T::from_f32(f32::NAN); q.len()];
        decode_attention_kv8(&g, &q, b.num_rows, &kv, extra, sm_scale, &mut out).unwrap();
        let want = kv8_ref::attention(
            (g.num_qo_heads, h_kv, bs, d),
            &qf,
            b.num_rows,
            &kv8_ref::Table {
                indptr: &b.indptr,
                indices: &b.indices,
                last: &b.last,
                page_map,
            },
            |p, h, t| pool.row(&g, p, h, t),
            extra.map(|_| (&ekf[..], &evf[..])),
            f64::from(sm_scale),
        );
        let what = format!("bs {bs} d {d} gs {gs} h_kv {h_kv} holes {holes}");
        worst = worst.max(check_close(&out, &want, &what));

        // The same loop over the dequantized values in T = f32 pages: the same bits (the
        // dequantization is exact and the accumulation order shared).
        if T::DTYPE == oasis_core::DType::F32 {
            let deq = |codes: &[u8], scales: &[f32]| {
                codes
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| {
                        let s = scales[i / g.entry_elems()];
                        T::from_f32((kv8_ref::value(c).unwrap() * f64::from(s)) as f32)
                    })
                    .collect::<Vec<T>>()
            };
            let (kp, vp) = (deq(&pool.k, &pool.ks), deq(&pool.v, &pool.vs));
            let kv_t = PagedKv {
                k_pages: &kp,
                v_pages: &vp,
                kv_indptr: &b.indptr,
                kv_indices: &b.indices,
                kv_last_page_len: &b.last,
                page_map,
            };
            let mut out_t = vec![T::from_f32(0.0); q.len()];
            decode_attention(&g, &q, b.num_rows, &kv_t, extra, sm_scale, &mut out_t).unwrap();
            let bits = |x: &[T]| x.iter().map(|y| y.to_f32().to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&out_t), "{what}");
        }
    }
    worst
}

#[test]
fn kv8_attention_matches_the_f64_reference() {
    let mut worst = 0.0f64;
    let mut seed = 100;
    for bs in BLOCK_SIZES {
        for d in HEAD_DIMS {
            for gs in GROUP_SIZES {
                seed += 1;
                worst = worst.max(grid_case::<f32>(bs, d, gs, seed));
            }
        }
    }
    eprintln!("kv8 attention f32: worst abs error {worst:e}");
    // Storage-dtype outputs on a few geometries.
    for (i, gs) in GROUP_SIZES.into_iter().enumerate() {
        grid_case::<bf16>(BLOCK_SIZES[i % 3], HEAD_DIMS[i % 3], gs, 900 + i as u64);
        grid_case::<half::f16>(BLOCK_SIZES[i % 3], HEAD_DIMS[i % 3], gs, 950 + i as u64);
    }
}

#[test]
fn a_nan_code_propagates_to_the_heads_that_read_it() {
    let g = KvGeometry::new(4, 2, 8, 4).unwrap();
    let mut rng = Rng(7);
    let mut pool = Pool::random(&g, 2, &mut rng);
    // Page 1, KV head 1, token 0, element 3 of K: the NaN code.
    pool.k[(g.num_kv_heads + 1) * g.entry_elems() + 3] = kv8_ref::NAN_CODE;
    let q: Vec<f32> = (0..2 * g.num_qo_heads * 8).map(|_| rng.f32()).collect();
    let kv = PagedKv8 {
        pages: pool.pages(),
        kv_indptr: &[0, 1, 2],
        kv_indices: &[0, 1],
        kv_last_page_len: &[4, 4],
        page_map: None,
    };
    let mut out = vec![0.0f32; q.len()];
    decode_attention_kv8(&g, &q, 1, &kv, None, 0.5, &mut out).unwrap();
    for s in 0..2 {
        for qh in 0..4 {
            let row = &out[(s * 4 + qh) * 8..][..8];
            if s == 1 && qh >= 2 {
                assert!(row.iter().all(|x| x.is_nan()), "seq {s} head {qh}: {row:?}");
            } else {
                assert!(
                    row.iter().all(|x| x.is_finite()),
                    "seq {s} head {qh}: {row:?}"
                );
            }
        }
    }
}

#[test]
fn kv8_attention_errors_leave_out_untouched() {
    let g = KvGeometry::new(4, 2, 4, 2).unwrap();
    let mut rng = Rng(8);
    let pool = Pool::random(&g, 3, &mut rng);
    let q = vec![0.1f32; 2 * 4 * 4];
    let base = PagedKv8 {
        pages: pool.pages(),
        kv_indptr: &[0, 2, 3],
        kv_indices: &[0, 1, 2],
        kv_last_page_len: &[1, 2],
        page_map: None,
    };
    let mut out = vec![7.0f32; q.len()];
    let mut run = |kv: PagedKv8| {
        let r = decode_attention_kv8(&g, &q, 1, &kv, None, 1.0, &mut out);
        assert!(out.iter().all(|&x| x == 7.0), "out written on error");
        r
    };
    let shape = |r: Result<(), OasisError>, what: &str| match r {
        Err(OasisError::Shape { what: w, .. }) => assert_eq!(w, what),
        other => panic!("expected shape error for {what}, got {other:?}"),
    };
    let pages = base.pages;
    let with = |pages| PagedKv8 { pages, ..base };
    shape(
        run(with(Kv8Pages {
            k_scales: &pool.ks[1..],
            ..pages
        })),
        "k_scales",
    );
    shape(
        run(with(Kv8Pages {
            v_scales: &pool.vs[..2],
            ..pages
        })),
        "v_scales",
    );
    shape(
        run(with(Kv8Pages {
            k_codes: &pool.k[1..],
            ..pages
        })),
        "k_pages",
    );
    shape(
        run(with(Kv8Pages {
            v_codes: &pool.v[..8],
            ..pages
        })),
        "v_pages",
    );
    let pm = [0i32; 5];
    shape(
        run(PagedKv8 {
            page_map: Some(&pm),
            ..base
        }),
        "page_map",
    );
    assert!(matches!(
        run(PagedKv8 {
            kv_indices: &[0, 3, 1],
            ..base
        }),
        Err(OasisError::IndexOutOfRange {
            what: "kv_indices",
            index: 3,
            bound: 3
        })
    ));
    let mut out = vec![7.0f32; q.len()];
    decode_attention_kv8(&g, &q, 1, &base, None, 1.0, &mut out).unwrap();
}
