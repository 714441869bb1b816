//! The items in flight as a step's submission sees them: a step taking over background reads
//! it needs ([`take_over`]), the registration of new items ([`items_of`]), the prefetch hits
//! ([`count_hits`]) and a step's prefetch as items ([`prefetch_items`]). Helpers of
//! [`crate::Coordinator::submit_step`], under the coordinator's lock.

use std::collections::HashSet;

use oasis_rt::protocol::{BlockKey, ALL_HEADS};
use oasis_runtime::Entry;

use crate::coordinator::{heads_of, Item, Reg, State};

use crate::error::Result;
use crate::prefetch::{self, Planned};

impl State {
    pub(crate) fn fail(&mut self, owner: i64, message: String) {
        self.dead.insert(owner);
        self.failed.entry(owner).or_insert(message);
    }

    /// The registered item in flight that carries block-head `e`.
    pub(crate) fn item_of(&self, e: Entry) -> Option<(Entry, Reg)> {
        let whole = Entry {
            head: ALL_HEADS,
            ..e
        };
        [e, whole]
            .into_iter()
            .find_map(|k| self.items.get(&k).map(|r| (k, *r)))
    }

    /// Forget item `key` (landed, failed or taken over): its counters, and (taken over) its
    /// block-heads in flight.
    pub(crate) fn unregister(&mut self, key: Entry, reg: Reg, owner: i64, heads: usize) {
        self.items.remove(&key);
        if reg.step {
            self.pending[usize::from(key.layer)] -= 1;
        }
        if reg.prefetch {
            self.prefetch_inflight -= heads_of(key, heads).len();
        }
        if let Some(n) = self.inflight_of.get_mut(&owner) {
            *n -= 1;
            if *n == 0 {
                self.inflight_of.remove(&owner);
            }
        }
        let at = (owner, key.layer);
        if let Some(n) = self.inflight_layer_of.get_mut(&at) {
            *n -= 1;
            if *n == 0 {
                self.inflight_layer_of.remove(&at);
            }
        }
        for h in heads_of(key, heads) {
            self.inflight.remove(&Entry { head: h, ..key });
        }
    }

    /// Drop `owner`'s items whose frames have not gone out (it ends): their frames send the
    /// others only. Counted as failed reads (a frame dropped unsent), a prefetch as cancelled.
    pub(crate) fn drop_queued(&mut self, owner: i64) {
        let heads = self.presence.shape().2;
        let queued: Vec<(Entry, Reg)> = self
            .items
            .iter()
            .filter(|(k, r)| {
                !r.started && self.presence.owner_of(k.row).is_ok_and(|o| o.0 == owner)
            })
            .map(|(k, r)| (*k, *r))
            .collect();
        for (k, r) in queued {
            self.unregister(k, r, owner, heads);
            let n = heads_of(k, heads).len() as u64;
            if r.prefetch {
                self.stats.prefetch_cancelled += n;
            } else {
                self.stats.failed_entries += n; // as a frame dropped unsent
            }
        }
    }

    /// A frame's items about to go out: the ones still registered (a step may have taken some
    /// over), marked started.
    pub(crate) fn start(&mut self, items: Vec<Item>) -> Vec<Item> {
        items
            .into_iter()
            .filter(|it| match self.items.get_mut(&it.entry) {
                Some(r) if r.id == it.id => {
                    r.started = true;
                    true
                }
                _ => false,
            })
            .collect()
    }

    /// Items of `owner` in flight (of `layer` only, when given).
    pub(crate) fn in_flight(&self, owner: i64, layer: Option<u16>) -> usize {
        match layer {
            None => self.inflight_of.get(&owner).copied().unwrap_or(0),
            Some(l) => self
                .inflight_layer_of
                .get(&(owner, l))
                .copied()
                .unwrap_or(0),
        }
    }
}

/// Prefetch frames stay this much smaller than a step's (`frame_bytes / 4`): a step's frame on
/// the same connection waits behind at most one of them.
pub const PREFETCH_FRAME_DIVISOR: usize = 4;

/// The planned block-heads of `keys` that a prefetch brought count as hits (once each).
pub(crate) fn count_hits(st: &mut State, keys: &[Entry], heads: usize) {
    if st.prefetched.is_empty() {
        return;
    }
    for &k in keys {
        for h in heads_of(k, heads) {
            if st.prefetched.remove(&Entry { head: h, ..k }) {
                st.stats.prefetch_hits += 1;
            }
        }
    }
}

/// A step needs the `absent` block-heads: the ones in flight in the background are taken over
/// (queued: returned, every head of their item, for the step to read) or awaited (on the wire:
/// counted in their layer's wait and in `per_layer`).
pub(crate) fn take_over(
    st: &mut State,
    absent: &[Entry],
    per_layer: &mut [u32],
    heads: usize,
) -> Vec<Entry> {
    let mut taken = Vec::new();
    for &e in absent {
        if !st.inflight.contains(&e) {
            continue;
        }
        let Some((key, reg)) = st.item_of(e) else {
            continue;
        };
        if reg.step {
            continue;
        }
        let n = heads_of(key, heads).len();
        let Ok((owner, _)) = st.presence.owner_of(key.row) else {
            continue;
        };
        if reg.started {
            if let Some(r) = st.items.get_mut(&key) {
                r.step = true;
            }
            st.pending[usize::from(key.layer)] += 1;
            per_layer[usize::from(key.layer)] += n as u32;
            if reg.prefetch {
                st.stats.prefetch_hits += n as u64;
            }
        } else {
            st.unregister(key, reg, owner, heads);
            if reg.prefetch {
                st.stats.prefetch_taken += n as u64;
            }
            taken.extend(heads_of(key, heads).map(|h| Entry { head: h, ..key }));
        }
    }
    taken
}

/// Items by layer for the `absent` block-heads (sorted, none in flight), registered in flight:
/// a row's heads merged into one whole block when all are absent and it was asked for whole.
pub(crate) fn items_of(
    st: &mut State,
    absent: &[Entry],
    whole: &HashSet<(u16, u32)>,
    step: bool,
    prefetch: bool,
) -> Result<Vec<Vec<Item>>> {
    let (layers, _, heads) = st.presence.shape();
    let mut by_layer: Vec<Vec<Item>> = vec![Vec::new(); layers];
    let mut i = 0;
    while i < absent.len() {
        let e = absent[i];
        let mut j = i;
        while j < absent.len() && absent[j].layer == e.layer && absent[j].row == e.row {
            j += 1;
        }
        let group: Vec<Entry> = if j - i == heads && whole.contains(&(e.layer, e.row)) {
            vec![Entry {
                head: ALL_HEADS,
                ..e
            }]
        } else {
            absent[i..j].to_vec()
        };
        let (owner, logical) = st.presence.owner_of(e.row)?;
        let Some(request) = st.daemon_of.get(&owner).copied() else {
            st.fail(
                owner,
                format!(
                    "host row {} holds a staged block of request {owner}, which was never \
                     staged with the coordinator",
                    e.row
                ),
            );
            i = j;
            continue;
        };
        for g in group {
            let id = st.next_id;
            st.next_id += 1;
            st.items.insert(
                g,
                Reg {
                    id,
                    step,
                    started: false,
                    prefetch,
                },
            );
            if step {
                st.pending[usize::from(g.layer)] += 1;
            }
            *st.inflight_of.entry(owner).or_insert(0) += 1;
            *st.inflight_layer_of.entry((owner, g.layer)).or_insert(0) += 1;
            by_layer[usize::from(g.layer)].push(Item {
                id,
                entry: g,
                owner,
                key: BlockKey {
                    request,
                    layer: g.layer,
                    block: logical,
                    head: g.head,
                },
            });
        }
        st.stats.sent_entries += (j - i) as u64;
        if prefetch {
            st.stats.prefetch_entries += (j - i) as u64;
            st.prefetch_inflight += j - i;
        }
        st.inflight.extend(absent[i..j].iter().copied());
        i = j;
    }
    Ok(by_layer)
}

/// The prefetch of a step that planned `keys` ([`prefetch::select`]), as background items.
pub(crate) fn prefetch_items(
    st: &mut State,
    keys: &[Entry],
    budget: usize,
    heads: usize,
) -> Result<Vec<Vec<Item>>> {
    let mut planned = Vec::with_capacity(keys.len());
    for &k in keys {
        let (owner, logical) = st.presence.owner_of(k.row)?;
        if st.rows_of.contains_key(&owner) && !st.dead.contains(&owner) {
            for h in heads_of(k, heads) {
                let entry = Entry { head: h, ..k };
                planned.push(Planned {
                    entry,
                    owner,
                    logical,
                });
            }
        }
    }
    let chosen = {
        let s: &State = st;
        prefetch::select(&planned, &s.rows_of, budget, |e| {
            !s.inflight.contains(&e)
                && !s
                    .dead
                    .contains(&s.presence.owner_of(e.row).map_or(-1, |o| o.0))
                && s.presence.is_present(e).is_ok_and(|p| !p)
        })
    };
    let entries: Vec<Entry> = chosen.iter().map(|p| p.entry).collect();
    items_of(st, &entries, &HashSet::new(), false, true)
}
