//! The validation layer of the kernel bindings: the checks every family shares (dtype agreement,
//! pool shapes, block tables, output aliasing), on top of the per-tensor checks of
//! [`crate::tensor`]. Messages name the tensor and the expected shape, and say how to fix the call.

use oasis_core::{DType, KvGeometry};
use pyo3::prelude::*;

use crate::errors::py_err;
use crate::tensor::{check_disjoint, check_disjoint_bytes, Cx, RowsView, TensorArg};

/// Storage dtype shared by every KV-like tensor of one call.
pub(crate) fn kv_dtype(py: Python<'_>, named: &[(&str, &TensorArg)]) -> PyResult<DType> {
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
pub(crate) fn pool_rows(
    cx: &Cx<'_>,
    g: &KvGeometry,
    pool: &[(&str, &TensorArg)],
) -> PyResult<usize> {
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
pub(crate) fn check_block_tables(
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
pub(crate) fn check_outputs(
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

/// Every output's bytes are disjoint from every other argument's (outputs and inputs), given as
/// byte ranges (row-strided inputs take their span, not their element count).
pub(crate) fn check_outputs_bytes(
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
pub(crate) fn rows_of(
    cx: &Cx<'_>,
    t: &TensorArg,
    name: &str,
    cols: usize,
    what: &str,
) -> PyResult<RowsView> {
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
