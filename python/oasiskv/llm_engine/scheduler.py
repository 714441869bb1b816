"""Admission and prefill: the queues a request passes through and the step's prompt budget.

Requests wait in arrival order (:attr:`Scheduler._waiting`). Each step :meth:`Scheduler._prefill`
spends at most ``max_num_batched_tokens`` prompt tokens, first on the prompts already being
prefilled (``_prefilling``), then on waiting requests admitted first come, first served while a
seat is free and their peak KV need fits (no overtaking); a prefilled request moves to
``_running``. A staged request (disaggregated prefill) is admitted from the staging daemon in
place of its prefill, in two steps: :meth:`Scheduler._start_staged` reserves it and hands its
blocks to the source's coordinator, which streams them into the host pool in the background
while it waits in ``_prefilling`` (its seat taken, no prompt budget spent);
:meth:`Scheduler._land_staged` finishes it once its blocks have landed (or at once, waiting
layer by layer, when nothing was running) and it joins ``_running``. So the decode steps of
the others never wait on the network for it.

:class:`Scheduler` is a mixin of :class:`~oasiskv.llm_engine.LLMEngine`; the annotations in its
body are what it reads of the engine.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..config import KvConfig
from ..drafters import Drafter
from ..engine import Engine, Request
from ..errors import ConfigError, ContextLengthError, OasisError
from .params import SamplingParams, StepInfo
from .prompts import prompt_token_ids


@dataclass(frozen=True)
class PrefillRound:
    """What :meth:`Scheduler.prefill_only` did: ``done``, the requests whose prompt finished
    prefilling in the call (``(request_id, error)``, ``error`` None unless the request failed), and
    ``progressed``, whether anything was admitted or prefilled, or a staged request's admission is
    still streaming in (it lands, or fails, by itself; False: the waiting requests do not fit the
    pools beside the running ones). ``out_of_memory``: the requests of ``done`` whose prefill ran
    the device out of memory (their pools fit; what the prefill needed beside them did not)."""

    done: list[tuple[str, str | None]]
    progressed: bool
    out_of_memory: tuple[str, ...] = ()


@dataclass
class Seq:
    """A request as the scheduler tracks it."""

    request_id: str
    req: Request
    params: SamplingParams
    gen: torch.Generator | None
    stop: Callable[[list[int]], bool] | None = None
    forced: list[int] | None = None
    error: str | None = None
    out_of_memory: bool = False  # its prefill failed for lack of device memory
    prefilled: int = 0  # prompt tokens prefilled so far
    new: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)  # one per token of ``new``
    staged: object | None = None  # a disagg.StagedRequest: admitted from the staging daemon


class Scheduler:
    """Queueing, admission and chunked prefill (a mixin of ``LLMEngine``; see the module
    docstring)."""

    # What it reads of the engine (set by LLMEngine.__init__).
    engine: Engine
    drafter: Drafter | None
    kv: KvConfig
    kv_source: object | None  # a disagg.RemoteKvSource
    model: torch.nn.Module
    tokenizer: object
    speculative: bool
    recorder: object | None
    max_num_seqs: int
    max_num_batched_tokens: int
    _gen: torch.Generator | None
    _ids: Iterator[int]
    _waiting: deque[Seq]
    _prefilling: list[Seq]
    _done: list[Seq]
    _running: list[Seq]
    _by_id: dict[str, Seq]

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
            len(ids),
            params.max_tokens,
            sparse=staged is not None or self._prefills_sparse(len(ids)),
            cache_blocks=self._cache_of(staged),
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
        seq = Seq(rid, Request(id=n, prompt=ids, max_new_tokens=params.max_tokens), params, gen, stop, forced)
        seq.staged = staged
        self._waiting.append(seq)
        self._by_id[rid] = seq
        return rid

    def _connect_kv_source(self, src, transfer, token, timeout_s, retries, cuda_graph, cache_blocks=None):
        from ..disagg import RemoteKvSource

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

    def _start_staged(self, seq: Seq, touched: list[Seq]) -> None:
        """Start admitting a staged request from the daemon (in place of its prefill): it takes
        its seat in ``_prefilling`` while its blocks stream in; a failure finishes it with an
        error and the others go on."""
        r = seq.req
        if self.drafter is not None:
            self.drafter.begin(r.id, r.prompt)
        r.tokens = list(r.prompt)
        t0 = time.perf_counter()
        try:
            self.kv_source.start_admission(r, seq.staged)
        except (OasisError, torch.OutOfMemoryError) as e:
            touched.append(seq)
            self._finish(seq, "error", f"admission from the staging daemon failed: {e}")
            return
        r.metrics.prefill_s += time.perf_counter() - t0
        self._prefilling.append(seq)

    def _land_staged(self, touched: list[Seq], busy: bool) -> None:
        """Finish the admissions whose blocks have landed (any that failed included: they end
        with the error), in admission order, and take their first tokens. While no request was
        decoding (not ``busy``) every one is finished, waiting for each (layer by layer; their
        streams all went out before the first wait): that costs no one a step, and the requests
        admitted together start decoding together, as without a daemon."""
        src = self.kv_source
        for seq in [s for s in self._prefilling if s.staged is not None]:
            if busy and not src.admission_landed(seq.req):
                continue
            r = seq.req
            self._prefilling.remove(seq)
            touched.append(seq)
            t0 = time.perf_counter()
            try:
                src.finish_admission(r)
            except (OasisError, torch.OutOfMemoryError) as e:
                self._finish(seq, "error", f"admission from the staging daemon failed: {e}")
                continue
            r.metrics.prefill_s += time.perf_counter() - t0
            r.metrics.prompt_tokens = len(r.prompt)
            self._accept(seq, seq.staged.first_token)
            if r.finish_reason is None:
                self._running.append(seq)

    def prefill_only(self) -> PrefillRound:
        """The admission and prefill half of ``step()``, without its decode: admit what fits and
        spend one step's prompt-token budget. Benchmarks use it to start every request before they
        time decoding. Nothing is lost: the first tokens and failures it produced are reported by
        the next ``step()``."""
        state = (len(self._waiting), [s.prefilled for s in self._prefilling], len(self._running))
        touched: list[Seq] = []
        self._prefill(touched)
        self._done.extend(touched)
        after = (len(self._waiting), [s.prefilled for s in self._prefilling], len(self._running))
        done = [(s.request_id, s.error if s.req.finish_reason == "error" else None) for s in touched]
        oom = tuple(s.request_id for s in touched if s.out_of_memory)
        return PrefillRound(done, after != state or self._staged_pending(), oom)

    def _staged_pending(self) -> bool:
        """Whether a staged request is on its way in by itself: its admission streaming in, or the
        first waiting one fits but its data is still being read ahead while others decode."""
        if any(s.staged is not None for s in self._prefilling):
            return True
        if self.kv_source is None or not self._waiting or not self._running:
            return False
        seq = self._waiting[0]
        if seq.staged is None or not self._seat_free() or not self._fits(seq):
            return False
        return not self.kv_source.ready(seq.staged, seq.req.max_new_tokens)

    def _seat_free(self) -> bool:
        """Whether ``max_num_seqs`` leaves room for one more admitted request."""
        return len(self._running) + len(self._prefilling) < self.max_num_seqs

    def _prefills_sparse(self, prompt_len: int) -> bool:
        """Whether a local prompt of ``prompt_len`` tokens is admitted sparse: the engine prefills
        it straight into the host pool (``Engine.prefills_sparse``), in one piece when it is within
        ``max_num_batched_tokens`` (:meth:`_prefill` waits for a step's whole budget for it), else
        in chunks. Then it reserves only its working set."""
        return self.engine.prefills_sparse(prompt_len)

    def _fits(self, seq: Seq) -> bool:
        """Whether the pools hold ``seq``'s peak KV beside the admitted requests' (a staged
        request, or a prompt admitted sparse (:meth:`_prefills_sparse`), reserves its working set
        only: ``Engine.admit_sparse``)."""
        r = seq.req
        staged = seq.staged
        sparse = staged is not None or self._prefills_sparse(len(r.prompt))
        return self.engine.can_admit(
            len(r.prompt), r.max_new_tokens, sparse=sparse, cache_blocks=self._cache_of(staged)
        )

    def _prefill(self, touched: list[Seq]) -> None:
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
                if seq.staged is not None:
                    continue  # its blocks stream in: _land_staged below
            elif self._waiting and self._seat_free():
                seq = self._waiting[0]
                if not self._fits(seq):
                    break  # it waits, and so does everyone behind it (no overtaking)
                if (
                    seq.staged is None
                    and budget < len(seq.req.prompt) <= self.max_num_batched_tokens
                    and self._prefills_sparse(len(seq.req.prompt))
                ):
                    break  # admitted sparse, it is prefilled in one piece: next step's whole budget
                if seq.staged is not None and busy and not src.ready(seq.staged, seq.req.max_new_tokens):
                    break  # its data is still being read ahead: decode the others meanwhile
                self._waiting.popleft()
                if seq.staged is not None:
                    self._start_staged(seq, touched)
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
                seq.out_of_memory = isinstance(e, torch.OutOfMemoryError)
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
        if src is not None:
            self._land_staged(touched, busy)
