//! # oasis-runtime
//!
//! The state of a running OasisKV engine, owned by Rust: the pool accounting of both tiers, every
//! request's block tables, admission, the dense→sparse transition, release, and the per-step
//! plan that every layer of a decode step reads. Python keeps only the model forward, the
//! attention callback, the drafters and sampling; the bytes of the pools are torch tensors it
//! owns, addressed by the ids handed out here.
//!
//! * [`config`] — [`RuntimeConfig`]: block size, budget K, threshold, rows per request.
//! * [`cache`] — [`RowCache`]: the host rows of a staged request's cached blocks, LRU eviction
//!   that never touches the blocks a gather reads (the bounded decode-side host pool).
//! * [`table`] — [`RequestTable`]: one request's pages, working-set slots, local page and host
//!   blocks, and the [`Reservation`] that admission charged for it.
//! * [`manager`] — [`Runtime`]: the pools, the tables, admission and the state transitions.
//! * [`presence`] — [`PresenceMap`]: which staged block-heads `(layer, host row, KV head)` the
//!   decode side's host pool holds (disaggregation), and which of a step's plan are absent.
//! * [`plan`] — [`StepPlan`]: one step's tables for all layers, laid out in one flat `i32` arena
//!   so that the engine copies them to the device in one async copy (FlashInfer's plan/run).
//!
//! ## Admission (why an admitted request never runs out of blocks)
//!
//! A request is admitted only when its *peak* need in both tiers, over its whole life, fits beside
//! the peaks already reserved by the running requests: see [`Reservation::for_request`]. Its
//! holdings never exceed its reservation, so every later allocation for it succeeds. When it turns
//! sparse its GPU reservation shrinks to the working set; on release both go to zero.
//!
//! No `unsafe` here: this crate is plain data structures, tested on any machine.

#![forbid(unsafe_code)]

pub mod cache;
pub mod config;
pub mod manager;
pub mod plan;
pub mod presence;
pub mod table;

pub use cache::{Cached, RowCache};
pub use config::RuntimeConfig;
pub use manager::{Runtime, SparseTransition};
pub use oasis_core::{OasisError, Result, Tier};
pub use plan::{PlanField, PlanLayout, PlanMeta, PlanPad, StepPlan};
pub use presence::{Entry, PresenceMap};
pub use table::{RequestTable, Reservation};
