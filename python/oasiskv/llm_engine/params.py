"""What a request asks for and what a step reports: :class:`SamplingParams` (how one request
samples and when it stops), :class:`RequestOutput` (one request's share of a step) and
:class:`StepInfo` (what a recorder sees of one forward). Plain data with its checks; nothing here
runs the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine import RequestMetrics
from ..errors import ConfigError

#: Values of :attr:`RequestOutput.finish_reason`.
FINISH_REASONS = ("stop", "length", "abort", "error")
#: Most alternatives :attr:`SamplingParams.logprobs` may ask for (vLLM's ``max_logprobs``).
MAX_LOGPROBS = 20


def is_int(x) -> bool:
    """Whether ``x`` is an int and not a bool (the argument checks' test)."""
    return isinstance(x, int) and not isinstance(x, bool)


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
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            raise ConfigError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        ids = self.stop_token_ids
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | set | frozenset):
            raise ConfigError(f"stop_token_ids must be a sequence of ints, got {ids!r}")
        if not all(is_int(x) and x >= 0 for x in ids):
            raise ConfigError(f"stop_token_ids must hold ints >= 0, got {list(ids)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.skip_special_tokens, bool):
            raise ConfigError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        n = self.logprobs
        if n is not None and (not is_int(n) or not 0 <= n <= MAX_LOGPROBS):
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
