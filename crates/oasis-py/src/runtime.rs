//! `oasiskv._core.Runtime`: the engine state of `oasis-runtime` (pools, block tables, admission,
//! the per-step plan) as one small class. Python keeps the tensors; this keeps the ids.

use oasis_core::{BlockPool as CorePool, KvGeometry, OasisError, Tier};
use oasis_runtime::{PlanField, PlanPad, Reservation, Runtime, RuntimeConfig, SparseTransition};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::call::{entry, guarded};
use crate::errors::{core_err, py_err};
use crate::tensor::TensorArg;

/// Run `f` under the module's `entry` guard (a panic becomes an `OasisError`), turning a core
/// error into its Python class.
fn call<R>(py: Python<'_>, what: &str, f: impl FnOnce() -> Result<R, OasisError>) -> PyResult<R> {
    crate::call::entry(py, what, || f().map_err(|e| core_err(py, e)))
}

/// `cache_blocks`' answer: `(rows, given, evicted)`.
type CachedRows = (Vec<u32>, Vec<usize>, Vec<(usize, u32)>);

/// Pools, block tables, admission and the step plan of one engine.
#[pyclass(name = "Runtime", module = "oasiskv._core")]
pub struct PyRuntime {
    inner: Runtime,
}

fn transition_dict(py: Python<'_>, tr: SparseTransition) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("src_pages", tr.src_pages)?;
    d.set_item("host_blocks", tr.host_blocks)?;
    d.set_item("host_rows", tr.host_rows)?;
    d.set_item("lens", tr.lens)?;
    d.set_item("slot_pages", tr.slot_pages)?;
    d.set_item("local_page", tr.local_page)?;
    d.set_item("n_complete", tr.n_complete)?;
    Ok(d)
}

impl PyRuntime {
    fn res(
        &self,
        prompt_len: usize,
        max_new_tokens: usize,
        sparse: bool,
        cache_blocks: Option<usize>,
    ) -> Reservation {
        if sparse {
            self.inner
                .sparse_reservation(prompt_len, max_new_tokens, cache_blocks)
        } else {
            self.inner.reservation(prompt_len, max_new_tokens)
        }
    }
}

#[pymethods]
impl PyRuntime {
    #[new]
    #[pyo3(signature = (*, block_size, top_k_blocks, sparse_threshold, sparse, rows, measure_recall,
        plan_blk_seq, max_num_seqs, gpu_pages, host_blocks, gpu_cap, host_cap))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        block_size: usize,
        top_k_blocks: usize,
        sparse_threshold: usize,
        sparse: bool,
        rows: usize,
        measure_recall: bool,
        plan_blk_seq: bool,
        max_num_seqs: usize,
        gpu_pages: usize,
        host_blocks: usize,
        gpu_cap: usize,
        host_cap: usize,
    ) -> PyResult<Self> {
        let cfg = RuntimeConfig {
            block_size,
            top_k_blocks,
            sparse_threshold,
            sparse,
            rows,
            measure_recall,
            plan_blk_seq,
            max_num_seqs,
        };
        call(py, "Runtime.__init__", || {
            Runtime::new(cfg, gpu_pages, host_blocks, gpu_cap, host_cap).map(|inner| Self { inner })
        })
    }

    /// `(gpu_pages, host_rows, turns_sparse)`: the peak a request of this size reserves in the
    /// two budgets (`sparse=True`: admitted with `admit_sparse`, `cache_blocks` as there). Host
    /// rows are the host budget's unit; a local request takes one with every host block id.
    #[pyo3(signature = (prompt_len, max_new_tokens, *, sparse = false, cache_blocks = None))]
    fn reservation(
        &self,
        prompt_len: usize,
        max_new_tokens: usize,
        sparse: bool,
        cache_blocks: Option<usize>,
    ) -> (usize, usize, bool) {
        let r = self.res(prompt_len, max_new_tokens, sparse, cache_blocks);
        (r.gpu_pages, r.host_rows, r.turns_sparse)
    }

    /// Whether such a request fits the caps at all (alone).
    #[pyo3(signature = (prompt_len, max_new_tokens, *, sparse = false, cache_blocks = None))]
    fn fits_ever(
        &self,
        prompt_len: usize,
        max_new_tokens: usize,
        sparse: bool,
        cache_blocks: Option<usize>,
    ) -> bool {
        self.inner
            .fits_ever(&self.res(prompt_len, max_new_tokens, sparse, cache_blocks))
    }

    /// Whether such a request can be admitted now (a free seat and room beside the others).
    #[pyo3(signature = (prompt_len, max_new_tokens, *, sparse = false, cache_blocks = None))]
    fn can_admit(
        &self,
        prompt_len: usize,
        max_new_tokens: usize,
        sparse: bool,
        cache_blocks: Option<usize>,
    ) -> bool {
        self.inner
            .can_admit(&self.res(prompt_len, max_new_tokens, sparse, cache_blocks))
    }

    /// `(gpu_pages, host_blocks, host_rows)` the pools must hold to admit such a request now.
    #[pyo3(signature = (prompt_len, max_new_tokens, *, sparse = false, cache_blocks = None))]
    fn pool_sizes_needed(
        &self,
        prompt_len: usize,
        max_new_tokens: usize,
        sparse: bool,
        cache_blocks: Option<usize>,
    ) -> (usize, usize, usize) {
        self.inner
            .pool_sizes_needed(&self.res(prompt_len, max_new_tokens, sparse, cache_blocks))
    }

    /// Grow the pools' id ranges (after the engine grew its tensors): GPU pages, host block ids
    /// (summaries, codes), host rows (`host_k`/`host_v`).
    fn grow(
        &mut self,
        py: Python<'_>,
        gpu_pages: usize,
        host_blocks: usize,
        host_rows: usize,
    ) -> PyResult<()> {
        call(py, "Runtime.grow", || {
            self.inner.grow(gpu_pages, host_blocks, host_rows)
        })
    }

    /// Admit a request about to be prefilled: `(slot, pages)`.
    fn admit(
        &mut self,
        py: Python<'_>,
        id: u64,
        prompt_len: usize,
        max_new_tokens: usize,
    ) -> PyResult<(u32, Vec<u32>)> {
        call(py, "Runtime.admit", || {
            self.inner.admit(id, prompt_len, max_new_tokens)
        })
    }

    /// Admit a request whose prompt's KV is already stored elsewhere (staged by a prefill
    /// worker) directly sparse: only the working set (K slot pages, the local page) and the
    /// prompt's host blocks, never its dense pages. A dict of `slot` and, as `make_sparse`'s,
    /// `src_pages` (empty: nothing to copy), `host_blocks`, `host_rows`, `lens`, `slot_pages`,
    /// `local_page`, `n_complete`.
    ///
    /// `cache_blocks=C` bounds its host rows: rows of its own only for the blocks it writes
    /// (from `prompt_len // block_size` on) plus `C` cache rows that `cache_blocks(id, ...)`
    /// hands to the staged blocks a gather needs (`host_rows` holds a filler for the others).
    #[pyo3(signature = (id, prompt_len, max_new_tokens, cache_blocks = None))]
    fn admit_sparse<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        prompt_len: usize,
        max_new_tokens: usize,
        cache_blocks: Option<usize>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let (slot, tr) = call(py, "Runtime.admit_sparse", || {
            self.inner
                .admit_sparse(id, prompt_len, max_new_tokens, cache_blocks)
        })?;
        let d = transition_dict(py, tr)?;
        d.set_item("slot", slot)?;
        Ok(d)
    }

    /// Give host rows to the request's logical blocks `logicals` before a gather reads them
    /// (a bounded staged request's cache; the blocks it writes and every block of any other
    /// request have theirs already): `(rows, given, evicted)`, `rows` in the order asked,
    /// `given` the logical blocks whose rows the caller must fill, `evicted` `(logical, row)`
    /// pairs whose bytes are gone. The least recently used cached blocks outside `pinned` and
    /// `logicals` are evicted; `OutOfBlocksError` (nothing changed) when every row is pinned.
    fn cache_blocks(
        &mut self,
        py: Python<'_>,
        id: u64,
        logicals: Vec<usize>,
        pinned: Vec<usize>,
    ) -> PyResult<CachedRows> {
        let c = call(py, "Runtime.cache_blocks", || {
            self.inner.cache_blocks(id, &logicals, &pinned)
        })?;
        Ok((c.rows, c.given, c.evicted))
    }

    fn wants_sparse(&self, py: Python<'_>, id: u64) -> PyResult<bool> {
        call(py, "Runtime.wants_sparse", || self.inner.wants_sparse(id))
    }

    /// Whether the request's draft may take the position after its last planned token (a
    /// speculative plan reserves a tentative slot only then).
    fn can_append(&self, py: Python<'_>, id: u64) -> PyResult<bool> {
        call(py, "Runtime.can_append", || self.inner.can_append(id))
    }

    /// The requests whose drafts hold a tentative slot (the last speculative plan), batch order.
    fn pending_drafts(&self) -> Vec<u64> {
        self.inner.pending_drafts()
    }

    /// Resolve the last speculative plan's tentative slots: the drafts of `accepted` are stored
    /// (their `kv_len` advances, their mapping update is queued), every other slot is given back.
    fn commit_drafts(&mut self, py: Python<'_>, accepted: Vec<u64>) -> PyResult<()> {
        call(py, "Runtime.commit_drafts", || {
            self.inner.commit_drafts(&accepted)
        })
    }

    /// Turn a request sparse: a dict of `src_pages`, `host_blocks`, `host_rows`, `lens`,
    /// `slot_pages`, `local_page`, `n_complete` (what the engine copies and selects on the
    /// device: pages into the rows, summaries of the ids).
    fn make_sparse<'py>(&mut self, py: Python<'py>, id: u64) -> PyResult<Bound<'py, PyDict>> {
        let tr = call(py, "Runtime.make_sparse", || self.inner.make_sparse(id))?;
        transition_dict(py, tr)
    }

    fn release(&mut self, py: Python<'_>, id: u64) -> PyResult<()> {
        call(py, "Runtime.release", || self.inner.release(id))
    }

    fn kv_len(&self, py: Python<'_>, id: u64) -> PyResult<usize> {
        call(py, "Runtime.kv_len", || self.inner.kv_len(id))
    }

    /// A request's tables: a dict of `slot`, `kv_len`, `sparse`, `pages`, `slot_pages`,
    /// `local_page` (-1 when dense), `host_blocks` (ids), `host_rows` (their rows; a bounded
    /// staged request's uncached blocks: a filler) and `cache_blocks` (its `C`, or None).
    fn table<'py>(&self, py: Python<'py>, id: u64) -> PyResult<Bound<'py, PyDict>> {
        let t = self.inner.table(id).ok_or_else(|| {
            py_err(
                py,
                "InvalidArgumentError",
                format!("unknown request {id}; admit it first"),
            )
        })?;
        let d = PyDict::new(py);
        d.set_item("slot", t.slot)?;
        d.set_item("kv_len", t.kv_len)?;
        d.set_item("sparse", t.sparse)?;
        d.set_item("pages", t.pages.clone())?;
        d.set_item("slot_pages", t.slot_pages.clone())?;
        d.set_item("local_page", t.local_page.map_or(-1, i64::from))?;
        d.set_item("host_blocks", t.host_blocks.clone())?;
        d.set_item("host_rows", t.host_rows.clone())?;
        d.set_item("cache_blocks", t.cache.as_ref().map(|c| c.capacity()))?;
        Ok(d)
    }

    /// Drain the pending head-wise mapping updates: `(pages, values)`, each page once.
    fn take_map_updates(&mut self) -> (Vec<u32>, Vec<i32>) {
        self.inner.take_map_updates()
    }

    /// Plan one decode step of `ids` (batch order) whose query rows take `input_ids` (`rows` per
    /// request); every request's `kv_len` advances by one.
    /// Returns `(arena_len, layout, num_sparse, max_pages)`, `layout` a dict name -> (start, len)
    /// in elements; copy the arena out with [`PyRuntime::write_plan`].
    ///
    /// `pad = (rows, pages, blocks, dummy_slot)` lays the plan out at fixed capacities (the same
    /// layout every step, for a captured CUDA graph; see `oasis_runtime::PlanPad`); the mapping
    /// updates then stay pending for `take_map_updates`. `step_needs(ids)` gives the pages and
    /// blocks it must allow.
    ///
    /// `tries` (one flag per request) makes it a speculative plan: each request that tries and
    /// may ([`PyRuntime::can_append`]) gets a tentative slot for its draft, in the `spec_*` fields;
    /// `commit_drafts` resolves them before the next plan.
    #[pyo3(signature = (ids, input_ids, pad = None, tries = None))]
    fn plan<'py>(
        &mut self,
        py: Python<'py>,
        ids: Vec<u64>,
        input_ids: Vec<i32>,
        pad: Option<(usize, usize, usize, i32)>,
        tries: Option<Vec<bool>>,
    ) -> PyResult<(usize, Bound<'py, PyDict>, usize, usize)> {
        let pad = pad.map(|(rows, pages, blocks, dummy_slot)| PlanPad {
            rows,
            pages,
            blocks,
            dummy_slot,
        });
        let plan = call(py, "Runtime.plan", || match (&pad, &tries) {
            (_, Some(tries)) => self
                .inner
                .plan_speculative(&ids, &input_ids, pad.as_ref(), tries)
                .map(|p| p.clone_meta()),
            (None, None) => self.inner.plan(&ids, &input_ids).map(|p| p.clone_meta()),
            (Some(pad), None) => self
                .inner
                .plan_padded(&ids, &input_ids, pad)
                .map(|p| p.clone_meta()),
        })?;
        let d = PyDict::new(py);
        for f in PlanField::ALL {
            d.set_item(f.name(), plan.layout[f as usize])?;
        }
        Ok((plan.len, d, plan.num_sparse, plan.max_pages))
    }

    /// `(pages, blocks)`: the most attention pages and host blocks any of `ids` holds once its
    /// next token's block is entered (the capacities a padded plan of them needs).
    fn step_needs(&self, py: Python<'_>, ids: Vec<u64>) -> PyResult<(usize, usize)> {
        call(py, "Runtime.step_needs", || self.inner.step_needs(&ids))
    }

    /// Copy the last plan's arena into `out`, a contiguous int32 CPU tensor (pinned, to copy it
    /// on to the device asynchronously) of at least `arena_len` elements.
    fn write_plan(&self, py: Python<'_>, out: TensorArg) -> PyResult<()> {
        let arena = self.inner.last_plan().arena();
        if out.dtype != "int32" || out.device != "cpu" || !out.contiguous {
            return Err(py_err(
                py,
                "DTypeError",
                format!(
                    "the plan buffer must be a contiguous int32 CPU tensor, got {} on {}",
                    out.dtype, out.device
                ),
            ));
        }
        if out.numel() < arena.len() {
            return Err(py_err(
                py,
                "ShapeError",
                format!(
                    "the plan buffer holds {} elements but the plan needs {}; grow it",
                    out.numel(),
                    arena.len()
                ),
            ));
        }
        if arena.is_empty() {
            return Ok(());
        }
        // SAFETY: `out` is a live, contiguous int32 CPU tensor (checked above) with at least
        // `arena.len()` elements, so the destination range is valid for writes and 4-aligned; the
        // arena is a Rust Vec, so the two ranges cannot overlap. The caller holds `out` across
        // this call (it is an argument), and the GIL is held, so no Python code frees it.
        unsafe {
            std::ptr::copy_nonoverlapping(arena.as_ptr(), out.ptr as *mut i32, arena.len());
        }
        Ok(())
    }

    /// Check every table invariant against the pools (tests).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        call(py, "Runtime.check_invariants", || {
            self.inner.check_invariants()
        })
    }

    /// `(gpu_pages, host_blocks, host_rows)` in the pools now (pages; summary/code ids;
    /// `host_k`/`host_v` rows).
    #[getter]
    fn pool_sizes(&self) -> (usize, usize, usize) {
        self.inner.pool_sizes()
    }

    /// Free entries per pool, as `pool_sizes`.
    #[getter]
    fn num_free(&self) -> (usize, usize, usize) {
        self.inner.num_free()
    }

    /// Entries reserved by the admitted requests per pool, as `pool_sizes`.
    #[getter]
    fn reserved(&self) -> (usize, usize, usize) {
        self.inner.reserved()
    }

    /// The caps per pool, as `pool_sizes` (the ids': 2**31 - 1, what int32 addresses).
    #[getter]
    fn caps(&self) -> (usize, usize, usize) {
        self.inner.caps()
    }

    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }
}

/// The KV shape of a model: query heads, KV heads, head_dim, tokens per block.
#[pyclass(name = "KvGeometry", frozen, module = "oasiskv._core")]
#[derive(Clone)]
pub(crate) struct PyGeometry {
    pub(crate) inner: KvGeometry,
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
pub(crate) struct PyBlockPool {
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

/// Add this module's classes to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGeometry>()?;
    m.add_class::<PyBlockPool>()?;
    m.add_class::<PyRuntime>()?;
    Ok(())
}
