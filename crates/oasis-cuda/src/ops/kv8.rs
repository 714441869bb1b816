//! The FP8 (E4M3) KV cache's launches ("kv8", `oasis_core::kernels::kv8`): `quantize_kv8`,
//! `append_kv_tiers`, `gather_blocks_tiers`, `copy_pages_tiers` (each tier `T` pages or kv8
//! pages, as [`KvTierDev`]) and `decode_attention_kv8`. Every kernel writes the twins' bytes
//! (codes, scales, dequantized `T`) exactly; attention matches within the bf16 tolerances.
//!
//! Entry points: `<verb>_<object>_<from tier>_<to tier>_<dtype>` with tiers `elem` / `kv8`
//! (append: the GPU tier, then the host tier); kv8 -> kv8 copies are dtype-free
//! (`gather_blocks_kv8`, `copy_pages_kv8`). Both tiers `T` call the existing kernels.

use std::sync::{Mutex, PoisonError};

use super::attention::{attention_call, attention_grid, generic_tile, AttnTable};
use super::*;
use crate::params::{
    AppendKvTiersParams, CopyPagesTiersParams, DecodeAttnKv8Params, GatherBlocksTiersParams,
    QuantizeKv8Params,
};

/// One tier's kv8 pages on the device, as `oasis_core::kernels::Kv8Pages`.
#[derive(Debug, Clone, Copy)]
pub struct Kv8PagesDev {
    pub k_codes: DevSlice<u8>, // [num_pages, num_kv_heads, block_size, head_dim] E4M3
    pub v_codes: DevSlice<u8>, // [num_pages, num_kv_heads, block_size, head_dim] E4M3
    pub k_scales: DevSlice<f32>, // [num_pages, num_kv_heads] powers of two
    pub v_scales: DevSlice<f32>, // [num_pages, num_kv_heads] powers of two
}

/// The storage of one tier (GPU pages or the pinned host pool), as
/// `oasis_core::kernels::KvTier`: `T` pages or kv8 pages, `[num_pages, num_kv_heads, block_size,
/// head_dim]`.
#[derive(Debug, Clone, Copy)]
pub enum KvTierDev<T> {
    Elem { k: DevSlice<T>, v: DevSlice<T> },
    Kv8(Kv8PagesDev),
}

/// The paged KV of [`Gpu::decode_attention_kv8`], as `oasis_core::kernels::PagedKv8`.
#[derive(Debug, Clone, Copy)]
pub struct PagedKv8Dev {
    pub pages: Kv8PagesDev,
    pub kv_indptr: DevSlice<i32>,  // [num_seqs + 1] CSR over kv_indices
    pub kv_indices: DevSlice<i32>, // [nnz] GPU page ids of each sequence
    pub kv_last_page_len: DevSlice<i32>, // [num_seqs] 1..=block_size
    pub page_map: Option<DevSlice<i32>>, // [num_pages, num_kv_heads]; None = every entry valid
}

/// The names a tier's buffers go by in errors (the twins' names).
struct Names {
    k: &'static str,
    v: &'static str,
    k_scales: &'static str,
    v_scales: &'static str,
}

const GPU: Names = Names {
    k: "k_pages",
    v: "v_pages",
    k_scales: "k_scales",
    v_scales: "v_scales",
};
const HOST: Names = Names {
    k: "host_k",
    v: "host_v",
    k_scales: "host_k_scales",
    v_scales: "host_v_scales",
};
const SRC: Names = Names {
    k: "src_k",
    v: "src_v",
    k_scales: "src_k_scales",
    v_scales: "src_v_scales",
};
const DST: Names = Names {
    k: "dst_k",
    v: "dst_v",
    k_scales: "dst_k_scales",
    v_scales: "dst_v_scales",
};

/// Pages of kv8 pages shaped `[n, page...]` (codes) and `[n, num_kv_heads]` (scales).
fn kv8_rows(page: [usize; 3], p: &Kv8PagesDev, names: &Names) -> Result<usize> {
    let n = pool_rows(page, (names.k, p.k_codes), (names.v, p.v_codes))?;
    check_len(names.k_scales, p.k_scales.len(), &[n, page[0]])?;
    check_len(names.v_scales, p.v_scales.len(), &[n, page[0]])?;
    Ok(n)
}

impl<T> KvTierDev<T> {
    /// Check the buffers' shapes; the number of pages.
    fn rows(&self, page: [usize; 3], names: &Names) -> Result<usize> {
        match self {
            KvTierDev::Elem { k, v } => pool_rows(page, (names.k, *k), (names.v, *v)),
            KvTierDev::Kv8(p) => kv8_rows(page, p, names),
        }
    }

    /// The kernel parameters' (k, v, k_scales, v_scales); null scales for `T` pages.
    fn ptrs(&self) -> [DevPtr; 4] {
        match self {
            KvTierDev::Elem { k, v } => [(*k).into(), (*v).into(), DevPtr::NULL, DevPtr::NULL],
            KvTierDev::Kv8(p) => [
                p.k_codes.into(),
                p.v_codes.into(),
                p.k_scales.into(),
                p.v_scales.into(),
            ],
        }
    }

    fn is_kv8(&self) -> bool {
        matches!(self, KvTierDev::Kv8(_))
    }
}

/// The entry point of a conversion family (`family` = e.g. `"gather_blocks_kv8_elem"`) for `T`.
fn conv_entry<T: KvElem>(family: &str) -> &'static str {
    let names: &[&'static str] = match family {
        "gather_blocks_kv8_elem" => &[
            "gather_blocks_kv8_elem_bf16",
            "gather_blocks_kv8_elem_f16",
            "gather_blocks_kv8_elem_f32",
        ],
        "gather_blocks_elem_kv8" => &[
            "gather_blocks_elem_kv8_bf16",
            "gather_blocks_elem_kv8_f16",
            "gather_blocks_elem_kv8_f32",
        ],
        "copy_pages_kv8_elem" => &[
            "copy_pages_kv8_elem_bf16",
            "copy_pages_kv8_elem_f16",
            "copy_pages_kv8_elem_f32",
        ],
        "copy_pages_elem_kv8" => &[
            "copy_pages_elem_kv8_bf16",
            "copy_pages_elem_kv8_f16",
            "copy_pages_elem_kv8_f32",
        ],
        "append_kv_kv8_kv8" => &[
            "append_kv_kv8_kv8_bf16",
            "append_kv_kv8_kv8_f16",
            "append_kv_kv8_kv8_f32",
        ],
        "append_kv_elem_kv8" => &[
            "append_kv_elem_kv8_bf16",
            "append_kv_elem_kv8_f16",
            "append_kv_elem_kv8_f32",
        ],
        "append_kv_kv8_elem" => &[
            "append_kv_kv8_elem_bf16",
            "append_kv_kv8_elem_f16",
            "append_kv_kv8_elem_f32",
        ],
        _ => unreachable!("no kv8 family {family}"),
    };
    match T::DTYPE {
        DType::BF16 => names[0],
        DType::F16 => names[1],
        DType::F32 => names[2],
    }
}

/// Which tensor-core kernel reads kv8 pages in [`Gpu::decode_attention_kv8`] (cuda/
/// oasis_attn_tc.cuh). Both match `oasis_core::kernels::decode_attention_kv8` within the bf16
/// tolerances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kv8AttnKernel {
    /// `decode_attn_kv8_tc_*` (`TcKv8Pages`): each 16-token chunk dequantized to f32, scaled and
    /// rounded into a bf16 tile in shared memory, then the T pages' bf16 MMA (bf16 only). 0.55 of
    /// the copy ceiling on an H100 (s27, docs/PERF.md).
    Tile,
    /// `decode_attn_kv8_tcr_*` (`TcKv8RegPages`): the MMA fragments taken from the codes in
    /// shared memory by ldmatrix, one cvt per two codes into f16, the scales applied to the
    /// scores and carried as the accumulator's unit; bf16 and f16. The default: 0.69-0.70 of the
    /// copy ceiling on an H100 (s27), 1.26x `Tile`'s speed.
    Registers,
    /// `decode_attn_kv8_tcd_*` (`TcKv8DeepPages`): `Registers` with twice the bf16 kernel's
    /// pipeline depth ([`decode_attn_kv8_deep_stages`]) and no tile room, so that a warp keeps
    /// the bf16 kernel's bytes in flight (a chunk of codes is half a bf16 chunk). Correct on an
    /// H100 but not faster (0.66-0.68 of the copy ceiling against 0.69-0.70, s28): opt-in.
    RegistersDeep,
}

/// Pipeline depth of the `RegistersDeep` kernel per head_dim: twice the bf16 kernel's
/// ([`decode_attn_tc_stages`]), 3 at head_dim 256 (two blocks per SM); must match the
/// instantiations in cuda/decode_attn.cu.
pub fn decode_attn_kv8_deep_stages(head_dim: usize) -> Option<usize> {
    match head_dim {
        64 => Some(8),
        128 => Some(6),
        256 => Some(3),
        _ => None,
    }
}

static KV8_ATTN_KERNEL: Mutex<Kv8AttnKernel> = Mutex::new(Kv8AttnKernel::Registers);

/// Set the process-wide kv8 tensor-core attention kernel (takes effect at the next launch; a
/// CUDA graph keeps the kernel it captured).
pub fn set_kv8_attn_kernel(k: Kv8AttnKernel) {
    *KV8_ATTN_KERNEL
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = k;
}

/// The kv8 tensor-core attention kernel launches use now ([`set_kv8_attn_kernel`]).
pub fn kv8_attn_kernel() -> Kv8AttnKernel {
    *KV8_ATTN_KERNEL
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The kv8 tensor-core decode attention entry point of `kernel` for `T` and `head_dim` with its
/// pipeline depth: `Tile` bf16 only (the dequantized tile must hold `code * scale` exactly),
/// `Registers` bf16 and f16.
pub fn decode_attn_kv8_tc_entry<T: KvElem>(
    head_dim: usize,
    kernel: Kv8AttnKernel,
) -> Option<(&'static str, usize)> {
    let stages = match kernel {
        Kv8AttnKernel::RegistersDeep => decode_attn_kv8_deep_stages(head_dim)?,
        _ => decode_attn_tc_stages(head_dim)?,
    };
    let name = match (kernel, T::DTYPE, head_dim) {
        (Kv8AttnKernel::Tile, DType::BF16, 64) => "decode_attn_kv8_tc_bf16_d64",
        (Kv8AttnKernel::Tile, DType::BF16, 128) => "decode_attn_kv8_tc_bf16_d128",
        (Kv8AttnKernel::Tile, DType::BF16, 256) => "decode_attn_kv8_tc_bf16_d256",
        (Kv8AttnKernel::Registers, DType::BF16, 64) => "decode_attn_kv8_tcr_bf16_d64",
        (Kv8AttnKernel::Registers, DType::BF16, 128) => "decode_attn_kv8_tcr_bf16_d128",
        (Kv8AttnKernel::Registers, DType::BF16, 256) => "decode_attn_kv8_tcr_bf16_d256",
        (Kv8AttnKernel::Registers, DType::F16, 64) => "decode_attn_kv8_tcr_f16_d64",
        (Kv8AttnKernel::Registers, DType::F16, 128) => "decode_attn_kv8_tcr_f16_d128",
        (Kv8AttnKernel::Registers, DType::F16, 256) => "decode_attn_kv8_tcr_f16_d256",
        (Kv8AttnKernel::RegistersDeep, DType::BF16, 64) => "decode_attn_kv8_tcd_bf16_d64",
        (Kv8AttnKernel::RegistersDeep, DType::BF16, 128) => "decode_attn_kv8_tcd_bf16_d128",
        (Kv8AttnKernel::RegistersDeep, DType::BF16, 256) => "decode_attn_kv8_tcd_bf16_d256",
        (Kv8AttnKernel::RegistersDeep, DType::F16, 64) => "decode_attn_kv8_tcd_f16_d64",
        (Kv8AttnKernel::RegistersDeep, DType::F16, 128) => "decode_attn_kv8_tcd_f16_d128",
        (Kv8AttnKernel::RegistersDeep, DType::F16, 256) => "decode_attn_kv8_tcd_f16_d256",
        _ => return None,
    };
    Some((name, stages))
}

/// Shared memory of one kv8 tensor-core decode attention block of `kernel`, in bytes
/// (cuda/oasis_attn_tc.cuh, `TcKv8Pages` and `TcKv8RegPages`'s `WARP_UNITS`): per warp `stages`
/// chunks of K and V codes (16 x head_dim bytes each), then one bf16 tile of K and V (`Tile`, and
/// `Registers`, which keeps that layout; not `RegistersDeep`: its `TILE` is 0), as
/// [`decode_attn_tc_block_smem_bytes`] with the item list's K and V scales (`SCALED` pages: read
/// with the list, so no chunk waits on a scattered load of its own).
pub fn decode_attn_kv8_tc_smem_bytes(
    kernel: Kv8AttnKernel,
    head_dim: usize,
    stages: usize,
) -> usize {
    let tile = match kernel {
        Kv8AttnKernel::RegistersDeep => 0,
        Kv8AttnKernel::Tile | Kv8AttnKernel::Registers => 2 * 16 * head_dim * 2,
    };
    decode_attn_tc_block_smem_bytes(stages * 2 * 16 * head_dim + tile, true)
}

impl Gpu {
    /// GPU twin of `oasis_core::kernels::quantize_kv8`: whole-block kv8 quantization of one
    /// array (K or V) over each block's first `valid[b]` rows, rows past them code 0.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape. A `valid` entry
    /// outside `1..=block_size` (an error of the twin) skips that block on the device.
    pub fn quantize_kv8<T: KvElem>(
        &self,
        geo: &KvGeometry,
        src: DevSlice<T>,      // [n, num_kv_heads, block_size, head_dim]
        valid: DevSlice<i32>,  // [n] 1..=block_size
        codes: DevSlice<u8>,   // [n, num_kv_heads, block_size, head_dim]
        scales: DevSlice<f32>, // [n, num_kv_heads]
        stream: Stream,
    ) -> Result<()> {
        guard("quantize_kv8", || {
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            let n = rows("src", src.len(), &page)?;
            check_len("valid", valid.len(), &[n])?;
            check_len("codes", codes.len(), &[n, h, bs, d])?;
            check_len("scales", scales.len(), &[n, h])?;
            let params = params!(QuantizeKv8Params {
                ptr: { src, valid, codes, scales },
                int: { num_kv_heads = h, block_size = bs, head_dim = d },
                raw: { _pad0 = 0 },
            });
            let grid = grid_x("n", n)?;
            // SAFETY: lengths checked above; `valid` entries are checked by the kernel
            // (out-of-range skips the block); reachability and lifetime by DevSlice's contract,
            // the stream by Stream's.
            unsafe {
                self.queue(
                    entry!(T, "quantize_kv8"),
                    grid,
                    COPY_THREADS,
                    0,
                    stream,
                    &params,
                )
            }
        })
    }

    /// GPU twin of `oasis_core::kernels::append_kv_tiers`: [`Gpu::append_kv`] with the GPU tier
    /// `gpu` and the host tier `host` each `T` pages or kv8 pages (the incremental append, with
    /// the scale growth's requantization of the rows before the offset). Both `T`: `append_kv`.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn append_kv_tiers<T: KvElem>(
        &self,
        geo: &KvGeometry,
        k_new: DevSlice<T>,               // [num_seqs, num_kv_heads, head_dim]
        v_new: DevSlice<T>,               // [num_seqs, num_kv_heads, head_dim]
        page_ids: DevSlice<i32>,          // [num_seqs]
        page_offsets: DevSlice<i32>,      // [num_seqs] 0..block_size
        host_block_ids: DevSlice<i32>,    // [num_seqs] -1 = dense
        host_rows: Option<DevSlice<i32>>, // [num_seqs] host row of the write-through; None: the id
        gpu: KvTierDev<T>,                // [num_pages, num_kv_heads, block_size, head_dim]
        host: KvTierDev<T>, // [num_host_rows, num_kv_heads, block_size, head_dim] pinned host
        summaries: DevSlice<T>, // [num_host_blocks, num_kv_heads, 2, head_dim]
        stream: Stream,
    ) -> Result<()> {
        if let (KvTierDev::Elem { k, v }, KvTierDev::Elem { k: hk, v: hv }) = (gpu, host) {
            return self.append_kv(
                geo,
                k_new,
                v_new,
                page_ids,
                page_offsets,
                host_block_ids,
                host_rows,
                k,
                v,
                hk,
                hv,
                summaries,
                stream,
            );
        }
        guard("append_kv_tiers", || {
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            let num_seqs = page_ids.len();
            check_len("k_new", k_new.len(), &[num_seqs, h, d])?;
            check_len("v_new", v_new.len(), &[num_seqs, h, d])?;
            check_len("page_offsets", page_offsets.len(), &[num_seqs])?;
            check_len("host_block_ids", host_block_ids.len(), &[num_seqs])?;
            if let Some(r) = host_rows {
                check_len("host_rows", r.len(), &[num_seqs])?;
            }
            let num_pages = gpu.rows(page, &GPU)?;
            let num_rows = host.rows(page, &HOST)?;
            let num_host = rows("summaries", summaries.len(), &[h, 2, d])?;
            let name = match (gpu.is_kv8(), host.is_kv8()) {
                (true, true) => conv_entry::<T>("append_kv_kv8_kv8"),
                (false, _) => conv_entry::<T>("append_kv_elem_kv8"),
                (true, false) => conv_entry::<T>("append_kv_kv8_elem"),
            };
            let [k_pages, v_pages, k_scales, v_scales] = gpu.ptrs();
            let [host_k, host_v, host_k_scales, host_v_scales] = host.ptrs();
            let params = params!(AppendKvTiersParams {
                ptr: {
                    k_new, v_new, page_ids, page_offsets, host_block_ids, host_rows, k_pages,
                    v_pages, k_scales, v_scales, host_k, host_v, host_k_scales, host_v_scales,
                    summaries,
                },
                int: {
                    num_kv_heads = h, head_dim = d, block_size = bs, num_pages,
                    num_host_blocks = num_host, num_host_rows = num_rows,
                },
            });
            let grid = grid_rows_heads("num_seqs", num_seqs, h)?;
            // SAFETY: every buffer of `params` has the length its shape needs (checked above;
            // scales null exactly for a T tier, which the kernel instantiated for it never
            // reads) and, by DevSlice's contract, is reachable by this device until the stream
            // runs the kernel; table entries are bounds-checked by the kernel; one block per
            // (sequence, head) owns its entries (two sequences naming one slot race, as in
            // append_kv); row_threads is a multiple of 32 (the kernel's block reduction).
            unsafe { self.queue(name, grid, row_threads(d), 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::gather_blocks_tiers`: [`Gpu::gather_blocks`] with the
    /// host pool `host` and the GPU pages `gpu` each `T` or kv8: kv8 -> kv8 copies codes and
    /// scales, kv8 -> `T` dequantizes (both staged like `gather_blocks`, codes and scales in
    /// shared memory, [`GatherLaunch::kv8_stage_for`] entries per warp), `T` -> kv8 quantizes
    /// whole blocks (through registers, one warp per entry). Both `T`: `gather_blocks`.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_blocks_tiers<T: KvElem>(
        &self,
        geo: &KvGeometry,
        plan_slots: DevSlice<i32>,  // [num_seqs, num_kv_heads, fetch_cap]
        plan_blocks: DevSlice<i32>, // [num_seqs, num_kv_heads, fetch_cap]
        fetch_cap: usize,
        slot_pages: DevSlice<i32>, // [num_seqs, budget]
        budget: usize,
        host_indptr: DevSlice<i32>,  // [num_seqs + 1]
        host_indices: DevSlice<i32>, // [nnz]
        host: KvTierDev<T>, // [num_host_blocks, num_kv_heads, block_size, head_dim] pinned host
        gpu: KvTierDev<T>,  // [num_pages, num_kv_heads, block_size, head_dim]
        device_source: bool,
        stream: Stream,
    ) -> Result<()> {
        if let (KvTierDev::Elem { k: hk, v: hv }, KvTierDev::Elem { k, v }) = (host, gpu) {
            return self.gather_blocks(
                geo,
                plan_slots,
                plan_blocks,
                fetch_cap,
                slot_pages,
                budget,
                host_indptr,
                host_indices,
                hk,
                hv,
                k,
                v,
                device_source,
                stream,
            );
        }
        guard("gather_blocks_tiers", || {
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            let num_seqs = csr_rows("host_indptr", host_indptr.len())?;
            check_len("plan_slots", plan_slots.len(), &[num_seqs, h, fetch_cap])?;
            check_len("plan_blocks", plan_blocks.len(), &[num_seqs, h, fetch_cap])?;
            check_len("slot_pages", slot_pages.len(), &[num_seqs, budget])?;
            let num_host = host.rows(page, &HOST)?;
            let num_pages = gpu.rows(page, &GPU)?;

            // A float pool into kv8 pages quantizes through registers under the float pools'
            // launch; a kv8 pool takes its own (GatherLaunch::KV8_SOURCE by default).
            let launch = match (device_source, host.is_kv8()) {
                (true, _) => GatherLaunch::DEVICE_SOURCE,
                (false, true) => gather_launch_kv8(),
                (false, false) => gather_launch(),
            };
            // From a kv8 pool: codes and scales staged in shared memory (kv8 -> kv8 copied,
            // kv8 -> T dequantized from the stage), twice gather_blocks' entries per warp for
            // the same bytes in flight. T -> kv8 quantizes through registers.
            let stage = match host.is_kv8() {
                true => launch.kv8_stage_for(bs * d, self.max_shared_mem_per_block()),
                false => 0,
            };
            let name = match (host.is_kv8(), gpu.is_kv8()) {
                (true, true) => "gather_blocks_kv8",
                (true, false) => conv_entry::<T>("gather_blocks_kv8_elem"),
                _ => conv_entry::<T>("gather_blocks_elem_kv8"),
            };
            let smem = match stage {
                0 => 0,
                s => launch.kv8_stage_smem_bytes(s, bs * d),
            };
            let [host_k, host_v, host_k_scales, host_v_scales] = host.ptrs();
            let [k_pages, v_pages, k_scales, v_scales] = gpu.ptrs();
            let params = params!(GatherBlocksTiersParams {
                ptr: {
                    plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, host_k, host_v,
                    host_k_scales, host_v_scales, k_pages, v_pages, k_scales, v_scales,
                },
                int: {
                    num_kv_heads = h, fetch_cap, budget, block_size = bs, head_dim = d, num_pages,
                    num_host_blocks = num_host, nnz = host_indices.len(), num_seqs,
                },
                raw: {
                    entries_per_warp = launch.entries_per_warp as i32, stage_entries = stage as i32,
                    _pad0 = 0,
                },
            });
            let grid = grid_x(
                "gather blocks",
                gather_grid(num_seqs * h * fetch_cap, launch),
            )?;
            // SAFETY: as gather_blocks: lengths checked above (scales null exactly for a T tier,
            // never read by the kernel instantiated for it); slots, pages, logical and host
            // block ids and each host_indptr row are bounds-checked by the kernel. The host
            // tier is pinned host memory at the same address on the device (DevSlice contract);
            // lifetime by DevSlice's contract, the stream by Stream's. The block is whole warps,
            // at most OASIS_COPY_THREADS; shared memory holds `stage` entries of K and V codes
            // and their scales per warp (kv8_stage_for fits it under the device limit; 0 for
            // T -> kv8 and the register paths, which stage nothing).
            unsafe {
                self.queue(
                    name,
                    grid,
                    32 * launch.warps_per_block,
                    smem,
                    stream,
                    &params,
                )
            }
        })
    }

    /// GPU twin of `oasis_core::kernels::copy_pages_tiers`: whole pages `src_ids[i] ->
    /// dst_ids[i]` between pools that are each `T` or kv8: kv8 -> kv8 bit-exact, kv8 -> `T`
    /// dequantized, `T` -> kv8 quantized over the first `valid[i]` rows (`None`: all; read only
    /// for `T` -> kv8). Both `T`: `copy_pages`.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a buffer whose size does not match its shape. A `valid` entry
    /// outside `1..=block_size` (an error of the twin) skips that page on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_pages_tiers<T: KvElem>(
        &self,
        geo: &KvGeometry,
        src: KvTierDev<T>, // [num_src_pages, num_kv_heads, block_size, head_dim]
        src_ids: DevSlice<i32>, // [n]
        dst: KvTierDev<T>, // [num_dst_pages, num_kv_heads, block_size, head_dim]
        dst_ids: DevSlice<i32>, // [n]
        valid: Option<DevSlice<i32>>, // [n] 1..=block_size; None: every row
        stream: Stream,
    ) -> Result<()> {
        if let (KvTierDev::Elem { k, v }, KvTierDev::Elem { k: dk, v: dv }) = (src, dst) {
            return self.copy_pages(geo, k, v, src_ids, dk, dv, dst_ids, stream);
        }
        guard("copy_pages_tiers", || {
            let page = page_shape(geo)?;
            let [h, bs, d] = page;
            let n = src_ids.len();
            check_len("dst_ids", dst_ids.len(), &[n])?;
            let num_src = src.rows(page, &SRC)?;
            let num_dst = dst.rows(page, &DST)?;
            let (name, valid) = match (src.is_kv8(), dst.is_kv8()) {
                (true, true) => ("copy_pages_kv8", None),
                (true, false) => (conv_entry::<T>("copy_pages_kv8_elem"), None),
                _ => {
                    if let Some(v) = valid {
                        check_len("valid", v.len(), &[n])?;
                    }
                    (conv_entry::<T>("copy_pages_elem_kv8"), valid)
                }
            };
            let [src_k, src_v, src_k_scales, src_v_scales] = src.ptrs();
            let [dst_k, dst_v, dst_k_scales, dst_v_scales] = dst.ptrs();
            let params = params!(CopyPagesTiersParams {
                ptr: {
                    src_k, src_v, src_k_scales, src_v_scales, src_ids, dst_k, dst_v, dst_k_scales,
                    dst_v_scales, dst_ids, valid,
                },
                int: {
                    num_kv_heads = h, block_size = bs, head_dim = d, num_src_pages = num_src,
                    num_dst_pages = num_dst,
                },
                raw: { _pad0 = 0 },
            });
            let grid = grid_x("n", n)?;
            // SAFETY: lengths checked above (scales null exactly for a T pool, never read by the
            // kernel instantiated for it; `valid` null or n long, read only by T -> kv8); page
            // ids and `valid` entries bounds-checked by the kernel; reachability (UVA for a
            // pinned side) and lifetime by DevSlice's contract, the stream by Stream's.
            unsafe { self.queue(name, grid, COPY_THREADS, 0, stream, &params) }
        })
    }

    /// GPU twin of `oasis_core::kernels::decode_attention_kv8`: [`Gpu::decode_attention`] over
    /// kv8 pages (queries, `extra` and `out` stay `T`). The tensor-core kernel (bf16, head_dim
    /// 64/128/256, under the same conditions as the T pages') dequantizes each 16-token chunk
    /// into its bf16 tile; the generic kernel (every other case) into its f32 tile. Split-KV is
    /// merged by `merge_attn_states` as for T pages.
    ///
    /// # Errors
    /// As [`Gpu::decode_attention`]; the codes go by `k_pages` / `v_pages`, the scales by
    /// `k_scales` / `v_scales`.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_attention_kv8<T: KvElem>(
        &self,
        geo: &KvGeometry,
        q: DevSlice<T>, // [num_seqs, num_rows, num_qo_heads, head_dim]
        num_rows: usize,
        kv: &PagedKv8Dev,
        extra: Option<&ExtraKvDev<T>>,
        sm_scale: f32,
        out: DevSlice<T>, // [num_seqs, num_rows, num_qo_heads, head_dim]
        split: Option<&SplitKv>,
        stream: Stream,
    ) -> Result<()> {
        guard("decode_attention_kv8", || {
            let table = AttnTable {
                kv_indptr: kv.kv_indptr,
                kv_last_page_len: kv.kv_last_page_len,
                page_map: kv.page_map,
            };
            let pools = |page| kv8_rows(page, &kv.pages, &GPU);
            let c = attention_call(geo, q, num_rows, &table, pools, extra, out, split)?;
            let (h, bs, d) = (geo.num_kv_heads, geo.block_size, geo.head_dim);
            let p = &kv.pages;
            // The tensor-core kernel copies 16-byte units of codes and of the extra row.
            let aligned = q.ptr().is_multiple_of(4)
                && (p.k_codes.ptr() | p.v_codes.ptr() | c.extra_k | c.extra_v).is_multiple_of(16);
            let kernel = kv8_attn_kernel();
            let (name, tt, smem) = match decode_attn_kv8_tc_entry::<T>(d, kernel) {
                Some((name, stages)) if c.nq <= 16 && bs.is_multiple_of(16) && aligned => {
                    (name, 0, decode_attn_kv8_tc_smem_bytes(kernel, d, stages))
                }
                _ => {
                    let (tt, smem) = generic_tile(c.nq, d);
                    (entry!(T, "decode_attn_kv8"), tt, smem)
                }
            };
            let params = params!(DecodeAttnKv8Params {
                ptr: {
                    q, k_codes = p.k_codes, v_codes = p.v_codes, k_scales = p.k_scales,
                    v_scales = p.v_scales, kv_indptr = kv.kv_indptr, kv_indices = kv.kv_indices,
                    kv_last_page_len = kv.kv_last_page_len, page_map = DevPtr(c.page_map),
                    extra_k = DevPtr(c.extra_k), extra_v = DevPtr(c.extra_v), out,
                    tmp_out = DevPtr(c.tmp_out), tmp_lse = DevPtr(c.tmp_lse),
                },
                int: {
                    num_rows, num_qo_heads = geo.num_qo_heads, num_kv_heads = h, head_dim = d,
                    block_size = bs, num_pages = c.num_pages, nnz = kv.kv_indices.len(),
                    num_splits = c.num_splits, tile_tokens = tt,
                },
                raw: { sm_scale },
            });
            let grid = attention_grid(&c, h)?;
            // SAFETY: as decode_attention: null pointers only where the kernel tests for null
            // (page_map, extra_k, extra_v) or never dereferences them (tmp_* when num_splits ==
            // 1, out when > 1); lengths (codes and scales included) checked by attention_call;
            // the tensor-core kernel only where its shape and alignment conditions hold (bf16,
            // an instantiated head_dim); `smem` is the chosen kernel's layout, checked by
            // launch() against the device limit; table contents checked by the kernel; the
            // stream by Stream's contract.
            unsafe { self.queue(name, grid, DECODE_THREADS, smem, stream, &params)? };
            self.merge_splits(&c, d, out, stream)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv8_entries_are_registered() {
        for family in [
            "gather_blocks_kv8_elem",
            "gather_blocks_elem_kv8",
            "copy_pages_kv8_elem",
            "copy_pages_elem_kv8",
            "append_kv_kv8_kv8",
            "append_kv_elem_kv8",
            "append_kv_kv8_elem",
        ] {
            for name in [
                conv_entry::<half::bf16>(family),
                conv_entry::<half::f16>(family),
                conv_entry::<f32>(family),
            ] {
                assert!(name.starts_with(family), "{family}: {name}");
                assert!(crate::kernels::source_of(name).is_some(), "{name}");
            }
        }
        for name in [
            "gather_blocks_kv8",
            "copy_pages_kv8",
            entry!(half::bf16, "quantize_kv8"),
            entry!(f32, "decode_attn_kv8"),
        ] {
            assert!(crate::kernels::source_of(name).is_some(), "{name}");
        }
        let src = crate::kernels::source("decode_attn").unwrap().source;
        for d in [64, 128, 256] {
            for k in [Kv8AttnKernel::Tile, Kv8AttnKernel::Registers] {
                let (name, stages) = decode_attn_kv8_tc_entry::<half::bf16>(d, k).unwrap();
                assert_eq!(Some(stages), decode_attn_tc_stages(d));
                assert!(crate::kernels::source_of(name).is_some(), "{name}");
                let inst = format!("({name}, oasis::bf16, {d}, {stages}, ");
                assert!(src.contains(&inst), "{inst} not in decode_attn.cu");
            }
            let (name, stages) =
                decode_attn_kv8_tc_entry::<half::f16>(d, Kv8AttnKernel::Registers).unwrap();
            assert!(
                src.contains(&format!(
                    "({name}, oasis::f16, {d}, {stages}, TcKv8RegPages)"
                )),
                "{name}"
            );
            for (t, dt) in [("bf16", true), ("f16", false)] {
                let (name, stages) = if dt {
                    decode_attn_kv8_tc_entry::<half::bf16>(d, Kv8AttnKernel::RegistersDeep)
                } else {
                    decode_attn_kv8_tc_entry::<half::f16>(d, Kv8AttnKernel::RegistersDeep)
                }
                .unwrap();
                assert_eq!(Some(stages), decode_attn_kv8_deep_stages(d));
                assert!(crate::kernels::source_of(name).is_some(), "{name}");
                let inst = format!("({name}, oasis::{t}, {d}, {stages}, TcKv8DeepPages)");
                assert!(src.contains(&inst), "{inst} not in decode_attn.cu");
            }
        }
        assert_eq!(
            decode_attn_kv8_tc_entry::<half::f16>(128, Kv8AttnKernel::Tile),
            None
        );
        assert_eq!(
            decode_attn_kv8_tc_entry::<half::bf16>(96, Kv8AttnKernel::Registers),
            None
        );
        assert_eq!(
            decode_attn_kv8_tc_entry::<f32>(128, Kv8AttnKernel::Registers),
            None
        );
    }

    #[test]
    fn kv8_tensor_core_smem() {
        // Half the T ring plus one bf16 tile per warp: at head_dim 128, 80 KiB of staging, two
        // blocks per SM on an H100/H200 as with bf16 pages; the item list's scales after it.
        let b = decode_attn_kv8_tc_smem_bytes(Kv8AttnKernel::Tile, 128, 3);
        assert_eq!(
            b,
            4 * (3 * 2 * 16 * 128 + 4 * 16 * 128) + 8 * 513 + 512 + 144 + 8 * 513
        );
        assert_eq!(
            b,
            decode_attn_kv8_tc_smem_bytes(Kv8AttnKernel::Registers, 128, 3)
        );
        assert!(b < decode_attn_tc_smem_bytes(128, 3));
        assert!(DECODE_TC_BLOCKS_PER_SM * (b + 1024) <= 227 * 1024);
        assert!(decode_attn_kv8_tc_smem_bytes(Kv8AttnKernel::Registers, 256, 2) <= 227 * 1024);
        // The deep ring: the bf16 kernel's bytes in flight per warp at head_dim 64 and 128, and
        // still two blocks per SM at every head_dim.
        for d in [64, 128, 256] {
            let s = decode_attn_kv8_deep_stages(d).unwrap();
            let deep = decode_attn_kv8_tc_smem_bytes(Kv8AttnKernel::RegistersDeep, d, s);
            assert_eq!(
                deep,
                4 * s * 2 * 16 * d + 8 * 513 + 512 + 144 + 8 * 513,
                "{d}: no tile room, the list's scales"
            );
            assert!(DECODE_TC_BLOCKS_PER_SM * (deep + 1024) <= 227 * 1024, "{d}");
            if d < 256 {
                assert_eq!(s * 16 * d, decode_attn_tc_stages(d).unwrap() * 16 * d * 2);
            }
        }
    }
}
