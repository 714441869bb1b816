//! Selection bindings: Quest block scores (`score_blocks`), the top-K of blocks per KV head
//! (`topk_blocks`, with its index map or forced blocks), forcing (`force_scores`), the two-stage
//! score's last top-K (`topk_candidates`) and delta selection (`delta_select`).

use oasis_core::kernels;
use pyo3::prelude::*;

use crate::call::{entry, guarded, on_gpu, with_dtype};
use crate::check::{check_all, check_outputs, indptr_rows, kv_dtype, per_head, summary_rows};
use crate::errors::py_err;
use crate::runtime::PyGeometry;
use crate::tensor::{check_disjoint, Cx, Elem, Place, TensorArg, ANY};

#[pyfunction]
#[pyo3(signature = (geo, q, summaries, blk_indptr, blk_indices, scores, *, stream = 0))]
/// Quest block scores of the lookahead queries, summed over each GQA group: scores [nnz, num_kv_heads] f32.
///
/// q [num_seqs, num_qo_heads, head_dim]; summaries [num_host_blocks, num_kv_heads, 2, head_dim];
/// blk_indptr [num_seqs + 1], blk_indices [nnz] int32 (host block of each logical block).
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (raw cudaStream_t, 0 = legacy default),
/// returns at once. An out-of-range block id, or an entry of a malformed blk_indptr row, scores
/// -inf on the GPU (the CPU raises). `stream` is ignored on the CPU.
#[allow(clippy::too_many_arguments)]
fn score_blocks(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    summaries: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    scores: TensorArg,
    stream: u64,
) -> PyResult<()> {
    entry(py, "score_blocks", || {
        let g = geo.inner;
        let inputs = [
            ("q", &q),
            ("summaries", &summaries),
            ("blk_indptr", &blk_indptr),
            ("blk_indices", &blk_indices),
        ];
        let cx = Cx::new(py, &[&inputs[..], &[("scores", &scores)]].concat(), &[])?;
        let [ns, ..] = q.check(&cx, "q", Elem::Any, [ANY, g.num_qo_heads, g.head_dim])?;
        summary_rows(&cx, &g, &summaries)?;
        blk_indptr.check(&cx, "blk_indptr", Elem::I32, [ns + 1])?;
        let [nnz] = blk_indices.check(&cx, "blk_indices", Elem::I32, [ANY])?;
        scores.check(&cx, "scores", Elem::F32, [nnz, g.num_kv_heads])?;
        let dt = kv_dtype(py, &[("q", &q), ("summaries", &summaries)])?;
        check_outputs(py, &[("scores", &scores)], &inputs)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; scores is disjoint from the inputs.
                let (qs, sm, ip, ix, sc) = unsafe { (q.slice::<T>(), summaries.slice::<T>(), blk_indptr.ints(), blk_indices.ints(), scores.slice_mut::<f32>()) };
                guarded(py, "score_blocks", || kernels::score_blocks::<T>(&g, qs, sm, ip, ix, sc))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; scores is disjoint from the inputs.
                let (qs, sm, ip, ix, sc) = unsafe { (q.dev::<T>(), summaries.dev::<T>(), blk_indptr.dev::<i32>(), blk_indices.dev::<i32>(), scores.dev::<f32>()) };
                on_gpu(py, "score_blocks", dev, stream, &[], move |gpu, st| gpu.score_blocks::<T>(&g, qs, sm, ip, ix, sc, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (num_kv_heads, scores, blk_indptr, k, out, *, index_map = None, forced = None, stream = 0))]
/// Per (seq, kv head) top-k logical blocks, best first, -1 padded: out [num_seqs, num_kv_heads, k].
///
/// scores [nnz, num_kv_heads] float32; blk_indptr [num_seqs + 1] int32. Ties go to the lower
/// logical index. index_map [num_seqs, num_kv_heads, m] int32: out holds index_map[s, h, i] for
/// each chosen position i (-1 past m and for the padding), in the same launch. forced
/// [num_seqs, num_kv_heads, F] int32: force_scores first (those entries of scores set to +inf, in
/// place), in the same launch; not with index_map.
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (raw cudaStream_t, 0 = legacy default),
/// returns at once; k is at most 512 there, and a malformed blk_indptr row gives all -1 (the CPU
/// raises). `stream` is ignored on the CPU.
#[allow(clippy::too_many_arguments)]
fn topk_blocks(
    py: Python<'_>,
    num_kv_heads: usize,
    scores: TensorArg,
    blk_indptr: TensorArg,
    k: usize,
    out: TensorArg,
    index_map: Option<TensorArg>,
    forced: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "topk_blocks", || {
        if index_map.is_some() && forced.is_some() {
            return Err(py_err(
                py,
                "InvalidArgumentError",
                "topk_blocks takes index_map or forced, not both: force the scores first \
                 (force_scores), then map"
                    .into(),
            ));
        }
        let mut inputs: Vec<(&str, &TensorArg)> = vec![("blk_indptr", &blk_indptr)];
        if let Some(m) = &index_map {
            inputs.push(("index_map", m));
        }
        if let Some(f) = &forced {
            inputs.push(("forced", f));
        }
        // With forced, scores is written too.
        let mut outputs: Vec<(&str, &TensorArg)> = vec![("out", &out)];
        if forced.is_some() {
            outputs.push(("scores", &scores));
        } else {
            inputs.push(("scores", &scores));
        }
        let cx = Cx::new(py, &[&inputs[..], &outputs[..]].concat(), &[])?;
        scores.check(&cx, "scores", Elem::F32, [ANY, num_kv_heads])?;
        let ns = indptr_rows(&cx, &blk_indptr)?;
        out.check(&cx, "out", Elem::I32, [ns, num_kv_heads, k])?;
        let map_m = per_head(&cx, "index_map", index_map.as_ref(), ns, num_kv_heads)?;
        let n_forced = per_head(&cx, "forced", forced.as_ref(), ns, num_kv_heads)?;
        check_outputs(py, &outputs, &inputs)?;
        match cx.place {
            Place::Cpu => {
                // SAFETY: checked above; out is disjoint from the inputs.
                let (ip, o) = unsafe { (blk_indptr.ints(), out.ints_mut()) };
                match (&index_map, &forced) {
                    (Some(m), _) => {
                        // SAFETY: checked above (int32 inputs).
                        let (sc, mp) = unsafe { (scores.slice::<f32>(), m.ints()) };
                        guarded(py, "topk_blocks", || {
                            kernels::topk_blocks_mapped(num_kv_heads, sc, ip, k, mp, map_m, o)
                        })
                    }
                    (None, Some(f)) => {
                        // SAFETY: checked above; scores (written) is disjoint from the inputs.
                        let (sc, fs) = unsafe { (scores.slice_mut::<f32>(), f.ints()) };
                        guarded(py, "topk_blocks", || {
                            kernels::force_scores(num_kv_heads, sc, ip, fs, n_forced)?;
                            kernels::topk_blocks(num_kv_heads, sc, ip, k, o)
                        })
                    }
                    (None, None) => {
                        // SAFETY: checked above.
                        let sc = unsafe { scores.slice::<f32>() };
                        guarded(py, "topk_blocks", || {
                            kernels::topk_blocks(num_kv_heads, sc, ip, k, o)
                        })
                    }
                }
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) checked above; out (and scores with forced) are
                // disjoint from the inputs.
                let (sc, ip, o) = unsafe {
                    (
                        scores.dev::<f32>(),
                        blk_indptr.dev::<i32>(),
                        out.dev::<i32>(),
                    )
                };
                // SAFETY: as above (int32 inputs on the same device).
                let mp = index_map.as_ref().map(|m| unsafe { m.dev::<i32>() });
                let fs = forced.as_ref().map(|f| unsafe { f.dev::<i32>() });
                on_gpu(py, "topk_blocks", dev, stream, &[], move |gpu, st| {
                    match (mp, fs) {
                        (Some(mp), _) => {
                            gpu.topk_blocks_mapped(num_kv_heads, sc, ip, k, mp, map_m, o, st)
                        }
                        (None, Some(fs)) => {
                            gpu.topk_blocks_forced(num_kv_heads, sc, ip, k, fs, n_forced, o, st)
                        }
                        (None, None) => gpu.topk_blocks(num_kv_heads, sc, ip, k, o, st),
                    }
                })
            }
        }
    })
}

#[pyfunction]
#[pyo3(signature = (num_kv_heads, scores, blk_indptr, forced, *, stream = 0))]
/// Set the forced entries of scores [nnz, num_kv_heads] float32 to +inf, in place: forced
/// [num_seqs, num_kv_heads, F] int32 holds logical blocks (positions within each row of
/// blk_indptr [num_seqs + 1] int32); -1 and positions past the row are ignored.
///
/// CUDA: every tensor on one cuda:N, queued on `stream`. `stream` is ignored on the CPU.
fn force_scores(
    py: Python<'_>,
    num_kv_heads: usize,
    scores: TensorArg,
    blk_indptr: TensorArg,
    forced: TensorArg,
    stream: u64,
) -> PyResult<()> {
    entry(py, "force_scores", || {
        let inputs: Vec<(&str, &TensorArg)> =
            vec![("blk_indptr", &blk_indptr), ("forced", &forced)];
        let cx = Cx::new(py, &[&inputs[..], &[("scores", &scores)]].concat(), &[])?;
        scores.check(&cx, "scores", Elem::F32, [ANY, num_kv_heads])?;
        let ns = indptr_rows(&cx, &blk_indptr)?;
        let nf = per_head(&cx, "forced", Some(&forced), ns, num_kv_heads)?;
        check_outputs(py, &[("scores", &scores)], &inputs)?;
        match cx.place {
            Place::Cpu => {
                // SAFETY: checked above; scores is disjoint from the inputs.
                let (sc, ip, f) =
                    unsafe { (scores.slice_mut::<f32>(), blk_indptr.ints(), forced.ints()) };
                guarded(py, "force_scores", || {
                    kernels::force_scores(num_kv_heads, sc, ip, f, nf)
                })
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) checked above; scores is disjoint from the inputs.
                let (sc, ip, f) = unsafe {
                    (
                        scores.dev::<f32>(),
                        blk_indptr.dev::<i32>(),
                        forced.dev::<i32>(),
                    )
                };
                on_gpu(py, "force_scores", dev, stream, &[], move |gpu, st| {
                    gpu.force_scores(num_kv_heads, sc, ip, f, nf, st)
                })
            }
        }
    })
}

#[pyfunction]
#[pyo3(signature = (num_kv_heads, scores, cand, blk_indptr, k, out, *, successors = 0, forced = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// The two-stage score's last top-k: candidates cand [num_seqs, num_kv_heads, m] int32 (logical
/// blocks of the rows of blk_indptr [num_seqs + 1] int32, < 0: none) with scores
/// [num_seqs * m, num_kv_heads] float32; the next blocks of the `successors` best and the blocks
/// of forced [num_seqs, num_kv_heads, F] int32 rank first (a successor that is no candidate is
/// appended); out [num_seqs, num_kv_heads, k] int32 receives the k best as blocks, -1 padded.
///
/// CUDA: every tensor on one cuda:N, queued on `stream`; k <= 512 and m + successors <= 1024
/// there. `stream` is ignored on the CPU.
fn topk_candidates(
    py: Python<'_>,
    num_kv_heads: usize,
    scores: TensorArg,
    cand: TensorArg,
    blk_indptr: TensorArg,
    k: usize,
    out: TensorArg,
    successors: usize,
    forced: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "topk_candidates", || {
        let mut inputs: Vec<(&str, &TensorArg)> = vec![
            ("scores", &scores),
            ("cand", &cand),
            ("blk_indptr", &blk_indptr),
        ];
        if let Some(f) = &forced {
            inputs.push(("forced", f));
        }
        let cx = Cx::new(py, &[&inputs[..], &[("out", &out)]].concat(), &[])?;
        let [ns, _, m] = cand.check(&cx, "cand", Elem::I32, [ANY, num_kv_heads, ANY])?;
        scores.check(&cx, "scores", Elem::F32, [ns * m, num_kv_heads])?;
        blk_indptr.check(&cx, "blk_indptr", Elem::I32, [ns + 1])?;
        out.check(&cx, "out", Elem::I32, [ns, num_kv_heads, k])?;
        let nf = per_head(&cx, "forced", forced.as_ref(), ns, num_kv_heads)?;
        check_outputs(py, &[("out", &out)], &inputs)?;
        match cx.place {
            Place::Cpu => {
                // SAFETY: checked above; out is disjoint from the inputs.
                let (sc, cn, ip, o) = unsafe {
                    (
                        scores.slice::<f32>(),
                        cand.ints(),
                        blk_indptr.ints(),
                        out.ints_mut(),
                    )
                };
                // SAFETY: as above (an int32 input).
                let fs: &[i32] = forced.as_ref().map_or(&[], |f| unsafe { f.ints() });
                guarded(py, "topk_candidates", || {
                    kernels::topk_candidates(num_kv_heads, sc, cn, m, ip, k, successors, fs, nf, o)
                })
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) checked above; out is disjoint from the inputs.
                let (sc, cn, ip, o) = unsafe {
                    (
                        scores.dev::<f32>(),
                        cand.dev::<i32>(),
                        blk_indptr.dev::<i32>(),
                        out.dev::<i32>(),
                    )
                };
                // SAFETY: as above (an int32 input on the same device).
                let fs = forced.as_ref().map(|f| (unsafe { f.dev::<i32>() }, nf));
                on_gpu(py, "topk_candidates", dev, stream, &[], move |gpu, st| {
                    gpu.topk_candidates(num_kv_heads, sc, cn, m, ip, k, successors, fs, o, st)
                })
            }
        }
    })
}

#[pyfunction]
#[pyo3(signature = (num_kv_heads, predicted, slot_pages, page_map, page_last_selected, step, fetch_cap, plan_slots, plan_blocks, *, stats = None, step_now = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Delta selection with capped least-recently-selected eviction. Updates page_map and
/// page_last_selected in place and writes the plan.
///
/// predicted [num_seqs, num_kv_heads, num_pred] (num_pred <= budget), slot_pages
/// [num_seqs, budget], page_map and page_last_selected [num_pages, num_kv_heads], plan_slots and
/// plan_blocks [num_seqs, num_kv_heads, fetch_cap], all int32.
///
/// CPU: returns (pairs, kept, missing) summed over sequences and heads; `stats` must be None.
/// CUDA: every tensor on one cuda:N, queued on `stream` (raw cudaStream_t, 0 = legacy default),
/// returns None at once; pass `stats`, an int32 tensor [num_seqs, num_kv_heads, 3] on cuda:N, to
/// receive (pairs, kept, missing) per (seq, head). On the GPU, budget is at most 4096, and
/// slot_pages is not validated: an out-of-range page is skipped, a page listed twice is undefined.
fn delta_select(
    py: Python<'_>,
    num_kv_heads: usize,
    predicted: TensorArg,
    slot_pages: TensorArg,
    page_map: TensorArg,
    page_last_selected: TensorArg,
    step: i32,
    fetch_cap: usize,
    plan_slots: TensorArg,
    plan_blocks: TensorArg,
    stats: Option<TensorArg>,
    step_now: Option<TensorArg>,
    stream: u64,
) -> PyResult<Option<(usize, usize, usize)>> {
    entry(py, "delta_select", || {
        let mut all = vec![
            ("predicted", &predicted),
            ("slot_pages", &slot_pages),
            ("page_map", &page_map),
            ("page_last_selected", &page_last_selected),
            ("plan_slots", &plan_slots),
            ("plan_blocks", &plan_blocks),
        ];
        if let Some(st) = &stats {
            all.push(("stats", st));
        }
        if let Some(sn) = &step_now {
            all.push(("step_now", sn));
        }
        let cx = Cx::new(py, &all, &[])?;
        if let Some(sn) = &step_now {
            sn.check(&cx, "step_now", Elem::I32, [1])?;
        }
        let h = num_kv_heads;
        let [ns, _, np] = predicted.check(&cx, "predicted", Elem::I32, [ANY, h, ANY])?;
        let [_, budget] = slot_pages.check(&cx, "slot_pages", Elem::I32, [ns, ANY])?;
        let pages = [
            ("page_map", &page_map),
            ("page_last_selected", &page_last_selected),
        ];
        check_all(&cx, &pages, Elem::I32, [ANY, h])?;
        let plan = [("plan_slots", &plan_slots), ("plan_blocks", &plan_blocks)];
        check_all(&cx, &plan, Elem::I32, [ns, h, fetch_cap])?;
        if let Some(st) = &stats {
            st.check(&cx, "stats", Elem::I32, [ns, h, 3])?;
        }
        check_disjoint(py, &all)?;
        match cx.place {
            Place::Cpu => {
                if stats.is_some() {
                    return Err(py_err(
                        py,
                        "InvalidArgumentError",
                        "stats is filled by the GPU kernel only; on the CPU delta_select returns the totals (pairs, kept, missing): pass stats=None".into(),
                    ));
                }
                if step_now.is_some() {
                    return Err(py_err(
                        py,
                        "InvalidArgumentError",
                        "step_now is read by the GPU kernel only; on the CPU pass the step as `step` and step_now=None".into(),
                    ));
                }
                // SAFETY: all i32 on the CPU with the checked shapes; the four mutable ones are disjoint.
                let (pr, sp, pm, pls, ps, pb) = unsafe {
                    (
                        predicted.ints(),
                        slot_pages.ints(),
                        page_map.ints_mut(),
                        page_last_selected.ints_mut(),
                        plan_slots.ints_mut(),
                        plan_blocks.ints_mut(),
                    )
                };
                let st = guarded(py, "delta_select", || {
                    kernels::delta_select(
                        num_kv_heads,
                        pr,
                        np,
                        sp,
                        budget,
                        pm,
                        pls,
                        step,
                        fetch_cap,
                        ps,
                        pb,
                    )
                })?;
                Ok(Some((st.pairs, st.kept, st.missing)))
            }
            Place::Cuda(dev) => {
                // SAFETY: (TensorArg::dev) all int32 on cuda:dev with the checked shapes, pairwise disjoint.
                let (pr, sp, pm, pls, ps, pb) = unsafe {
                    (
                        predicted.dev::<i32>(),
                        slot_pages.dev::<i32>(),
                        page_map.dev::<i32>(),
                        page_last_selected.dev::<i32>(),
                        plan_slots.dev::<i32>(),
                        plan_blocks.dev::<i32>(),
                    )
                };
                let sd = stats.as_ref().map(|s| unsafe { s.dev::<i32>() });
                // SAFETY: as above (int32 [1] on cuda:dev, checked; only read).
                let sn = step_now.as_ref().map(|s| unsafe { s.dev::<i32>() });
                on_gpu(py, "delta_select", dev, stream, &[], move |gpu, st| {
                    gpu.delta_select(
                        num_kv_heads,
                        pr,
                        np,
                        sp,
                        budget,
                        pm,
                        pls,
                        step,
                        sn,
                        fetch_cap,
                        ps,
                        pb,
                        sd,
                        st,
                    )
                })?;
                Ok(None)
            }
        }
    })
}

/// Add this module's functions to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(score_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(topk_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(force_scores, m)?)?;
    m.add_function(wrap_pyfunction!(topk_candidates, m)?)?;
    m.add_function(wrap_pyfunction!(delta_select, m)?)?;
    Ok(())
}
