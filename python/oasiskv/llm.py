"""The public entry point: :class:`LLM`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .config import KvConfig
from .drafters import Drafter, make_drafter
from .engine import Engine, GenerationResult, PrefillCache, _Request
from .errors import ConfigError, ContextLengthError


class LLM:
    """A model plus an OasisKV cache.

    Args:
        model: ``"smollm2"`` (the bundled SmolLM2-135M-Instruct GGUF), a ``.gguf`` path, a local
            Hugging Face directory (config.json + safetensors), or a ``CausalLM`` instance.
        tokenizer: needed to pass text prompts when ``model`` is a ``CausalLM``.
        kv: the cache configuration (:class:`KvConfig`).
        backend: ``"oasis"`` (requests turn sparse past ``kv.sparse_threshold``) or ``"dense"``.
        drafter: the lookahead source: ``"ngram"`` (default), ``"previous-query"``, ``None`` (no
            lookahead row; only sensible with ``backend="dense"``) or a :class:`Drafter`.
        dtype: compute dtype when loading a model (float32 on the CPU by default).
        device: where the model runs (``"cpu"``; ``"cuda"`` once the GPU backend is built).
        max_batch_size: most requests decoded together; later ones wait for a free seat.
        prefill_cache: share prompt prefills between LLMs over the same model (see
            :class:`~oasiskv.engine.PrefillCache`); the demo uses it so dense and oasis prefill once.
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
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        prefill_cache: PrefillCache | None = None,
    ) -> None:
        if isinstance(model, str):
            from .models.loader import load_model

            model, loaded_tok = load_model(model, dtype=dtype or torch.float32, device=device)
            tokenizer = tokenizer or loaded_tok
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise ConfigError(f"model must be a path, 'smollm2' or a CausalLM, got {type(model).__name__}")
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.kv = kv or KvConfig()
        if backend == "oasis" and drafter is None:
            drafter = "previous-query"
        self.drafter = make_drafter(drafter)
        eos = list(
            getattr(tokenizer, "eos_token_ids", None) or getattr(model.config, "eos_token_ids", None) or []
        )
        self.engine = Engine(self.model, self.kv, backend, self.drafter, eos, prefill_cache)
        self.max_batch_size = max_batch_size

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        out = []
        for i, pr in enumerate(prompts):
            if isinstance(pr, str):
                if self.tokenizer is None:
                    raise ConfigError(
                        "text prompts need a tokenizer; pass LLM(..., tokenizer=...) or token ids"
                    )
                ids = self.tokenizer.encode(pr)
            else:
                ids = [int(t) for t in pr]
            if not ids:
                raise ConfigError(f"prompt {i} is empty; pass at least one token")
            vocab = self.model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ConfigError(f"prompt {i} has token ids outside the vocabulary 0..{vocab}: {bad[:5]}")
            out.append(ids)
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
        if temperature <= 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        ignore_eos: bool = False,
        progress: bool = False,
        stop: Callable[[int, list[int]], bool] | None = None,
    ) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts (text or token ids).

        ``stop(i, generated)``, if given, is called after every token generated for prompt ``i``
        with that prompt's generated token ids so far; True ends the request there (finish reason
        ``"stop"``, the token kept), e.g. once an answer is complete.

        Returns one :class:`GenerationResult` per prompt, in order, each with its tokens, text and
        :class:`~oasiskv.engine.RequestMetrics`.
        """
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 0.0 < top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
        token_lists = self._tokenize(prompts)
        ctx = self.model.config.max_position_embeddings
        for i, ids in enumerate(token_lists):
            # The last new token is sampled, never fed: positions 0 .. len + max_new - 2 are used.
            if len(ids) + max_new_tokens - 1 > ctx:
                raise ContextLengthError(
                    f"prompt {i} has {len(ids)} tokens and max_new_tokens={max_new_tokens}: "
                    f"{len(ids) + max_new_tokens - 1} positions exceeds the model's context of {ctx} "
                    "tokens; shorten the prompt or lower max_new_tokens"
                )
        eng = self.engine
        reqs = [
            _Request(id=i, prompt=ids, max_new_tokens=max_new_tokens) for i, ids in enumerate(token_lists)
        ]
        eng.ensure_pools(reqs[: self.max_batch_size], num_requests=len(reqs))
        gen = torch.Generator().manual_seed(seed)
        waiting = list(reqs)
        running: list[_Request] = []
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(r.max_new_tokens for r in reqs), unit="tok", desc="decode")
        try:
            while waiting or running:
                while waiting and len(running) < self.max_batch_size:
                    r = waiting.pop(0)
                    self._admit(r, temperature, top_p, gen, ignore_eos, stop)
                    if bar:
                        bar.update(1)
                    if r.finish_reason is None:
                        running.append(r)
                if not running:
                    continue
                t0 = time.perf_counter()
                logits = eng.decode_step(running)
                dt = time.perf_counter() - t0
                still = []
                # Greedy: one argmax and one host read for the whole batch.
                greedy = logits.argmax(dim=-1).tolist() if temperature <= 0.0 else None
                for i, r in enumerate(running):
                    r.metrics.decode_s += dt / len(running)
                    if greedy is not None:
                        tok = greedy[i]
                    else:
                        tok = self._sample(logits[i], temperature, top_p, gen)
                    self._accept(r, tok, ignore_eos, stop)
                    if bar:
                        bar.update(1)
                    if r.finish_reason is None:
                        still.append(r)
                    else:
                        eng.finalize_metrics(r)
                        eng.release(r)
                running = still
        finally:
            if bar:
                bar.close()
            for r in running + waiting:
                eng.release(r)
        return [self._result(r) for r in reqs]

    def _admit(self, r: _Request, temperature, top_p, gen, ignore_eos, stop=None) -> None:
        eng = self.engine
        if self.drafter is not None:
            self.drafter.begin(r.id, r.prompt)
        t0 = time.perf_counter()
        r.tokens = list(r.prompt)
        logits = eng.prefill(r)
        r.metrics.prompt_tokens = len(r.prompt)
        r.metrics.prefill_s = time.perf_counter() - t0
        self._accept(r, self._sample(logits, temperature, top_p, gen), ignore_eos, stop)
        if r.finish_reason is not None:
            eng.finalize_metrics(r)
            eng.release(r)

    def _accept(self, r: _Request, tok: int, ignore_eos: bool, stop=None) -> None:
        """Append a sampled token, check the stop conditions, draft the next lookahead token and
        turn the request sparse once its context passes the threshold."""
        eng = self.engine
        r.tokens.append(tok)
        r.metrics.generated_tokens += 1
        if not ignore_eos and tok in eng.eos:
            r.finish_reason = "stop"
        elif stop is not None and stop(r.id, r.tokens[len(r.prompt) :]):
            r.finish_reason = "stop"
        elif r.metrics.generated_tokens >= r.max_new_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            return
        if eng.rows == 2:
            r.draft = self.drafter.propose(r.id, r.tokens, r.features)
        if eng.backend == "oasis" and not r.sparse and r.kv_len > self.kv.threshold_tokens:
            eng.make_sparse(r)

    def _result(self, r: _Request) -> GenerationResult:
        gen_tokens = r.tokens[len(r.prompt) :]
        text = self.tokenizer.decode(gen_tokens) if self.tokenizer is not None else None
        return GenerationResult(
            r.id, list(r.prompt), gen_tokens, text, r.finish_reason or "aborted", r.metrics
        )
