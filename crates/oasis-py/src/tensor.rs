//! Tensors as they cross the FFI boundary: a pointer, a shape, a dtype and a device, read from
//! any object with torch's tensor attributes. Nothing here copies data.
//!
//! Every call runs in one [`Place`]: on the CPU twins when its device-side tensors are all on the
//! CPU, or on CUDA device `n` when they are all on `cuda:n`. [`Cx`] carries that decision through
//! the checks, so that one set serves both paths: [`TensorArg::check`], the one check of every
//! tensor argument, also checks that the tensor lives where the call runs (or, for the host pool
//! of a CUDA call, in pinned CPU memory) and is contiguous.

use std::cell::Cell;
use std::fmt;

use oasis_core::DType;
use oasis_cuda::DevSlice;
use pyo3::prelude::*;

use crate::errors::py_err;

/// Where a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// The CPU twins of `oasis_core::kernels`.
    Cpu,
    /// The CUDA kernels of `oasis_cuda`, on this device ordinal.
    Cuda(i32),
}

impl Place {
    /// Parse torch's device string (`cpu`, `cuda:1`); `None` for any other device.
    fn parse(device: &str) -> Option<Place> {
        if device == "cpu" {
            return Some(Place::Cpu);
        }
        let n: i32 = device.strip_prefix("cuda:")?.parse().ok()?;
        (n >= 0).then_some(Place::Cuda(n))
    }
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Place::Cpu => f.write_str("cpu"),
            Place::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The context of one call: the GIL token, where the call runs, and whether the tensor being
/// checked belongs to the host pool (which a CUDA call may read from pinned CPU memory).
#[derive(Clone, Copy)]
pub struct Cx<'py> {
    pub py: Python<'py>,
    pub place: Place,
    host_pool: bool,
}

impl<'py> Cx<'py> {
    /// Decide where a call runs from its tensors. `device_side` tensors must all be on the CPU or
    /// all on one `cuda:n`; `host_side` tensors (the host pool) must be where they are, or, for a
    /// CUDA call, on the CPU (pinned: checked by [`TensorArg::check`] under [`Cx::host`]).
    ///
    /// # Errors
    /// `DeviceError` naming every tensor and its device when they disagree, or when a device is
    /// neither `cpu` nor `cuda:n`.
    pub fn new(
        py: Python<'py>,
        device_side: &[(&str, &TensorArg)],
        host_side: &[(&str, &TensorArg)],
    ) -> PyResult<Self> {
        let (first_name, first) = device_side[0];
        let place = Place::parse(&first.device);
        let device_ok = place.is_some()
            && device_side
                .iter()
                .all(|(_, t)| Place::parse(&t.device) == place);
        let host_ok = |t: &TensorArg| {
            let p = Place::parse(&t.device);
            p == place || (matches!(place, Some(Place::Cuda(_))) && p == Some(Place::Cpu))
        };
        if device_ok && host_side.iter().all(|(_, t)| host_ok(t)) {
            let place = place.unwrap_or(Place::Cpu);
            return Ok(Self {
                py,
                place,
                host_pool: false,
            });
        }
        // Group the tensors by device, in argument order, for a message that names them all.
        let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
        for (name, t) in device_side.iter().chain(host_side) {
            match groups.iter_mut().find(|(d, _)| *d == t.device) {
                Some((_, names)) => names.push(name),
                None => groups.push((&t.device, vec![name])),
            }
        }
        let listing = groups
            .iter()
            .map(|(d, names)| format!("{} on {d}", names.join(", ")))
            .collect::<Vec<_>>()
            .join("; ");
        let names = host_side
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ");
        let msg = if let Some((name, t)) = device_side
            .iter()
            .chain(host_side)
            .find(|(_, t)| Place::parse(&t.device).is_none())
        {
            format!(
                "{name} is on {}; the kernels run on CPU tensors or on CUDA tensors (move them with .cpu() or .to(\"cuda\")). \
                 tensors: {listing}",
                t.device
            )
        } else if device_ok {
            format!(
                "the call runs on {} ({first_name}'s device) but the host pool is elsewhere: {listing}; pass {names} on {} \
                 or, for a CUDA call, as pinned CPU memory (torch.empty(..., pin_memory=True))",
                first.device, first.device
            )
        } else {
            let host = if host_side.is_empty() {
                String::new()
            } else {
                format!(
                    " ({names} may also be pinned CPU memory when the rest is on a CUDA device)"
                )
            };
            format!(
                "the tensors of one call must be on one device, but {listing}; move them to one device, e.g. \
                 .to({first_name}.device){host}"
            )
        };
        Err(py_err(py, "DeviceError", msg))
    }

    /// The same call, for checking a host-pool tensor (a CUDA call may read it from pinned CPU
    /// memory through unified addressing).
    pub fn host(self) -> Self {
        Self {
            host_pool: true,
            ..self
        }
    }
}

/// A dimension of [`TensorArg::check`]'s expected shape that takes any size (and reports it).
pub const ANY: usize = usize::MAX;

/// The element type [`TensorArg::check`] requires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// Not checked there: a KV tensor (float32, float16 or bfloat16, one dtype per call: checked
    /// together by `check::kv_dtype`), or a tensor its caller checks (positions: int32 or int64).
    Any,
    I32,
    I64,
    F32,
    U8,
}

impl Elem {
    /// torch's name of the dtype, and the cast that makes it, for the message.
    fn torch(self) -> Option<(&'static str, &'static str)> {
        match self {
            Elem::Any => None,
            Elem::I32 => Some(("int32", ".to(torch.int32)")),
            Elem::I64 => Some(("int64", ".to(torch.int64)")),
            Elem::F32 => Some(("float32", ".float()")),
            Elem::U8 => Some(("uint8", ".to(torch.uint8)")),
        }
    }
}

pub struct TensorArg {
    pub ptr: usize,
    pub shape: Vec<usize>,
    /// torch's name without the `torch.` prefix: float32, bfloat16, int32, ...
    pub dtype: String,
    pub device: String,
    pub contiguous: bool,
    pub elem_size: usize,
    /// The tensor itself, to ask `is_pinned()` only when it matters (a CPU host pool of a CUDA
    /// call), and remembered once asked.
    obj: Py<PyAny>,
    pinned: Cell<Option<bool>>,
}

impl<'a, 'py> FromPyObject<'a, 'py> for TensorArg {
    type Error = PyErr;

    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let py = ob.py();
        let not_tensor = || {
            let ty = ob
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default();
            py_err(
                py,
                "DTypeError",
                format!("expected a torch.Tensor, got {ty}; pass a tensor (torch.as_tensor(x))"),
            )
        };
        let ptr: usize = ob
            .call_method0("data_ptr")
            .and_then(|p| p.extract())
            .map_err(|_| not_tensor())?;
        let shape: Vec<usize> = ob
            .getattr("shape")
            .and_then(|s| s.extract())
            .map_err(|_| not_tensor())?;
        let dtype: String = ob
            .getattr("dtype")
            .and_then(|d| d.str())
            .map(|s| s.to_string())
            .map_err(|_| not_tensor())?;
        let device: String = ob
            .getattr("device")
            .and_then(|d| d.str())
            .map(|s| s.to_string())
            .map_err(|_| not_tensor())?;
        let contiguous: bool = ob
            .call_method0("is_contiguous")
            .and_then(|c| c.extract())
            .map_err(|_| not_tensor())?;
        let elem_size: usize = ob
            .call_method0("element_size")
            .and_then(|c| c.extract())
            .map_err(|_| not_tensor())?;
        Ok(Self {
            ptr,
            shape,
            dtype: dtype.trim_start_matches("torch.").to_string(),
            device,
            contiguous,
            elem_size,
            obj: ob.to_owned().unbind(),
            pinned: Cell::new(None),
        })
    }
}

impl TensorArg {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether this CPU tensor lives in page-locked memory (torch's `is_pinned()`).
    fn is_pinned(&self, py: Python<'_>) -> bool {
        if let Some(p) = self.pinned.get() {
            return p;
        }
        let p = self
            .obj
            .bind(py)
            .call_method0("is_pinned")
            .and_then(|r| r.extract())
            .unwrap_or(false);
        self.pinned.set(Some(p));
        p
    }

    /// A CPU tensor that a CUDA call reads or writes through unified addressing (a non-empty host
    /// pool in pinned memory).
    pub fn is_host_mapped(&self) -> bool {
        self.device == "cpu" && self.numel() > 0
    }

    /// The tensor lives where the call runs (see [`Cx`]) and is contiguous.
    fn check_place(&self, cx: &Cx<'_>, name: &str) -> PyResult<()> {
        self.check_device(cx, name)?;
        if !self.contiguous {
            return Err(py_err(
                cx.py,
                "ShapeError",
                format!("{name} is not contiguous; pass {name}.contiguous()"),
            ));
        }
        Ok(())
    }

    /// The tensor lives where the call runs (see [`Cx`]).
    fn check_device(&self, cx: &Cx<'_>, name: &str) -> PyResult<()> {
        let py = cx.py;
        let here = Place::parse(&self.device);
        match (cx.place, here) {
            (p, Some(h)) if p == h => {}
            (Place::Cuda(_), Some(Place::Cpu)) if cx.host_pool => {
                // An empty host pool (every sequence dense) is never touched: any memory will do.
                if self.numel() > 0 && !self.is_pinned(py) {
                    return Err(py_err(
                        py,
                        "DeviceError",
                        format!(
                            "{name} is in pageable CPU memory; the CUDA kernels read the host pool through unified \
                             addressing, so allocate it with pin_memory=True (torch.empty(..., pin_memory=True)) or \
                             pass {name}.pin_memory()"
                        ),
                    ));
                }
            }
            (Place::Cpu, _) => {
                return Err(py_err(
                    py,
                    "DeviceError",
                    format!(
                        "{name} is on {}; the CPU kernels need CPU tensors (move it with .cpu(), or pass every tensor \
                         on one CUDA device for the GPU kernels)",
                        self.device
                    ),
                ));
            }
            (Place::Cuda(n), _) => {
                let also = if cx.host_pool {
                    " (or, as the host pool, in pinned CPU memory)"
                } else {
                    ""
                };
                return Err(py_err(
                    py,
                    "DeviceError",
                    format!(
                        "{name} is on {} but the call runs on cuda:{n}; pass it on cuda:{n}{also}",
                        self.device
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A 2-D tensor read as rows that may be strided (a column slice of a wider tensor, like
    /// `qkv[:, :q_size]`): its rows are `stride` elements apart and each row is contiguous. Checks
    /// that it lives where the call runs. `stride` is `cols` for a contiguous tensor and for at
    /// most one row.
    ///
    /// # Errors
    /// `ShapeError` for a rank other than 2, a row that is not contiguous, or rows that overlap
    /// (a row stride below the row length, as `expand` makes).
    pub fn strided_rows(&self, cx: &Cx<'_>, name: &str) -> PyResult<RowsView> {
        self.check_device(cx, name)?;
        let py = cx.py;
        let [rows, cols] = self.shape[..] else {
            return Err(py_err(
                py,
                "ShapeError",
                format!(
                    "{name} must have 2 dimensions [n, cols], got shape {:?}",
                    self.shape
                ),
            ));
        };
        if self.contiguous || rows <= 1 {
            // A single row's stride is irrelevant (torch may report anything for it).
            let ok = self.contiguous || cols <= 1 || self.strides(py)?.get(1) == Some(&1);
            if ok {
                return Ok(RowsView {
                    rows,
                    cols,
                    stride: cols,
                });
            }
        }
        let strides = self.strides(py)?;
        let (row_stride, col_stride) = (strides[0], strides[1]);
        if col_stride != 1 && cols > 1 {
            return Err(py_err(
                py,
                "ShapeError",
                format!(
                    "{name} must have contiguous rows (stride 1 along its last dimension), got strides {strides:?}; \
                     pass {name}.contiguous()"
                ),
            ));
        }
        match usize::try_from(row_stride) {
            Ok(stride) if stride >= cols => Ok(RowsView { rows, cols, stride }),
            _ => Err(py_err(
                py,
                "ShapeError",
                format!(
                    "{name} has rows of {cols} elements only {row_stride} apart (they overlap); pass {name}.contiguous()"
                ),
            )),
        }
    }

    /// torch's `stride()`.
    fn strides(&self, py: Python<'_>) -> PyResult<Vec<isize>> {
        let strides: Vec<isize> = self
            .obj
            .bind(py)
            .call_method0("stride")
            .and_then(|s| s.extract())
            .map_err(|_| {
                py_err(
                    py,
                    "ShapeError",
                    "expected a torch.Tensor with strides (tensor.stride())".to_string(),
                )
            })?;
        if strides.len() != self.shape.len() {
            return Err(py_err(
                py,
                "ShapeError",
                format!("stride() {strides:?} does not match shape {:?}", self.shape),
            ));
        }
        Ok(strides)
    }

    /// The one check of a tensor argument: its element type (`elem`), that it lives where the
    /// call runs (see [`Cx`]) and is contiguous, its rank (`N`) and each dimension of `shape`
    /// other than [`ANY`]. Returns the shape, [`ANY`] dimensions as found, so that the sizes
    /// one tensor fixes can be required of the next.
    ///
    /// # Errors
    /// `DTypeError` "{name} must be int32, got int64; pass {name}.to(torch.int32)"; `DeviceError`
    /// (see [`Cx`]); `ShapeError` "{name} is not contiguous; pass {name}.contiguous()", "{name}
    /// must have 3 dimensions, got shape [..]" or "{name} must have shape [..], got [..]" (the
    /// expected shape with its [`ANY`] dimensions as found).
    pub fn check<const N: usize>(
        &self,
        cx: &Cx<'_>,
        name: &str,
        elem: Elem,
        shape: [usize; N],
    ) -> PyResult<[usize; N]> {
        if let Some((dtype, cast)) = elem.torch() {
            if self.dtype != dtype {
                return Err(py_err(
                    cx.py,
                    "DTypeError",
                    format!(
                        "{name} must be {dtype}, got {}; pass {name}{cast}",
                        self.dtype
                    ),
                ));
            }
        }
        self.check_place(cx, name)?;
        if self.shape.len() != N {
            return Err(py_err(
                cx.py,
                "ShapeError",
                format!(
                    "{name} must have {N} dimensions, got shape {:?}",
                    self.shape
                ),
            ));
        }
        let mut want = shape;
        for (w, &got) in want.iter_mut().zip(&self.shape) {
            if *w == ANY {
                *w = got;
            }
        }
        if self.shape[..] != want[..] {
            return Err(py_err(
                cx.py,
                "ShapeError",
                format!("{name} must have shape {want:?}, got {:?}", self.shape),
            ));
        }
        Ok(want)
    }

    /// The KV storage dtype of this tensor (float32, float16 or bfloat16).
    pub fn kv_dtype(&self, py: Python<'_>, name: &str) -> PyResult<DType> {
        match DType::parse(&self.dtype) {
            Some(d) if d.size_of() == self.elem_size => Ok(d),
            _ => Err(py_err(
                py,
                "DTypeError",
                format!(
                    "{name} has dtype {}; KV tensors must be float32, float16 or bfloat16",
                    self.dtype
                ),
            )),
        }
    }

    /// The bytes of a contiguous tensor, `[start, end)`.
    pub fn byte_range(&self) -> (usize, usize) {
        self.span_bytes(self.numel())
    }

    /// The bytes of the first `elems` elements from the data pointer, `[start, end)`.
    pub fn span_bytes(&self, elems: usize) -> (usize, usize) {
        (self.ptr, self.ptr + elems * self.elem_size)
    }

    /// # Safety
    /// As [`Self::slice`], for the `len` elements from the data pointer (a row-strided tensor's
    /// span, [`RowsView::span`]), which must all lie inside the tensor's storage.
    pub unsafe fn span_slice<T>(&self, len: usize) -> &[T] {
        if len == 0 || self.ptr == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr as *const T, len)
    }

    /// The `len` elements from the data pointer as a device buffer (a row-strided tensor's span).
    ///
    /// # Safety
    /// As [`Self::dev`], with the tensor's contiguity replaced by: the `len` elements lie inside
    /// its storage ([`RowsView::span`] of a view checked with [`Self::strided_rows`]).
    pub unsafe fn span_dev<T>(&self, len: usize) -> DevSlice<T> {
        if len == 0 {
            return DevSlice::empty();
        }
        DevSlice::from_raw(self.ptr as u64, len)
    }

    /// # Safety
    /// The tensor must be alive, on the CPU, contiguous, and of element type `T` (checked by the
    /// caller), and not written through another alias while the slice lives.
    pub unsafe fn slice<T>(&self) -> &[T] {
        let n = self.numel();
        if n == 0 || self.ptr == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr as *const T, n)
    }

    /// # Safety
    /// As [`Self::slice`], and no other live slice may overlap this tensor's memory
    /// (checked with [`check_disjoint`]).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<T>(&self) -> &mut [T] {
        let n = self.numel();
        if n == 0 || self.ptr == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr as *mut T, n)
    }

    /// # Safety
    /// As [`Self::slice`] for an int32 tensor.
    pub unsafe fn ints(&self) -> &[i32] {
        self.slice::<i32>()
    }

    /// # Safety
    /// As [`Self::slice_mut`] for an int32 tensor.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn ints_mut(&self) -> &mut [i32] {
        self.slice_mut::<i32>()
    }

    /// The tensor as a device buffer of its `numel()` elements.
    ///
    /// # Safety
    /// [`DevSlice::from_raw`]'s contract: the tensor is contiguous, of element type `T`, on the
    /// call's CUDA device or in pinned host memory mapped at the same address (checked by the
    /// caller with [`Self::check`] and `Gpu::check_uva`); it stays alive and is not touched
    /// unordered with the launch until the stream has run it (the caller's stream contract, as
    /// for any CUDA op of PyTorch); an output does not overlap any other argument (checked with
    /// [`check_disjoint`]).
    pub unsafe fn dev<T>(&self) -> DevSlice<T> {
        if self.numel() == 0 {
            return DevSlice::empty();
        }
        DevSlice::from_raw(self.ptr as u64, self.numel())
    }
}

/// A 2-D tensor as rows that may be strided ([`TensorArg::strided_rows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsView {
    pub rows: usize,
    pub cols: usize,
    /// Elements between the starts of two rows, `>= cols`.
    pub stride: usize,
}

impl RowsView {
    /// Elements from the first row's start to the last row's end (0 for no row).
    pub fn span(&self) -> usize {
        match self.rows {
            0 => 0,
            n => (n - 1) * self.stride + self.cols,
        }
    }
}

/// Reject calls where two of the named byte ranges `[start, end)` overlap (at least one of them
/// is written).
pub fn check_disjoint_bytes(py: Python<'_>, named: &[(&str, (usize, usize))]) -> PyResult<()> {
    for (i, (na, (a0, a1))) in named.iter().enumerate() {
        for (nb, (b0, b1)) in &named[i + 1..] {
            if a0 < b1 && b0 < a1 {
                return Err(py_err(
                    py,
                    "InvalidArgumentError",
                    format!(
                        "{na} and {nb} share memory; pass separate tensors (clone one of them)"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Reject calls where two of the named tensors share memory (at least one of them is written).
/// Device addresses and host addresses share one space under unified addressing, so the test
/// holds for CUDA calls too.
pub fn check_disjoint(py: Python<'_>, named: &[(&str, &TensorArg)]) -> PyResult<()> {
    let ranges: Vec<_> = named.iter().map(|(n, t)| (*n, t.byte_range())).collect();
    check_disjoint_bytes(py, &ranges)
}
