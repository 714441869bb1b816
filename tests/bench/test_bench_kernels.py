"""The kernel benchmark's row builders on the CPU (``oasiskv.bench.kernels``): the gather plan
copies every entry it counts, the fp8 rows' byte counts are the codes and scales the CPU twin
actually reads, the fp8 gather's refcheck sees a difference, ``--help`` names the fp8 rows, and the
report prints each row's ratios and its refcheck.
The timed rows themselves need a GPU (``python -m oasiskv.bench.kernels --refcheck``)."""

from __future__ import annotations

import pytest
import torch

from oasiskv import ops
from oasiskv.bench import kernels

#: A small geometry: 2 KV heads, blocks of 4 x 16 (the rows' logic is shape-free).
GEO = ops.KvGeometry(4, 2, 16, 4)


def test_help_lists_the_fp8_rows(capsys):
    with pytest.raises(SystemExit) as e:
        kernels.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "over fp8_e4m3 pages" in text and "from a pinned fp8_e4m3" in text
    assert "{score,attention,gather}" in text  # --only: one group of rows


def test_only_takes_a_known_group_of_rows(capsys):
    with pytest.raises(SystemExit) as e:
        kernels.main(["--only", "dense"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_kv8_bytes_are_codes_and_scales():
    # One entry: 4 x 16 codes and one f32 scale, for K and for V.
    assert kernels.kv8_bytes(GEO, 1) == 2 * (64 + 4)
    assert kernels.kv8_bytes(GEO, 10) == 10 * kernels.kv8_bytes(GEO, 1)


@pytest.mark.parametrize("n_entries", [1, 2 * 128, 3 * 2 * 128])
def test_gather_plan_copies_what_the_kv8_row_counts(n_entries):
    torch.manual_seed(0)
    n_host = 96
    tabs, seqs = kernels.gather_plan(GEO, "cpu", n_entries, n_host)
    assert seqs == max(1, n_entries // (2 * 128))
    hk, hks = kernels.kv8_host_pool(GEO, n_host, pin=False)
    hv, hvs = kernels.kv8_host_pool(GEO, n_host, pin=False)
    assert hk.dtype == torch.uint8 and hks.shape == (n_host, 2)
    kp = torch.zeros(seqs * 128, 2, 4, 16, dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    pool = dict(host_k_scales=hks, host_v_scales=hvs)
    copied = ops.gather_blocks(GEO, *tabs, hk, hv, kp, vp, **pool)
    entries = tabs[0].numel()
    assert copied == entries  # every counted entry is read: the row's bytes are the bytes moved
    # What the entries read: codes of K and V (one byte a value) plus their two scales.
    assert kernels.kv8_bytes(GEO, copied) == 2 * copied * (hk[0, 0].numel() + hks.element_size())
    assert kernels.kv8_gather_refcheck(ops, GEO, tabs, hk, hv, pool, kp, vp)
    kp[0, 0, 0, 0] = float("nan") if kp[0, 0, 0, 0] == kp[0, 0, 0, 0] else 0.0
    assert not kernels.kv8_gather_refcheck(ops, GEO, tabs, hk, hv, pool, kp, vp)


def test_kv8_pages_quantize_finite_values():
    codes, scales = kernels.kv8_pages(ops, GEO, "cpu", torch.bfloat16, 5)
    assert codes.shape == (5, 2, 4, 16) and scales.shape == (5, 2)
    vals = ops.dequantize_kv8(codes, scales)
    assert torch.isfinite(vals).all() and vals.abs().sum() > 0
    # Powers of two: the engine's scales.
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)


def test_codes_rows_count_the_bound_and_the_codes_per_candidate():
    """The codes score reads, per candidate and KV head, the block's 8-bit bound and its codes
    (768 bytes at head_dim 128, block 16: Qwen3-8B's shapes; 1,024 when it read the 16-bit
    summaries), and the rows' inputs hold the bound of their summaries."""
    qwen = ops.KvGeometry(32, 8, 128, 16)
    assert kernels.codes_candidate_bytes(qwen) == 768
    for geo in (qwen, GEO):
        b8, _ = ops.empty_bounds8(geo, 1)
        codes = ops.empty_key_codes(geo, 1)
        assert kernels.codes_candidate_bytes(geo) == b8[0, 0].numel() + codes[0, 0].numel()
    torch.manual_seed(0)
    q, summ, b8, sc, codes, indptr, indices = kernels.codes_inputs(GEO, "cpu", torch.float32, 2, 64)
    assert q.shape == (2, 4, 16) and codes.shape == (32, 2, 4, 4) and indptr.tolist() == [0, 16, 32]
    want = ops.empty_bounds8(GEO, 32)
    ops.build_bounds8(GEO, summ, torch.arange(32, dtype=torch.int32), *want)
    assert torch.equal(b8, want[0]) and torch.equal(sc, want[1])


def test_report_prints_the_ceilings_ratios_and_refchecks():
    res = {
        "device": "GPU X",
        "preset": "qwen3-8b",
        "dtype": "bfloat16",
        "ceilings": {"d2d_copy_Bps": 3.0e12, "h2d_pinned_Bps": 55.0e9, "h2d_sm_Bps": None},
        "kernels": [
            {
                "label": "fp8 gather",
                "ms": 0.5,
                "Bps": 50.6e9,
                "ratio_to_h2d": 0.92,
                "refcheck_bitwise": False,
                "target": ">= 0.9 x pinned H2D memcpy",
            },
            {
                "label": "attn",
                "ms": 0.25,
                "ratio_to_d2d": 0.7,
                "splits_ms": {1: 0.3, 2: "refused"},
                "target": "t",
            },
        ],
    }
    lines = kernels.report_lines(res)
    assert lines[0] == "GPU X  preset qwen3-8b  bfloat16"
    assert "d2d copy 3.00 TB/s" in lines[2] and "pinned H2D 55.0 GB/s" in lines[2]
    assert "SM reads of pinned memory - GB/s" in lines[2]  # not measured
    gather = lines[3]
    assert "500.0 us (eager   500.0)" in gather and "50.6 GB/s" in gather and "h2d 0.92" in gather
    assert "DIFFERS FROM THE TWIN" in gather and gather.endswith("[target >= 0.9 x pinned H2D memcpy]")
    assert "d2d 0.70" in lines[4]
    assert lines[5] == "      splits: 1: 300.0 us, 2: refused"
    res["ceilings"]["h2d_sm_Bps"] = 50.8e9
    assert "SM reads of pinned memory 50.8 GB/s" in kernels.report_lines(res)[2]


@pytest.mark.parametrize("kv8", [False, True])
def test_attention_inputs_run_the_call_they_count(kv8):
    inp = kernels.attention_inputs(ops, GEO, "cpu", torch.bfloat16, 3, 5, sparse=True, kv8=kv8)
    entries = 3 * 5 * GEO.num_kv_heads
    if kv8:
        assert inp.bytes_read == kernels.kv8_bytes(GEO, entries) and set(inp.scales) == {
            "k_scales",
            "v_scales",
        }
    else:
        assert inp.bytes_read == 2 * entries * GEO.block_size * GEO.head_dim * 2 and inp.scales == {}
    assert inp.q.shape == (3, 2, GEO.num_qo_heads, GEO.head_dim) and inp.extra_k.shape == (3, 2, GEO.head_dim)
    inp.out.fill_(float("nan"))
    inp.run(ops)
    want = ops.decode_attention(
        GEO,
        inp.q,
        inp.k_pages,
        inp.v_pages,
        inp.indptr,
        inp.perm,
        inp.last,
        page_map=inp.page_map,
        extra_k=inp.extra_k,
        extra_v=inp.extra_v,
        **inp.scales,
    )
    assert torch.equal(inp.out, want)
    dense = kernels.attention_inputs(ops, GEO, "cpu", torch.bfloat16, 2, 4, sparse=False)
    assert dense.q.shape[1] == 1 and dense.extra_k is None and dense.extra_v is None
