"""Would some layers use more of the budget than others? (issue 12: "more budget for the layers
that need it"). CPU or GPU, any size:

    python3 experiments/exp_layer_budget.py [--context 2048] [--texts 4] [--queries 16] [--score int2]

The same dense forwards and attention shares as ``experiments/exp_block_score.py``: for every layer
and a ladder of per-layer budgets K (blocks per KV head), the share of the true attention that
the score's top-K holds (local block included), averaged over heads, query positions and texts.
Then, for each total budget ``layers x K`` of the usual fractions, a per-layer allocation with
the same total, chosen greedily from the mean curves (each step gives the next rung of the ladder
to the layer whose share rises most per block), against the uniform K. The allocation is fitted on
the first half of the texts and scored on the other half (held out), so the gain is not
in-sample.
"""

from __future__ import annotations

import argparse
from fractions import Fraction

import torch
from exp_block_score import block_mass, block_scores, queries_and_keys  # experiments/ is on sys.path

from oasiskv.eval import corpus
from oasiskv.models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budgets", default="1/16,1/8,1/4")
    ap.add_argument("--score", default="int2", help="a score of exp_block_score.py (quest, int2, ...)")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=torch.float32, device="cpu")
    cfg = model.config
    b, hq, hk = args.block_size, cfg.num_attention_heads, cfg.num_key_value_heads
    group, L = hq // hk, cfg.num_hidden_layers
    nblk = args.context // b
    uniform = {lab: max(1, round(args.context * Fraction(lab) / b)) for lab in args.budgets.split(",")}
    ladder = sorted(
        {max(1, round(u * f)) for u in uniform.values() for f in (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4)}
    )
    ladder = [k for k in ladder if k < nblk // 2]
    texts = corpus.heldout_texts(tok, args.context, args.texts, source="stdlib")
    span = args.context // 4
    positions = [args.context - 1 - (i * span) // args.queries for i in range(args.queries)]
    # held[t][layer][k]: mean share over heads and positions of text t
    held = [[[0.0] * len(ladder) for _ in range(L)] for _ in texts]
    for ti, text in enumerate(texts):
        qs, ks = queries_and_keys(model, text["tokens"], "cpu")
        for layer in range(L):
            for t in positions:
                q, k = qs[layer][t], ks[layer][: t + 1].transpose(0, 1)
                mass, nc, local = block_mass(q, k, b, group)
                score = block_scores(q, k[:, : nc * b], b, nc, group, [args.score])[args.score]
                order = score.argsort(dim=-1, descending=True)
                for i, kk in enumerate(ladder):
                    top = order[:, : min(kk, nc)]
                    held[ti][layer][i] += float((mass[:, :nc].gather(1, top).sum(-1) + local).mean()) / len(
                        positions
                    )
    fit, test = list(range(len(texts) // 2)), list(range(len(texts) // 2, len(texts)))

    def mean_curve(ts):
        return [
            [sum(held[t][layer][i] for t in ts) / len(ts) for i in range(len(ladder))] for layer in range(L)
        ]

    curve_fit, curve_test = mean_curve(fit), mean_curve(test)
    print(
        f"{args.model}, C={args.context}, score {args.score}, ladder {ladder}; fit on {fit}, test on {test}"
    )
    print("per-layer share at the uniform budgets (test texts):")
    for layer in range(L):
        row = "  ".join(f"{curve_test[layer][ladder.index(k)]:.3f}" for k in uniform.values() if k in ladder)
        print(f"  layer {layer:2d}: {row}")
    for lab, k in uniform.items():
        if k not in ladder:
            continue
        total = k * L
        rung = [0] * L  # index into the ladder per layer: start at the smallest rung
        used = ladder[0] * L
        while True:
            best, gain = None, 0.0
            for layer in range(L):
                r = rung[layer]
                if r + 1 < len(ladder) and used - ladder[r] + ladder[r + 1] <= total:
                    g = (curve_fit[layer][r + 1] - curve_fit[layer][r]) / (ladder[r + 1] - ladder[r])
                    if best is None or g > gain:
                        best, gain = layer, g
            if best is None:
                break
            used += ladder[rung[best] + 1] - ladder[rung[best]]
            rung[best] += 1
        alloc = [ladder[r] for r in rung]
        ui = ladder.index(k)
        u_test = sum(curve_test[layer][ui] for layer in range(L)) / L
        a_test = sum(curve_test[layer][rung[layer]] for layer in range(L)) / L
        print(
            f"{lab:5s} K={k:3d}: uniform {u_test:.3f}, per-layer {a_test:.3f} "
            f"({100 * (a_test - u_test):+.1f} points, {sum(alloc)} of {total} blocks); allocation {alloc}"
        )


if __name__ == "__main__":
    main()
