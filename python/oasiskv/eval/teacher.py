"""Teacher-forced runs over the :class:`~oasiskv.engine.Engine`.

A run takes texts of ``C + 1`` tokens, prefills the first ``P = C - S`` of each (dense, as the
engine always does), turns the request sparse right away (``oasis``), and then steps through the
remaining ``S`` positions feeding the TRUE token as x_t every step. Step j feeds ``text[P + j]`` and
its row-0 logits predict ``text[P + j + 1]``; the last step sees a context of ``C`` tokens. The
lookahead token of each step comes from the policy's drafter:

* ``eagle3``  — :class:`~oasiskv.drafters.Eagle3Drafter` over the target's captured hidden states,
  as the library runs it: the head's cache is first filled over the prompt's features, which the
  engine captures during its prefill;
* ``eagle3-noprefill`` — the same head with ``prefill=False``: its cache starts empty at the first
  decode step (what the library did before; shows what the prompt context is worth);
* ``ngram``   — :class:`~oasiskv.drafters.NgramDrafter` (prompt lookup over the text so far);
* ``oracle``  — :class:`~oasiskv.drafters.OracleDrafter`: the true next token (known here);
* ``previous-query`` — no lookahead row: x_t's own query selects the next step (FreeKV-like).

A ``+current`` suffix (``eagle3+current``) runs that drafter with
``KvConfig(select_queries="lookahead+current")``: the lookahead and the current query choose the
working set together.

Per step and text the runner keeps the NLL of the true token, the top-1 token and, against a dense
run of the same texts, KL(dense || policy). A :class:`LookaheadRecorder` on the engine receives,
per layer and step, the predicted top-K of the previous step, the exact top-K of this step's true
query and the working set this step attended over (``Engine.recorder``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..config import KvConfig
from ..drafters import Eagle3Drafter, NgramDrafter, OracleDrafter, PreviousQueryDrafter
from ..engine import Engine, PrefillCache, _recall, _Request
from .policies import QuestModel

#: ``eagle3`` is the library's drafter (its head first runs over the prompt's features from the
#: engine's own prefill); ``eagle3-noprefill`` starts the head with an empty cache.
DRAFTERS = ("eagle3", "eagle3-noprefill", "ngram", "oracle", "previous-query")


def drafter_parts(name: str) -> tuple[str, str]:
    """``"eagle3+current"`` -> ``("eagle3", "lookahead+current")``; ``"eagle3"`` -> ``("eagle3",
    "lookahead")``. Raises ValueError for a name that is neither (the message lists them)."""
    base, plus, rest = name.partition("+")
    if base in DRAFTERS and (not plus or (rest == "current" and base != "previous-query")):
        return base, "lookahead+current" if plus else "lookahead"
    raise ValueError(
        f"unknown drafter {name!r}; use one of {DRAFTERS}, optionally with '+current' "
        "(not previous-query, which has no lookahead row)"
    )


@dataclass(frozen=True)
class Policy:
    """One configuration of a teacher-forced run."""

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
    def label(self) -> str:
        if self.kind == "dense":
            return "dense"
        if self.kind == "quest":
            return f"quest K={self.top_k_blocks}"
        cap = "uncapped" if self.fetch_cap is None else f"cap={self.fetch_cap}"
        return f"oasis/{self.drafter} K={self.top_k_blocks} {cap}"


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
        idx = torch.tensor(r.host_blocks[: nblk[i]], dtype=torch.long)
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
      (what the fetch cap let in).

    Only steps with :attr:`enabled` are kept (the runner skips the first sparse step, whose
    prediction came from the prompt's last query, not from a lookahead row). Values stay on the
    device until :meth:`tensors` (no host sync inside the engine's background chain).
    """

    def __init__(self, mass_every: int = 0) -> None:
        self.enabled = False
        self.step = -1
        self.mass_every = int(mass_every)
        self._rows: list[tuple[int, int, list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._mass: list[tuple[int, int, list[int], torch.Tensor, torch.Tensor]] = []

    def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None) -> None:
        if not self.enabled:
            return
        ov, n = _recall(actual, prev)
        resident = engine.pools.page_map[layer][slot_pages.long()].transpose(1, 2)  # [n, hk, K]
        hit, _ = _recall(actual, resident)
        denom = n.clamp(min=1)
        ids = [r.id for r in sp_reqs]
        self._rows.append((self.step, layer, ids, ov / denom, hit / denom, n > 0))
        if q is not None and self.mass_every > 0 and self.step % self.mass_every == 0:
            mass = block_attention_mass(engine, layer, sp_reqs, q)  # [n, hk, blocks] (CPU)
            local = torch.tensor([r.kv_len // engine.kv.block_size for r in sp_reqs])
            best = best_mass_blocks(mass, local, actual.shape[-1])
            cov = [covered_mass(mass, local, s.cpu()) for s in (actual, prev, resident, best)]
            cells = torch.ones(len(ids), dtype=torch.bool)
            self._mass.append((self.step, layer, ids, torch.stack(cov, dim=-1), cells))  # [n, 4], [n]

    def clear(self) -> None:
        self._rows.clear()
        self._mass.clear()

    def mass_tensors(self, num_layers: int, req_ids: list[int], steps: list[int]):
        """(mass, valid): the share of the true query's attention that falls in the exact top-K,
        the predicted set, the resident set and the K blocks of most attention (each with the local
        block), ``[len(steps), num_layers, len(req_ids), 4]``; valid marks the sampled cells."""
        mass, valid = _grid(self._mass, num_layers, req_ids, steps, (((4,), torch.float64), ((), torch.bool)))
        return mass, valid

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
    matched: torch.Tensor | None = None  # [S', n] bool; None without a draft
    confidence: torch.Tensor | None = None  # [S', n] the head's probability of its draft (EAGLE-3)
    mass: torch.Tensor | None = None  # [S', L, n, 4] attention share: exact / predicted / resident / best
    mass_valid: torch.Tensor | None = None  # [S', L, n] the sampled cells
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
        self.device = next(model.parameters()).device
        self.cache = PrefillCache(capacity=3 * min(self.batch_size, len(texts)))
        self.quest_model = QuestModel(model)
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

    def _engine(self, policy: Policy, drafter) -> Engine:
        b = self.block_size
        if policy.kind == "oasis":
            kv = KvConfig(
                block_size=b,
                top_k_blocks=policy.top_k_blocks,
                fetch_cap=policy.fetch_cap,
                sparse_threshold=max(1, self.prefix - 1),  # sparse from the first decode step
                measure_recall=True,
                select_queries=drafter_parts(policy.drafter)[1],
            )
            return Engine(self.model, kv, "oasis", drafter, (), self.cache)
        kv = KvConfig(block_size=b, top_k_blocks=1, fetch_cap=None, measure_recall=False)
        if policy.kind == "quest":
            qm = self.quest_model
            qm.reset(policy.top_k_blocks)
            eng = Engine(qm, kv, "dense", None, (), self.cache)
            qm.attach(eng)
            return eng
        return Engine(self.model, kv, "dense", None, (), self.cache)

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
        eng = self._engine(policy, drafter)
        key = str(eng.dtype)
        if key in self._pools:
            eng.pools = self._pools[key]
        recorder = None
        if policy.kind == "oasis":
            recorder = eng.recorder = LookaheadRecorder(self.mass_every)
        reqs = [_Request(id=i, prompt=t[:P], max_new_tokens=S + 1) for i, t in enumerate(chunk)]
        # An EAGLE-3 drafter keeps its probability of each draft (from the first one on).
        track = getattr(drafter, "track_confidence", None) is not None
        if track:
            drafter.track_confidence = True
        eng.ensure_pools(reqs)
        self._pools[key] = eng.pools
        for r, t in zip(reqs, chunk, strict=True):
            if drafter is not None:
                drafter.begin(r.id, r.prompt)
            r.tokens = list(r.prompt)
            eng.prefill(r)
            r.tokens.append(t[P])
            if eng.rows == 2:
                r.draft = drafter.propose(r.id, r.tokens, r.features)
            if eng.backend == "oasis" and r.kv_len > eng.kv.threshold_tokens:
                eng.make_sparse(r)
        dev = self.device
        targets = torch.tensor([[t[P + j + 1] for t in chunk] for j in range(S)], device=dev)  # [S, n]
        nll = torch.empty(S, n, device=dev)
        top1 = torch.empty(S, n, dtype=torch.long, device=dev)
        kl = torch.empty(S, n, device=dev) if policy.kind != "dense" else None
        logp_all = None
        if policy.kind == "dense":
            logp_all = torch.empty(S, n, self.model.config.vocab_size, device=dev)
        dense = self._dense[ci] if self._dense is not None and policy.kind != "dense" else None
        matched: list[list[bool]] = []
        confidence: list[list[float]] = []
        measured: list[int] = []

        def drafts_now() -> tuple[list[int], list[float]]:
            """The drafts the next decode step runs, and the head's probability of each."""
            conf = [drafter.last_confidence.get(r.id, float("nan")) for r in reqs] if track else []
            return [r.draft for r in reqs], conf

        prev_draft, prev_conf = drafts_now()
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=S, desc=policy.label, unit="step", leave=False)
        try:
            for j in range(S):
                if recorder is not None:
                    # Step 0 judges the prompt's last query (make_sparse), not a lookahead: skip it.
                    recorder.enabled = j > 0
                    recorder.step = j
                    if j > 0:
                        measured.append(j)
                        if eng.rows == 2:
                            matched.append([prev_draft[i] == chunk[i][P + j] for i in range(n)])
                            if track:
                                confidence.append(prev_conf)
                prev_draft, prev_conf = drafts_now()
                logits = eng.decode_step(reqs)
                lp = torch.log_softmax(logits.float(), dim=-1)
                nll[j] = -lp.gather(1, targets[j].unsqueeze(1)).squeeze(1)
                top1[j] = lp.argmax(-1)
                if logp_all is not None:
                    logp_all[j] = lp
                if dense is not None:
                    d = dense["logp"][j]
                    kl[j] = (d.exp() * (d - lp)).sum(-1)
                if j < S - 1:
                    for i, r in enumerate(reqs):
                        r.tokens.append(chunk[i][P + j + 1])
                        if eng.rows == 2:
                            r.draft = drafter.propose(r.id, r.tokens, r.features)
                        if eng.backend == "oasis" and not r.sparse and r.kv_len > eng.kv.threshold_tokens:
                            eng.make_sparse(r)
                if bar:
                    bar.update(1)
        finally:
            if bar:
                bar.close()
        for r in reqs:
            eng.finalize_metrics(r)
            eng.release(r)
        if policy.kind == "dense":
            self._dense.append({"logp": logp_all, "top1": top1})
        res = RunResult(
            policy,
            nll.cpu(),
            top1.cpu(),
            kl.cpu() if kl is not None else None,
            (top1 == dense["top1"]).cpu() if dense is not None else None,
            fetched_bytes_per_step=[r.metrics.fetched_bytes_per_step for r in reqs],
            full_kv_bytes=[r.metrics.full_kv_bytes for r in reqs],
            resident_kv_bytes=[r.metrics.resident_kv_bytes for r in reqs],
        )
        if policy.kind == "quest":
            qm = self.quest_model
            entry = 2 * b * eng.geo.head_dim * eng.dtype.itemsize
            res.would_fetch_bytes_per_step = [
                float(qm.churn.get(r.id, 0)) * entry / max(1, S - 1) for r in reqs
            ]
            # A dense engine reports its whole KV as resident; so does Quest (everything resident).
        if recorder is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            ov, hit, valid = recorder.tensors(
                self.model.config.num_hidden_layers, [r.id for r in reqs], measured
            )
            res.overlap, res.resident_hit, res.valid = ov, hit, valid
            if self.mass_every:
                res.mass, res.mass_valid = recorder.mass_tensors(
                    self.model.config.num_hidden_layers, [r.id for r in reqs], measured
                )
            res.measured_steps = measured
            res.matched = torch.tensor(matched, dtype=torch.bool) if matched else None
            res.confidence = torch.tensor(confidence, dtype=torch.float32) if confidence else None
        return res


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
    out.matched = cat("matched", 1)
    out.confidence = cat("confidence", 1)
    out.mass = cat("mass", 2)
    out.mass_valid = cat("mass_valid", 2)
    out.measured_steps = parts[0].measured_steps
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
        kv=KvConfig(block_size=block_size),
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
    if res.mass is not None and res.mass_valid is not None and bool(res.mass_valid.any()):
        out["attn_mass"] = attention_mass_summary(res)
    if res.confidence is not None and res.matched is not None and res.confidence.shape == res.matched.shape:
        out["by_confidence"] = confidence_bins(res.confidence, res.matched, ov, valid)
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
