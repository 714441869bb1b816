//! [`RequestTable`]: one request's block tables, and the [`Reservation`] admission charged.

use crate::cache::RowCache;
use crate::config::RuntimeConfig;

/// What a request may hold at most, over its remaining life, in each tier (in blocks).
///
/// The host tier has two pools: block *ids* (a summary, key codes, a place in the scoring tables;
/// GPU memory, 1/b of the KV) and host *rows* (`host_k`/`host_v`, the host budget). A local
/// request takes one row with every id (`host_rows == host_blocks`); a staged request with a
/// bounded cache takes rows only for the blocks it writes and its `C` cache rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reservation {
    pub gpu_pages: usize,
    /// Host block ids.
    pub host_blocks: usize,
    /// Host rows (the host budget's unit).
    pub host_rows: usize,
    /// Whether the request will turn sparse before it finishes.
    pub turns_sparse: bool,
}

impl Reservation {
    /// The peak need of a request of `prompt_len` tokens that makes at most `max_new_tokens`.
    ///
    /// The stored context grows to `L = prompt_len + max_new_tokens - 1` tokens (the last token is
    /// sampled, never fed). A dense request holds `ceil(L / b)` pages. A request that turns sparse
    /// (the engine checks `kv_len > threshold` after every token but the last, so when
    /// `prompt_len + max_new_tokens - 2 > threshold`) holds its dense pages until then, at most
    /// `ceil(max(prompt_len, threshold + 1) / b)`, and then the working set, `K + 1` pages (the
    /// transition reuses its dense pages, so the peak is the larger of the two); its host table
    /// grows to `ceil(L / b)` blocks.
    pub fn for_request(cfg: &RuntimeConfig, prompt_len: usize, max_new_tokens: usize) -> Self {
        let b = cfg.block_size;
        let stored = prompt_len.saturating_add(max_new_tokens.max(1) - 1);
        let blocks = stored.div_ceil(b);
        let turns_sparse = cfg.sparse
            && max_new_tokens >= 2
            && prompt_len.saturating_add(max_new_tokens - 2) > cfg.sparse_threshold;
        if !turns_sparse {
            return Self {
                gpu_pages: blocks,
                host_blocks: 0,
                host_rows: 0,
                turns_sparse,
            };
        }
        let dense_peak = prompt_len
            .max(cfg.sparse_threshold.saturating_add(1))
            .div_ceil(b);
        Self {
            gpu_pages: dense_peak.max(cfg.top_k_blocks + 1),
            host_blocks: blocks,
            host_rows: blocks,
            turns_sparse,
        }
    }

    /// The peak need of a request admitted sparse from its first step (its prompt's KV comes
    /// from elsewhere, a staging daemon): never a dense page, only the working set (`K` slot pages
    /// and the local page) on the GPU; its host table grows to `ceil(L / b)` blocks,
    /// `L = prompt_len + max_new_tokens - 1`, as for a request that turns sparse.
    ///
    /// Its host rows: one per block without `cache_blocks`; with `cache_blocks = Some(C)` (the
    /// bounded host pool) only the blocks it writes itself, logicals `>= floor(P / b)`, plus `C`
    /// cache rows: `C + ceil(L / b) - floor(P / b)`.
    pub fn for_sparse_request(
        cfg: &RuntimeConfig,
        prompt_len: usize,
        max_new_tokens: usize,
        cache_blocks: Option<usize>,
    ) -> Self {
        let stored = prompt_len.saturating_add(max_new_tokens.max(1) - 1);
        let blocks = stored.div_ceil(cfg.block_size);
        let host_rows = match cache_blocks {
            None => blocks,
            Some(c) => c.saturating_add(blocks - prompt_len / cfg.block_size),
        };
        Self {
            gpu_pages: cfg.top_k_blocks + 1,
            host_blocks: blocks,
            host_rows,
            turns_sparse: true,
        }
    }
}

/// The block tables of one admitted request.
///
/// Invariants (checked by the manager's tests):
/// * dense: `pages[i]` holds logical block `i`; `slot_pages`, `host_blocks` empty, no local page;
/// * sparse: `pages` empty; `slot_pages` holds exactly K pages, `local_page` the block that the
///   next token lands in, `host_blocks[i]` logical block `i`'s id (append-only), `host_rows[i]`
///   its host row;
/// * a local request (no `cache`) holds a row of its own for every id; a bounded staged request
///   (`cache`) holds its own rows for logicals `>= written_from` and routes the others through
///   its [`RowCache`]: `host_rows[i]` is the cached row, or the cache's first row as a filler
///   (a valid index no plan reads);
/// * every page, host block and host row held is allocated in its pool and held by this request
///   alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestTable {
    pub id: u64,
    /// Row of the per-request accumulators on the device (`0..max_num_seqs`), reset at admission.
    pub slot: u32,
    /// Tokens whose KV is stored (the next token lands at this position).
    pub kv_len: usize,
    pub sparse: bool,
    /// Dense page table, logical order.
    pub pages: Vec<u32>,
    /// The budget: K pages whose head-wise mapping selection fills.
    pub slot_pages: Vec<u32>,
    /// The page of the block the next token lands in (sparse only).
    pub local_page: Option<u32>,
    /// The host block id of each logical block (sparse only).
    pub host_blocks: Vec<u32>,
    /// The host row of each logical block (sparse only), parallel to `host_blocks`.
    pub host_rows: Vec<u32>,
    /// A bounded staged request's cache rows (`admit_sparse(..., Some(C))`); None otherwise.
    pub cache: Option<RowCache>,
    /// The first logical block the request writes itself (`floor(P / b)` for a bounded staged
    /// request, 0 otherwise): the blocks before it are the daemon's, cached or not.
    pub written_from: usize,
    pub reservation: Reservation,
}

impl RequestTable {
    /// GPU pages held now.
    pub fn gpu_pages_held(&self) -> usize {
        self.pages.len() + self.slot_pages.len() + usize::from(self.local_page.is_some())
    }

    /// Host rows held now: the rows of the written blocks plus the cache's, or one per block.
    pub fn host_rows_held(&self) -> usize {
        match &self.cache {
            None => self.host_rows.len(),
            Some(c) => c.capacity() + self.host_rows.len().saturating_sub(self.written_from),
        }
    }

    /// Every host row held, in no particular order (each once).
    pub fn all_rows(&self) -> Vec<u32> {
        match &self.cache {
            None => self.host_rows.clone(),
            Some(c) => c
                .rows()
                .iter()
                .chain(self.host_rows.get(self.written_from..).unwrap_or(&[]))
                .copied()
                .collect(),
        }
    }

    /// Every GPU page held, in no particular order.
    pub fn all_pages(&self) -> impl Iterator<Item = u32> + '_ {
        self.pages
            .iter()
            .chain(&self.slot_pages)
            .chain(self.local_page.as_ref())
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_config;

    #[test]
    fn reservation_of_dense_and_sparse_requests() {
        let cfg = test_config(); // b = 4, K = 3, threshold 12
                                 // 5 + 3 - 1 = 7 tokens stored, never past 12: two pages, no host blocks.
        let r = Reservation::for_request(&cfg, 5, 3);
        assert_eq!((r.gpu_pages, r.host_blocks, r.turns_sparse), (2, 0, false));
        // Turns sparse at kv_len 13: four dense pages, then K + 1 = 4; 30 stored -> 8 host blocks.
        let r = Reservation::for_request(&cfg, 10, 21);
        assert_eq!((r.gpu_pages, r.host_blocks, r.turns_sparse), (4, 8, true));
        // A long prompt: its prefill holds every page.
        let r = Reservation::for_request(&cfg, 40, 2);
        assert_eq!((r.gpu_pages, r.host_blocks, r.turns_sparse), (10, 11, true));
        // A short sparse request still needs the whole working set (K + 1 > its dense pages).
        let cfg = RuntimeConfig {
            top_k_blocks: 8,
            sparse_threshold: 6,
            ..cfg
        };
        let r = Reservation::for_request(&cfg, 7, 2);
        assert_eq!((r.gpu_pages, r.turns_sparse), (9, true));
        // One token out: no decode step, the prompt alone.
        let r = Reservation::for_request(&cfg, 100, 1);
        assert_eq!((r.gpu_pages, r.turns_sparse), (25, false));
        // The dense backend never turns sparse.
        let dense = RuntimeConfig {
            sparse: false,
            ..cfg
        };
        let r = Reservation::for_request(&dense, 100, 50);
        assert_eq!((r.gpu_pages, r.host_blocks, r.turns_sparse), (38, 0, false));
    }

    #[test]
    fn reservation_of_a_request_admitted_sparse() {
        let cfg = test_config(); // b = 4, K = 3
                                 // 40 + 2 - 1 = 41 tokens stored: 11 host blocks, K + 1 = 4 pages (not the prompt's 10).
        let r = Reservation::for_sparse_request(&cfg, 40, 2, None);
        assert_eq!((r.gpu_pages, r.host_blocks, r.turns_sparse), (4, 11, true));
        assert_eq!(r.host_rows, 11);
        // Short prompts too: the working set, whatever the threshold.
        let r = Reservation::for_sparse_request(&cfg, 3, 1, None);
        assert_eq!((r.gpu_pages, r.host_blocks), (4, 1));
        let r = Reservation::for_sparse_request(&cfg, 8, 1, None);
        assert_eq!((r.gpu_pages, r.host_blocks), (4, 2));
        // A bounded cache of C = 5 rows: ids for all 11 blocks, rows for C and the blocks from
        // floor(40 / 4) = 10 on (11 - 10 = 1): 6.
        let r = Reservation::for_sparse_request(&cfg, 40, 2, Some(5));
        assert_eq!((r.host_blocks, r.host_rows), (11, 6));
        // 41 prompt tokens: block 10 is partial (written), 42 stored -> 11 blocks: 5 + 1.
        let r = Reservation::for_sparse_request(&cfg, 41, 2, Some(5));
        assert_eq!((r.host_blocks, r.host_rows), (11, 6));
    }
}
