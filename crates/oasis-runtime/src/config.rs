//! [`RuntimeConfig`]: what the runtime needs of `KvConfig` and the engine, checked once.

use oasis_core::limits::MAX_BLOCK_SIZE;
use oasis_core::{OasisError, Result};

/// Largest pool the tables can address: ids travel as `i32` to the GPU.
pub use oasis_core::limits::MAX_POOL_BLOCKS;

/// The configuration of one [`crate::Runtime`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// Tokens per block (page).
    pub block_size: usize,
    /// The working-set budget K: selected blocks per KV head, the local block excluded.
    pub top_k_blocks: usize,
    /// A request turns sparse once its stored context exceeds this many tokens.
    pub sparse_threshold: usize,
    /// Whether requests turn sparse at all (`false`: the dense backend).
    pub sparse: bool,
    /// Query rows per request and step: 1, or 2 with a lookahead (draft) row.
    pub rows: usize,
    /// Plan the tables of lookahead recall (the previous prediction against this step's top-K).
    pub measure_recall: bool,
    /// Plan `blk_seq` (each candidate's sparse request) for `select_queries="lookahead+current"`.
    pub plan_blk_seq: bool,
    /// Most requests admitted at once; each holds one accumulator slot `0..max_num_seqs`.
    pub max_num_seqs: usize,
}

impl RuntimeConfig {
    /// Check the values against each other.
    ///
    /// # Errors
    /// [`OasisError::Config`] naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(OasisError::Config(m));
        if !(1..=MAX_BLOCK_SIZE).contains(&self.block_size) {
            return bad(format!(
                "block_size must be in 1..={MAX_BLOCK_SIZE}, got {}",
                self.block_size
            ));
        }
        if self.top_k_blocks == 0 || self.top_k_blocks > MAX_POOL_BLOCKS / 2 {
            return bad(format!(
                "top_k_blocks must be >= 1, got {}",
                self.top_k_blocks
            ));
        }
        if !(1..=2).contains(&self.rows) {
            return bad(format!("rows must be 1 or 2, got {}", self.rows));
        }
        if self.max_num_seqs == 0 || self.max_num_seqs > 1 << 20 {
            return bad(format!(
                "max_num_seqs must be in 1..={}, got {}",
                1 << 20,
                self.max_num_seqs
            ));
        }
        if self.sparse_threshold == 0 {
            return bad("sparse_threshold must be >= 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) fn test_config() -> RuntimeConfig {
    RuntimeConfig {
        block_size: 4,
        top_k_blocks: 3,
        sparse_threshold: 12,
        sparse: true,
        rows: 2,
        measure_recall: true,
        plan_blk_seq: true,
        max_num_seqs: 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_names_the_field() {
        let ok = test_config();
        assert!(ok.validate().is_ok());
        for (cfg, field) in [
            (
                RuntimeConfig {
                    block_size: 0,
                    ..ok.clone()
                },
                "block_size",
            ),
            (
                RuntimeConfig {
                    top_k_blocks: 0,
                    ..ok.clone()
                },
                "top_k_blocks",
            ),
            (
                RuntimeConfig {
                    rows: 3,
                    ..ok.clone()
                },
                "rows",
            ),
            (
                RuntimeConfig {
                    max_num_seqs: 0,
                    ..ok.clone()
                },
                "max_num_seqs",
            ),
        ] {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }
}
