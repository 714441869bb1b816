//! [`Coordinator`]: the decode side's remote reads, off the caller's thread.
//!
//! ```text
//!  caller (the engine's Python thread)        coordinator runtime (tokio, own threads)
//!  submit(step's planned entries) ──┐
//!    presence: absent, not in flight│ frames in layer order, round robin ─▶ worker 0 ── conn 0
//!    returns at once                └──────────────────────────────────────▶ worker 1 ── conn 1
//!  wait_layer(0) ◀── condvar ── land(): bytes written into the pool,        ...
//!  gather(0)                           then entries marked present
//!  wait_layer(1) ...                   failures: their requests, take_failed()
//! ```
//!
//! The state behind one mutex: the [`PresenceMap`], the staged requests (engine request id ->
//! daemon request id), the entries in flight (per layer, per request, per request and layer:
//! [`Coordinator::wait_layer`] waits for a step's layer, [`Coordinator::wait_request`] for one
//! request's, e.g. an admission streaming a whole request in while others decode), the failed
//! requests and their messages, the counters. Each connection is a tokio task with two queues,
//! a step's and a background one (an admission's stream, prefetches, releases), the step's
//! served first: the frames of each land in the order submitted (layer order), a step's frame
//! waits behind at most one background frame, and a step takes over the background reads it
//! needs ([`crate::prefetch`]); a frame never spans layers.
//!
//! Invariants:
//! * an entry is marked present only after its bytes are fully written into the pool; a failed
//!   read marks nothing (its request fails; its entries stay absent);
//! * no entry is read twice at once (the in-flight set), and a failed request's entries are not
//!   read again: not submitted, and its frames queued already are dropped unsent (so a stalled
//!   daemon costs it one frame's deadline, not one per frame);
//! * the pools are not written while a new layout is registered, nor a row after it changes
//!   hands: [`Coordinator::register_pools`] waits for every read, and [`Coordinator::end`] /
//!   [`Coordinator::forget_row`] for the reads of the row's request.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use oasis_rt::protocol::{BlockKey, ALL_HEADS, MAX_ENTRIES};
use oasis_runtime::{Entry, PresenceMap};
use tokio::sync::mpsc;

use crate::connect::Connector;
use crate::error::{CoordError, Result};
use crate::inflight::{count_hits, items_of, prefetch_items, take_over, PREFETCH_FRAME_DIVISOR};
use crate::pools::PoolLayout;
use crate::prefetch::{Planned, RowsOf};
pub use crate::stats::CoordStats;

/// Reply frames stay this small: a few MiB come from (and go back to) the allocator's heap,
/// while larger ones are fresh mappings whose page faults cost more than the copy (measured for
/// the Python client's bulk frames; the same number as `wire.BULK_FRAME_BYTES`).
pub const DEFAULT_FRAME_BYTES: usize = 4 << 20;
/// Bytes a reply frame spends besides its entries' data (header, counts), rounded up; and per
/// entry (its status and length). As `wire.FRAME_OVERHEAD` / `wire.READ_REPLY_ENTRY_BYTES`.
const FRAME_OVERHEAD: usize = 64;
const REPLY_ENTRY_BYTES: usize = 6;
/// A layer's entries are spread over several connections only past this many per connection
/// (arbitrary: below it a round trip costs more than the bytes).
pub const DEFAULT_SPLIT_MIN_ENTRIES: usize = 256;

/// How long [`Coordinator::close`] lets the connections' queued releases go (arbitrary: a few
/// loopback round trips; a stalled daemon's lease frees what is left).
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// The coordinator's settings.
#[derive(Clone, Debug)]
pub struct CoordConfig {
    /// Connections to the daemon, each a tokio task with its own queue (at least 1).
    pub connections: usize,
    /// How many times a frame that failed in transport (connection lost, timeout, daemon
    /// unreachable) reconnects and tries again before the requests of its entries fail.
    pub retries: u32,
    /// Threads of the coordinator's tokio runtime (at least 1).
    pub threads: usize,
    /// Reply frame budget (a frame carries at least one entry, whatever the budget).
    pub frame_bytes: usize,
    /// See [`DEFAULT_SPLIT_MIN_ENTRIES`].
    pub split_min_entries: usize,
    /// Read the bytes by RMA where the connection offers it (UCX).
    pub use_rma: bool,
}

impl Default for CoordConfig {
    fn default() -> Self {
        CoordConfig {
            connections: 1,
            retries: 0,
            threads: 1,
            frame_bytes: DEFAULT_FRAME_BYTES,
            split_min_entries: DEFAULT_SPLIT_MIN_ENTRIES,
            use_rma: true,
        }
    }
}

/// One entry of a frame: where it goes and what the daemon calls it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Item {
    /// Unique among the items ever submitted: tells a queued item from a later one of the same
    /// entry after a step took it over.
    pub(crate) id: u64,
    pub(crate) entry: Entry,
    pub(crate) owner: i64,
    pub(crate) key: BlockKey,
}

/// An item in flight, by its entry ([`State::items`]): the truth about it while its frame is
/// queued or on the wire.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reg {
    pub(crate) id: u64,
    /// Counted in its layer's [`State::pending`]: submitted for a step, or a background item a
    /// step needed once its frame was on the wire.
    pub(crate) step: bool,
    /// Its frame went to the daemon (a step can no longer take it over).
    pub(crate) started: bool,
    pub(crate) prefetch: bool,
}

/// A connection's two queues: a step's frames go first, then the background ones (an
/// admission's stream, releases), so a step waits behind at most one background frame.
pub(crate) struct Queues {
    step: mpsc::UnboundedSender<Job>,
    background: mpsc::UnboundedSender<Job>,
}

impl Queues {
    fn of(&self, step: bool) -> &mpsc::UnboundedSender<Job> {
        if step {
            &self.step
        } else {
            &self.background
        }
    }
}

/// One frame's reads.
pub(crate) struct Frame {
    pub(crate) items: Vec<Item>,
    pub(crate) layout: Arc<PoolLayout>,
}

/// A connection's work, in the order queued.
pub(crate) enum Job {
    Read(Frame),
    /// Release the daemon's staged request (best effort: [`CoordStats::releases`] /
    /// [`CoordStats::failed_releases`]).
    Release(u64),
}

pub(crate) struct State {
    pub(crate) presence: PresenceMap,
    pub(crate) layout: Option<Arc<PoolLayout>>,
    /// Engine request id -> the daemon's id of its staged copy.
    pub(crate) daemon_of: HashMap<i64, u64>,
    /// Requests whose reads failed (or that are ending): never read again until they end.
    pub(crate) dead: HashSet<i64>,
    /// Failures not taken yet, request -> its first message.
    pub(crate) failed: HashMap<i64, String>,
    /// Block-heads in flight (a whole block's as each of its heads).
    pub(crate) inflight: HashSet<Entry>,
    /// Items in flight by their entry (a whole block's as [`ALL_HEADS`]).
    pub(crate) items: HashMap<Entry, Reg>,
    pub(crate) next_id: u64,
    /// Staged rows by request and logical block ([`crate::prefetch::RowsOf`]).
    pub(crate) rows_of: RowsOf,
    /// Prefetched block-heads in flight; landed ones no step planned yet (for the hits); and
    /// the ones landed since the last step's submission, with their request and logical block
    /// (marked absent again if the pools move: their bytes may have missed the copy).
    pub(crate) prefetch_inflight: usize,
    pub(crate) prefetched: HashSet<Entry>,
    pub(crate) fresh: Vec<Planned>,
    /// Items in flight per request, and per request and layer.
    pub(crate) inflight_of: HashMap<i64, usize>,
    pub(crate) inflight_layer_of: HashMap<(i64, u16), usize>,
    /// Step items in flight per layer (not the background ones).
    pub(crate) pending: Vec<usize>,
    /// Per request since the last [`Coordinator::take_landed`]: block-heads landed, and its
    /// share of the frames' wire bytes (split evenly among a frame's items).
    pub(crate) landed: HashMap<i64, (u64, f64)>,
    pub(crate) stats: CoordStats,
    pub(crate) closed: bool,
}

pub(crate) struct Shared {
    state: Mutex<State>,
    /// Signalled whenever items land.
    landed: Condvar,
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wait until `done(state)`; how long that took.
    fn wait_until(&self, done: impl Fn(&State) -> bool) -> (MutexGuard<'_, State>, Duration) {
        let t0 = Instant::now();
        let mut st = self.lock();
        while !done(&st) {
            st = self.landed.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        (st, t0.elapsed())
    }

    /// A frame is done: `outcome[i]` is `None` when item `i`'s bytes are in the pool, else why
    /// it failed; `sent`: whether it went to the daemon (counted in [`CoordStats::frames`]).
    pub(crate) fn land(
        &self,
        items: &[Item],
        outcome: Vec<Option<String>>,
        busy: Duration,
        wire: u64,
        sent: bool,
    ) {
        let mut st = self.lock();
        let mut written = Vec::with_capacity(items.len());
        let mut owners = Vec::with_capacity(items.len());
        let mut prefetched = Vec::new();
        let share = wire as f64 / items.len().max(1) as f64;
        let heads = st.presence.shape().2;
        for (it, why) in items.iter().zip(outcome) {
            let reg = match st.items.get(&it.entry) {
                Some(r) if r.id == it.id => *r,
                _ => continue, // taken over by a step before it went out (never sent)
            };
            st.landed.entry(it.owner).or_insert((0, 0.0)).1 += share;
            st.unregister(it.entry, reg, it.owner, heads);
            match why {
                None => {
                    written.push(it.entry);
                    owners.push(it.owner);
                    prefetched.push((reg.prefetch, reg.step, it.key.block));
                }
                Some(m) => {
                    st.stats.failed_entries += heads_of(it.entry, heads).len() as u64;
                    st.fail(it.owner, m);
                }
            }
        }
        // The rows cannot have changed hands meanwhile (end and forget_row wait for the reads
        // of their request), so the keys are still in the map.
        if let Ok(new) = st.presence.mark_present(&written) {
            for (((owner, n), e), logical) in
                owners.into_iter().zip(new).zip(&written).zip(prefetched)
            {
                st.landed.entry(owner).or_insert((0, 0.0)).0 += u64::from(n);
                st.stats.entries += u64::from(n);
                let (prefetch, awaited, logical) = logical;
                if prefetch {
                    st.stats.prefetched_entries += u64::from(n);
                }
                // Not awaited by a step (which counted it a hit and gathers it in this step,
                // before the pools can move): a later step's hit, or stale after a move.
                if prefetch && !awaited {
                    st.prefetched.insert(*e);
                    st.fresh.push(Planned {
                        entry: *e,
                        owner,
                        logical,
                    });
                }
            }
        }
        st.stats.read_seconds += busy.as_secs_f64();
        st.stats.wire_bytes += wire;
        st.stats.frames += u64::from(sent);
        drop(st);
        self.landed.notify_all();
    }
}

pub(crate) fn heads_of(e: Entry, heads: usize) -> std::ops::Range<u16> {
    if e.head == ALL_HEADS {
        0..heads as u16
    } else {
        e.head..e.head + 1
    }
}

/// The decode side's remote reads (see the module docs).
pub struct Coordinator {
    shared: Arc<Shared>,
    senders: Mutex<Vec<Queues>>,
    next: AtomicUsize,
    rt: Mutex<Option<tokio::runtime::Runtime>>,
    /// The connections' tasks, for [`Coordinator::close`] to let their queued releases go.
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    config: CoordConfig,
}

impl Coordinator {
    /// Start the runtime and one task per connection (each connects on its first frame), for
    /// an engine of `layers` layers and `heads` KV heads.
    ///
    /// # Errors
    /// [`CoordError::Invalid`] for zero connections or threads, a frame budget too small for a
    /// block-head; [`CoordError::Presence`] for `layers`/`heads` out of range;
    /// [`CoordError::Runtime`] when tokio cannot start.
    pub fn start<K: Connector>(
        connector: K,
        config: CoordConfig,
        layers: usize,
        heads: usize,
    ) -> Result<Self> {
        if config.connections == 0
            || config.threads == 0
            || config.split_min_entries == 0
            || config.frame_bytes == 0
        {
            return Err(CoordError::Invalid(format!(
                "connections, threads, split_min_entries and frame_bytes must be >= 1, got {}, {}, \
                 {} and {}",
                config.connections, config.threads, config.split_min_entries, config.frame_bytes
            )));
        }
        let presence = PresenceMap::new(layers, heads)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .thread_name("oasis-coord")
            .enable_all()
            .build()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                presence,
                layout: None,
                daemon_of: HashMap::new(),
                dead: HashSet::new(),
                failed: HashMap::new(),
                inflight: HashSet::new(),
                items: HashMap::new(),
                next_id: 0,
                rows_of: RowsOf::new(),
                prefetch_inflight: 0,
                prefetched: HashSet::new(),
                fresh: Vec::new(),
                inflight_of: HashMap::new(),
                inflight_layer_of: HashMap::new(),
                pending: vec![0; layers],
                landed: HashMap::new(),
                stats: CoordStats::default(),
                closed: false,
            }),
            landed: Condvar::new(),
        });
        let connector = Arc::new(connector);
        let mut senders = Vec::with_capacity(config.connections);
        let mut tasks = Vec::with_capacity(config.connections);
        for index in 0..config.connections {
            let (step, step_rx) = mpsc::unbounded_channel();
            let (background, background_rx) = mpsc::unbounded_channel();
            senders.push(Queues { step, background });
            let w = crate::worker::Worker {
                index,
                connector: Arc::clone(&connector),
                client: None,
                shared: Arc::clone(&shared),
                retries: config.retries,
                use_rma: config.use_rma,
            };
            tasks.push(rt.spawn(w.run(step_rx, background_rx)));
        }
        Ok(Coordinator {
            shared,
            senders: Mutex::new(senders),
            next: AtomicUsize::new(0),
            rt: Mutex::new(Some(rt)),
            tasks: Mutex::new(tasks),
            config,
        })
    }

    /// The settings it runs with.
    pub fn config(&self) -> &CoordConfig {
        &self.config
    }

    /// Register the pools the reads write into (again whenever they grow or move), after every
    /// read in flight has landed; the presence map grows to their rows. When they move, the
    /// prefetched block-heads that landed since the last step's submission are absent again:
    /// they may have landed in the old pools after their copy (a step's own reads land within
    /// the step, before the caller can move the pools). Returns per request how many.
    ///
    /// # Errors
    /// [`CoordError::Invalid`] for a layout whose layers or heads are not the coordinator's.
    ///
    /// # Safety
    /// 1. Every address of `layout` (per layer `rows * heads * head_bytes` bytes from `k` and
    ///    from `v`, `rows * heads * 4` from each scale address) is memory that stays allocated
    ///    and unmoved until the next `register_pools` or [`Coordinator::close`] returns.
    /// 2. Nothing else writes the rows of staged requests' entries while they are in flight,
    ///    and nothing reads an entry of a layer before [`Coordinator::wait_layer`] of that layer
    ///    (or [`Coordinator::drain`]) returned after its submission.
    pub unsafe fn register_pools(&self, layout: PoolLayout) -> Result<Vec<(i64, u64)>> {
        layout.validate()?;
        let (st, _) = self.shared.wait_until(|s| s.inflight.is_empty());
        let mut st = st;
        let (layers, _, heads) = st.presence.shape();
        if layout.layers.len() != layers || layout.heads != heads {
            return Err(CoordError::Invalid(format!(
                "pools of {} layers and {} KV heads for a coordinator of {layers} and {heads}",
                layout.layers.len(),
                layout.heads
            )));
        }
        st.presence.grow(layout.rows)?;
        let moved = st.layout.as_deref().is_some_and(|l| *l != layout);
        st.layout = Some(Arc::new(layout));
        let mut dropped: HashMap<i64, u64> = HashMap::new();
        if moved {
            for p in std::mem::take(&mut st.fresh) {
                // Still the row of the same staged block, and present (not released since).
                if st.presence.owner_of(p.entry.row)? != (p.owner, p.logical)
                    || !st.presence.is_present(p.entry)?
                {
                    continue;
                }
                let n = st.presence.mark_absent(&[p.entry])?;
                st.prefetched.remove(&p.entry);
                st.stats.prefetch_dropped += n;
                *dropped.entry(p.owner).or_insert(0) += n;
            }
        }
        let mut out: Vec<_> = dropped.into_iter().collect();
        out.sort_unstable();
        Ok(out)
    }

    /// The registered layout's rows (0: none registered).
    pub fn rows(&self) -> usize {
        self.shared.lock().layout.as_ref().map_or(0, |l| l.rows)
    }

    /// Engine request `owner` reads from the daemon's request `daemon_id`.
    pub fn stage(&self, owner: i64, daemon_id: u64) {
        let mut st = self.shared.lock();
        st.daemon_of.insert(owner, daemon_id);
        st.dead.remove(&owner);
    }

    /// `owner` ends: its items not sent yet are dropped (a frame shared with other requests
    /// goes without them), then it waits for the frames being read (one per connection at
    /// most), forgets it and gives its `rows` back (local again).
    /// Returns how many of their entries held their bytes.
    ///
    /// # Errors
    /// [`CoordError::Presence`] for a row past the map (nothing is released then).
    pub fn end(&self, owner: i64, rows: &[u32]) -> Result<u64> {
        {
            let mut st = self.shared.lock();
            st.dead.insert(owner);
            st.drop_queued(owner);
        }
        self.shared.landed.notify_all();
        let (mut st, _) = self
            .shared
            .wait_until(|s| !s.inflight_of.contains_key(&owner));
        st.daemon_of.remove(&owner);
        st.dead.remove(&owner);
        st.failed.remove(&owner);
        st.rows_of.remove(&owner);
        let gone: HashSet<u32> = rows.iter().copied().collect();
        st.prefetched.retain(|e| !gone.contains(&e.row));
        st.fresh.retain(|p| p.owner != owner);
        Ok(st.presence.release(rows)?)
    }

    /// Host row `row` now holds staged block `logical` of `owner`: every entry absent.
    ///
    /// # Errors
    /// As [`PresenceMap::take_row`].
    pub fn take_row(&self, row: u32, owner: i64, logical: u32) -> Result<()> {
        let mut st = self.shared.lock();
        st.presence.take_row(row, owner, logical)?;
        st.rows_of.entry(owner).or_default().insert(logical, row);
        Ok(())
    }

    /// `row` names `owner` without holding a staged block (a bounded cache's filler).
    ///
    /// # Errors
    /// As [`PresenceMap::set_owner`].
    pub fn set_owner(&self, row: u32, owner: i64) -> Result<()> {
        Ok(self.shared.lock().presence.set_owner(row, owner)?)
    }

    /// The block in `row` was evicted (after the reads of its request landed); how many of its
    /// entries held their bytes.
    ///
    /// # Errors
    /// As [`PresenceMap::forget_row`].
    pub fn forget_row(&self, row: u32) -> Result<u64> {
        let owner = self.shared.lock().presence.owner_of(row)?.0;
        let (mut st, _) = self
            .shared
            .wait_until(|s| !s.inflight_of.contains_key(&owner));
        let (owner, logical) = st.presence.owner_of(row)?;
        if let Some(rows) = st.rows_of.get_mut(&owner) {
            if rows.get(&logical) == Some(&row) {
                rows.remove(&logical);
            }
        }
        st.prefetched.retain(|e| e.row != row);
        st.fresh.retain(|p| p.entry.row != row);
        Ok(st.presence.forget_row(row)?)
    }

    /// Entries written by the caller (an admission's blocks); per key how many were absent.
    ///
    /// # Errors
    /// As [`PresenceMap::mark_present`].
    pub fn mark_present(&self, keys: &[Entry]) -> Result<Vec<u32>> {
        Ok(self.shared.lock().presence.mark_present(keys)?)
    }

    /// The `rows` of `layer` with some head absent.
    ///
    /// # Errors
    /// As [`PresenceMap::is_present`].
    pub fn absent_blocks(&self, layer: u16, rows: &[u32]) -> Result<Vec<u32>> {
        let st = self.shared.lock();
        let heads = st.presence.shape().2 as u16;
        let mut out = Vec::new();
        for &row in rows {
            for head in 0..heads {
                if !st.presence.is_present(Entry { layer, row, head })? {
                    out.push(row);
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Whether `e` holds its bytes.
    ///
    /// # Errors
    /// As [`PresenceMap::is_present`].
    pub fn is_present(&self, e: Entry) -> Result<bool> {
        Ok(self.shared.lock().presence.is_present(e)?)
    }

    /// The request holding `row` ([`oasis_runtime::presence::LOCAL`]: none) and its logical
    /// block.
    ///
    /// # Errors
    /// As [`PresenceMap::owner_of`].
    pub fn owner_of(&self, row: u32) -> Result<(i64, u32)> {
        Ok(self.shared.lock().presence.owner_of(row)?)
    }

    /// [`Coordinator::owner_of`] of every row of `rows`, under one lock.
    ///
    /// # Errors
    /// As [`PresenceMap::owner_of`].
    pub fn owners(&self, rows: &[u32]) -> Result<Vec<(i64, u32)>> {
        let st = self.shared.lock();
        Ok(rows
            .iter()
            .map(|&r| st.presence.owner_of(r))
            .collect::<oasis_core::Result<_>>()?)
    }

    /// Absent entries, all layers.
    pub fn missing(&self) -> u64 {
        self.shared.lock().presence.missing()
    }

    /// Step items of `layer` in flight.
    pub fn pending(&self, layer: usize) -> usize {
        self.shared.lock().pending.get(layer).copied().unwrap_or(0)
    }

    /// Step items in flight of every layer (one look under the lock).
    pub fn pending_layers(&self) -> Vec<usize> {
        self.shared.lock().pending.clone()
    }

    /// The layers it was started for.
    pub fn layers(&self) -> usize {
        self.shared.lock().pending.len()
    }

    /// Items of `owner` in flight: of `layer` only, or (None) of every layer. 0: every read
    /// submitted for it has landed or failed ([`Coordinator::take_failed`] says which).
    pub fn in_flight(&self, owner: i64, layer: Option<u16>) -> usize {
        self.shared.lock().in_flight(owner, layer)
    }

    /// Block until every item of `owner` submitted so far (of `layer` only, when given) has
    /// landed or failed; how long that took (also added to [`CoordStats::wait_seconds`]). An
    /// admission streaming a request in waits this way, per layer, for its own reads alone.
    ///
    /// # Errors
    /// [`CoordError::Invalid`] for a layer past the coordinator's.
    pub fn wait_request(&self, owner: i64, layer: Option<usize>) -> Result<Duration> {
        let layers = self.shared.lock().pending.len();
        let layer = match layer {
            Some(l) if l >= layers => {
                return Err(CoordError::Invalid(format!(
                    "layer {l} is past the coordinator's {layers} layers"
                )))
            }
            l => l.map(|l| l as u16),
        };
        let (mut st, waited) = self.shared.wait_until(|s| s.in_flight(owner, layer) == 0);
        st.stats.wait_seconds += waited.as_secs_f64();
        Ok(waited)
    }

    /// Fail `owner` (the caller's own reason, e.g. its bounded cache cannot hold a layer):
    /// nothing of it is read again until it ends.
    pub fn fail(&self, owner: i64, message: String) {
        self.shared.lock().fail(owner, message);
    }

    /// Requests that failed since the last call -> why (the first message of each).
    pub fn take_failed(&self) -> Vec<(i64, String)> {
        let mut out: Vec<_> = self.shared.lock().failed.drain().collect();
        out.sort_unstable();
        out
    }

    /// Per request, since the last call: `(request, block-heads landed, wire bytes)` (its share
    /// of the frames that carried its entries), by request.
    pub fn take_landed(&self) -> Vec<(i64, u64, u64)> {
        let mut out: Vec<_> = self
            .shared
            .lock()
            .landed
            .drain()
            .map(|(o, (n, w))| (o, n, w.round() as u64))
            .collect();
        out.sort_unstable();
        out
    }

    /// The counters.
    pub fn stats(&self) -> CoordStats {
        self.shared.lock().stats.clone()
    }

    /// Read every absent entry among `keys` (a key with head [`ALL_HEADS`]: every head of its
    /// row) for a step, whose request has not failed: frames in layer order, round robin over
    /// the connections, on the step queues. Returns at once: per layer, how many block-heads
    /// its [`Coordinator::wait_layer`] waits for (0: nothing). A row asked for whole whose heads
    /// are all absent travels as one whole block; otherwise block-heads travel one by one.
    ///
    /// An entry in flight in the background (an admission's stream, a prefetch) is the step's
    /// too: taken over while its frame is still queued (the step reads it on its own queue, the
    /// queued copy is dropped unsent), or, once that frame is on the wire, counted in its
    /// layer's wait. So a step never waits behind a background queue, and never gathers an
    /// entry its wait does not cover.
    ///
    /// # Errors
    /// [`CoordError::NoPools`] before [`Coordinator::register_pools`]; [`CoordError::Closed`];
    /// [`CoordError::Presence`] for a key past the map (nothing is submitted then).
    pub fn submit(&self, keys: &[Entry]) -> Result<Vec<u32>> {
        self.submit_as(keys, true, 0)
    }

    /// [`Coordinator::submit`], then prefetch ([`crate::prefetch`]): background reads of up to
    /// `prefetch` block-heads the next steps are likely to plan (the successors of `keys`'
    /// blocks, their requests' most recent staged blocks), fewer while earlier prefetches are
    /// in flight (at most `prefetch` at once). No wait covers them: a later step that plans one
    /// finds it present, takes it over, or waits for the frame on the wire (above). A failed
    /// prefetch fails its request like any read (its staged copy is gone or broken; it would
    /// very likely be needed). Use it only where rows do not change hands between steps (not
    /// with a bounded cache: [`Coordinator::forget_row`] would wait for the prefetches).
    ///
    /// # Errors
    /// As [`Coordinator::submit`].
    pub fn submit_step(&self, keys: &[Entry], prefetch: usize) -> Result<Vec<u32>> {
        self.submit_as(keys, true, prefetch)
    }

    /// As [`Coordinator::submit`], for reads no step waits for: a request streamed in while
    /// others decode (an admission). [`Coordinator::wait_layer`] does not wait for them;
    /// [`Coordinator::wait_request`] of their request does.
    ///
    /// # Errors
    /// As [`Coordinator::submit`].
    pub fn submit_background(&self, keys: &[Entry]) -> Result<Vec<u32>> {
        self.submit_as(keys, false, 0)
    }

    fn submit_as(&self, keys: &[Entry], step: bool, prefetch: usize) -> Result<Vec<u32>> {
        let mut st = self.shared.lock();
        if st.closed {
            return Err(CoordError::Closed);
        }
        let layout = st.layout.clone().ok_or(CoordError::NoPools)?;
        let (layers, _, heads) = st.presence.shape();
        let whole: HashSet<(u16, u32)> = keys
            .iter()
            .filter(|k| k.head == ALL_HEADS)
            .map(|k| (k.layer, k.row))
            .collect();
        let mut absent = st.presence.absent(keys, &st.dead)?;
        let mut per_layer = vec![0u32; layers];
        if step {
            st.fresh.clear(); // the pools are the registered ones now (the caller's contract)
            count_hits(&mut st, keys, heads);
            let taken = take_over(&mut st, &absent, &mut per_layer, heads);
            if !taken.is_empty() {
                absent.extend(taken);
                absent.sort_unstable();
                absent.dedup();
            }
        }
        absent.retain(|e| !st.inflight.contains(e));
        let by_layer = items_of(&mut st, &absent, &whole, step, false)?;
        for (l, items) in by_layer.iter().enumerate() {
            per_layer[l] += items
                .iter()
                .map(|it| heads_of(it.entry, heads).len() as u32)
                .sum::<u32>();
        }
        if step {
            st.stats.step_entries += absent.len() as u64;
        }
        let mut jobs: Vec<(bool, Vec<Item>)> = Vec::new();
        for items in by_layer.into_iter().filter(|v| !v.is_empty()) {
            let f = self.frames(&layout, items, self.config.frame_bytes);
            jobs.extend(f.into_iter().map(|v| (step, v)));
        }
        let budget = prefetch.saturating_sub(st.prefetch_inflight);
        if step && budget > 0 {
            for items in prefetch_items(&mut st, keys, budget, heads)?
                .into_iter()
                .filter(|v| !v.is_empty())
            {
                let small = (self.config.frame_bytes / PREFETCH_FRAME_DIVISOR).max(1);
                let f = self.frames(&layout, items, small);
                jobs.extend(f.into_iter().map(|v| (false, v)));
            }
        }
        drop(st);
        let senders = self.senders.lock().unwrap_or_else(PoisonError::into_inner);
        for (on_step, items) in jobs {
            let n = self.next.fetch_add(1, Ordering::Relaxed) % senders.len();
            let job = Job::Read(Frame {
                items,
                layout: Arc::clone(&layout),
            });
            if let Err(mpsc::error::SendError(Job::Read(f))) = senders[n].of(on_step).send(job) {
                // The worker is gone (closing): the items fail, nothing was written.
                let why = vec![Some("the coordinator is closing".to_string()); f.items.len()];
                self.shared.land(&f.items, why, Duration::ZERO, 0, false);
            }
        }
        Ok(per_layer)
    }

    /// Release the daemon's staged request `daemon_id` from a connection's task, after the
    /// frames queued on it (a background job): returns at once, so the caller never waits on the daemon for it
    /// (a stalled daemon costs the connection one deadline). Best effort: a failure is only
    /// counted ([`CoordStats::failed_releases`]; the daemon's lease frees the request).
    /// Release a request after its reads ([`Coordinator::end`]).
    ///
    /// # Errors
    /// [`CoordError::Closed`].
    pub fn release(&self, daemon_id: u64) -> Result<()> {
        if self.shared.lock().closed {
            return Err(CoordError::Closed);
        }
        let senders = self.senders.lock().unwrap_or_else(PoisonError::into_inner);
        if senders.is_empty() {
            return Err(CoordError::Closed);
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed) % senders.len();
        senders[n]
            .background
            .send(Job::Release(daemon_id))
            .map_err(|_| CoordError::Closed)
    }

    /// One layer's items cut into frames: under the frame budget and [`MAX_ENTRIES`], and spread
    /// over the connections when the layer has enough of them.
    fn frames(&self, layout: &PoolLayout, items: Vec<Item>, frame_bytes: usize) -> Vec<Vec<Item>> {
        let c = &self.config;
        let n = items.len();
        let parts = c.connections.min(n / c.split_min_entries).max(1);
        let cap = n.div_ceil(parts).min(MAX_ENTRIES);
        let mut out = Vec::new();
        let mut cur: Vec<Item> = Vec::new();
        let mut bytes = FRAME_OVERHEAD;
        for it in items {
            let heads = if it.entry.head == ALL_HEADS {
                layout.heads
            } else {
                1
            };
            let size = heads * layout.head_entry_bytes() + REPLY_ENTRY_BYTES;
            if !cur.is_empty() && (cur.len() == cap || bytes + size > frame_bytes) {
                out.push(std::mem::take(&mut cur));
                bytes = FRAME_OVERHEAD;
            }
            bytes += size;
            cur.push(it);
        }
        if !cur.is_empty() {
            out.push(cur);
        }
        out
    }

    /// Block until every item of `layer` submitted so far for a step ([`Coordinator::submit`];
    /// not the background ones) has landed or failed; how long that took (also added to
    /// [`CoordStats::wait_seconds`]).
    ///
    /// # Errors
    /// [`CoordError::Invalid`] for a layer past the coordinator's.
    pub fn wait_layer(&self, layer: usize) -> Result<Duration> {
        let layers = self.shared.lock().pending.len();
        if layer >= layers {
            return Err(CoordError::Invalid(format!(
                "layer {layer} is past the coordinator's {layers} layers"
            )));
        }
        let (mut st, waited) = self.shared.wait_until(|s| s.pending[layer] == 0);
        st.stats.wait_seconds += waited.as_secs_f64();
        Ok(waited)
    }

    /// Block until every read in flight has landed or failed; how long that took.
    pub fn drain(&self) -> Duration {
        let (mut st, waited) = self.shared.wait_until(|s| s.inflight.is_empty());
        st.stats.wait_seconds += waited.as_secs_f64();
        waited
    }

    /// Let every read in flight land and the queued releases go (for at most
    /// [`CLOSE_GRACE`]), then stop the connections and the runtime: nothing is written into the
    /// pools after this returns. Idempotent; later submits fail with [`CoordError::Closed`].
    pub fn close(&self) {
        self.shared.lock().closed = true;
        self.drain();
        self.senders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(PoisonError::into_inner));
        if let Some(rt) = self
            .rt
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            // The tasks end once their queues are empty (the senders are gone).
            rt.block_on(async {
                let all = async {
                    for t in tasks {
                        let _ = t.await;
                    }
                };
                let _ = tokio::time::timeout(CLOSE_GRACE, all).await;
            });
            rt.shutdown_background();
        }
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.close();
    }
}
