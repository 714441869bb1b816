//! Malformed CSR tables (`kv_indptr`, `blk_indptr`, `host_indptr`): every CPU twin that takes
//! one rejects it with a typed error naming the table, before writing anything. The GPU kernels
//! take the same tables and read a malformed row as an empty one instead (they cannot report
//! without a host synchronisation); tests/kernels/test_gpu_kernels.py checks that side.

use oasis_core::kernels::{decode_attention, gather_blocks, score_blocks, topk_blocks, PagedKv};
use oasis_core::{KvGeometry, OasisError};

/// Tables over `nnz = 3` indices with one sequence per row pair: the end past nnz, a decreasing
/// pair, a negative start, a negative end, a start that is not 0.
const BAD: [&[i32]; 5] = [&[0, 1, 5], &[0, 2, 1], &[-1, 1, 3], &[0, -1, 3], &[1, 2, 3]];
const GOOD: &[i32] = &[0, 1, 3];

/// The error names `what` and says what is wrong with it.
fn assert_names(r: Result<impl std::fmt::Debug, OasisError>, what: &str) {
    match r {
        Err(OasisError::Invalid(m)) => assert!(m.contains(what), "{m}"),
        Err(OasisError::Shape { what: w, .. }) => {
            assert!(w == what || w.contains("indices") || w == "scores", "{w}")
        }
        other => panic!("expected an error about {what}, got {other:?}"),
    }
}

#[test]
fn decode_attention_rejects_a_malformed_kv_indptr() {
    let g = KvGeometry::new(2, 1, 4, 2).unwrap();
    let k = vec![0.5f32; 4 * g.page_elems()];
    let q = vec![0.25f32; 2 * 2 * 4];
    for bad in BAD.iter().chain([&GOOD]) {
        let kv = PagedKv {
            k_pages: &k,
            v_pages: &k,
            kv_indptr: bad,
            kv_indices: &[0, 1, 2],
            kv_last_page_len: &[2, 1],
            page_map: None,
        };
        let mut out = vec![7.0f32; q.len()];
        let r = decode_attention(&g, &q, 1, &kv, None, 1.0, &mut out);
        if *bad == GOOD {
            r.unwrap();
            continue;
        }
        assert_names(r, "kv_indptr");
        assert!(
            out.iter().all(|&x| x == 7.0),
            "{bad:?}: out written on error"
        );
    }
}

#[test]
fn score_and_topk_reject_a_malformed_blk_indptr() {
    let g = KvGeometry::new(2, 1, 4, 2).unwrap();
    let q = vec![0.25f32; 2 * 2 * 4];
    let summaries = vec![0.5f32; 4 * 2 * 4];
    let scores_in = vec![1.0f32, 2.0, 3.0];
    for bad in BAD.iter().chain([&GOOD]) {
        let mut scores = vec![7.0f32; 3];
        let r = score_blocks(&g, &q, &summaries, bad, &[0, 1, 2], &mut scores);
        let mut out = vec![7i32; 2 * 2];
        let t = topk_blocks(1, &scores_in, bad, 2, &mut out);
        if *bad == GOOD {
            r.unwrap();
            t.unwrap();
            continue;
        }
        assert_names(r, "blk_indptr");
        assert_names(t, "blk_indptr");
        assert!(
            scores.iter().all(|&x| x == 7.0),
            "{bad:?}: scores written on error"
        );
        assert!(
            out.iter().all(|&x| x == 7),
            "{bad:?}: top-k written on error"
        );
    }
}

#[test]
fn gather_rejects_a_malformed_host_indptr() {
    let g = KvGeometry::new(2, 1, 4, 2).unwrap();
    let host = vec![0.5f32; 4 * g.page_elems()];
    for bad in BAD.iter().chain([&GOOD]) {
        let mut kp = vec![7.0f32; 2 * g.page_elems()];
        let mut vp = kp.clone();
        // Sequence s copies its logical block 0 into its slot 0 (page s).
        let r = gather_blocks(
            &g,
            &[0, 0],
            &[0, 0],
            1,
            &[0, 1],
            1,
            bad,
            &[0, 1, 2],
            &host,
            &host,
            &mut kp,
            &mut vp,
        );
        if *bad == GOOD {
            assert_eq!(r.unwrap(), 2);
            continue;
        }
        assert_names(r, "host_indptr");
        assert!(
            kp.iter().chain(&vp).all(|&x| x == 7.0),
            "{bad:?}: pages written on error"
        );
    }
}
