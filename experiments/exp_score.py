"""Compile variants of cuda/score_blocks.cu (its #ifndef knobs) with CuPy's NVRTC and time them.

    python3 experiments/exp_score.py [--batch 64] [--ctx 32768] [--k 128]

An experiment tool for the GPU machine (CuPy and torch there, no cargo): it checks each variant's
scores and top-K against the default build and prints each against the device-to-device copy
bandwidth measured in the same run (the ratio `python -m oasiskv.bench.kernels` reports).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import cupy as cp
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1] / "cuda"


# The defaults of cuda/score_blocks.cu's knobs (what oasis-cuda builds); each variant overrides some.
SCORE_DEFAULTS = {
    "OASIS_SCORE_THREADS": 256,
    "OASIS_SCORE_MIN_BLOCKS": 4,
    "OASIS_SCORE_UMAX": 8,
    "OASIS_SCORE_HEAD_MAJOR": 1,
}
VARIANTS = [
    {"OASIS_SCORE_MIN_BLOCKS": 2, "OASIS_SCORE_UMAX": 16, "OASIS_SCORE_HEAD_MAJOR": 0},  # the first version
    {"OASIS_SCORE_MIN_BLOCKS": 2, "OASIS_SCORE_UMAX": 16},
    {"OASIS_SCORE_MIN_BLOCKS": 3, "OASIS_SCORE_HEAD_MAJOR": 0},
    {"OASIS_SCORE_HEAD_MAJOR": 0},
    {},  # the defaults
    {"OASIS_SCORE_UMAX": 16, "OASIS_SCORE_HEAD_MAJOR": 0},
    {"OASIS_SCORE_MIN_BLOCKS": 6, "OASIS_SCORE_UMAX": 4, "OASIS_SCORE_HEAD_MAJOR": 0},
    {"OASIS_SCORE_MIN_BLOCKS": 8, "OASIS_SCORE_UMAX": 4, "OASIS_SCORE_HEAD_MAJOR": 0},
    {"OASIS_SCORE_MIN_BLOCKS": 8, "OASIS_SCORE_UMAX": 2, "OASIS_SCORE_HEAD_MAJOR": 0},
    {"OASIS_SCORE_THREADS": 128, "OASIS_SCORE_MIN_BLOCKS": 8, "OASIS_SCORE_HEAD_MAJOR": 0},
    {"OASIS_SCORE_THREADS": 512, "OASIS_SCORE_MIN_BLOCKS": 2, "OASIS_SCORE_HEAD_MAJOR": 0},
    {"OASIS_SCORE_THREADS": 512, "OASIS_SCORE_UMAX": 4, "OASIS_SCORE_HEAD_MAJOR": 0},
]
# Threads per block of topk_blocks_f32 to try (OASIS_TOPK_THREADS; the default is 512).
TOPK_THREADS = [512, 256, 1024]


def source(path: Path = ROOT / "score_blocks.cu") -> str:
    """A kernel file with the project's headers inlined (what CuPy's NVRTC compiles, and the text
    exp_codes.py patches: key_codes.cu's tensor-core path is in oasis_codes_tc.cuh)."""
    src = path.read_text()
    for header in ("oasis_common.cuh", "oasis_params.cuh", "oasis_topk.cuh", "oasis_codes_tc.cuh"):
        src = src.replace(f'#include "{header}"', (ROOT / header).read_text())
    return src


def params(*fields: tuple[str, str, int]) -> np.void:
    """A kernel's parameter struct (cuda/oasis_params.cuh) as a NumPy structured scalar, which CuPy
    passes by value: ``(name, "ptr" | "i32", value)`` in the C field order. Pointers first, then
    4-byte ints, padded to 8 bytes as the header does (``_pad0``)."""
    fmt = {"ptr": np.uint64, "i32": np.int32}
    dt = np.dtype({"names": [f[0] for f in fields], "formats": [fmt[f[1]] for f in fields]}, align=True)
    assert dt.itemsize % 8 == 0, "add the struct's _pad0 field"
    v = np.zeros((), dtype=dt)
    for name, _, value in fields:
        v[name] = value
    return v[()]


def module(defs: dict, src: str | None = None) -> cp.RawModule:
    """``src`` (default: score_blocks.cu) compiled for sm_90 with the knobs ``defs``."""
    opts = ("-std=c++17", "--gpu-architecture=sm_90", "-default-device") + tuple(
        f"-D{k}={v}" for k, v in defs.items()
    )
    return cp.RawModule(code=source() if src is None else src, options=opts)


def timed(fn, calls=20, repeat=15) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda"
    hq, hk, d, bs = 32, 8, 128, 16
    nb = args.ctx // bs
    n_host = args.batch * nb
    torch.manual_seed(0)
    summ = torch.randn(n_host, hk, 2, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(args.batch, hq, d, device=dev, dtype=torch.bfloat16)
    indptr = torch.arange(0, n_host + 1, nb, device=dev, dtype=torch.int32)
    indices = torch.randperm(n_host, device=dev).to(torch.int32)
    scores = torch.empty(n_host, hk, device=dev, dtype=torch.float32)
    top = torch.empty(args.batch, hk, args.k, device=dev, dtype=torch.int32)
    c_summ, c_q = cp.asarray(summ.view(torch.int16)), cp.asarray(q.view(torch.int16))
    c_ip, c_ix, c_sc, c_top = (cp.asarray(t) for t in (indptr, indices, scores, top))

    big = torch.empty(256 << 20, device=dev, dtype=torch.float32)
    big2 = torch.empty_like(big)
    copy_ms = timed(lambda: big2.copy_(big), calls=5, repeat=10)
    copy_bps = 2 * big.numel() * 4 / (copy_ms * 1e-3)
    sb = n_host * hk * 2 * d * 2
    print(f"copy {copy_bps / 1e12:.2f} TB/s; summaries {sb / 2**20:.0f} MiB", flush=True)

    # oasis::ScoreBlocksParams<oasis::bf16>
    sargs = (
        params(
            ("q", "ptr", c_q.data.ptr),
            ("summaries", "ptr", c_summ.data.ptr),
            ("blk_indptr", "ptr", c_ip.data.ptr),
            ("blk_indices", "ptr", c_ix.data.ptr),
            ("scores", "ptr", c_sc.data.ptr),
            ("num_seqs", "i32", args.batch),
            ("nnz", "i32", n_host),
            ("num_qo_heads", "i32", hq),
            ("num_kv_heads", "i32", hk),
            ("head_dim", "i32", d),
            ("num_host_blocks", "i32", n_host),
        ),
    )

    def score_launcher(v: dict):
        """The compiled variant ``v`` (every knob given) and a closure launching it on the data."""
        fn = module(v).get_function("score_blocks_bf16")
        threads = v["OASIS_SCORE_THREADS"]
        wpb = threads // 32
        tiles = -(-n_host // 32)
        blocks = -(-tiles // wpb) * hk if v["OASIS_SCORE_HEAD_MAJOR"] else -(-(tiles * hk) // wpb)
        return fn, lambda: fn((blocks,), (threads,), sargs)

    ref_scores = ref_top = None
    rows = []
    for over in VARIANTS:
        v = {**SCORE_DEFAULTS, **over}
        fn, launch = score_launcher(v)
        scores.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        if ref_scores is None:
            ref_scores = scores.clone()
        err = (scores - ref_scores).abs().max().item()
        ms = timed(launch)
        row = {
            "variant": v,
            "ms": ms,
            "ratio": sb / (ms * 1e-3) / copy_bps,
            "max_err_vs_first": err,
            "regs": fn.num_regs,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    _, score = score_launcher(min(rows, key=lambda r: r["ms"])["variant"])
    for tt in TOPK_THREADS:
        tfn = module({"OASIS_TOPK_THREADS": tt}).get_function("topk_blocks_f32")
        # oasis::TopkBlocksParams
        targs = (
            params(
                ("scores", "ptr", c_sc.data.ptr),
                ("blk_indptr", "ptr", c_ip.data.ptr),
                ("out", "ptr", c_top.data.ptr),
                ("num_kv_heads", "i32", hk),
                ("nnz", "i32", n_host),
                ("k", "i32", args.k),
                ("_pad0", "i32", 0),
            ),
        )

        def topk(tfn=tfn, tt=tt, targs=targs):
            tfn((args.batch, hk), (tt,), targs)

        def both(topk=topk):
            score()
            topk()

        top.fill_(-7)
        both()
        torch.cuda.synchronize()
        if ref_top is None:
            ref_top = top.clone()
        same = bool(torch.equal(top, ref_top))
        ms_t = timed(topk)
        ms_b = timed(both)
        row = {
            "topk_threads": tt,
            "topk_ms": ms_t,
            "both_ms": ms_b,
            "ratio_both": sb / (ms_b * 1e-3) / copy_bps,
            "same_as_first": same,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_Bps": copy_bps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
