//! # oasis-cuda
//!
//! The GPU side of OasisKV. The kernels live in `cuda/*.cu` as plain CUDA C++ (raw pointers and
//! ints gathered in one parameter struct per kernel, no framework headers); this crate embeds
//! them, compiles them with NVRTC for the device's architecture on first use (cached on disk),
//! and launches them on the caller's stream, inside the caller's (PyTorch's) context.
//!
//! ```text
//! cuda/*.cu ──include_str!──▶ kernels (registry: sources, entry points, headers)
//!                                 │
//!                                 ▼
//!                   nvrtc (find libnvrtc, compile, cache) ──▶ cubin / PTX on disk
//!                                 │
//!                                 ▼
//!   driver (libcuda, current context, modules) ──▶ ops (one checked wrapper per kernel)
//!                                                     │ fills
//!                                                     ▼
//!            params (one #[repr(C)] struct per kernel = cuda/oasis_params.cuh)
//! ```
//!
//! Every kernel takes one parameter, a struct of `cuda/oasis_params.cuh` passed by value, which
//! [`params`] mirrors in Rust; `tests/params_layout.rs` checks that the two layouts agree.
//!
//! Every kernel has a CPU twin in `oasis_core::kernels` computing the same function with the
//! same argument layout; the wrappers in [`ops`] take the twins' arguments as [`DevSlice`]s
//! plus a [`Stream`], check every size the way the twin does, then queue the launch and return
//! (no host synchronisation anywhere).
//!
//! Nothing here links against CUDA: libnvrtc and libcuda are opened at run time, so the crate
//! builds and its users import on machines without either, and every entry point answers a
//! missing library with a [`CudaError`], never a panic.
//!
//! ## Kernels
//!
//! | source | kernels (each `_bf16`, `_f16`, `_f32` unless noted) | twin |
//! | --- | --- | --- |
//! | `append_kv.cu` | `append_kv`, `build_summaries` | `append_kv`, `build_summaries` |
//! | `decode_attn.cu` | `decode_attn`, `merge_attn_states` (split-KV) | `decode_attention` |
//! | `score_blocks.cu` | `score_blocks`, `topk_blocks_f32` | `score_blocks`, `topk_blocks` |
//! | `delta_select.cu` | `delta_select_i32` | `delta_select` |
//! | `gather_blocks.cu` | `gather_blocks`, `copy_pages` | `gather_blocks`, `copy_pages` |
//! | `norm_rope.cu` | `rms_norm`, `qk_norm_rope` | `rms_norm`, `qk_norm_rope` |
//! | `wait_stamp.cu` | `wait_stamp`, `wait_epoch` | `wait_stamp`, `wait_epoch` |
//!
//! kv8 (FP8 E4M3) pages, [`ops`]' `kv8.rs`: `quantize_kv8` (twin `quantize_kv8`),
//! `append_kv_{kv8_kv8,elem_kv8,kv8_elem}` (`append_kv_tiers`), `gather_blocks_kv8`,
//! `gather_blocks_{kv8_elem,elem_kv8}`, `copy_pages_kv8`, `copy_pages_{kv8_elem,elem_kv8}`
//! (`gather_blocks_tiers`, `copy_pages_tiers`), `decode_attn_kv8` and
//! `decode_attn_kv8_tc_bf16_d{64,128,256}` (`decode_attention_kv8`).
//!
//! ## Examples
//!
//! Compile every kernel for an H200 (no GPU needed, only libnvrtc):
//!
//! ```no_run
//! for (name, bytes) in oasis_cuda::compile_all("sm_90")? {
//!     println!("{name}: {bytes} bytes");
//! }
//! # Ok::<(), oasis_cuda::CudaError>(())
//! ```

pub mod cache;
pub mod driver;
pub mod error;
pub mod kernels;
pub mod nvrtc;
pub mod ops;
pub mod params;
pub mod resources;

pub use cache::KernelCache;
pub use driver::{driver_available, Gpu};
pub use error::{CudaError, Result};
pub use nvrtc::{
    compile, compile_all, compile_all_with_cache, compile_source, compile_with_cache, nvrtc_info,
    NvrtcInfo,
};
pub use ops::{
    DevSlice, ExtraKvDev, Kv8PagesDev, KvTierDev, PagedKv8Dev, PagedKvDev, SplitKv, Stream,
};
pub use resources::{cubin_resources, KernelResources};
