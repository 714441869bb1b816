"""The step-level API: :class:`LLMEngine` with continuous batching, for custom serving loops.

Names follow vLLM where they fit::

    eng = oasiskv.LLMEngine("smollm2", kv=oasiskv.KvConfig(top_k_blocks=64))
    rid = eng.add_request("Why is the sky blue?", oasiskv.SamplingParams(max_tokens=32))
    while eng.has_unfinished_requests():
        for out in eng.step():
            print(out.request_id, out.new_token_ids, out.finished)

**Scheduling.** Requests wait in arrival order. At the start of every :meth:`LLMEngine.step`,
waiting requests are admitted first come, first served while a seat is free (``max_num_seqs``)
and their *peak* KV need in both tiers fits beside the reservations of the running requests
(``oasis-runtime``'s admission); a request that does not fit waits, and so do the ones behind it
(no overtaking, so a long request is never starved). Prompts are prefilled densely, in chunks:
each step spends at most ``max_num_batched_tokens`` prompt tokens, first on the prompts already
being prefilled, then on newly admitted ones, so a long prompt (or a burst of them) does not stall
the running decodes for its whole length; then every running request decodes one token. A chunk
attends to the KV the earlier chunks stored and to itself. Because admission reserves the peak, a
running request never fails for lack of blocks and nothing is ever preempted; past the budget,
requests wait.

**Failures stay per request.** A request whose prefill runs out of memory, or whose logits turn
non-finite (NaN/inf), finishes with ``finish_reason="error"`` and a message in ``error``; its
blocks go back to the pools and the others go on. A request that could never fit (its context
passes the model's, or its peak need passes a pool's cap) is refused at :meth:`add_request`.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .config import KvConfig
from .drafters import Drafter, make_drafter
from .engine import (
    Engine,
    GenerationResult,
    PrefillCache,
    Request,
    RequestMetrics,
    RowSampling,
    copy_to_host,
    sample_inverse_cdf,
    sampling_probs,
)
from .errors import ConfigError, ContextLengthError, OasisError

#: Values of :attr:`RequestOutput.finish_reason`.
FINISH_REASONS = ("stop", "length", "abort", "error")
#: Most alternatives :attr:`SamplingParams.logprobs` may ask for (vLLM's ``max_logprobs``).
MAX_LOGPROBS = 20


#: The compute dtypes a model may be loaded in (``dtype=None``: bfloat16 on a GPU, float32 on the CPU).
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _enforce_eager(enforce_eager, cuda_graph) -> bool:
    """``enforce_eager``, with the deprecated ``cuda_graph`` (for one release: ``cuda_graph=True``
    is ``enforce_eager=False``, now the default; ``cuda_graph=False`` is ``enforce_eager=True``)."""
    if not isinstance(enforce_eager, bool):
        raise ConfigError(f"enforce_eager must be True or False, got {enforce_eager!r}")
    if cuda_graph is None:
        return enforce_eager
    if not isinstance(cuda_graph, bool):
        raise ConfigError(
            f"cuda_graph must be True or False (deprecated: use enforce_eager), got {cuda_graph!r}"
        )
    warnings.warn(
        "cuda_graph= is deprecated and will be removed: CUDA graphs are on by default on a GPU; "
        "pass enforce_eager=True to turn them off (for cuda_graph=False), or nothing (cuda_graph=True)",
        DeprecationWarning,
        stacklevel=3,
    )
    if cuda_graph and enforce_eager:
        raise ConfigError("cuda_graph=True contradicts enforce_eager=True; pass enforce_eager alone")
    return not cuda_graph


def _check_model_placement(model, device, dtype) -> None:
    """A model passed as an object stays where it is: ``device`` (other than ``"auto"``) and
    ``dtype`` (other than None) must name its own device and dtype. Moving or casting it here
    would change the caller's object under them (a model shared by two engines)."""
    from .devices import resolve_device

    p = next(model.parameters(), None)
    if p is None:
        raise ConfigError("model has no parameters; pass a CausalLM")
    if not (isinstance(device, str) and device == "auto"):
        want = torch.device(resolve_device(device))
        if want.type != p.device.type or (want.index is not None and want.index != p.device.index):
            raise ConfigError(
                f"the model is on {p.device} but device={str(device)!r}; move it first "
                f"(model.to({str(want)!r})) or leave device out (a model object runs where it is)"
            )
    if dtype is not None and dtype != p.dtype:
        raise ConfigError(
            f"the model is in {p.dtype} but dtype={dtype}; cast it first (model.to({dtype})) or "
            "leave dtype out (a model object runs in its own dtype)"
        )


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 is greedy (argmax); > 0 samples from the softmax at this temperature.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches this.
        seed: the request's own random seed (reproducible whatever else runs beside it); ``None``
            (the default): a fresh random seed per request, or a draw from the engine's generator
            when the engine has a seed (``LLMEngine(seed=...)``).
        ignore_eos: keep generating past the tokenizer's end-of-sequence tokens.
        stop_token_ids: more tokens that end the request (kept in the output, like EOS).
        skip_special_tokens: leave special tokens (``<|im_end|>``, ...) out of the output text
            (:func:`output_text`), as vLLM and the HTTP server do; the token ids keep them.
        logprobs: report each generated token's log-probability and those of the ``logprobs``
            most likely tokens at its position (0: the generated token's only; at most
            :data:`MAX_LOGPROBS`) in :attr:`RequestOutput.new_logprobs`; ``None``: none. They are
            the model's own distribution (log-softmax of the logits, before temperature and
            top_p), as vLLM's default. Not with a speculative engine.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise ConfigError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        ids = self.stop_token_ids
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | set | frozenset):
            raise ConfigError(f"stop_token_ids must be a sequence of ints, got {ids!r}")
        if not all(_is_int(x) and x >= 0 for x in ids):
            raise ConfigError(f"stop_token_ids must hold ints >= 0, got {list(ids)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.skip_special_tokens, bool):
            raise ConfigError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        n = self.logprobs
        if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
            raise ConfigError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {n!r}")


@dataclass
class RequestOutput:
    """What one :meth:`LLMEngine.step` did for one request.

    ``new_token_ids`` were made in this step (empty for an abort); ``token_ids`` are all tokens
    generated so far. ``finish_reason`` is one of :data:`FINISH_REASONS` once ``finished``;
    ``error`` says what went wrong when it is ``"error"``. ``metrics`` are complete once finished.
    ``new_logprobs`` (with :attr:`SamplingParams.logprobs`, else None): one ``{token_id: logprob}``
    per new token, the most likely tokens first, then the generated token if it is not among them.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    new_logprobs: list[dict[int, float]] | None = None


@dataclass
class StepInfo:
    """What an :class:`LLMEngine` recorder sees of one forward (``recorder.on_step(info)``), before
    sampling: ``kind`` is ``"prefill"`` (one request) or ``"decode"``; ``logits`` the rows that
    choose each request's next token, ``[len(request_ids), vocab]`` on the model's device;
    ``drafts`` the lookahead token each request ran with in this decode step (None at prefill or
    without a lookahead row)."""

    kind: str
    request_ids: list[str]
    logits: torch.Tensor
    drafts: list[int | None]


@dataclass
class _Seq:
    """A request as the scheduler tracks it."""

    request_id: str
    req: Request
    params: SamplingParams
    gen: torch.Generator | None
    stop: Callable[[list[int]], bool] | None = None
    forced: list[int] | None = None
    error: str | None = None
    prefilled: int = 0  # prompt tokens prefilled so far
    new: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)  # one per token of ``new``
    staged: object | None = None  # a disagg.StagedRequest: admitted from the staging daemon


def output_text(tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The text of generated ``token_ids``: special tokens (end of turn, ...) left out unless
    ``skip_special_tokens`` is False, as vLLM's ``skip_special_tokens=True``. The one
    detokenisation of :attr:`GenerationResult.text` and of the HTTP server's responses."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def prompt_token_ids(prompt, tokenizer, vocab_size: int, what: str = "prompt") -> list[int]:
    """A prompt (text, or token ids as a list, tuple, 1-D integer tensor or array) as a list of
    ints, checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError(f"{what} is text but there is no tokenizer; pass token ids or a tokenizer")
        ids = list(tokenizer.encode(prompt))
    else:
        if hasattr(prompt, "tolist") and hasattr(prompt, "dtype"):  # torch tensor / numpy array
            kind = str(prompt.dtype)
            if "int" not in kind or "bool" in kind:
                raise ConfigError(f"{what} must hold integer token ids, got dtype {kind}")
            if getattr(prompt, "ndim", 1) != 1:
                raise ConfigError(f"{what} must be 1-D, got shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise ConfigError(f"{what} must be text or a sequence of token ids, got {type(prompt).__name__}")
        bad = [t for t in prompt if not _is_int(t)]
        if bad:
            raise ConfigError(f"{what} has token ids that are not ints: {bad[:5]!r}")
        ids = list(prompt)
    if not ids:
        raise ConfigError(f"{what} is empty; pass at least one token")
    out = [t for t in ids if not 0 <= t < vocab_size]
    if out:
        raise ConfigError(f"{what} has token ids outside the vocabulary 0..{vocab_size}: {out[:5]}")
    return ids


class LLMEngine:
    """A model and its OasisKV engine, driven one step at a time (continuous batching).

    Args:
        model: ``"smollm2"`` (bundled), a ``.gguf`` path, a local Hugging Face directory, or a
            ``CausalLM`` instance (then pass ``tokenizer`` for text prompts).
        kv: the cache configuration (:class:`KvConfig`).
        backend: ``"oasis"`` (requests turn sparse past ``kv.sparse_threshold``) or ``"dense"``.
        drafter: the lookahead source: ``"ngram"``, ``"eagle3"`` (the bundled head of the bundled
            model), ``"previous-query"``, ``None`` or a :class:`~oasiskv.Drafter`.
        dtype: the compute dtype when loading ``model`` by name: None (auto) is bfloat16 on a GPU,
            float32 on the CPU. With a model object: None, or the model's own dtype (it is not
            cast; ConfigError otherwise).
        device: ``"auto"`` (the default): the GPU when one can run OasisKV's kernels, else the
            CPU (:func:`oasiskv.devices.resolve_device`, as ``oasis --device auto``); or
            ``"cpu"``, ``"cuda"``, ``"cuda:N"``. :class:`~oasiskv.errors.CudaUnavailableError`
            for a GPU on a machine without one, ConfigError for another device type. A model
            object runs where it is: ``device`` must then be ``"auto"`` or its own device.
        max_num_seqs: most requests running at once.
        gpu_kv_budget_bytes: the most bytes of GPU KV pages (all layers); emulates a smaller GPU.
            ``None``: 40 % of the device's free memory when the engine starts.
        host_kv_budget_bytes: the most bytes of the host pool. ``None``: 40 % of free RAM.
        max_num_batched_tokens: prompt tokens prefilled per step (chunked prefill); a prompt
            longer than this takes several steps, interleaved with the decode steps.
        seed: seeds one generator shared by the requests whose :class:`SamplingParams` has no
            seed (reproducible run to run); None (the default): each such request gets a fresh
            random seed of its own.
        policy: a :class:`~oasiskv.policy.SelectionPolicy` (evaluation: the Quest-like ideal).
        output_kind: ``"cumulative"`` (every :class:`RequestOutput` carries ``token_ids``, all
            tokens so far: a copy per request and step) or ``"delta"`` (``token_ids`` only in the
            final output; stream ``new_token_ids`` instead: O(1) per step for long outputs).
        speculative: accept the lookahead draft as speculative decoding (needs a drafter with a
            lookahead row): a decode step verifies each request's draft against row 0's logits
            and, when it is accepted, takes one more token from row 1's logits and stores the
            draft's K/V computed in that same step. Greedy outputs are those of the
            non-speculative engine (token for token while attention is exact: the dense backend,
            or a working set that holds the context); sampling uses the speculative-sampling rule,
            so the output distribution is unchanged. Every draft, greedy or sampled, is verified
            inside the step on the device (a per-row flag), so speculative steps replay as CUDA
            graphs too (``cuda_graph=True``). A seeded request's tokens depend on its seed alone,
            whatever runs beside it, eager or graph (they differ from the non-speculative run's:
            the acceptance draws from the same generator). Off by default. :attr:`spec_stats` and
            the requests' metrics report the acceptance rate and tokens per step. A measurement
            drafter may force the verdicts of greedy drafts (``Drafter.forced_verdicts``:
            ``OracleDrafter(force=True)``): the step then does the work of an acceptance or a
            rejection at a set rate, and the outputs are NOT the model's greedy outputs.
        host_pool: where the oasis backend's host pool lives: ``"pinned"`` CPU memory (read over
            PCIe), or ``"device"``, the all-resident oracle: a copy of the full KV on the GPU, the
            same selection, the gather device to device (the benchmark's upper bound; it needs the
            whole KV of every request in GPU memory). Without a GPU both are CPU memory.
        enforce_eager: run every decode step eagerly. By default (False) a GPU engine replays each
            decode step as a CUDA graph (one capture per batch size bucket and context capacity;
            13-19 x faster decode than eager on SmolLM2 on an H100), as vLLM does; on the CPU
            graphs do not apply. Steps under a selection policy or a recall recorder
            (``engine.recorder``) run eagerly anyway. :attr:`cuda_graphs` says which.
        cuda_graph: deprecated (one release): ``True`` is the default now, ``False`` is
            ``enforce_eager=True``; passing it warns (DeprecationWarning).
        kv_source: ``"oasis-rt://HOST:PORT"`` (TCP) or ``"oasis-rt+ucx://HOST:PORT"`` (UCX, block
            reads by RMA), the staging daemon of disaggregated prefill (:mod:`oasiskv.disagg`):
            :meth:`add_staged_request` then admits requests a :class:`~oasiskv.disagg.PrefillWorker`
            prefilled. None: no daemon.
        kv_transfer: how a staged request's KV comes over: ``"partial"`` (the summaries and the
            blocks of the first step at admission, every later miss on demand, each block-head at
            most once) or ``"full"`` (every block at admission, the baseline).
        kv_token: the daemon's shared token (its ``--token-file`` contents), if it has one.
        kv_timeout_s: the deadline of every daemon call; a daemon that dies or stalls fails the
            requests whose KV it holds (``finish_reason="error"``) within it, the others go on.
        kv_retries: reconnect and retry a failed daemon read this many times first.
        kv_cache_blocks: bound each staged request's host pool to this many cached blocks (plus
            the blocks it writes itself): planned blocks without a row evict the least recently
            used ones this layer does not read, and an evicted block is read again when it is
            planned again. At least ``num_kv_heads * top_k_blocks``; needs
            ``kv_transfer="partial"`` and ``cuda_graph=False``. None: room for the whole context
            (each block-head crosses the network at most once). With ``cuda_graph=True`` a
            partial transfer's misses are read after each replayed step and their layers
            gathered again before the next one.
    """

    def __init__(
        self,
        model,
        *,
        tokenizer=None,
        kv: KvConfig | None = None,
        backend: str = "oasis",
        drafter: str | Drafter | None = "ngram",
        dtype: torch.dtype | None = None,
        device: str | torch.device = "auto",
        max_num_seqs: int = 64,
        gpu_kv_budget_bytes: int | None = None,
        host_kv_budget_bytes: int | None = None,
        max_num_batched_tokens: int = 8192,
        prefill_cache: PrefillCache | None = None,
        seed: int | None = None,
        policy=None,
        output_kind: str = "cumulative",
        speculative: bool = False,
        host_pool: str = "pinned",
        enforce_eager: bool = False,
        cuda_graph: bool | None = None,
        kv_source: str | None = None,
        kv_transfer: str = "partial",
        kv_token: str | bytes | None = None,
        kv_timeout_s: float = 30.0,
        kv_retries: int = 0,
        kv_cache_blocks: int | None = None,
    ) -> None:
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not _is_int(v) or not 1 <= v <= 1 << 20:
                raise ConfigError(f"{name} must be an int in 1..={1 << 20}, got {v!r}")
        budgets = {"gpu_kv_budget_bytes": gpu_kv_budget_bytes, "host_kv_budget_bytes": host_kv_budget_bytes}
        for name, v in budgets.items():
            if v is not None and (not _is_int(v) or v < 0):
                raise ConfigError(f"{name} must be None or an int >= 0, got {v!r}")
        model_name = model if isinstance(model, str) else None
        if output_kind not in ("cumulative", "delta"):
            raise ConfigError(f"output_kind must be 'cumulative' or 'delta', got {output_kind!r}")
        self.output_kind = output_kind
        if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
            raise ConfigError(
                f"seed must be None (a fresh seed per request) or an int in [0, 2**63), got {seed!r}"
            )
        enforce_eager = _enforce_eager(enforce_eager, cuda_graph)
        if dtype is not None and dtype not in MODEL_DTYPES:
            raise ConfigError(
                f"dtype must be None (auto), torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}"
            )
        if isinstance(model, str):
            from .devices import compute_dtype, resolve_device
            from .models.loader import load_model

            device = resolve_device(device)
            model, loaded_tok = load_model(model, dtype=dtype or compute_dtype(device), device=device)
            tokenizer = tokenizer or loaded_tok
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise ConfigError(f"model must be a path, 'smollm2' or a CausalLM, got {type(model).__name__}")
        if model_name is None:
            _check_model_placement(model, device, dtype)
        if backend not in ("oasis", "dense"):
            raise ConfigError(f"backend must be 'oasis' or 'dense', got {backend!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        #: Where the model runs (a ``torch.device``).
        self.device = next(model.parameters()).device
        #: Whether decode steps replay as CUDA graphs: on a GPU unless ``enforce_eager``.
        self.cuda_graphs = self.device.type == "cuda" and not enforce_eager
        self.enforce_eager = enforce_eager
        kv = kv or KvConfig()
        if not isinstance(kv, KvConfig):
            raise ConfigError(f"kv must be a KvConfig, got {type(kv).__name__}")
        if backend == "oasis" and drafter is None:
            drafter = "previous-query"
        self.drafter = make_drafter(drafter, model=self.model, model_name=model_name)
        eos = list(
            getattr(tokenizer, "eos_token_ids", None) or getattr(model.config, "eos_token_ids", None) or []
        )
        self.engine = Engine(
            self.model,
            kv,
            backend,
            self.drafter,
            eos,
            prefill_cache,
            max_num_seqs=max_num_seqs,
            gpu_kv_budget_bytes=gpu_kv_budget_bytes,
            host_kv_budget_bytes=host_kv_budget_bytes,
            policy=policy,
            host_pool=host_pool,
            cuda_graph=self.cuda_graphs,
        )
        #: The cache configuration, its ``"auto"`` fields resolved for this engine's drafter.
        self.kv = self.engine.kv
        self.max_num_seqs = max_num_seqs
        if not isinstance(speculative, bool):
            raise ConfigError(f"speculative must be a bool, got {speculative!r}")
        if speculative and self.engine.rows != 2:
            raise ConfigError(
                "speculative=True verifies the lookahead draft, so it needs a drafter with a "
                f"lookahead row ('ngram', 'eagle3', an Eagle3Drafter or OracleDrafter), got {drafter!r}"
            )
        self.speculative = speculative
        # Speculative decoding, over every decode step of every request: request-steps, tokens
        # they made, drafts verified and accepted (spec_stats).
        self._spec_counts = [0, 0, 0, 0]
        #: Optional hook: ``recorder.on_step(StepInfo)`` after every forward, before sampling.
        self.recorder = None
        self.max_num_batched_tokens = max_num_batched_tokens
        # Requests without a seed: with an engine seed they draw from one generator seeded by it
        # (reproducible run to run); without, each gets a fresh random seed of its own.
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self._ids = itertools.count()
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []  # admitted, prompt partly prefilled
        self._running: list[_Seq] = []
        self._done: list[_Seq] = []  # finished outside step() (aborts), reported by the next step
        self._by_id: dict[str, _Seq] = {}
        #: The staging daemon's client (``kv_source``), or None.
        self.kv_source = None
        if kv_source is not None:
            self.kv_source = self._connect_kv_source(
                kv_source, kv_transfer, kv_token, kv_timeout_s, kv_retries, self.cuda_graphs, kv_cache_blocks
            )
        elif kv_cache_blocks is not None:
            raise ConfigError("kv_cache_blocks bounds the host pool of staged requests; it needs kv_source")

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stop: Callable[[list[int]], bool] | None = None,
        forced_tokens: Sequence[int] | None = None,
    ) -> str:
        """Queue a request; returns its id. ``prompt`` is text or token ids.

        ``forced_tokens`` (teacher forcing, for evaluation): the request's i-th token is
        ``forced_tokens[i]`` instead of a sample, as long as there are any; the logits are still
        computed and shown to the recorder.

        ``stop(generated)``, if given, is called after every token with the token ids generated so
        far; True ends the request there (finish reason ``"stop"``, the token kept).

        Raises :class:`ContextLengthError` when the prompt plus ``max_tokens`` passes the model's
        context, :class:`OutOfBlocksError` when the request could never fit the pools' budgets,
        :class:`ConfigError` for a bad prompt or id. Nothing is queued then.
        """
        return self._add(prompt, params, request_id, stop, forced_tokens, None)

    def _add(self, prompt, params, request_id, stop, forced_tokens, staged) -> str:
        """Queue a request (``staged``: a StagedRequest, admitted sparse from the daemon)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.logprobs is not None and (self.speculative or staged is not None):
            raise ConfigError(
                "SamplingParams(logprobs=...) needs a non-speculative engine and a local prefill; "
                "pass logprobs=None, or speculative=False"
            )
        ids = prompt_token_ids(prompt, self.tokenizer, self.model.config.vocab_size)
        ctx = self.model.config.max_position_embeddings
        # The last new token is sampled, never fed: positions 0 .. len + max_tokens - 2 are used.
        if len(ids) + params.max_tokens - 1 > ctx:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens and max_tokens={params.max_tokens}: "
                f"{len(ids) + params.max_tokens - 1} positions exceeds the model's context of {ctx} "
                "tokens; shorten the prompt or lower max_tokens"
            )
        self.engine.check_fits(
            len(ids), params.max_tokens, sparse=staged is not None, cache_blocks=self._cache_of(staged)
        )
        n = next(self._ids)
        rid = str(n) if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise ConfigError(f"request_id must be a non-empty str, got {rid!r}")
        if rid in self._by_id:
            raise ConfigError(f"request_id {rid!r} is already in use; pass a unique id")
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        elif self._gen is None:
            gen = torch.Generator().manual_seed(secrets.randbits(63))  # a fresh seed per request
        else:
            gen = None  # the engine's generator
        forced = None
        if forced_tokens is not None:
            forced = prompt_token_ids(
                list(forced_tokens), None, self.model.config.vocab_size, "forced_tokens"
            )
        seq = _Seq(
            rid, Request(id=n, prompt=ids, max_new_tokens=params.max_tokens), params, gen, stop, forced
        )
        seq.staged = staged
        self._waiting.append(seq)
        self._by_id[rid] = seq
        return rid

    def _connect_kv_source(self, src, transfer, token, timeout_s, retries, cuda_graph, cache_blocks=None):
        from .disagg import RemoteKvSource

        if transfer == "partial" and cuda_graph and cache_blocks is not None:
            raise ConfigError(
                "kv_cache_blocks moves host rows between a step's layers, which a captured CUDA graph "
                "cannot follow; pass enforce_eager=True or kv_cache_blocks=None"
            )
        if self.drafter is not None and self.drafter.wants_prompt_features:
            raise ConfigError(
                "a staged request has no prompt features for this drafter (EAGLE-3); pass drafter='ngram'"
            )
        if self.kv.block_score != "quest":
            raise ConfigError(
                "a staged request comes with min/max summaries only (key codes are not transferred "
                "yet), so the default selection cannot rank its blocks; pass kv=KvConfig.fast()"
            )
        return RemoteKvSource(
            self.engine,
            src,
            transfer,
            token=token,
            timeout_s=timeout_s,
            retries=retries,
            cache_blocks=cache_blocks,
        )

    def _cache_of(self, staged) -> int | None:
        """The host cache (``kv_cache_blocks``) of a staged request; None for a local one."""
        return self.kv_source.cache_blocks if staged is not None and self.kv_source is not None else None

    def add_staged_request(
        self,
        handle,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stop: Callable[[list[int]], bool] | None = None,
    ) -> str:
        """Queue a request whose prompt a :class:`~oasiskv.disagg.PrefillWorker` prefilled into
        the staging daemon (``handle``: its :class:`~oasiskv.disagg.StagedRequest`, or that
        object's JSON). It waits for admission like any request; admitted, its KV comes from the
        daemon (``kv_transfer``) instead of a prefill, its first token is the handle's, and it
        decodes sparsely from its first step. Needs ``kv_source``. Raises as
        :meth:`add_request`."""
        from .disagg import StagedRequest

        if self.kv_source is None:
            raise ConfigError("add_staged_request needs LLMEngine(kv_source='oasis-rt://HOST:PORT')")
        if not isinstance(handle, StagedRequest):
            handle = StagedRequest.from_json(handle)
        return self._add(list(handle.prompt), params, request_id, stop, None, handle)

    def _admit_staged(self, seq: _Seq, touched: list[_Seq]) -> None:
        """Admit a staged request from the daemon (in place of its prefill) and take its first
        token; a failure finishes it with an error and the others go on."""
        r = seq.req
        if self.drafter is not None:
            self.drafter.begin(r.id, r.prompt)
        r.tokens = list(r.prompt)
        t0 = time.perf_counter()
        touched.append(seq)
        try:
            self.kv_source.admit(r, seq.staged)
        except (OasisError, torch.OutOfMemoryError) as e:
            self._finish(seq, "error", f"admission from the staging daemon failed: {e}")
            return
        r.metrics.prefill_s += time.perf_counter() - t0
        r.metrics.prompt_tokens = len(r.prompt)
        self._accept(seq, seq.staged.first_token)
        if r.finish_reason is None:
            self._running.append(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a waiting or running request and return its blocks to the pools; the next
        :meth:`step` reports it with ``finish_reason="abort"``. Unknown ids are ignored."""
        seq = self._by_id.get(request_id)
        if seq is None or seq.req.finish_reason is not None:
            return
        for queue in (self._waiting, self._prefilling, self._running):
            if seq in queue:
                queue.remove(seq)
                break
        self._finish(seq, "abort")
        self._done.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._prefilling or self._running or self._done)

    def get_num_unfinished_requests(self) -> int:
        return len(self._waiting) + len(self._prefilling) + len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests: decoding, or with their prompt partly prefilled."""
        return len(self._running) + len(self._prefilling)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Admit and prefill what fits, decode one token for every running request, and report
        every request that made a token or finished in this step."""
        touched: list[_Seq] = list(self._done)
        self._done.clear()
        self._prefill(touched)
        if self._running:
            self._decode(touched)
        out = []
        seen = set()
        for seq in touched:
            if id(seq) in seen:
                continue
            seen.add(id(seq))
            out.append(self._output(seq))
            seq.new = []
            seq.new_logprobs = []
            if seq.req.finish_reason is not None:
                self._by_id.pop(seq.request_id, None)
        return out

    def _prefill(self, touched: list[_Seq]) -> None:
        """Spend this step's prompt-token budget: first on the prompts being prefilled (in
        admission order), then on waiting requests admitted first come, first served while a seat
        is free and their peak KV need fits. A prompt longer than what is left of the budget is
        prefilled in chunks over the next steps, between decode steps."""
        eng = self.engine
        budget = self.max_num_batched_tokens
        queue = list(self._prefilling)
        src = self.kv_source
        busy = bool(self._running)  # others decode this step: a staged admission must not stall them
        if src is not None:
            # The first waiting staged requests' data is read in the background meanwhile.
            staged = (s.staged for s in self._waiting if s.staged is not None)
            for handle in itertools.islice(staged, src.prefetch_depth):
                src.prefetch(handle)
        while budget > 0:
            if queue:
                seq = queue.pop(0)
            elif self._waiting and len(self._running) + len(self._prefilling) < self.max_num_seqs:
                seq = self._waiting[0]
                # A staged request reserves its working set only (Engine.admit_sparse).
                if not eng.can_admit(
                    len(seq.req.prompt),
                    seq.req.max_new_tokens,
                    sparse=seq.staged is not None,
                    cache_blocks=self._cache_of(seq.staged),
                ):
                    break  # it waits, and so does everyone behind it (no overtaking)
                if seq.staged is not None and busy and not src.ready(seq.staged):
                    break  # its data is still being read ahead: decode the others meanwhile
                self._waiting.popleft()
                if seq.staged is not None:
                    self._admit_staged(seq, touched)
                    continue
                self._prefilling.append(seq)
                if self.drafter is not None:
                    self.drafter.begin(seq.req.id, seq.req.prompt)
                seq.req.tokens = list(seq.req.prompt)
            else:
                break
            r = seq.req
            start = seq.prefilled
            end = min(len(r.prompt), start + budget)
            budget -= end - start
            t0 = time.perf_counter()
            try:
                logits = eng.prefill_chunk(r, start, end)
            except (OasisError, torch.OutOfMemoryError) as e:
                self._prefilling.remove(seq)
                self._finish(seq, "error", f"prefill failed: {e}")
                touched.append(seq)
                continue
            seq.prefilled = end
            r.metrics.prefill_s += time.perf_counter() - t0
            if logits is None:
                continue  # more of the prompt next step
            self._prefilling.remove(seq)
            r.metrics.prompt_tokens = len(r.prompt)
            if self.recorder is not None:
                self.recorder.on_step(StepInfo("prefill", [seq.request_id], logits.unsqueeze(0), [None]))
            self._accept(seq, self._sample(seq, logits.unsqueeze(0))[0])
            touched.append(seq)
            if r.finish_reason is None:
                self._running.append(seq)

    @property
    def spec_stats(self) -> dict:
        """Speculative decoding over the engine's life (all requests): ``steps`` (decode steps,
        counted per request), ``tokens`` (tokens those steps made), ``drafts`` (drafts verified),
        ``accepted`` (drafts accepted), ``acceptance_rate`` (accepted / drafts, None before any)
        and ``tokens_per_step`` (tokens / steps, None before any)."""
        steps, tokens, drafts, accepted = self._spec_counts
        return {
            "steps": steps,
            "tokens": tokens,
            "drafts": drafts,
            "accepted": accepted,
            "acceptance_rate": accepted / drafts if drafts else None,
            "tokens_per_step": tokens / steps if steps else None,
        }

    def _decode(self, touched: list[_Seq]) -> None:
        if self.speculative:
            self._decode_speculative(touched)
            return
        eng = self.engine
        running = self._running
        reqs = [s.req for s in running]
        t0 = time.perf_counter()
        drafts = [r.draft for r in reqs] if eng.rows == 2 else [None] * len(reqs)
        logits = eng.decode_step(reqs)
        if self.recorder is not None:
            self.recorder.on_step(StepInfo("decode", [s.request_id for s in running], logits, drafts))
        toks = self._sample_batch(running, logits, launch=self._launcher(running))
        dt = time.perf_counter() - t0
        # Requests whose KV the staging daemon failed to serve in this step: their logits are void.
        failed = self.kv_source.take_failed() if self.kv_source is not None else {}
        going = []
        for seq, tok in zip(running, toks, strict=True):
            seq.req.metrics.decode_s += dt / len(running)
            if seq.req.id in failed:
                self._finish(seq, "error", failed[seq.req.id])
            elif self._take(seq, tok):
                going.append(seq)
            touched.append(seq)
        self._next_drafts(going)
        self._running = [seq for seq in running if seq.req.finish_reason is None]

    def _decode_speculative(self, touched: list[_Seq]) -> None:
        """One decode step that verifies each request's draft: every request gains its next token
        (row 0), and those whose draft is accepted one more (row 1), whose draft's K/V the step
        computed is stored in a slot the plan reserved for it. Every request is verified inside
        the step, on the device (``Engine.decode_step(speculate=..., sampling=...)``, the same
        code eager and in a CUDA graph): greedy ones against row 0's argmax, sampling ones by the
        speculative-sampling rule with three uniforms drawn here from the request's generator
        (:meth:`_row_sampling`); ``Engine.commit_drafts`` then moves the tables on by one or two
        tokens. A request tries only if it can take both tokens: no forced tokens, two tokens left
        under ``max_tokens``, and room in the runtime (``Runtime.can_append``: not about to turn
        sparse, not a sparse request whose draft would complete its local block). One that stops
        on the first token takes no second. A drafter that forces verdicts
        (``Drafter.forced_verdicts``, measurement only) has them applied to its greedy rows
        (:meth:`_forced_verdicts`), as step inputs too."""
        eng = self.engine
        running = self._running
        reqs = [s.req for s in running]
        t0 = time.perf_counter()
        drafts = [r.draft for r in reqs]
        tries = [
            seq.forced is None and seq.req.metrics.generated_tokens + 2 <= seq.req.max_new_tokens
            for seq in running
        ]
        sampling = [self._row_sampling(seq) for seq in running]
        verdicts = self._forced_verdicts(running, tries, sampling)
        launch = self._spec_launcher(running)
        res = eng.decode_step(reqs, speculate=tries, sampling=sampling, verdicts=verdicts, before_read=launch)
        try:
            if self.recorder is not None:
                self.recorder.on_step(StepInfo("decode", [s.request_id for s in running], res.logits, drafts))
            firsts, seconds = self._verify_batch(running, res)
        except BaseException:
            eng.commit_drafts()  # the step's verdicts stand
            raise
        dt = time.perf_counter() - t0
        counts = self._spec_counts
        two: list[tuple[_Seq, int]] = []
        for i, (seq, tok, tok2) in enumerate(zip(running, firsts, seconds, strict=True)):
            r, m = seq.req, seq.req.metrics
            m.decode_s += dt / len(running)
            counts[0] += 1
            if res.tried[i]:
                m.draft_tokens += 1
                counts[2] += 1
                # The step's flag (a forced rejection may leave the draft as row 0's token).
                if tok is not None and res.accepted[i]:
                    m.accepted_tokens += 1
                    counts[3] += 1
            touched.append(seq)
            # A request that stops here is released, and its draft slot with it.
            if self._take(seq, tok) and tok2 is not None:
                two.append((seq, tok2))
        eng.commit_drafts()
        for seq, tok2 in two:
            seq.req.features = seq.req.draft_features  # the features of the accepted draft's row
            self._take(seq, tok2)
        took_two = {id(seq) for seq, _ in two}
        for seq in running:
            r, m = seq.req, seq.req.metrics
            made = 2 if id(seq) in took_two else 1
            m.decode_tokens += made
            counts[1] += made
            m.tokens_per_step = m.decode_tokens / m.steps if m.steps else None
            m.acceptance_rate = m.accepted_tokens / m.draft_tokens if m.draft_tokens else None
            r.draft_features = None
        self._next_drafts([seq for seq in running if seq.req.finish_reason is None])
        self._running = [seq for seq in running if seq.req.finish_reason is None]

    def _forced_verdicts(
        self, seqs: list[_Seq], tries: list[bool], sampling: list[RowSampling | None]
    ) -> list[bool | None] | None:
        """The drafter's forced verdicts of this step's drafts (``Drafter.forced_verdicts``;
        measurement only), kept for the greedy rows that try (None elsewhere: sampling rows keep
        the speculative-sampling rule); None when it forces none (every real drafter)."""
        reqs = [s.req for s in seqs]
        got = self.drafter.forced_verdicts([r.id for r in reqs], [r.tokens for r in reqs])
        if got is None:
            return None
        if len(got) != len(reqs):
            raise ConfigError(
                f"{type(self.drafter).__name__}.forced_verdicts returned {len(got)} verdicts for "
                f"{len(reqs)} requests; return one per request (None where it forces none)"
            )
        out = [v if t and s is None else None for v, t, s in zip(got, tries, sampling, strict=True)]
        return out if any(v is not None for v in out) else None

    def _row_sampling(self, seq: _Seq) -> RowSampling | None:
        """What a speculative step needs to sample for this request: None where it is greedy (or
        its token is forced), else its temperature, top_p and three uniforms drawn from its own
        generator (the engine's where it has no seed), three every step whether or not its draft
        is tried, so a seeded request's stream depends on nothing else in the batch."""
        p = seq.params
        made = len(seq.req.tokens) - len(seq.req.prompt)
        if p.temperature <= 0.0 or (seq.forced is not None and made < len(seq.forced)):
            return None
        u = torch.rand(3, generator=seq.gen or self._gen, dtype=torch.float64).tolist()
        return RowSampling(float(p.temperature), float(p.top_p), *u)

    def _verify_batch(self, seqs: list[_Seq], res) -> tuple[list[int | None], list[int | None]]:
        """Each request's next token and, where the step accepted its draft, the token after it
        (else None), from the step's one host read (``res``). The step chose them on the device
        (``Engine._verify_drafts``): greedy rows by argmax, sampling rows by the speculative-
        sampling rule (``engine.verify_sampled_drafts``), so every token has the non-speculative
        sampler's distribution; a forced verdict's hit has the draft as its first token. Non-finite
        logits give None; forced tokens win."""
        firsts: list[int | None] = []
        seconds: list[int | None] = []
        for i, seq in enumerate(seqs):
            made = len(seq.req.tokens) - len(seq.req.prompt)
            second = None
            if not res.finite[i]:
                first = None
            elif seq.forced is not None and made < len(seq.forced):
                first = seq.forced[made]
            else:
                first = res.token[i]
                if res.accepted[i]:
                    second = res.token2[i]
            firsts.append(first)
            seconds.append(second)
        return firsts, seconds

    # ------------------------------------------------------------------ sampling
    def _sample(self, seq: _Seq, logits: torch.Tensor) -> list[int | None]:
        return self._sample_batch([seq], logits)

    def _launcher(self, seqs: list[_Seq]):
        """What starts the next drafts from the step's tokens still on the device
        (:meth:`Drafter.launch_batch`), or None where the drafter would see other tokens or
        inputs than the step's own: no lookahead row, a forced token, a request without
        captured features."""
        if self.engine.rows != 2 or not seqs:
            return None
        if any(s.forced is not None or s.req.features is None for s in seqs):
            return None
        # Not those whose token is their last (max_tokens): no draft follows it.
        rows = [i for i, s in enumerate(seqs) if s.req.metrics.generated_tokens + 1 < s.req.max_new_tokens]
        if not rows:
            return None
        reqs = [seqs[i].req for i in rows]

        def launch(tokens: torch.Tensor) -> None:
            feats = torch.stack([r.features for r in reqs])
            if len(rows) < len(seqs):
                tokens = tokens.index_select(0, torch.tensor(rows).to(tokens.device, non_blocking=True))
            self.drafter.launch_batch([r.id for r in reqs], [len(r.tokens) for r in reqs], tokens, feats)

        return launch

    def _spec_launcher(self, seqs: list[_Seq]):
        """As :meth:`_launcher`, for a speculative step: each request's next draft follows its
        last token of the step, row 0's or, where the draft was accepted, row 1's (its token,
        the draft row's features, one position on), chosen on the device from the step's
        verdict. Not for requests that may take their last token in this step."""
        if self.engine.rows != 2 or not seqs or any(s.forced is not None for s in seqs):
            return None
        rows = [i for i, s in enumerate(seqs) if s.req.metrics.generated_tokens + 2 < s.req.max_new_tokens]
        if not rows:
            return None
        reqs = [seqs[i].req for i in rows]

        def launch(verdict: torch.Tensor, feats0, feats1) -> None:
            if feats0 is None or feats1 is None:
                return
            dev = verdict.device
            at = torch.tensor(rows).to(dev, non_blocking=True)
            v = verdict.index_select(1, at)
            acc = v[4].bool()
            tokens = torch.where(acc, v[2], v[0])
            feats = torch.where(acc[:, None], feats1.index_select(0, at), feats0.index_select(0, at))
            pos = torch.tensor([len(r.tokens) for r in reqs]).to(dev, non_blocking=True) + acc.long()
            self.drafter.launch_batch([r.id for r in reqs], pos, tokens, feats)

        return launch

    def _sample_batch(self, seqs: list[_Seq], logits: torch.Tensor, launch=None) -> list[int | None]:
        """One token per row, or None where the row's logits are not finite. Every row is
        decided on the logits' device and the batch takes one host read: greedy rows their
        argmax, sampling rows a draw from :func:`~oasiskv.engine.sampling_probs` (temperature,
        then top_p) by :func:`~oasiskv.engine.sample_inverse_cdf` at a uniform from the request's
        own generator (the engine's when unseeded), drawn on the host in row order. ``launch``
        (:meth:`_launcher`) gets the rows' tokens on the device before that read."""
        finite = torch.isfinite(logits).all(dim=-1)
        made = [len(seq.req.tokens) - len(seq.req.prompt) for seq in seqs]
        forced = [seq.forced is not None and m < len(seq.forced) for seq, m in zip(seqs, made, strict=True)]
        rows = [i for i, seq in enumerate(seqs) if seq.params.temperature > 0.0 and not forced[i]]
        cols = [logits.argmax(dim=-1), finite.long()]
        if rows:
            params = [seqs[i].params for i in rows]
            gens = [seqs[i].gen or self._gen for i in rows]
            uniforms = [float(torch.rand((), generator=g, dtype=torch.float64)) for g in gens]
            temps, top_ps = [p.temperature for p in params], [p.top_p for p in params]
            at = torch.tensor(rows).to(logits.device, non_blocking=True)
            drawn = _sample_rows(logits, at, temps, top_ps, uniforms)
            cols.append(torch.zeros_like(cols[0]).index_copy_(0, at, drawn))
        stacked = torch.stack(cols)
        if launch is None:
            host = stacked.tolist()
        else:
            # The tokens' copy is queued before the drafts, so the host reads them as soon as
            # the step is done, while the GPU runs the drafter.
            host_t, ready = copy_to_host(stacked)
            launch(cols[0] if not rows else cols[0].index_copy(0, at, drawn))
            if ready is not None:
                ready.synchronize()
            host = host_t.tolist()
        out: list[int | None] = []
        for i, seq in enumerate(seqs):
            if not host[1][i]:
                out.append(None)
            elif forced[i]:
                out.append(seq.forced[made[i]])
            elif seq.params.temperature <= 0.0:
                out.append(host[0][i])
            else:
                out.append(host[2][i])
        self._record_logprobs(seqs, logits, out)
        return out

    def _record_logprobs(self, seqs: list[_Seq], logits: torch.Tensor, toks: list[int | None]) -> None:
        """Append each token's ``{token_id: logprob}`` (:attr:`SamplingParams.logprobs`) to the
        requests that asked: one batched log-softmax and top-k, one host read."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and toks[i] is not None]
        if not rows:
            return
        at = torch.tensor(rows).to(logits.device, non_blocking=True)
        lp = torch.log_softmax(logits.index_select(0, at).float(), dim=-1)
        picked = torch.tensor([toks[i] for i in rows]).to(logits.device, non_blocking=True)
        chosen = lp.gather(1, picked.unsqueeze(1)).squeeze(1).tolist()
        k = min(max(seqs[i].params.logprobs for i in rows), lp.shape[-1])
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(rows):
            n = seqs[i].params.logprobs
            d = dict(zip(top_i[j][:n], top_v[j][:n], strict=True))
            d.setdefault(toks[i], chosen[j])
            seqs[i].new_logprobs.append(d)

    def _accept(self, seq: _Seq, tok: int | None) -> None:
        """Append a sampled token, check the stop conditions, draft the next lookahead token and
        turn the request sparse once its context passes the threshold."""
        if self._take(seq, tok):
            self._next_drafts([seq])

    def _take(self, seq: _Seq, tok: int | None) -> bool:
        """Append a sampled token and check the stop conditions; whether the request goes on."""
        eng, r, p = self.engine, seq.req, seq.params
        if tok is None:
            self._finish(seq, "error", "the model produced non-finite logits (NaN or inf)")
            return False
        r.tokens.append(tok)
        seq.new.append(tok)
        r.metrics.generated_tokens += 1
        generated = r.tokens[len(r.prompt) :]
        if not p.ignore_eos and tok in eng.eos or tok in p.stop_token_ids:
            reason = "stop"
        elif seq.stop is not None and seq.stop(generated):
            reason = "stop"
        elif r.metrics.generated_tokens >= r.max_new_tokens:
            reason = "length"
        else:
            reason = None
        if reason is not None:
            self._finish(seq, reason)
            return False
        return True

    def _next_drafts(self, seqs: list[_Seq]) -> None:
        """Draft the next lookahead token of every request in ``seqs`` -- one
        ``Drafter.propose_batch`` call, so a model drafter runs once per step, not once per
        request -- and turn each request sparse once its context passes the threshold."""
        eng = self.engine
        if eng.rows == 2 and seqs:
            reqs = [s.req for s in seqs]
            drafts = self.drafter.propose_batch(
                [r.id for r in reqs], [r.tokens for r in reqs], [r.features for r in reqs]
            )
            for r, d in zip(reqs, drafts, strict=True):
                r.draft = d
            tau = eng.kv.lookahead_min_confidence
            if tau is not None:  # the drafter was unsure: the step's own query selects
                conf = self.drafter.last_confidence
                for r in reqs:
                    r.own_query = conf.get(r.id, 1.0) < tau
        for seq in seqs:
            r = seq.req
            if eng.backend == "oasis" and not r.sparse and eng.runtime.wants_sparse(r.id):
                try:
                    eng.make_sparse(r)
                except (OasisError, torch.OutOfMemoryError) as e:
                    # Its blocks go back with it; the others go on.
                    self._finish(seq, "error", f"turning the request sparse failed: {e}")

    def _finish(self, seq: _Seq, reason: str, error: str | None = None) -> None:
        r = seq.req
        r.finish_reason = reason
        seq.error = error
        if r.runtime is not None:
            self.engine.finalize_metrics(r)
        if self.kv_source is not None:
            self.kv_source.end(r)
            if seq.staged is not None:
                self.kv_source.drop_prefetch(seq.staged.request_id)
        self.engine.release(r)

    def _output(self, seq: _Seq) -> RequestOutput:
        r = seq.req
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=r.prompt,
            new_token_ids=list(seq.new),
            token_ids=(
                r.tokens[len(r.prompt) :]
                if r.tokens and (self.output_kind == "cumulative" or r.finish_reason is not None)
                else []
            ),
            finished=r.finish_reason is not None,
            finish_reason=r.finish_reason,
            metrics=r.metrics,
            error=seq.error,
            new_logprobs=list(seq.new_logprobs) if seq.params.logprobs is not None else None,
        )

    # ------------------------------------------------------------------ batch helper
    def run_to_completion(self, request_ids: list[str], progress=None) -> dict[str, RequestOutput]:
        """Step until every one of ``request_ids`` has finished; their last outputs by id. On an
        exception (or Ctrl-C) every unfinished request is aborted, so nothing stays allocated."""
        want = set(request_ids)
        last: dict[str, RequestOutput] = {}
        try:
            while want - {k for k, o in last.items() if o.finished}:
                for o in self.step():
                    if o.request_id in want:
                        last[o.request_id] = o
                        if progress is not None:
                            progress(len(o.new_token_ids))
        except BaseException:
            # Abort them and forget them at once: no later step reports them (a step that raised,
            # e.g. in a request's stop callback, would otherwise leave them in _by_id).
            for rid in want:
                self.abort_request(rid)
                self._by_id.pop(rid, None)
            self._done = [s for s in self._done if s.request_id not in want]
            raise
        return last

    def result(self, out: RequestOutput, skip_special_tokens: bool = True) -> GenerationResult:
        """A finished request's :class:`GenerationResult` (tokens, text, metrics); the text
        without special tokens unless ``skip_special_tokens`` is False (:func:`output_text`)."""
        tok = self.tokenizer
        text = output_text(tok, out.token_ids, skip_special_tokens) if tok is not None else None
        seq_id = int(out.request_id) if out.request_id.isdigit() else -1
        reason = out.finish_reason or "abort"
        return GenerationResult(
            seq_id, list(out.prompt_token_ids), list(out.token_ids), text, reason, out.metrics
        )


def _sample_rows(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    uniforms: list[float],
) -> torch.Tensor:
    """A token for each of ``rows`` (int64, on the logits' device) of ``logits`` ``[n, vocab]``:
    the row's sampling distribution at its temperature and top_p (:func:`~oasiskv.engine.sampling_probs`;
    the top-p sort only where some row cuts, top_p < 1) inverted at its uniform. Returns
    ``[len(rows)]`` int64 token ids. One batched pass: no per-row copy of the vocabulary to the
    host (at 151K tokens and 32 sampling rows that was a host copy, softmax and multinomial per
    row and step)."""
    # One host-to-device copy for the three per-row inputs.
    inputs = torch.tensor([temperatures, top_ps, uniforms], dtype=torch.float64)
    temp, top_p, u = inputs.to(logits.device, non_blocking=True)
    probs = sampling_probs(logits.index_select(0, rows), temp, top_p, nucleus=any(p < 1.0 for p in top_ps))
    return sample_inverse_cdf(probs, u)
