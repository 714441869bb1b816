//! The KV geometry of one model: everything a kernel needs to index a page.

use crate::error::{OasisError, Result};

pub use crate::limits::MAX_HEAD_DIM;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    pub num_qo_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl KvGeometry {
    /// # Errors
    /// [`OasisError::Config`] when a size is zero, head_dim exceeds [`MAX_HEAD_DIM`], the query
    /// heads are not a multiple of the KV heads, or a page (`num_kv_heads * block_size *
    /// head_dim` elements) or a query row overflows `usize`.
    pub fn new(
        num_qo_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
    ) -> Result<Self> {
        if num_qo_heads == 0 || num_kv_heads == 0 || head_dim == 0 || block_size == 0 {
            return Err(OasisError::Config(format!(
                "all sizes must be positive (num_qo_heads={num_qo_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, block_size={block_size})"
            )));
        }
        if !num_qo_heads.is_multiple_of(num_kv_heads) {
            return Err(OasisError::Config(format!(
                "num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )));
        }
        if head_dim > MAX_HEAD_DIM {
            return Err(OasisError::Config(format!(
                "head_dim {head_dim} exceeds the supported maximum {MAX_HEAD_DIM}"
            )));
        }
        // NOTE: the sizes come from users (config.json, Python): a page or a query row whose
        // element count overflows is an error here, so no later product can wrap or panic.
        let page = num_kv_heads
            .checked_mul(block_size)
            .and_then(|x| x.checked_mul(head_dim));
        let q_row = num_qo_heads.checked_mul(head_dim);
        if page.is_none() || q_row.is_none() {
            return Err(OasisError::Config(format!(
                "geometry sizes overflow (num_qo_heads={num_qo_heads}, num_kv_heads={num_kv_heads}, head_dim={head_dim}, block_size={block_size}); use the model's real head counts and a block size of a few tokens"
            )));
        }
        Ok(Self {
            num_qo_heads,
            num_kv_heads,
            head_dim,
            block_size,
        })
    }

    /// Re-check a geometry that may have been built field by field (the fields are public):
    /// the same rules as [`KvGeometry::new`], which include that every buffer-size product fits
    /// a `usize`. Every kernel calls this first, so a hand-built bad geometry is an error, never
    /// a panic.
    ///
    /// # Errors
    /// [`OasisError::Config`] as for [`KvGeometry::new`].
    pub fn validate(&self) -> Result<()> {
        Self::new(
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        )
        .map(|_| ())
    }

    /// Query heads sharing one KV head (the GQA group).
    pub fn group_size(&self) -> usize {
        self.num_qo_heads / self.num_kv_heads
    }

    /// Elements in one page (all heads) of K or of V.
    pub fn page_elems(&self) -> usize {
        self.num_kv_heads * self.block_size * self.head_dim
    }

    /// Elements in one block-head entry (one head of one page) of K or of V.
    pub fn entry_elems(&self) -> usize {
        self.block_size * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enormous_sizes_are_config_errors() {
        let huge = usize::MAX / 2 + 1;
        for (hq, hk, d, bs) in [(2, 1, 256, huge), (huge, huge, 128, 16), (huge, 1, 2, 1)] {
            let err = KvGeometry::new(hq, hk, d, bs).unwrap_err();
            assert!(
                matches!(err, OasisError::Config(ref m) if m.contains("overflow")),
                "{err}"
            );
        }
        let g = KvGeometry::new(32, 8, 128, 1 << 40).unwrap();
        assert_eq!(g.entry_elems(), 128 << 40);
        let bad = KvGeometry {
            block_size: huge,
            ..g
        };
        assert!(bad.validate().is_err());
    }
}
