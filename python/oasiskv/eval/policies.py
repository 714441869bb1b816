"""Selection policies of the evaluation: OasisKV, and the two reference policies beside it.

Each maps onto the engine's public seams (:mod:`oasiskv.policy`):

* ``oasis`` — the engine as it runs (no :class:`~oasiskv.policy.SelectionPolicy`): the lookahead
  row of a drafter predicts the next step's top-K blocks; delta selection with the fetch cap fills
  the working set from the host pool.
* ``freekv`` — FreeKV-like (without its correction step): the same engine with the
  ``previous-query`` drafter, i.e. step t's own query selects step t+1's blocks.
* ``quest`` — Quest-like: every block stays resident, and at every layer and step the CURRENT
  query's top-K blocks (same Quest scores over the same min/max summaries, same K, plus the local
  block) are the only ones attention may read. Nothing has to be predicted or fetched, so this is
  the upper bound of any prediction at budget K. :class:`QuestPolicy` runs it on a ``dense``
  engine through :meth:`~oasiskv.policy.SelectionPolicy.wrap_attention`: inside each layer's
  attention call it masks the head-wise mapping (``page_map``) of every request to its top-K pages
  for that call only, then restores it.
"""

from __future__ import annotations

import torch

from .. import ops
from ..engine import csr_tables
from ..policy import AttnFn, SelectionPolicy


class QuestPolicy(SelectionPolicy):
    """The Quest-like ideal at budget ``top_k_blocks``, as a selection policy of a ``dense`` engine
    (``Engine(..., "dense", policy=QuestPolicy(k))`` or ``LLMEngine(..., backend="dense",
    policy=...)``).

    At every decode step the current query of every request scores the min/max summaries of its
    complete blocks (built from the resident pages with the engine's kernels), and only the top-K
    blocks per KV head plus the local block keep their mapping entries during each layer's
    attention call. Prefill is unchanged (it is dense in OasisKV as well), so prefills are shared
    with other engines over the same model through a :class:`~oasiskv.engine.PrefillCache`.

    It also counts, per request id, how many (layer, head, block) entries enter the selection
    each step (``churn``, over ``churn_steps`` steps): what a non-resident Quest would have to
    fetch per step, uncapped. A step's selection is compared with the previous step's only when
    the batch holds the same requests in the same order.
    """

    name = "quest"
    backend = "dense"

    def __init__(self, top_k_blocks: int) -> None:
        if isinstance(top_k_blocks, bool) or not isinstance(top_k_blocks, int) or top_k_blocks < 1:
            raise ValueError(f"QuestPolicy needs top_k_blocks >= 1, got {top_k_blocks!r}")
        self.top_k_blocks = top_k_blocks
        self._summ: torch.Tensor | None = None
        # layer -> (request ids of the batch, [n, hk, K] selection) of the last step.
        self._prev_sel: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        self.churn: dict[int, torch.Tensor | int] = {}
        self.churn_steps: dict[int, int] = {}
        # For tests: the (layer, request index) -> number of (page, head) entries attention could read.
        self.last_visible: dict[tuple[int, int], int] = {}

    def after_step(self, engine, reqs: list) -> None:
        for r in reqs:
            self.churn_steps[r.id] = self.churn_steps.get(r.id, 0) + 1

    def wrap_attention(self, engine, reqs: list, attn: AttnFn) -> AttnFn:
        eng = engine
        g, b = eng.geo, eng.kv.block_size
        hk = g.num_kv_heads
        dev = eng.device
        k_budget = self.top_k_blocks
        n = len(reqs)
        # Candidates: each request's complete blocks before x_t's own (the local block).
        cand = [r.pages[: r.kv_len // b] for r in reqs]
        local = [r.kv_len // b for r in reqs]
        pages = [list(r.pages) for r in reqs]
        if all(len(c) <= k_budget for c in cand):
            return attn  # the budget covers every block: nothing to mask
        ids = tuple(r.id for r in reqs)
        blk_indptr, blk_indices = csr_tables(cand, dev)
        all_pages = torch.tensor(sum(pages, []), dtype=torch.long, device=dev)
        offsets = [0]
        for p in pages:
            offsets.append(offsets[-1] + len(p))
        # keep[j, h]: page j of the flattened page lists stays visible to KV head h.
        keep_local = torch.zeros(len(all_pages), hk, dtype=torch.bool, device=dev)
        for i in range(n):
            keep_local[offsets[i] + local[i] : offsets[i + 1]] = True
        off_t = torch.tensor(offsets[:-1], dtype=torch.long, device=dev).view(n, 1, 1)
        heads = torch.arange(hk, device=dev).view(1, hk, 1)
        lens = torch.full((len(blk_indices),), b, dtype=torch.int32, device=dev)

        def wrapped(layer, q, k, v):
            p = eng.pools
            q_now = q.view(n, eng.rows, g.num_qo_heads, g.head_dim)[:, 0].to(eng.dtype).contiguous()
            scores = self.block_scores(eng, layer, q_now, reqs, (blk_indptr, blk_indices), lens)
            sel = ops.topk_blocks(hk, scores, blk_indptr, k_budget)  # [n, hk, K] logical, -1 padded
            valid = sel >= 0
            keep = keep_local.clone()
            rows = (off_t + sel.clamp(min=0).long()).expand(n, hk, k_budget)[valid]
            cols = heads.expand(n, hk, k_budget)[valid]
            keep[rows, cols] = True
            self._count_churn(layer, ids, sel)
            pm = p.page_map[layer]
            saved = pm[all_pages].clone()
            pm[all_pages] = torch.where(keep, saved, torch.full_like(saved, -1))
            if not eng.cuda:
                for i in range(n):
                    self.last_visible[(layer, i)] = int(keep[offsets[i] : offsets[i + 1]].sum())
            try:
                return attn(layer, q, k, v)
            finally:
                pm[all_pages] = saved

        return wrapped

    def block_scores(self, eng, layer: int, q_now: torch.Tensor, reqs: list, csr, lens) -> torch.Tensor:
        """``[nnz, num_kv_heads]`` scores of every request's complete blocks (``csr``: their pages)
        for the current queries ``q_now [n, num_qo_heads, head_dim]``: the Quest bound over
        min/max summaries built from the resident pages."""
        summ = self._summaries(eng, layer, csr[1], lens)
        return ops.score_blocks(eng.geo, q_now, summ, *csr)

    def _summaries(self, eng, layer: int, pages: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Min/max summaries of ``pages`` (complete blocks), from the resident pages of ``layer``."""
        p, g = eng.pools, eng.geo
        if self._summ is None or self._summ.shape[0] != p.num_pages or self._summ.dtype != p.dtype:
            shape = (p.num_pages, g.num_kv_heads, 2, g.head_dim)
            self._summ = torch.zeros(shape, dtype=p.dtype, device=eng.device)
        if len(pages):
            keys, rows = p.key_rows(layer, pages)  # fp8 pages: their values
            ops.build_summaries(g, keys, pages, lens, self._summ, block_rows=rows)
        return self._summ

    def _count_churn(self, layer: int, ids: tuple[int, ...], sel: torch.Tensor) -> None:
        prev = self._prev_sel.get(layer)
        self._prev_sel[layer] = (ids, sel)
        if prev is None or prev[0] != ids or prev[1].shape != sel.shape:
            return
        prev_sel = prev[1]
        valid = sel >= 0
        stay = ((sel.unsqueeze(-1) == prev_sel.unsqueeze(-2)) & (prev_sel >= 0).unsqueeze(-2)).any(-1) & valid
        new = (valid & ~stay).sum(dim=(1, 2))
        for i, rid in enumerate(ids):
            self.churn[rid] = self.churn.get(rid, 0) + new[i]  # a tensor: no host sync here


class ExactPolicy(QuestPolicy):
    """The exact ideal at budget ``top_k_blocks``: as :class:`QuestPolicy`, but each KV head's
    blocks rank by the share of the current query's true softmax attention they hold (averaged
    over the head's query heads, normalised over every cached token), not by a bound. The best any
    block selection at that budget can read for the current query (a measurement reference: it
    reads every cached key of every layer at every step)."""

    name = "exact"

    def block_scores(self, eng, layer: int, q_now: torch.Tensor, reqs: list, csr, lens) -> torch.Tensor:
        g, b = eng.geo, eng.kv.block_size
        hk, hq, d = g.num_kv_heads, g.num_qo_heads, g.head_dim
        out = []
        for i, r in enumerate(reqs):
            nc, t = r.kv_len // b, r.kv_len  # complete blocks; tokens cached before x_t
            pages = torch.tensor(list(r.pages[: -(-t // b)]), dtype=torch.long, device=eng.device)
            keys = eng.pools.pages_kv(layer, pages)[0].float()  # [P, hk, b, d] (fp8 pages: their values)
            keys = keys.permute(1, 0, 2, 3).reshape(hk, -1, d)[:, :t]  # [hk, t, d]
            qh = q_now[i].float().view(hk, hq // hk, d)
            w = torch.softmax(torch.einsum("hgd,htd->hgt", qh, keys) * d**-0.5, dim=-1).mean(1)  # [hk, t]
            out.append(w[:, : nc * b].reshape(hk, nc, b).sum(-1).transpose(0, 1))  # [nc, hk]
        return torch.cat(out).contiguous() if out else torch.zeros(0, hk, device=eng.device)


class CodesPolicy(QuestPolicy):
    """The codes ideal at budget ``top_k_blocks``: as :class:`QuestPolicy`, but the blocks rank by
    ``KvConfig(block_score="codes")``'s score (every key at 2 bits per channel inside its block's
    8-bit bound, both built from the resident pages), every block scored: what that score selects
    for the current query, with nothing predicted or fetched."""

    name = "codes"

    def __init__(self, top_k_blocks: int) -> None:
        super().__init__(top_k_blocks)
        self._codes: torch.Tensor | None = None
        self._bounds: tuple[torch.Tensor, torch.Tensor] | None = None

    def block_scores(self, eng, layer: int, q_now: torch.Tensor, reqs: list, csr, lens) -> torch.Tensor:
        p, g = eng.pools, eng.geo
        summ = self._summaries(eng, layer, csr[1], lens)
        if self._codes is None or self._codes.shape[0] != p.num_pages:
            shape = (p.num_pages, g.num_kv_heads, eng.kv.block_size, g.head_dim // 4)
            self._codes = torch.zeros(shape, dtype=torch.uint8, device=eng.device)
            self._bounds = tuple(t.zero_() for t in ops.empty_bounds8(g, p.num_pages, eng.device))
        if len(csr[1]):
            keys, rows = p.key_rows(layer, csr[1])
            ops.encode_blocks(g, keys, summ, csr[1], self._codes, *self._bounds, block_rows=rows)
        return ops.score_blocks_codes(g, q_now, *self._bounds, self._codes, *csr)
