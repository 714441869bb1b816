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
/// `block_ids[i]`, all KV heads. Listing a block twice recomputes it twice (the later length
/// wins).
///
/// # Errors
/// * [`OasisError::Shape`](crate::OasisError::Shape) for a buffer of the wrong size;
/// * [`OasisError::IndexOutOfRange`](crate::OasisError::IndexOutOfRange) for a block id outside
///   the host pool;
/// * [`OasisError::Invalid`](crate::OasisError::Invalid) for a length outside `1..=block_size`.
///
/// Nothing is written when an error is returned.
pub fn build_summaries<T: KvElem>(
    geo: &KvGeometry,
    host_k: &[T],        // [num_host_blocks, num_kv_heads, block_size, head_dim]
    block_ids: &[i32],   // [n]
    block_lens: &[i32],  // [n] 1..=block_size
    summaries: &mut [T], // [num_host_blocks, num_kv_heads, 2, head_dim]
) -> Result<()> {
    geo.validate()?;
    let (h_kv, bs, d) = (geo.num_kv_heads, geo.block_size, geo.head_dim);
    let num_host = leading_rows("host_k", host_k.len(), &[h_kv, bs, d])?;
    check_len("summaries", summaries.len(), &[num_host, h_kv, 2, d])?;
    check_len("block_lens", block_lens.len(), &[block_ids.len()])?;
    for (i, (&b, &n)) in block_ids.iter().zip(block_lens).enumerate() {
        index("block_ids", b, num_host)?;
        length("block_lens", i, n, bs)?;
    }

    let entry = geo.entry_elems();
    for (&b, &n) in block_ids.iter().zip(block_lens) {
        // Validated above.
        let (b, n) = (b as usize, n as usize);
        for h in 0..h_kv {
            let keys = &host_k[(b * h_kv + h) * entry..][..n * d];
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
        build_summaries(&g, &host_k, &[3, 0, 1], &[7, 1, 4], &mut sm).unwrap();
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
    fn validation_errors() {
        let g = KvGeometry::new(2, 1, 2, 4).unwrap();
        let host_k = vec![1.0f32; 2 * g.page_elems()];
        let mut sm = vec![0.0f32; 2 * 2 * 2];
        let r = build_summaries(&g, &host_k, &[2], &[1], &mut sm);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "block_ids",
                index: 2,
                bound: 2
            })
        ));
        let r = build_summaries(&g, &host_k, &[-1], &[1], &mut sm);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "block_ids",
                index: -1,
                ..
            })
        ));
        assert!(matches!(
            build_summaries(&g, &host_k, &[0], &[0], &mut sm),
            Err(OasisError::Invalid(_))
        ));
        assert!(matches!(
            build_summaries(&g, &host_k, &[0], &[5], &mut sm),
            Err(OasisError::Invalid(_))
        ));
        let r = build_summaries(&g, &host_k, &[0, 1], &[1], &mut sm);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "block_lens",
                ..
            })
        ));
        let r = build_summaries(&g, &host_k[1..], &[0], &[1], &mut sm);
        assert!(matches!(r, Err(OasisError::Shape { what: "host_k", .. })));
        let r = build_summaries(&g, &host_k, &[0], &[1], &mut sm[1..]);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "summaries",
                ..
            })
        ));
        // A good entry before a bad one is not written either.
        let r = build_summaries(&g, &host_k, &[0, 1], &[4, 9], &mut sm);
        assert!(matches!(r, Err(OasisError::Invalid(_))));
        assert!(sm.iter().all(|&x| x == 0.0));
    }
}
