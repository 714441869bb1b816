//! `oasiskv._core`: the thin PyO3 module over `oasis-core` (CPU twins) and `oasis-cuda` (GPU
//! kernels).
//!
//! Tensors cross the boundary as [`TensorArg`]s: anything with torch's `data_ptr()`, `shape`,
//! `dtype`, `device` and `is_contiguous()` (torch tensors, in practice). Every kernel function
//! dispatches on the device of its tensors:
//!
//! ```text
//!                ┌─ all on the CPU ──────▶ oasis_core::kernels::* (validates every table entry)
//! tensors ─ Cx ──┤
//!                └─ all on one cuda:N ───▶ oasis_cuda::Gpu::* on `stream` (host pool: pinned CPU
//!                                          memory through unified addressing, or cuda:N)
//! ```
//!
//! Device, dtype, contiguity, shape and aliasing are checked here, the same checks for both
//! paths; then the GIL is released and the kernel runs (CPU) or is queued (CUDA: the call returns
//! without synchronising). Table *contents* are not validated on the GPU (that would need a
//! synchronisation): the kernels check ids against their pools and every CSR row against the
//! length of its indices where they read them, skip a bad id and read a malformed row as empty,
//! where the CPU twins raise (docs/CORE_CONTRACT.md, last section). No panic crosses into
//! Python: each entry point runs under `catch_unwind`, and core and CUDA errors become the
//! classes of `oasiskv.errors`.
//!
//! Nothing here links against CUDA: the module imports on a machine without a driver or NVRTC,
//! and only a call on CUDA tensors (or `compile_kernels`, `nvrtc_version`) asks for them.
//!
//! One module per kernel family, each registering its own functions:
//!
//! ```text
//! attention  decode_attention, decode_attn_workspace_len, plan_num_splits
//! page       append_kv, build_summaries, gather_blocks (+ its launch shape), copy_pages
//! selection  score_blocks, topk_blocks, force_scores, topk_candidates, delta_select
//! codes      build_key_codes, score_blocks_codes, rescore_blocks_codes
//! norm       rms_norm, qk_norm_rope, silu_mul
//! device     cuda_status, compile_kernels, nvrtc_version, wait_stamp
//! runtime    KvGeometry, BlockPool, Runtime (pools, block tables, the step plan)
//! limits     MAX_TOP_K_BLOCKS, MAX_BLOCK_SIZE, ... (oasis_core::limits, one source each)
//! rt         RtClient, ucx_version (the oasis-rt staging daemon's client)
//! ```
//!
//! Beneath them: `tensor` (a tensor as it crosses the boundary, and its own checks), `check` (the
//! checks the families share), `call` (running an entry point: panics, the GIL, the device's
//! stream) and `errors` (the mapping to `oasiskv.errors`).

mod attention;
mod call;
mod check;
mod codes;
mod coord;
mod device;
mod errors;
mod limits;
mod norm;
mod page;
mod rt;
mod runtime;
mod selection;
mod step_reader;
mod tensor;
mod tier;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    runtime::register(m)?;
    rt::register(m)?;
    coord::register(m)?;
    step_reader::register(m)?;
    page::register(m)?;
    attention::register(m)?;
    selection::register(m)?;
    codes::register(m)?;
    norm::register(m)?;
    device::register(m)?;
    limits::register(m)?;
    Ok(())
}
