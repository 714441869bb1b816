//! Core and CUDA errors -> the Python classes of `oasiskv.errors`, variant by variant, with a hint
//! that says how to fix the call.

use oasis_core::OasisError;
use oasis_cuda::CudaError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

/// Build an exception of class `oasiskv.errors.<class>` with `msg`. Falls back to RuntimeError
/// if the Python package cannot be imported (only when `_core` is loaded on its own).
pub fn py_err(py: Python<'_>, class: &str, msg: String) -> PyErr {
    let cls = py
        .import("oasiskv.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
    match cls {
        Ok(cls) => PyErr::from_type(cls, msg),
        Err(_) => PyRuntimeError::new_err(format!("{class}: {msg}")),
    }
}

pub fn core_err(py: Python<'_>, e: OasisError) -> PyErr {
    let (class, hint) = match &e {
        OasisError::Shape { .. } => (
            "ShapeError",
            "pass tensors laid out as documented in docs/CORE_CONTRACT.md",
        ),
        OasisError::DType { .. } => ("DTypeError", "convert the tensor with .to(dtype)"),
        OasisError::IndexOutOfRange { .. } => (
            "IndexError_",
            "a table entry points past its pool; check the block tables",
        ),
        OasisError::OutOfBlocks { .. } => (
            "OutOfBlocksError",
            "raise the pool size in KvConfig or run fewer requests at once",
        ),
        OasisError::OutOfMemory { .. } => (
            "OutOfMemoryError",
            "ask for fewer blocks or a smaller batch (KvConfig num_gpu_pages / num_host_blocks), or free memory first",
        ),
        OasisError::Config(_) => ("ConfigError", "fix the configuration value named above"),
        OasisError::Invalid(_) => ("InvalidArgumentError", "fix the argument named above"),
    };
    py_err(py, class, format!("{e}; {hint}"))
}

/// CUDA-side errors -> `oasiskv.errors`: what is missing on this machine is a
/// `CudaUnavailableError` (the message says what to install or set), a failed shape or argument
/// check maps like the core's, a call the kernels cannot take is an `InvalidArgumentError`, and
/// anything else (a driver call failing, a compile error with its log) an `OasisError`.
pub fn cuda_err(py: Python<'_>, e: CudaError) -> PyErr {
    match e {
        CudaError::Invalid(core) => core_err(py, core),
        CudaError::DriverMissing => py_err(
            py,
            "CudaUnavailableError",
            format!("{e}; install the nvidia driver, or pass CPU tensors to run the CPU kernels"),
        ),
        CudaError::NvrtcMissing { .. } => py_err(
            py,
            "CudaUnavailableError",
            format!("{e}; `pip install nvidia-cuda-nvrtc` (CUDA 13) usually suffices"),
        ),
        CudaError::UnsupportedArch { .. } | CudaError::NoContext => {
            py_err(py, "CudaUnavailableError", e.to_string())
        }
        CudaError::Unsupported(_) => py_err(py, "InvalidArgumentError", e.to_string()),
        _ => py_err(py, "OasisError", e.to_string()),
    }
}
