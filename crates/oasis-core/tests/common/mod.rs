//! Fixtures shared by the integration tests of `oasis-core` (`mod common;`) and by
//! `benches/core_kernels.rs`, which includes this file through `#[path]`: a bench cannot depend
//! on a test module, and a `pub` test-support module in the library would need a cargo feature
//! for a few lines of RNG.

// Each test binary uses a part of this module.
#![allow(dead_code)]

/// SplitMix64: reproducible data from one seed (in the property tests, a proptest-chosen one),
/// with no RNG crate.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// Uniform in `[-1, 1)`, on a 2^-23 grid.
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}
