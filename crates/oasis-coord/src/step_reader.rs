//! [`StepReader`]: a decode step's remote reads, started from the GPU's own plans while the GPU
//! runs the step (issue 37), so the reads overlap the step instead of following it.
//!
//! ```text
//!  GPU (a captured or eager step), layer l,          StepReader thread (one, its own)
//!  on the layer's background stream
//!  selection -> plan_slots, plan_blocks
//!    ──copy──▶ mailbox slots[l], blocks[l] (pinned)
//!  the step's epoch ──copy──▶ ready[l] (pinned) ───▶ sees ready[l] == the epoch begun
//!                                                    the plan's entries: (l, row, head) with
//!                                                      row = indices[indptr[seq] + block]
//!                                                    Coordinator::submit_step (absent ones read)
//!  wait kernel: landed[l] >= epoch ◀───────────────── landed[l] = epoch once pending(l) == 0
//!  gather(l) (reads what landed)
//! ```
//!
//! The host hands each step's tables to [`StepReader::begin_step`] before it launches the step:
//! its epoch (a number the step copies into `ready[l]` after each layer's plan, greater than
//! every earlier step's), the plan's shape and the host block table (the step's `host_indptr` /
//! `host_indices`, as the gather reads them). Steps are served in order, one at a time: a step's
//! layer `l` of the next step can only be published after this step's gather of `l`, which waits
//! for `landed[l]`.
//!
//! Invariants:
//! * `landed[l]` is written only after every step read of layer `l` submitted so far has landed
//!   or failed (the coordinator's per-layer count), so a gather that waited for it reads bytes
//!   that were written before: a block present at submission was written before it; an absent
//!   one is read now and counted;
//! * a failed read does not hold the GPU: its layer is marked landed like any other, the
//!   request fails ([`crate::Coordinator::take_failed`]) and its step's output is discarded by
//!   the caller; so does a plan entry outside the tables (counted in [`ReaderStats::bad_entries`]);
//! * the thread never panics across its loop: every address was validated at start, every
//!   index is checked before use.

use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use oasis_runtime::Entry;

use crate::coordinator::Coordinator;
use crate::error::{CoordError, Result};

/// How long the thread spins on the ready words before it sleeps between looks (arbitrary: a
/// layer's plan comes every few hundred microseconds in a step; a sleep costs ~60 us on Linux).
const SPIN: Duration = Duration::from_micros(200);
/// Its sleep between looks once spinning found nothing.
const NAP: Duration = Duration::from_micros(20);
/// How long it waits for a step to be begun before it looks at its stop flag again.
const IDLE: Duration = Duration::from_millis(5);

/// Where the GPU writes each layer's plan and epoch, and reads `landed`: addresses of pinned
/// (mapped) host memory, per layer `capacity` i32 slots and blocks, one u64 ready and landed word.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MailboxLayout {
    /// Per layer: the plan's slots (`-1`: no fetch), `[rows, heads, cap]` flattened.
    pub slots: Vec<usize>,
    /// Per layer: the plan's logical blocks, the same shape.
    pub blocks: Vec<usize>,
    /// i32 entries each `slots` / `blocks` address holds.
    pub capacity: usize,
    /// `u64 [layers]`: the epoch of the plan last published per layer (the GPU writes it).
    pub ready: usize,
    /// `u64 [layers]`: the epoch whose reads have landed per layer (this thread writes it).
    pub landed: usize,
}

impl MailboxLayout {
    fn validate(&self, layers: usize) -> Result<()> {
        if self.slots.len() != layers || self.blocks.len() != layers {
            return Err(CoordError::Invalid(format!(
                "a mailbox of {} slot and {} block addresses for {layers} layers",
                self.slots.len(),
                self.blocks.len()
            )));
        }
        let i32s = self.slots.iter().chain(&self.blocks);
        if self.capacity == 0
            || i32s.clone().any(|&a| a == 0 || a % 4 != 0)
            || [self.ready, self.landed]
                .iter()
                .any(|&a| a == 0 || a % 8 != 0)
        {
            return Err(CoordError::Invalid(
                "mailbox addresses must be non-null and aligned (i32 plans, u64 words) and its \
                 capacity at least 1"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// One step's tables ([`StepReader::begin_step`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepPlan {
    /// The number the step writes into `ready[l]`; greater than every earlier step's.
    pub epoch: u64,
    /// The plan's shape: `rows` requests (padded rows plan nothing), and per layer the slots
    /// each KV head's plan has (`[rows, heads, caps[l]]`; the fetch cap of the layer's budget).
    pub rows: usize,
    pub caps: Vec<usize>,
    /// The host block table: request `seq`'s logical block `b` is host row
    /// `indices[indptr[seq] + b]`.
    pub indptr: Vec<i32>,
    pub indices: Vec<i32>,
}

/// The reader's counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReaderStats {
    /// Steps whose every layer was marked landed.
    pub steps: u64,
    /// Layers whose plan was read and submitted.
    pub layers: u64,
    /// Block-heads handed to the coordinator (present ones included).
    pub entries: u64,
    /// Plan entries outside the tables (skipped).
    pub bad_entries: u64,
    /// Submissions the coordinator refused (closed, no pools): their layers are marked landed.
    pub refused: u64,
    /// Steps dropped because the GPU published a later epoch first (a begun step never ran).
    pub stale_steps: u64,
    /// Seconds from a layer's plan seen to its landed word written, summed.
    pub read_seconds: f64,
    /// The last refusal's message.
    pub last_error: Option<String>,
}

struct Shared {
    queue: Mutex<VecDeque<StepPlan>>,
    begun: Condvar,
    stop: AtomicBool,
    stats: Mutex<ReaderStats>,
    last_epoch: Mutex<u64>,
}

/// The thread that serves each begun step's plans (see the module docs).
pub struct StepReader {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    heads: usize,
    capacity: usize,
    layers: usize,
}

impl StepReader {
    /// Start the thread, reading plans of `heads` KV heads from `layout` for `coord`, each
    /// submission with `prefetch` ([`Coordinator::submit_step`]).
    ///
    /// # Errors
    /// [`CoordError::Invalid`] for a layout of other layers than the coordinator's, null or
    /// misaligned addresses, zero heads; [`CoordError::Runtime`] when the thread cannot start.
    ///
    /// # Safety
    /// Every address of `layout` (`capacity` i32 from each slots and blocks address, `layers`
    /// u64 from `ready` and `landed`) is host memory that stays allocated until [`StepReader::stop`]
    /// returns (or the reader is dropped); only the GPU (or the caller, between steps) writes the
    /// plans and `ready`, and only this reader writes `landed`.
    pub unsafe fn start(
        coord: Arc<Coordinator>,
        layout: MailboxLayout,
        heads: usize,
        prefetch: usize,
    ) -> Result<Self> {
        let layers = coord.layers();
        layout.validate(layers)?;
        if heads == 0 || heads > usize::from(u16::MAX) {
            return Err(CoordError::Invalid(format!("{heads} KV heads")));
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            begun: Condvar::new(),
            stop: AtomicBool::new(false),
            stats: Mutex::new(ReaderStats::default()),
            last_epoch: Mutex::new(0),
        });
        let capacity = layout.capacity;
        let worker = Worker {
            coord,
            layout,
            shared: Arc::clone(&shared),
            heads,
            prefetch,
            layers,
        };
        let thread = std::thread::Builder::new()
            .name("oasis-step-reader".into())
            .spawn(move || worker.run())?;
        Ok(StepReader {
            shared,
            thread: Some(thread),
            heads,
            capacity,
            layers,
        })
    }

    /// Queue a step's tables, before the step is launched.
    ///
    /// # Errors
    /// [`CoordError::Invalid`] for an epoch not above the last begun one, a plan larger than the
    /// mailbox, an `indptr` that is not `rows + 1` non-decreasing offsets into `indices`;
    /// [`CoordError::Closed`] after [`StepReader::stop`].
    pub fn begin_step(&self, plan: StepPlan) -> Result<()> {
        if self.shared.stop.load(Ordering::Acquire) {
            return Err(CoordError::Closed);
        }
        if plan.caps.len() != self.layers {
            return Err(CoordError::Invalid(format!(
                "caps has {} entries for {} layers",
                plan.caps.len(),
                self.layers
            )));
        }
        let most = plan.caps.iter().copied().max().unwrap_or(0);
        let n = plan
            .rows
            .checked_mul(self.heads)
            .and_then(|x| x.checked_mul(most));
        if n.is_none_or(|n| n > self.capacity) {
            return Err(CoordError::Invalid(format!(
                "a plan of {} rows x {} heads x {most} slots is larger than the mailbox's {} entries",
                plan.rows, self.heads, self.capacity
            )));
        }
        let ok = plan.indptr.len() == plan.rows + 1
            && plan.indptr.first() == Some(&0)
            && plan.indptr.windows(2).all(|w| w[0] <= w[1])
            && plan
                .indptr
                .last()
                .is_some_and(|&e| e as usize <= plan.indices.len());
        if !ok {
            return Err(CoordError::Invalid(format!(
                "indptr must be {} non-decreasing offsets from 0 into {} indices",
                plan.rows + 1,
                plan.indices.len()
            )));
        }
        let mut last = self
            .shared
            .last_epoch
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if plan.epoch <= *last {
            return Err(CoordError::Invalid(format!(
                "epoch {} is not above the last begun step's {}",
                plan.epoch, *last
            )));
        }
        *last = plan.epoch;
        drop(last);
        self.shared
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(plan);
        self.shared.begun.notify_all();
        Ok(())
    }

    /// Steps begun and not yet fully landed (the one being served included).
    pub fn queued(&self) -> usize {
        self.shared
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The counters.
    pub fn stats(&self) -> ReaderStats {
        self.shared
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stop the thread (the step being served is abandoned: its remaining layers are marked
    /// landed so that no GPU wait is left hanging) and join it. Idempotent.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.begun.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for StepReader {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    coord: Arc<Coordinator>,
    layout: MailboxLayout,
    shared: Arc<Shared>,
    heads: usize,
    prefetch: usize,
    layers: usize,
}

/// The step being served: which layers were submitted and marked landed.
struct Serving {
    plan: StepPlan,
    seen: Vec<Option<Instant>>,
    landed: Vec<bool>,
}

impl Worker {
    fn ready(&self, layer: usize) -> u64 {
        // SAFETY: validated non-null and 8-aligned at start; inside `layers` words (the
        // caller's contract); an atomic view, as the GPU writes it concurrently.
        unsafe { (*(self.layout.ready as *const AtomicU64).add(layer)).load(Ordering::Acquire) }
    }

    fn mark_landed(&self, layer: usize, epoch: u64) {
        // The pool writes of the landed reads happen-before this (the coordinator's lock).
        fence(Ordering::SeqCst);
        // SAFETY: as `ready`.
        unsafe {
            (*(self.layout.landed as *const AtomicU64).add(layer)).store(epoch, Ordering::Release)
        }
    }

    fn run(self) {
        let mut serving: Option<Serving> = None;
        let mut idle_since = Instant::now();
        loop {
            let stopping = self.shared.stop.load(Ordering::Acquire);
            if serving.is_none() {
                let q = self
                    .shared
                    .queue
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if q.is_empty() {
                    if stopping {
                        return;
                    }
                    let (guard, _) = self
                        .shared
                        .begun
                        .wait_timeout(q, IDLE)
                        .unwrap_or_else(PoisonError::into_inner);
                    drop(guard);
                    continue;
                }
                let plan = q.front().cloned().expect("not empty");
                drop(q);
                serving = Some(Serving {
                    plan,
                    seen: vec![None; self.layers],
                    landed: vec![false; self.layers],
                });
                idle_since = Instant::now();
            }
            let s = serving.as_mut().expect("set above");
            if stopping {
                for l in (0..self.layers).filter(|&l| !s.landed[l]) {
                    self.mark_landed(l, s.plan.epoch);
                }
                return;
            }
            let progressed = self.serve(s);
            if s.landed.iter().all(|&d| d) {
                // Every layer landed without its plan seen: dropped by `serve` as never run.
                let stale = s.seen.iter().all(Option::is_none);
                let mut st = self
                    .shared
                    .stats
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if stale {
                    st.stale_steps += 1;
                } else {
                    st.steps += 1;
                }
                drop(st);
                self.shared
                    .queue
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .pop_front();
                serving = None;
                continue;
            }
            if progressed {
                idle_since = Instant::now();
            } else if idle_since.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(NAP);
            }
        }
    }

    /// One look at every layer of the step being served: submit the plans newly published,
    /// mark landed the layers whose reads are done. Whether anything changed.
    fn serve(&self, s: &mut Serving) -> bool {
        let epoch = s.plan.epoch;
        let mut progressed = false;
        for l in 0..self.layers {
            if s.seen[l].is_some() || s.landed[l] {
                continue;
            }
            let r = self.ready(l);
            if r > epoch {
                // The GPU published a later step: this one never ran (its launch failed after
                // it was begun). Drop it: nothing waits for it.
                s.landed.iter_mut().for_each(|d| *d = true);
                return true;
            }
            if r != epoch {
                continue;
            }
            s.seen[l] = Some(Instant::now());
            progressed = true;
            let (entries, bad) = self.entries_of(l, &s.plan);
            let outcome = self.coord.submit_step(&entries, self.prefetch);
            let mut st = self
                .shared
                .stats
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            st.layers += 1;
            st.entries += entries.len() as u64;
            st.bad_entries += bad;
            if let Err(e) = outcome {
                st.refused += 1;
                st.last_error = Some(e.to_string());
            }
        }
        let pending = self.coord.pending_layers();
        for l in 0..self.layers {
            if let (Some(t0), false) = (s.seen[l], s.landed[l]) {
                if pending.get(l).copied().unwrap_or(0) == 0 {
                    self.mark_landed(l, epoch);
                    s.landed[l] = true;
                    progressed = true;
                    let mut st = self
                        .shared
                        .stats
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    st.read_seconds += t0.elapsed().as_secs_f64();
                }
            }
        }
        progressed
    }

    /// The block-heads layer `layer`'s published plan gathers, and how many of its entries were
    /// outside the tables.
    fn entries_of(&self, layer: usize, plan: &StepPlan) -> (Vec<Entry>, u64) {
        // <= capacity: begin_step checked.
        let n = plan.rows * self.heads * plan.caps[layer];
        // SAFETY: `capacity` i32 at each address (the caller's contract), n <= capacity; the
        // plan was published before `ready[layer]` (Acquire above).
        let (slots, blocks) = unsafe {
            (
                std::slice::from_raw_parts(self.layout.slots[layer] as *const i32, n),
                std::slice::from_raw_parts(self.layout.blocks[layer] as *const i32, n),
            )
        };
        entries_of(layer, self.heads, plan, slots, blocks)
    }
}

/// The block-heads a plan gathers: for each `(seq, head, j)` with `slots >= 0`, host row
/// `indices[indptr[seq] + blocks]` of `head`; entries outside the tables are counted, not kept.
pub fn entries_of(
    layer: usize,
    heads: usize,
    plan: &StepPlan,
    slots: &[i32],
    blocks: &[i32],
) -> (Vec<Entry>, u64) {
    let cap = plan.caps.get(layer).copied().unwrap_or(0).max(1);
    let per_seq = heads * cap;
    let mut out = Vec::new();
    let mut bad = 0u64;
    for (i, (&s, &b)) in slots.iter().zip(blocks).enumerate() {
        if s < 0 {
            continue;
        }
        let seq = i / per_seq;
        let head = (i / cap) % heads;
        let row = (seq < plan.rows && b >= 0)
            .then(|| {
                let (lo, hi) = (plan.indptr[seq] as usize, plan.indptr[seq + 1] as usize);
                let at = lo + b as usize;
                (at < hi).then(|| plan.indices.get(at).copied()).flatten()
            })
            .flatten()
            .filter(|&r| r >= 0);
        match (row, u16::try_from(layer)) {
            (Some(r), Ok(l)) => out.push(Entry {
                layer: l,
                row: r as u32,
                head: head as u16,
            }),
            _ => bad += 1,
        }
    }
    (out, bad)
}
