"""The sampling-distribution check of speculative decoding, shared by the CPU test
(``tests/engine/test_speculative.py``) and the CUDA-graph one (``test_gpu_speculative.py``): a
peaked 16-token model, a drafter whose drafts are accepted often and rejected often, the exact
joint distribution of the first generated tokens (enumerated with the dense forward), the counts
an engine samples, and a chi-square goodness-of-fit p-value."""

from __future__ import annotations

import math

import torch

from oasiskv import SamplingParams
from oasiskv.drafters import Drafter
from oasiskv.models.transformer import dense_causal_attn
from support.fakes import tiny

SMALL_VOCAB = 16


class ArgmaxDrafter(Drafter):
    """Drafts the model's most likely next token (computed densely), or on every third position a
    fixed token: drafts accepted often and rejected often."""

    def __init__(self, model) -> None:
        self.model = model
        self._memo: dict = {}

    @torch.no_grad()
    def propose(self, req_id, tokens, features=None) -> int:
        if len(tokens) % 3 == 0:
            return 3
        key = tuple(tokens)
        if key not in self._memo:
            ids = torch.tensor(tokens)
            rows = torch.tensor([len(tokens) - 1])
            logits, _ = self.model.forward(
                ids, torch.arange(len(tokens)), dense_causal_attn(), logits_rows=rows
            )
            self._memo[key] = int(logits[0].argmax())
        return self._memo[key]


def peaked_model():
    m = tiny(seed=3, layers=1, vocab=SMALL_VOCAB, hidden=32)
    with torch.no_grad():
        m.lm_head.mul_(8.0)  # a peaked distribution: drafts often accepted, often rejected
    return m


def probs_row(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution of one row, computed independently of the engine's sampler on the
    host (float32; unnormalised after top_p: the kept tokens' probabilities, the rest 0)."""
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return probs


def exact_joint(model, ids, temperature, top_p, n_tokens):
    """The exact distribution of the first ``n_tokens`` generated tokens: {tuple: probability}."""

    attn = dense_causal_attn()
    out = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for seq, pr in out.items():
            toks = list(ids) + list(seq)
            logits, _ = model.forward(
                torch.tensor(toks), torch.arange(len(toks)), attn, logits_rows=torch.tensor([len(toks) - 1])
            )
            p = probs_row(logits[0], temperature, top_p).double()
            p = p / p.sum()
            for t in torch.nonzero(p > 0).flatten().tolist():
                nxt[(*seq, t)] = pr * float(p[t])
        out = nxt
    return out


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """Goodness-of-fit p-value, cells with expected count < 5 pooled."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e, o = n * p, counts.get(cell, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            dof += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    assert not set(counts) - set(probs), "a sample outside the support"
    # Wilson-Hilferty approximation of the chi-square tail.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def second_and_third_tokens(eng, ids, n: int, temperature: float, top_p: float) -> dict:
    """``n`` requests of 3 sampled tokens from ``ids`` through ``eng``: how often each pair of
    2nd and 3rd tokens came out."""
    sp = SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p, ignore_eos=True)
    rids = [eng.add_request(ids, sp) for _ in range(n)]
    outs = eng.run_to_completion(rids)
    counts: dict = {}
    for r in rids:
        t = tuple(outs[r].token_ids[1:])
        counts[t] = counts.get(t, 0) + 1
    return counts
