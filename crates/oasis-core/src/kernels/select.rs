//! Delta selection with capped eviction: turn the predicted top-K blocks of each (seq, KV head)
//! into an update of the head-wise mapping plus a transfer plan for [`super::gather_blocks`].
//!
//! Only the difference between the prediction and what is resident moves: predicted blocks that
//! are already in a slot stay where they are; each missing block is paired with a slot whose block
//! is not predicted, empty slots first, then the least recently selected; and at most `fetch_cap`
//! pairs per head per step are executed (the per-step byte budget). Missing blocks beyond the cap
//! wait for a later step, in prediction order (best first).
//!
//! Invariants kept (given a mapping that satisfies them): per (seq, head), no block sits in two
//! slots; at most `fetch_cap` slots change per step; predicted resident blocks never move.
//! The local block (the sequence's last page) is not one of the budget slots: callers leave it
//! out of `predicted`, or it would be fetched a second time into a slot.

use crate::ensure;
use crate::error::{check_len, OasisError, Result};
use crate::kernels::validate::{index, leading_rows, plan_shape};

/// Traffic statistics of one [`delta_select`] call, summed over sequences and KV heads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SelectStats {
    /// (victim slot, missing block) pairs planned: block-head entries to fetch, `<= fetch_cap`
    /// per (seq, head).
    pub pairs: usize,
    /// Distinct predicted blocks already resident (kept in place, no traffic).
    pub kept: usize,
    /// Distinct predicted blocks not resident, before the cap (`missing - pairs` are deferred).
    pub missing: usize,
}

/// Delta selection with capped eviction, per (seq s, kv head h), over the sequence's `budget`
/// slots (slot i lives in GPU page `slot_pages[s, i]`; its entry is `page_map[page, h]`):
///  1. S = `predicted[s, h, :]` without -1 (distinct logical blocks, best first).
///  2. Every slot whose block is in S: `page_last_selected[page, h] = step` (kept, no traffic).
///  3. missing = blocks of S not resident, in prediction order.
///  4. victims = slots whose block is not in S: empty slots (-1) first, then ascending
///     `page_last_selected`, ties by slot index.
///  5. n = min(len(missing), len(victims), fetch_cap); for i < n: `page_map[victim_i page, h] =
///     missing[i]`, `page_last_selected = step`, `plan_slots[s,h,i]` = victim slot index,
///     `plan_blocks[s,h,i] = missing[i]`. Remaining plan entries = -1.
///
/// Details fixed here: every negative `predicted` entry is padding; a block predicted twice
/// counts once, at its first position; predicted ids `>= 0` are trusted (this function does not
/// know the sequence lengths). Every negative `page_map` entry is an empty slot. Victims are
/// ordered by the key (non-empty, `page_last_selected`, slot index), so empty slots too are
/// ordered by `page_last_selected`, then slot.
///
/// The number of sequences is `slot_pages.len() / budget` (from the plan buffers when
/// `budget == 0`, when nothing can be selected).
///
/// # Errors
/// * [`OasisError::Config`] for `num_kv_heads == 0`;
/// * [`OasisError::Invalid`] for `num_pred > budget`, or a page listed twice in `slot_pages`
///   (two slots would share one mapping entry);
/// * [`OasisError::Shape`] for a buffer of the wrong size;
/// * [`OasisError::IndexOutOfRange`] for a `slot_pages` entry outside `0..num_pages` (negative
///   included), `num_pages = page_map.len() / num_kv_heads`.
///
/// Nothing is written when an error is returned.
#[allow(clippy::too_many_arguments)]
pub fn delta_select(
    num_kv_heads: usize,
    predicted: &[i32], // [num_seqs, num_kv_heads, num_pred]  num_pred <= budget
    num_pred: usize,
    slot_pages: &[i32], // [num_seqs, budget]
    budget: usize,
    page_map: &mut [i32],           // [num_pages, num_kv_heads]
    page_last_selected: &mut [i32], // [num_pages, num_kv_heads]
    step: i32,
    fetch_cap: usize,
    plan_slots: &mut [i32],  // [num_seqs, num_kv_heads, fetch_cap]
    plan_blocks: &mut [i32], // [num_seqs, num_kv_heads, fetch_cap]
) -> Result<SelectStats> {
    let h_kv = num_kv_heads;
    if h_kv == 0 {
        return Err(OasisError::Config(
            "num_kv_heads must be positive".to_string(),
        ));
    }
    ensure!(
        num_pred <= budget,
        "num_pred ({num_pred}) must not exceed the budget ({budget})"
    );
    let num_seqs = if budget > 0 {
        leading_rows("slot_pages", slot_pages.len(), &[budget])?
    } else if fetch_cap > 0 {
        leading_rows("plan_slots", plan_slots.len(), &[h_kv, fetch_cap])?
    } else {
        0 // every buffer but the maps is empty whatever the batch; nothing to do
    };
    check_len("predicted", predicted.len(), &[num_seqs, h_kv, num_pred])?;
    check_len("slot_pages", slot_pages.len(), &[num_seqs, budget])?;
    plan_shape(
        plan_slots.len(),
        plan_blocks.len(),
        [num_seqs, h_kv, fetch_cap],
    )?;
    let num_pages = leading_rows("page_map", page_map.len(), &[h_kv])?;
    check_len(
        "page_last_selected",
        page_last_selected.len(),
        &[num_pages, h_kv],
    )?;
    let mut owner = vec![false; num_pages];
    for (i, &p) in slot_pages.iter().enumerate() {
        let p = index("slot_pages", p, num_pages)?;
        ensure!(
            !owner[p],
            "page {p} appears twice in slot_pages (at seq {}, slot {}); slots must be distinct pages",
            i / budget,
            i % budget
        );
        owner[p] = true;
    }
    drop(owner);

    let mut stats = SelectStats::default();
    // Per-head scratch, reused: S sorted by block with first position, residency flags, victims.
    // (Grown on demand: with no sequences, `budget` and `num_pred` are not bounded by a buffer.)
    let mut sorted: Vec<(i32, u32)> = Vec::new();
    let mut resident: Vec<bool> = Vec::new();
    let mut missing: Vec<i32> = Vec::new();
    let mut victims: Vec<(bool, i32, u32)> = Vec::new();
    for s in 0..num_seqs {
        let pages = &slot_pages[s * budget..(s + 1) * budget];
        for h in 0..h_kv {
            let pred = &predicted[(s * h_kv + h) * num_pred..][..num_pred];
            // 1. S: distinct non-negative predictions, sorted for lookup; the first position of
            //    each block is kept to restore prediction order for `missing`.
            sorted.clear();
            sorted.extend(
                pred.iter()
                    .enumerate()
                    .filter(|&(_, &b)| b >= 0)
                    .map(|(i, &b)| (b, i as u32)),
            );
            sorted.sort_unstable();
            sorted.dedup_by_key(|&mut (b, _)| b); // keeps the first = lowest position
            resident.clear();
            resident.resize(sorted.len(), false);

            // 2. Keep predicted resident blocks; collect the other slots as victims.
            victims.clear();
            for (slot, &page) in pages.iter().enumerate() {
                let e = page as usize * h_kv + h; // validated
                let blk = page_map[e];
                match (blk >= 0).then(|| sorted.binary_search_by_key(&blk, |&(b, _)| b)) {
                    Some(Ok(i)) => {
                        page_last_selected[e] = step;
                        resident[i] = true;
                    }
                    _ => victims.push((blk >= 0, page_last_selected[e], slot as u32)),
                }
            }

            // 3. Missing blocks in prediction order.
            missing.clear();
            let kept = resident.iter().filter(|&&r| r).count();
            for &b in pred {
                if b < 0 {
                    continue;
                }
                if let Ok(i) = sorted.binary_search_by_key(&b, |&(b, _)| b) {
                    if !resident[i] {
                        resident[i] = true; // emitted once (dedup)
                        missing.push(b);
                    }
                }
            }

            // 4-5. Pair missing blocks with victims, capped.
            let n = missing.len().min(victims.len()).min(fetch_cap);
            if n > 0 && n < victims.len() {
                victims.select_nth_unstable(n - 1);
            }
            victims[..n].sort_unstable();
            let plan = (s * h_kv + h) * fetch_cap;
            let plan_s = &mut plan_slots[plan..plan + fetch_cap];
            let plan_b = &mut plan_blocks[plan..plan + fetch_cap];
            plan_s.fill(-1);
            plan_b.fill(-1);
            for (i, (&(_, _, slot), &blk)) in victims[..n].iter().zip(&missing).enumerate() {
                let e = pages[slot as usize] as usize * h_kv + h;
                page_map[e] = blk;
                page_last_selected[e] = step;
                plan_s[i] = slot as i32; // slot < budget, and budget slots are i32 pages
                plan_b[i] = blk;
            }
            stats.pairs += n;
            stats.kept += kept;
            stats.missing += missing.len();
        }
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct St {
        map: Vec<i32>,
        last: Vec<i32>,
        ps: Vec<i32>,
        pb: Vec<i32>,
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        h: usize,
        pred: &[i32],
        np: usize,
        slots: &[i32],
        budget: usize,
        st: &mut St,
        step: i32,
        cap: usize,
    ) -> Result<SelectStats> {
        delta_select(
            h,
            pred,
            np,
            slots,
            budget,
            &mut st.map,
            &mut st.last,
            step,
            cap,
            &mut st.ps,
            &mut st.pb,
        )
    }

    fn state(num_pages: usize, h: usize, seqs: usize, cap: usize) -> St {
        St {
            map: vec![-1; num_pages * h],
            last: vec![-1; num_pages * h],
            ps: vec![7; seqs * h * cap],
            pb: vec![7; seqs * h * cap],
        }
    }

    #[test]
    fn worked_example() {
        // One seq, one head, budget 4: slots 0..4 live in pages [5, 2, 7, 0].
        let slots = [5, 2, 7, 0];
        let mut st = state(8, 1, 1, 2);
        st.map[5] = 10;
        st.last[5] = 3;
        st.map[2] = 11;
        st.last[2] = 1;
        st.map[7] = -1; // empty
        st.last[7] = 9;
        st.map[0] = 12;
        st.last[0] = 1;
        // Predict 12 (resident), 20, 21, 22 (missing); -1 and a duplicate are ignored.
        let pred = [20, 12, -1, 20];
        let stats = run(1, &pred, 4, &slots, 4, &mut st, 4, 2).unwrap();
        assert_eq!(
            stats,
            SelectStats {
                pairs: 1,
                kept: 1,
                missing: 1
            }
        );
        assert_eq!(st.last[0], 4); // kept
        assert_eq!(st.map[7], 20); // empty slot used first
        assert_eq!(st.last[7], 4);
        assert_eq!(st.ps, [2, -1]);
        assert_eq!(st.pb, [20, -1]);

        let pred = [21, 22, 23, 12];
        let stats = run(1, &pred, 4, &slots, 4, &mut st, 5, 2).unwrap();
        assert_eq!(
            stats,
            SelectStats {
                pairs: 2,
                kept: 1,
                missing: 3
            }
        );
        // Victims (not predicted): slot 0 (last 3), slot 1 (last 1), slot 2 (last 4). LRS first.
        assert_eq!(st.ps, [1, 0]);
        assert_eq!(st.pb, [21, 22]);
        assert_eq!(
            (st.map[2], st.map[5], st.map[7], st.map[0]),
            (21, 22, 20, 12)
        );
        assert_eq!(
            (st.last[2], st.last[5], st.last[7], st.last[0]),
            (5, 5, 4, 5)
        );
    }

    #[test]
    fn ties_by_slot_index_and_cap_zero() {
        let slots = [3, 1, 2];
        let mut st = state(4, 1, 1, 3);
        st.map[3] = 0;
        st.map[1] = 1;
        st.map[2] = 2;
        st.last.fill(5);
        let stats = run(1, &[7, 8], 2, &slots, 3, &mut st, 6, 3).unwrap();
        assert_eq!(stats.pairs, 2);
        assert_eq!(st.ps, [0, 1, -1]);
        assert_eq!(st.pb, [7, 8, -1]);
        // fetch_cap 0: nothing moves, but kept blocks are still touched.
        let mut st2 = state(4, 1, 1, 0);
        st2.map.copy_from_slice(&st.map);
        let stats = run(1, &[2, 9], 2, &slots, 3, &mut st2, 7, 0).unwrap();
        assert_eq!(
            stats,
            SelectStats {
                pairs: 0,
                kept: 1,
                missing: 1
            }
        );
        assert_eq!(st2.map, st.map);
        assert_eq!(st2.last[2], 7);
    }

    #[test]
    fn budget_zero_is_a_noop() {
        let mut st = state(2, 2, 3, 1);
        let stats = run(2, &[], 0, &[], 0, &mut st, 1, 1).unwrap();
        assert_eq!(stats, SelectStats::default());
        assert_eq!(st.ps, [-1; 6]);
        let mut st = state(2, 2, 0, 0);
        run(2, &[], 0, &[], 0, &mut st, 1, 0).unwrap();
        assert!(st.map.iter().all(|&x| x == -1));
    }

    #[test]
    fn validation_errors_leave_state_untouched() {
        let h = 2;
        let mut st = state(6, h, 2, 2);
        let slots = [0, 1, 2, 3];
        let pred = [4, 5, 4, 5, 4, 5, 4, 5];
        let check = |st: &St| {
            assert!(st.map.iter().chain(&st.last).all(|&x| x == -1));
            assert!(st.ps.iter().chain(&st.pb).all(|&x| x == 7));
        };
        let r = run(h, &pred, 2, &slots, 2, &mut st, 1, 2);
        assert!(r.is_ok());
        let mut st = state(6, h, 2, 2);
        assert!(matches!(
            run(h, &pred, 3, &slots, 2, &mut st, 1, 2),
            Err(OasisError::Invalid(_))
        ));
        assert!(matches!(
            run(0, &pred, 2, &slots, 2, &mut st, 1, 2),
            Err(OasisError::Config(_))
        ));
        let r = run(h, &pred[1..], 2, &slots, 2, &mut st, 1, 2);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "predicted",
                ..
            })
        ));
        let r = run(h, &pred, 2, &slots[1..], 2, &mut st, 1, 2);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "slot_pages",
                ..
            })
        ));
        let r = run(h, &pred, 2, &[0, 1, 2, 6], 2, &mut st, 1, 2);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "slot_pages",
                index: 6,
                bound: 6
            })
        ));
        let r = run(h, &pred, 2, &[0, 1, -1, 2], 2, &mut st, 1, 2);
        assert!(matches!(
            r,
            Err(OasisError::IndexOutOfRange {
                what: "slot_pages",
                index: -1,
                ..
            })
        ));
        assert!(matches!(
            run(h, &pred, 2, &[0, 1, 2, 0], 2, &mut st, 1, 2),
            Err(OasisError::Invalid(_))
        ));
        let r = run(h, &pred, 2, &slots, 2, &mut st, 1, 3);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "plan_slots",
                ..
            })
        ));
        check(&st);
        let mut bad = state(6, h, 2, 2);
        bad.pb.pop();
        let r = run(h, &pred, 2, &slots, 2, &mut bad, 1, 2);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "plan_blocks",
                ..
            })
        ));
        let mut bad = state(6, h, 2, 2);
        bad.map.pop();
        let r = run(h, &pred, 2, &slots, 2, &mut bad, 1, 2);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "page_map",
                ..
            })
        ));
        let mut bad = state(6, h, 2, 2);
        bad.last.pop();
        let r = run(h, &pred, 2, &slots, 2, &mut bad, 1, 2);
        assert!(matches!(
            r,
            Err(OasisError::Shape {
                what: "page_last_selected",
                ..
            })
        ));
    }
}
