//! Paged KV bindings: writing the new token (`append_kv`) and the host summaries
//! (`build_summaries`), executing a selection plan (`gather_blocks` and its launch shape), and
//! whole-page copies between pools (`copy_pages`).

use oasis_core::kernels;
use pyo3::prelude::*;

use crate::call::{entry, guarded, on_gpu, with_dtype};
use crate::check::{check_all, check_block_tables, check_outputs, kv_dtype, summary_rows};
use crate::runtime::PyGeometry;
use crate::tensor::{check_disjoint, Cx, Elem, Place, TensorArg, ANY};
use crate::tier::{Tier, GPU_TIER};

#[pyfunction]
#[pyo3(signature = (max_blocks = None, warps_per_block = None, entries_per_warp = None, stage_entries = None, *, kv8 = false))]
/// Launch shape of the GPU gather (`gather_blocks`): at most `max_blocks` blocks (0: no cap) of
/// `warps_per_block` warps (1-4), each checking `entries_per_warp` plan entries (1-32) per pass
/// and copying `stage_entries` (0-32) of them at once through shared memory (0: through
/// registers). `kv8`: the launch of gathers from fp8_e4m3 host pools, else of float host pools.
/// A field left out (None) takes that launch's default. Process-wide, for tuning; a captured CUDA
/// graph keeps the launch it was captured with.
fn set_gather_launch(
    max_blocks: Option<usize>,
    warps_per_block: Option<u32>,
    entries_per_warp: Option<u32>,
    stage_entries: Option<u32>,
    kv8: bool,
) -> PyResult<()> {
    use oasis_cuda::ops::GatherLaunch;
    // A field left out takes the default launch's (one place holds each measured best).
    let d = if kv8 {
        GatherLaunch::KV8_SOURCE
    } else {
        GatherLaunch::DEFAULT
    };
    let l = GatherLaunch {
        max_blocks: max_blocks.unwrap_or(d.max_blocks),
        warps_per_block: warps_per_block.unwrap_or(d.warps_per_block),
        entries_per_warp: entries_per_warp.unwrap_or(d.entries_per_warp),
        stage_entries: stage_entries.unwrap_or(d.stage_entries),
    };
    let set = if kv8 {
        oasis_cuda::ops::set_gather_launch_kv8(l)
    } else {
        oasis_cuda::ops::set_gather_launch(l)
    };
    set.map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}

#[pyfunction]
#[pyo3(signature = (*, kv8 = false))]
/// The launch shape of `set_gather_launch` (`kv8`: of gathers from fp8_e4m3 host pools):
/// `(max_blocks, warps_per_block, entries_per_warp, stage_entries)`.
fn gather_launch(kv8: bool) -> (usize, u32, u32, u32) {
    let l = if kv8 {
        oasis_cuda::ops::gather_launch_kv8()
    } else {
        oasis_cuda::ops::gather_launch()
    };
    (
        l.max_blocks,
        l.warps_per_block,
        l.entries_per_warp,
        l.stage_entries,
    )
}

#[pyfunction]
#[pyo3(signature = (geo, k_new, v_new, page_ids, page_offsets, host_block_ids, k_pages, v_pages, host_k, host_v, summaries, *, host_rows = None, k_scales = None, v_scales = None, host_k_scales = None, host_v_scales = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Append one token per sequence into its page slot, with write-through and summary update for
/// sparse sequences (host_block_ids >= 0).
///
/// k_new, v_new [num_seqs, num_kv_heads, head_dim]; page_ids, page_offsets, host_block_ids
/// [num_seqs] int32; k_pages, v_pages [num_pages, num_kv_heads, block_size, head_dim]; host_k,
/// host_v [num_host_rows, num_kv_heads, block_size, head_dim] (may be empty when every sequence
/// is dense); summaries [num_host_blocks, num_kv_heads, 2, head_dim]; host_rows [num_seqs] int32
/// or None: the host row the token is written through to (None: the row is the block id; the
/// summary is always host_block_ids').
///
/// Either tier may hold fp8_e4m3 KV: uint8 E4M3 pages with k_scales, v_scales (the GPU pages)
/// or host_k_scales, host_v_scales (the host pool), [rows, num_kv_heads] float32 powers of two
/// (`oasis_core::kernels::kv8`: a row at offset 0 sets its page's scale, a later larger row
/// raises it and requantizes the rows before it). Summaries come from the unquantized keys.
///
/// CUDA: every tensor on one cuda:N except the host pool (host_k, host_v), which may also be
/// pinned CPU memory; queued on `stream` (the raw cudaStream_t of a live stream of cuda:N,
/// torch.cuda.current_stream(device).cuda_stream; 0 = the legacy default stream), returns at
/// once. Table entries are not validated on the GPU: out-of-range ones are skipped. `stream` is
/// ignored on the CPU.
fn append_kv(
    py: Python<'_>,
    geo: &PyGeometry,
    k_new: TensorArg,
    v_new: TensorArg,
    page_ids: TensorArg,
    page_offsets: TensorArg,
    host_block_ids: TensorArg,
    k_pages: TensorArg,
    v_pages: TensorArg,
    host_k: TensorArg,
    host_v: TensorArg,
    summaries: TensorArg,
    host_rows: Option<TensorArg>,
    k_scales: Option<TensorArg>,
    v_scales: Option<TensorArg>,
    host_k_scales: Option<TensorArg>,
    host_v_scales: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "append_kv", || {
        let g = geo.inner;
        let gpu = Tier::new(
            py,
            GPU_TIER,
            &k_pages,
            &v_pages,
            k_scales.as_ref(),
            v_scales.as_ref(),
        )?;
        let hst = Tier::new(
            py,
            HOST_TIER,
            &host_k,
            &host_v,
            host_k_scales.as_ref(),
            host_v_scales.as_ref(),
        )?;
        let new = [("k_new", &k_new), ("v_new", &v_new)];
        let mut tables = vec![
            ("page_ids", &page_ids),
            ("page_offsets", &page_offsets),
            ("host_block_ids", &host_block_ids),
        ];
        if let Some(r) = &host_rows {
            tables.push(("host_rows", r));
        }
        let pages = gpu.named();
        let host = hst.named();
        let sums = [("summaries", &summaries)];
        let cx = Cx::new(py, &[&new[..], &tables, &pages, &sums].concat(), &host)?;
        let [n, ..] = check_all(&cx, &new, Elem::Any, [ANY, g.num_kv_heads, g.head_dim])?;
        check_all(&cx, &tables, Elem::I32, [n])?;
        gpu.rows(&cx, &g)?;
        hst.rows(&cx.host(), &g)?;
        summary_rows(&cx, &g, &summaries)?;
        let dt = kv_dtype(
            py,
            &[&new[..], &sums, &gpu.float_pages(), &hst.float_pages()].concat(),
        )?;
        check_outputs(
            py,
            &[&pages[..], &host, &sums].concat(),
            &[&new[..], &tables].concat(),
        )?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: shapes, dtypes and CPU residence were checked above; the mutable buffers
                // were checked disjoint from each other and from the inputs; the caller keeps the
                // tensors alive for the call.
                let (kn, vn, sm) = unsafe { (k_new.slice::<T>(), v_new.slice::<T>(), summaries.slice_mut::<T>()) };
                let (gt, ht) = unsafe { (gpu.write::<T>(), hst.write::<T>()) };
                let (pi, po, hb) = unsafe { (page_ids.ints(), page_offsets.ints(), host_block_ids.ints()) };
                let hr = host_rows.as_ref().map(|r| unsafe { r.ints() });
                guarded(py, "append_kv", || kernels::append_kv_tiers::<T>(&g, kn, vn, pi, po, hb, hr, gt, ht, sm))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) shapes, dtypes, contiguity and residence on cuda:dev
                // (the host pool: pinned, mapped checked in on_gpu) were checked above; outputs
                // are disjoint from every other argument.
                let (kn, vn, sm) = unsafe { (k_new.dev::<T>(), v_new.dev::<T>(), summaries.dev::<T>()) };
                let (gt, ht) = unsafe { (gpu.dev::<T>(), hst.dev::<T>()) };
                let (pi, po, hb) = unsafe { (page_ids.dev::<i32>(), page_offsets.dev::<i32>(), host_block_ids.dev::<i32>()) };
                let hr = host_rows.as_ref().map(|r| unsafe { r.dev::<i32>() });
                on_gpu(py, "append_kv", dev, stream, &host, move |g8, st| g8.append_kv_tiers::<T>(&g, kn, vn, pi, po, hb, hr, gt, ht, sm, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, host_k, block_ids, block_lens, summaries, *, block_rows = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Recompute the min/max summaries of the given host blocks over their first `block_lens` tokens.
///
/// host_k [num_host_rows, num_kv_heads, block_size, head_dim]; block_ids, block_lens [n] int32;
/// summaries [num_host_blocks, num_kv_heads, 2, head_dim]; block_rows [n] int32 or None: the host
/// row holding each block's keys (None: the row is the block id).
///
/// CUDA: block_ids, block_lens and summaries on one cuda:N; host_k there too or in pinned CPU
/// memory; queued on `stream` (raw cudaStream_t of cuda:N, 0 = legacy default), returns at once.
/// Out-of-range ids or lengths are skipped on the GPU. `stream` is ignored on the CPU.
fn build_summaries(
    py: Python<'_>,
    geo: &PyGeometry,
    host_k: TensorArg,
    block_ids: TensorArg,
    block_lens: TensorArg,
    summaries: TensorArg,
    block_rows: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "build_summaries", || {
        let g = geo.inner;
        let host = [("host_k", &host_k)];
        let mut tables = vec![("block_ids", &block_ids), ("block_lens", &block_lens)];
        if let Some(r) = &block_rows {
            tables.push(("block_rows", r));
        }
        let cx = Cx::new(
            py,
            &[&[("summaries", &summaries)][..], &tables].concat(),
            &host,
        )?;
        check_block_tables(&cx, &g, &host, &summaries, &tables)?;
        let dt = kv_dtype(py, &[("host_k", &host_k), ("summaries", &summaries)])?;
        check_outputs(
            py,
            &[("summaries", &summaries)],
            &[&[("host_k", &host_k)][..], &tables].concat(),
        )?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; summaries is disjoint from the inputs.
                let (hk, sm, ids, lens) = unsafe { (host_k.slice::<T>(), summaries.slice_mut::<T>(), block_ids.ints(), block_lens.ints()) };
                let rows = block_rows.as_ref().map(|r| unsafe { r.ints() });
                guarded(py, "build_summaries", || kernels::build_summaries::<T>(&g, hk, ids, rows, lens, sm))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; summaries is disjoint from the inputs.
                let (hk, sm, ids, lens) = unsafe { (host_k.dev::<T>(), summaries.dev::<T>(), block_ids.dev::<i32>(), block_lens.dev::<i32>()) };
                let rows = block_rows.as_ref().map(|r| unsafe { r.dev::<i32>() });
                on_gpu(py, "build_summaries", dev, stream, &host, move |gpu, st| gpu.build_summaries::<T>(&g, hk, ids, rows, lens, sm, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, host_k, host_v, k_pages, v_pages, *, host_k_scales = None, host_v_scales = None, k_scales = None, v_scales = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Execute a selection plan: copy planned block-head entries from the host pool into GPU slots.
///
/// plan_slots, plan_blocks [num_seqs, num_kv_heads, fetch_cap], slot_pages [num_seqs, budget],
/// host_indptr [num_seqs + 1], host_indices [nnz] int32; host_k, host_v [num_host_blocks,
/// num_kv_heads, block_size, head_dim]; k_pages, v_pages [num_pages, num_kv_heads, block_size,
/// head_dim]. Bit-exact between tiers of one storage; either tier may hold fp8_e4m3 KV (uint8 pages
/// with host_k_scales, host_v_scales or k_scales, v_scales [rows, num_kv_heads] float32): kv8 to
/// kv8 copies the codes and the scales, kv8 to float pages dequantizes (code x scale), float to
/// kv8 quantizes each entry's whole block.
///
/// CPU: returns the number of block-head entries copied. CUDA: every tensor on one cuda:N except
/// host_k, host_v, which may be pinned CPU memory (read through unified addressing); queued on
/// `stream` (raw cudaStream_t, 0 = legacy default); returns None at once. Plan entries out of
/// range, and those of a malformed host_indptr row, are skipped on the GPU. Keep the host pool
/// alive until the stream has run the copy. Launched as `set_gather_launch` says for a pinned
/// pool; a pool on the device takes the many-block launch that device memory needs.
fn gather_blocks(
    py: Python<'_>,
    geo: &PyGeometry,
    plan_slots: TensorArg,
    plan_blocks: TensorArg,
    slot_pages: TensorArg,
    host_indptr: TensorArg,
    host_indices: TensorArg,
    host_k: TensorArg,
    host_v: TensorArg,
    k_pages: TensorArg,
    v_pages: TensorArg,
    host_k_scales: Option<TensorArg>,
    host_v_scales: Option<TensorArg>,
    k_scales: Option<TensorArg>,
    v_scales: Option<TensorArg>,
    stream: u64,
) -> PyResult<Option<usize>> {
    entry(py, "gather_blocks", || {
        let g = geo.inner;
        let hst = Tier::new(
            py,
            HOST_TIER,
            &host_k,
            &host_v,
            host_k_scales.as_ref(),
            host_v_scales.as_ref(),
        )?;
        let gpu = Tier::new(
            py,
            GPU_TIER,
            &k_pages,
            &v_pages,
            k_scales.as_ref(),
            v_scales.as_ref(),
        )?;
        let tables = [
            ("plan_slots", &plan_slots),
            ("plan_blocks", &plan_blocks),
            ("slot_pages", &slot_pages),
            ("host_indptr", &host_indptr),
            ("host_indices", &host_indices),
        ];
        let (host, pages) = (hst.named(), gpu.named());
        let cx = Cx::new(py, &[&tables[..], &pages].concat(), &host)?;
        let plan = [("plan_slots", &plan_slots), ("plan_blocks", &plan_blocks)];
        let [ns, _, cap] = check_all(&cx, &plan, Elem::I32, [ANY, g.num_kv_heads, ANY])?;
        let [_, budget] = slot_pages.check(&cx, "slot_pages", Elem::I32, [ns, ANY])?;
        host_indptr.check(&cx, "host_indptr", Elem::I32, [ns + 1])?;
        host_indices.check(&cx, "host_indices", Elem::I32, [ANY])?;
        hst.rows(&cx.host(), &g)?;
        gpu.rows(&cx, &g)?;
        let floats = [&hst.float_pages()[..], &gpu.float_pages()].concat();
        // Two kv8 tiers copy bytes: any float dtype instantiates the kernel.
        let dt = if floats.is_empty() {
            oasis_core::DType::F32
        } else {
            kv_dtype(py, &floats)?
        };
        check_disjoint(py, &[&host[..], &pages].concat())?;
        check_outputs(py, &pages, &tables)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; the page pools are disjoint from each other and from every input.
                let (ps, pb, sp, hi, hx) = unsafe { (plan_slots.ints(), plan_blocks.ints(), slot_pages.ints(), host_indptr.ints(), host_indices.ints()) };
                let (ht, gt) = unsafe { (hst.read::<T>(), gpu.write::<T>()) };
                guarded(py, "gather_blocks", || kernels::gather_blocks_tiers::<T>(&g, ps, pb, cap, sp, budget, hi, hx, &ht, gt)).map(Some)
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above (the host pool pinned; mapped checked in
                // on_gpu); the page pools are disjoint from each other and from every input.
                let (ps, pb, sp, hi, hx) = unsafe { (plan_slots.dev::<i32>(), plan_blocks.dev::<i32>(), slot_pages.dev::<i32>(), host_indptr.dev::<i32>(), host_indices.dev::<i32>()) };
                let (ht, gt) = unsafe { (hst.dev::<T>(), gpu.dev::<T>()) };
                // A pool in device memory (the all-resident oracle) takes the launch HBM reads need.
                let device_source = !host_k.is_host_mapped();
                on_gpu(py, "gather_blocks", dev, stream, &host, move |g8, st| g8.gather_blocks_tiers::<T>(&g, ps, pb, cap, sp, budget, hi, hx, ht, gt, device_source, st))?;
                Ok(None)
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, src_k, src_v, src_ids, dst_k, dst_v, dst_ids, *, src_k_scales = None, src_v_scales = None, dst_k_scales = None, dst_v_scales = None, valid = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Whole-page copy between two pools of the same page geometry: src_ids[i] -> dst_ids[i], all heads.
///
/// src_k, src_v [num_src_pages, num_kv_heads, block_size, head_dim]; dst_k, dst_v [num_dst_pages,
/// ...]; src_ids, dst_ids [n] int32. Bit-exact between pools of one storage. Either pool may hold
/// fp8_e4m3 KV (uint8 pages with src_/dst_k_scales, v_scales [rows, num_kv_heads] float32): float
/// to kv8 quantizes each page over its first valid[i] rows (valid [n] int32 in 1..=block_size;
/// None: full pages), kv8 to float dequantizes, kv8 to kv8 copies codes and scales.
///
/// CUDA: src_ids, dst_ids on cuda:N; each pool there too or in pinned CPU memory (dense pages to
/// host blocks when a request turns sparse); queued on `stream` (raw cudaStream_t, 0 = legacy
/// default), returns at once. Out-of-range ids are skipped on the GPU.
fn copy_pages(
    py: Python<'_>,
    geo: &PyGeometry,
    src_k: TensorArg,
    src_v: TensorArg,
    src_ids: TensorArg,
    dst_k: TensorArg,
    dst_v: TensorArg,
    dst_ids: TensorArg,
    src_k_scales: Option<TensorArg>,
    src_v_scales: Option<TensorArg>,
    dst_k_scales: Option<TensorArg>,
    dst_v_scales: Option<TensorArg>,
    valid: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "copy_pages", || {
        let g = geo.inner;
        let src = Tier::new(
            py,
            SRC_TIER,
            &src_k,
            &src_v,
            src_k_scales.as_ref(),
            src_v_scales.as_ref(),
        )?;
        let dst = Tier::new(
            py,
            DST_TIER,
            &dst_k,
            &dst_v,
            dst_k_scales.as_ref(),
            dst_v_scales.as_ref(),
        )?;
        let mut ids = vec![("src_ids", &src_ids), ("dst_ids", &dst_ids)];
        if let Some(v) = &valid {
            ids.push(("valid", v));
        }
        let pools = [&src.named()[..], &dst.named()].concat();
        let cx = Cx::new(py, &ids, &pools)?;
        src.rows(&cx.host(), &g)?;
        dst.rows(&cx.host(), &g)?;
        check_all(&cx, &ids, Elem::I32, [ANY])?;
        let floats = [&src.float_pages()[..], &dst.float_pages()].concat();
        // Two kv8 pools copy bytes: any float dtype instantiates the kernel.
        let dt = if floats.is_empty() {
            oasis_core::DType::F32
        } else {
            kv_dtype(py, &floats)?
        };
        check_disjoint(py, &pools)?;
        check_outputs(py, &dst.named(), &ids)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; destination pools are disjoint from the sources and the ids.
                let (si, di) = unsafe { (src_ids.ints(), dst_ids.ints()) };
                let va = valid.as_ref().map(|v| unsafe { v.ints() });
                let (st, dt) = unsafe { (src.read::<T>(), dst.write::<T>()) };
                guarded(py, "copy_pages", || kernels::copy_pages_tiers::<T>(&g, &st, si, dt, di, va))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above (pinned pools: mapped checked in on_gpu);
                // destination pools are disjoint from the sources and the ids.
                let (si, di) = unsafe { (src_ids.dev::<i32>(), dst_ids.dev::<i32>()) };
                let va = valid.as_ref().map(|v| unsafe { v.dev::<i32>() });
                let (st, dt) = unsafe { (src.dev::<T>(), dst.dev::<T>()) };
                on_gpu(py, "copy_pages", dev, stream, &pools, move |g8, sm| g8.copy_pages_tiers::<T>(&g, st, si, dt, di, va, sm))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, src, valid, codes, scales, *, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Quantize whole pages to fp8_e4m3 KV (`oasis_core::kernels::kv8`): per (page, KV head) the
/// power-of-two scale of the first valid[i] rows' largest finite magnitude, then each value
/// rounded to the nearest E4M3 code (ties to even; NaN and inf to the NaN code); rows past
/// valid[i] are code 0.
///
/// src [n, num_kv_heads, block_size, head_dim] float; valid [n] int32 in 1..=block_size; codes
/// [n, num_kv_heads, block_size, head_dim] uint8 and scales [n, num_kv_heads] float32 (written).
fn quantize_kv8(
    py: Python<'_>,
    geo: &PyGeometry,
    src: TensorArg,
    valid: TensorArg,
    codes: TensorArg,
    scales: TensorArg,
    stream: u64,
) -> PyResult<()> {
    entry(py, "quantize_kv8", || {
        let g = geo.inner;
        let all = [
            ("src", &src),
            ("valid", &valid),
            ("codes", &codes),
            ("scales", &scales),
        ];
        let cx = Cx::new(py, &all, &[])?;
        let page = [ANY, g.num_kv_heads, g.block_size, g.head_dim];
        let [n, ..] = src.check(&cx, "src", Elem::Any, page)?;
        valid.check(&cx, "valid", Elem::I32, [n])?;
        codes.check(
            &cx,
            "codes",
            Elem::U8,
            [n, g.num_kv_heads, g.block_size, g.head_dim],
        )?;
        scales.check(&cx, "scales", Elem::F32, [n, g.num_kv_heads])?;
        let dt = kv_dtype(py, &[("src", &src)])?;
        check_outputs(
            py,
            &[("codes", &codes), ("scales", &scales)],
            &[("src", &src), ("valid", &valid)],
        )?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; the outputs are disjoint from each other and the inputs.
                let (sr, va, cd, sc) = unsafe { (src.slice::<T>(), valid.ints(), codes.slice_mut::<u8>(), scales.slice_mut::<f32>()) };
                guarded(py, "quantize_kv8", || kernels::quantize_kv8::<T>(&g, sr, va, cd, sc))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; the outputs are disjoint from the inputs.
                let (sr, va, cd, sc) = unsafe { (src.dev::<T>(), valid.dev::<i32>(), codes.dev::<u8>(), scales.dev::<f32>()) };
                on_gpu(py, "quantize_kv8", dev, stream, &[], move |g8, st| g8.quantize_kv8::<T>(&g, sr, va, cd, sc, st))
            }),
        }
    })
}

/// The names each tier's tensors go by in messages.
const HOST_TIER: [&str; 4] = ["host_k", "host_v", "host_k_scales", "host_v_scales"];
const SRC_TIER: [&str; 4] = ["src_k", "src_v", "src_k_scales", "src_v_scales"];
const DST_TIER: [&str; 4] = ["dst_k", "dst_v", "dst_k_scales", "dst_v_scales"];

/// Add this module's functions to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(append_kv, m)?)?;
    m.add_function(wrap_pyfunction!(build_summaries, m)?)?;
    m.add_function(wrap_pyfunction!(gather_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(set_gather_launch, m)?)?;
    m.add_function(wrap_pyfunction!(gather_launch, m)?)?;
    m.add_function(wrap_pyfunction!(copy_pages, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_kv8, m)?)?;
    Ok(())
}
