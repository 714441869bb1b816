//! The decode attention launch: the tensor-core or generic kernel over paged, head-wise working
//! sets, and, with split-KV, the merge of the partial results. [`attention_call`] and
//! [`Gpu::merge_splits`] are shared with the kv8 pages' launch (`ops/kv8.rs`).

use super::*;

/// A checked decode attention call, less its pages: what both launches (T pages, kv8 pages) fill
/// their parameter struct and grid from.
pub(super) struct AttnCall {
    pub num_seqs: usize,
    pub num_pages: usize,
    pub num_splits: usize,
    /// `num_seqs * num_rows * num_qo_heads`
    pub heads: usize,
    /// Query vectors per block: `num_rows * group_size`.
    pub nq: usize,
    pub tmp_out: u64,
    pub tmp_lse: u64,
    pub page_map: u64,
    pub extra_k: u64,
    pub extra_v: u64,
}

/// The page table of a call (both page kinds).
pub(super) struct AttnTable {
    pub kv_indptr: DevSlice<i32>,
    pub kv_last_page_len: DevSlice<i32>,
    pub page_map: Option<DevSlice<i32>>,
}

/// Check a decode attention call as the CPU twin does; `num_pages` checks the pools and counts
/// their pages.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_call<T>(
    geo: &KvGeometry,
    q: DevSlice<T>,
    num_rows: usize,
    table: &AttnTable,
    num_pages: impl FnOnce([usize; 3]) -> Result<usize>,
    extra: Option<&ExtraKvDev<T>>,
    out: DevSlice<T>,
    split: Option<&SplitKv>,
) -> Result<AttnCall> {
    let page = page_shape(geo)?;
    let [h, _, d] = page;
    let qh = geo.num_qo_heads;
    if num_rows == 0 {
        return Err(OasisError::Invalid("num_rows must be at least 1".into()).into());
    }
    let num_seqs = csr_rows("kv_indptr", table.kv_indptr.len())?;
    check_len("q", q.len(), &[num_seqs, num_rows, qh, d])?;
    check_len("out", out.len(), &[num_seqs, num_rows, qh, d])?;
    check_len(
        "kv_last_page_len",
        table.kv_last_page_len.len(),
        &[num_seqs],
    )?;
    let num_pages = num_pages(page)?;
    if let Some(pm) = &table.page_map {
        check_len("page_map", pm.len(), &[num_pages, h])?;
    }
    if let Some(x) = extra {
        if num_rows < 2 {
            return Err(OasisError::Invalid(format!(
                "extra kv is seen by rows >= 1 only: it needs num_rows >= 2, got {num_rows}"
            ))
            .into());
        }
        check_len("extra.k", x.k.len(), &[num_seqs, h, d])?;
        check_len("extra.v", x.v.len(), &[num_seqs, h, d])?;
    }
    let num_splits = split.map_or(1, |s| s.num_splits);
    if num_splits == 0 || num_splits > MAX_SPLITS {
        return Err(OasisError::Invalid(format!(
            "num_splits must be in 1..={MAX_SPLITS}, got {num_splits}"
        ))
        .into());
    }
    let heads = num_seqs * num_rows * qh;
    let (tmp_out, tmp_lse) = match split {
        Some(s) if num_splits > 1 => {
            let need = decode_attn_workspace_len(num_seqs, num_rows, qh, d, num_splits);
            if s.workspace.len() < need {
                return Err(OasisError::Shape {
                    what: "split workspace",
                    expected: format!("at least {need} f32 elements"),
                    got: format!("{} elements", s.workspace.len()),
                }
                .into());
            }
            let lse = s.workspace.ptr() + (heads * num_splits * d * 4) as u64;
            (s.workspace.ptr(), lse)
        }
        _ => (0, 0),
    };
    let (extra_k, extra_v) = extra.map_or((0, 0), |x| (x.k.ptr(), x.v.ptr()));
    Ok(AttnCall {
        num_seqs,
        num_pages,
        num_splits,
        heads,
        nq: num_rows * geo.group_size(),
        tmp_out,
        tmp_lse,
        page_map: table.page_map.map_or(0, |p| p.ptr()),
        extra_k,
        extra_v,
    })
}

/// The generic kernel's tile: the most tokens whose shared memory stays under
/// [`DECODE_SMEM_TARGET`], and that shared memory.
pub(super) fn generic_tile(nq: usize, d: usize) -> (usize, usize) {
    let tt = (1..=MAX_TILE_TOKENS)
        .rev()
        .find(|&tt| decode_attn_smem_bytes(nq, d, tt) <= DECODE_SMEM_TARGET)
        .unwrap_or(1);
    (tt, decode_attn_smem_bytes(nq, d, tt))
}

/// The grid of both attention launches: (num_seqs, num_kv_heads, num_splits).
pub(super) fn attention_grid(c: &AttnCall, num_kv_heads: usize) -> Result<(u32, u32, u32)> {
    Ok((
        grid_dim("num_seqs", c.num_seqs, GRID_X_MAX)?,
        grid_dim("num_kv_heads", num_kv_heads, GRID_YZ_MAX)?,
        grid_dim("num_splits", c.num_splits, GRID_YZ_MAX)?,
    ))
}

impl Gpu {
    /// GPU twin of `oasis_core::kernels::decode_attention`: every query row of a sequence attends
    /// to every valid (page, head) entry of it; rows >= 1 also attend to `extra`. With `split`,
    /// the pages are cut into `split.num_splits` parts whose results are merged by a second
    /// kernel on the same stream ([`plan_num_splits`] picks the count).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape, `num_rows == 0`,
    /// `extra` with fewer than 2 rows, or a workspace too small; [`CudaError::Unsupported`] when
    /// the query group does not fit in shared memory.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_attention<T: KvElem>(
        &self,
        geo: &KvGeometry,
        q: DevSlice<T>, // [num_seqs, num_rows, num_qo_heads, head_dim]
        num_rows: usize,
        kv: &PagedKvDev<T>,
        extra: Option<&ExtraKvDev<T>>,
        sm_scale: f32,
        out: DevSlice<T>, // [num_seqs, num_rows, num_qo_heads, head_dim]
        split: Option<&SplitKv>,
        stream: Stream,
    ) -> Result<()> {
        guard("decode_attention", || {
            let table = AttnTable {
                kv_indptr: kv.kv_indptr,
                kv_last_page_len: kv.kv_last_page_len,
                page_map: kv.page_map,
            };
            let pools = |page| pool_rows(page, ("k_pages", kv.k_pages), ("v_pages", kv.v_pages));
            let c = attention_call(geo, q, num_rows, &table, pools, extra, out, split)?;
            let (h, bs, d) = (geo.num_kv_heads, geo.block_size, geo.head_dim);
            // Tensor-core kernel for 16-bit storage when the query group fits one m16 tile, pages
            // are whole 16-token chunks and K/V allow 16-byte copies (q 4-byte loads); else the
            // generic one, whose `tile_tokens` the tensor-core kernel ignores (it passes 0).
            let aligned = q.ptr().is_multiple_of(4)
                && (kv.k_pages.ptr() | kv.v_pages.ptr() | c.extra_k | c.extra_v).is_multiple_of(16);
            let (name, tt, smem) = match decode_attn_tc_entry::<T>(d) {
                Some((name, stages)) if c.nq <= 16 && bs.is_multiple_of(16) && aligned => {
                    (name, 0, decode_attn_tc_smem_bytes(d, stages))
                }
                _ => {
                    let (tt, smem) = generic_tile(c.nq, d);
                    (entry!(T, "decode_attn"), tt, smem)
                }
            };
            let params = params!(DecodeAttnParams {
                ptr: {
                    q, k_pages = kv.k_pages, v_pages = kv.v_pages, kv_indptr = kv.kv_indptr,
                    kv_indices = kv.kv_indices, kv_last_page_len = kv.kv_last_page_len,
                    page_map = DevPtr(c.page_map), extra_k = DevPtr(c.extra_k),
                    extra_v = DevPtr(c.extra_v), out, tmp_out = DevPtr(c.tmp_out),
                    tmp_lse = DevPtr(c.tmp_lse),
                },
                int: {
                    num_rows, num_qo_heads = geo.num_qo_heads, num_kv_heads = h, head_dim = d,
                    block_size = bs, num_pages = c.num_pages, nnz = kv.kv_indices.len(),
                    num_splits = c.num_splits, tile_tokens = tt,
                },
                raw: { sm_scale },
            });
            let grid = attention_grid(&c, h)?;
            // SAFETY: null pointers in `params` only where the kernel tests for null
            // (page_map, extra_k, extra_v) or never dereferences them (tmp_* when num_splits ==
            // 1, out when > 1). Buffer lengths checked by attention_call, the workspace against
            // decode_attn_workspace_len; the tensor-core kernel only where its shape and
            // alignment conditions hold (checked above; it is instantiated for this head_dim).
            // `smem` is the chosen kernel's layout (for (nq, d, tt), or for (d, stages) of the
            // tensor-core kernel) and launch() checks it against the
            // device limit. The table contents are checked by the kernel: page ids against
            // num_pages, each kv_indptr row against nnz = kv_indices.len() (a malformed row reads
            // as empty), so it reads kv_indices only inside the buffer. Reachability and
            // lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, DECODE_THREADS, smem, stream, &params)? };
            self.merge_splits(&c, d, out, stream)
        })
    }

    /// The split-KV merge of a checked call whose attention kernel was just queued on `stream`
    /// (nothing to do without splits).
    pub(super) fn merge_splits<T: KvElem>(
        &self,
        c: &AttnCall,
        d: usize,
        out: DevSlice<T>, // [num_seqs, num_rows, num_qo_heads, head_dim]
        stream: Stream,
    ) -> Result<()> {
        if c.num_splits == 1 {
            return Ok(());
        }
        let name = entry!(T, "merge_attn_states");
        let params = params!(MergeAttnStatesParams {
            ptr: { tmp_out = DevPtr(c.tmp_out), tmp_lse = DevPtr(c.tmp_lse), out },
            int: { num_splits = c.num_splits, head_dim = d },
        });
        let grid = grid_x("num_seqs * num_rows * num_qo_heads", c.heads)?;
        // SAFETY: the workspace holds heads * num_splits * (d + 1) f32 (checked by
        // attention_call) written by the launch just queued on the same stream; `out` has
        // heads * d elements (checked there too).
        unsafe { self.queue(name, grid, row_threads(d), 0, stream, &params) }
    }
}
