//! The shared limits of [`oasis_core::limits`] as module constants of `oasiskv._core`, so that
//! Python checks a configuration against the very numbers the kernels are compiled with
//! (`oasiskv.config` reads them; nothing in Python repeats them).

use oasis_core::limits;
use pyo3::prelude::*;

/// (name, value) of every limit `_core` exports; `_core.pyi` lists the same names.
const EXPORTED: [(&str, usize); 7] = [
    ("MAX_BLOCK_SIZE", limits::MAX_BLOCK_SIZE),
    ("MAX_TOP_K_BLOCKS", limits::MAX_TOP_K_BLOCKS),
    ("MAX_CANDIDATES", limits::MAX_CANDIDATES),
    ("MAX_SELECT_BUDGET", limits::MAX_SELECT_BUDGET),
    ("MAX_POOL_BLOCKS", limits::MAX_POOL_BLOCKS),
    ("MAX_TOKENS", limits::MAX_TOKENS),
    ("MAX_HEAD_DIM", limits::MAX_HEAD_DIM),
];

/// Add the limits to `_core` as ints.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for (name, value) in EXPORTED {
        m.add(name, value)?;
    }
    Ok(())
}
