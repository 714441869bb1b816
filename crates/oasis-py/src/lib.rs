//! `oasiskv._core`: the thin PyO3 module over `oasis-core`.
//!
//! Tensors cross the boundary as [`TensorArg`]s: anything with torch's `data_ptr()`, `shape`,
//! `dtype`, `device` and `is_contiguous()` (torch tensors, in practice). Every function checks
//! device, dtype, contiguity, shape and aliasing here, then releases the GIL and calls the core
//! kernel, which validates every table entry before writing. No panic crosses into Python: each
//! entry point runs under `catch_unwind` and core errors become the classes of `oasiskv.errors`.

mod errors;
mod tensor;

use std::panic::{catch_unwind, AssertUnwindSafe};

use half::{bf16, f16};
use oasis_core::kernels::{self, ExtraKv, PagedKv};
use oasis_core::{BlockPool as CorePool, DType, KvGeometry, OasisError, Tier};
use pyo3::prelude::*;

use errors::{core_err, py_err};
use tensor::{check_disjoint, TensorArg};

/// Run `f` with the GIL released, turning a panic into an `OasisError` instead of unwinding
/// into Python.
fn guarded<R: Send>(py: Python<'_>, what: &str, f: impl FnOnce() -> Result<R, OasisError> + Send) -> PyResult<R> {
    let res = py.detach(|| catch_unwind(AssertUnwindSafe(f)));
    match res {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(core_err(py, e)),
        Err(_) => Err(py_err(py, "OasisError", format!("internal error in {what}; please report it with the call's shapes"))),
    }
}

/// Dispatch a generic kernel body over the storage dtype.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
        }
    };
}

/// The KV shape of a model: query heads, KV heads, head_dim, tokens per block.
#[pyclass(name = "KvGeometry", frozen, module = "oasiskv._core")]
#[derive(Clone)]
struct PyGeometry {
    inner: KvGeometry,
}

#[pymethods]
impl PyGeometry {
    #[new]
    fn new(py: Python<'_>, num_qo_heads: usize, num_kv_heads: usize, head_dim: usize, block_size: usize) -> PyResult<Self> {
        KvGeometry::new(num_qo_heads, num_kv_heads, head_dim, block_size)
            .map(|inner| Self { inner })
            .map_err(|e| core_err(py, e))
    }
    #[getter]
    fn num_qo_heads(&self) -> usize {
        self.inner.num_qo_heads
    }
    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.inner.num_kv_heads
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head_dim
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    fn __repr__(&self) -> String {
        let g = &self.inner;
        format!(
            "KvGeometry(num_qo_heads={}, num_kv_heads={}, head_dim={}, block_size={})",
            g.num_qo_heads, g.num_kv_heads, g.head_dim, g.block_size
        )
    }
}

/// Free list of fixed-size blocks: the GPU page pool or the host pool of one engine.
#[pyclass(name = "BlockPool", module = "oasiskv._core")]
struct PyBlockPool {
    inner: CorePool,
}

#[pymethods]
impl PyBlockPool {
    /// `tier` is "gpu" or "host"; it only names the pool in errors.
    #[new]
    fn new(py: Python<'_>, tier: &str, num_blocks: usize) -> PyResult<Self> {
        let tier = match tier {
            "gpu" => Tier::Gpu,
            "host" => Tier::Host,
            other => return Err(py_err(py, "ConfigError", format!("tier must be 'gpu' or 'host', got {other:?}"))),
        };
        Ok(Self { inner: CorePool::new(tier, num_blocks) })
    }
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }
    /// Allocate `n` blocks, all or nothing. Raises OutOfBlocksError when fewer are free.
    fn allocate(&mut self, py: Python<'_>, n: usize) -> PyResult<Vec<u32>> {
        self.inner.allocate(n).map_err(|e| core_err(py, e))
    }
    /// Return blocks to the pool. Raises on a double free or an unknown id (nothing freed then).
    fn free(&mut self, py: Python<'_>, ids: Vec<u32>) -> PyResult<()> {
        self.inner.free(&ids).map_err(|e| core_err(py, e))
    }
}

/// Storage dtype shared by every KV-like tensor of one call.
fn kv_dtype(py: Python<'_>, named: &[(&str, &TensorArg)]) -> PyResult<DType> {
    let (first_name, first) = named[0];
    let dt = first.kv_dtype(py, first_name)?;
    for (name, t) in &named[1..] {
        if t.dtype != first.dtype {
            return Err(py_err(
                py,
                "DTypeError",
                format!("{name} has dtype {} but {first_name} has {}; pass all KV tensors in one dtype", t.dtype, first.dtype),
            ));
        }
    }
    Ok(dt)
}

#[pyfunction]
#[pyo3(signature = (geo, k_new, v_new, page_ids, page_offsets, host_block_ids, k_pages, v_pages, host_k, host_v, summaries))]
#[allow(clippy::too_many_arguments)]
/// Append one token per sequence into its page slot, with write-through and summary update for
/// sparse sequences (host_block_ids >= 0).
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
) -> PyResult<()> {
    let g = geo.inner;
    let n = k_new.dim(py, "k_new", 3, 0)?;
    k_new.expect_shape(py, "k_new", &[n, g.num_kv_heads, g.head_dim])?;
    v_new.expect_shape(py, "v_new", &[n, g.num_kv_heads, g.head_dim])?;
    for (name, t) in [("page_ids", &page_ids), ("page_offsets", &page_offsets), ("host_block_ids", &host_block_ids)] {
        t.expect_i32(py, name)?;
        t.expect_shape(py, name, &[n])?;
    }
    let np = k_pages.dim(py, "k_pages", 4, 0)?;
    k_pages.expect_shape(py, "k_pages", &[np, g.num_kv_heads, g.block_size, g.head_dim])?;
    v_pages.expect_shape(py, "v_pages", &[np, g.num_kv_heads, g.block_size, g.head_dim])?;
    let nh = host_k.dim(py, "host_k", 4, 0)?;
    host_k.expect_shape(py, "host_k", &[nh, g.num_kv_heads, g.block_size, g.head_dim])?;
    host_v.expect_shape(py, "host_v", &[nh, g.num_kv_heads, g.block_size, g.head_dim])?;
    summaries.expect_shape(py, "summaries", &[nh, g.num_kv_heads, 2, g.head_dim])?;
    let dt = kv_dtype(
        py,
        &[("k_pages", &k_pages), ("v_pages", &v_pages), ("k_new", &k_new), ("v_new", &v_new), ("host_k", &host_k), ("host_v", &host_v), ("summaries", &summaries)],
    )?;
    check_disjoint(py, &[("k_pages", &k_pages), ("v_pages", &v_pages), ("host_k", &host_k), ("host_v", &host_v), ("summaries", &summaries)])?;
    with_dtype!(dt, T => {
        // SAFETY: shapes, dtypes and CPU residence were checked above; the mutable buffers were
        // checked pairwise disjoint; the caller keeps the tensors alive for the call.
        let (kn, vn) = unsafe { (k_new.slice::<T>(), v_new.slice::<T>()) };
        let (kp, vp, hk, hv, sm) = unsafe { (k_pages.slice_mut::<T>(), v_pages.slice_mut::<T>(), host_k.slice_mut::<T>(), host_v.slice_mut::<T>(), summaries.slice_mut::<T>()) };
        let (pi, po, hb) = unsafe { (page_ids.ints(), page_offsets.ints(), host_block_ids.ints()) };
        guarded(py, "append_kv", || kernels::append_kv::<T>(&g, kn, vn, pi, po, hb, kp, vp, hk, hv, sm))
    })
}

#[pyfunction]
#[pyo3(signature = (geo, q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len, page_map, extra_k, extra_v, sm_scale, out))]
#[allow(clippy::too_many_arguments)]
/// Decode attention for stacked query rows over paged, head-wise working sets.
fn decode_attention(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    k_pages: TensorArg,
    v_pages: TensorArg,
    kv_indptr: TensorArg,
    kv_indices: TensorArg,
    kv_last_page_len: TensorArg,
    page_map: Option<TensorArg>,
    extra_k: Option<TensorArg>,
    extra_v: Option<TensorArg>,
    sm_scale: f32,
    out: TensorArg,
) -> PyResult<()> {
    let g = geo.inner;
    let ns = q.dim(py, "q", 4, 0)?;
    let rows = q.dim(py, "q", 4, 1)?;
    q.expect_shape(py, "q", &[ns, rows, g.num_qo_heads, g.head_dim])?;
    out.expect_shape(py, "out", &[ns, rows, g.num_qo_heads, g.head_dim])?;
    let np = k_pages.dim(py, "k_pages", 4, 0)?;
    k_pages.expect_shape(py, "k_pages", &[np, g.num_kv_heads, g.block_size, g.head_dim])?;
    v_pages.expect_shape(py, "v_pages", &[np, g.num_kv_heads, g.block_size, g.head_dim])?;
    kv_indptr.expect_i32(py, "kv_indptr")?;
    kv_indptr.expect_shape(py, "kv_indptr", &[ns + 1])?;
    kv_indices.expect_i32(py, "kv_indices")?;
    kv_indices.dim(py, "kv_indices", 1, 0)?;
    kv_last_page_len.expect_i32(py, "kv_last_page_len")?;
    kv_last_page_len.expect_shape(py, "kv_last_page_len", &[ns])?;
    if let Some(pm) = &page_map {
        pm.expect_i32(py, "page_map")?;
        pm.expect_shape(py, "page_map", &[np, g.num_kv_heads])?;
    }
    let mut named = vec![("q", &q), ("k_pages", &k_pages), ("v_pages", &v_pages), ("out", &out)];
    match (&extra_k, &extra_v) {
        (Some(ek), Some(ev)) => {
            ek.expect_shape(py, "extra_k", &[ns, g.num_kv_heads, g.head_dim])?;
            ev.expect_shape(py, "extra_v", &[ns, g.num_kv_heads, g.head_dim])?;
            named.push(("extra_k", ek));
            named.push(("extra_v", ev));
        }
        (None, None) => {}
        _ => return Err(py_err(py, "InvalidArgumentError", "pass extra_k and extra_v together, or neither".into())),
    }
    let dt = kv_dtype(py, &named)?;
    for (name, t) in &named[..named.len()] {
        if *name != "out" {
            check_disjoint(py, &[("out", &out), (name, t)])?;
        }
    }
    with_dtype!(dt, T => {
        // SAFETY: shapes/dtypes/CPU residence checked above; `out` is disjoint from every input.
        let (qs, kp, vp, o) = unsafe { (q.slice::<T>(), k_pages.slice::<T>(), v_pages.slice::<T>(), out.slice_mut::<T>()) };
        let kv = PagedKv {
            k_pages: kp,
            v_pages: vp,
            kv_indptr: unsafe { kv_indptr.ints() },
            kv_indices: unsafe { kv_indices.ints() },
            kv_last_page_len: unsafe { kv_last_page_len.ints() },
            page_map: page_map.as_ref().map(|p| unsafe { p.ints() }),
        };
        let extra = match (&extra_k, &extra_v) {
            (Some(ek), Some(ev)) => Some(ExtraKv { k: unsafe { ek.slice::<T>() }, v: unsafe { ev.slice::<T>() } }),
            _ => None,
        };
        guarded(py, "decode_attention", || kernels::decode_attention::<T>(&g, qs, rows, &kv, extra.as_ref(), sm_scale, o))
    })
}

#[pyfunction]
/// Recompute the min/max summaries of the given host blocks over their first `block_lens` tokens.
fn build_summaries(py: Python<'_>, geo: &PyGeometry, host_k: TensorArg, block_ids: TensorArg, block_lens: TensorArg, summaries: TensorArg) -> PyResult<()> {
    let g = geo.inner;
    let nh = host_k.dim(py, "host_k", 4, 0)?;
    host_k.expect_shape(py, "host_k", &[nh, g.num_kv_heads, g.block_size, g.head_dim])?;
    summaries.expect_shape(py, "summaries", &[nh, g.num_kv_heads, 2, g.head_dim])?;
    let n = block_ids.dim(py, "block_ids", 1, 0)?;
    block_ids.expect_i32(py, "block_ids")?;
    block_lens.expect_i32(py, "block_lens")?;
    block_lens.expect_shape(py, "block_lens", &[n])?;
    let dt = kv_dtype(py, &[("host_k", &host_k), ("summaries", &summaries)])?;
    check_disjoint(py, &[("host_k", &host_k), ("summaries", &summaries)])?;
    with_dtype!(dt, T => {
        // SAFETY: checked above; summaries is disjoint from host_k.
        let (hk, sm, ids, lens) = unsafe { (host_k.slice::<T>(), summaries.slice_mut::<T>(), block_ids.ints(), block_lens.ints()) };
        guarded(py, "build_summaries", || kernels::build_summaries::<T>(&g, hk, ids, lens, sm))
    })
}

#[pyfunction]
/// Quest block scores of the lookahead queries, summed over each GQA group: scores [nnz, num_kv_heads] f32.
fn score_blocks(py: Python<'_>, geo: &PyGeometry, q: TensorArg, summaries: TensorArg, blk_indptr: TensorArg, blk_indices: TensorArg, scores: TensorArg) -> PyResult<()> {
    let g = geo.inner;
    let ns = q.dim(py, "q", 3, 0)?;
    q.expect_shape(py, "q", &[ns, g.num_qo_heads, g.head_dim])?;
    let nh = summaries.dim(py, "summaries", 4, 0)?;
    summaries.expect_shape(py, "summaries", &[nh, g.num_kv_heads, 2, g.head_dim])?;
    blk_indptr.expect_i32(py, "blk_indptr")?;
    blk_indptr.expect_shape(py, "blk_indptr", &[ns + 1])?;
    blk_indices.expect_i32(py, "blk_indices")?;
    let nnz = blk_indices.dim(py, "blk_indices", 1, 0)?;
    scores.expect_f32(py, "scores")?;
    scores.expect_shape(py, "scores", &[nnz, g.num_kv_heads])?;
    let dt = kv_dtype(py, &[("q", &q), ("summaries", &summaries)])?;
    with_dtype!(dt, T => {
        // SAFETY: checked above; scores is f32 and so cannot alias the T-typed inputs' use.
        let (qs, sm, ip, ix, sc) = unsafe { (q.slice::<T>(), summaries.slice::<T>(), blk_indptr.ints(), blk_indices.ints(), scores.slice_mut::<f32>()) };
        guarded(py, "score_blocks", || kernels::score_blocks::<T>(&g, qs, sm, ip, ix, sc))
    })
}

#[pyfunction]
/// Per (seq, kv head) top-k logical blocks, best first, -1 padded: out [num_seqs, num_kv_heads, k].
fn topk_blocks(py: Python<'_>, num_kv_heads: usize, scores: TensorArg, blk_indptr: TensorArg, k: usize, out: TensorArg) -> PyResult<()> {
    scores.expect_f32(py, "scores")?;
    let nnz = scores.dim(py, "scores", 2, 0)?;
    scores.expect_shape(py, "scores", &[nnz, num_kv_heads])?;
    blk_indptr.expect_i32(py, "blk_indptr")?;
    let ns = blk_indptr.dim(py, "blk_indptr", 1, 0)?.saturating_sub(1);
    out.expect_i32(py, "out")?;
    out.expect_shape(py, "out", &[ns, num_kv_heads, k])?;
    // SAFETY: checked above; out is i32 and scores f32, distinct tensors.
    let (sc, ip, o) = unsafe { (scores.slice::<f32>(), blk_indptr.ints(), out.ints_mut()) };
    guarded(py, "topk_blocks", || kernels::topk_blocks(num_kv_heads, sc, ip, k, o))
}

#[pyfunction]
#[pyo3(signature = (num_kv_heads, predicted, slot_pages, page_map, page_last_selected, step, fetch_cap, plan_slots, plan_blocks))]
#[allow(clippy::too_many_arguments)]
/// Delta selection with capped least-recently-selected eviction. Updates page_map and
/// page_last_selected in place, writes the plan, returns (pairs, kept, missing).
fn delta_select(
    py: Python<'_>,
    num_kv_heads: usize,
    predicted: TensorArg,
    slot_pages: TensorArg,
    page_map: TensorArg,
    page_last_selected: TensorArg,
    step: i32,
    fetch_cap: usize,
    plan_slots: TensorArg,
    plan_blocks: TensorArg,
) -> PyResult<(usize, usize, usize)> {
    let ns = predicted.dim(py, "predicted", 3, 0)?;
    let np = predicted.dim(py, "predicted", 3, 2)?;
    predicted.expect_shape(py, "predicted", &[ns, num_kv_heads, np])?;
    let budget = slot_pages.dim(py, "slot_pages", 2, 1)?;
    slot_pages.expect_shape(py, "slot_pages", &[ns, budget])?;
    let npages = page_map.dim(py, "page_map", 2, 0)?;
    page_map.expect_shape(py, "page_map", &[npages, num_kv_heads])?;
    page_last_selected.expect_shape(py, "page_last_selected", &[npages, num_kv_heads])?;
    plan_slots.expect_shape(py, "plan_slots", &[ns, num_kv_heads, fetch_cap])?;
    plan_blocks.expect_shape(py, "plan_blocks", &[ns, num_kv_heads, fetch_cap])?;
    let all = [
        ("predicted", &predicted),
        ("slot_pages", &slot_pages),
        ("page_map", &page_map),
        ("page_last_selected", &page_last_selected),
        ("plan_slots", &plan_slots),
        ("plan_blocks", &plan_blocks),
    ];
    for (name, t) in all {
        t.expect_i32(py, name)?;
    }
    check_disjoint(py, &all)?;
    // SAFETY: all i32 on the CPU with the checked shapes; the four mutable ones are disjoint.
    let (pr, sp, pm, pls, ps, pb) = unsafe {
        (predicted.ints(), slot_pages.ints(), page_map.ints_mut(), page_last_selected.ints_mut(), plan_slots.ints_mut(), plan_blocks.ints_mut())
    };
    let st = guarded(py, "delta_select", || kernels::delta_select(num_kv_heads, pr, np, sp, budget, pm, pls, step, fetch_cap, ps, pb))?;
    Ok((st.pairs, st.kept, st.missing))
}

#[pyfunction]
#[pyo3(signature = (geo, plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, host_k, host_v, k_pages, v_pages))]
#[allow(clippy::too_many_arguments)]
/// Execute a selection plan: copy planned block-head entries from the host pool into GPU slots.
/// Returns the number of block-head entries copied.
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
) -> PyResult<usize> {
    let g = geo.inner;
    let ns = plan_slots.dim(py, "plan_slots", 3, 0)?;
    let cap = plan_slots.dim(py, "plan_slots", 3, 2)?;
    for (name, t) in [("plan_slots", &plan_slots), ("plan_blocks", &plan_blocks), ("slot_pages", &slot_pages), ("host_indptr", &host_indptr), ("host_indices", &host_indices)] {
        t.expect_i32(py, name)?;
    }
    plan_slots.expect_shape(py, "plan_slots", &[ns, g.num_kv_heads, cap])?;
    plan_blocks.expect_shape(py, "plan_blocks", &[ns, g.num_kv_heads, cap])?;
    let budget = slot_pages.dim(py, "slot_pages", 2, 1)?;
    slot_pages.expect_shape(py, "slot_pages", &[ns, budget])?;
    host_indptr.expect_shape(py, "host_indptr", &[ns + 1])?;
    host_indices.dim(py, "host_indices", 1, 0)?;
    let nh = host_k.dim(py, "host_k", 4, 0)?;
    host_k.expect_shape(py, "host_k", &[nh, g.num_kv_heads, g.block_size, g.head_dim])?;
    host_v.expect_shape(py, "host_v", &[nh, g.num_kv_heads, g.block_size, g.head_dim])?;
    let np = k_pages.dim(py, "k_pages", 4, 0)?;
    k_pages.expect_shape(py, "k_pages", &[np, g.num_kv_heads, g.block_size, g.head_dim])?;
    v_pages.expect_shape(py, "v_pages", &[np, g.num_kv_heads, g.block_size, g.head_dim])?;
    let dt = kv_dtype(py, &[("host_k", &host_k), ("host_v", &host_v), ("k_pages", &k_pages), ("v_pages", &v_pages)])?;
    check_disjoint(py, &[("host_k", &host_k), ("host_v", &host_v), ("k_pages", &k_pages), ("v_pages", &v_pages)])?;
    with_dtype!(dt, T => {
        // SAFETY: checked above; the page pools are disjoint from each other and from the host pool.
        let (ps, pb, sp, hi, hx) = unsafe { (plan_slots.ints(), plan_blocks.ints(), slot_pages.ints(), host_indptr.ints(), host_indices.ints()) };
        let (hk, hv, kp, vp) = unsafe { (host_k.slice::<T>(), host_v.slice::<T>(), k_pages.slice_mut::<T>(), v_pages.slice_mut::<T>()) };
        guarded(py, "gather_blocks", || kernels::gather_blocks::<T>(&g, ps, pb, cap, sp, budget, hi, hx, hk, hv, kp, vp))
    })
}

#[pyfunction]
#[allow(clippy::too_many_arguments)]
/// Whole-page copy between two pools of the same page geometry: src_ids[i] -> dst_ids[i].
fn copy_pages(py: Python<'_>, geo: &PyGeometry, src_k: TensorArg, src_v: TensorArg, src_ids: TensorArg, dst_k: TensorArg, dst_v: TensorArg, dst_ids: TensorArg) -> PyResult<()> {
    let g = geo.inner;
    let ns = src_k.dim(py, "src_k", 4, 0)?;
    src_k.expect_shape(py, "src_k", &[ns, g.num_kv_heads, g.block_size, g.head_dim])?;
    src_v.expect_shape(py, "src_v", &[ns, g.num_kv_heads, g.block_size, g.head_dim])?;
    let nd = dst_k.dim(py, "dst_k", 4, 0)?;
    dst_k.expect_shape(py, "dst_k", &[nd, g.num_kv_heads, g.block_size, g.head_dim])?;
    dst_v.expect_shape(py, "dst_v", &[nd, g.num_kv_heads, g.block_size, g.head_dim])?;
    src_ids.expect_i32(py, "src_ids")?;
    dst_ids.expect_i32(py, "dst_ids")?;
    let n = src_ids.dim(py, "src_ids", 1, 0)?;
    dst_ids.expect_shape(py, "dst_ids", &[n])?;
    let dt = kv_dtype(py, &[("src_k", &src_k), ("src_v", &src_v), ("dst_k", &dst_k), ("dst_v", &dst_v)])?;
    check_disjoint(py, &[("src_k", &src_k), ("src_v", &src_v), ("dst_k", &dst_k), ("dst_v", &dst_v)])?;
    with_dtype!(dt, T => {
        // SAFETY: checked above; destination pools are disjoint from the sources.
        let (sk, sv, si, dk, dv, di) = unsafe { (src_k.slice::<T>(), src_v.slice::<T>(), src_ids.ints(), dst_k.slice_mut::<T>(), dst_v.slice_mut::<T>(), dst_ids.ints()) };
        guarded(py, "copy_pages", || kernels::copy_pages::<T>(&g, sk, sv, si, dk, dv, di))
    })
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyGeometry>()?;
    m.add_class::<PyBlockPool>()?;
    m.add_function(wrap_pyfunction!(append_kv, m)?)?;
    m.add_function(wrap_pyfunction!(decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(build_summaries, m)?)?;
    m.add_function(wrap_pyfunction!(score_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(topk_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(delta_select, m)?)?;
    m.add_function(wrap_pyfunction!(gather_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(copy_pages, m)?)?;
    Ok(())
}
