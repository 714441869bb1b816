//! The pinned host pool as the coordinator sees it: raw addresses per layer ([`PoolLayout`]),
//! and where one read entry's bytes go ([`Dest`]).
//!
//! The pools are the engine's torch tensors `host_k[layer]` / `host_v[layer]`, each contiguous
//! `[rows, num_kv_heads, block_size, head_dim]`, and with an fp8 host tier (`kv_format` 1) the
//! float32 scales `host_k_scales[layer]` / `host_v_scales[layer]` `[rows, num_kv_heads]`. An
//! entry on the wire is `[2 (K, V)][heads]` segments: a head's rows, then (fp8) its scale.

use oasis_runtime::presence::ALL_HEADS;
use oasis_runtime::Entry;

use crate::error::{CoordError, Result};

/// Bytes of a float32 scale.
pub const SCALE_BYTES: usize = 4;

/// One layer's pools: base addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerPool {
    /// `host_k[layer]`: `[rows, heads, block_size, head_dim]`, contiguous.
    pub k: usize,
    /// `host_v[layer]`: as `k`.
    pub v: usize,
    /// fp8 only: `host_k_scales[layer]` and `host_v_scales[layer]`, float32 `[rows, heads]`.
    pub scales: Option<(usize, usize)>,
}

/// Every layer's pools, all of one shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLayout {
    pub layers: Vec<LayerPool>,
    pub rows: usize,
    pub heads: usize,
    /// Bytes of one head's rows of one block (`block_size * head_dim * elem_size`).
    pub head_bytes: usize,
}

impl PoolLayout {
    /// Check the layout's own consistency.
    ///
    /// # Errors
    /// [`CoordError::Invalid`] for no layers, zero heads or head bytes, or layers that disagree
    /// on having scales.
    pub fn validate(&self) -> Result<()> {
        if self.layers.is_empty() || self.heads == 0 || self.head_bytes == 0 {
            return Err(CoordError::Invalid(format!(
                "pools need at least one layer, head and byte per head (got {} layers, {} heads, \
                 {} bytes per head)",
                self.layers.len(),
                self.heads,
                self.head_bytes
            )));
        }
        let fp8 = self.layers[0].scales.is_some();
        if self.layers.iter().any(|l| l.scales.is_some() != fp8) {
            return Err(CoordError::Invalid(
                "pass scales for every layer (an fp8 pool) or for none".into(),
            ));
        }
        Ok(())
    }

    /// Whether the pools are fp8 (codes and scales).
    pub fn fp8(&self) -> bool {
        self.layers[0].scales.is_some()
    }

    /// Bytes of one block-head on the wire (K and V; fp8: codes and scales).
    pub fn head_entry_bytes(&self) -> usize {
        2 * (self.head_bytes + if self.fp8() { SCALE_BYTES } else { 0 })
    }

    /// Where entry `e` goes ([`ALL_HEADS`]: every head of its row).
    ///
    /// # Errors
    /// [`CoordError::Invalid`] for an entry past the pools.
    pub fn dest(&self, e: Entry) -> Result<Dest> {
        let l = usize::from(e.layer);
        let row = e.row as usize;
        let pool = self.layers.get(l).ok_or_else(|| {
            CoordError::Invalid(format!(
                "layer {} is past the pools' {} layers",
                e.layer,
                self.layers.len()
            ))
        })?;
        if row >= self.rows {
            return Err(CoordError::Invalid(format!(
                "host row {row} is outside the pools' {} rows",
                self.rows
            )));
        }
        let (first, heads) = match e.head {
            ALL_HEADS => (row * self.heads, self.heads),
            h if usize::from(h) < self.heads => (row * self.heads + usize::from(h), 1),
            h => {
                return Err(CoordError::Invalid(format!(
                    "head {h} is not one of the pools' {} heads",
                    self.heads
                )))
            }
        };
        Ok(Dest {
            k: pool.k + first * self.head_bytes,
            v: pool.v + first * self.head_bytes,
            scales: pool
                .scales
                .map(|(ks, vs)| (ks + first * SCALE_BYTES, vs + first * SCALE_BYTES)),
            heads,
            head_bytes: self.head_bytes,
        })
    }
}

/// Where one entry is written: its heads' K rows from `k` on and V rows from `v` on, and with
/// an fp8 pool each head's scales from `scales` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    pub k: usize,
    pub v: usize,
    pub scales: Option<(usize, usize)>,
    /// 1 (a block-head) or every head of the row (a whole block).
    pub heads: usize,
    pub head_bytes: usize,
}

impl Dest {
    fn segment(&self) -> usize {
        self.head_bytes + self.scales.map_or(0, |_| SCALE_BYTES)
    }

    /// The entry's length on the wire: what [`Dest::write`] takes.
    pub fn entry_bytes(&self) -> usize {
        2 * self.heads * self.segment()
    }

    /// Copy an entry of [`Self::entry_bytes`] into the pools.
    ///
    /// # Safety
    /// 1. `src.len() == self.entry_bytes()`.
    /// 2. The destinations (`heads * head_bytes` bytes from `k` and from `v`; `heads * 4` from
    ///    each scale address) lie inside live memory that nothing else reads or writes during
    ///    the call, and none of them overlaps `src`.
    pub unsafe fn write(&self, src: &[u8]) {
        debug_assert_eq!(src.len(), self.entry_bytes());
        let p = src.as_ptr();
        let rows = self.heads * self.head_bytes;
        match self.scales {
            // Plain pools: the K half, then the V half, each contiguous on both sides.
            None => unsafe {
                std::ptr::copy_nonoverlapping(p, self.k as *mut u8, rows);
                std::ptr::copy_nonoverlapping(p.add(rows), self.v as *mut u8, rows);
            },
            Some((ks, vs)) => {
                let seg = self.segment();
                for (side, (rows_at, scales_at)) in
                    [(self.k, ks), (self.v, vs)].into_iter().enumerate()
                {
                    for j in 0..self.heads {
                        let at = (side * self.heads + j) * seg;
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                p.add(at),
                                (rows_at + j * self.head_bytes) as *mut u8,
                                self.head_bytes,
                            );
                            std::ptr::copy_nonoverlapping(
                                p.add(at + self.head_bytes),
                                (scales_at + j * SCALE_BYTES) as *mut u8,
                                SCALE_BYTES,
                            );
                        }
                    }
                }
            }
        }
    }
}
