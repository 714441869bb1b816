//! `oasiskv._core.StepReader`: a coordinator's reads started from the plans a decode step
//! publishes while it runs (`oasis_coord::StepReader`), for `oasiskv.disagg.RemoteKvSource`.
//!
//! ```text
//! the step (GPU, or the CPU path inline)       StepReader (its own thread; no GIL)
//! per layer: plan -> slots[l], blocks[l];
//!   epoch -> ready[l]  ───────────────────────▶ submit the plan's block-heads to the Coordinator
//!   ops.wait_epoch(landed, l, epoch) ◀───────── landed[l] = epoch once they are in the pool
//!   gather(l)
//! Python, before each step: begin_step(epoch, rows, cap, host_indptr, host_indices)
//! ```
//!
//! The mailbox tensors are CPU tensors (pinned for a CUDA step, whose copies and wait kernel
//! reach them through unified addressing); the reader keeps references to them until `stop`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError};

use oasis_coord::{MailboxLayout, StepPlan, StepReader};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::coord::{coord_call, coord_err, PyCoordinator};
use crate::rt::errors::bad_arg;
use crate::tensor::{Cx, Elem, TensorArg, ANY};

/// Reads the block-heads each layer's published plan gathers (see the module docs).
#[pyclass(name = "StepReader", module = "oasiskv._core")]
pub struct PyStepReader {
    inner: Mutex<Option<StepReader>>,
    /// The mailbox, kept alive while the reader's thread reads it (`StepReader::start`'s
    /// safety obligation).
    mailbox: Mutex<Vec<TensorArg>>,
}

impl PyStepReader {
    fn with<R>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&StepReader) -> oasis_coord::Result<R> + Send,
    ) -> PyResult<R>
    where
        R: Send,
    {
        let guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(r) = guard.as_ref() else {
            return Err(coord_err(py, oasis_coord::CoordError::Closed));
        };
        coord_call(py, what, || f(r))
    }
}

#[pymethods]
impl PyStepReader {
    /// Start a reader for `coordinator`'s pools: per layer `slots[l]` and `blocks[l]` (int32
    /// CPU tensors of one length, the plan's `[rows, num_kv_heads, cap]` flattened), `ready` and
    /// `landed` (int64 CPU `[num_layers]`; the step writes `ready`, the reader `landed`). Each
    /// layer's block-heads are submitted with `prefetch` (as `Coordinator.submit(prefetch=)`).
    ///
    /// Raises `InvalidArgumentError` for a mailbox of other layers than the coordinator's,
    /// `ShapeError` / `DTypeError` / `DeviceError` for tensors not as above.
    #[new]
    #[allow(clippy::too_many_arguments)] // the Python signature
    #[pyo3(signature = (coordinator, slots, blocks, ready, landed, num_kv_heads, *, prefetch = 0))]
    fn new(
        py: Python<'_>,
        coordinator: PyRef<'_, PyCoordinator>,
        slots: Vec<TensorArg>,
        blocks: Vec<TensorArg>,
        ready: TensorArg,
        landed: TensorArg,
        num_kv_heads: usize,
        prefetch: usize,
    ) -> PyResult<Self> {
        let cx = Cx::new(py, &[("ready", &ready)], &[])?;
        if !matches!(cx.place, crate::tensor::Place::Cpu) {
            return Err(bad_arg(
                py,
                "the mailbox (slots, blocks, ready, landed) must be CPU tensors (pinned for a CUDA \
                 step)"
                    .into(),
            ));
        }
        let [layers] = ready.check(&cx, "ready", Elem::I64, [ANY])?;
        landed.check(&cx, "landed", Elem::I64, [layers])?;
        if slots.len() != layers || blocks.len() != layers || layers == 0 {
            return Err(bad_arg(
                py,
                format!(
                    "slots and blocks are one tensor per layer: {layers} layers (ready), got {} \
                     and {}",
                    slots.len(),
                    blocks.len()
                ),
            ));
        }
        let [capacity] = slots[0].check(&cx, "slots[0]", Elem::I32, [ANY])?;
        for (name, ts) in [("slots", &slots), ("blocks", &blocks)] {
            for (l, t) in ts.iter().enumerate() {
                t.check(&cx, &format!("{name}[{l}]"), Elem::I32, [capacity])?;
            }
        }
        let layout = MailboxLayout {
            slots: slots.iter().map(|t| t.ptr).collect(),
            blocks: blocks.iter().map(|t| t.ptr).collect(),
            capacity,
            ready: ready.ptr,
            landed: landed.ptr,
        };
        let coord = Arc::clone(&coordinator.inner);
        // SAFETY: every address is a contiguous CPU tensor of the checked length (capacity
        // int32 per slots/blocks tensor, `layers` int64 for ready and landed); `self.mailbox`
        // keeps a reference to each until `stop` has joined the thread (and Drop stops it
        // before the references go). Python's side (oasiskv.disagg.RemoteKvSource): only the
        // step writes the plans and `ready`; nothing but the reader writes `landed`.
        let reader = coord_call(py, "StepReader", || unsafe {
            StepReader::start(coord, layout, num_kv_heads, prefetch)
        })?;
        let mut kept: Vec<TensorArg> = slots.into_iter().chain(blocks).collect();
        kept.push(ready);
        kept.push(landed);
        Ok(Self {
            inner: Mutex::new(Some(reader)),
            mailbox: Mutex::new(kept),
        })
    }

    /// Queue a step's tables before the step runs: `epoch` (what the step writes into
    /// `ready`, above every earlier step's), per layer the slots each KV head's plan has
    /// (`caps`: the plans are `[rows, num_kv_heads, caps[l]]`), and the step's host block table
    /// (`host_indptr` int32 `[rows + 1]`, `host_indices` int32, CPU), copied here.
    ///
    /// Raises `InvalidArgumentError` for an epoch not above the last, a plan larger than the
    /// mailbox or an indptr that does not index host_indices.
    fn begin_step(
        &self,
        py: Python<'_>,
        epoch: u64,
        caps: Vec<usize>,
        host_indptr: TensorArg,
        host_indices: TensorArg,
    ) -> PyResult<()> {
        let cx = Cx::new(
            py,
            &[
                ("host_indptr", &host_indptr),
                ("host_indices", &host_indices),
            ],
            &[],
        )?;
        if !matches!(cx.place, crate::tensor::Place::Cpu) {
            return Err(bad_arg(
                py,
                "host_indptr and host_indices must be CPU tensors".into(),
            ));
        }
        host_indptr.check(&cx, "host_indptr", Elem::I32, [ANY])?;
        host_indices.check(&cx, "host_indices", Elem::I32, [ANY])?;
        // SAFETY: contiguous CPU int32 tensors (checked above), read here under the GIL.
        let (indptr, indices) =
            unsafe { (host_indptr.ints().to_vec(), host_indices.ints().to_vec()) };
        let plan = StepPlan {
            epoch,
            rows: indptr.len().saturating_sub(1),
            caps,
            indptr,
            indices,
        };
        self.with(py, "begin_step", move |r| r.begin_step(plan))
    }

    /// Steps begun and not yet fully landed.
    #[getter]
    fn queued(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, "queued", |r| Ok(r.queued()))
    }

    /// Counters: `steps`, `layers`, `entries` (block-heads handed over, present ones
    /// included), `bad_entries`, `refused`, `stale_steps`, `read_seconds` (from each layer's plan
    /// seen to its landed word) and `last_error`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, "stats", |r| Ok(r.stats()))?;
        let d = PyDict::new(py);
        d.set_item("steps", s.steps)?;
        d.set_item("layers", s.layers)?;
        d.set_item("entries", s.entries)?;
        d.set_item("bad_entries", s.bad_entries)?;
        d.set_item("refused", s.refused)?;
        d.set_item("stale_steps", s.stale_steps)?;
        d.set_item("read_seconds", s.read_seconds)?;
        d.set_item("last_error", s.last_error)?;
        Ok(d)
    }

    /// Stop the thread (the step being served gets every layer marked landed, so no wait is
    /// left hanging) and drop the mailbox's references. Idempotent.
    fn stop(&self, py: Python<'_>) {
        let taken = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(mut r) = taken {
            py.detach(move || {
                let _ = catch_unwind(AssertUnwindSafe(|| r.stop()));
            });
        }
        self.mailbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

impl Drop for PyStepReader {
    fn drop(&mut self) {
        // The thread stops (and joins) before the mailbox's references go.
        if let Some(mut r) = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            r.stop();
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStepReader>()
}
