//! Decode attention bindings: `decode_attention` over paged, head-wise working sets, and the
//! split-KV helpers (`decode_attn_workspace_len`, `plan_num_splits`).

use oasis_core::kernels::{self, ExtraKv, KvTier, PagedKv, PagedKv8};
use oasis_core::{DType, KvGeometry, OasisError};
use oasis_cuda::ops::{
    decode_attn_workspace_len as ws_len, plan_num_splits as plan_splits, MAX_SPLITS,
};
use oasis_cuda::{CudaError, DevSlice, ExtraKvDev, KvTierDev, PagedKv8Dev, PagedKvDev, SplitKv};
use pyo3::prelude::*;

use crate::call::{entry, guarded, on_gpu, with_dtype};
use crate::check::{check_all, check_outputs, kv_dtype};
use crate::errors::py_err;
use crate::runtime::PyGeometry;
use crate::tensor::{Cx, Elem, Place, TensorArg, ANY};
use crate::tier::{Tier, GPU_TIER};

#[pyfunction]
#[pyo3(signature = (geo, q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len, page_map, extra_k, extra_v, sm_scale, out, *, num_splits = 0, max_pages_per_seq = 0, workspace = None, k_scales = None, v_scales = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Decode attention for stacked query rows over paged, head-wise working sets.
///
/// q, out [num_seqs, num_rows, num_qo_heads, head_dim]; k_pages, v_pages [num_pages,
/// num_kv_heads, block_size, head_dim]; kv_indptr [num_seqs + 1], kv_indices [nnz],
/// kv_last_page_len [num_seqs] int32 (flashinfer's CSR); page_map [num_pages, num_kv_heads] int32
/// or None (entries < 0 are skipped); extra_k, extra_v [num_seqs, num_kv_heads, head_dim] or None
/// (seen by rows >= 1 only). Pages in fp8_e4m3 (uint8 codes) come with k_scales, v_scales
/// [num_pages, num_kv_heads] float32: each value is code x scale (`oasis_core::kernels::kv8`);
/// q, out, extra_k and extra_v stay float.
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (the raw cudaStream_t of a live stream of
/// cuda:N; 0 = the legacy default stream), returns at once. `num_splits` cuts each sequence's
/// pages into that many parts merged by a second kernel (split-KV); 0 plans it from the SM count
/// and `max_pages_per_seq` (a bound on any sequence's page count; 0 = len(kv_indices)). More than
/// one split needs `workspace`, a float32 tensor on cuda:N of at least
/// decode_attn_workspace_len(num_seqs, num_rows, num_qo_heads, head_dim, num_splits) elements.
/// Table entries are not validated on the GPU: out-of-range page ids are skipped and a malformed
/// kv_indptr row reads as a sequence with no pages. NaN in q, K or V gives NaN in the outputs
/// that see it (CPU and GPU). The CPU ignores num_splits, max_pages_per_seq, workspace and
/// stream.
fn decode_attention(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    k_pages: TensorArg,
    v_pages: TensorArg,
    kv_indptr: TensorArg,
    kv_indices: TensorArg,
    kv_last_page_len: TensorArg,
    page_map: Option<TensorArg>,
    extra_k: Option<TensorArg>,
    extra_v: Option<TensorArg>,
    sm_scale: f32,
    out: TensorArg,
    num_splits: usize,
    max_pages_per_seq: usize,
    workspace: Option<TensorArg>,
    k_scales: Option<TensorArg>,
    v_scales: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "decode_attention", || {
        let g = geo.inner;
        let pages = Tier::new(
            py,
            GPU_TIER,
            &k_pages,
            &v_pages,
            k_scales.as_ref(),
            v_scales.as_ref(),
        )?;
        let mut all = vec![
            ("q", &q),
            ("k_pages", &k_pages),
            ("v_pages", &v_pages),
            ("kv_indptr", &kv_indptr),
            ("kv_indices", &kv_indices),
            ("kv_last_page_len", &kv_last_page_len),
        ];
        for (name, t) in [
            ("page_map", &page_map),
            ("extra_k", &extra_k),
            ("extra_v", &extra_v),
            ("workspace", &workspace),
        ] {
            if let Some(t) = t {
                all.push((name, t));
            }
        }
        all.extend(pages.named().into_iter().skip(2)); // the scales, with fp8 pages
        all.push(("out", &out));
        let cx = Cx::new(py, &all, &[])?;
        let qo = [("q", &q), ("out", &out)];
        let [ns, rows, ..] =
            check_all(&cx, &qo, Elem::Any, [ANY, ANY, g.num_qo_heads, g.head_dim])?;
        let np = pages.rows(&cx, &g)?;
        kv_indptr.check(&cx, "kv_indptr", Elem::I32, [ns + 1])?;
        kv_indices.check(&cx, "kv_indices", Elem::I32, [ANY])?;
        kv_last_page_len.check(&cx, "kv_last_page_len", Elem::I32, [ns])?;
        if let Some(pm) = &page_map {
            pm.check(&cx, "page_map", Elem::I32, [np, g.num_kv_heads])?;
        }
        let mut named = [&[("q", &q), ("out", &out)][..], &pages.float_pages()].concat();
        let extra = match (&extra_k, &extra_v) {
            (Some(ek), Some(ev)) => {
                let extra = [("extra_k", ek), ("extra_v", ev)];
                check_all(&cx, &extra, Elem::Any, [ns, g.num_kv_heads, g.head_dim])?;
                named.push(("extra_k", ek));
                named.push(("extra_v", ev));
                Some((ek, ev))
            }
            (None, None) => None,
            _ => {
                return Err(py_err(
                    py,
                    "InvalidArgumentError",
                    "pass extra_k and extra_v together, or neither".into(),
                ))
            }
        };
        let dt = kv_dtype(py, &named)?;
        let inputs: Vec<_> = all
            .iter()
            .copied()
            .filter(|(n, _)| *n != "out" && *n != "workspace")
            .collect();
        check_outputs(py, &[("out", &out)], &inputs)?;
        let tables = Tables {
            kv_indptr: &kv_indptr,
            kv_indices: &kv_indices,
            kv_last_page_len: &kv_last_page_len,
            page_map: page_map.as_ref(),
        };
        let call = Call {
            g,
            dt,
            pages: &pages,
            q: &q,
            rows,
            tables,
            extra,
            sm_scale,
            out: &out,
        };
        match cx.place {
            Place::Cpu => call.cpu(py),
            Place::Cuda(dev) => {
                let ws = match &workspace {
                    Some(w) => {
                        w.check(&cx, "workspace", Elem::F32, [ANY])?;
                        let others: Vec<_> = all
                            .iter()
                            .copied()
                            .filter(|(n, _)| *n != "workspace")
                            .collect();
                        check_outputs(py, &[("workspace", w)], &others)?;
                        // SAFETY: float32, contiguous, on cuda:dev, disjoint from every other argument.
                        Some(unsafe { w.dev::<f32>() })
                    }
                    None => None,
                };
                let max_pages = if max_pages_per_seq > 0 {
                    max_pages_per_seq
                } else {
                    kv_indices.numel()
                };
                let launch = Launch {
                    dev,
                    stream,
                    num_splits,
                    max_pages,
                    ns,
                    workspace: ws,
                };
                call.cuda(py, launch)
            }
        }
    })
}

/// The page tables of a decode_attention call (flashinfer's CSR and the head-wise page map).
struct Tables<'a> {
    kv_indptr: &'a TensorArg,
    kv_indices: &'a TensorArg,
    kv_last_page_len: &'a TensorArg,
    page_map: Option<&'a TensorArg>,
}

/// A decode_attention call whose arguments `decode_attention` has checked (shapes, dtypes,
/// residence on one place, outputs disjoint from inputs): what the CPU twin and the CUDA launch read.
struct Call<'a> {
    g: KvGeometry,
    dt: DType,
    pages: &'a Tier<'a>,
    q: &'a TensorArg,
    rows: usize,
    tables: Tables<'a>,
    extra: Option<(&'a TensorArg, &'a TensorArg)>,
    sm_scale: f32,
    out: &'a TensorArg,
}

/// The CUDA side of a call: where and how it launches.
struct Launch {
    dev: i32,
    stream: u64,
    num_splits: usize,
    max_pages: usize,
    ns: usize,
    workspace: Option<DevSlice<f32>>,
}

impl Call<'_> {
    /// The CPU twin (`oasis_core::kernels`), over float or fp8 pages.
    fn cpu(&self, py: Python<'_>) -> PyResult<()> {
        let (g, rows, sm_scale, t) = (&self.g, self.rows, self.sm_scale, &self.tables);
        // SAFETY (every slice below): shapes, dtypes and CPU residence were checked by
        // decode_attention; `out` is disjoint from every input.
        let (indptr, indices, last) = unsafe {
            (
                t.kv_indptr.ints(),
                t.kv_indices.ints(),
                t.kv_last_page_len.ints(),
            )
        };
        let page_map = t.page_map.map(|p| unsafe { p.ints() });
        with_dtype!(self.dt, T => {
            let (qs, o) = unsafe { (self.q.slice::<T>(), self.out.slice_mut::<T>()) };
            let extra = self.extra.map(|(ek, ev)| ExtraKv { k: unsafe { ek.slice::<T>() }, v: unsafe { ev.slice::<T>() } });
            match unsafe { self.pages.read::<T>() } {
                KvTier::Kv8(p8) => {
                    let kv = PagedKv8 { pages: p8, kv_indptr: indptr, kv_indices: indices, kv_last_page_len: last, page_map };
                    guarded(py, "decode_attention", || kernels::decode_attention_kv8::<T>(g, qs, rows, &kv, extra.as_ref(), sm_scale, o))
                }
                KvTier::Elem { k, v } => {
                    let kv = PagedKv { k_pages: k, v_pages: v, kv_indptr: indptr, kv_indices: indices, kv_last_page_len: last, page_map };
                    guarded(py, "decode_attention", || kernels::decode_attention::<T>(g, qs, rows, &kv, extra.as_ref(), sm_scale, o))
                }
            }
        })
    }

    /// The CUDA launch on `l.stream` of cuda:`l.dev`, split-KV as planned (returns at once).
    fn cuda(&self, py: Python<'_>, l: Launch) -> PyResult<()> {
        let (g, rows, sm_scale, t) = (self.g, self.rows, self.sm_scale, &self.tables);
        let (hq, h, d) = (g.num_qo_heads, g.num_kv_heads, g.head_dim);
        let Launch {
            dev,
            stream,
            num_splits,
            max_pages,
            ns,
            workspace: ws,
        } = l;
        // SAFETY (every device view below): (TensorArg::dev) shapes, dtypes, contiguity and
        // residence on cuda:dev were checked by decode_attention; `out` is disjoint from every
        // other argument.
        let (indptr, indices, last) = unsafe {
            (
                t.kv_indptr.dev::<i32>(),
                t.kv_indices.dev::<i32>(),
                t.kv_last_page_len.dev::<i32>(),
            )
        };
        let page_map = t.page_map.map(|p| unsafe { p.dev::<i32>() });
        with_dtype!(self.dt, T => {
            let (qd, od) = unsafe { (self.q.dev::<T>(), self.out.dev::<T>()) };
            let extra = self.extra.map(|(ek, ev)| unsafe { ExtraKvDev { k: ek.dev::<T>(), v: ev.dev::<T>() } });
            let pages = unsafe { self.pages.dev::<T>() };
            on_gpu(py, "decode_attention", dev, stream, &[], move |gpu, st| {
                let splits = if num_splits > 0 { num_splits } else { plan_splits(gpu.num_sms(), ns, h, max_pages) };
                let split = split_kv(splits, ws, dev, ws_len(ns, rows, hq, d, splits))?;
                match pages {
                    KvTierDev::Kv8(p8) => {
                        let kv = PagedKv8Dev { pages: p8, kv_indptr: indptr, kv_indices: indices, kv_last_page_len: last, page_map };
                        gpu.decode_attention_kv8::<T>(&g, qd, rows, &kv, extra.as_ref(), sm_scale, od, split.as_ref(), st)
                    }
                    KvTierDev::Elem { k, v } => {
                        let kv = PagedKvDev { k_pages: k, v_pages: v, kv_indptr: indptr, kv_indices: indices, kv_last_page_len: last, page_map };
                        gpu.decode_attention::<T>(&g, qd, rows, &kv, extra.as_ref(), sm_scale, od, split.as_ref(), st)
                    }
                }
            })
        })
    }
}

/// The split-KV launch of `splits` parts on `workspace` (None for one part). More than one needs
/// a workspace of `need` f32 elements on cuda:`dev`: without one, an error that says how to pass
/// it; past [`MAX_SPLITS`], the launch wrapper's error (it says so before it looks at a
/// workspace).
fn split_kv(
    splits: usize,
    workspace: Option<DevSlice<f32>>,
    dev: i32,
    need: usize,
) -> Result<Option<SplitKv>, CudaError> {
    Ok(match workspace {
        _ if splits <= 1 => None,
        Some(w) => Some(SplitKv {
            num_splits: splits,
            workspace: w,
        }),
        None if splits > MAX_SPLITS => Some(SplitKv {
            num_splits: splits,
            workspace: DevSlice::empty(),
        }),
        None => {
            return Err(OasisError::Invalid(format!(
                "split-kv attention with {splits} splits needs a float32 workspace of {need} elements on \
                 cuda:{dev}: pass workspace=torch.empty({need}, dtype=torch.float32, device=q.device) \
                 (decode_attn_workspace_len gives the size), or num_splits=1"
            ))
            .into())
        }
    })
}

#[pyfunction]
/// f32 elements of the split-KV workspace of decode_attention: partial outputs and log-sum-exps
/// of every (seq, row, query head, split).
fn decode_attn_workspace_len(
    py: Python<'_>,
    num_seqs: usize,
    num_rows: usize,
    num_qo_heads: usize,
    head_dim: usize,
    num_splits: usize,
) -> PyResult<usize> {
    // The product of oasis_cuda's formula, checked: sizes come from Python and must not wrap.
    let fits = head_dim
        .checked_add(1)
        .and_then(|d1| {
            [num_seqs, num_rows, num_qo_heads, num_splits]
                .iter()
                .try_fold(d1, |acc, &x| acc.checked_mul(x))
        })
        .is_some();
    if !fits {
        return Err(py_err(
            py,
            "InvalidArgumentError",
            "the split-kv workspace size overflows; make the call smaller".into(),
        ));
    }
    Ok(ws_len(
        num_seqs,
        num_rows,
        num_qo_heads,
        head_dim,
        num_splits,
    ))
}

#[pyfunction]
/// The split count decode_attention plans on a GPU with `num_sms` SMs for a batch whose longest
/// sequence has `max_pages` pages (1 = no split, no workspace).
fn plan_num_splits(
    py: Python<'_>,
    num_sms: usize,
    num_seqs: usize,
    num_kv_heads: usize,
    max_pages: usize,
) -> PyResult<usize> {
    // Total (saturating) for any sizes: no error case.
    entry(py, "plan_num_splits", || {
        Ok(plan_splits(num_sms, num_seqs, num_kv_heads, max_pages))
    })
}

/// The names `set_kv8_attention_kernel` takes, for its error.
const KV8_KERNELS: &str = "'tile', 'registers' or 'registers-deep'";

#[pyfunction]
/// The tensor-core kernel that reads fp8_e4m3 pages in `decode_attention` on a GPU: `"tile"`
/// (each chunk dequantized into a bf16 tile; bf16 only), `"registers"` (the MMA fragments taken
/// from the codes, f16 MMA; bf16 and f16) or `"registers-deep"` (the same, twice the pipeline
/// depth). Process-wide, for measuring; a captured CUDA graph keeps the kernel it captured.
fn set_kv8_attention_kernel(kernel: &str) -> PyResult<()> {
    use oasis_cuda::ops::Kv8AttnKernel;
    let k = match kernel {
        "tile" => Kv8AttnKernel::Tile,
        "registers" => Kv8AttnKernel::Registers,
        "registers-deep" => Kv8AttnKernel::RegistersDeep,
        other => {
            let msg = format!("kv8 attention kernel must be {KV8_KERNELS}, got {other:?}");
            return Err(pyo3::exceptions::PyValueError::new_err(msg));
        }
    };
    oasis_cuda::ops::set_kv8_attn_kernel(k);
    Ok(())
}

#[pyfunction]
/// The kernel `set_kv8_attention_kernel` chose: `"tile"`, `"registers"` or `"registers-deep"`.
fn kv8_attention_kernel() -> &'static str {
    match oasis_cuda::ops::kv8_attn_kernel() {
        oasis_cuda::ops::Kv8AttnKernel::Tile => "tile",
        oasis_cuda::ops::Kv8AttnKernel::Registers => "registers",
        oasis_cuda::ops::Kv8AttnKernel::RegistersDeep => "registers-deep",
    }
}

/// Add this module's functions to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_kv8_attention_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(kv8_attention_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(decode_attn_workspace_len, m)?)?;
    m.add_function(wrap_pyfunction!(plan_num_splits, m)?)?;
    Ok(())
}
