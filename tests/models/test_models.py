"""CausalLM (Llama / Qwen3) against transformers on random weights, plus the attention helpers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from oasiskv.errors import ConfigError, ContextLengthError, ShapeError
from oasiskv.models import transformer
from oasiskv.models.config import PRESETS, ModelConfig, preset_config
from oasiskv.models.loader import load_hf_dir
from oasiskv.models.transformer import (
    CausalLM,
    DenseKVCache,
    causal_attention,
    dense_causal_attn,
    greedy_generate,
    rms_norm,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    varlen_causal_attention,
)
from support.hf_models import HF_CASES, LLAMA3_SCALING, YARN_SCALING, make_hf_model

# Private names read here: ``transformer._no_cudnn`` (the guard that keeps cuDNN off the pieces it
# gets wrong) is what its test checks.

transformers = pytest.importorskip("transformers")
torch.set_num_threads(2)


@pytest.fixture(scope="module", params=list(HF_CASES))
def pair(request, tmp_path_factory):
    case = HF_CASES[request.param]
    hf = make_hf_model(case)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    ours = load_hf_dir(d)
    return request.param, hf, ours


def test_matches_transformers_logits_and_hidden_states(pair):
    name, hf, ours = pair
    n = 37
    ids = torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n) + 20  # offset so scaled RoPE frequencies matter
    with torch.no_grad():
        ref = hf(ids[None], position_ids=pos[None], output_hidden_states=True)
    L = ours.num_layers
    logits, captured = ours(ids, pos, dense_causal_attn(), capture_layers=range(L + 1))
    assert logits.dtype == torch.float32 and logits.shape == (n, 257)
    torch.testing.assert_close(logits, ref.logits[0], atol=1e-4, rtol=1e-4)
    assert set(captured) == set(range(L + 1))
    for i in range(L):  # hidden_states[i] = residual stream entering layer i
        torch.testing.assert_close(captured[i], ref.hidden_states[i][0], atol=1e-5, rtol=1e-5)
    # transformers' last entry is after the final norm
    normed = rms_norm(captured[L], ours.norm.weight, ours.config.rms_norm_eps)
    torch.testing.assert_close(normed, ref.hidden_states[L][0], atol=1e-5, rtol=1e-5)
    assert logits.std() > 0.05  # not a degenerate model


def test_logits_rows_subset(pair):
    _, _, ours = pair
    n = 19
    ids = torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(n)
    full, _ = ours(ids, pos, dense_causal_attn())
    rows = torch.tensor([0, 7, 18, 7])
    sub, cap = ours(ids, pos, dense_causal_attn(), logits_rows=rows)
    assert sub.shape == (4, 257) and cap == {}
    torch.testing.assert_close(sub, full[rows], atol=1e-6, rtol=1e-6)


def test_config_round_trip_through_transformers(pair):
    _, hf, ours = pair
    cfg = ours.config
    d = cfg.to_hf_dict()
    cls = transformers.LlamaConfig if cfg.family == "llama" else transformers.Qwen3Config
    hf_cfg = cls(**json.loads(json.dumps(d)))
    assert ModelConfig.from_hf_dict(hf_cfg.to_dict()) == cfg
    assert ModelConfig.from_hf_dict(d) == cfg
    assert hf_cfg.head_dim == cfg.head_dim and hf_cfg.num_key_value_heads == cfg.num_key_value_heads
    # the config transformers wrote parses to the same thing
    assert ModelConfig.from_hf_dict(hf.config.to_dict()) == cfg


@pytest.mark.parametrize(
    "scaling", [LLAMA3_SCALING, {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"]
)
def test_rope_scaling_matches_transformers_and_changes_frequencies(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig("llama", 100, 128, 64, 1, 4, 2, rope_theta=10000.0, rope_scaling=scaling)
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf_dict())
    want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    got = rope_inv_freq(cfg)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    plain = rope_inv_freq(cfg.replace(rope_scaling=None))
    assert not torch.allclose(got, plain)
    if scaling["rope_type"] == "llama3":  # the highest frequencies are left alone
        assert torch.equal(got[0], plain[0])


#: YaRN settings transformers computes differently: Qwen3's own, every optional key, DeepSeek's
#: mscale ratio, an explicit attention factor, and a null factor (max_position_embeddings / original).
YARN_VARIANTS = {
    "qwen3-card": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "betas-no-truncate": {
        "rope_type": "yarn",
        "factor": 3.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "truncate": False,
    },
    "mscales": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "attention-factor": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 0.9,
    },
    "null-factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},
}


def _hf_rotary(hf_cfg):
    """transformers' rotary embedding module of ``hf_cfg`` (no weights)."""
    if hf_cfg.model_type == "llama":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
    else:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rotary
    return Rotary(hf_cfg)


def _assert_rope_matches_transformers(cfg: ModelConfig, hf_cfg, positions: list[int]) -> None:
    """Our inverse frequencies, attention factor and cos/sin tables at ``positions`` equal
    transformers' for the same config (float32)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg), want_inv, atol=0, rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(want_factor, rel=1e-12)
    pos = torch.tensor(positions)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), pos, torch.float32, rope_attention_factor(cfg))
    hf_cos, hf_sin = _hf_rotary(hf_cfg)(torch.zeros(1, dtype=torch.float32), pos[None])
    torch.testing.assert_close(cos[:, 0], hf_cos[0], atol=1e-5, rtol=1.3e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], atol=1e-5, rtol=1.3e-6)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("scaling", list(YARN_VARIANTS.values()), ids=list(YARN_VARIANTS))
def test_yarn_rope_matches_transformers(family, scaling):
    cfg = ModelConfig(
        family, 100, 128, 64, 1, 4, 2, rope_theta=10000.0, rope_scaling=scaling, max_position_embeddings=256
    )
    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config
    # transformers reads the dict as given (a null factor too), not our normalised copy
    hf_cfg = cls(**{**cfg.to_hf_dict(), "rope_scaling": dict(scaling), "rope_parameters": None})
    _assert_rope_matches_transformers(cfg, hf_cfg, [0, 1, 63, 64, 200, 255])
    assert ModelConfig.from_hf_dict(hf_cfg.to_dict()) == cfg
    plain = rope_inv_freq(cfg.replace(rope_scaling=None))
    assert torch.equal(rope_inv_freq(cfg)[0], plain[0])  # the fastest pair extrapolates
    if cfg.rope_scaling["factor"] > 1:
        assert not torch.allclose(rope_inv_freq(cfg), plain)


def test_yarn_original_context_defaults_to_max_position_embeddings_as_in_transformers():
    d = {**make_hf_model(HF_CASES["qwen3-yarn"]).config.to_dict(), "rope_parameters": None}
    d.update(rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 256
    _assert_rope_matches_transformers(cfg, transformers.Qwen3Config(**d), [0, 255])


@pytest.mark.parametrize("fused", ["never", "always"])
@pytest.mark.parametrize("case", ["qwen3-yarn", "llama-yarn"])
def test_yarn_forward_matches_transformers_past_the_original_context(case, fused, tmp_path, monkeypatch):
    """200 positions over a model trained on 64 (YARN_SCALING): the torch path and the fused one
    (its CPU twins) give transformers' logits."""
    hf = make_hf_model(HF_CASES[case])
    hf.save_pretrained(tmp_path)
    ours = load_hf_dir(tmp_path)
    assert ours.config.rope_scaling == YARN_SCALING and ours.rope_attention_factor > 1.1
    monkeypatch.setattr(transformer, "FUSED_KERNELS", fused)
    n = 200
    ids = torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(n) + 50  # up to 249 of max_position_embeddings 256
    with torch.no_grad():
        ref = hf(ids[None], position_ids=pos[None]).logits[0]
    logits, _ = ours(ids, pos, dense_causal_attn())
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    # without the attention factor the logits move ten times past that tolerance
    monkeypatch.setattr(ours, "rope_attention_factor", 1.0)
    assert (ours(ids, pos, dense_causal_attn())[0] - ref).abs().max() > 1e-3


def test_qwen3_8b_128k_preset():
    """Qwen3-8B with YaRN to 131,072 positions (factor 4 over 32,768, as its model card says):
    qwen3-8b's shape, and transformers' RoPE for it at positions across the 128K."""
    from oasiskv.bench.kernels import PRESETS as KERNEL_SHAPES

    cfg = preset_config("qwen3-8b-128k")
    assert cfg.max_position_embeddings == 131072
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    base = PRESETS["qwen3-8b"]
    assert cfg.replace(rope_scaling=None, max_position_embeddings=40960) == base
    assert KERNEL_SHAPES["qwen3-8b-128k"] == KERNEL_SHAPES["qwen3-8b"]
    # --fig11 --contexts 65536 (and 128K less the decoded tokens) fit the model's context
    assert 65536 + 64 - 1 <= cfg.max_position_embeddings
    hf_cfg = transformers.Qwen3Config(**cfg.to_hf_dict())
    assert rope_attention_factor(cfg) == pytest.approx(0.1 * math.log(4) + 1)
    _assert_rope_matches_transformers(cfg, hf_cfg, [0, 4095, 32767, 32768, 65535, 131071])


def test_varlen_batch_equals_separate_requests():
    cfg = ModelConfig("qwen3", 257, 96, 160, 3, 6, 2, head_dim=16)
    model = CausalLM.random(cfg, seed=3)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 257, (11,), generator=g), torch.randint(0, 257, (6,), generator=g)
    la, _ = model(a, torch.arange(11), dense_causal_attn())
    lb, _ = model(b, torch.arange(6), dense_causal_attn())
    ids = torch.cat([a, b])
    pos = torch.cat([torch.arange(11), torch.arange(6)])
    lab, cap = model(ids, pos, dense_causal_attn([0, 11, 17]), capture_layers=[1])
    torch.testing.assert_close(lab, torch.cat([la, lb]), atol=1e-5, rtol=1e-5)
    assert cap[1].shape == (17, 96)


def test_incremental_decode_with_dense_cache_matches_full_forward():
    cfg = ModelConfig("llama", 257, 96, 160, 3, 6, 2, rope_scaling=LLAMA3_SCALING, max_position_embeddings=64)
    model = CausalLM.random(cfg, seed=4)
    ids = torch.randint(0, 257, (14,), generator=torch.Generator().manual_seed(5))
    full, _ = model(ids, torch.arange(14), dense_causal_attn())
    cache = DenseKVCache(model.num_layers, model.attn_scale)
    rows = [model(ids[:9], torch.arange(9), cache)[0]]
    for t in range(9, 14):
        rows.append(model(ids[t : t + 1], torch.tensor([t]), cache)[0])
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 14


def test_attn_callable_contract():
    cfg = ModelConfig("qwen3", 257, 96, 160, 3, 6, 2, head_dim=24)
    model = CausalLM.random(cfg, seed=0)
    seen = []

    def attn(i, q, k, v):
        seen.append(i)
        assert q.shape == (5, 6, 24) and k.shape == (5, 2, 24) and v.shape == (5, 2, 24)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        return causal_attention(q, k, v, model.attn_scale)

    model(torch.arange(5), torch.arange(5), attn)
    assert seen == [0, 1, 2]

    with pytest.raises(ShapeError, match="returned shape"):
        model(torch.arange(5), torch.arange(5), lambda i, q, k, v: q[:, :2])
    with pytest.raises(ShapeError, match="capture layer"):
        model(torch.arange(5), torch.arange(5), attn, capture_layers=[4])
    with pytest.raises(ShapeError, match="1-D"):
        model(torch.arange(5)[None], torch.arange(5)[None], attn)


def test_causal_attention_with_cached_prefix_and_gqa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(10, 4, 8, generator=g)
    k = torch.randn(10, 2, 8, generator=g)
    v = torch.randn(10, 2, 8, generator=g)
    full = causal_attention(q, k, v)
    tail = causal_attention(q[6:], k, v)  # last 4 queries over the whole prefix
    torch.testing.assert_close(tail, full[6:], atol=1e-6, rtol=1e-6)
    # explicit GQA reference: head h uses kv head h // 2
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) / 8**0.5
    scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(full, ref, atol=1e-5, rtol=1e-5)
    two = varlen_causal_attention(q, k, v, [0, 3, 10])
    torch.testing.assert_close(two[:3], causal_attention(q[:3], k[:3], v[:3]))
    torch.testing.assert_close(two[3:], causal_attention(q[3:], k[3:], v[3:]))


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-3, rtol=1.6e-2),
    torch.float32: dict(atol=1e-5, rtol=1.3e-6),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nq, nk, hq, hkv", [(97, 97, 8, 2), (54, 131, 8, 2), (1, 97, 6, 3), (33, 54, 4, 4)])
def test_causal_attention_against_a_reference(device, dtype, nq, nk, hq, hkv):
    """Every path of causal_attention (one causal piece, a chunk after a cached prefix -- on a GPU
    in 16 bits the flash kernel's bottom-right causal mask --, one query, GQA or not) against
    float32 attention over an explicit mask and KV heads repeated by hand."""
    g = torch.Generator().manual_seed(nq + nk)
    q, k, v = (torch.randn(n, h, 64, generator=g) for n, h in ((nq, hq), (nk, hkv), (nk, hkv)))
    got = causal_attention(*(x.to(device, dtype) for x in (q, k, v)), scale=0.1)
    q, k, v = (x.to(dtype).float() for x in (q, k, v))  # the inputs as the kernel saw them
    kr, vr = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kr) * 0.1
    seen = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vr)
    assert got.shape == (nq, hq, 64) and got.dtype == dtype and got.is_contiguous()
    tol = TOL[dtype]
    if dtype == torch.bfloat16:
        # NOTE: fused kernels round the softmax weights to bf16 before P @ V: an absolute error of
        # about one bf16 ulp of |v| (2**-8), also on outputs near zero.
        tol = dict(tol, atol=4e-3)
    torch.testing.assert_close(got.float().cpu(), ref, **tol)


def test_queries_against_a_longer_cache_never_take_cudnn():
    """cuDNN's SDPA builds a plan per new shape (40-70 ms on the H200), and a decoding cache has
    a new length every step: causal_attention keeps it for full causal pieces only."""
    from types import SimpleNamespace

    from oasiskv.models import transformer

    if transformer.sdpa_kernel is None:  # pragma: no cover - torch < 2.3
        pytest.skip("torch has no sdpa_kernel")
    with transformer._no_cudnn(SimpleNamespace(is_cuda=True)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with transformer._no_cudnn(torch.zeros(1)):  # a CPU query: nothing changes
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cudnn_only_for_full_causal_pieces_on_cuda(monkeypatch):
    real = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def spy(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    default = torch.backends.cuda.cudnn_sdp_enabled()
    # NOTE: float32, so the chunk takes an explicit mask: the spy in place of SDPA would break
    # the dispatch of the 16-bit path's CausalBias mask (it matches SDPA by identity).
    q = torch.randn(64, 8, 64, device="cuda")
    k = torch.randn(64, 2, 64, device="cuda")
    causal_attention(q, k, k)  # prefill: nq == nk
    causal_attention(q[-1:], k, k)  # one decode query
    causal_attention(q[-16:], k, k)  # a chunk after a cached prefix
    assert seen == [default, False, False]


def test_random_is_deterministic_and_meaningful():
    cfg = ModelConfig("llama", 100, 32, 64, 2, 4, 2)
    a, b, c = CausalLM.random(cfg, seed=7), CausalLM.random(cfg, seed=7), CausalLM.random(cfg, seed=8)
    for (na, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), na
        assert not torch.equal(pa, pc), na
    norm = a.layers[0].input_layernorm.weight
    assert 0.05 < norm.std() < 0.2 and abs(norm.mean() - 1) < 0.1
    assert 0.015 < a.layers[0].qkv_proj.std() < 0.025
    assert not any(p.requires_grad for p in a.parameters())


def test_bfloat16_forward_close_to_float32():
    cfg = ModelConfig("qwen3", 257, 96, 160, 2, 6, 2, head_dim=16)
    f32 = CausalLM.random(cfg, seed=1)
    bf = CausalLM.random(cfg, seed=1, dtype=torch.bfloat16)
    ids = torch.arange(12) * 13 % 257
    a, _ = f32(ids, torch.arange(12), dense_causal_attn())
    b, _ = bf(ids, torch.arange(12), dense_causal_attn())
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_greedy_generate_and_context_limit():
    cfg = ModelConfig("llama", 50, 32, 64, 2, 4, 2, max_position_embeddings=16, eos_token_ids=[])
    model = CausalLM.random(cfg, seed=0)
    out = greedy_generate(model, [1, 2, 3], 5)
    assert len(out) == 5 and all(0 <= t < 50 for t in out)
    # greedy = argmax of the full forward over prompt + generated
    seq = [1, 2, 3, *out]
    full, _ = model(torch.tensor(seq), torch.arange(len(seq)), dense_causal_attn())
    assert full[2:-1].argmax(-1).tolist() == out
    with pytest.raises(ContextLengthError, match="context window of 16"):
        greedy_generate(model, list(range(10)), 10)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_key_value_heads": 4}, "multiple of num_key_value_heads"),
        ({"head_dim": 15}, "even"),
        ({"family": "mistral"}, "family"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "'longrope' is not supported"),
        ({"rope_scaling": {**YARN_SCALING, "factor": 0.5}}, "factor' >= 1"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "needs original_max_position_embeddings"),
        ({"rope_scaling": {**YARN_SCALING, "original_max_position_embeddings": 64.0}}, "positive int"),
        ({"rope_scaling": {**YARN_SCALING, "beta_fast": 1.0, "beta_slow": 2.0}}, "beta_fast >= beta_slow"),
        ({"rope_scaling": {**YARN_SCALING, "attention_factor": -1.0}}, "attention_factor must be"),
        ({"rope_scaling": {**YARN_SCALING, "truncate": "yes"}}, "truncate must be true or false"),
        ({"rope_scaling": {**YARN_SCALING, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing"),
        ({"hidden_size": 0}, "positive"),
        ({"eos_token_ids": [1000]}, "outside the vocabulary"),
    ],
)
def test_config_validation(changes, match):
    base = dict(
        family="llama",
        vocab_size=100,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**base, **changes})


def test_config_from_hf_dict_variants():
    d = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        "eos_token_id": [5, 6],
    }
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16 and cfg.eos_token_ids == [5, 6]
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096
    v5 = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **d["rope_scaling"]}
    assert ModelConfig.from_hf_dict(v5) == cfg
    with pytest.raises(ConfigError, match=r"supported model types: \['llama', 'qwen3', 'qwen3_moe'\]"):
        ModelConfig.from_hf_dict({**d, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig.from_hf_dict({**d, "attention_bias": True})
    with pytest.raises(ConfigError, match="'dynamic' is not supported"):
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
