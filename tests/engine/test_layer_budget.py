"""Per-layer budgets: the attention curves against a float64 reference, the greedy allocation, the
fit, and the evaluation's ``+layers`` drafters."""

from __future__ import annotations

import pytest
import torch

import oasiskv
from oasiskv import KvConfig, errors
from oasiskv.eval.teacher import kv_budget_kwargs, parse_drafter
from oasiskv.layer_budget import allocate, attention_curves, fit_layer_blocks, ladder_for
from oasiskv.models.transformer import CausalLM, causal_attention
from support.configs import QWEN3_3L

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return CausalLM.random(QWEN3_3L, seed=1)


def texts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 301, (length,), generator=g).tolist() for _ in range(n)]


def reference_curves(model, seqs, b, ladder, queries, span=0.25):
    """Independent float64 reference: full causal attention matrices from the captured q and k,
    per position, KV head and query head, then block sums and sorted prefixes."""
    cfg = model.config
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group = hq // hk
    out = torch.zeros(cfg.num_hidden_layers, len(ladder), dtype=torch.float64)
    for tokens in seqs:
        n = len(tokens)
        window = max(1, int(n * span))
        positions = sorted({n - 1 - (i * window) // queries for i in range(queries)})
        caught = []

        def attn(layer, q, k, v, caught=caught):
            caught.append((q.double(), k.double()))
            return causal_attention(q, k, v, d**-0.5)

        with torch.no_grad():
            model.forward(torch.tensor(tokens), torch.arange(n), attn, logits_rows=torch.tensor([n - 1]))
        for layer, (q, k) in enumerate(caught):
            per_rung = [[] for _ in ladder]
            for t in positions:
                nc = t // b
                for h in range(hk):
                    blocks = [0.0] * nc
                    local = 0.0
                    for j in range(group):
                        logits = (k[: t + 1, h] @ q[t, h * group + j]) * d**-0.5
                        w = torch.softmax(logits, dim=0)
                        for i in range(nc):
                            blocks[i] += float(w[i * b : (i + 1) * b].sum()) / group
                        local += float(w[nc * b :].sum()) / group
                    # The best blocks of the head's mean over its query heads.
                    best = sorted(blocks, reverse=True)
                    for r, kk in enumerate(ladder):
                        per_rung[r].append(sum(best[: min(kk, nc)]) + local)
            for r in range(len(ladder)):
                out[layer, r] += sum(per_rung[r]) / len(per_rung[r])
    return out / len(seqs)


def test_attention_curves_match_a_float64_reference(model):
    seqs = texts(2, 97)
    ladder = [1, 2, 3, 5, 50]
    got = attention_curves(model, seqs, 8, ladder, queries=4)
    want = reference_curves(model, seqs, 8, ladder, queries=4)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
    assert bool((got[:, 1:] >= got[:, :-1] - 1e-12).all())  # more blocks never hold less
    torch.testing.assert_close(got[:, -1], torch.ones(3, dtype=torch.float64))  # every block: all of it
    assert float(got[:, 0].min()) < 0.9  # one block of random text does not hold it all


def test_allocate_gives_blocks_where_the_share_rises_most():
    ladder = [1, 2, 4, 8]
    curves = torch.tensor(
        [
            [0.30, 0.50, 0.70, 0.90],  # spread: gains all the way
            [0.95, 0.97, 0.98, 0.99],  # concentrated
            [0.60, 0.75, 0.85, 0.95],
        ],
        dtype=torch.float64,
    )
    alloc = allocate(curves, ladder, total=12)
    assert sum(alloc) <= 12 and all(a in ladder for a in alloc)
    # Per block: layer 0 1->2 (0.20), layer 2 1->2 (0.15), layer 0 2->4 (0.10), layer 0 4->8 (0.05,
    # tied with layer 2's 2->4, which no longer fits), then the one block left to layer 1.
    assert alloc == (8, 2, 2)
    with pytest.raises(errors.ConfigError, match="below 1 per layer"):
        allocate(curves, ladder, total=2)


def test_ladder_holds_the_uniform_budget_and_its_bounds():
    assert ladder_for(8) == [2, 4, 6, 8, 10, 12, 16, 24, 32]
    assert ladder_for(200, max_blocks=512)[-1] == 512
    assert ladder_for(3, max_blocks=5) == [1, 2, 3, 4, 5]


def test_fit_layer_blocks_keeps_the_total_and_runs_in_the_engine(model):
    seqs = texts(2, 120, seed=3)
    alloc = fit_layer_blocks(model, seqs, 4, 8, queries=4)
    assert len(alloc) == 3 and sum(alloc) <= 3 * 4 and max(alloc) <= 120 // 8
    assert all(a in ladder_for(4, 15) for a in alloc)
    kv = KvConfig(block_size=8, top_k_blocks=max(alloc), layer_blocks=alloc, sparse_threshold=40)
    out = oasiskv.LLM(model, kv=kv, backend="oasis", drafter="ngram").generate(texts(1, 90, seed=5), 6)
    assert out[0].metrics.sparse_steps > 0
    with pytest.raises(errors.ConfigError, match="shorter than two blocks"):
        attention_curves(model, [[1, 2, 3]], 8, [1])


def test_layers_drafter_suffix_fits_once_with_the_uniform_total(model):
    spec = parse_drafter("ngram+codes2+succ1+layers")
    assert spec.layers and spec.successor_blocks == 1 and spec.score_candidates == 2
    with pytest.raises(ValueError, match="in that order"):
        parse_drafter("ngram+layers+succ1")
    assert parse_drafter("eagle3+layers+top2").top2
    assert kv_budget_kwargs(parse_drafter("ngram"), 6, 8)["top_k_blocks"] == 6
    with pytest.raises(ValueError, match="calibration"):
        kv_budget_kwargs(spec, 6, 8)
    cal = texts(2, 120, seed=7)
    kw = kv_budget_kwargs(parse_drafter("ngram+layers"), 5, 8, model, cal)
    assert sum(kw["layer_blocks"]) <= 15 and kw["top_k_blocks"] == max(kw["layer_blocks"])
    assert kw["sparse_threshold"] == 5 * 8  # turns sparse where the uniform budget would
    assert kv_budget_kwargs(parse_drafter("ngram+layers"), 5, 8, model, cal) == kw
    KvConfig(**kw)
