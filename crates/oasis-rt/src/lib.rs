//! `oasis-rt`: the KV staging daemon of disaggregated prefill/decode, its protocol, its
//! transports and its client.
//!
//! ```text
//!  prefill worker                 oasis-rt daemon                      decode engine
//!  (Client)          frames       (Server, one task per connection)    (Client)
//!  stage_blocks  ---------------> StagingPool: per request, under  <-- fetch_admission
//!  stage_summaries                a byte budget: blocks, summary       read_blocks (per layer,
//!  stage_admission                rows, admission set; leases,         across requests)
//!                                 eviction of expired data only    <-- release
//!                  Transport: TcpTransport (tokio); UcxTransport (feature `ucx`, libucp
//!                  loaded at run time, frames as active messages, block reads by RMA get
//!                  of the daemon's registered staging memory: ReadBlocksRma / Ack)
//! ```
//!
//! - [`protocol`]: versioned, length-prefixed frames; every field bounds-checked on decode.
//! - [`pool`]: the staging pool and its accounting.
//! - [`transport`]: the [`transport::Connection`] / [`transport::Listener`] /
//!   [`transport::Transport`] traits and the TCP implementation; `ucx` (feature `ucx`) the UCX
//!   one.
//! - [`server`]: the daemon (`oasis-rt serve`), [`metrics`]: its Prometheus endpoint.
//! - [`client`]: the async client.
//! - [`bench`]: block-read throughput against a host memcpy (`oasis-rt bench`).
//!
//! Failure semantics are in [`server`] and `docs/ARCHITECTURE.md`.

pub mod bench;
pub mod client;
pub mod error;
pub mod metrics;
pub mod pool;
pub mod protocol;
pub mod server;
pub mod transport;
#[cfg(feature = "ucx")]
pub mod ucx;
#[cfg(feature = "ucx")]
pub use ucx::{UcxConfig, UcxTransport};

pub use client::{Client, ClientConfig};
pub use error::{Error, ErrorCode, Result};
pub use pool::{PoolConfig, StagingPool};
pub use server::{Server, ServerConfig, ServerHandle};
