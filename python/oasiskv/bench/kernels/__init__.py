"""GPU kernel benchmark: every kernel against a ceiling measured in the same run.

    python -m oasiskv.bench.kernels [--preset qwen3-8b] [--json out.json] [--refcheck] [--quick]

Ceilings (measured here, not quoted): device-to-device copy bandwidth (bytes read + written),
pinned host-to-device copy bandwidth (one large cudaMemcpyAsync), torch SDPA (flash) over a
contiguous KV. Each kernel is timed with CUDA events after warm-up; the median of the repeats is
reported, with the ratio to its ceiling and the target the GPU issue sets.

Rows: sparse attention over bf16 pages and over fp8_e4m3 pages (codes + scales; vs d2d; each
tensor-core kernel of ``ops.set_kv8_attention_kernel``), dense
attention (vs d2d and SDPA), the gather from a pinned bf16 host pool and from a pinned fp8_e4m3
host pool into bf16 slots (bytes read over PCIe; vs pinned H2D), the Quest / codes scores and the
two-stage chains (``--only score``: these alone), delta select. ``--refcheck`` compares the
attention rows (bf16 and fp8) with the CPU twin (max abs error) and the fp8 gather bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .attention import AttentionInputs, attention_inputs, attention_rows, bench_attention
from .common import PRESETS, ceilings, i32, kernel_breakdown, time_both, time_cuda, time_graph, uva_view
from .gather import (
    bench_gather,
    bench_gather_kv8,
    gather_plan,
    gather_rows,
    kv8_bytes,
    kv8_gather_refcheck,
    kv8_host_pool,
    kv8_pages,
)
from .score import (
    bench_score,
    bench_score_codes,
    bench_score_codes_staged,
    bench_select,
    codes_candidate_bytes,
    codes_inputs,
    score_rows,
)

__all__ = [
    "PRESETS",
    "AttentionInputs",
    "attention_inputs",
    "attention_rows",
    "bench_attention",
    "bench_gather",
    "bench_gather_kv8",
    "bench_score",
    "bench_score_codes",
    "bench_score_codes_staged",
    "bench_select",
    "ceilings",
    "codes_candidate_bytes",
    "codes_inputs",
    "gather_plan",
    "gather_rows",
    "i32",
    "kernel_breakdown",
    "kv8_bytes",
    "kv8_gather_refcheck",
    "kv8_host_pool",
    "kv8_pages",
    "main",
    "report_lines",
    "score_rows",
    "time_both",
    "time_cuda",
    "time_graph",
    "uva_view",
]


def report_lines(res: dict) -> list[str]:
    """The printed report of a run's results (``main``'s JSON): the device, the ceilings, one line per
    row with its ratios, refcheck and target."""
    ceil = res["ceilings"]
    d2d, h2d, sm = ceil["d2d_copy_Bps"], ceil["h2d_pinned_Bps"], ceil["h2d_sm_Bps"]
    lines = [f"{res['device']}  preset {res['preset']}  {res['dtype']}"]
    lines.append("kernel times: CUDA-graph replay per call (eager call incl. host launch cost in brackets)")
    lines.append(
        f"ceilings: d2d copy {d2d / 1e12:.2f} TB/s (read+write), pinned H2D {h2d / 1e9:.1f} GB/s "
        f"(copy engines), SM reads of pinned memory {'-' if sm is None else f'{sm / 1e9:.1f}'} GB/s"
    )
    for r in res["kernels"]:
        parts = [f"{r['label']:<48} {r['ms'] * 1e3:9.1f} us (eager {r.get('eager_ms', r['ms']) * 1e3:7.1f})"]
        if "Bps" in r:
            parts.append(f"{r['Bps'] / 1e9:8.1f} GB/s")
        for key in ("ratio_to_d2d", "ratio_to_sdpa", "ratio_to_h2d", "ratio_to_h2d_sm", "ratio_to_quest"):
            if key in r:
                parts.append(f"{key[9:]} {r[key]:.2f}")
        if "refcheck_max_abs_err" in r:
            parts.append(f"err {r['refcheck_max_abs_err']:.1e}")
        if "refcheck_bitwise" in r:
            parts.append("bitwise = twin" if r["refcheck_bitwise"] else "DIFFERS FROM THE TWIN")
        if "rescore_ms" in r:
            parts.append(f"codes of the candidates {r['rescore_ms'] * 1e3:.1f} us")
        parts.append(f"[target {r['target']}]")
        lines.append("  ".join(parts))
        if "kernels_us" in r:
            lines.append(
                "      kernels: " + ", ".join(f"{k}: {v:.1f} us" for k, v in r["kernels_us"].items())
            )
        if "splits_ms" in r:
            lines.append(
                "      splits: "
                + ", ".join(
                    f"{k}: {v * 1e3:.1f} us" if isinstance(v, float) else f"{k}: {v}"
                    for k, v in r["splits_ms"].items()
                )
            )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m oasiskv.bench.kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--refcheck", action="store_true", help="check GPU outputs against the CPU twin once")
    ap.add_argument("--quick", action="store_true", help="smaller batches (smoke test)")
    ap.add_argument("--sweep-splits", action="store_true", help="also time attention at fixed split counts")
    ap.add_argument(
        "--only",
        choices=["score", "attention", "gather"],
        help="only these rows: 'score' = the Quest and codes scores with their top-K (issue 12's rows); "
        "'attention' = sparse attention over bf16 and fp8 pages; 'gather' = the gathers from bf16 and fp8 "
        "host pools",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also each kernel's device time in the two-stage rows (torch profiler; 'kernels_us')",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("oasiskv.bench.kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    from oasiskv import ops

    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    p = PRESETS[args.preset]
    geo = ops.KvGeometry(p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["block_size"])
    ceil = ceilings(dev)
    d2d = ceil["d2d_copy_Bps"]
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "preset": args.preset,
        "dtype": args.dtype,
        "ceilings": ceil,
        "kernels": [],
    }

    def want(rows: str) -> bool:
        return args.only in (None, rows)

    if want("attention"):
        res["kernels"] += attention_rows(ops, geo, dev, dtype, args, d2d)
    if want("gather"):
        res["kernels"] += gather_rows(ops, geo, dev, dtype, args, ceil)
    if want("score"):
        res["kernels"] += score_rows(ops, geo, dev, dtype, args, d2d)
    if not args.only:
        sel = bench_select(ops, geo, dev, 64 if args.quick else 256, 128, 7)
        sel["target"] = "<= 20 us per layer"
        res["kernels"].append(sel)

    print("\n".join(report_lines(res)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
