"""The public entry point: :class:`LLM`."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch

from .config import KvConfig
from .drafters import Drafter
from .engine import GenerationResult, PrefillCache
from .errors import ConfigError, ContextLengthError
from .llm_engine import LLMEngine, SamplingParams, prompt_token_ids
from .policy import SelectionPolicy


class LLM:
    """A model plus an OasisKV cache: batch generation over :class:`~oasiskv.LLMEngine`.

    Args:
        model: ``"smollm2"`` (the bundled SmolLM2-135M-Instruct GGUF), a ``.gguf`` path, a local
            Hugging Face directory (config.json + safetensors), or a ``CausalLM`` instance.
        tokenizer: needed to pass text prompts when ``model`` is a ``CausalLM``.
        kv: the cache configuration (:class:`KvConfig`).
        backend: ``"oasis"`` (requests turn sparse past ``kv.sparse_threshold``) or ``"dense"``.
        drafter: the lookahead source: ``"ngram"`` (default), ``"eagle3"`` (the bundled head of
            the bundled model), ``"previous-query"``, ``None`` (no lookahead row; only sensible
            with ``backend="dense"``) or a :class:`Drafter`.
        dtype: compute dtype when loading a model by name: None (auto) is bfloat16 on a GPU,
            float32 on the CPU; a model object keeps its own (see :class:`LLMEngine`).
        device: where the model runs: ``"auto"`` (the default: the GPU when one can run the
            kernels, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        max_batch_size: most requests decoded together (``max_num_seqs``); later ones wait.
        gpu_kv_budget_bytes, host_kv_budget_bytes: the pools' budgets (see :class:`LLMEngine`).
        prefill_cache: share prompt prefills between LLMs over the same model (see
            :class:`~oasiskv.engine.PrefillCache`); the demo uses it so dense and oasis prefill once.
        policy: a :class:`~oasiskv.policy.SelectionPolicy` (evaluation: the Quest-like ideal,
            :class:`oasiskv.eval.policies.QuestPolicy`); ``None`` runs the engine as it is.
        enforce_eager: decode eagerly; by default a GPU engine replays decode steps as CUDA
            graphs (vLLM's name and default; see :class:`LLMEngine`).
        cuda_graph: deprecated, see :class:`LLMEngine`.
        seed: see :class:`LLMEngine` (None: unseeded requests get fresh random seeds).
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
        max_batch_size: int = 64,
        gpu_kv_budget_bytes: int | None = None,
        host_kv_budget_bytes: int | None = None,
        prefill_cache: PrefillCache | None = None,
        policy: SelectionPolicy | None = None,
        enforce_eager: bool = False,
        cuda_graph: bool | None = None,
        seed: int | None = None,
    ) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        self.llm_engine = LLMEngine(
            model,
            tokenizer=tokenizer,
            kv=kv,
            backend=backend,
            drafter=drafter,
            dtype=dtype,
            device=device,
            max_num_seqs=max_batch_size,
            gpu_kv_budget_bytes=gpu_kv_budget_bytes,
            host_kv_budget_bytes=host_kv_budget_bytes,
            prefill_cache=prefill_cache,
            policy=policy,
            enforce_eager=enforce_eager,
            cuda_graph=cuda_graph,
            seed=seed,
        )
        le = self.llm_engine
        self.model, self.tokenizer, self.kv, self.drafter = le.model, le.tokenizer, le.kv, le.drafter
        #: The engine below (pools, runtime, model forward): measurement code reads it.
        self.engine = le.engine
        self.max_batch_size = max_batch_size

    @staticmethod
    def _as_list(prompts) -> list:
        """One prompt (text, a sequence of ints, a 1-D tensor/array) or a list of prompts."""
        if isinstance(prompts, str) or hasattr(prompts, "dtype"):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], numbers.Number):
            return [prompts]  # one prompt of token ids (non-int ids are reported as such)
        if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
            kind = type(prompts).__name__
            raise ConfigError(f"prompts must be text, token ids or a list of them, got {kind}")
        if not prompts:
            raise ConfigError("prompts is empty; pass at least one prompt")
        return list(prompts)

    def generate(
        self,
        prompts,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        ignore_eos: bool = False,
        progress: bool = False,
        stop: Callable[[int, list[int]], bool] | None = None,
        skip_special_tokens: bool = True,
    ) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts (text or token ids).

        Every prompt is checked before any runs (a bad one raises and nothing runs). With a
        ``seed``, prompt ``i`` samples with its own seed ``seed + i``, so its output does not
        depend on the others and a second call reproduces it; without (the default), every
        request gets a fresh random seed, as vLLM's (so sampled calls differ). The text leaves
        special tokens out unless ``skip_special_tokens=False`` (the tokens keep them).
        ``stop(i, generated)``, if given, is called after every token generated for prompt ``i``
        with that prompt's generated token ids so far; True ends the request there (finish reason
        ``"stop"``, the token kept), e.g. once an answer is complete.

        Returns one :class:`GenerationResult` per prompt, in order, each with its tokens, text and
        :class:`~oasiskv.engine.RequestMetrics`. A request that failed on its own (non-finite
        logits) has ``finish_reason="error"``; the others are unaffected.
        """
        items = self._as_list(prompts)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ConfigError(f"seed must be None (fresh random seeds) or an int >= 0, got {seed!r}")
        params = [
            SamplingParams(
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=None if seed is None else seed + i,
                ignore_eos=ignore_eos,
                skip_special_tokens=skip_special_tokens,
            )
            for i in range(len(items))
        ]
        le = self.llm_engine
        vocab = self.model.config.vocab_size
        token_lists = [prompt_token_ids(p, self.tokenizer, vocab, f"prompt {i}") for i, p in enumerate(items)]
        rids = []
        try:
            for i, (ids, sp) in enumerate(zip(token_lists, params, strict=True)):
                cb = None if stop is None else (lambda gen, i=i: stop(i, gen))
                try:
                    rids.append(le.add_request(ids, sp, stop=cb))
                except ContextLengthError as e:
                    raise ContextLengthError(f"prompt {i}: {e}") from None
        except BaseException:
            for rid in rids:
                le.abort_request(rid)
            le.step()  # report (and drop) the aborted requests
            raise
        # Size the pools for the first batch at once (they grow geometrically past it).
        first = token_lists[: self.max_batch_size]
        self.engine.reserve_pools([(len(ids), max_new_tokens) for ids in first])
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(p.max_tokens for p in params), unit="tok", desc="decode")
        try:
            outs = le.run_to_completion(rids, progress=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        results = []
        for i, rid in enumerate(rids):
            res = le.result(outs[rid], skip_special_tokens=skip_special_tokens)
            res.request_id = i
            results.append(res)
        return results
