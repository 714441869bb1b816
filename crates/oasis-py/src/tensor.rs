//! Tensors as they cross the FFI boundary: a pointer, a shape, a dtype and a device, read from
//! any object with torch's tensor attributes. Nothing here copies data.

use oasis_core::DType;
use pyo3::prelude::*;

use crate::errors::py_err;

pub struct TensorArg {
    pub ptr: usize,
    pub shape: Vec<usize>,
    /// torch's name without the `torch.` prefix: float32, bfloat16, int32, ...
    pub dtype: String,
    pub device: String,
    pub contiguous: bool,
    pub elem_size: usize,
}

impl<'a, 'py> FromPyObject<'a, 'py> for TensorArg {
    type Error = PyErr;

    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let py = ob.py();
        let not_tensor = || {
            let ty = ob.get_type().name().map(|n| n.to_string()).unwrap_or_default();
            py_err(py, "DTypeError", format!("expected a torch.Tensor, got {ty}; pass a tensor (torch.as_tensor(x))"))
        };
        let ptr: usize = ob.call_method0("data_ptr").and_then(|p| p.extract()).map_err(|_| not_tensor())?;
        let shape: Vec<usize> = ob.getattr("shape").and_then(|s| s.extract()).map_err(|_| not_tensor())?;
        let dtype: String = ob.getattr("dtype").and_then(|d| d.str()).map(|s| s.to_string()).map_err(|_| not_tensor())?;
        let device: String = ob.getattr("device").and_then(|d| d.str()).map(|s| s.to_string()).map_err(|_| not_tensor())?;
        let contiguous: bool = ob.call_method0("is_contiguous").and_then(|c| c.extract()).map_err(|_| not_tensor())?;
        let elem_size: usize = ob.call_method0("element_size").and_then(|c| c.extract()).map_err(|_| not_tensor())?;
        Ok(Self { ptr, shape, dtype: dtype.trim_start_matches("torch.").to_string(), device, contiguous, elem_size })
    }
}

impl TensorArg {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn check_cpu(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        if self.device != "cpu" {
            return Err(py_err(
                py,
                "DeviceError",
                format!("{name} is on {}; the CPU kernels need CPU tensors (move it with .cpu(), or use the GPU backend)", self.device),
            ));
        }
        if !self.contiguous {
            return Err(py_err(py, "ShapeError", format!("{name} is not contiguous; pass {name}.contiguous()")));
        }
        Ok(())
    }

    /// Size of dimension `axis`, checking the rank is `ndim`, the tensor is contiguous and on the CPU.
    pub fn dim(&self, py: Python<'_>, name: &str, ndim: usize, axis: usize) -> PyResult<usize> {
        self.check_cpu(py, name)?;
        if self.shape.len() != ndim {
            return Err(py_err(py, "ShapeError", format!("{name} must have {ndim} dimensions, got shape {:?}", self.shape)));
        }
        Ok(self.shape[axis])
    }

    pub fn expect_shape(&self, py: Python<'_>, name: &str, shape: &[usize]) -> PyResult<()> {
        self.check_cpu(py, name)?;
        if self.shape != shape {
            return Err(py_err(py, "ShapeError", format!("{name} must have shape {shape:?}, got {:?}", self.shape)));
        }
        Ok(())
    }

    pub fn expect_i32(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        if self.dtype != "int32" {
            return Err(py_err(py, "DTypeError", format!("{name} must be int32, got {}; pass {name}.to(torch.int32)", self.dtype)));
        }
        Ok(())
    }

    pub fn expect_f32(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        if self.dtype != "float32" {
            return Err(py_err(py, "DTypeError", format!("{name} must be float32, got {}; pass {name}.float()", self.dtype)));
        }
        Ok(())
    }

    /// The KV storage dtype of this tensor (float32, float16 or bfloat16).
    pub fn kv_dtype(&self, py: Python<'_>, name: &str) -> PyResult<DType> {
        match DType::parse(&self.dtype) {
            Some(d) if d.size_of() == self.elem_size => Ok(d),
            _ => Err(py_err(
                py,
                "DTypeError",
                format!("{name} has dtype {}; KV tensors must be float32, float16 or bfloat16", self.dtype),
            )),
        }
    }

    fn byte_range(&self) -> (usize, usize) {
        (self.ptr, self.ptr + self.numel() * self.elem_size)
    }

    /// # Safety
    /// The tensor must be alive, on the CPU, contiguous, and of element type `T` (checked by the
    /// caller), and not written through another alias while the slice lives.
    pub unsafe fn slice<'s, T>(&'s self) -> &'s [T] {
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
    pub unsafe fn slice_mut<'s, T>(&'s self) -> &'s mut [T] {
        let n = self.numel();
        if n == 0 || self.ptr == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr as *mut T, n)
    }

    /// # Safety
    /// As [`Self::slice`] for an int32 tensor.
    pub unsafe fn ints<'s>(&'s self) -> &'s [i32] {
        self.slice::<i32>()
    }

    /// # Safety
    /// As [`Self::slice_mut`] for an int32 tensor.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn ints_mut<'s>(&'s self) -> &'s mut [i32] {
        self.slice_mut::<i32>()
    }
}

/// Reject calls where two of the named tensors share memory (at least one of them is written).
pub fn check_disjoint(py: Python<'_>, named: &[(&str, &TensorArg)]) -> PyResult<()> {
    for (i, (na, a)) in named.iter().enumerate() {
        for (nb, b) in &named[i + 1..] {
            let (a0, a1) = a.byte_range();
            let (b0, b1) = b.byte_range();
            if a0 < b1 && b0 < a1 {
                return Err(py_err(
                    py,
                    "InvalidArgumentError",
                    format!("{na} and {nb} share memory; pass separate tensors (clone one of them)"),
                ));
            }
        }
    }
    Ok(())
}
