"""How much of the true attention each block score's top-K holds (CPU or GPU, any size).

    python3 scripts/exp_block_score.py [--model smollm2] [--context 2048] [--texts 4] [--queries 16]

One dense forward per held-out text records every layer's post-RoPE queries and keys. For the
last ``--queries`` positions t (spread over the last quarter of the text) and every layer, the
query's exact softmax attention over keys 0..t is summed per block and averaged over the query
heads of each KV head. Each block score then picks the top-K complete blocks per KV head (the
local block, t's own, always counts), and the share of the attention they hold is averaged:

* ``quest``  -- the engine's score: sum over the group of sum_d max(q_d min_d, q_d max_d) over the
  block's per-channel key min/max (2 x head_dim summary values per block and head);
* ``quest/P`` -- the same bound over each of P sub-blocks, the block scoring its best one (P times
  the summary bytes; the engine's blocks, finer summaries);
* ``mean``   -- sum over the group of q . mean(k) (head_dim values);
* ``max``    -- sum over the group of the block's largest exact logit (needs every key);
* ``best``   -- the K blocks of most attention (the ceiling of any score).

``--sinks 1,2,4`` adds ``quest+sN`` and ``int2+sN``: the same scores with the first N blocks always
taken (``KvConfig(sink_blocks=N)``: they take N of the K slots).

Budgets are fractions of the context (``--budgets``). This is the question behind "better block
scoring": on SmolLM2 the Quest-score top-K leaves 3-6.5 points of attention that the best K blocks
hold (docs/EVAL.md, attention mass).
"""

from __future__ import annotations

import argparse
import json
import math
from fractions import Fraction

import torch

from oasiskv.eval import corpus
from oasiskv.models.loader import load_model
from oasiskv.models.transformer import causal_attention

SCORES = (
    "quest",
    "quest/2",
    "quest/4",
    "mean",
    "c+.5r",
    "c+.75r",
    "m+.5r",
    "m+.75r",
    "m+r",
    "int2",
    "int3",
    "int2/blk",
    "int2/med",
    "max",
    "best",
)


def block_scores(q: torch.Tensor, k: torch.Tensor, b: int, nc: int, group: int) -> dict[str, torch.Tensor]:
    """q [hq, d] (one position), k [hk, nc * b, d] (its complete blocks): scores [hk, nc] each."""
    hk, _, d = k.shape
    kb = k.view(hk, nc, b, d)
    qg = q.view(hk, group, d)

    def quest(parts: int) -> torch.Tensor:
        # Min/max over each of `parts` sub-blocks; a block scores its best sub-block's bound.
        sub = kb.reshape(hk, nc, parts, b // parts, d)
        lo, hi = sub.amin(3), sub.amax(3)  # [hk, nc, parts, d]
        qx = qg.view(hk, group, 1, 1, d)
        bound = torch.maximum(qx * lo.unsqueeze(1), qx * hi.unsqueeze(1)).sum(-1)  # [hk, group, nc, parts]
        return bound.amax(-1).sum(1)

    mean = torch.einsum("hgd,hnd->hn", qg, kb.mean(2))
    logits = torch.einsum("hgd,hntd->hgnt", qg, kb)
    lo, hi = kb.amin(2), kb.amax(2)  # [hk, nc, d]
    center, radius = (lo + hi) / 2, (hi - lo) / 2
    spread = torch.einsum("hgd,hnd->hn", qg.abs(), radius)  # the box's half-width along |q|

    def around(c: torch.Tensor, beta: float) -> torch.Tensor:
        # q . c + beta * sum_d |q_d| r_d: beta = 1 with c the box centre is the Quest bound itself.
        return torch.einsum("hgd,hnd->hn", qg, c) + beta * spread

    def codes(bits: int) -> torch.Tensor:
        # Keys quantised to `bits` per channel inside the block's own [min, max] (the summary is
        # the scale): the largest approximate logit of the block.
        levels = 2**bits - 1
        width = (hi - lo).clamp(min=1e-12).unsqueeze(2)
        code = ((kb - lo.unsqueeze(2)) / width * levels).round()
        approx = lo.unsqueeze(2) + code * width / levels
        return torch.einsum("hgd,hntd->hgnt", qg, approx).amax(-1).sum(1)

    def codes_step(step: torch.Tensor) -> torch.Tensor:
        # 2-bit codes above each block's per-channel min with a step that does not vary per channel
        # within the block (`step` [hk, nc or 1, d]): the score's per-block weights then factor out
        # of the query (the tensor-core kernel's B would be the query itself).
        step = step.clamp(min=1e-12).unsqueeze(2)
        code = ((kb - lo.unsqueeze(2)) / step * 3).round().clamp(0, 3)
        approx = lo.unsqueeze(2) + code * step / 3
        return torch.einsum("hgd,hntd->hgnt", qg, approx).amax(-1).sum(1)

    rng = hi - lo  # [hk, nc, d]
    return {
        # one step per block: its largest channel range
        "int2/blk": codes_step(rng.amax(-1, keepdim=True).expand_as(rng)),
        # one step per (head, channel) for the whole context: the median block range
        "int2/med": codes_step(rng.median(dim=1, keepdim=True).values.expand_as(rng)),
        "c+.5r": around(center, 0.5),
        "c+.75r": around(center, 0.75),
        "m+.5r": around(kb.mean(2), 0.5),
        "m+.75r": around(kb.mean(2), 0.75),
        "m+r": around(kb.mean(2), 1.0),
        "int2": codes(2),
        "int3": codes(3),
        "quest": quest(1),
        "quest/2": quest(2),
        "quest/4": quest(4),
        "mean": mean,
        "max": logits.amax(-1).sum(1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--queries", type=int, default=16, help="query positions per text")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budgets", default="1/16,1/8,1/4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--sinks", default="", help="sink block counts N: also quest+sN and int2+sN")
    args = ap.parse_args()
    sinks = [int(x) for x in args.sinks.split(",") if x.strip()]
    names = list(SCORES) + [f"{base}+s{n}" for n in sinks for base in ("quest", "int2")]
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    model, tok = load_model(args.model, dtype=torch.float32, device=dev)
    cfg = model.config
    b, hq, hk = args.block_size, cfg.num_attention_heads, cfg.num_key_value_heads
    group = hq // hk
    budgets = {lab: max(1, round(args.context * Fraction(lab) / b)) for lab in args.budgets.split(",")}
    texts = corpus.heldout_texts(tok, args.context, args.texts, source="stdlib")
    span = args.context // 4
    positions = [args.context - 1 - (i * span) // args.queries for i in range(args.queries)]
    held = {lab: {s: [] for s in names} for lab in budgets}
    sink_mass: dict[int, list[float]] = {n: [] for n in sinks}  # attention on blocks 0..N-1 alone
    for text in texts:
        qs, ks = [], []

        def attn(layer, q, k, v, qs=qs, ks=ks):
            qs.append(q.float())
            ks.append(k.float())
            return causal_attention(q, k, v, cfg.head_dim**-0.5)

        ids = torch.tensor(text["tokens"], dtype=torch.long, device=dev)
        with torch.no_grad():
            model.forward(
                ids, torch.arange(len(ids), device=dev), attn, logits_rows=torch.tensor([0], device=dev)
            )
        for layer in range(cfg.num_hidden_layers):
            for t in positions:
                q, k = qs[layer][t], ks[layer][: t + 1].transpose(0, 1)  # [hq, d], [hk, t+1, d]
                w = torch.softmax(
                    (q.view(hk, group, 1, -1) @ k.unsqueeze(1).transpose(-1, -2)).squeeze(2).double()
                    * cfg.head_dim**-0.5,
                    dim=-1,
                )  # [hk, group, t+1]
                nc = t // b  # the blocks before t's own (the local block, always resident)
                nb = math.ceil((t + 1) / b)
                w = torch.nn.functional.pad(w, (0, nb * b - (t + 1)))
                mass = w.view(hk, group, nb, b).sum(-1).mean(1)  # [hk, nb]
                local = mass[:, nc:].sum(-1)  # t's own block
                scores = block_scores(q, k[:, : nc * b], b, nc, group)
                scores["best"] = mass[:, :nc]
                for n in sinks:
                    sink_mass[n].append(float(mass[:, : min(n, nc)].sum(-1).mean()))
                    for base in ("quest", "int2"):
                        forced = scores[base].clone()
                        forced[:, :n] = math.inf  # the sinks, whatever their score
                        scores[f"{base}+s{n}"] = forced
                for lab, kk in budgets.items():
                    kk = min(kk, nc)
                    for s in names:
                        top = scores[s].topk(kk, dim=-1).indices
                        held[lab][s].append(float((mass[:, :nc].gather(1, top).sum(-1) + local).mean()))
    out = {
        "model": args.model,
        "context": args.context,
        "texts": len(texts),
        "queries_per_text": args.queries,
        "layers": cfg.num_hidden_layers,
        "held": {lab: {s: sum(v) / len(v) for s, v in d.items()} for lab, d in held.items()},
        "sink_mass": {n: sum(v) / len(v) for n, v in sink_mass.items()},
        "summary_values_per_block_head": {
            "quest": 2 * cfg.head_dim,
            "quest/2": 4 * cfg.head_dim,
            "quest/4": 8 * cfg.head_dim,
            "mean": cfg.head_dim,
            "c+beta*r, m+beta*r": 2 * cfg.head_dim,
            "int2 / int3": f"2 x head_dim + {2 * args.block_size} / {3 * args.block_size} bits x head_dim",
            "max": "all keys",
        },
    }
    print(
        f"share of the true attention held by each score's top-K ({args.model}, C={args.context}, "
        f"{len(texts)} texts x {args.queries} queries x {cfg.num_hidden_layers} layers):"
    )
    print("budget  K     " + "  ".join(f"{s:>7s}" for s in names))
    for lab, d in out["held"].items():
        print(f"{lab:6s}  {budgets[lab]:<4d}  " + "  ".join(f"{d[s]:7.3f}" for s in names))
    for n, m in out["sink_mass"].items():
        print(f"attention on blocks 0..{n - 1} alone: {m:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
