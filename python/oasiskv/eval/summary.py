"""What a teacher-forced run gives back and how it is reported: :class:`RunResult` (the runner's
per-step, per-text tensors; :func:`concat_results` joins the runner's chunks) and the JSON record
of one run (:func:`summarize`, see ``docs/EVAL.md`` for every field), built from its parts:
:func:`lookahead_summary`, :func:`kept_summary`, :func:`attention_mass_summary`,
:func:`top2_summary` and :func:`confidence_bins`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .overlap import TOP2_SETS
from .specs import Policy


@dataclass
class RunResult:
    policy: Policy
    nll: torch.Tensor  # [S, n]
    top1: torch.Tensor  # [S, n] token ids
    kl: torch.Tensor | None  # [S, n] KL(dense || policy)
    top1_agree: torch.Tensor | None  # [S, n] bool
    fetched_bytes_per_step: list[float] = field(default_factory=list)  # per text
    full_kv_bytes: list[int] = field(default_factory=list)
    resident_kv_bytes: list[int] = field(default_factory=list)
    would_fetch_bytes_per_step: list[float] | None = None  # quest: selection churn
    overlap: torch.Tensor | None = None  # [S', L, n]
    resident_hit: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    overlap_kept: torch.Tensor | None = None  # [S', L, n] sticky candidates: see LookaheadRecorder
    kept_valid: torch.Tensor | None = None
    matched: torch.Tensor | None = None  # [S', n] bool; None without a draft
    confidence: torch.Tensor | None = None  # [S', n] the head's probability of its draft (EAGLE-3)
    mass: torch.Tensor | None = None  # [S', L, n, 4] attention share: exact / predicted / resident / best
    mass_valid: torch.Tensor | None = None  # [S', L, n] the sampled cells
    # +top2: the TOP2_SETS' overlap [S', L, n, 3] and attention share, and whether the runner-up
    # draft was the next token [S', n].
    top2_overlap: torch.Tensor | None = None
    top2_valid: torch.Tensor | None = None
    top2_mass: torch.Tensor | None = None
    top2_mass_valid: torch.Tensor | None = None
    layer_blocks: tuple[int, ...] | None = None  # +layers: the fitted per-layer budgets
    matched2: torch.Tensor | None = None
    measured_steps: list[int] = field(default_factory=list)
    wall_s: float = 0.0


def concat_results(policy: Policy, parts: list[RunResult]) -> RunResult:
    def cat(name, dim):
        xs = [getattr(p, name) for p in parts]
        return None if any(x is None for x in xs) else torch.cat(xs, dim=dim)

    out = RunResult(
        policy,
        cat("nll", 1),
        cat("top1", 1),
        cat("kl", 1),
        cat("top1_agree", 1),
        fetched_bytes_per_step=sum((p.fetched_bytes_per_step for p in parts), []),
        full_kv_bytes=sum((p.full_kv_bytes for p in parts), []),
        resident_kv_bytes=sum((p.resident_kv_bytes for p in parts), []),
    )
    if all(p.would_fetch_bytes_per_step is not None for p in parts):
        out.would_fetch_bytes_per_step = sum((p.would_fetch_bytes_per_step for p in parts), [])
    out.overlap = cat("overlap", 2)
    out.resident_hit = cat("resident_hit", 2)
    out.valid = cat("valid", 2)
    out.overlap_kept = cat("overlap_kept", 2)
    out.kept_valid = cat("kept_valid", 2)
    out.matched = cat("matched", 1)
    out.confidence = cat("confidence", 1)
    out.mass = cat("mass", 2)
    out.mass_valid = cat("mass_valid", 2)
    for name in ("top2_overlap", "top2_valid", "top2_mass", "top2_mass_valid"):
        setattr(out, name, cat(name, 2))
    out.matched2 = cat("matched2", 1)
    out.measured_steps = parts[0].measured_steps
    out.layer_blocks = parts[0].layer_blocks
    return out


def _mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> float | None:
    if mask is not None:
        x = x[mask]
    return float(x.float().mean()) if x.numel() else None


def summarize(res: RunResult, dense: RunResult | None) -> dict:
    """The JSON record of one run (see docs/EVAL.md for every field)."""
    p = res.policy
    rec: dict = {
        "policy": p.kind,
        "drafter": p.drafter,
        "top_k_blocks": p.top_k_blocks,
        "fetch_cap": p.fetch_cap,
        **({"layer_blocks": list(res.layer_blocks)} if res.layer_blocks else {}),
        "nll": _mean(res.nll),
        "ppl": math.exp(_mean(res.nll)),
        "nll_per_text": [float(x) for x in res.nll.mean(0)],
        "wall_s": res.wall_s,
    }
    if dense is not None and p.kind != "dense":
        d_nll = _mean(dense.nll)
        per_text = res.nll.mean(0) - dense.nll.mean(0)
        n = per_text.numel()
        rec.update(
            nll_dense=d_nll,
            delta_nll=rec["nll"] - d_nll,
            delta_nll_pct=100.0 * (rec["nll"] - d_nll) / d_nll,
            delta_nll_se=float(per_text.std(unbiased=True) / math.sqrt(n)) if n > 1 else None,
            ppl_ratio=math.exp(rec["nll"] - d_nll),
            kl=_mean(res.kl),
            top1_agree=_mean(res.top1_agree),
        )
    if p.kind != "dense":
        rec["fetched_bytes_per_step"] = sum(res.fetched_bytes_per_step) / len(res.fetched_bytes_per_step)
        rec["full_kv_bytes"] = sum(res.full_kv_bytes) / len(res.full_kv_bytes)
        if p.kind == "oasis":
            rec["resident_kv_bytes"] = sum(res.resident_kv_bytes) / len(res.resident_kv_bytes)
    if res.would_fetch_bytes_per_step is not None:
        w = res.would_fetch_bytes_per_step
        rec["would_fetch_bytes_per_step"] = sum(w) / len(w)
    if res.overlap is not None:
        rec["lookahead"] = lookahead_summary(res)
    return rec


def lookahead_summary(res: RunResult) -> dict:
    ov, hit, valid = res.overlap, res.resident_hit, res.valid  # [S', L, n]
    per_layer = []
    hit_layer = []
    for layer in range(ov.shape[1]):
        per_layer.append(_mean(ov[:, layer], valid[:, layer]))
        hit_layer.append(_mean(hit[:, layer], valid[:, layer]))
    out = {
        "overlap": _mean(ov, valid),
        "overlap_per_layer": per_layer,
        "overlap_min_layer": min((x for x in per_layer if x is not None), default=None),
        "resident_hit": _mean(hit, valid),
        "resident_hit_per_layer": hit_layer,
        "steps_measured": len(res.measured_steps),
        "overlap_per_step": [_mean(ov[s], valid[s]) for s in range(ov.shape[0])],
    }
    if res.matched is not None and res.matched.numel():
        m = res.matched.unsqueeze(1).expand_as(valid)  # [S', L, n]
        out.update(
            draft_accept=_mean(res.matched.float()),
            overlap_matched=_mean(ov, valid & m),
            overlap_unmatched=_mean(ov, valid & ~m),
            n_matched=int(res.matched.sum()),
            n_unmatched=int((~res.matched).sum()),
            matched_per_step=[_mean(res.matched[s].float()) for s in range(res.matched.shape[0])],
        )
    else:
        out.update(
            draft_accept=None, overlap_matched=None, overlap_unmatched=None, n_matched=0, n_unmatched=0
        )
    if res.overlap_kept is not None and res.kept_valid is not None:
        out["kept"] = kept_summary(res)
    if res.mass is not None and res.mass_valid is not None and bool(res.mass_valid.any()):
        out["attn_mass"] = attention_mass_summary(res)
    if res.top2_overlap is not None:
        out["top2"] = top2_summary(res)
    if res.confidence is not None and res.matched is not None and res.confidence.shape == res.matched.shape:
        out["by_confidence"] = confidence_bins(res.confidence, res.matched, ov, valid)
    return out


def kept_summary(res: RunResult) -> dict:
    """The overlap against the selection's own choice with the true query (sticky candidates:
    the exact top-K keeps the blocks the prediction kept), overall, per layer and split by draft
    match as :func:`lookahead_summary`'s."""
    ov, valid = res.overlap_kept, res.kept_valid
    per_layer = [_mean(ov[:, layer], valid[:, layer]) for layer in range(ov.shape[1])]
    out = {
        "overlap": _mean(ov, valid),
        "overlap_per_layer": per_layer,
        "overlap_min_layer": min((x for x in per_layer if x is not None), default=None),
        "overlap_matched": None,
        "overlap_unmatched": None,
    }
    if res.matched is not None and res.matched.numel() and res.matched.shape[0] == ov.shape[0]:
        m = res.matched.unsqueeze(1).expand_as(valid)
        out.update(overlap_matched=_mean(ov, valid & m), overlap_unmatched=_mean(ov, valid & ~m))
    return out


def attention_mass_summary(res: RunResult) -> dict:
    """Means over the sampled (step, layer, request) cells of the true query's attention share in
    the exact top-K (what the Quest-like ideal reads), the predicted set, the resident set and the
    K blocks of most attention (``best``: the ceiling of any block scoring at this budget), each
    with the local block; the predicted share split by draft match when there is a draft."""
    mass, valid = res.mass, res.mass_valid  # [S', L, n, 3], [S', L, n]
    out = {
        "exact": _mean(mass[..., 0], valid),
        "predicted": _mean(mass[..., 1], valid),
        "resident": _mean(mass[..., 2], valid),
        "best": _mean(mass[..., 3], valid),
        "cells": int(valid.sum()),
        "resident_per_layer": [
            _mean(mass[:, layer, :, 2], valid[:, layer]) for layer in range(mass.shape[1])
        ],
    }
    if res.matched is not None and res.matched.shape == (mass.shape[0], mass.shape[2]):
        m = res.matched.unsqueeze(1).expand_as(valid)
        out["predicted_matched"] = _mean(mass[..., 1], valid & m)
        out["predicted_unmatched"] = _mean(mass[..., 1], valid & ~m)
    return out


def top2_summary(res: RunResult) -> dict:
    """Lookahead from the two best drafts (``+top2``): per set of :data:`TOP2_SETS`, the overlap with
    the exact top-K and the attention share (sampled cells); and how often the runner-up draft was
    the next token (``runner_up_accept``; the best draft's is ``draft_accept``)."""
    ov, valid = res.top2_overlap, res.top2_valid
    out: dict = {"overlap": {name: _mean(ov[..., i], valid) for i, name in enumerate(TOP2_SETS)}}
    mass, mv = res.top2_mass, res.top2_mass_valid
    if mass is not None and mv is not None and bool(mv.any()):
        out["attn_mass"] = {name: _mean(mass[..., i], mv) for i, name in enumerate(TOP2_SETS)}
        out["mass_cells"] = int(mv.sum())
    out["runner_up_accept"] = _mean(res.matched2.float()) if res.matched2 is not None else None
    return out


#: Edges of the draft-confidence bins of :func:`confidence_bins`.
CONFIDENCE_EDGES = (0.0, 0.25, 0.5, 0.75, 1.0)


def confidence_bins(conf: torch.Tensor, matched: torch.Tensor, ov: torch.Tensor, valid: torch.Tensor) -> list:
    """Per bin of the head's probability of its draft: the share of steps, the acceptance and the
    lookahead overlap (mean over layers and heads). Whether a confident draft is a right one is what
    a confidence-gated selection would rely on. conf, matched: [S', n]; ov, valid: [S', L, n]."""
    out = []
    total = int(torch.isfinite(conf).sum())
    for lo, hi in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:], strict=False):
        sel = (conf >= lo) & ((conf < hi) if hi < 1.0 else (conf <= hi))
        cnt = int(sel.sum())
        m = sel.unsqueeze(1).expand_as(valid)
        out.append(
            {
                "lo": lo,
                "hi": hi,
                "steps": cnt,
                "share": cnt / total if total else None,
                "accept": _mean(matched.float(), sel) if cnt else None,
                "overlap": _mean(ov, valid & m) if cnt else None,
            }
        )
    return out
