"""User-facing configuration of the KV cache."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from . import _core
from .errors import ConfigError

#: The values of :attr:`KvConfig.select_queries`.
SELECT_QUERIES = ("lookahead", "lookahead+current")

#: The values of :attr:`KvConfig.block_score`.
BLOCK_SCORES = ("quest", "codes")
#: The fidelity selection, :class:`KvConfig`'s default (also :meth:`KvConfig.fidelity` and
#: ``--selection fidelity``): the two-stage codes score over 1.25 x K candidates that keep each
#: request's previous prediction, plus the successors of the codes' 8 best blocks (fewer at small
#: budgets: :func:`auto_successor_blocks`), and, with a drafter that reports its probability
#: (EAGLE-3), ``lookahead_min_confidence=0.5``. On SmolLM2 at 8K and a quarter of the context as
#: budget it gave every retrieval outcome dense gives (420 trials), exact copies within 1 point of
#: dense and +1.2-1.4 % NLL, at 1.5 x the Quest score's kernel time and about 0.95-0.97 x its
#: decode throughput at 16 x 16K (docs/EVAL.md; docs/history/PERF-2026-12-07.md, the H200's
#: selection kernels; at the full host pool on the H100: docs/PERF.md, s25).
FIDELITY_SELECTION = {
    "block_score": "codes",
    "score_candidates": 1.25,
    "sticky_candidates": True,
    "successor_blocks": 8,
}
#: The Quest-only selection (:meth:`KvConfig.fast`, ``--selection fast``): the Quest bound ranks
#: every block, nothing added. Up to 5 % more decode throughput than the default on Qwen3-8B
#: shapes, but it loses retrievals dense keeps (README, "Defaults").
FAST_SELECTION = {
    "block_score": "quest",
    "score_candidates": None,
    "sticky_candidates": False,
    "successor_blocks": 0,
    "lookahead_min_confidence": None,
}
#: The lookahead drafter's probability below which the step's own query selects, where the drafter
#: reports one and ``lookahead_min_confidence`` is left ``"auto"`` (docs/EVAL.md: 0.5 kept exact
#: copies with EAGLE-3 on SmolLM2).
AUTO_MIN_CONFIDENCE = 0.5
#: The values of ``--selection``: ``fidelity`` (the default), ``fast`` (:data:`FAST_SELECTION`)
#: and ``quest``, the old name of ``fast``.
SELECTIONS = ("fidelity", "fast", "quest")
#: The KvConfig fields whose default is ``"auto"``, resolved from the others (and, for
#: ``lookahead_min_confidence``, from the drafter: :meth:`KvConfig.resolve`).
AUTO = "auto"

#: The 8-bit KV storage (``KvConfig.host_kv_dtype``): E4M3 codes with a power-of-two scale per
#: (block, KV head), K and V apart; and the names that ask for it (vLLM's ``kv_cache_dtype="fp8"``
#: is E4M3 too).
FP8_KV = "fp8_e4m3"
FP8_KV_NAMES = ("fp8", "fp8_e4m3")


def _names_fp8(value) -> bool:
    """Whether a ``kv_dtype``/``host_kv_dtype`` value asks for :data:`FP8_KV` (one of
    :data:`FP8_KV_NAMES`, or ``torch.float8_e4m3fn``)."""
    return value in FP8_KV_NAMES or (value is not None and value is getattr(torch, "float8_e4m3fn", None))


#: Largest ``block_size`` (``oasis_core::limits``, exported by ``_core``: one source for the
#: config, the runtime and the kernels).
MAX_BLOCK_SIZE: int = _core.MAX_BLOCK_SIZE
#: Largest ``top_k_blocks``: the most the GPU top-K kernel selects per KV head (the kernels are
#: compiled with it).
MAX_TOP_K_BLOCKS: int = _core.MAX_TOP_K_BLOCKS
#: Largest pool (``num_gpu_pages``, ``num_host_blocks``): page and block ids are i32 on the GPU.
MAX_POOL_BLOCKS: int = _core.MAX_POOL_BLOCKS
#: Largest ``sparse_threshold`` in tokens: positions are i32 on the GPU.
MAX_TOKENS: int = _core.MAX_TOKENS


def _check_int(name: str, v: object, lo: int, hi: int, fix: str, optional: bool = False) -> None:
    """``v`` must be an int in ``lo..=hi`` (or None when ``optional``); bools are refused (``True`` is
    an int subclass, and a flag passed in the wrong position would otherwise be a size of 1)."""
    if optional and v is None:
        return
    kind = f"an int in {lo}..={hi}" + (" or None" if optional else "")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ConfigError(f"{name} must be {kind}, got {v!r} of type {type(v).__name__}")
    if v < lo:
        raise ConfigError(f"{name} must be {kind}, got {v}")
    if v > hi:
        raise ConfigError(f"{name}={v} is above {hi}, the largest allowed; {fix}")


def auto_successor_blocks(top_k_blocks: int, sink_blocks: int = 0, pin_blocks: int = 0) -> int:
    """The default ``successor_blocks`` of the codes score: 8 (:data:`FIDELITY_SELECTION`) at the
    usual budgets, at most a quarter of the slots left after the sink and pinned blocks, so a
    small budget keeps most of its slots for the selection (K = 16: 4, K = 8: 2, K < 4: 0)."""
    free = max(0, top_k_blocks - sink_blocks - pin_blocks)
    return min(FIDELITY_SELECTION["successor_blocks"], free // 4)


@dataclass(frozen=True)
class KvConfig:
    """How OasisKV keeps the KV cache of a request.

    The defaults are the fidelity selection (:data:`FIDELITY_SELECTION`: two-stage key-codes
    scoring with sticky candidates and successor blocks, and the EAGLE-3 confidence fallback where
    that drafter is used), which kept every retrieval dense keeps on SmolLM2 for 1-5 % of decode
    throughput; :meth:`fast` is the Quest-only selection. Fields whose default is ``"auto"`` are
    resolved at construction from ``block_score``, ``select_queries`` and the budget (so
    ``KvConfig(block_score="quest") == KvConfig.fast()``), except ``lookahead_min_confidence``,
    which the engine resolves when it knows its drafter (:meth:`resolve`).

    A request decodes densely until its context passes ``sparse_threshold`` tokens; then its full
    KV moves to the host pool and the GPU keeps, per layer and KV head, ``top_k_blocks`` selected
    blocks plus the local block. Each step the lookahead query re-selects; at most ``fetch_cap``
    new blocks per KV head enter the working set per step (the per-step traffic cap of the paper,
    eq. 3).

    Attributes:
        block_size: tokens per KV block (page).
        top_k_blocks: the working-set budget K, in blocks per KV head (excluding the local block).
        fetch_cap: the cap C on new blocks per KV head and step: a fraction of ``top_k_blocks`` when
            a float in (0, 1], an absolute count when an int >= 1. ``None`` means uncapped (C = K).
        sparse_threshold: context length (tokens) past which a request turns sparse. Defaults to
            the budget, ``top_k_blocks * block_size``: below it the budget holds everything anyway.
        kv_dtype: storage dtype of the pools; defaults to the model's dtype. ``"fp8_e4m3"``
            (``"fp8"``, ``torch.float8_e4m3fn``): the GPU pages in E4M3 with a power-of-two scale
            per (page, KV head), K and V apart, quantized where K/V are written (prefill, each
            token's append; a chunk that continues a page requantizes it), read by the attention
            kernels as code x scale; the host pool follows (fp8 too), so OasisKV's gathers move
            codes and scales as bytes. The summaries and key codes of blocks that were dense
            bound the keys as stored (code x scale); a decoded token's summary comes from its
            unquantized key.
        host_kv_dtype: storage of the host pool alone: ``None`` (as ``kv_dtype``) or
            ``"fp8_e4m3"`` (``"fp8"`` and ``torch.float8_e4m3fn`` name it too): E4M3 codes with a
            power-of-two scale per (block, KV head), K and V apart (``oasis_core::kernels::kv8``),
            so the host pool holds half the bytes of bf16 per request (plus 8 bytes per block and
            head). Blocks are quantized where they enter the pool (the dense -> sparse copy, each
            decoded token's write-through) and dequantized into the working set's pages when
            gathered; summaries and key codes come from the unquantized keys. Not with a remote
            KV source yet.
        num_gpu_pages: pages in the GPU pool (shared by all requests, per layer): a fixed pool of
            this size. ``None`` grows the pool with what admitted requests need, up to the
            engine's budget (``LLMEngine(gpu_kv_budget_bytes=...)``).
        num_host_blocks: blocks in the host pool; ``None`` sizes it like ``num_gpu_pages`` (or
            grows it up to ``host_kv_budget_bytes``).
        measure_recall: compute lookahead recall (the predicted set against the exact top-K of the
            next step's true query). Costs one extra scoring pass, top-K and overlap per layer on
            the steps that measure it.
        recall_every: measure recall on one decode step in this many (the engine's step count;
            the step before keeps its predictions for it). 1 measures every step, as an
            evaluation recorder always does; at the default 8 the cost is an eighth (every step
            cost about a fifth of SmolLM2's batch-1 step on the H200, docs/history/PERF-2026-12-07.md).
        select_queries: which queries choose the next working set. ``"lookahead"`` (the default):
            the lookahead row's alone, as in the paper. ``"lookahead+current"``: each candidate
            block's score under the lookahead query and under the current query is taken relative
            to that query's best block (a log attention-weight bound), and the larger of the two
            ranks it -- blocks either query leans on stay. Costs one extra scoring pass per layer
            and step; without a lookahead row it is the same as ``"lookahead"``.
        block_score: how a query ranks the candidate blocks (one of :data:`BLOCK_SCORES`).
            ``"quest"``: the Quest upper bound from each block's per-channel key min/max.
            ``"codes"`` (the default): every key of a complete block is also kept at 2 bits per
            channel inside that min/max, and a block ranks by its largest approximate logit -- closer to
            the true attention (docs/EVAL.md) for twice the summary bytes and more scoring work.
            Needs ``head_dim`` divisible by 4 (else the engine raises ConfigError: pass
            ``KvConfig.fast()``).
        sink_blocks: the first ``sink_blocks`` logical blocks of every sparse request are always in
            the predicted set (StreamingLLM's attention sinks); they take that many of the
            ``top_k_blocks`` slots, and the other slots go to the best-scored of the remaining
            blocks. 0 (the default) selects by score alone. Must be below ``top_k_blocks``.
        pin_blocks: per layer and KV head, the ``pin_blocks`` best blocks of a request's initial
            selection (the last prompt token's query, right after prefill: what the prompt's
            question reads) stay in every later predicted set, as SnapKV keeps what the prompt's
            end attends to. They take that many of the ``top_k_blocks`` slots; 0 (the default)
            pins nothing. ``sink_blocks + pin_blocks`` must be below ``top_k_blocks``.
        successor_blocks: per KV head, the next logical block of each of the
            ``successor_blocks`` best-scored blocks (by the block score; in two stages the codes
            score's best candidates, their successors taken whether candidates or not) is in the
            predicted set too, so that a span that straddles a block boundary (a number, a line of code) is
            fetched whole. They take that many of the ``top_k_blocks`` slots (fewer when a
            successor is already among the best, the last block of the request or forced anyway);
            0 adds none. ``"auto"`` (the default): :func:`auto_successor_blocks` with
            ``block_score="codes"`` (8 at the usual budgets, fewer below K = 32), 0 with
            ``"quest"``. An explicit count must keep ``sink_blocks + pin_blocks +
            successor_blocks`` below ``top_k_blocks``.
        score_candidates: with ``block_score="codes"``, score in two stages: the Quest bound's
            best ``ceil(score_candidates x top_k_blocks)`` blocks per KV head (at most
            :data:`MAX_TOP_K_BLOCKS`) are the candidates, and the codes rank only those. The
            codes work then scales with the budget instead of the context (at 32K and K = 128,
            3 x K is 19 % of the blocks). ``None`` ranks every block by its codes. ``"auto"`` (the
            default): 1.25 with ``block_score="codes"`` and ``select_queries="lookahead"``, else
            None.
            On SmolLM2 (docs/EVAL.md) 3 keeps the codes' selection within 0.4-0.6 points of
            attention at 1/16 of the context, 0.1-0.2 at 1/8 and 0.0 at 1/4. A number >= 1; not
            with ``select_queries="lookahead+current"``.
        sticky_candidates: with ``score_candidates`` (two stages), a request's previous prediction
            (per layer and KV head, its ``top_k_blocks`` blocks) is always among the next
            selection's candidates, and its first selection (when it turns sparse: the prompt's
            last query) ranks every block by the codes. A block the codes once ranked among the
            best stays a candidate until the codes rank it out, whatever the Quest bound says; the
            Quest bound only brings the other ``ceil(score_candidates x K) - K`` candidates (so
            the cost is that of the same ``score_candidates``). The prediction is kept every
            step (one more gather and scatter per layer). ``False``: the Quest bound's best alone.
            ``"auto"`` (the default): True exactly when ``score_candidates`` is set.
        lookahead_min_confidence: the lookahead row chooses the next working set only when the
            drafter's probability of its draft is at least this; below it the step's own query
            chooses (as the ``previous-query`` drafter does). A draft the head is unsure of (a
            random digit of a number being copied) points its query elsewhere, while the step's
            own query keeps reading what it reads (docs/EVAL.md). Needs a drafter that reports its
            probability (``eagle3``). ``None``: the lookahead row always. ``"auto"`` (the
            default): :data:`AUTO_MIN_CONFIDENCE` (0.5) where the drafter reports its probability
            and ``block_score="codes"``, else None (resolved by the engine, :meth:`resolve`); an
            explicit number with a drafter that reports none is an error.
        layer_blocks: per-layer budgets, one per model layer: layer ``l`` selects, fetches and
            attends to at most ``layer_blocks[l]`` blocks per KV head (plus the local block), and
            its fetch cap is taken of that budget. Layers differ in how much of their attention a
            few blocks hold (docs/EVAL.md), so the same total can hold more of it spread unevenly;
            :func:`oasiskv.layer_budget.fit_layer_blocks` fits such an allocation on calibration
            text. Each budget lies in ``sink_blocks + pin_blocks + successor_blocks + 1`` ..
            ``top_k_blocks``: ``top_k_blocks`` stays the number of slot pages a sparse request
            holds in every layer (the slots a smaller layer leaves unused stay unmapped), so set it
            to ``max(layer_blocks)``. ``None`` (the default): ``top_k_blocks`` in every layer.
        candidate_bound: with ``score_candidates`` (two stages), what the first stage's Quest
            bound reads: ``"fp8"`` (the default), each complete block's ``[min; max]`` summary in
            E4M3 rounded outward (``oasis_core::kernels::bound8``): still an upper bound of every
            logit in the block, looser by under one E4M3 step per channel, for half the bytes of
            16-bit summaries (the largest read of the selection: ~184 MB per layer and step at 44
            x 16K on Qwen3-8B shapes). ``"summaries"``: the 16-bit summaries themselves.
    """

    block_size: int = 16
    top_k_blocks: int = 128
    fetch_cap: float | int | None = 0.05
    sparse_threshold: int | None = None
    kv_dtype: torch.dtype | str | None = None
    host_kv_dtype: str | torch.dtype | None = None
    num_gpu_pages: int | None = None
    num_host_blocks: int | None = None
    measure_recall: bool = True
    recall_every: int = 8
    select_queries: str = "lookahead"
    block_score: str = "codes"
    sink_blocks: int = 0
    pin_blocks: int = 0
    successor_blocks: int | str = AUTO
    score_candidates: float | None | str = AUTO
    sticky_candidates: bool | str = AUTO
    lookahead_min_confidence: float | None | str = AUTO
    layer_blocks: tuple[int, ...] | None = None
    candidate_bound: str = "fp8"
    #: The ``"auto"`` fields this config resolved at construction, as ``(name, value)`` pairs, so
    #: that ``dataclasses.replace(kv, top_k_blocks=4)`` resolves them again for the new budget
    #: instead of validating the old budget's values as explicit ones (a field replaced by a value
    #: other than the resolved one is explicit). Not compared, not shown.
    _auto: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        # Carried over by dataclasses.replace: still the resolved value -> "auto" again.
        for name, value in self._auto:
            if getattr(self, name) == value and type(getattr(self, name)) is type(value):
                self._set(name, AUTO)
        resolved = []
        if self.select_queries not in SELECT_QUERIES:
            raise ConfigError(f"select_queries must be one of {SELECT_QUERIES}, got {self.select_queries!r}")
        if self.block_score not in BLOCK_SCORES:
            raise ConfigError(f"block_score must be one of {BLOCK_SCORES}, got {self.block_score!r}")
        two_stage = self.block_score == "codes" and self.select_queries == "lookahead"
        self._resolve_two_stage(two_stage, resolved)
        _check_int(
            "block_size", self.block_size, 1, MAX_BLOCK_SIZE, "use a smaller block_size (16 to 64 is usual)"
        )
        _check_int(
            "top_k_blocks",
            self.top_k_blocks,
            1,
            MAX_TOP_K_BLOCKS,
            "the GPU top-K kernel selects at most that many blocks per KV head; lower top_k_blocks, "
            "or raise block_size to keep the same budget in tokens",
        )
        cap = self.fetch_cap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, int | float):
                raise ConfigError(f"fetch_cap must be a float in (0, 1], an int >= 1 or None, got {cap!r}")
            if isinstance(cap, float) and not 0.0 < cap <= 1.0:
                raise ConfigError(
                    f"fetch_cap={cap}: a float is a fraction of top_k_blocks and must lie in (0, 1]; "
                    "pass an int for an absolute number of blocks"
                )
            if isinstance(cap, int) and cap < 1:
                raise ConfigError(f"fetch_cap={cap}: an absolute cap must be >= 1 (use None for uncapped)")
        _check_int(
            "sparse_threshold",
            self.sparse_threshold,
            1,
            MAX_TOKENS,
            "positions are i32 on the GPU; pass a smaller threshold, or None for the default",
            optional=True,
        )
        _check_int(
            "sink_blocks",
            self.sink_blocks,
            0,
            self.top_k_blocks - 1,
            "sink blocks take slots of the budget and at least one must stay for the selection; "
            "lower sink_blocks or raise top_k_blocks",
        )
        _check_int(
            "pin_blocks",
            self.pin_blocks,
            0,
            self.top_k_blocks - 1 - self.sink_blocks,
            "pinned blocks take slots of the budget beside the sink blocks, and at least one must stay "
            "for the selection; lower pin_blocks (or sink_blocks) or raise top_k_blocks",
        )
        self._resolve_successors(resolved)
        self._set("_auto", tuple((name, getattr(self, name)) for name in resolved))
        _check_int(
            "successor_blocks",
            self.successor_blocks,
            0,
            self.top_k_blocks - 1 - self.sink_blocks - self.pin_blocks,
            "successor blocks take slots of the budget beside the sink and pinned blocks, and at "
            "least one must stay for the selection; lower successor_blocks or raise top_k_blocks",
        )
        if self.layer_blocks is not None:
            lb = self.layer_blocks
            if not isinstance(lb, tuple) or not lb:
                raise ConfigError(
                    "layer_blocks must be a non-empty tuple of ints (one budget per layer) or None, "
                    f"got {lb!r}"
                )
            low = self.sink_blocks + self.pin_blocks + self.successor_blocks + 1
            for i, k in enumerate(lb):
                _check_int(
                    f"layer_blocks[{i}]",
                    k,
                    low,
                    self.top_k_blocks,
                    "a layer's budget cannot exceed the slots of a request (top_k_blocks); set "
                    "top_k_blocks to max(layer_blocks)",
                )
        f = self.score_candidates
        if f is not None:
            if isinstance(f, bool) or not isinstance(f, int | float) or not math.isfinite(f) or f < 1:
                raise ConfigError(f"score_candidates must be a number >= 1 or None, got {f!r}")
            if self.block_score != "codes":
                raise ConfigError(
                    "score_candidates ranks the Quest bound's candidates by the key codes: it needs "
                    f"block_score='codes', got block_score={self.block_score!r}"
                )
            if self.select_queries != "lookahead":
                raise ConfigError(
                    "score_candidates works with select_queries='lookahead' only (the two-query "
                    "combination ranks every block); drop one of them"
                )
        if self.candidate_bound not in ("fp8", "summaries"):
            raise ConfigError(f"candidate_bound must be 'fp8' or 'summaries', got {self.candidate_bound!r}")
        if not isinstance(self.sticky_candidates, bool):
            raise ConfigError(f"sticky_candidates must be True or False, got {self.sticky_candidates!r}")
        if self.sticky_candidates and f is None:
            raise ConfigError(
                "sticky_candidates keeps the previous prediction among the two-stage score's "
                "candidates: it needs score_candidates (and block_score='codes')"
            )
        c = self.lookahead_min_confidence
        if c is not None and c != AUTO:
            if isinstance(c, bool) or not isinstance(c, int | float) or not 0.0 <= c <= 1.0:
                raise ConfigError(
                    f"lookahead_min_confidence must be a probability in [0, 1], None or 'auto', got {c!r}"
                )
            if self.select_queries != "lookahead":
                raise ConfigError(
                    "lookahead_min_confidence chooses between the lookahead row and the step's own "
                    "query: it needs select_queries='lookahead'"
                )
        if _names_fp8(self.kv_dtype):
            self._set("kv_dtype", FP8_KV)
        elif self.kv_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise ConfigError(
                f"kv_dtype must be float32, float16, bfloat16 or 'fp8_e4m3', got {self.kv_dtype}"
            )
        if _names_fp8(self.host_kv_dtype):
            self._set("host_kv_dtype", FP8_KV)
        elif self.host_kv_dtype is not None:
            raise ConfigError(
                f"host_kv_dtype must be None (the pools' dtype) or 'fp8_e4m3', got {self.host_kv_dtype!r}"
            )
        for name in ("num_gpu_pages", "num_host_blocks"):
            _check_int(
                name,
                getattr(self, name),
                1,
                MAX_POOL_BLOCKS,
                f"block ids are i32 on the GPU; pass a smaller {name} or None (sized for the batch)",
                optional=True,
            )
        if not isinstance(self.measure_recall, bool):
            raise ConfigError(f"measure_recall must be True or False, got {self.measure_recall!r}")
        _check_int("recall_every", self.recall_every, 1, 1 << 20, "1 measures recall every step")
        if self.num_gpu_pages is not None and self.num_gpu_pages < self.top_k_blocks + 1:
            raise ConfigError(
                f"the budget needs top_k_blocks + 1 = {self.top_k_blocks + 1} GPU pages per sparse request "
                f"but num_gpu_pages={self.num_gpu_pages}; lower top_k_blocks or raise num_gpu_pages"
            )

    def _resolve_two_stage(self, two_stage: bool, resolved: list[str]) -> None:
        """Resolve the two stages' ``"auto"`` fields (appending their names to ``resolved``): the
        fidelity selection's candidates with the codes score, none with the Quest score."""
        if self.score_candidates == AUTO:
            self._set("score_candidates", FIDELITY_SELECTION["score_candidates"] if two_stage else None)
            resolved.append("score_candidates")
        if self.sticky_candidates == AUTO:
            self._set("sticky_candidates", self.score_candidates is not None)
            resolved.append("sticky_candidates")
        if self.lookahead_min_confidence == AUTO and not two_stage:
            self._set("lookahead_min_confidence", None)

    def _resolve_successors(self, resolved: list[str]) -> None:
        """Resolve ``successor_blocks="auto"`` for the smallest layer budget (appending its name to
        ``resolved``); called once the sink and pin counts are validated."""
        if self.successor_blocks == AUTO:
            auto = 0
            if self.block_score == "codes":
                # The smallest layer budget bounds it (an invalid one is reported below).
                lb = self.layer_blocks if isinstance(self.layer_blocks, tuple) else ()
                k = min([x for x in lb if isinstance(x, int)] or [self.top_k_blocks])
                auto = auto_successor_blocks(k, self.sink_blocks, self.pin_blocks)
            self._set("successor_blocks", auto)
            resolved.append("successor_blocks")

    def _set(self, name: str, value) -> None:
        """Resolve an ``"auto"`` field at construction (the dataclass is frozen)."""
        object.__setattr__(self, name, value)

    def resolve(self, *, reports_confidence: bool) -> KvConfig:
        """This config with ``lookahead_min_confidence="auto"`` resolved for a drafter:
        :data:`AUTO_MIN_CONFIDENCE` where the drafter has a lookahead row and reports the
        probability of its drafts (``reports_confidence``: EAGLE-3), else None. The engine calls
        it when it knows its drafter; every other field is resolved at construction."""
        if self.lookahead_min_confidence != AUTO:
            return self
        return dataclasses.replace(
            self, lookahead_min_confidence=AUTO_MIN_CONFIDENCE if reports_confidence else None
        )

    @property
    def cap_blocks(self) -> int:
        """The fetch cap C in blocks per KV head and step (of a layer with the whole
        ``top_k_blocks``; :meth:`cap_blocks_for` of a smaller budget)."""
        return self.cap_blocks_for(self.top_k_blocks)

    def cap_blocks_for(self, k: int) -> int:
        """The fetch cap in blocks per KV head and step of a layer whose budget is ``k`` blocks."""
        if self.fetch_cap is None:
            return k
        if isinstance(self.fetch_cap, float):
            return max(1, min(k, math.ceil(self.fetch_cap * k)))
        return min(self.fetch_cap, k)

    @classmethod
    def fidelity(cls, **kwargs) -> KvConfig:
        """The fidelity selection, the default: ``KvConfig.fidelity(**kw) == KvConfig(**kw)``
        (kept so that code that asked for it by name says so). ``kwargs`` set the rest or
        override it, e.g. ``KvConfig.fidelity(top_k_blocks=64)``.

        Raises:
            ConfigError: as the constructor."""
        return cls(**kwargs)

    @classmethod
    def fast(cls, **kwargs) -> KvConfig:
        """The Quest-only selection (:data:`FAST_SELECTION`, the default before the fidelity
        selection): the Quest bound ranks every block; no key codes, candidates, successors or
        confidence fallback. Up to 5 % more decode throughput, but it loses retrievals dense
        keeps (README, "Defaults"). ``kwargs`` set the rest or override it, e.g.
        ``KvConfig.fast(top_k_blocks=64)``.

        Raises:
            ConfigError: as the constructor."""
        return cls(**{**FAST_SELECTION, **kwargs})

    def layer_budget(self, layer: int) -> int:
        """Layer ``layer``'s budget in blocks per KV head (:attr:`layer_blocks`, else
        ``top_k_blocks``)."""
        return self.top_k_blocks if self.layer_blocks is None else self.layer_blocks[layer]

    def candidate_blocks(self, k: int) -> int | None:
        """Candidates per KV head of the two-stage score for a budget of ``k`` blocks (``None``:
        one stage, every block)."""
        if self.score_candidates is None:
            return None
        return max(k, min(MAX_TOP_K_BLOCKS, math.ceil(self.score_candidates * k)))

    @property
    def threshold_tokens(self) -> int:
        if self.sparse_threshold is not None:
            return self.sparse_threshold
        return self.top_k_blocks * self.block_size
