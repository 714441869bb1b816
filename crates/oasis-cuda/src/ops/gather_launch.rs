//! How the gather kernels are launched (`gather_blocks_*`, the kv8 gathers): the process-wide
//! [`GatherLaunch`]es (blocks, warps, entries per warp, entries staged through shared memory), one
//! for float host pools and one for kv8 host pools, the stage that fits a device's shared memory
//! for bf16 and for kv8 entries, and the grid of a gather. The shapes trade PCIe reads in flight
//! against SMs held beside the compute stream.

use std::sync::{Mutex, PoisonError};

use oasis_core::OasisError;

use crate::error::{CudaError, Result};

/// Threads per block of the copy kernels; must match OASIS_COPY_THREADS in cuda/gather_blocks.cu.
pub const COPY_THREADS: u32 = 128;
/// How `gather_blocks_*` is launched: at most `max_blocks` blocks (0: no cap) of
/// `warps_per_block` warps, each warp checking `entries_per_warp` plan entries per pass and
/// copying `stage_entries` of them at once through shared memory (0: one at a time through
/// registers). Any values are correct (the warps stride over the plan); they trade how many PCIe
/// reads are in flight against how many SMs hold blocks waiting on them beside the compute
/// stream's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherLaunch {
    pub max_blocks: usize,
    pub warps_per_block: u32,
    pub entries_per_warp: u32,
    pub stage_entries: u32,
}

impl GatherLaunch {
    /// The best of the shapes swept on the H200 (docs/PERF.md, "The gather off the GEMMs' SMs"):
    /// four blocks of four warps, each warp with six entries in flight (192 KiB of shared memory
    /// per block for bf16 blocks of 16 x 128). Before the staged path, one block per 32 entries
    /// (0 : 4 : 8 : 0) was best; at 40 x 16K it takes 1.32x the step time of this one.
    pub const DEFAULT: Self = Self {
        max_blocks: 4,
        warps_per_block: 4,
        entries_per_warp: 32,
        stage_entries: 6,
    };

    /// The launch of a gather from a kv8 host pool ([`gather_launch_kv8`]'s default): one block
    /// of four warps per 32 entries, each entry through registers. A kv8 entry is dequantized
    /// (or copied with its scales) by its warp, so the few blocks of [`Self::DEFAULT`] leave PCIe
    /// idle while they convert: on an H100 (s20, 65,536 entries of 16 x 128 codes into bf16) this
    /// launch took 8.3 ms against 29.4 ms for `DEFAULT`'s staged shape and 14.1 ms for that shape
    /// on 132 blocks; a 86 x 16K Fig. 11 step over an fp8 host pool, 40.4 ms against 62.2 ms.
    pub const KV8_SOURCE: Self = Self {
        max_blocks: 0,
        warps_per_block: 4,
        entries_per_warp: 8,
        stage_entries: 0,
    };

    /// The launch of a gather whose source pool is in device memory (the all-resident oracle,
    /// `Engine(host_pool="device")`): HBM reads need many blocks, not a few with deep queues, and
    /// this is the launch the oracle was measured with before the staged path.
    pub const DEVICE_SOURCE: Self = Self {
        max_blocks: 0,
        warps_per_block: 4,
        entries_per_warp: 8,
        stage_entries: 0,
    };

    /// Entries a warp stages at once for entries of `entry_bytes` (K or V of one block-head),
    /// within `max_smem` bytes of shared memory per block: `stage_entries`, lowered to what fits;
    /// 0 (the register path) when none fits or the entry is not a multiple of 16 bytes.
    pub fn stage_for(&self, entry_bytes: usize, max_smem: usize) -> u32 {
        if self.stage_entries == 0 || entry_bytes == 0 || !entry_bytes.is_multiple_of(16) {
            return 0;
        }
        let fits = (max_smem / self.stage_smem_bytes(1, entry_bytes)).min(u32::MAX as usize) as u32;
        self.stage_entries.min(fits)
    }

    /// Shared memory of one block staging `stage` entries per warp: K and V of each, for every
    /// warp (the kernel's layout, cuda/gather_blocks.cu).
    pub fn stage_smem_bytes(&self, stage: u32, entry_bytes: usize) -> usize {
        2 * entry_bytes * stage as usize * self.warps_per_block as usize
    }

    /// Entries a warp stages at once in a gather from a kv8 host pool, for entries of
    /// `code_bytes` codes (K or V of one block-head): [`KV8_STAGE_FACTOR`] x `stage_entries`, so
    /// a warp keeps the bytes in flight of the bf16 gather's stage (a kv8 entry is half a bf16
    /// one), at most [`MAX_STAGE_ENTRIES`] and lowered to what fits `max_smem`; 0 (the register
    /// paths) when none fits, `stage_entries` is 0 or the entry is not a multiple of 16 bytes.
    pub fn kv8_stage_for(&self, code_bytes: usize, max_smem: usize) -> u32 {
        if self.stage_entries == 0 || code_bytes == 0 || !code_bytes.is_multiple_of(16) {
            return 0;
        }
        let mut stage = self
            .stage_entries
            .saturating_mul(KV8_STAGE_FACTOR)
            .min(MAX_STAGE_ENTRIES);
        while stage > 0 && self.kv8_stage_smem_bytes(stage, code_bytes) > max_smem {
            stage -= 1;
        }
        stage
    }

    /// Shared memory of one block of a kv8 gather staging `stage` entries per warp: K and V codes
    /// of each, then their two f32 scales rounded up to 16 bytes, for every warp (the kernel's
    /// layout: `kv8_stage_words` in cuda/gather_blocks.cu).
    pub fn kv8_stage_smem_bytes(&self, stage: u32, code_bytes: usize) -> usize {
        let stage = stage as usize;
        (2 * code_bytes * stage + (8 * stage).next_multiple_of(16)) * self.warps_per_block as usize
    }
}

/// How many more entries a warp stages from a kv8 host pool than `stage_entries`: a kv8 entry
/// (1-byte codes) is half a bf16 entry, and a PCIe round trip moves the bytes in flight, so twice
/// the entries keep the bf16 gather's bytes (and bandwidth). Follows from the tuned bf16 shape.
pub const KV8_STAGE_FACTOR: u32 = 2;

/// Largest `stage_entries` of a [`GatherLaunch`] (a warp's batch is a 32-bit lane mask).
pub const MAX_STAGE_ENTRIES: u32 = 32;

/// One lock per setting, so a launch never reads half of a concurrent setting.
static GATHER_LAUNCH: Mutex<GatherLaunch> = Mutex::new(GatherLaunch::DEFAULT);
static GATHER_LAUNCH_KV8: Mutex<GatherLaunch> = Mutex::new(GatherLaunch::KV8_SOURCE);

/// Refuse a launch outside the kernels' bounds.
///
/// # Errors
/// [`CudaError::Invalid`] unless 1 <= warps_per_block <= COPY_THREADS / 32,
/// 1 <= entries_per_warp <= 32 and stage_entries <= MAX_STAGE_ENTRIES.
fn check_launch(l: GatherLaunch) -> Result<()> {
    if !(1..=COPY_THREADS / 32).contains(&l.warps_per_block)
        || !(1..=32).contains(&l.entries_per_warp)
        || l.stage_entries > MAX_STAGE_ENTRIES
    {
        return Err(CudaError::Invalid(OasisError::Invalid(format!(
            "gather launch: warps_per_block must be 1..={} and entries_per_warp 1..=32, got {} and {}; \
             stage_entries 0..={MAX_STAGE_ENTRIES}, got {}",
            COPY_THREADS / 32,
            l.warps_per_block,
            l.entries_per_warp,
            l.stage_entries
        ))));
    }
    Ok(())
}

/// Set the process-wide [`GatherLaunch`] of gathers from float host pools; takes effect at the
/// next launch (a captured graph keeps the launch it was captured with).
///
/// # Errors
/// As [`check_launch`].
pub fn set_gather_launch(l: GatherLaunch) -> Result<()> {
    check_launch(l)?;
    *GATHER_LAUNCH.lock().unwrap_or_else(PoisonError::into_inner) = l;
    Ok(())
}

/// The current [`GatherLaunch`] of gathers from float host pools.
pub fn gather_launch() -> GatherLaunch {
    *GATHER_LAUNCH.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Set the process-wide [`GatherLaunch`] of gathers from kv8 host pools (default
/// [`GatherLaunch::KV8_SOURCE`]); as [`set_gather_launch`].
///
/// # Errors
/// As [`check_launch`].
pub fn set_gather_launch_kv8(l: GatherLaunch) -> Result<()> {
    check_launch(l)?;
    *GATHER_LAUNCH_KV8
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = l;
    Ok(())
}

/// The current [`GatherLaunch`] of gathers from kv8 host pools.
pub fn gather_launch_kv8() -> GatherLaunch {
    *GATHER_LAUNCH_KV8
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// Blocks of a gather over `entries` plan entries under `l`: one warp per `entries_per_warp`
/// entries, at most `max_blocks` (unless 0), at least one.
pub(crate) fn gather_grid(entries: usize, l: GatherLaunch) -> usize {
    let per_block = (l.warps_per_block * l.entries_per_warp) as usize;
    let natural = entries.div_ceil(per_block).max(1);
    match l.max_blocks {
        0 => natural,
        n => natural.min(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_stage_fits_shared_memory() {
        let l = GatherLaunch {
            max_blocks: 4,
            warps_per_block: 4,
            entries_per_warp: 32,
            stage_entries: 6,
        };
        // bf16 blocks of 16 x 128: 4 KiB of K per entry; 6 x 2 x 4 KiB x 4 warps = 192 KiB fits
        // the H200's 227 KiB.
        assert_eq!(l.stage_for(4096, 227 * 1024), 6);
        // f32 blocks of 32 x 128 (16 KiB of K, 32 KiB with V): one entry per warp fits.
        assert_eq!(l.stage_for(16384, 227 * 1024), 1);
        // Nothing fits, or an entry not a multiple of 16 bytes: the register path.
        assert_eq!(l.stage_for(64 * 1024, 227 * 1024), 0);
        assert_eq!(l.stage_for(4104, 227 * 1024), 0);
        let registers = GatherLaunch {
            stage_entries: 0,
            ..l
        };
        assert_eq!(registers.stage_for(4096, 227 * 1024), 0);
        // The default stages on the H200, and fits an A100's 163 KiB with fewer entries.
        assert_eq!(GatherLaunch::DEFAULT.stage_for(4096, 227 * 1024), 6);
        assert_eq!(GatherLaunch::DEFAULT.stage_for(4096, 163 * 1024), 5);
        // kv8 codes of 16 x 128: twice the entries, the bf16 stage's bytes plus the scales.
        let d = GatherLaunch::DEFAULT;
        assert_eq!(d.kv8_stage_for(2048, 227 * 1024), 12);
        assert_eq!(
            d.kv8_stage_smem_bytes(12, 2048),
            d.stage_smem_bytes(6, 4096) + 4 * 96
        );
        assert_eq!(d.kv8_stage_for(2048, 163 * 1024), 10);
        assert_eq!(d.kv8_stage_for(2048 + 8, 227 * 1024), 0);
        assert_eq!(registers.kv8_stage_for(2048, 227 * 1024), 0);
        // Lowered to what fits (32 x 128 codes: 8 KiB K + V per entry, 7 per warp of four), and
        // capped at the lane mask.
        let wide = GatherLaunch {
            stage_entries: 32,
            ..d
        };
        assert_eq!(wide.kv8_stage_for(4096, 227 * 1024), 7);
        assert_eq!(wide.kv8_stage_for(16, 227 * 1024), MAX_STAGE_ENTRIES);
        assert_eq!(d.kv8_stage_smem_bytes(1, 16), 4 * (32 + 16));
        assert_eq!(d.kv8_stage_smem_bytes(3, 16), 4 * (96 + 32));
        let mut bad = l;
        bad.stage_entries = MAX_STAGE_ENTRIES + 1;
        assert!(set_gather_launch(bad).is_err() && set_gather_launch_kv8(bad).is_err());
        // The kv8 launch stages nothing by default: every entry through registers.
        assert_eq!(GatherLaunch::KV8_SOURCE.kv8_stage_for(2048, 227 * 1024), 0);
        assert_eq!(gather_grid(65536, GatherLaunch::KV8_SOURCE), 2048);
    }
}
