//! [`Runtime`]: both pools, every request's tables, admission and the state transitions.
//!
//! The runtime hands out ids; the bytes are torch tensors the engine owns. Every change of a
//! page's owner or logical block is also queued as a head-wise mapping update (`page_map[:, page,
//! :] = value` in every layer, and `page_last_selected` reset): [`Runtime::take_map_updates`]
//! drains them, one value per page (the last one), and [`Runtime::plan`] lays out those of the
//! step in the plan itself, so they reach the device in the plan's one copy.

use std::collections::HashMap;

use oasis_core::{BlockPool, OasisError, Result, Tier};

use crate::cache::{Cached, RowCache};
use crate::config::{RuntimeConfig, MAX_POOL_BLOCKS};
use crate::plan::{PlanPad, StepPlan};
use crate::table::{RequestTable, Reservation};

mod drafts;
mod invariants;
mod sparse;
#[cfg(test)]
mod tests;

/// What the engine must do on the device when a request turns sparse (every layer):
/// copy `src_pages[i]` (holding `lens[i]` tokens) into host row `host_rows[i]` and build the
/// summary of block id `host_blocks[i]` from it; then select the initial working set over the
/// first `n_complete` host blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparseTransition {
    pub src_pages: Vec<u32>,
    pub host_blocks: Vec<u32>,
    /// The host row of each block (a bounded staged request: the filler row for the blocks
    /// before `written_from`, which hold no row until [`Runtime::cache_blocks`] gives them one).
    pub host_rows: Vec<u32>,
    pub lens: Vec<u32>,
    pub slot_pages: Vec<u32>,
    pub local_page: u32,
    /// Blocks complete (candidates of selection): `kv_len / block_size`.
    pub n_complete: usize,
}

/// A draft's tentative slot, reserved by [`Runtime::plan_speculative`] until
/// [`Runtime::commit_drafts`] keeps it (the draft was accepted) or gives it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Draft {
    id: u64,
    /// The block entered for the draft (a dense page or a sparse request's host block), freed if
    /// it is rejected.
    entered: Option<u32>,
    /// The host row entered with it (sparse), freed with it.
    entered_row: Option<u32>,
    /// The mapping update entering its block needs, queued only when it is accepted (a sparse
    /// request's local page keeps mapping x_t's block until then).
    map: Option<(u32, i32)>,
}

/// Where a token lands once its block is entered ([`Runtime::enter_block`]).
struct Entered {
    page: u32,
    host: i32,
    offset: usize,
    /// The block allocated for it, if any.
    entered: Option<u32>,
    /// The host row allocated with a sparse request's new block.
    entered_row: Option<u32>,
    /// The host row of the write-through (-1 when dense).
    row: i32,
    /// The mapping update that entering the block needs, if any.
    map: Option<(u32, i32)>,
}

/// The pools, the tables and admission of one engine.
#[derive(Debug, Clone)]
pub struct Runtime {
    cfg: RuntimeConfig,
    gpu: BlockPool,
    /// Host block ids (summaries, codes, the scoring tables): capped only by what ids address,
    /// bounded in practice by the admitted requests' reservations.
    host: BlockPool,
    /// Host rows (`host_k`/`host_v`): the host budget.
    rows: BlockPool,
    /// The most blocks each pool may grow to (the budget), in blocks.
    gpu_cap: usize,
    rows_cap: usize,
    reserved_gpu: usize,
    reserved_host: usize,
    reserved_rows: usize,
    reqs: HashMap<u64, RequestTable>,
    free_slots: Vec<u32>,
    /// Pending head-wise mapping updates: page -> value, in the order first queued.
    map_order: Vec<u32>,
    map_value: HashMap<u32, i32>,
    plan: StepPlan,
    /// Tentative draft slots of the last speculative plan, batch order, until committed.
    drafts: Vec<Draft>,
}

fn to_i32(x: usize) -> i32 {
    // Ids and lengths stay below i32::MAX by construction (pool caps, block_size <= 1024).
    i32::try_from(x).unwrap_or(i32::MAX)
}

impl Runtime {
    /// A runtime whose pools hold `gpu_pages` / `host_blocks` now and may grow to the caps
    /// (`host_blocks` ids and as many host rows; `host_cap` caps the rows, the ids grow with the
    /// reservations up to [`MAX_POOL_BLOCKS`]).
    ///
    /// # Errors
    /// [`OasisError::Config`] for a bad config or a pool larger than its cap or than ids address.
    pub fn new(
        cfg: RuntimeConfig,
        gpu_pages: usize,
        host_blocks: usize,
        gpu_cap: usize,
        host_cap: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        for (what, n, cap) in [("gpu", gpu_pages, gpu_cap), ("host", host_blocks, host_cap)] {
            if cap > MAX_POOL_BLOCKS {
                return Err(OasisError::Config(format!(
                    "the {what} pool cap of {cap} blocks exceeds {MAX_POOL_BLOCKS} (ids are i32)"
                )));
            }
            if n > cap {
                return Err(OasisError::Config(format!(
                    "the {what} pool has {n} blocks, more than its cap of {cap}"
                )));
            }
        }
        let slots = (0..cfg.max_num_seqs as u32).rev().collect();
        Ok(Self {
            gpu: BlockPool::try_new(Tier::Gpu, gpu_pages)?,
            host: BlockPool::try_new(Tier::Host, host_blocks)?,
            rows: BlockPool::try_new(Tier::Host, host_blocks)?,
            cfg,
            gpu_cap,
            rows_cap: host_cap,
            reserved_gpu: 0,
            reserved_host: 0,
            reserved_rows: 0,
            reqs: HashMap::new(),
            free_slots: slots,
            map_order: Vec::new(),
            map_value: HashMap::new(),
            plan: StepPlan::default(),
            drafts: Vec::new(),
        })
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    /// `(gpu pages, host block ids, host rows)` in the pools now (the engine's tensors must have
    /// at least these many rows: pages; summaries and codes; `host_k`/`host_v`).
    pub fn pool_sizes(&self) -> (usize, usize, usize) {
        (
            self.gpu.num_blocks(),
            self.host.num_blocks(),
            self.rows.num_blocks(),
        )
    }

    /// Free entries in each pool now, as [`Runtime::pool_sizes`].
    pub fn num_free(&self) -> (usize, usize, usize) {
        (
            self.gpu.num_free(),
            self.host.num_free(),
            self.rows.num_free(),
        )
    }

    /// Entries reserved by the admitted requests, per pool, as [`Runtime::pool_sizes`].
    pub fn reserved(&self) -> (usize, usize, usize) {
        (self.reserved_gpu, self.reserved_host, self.reserved_rows)
    }

    /// The caps (budgets), as [`Runtime::pool_sizes`]; the ids' is [`MAX_POOL_BLOCKS`].
    pub fn caps(&self) -> (usize, usize, usize) {
        (self.gpu_cap, MAX_POOL_BLOCKS, self.rows_cap)
    }

    pub fn num_requests(&self) -> usize {
        self.reqs.len()
    }

    pub fn table(&self, id: u64) -> Option<&RequestTable> {
        self.reqs.get(&id)
    }

    fn get(&self, id: u64) -> Result<&RequestTable> {
        self.reqs
            .get(&id)
            .ok_or_else(|| OasisError::Invalid(format!("unknown request {id}")))
    }

    /// The peak need of a request (see [`Reservation::for_request`]).
    pub fn reservation(&self, prompt_len: usize, max_new_tokens: usize) -> Reservation {
        Reservation::for_request(&self.cfg, prompt_len, max_new_tokens)
    }

    /// Whether a request with this reservation could ever be admitted (alone, at the caps).
    pub fn fits_ever(&self, r: &Reservation) -> bool {
        r.gpu_pages <= self.gpu_cap && r.host_rows <= self.rows_cap
    }

    /// Whether a request with this reservation can be admitted now (a seat and room under the
    /// caps beside the running requests' reservations). The pools may have to grow first:
    /// [`Runtime::pool_sizes_needed`].
    pub fn can_admit(&self, r: &Reservation) -> bool {
        !self.free_slots.is_empty()
            && self.reserved_gpu + r.gpu_pages <= self.gpu_cap
            && self.reserved_rows + r.host_rows <= self.rows_cap
            && self.reserved_host + r.host_blocks <= MAX_POOL_BLOCKS
    }

    /// Pool sizes that admitting `r` needs (the reservations, all together), as
    /// [`Runtime::pool_sizes`].
    pub fn pool_sizes_needed(&self, r: &Reservation) -> (usize, usize, usize) {
        (
            self.reserved_gpu + r.gpu_pages,
            self.reserved_host + r.host_blocks,
            self.reserved_rows + r.host_rows,
        )
    }

    /// Grow the pools to at least these sizes (never shrinks; the engine grows its tensors first).
    ///
    /// # Errors
    /// [`OasisError::Config`] past a cap; [`OasisError::OutOfMemory`] when the free list cannot be
    /// allocated.
    pub fn grow(&mut self, gpu_pages: usize, host_blocks: usize, host_rows: usize) -> Result<()> {
        if gpu_pages > self.gpu_cap || host_rows > self.rows_cap || host_blocks > MAX_POOL_BLOCKS {
            return Err(OasisError::Config(format!(
                "cannot grow the pools to {gpu_pages} gpu pages / {host_blocks} host blocks / \
                 {host_rows} host rows: the caps are {} / {MAX_POOL_BLOCKS} / {}",
                self.gpu_cap, self.rows_cap
            )));
        }
        self.gpu.grow(gpu_pages)?;
        self.host.grow(host_blocks)?;
        self.rows.grow(host_rows)?;
        Ok(())
    }

    /// Admit request `id` whose prompt of `prompt_len` tokens is about to be prefilled: reserve
    /// its peak, take an accumulator slot, and allocate the prompt's pages (logical order, their
    /// mapping queued). Returns the slot and the pages.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a duplicate id or an empty prompt; [`OasisError::OutOfBlocks`]
    /// when [`Runtime::can_admit`] is false or the pools were not grown to
    /// [`Runtime::pool_sizes_needed`]. Nothing changes on error.
    pub fn admit(
        &mut self,
        id: u64,
        prompt_len: usize,
        max_new_tokens: usize,
    ) -> Result<(u32, Vec<u32>)> {
        let res = self.reservation(prompt_len, max_new_tokens);
        self.check_admission(id, prompt_len, max_new_tokens, &res)?;
        let n_blocks = prompt_len.div_ceil(self.cfg.block_size);
        // Cannot fail: the pool holds at least the reservations, and every request holds at most
        // its own.
        let pages = self.gpu.allocate(n_blocks)?;
        let slot = self.free_slots.pop().expect("checked by check_admission");
        for (i, &p) in pages.iter().enumerate() {
            self.queue_map(p, to_i32(i));
        }
        self.reserved_gpu += res.gpu_pages;
        self.reserved_host += res.host_blocks;
        self.reserved_rows += res.host_rows;
        self.reqs.insert(
            id,
            RequestTable {
                id,
                slot,
                kv_len: prompt_len,
                sparse: false,
                pages: pages.clone(),
                slot_pages: Vec::new(),
                local_page: None,
                host_blocks: Vec::new(),
                host_rows: Vec::new(),
                cache: None,
                written_from: 0,
                reservation: res,
            },
        );
        Ok((slot, pages))
    }

    /// Refuse an admission of `res` for request `id` unless the id is new, the sizes non-zero, a
    /// seat is free and the pools (grown, under the caps) hold `res` beside the reservations (no
    /// seat is reported as [`OasisError::OutOfBlocks`] too, as [`Runtime::can_admit`] folds it in).
    fn check_admission(
        &self,
        id: u64,
        prompt_len: usize,
        max_new_tokens: usize,
        res: &Reservation,
    ) -> Result<()> {
        if self.reqs.contains_key(&id) {
            return Err(OasisError::Invalid(format!(
                "request {id} is already admitted"
            )));
        }
        if prompt_len == 0 || max_new_tokens == 0 {
            return Err(OasisError::Invalid(format!(
                "request {id}: prompt_len and max_new_tokens must be >= 1, got {prompt_len} and \
                 {max_new_tokens}"
            )));
        }
        let (need_gpu, need_host, need_rows) = self.pool_sizes_needed(res);
        if !self.can_admit(res)
            || need_gpu > self.gpu.num_blocks()
            || need_host > self.host.num_blocks()
            || need_rows > self.rows.num_blocks()
        {
            let rows_room = self.rows_cap.min(self.rows.num_blocks());
            let (tier, requested, free) = if need_rows > rows_room {
                (
                    Tier::Host,
                    res.host_rows,
                    rows_room.saturating_sub(self.reserved_rows),
                )
            } else if need_host > self.host.num_blocks() {
                (
                    Tier::Host,
                    res.host_blocks,
                    self.host.num_blocks().saturating_sub(self.reserved_host),
                )
            } else {
                (
                    Tier::Gpu,
                    res.gpu_pages,
                    self.gpu_cap
                        .min(self.gpu.num_blocks())
                        .saturating_sub(self.reserved_gpu),
                )
            };
            return Err(OasisError::OutOfBlocks {
                tier,
                requested,
                free,
            });
        }
        Ok(())
    }

    /// Free everything request `id` holds and its reservation and slot.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an unknown request.
    pub fn release(&mut self, id: u64) -> Result<()> {
        let t = self
            .reqs
            .remove(&id)
            .ok_or_else(|| OasisError::Invalid(format!("unknown request {id}")))?;
        // A tentative draft slot's block is in the table: freed with it.
        self.drafts.retain(|d| d.id != id);
        let mut pages: Vec<u32> = t.all_pages().collect();
        pages.sort_unstable();
        self.gpu.free(&pages)?;
        self.host.free(&t.host_blocks)?;
        self.rows.free(&t.all_rows())?;
        self.reserved_gpu -= t.reservation.gpu_pages;
        self.reserved_host -= t.reservation.host_blocks;
        self.reserved_rows -= t.reservation.host_rows;
        self.free_slots.push(t.slot);
        Ok(())
    }

    /// Tokens stored for request `id` (the position its next token lands at).
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an unknown request.
    pub fn kv_len(&self, id: u64) -> Result<usize> {
        Ok(self.get(id)?.kv_len)
    }

    fn queue_map(&mut self, page: u32, value: i32) {
        if self.map_value.insert(page, value).is_none() {
            self.map_order.push(page);
        }
    }

    /// Drain the pending head-wise mapping updates: `(pages, values)`, each page once.
    pub fn take_map_updates(&mut self) -> (Vec<u32>, Vec<i32>) {
        let pages = std::mem::take(&mut self.map_order);
        let values = pages.iter().map(|p| self.map_value[p]).collect();
        self.map_value.clear();
        (pages, values)
    }

    /// Make the block that request `id`'s next token (at `kv_len`) lands in ready: allocate its
    /// page (dense) or host block (sparse) when the token enters it, and queue the mapping of the
    /// page that holds it (a dense request's new page; a sparse request's local page when it moves
    /// on to a new block). Returns that page, the host block of the write-through (-1 when dense)
    /// and the token's offset in the block. `kv_len` is not advanced.
    fn enter_block(&mut self, id: u64) -> Result<(u32, i32, usize)> {
        let e = self.enter_block_unmapped(id)?;
        if let Some((page, value)) = e.map {
            self.queue_map(page, value);
        }
        Ok((e.page, e.host, e.offset))
    }

    /// Give back a sparse request's last host block and its row (a rejected draft's).
    fn pop_host_block(&mut self, id: u64, block: u32) -> Result<()> {
        let t = self.reqs.get_mut(&id).expect("checked by the caller");
        debug_assert_eq!(t.host_blocks.last(), Some(&block));
        t.host_blocks.pop();
        let row = t
            .host_rows
            .pop()
            .expect("host_rows parallel to host_blocks");
        self.host.free(&[block])?;
        self.rows.free(&[row])
    }

    /// [`Runtime::enter_block`] without queueing the mapping update: returned instead, with the
    /// block allocated, if any.
    fn enter_block_unmapped(&mut self, id: u64) -> Result<Entered> {
        let b = self.cfg.block_size;
        let t = self.get(id)?;
        let (blk, off) = (t.kv_len / b, t.kv_len % b);
        let (sparse, need) = if t.sparse {
            (true, t.host_blocks.len() <= blk)
        } else {
            (false, t.pages.len() <= blk)
        };
        let mut entered = None;
        let mut entered_row = None;
        let mut map = None;
        if need {
            let new = if sparse {
                // A block the request writes: an id and a row of its own (within the
                // reservation of both).
                let id_new = self.host.allocate(1)?[0];
                let row = match self.rows.allocate(1) {
                    Ok(r) => r[0],
                    Err(e) => {
                        self.host.free(&[id_new])?;
                        return Err(e);
                    }
                };
                entered_row = Some(row);
                id_new
            } else {
                self.gpu.allocate(1)?[0]
            };
            entered = Some(new);
            let t = self.reqs.get_mut(&id).expect("checked");
            if sparse {
                t.host_blocks.push(new);
                t.host_rows.push(entered_row.expect("set above"));
            } else {
                t.pages.push(new);
                map = Some((new, to_i32(blk)));
            }
        }
        let t = &self.reqs[&id];
        if !sparse {
            return Ok(Entered {
                page: t.pages[blk],
                host: -1,
                row: -1,
                offset: off,
                entered,
                entered_row,
                map,
            });
        }
        let local = t.local_page.expect("sparse requests hold a local page");
        if off == 0 {
            map = Some((local, to_i32(blk)));
        }
        Ok(Entered {
            page: local,
            host: t.host_blocks[blk] as i32,
            row: t.host_rows[blk] as i32,
            offset: off,
            entered,
            entered_row,
            map,
        })
    }

    /// Plan one decode step of the requests `ids` (in batch order), whose query rows take the
    /// tokens `input_ids` (`rows` per request: x_t, then the draft): each request stores its next
    /// token, so its `kv_len` advances by one. Blocks the step enters are allocated here (within the
    /// reservation), and the pending mapping updates move into the plan.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an unknown or repeated id, or a dense request past the sparse
    /// threshold (it must turn sparse first: its reservation does not cover more dense pages).
    /// Nothing changes then.
    pub fn plan(&mut self, ids: &[u64], input_ids: &[i32]) -> Result<&StepPlan> {
        self.plan_with(ids, input_ids, None, None)
    }

    /// The capacities a padded plan of `ids` needs ([`Runtime::plan_padded`]): the most attention
    /// pages and the most host blocks any of them holds once this step's block is entered.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an unknown request.
    pub fn step_needs(&self, ids: &[u64]) -> Result<(usize, usize)> {
        let b = self.cfg.block_size;
        let (mut pages, mut blocks) = (0usize, 0usize);
        for &id in ids {
            let t = self.get(id)?;
            let blk = t.kv_len / b + 1;
            if t.sparse {
                pages = pages.max(t.slot_pages.len() + 1);
                blocks = blocks.max(t.host_blocks.len().max(blk));
            } else {
                pages = pages.max(t.pages.len().max(blk));
            }
        }
        Ok((pages, blocks))
    }

    /// [`Runtime::plan`] at the fixed capacities of `pad` (see [`PlanPad`]): the same layout for
    /// every step of the same capacities, so a captured CUDA graph can read it. The head-wise
    /// mapping updates stay pending ([`Runtime::take_map_updates`]).
    ///
    /// # Errors
    /// As [`Runtime::plan`], and [`OasisError::Invalid`] when the requests do not fit `pad` (more
    /// requests than `rows`, or more than `pages` / `blocks` for one of them:
    /// [`Runtime::step_needs`] says how many); nothing changes then.
    pub fn plan_padded(
        &mut self,
        ids: &[u64],
        input_ids: &[i32],
        pad: &PlanPad,
    ) -> Result<&StepPlan> {
        self.check_pad(ids, pad)?;
        self.plan_with(ids, input_ids, Some(pad), None)
    }

    /// [`Runtime::plan`] (or [`Runtime::plan_padded`] with `pad`) of a speculative step: besides
    /// storing x_t, every request `i` with `tries[i]` that [`Runtime::can_append`] allows after x_t
    /// gets a *tentative slot* for its draft (row 1), the position after x_t: its block is entered
    /// (allocated within the reservation) and its page, offset and host block are written to the
    /// plan's `spec_*` fields (-1 where the request does not try), so the step can store the
    /// draft's K/V there where it accepts it, without a host round trip. Its `kv_len` does not
    /// advance and the mapping update stays back until [`Runtime::commit_drafts`], which must come
    /// before the next plan. [`Runtime::pending_drafts`] lists the requests that got a slot.
    ///
    /// # Errors
    /// As [`Runtime::plan`] / [`Runtime::plan_padded`], and [`OasisError::Invalid`] when `tries`
    /// does not have one entry per request or the last speculative plan's drafts are not committed
    /// yet. Nothing changes then.
    pub fn plan_speculative(
        &mut self,
        ids: &[u64],
        input_ids: &[i32],
        pad: Option<&PlanPad>,
        tries: &[bool],
    ) -> Result<&StepPlan> {
        if tries.len() != ids.len() {
            return Err(OasisError::Invalid(format!(
                "{} draft flags for {} requests",
                tries.len(),
                ids.len()
            )));
        }
        if let Some(pad) = pad {
            self.check_pad(ids, pad)?;
        }
        self.plan_with(ids, input_ids, pad, Some(tries))
    }

    fn check_pad(&self, ids: &[u64], pad: &PlanPad) -> Result<()> {
        let (pages, blocks) = self.step_needs(ids)?;
        if ids.len() > pad.rows || pages > pad.pages || blocks > pad.blocks {
            return Err(OasisError::Invalid(format!(
                "{} requests needing {pages} pages and {blocks} host blocks each do not fit the \
                 padded plan of {} rows x {} pages x {} blocks; plan with larger capacities \
                 (Runtime::step_needs)",
                ids.len(),
                pad.rows,
                pad.pages,
                pad.blocks
            )));
        }
        if pad.dummy_slot < 0 {
            return Err(OasisError::Invalid(format!(
                "the padded plan's dummy accumulator slot must be >= 0, got {}",
                pad.dummy_slot
            )));
        }
        Ok(())
    }

    fn plan_with(
        &mut self,
        ids: &[u64],
        input_ids: &[i32],
        pad: Option<&PlanPad>,
        tries: Option<&[bool]>,
    ) -> Result<&StepPlan> {
        if !self.drafts.is_empty() {
            return Err(OasisError::Invalid(format!(
                "the drafts of the last speculative step ({} tentative slots) are not resolved: \
                 call commit_drafts before the next plan",
                self.drafts.len()
            )));
        }
        if input_ids.len() != ids.len() * self.cfg.rows {
            return Err(OasisError::Invalid(format!(
                "{} input ids for {} requests of {} rows",
                input_ids.len(),
                ids.len(),
                self.cfg.rows
            )));
        }
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        for &id in ids {
            // Admission reserved the working set, not the dense pages past the threshold.
            if self.wants_sparse(id)? {
                return Err(OasisError::Invalid(format!(
                    "request {id} is past the sparse threshold: turn it sparse (make_sparse) \
                     before it decodes further"
                )));
            }
            if !seen.insert(id) {
                return Err(OasisError::Invalid(format!(
                    "request {id} listed twice in one step"
                )));
            }
        }
        // Allocate the blocks this step's tokens land in.
        for &id in ids {
            self.enter_block(id)?;
        }
        // A padded plan leaves the mapping updates pending (their number varies per step).
        let (map_pages, map_values) = if pad.is_some() {
            (Vec::new(), Vec::new())
        } else {
            self.take_map_updates()
        };
        let tables: Vec<&RequestTable> = ids.iter().map(|id| &self.reqs[id]).collect();
        self.plan.build(
            &self.cfg,
            &tables,
            input_ids,
            &map_pages,
            &map_values,
            pad,
            tries.is_some(),
        );
        for &id in ids {
            self.reqs.get_mut(&id).expect("checked").kv_len += 1;
        }
        // The drafts' tentative slots, after x_t: not in this step's attention tables.
        for (i, (&id, &t)) in ids.iter().zip(tries.unwrap_or(&[])).enumerate() {
            if !t || !self.can_append(id)? {
                continue;
            }
            // Within the reservation (can_append), so the pool has the block; a draft is optional
            // anyway, so a refusal only means this one does not try.
            let Ok(e) = self.enter_block_unmapped(id) else {
                continue;
            };
            self.plan
                .set_draft(i, e.page as i32, to_i32(e.offset), e.host, e.row);
            self.drafts.push(Draft {
                id,
                entered: e.entered,
                entered_row: e.entered_row,
                map: e.map,
            });
        }
        Ok(&self.plan)
    }

    /// The plan of the last [`Runtime::plan`].
    pub fn last_plan(&self) -> &StepPlan {
        &self.plan
    }
}
