"""Qwen3-MoE's mixture of experts (issue 14): the layer against an independent float64 reference
that walks the tokens one by one, the whole model against transformers' Qwen3MoeForCausalLM
through a saved checkpoint, the config (keys, validation, presets' published sizes) and the
tensor-parallel shard rules of the experts. TP=2 tokens against one process: test_parallel."""

from __future__ import annotations

import json
import math

import pytest
import torch

from oasiskv.errors import ConfigError
from oasiskv.models.config import PRESETS, ModelConfig, estimate_model_bytes, preset_config
from oasiskv.models.loader import load_hf_dir
from oasiskv.models.moe import SparseMoE
from oasiskv.models.tp import TPCausalLM, is_replicated, shard_hf_tensor, tp_config
from oasiskv.models.transformer import CausalLM, dense_causal_attn
from oasiskv.parallel import TPGroup

torch.set_num_threads(2)

#: Odd sizes: (hidden, experts, top-k, expert width, tokens).
SHAPES = [(54, 7, 3, 20, 37), (32, 8, 2, 16, 1), (40, 5, 5, 12, 9)]
#: vLLM's table; float64 against the float64 reference is exact up to summation order.
TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1.3e-6)}

#: A small Qwen3-MoE: layers 0 and 2 sparse (decoder_sparse_step=1), layer 1 dense (mlp_only_layers).
MOE_CFG = ModelConfig(
    family="qwen3",
    vocab_size=257,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
)


# ------------------------------------------------------------------------------- the reference
def ref_moe(x, router, gate, up, down, top_k: int, norm_topk_prob: bool):
    """Token by token in float64, from the definition: p = softmax(router @ x); the k largest
    p_e (found by sorting); w_e = p_e, or p_e / sum of the k when ``norm_topk_prob``;
    out = sum_e w_e * down_e @ (silu(gate_e @ x) * (up_e @ x)). Also returns the smallest gap
    between the k-th and the (k+1)-th probability over the rows (how far from a tie)."""
    x, router = x.double(), router.double()
    gate, up, down = gate.double(), up.double(), down.double()
    out = torch.zeros_like(x)
    gap = math.inf
    for i in range(x.shape[0]):
        logits = [float(router[e] @ x[i]) for e in range(router.shape[0])]
        m = max(logits)
        exps = [math.exp(v - m) for v in logits]
        probs = [v / sum(exps) for v in exps]
        ranked = sorted(range(len(probs)), key=lambda e: -probs[e])
        chosen = ranked[:top_k]
        if top_k < len(probs):
            gap = min(gap, probs[ranked[top_k - 1]] - probs[ranked[top_k]])
        total = sum(probs[e] for e in chosen) if norm_topk_prob else 1.0
        for e in chosen:
            g = gate[e] @ x[i]
            hidden = g / (1 + torch.exp(-g)) * (up[e] @ x[i])
            out[i] += probs[e] / total * (down[e] @ hidden)
    return out, gap


def _layer(h, e, k, inter, norm, dtype, seed=0):
    moe = SparseMoE(h, e, inter, k, norm, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        moe.gate.copy_(torch.randn(e, h, generator=gen))  # std 1: routing far from uniform
        moe.experts_gate_up.copy_(0.3 * torch.randn(e, 2 * inter, h, generator=gen))
        moe.experts_down.copy_(0.3 * torch.randn(e, h, inter, generator=gen))
    return moe


def _weights(moe):
    i = moe.intermediate_size
    gu = moe.experts_gate_up.detach()
    return moe.gate.detach(), gu[:, :i], gu[:, i:], moe.experts_down.detach()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "no-renorm"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layer_matches_the_float64_reference(shape, norm, dtype):
    h, e, k, inter, n = shape
    moe = _layer(h, e, k, inter, norm, dtype)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.5
    want, gap = ref_moe(x, *_weights(moe), k, norm)
    assert gap > 1e-6  # tie-free routing, so float32 picks the same experts
    with torch.no_grad():
        got = moe(x.to(dtype))
    assert got.dtype == dtype and got.shape == (n, h)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    assert want.abs().max() > 0.1  # the experts contribute


def test_only_the_chosen_experts_run():
    """Experts no row chose hold NaN weights: the output stays finite and equal to the reference
    (a dense all-experts product times zero weights would be NaN)."""
    h, e, k, inter = 32, 8, 2, 16
    moe = _layer(h, e, k, inter, True, torch.float64)
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    chosen = torch.topk(x @ moe.gate.detach().T, k).indices.unique().tolist()
    unused = [i for i in range(e) if i not in chosen]
    assert unused
    with torch.no_grad():
        want, _ = ref_moe(x, *_weights(moe), k, True)
        moe.experts_gate_up[unused] = float("nan")
        moe.experts_down[unused] = float("nan")
        got = moe(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_no_rows_give_zeros():
    moe = _layer(16, 4, 2, 8, False, torch.float32)
    with torch.no_grad():
        assert moe(torch.zeros(0, 16)).shape == (0, 16)


# ------------------------------------------------------------------------------- the model
def test_model_layers_follow_the_sparse_step_and_mlp_only_layers():
    cfg = MOE_CFG.replace(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    model = CausalLM(cfg, device="meta")
    assert [layer.moe is not None for layer in model.layers] == [False, True, False, False, False, True]
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    names = model.hf_tensor_slots()
    assert (
        "model.layers.1.mlp.experts.5.down_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    )
    assert "model.layers.0.mlp.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert names["model.layers.1.mlp.experts.2.up_proj.weight"].shape == (24, 64)
    assert names["model.layers.1.mlp.gate.weight"].shape == (6, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_estimate_model_bytes_counts_every_expert(dtype):
    model = CausalLM(MOE_CFG, dtype=dtype, device="meta")
    assert estimate_model_bytes(MOE_CFG, dtype) == sum(
        p.numel() * p.element_size() for p in model.parameters()
    )


def test_presets_carry_the_published_sizes():
    """Qwen3-235B-A22B: 94 layers of 128 experts, 235e9 parameters, 22e9 active; Qwen3-30B-A3B:
    30.5e9 and 3.3e9; Qwen3-32B: 32.8e9, dense."""
    big = preset_config("qwen3-235b-a22b")
    assert (big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads) == (94, 64, 4)
    assert (big.num_experts, big.num_experts_per_tok, big.moe_intermediate_size) == (128, 8, 1536)
    assert round(big.num_parameters / 1e9) == 235 and round(big.active_parameters / 1e9) == 22
    a3b = preset_config("qwen3-30b-a3b")
    assert round(a3b.num_parameters / 1e9, 1) == 30.5 and round(a3b.active_parameters / 1e9, 1) == 3.4
    dense = preset_config("qwen3-32b")
    assert round(dense.num_parameters / 1e9, 1) == 32.8 and not dense.is_moe
    assert dense.active_parameters == dense.num_parameters
    assert preset_config("tiny-moe").is_moe and "tiny-moe" in PRESETS
    # tp divides the 235B's heads and expert width; past its 4 KV heads they are replicated: at
    # the paper's TP8 each rank holds one KV head (of two ranks) and 8 query heads
    assert tp_config(big, 4).moe_intermediate_size == 384
    tp8 = tp_config(big, 8)
    assert (tp8.num_key_value_heads, tp8.num_attention_heads, tp8.moe_intermediate_size) == (1, 8, 192)
    with pytest.raises(ConfigError, match="num_key_value_heads=4"):
        tp_config(big, 6)


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("step", [1, 2], ids=["every-layer", "sparse-step-2"])
def test_matches_transformers_qwen3_moe(step, tmp_path):
    """transformers' Qwen3MoeForCausalLM with random weights, saved with save_pretrained (the
    per-expert checkpoint names) and loaded by load_hf_dir: the same logits; and the config
    round-trips through transformers' Qwen3MoeConfig."""
    cfg = MOE_CFG.replace(decoder_sparse_step=step, mlp_only_layers=() if step == 2 else (1,))
    hf_cfg = transformers.Qwen3MoeConfig(
        **json.loads(json.dumps(cfg.to_hf_dict())), attn_implementation="eager"
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # make the norms and the routing matter
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    ours = load_hf_dir(tmp_path)
    assert ours.config == cfg
    assert ModelConfig.from_hf_dict(hf.config.to_dict()) == cfg  # num_local_experts spelling
    n = 29
    ids = torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(n)
    with torch.no_grad():
        want = hf(ids[None], position_ids=pos[None]).logits[0]
    got, _ = ours(ids, pos, dense_causal_attn())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got.std() > 0.05


# ------------------------------------------------------------------------------- the config
def test_config_keys_and_validation():
    d = MOE_CFG.to_hf_dict()
    assert d["model_type"] == "qwen3_moe" and d["architectures"] == ["Qwen3MoeForCausalLM"]
    assert ModelConfig.from_hf_dict(d) == MOE_CFG
    dense = MOE_CFG.replace(num_experts=0)
    assert dense.to_hf_dict()["model_type"] == "qwen3" and "num_experts" not in dense.to_hf_dict()
    assert not dense.is_moe and CausalLM(dense, device="meta").layers[0].moe is None
    with pytest.raises(ConfigError, match=r"missing keys \['num_experts'\]"):
        ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "num_experts"})
    bad = {
        "num_experts_per_tok=7": dict(num_experts_per_tok=7),
        "num_experts_per_tok must be an int in 1..=6": dict(num_experts_per_tok=0),
        "moe_intermediate_size must be a positive int": dict(moe_intermediate_size=0),
        "num_experts must be an int >= 0": dict(num_experts=-1),
        "num_experts=5000 is larger": dict(num_experts=5000),
        "decoder_sparse_step must be an int >= 1": dict(decoder_sparse_step=0),
        r"mlp_only_layers \[3\] are outside": dict(mlp_only_layers=(3,)),
    }
    for match, change in bad.items():
        with pytest.raises(ConfigError, match=match.replace("=7", "")):
            MOE_CFG.replace(**change)
    with pytest.raises(ConfigError, match="qwen3 family"):
        MOE_CFG.replace(family="llama")


# ------------------------------------------------------------------------------- tensor parallel
def test_expert_shards_put_back_together_are_the_full_tensors():
    """Tensor-parallel experts: each expert's gate/up by rows, down by columns, the router
    replicated; the shards of TPCausalLM.random are those of CausalLM.random's model."""
    full = CausalLM.random(MOE_CFG, seed=5)
    for name, t in full.hf_tensor_slots().items():
        if ".experts." not in name and not name.endswith("mlp.gate.weight"):
            continue
        parts = [shard_hf_tensor(name, t, 2, r) for r in range(2)]
        if name.endswith("mlp.gate.weight"):
            assert is_replicated(name) and all(p is t for p in parts)
        elif name.endswith("down_proj.weight"):
            assert parts[0].shape == (64, 12) and torch.equal(torch.cat(parts, dim=1), t)
        else:
            assert parts[0].shape == (12, 64) and torch.equal(torch.cat(parts), t)
    local = tp_config(MOE_CFG, 2)
    assert (local.moe_intermediate_size, local.num_experts, local.intermediate_size) == (12, 6, 48)
    for r in range(2):
        group = TPGroup(r, 2, torch.device("cpu"))
        want = TPCausalLM.from_full(full, group=group).state_dict()
        got = TPCausalLM.random(MOE_CFG, seed=5, group=group).state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        assert got["layers.0.moe.experts_gate_up"].shape == (6, 24, 64)


def test_tp_config_of_an_all_moe_model_ignores_the_dense_width():
    cfg = MOE_CFG.replace(mlp_only_layers=(), intermediate_size=100)  # 100 % 8 != 0, unused
    assert tp_config(cfg.replace(num_attention_heads=8, num_key_value_heads=8), 8).intermediate_size == 100
    with pytest.raises(ConfigError, match="moe_intermediate_size=24 not divisible by tp=16"):
        tp_config(cfg.replace(num_attention_heads=16, num_key_value_heads=16), 16)
    with pytest.raises(ConfigError, match="intermediate_size=99 not divisible by tp=2"):
        tp_config(MOE_CFG.replace(intermediate_size=99), 2)  # layer 1 is dense


def test_random_shards_agree_on_the_replicated_tensors():
    """The benchmark's per-rank init: norms and routers equal on every rank, shards differ."""
    a, b = (
        TPCausalLM.random_shards(MOE_CFG, seed=1, group=TPGroup(r, 2, torch.device("cpu"))) for r in (0, 1)
    )
    sa, sb = a.state_dict(), b.state_dict()
    assert (
        torch.equal(sa["layers.0.moe.gate"], sb["layers.0.moe.gate"]) and sa["layers.0.moe.gate"].std() > 0.01
    )
    assert torch.equal(sa["norm.weight"], sb["norm.weight"])
    assert not torch.equal(sa["layers.0.moe.experts_down"], sb["layers.0.moe.experts_down"])
