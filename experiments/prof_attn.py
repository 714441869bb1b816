"""Why does the fp8 decode attention read at 0.70 x the copy ceiling while the bf16 one reads at
1.00 x? (issue 36's 0.8.) A driver for Nsight Compute, not the product: it builds the inputs of
`bench.kernels`' sparse attention rows (`attention_inputs`: Qwen3-8B heads, 129 random pages per
sequence, two query rows, the extra row, a page map) and launches one kernel configuration
`--calls` times, so that `ncu -k regex:decode_attn --launch-skip 2 --launch-count 1` profiles
one warm launch of it.

Usage (on the GPU machine):
  ncu --section SpeedOfLight --section Occupancy --section WarpStateStats ... \\
      python experiments/prof_attn.py --kernel registers --batch 256
  python experiments/prof_attn.py --kernel registers --batch 256 --time   # timing only, no ncu

`--kernel`: `bf16` (bf16 pages), or an fp8 kernel of `ops.set_kv8_attention_kernel` (`tile`,
`registers`, `registers-deep`). `--splits N` forces the split count (0: the planner's).
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", default="registers", choices=["bf16", "tile", "registers", "registers-deep"])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--pages", type=int, default=129, help="pages per sequence")
    ap.add_argument("--splits", type=int, default=0, help="split count; 0: the planner's")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--time", action="store_true", help="print the mean time of --calls launches")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("prof_attn.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from oasiskv import ops
    from oasiskv.bench.kernels import PRESETS, attention_inputs

    dev = torch.device("cuda")
    p = PRESETS["qwen3-8b"]
    geo = ops.KvGeometry(p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["block_size"])
    kv8 = args.kernel != "bf16"
    if kv8:
        ops.set_kv8_attention_kernel(args.kernel)
    inp = attention_inputs(ops, geo, dev, torch.bfloat16, args.batch, args.pages, sparse=True, kv8=kv8)
    nbytes = inp.bytes_read

    def run():
        inp.run(ops, args.splits)

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    start.record()
    for _ in range(args.calls):
        run()
    end.record()
    torch.cuda.synchronize()
    if args.time:
        ms = start.elapsed_time(end) / args.calls
        print(
            f"{args.kernel} batch {args.batch} splits {args.splits}: {ms * 1e3:.1f} us, "
            f"{nbytes / (ms * 1e-3) / 1e9:.1f} GB/s of pages"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
