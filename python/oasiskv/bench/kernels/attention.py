"""``bench.kernels``' sparse and dense decode attention rows: the inputs of one case
(:func:`attention_inputs`, also ``experiments/prof_attn.py``'s), one timed case against the copy
ceiling and SDPA (:func:`bench_attention`), and the rows of a run (:func:`attention_rows`: bf16
pages, each fp8 tensor-core kernel, dense, split-count sweeps)."""

from __future__ import annotations

import dataclasses

import torch

from .common import i32, time_both, time_cuda, time_graph
from .gather import kv8_bytes, kv8_pages


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
