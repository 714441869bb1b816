//! CPU twins of the GPU kernels. Each function here is the oracle its CUDA kernel is tested
//! against, and the path that runs the whole system on a machine with no GPU.
//!
//! Conventions shared by every kernel:
//! * all buffers are flat row-major slices; the shape comment on each argument is normative;
//! * tables are `i32` (what the GPU kernels take); a negative entry means "empty / padding";
//! * every shape and every table entry is validated before any write, so a bad call returns an
//!   error and leaves every output untouched;
//! * arithmetic is f32 whatever the storage type `T`; kv8 pages ([`kv8`]) read as
//!   `e4m3_decode(code) * scale`, exact in f32.

pub mod append;
pub mod attention;
pub mod bound8;
pub mod codes;
pub mod gather;
pub mod kv8;
pub mod mlp;
pub mod norm;
pub mod score;
pub mod select;
pub mod summary;
pub mod two_stage;
mod validate;
pub mod wait;

/// The tests' random numbers: a xorshift64 stream from `seed` (nonzero), the same sequence in every
/// test that names the same seed.
#[cfg(test)]
pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut rng = seed;
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    }
}

pub use append::{append_kv, append_kv_tiers};
pub use attention::{decode_attention, decode_attention_kv8, ExtraKv, PagedKv, PagedKv8};
pub use bound8::{build_bounds8, e4m3_decode, e4m3_rne, score_blocks_bound8};
pub use codes::{build_key_codes, rescore_blocks_codes, score_blocks_codes};
pub use gather::{copy_pages, copy_pages_tiers, gather_blocks, gather_blocks_tiers};
pub use kv8::{
    kv8_exponent, kv8_scale_exponent, quantize_kv8, Kv8Pages, Kv8PagesMut, KvTier, KvTierMut,
    KV8_MAX_EXP, KV8_MIN_EXP,
};
pub use mlp::silu_mul;
pub use norm::{qk_norm_rope, rms_norm, HeadLayout, Positions, QkNorm, Residual};
pub use score::{force_scores, score_blocks, topk_blocks, topk_blocks_mapped, topk_candidates};
pub use select::{delta_select, SelectStats};
pub use summary::build_summaries;
pub use two_stage::{encode_blocks, rescore_topk_codes};
pub use wait::{wait_epoch, wait_stamp, WaitStamp};
