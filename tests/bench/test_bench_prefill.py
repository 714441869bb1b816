"""``python -m oasiskv.bench.prefill`` on the CPU at the tiny preset: the smoke test of the GPU
prefill benchmark (every row measured, positive, and the engine's logits those of the forward)."""

from __future__ import annotations

import json

import pytest
import torch

from oasiskv.bench import prefill as bench
from oasiskv.errors import ConfigError
from oasiskv.models.config import PRESETS, preset_config

torch.set_num_threads(2)

ROWS = ("sdpa_forward", "engine_prefill", "engine_prefill_chunked")


def test_bench_prefill_tiny_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    argv = ["--preset", "tiny", "--tokens", "256", "--device", "cpu", "--chunk", "100", "--warmup", "1"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["model"], res["tokens"], res["chunk"], res["dtype"]) == ("tiny", 256, 100, "float32")
    for key in ROWS:
        row = res[key]
        assert row["ms"] > 0 and row["tokens_per_s"] > 0 and len(row["times_s"]) == 3
        assert row["peak_mem_bytes"] is None  # device memory: CUDA only
    for key in ROWS[1:]:
        assert res[key]["ratio_to_sdpa"] > 0
        assert 0 <= res[key]["max_abs_logit_diff"] < 1e-4
    printed = capsys.readouterr().out
    assert all(key in printed for key in ROWS) and "ratio" in printed


def test_bench_prefill_oasis_admits_the_prompt_sparse(tmp_path, capsys):
    """``--backend oasis``: a prompt past the sparse threshold (2,048 tokens by default) is admitted
    sparse in one piece and in chunks, and both prefills give the forward's logits."""
    out = tmp_path / "prefill.json"
    argv = ["--preset", "tiny", "--tokens", "2100", "--device", "cpu", "--chunk", "800", "--repeat", "1"]
    assert bench.main([*argv, "--backend", "oasis", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["backend"] == "oasis"
    for key in ROWS[1:]:
        assert res[key]["admitted_sparse"] and res[key]["max_abs_logit_diff"] < 1e-4
    assert capsys.readouterr().out.count("admitted sparse") == 2
    assert bench.main([*argv, "--json", str(out)]) == 0  # the dense backend: through pages
    assert not any(json.loads(out.read_text())[key]["admitted_sparse"] for key in ROWS[1:])


def test_bench_prefill_one_chunk_and_bad_arguments(tmp_path, capsys):
    """A prompt that fits one chunk has no chunked row; nonsense sizes are argparse errors."""
    out = tmp_path / "prefill.json"
    argv = ["--preset", "tiny", "--tokens", "40", "--device", "cpu", "--repeat", "1"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["chunk"] is None and "engine_prefill_chunked" not in res
    for bad in (["--tokens", "0"], ["--chunk", "-1"], ["--preset", "nope"], ["--backend", "quest"]):
        with pytest.raises(SystemExit):
            bench.main(["--device", "cpu", *bad])


def test_presets_carry_the_published_shapes():
    """Qwen3-8B: 36 layers, 32/8 heads of 128, 8.19e9 parameters; presets are copies."""
    q = preset_config("qwen3-8b")
    assert (q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads, q.head_dim) == (36, 32, 8, 128)
    assert round(q.num_parameters / 1e9, 2) == 8.19
    assert round(preset_config("llama3.1-8b").num_parameters / 1e9, 2) == 8.03
    assert q == PRESETS["qwen3-8b"] and q is not PRESETS["qwen3-8b"]
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset_config("qwen3-9b")
