//! The decoder's elementwise bindings: `rms_norm` (with the fused residual add), `qk_norm_rope`
//! (per-head q/k RMSNorm, RoPE and the V copy from the fused QKV projection) and `silu_mul` (the
//! MLP's SwiGLU activation from the fused gate/up projection).

use oasis_core::kernels::{self, HeadLayout, Positions, QkNorm, Residual};
use oasis_cuda::ops::{PositionsDev, ResidualDev};
use pyo3::prelude::*;

use crate::call::{entry, guarded, on_gpu, with_dtype};
use crate::check::{check_all, check_outputs_bytes, kv_dtype, rows_of};
use crate::errors::{core_err, py_err};
use crate::tensor::{Cx, Elem, Place, TensorArg, ANY};

#[pyfunction]
#[pyo3(signature = (x, weight, eps, out, residual = None, residual_out = None, *, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Hugging Face RMSNorm of rows, with an optional fused residual add.
///
/// x [n, hidden] (rows may be strided: each row contiguous, rows at least hidden apart); weight
/// [hidden]; out [n, hidden] contiguous; all in one dtype (float32, float16 or bfloat16). Computes
/// xf = float32(x); r = 1 / sqrt(sum(xf * xf) / hidden + eps); out = dtype(float32(weight) *
/// float32(dtype(xf * r))), each operation rounded as torch rounds it (the sum of squares in the
/// kernels' fixed order, identical on the CPU and the GPU).
///
/// With residual and residual_out (both [n, hidden] contiguous, pass both or neither): h =
/// dtype(float32(x) + float32(residual)) (torch's `residual + x`) is written to residual_out and
/// normalised instead of x. Aliasing: residual_out may be residual itself (the same tensor: an
/// in-place update) but may not overlap it otherwise; out and residual_out may not overlap any
/// other argument.
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (the raw cudaStream_t of a live stream of
/// cuda:N; 0 = the legacy default stream), returns at once. `stream` is ignored on the CPU.
fn rms_norm(
    py: Python<'_>,
    x: TensorArg,
    weight: TensorArg,
    eps: f32,
    out: TensorArg,
    residual: Option<TensorArg>,
    residual_out: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "rms_norm", || {
        let mut all = vec![("x", &x), ("weight", &weight), ("out", &out)];
        let res = match (&residual, &residual_out) {
            (Some(r), Some(ro)) => {
                all.push(("residual", r));
                all.push(("residual_out", ro));
                Some((r, ro))
            }
            (None, None) => None,
            _ => {
                return Err(py_err(
                    py,
                    "InvalidArgumentError",
                    "pass residual and residual_out together (residual_out=residual updates it in place), or neither"
                        .into(),
                ))
            }
        };
        let cx = Cx::new(py, &all, &[])?;
        let [hidden] = weight.check(&cx, "weight", Elem::Any, [ANY])?;
        let xv = rows_of(&cx, &x, "x", hidden, "hidden = len(weight)")?;
        let n = xv.rows;
        out.check(&cx, "out", Elem::Any, [n, hidden])?;
        let named: Vec<_> = all.iter().copied().filter(|(nm, _)| *nm != "x").collect();
        let dt = kv_dtype(py, &[&[("x", &x)][..], &named].concat())?;
        let x_bytes = ("x", x.span_bytes(xv.span()));
        let w_bytes = ("weight", weight.byte_range());
        let out_bytes = ("out", out.byte_range());
        let in_place = match res {
            Some((r, ro)) => {
                let residual = [("residual", r), ("residual_out", ro)];
                check_all(&cx, &residual, Elem::Any, [n, hidden])?;
                let in_place = r.ptr == ro.ptr;
                let (rb, rob) = (
                    ("residual", r.byte_range()),
                    ("residual_out", ro.byte_range()),
                );
                if in_place {
                    check_outputs_bytes(py, &[out_bytes, rob], &[x_bytes, w_bytes])?;
                } else {
                    check_outputs_bytes(py, &[out_bytes, rob], &[x_bytes, w_bytes, rb])?;
                }
                in_place
            }
            None => {
                check_outputs_bytes(py, &[out_bytes], &[x_bytes, w_bytes])?;
                false
            }
        };
        let span = xv.span();
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: shapes, dtypes and CPU residence checked above; x's span lies in its
                // storage (strided_rows); out and residual_out are disjoint from every other
                // argument, except residual_out == residual, passed as one mutable slice.
                let (xs, w, o) = unsafe { (x.span_slice::<T>(span), weight.slice::<T>(), out.slice_mut::<T>()) };
                let residual = res.map(|(r, ro)| {
                    if in_place {
                        Residual::InPlace(unsafe { ro.slice_mut::<T>() })
                    } else {
                        Residual::Separate { residual: unsafe { r.slice::<T>() }, residual_out: unsafe { ro.slice_mut::<T>() } }
                    }
                });
                guarded(py, "rms_norm", || kernels::rms_norm::<T>(xs, xv.stride, w, eps, residual, o))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev / span_dev) checked above on cuda:dev; outputs disjoint
                // from every other argument but residual_out == residual, which the kernel allows.
                let (xs, w, o) = unsafe { (x.span_dev::<T>(span), weight.dev::<T>(), out.dev::<T>()) };
                let residual = res.map(|(r, ro)| ResidualDev { residual: unsafe { r.dev::<T>() }, residual_out: unsafe { ro.dev::<T>() } });
                on_gpu(py, "rms_norm", dev, stream, &[], move |gpu, st| gpu.rms_norm::<T>(xs, xv.stride, w, eps, residual, o, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (qkv, q_size, kv_size, num_heads, num_kv_heads, head_dim, positions, inv_freq, q_norm, k_norm, eps, q_out, k_out, v_out, *, kv_groups = 1, rope_scale = 1.0, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// The attention prologue of a decoder layer from its fused QKV projection: per-head q/k RMSNorm
/// (Qwen3; skipped when q_norm and k_norm are None), rotate-half RoPE, and the V copy.
///
/// qkv [n, q_size + 2 * kv_size] (rows may be strided: each row contiguous) holds the query heads,
/// then the key heads, then the value heads of each token (q_size = num_heads * head_dim, kv_size =
/// num_kv_heads * head_dim, head_dim even); positions [n] int64 or int32 (read by the kernel);
/// inv_freq [head_dim / 2] float32; q_norm, k_norm [head_dim] or None (both or neither); outputs
/// q_out [n, num_heads, head_dim], k_out and v_out [n, num_kv_heads, head_dim], contiguous and
/// disjoint from every other argument. qkv, the norms and the outputs share one dtype.
///
/// Numerics are transformers' (rms_norm, then rope_cos_sin and apply_rope of
/// oasiskv.models.transformer): cos and sin of float32(pos) * inv_freq rounded to float32, times
/// rope_scale in float32 (YaRN's attention factor; 1.0 otherwise), then rounded to the dtype, and out = dtype(dtype(x * cos) + dtype(rotate_half(x) * sin)). The CPU and the GPU
/// compute the same bits.
///
/// kv_groups = G > 1 (dividing n): the rows are n / G groups of G (row t = s * G + r), and row t's
/// key and value heads go to row r * (n / G) + s of k_out and v_out; q_out keeps row t.
///
/// CUDA: every tensor on one cuda:N, queued on `stream`, returns at once; `stream` is ignored on
/// the CPU.
fn qk_norm_rope(
    py: Python<'_>,
    qkv: TensorArg,
    q_size: usize,
    kv_size: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    positions: TensorArg,
    inv_freq: TensorArg,
    q_norm: Option<TensorArg>,
    k_norm: Option<TensorArg>,
    eps: f32,
    q_out: TensorArg,
    k_out: TensorArg,
    v_out: TensorArg,
    kv_groups: usize,
    rope_scale: f32,
    stream: u64,
) -> PyResult<()> {
    entry(py, "qk_norm_rope", || {
        if !(rope_scale.is_finite() && rope_scale > 0.0) {
            return Err(py_err(
                py,
                "ConfigError",
                format!("rope_scale must be a finite number > 0 (YaRN's attention factor), got {rope_scale}"),
            ));
        }
        let layout = HeadLayout {
            num_heads,
            num_kv_heads,
            head_dim,
        };
        layout.validate().map_err(|e| core_err(py, e))?;
        if q_size != layout.q_size() || kv_size != layout.kv_size() {
            return Err(py_err(
                py,
                "InvalidArgumentError",
                format!(
                    "q_size = {q_size} and kv_size = {kv_size} must be num_heads * head_dim = {} and \
                     num_kv_heads * head_dim = {}; pass the sizes of the model's QKV projection",
                    layout.q_size(),
                    layout.kv_size()
                ),
            ));
        }
        let mut all = vec![
            ("qkv", &qkv),
            ("positions", &positions),
            ("inv_freq", &inv_freq),
            ("q_out", &q_out),
            ("k_out", &k_out),
            ("v_out", &v_out),
        ];
        let norm = match (&q_norm, &k_norm) {
            (Some(qn), Some(kn)) => {
                all.push(("q_norm", qn));
                all.push(("k_norm", kn));
                Some((qn, kn))
            }
            (None, None) => None,
            _ => {
                return Err(py_err(
                    py,
                    "InvalidArgumentError",
                    "pass q_norm and k_norm together (Qwen3), or neither (Llama)".into(),
                ))
            }
        };
        let cx = Cx::new(py, &all, &[])?;
        let qv = rows_of(&cx, &qkv, "qkv", layout.width(), "q_size + 2 * kv_size")?;
        let n = qv.rows;
        let pos64 = match positions.dtype.as_str() {
            "int64" => true,
            "int32" => false,
            other => {
                return Err(py_err(
                    py,
                    "DTypeError",
                    format!("positions must be int64 or int32, got {other}; pass positions.long()"),
                ))
            }
        };
        positions.check(&cx, "positions", Elem::Any, [n])?;
        inv_freq.check(&cx, "inv_freq", Elem::F32, [head_dim / 2])?;
        q_out.check(&cx, "q_out", Elem::Any, [n, num_heads, head_dim])?;
        let kv_out = [("k_out", &k_out), ("v_out", &v_out)];
        check_all(&cx, &kv_out, Elem::Any, [n, num_kv_heads, head_dim])?;
        let mut typed = vec![
            ("qkv", &qkv),
            ("q_out", &q_out),
            ("k_out", &k_out),
            ("v_out", &v_out),
        ];
        let mut inputs = vec![
            ("qkv", qkv.span_bytes(qv.span())),
            ("positions", positions.byte_range()),
            ("inv_freq", inv_freq.byte_range()),
        ];
        if let Some((qn, kn)) = norm {
            check_all(
                &cx,
                &[("q_norm", qn), ("k_norm", kn)],
                Elem::Any,
                [head_dim],
            )?;
            typed.push(("q_norm", qn));
            typed.push(("k_norm", kn));
            inputs.push(("q_norm", qn.byte_range()));
            inputs.push(("k_norm", kn.byte_range()));
        }
        let dt = kv_dtype(py, &typed)?;
        check_outputs_bytes(
            py,
            &[
                ("q_out", q_out.byte_range()),
                ("k_out", k_out.byte_range()),
                ("v_out", v_out.byte_range()),
            ],
            &inputs,
        )?;
        let span = qv.span();
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: shapes, dtypes and CPU residence checked above; qkv's span lies in its
                // storage (strided_rows); the outputs are disjoint from each other and the inputs.
                let (x, inv, qo, ko, vo) = unsafe { (qkv.span_slice::<T>(span), inv_freq.slice::<f32>(), q_out.slice_mut::<T>(), k_out.slice_mut::<T>(), v_out.slice_mut::<T>()) };
                let pos = if pos64 { Positions::I64(unsafe { positions.slice::<i64>() }) } else { Positions::I32(unsafe { positions.ints() }) };
                let weights = norm.map(|(qn, kn)| unsafe { (qn.slice::<T>(), kn.slice::<T>()) });
                guarded(py, "qk_norm_rope", || {
                    let qk = weights.map(|(q_weight, k_weight)| QkNorm { q_weight, k_weight, eps });
                    kernels::qk_norm_rope::<T>(&layout, x, qv.stride, pos, inv, rope_scale, qk.as_ref(), qo, ko, vo, kv_groups)
                })
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev / span_dev) checked above on cuda:dev; outputs disjoint
                // from every other argument.
                let (x, inv, qo, ko, vo) = unsafe { (qkv.span_dev::<T>(span), inv_freq.dev::<f32>(), q_out.dev::<T>(), k_out.dev::<T>(), v_out.dev::<T>()) };
                let pos = if pos64 { PositionsDev::I64(unsafe { positions.dev::<i64>() }) } else { PositionsDev::I32(unsafe { positions.dev::<i32>() }) };
                let weights = norm.map(|(qn, kn)| unsafe { (qn.dev::<T>(), kn.dev::<T>()) });
                on_gpu(py, "qk_norm_rope", dev, stream, &[], move |gpu, st| gpu.qk_norm_rope::<T>(&layout, x, qv.stride, pos, inv, rope_scale, weights, eps, qo, ko, vo, kv_groups, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (gu, out, *, stream = 0))]
/// The MLP's SwiGLU activation: out [n, inter] = silu(gate) * up over gu [n, 2 * inter] (gate
/// columns first, as the fused gate/up projection stacks them), both contiguous, in one dtype
/// (float32, float16 or bfloat16). Computes s = dtype(g / (1 + exp(-g))) in float32 (exp
/// correctly rounded to float32), then out = dtype(float32(s) * float32(u)): torch's
/// `F.silu(g) * u` up to exp's last bit, identical on the CPU and the GPU. out may not overlap gu.
///
/// CUDA: both on one cuda:N, queued on `stream`, returns at once; `stream` is ignored on the CPU.
fn silu_mul(py: Python<'_>, gu: TensorArg, out: TensorArg, stream: u64) -> PyResult<()> {
    entry(py, "silu_mul", || {
        let all = [("gu", &gu), ("out", &out)];
        let cx = Cx::new(py, &all, &[])?;
        let [n, inter] = out.check(&cx, "out", Elem::Any, [ANY, ANY])?;
        let width = inter
            .checked_mul(2)
            .ok_or_else(|| py_err(py, "ShapeError", "out's columns overflow".into()))?;
        gu.check(&cx, "gu", Elem::Any, [n, width])?;
        let dt = kv_dtype(py, &all)?;
        check_outputs_bytes(py, &[("out", out.byte_range())], &[("gu", gu.byte_range())])?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: shapes, dtypes and CPU residence checked above; out is disjoint from gu.
                let (g, o) = unsafe { (gu.slice::<T>(), out.slice_mut::<T>()) };
                guarded(py, "silu_mul", || kernels::silu_mul::<T>(g, inter, o))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above on cuda:dev; out is disjoint from gu.
                let (g, o) = unsafe { (gu.dev::<T>(), out.dev::<T>()) };
                on_gpu(py, "silu_mul", dev, stream, &[], move |gpu, st| gpu.silu_mul::<T>(g, inter, o, st))
            }),
        }
    })
}

/// Add this module's functions to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(qk_norm_rope, m)?)?;
    m.add_function(wrap_pyfunction!(silu_mul, m)?)?;
    Ok(())
}
