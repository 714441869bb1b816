"""Time the two-stage codes score (KvConfig(score_candidates=F)) part by part, and compile variants
of cuda/key_codes.cu (the #ifndef knobs of it and its oasis_codes_tc.cuh) with CuPy's NVRTC to time
the candidates' rescoring.

    python3 experiments/exp_codes.py [--batch 64] [--ctx 32768] [--k 128] [--factor 1.5]
        [--source-alt PATH ...] [--json out.json]

An experiment tool for the GPU machine (CuPy, torch and the oasiskv wheel there, no cargo). Parts:
the Quest score, its top-m, the rescoring, the last top-k with the map back, and the whole chain,
each replayed from a CUDA graph (oasiskv.bench.kernels.time_graph). Variants: each is checked
against the wheel's rescoring (largest difference relative to the scores' magnitude) and timed
with CUDA events over back-to-back launches, as is the wheel's kernel in the same run.
``--source-alt`` (repeatable) adds the variants compiled from other copies of key_codes.cu (an
older version, or a change to try), each labelled by its file name.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import cupy as cp
import numpy as np
import torch
from exp_score import ROOT, module, params, source, timed

from oasiskv import ops
from oasiskv.bench.kernels import codes_inputs, time_graph

# The defaults of the knobs of cuda/key_codes.cu and cuda/oasis_codes_tc.cuh (what oasis-cuda
# builds); each variant overrides some.
DEFAULTS = {"OASIS_CODES_STAGES": 3, "OASIS_CODES_MIN_BLOCKS": 6, "OASIS_CODES_TILE": 32}
# "tile": the entries per warp the launch asks for (ScoreBlocksCodesParams.tile, at most
# OASIS_CODES_TILE); the wheel picks it by the batch (oasis_cuda::ops::score_codes_tile). Shorter
# tiles: more warps in flight for a small batch (the rescoring is latency-bound); at 32K x 64
# they lose (sixteenth session: 16 -> 66 us, 8 -> 84 us against 61; docs/PERF.md has each batch).
VARIANTS = [
    {},
    {"OASIS_CODES_STAGES": 4},
    {"OASIS_CODES_STAGES": 2, "OASIS_CODES_MIN_BLOCKS": 8},
    {"tile": 16},
    {"tile": 8},
    {"tile": 4},
]
THREADS = 128  # OASIS_CODES_THREADS


def timed_cold(fn, flush: torch.Tensor, repeat=15) -> float:
    """Median milliseconds of one call of ``fn`` after overwriting ``flush`` (larger than the L2):
    the call finds none of its inputs in L2, as in a decode step after the Quest score."""
    ts = []
    for _ in range(repeat + 2):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--factor", type=float, default=1.5)
    ap.add_argument("--source-alt", action="append", default=[])
    ap.add_argument("--json", default=None)
    ap.add_argument("--topk-variants", action="store_true", help="also time topk_blocks_f32's knobs")
    ap.add_argument("--record-layout", action="store_true", help="also time bound + codes as one record")
    args = ap.parse_args()
    dev = torch.device("cuda")
    hq, hk, d, bs = 32, 8, 128, 16
    geo = ops.KvGeometry(hq, hk, d, bs)
    torch.manual_seed(0)
    q, summ, b8, sc, codes, indptr, indices = codes_inputs(geo, dev, torch.bfloat16, args.batch, args.ctx)
    n_host = indices.numel()
    m = min(512, math.ceil(args.factor * args.k))
    bound = torch.empty(n_host, hk, device=dev, dtype=torch.float32)
    cand = torch.empty(args.batch, hk, m, device=dev, dtype=torch.int32)
    rescored = torch.empty(args.batch * m, hk, device=dev, dtype=torch.float32)
    rows = torch.arange(0, args.batch * m + 1, m, device=dev, dtype=torch.int32)
    top = torch.empty(args.batch, hk, args.k, device=dev, dtype=torch.int32)
    top_q = torch.empty_like(top)

    parts = {
        "quest_score": lambda: ops.score_blocks(geo, q, summ, indptr, indices, bound),
        "quest_topk": lambda: ops.topk_blocks(hk, bound, indptr, args.k, top_q),
        "topm": lambda: ops.topk_blocks(hk, bound, indptr, m, cand),
        "rescore": lambda: ops.rescore_blocks_codes(geo, q, b8, sc, codes, indptr, indices, cand, rescored),
        "final_topk": lambda: ops.topk_blocks(hk, rescored, rows, args.k, top, index_map=cand),
    }
    for f in parts.values():
        f()
    torch.cuda.synchronize()
    out: dict = {"batch": args.batch, "ctx": args.ctx, "k": args.k, "m": m, "parts_us": {}, "variants": []}
    for name, f in parts.items():
        out["parts_us"][name] = time_graph(f) * 1e3

    def quest():
        parts["quest_score"]()
        parts["quest_topk"]()

    def staged():
        parts["quest_score"]()
        parts["topm"]()
        parts["rescore"]()
        parts["final_topk"]()

    out["parts_us"]["quest_chain"] = time_graph(quest) * 1e3
    out["parts_us"]["staged_chain"] = time_graph(staged) * 1e3
    out["ratio"] = out["parts_us"]["staged_chain"] / out["parts_us"]["quest_chain"]
    print(json.dumps(out["parts_us"]), f"ratio {out['ratio']:.3f}", flush=True)

    parts["rescore"]()
    torch.cuda.synchronize()
    ref = rescored.clone()
    scale = ref[torch.isfinite(ref)].abs().max().item()
    wheel_ms = timed(parts["rescore"])
    out["wheel_rescore_us"] = wheel_ms * 1e3
    print(f"wheel rescore {wheel_ms * 1e3:.1f} us (events, eager)", flush=True)

    c = {
        name: cp.asarray(t)
        for name, t in dict(
            q=q.view(torch.int16),
            b8=b8,
            sc=sc,
            codes=codes,
            indptr=indptr,
            indices=indices,
            scores=rescored,
            cand=cand,
        ).items()
    }

    def rescore_params(b8_ptr: int, codes_ptr: int, tile: int = 32) -> np.void:
        return params(
            ("q", "ptr", c["q"].data.ptr),
            ("bounds8", "ptr", b8_ptr),
            ("scales", "ptr", c["sc"].data.ptr),
            ("codes", "ptr", codes_ptr),
            ("blk_indptr", "ptr", c["indptr"].data.ptr),
            ("blk_indices", "ptr", c["indices"].data.ptr),
            ("scores", "ptr", c["scores"].data.ptr),
            ("cand", "ptr", c["cand"].data.ptr),
            ("num_seqs", "i32", args.batch),
            ("nnz", "i32", n_host),
            ("num_qo_heads", "i32", hq),
            ("num_kv_heads", "i32", hk),
            ("head_dim", "i32", d),
            ("block_size", "i32", bs),
            ("num_host_blocks", "i32", n_host),
            ("cand_m", "i32", m),
            ("tile", "i32", tile),
            ("_pad0", "i32", 0),
        )

    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # 256 MiB: past any L2
    out["wheel_rescore_cold_us"] = timed_cold(parts["rescore"], flush) * 1e3
    print(f"wheel rescore, cold L2: {out['wheel_rescore_cold_us']:.1f} us", flush=True)
    group = hq // hk
    n_out = args.batch * m
    ptrs = (c["b8"].data.ptr, c["codes"].data.ptr)
    sources = [("current", source(ROOT / "key_codes.cu"), ptrs)]
    for alt in args.source_alt:
        sources.append((Path(alt).stem, source(Path(alt)), ptrs))
    if args.record_layout:
        # An entry's bound and codes as one record (2 d E4M3 bytes, then 4 d code bytes; the
        # scales apart), the records in entry order: the staged copy reads one contiguous 768 B
        # (d 128) per entry instead of 256 and 512 B from two arrays. Only the staged
        # (tensor-core) path is patched, which every entry of these inputs takes.
        rec = torch.cat([b8.reshape(n_host * hk, -1), codes.reshape(n_host * hk, -1)], dim=1)
        rec = rec.contiguous()
        c["rec"] = cp.asarray(rec)
        old_s = "const unsigned char* src_b = bounds8 + entry * 2 * HD;"
        old_c = "const unsigned char* src_c = codes + entry * 4 * HD;"
        src = source(ROOT / "key_codes.cu")
        assert old_s in src and old_c in src
        src = src.replace(old_s, "const unsigned char* src_b = bounds8 + entry * 6 * HD;").replace(
            old_c, "const unsigned char* src_c = src_b + 2 * HD;"
        )
        sources.append(("record", src, (c["rec"].data.ptr, c["rec"].data.ptr)))
    for label, src, ptrs in sources:
        for over in VARIANTS:
            v = {**DEFAULTS, "tile": DEFAULTS["OASIS_CODES_TILE"], **over}
            pv = rescore_params(*ptrs, tile=v["tile"])
            fn = module({k: x for k, x in v.items() if k != "tile"}, src).get_function(
                "score_blocks_codes_bf16"
            )
            stage = v["OASIS_CODES_STAGES"] * (6 * d + 16)  # codes_stage_bytes
            smem = (THREADS // 32) * (stage + (2 * group * d + d + group) * 4)
            if smem > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = smem

            blocks = math.ceil(math.ceil(n_out / v["tile"]) / (THREADS // 32)) * hk

            def launch(fn=fn, smem=smem, blocks=blocks, pv=pv):
                fn((blocks,), (THREADS,), (pv,), shared_mem=smem)

            rescored.fill_(float("nan"))
            launch()
            cp.cuda.Device().synchronize()
            fin = torch.isfinite(ref)
            same_inf = bool(torch.equal(fin, torch.isfinite(rescored)))
            err = (rescored[fin] - ref[fin]).abs().max().item() / scale if fin.any() else 0.0
            ms = timed(launch)
            cold_ms = timed_cold(launch, flush)
            row = {
                "source": label,
                "variant": v,
                "us": ms * 1e3,
                "cold_us": cold_ms * 1e3,
                "regs": fn.num_regs,
                "smem": smem,
                "rel_err_vs_wheel": err,
                "same_finite": same_inf,
            }
            out["variants"].append(row)
            print(json.dumps(row), flush=True)
    # topk_blocks_f32 variants: the Quest top-k, the candidates' top-m and the last top-k.
    out["topk_variants"] = []
    parts["rescore"]()
    torch.cuda.synchronize()
    cand_ref, top_ref, topq_ref = cand.clone(), top.clone(), top_q.clone()
    cand2, top2, topq2 = torch.empty_like(cand), torch.empty_like(top), torch.empty_like(top_q)
    ct = {
        name: cp.asarray(t)
        for name, t in dict(
            bound=bound,
            rescored=rescored,
            indptr=indptr,
            rows=rows,
            cand=cand,
            cand2=cand2,
            top2=top2,
            topq2=topq2,
        ).items()
    }

    def tparams(scores, ip, dst, kk, nnz, imap=None, map_m=0):
        return params(
            ("scores", "ptr", ct[scores].data.ptr),
            ("blk_indptr", "ptr", ct[ip].data.ptr),
            ("out", "ptr", ct[dst].data.ptr),
            ("index_map", "ptr", ct[imap].data.ptr if imap else 0),
            ("num_kv_heads", "i32", hk),
            ("nnz", "i32", nnz),
            ("k", "i32", kk),
            ("map_m", "i32", map_m),
        )

    calls = {
        "quest_topk": (tparams("bound", "indptr", "topq2", args.k, n_host), topq2, topq_ref),
        "topm": (tparams("bound", "indptr", "cand2", m, n_host), cand2, cand_ref),
        "final_topk": (tparams("rescored", "rows", "top2", args.k, n_out, "cand", m), top2, top_ref),
    }
    for threads in (256, 512, 1024) if args.topk_variants else ():
        tfn = module({"OASIS_TOPK_THREADS": threads}).get_function("topk_blocks_f32")
        row = {"threads": threads}
        for name, (tp, dst, ref_t) in calls.items():

            def tl(tp=tp, tfn=tfn, threads=threads):
                tfn((args.batch, hk), (threads,), (tp,))

            dst.fill_(-7)
            tl()
            cp.cuda.Device().synchronize()
            row[name + "_us"] = timed(tl) * 1e3
            row[name + "_same"] = bool(torch.equal(dst, ref_t))
        out["topk_variants"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
