"""The block-set math of the lookahead measurement: the exact attention mass per block over the
host pool (:func:`block_attention_mass`), the share a block set covers (:func:`covered_mass`), the
blocks of most mass (:func:`best_mass_blocks`), the runner-up draft's shadow query
(:func:`shadow_queries`) and the merges of two drafts' top-K (:func:`union_by_rank`,
:data:`TOP2_SETS`); :func:`grid` lays per-step rows out as tensors. Evaluation only: these read
the whole context on the CPU. :class:`~oasiskv.eval.teacher.LookaheadRecorder` calls them.
"""

from __future__ import annotations

import torch


def host_rows(r) -> list[int]:
    """The host rows of ``r``'s blocks (its K/V in ``host_k``/``host_v``). A staged request with a
    bounded cache (``LLMEngine(kv_cache_blocks=)``) has no row for its uncached blocks: the
    teacher reads the whole context, so it refuses it."""
    t = r.runtime.table(r.id)
    if t.get("cache_blocks") is not None:
        raise ValueError(
            f"request {r.id} holds only a bounded cache of its staged blocks (kv_cache_blocks); the "
            "exact-attention teacher needs every block on the host: run it without kv_cache_blocks"
        )
    return t["host_rows"]


def block_attention_mass(engine, layer: int, sp_reqs, q: torch.Tensor) -> torch.Tensor:
    """The softmax attention of each request's true query ``q [n, num_qo_heads, head_dim]`` over
    its whole context (every token up to and including x_t, read from the host pool, which holds
    all of it), summed per block and averaged over the query heads of each KV head:
    ``[n, num_kv_heads, max_blocks]`` float64 on the CPU, zero past a request's last block.

    The exact attention a dense engine computes; an evaluation metric only (it reads the whole
    context per layer, on the CPU)."""
    g, b = engine.geo, engine.kv.block_size
    hq, hk, d = g.num_qo_heads, g.num_kv_heads, g.head_dim
    group = hq // hk
    lens = [r.kv_len + 1 for r in sp_reqs]  # x_t sits at position kv_len
    nblk = [(t + b - 1) // b for t in lens]
    width = max(nblk)
    out = torch.zeros(len(sp_reqs), hk, width, dtype=torch.float64)
    # Dot products in float32 (the gather and matmul dominate), softmax and sums in float64.
    qc = q.detach().to("cpu", torch.float32).view(-1, hk, group, d)  # query head h reads KV head h // group
    for i, r in enumerate(sp_reqs):
        idx = torch.tensor(host_rows(r)[: nblk[i]], dtype=torch.long)
        k = engine.pools.host_kv(layer, idx)[0].to(torch.float32)  # [blocks, hk, b, d] (fp8: values)
        k = k.permute(1, 0, 2, 3).reshape(hk, nblk[i] * b, d)[:, : lens[i]]  # [hk, T, d]
        logits = torch.matmul(qc[i], k.transpose(1, 2)).double() * d**-0.5  # [hk, group, T]
        w = torch.softmax(logits, dim=-1)
        w = torch.nn.functional.pad(w, (0, nblk[i] * b - lens[i])).view(hk, group, nblk[i], b).sum(-1)
        out[i, :, : nblk[i]] = w.mean(1)
    return out


def covered_mass(mass: torch.Tensor, local: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The attention share of ``blocks [n, hk, K]`` (logical, -1 = none; duplicates counted once)
    plus each request's ``local`` block, averaged over KV heads: ``[n]``."""
    n, hk, width = mass.shape
    keep = torch.zeros(n, hk, width + 1, dtype=torch.bool)
    sel = torch.where(blocks >= 0, blocks.long(), width).clamp(max=width)
    keep.scatter_(2, sel, True)
    keep = keep[..., :width]
    keep[torch.arange(n), :, local.clamp(max=width - 1)] = True
    return (mass * keep).sum(-1).mean(-1)


def best_mass_blocks(mass: torch.Tensor, local: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` complete blocks (before each request's ``local`` block) of most attention per KV
    head, -1 padded: ``[n, hk, k]``. What a selection that knew the true attention would keep."""
    n, hk, width = mass.shape
    cand = torch.arange(width).view(1, 1, width) < local.view(n, 1, 1)
    ranked = torch.where(cand, mass, torch.full_like(mass, -1.0))
    vals, idx = ranked.topk(min(k, width), dim=-1)
    idx = torch.where(vals >= 0, idx, torch.full_like(idx, -1))
    return torch.nn.functional.pad(idx, (0, k - idx.shape[-1]), value=-1)


def shadow_queries(engine, sp_reqs, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's query ``[n, m, num_qo_heads, head_dim]`` of ``m`` alternative tokens per request
    (``tokens [n, m]``) at the position x_t holds now (``kv_len``), each attending to the request's
    context before x_t (read from the host pool, which holds all of it) and to itself: the queries
    the lookahead row would have had with each token as its draft, one step late. An evaluation
    measurement (one extra forward of ``n * m`` rows with dense attention, on the engine's model)."""
    g, b = engine.geo, engine.kv.block_size
    n, m = tokens.shape
    hq, hk, d = g.num_qo_heads, g.num_kv_heads, g.head_dim
    group = hq // hk
    dev = engine.device
    lens = [r.kv_len for r in sp_reqs]
    blocks = [
        torch.tensor(host_rows(r)[: -(-t // b)], dtype=torch.long, device=dev)
        for r, t in zip(sp_reqs, lens, strict=True)
    ]
    out: list = [None] * engine.cfg.num_hidden_layers

    def attn(layer, q, k, v):
        out[layer] = q.view(n, m, hq, d).clone()
        qf = q.float().view(n, m, hk, group, d)
        kf, vf = k.float().view(n, m, hk, d), v.float().view(n, m, hk, d)
        o = torch.empty(n, m, hk, group, d, dtype=torch.float32, device=q.device)
        p = engine.pools
        for i, t in enumerate(lens):
            kb, vb = p.host_kv(layer, blocks[i])  # fp8 host pool: the values
            kc = kb.float().permute(1, 0, 2, 3).reshape(hk, -1, d)[:, :t]
            vc = vb.float().permute(1, 0, 2, 3).reshape(hk, -1, d)[:, :t]
            ctx = torch.einsum("mhgd,htd->mhgt", qf[i], kc)
            own = torch.einsum("mhgd,mhd->mhg", qf[i], kf[i]).unsqueeze(-1)
            w = torch.softmax(torch.cat([ctx, own], dim=-1) * d**-0.5, dim=-1)
            o[i] = torch.einsum("mhgt,htd->mhgd", w[..., :t], vc) + w[..., t:] * vf[i].unsqueeze(2)
        return o.view(n * m, hq, d).to(q.dtype)

    pos = torch.tensor(lens, device=dev).repeat_interleave(m)
    engine.model.forward(tokens.reshape(-1).to(dev), pos, attn, logits_rows=pos[:0])
    return out


def union_by_rank(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` distinct blocks of ``a[0], b[0], a[1], b[1], ...`` per (request, head): the
    union of two best-first top-K lists ``[n, hk, K]`` (-1 padded) within ``k``, alternating from
    ``a``. ``[n, hk, k]``, -1 padded."""
    seq = torch.stack([a, b], dim=-1).flatten(-2)  # [n, hk, 2K]
    w = seq.shape[-1]
    earlier = torch.ones(w, w, dtype=torch.bool, device=seq.device).tril(-1)
    dup = ((seq.unsqueeze(-1) == seq.unsqueeze(-2)) & earlier).any(-1)
    keep = (seq >= 0) & ~dup
    rank = keep.long().cumsum(-1) - 1
    keep &= rank < k
    out = torch.full((*seq.shape[:-1], k + 1), -1, dtype=seq.dtype, device=seq.device)
    out.scatter_(-1, torch.where(keep, rank, k), seq)
    return out[..., :k]


#: The block sets of the top-2 measurement: the best draft's shadow query alone (the control),
#: the two drafts' top-K merged by rank, and by the larger relative score (as lookahead+current).
TOP2_SETS = ("top1", "union_rank", "union_max")


def grid(rows, num_layers: int, req_ids: list[int], steps: list[int], fields) -> list[torch.Tensor]:
    """Rows ``(step, layer, request ids, *values)``, each value ``[n, *tail]``, laid out as one CPU
    tensor per value ``[len(steps), num_layers, len(req_ids), *tail]`` (``fields``: its ``(tail,
    dtype)``); rows of steps not listed are skipped, cells without a row stay zero."""
    s_idx = {s: i for i, s in enumerate(steps)}
    r_idx = {r: i for i, r in enumerate(req_ids)}
    out = [torch.zeros(len(steps), num_layers, len(req_ids), *tail, dtype=dt) for tail, dt in fields]
    for step, layer, ids, *values in rows:
        if step not in s_idx:
            continue
        cols = torch.tensor([r_idx[i] for i in ids])
        for grid, v in zip(out, values, strict=True):
            grid[s_idx[step], layer, cols] = v.cpu().to(grid.dtype)
    return out
