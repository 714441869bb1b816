//! The device itself: whether the CUDA path can run here (`cuda_status`), NVRTC
//! (`compile_kernels`, `nvrtc_version`), the stream timer `wait_stamp` and the wait on a
//! layer's remote reads `wait_epoch`.

use std::panic::catch_unwind;
use std::sync::OnceLock;

use oasis_core::kernels;
use oasis_cuda::{CudaError, Gpu};
use pyo3::prelude::*;

use crate::call::{detached, entry, guarded, on_gpu};
use crate::tensor::{Cx, Elem, Place, TensorArg, ANY};

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
        stamps.check(&cx, "stamps", Elem::I64, [3])?;
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

#[pyfunction]
#[pyo3(signature = (landed, layer, epoch, stats, timeout_s, *, stream = 0))]
/// Hold a stream until `landed[layer]` (int64 `[layers]`: the landed epochs a coordinator's
/// `StepReader` writes; CPU, pinned for a CUDA call) reaches `epoch[0]` (int64 `[1]`, on the
/// call's device: a captured graph reads each replay's own), or give up after `timeout_s`.
/// `stats` (int64 `[4]`, on the call's device): waits that gave up (`+= 1`), the last one's epoch,
/// nanoseconds the stream was held, waits; for the caller to read after the step.
///
/// CUDA: a one-thread kernel queued on `stream`, captured into a CUDA graph like any kernel.
/// CPU: the wait itself, at once, the GIL released.
fn wait_epoch(
    py: Python<'_>,
    landed: TensorArg,
    layer: usize,
    epoch: TensorArg,
    stats: TensorArg,
    timeout_s: f64,
    stream: u64,
) -> PyResult<()> {
    entry(py, "wait_epoch", || {
        let cx = Cx::new(
            py,
            &[("epoch", &epoch), ("stats", &stats)],
            &[("landed", &landed)],
        )?;
        epoch.check(&cx, "epoch", Elem::I64, [1])?;
        stats.check(&cx, "stats", Elem::I64, [4])?;
        let [layers] = landed.check(&cx.host(), "landed", Elem::I64, [ANY])?;
        if layer >= layers || !(timeout_s.is_finite() && timeout_s > 0.0 && timeout_s < 1e6) {
            return Err(crate::rt::errors::bad_arg(
                py,
                format!(
                    "layer must be below landed's {layers} entries and timeout_s a positive number of \
                     seconds, got {layer} and {timeout_s}"
                ),
            ));
        }
        let word = landed.ptr + 8 * layer;
        match cx.place {
            Place::Cpu => {
                // SAFETY: CPU tensors of the checked shapes; epoch read once here; the landed word
                // is 8-aligned (an int64 tensor's element) and written concurrently by the reader
                // thread, so it is read through an atomic view.
                let want = unsafe { epoch.slice::<i64>()[0] } as u64;
                let t = unsafe { stats.slice_mut::<u64>() };
                let w: &std::sync::atomic::AtomicU64 =
                    unsafe { &*(word as *const std::sync::atomic::AtomicU64) };
                let timeout = std::time::Duration::from_secs_f64(timeout_s);
                guarded(py, "wait_epoch", || {
                    kernels::wait_epoch(w, want, timeout, t).map(|_| ())
                })
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) 1 and 4 int64 on cuda:dev; the landed word is inside a
                // pinned tensor mapped at its own address (checked by on_gpu) that the caller
                // keeps alive until the stream ran the kernel.
                let (e, t) = unsafe { (epoch.dev::<i64>(), stats.dev::<u64>()) };
                let ns = (timeout_s * 1e9) as i64;
                on_gpu(
                    py,
                    "wait_epoch",
                    dev,
                    stream,
                    &[("landed", &landed)],
                    move |gpu, st| unsafe { gpu.wait_epoch(word as u64, e, t, ns, st) },
                )
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

/// Add this module's functions to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(wait_stamp, m)?)?;
    m.add_function(wrap_pyfunction!(wait_epoch, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(compile_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_version, m)?)?;
    Ok(())
}
