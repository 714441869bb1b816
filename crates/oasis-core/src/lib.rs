//! # oasis-core
//!
//! The pure-Rust heart of OasisKV: no CUDA, no Python, no network. It holds
//!
//! * [`geometry`] — the KV shape of a model (heads, head_dim, block size);
//! * [`pool`] — [`pool::BlockPool`], the free list behind the GPU page pool and the host pool;
//! * [`kernels`] — the CPU twin of every GPU kernel: append with write-through, decode attention
//!   over head-wise working sets, block summaries, block scoring + per-head top-K, delta selection
//!   with capped eviction, and the gather from the host pool into GPU slots; and the decoder's
//!   fused elementwise work (RMSNorm with the residual add, q/k norm + RoPE from the QKV rows).
//!
//! Every kernel takes flat slices plus the geometry, checks every shape and every index first and
//! returns [`OasisError`] instead of panicking, then computes in f32 whatever the storage dtype.
//! The CUDA kernels in `cuda/` compute the same functions and are tested against these.
//!
//! ## Layout (Head-Token-Dimension pages, as in the paper's Fig. 9)
//!
//! ```text
//! k_pages, v_pages     [num_pages, num_kv_heads, block_size, head_dim]   GPU pool (one per layer)
//! host_k, host_v       [num_host_blocks, num_kv_heads, block_size, head_dim]
//! summaries            [num_host_blocks, num_kv_heads, 2, head_dim]      row 0 = min, row 1 = max
//! page_map             [num_pages, num_kv_heads] i32  head-wise mapping: logical block held, -1 empty
//! page_last_selected   [num_pages, num_kv_heads] i32  step the entry was last selected, -1 never
//! ```
//!
//! Either tier may instead hold kv8 pages ([`kernels::kv8`]): E4M3 codes in the same
//! `[num_pages, num_kv_heads, block_size, head_dim]` layout plus f32 power-of-two scales
//! `[num_pages, num_kv_heads]` for K and for V.

#![forbid(unsafe_code)]

pub mod dtype;
pub mod error;
pub mod geometry;
pub mod kernels;
pub mod limits;
pub mod pool;

pub use dtype::{DType, KvElem};
pub use error::{OasisError, Result, Tier};
pub use geometry::KvGeometry;
pub use pool::BlockPool;
