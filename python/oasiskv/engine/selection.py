"""Selection: which blocks a sparse request's attention reads next. Scoring the block summaries,
the two-stage top-K (:func:`two_stage_top_k`), the forced blocks (sinks :func:`keep_sinks`, pins
:func:`keep_pins`, :func:`successors`), recall against the true query (:func:`recall_overlap`),
the CSR tables they run over (:func:`csr_tables`) and the per-step :class:`SparsePlan`.
:class:`SelectionMixin` is the engine's selection chain: score, select, fetch and gather each
layer's blocks (on a background stream on a GPU), and the block source's reads before the gathers
(:class:`~oasiskv.policy.BlockSource`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .. import ops
from ..errors import ConfigError
from .pools import i32
from .requests import Request


@runtime_checkable
class RecallRecorder(Protocol):
    """``Engine.recorder``, a measurement hook (``oasiskv.eval``'s per-layer lookahead accuracy).

    Attributes:
        kept_reference: True to also get ``actual_kept=`` with ``KvConfig.sticky_candidates``: the
            true query's top-K when it keeps the blocks the prediction kept as candidates (the
            selection's own choice had it known the query; one more top-K per layer).
    """

    kept_reference: bool

    def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None, **kw) -> None:
        """Called wherever recall is measured, before this step's selection changes the mapping:
        ``actual`` the true query's top-K, ``prev`` last step's prediction, per sparse request. On a
        GPU it runs on the background stream: it must not sync, unless the evaluation accepts the
        stall."""
        ...


@dataclass
class SparsePlan:
    """The tables of one step's sparse requests, built once on the CPU and read by every layer's
    selection chain (on the background stream when there is a GPU)."""

    idx: torch.Tensor  # [n_sparse] rows of the sparse requests in the batch
    ids: torch.Tensor  # [n_sparse] request ids (rows of the metric accumulators)
    reqs: list[Request]
    slot_pages: torch.Tensor  # [n_sparse, top_k_blocks] GPU page of each budget slot
    blk_indptr: torch.Tensor  # CSR over blk_indices: the candidates, blocks complete once x_t is appended
    blk_indices: torch.Tensor  # host block of each candidate, logical order
    blk_seq: torch.Tensor | None  # [nnz] (long) each candidate's sparse request; None unless needed
    host_indptr: torch.Tensor  # CSR over host_indices: every host block of the request
    host_indices: torch.Tensor
    # Recall is judged over the blocks that were candidates when the last step predicted: those
    # before x_t's own block (the local block, always resident). None: recall not measured.
    rec_csr: tuple[torch.Tensor, torch.Tensor] | None
    # KvConfig.layer_blocks: the first k slot pages of each request, [n_sparse, k], per budget k
    # below top_k_blocks (a layer with budget k selects into these only). Made with the plan, on
    # the compute stream, before any background chain reads them.
    slot_pages_of: dict = field(default_factory=dict)
    # KvConfig.lookahead_min_confidence: [n_sparse] bool, the requests whose own query (row 0)
    # selects this step; gathered from the engine's per-slot flags on the compute stream.
    own: torch.Tensor | None = None
    # [n_sparse] int64: the row of q4.view(-1, num_qo_heads, head_dim) whose query selects, per
    # sparse request (the lookahead row, or row 0 where ``own``): one gather per layer's chain
    # instead of two and a where. Made with the plan (_sparse_plan), on the compute stream.
    q_rows: torch.Tensor | None = None

    def slots_for(self, k: int) -> torch.Tensor:
        """The slot pages a layer with a budget of ``k`` blocks selects into, ``[n_sparse, k]``."""
        return self.slot_pages if k == self.slot_pages.shape[1] else self.slot_pages_of[k]

    @staticmethod
    def from_views(
        v: dict,
        reqs: list[Request],
        k_budget: int,
        measure_recall: bool,
        with_seq: bool,
        layer_blocks: tuple[int, ...] | None = None,
    ):
        """The sparse tables of one step, as views of the plan on the device (and, with
        ``layer_blocks``, each smaller budget's first slot pages)."""
        sp_rows = v["sp_rows"].long()
        slot_pages = v["slot_pages"].view(-1, k_budget)
        smaller = sorted({k for k in layer_blocks or () if k < k_budget})
        return SparsePlan(
            idx=sp_rows,
            ids=v["sp_slots"].long(),
            reqs=[r for r in reqs if r.sparse],  # batch order, as the runtime's sp_rows
            slot_pages=slot_pages,
            blk_indptr=v["blk_indptr"],
            blk_indices=v["blk_indices"],
            blk_seq=v["blk_seq"].long() if with_seq else None,
            host_indptr=v["host_indptr"],
            host_indices=v["host_indices"],
            rec_csr=(v["rec_indptr"], v["rec_indices"]) if measure_recall else None,
            slot_pages_of={k: slot_pages[:, :k].contiguous() for k in smaller},
        )

    def keep_for(self, stream) -> None:
        """These tables are read on ``stream``: keep their memory until it is done with them."""
        for t in (
            self.idx,
            self.ids,
            self.slot_pages,
            self.blk_indptr,
            self.blk_indices,
            self.host_indptr,
            self.host_indices,
            *(self.rec_csr or ()),
            *((self.blk_seq,) if self.blk_seq is not None else ()),
            *((self.own,) if self.own is not None else ()),
            *((self.q_rows,) if self.q_rows is not None else ()),
            *self.slot_pages_of.values(),
        ):
            t.record_stream(stream)


def csr_tables(lists: list[list[int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indptr, indices)`` int32 of per-row lists, on ``device`` (CPU when None)."""
    indptr = [0]
    flat: list[int] = []
    for xs in lists:
        flat.extend(xs)
        indptr.append(len(flat))
    return i32(indptr, device), i32(flat, device)


def recall_overlap(actual: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the sum over KV heads of |prev ∩ actual| / |actual|, and the heads counted.

    actual, prev: [num_seqs, num_kv_heads, k] logical blocks, -1 padded. The engine's lookahead
    recall; the evaluation's overlap (``oasiskv.eval.teacher.LookaheadRecorder``) uses it too.
    """
    # Few kernels: it runs per layer and step on the background stream, where at batch 1 each
    # tiny kernel is latency. A padded -1 of prev only ever equals a padded -1 of actual, which
    # `valid` masks; a head with no valid entry has 0 hits, so its ratio is 0 without a mask.
    valid = actual >= 0
    hits = ((actual.unsqueeze(-1) == prev.unsqueeze(-2)).any(-1) & valid).sum(-1)
    denom = valid.sum(-1)
    ratio = hits / denom.clamp(min=1)  # true division: float32
    return ratio.sum(-1), (denom > 0).sum(-1, dtype=torch.float32)


def relative_to_best(scores: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    """``scores [nnz, heads]`` minus the best score of the same (request, head): a bound on the
    log of each block's attention weight relative to the top block's."""
    best = torch.full((n, scores.shape[1]), -torch.inf, dtype=scores.dtype, device=scores.device)
    best.scatter_reduce_(0, seq.unsqueeze(1).expand_as(scores), scores, "amax")
    return scores - best[seq]


def keep_sinks(scores: torch.Tensor, blk_indptr: torch.Tensor, n_sink: int) -> torch.Tensor:
    """``scores [nnz, heads]`` with the first ``n_sink`` entries of every CSR row (each request's
    logical blocks ``0 .. n_sink - 1``: candidates are in logical order) set to +inf, so that every
    top-K of ``k > n_sink`` takes them (``KvConfig.sink_blocks``): :func:`keep_pins` with blocks
    ``0 .. n_sink - 1`` pinned for every request and head. Device-side ops indexed by
    ``blk_indptr`` only: no host sync and no branch on device values (a captured step replays it);
    rows shorter than ``n_sink`` mark what they have. Apply it after any combination of scores
    (``relative_to_best`` of +inf would be NaN)."""
    if n_sink <= 0:
        return scores
    return keep_pins(
        scores, blk_indptr, _sink_ids(blk_indptr.shape[0] - 1, scores.shape[1], n_sink, scores.device)
    )


def _sink_ids(n: int, heads: int, n_sink: int, device) -> torch.Tensor:
    """Logical blocks ``0 .. n_sink - 1`` for each of ``n`` requests and ``heads`` KV heads:
    ``[n, heads, n_sink]`` int32 (an expanded view), in :func:`keep_pins`' layout."""
    return torch.arange(n_sink, dtype=torch.int32, device=device).expand(n, heads, n_sink)


def successors(blocks: torch.Tensor, blk_indptr: torch.Tensor) -> torch.Tensor:
    """``blocks [n, heads, S]`` logical blocks (-1: none) of the CSR rows ``blk_indptr`` -> the
    next block of each, -1 past its row's last block (``KvConfig.successor_blocks``), in
    :func:`keep_pins`' layout. Device-side ops only."""
    lens = (blk_indptr[1:] - blk_indptr[:-1]).view(-1, 1, 1)
    nxt = blocks + 1
    return torch.where((blocks >= 0) & (nxt < lens), nxt, torch.full_like(blocks, -1))


def keep_pins(scores: torch.Tensor, blk_indptr: torch.Tensor, pins: torch.Tensor | None) -> torch.Tensor:
    """``scores [nnz, heads]`` with each request's pinned blocks set to +inf (``KvConfig.pin_blocks``):
    ``pins [n, heads, P]`` holds, per CSR row and head, logical blocks (positions within the row)
    that every top-K of ``k > P`` (plus sinks) takes; -1 and positions past the row are ignored.
    Device-side ops only (a captured step replays it)."""
    nnz = scores.shape[0]
    if pins is None or pins.shape[-1] == 0 or nnz == 0:
        return scores
    n, heads, _ = pins.shape
    start = blk_indptr[:-1].long().view(n, 1, 1)
    lens = blk_indptr[1:].long().view(n, 1, 1) - start
    p = pins.long()
    # Entries outside a row go to a spare row nnz, dropped below.
    entry = torch.where((p >= 0) & (p < lens), start + p, nnz)
    flat = entry * heads + torch.arange(heads, device=scores.device).view(1, heads, 1)
    mark = torch.zeros((nnz + 1) * heads, dtype=torch.bool, device=scores.device)
    mark.scatter_(0, flat.view(-1), True)
    return scores.masked_fill(mark[: nnz * heads].view(nnz, heads), torch.inf)


def top_k_forced(heads: int, scores: torch.Tensor, indptr: torch.Tensor, k: int, forced) -> torch.Tensor:
    """``topk_blocks(keep_pins(scores, indptr, forced), indptr, k)`` in one launch past a copy of
    the scores (``topk_blocks(forced=)`` writes them, and they may be a selection policy's)."""
    if forced is None or forced.shape[-1] == 0 or scores.shape[0] == 0:
        return ops.topk_blocks(heads, scores, indptr, k)
    return ops.topk_blocks(heads, scores.clone(), indptr, k, forced=forced.to(torch.int32).contiguous())


#: Whether the engine's two-stage selection ends with the one launch :func:`ops.rescore_topk_codes`
#: instead of :func:`ops.rescore_blocks_codes` then :func:`ops.topk_candidates` (the same blocks
#: bit for bit). Off: on the H100 (s21) the fused kernel took 1.0-1.2 x the two launches' time in a
#: CUDA graph (44 x 16K: 184.3 against 153.1 us for the whole chain), and its multi-block form
#: (each row's candidates over several thread blocks, the last one selecting) has not run on a GPU
#: yet. ``bench.kernels --only score`` times both.
FUSED_RESCORE = False


def two_stage_top_k(
    geo,
    q,
    summaries,
    bounds,
    codes,
    csr,
    k: int,
    m: int,
    *,
    forced=None,
    keep=None,
    successor_blocks: int = 0,
    reduce=None,
    bound8_first: bool = True,
    fused: bool | None = None,
    counters=None,
) -> torch.Tensor:
    """The two-stage codes score's top-``k`` (``KvConfig(score_candidates=...)``): the Quest
    bound's best ``m`` blocks per KV head are the candidates (``forced`` and ``keep`` first,
    whatever their bound), the codes rank them; ``forced`` blocks and the successors of the
    ``successor_blocks`` best candidates by the codes (candidates or not) go ahead of every codes
    score, ``keep`` competes like the rest. ``forced``/``keep``: ``[n, heads, F]`` logical blocks
    in :func:`keep_pins`' layout, or None; ``reduce``: :attr:`Engine.score_reduce`. Four
    launches, no host sync (a captured step replays it): the Quest score, its top-``m`` (forced
    and kept blocks set to +inf first, :func:`ops.topk_blocks`' ``forced``), the codes of the
    candidates (:func:`ops.rescore_blocks_codes`) and their top-``k``
    (:func:`ops.topk_candidates`). ``fused`` (None: :data:`FUSED_RESCORE` as it is at the call):
    the last two as one launch, :func:`ops.rescore_topk_codes` (whose ``counters`` this passes on:
    the engine's per layer, or None), the same blocks bit for bit; never with a ``reduce`` (KV-head replicas),
    which must see the codes scores between the two.
    ``bounds = (bounds8, scales)``: the pool's 8-bit bounds, which the codes are encoded in; the
    rescoring reads them and the codes, never the summaries. ``bound8_first``: the Quest score
    reads them too (:func:`ops.score_blocks_bound8`, ``KvConfig.candidate_bound="fp8"``); False
    (``"summaries"``): it reads ``summaries`` (unused, and may be None, when True).
    :meth:`Engine.top_k_blocks` and the kernel benchmark."""
    fused = (FUSED_RESCORE if fused is None else fused) and reduce is None
    reduce = reduce or (lambda x: x)
    heads = geo.num_kv_heads
    indptr = csr[0]
    if bound8_first:
        bound = reduce(ops.score_blocks_bound8(geo, q, *bounds, *csr)).contiguous()
    else:
        bound = reduce(ops.score_blocks(geo, q, summaries, *csr)).contiguous()
    first = forced if keep is None else keep if forced is None else torch.cat([forced, keep], dim=-1)
    if first is not None and first.shape[-1]:
        first = first.to(torch.int32).contiguous()  # +inf in the bound, in the top-m's launch
    else:
        first = None
    cand = ops.topk_blocks(heads, bound, indptr, m, forced=first)  # [n, H, m] logical, -1 padded
    # Successors of the codes score's best candidates (not the Quest bound's, whose best are not
    # the blocks a copy reads: docs/EVAL.md) and the forced blocks first, then the top-k.
    if forced is not None:
        forced = forced.to(torch.int32).contiguous()
    if fused:
        return ops.rescore_topk_codes(
            geo,
            q,
            *bounds,
            codes,
            *csr,
            cand,
            k,
            successors=successor_blocks,
            forced=forced,
            counters=counters,
        )
    scores = reduce(ops.rescore_blocks_codes(geo, q, *bounds, codes, *csr, cand)).contiguous()
    return ops.topk_candidates(heads, scores, cand, indptr, k, successors=successor_blocks, forced=forced)


#: Captured decode steps kept per engine (least recently used out): a batch size has up to
#: three (plain, keeping predictions, measuring recall), and speculative steps their own.


def _before_gathers(src, plans: list) -> list[bool]:
    """``src.before_gathers`` over the engine's kept plans ``(layer, plan_slots, plan_blocks,
    slot_pages, host_csr)``: per plan, whether its gather's inputs changed."""
    return src.before_gathers([(layer, ps, pb, *csr) for layer, ps, pb, _, csr in plans])


class SelectionMixin:
    """The engine's selection chain (mixed into :class:`~.core.Engine`)."""

    def _sparse_plan(self, v: dict, reqs: list[Request]) -> SparsePlan:
        """The selection tables of a step, from the plan's views ``v``."""
        kv = self.kv
        both = self.rows == 2 and kv.select_queries == "lookahead+current"
        plan = SparsePlan.from_views(v, reqs, kv.top_k_blocks, self._recall_now, both, kv.layer_blocks)
        if self._own_q is not None:
            plan.own = self._own_q[plan.ids]  # read in the step (a captured one gathers at replay)
        last = plan.idx * self.rows + (self.rows - 1)
        plan.q_rows = last if plan.own is None else torch.where(plan.own, plan.idx * self.rows, last)
        return plan

    def _recall_phase(self) -> tuple[bool, bool]:
        """``(measure recall in this step, keep this step's predictions for the next one's)``.
        Recall runs on one step in ``KvConfig.recall_every`` (and predictions are kept the step
        before): each measurement costs a scoring pass, top-K and overlap kernels per layer,
        about a fifth of a small model's step at batch 1. A recorder sees every step."""
        kv = self.kv
        keep = kv.sticky_candidates  # the next selection's candidates include this step's prediction
        if not kv.measure_recall:
            return False, keep
        every = kv.recall_every
        if every == 1 or self.recorder is not None:
            return True, True
        return self.step_no % every == 0, keep or (self.step_no + 1) % every == 0

    def select_initial(self, r, layer: int, q, slot_pages, blk_csr, host_csr, k_budget: int) -> None:
        """A request's initial working set at ``layer`` (it turns sparse, or a staged request is
        admitted): the top ``k_budget`` blocks for the query ``q`` ``[1, num_qo_heads, head_dim]``
        without the fetch cap, gathered into ``slot_pages``, and recorded as the slot's prediction."""
        pred, _ = self._select_and_fetch(
            layer, q, slot_pages, blk_csr, host_csr, self.step_no, k_budget, k_budget, initial=True
        )
        self._initial_selection(layer, r.slot, pred[0])

    def _fix_up_gathers(self, plans: list) -> None:
        """After a graph step with a block source: each layer's plan goes to the source, which
        reads the planned block-heads the host pool lacked; where it read any, the layer is
        gathered again (on the current stream, after the graph and before the next step, whose
        attention reads those slots). The graph's own gather copied stale rows for them."""
        src = self.block_source
        if src.idle:
            return
        changed = _before_gathers(src, plans)
        for (layer, ps, pb, slot_pages, host_csr), again in zip(plans, changed, strict=True):
            if again:
                src.wait_for_layer_load(layer)  # that layer's reads only; later ones go on
                self._gather(layer, ps, pb, slot_pages, host_csr)

    def _select(
        self,
        layer: int,
        q4: torch.Tensor,
        plan: SparsePlan,
        step,
        cap: int,
        k_budget: int,
        per_layer: bool = True,
    ) -> tuple:
        """The background chain of one layer: score -> top-K -> delta selection -> gather.

        On a GPU this runs on the background stream; it never synchronises with the host. ``step``
        is an int, or the int32 device tensor a captured step reads. Returns the tensors it made
        (a captured step keeps them alive until the capture ends): ``(q4, prediction, plan
        slots)``. ``per_layer=False``: the caller adds the fetches to the requests' metrics and
        stores the predictions itself, once for every layer (:meth:`_finish_chains`: a captured
        step after its join, the CPU after the forward).
        """
        sp_idx, sp_ids, sp_reqs, slot_pages = plan.idx, plan.ids, plan.reqs, plan.slots_for(k_budget)
        rec_csr = plan.rec_csr
        if rec_csr is not None:
            # Recall of last step's prediction against the exact top-K of this step's true query.
            prev = self._pred_of(layer)[sp_ids]
            q_now = q4[sp_idx, 0].contiguous()
            rec_indptr, rec_indices = rec_csr
            actual = self.top_k_blocks(layer, q_now, (rec_indptr, rec_indices), k_budget, sp_ids)
            hits, counted = recall_overlap(actual, prev)
            self._acc_recall.index_add_(0, sp_ids, hits)
            self._acc_recall_n.index_add_(0, sp_ids, counted)
            if self.recorder is not None:
                extra = {}
                kept = self._kept[layer]
                if kept is not None and self._wants_kept():
                    keep = kept[sp_ids]
                    extra["actual_kept"] = self.top_k_blocks(
                        layer, q_now, (rec_indptr, rec_indices), k_budget, sp_ids, keep=keep
                    )
                self.recorder.on_recall(self, layer, sp_reqs, actual, prev, slot_pages, q_now, **extra)
        both = plan.blk_seq is not None  # KvConfig.select_queries == "lookahead+current" with a lookahead row
        # The lookahead row's query, or row 0's where the draft is unsure (plan.own,
        # KvConfig.lookahead_min_confidence): one gather of the rows the plan chose.
        q_next = q4.reshape(-1, q4.shape[-2], q4.shape[-1]).index_select(0, plan.q_rows)
        pred, ps = self._select_and_fetch(
            layer,
            q_next,
            slot_pages,
            (plan.blk_indptr, plan.blk_indices),
            (plan.host_indptr, plan.host_indices),
            step,
            cap,
            k_budget,
            also=(q4[sp_idx, 0].contiguous(), plan.blk_seq) if both else None,
            slots=sp_ids,
        )
        if per_layer:
            self._acc_fetched.index_add_(0, sp_ids, (ps >= 0).sum(dim=(1, 2)))
            if self._store_pred:
                self._pred_of(layer)[sp_ids] = pred  # the next step's recall and sticky candidates read it
        return q4, pred, ps

    def _finish_chains(self, plan: SparsePlan, chains: list[tuple]) -> None:
        """What every layer's chain (``chains``: :meth:`_select`'s results, layer order) leaves
        for after the step, on the current stream: the fetches added to the requests' counters
        (four launches, not three per layer on the background streams), and, when this step keeps
        its predictions, each layer's prediction stored in the slots' table for the next step's
        recall and sticky candidates (one launch where every layer has one budget, not one per
        layer). A captured step's graph nodes cost host time at every replay."""
        if not chains:
            return
        ids, n = plan.ids, plan.ids.shape[0]
        flat = torch.cat([ps.reshape(n, -1) for _, _, ps in chains], dim=1)
        self._acc_fetched.index_add_(0, ids, (flat >= 0).sum(dim=1))
        if not self._store_pred:
            return
        preds = [pred for _, pred, _ in chains]
        self._pred_of(0)  # makes the table(s)
        if self._pred_all is not None and len(preds) == self._pred_all.shape[0]:
            self._pred_all[:, ids] = torch.stack(preds)
        else:
            for layer, pred in enumerate(preds):
                self._pred_of(layer)[ids] = pred

    def _pred_of(self, layer: int) -> torch.Tensor:
        """Each slot's latest prediction of ``layer``, ``[max_num_seqs, num_kv_heads, K]`` logical
        blocks (-1 padded; K the layer's budget), on the device: one gather and one scatter per
        layer and step instead of a tensor per request."""
        if self._pred[layer] is None:
            rows, heads = self.max_num_seqs + 1, self.geo.num_kv_heads
            if self.kv.layer_blocks is None:
                # One budget: one table for every layer (:meth:`_finish_chains` stores a step's
                # predictions in one launch), each layer's a view of it.
                layers = len(self._pred)
                shape = (layers, rows, heads, self.kv.top_k_blocks)
                self._pred_all = torch.full(shape, -1, dtype=torch.int32, device=self.device)
                self._pred[:] = list(self._pred_all.unbind(0))
            else:
                shape = (rows, heads, self.kv.layer_budget(layer))
                self._pred[layer] = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        return self._pred[layer]

    def _counters_of(self, layer: int) -> torch.Tensor:
        """``layer``'s tickets for :func:`ops.rescore_topk_codes` (int32, ``(max_num_seqs + 1) x
        num_kv_heads``, zero between its launches, which leave them zero): one buffer per layer,
        whose chain runs in the order of one stream, so that no launch needs a memset of its own.
        Made on first use, like :meth:`_pred_of` (before any capture: the first step runs eagerly)."""
        if self._counters[layer] is None:
            n = (self.max_num_seqs + 1) * self.geo.num_kv_heads
            self._counters[layer] = torch.zeros(n, dtype=torch.int32, device=self.device)
        return self._counters[layer]

    def _wants_kept(self) -> bool:
        """Whether the recorder asked for the recall's kept reference (``kept_reference``)."""
        return self.recorder is not None and bool(self.recorder.kept_reference)

    @property
    def recorder(self) -> RecallRecorder | None:
        """The recall recorder (:class:`RecallRecorder`; None on the normal path)."""
        return self._recorder

    @recorder.setter
    def recorder(self, rec: RecallRecorder | None) -> None:
        if rec is not None and not isinstance(rec, RecallRecorder):
            lacks = [n for n in ("on_recall", "kept_reference") if not hasattr(rec, n)]
            raise ConfigError(
                f"engine.recorder must be a RecallRecorder: {type(rec).__name__} lacks "
                f"{' and '.join(lacks)} (kept_reference = False asks for no actual_kept)"
            )
        self._recorder = rec

    def _kept_of(self, layer: int) -> torch.Tensor:
        """Each slot's kept candidates of its latest prediction of ``layer`` (see ``_kept``), shaped
        as :meth:`_pred_of`; made when a recorder first needs it."""
        if self._kept[layer] is None:
            self._kept[layer] = torch.full_like(self._pred_of(layer), -1)
        return self._kept[layer]

    def _pins_of(self, layer: int) -> torch.Tensor:
        """Each slot's pinned blocks of ``layer`` (``KvConfig.pin_blocks``), ``[max_num_seqs + 1,
        num_kv_heads, pin_blocks]`` logical blocks (-1: none), on the device."""
        if self._pins[layer] is None:
            shape = (self.max_num_seqs + 1, self.geo.num_kv_heads, self.kv.pin_blocks)
            self._pins[layer] = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        return self._pins[layer]

    def _initial_selection(self, layer: int, slot: int, pred: torch.Tensor) -> None:
        """Record a request's initial selection ``pred [num_kv_heads, K]`` (best first, sinks first)
        of ``layer``: the prediction the next step's recall measures, and the pinned blocks
        (``KvConfig.pin_blocks``: the best ``pin_blocks`` after the sinks)."""
        self._pred_of(layer)[slot] = pred
        if self.kv.sticky_candidates and self._wants_kept():
            self._kept_of(layer)[slot] = -1  # the first selection ranked every block, keeping none
        if self.kv.pin_blocks:
            s = self.kv.sink_blocks
            self._pins_of(layer)[slot] = pred[:, s : s + self.kv.pin_blocks]

    def block_scores(self, layer: int, q: torch.Tensor, csr) -> torch.Tensor:
        """Block scores ``[nnz, num_kv_heads]`` of queries ``q`` ``[n, num_qo_heads, head_dim]``
        under ``KvConfig.block_score`` for every candidate of ``csr = (blk_indptr, blk_indices)``
        (host block ids of each request's logical blocks), on ``layer``'s summaries (the codes:
        its 8-bit bounds and key codes), summed over the KV heads' replicas with
        :attr:`score_reduce`. One stage: every block is scored,
        whatever ``KvConfig.score_candidates`` says. A public seam for evaluation; the engine
        ranks through :meth:`top_k_blocks`."""
        p = self.pools
        if self.key_codes:
            bounds = (p.bounds8[layer], p.bound_scales[layer])
            scores = ops.score_blocks_codes(self.geo, q, *bounds, p.codes[layer], *csr)
        else:
            scores = ops.score_blocks(self.geo, q, p.summaries[layer], *csr)
        return scores if self.score_reduce is None else self.score_reduce(scores)

    def _forced(self, layer: int, indptr: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor | None:
        """The blocks every top-K of ``layer``'s selection takes, per request of the CSR ``indptr``
        and KV head: its sink blocks (``0 .. sink_blocks - 1``), then the pinned blocks of the
        requests in runtime ``slots`` (``KvConfig.pin_blocks``; none without slots), ``[n,
        num_kv_heads, F]`` logical blocks in :func:`keep_pins`' layout (-1: none); None when
        there are neither."""
        parts = []
        if self.kv.sink_blocks:
            parts.append(
                _sink_ids(indptr.shape[0] - 1, self.geo.num_kv_heads, self.kv.sink_blocks, self.device)
            )
        if self.kv.pin_blocks and slots is not None:
            parts.append(self._pins_of(layer)[slots])
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def _with_successors(
        self, scores: torch.Tensor, indptr: torch.Tensor, forced: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``forced`` (:meth:`_forced`) with the successors of each KV head's
        ``KvConfig.successor_blocks`` best blocks by ``scores [nnz, num_kv_heads]`` appended (one
        top-K launch); unchanged without successor blocks."""
        n_succ = self.kv.successor_blocks
        if not n_succ or scores.shape[0] == 0:
            return forced
        best = ops.topk_blocks(self.geo.num_kv_heads, scores, indptr, n_succ)
        nxt = successors(best, indptr)
        return nxt if forced is None else torch.cat([forced, nxt], dim=-1)

    def top_k_blocks(
        self,
        layer: int,
        q: torch.Tensor,
        csr,
        k: int,
        slots: torch.Tensor | None = None,
        *,
        keep: torch.Tensor | None = None,
        every_block: bool = False,
    ) -> torch.Tensor:
        """The best ``k`` logical blocks per (sequence, KV head) for queries ``q`` under
        ``KvConfig.block_score``, each request's sink blocks first: ``[n, num_kv_heads, k]``, -1
        padded. With ``KvConfig.score_candidates`` in two stages: the Quest bound's top ``m`` are
        the candidates, their codes scores rank them (device ops only: a captured step replays
        it). ``slots`` (int64 ``[n]``, the requests' runtime slots): their pinned blocks
        (``KvConfig.pin_blocks``) are taken too; None pins nothing. ``keep`` (``[n, num_kv_heads,
        K']`` logical blocks, -1: none): in two stages, always candidates, then ranked by the codes
        like the others (``KvConfig.sticky_candidates``). ``every_block``: one stage whatever
        ``KvConfig.score_candidates`` says. The ranking of every prediction and recall; other
        arguments as :meth:`block_scores`."""
        g, p = self.geo, self.pools
        indptr = csr[0]
        forced = self._forced(layer, indptr, slots)
        m = None if every_block else self.kv.candidate_blocks(k)
        if m is None or indptr.shape[0] <= 1:
            scores = self.block_scores(layer, q, csr)
            forced = self._with_successors(scores, indptr, forced)
            return top_k_forced(g.num_kv_heads, scores, indptr, k, forced)
        return two_stage_top_k(
            g,
            q,
            p.summaries[layer],
            (p.bounds8[layer], p.bound_scales[layer]),
            p.codes[layer],
            csr,
            k,
            m,
            forced=forced,
            keep=keep,
            successor_blocks=self.kv.successor_blocks,
            reduce=self.score_reduce,
            bound8_first=self.kv.candidate_bound == "fp8",
            counters=self._counters_of(layer) if self.cuda and FUSED_RESCORE else None,
        )

    def _select_and_fetch(
        self,
        layer,
        q,
        slot_pages,
        blk_csr,
        host_csr,
        step,
        cap,
        k_budget,
        also=None,
        slots=None,
        initial=False,
    ):
        """Score the candidate blocks with ``q`` ([n, num_qo_heads, head_dim]), take the top-K per
        KV head, plan with delta selection (at most ``cap`` fetches per head) and gather the plan
        from the host pool. Returns the prediction and the plan's slots.

        ``also = (q_current, blk_seq)`` ranks each block by the larger of its two scores, each taken
        relative to its own query's best block (``KvConfig.select_queries``). Each request's first
        ``KvConfig.sink_blocks`` candidates and the pinned blocks of the requests in runtime
        ``slots`` are always taken (:meth:`_forced`). ``initial``: a request's first selection
        (``KvConfig.sticky_candidates`` ranks every block then; later ones keep the requests'
        previous predictions, by ``slots``, among the candidates)."""
        p, g = self.pools, self.geo
        if also is None:
            if self.kv.sticky_candidates:
                keep = None if initial or slots is None else self._pred_of(layer)[slots]
                pred = self.top_k_blocks(layer, q, blk_csr, k_budget, slots, keep=keep, every_block=initial)
                if slots is not None and self._wants_kept():
                    self._kept_of(layer)[slots] = -1 if keep is None else keep
            else:
                pred = self.top_k_blocks(layer, q, blk_csr, k_budget, slots)
        else:
            scores = self.block_scores(layer, q, blk_csr)
            if scores.shape[0] > 0:
                q_cur, seq = also
                other = self.block_scores(layer, q_cur, blk_csr)
                scores = torch.maximum(
                    relative_to_best(scores, seq, q.shape[0]), relative_to_best(other, seq, q.shape[0])
                )
            forced = self._with_successors(scores, blk_csr[0], self._forced(layer, blk_csr[0], slots))
            pred = top_k_forced(g.num_kv_heads, scores, blk_csr[0], k_budget, forced)
        ps, pb, _ = ops.delta_select(
            g.num_kv_heads, pred, slot_pages, p.page_map[layer], p.page_last_selected[layer], step, cap
        )
        if self._deferred is not None:
            # A decode step with a block source: the host reads this plan and fetches its misses
            # after every layer's compute is queued (_flush_deferred), not here between layers.
            self._deferred.append((layer, ps, pb, slot_pages, host_csr))
            return pred, ps
        self._fetch_and_gather(layer, ps, pb, slot_pages, host_csr)
        return pred, ps

    def _fetch_and_gather(self, layer, ps, pb, slot_pages, host_csr) -> None:
        """Gather a layer's plan from the host pool, after the block source (if any) has brought
        the planned blocks it lacked."""
        if self._plans is not None:
            self._plans.append((layer, ps, pb, slot_pages, host_csr))  # read after the step
        elif self._in_step:
            self.block_source.publish(layer, ps, pb, self._epoch_dev)  # the reads start
            if self._transfer is not None:
                self._gather_on_transfer(layer, ps, pb, slot_pages, host_csr)
                return
            self.block_source.wait_published(layer, self._epoch_dev)  # on this stream
        else:
            self.block_source.before_gather(layer, ps, pb, *host_csr)
        self._gather(layer, ps, pb, slot_pages, host_csr)

    def _gather_on_transfer(self, layer, ps, pb, slot_pages, host_csr) -> None:
        """In-step reads on a GPU: wait for layer ``layer``'s reads (its plan was published on the
        current, background stream, so they have started) and gather it on the transfer stream,
        so that the selections queued behind it on the background stream go on while the reads
        land, and every layer's reads overlap. An eager step keeps the gather's event for the
        next step's attention (``_transfer_done``); a captured one is joined at its end
        (``_transfer_forked``)."""
        t = self._transfer
        t.wait_stream(torch.cuda.current_stream(self.device))
        self._transfer_forked = True
        with torch.cuda.stream(t):
            self.block_source.wait_published(layer, self._epoch_dev)
            self._gather(layer, ps, pb, slot_pages, host_csr)
            if not torch.cuda.is_current_stream_capturing():
                ps.record_stream(t)
                pb.record_stream(t)
                done = torch.cuda.Event()
                done.record(t)
                self._transfer_done[layer] = done

    def _gather(self, layer, ps, pb, slot_pages, host_csr) -> None:
        """One layer's plan from the host pool into its working-set pages."""
        p, g = self.pools, self.geo
        ops.gather_blocks(
            g,
            ps,
            pb,
            slot_pages,
            *host_csr,
            p.host_k[layer],
            p.host_v[layer],
            p.k_pages[layer],
            p.v_pages[layer],
            **p.host_scales(layer),
            **p.page_scales(layer),
        )

    def _flush_deferred(self) -> None:
        """The deferred fetches and gathers of this step, in layer order, each gather on its
        layer's background stream (after its selection), whose event the next step's attention
        waits on. The host blocks on the plans (and the daemon) only once the whole step's compute
        is queued. A source that does not evict hands every layer's plan over in one call once
        the selections are done (``before_gathers``: the reads go out at once) and each layer's
        gather first waits for that layer's reads alone (``wait_for_layer_load``), so later
        layers' reads overlap earlier layers' gathers; an evicting source fetches each layer
        before its gather, in the inline order."""
        work, self._deferred = self._deferred or [], None
        # A block source that evicts host rows (a bounded cache) may hand a row the previous
        # layer's gather still reads (another stream) to another block: wait for that gather.
        evicts = self.block_source.may_evict
        batched = not evicts
        if batched and work:
            # One read for the whole step's misses (not a daemon round trip per layer), once
            # every layer's selection is done: the plans are read on the host.
            if self.cuda:
                for side in {id(s): s for s in (self._side(w[0]) for w in work)}.values():
                    side.synchronize()
            _before_gathers(self.block_source, work)
        gather = self._gather if batched else self._fetch_and_gather
        prev = None
        for layer, ps, pb, slot_pages, host_csr in work:
            if batched:
                self.block_source.wait_for_layer_load(layer)
            if not self.cuda:
                gather(layer, ps, pb, slot_pages, host_csr)
                continue
            if prev is not None and evicts:
                prev.synchronize()
            side = self._side(layer)
            with torch.cuda.stream(side):
                gather(layer, ps, pb, slot_pages, host_csr)
                done = torch.cuda.Event()
                done.record(side)
                self._gather_done[layer] = (done,)
            prev = done
