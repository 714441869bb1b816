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

The module's neighbours, each a room: :mod:`~oasiskv.eval.specs` (drafter names, budgets,
:class:`Policy`), :mod:`~oasiskv.eval.overlap` (the block-set and attention-mass math) and
:mod:`~oasiskv.eval.summary` (:class:`RunResult` and the JSON record, :func:`summarize`). This
module keeps the runner (:class:`TeacherForcing`, :func:`greedy_continuations`) and the
:class:`LookaheadRecorder`; their names stay importable from here.
"""

from __future__ import annotations

import time

import torch

from .. import ops
from ..config import KvConfig
from ..drafters import Eagle3Drafter, NgramDrafter, OracleDrafter, PreviousQueryDrafter
from ..engine import PrefillCache, csr_tables, keep_sinks, recall_overlap, relative_to_best
from ..llm_engine import LLMEngine, SamplingParams, StepInfo
from .overlap import (
    TOP2_SETS,
    best_mass_blocks,
    block_attention_mass,
    covered_mass,
    grid,
    host_rows,
    shadow_queries,
    union_by_rank,
)
from .policies import QuestPolicy
from .specs import (
    DRAFTERS,
    DrafterSpec,
    Policy,
    block_score_of,
    drafter_parts,
    kv_budget_kwargs,
    parse_drafter,
)
from .summary import (
    CONFIDENCE_EDGES,
    RunResult,
    attention_mass_summary,
    concat_results,
    confidence_bins,
    kept_summary,
    lookahead_summary,
    summarize,
    top2_summary,
)

__all__ = [
    "CONFIDENCE_EDGES",
    "DRAFTERS",
    "TOP2_SETS",
    "DrafterSpec",
    "LookaheadRecorder",
    "Policy",
    "RunResult",
    "TeacherForcing",
    "attention_mass_summary",
    "best_mass_blocks",
    "block_attention_mass",
    "block_score_of",
    "confidence_bins",
    "covered_mass",
    "drafter_parts",
    "greedy_continuations",
    "kept_summary",
    "kv_budget_kwargs",
    "lookahead_summary",
    "parse_drafter",
    "shadow_queries",
    "summarize",
    "top2_summary",
    "union_by_rank",
]

# The names these had when the rooms were one module (kept importable).
_rows = host_rows
_grid = grid
_concat = concat_results


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
        ov, valid = grid(self._top2, num_layers, req_ids, steps, (((n,), torch.float32), ((), torch.bool)))
        fields = (((n,), torch.float64), ((), torch.bool))
        mass, mass_valid = grid(self._top2_mass, num_layers, req_ids, steps, fields)
        return ov, valid, mass, mass_valid

    def mass_tensors(self, num_layers: int, req_ids: list[int], steps: list[int]):
        """(mass, valid): the share of the true query's attention that falls in the exact top-K,
        the predicted set, the resident set and the K blocks of most attention (each with the local
        block), ``[len(steps), num_layers, len(req_ids), 4]``; valid marks the sampled cells."""
        mass, valid = grid(self._mass, num_layers, req_ids, steps, (((4,), torch.float64), ((), torch.bool)))
        return mass, valid

    def kept_tensors(self, num_layers: int, req_ids: list[int], steps: list[int]):
        """(kept overlap, valid) ``[len(steps), num_layers, len(req_ids)]``, or None where the
        engine gave no kept top-K (no sticky candidates)."""
        if not self._kept:
            return None
        return tuple(grid(self._kept, num_layers, req_ids, steps, (((), torch.float32), ((), torch.bool))))

    def tensors(self, num_layers: int, req_ids: list[int], steps: list[int]):
        """(overlap, resident_hit, valid) as float/bool CPU tensors [len(steps), num_layers, len(req_ids)]."""
        f32, flag = ((), torch.float32), ((), torch.bool)
        return tuple(grid(self._rows, num_layers, req_ids, steps, (f32, f32, flag)))


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
        kv_dtype: str | None = None,
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
        #: ``KvConfig.kv_dtype`` of every run, dense included (``"fp8_e4m3"``: fp8 pages and host
        #: pool; None: the model's dtype).
        self.kv_dtype = kv_dtype
        self.device = next(model.parameters()).device
        self.cache = PrefillCache(capacity=3 * min(self.batch_size, len(texts)))
        #: The :class:`QuestPolicy` of the latest Quest-like chunk (tests read its counters).
        self.quest_policy: QuestPolicy | None = None
        self._pools: dict[tuple, object] = {}
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
                    "kv_dtype": self.kv_dtype,
                }
            )
        else:
            # Dense (or a policy that scores by itself): no key codes in the engine's prefills.
            kv = KvConfig.fast(
                block_size=b, top_k_blocks=1, fetch_cap=None, measure_recall=False, kv_dtype=self.kv_dtype
            )
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
        res = concat_results(policy, parts)
        res.wall_s = time.perf_counter() - t0
        return res

    def _run_chunk(self, policy: Policy, ci: int, chunk: list[list[int]]) -> RunResult:
        S, P, b = self.steps, self.prefix, self.block_size
        n = len(chunk)
        drafter = self._drafter(policy, chunk)
        # An EAGLE-3 drafter keeps its probability of each draft (from the first one on).
        track = drafter is not None and drafter.reports_confidence
        if track:
            drafter.track_confidence = True
        top2 = policy.kind == "oasis" and parse_drafter(policy.drafter).top2
        if top2:
            drafter.track_runner_up = True
        le = self._engine(policy, drafter, n)
        eng = le.engine
        key = (str(eng.dtype), eng.page_kv8, eng.host_kv8)  # pools of one storage (fp8 tiers apart)
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
