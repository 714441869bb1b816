//! The sparse side of [`Runtime`]: admitting a request straight into sparse decoding (a staged
//! request of disaggregation), the dense-to-sparse transition, and the bounded host cache's rows.

use super::*;

impl Runtime {
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
}
