"""The decode engine: requests, the KV pools, and one forward pass per step.

One :class:`Engine` owns the per-layer pools (GPU pages, host blocks, summaries, head-wise mapping)
and runs batches of requests. Every step it

1. plans on the CPU, once for all layers: which page each request's new token goes to, the
   attention tables (dense requests: their page table; sparse ones: their budget slots plus the
   local block) and the scoring tables of the sparse requests;
2. runs the model forward over the stacked rows ``[x_t ; d_{t+1}]`` of every request; at each
   layer the attention callback appends x_t's K/V (with write-through for sparse requests),
   attends both rows over the working set in one call, and for sparse requests lets the lookahead
   row score the block summaries, select the next step's blocks (delta selection, capped) and
   gather them from the host pool;
3. samples, drafts the next lookahead token, and turns requests sparse once their context passes
   the threshold.

Prefill is dense, one forward over the whole prompt. It captures the drafter's
``capture_layers`` for the first draft, and for a drafter that ``wants_prompt_features`` (an
EAGLE-3 head filling its cache over the prompt) those of every prompt position, handed over by
``Drafter.feed_prompt`` right after that same forward.

On the CPU the "background" stages run inline after each layer's attention; the GPU backend
moves them onto their own streams without changing this structure.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import _core, ops
from .config import MAX_POOL_BLOCKS, KvConfig
from .drafters import Drafter
from .errors import ConfigError, OutOfBlocksError
from .memory import available_bytes, device_numa_node, ensure_fits, pinned_full
from .policy import SelectionPolicy

log = logging.getLogger("oasiskv.engine")

#: A pinned host-pool growth at least this large is announced (log line and a progress bar on a
#: terminal): pinning costs about 0.6 s per GiB, so a 100 GiB pool takes a minute.
PIN_NOTICE_BYTES = 1 << 30

BACKENDS = ("dense", "oasis")
#: Where the host pool lives (``Engine(host_pool=...)``): pinned CPU memory, or the model's device
#: (the all-resident oracle: the same selection, but the gather copies device to device).
HOST_POOLS = ("pinned", "device")


@dataclass
class RequestMetrics:
    """What one request cost and how well its lookahead predicted.

    Byte counts are per request, over all layers, K and V together.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    sparse_steps: int = 0
    sparse_since_token: int | None = None
    full_kv_bytes: int = 0
    resident_kv_bytes: int = 0
    summary_bytes: int = 0
    fetched_bytes_total: int = 0
    fetched_bytes_per_step: float = 0.0
    lookahead_recall: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # Speculative decoding (LLMEngine(speculative=True)): drafts verified and accepted, tokens the
    # decode steps made, accepted / verified and decode tokens / steps (None when not measured).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_tokens: int = 0
    acceptance_rate: float | None = None
    tokens_per_step: float | None = None
    # Disaggregated decode (LLMEngine(kv_source=...)): wire bytes of the admission from the
    # staging daemon, and of the block-heads read from it during decode.
    network_admission_bytes: int = 0
    network_fetched_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GenerationResult:
    request_id: int
    prompt_tokens: list[int]
    tokens: list[int]
    text: str | None
    finish_reason: str
    metrics: RequestMetrics

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["metrics"] = self.metrics.as_dict()
        return d


@dataclass
class _Request:
    """One request's Python side: its tokens, drafter state and metrics. Its block tables live in
    the engine's :class:`oasiskv._core.Runtime` (``pages``, ``slot_pages``, ``local_page``,
    ``host_blocks`` read them, for measurement code)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    draft: int | None = None
    # KvConfig.lookahead_min_confidence: the drafter was unsure of `draft`, so the step's own
    # query (row 0) chooses the next working set instead of the lookahead row.
    own_query: bool = False
    features: torch.Tensor | None = None
    # Speculative decoding: the captured features of the draft's row (the features of the
    # position after x_t), set by decode_step(speculate=...).
    draft_features: torch.Tensor | None = None
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Set at admission: the accumulator row on the device, and the runtime holding the tables.
    slot: int = -1
    sparse: bool = False
    runtime: object | None = field(default=None, repr=False)

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is stored (every token but the newest)."""
        return len(self.tokens) - 1

    def _table(self) -> dict:
        if self.runtime is None:
            return {"pages": [], "slot_pages": [], "local_page": -1, "host_blocks": [], "host_rows": []}
        return self.runtime.table(self.id)

    @property
    def pages(self) -> list[int]:
        """Dense page table, logical order (empty once sparse)."""
        return self._table()["pages"]

    @property
    def slot_pages(self) -> list[int]:
        """The budget: K pages (head-wise mapped); empty while dense."""
        return self._table()["slot_pages"]

    @property
    def local_page(self) -> int:
        return self._table()["local_page"]

    @property
    def host_blocks(self) -> list[int]:
        """Host block id of each logical block (sparse only): its summary and codes."""
        return self._table()["host_blocks"]

    @property
    def host_rows(self) -> list[int]:
        """Host row of each logical block (sparse only): its K/V in ``host_k``/``host_v`` (a
        staged request with ``kv_cache_blocks``: a filler row for the blocks not cached)."""
        return self._table()["host_rows"]


@dataclass
class _Prefilled:
    k: list[torch.Tensor]  # per layer [n, num_kv_heads, head_dim], post-RoPE
    v: list[torch.Tensor]
    last_q: list[torch.Tensor]  # per layer [1, num_qo_heads, head_dim]
    logits: torch.Tensor
    # [n, width] the captured features of EVERY prompt position (the engine's capture layers
    # concatenated), None when the engine captures nothing.
    features: torch.Tensor | None
    capture: tuple[int, ...] = ()  # the layers ``features`` concatenates


class PrefillCache:
    """Prompt -> its prefill results, so several engines (say a dense and an oasis one over the same
    model) prefill a shared prompt once. Holds at most ``capacity`` prompts, least recently used out.

    Entries are keyed by (model, KV dtype, prompt); the model is the one that prefills (a model
    wrapper that only changes decode steps names its inner model as ``prefill_model``; a
    :class:`~oasiskv.policy.SelectionPolicy`, like the evaluation's Quest-like ``QuestPolicy``,
    needs no wrapper). An engine that captures features stores those of every prompt
    position, whether or not its own drafter wants them, so a hit serves a drafter with
    ``wants_prompt_features`` exactly as a fresh prefill would (no recompute, and no dependence on
    which engine filled the entry first). An entry serves an engine that captures nothing whatever
    it captured (capturing does not change the KV or the logits); an engine that captures layers
    is served only by an entry with those same layers, else it prefills and replaces the entry. So
    where engines with and without a drafter share prompts, let one that captures prefill first.

    NOTE: an entry holds the prompt's whole KV (and its features: ``3 * hidden`` values per token
    for EAGLE-3) on the model's device; keep ``capacity`` small.
    """

    def __init__(self, capacity: int = 1) -> None:
        if capacity < 1:
            raise ConfigError(f"PrefillCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: dict = {}
        self.hits = 0

    def get(self, key, capture: tuple[int, ...] = ()):
        """The entry of ``key`` if it holds the features of ``capture`` (any entry when empty)."""
        item = self._items.get(key)
        if item is None or (capture and getattr(item, "capture", ()) != tuple(capture)):
            return None
        self._items[key] = self._items.pop(key)  # most recently used
        self.hits += 1
        return item

    def put(self, key, item) -> None:
        self._items.pop(key, None)
        self._items[key] = item
        while len(self._items) > self.capacity:
            self._items.pop(next(iter(self._items)))


@dataclass
class _SparsePlan:
    """The tables of one step's sparse requests, built once on the CPU and read by every layer's
    selection chain (on the background stream when there is a GPU)."""

    idx: torch.Tensor  # [n_sparse] rows of the sparse requests in the batch
    ids: torch.Tensor  # [n_sparse] request ids (rows of the metric accumulators)
    reqs: list[_Request]
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

    def slots_for(self, k: int) -> torch.Tensor:
        """The slot pages a layer with a budget of ``k`` blocks selects into, ``[n_sparse, k]``."""
        return self.slot_pages if k == self.slot_pages.shape[1] else self.slot_pages_of[k]

    @staticmethod
    def from_views(
        v: dict,
        reqs: list[_Request],
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
        return _SparsePlan(
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
            *self.slot_pages_of.values(),
        ):
            t.record_stream(stream)


class KvPools:
    """The per-layer pools (one page id addresses the same page in every layer). The ids are
    handed out by the engine's :class:`oasiskv._core.Runtime`; :meth:`grow` enlarges the tensors
    as admitted requests need them, keeping every block's contents.

    ``host_pool`` places ``host_k``/``host_v``: ``"pinned"`` in CPU memory (pinned with a GPU: the
    kernels read and write it over PCIe through unified addressing), ``"device"`` on ``device``
    beside the pages (the all-resident oracle: every kernel that takes the host pool accepts it
    there, and the gather becomes a device-to-device copy). Without a GPU both are CPU memory."""

    def __init__(
        self,
        geo,
        num_layers: int,
        dtype: torch.dtype,
        num_pages: int,
        num_host_blocks: int,
        device: torch.device,
        key_codes: bool = False,
        host_pool: str = "pinned",
        num_host_rows: int | None = None,
    ) -> None:
        self.geo, self.dtype, self.num_layers, self.device = geo, dtype, num_layers, device
        self.num_pages, self.num_host_blocks, self.num_host_rows = 0, 0, 0
        hk, b, d = geo.num_kv_heads, geo.block_size, geo.head_dim
        self.host_pool = host_pool
        self.host_device = device if host_pool == "device" else torch.device("cpu")
        self.host_pin = device.type == "cuda" and host_pool != "device"
        #: The NUMA node the pinned host pool's pages are placed on: the GPU's, where the machine
        #: shows one (None: the kernel's default placement).
        self.numa_node = device_numa_node(device) if self.host_pin else None
        pin, host_dev = self.host_pin, self.host_device
        # Empty pools first (every kernel takes a tensor, also of 0 rows); grow() fills them.
        self.k_pages = [torch.zeros(0, hk, b, d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(0, hk, b, d, dtype=dtype, device=device) for _ in range(num_layers)]
        self.page_map = torch.full((num_layers, 0, hk), -1, dtype=torch.int32, device=device)
        self.page_last_selected = torch.full((num_layers, 0, hk), -1, dtype=torch.int32, device=device)
        self.host_k = [
            torch.zeros(0, hk, b, d, dtype=dtype, device=host_dev, pin_memory=pin) for _ in range(num_layers)
        ]
        self.host_v = [
            torch.zeros(0, hk, b, d, dtype=dtype, device=host_dev, pin_memory=pin) for _ in range(num_layers)
        ]
        self.summaries = [torch.zeros(0, hk, 2, d, dtype=dtype, device=device) for _ in range(num_layers)]
        # KvConfig(block_score="codes"): every key of a complete block at 2 bits per channel,
        # [num_host_blocks, num_kv_heads, block_size, head_dim // 4] bytes per layer (GPU).
        self.codes = (
            [torch.zeros(0, hk, b, d // 4, dtype=torch.uint8, device=device) for _ in range(num_layers)]
            if key_codes
            else None
        )
        self.grow(num_pages, num_host_blocks, num_host_rows)

    def enable_key_codes(self) -> None:
        """Add (empty) key-code tensors to pools made without them (pools shared, while idle,
        between engines of different block scores); codes are written as blocks enter the host
        pool (the transition to sparse, then each completed block)."""
        if self.codes is None:
            g = self.geo
            shape = (self.num_host_blocks, g.num_kv_heads, g.block_size, g.head_dim // 4)
            self.codes = [
                torch.zeros(shape, dtype=torch.uint8, device=self.device) for _ in range(self.num_layers)
            ]

    def grow(self, num_pages: int, num_host_blocks: int, num_host_rows: int | None = None) -> None:
        """Enlarge the pools to at least these sizes (never shrinks). New pages map nowhere.

        ``num_host_blocks`` sizes what is indexed by host block id (the summaries and key codes,
        on the GPU), ``num_host_rows`` (None: as many) the host pool itself (``host_k``/``host_v``,
        indexed by host row): a local request holds a row with every id, a staged request with a
        bounded cache (``LLMEngine(kv_cache_blocks=)``) fewer rows than ids."""
        device, layers = self.device, self.num_layers
        num_host_rows = num_host_blocks if num_host_rows is None else num_host_rows
        if num_pages > self.num_pages:
            ensure_fits(
                (num_pages - self.num_pages) * self.page_bytes * layers,
                device,
                f"growing the page pool to {num_pages} pages x {layers} layers",
                "lower gpu_kv_budget_bytes / KvConfig.num_gpu_pages, max_num_seqs or max_tokens",
            )
            self.k_pages = [_grown(t, num_pages) for t in self.k_pages]
            self.v_pages = [_grown(t, num_pages) for t in self.v_pages]
            # Head-wise mapping per layer: [num_pages, num_kv_heads], logical block held, -1 empty.
            self.page_map = _grown(self.page_map, num_pages, dim=1, fill=-1)
            self.page_last_selected = _grown(self.page_last_selected, num_pages, dim=1, fill=-1)
            self.num_pages = num_pages
        if num_host_rows > self.num_host_rows:
            ensure_fits(
                (num_host_rows - self.num_host_rows) * self.page_bytes * layers,
                self.host_device,
                f"growing the host pool to {num_host_rows} blocks x {layers} layers",
                "lower host_kv_budget_bytes / KvConfig.num_host_blocks, max_num_seqs or max_tokens",
            )
            # With a GPU the host pool is pinned: the gather and write-through kernels read and
            # write it directly through unified virtual addressing (host_pool="device": it stays
            # on the GPU, where _grown keeps it). The pool grows geometrically with what admitted
            # requests need (Engine._grow_to), so it is pinned in chunks, never all up front;
            # a large growth says so, since pinning is slow.
            pin_bytes = num_host_rows * self.page_bytes * layers
            bar = None
            if self.host_pin and pin_bytes >= PIN_NOTICE_BYTES:
                log.info(
                    "pinning %.1f GiB of host memory for the KV host pool (%d blocks x %d layers); "
                    "about 0.6 s per GiB",
                    pin_bytes / (1 << 30),
                    num_host_rows,
                    layers,
                )
                from tqdm import tqdm

                # disable=None: a bar on a terminal only (logs and CI stay clean).
                bar = tqdm(total=2 * layers, desc="pinning host KV pool", unit="tensor", disable=None)

            if self.host_pin and device.type == "cuda":
                # Kernels read the old pool through UVA; its pages are unpinned when it is freed.
                torch.cuda.synchronize(device)

            def grown_host(tensors):
                # In place, one layer at a time: the old layer is freed as soon as it is copied,
                # so the growth peaks at the new pool plus one old layer.
                for i, t in enumerate(tensors):
                    tensors[i] = _grown(t, num_host_rows, pin=self.host_pin, numa_node=self.numa_node)
                    if bar is not None:
                        bar.update()
                return tensors

            try:
                self.host_k = grown_host(self.host_k)
                self.host_v = grown_host(self.host_v)
            finally:
                if bar is not None:
                    bar.close()
            self.num_host_rows = num_host_rows
        if num_host_blocks > self.num_host_blocks:
            self.summaries = [_grown(t, num_host_blocks) for t in self.summaries]
            if self.codes is not None:
                self.codes = [_grown(t, num_host_blocks) for t in self.codes]
            self.num_host_blocks = num_host_blocks

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, K and V, one layer."""
        g = self.geo
        return 2 * g.num_kv_heads * g.block_size * g.head_dim * self.dtype.itemsize

    @property
    def summary_block_bytes(self) -> int:
        """Bytes of one block's summaries (and key codes, with them), all KV heads, one layer."""
        g = self.geo
        codes = g.num_kv_heads * g.block_size * (g.head_dim // 4) if self.codes is not None else 0
        return 2 * g.num_kv_heads * g.head_dim * self.dtype.itemsize + codes


def _grown(
    old: torch.Tensor, rows: int, dim: int = 0, fill=0, pin: bool = False, numa_node: int | None = None
) -> torch.Tensor:
    """``old`` with ``rows`` rows along ``dim``: its rows copied first, then ``fill``; on its own
    device (in pinned CPU memory with ``pin``, on NUMA node ``numa_node`` when given)."""
    shape = list(old.shape)
    shape[dim] = rows
    if pin:  # exactly its size: torch's pin_memory rounds up to a power of two
        new = pinned_full(shape, fill, old.dtype, numa_node=numa_node)
    else:
        new = torch.full(shape, fill, dtype=old.dtype, device=old.device)
    new.narrow(dim, 0, old.shape[dim]).copy_(old)
    return new


def copy_to_host(t: torch.Tensor):
    """``(host copy, event)``: on a GPU an asynchronous copy into pinned memory and the event
    that marks it done (wait on it before reading); on the CPU the tensor itself and None."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _i32(x, device=None) -> torch.Tensor:
    t = torch.tensor(x, dtype=torch.int32)
    return t if device is None or device.type == "cpu" else t.to(device, non_blocking=True)


def csr_tables(lists: list[list[int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indptr, indices)`` int32 of per-row lists, on ``device`` (CPU when None)."""
    indptr = [0]
    flat: list[int] = []
    for xs in lists:
        flat.extend(xs)
        indptr.append(len(flat))
    return _i32(indptr, device), _i32(flat, device)


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


def _relative_to_best(scores: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
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
    (``_relative_to_best`` of +inf would be NaN)."""
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


def two_stage_top_k(
    geo,
    q,
    summaries,
    codes,
    csr,
    k: int,
    m: int,
    *,
    forced=None,
    keep=None,
    successor_blocks: int = 0,
    reduce=None,
) -> torch.Tensor:
    """The two-stage codes score's top-``k`` (``KvConfig(score_candidates=...)``): the Quest
    bound's best ``m`` blocks per KV head are the candidates (``forced`` and ``keep`` first,
    whatever their bound), the codes rank them; ``forced`` blocks and the successors of the
    ``successor_blocks`` best candidates by the codes (candidates or not) go ahead of every codes
    score, ``keep`` competes like the rest. ``forced``/``keep``: ``[n, heads, F]`` logical blocks
    in :func:`keep_pins`' layout, or None; ``reduce``: :attr:`Engine.score_reduce`. Four
    launches, no host sync (a captured step replays it): the Quest score, its top-``m`` (forced
    and kept blocks set to +inf first, :func:`ops.topk_blocks`' ``forced``), the codes of the
    candidates and :func:`ops.topk_candidates`. :meth:`Engine.top_k_blocks` and the kernel benchmark."""
    reduce = reduce or (lambda x: x)
    heads = geo.num_kv_heads
    indptr = csr[0]
    bound = reduce(ops.score_blocks(geo, q, summaries, *csr)).contiguous()
    first = forced if keep is None else keep if forced is None else torch.cat([forced, keep], dim=-1)
    if first is not None and first.shape[-1]:
        first = first.to(torch.int32).contiguous()  # +inf in the bound, in the top-m's launch
    else:
        first = None
    cand = ops.topk_blocks(heads, bound, indptr, m, forced=first)  # [n, H, m] logical, -1 padded
    scores = reduce(ops.rescore_blocks_codes(geo, q, summaries, codes, *csr, cand)).contiguous()
    # Successors of the codes score's best candidates (not the Quest bound's, whose best are not
    # the blocks a copy reads: docs/EVAL.md) and the forced blocks first, then the top-k: one launch.
    if forced is not None:
        forced = forced.to(torch.int32).contiguous()
    return ops.topk_candidates(heads, scores, cand, indptr, k, successors=successor_blocks, forced=forced)


#: Captured decode steps kept per engine (least recently used out): a batch size has up to
#: three (plain, keeping predictions, measuring recall), and speculative steps their own.
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


class RowSampling(NamedTuple):
    """How one request of a speculative step samples (:meth:`Engine.decode_step`'s ``sampling``):
    its ``temperature`` (> 0) and ``top_p`` (in (0, 1]), and three uniforms in [0, 1) the caller
    drew from the request's own generator (``u_accept`` decides the draft, ``u_token`` samples
    the first token where the draft is rejected or not tried, ``u_bonus`` the token after an
    accepted draft). Plain numbers, so that they travel as step inputs (a CUDA graph reads them
    at fixed offsets) and to tensor-parallel workers."""

    temperature: float
    top_p: float
    u_accept: float
    u_token: float
    u_bonus: float


#: Rows of the per-step sampling inputs (``[SAMPLING_FIELDS, rows]`` float64, one column per
#: batch row): :class:`RowSampling`'s fields in order. A greedy (or padded) row is all zeros
#: but ``top_p`` (1).
SAMPLING_FIELDS = len(RowSampling._fields)
_GREEDY_ROW = (0.0, 1.0, 0.0, 0.0, 0.0)


def sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, nucleus: bool = True
) -> torch.Tensor:
    """Each row's sampling distribution ``[n, vocab]`` float32, normalised: the softmax at its
    ``temperature`` (``[n]``, > 0), then nucleus sampling at its ``top_p`` (``[n]``): the smallest
    set of most likely tokens whose probability reaches ``top_p``, renormalised. The one sampling
    distribution of the engine: the non-speculative sampler (``LLMEngine``) and the in-step
    speculative verification both draw from it.

    ``nucleus=False`` skips the top-p cut, for callers that know every ``top_p`` is >= 1 (a host
    decision). NOTE: with the cut every row of the vocabulary is sorted, even where ``top_p`` is
    1 (a captured step cannot branch on device values); only steps that hold a sampling row pay."""
    probs = torch.softmax(logits.float() / temperature.float().unsqueeze(1), dim=-1)
    if not nucleus:
        return probs / probs.sum(dim=-1, keepdim=True)
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    tp = top_p.float().unsqueeze(1)
    # top_p >= 1 keeps every token, as the reference does: float32 running sums reach 1 before
    # the tail, and "< 1" alone would drop the tail's tokens.
    keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p < tp) | (tp >= 1.0)
    probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p * keep)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_inverse_cdf(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``q`` (``[n, vocab]``, non-negative, not necessarily normalised)
    with probability ``q[i] / q.sum()``, by inverting the CDF at the uniform ``u`` (``[n]``, in
    [0, 1)): the first token whose cumulative mass passes ``u * total``. Only tokens with mass are
    ever taken (a parallel scan's cumulative sums may dip by an ulp over zero entries, and
    ``u * total`` may round up to the total: the last token with mass then); a row without mass
    gives 0. The sums are float64, so a token's probability is resolved to ~1e-16, not to
    float32's 6e-8."""
    cdf = torch.cumsum(q.double(), dim=-1)
    target = u.double().unsqueeze(1) * cdf[:, -1:]
    vocab = q.shape[-1]
    has_mass = q > 0
    idx = torch.arange(vocab, device=q.device)
    first = torch.where((cdf > target) & has_mass, idx, vocab).amin(dim=-1)
    last = torch.where(has_mass, idx, -1).amax(dim=-1)
    return torch.where(first < vocab, first, last).clamp_(min=0)


def verify_sampled_drafts(
    logits: torch.Tensor,
    logits1: torch.Tensor,
    draft: torch.Tensor,
    tried: torch.Tensor,
    samp: torch.Tensor,
    nucleus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling of a one-token deterministic draft, per row, on the device (no host
    branch, graph safe): ``(first token, draft taken, second token)``, each ``[n]``.

    ``logits`` / ``logits1``: rows 0 and 1 (``[n, vocab]``: the token after x_t, and the token
    after the draft); ``draft`` ``[n]``; ``tried`` ``[n]`` bool: the draft is verified (it holds a
    tentative slot and row 0 is finite); ``samp``: the step's sampling inputs
    (``[SAMPLING_FIELDS, >= n]``: temperature, top_p, u_accept, u_token, u_bonus per row). Rows
    with temperature 0 are greedy and take no part (the caller keeps their argmax).

    **The rule.** The standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023)
    with a draft distribution ``q`` and the target's ``p`` (row 0's, after temperature and top-p):
    accept the draft ``d`` with probability ``min(1, p(d) / q(d))``; on rejection sample from
    ``norm(max(0, p - q))``; after an acceptance the token that follows is sampled from the
    target's distribution at the next position. Every drafter here is deterministic (n-gram, an
    EAGLE-3 head's argmax, an oracle), so ``q`` is a point mass at ``d`` (``q(d) = 1``, else 0):

    * accept with probability ``min(1, p(d) / 1) = p(d)``: ``u_accept < p(d)``;
    * the residual: ``max(0, p(x) - q(x))`` is ``p(x)`` for ``x != d`` and ``max(0, p(d) - 1) =
      0`` at ``d``: ``p`` with ``d`` removed, renormalised (by ``1 - p(d)``), sampled with
      ``u_token``;
    * after an acceptance, the token after ``d`` is sampled from row 1's distribution (same
      temperature and top-p) with ``u_bonus``: row 1 is the forward with ``d`` as input, exactly
      the next step's row 0 had ``d`` been sampled.

    Lossless: ``P(first = d) = p(d)`` and, for ``x != d``, ``P(first = x) = (1 - p(d)) * p(x) /
    (1 - p(d)) = p(x)``: the first token has distribution ``p``, and given ``first = d`` the
    second has the target's next-position distribution, so the pair is distributed as two steps
    of the non-speculative sampler. Where ``p(d) = 1`` the residual is empty and the draft is
    always taken (also where rounding left ``u_accept >= p(d)``). A row that did not try samples
    its first token from ``p`` itself with ``u_token``. ``nucleus=False`` (every row's top_p is
    1, a host decision the caller makes per step) skips the top-p sort (:func:`sampling_probs`)."""
    n = logits.shape[0]
    temp, top_p = samp[0, :n], samp[1, :n]
    u_accept, u_token, u_bonus = samp[2, :n], samp[3, :n], samp[4, :n]
    # Greedy rows divide by 1 (their results are not used); every row runs the same kernels.
    temp = torch.where(temp > 0, temp, torch.ones_like(temp))
    p = sampling_probs(logits, temp, top_p, nucleus)
    d = draft.long().unsqueeze(1)
    p_d = p.gather(1, d).squeeze(1).double()
    resid = torch.where(tried.unsqueeze(1), p.scatter(1, d, 0.0), p)
    empty = resid.sum(dim=-1) <= 0
    taken = tried & ((u_accept < p_d) | empty)
    first = torch.where(taken, draft.long(), sample_inverse_cdf(resid, u_token))
    second = sample_inverse_cdf(sampling_probs(logits1, temp, top_p, nucleus), u_bonus)
    return first, taken, second


def _sampling_inputs(sampling: list[RowSampling | None] | None) -> torch.Tensor | None:
    """A speculative step's sampling inputs on the host, ``[SAMPLING_FIELDS, n]`` float64 (a
    greedy row: ``_GREEDY_ROW``), or None where every row is greedy (the step then runs no
    sampling kernel, and its graph is the greedy one)."""
    if sampling is None or all(s is None for s in sampling):
        return None
    cols = []
    for i, s in enumerate(sampling):
        if s is None:
            cols.append(_GREEDY_ROW)
            continue
        if not isinstance(s, RowSampling):
            raise ConfigError(f"sampling[{i}] must be a RowSampling or None, got {type(s).__name__}")
        t, p, *us = s
        if not (math.isfinite(t) and t > 0 and 0 < p <= 1 and all(0 <= u < 1 for u in us)):
            raise ConfigError(
                f"sampling[{i}] = {s!r}: temperature must be > 0, top_p in (0, 1] and the uniforms in "
                "[0, 1); pass None for a greedy request"
            )
        cols.append(tuple(float(x) for x in s))
    return torch.tensor(cols, dtype=torch.float64).T.contiguous()


#: A row's forced verdict as a step input (``Engine.decode_step(verdicts=...)``): none (the engine
#: verifies), a forced rejection, a forced acceptance.
VERDICT_NONE, VERDICT_REJECT, VERDICT_ACCEPT = -1, 0, 1


def _verdict_inputs(
    verdicts: list[bool | None] | None, sampling: list[RowSampling | None] | None, n: int
) -> torch.Tensor | None:
    """A speculative step's forced verdicts on the host, ``[n]`` int32 (:data:`VERDICT_NONE`,
    :data:`VERDICT_REJECT` or :data:`VERDICT_ACCEPT` per row), or None where no row has one (the
    step then runs none of their kernels, and its graph is the unforced one)."""
    if verdicts is None:
        return None
    if len(verdicts) != n:
        raise ConfigError(f"verdicts needs one entry per request ({n}), got {len(verdicts)}")
    out = []
    for i, x in enumerate(verdicts):
        if x is not None and not isinstance(x, bool):
            raise ConfigError(f"verdicts[{i}] must be True, False or None, got {x!r}")
        if x is not None and sampling is not None and sampling[i] is not None:
            raise ConfigError(
                f"verdicts[{i}] forces the verdict of a sampling row; forced verdicts are for greedy rows "
                "(pass None there: the speculative-sampling rule decides)"
            )
        out.append(VERDICT_NONE if x is None else VERDICT_ACCEPT if x else VERDICT_REJECT)
    if all(x == VERDICT_NONE for x in out):
        return None
    return torch.tensor(out, dtype=torch.int32)


@dataclass
class SpecStep:
    """What a speculative decode step (:meth:`Engine.decode_step` with ``speculate``) gives back:
    per request (batch order) the host copies of its one device-to-host read, and both rows'
    logits.

    ``tried``: its draft held a tentative slot (the runtime allowed the position after x_t).
    ``token``: the request's next token as the step chose it (a greedy row: row 0's argmax; a
    sampling row: the draft where accepted, else a sample of the residual, or of row 0's
    distribution where it did not try: :func:`verify_sampled_drafts`); ``finite``: whether row
    0's logits are finite. ``token2`` / ``finite2`` the same for row 1 (the token after the
    draft). ``accepted``: the step accepted the draft (a per-row device flag: greedy, ``token ==
    draft``, or its forced verdict; sampling, the speculative-sampling rule; both rows finite)
    and stored its K/V; only then is ``token2`` the request's."""

    logits: torch.Tensor  # [n, vocab] row 0
    draft_logits: torch.Tensor  # [n, vocab] row 1
    tried: list[bool]
    token: list[int]
    finite: list[bool]
    token2: list[int]
    finite2: list[bool]
    accepted: list[bool]


@dataclass
class _SpecState:
    """The last speculative step, until :meth:`Engine.commit_drafts`: the requests whose drafts
    it accepted and stored."""

    stored: set[int]


@dataclass
class _StepGraph:
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
    def new(eng: Engine, key: tuple, arena_len: int, layout: dict) -> _StepGraph:
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
        return _StepGraph(
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


def _before_gathers(src, plans: list) -> list[bool]:
    """``src.before_gathers`` over the engine's kept plans ``(layer, plan_slots, plan_blocks,
    slot_pages, host_csr)``: per plan, whether its gather's inputs changed."""
    return src.before_gathers([(layer, ps, pb, *csr) for layer, ps, pb, _, csr in plans])


class Engine:
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
        background_streams: int = 2,
    ) -> None:
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
        self.host_pool = host_pool
        self.model = model
        # A model whose forward takes kv_groups (CausalLM) hands a decode step's K/V grouped by
        # row (each request's token row, then each lookahead row: contiguous for the append and
        # the attention's extra row), written so by the QKV prologue kernel; any other model's
        # K/V is regrouped here with one copy per tensor.
        self._kv_grouped = "kv_groups" in inspect.signature(model.forward).parameters
        self.cfg = model.config
        self.kv = kv
        self.backend = backend
        self.drafter = drafter
        self.eos = set(eos_token_ids)
        c = self.cfg
        self.geo = ops.KvGeometry(c.num_attention_heads, c.num_key_value_heads, c.head_dim, kv.block_size)
        self.dtype = kv.kv_dtype or next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.rows = 2 if (drafter is not None and drafter.uses_lookahead_row) else 1
        # KvConfig's "auto" confidence fallback: on where the drafter reports its probability.
        kv = self.kv = kv.resolve(reports_confidence=self.rows == 2 and hasattr(drafter, "track_confidence"))
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
            if self.rows != 2 or not hasattr(drafter, "track_confidence"):
                raise ConfigError(
                    "KvConfig(lookahead_min_confidence=...) needs a drafter with a lookahead row that "
                    f"reports its probability (eagle3), got {getattr(drafter, 'name', drafter)!r}; "
                    "drop lookahead_min_confidence or use the eagle3 drafter"
                )
            drafter.track_confidence = True
            self._own_q = torch.zeros(int(max_num_seqs) + 1, dtype=torch.bool, device=self.device)
        self.capture = tuple(drafter.capture_layers(c.num_hidden_layers)) if drafter is not None else ()
        # Hand the features of every prompt position to the drafter at prefill (Drafter.feed_prompt).
        self.prompt_features = bool(self.capture) and bool(getattr(drafter, "wants_prompt_features", False))
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
        # The background chain (score -> select -> gather) runs on streams of its own on a GPU;
        # the attention of layer l waits only for layer l's transfer event of the previous step.
        # Layer l's chain goes to stream l % background_streams: the layers' chains are
        # independent, and at small batches each is a string of tiny latency-bound kernels
        # longer than the layer's own compute, so one stream would serialise them all.
        if not isinstance(background_streams, int) or not 1 <= background_streams <= 8:
            raise ConfigError(f"background_streams must be an int in 1..8, got {background_streams!r}")
        self.cuda = self.device.type == "cuda"
        self._sides = [torch.cuda.Stream(self.device) for _ in range(background_streams)] if self.cuda else []
        # The stream steps are captured on. torch instantiates graphs with per-node priorities,
        # copied from the stream at capture, so this (not the replay stream) sets the compute
        # nodes' priority against the background streams'. Same priority as theirs: a high one
        # measured 0.91x the step time at 20 x 32K but 1.11-1.25x at 32-40 x 16K (docs/PERF.md).
        self._capture_stream = torch.cuda.Stream(self.device, priority=0) if self.cuda else None
        self._gather_done: list = [None] * c.num_hidden_layers
        # The compute stream's waits on the background streams, timed on the device (ops.wait_stamp:
        # start, total ns, waits); read by transfer_wait().
        self._wait_stamps = torch.zeros(3, dtype=torch.int64, device=self.device) if self.cuda else None
        # The step plan: persistent buffers (pinned host + device on a GPU, double-buffered so a
        # step's copy never overwrites tables an earlier step's kernels may still read).
        self._plan_bufs: list = []
        self._plan_evt: list = [None, None]
        self._plan_flip = 0
        # Per-request accumulators kept on the device (no host sync per step), one row per
        # runtime slot (reset when a request is admitted there).
        # One row more than slots: the padded entries of a captured step add into that row.
        acc_rows = self.max_num_seqs + 1
        self._acc_fetched = torch.zeros(acc_rows, dtype=torch.long, device=self.device)
        self._acc_recall = torch.zeros(acc_rows, dtype=torch.float32, device=self.device)
        self._acc_recall_n = torch.zeros(acc_rows, dtype=torch.float32, device=self.device)
        # Each slot's latest prediction per layer (see _pred_of), made on first use.
        self._pred: list[torch.Tensor | None] = [None] * c.num_hidden_layers
        # Each slot's pinned blocks per layer (KvConfig.pin_blocks; see _pins_of), made on first use.
        self._pins: list[torch.Tensor | None] = [None] * c.num_hidden_layers
        # With a recorder and KvConfig.sticky_candidates: the blocks each slot's latest prediction
        # kept as candidates (the prediction before it), per layer, so that the next recall can also
        # rank the true query with the same kept blocks (the selection's own exact choice).
        self._kept: list[torch.Tensor | None] = [None] * c.num_hidden_layers
        # Optional measurement hook (None on the normal path): ``recorder.on_recall(engine, layer,
        # sp_reqs, actual, prev, slot_pages, q_now)`` is called from ``_select`` wherever recall is
        # measured, before this step's selection changes the mapping; with sticky candidates and a
        # recorder whose ``kept_reference`` is true, also ``actual_kept=``: the true query's top-K
        # with the blocks the prediction kept as candidates (what the selection itself would have
        # chosen knowing the query; one more top-K per layer, so a recorder opts in).
        # ``oasiskv.eval`` uses it for per-layer, per-step lookahead accuracy. On a GPU it runs on
        # the background stream: it must not sync, except an evaluation recorder that accepts the
        # stall (the attention-mass sample).
        self.recorder = None
        self._recall_now = self._store_pred = bool(kv.measure_recall)  # set per step (_recall_phase)
        # Whether this step's sampling rows cut at top_p < 1 (set per step; a graph key element):
        # without a cut the verification skips sorting the vocabulary.
        self._nucleus_now = False
        # The last speculative step (_SpecState) until commit_drafts; see decode_step(speculate=...).
        self._spec = None
        #: Speculative steps of a ``cuda_graph`` engine on a GPU that ran eagerly (a selection
        #: policy, a recorder). Sampling requests do not count: their acceptance rule runs inside
        #: the step (:func:`verify_sampled_drafts`), captured like the greedy one.
        self.spec_eager_steps = 0
        #: Replay decode steps as CUDA graphs (:meth:`decode_step`); ignored on the CPU.
        if not isinstance(cuda_graph, bool):
            raise ConfigError(f"cuda_graph must be True or False, got {cuda_graph!r}")
        self.cuda_graph = cuda_graph
        self._graphs: dict[tuple, _StepGraph] = {}
        self._graph_pool = None
        #: Captured decode steps so far, replays of them, and decode steps run eagerly.
        self.graph_stats = {"captures": 0, "replays": 0, "eager": 0}
        #: Why capturing failed (graphs are off since), else None.
        self.graph_error: str | None = None
        # The step number a captured step's selection reads on the device (set before each replay).
        self._step_now = torch.zeros(1, dtype=torch.int32, device=self.device) if self.cuda else None
        #: The selection policy (:mod:`oasiskv.policy`): None runs the engine as it is.
        self.policy = policy
        if policy is not None:
            policy.bind(self)
        #: Disaggregated decode (:class:`oasiskv.disagg.RemoteKvSource`, None otherwise):
        #: ``block_source.before_gather(layer, plan_slots, plan_blocks, host_indptr, host_indices)``
        #: runs between each layer's delta selection and its gather and fills the host pool with
        #: planned blocks still held by the staging daemon; ``before_gathers`` does it for a
        #: step's layers at once (deferred and CUDA-graph steps).
        self.block_source = None
        # The eager step's deferred (fetch, gather) of each layer while a block_source is set
        # (_run_step, _select_and_fetch); None outside such a step.
        self._deferred: list | None = None
        # A CUDA-graph step's kept plans per layer while a block_source is set (_run_step,
        # _fix_up_gathers); None outside such a step.
        self._plans: list | None = None
        #: KV-head replication under tensor parallelism (:mod:`oasiskv.models.tp`): the model
        #: shard's ``score_reduce`` sums each block's partial score ``[nnz, num_kv_heads]`` (this
        #: rank's query heads of the KV head) over the ranks sharing the head, before every top-K,
        #: so that they select the same blocks; None otherwise.
        self.score_reduce = getattr(model, "score_reduce", None)

    # ---------------------------------------------------------------- pools
    @property
    def page_bytes_all_layers(self) -> int:
        """Bytes of one page (or host block), K and V, every layer."""
        g = self.geo
        per_layer = 2 * g.num_kv_heads * g.block_size * g.head_dim * self.dtype.itemsize
        return per_layer * self.cfg.num_hidden_layers

    def default_caps(self) -> tuple[int, int]:
        """The pools' caps in blocks: ``KvConfig.num_gpu_pages`` / ``num_host_blocks`` when set
        (then the pools are that size from the start), else the constructor's budgets, else 40 % of
        the free memory of the model's device (pages) and of the host (host blocks; 0 for the
        dense backend) -- on a CPU-only machine both from the same RAM. With ``host_pool="device"``
        the host blocks share the device with the pages: 40 % of its free memory past the pages'
        cap. Never past 2**31 - 1."""
        kv, per = self.kv, self.page_bytes_all_layers
        gpu, host = (None if b is None else b // per for b in self._budgets)
        if kv.num_gpu_pages is not None:
            gpu = kv.num_gpu_pages
        if kv.num_host_blocks is not None:
            host = kv.num_host_blocks
        elif kv.num_gpu_pages is not None and host is None:
            host = kv.num_gpu_pages
        if gpu is None:
            free = available_bytes(self.device)
            gpu = int(0.4 * free) // per if free is not None else 1 << 20
        if host is None and self.backend != "oasis":
            host = 0
        elif host is None:
            on_device = self.host_pool == "device"
            free = available_bytes(self.device if on_device else "cpu")
            if free is not None and on_device:
                free = max(0, free - int(gpu) * per)
            host = int(0.4 * free) // per if free is not None else 1 << 20
        cap = MAX_POOL_BLOCKS
        return max(0, min(int(gpu), cap)), max(0, min(int(host), cap))

    def _new_runtime(self, pages: int, host: int, rows: int) -> None:
        from ._core import Runtime

        gcap, hcap = self.default_caps()
        gcap, hcap = max(gcap, pages), max(hcap, rows)
        kv = self.kv
        self.runtime = Runtime(
            block_size=kv.block_size,
            top_k_blocks=kv.top_k_blocks,
            sparse_threshold=kv.threshold_tokens,
            sparse=self.backend == "oasis",
            rows=self.rows,
            measure_recall=bool(kv.measure_recall),
            plan_blk_seq=kv.select_queries == "lookahead+current",
            max_num_seqs=self.max_num_seqs,
            gpu_pages=pages,
            host_blocks=min(host, rows),
            gpu_cap=gcap,
            host_cap=hcap,
        )
        # The host cap bounds the rows; ids (summaries) grow with the reservations.
        self.runtime.grow(pages, host, rows)
        self._runtime_pools = self.pools

    def _sync_runtime(self) -> None:
        """Create the runtime and pools on first use; follow pools swapped in from outside (the
        evaluation shares one set of pools between engines) while no request is running."""
        if self.pools is None:
            kv = self.kv
            pages = kv.num_gpu_pages or 0
            host = kv.num_host_blocks or kv.num_gpu_pages or 0
            self.pools = KvPools(
                self.geo,
                self.cfg.num_hidden_layers,
                self.dtype,
                pages,
                host,
                self.device,
                self.key_codes,
                host_pool=self.host_pool,
            )
        if self.key_codes:
            self.pools.enable_key_codes()
        if self.runtime is None or self._runtime_pools is not self.pools:
            if self.runtime is not None and self.runtime.num_requests:
                raise ConfigError("the engine's pools were replaced while requests are running")
            p = self.pools
            self._new_runtime(p.num_pages, p.num_host_blocks, p.num_host_rows)

    def _grow_to(self, pages: int, host: int, rows: int | None = None) -> None:
        """Grow the pool tensors and the runtime's id ranges to at least these sizes (pages, host
        block ids, host rows; None: as many rows as ids), geometrically (to at most the caps) so
        that a stream of admissions reallocates O(log n) times."""
        p, rt = self.pools, self.runtime
        rows = host if rows is None else rows
        if pages <= p.num_pages and host <= p.num_host_blocks and rows <= p.num_host_rows:
            return
        gcap, icap, hcap = rt.caps
        if pages > p.num_pages:
            pages = min(gcap, max(pages, 2 * p.num_pages))
        if host > p.num_host_blocks:
            host = min(icap, max(host, 2 * p.num_host_blocks))
        if rows > p.num_host_rows:
            rows = min(hcap, max(rows, 2 * p.num_host_rows))
        self._join_background()
        self.drop_graphs()  # they hold the old pools' addresses
        p.grow(pages, host, rows)
        rt.grow(p.num_pages, p.num_host_blocks, p.num_host_rows)

    def ensure_pools(self, requests: list[_Request]) -> None:
        """Make room for admitting ``requests`` together (grow the pools to their reservations)."""
        self.reserve_pools([(len(r.prompt), r.max_new_tokens) for r in requests])

    def reserve_pools(self, sizes: list[tuple[int, int]]) -> None:
        """Grow the pools now (up to the caps) so that requests of these ``(prompt_len,
        max_new_tokens)`` fit beside the running ones: one allocation instead of several as a
        batch is admitted."""
        self._sync_runtime()
        rt = self.runtime
        g, h, w = rt.reserved
        for n, m in sizes:
            rg, rh, _ = rt.reservation(n, m)  # a local request: a host row with every id
            g, h, w = g + rg, h + rh, w + rh
        gcap, _, hcap = rt.caps
        self._grow_to(min(g, gcap), h, min(w, hcap))

    # ---------------------------------------------------------------- request lifecycle
    def can_admit(
        self, prompt_len: int, max_new_tokens: int, *, sparse: bool = False, cache_blocks: int | None = None
    ) -> bool:
        """Whether a request of this size can be admitted now (a seat, and its peak need in both
        tiers fits beside the running requests' reservations). ``sparse=True``: admitted with
        :meth:`admit_sparse` (the working set only on the GPU; ``cache_blocks`` as there)."""
        self._sync_runtime()
        return self.runtime.can_admit(prompt_len, max_new_tokens, sparse=sparse, cache_blocks=cache_blocks)

    def check_fits(
        self, prompt_len: int, max_new_tokens: int, *, sparse: bool = False, cache_blocks: int | None = None
    ) -> None:
        """Raise :class:`OutOfBlocksError` when a request of this size could never be admitted,
        even alone: its peak need passes a pool's cap (``sparse``, ``cache_blocks``: as
        :meth:`can_admit`)."""
        self._sync_runtime()
        rt = self.runtime
        if rt.fits_ever(prompt_len, max_new_tokens, sparse=sparse, cache_blocks=cache_blocks):
            return
        g, h, _ = rt.reservation(prompt_len, max_new_tokens, sparse=sparse, cache_blocks=cache_blocks)
        gcap, _, hcap = rt.caps
        per = self.page_bytes_all_layers
        raise OutOfBlocksError(
            f"a request of {prompt_len} prompt tokens and max_tokens={max_new_tokens} needs up to "
            f"{g} GPU pages and {h} host blocks ({g * per} / {h * per} bytes) but the caps are "
            f"{gcap} / {hcap}; raise gpu_kv_budget_bytes / host_kv_budget_bytes (or KvConfig."
            "num_gpu_pages / num_host_blocks), lower max_tokens, or lower sparse_threshold so the "
            "request turns sparse sooner"
        )

    def admit(self, r: _Request) -> None:
        """Reserve ``r``'s peak need, take its accumulator slot and the prompt's pages."""
        self._sync_runtime()
        rt = self.runtime
        n, m = len(r.prompt), r.max_new_tokens
        self._grow_to(*rt.pool_sizes_needed(n, m))
        try:
            slot, _pages = rt.admit(r.id, n, m)
        except OutOfBlocksError as e:
            raise OutOfBlocksError(
                f"{e} while admitting request {r.id}; wait for running requests to finish "
                "(LLMEngine does), raise the pool budgets, or submit fewer requests at once"
            ) from None
        self._seat(r, slot, False)

    def admit_sparse(self, r: _Request, cache_blocks: int | None = None) -> dict:
        """Admit ``r``, whose prompt's KV is stored elsewhere (a staging daemon), directly sparse:
        reserve and take only its working set (K slot pages, the local page) and the prompt's host
        blocks, never the prompt's dense pages. Returns ``Runtime.admit_sparse``'s dict (the slot
        pages, local page, host block ids and rows, their lens and ``n_complete``); the caller
        fills the host rows, summaries and local page and selects the initial working set.
        ``cache_blocks=C``: host rows only for the blocks it writes plus ``C`` cache rows
        (``Runtime.cache_blocks`` hands them out)."""
        self._sync_runtime()
        rt = self.runtime
        n, m = len(r.prompt), r.max_new_tokens
        self._grow_to(*rt.pool_sizes_needed(n, m, sparse=True, cache_blocks=cache_blocks))
        try:
            tr = rt.admit_sparse(r.id, n, m, cache_blocks)
        except OutOfBlocksError as e:
            raise OutOfBlocksError(
                f"{e} while admitting request {r.id}; wait for running requests to finish "
                "(LLMEngine does), raise the pool budgets, or submit fewer requests at once"
            ) from None
        self._seat(r, tr["slot"], True)
        return tr

    def _seat(self, r: _Request, slot: int, sparse: bool) -> None:
        """``r`` was admitted at accumulator ``slot``: reset the slot, apply the new mapping."""
        r.slot, r.sparse, r.runtime = slot, sparse, self.runtime
        self._acc_fetched[slot] = 0
        self._acc_recall[slot] = 0
        self._acc_recall_n[slot] = 0
        for pins in self._pins:  # a previous occupant's pins (the initial selection sets new ones)
            if pins is not None:
                pins[slot] = -1
        self._flush_map()

    def transfer_wait(self) -> tuple[float, int]:
        """``(seconds, waits)``: how long the compute stream has waited on background work (the
        selection chain and its transfers) since the engine was made, and how many waits: at each
        layer's transfer event in eager steps, at the end-of-step join in CUDA-graph steps. Each
        wait includes a kernel launch gap (about a microsecond). ``(0.0, 0)`` on the CPU, where
        the chain runs inline. Reads device counters: synchronises with the current stream."""
        if self._wait_stamps is None:
            return 0.0, 0
        _, total_ns, waits = self._wait_stamps.tolist()
        return total_ns / 1e9, int(waits)

    def _side(self, layer: int):
        """The background stream of ``layer``'s chain."""
        return self._sides[layer % len(self._sides)]

    def _join_background(self) -> None:
        """Make the compute stream wait for all background work (before pages change owners)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for side in self._sides:
                cur.wait_stream(side)

    def release(self, r: _Request) -> None:
        """Return everything ``r`` holds to the pools (safe to call twice)."""
        if r.runtime is not None and r.runtime is self.runtime:
            self._join_background()
            self.runtime.release(r.id)
        r.runtime = None
        if self.drafter is not None:
            self.drafter.end(r.id)

    def _flush_map(self) -> None:
        """Apply the runtime's pending head-wise mapping updates on the device, every layer."""
        pages, values = self.runtime.take_map_updates()
        if pages:
            idx = torch.tensor(pages, dtype=torch.long).to(self.device, non_blocking=True)
            self._apply_map(idx, _i32(values, self.device))

    def _apply_map(self, pages: torch.Tensor, values: torch.Tensor) -> None:
        """``page_map[:, pages, :] = values`` in every layer (and those pages' last-selected
        steps reset): device tensors, long page ids and int32 logical blocks."""
        p = self.pools
        p.page_map[:, pages, :] = values.view(1, -1, 1)
        p.page_last_selected[:, pages, :] = -1

    def _sparse_plan(self, v: dict, reqs: list[_Request]) -> _SparsePlan:
        """The selection tables of a step, from the plan's views ``v``."""
        kv = self.kv
        both = self.rows == 2 and kv.select_queries == "lookahead+current"
        plan = _SparsePlan.from_views(v, reqs, kv.top_k_blocks, self._recall_now, both, kv.layer_blocks)
        if self._own_q is not None:
            plan.own = self._own_q[plan.ids]  # read in the step (a captured one gathers at replay)
        return plan

    # ---------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, r: _Request) -> torch.Tensor:
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
            self.admit(r)
        try:
            return self._prefill(r)
        except BaseException:
            self.release(r)
            raise

    def _prefill(self, r: _Request) -> torch.Tensor:
        from .models.transformer import causal_attention

        p = self.pools
        self._join_background()
        n = len(r.prompt)
        scale = self.geo.head_dim**-0.5
        d = self.geo.head_dim
        layers = self.cfg.num_hidden_layers
        self._last_row = {r.id: 0}
        rows = self._kv_rows(r, n)

        def store(layer, k, v):
            # One row copy per tensor straight into the pages: no padded or transposed copy.
            p.k_pages[layer].view(-1, d).index_copy_(0, rows, k.to(self.dtype).reshape(-1, d))
            p.v_pages[layer].view(-1, d).index_copy_(0, rows, v.to(self.dtype).reshape(-1, d))

        cache = self.prefill_cache
        key = (id(getattr(self.model, "prefill_model", self.model)), self.dtype, tuple(r.prompt))
        hit = cache.get(key, self.capture) if cache is not None else None
        if cache is not None and self.prefill_agree is not None and not self.prefill_agree(hit is not None):
            hit = None  # another rank missed: every rank runs the forward
        if hit is not None:
            for layer in range(layers):
                store(layer, hit.k[layer], hit.v[layer])
                self._last_q[layer] = hit.last_q[layer]
            self._take_features(r, hit.features if self.capture else None)
            return hit.logits

        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []

        def attn(layer, q, k, v):
            o = causal_attention(q, k, v, scale)
            store(layer, k, v)
            if cache is not None:
                ks.append(k.to(self.dtype))
                vs.append(v.to(self.dtype))
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
            cache.put(key, _Prefilled(ks, vs, list(self._last_q), logits[0], feats, self.capture))
        self._take_features(r, feats)
        return logits[0]

    @torch.no_grad()
    def prefill_chunk(self, r: _Request, start: int, end: int) -> torch.Tensor | None:
        """Prefill prompt positions ``start .. end - 1`` (chunked prefill): the chunk's queries
        attend to the prompt's KV stored by earlier chunks (read back from its pages) and to the
        chunk itself, causally; the chunk's KV goes to its pages. Chunks must come in order and
        cover the prompt. Returns the last prompt position's logits after the final chunk, else
        None. The first chunk admits ``r`` (:meth:`admit`); a failure releases it. A chunk that is
        the whole prompt is :meth:`prefill` (which may use the :class:`PrefillCache`)."""
        n = len(r.prompt)
        if not 0 <= start < end <= n:
            raise ConfigError(f"prefill_chunk({start}, {end}) is not a chunk of a {n}-token prompt")
        if start == 0 and end == n:
            return self.prefill(r)
        if start == 0 and r.runtime is None:
            self.admit(r)
        try:
            return self._prefill_chunk(r, start, end)
        except BaseException:
            self.release(r)
            raise

    def _prefill_chunk(self, r: _Request, start: int, end: int) -> torch.Tensor | None:
        from .models.transformer import causal_attention

        p, dev = self.pools, self.device
        self._join_background()
        n = len(r.prompt)
        hk, d = self.geo.num_kv_heads, self.geo.head_dim
        scale = d**-0.5
        pos = torch.arange(start, end, device=dev)
        final = end == n
        rows = self._kv_rows(r, end)  # positions 0 .. end - 1
        new_rows = rows[start * hk :]

        def attn(layer, q, k, v):
            # Store the chunk first, then read positions 0 .. end - 1 back with ONE gather per
            # tensor into a contiguous [end, Hkv, D] buffer (the prefix's pages are read once per
            # layer; earlier this took a page gather, a transposing copy and a concatenation).
            # NOTE: the prefix is still copied once per layer and chunk, O(layers * n**2 / chunk)
            # bytes over a prompt; a paged prefill attention kernel would read the pages in place.
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

        ids = torch.tensor(r.prompt[start:end], dtype=torch.long, device=dev)
        last = torch.tensor([end - start - 1], device=dev)
        logits, captured = self.model.forward(ids, pos, attn, logits_rows=last, capture_layers=self.capture)
        if self.capture:
            rows = slice(None) if self.prompt_features else slice(-1, None)
            feats = torch.cat([captured[i][rows] for i in self.capture], dim=-1)
            if self.prompt_features:
                self.drafter.feed_prompt(r.id, r.prompt, feats, start)
            if final:
                r.features = feats[-1].clone()
        if final:
            self._last_row = {r.id: 0}
            return logits[0]
        return None

    def _kv_rows(self, r: _Request, end: int) -> torch.Tensor:
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

    def _take_features(self, r: _Request, feats: torch.Tensor | None) -> None:
        """``r.features`` := the last prompt position's features; a drafter that wants them gets
        every position's (``feats`` [n, width], or None when nothing is captured)."""
        if feats is None:
            r.features = None
            return
        # A copy, not a view: the [n, width] block is not kept alive until the first decode step.
        r.features = feats[-1].clone()
        if self.prompt_features:
            self.drafter.feed_prompt(r.id, r.prompt, feats, 0)

    # ---------------------------------------------------------------- dense -> sparse
    @torch.no_grad()
    def make_sparse(self, r: _Request) -> None:
        """Move the request's KV to the host pool and keep only the budget on the GPU.

        The initial working set is the top-K of the latest lookahead query of every layer (the
        last prompt token's query right after prefill), filled without the fetch cap.
        """
        p, g, kv = self.pools, self.geo, self.kv
        self._join_background()
        dev = self.device
        tr = self.runtime.make_sparse(r.id)
        self._flush_map()
        src, dst, lens = _i32(tr["src_pages"], dev), _i32(tr["host_blocks"], dev), _i32(tr["lens"], dev)
        rows = _i32(tr["host_rows"], dev)
        complete, complete_src = dst[: tr["n_complete"]], src[: tr["n_complete"]]
        for layer in range(self.cfg.num_hidden_layers):
            # Pages into host rows; summaries (and codes) of the block ids from the same keys, read
            # from the GPU pages (the host rows hold copies of them): HBM, not PCIe reads.
            ops.copy_pages(g, p.k_pages[layer], p.v_pages[layer], src, p.host_k[layer], p.host_v[layer], rows)
            ops.build_summaries(g, p.k_pages[layer], dst, lens, p.summaries[layer], block_rows=src)
            if self.key_codes and complete.numel():
                ops.build_key_codes(
                    g, p.k_pages[layer], p.summaries[layer], complete, p.codes[layer], block_rows=complete_src
                )
        r.sparse = True
        r.metrics.sparse_since_token = r.kv_len
        n_complete = tr["n_complete"]
        slot_pages = _i32([tr["slot_pages"]], dev)
        blk_indptr, blk_indices = csr_tables([tr["host_blocks"][:n_complete]], dev)
        host_indptr, host_indices = csr_tables([tr["host_rows"]], dev)
        for layer in range(self.cfg.num_hidden_layers):
            row = self._last_row[r.id]
            q = self._last_q[layer][row : row + 1].reshape(1, g.num_qo_heads, g.head_dim).contiguous()
            k_budget = kv.layer_budget(layer)
            pred, _ = self._select_and_fetch(
                layer,
                q,
                slot_pages[:, :k_budget].contiguous(),
                (blk_indptr, blk_indices),
                (host_indptr, host_indices),
                self.step_no,
                k_budget,
                k_budget,
                initial=True,
            )
            self._initial_selection(layer, r.slot, pred[0])

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
        return views, n_sparse, max_pages

    @torch.no_grad()
    def decode_step(
        self,
        reqs: list[_Request],
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
        (``_Request.draft_features``); :meth:`commit_drafts` must follow, and advances the tables
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
            samp = _sampling_inputs(sampling)
            forced = _verdict_inputs(verdicts, sampling, n)
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
        reads = src is not None and not getattr(src, "idle", False)
        # A source that fixes up graph steps (_fix_up_gathers) keeps the graphs.
        reads_eagerly = reads and not getattr(src, "fixes_up_graph_steps", False)
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

    def _spec_result(self, reqs, logits, out: dict, launch=None) -> SpecStep:
        """Adopt a speculative step's outputs (``out`` of :meth:`_run_step`, or copies of a
        graph's): the one host read of its verdict, row 1's features, the state
        :meth:`commit_drafts` needs."""
        n = len(reqs)
        verdict, targets = out["verdict"], out["targets"]
        # The step's only device-to-host copy: both rows' tokens and finiteness, the accept flags,
        # and which rows held a tentative slot.
        both = torch.cat([verdict[:, :n], (targets[0][:n] >= 0).long().unsqueeze(0)])
        if launch is None:
            host = both.tolist()
        else:
            # Queued before the launched work, so the read waits for the step alone.
            host_t, ready = copy_to_host(both)
            launch()
            if ready is not None:
                ready.synchronize()
            host = host_t.tolist()
        tok, fin, tok2, fin2, acc, tried = host
        if out["feats1"] is not None:
            for i, r in enumerate(reqs):
                r.draft_features = out["feats1"][i]
        self._spec = _SpecState(stored={r.id for i, r in enumerate(reqs) if acc[i]})
        return SpecStep(
            logits=logits,
            draft_logits=out["logits1"][:n],
            tried=[bool(x) for x in tried],
            token=tok,
            finite=[bool(x) for x in fin],
            token2=tok2,
            finite2=[bool(x) for x in fin2],
            accepted=[bool(x) for x in acc],
        )

    def _decode_eager(
        self,
        reqs: list[_Request],
        ids: list[int],
        speculate: list[bool] | None = None,
        samp: torch.Tensor | None = None,
        verdicts: torch.Tensor | None = None,
    ):
        """One step launched kernel by kernel: ``(logits, features, speculative outputs)``;
        ``samp``: the sampling inputs (:func:`_sampling_inputs`, on the host), or None;
        ``verdicts``: the forced verdicts (:func:`_verdict_inputs`, on the host), or None."""
        n = len(reqs)
        # ---- plan (Rust, once per step): every table of every layer in one arena, one copy
        v, n_sparse, max_pages = self._plan([r.id for r in reqs], ids, speculate)
        if v["map_pages"].numel():
            self._apply_map(v["map_pages"].long(), v["map_values"])
        # The split of long contexts, planned once for all layers (the GPU kernel's).
        num_splits = 0
        if self.cuda:
            num_splits = _core.plan_num_splits(ops._num_sms(self.device), n, self.geo.num_kv_heads, max_pages)
        plan = self._sparse_plan(v, reqs) if n_sparse else None
        if plan is not None and self.cuda:
            for side in self._sides:
                plan.keep_for(side)
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

    def _run_step(
        self,
        v: dict,
        n: int,
        plan: _SparsePlan | None,
        done_blocks: torch.Tensor | None,
        max_pages: int,
        num_splits: int,
        draft_logits: bool = False,
        *,
        reqs: list[_Request] | None = None,
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
        p, g, kv = self.pools, self.geo, self.kv
        rows = self.rows
        hq, hk, d = g.num_qo_heads, g.num_kv_heads, g.head_dim
        dev = self.device
        page_ids_t, offsets_t, host_ids_t = v["page_ids"], v["offsets"], v["host_ids"]
        host_rows_t, done_pages = v["host_rows"], v["done_pages"]
        kv_indptr, kv_indices, last_len_t = v["kv_indptr"], v["kv_indices"], v["last_len"]
        step = self._step_now if static else self.step_no
        scale = d**-0.5
        last_q: list = [None] * self.cfg.num_hidden_layers
        keep: list = []  # static: what the background streams read, alive until the step is over
        kv_grouped = self._kv_grouped and rows > 1  # the model hands k, v grouped by row
        forked: set = set()  # the background streams this step forked
        # Speculative decoding: each layer's row-1 K/V ([n, num_kv_heads, head_dim] each), kept on
        # the device for the draft stores (no copy beyond the one the attention takes anyway).
        spec_kv: list | None = [None] * self.cfg.num_hidden_layers if draft_logits else None

        def attn(layer, q, k, v):
            out_dtype = q.dtype
            if self.cuda and not static and self._gather_done[layer] is not None:
                # The one place the compute stream waits: layer l's transfer of the previous step.
                ops.wait_stamp(self._wait_stamps, 0)
                torch.cuda.current_stream(dev).wait_event(self._gather_done[layer])
                ops.wait_stamp(self._wait_stamps, 1)
            q4 = q.view(n, rows, hq, d).to(self.dtype).contiguous()
            # Row-major by row: kt[0] (x_t's K) and kt[1] (the draft's) are contiguous views.
            if kv_grouped:  # as the model's prologue kernel wrote them: no copy
                kt = k.view(rows, n, hk, d).to(self.dtype)
                vt = v.view(rows, n, hk, d).to(self.dtype)
            else:
                kt = k.view(n, rows, hk, d).to(self.dtype).transpose(0, 1).contiguous()
                vt = v.view(n, rows, hk, d).to(self.dtype).transpose(0, 1).contiguous()
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
            )
            if done_blocks is not None:
                # Blocks x_t completed: their summaries are final, so their keys get codes now,
                # before this layer's selection scores them; read from the local pages x_t just
                # filled (HBM; the host rows hold the same keys).
                ops.build_key_codes(
                    g,
                    p.k_pages[layer],
                    p.summaries[layer],
                    done_blocks,
                    p.codes[layer],
                    block_rows=done_pages,
                )
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
            )
            last_q[layer] = q4[:, rows - 1]
            if plan is not None:
                k_budget = kv.layer_budget(layer)
                args = (layer, q4, plan, step, kv.cap_blocks_for(k_budget), k_budget)
                if self.cuda:
                    attn_done = torch.cuda.Event()
                    attn_done.record()
                    side = self._side(layer)
                    forked.add(side)
                    with torch.cuda.stream(side):
                        side.wait_event(attn_done)  # selection reads q, gather overwrites slots
                        if static:
                            keep.append(self._select(*args))  # q4 among them
                        else:
                            q4.record_stream(side)
                            self._select(*args)
                            done = torch.cuda.Event()
                            done.record(side)
                            self._gather_done[layer] = done
                else:
                    self._select(*args)
            return o.view(n * rows, hq, d).to(out_dtype)

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
        defer = self.block_source is not None and plan is not None and not static
        self._deferred = [] if defer else None
        # A static (CUDA-graph) step with a block source: the gathers run as planned and each
        # layer's plan is kept for the host to fix up after the step (_fix_up_gathers).
        self._plans = [] if self.block_source is not None and plan is not None and static else None
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
        return out

    def _verify_drafts(
        self,
        v: dict,
        n: int,
        logits: torch.Tensor,
        logits1: torch.Tensor,
        spec_kv: list,
        samp: torch.Tensor | None,
        verdicts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Verification inside the step, on the device (no host branch, graph safe): a row
        verifies its draft when it holds a tentative slot (``spec_page_ids >= 0``) and row 0's
        logits are finite. A greedy row takes the draft when it is row 0's argmax; a sampling row
        (temperature > 0 in ``samp``) by the speculative-sampling rule
        (:func:`verify_sampled_drafts`), which also samples its tokens. A taken draft is accepted
        when row 1's logits are finite too: its K/V (``spec_kv``, row 1 of every layer) is stored
        into its slot; every other row's page is masked to -1, which ``append_kv`` skips entirely
        (no page, host row or summary touched). Returns ``[5, n]`` int64: row 0's token (argmax,
        or sampled), its finiteness, row 1's token, its finiteness, the accept flag. Without
        ``samp`` (every row greedy) none of the sampling kernels run.

        ``verdicts`` (``[>= n]`` int32 on the device, or None; measurement only): a greedy row's
        forced verdict replaces the argmax test. :data:`VERDICT_ACCEPT` takes the draft as if row
        0's argmax were the draft (its token is the draft; accepted and stored when row 1 is
        finite, exactly as a genuine acceptance), :data:`VERDICT_REJECT` rejects it (its token
        stays the argmax, even where that is the draft), :data:`VERDICT_NONE` verifies as above.
        Elementwise selects on device values: no branch, no host read, nothing baked into a
        graph."""
        tok = logits.argmax(dim=-1)
        tok2 = logits1.argmax(dim=-1)
        fin = torch.isfinite(logits).all(dim=-1)
        fin2 = torch.isfinite(logits1).all(dim=-1)
        draft = v["input_ids"].view(n, 2)[:, 1]
        page = v["spec_page_ids"]
        match = tok == draft  # a greedy row takes its draft
        if verdicts is not None:
            f = verdicts[:n]
            match = torch.where(f == VERDICT_NONE, match, f == VERDICT_ACCEPT)
            tok = torch.where((f == VERDICT_ACCEPT) & (page >= 0) & fin, draft.long(), tok)
        if samp is None:
            accept = (page >= 0) & match & fin & fin2
        else:
            tried = (page >= 0) & fin
            first, taken, second = verify_sampled_drafts(
                logits, logits1, draft, tried, samp, nucleus=self._nucleus_now
            )
            greedy = samp[0, :n] <= 0
            taken = torch.where(greedy, tried & match, taken)
            tok = torch.where(greedy, tok, first)
            tok2 = torch.where(greedy, tok2, second)
            accept = taken & fin2
        self._store_drafts(
            spec_kv, page.masked_fill(~accept, -1), v["spec_offsets"], v["spec_host_ids"], v["spec_host_rows"]
        )
        return torch.stack([tok, fin.long(), tok2, fin2.long(), accept.long()])

    def _store_drafts(
        self,
        spec_kv: list,
        page_ids: torch.Tensor,
        offsets: torch.Tensor,
        host_ids: torch.Tensor,
        host_rows: torch.Tensor,
    ) -> None:
        """Store row 1's K/V of every layer where ``page_ids >= 0`` (one ``append_kv`` per layer:
        write-through to host row ``host_rows`` and summary update of block ``host_ids`` for
        sparse requests)."""
        p, g = self.pools, self.geo
        for layer, (k1, v1) in enumerate(spec_kv):
            ops.append_kv(
                g,
                k1,
                v1,
                page_ids,
                offsets,
                host_ids,
                p.k_pages[layer],
                p.v_pages[layer],
                p.host_k[layer],
                p.host_v[layer],
                p.summaries[layer],
                host_rows=host_rows,
            )

    # ---------------------------------------------------------------- CUDA-graph decode
    def _decode_graph(
        self,
        reqs: list[_Request],
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
        # Steps that measure recall, or keep predictions for it, are graphs of their own.
        key = (
            _bucket(n),
            _round_cap(pages),
            blk_cap,
            spec,
            self._recall_now,
            self._store_pred,
            0 if samp is None else 2 if self._nucleus_now else 1,
            verdicts is not None,
        )
        pad = (*key[:3], self.max_num_seqs)
        if spec:
            arena_len, layout, _n_sparse, _ = rt.plan(req_ids, ids, pad, speculate)
        else:
            arena_len, layout, _n_sparse, _ = rt.plan(req_ids, ids, pad)
        gr = self._graphs.pop(key, None)
        if gr is None:
            gr = _StepGraph.new(self, key, arena_len, layout)
            fresh = True
        else:
            fresh = False
        self._graphs[key] = gr  # most recently used last
        if gr.plan_evt is not None:
            gr.plan_evt.synchronize()  # the copy out of the pinned buffer a step ago is done
        rt.write_plan(gr.plan_host)
        self._join_background()
        self._flush_map()
        gr.plan_dev.copy_(gr.plan_host, non_blocking=True)
        if samp is not None:
            # Padded rows are greedy (and hold no draft slot).
            gr.samp_host[:] = torch.tensor(_GREEDY_ROW, dtype=torch.float64).unsqueeze(1)
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

    def _fix_up_gathers(self, plans: list) -> None:
        """After a graph step with a block source: each layer's plan goes to the source, which
        reads the planned block-heads the host pool lacked; where it read any, the layer is
        gathered again (on the current stream, after the graph and before the next step, whose
        attention reads those slots). The graph's own gather copied stale rows for them."""
        src = self.block_source
        if src is None or getattr(src, "idle", True):
            return
        changed = _before_gathers(src, plans)
        for (layer, ps, pb, slot_pages, host_csr), again in zip(plans, changed, strict=True):
            if again:
                self._gather(layer, ps, pb, slot_pages, host_csr)

    def drop_graphs(self) -> None:
        """Forget every captured step (the pools moved, or to free the graphs' memory)."""
        self._graphs.clear()
        # The last graph gone, torch frees the shared memory pool; capturing into its old handle
        # again trips the allocator's assert (use_count > 0), so the next capture takes a new one.
        self._graph_pool = None

    @torch.no_grad()
    def commit_drafts(self) -> None:
        """Resolve the last speculative :meth:`decode_step`: the drafts the step accepted (and
        stored) are kept, every other tentative slot goes back. So each request's tables advance
        by one or two tokens. A request released since the step (it stopped on its first token)
        has no slot left.

        Raises:
            ConfigError: without a speculative step first."""
        st = self._spec
        if st is None:
            raise ConfigError("commit_drafts needs a decode_step(speculate=...) first")
        pending = set(self.runtime.pending_drafts())
        self._spec = None
        self.runtime.commit_drafts([rid for rid in st.stored if rid in pending])

    def _select(
        self, layer: int, q4: torch.Tensor, plan: _SparsePlan, step, cap: int, k_budget: int
    ) -> tuple:
        """The background chain of one layer: score -> top-K -> delta selection -> gather.

        On a GPU this runs on the background stream; it never synchronises with the host. ``step``
        is an int, or the int32 device tensor a captured step reads. Returns the tensors it made
        (a captured step keeps them alive until the capture ends).
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
        q_next = q4[sp_idx, -1]
        if plan.own is not None:  # KvConfig.lookahead_min_confidence: unsure drafts select by row 0
            q_next = torch.where(plan.own.view(-1, 1, 1), q4[sp_idx, 0], q_next)
        pred, ps = self._select_and_fetch(
            layer,
            q_next.contiguous(),
            slot_pages,
            (plan.blk_indptr, plan.blk_indices),
            (plan.host_indptr, plan.host_indices),
            step,
            cap,
            k_budget,
            also=(q4[sp_idx, 0].contiguous(), plan.blk_seq) if both else None,
            slots=sp_ids,
        )
        self._acc_fetched.index_add_(0, sp_ids, (ps >= 0).sum(dim=(1, 2)))
        if self._store_pred:
            self._pred_of(layer)[sp_ids] = pred  # the next step's recall and sticky candidates read it
        return q4, pred, ps

    def _pred_of(self, layer: int) -> torch.Tensor:
        """Each slot's latest prediction of ``layer``, ``[max_num_seqs, num_kv_heads, K]`` logical
        blocks (-1 padded; K the layer's budget), on the device: one gather and one scatter per
        layer and step instead of a tensor per request."""
        if self._pred[layer] is None:
            shape = (self.max_num_seqs + 1, self.geo.num_kv_heads, self.kv.layer_budget(layer))
            self._pred[layer] = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        return self._pred[layer]

    def _wants_kept(self) -> bool:
        """Whether the recorder asked for the recall's kept reference (``kept_reference``)."""
        return self.recorder is not None and bool(getattr(self.recorder, "kept_reference", False))

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
        (host block ids of each request's logical blocks), on ``layer``'s summaries (summed over
        the KV heads' replicas with :attr:`score_reduce`). One stage: every block is scored,
        whatever ``KvConfig.score_candidates`` says. A public seam for evaluation; the engine
        ranks through :meth:`top_k_blocks`."""
        p = self.pools
        if self.key_codes:
            scores = ops.score_blocks_codes(self.geo, q, p.summaries[layer], p.codes[layer], *csr)
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
            p.codes[layer],
            csr,
            k,
            m,
            forced=forced,
            keep=keep,
            successor_blocks=self.kv.successor_blocks,
            reduce=self.score_reduce,
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
                    _relative_to_best(scores, seq, q.shape[0]), _relative_to_best(other, seq, q.shape[0])
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
        elif self.block_source is not None:
            self.block_source.before_gather(layer, ps, pb, *host_csr)
        self._gather(layer, ps, pb, slot_pages, host_csr)

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
        )

    def _flush_deferred(self) -> None:
        """The deferred fetches and gathers of this step, in layer order, each gather on its
        layer's background stream (after its selection), whose event the next step's attention
        waits on. The host blocks on the plans (and the daemon) only once the whole step's compute
        is queued. A source with ``before_gathers`` (and no evicting cache) reads every layer's
        misses in one call once the selections are done; otherwise each layer's fetch precedes
        its gather, in the inline order."""
        work, self._deferred = self._deferred or [], None
        # A block source that evicts host rows (a bounded cache) may hand a row the previous
        # layer's gather still reads (another stream) to another block: wait for that gather.
        evicts = getattr(self.block_source, "may_evict", True)
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
                self._gather_done[layer] = done
            prev = done

    # ---------------------------------------------------------------- metrics
    def finalize_metrics(self, r: _Request) -> None:
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
        entry_bytes = 2 * self.kv.block_size * self.geo.head_dim * self.dtype.itemsize  # K+V, one head
        if r.slot < 0:  # never admitted
            return
        m.fetched_bytes_total = int(self._acc_fetched[r.slot]) * entry_bytes
        m.fetched_bytes_per_step = m.fetched_bytes_total / m.sparse_steps if m.sparse_steps else 0.0
        n_rec = float(self._acc_recall_n[r.slot])
        m.lookahead_recall = float(self._acc_recall[r.slot]) / n_rec if n_rec else None
