"""``KvConfig(host_kv_dtype="fp8_e4m3")`` on the CPU: the host pool holds E4M3 codes and scales
(about half the bytes of bf16 per block), blocks are quantized where they enter it (the dense ->
sparse copy, each token's write-through) exactly as ``ops.quantize_kv8`` / the append rule define,
the summaries stay those of the unquantized keys, the working set is the dequantized blocks, and
decoding stays close to the float host pool's while differing from it. Plus the flag of the engine
CLI and fig11. (A remote KV source serves an fp8 host pool: tests/disagg/test_disagg_fp8.py.)"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from oasiskv import KvConfig, errors, ops
from oasiskv.bench import serve as bench
from oasiskv.bench.fig11.report import markdown
from oasiskv.engine.pools import kv_block_bytes
from support.engines import gpu_model, repeated_prompts, teacher_forced_logits

torch.set_num_threads(2)

KV = dict(block_size=16, top_k_blocks=6, fetch_cap=2, sparse_threshold=64, block_score="quest")


def _run(host_kv_dtype, **kw):
    model = gpu_model("cpu", num_layers=2)
    prompts = repeated_prompts(model.config.vocab_size, [333, 150])
    forced = [repeated_prompts(model.config.vocab_size, [12], seed=7 + i)[0] for i in range(2)]
    kv = KvConfig(**{**KV, **kw}, host_kv_dtype=host_kv_dtype)
    return teacher_forced_logits(model, kv, "oasis", prompts, forced)


def test_config_names_and_refusals():
    assert KvConfig(host_kv_dtype="fp8").host_kv_dtype == "fp8_e4m3"
    assert KvConfig(host_kv_dtype=torch.float8_e4m3fn).host_kv_dtype == "fp8_e4m3"
    assert KvConfig().host_kv_dtype is None
    for bad in ("int8", torch.bfloat16, "fp8_e5m2"):
        with pytest.raises(errors.ConfigError, match="host_kv_dtype"):
            KvConfig(host_kv_dtype=bad)


def test_host_row_bytes_are_about_half_of_bf16():
    geo = ops.KvGeometry(32, 8, 128, 16)
    bf16, fp8 = kv_block_bytes(geo, torch.bfloat16, False), kv_block_bytes(geo, torch.bfloat16, True)
    assert bf16 == 2 * 8 * 16 * 128 * 2 and fp8 == bf16 // 2 + 2 * 8 * 4  # codes + a scale per head


def test_host_pool_holds_the_quantized_blocks_and_decodes_close_to_float():
    ref, ref_reqs, ref_eng = _run(None)
    got, reqs, eng = _run("fp8_e4m3")
    p, rp = eng.pools, ref_eng.pools
    assert all(r.sparse for r in reqs)
    assert p.host_k[0].dtype == torch.uint8 and p.host_k_scales[0].dtype == torch.float32
    # A float32 model: a quarter of the bytes, plus the scales.
    assert eng.host_row_bytes_all_layers < ref_eng.host_row_bytes_all_layers / 3
    # Every full prompt block the float run holds, quantized by the definition, is what the fp8 run
    # holds (both runs gave the blocks the same host rows). Summaries: the float run's, unquantized.
    r = reqs[0]
    full = r.host_rows[: len(r.prompt) // 16]  # the prompt's full blocks: the same keys in both runs
    rows = torch.tensor(full, dtype=torch.long)
    for layer in range(2):
        want_k, want_sk = ops.empty_kv8(eng.geo, len(full), "cpu")
        valid = torch.full((len(full),), 16, dtype=torch.int32)
        ops.quantize_kv8(eng.geo, rp.host_k[layer][rows], valid, want_k, want_sk)
        assert torch.equal(p.host_k_scales[layer][rows], want_sk)
        assert torch.equal(p.host_k[layer][rows], want_k)
        # The prompt's blocks (decoding then diverges: later keys differ between the runs).
        ids = torch.tensor(r.host_blocks[: len(r.prompt) // 16], dtype=torch.long)
        assert torch.equal(p.summaries[layer][ids], rp.summaries[layer][ids])
    # Decoding: close to the float host pool, not equal (the working set is the dequantized blocks).
    assert not torch.equal(got, ref)
    # E4M3 keeps 3 mantissa bits (up to 2^-4 relative error per value): on this random 2-layer
    # model the logits move by 4.4 % (relative L2), and the greedy choice stays.
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.08, rel
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree
    # The fetched bytes count the fp8 entries.
    assert reqs[0].metrics.fetched_bytes_per_step < ref_reqs[0].metrics.fetched_bytes_per_step / 3


def test_codes_score_and_fp8_host_pool_together():
    """The fidelity selection (codes from the unquantized keys) over an fp8 host pool."""
    got, reqs, _ = _run("fp8_e4m3", block_score="codes", score_candidates=1.5)
    assert torch.isfinite(got).all() and all(r.sparse for r in reqs)


def test_engine_cli_flag_reaches_the_config():
    from oasiskv.serve.cli import add_engine_arguments, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    kw = engine_kwargs(p.parse_args(["--host-kv-dtype", "fp8", "--device", "cpu"]))
    assert kw["kv"].host_kv_dtype == "fp8_e4m3"
    assert engine_kwargs(p.parse_args(["--device", "cpu"]))["kv"].host_kv_dtype is None


def test_fig11_host_pool_in_fp8_halves_its_bytes(tmp_path):
    base = ["--fig11", "--preset", "tiny", "--contexts", "256", "--max-tokens", "4", "--device", "cpu"]
    base += ["--top-k-blocks", "4", "--fetch-cap", "0.5", "--modes", "oasis", "--concurrency", "2"]
    reps = {}
    for dtype in ("auto", "fp8_e4m3"):
        out = tmp_path / f"{dtype}.json"
        assert bench.main([*base, "--host-kv-dtype", dtype, "--json", str(out), "--md", "", "--png", ""]) == 0
        reps[dtype] = json.loads(out.read_text())
    (a,), (b,) = reps["auto"]["rows"], reps["fp8_e4m3"]["rows"]
    assert reps["fp8_e4m3"]["kv"]["host_kv_dtype"] == "fp8_e4m3"
    assert reps["auto"]["kv"]["host_kv_dtype"] == "float32"
    assert a["status"] == b["status"] == "ok"
    assert (a["kv_dtype"], a["host_kv_dtype"]) == ("float32", "float32")
    assert (b["kv_dtype"], b["host_kv_dtype"]) == ("float32", "fp8_e4m3")
    assert "KV float32, host fp8_e4m3" in markdown(reps["fp8_e4m3"])
    assert "KV float32 |" in markdown(reps["auto"]) or "KV float32;" in markdown(reps["auto"])
    assert b["host_pool_bytes"] < a["host_pool_bytes"] / 3  # float32 tiny preset: a quarter + scales
    assert b["fetched_bytes_per_step"] < a["fetched_bytes_per_step"] / 3


# ------------------------------------------------------------------ fp8 GPU pages (dense backend)
def _dense(kv_dtype, prompts, n=10, chunk=None):
    import oasiskv

    model = gpu_model("cpu", num_layers=2)
    kv = KvConfig(block_size=16, top_k_blocks=4, kv_dtype=kv_dtype)
    llm = oasiskv.LLM(model, kv=kv, backend="dense", drafter=None)
    if chunk is not None:
        llm.llm_engine.max_num_batched_tokens = chunk  # chunked prefill (the scheduler's budget)
    return llm, llm.generate(prompts, n, ignore_eos=True)


def test_dense_fp8_pages_hold_the_quantized_prompt_and_decode_close_to_float():
    model = gpu_model("cpu", num_layers=2)
    prompts = repeated_prompts(model.config.vocab_size, [150, 77])
    ref_llm, ref = _dense(None, prompts)
    llm, got = _dense("fp8", prompts)
    eng, ref_eng = llm.llm_engine.engine, ref_llm.llm_engine.engine
    p = eng.pools
    assert eng.page_kv8 and p.k_pages[0].dtype == torch.uint8 and p.k_scales[0].dtype == torch.float32
    assert eng.page_bytes_all_layers < ref_eng.page_bytes_all_layers / 3  # float32 model
    # Greedy tokens mostly agree with float pages; the fp8 pages are in effect (some logits move).
    same = sum(a == b for r, s in zip(ref, got, strict=True) for a, b in zip(r.tokens, s.tokens, strict=True))
    assert same >= 0.7 * sum(len(r.tokens) for r in ref), same
    assert all(len(r.tokens) == 10 for r in got)


def test_dense_fp8_prompt_pages_equal_the_definition():
    """One prefill: every full prompt page is quantize_kv8 of that page's float K/V, the partial
    last page over its valid rows only."""
    from oasiskv.engine import Engine, Request

    model = gpu_model("cpu", num_layers=2)
    prompt = repeated_prompts(model.config.vocab_size, [150])[0]
    engines = {}
    for kvd in (None, "fp8_e4m3"):
        eng = Engine(model, KvConfig(block_size=16, top_k_blocks=4, kv_dtype=kvd), "dense", None)
        r = Request(id=0, prompt=prompt, max_new_tokens=2)
        eng.ensure_pools([r])
        eng.prefill(r)
        engines[kvd] = (eng, r)
    (fe, fr), (qe, qr) = engines[None], engines["fp8_e4m3"]
    ids_f = torch.tensor(fr.pages, dtype=torch.long)
    ids_q = torch.tensor(qr.pages, dtype=torch.long)
    valid = torch.tensor([16] * 9 + [150 - 9 * 16], dtype=torch.int32)
    for layer in range(2):
        want, want_s = ops.empty_kv8(qe.geo, 10, "cpu")
        ops.quantize_kv8(qe.geo, fe.pools.k_pages[layer][ids_f], valid, want, want_s)
        got = qe.pools.k_pages[layer][ids_q]
        assert torch.equal(qe.pools.k_scales[layer][ids_q], want_s)
        assert torch.equal(got[:9], want[:9]) and torch.equal(got[9, :, :6], want[9, :, :6])


def test_dense_fp8_chunked_prefill_runs_and_stays_close():
    """Chunks that end mid-page continue that page (dequantize, requantize with the grown
    scale); the chunks attend to the stored (fp8) prefix, so the tokens are close to one
    prefill's, not equal."""
    model = gpu_model("cpu", num_layers=2)
    prompts = repeated_prompts(model.config.vocab_size, [150])
    _, one = _dense("fp8", prompts, n=8)
    _, chunked = _dense("fp8", prompts, n=8, chunk=37)
    assert len(chunked[0].tokens) == 8
    assert sum(a == b for a, b in zip(one[0].tokens, chunked[0].tokens, strict=True)) >= 5


def test_oasis_with_fp8_pages_equals_dense_fp8_with_a_covering_budget():
    """Issue 36's equality: with a budget that covers the context, OasisKV over fp8 pages (and an
    fp8 host pool) gives dense fp8's logits exactly (the working set is the same codes and
    scales, gathered as bytes)."""
    model = gpu_model("cpu", num_layers=2)
    prompts = repeated_prompts(model.config.vocab_size, [333, 150])
    forced = [repeated_prompts(model.config.vocab_size, [12], seed=7 + i)[0] for i in range(2)]
    kw = dict(block_size=16, top_k_blocks=64, fetch_cap=None, sparse_threshold=64, block_score="quest")
    out = {}
    for backend in ("dense", "oasis"):
        kv = KvConfig(**kw, kv_dtype="fp8")
        out[backend], reqs, _ = teacher_forced_logits(model, kv, backend, prompts, forced)
    assert all(r.sparse for r in reqs)
    assert torch.equal(out["oasis"], out["dense"])
    float_dense, _, _ = teacher_forced_logits(model, KvConfig(**kw), "dense", prompts, forced)
    assert not torch.equal(out["dense"], float_dense)


def test_oasis_with_fp8_pages_gathers_the_host_rows_as_bytes():
    """A small budget: every working-set page holds, byte for byte, the host row of the block it
    maps (codes and scale), and the step runs (the selection differs from float's, so the
    logits are not compared)."""
    got, reqs, eng = _run(None, kv_dtype="fp8")
    p = eng.pools
    assert eng.page_kv8 and eng.host_kv8 and p.k_pages[0].dtype == torch.uint8 == p.host_k[0].dtype
    assert all(r.sparse for r in reqs) and torch.isfinite(got).all()
    r, checked = reqs[0], 0
    for layer in range(2):
        for page in r.slot_pages:
            for head in range(p.geo.num_kv_heads):
                blk = int(p.page_map[layer, page, head])
                if blk < 0:
                    continue
                row = r.host_rows[blk]
                assert torch.equal(p.k_pages[layer][page, head], p.host_k[layer][row, head])
                assert torch.equal(p.v_pages[layer][page, head], p.host_v[layer][row, head])
                assert p.k_scales[layer][page, head] == p.host_k_scales[layer][row, head]
                checked += 1
    assert checked > 0


def test_fp8_kv_dtype_names():
    assert KvConfig(kv_dtype=torch.float8_e4m3fn).kv_dtype == "fp8_e4m3"
    with pytest.raises(errors.ConfigError, match="kv_dtype"):
        KvConfig(kv_dtype="int4")


def test_fig11_kv_dtype_fp8_runs_dense_and_oasis(tmp_path):
    base = ["--fig11", "--preset", "tiny", "--contexts", "256", "--max-tokens", "4", "--device", "cpu"]
    base += ["--top-k-blocks", "4", "--fetch-cap", "0.5", "--modes", "dense,oasis", "--concurrency", "1"]
    out = tmp_path / "fp8.json"
    assert bench.main([*base, "--kv-dtype", "fp8", "--json", str(out), "--md", "", "--png", ""]) == 0
    rep = json.loads(out.read_text())
    assert rep["kv"]["kv_dtype"] == rep["kv"]["host_kv_dtype"] == "fp8_e4m3"
    assert [r["status"] for r in rep["rows"]] == ["ok", "ok"]
    dtypes = [(r["kv_dtype"], r["host_kv_dtype"]) for r in rep["rows"]]
    assert dtypes == [("fp8_e4m3", None), ("fp8_e4m3", "fp8_e4m3")]
    rows = [line for line in markdown(rep).splitlines() if line.startswith("| 256 |")]
    assert len(rows) == 2 and all("KV fp8_e4m3" in line and ", host" not in line for line in rows)


def test_engine_cli_kv_dtype_flag():
    from oasiskv.serve.cli import add_engine_arguments, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_kwargs(p.parse_args(["--kv-dtype", "fp8", "--device", "cpu"]))["kv"].kv_dtype == "fp8_e4m3"


def test_host_kv_reads_an_fp8_pool_as_its_values_and_the_teacher_mass_uses_them():
    """``KvPools.host_kv``: an fp8 host pool's rows as code x scale (the float run's rows quantized
    by the definition); the evaluation's exact attention mass over them is the float pool's within
    the quantization error (s20: reading the codes as keys gave 6 % where 84 % is right)."""
    from oasiskv.eval.overlap import block_attention_mass

    _, ref_reqs, ref_eng = _run(None)
    _, reqs, eng = _run("fp8_e4m3")
    r, rr = reqs[0], ref_reqs[0]
    rows = torch.tensor(r.host_rows[: len(r.prompt) // 16], dtype=torch.long)
    k, v = eng.pools.host_kv(0, rows)
    assert k.dtype == v.dtype == eng.dtype
    codes, scales = eng.pools.host_k[0][rows], eng.pools.host_k_scales[0][rows]
    assert torch.equal(k, ops.dequantize_kv8(codes, scales, eng.dtype))
    fk, fv = ref_eng.pools.host_kv(0, rows)
    assert torch.equal(fk, ref_eng.pools.host_k[0][rows]) and torch.equal(fv, ref_eng.pools.host_v[0][rows])
    assert (k - fk).abs().max() <= fk.abs().max() * 2**-4  # within one E4M3 step of the block's range

    # The mass over the prompt alone (decoding diverges later): each request as of its last prompt
    # token (what block_attention_mass reads of a request: kv_len, its runtime table).
    def at_prompt(req):
        return SimpleNamespace(kv_len=len(req.prompt) - 1, runtime=req.runtime, id=req.id)

    q = torch.randn(1, eng.geo.num_qo_heads, eng.geo.head_dim, generator=torch.Generator().manual_seed(3))
    got = block_attention_mass(eng, 0, [at_prompt(r)], q)
    want = block_attention_mass(ref_eng, 0, [at_prompt(rr)], q)
    assert torch.allclose(got.sum(-1), torch.ones_like(got.sum(-1)))
    assert (got - want).abs().max() < 0.05, (got - want).abs().max()
