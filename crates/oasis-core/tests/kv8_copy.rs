//! `gather_blocks_tiers` and `copy_pages_tiers`: kv8 -> kv8 byte-exact (codes and scales),
//! kv8 -> T equal to `decode(code) * scale`, T -> kv8 equal to `quantize_kv8` (and to the f64
//! reference), T -> T as the old functions; errors write nothing.

use half::bf16;
use oasis_core::kernels::{
    copy_pages, copy_pages_tiers, gather_blocks, gather_blocks_tiers, quantize_kv8, Kv8Pages,
    Kv8PagesMut, KvTier, KvTierMut,
};
use oasis_core::{KvElem, KvGeometry, OasisError};

mod common;
mod kv8_ref;
use common::Rng;

fn geo() -> KvGeometry {
    KvGeometry::new(4, 2, 8, 4).unwrap()
}

/// Random codes (NaN codes included) and power-of-two scales: a kv8 pool of `n` pages.
#[derive(Clone, Debug, PartialEq)]
struct Pool8 {
    k: Vec<u8>,
    v: Vec<u8>,
    ks: Vec<f32>,
    vs: Vec<f32>,
}

impl Pool8 {
    fn random(g: &KvGeometry, n: usize, rng: &mut Rng) -> Self {
        let codes = |rng: &mut Rng| (0..n * g.page_elems()).map(|_| rng.next() as u8).collect();
        let scales = |rng: &mut Rng| {
            (0..n * g.num_kv_heads)
                .map(|_| 2f32.powi(rng.below(60) as i32 - 30))
                .collect()
        };
        Pool8 {
            k: codes(rng),
            v: codes(rng),
            ks: scales(rng),
            vs: scales(rng),
        }
    }
    fn tier<T>(&self) -> KvTier<'_, T> {
        KvTier::Kv8(Kv8Pages {
            k_codes: &self.k,
            v_codes: &self.v,
            k_scales: &self.ks,
            v_scales: &self.vs,
        })
    }
    fn tier_mut<T>(&mut self) -> KvTierMut<'_, T> {
        KvTierMut::Kv8(Kv8PagesMut {
            k_codes: &mut self.k,
            v_codes: &mut self.v,
            k_scales: &mut self.ks,
            v_scales: &mut self.vs,
        })
    }
    /// Entry `e`'s (K codes, V codes, K scale, V scale).
    fn entry(&self, g: &KvGeometry, e: usize) -> (&[u8], &[u8], f32, f32) {
        let r = e * g.entry_elems()..(e + 1) * g.entry_elems();
        (&self.k[r.clone()], &self.v[r], self.ks[e], self.vs[e])
    }
}

/// The reference's dequantized value, rounded to `T` (exact for f32).
fn deq<T: KvElem>(c: u8, s: f32) -> T {
    T::from_f32(kv8_ref::value(c).map_or(f32::NAN, |v| (v * f64::from(s)) as f32))
}

fn same_bits<T: KvElem>(a: T, b: T) -> bool {
    let (a, b) = (a.to_f32(), b.to_f32());
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// The plan of `gather_blocks`' own test: (page, head) <- (host block, head) for 4 entries.
struct Plan {
    slots: Vec<i32>,
    blocks: Vec<i32>,
    slot_pages: Vec<i32>,
    indptr: Vec<i32>,
    indices: Vec<i32>,
    moved: Vec<((usize, usize), usize)>,
}

fn plan() -> Plan {
    Plan {
        slots: vec![1, -1, 0, 1, -1, -1, 1, -1],
        blocks: vec![2, 9, 0, 1, 5, -3, 0, -1],
        slot_pages: vec![3, 0, 1, 2],
        indptr: vec![0, 3, 5],
        indices: vec![4, 1, 3, 0, 2],
        moved: vec![((0, 0), 3), ((3, 1), 4), ((0, 1), 1), ((2, 1), 0)],
    }
}

fn gather<T: KvElem>(g: &KvGeometry, p: &Plan, host: &KvTier<T>, gpu: KvTierMut<T>) -> usize {
    gather_blocks_tiers(
        g,
        &p.slots,
        &p.blocks,
        2,
        &p.slot_pages,
        2,
        &p.indptr,
        &p.indices,
        host,
        gpu,
    )
    .unwrap()
}

#[test]
fn gather_kv8_to_kv8_is_byte_exact() {
    let g = geo();
    let mut rng = Rng(1);
    let host = Pool8::random(&g, 5, &mut rng);
    let mut gpu = Pool8::random(&g, 4, &mut rng);
    let before = gpu.clone();
    let p = plan();
    assert_eq!(gather::<f32>(&g, &p, &host.tier(), gpu.tier_mut()), 4);
    for e in 0..4 * g.num_kv_heads {
        let (page, h) = (e / g.num_kv_heads, e % g.num_kv_heads);
        match p.moved.iter().find(|&&(at, _)| at == (page, h)) {
            Some(&(_, hb)) => {
                let want = host.entry(&g, hb * g.num_kv_heads + h);
                let got = gpu.entry(&g, e);
                assert_eq!((got.0, got.1), (want.0, want.1));
                assert_eq!(
                    (got.2.to_bits(), got.3.to_bits()),
                    (want.2.to_bits(), want.3.to_bits())
                );
            }
            None => assert_eq!(gpu.entry(&g, e), before.entry(&g, e)),
        }
    }
}

fn gather_kv8_to_elem<T: KvElem>() {
    let g = geo();
    let mut rng = Rng(2);
    let host = Pool8::random(&g, 5, &mut rng);
    let mut kp = vec![T::from_f32(-3.0); 4 * g.page_elems()];
    let mut vp = kp.clone();
    let p = plan();
    gather::<T>(
        &g,
        &p,
        &host.tier(),
        KvTierMut::Elem {
            k: &mut kp,
            v: &mut vp,
        },
    );
    let n = g.entry_elems();
    for e in 0..4 * g.num_kv_heads {
        let (page, h) = (e / g.num_kv_heads, e % g.num_kv_heads);
        for i in 0..n {
            let (k, v) = (kp[e * n + i], vp[e * n + i]);
            match p.moved.iter().find(|&&(at, _)| at == (page, h)) {
                Some(&(_, hb)) => {
                    let se = hb * g.num_kv_heads + h;
                    assert!(same_bits(k, deq::<T>(host.k[se * n + i], host.ks[se])));
                    assert!(same_bits(v, deq::<T>(host.v[se * n + i], host.vs[se])));
                }
                None => assert!(k.to_f32() == -3.0 && v.to_f32() == -3.0),
            }
        }
    }
}

#[test]
fn gather_kv8_to_elem_dequantizes_exactly() {
    gather_kv8_to_elem::<f32>();
    gather_kv8_to_elem::<bf16>();
    gather_kv8_to_elem::<half::f16>();
}

#[test]
fn gather_elem_to_kv8_quantizes_whole_blocks() {
    let g = geo();
    let mut rng = Rng(3);
    let hk: Vec<f32> = (0..5 * g.page_elems()).map(|_| rng.f32() * 37.0).collect();
    let hv: Vec<f32> = (0..5 * g.page_elems()).map(|_| rng.f32() * 1e-3).collect();
    let mut gpu = Pool8::random(&g, 4, &mut rng);
    let p = plan();
    gather::<f32>(&g, &p, &KvTier::Elem { k: &hk, v: &hv }, gpu.tier_mut());
    let n = g.entry_elems();
    for &((page, h), hb) in &p.moved {
        let (se, de) = (hb * g.num_kv_heads + h, page * g.num_kv_heads + h);
        for (src, codes, scales) in [(&hk, &gpu.k, &gpu.ks), (&hv, &gpu.v, &gpu.vs)] {
            let rows: Vec<f64> = src[se * n..(se + 1) * n]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            let (want, e) = kv8_ref::quantize_block(&rows, n);
            assert_eq!(&codes[de * n..(de + 1) * n], &want[..]);
            assert_eq!(f64::from(scales[de]), 2f64.powi(e));
        }
    }
}

#[test]
fn gather_elem_to_elem_is_gather_blocks() {
    let g = geo();
    let mut rng = Rng(4);
    let host: Vec<bf16> = (0..5 * g.page_elems())
        .map(|_| bf16::from_f32(rng.f32()))
        .collect();
    let mut a = vec![bf16::ZERO; 4 * g.page_elems()];
    let (mut av, mut b, mut bv) = (a.clone(), a.clone(), a.clone());
    let p = plan();
    gather::<bf16>(
        &g,
        &p,
        &KvTier::Elem { k: &host, v: &host },
        KvTierMut::Elem {
            k: &mut a,
            v: &mut av,
        },
    );
    gather_blocks(
        &g,
        &p.slots,
        &p.blocks,
        2,
        &p.slot_pages,
        2,
        &p.indptr,
        &p.indices,
        &host,
        &host,
        &mut b,
        &mut bv,
    )
    .unwrap();
    assert_eq!((a, av), (b, bv));
}

#[test]
fn copy_pages_kv8_to_kv8_and_to_elem() {
    let g = geo();
    let mut rng = Rng(5);
    let src = Pool8::random(&g, 3, &mut rng);
    let mut dst = Pool8::random(&g, 4, &mut rng);
    let before = dst.clone();
    // `valid` is read only for T -> kv8: a kv8 copy is whole pages whatever it says.
    copy_pages_tiers::<f32>(
        &g,
        &src.tier(),
        &[2, 0],
        dst.tier_mut(),
        &[0, 3],
        Some(&[1, 2]),
    )
    .unwrap();
    let h = g.num_kv_heads;
    for (s, t) in [(2usize, 0usize), (0, 3)] {
        for hh in 0..h {
            let want = src.entry(&g, s * h + hh);
            let got = dst.entry(&g, t * h + hh);
            assert_eq!((got.0, got.1), (want.0, want.1));
            assert_eq!(
                (got.2.to_bits(), got.3.to_bits()),
                (want.2.to_bits(), want.3.to_bits())
            );
        }
    }
    for e in h..3 * h {
        assert_eq!(dst.entry(&g, e), before.entry(&g, e));
    }
    let mut dk = vec![0.0f32; 2 * g.page_elems()];
    let mut dv = dk.clone();
    copy_pages_tiers(
        &g,
        &src.tier(),
        &[1, 2],
        KvTierMut::Elem {
            k: &mut dk,
            v: &mut dv,
        },
        &[1, 0],
        None,
    )
    .unwrap();
    let n = g.entry_elems();
    for (s, t) in [(1usize, 1usize), (2, 0)] {
        for hh in 0..h {
            let (se, te) = (s * h + hh, t * h + hh);
            for i in 0..n {
                assert!(same_bits(
                    dk[te * n + i],
                    deq::<f32>(src.k[se * n + i], src.ks[se])
                ));
                assert!(same_bits(
                    dv[te * n + i],
                    deq::<f32>(src.v[se * n + i], src.vs[se])
                ));
            }
        }
    }
}

fn copy_elem_to_kv8<T: KvElem>() {
    let g = KvGeometry::new(6, 3, 16, 8).unwrap();
    let mut rng = Rng(6);
    let n_src = 4;
    let sk: Vec<T> = (0..n_src * g.page_elems())
        .map(|i| T::from_f32(rng.f32() * 2f32.powi((i / g.entry_elems()) as i32 % 9 - 4)))
        .collect();
    let sv: Vec<T> = (0..n_src * g.page_elems())
        .map(|_| T::from_f32(rng.f32() * 0.01))
        .collect();
    let src_ids: [i32; 3] = [3, 0, 2];
    let dst_ids: [i32; 3] = [1, 4, 0];
    let valid: [i32; 3] = [8, 3, 1]; // the last, partial page of each request
    let mut dst = Pool8::random(&g, 5, &mut rng);
    let before = dst.clone();
    copy_pages_tiers(
        &g,
        &KvTier::Elem { k: &sk, v: &sv },
        &src_ids,
        dst.tier_mut(),
        &dst_ids,
        Some(&valid),
    )
    .unwrap();
    // Equal to quantize_kv8 over the same source pages.
    let pe = g.page_elems();
    let pick = |x: &[T]| {
        src_ids
            .iter()
            .flat_map(|&s| x[s as usize * pe..(s as usize + 1) * pe].to_vec())
            .collect::<Vec<T>>()
    };
    let h = g.num_kv_heads;
    for (src, codes, scales) in [(pick(&sk), &dst.k, &dst.ks), (pick(&sv), &dst.v, &dst.vs)] {
        let mut qc = vec![0u8; src.len()];
        let mut qs = vec![0.0f32; src_ids.len() * h];
        quantize_kv8(&g, &src, &valid, &mut qc, &mut qs).unwrap();
        for (i, &t) in dst_ids.iter().enumerate() {
            assert_eq!(
                &codes[t as usize * pe..(t as usize + 1) * pe],
                &qc[i * pe..(i + 1) * pe]
            );
            assert_eq!(
                &scales[t as usize * h..(t as usize + 1) * h],
                &qs[i * h..(i + 1) * h]
            );
            // And to the reference.
            for hh in 0..h {
                let at = i * pe + hh * g.entry_elems();
                let rows: Vec<f64> = src[at..at + valid[i] as usize * g.head_dim]
                    .iter()
                    .map(|x| f64::from(x.to_f32()))
                    .collect();
                let (want, e) = kv8_ref::quantize_block(&rows, g.entry_elems());
                assert_eq!(&qc[at..at + g.entry_elems()], &want[..]);
                assert_eq!(f64::from(qs[i * h + hh]), 2f64.powi(e));
            }
        }
    }
    for e in [2 * h, 3 * h] {
        assert_eq!(dst.entry(&g, e), before.entry(&g, e));
    }
}

#[test]
fn copy_pages_elem_to_kv8_is_quantize_kv8() {
    copy_elem_to_kv8::<f32>();
    copy_elem_to_kv8::<bf16>();
    copy_elem_to_kv8::<half::f16>();
}

#[test]
fn copy_pages_elem_to_elem_is_copy_pages() {
    let g = geo();
    let mut rng = Rng(7);
    let s: Vec<f32> = (0..3 * g.page_elems()).map(|_| rng.f32()).collect();
    let mut a = vec![0.0f32; 4 * g.page_elems()];
    let (mut av, mut b, mut bv) = (a.clone(), a.clone(), a.clone());
    copy_pages_tiers(
        &g,
        &KvTier::Elem { k: &s, v: &s },
        &[2, 1],
        KvTierMut::Elem {
            k: &mut a,
            v: &mut av,
        },
        &[3, 0],
        Some(&[1, 1]),
    )
    .unwrap();
    copy_pages(&g, &s, &s, &[2, 1], &mut b, &mut bv, &[3, 0]).unwrap();
    assert_eq!((a, av), (b, bv));
}

#[test]
fn kv8_copy_errors_write_nothing() {
    let g = geo();
    let mut rng = Rng(8);
    let src = Pool8::random(&g, 3, &mut rng);
    let mut dst = Pool8::random(&g, 2, &mut rng);
    let before = dst.clone();
    let elem = vec![0.5f32; 3 * g.page_elems()];
    let shape = |r: Result<(), OasisError>, what: &str| match r {
        Err(OasisError::Shape { what: w, .. }) => assert_eq!(w, what),
        other => panic!("expected shape error for {what}, got {other:?}"),
    };
    let bad_src = Kv8Pages {
        k_scales: &src.ks[1..],
        k_codes: &src.k,
        v_codes: &src.v,
        v_scales: &src.vs,
    };
    shape(
        copy_pages_tiers::<f32>(&g, &KvTier::Kv8(bad_src), &[0], dst.tier_mut(), &[0], None),
        "src_k_scales",
    );
    {
        let Pool8 { k, v, ks, vs } = &mut dst;
        let bad = KvTierMut::Kv8(Kv8PagesMut {
            k_codes: k,
            v_codes: v,
            k_scales: ks,
            v_scales: &mut vs[1..],
        });
        shape(
            copy_pages_tiers::<f32>(&g, &src.tier(), &[0], bad, &[0], None),
            "dst_v_scales",
        );
    }
    let e = KvTier::Elem { k: &elem, v: &elem };
    shape(
        copy_pages_tiers(&g, &e, &[0, 1], dst.tier_mut(), &[0, 1], Some(&[1])),
        "valid",
    );
    for bad in [0, 5, -1] {
        let r = copy_pages_tiers(&g, &e, &[0, 1], dst.tier_mut(), &[0, 1], Some(&[1, bad]));
        assert!(matches!(r, Err(OasisError::Invalid(_))), "{r:?}");
    }
    let r = copy_pages_tiers(&g, &e, &[0, 3], dst.tier_mut(), &[0, 1], None);
    assert!(matches!(
        r,
        Err(OasisError::IndexOutOfRange {
            what: "src_ids",
            index: 3,
            bound: 3
        })
    ));
    let r = copy_pages_tiers::<f32>(&g, &src.tier(), &[0], dst.tier_mut(), &[2], None);
    assert!(matches!(
        r,
        Err(OasisError::IndexOutOfRange {
            what: "dst_ids",
            index: 2,
            bound: 2
        })
    ));
    // gather: a host pool with short scales, an out-of-range host block.
    let p = plan();
    let host = Pool8::random(&g, 5, &mut rng);
    let mut gpu = Pool8::random(&g, 4, &mut rng);
    let gpu_before = gpu.clone();
    let short = Kv8Pages {
        v_scales: &host.vs[2..],
        ..match host.tier::<f32>() {
            KvTier::Kv8(p) => p,
            _ => unreachable!(),
        }
    };
    let r = gather_blocks_tiers::<f32>(
        &g,
        &p.slots,
        &p.blocks,
        2,
        &p.slot_pages,
        2,
        &p.indptr,
        &p.indices,
        &KvTier::Kv8(short),
        gpu.tier_mut(),
    );
    shape(r.map(|_| ()), "host_v_scales");
    let bad_idx = [4, 1, 3, 0, 5];
    let r = gather_blocks_tiers::<f32>(
        &g,
        &p.slots,
        &p.blocks,
        2,
        &p.slot_pages,
        2,
        &p.indptr,
        &bad_idx,
        &host.tier(),
        gpu.tier_mut(),
    );
    assert!(matches!(
        r,
        Err(OasisError::IndexOutOfRange {
            what: "host_indices",
            index: 5,
            ..
        })
    ));
    assert_eq!(gpu, gpu_before);
    assert_eq!(dst, before);
}
