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
    /// An allocation failed (or its size overflows): `bytes` of host memory for `what`. Every
    /// allocation sized by a caller goes through [`try_vec`], so it is this error, never an abort.
    #[error("out of memory: {what} needs {bytes} bytes")]
    OutOfMemory { what: &'static str, bytes: u128 },
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

/// An empty vector with room for `n` elements of `T`, or [`OasisError::OutOfMemory`] when the
/// allocator refuses (or `n` elements overflow `isize::MAX` bytes). Use it for every allocation
/// whose size a caller chooses: `Vec::with_capacity` / `vec![..; n]` abort the process on failure,
/// which no Python `except` can catch.
pub fn try_vec<T>(what: &'static str, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| OasisError::OutOfMemory {
            what,
            bytes: n as u128 * std::mem::size_of::<T>() as u128,
        })?;
    Ok(v)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn try_vec_reports_what_it_could_not_allocate() {
        let v: Vec<u32> = try_vec("ids", 10).unwrap();
        assert!(v.is_empty() && v.capacity() >= 10);
        // More than isize::MAX bytes: a capacity overflow, reported, not a panic or an abort.
        let err = try_vec::<u64>("ids", usize::MAX / 4).unwrap_err();
        assert_eq!(
            err,
            OasisError::OutOfMemory {
                what: "ids",
                bytes: (usize::MAX / 4) as u128 * 8
            }
        );
        // Representable but far beyond any machine: the allocator refuses.
        let err = try_vec::<u8>("pool", 1 << 62).unwrap_err();
        assert!(matches!(err, OasisError::OutOfMemory { what: "pool", .. }));
        assert!(err.to_string().starts_with("out of memory: pool needs"));
    }
}
