"""``bench.kernels``' gather rows: block-head entries from a pinned bf16 or fp8 host pool into
the GPU slots, read over PCIe (UVA), against pinned H2D and the host's SM-read ceiling; the plan,
the fp8 pool and pages, and the bit-for-bit check against the CPU twin."""

from __future__ import annotations

import torch

from .common import i32, time_both


def gather_plan(geo, dev, n_entries: int, n_host: int) -> tuple[list[torch.Tensor], int]:
    """The gather rows' plan: ``n_entries`` block-head entries over sequences of budget = fetch
    cap = 128 (at least one sequence), every entry a distinct slot of a random block of its
    sequence's share of the ``n_host`` host blocks. ``([plan_slots, plan_blocks, slot_pages,
    host_indptr, host_indices], num_seqs)``; the slots are pages ``0..num_seqs * 128``."""
    hk = geo.num_kv_heads
    budget = cap = 128
    seqs = max(1, n_entries // (hk * cap))
    per = n_host // seqs
    plan_slots = torch.arange(cap, dtype=torch.int32).repeat(seqs, hk, 1).to(dev)
    plan_blocks = torch.randint(0, per, (seqs, hk, cap), dtype=torch.int32).to(dev)
    slot_pages = torch.arange(seqs * budget, dtype=torch.int32).view(seqs, budget).to(dev)
    host_indptr = i32(list(range(0, seqs * per + 1, per)), dev)
    host_indices = torch.randperm(n_host, dtype=torch.int32)[: seqs * per].to(dev)
    return [plan_slots, plan_blocks, slot_pages, host_indptr, host_indices], seqs


def kv8_host_pool(geo, rows: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``rows`` fp8_e4m3 host pool rows: random codes (NaN codes too: the
    gather copies whatever is there) and power-of-two scales, pinned when ``pin``."""
    hk, b, d = geo.num_kv_heads, geo.block_size, geo.head_dim
    codes = torch.randint(0, 256, (rows, hk, b, d), dtype=torch.uint8)
    scales = torch.exp2(torch.randint(-12, 4, (rows, hk)).float())
    return (codes.pin_memory(), scales.pin_memory()) if pin else (codes, scales)


def kv8_pages(ops, geo, dev, dtype, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``rows`` fp8_e4m3 pages on ``dev``: random ``dtype`` values
    quantized by ``ops.quantize_kv8`` (finite, the engine's scales), every row valid."""
    codes, scales = ops.empty_kv8(geo, rows, dev)
    hk, b, d = geo.num_kv_heads, geo.block_size, geo.head_dim
    chunk = 4096  # pages per quantize call: bounds the float staging buffer. Arbitrary.
    for at in range(0, rows, chunk):
        n = min(chunk, rows - at)
        src = torch.randn(n, hk, b, d, device=dev, dtype=dtype)
        full = torch.full((n,), b, dtype=torch.int32, device=dev)
        ops.quantize_kv8(geo, src, full, codes[at : at + n], scales[at : at + n])
    return codes, scales


def kv8_bytes(geo, entries: int) -> int:
    """Bytes of K and V read for ``entries`` fp8_e4m3 block-head entries (a page holds
    ``num_kv_heads``): the codes, one byte a value, and the two f32 scales of each."""
    return 2 * entries * (geo.block_size * geo.head_dim + 4)


def bench_gather(ops, geo, dev, dtype, n_entries: int, h2d: float) -> dict:
    hk, d, b = geo.num_kv_heads, geo.head_dim, geo.block_size
    n_host = 8192
    host_k = torch.randn(n_host, hk, b, d, dtype=dtype).pin_memory()
    host_v = torch.randn(n_host, hk, b, d, dtype=dtype).pin_memory()
    tabs, seqs = gather_plan(geo, dev, n_entries, n_host)
    k_pages = torch.empty(seqs * 128, hk, b, d, device=dev, dtype=dtype)
    v_pages = torch.empty_like(k_pages)

    def run():
        ops.gather_blocks(geo, *tabs, host_k, host_v, k_pages, v_pages)

    ms, eager = time_both(run)
    entries = tabs[0].numel()
    moved = entries * 2 * b * d * dtype.itemsize
    return {
        "label": f"gather {entries} entries of {2 * b * d * dtype.itemsize // 1024} KiB (K+V)",
        "ms": ms,
        "eager_ms": eager,
        "bytes": moved,
        "Bps": moved / (ms * 1e-3),
        "ratio_to_h2d": moved / (ms * 1e-3) / h2d,
    }


def bench_gather_kv8(
    ops, geo, dev, dtype, n_entries: int, h2d: float, refcheck: bool, *, fp8_pages: bool = False
) -> dict:
    """:func:`bench_gather`'s plan from a pinned fp8_e4m3 host pool (``KvConfig(host_kv_dtype=
    "fp8_e4m3")``) into ``dtype`` slots, dequantized by the gather; with ``fp8_pages``, into
    fp8_e4m3 pages (``KvConfig(kv_dtype="fp8_e4m3")``: codes and scales copied, no conversion).
    ``bytes``: what crosses PCIe, the codes and the two scales of each entry. ``refcheck``: the
    first sequence's slots (codes) against the CPU twin, bit for bit (``refcheck_bitwise``)."""
    hk, d, b = geo.num_kv_heads, geo.head_dim, geo.block_size
    n_host = 8192
    host_k, host_ks = kv8_host_pool(geo, n_host, pin=True)
    host_v, host_vs = kv8_host_pool(geo, n_host, pin=True)
    tabs, seqs = gather_plan(geo, dev, n_entries, n_host)
    pool = dict(host_k_scales=host_ks, host_v_scales=host_vs)
    if fp8_pages:
        k_pages, ks = ops.empty_kv8(geo, seqs * 128, dev)
        v_pages, vs = ops.empty_kv8(geo, seqs * 128, dev)
        dst = dict(k_scales=ks, v_scales=vs)
    else:
        k_pages = torch.empty(seqs * 128, hk, b, d, device=dev, dtype=dtype)
        v_pages = torch.empty_like(k_pages)
        dst = {}

    def run():
        ops.gather_blocks(geo, *tabs, host_k, host_v, k_pages, v_pages, **pool, **dst)

    ms, eager = time_both(run)
    entries = tabs[0].numel()
    moved = kv8_bytes(geo, entries)
    into = "fp8 pages" if fp8_pages else str(dtype)[6:]
    r = {
        "label": f"fp8 gather {entries} entries of {2 * b * d // 1024} KiB+scales -> {into}",
        "ms": ms,
        "eager_ms": eager,
        "bytes": moved,
        "Bps": moved / (ms * 1e-3),
        "ratio_to_h2d": moved / (ms * 1e-3) / h2d,
    }
    if refcheck:
        r["refcheck_bitwise"] = kv8_gather_refcheck(ops, geo, tabs, host_k, host_v, pool, k_pages, v_pages)
    return r


def kv8_gather_refcheck(ops, geo, tabs, host_k, host_v, pool, k_pages, v_pages) -> bool:
    """Whether the first sequence's slots (pages ``0..128`` of ``k_pages``/``v_pages``, after a
    gather of ``tabs``) equal the CPU twin's gather of that sequence's plan, bit for bit (the
    codes, for fp8_e4m3 pages: uint8 ``k_pages``, whose twin gather also takes page scales)."""
    slots, blocks, slot_pages, indptr, indices = (t.cpu() for t in tabs)
    budget = slot_pages.shape[1]
    kp = torch.zeros((budget, *k_pages.shape[1:]), dtype=k_pages.dtype)
    vp = torch.zeros_like(kp)
    if k_pages.dtype == torch.uint8:
        scales = torch.zeros(budget, geo.num_kv_heads, dtype=torch.float32)
        pool = {**pool, "k_scales": scales, "v_scales": scales.clone()}
    row = indices[: int(indptr[1])]  # the first sequence's CSR row
    ops.gather_blocks(
        geo, slots[:1], blocks[:1], slot_pages[:1], indptr[:2], row, host_k, host_v, kp, vp, **pool
    )
    got = [t[:budget].cpu().view(torch.uint8) for t in (k_pages, v_pages)]
    return all(torch.equal(a, w.view(torch.uint8)) for a, w in zip(got, (kp, vp), strict=True))


def gather_rows(ops, geo, dev, dtype, args, ceil: dict) -> list[dict]:
    """The gathers from a bf16 and an fp8 host pool (into bf16 pages, and into fp8 pages under both
    launches) against pinned H2D and the host's SM-read ceiling: the rows of ``--only gather``."""
    h2d = ceil["h2d_pinned_Bps"]
    n_entries = 8 * 128 * (16 if args.quick else 64)
    g = bench_gather(ops, geo, dev, dtype, n_entries, h2d)
    g["target"] = ">= 0.9 x pinned H2D memcpy"
    g8 = bench_gather_kv8(ops, geo, dev, dtype, n_entries, h2d, args.refcheck)
    g8["target"] = ">= 0.9 x pinned H2D memcpy (issue 36)"
    rows = [g, g8]
    # Into fp8 pages (no conversion) under the kv8 launch (registers) and under the float
    # pools' staged launch, which the conversion kept off kv8 gathers (s20).
    launch = ops.gather_launch(kv8=True)
    try:
        for shape in (launch, ops.gather_launch()):
            ops.set_gather_launch(*shape, kv8=True)
            r8 = bench_gather_kv8(ops, geo, dev, dtype, n_entries, h2d, args.refcheck, fp8_pages=True)
            r8["label"] += f", launch {shape}"
            r8["target"] = ">= 0.9 x pinned H2D memcpy (issue 36)"
            rows.append(r8)
    finally:
        ops.set_gather_launch(*launch, kv8=True)
    if ceil["h2d_sm_Bps"]:  # the same bytes against what an SM kernel reads of host memory
        for row in rows:
            row["ratio_to_h2d_sm"] = row["Bps"] / ceil["h2d_sm_Bps"]
    return rows
