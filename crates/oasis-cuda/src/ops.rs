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

use std::marker::PhantomData;
use std::sync::{Mutex, PoisonError};

use oasis_core::error::check_len;
use oasis_core::kernels::norm::{check_kv_groups, check_rows, rms_norm_threads};
use oasis_core::kernels::{HeadLayout, WaitStamp};
use oasis_core::{DType, KvElem, KvGeometry, OasisError};

use crate::driver::{Gpu, LaunchCfg};
use crate::error::{guard, CudaError, Result};
use crate::params::{
    AppendKvParams, BuildKeyCodesParams, BuildSummariesParams, CopyPagesParams, DecodeAttnParams,
    DeltaSelectParams, DevPtr, ForceScoresParams, GatherBlocksParams, KernelParams,
    MergeAttnStatesParams, QkNormRopeParams, RmsNormParams, ScoreBlocksCodesParams,
    ScoreBlocksParams, TopkBlocksParams, TopkCandidatesParams, WaitStampParams,
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
/// Threads per block of the copy kernels; must match OASIS_COPY_THREADS in cuda/gather_blocks.cu.
pub const COPY_THREADS: u32 = 128;
/// How `gather_blocks_*` is launched: at most `max_blocks` blocks (0: no cap) of
/// `warps_per_block` warps, each warp checking `entries_per_warp` plan entries per pass and
/// copying `stage_entries` of them at once through shared memory (0: one at a time through
/// registers). Any values are correct (the warps stride over the plan); they trade how many PCIe
/// reads are in flight against how many SMs hold blocks waiting on them beside the compute
/// stream's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherLaunch {
    pub max_blocks: usize,
    pub warps_per_block: u32,
    pub entries_per_warp: u32,
    pub stage_entries: u32,
}

impl GatherLaunch {
    /// The best of the shapes swept on the H200 (docs/PERF.md, "The gather off the GEMMs' SMs"):
    /// four blocks of four warps, each warp with six entries in flight (192 KiB of shared memory
    /// per block for bf16 blocks of 16 x 128). Before the staged path, one block per 32 entries
    /// (0 : 4 : 8 : 0) was best; at 40 x 16K it takes 1.32x the step time of this one.
    pub const DEFAULT: Self = Self {
        max_blocks: 4,
        warps_per_block: 4,
        entries_per_warp: 32,
        stage_entries: 6,
    };

    /// The launch of a gather whose source pool is in device memory (the all-resident oracle,
    /// `Engine(host_pool="device")`): HBM reads need many blocks, not a few with deep queues, and
    /// this is the launch the oracle was measured with before the staged path.
    pub const DEVICE_SOURCE: Self = Self {
        max_blocks: 0,
        warps_per_block: 4,
        entries_per_warp: 8,
        stage_entries: 0,
    };

    /// Entries a warp stages at once for entries of `entry_bytes` (K or V of one block-head),
    /// within `max_smem` bytes of shared memory per block: `stage_entries`, lowered to what fits;
    /// 0 (the register path) when none fits or the entry is not a multiple of 16 bytes.
    pub fn stage_for(&self, entry_bytes: usize, max_smem: usize) -> u32 {
        if self.stage_entries == 0 || entry_bytes == 0 || !entry_bytes.is_multiple_of(16) {
            return 0;
        }
        let fits = (max_smem / self.stage_smem_bytes(1, entry_bytes)).min(u32::MAX as usize) as u32;
        self.stage_entries.min(fits)
    }

    /// Shared memory of one block staging `stage` entries per warp: K and V of each, for every
    /// warp (the kernel's layout, cuda/gather_blocks.cu).
    pub fn stage_smem_bytes(&self, stage: u32, entry_bytes: usize) -> usize {
        2 * entry_bytes * stage as usize * self.warps_per_block as usize
    }
}

/// Largest `stage_entries` of a [`GatherLaunch`] (a warp's batch is a 32-bit lane mask).
pub const MAX_STAGE_ENTRIES: u32 = 32;

/// One lock for the three fields, so a launch never reads half of a concurrent setting.
static GATHER_LAUNCH: Mutex<GatherLaunch> = Mutex::new(GatherLaunch::DEFAULT);

/// Set the process-wide [`GatherLaunch`]; takes effect at the next launch (a captured graph
/// keeps the launch it was captured with).
///
/// # Errors
/// [`CudaError::Invalid`] unless 1 <= warps_per_block <= COPY_THREADS / 32,
/// 1 <= entries_per_warp <= 32 and stage_entries <= MAX_STAGE_ENTRIES.
pub fn set_gather_launch(l: GatherLaunch) -> Result<()> {
    if !(1..=COPY_THREADS / 32).contains(&l.warps_per_block)
        || !(1..=32).contains(&l.entries_per_warp)
        || l.stage_entries > MAX_STAGE_ENTRIES
    {
        return Err(CudaError::Invalid(OasisError::Invalid(format!(
            "gather launch: warps_per_block must be 1..={} and entries_per_warp 1..=32, got {} and {}; \
             stage_entries 0..={MAX_STAGE_ENTRIES}, got {}",
            COPY_THREADS / 32,
            l.warps_per_block,
            l.entries_per_warp,
            l.stage_entries
        ))));
    }
    *GATHER_LAUNCH.lock().unwrap_or_else(PoisonError::into_inner) = l;
    Ok(())
}

/// The current [`GatherLaunch`].
pub fn gather_launch() -> GatherLaunch {
    *GATHER_LAUNCH.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Blocks of a gather over `entries` plan entries under `l`: one warp per `entries_per_warp`
/// entries, at most `max_blocks` (unless 0), at least one.
fn gather_grid(entries: usize, l: GatherLaunch) -> usize {
    let per_block = (l.warps_per_block * l.entries_per_warp) as usize;
    let natural = entries.div_ceil(per_block).max(1);
    match l.max_blocks {
        0 => natural,
        n => natural.min(n),
    }
}
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

/// Shared memory of one tensor-core decode attention block, in bytes (cuda/decode_attn.cu,
/// `decode_attn_tc_impl`): 4 warps × `stages` × (K + V of 16 tokens of 16-bit elements), the
/// item list, the merge's m/l and the scan scratch.
pub fn decode_attn_tc_smem_bytes(head_dim: usize, stages: usize) -> usize {
    4 * stages * 2 * 16 * head_dim * 2 + 2 * 4 * (DECODE_TC_LIST_CAP + 1) + 2 * 4 * 64 + 4 * 36
}

/// Shared memory of one `score_blocks_codes_*` block, in bytes (cuda/key_codes.cu): per warp,
/// [`SCORE_CODES_STAGES`] staging buffers of one entry each (`codes_stage_bytes`: the min and max
/// rows in `elem_bytes`-byte elements, then 16 tokens' codes), then, after every warp's buffers,
/// `codes_scalar_warp_floats` per warp: q and the weights of the group (`group * head_dim` f32
/// each), the block's min row and the group's bases.
pub fn score_blocks_codes_smem_bytes(group: usize, head_dim: usize, elem_bytes: usize) -> usize {
    let warps = (SCORE_CODES_THREADS / 32) as usize;
    let scalar = (2 * group * head_dim + head_dim + group) * 4;
    let stage = SCORE_CODES_STAGES * (2 * head_dim * elem_bytes + 4 * head_dim);
    warps * (stage + scalar)
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
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            let qh = geo.num_qo_heads;
            if num_rows == 0 {
                return Err(OasisError::Invalid("num_rows must be at least 1".into()).into());
            }
            let num_seqs = csr_rows("kv_indptr", kv.kv_indptr.len())?;
            check_len("q", q.len(), &[num_seqs, num_rows, qh, d])?;
            check_len("out", out.len(), &[num_seqs, num_rows, qh, d])?;
            check_len("kv_last_page_len", kv.kv_last_page_len.len(), &[num_seqs])?;
            let num_pages = pool_rows(page, ("k_pages", kv.k_pages), ("v_pages", kv.v_pages))?;
            if let Some(pm) = &kv.page_map {
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

            let nq = num_rows * geo.group_size();
            let pm = kv.page_map.map_or(0, |p| p.ptr());
            let (ek, ev) = extra.map_or((0, 0), |x| (x.k.ptr(), x.v.ptr()));
            // Tensor-core kernel for 16-bit storage when the query group fits one m16 tile, pages
            // are whole 16-token chunks and K/V allow 16-byte copies (q 4-byte loads); else the
            // generic one, whose `tile_tokens` the tensor-core kernel ignores (it passes 0).
            let aligned = q.ptr().is_multiple_of(4)
                && (kv.k_pages.ptr() | kv.v_pages.ptr() | ek | ev).is_multiple_of(16);
            let (name, tt, smem) = match decode_attn_tc_entry::<T>(d) {
                Some((name, stages)) if nq <= 16 && bs.is_multiple_of(16) && aligned => {
                    (name, 0, decode_attn_tc_smem_bytes(d, stages))
                }
                _ => {
                    let tt = (1..=MAX_TILE_TOKENS)
                        .rev()
                        .find(|&tt| decode_attn_smem_bytes(nq, d, tt) <= DECODE_SMEM_TARGET)
                        .unwrap_or(1);
                    (
                        entry!(T, "decode_attn"),
                        tt,
                        decode_attn_smem_bytes(nq, d, tt),
                    )
                }
            };
            let params = params!(DecodeAttnParams {
                ptr: {
                    q, k_pages = kv.k_pages, v_pages = kv.v_pages, kv_indptr = kv.kv_indptr,
                    kv_indices = kv.kv_indices, kv_last_page_len = kv.kv_last_page_len,
                    page_map = DevPtr(pm), extra_k = DevPtr(ek), extra_v = DevPtr(ev), out,
                    tmp_out = DevPtr(tmp_out), tmp_lse = DevPtr(tmp_lse),
                },
                int: {
                    num_rows, num_qo_heads = qh, num_kv_heads = h, head_dim = d, block_size = bs,
                    num_pages, nnz = kv.kv_indices.len(), num_splits, tile_tokens = tt,
                },
                raw: { sm_scale },
            });
            let grid = (
                grid_dim("num_seqs", num_seqs, GRID_X_MAX)?,
                grid_dim("num_kv_heads", h, GRID_YZ_MAX)?,
                grid_dim("num_splits", num_splits, GRID_YZ_MAX)?,
            );
            // SAFETY: null pointers in `params` only where the kernel tests for null
            // (page_map, extra_k, extra_v) or never dereferences them (tmp_* when num_splits ==
            // 1, out when > 1). Buffer lengths checked above, the workspace against
            // decode_attn_workspace_len; the tensor-core kernel only where its shape and
            // alignment conditions hold (checked above; it is instantiated for this head_dim).
            // `smem` is the chosen kernel's layout (for (nq, d, tt), or for (d, stages) of the
            // tensor-core kernel) and launch() checks it against the
            // device limit. The table contents are checked by the kernel: page ids against
            // num_pages, each kv_indptr row against nnz = kv_indices.len() (a malformed row reads
            // as empty), so it reads kv_indices only inside the buffer. Reachability and
            // lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, DECODE_THREADS, smem, stream, &params)? };
            if num_splits == 1 {
                return Ok(());
            }
            let name = entry!(T, "merge_attn_states");
            let params = params!(MergeAttnStatesParams {
                ptr: { tmp_out = DevPtr(tmp_out), tmp_lse = DevPtr(tmp_lse), out },
                int: { num_splits, head_dim = d },
            });
            let grid = grid_x("num_seqs * num_rows * num_qo_heads", heads)?;
            // SAFETY: the workspace holds heads * num_splits * (d + 1) f32 (checked above)
            // written by the launch just queued on the same stream; `out` has heads * d
            // elements.
            unsafe { self.queue(name, grid, row_threads(d), 0, stream, &params) }
        })
    }

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
            let [h, _, d] = page_shape(geo)?;
            let qh = geo.num_qo_heads;
            let num_seqs = csr_rows("blk_indptr", blk_indptr.len())?;
            check_len("q", q.len(), &[num_seqs, qh, d])?;
            let num_host = rows("summaries", summaries.len(), &[h, 2, d])?;
            let nnz = blk_indices.len();
            check_len("scores", scores.len(), &[nnz, h])?;

            let name = entry!(T, "score_blocks");
            let params = params!(ScoreBlocksParams {
                ptr: { q, summaries, blk_indptr, blk_indices, scores },
                int: {
                    num_seqs, nnz, num_qo_heads = qh, num_kv_heads = h, head_dim = d,
                    num_host_blocks = num_host,
                },
            });
            // One warp per (tile of SCORE_TILE entries, KV head); a thread block holds
            // consecutive tiles of one head (OASIS_SCORE_HEAD_MAJOR).
            let blocks = nnz
                .div_ceil(SCORE_TILE)
                .div_ceil((SCORE_THREADS / 32) as usize)
                * h;
            let grid = grid_x("score blocks", blocks)?;
            // SAFETY: lengths checked above; the kernel bounds-checks block ids and each
            // blk_indptr row against nnz (an entry outside a well-formed row scores -inf), and
            // only reads blk_indptr[0..=num_seqs]; reachability and lifetime by DevSlice's
            // contract, the stream by Stream's.
            unsafe { self.queue(name, grid, SCORE_THREADS, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::build_key_codes`: the 2-bit codes of every key of host
    /// blocks `block_ids` (all KV heads; keys in host rows `block_rows`, `None`: the id) inside
    /// their `[min; max]` summaries, which must be those of the same complete blocks (queue it
    /// after the summaries' build on the same stream). Bit-exact with the twin. Out-of-range ids
    /// and rows are skipped.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape or a head_dim not
    /// divisible by 4.
    #[allow(clippy::too_many_arguments)]
    pub fn build_key_codes<T: KvElem>(
        &self,
        geo: &KvGeometry,
        host_k: DevSlice<T>, // [num_host_rows, num_kv_heads, block_size, head_dim]
        summaries: DevSlice<T>, // [num_host_blocks, num_kv_heads, 2, head_dim]
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
            let num_host = rows("summaries", summaries.len(), &[h, 2, d])?;
            check_len("codes", codes.len(), &[num_host, h, bs, d / 4])?;
            let n = block_ids.len();
            if let Some(r) = block_rows {
                check_len("block_rows", r.len(), &[n])?;
            }

            let name = entry!(T, "build_key_codes");
            let params = params!(BuildKeyCodesParams {
                ptr: { host_k, summaries, block_ids, block_rows, codes },
                int: {
                    n, num_kv_heads = h, head_dim = d, block_size = bs, num_host_blocks = num_host,
                    num_host_rows = num_rows,
                },
            });
            let grid = grid_rows_heads("n", n, h)?;
            // SAFETY: lengths checked above (summaries and codes have num_host rows, host_k
            // num_rows); block ids and rows are bounds-checked by the kernel; host_k may be pinned host memory at the
            // same address on the device (DevSlice contract; Gpu::check_uva tests it);
            // reachability and lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, CODES_BUILD_THREADS, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::score_blocks_codes`: per listed block and KV head, the
    /// sum over the GQA group of the block's largest approximate logit from its 2-bit codes.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape or a head_dim not
    /// divisible by 4; a launch error when the group's shared memory does not fit the device.
    #[allow(clippy::too_many_arguments)]
    pub fn score_blocks_codes<T: KvElem>(
        &self,
        geo: &KvGeometry,
        q: DevSlice<T>,             // [num_seqs, num_qo_heads, head_dim]
        summaries: DevSlice<T>,     // [num_host_blocks, num_kv_heads, 2, head_dim]
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
            summaries,
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
        summaries: DevSlice<T>,     // [num_host_blocks, num_kv_heads, 2, head_dim]
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
            summaries,
            codes,
            blk_indptr,
            blk_indices,
            scores,
            Some((cand, m)),
            stream,
        )
    }

    /// The launch of `score_blocks_codes_*`: every listed block, or with `cand = (cand, m)` the
    /// candidates of each (sequence, KV head).
    #[allow(clippy::too_many_arguments)]
    fn launch_codes<T: KvElem>(
        &self,
        what: &'static str,
        geo: &KvGeometry,
        q: DevSlice<T>,
        summaries: DevSlice<T>,
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
            let num_host = rows("summaries", summaries.len(), &[h, 2, d])?;
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
                    q, summaries, codes, blk_indptr, blk_indices, scores,
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
            let smem = score_blocks_codes_smem_bytes(geo.group_size(), d, std::mem::size_of::<T>());
            // SAFETY: lengths checked above (summaries and codes have num_host rows); the kernel
            // bounds-checks block ids and each blk_indptr row against nnz (an entry outside a
            // well-formed row scores -inf) and only reads blk_indptr[0..=num_seqs]; `smem` is the
            // kernel's layout and launch() checks it against the device limit; reachability and
            // lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, SCORE_CODES_THREADS, smem, stream, &params) }
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
            // SAFETY: k <= MAX_TOPK and m + successors <= MAX_CANDIDATES (its static buffers);
            // lengths checked above (the kernel reads cand and forced only below m and
            // n_forced, scores at the rows of m entries); blk_indptr rows are only subtracted;
            // reachability and lifetime by DevSlice's contract, the stream by Stream's.
            unsafe {
                self.queue(
                    "topk_candidates_f32",
                    grid,
                    TOPK_THREADS,
                    0,
                    stream,
                    &params,
                )
            }
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

    /// GPU twin of `oasis_core::kernels::rms_norm`: HF RMSNorm of `n` rows of `hidden =
    /// weight.len()` elements (`x` holds them `x_stride` apart: a row-strided view whose slice
    /// ends with the last row), with the optional fused residual add. Bit-identical to the twin
    /// (the block's size is `rms_norm_threads(hidden)`, which fixes the order of the sum). One
    /// block per row.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape, an empty weight,
    /// a row stride below `hidden`, or a residual output that overlaps the residual without
    /// being the same buffer.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm<T: KvElem>(
        &self,
        x: DevSlice<T>, // [n, x_stride] rows of hidden elements
        x_stride: usize,
        weight: DevSlice<T>, // [hidden]
        eps: f32,
        residual: Option<ResidualDev<T>>,
        out: DevSlice<T>, // [n, hidden]
        stream: Stream,
    ) -> Result<()> {
        guard("rms_norm", || {
            let hidden = weight.len();
            if hidden == 0 {
                return Err(OasisError::Config(
                    "rms_norm needs a non-empty weight (hidden > 0)".into(),
                )
                .into());
            }
            let n = rows("out", out.len(), &[hidden])?;
            check_rows("x", x.len(), n, x_stride, hidden)?;
            let (res, res_out) = match residual {
                Some(ResidualDev {
                    residual,
                    residual_out,
                }) => {
                    check_len("residual", residual.len(), &[n, hidden])?;
                    check_len("residual_out", residual_out.len(), &[n, hidden])?;
                    let bytes = (n * hidden * std::mem::size_of::<T>()) as u64;
                    let (a, b) = (residual.ptr(), residual_out.ptr());
                    if a != b && a < b + bytes && b < a + bytes {
                        return Err(OasisError::Invalid(
                            "residual_out overlaps residual without being the same buffer".into(),
                        )
                        .into());
                    }
                    (residual.into(), residual_out.into())
                }
                None => (DevPtr::NULL, DevPtr::NULL),
            };
            let name = entry!(T, "rms_norm");
            let x_stride = i64::try_from(x_stride)
                .map_err(|_| CudaError::Unsupported("x_stride does not fit i64".into()))?;
            let params = params!(RmsNormParams {
                ptr: { x, weight, residual = res, residual_out = res_out, out },
                int: { hidden },
                raw: { x_stride, eps },
            });
            let grid = grid_x("n", n)?;
            let threads = rms_norm_threads(hidden) as u32;
            // SAFETY: every buffer has the length its shape needs (checked above: x spans n rows
            // x_stride apart); by DevSlice's contract they are reachable and alive until the
            // stream runs the kernel and outputs overlap no other argument, except residual_out,
            // which may be residual itself (checked: identical or disjoint), which the kernel
            // handles (each element read before the same thread writes it); the stream by
            // Stream's contract.
            unsafe { self.queue(name, grid, threads, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::wait_stamp`: one thread stamps the device's global
    /// nanosecond timer into `stamps` (`[start, total waited, waits]`, u64) when the stream
    /// reaches it. Queued just before and just after a wait on background work, the pair times it.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] unless `stamps` has 3 elements.
    pub fn wait_stamp(
        &self,
        stamps: DevSlice<u64>,
        stamp: WaitStamp,
        stream: Stream,
    ) -> Result<()> {
        guard("wait_stamp", || {
            check_len("stamps", stamps.len(), &[3])?;
            let params = params!(WaitStampParams {
                ptr: { stamps },
                raw: { mode = stamp.mode(), _pad0 = 0 },
            });
            // SAFETY: stamps holds the 3 u64 the kernel reads and writes (checked above), reachable
            // and alive until the stream runs it by DevSlice's contract; the stream by Stream's.
            unsafe { self.queue("wait_stamp", (1, 1, 1), 32, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::qk_norm_rope`: from the fused QKV projection (`n =
    /// positions.len()` rows of `layout.width()` elements, `qkv_stride` apart), write `q_out`,
    /// `k_out` (optionally RMS-normalised per head with `norm = (q_weight, k_weight)`, then
    /// rotate-half RoPE at `positions`, read on the device) and `v_out` (a copy). Bit-identical to
    /// the twin, including its `kv_groups` row order of `k_out` / `v_out`. One block of
    /// [`QK_ROPE_WARPS`] warps per row and group of heads.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a layout the twin rejects or a buffer whose size does not match
    /// its shape; [`CudaError::Unsupported`] for a head_dim whose shared memory does not fit.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope<T: KvElem>(
        &self,
        layout: &HeadLayout,
        qkv: DevSlice<T>, // [n, qkv_stride] rows of (num_heads + 2 num_kv_heads) head_dim
        qkv_stride: usize,
        positions: PositionsDev,                  // [n]
        inv_freq: DevSlice<f32>,                  // [head_dim / 2]
        norm: Option<(DevSlice<T>, DevSlice<T>)>, // q_norm, k_norm [head_dim]
        eps: f32,
        q_out: DevSlice<T>, // [n, num_heads, head_dim]
        k_out: DevSlice<T>, // [n, num_kv_heads, head_dim]
        v_out: DevSlice<T>, // [n, num_kv_heads, head_dim]
        kv_groups: usize,
        stream: Stream,
    ) -> Result<()> {
        guard("qk_norm_rope", || {
            layout.validate()?;
            let HeadLayout {
                num_heads: hq,
                num_kv_heads: hkv,
                head_dim: d,
            } = *layout;
            let n = positions.len();
            check_rows("qkv", qkv.len(), n, qkv_stride, layout.width())?;
            check_len("inv_freq", inv_freq.len(), &[d / 2])?;
            if let Some((qw, kw)) = norm {
                check_len("q_norm", qw.len(), &[d])?;
                check_len("k_norm", kw.len(), &[d])?;
            }
            check_len("q_out", q_out.len(), &[n, hq, d])?;
            check_len("k_out", k_out.len(), &[n, hkv, d])?;
            check_len("v_out", v_out.len(), &[n, hkv, d])?;
            check_kv_groups(n, kv_groups)?;

            let (p64, p32) = match positions {
                PositionsDev::I64(p) => (p.into(), DevPtr::NULL),
                PositionsDev::I32(p) => (DevPtr::NULL, p.into()),
            };
            let name = entry!(T, "qk_norm_rope");
            let qkv_stride = i64::try_from(qkv_stride)
                .map_err(|_| CudaError::Unsupported("qkv_stride does not fit i64".into()))?;
            let params = params!(QkNormRopeParams {
                ptr: {
                    qkv, positions_i64 = p64, positions_i32 = p32, inv_freq,
                    q_norm = norm.map(|(q, _)| q), k_norm = norm.map(|(_, k)| k), q_out, k_out,
                    v_out,
                },
                int: { num_heads = hq, num_kv_heads = hkv, head_dim = d, kv_groups },
                raw: { qkv_stride, eps, num_rows = int("n", n)? },
            });
            let heads = hq + 2 * hkv; // fits i32: HeadLayout::validate
            let grid = (
                grid_dim("n", n, GRID_X_MAX)?,
                grid_dim(
                    "head groups",
                    heads.div_ceil(QK_ROPE_WARPS as usize),
                    GRID_YZ_MAX,
                )?,
                1,
            );
            let smem = qk_norm_rope_smem_bytes(d);
            // SAFETY: every buffer has the length its shape needs (checked above); exactly one
            // positions pointer is set, and the norm weights are both set or both null, as the
            // kernel expects; reachability, lifetime and disjoint outputs by DevSlice's contract;
            // the stream by Stream's contract.
            unsafe { self.queue(name, grid, QK_ROPE_WARPS * 32, smem, stream, &params) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_tile_shrinks_for_small_batches_only() {
        // The H200 (132 SMs), 8 KV heads, 160 candidates per sequence.
        let tile = |seqs: usize| score_codes_tile(seqs * 160, 8, 132);
        assert_eq!(tile(64), 32); // 2560 warps of 32 entries: enough
        assert_eq!(tile(32), 16);
        assert_eq!(tile(16), 8);
        assert_eq!(tile(1), 8); // never below 8
        for (n, h, sms) in [
            (0, 0, 0),
            (usize::MAX, usize::MAX, usize::MAX),
            (1, 1, 1),
            (7, 3, 0),
        ] {
            let t = score_codes_tile(n, h, sms);
            assert!([8, 16, 32].contains(&t), "{n} {h} {sms}: {t}");
        }
        // The tile chosen gives the warps asked for whenever some tile does.
        for n in [100, 1000, 5000, 20000, 100000] {
            let t = score_codes_tile(n, 8, 132);
            let want = SCORE_CODES_WARPS_PER_SM * 132;
            assert!(n.div_ceil(t) * 8 >= want || t == 8, "{n}: {t}");
            assert!(
                t == SCORE_CODES_TILE || n.div_ceil(t * 2) * 8 < want,
                "{n}: {t} is shorter than needed"
            );
        }
    }

    #[test]
    fn gather_stage_fits_shared_memory() {
        let l = GatherLaunch {
            max_blocks: 4,
            warps_per_block: 4,
            entries_per_warp: 32,
            stage_entries: 6,
        };
        // bf16 blocks of 16 x 128: 4 KiB of K per entry; 6 x 2 x 4 KiB x 4 warps = 192 KiB fits
        // the H200's 227 KiB.
        assert_eq!(l.stage_for(4096, 227 * 1024), 6);
        // f32 blocks of 32 x 128 (16 KiB of K, 32 KiB with V): one entry per warp fits.
        assert_eq!(l.stage_for(16384, 227 * 1024), 1);
        // Nothing fits, or an entry not a multiple of 16 bytes: the register path.
        assert_eq!(l.stage_for(64 * 1024, 227 * 1024), 0);
        assert_eq!(l.stage_for(4104, 227 * 1024), 0);
        let registers = GatherLaunch {
            stage_entries: 0,
            ..l
        };
        assert_eq!(registers.stage_for(4096, 227 * 1024), 0);
        // The default stages on the H200, and fits an A100's 163 KiB with fewer entries.
        assert_eq!(GatherLaunch::DEFAULT.stage_for(4096, 227 * 1024), 6);
        assert_eq!(GatherLaunch::DEFAULT.stage_for(4096, 163 * 1024), 5);
        let mut bad = l;
        bad.stage_entries = MAX_STAGE_ENTRIES + 1;
        assert!(set_gather_launch(bad).is_err());
    }

    #[test]
    fn split_planning() {
        // One long sequence, 8 KV heads, 132 SMs (264 block slots): 30 splits fill 240 of them
        // (over 90%), 4096 pages allow that.
        assert_eq!(plan_num_splits(132, 1, 8, 4096), 30);
        // Batch 16 at 16K tokens: 128 blocks fill half the slots, 2 splits fill 256 of 264
        // (3 would leave a second wave 45% full).
        assert_eq!(plan_num_splits(132, 16, 8, 1024), 2);
        // 300 blocks: a second wave 14% full unsplit; 4 splits give 1200 blocks in 5 waves.
        assert_eq!(plan_num_splits(132, 300, 1, 129), 4);
        // Short sequences never split below MIN_PAGES_PER_SPLIT pages.
        assert_eq!(plan_num_splits(132, 1, 8, 10), 1);
        assert_eq!(plan_num_splits(132, 1, 8, 16), 2);
        // A big batch fills the device alone.
        assert_eq!(plan_num_splits(132, 64, 8, 4096), 1);
        assert!(plan_num_splits(10_000, 1, 1, usize::MAX / 2) <= MAX_SPLITS);
    }

    /// Any arguments plan a count in 1..=MAX_SPLITS: no overflow, no division by zero (the
    /// planner is reachable from Python with arbitrary integers).
    #[test]
    fn split_planning_is_total() {
        let big = [
            0,
            1,
            7,
            132,
            1 << 40,
            usize::MAX / 2,
            usize::MAX - 1,
            usize::MAX,
        ];
        for &sms in &big {
            for &seqs in &big {
                for &heads in &[0, 1, 8, usize::MAX] {
                    for &pages in &big {
                        let n = plan_num_splits(sms, seqs, heads, pages);
                        assert!(
                            (1..=MAX_SPLITS).contains(&n),
                            "plan_num_splits({sms}, {seqs}, {heads}, {pages}) = {n}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn workspace_len_saturates() {
        assert_eq!(
            decode_attn_workspace_len(3, 2, 4, 64, 5),
            3 * 2 * 4 * 5 * 65
        );
        assert_eq!(decode_attn_workspace_len(0, 2, 4, 64, 5), 0);
        assert_eq!(
            decode_attn_workspace_len(1 << 40, 1 << 20, 64, 128, 256),
            usize::MAX
        );
        assert_eq!(
            decode_attn_workspace_len(1, 1, 1, usize::MAX, 2),
            usize::MAX
        );
    }

    /// Every kernel that reads a CSR table checks its rows in the kernel (the wrappers pass the
    /// indices' length as `nnz`): a malformed table reads as empty rows, never out of bounds.
    #[test]
    fn csr_tables_are_checked_in_the_kernels() {
        let (_, common) = crate::kernels::HEADERS[0];
        assert!(common.contains("bool csr_row("));
        for (source, uses) in [
            ("decode_attn", 2),
            // topk_blocks, force_scores, topk_candidates (which only bounds successors by its
            // rows' lengths: its wrapper passes i32::MAX, a malformed row reads as empty).
            ("score_blocks", 3),
            ("gather_blocks", 1),
        ] {
            let src = crate::kernels::source(source).unwrap().source;
            assert_eq!(src.matches("csr_row(").count(), uses, "{source}");
            assert!(src.contains("int nnz"), "{source} takes no nnz");
        }
        // score_blocks checks its rows inline (it walks them rather than indexing one).
        let src = crate::kernels::source("score_blocks").unwrap().source;
        assert_eq!(src.matches("seq_end <= nnz").count(), 1);
        assert_eq!(src.matches("row_e <= nnz").count(), 1);
        let src = crate::kernels::source("key_codes").unwrap().source;
        assert!(src.contains("row_e <= nnz"), "key_codes checks its rows");
        assert!(src.contains("int nnz"), "key_codes takes no nnz");
    }

    #[test]
    fn tensor_core_variants() {
        // Qwen3-8B shapes: head_dim 128, 3 stages of 8 KiB per warp, two blocks per SM fit the
        // 227 KiB of an H100/H200.
        assert_eq!(decode_attn_tc_stages(128), Some(3));
        let b = decode_attn_tc_smem_bytes(128, 3);
        assert_eq!(b, 4 * 3 * 8192 + 8 * 513 + 512 + 144);
        assert!(DECODE_TC_BLOCKS_PER_SM * (b + 1024) <= 227 * 1024);
        assert!(decode_attn_tc_smem_bytes(256, 2) <= 227 * 1024);
        assert_eq!(decode_attn_tc_stages(96), None);
        assert_eq!(
            decode_attn_tc_entry::<half::bf16>(64),
            Some(("decode_attn_tc_bf16_d64", 4))
        );
        assert_eq!(decode_attn_tc_entry::<f32>(128), None);
        let src = crate::kernels::source("decode_attn").unwrap().source;
        assert!(src.contains(&format!("#define OASIS_TC_LIST_CAP {DECODE_TC_LIST_CAP}\n")));
        // The launch gives it DECODE_THREADS threads: 4 warps.
        assert!(src.contains("#define OASIS_TC_WARPS 4\n"));
        assert_eq!(DECODE_THREADS, 4 * 32);
        for d in [64, 128, 256] {
            let st = decode_attn_tc_stages(d).unwrap();
            for (t, ty) in [("bf16", "bf16"), ("f16", "f16")] {
                let inst = format!("(decode_attn_tc_{t}_d{d}, oasis::{ty}, {d}, {st})");
                assert!(src.contains(&inst), "{inst} not in decode_attn.cu");
            }
        }
        for d in [64, 128, 256] {
            for name in [
                decode_attn_tc_entry::<half::bf16>(d),
                decode_attn_tc_entry::<half::f16>(d),
            ] {
                let (name, _) = name.unwrap();
                assert!(
                    crate::kernels::source_of(name).is_some(),
                    "{name} not registered"
                );
            }
        }
    }

    #[test]
    fn shared_memory_sizes() {
        // Qwen3-8B shapes, 2 rows: 8 query vectors, head_dim 128, a 32-token tile.
        let b = decode_attn_smem_bytes(8, 128, 32);
        assert_eq!(
            b,
            4 * (8 * 129 + 32 * 129 + 32 * 128 + 8 * 32 + 8 * 128 + 16)
        );
        assert!(b <= DECODE_SMEM_TARGET);
        assert_eq!(
            delta_select_smem_bytes(100, 20),
            8 * 128 + 4 * 128 + 4 * 100 + 4 * 32
        );
        assert!(delta_select_smem_bytes(MAX_SELECT_BUDGET, MAX_SELECT_BUDGET) <= 227 * 1024);
    }

    #[test]
    fn sizes_and_limits() {
        assert_eq!(rows("x", 12, &[3, 2]).unwrap(), 2);
        assert!(rows("x", 13, &[3, 2]).is_err());
        assert!(rows("x", 0, &[0]).is_err());
        assert_eq!(csr_rows("p", 3).unwrap(), 2);
        assert!(csr_rows("p", 0).is_err());
        assert!(int("n", 1 << 31).is_err());
        assert!(grid_dim("y", 65536, GRID_YZ_MAX).is_err());
        assert_eq!(row_threads(64), 64);
        assert_eq!(row_threads(54), 64);
        assert_eq!(row_threads(256), ROW_THREADS);
        assert_eq!(row_threads(1), 32);
    }

    #[test]
    fn entry_names_follow_the_dtype() {
        assert_eq!(entry!(half::bf16, "gather_blocks"), "gather_blocks_bf16");
        assert_eq!(entry!(half::f16, "gather_blocks"), "gather_blocks_f16");
        assert_eq!(entry!(f32, "gather_blocks"), "gather_blocks_f32");
        for name in [
            "append_kv_bf16",
            "decode_attn_f16",
            "merge_attn_states_f32",
            "score_blocks_bf16",
        ] {
            assert!(
                crate::kernels::source_of(name).is_some(),
                "{name} not registered"
            );
        }
    }

    /// The kernel-side limits are defined once (oasis_core::limits): NVRTC passes them to every
    /// source, and no source defines them itself.
    #[test]
    fn limits_reach_the_kernels_as_defines() {
        let options = crate::nvrtc::compile_options("sm_90");
        for (name, value, source) in [
            ("OASIS_MAX_TOPK", MAX_TOPK, "score_blocks"),
            ("OASIS_CAND_MAX", MAX_CANDIDATES, "score_blocks"),
            ("OASIS_MAX_SELECT_BUDGET", MAX_SELECT_BUDGET, "delta_select"),
        ] {
            assert!(
                options.contains(&format!("-D{name}={value}")),
                "{name}: {options:?}"
            );
            let src = crate::kernels::source(source).unwrap().source;
            assert!(
                src.contains(&format!("#ifndef {name}\n")),
                "{source} guards {name}"
            );
            for s in crate::kernels::SOURCES {
                assert!(
                    !s.source.contains(&format!("#define {name} ")),
                    "{} defines {name} again",
                    s.file
                );
            }
        }
    }

    /// The launch constants repeated from the kernels' `#define`s agree with them.
    #[test]
    fn constants_match_the_kernel_sources() {
        let define = |source: &str, name: &str| -> usize {
            let src = crate::kernels::source(source).unwrap().source;
            let line = src
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap();
            line.split_whitespace().nth(2).unwrap().parse().unwrap()
        };
        assert_eq!(
            define("score_blocks", "OASIS_SCORE_THREADS"),
            SCORE_THREADS as usize
        );
        assert_eq!(
            define("score_blocks", "OASIS_TOPK_THREADS"),
            TOPK_THREADS as usize
        );
        assert_eq!(
            define("delta_select", "OASIS_SELECT_THREADS"),
            SELECT_THREADS as usize
        );
        assert_eq!(define("score_blocks", "OASIS_SCORE_TILE"), SCORE_TILE);
        assert_eq!(
            define("key_codes", "OASIS_CODES_BUILD_THREADS"),
            CODES_BUILD_THREADS as usize
        );
        assert_eq!(
            define("key_codes", "OASIS_CODES_THREADS"),
            SCORE_CODES_THREADS as usize
        );
        assert_eq!(define("key_codes", "OASIS_CODES_TILE"), SCORE_CODES_TILE);
        assert_eq!(
            define("delta_select", "OASIS_SELECT_WARP_THREADS"),
            SELECT_WARP_THREADS as usize
        );
        assert_eq!(
            define("delta_select", "OASIS_SELECT_WARP_MAX"),
            SELECT_WARP_MAX
        );
        assert_eq!(
            define("gather_blocks", "OASIS_COPY_THREADS"),
            COPY_THREADS as usize
        );
        assert_eq!(
            define("norm_rope", "OASIS_QK_ROPE_WARPS"),
            QK_ROPE_WARPS as usize
        );
    }
}
