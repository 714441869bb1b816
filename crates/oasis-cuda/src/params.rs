//! Kernel launch parameters: one `#[repr(C)]` struct per kernel family, the only parameter of
//! its kernels, mirrored field for field by the C struct of the same name in
//! `cuda/oasis_params.cuh`.
//!
//! ```text
//! ops::Gpu::append_kv (checks shapes) ──fills──▶ AppendKvParams ──launch(&p)──▶ cuLaunchKernel
//!                                                      ║ same layout (tests/params_layout.rs)
//!  append_kv_bf16(const __grid_constant__ oasis::AppendKvParams<oasis::bf16> p)  (cuda/*.cu)
//! ```
//!
//! A launch passes one pointer to the struct (`kernelParams = {&p}`), and the driver copies its
//! `size_of::<P>()` bytes into the kernel's parameter space. So the two layouts must agree byte
//! for byte, which nothing at compile time can check across the two languages; instead:
//!
//! - [`KernelParams::LAYOUT`] describes each struct (size, alignment, every field's offset, size
//!   and [`FieldKind`]) from `size_of` / `offset_of!`, and the integration test
//!   `tests/params_layout.rs` compiles `cuda/oasis_params.cuh` with NVRTC into a probe whose
//!   `sizeof` / `alignof` / `offsetof` values it reads back from the PTX and compares, field by
//!   field, with it; it also checks that every entry point takes exactly its struct;
//! - [`Gpu::launch`](crate::Gpu) only accepts a struct for the kernels its layout names
//!   ([`ParamsLayout::kernels`]), so a wrapper cannot hand one kernel another kernel's struct.
//!
//! Layout rules (both sides): 8-byte pointers ([`DevPtr`]), `i32`, `i64`, `f32` fields only;
//! pointers first, then 8-byte scalars, then 4-byte ones; no implicit padding (an explicit
//! `_pad0: i32` where the size would not be a multiple of 8). A pointer field carries its shape
//! comment; it may be null only where the comment says so.

use cudarc::driver::DeviceRepr;

use crate::ops::DevSlice;

/// A device-visible address as a kernel parameter (`T*` / `const T*` in the C struct): device
/// memory, or pinned host memory mapped at the same address (UVA). 0 is the null pointer.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DevPtr(pub u64);

impl DevPtr {
    /// The null pointer, for the fields that allow it.
    pub const NULL: DevPtr = DevPtr(0);
}

impl<T> From<DevSlice<T>> for DevPtr {
    fn from(s: DevSlice<T>) -> Self {
        DevPtr(s.ptr())
    }
}

impl<T> From<Option<DevSlice<T>>> for DevPtr {
    /// `None` is the null pointer.
    fn from(s: Option<DevSlice<T>>) -> Self {
        s.map_or(DevPtr::NULL, DevPtr::from)
    }
}

/// The C type of one parameter field, as the layout test compares it (so that an `int` and a
/// `float` at the same offset are told apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    /// A pointer (`T*`, `const T*`), [`DevPtr`] in Rust.
    Ptr,
    /// `int`, `i32`.
    I32,
    /// `long long`, `i64`.
    I64,
    /// `float`, `f32`.
    F32,
}

/// A Rust type allowed as a parameter field, with its [`FieldKind`].
pub trait ParamField {
    /// Its C counterpart.
    const KIND: FieldKind;
}

impl ParamField for DevPtr {
    const KIND: FieldKind = FieldKind::Ptr;
}
impl ParamField for i32 {
    const KIND: FieldKind = FieldKind::I32;
}
impl ParamField for i64 {
    const KIND: FieldKind = FieldKind::I64;
}
impl ParamField for f32 {
    const KIND: FieldKind = FieldKind::F32;
}

/// One field of a parameter struct.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldLayout {
    /// Field name, the same in Rust and C.
    pub name: &'static str,
    /// `offset_of!` in bytes.
    pub offset: usize,
    /// `size_of` of the field's type in bytes.
    pub size: usize,
    /// The C type it stands for.
    pub kind: FieldKind,
}

/// The layout of a parameter struct, as Rust computes it, and the C type it mirrors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamsLayout {
    /// The Rust type name (`"AppendKvParams"`).
    pub name: &'static str,
    /// The C type; `T` stands for the storage type of a kernel family
    /// (`"oasis::AppendKvParams<T>"`: `oasis::bf16`, `oasis::f16` or `float`).
    pub c_type: &'static str,
    /// `size_of` in bytes.
    pub size: usize,
    /// `align_of` in bytes.
    pub align: usize,
    /// Every field, in declaration order.
    pub fields: &'static [FieldLayout],
    /// Every entry point that takes this struct as its only parameter.
    pub kernels: &'static [&'static str],
}

impl ParamsLayout {
    /// The C type for the kernel `entry`, with `T` replaced by the storage type its name carries
    /// (`_bf16` -> `oasis::bf16`, `_f16` -> `oasis::f16`, `_f32` -> `float`).
    pub fn c_type_for(&self, entry: &str) -> String {
        if !self.c_type.contains("<T>") {
            return self.c_type.to_string();
        }
        let t = if entry.contains("_bf16") {
            "oasis::bf16"
        } else if entry.contains("_f16") {
            "oasis::f16"
        } else {
            "float"
        };
        self.c_type.replace("<T>", &format!("<{t}>"))
    }
}

/// A kernel parameter struct: what [`Gpu::launch`](crate::Gpu) passes, by one pointer, as the
/// only parameter of the kernels in `LAYOUT.kernels`.
///
/// # Safety
/// Implementors promise that
/// 1. the type is `#[repr(C)]`, with the size, alignment and field offsets that [`Self::LAYOUT`]
///    states, and has no padding bytes (every byte belongs to a field, so every byte the driver
///    copies is initialised);
/// 2. its layout is that of the C struct `LAYOUT.c_type` of `cuda/oasis_params.cuh`, and every
///    kernel in `LAYOUT.kernels` takes exactly one parameter of that C type (checked by
///    `tests/params_layout.rs`);
/// 3. every field is plain data (an address, an integer, a float): any bit pattern is a valid
///    value, and copying the bytes to the device is all a launch needs.
pub unsafe trait KernelParams: DeviceRepr + Copy + 'static {
    /// The layout, from `size_of` / `offset_of!`.
    const LAYOUT: ParamsLayout;
}

/// Define a parameter struct, its [`KernelParams`] layout and its [`DeviceRepr`] marker. Fields
/// are `DevPtr`, `i32`, `i64` or `f32` (the [`ParamField`] bound rejects anything else).
macro_rules! kernel_params {
    (
        $(#[$meta:meta])*
        pub struct $name:ident => $c_type:literal for [$($kernel:literal),+ $(,)?] {
            $( $(#[$fmeta:meta])* pub $field:ident: $ty:ty, )+
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default, PartialEq)]
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )+
        }

        // SAFETY: #[repr(C)] plain data (DevPtr / i32 / i64 / f32 fields), no padding (checked by
        // the unit tests of this module), so its bytes are a valid kernel parameter; the C side
        // is checked by tests/params_layout.rs.
        unsafe impl DeviceRepr for $name {}

        // SAFETY: LAYOUT is computed from size_of / align_of / offset_of! of this very type;
        // obligations 1 (no padding) and 2 (the C mirror, the entry points) are checked by the
        // unit tests below and by tests/params_layout.rs; 3 by the field types.
        unsafe impl KernelParams for $name {
            const LAYOUT: ParamsLayout = ParamsLayout {
                name: stringify!($name),
                c_type: $c_type,
                size: std::mem::size_of::<$name>(),
                align: std::mem::align_of::<$name>(),
                fields: &[$(FieldLayout {
                    name: stringify!($field),
                    offset: std::mem::offset_of!($name, $field),
                    size: std::mem::size_of::<$ty>(),
                    kind: <$ty as ParamField>::KIND,
                }),+],
                kernels: &[$($kernel),+],
            };
        }
    };
}

kernel_params! {
    /// `append_kv_*` (cuda/append_kv.cu): one token per sequence into its page, written through
    /// to the host pool and the summaries for sparse sequences.
    pub struct AppendKvParams => "oasis::AppendKvParams<T>"
        for ["append_kv_bf16", "append_kv_f16", "append_kv_f32"] {
        pub k_new: DevPtr,          // [num_seqs, num_kv_heads, head_dim]
        pub v_new: DevPtr,          // [num_seqs, num_kv_heads, head_dim]
        pub page_ids: DevPtr,       // [num_seqs]
        pub page_offsets: DevPtr,   // [num_seqs] 0..block_size
        pub host_block_ids: DevPtr, // [num_seqs] < 0 = dense (no write-through)
        pub host_rows: DevPtr,      // [num_seqs] host row of the write-through, or null (the id)
        pub k_pages: DevPtr,        // [num_pages, num_kv_heads, block_size, head_dim]
        pub v_pages: DevPtr,        // [num_pages, num_kv_heads, block_size, head_dim]
        pub host_k: DevPtr,         // [num_host_rows, num_kv_heads, block_size, head_dim] pinned
        pub host_v: DevPtr,         // [num_host_rows, num_kv_heads, block_size, head_dim] pinned
        pub summaries: DevPtr,      // [num_host_blocks, num_kv_heads, 2, head_dim]
        pub num_kv_heads: i32,
        pub head_dim: i32,
        pub block_size: i32,
        pub num_pages: i32,
        pub num_host_blocks: i32,
        pub num_host_rows: i32,
    }
}

kernel_params! {
    /// `build_summaries_*` (cuda/append_kv.cu): min/max summaries of whole host blocks.
    pub struct BuildSummariesParams => "oasis::BuildSummariesParams<T>"
        for ["build_summaries_bf16", "build_summaries_f16", "build_summaries_f32"] {
        pub host_k: DevPtr,     // [num_host_rows, num_kv_heads, block_size, head_dim]
        pub block_ids: DevPtr,  // [n]
        pub block_rows: DevPtr, // [n] host row of each block, or null (the id)
        pub block_lens: DevPtr, // [n] 1..=block_size
        pub summaries: DevPtr,  // [num_host_blocks, num_kv_heads, 2, head_dim]
        pub num_kv_heads: i32,
        pub head_dim: i32,
        pub block_size: i32,
        pub num_host_blocks: i32,
        pub num_host_rows: i32,
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `decode_attn_*` and `decode_attn_tc_*` (cuda/decode_attn.cu; the tensor-core kernels
    /// ignore `head_dim`, their template parameter, and `tile_tokens`).
    pub struct DecodeAttnParams => "oasis::DecodeAttnParams<T>"
        for [
            "decode_attn_bf16",
            "decode_attn_f16",
            "decode_attn_f32",
            "decode_attn_tc_bf16_d64",
            "decode_attn_tc_bf16_d128",
            "decode_attn_tc_bf16_d256",
            "decode_attn_tc_f16_d64",
            "decode_attn_tc_f16_d128",
            "decode_attn_tc_f16_d256",
        ] {
        pub q: DevPtr,                // [num_seqs, num_rows, num_qo_heads, head_dim]
        pub k_pages: DevPtr,          // [num_pages, num_kv_heads, block_size, head_dim]
        pub v_pages: DevPtr,          // [num_pages, num_kv_heads, block_size, head_dim]
        pub kv_indptr: DevPtr,        // [num_seqs + 1] CSR over kv_indices
        pub kv_indices: DevPtr,       // [nnz] GPU page ids, in sequence order
        pub kv_last_page_len: DevPtr, // [num_seqs] 1..=block_size
        pub page_map: DevPtr,         // [num_pages, num_kv_heads] or null (every entry valid)
        pub extra_k: DevPtr,          // [num_seqs, num_kv_heads, head_dim] or null
        pub extra_v: DevPtr,          // [num_seqs, num_kv_heads, head_dim] or null
        pub out: DevPtr,              // [num_seqs, num_rows, num_qo_heads, head_dim]
        pub tmp_out: DevPtr, // [num_seqs, num_rows, num_qo_heads, num_splits, head_dim] or null
        pub tmp_lse: DevPtr, // [num_seqs, num_rows, num_qo_heads, num_splits] or null
        pub num_rows: i32,
        pub num_qo_heads: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32,
        pub block_size: i32,
        pub num_pages: i32,
        pub nnz: i32, // kv_indices' length: every kv_indptr row is checked against it
        pub num_splits: i32,
        pub tile_tokens: i32, // 1..=32 (generic kernel); 0 for the tensor-core kernels
        pub sm_scale: f32,
    }
}

kernel_params! {
    /// `merge_attn_states_*` (cuda/decode_attn.cu): the split-KV merge.
    pub struct MergeAttnStatesParams => "oasis::MergeAttnStatesParams<T>"
        for ["merge_attn_states_bf16", "merge_attn_states_f16", "merge_attn_states_f32"] {
        pub tmp_out: DevPtr, // [num_heads_total, num_splits, head_dim] f32
        pub tmp_lse: DevPtr, // [num_heads_total, num_splits] f32
        pub out: DevPtr,     // [num_heads_total, head_dim]
        pub num_splits: i32,
        pub head_dim: i32,
    }
}

kernel_params! {
    /// `score_blocks_*` (cuda/score_blocks.cu): Quest scores of every listed block summary.
    pub struct ScoreBlocksParams => "oasis::ScoreBlocksParams<T>"
        for ["score_blocks_bf16", "score_blocks_f16", "score_blocks_f32"] {
        pub q: DevPtr,           // [num_seqs, num_qo_heads, head_dim]
        pub summaries: DevPtr,   // [num_host_blocks, num_kv_heads, 2, head_dim]
        pub blk_indptr: DevPtr,  // [num_seqs + 1]
        pub blk_indices: DevPtr, // [nnz]
        pub scores: DevPtr,      // [nnz, num_kv_heads] f32
        pub num_seqs: i32,
        pub nnz: i32,
        pub num_qo_heads: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32,
        pub num_host_blocks: i32,
    }
}

kernel_params! {
    /// `score_blocks_bound8_*` and `score_blocks_bound8_tc_*` (cuda/score_blocks.cu): Quest scores
    /// over the 8-bit bounds
    /// (`oasis_core::kernels::bound8`), times each row's scale.
    pub struct ScoreBlocksBound8Params => "oasis::ScoreBlocksBound8Params<T>"
        for [
            "score_blocks_bound8_bf16",
            "score_blocks_bound8_f16",
            "score_blocks_bound8_f32",
            "score_blocks_bound8_tc_bf16",
            "score_blocks_bound8_tc_f16",
            "score_blocks_bound8_tc_f32",
        ] {
        pub q: DevPtr,           // [num_seqs, num_qo_heads, head_dim]
        pub bounds8: DevPtr,     // [num_host_blocks, num_kv_heads, 2, head_dim] u8 (E4M3)
        pub scales: DevPtr,      // [num_host_blocks, num_kv_heads] f32
        pub blk_indptr: DevPtr,  // [num_seqs + 1]
        pub blk_indices: DevPtr, // [nnz]
        pub scores: DevPtr,      // [nnz, num_kv_heads] f32
        pub num_seqs: i32,
        pub nnz: i32,
        pub num_qo_heads: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32,
        pub num_host_blocks: i32,
    }
}

kernel_params! {
    /// `build_bounds8_*` (cuda/key_codes.cu): the 8-bit bounds of whole host blocks.
    pub struct BuildBounds8Params => "oasis::BuildBounds8Params<T>"
        for ["build_bounds8_bf16", "build_bounds8_f16", "build_bounds8_f32"] {
        pub summaries: DevPtr, // [num_host_blocks, num_kv_heads, 2, head_dim]
        pub block_ids: DevPtr, // [n]
        pub bounds8: DevPtr,   // [num_host_blocks, num_kv_heads, 2, head_dim] u8
        pub scales: DevPtr,    // [num_host_blocks, num_kv_heads] f32
        pub n: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32,
        pub num_host_blocks: i32,
    }
}

kernel_params! {
    /// `build_key_codes_*` (cuda/key_codes.cu): 2-bit codes of every key of whole host blocks,
    /// inside each block's decoded 8-bit bound (`bounds8` and `scales` of `build_bounds8_*`).
    pub struct BuildKeyCodesParams => "oasis::BuildKeyCodesParams<T>"
        for ["build_key_codes_bf16", "build_key_codes_f16", "build_key_codes_f32"] {
        pub host_k: DevPtr,     // [num_host_rows, num_kv_heads, block_size, head_dim]
        pub bounds8: DevPtr,    // [num_host_blocks, num_kv_heads, 2, head_dim] u8 (E4M3)
        pub scales: DevPtr,     // [num_host_blocks, num_kv_heads] f32
        pub block_ids: DevPtr,  // [n]
        pub block_rows: DevPtr, // [n] host row of each block, or null (the id)
        pub codes: DevPtr,      // [num_host_blocks, num_kv_heads, block_size, head_dim / 4] u8
        pub n: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32, // a multiple of 4
        pub block_size: i32,
        pub num_host_blocks: i32,
        pub num_host_rows: i32,
    }
}

kernel_params! {
    /// `encode_blocks_*` (cuda/key_codes.cu): `build_bounds8` then `build_key_codes` (inside that
    /// bound) of the same blocks in one launch.
    pub struct EncodeBlocksParams => "oasis::EncodeBlocksParams<T>"
        for ["encode_blocks_bf16", "encode_blocks_f16", "encode_blocks_f32"] {
        pub host_k: DevPtr,     // [num_host_rows, num_kv_heads, block_size, head_dim]
        pub summaries: DevPtr,  // [num_host_blocks, num_kv_heads, 2, head_dim]
        pub block_ids: DevPtr,  // [n]
        pub block_rows: DevPtr, // [n] host row of each block, or null (the id)
        pub codes: DevPtr,      // [num_host_blocks, num_kv_heads, block_size, head_dim / 4] u8
        pub bounds8: DevPtr,    // [num_host_blocks, num_kv_heads, 2, head_dim] u8
        pub scales: DevPtr,     // [num_host_blocks, num_kv_heads] f32
        pub n: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32, // a multiple of 4
        pub block_size: i32,
        pub num_host_blocks: i32,
        pub num_host_rows: i32,
    }
}

kernel_params! {
    /// `score_blocks_codes_*` (cuda/key_codes.cu): the largest approximate logit of each listed
    /// block from its 2-bit key codes inside its 8-bit bound, summed over the GQA group.
    pub struct ScoreBlocksCodesParams => "oasis::ScoreBlocksCodesParams<T>"
        for ["score_blocks_codes_bf16", "score_blocks_codes_f16", "score_blocks_codes_f32"] {
        pub q: DevPtr,           // [num_seqs, num_qo_heads, head_dim]
        pub bounds8: DevPtr,     // [num_host_blocks, num_kv_heads, 2, head_dim] u8 (E4M3)
        pub scales: DevPtr,      // [num_host_blocks, num_kv_heads] f32
        pub codes: DevPtr,       // [num_host_blocks, num_kv_heads, block_size, head_dim / 4] u8
        pub blk_indptr: DevPtr,  // [num_seqs + 1]
        pub blk_indices: DevPtr, // [nnz]
        pub scores: DevPtr,      // [nnz, num_kv_heads] f32; with cand [num_seqs * cand_m, num_kv_heads]
        pub cand: DevPtr,        // [num_seqs, num_kv_heads, cand_m] i32 (< 0: none), or null
        pub num_seqs: i32,
        pub nnz: i32, // blk_indices' length: every blk_indptr row is checked against it
        pub num_qo_heads: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32, // a multiple of 4
        pub block_size: i32,
        pub num_host_blocks: i32,
        pub cand_m: i32, // candidates per (sequence, KV head) with cand; 0 without
        pub tile: i32,   // entries per warp (1..=SCORE_CODES_TILE): ops::score_codes_tile
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `topk_blocks_f32` (cuda/score_blocks.cu).
    pub struct TopkBlocksParams => "oasis::TopkBlocksParams" for ["topk_blocks_f32"] {
        pub scores: DevPtr,     // [nnz, num_kv_heads] f32 (written only with forced)
        pub blk_indptr: DevPtr, // [num_seqs + 1]
        pub out: DevPtr,        // [num_seqs, num_kv_heads, k]
        pub index_map: DevPtr,  // [num_seqs, num_kv_heads, map_m] i32, or null
        pub forced: DevPtr,     // [num_seqs, num_kv_heads, n_forced] i32, or null
        pub num_kv_heads: i32,
        pub nnz: i32,
        pub k: i32,
        pub map_m: i32,
        pub n_forced: i32,
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `force_scores_f32` (cuda/score_blocks.cu): forced entries of a score table set to +inf.
    pub struct ForceScoresParams => "oasis::ForceScoresParams" for ["force_scores_f32"] {
        pub scores: DevPtr,     // [nnz, num_kv_heads] f32, written in place
        pub blk_indptr: DevPtr, // [num_seqs + 1]
        pub forced: DevPtr,     // [num_seqs, num_kv_heads, n_forced] i32
        pub num_seqs: i32,
        pub num_kv_heads: i32,
        pub nnz: i32,
        pub n_forced: i32,
    }
}

kernel_params! {
    /// `topk_candidates_f32` (cuda/score_blocks.cu): the two-stage score's last top-k, with
    /// successors and forced blocks.
    pub struct TopkCandidatesParams => "oasis::TopkCandidatesParams" for ["topk_candidates_f32"] {
        pub scores: DevPtr,     // [num_seqs * m, num_kv_heads] f32
        pub cand: DevPtr,       // [num_seqs, num_kv_heads, m] i32
        pub blk_indptr: DevPtr, // [num_seqs + 1]
        pub forced: DevPtr,     // [num_seqs, num_kv_heads, n_forced] i32, or null
        pub out: DevPtr,        // [num_seqs, num_kv_heads, k] i32
        pub num_kv_heads: i32,
        pub nnz: i32,
        pub m: i32,
        pub k: i32,
        pub successors: i32,
        pub n_forced: i32,
    }
}

kernel_params! {
    /// `rescore_topk_codes_*` (cuda/key_codes.cu): the codes score of the candidates and the
    /// two-stage score's last top-k over them, in one launch.
    pub struct RescoreTopkCodesParams => "oasis::RescoreTopkCodesParams<T>"
        for ["rescore_topk_codes_bf16", "rescore_topk_codes_f16", "rescore_topk_codes_f32"] {
        pub q: DevPtr,           // [num_seqs, num_qo_heads, head_dim]
        pub bounds8: DevPtr,     // [num_host_blocks, num_kv_heads, 2, head_dim] u8 (E4M3)
        pub scales: DevPtr,      // [num_host_blocks, num_kv_heads] f32
        pub codes: DevPtr,       // [num_host_blocks, num_kv_heads, block_size, head_dim / 4] u8
        pub blk_indptr: DevPtr,  // [num_seqs + 1]
        pub blk_indices: DevPtr, // [nnz]
        pub cand: DevPtr,        // [num_seqs, num_kv_heads, m] i32 (< 0: none)
        pub forced: DevPtr,      // [num_seqs, num_kv_heads, n_forced] i32, or null
        pub out: DevPtr,         // [num_seqs, num_kv_heads, k] i32
        pub scratch: DevPtr,     // [num_seqs, num_kv_heads, m] f32
        pub counters: DevPtr,    // [num_seqs, num_kv_heads] i32, zero before and after
        pub nnz: i32, // blk_indices' length: the candidates' rows are checked against it
        pub num_qo_heads: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32, // a multiple of 4
        pub block_size: i32,
        pub num_host_blocks: i32,
        pub m: i32,
        pub k: i32,
        pub successors: i32,
        pub n_forced: i32,
        pub tile: i32, // candidates per warp; the grid's z blocks per (sequence, KV head)
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `delta_select_i32` and `delta_select_warp_i32` (cuda/delta_select.cu; only the warp
    /// kernel reads `num_seqs`).
    pub struct DeltaSelectParams => "oasis::DeltaSelectParams"
        for ["delta_select_i32", "delta_select_warp_i32"] {
        pub predicted: DevPtr,          // [num_seqs, num_kv_heads, num_pred]
        pub slot_pages: DevPtr,         // [num_seqs, budget]
        pub page_map: DevPtr,           // [num_pages, num_kv_heads]
        pub page_last_selected: DevPtr, // [num_pages, num_kv_heads]
        pub plan_slots: DevPtr,         // [num_seqs, num_kv_heads, fetch_cap]
        pub plan_blocks: DevPtr,        // [num_seqs, num_kv_heads, fetch_cap]
        pub stats: DevPtr,              // [num_seqs, num_kv_heads, 3] or null
        pub step_now: DevPtr,           // [1] or null (then `step`)
        pub num_kv_heads: i32,
        pub num_pred: i32,
        pub budget: i32,
        pub num_pages: i32,
        pub step: i32,
        pub fetch_cap: i32,
        pub num_seqs: i32,
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `gather_blocks_*` (cuda/gather_blocks.cu): a selection plan, host pool -> GPU slots.
    pub struct GatherBlocksParams => "oasis::GatherBlocksParams<T>"
        for ["gather_blocks_bf16", "gather_blocks_f16", "gather_blocks_f32"] {
        pub plan_slots: DevPtr,   // [num_seqs, num_kv_heads, fetch_cap]
        pub plan_blocks: DevPtr,  // [num_seqs, num_kv_heads, fetch_cap]
        pub slot_pages: DevPtr,   // [num_seqs, budget]
        pub host_indptr: DevPtr,  // [num_seqs + 1]
        pub host_indices: DevPtr, // [nnz]
        pub host_k: DevPtr,       // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned
        pub host_v: DevPtr,       // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned
        pub k_pages: DevPtr,      // [num_pages, num_kv_heads, block_size, head_dim]
        pub v_pages: DevPtr,      // [num_pages, num_kv_heads, block_size, head_dim]
        pub num_kv_heads: i32,
        pub fetch_cap: i32,
        pub budget: i32,
        pub block_size: i32,
        pub head_dim: i32,
        pub num_pages: i32,
        pub num_host_blocks: i32,
        pub nnz: i32,
        pub num_seqs: i32,
        pub entries_per_warp: i32, // 1-32
        pub stage_entries: i32,    // 0: through registers
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `copy_pages_*` (cuda/gather_blocks.cu): whole pages between two pools of one geometry.
    pub struct CopyPagesParams => "oasis::CopyPagesParams<T>"
        for ["copy_pages_bf16", "copy_pages_f16", "copy_pages_f32"] {
        pub src_k: DevPtr,   // [num_src_pages, num_kv_heads, block_size, head_dim]
        pub src_v: DevPtr,   // [num_src_pages, num_kv_heads, block_size, head_dim]
        pub src_ids: DevPtr, // [n]
        pub dst_k: DevPtr,   // [num_dst_pages, num_kv_heads, block_size, head_dim]
        pub dst_v: DevPtr,   // [num_dst_pages, num_kv_heads, block_size, head_dim]
        pub dst_ids: DevPtr, // [n]
        pub page_elems: i64, // num_kv_heads * block_size * head_dim
        pub num_src_pages: i32,
        pub num_dst_pages: i32,
    }
}

kernel_params! {
    /// `rms_norm_*` (cuda/norm_rope.cu): HF RMSNorm of rows, with an optional fused residual add.
    pub struct RmsNormParams => "oasis::RmsNormParams<T>"
        for ["rms_norm_bf16", "rms_norm_f16", "rms_norm_f32"] {
        pub x: DevPtr,            // [n, x_stride] rows of hidden elements
        pub weight: DevPtr,       // [hidden]
        pub residual: DevPtr,     // [n, hidden] or null
        pub residual_out: DevPtr, // [n, hidden], null exactly when residual is; may be residual
        pub out: DevPtr,          // [n, hidden]
        pub x_stride: i64,
        pub hidden: i32,
        pub eps: f32,
    }
}

kernel_params! {
    /// `silu_mul_*` (cuda/norm_rope.cu): the MLP's `silu(gate) * up` over the fused gate/up
    /// projection's rows.
    pub struct SiluMulParams => "oasis::SiluMulParams<T>"
        for ["silu_mul_bf16", "silu_mul_f16", "silu_mul_f32"] {
        pub gu: DevPtr,  // [n, 2 * inter]: gate columns, then up
        pub out: DevPtr, // [n, inter]
        pub n: i64,
        pub inter: i32,
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `wait_stamp` (cuda/wait_stamp.cu): the compute stream's waits on background work, timed.
    pub struct WaitStampParams => "oasis::WaitStampParams" for ["wait_stamp"] {
        pub stamps: DevPtr, // [3] u64: start of the current wait (ns), total waited (ns), waits
        pub mode: i32,      // 0: a wait starts; else it ended
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `wait_epoch` (cuda/wait_stamp.cu): hold a stream until a layer's landed epoch (a host
    /// word the coordinator's step reader writes) reaches the step's epoch, or a timeout passes.
    pub struct WaitEpochParams => "oasis::WaitEpochParams" for ["wait_epoch"] {
        pub landed: DevPtr,   // u64, host-mapped: the layer's landed epoch
        pub epoch: DevPtr,    // [1] i64: the step's epoch (on the device)
        pub stats: DevPtr,    // [4] u64: waits that gave up, the last one's epoch, ns held, waits
        pub timeout_ns: i64,
    }
}

kernel_params! {
    /// `qk_norm_rope_*` (cuda/norm_rope.cu): q, k, v from the fused QKV projection, with the
    /// optional per-head q/k RMSNorm and rotate-half RoPE.
    pub struct QkNormRopeParams => "oasis::QkNormRopeParams<T>"
        for ["qk_norm_rope_bf16", "qk_norm_rope_f16", "qk_norm_rope_f32"] {
        pub qkv: DevPtr,           // [n, qkv_stride] rows of (num_heads + 2 num_kv_heads) head_dim
        pub positions_i64: DevPtr, // [n] or null (then positions_i32)
        pub positions_i32: DevPtr, // [n] or null (then positions_i64)
        pub inv_freq: DevPtr,      // [head_dim / 2] f32
        pub q_norm: DevPtr,        // [head_dim] or null (no q/k norm)
        pub k_norm: DevPtr,        // [head_dim], null exactly when q_norm is
        pub q_out: DevPtr,         // [n, num_heads, head_dim]
        pub k_out: DevPtr,         // [n, num_kv_heads, head_dim]
        pub v_out: DevPtr,         // [n, num_kv_heads, head_dim]
        pub qkv_stride: i64,
        pub num_heads: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32, // even
        pub eps: f32,
        pub kv_groups: i32, // >= 1: k_out, v_out grouped by row within groups of this many rows
        pub num_rows: i32,  // n
        pub rope_scale: f32, // cos and sin times this (YaRN's attention factor; 1 otherwise)
        pub _pad0: i32,
    }
}

// ---- kv8 pages (oasis_core::kernels::kv8): a tier buffer that holds T pages or E4M3 codes
// depending on the kernel is untyped in C; its scales are null for a T tier.

kernel_params! {
    /// `append_kv_<gpu tier>_<host tier>_*` (cuda/append_kv.cu): [`AppendKvParams`] with each
    /// tier `T` pages (`elem`) or kv8 pages, as `oasis_core::kernels::append_kv_tiers`.
    pub struct AppendKvTiersParams => "oasis::AppendKvTiersParams<T>"
        for [
            "append_kv_kv8_kv8_bf16", "append_kv_kv8_kv8_f16", "append_kv_kv8_kv8_f32",
            "append_kv_elem_kv8_bf16", "append_kv_elem_kv8_f16", "append_kv_elem_kv8_f32",
            "append_kv_kv8_elem_bf16", "append_kv_kv8_elem_f16", "append_kv_kv8_elem_f32",
        ] {
        pub k_new: DevPtr,          // [num_seqs, num_kv_heads, head_dim]
        pub v_new: DevPtr,          // [num_seqs, num_kv_heads, head_dim]
        pub page_ids: DevPtr,       // [num_seqs]
        pub page_offsets: DevPtr,   // [num_seqs] 0..block_size
        pub host_block_ids: DevPtr, // [num_seqs] < 0 = dense (no write-through)
        pub host_rows: DevPtr,      // [num_seqs] host row of the write-through, or null (the id)
        pub k_pages: DevPtr,        // [num_pages, num_kv_heads, block_size, head_dim] T or codes
        pub v_pages: DevPtr,        // [num_pages, num_kv_heads, block_size, head_dim] T or codes
        pub k_scales: DevPtr,       // [num_pages, num_kv_heads] kv8 GPU tier, else null
        pub v_scales: DevPtr,       // [num_pages, num_kv_heads] kv8 GPU tier, else null
        pub host_k: DevPtr,         // [num_host_rows, num_kv_heads, block_size, head_dim] pinned
        pub host_v: DevPtr,         // [num_host_rows, num_kv_heads, block_size, head_dim] pinned
        pub host_k_scales: DevPtr,  // [num_host_rows, num_kv_heads] kv8 host tier, else null
        pub host_v_scales: DevPtr,  // [num_host_rows, num_kv_heads] kv8 host tier, else null
        pub summaries: DevPtr,      // [num_host_blocks, num_kv_heads, 2, head_dim]
        pub num_kv_heads: i32,
        pub head_dim: i32,
        pub block_size: i32,
        pub num_pages: i32,
        pub num_host_blocks: i32,
        pub num_host_rows: i32,
    }
}

kernel_params! {
    /// `gather_blocks_kv8` and `gather_blocks_<host tier>_<gpu tier>_*` (cuda/gather_blocks.cu):
    /// [`GatherBlocksParams`] with either tier kv8, as `oasis_core::kernels::gather_blocks_tiers`.
    pub struct GatherBlocksTiersParams => "oasis::GatherBlocksTiersParams"
        for [
            "gather_blocks_kv8",
            "gather_blocks_kv8_elem_bf16", "gather_blocks_kv8_elem_f16", "gather_blocks_kv8_elem_f32",
            "gather_blocks_elem_kv8_bf16", "gather_blocks_elem_kv8_f16", "gather_blocks_elem_kv8_f32",
        ] {
        pub plan_slots: DevPtr,    // [num_seqs, num_kv_heads, fetch_cap] slot index or < 0
        pub plan_blocks: DevPtr,   // [num_seqs, num_kv_heads, fetch_cap] logical block
        pub slot_pages: DevPtr,    // [num_seqs, budget]
        pub host_indptr: DevPtr,   // [num_seqs + 1] CSR over host_indices
        pub host_indices: DevPtr,  // [nnz] host block of each logical block
        pub host_k: DevPtr,        // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned
        pub host_v: DevPtr,        // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned
        pub host_k_scales: DevPtr, // [num_host_blocks, num_kv_heads] kv8 host tier, else null
        pub host_v_scales: DevPtr, // [num_host_blocks, num_kv_heads] kv8 host tier, else null
        pub k_pages: DevPtr,       // [num_pages, num_kv_heads, block_size, head_dim]
        pub v_pages: DevPtr,       // [num_pages, num_kv_heads, block_size, head_dim]
        pub k_scales: DevPtr,      // [num_pages, num_kv_heads] kv8 GPU tier, else null
        pub v_scales: DevPtr,      // [num_pages, num_kv_heads] kv8 GPU tier, else null
        pub num_kv_heads: i32,
        pub fetch_cap: i32,
        pub budget: i32,
        pub block_size: i32,
        pub head_dim: i32,
        pub num_pages: i32,
        pub num_host_blocks: i32,
        pub nnz: i32,
        pub num_seqs: i32,
        pub entries_per_warp: i32,
        pub stage_entries: i32, // gather_blocks_kv8 only; 0: through registers
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `copy_pages_kv8` and `copy_pages_<src tier>_<dst tier>_*` (cuda/gather_blocks.cu):
    /// [`CopyPagesParams`] with either pool kv8, as `oasis_core::kernels::copy_pages_tiers`.
    pub struct CopyPagesTiersParams => "oasis::CopyPagesTiersParams"
        for [
            "copy_pages_kv8",
            "copy_pages_kv8_elem_bf16", "copy_pages_kv8_elem_f16", "copy_pages_kv8_elem_f32",
            "copy_pages_elem_kv8_bf16", "copy_pages_elem_kv8_f16", "copy_pages_elem_kv8_f32",
        ] {
        pub src_k: DevPtr,        // [num_src_pages, num_kv_heads, block_size, head_dim]
        pub src_v: DevPtr,        // [num_src_pages, num_kv_heads, block_size, head_dim]
        pub src_k_scales: DevPtr, // [num_src_pages, num_kv_heads] kv8 source, else null
        pub src_v_scales: DevPtr, // [num_src_pages, num_kv_heads] kv8 source, else null
        pub src_ids: DevPtr,      // [n]
        pub dst_k: DevPtr,        // [num_dst_pages, num_kv_heads, block_size, head_dim]
        pub dst_v: DevPtr,        // [num_dst_pages, num_kv_heads, block_size, head_dim]
        pub dst_k_scales: DevPtr, // [num_dst_pages, num_kv_heads] kv8 destination, else null
        pub dst_v_scales: DevPtr, // [num_dst_pages, num_kv_heads] kv8 destination, else null
        pub dst_ids: DevPtr,      // [n]
        pub valid: DevPtr,        // [n] 1..=block_size (T -> kv8), or null (every row)
        pub num_kv_heads: i32,
        pub block_size: i32,
        pub head_dim: i32,
        pub num_src_pages: i32,
        pub num_dst_pages: i32,
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `quantize_kv8_*` (cuda/gather_blocks.cu): whole-block kv8 quantization of one array.
    pub struct QuantizeKv8Params => "oasis::QuantizeKv8Params<T>"
        for ["quantize_kv8_bf16", "quantize_kv8_f16", "quantize_kv8_f32"] {
        pub src: DevPtr,    // [n, num_kv_heads, block_size, head_dim]
        pub valid: DevPtr,  // [n] 1..=block_size
        pub codes: DevPtr,  // [n, num_kv_heads, block_size, head_dim] u8
        pub scales: DevPtr, // [n, num_kv_heads] f32
        pub num_kv_heads: i32,
        pub block_size: i32,
        pub head_dim: i32,
        pub _pad0: i32,
    }
}

kernel_params! {
    /// `decode_attn_kv8_*`, `decode_attn_kv8_tc_*` and `decode_attn_kv8_tcr_*`
    /// (cuda/decode_attn.cu): [`DecodeAttnParams`] over kv8 pages.
    pub struct DecodeAttnKv8Params => "oasis::DecodeAttnKv8Params<T>"
        for [
            "decode_attn_kv8_bf16",
            "decode_attn_kv8_f16",
            "decode_attn_kv8_f32",
            "decode_attn_kv8_tc_bf16_d64",
            "decode_attn_kv8_tc_bf16_d128",
            "decode_attn_kv8_tc_bf16_d256",
            "decode_attn_kv8_tcr_bf16_d64",
            "decode_attn_kv8_tcr_bf16_d128",
            "decode_attn_kv8_tcr_bf16_d256",
            "decode_attn_kv8_tcr_f16_d64",
            "decode_attn_kv8_tcr_f16_d128",
            "decode_attn_kv8_tcr_f16_d256",
            "decode_attn_kv8_tcd_bf16_d64",
            "decode_attn_kv8_tcd_bf16_d128",
            "decode_attn_kv8_tcd_bf16_d256",
            "decode_attn_kv8_tcd_f16_d64",
            "decode_attn_kv8_tcd_f16_d128",
            "decode_attn_kv8_tcd_f16_d256",
        ] {
        pub q: DevPtr,                // [num_seqs, num_rows, num_qo_heads, head_dim]
        pub k_codes: DevPtr,          // [num_pages, num_kv_heads, block_size, head_dim] u8
        pub v_codes: DevPtr,          // [num_pages, num_kv_heads, block_size, head_dim] u8
        pub k_scales: DevPtr,         // [num_pages, num_kv_heads] f32
        pub v_scales: DevPtr,         // [num_pages, num_kv_heads] f32
        pub kv_indptr: DevPtr,        // [num_seqs + 1] CSR over kv_indices
        pub kv_indices: DevPtr,       // [nnz] GPU page ids, in sequence order
        pub kv_last_page_len: DevPtr, // [num_seqs] 1..=block_size
        pub page_map: DevPtr,         // [num_pages, num_kv_heads] or null (every entry valid)
        pub extra_k: DevPtr,          // [num_seqs, num_kv_heads, head_dim] or null
        pub extra_v: DevPtr,          // [num_seqs, num_kv_heads, head_dim] or null
        pub out: DevPtr,              // [num_seqs, num_rows, num_qo_heads, head_dim]
        pub tmp_out: DevPtr, // [num_seqs, num_rows, num_qo_heads, num_splits, head_dim] or null
        pub tmp_lse: DevPtr, // [num_seqs, num_rows, num_qo_heads, num_splits] or null
        pub num_rows: i32,
        pub num_qo_heads: i32,
        pub num_kv_heads: i32,
        pub head_dim: i32,
        pub block_size: i32,
        pub num_pages: i32,
        pub nnz: i32,
        pub num_splits: i32,
        pub tile_tokens: i32, // 1..=32 (generic kernel); 0 for the tensor-core kernels
        pub sm_scale: f32,
    }
}

/// The layout of every parameter struct, in `cuda/oasis_params.cuh` order.
pub const ALL: &[ParamsLayout] = &[
    AppendKvParams::LAYOUT,
    BuildSummariesParams::LAYOUT,
    DecodeAttnParams::LAYOUT,
    MergeAttnStatesParams::LAYOUT,
    ScoreBlocksParams::LAYOUT,
    ScoreBlocksBound8Params::LAYOUT,
    BuildBounds8Params::LAYOUT,
    BuildKeyCodesParams::LAYOUT,
    EncodeBlocksParams::LAYOUT,
    ScoreBlocksCodesParams::LAYOUT,
    TopkBlocksParams::LAYOUT,
    ForceScoresParams::LAYOUT,
    TopkCandidatesParams::LAYOUT,
    RescoreTopkCodesParams::LAYOUT,
    DeltaSelectParams::LAYOUT,
    GatherBlocksParams::LAYOUT,
    CopyPagesParams::LAYOUT,
    AppendKvTiersParams::LAYOUT,
    GatherBlocksTiersParams::LAYOUT,
    CopyPagesTiersParams::LAYOUT,
    QuantizeKv8Params::LAYOUT,
    DecodeAttnKv8Params::LAYOUT,
    RmsNormParams::LAYOUT,
    SiluMulParams::LAYOUT,
    QkNormRopeParams::LAYOUT,
    WaitStampParams::LAYOUT,
    WaitEpochParams::LAYOUT,
];

/// The parameter struct layout of kernel `entry`, if it has one.
pub fn layout_of(entry: &str) -> Option<&'static ParamsLayout> {
    ALL.iter().find(|l| l.kernels.contains(&entry))
}

#[cfg(test)]
mod tests;
