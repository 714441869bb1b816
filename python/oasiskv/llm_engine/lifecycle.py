"""What follows a chosen token: append it and check the stop conditions (EOS, stop ids, the
``stop`` callback, ``max_tokens``), finish a request (its metrics, its blocks back to the pools,
its staged data dropped) and report it as a :class:`~oasiskv.llm_engine.RequestOutput`.

:class:`Lifecycle` is a mixin of :class:`~oasiskv.llm_engine.LLMEngine`; the annotations in its
body are what it reads of the engine.
"""

from __future__ import annotations

from ..engine import Engine
from .params import RequestOutput
from .scheduler import Seq


class Lifecycle:
    """Token acceptance, stop handling, finish and output (a mixin of ``LLMEngine``; see the
    module docstring)."""

    # What it reads of the engine (set by LLMEngine.__init__).
    engine: Engine
    kv_source: object | None  # a disagg.RemoteKvSource
    output_kind: str

    def _accept(self, seq: Seq, tok: int | None) -> None:
        """Append a sampled token, check the stop conditions, draft the next lookahead token and
        turn the request sparse once its context passes the threshold."""
        if self._take(seq, tok):
            self._next_drafts([seq])

    def _take(self, seq: Seq, tok: int | None) -> bool:
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

    def _finish(self, seq: Seq, reason: str, error: str | None = None) -> None:
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

    def _output(self, seq: Seq) -> RequestOutput:
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
