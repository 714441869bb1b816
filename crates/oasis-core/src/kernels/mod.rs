//! CPU twins of the GPU kernels. Each function here is the oracle its CUDA kernel is tested
//! against, and the path that runs the whole system on a machine with no GPU.
//!
//! Conventions shared by every kernel:
//! * all buffers are flat row-major slices; the shape comment on each argument is normative;
//! * tables are `i32` (what the GPU kernels take); a negative entry means "empty / padding";
//! * every shape and every table entry is validated before any write, so a bad call returns an
//!   error and leaves every output untouched;
//! * arithmetic is f32 whatever the storage type `T`.

pub mod append;
pub mod attention;
pub mod bound8;
pub mod codes;
pub mod gather;
pub mod norm;
pub mod score;
pub mod select;
pub mod summary;
mod validate;
pub mod wait;

pub use append::append_kv;
pub use attention::{decode_attention, ExtraKv, PagedKv};
pub use bound8::{build_bounds8, score_blocks_bound8};
pub use codes::{build_key_codes, rescore_blocks_codes, score_blocks_codes};
pub use gather::{copy_pages, gather_blocks};
pub use norm::{qk_norm_rope, rms_norm, HeadLayout, Positions, QkNorm, Residual};
pub use score::{force_scores, score_blocks, topk_blocks, topk_blocks_mapped, topk_candidates};
pub use select::{delta_select, SelectStats};
pub use summary::build_summaries;
pub use wait::{wait_stamp, WaitStamp};
