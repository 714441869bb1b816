"""Teacher-forced runs through the library's own request lifecycle (:class:`~oasiskv.LLMEngine`).

A run takes texts of ``C + 1`` tokens and adds, per text, a request whose prompt is the first
``P = C - S`` tokens and whose generated tokens are forced to be the rest
(``add_request(..., forced_tokens=text[P:])``, ``max_tokens = S + 1``). The engine prefills the
prompts (dense, as it always does; the first token, ``text[P]``, replaces the prefill's sample),
turns the requests sparse right away (``oasis``), and then decodes ``S`` steps feeding the TRUE
token as x_t every step. Decode step j feeds ``text[P + j]`` and its row-0 logits predict
``text[P + j + 1]``; the last step sees a context of ``C`` tokens. Only the decode steps' logits
are scored, read by the engine's step recorder (``LLMEngine.recorder.on_step``). The lookahead
token of each step comes from the policy's drafter:

* ``eagle3``  — :class:`~oasiskv.drafters.Eagle3Drafter` over the target's captured hidden states,
  as the library runs it: the head's cache is first filled over the prompt's features, which the
  engine captures during its prefill;
* ``eagle3-noprefill`` — the same head with ``prefill=False``: its cache starts empty at the first
  decode step (what the library did before; shows what the prompt context is worth);
* ``ngram``   — :class:`~oasiskv.drafters.NgramDrafter` (prompt lookup over the text so far);
* ``oracle``  — :class:`~oasiskv.drafters.OracleDrafter`: the true next token (known here);
* ``previous-query`` — no lookahead row: x_t's own query selects the next step (FreeKV-like).

A ``+codes`` suffix (``eagle3+codes``, ``oracle+current+codes``) ranks blocks by their 2-bit key
codes (``KvConfig(block_score="codes")``) instead of the Quest bound; ``+codesF`` (``eagle3+codes3``)
ranks only the Quest bound's best ``F x K`` blocks by them (``KvConfig(score_candidates=F)``).
A ``+current`` suffix (``eagle3+current``) runs that drafter with
``KvConfig(select_queries="lookahead+current")``: the lookahead and the current query choose the
working set together.

The Quest-like reference is a :class:`~oasiskv.eval.policies.QuestPolicy` on a dense engine
(:meth:`Policy.selection_policy`). Per step and text the runner keeps the NLL of the true token,
the top-1 token and, against a dense run of the same texts, KL(dense || policy). A
:class:`LookaheadRecorder` on the engine receives, per layer and step, the predicted top-K of the
previous step, the exact top-K of this step's true query and the working set this step attended
over (``Engine.recorder``).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import torch

from .. import ops
from ..config import KvConfig
from ..drafters import Eagle3Drafter, NgramDrafter, OracleDrafter, PreviousQueryDrafter
from ..engine import PrefillCache, csr_tables, keep_sinks, recall_overlap, relative_to_best
from ..layer_budget import fit_layer_blocks
from ..llm_engine import LLMEngine, SamplingParams, StepInfo
from ..policy import SelectionPolicy
from .policies import QuestPolicy

#: ``eagle3`` is the library's drafter (its head first runs over the prompt's features from the
#: engine's own prefill); ``eagle3-noprefill`` starts the head with an empty cache.
DRAFTERS = ("eagle3", "eagle3-noprefill", "ngram", "oracle", "previous-query")


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter name of the evaluation,
    ``BASE[+current][+fidelity][+codes[F]][+sticky][+sinkN][+pinN][+succN][+confP][+layers][+top2]``, and what
    each part sets: ``+current`` ``KvConfig(select_queries="lookahead+current")``, ``+fidelity``
    the library's default selection (``KvConfig()``'s ``"auto"`` fields; not with ``+codes``,
    ``+sticky``, ``+succN``, ``+confP``, which it sets), ``+codes``
    ``KvConfig(block_score="codes")`` (``+codesF``: and ``score_candidates=F``), ``+sticky``
    ``KvConfig(sticky_candidates=True)`` (after ``+codesF``), ``+confP`` (EAGLE-3 only)
    ``KvConfig(lookahead_min_confidence=P)``, ``+sinkN``
    ``KvConfig(sink_blocks=N)``, ``+pinN`` ``KvConfig(pin_blocks=N)``, ``+succN``
    ``KvConfig(successor_blocks=N)``, ``+layers`` ``KvConfig(layer_blocks=...)`` fitted on
    calibration text with the budget's total (:func:`kv_budget_kwargs`; ``+layersout``: fitted
    on the attention output's error instead of its mass); ``+top2`` (EAGLE-3
    only) changes nothing in the engine and also measures lookahead from the head's two best drafts
    (:class:`LookaheadRecorder`)."""

    base: str
    select_queries: str = "lookahead"
    block_score: str = "quest"
    sink_blocks: int = 0
    top2: bool = False
    score_candidates: float | str | None = None
    pin_blocks: int = 0
    successor_blocks: int | str = 0
    layers: str = ""  # "" (uniform), or the metric of the fit: "mass" (+layers), "output" (+layersout)
    sticky_candidates: bool | str = False
    lookahead_min_confidence: float | str | None = None

    def kv_kwargs(self) -> dict:
        """The :class:`~oasiskv.KvConfig` keyword arguments the suffixes set."""
        return dict(
            select_queries=self.select_queries,
            block_score=self.block_score,
            sink_blocks=self.sink_blocks,
            pin_blocks=self.pin_blocks,
            successor_blocks=self.successor_blocks,
            score_candidates=self.score_candidates,
            sticky_candidates=self.sticky_candidates,
            lookahead_min_confidence=self.lookahead_min_confidence,
        )


_CODES_F = re.compile(r"(\d+(\.\d+)?)?")  # the F of "+codesF"
_CONF_P = re.compile(r"(0(\.\d+)?|1(\.0+)?)")  # the P of "+confP", a probability


def parse_drafter(name: str) -> DrafterSpec:
    """The :class:`DrafterSpec` of ``name``; ValueError for an unknown one (the message lists the
    grammar). The suffixes come in the order given, each at most once."""
    base, *mods = str(name).split("+")
    kw: dict = {}
    order = ("current", "fidelity", "codes", "sticky", "sink", "pin", "succ", "conf", "layers", "top2")
    last = -1
    ok = base in DRAFTERS
    for m in mods:
        key = m
        for prefix in ("sink", "pin", "succ"):
            if m.startswith(prefix):
                key = prefix if m[len(prefix) :].isdigit() else ""
        if m.startswith("conf"):
            key = "conf" if _CONF_P.fullmatch(m[4:]) else ""
        if m in ("layers", "layersout"):
            key = "layers"
        if m.startswith("codes") and _CODES_F.fullmatch(m[5:]):
            key = "codes"
        if not ok or key not in order or order.index(key) <= last:
            ok = False
            break
        last = order.index(key)
        if key == "current":
            ok = base != "previous-query"  # no lookahead row to combine with
            kw["select_queries"] = "lookahead+current"
        elif key == "fidelity":
            # KvConfig's default selection: its "auto" fields, resolved as the library resolves
            # them (the confidence fallback by the engine, for this drafter).
            kw.update(
                block_score="codes",
                score_candidates="auto",
                sticky_candidates="auto",
                successor_blocks="auto",
                lookahead_min_confidence="auto",
            )
        elif key in ("codes", "sticky", "succ", "conf") and "fidelity" in mods:
            ok = False  # the preset sets these
        elif key == "codes":
            kw["block_score"] = "codes"
            if m[5:]:
                kw["score_candidates"] = float(m[5:])
                ok = kw["score_candidates"] >= 1
        elif key == "sticky":
            ok = "score_candidates" in kw  # the previous prediction joins the two stages' candidates
            kw["sticky_candidates"] = True
        elif key == "sink":
            kw["sink_blocks"] = int(m[4:])
        elif key == "pin":
            kw["pin_blocks"] = int(m[3:])
        elif key == "succ":
            kw["successor_blocks"] = int(m[4:])
        elif key == "conf":
            ok = base.startswith("eagle3")  # a drafter that reports its probability
            kw["lookahead_min_confidence"] = float(m[4:])
        elif key == "layers":
            kw["layers"] = "output" if m == "layersout" else "mass"
        else:
            ok = base.startswith("eagle3")  # the runner-up needs a head that ranks drafts
            kw["top2"] = True
    if not ok:
        raise ValueError(
            f"unknown drafter {name!r}; use one of {DRAFTERS}, then optionally '+current' (not "
            "previous-query, which has no lookahead row), '+fidelity' (KvConfig()'s default "
            "selection; not with the four suffixes it sets), '+codes' or '+codesF' (F >= 1: the "
            "Quest bound's best F x K blocks ranked by the codes), '+sticky' (after '+codesF': the "
            "previous prediction stays among the candidates), '+sinkN' (N sink blocks), '+pinN' "
            "(N pinned blocks per layer and KV head), '+succN' (the next block of the N best), '+confP' "
            "(eagle3 only: the step's own query selects when the head's probability is below P), "
            "'+layers' or '+layersout' (per-layer budgets fitted on calibration text by attention "
            "mass or output error) and '+top2' (eagle3 only), "
            "in that order"
        )
    return DrafterSpec(base, **kw)


# (id(model), K, block size, calibration texts) -> the fitted per-layer budgets
_LAYER_FITS: dict[tuple, tuple[int, ...]] = {}


def kv_budget_kwargs(
    spec: DrafterSpec, top_k_blocks: int, block_size: int, model=None, calibration=None
) -> dict:
    """The :class:`~oasiskv.KvConfig` keyword arguments of ``spec`` at a uniform budget of
    ``top_k_blocks``: its suffixes' (:meth:`DrafterSpec.kv_kwargs`) and ``top_k_blocks``; with
    ``+layers``, per-layer budgets with the same total fitted on ``calibration`` (token lists of
    the train split, :func:`oasiskv.layer_budget.fit_layer_blocks`; one fit per model, budget and
    texts), ``top_k_blocks`` their largest and ``sparse_threshold`` still the uniform budget's
    tokens (callers' own keywords go on top)."""
    kw = {**spec.kv_kwargs(), "top_k_blocks": top_k_blocks}
    if spec.layers:
        if model is None or not calibration:
            raise ValueError("+layers needs calibration texts to fit the per-layer budgets on")
        key = (id(model), top_k_blocks, block_size, spec.layers, tuple(tuple(t) for t in calibration))
        if key not in _LAYER_FITS:
            _LAYER_FITS[key] = fit_layer_blocks(
                model, calibration, top_k_blocks, block_size, metric=spec.layers
            )
        alloc = _LAYER_FITS[key]
        kw.update(top_k_blocks=max(alloc), layer_blocks=alloc, sparse_threshold=top_k_blocks * block_size)
    return kw


def block_score_of(name: str) -> tuple[str, str]:
    """``"eagle3+codes"`` -> ``("eagle3", "codes")``: a ``+codes`` (or ``+codesF``) suffix runs the
    drafter with ``KvConfig(block_score="codes")`` (2-bit key codes); without it, ``("eagle3",
    "quest")``."""
    spec = parse_drafter(name)
    return "+".join(x for x in name.split("+") if not x.startswith("codes")), spec.block_score


def drafter_parts(name: str) -> tuple[str, str]:
    """``"eagle3+current"`` -> ``("eagle3", "lookahead+current")``; ``"eagle3"`` -> ``("eagle3",
    "lookahead")``; the other suffixes (:func:`parse_drafter`) are accepted and ignored here.
    Raises ValueError for an unknown name (the message lists the grammar)."""
    spec = parse_drafter(name)
    return spec.base, spec.select_queries


@dataclass(frozen=True)
class Policy:
    """One configuration of a teacher-forced run, and how it maps onto the engine: its
    :attr:`backend`, its drafter (:attr:`drafter`, oasis only: FreeKV-like is ``previous-query``)
    and its :meth:`selection_policy` (the Quest-like :class:`QuestPolicy`, else the engine as it
    is)."""

    kind: str  # "dense" | "oasis" | "quest"
    drafter: str | None = None  # oasis only: one of DRAFTERS
    top_k_blocks: int | None = None
    fetch_cap: float | int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "oasis", "quest"):
            raise ValueError(f"policy kind must be dense, oasis or quest, got {self.kind!r}")
        if self.kind == "oasis":
            drafter_parts(self.drafter or "")
        if self.kind != "dense" and (self.top_k_blocks is None or self.top_k_blocks < 1):
            raise ValueError(f"{self.kind} needs top_k_blocks >= 1")

    @property
    def backend(self) -> str:
        """The engine backend: ``"oasis"`` for OasisKV, ``"dense"`` for dense and Quest-like."""
        return "oasis" if self.kind == "oasis" else "dense"

    def selection_policy(self) -> SelectionPolicy | None:
        """A fresh :class:`~oasiskv.policy.SelectionPolicy` for the engine, or None for the engine
        as it is (dense, and OasisKV with its drafter)."""
        return QuestPolicy(self.top_k_blocks) if self.kind == "quest" else None

    @property
    def label(self) -> str:
        if self.kind == "dense":
            return "dense"
        if self.kind == "quest":
            return f"quest K={self.top_k_blocks}"
        cap = "uncapped" if self.fetch_cap is None else f"cap={self.fetch_cap}"
        return f"oasis/{self.drafter} K={self.top_k_blocks} {cap}"


def _rows(r) -> list[int]:
    """The host rows of ``r``'s blocks (its K/V in ``host_k``/``host_v``). A staged request with a
    bounded cache (``LLMEngine(kv_cache_blocks=)``) has no row for its uncached blocks: the
    teacher reads the whole context, so it refuses it."""
    t = r.runtime.table(r.id)
    if t.get("cache_blocks") is not None:
        raise ValueError(
            f"request {r.id} holds only a bounded cache of its staged blocks (kv_cache_blocks); the "
            "exact-attention teacher needs every block on the host: run it without kv_cache_blocks"
        )
    return t["host_rows"]


def block_attention_mass(engine, layer: int, sp_reqs, q: torch.Tensor) -> torch.Tensor:
    """The softmax attention of each request's true query ``q [n, num_qo_heads, head_dim]`` over
    its whole context (every token up to and including x_t, read from the host pool, which holds
    all of it), summed per block and averaged over the query heads of each KV head:
    ``[n, num_kv_heads, max_blocks]`` float64 on the CPU, zero past a request's last block.

    The exact attention a dense engine computes; an evaluation metric only (it reads the whole
    context per layer, on the CPU)."""
    g, b = engine.geo, engine.kv.block_size
    hq, hk, d = g.num_qo_heads, g.num_kv_heads, g.head_dim
    group = hq // hk
    lens = [r.kv_len + 1 for r in sp_reqs]  # x_t sits at position kv_len
    nblk = [(t + b - 1) // b for t in lens]
    width = max(nblk)
    host_k = engine.pools.host_k[layer]
    out = torch.zeros(len(sp_reqs), hk, width, dtype=torch.float64)
    # Dot products in float32 (the gather and matmul dominate), softmax and sums in float64.
    qc = q.detach().to("cpu", torch.float32).view(-1, hk, group, d)  # query head h reads KV head h // group
    for i, r in enumerate(sp_reqs):
        idx = torch.tensor(_rows(r)[: nblk[i]], dtype=torch.long)
        k = host_k.index_select(0, idx).to(torch.float32)  # [blocks, hk, b, d]
        k = k.permute(1, 0, 2, 3).reshape(hk, nblk[i] * b, d)[:, : lens[i]]  # [hk, T, d]
        logits = torch.matmul(qc[i], k.transpose(1, 2)).double() * d**-0.5  # [hk, group, T]
        w = torch.softmax(logits, dim=-1)
        w = torch.nn.functional.pad(w, (0, nblk[i] * b - lens[i])).view(hk, group, nblk[i], b).sum(-1)
        out[i, :, : nblk[i]] = w.mean(1)
    return out


def covered_mass(mass: torch.Tensor, local: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The attention share of ``blocks [n, hk, K]`` (logical, -1 = none; duplicates counted once)
    plus each request's ``local`` block, averaged over KV heads: ``[n]``."""
    n, hk, width = mass.shape
    keep = torch.zeros(n, hk, width + 1, dtype=torch.bool)
    sel = torch.where(blocks >= 0, blocks.long(), width).clamp(max=width)
    keep.scatter_(2, sel, True)
    keep = keep[..., :width]
    keep[torch.arange(n), :, local.clamp(max=width - 1)] = True
    return (mass * keep).sum(-1).mean(-1)


def best_mass_blocks(mass: torch.Tensor, local: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` complete blocks (before each request's ``local`` block) of most attention per KV
    head, -1 padded: ``[n, hk, k]``. What a selection that knew the true attention would keep."""
    n, hk, width = mass.shape
    cand = torch.arange(width).view(1, 1, width) < local.view(n, 1, 1)
    ranked = torch.where(cand, mass, torch.full_like(mass, -1.0))
    vals, idx = ranked.topk(min(k, width), dim=-1)
    idx = torch.where(vals >= 0, idx, torch.full_like(idx, -1))
    return torch.nn.functional.pad(idx, (0, k - idx.shape[-1]), value=-1)


def shadow_queries(engine, sp_reqs, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's query ``[n, m, num_qo_heads, head_dim]`` of ``m`` alternative tokens per request
    (``tokens [n, m]``) at the position x_t holds now (``kv_len``), each attending to the request's
    context before x_t (read from the host pool, which holds all of it) and to itself: the queries
    the lookahead row would have had with each token as its draft, one step late. An evaluation
    measurement (one extra forward of ``n * m`` rows with dense attention, on the engine's model)."""
    g, b = engine.geo, engine.kv.block_size
    n, m = tokens.shape
    hq, hk, d = g.num_qo_heads, g.num_kv_heads, g.head_dim
    group = hq // hk
    dev = engine.device
    lens = [r.kv_len for r in sp_reqs]
    blocks = [
        torch.tensor(_rows(r)[: -(-t // b)], dtype=torch.long, device=dev)
        for r, t in zip(sp_reqs, lens, strict=True)
    ]
    out: list = [None] * engine.cfg.num_hidden_layers

    def attn(layer, q, k, v):
        out[layer] = q.view(n, m, hq, d).clone()
        qf = q.float().view(n, m, hk, group, d)
        kf, vf = k.float().view(n, m, hk, d), v.float().view(n, m, hk, d)
        o = torch.empty(n, m, hk, group, d, dtype=torch.float32, device=q.device)
        p = engine.pools
        for i, t in enumerate(lens):
            kc = (
                p.host_k[layer]
                .index_select(0, blocks[i])
                .float()
                .permute(1, 0, 2, 3)
                .reshape(hk, -1, d)[:, :t]
            )
            vc = (
                p.host_v[layer]
                .index_select(0, blocks[i])
                .float()
                .permute(1, 0, 2, 3)
                .reshape(hk, -1, d)[:, :t]
            )
            ctx = torch.einsum("mhgd,htd->mhgt", qf[i], kc)
            own = torch.einsum("mhgd,mhd->mhg", qf[i], kf[i]).unsqueeze(-1)
            w = torch.softmax(torch.cat([ctx, own], dim=-1) * d**-0.5, dim=-1)
            o[i] = torch.einsum("mhgt,htd->mhgd", w[..., :t], vc) + w[..., t:] * vf[i].unsqueeze(2)
        return o.view(n * m, hq, d).to(q.dtype)

    pos = torch.tensor(lens, device=dev).repeat_interleave(m)
    engine.model.forward(tokens.reshape(-1).to(dev), pos, attn, logits_rows=pos[:0])
    return out


def union_by_rank(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` distinct blocks of ``a[0], b[0], a[1], b[1], ...`` per (request, head): the
    union of two best-first top-K lists ``[n, hk, K]`` (-1 padded) within ``k``, alternating from
    ``a``. ``[n, hk, k]``, -1 padded."""
    seq = torch.stack([a, b], dim=-1).flatten(-2)  # [n, hk, 2K]
    w = seq.shape[-1]
    earlier = torch.ones(w, w, dtype=torch.bool, device=seq.device).tril(-1)
    dup = ((seq.unsqueeze(-1) == seq.unsqueeze(-2)) & earlier).any(-1)
    keep = (seq >= 0) & ~dup
    rank = keep.long().cumsum(-1) - 1
    keep &= rank < k
    out = torch.full((*seq.shape[:-1], k + 1), -1, dtype=seq.dtype, device=seq.device)
    out.scatter_(-1, torch.where(keep, rank, k), seq)
    return out[..., :k]


#: The block sets of the top-2 measurement: the best draft's shadow query alone (the control),
#: the two drafts' top-K merged by rank, and by the larger relative score (as lookahead+current).
TOP2_SETS = ("top1", "union_rank", "union_max")


def _grid(rows, num_layers: int, req_ids: list[int], steps: list[int], fields) -> list[torch.Tensor]:
    """Rows ``(step, layer, request ids, *values)``, each value ``[n, *tail]``, laid out as one CPU
    tensor per value ``[len(steps), num_layers, len(req_ids), *tail]`` (``fields``: its ``(tail,
    dtype)``); rows of steps not listed are skipped, cells without a row stay zero."""
    s_idx = {s: i for i, s in enumerate(steps)}
    r_idx = {r: i for i, r in enumerate(req_ids)}
    out = [torch.zeros(len(steps), num_layers, len(req_ids), *tail, dtype=dt) for tail, dt in fields]
    for step, layer, ids, *values in rows:
        if step not in s_idx:
            continue
        cols = torch.tensor([r_idx[i] for i in ids])
        for grid, v in zip(out, values, strict=True):
            grid[s_idx[step], layer, cols] = v.cpu().to(grid.dtype)
    return out


class LookaheadRecorder:
    """``Engine.recorder``: per (step, layer, request) lookahead overlap and working-set hit.

    * overlap: |predicted ∩ exact| / |exact|, averaged over KV heads, where ``predicted`` is the
      top-K chosen by last step's lookahead (or current, for previous-query) query and ``exact`` the
      top-K of this step's true query, both over the blocks that were complete at prediction time;
    * resident hit: the same with ``predicted`` replaced by the working set this step attended over
      (what the fetch cap let in);
    * kept overlap (sticky candidates only): the overlap with the true query's top-K when it, too,
      keeps the blocks the prediction kept as candidates: the selection's own choice had it known
      the query, so that a kept block is not a miss because the plain top-K never keeps one.

    Only steps with :attr:`enabled` are kept (the runner skips the first sparse step, whose
    prediction came from the prompt's last query, not from a lookahead row). Values stay on the
    device until :meth:`tensors` (no host sync inside the engine's background chain).
    """

    #: Ask the engine for ``actual_kept`` (sticky candidates: the selection's own choice).
    kept_reference = True

    def __init__(self, mass_every: int = 0) -> None:
        self.enabled = False
        self.step = -1
        self.mass_every = int(mass_every)
        self._rows: list[tuple[int, int, list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._kept: list[tuple[int, int, list[int], torch.Tensor, torch.Tensor]] = []
        self._mass: list[tuple[int, int, list[int], torch.Tensor, torch.Tensor]] = []
        #: Top-2 drafts (``+top2``): request id -> (best draft, runner-up) of the step before
        #: :attr:`step`, set by the chunk scorer; their shadow queries are computed at layer 0.
        self.top2_drafts: dict[int, tuple[int, int]] | None = None
        self._shadow: list[torch.Tensor] | None = None
        self._top2: list[tuple[int, int, list[int], torch.Tensor, torch.Tensor]] = []
        self._top2_mass: list[tuple[int, int, list[int], torch.Tensor, torch.Tensor]] = []

    def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None, actual_kept=None) -> None:
        if not self.enabled:
            return
        ov, n = recall_overlap(actual, prev)
        resident = engine.pools.page_map[layer][slot_pages.long()].transpose(1, 2)  # [n, hk, K]
        hit, _ = recall_overlap(actual, resident)
        denom = n.clamp(min=1)
        ids = [r.id for r in sp_reqs]
        self._rows.append((self.step, layer, ids, ov / denom, hit / denom, n > 0))
        if actual_kept is not None:
            ovk, nk = recall_overlap(actual_kept, prev)
            self._kept.append((self.step, layer, ids, ovk / nk.clamp(min=1), nk > 0))
        top2 = self._top2_sets(engine, layer, sp_reqs, actual.shape[-1])
        cells = torch.ones(len(ids), dtype=torch.bool)
        if top2 is not None:
            ov2 = torch.stack([recall_overlap(actual, x)[0] / denom for x in top2], dim=-1)
            self._top2.append((self.step, layer, ids, ov2, n > 0))  # [n, 3]
        if q is not None and self.mass_every > 0 and self.step % self.mass_every == 0:
            mass = block_attention_mass(engine, layer, sp_reqs, q)  # [n, hk, blocks] (CPU)
            local = torch.tensor([r.kv_len // engine.kv.block_size for r in sp_reqs])
            best = best_mass_blocks(mass, local, actual.shape[-1])
            cov = [covered_mass(mass, local, s.cpu()) for s in (actual, prev, resident, best)]
            self._mass.append((self.step, layer, ids, torch.stack(cov, dim=-1), cells))  # [n, 4], [n]
            if top2 is not None:
                cov2 = [covered_mass(mass, local, x.cpu()) for x in top2]
                self._top2_mass.append((self.step, layer, ids, torch.stack(cov2, dim=-1), cells))

    def _top2_sets(self, engine, layer: int, sp_reqs, k: int) -> list[torch.Tensor] | None:
        """The :data:`TOP2_SETS` of this step and layer (``[n, hk, k]`` each), predicted from the
        shadow queries of the previous step's two best drafts over the blocks complete then (those
        before x_t's own block, as the recall's exact top-K), with the engine's block score and
        sink blocks; None without drafts for every request."""
        drafts = self.top2_drafts
        if drafts is None or any(r.id not in drafts for r in sp_reqs):
            return None
        if layer == 0 or self._shadow is None:
            toks = torch.tensor([drafts[r.id] for r in sp_reqs], dtype=torch.long)
            self._shadow = shadow_queries(engine, sp_reqs, toks)
        b, n_sink = engine.kv.block_size, engine.kv.sink_blocks
        cand = [r.host_blocks[: r.kv_len // b] for r in sp_reqs]
        indptr, indices = csr_tables(cand, engine.device)
        qs = self._shadow[layer].to(engine.dtype)
        q1, q2 = qs[:, 0].contiguous(), qs[:, 1].contiguous()
        # Each draft's own set as the engine ranks it (two stages with KvConfig.score_candidates);
        # the max-score union compares one-stage scores of every block.
        top = [engine.top_k_blocks(layer, x, (indptr, indices), k) for x in (q1, q2)]
        s1 = engine.block_scores(layer, q1, (indptr, indices))
        s2 = engine.block_scores(layer, q2, (indptr, indices))
        hk = engine.geo.num_kv_heads
        seq = torch.repeat_interleave(
            torch.arange(len(cand), device=engine.device),
            torch.tensor([len(c) for c in cand], device=engine.device),
        )
        if s1.shape[0]:
            s1, s2 = relative_to_best(s1, seq, len(cand)), relative_to_best(s2, seq, len(cand))
        both = keep_sinks(torch.maximum(s1, s2), indptr, n_sink)
        return [top[0], union_by_rank(top[0], top[1], k), ops.topk_blocks(hk, both, indptr, k)]

    def clear(self) -> None:
        self._rows.clear()
        self._kept.clear()
        self._mass.clear()
        self._top2.clear()
        self._top2_mass.clear()

    def top2_tensors(self, num_layers: int, req_ids: list[int], steps: list[int]):
        """(overlap, valid, mass, mass_valid) of the :data:`TOP2_SETS`: overlap with the exact top-K
        ``[len(steps), num_layers, len(req_ids), 3]`` and the attention share (sampled cells)."""
        n = len(TOP2_SETS)
        ov, valid = _grid(self._top2, num_layers, req_ids, steps, (((n,), torch.float32), ((), torch.bool)))
        fields = (((n,), torch.float64), ((), torch.bool))
        mass, mass_valid = _grid(self._top2_mass, num_layers, req_ids, steps, fields)
        return ov, valid, mass, mass_valid

    def mass_tensors(self, num_layers: int, req_ids: list[int], steps: list[int]):
        """(mass, valid): the share of the true query's attention that falls in the exact top-K,
        the predicted set, the resident set and the K blocks of most attention (each with the local
        block), ``[len(steps), num_layers, len(req_ids), 4]``; valid marks the sampled cells."""
        mass, valid = _grid(self._mass, num_layers, req_ids, steps, (((4,), torch.float64), ((), torch.bool)))
        return mass, valid

    def kept_tensors(self, num_layers: int, req_ids: list[int], steps: list[int]):
        """(kept overlap, valid) ``[len(steps), num_layers, len(req_ids)]``, or None where the
        engine gave no kept top-K (no sticky candidates)."""
        if not self._kept:
            return None
        return tuple(_grid(self._kept, num_layers, req_ids, steps, (((), torch.float32), ((), torch.bool))))

    def tensors(self, num_layers: int, req_ids: list[int], steps: list[int]):
        """(overlap, resident_hit, valid) as float/bool CPU tensors [len(steps), num_layers, len(req_ids)]."""
        f32, flag = ((), torch.float32), ((), torch.bool)
        return tuple(_grid(self._rows, num_layers, req_ids, steps, (f32, f32, flag)))


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


class TeacherForcing:
    """Teacher-forced runs of many policies over the same texts (see the module docstring).

    Args:
        model: a ``CausalLM`` (any device).
        texts: token lists, all of the same length ``C + 1``.
        steps: S, the number of teacher-forced decode steps (``< C``).
        block_size: KV block size of every run.
        batch_size: texts decoded together per engine batch.
        eagle3_head: an :class:`~oasiskv.models.eagle3.Eagle3Head` attached to ``model`` (for the
            ``eagle3`` drafter).
        progress: tqdm bars over the steps of each run.
        mass_every: every how many measured steps the recorder also computes the true query's
            exact attention over the whole context and the share of it each block set covers
            (``attn_mass`` in the lookahead summary; 0 = never). It reads the whole context per
            layer on the CPU, so sample.
    """

    def __init__(
        self,
        model,
        texts: list[list[int]],
        steps: int,
        *,
        block_size: int = 16,
        batch_size: int = 8,
        eagle3_head=None,
        progress: bool = True,
        mass_every: int = 0,
        calibration: list[list[int]] | None = None,
    ) -> None:
        lens = {len(t) for t in texts}
        if not texts or len(lens) != 1:
            raise ValueError(f"need one or more texts of equal length, got lengths {sorted(lens)}")
        self.length = lens.pop()
        self.context = self.length - 1
        if not 1 <= steps < self.context - block_size:
            raise ValueError(f"steps must be in [1, {self.context - block_size}), got {steps}")
        self.model = model.eval()
        self.texts = [list(t) for t in texts]
        self.steps = steps
        self.prefix = self.context - steps
        self.block_size = block_size
        self.batch_size = max(1, batch_size)
        self.head = eagle3_head
        self.progress = progress
        if mass_every < 0:
            raise ValueError(f"mass_every must be >= 0, got {mass_every}")
        self.mass_every = mass_every
        #: Train-split token lists the ``+layers`` drafters fit their per-layer budgets on.
        self.calibration = calibration
        self.device = next(model.parameters()).device
        self.cache = PrefillCache(capacity=3 * min(self.batch_size, len(texts)))
        #: The :class:`QuestPolicy` of the latest Quest-like chunk (tests read its counters).
        self.quest_policy: QuestPolicy | None = None
        self._pools: dict[str, object] = {}
        self._dense: list[dict] | None = None  # per chunk: logp [S, n, V], top1 [S, n]

    # -------------------------------------------------------------- helpers
    def _chunks(self) -> list[list[int]]:
        idx = list(range(len(self.texts)))
        return [idx[i : i + self.batch_size] for i in range(0, len(idx), self.batch_size)]

    def _drafter(self, policy: Policy, chunk: list[list[int]]):
        if policy.kind != "oasis":
            return None
        name, _ = drafter_parts(policy.drafter)
        if name == "ngram":
            return NgramDrafter()
        if name == "oracle":
            return OracleDrafter([t[self.prefix :] for t in chunk])
        if name == "previous-query":
            return PreviousQueryDrafter()
        if self.head is None:
            raise ValueError(f"the {name} drafter needs an EAGLE-3 head (pass --eagle3 PATH)")
        if name == "eagle3-noprefill":
            return Eagle3Drafter(self.head, self.model, prefill=False)
        return Eagle3Drafter(self.head, self.model)

    def _engine(self, policy: Policy, drafter, n: int) -> LLMEngine:
        """The engine of one chunk of ``n`` texts: room for all of them at once, and a prefill
        budget for all their prompts in one step, so the whole chunk is admitted and prefilled in
        the first step and every decode step runs the same batch."""
        b = self.block_size
        if policy.kind == "oasis":
            spec = parse_drafter(policy.drafter)
            kv = KvConfig(
                **{
                    **kv_budget_kwargs(spec, policy.top_k_blocks, b, self.model, self.calibration),
                    "block_size": b,
                    "fetch_cap": policy.fetch_cap,
                    "sparse_threshold": max(1, self.prefix - 1),  # sparse from the first decode step
                    "measure_recall": True,
                }
            )
        else:
            # Dense (or a policy that scores by itself): no key codes in the engine's prefills.
            kv = KvConfig.fast(block_size=b, top_k_blocks=1, fetch_cap=None, measure_recall=False)
        return LLMEngine(
            self.model,
            kv=kv,
            backend=policy.backend,
            drafter=drafter,
            max_num_seqs=n,
            max_num_batched_tokens=min(1 << 20, max(1, n * self.prefix)),
            prefill_cache=self.cache,
            policy=policy.selection_policy(),
        )

    # -------------------------------------------------------------- runs
    @torch.no_grad()
    def run(self, policy: Policy) -> RunResult:
        """One policy over all texts. The dense policy must run first: the others are compared to it."""
        if policy.kind != "dense" and self._dense is None:
            self.run(Policy("dense"))
        if policy.kind == "dense":
            self._dense = []
        t0 = time.perf_counter()
        parts = []
        for ci, idx in enumerate(self._chunks()):
            parts.append(self._run_chunk(policy, ci, [self.texts[i] for i in idx]))
        res = _concat(policy, parts)
        res.wall_s = time.perf_counter() - t0
        return res

    def _run_chunk(self, policy: Policy, ci: int, chunk: list[list[int]]) -> RunResult:
        S, P, b = self.steps, self.prefix, self.block_size
        n = len(chunk)
        drafter = self._drafter(policy, chunk)
        # An EAGLE-3 drafter keeps its probability of each draft (from the first one on).
        track = getattr(drafter, "track_confidence", None) is not None
        if track:
            drafter.track_confidence = True
        top2 = policy.kind == "oasis" and parse_drafter(policy.drafter).top2
        if top2:
            drafter.track_runner_up = True
        le = self._engine(policy, drafter, n)
        eng = le.engine
        key = str(eng.dtype)
        if key in self._pools:
            eng.pools = self._pools[key]  # one set of pools for every run (swapped in while idle)
        lookahead = None
        if policy.kind == "oasis":
            lookahead = eng.recorder = LookaheadRecorder(self.mass_every)
        dense = self._dense[ci] if self._dense is not None and policy.kind != "dense" else None
        scorer = _ChunkScorer(
            chunk,
            P,
            S,
            self.device,
            vocab=self.model.config.vocab_size if policy.kind == "dense" else None,
            dense=dense,
            lookahead=lookahead,
            confidence=drafter if track else None,
            runner_up=drafter if top2 else None,
        )
        le.recorder = scorer
        params = SamplingParams(max_tokens=S + 1, ignore_eos=True)
        # A fresh engine numbers its requests 0, 1, ... in the order added, and a request's default
        # id is that number: int(rid) is the request's id in the engine's hooks (drafter, recorder).
        rids = [le.add_request(t[:P], params, forced_tokens=t[P : P + S + 1]) for t in chunk]
        scorer.request_ids = rids
        ids = [int(rid) for rid in rids]
        if self.progress:
            from tqdm import tqdm

            scorer.bar = tqdm(total=S, desc=policy.label, unit="step", leave=False)
        try:
            outs = le.run_to_completion(rids)
        finally:
            if scorer.bar is not None:
                scorer.bar.close()
        self._pools[key] = eng.pools
        bad = [o for o in outs.values() if o.finish_reason != "length"]
        if bad or scorer.j != S:
            why = bad[0].error or bad[0].finish_reason if bad else f"{scorer.j} of {S} steps ran"
            raise RuntimeError(f"teacher forcing of {policy.label} stopped early: {why}")
        metrics = [outs[rid].metrics for rid in rids]
        if policy.kind == "dense":
            self._dense.append({"logp": scorer.logp_all, "top1": scorer.top1})
        res = RunResult(
            policy,
            scorer.nll.cpu(),
            scorer.top1.cpu(),
            scorer.kl.cpu() if scorer.kl is not None else None,
            (scorer.top1 == dense["top1"]).cpu() if dense is not None else None,
            fetched_bytes_per_step=[m.fetched_bytes_per_step for m in metrics],
            full_kv_bytes=[m.full_kv_bytes for m in metrics],
            resident_kv_bytes=[m.resident_kv_bytes for m in metrics],
            layer_blocks=eng.kv.layer_blocks,
        )
        if policy.kind == "quest":
            qp = self.quest_policy = eng.policy
            entry = 2 * b * eng.geo.head_dim * eng.dtype.itemsize
            res.would_fetch_bytes_per_step = [float(qp.churn.get(i, 0)) * entry / max(1, S - 1) for i in ids]
            # A dense engine reports its whole KV as resident; so does Quest (everything resident).
        if lookahead is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            measured = list(range(1, S))  # step 0 judges the prompt's last query (make_sparse)
            L = self.model.config.num_hidden_layers
            res.overlap, res.resident_hit, res.valid = lookahead.tensors(L, ids, measured)
            kept = lookahead.kept_tensors(L, ids, measured)
            if kept is not None:
                res.overlap_kept, res.kept_valid = kept
            if self.mass_every:
                res.mass, res.mass_valid = lookahead.mass_tensors(L, ids, measured)
            res.measured_steps = measured
            m, c = scorer.matched, scorer.confidence
            res.matched = torch.tensor(m, dtype=torch.bool) if m else None
            res.confidence = torch.tensor(c, dtype=torch.float32) if c else None
            if top2:
                res.top2_overlap, res.top2_valid, res.top2_mass, res.top2_mass_valid = lookahead.top2_tensors(
                    L, ids, measured
                )
                res.matched2 = torch.tensor(scorer.matched2, dtype=torch.bool) if scorer.matched2 else None
        return res


class _ChunkScorer:
    """The :class:`~oasiskv.LLMEngine` recorder of one teacher-forced chunk (``on_step``).

    Decode step j's logits (row 0 of every request, before the forced token replaces the sample)
    are scored against ``text[P + j + 1]``: NLL, top-1, and KL against the dense run's log-probs.
    Step j's drafts (``StepInfo.drafts``) predicted ``text[P + j + 1]``; from step 1 on, the
    previous step's drafts are checked against this step's input, as the lookahead overlap of this
    step judges them. The :class:`LookaheadRecorder` keeps step j's rows from step 1 on (step 0's
    prediction came from the prompt's last query at ``make_sparse``, not from a lookahead row).
    """

    def __init__(
        self, chunk, P: int, S: int, device, *, vocab, dense, lookahead, confidence, runner_up=None
    ) -> None:
        n = len(chunk)
        self.chunk, self.P, self.S = chunk, P, S
        targets = [[t[P + j + 1] for t in chunk] for j in range(S)]
        self.targets = torch.tensor(targets, device=device)  # [S, n]
        self.nll = torch.empty(S, n, device=device)
        self.top1 = torch.empty(S, n, dtype=torch.long, device=device)
        self.kl = torch.empty(S, n, device=device) if dense is not None else None
        self.logp_all = torch.empty(S, n, vocab, device=device) if vocab is not None else None
        self.dense = dense
        self.lookahead = lookahead
        if lookahead is not None:
            lookahead.enabled, lookahead.step = False, 0
        self.confidence_of = confidence  # the drafter whose last_confidence to read, or None
        self.request_ids: list[str] = []
        self.matched: list[list[bool]] = []
        self.confidence: list[list[float]] = []
        self.runner_up_of = runner_up  # the drafter whose last_runner_up to read (+top2), or None
        self.matched2: list[list[bool]] = []
        self._prev2: list[int] | None = None
        self.bar = None
        self.j = 0
        self._prev: tuple[list, list] | None = None  # the previous step's drafts and confidences

    def on_step(self, info: StepInfo) -> None:
        if info.kind != "decode":
            return
        j = self.j
        if info.request_ids != self.request_ids or j >= self.S:
            raise RuntimeError(
                f"teacher forcing: decode step {j} ran requests {info.request_ids}, expected "
                f"{self.request_ids} (every request of a chunk runs every step together)"
            )
        lp = torch.log_softmax(info.logits.float(), dim=-1)
        self.nll[j] = -lp.gather(1, self.targets[j].unsqueeze(1)).squeeze(1)
        self.top1[j] = lp.argmax(-1)
        if self.logp_all is not None:
            self.logp_all[j] = lp
        if self.dense is not None:
            d = self.dense["logp"][j]
            self.kl[j] = (d.exp() * (d - lp)).sum(-1)
        if self.lookahead is not None:
            has_draft = info.drafts and info.drafts[0] is not None
            if j > 0 and has_draft:
                drafts, conf = self._prev
                self.matched.append([drafts[i] == t[self.P + j] for i, t in enumerate(self.chunk)])
                if self.confidence_of is not None:
                    self.confidence.append(conf)
            conf = []
            if self.confidence_of is not None:
                last = self.confidence_of.last_confidence
                conf = [last.get(int(rid), float("nan")) for rid in info.request_ids]
            self._prev = (list(info.drafts), conf)
            if self.runner_up_of is not None and has_draft:
                # The two best drafts of this step, whose queries the next step's recorder rebuilds.
                if j > 0 and self._prev2 is not None:
                    self.matched2.append(
                        [d == t[self.P + j] for d, t in zip(self._prev2, self.chunk, strict=True)]
                    )
                ru = self.runner_up_of.last_runner_up
                self._prev2 = [ru.get(int(rid), -1) for rid in info.request_ids]
                self.lookahead.top2_drafts = {
                    int(rid): (d, r2)
                    for rid, d, r2 in zip(info.request_ids, info.drafts, self._prev2, strict=True)
                    if r2 >= 0
                }
            self.lookahead.enabled, self.lookahead.step = True, j + 1  # the next step is measured
        self.j += 1
        if self.bar is not None:
            self.bar.update(1)


def _concat(policy: Policy, parts: list[RunResult]) -> RunResult:
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


def greedy_continuations(
    model,
    texts: list[list[int]],
    steps: int,
    *,
    block_size: int = 16,
    batch_size: int = 8,
    progress: bool = False,
) -> list[list[int]]:
    """Each text's first ``C - S`` tokens followed by the ``S + 1`` tokens that dense greedy decoding
    generates after them (``C + 1`` tokens, like the input).

    Teacher-forcing these makes every step's next token the model's own choice, as in real
    decoding: a draft then counts as matched when it agrees with the target (the acceptance EAGLE
    reports), not with a held-out text the target itself would not have predicted.
    """
    from ..llm import LLM  # local: llm imports the engine, as this module does

    context = len(texts[0]) - 1
    prefix = context - steps
    llm = LLM(
        model,
        kv=KvConfig.fast(block_size=block_size),
        backend="dense",
        drafter=None,
        max_batch_size=max(1, batch_size),
    )
    outs = llm.generate(
        [list(t[:prefix]) for t in texts], steps + 1, temperature=0.0, ignore_eos=True, progress=progress
    )
    return [list(t[:prefix]) + list(o.tokens) for t, o in zip(texts, outs, strict=True)]


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
