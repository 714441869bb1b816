//! `oasis-coord`: the decode side's coordinator of remote reads (disaggregated prefill and
//! decode, issue 37).
//!
//! A decode engine admits requests whose KV is staged in an `oasis-rt` daemon; its host pool
//! is a cache of those blocks. Each step the engine's selection plans, per layer, the
//! block-heads it gathers; the ones the host pool lacks must cross the network first. The
//! [`Coordinator`] owns that:
//!
//! ```text
//!  engine (Python)                         Coordinator                          oasis-rt daemon
//!  register_pools(host_k/v [+ scales]) ──▶ PoolLayout (raw addresses)
//!  stage(request, daemon id) ────────────▶ PresenceMap (layer, row, head)
//!  submit(step's planned entries) ───────▶ absent − in flight − failed ──▶ frames, layer order,
//!    returns at once                                                      N connections (tokio)
//!  wait_layer(l) / wait_request(r, l) ◀─── landed: bytes written, then ◀── replies
//!  gather(l)                               marked present; failures per request
//!  take_failed() ◀──────────────────────── request -> message
//! ```
//!
//! - [`coordinator`]: the [`Coordinator`] and its state.
//! - `worker`: one connection's task (its frames in order, reconnects, the writes into the pool).
//! - [`stats`]: the counters ([`CoordStats`]).
//! - [`step_reader`]: the [`StepReader`], which starts a step's reads from the plans the GPU
//!   publishes while it runs the step, and tells the GPU's gather when each layer's landed.
//! - [`pools`]: the pinned host pool's layout and the one `unsafe` write of an entry.
//! - [`connect`]: how connections are made ([`Connector`]; TCP here, UCX in the binding).
//! - [`error`]: the crate's [`CoordError`].
//!
//! A separate crate (not inside `oasis-py`) so that it tests without Python: against an
//! in-process daemon, with connectors that slow or break connections.

pub mod connect;
pub mod coordinator;
pub mod error;
mod inflight;
pub mod pools;
pub mod prefetch;
pub mod stats;
pub mod step_reader;
mod worker;

pub use connect::{Connector, TcpConnector};
pub use coordinator::{CoordConfig, CoordStats, Coordinator};
pub use error::{CoordError, Result};
pub use oasis_runtime::presence::ALL_HEADS;
pub use oasis_runtime::Entry;
pub use pools::{Dest, LayerPool, PoolLayout};
pub use prefetch::DEFAULT_PREFETCH_ENTRIES;
pub use step_reader::{MailboxLayout, ReaderStats, StepPlan, StepReader};
