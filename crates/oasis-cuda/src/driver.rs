//! The CUDA driver side: load libcuda without panicking, attach to the caller's context, load
//! the kernel modules for the device's architecture and launch on the caller's stream.
//!
//! OasisKV lives inside someone else's PyTorch process, so it never creates a context and never
//! changes the current device: [`Gpu::attach`] takes the context current on the calling thread
//! (PyTorch's primary context), or, when none is current and a device is named, that device's
//! primary context, which is the one PyTorch uses too. Launches on a thread where another
//! context is current push ours for the duration of the launch and pop it again.
//!
//! Modules are compiled (NVRTC, cached on disk) and loaded on first use of one of their
//! kernels; [`Gpu::preload`] does it for all of them up front, outside the hot loop.

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdevice_attribute, CUfunction_attribute, CUresult};

use crate::error::{guard, CudaError, Result};
use crate::kernels;
use crate::nvrtc;
use crate::params::KernelParams;

/// Oldest supported compute capability (Ampere): the kernels use bf16 conversions and more
/// shared memory than older parts offer.
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

fn check(res: CUresult, what: &str) -> Result<()> {
    if res == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `p` is valid for writes; on success it points to a static NUL-terminated string.
    let msg = unsafe {
        if sys::cuGetErrorString(res, &mut p) == CUresult::CUDA_SUCCESS && !p.is_null() {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        } else {
            format!("{res:?}")
        }
    };
    Err(CudaError::Driver(format!("{what}: {msg} ({res:?})")))
}

/// Whether the CUDA driver library can be opened and initialised.
///
/// # Errors
/// [`CudaError::DriverMissing`] when libcuda cannot be opened (no NVIDIA driver),
/// [`CudaError::Driver`] when `cuInit` fails (e.g. no device visible).
pub fn driver_available() -> Result<()> {
    guard("driver_available", || {
        // SAFETY: probing only dlopen()s and closes cudarc's candidate names for libcuda.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::DriverMissing);
        }
        // SAFETY: cuInit takes no pointers; calling it again is harmless.
        check(unsafe { sys::cuInit(0) }, "cuInit")
    })
}

/// A loaded kernel: its handle and how much dynamic shared memory it may use.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Function {
    handle: usize, // CUfunction
    pub(crate) max_dynamic_smem: usize,
}

/// The device and context that kernels run in, with the modules loaded there.
#[derive(Debug)]
pub struct Gpu {
    ctx: usize, // CUcontext
    device: i32,
    cc: (i32, i32),
    num_sms: usize,
    smem_optin: usize,
    functions: Mutex<HashMap<&'static str, Function>>,
}

/// One [`Gpu`] per context, so modules are loaded once per process and context.
static GPUS: Mutex<Vec<Arc<Gpu>>> = Mutex::new(Vec::new());

impl Gpu {
    /// Attach to the context current on this thread when it belongs to `device` (or `device`
    /// is `None`); otherwise to the primary context of `device` (retained, never made current;
    /// launches push it for their duration).
    ///
    /// # Errors
    /// [`CudaError::DriverMissing`], [`CudaError::NoContext`] (none current and no device),
    /// [`CudaError::UnsupportedArch`] below sm_80, [`CudaError::Driver`] for a failing call.
    pub fn attach(device: Option<i32>) -> Result<Arc<Gpu>> {
        guard("Gpu::attach", || {
            driver_available()?;
            let mut cur: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: `cur` is valid for writes.
            check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
            let mut cur_dev: Option<sys::CUdevice> = None;
            if !cur.is_null() {
                let mut dev: sys::CUdevice = 0;
                // SAFETY: a context is current; `dev` is valid for writes.
                check(unsafe { sys::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
                cur_dev = Some(dev);
            }
            // The current context serves when it belongs to the requested device (or none was
            // named). Otherwise (none current, or tensors on another device than the current
            // one, as with torch's current device 0 and tensors on cuda:1) the requested
            // device's primary context does: it is the one PyTorch allocated them in.
            let (ctx, dev, retained) =
                if let Some(dev) = cur_dev.filter(|&d| device.is_none() || device == Some(d)) {
                    (cur, dev, false)
                } else {
                    let want = device.ok_or(CudaError::NoContext)?;
                    let mut dev: sys::CUdevice = 0;
                    let mut ctx: sys::CUcontext = std::ptr::null_mut();
                    // SAFETY: out-pointers valid for writes. Retaining the primary context activates
                    // the one PyTorch uses; it is never released (it lives as long as the process).
                    unsafe {
                        check(sys::cuDeviceGet(&mut dev, want), "cuDeviceGet")?;
                        check(
                            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                            "cuDevicePrimaryCtxRetain",
                        )?;
                    }
                    (ctx, dev, true)
                };
            let mut gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(g) = gpus.iter().find(|g| g.ctx == ctx as usize) {
                if retained {
                    // SAFETY: balances the retain above; the first retain (kept by `g`) remains.
                    check(
                        unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) },
                        "cuDevicePrimaryCtxRelease",
                    )?;
                }
                return Ok(g.clone());
            }
            let attr = |a: CUdevice_attribute, what: &str| -> Result<i32> {
                let mut v = 0;
                // SAFETY: `v` valid for writes, `dev` a device ordinal returned by the driver.
                check(unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) }, what)?;
                Ok(v)
            };
            let major = attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                "compute capability",
            )?;
            let minor = attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                "compute capability",
            )?;
            if (major, minor) < MIN_COMPUTE_CAPABILITY {
                return Err(CudaError::UnsupportedArch { major, minor });
            }
            let num_sms = attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                "sm count",
            )?;
            let optin = attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "shared memory per block",
            )?;
            let gpu = Arc::new(Gpu {
                ctx: ctx as usize,
                device: dev,
                cc: (major, minor),
                num_sms: num_sms.max(1) as usize,
                smem_optin: optin.max(0) as usize,
                functions: Mutex::new(HashMap::new()),
            });
            gpus.push(gpu.clone());
            Ok(gpu)
        })
    }

    /// Device ordinal.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// The NVRTC architecture the kernels are compiled for (`"sm_90"`).
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.cc.0, self.cc.1)
    }

    /// Number of streaming multiprocessors (to size split-KV grids).
    pub fn num_sms(&self) -> usize {
        self.num_sms
    }

    /// Largest dynamic shared memory a block may opt into, in bytes.
    pub fn max_shared_mem_per_block(&self) -> usize {
        self.smem_optin
    }

    /// Compile (or read from the cache) and load every kernel module now.
    ///
    /// # Errors
    /// As the first failing compile or module load.
    pub fn preload(&self) -> Result<()> {
        guard("Gpu::preload", || {
            for src in kernels::SOURCES {
                self.function(src.entry_points[0])?;
            }
            Ok(())
        })
    }

    /// Run `f` with this context current: as is when it already is, else pushed and popped.
    fn with_ctx<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `cur` is valid for writes.
        check(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
        if cur as usize == self.ctx {
            return f();
        }
        // SAFETY: self.ctx is a live context (current or retained primary) of this process.
        check(
            unsafe { sys::cuCtxPushCurrent_v2(self.ctx as sys::CUcontext) },
            "cuCtxPushCurrent",
        )?;
        let r = f();
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops exactly the context pushed above.
        let pop = check(
            unsafe { sys::cuCtxPopCurrent_v2(&mut popped) },
            "cuCtxPopCurrent",
        );
        let v = r?;
        pop.map(|_| v)
    }

    /// The kernel `entry`, loading its module on first use.
    pub(crate) fn function(&self, entry: &'static str) -> Result<Function> {
        let mut funcs = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = funcs.get(entry) {
            return Ok(*f);
        }
        let src =
            kernels::source_of(entry).ok_or_else(|| CudaError::UnknownKernel(entry.to_string()))?;
        let image = nvrtc::compile(src.name, &self.arch())?;
        let loaded = self.with_ctx(|| self.load_module(&image, src.entry_points))?;
        funcs.extend(loaded);
        funcs
            .get(entry)
            .copied()
            .ok_or_else(|| CudaError::UnknownKernel(entry.to_string()))
    }

    /// Load one module image and resolve its entry points; the module stays loaded for the life
    /// of the context.
    fn load_module(
        &self,
        image: &[u8],
        entries: &[&'static str],
    ) -> Result<Vec<(&'static str, Function)>> {
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is a complete cubin (or NUL-terminated PTX) produced by NVRTC, alive
        // for the call; `module` is valid for writes; our context is current (with_ctx).
        check(
            unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>()) },
            "cuModuleLoadData",
        )?;
        let mut out = Vec::with_capacity(entries.len());
        for &entry in entries {
            let name =
                CString::new(entry).map_err(|_| CudaError::UnknownKernel(entry.to_string()))?;
            let mut f: sys::CUfunction = std::ptr::null_mut();
            let mut static_smem = 0;
            // SAFETY: `module` was loaded above; `name` is NUL-terminated; out-pointers valid.
            unsafe {
                check(
                    sys::cuModuleGetFunction(&mut f, module, name.as_ptr()),
                    entry,
                )?;
                check(
                    sys::cuFuncGetAttribute(
                        &mut static_smem,
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                        f,
                    ),
                    entry,
                )?;
            }
            let max_dynamic = self.smem_optin.saturating_sub(static_smem.max(0) as usize);
            // SAFETY: `f` is a live function of this context; the value is within the device's
            // opt-in limit minus the kernel's static shared memory.
            check(
                unsafe {
                    sys::cuFuncSetAttribute(
                        f,
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        max_dynamic as i32,
                    )
                },
                entry,
            )?;
            out.push((
                entry,
                Function {
                    handle: f as usize,
                    max_dynamic_smem: max_dynamic,
                },
            ));
        }
        Ok(out)
    }

    /// Launch kernel `entry` (loading its module on first use) with `params`, its one parameter,
    /// on `stream`. Returns as soon as the launch is queued.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when `P` is not the parameter struct of `entry` (its layout
    /// does not list it) or `smem` exceeds the kernel's limit; loading and driver errors.
    ///
    /// # Safety
    /// 1. every pointer field of `params` is valid for the accesses the kernel makes with the
    ///    sizes in `params`, from this context's device, until the kernel completes (null only
    ///    where the kernel tests for null);
    /// 2. `stream` is a stream of this context (or 0, the legacy default stream).
    ///
    /// That `params` has the layout of the kernel's parameter is `P`'s [`KernelParams`]
    /// contract, and that `entry` takes `P` is checked here.
    pub(crate) unsafe fn launch<P: KernelParams>(
        &self,
        entry: &'static str,
        cfg: LaunchCfg,
        stream: u64,
        params: &P,
    ) -> Result<()> {
        let LaunchCfg { grid, block, smem } = cfg;
        if !P::LAYOUT.kernels.contains(&entry) {
            return Err(CudaError::Unsupported(format!(
                "internal: {entry} does not take {} (it is the parameter of {:?})",
                P::LAYOUT.name,
                P::LAYOUT.kernels
            )));
        }
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(()); // nothing to do; a zero grid is an error for the driver
        }
        let f = self.function(entry)?;
        if smem > f.max_dynamic_smem {
            return Err(CudaError::Unsupported(format!(
                "{entry} needs {smem} bytes of shared memory per block, the device allows {}",
                f.max_dynamic_smem
            )));
        }
        // The kernel's one parameter: a pointer to the struct, whose size_of::<P>() bytes the
        // driver copies before cuLaunchKernel returns.
        let mut ptrs = [(params as *const P).cast_mut().cast::<c_void>()];
        self.with_ctx(|| {
            // SAFETY: the caller's obligations 1 and 2; `params` has the layout of `entry`'s
            // only parameter (P's KernelParams contract, and entry is one of P's kernels, checked
            // above); `ptrs` holds one pointer to it, alive for the call.
            check(
                unsafe {
                    sys::cuLaunchKernel(
                        f.handle as sys::CUfunction,
                        grid.0,
                        grid.1,
                        grid.2,
                        block,
                        1,
                        1,
                        smem as u32,
                        stream as sys::CUstream,
                        ptrs.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                },
                entry,
            )
        })
    }

    /// Check that `ptr` is reachable from this device at the same address (device memory, or
    /// pinned host memory mapped through unified virtual addressing), as the kernels assume.
    ///
    /// # Errors
    /// [`CudaError::Driver`] when the driver does not know the pointer or maps it elsewhere.
    pub fn check_uva(&self, ptr: u64) -> Result<()> {
        guard("Gpu::check_uva", || {
            let mut dev_ptr: sys::CUdeviceptr = 0;
            self.with_ctx(|| {
                // SAFETY: `dev_ptr` is valid for writes of a CUdeviceptr; the driver only looks
                // `ptr` up in its tables.
                check(
                    unsafe {
                        sys::cuPointerGetAttribute(
                            (&mut dev_ptr as *mut sys::CUdeviceptr).cast::<c_void>(),
                            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                            ptr,
                        )
                    },
                    "cuPointerGetAttribute",
                )
            })?;
            if dev_ptr != ptr {
                return Err(CudaError::Driver(format!(
                    "pointer {ptr:#x} is mapped at {dev_ptr:#x} on the device: allocate pinned memory with \
                     torch.empty(..., pin_memory=True) so the device sees it at the same address"
                )));
            }
            Ok(())
        })
    }
}

/// Grid, block (x only) and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaunchCfg {
    pub(crate) grid: (u32, u32, u32),
    pub(crate) block: u32,
    pub(crate) smem: usize,
}
