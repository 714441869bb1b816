//! One launch wrapper per kernel, with the argument layout of its CPU twin in
//! `oasis_core::kernels` (flat row-major buffers, `i32` tables, negative = empty), plus the
//! caller's stream. Each wrapper checks every size the way the twin does and returns an error
//! before anything is queued; then it launches and returns without synchronising the host.
//!
//! What a wrapper cannot check without a host synchronisation is the *contents* of the device
//! tables (page ids, block ids, CSR pointers). The kernels check them where they read them, where
//! the CPU twin returns an error: an out-of-range page, slot or block id is skipped, and a CSR row
//! that is not `0 <= indptr[s] <= indptr[s + 1] <= nnz` (each wrapper passes `nnz`, the length of
//! the indices buffer) is read as an empty row (`oasis::csr_row` in cuda/oasis_common.cuh). No
//! table content makes a kernel read or write outside its buffers; a malformed one gives
//! results that are only defined row by row (see each kernel). Test a new caller on the CPU path
//! first: the twins say what is wrong.
//!
//! Buffers are [`DevSlice`]s: a raw device address plus its element count (a PyTorch tensor's
//! `data_ptr()` and `numel()`), made with an `unsafe` constructor whose contract carries what
//! the wrappers cannot see. Pinned host buffers (the host pool) are passed the same way: the
//! kernels read and write them through unified virtual addressing ([`Gpu::check_uva`]).
//!
//! ```text
//! ops/mod.rs        buffers (DevSlice, Stream, *Dev), launch constants, shape helpers, params!,
//!                   Gpu::queue (the one launch call)
//! ops/attention.rs  decode_attention (+ merge_attn_states)
//! ops/kv8.rs        FP8 pages: quantize_kv8, append_kv/gather_blocks/copy_pages_tiers, decode_attention_kv8
//! ops/page.rs       append_kv, build_summaries, gather_blocks, copy_pages
//! ops/select.rs     score_blocks, topk_blocks(_mapped, _forced), force_scores, topk_candidates,
//!                   delta_select
//! ops/codes.rs      build_key_codes, score_blocks_codes, rescore_blocks_codes
//! ops/norm.rs       rms_norm, qk_norm_rope, silu_mul, wait_stamp
//! ops/tests.rs      CPU tests of the sizes, limits, entry names and constants above
//! ```

use std::marker::PhantomData;

use oasis_core::error::check_len;
use oasis_core::kernels::norm::{check_kv_groups, check_rows, rms_norm_threads};
use oasis_core::kernels::{HeadLayout, WaitStamp};
use oasis_core::{DType, KvElem, KvGeometry, OasisError};

use crate::driver::{Gpu, LaunchCfg};
use crate::error::{guard, CudaError, Result};
use crate::params::{
    AppendKvParams, BuildBounds8Params, BuildKeyCodesParams, BuildSummariesParams, CopyPagesParams,
    DecodeAttnParams, DeltaSelectParams, DevPtr, EncodeBlocksParams, ForceScoresParams,
    GatherBlocksParams, KernelParams, MergeAttnStatesParams, QkNormRopeParams,
    RescoreTopkCodesParams, RmsNormParams, ScoreBlocksBound8Params, ScoreBlocksCodesParams,
    ScoreBlocksParams, SiluMulParams, TopkBlocksParams, TopkCandidatesParams, WaitStampParams,
};

/// Threads per block of the decode attention kernel (a multiple of 32). Arbitrary.
pub const DECODE_THREADS: u32 = 128;
/// Largest tokens per attention tile (one softmax lane per token: at most 32).
pub const MAX_TILE_TOKENS: usize = 32;
/// Shared memory the attention wrapper aims to stay under when it picks the tile size, so that
/// several blocks share an SM. Tuned for H100/H200 (228 KiB per SM).
pub const DECODE_SMEM_TARGET: usize = 48 * 1024;
/// Threads per block of `score_blocks_*`; must match OASIS_SCORE_THREADS in cuda/score_blocks.cu.
pub const SCORE_THREADS: u32 = 256;
/// Consecutive block-table entries one warp of `score_blocks_*` scores (for one KV head); must
/// match OASIS_SCORE_TILE.
pub const SCORE_TILE: usize = 32;
/// Threads per block of `build_key_codes_*`; must match OASIS_CODES_BUILD_THREADS in
/// cuda/key_codes.cu.
pub const CODES_BUILD_THREADS: u32 = 128;
/// Threads per block of `score_blocks_codes_*`; must match OASIS_CODES_THREADS.
pub const SCORE_CODES_THREADS: u32 = 128;
/// Consecutive block-table entries one warp of `score_blocks_codes_*` scores (for one KV head);
/// must match OASIS_CODES_TILE.
pub const SCORE_CODES_TILE: usize = 32;
/// Warps `score_blocks_codes_*` should have per SM before its tiles shrink: the rescoring is
/// latency-bound (each warp copies and scores its tile's entries one after another), so a small
/// batch needs shorter tiles to keep enough copies in flight.
pub const SCORE_CODES_WARPS_PER_SM: usize = 16;

/// Entries per warp of `score_blocks_codes_*` for `n_out` entries per KV head: the longest tile of
/// 32, 16 and 8 that still gives every SM [`SCORE_CODES_WARPS_PER_SM`] warps, else 8 (a 4-entry
/// tile measured faster at 4 x 32K but has no GPU test yet; docs/PERF.md). Total for any
/// arguments.
pub fn score_codes_tile(n_out: usize, num_kv_heads: usize, num_sms: usize) -> usize {
    let want = SCORE_CODES_WARPS_PER_SM.saturating_mul(num_sms.max(1));
    [SCORE_CODES_TILE, 16, 8]
        .into_iter()
        .find(|&t| n_out.div_ceil(t).saturating_mul(num_kv_heads) >= want)
        .unwrap_or(8)
}

/// Staging buffers per warp of `score_blocks_codes_*`'s tensor-core path; must match
/// OASIS_CODES_STAGES.
pub const SCORE_CODES_STAGES: usize = 3;

/// Threads per block of `topk_blocks_f32`; must match OASIS_TOPK_THREADS.
pub const TOPK_THREADS: u32 = 512;
/// Largest `k` of [`Gpu::topk_blocks`]: [`oasis_core::limits::MAX_TOP_K_BLOCKS`], which the
/// kernel gets as OASIS_MAX_TOPK ([`crate::nvrtc::compile_options`]).
pub const MAX_TOPK: usize = oasis_core::limits::MAX_TOP_K_BLOCKS;
/// Largest `m + successors` of [`Gpu::topk_candidates`]: [`oasis_core::limits::MAX_CANDIDATES`]
/// (OASIS_CAND_MAX in the kernel).
pub const MAX_CANDIDATES: usize = oasis_core::limits::MAX_CANDIDATES;
/// Dynamic shared memory of `topk_candidates_f32` for `m` candidates and `successors`, and of the
/// top-K part of `rescore_topk_codes_*`: `topk_candidates_bytes` in cuda/oasis_topk.cuh (its
/// sort buffer of `next_pow2(m)` keys, then the row's keys, values, successors, result and scan
/// scratch).
pub fn topk_candidates_smem_bytes(m: usize, successors: usize) -> usize {
    8 * m.max(1).next_power_of_two() + 4 * (2 * (m + successors) + m + successors + 33)
}

/// Threads of a `topk_candidates_f32` block: one per entry of its row (`m`, or the successors
/// when more), a whole number of warps, at most [`TOPK_THREADS`]. The selection does not depend
/// on it; a block sized to its row leaves the rest of the SM to the kernels it runs beside.
pub fn topk_candidates_threads(m: usize, successors: usize) -> u32 {
    let want = m.max(successors).max(1).div_ceil(32) * 32;
    want.min(TOPK_THREADS as usize) as u32
}

/// Threads per block of `force_scores_f32`. Arbitrary.
pub const FORCE_THREADS: u32 = 256;
/// Threads per block of `delta_select_i32`; must match OASIS_SELECT_THREADS.
pub const SELECT_THREADS: u32 = 256;
/// Largest budget of [`Gpu::delta_select`]: [`oasis_core::limits::MAX_SELECT_BUDGET`]
/// (OASIS_MAX_SELECT_BUDGET in the kernel).
pub const MAX_SELECT_BUDGET: usize = oasis_core::limits::MAX_SELECT_BUDGET;
/// Threads per block of `delta_select_warp_i32` (one warp per (sequence, KV head)); must match
/// OASIS_SELECT_WARP_THREADS.
pub const SELECT_WARP_THREADS: u32 = 128;
/// Largest budget `delta_select_warp_i32` handles; above it [`Gpu::delta_select`] launches
/// `delta_select_i32`. Must match OASIS_SELECT_WARP_MAX.
pub const SELECT_WARP_MAX: usize = 256;
/// Threads per block of append / summary / merge kernels (they stride over head_dim). Arbitrary.
pub const ROW_THREADS: u32 = 128;
/// Warps of one `qk_norm_rope_*` block, one head each; must match OASIS_QK_ROPE_WARPS in
/// cuda/norm_rope.cu. Arbitrary.
pub const QK_ROPE_WARPS: u32 = 4;
/// Largest split count of the split-KV attention (grid z). Arbitrary.
pub const MAX_SPLITS: usize = 256;
/// Fewest pages a split should get: below this the merge costs more than the split saves.
/// Arbitrary.
pub const MIN_PAGES_PER_SPLIT: usize = 8;
/// Blocks of the tensor-core decode attention kernel resident per SM that the split planner
/// counts on (head_dim 128: two blocks of about 100 KiB shared memory each on an H100/H200).
pub const DECODE_TC_BLOCKS_PER_SM: usize = 2;
/// Work items (16-token chunks) the tensor-core decode attention kernel compacts per round;
/// must match OASIS_TC_LIST_CAP in cuda/decode_attn.cu.
pub const DECODE_TC_LIST_CAP: usize = 512;

/// `len` elements of `T` at device-visible address `ptr`: device memory, or pinned host memory
/// mapped at the same address (UVA). Copy, like the raw pointer it is.
#[derive(Debug)]
pub struct DevSlice<T> {
    ptr: u64,
    len: usize,
    _elem: PhantomData<fn() -> T>,
}

impl<T> Clone for DevSlice<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DevSlice<T> {}

impl<T> DevSlice<T> {
    /// # Safety
    /// 1. `ptr .. ptr + len * size_of::<T>()` lies inside one live allocation that the device of
    ///    the [`Gpu`] it is used with can read and, for output arguments, write at that address
    ///    (device memory of that device, or pinned host memory mapped through UVA);
    /// 2. `ptr` is aligned for `T`, and the memory holds valid `T` values;
    /// 3. the allocation stays alive, and no host code or other stream writes it (or reads an
    ///    output argument) unordered with the launch, until the stream has run the kernel;
    /// 4. output arguments do not overlap any other argument of the same launch.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        Self {
            ptr,
            len,
            _elem: PhantomData,
        }
    }

    /// The empty buffer (a null pointer of length 0); valid wherever a length of 0 is.
    pub const fn empty() -> Self {
        Self {
            ptr: 0,
            len: 0,
            _elem: PhantomData,
        }
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A CUDA stream handle (`torch.cuda.current_stream().cuda_stream`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream(u64);

impl Stream {
    /// # Safety
    /// `handle` is 0 (the legacy default stream) or a live stream of the context of the [`Gpu`]
    /// it is used with, and stays alive until the work queued on it has run.
    pub unsafe fn from_raw(handle: u64) -> Self {
        Self(handle)
    }

    /// The legacy default stream (handle 0), always valid.
    pub const fn legacy_default() -> Self {
        Self(0)
    }

    /// The raw handle.
    pub fn handle(&self) -> u64 {
        self.0
    }
}

/// The paged KV of [`Gpu::decode_attention`], as `oasis_core::kernels::PagedKv`.
#[derive(Debug, Clone, Copy)]
pub struct PagedKvDev<T> {
    pub k_pages: DevSlice<T>, // [num_pages, num_kv_heads, block_size, head_dim]
    pub v_pages: DevSlice<T>, // [num_pages, num_kv_heads, block_size, head_dim]
    pub kv_indptr: DevSlice<i32>, // [num_seqs + 1] CSR over kv_indices
    pub kv_indices: DevSlice<i32>, // [nnz] GPU page ids of each sequence
    pub kv_last_page_len: DevSlice<i32>, // [num_seqs] 1..=block_size
    pub page_map: Option<DevSlice<i32>>, // [num_pages, num_kv_heads]; None = every entry valid
}

/// The lookahead token's own K and V, seen by rows >= 1, as `oasis_core::kernels::ExtraKv`.
#[derive(Debug, Clone, Copy)]
pub struct ExtraKvDev<T> {
    pub k: DevSlice<T>, // [num_seqs, num_kv_heads, head_dim]
    pub v: DevSlice<T>, // [num_seqs, num_kv_heads, head_dim]
}

/// The residual stream of a fused [`Gpu::rms_norm`], as `oasis_core::kernels::Residual`: the
/// kernel reads `residual` and writes `h = x + residual` to `residual_out`. The two may be the
/// same buffer (an in-place update; an exception to [`DevSlice::from_raw`]'s obligation 4, which
/// the wrapper checks: the same address and length, or no overlap at all).
#[derive(Debug, Clone, Copy)]
pub struct ResidualDev<T> {
    pub residual: DevSlice<T>,     // [n, hidden]
    pub residual_out: DevSlice<T>, // [n, hidden]
}

/// Token positions of [`Gpu::qk_norm_rope`], read by the kernel (int32 or int64, as stored), as
/// `oasis_core::kernels::Positions`.
#[derive(Debug, Clone, Copy)]
pub enum PositionsDev {
    I32(DevSlice<i32>), // [n]
    I64(DevSlice<i64>), // [n]
}

impl PositionsDev {
    fn len(&self) -> usize {
        match self {
            PositionsDev::I32(p) => p.len(),
            PositionsDev::I64(p) => p.len(),
        }
    }
}

/// Split-KV ("flash-decoding"): each sequence's pages are cut into `num_splits` parts, attended
/// by separate blocks, and merged. `workspace` holds the partial results:
/// [`decode_attn_workspace_len`] f32 elements.
#[derive(Debug, Clone, Copy)]
pub struct SplitKv {
    pub num_splits: usize,
    pub workspace: DevSlice<f32>,
}

/// f32 elements of the split-KV workspace: partial outputs
/// `[num_seqs, num_rows, num_qo_heads, num_splits, head_dim]` then log-sum-exps
/// `[num_seqs, num_rows, num_qo_heads, num_splits]`.
///
/// Saturates at `usize::MAX` instead of overflowing: no buffer has that many elements, so a
/// saturated size is always rejected as too small a workspace.
pub fn decode_attn_workspace_len(
    num_seqs: usize,
    num_rows: usize,
    num_qo_heads: usize,
    head_dim: usize,
    num_splits: usize,
) -> usize {
    [
        num_rows,
        num_qo_heads,
        num_splits,
        head_dim.saturating_add(1),
    ]
    .iter()
    .fold(num_seqs, |acc, &x| acc.saturating_mul(x))
}

/// A split count for a batch whose longest sequence has `max_pages` pages: the fewest splits
/// whose blocks fill the device's resident block slots ([`DECODE_TC_BLOCKS_PER_SM`] per SM) to
/// at least 90% over whole waves (no half-empty last wave), else the count that fills them best;
/// each split keeps at least [`MIN_PAGES_PER_SPLIT`] pages. 1 means no split (and no workspace).
/// Plan it on the CPU once per step.
///
/// Total: any arguments give a count in `1..=MAX_SPLITS` (the arithmetic saturates; huge
/// arguments never overflow nor divide by zero).
pub fn plan_num_splits(
    num_sms: usize,
    num_seqs: usize,
    num_kv_heads: usize,
    max_pages: usize,
) -> usize {
    let blocks = num_seqs.saturating_mul(num_kv_heads).max(1);
    let slots = DECODE_TC_BLOCKS_PER_SM.saturating_mul(num_sms).max(1);
    let most = (max_pages / MIN_PAGES_PER_SPLIT).clamp(1, MAX_SPLITS);
    // Fill of the slots over the waves `n` blocks take, in 1/1000. In u128: `n` rounded up to
    // whole waves can exceed usize::MAX, and 1000 * n fits.
    let fill = |n: usize| {
        let (n, slots) = (n as u128, slots as u128);
        (n * 1000 / (n.div_ceil(slots) * slots)) as usize
    };
    let mut best = (1, fill(blocks));
    for splits in 1..=most {
        let f = fill(blocks.saturating_mul(splits));
        if f >= 900 {
            return splits;
        }
        if f > best.1 {
            best = (splits, f);
        }
    }
    best.0
}

/// Shared memory of one decode attention block, in bytes: the same sum as the kernel's layout
/// (cuda/decode_attn.cu, `DecodeSmem`), for `nq` query vectors per block and `tt` tile tokens.
pub fn decode_attn_smem_bytes(nq: usize, head_dim: usize, tt: usize) -> usize {
    let d = head_dim;
    4 * (nq * (d + 1) + tt * (d + 1) + tt * d + nq * tt + nq * d + 2 * nq)
}

/// Pipeline depth (shared-memory stages per warp) of the tensor-core decode attention kernel for
/// `head_dim`, or None when it has no variant for it. Must match the OASIS_DECODE_ATTN_TC
/// instances in cuda/decode_attn.cu.
pub fn decode_attn_tc_stages(head_dim: usize) -> Option<usize> {
    match head_dim {
        64 => Some(4),
        128 => Some(3),
        256 => Some(2),
        _ => None,
    }
}

/// Shared memory of one tensor-core decode attention block of any page kind, in bytes
/// (cuda/oasis_attn_tc.cuh, `decode_attn_tc_impl`): 4 warps × `warp_units_bytes` (the pages'
/// `WARP_UNITS` × 16), then the item list (pages and infos), the merge's m/l and the scan
/// scratch; `scaled` (the loader's `SCALED`: kv8 pages) adds the items' K and V scales after it.
pub fn decode_attn_tc_block_smem_bytes(warp_units_bytes: usize, scaled: bool) -> usize {
    let list = 4 * (DECODE_TC_LIST_CAP + 1); // one 4-byte array per list item
    let per_item = if scaled { 4 } else { 2 };
    4 * warp_units_bytes + per_item * list + 2 * 4 * 64 + 4 * 36
}

/// Shared memory of one tensor-core decode attention block over 16-bit pages, in bytes: per
/// warp `stages` × (K + V of 16 tokens of 16-bit elements) ([`decode_attn_tc_block_smem_bytes`]).
pub fn decode_attn_tc_smem_bytes(head_dim: usize, stages: usize) -> usize {
    decode_attn_tc_block_smem_bytes(stages * 2 * 16 * head_dim * 2, false)
}

/// Shared memory of one `score_blocks_codes_*` block, in bytes (cuda/key_codes.cu): per warp,
/// [`SCORE_CODES_STAGES`] staging buffers of one entry each (`codes_stage_bytes`: the bound's two
/// E4M3 rows, 16 tokens' codes, then the scale padded to 16 bytes), then, after every warp's
/// buffers, `codes_scalar_warp_floats` per warp: q and the weights of the group (`group *
/// head_dim` f32 each), the block's decoded lower bound row and the group's bases.
pub fn score_blocks_codes_smem_bytes(group: usize, head_dim: usize) -> usize {
    let warps = (SCORE_CODES_THREADS / 32) as usize;
    warps * codes_warp_smem_bytes(group, head_dim)
}

/// Shared memory of one warp of the codes scores (`score_blocks_codes_*`,
/// `rescore_topk_codes_*`): its staging buffers and its scalar path's floats.
pub(crate) fn codes_warp_smem_bytes(group: usize, head_dim: usize) -> usize {
    let scalar = (2 * group * head_dim + head_dim + group) * 4;
    let stage = SCORE_CODES_STAGES * (6 * head_dim + 16);
    stage + scalar
}

/// Shared memory of one `build_key_codes_*` / `encode_blocks_*` block, in bytes: the (block,
/// head)'s decoded bound, `2 head_dim` f32 (cuda/key_codes.cu, `codes_load_bound`).
pub fn codes_build_smem_bytes(head_dim: usize) -> usize {
    2 * head_dim * 4
}

/// 2-bit key codes need `head_dim` divisible by 4 (four codes per byte), as the CPU twin.
fn codes_head_dim(head_dim: usize) -> Result<()> {
    if !head_dim.is_multiple_of(4) {
        return Err(OasisError::Config(format!(
            "2-bit key codes need head_dim divisible by 4, got {head_dim}"
        ))
        .into());
    }
    Ok(())
}

/// Shared memory of one `qk_norm_rope_*` block, in bytes (cuda/norm_rope.cu): one head of f32
/// per warp.
pub fn qk_norm_rope_smem_bytes(head_dim: usize) -> usize {
    QK_ROPE_WARPS as usize * head_dim.saturating_mul(4)
}

/// Shared memory of one delta-selection block, in bytes (cuda/delta_select.cu).
pub fn delta_select_smem_bytes(budget: usize, num_pred: usize) -> usize {
    let b2 = budget.max(1).next_power_of_two();
    let p2 = num_pred.max(1).next_power_of_two();
    8 * b2 + 4 * b2 + 4 * budget + 4 * p2
}

/// Number of leading rows of a buffer shaped `[n, row_shape...]` (pool sizes are implied by the
/// buffers, as in the CPU twins).
fn rows(what: &'static str, len: usize, row_shape: &[usize]) -> Result<usize> {
    let row: usize = row_shape.iter().product();
    if row == 0 || !len.is_multiple_of(row) {
        return Err(OasisError::Shape {
            what,
            expected: format!("[n, {row_shape:?}] (a multiple of {row} elements)"),
            got: format!("{len} elements"),
        }
        .into());
    }
    Ok(len / row)
}

/// Sequences of a CSR `indptr` buffer (its length minus one).
fn csr_rows(what: &'static str, indptr_len: usize) -> Result<usize> {
    indptr_len.checked_sub(1).ok_or_else(|| {
        OasisError::Shape {
            what,
            expected: "[num_seqs + 1] (at least 1 element)".into(),
            got: "0 elements".into(),
        }
        .into()
    })
}

fn int(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| CudaError::Unsupported(format!("{what} = {v} does not fit the kernels' i32")))
}

fn grid_dim(what: &str, v: usize, max: u32) -> Result<u32> {
    match u32::try_from(v) {
        Ok(x) if x <= max => Ok(x),
        _ => Err(CudaError::Unsupported(format!(
            "{what} = {v} exceeds the grid limit {max}"
        ))),
    }
}

/// Grid x may be up to 2^31 - 1 blocks, y and z up to 65535.
const GRID_X_MAX: u32 = i32::MAX as u32;
const GRID_YZ_MAX: u32 = 65535;

/// Threads for kernels that stride over head_dim: a multiple of 32, at most ROW_THREADS.
fn row_threads(head_dim: usize) -> u32 {
    (head_dim.div_ceil(32) * 32).clamp(32, ROW_THREADS as usize) as u32
}

/// A one-dimensional grid of `n` blocks.
fn grid_x(what: &str, n: usize) -> Result<(u32, u32, u32)> {
    Ok((grid_dim(what, n, GRID_X_MAX)?, 1, 1))
}

/// A grid of one block per (row, KV head): `n` rows (`what`) by `num_kv_heads`.
fn grid_rows_heads(what: &str, n: usize, num_kv_heads: usize) -> Result<(u32, u32, u32)> {
    Ok((
        grid_dim(what, n, GRID_X_MAX)?,
        grid_dim("num_kv_heads", num_kv_heads, GRID_YZ_MAX)?,
        1,
    ))
}

/// The shape of one page of `geo` after validating it, `[num_kv_heads, block_size, head_dim]`:
/// one row of every K/V pool.
fn page_shape(geo: &KvGeometry) -> Result<[usize; 3]> {
    geo.validate()?;
    Ok([geo.num_kv_heads, geo.block_size, geo.head_dim])
}

/// Rows of a K/V pool pair shaped `[n, page...]` (GPU pages or host blocks): `n` from the K
/// buffer, the V buffer checked against it.
fn pool_rows<T>(
    page: [usize; 3],
    (k_what, k): (&'static str, DevSlice<T>),
    (v_what, v): (&'static str, DevSlice<T>),
) -> Result<usize> {
    let n = rows(k_what, k.len(), &page)?;
    let [h, bs, d] = page;
    check_len(v_what, v.len(), &[n, h, bs, d])?;
    Ok(n)
}

/// `num_kv_heads` of a wrapper that takes it without a geometry.
fn positive_heads(num_kv_heads: usize) -> Result<()> {
    if num_kv_heads == 0 {
        return Err(OasisError::Config("num_kv_heads must be positive".into()).into());
    }
    Ok(())
}

/// The kernel of family `$family` for storage type `$t`.
/// The tensor-core decode attention entry point for `T` and `head_dim`, with its pipeline
/// depth; None for f32 storage or a head_dim it has no variant for.
fn decode_attn_tc_entry<T: KvElem>(head_dim: usize) -> Option<(&'static str, usize)> {
    let stages = decode_attn_tc_stages(head_dim)?;
    let name = match (T::DTYPE, head_dim) {
        (DType::BF16, 64) => "decode_attn_tc_bf16_d64",
        (DType::BF16, 128) => "decode_attn_tc_bf16_d128",
        (DType::BF16, 256) => "decode_attn_tc_bf16_d256",
        (DType::F16, 64) => "decode_attn_tc_f16_d64",
        (DType::F16, 128) => "decode_attn_tc_f16_d128",
        (DType::F16, 256) => "decode_attn_tc_f16_d256",
        _ => return None,
    };
    Some((name, stages))
}

/// A `#[repr(C)]` parameter struct filled field by field, in groups that may repeat, in any
/// order (a field's group says how its value becomes the field):
///
/// - `ptr: { a, b = expr }`: a device pointer, `DevPtr::from` a [`DevSlice`], an `Option` of one
///   (`None`: null) or a [`DevPtr`];
/// - `int: { n, m = expr }`: a size, as the kernels' `i32` through [`int`] under the field's own
///   name (an error when it does not fit);
/// - `raw: { eps, x = expr }`: taken as it is.
///
/// `a` alone stands for `a = a`. The fields are evaluated in the order written, and the struct
/// literal still needs every field, once.
macro_rules! params {
    ($P:ident { $($kind:ident: { $($f:ident $(= $e:expr)?),* $(,)? }),* $(,)? }) => {
        $P { $($($f: params!(@$kind $f $(, $e)?),)*)* }
    };
    (@ptr $f:ident) => { DevPtr::from($f) };
    (@ptr $f:ident, $e:expr) => { DevPtr::from($e) };
    (@int $f:ident) => { int(stringify!($f), $f)? };
    (@int $f:ident, $e:expr) => { int(stringify!($f), $e)? };
    (@raw $f:ident) => { $f };
    (@raw $f:ident, $e:expr) => { $e };
}

macro_rules! entry {
    ($t:ty, $family:literal) => {
        match <$t as KvElem>::DTYPE {
            DType::BF16 => concat!($family, "_bf16"),
            DType::F16 => concat!($family, "_f16"),
            DType::F32 => concat!($family, "_f32"),
        }
    };
}

// The launch wrappers, one file per kernel family (they use the helpers and macros above).
pub use codes::{rescore_topk_codes_smem_bytes, RESCORE_TOPK_THREADS};
pub(crate) use gather_launch::gather_grid;
pub use gather_launch::{
    gather_launch, gather_launch_kv8, set_gather_launch, set_gather_launch_kv8, GatherLaunch,
    COPY_THREADS, KV8_STAGE_FACTOR, MAX_STAGE_ENTRIES,
};
pub use kv8::{
    decode_attn_kv8_deep_stages, decode_attn_kv8_tc_entry, decode_attn_kv8_tc_smem_bytes,
    kv8_attn_kernel, set_kv8_attn_kernel, Kv8AttnKernel, Kv8PagesDev, KvTierDev, PagedKv8Dev,
};
pub use select::{
    bound8_score_kernel, score_bound8_entry, set_bound8_score_kernel, Bound8ScoreKernel,
};
mod attention;
mod codes;
mod gather_launch;
mod kv8;
mod norm;
mod page;
mod select;

impl Gpu {
    /// [`Gpu::launch`] of `name` with `params` on `grid` with `block` threads and `smem` bytes
    /// of dynamic shared memory per block, queued on `stream`.
    ///
    /// # Safety
    /// [`Gpu::launch`]'s obligation 1 for `params`; its obligation 2 holds by [`Stream`]'s
    /// contract.
    unsafe fn queue<P: KernelParams>(
        &self,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        stream: Stream,
        params: &P,
    ) -> Result<()> {
        // SAFETY: the caller's obligation 1; 2 by Stream's contract.
        unsafe {
            self.launch(
                name,
                LaunchCfg { grid, block, smem },
                stream.handle(),
                params,
            )
        }
    }
}

#[cfg(test)]
mod tests;
