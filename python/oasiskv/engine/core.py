"""The :class:`Engine` façade: construction, prefill, the dense-to-sparse switch, the per-step
plan and :meth:`Engine.decode_step`, and the metrics a finished request reports.

The engine's rooms are mixed in as base classes, one per concern: :class:`~.pools.PoolsMixin`
(pools, runtime, admission), :class:`~.selection.SelectionMixin` (the selection chain and the
block source's gathers), :class:`~.speculative.SpeculativeMixin` (draft verification and commit),
:class:`~.graphs.GraphsMixin` (CUDA-graph capture and replay) and :class:`~.step.StepMixin` (the
forward pass of one decode step with its attention callback, :class:`~.step.DecodeAttention`).
They share the engine's attributes, all set in :meth:`Engine.__init__`.
"""

from __future__ import annotations

import math

import torch

from .. import _core, ops
from ..config import FP8_KV, KvConfig
from ..drafters import Drafter
from ..errors import ConfigError
from ..policy import BlockSource, LocalHostPool, SelectionPolicy
from .graphs import GraphsMixin, StepGraph, split_caps
from .model import check_engine_model
from .pools import HOST_POOLS, KvPools, PoolsMixin, i32
from .prefill import SparsePrefill
from .requests import PrefillCache, Prefilled, Request
from .selection import SelectionMixin, csr_tables
from .speculative import RowSampling, SpeculativeMixin, sampling_inputs, verdict_inputs
from .step import StepMixin

BACKENDS = ("dense", "oasis")
#: Prompt positions a drafter's ``feed_prompt`` takes per call: the EAGLE-3 head runs a decoder
#: layer over what it is fed, so one call over a 128K prompt on an 8B model took 3 GiB of MLP
#: activations at once (issue 35's 128K rows ran out of memory there). Arbitrary: 8192 positions
#: is 0.2 GiB there; shorter prompts go in one call, as before.
FEED_CHUNK = 8192
#: The background streams of an engine made with ``background_streams=None`` (layer l's selection
#: chain runs on stream l % N, :meth:`Engine._init_streams`); read when the engine is made, so
#: ``experiments/exp_step_host.py`` and a tuning run can change it for every engine a tool makes.
BACKGROUND_STREAMS = 2
#: With a block source that reads in the step (issue 37): each layer's wait for its reads and its
#: gather on a transfer stream of their own instead of the layer's background stream
#: (:meth:`Engine._gather_on_transfer`). Off until measured and tested on a GPU (results/pending-s31:
#: ``python -m oasiskv.bench.disagg --transfer-stream``); read when the engine is made.
IN_STEP_TRANSFER_STREAM = False


def check_backend(backend: str, host_pool: str) -> None:
    """Raise :class:`ConfigError` unless ``backend`` and ``host_pool`` name a known, compatible pair."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if host_pool not in HOST_POOLS:
        raise ConfigError(
            f"host_pool must be one of {HOST_POOLS}, got {host_pool!r}; pass 'pinned' (the host "
            "pool in pinned CPU memory, read over PCIe) or 'device' (the all-resident oracle: the "
            "host pool on the model's device)"
        )
    if host_pool == "device" and backend != "oasis":
        raise ConfigError(
            f"host_pool='device' places the oasis backend's host pool on the GPU, but backend="
            f"{backend!r} has no host pool; pass host_pool='pinned' or backend='oasis'"
        )


class Engine(PoolsMixin, SelectionMixin, SpeculativeMixin, GraphsMixin, StepMixin):
    """Runs requests over one model with one attention backend (``dense`` or ``oasis``).

    The block tables, pool accounting and admission live in ``self.runtime``
    (:class:`oasiskv._core.Runtime`, crate ``oasis-runtime``); this class owns the tensors and the
    model forward. ``max_num_seqs`` bounds the requests held at once; the pools grow as admitted
    requests need them, up to the budgets ``gpu_kv_budget_bytes`` / ``host_kv_budget_bytes``
    (``None``: sized from the free memory, see :meth:`default_caps`). ``host_pool`` (oasis only)
    is where the host pool lives, one of :data:`HOST_POOLS`: ``"pinned"`` CPU memory, or
    ``"device"``, the all-resident oracle (the same selection, the gather device to device), which
    measures what the PCIe transfers cost.
    """

    def __init__(
        self,
        model,
        kv: KvConfig,
        backend: str,
        drafter: Drafter | None,
        eos_token_ids=(),
        prefill_cache: PrefillCache | None = None,
        *,
        max_num_seqs: int = 256,
        gpu_kv_budget_bytes: int | None = None,
        host_kv_budget_bytes: int | None = None,
        policy: SelectionPolicy | None = None,
        cuda_graph: bool = False,
        host_pool: str = "pinned",
        background_streams: int | None = None,
    ) -> None:
        check_backend(backend, host_pool)
        check_engine_model(model)
        self.host_pool = host_pool
        self.model = model
        # A model that groups a decode step's K/V by row (EngineModel.groups_kv: CausalLM's QKV
        # prologue kernel writes each request's token row, then each lookahead row, contiguous
        # for the append and the attention's extra row); any other model's K/V is regrouped here
        # with one copy per tensor.
        self._kv_grouped = bool(model.groups_kv)
        self.cfg = model.config
        self.kv = kv
        self.backend = backend
        self.drafter = drafter
        self.eos = set(eos_token_ids)
        c = self.cfg
        self.geo = ops.KvGeometry(c.num_attention_heads, c.num_key_value_heads, c.head_dim, kv.block_size)
        #: KvConfig.kv_dtype="fp8_e4m3": the GPU pages in E4M3 (engine.pools.KvPools); ``dtype``
        #: is then the float type everything else of the KV is kept in (the model's).
        self.page_kv8 = kv.kv_dtype == FP8_KV
        model_dtype = next(model.parameters()).dtype
        self.dtype = model_dtype if self.page_kv8 else kv.kv_dtype or model_dtype
        #: KvConfig.host_kv_dtype="fp8_e4m3" (or kv_dtype's fp8): the host pool in E4M3.
        self.host_kv8 = kv.host_kv_dtype == FP8_KV or (self.page_kv8 and kv.host_kv_dtype is None)
        self.device = next(model.parameters()).device
        self.rows = 2 if (drafter is not None and drafter.uses_lookahead_row) else 1
        # KvConfig's "auto" confidence fallback: on where the drafter reports its probability.
        confident = self.rows == 2 and drafter.reports_confidence
        kv = self.kv = kv.resolve(reports_confidence=confident)
        self.key_codes = kv.block_score == "codes"
        if self.key_codes and c.head_dim % 4:
            raise ConfigError(
                f"KvConfig(block_score='codes') (the default selection) needs head_dim divisible by 4, "
                f"got {c.head_dim}; pass kv=KvConfig.fast() (the Quest-only selection) or "
                "block_score='quest'"
            )
        if kv.layer_blocks is not None and len(kv.layer_blocks) != c.num_hidden_layers:
            raise ConfigError(
                f"KvConfig(layer_blocks=...) has {len(kv.layer_blocks)} budgets but the model has "
                f"{c.num_hidden_layers} layers; pass one budget per layer"
            )
        # KvConfig.lookahead_min_confidence: per runtime slot, whether the step's own query selects
        # (written before each step; a captured step gathers it by the plan's slots).
        self._own_q: torch.Tensor | None = None
        if kv.lookahead_min_confidence is not None:
            if not confident:
                raise ConfigError(
                    "KvConfig(lookahead_min_confidence=...) needs a drafter with a lookahead row that "
                    f"reports its probability (eagle3), got {drafter.name if drafter else None!r}; "
                    "drop lookahead_min_confidence or use the eagle3 drafter"
                )
            drafter.track_confidence = True
            self._own_q = torch.zeros(int(max_num_seqs) + 1, dtype=torch.bool, device=self.device)
        self.capture = tuple(drafter.capture_layers(c.num_hidden_layers)) if drafter is not None else ()
        # Hand the features of every prompt position to the drafter at prefill (Drafter.feed_prompt).
        self.prompt_features = bool(self.capture) and drafter.wants_prompt_features
        self.max_num_seqs = int(max_num_seqs)
        self.pools: KvPools | None = None
        self.runtime = None
        self._runtime_pools: KvPools | None = None
        self._budgets = (gpu_kv_budget_bytes, host_kv_budget_bytes)
        self.prefill_cache = prefill_cache
        #: Under tensor parallelism (set by TPLLMEngine): ``agree(hit) -> bool``, whether every
        #: rank's prefill cache hit, so that all ranks skip the forward (and its collectives) or
        #: none does; None in one process.
        self.prefill_agree = None
        self.step_no = 0
        # Latest lookahead query of every layer ([batch, num_qo_heads, head_dim]) and each request's
        # row in it: the initial selection of a request that turns sparse uses them.
        self._last_q: list[torch.Tensor | None] = [None] * c.num_hidden_layers
        self._last_row: dict[int, int] = {}
        self._init_streams(background_streams)
        # The step plan: persistent buffers (pinned host + device on a GPU, double-buffered so a
        # step's copy never overwrites tables an earlier step's kernels may still read).
        self._plan_bufs: list = []
        self._plan_evt: list = [None, None]
        self._plan_flip = 0
        self._init_selection_state()
        # Whether this step's sampling rows cut at top_p < 1 (set per step; a graph key element):
        # without a cut the verification skips sorting the vocabulary.
        self._nucleus_now = False
        # The last speculative step (_SpecState) until commit_drafts; see decode_step(speculate=...).
        self._spec = None
        #: Speculative steps of a ``cuda_graph`` engine on a GPU that ran eagerly (a selection
        #: policy, a recorder). Sampling requests do not count: their acceptance rule runs inside
        #: the step (:func:`verify_sampled_drafts`), captured like the greedy one.
        self.spec_eager_steps = 0
        self._init_graph_state(cuda_graph)
        #: The selection policy (:mod:`oasiskv.policy`): None runs the engine as it is.
        self.policy = policy
        if policy is not None:
            policy.bind(self)
        #: Where the host pool's blocks come from (:class:`~oasiskv.policy.BlockSource`): the
        #: local host pool, or for disaggregated decode :class:`oasiskv.disagg.RemoteKvSource`:
        #: ``block_source.before_gather(layer, plan_slots, plan_blocks, host_indptr, host_indices)``
        #: runs between each layer's delta selection and its gather and fills the host pool with
        #: planned blocks still held by the staging daemon; ``before_gathers`` does it for a
        #: step's layers at once (deferred and CUDA-graph steps).
        self.block_source: BlockSource = LocalHostPool()
        # The eager step's deferred (fetch, gather) of each layer while a remote block_source is
        # set (_run_step, _select_and_fetch); None outside such a step.
        self._deferred: list | None = None
        # A CUDA-graph step's kept plans per layer while a block_source is set (_run_step,
        # _fix_up_gathers); None outside such a step.
        self._plans: list | None = None
        # Whether this step's layers publish their plans to a source that reads in the step
        # (BlockSource.reads_in_step, not idle; decode_step), and the step's epoch on the device.
        self._in_step = False
        self._epoch_dev = torch.zeros(1, dtype=torch.int64, device=self.device)
        # The last eager step's plan on the host and its layout (_plan): begin_step's table.
        self._plan_host: tuple = ()
        #: KV-head replication under tensor parallelism (:mod:`oasiskv.models.tp`): the model
        #: shard's ``score_reduce`` sums each block's partial score ``[nnz, num_kv_heads]`` (this
        #: rank's query heads of the KV head) over the ranks sharing the head, before every top-K,
        #: so that they select the same blocks; None otherwise.
        self.score_reduce = model.score_reduce

    def _init_graph_state(self, cuda_graph: bool) -> None:
        """The captured steps' state (part of __init__)."""
        #: Replay decode steps as CUDA graphs (:meth:`decode_step`); ignored on the CPU.
        if not isinstance(cuda_graph, bool):
            raise ConfigError(f"cuda_graph must be True or False, got {cuda_graph!r}")
        self.cuda_graph = cuda_graph
        self._graphs: dict[tuple, StepGraph] = {}
        self._graph_pool = None
        #: Captured decode steps so far, replays of them, and decode steps run eagerly.
        self.graph_stats = {"captures": 0, "replays": 0, "eager": 0}
        #: Why capturing failed (graphs are off since), else None.
        self.graph_error: str | None = None
        # The step number a captured step's selection reads on the device (set before each replay).
        self._step_now = torch.zeros(1, dtype=torch.int32, device=self.device) if self.cuda else None

    def _init_streams(self, background_streams: int | None) -> None:
        """The background streams, the capture stream and the transfer events (part of __init__)."""
        c = self.cfg
        # The background chain (score -> select -> gather) runs on streams of its own on a GPU;
        # the attention of layer l waits only for layer l's transfer event of the previous step.
        # Layer l's chain goes to stream l % background_streams: the layers' chains are
        # independent, and at small batches each is a string of tiny latency-bound kernels
        # longer than the layer's own compute, so one stream would serialise them all.
        if background_streams is None:
            background_streams = BACKGROUND_STREAMS
        if not isinstance(background_streams, int) or not 1 <= background_streams <= 8:
            raise ConfigError(f"background_streams must be an int in 1..8, got {background_streams!r}")
        self.cuda = self.device.type == "cuda"
        self._sides = [torch.cuda.Stream(self.device) for _ in range(background_streams)] if self.cuda else []
        # The stream steps are captured on. torch instantiates graphs with per-node priorities,
        # copied from the stream at capture, so this (not the replay stream) sets the compute
        # nodes' priority against the background streams'. Same priority as theirs: a high one
        # measured 0.91x the step time at 20 x 32K but 1.11-1.25x at 32-40 x 16K (docs/PERF.md).
        self._capture_stream = torch.cuda.Stream(self.device, priority=0) if self.cuda else None
        # Each layer's transfer event(s) of the last eager step: the next step's attention waits
        # on them (DecodeAttention).
        self._gather_done: list = [None] * c.num_hidden_layers
        # With a block source that reads in the step (issue 37), each layer's wait for its reads
        # and its gather run on a transfer stream of their own (Engine._gather_on_transfer), after
        # the layer's selection: later layers' selections, on the background streams, then never
        # queue behind a layer's late reads (the paper's separate KV Transfer stream; None unless
        # IN_STEP_TRANSFER_STREAM). Whether the step being built has forked it (DecodeAttention
        # joins it at the end).
        on = self.cuda and IN_STEP_TRANSFER_STREAM
        self._transfer = torch.cuda.Stream(self.device) if on else None
        self._transfer_forked = False
        self._transfer_done: dict = {}
        # The compute stream's waits on the background streams, timed on the device (ops.wait_stamp:
        # start, total ns, waits); read by transfer_wait().
        self._wait_stamps = torch.zeros(3, dtype=torch.int64, device=self.device) if self.cuda else None

    def _init_selection_state(self) -> None:
        """The per-slot accumulators and predictions the selection keeps (part of __init__)."""
        c, kv = self.cfg, self.kv
        # Per-request accumulators kept on the device (no host sync per step), one row per
        # runtime slot (reset when a request is admitted there).
        # One row more than slots: the padded entries of a captured step add into that row.
        acc_rows = self.max_num_seqs + 1
        self._acc_fetched = torch.zeros(acc_rows, dtype=torch.long, device=self.device)
        self._acc_recall = torch.zeros(acc_rows, dtype=torch.float32, device=self.device)
        self._acc_recall_n = torch.zeros(acc_rows, dtype=torch.float32, device=self.device)
        # Each slot's latest prediction per layer (see _pred_of), made on first use.
        self._pred: list[torch.Tensor | None] = [None] * c.num_hidden_layers
        self._pred_all: torch.Tensor | None = None  # their one table with a single budget (_pred_of)
        # Per layer: the tickets of ops.rescore_topk_codes (zero between launches; _counters_of).
        self._counters: list[torch.Tensor | None] = [None] * c.num_hidden_layers
        # Each slot's pinned blocks per layer (KvConfig.pin_blocks; see _pins_of), made on first use.
        self._pins: list[torch.Tensor | None] = [None] * c.num_hidden_layers
        # With a recorder and KvConfig.sticky_candidates: the blocks each slot's latest prediction
        # kept as candidates (the prediction before it), per layer, so that the next recall can also
        # rank the true query with the same kept blocks (the selection's own exact choice).
        self._kept: list[torch.Tensor | None] = [None] * c.num_hidden_layers
        # Optional measurement hook (None on the normal path): a RecallRecorder, whose on_recall
        # _select calls wherever recall is measured (oasiskv.eval's per-layer lookahead accuracy).
        self.recorder = None
        self._recall_now = self._store_pred = bool(kv.measure_recall)  # set per step (_recall_phase)

    # ---------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, r: Request) -> torch.Tensor:
        """Run the prompt densely, store its KV in fresh pages, return the last row's logits.

        Sets ``r.features`` to the last prompt position's captured features (the first draft's
        input) and, when the drafter ``wants_prompt_features``, calls its ``feed_prompt`` with the
        features of every prompt position, captured by this same forward (call the drafter's
        ``begin`` first). With a :class:`PrefillCache` the same prompt on the same model is computed
        once: the cached K/V, last queries, logits and features are written back instead.

        Admits ``r`` first (:meth:`admit`) unless it already is; if the prefill fails, everything
        it took goes back to the pools before the error propagates.
        """
        if r.runtime is None:
            r.sparse_prefill = self.admit(r, whole=True)
        try:
            return self._prefill(r)
        except BaseException:
            self.release(r)
            raise
        finally:
            r.sparse_prefill = None

    def _prefill(self, r: Request) -> torch.Tensor:
        from ..models.transformer import causal_attention

        p = self.pools
        self._join_background()
        n = len(r.prompt)
        scale = self.geo.head_dim**-0.5
        d = self.geo.head_dim
        layers = self.cfg.num_hidden_layers
        self._last_row = {r.id: 0}
        direct = None if r.sparse_prefill is None else SparsePrefill(self, r.sparse_prefill)
        rows = self._kv_rows(r, n) if direct is None else None
        page_ids = torch.tensor(r.pages, dtype=torch.long, device=self.device) if p.page_kv8 else None

        def store(layer, k, v):
            if direct is not None:  # admitted sparse: to the host pool, not to pages
                direct.store(layer, k, v)
                return
            # One row copy per tensor straight into the pages: no padded or transposed copy (a
            # cache entry held on the host comes in first, one layer at a time). fp8 pages:
            # quantized page by page from the unrounded K/V.
            k, v = (t.to(self.device, non_blocking=True) for t in (k, v))
            if p.page_kv8:
                p.write_kv8(layer, page_ids, 0, k, v)
                return
            k, v = (t.to(self.dtype).reshape(-1, d) for t in (k, v))
            p.k_pages[layer].view(-1, d).index_copy_(0, rows, k)
            p.v_pages[layer].view(-1, d).index_copy_(0, rows, v)

        cache = self.prefill_cache
        key = (id(self.model), self.dtype, tuple(r.prompt))
        hit = cache.get(key, self.capture) if cache is not None else None
        if cache is not None and self.prefill_agree is not None and not self.prefill_agree(hit is not None):
            hit = None  # another rank missed: every rank runs the forward
        if hit is not None:
            for layer in range(layers):
                store(layer, hit.k[layer], hit.v[layer])
                self._last_q[layer] = hit.last_q[layer]
            feats = hit.features if self.capture else None
            self._take_features(r, feats)  # an entry held on the host comes in chunk by chunk
            if direct is not None:
                self._finish_sparse_prefill(r)
            return hit.logits

        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []

        def attn(layer, q, k, v):
            o = causal_attention(q, k, v, scale)
            store(layer, k, v)
            if cache is not None:
                ks.append(cache.hold(k.to(self.dtype)))
                vs.append(cache.hold(v.to(self.dtype)))
            # A copy: a view would keep the layer's whole [n, Hq, D] queries alive.
            self._last_q[layer] = q[-1:].to(self.dtype, copy=True)
            return o

        ids = torch.tensor(r.prompt, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        logits, captured = self.model.forward(
            ids, pos, attn, logits_rows=torch.tensor([n - 1], device=self.device), capture_layers=self.capture
        )
        feats = None
        if self.capture:
            # Every position when someone keeps or consumes them, else the last one only. One
            # concatenation on the device after the forward: no copy or host sync per layer.
            rows = slice(None) if (self.prompt_features or cache is not None) else slice(-1, None)
            feats = torch.cat([captured[i][rows] for i in self.capture], dim=-1)  # [n or 1, width]
        if cache is not None:
            kept = None if feats is None else cache.hold(feats)
            cache.put(key, Prefilled(ks, vs, list(self._last_q), logits[0], kept, self.capture))
        self._take_features(r, feats)
        if direct is not None:
            self._finish_sparse_prefill(r)
        return logits[0]

    @torch.no_grad()
    def prefill_chunk(self, r: Request, start: int, end: int) -> torch.Tensor | None:
        """Prefill prompt positions ``start .. end - 1`` (chunked prefill): the chunk's queries
        attend to the prompt's KV stored by earlier chunks (read back from its pages) and to the
        chunk itself, causally; the chunk's KV goes to its pages. Chunks must come in order and
        cover the prompt. Returns the last prompt position's logits after the final chunk, else
        None. The first chunk admits ``r`` (:meth:`admit`); a failure releases it. A chunk that is
        the whole prompt is :meth:`prefill` (which may use the :class:`PrefillCache`). A long
        prompt is admitted sparse here too (:meth:`prefills_sparse`): its chunks go to the host
        pool and read the earlier ones back from there."""
        n = len(r.prompt)
        if not 0 <= start < end <= n:
            raise ConfigError(f"prefill_chunk({start}, {end}) is not a chunk of a {n}-token prompt")
        if start == 0 and end == n:
            return self.prefill(r)
        if start == 0 and r.runtime is None:
            r.sparse_prefill = self.admit(r, chunked=True)
        try:
            out = self._prefill_chunk(r, start, end)
        except BaseException:
            r.sparse_prefill = None
            self.release(r)
            raise
        if out is not None:
            r.sparse_prefill = None
        return out

    def _prefill_chunk(self, r: Request, start: int, end: int) -> torch.Tensor | None:
        dev = self.device
        self._join_background()
        n = len(r.prompt)
        pos = torch.arange(start, end, device=dev)
        final = end == n
        if r.sparse_prefill is not None:
            attn = self._sparse_chunk_attention(r, start, final)
        else:
            attn = self._paged_chunk_attention(r, start, end, final)
        ids = torch.tensor(r.prompt[start:end], dtype=torch.long, device=dev)
        last = torch.tensor([end - start - 1], device=dev)
        logits, captured = self.model.forward(ids, pos, attn, logits_rows=last, capture_layers=self.capture)
        if self.capture:
            rows = slice(None) if self.prompt_features else slice(-1, None)
            feats = torch.cat([captured[i][rows] for i in self.capture], dim=-1)
            if self.prompt_features:
                self._feed_prompt(r, feats, start)
            if final:
                r.features = feats[-1].clone()
        if final:
            self._last_row = {r.id: 0}
            if r.sparse_prefill is not None:
                self._finish_sparse_prefill(r)
            return logits[0]
        return None

    def _sparse_chunk_attention(self, r: Request, start: int, final: bool):
        """The attention of a chunk of a prompt admitted sparse (positions ``start ..``): the
        earlier positions read back from the host rows (:meth:`SparsePrefill.prefix`) and the
        chunk's own K/V unrounded, as the path through pages has them; the chunk's blocks go to
        the host pool (:meth:`SparsePrefill.store`), from the block it starts in. On a GPU the
        next layer's read-back runs on a background stream while this layer computes."""
        from ..models.transformer import causal_attention

        scale = self.geo.head_dim**-0.5
        direct = SparsePrefill(self, r.sparse_prefill, side=self._sides[0] if self._sides else None)
        first = start // self.kv.block_size
        at = first * self.kv.block_size
        if start:
            direct.prefetch(0, start)

        def attn(layer, q, k, v):
            if start:
                kp, vp = direct.prefix(layer, start)
                direct.prefetch(layer + 1, start)
                k_all, v_all = torch.cat([kp.to(k.dtype), k]), torch.cat([vp.to(v.dtype), v])
            else:
                k_all, v_all = k, v
            o = causal_attention(q, k_all, v_all, scale)
            direct.store(layer, k_all[at:], v_all[at:], first)
            if final:
                self._last_q[layer] = q[-1:].to(self.dtype, copy=True)
            return o

        return attn

    def _paged_chunk_attention(self, r: Request, start: int, end: int, final: bool):
        """The attention of a chunk of a prompt on its dense pages: the chunk stored into them,
        then every position so far read back."""
        from ..models.transformer import causal_attention

        p, dev = self.pools, self.device
        hk, d = self.geo.num_kv_heads, self.geo.head_dim
        scale = d**-0.5
        rows = self._kv_rows(r, end)  # positions 0 .. end - 1
        new_rows = rows[start * hk :]
        page_ids = torch.tensor(r.pages, dtype=torch.long, device=dev) if p.page_kv8 else None

        def attn(layer, q, k, v):
            # Store the chunk first, then read positions 0 .. end - 1 back with ONE gather per
            # tensor into a contiguous [end, Hkv, D] buffer (the prefix's pages are read once per
            # layer; earlier this took a page gather, a transposing copy and a concatenation).
            # NOTE: the prefix is still copied once per layer and chunk, O(layers * n**2 / chunk)
            # bytes over a prompt; a paged prefill attention kernel would read the pages in place.
            if p.page_kv8:  # fp8 pages: the prefix as stored (code x scale), the chunk unrounded
                p.write_kv8(layer, page_ids, start, k, v)
                k_all, v_all = (t.to(k.dtype) for t in p.read_kv8(layer, page_ids, end))
                k_all[start:], v_all[start:] = k, v
            else:
                kp, vp = p.k_pages[layer].view(-1, d), p.v_pages[layer].view(-1, d)
                kp.index_copy_(0, new_rows, k.to(self.dtype).reshape(-1, d))
                vp.index_copy_(0, new_rows, v.to(self.dtype).reshape(-1, d))
                k_all = kp.index_select(0, rows).view(end, hk, d).to(k.dtype)
                v_all = vp.index_select(0, rows).view(end, hk, d).to(v.dtype)
                if self.dtype != k.dtype:  # the chunk's own K/V unrounded, as one prefill has them
                    k_all[start:], v_all[start:] = k, v
            o = causal_attention(q, k_all, v_all, scale)
            if final:
                self._last_q[layer] = q[-1:].to(self.dtype, copy=True)
            return o

        return attn

    def _kv_rows(self, r: Request, end: int) -> torch.Tensor:
        """Rows of a layer's page pool viewed as ``[num_pages * num_kv_heads * block_size,
        head_dim]`` that hold positions ``0 .. end - 1`` of ``r``: ``[end * num_kv_heads]``
        (int64, on the device), position-major, so a ``[end, num_kv_heads, head_dim]`` tensor
        viewed as ``[-1, head_dim]`` writes (``index_copy_``) or reads (``index_select``) its
        K or V with one kernel."""
        b, hk = self.kv.block_size, self.geo.num_kv_heads
        dev = self.device
        pos = torch.arange(end, device=dev)
        pages = torch.tensor(r.pages[: math.ceil(end / b)], dtype=torch.long, device=dev)
        heads = torch.arange(hk, device=dev)
        return ((pages[pos // b, None] * hk + heads) * b + (pos % b)[:, None]).view(-1)

    def _take_features(self, r: Request, feats: torch.Tensor | None) -> None:
        """``r.features`` := the last prompt position's features; a drafter that wants them gets
        every position's (``feats`` [n, width], or None when nothing is captured; on the device,
        or in host memory for a :class:`PrefillCache` entry held there)."""
        if feats is None:
            r.features = None
            return
        # A copy, not a view: the [n, width] block is not kept alive until the first decode step.
        r.features = feats[-1].to(self.device, copy=True)
        if self.prompt_features:
            self._feed_prompt(r, feats, 0)

    def _feed_prompt(self, r: Request, feats: torch.Tensor, start: int) -> None:
        """The drafter's ``feed_prompt`` of positions ``start ..`` (``feats`` [n, width]) in
        :data:`FEED_CHUNK` pieces, each moved to the device as it goes."""
        for at in range(0, feats.shape[0], FEED_CHUNK):
            part = feats[at : at + FEED_CHUNK].to(self.device, non_blocking=True)
            self.drafter.feed_prompt(r.id, r.prompt, part, start + at)

    # ---------------------------------------------------------------- dense -> sparse
    @torch.no_grad()
    def make_sparse(self, r: Request) -> None:
        """Move the request's KV to the host pool and keep only the budget on the GPU.

        The initial working set is the top-K of the latest lookahead query of every layer (the
        last prompt token's query right after prefill), filled without the fetch cap. A request
        already sparse (a long prompt its prefill admitted sparse: :meth:`prefills_sparse`) is
        left as it is, so ``prefill`` then ``make_sparse`` works for every prompt.
        """
        if r.sparse:
            return
        p = self.pools
        self._join_background()
        dev = self.device
        tr = self.runtime.make_sparse(r.id)
        self._flush_map()
        src, dst, lens = i32(tr["src_pages"], dev), i32(tr["host_blocks"], dev), i32(tr["lens"], dev)
        rows = i32(tr["host_rows"], dev)
        for layer in range(self.cfg.num_hidden_layers):
            p.blocks_to_host(layer, src, rows, dst, lens, tr["n_complete"], self.key_codes)
        r.sparse = True
        r.metrics.sparse_since_token = r.kv_len
        self._select_all_initial(r, tr)

    def _finish_sparse_prefill(self, r: Request) -> None:
        """After the prefill of a prompt admitted sparse (its layers stored by
        :class:`SparsePrefill`): its initial working sets, as :meth:`make_sparse` selects them."""
        r.metrics.sparse_since_token = len(r.prompt)
        self._select_all_initial(r, r.sparse_prefill)

    def _select_all_initial(self, r: Request, tr: dict) -> None:
        """Every layer's initial working set of ``r``, which just turned sparse (transition
        ``tr``: :meth:`make_sparse`, or a prompt admitted sparse and prefilled), from the latest
        lookahead query without the fetch cap."""
        kv, g, dev = self.kv, self.geo, self.device
        n_complete = tr["n_complete"]
        slot_pages = i32([tr["slot_pages"]], dev)
        blk_indptr, blk_indices = csr_tables([tr["host_blocks"][:n_complete]], dev)
        host_indptr, host_indices = csr_tables([tr["host_rows"]], dev)
        for layer in range(self.cfg.num_hidden_layers):
            row = self._last_row[r.id]
            q = self._last_q[layer][row : row + 1].reshape(1, g.num_qo_heads, g.head_dim).contiguous()
            k_budget = kv.layer_budget(layer)
            self.select_initial(
                r,
                layer,
                q,
                slot_pages[:, :k_budget].contiguous(),
                (blk_indptr, blk_indices),
                (host_indptr, host_indices),
                k_budget,
            )

    # ---------------------------------------------------------------- one decode step
    def _plan(
        self, ids: list[int], input_ids: list[int], tries: list[bool] | None = None
    ) -> tuple[dict, int, int]:
        """Plan the step in the runtime and bring the arena to the device: views by field name,
        the number of sparse requests and the most pages any request reads. ``tries``: a
        speculative plan (tentative draft slots)."""
        if tries is None:
            n, layout, n_sparse, max_pages = self.runtime.plan(ids, input_ids)
        else:
            n, layout, n_sparse, max_pages = self.runtime.plan(ids, input_ids, None, tries)
        i = self._plan_flip
        self._plan_flip ^= 1 if self.cuda else 0
        bufs = self._plan_bufs
        if not bufs or bufs[0][0].numel() < n:
            cap = max(1024, 2 * n)
            self._join_background()
            if self.cuda:
                bufs[:] = [
                    (
                        torch.empty(cap, dtype=torch.int32, pin_memory=True),
                        torch.empty(cap, dtype=torch.int32, device=self.device),
                    )
                    for _ in range(2)
                ]
            else:
                host = torch.empty(cap, dtype=torch.int32)
                bufs[:] = [(host, host)]
            self._plan_evt = [None, None]
        host, dev = bufs[i]
        if self._plan_evt[i] is not None:
            self._plan_evt[i].synchronize()  # the copy out of this buffer two steps ago is done
        self.runtime.write_plan(host)
        if self.cuda:
            dev[:n].copy_(host[:n], non_blocking=True)
            evt = torch.cuda.Event()
            evt.record()
            self._plan_evt[i] = evt
        views = {name: dev[start : start + length] for name, (start, length) in layout.items()}
        self._plan_host = (host, layout)
        return views, n_sparse, max_pages

    @torch.no_grad()
    def decode_step(
        self,
        reqs: list[Request],
        *,
        speculate: list[bool] | None = None,
        sampling: list[RowSampling | None] | None = None,
        verdicts: list[bool | None] | None = None,
        before_read=None,
    ):
        """Advance every request by one token; returns row-0 logits ``[len(reqs), vocab]``.

        ``speculate`` (one flag per request; speculative decoding, needs the lookahead row) makes
        it a speculative step and returns a :class:`SpecStep`. Each request that tries and may
        (``Runtime.can_append``) gets a tentative slot for its draft at plan time; inside the step,
        on the device, every row verifies its draft (a per-row flag, no host branch) and the
        accepted drafts' K/V, computed by row 1, is stored into their slots (write-through and
        summary update for sparse requests; a rejected draft's row is masked and stores nothing).
        A greedy row accepts when row 0's argmax is the draft; a row of ``sampling`` (one
        :class:`RowSampling` or None, greedy, per request) by the speculative-sampling rule
        (:func:`verify_sampled_drafts`) with its temperature, top_p and uniforms, which the step
        reads as device inputs. The step keeps the captured features of row 1
        (``Request.draft_features``); :meth:`commit_drafts` must follow, and advances the tables
        by one or two tokens.

        ``verdicts`` (measurement only; one True, False or None per request, None for a sampling
        row): forced verdicts (``Drafter.forced_verdicts``). A greedy row that verifies its draft
        accepts it where True, as if row 0's token were the draft (the draft is its token, row
        1's argmax the second, the draft's K/V stored), and rejects it where False (row 0's
        argmax, nothing stored), whatever the logits; None verifies as above. They reach the step
        as a per-row device input, like ``sampling``. The tokens are then not the model's.

        ``before_read`` (a speculative step): called with the step's device outputs
        ``(verdict [5, >= n], features [n, width] or None, draft_features [n, width] or None)``
        before the step's one host read, to queue work that depends on them (the next drafts,
        :meth:`Drafter.launch_batch`).

        With ``cuda_graph=True`` on a GPU the step replays a captured CUDA graph (see
        :meth:`_decode_graph`), speculative or not, sampling or not, except under a selection
        policy, a recorder or a ``block_source`` with blocks left to read, which run eagerly."""
        rows, n = self.rows, len(reqs)
        samp = None
        if speculate is not None:
            if rows != 2:
                raise ConfigError("speculate needs a lookahead drafter (two rows per request)")
            if len(speculate) != n or (sampling is not None and len(sampling) != n):
                raise ConfigError(
                    f"speculate and sampling need one entry per request ({n}), got "
                    f"{len(speculate)} and {None if sampling is None else len(sampling)}"
                )
            if self._spec is not None:
                raise ConfigError("commit_drafts must resolve the last speculative step first")
            samp = sampling_inputs(sampling)
            forced = verdict_inputs(verdicts, sampling, n)
        elif sampling is not None or verdicts is not None:
            raise ConfigError(
                "sampling and verdicts are for speculative steps (pass speculate); sample row 0's "
                "logits instead"
            )
        else:
            forced = None
        ids = []
        for r in reqs:
            ids.append(r.tokens[-1])
            if rows == 2:
                ids.append(r.draft)
        self._last_row = {r.id: i for i, r in enumerate(reqs)}
        if self._own_q is not None:  # only with a lookahead row (checked at construction)
            # Which requests' own query selects this step (their drafter was unsure): per runtime
            # slot, written before the step (eager or replayed) reads it.
            slots = torch.tensor([r.slot for r in reqs], dtype=torch.long).to(self.device)
            self._own_q[slots] = torch.tensor([r.own_query for r in reqs]).to(self.device)
        # Host-side work inside the step (a policy, a recall recorder, reads from a staging daemon
        # before a gather) keeps the step eager; a source with nothing left to read does not.
        src = self.block_source
        reads = not src.idle
        # A source that reads in the step, or fixes up graph steps (_fix_up_gathers), keeps the
        # graphs.
        self._in_step = reads and src.reads_in_step
        reads_eagerly = reads and not (src.fixes_up_graph_steps or self._in_step)
        eager = self.policy is not None or self.recorder is not None or reads_eagerly
        graph = self.cuda and self.cuda_graph and not eager
        self._recall_now, self._store_pred = self._recall_phase()
        self._nucleus_now = samp is not None and bool((samp[1] < 1.0).any())
        if speculate is not None and eager and self.cuda and self.cuda_graph:
            self.spec_eager_steps += 1
        spec_out = None
        try:
            if graph:
                logits, feats, spec_out = self._decode_graph(reqs, ids, speculate, samp, forced)
            else:
                self.graph_stats["eager"] += 1
                logits, feats, spec_out = self._decode_eager(reqs, ids, speculate, samp, forced)
        except BaseException:
            if speculate is not None:
                self._spec = None
                self.runtime.commit_drafts([])  # give the tentative slots back
            raise
        finally:
            self._in_step = False
        if feats is not None:
            for i, r in enumerate(reqs):
                r.features = feats[i]
        if self.policy is not None:
            self.policy.after_step(self, reqs)
        for r in reqs:
            r.metrics.steps += 1
            if r.sparse:
                r.metrics.sparse_steps += 1
        self.step_no += 1
        if speculate is None:
            return logits[:n]
        launch = None
        if before_read is not None:
            f0 = None if feats is None else feats[:n]
            f1 = None if spec_out["feats1"] is None else spec_out["feats1"][:n]

            def launch():
                before_read(spec_out["verdict"], f0, f1)

        return self._spec_result(reqs, logits[:n], spec_out, launch)

    def _decode_eager(
        self,
        reqs: list[Request],
        ids: list[int],
        speculate: list[bool] | None = None,
        samp: torch.Tensor | None = None,
        verdicts: torch.Tensor | None = None,
    ):
        """One step launched kernel by kernel: ``(logits, features, speculative outputs)``;
        ``samp``: the sampling inputs (:func:`sampling_inputs`, on the host), or None;
        ``verdicts``: the forced verdicts (:func:`verdict_inputs`, on the host), or None."""
        n = len(reqs)
        # ---- plan (Rust, once per step): every table of every layer in one arena, one copy
        v, n_sparse, max_pages = self._plan([r.id for r in reqs], ids, speculate)
        if v["map_pages"].numel():
            self._apply_map(v["map_pages"].long(), v["map_values"])
        # The split of long contexts, planned once for all layers (the GPU kernel's), at the
        # capacities a captured step of this batch plans it for: eager and graph steps then sum
        # each sequence's attention in the same order (the same tokens, enforce_eager or not).
        num_splits = 0
        if self.cuda:
            rows_cap, pages_cap = split_caps(n, max_pages)
            sms = ops._num_sms(self.device)
            num_splits = _core.plan_num_splits(sms, rows_cap, self.geo.num_kv_heads, pages_cap)
        plan = self._sparse_plan(v, reqs) if n_sparse else None
        if plan is not None and self._in_step:
            self._begin_in_step(*self._plan_host)
        if plan is not None and self.cuda:
            for side in self._sides:
                plan.keep_for(side)
            if self._in_step and self._transfer is not None:
                plan.keep_for(self._transfer)
        done_blocks = v["done_blocks"] if self.key_codes and v["done_blocks"].numel() else None
        if samp is not None:
            samp = samp.to(self.device, non_blocking=True)
        if verdicts is not None:
            verdicts = verdicts.to(self.device, non_blocking=True)
        spec = speculate is not None
        out = self._run_step(
            v, n, plan, done_blocks, max_pages, num_splits, spec, reqs=reqs, samp=samp, verdicts=verdicts
        )
        self._last_q = list(out["last_q"])
        return out["logits"], out["feats"], (out if spec else None)

    def _begin_in_step(self, plan_host: torch.Tensor, layout: dict) -> None:
        """Hand a step's host block table (the fields of its plan on the host, ``layout``: field
        -> (start, length)) to a source that reads in the step, and write the step's epoch where
        its layers read it (on the current stream, before the step)."""
        (a, na), (b, nb) = layout["host_indptr"], layout["host_indices"]
        indptr, indices = plan_host[a : a + na], plan_host[b : b + nb]
        self._epoch_dev.fill_(self.block_source.begin_step(indptr, indices))

    # ---------------------------------------------------------------- metrics
    def finalize_metrics(self, r: Request) -> None:
        p, m = self.pools, r.metrics
        layers = self.cfg.num_hidden_layers
        length = r.kv_len + 1  # the last token's KV would be stored by the next step
        token_bytes = p.page_bytes // self.kv.block_size
        m.full_kv_bytes = length * token_bytes * layers
        n_blocks = math.ceil(length / self.kv.block_size)
        if r.sparse:
            m.summary_bytes = n_blocks * p.summary_block_bytes * layers
            m.resident_kv_bytes = (self.kv.top_k_blocks + 1) * p.page_bytes * layers + m.summary_bytes
        else:
            m.resident_kv_bytes = n_blocks * p.page_bytes * layers
        self._join_background()
        # K+V of one block and head as the gather moves it from the host pool (fp8: codes + scales).
        entry_bytes = p.host_row_bytes // self.geo.num_kv_heads
        if r.slot < 0:  # never admitted
            return
        m.fetched_bytes_total = int(self._acc_fetched[r.slot]) * entry_bytes
        m.fetched_bytes_per_step = m.fetched_bytes_total / m.sparse_steps if m.sparse_steps else 0.0
        n_rec = float(self._acc_recall_n[r.slot])
        m.lookahead_recall = float(self._acc_recall[r.slot]) / n_rec if n_rec else None
