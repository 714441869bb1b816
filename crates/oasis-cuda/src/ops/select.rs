//! Selection launches: Quest block scores (`score_blocks`), the top-K of blocks per KV head
//! (`topk_blocks`, mapped or forced), `force_scores`, the two-stage score's `topk_candidates` and
//! `delta_select`.

use std::sync::{Mutex, PoisonError};

use super::*;

/// Which kernel scores the 8-bit bound in [`Gpu::score_blocks_bound8`] (cuda/score_blocks.cu).
/// Both match `oasis_core::kernels::score_blocks_bound8` within f32 summation-order rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound8ScoreKernel {
    /// `score_blocks_bound8_*`: each code converted to f32 and multiplied into the group-summed
    /// query (bound by those conversions, docs/PERF.md); where `Mma` does not apply.
    Fma,
    /// `score_blocks_bound8_tc_*`: eight entries per MMA, the codes exact in f16 as the B operand,
    /// the coefficients in two f16 rows (value and remainder); head_dim 64/128/256 with 16-byte
    /// aligned bounds, else `Fma`. The default: on an H100 (s27) the default chain at 44 x 16K
    /// took 159.8 us against `Fma`'s 166.6, and the 20 x 32K step 13.95 ms against 14.21.
    Mma,
}

static BOUND8_SCORE_KERNEL: Mutex<Bound8ScoreKernel> = Mutex::new(Bound8ScoreKernel::Mma);

/// Set the process-wide 8-bit bound score kernel (the next launch on; a CUDA graph keeps the
/// kernel it captured).
pub fn set_bound8_score_kernel(k: Bound8ScoreKernel) {
    *BOUND8_SCORE_KERNEL
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = k;
}

/// The 8-bit bound score kernel launches use now ([`set_bound8_score_kernel`]).
pub fn bound8_score_kernel() -> Bound8ScoreKernel {
    *BOUND8_SCORE_KERNEL
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The entry point [`Gpu::score_blocks_bound8`] launches for `kernel`, `T`, `head_dim` and
/// whether the bounds are 16-byte aligned: the MMA kernel only where it applies.
pub fn score_bound8_entry<T: KvElem>(
    kernel: Bound8ScoreKernel,
    head_dim: usize,
    aligned: bool,
) -> &'static str {
    if kernel == Bound8ScoreKernel::Mma && matches!(head_dim, 64 | 128 | 256) && aligned {
        entry!(T, "score_blocks_bound8_tc")
    } else {
        entry!(T, "score_blocks_bound8")
    }
}

impl Gpu {
    /// GPU twin of `oasis_core::kernels::score_blocks`: Quest scores of the lookahead query
    /// against every listed block summary, summed over the GQA group.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn score_blocks<T: KvElem>(
        &self,
        geo: &KvGeometry,
        q: DevSlice<T>,             // [num_seqs, num_qo_heads, head_dim]
        summaries: DevSlice<T>,     // [num_host_blocks, num_kv_heads, 2, head_dim]
        blk_indptr: DevSlice<i32>,  // [num_seqs + 1]
        blk_indices: DevSlice<i32>, // [nnz]
        scores: DevSlice<f32>,      // [nnz, num_kv_heads]
        stream: Stream,
    ) -> Result<()> {
        guard("score_blocks", || {
            let (h, d, qh, num_seqs, grid) = score_shape(
                geo,
                q.len(),
                blk_indptr.len(),
                blk_indices.len(),
                scores.len(),
            )?;
            let num_host = rows("summaries", summaries.len(), &[h, 2, d])?;
            let nnz = blk_indices.len();

            let name = entry!(T, "score_blocks");
            let params = params!(ScoreBlocksParams {
                ptr: { q, summaries, blk_indptr, blk_indices, scores },
                int: {
                    num_seqs, nnz, num_qo_heads = qh, num_kv_heads = h, head_dim = d,
                    num_host_blocks = num_host,
                },
            });
            // SAFETY: lengths checked above; the kernel bounds-checks block ids and each
            // blk_indptr row against nnz (an entry outside a well-formed row scores -inf), and
            // only reads blk_indptr[0..=num_seqs]; reachability and lifetime by DevSlice's
            // contract, the stream by Stream's.
            unsafe { self.queue(name, grid, SCORE_THREADS, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::score_blocks_bound8`: the Quest score of every listed
    /// block over its 8-bit (E4M3, outward-rounded) bound, times the row's scale; the same launch
    /// shape as [`Self::score_blocks`] at half the summary bytes of 16-bit storage.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn score_blocks_bound8<T: KvElem>(
        &self,
        geo: &KvGeometry,
        q: DevSlice<T>,             // [num_seqs, num_qo_heads, head_dim]
        bounds8: DevSlice<u8>,      // [num_host_blocks, num_kv_heads, 2, head_dim]
        scales: DevSlice<f32>,      // [num_host_blocks, num_kv_heads]
        blk_indptr: DevSlice<i32>,  // [num_seqs + 1]
        blk_indices: DevSlice<i32>, // [nnz]
        scores: DevSlice<f32>,      // [nnz, num_kv_heads]
        stream: Stream,
    ) -> Result<()> {
        guard("score_blocks_bound8", || {
            let (h, d, qh, num_seqs, grid) = score_shape(
                geo,
                q.len(),
                blk_indptr.len(),
                blk_indices.len(),
                scores.len(),
            )?;
            let num_host = rows("bounds8", bounds8.len(), &[h, 2, d])?;
            check_len("scales", scales.len(), &[num_host, h])?;
            let nnz = blk_indices.len();

            let aligned = bounds8.ptr().is_multiple_of(16);
            let name = score_bound8_entry::<T>(bound8_score_kernel(), d, aligned);
            let params = params!(ScoreBlocksBound8Params {
                ptr: { q, bounds8, scales, blk_indptr, blk_indices, scores },
                int: {
                    num_seqs, nnz, num_qo_heads = qh, num_kv_heads = h, head_dim = d,
                    num_host_blocks = num_host,
                },
            });
            // SAFETY: as score_blocks (the scales have num_host rows too, read by block id
            // after the kernel's bounds check); the MMA kernel only for the head_dims it is
            // instantiated for and 16-byte aligned bounds (score_bound8_entry), with the same
            // grid and threads and its own static shared memory.
            unsafe { self.queue(name, grid, SCORE_THREADS, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::topk_blocks`: per (sequence, KV head), the `k` best
    /// logical blocks, best first, ties to the lower index, padded with -1.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape;
    /// [`CudaError::Unsupported`] for `k > MAX_TOPK`.
    pub fn topk_blocks(
        &self,
        num_kv_heads: usize,
        scores: DevSlice<f32>,     // [nnz, num_kv_heads]
        blk_indptr: DevSlice<i32>, // [num_seqs + 1]
        k: usize,
        out: DevSlice<i32>, // [num_seqs, num_kv_heads, k]
        stream: Stream,
    ) -> Result<()> {
        self.launch_topk(
            "topk_blocks",
            num_kv_heads,
            scores,
            blk_indptr,
            k,
            out,
            None,
            None,
            stream,
        )
    }

    /// GPU twin of `oasis_core::kernels::topk_blocks_mapped`: [`Gpu::topk_blocks`] with each
    /// chosen position `i` of (sequence `s`, head `h`) written as `index_map[s, h, i]` (-1 past
    /// `map_m` and for the padding), in the same launch.
    ///
    /// # Errors
    /// As [`Gpu::topk_blocks`], and [`CudaError::Invalid`] when `index_map` is not
    /// `[num_seqs, num_kv_heads, map_m]`.
    #[allow(clippy::too_many_arguments)]
    pub fn topk_blocks_mapped(
        &self,
        num_kv_heads: usize,
        scores: DevSlice<f32>,     // [nnz, num_kv_heads]
        blk_indptr: DevSlice<i32>, // [num_seqs + 1]
        k: usize,
        index_map: DevSlice<i32>, // [num_seqs, num_kv_heads, map_m]
        map_m: usize,
        out: DevSlice<i32>, // [num_seqs, num_kv_heads, k]
        stream: Stream,
    ) -> Result<()> {
        self.launch_topk(
            "topk_blocks_mapped",
            num_kv_heads,
            scores,
            blk_indptr,
            k,
            out,
            Some((index_map, map_m)),
            None,
            stream,
        )
    }

    /// [`Gpu::force_scores`] then [`Gpu::topk_blocks`] in one launch: the `forced` blocks
    /// (`[num_seqs, num_kv_heads, n_forced]`; -1 and positions past the row ignored) are set to
    /// +inf in `scores`, in place as that op leaves them, and go first (the two-stage score's
    /// kept blocks).
    ///
    /// # Errors
    /// As [`Gpu::topk_blocks`], and [`CudaError::Invalid`] when `forced` is not
    /// `[num_seqs, num_kv_heads, n_forced]`.
    #[allow(clippy::too_many_arguments)]
    pub fn topk_blocks_forced(
        &self,
        num_kv_heads: usize,
        scores: DevSlice<f32>, // [nnz, num_kv_heads], forced entries written
        blk_indptr: DevSlice<i32>, // [num_seqs + 1]
        k: usize,
        forced: DevSlice<i32>, // [num_seqs, num_kv_heads, n_forced]
        n_forced: usize,
        out: DevSlice<i32>, // [num_seqs, num_kv_heads, k]
        stream: Stream,
    ) -> Result<()> {
        self.launch_topk(
            "topk_blocks_forced",
            num_kv_heads,
            scores,
            blk_indptr,
            k,
            out,
            None,
            Some((forced, n_forced)),
            stream,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_topk(
        &self,
        what: &'static str,
        num_kv_heads: usize,
        scores: DevSlice<f32>,
        blk_indptr: DevSlice<i32>,
        k: usize,
        out: DevSlice<i32>,
        index_map: Option<(DevSlice<i32>, usize)>,
        forced: Option<(DevSlice<i32>, usize)>,
        stream: Stream,
    ) -> Result<()> {
        guard(what, || {
            positive_heads(num_kv_heads)?;
            if k > MAX_TOPK {
                return Err(CudaError::Unsupported(format!(
                    "k = {k} exceeds the top-k kernel's maximum {MAX_TOPK}"
                )));
            }
            let num_seqs = csr_rows("blk_indptr", blk_indptr.len())?;
            let nnz = rows("scores", scores.len(), &[num_kv_heads])?;
            check_len("out", out.len(), &[num_seqs, num_kv_heads, k])?;
            if let Some((m, map_m)) = index_map {
                check_len("index_map", m.len(), &[num_seqs, num_kv_heads, map_m])?;
            }
            if let Some((f, n_forced)) = forced {
                check_len("forced", f.len(), &[num_seqs, num_kv_heads, n_forced])?;
            }
            if k == 0 {
                // Nothing to select; forced entries are still written (force_scores' effect).
                return match forced {
                    Some((f, n)) => {
                        self.force_scores(num_kv_heads, scores, blk_indptr, f, n, stream)
                    }
                    None => Ok(()),
                };
            }
            let name = "topk_blocks_f32";
            let params = params!(TopkBlocksParams {
                ptr: {
                    scores, blk_indptr, out, index_map = index_map.map(|(m, _)| m),
                    forced = forced.map(|(f, _)| f),
                },
                int: {
                    num_kv_heads, nnz, k, map_m = index_map.map_or(0, |(_, m)| m),
                    n_forced = forced.map_or(0, |(_, n)| n),
                },
                raw: { _pad0 = 0 },
            });
            let grid = grid_rows_heads("num_seqs", num_seqs, num_kv_heads)?;
            // SAFETY: k <= OASIS_MAX_TOPK (its static sort buffer). Lengths checked above
            // (index_map has map_m entries per (sequence, head), and the kernel reads it only
            // below map_m; forced has n_forced, each written only inside its row); the kernel
            // checks each blk_indptr row against nnz, the scores' rows
            // (a malformed row has no blocks); reachability and lifetime by DevSlice's contract,
            // the stream by Stream's.
            unsafe { self.queue(name, grid, TOPK_THREADS, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::force_scores`: the forced entries of `scores` set to
    /// +inf, in place (one thread per forced entry).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    pub fn force_scores(
        &self,
        num_kv_heads: usize,
        scores: DevSlice<f32>,     // [nnz, num_kv_heads], written
        blk_indptr: DevSlice<i32>, // [num_seqs + 1]
        forced: DevSlice<i32>,     // [num_seqs, num_kv_heads, n_forced]
        n_forced: usize,
        stream: Stream,
    ) -> Result<()> {
        guard("force_scores", || {
            positive_heads(num_kv_heads)?;
            let num_seqs = csr_rows("blk_indptr", blk_indptr.len())?;
            let nnz = rows("scores", scores.len(), &[num_kv_heads])?;
            check_len("forced", forced.len(), &[num_seqs, num_kv_heads, n_forced])?;
            let total = num_seqs * num_kv_heads * n_forced;
            if total == 0 {
                return Ok(());
            }
            let params = params!(ForceScoresParams {
                ptr: { scores, blk_indptr, forced },
                int: { num_seqs, num_kv_heads, nnz, n_forced },
            });
            int("num_seqs * num_kv_heads * n_forced", total)?;
            let grid = grid_x("force_scores", total.div_ceil(FORCE_THREADS as usize))?;
            // SAFETY: lengths checked above; the kernel bounds-checks each blk_indptr row against
            // nnz and each forced position against its row, and writes only scores inside it;
            // reachability and lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue("force_scores_f32", grid, FORCE_THREADS, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::topk_candidates`: the two-stage score's last top-k
    /// (successors of the best candidates, forced blocks, then the `k` best as blocks), one
    /// thread block per (sequence, KV head).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape;
    /// [`CudaError::Unsupported`] for `k > MAX_TOPK` or `m + successors > MAX_CANDIDATES`.
    #[allow(clippy::too_many_arguments)]
    pub fn topk_candidates(
        &self,
        num_kv_heads: usize,
        scores: DevSlice<f32>, // [num_seqs * m, num_kv_heads]
        cand: DevSlice<i32>,   // [num_seqs, num_kv_heads, m]
        m: usize,
        blk_indptr: DevSlice<i32>, // [num_seqs + 1]
        k: usize,
        successors: usize,
        forced: Option<(DevSlice<i32>, usize)>, // [num_seqs, num_kv_heads, n_forced]
        out: DevSlice<i32>,                     // [num_seqs, num_kv_heads, k]
        stream: Stream,
    ) -> Result<()> {
        guard("topk_candidates", || {
            positive_heads(num_kv_heads)?;
            if k > MAX_TOPK || m + successors > MAX_CANDIDATES {
                return Err(CudaError::Unsupported(format!(
                    "k = {k} (at most {MAX_TOPK}) or m + successors = {} (at most \
                     {MAX_CANDIDATES}) past the candidates' top-k kernel",
                    m + successors
                )));
            }
            let num_seqs = csr_rows("blk_indptr", blk_indptr.len())?;
            check_len("scores", scores.len(), &[num_seqs * m, num_kv_heads])?;
            check_len("cand", cand.len(), &[num_seqs, num_kv_heads, m])?;
            check_len("out", out.len(), &[num_seqs, num_kv_heads, k])?;
            let n_forced = forced.map_or(0, |(_, n)| n);
            if let Some((f, n)) = forced {
                check_len("forced", f.len(), &[num_seqs, num_kv_heads, n])?;
            }
            if k == 0 || num_seqs == 0 {
                return Ok(());
            }
            let params = params!(TopkCandidatesParams {
                ptr: { scores, cand, blk_indptr, forced = forced.map(|(f, _)| f), out },
                int: { num_kv_heads, m, k, successors, n_forced },
                raw: { nnz = i32::MAX },
            });
            let grid = grid_rows_heads("num_seqs", num_seqs, num_kv_heads)?;
            let smem = topk_candidates_smem_bytes(m, successors);
            let threads = topk_candidates_threads(m, successors);
            // SAFETY: k <= MAX_TOPK and m + successors <= MAX_CANDIDATES; `smem` is the layout of
            // its dynamic buffers for this m and successors (launch() checks it against the
            // device limit) and `threads` a multiple of 32 within its launch bound; lengths
            // checked above (the kernel reads cand and forced only below m and n_forced, scores
            // at the rows of m entries); blk_indptr rows are only subtracted; reachability and
            // lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue("topk_candidates_f32", grid, threads, smem, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::delta_select`: keep predicted blocks already resident,
    /// pair each missing one with a victim slot (empty first, then least recently selected), at
    /// most `fetch_cap` per head; updates `page_map` and `page_last_selected` and writes the
    /// plan. `stats`, when given, receives (pairs, kept, missing) per (seq, head): sum them for
    /// the twin's `SelectStats` (reading them needs a synchronisation the caller chooses).
    ///
    /// Unlike the twin, the kernel does not reject a slot page out of range (it skips that slot)
    /// nor a page listed twice in `slot_pages` (undefined then).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape or
    /// `num_pred > budget`; [`CudaError::Unsupported`] for `budget > MAX_SELECT_BUDGET`.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_select(
        &self,
        num_kv_heads: usize,
        predicted: DevSlice<i32>, // [num_seqs, num_kv_heads, num_pred]
        num_pred: usize,
        slot_pages: DevSlice<i32>, // [num_seqs, budget]
        budget: usize,
        page_map: DevSlice<i32>,           // [num_pages, num_kv_heads]
        page_last_selected: DevSlice<i32>, // [num_pages, num_kv_heads]
        step: i32,
        step_now: Option<DevSlice<i32>>, // [1]: the step read on the device, overriding `step`
        fetch_cap: usize,
        plan_slots: DevSlice<i32>,    // [num_seqs, num_kv_heads, fetch_cap]
        plan_blocks: DevSlice<i32>,   // [num_seqs, num_kv_heads, fetch_cap]
        stats: Option<DevSlice<i32>>, // [num_seqs, num_kv_heads, 3]
        stream: Stream,
    ) -> Result<()> {
        guard("delta_select", || {
            positive_heads(num_kv_heads)?;
            if num_pred > budget {
                return Err(OasisError::Invalid(format!(
                    "num_pred ({num_pred}) must not exceed budget ({budget})"
                ))
                .into());
            }
            if budget > MAX_SELECT_BUDGET {
                return Err(CudaError::Unsupported(format!(
                    "budget = {budget} slots exceeds the selection kernel's maximum {MAX_SELECT_BUDGET}"
                )));
            }
            let h = num_kv_heads;
            // As the twin: the batch size comes from the first buffer that has a row per seq.
            let num_seqs = if budget > 0 {
                rows("slot_pages", slot_pages.len(), &[budget])?
            } else if fetch_cap > 0 {
                rows("plan_slots", plan_slots.len(), &[h, fetch_cap])?
            } else {
                0
            };
            check_len("slot_pages", slot_pages.len(), &[num_seqs, budget])?;
            check_len("predicted", predicted.len(), &[num_seqs, h, num_pred])?;
            let num_pages = rows("page_map", page_map.len(), &[h])?;
            check_len(
                "page_last_selected",
                page_last_selected.len(),
                &[num_pages, h],
            )?;
            check_len("plan_slots", plan_slots.len(), &[num_seqs, h, fetch_cap])?;
            check_len("plan_blocks", plan_blocks.len(), &[num_seqs, h, fetch_cap])?;
            if let Some(st) = &stats {
                check_len("stats", st.len(), &[num_seqs, h, 3])?;
            }
            if let Some(sn) = &step_now {
                check_len("step_now", sn.len(), &[1])?;
            }

            // The parameters of both kernels (only the warp kernel reads num_seqs).
            let params = params!(DeltaSelectParams {
                ptr: {
                    predicted, slot_pages, page_map, page_last_selected, plan_slots, plan_blocks,
                    stats, step_now,
                },
                int: { num_kv_heads = h, num_pred, budget, num_pages, fetch_cap, num_seqs },
                raw: { step, _pad0 = 0 },
            });
            if budget <= SELECT_WARP_MAX {
                let name = "delta_select_warp_i32";
                // One warp per (sequence, KV head).
                let warps = num_seqs.checked_mul(h).ok_or_else(|| {
                    CudaError::Unsupported("num_seqs * num_kv_heads overflows".into())
                })?;
                let blocks = warps.div_ceil((SELECT_WARP_THREADS / 32) as usize);
                let grid = grid_x("selection blocks", blocks)?;
                // SAFETY: stats may be null (the kernel tests it). num_pred <= budget <=
                // OASIS_SELECT_WARP_MAX (its register and static shared-memory layout). Lengths
                // checked above; page ids are bounds-checked by the kernel; reachability and
                // lifetime by DevSlice's contract, the stream by Stream's.
                return unsafe { self.queue(name, grid, SELECT_WARP_THREADS, 0, stream, &params) };
            }
            let name = "delta_select_i32";
            let grid = grid_rows_heads("num_seqs", num_seqs, h)?;
            let smem = delta_select_smem_bytes(budget, num_pred);
            // SAFETY: stats may be null (the kernel tests it). budget <=
            // OASIS_MAX_SELECT_BUDGET, `smem` is the kernel's layout and launch() checks it
            // against the device limit. Lengths checked above; page ids are bounds-checked by the
            // kernel; reachability and lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, SELECT_THREADS, smem, stream, &params) }
        })
    }
}

/// `(num_kv_heads, head_dim, num_qo_heads, num_seqs, grid)` of [`score_shape`].
type ScoreShape = (usize, usize, usize, usize, (u32, u32, u32));

/// What `score_blocks` and `score_blocks_bound8` check and launch alike: `q [num_seqs,
/// num_qo_heads, head_dim]` against the CSR, `scores [nnz, num_kv_heads]`, and the grid (one warp
/// per tile of SCORE_TILE entries and KV head; a thread block holds consecutive tiles of one head,
/// OASIS_SCORE_HEAD_MAJOR). Returns `(num_kv_heads, head_dim, num_qo_heads, num_seqs, grid)`.
fn score_shape(
    geo: &KvGeometry,
    q_len: usize,
    indptr_len: usize,
    nnz: usize,
    scores_len: usize,
) -> Result<ScoreShape> {
    let [h, _, d] = page_shape(geo)?;
    let qh = geo.num_qo_heads;
    let num_seqs = csr_rows("blk_indptr", indptr_len)?;
    check_len("q", q_len, &[num_seqs, qh, d])?;
    check_len("scores", scores_len, &[nnz, h])?;
    let blocks = nnz
        .div_ceil(SCORE_TILE)
        .div_ceil((SCORE_THREADS / 32) as usize)
        * h;
    Ok((h, d, qh, num_seqs, grid_x("score blocks", blocks)?))
}
