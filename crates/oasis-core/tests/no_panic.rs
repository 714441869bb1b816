//! Robustness: every kernel, fed mostly-valid calls with random corruption (a buffer one element
//! short or long, table entries out of range or negative, bad counts, broken geometry), must
//! return `Ok` or `Err` without panicking, and must leave every output untouched on `Err`.

use oasis_core::kernels::{
    append_kv, append_kv_tiers, build_summaries, copy_pages, copy_pages_tiers, decode_attention,
    decode_attention_kv8, delta_select, gather_blocks, gather_blocks_tiers, qk_norm_rope,
    quantize_kv8, rms_norm, score_blocks, topk_blocks, ExtraKv, HeadLayout, Kv8Pages, Kv8PagesMut,
    KvTier, KvTierMut, PagedKv, PagedKv8, Positions, QkNorm, Residual,
};
use oasis_core::KvGeometry;
use proptest::prelude::*;

mod common;
use common::Rng;

/// The draws of the robustness cases: mostly valid values, sometimes corrupted.
impl Rng {
    /// True with probability 1/n.
    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
    /// A table entry: usually in `0..bound`, sometimes just outside, negative or extreme.
    fn entry(&mut self, bound: usize) -> i32 {
        match self.below(40) {
            0 => -1,
            1 => bound as i32,
            2 => [i32::MIN, i32::MAX, -2, bound as i32 + 1][self.below(4)],
            _ => self.below(bound) as i32,
        }
    }
    fn table(&mut self, n: usize, bound: usize) -> Vec<i32> {
        (0..n).map(|_| self.entry(bound)).collect()
    }
    fn data(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    fn jdata(&mut self, n: usize) -> Vec<f32> {
        let v = self.data(n);
        self.jiggle(v)
    }
    fn jtable(&mut self, n: usize, bound: usize) -> Vec<i32> {
        let v = self.table(n, bound);
        self.jiggle(v)
    }
    /// Entries drawn from `lo..lo + span`, sometimes one short or long.
    fn jsmall(&mut self, n: usize, lo: i32, span: usize) -> Vec<i32> {
        let v = (0..n).map(|_| lo + self.below(span) as i32).collect();
        self.jiggle(v)
    }
    /// Sometimes one element short or long.
    fn jiggle<T: Clone + Default>(&mut self, mut v: Vec<T>) -> Vec<T> {
        match self.below(30) {
            0 => {
                v.pop();
            }
            1 => v.push(T::default()),
            _ => {}
        }
        v
    }
    /// A count: usually `n`, sometimes off by one.
    fn count(&mut self, n: usize) -> usize {
        match self.below(12) {
            0 => n + 1,
            1 => n.saturating_sub(1),
            _ => n,
        }
    }
    fn geometry(&mut self) -> KvGeometry {
        let h_kv = 1 + self.below(3);
        let mut g = KvGeometry {
            num_qo_heads: h_kv * (1 + self.below(3)),
            num_kv_heads: h_kv,
            head_dim: 1 + self.below(6),
            block_size: 1 + self.below(4),
        };
        if self.one_in(20) {
            // Built by hand, bypassing `new`.
            match self.below(3) {
                0 => g.num_kv_heads = 0,
                1 => g.num_qo_heads += 1,
                _ => g.head_dim = 0,
            }
        }
        g
    }
}

/// CSR over `lens`, sometimes corrupted.
fn indptr(rng: &mut Rng, lens: &[usize]) -> Vec<i32> {
    let mut p = vec![0i32];
    for &n in lens {
        p.push(p.last().unwrap() + n as i32);
    }
    if rng.one_in(15) {
        let i = rng.below(p.len());
        p[i] += [-1, 1, 5][rng.below(3)];
    }
    rng.jiggle(p)
}

fn heads(g: &KvGeometry) -> (usize, usize, usize, usize) {
    // Sizes that stay usable for building buffers even when the geometry is invalid.
    (
        g.num_qo_heads.max(1),
        g.num_kv_heads.max(1),
        g.head_dim.max(1),
        g.block_size.max(1),
    )
}

fn attention_case(rng: &mut Rng) {
    let g = rng.geometry();
    let (hq, h_kv, d, bs) = heads(&g);
    let num_seqs = rng.below(4);
    let num_pages = 1 + rng.below(6);
    let num_rows = rng.below(4);
    let lens: Vec<usize> = (0..num_seqs)
        .map(|_| if rng.one_in(10) { 0 } else { 1 + rng.below(3) })
        .collect();
    let nnz = lens.iter().sum();
    let k = rng.jdata(num_pages * h_kv * bs * d);
    let v = rng.jdata(num_pages * h_kv * bs * d);
    let ip = indptr(rng, &lens);
    let ind = rng.jtable(nnz, num_pages);
    let last: Vec<i32> = (0..num_seqs)
        .map(|_| rng.entry(bs).wrapping_add(1))
        .collect();
    let last = rng.jiggle(last);
    let pm = rng.jsmall(num_pages * h_kv, -2, 6);
    let q = rng.jdata(num_seqs * num_rows * hq * d);
    let ek = rng.jdata(num_seqs * h_kv * d);
    let ev = rng.jdata(num_seqs * h_kv * d);
    let rows = rng.count(num_rows);
    let kv = PagedKv {
        k_pages: &k,
        v_pages: &v,
        kv_indptr: &ip,
        kv_indices: &ind,
        kv_last_page_len: &last,
        page_map: (!rng.one_in(3)).then_some(pm.as_slice()),
    };
    let extra = ExtraKv { k: &ek, v: &ev };
    let extra = rng.one_in(2).then_some(&extra);
    let mut out = rng.jiggle(vec![f32::NAN; num_seqs * num_rows * hq * d]);
    let before: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
    match decode_attention(&g, &q, rows, &kv, extra, 0.5, &mut out) {
        Ok(()) => assert!(out.iter().all(|x| x.is_finite()), "non-finite output"),
        Err(_) => assert_eq!(out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), before),
    }
}

fn append_summary_case(rng: &mut Rng) {
    let g = rng.geometry();
    let (_, h_kv, d, bs) = heads(&g);
    let num_seqs = rng.below(4);
    let num_pages = 1 + rng.below(4);
    let num_host = rng.below(4);
    let k = rng.jdata(num_seqs * h_kv * d);
    let v = rng.jdata(num_seqs * h_kv * d);
    let pid = rng.jtable(num_seqs, num_pages);
    let off = rng.jtable(num_seqs, bs);
    let hb = rng.jtable(num_seqs, num_host);
    // Rows apart from ids half the time (a pool of other size).
    let num_rows = 1 + rng.below(5);
    let rows = rng.jtable(num_seqs, num_rows);
    let split = rng.below(2) == 1;
    let (rows, num_rows) = if split {
        (Some(&rows[..]), num_rows)
    } else {
        (None, num_host)
    };
    let mut kp = rng.jdata(num_pages * h_kv * bs * d);
    let mut vp = rng.jdata(num_pages * h_kv * bs * d);
    let mut hk = rng.jdata(num_rows * h_kv * bs * d);
    let mut hv = rng.jdata(num_rows * h_kv * bs * d);
    let mut sm = rng.jdata(num_host * h_kv * 2 * d);
    let before = (kp.clone(), vp.clone(), hk.clone(), hv.clone(), sm.clone());
    if append_kv(
        &g, &k, &v, &pid, &off, &hb, rows, &mut kp, &mut vp, &mut hk, &mut hv, &mut sm,
    )
    .is_err()
    {
        assert_eq!((kp, vp, hk.clone(), hv, sm.clone()), before);
    }

    let n = rng.below(4);
    let ids = rng.jtable(n, num_host);
    let id_rows = rng.jtable(n, num_rows);
    let lens: Vec<i32> = (0..n).map(|_| rng.entry(bs).wrapping_add(1)).collect();
    let lens = rng.jiggle(lens);
    let before = sm.clone();
    let id_rows = rows.map(|_| &id_rows[..]);
    if build_summaries(&g, &hk, &ids, id_rows, &lens, &mut sm).is_err() {
        assert_eq!(sm, before);
    }
}

fn score_case(rng: &mut Rng) {
    let g = rng.geometry();
    let (hq, h_kv, d, _) = heads(&g);
    let num_seqs = rng.below(4);
    let num_host = 1 + rng.below(5);
    let lens: Vec<usize> = (0..num_seqs).map(|_| rng.below(5)).collect();
    let nnz: usize = lens.iter().sum();
    let q = rng.jdata(num_seqs * hq * d);
    let sm = rng.jdata(num_host * h_kv * 2 * d);
    let ip = indptr(rng, &lens);
    let ind = rng.jtable(nnz, num_host);
    let mut scores = rng.jiggle(vec![9.0f32; nnz * h_kv]);
    let before = scores.clone();
    if score_blocks(&g, &q, &sm, &ip, &ind, &mut scores).is_err() {
        assert_eq!(scores, before);
    }
    let k = rng.below(6);
    let h = rng.count(h_kv);
    let sc = rng.jdata(nnz * h_kv);
    let mut out = rng.jiggle(vec![77; num_seqs * h_kv * k]);
    let before = out.clone();
    match topk_blocks(h, &sc, &ip, rng.count(k), &mut out) {
        Ok(()) => assert!(out.iter().all(|x| (-1..5).contains(x))),
        Err(_) => assert_eq!(out, before),
    }
}

fn select_gather_case(rng: &mut Rng) {
    let g = rng.geometry();
    let (_, h_kv, d, bs) = heads(&g);
    let num_seqs = rng.below(4);
    let budget = rng.below(5);
    let num_pred = rng.below(budget + 1);
    let cap = rng.below(4);
    let num_pages = num_seqs * budget + rng.below(3);
    let mut pages: Vec<i32> = (0..num_pages as i32).collect();
    for i in (1..pages.len()).rev() {
        pages.swap(i, rng.below(i + 1));
    }
    pages.truncate(num_seqs * budget);
    if rng.one_in(8) && !pages.is_empty() {
        let i = rng.below(pages.len());
        pages[i] = rng.entry(num_pages); // maybe a duplicate or out of range
    }
    let slot_pages = rng.jiggle(pages);
    let nblocks = 1 + rng.below(6);
    let pred = rng.jtable(num_seqs * h_kv * num_pred, nblocks);
    let mut map = rng.jsmall(num_pages * h_kv, -1, nblocks + 1);
    let mut last = rng.jsmall(num_pages * h_kv, -1, 5);
    let mut ps = rng.jiggle(vec![-5; num_seqs * h_kv * cap]);
    let mut pb = rng.jiggle(vec![-5; num_seqs * h_kv * cap]);
    let before = (map.clone(), last.clone(), ps.clone(), pb.clone());
    let (np, b, c) = (rng.count(num_pred), rng.count(budget), rng.count(cap));
    let h = if rng.one_in(20) { 0 } else { h_kv };
    if delta_select(
        h,
        &pred,
        np,
        &slot_pages,
        b,
        &mut map,
        &mut last,
        3,
        c,
        &mut ps,
        &mut pb,
    )
    .is_err()
    {
        assert_eq!((map, last, ps.clone(), pb.clone()), before);
    }

    let num_host = 1 + rng.below(6);
    let lens: Vec<usize> = (0..num_seqs).map(|_| rng.below(nblocks + 1)).collect();
    let hip = indptr(rng, &lens);
    let hind = rng.jtable(lens.iter().sum(), num_host);
    let hk = rng.jdata(num_host * h_kv * bs * d);
    let hv = rng.jdata(num_host * h_kv * bs * d);
    let mut kp = rng.jdata(num_pages * h_kv * bs * d);
    let mut vp = rng.jdata(num_pages * h_kv * bs * d);
    let before = (kp.clone(), vp.clone());
    if gather_blocks(
        &g,
        &ps,
        &pb,
        c,
        &slot_pages,
        b,
        &hip,
        &hind,
        &hk,
        &hv,
        &mut kp,
        &mut vp,
    )
    .is_err()
    {
        assert_eq!((kp.clone(), vp.clone()), before);
    }

    let n = rng.below(4);
    let src = rng.table(n, num_host);
    let dst = rng.jtable(n, num_pages);
    let before = (kp.clone(), vp.clone());
    if copy_pages(&g, &hk, &hv, &src, &mut kp, &mut vp, &dst).is_err() {
        assert_eq!((kp, vp), before);
    }
}

fn norm_rope_case(rng: &mut Rng) {
    let hidden = rng.below(7);
    let n = rng.below(4);
    let pad = rng.below(3);
    let stride = rng.count(hidden + pad);
    let span = if n == 0 { 0 } else { (n - 1) * stride + hidden };
    let x = rng.jdata(span);
    let w = rng.jdata(hidden);
    let res = rng.jdata(n * hidden);
    let mut h = rng.jdata(n * hidden);
    let mut out = rng.jiggle(vec![f32::NAN; n * hidden]);
    let before = (out.clone(), h.clone());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let residual = match rng.below(3) {
        0 => None,
        1 => Some(Residual::Separate {
            residual: &res,
            residual_out: &mut h,
        }),
        _ => Some(Residual::InPlace(&mut h)),
    };
    if rms_norm(&x, stride, &w, 1e-6, residual, &mut out).is_err() {
        assert_eq!((bits(&out), bits(&h)), (bits(&before.0), bits(&before.1)));
    }

    let layout = HeadLayout {
        num_heads: rng.below(4),
        num_kv_heads: rng.below(3),
        head_dim: rng.below(6),
    };
    let (hq, hkv, d) = (layout.num_heads, layout.num_kv_heads, layout.head_dim);
    let width = (hq + 2 * hkv) * d;
    let n = rng.below(4);
    let pad = rng.below(3);
    let stride = rng.count(width + pad);
    let span = if n == 0 { 0 } else { (n - 1) * stride + width };
    let qkv = rng.jdata(span);
    let pos: Vec<i64> = (0..n).map(|_| rng.below(50_000) as i64 - 10).collect();
    let pos = rng.jiggle(pos);
    let inv = rng.jdata(d / 2);
    let (qw, kw) = (rng.jdata(d), rng.jdata(d));
    let norm = QkNorm {
        q_weight: &qw,
        k_weight: &kw,
        eps: 1e-6,
    };
    let mut q = rng.jiggle(vec![f32::NAN; n * hq * d]);
    let mut k = rng.jiggle(vec![f32::NAN; n * hkv * d]);
    let mut v = rng.jiggle(vec![f32::NAN; n * hkv * d]);
    let before = (bits(&q), bits(&k), bits(&v));
    let norm = rng.one_in(2).then_some(&norm);
    let kv_groups = rng.below(4); // 0 and non-divisors are errors
    if qk_norm_rope(
        &layout,
        &qkv,
        stride,
        Positions::I64(&pos),
        &inv,
        1.0,
        norm,
        &mut q,
        &mut k,
        &mut v,
        kv_groups,
    )
    .is_err()
    {
        assert_eq!((bits(&q), bits(&k), bits(&v)), before);
    }
}

/// A pool of either storage for the kv8 cases: `T` pages, or codes plus K and V scales.
#[derive(Clone, Debug, PartialEq)]
struct AnyPool {
    kv8: bool,
    k: Vec<f32>,
    v: Vec<f32>,
    kc: Vec<u8>,
    vc: Vec<u8>,
    ks: Vec<f32>,
    vs: Vec<f32>,
}

impl AnyPool {
    fn random(rng: &mut Rng, pages: usize, h_kv: usize, bs: usize, d: usize) -> Self {
        let n = pages * h_kv * bs * d;
        let codes = |rng: &mut Rng| {
            let c = (0..n).map(|_| rng.next() as u8).collect();
            rng.jiggle(c)
        };
        let scales = |rng: &mut Rng| {
            let s = (0..pages * h_kv)
                .map(|_| 2f32.powi(rng.below(300) as i32 - 150)) // garbage scales included
                .collect();
            rng.jiggle(s)
        };
        AnyPool {
            kv8: rng.one_in(2),
            k: rng.jdata(n),
            v: rng.jdata(n),
            kc: codes(rng),
            vc: codes(rng),
            ks: scales(rng),
            vs: scales(rng),
        }
    }
    fn tier(&self) -> KvTier<'_, f32> {
        if self.kv8 {
            KvTier::Kv8(Kv8Pages {
                k_codes: &self.kc,
                v_codes: &self.vc,
                k_scales: &self.ks,
                v_scales: &self.vs,
            })
        } else {
            KvTier::Elem {
                k: &self.k,
                v: &self.v,
            }
        }
    }
    fn tier_mut(&mut self) -> KvTierMut<'_, f32> {
        if self.kv8 {
            KvTierMut::Kv8(Kv8PagesMut {
                k_codes: &mut self.kc,
                v_codes: &mut self.vc,
                k_scales: &mut self.ks,
                v_scales: &mut self.vs,
            })
        } else {
            KvTierMut::Elem {
                k: &mut self.k,
                v: &mut self.v,
            }
        }
    }
}

/// The kv8 entry points, each tier `T` or kv8 at random.
fn kv8_case(rng: &mut Rng) {
    let g = rng.geometry();
    let (hq, h_kv, d, bs) = heads(&g);
    let num_seqs = rng.below(4);
    let num_pages = 1 + rng.below(5);
    let mut gpu = AnyPool::random(rng, num_pages, h_kv, bs, d);
    gpu.kv8 = true;

    // Attention over kv8 pages.
    let num_rows = 1 + rng.below(3);
    let lens: Vec<usize> = (0..num_seqs).map(|_| 1 + rng.below(3)).collect();
    let ip = indptr(rng, &lens);
    let ind = rng.jtable(lens.iter().sum(), num_pages);
    let last: Vec<i32> = (0..num_seqs)
        .map(|_| rng.entry(bs).wrapping_add(1))
        .collect();
    let last = rng.jiggle(last);
    let pm = rng.jsmall(num_pages * h_kv, -2, 6);
    let q = rng.jdata(num_seqs * num_rows * hq * d);
    let (ek, ev) = (
        rng.jdata(num_seqs * h_kv * d),
        rng.jdata(num_seqs * h_kv * d),
    );
    let KvTier::Kv8(pages) = gpu.tier() else {
        unreachable!()
    };
    let kv = PagedKv8 {
        pages,
        kv_indptr: &ip,
        kv_indices: &ind,
        kv_last_page_len: &last,
        page_map: rng.one_in(2).then_some(pm.as_slice()),
    };
    let extra = ExtraKv { k: &ek, v: &ev };
    let extra = rng.one_in(2).then_some(&extra);
    let mut out = rng.jiggle(vec![7.0f32; num_seqs * num_rows * hq * d]);
    let before = out.clone();
    let rows = rng.count(num_rows);
    if decode_attention_kv8(&g, &q, rows, &kv, extra, 0.5, &mut out).is_err() {
        assert_eq!(out, before);
    }

    // Append with each tier T or kv8.
    gpu.kv8 = rng.one_in(2);
    let num_host = 1 + rng.below(4);
    let mut host = AnyPool::random(rng, num_host, h_kv, bs, d);
    let mut sm = rng.jdata(num_host * h_kv * 2 * d);
    let (k, v) = (
        rng.jdata(num_seqs * h_kv * d),
        rng.jdata(num_seqs * h_kv * d),
    );
    let pid = rng.jtable(num_seqs, num_pages);
    let off = rng.jtable(num_seqs, bs);
    let hb = rng.jtable(num_seqs, num_host);
    let before = (gpu.clone(), host.clone(), sm.clone());
    let r = append_kv_tiers(
        &g,
        &k,
        &v,
        &pid,
        &off,
        &hb,
        None,
        gpu.tier_mut(),
        host.tier_mut(),
        &mut sm,
    );
    if r.is_err() {
        assert_eq!((gpu.clone(), host.clone(), sm.clone()), before);
    }

    // Gather and page copies between any two storages.
    let cap = rng.below(3);
    let budget = rng.below(4);
    let ps = rng.jtable(num_seqs * h_kv * cap, budget);
    let pb = rng.jtable(num_seqs * h_kv * cap, 3);
    let slot_pages = rng.jtable(num_seqs * budget, num_pages);
    let lens: Vec<usize> = (0..num_seqs).map(|_| rng.below(4)).collect();
    let hip = indptr(rng, &lens);
    let hind = rng.jtable(lens.iter().sum(), num_host);
    let before = gpu.clone();
    let (c, b) = (rng.count(cap), rng.count(budget));
    let r = gather_blocks_tiers(
        &g,
        &ps,
        &pb,
        c,
        &slot_pages,
        b,
        &hip,
        &hind,
        &host.tier(),
        gpu.tier_mut(),
    );
    if r.is_err() {
        assert_eq!(gpu, before);
    }
    let n = rng.below(4);
    let src = rng.jtable(n, num_pages);
    let dst = rng.jtable(n, num_host);
    let valid: Vec<i32> = (0..n).map(|_| rng.entry(bs).wrapping_add(1)).collect();
    let valid = rng.jiggle(valid);
    let before = host.clone();
    let valid = rng.one_in(2).then_some(valid.as_slice());
    if copy_pages_tiers(&g, &gpu.tier(), &src, host.tier_mut(), &dst, valid).is_err() {
        assert_eq!(host, before);
    }

    // Whole-block quantization.
    let lens: Vec<i32> = (0..num_pages)
        .map(|_| rng.entry(bs).wrapping_add(1))
        .collect();
    let lens = rng.jiggle(lens);
    let before = (host.kc.clone(), host.ks.clone());
    if quantize_kv8(&g, &gpu.k, &lens, &mut host.kc, &mut host.ks).is_err() {
        assert_eq!((host.kc, host.ks), before);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn kernels_never_panic(seed in any::<u64>()) {
        let mut rng = Rng(seed);
        attention_case(&mut rng);
        append_summary_case(&mut rng);
        score_case(&mut rng);
        select_gather_case(&mut rng);
        norm_rope_case(&mut rng);
    }

    #[test]
    fn kv8_kernels_never_panic(seed in any::<u64>()) {
        kv8_case(&mut Rng(seed));
    }
}
