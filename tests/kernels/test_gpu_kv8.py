"""The fp8_e4m3 KV tiers on CUDA against their CPU twins, bit for bit: ``quantize_kv8``,
``append_kv`` into an fp8 host pool (pinned, written through unified addressing) with float or
fp8 GPU pages (scale growth and requantization mid-block, NaN and inf rows), ``gather_blocks``
from an fp8 host pool into float or fp8 slots (staged and register launches, the pool pinned or on
the device), and ``copy_pages`` float -> fp8 (partial last pages) and
fp8 -> float; block sizes 8/16/32, head_dim 64/96/128, every float dtype; attention over fp8
pages, every tensor-core kernel (``set_kv8_attention_kernel``) at head_dim 64/128/256, over
sequences long enough that each pipeline's ring wraps. Run under compute-sanitizer with ``-k kv8``."""

from __future__ import annotations

import zlib

import pytest
import torch

from oasiskv import ops
from support.reference import ATTN_TOL, ref_decode_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

DEV = torch.device("cuda", 0)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
GEOMETRIES = [(16, 128), (8, 64), (32, 96)]  # (block_size, head_dim)


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _keys(shape, dtype, gen) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    x[..., :3] *= 40
    x *= torch.exp2(torch.randint(-6, 7, shape[:-1], generator=gen).float())[..., None]
    return x.to(dtype)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", GEOMETRIES)
def test_kv8_quantize_and_copy_match_the_twins(dtype, block_size, head_dim):
    h = 4
    geo = ops.KvGeometry(2 * h, h, head_dim, block_size)
    gen = _gen("copy", dtype, block_size, head_dim)
    src = _keys((9, h, block_size, head_dim), dtype, gen)
    src_v = _keys((9, h, block_size, head_dim), dtype, gen)
    src[2, 1, 0, 0], src[3, 0, 1, 2] = float("nan"), float("-inf")
    valid = torch.tensor([block_size, 1, 5, block_size, 2, block_size, 3, block_size, 7], dtype=torch.int32)
    want_c, want_s = (t.zero_() for t in ops.empty_kv8(geo, 9, "cpu"))
    ops.quantize_kv8(geo, src, valid, want_c, want_s)
    got_c, got_s = (t.zero_() for t in ops.empty_kv8(geo, 9, DEV))
    ops.quantize_kv8(geo, src.to(DEV), valid.to(DEV), got_c, got_s)
    torch.cuda.synchronize()
    assert torch.equal(got_c.cpu(), want_c) and torch.equal(got_s.cpu(), want_s)

    # Dense pages (on the GPU) into a pinned fp8 host pool, a partial last page; then back.
    src_ids = torch.tensor([4, 0, 7, 2], dtype=torch.int32)
    dst_ids = torch.tensor([1, 5, 0, 3], dtype=torch.int32)
    part = torch.tensor([block_size, block_size, block_size, 3], dtype=torch.int32)
    pools = {}
    for where in ("cpu", "cuda"):
        hk, hks = (_pinned(t.zero_()) for t in ops.empty_kv8(geo, 6, "cpu"))
        hv, hvs = (_pinned(t.zero_()) for t in ops.empty_kv8(geo, 6, "cpu"))
        d = DEV if where == "cuda" else "cpu"
        ops.copy_pages(
            geo,
            src.to(d),
            src_v.to(d),
            src_ids.to(d),
            hk,
            hv,
            dst_ids.to(d),
            dst_k_scales=hks,
            dst_v_scales=hvs,
            valid=part.to(d),
        )
        back_k = torch.zeros(6, h, block_size, head_dim, dtype=dtype, device=d)
        back_v = torch.zeros_like(back_k)
        ids = torch.arange(6, dtype=torch.int32, device=d)
        ops.copy_pages(geo, hk, hv, ids, back_k, back_v, ids, src_k_scales=hks, src_v_scales=hvs)
        torch.cuda.synchronize()
        pools[where] = (hk, hv, hks, hvs, back_k.cpu(), back_v.cpu())
    for i, (a, b) in enumerate(zip(pools["cpu"], pools["cuda"], strict=True)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i  # bitwise (NaNs too)


@pytest.mark.parametrize("gpu_kv8", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", GEOMETRIES)
def test_kv8_append_matches_the_twin(dtype, block_size, head_dim, gpu_kv8):
    """Three sequences append 1.5 blocks token by token; rows grow mid-block (requantizing the rows
    before them), one row is NaN and one inf; the summaries come from the unquantized keys."""
    h, seqs = 2, 3
    geo = ops.KvGeometry(4 * h, h, head_dim, block_size)
    gen = _gen("append", dtype, block_size, head_dim, gpu_kv8)
    pages = 2 * seqs
    steps = block_size + block_size // 2
    news = []
    for t in range(steps):
        k = _keys((seqs, h, head_dim), dtype, gen) * (8.0 if t in (3, block_size + 2) else 1.0)
        v = _keys((seqs, h, head_dim), dtype, gen)
        if t == 5:
            k[1, 0, 7] = float("nan")
            v[2, 1, 0] = float("inf")
        news.append((k, v))
    out = {}
    for where in ("cpu", "cuda"):
        d = DEV if where == "cuda" else "cpu"
        if gpu_kv8:
            kp, ks = (t.zero_() for t in ops.empty_kv8(geo, pages, d))
            vp, vs = (t.zero_() for t in ops.empty_kv8(geo, pages, d))
            gpu_kw = {"k_scales": ks, "v_scales": vs}
        else:
            kp = torch.zeros(pages, h, block_size, head_dim, dtype=dtype, device=d)
            vp = torch.zeros_like(kp)
            gpu_kw = {}
        hk, hks = (_pinned(t.zero_()) for t in ops.empty_kv8(geo, pages, "cpu"))
        hv, hvs = (_pinned(t.zero_()) for t in ops.empty_kv8(geo, pages, "cpu"))
        sums = torch.zeros(pages, h, 2, head_dim, dtype=dtype, device=d)
        for t, (k, v) in enumerate(news):
            blk = t // block_size
            ids = torch.tensor([seqs * blk + s for s in range(seqs)], dtype=torch.int32, device=d)
            offs = torch.full((seqs,), t % block_size, dtype=torch.int32, device=d)
            ops.append_kv(
                geo,
                k.to(d),
                v.to(d),
                ids,
                offs,
                ids,
                kp,
                vp,
                hk,
                hv,
                sums,
                host_k_scales=hks,
                host_v_scales=hvs,
                **gpu_kw,
            )
        torch.cuda.synchronize()
        out[where] = [kp.cpu(), vp.cpu(), hk, hv, hks, hvs, sums.cpu(), *(t.cpu() for t in gpu_kw.values())]
    for i, (a, b) in enumerate(zip(out["cpu"], out["cuda"], strict=True)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i  # bitwise (NaN codes too)


#: Gather launches (``set_gather_launch(..., kv8=True)``'s fields; None: the default, every entry
#: through registers on a block per 32 entries): the float pools' staged shape (fp8 entries staged
#: 12 per warp, two halves of 6 in flight in turn), one entry staged per half of a three-entry
#: pass, one block of two warps staging halves of 5 over several batches of a 32-entry pass, a
#: stage of 32 lowered to what fits; "device": the pool in device memory (the register launch
#: whatever is set).
LAUNCHES = [None, (4, 4, 32, 6), (2, 1, 3, 1), (1, 2, 32, 5), (4, 4, 32, 32), "device"]


@pytest.fixture
def restore_gather_launch():
    before = ops.gather_launch(kv8=True)
    yield
    ops.set_gather_launch(*before, kv8=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", GEOMETRIES)
@pytest.mark.parametrize("launch", LAUNCHES, ids=str)
@pytest.mark.parametrize("into", ["float", "fp8"])
def test_kv8_gather_matches_the_twin(dtype, block_size, head_dim, launch, into, restore_gather_launch):
    """An fp8 host pool gathered into float slots (dequantized) or fp8 slots (codes and scales
    copied), staged and through registers, bit for bit (NaN codes included)."""
    if into == "fp8" and dtype != torch.bfloat16:
        pytest.skip("fp8 -> fp8 is dtype-free: run once")
    h, seqs, nb, budget, cap = 4, 3, 40, 6, 3
    geo = ops.KvGeometry(2 * h, h, head_dim, block_size)
    gen = _gen("gather", dtype, block_size, head_dim)
    src = _keys((nb, h, block_size, head_dim), torch.float32, gen)
    hk, hks = ops.empty_kv8(geo, nb, "cpu")
    hv, hvs = ops.empty_kv8(geo, nb, "cpu")
    full = torch.full((nb,), block_size, dtype=torch.int32)
    ops.quantize_kv8(geo, src, full, hk, hks)
    ops.quantize_kv8(geo, src.flip(0), full, hv, hvs)
    hk.view(-1)[::997] = 0x7F  # NaN codes
    hv.view(-1)[5::1009] = 0xFF
    lens = [13, 7, 20]
    host_indptr = torch.tensor([0, 13, 20, 40], dtype=torch.int32)
    host_indices = torch.randperm(nb, generator=gen).to(torch.int32)
    slot_pages = torch.arange(seqs * budget, dtype=torch.int32).view(seqs, budget).flip(1).contiguous()
    plan_slots = torch.randint(-1, budget, (seqs, h, cap), generator=gen, dtype=torch.int32)
    plan_blocks = torch.stack([torch.randint(0, n, (h, cap), generator=gen, dtype=torch.int32) for n in lens])
    for s in range(seqs):  # distinct slots per (seq, head): no two entries write one slot
        for hh in range(h):
            plan_slots[s, hh] = torch.randperm(budget, generator=gen)[:cap].to(torch.int32)
    plan_slots[1, 2, 0] = -1  # a skipped entry
    if launch not in (None, "device"):
        ops.set_gather_launch(*launch, kv8=True)
    out = {}
    for where in ("cpu", "cuda"):
        d = DEV if where == "cuda" else "cpu"
        pool = [hk, hv, hks, hvs]
        if where == "cuda":
            pool = [t.to(DEV) if launch == "device" else _pinned(t) for t in pool]
        if into == "fp8":
            kp, ks = ops.empty_kv8(geo, seqs * budget, d)
            vp, vs = ops.empty_kv8(geo, seqs * budget, d)
            for t in (kp, ks, vp, vs):
                t.zero_()
            scales = dict(k_scales=ks, v_scales=vs)
        else:
            kp = torch.zeros(seqs * budget, h, block_size, head_dim, dtype=dtype, device=d)
            vp = torch.zeros_like(kp)
            scales = {}
        tabs = [t.to(d) for t in (plan_slots, plan_blocks, slot_pages, host_indptr, host_indices)]
        ops.gather_blocks(
            geo, *tabs, pool[0], pool[1], kp, vp, host_k_scales=pool[2], host_v_scales=pool[3], **scales
        )
        torch.cuda.synchronize()
        out[where] = [kp.cpu(), vp.cpu(), *(t.cpu() for t in scales.values())]
    for i, (a, b) in enumerate(zip(out["cpu"], out["cuda"], strict=True)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i  # bitwise (NaN codes too)
    assert out["cpu"][0].float().nan_to_num().abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", GEOMETRIES)
@pytest.mark.parametrize("group,splits", [(1, 1), (4, 3), (8, 0)])
def test_kv8_attention_matches_the_twin(dtype, block_size, head_dim, group, splits):
    """Attention over fp8 pages on CUDA (the tensor-core kernel for bf16 where the float path
    takes it, else the generic one; split-KV with num_splits > 1) against the CPU twin, and the
    twin against a float64 reference over the dequantized pages. The queries are small (logits
    of a few units): the keys' wide range (scales 2^-6..2^6, three dims x40) would otherwise give
    logits of 1e5, where float32 summation order alone moves the softmax by 1e-3 (s20's first run).
    Tolerances scale with each head-dim column's largest |V|."""
    _attention_case(dtype, block_size, head_dim, group, splits)


@pytest.fixture
def restore_kv8_attention_kernel():
    before = ops.kv8_attention_kernel()
    yield
    ops.set_kv8_attention_kernel(before)


# Every tensor-core shape: head_dim 64 / 128 / 256, one and two 16-token chunks per page.
TC_GEOMETRIES = [(16, 128), (32, 64), (16, 256), (32, 128)]


KV8_KERNELS = ["tile", "registers", "registers-deep"]


@pytest.mark.parametrize("kernel", KV8_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,head_dim", TC_GEOMETRIES)
@pytest.mark.parametrize("group,splits", [(1, 1), (4, 3), (8, 0)])
def test_kv8_tensor_core_kernels_match_the_twin(
    kernel, dtype, block_size, head_dim, group, splits, restore_kv8_attention_kernel
):
    """Both tensor-core kernels over fp8 pages (``set_kv8_attention_kernel``; "tile" takes bf16
    only, so f16 there is the generic kernel) against the twin and the float64 reference, with a
    page never written (codes and scales 0: its keys score 0 and its values add nothing) and the
    lookahead row's extra K/V. "registers" permutes Q's and the output's columns and carries the
    V scale as the accumulator's unit: a wrong permutation or unit is far outside the bounds."""
    ops.set_kv8_attention_kernel(kernel)
    assert ops.kv8_attention_kernel() == kernel
    _attention_case(dtype, block_size, head_dim, group, splits, blank_page=6)


@pytest.mark.parametrize("kernel", KV8_KERNELS)
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (16, 128), (32, 128), (16, 256)])
@pytest.mark.parametrize("splits", [1, 0])
def test_kv8_tensor_core_kernels_over_long_sequences(
    kernel, block_size, head_dim, splits, restore_kv8_attention_kernel
):
    """A sequence of 41 pages (41-82 chunks of 16 tokens) beside a short one: each warp's ring
    of chunks wraps many times, at every kernel's pipeline depth ("registers-deep": 8 / 6 / 3
    chunks at head_dim 64 / 128 / 256)."""
    ops.set_kv8_attention_kernel(kernel)
    indptr = torch.tensor([0, 41, 44], dtype=torch.int32)
    indices = torch.randperm(48, generator=torch.Generator().manual_seed(41))[:44].to(torch.int32)
    last = torch.tensor([block_size - 5, 2], dtype=torch.int32)
    _attention_case(torch.bfloat16, block_size, head_dim, 4, splits, layout=(48, indptr, indices, last))


def _attention_case(dtype, block_size, head_dim, group, splits, blank_page=None, layout=None) -> None:
    """Attention over 12 fp8 pages of 3 sequences (2 rows, the extra K/V, holes in the page map)
    on CUDA against the twin, and the twin against float64; ``blank_page``: that page's codes
    and scales zeroed, as an unwritten page; ``layout = (npages, indptr, indices, last)``: other
    sequences instead (page_map holes at pages 7 and 2 as in the default)."""
    h, rows = 2, 2
    npages = 12 if layout is None else layout[0]
    geo = ops.KvGeometry(h * group, h, head_dim, block_size)
    gen = _gen("attn", dtype, block_size, head_dim, group)
    kp, ksc = ops.empty_kv8(geo, npages, "cpu")
    vp, vsc = ops.empty_kv8(geo, npages, "cpu")
    full = torch.full((npages,), block_size, dtype=torch.int32)
    ops.quantize_kv8(geo, _keys((npages, h, block_size, head_dim), dtype, gen), full, kp, ksc)
    ops.quantize_kv8(geo, _keys((npages, h, block_size, head_dim), dtype, gen), full, vp, vsc)
    if blank_page is not None:
        for t in (kp, ksc, vp, vsc):
            t[blank_page] = 0
    if layout is None:
        indptr = torch.tensor([0, 5, 6, 11], dtype=torch.int32)
        indices = torch.tensor([3, 0, 7, 5, 10, 9, 1, 2, 8, 4, 11], dtype=torch.int32)
        last = torch.tensor([block_size, 3, 1], dtype=torch.int32)
    else:
        _, indptr, indices, last = layout
    if blank_page is not None:
        indices[2] = blank_page  # in the middle of sequence 0
    ns = indptr.numel() - 1
    page_map = torch.randint(0, 50, (npages, h), generator=gen, dtype=torch.int32)
    page_map[7, 0] = page_map[2, 1] = -1
    q = (torch.randn((ns, rows, h * group, head_dim), generator=gen) * 2e-3).to(dtype)
    ek, ev = _keys((ns, h, head_dim), dtype, gen), _keys((ns, h, head_dim), dtype, gen)
    args = (indptr, indices, last)
    want = ops.decode_attention(
        geo, q, kp, vp, *args, page_map=page_map, extra_k=ek, extra_v=ev, k_scales=ksc, v_scales=vsc
    )
    d = [t.to(DEV) for t in (q, kp, vp, *args, page_map, ek, ev, ksc, vsc)]
    got = ops.decode_attention(
        geo,
        *d[:6],
        page_map=d[6],
        extra_k=d[7],
        extra_v=d[8],
        k_scales=d[9],
        v_scales=d[10],
        num_splits=splits,
    )
    torch.cuda.synchronize()
    kd, vd = ops.dequantize_kv8(kp, ksc, torch.float64), ops.dequantize_kv8(vp, vsc, torch.float64)
    ref = ref_decode_attention(q, kd, vd, *args, page_map, ek, ev)
    mag = torch.maximum(vd.abs().amax(dim=(0, 1, 2)), ev.double().abs().amax(dim=(0, 1))).clamp_min(1.0)
    _close(want, ref, ATTN_TOL[dtype], mag, "twin vs float64")
    _close(got.cpu(), want, ATTN_TOL[dtype], mag, "CUDA vs twin")


def _close(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float], mag: torch.Tensor, what: str) -> None:
    """``|a - b| <= atol * mag + rtol * |b|`` elementwise (``mag``: per head-dim column)."""
    err = (a.double() - b.double()).abs()
    bound = tol[0] * mag.double() + tol[1] * b.double().abs()
    bad = err > bound
    worst = float((err - bound).max())
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} elements off, worst excess {worst:.3g}"
