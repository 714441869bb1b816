"""The lookahead drafts of running requests: proposed after each step (:meth:`Drafting._next_drafts`,
which also turns a request sparse once its context passes the threshold), launched on the device
from a step's own tokens where the drafter can (:meth:`Drafting._launcher`,
:meth:`Drafting._spec_launcher`), and a measurement drafter's forced verdicts
(:meth:`Drafting._forced_verdicts`).

:class:`Drafting` is a mixin of :class:`~oasiskv.llm_engine.LLMEngine`; the annotations in its
body are what it reads of the engine.
"""

from __future__ import annotations

import torch

from ..drafters import Drafter
from ..engine import Engine, RowSampling
from ..errors import ConfigError, OasisError
from .scheduler import Seq


class Drafting:
    """Drafts and their launchers (a mixin of ``LLMEngine``; see the module docstring)."""

    # What it reads of the engine (set by LLMEngine.__init__).
    engine: Engine
    drafter: Drafter | None

    def _launcher(self, seqs: list[Seq]):
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

    def _spec_launcher(self, seqs: list[Seq]):
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

    def _next_drafts(self, seqs: list[Seq]) -> None:
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

    def _forced_verdicts(
        self, seqs: list[Seq], tries: list[bool], sampling: list[RowSampling | None]
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
