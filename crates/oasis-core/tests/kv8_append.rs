//! `append_kv_tiers` with kv8 tiers against the f64 reference's sequential procedure
//! (`kv8_ref::Entry`), the tier combinations, and `append_kv` (T + T) bit-identical with the
//! function as it was before kv8.

use half::bf16;
use oasis_core::kernels::{append_kv, append_kv_tiers, Kv8PagesMut, KvTierMut, KV8_MIN_EXP};
use oasis_core::{KvElem, KvGeometry, OasisError};

mod common;
mod kv8_ref;
use common::Rng;

/// A kv8 pool: codes `[n, H, B, D]` (filled with garbage), K and V scales `[n, H]`.
struct Pool8 {
    k: Vec<u8>,
    v: Vec<u8>,
    ks: Vec<f32>,
    vs: Vec<f32>,
}

impl Pool8 {
    fn new(g: &KvGeometry, n: usize) -> Self {
        Pool8 {
            k: vec![0xa5; n * g.page_elems()],
            v: vec![0x5a; n * g.page_elems()],
            ks: vec![3.0; n * g.num_kv_heads],
            vs: vec![0.0; n * g.num_kv_heads],
        }
    }
    fn tier(&mut self) -> KvTierMut<'_, f32> {
        KvTierMut::Kv8(Kv8PagesMut {
            k_codes: &mut self.k,
            v_codes: &mut self.v,
            k_scales: &mut self.ks,
            v_scales: &mut self.vs,
        })
    }
    /// Check rows `0..rows` of entry (page, head) against the reference's K and V entries (the
    /// rows past them hold what was there before).
    fn check(
        &self,
        g: &KvGeometry,
        page: usize,
        h: usize,
        rows: usize,
        rk: &kv8_ref::Entry,
        rv: &kv8_ref::Entry,
    ) {
        let e = page * g.num_kv_heads + h;
        let n = rows * g.head_dim;
        let at = e * g.entry_elems()..e * g.entry_elems() + n;
        assert_eq!(
            &self.k[at.clone()],
            &rk.codes[..n],
            "k codes of ({page}, {h})"
        );
        assert_eq!(&self.v[at], &rv.codes[..n], "v codes of ({page}, {h})");
        assert_eq!(
            f64::from(self.ks[e]),
            2f64.powi(rk.e),
            "k scale of ({page}, {h})"
        );
        assert_eq!(
            f64::from(self.vs[e]),
            2f64.powi(rv.e),
            "v scale of ({page}, {h})"
        );
    }
}

/// Rows whose magnitude jumps: token 3 needs a much larger scale (old rows requantized, the
/// smallest into subnormals), token 5 a smaller one (kept), some tokens hold zeros or NaN.
fn token_row(rng: &mut Rng, t: usize, n: usize) -> Vec<f32> {
    let mag = [
        2f32.powi(-6),
        1.0,
        0.5,
        2f32.powi(9),
        3.0,
        1e-3,
        2f32.powi(12),
        7.0,
    ][t % 8];
    (0..n)
        .map(|i| match (t, i) {
            (2, 0) => 0.0,
            (4, 1) => f32::NAN,
            _ => rng.f32() * mag,
        })
        .collect()
}

#[test]
fn sequential_appends_match_the_reference_on_both_kv8_tiers() {
    let g = KvGeometry::new(4, 2, 16, 8).unwrap();
    let (h_kv, bs, d) = (g.num_kv_heads, g.block_size, g.head_dim);
    let mut rng = Rng(11);
    let (mut gpu, mut host) = (Pool8::new(&g, 3), Pool8::new(&g, 3));
    let untouched = (gpu.k.clone(), host.ks.clone());
    let mut sm = vec![0.0f32; 2 * h_kv * 2 * d];
    let fresh = || vec![kv8_ref::Entry::new(bs, d); h_kv];
    let (mut rk, mut rv) = (fresh(), fresh());
    let mut raw_k: Vec<Vec<f32>> = Vec::new();
    // One sequence: page 1 of the GPU pool, host block 1 written through to host row 2. The
    // offsets run 0..bs, then 0 again (the page is reused: the scale resets to the new row's).
    for (step, off) in (0..bs).chain([0, 1]).enumerate() {
        let k = token_row(&mut rng, step, h_kv * d);
        let v = token_row(&mut rng, step + 3, h_kv * d);
        append_kv_tiers(
            &g,
            &k,
            &v,
            &[1],
            &[off as i32],
            &[1],
            Some(&[2]),
            gpu.tier(),
            host.tier(),
            &mut sm,
        )
        .unwrap();
        if off == 0 {
            raw_k.clear();
        }
        raw_k.push(k.clone());
        for h in 0..h_kv {
            let row = |x: &[f32]| {
                x[h * d..(h + 1) * d]
                    .iter()
                    .map(|&y| f64::from(y))
                    .collect::<Vec<_>>()
            };
            rk[h].append(off, &row(&k));
            rv[h].append(off, &row(&v));
            gpu.check(&g, 1, h, off + 1, &rk[h], &rv[h]);
            host.check(&g, 2, h, off + 1, &rk[h], &rv[h]);
            // The summary comes from the unquantized keys.
            for x in 0..d {
                let col = raw_k.iter().map(|k| k[h * d + x]);
                let mn = col.clone().fold(f32::INFINITY, f32::min);
                let mx = col.fold(f32::NEG_INFINITY, f32::max);
                let at = (h_kv + h) * 2 * d + x;
                assert_eq!((sm[at], sm[at + d]), (mn, mx), "summary h {h} x {x}");
            }
        }
        if step == 3 {
            assert!(rk.iter().any(|e| e.e > KV8_MIN_EXP + 100), "the scale grew");
        }
    }
    // Other pages, rows and summaries untouched.
    let p = g.page_elems();
    assert_eq!(&gpu.k[..p], &untouched.0[..p]);
    assert_eq!(&gpu.k[2 * p..], &untouched.0[2 * p..]);
    assert_eq!(&host.ks[..2 * h_kv], &untouched.1[..2 * h_kv]);
    assert!(sm[..h_kv * 2 * d].iter().all(|&x| x == 0.0));
}

#[test]
fn gpu_elem_with_host_kv8() {
    let g = KvGeometry::new(8, 2, 64, 16).unwrap();
    let (h_kv, bs, d) = (g.num_kv_heads, g.block_size, g.head_dim);
    let mut rng = Rng(12);
    let mut kp = vec![0.0f32; 2 * g.page_elems()];
    let mut vp = kp.clone();
    let mut host = Pool8::new(&g, 2);
    let mut sm = vec![0.0f32; 2 * h_kv * 2 * d];
    let mut rk = vec![kv8_ref::Entry::new(bs, d); h_kv];
    let mut rv = rk.clone();
    // Seq 0 sparse (page 0, host block 0 = row 0), seq 1 dense (page 1): no host write.
    for off in 0..bs {
        let k = [
            token_row(&mut rng, off, h_kv * d),
            token_row(&mut rng, 1, h_kv * d),
        ]
        .concat();
        let v = [
            token_row(&mut rng, off + 1, h_kv * d),
            token_row(&mut rng, 2, h_kv * d),
        ]
        .concat();
        append_kv_tiers(
            &g,
            &k,
            &v,
            &[0, 1],
            &[off as i32, off as i32],
            &[0, -1],
            None,
            KvTierMut::Elem {
                k: &mut kp,
                v: &mut vp,
            },
            host.tier(),
            &mut sm,
        )
        .unwrap();
        for (s, page) in [(0usize, 0usize), (1, 1)] {
            for h in 0..h_kv {
                let src = (s * h_kv + h) * d..(s * h_kv + h + 1) * d;
                let dst = ((page * h_kv + h) * bs + off) * d;
                let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&kp[dst..dst + d]), bits(&k[src.clone()]));
                assert_eq!(bits(&vp[dst..dst + d]), bits(&v[src.clone()]));
                if s == 0 {
                    let f = |x: &[f32]| x.iter().map(|&y| f64::from(y)).collect::<Vec<_>>();
                    rk[h].append(off, &f(&k[src.clone()]));
                    rv[h].append(off, &f(&v[src]));
                    host.check(&g, 0, h, off + 1, &rk[h], &rv[h]);
                }
            }
        }
    }
    assert!(
        host.k[g.page_elems()..].iter().all(|&c| c == 0xa5),
        "row 1 untouched"
    );
}

/// `append_kv` exactly as it was before kv8 (the T + T path), for the bit-identity check.
#[allow(clippy::too_many_arguments)]
fn append_kv_before<T: KvElem>(
    g: &KvGeometry,
    k_new: &[T],
    v_new: &[T],
    page_ids: &[i32],
    page_offsets: &[i32],
    host_block_ids: &[i32],
    host_rows: Option<&[i32]>,
    k_pages: &mut [T],
    v_pages: &mut [T],
    host_k: &mut [T],
    host_v: &mut [T],
    summaries: &mut [T],
) {
    let (h_kv, d) = (g.num_kv_heads, g.head_dim);
    let row_of = |s: usize| host_rows.map_or(host_block_ids[s], |r| r[s]);
    for s in 0..page_ids.len() {
        if page_ids[s] < 0 {
            continue;
        }
        let page = page_ids[s] as usize;
        let off = page_offsets[s] as usize;
        for h in 0..h_kv {
            let src = (s * h_kv + h) * d..(s * h_kv + h + 1) * d;
            let dst = page * g.page_elems() + h * g.entry_elems() + off * d;
            k_pages[dst..dst + d].copy_from_slice(&k_new[src.clone()]);
            v_pages[dst..dst + d].copy_from_slice(&v_new[src.clone()]);
            if host_block_ids[s] < 0 {
                continue;
            }
            let blk = host_block_ids[s] as usize;
            let row = row_of(s) as usize;
            let dst = row * g.page_elems() + h * g.entry_elems() + off * d;
            host_k[dst..dst + d].copy_from_slice(&k_new[src.clone()]);
            host_v[dst..dst + d].copy_from_slice(&v_new[src.clone()]);
            let sum = (blk * h_kv + h) * 2 * d;
            let (mins, maxs) = summaries[sum..sum + 2 * d].split_at_mut(d);
            let k = &k_new[src];
            if off == 0 {
                mins.copy_from_slice(k);
                maxs.copy_from_slice(k);
            } else {
                for ((mn, mx), &x) in mins.iter_mut().zip(maxs.iter_mut()).zip(k) {
                    let xf = x.to_f32();
                    *mn = T::from_f32(mn.to_f32().min(xf));
                    *mx = T::from_f32(mx.to_f32().max(xf));
                }
            }
        }
    }
}

fn unchanged<T: KvElem>() {
    let g = KvGeometry::new(6, 3, 8, 4).unwrap();
    let (h_kv, bs, d) = (g.num_kv_heads, g.block_size, g.head_dim);
    let (pages, rows, blocks, seqs) = (5, 4, 6, 4);
    let mut rng = Rng(21);
    let mut data = |n: usize| {
        (0..n)
            .map(|_| T::from_f32(rng.f32() * 8.0))
            .collect::<Vec<T>>()
    };
    let mut a = [
        data(pages * g.page_elems()),
        data(pages * g.page_elems()),
        data(rows * g.page_elems()),
        data(rows * g.page_elems()),
        data(blocks * h_kv * 2 * d),
    ];
    let mut b = a.clone();
    let mut rng = Rng(22);
    for step in 0..40 {
        let k = (0..seqs * h_kv * d)
            .map(|_| T::from_f32(rng.f32()))
            .collect::<Vec<T>>();
        let v = (0..seqs * h_kv * d)
            .map(|_| T::from_f32(rng.f32()))
            .collect::<Vec<T>>();
        let ids: Vec<i32> = (0..seqs).map(|_| rng.below(pages + 1) as i32 - 1).collect();
        let offs: Vec<i32> = (0..seqs).map(|_| rng.below(bs) as i32).collect();
        let hb: Vec<i32> = (0..seqs)
            .map(|_| rng.below(blocks + 1) as i32 - 1)
            .collect();
        let hr: Vec<i32> = (0..seqs).map(|_| rng.below(rows) as i32).collect();
        let host_rows = (step % 2 == 0).then_some(&hr[..]);
        let hb: Vec<i32> = if host_rows.is_none() {
            hb.iter().map(|&x| x.min(rows as i32 - 1)).collect()
        } else {
            hb
        };
        let [kp, vp, hk, hv, sm] = &mut a;
        append_kv(&g, &k, &v, &ids, &offs, &hb, host_rows, kp, vp, hk, hv, sm).unwrap();
        let [kp, vp, hk, hv, sm] = &mut b;
        append_kv_before(&g, &k, &v, &ids, &offs, &hb, host_rows, kp, vp, hk, hv, sm);
        let bits = |x: &[T]| x.iter().map(|y| y.to_f32().to_bits()).collect::<Vec<_>>();
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(bits(x), bits(y), "step {step} {:?}", T::DTYPE);
        }
    }
}

#[test]
fn append_kv_is_bit_identical_to_before() {
    unchanged::<f32>();
    unchanged::<bf16>();
    unchanged::<half::f16>();
}

#[test]
fn kv8_tier_errors_write_nothing() {
    let g = KvGeometry::new(2, 2, 4, 3).unwrap();
    let h_kv = g.num_kv_heads;
    let k = vec![1.0f32; h_kv * g.head_dim];
    let mut gpu = Pool8::new(&g, 2);
    let mut host = Pool8::new(&g, 1);
    let mut sm = vec![0.0f32; h_kv * 2 * g.head_dim];
    let before = (
        gpu.k.clone(),
        gpu.ks.clone(),
        host.k.clone(),
        host.vs.clone(),
    );
    let shape = |r: Result<(), OasisError>, what: &str| match r {
        Err(OasisError::Shape { what: w, .. }) => assert_eq!(w, what),
        other => panic!("expected shape error for {what}, got {other:?}"),
    };
    let call = |gpu: &mut Pool8, host: &mut Pool8, sm: &mut [f32], page: i32, bad: usize| {
        let mut gt = gpu.tier();
        let mut ht = host.tier();
        match (bad, &mut gt, &mut ht) {
            (1, KvTierMut::Kv8(p), _) => p.k_scales = &mut [],
            (2, KvTierMut::Kv8(p), _) => p.v_codes = &mut [],
            (3, _, KvTierMut::Kv8(p)) => p.v_scales = &mut [],
            (4, _, KvTierMut::Kv8(p)) => p.k_codes = &mut [],
            _ => {}
        }
        append_kv_tiers(&g, &k, &k, &[page], &[1], &[0], None, gt, ht, sm)
    };
    shape(call(&mut gpu, &mut host, &mut sm, 0, 1), "k_scales");
    shape(call(&mut gpu, &mut host, &mut sm, 0, 2), "v_pages");
    shape(call(&mut gpu, &mut host, &mut sm, 0, 3), "host_v_scales");
    // Empty K codes imply 0 rows, so the V codes are the ones that disagree.
    shape(call(&mut gpu, &mut host, &mut sm, 0, 4), "host_v");
    assert!(matches!(
        call(&mut gpu, &mut host, &mut sm, 2, 0),
        Err(OasisError::IndexOutOfRange {
            what: "page_ids",
            index: 2,
            bound: 2
        })
    ));
    assert_eq!(
        (
            gpu.k.clone(),
            gpu.ks.clone(),
            host.k.clone(),
            host.vs.clone()
        ),
        before
    );
    assert!(sm.iter().all(|&x| x == 0.0));
    call(&mut gpu, &mut host, &mut sm, 1, 0).unwrap();
}
