//! [`BlockPool`]: the free list behind one memory tier (the GPU page pool or the host pool).
//!
//! The pool only hands out and takes back block ids; the bytes live in buffers owned elsewhere.
//! Invariants (checked by the tests):
//! * an id is either free or allocated, never both, and `0 <= id < num_blocks`;
//! * [`BlockPool::allocate`] is all-or-nothing: on error nothing is allocated;
//! * [`BlockPool::free`] is all-or-nothing: a double free or an out-of-range id frees nothing.
//!
//! Freed ids are reused first (LIFO), so a request that finishes and a request that starts touch
//! the same, recently used memory.

use crate::error::{OasisError, Result, Tier};

#[derive(Debug, Clone)]
pub struct BlockPool {
    tier: Tier,
    /// Free ids; the next allocation pops from the end.
    free: Vec<u32>,
    /// `is_free[id]`, for O(1) double-free detection.
    is_free: Vec<bool>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks with ids `0..num_blocks`; the first allocation returns
    /// the lowest ids in ascending order.
    ///
    /// NOTE: ids are `u32` (and GPU tables are `i32`), so `num_blocks` is clamped to
    /// `i32::MAX`; [`BlockPool::num_blocks`] reports the clamped value.
    pub fn new(tier: Tier, num_blocks: usize) -> Self {
        // i32::MAX fits both u32 and every usize this crate builds for.
        let n = num_blocks.min(i32::MAX as usize) as u32;
        Self {
            tier,
            free: (0..n).rev().collect(),
            is_free: vec![true; n as usize],
        }
    }

    /// The tier this pool manages (used in error messages).
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Total number of blocks, free or not.
    pub fn num_blocks(&self) -> usize {
        self.is_free.len()
    }

    /// Number of blocks currently free.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Whether `id` is a free block of this pool (false for ids out of range).
    pub fn is_free(&self, id: u32) -> bool {
        self.is_free.get(id as usize).copied().unwrap_or(false)
    }

    /// Allocate `n` distinct blocks.
    ///
    /// # Errors
    /// [`OasisError::OutOfBlocks`] when fewer than `n` blocks are free; nothing is allocated then.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(OasisError::OutOfBlocks {
                tier: self.tier,
                requested: n,
                free: self.free.len(),
            });
        }
        let ids = self.free.split_off(self.free.len() - n);
        // `split_off` keeps the stack order; hand them out in pop order (most recently freed first).
        let ids: Vec<u32> = ids.into_iter().rev().collect();
        for &id in &ids {
            self.is_free[id as usize] = false;
        }
        Ok(ids)
    }

    /// Return blocks to the pool. A later [`BlockPool::allocate`] returns them first, in the
    /// order given here.
    ///
    /// # Errors
    /// [`OasisError::Invalid`] when an id is out of range, already free, or listed twice; nothing
    /// is freed then.
    pub fn free(&mut self, ids: &[u32]) -> Result<()> {
        for (i, &id) in ids.iter().enumerate() {
            let err = match self.is_free.get(id as usize) {
                None => Some(format!(
                    "cannot free block {id}: out of range 0..{} of the {}",
                    self.is_free.len(),
                    self.tier
                )),
                Some(true) => Some(format!("double free of block {id} in the {}", self.tier)),
                Some(false) => None,
            };
            if let Some(msg) = err {
                // Roll back the ids of this call marked so far: all-or-nothing.
                for &done in &ids[..i] {
                    self.is_free[done as usize] = false;
                }
                return Err(OasisError::Invalid(msg));
            }
            // Marked now so that an id listed twice in `ids` is caught as a double free.
            self.is_free[id as usize] = true;
        }
        self.free.extend(ids.iter().rev());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn allocates_distinct_ids_in_range() {
        let mut pool = BlockPool::new(Tier::Gpu, 10);
        assert_eq!(pool.num_blocks(), 10);
        let a = pool.allocate(4).unwrap();
        assert_eq!(a, vec![0, 1, 2, 3]);
        let b = pool.allocate(6).unwrap();
        let all: HashSet<u32> = a.iter().chain(&b).copied().collect();
        assert_eq!(all.len(), 10);
        assert!(all.iter().all(|&id| id < 10));
        assert_eq!(pool.num_free(), 0);
        assert_eq!(pool.allocate(0).unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let mut pool = BlockPool::new(Tier::Host, 5);
        pool.allocate(3).unwrap();
        let err = pool.allocate(3).unwrap_err();
        assert_eq!(
            err,
            OasisError::OutOfBlocks {
                tier: Tier::Host,
                requested: 3,
                free: 2
            }
        );
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.allocate(2).unwrap().len(), 2);
    }

    #[test]
    fn free_is_lifo_and_all_or_nothing() {
        let mut pool = BlockPool::new(Tier::Gpu, 8);
        let ids = pool.allocate(8).unwrap();
        pool.free(&[5, 2]).unwrap();
        assert!(pool.is_free(5) && pool.is_free(2) && !pool.is_free(3));
        assert_eq!(pool.allocate(2).unwrap(), vec![5, 2]);

        // Double free of an id freed earlier: nothing in the call is freed.
        pool.free(&[1]).unwrap();
        assert!(matches!(pool.free(&[0, 1]), Err(OasisError::Invalid(_))));
        assert!(!pool.is_free(0));
        assert_eq!(pool.num_free(), 1);
        // An id listed twice in one call.
        assert!(matches!(pool.free(&[3, 3]), Err(OasisError::Invalid(_))));
        assert!(!pool.is_free(3));
        // Out of range.
        assert!(matches!(pool.free(&[4, 8]), Err(OasisError::Invalid(_))));
        assert!(!pool.is_free(4));
        assert!(!pool.is_free(8));
        assert_eq!(pool.num_free(), 1);

        let rest: Vec<u32> = ids.into_iter().filter(|&id| id != 1).collect();
        pool.free(&rest).unwrap();
        assert_eq!(pool.num_free(), 8);
        let again: HashSet<u32> = pool.allocate(8).unwrap().into_iter().collect();
        assert_eq!(again.len(), 8);
    }

    #[test]
    fn empty_pool() {
        let mut pool = BlockPool::new(Tier::Gpu, 0);
        assert_eq!(pool.num_blocks(), 0);
        assert!(pool.allocate(0).unwrap().is_empty());
        assert!(matches!(
            pool.allocate(1),
            Err(OasisError::OutOfBlocks { .. })
        ));
        assert!(matches!(pool.free(&[0]), Err(OasisError::Invalid(_))));
        assert!(!pool.is_free(0));
    }
}
