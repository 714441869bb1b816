"""Speculative decoding: the sampling inputs of a step (:class:`RowSampling`,
:func:`sampling_inputs`, forced :func:`verdict_inputs`), the speculative-sampling rule
(:func:`sampling_probs`, :func:`sample_inverse_cdf`, :func:`verify_sampled_drafts`), what a
speculative step returns (:class:`SpecStep`), and the engine's verification inside the step, the
draft stores and :meth:`SpeculativeMixin.commit_drafts` (:class:`SpeculativeMixin`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import ops
from ..errors import ConfigError
from .pools import copy_to_host


class RowSampling(NamedTuple):
    """How one request of a speculative step samples (:meth:`Engine.decode_step`'s ``sampling``):
    its ``temperature`` (> 0) and ``top_p`` (in (0, 1]), and three uniforms in [0, 1) the caller
    drew from the request's own generator (``u_accept`` decides the draft, ``u_token`` samples
    the first token where the draft is rejected or not tried, ``u_bonus`` the token after an
    accepted draft). Plain numbers, so that they travel as step inputs (a CUDA graph reads them
    at fixed offsets) and to tensor-parallel workers."""

    temperature: float
    top_p: float
    u_accept: float
    u_token: float
    u_bonus: float


#: Rows of the per-step sampling inputs (``[SAMPLING_FIELDS, rows]`` float64, one column per
#: batch row): :class:`RowSampling`'s fields in order. A greedy (or padded) row is all zeros
#: but ``top_p`` (1).
SAMPLING_FIELDS = len(RowSampling._fields)
GREEDY_ROW = (0.0, 1.0, 0.0, 0.0, 0.0)


def sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, nucleus: bool = True
) -> torch.Tensor:
    """Each row's sampling distribution ``[n, vocab]`` float32, normalised: the softmax at its
    ``temperature`` (``[n]``, > 0), then nucleus sampling at its ``top_p`` (``[n]``): the smallest
    set of most likely tokens whose probability reaches ``top_p``, renormalised. The one sampling
    distribution of the engine: the non-speculative sampler (``LLMEngine``) and the in-step
    speculative verification both draw from it.

    ``nucleus=False`` skips the top-p cut, for callers that know every ``top_p`` is >= 1 (a host
    decision). NOTE: with the cut every row of the vocabulary is sorted, even where ``top_p`` is
    1 (a captured step cannot branch on device values); only steps that hold a sampling row pay."""
    probs = torch.softmax(logits.float() / temperature.float().unsqueeze(1), dim=-1)
    if not nucleus:
        return probs / probs.sum(dim=-1, keepdim=True)
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    tp = top_p.float().unsqueeze(1)
    # top_p >= 1 keeps every token, as the reference does: float32 running sums reach 1 before
    # the tail, and "< 1" alone would drop the tail's tokens.
    keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p < tp) | (tp >= 1.0)
    probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p * keep)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_inverse_cdf(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``q`` (``[n, vocab]``, non-negative, not necessarily normalised)
    with probability ``q[i] / q.sum()``, by inverting the CDF at the uniform ``u`` (``[n]``, in
    [0, 1)): the first token whose cumulative mass passes ``u * total``. Only tokens with mass are
    ever taken (a parallel scan's cumulative sums may dip by an ulp over zero entries, and
    ``u * total`` may round up to the total: the last token with mass then); a row without mass
    gives 0. The sums are float64, so a token's probability is resolved to ~1e-16, not to
    float32's 6e-8."""
    cdf = torch.cumsum(q.double(), dim=-1)
    target = u.double().unsqueeze(1) * cdf[:, -1:]
    vocab = q.shape[-1]
    has_mass = q > 0
    idx = torch.arange(vocab, device=q.device)
    first = torch.where((cdf > target) & has_mass, idx, vocab).amin(dim=-1)
    last = torch.where(has_mass, idx, -1).amax(dim=-1)
    return torch.where(first < vocab, first, last).clamp_(min=0)


def verify_sampled_drafts(
    logits: torch.Tensor,
    logits1: torch.Tensor,
    draft: torch.Tensor,
    tried: torch.Tensor,
    samp: torch.Tensor,
    nucleus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling of a one-token deterministic draft, per row, on the device (no host
    branch, graph safe): ``(first token, draft taken, second token)``, each ``[n]``.

    ``logits`` / ``logits1``: rows 0 and 1 (``[n, vocab]``: the token after x_t, and the token
    after the draft); ``draft`` ``[n]``; ``tried`` ``[n]`` bool: the draft is verified (it holds a
    tentative slot and row 0 is finite); ``samp``: the step's sampling inputs
    (``[SAMPLING_FIELDS, >= n]``: temperature, top_p, u_accept, u_token, u_bonus per row). Rows
    with temperature 0 are greedy and take no part (the caller keeps their argmax).

    **The rule.** The standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023)
    with a draft distribution ``q`` and the target's ``p`` (row 0's, after temperature and top-p):
    accept the draft ``d`` with probability ``min(1, p(d) / q(d))``; on rejection sample from
    ``norm(max(0, p - q))``; after an acceptance the token that follows is sampled from the
    target's distribution at the next position. Every drafter here is deterministic (n-gram, an
    EAGLE-3 head's argmax, an oracle), so ``q`` is a point mass at ``d`` (``q(d) = 1``, else 0):

    * accept with probability ``min(1, p(d) / 1) = p(d)``: ``u_accept < p(d)``;
    * the residual: ``max(0, p(x) - q(x))`` is ``p(x)`` for ``x != d`` and ``max(0, p(d) - 1) =
      0`` at ``d``: ``p`` with ``d`` removed, renormalised (by ``1 - p(d)``), sampled with
      ``u_token``;
    * after an acceptance, the token after ``d`` is sampled from row 1's distribution (same
      temperature and top-p) with ``u_bonus``: row 1 is the forward with ``d`` as input, exactly
      the next step's row 0 had ``d`` been sampled.

    Lossless: ``P(first = d) = p(d)`` and, for ``x != d``, ``P(first = x) = (1 - p(d)) * p(x) /
    (1 - p(d)) = p(x)``: the first token has distribution ``p``, and given ``first = d`` the
    second has the target's next-position distribution, so the pair is distributed as two steps
    of the non-speculative sampler. Where ``p(d) = 1`` the residual is empty and the draft is
    always taken (also where rounding left ``u_accept >= p(d)``). A row that did not try samples
    its first token from ``p`` itself with ``u_token``. ``nucleus=False`` (every row's top_p is
    1, a host decision the caller makes per step) skips the top-p sort (:func:`sampling_probs`)."""
    n = logits.shape[0]
    temp, top_p = samp[0, :n], samp[1, :n]
    u_accept, u_token, u_bonus = samp[2, :n], samp[3, :n], samp[4, :n]
    # Greedy rows divide by 1 (their results are not used); every row runs the same kernels.
    temp = torch.where(temp > 0, temp, torch.ones_like(temp))
    p = sampling_probs(logits, temp, top_p, nucleus)
    d = draft.long().unsqueeze(1)
    p_d = p.gather(1, d).squeeze(1).double()
    resid = torch.where(tried.unsqueeze(1), p.scatter(1, d, 0.0), p)
    empty = resid.sum(dim=-1) <= 0
    taken = tried & ((u_accept < p_d) | empty)
    first = torch.where(taken, draft.long(), sample_inverse_cdf(resid, u_token))
    second = sample_inverse_cdf(sampling_probs(logits1, temp, top_p, nucleus), u_bonus)
    return first, taken, second


def sampling_inputs(sampling: list[RowSampling | None] | None) -> torch.Tensor | None:
    """A speculative step's sampling inputs on the host, ``[SAMPLING_FIELDS, n]`` float64 (a
    greedy row: ``GREEDY_ROW``), or None where every row is greedy (the step then runs no
    sampling kernel, and its graph is the greedy one)."""
    if sampling is None or all(s is None for s in sampling):
        return None
    cols = []
    for i, s in enumerate(sampling):
        if s is None:
            cols.append(GREEDY_ROW)
            continue
        if not isinstance(s, RowSampling):
            raise ConfigError(f"sampling[{i}] must be a RowSampling or None, got {type(s).__name__}")
        t, p, *us = s
        if not (math.isfinite(t) and t > 0 and 0 < p <= 1 and all(0 <= u < 1 for u in us)):
            raise ConfigError(
                f"sampling[{i}] = {s!r}: temperature must be > 0, top_p in (0, 1] and the uniforms in "
                "[0, 1); pass None for a greedy request"
            )
        cols.append(tuple(float(x) for x in s))
    return torch.tensor(cols, dtype=torch.float64).T.contiguous()


#: A row's forced verdict as a step input (``Engine.decode_step(verdicts=...)``): none (the engine
#: verifies), a forced rejection, a forced acceptance.
VERDICT_NONE, VERDICT_REJECT, VERDICT_ACCEPT = -1, 0, 1


def verdict_inputs(
    verdicts: list[bool | None] | None, sampling: list[RowSampling | None] | None, n: int
) -> torch.Tensor | None:
    """A speculative step's forced verdicts on the host, ``[n]`` int32 (:data:`VERDICT_NONE`,
    :data:`VERDICT_REJECT` or :data:`VERDICT_ACCEPT` per row), or None where no row has one (the
    step then runs none of their kernels, and its graph is the unforced one)."""
    if verdicts is None:
        return None
    if len(verdicts) != n:
        raise ConfigError(f"verdicts needs one entry per request ({n}), got {len(verdicts)}")
    out = []
    for i, x in enumerate(verdicts):
        if x is not None and not isinstance(x, bool):
            raise ConfigError(f"verdicts[{i}] must be True, False or None, got {x!r}")
        if x is not None and sampling is not None and sampling[i] is not None:
            raise ConfigError(
                f"verdicts[{i}] forces the verdict of a sampling row; forced verdicts are for greedy rows "
                "(pass None there: the speculative-sampling rule decides)"
            )
        out.append(VERDICT_NONE if x is None else VERDICT_ACCEPT if x else VERDICT_REJECT)
    if all(x == VERDICT_NONE for x in out):
        return None
    return torch.tensor(out, dtype=torch.int32)


@dataclass
class SpecStep:
    """What a speculative decode step (:meth:`Engine.decode_step` with ``speculate``) gives back:
    per request (batch order) the host copies of its one device-to-host read, and both rows'
    logits.

    ``tried``: its draft held a tentative slot (the runtime allowed the position after x_t).
    ``token``: the request's next token as the step chose it (a greedy row: row 0's argmax; a
    sampling row: the draft where accepted, else a sample of the residual, or of row 0's
    distribution where it did not try: :func:`verify_sampled_drafts`); ``finite``: whether row
    0's logits are finite. ``token2`` / ``finite2`` the same for row 1 (the token after the
    draft). ``accepted``: the step accepted the draft (a per-row device flag: greedy, ``token ==
    draft``, or its forced verdict; sampling, the speculative-sampling rule; both rows finite)
    and stored its K/V; only then is ``token2`` the request's."""

    logits: torch.Tensor  # [n, vocab] row 0
    draft_logits: torch.Tensor  # [n, vocab] row 1
    tried: list[bool]
    token: list[int]
    finite: list[bool]
    token2: list[int]
    finite2: list[bool]
    accepted: list[bool]


@dataclass
class _SpecState:
    """The last speculative step, until :meth:`Engine.commit_drafts`: the requests whose drafts
    it accepted and stored."""

    stored: set[int]


class SpeculativeMixin:
    """The engine's draft verification, stores and commit (mixed into :class:`~.core.Engine`)."""

    def _spec_result(self, reqs, logits, out: dict, launch=None) -> SpecStep:
        """Adopt a speculative step's outputs (``out`` of :meth:`_run_step`, or copies of a
        graph's): the one host read of its verdict, row 1's features, the state
        :meth:`commit_drafts` needs."""
        n = len(reqs)
        verdict, targets = out["verdict"], out["targets"]
        # The step's only device-to-host copy: both rows' tokens and finiteness, the accept flags,
        # and which rows held a tentative slot.
        both = torch.cat([verdict[:, :n], (targets[0][:n] >= 0).long().unsqueeze(0)])
        if launch is None:
            host = both.tolist()
        else:
            # Queued before the launched work, so the read waits for the step alone.
            host_t, ready = copy_to_host(both)
            launch()
            if ready is not None:
                ready.synchronize()
            host = host_t.tolist()
        tok, fin, tok2, fin2, acc, tried = host
        if out["feats1"] is not None:
            for i, r in enumerate(reqs):
                r.draft_features = out["feats1"][i]
        self._spec = _SpecState(stored={r.id for i, r in enumerate(reqs) if acc[i]})
        return SpecStep(
            logits=logits,
            draft_logits=out["logits1"][:n],
            tried=[bool(x) for x in tried],
            token=tok,
            finite=[bool(x) for x in fin],
            token2=tok2,
            finite2=[bool(x) for x in fin2],
            accepted=[bool(x) for x in acc],
        )

    def _verify_drafts(
        self,
        v: dict,
        n: int,
        logits: torch.Tensor,
        logits1: torch.Tensor,
        spec_kv: list,
        samp: torch.Tensor | None,
        verdicts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Verification inside the step, on the device (no host branch, graph safe): a row
        verifies its draft when it holds a tentative slot (``spec_page_ids >= 0``) and row 0's
        logits are finite. A greedy row takes the draft when it is row 0's argmax; a sampling row
        (temperature > 0 in ``samp``) by the speculative-sampling rule
        (:func:`verify_sampled_drafts`), which also samples its tokens. A taken draft is accepted
        when row 1's logits are finite too: its K/V (``spec_kv``, row 1 of every layer) is stored
        into its slot; every other row's page is masked to -1, which ``append_kv`` skips entirely
        (no page, host row or summary touched). Returns ``[5, n]`` int64: row 0's token (argmax,
        or sampled), its finiteness, row 1's token, its finiteness, the accept flag. Without
        ``samp`` (every row greedy) none of the sampling kernels run.

        ``verdicts`` (``[>= n]`` int32 on the device, or None; measurement only): a greedy row's
        forced verdict replaces the argmax test. :data:`VERDICT_ACCEPT` takes the draft as if row
        0's argmax were the draft (its token is the draft; accepted and stored when row 1 is
        finite, exactly as a genuine acceptance), :data:`VERDICT_REJECT` rejects it (its token
        stays the argmax, even where that is the draft), :data:`VERDICT_NONE` verifies as above.
        Elementwise selects on device values: no branch, no host read, nothing baked into a
        graph."""
        tok = logits.argmax(dim=-1)
        tok2 = logits1.argmax(dim=-1)
        fin = torch.isfinite(logits).all(dim=-1)
        fin2 = torch.isfinite(logits1).all(dim=-1)
        draft = v["input_ids"].view(n, 2)[:, 1]
        page = v["spec_page_ids"]
        match = tok == draft  # a greedy row takes its draft
        if verdicts is not None:
            f = verdicts[:n]
            match = torch.where(f == VERDICT_NONE, match, f == VERDICT_ACCEPT)
            tok = torch.where((f == VERDICT_ACCEPT) & (page >= 0) & fin, draft.long(), tok)
        if samp is None:
            accept = (page >= 0) & match & fin & fin2
        else:
            tried = (page >= 0) & fin
            first, taken, second = verify_sampled_drafts(
                logits, logits1, draft, tried, samp, nucleus=self._nucleus_now
            )
            greedy = samp[0, :n] <= 0
            taken = torch.where(greedy, tried & match, taken)
            tok = torch.where(greedy, tok, first)
            tok2 = torch.where(greedy, tok2, second)
            accept = taken & fin2
        self._store_drafts(
            spec_kv, page.masked_fill(~accept, -1), v["spec_offsets"], v["spec_host_ids"], v["spec_host_rows"]
        )
        return torch.stack([tok, fin.long(), tok2, fin2.long(), accept.long()])

    def _store_drafts(
        self,
        spec_kv: list,
        page_ids: torch.Tensor,
        offsets: torch.Tensor,
        host_ids: torch.Tensor,
        host_rows: torch.Tensor,
    ) -> None:
        """Store row 1's K/V of every layer where ``page_ids >= 0`` (one ``append_kv`` per layer:
        write-through to host row ``host_rows`` and summary update of block ``host_ids`` for
        sparse requests)."""
        p, g = self.pools, self.geo
        for layer, (k1, v1) in enumerate(spec_kv):
            ops.append_kv(
                g,
                k1,
                v1,
                page_ids,
                offsets,
                host_ids,
                p.k_pages[layer],
                p.v_pages[layer],
                p.host_k[layer],
                p.host_v[layer],
                p.summaries[layer],
                host_rows=host_rows,
                **p.host_scales(layer),
                **p.page_scales(layer),
            )

    @torch.no_grad()
    def commit_drafts(self) -> None:
        """Resolve the last speculative :meth:`decode_step`: the drafts the step accepted (and
        stored) are kept, every other tentative slot goes back. So each request's tables advance
        by one or two tokens. A request released since the step (it stopped on its first token)
        has no slot left.

        Raises:
            ConfigError: without a speculative step first."""
        st = self._spec
        if st is None:
            raise ConfigError("commit_drafts needs a decode_step(speculate=...) first")
        pending = set(self.runtime.pending_drafts())
        self._spec = None
        self.runtime.commit_drafts([rid for rid in st.stored if rid in pending])
