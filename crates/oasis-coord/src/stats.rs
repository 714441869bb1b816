//! [`CoordStats`]: the coordinator's counters, as `Coordinator::stats` reports them.

/// Counters since the coordinator started.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CoordStats {
    /// Seconds the connections spent on frames (request, reply, writes into the pool), summed
    /// over connections: the host time spent reading, none of it on the caller's thread.
    pub read_seconds: f64,
    /// Seconds the caller spent blocked in [`crate::Coordinator::wait_layer`] /
    /// [`crate::Coordinator::drain`].
    pub wait_seconds: f64,
    /// Bytes that crossed the wire for the reads (frames both ways; RMA reads).
    pub wire_bytes: u64,
    /// Block-heads submitted for reading (each absent and not in flight then).
    pub sent_entries: u64,
    /// Block-heads written into the pool and marked present.
    pub entries: u64,
    /// Block-heads whose read failed.
    pub failed_entries: u64,
    /// Frames sent (their reads done, or failed).
    pub frames: u64,
    /// Frames taken off a queue to be read (on the wire, or skipped for a dead request): a
    /// request's items in them are past `end`'s reach (it waits for them instead of dropping).
    pub frames_started: u64,
    /// Connections opened again after one was lost.
    pub reconnects: u64,
    /// Staged requests released in the daemon ([`crate::Coordinator::release`]), and releases that
    /// failed (the daemon gone: its lease frees them).
    pub releases: u64,
    pub failed_releases: u64,
    /// Block-heads steps submitted ([`crate::Coordinator::submit`] /
    /// [`crate::Coordinator::submit_step`]): their own misses, which they wait for.
    pub step_entries: u64,
    /// Block-heads queued as prefetch ([`crate::prefetch`]), and landed.
    pub prefetch_entries: u64,
    pub prefetched_entries: u64,
    /// Block-heads a step planned that a prefetch brought (landed, or on the wire then).
    pub prefetch_hits: u64,
    /// Prefetched block-heads a step needed while still queued: read by the step instead.
    pub prefetch_taken: u64,
    /// Prefetched block-heads dropped unsent because their request ended.
    pub prefetch_cancelled: u64,
    /// Prefetched block-heads marked absent again because the pools moved meanwhile
    /// ([`crate::Coordinator::register_pools`]).
    pub prefetch_dropped: u64,
}
