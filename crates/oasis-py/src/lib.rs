//! `oasiskv._core`: the thin PyO3 module over `oasis-core` (CPU twins) and `oasis-cuda` (GPU
//! kernels).
//!
//! Tensors cross the boundary as [`TensorArg`]s: anything with torch's `data_ptr()`, `shape`,
//! `dtype`, `device` and `is_contiguous()` (torch tensors, in practice). Every kernel function
//! dispatches on the device of its tensors:
//!
//! ```text
//!                ┌─ all on the CPU ──────▶ oasis_core::kernels::* (validates every table entry)
//! tensors ─ Cx ──┤
//!                └─ all on one cuda:N ───▶ oasis_cuda::Gpu::* on `stream` (host pool: pinned CPU
//!                                          memory through unified addressing, or cuda:N)
//! ```
//!
//! Device, dtype, contiguity, shape and aliasing are checked here, the same checks for both
//! paths; then the GIL is released and the kernel runs (CPU) or is queued (CUDA: the call returns
//! without synchronising). Table *contents* are not validated on the GPU (that would need a
//! synchronisation): the kernels check ids against their pools and every CSR row against the
//! length of its indices where they read them, skip a bad id and read a malformed row as empty,
//! where the CPU twins raise (docs/CORE_CONTRACT.md, last section). No panic crosses into
//! Python: each entry point runs under `catch_unwind`, and core and CUDA errors become the
//! classes of `oasiskv.errors`.
//!
//! Nothing here links against CUDA: the module imports on a machine without a driver or NVRTC,
//! and only a call on CUDA tensors (or `compile_kernels`, `nvrtc_version`) asks for them.

mod errors;
mod rt;
mod runtime;
mod tensor;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use half::{bf16, f16};
use oasis_core::kernels::{self, ExtraKv, HeadLayout, PagedKv, Positions, QkNorm, Residual};
use oasis_core::{BlockPool as CorePool, DType, KvGeometry, OasisError, Tier};
use oasis_cuda::ops::{
    decode_attn_workspace_len as ws_len, plan_num_splits as plan_splits, MAX_SPLITS,
};
use oasis_cuda::ops::{PositionsDev, ResidualDev};
use oasis_cuda::{CudaError, DevSlice, ExtraKvDev, Gpu, PagedKvDev, SplitKv, Stream};
use pyo3::prelude::*;

use errors::{core_err, cuda_err, py_err};
use tensor::{check_disjoint, check_disjoint_bytes, Cx, Place, RowsView, TensorArg};

fn internal_error(py: Python<'_>, what: &str) -> PyErr {
    py_err(
        py,
        "OasisError",
        format!("internal error in {what}; please report it with the call's shapes"),
    )
}

/// Run a whole entry point, turning a panic into an `OasisError` instead of unwinding into
/// Python.
fn entry<R>(py: Python<'_>, what: &str, f: impl FnOnce() -> PyResult<R>) -> PyResult<R> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(internal_error(py, what)))
}

/// Run a CPU kernel with the GIL released, turning a panic into an `OasisError`.
fn guarded<R: Send>(
    py: Python<'_>,
    what: &str,
    f: impl FnOnce() -> Result<R, OasisError> + Send,
) -> PyResult<R> {
    let res = py.detach(|| catch_unwind(AssertUnwindSafe(f)));
    match res {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(core_err(py, e)),
        Err(_) => Err(internal_error(py, what)),
    }
}

/// One [`Gpu`] per device ordinal, attached on the first call that runs there (PyTorch's
/// context for that device: the current one when it belongs to it, else its primary context).
static GPUS: OnceLock<Mutex<HashMap<i32, Arc<Gpu>>>> = OnceLock::new();

fn gpu_for(device: i32) -> Result<Arc<Gpu>, CudaError> {
    let mut gpus = GPUS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(g) = gpus.get(&device) {
        return Ok(g.clone());
    }
    let g = Gpu::attach(Some(device))?;
    gpus.insert(device, g.clone());
    Ok(g)
}

/// Run `f` with the GIL released and no panic escaping, mapping CUDA errors.
fn detached<R: Send>(
    py: Python<'_>,
    what: &str,
    f: impl FnOnce() -> Result<R, CudaError> + Send,
) -> PyResult<R> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(cuda_err(py, e)),
        Err(_) => Err(internal_error(py, what)),
    }
}

/// Queue a CUDA kernel on `stream` of `device`: attach (once per device), check that every
/// pinned host tensor of `host` is mapped at its own address on the device, then call `f` with
/// the GIL released.
fn on_gpu<R: Send>(
    py: Python<'_>,
    what: &str,
    device: i32,
    stream: u64,
    host: &[(&str, &TensorArg)],
    f: impl FnOnce(&Gpu, Stream) -> Result<R, CudaError> + Send,
) -> PyResult<R> {
    let gpu = detached(py, what, || gpu_for(device))?;
    for (name, t) in host.iter().filter(|(_, t)| t.is_host_mapped()) {
        let ptr = t.ptr as u64;
        if let Err(e) = py.detach(|| gpu.check_uva(ptr)) {
            return Err(py_err(
                py,
                "DeviceError",
                format!("{name} is not visible to cuda:{device} at its host address ({e}); allocate it with torch.empty(..., pin_memory=True)"),
            ));
        }
    }
    // SAFETY: Stream::from_raw's contract is the documented contract of every kernel function of
    // this module: `stream` is 0 or a live stream of the tensors' device
    // (torch.cuda.current_stream(device).cuda_stream), as for PyTorch's own raw-stream APIs.
    let stream = unsafe { Stream::from_raw(stream) };
    detached(py, what, || f(&gpu, stream))
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
    fn new(
        py: Python<'_>,
        num_qo_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
    ) -> PyResult<Self> {
        entry(py, "KvGeometry", || {
            KvGeometry::new(num_qo_heads, num_kv_heads, head_dim, block_size)
                .map(|inner| Self { inner })
                .map_err(|e| core_err(py, e))
        })
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
    /// `tier` is "gpu" or "host"; it only names the pool in errors. Raises ConfigError for more
    /// than 2**31 - 1 blocks (ids are int32) and OutOfMemoryError when the free list cannot be
    /// allocated (5 bytes per block), never aborting the process.
    #[new]
    fn new(py: Python<'_>, tier: &str, num_blocks: usize) -> PyResult<Self> {
        let tier = match tier {
            "gpu" => Tier::Gpu,
            "host" => Tier::Host,
            other => {
                return Err(py_err(
                    py,
                    "ConfigError",
                    format!("tier must be 'gpu' or 'host', got {other:?}"),
                ))
            }
        };
        // The GIL is released: a large pool takes a while to fill.
        guarded(py, "BlockPool", || CorePool::try_new(tier, num_blocks)).map(|inner| Self { inner })
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
        entry(py, "BlockPool.allocate", || {
            self.inner.allocate(n).map_err(|e| core_err(py, e))
        })
    }
    /// Return blocks to the pool. Raises on a double free or an unknown id (nothing freed then).
    fn free(&mut self, py: Python<'_>, ids: Vec<u32>) -> PyResult<()> {
        entry(py, "BlockPool.free", || {
            self.inner.free(&ids).map_err(|e| core_err(py, e))
        })
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
                format!(
                    "{name} has dtype {} but {first_name} has {}; pass all KV tensors in one dtype",
                    t.dtype, first.dtype
                ),
            ));
        }
    }
    Ok(dt)
}

/// Rows of the K/V pool tensors of `pool` (the first gives the count), all shaped
/// `[n, num_kv_heads, block_size, head_dim]`: GPU pages, or host blocks under [`Cx::host`].
fn pool_rows(cx: &Cx<'_>, g: &KvGeometry, pool: &[(&str, &TensorArg)]) -> PyResult<usize> {
    let (first_name, first) = pool[0];
    let n = first.dim(cx, first_name, 4, 0)?;
    for (name, t) in pool {
        t.expect_shape(cx, name, &[n, g.num_kv_heads, g.block_size, g.head_dim])?;
    }
    Ok(n)
}

/// The shapes shared by the kernels that read host K rows into per-block summary data:
/// `host` the host pool, `summaries [nb, num_kv_heads, 2, head_dim]`, and int32 `tables`
/// (`block_ids` first) of one length. Returns `nb`.
fn check_block_tables(
    py: Python<'_>,
    cx: &Cx<'_>,
    g: &KvGeometry,
    host: &[(&str, &TensorArg)],
    summaries: &TensorArg,
    tables: &[(&str, &TensorArg)],
) -> PyResult<usize> {
    pool_rows(&cx.host(), g, host)?;
    let nb = summaries.dim(cx, "summaries", 4, 0)?;
    summaries.expect_shape(cx, "summaries", &[nb, g.num_kv_heads, 2, g.head_dim])?;
    let (first_name, first) = tables[0];
    let n = first.dim(cx, first_name, 1, 0)?;
    for &(name, t) in tables {
        t.expect_i32(py, name)?;
        t.expect_shape(cx, name, &[n])?;
    }
    Ok(nb)
}

/// Outputs must not share memory with each other nor with any input of the same call.
fn check_outputs(
    py: Python<'_>,
    outputs: &[(&str, &TensorArg)],
    inputs: &[(&str, &TensorArg)],
) -> PyResult<()> {
    check_disjoint(py, outputs)?;
    for o in outputs {
        for i in inputs {
            check_disjoint(py, &[*o, *i])?;
        }
    }
    Ok(())
}

#[pyfunction]
#[pyo3(signature = (stamps, mode, *, stream = 0))]
/// Time a wait of a stream on background work: stamps int64 [3] = (start of the current wait,
/// total waited, waits), nanoseconds. mode 0 marks the start (stamps[0] = now), any other mode
/// the end (stamps[1] += now - stamps[0], stamps[2] += 1). Queue mode 0 just before a wait on
/// another stream's event and mode 1 just after it.
///
/// CUDA: the device's global timer, queued on `stream` (raw cudaStream_t; 0 = the legacy default
/// stream) and captured into a CUDA graph like any kernel. CPU: a monotonic clock, at once.
fn wait_stamp(py: Python<'_>, stamps: TensorArg, mode: i32, stream: u64) -> PyResult<()> {
    entry(py, "wait_stamp", || {
        let cx = Cx::new(py, &[("stamps", &stamps)], &[])?;
        stamps.expect_i64(py, "stamps")?;
        stamps.expect_shape(&cx, "stamps", &[3])?;
        let stamp = kernels::WaitStamp::from_mode(mode);
        match cx.place {
            Place::Cpu => {
                let now = monotonic_ns();
                // SAFETY: a CPU tensor of 3 int64 (checked above), read as u64 (same size and
                // alignment); no other argument aliases it.
                let s = unsafe { stamps.slice_mut::<u64>() };
                guarded(py, "wait_stamp", || kernels::wait_stamp(s, stamp, now))
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) 3 int64 on cuda:dev, read as u64 by the kernel.
                let s = unsafe { stamps.dev::<u64>() };
                on_gpu(py, "wait_stamp", dev, stream, &[], move |gpu, st| {
                    gpu.wait_stamp(s, stamp, st)
                })
            }
        }
    })
}

/// Nanoseconds of a monotonic clock (from the first call in this process).
fn monotonic_ns() -> u64 {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    let start = START.get_or_init(std::time::Instant::now);
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

#[pyfunction]
#[pyo3(signature = (max_blocks = None, warps_per_block = None, entries_per_warp = None, stage_entries = None))]
/// Launch shape of the GPU gather (`gather_blocks`): at most `max_blocks` blocks (0: no cap) of
/// `warps_per_block` warps (1-4), each checking `entries_per_warp` plan entries (1-32) per pass
/// and copying `stage_entries` (0-32) of them at once through shared memory (0: through
/// registers). A field left out (None) takes the default launch's. Process-wide, for tuning; a
/// captured CUDA graph keeps the launch it was captured with.
fn set_gather_launch(
    max_blocks: Option<usize>,
    warps_per_block: Option<u32>,
    entries_per_warp: Option<u32>,
    stage_entries: Option<u32>,
) -> PyResult<()> {
    // A field left out takes the default launch's (one place holds the measured best).
    let d = oasis_cuda::ops::GatherLaunch::DEFAULT;
    oasis_cuda::ops::set_gather_launch(oasis_cuda::ops::GatherLaunch {
        max_blocks: max_blocks.unwrap_or(d.max_blocks),
        warps_per_block: warps_per_block.unwrap_or(d.warps_per_block),
        entries_per_warp: entries_per_warp.unwrap_or(d.entries_per_warp),
        stage_entries: stage_entries.unwrap_or(d.stage_entries),
    })
    .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}

#[pyfunction]
/// The launch shape of `set_gather_launch`: `(max_blocks, warps_per_block, entries_per_warp,
/// stage_entries)`.
fn gather_launch() -> (usize, u32, u32, u32) {
    let l = oasis_cuda::ops::gather_launch();
    (
        l.max_blocks,
        l.warps_per_block,
        l.entries_per_warp,
        l.stage_entries,
    )
}

#[pyfunction]
#[pyo3(signature = (geo, k_new, v_new, page_ids, page_offsets, host_block_ids, k_pages, v_pages, host_k, host_v, summaries, *, host_rows = None, stream = 0))]
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
    stream: u64,
) -> PyResult<()> {
    entry(py, "append_kv", || {
        let g = geo.inner;
        let new = [("k_new", &k_new), ("v_new", &v_new)];
        let mut tables = vec![
            ("page_ids", &page_ids),
            ("page_offsets", &page_offsets),
            ("host_block_ids", &host_block_ids),
        ];
        if let Some(r) = &host_rows {
            tables.push(("host_rows", r));
        }
        let pages = [("k_pages", &k_pages), ("v_pages", &v_pages)];
        let host = [("host_k", &host_k), ("host_v", &host_v)];
        let sums = [("summaries", &summaries)];
        let cx = Cx::new(py, &[&new[..], &tables, &pages, &sums].concat(), &host)?;
        let n = k_new.dim(&cx, "k_new", 3, 0)?;
        for (name, t) in new {
            t.expect_shape(&cx, name, &[n, g.num_kv_heads, g.head_dim])?;
        }
        for &(name, t) in &tables {
            t.expect_i32(py, name)?;
            t.expect_shape(&cx, name, &[n])?;
        }
        pool_rows(&cx, &g, &pages)?;
        pool_rows(&cx.host(), &g, &host)?;
        let nb = summaries.dim(&cx, "summaries", 4, 0)?;
        summaries.expect_shape(&cx, "summaries", &[nb, g.num_kv_heads, 2, g.head_dim])?;
        let dt = kv_dtype(py, &[&pages[..], &new, &host, &sums].concat())?;
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
                let (kn, vn) = unsafe { (k_new.slice::<T>(), v_new.slice::<T>()) };
                let (kp, vp, hk, hv, sm) = unsafe { (k_pages.slice_mut::<T>(), v_pages.slice_mut::<T>(), host_k.slice_mut::<T>(), host_v.slice_mut::<T>(), summaries.slice_mut::<T>()) };
                let (pi, po, hb) = unsafe { (page_ids.ints(), page_offsets.ints(), host_block_ids.ints()) };
                let hr = host_rows.as_ref().map(|r| unsafe { r.ints() });
                guarded(py, "append_kv", || kernels::append_kv::<T>(&g, kn, vn, pi, po, hb, hr, kp, vp, hk, hv, sm))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) shapes, dtypes, contiguity and residence on cuda:dev
                // (the host pool: pinned, mapped checked in on_gpu) were checked above; outputs
                // are disjoint from every other argument.
                let (kn, vn, kp, vp, hk, hv, sm) = unsafe { (k_new.dev::<T>(), v_new.dev::<T>(), k_pages.dev::<T>(), v_pages.dev::<T>(), host_k.dev::<T>(), host_v.dev::<T>(), summaries.dev::<T>()) };
                let (pi, po, hb) = unsafe { (page_ids.dev::<i32>(), page_offsets.dev::<i32>(), host_block_ids.dev::<i32>()) };
                let hr = host_rows.as_ref().map(|r| unsafe { r.dev::<i32>() });
                on_gpu(py, "append_kv", dev, stream, &host, move |gpu, st| gpu.append_kv::<T>(&g, kn, vn, pi, po, hb, hr, kp, vp, hk, hv, sm, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len, page_map, extra_k, extra_v, sm_scale, out, *, num_splits = 0, max_pages_per_seq = 0, workspace = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Decode attention for stacked query rows over paged, head-wise working sets.
///
/// q, out [num_seqs, num_rows, num_qo_heads, head_dim]; k_pages, v_pages [num_pages,
/// num_kv_heads, block_size, head_dim]; kv_indptr [num_seqs + 1], kv_indices [nnz],
/// kv_last_page_len [num_seqs] int32 (flashinfer's CSR); page_map [num_pages, num_kv_heads] int32
/// or None (entries < 0 are skipped); extra_k, extra_v [num_seqs, num_kv_heads, head_dim] or None
/// (seen by rows >= 1 only).
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (the raw cudaStream_t of a live stream of
/// cuda:N; 0 = the legacy default stream), returns at once. `num_splits` cuts each sequence's
/// pages into that many parts merged by a second kernel (split-KV); 0 plans it from the SM count
/// and `max_pages_per_seq` (a bound on any sequence's page count; 0 = len(kv_indices)). More than
/// one split needs `workspace`, a float32 tensor on cuda:N of at least
/// decode_attn_workspace_len(num_seqs, num_rows, num_qo_heads, head_dim, num_splits) elements.
/// Table entries are not validated on the GPU: out-of-range page ids are skipped and a malformed
/// kv_indptr row reads as a sequence with no pages. NaN in q, K or V gives NaN in the outputs
/// that see it (CPU and GPU). The CPU ignores num_splits, max_pages_per_seq, workspace and
/// stream.
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
    num_splits: usize,
    max_pages_per_seq: usize,
    workspace: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "decode_attention", || {
        let g = geo.inner;
        let mut all = vec![
            ("q", &q),
            ("k_pages", &k_pages),
            ("v_pages", &v_pages),
            ("kv_indptr", &kv_indptr),
            ("kv_indices", &kv_indices),
            ("kv_last_page_len", &kv_last_page_len),
        ];
        for (name, t) in [
            ("page_map", &page_map),
            ("extra_k", &extra_k),
            ("extra_v", &extra_v),
            ("workspace", &workspace),
        ] {
            if let Some(t) = t {
                all.push((name, t));
            }
        }
        all.push(("out", &out));
        let cx = Cx::new(py, &all, &[])?;
        let ns = q.dim(&cx, "q", 4, 0)?;
        let rows = q.dim(&cx, "q", 4, 1)?;
        q.expect_shape(&cx, "q", &[ns, rows, g.num_qo_heads, g.head_dim])?;
        out.expect_shape(&cx, "out", &[ns, rows, g.num_qo_heads, g.head_dim])?;
        let np = pool_rows(&cx, &g, &[("k_pages", &k_pages), ("v_pages", &v_pages)])?;
        kv_indptr.expect_i32(py, "kv_indptr")?;
        kv_indptr.expect_shape(&cx, "kv_indptr", &[ns + 1])?;
        kv_indices.expect_i32(py, "kv_indices")?;
        kv_indices.dim(&cx, "kv_indices", 1, 0)?;
        kv_last_page_len.expect_i32(py, "kv_last_page_len")?;
        kv_last_page_len.expect_shape(&cx, "kv_last_page_len", &[ns])?;
        if let Some(pm) = &page_map {
            pm.expect_i32(py, "page_map")?;
            pm.expect_shape(&cx, "page_map", &[np, g.num_kv_heads])?;
        }
        let mut named = vec![
            ("q", &q),
            ("k_pages", &k_pages),
            ("v_pages", &v_pages),
            ("out", &out),
        ];
        let extra = match (&extra_k, &extra_v) {
            (Some(ek), Some(ev)) => {
                ek.expect_shape(&cx, "extra_k", &[ns, g.num_kv_heads, g.head_dim])?;
                ev.expect_shape(&cx, "extra_v", &[ns, g.num_kv_heads, g.head_dim])?;
                named.push(("extra_k", ek));
                named.push(("extra_v", ev));
                Some((ek, ev))
            }
            (None, None) => None,
            _ => {
                return Err(py_err(
                    py,
                    "InvalidArgumentError",
                    "pass extra_k and extra_v together, or neither".into(),
                ))
            }
        };
        let dt = kv_dtype(py, &named)?;
        let inputs: Vec<_> = all
            .iter()
            .copied()
            .filter(|(n, _)| *n != "out" && *n != "workspace")
            .collect();
        check_outputs(py, &[("out", &out)], &inputs)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
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
                let extra = extra.map(|(ek, ev)| ExtraKv { k: unsafe { ek.slice::<T>() }, v: unsafe { ev.slice::<T>() } });
                guarded(py, "decode_attention", || kernels::decode_attention::<T>(&g, qs, rows, &kv, extra.as_ref(), sm_scale, o))
            }),
            Place::Cuda(dev) => {
                let ws = match &workspace {
                    Some(w) => {
                        w.expect_f32(py, "workspace")?;
                        w.dim(&cx, "workspace", 1, 0)?;
                        check_outputs(
                            py,
                            &[("workspace", w)],
                            &all.iter()
                                .copied()
                                .filter(|(n, _)| *n != "workspace")
                                .collect::<Vec<_>>(),
                        )?;
                        // SAFETY: float32, contiguous, on cuda:dev, disjoint from every other argument.
                        Some(unsafe { w.dev::<f32>() })
                    }
                    None => None,
                };
                let (hq, h, d) = (g.num_qo_heads, g.num_kv_heads, g.head_dim);
                let max_pages = if max_pages_per_seq > 0 {
                    max_pages_per_seq
                } else {
                    kv_indices.numel()
                };
                with_dtype!(dt, T => {
                    // SAFETY: (TensorArg::dev) shapes, dtypes, contiguity and residence on cuda:dev
                    // checked above; `out` is disjoint from every other argument.
                    let (qd, od) = unsafe { (q.dev::<T>(), out.dev::<T>()) };
                    let kv = unsafe {
                        PagedKvDev {
                            k_pages: k_pages.dev::<T>(),
                            v_pages: v_pages.dev::<T>(),
                            kv_indptr: kv_indptr.dev::<i32>(),
                            kv_indices: kv_indices.dev::<i32>(),
                            kv_last_page_len: kv_last_page_len.dev::<i32>(),
                            page_map: page_map.as_ref().map(|p| p.dev::<i32>()),
                        }
                    };
                    let extra = extra.map(|(ek, ev)| unsafe { ExtraKvDev { k: ek.dev::<T>(), v: ev.dev::<T>() } });
                    on_gpu(py, "decode_attention", dev, stream, &[], move |gpu, st| {
                        let splits = if num_splits > 0 { num_splits } else { plan_splits(gpu.num_sms(), ns, h, max_pages) };
                        let split = match ws {
                            _ if splits <= 1 => None,
                            Some(w) => Some(SplitKv { num_splits: splits, workspace: w }),
                            // Out of range: the launch wrapper says so before it looks at a workspace.
                            None if splits > MAX_SPLITS => Some(SplitKv { num_splits: splits, workspace: DevSlice::empty() }),
                            None => {
                                let need = ws_len(ns, rows, hq, d, splits);
                                return Err(OasisError::Invalid(format!(
                                    "split-kv attention with {splits} splits needs a float32 workspace of {need} elements on \
                                     cuda:{dev}: pass workspace=torch.empty({need}, dtype=torch.float32, device=q.device) \
                                     (decode_attn_workspace_len gives the size), or num_splits=1"
                                ))
                                .into());
                            }
                        };
                        gpu.decode_attention::<T>(&g, qd, rows, &kv, extra.as_ref(), sm_scale, od, split.as_ref(), st)
                    })
                })
            }
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
        check_block_tables(py, &cx, &g, &host, &summaries, &tables)?;
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
#[pyo3(signature = (geo, q, summaries, blk_indptr, blk_indices, scores, *, stream = 0))]
/// Quest block scores of the lookahead queries, summed over each GQA group: scores [nnz, num_kv_heads] f32.
///
/// q [num_seqs, num_qo_heads, head_dim]; summaries [num_host_blocks, num_kv_heads, 2, head_dim];
/// blk_indptr [num_seqs + 1], blk_indices [nnz] int32 (host block of each logical block).
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (raw cudaStream_t, 0 = legacy default),
/// returns at once. An out-of-range block id, or an entry of a malformed blk_indptr row, scores
/// -inf on the GPU (the CPU raises). `stream` is ignored on the CPU.
#[allow(clippy::too_many_arguments)]
fn score_blocks(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    summaries: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    scores: TensorArg,
    stream: u64,
) -> PyResult<()> {
    entry(py, "score_blocks", || {
        let g = geo.inner;
        let inputs = [
            ("q", &q),
            ("summaries", &summaries),
            ("blk_indptr", &blk_indptr),
            ("blk_indices", &blk_indices),
        ];
        let cx = Cx::new(py, &[&inputs[..], &[("scores", &scores)]].concat(), &[])?;
        let ns = q.dim(&cx, "q", 3, 0)?;
        q.expect_shape(&cx, "q", &[ns, g.num_qo_heads, g.head_dim])?;
        let nh = summaries.dim(&cx, "summaries", 4, 0)?;
        summaries.expect_shape(&cx, "summaries", &[nh, g.num_kv_heads, 2, g.head_dim])?;
        blk_indptr.expect_i32(py, "blk_indptr")?;
        blk_indptr.expect_shape(&cx, "blk_indptr", &[ns + 1])?;
        blk_indices.expect_i32(py, "blk_indices")?;
        let nnz = blk_indices.dim(&cx, "blk_indices", 1, 0)?;
        scores.expect_f32(py, "scores")?;
        scores.expect_shape(&cx, "scores", &[nnz, g.num_kv_heads])?;
        let dt = kv_dtype(py, &[("q", &q), ("summaries", &summaries)])?;
        check_outputs(py, &[("scores", &scores)], &inputs)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; scores is disjoint from the inputs.
                let (qs, sm, ip, ix, sc) = unsafe { (q.slice::<T>(), summaries.slice::<T>(), blk_indptr.ints(), blk_indices.ints(), scores.slice_mut::<f32>()) };
                guarded(py, "score_blocks", || kernels::score_blocks::<T>(&g, qs, sm, ip, ix, sc))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; scores is disjoint from the inputs.
                let (qs, sm, ip, ix, sc) = unsafe { (q.dev::<T>(), summaries.dev::<T>(), blk_indptr.dev::<i32>(), blk_indices.dev::<i32>(), scores.dev::<f32>()) };
                on_gpu(py, "score_blocks", dev, stream, &[], move |gpu, st| gpu.score_blocks::<T>(&g, qs, sm, ip, ix, sc, st))
            }),
        }
    })
}

/// 2-bit key codes need head_dim divisible by 4 (checked before any shape, as the CPU twin).
fn check_codes_head_dim(py: Python<'_>, g: &KvGeometry) -> PyResult<()> {
    if !g.head_dim.is_multiple_of(4) {
        return Err(py_err(
            py,
            "ConfigError",
            format!(
                "2-bit key codes need head_dim divisible by 4, got {}",
                g.head_dim
            ),
        ));
    }
    Ok(())
}

#[pyfunction]
#[pyo3(signature = (geo, host_k, summaries, block_ids, codes, *, block_rows = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Encode every key of complete host blocks to 2 bits per channel inside the block's [min, max].
///
/// host_k [num_host_rows, num_kv_heads, block_size, head_dim]; summaries [num_host_blocks,
/// num_kv_heads, 2, head_dim] (those of the same complete blocks); block_ids [n] int32; codes
/// [num_host_blocks, num_kv_heads, block_size, head_dim // 4] uint8 (channel 4i + j in bits
/// 2j..2j+2 of byte i); block_rows [n] int32 or None: the host row holding each block's keys
/// (None: the row is the block id). head_dim must be divisible by 4 (ConfigError).
///
/// CUDA: summaries, block_ids and codes on one cuda:N; host_k there too or in pinned CPU memory;
/// queued on `stream` (raw cudaStream_t of cuda:N, 0 = legacy default), returns at once.
/// Out-of-range ids are skipped on the GPU. `stream` is ignored on the CPU.
fn build_key_codes(
    py: Python<'_>,
    geo: &PyGeometry,
    host_k: TensorArg,
    summaries: TensorArg,
    block_ids: TensorArg,
    codes: TensorArg,
    block_rows: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "build_key_codes", || {
        let g = geo.inner;
        check_codes_head_dim(py, &g)?;
        let host = [("host_k", &host_k)];
        let mut tables = vec![("block_ids", &block_ids)];
        if let Some(r) = &block_rows {
            tables.push(("block_rows", r));
        }
        let cx = Cx::new(
            py,
            &[&[("summaries", &summaries), ("codes", &codes)][..], &tables].concat(),
            &host,
        )?;
        let nb = check_block_tables(py, &cx, &g, &host, &summaries, &tables)?;
        codes.expect_u8(py, "codes")?;
        codes.expect_shape(
            &cx,
            "codes",
            &[nb, g.num_kv_heads, g.block_size, g.head_dim / 4],
        )?;
        let dt = kv_dtype(py, &[("host_k", &host_k), ("summaries", &summaries)])?;
        check_outputs(
            py,
            &[("codes", &codes)],
            &[
                &[("host_k", &host_k), ("summaries", &summaries)][..],
                &tables,
            ]
            .concat(),
        )?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; codes is disjoint from the inputs.
                let (hk, sm, ids, cd) = unsafe { (host_k.slice::<T>(), summaries.slice::<T>(), block_ids.ints(), codes.slice_mut::<u8>()) };
                let rows = block_rows.as_ref().map(|r| unsafe { r.ints() });
                guarded(py, "build_key_codes", || kernels::build_key_codes::<T>(&g, hk, sm, ids, rows, cd))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; codes is disjoint from the inputs.
                let (hk, sm, ids, cd) = unsafe { (host_k.dev::<T>(), summaries.dev::<T>(), block_ids.dev::<i32>(), codes.dev::<u8>()) };
                let rows = block_rows.as_ref().map(|r| unsafe { r.dev::<i32>() });
                on_gpu(py, "build_key_codes", dev, stream, &host, move |gpu, st| gpu.build_key_codes::<T>(&g, hk, sm, ids, rows, cd, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, q, summaries, codes, blk_indptr, blk_indices, scores, *, stream = 0))]
/// Block scores from the 2-bit key codes: per entry and KV head, the sum over the GQA group of
/// the block's largest approximate logit, into scores [nnz, num_kv_heads] f32.
///
/// q [num_seqs, num_qo_heads, head_dim]; summaries [num_host_blocks, num_kv_heads, 2, head_dim];
/// codes [num_host_blocks, num_kv_heads, block_size, head_dim // 4] uint8; blk_indptr
/// [num_seqs + 1], blk_indices [nnz] int32 (host block of each logical block). head_dim must be
/// divisible by 4 (ConfigError).
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (raw cudaStream_t, 0 = legacy default),
/// returns at once. An out-of-range block id, or an entry of a malformed blk_indptr row, scores
/// -inf on the GPU (the CPU raises). `stream` is ignored on the CPU.
#[allow(clippy::too_many_arguments)]
fn score_blocks_codes(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    summaries: TensorArg,
    codes: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    scores: TensorArg,
    stream: u64,
) -> PyResult<()> {
    codes_scores(
        py,
        "score_blocks_codes",
        geo,
        q,
        summaries,
        codes,
        blk_indptr,
        blk_indices,
        None,
        scores,
        stream,
    )
}

#[pyfunction]
#[pyo3(signature = (geo, q, summaries, codes, blk_indptr, blk_indices, cand, scores, *, stream = 0))]
/// The codes score of candidate logical blocks per (seq, kv head): the second stage of
/// KvConfig(score_candidates). cand [num_seqs, num_kv_heads, m] int32 (negative: none, -inf);
/// scores [num_seqs * m, num_kv_heads] f32, a CSR of m entries per sequence for topk_blocks,
/// whose positions index cand. Other arguments as score_blocks_codes.
///
/// A candidate outside its sequence's row raises on the CPU and scores -inf on the GPU.
#[allow(clippy::too_many_arguments)]
fn rescore_blocks_codes(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    summaries: TensorArg,
    codes: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    cand: TensorArg,
    scores: TensorArg,
    stream: u64,
) -> PyResult<()> {
    codes_scores(
        py,
        "rescore_blocks_codes",
        geo,
        q,
        summaries,
        codes,
        blk_indptr,
        blk_indices,
        Some(cand),
        scores,
        stream,
    )
}

/// [`score_blocks_codes`] (every listed block) and, with `cand`, [`rescore_blocks_codes`] (the
/// candidates of each sequence and KV head): the shared checks and the dispatch to the twins.
#[allow(clippy::too_many_arguments)]
fn codes_scores(
    py: Python<'_>,
    what: &'static str,
    geo: &PyGeometry,
    q: TensorArg,
    summaries: TensorArg,
    codes: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    cand: Option<TensorArg>,
    scores: TensorArg,
    stream: u64,
) -> PyResult<()> {
    entry(py, what, || {
        let g = geo.inner;
        check_codes_head_dim(py, &g)?;
        let mut inputs = vec![
            ("q", &q),
            ("summaries", &summaries),
            ("codes", &codes),
            ("blk_indptr", &blk_indptr),
            ("blk_indices", &blk_indices),
        ];
        if let Some(c) = &cand {
            inputs.push(("cand", c));
        }
        let cx = Cx::new(py, &[&inputs[..], &[("scores", &scores)]].concat(), &[])?;
        let ns = q.dim(&cx, "q", 3, 0)?;
        q.expect_shape(&cx, "q", &[ns, g.num_qo_heads, g.head_dim])?;
        let nh = summaries.dim(&cx, "summaries", 4, 0)?;
        summaries.expect_shape(&cx, "summaries", &[nh, g.num_kv_heads, 2, g.head_dim])?;
        codes.expect_u8(py, "codes")?;
        codes.expect_shape(
            &cx,
            "codes",
            &[nh, g.num_kv_heads, g.block_size, g.head_dim / 4],
        )?;
        blk_indptr.expect_i32(py, "blk_indptr")?;
        blk_indptr.expect_shape(&cx, "blk_indptr", &[ns + 1])?;
        blk_indices.expect_i32(py, "blk_indices")?;
        let nnz = blk_indices.dim(&cx, "blk_indices", 1, 0)?;
        // Entries scored: every listed block, or m candidates per sequence.
        let (rows, m) = match &cand {
            None => (nnz, 0),
            Some(c) => {
                c.expect_i32(py, "cand")?;
                let m = c.dim(&cx, "cand", 3, 2)?;
                c.expect_shape(&cx, "cand", &[ns, g.num_kv_heads, m])?;
                (ns * m, m)
            }
        };
        scores.expect_f32(py, "scores")?;
        scores.expect_shape(&cx, "scores", &[rows, g.num_kv_heads])?;
        let dt = kv_dtype(py, &[("q", &q), ("summaries", &summaries)])?;
        check_outputs(py, &[("scores", &scores)], &inputs)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; scores is disjoint from the inputs.
                let (qs, sm, cd, ip, ix, sc) = unsafe { (q.slice::<T>(), summaries.slice::<T>(), codes.slice::<u8>(), blk_indptr.ints(), blk_indices.ints(), scores.slice_mut::<f32>()) };
                match &cand {
                    None => guarded(py, what, || kernels::score_blocks_codes::<T>(&g, qs, sm, cd, ip, ix, sc)),
                    // SAFETY: checked above (an int32 input).
                    Some(c) => {
                        let cn = unsafe { c.ints() };
                        guarded(py, what, || kernels::rescore_blocks_codes::<T>(&g, qs, sm, cd, ip, ix, cn, m, sc))
                    }
                }
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; scores is disjoint from the inputs.
                let (qs, sm, cd, ip, ix, sc) = unsafe { (q.dev::<T>(), summaries.dev::<T>(), codes.dev::<u8>(), blk_indptr.dev::<i32>(), blk_indices.dev::<i32>(), scores.dev::<f32>()) };
                // SAFETY: as above (an int32 input on the same device).
                let cn = cand.as_ref().map(|c| unsafe { c.dev::<i32>() });
                on_gpu(py, what, dev, stream, &[], move |gpu, st| match cn {
                    None => gpu.score_blocks_codes::<T>(&g, qs, sm, cd, ip, ix, sc, st),
                    Some(cn) => gpu.rescore_blocks_codes::<T>(&g, qs, sm, cd, ip, ix, cn, m, sc, st),
                })
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (num_kv_heads, scores, blk_indptr, k, out, *, index_map = None, forced = None, stream = 0))]
/// Per (seq, kv head) top-k logical blocks, best first, -1 padded: out [num_seqs, num_kv_heads, k].
///
/// scores [nnz, num_kv_heads] float32; blk_indptr [num_seqs + 1] int32. Ties go to the lower
/// logical index. index_map [num_seqs, num_kv_heads, m] int32: out holds index_map[s, h, i] for
/// each chosen position i (-1 past m and for the padding), in the same launch. forced
/// [num_seqs, num_kv_heads, F] int32: force_scores first (those entries of scores set to +inf, in
/// place), in the same launch; not with index_map.
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (raw cudaStream_t, 0 = legacy default),
/// returns at once; k is at most 512 there, and a malformed blk_indptr row gives all -1 (the CPU
/// raises). `stream` is ignored on the CPU.
#[allow(clippy::too_many_arguments)]
fn topk_blocks(
    py: Python<'_>,
    num_kv_heads: usize,
    scores: TensorArg,
    blk_indptr: TensorArg,
    k: usize,
    out: TensorArg,
    index_map: Option<TensorArg>,
    forced: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "topk_blocks", || {
        if index_map.is_some() && forced.is_some() {
            return Err(py_err(
                py,
                "InvalidArgumentError",
                "topk_blocks takes index_map or forced, not both: force the scores first \
                 (force_scores), then map"
                    .into(),
            ));
        }
        let mut inputs: Vec<(&str, &TensorArg)> = vec![("blk_indptr", &blk_indptr)];
        if let Some(m) = &index_map {
            inputs.push(("index_map", m));
        }
        if let Some(f) = &forced {
            inputs.push(("forced", f));
        }
        // With forced, scores is written too.
        let mut outputs: Vec<(&str, &TensorArg)> = vec![("out", &out)];
        if forced.is_some() {
            outputs.push(("scores", &scores));
        } else {
            inputs.push(("scores", &scores));
        }
        let cx = Cx::new(py, &[&inputs[..], &outputs[..]].concat(), &[])?;
        scores.expect_f32(py, "scores")?;
        let nnz = scores.dim(&cx, "scores", 2, 0)?;
        scores.expect_shape(&cx, "scores", &[nnz, num_kv_heads])?;
        blk_indptr.expect_i32(py, "blk_indptr")?;
        let ns = blk_indptr.dim(&cx, "blk_indptr", 1, 0)?.saturating_sub(1);
        out.expect_i32(py, "out")?;
        out.expect_shape(&cx, "out", &[ns, num_kv_heads, k])?;
        let map_m = match &index_map {
            None => 0,
            Some(m) => {
                m.expect_i32(py, "index_map")?;
                let mm = m.dim(&cx, "index_map", 3, 2)?;
                m.expect_shape(&cx, "index_map", &[ns, num_kv_heads, mm])?;
                mm
            }
        };
        let n_forced = match &forced {
            None => 0,
            Some(f) => {
                f.expect_i32(py, "forced")?;
                let nf = f.dim(&cx, "forced", 3, 2)?;
                f.expect_shape(&cx, "forced", &[ns, num_kv_heads, nf])?;
                nf
            }
        };
        check_outputs(py, &outputs, &inputs)?;
        match cx.place {
            Place::Cpu => {
                // SAFETY: checked above; out is disjoint from the inputs.
                let (ip, o) = unsafe { (blk_indptr.ints(), out.ints_mut()) };
                match (&index_map, &forced) {
                    (Some(m), _) => {
                        // SAFETY: checked above (int32 inputs).
                        let (sc, mp) = unsafe { (scores.slice::<f32>(), m.ints()) };
                        guarded(py, "topk_blocks", || {
                            kernels::topk_blocks_mapped(num_kv_heads, sc, ip, k, mp, map_m, o)
                        })
                    }
                    (None, Some(f)) => {
                        // SAFETY: checked above; scores (written) is disjoint from the inputs.
                        let (sc, fs) = unsafe { (scores.slice_mut::<f32>(), f.ints()) };
                        guarded(py, "topk_blocks", || {
                            kernels::force_scores(num_kv_heads, sc, ip, fs, n_forced)?;
                            kernels::topk_blocks(num_kv_heads, sc, ip, k, o)
                        })
                    }
                    (None, None) => {
                        // SAFETY: checked above.
                        let sc = unsafe { scores.slice::<f32>() };
                        guarded(py, "topk_blocks", || {
                            kernels::topk_blocks(num_kv_heads, sc, ip, k, o)
                        })
                    }
                }
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) checked above; out (and scores with forced) are
                // disjoint from the inputs.
                let (sc, ip, o) = unsafe {
                    (
                        scores.dev::<f32>(),
                        blk_indptr.dev::<i32>(),
                        out.dev::<i32>(),
                    )
                };
                // SAFETY: as above (int32 inputs on the same device).
                let mp = index_map.as_ref().map(|m| unsafe { m.dev::<i32>() });
                let fs = forced.as_ref().map(|f| unsafe { f.dev::<i32>() });
                on_gpu(py, "topk_blocks", dev, stream, &[], move |gpu, st| {
                    match (mp, fs) {
                        (Some(mp), _) => {
                            gpu.topk_blocks_mapped(num_kv_heads, sc, ip, k, mp, map_m, o, st)
                        }
                        (None, Some(fs)) => {
                            gpu.topk_blocks_forced(num_kv_heads, sc, ip, k, fs, n_forced, o, st)
                        }
                        (None, None) => gpu.topk_blocks(num_kv_heads, sc, ip, k, o, st),
                    }
                })
            }
        }
    })
}

#[pyfunction]
#[pyo3(signature = (num_kv_heads, scores, blk_indptr, forced, *, stream = 0))]
/// Set the forced entries of scores [nnz, num_kv_heads] float32 to +inf, in place: forced
/// [num_seqs, num_kv_heads, F] int32 holds logical blocks (positions within each row of
/// blk_indptr [num_seqs + 1] int32); -1 and positions past the row are ignored.
///
/// CUDA: every tensor on one cuda:N, queued on `stream`. `stream` is ignored on the CPU.
fn force_scores(
    py: Python<'_>,
    num_kv_heads: usize,
    scores: TensorArg,
    blk_indptr: TensorArg,
    forced: TensorArg,
    stream: u64,
) -> PyResult<()> {
    entry(py, "force_scores", || {
        let inputs: Vec<(&str, &TensorArg)> =
            vec![("blk_indptr", &blk_indptr), ("forced", &forced)];
        let cx = Cx::new(py, &[&inputs[..], &[("scores", &scores)]].concat(), &[])?;
        scores.expect_f32(py, "scores")?;
        let nnz = scores.dim(&cx, "scores", 2, 0)?;
        scores.expect_shape(&cx, "scores", &[nnz, num_kv_heads])?;
        blk_indptr.expect_i32(py, "blk_indptr")?;
        let ns = blk_indptr.dim(&cx, "blk_indptr", 1, 0)?.saturating_sub(1);
        forced.expect_i32(py, "forced")?;
        let nf = forced.dim(&cx, "forced", 3, 2)?;
        forced.expect_shape(&cx, "forced", &[ns, num_kv_heads, nf])?;
        check_outputs(py, &[("scores", &scores)], &inputs)?;
        match cx.place {
            Place::Cpu => {
                // SAFETY: checked above; scores is disjoint from the inputs.
                let (sc, ip, f) =
                    unsafe { (scores.slice_mut::<f32>(), blk_indptr.ints(), forced.ints()) };
                guarded(py, "force_scores", || {
                    kernels::force_scores(num_kv_heads, sc, ip, f, nf)
                })
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) checked above; scores is disjoint from the inputs.
                let (sc, ip, f) = unsafe {
                    (
                        scores.dev::<f32>(),
                        blk_indptr.dev::<i32>(),
                        forced.dev::<i32>(),
                    )
                };
                on_gpu(py, "force_scores", dev, stream, &[], move |gpu, st| {
                    gpu.force_scores(num_kv_heads, sc, ip, f, nf, st)
                })
            }
        }
    })
}

#[pyfunction]
#[pyo3(signature = (num_kv_heads, scores, cand, blk_indptr, k, out, *, successors = 0, forced = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// The two-stage score's last top-k: candidates cand [num_seqs, num_kv_heads, m] int32 (logical
/// blocks of the rows of blk_indptr [num_seqs + 1] int32, < 0: none) with scores
/// [num_seqs * m, num_kv_heads] float32; the next blocks of the `successors` best and the blocks
/// of forced [num_seqs, num_kv_heads, F] int32 rank first (a successor that is no candidate is
/// appended); out [num_seqs, num_kv_heads, k] int32 receives the k best as blocks, -1 padded.
///
/// CUDA: every tensor on one cuda:N, queued on `stream`; k <= 512 and m + successors <= 1024
/// there. `stream` is ignored on the CPU.
fn topk_candidates(
    py: Python<'_>,
    num_kv_heads: usize,
    scores: TensorArg,
    cand: TensorArg,
    blk_indptr: TensorArg,
    k: usize,
    out: TensorArg,
    successors: usize,
    forced: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "topk_candidates", || {
        let mut inputs: Vec<(&str, &TensorArg)> = vec![
            ("scores", &scores),
            ("cand", &cand),
            ("blk_indptr", &blk_indptr),
        ];
        if let Some(f) = &forced {
            inputs.push(("forced", f));
        }
        let cx = Cx::new(py, &[&inputs[..], &[("out", &out)]].concat(), &[])?;
        cand.expect_i32(py, "cand")?;
        let m = cand.dim(&cx, "cand", 3, 2)?;
        let ns = cand.dim(&cx, "cand", 3, 0)?;
        cand.expect_shape(&cx, "cand", &[ns, num_kv_heads, m])?;
        scores.expect_f32(py, "scores")?;
        scores.expect_shape(&cx, "scores", &[ns * m, num_kv_heads])?;
        blk_indptr.expect_i32(py, "blk_indptr")?;
        blk_indptr.expect_shape(&cx, "blk_indptr", &[ns + 1])?;
        out.expect_i32(py, "out")?;
        out.expect_shape(&cx, "out", &[ns, num_kv_heads, k])?;
        let nf = match &forced {
            None => 0,
            Some(f) => {
                f.expect_i32(py, "forced")?;
                let nf = f.dim(&cx, "forced", 3, 2)?;
                f.expect_shape(&cx, "forced", &[ns, num_kv_heads, nf])?;
                nf
            }
        };
        check_outputs(py, &[("out", &out)], &inputs)?;
        match cx.place {
            Place::Cpu => {
                // SAFETY: checked above; out is disjoint from the inputs.
                let (sc, cn, ip, o) = unsafe {
                    (
                        scores.slice::<f32>(),
                        cand.ints(),
                        blk_indptr.ints(),
                        out.ints_mut(),
                    )
                };
                // SAFETY: as above (an int32 input).
                let fs: &[i32] = forced.as_ref().map_or(&[], |f| unsafe { f.ints() });
                guarded(py, "topk_candidates", || {
                    kernels::topk_candidates(num_kv_heads, sc, cn, m, ip, k, successors, fs, nf, o)
                })
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) checked above; out is disjoint from the inputs.
                let (sc, cn, ip, o) = unsafe {
                    (
                        scores.dev::<f32>(),
                        cand.dev::<i32>(),
                        blk_indptr.dev::<i32>(),
                        out.dev::<i32>(),
                    )
                };
                // SAFETY: as above (an int32 input on the same device).
                let fs = forced.as_ref().map(|f| (unsafe { f.dev::<i32>() }, nf));
                on_gpu(py, "topk_candidates", dev, stream, &[], move |gpu, st| {
                    gpu.topk_candidates(num_kv_heads, sc, cn, m, ip, k, successors, fs, o, st)
                })
            }
        }
    })
}

#[pyfunction]
#[pyo3(signature = (num_kv_heads, predicted, slot_pages, page_map, page_last_selected, step, fetch_cap, plan_slots, plan_blocks, *, stats = None, step_now = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Delta selection with capped least-recently-selected eviction. Updates page_map and
/// page_last_selected in place and writes the plan.
///
/// predicted [num_seqs, num_kv_heads, num_pred] (num_pred <= budget), slot_pages
/// [num_seqs, budget], page_map and page_last_selected [num_pages, num_kv_heads], plan_slots and
/// plan_blocks [num_seqs, num_kv_heads, fetch_cap], all int32.
///
/// CPU: returns (pairs, kept, missing) summed over sequences and heads; `stats` must be None.
/// CUDA: every tensor on one cuda:N, queued on `stream` (raw cudaStream_t, 0 = legacy default),
/// returns None at once; pass `stats`, an int32 tensor [num_seqs, num_kv_heads, 3] on cuda:N, to
/// receive (pairs, kept, missing) per (seq, head). On the GPU, budget is at most 4096, and
/// slot_pages is not validated: an out-of-range page is skipped, a page listed twice is undefined.
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
    stats: Option<TensorArg>,
    step_now: Option<TensorArg>,
    stream: u64,
) -> PyResult<Option<(usize, usize, usize)>> {
    entry(py, "delta_select", || {
        let mut all = vec![
            ("predicted", &predicted),
            ("slot_pages", &slot_pages),
            ("page_map", &page_map),
            ("page_last_selected", &page_last_selected),
            ("plan_slots", &plan_slots),
            ("plan_blocks", &plan_blocks),
        ];
        if let Some(st) = &stats {
            all.push(("stats", st));
        }
        if let Some(sn) = &step_now {
            all.push(("step_now", sn));
        }
        let cx = Cx::new(py, &all, &[])?;
        if let Some(sn) = &step_now {
            sn.expect_shape(&cx, "step_now", &[1])?;
        }
        let ns = predicted.dim(&cx, "predicted", 3, 0)?;
        let np = predicted.dim(&cx, "predicted", 3, 2)?;
        predicted.expect_shape(&cx, "predicted", &[ns, num_kv_heads, np])?;
        let budget = slot_pages.dim(&cx, "slot_pages", 2, 1)?;
        slot_pages.expect_shape(&cx, "slot_pages", &[ns, budget])?;
        let npages = page_map.dim(&cx, "page_map", 2, 0)?;
        page_map.expect_shape(&cx, "page_map", &[npages, num_kv_heads])?;
        page_last_selected.expect_shape(&cx, "page_last_selected", &[npages, num_kv_heads])?;
        plan_slots.expect_shape(&cx, "plan_slots", &[ns, num_kv_heads, fetch_cap])?;
        plan_blocks.expect_shape(&cx, "plan_blocks", &[ns, num_kv_heads, fetch_cap])?;
        if let Some(st) = &stats {
            st.expect_shape(&cx, "stats", &[ns, num_kv_heads, 3])?;
        }
        for (name, t) in &all {
            t.expect_i32(py, name)?;
        }
        check_disjoint(py, &all)?;
        match cx.place {
            Place::Cpu => {
                if stats.is_some() {
                    return Err(py_err(
                        py,
                        "InvalidArgumentError",
                        "stats is filled by the GPU kernel only; on the CPU delta_select returns the totals (pairs, kept, missing): pass stats=None".into(),
                    ));
                }
                if step_now.is_some() {
                    return Err(py_err(
                        py,
                        "InvalidArgumentError",
                        "step_now is read by the GPU kernel only; on the CPU pass the step as `step` and step_now=None".into(),
                    ));
                }
                // SAFETY: all i32 on the CPU with the checked shapes; the four mutable ones are disjoint.
                let (pr, sp, pm, pls, ps, pb) = unsafe {
                    (
                        predicted.ints(),
                        slot_pages.ints(),
                        page_map.ints_mut(),
                        page_last_selected.ints_mut(),
                        plan_slots.ints_mut(),
                        plan_blocks.ints_mut(),
                    )
                };
                let st = guarded(py, "delta_select", || {
                    kernels::delta_select(
                        num_kv_heads,
                        pr,
                        np,
                        sp,
                        budget,
                        pm,
                        pls,
                        step,
                        fetch_cap,
                        ps,
                        pb,
                    )
                })?;
                Ok(Some((st.pairs, st.kept, st.missing)))
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) all int32 on cuda:dev with the checked shapes, pairwise disjoint.
                let (pr, sp, pm, pls, ps, pb) = unsafe {
                    (
                        predicted.dev::<i32>(),
                        slot_pages.dev::<i32>(),
                        page_map.dev::<i32>(),
                        page_last_selected.dev::<i32>(),
                        plan_slots.dev::<i32>(),
                        plan_blocks.dev::<i32>(),
                    )
                };
                let sd = stats.as_ref().map(|s| unsafe { s.dev::<i32>() });
                // SAFETY: as above (int32 [1] on cuda:dev, checked; only read).
                let sn = step_now.as_ref().map(|s| unsafe { s.dev::<i32>() });
                on_gpu(py, "delta_select", dev, stream, &[], move |gpu, st| {
                    gpu.delta_select(
                        num_kv_heads,
                        pr,
                        np,
                        sp,
                        budget,
                        pm,
                        pls,
                        step,
                        sn,
                        fetch_cap,
                        ps,
                        pb,
                        sd,
                        st,
                    )
                })?;
                Ok(None)
            }
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, host_k, host_v, k_pages, v_pages, *, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Execute a selection plan: copy planned block-head entries from the host pool into GPU slots.
///
/// plan_slots, plan_blocks [num_seqs, num_kv_heads, fetch_cap], slot_pages [num_seqs, budget],
/// host_indptr [num_seqs + 1], host_indices [nnz] int32; host_k, host_v [num_host_blocks,
/// num_kv_heads, block_size, head_dim]; k_pages, v_pages [num_pages, num_kv_heads, block_size,
/// head_dim]. Bit-exact.
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
    stream: u64,
) -> PyResult<Option<usize>> {
    entry(py, "gather_blocks", || {
        let g = geo.inner;
        let tables = [
            ("plan_slots", &plan_slots),
            ("plan_blocks", &plan_blocks),
            ("slot_pages", &slot_pages),
            ("host_indptr", &host_indptr),
            ("host_indices", &host_indices),
        ];
        let pools = [
            ("host_k", &host_k),
            ("host_v", &host_v),
            ("k_pages", &k_pages),
            ("v_pages", &v_pages),
        ];
        let (host, pages) = pools.split_at(2);
        let cx = Cx::new(py, &[&tables[..], pages].concat(), host)?;
        let ns = plan_slots.dim(&cx, "plan_slots", 3, 0)?;
        let cap = plan_slots.dim(&cx, "plan_slots", 3, 2)?;
        for (name, t) in tables {
            t.expect_i32(py, name)?;
        }
        plan_slots.expect_shape(&cx, "plan_slots", &[ns, g.num_kv_heads, cap])?;
        plan_blocks.expect_shape(&cx, "plan_blocks", &[ns, g.num_kv_heads, cap])?;
        let budget = slot_pages.dim(&cx, "slot_pages", 2, 1)?;
        slot_pages.expect_shape(&cx, "slot_pages", &[ns, budget])?;
        host_indptr.expect_shape(&cx, "host_indptr", &[ns + 1])?;
        host_indices.dim(&cx, "host_indices", 1, 0)?;
        pool_rows(&cx.host(), &g, host)?;
        pool_rows(&cx, &g, pages)?;
        let dt = kv_dtype(py, &pools)?;
        check_disjoint(py, &pools)?;
        check_outputs(py, pages, &tables)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; the page pools are disjoint from each other and from every input.
                let (ps, pb, sp, hi, hx) = unsafe { (plan_slots.ints(), plan_blocks.ints(), slot_pages.ints(), host_indptr.ints(), host_indices.ints()) };
                let (hk, hv, kp, vp) = unsafe { (host_k.slice::<T>(), host_v.slice::<T>(), k_pages.slice_mut::<T>(), v_pages.slice_mut::<T>()) };
                guarded(py, "gather_blocks", || kernels::gather_blocks::<T>(&g, ps, pb, cap, sp, budget, hi, hx, hk, hv, kp, vp)).map(Some)
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above (the host pool pinned; mapped checked in
                // on_gpu); the page pools are disjoint from each other and from every input.
                let (ps, pb, sp, hi, hx) = unsafe { (plan_slots.dev::<i32>(), plan_blocks.dev::<i32>(), slot_pages.dev::<i32>(), host_indptr.dev::<i32>(), host_indices.dev::<i32>()) };
                let (hk, hv, kp, vp) = unsafe { (host_k.dev::<T>(), host_v.dev::<T>(), k_pages.dev::<T>(), v_pages.dev::<T>()) };
                // A pool in device memory (the all-resident oracle) takes the launch HBM reads need.
                let device_source = !host_k.is_host_mapped();
                on_gpu(py, "gather_blocks", dev, stream, host, move |gpu, st| gpu.gather_blocks::<T>(&g, ps, pb, cap, sp, budget, hi, hx, hk, hv, kp, vp, device_source, st))?;
                Ok(None)
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, src_k, src_v, src_ids, dst_k, dst_v, dst_ids, *, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Whole-page copy between two pools of the same page geometry: src_ids[i] -> dst_ids[i], all heads.
///
/// src_k, src_v [num_src_pages, num_kv_heads, block_size, head_dim]; dst_k, dst_v [num_dst_pages,
/// ...]; src_ids, dst_ids [n] int32. Bit-exact.
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
    stream: u64,
) -> PyResult<()> {
    entry(py, "copy_pages", || {
        let g = geo.inner;
        let pools = [
            ("src_k", &src_k),
            ("src_v", &src_v),
            ("dst_k", &dst_k),
            ("dst_v", &dst_v),
        ];
        let ids = [("src_ids", &src_ids), ("dst_ids", &dst_ids)];
        let cx = Cx::new(py, &ids, &pools)?;
        let (src, dst) = pools.split_at(2);
        pool_rows(&cx.host(), &g, src)?;
        pool_rows(&cx.host(), &g, dst)?;
        src_ids.expect_i32(py, "src_ids")?;
        dst_ids.expect_i32(py, "dst_ids")?;
        let n = src_ids.dim(&cx, "src_ids", 1, 0)?;
        dst_ids.expect_shape(&cx, "dst_ids", &[n])?;
        let dt = kv_dtype(py, &pools)?;
        check_disjoint(py, &pools)?;
        check_outputs(py, dst, &ids)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; destination pools are disjoint from the sources and the ids.
                let (sk, sv, si, dk, dv, di) = unsafe { (src_k.slice::<T>(), src_v.slice::<T>(), src_ids.ints(), dst_k.slice_mut::<T>(), dst_v.slice_mut::<T>(), dst_ids.ints()) };
                guarded(py, "copy_pages", || kernels::copy_pages::<T>(&g, sk, sv, si, dk, dv, di))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above (pinned pools: mapped checked in on_gpu);
                // destination pools are disjoint from the sources and the ids.
                let (sk, sv, si, dk, dv, di) = unsafe { (src_k.dev::<T>(), src_v.dev::<T>(), src_ids.dev::<i32>(), dst_k.dev::<T>(), dst_v.dev::<T>(), dst_ids.dev::<i32>()) };
                on_gpu(py, "copy_pages", dev, stream, &pools, move |gpu, st| gpu.copy_pages::<T>(&g, sk, sv, si, dk, dv, di, st))
            }),
        }
    })
}

/// Every output's bytes are disjoint from every other argument's (outputs and inputs), given as
/// byte ranges (row-strided inputs take their span, not their element count).
fn check_outputs_bytes(
    py: Python<'_>,
    outputs: &[(&str, (usize, usize))],
    inputs: &[(&str, (usize, usize))],
) -> PyResult<()> {
    check_disjoint_bytes(py, outputs)?;
    for o in outputs {
        for i in inputs {
            check_disjoint_bytes(py, &[*o, *i])?;
        }
    }
    Ok(())
}

/// The rows of `t` (`name`), which must be `cols` wide: a [`RowsView`], possibly strided.
fn rows_of(cx: &Cx<'_>, t: &TensorArg, name: &str, cols: usize, what: &str) -> PyResult<RowsView> {
    let v = t.strided_rows(cx, name)?;
    if v.cols != cols {
        return Err(py_err(
            cx.py,
            "ShapeError",
            format!(
                "{name} must have shape [n, {cols}] ({what}), got {:?}",
                t.shape
            ),
        ));
    }
    Ok(v)
}

#[pyfunction]
#[pyo3(signature = (x, weight, eps, out, residual = None, residual_out = None, *, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Hugging Face RMSNorm of rows, with an optional fused residual add.
///
/// x [n, hidden] (rows may be strided: each row contiguous, rows at least hidden apart); weight
/// [hidden]; out [n, hidden] contiguous; all in one dtype (float32, float16 or bfloat16). Computes
/// xf = float32(x); r = 1 / sqrt(sum(xf * xf) / hidden + eps); out = dtype(float32(weight) *
/// float32(dtype(xf * r))), each operation rounded as torch rounds it (the sum of squares in the
/// kernels' fixed order, identical on the CPU and the GPU).
///
/// With residual and residual_out (both [n, hidden] contiguous, pass both or neither): h =
/// dtype(float32(x) + float32(residual)) (torch's `residual + x`) is written to residual_out and
/// normalised instead of x. Aliasing: residual_out may be residual itself (the same tensor: an
/// in-place update) but may not overlap it otherwise; out and residual_out may not overlap any
/// other argument.
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (the raw cudaStream_t of a live stream of
/// cuda:N; 0 = the legacy default stream), returns at once. `stream` is ignored on the CPU.
fn rms_norm(
    py: Python<'_>,
    x: TensorArg,
    weight: TensorArg,
    eps: f32,
    out: TensorArg,
    residual: Option<TensorArg>,
    residual_out: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "rms_norm", || {
        let mut all = vec![("x", &x), ("weight", &weight), ("out", &out)];
        let res = match (&residual, &residual_out) {
            (Some(r), Some(ro)) => {
                all.push(("residual", r));
                all.push(("residual_out", ro));
                Some((r, ro))
            }
            (None, None) => None,
            _ => {
                return Err(py_err(
                    py,
                    "InvalidArgumentError",
                    "pass residual and residual_out together (residual_out=residual updates it in place), or neither"
                        .into(),
                ))
            }
        };
        let cx = Cx::new(py, &all, &[])?;
        let hidden = weight.dim(&cx, "weight", 1, 0)?;
        let xv = rows_of(&cx, &x, "x", hidden, "hidden = len(weight)")?;
        let n = xv.rows;
        out.expect_shape(&cx, "out", &[n, hidden])?;
        let named: Vec<_> = all.iter().copied().filter(|(nm, _)| *nm != "x").collect();
        let dt = kv_dtype(py, &[&[("x", &x)][..], &named].concat())?;
        let x_bytes = ("x", x.span_bytes(xv.span()));
        let w_bytes = ("weight", weight.byte_range());
        let out_bytes = ("out", out.byte_range());
        let in_place = match res {
            Some((r, ro)) => {
                r.expect_shape(&cx, "residual", &[n, hidden])?;
                ro.expect_shape(&cx, "residual_out", &[n, hidden])?;
                let in_place = r.ptr == ro.ptr;
                let (rb, rob) = (
                    ("residual", r.byte_range()),
                    ("residual_out", ro.byte_range()),
                );
                if in_place {
                    check_outputs_bytes(py, &[out_bytes, rob], &[x_bytes, w_bytes])?;
                } else {
                    check_outputs_bytes(py, &[out_bytes, rob], &[x_bytes, w_bytes, rb])?;
                }
                in_place
            }
            None => {
                check_outputs_bytes(py, &[out_bytes], &[x_bytes, w_bytes])?;
                false
            }
        };
        let span = xv.span();
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: shapes, dtypes and CPU residence checked above; x's span lies in its
                // storage (strided_rows); out and residual_out are disjoint from every other
                // argument, except residual_out == residual, passed as one mutable slice.
                let (xs, w, o) = unsafe { (x.span_slice::<T>(span), weight.slice::<T>(), out.slice_mut::<T>()) };
                let residual = res.map(|(r, ro)| {
                    if in_place {
                        Residual::InPlace(unsafe { ro.slice_mut::<T>() })
                    } else {
                        Residual::Separate { residual: unsafe { r.slice::<T>() }, residual_out: unsafe { ro.slice_mut::<T>() } }
                    }
                });
                guarded(py, "rms_norm", || kernels::rms_norm::<T>(xs, xv.stride, w, eps, residual, o))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev / span_dev) checked above on cuda:dev; outputs disjoint
                // from every other argument but residual_out == residual, which the kernel allows.
                let (xs, w, o) = unsafe { (x.span_dev::<T>(span), weight.dev::<T>(), out.dev::<T>()) };
                let residual = res.map(|(r, ro)| ResidualDev { residual: unsafe { r.dev::<T>() }, residual_out: unsafe { ro.dev::<T>() } });
                on_gpu(py, "rms_norm", dev, stream, &[], move |gpu, st| gpu.rms_norm::<T>(xs, xv.stride, w, eps, residual, o, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (qkv, q_size, kv_size, num_heads, num_kv_heads, head_dim, positions, inv_freq, q_norm, k_norm, eps, q_out, k_out, v_out, *, kv_groups = 1, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// The attention prologue of a decoder layer from its fused QKV projection: per-head q/k RMSNorm
/// (Qwen3; skipped when q_norm and k_norm are None), rotate-half RoPE, and the V copy.
///
/// qkv [n, q_size + 2 * kv_size] (rows may be strided: each row contiguous) holds the query heads,
/// then the key heads, then the value heads of each token (q_size = num_heads * head_dim, kv_size =
/// num_kv_heads * head_dim, head_dim even); positions [n] int64 or int32 (read by the kernel);
/// inv_freq [head_dim / 2] float32; q_norm, k_norm [head_dim] or None (both or neither); outputs
/// q_out [n, num_heads, head_dim], k_out and v_out [n, num_kv_heads, head_dim], contiguous and
/// disjoint from every other argument. qkv, the norms and the outputs share one dtype.
///
/// Numerics are transformers' (rms_norm, then rope_cos_sin and apply_rope of
/// oasiskv.models.transformer): cos and sin of float32(pos) * inv_freq rounded to float32 then to
/// the dtype, and out = dtype(dtype(x * cos) + dtype(rotate_half(x) * sin)). The CPU and the GPU
/// compute the same bits.
///
/// kv_groups = G > 1 (dividing n): the rows are n / G groups of G (row t = s * G + r), and row t's
/// key and value heads go to row r * (n / G) + s of k_out and v_out; q_out keeps row t.
///
/// CUDA: every tensor on one cuda:N, queued on `stream`, returns at once; `stream` is ignored on
/// the CPU.
fn qk_norm_rope(
    py: Python<'_>,
    qkv: TensorArg,
    q_size: usize,
    kv_size: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    positions: TensorArg,
    inv_freq: TensorArg,
    q_norm: Option<TensorArg>,
    k_norm: Option<TensorArg>,
    eps: f32,
    q_out: TensorArg,
    k_out: TensorArg,
    v_out: TensorArg,
    kv_groups: usize,
    stream: u64,
) -> PyResult<()> {
    entry(py, "qk_norm_rope", || {
        let layout = HeadLayout {
            num_heads,
            num_kv_heads,
            head_dim,
        };
        layout.validate().map_err(|e| core_err(py, e))?;
        if q_size != layout.q_size() || kv_size != layout.kv_size() {
            return Err(py_err(
                py,
                "InvalidArgumentError",
                format!(
                    "q_size = {q_size} and kv_size = {kv_size} must be num_heads * head_dim = {} and \
                     num_kv_heads * head_dim = {}; pass the sizes of the model's QKV projection",
                    layout.q_size(),
                    layout.kv_size()
                ),
            ));
        }
        let mut all = vec![
            ("qkv", &qkv),
            ("positions", &positions),
            ("inv_freq", &inv_freq),
            ("q_out", &q_out),
            ("k_out", &k_out),
            ("v_out", &v_out),
        ];
        let norm = match (&q_norm, &k_norm) {
            (Some(qn), Some(kn)) => {
                all.push(("q_norm", qn));
                all.push(("k_norm", kn));
                Some((qn, kn))
            }
            (None, None) => None,
            _ => {
                return Err(py_err(
                    py,
                    "InvalidArgumentError",
                    "pass q_norm and k_norm together (Qwen3), or neither (Llama)".into(),
                ))
            }
        };
        let cx = Cx::new(py, &all, &[])?;
        let qv = rows_of(&cx, &qkv, "qkv", layout.width(), "q_size + 2 * kv_size")?;
        let n = qv.rows;
        let pos64 = match positions.dtype.as_str() {
            "int64" => true,
            "int32" => false,
            other => {
                return Err(py_err(
                    py,
                    "DTypeError",
                    format!("positions must be int64 or int32, got {other}; pass positions.long()"),
                ))
            }
        };
        positions.expect_shape(&cx, "positions", &[n])?;
        inv_freq.expect_f32(py, "inv_freq")?;
        inv_freq.expect_shape(&cx, "inv_freq", &[head_dim / 2])?;
        q_out.expect_shape(&cx, "q_out", &[n, num_heads, head_dim])?;
        k_out.expect_shape(&cx, "k_out", &[n, num_kv_heads, head_dim])?;
        v_out.expect_shape(&cx, "v_out", &[n, num_kv_heads, head_dim])?;
        let mut typed = vec![
            ("qkv", &qkv),
            ("q_out", &q_out),
            ("k_out", &k_out),
            ("v_out", &v_out),
        ];
        let mut inputs = vec![
            ("qkv", qkv.span_bytes(qv.span())),
            ("positions", positions.byte_range()),
            ("inv_freq", inv_freq.byte_range()),
        ];
        if let Some((qn, kn)) = norm {
            qn.expect_shape(&cx, "q_norm", &[head_dim])?;
            kn.expect_shape(&cx, "k_norm", &[head_dim])?;
            typed.push(("q_norm", qn));
            typed.push(("k_norm", kn));
            inputs.push(("q_norm", qn.byte_range()));
            inputs.push(("k_norm", kn.byte_range()));
        }
        let dt = kv_dtype(py, &typed)?;
        check_outputs_bytes(
            py,
            &[
                ("q_out", q_out.byte_range()),
                ("k_out", k_out.byte_range()),
                ("v_out", v_out.byte_range()),
            ],
            &inputs,
        )?;
        let span = qv.span();
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: shapes, dtypes and CPU residence checked above; qkv's span lies in its
                // storage (strided_rows); the outputs are disjoint from each other and the inputs.
                let (x, inv, qo, ko, vo) = unsafe { (qkv.span_slice::<T>(span), inv_freq.slice::<f32>(), q_out.slice_mut::<T>(), k_out.slice_mut::<T>(), v_out.slice_mut::<T>()) };
                let pos = if pos64 { Positions::I64(unsafe { positions.slice::<i64>() }) } else { Positions::I32(unsafe { positions.ints() }) };
                let weights = norm.map(|(qn, kn)| unsafe { (qn.slice::<T>(), kn.slice::<T>()) });
                guarded(py, "qk_norm_rope", || {
                    let qk = weights.map(|(q_weight, k_weight)| QkNorm { q_weight, k_weight, eps });
                    kernels::qk_norm_rope::<T>(&layout, x, qv.stride, pos, inv, qk.as_ref(), qo, ko, vo, kv_groups)
                })
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev / span_dev) checked above on cuda:dev; outputs disjoint
                // from every other argument.
                let (x, inv, qo, ko, vo) = unsafe { (qkv.span_dev::<T>(span), inv_freq.dev::<f32>(), q_out.dev::<T>(), k_out.dev::<T>(), v_out.dev::<T>()) };
                let pos = if pos64 { PositionsDev::I64(unsafe { positions.dev::<i64>() }) } else { PositionsDev::I32(unsafe { positions.dev::<i32>() }) };
                let weights = norm.map(|(qn, kn)| unsafe { (qn.dev::<T>(), kn.dev::<T>()) });
                on_gpu(py, "qk_norm_rope", dev, stream, &[], move |gpu, st| gpu.qk_norm_rope::<T>(&layout, x, qv.stride, pos, inv, weights, eps, qo, ko, vo, kv_groups, st))
            }),
        }
    })
}

#[pyfunction]
/// f32 elements of the split-KV workspace of decode_attention: partial outputs and log-sum-exps
/// of every (seq, row, query head, split).
fn decode_attn_workspace_len(
    py: Python<'_>,
    num_seqs: usize,
    num_rows: usize,
    num_qo_heads: usize,
    head_dim: usize,
    num_splits: usize,
) -> PyResult<usize> {
    // The product of oasis_cuda's formula, checked: sizes come from Python and must not wrap.
    let fits = head_dim
        .checked_add(1)
        .and_then(|d1| {
            [num_seqs, num_rows, num_qo_heads, num_splits]
                .iter()
                .try_fold(d1, |acc, &x| acc.checked_mul(x))
        })
        .is_some();
    if !fits {
        return Err(py_err(
            py,
            "InvalidArgumentError",
            "the split-kv workspace size overflows; make the call smaller".into(),
        ));
    }
    Ok(ws_len(
        num_seqs,
        num_rows,
        num_qo_heads,
        head_dim,
        num_splits,
    ))
}

#[pyfunction]
/// The split count decode_attention plans on a GPU with `num_sms` SMs for a batch whose longest
/// sequence has `max_pages` pages (1 = no split, no workspace).
fn plan_num_splits(
    py: Python<'_>,
    num_sms: usize,
    num_seqs: usize,
    num_kv_heads: usize,
    max_pages: usize,
) -> PyResult<usize> {
    // Total (saturating) for any sizes: no error case.
    entry(py, "plan_num_splits", || {
        Ok(plan_splits(num_sms, num_seqs, num_kv_heads, max_pages))
    })
}

/// Why the CUDA path cannot run here, or `None`.
fn cuda_unavailable_reason() -> Option<String> {
    let mut reasons = Vec::new();
    if let Err(e) = oasis_cuda::nvrtc_info() {
        reasons.push(e.to_string());
    }
    let gpu = match Gpu::attach(None) {
        Err(CudaError::NoContext) => Gpu::attach(Some(0)),
        r => r,
    };
    if let Err(e) = gpu {
        reasons.push(e.to_string());
    }
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

#[pyfunction]
/// None when the CUDA path can run here (driver, a GPU of sm_80 or newer that takes a context,
/// NVRTC), else the reason and what to install or set. Never raises. Without a current context
/// it attaches to device 0's primary context (as torch.cuda.init() would).
fn cuda_status(py: Python<'_>) -> Option<String> {
    py.detach(|| {
        catch_unwind(cuda_unavailable_reason)
            .unwrap_or_else(|_| Some("internal error while probing cuda".to_string()))
    })
}

#[pyfunction]
#[pyo3(signature = (arch = "sm_90"))]
/// Compile every kernel source with NVRTC for `arch` (sm_XY or compute_XY, sm_80 or newer),
/// through the on-disk cache; returns (source name, image bytes) per source. Needs libnvrtc
/// only, no GPU. Raises CudaUnavailableError without NVRTC, OasisError with the log when a
/// source does not compile.
fn compile_kernels(py: Python<'_>, arch: &str) -> PyResult<Vec<(String, usize)>> {
    let arch = arch.to_string();
    detached(py, "compile_kernels", move || {
        oasis_cuda::compile_all(&arch)
    })
}

#[pyfunction]
/// (major, minor) of the NVRTC in use. Raises CudaUnavailableError when libnvrtc is not found.
fn nvrtc_version(py: Python<'_>) -> PyResult<(i32, i32)> {
    detached(py, "nvrtc_version", || {
        oasis_cuda::nvrtc_info().map(|i| i.version)
    })
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyGeometry>()?;
    m.add_class::<PyBlockPool>()?;
    m.add_class::<runtime::PyRuntime>()?;
    m.add_class::<rt::PyRtClient>()?;
    m.add_function(wrap_pyfunction!(rt::ucx_version, m)?)?;
    m.add_function(wrap_pyfunction!(append_kv, m)?)?;
    m.add_function(wrap_pyfunction!(decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(build_summaries, m)?)?;
    m.add_function(wrap_pyfunction!(score_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(build_key_codes, m)?)?;
    m.add_function(wrap_pyfunction!(score_blocks_codes, m)?)?;
    m.add_function(wrap_pyfunction!(rescore_blocks_codes, m)?)?;
    m.add_function(wrap_pyfunction!(topk_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(force_scores, m)?)?;
    m.add_function(wrap_pyfunction!(topk_candidates, m)?)?;
    m.add_function(wrap_pyfunction!(delta_select, m)?)?;
    m.add_function(wrap_pyfunction!(gather_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(set_gather_launch, m)?)?;
    m.add_function(wrap_pyfunction!(wait_stamp, m)?)?;
    m.add_function(wrap_pyfunction!(gather_launch, m)?)?;
    m.add_function(wrap_pyfunction!(copy_pages, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(qk_norm_rope, m)?)?;
    m.add_function(wrap_pyfunction!(decode_attn_workspace_len, m)?)?;
    m.add_function(wrap_pyfunction!(plan_num_splits, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(compile_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_version, m)?)?;
    Ok(())
}
