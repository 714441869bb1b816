"""The evaluation harness and the EAGLE-3 trainer on a GPU (tiny random models): the paths the
H200 runs of issue 4 take, checked before they spend device time on SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch

from oasiskv.eval.teacher import Policy, TeacherForcing, summarize
from oasiskv.models.config import ModelConfig
from oasiskv.models.eagle3 import Eagle3Head
from oasiskv.models.transformer import CausalLM
from oasiskv.train import eagle3 as tr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _tiny(dtype=torch.bfloat16):
    cfg = ModelConfig(
        family="llama",
        vocab_size=301,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    )
    return CausalLM.random(cfg, seed=1, dtype=dtype, device="cuda")


def _repetitive(n: int, period: int = 37, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 301, (period,), generator=g).tolist()
    return (base * (n // period + 1))[:n]


def test_teacher_forcing_on_gpu_full_budget_tracks_dense_and_small_budget_measures():
    model = _tiny()
    head = Eagle3Head.random(model.config, 64, seed=2, dtype=torch.bfloat16, device="cuda")
    head.attach_target(model)
    texts = [_repetitive(513, seed=s) for s in range(2)]
    tf = TeacherForcing(model, texts, 24, block_size=16, batch_size=2, eagle3_head=head, progress=False)
    dense = tf.run(Policy("dense"))
    full = summarize(tf.run(Policy("oasis", "eagle3", 32, None)), dense)
    # The whole context fits the budget: the same attention up to bf16 summation order.
    assert abs(full["delta_nll_pct"]) < 1.0 and full["top1_agree"] > 0.95, full
    recs = {d: summarize(tf.run(Policy("oasis", d, 4, 0.25)), dense) for d in ("oracle", "previous-query")}
    o, p = recs["oracle"]["lookahead"], recs["previous-query"]["lookahead"]
    assert o["steps_measured"] == 23 and len(o["overlap_per_layer"]) == model.config.num_hidden_layers
    assert o["overlap"] >= p["overlap"], (o["overlap"], p["overlap"])
    for r in recs.values():
        assert 0.0 <= r["lookahead"]["overlap"] <= 1.0 and math.isfinite(r["nll"]) and r["kl"] >= 0
        assert r["fetched_bytes_per_step"] > 0
    quest = summarize(tf.run(Policy("quest", top_k_blocks=4)), dense)
    assert math.isfinite(quest["nll"]) and quest["kl"] >= 0


def test_trainer_steps_on_gpu_lower_the_loss():
    target = _tiny()
    sel = torch.arange(0, 300, 3)
    head = tr.new_head(target, sel, seed=0, device="cuda")
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    tokens = torch.tensor([_repetitive(256, seed=s) for s in range(4)])
    losses = []
    for _ in range(30):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            feats, z, _ = tr.target_pass(target, tokens, sel)
            outs = tr.ttt_forward(head, feats, tokens, 3)
            loss, _, _ = tr.ttt_loss(outs, z, 0.8)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses
