"""Choosing tokens: every row decided on the logits' device, one host read per batch.

:func:`sample_rows` draws the sampling rows of a batch in one pass (temperature, top_p, the
inverse CDF at a uniform); :class:`Sampler` picks each request's token (greedy, sampled or
forced), records the log-probabilities a request asked for, and draws the per-row inputs a
speculative step samples with (:meth:`Sampler._row_sampling`).

:class:`Sampler` is a mixin of :class:`~oasiskv.llm_engine.LLMEngine`; the annotations in its
body are what it reads of the engine. Its one host sampling call goes through ``_draw_rows``,
which the engine provides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..engine import RowSampling, copy_to_host, sample_inverse_cdf, sampling_probs
from .scheduler import Seq


class Sampler:
    """Token choice for a batch of requests (a mixin of ``LLMEngine``; see the module
    docstring)."""

    # What it reads of the engine (set by LLMEngine).
    _gen: torch.Generator | None
    #: ``(logits, rows, temperatures, top_ps, uniforms) -> tokens``: :func:`sample_rows`.
    _draw_rows: Callable[..., torch.Tensor]

    def _sample(self, seq: Seq, logits: torch.Tensor) -> list[int | None]:
        return self._sample_batch([seq], logits)

    def _sample_batch(self, seqs: list[Seq], logits: torch.Tensor, launch=None) -> list[int | None]:
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
            drawn = self._draw_rows(logits, at, temps, top_ps, uniforms)
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

    def _record_logprobs(self, seqs: list[Seq], logits: torch.Tensor, toks: list[int | None]) -> None:
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

    def _row_sampling(self, seq: Seq) -> RowSampling | None:
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


def sample_rows(
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
