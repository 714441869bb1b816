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

The package's rooms, each a module: :mod:`.params` (:class:`SamplingParams`,
:class:`RequestOutput`, :class:`StepInfo`), :mod:`.prompts` (prompt ids in, text out),
:mod:`.options` (construction checks), :mod:`.scheduler` (queues, admission, chunked prefill),
:mod:`.decode` (the decode step, plain and speculative), :mod:`.sampling` (token choice, one host
read per batch), :mod:`.drafting` (the next drafts and their device launchers) and
:mod:`.lifecycle` (stop conditions, finish, outputs). :class:`LLMEngine`, here, is the façade:
construction, the public request API and the step that runs the rooms in order. The batch API
over it, :class:`~oasiskv.LLM`, is :mod:`oasiskv.llm`.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Callable, Sequence

import torch

from ..config import KvConfig
from ..drafters import Drafter, make_drafter
from ..engine import Engine, GenerationResult, PrefillCache, check_engine_model
from ..errors import ConfigError
from .decode import Decoder
from .drafting import Drafting
from .lifecycle import Lifecycle
from .options import MODEL_DTYPES, check_model_placement, resolve_enforce_eager
from .params import FINISH_REASONS, MAX_LOGPROBS, RequestOutput, SamplingParams, StepInfo, is_int
from .prompts import output_text, prompt_token_ids
from .sampling import Sampler, sample_rows
from .scheduler import Scheduler, Seq

__all__ = [
    "FINISH_REASONS",
    "MAX_LOGPROBS",
    "MODEL_DTYPES",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StepInfo",
    "output_text",
    "prompt_token_ids",
]

# The names these had when the package was one module (kept importable). ``_sample_rows`` is also
# the one host sampler LLMEngine calls (:meth:`LLMEngine._draw_rows`), looked up here at each
# call, so a test may count its calls by replacing it.
_is_int = is_int
_enforce_eager = resolve_enforce_eager
_check_model_placement = check_model_placement
_Seq = Seq
_sample_rows = sample_rows


class LLMEngine(Scheduler, Decoder, Sampler, Drafting, Lifecycle):
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
        kv_prefetch: with ``kv_transfer="partial"``, block-heads a step may also read in the
            background that the next steps will probably need (each planned block's successor,
            the newest staged blocks), at most this many per step and in flight
            (``RemoteKvSource.decode_prefetch``); 0 turns it off. None: the source's default.
        kv_in_step_reads: with ``kv_transfer="partial"``, read each step's misses while the step
            runs: every layer publishes its plan to the coordinator's step reader and its gather
            waits for that layer's reads alone (``RemoteKvSource.in_step_reads``,
            :mod:`oasiskv.disagg.in_step`). None (the default): on wherever it applies (a
            partial transfer without ``kv_cache_blocks``; on an H100 it cut Fig. 12's partial
            TPOT over TCP from 2.0-2.5 x the full transfer's to 1.01-1.15 x, docs/PERF.md s27).
            True: on, a ConfigError where it cannot apply. False: the misses are read after the
            step.
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
        kv_prefetch: int | None = None,
        kv_in_step_reads: bool | None = None,
    ) -> None:
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not is_int(v) or not 1 <= v <= 1 << 20:
                raise ConfigError(f"{name} must be an int in 1..={1 << 20}, got {v!r}")
        budgets = {"gpu_kv_budget_bytes": gpu_kv_budget_bytes, "host_kv_budget_bytes": host_kv_budget_bytes}
        for name, v in budgets.items():
            if v is not None and (not is_int(v) or v < 0):
                raise ConfigError(f"{name} must be None or an int >= 0, got {v!r}")
        model_name = model if isinstance(model, str) else None
        if output_kind not in ("cumulative", "delta"):
            raise ConfigError(f"output_kind must be 'cumulative' or 'delta', got {output_kind!r}")
        self.output_kind = output_kind
        if seed is not None and (not is_int(seed) or not 0 <= seed < 2**63):
            raise ConfigError(
                f"seed must be None (a fresh seed per request) or an int in [0, 2**63), got {seed!r}"
            )
        enforce_eager = resolve_enforce_eager(enforce_eager, cuda_graph)
        if dtype is not None and dtype not in MODEL_DTYPES:
            raise ConfigError(
                f"dtype must be None (auto), torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}"
            )
        if isinstance(model, str):
            from ..devices import compute_dtype, resolve_device
            from ..models.loader import load_model

            device = resolve_device(device)
            model, loaded_tok = load_model(model, dtype=dtype or compute_dtype(device), device=device)
            tokenizer = tokenizer or loaded_tok
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a path, 'smollm2' or a CausalLM, got {type(model).__name__}")
        check_engine_model(model)
        if model_name is None:
            check_model_placement(model, device, dtype)
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
        self._waiting: deque[Seq] = deque()
        self._prefilling: list[Seq] = []  # admitted, prompt partly prefilled
        self._running: list[Seq] = []
        self._done: list[Seq] = []  # aborted, or touched by prefill_only(): reported by the next step
        self._by_id: dict[str, Seq] = {}
        #: The staging daemon's client (``kv_source``), or None.
        self.kv_source = None
        if kv_source is not None:
            self.kv_source = self._connect_kv_source(
                kv_source, kv_transfer, kv_token, kv_timeout_s, kv_retries, self.cuda_graphs, kv_cache_blocks
            )
            if kv_in_step_reads is None:  # on wherever it applies
                kv_in_step_reads = self.kv_source.can_read_in_step
            try:
                if kv_prefetch is not None:
                    self.kv_source.decode_prefetch = kv_prefetch  # validated there
                if kv_in_step_reads is not False:
                    self.kv_source.in_step_reads = kv_in_step_reads  # validated there
            except ConfigError:
                self.kv_source.close()  # the connections the refused engine opened
                raise
        elif kv_cache_blocks is not None:
            raise ConfigError("kv_cache_blocks bounds the host pool of staged requests; it needs kv_source")
        elif kv_prefetch is not None:
            raise ConfigError("kv_prefetch reads ahead the blocks of staged requests; it needs kv_source")
        elif kv_in_step_reads is not None and kv_in_step_reads is not False:
            raise ConfigError("kv_in_step_reads reads the misses of staged requests; it needs kv_source")

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
        decodes sparsely from its first step (a prompt too short for ``sparse_threshold`` too,
        where the budget holds its whole context: the dense attention). Needs ``kv_source``.
        Raises as :meth:`add_request`."""
        from ..disagg import StagedRequest

        if self.kv_source is None:
            raise ConfigError("add_staged_request needs LLMEngine(kv_source='oasis-rt://HOST:PORT')")
        if not isinstance(handle, StagedRequest):
            handle = StagedRequest.from_json(handle)
        return self._add(list(handle.prompt), params, request_id, stop, None, handle)

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
        touched: list[Seq] = list(self._done)
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

    def reserve_pools(self, sizes: list[tuple[int, int]]) -> None:
        """Grow the KV pools now (up to their caps) for requests of ``(prompt tokens, max new
        tokens)`` each beside the running ones, in one allocation, instead of as requests arrive:
        growing a pinned host pool costs about 0.6 s per GiB and drops the captured graphs, which
        a server pays once rather than mid-batch. Admission still checks every request."""
        checked = []
        for item in sizes:
            try:
                n, m = (operator.index(x) for x in item)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"reserve_pools takes (prompt_tokens, max_tokens) pairs of ints, got {item!r}"
                ) from None
            if n < 1 or m < 0:
                raise ConfigError(f"reserve_pools: prompt_tokens >= 1 and max_tokens >= 0, got {item!r}")
            checked.append((n, m))
        self.engine.reserve_pools(checked)

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

    def _draw_rows(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        temperatures: list[float],
        top_ps: list[float],
        uniforms: list[float],
    ) -> torch.Tensor:
        """The sampling rows' tokens (:func:`~oasiskv.llm_engine.sampling.sample_rows`), for
        :meth:`_sample_batch`: the package's ``_sample_rows``, looked up at each call."""
        return _sample_rows(logits, rows, temperatures, top_ps, uniforms)

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
