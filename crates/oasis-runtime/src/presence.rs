//! [`PresenceMap`]: which staged block-heads the decode side's host pool holds.
//!
//! A request admitted from a staging daemon (disaggregation, issue 11) owns host rows whose bytes
//! arrive over the network, one *entry* `(layer, host row, KV head)` at a time (a head's K and V
//! rows of one block in one layer). The map records, per host row, the staged request that owns it
//! and the logical block it holds, and per entry whether its bytes are there. The coordinator asks
//! it which entries of a step's plan are absent ([`PresenceMap::absent`]), reads those, and marks
//! them present ([`PresenceMap::mark_present`]).
//!
//! Invariants ([`PresenceMap::check_invariants`], and a property test against a plain model):
//! * a row that holds no staged block (a local row, a released one, a bounded cache's filler) has
//!   every entry present: there is nothing to read;
//! * `missing` is the number of absent entries, all layers;
//! * an entry is marked present only by a read, or when its row stops holding a staged block
//!   ([`PresenceMap::forget_row`], [`PresenceMap::release`]).

use std::collections::HashSet;

use oasis_core::{OasisError, Result};

/// `head` of a key that names every head of its row (a whole block).
pub const ALL_HEADS: u16 = u16::MAX;

/// No staged request owns the row.
pub const LOCAL: i64 = -1;

/// One entry: a head's K and V rows of one block in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Entry {
    pub layer: u16,
    pub row: u32,
    pub head: u16,
}

/// The presence of the staged block-heads in the host pool (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PresenceMap {
    layers: usize,
    heads: usize,
    rows: usize,
    /// Per row: the engine request id of the staged request that holds it ([`LOCAL`]: none).
    owner: Vec<i64>,
    /// Per row: the logical block it holds (meaningful while it holds a staged block).
    logical: Vec<u32>,
    /// Per row: whether it holds a staged block (its entries may be absent).
    staged: Vec<bool>,
    /// `[layer][row][head]`, row-major: whether the entry's bytes are in the host pool.
    present: Vec<bool>,
    missing: u64,
}

impl PresenceMap {
    /// An empty map of `layers` layers and `heads` KV heads (no rows yet: [`Self::grow`]).
    ///
    /// # Errors
    /// [`OasisError::Config`] unless both are in `1..=u16::MAX - 1`.
    pub fn new(layers: usize, heads: usize) -> Result<Self> {
        if layers == 0 || layers >= usize::from(u16::MAX) {
            return Err(OasisError::Config(format!(
                "layers must be in 1..65535, got {layers}"
            )));
        }
        if heads == 0 || heads >= usize::from(ALL_HEADS) {
            return Err(OasisError::Config(format!(
                "KV heads must be in 1..65535, got {heads}"
            )));
        }
        Ok(PresenceMap {
            layers,
            heads,
            rows: 0,
            owner: Vec::new(),
            logical: Vec::new(),
            staged: Vec::new(),
            present: Vec::new(),
            missing: 0,
        })
    }

    /// `(layers, rows, heads)`.
    pub fn shape(&self) -> (usize, usize, usize) {
        (self.layers, self.rows, self.heads)
    }

    /// Absent entries, all layers.
    pub fn missing(&self) -> u64 {
        self.missing
    }

    /// The staged request holding `row` ([`LOCAL`]: none) and its logical block.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a row past the map.
    pub fn owner_of(&self, row: u32) -> Result<(i64, u32)> {
        let r = self.check_row(row)?;
        Ok((self.owner[r], self.logical[r]))
    }

    /// Whether entry `e` holds its bytes.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for an entry past the map (or [`ALL_HEADS`]).
    pub fn is_present(&self, e: Entry) -> Result<bool> {
        self.check_entry(e, false)?;
        Ok(self.present[self.index(e.layer, e.row as usize, e.head)])
    }

    /// Cover `rows` host rows (the pools grew; new rows are local). Never shrinks.
    ///
    /// # Errors
    /// [`OasisError::Config`] past `u32::MAX` rows.
    pub fn grow(&mut self, rows: usize) -> Result<()> {
        if rows <= self.rows {
            return Ok(());
        }
        if u32::try_from(rows).is_err() {
            return Err(OasisError::Config(format!(
                "host rows must fit u32, got {rows}"
            )));
        }
        let (l, h, old) = (self.layers, self.heads, self.rows);
        let mut present = vec![true; l * rows * h];
        for layer in 0..l {
            let src = &self.present[layer * old * h..(layer + 1) * old * h];
            present[layer * rows * h..layer * rows * h + old * h].copy_from_slice(src);
        }
        self.present = present;
        self.owner.resize(rows, LOCAL);
        self.logical.resize(rows, 0);
        self.staged.resize(rows, false);
        self.rows = rows;
        Ok(())
    }

    /// `row` names `owner` without holding a staged block (a bounded cache's filler row).
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a row past the map or one holding a staged block.
    pub fn set_owner(&mut self, row: u32, owner: i64) -> Result<()> {
        let r = self.check_row(row)?;
        if self.staged[r] {
            return Err(OasisError::Invalid(format!(
                "host row {row} holds staged block {} of request {}: forget it first",
                self.logical[r], self.owner[r]
            )));
        }
        self.owner[r] = owner;
        Ok(())
    }

    /// Host row `row` now holds staged block `logical` of request `owner`: every entry absent.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a row past the map, one already holding a staged block, or a
    /// negative owner.
    pub fn take_row(&mut self, row: u32, owner: i64, logical: u32) -> Result<()> {
        let r = self.check_row(row)?;
        if owner < 0 {
            return Err(OasisError::Invalid(format!(
                "owner must be a request id >= 0, got {owner}"
            )));
        }
        if self.staged[r] {
            return Err(OasisError::Invalid(format!(
                "host row {row} already holds staged block {} of request {}",
                self.logical[r], self.owner[r]
            )));
        }
        self.owner[r] = owner;
        self.logical[r] = logical;
        self.staged[r] = true;
        for layer in 0..self.layers {
            let at = self.index(layer as u16, r, 0);
            self.present[at..at + self.heads].fill(false);
        }
        self.missing += (self.layers * self.heads) as u64;
        Ok(())
    }

    /// The block in `row` was evicted: its bytes are gone and nothing is left to read of it (the
    /// row stays with its owner, holding no staged block). Returns how many of its entries held
    /// their bytes.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a row past the map.
    pub fn forget_row(&mut self, row: u32) -> Result<u64> {
        let r = self.check_row(row)?;
        Ok(self.clear_row(r))
    }

    /// A staged request's `rows` go back to the pool: local again, nothing to read. Returns how
    /// many of their entries held their bytes.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a row past the map (nothing changes then).
    pub fn release(&mut self, rows: &[u32]) -> Result<u64> {
        for &row in rows {
            self.check_row(row)?;
        }
        let mut had = 0;
        for &row in rows {
            had += self.clear_row(row as usize);
            self.owner[row as usize] = LOCAL;
        }
        Ok(had)
    }

    /// Entries now in the host pool (a key with `head` [`ALL_HEADS`]: every head of its row).
    /// Returns, per key, how many of its entries were absent before (a row holding no staged
    /// block has none).
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a key past the map (nothing changes then).
    pub fn mark_present(&mut self, keys: &[Entry]) -> Result<Vec<u32>> {
        for &k in keys {
            self.check_entry(k, true)?;
        }
        let mut out = Vec::with_capacity(keys.len());
        for &k in keys {
            let heads = if k.head == ALL_HEADS {
                0..self.heads as u16
            } else {
                k.head..k.head + 1
            };
            let mut new = 0u32;
            for h in heads {
                let i = self.index(k.layer, k.row as usize, h);
                if !self.present[i] {
                    self.present[i] = true;
                    new += 1;
                }
            }
            self.missing -= u64::from(new);
            out.push(new);
        }
        Ok(out)
    }

    /// Entries whose bytes are no longer to be trusted (a prefetch that landed in pools since
    /// replaced): absent again, to be read again. Only rows holding a staged block change (a
    /// local row has nothing to read); `keys` name one head each. Returns how many were present.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a key past the map or [`ALL_HEADS`] (nothing changes then).
    pub fn mark_absent(&mut self, keys: &[Entry]) -> Result<u64> {
        for &k in keys {
            self.check_entry(k, false)?;
        }
        let mut n = 0;
        for &k in keys {
            if !self.staged[k.row as usize] {
                continue;
            }
            let i = self.index(k.layer, k.row as usize, k.head);
            if self.present[i] {
                self.present[i] = false;
                n += 1;
            }
        }
        self.missing += n;
        Ok(n)
    }

    /// The entries among `keys` not in the host pool, each once and none of a `failed` request,
    /// sorted by (layer, row, head): the order a read wants them. A key with `head`
    /// [`ALL_HEADS`] stands for every head of its row.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] for a key past the map.
    pub fn absent(&self, keys: &[Entry], failed: &HashSet<i64>) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        if self.missing == 0 {
            for &k in keys {
                self.check_entry(k, true)?;
            }
            return Ok(out);
        }
        for &k in keys {
            self.check_entry(k, true)?;
            let r = k.row as usize;
            if !self.staged[r] || failed.contains(&self.owner[r]) {
                continue;
            }
            let heads = if k.head == ALL_HEADS {
                0..self.heads as u16
            } else {
                k.head..k.head + 1
            };
            for h in heads {
                if !self.present[self.index(k.layer, r, h)] {
                    out.push(Entry {
                        layer: k.layer,
                        row: k.row,
                        head: h,
                    });
                }
            }
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// Check every invariant (tests and debug builds).
    ///
    /// # Errors
    /// [`OasisError::Invalid`] describing the first violation.
    pub fn check_invariants(&self) -> Result<()> {
        let bad = |m: String| Err(OasisError::Invalid(m));
        let (l, r, h) = (self.layers, self.rows, self.heads);
        if self.present.len() != l * r * h || self.owner.len() != r || self.staged.len() != r {
            return bad("the maps' sizes disagree with (layers, rows, heads)".into());
        }
        let mut absent = 0u64;
        for row in 0..r {
            for layer in 0..l {
                let at = self.index(layer as u16, row, 0);
                let gone = self.present[at..at + h].iter().filter(|p| !**p).count() as u64;
                if gone > 0 && !self.staged[row] {
                    return bad(format!(
                        "row {row} holds no staged block but has absent entries"
                    ));
                }
                absent += gone;
            }
            if self.staged[row] && self.owner[row] < 0 {
                return bad(format!("row {row} holds a staged block of no request"));
            }
        }
        if absent != self.missing {
            return bad(format!(
                "missing is {} but {absent} entries are absent",
                self.missing
            ));
        }
        Ok(())
    }

    fn clear_row(&mut self, r: usize) -> u64 {
        if !self.staged[r] {
            return 0;
        }
        let mut had = 0u64;
        for layer in 0..self.layers {
            let at = self.index(layer as u16, r, 0);
            let slice = &mut self.present[at..at + self.heads];
            let here = slice.iter().filter(|p| **p).count() as u64;
            had += here;
            self.missing -= self.heads as u64 - here;
            slice.fill(true);
        }
        self.staged[r] = false;
        had
    }

    fn index(&self, layer: u16, row: usize, head: u16) -> usize {
        (usize::from(layer) * self.rows + row) * self.heads + usize::from(head)
    }

    fn check_row(&self, row: u32) -> Result<usize> {
        let r = row as usize;
        if r >= self.rows {
            return Err(OasisError::Invalid(format!(
                "host row {row} is past the presence map's {} rows (grow it with the pools)",
                self.rows
            )));
        }
        Ok(r)
    }

    fn check_entry(&self, e: Entry, all_heads: bool) -> Result<()> {
        self.check_row(e.row)?;
        if usize::from(e.layer) >= self.layers {
            return Err(OasisError::Invalid(format!(
                "layer {} is past the model's {} layers",
                e.layer, self.layers
            )));
        }
        if usize::from(e.head) >= self.heads && !(all_heads && e.head == ALL_HEADS) {
            return Err(OasisError::Invalid(format!(
                "KV head {} is past the model's {} KV heads",
                e.head, self.heads
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
