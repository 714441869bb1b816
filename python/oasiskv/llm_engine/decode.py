"""The decode step of the running requests: one token each (:meth:`Decoder._decode`), or with
``speculative=True`` a step that verifies each request's draft on the device and may take two
(:meth:`Decoder._decode_speculative`, reading the verdicts with :meth:`Decoder._verify_batch`).

:class:`Decoder` is a mixin of :class:`~oasiskv.llm_engine.LLMEngine`; the annotations in its
body are what it reads of the engine.
"""

from __future__ import annotations

import time

from ..engine import Engine
from .params import StepInfo
from .scheduler import Seq


class Decoder:
    """The decode step (a mixin of ``LLMEngine``; see the module docstring)."""

    # What it reads of the engine (set by LLMEngine.__init__).
    engine: Engine
    kv_source: object | None  # a disagg.RemoteKvSource
    speculative: bool
    recorder: object | None
    _running: list[Seq]
    _spec_counts: list[int]

    def _decode(self, touched: list[Seq]) -> None:
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

    def _decode_speculative(self, touched: list[Seq]) -> None:
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
        two: list[tuple[Seq, int]] = []
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

    def _verify_batch(self, seqs: list[Seq], res) -> tuple[list[int | None], list[int | None]]:
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
