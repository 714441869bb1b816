//! One connection's task ([`Worker`]): its frames in submission order, reconnecting after a
//! transport failure up to the configured retries, each reply's entries written into the pool
//! ([`write_entries`]) before the frame lands; and the releases queued behind them. It serves
//! its step queue first, then its background queue (an admission's stream, releases), so a
//! step's frame waits behind at most the one background frame being read.
//!
//! A frame whose every entry belongs to a failed (or ending) request is not sent: its entries
//! fail at once. So a stalled daemon costs a request one frame's deadline (times its retries),
//! not one per frame it had queued, and [`crate::Coordinator::end`] waits for one frame at most.

use std::sync::Arc;
use std::time::{Duration, Instant};

use oasis_rt::protocol::BlockKey;
use oasis_rt::{Client, ErrorCode};
use tokio::sync::mpsc;

use crate::connect::Connector;
use crate::coordinator::{Frame, Job, Shared};

/// Why the entries of a frame that was not sent failed.
const SKIPPED: &str = "not read: its request had failed or ended";

/// One connection's task: its frames in order, reconnecting on transport failures.
pub(crate) struct Worker<K: Connector> {
    pub(crate) index: usize,
    pub(crate) connector: Arc<K>,
    pub(crate) client: Option<Client<K::Conn>>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) retries: u32,
    pub(crate) use_rma: bool,
}

type Entries = Vec<std::result::Result<bytes::Bytes, ErrorCode>>;

impl<K: Connector> Worker<K> {
    pub(crate) async fn run(
        mut self,
        mut step: mpsc::UnboundedReceiver<Job>,
        mut background: mpsc::UnboundedReceiver<Job>,
    ) {
        loop {
            // Biased: the step's queue first; the task ends once both are closed and empty.
            let job = tokio::select! {
                biased;
                Some(j) = step.recv() => j,
                Some(j) = background.recv() => j,
                else => break,
            };
            let mut job = match job {
                Job::Read(f) => f,
                Job::Release(id) => {
                    let ok = self.release(id).await;
                    let mut st = self.shared.lock();
                    if ok {
                        st.stats.releases += 1;
                    } else {
                        st.stats.failed_releases += 1;
                    }
                    continue;
                }
            };
            let t0 = Instant::now();
            let skip = {
                // A step may have taken some of its items over while it was queued.
                let mut st = self.shared.lock();
                job.items = st.start(std::mem::take(&mut job.items));
                if job.items.is_empty() {
                    continue;
                }
                st.stats.frames_started += 1;
                job.items.iter().all(|it| st.dead.contains(&it.owner))
            };
            if skip {
                let why = vec![Some(SKIPPED.to_string()); job.items.len()];
                self.shared.land(&job.items, why, Duration::ZERO, 0, false);
                continue;
            }
            let keys: Vec<BlockKey> = job.items.iter().map(|it| it.key).collect();
            let (got, wire) = self.read(keys).await;
            let outcome = match got {
                Ok(entries) => write_entries(&job, entries),
                Err(e) => {
                    let m = format!("reading KV from the staging daemon failed: {e}");
                    vec![Some(m); job.items.len()]
                }
            };
            self.shared
                .land(&job.items, outcome, t0.elapsed(), wire, true);
        }
    }

    /// Release `id` in the daemon: one attempt (connecting if need be); whether it went through.
    async fn release(&mut self, id: u64) -> bool {
        if self.client.is_none() {
            match self.connector.connect(self.index).await {
                Ok(c) => self.client = Some(c),
                Err(_) => return false,
            }
        }
        let Some(c) = self.client.as_mut() else {
            return false;
        };
        match c.release(id).await {
            Ok(_) => true,
            Err(_) => {
                if !c.is_connected() {
                    self.client = None;
                }
                false
            }
        }
    }

    /// The daemon's answer to `keys`, after up to `retries` reconnects; the wire bytes spent.
    async fn read(&mut self, keys: Vec<BlockKey>) -> (oasis_rt::Result<Entries>, u64) {
        let mut wire = 0;
        let mut last = oasis_rt::Error::Closed;
        for attempt in 0..=self.retries {
            if self.client.is_none() {
                match self.connector.connect(self.index).await {
                    Ok(c) => {
                        if attempt > 0 {
                            self.shared.lock().stats.reconnects += 1;
                        }
                        self.client = Some(c);
                    }
                    Err(e) => {
                        last = e;
                        continue;
                    }
                }
            }
            let Some(c) = self.client.as_mut() else {
                continue;
            };
            let (s0, r0) = c.wire_bytes();
            let got = if self.use_rma && c.rma() {
                c.read_blocks_rma(keys.clone()).await
            } else {
                c.read_blocks(keys.clone()).await
            };
            let (s1, r1) = c.wire_bytes();
            wire += (s1 - s0) + (r1 - r0);
            match got {
                Ok(entries) => return (Ok(entries), wire),
                Err(e) if !c.is_connected() => {
                    self.client = None;
                    last = e;
                }
                Err(e) => return (Err(e), wire),
            }
        }
        (Err(last), wire)
    }
}

/// Write a frame's good entries into the pool; per item `None` (written) or why it failed.
pub(crate) fn write_entries(job: &Frame, entries: Entries) -> Vec<Option<String>> {
    job.items
        .iter()
        .zip(entries)
        .map(|(it, got)| {
            let e = it.entry;
            let what = format!("block {} of layer {}", it.key.block, e.layer);
            let bytes = match got {
                Ok(b) => b,
                Err(code) => {
                    return Some(format!(
                        "reading {what} from the staging daemon failed ({}); was the request \
                         released or evicted after its lease (oasis-rt serve --lease)?",
                        code.name()
                    ))
                }
            };
            let dest = match job.layout.dest(e) {
                Ok(d) => d,
                Err(err) => return Some(format!("reading {what}: {err}")),
            };
            if bytes.len() != dest.entry_bytes() {
                return Some(format!(
                    "reading {what} from the staging daemon returned {} bytes where the host \
                     pool's entry holds {} (size_mismatch): was it staged with another geometry \
                     or kv_format?",
                    bytes.len(),
                    dest.entry_bytes()
                ));
            }
            // SAFETY: (1) the length was checked just above. (2) `dest` lies inside the pools
            // of `job.layout` (`PoolLayout::dest` checked layer, row and head); they stay
            // allocated while the job is in flight (`register_pools`' obligation 1: a new
            // layout and `close` wait for every read first); the entry is in the in-flight set,
            // so no other job writes it, its request's rows do not change hands until it lands
            // (`end`/`forget_row` wait), and the caller reads its layer only after
            // `wait_layer` (obligation 2); `bytes` is the received frame, a separate buffer.
            unsafe { dest.write(&bytes) };
            None
        })
        .collect()
}
