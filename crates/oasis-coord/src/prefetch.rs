//! Prefetch: background reads of the block-heads a step is likely to plan next, queued after
//! the step's own reads ([`crate::Coordinator::submit_step`]).
//!
//! For every `(layer, request, KV head)` a step plans, the candidates are, closest first:
//! 1. rank 0: the successor (logical block `b + 1`) of each planned block `b` (a selection that
//!    picks a block tends to pick its neighbour as the query moves on);
//! 2. ranks 1..=[`PREFETCH_RECENT`]: the request's most recent staged blocks (the highest
//!    logical blocks, nearest its local block, which recent queries attend most).
//!
//! Only entries of staged rows (a block the request holds a row for and reads from the daemon)
//! qualify, and only absent ones that are not in flight, not planned by the step itself and not
//! of a failed request. The candidates are ranked (rank, layer, request, head, block), each
//! taken once, and cut at the step's budget: [`select`] is pure, so its rules are tested alone.
//!
//! The budget ([`crate::Coordinator::submit_step`]'s `prefetch`) bounds both one step's
//! prefetch and the prefetched block-heads in flight at once: a step queues at most `budget -
//! in flight`, so prefetch uses the link only while its earlier prefetches have landed (the link
//! has room) and never builds a backlog in front of later steps.

use std::collections::{BTreeMap, HashMap, HashSet};

use oasis_runtime::Entry;

/// A good default for [`crate::Coordinator::submit_step`]'s budget: block-heads prefetched per
/// step and in flight at once (arbitrary, sized for a link of a few GB/s and steps of ~10 ms:
/// 512 bf16 block-heads of 16 x 128 are 4 MiB).
pub const DEFAULT_PREFETCH_ENTRIES: usize = 512;

/// How many of a request's most recent staged blocks are candidates per planned
/// `(layer, request, head)` (after the successors).
pub const PREFETCH_RECENT: usize = 2;

/// A staged request's rows by logical block: the coordinator's reverse index of the presence
/// map's staged rows (request -> logical block -> host row).
pub type RowsOf = HashMap<i64, BTreeMap<u32, u32>>;

/// A block-head a step planned (or a prefetch candidate): the entry, its request and the
/// logical block its row holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Planned {
    pub entry: Entry,
    pub owner: i64,
    pub logical: u32,
}

/// The prefetch candidates of a step's `planned` block-heads (one head each; see the module
/// docs), at most `budget`, each once, none planned and every one `wanted` (absent, not in
/// flight, of a live request: the caller's test), sorted by entry (layer order, for the frames).
pub fn select(
    planned: &[Planned],
    rows_of: &RowsOf,
    budget: usize,
    wanted: impl Fn(Entry) -> bool,
) -> Vec<Planned> {
    if budget == 0 || planned.is_empty() {
        return Vec::new();
    }
    let planned_set: HashSet<Entry> = planned.iter().map(|p| p.entry).collect();
    // (layer, owner, head) -> the planned logical blocks.
    let mut groups: BTreeMap<(u16, i64, u16), Vec<u32>> = BTreeMap::new();
    for p in planned {
        groups
            .entry((p.entry.layer, p.owner, p.entry.head))
            .or_default()
            .push(p.logical);
    }
    // (rank, layer, owner, head, logical, row)
    let mut cands: Vec<(usize, u16, i64, u16, u32, u32)> = Vec::new();
    for (&(layer, owner, head), logicals) in &groups {
        let Some(rows) = rows_of.get(&owner) else {
            continue;
        };
        for &b in logicals {
            if let Some(next) = b.checked_add(1) {
                if let Some(&row) = rows.get(&next) {
                    cands.push((0, layer, owner, head, next, row));
                }
            }
        }
        for (i, (&logical, &row)) in rows.iter().rev().take(PREFETCH_RECENT).enumerate() {
            cands.push((1 + i, layer, owner, head, logical, row));
        }
    }
    cands.sort_unstable();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (_, layer, owner, head, logical, row) in cands {
        if out.len() == budget {
            break;
        }
        let entry = Entry { layer, row, head };
        if planned_set.contains(&entry) || !seen.insert(entry) || !wanted(entry) {
            continue;
        }
        out.push(Planned {
            entry,
            owner,
            logical,
        });
    }
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn e(layer: u16, row: u32, head: u16) -> Entry {
        Entry { layer, row, head }
    }

    /// Request 1 holds logical blocks 0..6 in rows 10..16; request 2 blocks 0..3 in rows 20..23.
    fn rows() -> RowsOf {
        let mut m = RowsOf::new();
        m.insert(1, (0..6).map(|b| (b, 10 + b)).collect());
        m.insert(2, (0..3).map(|b| (b, 20 + b)).collect());
        m
    }

    #[test]
    fn successors_first_then_the_most_recent_blocks() {
        let planned = [Planned {
            entry: e(0, 11, 1),
            owner: 1,
            logical: 1,
        }];
        let got = select(&planned, &rows(), 10, |_| true);
        let entries: Vec<Entry> = got.iter().map(|p| p.entry).collect();
        // successor: block 2 (row 12); recent: blocks 5 and 4 (rows 15, 14); same layer, head.
        assert_eq!(entries, vec![e(0, 12, 1), e(0, 14, 1), e(0, 15, 1)]);
        // A budget of one keeps the successor (rank 0).
        let got = select(&planned, &rows(), 1, |_| true);
        assert_eq!(got[0].entry, e(0, 12, 1));
        assert_eq!(got[0].logical, 2);
    }

    #[test]
    fn nothing_planned_present_or_unstaged_is_taken() {
        // Block 5 of request 1 is planned and its successor (6) has no staged row.
        let planned = [
            Planned {
                entry: e(1, 15, 0),
                owner: 1,
                logical: 5,
            },
            Planned {
                entry: e(1, 14, 0),
                owner: 1,
                logical: 4,
            },
        ];
        // Row 15 is planned; block 4's successor is block 5: planned. Recent: 5 (planned), 4
        // (planned). Nothing is left.
        assert!(select(&planned, &rows(), 10, |_| true).is_empty());
        // An entry the caller does not want (present, in flight) is skipped.
        let one = [Planned {
            entry: e(0, 20, 0),
            owner: 2,
            logical: 0,
        }];
        let got = select(&one, &rows(), 10, |x| x.row != 21);
        assert_eq!(
            got.iter().map(|p| p.entry).collect::<Vec<_>>(),
            vec![e(0, 22, 0)]
        );
        assert!(select(&one, &rows(), 0, |_| true).is_empty());
        assert!(select(&one, &RowsOf::new(), 10, |_| true).is_empty());
    }

    proptest! {
        #[test]
        fn selection_keeps_its_rules(
            blocks in proptest::collection::vec(0u32..12, 1..4),
            picks in proptest::collection::vec((0u16..3, 0usize..4, 0u16..2, 0u32..12), 1..20),
            present in proptest::collection::hash_set((0u16..3, 0u32..64, 0u16..2), 0..40),
            budget in 0usize..12,
        ) {
            // Request i holds `blocks[i]` staged blocks, rows from 16 * i on.
            let mut rows_of = RowsOf::new();
            for (i, &n) in blocks.iter().enumerate() {
                rows_of.insert(i as i64, (0..n).map(|b| (b, 16 * i as u32 + b)).collect());
            }
            let planned: Vec<Planned> = picks
                .iter()
                .filter_map(|&(layer, o, head, b)| {
                    let o = o % blocks.len();
                    let row = *rows_of[&(o as i64)].get(&b)?;
                    Some(Planned { entry: e(layer, row, head), owner: o as i64, logical: b })
                })
                .collect();
            let wanted = |x: Entry| !present.contains(&(x.layer, x.row, x.head));
            let got = select(&planned, &rows_of, budget, wanted);
            prop_assert!(got.len() <= budget);
            let set: HashSet<Entry> = got.iter().map(|p| p.entry).collect();
            prop_assert_eq!(set.len(), got.len(), "no duplicates");
            let planned_set: HashSet<Entry> = planned.iter().map(|p| p.entry).collect();
            for p in &got {
                prop_assert!(wanted(p.entry) && !planned_set.contains(&p.entry));
                // Its row holds its logical block of its owner.
                prop_assert_eq!(rows_of[&p.owner].get(&p.logical), Some(&p.entry.row));
                // A successor or a recent block of a planned (layer, owner, head).
                let group: Vec<&Planned> = planned
                    .iter()
                    .filter(|q| q.owner == p.owner && q.entry.layer == p.entry.layer
                        && q.entry.head == p.entry.head)
                    .collect();
                let n = blocks[p.owner as usize];
                let successor = group.iter().any(|q| q.logical + 1 == p.logical);
                let recent = p.logical + PREFETCH_RECENT as u32 >= n;
                prop_assert!(!group.is_empty() && (successor || recent));
            }
            // Sorted by entry (layer order).
            prop_assert!(got.windows(2).all(|w| w[0].entry < w[1].entry));
            // A budget that binds takes every successor before any recent-only block.
            if got.len() == budget {
                let all = select(&planned, &rows_of, usize::MAX, wanted);
                let is_succ = |p: &Planned| planned.iter().any(|q| q.owner == p.owner
                    && q.entry.layer == p.entry.layer && q.entry.head == p.entry.head
                    && q.logical + 1 == p.logical);
                let succ_all = all.iter().filter(|p| is_succ(p)).count();
                let succ_got = got.iter().filter(|p| is_succ(p)).count();
                prop_assert_eq!(succ_got, succ_all.min(budget));
            }
        }
    }
}
