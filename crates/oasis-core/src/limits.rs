//! The limits shared across the stack, each defined here once. The other places read them:
//!
//! ```text
//! oasis_core::limits ─┬─ oasis-core        KvGeometry (MAX_HEAD_DIM), BlockPool (MAX_POOL_BLOCKS)
//!                     ├─ oasis-runtime     RuntimeConfig::validate (MAX_BLOCK_SIZE, MAX_POOL_BLOCKS)
//!                     ├─ oasis-cuda        the launch wrappers' checks, and the kernels: NVRTC gets
//!                     │                    the kernel-side ones as -D defines (nvrtc::compile_options)
//!                     └─ oasis-py          module constants of oasiskv._core, read by
//!                                          oasiskv.config (KvConfig's checks)
//! ```
//!
//! A kernel-side limit sizes a static buffer of its kernel, so raising one raises that kernel's
//! register or shared-memory use: check the kernel's occupancy after a change.

/// Largest `block_size` (tokens per page). Arbitrary: keeps ids and in-block offsets far from
/// `i32` limits and every block's summaries small.
pub const MAX_BLOCK_SIZE: usize = 1024;

/// Largest `top_k_blocks`: the most blocks the GPU top-K selects per KV head (the static sort
/// buffer of `topk_blocks_f32`, `OASIS_MAX_TOPK` in cuda/score_blocks.cu). Also the cap of the
/// two-stage score's candidates.
pub const MAX_TOP_K_BLOCKS: usize = 512;

/// Largest `m + successors` of the two-stage score's last top-K on the GPU (the candidate buffer
/// of `topk_candidates_f32`, `OASIS_CAND_MAX` in cuda/score_blocks.cu).
pub const MAX_CANDIDATES: usize = 1024;

/// Largest working-set budget (slots per sequence) of the GPU delta selection
/// (`OASIS_MAX_SELECT_BUDGET` in cuda/delta_select.cu: its shared-memory sort).
pub const MAX_SELECT_BUDGET: usize = 4096;

/// Largest pool (GPU pages, host blocks): page and block ids travel as `i32` to the GPU.
pub const MAX_POOL_BLOCKS: usize = i32::MAX as usize;

/// Largest token count of a sequence (`sparse_threshold` too): positions are `i32` on the GPU.
pub const MAX_TOKENS: usize = i32::MAX as usize;

/// Largest `head_dim` the kernels support (the GPU kernels keep one query row in registers).
pub const MAX_HEAD_DIM: usize = 256;

/// The kernel-side limits, as the `#define` names the CUDA sources use: NVRTC compiles every
/// source with `-D<name>=<value>` for each, so the kernels' static buffers are sized from here.
pub const KERNEL_DEFINES: [(&str, usize); 3] = [
    ("OASIS_MAX_TOPK", MAX_TOP_K_BLOCKS),
    ("OASIS_CAND_MAX", MAX_CANDIDATES),
    ("OASIS_MAX_SELECT_BUDGET", MAX_SELECT_BUDGET),
];

// Checked at compile time: every limit is a positive i32 (ids, lengths and offsets below them
// travel as non-negative i32), and the two-stage score's candidates (at most MAX_TOP_K_BLOCKS) fit
// the candidates' top-K.
const _: () = {
    let all = [
        MAX_BLOCK_SIZE,
        MAX_TOP_K_BLOCKS,
        MAX_CANDIDATES,
        MAX_SELECT_BUDGET,
        MAX_POOL_BLOCKS,
        MAX_TOKENS,
        MAX_HEAD_DIM,
    ];
    let mut i = 0;
    while i < all.len() {
        assert!(all[i] > 0 && all[i] <= i32::MAX as usize);
        i += 1;
    }
    assert!(MAX_TOP_K_BLOCKS <= MAX_CANDIDATES);
};
