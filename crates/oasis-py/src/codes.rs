//! 2-bit key code bindings: `build_bounds8` / `score_blocks_bound8` the 8-bit Quest bound (the
//! two-stage score's first stage reads it), `build_key_codes` encodes complete host blocks inside
//! that bound (`encode_blocks`: the bound then the codes, in one launch), `score_blocks_codes`
//! scores every listed block from its bound and codes and `rescore_blocks_codes` the candidates
//! of the two-stage score (`rescore_topk_codes`: with their top-K, in one launch).

use oasis_core::kernels;
use oasis_core::KvGeometry;
use pyo3::prelude::*;

use crate::call::{entry, guarded, on_gpu, with_dtype};
use crate::check::{check_all, check_outputs, kv_dtype, per_head, pool_rows, summary_rows};
use crate::errors::py_err;
use crate::runtime::PyGeometry;
use crate::tensor::{Cx, Elem, Place, TensorArg, ANY};

/// 2-bit key codes need head_dim divisible by 4 (checked before any shape, as the CPU twin).
fn check_codes_head_dim(py: Python<'_>, g: &KvGeometry) -> PyResult<()> {
    if !g.head_dim.is_multiple_of(4) {
        return Err(py_err(
            py,
            "ConfigError",
            format!(
                "2-bit key codes need head_dim divisible by 4, got {}",
                g.head_dim
            ),
        ));
    }
    Ok(())
}

/// `codes [nb, num_kv_heads, block_size, head_dim / 4]` uint8: the codes of `nb` host blocks.
fn check_codes(cx: &Cx<'_>, g: &KvGeometry, codes: &TensorArg, nb: usize) -> PyResult<()> {
    let shape = [nb, g.num_kv_heads, g.block_size, g.head_dim / 4];
    codes.check(cx, "codes", Elem::U8, shape)?;
    Ok(())
}

/// The validation `build_key_codes` and `encode_blocks` share: head_dim, one device, the host
/// pool and the int32 block tables, the pool's block count `nb` (of `pool`: the summaries, or
/// the bounds), `codes` for `nb` blocks, one KV dtype over `kv` (host_k first), and `outs` (codes
/// first) disjoint from `inputs`. Returns the call's context, `nb` and the dtype.
#[allow(clippy::too_many_arguments)]
fn check_encode<'py>(
    py: Python<'py>,
    g: &KvGeometry,
    host_k: &TensorArg,
    pool: &dyn Fn(&Cx<'_>) -> PyResult<usize>,
    block_ids: &TensorArg,
    block_rows: Option<&TensorArg>,
    inputs: &[(&str, &TensorArg)],
    kv: &[(&str, &TensorArg)],
    outs: &[(&str, &TensorArg)],
) -> PyResult<(Cx<'py>, usize, oasis_core::DType)> {
    check_codes_head_dim(py, g)?;
    let host = [("host_k", host_k)];
    let mut tables = vec![("block_ids", block_ids)];
    if let Some(r) = block_rows {
        tables.push(("block_rows", r));
    }
    let cx = Cx::new(py, &[inputs, outs, &tables].concat(), &host)?;
    pool_rows(&cx.host(), g, &host)?;
    let nb = pool(&cx)?;
    check_all(&cx, &tables, Elem::I32, [ANY])?;
    check_codes(&cx, g, outs[0].1, nb)?;
    let dt = kv_dtype(py, kv)?;
    check_outputs(py, outs, &[&host[..], inputs, &tables].concat())?;
    Ok((cx, nb, dt))
}

#[pyfunction]
#[pyo3(signature = (geo, host_k, bounds8, scales, block_ids, codes, *, block_rows = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// Encode every key of complete host blocks to 2 bits per channel inside the block's decoded
/// 8-bit bound [lo, hi] (lo = e4m3(bounds8[b, h, 0]) * scales[b, h], hi from row 1): build the
/// bound first (build_bounds8), or take encode_blocks, which does both.
///
/// host_k [num_host_rows, num_kv_heads, block_size, head_dim]; bounds8 [num_host_blocks,
/// num_kv_heads, 2, head_dim] uint8 and scales [num_host_blocks, num_kv_heads] f32 (build_bounds8's,
/// of the same complete blocks); block_ids [n] int32; codes [num_host_blocks, num_kv_heads,
/// block_size, head_dim // 4] uint8 (channel 4i + j in bits 2j..2j+2 of byte i); block_rows [n]
/// int32 or None: the host row holding each block's keys (None: the row is the block id).
/// head_dim must be divisible by 4 (ConfigError). A NaN scale (a block with a non-finite key)
/// gives codes 0.
///
/// CUDA: bounds8, scales, block_ids and codes on one cuda:N; host_k there too or in pinned CPU
/// memory; queued on `stream` (raw cudaStream_t of cuda:N, 0 = legacy default), returns at once.
/// Out-of-range ids are skipped on the GPU. `stream` is ignored on the CPU.
fn build_key_codes(
    py: Python<'_>,
    geo: &PyGeometry,
    host_k: TensorArg,
    bounds8: TensorArg,
    scales: TensorArg,
    block_ids: TensorArg,
    codes: TensorArg,
    block_rows: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "build_key_codes", || {
        let g = geo.inner;
        let outs = [("codes", &codes)];
        let inputs = [("bounds8", &bounds8), ("scales", &scales)];
        let (cx, _, dt) = check_encode(
            py,
            &g,
            &host_k,
            &|cx| check_bounds8(cx, &g, &bounds8, &scales),
            &block_ids,
            block_rows.as_ref(),
            &inputs,
            &[("host_k", &host_k)],
            &outs,
        )?;
        let host = [("host_k", &host_k)];
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; codes is disjoint from the inputs.
                let (hk, b8, sc, ids, cd) = unsafe { (host_k.slice::<T>(), bounds8.slice::<u8>(), scales.slice::<f32>(), block_ids.ints(), codes.slice_mut::<u8>()) };
                let rows = block_rows.as_ref().map(|r| unsafe { r.ints() });
                guarded(py, "build_key_codes", || kernels::build_key_codes::<T>(&g, hk, b8, sc, ids, rows, cd))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; codes is disjoint from the inputs.
                let (hk, b8, sc, ids, cd) = unsafe { (host_k.dev::<T>(), bounds8.dev::<u8>(), scales.dev::<f32>(), block_ids.dev::<i32>(), codes.dev::<u8>()) };
                let rows = block_rows.as_ref().map(|r| unsafe { r.dev::<i32>() });
                on_gpu(py, "build_key_codes", dev, stream, &host, move |gpu, st| gpu.build_key_codes::<T>(&g, hk, b8, sc, ids, rows, cd, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, host_k, summaries, block_ids, codes, bounds8, scales, *, block_rows = None, stream = 0))]
#[allow(clippy::too_many_arguments)]
/// build_bounds8 then build_key_codes of the same complete host blocks in one launch (the
/// engine's per-step encode of the blocks a step completed): the 8-bit Quest bounds from the
/// summaries, then the 2-bit codes inside them.
///
/// host_k, block_ids, codes and block_rows as build_key_codes; summaries [num_host_blocks,
/// num_kv_heads, 2, head_dim] (those of the same complete blocks); bounds8 [num_host_blocks,
/// num_kv_heads, 2, head_dim] uint8 and scales [num_host_blocks, num_kv_heads] f32 written (as
/// build_bounds8), on the device of codes. Bit-exact with the two calls. head_dim must be
/// divisible by 4 (ConfigError).
///
/// CUDA: queued on `stream`, returns at once; out-of-range ids (and rows) are skipped on the GPU
/// (the CPU raises, writing nothing). `stream` is ignored on the CPU.
fn encode_blocks(
    py: Python<'_>,
    geo: &PyGeometry,
    host_k: TensorArg,
    summaries: TensorArg,
    block_ids: TensorArg,
    codes: TensorArg,
    bounds8: TensorArg,
    scales: TensorArg,
    block_rows: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "encode_blocks", || {
        let g = geo.inner;
        let outs = [
            ("codes", &codes),
            ("bounds8", &bounds8),
            ("scales", &scales),
        ];
        let inputs = [("summaries", &summaries)];
        let (cx, nb, dt) = check_encode(
            py,
            &g,
            &host_k,
            &|cx| summary_rows(cx, &g, &summaries),
            &block_ids,
            block_rows.as_ref(),
            &inputs,
            &[("host_k", &host_k), ("summaries", &summaries)],
            &outs,
        )?;
        let host = [("host_k", &host_k)];
        let nb8 = check_bounds8(&cx, &g, &bounds8, &scales)?;
        if nb8 != nb {
            return Err(py_err(
                py,
                "ShapeError",
                format!("bounds8 has {nb8} host blocks but summaries have {nb}; allocate both for one pool"),
            ));
        }
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; the outputs are disjoint from the inputs and each other.
                let (hk, sm, ids, cd, b8, sc) = unsafe { (host_k.slice::<T>(), summaries.slice::<T>(), block_ids.ints(), codes.slice_mut::<u8>(), bounds8.slice_mut::<u8>(), scales.slice_mut::<f32>()) };
                let rows = block_rows.as_ref().map(|r| unsafe { r.ints() });
                guarded(py, "encode_blocks", || kernels::encode_blocks::<T>(&g, hk, sm, ids, rows, cd, b8, sc))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; the outputs are disjoint from the inputs.
                let (hk, sm, ids, cd, b8, sc) = unsafe { (host_k.dev::<T>(), summaries.dev::<T>(), block_ids.dev::<i32>(), codes.dev::<u8>(), bounds8.dev::<u8>(), scales.dev::<f32>()) };
                let rows = block_rows.as_ref().map(|r| unsafe { r.dev::<i32>() });
                on_gpu(py, "encode_blocks", dev, stream, &host, move |gpu, st| gpu.encode_blocks::<T>(&g, hk, sm, ids, rows, cd, b8, sc, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, q, bounds8, scales, codes, blk_indptr, blk_indices, scores, *, stream = 0))]
/// Block scores from the 2-bit key codes inside each block's 8-bit bound: per entry and KV head,
/// the sum over the GQA group of the block's largest approximate logit, into scores [nnz,
/// num_kv_heads] f32 (NaN for a block whose scale is NaN: it ranks last in topk_blocks).
///
/// q [num_seqs, num_qo_heads, head_dim]; bounds8 [num_host_blocks, num_kv_heads, 2, head_dim]
/// uint8 and scales [num_host_blocks, num_kv_heads] f32 (build_bounds8's); codes
/// [num_host_blocks, num_kv_heads, block_size, head_dim // 4] uint8 (build_key_codes' inside that
/// bound); blk_indptr [num_seqs + 1], blk_indices [nnz] int32 (host block of each logical block).
/// head_dim must be divisible by 4 (ConfigError).
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (raw cudaStream_t, 0 = legacy default),
/// returns at once. An out-of-range block id, or an entry of a malformed blk_indptr row, scores
/// -inf on the GPU (the CPU raises). `stream` is ignored on the CPU.
#[allow(clippy::too_many_arguments)]
fn score_blocks_codes(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    bounds8: TensorArg,
    scales: TensorArg,
    codes: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    scores: TensorArg,
    stream: u64,
) -> PyResult<()> {
    codes_scores(
        py,
        "score_blocks_codes",
        geo,
        q,
        bounds8,
        scales,
        codes,
        blk_indptr,
        blk_indices,
        None,
        scores,
        stream,
    )
}

#[pyfunction]
#[pyo3(signature = (geo, q, bounds8, scales, codes, blk_indptr, blk_indices, cand, scores, *, stream = 0))]
/// The codes score of candidate logical blocks per (seq, kv head): the second stage of
/// KvConfig(score_candidates). cand [num_seqs, num_kv_heads, m] int32 (negative: none, -inf);
/// scores [num_seqs * m, num_kv_heads] f32, a CSR of m entries per sequence for topk_blocks,
/// whose positions index cand. Other arguments as score_blocks_codes.
///
/// A candidate outside its sequence's row raises on the CPU and scores -inf on the GPU.
#[allow(clippy::too_many_arguments)]
fn rescore_blocks_codes(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    bounds8: TensorArg,
    scales: TensorArg,
    codes: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    cand: TensorArg,
    scores: TensorArg,
    stream: u64,
) -> PyResult<()> {
    codes_scores(
        py,
        "rescore_blocks_codes",
        geo,
        q,
        bounds8,
        scales,
        codes,
        blk_indptr,
        blk_indices,
        Some(cand),
        scores,
        stream,
    )
}

#[pyfunction]
#[pyo3(signature = (geo, q, bounds8, scales, codes, blk_indptr, blk_indices, cand, k, out, scratch, counters, *, successors = 0, forced = None, stream = 0))]
/// rescore_blocks_codes then topk_candidates in one launch (one thread block per (seq, kv head)):
/// the codes scores of the candidates cand [num_seqs, num_kv_heads, m] int32 (negative: none),
/// then their k best as logical blocks into out [num_seqs, num_kv_heads, k] int32, the successors
/// of the `successors` best and the blocks of forced [num_seqs, num_kv_heads, F] int32 first, as
/// topk_candidates. Bit-exact with the two calls (the scores are not reduced in between).
/// scratch [num_seqs, num_kv_heads, m] float32 receives the candidates' scores; counters
/// [num_seqs, num_kv_heads] int32 must be zero, and stays so (the thread blocks of a row take
/// tickets there: the last selects); neither is touched on the CPU.
///
/// CUDA: every tensor on one cuda:N, queued on `stream`, returns at once; k <= 512 and
/// m + successors <= 1024 there; a candidate outside its row scores -inf on the GPU (the CPU
/// raises). `stream` is ignored on the CPU.
#[allow(clippy::too_many_arguments)]
fn rescore_topk_codes(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    bounds8: TensorArg,
    scales: TensorArg,
    codes: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    cand: TensorArg,
    k: usize,
    out: TensorArg,
    scratch: TensorArg,
    counters: TensorArg,
    successors: usize,
    forced: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    entry(py, "rescore_topk_codes", || {
        let g = geo.inner;
        check_codes_head_dim(py, &g)?;
        let mut inputs = vec![
            ("q", &q),
            ("bounds8", &bounds8),
            ("scales", &scales),
            ("codes", &codes),
            ("blk_indptr", &blk_indptr),
            ("blk_indices", &blk_indices),
            ("cand", &cand),
        ];
        if let Some(f) = &forced {
            inputs.push(("forced", f));
        }
        let outs = [
            ("out", &out),
            ("scratch", &scratch),
            ("counters", &counters),
        ];
        let cx = Cx::new(py, &[&inputs[..], &outs].concat(), &[])?;
        let [ns, ..] = q.check(&cx, "q", Elem::Any, [ANY, g.num_qo_heads, g.head_dim])?;
        let nh = check_bounds8(&cx, &g, &bounds8, &scales)?;
        check_codes(&cx, &g, &codes, nh)?;
        blk_indptr.check(&cx, "blk_indptr", Elem::I32, [ns + 1])?;
        blk_indices.check(&cx, "blk_indices", Elem::I32, [ANY])?;
        let m = per_head(&cx, "cand", Some(&cand), ns, g.num_kv_heads)?;
        out.check(&cx, "out", Elem::I32, [ns, g.num_kv_heads, k])?;
        scratch.check(&cx, "scratch", Elem::F32, [ns, g.num_kv_heads, m])?;
        counters.check(&cx, "counters", Elem::I32, [ns, g.num_kv_heads])?;
        let nf = per_head(&cx, "forced", forced.as_ref(), ns, g.num_kv_heads)?;
        let dt = kv_dtype(py, &[("q", &q)])?;
        check_outputs(py, &outs, &inputs)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; out is disjoint from the inputs.
                let (qs, b8, sc, cd, ip, ix, cn, o) = unsafe { (q.slice::<T>(), bounds8.slice::<u8>(), scales.slice::<f32>(), codes.slice::<u8>(), blk_indptr.ints(), blk_indices.ints(), cand.ints(), out.ints_mut()) };
                // SAFETY: as above (an int32 input).
                let fs: &[i32] = forced.as_ref().map_or(&[], |f| unsafe { f.ints() });
                guarded(py, "rescore_topk_codes", || kernels::rescore_topk_codes::<T>(&g, qs, b8, sc, cd, ip, ix, cn, m, k, successors, fs, nf, o))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; out is disjoint from the inputs.
                let (qs, b8, sc, cd, ip, ix, cn, o) = unsafe { (q.dev::<T>(), bounds8.dev::<u8>(), scales.dev::<f32>(), codes.dev::<u8>(), blk_indptr.dev::<i32>(), blk_indices.dev::<i32>(), cand.dev::<i32>(), out.dev::<i32>()) };
                // SAFETY: as above (outputs on the same device, disjoint from the inputs).
                let (sr, ct) = unsafe { (scratch.dev::<f32>(), counters.dev::<i32>()) };
                // SAFETY: as above (an int32 input on the same device).
                let fs = forced.as_ref().map(|f| (unsafe { f.dev::<i32>() }, nf));
                on_gpu(py, "rescore_topk_codes", dev, stream, &[], move |gpu, st| gpu.rescore_topk_codes::<T>(&g, qs, b8, sc, cd, ip, ix, cn, m, k, successors, fs, o, sr, ct, st))
            }),
        }
    })
}

/// [`score_blocks_codes`] (every listed block) and, with `cand`, [`rescore_blocks_codes`] (the
/// candidates of each sequence and KV head): the shared checks and the dispatch to the twins.
#[allow(clippy::too_many_arguments)]
fn codes_scores(
    py: Python<'_>,
    what: &'static str,
    geo: &PyGeometry,
    q: TensorArg,
    bounds8: TensorArg,
    scales: TensorArg,
    codes: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    cand: Option<TensorArg>,
    scores: TensorArg,
    stream: u64,
) -> PyResult<()> {
    entry(py, what, || {
        let g = geo.inner;
        check_codes_head_dim(py, &g)?;
        let mut inputs = vec![
            ("q", &q),
            ("bounds8", &bounds8),
            ("scales", &scales),
            ("codes", &codes),
            ("blk_indptr", &blk_indptr),
            ("blk_indices", &blk_indices),
        ];
        if let Some(c) = &cand {
            inputs.push(("cand", c));
        }
        let cx = Cx::new(py, &[&inputs[..], &[("scores", &scores)]].concat(), &[])?;
        let [ns, ..] = q.check(&cx, "q", Elem::Any, [ANY, g.num_qo_heads, g.head_dim])?;
        let nh = check_bounds8(&cx, &g, &bounds8, &scales)?;
        check_codes(&cx, &g, &codes, nh)?;
        blk_indptr.check(&cx, "blk_indptr", Elem::I32, [ns + 1])?;
        let [nnz] = blk_indices.check(&cx, "blk_indices", Elem::I32, [ANY])?;
        // Entries scored: every listed block, or m candidates per sequence.
        let (rows, m) = match &cand {
            None => (nnz, 0),
            Some(c) => {
                let m = per_head(&cx, "cand", Some(c), ns, g.num_kv_heads)?;
                (ns * m, m)
            }
        };
        scores.check(&cx, "scores", Elem::F32, [rows, g.num_kv_heads])?;
        let dt = kv_dtype(py, &[("q", &q)])?;
        check_outputs(py, &[("scores", &scores)], &inputs)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; scores is disjoint from the inputs.
                let (qs, b8, sc, cd, ip, ix, out) = unsafe { (q.slice::<T>(), bounds8.slice::<u8>(), scales.slice::<f32>(), codes.slice::<u8>(), blk_indptr.ints(), blk_indices.ints(), scores.slice_mut::<f32>()) };
                match &cand {
                    None => guarded(py, what, || kernels::score_blocks_codes::<T>(&g, qs, b8, sc, cd, ip, ix, out)),
                    // SAFETY: checked above (an int32 input).
                    Some(c) => {
                        let cn = unsafe { c.ints() };
                        guarded(py, what, || kernels::rescore_blocks_codes::<T>(&g, qs, b8, sc, cd, ip, ix, cn, m, out))
                    }
                }
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; scores is disjoint from the inputs.
                let (qs, b8, sc, cd, ip, ix, out) = unsafe { (q.dev::<T>(), bounds8.dev::<u8>(), scales.dev::<f32>(), codes.dev::<u8>(), blk_indptr.dev::<i32>(), blk_indices.dev::<i32>(), scores.dev::<f32>()) };
                // SAFETY: as above (an int32 input on the same device).
                let cn = cand.as_ref().map(|c| unsafe { c.dev::<i32>() });
                on_gpu(py, what, dev, stream, &[], move |gpu, st| match cn {
                    None => gpu.score_blocks_codes::<T>(&g, qs, b8, sc, cd, ip, ix, out, st),
                    Some(cn) => gpu.rescore_blocks_codes::<T>(&g, qs, b8, sc, cd, ip, ix, cn, m, out, st),
                })
            }),
        }
    })
}

/// `bounds8 [nb, num_kv_heads, 2, head_dim]` uint8 and `scales [nb, num_kv_heads]` f32: the 8-bit
/// bounds of `nb` host blocks.
fn check_bounds8(
    cx: &Cx<'_>,
    g: &KvGeometry,
    bounds8: &TensorArg,
    scales: &TensorArg,
) -> PyResult<usize> {
    let [nb, ..] = bounds8.check(
        cx,
        "bounds8",
        Elem::U8,
        [ANY, g.num_kv_heads, 2, g.head_dim],
    )?;
    scales.check(cx, "scales", Elem::F32, [nb, g.num_kv_heads])?;
    Ok(nb)
}

#[pyfunction]
#[pyo3(signature = (geo, summaries, block_ids, bounds8, scales, *, stream = 0))]
/// The 8-bit Quest bounds of complete host blocks (oasis_core::kernels::bound8): each (block,
/// head) summary row in E4M3, min rounded down and max rounded up after dividing by the row's
/// power-of-two scale (NaN for a row with a non-finite value).
///
/// summaries [num_host_blocks, num_kv_heads, 2, head_dim]; block_ids [n] int32; bounds8 [same
/// num_host_blocks, num_kv_heads, 2, head_dim] uint8; scales [num_host_blocks, num_kv_heads] f32.
///
/// CUDA: every tensor on one cuda:N, queued on `stream` (raw cudaStream_t, 0 = legacy default),
/// returns at once. Out-of-range ids are skipped on the GPU (the CPU raises).
fn build_bounds8(
    py: Python<'_>,
    geo: &PyGeometry,
    summaries: TensorArg,
    block_ids: TensorArg,
    bounds8: TensorArg,
    scales: TensorArg,
    stream: u64,
) -> PyResult<()> {
    entry(py, "build_bounds8", || {
        let g = geo.inner;
        let all = [
            ("summaries", &summaries),
            ("block_ids", &block_ids),
            ("bounds8", &bounds8),
            ("scales", &scales),
        ];
        let cx = Cx::new(py, &all, &[])?;
        let nb = summary_rows(&cx, &g, &summaries)?;
        block_ids.check(&cx, "block_ids", Elem::I32, [ANY])?;
        let nb8 = check_bounds8(&cx, &g, &bounds8, &scales)?;
        if nb8 != nb {
            return Err(py_err(
                py,
                "ShapeError",
                format!("bounds8 has {nb8} host blocks but summaries have {nb}; allocate both for one pool"),
            ));
        }
        let dt = kv_dtype(py, &[("summaries", &summaries)])?;
        check_outputs(
            py,
            &[("bounds8", &bounds8), ("scales", &scales)],
            &[("summaries", &summaries), ("block_ids", &block_ids)],
        )?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; the outputs are disjoint from the inputs and each other.
                let (sm, ids, b8, sc) = unsafe { (summaries.slice::<T>(), block_ids.ints(), bounds8.slice_mut::<u8>(), scales.slice_mut::<f32>()) };
                guarded(py, "build_bounds8", || kernels::build_bounds8::<T>(&g, sm, ids, b8, sc))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; the outputs are disjoint from the inputs.
                let (sm, ids, b8, sc) = unsafe { (summaries.dev::<T>(), block_ids.dev::<i32>(), bounds8.dev::<u8>(), scales.dev::<f32>()) };
                on_gpu(py, "build_bounds8", dev, stream, &[], move |gpu, st| gpu.build_bounds8::<T>(&g, sm, ids, b8, sc, st))
            }),
        }
    })
}

#[pyfunction]
#[pyo3(signature = (geo, q, bounds8, scales, blk_indptr, blk_indices, scores, *, stream = 0))]
/// Quest block scores over the 8-bit bounds (see build_bounds8), into scores [nnz, num_kv_heads]
/// f32: an upper bound of each block's largest logit, summed over the GQA group, at least the
/// score_blocks of the same summaries. Arguments as score_blocks, with bounds8 and scales for the
/// summaries.
///
/// CUDA: every tensor on one cuda:N, queued on `stream`, returns at once. An out-of-range block id,
/// or an entry of a malformed blk_indptr row, scores -inf on the GPU (the CPU raises).
#[allow(clippy::too_many_arguments)]
fn score_blocks_bound8(
    py: Python<'_>,
    geo: &PyGeometry,
    q: TensorArg,
    bounds8: TensorArg,
    scales: TensorArg,
    blk_indptr: TensorArg,
    blk_indices: TensorArg,
    scores: TensorArg,
    stream: u64,
) -> PyResult<()> {
    entry(py, "score_blocks_bound8", || {
        let g = geo.inner;
        let inputs = [
            ("q", &q),
            ("bounds8", &bounds8),
            ("scales", &scales),
            ("blk_indptr", &blk_indptr),
            ("blk_indices", &blk_indices),
        ];
        let cx = Cx::new(py, &[&inputs[..], &[("scores", &scores)]].concat(), &[])?;
        let [ns, ..] = q.check(&cx, "q", Elem::Any, [ANY, g.num_qo_heads, g.head_dim])?;
        check_bounds8(&cx, &g, &bounds8, &scales)?;
        blk_indptr.check(&cx, "blk_indptr", Elem::I32, [ns + 1])?;
        let [nnz] = blk_indices.check(&cx, "blk_indices", Elem::I32, [ANY])?;
        scores.check(&cx, "scores", Elem::F32, [nnz, g.num_kv_heads])?;
        let dt = kv_dtype(py, &[("q", &q)])?;
        check_outputs(py, &[("scores", &scores)], &inputs)?;
        match cx.place {
            Place::Cpu => with_dtype!(dt, T => {
                // SAFETY: checked above; scores is disjoint from the inputs.
                let (qs, b8, sc, ip, ix, out) = unsafe { (q.slice::<T>(), bounds8.slice::<u8>(), scales.slice::<f32>(), blk_indptr.ints(), blk_indices.ints(), scores.slice_mut::<f32>()) };
                guarded(py, "score_blocks_bound8", || kernels::score_blocks_bound8::<T>(&g, qs, b8, sc, ip, ix, out))
            }),
            Place::Cuda(dev) => with_dtype!(dt, T => {
                // SAFETY: (TensorArg::dev) checked above; scores is disjoint from the inputs.
                let (qs, b8, sc, ip, ix, out) = unsafe { (q.dev::<T>(), bounds8.dev::<u8>(), scales.dev::<f32>(), blk_indptr.dev::<i32>(), blk_indices.dev::<i32>(), scores.dev::<f32>()) };
                on_gpu(py, "score_blocks_bound8", dev, stream, &[], move |gpu, st| gpu.score_blocks_bound8::<T>(&g, qs, b8, sc, ip, ix, out, st))
            }),
        }
    })
}

/// Add this module's functions to `_core`.
#[pyfunction]
/// The kernel that scores the 8-bit bound in `score_blocks_bound8` on a GPU: `"fma"` (each code
/// through f32) or `"mma"` (eight entries per tensor-core MMA; head_dim 64/128/256, else fma).
/// Process-wide, for measuring; a captured CUDA graph keeps the kernel it captured.
fn set_bound8_score_kernel(kernel: &str) -> PyResult<()> {
    use oasis_cuda::ops::Bound8ScoreKernel;
    let k = match kernel {
        "fma" => Bound8ScoreKernel::Fma,
        "mma" => Bound8ScoreKernel::Mma,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "bound8 score kernel must be 'fma' or 'mma', got {other:?}"
            )))
        }
    };
    oasis_cuda::ops::set_bound8_score_kernel(k);
    Ok(())
}

#[pyfunction]
/// The kernel `set_bound8_score_kernel` chose: `"fma"` or `"mma"`.
fn bound8_score_kernel() -> &'static str {
    match oasis_cuda::ops::bound8_score_kernel() {
        oasis_cuda::ops::Bound8ScoreKernel::Fma => "fma",
        oasis_cuda::ops::Bound8ScoreKernel::Mma => "mma",
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_bound8_score_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(bound8_score_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(build_key_codes, m)?)?;
    m.add_function(wrap_pyfunction!(encode_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(score_blocks_codes, m)?)?;
    m.add_function(wrap_pyfunction!(rescore_blocks_codes, m)?)?;
    m.add_function(wrap_pyfunction!(rescore_topk_codes, m)?)?;
    m.add_function(wrap_pyfunction!(build_bounds8, m)?)?;
    m.add_function(wrap_pyfunction!(score_blocks_bound8, m)?)?;
    Ok(())
}
