//! `oasis-rt`: the KV staging daemon of disaggregated prefill/decode, its protocol, its
//! transports and its client.
//!
//! - [`protocol`]: versioned, length-prefixed frames; every field bounds-checked on decode.
//! - [`pool`]: the staging pool and its accounting.
//! - [`transport`]: the [`transport::Connection`] / [`transport::Listener`] /
//!   [`transport::Transport`] traits and the TCP implementation.

pub mod error;
pub mod pool;
pub mod protocol;
pub mod transport;

pub use error::{Error, ErrorCode, Result};
pub use pool::{PoolConfig, StagingPool};
