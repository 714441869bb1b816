//! The validation layer of the kernel bindings: the checks every family shares (dtype agreement,
//! pool shapes, block tables, output aliasing), on top of the per-tensor checks of
//! [`crate::tensor`]. Messages name the tensor and the expected shape, and say how to fix the call.

use oasis_core::{DType, KvGeometry};
use pyo3::prelude::*;

use crate::errors::py_err;
use crate::tensor::{check_disjoint, check_disjoint_bytes, Cx, Elem, RowsView, TensorArg, ANY};

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

/// [`TensorArg::check`] of tensors that share one shape: the first against `shape` (its [`ANY`]
/// dimensions as found), each other one against the first's. Returns the shape.
pub(crate) fn check_all<const N: usize>(
    cx: &Cx<'_>,
    named: &[(&str, &TensorArg)],
    elem: Elem,
    shape: [usize; N],
) -> PyResult<[usize; N]> {
    let (first_name, first) = named[0];
    let shape = first.check(cx, first_name, elem, shape)?;
    for (name, t) in &named[1..] {
        t.check(cx, name, elem, shape)?;
    }
    Ok(shape)
}

/// Rows of the K/V pool tensors of `pool` (the first gives the count), all shaped
/// `[n, num_kv_heads, block_size, head_dim]`: GPU pages, or host blocks under [`Cx::host`].
pub(crate) fn pool_rows(
    cx: &Cx<'_>,
    g: &KvGeometry,
    pool: &[(&str, &TensorArg)],
) -> PyResult<usize> {
    let page = [ANY, g.num_kv_heads, g.block_size, g.head_dim];
    Ok(check_all(cx, pool, Elem::Any, page)?[0])
}

/// `summaries [nb, num_kv_heads, 2, head_dim]`; returns `nb`.
pub(crate) fn summary_rows(cx: &Cx<'_>, g: &KvGeometry, summaries: &TensorArg) -> PyResult<usize> {
    let [nb, ..] = summaries.check(
        cx,
        "summaries",
        Elem::Any,
        [ANY, g.num_kv_heads, 2, g.head_dim],
    )?;
    Ok(nb)
}

/// The shapes shared by the kernels that read host K rows into per-block summary data:
/// `host` the host pool, `summaries [nb, num_kv_heads, 2, head_dim]`, and int32 `tables`
/// (`block_ids` first) of one length. Returns `nb`.
pub(crate) fn check_block_tables(
    cx: &Cx<'_>,
    g: &KvGeometry,
    host: &[(&str, &TensorArg)],
    summaries: &TensorArg,
    tables: &[(&str, &TensorArg)],
) -> PyResult<usize> {
    pool_rows(&cx.host(), g, host)?;
    let nb = summary_rows(cx, g, summaries)?;
    check_all(cx, tables, Elem::I32, [ANY])?;
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

/// Sequences of a CSR `blk_indptr [num_seqs + 1]` int32 (0 for an empty one, which the kernels
/// then refuse).
pub(crate) fn indptr_rows(cx: &Cx<'_>, blk_indptr: &TensorArg) -> PyResult<usize> {
    let [n] = blk_indptr.check(cx, "blk_indptr", Elem::I32, [ANY])?;
    Ok(n.saturating_sub(1))
}

/// The last dimension of an optional int32 `[num_seqs, num_kv_heads, m]` per-head list (forced
/// blocks, an index map); 0 without one.
pub(crate) fn per_head(
    cx: &Cx<'_>,
    name: &str,
    t: Option<&TensorArg>,
    num_seqs: usize,
    num_kv_heads: usize,
) -> PyResult<usize> {
    match t {
        None => Ok(0),
        Some(t) => Ok(t.check(cx, name, Elem::I32, [num_seqs, num_kv_heads, ANY])?[2]),
    }
}
