//! The kernel registry: every `.cu` source of `cuda/`, embedded at build time, with its entry
//! points, and the headers NVRTC is given (it sees no file system: every `#include` of a kernel
//! must be one of [`HEADERS`]).
//!
//! Entry points are `extern "C"` and named `<verb>_<object>_<dtype>`; each kernel family exists
//! for bf16, f16 and f32 storage (the dtype-free ones carry the dtype of their tables). Each takes
//! one parameter, its struct of `oasis_params.cuh` ([`crate::params`]).

/// One kernel source file and the `extern "C"` kernels it defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// Registry name, the file stem (`"decode_attn"`).
    pub name: &'static str,
    /// File name under `cuda/`, also the NVRTC program name that compile logs show.
    pub file: &'static str,
    /// The source text.
    pub source: &'static str,
    /// Every `extern "C" __global__` function of the file.
    pub entry_points: &'static [&'static str],
}

/// Headers handed to NVRTC with every program: (include name, contents).
pub const HEADERS: &[(&str, &str)] = &[
    (
        "oasis_common.cuh",
        include_str!("../../../cuda/oasis_common.cuh"),
    ),
    (
        "oasis_params.cuh",
        include_str!("../../../cuda/oasis_params.cuh"),
    ),
    (
        "oasis_topk.cuh",
        include_str!("../../../cuda/oasis_topk.cuh"),
    ),
    (
        "oasis_attn_tc.cuh",
        include_str!("../../../cuda/oasis_attn_tc.cuh"),
    ),
    (
        "oasis_codes_tc.cuh",
        include_str!("../../../cuda/oasis_codes_tc.cuh"),
    ),
];

/// Every kernel source, in dependency-free order.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "append_kv",
        file: "append_kv.cu",
        source: include_str!("../../../cuda/append_kv.cu"),
        entry_points: &[
            "append_kv_bf16",
            "append_kv_f16",
            "append_kv_f32",
            "build_summaries_bf16",
            "build_summaries_f16",
            "build_summaries_f32",
            "append_kv_kv8_kv8_bf16",
            "append_kv_elem_kv8_bf16",
            "append_kv_kv8_elem_bf16",
            "append_kv_kv8_kv8_f16",
            "append_kv_elem_kv8_f16",
            "append_kv_kv8_elem_f16",
            "append_kv_kv8_kv8_f32",
            "append_kv_elem_kv8_f32",
            "append_kv_kv8_elem_f32",
        ],
    },
    KernelSource {
        name: "decode_attn",
        file: "decode_attn.cu",
        source: include_str!("../../../cuda/decode_attn.cu"),
        entry_points: &[
            "decode_attn_bf16",
            "decode_attn_f16",
            "decode_attn_f32",
            "decode_attn_tc_bf16_d64",
            "decode_attn_tc_bf16_d128",
            "decode_attn_tc_bf16_d256",
            "decode_attn_tc_f16_d64",
            "decode_attn_tc_f16_d128",
            "decode_attn_tc_f16_d256",
            "merge_attn_states_bf16",
            "merge_attn_states_f16",
            "merge_attn_states_f32",
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
        ],
    },
    KernelSource {
        name: "score_blocks",
        file: "score_blocks.cu",
        source: include_str!("../../../cuda/score_blocks.cu"),
        entry_points: &[
            "score_blocks_bf16",
            "score_blocks_f16",
            "score_blocks_f32",
            "score_blocks_bound8_bf16",
            "score_blocks_bound8_f16",
            "score_blocks_bound8_f32",
            "score_blocks_bound8_tc_bf16",
            "score_blocks_bound8_tc_f16",
            "score_blocks_bound8_tc_f32",
            "topk_blocks_f32",
            "force_scores_f32",
            "topk_candidates_f32",
        ],
    },
    KernelSource {
        name: "key_codes",
        file: "key_codes.cu",
        source: include_str!("../../../cuda/key_codes.cu"),
        entry_points: &[
            "build_key_codes_bf16",
            "build_key_codes_f16",
            "build_key_codes_f32",
            "build_bounds8_bf16",
            "build_bounds8_f16",
            "build_bounds8_f32",
            "encode_blocks_bf16",
            "encode_blocks_f16",
            "encode_blocks_f32",
            "score_blocks_codes_bf16",
            "score_blocks_codes_f16",
            "score_blocks_codes_f32",
            "rescore_topk_codes_bf16",
            "rescore_topk_codes_f16",
            "rescore_topk_codes_f32",
        ],
    },
    KernelSource {
        name: "delta_select",
        file: "delta_select.cu",
        source: include_str!("../../../cuda/delta_select.cu"),
        entry_points: &["delta_select_i32", "delta_select_warp_i32"],
    },
    KernelSource {
        name: "gather_blocks",
        file: "gather_blocks.cu",
        source: include_str!("../../../cuda/gather_blocks.cu"),
        entry_points: &[
            "gather_blocks_bf16",
            "gather_blocks_f16",
            "gather_blocks_f32",
            "copy_pages_bf16",
            "copy_pages_f16",
            "copy_pages_f32",
            "gather_blocks_kv8",
            "copy_pages_kv8",
            "gather_blocks_kv8_elem_bf16",
            "gather_blocks_elem_kv8_bf16",
            "copy_pages_kv8_elem_bf16",
            "copy_pages_elem_kv8_bf16",
            "quantize_kv8_bf16",
            "gather_blocks_kv8_elem_f16",
            "gather_blocks_elem_kv8_f16",
            "copy_pages_kv8_elem_f16",
            "copy_pages_elem_kv8_f16",
            "quantize_kv8_f16",
            "gather_blocks_kv8_elem_f32",
            "gather_blocks_elem_kv8_f32",
            "copy_pages_kv8_elem_f32",
            "copy_pages_elem_kv8_f32",
            "quantize_kv8_f32",
        ],
    },
    KernelSource {
        name: "norm_rope",
        file: "norm_rope.cu",
        source: include_str!("../../../cuda/norm_rope.cu"),
        entry_points: &[
            "rms_norm_bf16",
            "rms_norm_f16",
            "rms_norm_f32",
            "silu_mul_bf16",
            "silu_mul_f16",
            "silu_mul_f32",
            "qk_norm_rope_bf16",
            "qk_norm_rope_f16",
            "qk_norm_rope_f32",
        ],
    },
    KernelSource {
        name: "wait_stamp",
        file: "wait_stamp.cu",
        source: include_str!("../../../cuda/wait_stamp.cu"),
        entry_points: &["wait_stamp", "wait_epoch"],
    },
];

/// The source registered under `name` (file stem, e.g. `"gather_blocks"`).
pub fn source(name: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.name == name)
}

/// The source that defines the kernel `entry` (e.g. `"gather_blocks_bf16"`).
pub fn source_of(entry: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.entry_points.contains(&entry))
}
