"""How much of the true attention each block score's top-K holds (CPU or GPU, any size).

    python3 experiments/exp_block_score.py [--model smollm2] [--context 2048] [--texts 4] [--queries 16]
        [--scores int2/blk,hc/mse,...] [--sinks 1,2,4]

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
* ``best``   -- the K blocks of most attention (the ceiling of any score);
* ``int2``   -- today's ``KvConfig(block_score="codes")``: 2-bit codes inside each channel's block
  [min, max], the block's largest approximate logit (with exact weights ``q (max - min) / 3``; the
  engine rounds them to f16, which moves a score by under 1e-3 of its magnitude);
* ``int2/b8`` -- the same codes inside the block's 8-bit Quest bound (``bounds8``: the [min, max]
  rounded outward onto E4M3 after one power-of-two scale per (block, KV head)) instead of its
  16-bit summary: what a rescoring that reads the bound, not the summaries, would rank by (the
  bf16 summaries could then leave the GPU);
* ``int2/w8``, ``int2/w4`` -- the same with the per-block weights ``q (max - min) / 3`` rounded to
  8-bit (4-bit) signed integers with one scale per (block, query head): what an integer
  tensor-core product of codes and weights would compute;
* scalar-scale candidates (one step ``s`` per (block, head), so a tensor-core kernel's B could be
  the query itself; docs/EVAL.md "Scalar-scale candidates"): ``int2/blk`` (min + the largest range
  / 3), ``s/pP`` (min + the P-th percentile range / 3, codes clamped), ``s/mse`` / ``sc/mse`` (min
  or box centre + the step of least squared key error among ``MSE_FRACTIONS``), ``sg/mse`` (times
  a context-wide per-channel factor), ``hs/*`` and ``hc/*`` (after a Walsh-Hadamard rotation: above
  the rotated block min, or around the unrotated box centre).

``--scores a,b`` computes only those (plus quest, int2 and best); the paired difference of every
score to ``int2`` per text (mean +- standard error over texts) follows the table.

``--staged 1.5,2,3`` adds ``int2@qF``: two stages, the Quest bound's top-(F x K) blocks rescored with
the 2-bit codes, their top-K taken. Since a block's codes score never exceeds its Quest bound
(every approximate key lies inside the block's box), the staged set is certainly the full codes
top-K whenever the K-th codes score among the candidates is at least the best bound left out;
the share of (query, head) rows so certified and the share whose set equals the full codes top-K
are printed beside.

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
    "int2/b8",
    "int3",
    "int2/w8",
    "int2/w4",
    "int2/blk",
    "int2/med",
    "s/p50",
    "s/p75",
    "s/p90",
    "s/mse",
    "sc/mse",
    "sg/mse",
    "hs/max",
    "hs/mse",
    "hc/max",
    "hc/mse",
    "max",
    "best",
)


MSE_FRACTIONS = (1.0, 0.85, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)  # arbitrary grid of step / largest range


def hadamard(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal n x n Walsh-Hadamard matrix (n a power of two)."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


#: Every finite E4M3 value, ascending (the grid ``bound8`` rounds onto).
E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_GRID = E4M3_GRID[torch.isfinite(E4M3_GRID)].unique()


def bound8(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lo``/``hi`` [hk, nc, d] rounded outward onto E4M3 after one power-of-two scale per (head,
    block), the smallest with max |x| / s <= 448: the values the engine's 8-bit bound
    (``oasis_core::kernels::bound8``) decodes to, as float32."""
    grid = E4M3_GRID.to(lo.device)
    m = torch.maximum(lo.abs().amax(-1), hi.abs().amax(-1)).clamp(min=2.0**-120)
    s = torch.exp2(torch.ceil(torch.log2(m / 448.0)))
    s = torch.where(m / s > 448, s * 2, s).unsqueeze(-1)
    down = grid[(torch.searchsorted(grid, (lo / s).contiguous(), right=True) - 1).clamp(min=0)]
    up = grid[torch.searchsorted(grid, (hi / s).contiguous()).clamp(max=grid.numel() - 1)]
    return down * s, up * s


def block_scores(
    q: torch.Tensor, k: torch.Tensor, b: int, nc: int, group: int, wanted: list[str]
) -> dict[str, torch.Tensor]:
    """q [hq, d] (one position), k [hk, nc * b, d] (its complete blocks): scores [hk, nc] each
    for the names in `wanted` (only those are computed)."""
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

    def codes(bits: int, lo=lo, hi=hi) -> torch.Tensor:
        # Keys quantised to `bits` per channel inside the block's own [min, max] (the summary is
        # the scale), or the range given: the largest approximate logit of the block.
        levels = 2**bits - 1
        width = (hi - lo).clamp(min=1e-12).unsqueeze(2)
        code = ((kb - lo.unsqueeze(2)) / width * levels).round().clamp(0, levels)
        approx = lo.unsqueeze(2) + code * width / levels
        return torch.einsum("hgd,hntd->hgnt", qg, approx).amax(-1).sum(1)

    def codes_w8(levels_w: int) -> torch.Tensor:
        # The per-block weights w_gd = q_gd (max_d - min_d) / 3 of the 2-bit codes rounded to
        # signed integers of `levels_w` levels each side, one scale per (block, query head): the
        # score of an integer tensor-core product (codes x int8 weights, exact integer sums).
        width = (hi - lo).clamp(min=1e-12)  # [hk, nc, d]
        code = ((kb - lo.unsqueeze(2)) / width.unsqueeze(2) * 3).round()  # [hk, nc, b, d]
        w = qg.unsqueeze(2) * width.unsqueeze(1) / 3  # [hk, g, nc, d]
        scale = w.abs().amax(-1, keepdim=True).clamp(min=1e-30) / levels_w
        wq = (w / scale).round() * scale
        base = torch.einsum("hgd,hnd->hgn", qg, lo)
        return (base.unsqueeze(-1) + torch.einsum("hgnd,hntd->hgnt", wq, code)).amax(-1).sum(1)

    def codes_step(step: torch.Tensor) -> torch.Tensor:
        # 2-bit codes above each block's per-channel min with a step that does not vary per channel
        # within the block (`step` [hk, nc or 1, d]): the score's per-block weights then factor out
        # of the query (the tensor-core kernel's B would be the query itself).
        step = step.clamp(min=1e-12).unsqueeze(2)
        code = ((kb - lo.unsqueeze(2)) / step * 3).round().clamp(0, 3)
        approx = lo.unsqueeze(2) + code * step / 3
        return torch.einsum("hgd,hntd->hgnt", qg, approx).amax(-1).sum(1)

    rng = hi - lo  # [hk, nc, d]
    fracs = torch.tensor(MSE_FRACTIONS, dtype=kb.dtype, device=kb.device)

    def scalar_mse(x: torch.Tensor, off: torch.Tensor, scale: torch.Tensor, centred: bool) -> torch.Tensor:
        # One step per (block, head) s = f * (largest channel range) / 3, the fraction f in
        # MSE_FRACTIONS minimising the block's squared key error (codes clamped to 0..3), over
        # each channel's offset `off` [hk, nc, d] (the block min, or the centre with codes
        # -1.5..1.5) and a per-(head, channel) context-wide factor `scale` [hk, 1, d] (ones: none):
        # k^ = off + s * scale * code. The score's B operand is then q * scale, constant per
        # sequence (the per-block part is the scalar s and the offset's dot product).
        y = (x - off.unsqueeze(2)) / scale.unsqueeze(2)  # [hk, nc, b, d]
        top = (rng / scale).amax(-1)  # [hk, nc]
        step = (fracs.view(-1, 1, 1) * top / 3).clamp(min=1e-12)  # [F, hk, nc]
        st = step[..., None, None]
        shift = 1.5 if centred else 0.0
        code = (y.unsqueeze(0) / st + shift).round().clamp(0, 3)
        err = ((code - shift) * st - y.unsqueeze(0)).square().mul(scale.square().unsqueeze(2)).sum((-1, -2))
        best = err.argmin(0)  # [hk, nc]
        s = step.gather(0, best.unsqueeze(0)).squeeze(0)[..., None, None]
        c = (y / s + shift).round().clamp(0, 3)
        approx = off.unsqueeze(2) + (c - shift) * s * scale.unsqueeze(2)
        return torch.einsum("hgd,hntd->hgnt", qg, approx).amax(-1).sum(1)

    ones = torch.ones_like(rng[:, :1])
    # Walsh-Hadamard rotation (orthonormal; q.k = (Hq).(Hk)): spreads the outlier channels so that
    # one scale per block fits every rotated channel; offsets are the rotated keys' block min.
    had = hadamard(d, kb.dtype, kb.device)
    kh = kb @ had
    qh = qg @ had
    lo_h = kh.amin(2)

    def rotated(search: bool) -> torch.Tensor:
        y = kh - lo_h.unsqueeze(2)
        top = (kh.amax(2) - lo_h).amax(-1)
        fr = fracs if search else fracs[:1]
        step = (fr.view(-1, 1, 1) * top / 3).clamp(min=1e-12)[..., None, None]
        code = (y.unsqueeze(0) / step).round().clamp(0, 3)
        err = (code * step - y.unsqueeze(0)).square().sum((-1, -2))
        best = err.argmin(0)
        s = step.squeeze(-1).squeeze(-1).gather(0, best.unsqueeze(0)).squeeze(0)[..., None, None]
        approx = lo_h.unsqueeze(2) + (y / s).round().clamp(0, 3) * s
        return torch.einsum("hgd,hntd->hgnt", qh, approx).amax(-1).sum(1)

    def rotated_centre(search: bool) -> torch.Tensor:
        # Offset: the block's per-channel box centre from the min/max summary (q . centre needs no
        # rotation); the rotated residual H(k - centre) in 2-bit codes -1.5..1.5 times one step per
        # (block, head): its largest |value| / 1.5, or the MSE_FRACTIONS one of least squared error.
        y = (kb - center.unsqueeze(2)) @ had  # [hk, nc, b, d]
        top = y.abs().amax((-1, -2)) / 1.5  # [hk, nc]: no code clamps
        fr = fracs if search else fracs[:1]
        step = (fr.view(-1, 1, 1) * top).clamp(min=1e-12)[..., None, None]
        code = (y.unsqueeze(0) / step + 1.5).floor().clamp(0, 3)
        err = ((code - 1.5) * step - y.unsqueeze(0)).square().sum((-1, -2))
        best = err.argmin(0)
        s = step.squeeze(-1).squeeze(-1).gather(0, best.unsqueeze(0)).squeeze(0)[..., None, None]
        c = (y / s + 1.5).floor().clamp(0, 3)
        dot = torch.einsum("hgd,hntd->hgnt", qh, (c - 1.5) * s)
        return (dot + torch.einsum("hgd,hnd->hgn", qg, center).unsqueeze(-1)).amax(-1).sum(1)

    def pct(p: float) -> torch.Tensor:
        return rng.quantile(p, dim=-1, keepdim=True).expand_as(rng)

    fns = {
        # min + one step per block, the P-th percentile of its channel ranges (codes clamped)
        "s/p50": lambda: codes_step(pct(0.5)),
        "s/p75": lambda: codes_step(pct(0.75)),
        "s/p90": lambda: codes_step(pct(0.9)),
        "s/mse": lambda: scalar_mse(kb, lo, ones, centred=False),
        "sc/mse": lambda: scalar_mse(kb, center, ones, centred=True),
        # x a per-(head, channel) factor for the whole context: the median block range
        "sg/mse": lambda: scalar_mse(kb, lo, rng.median(dim=1, keepdim=True).values.clamp(min=1e-6), False),
        "hs/max": lambda: rotated(False),
        "hs/mse": lambda: rotated(True),
        "hc/max": lambda: rotated_centre(False),
        "hc/mse": lambda: rotated_centre(True),
        # one step per block: its largest channel range
        "int2/blk": lambda: codes_step(rng.amax(-1, keepdim=True).expand_as(rng)),
        # one step per (head, channel) for the whole context: the median block range
        "int2/med": lambda: codes_step(rng.median(dim=1, keepdim=True).values.expand_as(rng)),
        "c+.5r": lambda: around(center, 0.5),
        "c+.75r": lambda: around(center, 0.75),
        "m+.5r": lambda: around(kb.mean(2), 0.5),
        "m+.75r": lambda: around(kb.mean(2), 0.75),
        "m+r": lambda: around(kb.mean(2), 1.0),
        "int2": lambda: codes(2),
        "int2/b8": lambda: codes(2, *bound8(lo, hi)),
        "int2/w8": lambda: codes_w8(127),
        "int2/w4": lambda: codes_w8(7),
        "int3": lambda: codes(3),
        "quest": lambda: quest(1),
        "quest/2": lambda: quest(2),
        "quest/4": lambda: quest(4),
        "mean": lambda: mean,
        "max": lambda: logits.amax(-1).sum(1),
    }
    return {name: fns[name]() for name in wanted}


def queries_and_keys(model, tokens, dev) -> tuple[list, list]:
    """One dense forward of ``tokens``: every layer's post-RoPE queries ``[T, hq, d]`` and keys
    ``[T, hk, d]`` (float32)."""
    qs, ks = [], []
    scale = model.config.head_dim**-0.5

    def attn(layer, q, k, v):
        qs.append(q.float())
        ks.append(k.float())
        return causal_attention(q, k, v, scale)

    ids = torch.tensor(tokens, dtype=torch.long, device=dev)
    with torch.no_grad():
        model.forward(
            ids, torch.arange(len(ids), device=dev), attn, logits_rows=torch.tensor([0], device=dev)
        )
    return qs, ks


def block_mass(
    q: torch.Tensor, k: torch.Tensor, b: int, group: int
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The exact softmax attention of query ``q`` ``[hq, d]`` (position t) over keys ``k``
    ``[hk, t + 1, d]``, summed per block of ``b`` and averaged over each KV head's query heads:
    ``(mass [hk, blocks], nc, local)`` where ``nc`` counts the complete blocks before t's own and
    ``local`` ``[hk]`` is the share of t's own block (always resident)."""
    hk, n, d = k.shape
    t = n - 1
    w = torch.softmax(
        (q.view(hk, group, 1, -1) @ k.unsqueeze(1).transpose(-1, -2)).squeeze(2).double() * d**-0.5,
        dim=-1,
    )  # [hk, group, t+1]
    nc = t // b  # the blocks before t's own (the local block, always resident)
    nb = math.ceil((t + 1) / b)
    w = torch.nn.functional.pad(w, (0, nb * b - (t + 1)))
    mass = w.view(hk, group, nb, b).sum(-1).mean(1)  # [hk, nb]
    return mass, nc, mass[:, nc:].sum(-1)


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
    ap.add_argument("--scores", default="", help="comma-separated subset of the scores (default: all)")
    ap.add_argument("--staged", default="", help="factors F: also int2@qF (Quest top-F*K, then codes)")
    args = ap.parse_args()
    staged = [float(x) for x in args.staged.split(",") if x.strip()]
    sinks = [int(x) for x in args.sinks.split(",") if x.strip()]
    base_names = [x for x in args.scores.split(",") if x] or list(SCORES)
    for x in ("quest", "int2", "best"):  # sinks and the paired differences need these
        if x not in base_names:
            base_names.append(x)
    names = base_names + [f"{base}+s{n}" for n in sinks for base in ("quest", "int2")]
    names += [f"int2@q{f:g}" for f in staged]
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
    # Per budget and factor: rows certified to hold the full codes top-K, rows whose set equals it.
    certified = {lab: {f: [0, 0, 0] for f in staged} for lab in budgets}
    sink_mass: dict[int, list[float]] = {n: [] for n in sinks}  # attention on blocks 0..N-1 alone
    for text in texts:
        qs, ks = queries_and_keys(model, text["tokens"], dev)
        for layer in range(cfg.num_hidden_layers):
            for t in positions:
                q, k = qs[layer][t], ks[layer][: t + 1].transpose(0, 1)  # [hq, d], [hk, t+1, d]
                mass, nc, local = block_mass(q, k, b, group)
                scores = block_scores(q, k[:, : nc * b], b, nc, group, [x for x in base_names if x != "best"])
                scores["best"] = mass[:, :nc]
                for n in sinks:
                    sink_mass[n].append(float(mass[:, : min(n, nc)].sum(-1).mean()))
                    for base in ("quest", "int2"):
                        forced = scores[base].clone()
                        forced[:, :n] = math.inf  # the sinks, whatever their score
                        scores[f"{base}+s{n}"] = forced
                for lab, kk in budgets.items():
                    kk = min(kk, nc)
                    if staged:
                        full = scores["int2"].topk(kk, dim=-1).indices.sort(-1).values
                        order = scores["quest"].sort(-1, descending=True)
                    for f in staged:
                        kc = min(nc, math.ceil(f * kk))
                        cand = order.indices[:, :kc]
                        sub = scores["int2"].gather(1, cand).topk(kk, dim=-1)
                        pick = cand.gather(1, sub.indices)
                        sc = torch.full_like(scores["int2"], -math.inf)
                        sc.scatter_(1, pick, sub.values)
                        scores[f"int2@q{f:g}"] = sc
                        left = order.values[:, kc] if kc < nc else torch.full((hk,), -math.inf)
                        c = certified[lab][f]
                        c[0] += int((sub.values[:, -1] >= left).sum())
                        c[1] += int((pick.sort(-1).values == full).all(-1).sum())
                        c[2] += hk
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
    # Noise: each score minus int2 (the per-channel codes), per text, as mean +- standard error
    # over texts (the queries and layers of one text are not independent).
    per_text = cfg.num_hidden_layers * len(positions)
    out["vs_int2"] = {}
    print(f"paired difference to int2 over {len(texts)} texts (mean +- s.e., points):")
    for lab, d in held.items():
        row = {}
        for s in names:
            diffs = [
                100 * (sum(d[s][i : i + per_text]) - sum(d["int2"][i : i + per_text])) / per_text
                for i in range(0, len(d[s]), per_text)
            ]
            m = sum(diffs) / len(diffs)
            se = (sum((x - m) ** 2 for x in diffs) / max(1, len(diffs) - 1) / len(diffs)) ** 0.5
            row[s] = (m, se)
        out["vs_int2"][lab] = row
        print(f"{lab:6s}  {budgets[lab]:<4d}  " + "  ".join(f"{m:+4.1f}±{se:3.1f}" for m, se in row.values()))
    out["staged"] = {
        lab: {f"{f:g}": {"certified": c[0] / c[2], "equal": c[1] / c[2]} for f, c in d.items()}
        for lab, d in certified.items()
    }
    for lab, d in out["staged"].items():
        for f, c in d.items():
            print(
                f"{lab:6s}  int2@q{f}: rows certified to hold the full codes top-K {c['certified']:.3f}, "
                f"equal to it {c['equal']:.3f}"
            )
    for n, m in out["sink_mass"].items():
        print(f"attention on blocks 0..{n - 1} alone: {m:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
