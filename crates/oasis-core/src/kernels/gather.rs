//! Bit-exact copies between the host pool and the GPU pool: the gather that executes a selection
//! plan (block-head entries, host -> GPU slots) and whole-page copies (dense pages -> host blocks
//! when a request turns sparse). Either side may be kv8 pages (`*_tiers`): then a copy between
//! kv8 pools is still bit-exact, and one between a `T` pool and a kv8 pool (de)quantizes.

use crate::dtype::KvElem;
use crate::error::{check_len, Result};
use crate::geometry::KvGeometry;
use crate::kernels::kv8::{
    copy_entry, e4m3_table, KvTier, KvTierMut, TierNames, GPU_NAMES, HOST_NAMES,
};
use crate::kernels::validate::{all_indices, csr, csr_range, index, length, plan_shape};

/// Execute a selection plan: for every plan entry (s, h, i) with `plan_slots >= 0`, copy the
/// block-head entry (host block `host_indices[host_indptr[s] + plan_blocks[s,h,i]]`, head h) of
/// `host_k`/`host_v` into (`slot_pages[s, plan_slots[s,h,i]]`, head h) of `k_pages`/`v_pages`.
/// Bit-exact. Returns the number of block-head entries copied.
///
/// The number of sequences is `host_indptr.len() - 1`. Every `slot_pages` and `host_indices`
/// entry is checked, used or not; plan entries with a negative slot are skipped (their block is
/// not looked at).
///
/// # Errors
/// * [`OasisError::Shape`](crate::OasisError::Shape) for a buffer of the wrong size;
/// * [`OasisError::Invalid`](crate::OasisError::Invalid) for a malformed `host_indptr`;
/// * [`OasisError::IndexOutOfRange`](crate::OasisError::IndexOutOfRange) for a plan slot `>= budget`, a plan block outside its
///   sequence's logical blocks (negative included), a `slot_pages` entry outside the GPU pool or a
///   `host_indices` entry outside the host pool.
///
/// Nothing is written when an error is returned.
#[allow(clippy::too_many_arguments)]
pub fn gather_blocks<T: KvElem>(
    geo: &KvGeometry,
    plan_slots: &[i32],
    plan_blocks: &[i32], // [num_seqs, num_kv_heads, fetch_cap]
    fetch_cap: usize,
    slot_pages: &[i32],
    budget: usize, // [num_seqs, budget]
    host_indptr: &[i32],
    host_indices: &[i32], // CSR: host block of each logical block of seq s
    host_k: &[T],
    host_v: &[T], // [num_host_blocks, num_kv_heads, block_size, head_dim]
    k_pages: &mut [T],
    v_pages: &mut [T], // [num_pages, num_kv_heads, block_size, head_dim]
) -> Result<usize> {
    gather_blocks_tiers(
        geo,
        plan_slots,
        plan_blocks,
        fetch_cap,
        slot_pages,
        budget,
        host_indptr,
        host_indices,
        &KvTier::Elem {
            k: host_k,
            v: host_v,
        },
        KvTierMut::Elem {
            k: k_pages,
            v: v_pages,
        },
    )
}

/// [`gather_blocks`] with each tier `T` pages or kv8 pages ([`crate::kernels::kv8`]): kv8 -> kv8
/// copies the codes and the entry's K and V scales bit-exact, kv8 -> `T` dequantizes
/// (`T::from_f32(e4m3_decode(code) * scale)`), `T` -> kv8 quantizes the whole block (every row
/// valid: only complete blocks live in the host pool), `T` -> `T` is [`gather_blocks`].
///
/// # Errors
/// As [`gather_blocks`]; a kv8 tier's scales of the wrong size are a
/// [`OasisError::Shape`](crate::OasisError::Shape) (`host_k_scales`, `host_v_scales`, `k_scales`,
/// `v_scales`). Nothing is written when an error is returned.
#[allow(clippy::too_many_arguments)]
pub fn gather_blocks_tiers<T: KvElem>(
    geo: &KvGeometry,
    plan_slots: &[i32],
    plan_blocks: &[i32], // [num_seqs, num_kv_heads, fetch_cap]
    fetch_cap: usize,
    slot_pages: &[i32],
    budget: usize, // [num_seqs, budget]
    host_indptr: &[i32],
    host_indices: &[i32],  // CSR: host block of each logical block of seq s
    host: &KvTier<T>,      // [num_host_blocks, num_kv_heads, block_size, head_dim]
    mut gpu: KvTierMut<T>, // [num_pages, num_kv_heads, block_size, head_dim]
) -> Result<usize> {
    geo.validate()?;
    let h_kv = geo.num_kv_heads;
    let num_seqs = csr(
        "host_indptr",
        host_indptr,
        "host_indices",
        host_indices.len(),
    )?;
    plan_shape(
        plan_slots.len(),
        plan_blocks.len(),
        [num_seqs, h_kv, fetch_cap],
    )?;
    check_len("slot_pages", slot_pages.len(), &[num_seqs, budget])?;
    let num_host = host.num_pages(geo, &HOST_NAMES)?;
    let num_pages = gpu.num_pages(geo, &GPU_NAMES)?;
    all_indices("slot_pages", slot_pages, num_pages)?;
    all_indices("host_indices", host_indices, num_host)?;
    for s in 0..num_seqs {
        let nblocks = csr_range(host_indptr, s).len();
        let plan = s * h_kv * fetch_cap..(s + 1) * h_kv * fetch_cap;
        for (&slot, &blk) in plan_slots[plan.clone()].iter().zip(&plan_blocks[plan]) {
            if slot >= 0 {
                index("plan_slots", slot, budget)?;
                index("plan_blocks", blk, nblocks)?;
            }
        }
    }

    let table = e4m3_table();
    let mut copied = 0;
    for s in 0..num_seqs {
        let logical = &host_indices[csr_range(host_indptr, s)];
        for h in 0..h_kv {
            let plan = (s * h_kv + h) * fetch_cap..(s * h_kv + h + 1) * fetch_cap;
            for (&slot, &blk) in plan_slots[plan.clone()].iter().zip(&plan_blocks[plan]) {
                if slot < 0 {
                    continue;
                }
                // All validated above.
                let page = slot_pages[s * budget + slot as usize] as usize;
                let hb = logical[blk as usize] as usize;
                let (src, dst) = (hb * h_kv + h, page * h_kv + h);
                copy_entry(geo, host, src, &mut gpu, dst, geo.block_size, &table);
                copied += 1;
            }
        }
    }
    Ok(copied)
}

/// Whole-page copy between two pools of the same page geometry (dense pages -> host blocks when a
/// request turns sparse). `src_ids[i] -> dst_ids[i]`, all heads, K and V, bit-exact. A destination
/// listed twice receives the later source.
///
/// # Errors
/// * [`OasisError::Shape`](crate::OasisError::Shape) for a pool of the wrong size or `dst_ids` not as long as `src_ids`;
/// * [`OasisError::IndexOutOfRange`](crate::OasisError::IndexOutOfRange) for an id outside its pool (negative included).
///
/// Nothing is written when an error is returned.
pub fn copy_pages<T: KvElem>(
    geo: &KvGeometry,
    src_k: &[T],
    src_v: &[T],
    src_ids: &[i32],
    dst_k: &mut [T],
    dst_v: &mut [T],
    dst_ids: &[i32],
) -> Result<()> {
    copy_pages_tiers(
        geo,
        &KvTier::Elem { k: src_k, v: src_v },
        src_ids,
        KvTierMut::Elem { k: dst_k, v: dst_v },
        dst_ids,
        None,
    )
}

/// [`copy_pages`] with each pool `T` pages or kv8 pages ([`crate::kernels::kv8`]): `T` -> `T` and
/// kv8 -> kv8 copy whole pages bit-exact (codes and scales), kv8 -> `T` dequantizes whole pages,
/// `T` -> kv8 quantizes each (page, head) over the page's first `valid[i]` rows (the last, partial
/// page of a request; `None`: every page full) and writes the rows past them as code 0, exactly as
/// [`crate::kernels::quantize_kv8`]. `valid` is read only for `T` -> kv8.
///
/// # Errors
/// As [`copy_pages`]; also [`OasisError::Shape`](crate::OasisError::Shape) for kv8 scales
/// (`src_k_scales`, ..., `dst_v_scales`) or `valid` of the wrong size, and
/// [`OasisError::Invalid`](crate::OasisError::Invalid) for a `valid` entry outside
/// `1..=block_size`. Nothing is written when an error is returned.
pub fn copy_pages_tiers<T: KvElem>(
    geo: &KvGeometry,
    src: &KvTier<T>,       // [num_src, num_kv_heads, block_size, head_dim]
    src_ids: &[i32],       // [n]
    mut dst: KvTierMut<T>, // [num_dst, num_kv_heads, block_size, head_dim]
    dst_ids: &[i32],       // [n]
    valid: Option<&[i32]>, // [n] rows of src page i, 1..=block_size; None: all
) -> Result<()> {
    const SRC: TierNames = TierNames {
        k: "src_k",
        v: "src_v",
        k_scales: "src_k_scales",
        v_scales: "src_v_scales",
    };
    const DST: TierNames = TierNames {
        k: "dst_k",
        v: "dst_v",
        k_scales: "dst_k_scales",
        v_scales: "dst_v_scales",
    };
    geo.validate()?;
    let (h_kv, bs) = (geo.num_kv_heads, geo.block_size);
    let num_src = src.num_pages(geo, &SRC)?;
    let num_dst = dst.num_pages(geo, &DST)?;
    check_len("dst_ids", dst_ids.len(), &[src_ids.len()])?;
    all_indices("src_ids", src_ids, num_src)?;
    all_indices("dst_ids", dst_ids, num_dst)?;
    if let Some(valid) = valid {
        check_len("valid", valid.len(), &[src_ids.len()])?;
        for (i, &v) in valid.iter().enumerate() {
            length("valid", i, v, bs)?;
        }
    }
    let table = e4m3_table();
    for (i, (&s, &t)) in src_ids.iter().zip(dst_ids).enumerate() {
        let (s, t) = (s as usize, t as usize); // validated
        let rows = valid.map_or(bs, |v| v[i] as usize);
        for h in 0..h_kv {
            copy_entry(geo, src, s * h_kv + h, &mut dst, t * h_kv + h, rows, &table);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::OasisError;
    use half::f16;

    fn geo() -> KvGeometry {
        KvGeometry::new(4, 2, 3, 2).unwrap()
    }

    fn pool(g: &KvGeometry, n: usize, base: f32) -> Vec<f16> {
        (0..n * g.page_elems())
            .map(|i| f16::from_f32(base + i as f32))
            .collect()
    }

    #[test]
    fn gather_copies_planned_entries_only() {
        let g = geo();
        let e = g.entry_elems();
        let host_k = pool(&g, 5, 0.0);
        let host_v = pool(&g, 5, 1000.0);
        let mut kp = pool(&g, 4, -500.0);
        let mut vp = pool(&g, 4, -900.0);
        let (kp0, vp0) = (kp.clone(), vp.clone());
        // Two seqs; seq 0 has logical blocks on host [4, 1, 3], seq 1 [0, 2].
        let indptr = [0, 3, 5];
        let indices = [4, 1, 3, 0, 2];
        // budget 2: seq 0 slots in pages [3, 0], seq 1 in [1, 2]. fetch_cap 2.
        let slot_pages = [3, 0, 1, 2];
        // plan[s][h][i]
        let plan_slots = [1, -1, 0, 1, /* seq 1 */ -1, -1, 1, -1];
        let plan_blocks = [2, 9, 0, 1, /* seq 1 */ 5, -3, 0, -1];
        let n = gather_blocks(
            &g,
            &plan_slots,
            &plan_blocks,
            2,
            &slot_pages,
            2,
            &indptr,
            &indices,
            &host_k,
            &host_v,
            &mut kp,
            &mut vp,
        )
        .unwrap();
        assert_eq!(n, 4);
        let entry = |buf: &[f16], page: usize, h: usize| {
            buf[(page * 2 + h) * e..(page * 2 + h + 1) * e].to_vec()
        };
        // (page, head) <- (host block, head)
        let moved = [((0, 0), 3), ((3, 1), 4), ((0, 1), 1), ((2, 1), 0)];
        for (page, h) in (0..4).flat_map(|p| (0..2).map(move |h| (p, h))) {
            match moved.iter().find(|&&(at, _)| at == (page, h)) {
                Some(&(_, hb)) => {
                    assert_eq!(entry(&kp, page, h), entry(&host_k, hb, h));
                    assert_eq!(entry(&vp, page, h), entry(&host_v, hb, h));
                }
                None => {
                    assert_eq!(entry(&kp, page, h), entry(&kp0, page, h));
                    assert_eq!(entry(&vp, page, h), entry(&vp0, page, h));
                }
            }
        }
    }

    #[test]
    fn gather_validation() {
        let g = geo();
        let host = pool(&g, 3, 0.0);
        let mut kp = pool(&g, 2, 0.0);
        let mut vp = kp.clone();
        let kp0 = kp.clone();
        let ps = [0, 1];
        let pb = [0, 0];
        let mut run = |ps: &[i32],
                       pb: &[i32],
                       cap: usize,
                       slots: &[i32],
                       budget: usize,
                       indptr: &[i32],
                       idx: &[i32]| {
            let r = gather_blocks(
                &g, ps, pb, cap, slots, budget, indptr, idx, &host, &host, &mut kp, &mut vp,
            );
            assert_eq!(kp, kp0);
            r
        };
        let ok = run(&ps, &pb, 3, &[0, 1], 2, &[0, 2], &[0, 1]);
        assert!(
            matches!(
                ok,
                Err(OasisError::Shape {
                    what: "plan_slots",
                    ..
                })
            ),
            "{ok:?}"
        );
        let r = run(&[0, 2], &pb, 1, &[0, 1], 2, &[0, 2], &[0, 1]);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "plan_slots",
                index: 2,
                bound: 2
            })
        ));
        let r = run(&ps, &[0, 2], 1, &[0, 1], 2, &[0, 2], &[0, 1]);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "plan_blocks",
                index: 2,
                bound: 2
            })
        ));
        let r = run(&ps, &[-1, 0], 1, &[0, 1], 2, &[0, 2], &[0, 1]);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "plan_blocks",
                index: -1,
                ..
            })
        ));
        let r = run(&ps, &pb, 1, &[0, 2], 2, &[0, 2], &[0, 1]);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "slot_pages",
                index: 2,
                ..
            })
        ));
        let r = run(&ps, &pb, 1, &[0, 1], 2, &[0, 2], &[0, 3]);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "host_indices",
                index: 3,
                ..
            })
        ));
        let r = run(&ps, &pb, 1, &[0, 1], 2, &[0, 3], &[0, 1]);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "host_indices",
                ..
            })
        ));
        let r = run(&ps, &pb, 1, &[0], 2, &[0, 2], &[0, 1]);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "slot_pages",
                ..
            })
        ));
        let r = run(&ps, &pb[..1], 1, &[0, 1], 2, &[0, 2], &[0, 1]);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "plan_blocks",
                ..
            })
        ));
        let r = run(&ps, &pb, 1, &[0, 1], 2, &[2, 2], &[0, 1]);
        assert!(matches!(r, Err(OasisError::Invalid(_))));
        // Skipped entries are not checked.
        assert_eq!(
            run(&[-1, -1], &[77, -5], 1, &[0, 1], 2, &[0, 2], &[0, 1]),
            Ok(0)
        );
        assert_eq!(run(&[], &[], 0, &[], 0, &[0], &[]), Ok(0));
        let mut small = pool(&g, 2, 0.0);
        small.pop();
        let r = gather_blocks(
            &g,
            &ps,
            &pb,
            1,
            &[0, 1],
            2,
            &[0, 2],
            &[0, 1],
            &host,
            &host,
            &mut small,
            &mut vp,
        );
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "k_pages",
                ..
            })
        ));
        let r = gather_blocks(
            &g,
            &ps,
            &pb,
            1,
            &[0, 1],
            2,
            &[0, 2],
            &[0, 1],
            &host,
            &host[1..],
            &mut vp,
            &mut kp,
        );
        assert!(matches!(r, Err(OasisError::Shape { what: "host_v", .. })));
    }

    #[test]
    fn copy_pages_whole_pages_and_validation() {
        let g = geo();
        let p = g.page_elems();
        let sk = pool(&g, 3, 0.0);
        let sv = pool(&g, 3, 100.0);
        let mut dk = pool(&g, 4, -50.0);
        let mut dv = pool(&g, 4, -80.0);
        let (dk0, dv0) = (dk.clone(), dv.clone());
        copy_pages(&g, &sk, &sv, &[2, 0], &mut dk, &mut dv, &[0, 3]).unwrap();
        assert_eq!(&dk[..p], &sk[2 * p..3 * p]);
        assert_eq!(&dv[3 * p..], &sv[..p]);
        assert_eq!(&dk[p..3 * p], &dk0[p..3 * p]);
        assert_eq!(&dv[p..3 * p], &dv0[p..3 * p]);

        let before = (dk.clone(), dv.clone());
        let r = copy_pages(&g, &sk, &sv, &[0, 3], &mut dk, &mut dv, &[0, 1]);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "src_ids",
                index: 3,
                bound: 3
            })
        ));
        let r = copy_pages(&g, &sk, &sv, &[0, 1], &mut dk, &mut dv, &[0, -1]);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "dst_ids",
                index: -1,
                ..
            })
        ));
        let r = copy_pages(&g, &sk, &sv, &[0, 1], &mut dk, &mut dv, &[0]);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "dst_ids",
                ..
            })
        ));
        let r = copy_pages(&g, &sk, &sv[1..], &[0], &mut dk, &mut dv, &[0]);
        assert!(matches!(r, Err(OasisError::Shape { what: "src_v", .. })));
        let r = copy_pages(&g, &sk[1..], &sv, &[0], &mut dk, &mut dv, &[0]);
        assert!(matches!(r, Err(OasisError::Shape { what: "src_k", .. })));
        let r = copy_pages(&g, &sk, &sv, &[0], &mut dk[1..], &mut dv, &[0]);
        assert!(matches!(r, Err(OasisError::Shape { what: "dst_k", .. })));
        let r = copy_pages(&g, &sk, &sv, &[0], &mut dk, &mut dv[1..], &[0]);
        assert!(matches!(r, Err(OasisError::Shape { what: "dst_v", .. })));
        assert_eq!((dk, dv), before);
    }
}
