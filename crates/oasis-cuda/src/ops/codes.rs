//! 2-bit key code launches: `build_key_codes` (inside the 8-bit bound; both in one launch:
//! `encode_blocks`), and the codes score of every listed block (`score_blocks_codes`) or of the
//! candidates (`rescore_blocks_codes`), which read the bound and the codes (not the summaries).

use super::*;

/// Threads per block of `rescore_topk_codes_*`; must match OASIS_RESCORE_TOPK_THREADS in
/// cuda/oasis_codes_tc.cuh.
pub const RESCORE_TOPK_THREADS: u32 = 128;

/// Shared memory of one `rescore_topk_codes_*` block of `warps` warps, in bytes
/// (cuda/key_codes.cu): the larger of the layout of [`score_blocks_codes_smem_bytes`] for
/// `warps` warps (the rescoring) and, reusing it once that is done, the last block's top-k
/// buffers for `m` candidates and `successors` (`topk_candidates_bytes` in cuda/oasis_topk.cuh)
/// plus the `m` scores (f32).
pub fn rescore_topk_codes_smem_bytes(
    group: usize,
    head_dim: usize,
    m: usize,
    successors: usize,
    warps: usize,
) -> usize {
    let topk = topk_candidates_smem_bytes(m, successors);
    (warps * codes_warp_smem_bytes(group, head_dim)).max(topk + 4 * m)
}

impl Gpu {
    /// GPU twin of `oasis_core::kernels::build_key_codes`: the 2-bit codes of every key of host
    /// blocks `block_ids` (all KV heads; keys in host rows `block_rows`, `None`: the id) inside
    /// their decoded 8-bit bounds (`bounds8`, `scales`), which must be those of the same complete
    /// blocks (queue it after their [`Self::build_bounds8`] on the same stream, or take
    /// [`Self::encode_blocks`]). Bit-exact with the twin. Out-of-range ids and rows are skipped.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape or a head_dim not
    /// divisible by 4.
    #[allow(clippy::too_many_arguments)]
    pub fn build_key_codes<T: KvElem>(
        &self,
        geo: &KvGeometry,
        host_k: DevSlice<T>, // [num_host_rows, num_kv_heads, block_size, head_dim]
        bounds8: DevSlice<u8>, // [num_host_blocks, num_kv_heads, 2, head_dim]
        scales: DevSlice<f32>, // [num_host_blocks, num_kv_heads]
        block_ids: DevSlice<i32>, // [n]
        block_rows: Option<DevSlice<i32>>, // [n] host row of each block; None: the id
        codes: DevSlice<u8>, // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
        stream: Stream,
    ) -> Result<()> {
        guard("build_key_codes", || {
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            codes_head_dim(d)?;
            let num_rows = rows("host_k", host_k.len(), &page)?;
            let num_host = rows("bounds8", bounds8.len(), &[h, 2, d])?;
            check_len("scales", scales.len(), &[num_host, h])?;
            check_len("codes", codes.len(), &[num_host, h, bs, d / 4])?;
            let n = block_ids.len();
            if let Some(r) = block_rows {
                check_len("block_rows", r.len(), &[n])?;
            }

            let name = entry!(T, "build_key_codes");
            let params = params!(BuildKeyCodesParams {
                ptr: { host_k, bounds8, scales, block_ids, block_rows, codes },
                int: {
                    n, num_kv_heads = h, head_dim = d, block_size = bs, num_host_blocks = num_host,
                    num_host_rows = num_rows,
                },
            });
            let grid = grid_rows_heads("n", n, h)?;
            let smem = codes_build_smem_bytes(d);
            // SAFETY: lengths checked above (bounds8, scales and codes have num_host rows, host_k
            // num_rows); block ids and rows are bounds-checked by the kernel; host_k may be pinned
            // host memory at the same address on the device (DevSlice contract; Gpu::check_uva
            // tests it); `smem` is the kernel's layout (2 KiB at most: head_dim <= 256);
            // reachability and lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, CODES_BUILD_THREADS, smem, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::build_bounds8`: the 8-bit (E4M3, outward-rounded)
    /// bounds and scales of host blocks `block_ids` (all KV heads) from their `[min; max]`
    /// summaries (queue it after the summaries' build on the same stream). Bit-exact with the
    /// twin. Out-of-range ids are skipped.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    pub fn build_bounds8<T: KvElem>(
        &self,
        geo: &KvGeometry,
        summaries: DevSlice<T>, // [num_host_blocks, num_kv_heads, 2, head_dim]
        block_ids: DevSlice<i32>, // [n]
        bounds8: DevSlice<u8>,  // [num_host_blocks, num_kv_heads, 2, head_dim]
        scales: DevSlice<f32>,  // [num_host_blocks, num_kv_heads]
        stream: Stream,
    ) -> Result<()> {
        guard("build_bounds8", || {
            let [h, _, d] = page_shape(geo)?;
            let num_host = rows("summaries", summaries.len(), &[h, 2, d])?;
            check_len("bounds8", bounds8.len(), &[num_host, h, 2, d])?;
            check_len("scales", scales.len(), &[num_host, h])?;
            let n = block_ids.len();
            let name = entry!(T, "build_bounds8");
            let params = params!(BuildBounds8Params {
                ptr: { summaries, block_ids, bounds8, scales },
                int: { n, num_kv_heads = h, head_dim = d, num_host_blocks = num_host },
            });
            let grid = grid_rows_heads("n", n, h)?;
            // SAFETY: lengths checked above (summaries, bounds8 and scales have num_host rows);
            // block ids are bounds-checked by the kernel; reachability and lifetime by
            // DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, CODES_BUILD_THREADS, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::encode_blocks`: [`Self::build_bounds8`] then
    /// [`Self::build_key_codes`] (inside that bound) of the same host blocks `block_ids` in one
    /// launch (the engine's per-step encode of the blocks a step completed). Bit-exact with the
    /// twin, and with the two launches. Out-of-range ids (and rows, for the codes) are skipped.
    ///
    /// # Errors
    /// As [`Self::build_key_codes`] and [`Self::build_bounds8`].
    #[allow(clippy::too_many_arguments)]
    pub fn encode_blocks<T: KvElem>(
        &self,
        geo: &KvGeometry,
        host_k: DevSlice<T>, // [num_host_rows, num_kv_heads, block_size, head_dim]
        summaries: DevSlice<T>, // [num_host_blocks, num_kv_heads, 2, head_dim]
        block_ids: DevSlice<i32>, // [n]
        block_rows: Option<DevSlice<i32>>, // [n] host row of each block; None: the id
        codes: DevSlice<u8>, // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
        bounds8: DevSlice<u8>, // [num_host_blocks, num_kv_heads, 2, head_dim]
        scales: DevSlice<f32>, // [num_host_blocks, num_kv_heads]
        stream: Stream,
    ) -> Result<()> {
        guard("encode_blocks", || {
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            codes_head_dim(d)?;
            let num_rows = rows("host_k", host_k.len(), &page)?;
            let num_host = rows("summaries", summaries.len(), &[h, 2, d])?;
            check_len("codes", codes.len(), &[num_host, h, bs, d / 4])?;
            check_len("bounds8", bounds8.len(), &[num_host, h, 2, d])?;
            check_len("scales", scales.len(), &[num_host, h])?;
            let n = block_ids.len();
            if let Some(r) = block_rows {
                check_len("block_rows", r.len(), &[n])?;
            }

            let name = entry!(T, "encode_blocks");
            let params = params!(EncodeBlocksParams {
                ptr: { host_k, summaries, block_ids, block_rows, codes, bounds8, scales },
                int: {
                    n, num_kv_heads = h, head_dim = d, block_size = bs, num_host_blocks = num_host,
                    num_host_rows = num_rows,
                },
            });
            let grid = grid_rows_heads("n", n, h)?;
            let smem = codes_build_smem_bytes(d);
            // SAFETY: lengths checked above (summaries, codes, bounds8 and scales have num_host
            // rows, host_k num_rows); block ids and rows are bounds-checked by the kernel; host_k
            // may be pinned host memory at the same address on the device (DevSlice contract;
            // Gpu::check_uva tests it); `smem` is the kernel's layout (2 KiB at most: head_dim <=
            // 256); reachability and lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, CODES_BUILD_THREADS, smem, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::score_blocks_codes`: per listed block and KV head, the
    /// sum over the GQA group of the block's largest approximate logit from its 2-bit codes inside
    /// its decoded 8-bit bound (NaN for a NaN scale).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape or a head_dim not
    /// divisible by 4; a launch error when the group's shared memory does not fit the device.
    #[allow(clippy::too_many_arguments)]
    pub fn score_blocks_codes<T: KvElem>(
        &self,
        geo: &KvGeometry,
        q: DevSlice<T>,             // [num_seqs, num_qo_heads, head_dim]
        bounds8: DevSlice<u8>,      // [num_host_blocks, num_kv_heads, 2, head_dim]
        scales: DevSlice<f32>,      // [num_host_blocks, num_kv_heads]
        codes: DevSlice<u8>,        // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
        blk_indptr: DevSlice<i32>,  // [num_seqs + 1]
        blk_indices: DevSlice<i32>, // [nnz]
        scores: DevSlice<f32>,      // [nnz, num_kv_heads]
        stream: Stream,
    ) -> Result<()> {
        self.launch_codes(
            "score_blocks_codes",
            geo,
            q,
            bounds8,
            scales,
            codes,
            blk_indptr,
            blk_indices,
            scores,
            None,
            stream,
        )
    }

    /// GPU twin of `oasis_core::kernels::rescore_blocks_codes`: the codes score of `m` candidate
    /// logical blocks per (sequence, KV head), `cand [num_seqs, num_kv_heads, m]` (negative: none,
    /// -inf), into `scores [num_seqs * m, num_kv_heads]`, a CSR of `m` entries per sequence for
    /// [`Self::topk_blocks`]. A candidate outside its sequence's row scores -inf (the CPU twin
    /// refuses it).
    ///
    /// # Errors
    /// As [`Self::score_blocks_codes`], for `cand` and `scores` of other shapes too.
    #[allow(clippy::too_many_arguments)]
    pub fn rescore_blocks_codes<T: KvElem>(
        &self,
        geo: &KvGeometry,
        q: DevSlice<T>,             // [num_seqs, num_qo_heads, head_dim]
        bounds8: DevSlice<u8>,      // [num_host_blocks, num_kv_heads, 2, head_dim]
        scales: DevSlice<f32>,      // [num_host_blocks, num_kv_heads]
        codes: DevSlice<u8>,        // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
        blk_indptr: DevSlice<i32>,  // [num_seqs + 1]
        blk_indices: DevSlice<i32>, // [nnz]
        cand: DevSlice<i32>,        // [num_seqs, num_kv_heads, m]
        m: usize,
        scores: DevSlice<f32>, // [num_seqs * m, num_kv_heads]
        stream: Stream,
    ) -> Result<()> {
        self.launch_codes(
            "rescore_blocks_codes",
            geo,
            q,
            bounds8,
            scales,
            codes,
            blk_indptr,
            blk_indices,
            scores,
            Some((cand, m)),
            stream,
        )
    }

    /// GPU twin of `oasis_core::kernels::rescore_topk_codes`: [`Self::rescore_blocks_codes`]
    /// then [`Self::topk_candidates`] in one launch. The candidates of a (sequence, KV head) are
    /// scored by as many warps as [`Self::rescore_blocks_codes`] gives them (its tile length,
    /// [`score_codes_tile`], spread over several thread blocks) into `scratch`; the last of those
    /// blocks to finish (a ticket on `counters`, which it sets back to 0) selects from them. The
    /// same bits as the two launches (ties included): the scores go through no reduction in
    /// between, so a caller that reduces them (KV-head replicas) launches the two apart.
    ///
    /// `counters` must be all zero at the launch, and no other launch may use them until this
    /// one is done (each launch leaves them zero: allocate them zeroed once per stream or
    /// caller, not per launch).
    ///
    /// # Errors
    /// As the two launches: [`CudaError::Invalid`] for a buffer whose size does not match its
    /// shape or a head_dim not divisible by 4; [`CudaError::Unsupported`] for `k > MAX_TOPK` or
    /// `m + successors > MAX_CANDIDATES`; a launch error when the shared memory does not fit.
    #[allow(clippy::too_many_arguments)]
    pub fn rescore_topk_codes<T: KvElem>(
        &self,
        geo: &KvGeometry,
        q: DevSlice<T>,             // [num_seqs, num_qo_heads, head_dim]
        bounds8: DevSlice<u8>,      // [num_host_blocks, num_kv_heads, 2, head_dim]
        scales: DevSlice<f32>,      // [num_host_blocks, num_kv_heads]
        codes: DevSlice<u8>,        // [num_host_blocks, num_kv_heads, block_size, head_dim / 4]
        blk_indptr: DevSlice<i32>,  // [num_seqs + 1]
        blk_indices: DevSlice<i32>, // [nnz]
        cand: DevSlice<i32>,        // [num_seqs, num_kv_heads, m]
        m: usize,
        k: usize,
        successors: usize,
        forced: Option<(DevSlice<i32>, usize)>, // [num_seqs, num_kv_heads, n_forced]
        out: DevSlice<i32>,                     // [num_seqs, num_kv_heads, k]
        scratch: DevSlice<f32>,                 // [num_seqs, num_kv_heads, m]
        counters: DevSlice<i32>,                // [num_seqs, num_kv_heads], all zero
        stream: Stream,
    ) -> Result<()> {
        guard("rescore_topk_codes", || {
            let [h, bs, d] = page_shape(geo)?;
            codes_head_dim(d)?;
            if k > MAX_TOPK || m + successors > MAX_CANDIDATES {
                return Err(CudaError::Unsupported(format!(
                    "k = {k} (at most {MAX_TOPK}) or m + successors = {} (at most \
                     {MAX_CANDIDATES}) past the candidates' top-k kernel",
                    m + successors
                )));
            }
            let qh = geo.num_qo_heads;
            let num_seqs = csr_rows("blk_indptr", blk_indptr.len())?;
            check_len("q", q.len(), &[num_seqs, qh, d])?;
            let num_host = rows("bounds8", bounds8.len(), &[h, 2, d])?;
            check_len("scales", scales.len(), &[num_host, h])?;
            check_len("codes", codes.len(), &[num_host, h, bs, d / 4])?;
            let nnz = blk_indices.len();
            check_len("cand", cand.len(), &[num_seqs, h, m])?;
            check_len("out", out.len(), &[num_seqs, h, k])?;
            check_len("scratch", scratch.len(), &[num_seqs, h, m])?;
            check_len("counters", counters.len(), &[num_seqs, h])?;
            let n_forced = forced.map_or(0, |(_, n)| n);
            if let Some((f, n)) = forced {
                check_len("forced", f.len(), &[num_seqs, h, n])?;
            }
            int("num_seqs * m", num_seqs * m)?;
            if k == 0 || num_seqs == 0 {
                return Ok(());
            }

            let name = entry!(T, "rescore_topk_codes");
            // The tile of the two launches' rescoring: as many warps in flight.
            let tile = score_codes_tile(num_seqs * m, h, self.num_sms());
            let params = params!(RescoreTopkCodesParams {
                ptr: {
                    q, bounds8, scales, codes, blk_indptr, blk_indices, cand,
                    forced = forced.map(|(f, _)| f), out, scratch, counters,
                },
                int: {
                    nnz, num_qo_heads = qh, num_kv_heads = h, head_dim = d, block_size = bs,
                    num_host_blocks = num_host, m, k, successors, n_forced, tile,
                },
                raw: { _pad0 = 0 },
            });
            // RESCORE_TOPK_THREADS, or fewer warps where their shared memory does not fit (a
            // large group x head_dim): the kernel's result does not depend on its thread count.
            let limit = self.function(name)?.max_dynamic_smem;
            let smem_of = |threads: u32| {
                let warps = (threads / 32) as usize;
                rescore_topk_codes_smem_bytes(geo.group_size(), d, m, successors, warps)
            };
            let mut threads = RESCORE_TOPK_THREADS;
            while threads > 32 && smem_of(threads) > limit {
                threads /= 2;
            }
            let smem = smem_of(threads);
            // Thread blocks per (sequence, KV head): one tile per warp (at least one block, which
            // selects even with no candidate).
            let splits = m.div_ceil(tile * (threads / 32) as usize).max(1);
            let (gx, gy, _) = grid_rows_heads("num_seqs", num_seqs, h)?;
            let grid = (gx, gy, grid_dim("candidate blocks", splits, GRID_YZ_MAX)?);
            // SAFETY: lengths checked above (bounds8, scales and codes have num_host rows; cand,
            // forced, out, scratch and counters their (sequence, head) rows; the caller keeps
            // counters zero and to this launch, as documented); the kernel bounds-checks block ids
            // and each candidate's blk_indptr row against nnz (-inf outside), reads cand and
            // forced only below m and n_forced; k <= MAX_TOPK and m + successors <=
            // MAX_CANDIDATES (its buffers); `smem` is the kernel's layout for `threads` (a
            // multiple of 32, at most its launch bound) and launch() checks it against the device
            // limit; reachability and lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, threads, smem, stream, &params) }
        })
    }

    /// The launch of `score_blocks_codes_*`: every listed block, or with `cand = (cand, m)` the
    /// candidates of each (sequence, KV head).
    #[allow(clippy::too_many_arguments)]
    fn launch_codes<T: KvElem>(
        &self,
        what: &'static str,
        geo: &KvGeometry,
        q: DevSlice<T>,
        bounds8: DevSlice<u8>,
        scales: DevSlice<f32>,
        codes: DevSlice<u8>,
        blk_indptr: DevSlice<i32>,
        blk_indices: DevSlice<i32>,
        scores: DevSlice<f32>,
        cand: Option<(DevSlice<i32>, usize)>,
        stream: Stream,
    ) -> Result<()> {
        guard(what, || {
            let [h, bs, d] = page_shape(geo)?;
            codes_head_dim(d)?;
            let qh = geo.num_qo_heads;
            let num_seqs = csr_rows("blk_indptr", blk_indptr.len())?;
            check_len("q", q.len(), &[num_seqs, qh, d])?;
            let num_host = rows("bounds8", bounds8.len(), &[h, 2, d])?;
            check_len("scales", scales.len(), &[num_host, h])?;
            check_len("codes", codes.len(), &[num_host, h, bs, d / 4])?;
            let nnz = blk_indices.len();
            // Entries scored: every listed block, or m candidates per sequence.
            let n_out = match cand {
                None => nnz,
                Some((c, m)) => {
                    check_len("cand", c.len(), &[num_seqs, h, m])?;
                    num_seqs * m
                }
            };
            check_len("scores", scores.len(), &[n_out, h])?;
            if n_out == 0 {
                return Ok(());
            }

            let name = entry!(T, "score_blocks_codes");
            let tile = score_codes_tile(n_out, h, self.num_sms());
            let params = params!(ScoreBlocksCodesParams {
                ptr: {
                    q, bounds8, scales, codes, blk_indptr, blk_indices, scores,
                    cand = cand.map(|(c, _)| c),
                },
                int: {
                    num_seqs, nnz, num_qo_heads = qh, num_kv_heads = h, head_dim = d,
                    block_size = bs, num_host_blocks = num_host,
                },
                raw: { cand_m = int("m", cand.map_or(0, |(_, m)| m))? },
                int: { tile },
                raw: { _pad0 = 0 },
            });
            int("num_seqs * m", n_out)?;
            // One warp per (tile of `tile` entries, KV head); a thread block holds consecutive
            // tiles of one head.
            let blocks = n_out
                .div_ceil(tile)
                .div_ceil((SCORE_CODES_THREADS / 32) as usize)
                * h;
            let grid = grid_x("score blocks", blocks)?;
            let smem = score_blocks_codes_smem_bytes(geo.group_size(), d);
            // SAFETY: lengths checked above (bounds8, scales and codes have num_host rows); the kernel
            // bounds-checks block ids and each blk_indptr row against nnz (an entry outside a
            // well-formed row scores -inf) and only reads blk_indptr[0..=num_seqs]; `smem` is the
            // kernel's layout and launch() checks it against the device limit; reachability and
            // lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, SCORE_CODES_THREADS, smem, stream, &params) }
        })
    }
}
