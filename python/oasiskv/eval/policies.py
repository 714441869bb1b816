"""Selection policies of the evaluation: OasisKV, and the two reference policies beside it.

* ``oasis`` — the engine as it runs: the lookahead row (or, for ``previous-query``, the current
  query) predicts the next step's top-K blocks; delta selection with the fetch cap fills the
  working set from the host pool.
* ``quest`` — Quest-like: every block stays resident, and at every layer and step the CURRENT
  query's top-K blocks (same Quest scores over the same min/max summaries, same K, plus the local
  block) are the only ones attention may read. Nothing has to be predicted or fetched, so this is
  the upper bound of any prediction at budget K. It is implemented here, outside the engine, as an
  attention mode: :class:`QuestModel` wraps the model of a ``dense`` engine and, inside each
  layer's attention call, masks the head-wise mapping (``page_map``) of every request to its top-K
  pages for that call only, then restores it.
* ``freekv`` — FreeKV-like (without its correction step): OasisKV with the ``previous-query``
  drafter, i.e. step t's own query selects step t+1's blocks.
"""

from __future__ import annotations

import torch

from .. import ops


def _csr(lists: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = [0]
    flat: list[int] = []
    for xs in lists:
        flat.extend(xs)
        indptr.append(len(flat))
    return (
        torch.tensor(indptr, dtype=torch.int32, device=device),
        torch.tensor(flat, dtype=torch.int32, device=device),
    )


class QuestModel(torch.nn.Module):
    """A model wrapper that turns a ``dense`` :class:`~oasiskv.engine.Engine` into the Quest-like
    policy at budget ``top_k_blocks``.

    Use :meth:`attach` to bind it to the engine that runs it (the wrapper must be that engine's
    ``model``). While :attr:`active` (set around ``decode_step``), each layer's attention callback
    is wrapped: the current query of every request scores the min/max summaries of its complete
    blocks (built from the resident pages with the engine's kernels), and only the top-K blocks per
    KV head plus the local block keep their mapping entries during that call. Prefill passes
    through unchanged (it is dense in OasisKV as well).

    It also counts, per request, how many (layer, head, block) entries enter the selection each
    step (``churn``): what a non-resident Quest would have to fetch per step, uncapped.
    """

    def __init__(self, model: torch.nn.Module, top_k_blocks: int = 1) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.top_k_blocks = int(top_k_blocks)
        self.engine = None
        self.reqs: list | None = None
        self._summ: torch.Tensor | None = None
        self._prev_sel: dict[int, torch.Tensor] = {}
        self.churn: dict[int, int] = {}
        self.churn_steps: dict[int, int] = {}
        # For tests: the (layer, request index) -> number of (page, head) entries attention could read.
        self.last_visible: dict[tuple[int, int], int] = {}

    @property
    def prefill_model(self) -> torch.nn.Module:
        """The model whose prefill this wrapper's is (it masks decode steps only): a
        :class:`~oasiskv.engine.PrefillCache` shares prompts with engines over the bare model."""
        return self.inner

    # -------------------------------------------------------------- binding
    def attach(self, engine, top_k_blocks: int | None = None) -> QuestModel:
        """Bind to ``engine`` (whose ``model`` is this wrapper) and wrap its ``decode_step`` so that
        every step runs with the mask at budget ``top_k_blocks`` (default: the wrapper's), also when
        the engine is driven by :class:`oasiskv.LLM`. One wrapper may serve several engines with
        different budgets (they then share prefills through a ``PrefillCache``, also with engines
        over the bare model)."""
        if engine.model is not self:
            raise ValueError("QuestModel.attach: the engine must run this wrapper as its model")
        if engine.backend != "dense":
            raise ValueError("the Quest-like policy runs on a dense engine (everything resident)")
        self.engine = engine
        k_budget = int(top_k_blocks or self.top_k_blocks)
        orig = engine.decode_step

        def decode_step(reqs):
            self.engine, self.top_k_blocks = engine, k_budget
            self.reqs = reqs
            try:
                return orig(reqs)
            finally:
                self.reqs = None
                for r in reqs:
                    self.churn_steps[r.id] = self.churn_steps.get(r.id, 0) + 1

        engine.decode_step = decode_step
        return self

    def reset(self, top_k_blocks: int | None = None) -> None:
        if top_k_blocks is not None:
            self.top_k_blocks = int(top_k_blocks)
        self._prev_sel.clear()
        self.churn.clear()
        self.churn_steps.clear()
        self.last_visible.clear()

    @property
    def active(self) -> bool:
        return self.reqs is not None

    # -------------------------------------------------------------- forward
    def forward(self, input_ids, positions, attn, logits_rows=None, capture_layers=()):
        if self.reqs is not None:
            attn = self._wrap(attn, self.reqs)
        return self.inner.forward(
            input_ids, positions, attn, logits_rows=logits_rows, capture_layers=capture_layers
        )

    def _wrap(self, attn, reqs):
        eng = self.engine
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
        blk_indptr, blk_indices = _csr(cand, dev)
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
        entry_blocks = [len(c) for c in cand]

        def wrapped(layer, q, k, v):
            p = eng.pools
            if self._summ is None or self._summ.shape[0] != p.num_pages or self._summ.dtype != p.dtype:
                self._summ = torch.zeros(p.num_pages, hk, 2, g.head_dim, dtype=p.dtype, device=dev)
            if len(blk_indices):
                ops.build_summaries(g, p.k_pages[layer], blk_indices, lens, self._summ)
            q_now = q.view(n, eng.rows, g.num_qo_heads, g.head_dim)[:, 0].to(eng.dtype).contiguous()
            scores = ops.score_blocks(g, q_now, self._summ, blk_indptr, blk_indices)
            sel = ops.topk_blocks(hk, scores, blk_indptr, k_budget)  # [n, hk, K] logical, -1 padded
            valid = sel >= 0
            keep = keep_local.clone()
            rows = (off_t + sel.clamp(min=0).long()).expand(n, hk, k_budget)[valid]
            cols = heads.expand(n, hk, k_budget)[valid]
            keep[rows, cols] = True
            self._count_churn(layer, reqs, sel, entry_blocks)
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

    def _count_churn(self, layer, reqs, sel, entry_blocks) -> None:
        prev = self._prev_sel.get(layer)
        self._prev_sel[layer] = sel
        if prev is None or prev.shape != sel.shape:
            return
        valid = sel >= 0
        stay = ((sel.unsqueeze(-1) == prev.unsqueeze(-2)) & (prev >= 0).unsqueeze(-2)).any(-1) & valid
        new = (valid & ~stay).sum(dim=(1, 2))
        for i, r in enumerate(reqs):
            self.churn[r.id] = self.churn.get(r.id, 0) + new[i]  # a tensor: no host sync here
