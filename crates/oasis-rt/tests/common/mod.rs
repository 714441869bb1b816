//! Test bodies shared by every transport: `daemon.rs` runs them over TCP, `ucx.rs` over UCX.
//! Each takes a [`Net`] (the daemon's and the clients' transports) and checks the same
//! protocol-level behaviour: round trips, concurrency, the budget, a killed daemon, bad frames,
//! the token, graceful shutdown, oversized requests and replies.
//!
//! ```text
//! data.rs      the test requests' bytes: geometry, blocks, summary rows, stage_request
//! daemon.rs    Net (the two transports), Daemon (an in-process daemon), cfg
//! raw.rs       below the Client: raw frames (raw, recv, expect_refused), HTTP, samples
//! staging.rs   bodies: the round trip, many clients, the budget, a killed daemon
//! frames.rs    bodies: bad frames, oversized requests and replies
//! access.rs    bodies: the token, non-loopback addresses, the handshake and idle timeouts
//! metrics.rs   bodies: /metrics (and its token), graceful shutdown
//! ```
//!
//! Everything is re-exported here: the test files `use common::*` and run `common::<body>`.

#![allow(dead_code)]

use std::time::Duration;

mod access;
mod daemon;
mod data;
mod frames;
mod metrics;
mod raw;
mod staging;

pub use daemon::*;
pub use data::*;
pub use raw::*;

// The bodies (`bench.rs` runs none of them).
#[allow(unused_imports)]
pub use access::*;
#[allow(unused_imports)]
pub use frames::*;
#[allow(unused_imports)]
pub use metrics::*;
#[allow(unused_imports)]
pub use staging::*;

pub const T: Duration = Duration::from_secs(3);
