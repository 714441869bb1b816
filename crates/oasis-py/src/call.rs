//! How an entry point runs: under `catch_unwind` (no panic reaches Python), with the GIL released
//! around the kernel, on the CPU twins or queued on a CUDA stream of the device's [`Gpu`]
//! (attached once per device), and with core and CUDA errors mapped to `oasiskv.errors`.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use oasis_core::OasisError;
use oasis_cuda::{CudaError, Gpu, Stream};
use pyo3::prelude::*;

use crate::errors::{core_err, cuda_err, py_err};
use crate::tensor::TensorArg;

pub(crate) fn internal_error(py: Python<'_>, what: &str) -> PyErr {
    py_err(
        py,
        "OasisError",
        format!("internal error in {what}; please report it with the call's shapes"),
    )
}

/// Run a whole entry point, turning a panic into an `OasisError` instead of unwinding into
/// Python.
pub(crate) fn entry<R>(py: Python<'_>, what: &str, f: impl FnOnce() -> PyResult<R>) -> PyResult<R> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(internal_error(py, what)))
}

/// Run a CPU kernel with the GIL released, turning a panic into an `OasisError`.
pub(crate) fn guarded<R: Send>(
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

pub(crate) fn gpu_for(device: i32) -> Result<Arc<Gpu>, CudaError> {
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
pub(crate) fn detached<R: Send>(
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
pub(crate) fn on_gpu<R: Send>(
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
            ::oasis_core::DType::F32 => {
                type $T = f32;
                $body
            }
            ::oasis_core::DType::F16 => {
                type $T = ::half::f16;
                $body
            }
            ::oasis_core::DType::BF16 => {
                type $T = ::half::bf16;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;
