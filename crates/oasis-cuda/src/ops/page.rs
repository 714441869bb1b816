//! Paged KV launches: `append_kv` (the new token, written through to the host pool, and the
//! summaries' update), `build_summaries`, `gather_blocks` (a selection plan's copies from the
//! host pool, launched as [`gather_launch`] says) and `copy_pages`.

use super::*;

impl Gpu {
    /// GPU twin of `oasis_core::kernels::append_kv`: append one token per sequence, with
    /// write-through to host row `host_rows[s]` (`None`: the id) and the summary update of host
    /// block `host_block_ids[s]` for sparse sequences (`host_block_ids[s] >= 0`). `host_k`,
    /// `host_v` may be empty when every sequence is dense.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn append_kv<T: KvElem>(
        &self,
        geo: &KvGeometry,
        k_new: DevSlice<T>,               // [num_seqs, num_kv_heads, head_dim]
        v_new: DevSlice<T>,               // [num_seqs, num_kv_heads, head_dim]
        page_ids: DevSlice<i32>,          // [num_seqs]
        page_offsets: DevSlice<i32>,      // [num_seqs] 0..block_size
        host_block_ids: DevSlice<i32>,    // [num_seqs] -1 = dense
        host_rows: Option<DevSlice<i32>>, // [num_seqs] host row of the write-through; None: the id
        k_pages: DevSlice<T>,             // [num_pages, num_kv_heads, block_size, head_dim]
        v_pages: DevSlice<T>,             // [num_pages, num_kv_heads, block_size, head_dim]
        host_k: DevSlice<T>, // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host
        host_v: DevSlice<T>, // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host
        summaries: DevSlice<T>, // [num_host_blocks, num_kv_heads, 2, head_dim]
        stream: Stream,
    ) -> Result<()> {
        guard("append_kv", || {
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            let num_seqs = page_ids.len();
            check_len("k_new", k_new.len(), &[num_seqs, h, d])?;
            check_len("v_new", v_new.len(), &[num_seqs, h, d])?;
            check_len("page_offsets", page_offsets.len(), &[num_seqs])?;
            check_len("host_block_ids", host_block_ids.len(), &[num_seqs])?;
            if let Some(r) = host_rows {
                check_len("host_rows", r.len(), &[num_seqs])?;
            }
            let num_pages = pool_rows(page, ("k_pages", k_pages), ("v_pages", v_pages))?;
            let num_rows = pool_rows(page, ("host_k", host_k), ("host_v", host_v))?;
            let num_host = rows("summaries", summaries.len(), &[h, 2, d])?;

            let name = entry!(T, "append_kv");
            let params = params!(AppendKvParams {
                ptr: {
                    k_new, v_new, page_ids, page_offsets, host_block_ids, host_rows, k_pages,
                    v_pages, host_k, host_v, summaries,
                },
                int: {
                    num_kv_heads = h, head_dim = d, block_size = bs, num_pages,
                    num_host_blocks = num_host, num_host_rows = num_rows,
                },
            });
            let grid = grid_rows_heads("num_seqs", num_seqs, h)?;
            // SAFETY: every buffer of `params` has the length its shape needs (checked above)
            // and, by DevSlice's contract, is reachable by this device until the stream runs the
            // kernel; table entries are bounds-checked by the kernel; the stream is valid by
            // Stream's contract.
            unsafe { self.queue(name, grid, row_threads(d), 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::build_summaries`: recompute the summaries of host
    /// blocks `block_ids[i]` over the first `block_lens[i]` tokens of host row `block_rows[i]`
    /// (`None`: the id).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn build_summaries<T: KvElem>(
        &self,
        geo: &KvGeometry,
        host_k: DevSlice<T>, // [num_host_rows, num_kv_heads, block_size, head_dim]
        block_ids: DevSlice<i32>, // [n]
        block_rows: Option<DevSlice<i32>>, // [n] host row of each block; None: the id
        block_lens: DevSlice<i32>, // [n] 1..=block_size
        summaries: DevSlice<T>, // [num_host_blocks, num_kv_heads, 2, head_dim]
        stream: Stream,
    ) -> Result<()> {
        guard("build_summaries", || {
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            let num_rows = rows("host_k", host_k.len(), &page)?;
            let num_host = rows("summaries", summaries.len(), &[h, 2, d])?;
            check_len("block_lens", block_lens.len(), &[block_ids.len()])?;
            if let Some(r) = block_rows {
                check_len("block_rows", r.len(), &[block_ids.len()])?;
            }

            let name = entry!(T, "build_summaries");
            let params = params!(BuildSummariesParams {
                ptr: { host_k, block_ids, block_rows, block_lens, summaries },
                int: {
                    num_kv_heads = h, head_dim = d, block_size = bs, num_host_blocks = num_host,
                    num_host_rows = num_rows,
                },
                raw: { _pad0 = 0 },
            });
            let grid = grid_rows_heads("n", block_ids.len(), h)?;
            // SAFETY: buffer lengths checked above; reachability and lifetime by DevSlice's
            // contract; table entries bounds-checked by the kernel; the stream by Stream's
            // contract.
            unsafe { self.queue(name, grid, row_threads(d), 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::gather_blocks`: copy every planned block-head entry
    /// from the host pool (pinned, read through UVA) into its GPU slot. Bit-exact. Launched as
    /// [`gather_launch`] says, or as [`GatherLaunch::DEVICE_SOURCE`] when `device_source` (the
    /// pool is in device memory).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_blocks<T: KvElem>(
        &self,
        geo: &KvGeometry,
        plan_slots: DevSlice<i32>,  // [num_seqs, num_kv_heads, fetch_cap]
        plan_blocks: DevSlice<i32>, // [num_seqs, num_kv_heads, fetch_cap]
        fetch_cap: usize,
        slot_pages: DevSlice<i32>, // [num_seqs, budget]
        budget: usize,
        host_indptr: DevSlice<i32>,  // [num_seqs + 1]
        host_indices: DevSlice<i32>, // [nnz]
        host_k: DevSlice<T>, // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned host
        host_v: DevSlice<T>, // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned host
        k_pages: DevSlice<T>, // [num_pages, num_kv_heads, block_size, head_dim]
        v_pages: DevSlice<T>, // [num_pages, num_kv_heads, block_size, head_dim]
        device_source: bool,
        stream: Stream,
    ) -> Result<()> {
        guard("gather_blocks", || {
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            let num_seqs = csr_rows("host_indptr", host_indptr.len())?;
            check_len("plan_slots", plan_slots.len(), &[num_seqs, h, fetch_cap])?;
            check_len("plan_blocks", plan_blocks.len(), &[num_seqs, h, fetch_cap])?;
            check_len("slot_pages", slot_pages.len(), &[num_seqs, budget])?;
            let num_host = pool_rows(page, ("host_k", host_k), ("host_v", host_v))?;
            let num_pages = pool_rows(page, ("k_pages", k_pages), ("v_pages", v_pages))?;

            let name = entry!(T, "gather_blocks");
            let launch = if device_source {
                GatherLaunch::DEVICE_SOURCE
            } else {
                gather_launch()
            };
            let entry_bytes = bs * d * std::mem::size_of::<T>();
            let stage = launch.stage_for(entry_bytes, self.max_shared_mem_per_block());
            let smem = launch.stage_smem_bytes(stage, entry_bytes);
            let params = params!(GatherBlocksParams {
                ptr: {
                    plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, host_k, host_v,
                    k_pages, v_pages,
                },
                int: {
                    num_kv_heads = h, fetch_cap, budget, block_size = bs, head_dim = d, num_pages,
                    num_host_blocks = num_host, nnz = host_indices.len(), num_seqs,
                },
                raw: {
                    entries_per_warp = launch.entries_per_warp as i32, stage_entries = stage as i32,
                    _pad0 = 0,
                },
            });
            let grid = grid_x(
                "gather blocks",
                gather_grid(num_seqs * h * fetch_cap, launch),
            )?;
            // SAFETY: lengths checked above; slots, pages, logical and host block ids are all
            // bounds-checked by the kernel, and each host_indptr row against nnz =
            // host_indices.len() (a malformed row is skipped). host_k/host_v are pinned host
            // memory at the same address on the device (DevSlice contract; Gpu::check_uva tests
            // it); lifetime by DevSlice's contract, the stream by Stream's. The block is whole
            // warps, at most OASIS_COPY_THREADS (set_gather_launch checks it); its shared memory
            // holds stage entries of K and V per warp (stage_for fits it under the device limit).
            unsafe {
                self.queue(
                    name,
                    grid,
                    32 * launch.warps_per_block,
                    smem,
                    stream,
                    &params,
                )
            }
        })
    }

    /// GPU twin of `oasis_core::kernels::copy_pages`: whole pages `src_ids[i] -> dst_ids[i]`, all
    /// heads, between two pools of the same page geometry (either may be pinned host memory).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_pages<T: KvElem>(
        &self,
        geo: &KvGeometry,
        src_k: DevSlice<T>, // [num_src_pages, num_kv_heads, block_size, head_dim]
        src_v: DevSlice<T>, // [num_src_pages, num_kv_heads, block_size, head_dim]
        src_ids: DevSlice<i32>, // [n]
        dst_k: DevSlice<T>, // [num_dst_pages, num_kv_heads, block_size, head_dim]
        dst_v: DevSlice<T>, // [num_dst_pages, num_kv_heads, block_size, head_dim]
        dst_ids: DevSlice<i32>, // [n]
        stream: Stream,
    ) -> Result<()> {
        guard("copy_pages", || {
            let page = page_shape(geo)?;
            let n = src_ids.len();
            check_len("dst_ids", dst_ids.len(), &[n])?;
            let num_src = pool_rows(page, ("src_k", src_k), ("src_v", src_v))?;
            let num_dst = pool_rows(page, ("dst_k", dst_k), ("dst_v", dst_v))?;

            let name = entry!(T, "copy_pages");
            let page_elems = i64::try_from(geo.page_elems())
                .map_err(|_| CudaError::Unsupported("page size does not fit i64".into()))?;
            let params = params!(CopyPagesParams {
                ptr: { src_k, src_v, src_ids, dst_k, dst_v, dst_ids },
                raw: { page_elems },
                int: { num_src_pages = num_src, num_dst_pages = num_dst },
            });
            let grid = grid_x("n", n)?;
            // SAFETY: lengths checked above; page ids bounds-checked by the kernel; reachability
            // (UVA for a pinned side) and lifetime by DevSlice's contract, the stream by
            // Stream's.
            unsafe { self.queue(name, grid, COPY_THREADS, 0, stream, &params) }
        })
    }
}
