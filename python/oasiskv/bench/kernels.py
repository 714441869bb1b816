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
import dataclasses
import json
import math
import statistics
import sys

import torch

from ..models.config import PRESETS as MODEL_PRESETS

#: The kernels' geometry of the model presets benchmarked here (heads from the model's config,
#: blocks of 16 tokens).
PRESETS = {
    name: {
        "num_qo_heads": MODEL_PRESETS[name].num_attention_heads,
        "num_kv_heads": MODEL_PRESETS[name].num_key_value_heads,
        "head_dim": MODEL_PRESETS[name].head_dim,
        "block_size": 16,
    }
    for name in ("qwen3-8b", "qwen3-8b-128k", "llama3.1-8b")
}


def time_cuda(fn, warmup: int = 5, repeat: int = 20) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` eager calls, timed with CUDA events.

    NOTE: an eager call includes the host-side launch cost (Python, argument validation); when that
    exceeds the kernel time the GPU idles between the events. :func:`time_graph` removes it.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_graph(fn, calls: int = 10, repeat: int = 20) -> float | None:
    """Median milliseconds per call of ``fn`` captured ``calls`` times into one CUDA graph and
    replayed: the device time of the kernels without host launch gaps (how a serving loop with
    CUDA graphs runs them). None when the call cannot be captured."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as e:  # noqa: BLE001 - report and fall back to eager timing
        print(
            f"graph capture failed ({type(e).__name__}: {str(e)[:120]}); eager timing only", file=sys.stderr
        )
        torch.cuda.synchronize()
        return None
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def time_both(fn) -> tuple[float, float]:
    """(milliseconds used for the ratios, eager milliseconds): graph-replayed when capturable."""
    eager = time_cuda(fn)
    g = time_graph(fn)
    return (g if g is not None else eager), eager


def kernel_breakdown(fn, calls: int = 20) -> dict[str, float]:
    """Device microseconds per call of each kernel ``fn`` launches (torch profiler over ``calls``
    eager calls): where a chain's time goes. Graph time minus their sum is the gaps between
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if t > 0:
            out[ev.key[:60]] = round(t / calls, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def i32(x, dev):
    return torch.as_tensor(x, dtype=torch.int32).to(dev)


def uva_view(host: torch.Tensor, dev) -> torch.Tensor:
    """A pinned, contiguous CPU tensor as a CUDA tensor over the same bytes (unified addressing):
    kernels that read it issue their loads over PCIe, as the gathers do. torch takes the pointer
    through ``__cuda_array_interface__`` (it accepts host memory registered with CUDA)."""

    class _Host:
        __cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": {torch.int32: "<i4", torch.uint8: "|u1"}[host.dtype],
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }

    return torch.as_tensor(_Host(), device=dev)


def ceilings(dev) -> dict:
    """The copy ceilings the rows are ratios to: ``d2d_copy_Bps`` (a device copy, read + write),
    ``h2d_pinned_Bps`` (one cudaMemcpy of pinned host memory: the copy engines), and
    ``h2d_sm_Bps``: pinned host memory read by an SM kernel (torch's elementwise ``bitwise_not``
    over :func:`uva_view`), the path every gather takes. On some hosts SM reads of host memory run
    well below the copy engines (34 against 55 GB/s on the H100 hosts of s20-s27; 51 on s28's),
    so a gather's ``ratio_to_h2d`` is bounded by ``h2d_sm_Bps / h2d_pinned_Bps``; None where
    torch refuses the view."""
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src))
    d2d = 2 * n / (ms * 1e-3)
    host = torch.empty(n // 4, dtype=torch.uint8).pin_memory()
    dh = torch.empty(n // 4, dtype=torch.uint8, device=dev)
    ms = time_cuda(lambda: dh.copy_(host, non_blocking=True))
    h2d = (n // 4) / (ms * 1e-3)
    try:
        words = uva_view(host.view(torch.int32), dev)
        out = dh.view(torch.int32)
        ms = time_cuda(lambda: torch.bitwise_not(words, out=out))
        ok = bool(torch.equal(out.cpu(), torch.bitwise_not(host.view(torch.int32))))
        h2d_sm = (n // 4) / (ms * 1e-3) if ok else None
    except (RuntimeError, TypeError, ValueError) as e:  # torch refused the view: say so, go on
        print(f"no SM read ceiling ({e})", file=sys.stderr)
        h2d_sm = None
    return {"d2d_copy_Bps": d2d, "h2d_pinned_Bps": h2d, "h2d_sm_Bps": h2d_sm}


@dataclasses.dataclass
class AttentionInputs:
    """The inputs of one :func:`bench_attention` case (:func:`attention_inputs`): the pages, their
    table and queries on the device, ``scales`` the kv8 pages' (empty for T pages), and
    ``bytes_read``, the K and V bytes one call reads."""

    geo: object
    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    indptr: torch.Tensor
    perm: torch.Tensor
    last: torch.Tensor
    page_map: torch.Tensor
    extra_k: torch.Tensor | None
    extra_v: torch.Tensor | None
    out: torch.Tensor
    pages_per_seq: int
    scales: dict
    bytes_read: int

    def run(self, ops, num_splits: int = 0) -> None:
        """One ``ops.decode_attention`` call into ``out`` (``num_splits`` 0: the planner's count)."""
        ops.decode_attention(
            self.geo,
            self.q,
            self.k_pages,
            self.v_pages,
            self.indptr,
            self.perm,
            self.last,
            page_map=self.page_map,
            extra_k=self.extra_k,
            extra_v=self.extra_v,
            out=self.out,
            max_pages_per_seq=self.pages_per_seq,
            num_splits=num_splits,
            **self.scales,
        )


def attention_inputs(
    ops, geo, dev, dtype, batch: int, pages_per_seq: int, sparse: bool, kv8: bool = False
) -> AttentionInputs:
    """``batch`` sequences of ``pages_per_seq`` random pages (``sparse``: two query rows, the extra
    current row and a page map, as the sparse step; else one row). ``kv8``: fp8_e4m3 pages
    (:func:`kv8_pages`), ``bytes_read`` = codes + scales."""
    hq, hk, d, b = geo.num_qo_heads, geo.num_kv_heads, geo.head_dim, geo.block_size
    num_pages = batch * pages_per_seq
    scales = {}
    if kv8:
        k_pages, k_scales = kv8_pages(ops, geo, dev, dtype, num_pages)
        v_pages, v_scales = kv8_pages(ops, geo, dev, dtype, num_pages)
        scales = dict(k_scales=k_scales, v_scales=v_scales)
    else:
        k_pages = torch.randn(num_pages, hk, b, d, device=dev, dtype=dtype)
        v_pages = torch.randn_like(k_pages)
    rows = 2 if sparse else 1
    q = torch.randn(batch, rows, hq, d, device=dev, dtype=dtype)
    extra_k = torch.randn(batch, hk, d, device=dev, dtype=dtype) if sparse else None
    return AttentionInputs(
        geo=geo,
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        indptr=i32(torch.arange(0, num_pages + 1, pages_per_seq), dev),
        perm=torch.randperm(num_pages, device=dev).to(torch.int32),
        last=i32([b] * batch, dev),
        page_map=torch.zeros(num_pages, hk, dtype=torch.int32, device=dev),
        extra_k=extra_k,
        extra_v=torch.randn_like(extra_k) if sparse else None,
        out=torch.empty_like(q),
        pages_per_seq=pages_per_seq,
        scales=scales,
        bytes_read=kv8_bytes(geo, num_pages * hk) if kv8 else 2 * num_pages * hk * b * d * dtype.itemsize,
    )


def bench_attention(
    ops,
    geo,
    dev,
    dtype,
    batch: int,
    pages_per_seq: int,
    sparse: bool,
    sweep: bool,
    refcheck: bool,
    label: str,
    kv8: bool = False,
) -> dict:
    """Attention over :func:`attention_inputs`' pages, timed (``sweep``: at fixed split counts too;
    ``refcheck``: two sequences against the CPU twin); dense (not ``sparse``, not ``kv8``) against
    the SDPA ceiling over the same bytes."""
    hq, hk, d, b = geo.num_qo_heads, geo.num_kv_heads, geo.head_dim, geo.block_size
    inp = attention_inputs(ops, geo, dev, dtype, batch, pages_per_seq, sparse, kv8)

    def run(num_splits: int = 0):  # 0: the planner's split count
        inp.run(ops, num_splits)

    ms, eager = time_both(run)
    kv_bytes = inp.bytes_read
    r = {"label": label, "ms": ms, "eager_ms": eager, "bytes_read": kv_bytes, "Bps": kv_bytes / (ms * 1e-3)}
    if sweep:
        r["splits_ms"] = {}
        for ns in (1, 2, 3, 4, 6, 8):

            def run_n(ns=ns):
                run(ns)

            try:
                r["splits_ms"][ns] = time_graph(run_n) or time_cuda(run_n)
            except Exception as e:  # noqa: BLE001 - a split count the planner would not pick
                r["splits_ms"][ns] = str(e)[:80]
    if refcheck:
        from oasiskv import _core  # noqa: F401  (CPU twin through ops on CPU tensors)

        sel = slice(0, 2)
        cpu_out = ops.decode_attention(
            geo,
            inp.q[sel].cpu(),
            inp.k_pages.cpu(),
            inp.v_pages.cpu(),
            inp.indptr[:3].cpu(),
            inp.perm[: 2 * pages_per_seq].cpu(),
            inp.last[sel].cpu(),
            page_map=inp.page_map.cpu(),
            extra_k=None if inp.extra_k is None else inp.extra_k[sel].cpu(),
            extra_v=None if inp.extra_v is None else inp.extra_v[sel].cpu(),
            **{name: t.cpu() for name, t in inp.scales.items()},
        )
        r["refcheck_max_abs_err"] = float((inp.out[sel].cpu().float() - cpu_out.float()).abs().max())
    if not sparse and not kv8:
        # torch SDPA (flash) over the same amount of contiguous KV: [batch, heads, ctx, d]
        ctx = pages_per_seq * b
        kc = torch.randn(batch, hk, ctx, d, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        qc = torch.randn(batch, hq, 1, d, device=dev, dtype=dtype)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, enable_gqa=True)

        try:
            sms, _ = time_both(sdpa)
            r["sdpa_ms"] = sms
            r["sdpa_Bps"] = kv_bytes / (sms * 1e-3)
        except RuntimeError as e:  # flash backend refused the shape
            r["sdpa_error"] = str(e)[:200]
    return r


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


def bench_score(ops, geo, dev, dtype, batch: int, ctx: int, k: int) -> dict:
    hq, hk, d, b = geo.num_qo_heads, geo.num_kv_heads, geo.head_dim, geo.block_size
    nb = ctx // b
    n_host = batch * nb
    summaries = torch.randn(n_host, hk, 2, d, device=dev, dtype=dtype)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    blk_indptr = i32(list(range(0, n_host + 1, nb)), dev)
    blk_indices = torch.randperm(n_host, device=dev).to(torch.int32)
    scores = torch.empty(n_host, hk, device=dev, dtype=torch.float32)
    top = torch.empty(batch, hk, k, device=dev, dtype=torch.int32)

    def score():
        ops.score_blocks(geo, q, summaries, blk_indptr, blk_indices, scores)

    def both():
        score()
        ops.topk_blocks(hk, scores, blk_indptr, k, top)

    ms_s, _ = time_both(score)
    ms, eager = time_both(both)
    sb = n_host * hk * 2 * d * dtype.itemsize
    return {
        "label": f"score+top-{k}, {ctx} ctx, batch {batch}",
        "ms": ms,
        "eager_ms": eager,
        "score_only_ms": ms_s,
        "summary_bytes": sb,
        "Bps": sb / (ms * 1e-3),
        "score_only_Bps": sb / (ms_s * 1e-3),
    }


def codes_candidate_bytes(geo) -> int:
    """Bytes the codes score reads per (block, KV head): the block's 8-bit bound (``2 head_dim``
    E4M3 bytes) and its 2-bit codes (``block_size head_dim / 4`` bytes), 768 at head_dim 128,
    block 16 -- the codes once sat in the 16-bit summaries, 1,024 then. The bound's f32 scale
    (4 bytes more) is not counted."""
    return 2 * geo.head_dim + geo.block_size * geo.head_dim // 4


def codes_inputs(geo, dev, dtype, batch: int, ctx: int) -> tuple:
    """Random inputs of the codes scores at :func:`bench_score`'s shapes: ``(q, summaries (min <=
    max), bounds8, scales, codes, blk_indptr, blk_indices)`` (the 8-bit bound of those summaries,
    random codes), ``batch`` sequences of ``ctx // block_size`` blocks."""
    from oasiskv import ops

    hq, hk, d, b = geo.num_qo_heads, geo.num_kv_heads, geo.head_dim, geo.block_size
    nb = ctx // b
    n_host = batch * nb
    summaries = torch.randn(n_host, hk, 2, d, device=dev, dtype=dtype)
    summaries = torch.stack([summaries.amin(2), summaries.amax(2)], dim=2)  # min <= max
    bounds8, scales = ops.empty_bounds8(geo, n_host, dev)
    ops.build_bounds8(geo, summaries, torch.arange(n_host, device=dev, dtype=torch.int32), bounds8, scales)
    codes = torch.randint(0, 256, (n_host, hk, b, d // 4), device=dev, dtype=torch.uint8)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    blk_indptr = i32(list(range(0, n_host + 1, nb)), dev)
    blk_indices = torch.randperm(n_host, device=dev).to(torch.int32)
    return q, summaries, bounds8, scales, codes, blk_indptr, blk_indices


def bench_score_codes(ops, geo, dev, dtype, batch: int, ctx: int, k: int) -> dict:
    """The 2-bit key-code score (issue 12) of every block + top-K at the shapes of
    :func:`bench_score`: it reads each block's 8-bit bound and codes
    (:func:`codes_candidate_bytes` per block and KV head)."""
    hk = geo.num_kv_heads
    q, _, bounds8, scales, codes, blk_indptr, blk_indices = codes_inputs(geo, dev, dtype, batch, ctx)
    n_host = blk_indices.numel()
    scores = torch.empty(n_host, hk, device=dev, dtype=torch.float32)
    top = torch.empty(batch, hk, k, device=dev, dtype=torch.int32)

    def score():
        ops.score_blocks_codes(geo, q, bounds8, scales, codes, blk_indptr, blk_indices, scores)

    def both():
        score()
        ops.topk_blocks(hk, scores, blk_indptr, k, top)

    ms_s, _ = time_both(score)
    ms, eager = time_both(both)
    read = n_host * hk * codes_candidate_bytes(geo)
    return {
        "label": f"codes score+top-{k}, {ctx} ctx, batch {batch}",
        "ms": ms,
        "eager_ms": eager,
        "score_only_ms": ms_s,
        "bound_bytes": bounds8.numel(),
        "code_bytes": codes.numel(),
        "bytes_per_block_head": codes_candidate_bytes(geo),
        "Bps": read / (ms * 1e-3),
        "score_only_Bps": read / (ms_s * 1e-3),
    }


def bench_score_codes_staged(
    ops,
    geo,
    dev,
    dtype,
    batch: int,
    ctx: int,
    k: int,
    factor: float,
    successors: int = 0,
    sticky: bool = False,
    profile: bool = False,
    bound8: bool = False,
    fused: bool = True,
) -> dict:
    """The two-stage codes score (``KvConfig(score_candidates=factor)``) at :func:`bench_score`'s
    shapes: the Quest bound and its top-``m`` (``m = ceil(factor k)``) per KV head, the codes
    score of those candidates, top-``k`` among them and the map back to logical blocks -- the
    engine's ``top_k_blocks``, in one CUDA graph. ``rescore_ms``: the codes score of the
    candidates alone. With ``successors`` or ``sticky`` the chain is the engine's own
    :func:`~oasiskv.engine.two_stage_top_k` with ``KvConfig(successor_blocks=successors)`` and a
    previous prediction of ``k`` random blocks kept among the candidates (``sticky_candidates``),
    and there is no ``rescore_ms`` (its candidates are not kept). ``profile``: each kernel's
    device time per call in ``kernels_us`` (:func:`kernel_breakdown`). ``bound8``: the first
    stage reads the 8-bit bound (``KvConfig.candidate_bound="fp8"``, the engine's chain).
    ``fused=False``: the engine's chain with the candidates' codes score and their top-K as two
    launches (:func:`ops.rescore_blocks_codes`, :func:`ops.topk_candidates`) instead of
    :func:`ops.rescore_topk_codes`' one (the same blocks), labelled ``unfused``."""
    hk = geo.num_kv_heads
    m = min(512, math.ceil(factor * k))
    q, summaries, bounds8, scales, codes, blk_indptr, blk_indices = codes_inputs(geo, dev, dtype, batch, ctx)
    n_host = blk_indices.numel()
    bound = torch.empty(n_host, hk, device=dev, dtype=torch.float32)
    cand = torch.empty(batch, hk, m, device=dev, dtype=torch.int32)
    rescored = torch.empty(batch * m, hk, device=dev, dtype=torch.float32)
    rows = i32(list(range(0, batch * m + 1, m)), dev)
    top = torch.empty(batch, hk, k, device=dev, dtype=torch.int32)

    def rescore():
        ops.rescore_blocks_codes(geo, q, bounds8, scales, codes, blk_indptr, blk_indices, cand, rescored)

    def staged():
        ops.score_blocks(geo, q, summaries, blk_indptr, blk_indices, bound)
        ops.topk_blocks(hk, bound, blk_indptr, m, cand)
        rescore()
        return ops.topk_blocks(hk, rescored, rows, k, top, index_map=cand)

    extra = ""
    if successors or sticky or bound8 or not fused:
        from oasiskv.engine import two_stage_top_k

        n_blocks = ctx // geo.block_size
        keep = None
        if sticky:
            keep = torch.argsort(torch.rand(batch, hk, n_blocks, device=dev), dim=-1)[..., :k].to(torch.int32)
        csr = (blk_indptr, blk_indices)
        counters = torch.zeros(batch * hk, dtype=torch.int32, device=dev)  # the engine's, per layer

        def staged():  # noqa: F811 -- the engine's chain instead
            return two_stage_top_k(
                geo,
                q,
                summaries,
                (bounds8, scales),
                codes,
                csr,
                k,
                m,
                keep=keep,
                successor_blocks=successors,
                bound8_first=bound8,
                fused=fused,
                counters=counters,
            )

        extra = (
            (f" +succ{successors}" if successors else "")
            + (" +sticky" if sticky else "")
            + (" +fp8" if bound8 else "")
            + ("" if fused else " unfused")
        )
    ms, eager = time_both(staged)
    row = {
        "label": f"codes x{factor:g}{extra} staged+top-{k}, {ctx} ctx, b {batch}",
        "candidates": m,
        # What the rescoring reads: m candidates per (sequence, KV head), each its bound and codes.
        "candidate_bytes": codes_candidate_bytes(geo),
        "rescore_bytes": batch * hk * m * codes_candidate_bytes(geo),
        "ms": ms,
        "eager_ms": eager,
    }
    if not extra:  # the engine's chain keeps its candidates to itself: `cand` is the hand chain's
        row["rescore_ms"], _ = time_both(rescore)  # on the candidates the last call chose
    if profile:
        row["kernels_us"] = kernel_breakdown(staged)
    return row


def bench_select(ops, geo, dev, batch: int, budget: int, cap: int) -> dict:
    hk = geo.num_kv_heads
    num_pages = batch * budget
    slot_pages = torch.arange(num_pages, dtype=torch.int32, device=dev).view(batch, budget)
    page_map = torch.randint(0, 4 * budget, (num_pages, hk), dtype=torch.int32, device=dev)
    last = torch.randint(0, 100, (num_pages, hk), dtype=torch.int32, device=dev)
    pred = torch.stack([torch.randperm(4 * budget, device=dev)[:budget] for _ in range(batch * hk)])
    pred = pred.view(batch, hk, budget).to(torch.int32)
    ps = torch.empty(batch, hk, cap, dtype=torch.int32, device=dev)
    pb = torch.empty_like(ps)
    step = [1000]

    def run():
        step[0] += 1
        ops.delta_select(hk, pred, slot_pages, page_map, last, step[0], cap, ps, pb)

    ms, eager = time_both(run)
    return {
        "label": f"delta select {batch} x {hk} heads x {budget} slots, cap {cap}",
        "ms": ms,
        "eager_ms": eager,
        "us": ms * 1e3,
    }


def score_rows(ops, geo, dev, dtype, args, d2d: float) -> list[dict]:
    """The selection kernels' rows of :func:`main`: the Quest score, the codes score over every
    block, the two-stage chains (F, successors, sticky, the 8-bit bound) at 64 x 32K (16 with
    ``--quick``), and the default chain at Fig. 11's shapes (16 and 44 x 16K), each as a ratio
    to the Quest row of its shape."""
    rows: list[dict] = []
    s = bench_score(ops, geo, dev, dtype, 16 if args.quick else 64, 32768, 128)
    s["ratio_to_d2d"], s["target"] = s["Bps"] / d2d, ">= 0.7 x d2d"
    rows.append(s)
    c = bench_score_codes(ops, geo, dev, dtype, 16 if args.quick else 64, 32768, 128)
    c["ratio_to_d2d"] = c["Bps"] / d2d
    c["ratio_to_quest"] = c["ms"] / s["ms"]  # time ratio: issue 12 asks <= 1.5
    c["target"] = "<= 1.5 x the Quest row's time"
    rows.append(c)
    batch = 16 if args.quick else 64
    for factor, succ, sticky, bound8 in (
        (1.25, 0, False, False),
        (1.5, 0, False, False),
        (2, 0, False, False),
        (3, 0, False, False),
        (1.25, 8, False, False),
        (1.25, 0, True, False),
        (1.25, 8, True, False),
        (1.2, 8, True, False),
        (1.25, 8, True, True),
    ):
        st = bench_score_codes_staged(
            ops, geo, dev, dtype, batch, 32768, 128, factor, succ, sticky, args.profile, bound8
        )
        st["ratio_to_quest"] = st["ms"] / s["ms"]
        st["target"] = "<= 1.5 x the Quest row's time"
        rows.append(st)
    # The serving benchmark's shape (bench.fig11: 16 requests of 16K): a small batch, where the
    # candidates' rescoring is latency-bound rather than bandwidth-bound (shorter tiles).
    s16 = bench_score(ops, geo, dev, dtype, 16, 16384, 128)
    s16["ratio_to_d2d"], s16["target"] = s16["Bps"] / d2d, "(the fig11 shape's Quest baseline)"
    rows.append(s16)
    for b8 in (False, True):
        st = bench_score_codes_staged(ops, geo, dev, dtype, 16, 16384, 128, 1.25, 8, True, args.profile, b8)
        st["ratio_to_quest"] = st["ms"] / s16["ms"]
        st["target"] = "<= 1.5 x the row above's time"
        rows.append(st)
    # The fig11 shape at the full host pool (44 x 16K on an H100), Quest and the default chain.
    s44 = bench_score(ops, geo, dev, dtype, 44, 16384, 128)
    s44["ratio_to_d2d"], s44["target"] = s44["Bps"] / d2d, "(44 x 16K Quest baseline)"
    rows.append(s44)
    for b8 in (False, True):
        st = bench_score_codes_staged(ops, geo, dev, dtype, 44, 16384, 128, 1.25, 8, True, args.profile, b8)
        st["ratio_to_quest"] = st["ms"] / s44["ms"]
        st["target"] = "(the default chain at 44 x 16K)"
        rows.append(st)
    # The default chain with the 8-bit bound scored on the tensor cores
    # (ops.set_bound8_score_kernel("mma")) at 44 x 16K and 64 x 32K, against the fma rows above.
    kernel_before = ops.bound8_score_kernel()
    try:
        ops.set_bound8_score_kernel("mma")
        for b, ctx, sq in ((44, 16384, s44), (batch, 32768, s)):
            st = bench_score_codes_staged(
                ops, geo, dev, dtype, b, ctx, 128, 1.25, 8, True, args.profile, True
            )
            st["label"] += " [mma bound8]"
            st["bound8_score_kernel"] = "mma"
            st["ratio_to_quest"] = st["ms"] / sq["ms"]
            st["target"] = "below the same chain's fma row"
            rows.append(st)
    finally:
        ops.set_bound8_score_kernel(kernel_before)
    # Issue 33: the default chain's candidates' codes score and top-K in one launch
    # (ops.rescore_topk_codes) against the two launches, at batch 1 (launch-bound) and at 22 x 32K
    # (Qwen3-8B's serving shape), each against the Quest row of its shape.
    for batch, ctx in ((1, 16384), (22, 32768)):
        sq = bench_score(ops, geo, dev, dtype, batch, ctx, 128)
        sq["ratio_to_d2d"], sq["target"] = sq["Bps"] / d2d, f"({batch} x {ctx // 1024}K Quest baseline)"
        rows.append(sq)
        for fused in (True, False):
            st = bench_score_codes_staged(
                ops, geo, dev, dtype, batch, ctx, 128, 1.25, 8, True, args.profile, True, fused
            )
            st["ratio_to_quest"] = st["ms"] / sq["ms"]
            st["target"] = "fused: <= the unfused row" if fused else "(the two launches)"
            rows.append(st)
    return rows


def attention_rows(ops, geo, dev, dtype, args, d2d: float) -> list[dict]:
    """Sparse attention over bf16 and fp8 pages (each kv8 tensor-core kernel), then (all rows only)
    dense attention against SDPA: the rows of ``--only attention``."""
    rows: list[dict] = []
    batches = (8, 16) if args.quick else (64, 256)
    # Sparse attention over bf16 pages, then over fp8_e4m3 pages (bytes = codes + scales, issue
    # 36) under each tensor-core kernel (ops.set_kv8_attention_kernel; the process's own choice
    # is restored after).
    kernel_before = ops.kv8_attention_kernel()
    try:
        for label, kernel in (
            ("sparse attn", None),
            ("fp8 sparse attn (tile)", "tile"),
            ("fp8 sparse attn (registers)", "registers"),
            ("fp8 sparse attn (registers-deep)", "registers-deep"),
        ):
            if kernel is not None:
                ops.set_kv8_attention_kernel(kernel)
            for bs in batches:
                r = bench_attention(
                    ops,
                    geo,
                    dev,
                    dtype,
                    bs,
                    129,
                    True,
                    args.sweep_splits,
                    args.refcheck,
                    f"{label}, 129 blocks/head, batch {bs}",
                    kv8=kernel is not None,
                )
                if kernel is not None:
                    r["kv8_attention_kernel"] = kernel
                r["ratio_to_d2d"], r["target"] = r["Bps"] / d2d, ">= 0.8 x d2d"
                rows.append(r)
    finally:
        ops.set_kv8_attention_kernel(kernel_before)
    for ctx in () if args.only else (16384, 32768):
        bs = 4 if args.quick else 16
        r = bench_attention(
            ops,
            geo,
            dev,
            dtype,
            bs,
            ctx // geo.block_size,
            False,
            args.sweep_splits,
            args.refcheck,
            f"dense attn, {ctx} ctx, batch {bs}",
        )
        r["ratio_to_d2d"] = r["Bps"] / d2d
        if "sdpa_ms" in r:
            r["ratio_to_sdpa"] = r["sdpa_ms"] / r["ms"]
        r["target"] = ">= 0.8 x d2d and >= 0.95 x SDPA"
        rows.append(r)
    return rows


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":
    sys.exit(main())
