"""The forward pass of one decode step (:class:`StepMixin`): the model forward over the stacked
rows, whose attention callback is :class:`DecodeAttention`; it appends each layer's K/V, attends
over the working set and starts the layer's selection chain.
"""

from __future__ import annotations

import torch

from .. import ops
from .requests import Request
from .selection import SparsePlan


class StepMixin:
    """The forward pass of one decode step (mixed into :class:`~.core.Engine`)."""

    def _run_step(
        self,
        v: dict,
        n: int,
        plan: SparsePlan | None,
        done_blocks: torch.Tensor | None,
        max_pages: int,
        num_splits: int,
        draft_logits: bool = False,
        *,
        reqs: list[Request] | None = None,
        static: bool = False,
        workspace: torch.Tensor | None = None,
        samp: torch.Tensor | None = None,
        verdicts: torch.Tensor | None = None,
    ) -> dict:
        """The forward pass of one decode step over the plan's views ``v`` for ``n`` requests
        (batch rows): the attention callback appends, attends and starts each layer's selection
        chain. Changes no engine attribute (a captured step's outputs are static tensors the caller
        adopts); returns ``logits``, ``feats``, ``last_q`` (per layer) and, with
        ``draft_logits`` (a speculative step), ``logits1``, ``feats1``, ``targets`` and
        ``verdict`` (:meth:`_verify_drafts`: the drafts verified and the accepted ones stored
        inside the step; ``samp``, the sampling inputs on the device, ``[SAMPLING_FIELDS, >= n]``,
        or None where every row is greedy; ``verdicts``, the forced verdicts on the device,
        ``[>= n]`` int32, or None where no row has one).

        ``static`` (the CUDA-graph step): no wait on the previous step's transfer events and no
        ``record_stream`` (the tensors the background stream reads stay referenced until the step
        is over); the background stream is joined at the end of the step, inside the capture."""
        rows, dev = self.rows, self.device
        attn = DecodeAttention(
            self,
            v,
            n,
            plan,
            done_blocks,
            max_pages,
            num_splits,
            spec=draft_logits,
            static=static,
            workspace=workspace,
        )
        last_q, keep, forked, spec_kv = attn.last_q, attn.keep, attn.forked, attn.spec_kv
        kv_grouped = attn.kv_grouped
        if self.policy is not None and not static:
            attn = self.policy.wrap_attention(self, reqs, attn)
        ids_t = v["input_ids"].long()
        pos_t = v["positions"].long()
        row0 = torch.arange(0, n * rows, rows, device=dev)
        capture = self.capture
        last = self.cfg.num_hidden_layers
        if draft_logits and last not in capture:
            capture = (*capture, last)  # the last layer's output of row 1, for its logits
        grouped = {"kv_groups": rows} if kv_grouped else {}
        # A source that reads in the step: each layer publishes its plan and its gather waits for
        # its reads, on the layer's stream (_fetch_and_gather); nothing is deferred or kept.
        remote = not self.block_source.local and plan is not None and not self._in_step
        defer = remote and not static
        self._deferred = [] if defer else None
        # A static (CUDA-graph) step with a block source: the gathers run as planned and each
        # layer's plan is kept for the host to fix up after the step (_fix_up_gathers).
        self._plans = [] if remote and static else None
        try:
            logits, captured = self.model.forward(
                ids_t, pos_t, attn, logits_rows=row0, capture_layers=capture, **grouped
            )
            if defer:
                self._flush_deferred()
        finally:
            self._deferred = None
            plans, self._plans = self._plans, None
        out = {"logits": logits, "feats": None, "last_q": last_q, "keep": keep, "plans": plans}
        if self.capture:
            out["feats"] = torch.cat([captured[i][row0] for i in self.capture], dim=-1)
        if draft_logits:
            row1 = row0 + 1
            # The same LM-head shape as row 0's ([n, hidden]): row 1's logits are exactly what the
            # next step's row 0 would give for the accepted draft.
            out["logits1"] = self.model.logits(captured[last][row1])
            out["feats1"] = (
                torch.cat([captured[i][row1] for i in self.capture], dim=-1) if self.capture else None
            )
            out["targets"] = (v["spec_page_ids"], v["spec_offsets"], v["spec_host_ids"], v["spec_host_rows"])
            # Before the join below: the draft stores touch no page, host row or summary the
            # background chains read (the draft's block is never a candidate of this step).
            out["verdict"] = self._verify_drafts(v, n, logits, out["logits1"], spec_kv, samp, verdicts)
        if static and plan is not None:
            # Join the background streams inside the step: the next step's attention reads the
            # slots these gathers fill. Only those forked in it: waiting on a stream the capture
            # never forked would wait on work recorded before it (invalid in a capture).
            ops.wait_stamp(self._wait_stamps, 0)
            for side in forked:
                torch.cuda.current_stream(dev).wait_stream(side)
            ops.wait_stamp(self._wait_stamps, 1)
        if plan is not None and (static or not self.cuda):
            self._finish_chains(plan, keep)  # every layer's chain: after the join on a GPU
        return out


class DecodeAttention:
    """The attention callback of one decode step, ``attn(layer, q, k, v) -> o`` as the model
    forward calls it at every layer: it appends x_t's K/V (write-through and summaries for sparse
    requests; key codes of the blocks x_t completed), attends both rows over the working set in one
    call, and for sparse requests starts the layer's selection chain (on the layer's background
    stream on a GPU).

    Built by :meth:`StepMixin._run_step` over the plan's views ``v`` for ``n`` requests; what the
    step gathers across layers is read back after the forward: ``last_q`` (each layer's lookahead
    query), ``keep`` (each layer's chain results where the step finishes them after the forward:
    a static step, whose background streams read them until it is over, and the CPU), ``forked``
    (the background streams the step forked) and ``spec_kv`` (a speculative step: each layer's
    row-1 K/V for the draft stores, else None). ``static`` (a CUDA-graph step): no wait on the
    previous step's transfer events and no ``record_stream``."""

    def __init__(
        self,
        eng,
        v: dict,
        n: int,
        plan: SparsePlan | None,
        done_blocks: torch.Tensor | None,
        max_pages: int,
        num_splits: int,
        *,
        spec: bool,
        static: bool,
        workspace: torch.Tensor | None,
    ) -> None:
        g = eng.geo
        self.eng, self.n, self.rows, self.geo, self.pools, self.kv = eng, n, eng.rows, g, eng.pools, eng.kv
        self.hq, self.hk, self.d = g.num_qo_heads, g.num_kv_heads, g.head_dim
        self.device = eng.device
        self.page_ids, self.offsets, self.host_ids = v["page_ids"], v["offsets"], v["host_ids"]
        self.host_rows, self.done_pages = v["host_rows"], v["done_pages"]
        self.kv_indptr, self.kv_indices, self.last_len = v["kv_indptr"], v["kv_indices"], v["last_len"]
        self.step = eng._step_now if static else eng.step_no
        self.scale = g.head_dim**-0.5
        self.plan, self.done_blocks, self.max_pages, self.num_splits = (
            plan,
            done_blocks,
            max_pages,
            num_splits,
        )
        self.static, self.workspace = static, workspace
        self.kv_grouped = eng._kv_grouped and eng.rows > 1  # the model hands k, v grouped by row
        layers = eng.cfg.num_hidden_layers
        self.last_q: list = [None] * layers
        # Each layer's chain results where the step finishes them (Engine._finish_chains): a static
        # step (what the background streams read, alive until it is over) and the CPU.
        self.keep: list = []
        self.forked: set = set()  # the background streams this step forked
        eng._transfer_forked = False  # the transfer stream: not forked by this step yet
        # Speculative decoding: each layer's row-1 K/V ([n, num_kv_heads, head_dim] each), kept on
        # the device for the draft stores (no copy beyond the one the attention takes anyway).
        self.spec_kv: list | None = [None] * layers if spec else None

    def __call__(self, layer, q, k, v):
        eng, n, rows, g, p, kv = self.eng, self.n, self.rows, self.geo, self.pools, self.kv
        hq, hk, d, dev, scale, step = self.hq, self.hk, self.d, self.device, self.scale, self.step
        static, plan, done_blocks, workspace = self.static, self.plan, self.done_blocks, self.workspace
        page_ids_t, offsets_t, host_ids_t = self.page_ids, self.offsets, self.host_ids
        host_rows_t, done_pages = self.host_rows, self.done_pages
        kv_indptr, kv_indices, last_len_t = self.kv_indptr, self.kv_indices, self.last_len
        max_pages, num_splits, kv_grouped = self.max_pages, self.num_splits, self.kv_grouped
        last_q, keep, forked, spec_kv = self.last_q, self.keep, self.forked, self.spec_kv
        out_dtype = q.dtype
        if eng.cuda and not static and eng._gather_done[layer] is not None:
            # The one place the compute stream waits: layer l's transfer of the previous step
            # (its chain's end, and the transfer stream's gather with in-step reads).
            ops.wait_stamp(eng._wait_stamps, 0)
            for done in eng._gather_done[layer]:
                torch.cuda.current_stream(dev).wait_event(done)
            ops.wait_stamp(eng._wait_stamps, 1)
        q4 = q.view(n, rows, hq, d).to(eng.dtype).contiguous()
        # Row-major by row: kt[0] (x_t's K) and kt[1] (the draft's) are contiguous views.
        if kv_grouped:  # as the model's prologue kernel wrote them: no copy
            kt = k.view(rows, n, hk, d).to(eng.dtype)
            vt = v.view(rows, n, hk, d).to(eng.dtype)
        else:
            kt = k.view(n, rows, hk, d).to(eng.dtype).transpose(0, 1).contiguous()
            vt = v.view(n, rows, hk, d).to(eng.dtype).transpose(0, 1).contiguous()
        ops.append_kv(
            g,
            kt[0],
            vt[0],
            page_ids_t,
            offsets_t,
            host_ids_t,
            p.k_pages[layer],
            p.v_pages[layer],
            p.host_k[layer],
            p.host_v[layer],
            p.summaries[layer],
            host_rows=host_rows_t,
            **p.host_scales(layer),
            **p.page_scales(layer),
        )
        if done_blocks is not None:
            # Blocks x_t completed: their summaries are final, so their keys get codes now,
            # before this layer's selection scores them; read from the local pages x_t just
            # filled (HBM; the host rows hold the same keys).
            p.encode_blocks(layer, done_blocks, done_pages)
        extra_k = kt[1] if rows == 2 else None
        extra_v = vt[1] if rows == 2 else None
        if spec_kv is not None:
            spec_kv[layer] = (extra_k, extra_v)
        o = ops.decode_attention(
            g,
            q4,
            p.k_pages[layer],
            p.v_pages[layer],
            kv_indptr,
            kv_indices,
            last_len_t,
            page_map=p.page_map[layer],
            extra_k=extra_k,
            extra_v=extra_v,
            sm_scale=scale,
            max_pages_per_seq=max_pages,
            num_splits=num_splits,
            workspace=workspace,
            **p.page_scales(layer),
        )
        last_q[layer] = q4[:, rows - 1]
        if plan is not None:
            k_budget = kv.layer_budget(layer)
            args = (layer, q4, plan, step, kv.cap_blocks_for(k_budget), k_budget)
            if eng.cuda:
                attn_done = torch.cuda.Event()
                attn_done.record()
                side = eng._side(layer)
                forked.add(side)
                with torch.cuda.stream(side):
                    side.wait_event(attn_done)  # selection reads q, gather overwrites slots
                    if static:  # q4 among what it keeps; fetches and predictions kept after the join
                        keep.append(eng._select(*args, per_layer=False))
                    else:
                        q4.record_stream(side)
                        eng._select(*args)
                        done = torch.cuda.Event()
                        done.record(side)
                        moved = eng._transfer_done.pop(layer, None)  # in-step reads: the gather's
                        eng._gather_done[layer] = (done,) if moved is None else (done, moved)
                if eng._transfer_forked:  # joined at the end of the step with the others
                    forked.add(eng._transfer)
            else:  # the CPU: inline; the fetches and predictions are kept after the forward
                keep.append(eng._select(*args, per_layer=False))
        return o.view(n * rows, hq, d).to(out_dtype)
