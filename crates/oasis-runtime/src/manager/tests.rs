//! The tests of [`Runtime`](super::Runtime).

use super::*;
use crate::config::test_config;
use crate::plan::PlanField;

fn runtime(gpu: usize, host: usize) -> Runtime {
    Runtime::new(test_config(), gpu, host, gpu, host).unwrap()
}

#[test]
fn admit_plan_sparse_release_round_trip() {
    let mut rt = runtime(64, 64); // b = 4, K = 3, threshold 12
    let (slot, pages) = rt.admit(7, 10, 20).unwrap();
    assert_eq!((slot, pages.len()), (0, 3));
    let (mp, mv) = rt.take_map_updates();
    assert_eq!(mp, pages);
    assert_eq!(mv, vec![0, 1, 2]);
    // Three steps: positions 10, 11, 12 -> block 3 is entered at 12.
    for _ in 0..3 {
        rt.plan(&[7], &[0, 0]).unwrap();
        rt.check_invariants().unwrap();
    }
    assert_eq!(rt.kv_len(7).unwrap(), 13);
    assert!(rt.wants_sparse(7).unwrap());
    let tr = rt.make_sparse(7).unwrap();
    assert_eq!(tr.host_blocks.len(), 4);
    assert_eq!(tr.lens, vec![4, 4, 4, 1]);
    assert_eq!(tr.n_complete, 3);
    assert_eq!(tr.slot_pages.len(), 3);
    rt.check_invariants().unwrap();
    let t = rt.table(7).unwrap();
    assert_eq!(t.local_page, Some(tr.src_pages[3]));
    assert_eq!(rt.reserved().0, 4);
    let (mp, mv) = rt.take_map_updates();
    assert_eq!(mp.len(), 4);
    assert_eq!(mv, vec![-1, -1, -1, 3]);
    for _ in 0..6 {
        rt.plan(&[7], &[0, 0]).unwrap();
        rt.check_invariants().unwrap();
    }
    rt.release(7).unwrap();
    rt.check_invariants().unwrap();
    assert_eq!(rt.num_free(), (64, 64, 64));
    assert_eq!(rt.reserved(), (0, 0, 0));
}

#[test]
fn padded_plan_holds_the_plan_at_fixed_offsets() {
    use crate::plan::PlanField as F;
    // b = 4, K = 3, threshold 12: request 1 dense, request 2 sparse.
    let mut rt = runtime(64, 64);
    rt.admit(1, 6, 20).unwrap();
    rt.admit(2, 14, 20).unwrap();
    rt.make_sparse(2).unwrap();
    rt.take_map_updates();
    let pad = PlanPad {
        rows: 4,
        pages: 8,
        blocks: 16,
        dummy_slot: 7,
    };
    let mut layouts = Vec::new();
    for step in 0..6 {
        let mut plain = rt.clone();
        let want = plain.plan(&[1, 2], &[5, 6, 7, 8]).unwrap().clone();
        let (want_pages, want_values) = (want.field(F::MapPages), want.field(F::MapValues));
        let got = rt
            .plan_padded(&[1, 2], &[5, 6, 7, 8], &pad)
            .unwrap()
            .clone();
        assert_eq!(got.num_seqs, 2);
        assert_eq!(got.num_sparse, 1);
        assert_eq!(got.max_pages, want.max_pages);
        layouts.push(*got.layout());
        // The mapping updates stay pending, and are the plain plan's.
        assert!(got.field(F::MapPages).is_empty());
        let (mp, mv) = rt.take_map_updates();
        assert_eq!(mp.iter().map(|&p| p as i32).collect::<Vec<_>>(), want_pages);
        assert_eq!(mv, want_values);
        // Every field: the plain plan's values first, then the padding.
        let check = |f: F, cap: usize, fill: i32| {
            let (w, g) = (want.field(f), got.field(f));
            assert_eq!(g.len(), cap, "{} capacity (step {step})", f.name());
            assert_eq!(&g[..w.len()], w, "{} values", f.name());
            assert!(
                g[w.len()..].iter().all(|&x| x == fill),
                "{} padding",
                f.name()
            );
        };
        check(F::InputIds, 8, 0);
        check(F::Positions, 8, 0);
        check(F::PageIds, 4, -1);
        check(F::Offsets, 4, 0);
        check(F::HostIds, 4, -1);
        check(F::HostRows, 4, -1);
        check(F::LastLen, 4, 1);
        check(F::KvIndices, 32, -1);
        check(F::SpRows, 4, 0);
        check(F::SpSlots, 4, 7);
        check(F::SlotPages, 12, -1);
        check(F::BlkIndices, 64, -1);
        check(F::BlkSeq, 64, 0);
        check(F::HostIndices, 64, -1);
        check(F::RecIndices, 64, -1);
        check(F::DoneBlocks, 4, -1);
        check(F::DoneRows, 4, -1);
        check(F::DonePages, 4, -1);
        for f in [F::KvIndptr, F::BlkIndptr, F::HostIndptr, F::RecIndptr] {
            let w = want.field(f);
            check(f, 5, *w.last().unwrap());
        }
        plain.check_invariants().unwrap();
        rt.check_invariants().unwrap();
        assert_eq!(plain.table(1), rt.table(1));
        assert_eq!(plain.table(2), rt.table(2));
    }
    assert!(layouts.windows(2).all(|w| w[0] == w[1]), "the layout moved");
    // Too small: refused, nothing changes.
    let before = rt.clone().table(1).cloned();
    let small = PlanPad { pages: 2, ..pad };
    let e = rt.plan_padded(&[1, 2], &[0; 4], &small).unwrap_err();
    assert!(e.to_string().contains("step_needs"), "{e}");
    assert!(rt
        .plan_padded(&[1, 2], &[0; 4], &PlanPad { rows: 1, ..pad })
        .is_err());
    assert!(rt
        .plan_padded(
            &[1, 2],
            &[0; 4],
            &PlanPad {
                dummy_slot: -1,
                ..pad
            }
        )
        .is_err());
    assert_eq!(rt.table(1).cloned(), before);
    assert_eq!(rt.step_needs(&[1, 2]).unwrap(), (4, 6));
}

#[test]
fn admission_is_refused_past_the_caps_and_changes_nothing() {
    let mut rt = runtime(8, 8);
    rt.admit(1, 14, 2).unwrap(); // sparse at once: max(4, K + 1) = 4 pages, 4 host blocks
    assert_eq!(rt.reserved(), (4, 4, 4));
    let r = rt.reservation(17, 2); // 5 pages
    assert!(!rt.can_admit(&r));
    let e = rt.admit(2, 17, 2).unwrap_err();
    assert!(
        matches!(
            e,
            OasisError::OutOfBlocks {
                tier: Tier::Host,
                ..
            }
        ),
        "{e}"
    );
    rt.check_invariants().unwrap();
    assert!(rt.admit(1, 3, 2).is_err()); // duplicate id
    assert!(rt.admit(3, 0, 2).is_err()); // empty prompt
    rt.check_invariants().unwrap();
}

#[test]
fn grow_then_admit() {
    let mut rt = Runtime::new(test_config(), 2, 0, 100, 100).unwrap();
    let r = rt.reservation(40, 4);
    assert!(rt.can_admit(&r));
    assert!(rt.admit(1, 40, 4).is_err()); // the pools are still small
    let (g, h, w) = rt.pool_sizes_needed(&r);
    assert_eq!(h, w, "a local request takes a row with every id");
    rt.grow(g, h, w).unwrap();
    rt.admit(1, 40, 4).unwrap();
    assert!(rt.grow(101, 0, 0).is_err());
    assert!(rt.grow(0, 0, 101).is_err());
    rt.check_invariants().unwrap();
}

/// The `spec_*` fields of the last plan: (page, offset, host) per batch row.
/// (The host row, `spec_host_rows`, is checked against the table's row of the same block.)
fn drafts_of(rt: &Runtime) -> Vec<(i32, i32, i32)> {
    let p = rt.last_plan();
    let f = |x| p.field(x).to_vec();
    let (a, b, c, d) = (
        f(PlanField::SpecPageIds),
        f(PlanField::SpecOffsets),
        f(PlanField::SpecHostIds),
        f(PlanField::SpecHostRows),
    );
    assert_eq!(c.len(), d.len());
    for (&id, &row) in c.iter().zip(&d) {
        if id < 0 {
            assert_eq!(row, -1);
            continue;
        }
        let owner = rt
            .reqs
            .values()
            .find(|t| t.host_blocks.contains(&(id as u32)));
        let t = owner.expect("a draft's host block is held");
        let l = t.host_blocks.iter().position(|&h| h == id as u32).unwrap();
        assert_eq!(t.host_rows[l] as i32, row, "the draft's row is its block's");
    }
    (0..a.len()).map(|i| (a[i], b[i], c[i])).collect()
}

#[test]
fn speculative_plans_reserve_draft_slots_within_the_reservation() {
    let mut rt = runtime(64, 64); // b = 4, K = 3, threshold 12
                                  // Dense: 5 + 4 - 1 = 8 tokens at most -> 2 pages.
    rt.admit(1, 5, 4).unwrap();
    rt.take_map_updates();
    rt.plan_speculative(&[1], &[0, 0], None, &[true]).unwrap(); // x_t at 5, the draft at 6
    let pages = rt.table(1).unwrap().pages.clone();
    assert_eq!(drafts_of(&rt), vec![(pages[1] as i32, 2, -1)]);
    assert_eq!(rt.pending_drafts(), vec![1]);
    assert_eq!(
        rt.kv_len(1).unwrap(),
        6,
        "a tentative slot does not advance kv_len"
    );
    assert!(rt.plan(&[1], &[0, 0]).is_err(), "drafts first");
    assert!(rt.commit_drafts(&[1, 1]).is_err());
    assert!(rt.commit_drafts(&[9]).is_err());
    rt.commit_drafts(&[1]).unwrap();
    assert_eq!(rt.kv_len(1).unwrap(), 7);
    assert!(rt.pending_drafts().is_empty());
    // 7: the eighth token, the last stored; a third page passes the reservation.
    rt.plan_speculative(&[1], &[0, 0], None, &[true]).unwrap();
    assert_eq!(drafts_of(&rt), vec![(-1, 0, -1)]);
    assert!(rt.pending_drafts().is_empty());
    rt.commit_drafts(&[]).unwrap();
    assert_eq!(rt.kv_len(1).unwrap(), 8);
    rt.check_invariants().unwrap();
    // A dense request past the threshold must turn sparse before it stores more.
    rt.admit(2, 12, 10).unwrap();
    rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap(); // kv_len 13 > 12
    assert!(rt.pending_drafts().is_empty());
    rt.commit_drafts(&[]).unwrap();
    rt.make_sparse(2).unwrap();
    rt.take_map_updates();
    let local = rt.table(2).unwrap().local_page.unwrap();
    let host = rt.table(2).unwrap().host_blocks.clone();
    // Sparse, x_t at 13: the draft lands at 14 (offset 2), written through. A request that
    // does not try gets no slot.
    rt.admit(3, 3, 3).unwrap();
    rt.take_map_updates();
    rt.plan_speculative(&[3, 2], &[0, 0, 0, 0], None, &[false, true])
        .unwrap();
    assert_eq!(
        drafts_of(&rt),
        vec![(-1, 0, -1), (local as i32, 2, host[3] as i32)]
    );
    assert_eq!(rt.pending_drafts(), vec![2]);
    rt.commit_drafts(&[]).unwrap(); // rejected: nothing changes, the next token lands there
    assert_eq!(rt.kv_len(2).unwrap(), 14);
    assert_eq!(rt.take_map_updates(), (vec![], vec![]));
    // x_t at 14: the draft would complete block 3, which this step's selection did not see.
    rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap();
    assert!(rt.pending_drafts().is_empty());
    rt.commit_drafts(&[]).unwrap();
    // x_t at 15 completes it; the draft at 16 enters a new host block: rejected, the block
    // goes back and the local page keeps its mapping.
    let free = rt.num_free();
    rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap();
    let host = rt.table(2).unwrap().host_blocks.clone();
    assert_eq!(host.len(), 5);
    assert_eq!(drafts_of(&rt), vec![(local as i32, 0, host[4] as i32)]);
    assert_eq!(rt.num_free().1, free.1 - 1);
    assert_eq!(rt.num_free().2, free.2 - 1);
    rt.commit_drafts(&[]).unwrap();
    assert_eq!(rt.num_free(), free);
    assert_eq!(rt.table(2).unwrap().host_blocks.len(), 4);
    assert_eq!(rt.take_map_updates(), (vec![], vec![]));
    rt.check_invariants().unwrap();
    // Again: x_t at 16 enters block 4 itself; its draft at 17, accepted, advances kv_len.
    rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap(); // x_t at 16 (new block)
    rt.commit_drafts(&[2]).unwrap(); // the draft at 17
    assert_eq!(rt.kv_len(2).unwrap(), 18);
    rt.check_invariants().unwrap();
    // A padded speculative plan has one draft entry per padded row.
    let pad = PlanPad {
        rows: 4,
        pages: 8,
        blocks: 8,
        dummy_slot: 7,
    };
    rt.plan_speculative(&[2], &[0, 0], Some(&pad), &[true])
        .unwrap();
    assert_eq!(drafts_of(&rt), vec![(-1, 0, -1); 4]); // x_t at 18: the draft would complete block 4
    rt.commit_drafts(&[]).unwrap();
    assert!(rt.plan_speculative(&[2], &[0, 0], None, &[]).is_err());
    rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap(); // x_t at 19, the draft at 20
    assert_eq!(rt.pending_drafts(), vec![2]);
    // Releasing a request drops its tentative slot with its blocks.
    rt.release(2).unwrap();
    assert!(rt.pending_drafts().is_empty());
    rt.commit_drafts(&[]).unwrap();
    rt.release(1).unwrap();
    rt.release(3).unwrap();
    rt.check_invariants().unwrap();
    assert_eq!(rt.num_free(), (64, 64, 64));
}

/// Everything a refused call must leave alone.
fn snapshot(rt: &Runtime) -> impl PartialEq + std::fmt::Debug {
    let mut tables: Vec<_> = rt.reqs.values().cloned().collect();
    tables.sort_by_key(|t| t.id);
    (
        rt.num_free(),
        rt.reserved(),
        rt.pool_sizes(),
        rt.free_slots.clone(),
        rt.map_order.clone(),
        tables,
    )
}

#[test]
fn admit_sparse_takes_only_the_working_set() {
    // b = 4, K = 3: 10 prompt tokens, 20 new -> 29 stored, 8 host blocks; K + 1 = 4 pages.
    let mut rt = runtime(4, 64);
    let (slot, tr) = rt.admit_sparse(7, 10, 20, None).unwrap();
    assert_eq!(slot, 0);
    assert!(tr.src_pages.is_empty());
    assert_eq!(tr.host_blocks.len(), 3);
    assert_eq!(tr.lens, vec![4, 4, 2]);
    assert_eq!(tr.n_complete, 2);
    assert_eq!(tr.slot_pages.len(), 3);
    rt.check_invariants().unwrap();
    assert_eq!(rt.reserved(), (4, 8, 8));
    assert_eq!(rt.num_free(), (0, 61, 61));
    let t = rt.table(7).unwrap();
    assert!(t.sparse && t.pages.is_empty());
    assert_eq!(t.kv_len, 10);
    assert_eq!(t.local_page, Some(tr.local_page));
    assert_eq!(
        (&t.slot_pages, &t.host_blocks),
        (&tr.slot_pages, &tr.host_blocks)
    );
    // The slots' mapping empty, the local page on block 10 / 4 = 2.
    let (mp, mv) = rt.take_map_updates();
    let mut want = tr.slot_pages.clone();
    want.push(tr.local_page);
    assert_eq!((mp, mv), (want, vec![-1, -1, -1, 2]));
    // In a pool of K + 1 pages a 40-token prompt cannot be admitted dense (10 pages), but
    // sparse it can.
    let mut small = runtime(4, 64);
    assert!(small.admit(1, 40, 2).is_err()); // 10 dense pages
    small.admit_sparse(1, 40, 2, None).unwrap();
    small.check_invariants().unwrap();
    // Decode: it enters blocks within its reservation, as a request that turned sparse.
    for _ in 0..19 {
        rt.plan(&[7], &[0, 0]).unwrap();
        rt.check_invariants().unwrap();
    }
    assert_eq!(rt.kv_len(7).unwrap(), 29);
    assert_eq!(rt.table(7).unwrap().host_blocks.len(), 8);
    rt.release(7).unwrap();
    rt.check_invariants().unwrap();
    assert_eq!(rt.num_free(), (4, 64, 64));
    assert_eq!(rt.reserved(), (0, 0, 0));
    assert_eq!(rt.num_requests(), 0);
}

#[test]
fn admit_sparse_matches_admit_then_make_sparse() {
    // Prompts that turn sparse (P + 9 - 2 > 12), of every offset in a block.
    for prompt_len in [6, 8, 13, 16, 17] {
        let mut dense = runtime(64, 64);
        dense.admit(1, prompt_len, 9).unwrap();
        let want = dense.make_sparse(1).unwrap();
        let mut rt = runtime(64, 64);
        let (_, got) = rt.admit_sparse(1, prompt_len, 9, None).unwrap();
        assert_eq!(
            got.host_blocks.len(),
            want.host_blocks.len(),
            "{prompt_len}"
        );
        assert_eq!(got.lens, want.lens, "{prompt_len}");
        assert_eq!(got.n_complete, want.n_complete, "{prompt_len}");
        assert_eq!(got.slot_pages.len(), 3);
        let (t, u) = (rt.table(1).unwrap(), dense.table(1).unwrap());
        assert_eq!((t.kv_len, t.sparse), (u.kv_len, u.sparse));
        assert_eq!(t.reservation.host_blocks, u.reservation.host_blocks);
        assert_eq!(t.reservation.gpu_pages, 4);
        rt.check_invariants().unwrap();
        // Both decode alike from here.
        for _ in 0..8 {
            let a = rt.plan(&[1], &[0, 0]).unwrap().clone();
            let b = dense.plan(&[1], &[0, 0]).unwrap().clone();
            assert_eq!(a.num_sparse, b.num_sparse);
            assert_eq!(rt.kv_len(1).unwrap(), dense.kv_len(1).unwrap());
            assert_eq!(
                rt.table(1).unwrap().host_blocks.len(),
                dense.table(1).unwrap().host_blocks.len()
            );
            rt.check_invariants().unwrap();
        }
        rt.release(1).unwrap();
        assert_eq!(rt.num_free(), (64, 64, 64));
        rt.check_invariants().unwrap();
    }
}

#[test]
fn admit_sparse_refusals_change_nothing() {
    let mut rt = runtime(8, 8); // b = 4, K = 3
    rt.admit_sparse(1, 14, 2, None).unwrap(); // 4 pages, 4 host blocks
    rt.take_map_updates();
    let before = snapshot(&rt);
    // Duplicate id, empty prompt, no new token.
    for (id, n, m) in [(1, 3, 2), (2, 0, 2), (2, 3, 0)] {
        let e = rt.admit_sparse(id, n, m, None).unwrap_err();
        assert!(matches!(e, OasisError::Invalid(_)), "{e}");
        assert_eq!(snapshot(&rt), before);
    }
    // Past the host cap: 17 + 2 - 1 = 18 tokens -> 5 blocks beside 4 of 8.
    let e = rt.admit_sparse(2, 17, 2, None).unwrap_err();
    assert!(
        matches!(
            e,
            OasisError::OutOfBlocks {
                tier: Tier::Host,
                requested: 5,
                free: 4
            }
        ),
        "{e}"
    );
    assert_eq!(snapshot(&rt), before);
    // Host fits but not the working set beside the first one (GPU 4 of 8 free, needs 4: fits);
    // a third one does not.
    rt.admit_sparse(2, 3, 2, None).unwrap();
    let before = snapshot(&rt);
    let e = rt.admit_sparse(3, 1, 1, None).unwrap_err();
    assert!(
        matches!(
            e,
            OasisError::OutOfBlocks {
                tier: Tier::Gpu,
                requested: 4,
                free: 0
            }
        ),
        "{e}"
    );
    assert_eq!(snapshot(&rt), before);
    rt.check_invariants().unwrap();
    // Pools not grown to the reservation yet.
    let mut rt = Runtime::new(test_config(), 2, 0, 100, 100).unwrap();
    let before = snapshot(&rt);
    assert!(rt.admit_sparse(1, 40, 4, None).is_err());
    assert_eq!(snapshot(&rt), before);
    let r = rt.sparse_reservation(40, 4, None);
    let (g, h, w) = rt.pool_sizes_needed(&r);
    assert_eq!((g, h, w), (4, 11, 11));
    rt.grow(g, h, w).unwrap();
    rt.admit_sparse(1, 40, 4, None).unwrap();
    rt.check_invariants().unwrap();
    // No seat left.
    let cfg = RuntimeConfig {
        max_num_seqs: 1,
        ..test_config()
    };
    let mut rt = Runtime::new(cfg, 64, 64, 64, 64).unwrap();
    rt.admit_sparse(1, 5, 5, None).unwrap();
    let before = snapshot(&rt);
    assert!(rt.admit_sparse(2, 5, 5, None).is_err());
    assert_eq!(snapshot(&rt), before);
    // The dense backend has no working set.
    let cfg = RuntimeConfig {
        sparse: false,
        ..test_config()
    };
    let mut rt = Runtime::new(cfg, 64, 64, 64, 64).unwrap();
    let before = snapshot(&rt);
    let e = rt.admit_sparse(1, 20, 5, None).unwrap_err();
    assert!(e.to_string().contains("sparse backend"), "{e}");
    assert_eq!(snapshot(&rt), before);
}

#[test]
fn admit_sparse_with_a_bounded_cache_holds_c_rows_plus_its_own() {
    // b = 4, K = 3: 18 prompt tokens (blocks 0..3 complete, block 4 partial), 10 new -> 27
    // stored, 7 blocks; C = 2: rows for 2 + 7 - 18 / 4 = 5.
    let mut rt = runtime(8, 64);
    let r = rt.sparse_reservation(18, 10, Some(2));
    assert_eq!((r.host_blocks, r.host_rows), (7, 5));
    let (_, tr) = rt.admit_sparse(1, 18, 10, Some(2)).unwrap();
    rt.check_invariants().unwrap();
    assert_eq!(rt.reserved(), (4, 7, 5));
    assert_eq!(
        rt.num_free(),
        (4, 64 - 5, 64 - 3),
        "two cache rows and block 4's"
    );
    let filler = tr.host_rows[0];
    assert_eq!(tr.host_rows[..4], [filler; 4]);
    assert_ne!(tr.host_rows[4], filler);
    let own = tr.host_rows[4];
    // Blocks 0 and 2 get the two cache rows (nothing evicted), block 4 keeps its own row.
    let got = rt.cache_blocks(1, &[0, 2, 4], &[0, 2, 4]).unwrap();
    assert_eq!(got.given, vec![0, 2]);
    assert!(got.evicted.is_empty());
    assert_eq!(got.rows[2], own);
    let t = rt.table(1).unwrap();
    assert_eq!((t.host_rows[0], t.host_rows[2]), (got.rows[0], got.rows[1]));
    rt.check_invariants().unwrap();
    // Every cache row pinned: refused, nothing changes.
    let before = snapshot(&rt);
    let e = rt.cache_blocks(1, &[3], &[0, 2]).unwrap_err();
    assert!(
        matches!(
            e,
            OasisError::OutOfBlocks {
                tier: Tier::Host,
                ..
            }
        ),
        "{e}"
    );
    assert!(rt.cache_blocks(1, &[7], &[]).is_err(), "past the table");
    assert!(rt.cache_blocks(2, &[0], &[]).is_err(), "unknown request");
    assert_eq!(snapshot(&rt), before);
    // Block 3 evicts the least recently used unpinned block (0, pinned 2); 0 -> the filler.
    let row0 = got.rows[0];
    let got = rt.cache_blocks(1, &[3], &[2, 3]).unwrap();
    assert_eq!(got.evicted, vec![(0, row0)]);
    assert_eq!(got.rows, vec![row0]);
    assert_eq!(rt.table(1).unwrap().host_rows[3], row0);
    rt.check_invariants().unwrap();
    // Decode: the blocks it enters get ids and rows of their own; the plan's host_indices
    // are the table's rows, host_rows the write-through's row.
    for _ in 0..9 {
        let plan = rt.plan(&[1], &[0, 0]).unwrap().clone();
        let t = rt.table(1).unwrap();
        let rows: Vec<i32> = t.host_rows.iter().map(|&r| r as i32).collect();
        assert_eq!(plan.field(PlanField::HostIndices), &rows[..]);
        let blk = (t.kv_len - 1) / 4;
        assert_eq!(plan.field(PlanField::HostRows), &[rows[blk]]);
        if let [done] = plan.field(PlanField::DoneRows) {
            assert_eq!(*done, rows[blk]);
            // The codes are built from the local page x_t completes.
            let local = t.local_page.map(|p| p as i32);
            assert_eq!(Some(plan.field(PlanField::DonePages)[0]), local);
            assert_eq!(plan.field(PlanField::PageIds), &[local.unwrap()]);
        }
        rt.check_invariants().unwrap();
    }
    assert_eq!(rt.table(1).unwrap().host_rows.len(), 7);
    assert_eq!(rt.num_free().2, 64 - 5, "held rows reach the reservation");
    // A written block never goes through the cache.
    let got = rt.cache_blocks(1, &[5, 6], &[]).unwrap();
    assert!(got.given.is_empty() && got.evicted.is_empty());
    rt.release(1).unwrap();
    rt.check_invariants().unwrap();
    assert_eq!(rt.num_free(), (8, 64, 64));
    assert_eq!(rt.reserved(), (0, 0, 0));
    // C = 0 is refused; a local request's rows are fixed (nothing given).
    assert!(rt.admit_sparse(2, 18, 10, Some(0)).is_err());
    rt.admit_sparse(2, 18, 10, None).unwrap();
    let got = rt.cache_blocks(2, &[0, 1], &[]).unwrap();
    assert_eq!(got.rows, rt.table(2).unwrap().host_rows[..2]);
    assert!(got.given.is_empty());
    rt.check_invariants().unwrap();
}

#[test]
fn a_bounded_cache_fits_where_the_whole_context_does_not() {
    // 40 prompt tokens, 2 new: 11 blocks. Rows capped at 4: unbounded needs 11 rows, C = 2
    // needs 2 + 11 - 10 = 3; the ids grow past the row cap.
    let mut rt = Runtime::new(test_config(), 8, 4, 8, 4).unwrap();
    let e = rt.admit_sparse(1, 40, 2, None).unwrap_err();
    assert!(
        matches!(
            e,
            OasisError::OutOfBlocks {
                tier: Tier::Host,
                requested: 11,
                ..
            }
        ),
        "{e}"
    );
    let r = rt.sparse_reservation(40, 2, Some(2));
    assert!(rt.fits_ever(&r) && rt.can_admit(&r));
    assert!(
        rt.admit_sparse(1, 40, 2, Some(2)).is_err(),
        "the ids are not grown yet"
    );
    let (g, h, w) = rt.pool_sizes_needed(&r);
    assert_eq!((g, h, w), (4, 11, 3));
    rt.grow(g, h, w).unwrap();
    rt.admit_sparse(1, 40, 2, Some(2)).unwrap();
    rt.check_invariants().unwrap();
    assert_eq!(rt.pool_sizes(), (8, 11, 4));
}

#[test]
fn unknown_and_repeated_ids_are_errors() {
    let mut rt = runtime(16, 16);
    rt.admit(1, 3, 3).unwrap();
    assert!(rt.plan(&[2], &[0, 0]).is_err());
    assert!(rt.plan(&[1], &[0]).is_err());
    assert!(rt.plan(&[1, 1], &[0; 4]).is_err());
    // Past the threshold a request must turn sparse before it decodes again.
    rt.admit(5, 13, 4).unwrap();
    assert!(rt.wants_sparse(5).unwrap());
    assert!(rt.plan(&[5], &[0, 0]).is_err());
    rt.make_sparse(5).unwrap();
    rt.plan(&[5], &[0, 0]).unwrap();
    rt.check_invariants().unwrap();
    assert!(rt.release(2).is_err());
    assert!(rt.make_sparse(2).is_err());
    assert_eq!(rt.kv_len(1).unwrap(), 3);
}
