"""The speculative rows: the random EAGLE-3 head whose cost a drafter pays, the oracle drafter of
``--draft-acceptance``, its reference rounds, and the columns only a speculative row has.

Functions of what they are handed (a model, an engine, a :func:`~.drive.drive` result); the sweep
(:class:`~oasiskv.bench.fig11.Fig11`) decides which rows are speculative and keeps the base rows'
tokens they compare against.
"""

from __future__ import annotations

from .drive import drive
from .flags import usage_error

#: The drafter the report names for ``--drafter eagle3`` on random weights.
RANDOM_HEAD = "eagle3 (a random head of the target's shape)"
#: The draft vocabulary of the random EAGLE-3 head that ``--draft-cost eagle3`` runs: the size
#: published EAGLE-3 heads of 8B targets use (32000 tokens).
EAGLE3_DRAFT_VOCAB = 32000


def cost_head(model, seed: int, for_drafter: bool):
    """A random EAGLE-3 head of ``model``'s shape (one decoder layer, ``fc`` over three captured
    layers, a draft LM head of :data:`EAGLE3_DRAFT_VOCAB` tokens) in the model's dtype, on its
    device, attached to it. ``for_drafter``: it is ``--drafter eagle3``'s (else
    ``--draft-cost eagle3``'s), which the error names.

    # Errors
    ``ConfigError`` when the model has too few layers to capture three.
    """
    from ...errors import ConfigError
    from ...models.eagle3 import Eagle3Head

    cfg = model.config
    p = next(model.parameters())
    try:
        Eagle3Head.capture_layers(cfg.num_hidden_layers)
    except ConfigError as e:
        if for_drafter:
            raise usage_error(f"--drafter eagle3: {e}; pass --drafter ngram") from None
        raise usage_error(f"--draft-cost eagle3: {e}; pass --draft-cost none") from None
    head = Eagle3Head.random(
        cfg,
        draft_vocab_size=min(EAGLE3_DRAFT_VOCAB, cfg.vocab_size),
        seed=seed,
        dtype=p.dtype,
        device=p.device,
    )
    return head.attach_target(model).eval()


def oracle_drafter(model, head, conc: int, accept: float, seed: int, forced: bool):
    """The drafter of a ``--draft-acceptance`` row: an oracle right with probability ``accept``
    (forcing its verdicts when ``forced``), with no reference yet (:func:`oracle_rounds` sets it),
    running ``head`` beside it when there is one (``--draft-cost eagle3``)."""
    from ...drafters import Eagle3Drafter, OracleDrafter

    shadow = Eagle3Drafter(head, model) if head is not None else None
    return OracleDrafter(
        [[]] * conc,
        accept=accept,
        seed=seed,
        vocab_size=model.config.vocab_size,
        shadow=shadow,
        force=forced,
    )


def oracle_rounds(
    eng, prompts: list[list[int]], start, profile, trace=None, *, max_tokens: int, forced: bool, rounds: int
) -> dict:
    """:func:`~.drive.drive` a ``--draft-acceptance`` row. Forced verdicts: once, drafting from
    ``start`` (the base mode's tokens, when that row ran); ``converged`` is None (there is
    nothing to reach). Else until a round makes exactly the tokens its oracle drafted from
    (then the oracle is right as often as it is set to be), at most ``rounds`` times; round 1
    drafts from ``start``, each later round from the previous round's tokens.
    The last round's :func:`~.drive.drive` result, with ``rounds``, ``converged`` and the oracle's
    counters."""
    d = eng.drafter
    conc = len(prompts)
    ref = [list(t) for t in start] if start is not None else [[] for _ in prompts]
    kernels = copies = None
    converged = False
    for k in range(1 if forced else rounds):
        d.set_reference(ref, first_id=k * conc)  # the engine numbers requests 0, 1, ...
        prof, tr = (profile, trace) if k == 0 else (None, None)
        res = drive(eng, prompts, max_tokens, prof, tr)
        if k == 0:
            kernels, copies = res["kernels"], res["copies"]
        if forced:
            converged = None
            break
        tokens = [o.token_ids for o in res["outputs"]]
        converged = tokens == ref
        if converged:
            break
        ref = tokens
    res.update(kernels=kernels, copies=copies)
    return {
        **res,
        "rounds": k + 1,
        "converged": converged,
        "off_reference": len(d.off_reference),
        "reference_drafts": d.reference_drafts / d.drafts if d.drafts else None,
    }


def spec_columns(
    drafter_name: str, res: dict, base_tokens, accept: float | None, draft_cost: str, forced: bool
) -> dict:
    """A speculative row's own columns: tokens per request-step and the acceptance rate the
    engine measured (the requests' metrics in ``res``, a :func:`~.drive.drive` result), how many
    tokens equal ``base_tokens`` (the base mode's row's, None when it did not run), and for an
    oracle row (``accept`` set; ``res`` from :func:`oracle_rounds`) its reference rounds and
    draft cost."""
    ms = [o.metrics for o in res["outputs"]]
    steps, made = sum(m.steps for m in ms), sum(m.decode_tokens for m in ms)
    drafts, accepted = sum(m.draft_tokens for m in ms), sum(m.accepted_tokens for m in ms)
    match = None
    if base_tokens is not None:
        pairs = [
            (x, y)
            for o, b in zip(res["outputs"], base_tokens, strict=True)
            for x, y in zip(o.token_ids, b, strict=True)
        ]
        match = sum(x == y for x, y in pairs) / len(pairs) if pairs else None
    out = {
        "speculative": True,
        "drafter": drafter_name,
        "tokens_per_step": made / steps if steps else None,
        "acceptance_rate": accepted / drafts if drafts else None,
        "drafts": drafts,
        "tokens_match_base": match,
        "draft_acceptance_set": accept,
    }
    if accept is not None:
        out.update(
            draft_cost=draft_cost,
            draft_verdicts="forced" if forced else "reference",
            reference_rounds=res["rounds"],
            reference_converged=res["converged"],
            off_reference_requests=res["off_reference"],
            reference_draft_fraction=res["reference_drafts"],
        )
    return out
