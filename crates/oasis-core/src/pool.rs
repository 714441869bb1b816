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

use crate::error::{try_vec, OasisError, Result, Tier};

#[derive(Debug, Clone)]
pub struct BlockPool {
    tier: Tier,
    /// Free ids; the next allocation pops from the end.
    free: Vec<u32>,
    /// `is_free[id]`, for O(1) double-free detection.
    is_free: Vec<bool>,
}

/// Largest pool: ids are `u32` here and `i32` in the GPU tables ([`crate::limits::MAX_POOL_BLOCKS`]).
pub const MAX_BLOCKS: usize = crate::limits::MAX_POOL_BLOCKS;

impl BlockPool {
    /// A pool of `num_blocks` free blocks with ids `0..num_blocks`; the first allocation returns
    /// the lowest ids in ascending order. The pool's own bookkeeping takes 5 bytes per block.
    ///
    /// # Errors
    /// * [`OasisError::Config`] when `num_blocks` exceeds [`MAX_BLOCKS`];
    /// * [`OasisError::OutOfMemory`] when the bookkeeping cannot be allocated (never an abort).
    pub fn try_new(tier: Tier, num_blocks: usize) -> Result<Self> {
        if num_blocks > MAX_BLOCKS {
            return Err(OasisError::Config(format!(
                "a {tier} holds at most {MAX_BLOCKS} blocks (int32 ids), got num_blocks={num_blocks}"
            )));
        }
        let mut free = try_vec("the free list of a block pool", num_blocks)?;
        let mut is_free = try_vec("the free flags of a block pool", num_blocks)?;
        // Both fit the capacity reserved above: no reallocation.
        free.extend((0..num_blocks as u32).rev());
        is_free.resize(num_blocks, true);
        Ok(Self {
            tier,
            free,
            is_free,
        })
    }

    /// [`BlockPool::try_new`] for sizes known to be small (tests, fixed pools).
    ///
    /// NOTE: `num_blocks` is clamped to [`MAX_BLOCKS`]; [`BlockPool::num_blocks`] reports the
    /// clamped value.
    ///
    /// # Panics
    /// When the bookkeeping cannot be allocated. Code that takes the size from a user calls
    /// [`BlockPool::try_new`].
    pub fn new(tier: Tier, num_blocks: usize) -> Self {
        match Self::try_new(tier, num_blocks.min(MAX_BLOCKS)) {
            Ok(pool) => pool,
            Err(e) => panic!("{e}"),
        }
    }

    /// Grow the pool to `num_blocks` blocks (a no-op when it has as many): ids `old..num_blocks`
    /// become free, handed out after the blocks free now. The engine grows its pool tensors as
    /// admitted requests need them, so a pool starts small.
    ///
    /// # Errors
    /// [`OasisError::Config`] past [`MAX_BLOCKS`]; [`OasisError::OutOfMemory`] when the
    /// bookkeeping cannot grow. The pool is unchanged then.
    pub fn grow(&mut self, num_blocks: usize) -> Result<()> {
        let old = self.is_free.len();
        if num_blocks <= old {
            return Ok(());
        }
        if num_blocks > MAX_BLOCKS {
            return Err(OasisError::Config(format!(
                "a {} holds at most {MAX_BLOCKS} blocks (int32 ids), got num_blocks={num_blocks}",
                self.tier
            )));
        }
        let more = num_blocks - old;
        let mut free: Vec<u32> = try_vec("the free list of a block pool", self.free.len() + more)?;
        let oom = |_| OasisError::OutOfMemory {
            what: "the free flags of a block pool",
            bytes: num_blocks as u128,
        };
        self.is_free.try_reserve_exact(more).map_err(oom)?;
        // New ids go under the free stack: the blocks free now are still reused first.
        free.extend((old as u32..num_blocks as u32).rev());
        free.append(&mut self.free);
        self.free = free;
        self.is_free.resize(num_blocks, true);
        Ok(())
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
    fn grow_keeps_holdings_and_reuses_freed_first() {
        let mut pool = BlockPool::try_new(Tier::Gpu, 3).unwrap();
        let a = pool.allocate(3).unwrap();
        pool.free(&[1]).unwrap();
        pool.grow(5).unwrap();
        assert_eq!(pool.num_blocks(), 5);
        assert_eq!(pool.num_free(), 3);
        assert_eq!(pool.allocate(1).unwrap(), vec![1]);
        assert_eq!(pool.allocate(2).unwrap(), vec![3, 4]);
        assert!(!pool.is_free(a[0]));
        pool.grow(2).unwrap(); // never shrinks
        assert_eq!(pool.num_blocks(), 5);
        assert!(matches!(
            BlockPool::try_new(Tier::Host, 1 << 40),
            Err(OasisError::Config(_))
        ));
    }

    #[test]
    fn oversized_pools_are_errors_not_aborts() {
        let err = BlockPool::try_new(Tier::Gpu, 1 << 40).unwrap_err();
        assert!(matches!(err, OasisError::Config(ref m) if m.contains("at most 2147483647")));
        let err = BlockPool::try_new(Tier::Host, MAX_BLOCKS + 1).unwrap_err();
        assert!(matches!(err, OasisError::Config(_)));
        let pool = BlockPool::try_new(Tier::Host, 3).unwrap();
        assert_eq!((pool.num_blocks(), pool.num_free()), (3, 3));
        assert_eq!(BlockPool::new(Tier::Gpu, 5).num_blocks(), 5);
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
