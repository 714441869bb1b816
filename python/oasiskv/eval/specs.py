"""What a teacher-forced run is: the drafter names of ``oasis eval`` (``eagle3+codes3+current``,
``oracle+sink1``, ...) parsed into a :class:`DrafterSpec` (:func:`parse_drafter`), the
:class:`~oasiskv.config.KvConfig` fields they imply at a budget (:func:`kv_budget_kwargs`, with
the ``+layers`` per-layer budgets fitted once per model and budget), and a run's
:class:`Policy` (OasisKV with a drafter, or the Quest-like reference). Names only; nothing here
runs the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..layer_budget import fit_layer_blocks
from ..policy import SelectionPolicy
from .policies import QuestPolicy

#: ``eagle3`` is the library's drafter (its head first runs over the prompt's features from the
#: engine's own prefill); ``eagle3-noprefill`` starts the head with an empty cache.
DRAFTERS = ("eagle3", "eagle3-noprefill", "ngram", "oracle", "previous-query")


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter name of the evaluation, ``BASE[+current][+fidelity][+codes[F]][+b16][+sticky]
    [+sinkN][+pinN][+succN][+confP][+layers][+hfp8][+top2]`` (one word), and what each part sets:
    ``+current`` ``KvConfig(select_queries="lookahead+current")``, ``+fidelity`` the library's
    default selection (``KvConfig()``'s ``"auto"`` fields; not with ``+codes``, ``+sticky``,
    ``+succN``, ``+confP``, which it sets), ``+codes``
    ``KvConfig(block_score="codes")`` (``+codesF``: and ``score_candidates=F``), ``+b16``
    ``KvConfig(candidate_bound="summaries")`` (after ``+codesF`` or ``+fidelity``), ``+sticky``
    ``KvConfig(sticky_candidates=True)`` (after ``+codesF``), ``+confP`` (EAGLE-3 only)
    ``KvConfig(lookahead_min_confidence=P)``, ``+sinkN``
    ``KvConfig(sink_blocks=N)``, ``+pinN`` ``KvConfig(pin_blocks=N)``, ``+succN``
    ``KvConfig(successor_blocks=N)``, ``+layers`` ``KvConfig(layer_blocks=...)`` fitted on
    calibration text with the budget's total (:func:`kv_budget_kwargs`; ``+layersout``: fitted
    on the attention output's error instead of its mass); ``+hfp8``
    ``KvConfig(host_kv_dtype="fp8_e4m3")`` (the host pool in E4M3); ``+top2`` (EAGLE-3
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
    candidate_bound: str = "fp8"
    host_kv_dtype: str | None = None

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
            candidate_bound=self.candidate_bound,
            host_kv_dtype=self.host_kv_dtype,
        )


_CODES_F = re.compile(r"(\d+(\.\d+)?)?")  # the F of "+codesF"
_CONF_P = re.compile(r"(0(\.\d+)?|1(\.0+)?)")  # the P of "+confP", a probability


def parse_drafter(name: str) -> DrafterSpec:
    """The :class:`DrafterSpec` of ``name``; ValueError for an unknown one (the message lists the
    grammar). The suffixes come in the order given, each at most once."""
    base, *mods = str(name).split("+")
    kw: dict = {}
    order = (
        *("current", "fidelity", "codes", "b16", "sticky", "sink"),
        *("pin", "succ", "conf", "layers", "hfp8", "top2"),
    )
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
        elif key == "b16":
            # the two stages' first stage over the 16-bit summaries, not the 8-bit bound
            ok = "score_candidates" in kw or "fidelity" in mods
            kw["candidate_bound"] = "summaries"
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
        elif key == "hfp8":
            kw["host_kv_dtype"] = "fp8_e4m3"
        else:
            ok = base.startswith("eagle3")  # the runner-up needs a head that ranks drafts
            kw["top2"] = True
    if not ok:
        raise ValueError(
            f"unknown drafter {name!r}; use one of {DRAFTERS}, then optionally '+current' (not "
            "previous-query, which has no lookahead row), '+fidelity' (KvConfig()'s default "
            "selection; not with the four suffixes it sets), '+codes' or '+codesF' (F >= 1: the "
            "Quest bound's best F x K blocks ranked by the codes), '+b16' (after '+codesF' or "
            "'+fidelity': their first stage over the 16-bit summaries), '+sticky' (after '+codesF': the "
            "previous prediction stays among the candidates), '+sinkN' (N sink blocks), '+pinN' "
            "(N pinned blocks per layer and KV head), '+succN' (the next block of the N best), '+confP' "
            "(eagle3 only: the step's own query selects when the head's probability is below P), "
            "'+layers' or '+layersout' (per-layer budgets fitted on calibration text by attention "
            "mass or output error), '+hfp8' (the host pool in fp8_e4m3) and '+top2' (eagle3 only), "
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
