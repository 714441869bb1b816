"""``KvConfig(host_kv_dtype="fp8_e4m3")`` on the CPU: the host pool holds E4M3 codes and scales
(about half the bytes of bf16 per block), blocks are quantized where they enter it (the dense ->
sparse copy, each token's write-through) exactly as ``ops.quantize_kv8`` / the append rule define,
the summaries stay those of the unquantized keys, the working set is the dequantized blocks, and
decoding stays close to the float host pool's while differing from it. Plus the flag of the engine
CLI and fig11, and the refusal with a remote KV source."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from oasiskv import KvConfig, errors, ops
from oasiskv.bench import serve as bench
from oasiskv.engine.pools import host_row_bytes
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
    bf16, fp8 = host_row_bytes(geo, torch.bfloat16, False), host_row_bytes(geo, torch.bfloat16, True)
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
    assert b["host_pool_bytes"] < a["host_pool_bytes"] / 3  # float32 tiny preset: a quarter + scales
    assert b["fetched_bytes_per_step"] < a["fetched_bytes_per_step"] / 3


def test_a_remote_kv_source_refuses_an_fp8_host_pool():
    from oasiskv.disagg.remote import RemoteKvSource
    from oasiskv.engine import Engine

    eng = Engine(gpu_model("cpu", num_layers=2), KvConfig(**KV, host_kv_dtype="fp8"), "oasis", None)
    with pytest.raises(errors.ConfigError, match="host_kv_dtype"):
        RemoteKvSource(eng, "tcp://127.0.0.1:9")
