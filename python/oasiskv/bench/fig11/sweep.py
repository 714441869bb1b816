"""The sweep: :class:`Fig11` holds the model, the measured ceilings and the options, makes each
mode's engine, and runs every (context, mode, concurrency) row into the report dict.

It is the one room that puts the others together: the flags (:mod:`.flags`), what fits
(:mod:`.budget`), one row's run (:mod:`.drive`), the roofline (:mod:`.roofline`), the speculative
rows (:mod:`.spec`) and the report's labels (:mod:`.report`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from ... import ops
from . import budget as fits
from .drive import DoesNotFit, drive, make_prompts, p50_p99
from .flags import MODES, mode_parts, spec_modes, usage_error
from .model import build_model, free_memory, hbm_read_Bps
from .report import selection_label
from .roofline import (
    moe_weights_read_bytes,
    pcie_bytes_per_step,
    roofline_columns,
    step_roofline,
    weights_read_bytes,
)
from .spec import RANDOM_HEAD, cost_head, oracle_drafter, oracle_rounds, spec_columns


def cache_bytes(cache) -> int:
    """Bytes of the K and V a :class:`~oasiskv.engine.PrefillCache` holds (0 for None)."""
    if cache is None:
        return 0
    return cache.nbytes


class Fig11:
    """The sweep's state: the model, the measured ceilings and the options. With ``group`` (a
    :class:`~oasiskv.parallel.TPGroup` of more than one rank) this is rank 0's side of ``--tp``:
    every engine is a :class:`~oasiskv.parallel.TPLLMEngine` whose options go to the other
    ranks first (:func:`~oasiskv.bench.fig11.tp.tp_worker`)."""

    def __init__(self, args, group=None) -> None:
        import torch

        from ...memory import available_bytes

        self.torch, self.args = torch, args
        self.group = group if group is not None and group.size > 1 else None
        self.tp = group.size if self.group is not None else 1
        self._live = None  # the TPLLMEngine the workers follow now
        self.model, self.model_name, self.dev = build_model(args, self.group)
        self.cuda = self.dev.type == "cuda"
        from ...serve.cli import enforce_eager

        #: Decode eagerly: --enforce-eager, or --tp (captured steps with collectives: not yet).
        self.enforce_eager = enforce_eager(args) or self.tp > 1
        self.cfg = self.model.config
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        emb = self.model.embed_tokens.weight
        self.weights_read = weights_read_bytes(
            self.weights_bytes, emb.numel() * emb.element_size(), self.cfg.tie_word_embeddings
        )
        self.device_name = torch.cuda.get_device_name(self.dev) if self.cuda else str(self.dev)
        self.activation_reserve = fits.activation_reserve(
            args.activation_reserve, args.gpu_kv_budget, self.device_name, args.prompts
        )
        self.host_limit = fits.host_kv_limit(args.host_kv_budget, available_bytes("cpu"))
        self.spec_modes = spec_modes(args)
        if getattr(args, "draft_acceptance", None) and not getattr(args, "speculative", False):
            raise usage_error(
                "--draft-acceptance sets the drafter of the speculative rows: add --speculative"
            )
        if getattr(args, "speculative", False) and not self.spec_modes:
            raise usage_error(
                "--speculative adds rows to the oasis-backend modes (oasis, oracle), and --modes has "
                "none; add oasis to --modes"
            )
        if args.oracle_rounds < 1:
            raise usage_error(f"--oracle-rounds must be >= 1, got {args.oracle_rounds}")
        #: The random EAGLE-3 head whose cost the oracle drafter pays (``--draft-cost eagle3``).
        self.head = None
        self.head_bytes = 0
        #: ``--drafter eagle3`` on random weights (a preset): the oasis rows' lookahead comes
        #: from a random EAGLE-3 head of the target's shape, the cost of the paper's drafter
        #: (its drafts are as random as the weights).
        self.random_head_drafter = getattr(args, "drafter", None) == "eagle3" and not args.model
        if (args.draft_acceptance and args.draft_cost == "eagle3") or self.random_head_drafter:
            self.head = self._cost_head()
            self.head_bytes = sum(p.numel() * p.element_size() for p in self.head.parameters())
        self._tokens: dict = {}  # (context, mode, concurrency) -> the row's tokens per request
        self.ceilings = None
        if self.cuda:
            from ..kernels import ceilings

            self.ceilings = {**ceilings(self.dev), "hbm_read_Bps": hbm_read_Bps(torch, self.dev)}
            free_memory(torch, self.dev)
        #: The GPU KV budget before any context (the header's): beside the weights (and the cost
        #: head); :meth:`run` chooses it again per context, beside that context's prefill cache.
        self.gpu_kv_budget = self.choose_budget(available_bytes(self.dev))
        #: What every row must fit (:func:`~.budget.fit`).
        self.budgets = fits.Budgets(self.gpu_kv_budget.bytes, self.host_limit, self.activation_reserve)

    def choose_budget(self, free_bytes: int | None) -> fits.GpuKvBudget:
        """The GPU KV budget of ``--gpu-kv-budget`` with ``free_bytes`` free on the device
        (:func:`~.budget.choose_gpu_kv_budget`)."""
        a = self.args
        return fits.choose_gpu_kv_budget(
            a.gpu_kv_budget, self.device_name, free_bytes, self.weights_bytes, self.activation_reserve
        )

    def weights_read_at(self, conc: int) -> int:
        """Weight bytes one decode step of ``conc`` requests reads: :attr:`weights_read`, less,
        in a mixture of experts, the experts no row chose
        (:func:`~.roofline.moe_weights_read_bytes`)."""
        cfg = self.cfg
        if not cfg.is_moe:
            return self.weights_read
        itemsize = self.model.embed_tokens.weight.element_size()
        return moe_weights_read_bytes(
            self.weights_read,
            conc,
            num_experts=cfg.num_experts,
            experts_per_tok=cfg.num_experts_per_tok,
            moe_layers=sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)),
            expert_bytes=3 * cfg.moe_intermediate_size * cfg.hidden_size * itemsize,
        )

    def _cost_head(self):
        """A random EAGLE-3 head of the target's shape (:func:`~.spec.cost_head`)."""
        return cost_head(self.model, self.args.seed, self.random_head_drafter)

    @property
    def forced(self) -> bool:
        """Whether the oracle rows force their verdicts (``--draft-verdicts forced``)."""
        return getattr(self.args, "draft_verdicts", "forced") == "forced"

    def oracle(self, conc: int, accept: float):
        """The drafter of a ``--draft-acceptance`` row (:func:`~.spec.oracle_drafter`), paying
        for the head of ``--draft-cost``; :meth:`row` sets its reference."""
        return oracle_drafter(self.model, self.head, conc, accept, self.args.seed, self.forced)

    # ------------------------------------------------------------------ engines
    def kv(self):
        """The :class:`~oasiskv.KvConfig` of every engine: the KV and selection flags."""
        from ...config import KvConfig
        from ...serve.cli import apply_kernel_flags, host_kv_dtype, kv_dtype, selection_kwargs

        a = self.args
        apply_kernel_flags(a)
        # The selection flags (--block-score, --sticky-candidates, ...) are the engine's, as in
        # `oasis serve`; they were parsed but ignored here before the fifteenth session.
        return KvConfig(
            block_size=a.block_size,
            top_k_blocks=a.top_k_blocks,
            fetch_cap=a.fetch_cap,
            sparse_threshold=a.sparse_threshold,
            measure_recall=a.measure_recall,
            kv_dtype=kv_dtype(a),
            host_kv_dtype=host_kv_dtype(a),
            **selection_kwargs(a),
        )

    def engine(self, mode: str, conc: int, ctx: int, gpu_budget: int | None, host_budget: int | None, cache):
        """``mode``'s engine for ``conc`` requests of ``ctx`` tokens within the budgets (None:
        the engine's own), its drafter chosen by the mode and the flags; under ``--tp`` its
        options go to the other ranks first."""
        from ...drafters import NgramDrafter
        from ...llm_engine import LLMEngine

        base, spec, accept = mode_parts(mode)
        backend, host_pool = MODES[base]
        a = self.args
        drafter = None
        if accept is not None:
            drafter = self.oracle(conc, accept)
        elif backend == "oasis":
            if self.random_head_drafter:
                from ...drafters import Eagle3Drafter

                drafter = Eagle3Drafter(self.head, self.model)
            else:
                drafter = NgramDrafter(window=a.ngram_window) if a.drafter == "ngram" else a.drafter
        kw = dict(
            kv=self.kv(),
            backend=backend,
            drafter=drafter,
            max_num_seqs=conc,
            gpu_kv_budget_bytes=gpu_budget,
            host_kv_budget_bytes=host_budget,
            max_num_batched_tokens=min(ctx, 1 << 20),
            prefill_cache=cache,
            output_kind="delta",
            host_pool=host_pool,
            # CUDA graphs by default on a GPU; not with --tp yet (collectives inside a capture).
            enforce_eager=self.enforce_eager,
            speculative=spec,
        )
        if self.group is None:
            return LLMEngine(self.model, **kw)
        from ...parallel import TPLLMEngine

        self.close(self._live)
        # The context's prefill cache travels as a tag: each worker keeps its own cache of its
        # shard per tag (tp.tp_worker).
        sent = {**kw, "prefill_cache": None if cache is None else ("prefill-cache", ctx, cache.on_host)}
        self.group.broadcast_object(("engine", sent))
        self._live = TPLLMEngine(self.model, group=self.group, **kw)
        return self._live

    def close(self, eng) -> None:
        """Let the workers following ``eng`` (a TPLLMEngine) go; nothing in one process."""
        if eng is not None and self.group is not None and eng is self._live:
            self._live = None
            if self.group.broken is None:
                eng.shutdown()

    def close_live(self) -> None:
        """Let the workers go from the engine they follow now (rank 0 of ``--tp``, at the end)."""
        self.close(self._live)

    # ------------------------------------------------------------------ what fits
    def need(self, mode: str, ctx: int) -> dict:
        """One request's reservation in the engine's runtime: dense-phase peak pages, host
        blocks, whether it turns sparse; and the bytes of a block (all layers) and its summaries."""
        llm = self.engine(mode, 1, ctx, None, None, None)
        probe = llm.engine
        probe.reserve_pools([])  # makes the runtime, allocates nothing
        peak, host, sparse = probe.runtime.reservation(ctx, self.args.max_tokens)
        # A prompt the engine admits sparse (prefilled in one piece, as here) never holds its
        # dense pages: its peak is its working set (Engine.prefills_sparse).
        direct = mode != "dense" and probe.prefills_sparse(ctx)
        if direct:
            peak, _, _ = probe.runtime.reservation(ctx, self.args.max_tokens, sparse=True)
        self.close(llm)
        per = probe.page_bytes_all_layers
        kv = probe.kv
        if mode != "dense" and not sparse:
            raise usage_error(
                f"a {ctx}-token request does not turn sparse (sparse threshold "
                f"{kv.threshold_tokens} tokens): raise --contexts, or lower --top-k-blocks or "
                "--sparse-threshold"
            )
        return {
            "prefills_sparse": direct,
            "peak_pages": peak,
            "host_blocks": host,
            "kv_blocks": peak if mode == "dense" else host,  # every block of the request's KV
            "steady_pages": kv.top_k_blocks + 1,
            "block_bytes": per,
            "host_block_bytes": probe.host_row_bytes_all_layers,
            # On the GPU for every block: summaries, and with the codes score key codes and 8-bit bound
            "summary_bytes": probe.summary_bytes_all_layers,
            # What the roofline counts a step's scoring as reading per block: its min and max keys
            "score_bytes": per // kv.block_size,
            # The drafter's own device state per request beside the pools (the EAGLE-3 head's KV)
            "drafter_bytes": 0
            if probe.drafter is None
            else probe.drafter.device_bytes(ctx + self.args.max_tokens),
        }

    def fit(
        self, mode: str, conc: int, n: dict, device_free: int | None
    ) -> tuple[str | None, int, int | None]:
        """``(reason it does not fit or None, GPU budget, host budget)`` of ``conc`` requests
        (:func:`~.budget.fit`; a speculative row fits where its base mode does)."""
        return fits.fit(mode_parts(mode)[0], conc, n, self.budgets, device_free)

    def max_concurrency(
        self, mode: str, n: dict, device_free: int | None, limit: int = fits.MAX_SEARCHED
    ) -> int | None:
        """The largest concurrency that fits (0: not even one request; None: ``limit`` or more)."""
        return fits.max_concurrency(mode_parts(mode)[0], n, self.budgets, device_free, limit)

    # ------------------------------------------------------------------ rows
    def roofline(self, mode: str, ctx: int, conc: int, n: dict, host_pool: str, fetched, step_s) -> dict:
        """The roofline columns (:func:`~.roofline.roofline_columns`): the bytes one decode step
        must read at the middle of the decode phase (:func:`~.roofline.step_roofline`) and fetch
        over PCIe (``fetched``: per request and step), against the measured ``step_s``. Against
        the step: a speculative step reads the same bytes but makes more tokens."""
        read = step_roofline(
            mode,
            ctx,
            conc,
            n,
            block_size=self.args.block_size,
            max_tokens=self.args.max_tokens,
            weights_read=self.weights_read_at(conc),
            bandwidth_Bps=None,
        )["step_read_bytes"]
        pcie = pcie_bytes_per_step(host_pool, conc, fetched)
        return {"step_read_bytes": read, **roofline_columns(read, pcie, step_s, self.ceilings)}

    def row(self, mode: str, ctx: int, conc: int, n: dict, device_free, cache) -> dict:
        """One row: ``conc`` requests of ``ctx`` tokens through ``mode``'s engine, measured
        (:meth:`row_columns`), or skipped with the reason they do not fit."""
        torch, dev, a = self.torch, self.dev, self.args
        base = {
            "context": ctx,
            "mode": mode,
            "concurrency": conc,
            "gpu_kv_budget_kind": self.gpu_kv_budget.kind,
            "gpu_kv_budget_bytes": self.gpu_kv_budget.bytes,
        }
        reason, gpu_budget, host_budget = self.fit(mode, conc, n, device_free)
        if reason is not None:
            return {**base, "status": "skipped", "reason": reason}
        from ...errors import OutOfMemoryError

        free_memory(torch, dev)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        eng = None
        prompts = make_prompts(self.cfg.vocab_size, ctx, conc, a.prompts == "shared", a.seed)
        profile = 1 if self.cuda and a.max_tokens - 1 >= 3 else None  # leaves a timed step
        base_mode, spec, accept = mode_parts(mode)
        try:
            eng = self.engine(mode, conc, ctx, gpu_budget, host_budget, cache)
            # one allocation, not log2(C); through the driver's proxy under --tp (every rank)
            eng.reserve_pools([(ctx, a.max_tokens)] * conc)
            trace = None
            if a.trace_dir and profile is not None:
                os.makedirs(a.trace_dir, exist_ok=True)
                trace = os.path.join(a.trace_dir, f"{ctx}-{mode}-{conc}.json")
            if accept is None:
                res = drive(eng, prompts, a.max_tokens, profile, trace)
            else:
                start = self._tokens.get((ctx, base_mode, conc))
                res = self.oracle_rounds(eng, prompts, start, profile, trace)
        except (DoesNotFit, OutOfMemoryError, torch.OutOfMemoryError) as e:
            self.close(eng)
            del eng
            free_memory(torch, dev)
            why = " ".join(str(e).split())
            return {
                **base,
                "status": "skipped",
                "reason": why if isinstance(e, DoesNotFit) else f"OOM: {why}",
            }
        out = {**base, "status": "ok", **self.row_columns(eng, mode, ctx, conc, n, res)}
        self.close(eng)
        del eng, res
        free_memory(torch, dev)
        return out

    def row_columns(self, eng, mode: str, ctx: int, conc: int, n: dict, res: dict) -> dict:
        """A run row's measured columns from ``eng`` (its pools, before it is closed) and ``res``
        (:func:`~.drive.drive`'s result); keeps the tokens of a base row that speculative rows
        compare against."""
        torch, dev = self.torch, self.dev
        base_mode, spec, accept = mode_parts(mode)
        p = eng.engine.pools
        layers = self.cfg.num_hidden_layers
        peak = torch.cuda.max_memory_allocated(dev) if self.cuda else None
        times, outs = res["times"], res["outputs"]
        tpot50, tpot99 = p50_p99(res["tpots"])
        step50 = p50_p99(times)[0]
        ttft50, ttft99 = p50_p99(res["ttft"])
        tokens = [o.token_ids for o in outs]
        if not spec and any(m.startswith(f"{mode}+") for m in self.spec_modes):
            self._tokens[(ctx, mode, conc)] = tokens
        fetched = [o.metrics.fetched_bytes_per_step for o in outs]
        fetched = sum(fetched) / len(fetched) if eng.engine.backend == "oasis" else None
        host_place = str(p.host_k[0].device) + (" pinned" if p.host_k[0].is_pinned() else "")
        model_dtype = str(p.dtype).removeprefix("torch.")
        page_dtype = "fp8_e4m3" if p.page_kv8 else model_dtype
        host_dtype = ("fp8_e4m3" if p.host_kv8 else model_dtype) if eng.engine.backend == "oasis" else None
        out = {
            "backend": eng.engine.backend,
            "host_pool": eng.engine.host_pool,
            "requests": conc,
            "output_tokens": sum(len(t) for t in tokens),
            "timed_steps": len(times),
            "decode_tokens_per_s": res["timed_tokens"] / sum(times) if times else None,
            "tpot_p50_s": tpot50,
            "tpot_p99_s": tpot99,
            "tpot_mean_s": sum(res["tpots"]) / len(times) if times else None,
            "step_p50_s": step50,
            "ttft_p50_s": ttft50,
            "ttft_p99_s": ttft99,
            "peak_gpu_bytes": peak,
            "gpu_kv_bytes": p.num_pages * p.page_bytes * layers
            + p.num_host_blocks * p.summary_block_bytes * layers,
            "host_pool_bytes": p.num_host_rows * p.host_row_bytes * layers,
            "host_pool_place": host_place,
            # What the row's KV was stored in: the GPU pages, and (OasisKV) the host pool.
            "kv_dtype": page_dtype,
            "host_kv_dtype": host_dtype,
            "fetched_bytes_per_step": fetched,
            "kernels_per_layer_step": res["kernels"] / layers if res["kernels"] is not None else None,
            "transfer_wait_per_step_s": res["transfer_wait_s"] / len(times) if times else None,
            "copies_per_step": res["copies"],
            "tokens_digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            **(self.spec_columns(eng, ctx, base_mode, conc, accept, res) if spec else {"speculative": False}),
            **self.roofline(mode, ctx, conc, n, eng.engine.host_pool, fetched, step50),
        }
        return out

    def oracle_rounds(self, eng, prompts: list[list[int]], start, profile, trace=None) -> dict:
        """:func:`~.spec.oracle_rounds` of a ``--draft-acceptance`` row: once with forced
        verdicts, else at most ``--oracle-rounds`` times until a round reproduces its reference."""
        return oracle_rounds(
            eng,
            prompts,
            start,
            profile,
            trace,
            max_tokens=self.args.max_tokens,
            forced=self.forced,
            rounds=self.args.oracle_rounds,
        )

    def spec_columns(self, eng, ctx: int, base_mode: str, conc: int, accept, res) -> dict:
        """A speculative row's own columns (:func:`~.spec.spec_columns`), against the tokens of
        its base mode's row when that ran."""
        return spec_columns(
            eng.drafter.name,
            res,
            self._tokens.get((ctx, base_mode, conc)),
            accept,
            self.args.draft_cost,
            self.forced,
        )

    def warm_up(self, mode: str, ctx: int, cache) -> tuple[float, int | None]:
        """One request alone through ``mode`` (compiles the kernels, fills the prefill cache):
        its TTFT, a cold prefill when the cache was empty, and on CUDA the device bytes its
        admission and steps held at their peak beyond what stayed allocated (the peak less the
        allocation once it is done, its pools still held; None on other devices): what a row's
        admission needs free beside the running requests' pools (:func:`~.budget.admission_excess`)."""
        torch, dev = self.torch, self.dev
        eng = self.engine(mode, 1, ctx, None, None, cache)
        prompt = make_prompts(self.cfg.vocab_size, ctx, 1, True, self.args.seed)
        if self.cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        res = drive(eng, prompt, min(3, self.args.max_tokens))
        transient = None
        if self.cuda:
            torch.cuda.synchronize(dev)
            transient = torch.cuda.max_memory_allocated(dev) - torch.cuda.memory_allocated(dev)
        self.close(eng)
        del eng
        free_memory(torch, dev)
        return res["ttft"][0], transient

    # ------------------------------------------------------------------ the sweep
    def header(self) -> dict:
        """The report before any row: what runs where, the KV options, budgets and ceilings, with
        empty ``contexts`` and ``rows`` for :meth:`run` to fill."""
        torch, a = self.torch, self.args
        kv = self.kv()
        # The oasis rows' drafter reports its probability (EAGLE-3): the "auto" fallback is on.
        label_kv = kv.resolve(reports_confidence=self.random_head_drafter or a.drafter == "eagle3")
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return {
            "mode": "fig11",
            "model": self.model_name,
            "device": torch.cuda.get_device_name(self.dev) if self.cuda else "cpu",
            "dtype": dtype,
            "num_hidden_layers": self.cfg.num_hidden_layers,
            "max_tokens": a.max_tokens,
            "tp": self.tp,
            "prompts": a.prompts,
            "prefill_cache": a.prefill_cache if a.prompts == "shared" else None,
            "cuda_graph": self.cuda and not self.enforce_eager,
            "kv": {
                "block_size": kv.block_size,
                "top_k_blocks": kv.top_k_blocks,
                "fetch_cap_blocks": kv.cap_blocks,
                "sparse_threshold": kv.threshold_tokens,
                "drafter": RANDOM_HEAD if self.random_head_drafter else a.drafter,
                "ngram_window": a.ngram_window if a.drafter == "ngram" else None,
                "drafter_head_bytes": self.head_bytes if self.random_head_drafter else None,
                "selection": selection_label(label_kv),
                "kv_dtype": kv.kv_dtype or dtype,
                "host_kv_dtype": kv.host_kv_dtype or kv.kv_dtype or dtype,
                "kv8_attention_kernel": ops.kv8_attention_kernel(),
                "bound8_score_kernel": ops.bound8_score_kernel(),
            },
            "weights_bytes": self.weights_bytes,
            "gpu_kv_budget": a.gpu_kv_budget,
            "gpu_kv_budget_kind": self.gpu_kv_budget.kind,
            "gpu_kv_budget_bytes": self.gpu_kv_budget.bytes,
            "activation_reserve_bytes": self.activation_reserve,
            "host_limit_bytes": self.host_limit,
            "ceilings": self.ceilings,
            "speculative": None
            if not self.spec_modes
            else {
                "modes": self.spec_modes,
                "draft_acceptance": a.draft_acceptance,
                "draft_cost": a.draft_cost if a.draft_acceptance else None,
                "draft_head_bytes": self.head_bytes,
                "draft_verdicts": (
                    ("forced" if self.forced else "reference") if a.draft_acceptance else None
                ),
                "oracle_rounds": a.oracle_rounds if a.draft_acceptance and not self.forced else None,
            },
            "contexts": {},
            "rows": [],
        }

    def context_info(self, needs: dict, cold: float, device_free: int | None, cache) -> dict:
        """The report's entry of one context: its cold TTFT, the device's free bytes and the
        prefill cache's, the most requests each mode fits, and where dense fills its budget."""
        modes = self.args.modes
        info = {
            "ttft_cold_s": cold,
            "device_free_bytes": device_free,
            "gpu_kv_budget_kind": self.gpu_kv_budget.kind,
            "gpu_kv_budget_bytes": self.gpu_kv_budget.bytes,
            "prefill_cache_bytes": cache_bytes(cache),
            "max_concurrency": {m: self.max_concurrency(m, needs[m], device_free) for m in modes},
            # Each mode's warm admission at its peak beyond what stays allocated (CUDA), and what
            # of it the activation reserve does not cover, taken off that mode's GPU budget.
            "admission_bytes": {m: needs[m].get("admission_bytes") for m in modes},
            "admission_excess_bytes": {m: fits.admission_excess(needs[m], self.budgets) for m in modes},
            # Whether each mode admits the context's prompt sparse (straight to the host pool, its
            # working set its only pages: Engine.prefills_sparse) or through its dense pages.
            "prefills_sparse": {m: bool(needs[m].get("prefills_sparse")) for m in modes},
            # Each mode's drafter state per request beside the pools (the EAGLE-3 head's KV), in
            # the fit with the pages.
            "drafter_bytes": {m: needs[m].get("drafter_bytes", 0) for m in modes},
            "request_kv_bytes": needs[modes[0]]["kv_blocks"] * needs[modes[0]]["block_bytes"],
        }
        dense_max = info["max_concurrency"].get("dense")
        info["dense_fills_budget_at"] = None if dense_max is None else dense_max + 1
        return info

    def run(self, checkpoint=None) -> dict:
        """The sweep; ``checkpoint(report)`` is called after every row with the report so far."""
        from ...engine import PrefillCache
        from ...memory import available_bytes

        torch, a = self.torch, self.args
        rep = self.header()
        rows, contexts = rep["rows"], rep["contexts"]
        # The first forward of a process is slow (allocator, cuBLAS): once, on a short prompt.
        self.warm_up("dense", min(64, self.cfg.max_position_embeddings - a.max_tokens), None)
        for ctx in a.contexts:
            if ctx + a.max_tokens - 1 > self.cfg.max_position_embeddings:
                raise usage_error(
                    f"--contexts {ctx} + --max-tokens passes the model's context of "
                    f"{self.cfg.max_position_embeddings} tokens"
                )
            cache = PrefillCache(on_host=a.prefill_cache == "host") if a.prompts == "shared" else None
            modes = [*a.modes, *self.spec_modes]  # speculative rows draft from their base rows' tokens
            needs = {m: self.need(m, ctx) for m in modes}
            cold = None
            for mode in modes:
                t, transient = self.warm_up(mode, ctx, cache)
                if cold is None:
                    cold = t
                    if cache is not None and transient is not None:
                        # That one prefilled cold and filled the cache; the rows' admissions hit it.
                        transient = self.warm_up(mode, ctx, cache)[1]
                if a.activation_reserve is None:  # an explicit reserve is the user's measure
                    needs[mode]["admission_bytes"] = transient
            device_free = available_bytes(self.dev)  # beside the weights and the prefill cache
            # The engine's own check measures the same free bytes when a row's pools grow.
            self.gpu_kv_budget = self.choose_budget(device_free)
            self.budgets = fits.Budgets(self.gpu_kv_budget.bytes, self.host_limit, self.activation_reserve)
            contexts[str(ctx)] = self.context_info(needs, cold, device_free, cache)
            for mode in modes:
                for level in a.concurrency:
                    most = None
                    if level == fits.MAX_FITTING:  # a speculative row fits where its base does
                        most = self.max_concurrency(mode, needs[mode], device_free)
                    conc, why = fits.resolve_concurrency(level, most)
                    if why is not None:
                        rows.append(
                            {
                                "context": ctx,
                                "mode": mode,
                                "concurrency": None,
                                "status": "skipped",
                                "reason": why,
                            }
                        )
                        print(f"fig11: ctx {ctx} {mode}: {why}", file=sys.stderr)
                        continue
                    r = self.row(mode, ctx, conc, needs[mode], device_free, cache)
                    r["ttft_cold_s"] = cold
                    rows.append(r)
                    msg = r.get("reason") or f"{r['decode_tokens_per_s']:.1f} tok/s"
                    print(f"fig11: ctx {ctx} {mode} C={conc}: {msg}", file=sys.stderr)
                    if checkpoint is not None:
                        checkpoint(rep)
            del cache
            free_memory(torch, self.dev)
        return rep
