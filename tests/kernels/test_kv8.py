"""The fp8_e4m3 KV cache's bindings (``ops.quantize_kv8``, and ``ops.append_kv`` /
``ops.gather_blocks`` / ``ops.copy_pages`` with a uint8 tier and its scales; CPU twins) against an
independent float64 reference (``support.e4m3``: the grid from the format's definition, round to
nearest with ties to the even code), over block sizes 8/16/32, head_dim 64/96/128 and every float
KV dtype; ``ops.dequantize_kv8`` (torch's own E4M3 decode) against the same grid; typed errors.

The format (``oasis_core::kernels::kv8``): per (page, KV head) a power-of-two scale 2^e, e the
smallest in [-120, 120] with the largest finite magnitude <= 448 2^e; a value is
``rne(x / 2^e)``. An append at offset 0 sets its page's scale from the new row; a later row that
needs a larger exponent first requantizes the rows before it to that exponent."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from oasiskv import errors, ops
from support import e4m3

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GEOMETRIES = [(8, 64), (16, 96), (32, 128)]  # (block_size, head_dim)


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _keys(shape, dtype, gen) -> torch.Tensor:
    """Values like keys: a few outlier channels, rows of very different magnitudes."""
    x = torch.randn(shape, generator=gen)
    x[..., :3] *= 40
    x *= torch.exp2(torch.randint(-6, 7, shape[:-1], generator=gen).float())[..., None]
    return x.to(dtype)


def ref_quantize(src: torch.Tensor, valid) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of whole pages, float64, by the definition."""
    x = src.double().numpy()
    n, h, b, _ = x.shape
    codes = np.zeros(x.shape, dtype=np.uint8)
    scales = np.zeros((n, h))
    for i in range(n):
        for hh in range(h):
            rows = x[i, hh, : valid[i]]
            fin = rows[np.isfinite(rows)]
            e = e4m3.exponent(float(np.abs(fin).max()) if fin.size else 0.0, hi=120)
            scales[i, hh] = 2.0**e
            codes[i, hh, : valid[i]] = e4m3.rne(rows / 2.0**e)
    return codes, scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", GEOMETRIES)
def test_quantize_kv8_matches_the_definition(dtype, block_size, head_dim):
    geo = ops.KvGeometry(8, 2, head_dim, block_size)
    gen = _gen("q", dtype, block_size, head_dim)
    src = _keys((7, 2, block_size, head_dim), dtype, gen)
    src[1, 0, 2, 5] = float("nan")  # non-finite values: the NaN code, and left out of the scale
    src[1, 1, 0, 0] = float("inf")
    src[2].zero_()  # an all-zero page: the smallest scale
    valid = torch.tensor(
        [block_size, block_size, block_size, 1, block_size // 2, block_size, 3], dtype=torch.int32
    )
    codes, scales = ops.empty_kv8(geo, 7, "cpu")
    ops.quantize_kv8(geo, src, valid, codes, scales)
    want_codes, want_scales = ref_quantize(src, valid.tolist())
    np.testing.assert_array_equal(scales.double().numpy(), want_scales)
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    assert scales[2].tolist() == [2.0**-120] * 2
    assert codes[1, 0, 2, 5] == e4m3.NAN_CODE and codes[1, 1, 0, 0] == e4m3.NAN_CODE
    # torch's E4M3 decode is the same grid: code x scale back.
    back = ops.dequantize_kv8(codes, scales, torch.float64)
    np.testing.assert_array_equal(
        np.nan_to_num(back.numpy(), nan=7.0),
        np.nan_to_num(e4m3.decode(codes.numpy()) * scales.double().numpy()[..., None, None], nan=7.0),
    )


def test_quantization_error_is_within_half_a_step():
    """|x - dequant(q(x))| <= half an E4M3 step of x's binade (2^-4 relative for normals), the
    property the accuracy runs lean on."""
    geo = ops.KvGeometry(4, 1, 128, 16)
    src = _keys((32, 1, 16, 128), torch.float32, _gen("err"))
    codes, scales = ops.empty_kv8(geo, 32, "cpu")
    ops.quantize_kv8(geo, src, torch.full((32,), 16, dtype=torch.int32), codes, scales)
    back = ops.dequantize_kv8(codes, scales)
    x, err = src.double(), (back.double() - src.double()).abs()
    normal = x.abs() >= scales.double()[..., None, None] * 2.0**-6
    assert (err[normal] <= x.abs()[normal] * 2.0**-4 + 1e-30).all()
    assert (err[~normal] <= scales.double()[..., None, None].expand_as(x)[~normal] * 2.0**-10).all()


def ref_append(codes, scales, page, head, off, row):
    """The append rule on float64 numpy state (codes [P, H, B, D] uint8, scales [P, H]); True when
    the rows before ``off`` were requantized."""
    fin = row[np.isfinite(row)]
    e_row = e4m3.exponent(float(np.abs(fin).max()) if fin.size else 0.0, hi=120)
    if off == 0:
        e = e_row
    else:
        e_old = int(np.clip(np.log2(scales[page, head]), -120, 120))
        if e_row > e_old:
            shift = 2.0 ** max(e_old - e_row, -24)
            codes[page, head, :off] = e4m3.rne(e4m3.decode(codes[page, head, :off]) * shift)
            e = e_row
        else:
            e = e_old
    scales[page, head] = 2.0**e
    codes[page, head, off] = e4m3.rne(row / 2.0**e)
    return off > 0 and e > e_old


@pytest.mark.parametrize("gpu_kv8", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_append_into_fp8_tiers_follows_the_rule(dtype, gpu_kv8):
    """Two sequences append a block and a half each, token by token, into an fp8 host pool (and
    fp8 or float GPU pages), with rows that grow mid-block (requantizing the rows before them);
    the summaries come from the unquantized keys."""
    b, d, h = 8, 64, 2
    geo = ops.KvGeometry(4, h, d, b)
    gen = _gen("append", dtype, gpu_kv8)
    pages = 4
    if gpu_kv8:
        k_pages, k_sc = ops.empty_kv8(geo, pages, "cpu")
        v_pages, v_sc = ops.empty_kv8(geo, pages, "cpu")
        gpu_kw = {"k_scales": k_sc.zero_(), "v_scales": v_sc.zero_()}
        k_pages.zero_(), v_pages.zero_()
    else:
        k_pages = torch.zeros(pages, h, b, d, dtype=dtype)
        v_pages = torch.zeros(pages, h, b, d, dtype=dtype)
        gpu_kw = {}
    host_k, hk_sc = ops.empty_kv8(geo, pages, "cpu")
    host_v, hv_sc = ops.empty_kv8(geo, pages, "cpu")
    host_k.zero_(), host_v.zero_(), hk_sc.zero_(), hv_sc.zero_()
    summaries = torch.zeros(pages, h, 2, d, dtype=dtype)
    ref = {name: np.zeros((pages, h, b, d), np.uint8) for name in ("hk", "hv", "gk", "gv")}
    ref_sc = {name: np.zeros((pages, h)) for name in ("hk", "hv", "gk", "gv")}
    grown = 0
    for t in range(12):
        blk = t // b
        k_new = _keys((2, h, d), dtype, gen) * (4.0 if t in (3, 9) else 1.0)  # growth mid-block
        v_new = _keys((2, h, d), dtype, gen)
        page_ids = torch.tensor([2 * blk, 2 * blk + 1], dtype=torch.int32)
        offsets = torch.full((2,), t % b, dtype=torch.int32)
        ops.append_kv(
            geo,
            k_new,
            v_new,
            page_ids,
            offsets,
            page_ids,  # host block = host row = the page id here
            k_pages,
            v_pages,
            host_k,
            host_v,
            summaries,
            host_k_scales=hk_sc,
            host_v_scales=hv_sc,
            **gpu_kw,
        )
        for s in range(2):
            for hh in range(h):
                for tier in ("h", "g") if gpu_kv8 else ("h",):
                    grown += ref_append(
                        ref[tier + "k"],
                        ref_sc[tier + "k"],
                        2 * blk + s,
                        hh,
                        t % b,
                        k_new[s, hh].double().numpy(),
                    )
                    ref_append(
                        ref[tier + "v"],
                        ref_sc[tier + "v"],
                        2 * blk + s,
                        hh,
                        t % b,
                        v_new[s, hh].double().numpy(),
                    )
    np.testing.assert_array_equal(host_k.numpy(), ref["hk"])
    np.testing.assert_array_equal(host_v.numpy(), ref["hv"])
    np.testing.assert_array_equal(hk_sc.double().numpy(), ref_sc["hk"])
    np.testing.assert_array_equal(hv_sc.double().numpy(), ref_sc["hv"])
    if gpu_kv8:
        np.testing.assert_array_equal(k_pages.numpy(), ref["gk"])
        np.testing.assert_array_equal(gpu_kw["v_scales"].double().numpy(), ref_sc["gv"])
    else:
        assert k_pages[0, 0, 3].abs().sum() > 0  # float pages hold the row as given
    assert grown > 0  # some rows were requantized to a grown scale


def test_summaries_come_from_the_unquantized_keys():
    b, d, h = 8, 64, 1
    geo = ops.KvGeometry(2, h, d, b)
    k_new = _keys((1, h, d), torch.float32, _gen("sum"))
    host_k, hk = ops.empty_kv8(geo, 1, "cpu")
    host_v, hv = ops.empty_kv8(geo, 1, "cpu")
    summaries = torch.zeros(1, h, 2, d)
    zero = torch.zeros(1, dtype=torch.int32)
    pages = torch.zeros(1, h, b, d)
    ops.append_kv(
        geo,
        k_new,
        k_new,
        zero,
        zero,
        zero,
        pages,
        pages.clone(),
        host_k,
        host_v,
        summaries,
        host_k_scales=hk,
        host_v_scales=hv,
    )
    assert torch.equal(summaries[0, :, 0], k_new[0]) and torch.equal(summaries[0, :, 1], k_new[0])
    assert not torch.equal(ops.dequantize_kv8(host_k, hk)[0, :, 0], k_new[0])  # the host row is rounded


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", GEOMETRIES)
def test_copy_pages_into_and_out_of_fp8(dtype, block_size, head_dim):
    """Float pages -> fp8 pool = quantize_kv8 with the same valid rows; fp8 -> float = code x
    scale in the page dtype; fp8 -> fp8 copies codes and scales."""
    h = 2
    geo = ops.KvGeometry(2 * h, h, head_dim, block_size)
    src = _keys((5, h, block_size, head_dim), dtype, _gen("copy", dtype, block_size))
    src_v = _keys((5, h, block_size, head_dim), dtype, _gen("copy-v", dtype, block_size))
    src_ids = torch.tensor([4, 0, 2], dtype=torch.int32)
    dst_ids = torch.tensor([1, 3, 0], dtype=torch.int32)
    valid = torch.tensor([block_size, block_size, 3], dtype=torch.int32)
    hk, hk_sc = (t.zero_() for t in ops.empty_kv8(geo, 4, "cpu"))
    hv, hv_sc = (t.zero_() for t in ops.empty_kv8(geo, 4, "cpu"))
    ops.copy_pages(
        geo, src, src_v, src_ids, hk, hv, dst_ids, dst_k_scales=hk_sc, dst_v_scales=hv_sc, valid=valid
    )
    want_codes, want_scales = ref_quantize(src[src_ids.long()], valid.tolist())
    np.testing.assert_array_equal(hk[dst_ids.long()].numpy(), want_codes)
    np.testing.assert_array_equal(hk_sc[dst_ids.long()].double().numpy(), want_scales)
    # Back into float pages: exactly code x scale, in the page dtype.
    out_k = torch.zeros(3, h, block_size, head_dim, dtype=dtype)
    out_v = torch.zeros_like(out_k)
    ops.copy_pages(
        geo,
        hk,
        hv,
        dst_ids,
        out_k,
        out_v,
        torch.arange(3, dtype=torch.int32),
        src_k_scales=hk_sc,
        src_v_scales=hv_sc,
    )
    assert torch.equal(out_k, ops.dequantize_kv8(hk, hk_sc, dtype)[dst_ids.long()])
    # fp8 -> fp8: bytes and scales.
    k2, k2s = (t.zero_() for t in ops.empty_kv8(geo, 5, "cpu"))
    v2, v2s = (t.zero_() for t in ops.empty_kv8(geo, 5, "cpu"))
    ops.copy_pages(
        geo,
        hk,
        hv,
        dst_ids,
        k2,
        v2,
        src_ids,
        src_k_scales=hk_sc,
        src_v_scales=hv_sc,
        dst_k_scales=k2s,
        dst_v_scales=v2s,
    )
    assert torch.equal(k2[src_ids.long()], hk[dst_ids.long()]) and torch.equal(
        v2s[src_ids.long()], hv_sc[dst_ids.long()]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_from_an_fp8_host_pool_dequantizes_into_the_slots(dtype):
    b, d, h = 16, 128, 4
    geo = ops.KvGeometry(8, h, d, b)
    gen = _gen("gather", dtype)
    nb = 6
    src = _keys((nb, h, b, d), torch.float32, gen)
    hk, hk_sc = ops.empty_kv8(geo, nb, "cpu")
    hv, hv_sc = ops.empty_kv8(geo, nb, "cpu")
    full = torch.full((nb,), b, dtype=torch.int32)
    ops.quantize_kv8(geo, src, full, hk, hk_sc)
    ops.quantize_kv8(geo, -src, full, hv, hv_sc)
    # One sequence of 6 logical blocks (host rows reversed), budget 3 slots in pages 5, 1, 7.
    host_indptr = torch.tensor([0, nb], dtype=torch.int32)
    host_indices = torch.arange(nb - 1, -1, -1, dtype=torch.int32)
    slot_pages = torch.tensor([[5, 1, 7]], dtype=torch.int32)
    plan_slots = torch.full((1, h, 2), -1, dtype=torch.int32)
    plan_blocks = torch.zeros((1, h, 2), dtype=torch.int32)
    plan_slots[0, :, 0], plan_blocks[0, :, 0] = torch.tensor([0, 2, 1, 0]), torch.tensor([1, 4, 0, 5])
    k_pages = torch.zeros(8, h, b, d, dtype=dtype)
    v_pages = torch.zeros_like(k_pages)
    n = ops.gather_blocks(
        geo,
        plan_slots,
        plan_blocks,
        slot_pages,
        host_indptr,
        host_indices,
        hk,
        hv,
        k_pages,
        v_pages,
        host_k_scales=hk_sc,
        host_v_scales=hv_sc,
    )
    assert n == h
    deq_k, deq_v = ops.dequantize_kv8(hk, hk_sc, dtype), ops.dequantize_kv8(hv, hv_sc, dtype)
    for head in range(h):
        slot, blk = int(plan_slots[0, head, 0]), int(plan_blocks[0, head, 0])
        row, page = nb - 1 - blk, int(slot_pages[0, slot])
        assert torch.equal(k_pages[page, head], deq_k[row, head])
        assert torch.equal(v_pages[page, head], deq_v[row, head])
    assert k_pages[3].abs().sum() == 0  # an unplanned page is untouched


def test_fp8_tiers_refuse_wrong_arguments():
    b, d, h = 8, 64, 2
    geo = ops.KvGeometry(4, h, d, b)
    src = torch.zeros(3, h, b, d)
    ids = torch.arange(3, dtype=torch.int32)
    codes, scales = ops.empty_kv8(geo, 3, "cpu")
    codes_v, scales_v = ops.empty_kv8(geo, 3, "cpu")
    with pytest.raises(errors.ConfigError, match="dst_k_scales"):
        ops.copy_pages(geo, src, src, ids, codes, codes_v, ids)  # uint8 pages without their scales
    with pytest.raises(errors.ConfigError, match="uint8"):
        ops.copy_pages(
            geo, src, src, ids, src.clone(), src.clone(), ids, dst_k_scales=scales, dst_v_scales=scales_v
        )
    with pytest.raises(errors.ShapeError, match="dst_k_scales"):
        ops.copy_pages(
            geo, src, src, ids, codes, codes_v, ids, dst_k_scales=scales[:2], dst_v_scales=scales_v
        )
    with pytest.raises(errors.ShapeError, match="scales"):
        ops.quantize_kv8(geo, src, ids + 1, codes, scales[:, :1].contiguous())
    before = codes.clone()
    with pytest.raises(errors.OasisError, match="valid"):
        ops.quantize_kv8(geo, src, torch.tensor([1, b + 1, 2], dtype=torch.int32), codes, scales)
    assert torch.equal(codes, before)  # nothing written on an error
    with pytest.raises(errors.DTypeError):
        ops.quantize_kv8(geo, src.to(torch.int32), ids + 1, codes, scales)


def ref_attention(q, codes_k, codes_v, sk, sv, indptr, indices, last_len, page_map, extra, sm_scale):
    """float64: every valid (page, head) entry of each sequence, code x scale, then softmax
    attention; rows >= 1 also see the extra K/V."""
    qq = q.double().numpy()
    ns, rows, hq, d = qq.shape
    h = codes_k.shape[1]
    b = codes_k.shape[2]
    kd = e4m3.decode(codes_k.numpy()) * sk.double().numpy()[..., None, None]
    vd = e4m3.decode(codes_v.numpy()) * sv.double().numpy()[..., None, None]
    out = np.zeros((ns, rows, hq, d))
    for s in range(ns):
        pages = indices[indptr[s] : indptr[s + 1]].tolist()
        for hh in range(hq):
            kvh = hh // (hq // h)
            keys, vals = [], []
            for i, pg in enumerate(pages):
                if page_map is not None and page_map[pg, kvh] < 0:
                    continue
                n = int(last_len[s]) if i == len(pages) - 1 else b
                keys.append(kd[pg, kvh, :n])
                vals.append(vd[pg, kvh, :n])
            for r in range(rows):
                ks, vs = list(keys), list(vals)
                if r >= 1 and extra is not None:
                    ks.append(extra[0][s, kvh].double().numpy()[None])
                    vs.append(extra[1][s, kvh].double().numpy()[None])
                if not ks:
                    continue
                K, V = np.concatenate(ks), np.concatenate(vs)
                logits = K @ qq[s, r, hh] * sm_scale
                p = np.exp(logits - logits.max())
                out[s, r, hh] = (p / p.sum()) @ V
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim", GEOMETRIES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_attention_over_fp8_pages_matches_quantize_then_attend(dtype, block_size, head_dim, group):
    """decode_attention over fp8 pages (k_scales/v_scales) against a float64 reference of the
    same codes x scales; head-wise holes, a partial last page and a lookahead row with extra K/V."""
    h, ns, rows = 2, 3, 2
    geo = ops.KvGeometry(h * group, h, head_dim, block_size)
    gen = _gen("attn", dtype, block_size, head_dim, group)
    npages = 10
    kp, ksc = ops.empty_kv8(geo, npages, "cpu")
    vp, vsc = ops.empty_kv8(geo, npages, "cpu")
    full = torch.full((npages,), block_size, dtype=torch.int32)
    ops.quantize_kv8(geo, _keys((npages, h, block_size, head_dim), dtype, gen), full, kp, ksc)
    ops.quantize_kv8(geo, _keys((npages, h, block_size, head_dim), dtype, gen), full, vp, vsc)
    indptr = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    indices = torch.tensor([3, 0, 7, 5, 9, 1, 2, 8, 4], dtype=torch.int32)
    last = torch.tensor([block_size, 3, 1], dtype=torch.int32)
    page_map = torch.randint(0, 50, (npages, h), generator=gen, dtype=torch.int32)
    page_map[7, 0] = page_map[2, 1] = -1  # holes
    q = _keys((ns, rows, h * group, head_dim), dtype, gen) * 0.05
    ek, ev = _keys((ns, h, head_dim), dtype, gen), _keys((ns, h, head_dim), dtype, gen)
    scale = head_dim**-0.5
    out = ops.decode_attention(
        geo,
        q,
        kp,
        vp,
        indptr,
        indices,
        last,
        page_map=page_map,
        extra_k=ek,
        extra_v=ev,
        k_scales=ksc,
        v_scales=vsc,
    )
    want = ref_attention(q, kp, vp, ksc, vsc, indptr, indices, last, page_map, (ek, ev), scale)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    np.testing.assert_allclose(out.double().numpy(), want, atol=tol * np.abs(want).max(), rtol=tol)
    # The same pages dequantized into float32 pages give the same result through the float path.
    same = ops.decode_attention(
        geo,
        q.float(),
        ops.dequantize_kv8(kp, ksc),
        ops.dequantize_kv8(vp, vsc),
        indptr,
        indices,
        last,
        page_map=page_map,
        extra_k=ek.float(),
        extra_v=ev.float(),
    )
    if dtype == torch.float32:
        assert torch.equal(out, same)


def test_attention_refuses_fp8_pages_without_scales():
    geo = ops.KvGeometry(2, 1, 64, 8)
    kp, ksc = ops.empty_kv8(geo, 2, "cpu")
    q = torch.zeros(1, 1, 2, 64)
    tabs = (
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([8], dtype=torch.int32),
    )
    with pytest.raises(errors.ConfigError, match="k_scales"):
        ops.decode_attention(geo, q, kp, kp.clone(), *tabs)
    with pytest.raises(errors.ShapeError, match="v_scales"):
        ops.decode_attention(geo, q, kp, kp.clone(), *tabs, k_scales=ksc, v_scales=ksc[:1].clone())
