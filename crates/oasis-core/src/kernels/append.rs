//! Append one decoded token per sequence to its local block, with write-through to the host pool
//! and an incremental summary update for sparse sequences.

use crate::dtype::KvElem;
use crate::error::{check_len, Result};
use crate::geometry::KvGeometry;
use crate::kernels::kv8::{KvTierMut, GPU_NAMES, HOST_NAMES};
use crate::kernels::validate::{index, leading_rows};

/// A sequence whose page id is this stores nothing (a padded row of a captured step, a draft the
/// step rejected): no page, host row or summary is touched, and its other entries are not read.
pub const NO_PAGE: i32 = -1;

/// Append one new token per sequence: write its K,V into `(page_ids[s], page_offsets[s])` of the
/// GPU pool; when `host_block_ids[s] >= 0` also write it through to the same offset of host row
/// `host_rows[s]` (`None`: the row is the block id) and update host block `host_block_ids[s]`'s
/// summary (offset 0 resets `min = max = k`, else elementwise min/max). Dense sequences pass
/// `host_block_ids[s] = -1` (no write-through, no summary; their row is not read).
///
/// Host rows (`host_k`/`host_v`) and host block ids (`summaries`) are separate pools: a block of a
/// staged request has an id (its summary) but a row only while its bytes are cached. The number
/// of pages, of host rows and of host blocks is implied by the buffers. When two sequences name
/// the same slot, the later one wins (the GPU kernel leaves that undefined).
///
/// # Errors
/// * [`OasisError::Shape`](crate::OasisError::Shape) when a buffer does not match its shape;
/// * [`OasisError::IndexOutOfRange`](crate::OasisError::IndexOutOfRange) when a page id, an offset,
///   a host block id or the host row of a write-through is out of range (any negative host block
///   id means dense).
///
/// Nothing is written when an error is returned.
#[allow(clippy::too_many_arguments)]
pub fn append_kv<T: KvElem>(
    geo: &KvGeometry,
    k_new: &[T],
    v_new: &[T],               // [num_seqs, num_kv_heads, head_dim]
    page_ids: &[i32],          // [num_seqs]
    page_offsets: &[i32],      // [num_seqs] 0..block_size
    host_block_ids: &[i32],    // [num_seqs] -1 = dense
    host_rows: Option<&[i32]>, // [num_seqs] host row of the write-through; None: the id
    k_pages: &mut [T],
    v_pages: &mut [T], // [num_pages, num_kv_heads, block_size, head_dim]
    host_k: &mut [T],
    host_v: &mut [T],    // [num_host_rows, num_kv_heads, block_size, head_dim]
    summaries: &mut [T], // [num_host_blocks, num_kv_heads, 2, head_dim]
) -> Result<()> {
    append_kv_tiers(
        geo,
        k_new,
        v_new,
        page_ids,
        page_offsets,
        host_block_ids,
        host_rows,
        KvTierMut::Elem {
            k: k_pages,
            v: v_pages,
        },
        KvTierMut::Elem {
            k: host_k,
            v: host_v,
        },
        summaries,
    )
}

/// [`append_kv`] with each tier `T` pages or kv8 pages ([`crate::kernels::kv8`]): a `T` tier
/// receives the row as is, a kv8 tier by the incremental append (a scale that grows first
/// requantizes the rows before the offset). The summary always comes from the unquantized `k_new`.
/// With both tiers [`KvTierMut::Elem`] this is [`append_kv`], bit for bit.
///
/// # Errors
/// As [`append_kv`]; a kv8 tier's scales of the wrong size are a
/// [`OasisError::Shape`](crate::OasisError::Shape) (`k_scales`, `v_scales`, `host_k_scales`,
/// `host_v_scales`; the codes go by the pages' names). Nothing is written when an error is
/// returned.
#[allow(clippy::too_many_arguments)]
pub fn append_kv_tiers<T: KvElem>(
    geo: &KvGeometry,
    k_new: &[T],
    v_new: &[T],               // [num_seqs, num_kv_heads, head_dim]
    page_ids: &[i32],          // [num_seqs]
    page_offsets: &[i32],      // [num_seqs] 0..block_size
    host_block_ids: &[i32],    // [num_seqs] -1 = dense
    host_rows: Option<&[i32]>, // [num_seqs] host row of the write-through; None: the id
    mut gpu: KvTierMut<T>,     // [num_pages, num_kv_heads, block_size, head_dim]
    mut host: KvTierMut<T>,    // [num_host_rows, num_kv_heads, block_size, head_dim]
    summaries: &mut [T],       // [num_host_blocks, num_kv_heads, 2, head_dim]
) -> Result<()> {
    geo.validate()?;
    let (h_kv, d) = (geo.num_kv_heads, geo.head_dim);
    let bs = geo.block_size;
    let num_seqs = page_ids.len();
    check_len("k_new", k_new.len(), &[num_seqs, h_kv, d])?;
    check_len("v_new", v_new.len(), &[num_seqs, h_kv, d])?;
    check_len("page_offsets", page_offsets.len(), &[num_seqs])?;
    check_len("host_block_ids", host_block_ids.len(), &[num_seqs])?;
    let num_pages = gpu.num_pages(geo, &GPU_NAMES)?;
    let num_rows = host.num_pages(geo, &HOST_NAMES)?;
    let num_host = leading_rows("summaries", summaries.len(), &[h_kv, 2, d])?;
    if let Some(rows) = host_rows {
        check_len("host_rows", rows.len(), &[num_seqs])?;
    }
    let row_of = |s: usize| host_rows.map_or(host_block_ids[s], |r| r[s]);
    for s in 0..num_seqs {
        if page_ids[s] == NO_PAGE {
            continue;
        }
        index("page_ids", page_ids[s], num_pages)?;
        index("page_offsets", page_offsets[s], bs)?;
        if host_block_ids[s] >= 0 {
            index("host_block_ids", host_block_ids[s], num_host)?;
            index("host_rows", row_of(s), num_rows)?;
        }
    }

    for s in 0..num_seqs {
        if page_ids[s] == NO_PAGE {
            continue;
        }
        // Validated above: these casts are of in-range, non-negative values.
        let page = page_ids[s] as usize;
        let off = page_offsets[s] as usize;
        for h in 0..h_kv {
            let src = (s * h_kv + h) * d..(s * h_kv + h + 1) * d;
            let (k, v) = (&k_new[src.clone()], &v_new[src]);
            gpu.append_row(geo, page * h_kv + h, off, k, v);
            if host_block_ids[s] < 0 {
                continue;
            }
            let blk = host_block_ids[s] as usize;
            let row = row_of(s) as usize;
            host.append_row(geo, row * h_kv + h, off, k, v);
            let sum = (blk * h_kv + h) * 2 * d;
            let (mins, maxs) = summaries[sum..sum + 2 * d].split_at_mut(d);
            if off == 0 {
                mins.copy_from_slice(k);
                maxs.copy_from_slice(k);
            } else {
                super::summary::fold_min_max(mins, maxs, k);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::OasisError;
    use half::bf16;

    fn geo() -> KvGeometry {
        KvGeometry::new(4, 2, 3, 4).unwrap()
    }

    struct Bufs {
        kp: Vec<f32>,
        vp: Vec<f32>,
        hk: Vec<f32>,
        hv: Vec<f32>,
        sm: Vec<f32>,
    }

    fn bufs(g: &KvGeometry, pages: usize, host: usize) -> Bufs {
        Bufs {
            kp: vec![0.0; pages * g.page_elems()],
            vp: vec![0.0; pages * g.page_elems()],
            hk: vec![0.0; host * g.page_elems()],
            hv: vec![0.0; host * g.page_elems()],
            sm: vec![0.0; host * g.num_kv_heads * 2 * g.head_dim],
        }
    }

    fn run(
        g: &KvGeometry,
        b: &mut Bufs,
        k: &[f32],
        v: &[f32],
        p: &[i32],
        o: &[i32],
        hb: &[i32],
    ) -> Result<()> {
        append_kv(
            g, k, v, p, o, hb, None, &mut b.kp, &mut b.vp, &mut b.hk, &mut b.hv, &mut b.sm,
        )
    }

    #[test]
    fn writes_pages_host_and_summaries() {
        let g = geo();
        let (h_kv, bs, d) = (g.num_kv_heads, g.block_size, g.head_dim);
        let mut b = bufs(&g, 3, 2);
        // Seq 0 sparse (page 2, host block 1), seq 1 dense (page 0).
        let mut tokens = Vec::new();
        for t in 0..3 {
            let k: Vec<f32> = (0..2 * h_kv * d)
                .map(|i| ((i * 7 + t * 5) % 11) as f32 - 5.0)
                .collect();
            let v: Vec<f32> = k.iter().map(|x| x * 0.5 + 1.0).collect();
            run(&g, &mut b, &k, &v, &[2, 0], &[t as i32, t as i32], &[1, -1]).unwrap();
            tokens.push(k.clone());
            for s in 0..2 {
                let page = [2, 0][s];
                for h in 0..h_kv {
                    for x in 0..d {
                        let at = ((page * h_kv + h) * bs + t) * d + x;
                        assert_eq!(b.kp[at], k[(s * h_kv + h) * d + x]);
                        assert_eq!(b.vp[at], v[(s * h_kv + h) * d + x]);
                    }
                }
            }
        }
        // Host block 1 holds seq 0's tokens, host block 0 untouched (seq 1 is dense).
        for h in 0..h_kv {
            for (t, k) in tokens.iter().enumerate() {
                for x in 0..d {
                    let at = ((h_kv + h) * bs + t) * d + x;
                    assert_eq!(b.hk[at], k[h * d + x]);
                    assert_eq!(b.hk[at], b.kp[((2 * h_kv + h) * bs + t) * d + x]);
                    assert_eq!(b.hv[at], b.vp[((2 * h_kv + h) * bs + t) * d + x]);
                }
            }
            for x in 0..d {
                let col: Vec<f32> = tokens.iter().map(|k| k[h * d + x]).collect();
                let mn = col.iter().copied().fold(f32::INFINITY, f32::min);
                let mx = col.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(b.sm[((h_kv + h) * 2) * d + x], mn);
                assert_eq!(b.sm[((h_kv + h) * 2 + 1) * d + x], mx);
            }
        }
        assert!(b.hk[..g.page_elems()].iter().all(|&x| x == 0.0));
        assert!(b.sm[..h_kv * 2 * d].iter().all(|&x| x == 0.0));

        // Offset 0 resets the summary to the new key.
        let k = vec![9.0; 2 * h_kv * d];
        run(&g, &mut b, &k, &k, &[2, 0], &[0, 1], &[1, -1]).unwrap();
        assert!(b.sm[h_kv * 2 * d..].iter().all(|&x| x == 9.0));
    }

    #[test]
    fn rows_apart_from_ids() {
        // Host pool of 1 row, summaries of 3 blocks: block 2 written through to row 0.
        let g = geo();
        let (h_kv, d) = (g.num_kv_heads, g.head_dim);
        let mut b = bufs(&g, 1, 1);
        b.sm = vec![0.0f32; 3 * h_kv * 2 * d];
        let k: Vec<f32> = (0..h_kv * d).map(|i| i as f32 + 1.0).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        let call = |b: &mut Bufs, rows: &[i32]| {
            append_kv(
                &g,
                &k,
                &v,
                &[0],
                &[0],
                &[2],
                Some(rows),
                &mut b.kp,
                &mut b.vp,
                &mut b.hk,
                &mut b.hv,
                &mut b.sm,
            )
        };
        call(&mut b, &[0]).unwrap();
        assert_eq!(b.hk, b.kp);
        assert_eq!(b.hv, b.vp);
        let blk2 = 2 * h_kv * 2 * d;
        assert!(b.sm[..blk2].iter().all(|&x| x == 0.0));
        for h in 0..h_kv {
            for x in 0..d {
                assert_eq!(b.sm[blk2 + (h * 2) * d + x], k[h * d + x]);
                assert_eq!(b.sm[blk2 + (h * 2 + 1) * d + x], k[h * d + x]);
            }
        }
        // Row 1 is past the pool; the wrong number of rows is a shape error; nothing written.
        let mut b = bufs(&g, 1, 1);
        b.sm = vec![0.0f32; 3 * h_kv * 2 * d];
        assert!(matches!(
            call(&mut b, &[1]),
            Err(OasisError::IndexOutOfRange {
                what: "host_rows",
                index: 1,
                ..
            })
        ));
        assert!(matches!(
            call(&mut b, &[]),
            Err(OasisError::Shape {
                what: "host_rows",
                ..
            })
        ));
        assert!(b.sm.iter().chain(&b.hk).chain(&b.kp).all(|&x| x == 0.0));
    }

    #[test]
    fn bf16_is_bit_exact() {
        let g = geo();
        let n = g.page_elems();
        let k: Vec<bf16> = (0..g.num_kv_heads * g.head_dim)
            .map(|i| bf16::from_f32(i as f32 * 0.1))
            .collect();
        let mut kp = vec![bf16::ZERO; n];
        let mut vp = vec![bf16::ZERO; n];
        let mut hk = vec![bf16::ZERO; n];
        let mut hv = vec![bf16::ZERO; n];
        let mut sm = vec![bf16::ZERO; 2 * g.num_kv_heads * g.head_dim];
        append_kv(
            &g,
            &k,
            &k,
            &[0],
            &[3],
            &[0],
            None,
            &mut kp,
            &mut vp,
            &mut hk,
            &mut hv,
            &mut sm,
        )
        .unwrap();
        assert_eq!(kp, hk);
        assert_eq!(vp, hv);
        assert_eq!(&kp[3 * g.head_dim..4 * g.head_dim], &k[..g.head_dim]);
    }

    #[test]
    fn validation_errors_leave_outputs_untouched() {
        let g = geo();
        let nk = g.num_kv_heads * g.head_dim;
        let k1 = vec![1.0; nk];
        let k2 = vec![1.0; 2 * nk];
        let mut b = bufs(&g, 2, 1);
        let shape = |r: Result<()>, what: &str| match r {
            Err(OasisError::Shape { what: w, .. }) => assert_eq!(w, what),
            other => panic!("expected shape error for {what}, got {other:?}"),
        };
        let oob = |r: Result<()>, what: &str, index: i64| match r {
            Err(OasisError::IndexOutOfRange {
                what: w, index: i, ..
            }) => assert_eq!((w, i), (what, index)),
            other => panic!("expected index error for {what}, got {other:?}"),
        };
        shape(run(&g, &mut b, &k2, &k1, &[0], &[0], &[0]), "k_new");
        shape(run(&g, &mut b, &k1, &k2, &[0], &[0], &[0]), "v_new");
        shape(
            run(&g, &mut b, &k1, &k1, &[0], &[0, 1], &[0]),
            "page_offsets",
        );
        shape(run(&g, &mut b, &k1, &k1, &[0], &[0], &[]), "host_block_ids");
        oob(run(&g, &mut b, &k1, &k1, &[2], &[0], &[0]), "page_ids", 2);
        oob(run(&g, &mut b, &k1, &k1, &[-2], &[0], &[0]), "page_ids", -2);
        oob(
            run(&g, &mut b, &k1, &k1, &[0], &[4], &[0]),
            "page_offsets",
            4,
        );
        oob(
            run(&g, &mut b, &k1, &k1, &[0], &[-2], &[0]),
            "page_offsets",
            -2,
        );
        oob(
            run(&g, &mut b, &k1, &k1, &[0], &[0], &[1]),
            "host_block_ids",
            1,
        );
        // A bad second sequence stops the first one's write too.
        oob(
            run(&g, &mut b, &k2, &k2, &[0, 1], &[0, 0], &[0, 5]),
            "host_block_ids",
            5,
        );
        assert!(b
            .kp
            .iter()
            .chain(&b.vp)
            .chain(&b.hk)
            .chain(&b.sm)
            .all(|&x| x == 0.0));

        let mut bad = bufs(&g, 2, 1);
        bad.vp.pop();
        shape(run(&g, &mut bad, &k1, &k1, &[0], &[0], &[0]), "v_pages");
        let mut bad = bufs(&g, 2, 1);
        bad.kp.pop();
        shape(run(&g, &mut bad, &k1, &k1, &[0], &[0], &[0]), "k_pages");
        let mut bad = bufs(&g, 2, 1);
        bad.hv.pop();
        shape(run(&g, &mut bad, &k1, &k1, &[0], &[0], &[0]), "host_v");
        let mut bad = bufs(&g, 2, 1);
        bad.sm.push(0.0);
        shape(run(&g, &mut bad, &k1, &k1, &[0], &[0], &[0]), "summaries");
        // All dense: the host pool may be empty.
        let mut dense = bufs(&g, 2, 0);
        run(&g, &mut dense, &k1, &k1, &[1], &[0], &[-1]).unwrap();
        oob(
            run(&g, &mut dense, &k1, &k1, &[1], &[0], &[0]),
            "host_block_ids",
            0,
        );
    }

    #[test]
    fn bad_geometry_is_an_error() {
        let g = KvGeometry {
            num_qo_heads: 3,
            num_kv_heads: 0,
            head_dim: 4,
            block_size: 4,
        };
        let mut b = bufs(&geo(), 1, 0);
        let r = append_kv::<f32>(
            &g,
            &[],
            &[],
            &[],
            &[],
            &[],
            None,
            &mut b.kp,
            &mut b.vp,
            &mut b.hk,
            &mut b.hv,
            &mut b.sm,
        );
        assert!(matches!(r, Err(OasisError::Config(_))));
    }

    #[test]
    fn no_page_stores_nothing() {
        // Seq 0 has no page (a rejected draft: its other entries name a real slot, even one out
        // of range), seq 1 is sparse: only seq 1 is written, as the GPU kernel skips page < 0.
        let g = geo();
        let (h_kv, bs, d) = (g.num_kv_heads, g.block_size, g.head_dim);
        let mut b = bufs(&g, 2, 2);
        let k: Vec<f32> = (0..2 * h_kv * d).map(|i| i as f32 + 1.0).collect();
        run(&g, &mut b, &k, &k, &[NO_PAGE, 1], &[9, 1], &[0, 1]).unwrap();
        for h in 0..h_kv {
            let at = ((h_kv + h) * bs + 1) * d;
            assert_eq!(&b.kp[at..at + d], &k[(h_kv + h) * d..(h_kv + h + 1) * d]);
            assert_eq!(&b.hk[at..at + d], &k[(h_kv + h) * d..(h_kv + h + 1) * d]);
        }
        let n = g.page_elems();
        assert!(b.kp[..n].iter().chain(&b.hk[..n]).all(|&x| x == 0.0));
        assert!(
            b.sm[..h_kv * 2 * d].iter().all(|&x| x == 0.0),
            "no summary touched"
        );
    }
}
