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

    /// The peak need of a request admitted sparse (see [`Reservation::for_sparse_request`]).
    pub fn sparse_reservation(
        &self,
        prompt_len: usize,
        max_new_tokens: usize,
        cache_blocks: Option<usize>,
    ) -> Reservation {
        Reservation::for_sparse_request(&self.cfg, prompt_len, max_new_tokens, cache_blocks)
    }

    /// Admit request `id`, whose prompt of `prompt_len` tokens is already stored elsewhere (a
    /// prefill worker staged it), directly sparse: reserve and allocate only the working set, `K`
    /// slot pages (mapping queued empty) and the local page (mapped to block `prompt_len / b`),
    /// plus the prompt's `ceil(prompt_len / b)` host blocks; never the prompt's dense pages, so
    /// the GPU peak is `K + 1` pages (admitting dense and then [`Runtime::make_sparse`] briefly
    /// needs `ceil(prompt_len / b)`). The engine fills the host blocks, the summaries and the
    /// local page (the partial last block) itself, then selects the initial working set over
    /// the first `n_complete` host blocks.
    ///
    /// Returns the slot and a [`SparseTransition`] with no `src_pages` (nothing to copy on the
    /// device); `lens` are the tokens of each host block.
    ///
    /// `cache_blocks = Some(C)` bounds its host rows (the bounded decode-side host pool): rows of
    /// its own only for the blocks it writes itself (logicals `>= floor(P / b)`: the partial last
    /// block and the ones decode enters), and `C` cache rows that [`Runtime::cache_blocks`] hands
    /// to the daemon's blocks as the gathers need them (the others' `host_rows` entry is the
    /// first cache row, a filler no plan reads). `None`: a row for every block, as a local
    /// request.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a duplicate id, an empty prompt, the dense backend or
    /// `cache_blocks = Some(0)`; [`OasisError::OutOfBlocks`] when the
    /// [`Runtime::sparse_reservation`] does not fit now or the pools were not grown to it.
    /// Nothing changes on error.
    pub fn admit_sparse(
        &mut self,
        id: u64,
        prompt_len: usize,
        max_new_tokens: usize,
        cache_blocks: Option<usize>,
    ) -> Result<(u32, SparseTransition)> {
        let (b, k) = (self.cfg.block_size, self.cfg.top_k_blocks);
        if !self.cfg.sparse {
            return Err(OasisError::Invalid(format!(
                "request {id}: admit_sparse needs the sparse backend"
            )));
        }
        if cache_blocks == Some(0) {
            return Err(OasisError::Invalid(format!(
                "request {id}: cache_blocks must be >= 1 (None: a row for every block)"
            )));
        }
        let res = self.sparse_reservation(prompt_len, max_new_tokens, cache_blocks);
        self.check_admission(id, prompt_len, max_new_tokens, &res)?;
        let n_blocks = prompt_len.div_ceil(b);
        let written_from = if cache_blocks.is_some() {
            prompt_len / b
        } else {
            0
        };
        let n_rows = cache_blocks.unwrap_or(0) + n_blocks - written_from;
        // Cannot fail (checked: the pools hold the reservations); undone anyway if it does.
        let mut pages = self.gpu.allocate(k + 1)?;
        let host_blocks = match self.host.allocate(n_blocks) {
            Ok(h) => h,
            Err(e) => {
                self.gpu.free(&pages)?;
                return Err(e);
            }
        };
        let mut rows = match self.rows.allocate(n_rows) {
            Ok(r) => r,
            Err(e) => {
                self.gpu.free(&pages)?;
                self.host.free(&host_blocks)?;
                return Err(e);
            }
        };
        let (host_rows, cache) = match cache_blocks {
            None => (rows, None),
            Some(c) => {
                let own = rows.split_off(c);
                let mut host_rows = vec![rows[0]; written_from];
                host_rows.extend(own);
                (host_rows, Some(RowCache::new(rows)))
            }
        };
        let slot = self.free_slots.pop().expect("checked by check_admission");
        let local_page = pages.pop().expect("k + 1 >= 1 pages");
        let slot_pages = pages;
        for &p in &slot_pages {
            self.queue_map(p, -1);
        }
        let local_block = prompt_len / b;
        self.queue_map(local_page, to_i32(local_block));
        let mut lens = vec![b as u32; n_blocks];
        if let Some(last) = lens.last_mut() {
            *last = (prompt_len - (n_blocks - 1) * b) as u32;
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
                sparse: true,
                pages: Vec::new(),
                slot_pages: slot_pages.clone(),
                local_page: Some(local_page),
                host_blocks: host_blocks.clone(),
                host_rows: host_rows.clone(),
                cache,
                written_from,
                reservation: res,
            },
        );
        Ok((
            slot,
            SparseTransition {
                src_pages: Vec::new(),
                host_blocks,
                host_rows,
                lens,
                slot_pages,
                local_page,
                n_complete: local_block,
            },
        ))
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

    /// Whether request `id` should turn sparse now: the sparse backend, still dense, and its
    /// stored context past the threshold.
    pub fn wants_sparse(&self, id: u64) -> Result<bool> {
        let t = self.get(id)?;
        Ok(self.cfg.sparse && !t.sparse && t.kv_len > self.cfg.sparse_threshold)
    }

    /// Turn request `id` sparse: its KV goes to fresh host blocks, its dense pages become the
    /// local page and the working-set slots (more pages allocated if it held fewer than K + 1,
    /// surplus freed), their mapping queued (slots empty, local page its block).
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an unknown or already sparse request. Nothing changes on error.
    pub fn make_sparse(&mut self, id: u64) -> Result<SparseTransition> {
        let (b, k) = (self.cfg.block_size, self.cfg.top_k_blocks);
        let t = self.get(id)?;
        if t.sparse {
            return Err(OasisError::Invalid(format!(
                "request {id} is already sparse"
            )));
        }
        let length = t.kv_len;
        let n_blocks = length.div_ceil(b);
        let local_block = length / b;
        let mut spare = t.pages.clone();
        if spare.len() < n_blocks {
            return Err(OasisError::Invalid(format!(
                "request {id} holds {} pages for {length} tokens",
                spare.len()
            )));
        }
        let src_pages = spare[..n_blocks].to_vec();
        // The reservation covers host blocks and rows for the whole life and K + 1 pages:
        // cannot fail.
        let host_blocks = self.host.allocate(n_blocks)?;
        let host_rows = match self.rows.allocate(n_blocks) {
            Ok(r) => r,
            Err(e) => {
                self.host.free(&host_blocks)?;
                return Err(e);
            }
        };
        let local_page = if length % b != 0 {
            spare.remove(local_block)
        } else {
            match spare.pop() {
                Some(p) => p,
                None => match self.gpu.allocate(1) {
                    Ok(p) => p[0],
                    Err(e) => {
                        self.host.free(&host_blocks)?;
                        self.rows.free(&host_rows)?;
                        return Err(e);
                    }
                },
            }
        };
        if spare.len() < k {
            match self.gpu.allocate(k - spare.len()) {
                Ok(more) => spare.extend(more),
                Err(e) => {
                    self.host.free(&host_blocks)?;
                    self.rows.free(&host_rows)?;
                    return Err(e);
                }
            }
        }
        let surplus = spare.split_off(k);
        self.gpu.free(&surplus)?;
        let slot_pages = spare;
        let mut lens = vec![b as u32; n_blocks];
        if let Some(last) = lens.last_mut() {
            *last = (length - (n_blocks - 1) * b) as u32;
        }
        for &p in &slot_pages {
            self.queue_map(p, -1);
        }
        self.queue_map(local_page, to_i32(local_block));
        let gpu_res = k + 1;
        let t = self.reqs.get_mut(&id).expect("checked above");
        self.reserved_gpu -= t.reservation.gpu_pages;
        t.reservation.gpu_pages = gpu_res;
        self.reserved_gpu += gpu_res;
        t.sparse = true;
        t.pages.clear();
        t.slot_pages = slot_pages.clone();
        t.local_page = Some(local_page);
        t.host_blocks = host_blocks.clone();
        t.host_rows = host_rows.clone();
        Ok(SparseTransition {
            src_pages,
            host_blocks,
            host_rows,
            lens,
            slot_pages,
            local_page,
            n_complete: length / b,
        })
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

    /// Whether request `id`'s draft may take position `kv_len`, after the token its last plan
    /// stored (speculative decoding: [`Runtime::plan_speculative`] reserves a tentative slot
    /// there only then; the step computed the draft's K/V in row 1). False when
    /// * the request is past the sparse threshold (it must turn sparse first: its reservation
    ///   does not cover more dense pages);
    /// * it is sparse and the token would complete its local block: this step's selection did
    ///   not see that block as a candidate, so the next step would attend to neither it (the
    ///   local page moves on) nor, unless it is selected, its slot;
    /// * the block it lands in would pass the reservation.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an unknown request.
    pub fn can_append(&self, id: u64) -> Result<bool> {
        let b = self.cfg.block_size;
        if self.wants_sparse(id)? {
            return Ok(false);
        }
        let t = self.get(id)?;
        let blk = t.kv_len / b;
        Ok(if t.sparse {
            t.kv_len % b != b - 1
                && (blk < t.host_blocks.len() || t.host_blocks.len() < t.reservation.host_blocks)
        } else {
            blk < t.pages.len() || t.pages.len() < t.reservation.gpu_pages
        })
    }

    /// The requests whose drafts hold a tentative slot ([`Runtime::plan_speculative`]), batch
    /// order.
    pub fn pending_drafts(&self) -> Vec<u64> {
        self.drafts.iter().map(|d| d.id).collect()
    }

    /// Resolve the tentative slots of the last [`Runtime::plan_speculative`]: the drafts of
    /// `accepted` are stored (the step wrote their K/V into the slot): their mapping update is
    /// queued (applied by the next plan) and `kv_len` advances, so those tables moved by two
    /// tokens in the step. Every other slot is given back (the block entered for it freed), so a
    /// rejected draft leaves nothing: the next token lands where it would have.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an id listed twice or without a tentative slot. Nothing changes
    /// then.
    pub fn commit_drafts(&mut self, accepted: &[u64]) -> Result<()> {
        let mut seen = std::collections::HashSet::with_capacity(accepted.len());
        for &id in accepted {
            if !seen.insert(id) {
                return Err(OasisError::Invalid(format!(
                    "request {id} listed twice among the accepted drafts"
                )));
            }
            if !self.drafts.iter().any(|d| d.id == id) {
                return Err(OasisError::Invalid(format!(
                    "request {id} holds no tentative draft slot (plan_speculative reserves them; \
                     pending_drafts lists them)"
                )));
            }
        }
        for d in std::mem::take(&mut self.drafts) {
            let t = self.reqs.get_mut(&d.id).expect("release drops its drafts");
            if seen.contains(&d.id) {
                t.kv_len += 1;
                if let Some((page, value)) = d.map {
                    self.queue_map(page, value);
                }
            } else if let Some(block) = d.entered {
                // The block entered for the draft is the table's last one (with its row).
                if t.sparse {
                    debug_assert_eq!(t.host_rows.last().copied(), d.entered_row);
                    self.pop_host_block(d.id, block)?;
                } else {
                    debug_assert_eq!(t.pages.last(), Some(&block));
                    t.pages.pop();
                    self.gpu.free(&[block])?;
                }
            }
        }
        Ok(())
    }

    /// Give host rows to request `id`'s logical blocks `logicals` (repeats allowed) before a
    /// gather reads them: the blocks it writes itself (and every block of a request without a
    /// bounded cache) have their rows already; the daemon's blocks of a bounded staged request
    /// go through its [`RowCache`] (see [`RowCache::cache_blocks`]): uncached ones get rows,
    /// evicting the least recently used cached blocks outside `pinned` and `logicals`, and its
    /// `host_rows` follow (a row given: that row; evicted: the filler). The next plan's
    /// `host_indices` read the new rows; the caller patches the current step's own.
    ///
    /// Returns [`Cached`]: `rows` in the order asked, `given` (the caller reads their bytes),
    /// `evicted` (`(logical, row)`: their bytes are gone).
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an unknown request or a logical block past its table;
    /// [`OasisError::OutOfBlocks`] (host tier) when every cache row is pinned. Nothing changes on
    /// error.
    pub fn cache_blocks(
        &mut self,
        id: u64,
        logicals: &[usize],
        pinned: &[usize],
    ) -> Result<Cached> {
        let t = self.get(id)?;
        if let Some(&l) = logicals.iter().find(|&&l| l >= t.host_rows.len()) {
            return Err(OasisError::Invalid(format!(
                "request {id} has {} host blocks, no logical block {l}",
                t.host_rows.len()
            )));
        }
        let from = t.written_from;
        let t = self.reqs.get_mut(&id).expect("checked above");
        let Some(cache) = t.cache.as_mut() else {
            return Ok(Cached {
                rows: logicals.iter().map(|&l| t.host_rows[l]).collect(),
                ..Cached::default()
            });
        };
        let theirs: Vec<usize> = logicals.iter().copied().filter(|&l| l < from).collect();
        let pin: Vec<usize> = pinned.iter().copied().filter(|&l| l < from).collect();
        let got = cache.cache_blocks(&theirs, &pin)?;
        let filler = cache.rows()[0];
        for &(l, _) in &got.evicted {
            t.host_rows[l] = filler;
        }
        for (&l, &row) in theirs.iter().zip(&got.rows) {
            t.host_rows[l] = row;
        }
        Ok(Cached {
            rows: logicals.iter().map(|&l| t.host_rows[l]).collect(),
            given: got.given,
            evicted: got.evicted,
        })
    }

    /// The plan of the last [`Runtime::plan`].
    pub fn last_plan(&self) -> &StepPlan {
        &self.plan
    }

    /// Check every invariant of the tables against the pools (tests and debug builds).
    ///
    /// # Errors
    /// [`OasisError::Invalid`] describing the first violation.
    pub fn check_invariants(&self) -> Result<()> {
        let mut owner_gpu = HashMap::new();
        let mut owner_host = HashMap::new();
        let mut owner_row = HashMap::new();
        let (mut res_gpu, mut res_host, mut res_rows) = (0, 0, 0);
        let bad = |m: String| Err(OasisError::Invalid(m));
        for t in self.reqs.values() {
            res_gpu += t.reservation.gpu_pages;
            res_host += t.reservation.host_blocks;
            res_rows += t.reservation.host_rows;
            for r in t.all_rows() {
                if self.rows.is_free(r) || owner_row.insert(r, t.id).is_some() {
                    return bad(format!(
                        "host row {r} of request {} is free or shared",
                        t.id
                    ));
                }
            }
            if t.host_rows.len() != t.host_blocks.len() {
                return bad(format!(
                    "request {} has {} host rows for {} host blocks",
                    t.id,
                    t.host_rows.len(),
                    t.host_blocks.len()
                ));
            }
            if let Some(c) = &t.cache {
                c.check_invariants()?;
                let filler = c.rows()[0];
                for (l, &r) in t.host_rows.iter().enumerate().take(t.written_from) {
                    if c.row_of(l).unwrap_or(filler) != r {
                        return bad(format!(
                            "request {}: block {l}'s host row {r} is not its cache row",
                            t.id
                        ));
                    }
                }
                if c.cached().any(|(l, _)| l >= t.written_from) {
                    return bad(format!("request {}: a written block is cached", t.id));
                }
                if c.capacity() == 0 {
                    return bad(format!("request {}: an empty row cache", t.id));
                }
            } else if t.written_from != 0 {
                return bad(format!("request {}: written_from without a cache", t.id));
            }
            if t.host_rows_held() > t.reservation.host_rows {
                return bad(format!("request {} holds more rows than reserved", t.id));
            }
            for p in t.all_pages() {
                if self.gpu.is_free(p) || owner_gpu.insert(p, t.id).is_some() {
                    return bad(format!("page {p} of request {} is free or shared", t.id));
                }
            }
            for &h in &t.host_blocks {
                if self.host.is_free(h) || owner_host.insert(h, t.id).is_some() {
                    return bad(format!(
                        "host block {h} of request {} is free or shared",
                        t.id
                    ));
                }
            }
            if t.gpu_pages_held() > t.reservation.gpu_pages
                || t.host_blocks.len() > t.reservation.host_blocks
            {
                return bad(format!("request {} holds more than its reservation", t.id));
            }
            let b = self.cfg.block_size;
            if t.sparse {
                if !t.pages.is_empty()
                    || t.slot_pages.len() != self.cfg.top_k_blocks
                    || t.local_page.is_none()
                    || t.host_blocks.len() < t.kv_len.div_ceil(b)
                {
                    return bad(format!("sparse request {} has malformed tables", t.id));
                }
            } else if t.pages.len() < t.kv_len.div_ceil(b)
                || !t.slot_pages.is_empty()
                || !t.host_blocks.is_empty()
            {
                return bad(format!("dense request {} has malformed tables", t.id));
            }
        }
        if owner_gpu.len() + self.gpu.num_free() != self.gpu.num_blocks()
            || owner_host.len() + self.host.num_free() != self.host.num_blocks()
            || owner_row.len() + self.rows.num_free() != self.rows.num_blocks()
        {
            return bad("a block is neither free nor held (leak)".into());
        }
        if (res_gpu, res_host, res_rows)
            != (self.reserved_gpu, self.reserved_host, self.reserved_rows)
        {
            return bad("the reservation totals drifted".into());
        }
        if self.free_slots.len() + self.reqs.len() != self.cfg.max_num_seqs {
            return bad("an accumulator slot leaked".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_config;
    use crate::plan::PlanField;

    fn runtime(gpu: usize, host: usize) -> Runtime {
        Runtime::new(test_config(), gpu, host, gpu, host).unwrap()
    }

    #[test]
    fn admit_plan_sparse_release_round_trip() {
        let mut rt = runtime(64, 64); // b = 4, K = 3, threshold 12
        let (slot, pages) = rt.admit(7, 10, 20).unwrap();
        assert_eq!((slot, pages.len()), (0, 3));
        let (mp, mv) = rt.take_map_updates();
        assert_eq!(mp, pages);
        assert_eq!(mv, vec![0, 1, 2]);
        // Three steps: positions 10, 11, 12 -> block 3 is entered at 12.
        for _ in 0..3 {
            rt.plan(&[7], &[0, 0]).unwrap();
            rt.check_invariants().unwrap();
        }
        assert_eq!(rt.kv_len(7).unwrap(), 13);
        assert!(rt.wants_sparse(7).unwrap());
        let tr = rt.make_sparse(7).unwrap();
        assert_eq!(tr.host_blocks.len(), 4);
        assert_eq!(tr.lens, vec![4, 4, 4, 1]);
        assert_eq!(tr.n_complete, 3);
        assert_eq!(tr.slot_pages.len(), 3);
        rt.check_invariants().unwrap();
        let t = rt.table(7).unwrap();
        assert_eq!(t.local_page, Some(tr.src_pages[3]));
        assert_eq!(rt.reserved().0, 4);
        let (mp, mv) = rt.take_map_updates();
        assert_eq!(mp.len(), 4);
        assert_eq!(mv, vec![-1, -1, -1, 3]);
        for _ in 0..6 {
            rt.plan(&[7], &[0, 0]).unwrap();
            rt.check_invariants().unwrap();
        }
        rt.release(7).unwrap();
        rt.check_invariants().unwrap();
        assert_eq!(rt.num_free(), (64, 64, 64));
        assert_eq!(rt.reserved(), (0, 0, 0));
    }

    #[test]
    fn padded_plan_holds_the_plan_at_fixed_offsets() {
        use crate::plan::PlanField as F;
        // b = 4, K = 3, threshold 12: request 1 dense, request 2 sparse.
        let mut rt = runtime(64, 64);
        rt.admit(1, 6, 20).unwrap();
        rt.admit(2, 14, 20).unwrap();
        rt.make_sparse(2).unwrap();
        rt.take_map_updates();
        let pad = PlanPad {
            rows: 4,
            pages: 8,
            blocks: 16,
            dummy_slot: 7,
        };
        let mut layouts = Vec::new();
        for step in 0..6 {
            let mut plain = rt.clone();
            let want = plain.plan(&[1, 2], &[5, 6, 7, 8]).unwrap().clone();
            let (want_pages, want_values) = (want.field(F::MapPages), want.field(F::MapValues));
            let got = rt
                .plan_padded(&[1, 2], &[5, 6, 7, 8], &pad)
                .unwrap()
                .clone();
            assert_eq!(got.num_seqs, 2);
            assert_eq!(got.num_sparse, 1);
            assert_eq!(got.max_pages, want.max_pages);
            layouts.push(*got.layout());
            // The mapping updates stay pending, and are the plain plan's.
            assert!(got.field(F::MapPages).is_empty());
            let (mp, mv) = rt.take_map_updates();
            assert_eq!(mp.iter().map(|&p| p as i32).collect::<Vec<_>>(), want_pages);
            assert_eq!(mv, want_values);
            // Every field: the plain plan's values first, then the padding.
            let check = |f: F, cap: usize, fill: i32| {
                let (w, g) = (want.field(f), got.field(f));
                assert_eq!(g.len(), cap, "{} capacity (step {step})", f.name());
                assert_eq!(&g[..w.len()], w, "{} values", f.name());
                assert!(
                    g[w.len()..].iter().all(|&x| x == fill),
                    "{} padding",
                    f.name()
                );
            };
            check(F::InputIds, 8, 0);
            check(F::Positions, 8, 0);
            check(F::PageIds, 4, -1);
            check(F::Offsets, 4, 0);
            check(F::HostIds, 4, -1);
            check(F::HostRows, 4, -1);
            check(F::LastLen, 4, 1);
            check(F::KvIndices, 32, -1);
            check(F::SpRows, 4, 0);
            check(F::SpSlots, 4, 7);
            check(F::SlotPages, 12, -1);
            check(F::BlkIndices, 64, -1);
            check(F::BlkSeq, 64, 0);
            check(F::HostIndices, 64, -1);
            check(F::RecIndices, 64, -1);
            check(F::DoneBlocks, 4, -1);
            check(F::DoneRows, 4, -1);
            check(F::DonePages, 4, -1);
            for f in [F::KvIndptr, F::BlkIndptr, F::HostIndptr, F::RecIndptr] {
                let w = want.field(f);
                check(f, 5, *w.last().unwrap());
            }
            plain.check_invariants().unwrap();
            rt.check_invariants().unwrap();
            assert_eq!(plain.table(1), rt.table(1));
            assert_eq!(plain.table(2), rt.table(2));
        }
        assert!(layouts.windows(2).all(|w| w[0] == w[1]), "the layout moved");
        // Too small: refused, nothing changes.
        let before = rt.clone().table(1).cloned();
        let small = PlanPad { pages: 2, ..pad };
        let e = rt.plan_padded(&[1, 2], &[0; 4], &small).unwrap_err();
        assert!(e.to_string().contains("step_needs"), "{e}");
        assert!(rt
            .plan_padded(&[1, 2], &[0; 4], &PlanPad { rows: 1, ..pad })
            .is_err());
        assert!(rt
            .plan_padded(
                &[1, 2],
                &[0; 4],
                &PlanPad {
                    dummy_slot: -1,
                    ..pad
                }
            )
            .is_err());
        assert_eq!(rt.table(1).cloned(), before);
        assert_eq!(rt.step_needs(&[1, 2]).unwrap(), (4, 6));
    }

    #[test]
    fn admission_is_refused_past_the_caps_and_changes_nothing() {
        let mut rt = runtime(8, 8);
        rt.admit(1, 14, 2).unwrap(); // sparse at once: max(4, K + 1) = 4 pages, 4 host blocks
        assert_eq!(rt.reserved(), (4, 4, 4));
        let r = rt.reservation(17, 2); // 5 pages
        assert!(!rt.can_admit(&r));
        let e = rt.admit(2, 17, 2).unwrap_err();
        assert!(
            matches!(
                e,
                OasisError::OutOfBlocks {
                    tier: Tier::Host,
                    ..
                }
            ),
            "{e}"
        );
        rt.check_invariants().unwrap();
        assert!(rt.admit(1, 3, 2).is_err()); // duplicate id
        assert!(rt.admit(3, 0, 2).is_err()); // empty prompt
        rt.check_invariants().unwrap();
    }

    #[test]
    fn grow_then_admit() {
        let mut rt = Runtime::new(test_config(), 2, 0, 100, 100).unwrap();
        let r = rt.reservation(40, 4);
        assert!(rt.can_admit(&r));
        assert!(rt.admit(1, 40, 4).is_err()); // the pools are still small
        let (g, h, w) = rt.pool_sizes_needed(&r);
        assert_eq!(h, w, "a local request takes a row with every id");
        rt.grow(g, h, w).unwrap();
        rt.admit(1, 40, 4).unwrap();
        assert!(rt.grow(101, 0, 0).is_err());
        assert!(rt.grow(0, 0, 101).is_err());
        rt.check_invariants().unwrap();
    }

    /// The `spec_*` fields of the last plan: (page, offset, host) per batch row.
    /// (The host row, `spec_host_rows`, is checked against the table's row of the same block.)
    fn drafts_of(rt: &Runtime) -> Vec<(i32, i32, i32)> {
        let p = rt.last_plan();
        let f = |x| p.field(x).to_vec();
        let (a, b, c, d) = (
            f(PlanField::SpecPageIds),
            f(PlanField::SpecOffsets),
            f(PlanField::SpecHostIds),
            f(PlanField::SpecHostRows),
        );
        assert_eq!(c.len(), d.len());
        for (&id, &row) in c.iter().zip(&d) {
            if id < 0 {
                assert_eq!(row, -1);
                continue;
            }
            let owner = rt
                .reqs
                .values()
                .find(|t| t.host_blocks.contains(&(id as u32)));
            let t = owner.expect("a draft's host block is held");
            let l = t.host_blocks.iter().position(|&h| h == id as u32).unwrap();
            assert_eq!(t.host_rows[l] as i32, row, "the draft's row is its block's");
        }
        (0..a.len()).map(|i| (a[i], b[i], c[i])).collect()
    }

    #[test]
    fn speculative_plans_reserve_draft_slots_within_the_reservation() {
        let mut rt = runtime(64, 64); // b = 4, K = 3, threshold 12
                                      // Dense: 5 + 4 - 1 = 8 tokens at most -> 2 pages.
        rt.admit(1, 5, 4).unwrap();
        rt.take_map_updates();
        rt.plan_speculative(&[1], &[0, 0], None, &[true]).unwrap(); // x_t at 5, the draft at 6
        let pages = rt.table(1).unwrap().pages.clone();
        assert_eq!(drafts_of(&rt), vec![(pages[1] as i32, 2, -1)]);
        assert_eq!(rt.pending_drafts(), vec![1]);
        assert_eq!(
            rt.kv_len(1).unwrap(),
            6,
            "a tentative slot does not advance kv_len"
        );
        assert!(rt.plan(&[1], &[0, 0]).is_err(), "drafts first");
        assert!(rt.commit_drafts(&[1, 1]).is_err());
        assert!(rt.commit_drafts(&[9]).is_err());
        rt.commit_drafts(&[1]).unwrap();
        assert_eq!(rt.kv_len(1).unwrap(), 7);
        assert!(rt.pending_drafts().is_empty());
        // 7: the eighth token, the last stored; a third page passes the reservation.
        rt.plan_speculative(&[1], &[0, 0], None, &[true]).unwrap();
        assert_eq!(drafts_of(&rt), vec![(-1, 0, -1)]);
        assert!(rt.pending_drafts().is_empty());
        rt.commit_drafts(&[]).unwrap();
        assert_eq!(rt.kv_len(1).unwrap(), 8);
        rt.check_invariants().unwrap();
        // A dense request past the threshold must turn sparse before it stores more.
        rt.admit(2, 12, 10).unwrap();
        rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap(); // kv_len 13 > 12
        assert!(rt.pending_drafts().is_empty());
        rt.commit_drafts(&[]).unwrap();
        rt.make_sparse(2).unwrap();
        rt.take_map_updates();
        let local = rt.table(2).unwrap().local_page.unwrap();
        let host = rt.table(2).unwrap().host_blocks.clone();
        // Sparse, x_t at 13: the draft lands at 14 (offset 2), written through. A request that
        // does not try gets no slot.
        rt.admit(3, 3, 3).unwrap();
        rt.take_map_updates();
        rt.plan_speculative(&[3, 2], &[0, 0, 0, 0], None, &[false, true])
            .unwrap();
        assert_eq!(
            drafts_of(&rt),
            vec![(-1, 0, -1), (local as i32, 2, host[3] as i32)]
        );
        assert_eq!(rt.pending_drafts(), vec![2]);
        rt.commit_drafts(&[]).unwrap(); // rejected: nothing changes, the next token lands there
        assert_eq!(rt.kv_len(2).unwrap(), 14);
        assert_eq!(rt.take_map_updates(), (vec![], vec![]));
        // x_t at 14: the draft would complete block 3, which this step's selection did not see.
        rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap();
        assert!(rt.pending_drafts().is_empty());
        rt.commit_drafts(&[]).unwrap();
        // x_t at 15 completes it; the draft at 16 enters a new host block: rejected, the block
        // goes back and the local page keeps its mapping.
        let free = rt.num_free();
        rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap();
        let host = rt.table(2).unwrap().host_blocks.clone();
        assert_eq!(host.len(), 5);
        assert_eq!(drafts_of(&rt), vec![(local as i32, 0, host[4] as i32)]);
        assert_eq!(rt.num_free().1, free.1 - 1);
        assert_eq!(rt.num_free().2, free.2 - 1);
        rt.commit_drafts(&[]).unwrap();
        assert_eq!(rt.num_free(), free);
        assert_eq!(rt.table(2).unwrap().host_blocks.len(), 4);
        assert_eq!(rt.take_map_updates(), (vec![], vec![]));
        rt.check_invariants().unwrap();
        // Again: x_t at 16 enters block 4 itself; its draft at 17, accepted, advances kv_len.
        rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap(); // x_t at 16 (new block)
        rt.commit_drafts(&[2]).unwrap(); // the draft at 17
        assert_eq!(rt.kv_len(2).unwrap(), 18);
        rt.check_invariants().unwrap();
        // A padded speculative plan has one draft entry per padded row.
        let pad = PlanPad {
            rows: 4,
            pages: 8,
            blocks: 8,
            dummy_slot: 7,
        };
        rt.plan_speculative(&[2], &[0, 0], Some(&pad), &[true])
            .unwrap();
        assert_eq!(drafts_of(&rt), vec![(-1, 0, -1); 4]); // x_t at 18: the draft would complete block 4
        rt.commit_drafts(&[]).unwrap();
        assert!(rt.plan_speculative(&[2], &[0, 0], None, &[]).is_err());
        rt.plan_speculative(&[2], &[0, 0], None, &[true]).unwrap(); // x_t at 19, the draft at 20
        assert_eq!(rt.pending_drafts(), vec![2]);
        // Releasing a request drops its tentative slot with its blocks.
        rt.release(2).unwrap();
        assert!(rt.pending_drafts().is_empty());
        rt.commit_drafts(&[]).unwrap();
        rt.release(1).unwrap();
        rt.release(3).unwrap();
        rt.check_invariants().unwrap();
        assert_eq!(rt.num_free(), (64, 64, 64));
    }

    /// Everything a refused call must leave alone.
    fn snapshot(rt: &Runtime) -> impl PartialEq + std::fmt::Debug {
        let mut tables: Vec<_> = rt.reqs.values().cloned().collect();
        tables.sort_by_key(|t| t.id);
        (
            rt.num_free(),
            rt.reserved(),
            rt.pool_sizes(),
            rt.free_slots.clone(),
            rt.map_order.clone(),
            tables,
        )
    }

    #[test]
    fn admit_sparse_takes_only_the_working_set() {
        // b = 4, K = 3: 10 prompt tokens, 20 new -> 29 stored, 8 host blocks; K + 1 = 4 pages.
        let mut rt = runtime(4, 64);
        let (slot, tr) = rt.admit_sparse(7, 10, 20, None).unwrap();
        assert_eq!(slot, 0);
        assert!(tr.src_pages.is_empty());
        assert_eq!(tr.host_blocks.len(), 3);
        assert_eq!(tr.lens, vec![4, 4, 2]);
        assert_eq!(tr.n_complete, 2);
        assert_eq!(tr.slot_pages.len(), 3);
        rt.check_invariants().unwrap();
        assert_eq!(rt.reserved(), (4, 8, 8));
        assert_eq!(rt.num_free(), (0, 61, 61));
        let t = rt.table(7).unwrap();
        assert!(t.sparse && t.pages.is_empty());
        assert_eq!(t.kv_len, 10);
        assert_eq!(t.local_page, Some(tr.local_page));
        assert_eq!(
            (&t.slot_pages, &t.host_blocks),
            (&tr.slot_pages, &tr.host_blocks)
        );
        // The slots' mapping empty, the local page on block 10 / 4 = 2.
        let (mp, mv) = rt.take_map_updates();
        let mut want = tr.slot_pages.clone();
        want.push(tr.local_page);
        assert_eq!((mp, mv), (want, vec![-1, -1, -1, 2]));
        // In a pool of K + 1 pages a 40-token prompt cannot be admitted dense (10 pages), but
        // sparse it can.
        let mut small = runtime(4, 64);
        assert!(small.admit(1, 40, 2).is_err()); // 10 dense pages
        small.admit_sparse(1, 40, 2, None).unwrap();
        small.check_invariants().unwrap();
        // Decode: it enters blocks within its reservation, as a request that turned sparse.
        for _ in 0..19 {
            rt.plan(&[7], &[0, 0]).unwrap();
            rt.check_invariants().unwrap();
        }
        assert_eq!(rt.kv_len(7).unwrap(), 29);
        assert_eq!(rt.table(7).unwrap().host_blocks.len(), 8);
        rt.release(7).unwrap();
        rt.check_invariants().unwrap();
        assert_eq!(rt.num_free(), (4, 64, 64));
        assert_eq!(rt.reserved(), (0, 0, 0));
        assert_eq!(rt.num_requests(), 0);
    }

    #[test]
    fn admit_sparse_matches_admit_then_make_sparse() {
        // Prompts that turn sparse (P + 9 - 2 > 12), of every offset in a block.
        for prompt_len in [6, 8, 13, 16, 17] {
            let mut dense = runtime(64, 64);
            dense.admit(1, prompt_len, 9).unwrap();
            let want = dense.make_sparse(1).unwrap();
            let mut rt = runtime(64, 64);
            let (_, got) = rt.admit_sparse(1, prompt_len, 9, None).unwrap();
            assert_eq!(
                got.host_blocks.len(),
                want.host_blocks.len(),
                "{prompt_len}"
            );
            assert_eq!(got.lens, want.lens, "{prompt_len}");
            assert_eq!(got.n_complete, want.n_complete, "{prompt_len}");
            assert_eq!(got.slot_pages.len(), 3);
            let (t, u) = (rt.table(1).unwrap(), dense.table(1).unwrap());
            assert_eq!((t.kv_len, t.sparse), (u.kv_len, u.sparse));
            assert_eq!(t.reservation.host_blocks, u.reservation.host_blocks);
            assert_eq!(t.reservation.gpu_pages, 4);
            rt.check_invariants().unwrap();
            // Both decode alike from here.
            for _ in 0..8 {
                let a = rt.plan(&[1], &[0, 0]).unwrap().clone();
                let b = dense.plan(&[1], &[0, 0]).unwrap().clone();
                assert_eq!(a.num_sparse, b.num_sparse);
                assert_eq!(rt.kv_len(1).unwrap(), dense.kv_len(1).unwrap());
                assert_eq!(
                    rt.table(1).unwrap().host_blocks.len(),
                    dense.table(1).unwrap().host_blocks.len()
                );
                rt.check_invariants().unwrap();
            }
            rt.release(1).unwrap();
            assert_eq!(rt.num_free(), (64, 64, 64));
            rt.check_invariants().unwrap();
        }
    }

    #[test]
    fn admit_sparse_refusals_change_nothing() {
        let mut rt = runtime(8, 8); // b = 4, K = 3
        rt.admit_sparse(1, 14, 2, None).unwrap(); // 4 pages, 4 host blocks
        rt.take_map_updates();
        let before = snapshot(&rt);
        // Duplicate id, empty prompt, no new token.
        for (id, n, m) in [(1, 3, 2), (2, 0, 2), (2, 3, 0)] {
            let e = rt.admit_sparse(id, n, m, None).unwrap_err();
            assert!(matches!(e, OasisError::Invalid(_)), "{e}");
            assert_eq!(snapshot(&rt), before);
        }
        // Past the host cap: 17 + 2 - 1 = 18 tokens -> 5 blocks beside 4 of 8.
        let e = rt.admit_sparse(2, 17, 2, None).unwrap_err();
        assert!(
            matches!(
                e,
                OasisError::OutOfBlocks {
                    tier: Tier::Host,
                    requested: 5,
                    free: 4
                }
            ),
            "{e}"
        );
        assert_eq!(snapshot(&rt), before);
        // Host fits but not the working set beside the first one (GPU 4 of 8 free, needs 4: fits);
        // a third one does not.
        rt.admit_sparse(2, 3, 2, None).unwrap();
        let before = snapshot(&rt);
        let e = rt.admit_sparse(3, 1, 1, None).unwrap_err();
        assert!(
            matches!(
                e,
                OasisError::OutOfBlocks {
                    tier: Tier::Gpu,
                    requested: 4,
                    free: 0
                }
            ),
            "{e}"
        );
        assert_eq!(snapshot(&rt), before);
        rt.check_invariants().unwrap();
        // Pools not grown to the reservation yet.
        let mut rt = Runtime::new(test_config(), 2, 0, 100, 100).unwrap();
        let before = snapshot(&rt);
        assert!(rt.admit_sparse(1, 40, 4, None).is_err());
        assert_eq!(snapshot(&rt), before);
        let r = rt.sparse_reservation(40, 4, None);
        let (g, h, w) = rt.pool_sizes_needed(&r);
        assert_eq!((g, h, w), (4, 11, 11));
        rt.grow(g, h, w).unwrap();
        rt.admit_sparse(1, 40, 4, None).unwrap();
        rt.check_invariants().unwrap();
        // No seat left.
        let cfg = RuntimeConfig {
            max_num_seqs: 1,
            ..test_config()
        };
        let mut rt = Runtime::new(cfg, 64, 64, 64, 64).unwrap();
        rt.admit_sparse(1, 5, 5, None).unwrap();
        let before = snapshot(&rt);
        assert!(rt.admit_sparse(2, 5, 5, None).is_err());
        assert_eq!(snapshot(&rt), before);
        // The dense backend has no working set.
        let cfg = RuntimeConfig {
            sparse: false,
            ..test_config()
        };
        let mut rt = Runtime::new(cfg, 64, 64, 64, 64).unwrap();
        let before = snapshot(&rt);
        let e = rt.admit_sparse(1, 20, 5, None).unwrap_err();
        assert!(e.to_string().contains("sparse backend"), "{e}");
        assert_eq!(snapshot(&rt), before);
    }

    #[test]
    fn admit_sparse_with_a_bounded_cache_holds_c_rows_plus_its_own() {
        // b = 4, K = 3: 18 prompt tokens (blocks 0..3 complete, block 4 partial), 10 new -> 27
        // stored, 7 blocks; C = 2: rows for 2 + 7 - 18 / 4 = 5.
        let mut rt = runtime(8, 64);
        let r = rt.sparse_reservation(18, 10, Some(2));
        assert_eq!((r.host_blocks, r.host_rows), (7, 5));
        let (_, tr) = rt.admit_sparse(1, 18, 10, Some(2)).unwrap();
        rt.check_invariants().unwrap();
        assert_eq!(rt.reserved(), (4, 7, 5));
        assert_eq!(
            rt.num_free(),
            (4, 64 - 5, 64 - 3),
            "two cache rows and block 4's"
        );
        let filler = tr.host_rows[0];
        assert_eq!(tr.host_rows[..4], [filler; 4]);
        assert_ne!(tr.host_rows[4], filler);
        let own = tr.host_rows[4];
        // Blocks 0 and 2 get the two cache rows (nothing evicted), block 4 keeps its own row.
        let got = rt.cache_blocks(1, &[0, 2, 4], &[0, 2, 4]).unwrap();
        assert_eq!(got.given, vec![0, 2]);
        assert!(got.evicted.is_empty());
        assert_eq!(got.rows[2], own);
        let t = rt.table(1).unwrap();
        assert_eq!((t.host_rows[0], t.host_rows[2]), (got.rows[0], got.rows[1]));
        rt.check_invariants().unwrap();
        // Every cache row pinned: refused, nothing changes.
        let before = snapshot(&rt);
        let e = rt.cache_blocks(1, &[3], &[0, 2]).unwrap_err();
        assert!(
            matches!(
                e,
                OasisError::OutOfBlocks {
                    tier: Tier::Host,
                    ..
                }
            ),
            "{e}"
        );
        assert!(rt.cache_blocks(1, &[7], &[]).is_err(), "past the table");
        assert!(rt.cache_blocks(2, &[0], &[]).is_err(), "unknown request");
        assert_eq!(snapshot(&rt), before);
        // Block 3 evicts the least recently used unpinned block (0, pinned 2); 0 -> the filler.
        let row0 = got.rows[0];
        let got = rt.cache_blocks(1, &[3], &[2, 3]).unwrap();
        assert_eq!(got.evicted, vec![(0, row0)]);
        assert_eq!(got.rows, vec![row0]);
        assert_eq!(rt.table(1).unwrap().host_rows[3], row0);
        rt.check_invariants().unwrap();
        // Decode: the blocks it enters get ids and rows of their own; the plan's host_indices
        // are the table's rows, host_rows the write-through's row.
        for _ in 0..9 {
            let plan = rt.plan(&[1], &[0, 0]).unwrap().clone();
            let t = rt.table(1).unwrap();
            let rows: Vec<i32> = t.host_rows.iter().map(|&r| r as i32).collect();
            assert_eq!(plan.field(PlanField::HostIndices), &rows[..]);
            let blk = (t.kv_len - 1) / 4;
            assert_eq!(plan.field(PlanField::HostRows), &[rows[blk]]);
            if let [done] = plan.field(PlanField::DoneRows) {
                assert_eq!(*done, rows[blk]);
                // The codes are built from the local page x_t completes.
                let local = t.local_page.map(|p| p as i32);
                assert_eq!(Some(plan.field(PlanField::DonePages)[0]), local);
                assert_eq!(plan.field(PlanField::PageIds), &[local.unwrap()]);
            }
            rt.check_invariants().unwrap();
        }
        assert_eq!(rt.table(1).unwrap().host_rows.len(), 7);
        assert_eq!(rt.num_free().2, 64 - 5, "held rows reach the reservation");
        // A written block never goes through the cache.
        let got = rt.cache_blocks(1, &[5, 6], &[]).unwrap();
        assert!(got.given.is_empty() && got.evicted.is_empty());
        rt.release(1).unwrap();
        rt.check_invariants().unwrap();
        assert_eq!(rt.num_free(), (8, 64, 64));
        assert_eq!(rt.reserved(), (0, 0, 0));
        // C = 0 is refused; a local request's rows are fixed (nothing given).
        assert!(rt.admit_sparse(2, 18, 10, Some(0)).is_err());
        rt.admit_sparse(2, 18, 10, None).unwrap();
        let got = rt.cache_blocks(2, &[0, 1], &[]).unwrap();
        assert_eq!(got.rows, rt.table(2).unwrap().host_rows[..2]);
        assert!(got.given.is_empty());
        rt.check_invariants().unwrap();
    }

    #[test]
    fn a_bounded_cache_fits_where_the_whole_context_does_not() {
        // 40 prompt tokens, 2 new: 11 blocks. Rows capped at 4: unbounded needs 11 rows, C = 2
        // needs 2 + 11 - 10 = 3; the ids grow past the row cap.
        let mut rt = Runtime::new(test_config(), 8, 4, 8, 4).unwrap();
        let e = rt.admit_sparse(1, 40, 2, None).unwrap_err();
        assert!(
            matches!(
                e,
                OasisError::OutOfBlocks {
                    tier: Tier::Host,
                    requested: 11,
                    ..
                }
            ),
            "{e}"
        );
        let r = rt.sparse_reservation(40, 2, Some(2));
        assert!(rt.fits_ever(&r) && rt.can_admit(&r));
        assert!(
            rt.admit_sparse(1, 40, 2, Some(2)).is_err(),
            "the ids are not grown yet"
        );
        let (g, h, w) = rt.pool_sizes_needed(&r);
        assert_eq!((g, h, w), (4, 11, 3));
        rt.grow(g, h, w).unwrap();
        rt.admit_sparse(1, 40, 2, Some(2)).unwrap();
        rt.check_invariants().unwrap();
        assert_eq!(rt.pool_sizes(), (8, 11, 4));
    }

    #[test]
    fn unknown_and_repeated_ids_are_errors() {
        let mut rt = runtime(16, 16);
        rt.admit(1, 3, 3).unwrap();
        assert!(rt.plan(&[2], &[0, 0]).is_err());
        assert!(rt.plan(&[1], &[0]).is_err());
        assert!(rt.plan(&[1, 1], &[0; 4]).is_err());
        // Past the threshold a request must turn sparse before it decodes again.
        rt.admit(5, 13, 4).unwrap();
        assert!(rt.wants_sparse(5).unwrap());
        assert!(rt.plan(&[5], &[0, 0]).is_err());
        rt.make_sparse(5).unwrap();
        rt.plan(&[5], &[0, 0]).unwrap();
        rt.check_invariants().unwrap();
        assert!(rt.release(2).is_err());
        assert!(rt.make_sparse(2).is_err());
        assert_eq!(rt.kv_len(1).unwrap(), 3);
    }
}
