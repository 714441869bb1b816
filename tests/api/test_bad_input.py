"""Issue 9's bad-input audit: sizes checked before allocating, non-finite weights refused at load,
KvConfig and ModelConfig bounds. Each case is a typed error whose message names the field or the
tensor, never a raw RuntimeError or a silent wrong answer."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

import oasiskv
from oasiskv import memory
from oasiskv.config import MAX_POOL_BLOCKS, MAX_TOP_K_BLOCKS, KvConfig
from oasiskv.errors import CheckpointError, ConfigError, OasisError, OutOfMemoryError
from oasiskv.models.config import SIZE_BOUNDS, ModelConfig, estimate_model_bytes
from oasiskv.models.loader import load_gguf, load_hf_dir, read_hf_config
from oasiskv.models.transformer import CausalLM
from support.checkpoints import tiny_cfg, write_gguf, write_hf_dir

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny():
    return CausalLM.random(tiny_cfg("llama"), seed=3)


# ----------------------------------------------------------------------------- memory estimate
@pytest.mark.parametrize("family, tied", [("llama", False), ("qwen3", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimate_model_bytes_counts_every_parameter(family, tied, dtype):
    cfg = tiny_cfg(family, tie_word_embeddings=tied)
    model = CausalLM(cfg, dtype=dtype)
    actual = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head counts once
    assert estimate_model_bytes(cfg, dtype) == actual


def test_available_bytes():
    cpu = memory.available_bytes("cpu")
    assert cpu is None or (isinstance(cpu, int) and cpu > 0)
    assert memory.available_bytes("meta") is None


def test_model_too_large_for_memory_fails_before_allocating(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 10 << 20)
    big_vocab = tiny_cfg(vocab_size=1 << 20, hidden_size=1024, num_attention_heads=8, head_dim=128)
    with pytest.raises(OutOfMemoryError, match=r"vocab_size=1048576 x hidden_size=1024.*10\.0 MiB") as ei:
        CausalLM(big_vocab)
    assert isinstance(ei.value, MemoryError) and isinstance(ei.value, OasisError)
    assert "config.json" in str(ei.value) and "bfloat16" in str(ei.value)
    deep = tiny_cfg(num_hidden_layers=1000, hidden_size=1024, num_attention_heads=8, head_dim=128)
    with pytest.raises(OutOfMemoryError, match="num_hidden_layers=1000"):
        CausalLM.random(deep)
    # the escape hatch, for estimates that are wrong (swap): a small model then allocates
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1)
    monkeypatch.setenv(memory.MEMORY_CHECK_ENV, "0")
    CausalLM(tiny_cfg())


def test_hf_dir_with_absurd_sizes_is_a_config_error(tiny, tmp_path):
    d = write_hf_dir(tiny, tmp_path / "m")
    good = json.loads((d / "config.json").read_text())
    for key, value in (("vocab_size", 10**11), ("num_hidden_layers", 3000), ("hidden_size", True)):
        (d / "config.json").write_text(json.dumps({**good, key: value}))
        with pytest.raises(ConfigError, match=key):
            load_hf_dir(d)


# ----------------------------------------------------------------------------- non-finite weights
def test_nan_weight_in_safetensors_names_the_tensor(tiny, tmp_path):
    d = write_hf_dir(tiny, tmp_path / "m")
    sd = tiny.hf_state_dict()
    sd["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    sd["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.* 2 NaN/inf"):
        load_hf_dir(d)


def test_weights_overflowing_float16_are_refused(tiny, tmp_path):
    d = write_hf_dir(tiny, tmp_path / "m")
    sd = tiny.hf_state_dict()
    sd["model.norm.weight"][0] = 1e6  # finite in float32, inf in float16
    save_file(sd, str(d / "model.safetensors"))
    assert load_hf_dir(d).norm.weight[0] == 1e6
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*range of torch\.float16.*bfloat16"):
        load_hf_dir(d, dtype=torch.float16)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_gguf_with_ff_bytes_names_the_tensor(tiny, tmp_path, qtype):
    path = write_gguf(tiny, tmp_path / "m.gguf", qtype)
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_up.weight")
    # 0xFF bytes are NaN as f32 and as Q8_0's f16 scales; the audit's file generated [0, 0, 0, 0]
    with open(path, "r+b") as f:
        f.seek(t.data_offset)
        f.write(b"\xff" * min(64 << 10, t.n_bytes))
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*NaN/inf"):
        load_gguf(path)


# ----------------------------------------------------------------------------- KvConfig
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"block_size": True}, "block_size must be an int.*type bool"),
        ({"top_k_blocks": True}, "top_k_blocks must be an int"),
        ({"sparse_threshold": False}, "sparse_threshold"),
        ({"num_gpu_pages": True}, "num_gpu_pages"),
        ({"num_host_blocks": 2.0}, "num_host_blocks"),
        ({"top_k_blocks": MAX_TOP_K_BLOCKS + 1}, r"top_k_blocks=513 is above 512.*GPU top-K.*block_size"),
        ({"top_k_blocks": 10**9}, r"top_k_blocks=1000000000 is above 512"),
        ({"num_gpu_pages": 10**12}, rf"num_gpu_pages=1000000000000 is above {MAX_POOL_BLOCKS}.*i32"),
        ({"num_host_blocks": 1 << 31}, rf"num_host_blocks=2147483648 is above {MAX_POOL_BLOCKS}"),
        ({"sparse_threshold": 1 << 40}, "sparse_threshold=.* is above"),
        ({"measure_recall": "no"}, "measure_recall"),
    ],
)
def test_kv_config_bounds(kw, match):
    with pytest.raises(ConfigError, match=match):
        KvConfig(**kw)


def test_kv_config_limits_are_accepted():
    kv = KvConfig(
        top_k_blocks=MAX_TOP_K_BLOCKS, num_gpu_pages=MAX_POOL_BLOCKS, num_host_blocks=MAX_POOL_BLOCKS
    )
    assert kv.top_k_blocks == 512


# ----------------------------------------------------------------------------- ModelConfig
@pytest.mark.parametrize("field", sorted(SIZE_BOUNDS))
@pytest.mark.parametrize("kind", ["bool", "zero", "negative", "float", "absurd"])
def test_model_config_sizes(field, kind):
    value = {"bool": True, "zero": 0, "negative": -4, "float": 64.0, "absurd": SIZE_BOUNDS[field] + 2}[kind]
    base = dict(
        family="llama",
        vocab_size=100,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
    )
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**base, field: value})


def test_model_config_from_hf_dict_rejects_zero_kv_heads_and_bool_ids(tiny, tmp_path):
    d = tiny.config.to_hf_dict()
    with pytest.raises(ConfigError, match="num_key_value_heads must be a positive int, got 0"):
        ModelConfig.from_hf_dict({**d, "num_key_value_heads": 0})
    with pytest.raises(ConfigError, match="special token ids"):
        ModelConfig.from_hf_dict({**d, "eos_token_id": [True]})
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        ModelConfig.from_hf_dict({**d, "rms_norm_eps": True})
    (tmp_path / "config.json").write_text(json.dumps({**d, "vocab_size": 10**11}))
    with pytest.raises(ConfigError, match=r"vocab_size=100000000000 is larger than 16777216.*config\.json"):
        read_hf_config(tmp_path)


# ----------------------------------------------------------------------------- the CLI
def _generate(model) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "oasiskv.cli", "generate", str(model), "--prompt", "hi", "--backend", "dense"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_generate_reports_bad_models_in_one_line(tiny, tmp_path):
    d = write_hf_dir(tiny, tmp_path / "m")
    good = json.loads((d / "config.json").read_text())
    ff = write_gguf(tiny, tmp_path / "ff.gguf", Q.F32)
    t = next(t for t in gguf.GGUFReader(str(ff)).tensors if t.name == "token_embd.weight")
    with open(ff, "r+b") as f:
        f.seek(t.data_offset)
        f.write(b"\xff" * 4096)
    cases = [
        ({"vocab_size": 10**11}, d, "vocab_size"),
        ({"num_hidden_layers": 3000}, d, "num_hidden_layers"),
        # within the bounds, but about 16 TiB of weights: no test machine has that free
        ({"vocab_size": 1 << 24, "hidden_size": 1 << 17, "head_dim": 128}, d, "would take"),
        ({}, ff, "token_embd.weight"),
    ]
    for changes, model, says in cases:
        (d / "config.json").write_text(json.dumps({**good, **changes}))
        p = _generate(model)
        assert p.returncode == 2, p.stderr[-2000:]
        assert "Traceback" not in p.stderr and p.stderr.startswith("oasis generate: error: ")
        assert says in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_out_of_memory_error_is_exported():
    assert oasiskv.OutOfMemoryError is OutOfMemoryError and "OutOfMemoryError" in oasiskv.__all__
