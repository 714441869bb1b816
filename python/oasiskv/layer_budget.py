"""Per-layer budgets (``KvConfig(layer_blocks=...)``): how many blocks each layer gets out of a
total, fitted on calibration text.

Layers differ in how concentrated their attention is: on SmolLM2 at 2-4K, layer 0 holds only
about a third of its attention in its best 8 blocks, layer 13 almost all of it (docs/EVAL.md). So
the same total number of blocks, ``layers x K``, holds more of the attention when the layers
that spread it get more than ``K`` and the concentrated ones less.

:func:`attention_curves` runs dense forwards over the calibration texts and measures, per layer,
the share of the true attention the best ``k`` blocks of each KV head hold (plus the local block,
always resident) for a ladder of ``k``; :func:`allocate` gives the total out greedily along those
curves (each step the next rung goes to the layer whose share rises most per block);
:func:`fit_layer_blocks` does both. The curves use the exact attention, not a block score: they
measure what each layer needs, whatever score ranks its blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .config import MAX_TOP_K_BLOCKS
from .errors import ConfigError

#: What :func:`attention_curves` measures of a block set (see there).
METRICS = ("mass", "output")

#: The rungs of the budget ladder, as multiples of the uniform budget K.
LADDER = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def ladder_for(k: int, max_blocks: int = MAX_TOP_K_BLOCKS) -> list[int]:
    """The budgets a layer may get for a uniform budget ``k``: :data:`LADDER` times ``k``, rounded,
    at least 1 and at most ``max_blocks`` (``k`` itself always among them)."""
    return sorted({min(max_blocks, max(1, round(f * k))) for f in LADDER} | {min(k, max_blocks)})


@torch.no_grad()
def attention_curves(
    model,
    token_seqs: Sequence[Sequence[int]],
    block_size: int,
    ladder: Sequence[int],
    *,
    queries: int = 16,
    span: float = 0.25,
    metric: str = "mass",
) -> torch.Tensor:
    """``[num_layers, len(ladder)]``: per layer, how well the best ``ladder[i]`` complete blocks of
    each KV head (by the head's attention, averaged over its query heads) stand in for the whole
    context, the local block (the query's own) always kept. ``metric="mass"``: the share of the
    true attention they hold; ``"output"``: one minus the relative error of the attention output
    over them alone (renormalised) against the exact output, which also counts how different the
    values left out are. Averaged over query heads, KV heads, ``queries`` query positions spread
    over the last ``span`` of each text, and the texts. One dense forward per text on the model's
    device; computed in float64."""
    from .models.transformer import causal_attention

    cfg = model.config
    if not token_seqs:
        raise ConfigError("attention_curves needs at least one calibration text")
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group, num_layers = hq // hk, cfg.num_hidden_layers
    if metric not in METRICS:
        raise ConfigError(f"metric must be one of {METRICS}, got {metric!r}")
    dev = next(model.parameters()).device
    total = torch.zeros(num_layers, len(ladder), dtype=torch.float64)
    count = 0
    for tokens in token_seqs:
        n = len(tokens)
        if n < 2 * block_size:
            raise ConfigError(
                f"a calibration text of {n} tokens is shorter than two blocks of {block_size}; "
                "pass longer texts"
            )
        window = max(1, int(n * span))
        positions = sorted({n - 1 - (i * window) // queries for i in range(queries)})
        pos_t = torch.tensor(positions, device=dev)
        held: list[torch.Tensor] = []

        def attn(layer, q, k, v, n=n, positions=positions, pos_t=pos_t, held=held):
            # The sampled queries' exact attention over the whole prefix, in float64.
            qs = q[pos_t].double().view(len(positions), hk, group, d)
            ks = k.double().transpose(0, 1)  # [hk, n, d]
            logits = torch.einsum("phgd,hnd->phgn", qs, ks) * d**-0.5
            causal = torch.arange(n, device=dev)[None, :] <= pos_t[:, None]  # [p, n]
            logits = logits.masked_fill(~causal[:, None, None, :], -math.inf)
            wq = torch.softmax(logits, dim=-1)  # [p, hk, g, n]
            w = wq.mean(2)  # [p, hk, n]: each KV head's query heads
            nb = math.ceil(n / block_size)
            w = torch.nn.functional.pad(w, (0, nb * block_size - n)).view(len(positions), hk, nb, block_size)
            mass = w.sum(-1)  # [p, hk, nb]
            rows = []
            for i, t in enumerate(positions):
                nc = t // block_size  # complete blocks before t's own
                if metric == "mass":
                    local = mass[i, :, nc:].sum(-1)  # [hk]
                    best = mass[i, :, :nc].sort(dim=-1, descending=True).values.cumsum(-1)  # [hk, nc]
                    shares = []
                    for kk in ladder:
                        top = best[:, min(kk, nc) - 1] if nc and kk else torch.zeros_like(local)
                        shares.append((top + local).mean())
                    rows.append(torch.stack(shares))
                    continue
                # Keep-masks over tokens [hk, rungs, n]: each rung's best blocks plus the local ones.
                order = mass[i, :, :nc].argsort(dim=-1, descending=True)  # [hk, nc]
                rank = torch.empty_like(order)
                rank.scatter_(1, order, torch.arange(nc, device=dev).expand(hk, nc))
                rank = torch.cat([rank, torch.full((hk, nb - nc), -1, device=dev, dtype=rank.dtype)], 1)
                ks_t = torch.tensor(list(ladder), device=dev).view(1, -1, 1)
                keep = (rank.unsqueeze(1) < ks_t).repeat_interleave(block_size, dim=2)[..., :n].double()
                vs = v.double().transpose(0, 1)  # [hk, n, d]
                wi = wq[i]  # [hk, g, n]
                full = torch.einsum("hgn,hnd->hgd", wi, vs)
                kept = torch.einsum("hgn,hrn->hrgn", wi, keep)
                part = torch.einsum("hrgn,hnd->hrgd", kept, vs) / kept.sum(-1, keepdim=True)
                err = (part - full.unsqueeze(1)).norm(dim=-1) / full.norm(dim=-1).unsqueeze(1)  # [hk, r, g]
                rows.append(1 - err.mean(dim=(0, 2)))
            held.append(torch.stack(rows).mean(0).cpu())
            return causal_attention(q, k, v, d**-0.5)

        ids = torch.tensor(list(tokens), dtype=torch.long, device=dev)
        model.forward(ids, torch.arange(n, device=dev), attn, logits_rows=torch.tensor([n - 1], device=dev))
        total += torch.stack(held)
        count += 1
    return total / count


def allocate(curves: torch.Tensor, ladder: Sequence[int], total: int) -> tuple[int, ...]:
    """Per-layer budgets from the ladder whose sum is at most ``total`` blocks: every layer starts
    at the ladder's first rung, then the next rung goes, one step at a time, to the layer whose
    share rises most per block (``curves`` as :func:`attention_curves` returns), while the total
    allows."""
    num_layers = curves.shape[0]
    if total < ladder[0] * num_layers:
        raise ConfigError(
            f"a total of {total} blocks is below {ladder[0]} per layer x {num_layers} layers; "
            "raise the budget"
        )
    rung = [0] * num_layers
    used = ladder[0] * num_layers
    while True:
        best, gain = None, -math.inf
        for layer in range(num_layers):
            r = rung[layer]
            if r + 1 < len(ladder) and used + ladder[r + 1] - ladder[r] <= total:
                g = float(curves[layer, r + 1] - curves[layer, r]) / (ladder[r + 1] - ladder[r])
                if g > gain:
                    best, gain = layer, g
        if best is None:
            return tuple(ladder[r] for r in rung)
        used += ladder[rung[best] + 1] - ladder[rung[best]]
        rung[best] += 1


def fit_layer_blocks(
    model,
    token_seqs: Sequence[Sequence[int]],
    top_k_blocks: int,
    block_size: int,
    *,
    queries: int = 16,
    max_blocks: int = MAX_TOP_K_BLOCKS,
    metric: str = "mass",
) -> tuple[int, ...]:
    """Per-layer budgets with the same total as ``top_k_blocks`` in every layer (at most), fitted
    on ``token_seqs`` (calibration texts, each a list of token ids, about as long as the contexts
    to serve): pass the result as ``KvConfig(layer_blocks=..., top_k_blocks=max(...))``. No budget
    is above ``max_blocks`` nor above the blocks of the shortest text."""
    if not isinstance(top_k_blocks, int) or top_k_blocks < 1:
        raise ConfigError(f"top_k_blocks must be an int >= 1, got {top_k_blocks!r}")
    shortest = min(len(t) for t in token_seqs) if token_seqs else 0
    ladder = ladder_for(top_k_blocks, max(1, min(max_blocks, shortest // block_size)))
    curves = attention_curves(model, token_seqs, block_size, ladder, queries=queries, metric=metric)
    return allocate(curves, ladder, top_k_blocks * model.config.num_hidden_layers)
