//! [`RowCache`]: which logical blocks of one staged request hold a host row, and which to evict.
//!
//! A request admitted from a staging daemon with the partial transfer (issue 11) has a block id
//! (its summary, scored every step) for every logical block, but host rows (`host_k`/`host_v`, the
//! host budget) only for `C` cached blocks plus the blocks it writes itself. Before a layer's
//! gather, the blocks its plan reads must hold rows: [`RowCache::cache_blocks`] gives rows to the
//! uncached ones, evicting the least recently used cached blocks that the gather does not read.
//! The caller reads the bytes of every newly given row over the network, and forgets the bytes of
//! every evicted one (so a block crosses the network again only after its eviction).
//!
//! Invariants ([`RowCache::check_invariants`], and a property test below):
//! * at most `C` blocks are cached, each in its own row, every row one of the `C` the request
//!   holds;
//! * a call never evicts a block it is asked to keep (`pinned`) or to cache (`logicals`);
//! * a call that cannot fit its blocks (more uncached blocks than free rows plus evictable ones)
//!   is refused and changes nothing;
//! * the blocks evicted are the least recently used of the evictable ones (ties: lower row slot).

use std::collections::{HashMap, HashSet};

use oasis_core::{OasisError, Result, Tier};

/// The answer of [`RowCache::cache_blocks`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Cached {
    /// The row of each requested logical block, in the order asked.
    pub rows: Vec<u32>,
    /// The requested logical blocks (distinct, first-asked order) that were not cached before the
    /// call: their rows hold stale bytes until the caller reads them.
    pub given: Vec<usize>,
    /// `(logical, row)` of every block evicted by the call: its bytes in `row` are gone.
    pub evicted: Vec<(usize, u32)>,
}

/// The `C` cache rows of one request and the blocks they hold, least recently used first out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowCache {
    /// The rows this request holds for caching (from the host-row pool), slot order.
    rows: Vec<u32>,
    /// The logical block each slot holds, `None` when free.
    holds: Vec<Option<usize>>,
    /// The call (stamp) at which each slot was last given or asked for.
    last_use: Vec<u64>,
    /// Logical block -> slot, for the cached blocks.
    slot_of: HashMap<usize, usize>,
    clock: u64,
}

impl RowCache {
    /// A cache over `rows` (its capacity `C` is their number), every one free.
    pub fn new(rows: Vec<u32>) -> Self {
        let n = rows.len();
        Self {
            rows,
            holds: vec![None; n],
            last_use: vec![0; n],
            slot_of: HashMap::new(),
            clock: 0,
        }
    }

    /// `C`: the rows held for caching.
    pub fn capacity(&self) -> usize {
        self.rows.len()
    }

    /// The rows held for caching, slot order (freed with the request).
    pub fn rows(&self) -> &[u32] {
        &self.rows
    }

    /// Blocks cached now.
    pub fn num_cached(&self) -> usize {
        self.slot_of.len()
    }

    /// The row of logical block `logical`, if it is cached.
    pub fn row_of(&self, logical: usize) -> Option<u32> {
        self.slot_of.get(&logical).map(|&s| self.rows[s])
    }

    /// The cached blocks and their rows, in no particular order.
    pub fn cached(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        self.slot_of.iter().map(|(&l, &s)| (l, self.rows[s]))
    }

    /// Give a row to every logical block of `logicals` (repeats allowed) that has none, evicting
    /// the least recently used cached blocks that are neither in `pinned` nor in `logicals`; the
    /// blocks of `logicals` count as used now. `pinned` is what must stay readable while the rows
    /// are refilled: the blocks the layer being gathered reads (a superset of `logicals` or not).
    ///
    /// # Errors
    /// [`OasisError::OutOfBlocks`] (host tier) when the uncached blocks outnumber the free rows
    /// plus the evictable cached blocks (every row is pinned): `requested` the uncached blocks,
    /// `free` the rows that could be given. Nothing changes then.
    pub fn cache_blocks(&mut self, logicals: &[usize], pinned: &[usize]) -> Result<Cached> {
        let keep: HashSet<usize> = pinned.iter().chain(logicals).copied().collect();
        let mut given = Vec::new();
        let mut seen = HashSet::new();
        for &l in logicals {
            if !self.slot_of.contains_key(&l) && seen.insert(l) {
                given.push(l);
            }
        }
        let mut free: Vec<usize> = (0..self.rows.len())
            .filter(|&s| self.holds[s].is_none())
            .collect();
        let mut victims: Vec<usize> = (0..self.rows.len())
            .filter(|&s| self.holds[s].is_some_and(|l| !keep.contains(&l)))
            .collect();
        if given.len() > free.len() + victims.len() {
            return Err(OasisError::OutOfBlocks {
                tier: Tier::Host,
                requested: given.len(),
                free: free.len() + victims.len(),
            });
        }
        self.clock += 1;
        let now = self.clock;
        // Free rows first (lowest slot first), then the least recently used victims.
        free.reverse();
        victims.sort_by_key(|&s| (self.last_use[s], s));
        victims.reverse();
        let mut evicted = Vec::new();
        for &l in &given {
            let s = match free.pop() {
                Some(s) => s,
                None => {
                    let s = victims.pop().expect("counted above");
                    let old = self.holds[s].take().expect("a victim holds a block");
                    self.slot_of.remove(&old);
                    evicted.push((old, self.rows[s]));
                    s
                }
            };
            self.holds[s] = Some(l);
            self.slot_of.insert(l, s);
        }
        let rows = logicals
            .iter()
            .map(|l| {
                let s = self.slot_of[l];
                self.last_use[s] = now;
                self.rows[s]
            })
            .collect();
        Ok(Cached {
            rows,
            given,
            evicted,
        })
    }

    /// Check the invariants (tests and debug builds).
    ///
    /// # Errors
    /// [`OasisError::Invalid`] describing the first violation.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |m: String| Err(OasisError::Invalid(m));
        let n = self.rows.len();
        if self.holds.len() != n || self.last_use.len() != n {
            return bad("row cache: parallel vectors of different lengths".into());
        }
        if self.rows.iter().collect::<HashSet<_>>().len() != n {
            return bad("row cache: a row listed twice".into());
        }
        let held = self.holds.iter().flatten().count();
        if held != self.slot_of.len() {
            return bad("row cache: slot map and slots disagree".into());
        }
        for (&l, &s) in &self.slot_of {
            if self.holds.get(s) != Some(&Some(l)) {
                return bad(format!(
                    "row cache: block {l} maps to slot {s}, which does not hold it"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fills_free_rows_then_evicts_the_least_recently_used() {
        let mut c = RowCache::new(vec![10, 11, 12]);
        let a = c.cache_blocks(&[5, 6], &[5, 6]).unwrap();
        assert_eq!(a.rows, vec![10, 11]);
        assert_eq!(a.given, vec![5, 6]);
        assert!(a.evicted.is_empty());
        let a = c.cache_blocks(&[7, 5], &[7, 5]).unwrap(); // 5 touched, 7 takes the free row
        assert_eq!((a.rows, a.given), (vec![12, 10], vec![7]));
        // Full: 8 evicts 6 (used at call 1; 5 and 7 at call 2).
        let a = c.cache_blocks(&[8], &[8]).unwrap();
        assert_eq!((a.rows, a.evicted), (vec![11], vec![(6, 11)]));
        // Pinned blocks are never evicted: with 5 and 7 pinned, 9 takes 8's row.
        let a = c.cache_blocks(&[9], &[5, 7, 9]).unwrap();
        assert_eq!(a.evicted, vec![(8, 11)]);
        // Asked again while cached: no read, no eviction.
        let a = c.cache_blocks(&[9, 9, 5], &[]).unwrap();
        assert_eq!((a.rows, a.given.len()), (vec![11, 11, 10], 0));
        c.check_invariants().unwrap();
    }

    #[test]
    fn refuses_when_every_row_is_pinned_and_changes_nothing() {
        let mut c = RowCache::new(vec![0, 1]);
        c.cache_blocks(&[1, 2], &[]).unwrap();
        let before = c.clone();
        let e = c.cache_blocks(&[3], &[1, 2]).unwrap_err();
        assert!(
            matches!(
                e,
                OasisError::OutOfBlocks {
                    tier: Tier::Host,
                    requested: 1,
                    free: 0
                }
            ),
            "{e}"
        );
        assert_eq!(c, before);
        let e = c.cache_blocks(&[3, 4, 5], &[]).unwrap_err();
        assert!(matches!(
            e,
            OasisError::OutOfBlocks {
                requested: 3,
                free: 2,
                ..
            }
        ));
        assert_eq!(c, before);
        // An empty cache refuses any uncached block, and accepts an empty call.
        let mut empty = RowCache::new(Vec::new());
        assert!(empty.cache_blocks(&[0], &[]).is_err());
        assert_eq!(empty.cache_blocks(&[], &[]).unwrap(), Cached::default());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Random plans against a model: an eviction never hits a block of `pinned` or of the
        /// call's own blocks, evicts the least recently used evictable blocks, every asked block
        /// is cached afterwards, and a block is given (read) again only after it was evicted.
        #[test]
        fn evictions_never_hit_planned_blocks(
            cap in 0usize..6,
            calls in prop::collection::vec(
                (prop::collection::vec(0usize..12, 0..6), prop::collection::vec(0usize..12, 0..6)),
                1..40,
            ),
        ) {
            let mut c = RowCache::new((100..100 + cap as u32).collect());
            // The model: which blocks hold their bytes (read and not evicted since), and when
            // each was last used.
            let mut present: HashSet<usize> = HashSet::new();
            let mut used: HashMap<usize, usize> = HashMap::new();
            let mut reads: HashMap<usize, usize> = HashMap::new();
            let mut evictions: HashMap<usize, usize> = HashMap::new();
            for (step, (logicals, pinned)) in calls.iter().enumerate() {
                let before = c.clone();
                let keep: HashSet<usize> = pinned.iter().chain(logicals).copied().collect();
                let uncached: HashSet<usize> =
                    logicals.iter().copied().filter(|l| !present.contains(l)).collect();
                let evictable: Vec<usize> =
                    present.iter().copied().filter(|l| !keep.contains(l)).collect();
                let room = cap - present.len() + evictable.len();
                match c.cache_blocks(logicals, pinned) {
                    Err(_) => {
                        prop_assert!(uncached.len() > room);
                        prop_assert_eq!(&c, &before);
                        continue;
                    }
                    Ok(got) => {
                        prop_assert!(uncached.len() <= room);
                        prop_assert_eq!(got.given.iter().copied().collect::<HashSet<_>>(), uncached.clone());
                        for &(l, row) in &got.evicted {
                            prop_assert!(!keep.contains(&l), "evicted planned block {}", l);
                            prop_assert!(present.remove(&l));
                            prop_assert_eq!(before.row_of(l), Some(row));
                            *evictions.entry(l).or_default() += 1;
                        }
                        // LRU: no evictable block that stays was used before an evicted one.
                        let oldest_kept = evictable
                            .iter()
                            .filter(|l| !got.evicted.iter().any(|(e, _)| e == *l))
                            .map(|l| used[l])
                            .min();
                        if let Some(k) = oldest_kept {
                            for (e, _) in &got.evicted {
                                prop_assert!(used[e] <= k);
                            }
                        }
                        for &l in &got.given {
                            // Read again only after an eviction.
                            let r = reads.entry(l).or_default();
                            prop_assert_eq!(*r, evictions.get(&l).copied().unwrap_or(0));
                            *r += 1;
                            present.insert(l);
                        }
                        for (l, row) in logicals.iter().zip(&got.rows) {
                            prop_assert_eq!(c.row_of(*l), Some(*row));
                            used.insert(*l, step);
                        }
                        let rows: HashSet<u32> = c.cached().map(|(_, r)| r).collect();
                        prop_assert_eq!(rows.len(), c.num_cached());
                        prop_assert!(c.num_cached() <= cap);
                        prop_assert_eq!(c.cached().map(|(l, _)| l).collect::<HashSet<_>>(), present.clone());
                        c.check_invariants().unwrap();
                    }
                }
            }
        }
    }
}
