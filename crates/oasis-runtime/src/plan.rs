//! [`StepPlan`]: the tables of one decode step, for all layers, in one flat `i32` arena.
//!
//! Built once per step on the CPU by [`crate::Runtime::plan`]; the engine copies the arena into a
//! persistent pinned buffer, then to a persistent device buffer with one async copy, and every
//! layer's kernels read views of it (FlashInfer's plan/run). Each field starts on a 16-byte
//! boundary. Shapes, for `n` requests of which `s` are sparse, `r` rows each, budget `K`:
//!
//! ```text
//! input_ids     [n * r]   token of each query row (x_t, then the draft), as the engine gave them
//! positions     [n * r]   position of each query row (x_t at kv_len, the lookahead at kv_len + 1)
//! page_ids      [n]       page x_t's K/V is appended to
//! offsets       [n]       its offset in that page
//! host_ids      [n]       host block of the write-through (sparse), -1 dense: its summary
//! host_rows     [n]       host row of the write-through (sparse), -1 dense: its K/V
//! last_len      [n]       tokens of the last page attention reads (offset + 1)
//! kv_indptr     [n + 1]   CSR over kv_indices: dense page table, or the K slots + local page
//! kv_indices    [nnz]
//! map_pages     [m]       head-wise mapping updates of the step: page_map[:, page, :] = value
//! map_values    [m]       (and page_last_selected reset), applied before the forward
//! sp_rows       [s]       batch row of each sparse request
//! sp_slots      [s]       accumulator slot of each sparse request
//! slot_pages    [s * K]   its budget pages
//! blk_indptr    [s + 1]   CSR over blk_indices: candidates, the blocks complete once x_t is stored
//! blk_indices   [nnz_b]   host block of each candidate, logical order
//! blk_seq       [nnz_b]   each candidate's sparse request (empty unless planned)
//! host_indptr   [s + 1]   CSR over host_indices: every logical block of the request
//! host_indices  [nnz_h]   its host row (what the gather reads; a bounded staged request's
//!                         uncached blocks hold a filler row until `cache_blocks` gives one)
//! rec_indptr    [s + 1]   CSR over rec_indices: the blocks complete before x_t (recall's
//! rec_indices   [nnz_r]   candidates); empty unless recall is measured
//! done_blocks   [c]       host blocks of the sparse requests that x_t completes (their block
//!                         summaries are final now: per-block data such as key codes is built)
//! done_rows     [c]       their host rows (the write-through copies of the keys)
//! done_pages    [c]       their GPU pages (the local pages x_t completes: the keys the codes
//!                         are built from, in HBM)
//! spec_page_ids [n]       speculative plans: the page the draft's K/V goes to if it is accepted
//!                         (its tentative slot), -1 where the request does not try; else empty
//! spec_offsets  [n]       the draft's offset in that page
//! spec_host_ids [n]       host block of the draft's write-through (sparse), -1 dense
//! spec_host_rows [n]      its host row (sparse), -1 dense
//! ```

use crate::config::RuntimeConfig;
use crate::table::RequestTable;

/// The fields of a [`StepPlan`], in arena order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum PlanField {
    InputIds,
    Positions,
    PageIds,
    Offsets,
    HostIds,
    HostRows,
    LastLen,
    KvIndptr,
    KvIndices,
    MapPages,
    MapValues,
    SpRows,
    SpSlots,
    SlotPages,
    BlkIndptr,
    BlkIndices,
    BlkSeq,
    HostIndptr,
    HostIndices,
    RecIndptr,
    RecIndices,
    DoneBlocks,
    DoneRows,
    DonePages,
    SpecPageIds,
    SpecOffsets,
    SpecHostIds,
    SpecHostRows,
}

impl PlanField {
    pub const ALL: [PlanField; 28] = [
        PlanField::InputIds,
        PlanField::Positions,
        PlanField::PageIds,
        PlanField::Offsets,
        PlanField::HostIds,
        PlanField::HostRows,
        PlanField::LastLen,
        PlanField::KvIndptr,
        PlanField::KvIndices,
        PlanField::MapPages,
        PlanField::MapValues,
        PlanField::SpRows,
        PlanField::SpSlots,
        PlanField::SlotPages,
        PlanField::BlkIndptr,
        PlanField::BlkIndices,
        PlanField::BlkSeq,
        PlanField::HostIndptr,
        PlanField::HostIndices,
        PlanField::RecIndptr,
        PlanField::RecIndices,
        PlanField::DoneBlocks,
        PlanField::DoneRows,
        PlanField::DonePages,
        PlanField::SpecPageIds,
        PlanField::SpecOffsets,
        PlanField::SpecHostIds,
        PlanField::SpecHostRows,
    ];

    /// The field's name, as the Python engine reads it.
    pub fn name(self) -> &'static str {
        match self {
            PlanField::InputIds => "input_ids",
            PlanField::Positions => "positions",
            PlanField::PageIds => "page_ids",
            PlanField::Offsets => "offsets",
            PlanField::HostIds => "host_ids",
            PlanField::HostRows => "host_rows",
            PlanField::LastLen => "last_len",
            PlanField::KvIndptr => "kv_indptr",
            PlanField::KvIndices => "kv_indices",
            PlanField::MapPages => "map_pages",
            PlanField::MapValues => "map_values",
            PlanField::SpRows => "sp_rows",
            PlanField::SpSlots => "sp_slots",
            PlanField::SlotPages => "slot_pages",
            PlanField::BlkIndptr => "blk_indptr",
            PlanField::BlkIndices => "blk_indices",
            PlanField::BlkSeq => "blk_seq",
            PlanField::HostIndptr => "host_indptr",
            PlanField::HostIndices => "host_indices",
            PlanField::RecIndptr => "rec_indptr",
            PlanField::RecIndices => "rec_indices",
            PlanField::DoneBlocks => "done_blocks",
            PlanField::DoneRows => "done_rows",
            PlanField::DonePages => "done_pages",
            PlanField::SpecPageIds => "spec_page_ids",
            PlanField::SpecOffsets => "spec_offsets",
            PlanField::SpecHostIds => "spec_host_ids",
            PlanField::SpecHostRows => "spec_host_rows",
        }
    }
}

/// Where each field lies in the arena: `(start, len)` in elements.
pub type PlanLayout = [(usize, usize); PlanField::ALL.len()];

/// The sizes of a plan without its arena (what the Python side needs to make views).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanMeta {
    pub layout: PlanLayout,
    /// Elements in the arena.
    pub len: usize,
    pub num_seqs: usize,
    pub num_sparse: usize,
    pub max_pages: usize,
}

/// Fixed capacities for a plan whose layout must not change from step to step (a captured CUDA
/// graph reads every field at a fixed offset): `rows` requests, at most `pages` attention pages
/// and `blocks` host blocks per request. Padding: per-request fields of the missing requests hold
/// page -1 / host block -1 (the kernels skip them), `last_len` 1, and token and position 0; every
/// indptr repeats its total, so a padded request has empty rows; indices past the total hold -1
/// (`blk_seq`: 0). The sparse section has `rows` entries when the runtime is sparse (none when it
/// is dense): the padded ones point at batch row 0 with accumulator slot `dummy_slot` and no
/// candidates, budget pages -1. Head-wise mapping updates are not part of a padded plan: they stay
/// pending for [`crate::Runtime::take_map_updates`] (their number varies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanPad {
    pub rows: usize,
    pub pages: usize,
    pub blocks: usize,
    pub dummy_slot: i32,
}

/// One step's plan. The arena is reused from step to step (no allocation once it is large enough).
#[derive(Debug, Default, Clone)]
pub struct StepPlan {
    arena: Vec<i32>,
    layout: PlanLayout,
    /// Requests in the step.
    pub num_seqs: usize,
    /// Sparse requests among them.
    pub num_sparse: usize,
    /// The most pages any request's attention reads (sizes the split plan).
    pub max_pages: usize,
}

/// Elements per alignment unit: 16 bytes.
const ALIGN: usize = 4;

fn i32_of(x: usize) -> i32 {
    i32::try_from(x).unwrap_or(i32::MAX)
}

impl StepPlan {
    /// The arena, `len()` elements (every field inside it).
    pub fn arena(&self) -> &[i32] {
        &self.arena
    }

    pub fn clone_meta(&self) -> PlanMeta {
        PlanMeta {
            layout: self.layout,
            len: self.arena.len(),
            num_seqs: self.num_seqs,
            num_sparse: self.num_sparse,
            max_pages: self.max_pages,
        }
    }

    pub fn layout(&self) -> &PlanLayout {
        &self.layout
    }

    /// The elements of one field.
    pub fn field(&self, f: PlanField) -> &[i32] {
        let (start, len) = self.layout[f as usize];
        &self.arena[start..start + len]
    }

    fn open(&mut self, f: PlanField) {
        let start = self.arena.len().div_ceil(ALIGN) * ALIGN;
        self.arena.resize(start, 0);
        self.layout[f as usize] = (start, 0);
    }

    fn close(&mut self, f: PlanField) {
        let start = self.layout[f as usize].0;
        self.layout[f as usize].1 = self.arena.len() - start;
    }

    /// Lay out one field from an iterator.
    fn put(&mut self, f: PlanField, values: impl IntoIterator<Item = i32>) {
        self.open(f);
        self.arena.extend(values);
        self.close(f);
    }

    /// Pad the open field `f` with `fill` up to `cap` elements (no-op without a cap).
    fn pad_to(&mut self, f: PlanField, cap: Option<usize>, fill: i32) {
        if let Some(cap) = cap {
            let start = self.layout[f as usize].0;
            debug_assert!(
                self.arena.len() - start <= cap,
                "{} over its capacity",
                f.name()
            );
            self.arena.resize(start + cap, fill);
        }
    }

    /// Lay out one field from an iterator, padded with `fill` to `cap` elements when given.
    fn put_padded(
        &mut self,
        f: PlanField,
        values: impl IntoIterator<Item = i32>,
        cap: Option<usize>,
        fill: i32,
    ) {
        self.open(f);
        self.arena.extend(values);
        self.pad_to(f, cap, fill);
        self.close(f);
    }

    /// A CSR pair from per-request lists; with `cap = Some((rows, per_row))` the indptr has
    /// `rows + 1` entries (the total repeated) and the indices `rows * per_row` (-1 padded).
    fn put_csr<'a>(
        &mut self,
        indptr: PlanField,
        indices: PlanField,
        lists: impl Iterator<Item = &'a [u32]> + Clone,
        cap: Option<(usize, usize)>,
    ) {
        self.open(indptr);
        self.arena.push(0);
        let mut total = 0usize;
        for l in lists.clone() {
            total += l.len();
            self.arena.push(i32_of(total));
        }
        self.pad_to(indptr, cap.map(|(r, _)| r + 1), i32_of(total));
        self.close(indptr);
        self.open(indices);
        for l in lists {
            self.arena.extend(l.iter().map(|&x| x as i32));
        }
        self.pad_to(indices, cap.map(|(r, p)| r * p), -1);
        self.close(indices);
    }

    /// Build the plan of `tables` (batch order), before their `kv_len` advances; with `pad`, at
    /// the fixed capacities of [`PlanPad`] (the caller checked that the tables fit them). With
    /// `spec` the draft fields have one entry per request (padded), none trying yet
    /// ([`StepPlan::set_draft`] fills them once the tentative slots are reserved).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn build(
        &mut self,
        cfg: &RuntimeConfig,
        tables: &[&RequestTable],
        input_ids: &[i32],
        map_pages: &[u32],
        map_values: &[i32],
        pad: Option<&PlanPad>,
        spec: bool,
    ) {
        self.arena.clear();
        self.layout = Default::default();
        self.num_seqs = tables.len();
        let seqs = pad.map(|p| p.rows);
        self.put_token_rows(cfg, tables, input_ids, seqs);
        self.put_attention(tables, map_pages, map_values, pad);
        self.put_selection(cfg, tables, pad);
        let drafts = if spec {
            seqs.unwrap_or(tables.len())
        } else {
            0
        };
        for (f, fill) in [
            (PlanField::SpecPageIds, -1),
            (PlanField::SpecOffsets, 0),
            (PlanField::SpecHostIds, -1),
            (PlanField::SpecHostRows, -1),
        ] {
            self.put(f, std::iter::repeat_n(fill, drafts));
        }
        let end = self.arena.len().div_ceil(ALIGN) * ALIGN;
        self.arena.resize(end, 0);
    }

    /// The per-token fields of [`StepPlan::build`]: input ids and positions (every row), then
    /// per request the page and offset its token lands in, its host id and row (sparse) and
    /// the local block's length after it.
    fn put_token_rows(
        &mut self,
        cfg: &RuntimeConfig,
        tables: &[&RequestTable],
        input_ids: &[i32],
        seqs: Option<usize>,
    ) {
        let (b, rows) = (cfg.block_size, cfg.rows);
        self.put_padded(
            PlanField::InputIds,
            input_ids.iter().copied(),
            seqs.map(|n| n * rows),
            0,
        );
        self.put_padded(
            PlanField::Positions,
            tables
                .iter()
                .flat_map(|t| (0..rows).map(move |r| i32_of(t.kv_len + r))),
            seqs.map(|n| n * rows),
            0,
        );
        // The page each token lands in (allocated by the manager before the plan).
        let page_of = |t: &RequestTable| -> i32 {
            if t.sparse {
                t.local_page.map_or(-1, |p| p as i32)
            } else {
                t.pages.get(t.kv_len / b).map_or(-1, |&p| p as i32)
            }
        };
        self.put_padded(
            PlanField::PageIds,
            tables.iter().map(|t| page_of(t)),
            seqs,
            -1,
        );
        self.put_padded(
            PlanField::Offsets,
            tables.iter().map(|t| i32_of(t.kv_len % b)),
            seqs,
            0,
        );
        self.put_padded(
            PlanField::HostIds,
            tables.iter().map(|t| {
                if t.sparse {
                    t.host_blocks.get(t.kv_len / b).map_or(-1, |&h| h as i32)
                } else {
                    -1
                }
            }),
            seqs,
            -1,
        );
        self.put_padded(
            PlanField::HostRows,
            tables.iter().map(|t| {
                if t.sparse {
                    t.host_rows.get(t.kv_len / b).map_or(-1, |&h| h as i32)
                } else {
                    -1
                }
            }),
            seqs,
            -1,
        );
        self.put_padded(
            PlanField::LastLen,
            tables.iter().map(|t| i32_of(t.kv_len % b + 1)),
            seqs,
            1,
        );
    }

    /// The attention tables of [`StepPlan::build`]: per request its dense page table, or its K
    /// slots then the local page (CSR), and the head-wise mapping's updates.
    fn put_attention(
        &mut self,
        tables: &[&RequestTable],
        map_pages: &[u32],
        map_values: &[i32],
        pad: Option<&PlanPad>,
    ) {
        let seqs = pad.map(|p| p.rows);
        // Attention: dense page table, or the K slots then the local page.
        self.open(PlanField::KvIndptr);
        self.arena.push(0);
        let mut total = 0usize;
        let mut max_pages = 0usize;
        for t in tables {
            let n = attention_pages(t);
            max_pages = max_pages.max(n);
            total += n;
            self.arena.push(i32_of(total));
        }
        self.pad_to(PlanField::KvIndptr, seqs.map(|n| n + 1), i32_of(total));
        self.close(PlanField::KvIndptr);
        self.max_pages = max_pages;
        self.open(PlanField::KvIndices);
        for t in tables {
            if t.sparse {
                self.arena.extend(t.slot_pages.iter().map(|&p| p as i32));
                self.arena.push(t.local_page.map_or(-1, |p| p as i32));
            } else {
                self.arena.extend(t.pages.iter().map(|&p| p as i32));
            }
        }
        self.pad_to(PlanField::KvIndices, pad.map(|p| p.rows * p.pages), -1);
        self.close(PlanField::KvIndices);
        self.put(PlanField::MapPages, map_pages.iter().map(|&p| p as i32));
        self.put(PlanField::MapValues, map_values.iter().copied());
    }

    /// The sparse requests' selection tables of [`StepPlan::build`]: rows and slots, slot pages,
    /// the scoring CSR (and its per-block request), the gather's host rows, the recall CSR, and
    /// the blocks this step completes.
    fn put_selection(
        &mut self,
        cfg: &RuntimeConfig,
        tables: &[&RequestTable],
        pad: Option<&PlanPad>,
    ) {
        let b = cfg.block_size;
        // The sparse requests' selection tables: every sparse request, then (padded) empty entries
        // up to `rows` when the runtime is sparse, or none.
        let sparse: Vec<(usize, &RequestTable)> = tables
            .iter()
            .enumerate()
            .filter(|(_, t)| t.sparse)
            .map(|(i, t)| (i, *t))
            .collect();
        self.num_sparse = sparse.len();
        let sp = pad.map(|p| if cfg.sparse { p.rows } else { 0 });
        let blocks = pad.map_or(0, |p| p.blocks);
        let csr_cap = sp.map(|s| (s, blocks));
        self.put_padded(
            PlanField::SpRows,
            sparse.iter().map(|&(i, _)| i32_of(i)),
            sp,
            0,
        );
        self.put_padded(
            PlanField::SpSlots,
            sparse.iter().map(|(_, t)| t.slot as i32),
            sp,
            pad.map_or(-1, |p| p.dummy_slot),
        );
        self.put_padded(
            PlanField::SlotPages,
            sparse
                .iter()
                .flat_map(|(_, t)| t.slot_pages.iter().map(|&p| p as i32)),
            sp.map(|s| s * cfg.top_k_blocks),
            -1,
        );
        let cand = |t: &RequestTable| -> usize { ((t.kv_len + 1) / b).min(t.host_blocks.len()) };
        self.put_csr(
            PlanField::BlkIndptr,
            PlanField::BlkIndices,
            sparse.iter().map(|(_, t)| &t.host_blocks[..cand(t)]),
            csr_cap,
        );
        if cfg.plan_blk_seq && cfg.rows == 2 {
            self.put_padded(
                PlanField::BlkSeq,
                sparse
                    .iter()
                    .enumerate()
                    .flat_map(|(j, (_, t))| std::iter::repeat_n(i32_of(j), cand(t))),
                csr_cap.map(|(s, p)| s * p),
                0,
            );
        } else {
            self.put(PlanField::BlkSeq, std::iter::empty());
        }
        self.put_csr(
            PlanField::HostIndptr,
            PlanField::HostIndices,
            sparse.iter().map(|(_, t)| &t.host_rows[..]),
            csr_cap,
        );
        if cfg.measure_recall {
            let rec = |t: &RequestTable| -> usize { (t.kv_len / b).min(t.host_blocks.len()) };
            self.put_csr(
                PlanField::RecIndptr,
                PlanField::RecIndices,
                sparse.iter().map(|(_, t)| &t.host_blocks[..rec(t)]),
                csr_cap,
            );
        } else {
            self.put(PlanField::RecIndptr, std::iter::empty());
            self.put(PlanField::RecIndices, std::iter::empty());
        }
        for f in [
            PlanField::DoneBlocks,
            PlanField::DoneRows,
            PlanField::DonePages,
        ] {
            self.put_padded(
                f,
                sparse
                    .iter()
                    .filter(|(_, t)| t.kv_len % b == b - 1)
                    .filter_map(|(_, t)| {
                        let at = t.kv_len / b;
                        let h = *t.host_blocks.get(at)?;
                        Some(match f {
                            PlanField::DoneRows => *t.host_rows.get(at)? as i32,
                            // The local page holds the whole block (decode attention reads
                            // its tokens there); x_t completes it in this step.
                            PlanField::DonePages => t.local_page.map_or(-1, |p| p as i32),
                            _ => h as i32,
                        })
                    }),
                sp,
                -1,
            );
        }
    }

    /// Set request `i`'s (batch row) draft target: the tentative slot its draft's K/V is written
    /// to if the step accepts it.
    pub(crate) fn set_draft(&mut self, i: usize, page: i32, offset: i32, host: i32, row: i32) {
        for (f, x) in [
            (PlanField::SpecPageIds, page),
            (PlanField::SpecOffsets, offset),
            (PlanField::SpecHostIds, host),
            (PlanField::SpecHostRows, row),
        ] {
            let (start, len) = self.layout[f as usize];
            debug_assert!(i < len, "{} has no row {i}", f.name());
            self.arena[start + i] = x;
        }
    }
}

/// Pages the attention of request `t` reads this step: its dense page table, or the K slots and
/// the local page.
pub(crate) fn attention_pages(t: &RequestTable) -> usize {
    if t.sparse {
        t.slot_pages.len() + 1
    } else {
        t.pages.len()
    }
}
