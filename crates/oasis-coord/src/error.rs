//! The coordinator's errors: one enum, short lowercase messages. The binding maps each variant
//! to a Python class and says how to fix the call.

use oasis_core::OasisError;

/// What a coordinator call can fail with. Failed *reads* are not errors of the call: they fail
/// the requests whose entries they carried ([`crate::Coordinator::take_failed`]).
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    /// The caller's arguments (a key past the pools, pools of the wrong shape, ...).
    #[error("{0}")]
    Invalid(String),
    /// The presence map refused the change (a row past the map, a row taken twice, ...).
    #[error(transparent)]
    Presence(#[from] OasisError),
    /// Reads asked for before any pools were registered.
    #[error("no host pools registered: register the pools before submitting reads")]
    NoPools,
    /// The coordinator was closed.
    #[error("the coordinator is closed")]
    Closed,
    /// Its tokio runtime could not start.
    #[error("cannot start the coordinator's runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// The crate's result.
pub type Result<T> = std::result::Result<T, CoordError>;
