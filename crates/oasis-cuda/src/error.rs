//! One error enum for the CUDA side. Messages are short and lowercase and, where the fix is on
//! the caller's side (a missing library, an old GPU), they say what to do.

use oasis_core::OasisError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// libnvrtc could not be found or opened; `searched` lists every place tried (with why).
    #[error(
        "libnvrtc not found; set OASIS_NVRTC_LIB to the path of libnvrtc.so (e.g. the nvidia/cu13/lib \
         folder of the pip package nvidia-cuda-nvrtc). searched: {}",
        searched.join("; ")
    )]
    NvrtcMissing { searched: Vec<String> },
    /// The CUDA driver library (libcuda.so.1) could not be opened: no NVIDIA driver here.
    #[error("the cuda driver (libcuda.so.1) could not be loaded: this needs an nvidia gpu and its driver")]
    DriverMissing,
    /// NVRTC rejected a kernel source; `log` is the compiler's log.
    #[error("nvrtc failed to compile {kernel}:\n{log}")]
    Compile { kernel: String, log: String },
    /// The device is older than the kernels support (sm_80).
    #[error("unsupported gpu architecture sm_{major}{minor}: oasiskv kernels need sm_80 or newer")]
    UnsupportedArch { major: i32, minor: i32 },
    /// No CUDA context is current on this thread and no device was named.
    #[error("no current cuda context on this thread; touch the device first (e.g. torch.cuda.init()) or pass a device")]
    NoContext,
    /// A CUDA driver call failed.
    #[error("cuda driver: {0}")]
    Driver(String),
    /// An NVRTC call other than the compilation itself failed.
    #[error("nvrtc: {0}")]
    Nvrtc(String),
    /// A kernel source or entry point that the registry does not list.
    #[error("unknown kernel {0:?}")]
    UnknownKernel(String),
    /// The call does not fit what the kernel can do (shared memory, grid size, argument range).
    #[error("unsupported launch: {0}")]
    Unsupported(String),
    /// A shape or argument check failed (the same checks as the CPU twins).
    #[error(transparent)]
    Invalid(#[from] OasisError),
    /// A panic inside a dependency, caught at the crate boundary.
    #[error("internal error in {what}: {msg}")]
    Panic { what: &'static str, msg: String },
}

pub type Result<T, E = CudaError> = std::result::Result<T, E>;

/// Run `f`, turning a panic (cudarc's loaders panic on a missing symbol) into
/// [`CudaError::Panic`]. Used at every public entry point of the crate.
pub(crate) fn guard<R>(what: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(CudaError::Panic { what, msg })
        }
    }
}
