//! Block summaries (Quest): per host block and KV head, the coordinate-wise min and max of the
//! keys, stored as two rows `[min; max]` in the storage dtype.
//!
//! Min and max of values of type `T` are values of `T`, so summaries are exact in any dtype.
//! Comparisons use `f32::min`/`f32::max` (NaN-ignoring, like CUDA's `fminf`/`fmaxf`).

use crate::dtype::KvElem;
use crate::error::{check_len, Result};
use crate::geometry::KvGeometry;
use crate::kernels::validate::{index, leading_rows, length};

/// Fold one key row into a running `[min; max]` pair.
#[inline]
pub(crate) fn fold_min_max<T: KvElem>(mins: &mut [T], maxs: &mut [T], k: &[T]) {
    for ((mn, mx), &x) in mins.iter_mut().zip(maxs.iter_mut()).zip(k) {
        let xf = x.to_f32();
        *mn = T::from_f32(mn.to_f32().min(xf));
        *mx = T::from_f32(mx.to_f32().max(xf));
    }
}

/// Recompute summaries (min/max over the first `block_lens[i]` tokens) of host blocks
/// `block_ids[i]`, all KV heads, from the keys in host row `block_rows[i]` (`None`: the row is the
/// block id; host rows and host block ids are separate pools, see
/// [`append_kv`](crate::kernels::append_kv)). Listing a block twice recomputes it twice (the later
/// length wins).
///
/// # Errors
/// * [`OasisError::Shape`](crate::OasisError::Shape) for a buffer of the wrong size;
/// * [`OasisError::IndexOutOfRange`](crate::OasisError::IndexOutOfRange) for a block id outside
///   the summaries or a row outside the host pool;
/// * [`OasisError::Invalid`](crate::OasisError::Invalid) for a length outside `1..=block_size`.
///
/// Nothing is written when an error is returned.
pub fn build_summaries<T: KvElem>(
    geo: &KvGeometry,
    host_k: &[T],               // [num_host_rows, num_kv_heads, block_size, head_dim]
    block_ids: &[i32],          // [n]
    block_rows: Option<&[i32]>, // [n] host row of each block; None: the id
    block_lens: &[i32],         // [n] 1..=block_size
    summaries: &mut [T],        // [num_host_blocks, num_kv_heads, 2, head_dim]
) -> Result<()> {
    geo.validate()?;
    let (h_kv, bs, d) = (geo.num_kv_heads, geo.block_size, geo.head_dim);
    let num_rows = leading_rows("host_k", host_k.len(), &[h_kv, bs, d])?;
    let num_host = leading_rows("summaries", summaries.len(), &[h_kv, 2, d])?;
    check_len("block_lens", block_lens.len(), &[block_ids.len()])?;
    if let Some(rows) = block_rows {
        check_len("block_rows", rows.len(), &[block_ids.len()])?;
    }
    let row_of = |i: usize| block_rows.map_or(block_ids[i], |r| r[i]);
    for (i, (&b, &n)) in block_ids.iter().zip(block_lens).enumerate() {
        index("block_ids", b, num_host)?;
        let what = if block_rows.is_some() {
            "block_rows"
        } else {
            "block_ids"
        };
        index(what, row_of(i), num_rows)?;
        length("block_lens", i, n, bs)?;
    }

    let entry = geo.entry_elems();
    for (i, (&b, &n)) in block_ids.iter().zip(block_lens).enumerate() {
        // Validated above.
        let (b, n, r) = (b as usize, n as usize, row_of(i) as usize);
        for h in 0..h_kv {
            let keys = &host_k[(r * h_kv + h) * entry..][..n * d];
            let sum = (b * h_kv + h) * 2 * d;
            let (mins, maxs) = summaries[sum..sum + 2 * d].split_at_mut(d);
            mins.copy_from_slice(&keys[..d]);
            maxs.copy_from_slice(&keys[..d]);
            for k in keys.chunks_exact(d).skip(1) {
                fold_min_max(mins, maxs, k);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::OasisError;
    use half::{bf16, f16};

    fn naive<T: KvElem>(
        g: &KvGeometry,
        host_k: &[T],
        b: usize,
        n: usize,
        h: usize,
        x: usize,
    ) -> (f32, f32) {
        let mut mn = f32::INFINITY;
        let mut mx = f32::NEG_INFINITY;
        for t in 0..n {
            let v = host_k[((b * g.num_kv_heads + h) * g.block_size + t) * g.head_dim + x].to_f32();
            mn = mn.min(v);
            mx = mx.max(v);
        }
        (mn, mx)
    }

    fn check<T: KvElem>() {
        let g = KvGeometry::new(6, 3, 5, 7).unwrap();
        let num_host = 4;
        let host_k: Vec<T> = (0..num_host * g.page_elems())
            .map(|i| T::from_f32(((i * 2654435761usize) % 1000) as f32 / 37.0 - 13.0))
            .collect();
        let mut sm = vec![T::from_f32(-99.0); num_host * g.num_kv_heads * 2 * g.head_dim];
        build_summaries(&g, &host_k, &[3, 0, 1], None, &[7, 1, 4], &mut sm).unwrap();
        for (b, n) in [(3, 7), (0, 1), (1, 4)] {
            for h in 0..g.num_kv_heads {
                for x in 0..g.head_dim {
                    let (mn, mx) = naive(&g, &host_k, b, n, h, x);
                    let at = (b * g.num_kv_heads + h) * 2 * g.head_dim + x;
                    assert_eq!(sm[at].to_f32(), mn);
                    assert_eq!(sm[at + g.head_dim].to_f32(), mx);
                }
            }
        }
        // Block 2 untouched.
        let b2 = 2 * g.num_kv_heads * 2 * g.head_dim;
        assert!(sm[b2..b2 + g.num_kv_heads * 2 * g.head_dim]
            .iter()
            .all(|x| x.to_f32() == -99.0));
    }

    #[test]
    fn matches_naive_all_dtypes() {
        check::<f32>();
        check::<f16>();
        check::<bf16>();
    }

    #[test]
    fn rows_apart_from_ids() {
        // Keys in host rows 2 and 0, summaries of blocks 0 and 3: the same as rows = ids after
        // moving the keys.
        let g = KvGeometry::new(4, 2, 3, 4).unwrap();
        let host_k: Vec<f32> = (0..3 * g.page_elems())
            .map(|i| ((i * 7919) % 113) as f32 - 50.0)
            .collect();
        let per = g.num_kv_heads * 2 * g.head_dim;
        let mut sm = vec![0.0f32; 4 * per];
        build_summaries(&g, &host_k, &[0, 3], Some(&[2, 0]), &[4, 3], &mut sm).unwrap();
        let mut moved = vec![0.0f32; 4 * g.page_elems()];
        let pe = g.page_elems();
        moved[..pe].copy_from_slice(&host_k[2 * pe..3 * pe]);
        moved[3 * pe..].copy_from_slice(&host_k[..pe]);
        let mut want = vec![0.0f32; 4 * per];
        build_summaries(&g, &moved, &[0, 3], None, &[4, 3], &mut want).unwrap();
        assert_eq!(sm, want);
        // A row past the host pool (3 rows) is an error though the id is in range.
        let r = build_summaries(&g, &host_k, &[3], Some(&[3]), &[1], &mut sm);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "block_rows",
                index: 3,
                bound: 3
            })
        ));
        let r = build_summaries(&g, &host_k, &[3], Some(&[]), &[1], &mut sm);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "block_rows",
                ..
            })
        ));
    }

    #[test]
    fn validation_errors() {
        let g = KvGeometry::new(2, 1, 2, 4).unwrap();
        let host_k = vec![1.0f32; 2 * g.page_elems()];
        let mut sm = vec![0.0f32; 2 * 2 * 2];
        let r = build_summaries(&g, &host_k, &[2], None, &[1], &mut sm);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "block_ids",
                index: 2,
                bound: 2
            })
        ));
        let r = build_summaries(&g, &host_k, &[-1], None, &[1], &mut sm);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "block_ids",
                index: -1,
                ..
            })
        ));
        assert!(matches!(
            build_summaries(&g, &host_k, &[0], None, &[0], &mut sm),
            Err(OasisError::Invalid(_))
        ));
        assert!(matches!(
            build_summaries(&g, &host_k, &[0], None, &[5], &mut sm),
            Err(OasisError::Invalid(_))
        ));
        let r = build_summaries(&g, &host_k, &[0, 1], None, &[1], &mut sm);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "block_lens",
                ..
            })
        ));
        let r = build_summaries(&g, &host_k[1..], &[0], None, &[1], &mut sm);
        assert!(matches!(r, Err(OasisError::Shape { what: "host_k", .. })));
        let r = build_summaries(&g, &host_k, &[0], None, &[1], &mut sm[1..]);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "summaries",
                ..
            })
        ));
        // A good entry before a bad one is not written either.
        let r = build_summaries(&g, &host_k, &[0, 1], None, &[4, 9], &mut sm);
        assert!(matches!(r, Err(OasisError::Invalid(_))));
        assert!(sm.iter().all(|&x| x == 0.0));
    }
}
