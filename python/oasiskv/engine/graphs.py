"""CUDA graphs of decode steps: the batch buckets (:func:`_bucket`, :func:`_round_cap`,
:func:`split_caps`), one
captured step with its own plan buffers (:class:`StepGraph`), and the engine's capture, replay and
eviction of them (:class:`GraphsMixin`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import _core, ops
from .requests import Request
from .speculative import GREEDY_ROW, SAMPLING_FIELDS, VERDICT_NONE

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger("oasiskv.engine")


_MAX_GRAPHS = 16


def _bucket(n: int) -> int:
    """Requests a captured step is padded to: the next power of two up to 16, then 4, 5, 6 or 7
    times a power of two (at most 25 % padding). Padded rows still cost their share of every GEMM
    and of the drafter's work, so a power of two above 16 wasted up to half the step (33 requests
    ran as 64; docs/PERF.md)."""
    return 1 << max(0, n - 1).bit_length() if n <= 16 else _round_cap(n)


def _round_cap(x: int) -> int:
    """A per-request capacity (pages, host blocks) rounded up to 4, 5, 6 or 7 times a power of two
    (at most 25 % padding), at least 16; 0 stays 0."""
    if x <= 0:
        return 0
    x = max(x, 16)
    unit = 1 << (x.bit_length() - 3)
    return -(-x // unit) * unit


def split_caps(n: int, pages: int) -> tuple[int, int]:
    """``(rows, pages)`` a captured step of ``n`` requests needing ``pages`` attention pages per
    request plans its split-KV for (:func:`_bucket`, :func:`_round_cap`). An eager step plans
    with the same, so that both partition each sequence's pages alike and give the same numbers
    token for token (the split count changes the order of the attention's sums)."""
    return _bucket(n), _round_cap(pages)


@dataclass
class StepGraph:
    """One captured decode step: its key ``(requests, pages, host blocks, speculative, measures
    recall, keeps predictions, samples (0: no; 1: yes; 2: with a top-p cut), forces verdicts)``,
    its own plan buffers (pinned host,
    device), the split plan and workspace, and the graph with its outputs. A speculative step's
    graph also verifies the drafts and stores the accepted ones; one that samples (a row with
    temperature > 0) reads the sampling inputs from its own buffers too (``samp_host`` pinned,
    ``samp_dev``: ``[SAMPLING_FIELDS, requests]`` float64, written before every replay like the
    plan), and one with forced verdicts (``Drafter.forced_verdicts``, measurement only) reads them
    from ``verdict_host`` / ``verdict_dev`` (``[requests]`` int32, the same way; padded rows
    :data:`VERDICT_NONE`)."""

    key: tuple[int, int, int, bool, bool, bool, int, bool]
    layout: dict
    plan_host: torch.Tensor
    plan_dev: torch.Tensor
    num_splits: int
    workspace: torch.Tensor | None
    samp_host: torch.Tensor | None = None
    samp_dev: torch.Tensor | None = None
    verdict_host: torch.Tensor | None = None
    verdict_dev: torch.Tensor | None = None
    plan_evt: object = None
    graph: object = None
    out: dict | None = None

    @staticmethod
    def new(eng: Engine, key: tuple, arena_len: int, layout: dict) -> StepGraph:
        rows_cap, pages_cap = key[:2]
        g = eng.geo
        dev = eng.device
        splits = _core.plan_num_splits(ops._num_sms(dev), rows_cap, g.num_kv_heads, pages_cap)
        ws = None
        if splits > 1:
            need = _core.decode_attn_workspace_len(rows_cap, eng.rows, g.num_qo_heads, g.head_dim, splits)
            ws = torch.empty(need, dtype=torch.float32, device=dev)
        samp_host = samp_dev = None
        if key[6]:
            samp_host = torch.zeros(SAMPLING_FIELDS, rows_cap, dtype=torch.float64, pin_memory=True)
            samp_dev = torch.zeros(SAMPLING_FIELDS, rows_cap, dtype=torch.float64, device=dev)
        verdict_host = verdict_dev = None
        if key[7]:
            verdict_host = torch.full((rows_cap,), VERDICT_NONE, dtype=torch.int32, pin_memory=True)
            verdict_dev = torch.full((rows_cap,), VERDICT_NONE, dtype=torch.int32, device=dev)
        return StepGraph(
            key=key,
            layout=dict(layout),
            plan_host=torch.zeros(max(arena_len, 4), dtype=torch.int32, pin_memory=True),
            plan_dev=torch.zeros(max(arena_len, 4), dtype=torch.int32, device=dev),
            num_splits=splits,
            workspace=ws,
            samp_host=samp_host,
            samp_dev=samp_dev,
            verdict_host=verdict_host,
            verdict_dev=verdict_dev,
        )

    def views(self) -> dict:
        return {name: self.plan_dev[s : s + n] for name, (s, n) in self.layout.items()}

    def _run(self, eng: Engine) -> dict:
        rows_cap, pages_cap, _, spec = self.key[:4]
        v = self.views()
        plan = eng._sparse_plan(v, []) if eng.backend == "oasis" else None
        done = v["done_blocks"] if eng.key_codes else None
        return eng._run_step(
            v,
            rows_cap,
            plan,
            done,
            pages_cap,
            self.num_splits,
            spec,
            static=True,
            workspace=self.workspace,
            samp=self.samp_dev,
            verdicts=self.verdict_dev,
        )

    def run_eager(self, eng: Engine) -> dict:
        """This step, eagerly over the padded views: the real step of a key seen for the first
        time, which also warms every kernel and allocation up before :meth:`capture`."""
        return self._run(eng)

    def capture(self, eng: Engine) -> None:
        """Capture the step function into this graph (nothing runs)."""
        if eng._graph_pool is None:
            eng._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # "thread_local": another thread's cudaMalloc (a server's) must not break the capture.
        with torch.cuda.graph(
            graph, pool=eng._graph_pool, stream=eng._capture_stream, capture_error_mode="thread_local"
        ):
            static = self._run(eng)
        self.graph, self.out = graph, static


class GraphsMixin:
    """The engine's CUDA-graph decode steps (mixed into :class:`~.core.Engine`)."""

    # ---------------------------------------------------------------- CUDA-graph decode
    def _decode_graph(
        self,
        reqs: list[Request],
        ids: list[int],
        speculate: list[bool] | None = None,
        samp: torch.Tensor | None = None,
        verdicts: torch.Tensor | None = None,
    ):
        """One step as a CUDA-graph replay: ``(logits, features, speculative outputs)``, copies of
        the graph's outputs (the speculative ones, for :meth:`_spec_result`, the graph's own).

        The runtime plans the step at fixed capacities (``Runtime.plan(..., pad)``: requests
        padded to a bucket (``_bucket``), attention pages and host blocks per request rounded up), so
        every field of the plan lies at the same offset in the graph's own plan buffers; the
        padded rows read empty tables and exit early. One graph per capacity key, captured the
        first time the key is seen: that step runs eagerly with the same static shapes (which
        also warms every kernel and allocation up), then the same function is captured. The
        head-wise mapping updates are applied before the replay (their number varies). The pools
        growing drops every graph (their addresses are baked in).

        A speculative step (``speculate``) is its own graph: the plan carries each draft's
        tentative slot (``spec_*``, at fixed offsets), and the graph verifies every draft and
        stores the accepted ones' K/V (:meth:`_verify_drafts`); the caller reads the verdict once
        after the replay. A speculative step with sampling rows (``samp``, on the host) is a graph
        of its own again (the key's last element), which reads each row's temperature, top_p and
        uniforms from its sampling buffers, written before every replay like the plan: nothing of
        a request's sampling is baked into the graph. Forced verdicts (``verdicts``, on the host;
        measurement only) likewise: a graph of their own (the key's last element) that reads them
        from its verdict buffers."""
        rt = self.runtime
        n = len(reqs)
        req_ids = [r.id for r in reqs]
        pages, blocks = rt.step_needs(req_ids)
        spec = speculate is not None
        blk_cap = _round_cap(blocks) if self.backend == "oasis" else 0
        rows_cap, pages_cap = split_caps(n, pages)
        # Steps that measure recall, or keep predictions for it, are graphs of their own.
        key = (
            rows_cap,
            pages_cap,
            blk_cap,
            spec,
            self._recall_now,
            self._store_pred,
            0 if samp is None else 2 if self._nucleus_now else 1,
            verdicts is not None,
            self._in_step,  # its layers publish their plans (a source that reads in the step)
        )
        pad = (*key[:3], self.max_num_seqs)
        if spec:
            arena_len, layout, _n_sparse, _ = rt.plan(req_ids, ids, pad, speculate)
        else:
            arena_len, layout, _n_sparse, _ = rt.plan(req_ids, ids, pad)
        gr = self._graphs.pop(key, None)
        if gr is None:
            gr = StepGraph.new(self, key, arena_len, layout)
            fresh = True
        else:
            fresh = False
        self._graphs[key] = gr  # most recently used last
        if gr.plan_evt is not None:
            gr.plan_evt.synchronize()  # the copy out of the pinned buffer a step ago is done
        rt.write_plan(gr.plan_host)
        if self._in_step and self.backend == "oasis":
            self._begin_in_step(gr.plan_host, gr.layout)
        self._join_background()
        self._flush_map()
        gr.plan_dev.copy_(gr.plan_host, non_blocking=True)
        if samp is not None:
            # Padded rows are greedy (and hold no draft slot).
            gr.samp_host[:] = torch.tensor(GREEDY_ROW, dtype=torch.float64).unsqueeze(1)
            gr.samp_host[:, :n] = samp
            gr.samp_dev.copy_(gr.samp_host, non_blocking=True)
        if verdicts is not None:
            # Padded rows hold no draft slot; VERDICT_NONE all the same.
            gr.verdict_host.fill_(VERDICT_NONE)
            gr.verdict_host[:n] = verdicts
            gr.verdict_dev.copy_(gr.verdict_host, non_blocking=True)
        gr.plan_evt = torch.cuda.Event()
        gr.plan_evt.record()
        self._step_now.fill_(self.step_no)
        if fresh:
            try:
                out = gr.run_eager(self)
            except BaseException:
                self._graphs.pop(key, None)
                raise
            try:
                gr.capture(self)
            except Exception as e:  # noqa: BLE001 - the step ran; later steps stay eager
                # The step itself ran eagerly and its outputs stand; a capture that fails (a
                # driver or allocator refusal) turns graphs off for this engine, with a word.
                self._graphs.pop(key, None)
                if not self._graphs:
                    self._graph_pool = None
                self.cuda_graph = False
                self.graph_error = f"{type(e).__name__}: {e}"
                log.warning("CUDA-graph capture failed (%s); this engine decodes eagerly from now on", e)
            else:
                self.graph_stats["captures"] += 1
            while len(self._graphs) > _MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
        else:
            gr.graph.replay()
            self.graph_stats["replays"] += 1
            out = gr.out
        if out.get("plans"):
            self._fix_up_gathers(out["plans"])
        self._last_q = list(out["last_q"])  # a copy: prefill writes into the engine's list
        feats = out["feats"][:n].clone() if out["feats"] is not None else None
        spec_out = None
        if spec:
            # The verdict is read at once (_spec_result), before the next replay.
            spec_out = dict(out)
            spec_out["logits1"] = out["logits1"][:n].clone()
            if out["feats1"] is not None:
                spec_out["feats1"] = out["feats1"][:n].clone()
        return out["logits"][:n].clone(), feats, spec_out

    def drop_graphs(self) -> None:
        """Forget every captured step (the pools moved, or to free the graphs' memory)."""
        self._graphs.clear()
        # The last graph gone, torch frees the shared memory pool; capturing into its old handle
        # again trips the allocator's assert (use_count > 0), so the next capture takes a new one.
        self._graph_pool = None
