//! The staging pool: every staged request's blocks, summary rows and admission set, in host
//! memory, under a byte budget.
//!
//! # Accounting
//! `used_bytes` is the sum over requests of their payload bytes plus a fixed overhead per
//! entry ([`REQUEST_OVERHEAD_BYTES`], [`ENTRY_OVERHEAD_BYTES`]), so that a peer staging many
//! tiny entries cannot grow the daemon's memory past the budget through metadata. It never
//! exceeds the budget: a staging either fits (possibly after evicting *expired* requests) or is
//! refused as a whole, and nothing of it is stored.
//!
//! # Lifetimes, eviction
//! A request is *live* while something touched it (staged or read it) within the lease; it
//! *expires* when the lease passes untouched (the decode engine died, or forgot to release).
//! Release frees a request at once. When a staging does not fit, expired requests are evicted,
//! least recently touched first, and only if that makes it fit. Live data is never evicted: the
//! staging is refused with [`Error::OutOfMemory`] (it could never fit the budget) or
//! [`Error::Busy`] (live data fills the budget now; retry after releases). A reader of an
//! evicted request gets [`Error::UnknownRequest`], never wrong bytes.
//!
//! The pool is plain data (no locks, no clock): the daemon wraps it in a mutex and passes `now`,
//! which keeps every policy testable. Bytes are copied by the caller *before* taking the lock
//! (stored entries own their memory: a slice of a larger frame would pin the whole frame).
//!
//! # Registered memory (RMA reads)
//! Over a transport that reads memory remotely (UCX), the daemon copies each `StageBlocks`
//! frame's blocks into one allocation, registers it ([`Registered`]), and stages slices of it
//! ([`StagingPool::attach_region`] keeps the region with the request). [`StagingPool::
//! read_blocks_rma`] answers with ranges of those regions instead of bytes, and hands back what
//! keeps them alive (the blocks and their regions) for the daemon's lease.
//! NOTE: a block staged again from a later frame leaves the earlier frame's allocation alive
//! (its other blocks still use it) until the request goes; the accounting counts blocks, so
//! that memory is not counted. The prefill worker stages each block once.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::error::{Error, ErrorCode, Result};
use std::sync::Arc;

use crate::protocol::{
    Admission, BlockKey, Geometry, LayerBlock, RemoteRegion, RmaRange, Section, StagedBlock,
    StatsSnapshot, SummaryRun, ALL_HEADS,
};

/// Memory registered with a transport for remote reads, kept alive as long as this value (the
/// UCX transport's `UcxRegion`). `remote().base` is the memory's address in this process.
pub trait Registered: Send + Sync + std::fmt::Debug {
    fn remote(&self) -> &RemoteRegion;
}

/// [`StagingPool::read_blocks_rma`]'s answer: the regions the ranges name, the entries, and
/// what keeps their bytes alive until the client acknowledges (the daemon's lease).
#[derive(Debug, Default)]
pub struct RmaRead {
    pub regions: Vec<Arc<dyn Registered>>,
    pub entries: Vec<std::result::Result<Vec<RmaRange>, ErrorCode>>,
    pub pins: Vec<Bytes>,
    /// Bytes the ranges cover.
    pub bytes: u64,
}

/// Accounted per request besides its payload (arbitrary: a map entry and its tables).
pub const REQUEST_OVERHEAD_BYTES: u64 = 512;
/// Accounted per stored block, summary row, selected block or section (arbitrary).
pub const ENTRY_OVERHEAD_BYTES: u64 = 64;

/// Budget and lease.
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    pub budget_bytes: u64,
    /// A request untouched this long may be evicted; `None`: requests never expire.
    pub lease: Option<Duration>,
}

#[derive(Debug)]
struct AdmissionEntry {
    selected: Vec<LayerBlock>,
    sections: Vec<Section>,
}

impl AdmissionEntry {
    fn bytes(&self) -> u64 {
        let sections: u64 = self
            .sections
            .iter()
            .map(|s| ENTRY_OVERHEAD_BYTES + s.name.len() as u64 + s.data.len() as u64)
            .sum();
        ENTRY_OVERHEAD_BYTES + 6 * self.selected.len() as u64 + sections
    }
}

#[derive(Debug)]
struct StagedRequest {
    geometry: Geometry,
    blocks: HashMap<(u16, u32), Bytes>,
    summaries: BTreeMap<(u16, u32), Bytes>,
    admission: Option<AdmissionEntry>,
    /// Registered allocations its blocks are slices of (RMA); not accounted (see module docs).
    regions: Vec<Arc<dyn Registered>>,
    /// Accounted bytes of this request (overheads included).
    bytes: u64,
    last_touch: Instant,
}

impl StagedRequest {
    fn recount(&self) -> u64 {
        let block = self.geometry.block_bytes() + ENTRY_OVERHEAD_BYTES;
        let row = self.geometry.summary_row_bytes() + ENTRY_OVERHEAD_BYTES;
        REQUEST_OVERHEAD_BYTES
            + block * self.blocks.len() as u64
            + row * self.summaries.len() as u64
            + self.admission.as_ref().map_or(0, AdmissionEntry::bytes)
    }
}

/// The reply to a block read: per key, bytes or the code of why that entry failed.
pub type BlockResults = Vec<std::result::Result<Bytes, ErrorCode>>;

/// Per-request staging storage under a byte budget. See the module docs.
#[derive(Debug)]
pub struct StagingPool {
    config: PoolConfig,
    used: u64,
    requests: HashMap<u64, StagedRequest>,
    evicted_requests: u64,
    evicted_bytes: u64,
    refused_stages: u64,
    bytes_staged: u64,
}

impl StagingPool {
    pub fn new(config: PoolConfig) -> Self {
        StagingPool {
            config,
            used: 0,
            requests: HashMap::new(),
            evicted_requests: 0,
            evicted_bytes: 0,
            refused_stages: 0,
            bytes_staged: 0,
        }
    }

    pub fn budget_bytes(&self) -> u64 {
        self.config.budget_bytes
    }

    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    pub fn contains(&self, request: u64) -> bool {
        self.requests.contains_key(&request)
    }

    fn expired(&self, r: &StagedRequest, now: Instant) -> bool {
        self.config
            .lease
            .is_some_and(|lease| now.saturating_duration_since(r.last_touch) > lease)
    }

    /// Make room for `delta` more bytes beside request `keep`, evicting expired requests (least
    /// recently touched first) only if that is enough. All or nothing.
    fn reserve(&mut self, keep: u64, current: u64, delta: u64, now: Instant) -> Result<()> {
        let budget = self.config.budget_bytes;
        if current.saturating_add(delta) > budget {
            self.refused_stages += 1;
            // The request's size had this staging been stored, not this staging's alone: a
            // frame that fits the budget by itself is not what can never fit.
            return Err(Error::OutOfMemory {
                requested: current.saturating_add(delta),
                budget,
            });
        }
        let free = budget - self.used;
        if delta <= free {
            return Ok(());
        }
        let mut expired: Vec<(Instant, u64, u64)> = self
            .requests
            .iter()
            .filter(|(id, r)| **id != keep && self.expired(r, now))
            .map(|(id, r)| (r.last_touch, *id, r.bytes))
            .collect();
        let evictable: u64 = expired.iter().map(|e| e.2).sum();
        if delta > free + evictable {
            self.refused_stages += 1;
            return Err(Error::Busy {
                requested: delta,
                free: free + evictable,
            });
        }
        expired.sort_unstable();
        let mut freed = 0;
        for (_, id, bytes) in expired {
            if delta <= free + freed {
                break;
            }
            self.requests.remove(&id);
            self.used -= bytes;
            freed += bytes;
            self.evicted_requests += 1;
            self.evicted_bytes += bytes;
            tracing::info!(request = id, bytes, "evicted expired request");
        }
        Ok(())
    }

    /// Validate `geometry` against the staged one; true when `request` is new.
    fn check_geometry(&self, request: u64, geometry: &Geometry) -> Result<bool> {
        geometry.validate()?;
        match self.requests.get(&request) {
            Some(r) if r.geometry != *geometry => Err(Error::GeometryMismatch { request }),
            Some(_) => Ok(false),
            None => Ok(true),
        }
    }

    fn entry(&mut self, request: u64, geometry: Geometry, now: Instant) -> &mut StagedRequest {
        self.requests
            .entry(request)
            .or_insert_with(|| StagedRequest {
                geometry,
                blocks: HashMap::new(),
                summaries: BTreeMap::new(),
                admission: None,
                regions: Vec::new(),
                // `delta` of the staging that creates it includes REQUEST_OVERHEAD_BYTES.
                bytes: 0,
                last_touch: now,
            })
    }

    fn current_bytes(&self, request: u64) -> u64 {
        self.requests.get(&request).map_or(0, |r| r.bytes)
    }

    /// Store `blocks` of `request` (created if new). Restaging a block replaces it. All or
    /// nothing; returns the bytes added.
    ///
    /// # Errors
    /// Geometry, layer, block or length out of range; [`Error::GeometryMismatch`];
    /// [`Error::OutOfMemory`] or [`Error::Busy`] past the budget.
    pub fn stage_blocks(
        &mut self,
        request: u64,
        geometry: Geometry,
        blocks: Vec<StagedBlock>,
        now: Instant,
    ) -> Result<u64> {
        let is_new = self.check_geometry(request, &geometry)?;
        let bb = geometry.block_bytes();
        let mut fresh = HashSet::new();
        for b in &blocks {
            geometry.check_layer(b.layer)?;
            geometry.check_block(b.block)?;
            if b.data.len() as u64 != bb {
                return Err(Error::OutOfRange {
                    field: "block bytes",
                    value: b.data.len() as u64,
                    limit: bb,
                });
            }
            let key = (b.layer, b.block);
            let present = self
                .requests
                .get(&request)
                .is_some_and(|r| r.blocks.contains_key(&key));
            if !present {
                fresh.insert(key);
            }
        }
        let delta = fresh.len() as u64 * (bb + ENTRY_OVERHEAD_BYTES)
            + if is_new { REQUEST_OVERHEAD_BYTES } else { 0 };
        self.commit(request, geometry, delta, now, |r| {
            for b in blocks {
                r.blocks.insert((b.layer, b.block), b.data);
            }
        })
    }

    /// Store summary rows of `request` (created if new), one entry per block row. Restaging a
    /// row replaces it.
    ///
    /// # Errors
    /// As [`StagingPool::stage_blocks`].
    pub fn stage_summaries(
        &mut self,
        request: u64,
        geometry: Geometry,
        runs: Vec<SummaryRun>,
        now: Instant,
    ) -> Result<u64> {
        let is_new = self.check_geometry(request, &geometry)?;
        let row = geometry.summary_row_bytes();
        let mut fresh = HashSet::new();
        let mut rows = Vec::new();
        for run in &runs {
            geometry.check_layer(run.layer)?;
            let len = run.data.len() as u64;
            if len == 0 || !len.is_multiple_of(row) {
                return Err(Error::Invalid {
                    field: "summary run",
                    reason: "length must be a nonzero multiple of the row size",
                });
            }
            let n = len / row;
            let end = u64::from(run.first_block) + n;
            if end > u64::from(geometry.num_blocks) {
                return Err(Error::OutOfRange {
                    field: "summary run end",
                    value: end,
                    limit: geometry.num_blocks.into(),
                });
            }
            for i in 0..n {
                // end <= num_blocks <= u32::MAX, so the block id fits.
                let key = (run.layer, run.first_block + i as u32);
                let present = self
                    .requests
                    .get(&request)
                    .is_some_and(|r| r.summaries.contains_key(&key));
                if !present {
                    fresh.insert(key);
                }
                let start = (i * row) as usize;
                rows.push((key, run.data.slice(start..start + row as usize)));
            }
        }
        let delta = fresh.len() as u64 * (row + ENTRY_OVERHEAD_BYTES)
            + if is_new { REQUEST_OVERHEAD_BYTES } else { 0 };
        self.commit(request, geometry, delta, now, |r| {
            for (key, data) in rows {
                r.summaries.insert(key, data);
            }
        })
    }

    /// Set the admission set of an already staged request (replaces an earlier one).
    ///
    /// # Errors
    /// [`Error::UnknownRequest`]; a selected block out of range; budget errors.
    pub fn stage_admission(
        &mut self,
        request: u64,
        selected: Vec<LayerBlock>,
        sections: Vec<Section>,
        now: Instant,
    ) -> Result<u64> {
        let r = self
            .requests
            .get(&request)
            .ok_or(Error::UnknownRequest(request))?;
        let geometry = r.geometry;
        for s in &selected {
            geometry.check_layer(s.layer)?;
            geometry.check_block(s.block)?;
        }
        let entry = AdmissionEntry { selected, sections };
        let old = r.admission.as_ref().map_or(0, AdmissionEntry::bytes);
        let new = entry.bytes();
        // Replacing a larger admission set frees bytes: account the net change.
        if new <= old {
            let r = self
                .requests
                .get_mut(&request)
                .ok_or(Error::UnknownRequest(request))?;
            r.admission = Some(entry);
            r.bytes -= old - new;
            r.last_touch = now;
            self.used -= old - new;
            return Ok(0);
        }
        self.commit(request, geometry, new - old, now, |r| {
            r.admission = Some(entry);
        })
    }

    fn commit(
        &mut self,
        request: u64,
        geometry: Geometry,
        delta: u64,
        now: Instant,
        apply: impl FnOnce(&mut StagedRequest),
    ) -> Result<u64> {
        let current = self.current_bytes(request);
        self.reserve(request, current, delta, now)?;
        let r = self.entry(request, geometry, now);
        apply(r);
        r.last_touch = now;
        r.bytes += delta;
        debug_assert_eq!(r.bytes, r.recount());
        self.used += delta;
        self.bytes_staged += delta;
        Ok(delta)
    }

    /// The admission set of layers `first_layer..first_layer + num_layers`: every staged summary
    /// row of those layers (as runs of consecutive blocks), the selected blocks of those layers,
    /// and the sections if asked. `num_layers = 0` asks for the sections alone (a full transfer
    /// reads every block and needs no summaries). `max_bytes` bounds the reply (the frame limit).
    ///
    /// # Errors
    /// [`Error::UnknownRequest`]; a layer range out of bounds; [`Error::MissingBlock`] for a
    /// selected block that was never staged; [`Error::FrameTooLarge`] past `max_bytes` (ask
    /// for fewer layers).
    pub fn fetch_admission(
        &mut self,
        request: u64,
        first_layer: u16,
        num_layers: u16,
        include_sections: bool,
        max_bytes: u64,
        now: Instant,
    ) -> Result<Admission> {
        let r = self
            .requests
            .get_mut(&request)
            .ok_or(Error::UnknownRequest(request))?;
        let g = r.geometry;
        let end = u32::from(first_layer) + u32::from(num_layers);
        if end > u32::from(g.num_layers) {
            return Err(Error::OutOfRange {
                field: "layer range end",
                value: end.into(),
                limit: g.num_layers.into(),
            });
        }
        r.last_touch = now;
        let layers = first_layer..(end as u16);
        let row = g.summary_row_bytes();
        let mut total = 64u64;
        // Runs of consecutive rows; the map is ordered by (layer, block).
        let mut summaries: Vec<SummaryRun> = Vec::new();
        let mut run: Option<(u16, u32, u32, BytesMut)> = None;
        for (&(layer, block), data) in r.summaries.range((first_layer, 0)..(end as u16, 0)) {
            total += row;
            if total > max_bytes {
                return Err(Error::FrameTooLarge {
                    len: total,
                    max: max_bytes,
                });
            }
            match &mut run {
                Some((l, first, n, buf)) if *l == layer && *first + *n == block => {
                    buf.extend_from_slice(data);
                    *n += 1;
                }
                _ => {
                    if let Some((l, first, _, buf)) = run.take() {
                        summaries.push(SummaryRun {
                            layer: l,
                            first_block: first,
                            data: buf.freeze(),
                        });
                        total += 10;
                    }
                    let mut buf = BytesMut::new();
                    buf.extend_from_slice(data);
                    run = Some((layer, block, 1, buf));
                }
            }
        }
        if let Some((l, first, _, buf)) = run {
            summaries.push(SummaryRun {
                layer: l,
                first_block: first,
                data: buf.freeze(),
            });
        }
        let mut blocks = Vec::new();
        let mut sections = Vec::new();
        if let Some(a) = &r.admission {
            let mut seen = HashSet::new();
            for s in a.selected.iter().filter(|s| layers.contains(&s.layer)) {
                if !seen.insert(*s) {
                    continue;
                }
                let data = r
                    .blocks
                    .get(&(s.layer, s.block))
                    .ok_or(Error::MissingBlock {
                        request,
                        layer: s.layer,
                        block: s.block,
                    })?;
                total += 6 + g.block_bytes();
                if total > max_bytes {
                    return Err(Error::FrameTooLarge {
                        len: total,
                        max: max_bytes,
                    });
                }
                blocks.push(StagedBlock {
                    layer: s.layer,
                    block: s.block,
                    data: data.clone(),
                });
            }
            if include_sections {
                for s in &a.sections {
                    total += 5 + s.name.len() as u64 + s.data.len() as u64;
                    sections.push(s.clone());
                }
                if total > max_bytes {
                    return Err(Error::FrameTooLarge {
                        len: total,
                        max: max_bytes,
                    });
                }
            }
        }
        Ok(Admission {
            geometry: g,
            summaries,
            blocks,
            sections,
        })
    }

    /// Read a batch of block (or block-head) entries across requests. Each entry succeeds or
    /// fails on its own (a released request fails only its entries). `max_bytes` bounds the
    /// reply: past it the whole batch is refused with [`Error::FrameTooLarge`].
    ///
    /// # Errors
    /// [`Error::FrameTooLarge`] only; per-entry failures are codes in the result.
    pub fn read_blocks(
        &mut self,
        keys: &[BlockKey],
        max_bytes: u64,
        now: Instant,
    ) -> Result<BlockResults> {
        self.check_read(keys, 64, 6, max_bytes)?;
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let (r, data) = match self.block_of(k, now) {
                Ok(found) => found,
                Err(code) => {
                    out.push(Err(code));
                    continue;
                }
            };
            if k.head == ALL_HEADS {
                out.push(Ok(data.clone()));
            } else {
                // K rows of the head, then its V rows.
                let hb = r.geometry.head_bytes() as usize;
                let mut buf = BytesMut::with_capacity(2 * hb);
                for at in r.geometry.head_offsets(k.head) {
                    buf.extend_from_slice(&data[at as usize..at as usize + hb]);
                }
                out.push(Ok(buf.freeze()));
            }
        }
        Ok(out)
    }

    /// Keep `region` (the registered allocation the blocks just staged for `request` are slices
    /// of) with the request, so that RMA reads can name it. Call under the same lock as the
    /// staging; a no-op when the request is gone.
    pub fn attach_region(&mut self, request: u64, region: Arc<dyn Registered>) {
        if let Some(r) = self.requests.get_mut(&request) {
            r.regions.push(region);
        }
    }

    /// As [`StagingPool::read_blocks`], answered with ranges of registered regions: per key one
    /// range (a whole block) or two (a head's K rows, then its V rows). `max_bytes` bounds the
    /// bytes the ranges cover (what the lease pins). A block whose memory is in no registered
    /// region (staged without one) fails with `internal`.
    ///
    /// # Errors
    /// [`Error::FrameTooLarge`] only; per-entry failures are codes in the result.
    pub fn read_blocks_rma(
        &mut self,
        keys: &[BlockKey],
        max_bytes: u64,
        now: Instant,
    ) -> Result<RmaRead> {
        self.check_read(keys, 0, 0, max_bytes)?;
        let mut out = RmaRead::default();
        let mut index: HashMap<*const (), u32> = HashMap::new();
        for k in keys {
            let (r, data) = match self.block_of(k, now) {
                Ok(found) => found,
                Err(code) => {
                    out.entries.push(Err(code));
                    continue;
                }
            };
            let at = data.as_ptr() as u64;
            let len = data.len() as u64;
            let Some(region) = r.regions.iter().find(|g| {
                let rr = g.remote();
                at >= rr.base && at - rr.base + len <= rr.len
            }) else {
                out.entries.push(Err(ErrorCode::Internal));
                continue;
            };
            let key = Arc::as_ptr(region).cast::<()>();
            let idx = *index.entry(key).or_insert_with(|| {
                out.regions.push(region.clone());
                (out.regions.len() - 1) as u32
            });
            let offset = at - region.remote().base;
            let ranges = if k.head == ALL_HEADS {
                vec![RmaRange {
                    region: idx,
                    offset,
                    len: len as u32,
                }]
            } else {
                // K rows of the head, then its V rows.
                let hb = r.geometry.head_bytes();
                r.geometry
                    .head_offsets(k.head)
                    .iter()
                    .map(|at| RmaRange {
                        region: idx,
                        offset: offset + at,
                        len: hb as u32,
                    })
                    .collect()
            };
            out.bytes += ranges.iter().map(|r| u64::from(r.len)).sum::<u64>();
            out.pins.push(data.clone());
            out.entries.push(Ok(ranges));
        }
        Ok(out)
    }

    /// Refuse a read whose reply would pass `max_bytes`: `base` bytes, plus per key `per_key`
    /// and the bytes it reads (0 for an unknown request).
    fn check_read(&self, keys: &[BlockKey], base: u64, per_key: u64, max_bytes: u64) -> Result<()> {
        let mut total = base;
        for k in keys {
            total += per_key
                + self
                    .requests
                    .get(&k.request)
                    .map_or(0, |r| r.geometry.read_bytes(k.head));
        }
        if total > max_bytes {
            return Err(Error::FrameTooLarge {
                len: total,
                max: max_bytes,
            });
        }
        Ok(())
    }

    /// The staged request and block `k` names (the request touched at `now`), or the entry's
    /// error: an unknown request, a key outside its geometry, a block not staged.
    fn block_of(
        &mut self,
        k: &BlockKey,
        now: Instant,
    ) -> std::result::Result<(&StagedRequest, &Bytes), ErrorCode> {
        let r = self
            .requests
            .get_mut(&k.request)
            .ok_or(ErrorCode::UnknownRequest)?;
        r.last_touch = now;
        let g = r.geometry;
        if g.check_layer(k.layer).is_err()
            || g.check_block(k.block).is_err()
            || g.check_head(k.head).is_err()
        {
            return Err(ErrorCode::BadRequest);
        }
        let data = r
            .blocks
            .get(&(k.layer, k.block))
            .ok_or(ErrorCode::MissingBlock)?;
        Ok((r, data))
    }

    /// Free everything of `request`; returns the bytes freed (0 if it was not staged: release
    /// is idempotent).
    pub fn release(&mut self, request: u64) -> u64 {
        match self.requests.remove(&request) {
            Some(r) => {
                self.used -= r.bytes;
                r.bytes
            }
            None => 0,
        }
    }

    /// Pool counters (the daemon adds its own).
    pub fn stats(&self, now: Instant) -> StatsSnapshot {
        let mut s = StatsSnapshot {
            budget_bytes: self.config.budget_bytes,
            used_bytes: self.used,
            evicted_requests: self.evicted_requests,
            evicted_bytes: self.evicted_bytes,
            refused_stages: self.refused_stages,
            bytes_staged: self.bytes_staged,
            ..Default::default()
        };
        for r in self.requests.values() {
            if self.expired(r, now) {
                s.expired_requests += 1;
            } else {
                s.live_requests += 1;
            }
            s.staged_blocks += r.blocks.len() as u64;
            s.summary_rows += r.summaries.len() as u64;
        }
        s
    }

    /// Check the accounting from scratch: `used` is the sum of every request's recount, and
    /// within the budget.
    ///
    /// # Errors
    /// A description of the first broken invariant.
    pub fn audit(&self) -> std::result::Result<(), String> {
        let mut sum = 0;
        for (id, r) in &self.requests {
            let n = r.recount();
            if n != r.bytes {
                return Err(format!(
                    "request {id}: accounted {} != recount {n}",
                    r.bytes
                ));
            }
            sum += n;
        }
        if sum != self.used {
            return Err(format!("used {} != sum of requests {sum}", self.used));
        }
        if self.used > self.config.budget_bytes {
            return Err(format!(
                "used {} > budget {}",
                self.used, self.config.budget_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
