//! One error enum for the core. Messages are short and lowercase; the Python layer maps each
//! variant to an exception class and adds how to fix the call.

/// Which memory tier ran out or was addressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Gpu,
    Host,
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tier::Gpu => "gpu pool",
            Tier::Host => "host pool",
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum OasisError {
    /// A buffer does not have the shape the operation needs.
    #[error("{what}: expected shape {expected}, got {got}")]
    Shape {
        what: &'static str,
        expected: String,
        got: String,
    },
    /// A buffer has the wrong element type.
    #[error("{what}: expected dtype {expected}, got {got}")]
    DType {
        what: &'static str,
        expected: String,
        got: String,
    },
    /// An index stored in a table points outside the buffer it indexes.
    #[error("{what}: index {index} out of range 0..{bound}")]
    IndexOutOfRange {
        what: &'static str,
        index: i64,
        bound: usize,
    },
    /// A pool has fewer free blocks than requested.
    #[error("out of blocks in the {tier}: requested {requested}, free {free}")]
    OutOfBlocks {
        tier: Tier,
        requested: usize,
        free: usize,
    },
    /// A configuration value is outside what the geometry allows.
    #[error("invalid config: {0}")]
    Config(String),
    /// An argument is inconsistent with another one.
    #[error("invalid argument: {0}")]
    Invalid(String),
}

pub type Result<T, E = OasisError> = std::result::Result<T, E>;

/// Return `Err(OasisError::Invalid(..))` unless `cond` holds (polars' `polars_ensure!`).
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::OasisError::Invalid(format!($($fmt)+)));
        }
    };
}

/// Check that a slice has exactly `expected` elements for the named shape.
pub fn check_len(what: &'static str, len: usize, shape: &[usize]) -> Result<()> {
    // NOTE: checked product: shapes come from user-controlled sizes and must not overflow-panic.
    let Some(expected) = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) else {
        return Err(OasisError::Shape {
            what,
            expected: format!("{shape:?} (overflows usize)"),
            got: format!("{len} elements"),
        });
    };
    if len != expected {
        return Err(OasisError::Shape {
            what,
            expected: format!("{shape:?} ({expected} elements)"),
            got: format!("{len} elements"),
        });
    }
    Ok(())
}
