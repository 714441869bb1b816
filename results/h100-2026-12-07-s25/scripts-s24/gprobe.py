"""s24: the bf16 gather of bench.kernels (65,536 entries of 8 KiB, default launch) twice, then the
fp8 gather (65,536 entries of 16 x 128 codes + scales into bf16) under set_gather_launch(kv8=True)
shapes (max_blocks, warps, entries_per_warp, stage): the register launch (the default) and staged
ones (two halves in flight since s24), with the twin refcheck on the first."""
import torch

from oasiskv import ops
from oasiskv.bench import kernels as bk

dev = torch.device("cuda", 0)
geo = ops.KvGeometry(32, 8, 128, 16)
h2d = bk.ceilings(dev)["h2d_pinned_Bps"]
print("h2d GB/s", round(h2d / 1e9, 1), flush=True)
for i in range(2):
    r = bk.bench_gather(ops, geo, dev, torch.bfloat16, 8 * 128 * 64, h2d)
    print("bf16", ops.gather_launch(), f"{r['ms'] * 1e3:.0f} us h2d {r['ratio_to_h2d']:.2f}", flush=True)
base = ops.gather_launch(kv8=True)
shapes = [None, (4, 4, 32, 6), (8, 4, 32, 6), (16, 4, 32, 6), (32, 4, 32, 6), (16, 4, 32, 3), (132, 4, 32, 3), (0, 4, 8, 0)]
for i, shape in enumerate(shapes):
    if shape is not None:
        ops.set_gather_launch(*shape, kv8=True)
    r = bk.bench_gather_kv8(ops, geo, dev, torch.bfloat16, 8 * 128 * 64, h2d, i < 2)
    print("fp8", ops.gather_launch(kv8=True), f"{r['ms'] * 1e3:.0f} us h2d {r['ratio_to_h2d']:.2f}",
          "refcheck", r.get("refcheck_bitwise"), flush=True)
ops.set_gather_launch(*base, kv8=True)
