"""Requests and what they report: :class:`Request` (one sequence's state inside the engine, its
block tables read from the runtime), :class:`RequestMetrics` and :class:`GenerationResult`, and the
:class:`PrefillCache` of prompt KV (:class:`Prefilled` entries) shared by engines over one model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError


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
class Request:
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
    # Admitted sparse for a prefill in one piece (Engine.admit with whole=True): the runtime's
    # transition, whose host rows and local page the prefill fills; None once it has.
    sparse_prefill: dict | None = field(default=None, repr=False)

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
class Prefilled:
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

    Entries are keyed by (model, KV dtype, prompt): engines share an entry when they run the same
    model object (a :class:`~oasiskv.policy.SelectionPolicy`, like the evaluation's Quest-like
    ``QuestPolicy``, changes the decode steps without a model wrapper). An engine that captures
    features stores those of every prompt position, whether or not its own drafter wants them,
    so a hit serves a drafter with ``wants_prompt_features`` exactly as a fresh prefill would (no
    recompute, and no dependence on which engine filled the entry first). An entry serves an
    engine that captures nothing whatever it captured (capturing does not change the KV or the
    logits); an engine that captures layers is served only by an entry with those same layers,
    else it prefills and replaces the entry. So where engines with and without a drafter share
    prompts, let one that captures prefill first.

    An entry holds the prompt's whole KV (and its features: ``3 * hidden`` values per token for
    EAGLE-3): on the model's device by default, or with ``on_host=True`` in pinned host memory
    (:meth:`hold`), so that a long prompt's entry (18 GiB at 128K tokens on an 8B model) does not
    take the card's memory from the requests it serves; a hit then copies it in, layer by layer.
    Keep ``capacity`` small.
    """

    def __init__(self, capacity: int = 1, *, on_host: bool = False) -> None:
        if capacity < 1:
            raise ConfigError(f"PrefillCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.on_host = bool(on_host)
        self._items: dict = {}
        self.hits = 0

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor an entry keeps for ``t``: ``t`` itself, or with ``on_host`` a copy in pinned
        host memory, queued on the current stream (so ``t`` may be freed as soon as this returns:
        the allocator reuses its memory only for work queued after the copy)."""
        if not self.on_host or t.device.type == "cpu":
            return t
        h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        h.copy_(t, non_blocking=True)
        return h

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V the entries hold (wherever they are held)."""
        return sum(t.numel() * t.element_size() for item in self._items.values() for t in (*item.k, *item.v))

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
