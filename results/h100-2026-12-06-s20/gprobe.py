"""s20: the bf16 gather of bench.kernels (65536 entries of 8 KiB, default launch), five times,
with whatever oasiskv PYTHONPATH gives: the same-lease check of the old wheel against the new."""
import sys

import torch

from oasiskv import ops
from oasiskv.bench import kernels as bk

dev = torch.device("cuda", 0)
geo = ops.KvGeometry(32, 8, 128, 16)
h2d = bk.ceilings(dev)["h2d_pinned_Bps"]
for i in range(4):
    r = bk.bench_gather(ops, geo, dev, torch.bfloat16, 8 * 128 * 64, h2d)
    print(sys.argv[1], r["label"], f"{r['ms'] * 1e3:.1f} us", f"{r['Bps'] / 1e9:.1f} GB/s", f"h2d {r['ratio_to_h2d']:.2f}", flush=True)
print(sys.argv[1], "launch", ops.gather_launch() if hasattr(ops, "gather_launch") else None)
if len(sys.argv) > 2:  # the fp8 gather's launch sweep (new wheel): max_blocks x warps x stage
    base = ops.gather_launch()
    for mb, wpb, stage in [(4, 4, 6), (8, 4, 6), (16, 4, 6), (32, 4, 6), (16, 4, 3), (32, 4, 3), (64, 4, 2), (132, 4, 2), (0, 4, 0)]:
        ops.set_gather_launch(max_blocks=mb, warps_per_block=wpb, entries_per_warp=32 if mb else 8, stage_entries=stage)
        r = bk.bench_gather_kv8(ops, geo, dev, torch.bfloat16, 8 * 128 * 64, h2d, False)
        b = bk.bench_gather(ops, geo, dev, torch.bfloat16, 8 * 128 * 64, h2d)
        print("sweep", mb, wpb, stage, f"fp8 {r['ms'] * 1e3:.0f} us h2d {r['ratio_to_h2d']:.2f}", f"bf16 {b['ms'] * 1e3:.0f} us h2d {b['ratio_to_h2d']:.2f}", flush=True)
    ops.set_gather_launch(*base)
