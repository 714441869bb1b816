"""Per-step host time of a decode step: plan plus launches, measured with the GPU idle.

Qwen3-8B attention shapes (36 layers, 32 query / 8 KV heads, head_dim 128; a narrow MLP and
vocabulary, which change GPU time, not host time), random bf16 weights, ``--requests`` sparse
requests at ``--context`` tokens, the lookahead row on. Each measured step: synchronize (the GPU
is idle), then time ``Engine.decode_step`` on the host clock until it returns (``host_ms``: what
the CPU spends planning and launching), then synchronize again (``step_ms``: the whole step).
Medians over ``--steps`` after two warm-up steps.

``--engine old`` runs the engine of an earlier tree for the before/after comparison: put its
``engine.py`` at ``oasiskv/engine_old.py`` in the installed package (see docs/PERF.md).

    python3 experiments/exp_step_host.py --engine new --json out.json
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import statistics
import time

import torch

from oasiskv import KvConfig
from oasiskv.drafters import NgramDrafter
from oasiskv.models.config import preset_config
from oasiskv.models.transformer import CausalLM


def profile_steps(eng, reqs, layers: int, path: str, trace: str | None) -> float:
    """Profile 3 decode steps of ``eng`` (CUDA): the kernel table by CUDA time into ``path``
    (and the Chrome trace into ``trace``); returns the kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            eng.decode_step(reqs)
            for r in reqs:
                r.tokens.append(1)
                r.draft = 2
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_step = len(kernels) / 3
    with open(path, "w") as f:
        f.write(f"kernels per step {per_step:.0f}, per layer {per_step / layers:.1f}\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    return per_step


_GREEN: list = []  # the green contexts of --background-sms, alive as long as their streams


def green_streams(n_sms: int, k: int, dev: torch.device) -> list:
    """``k`` streams whose kernels run on ``n_sms`` SMs (a CUDA green context each,
    ``torch.cuda.green_contexts``; torch splits the same SMs off for each), for the engine's
    background chains: their kernels then leave the other SMs to the compute stream, which keeps
    every SM. Whether a captured step keeps the partition is what the timing shows."""
    from torch.cuda.green_contexts import GreenContext

    idx = dev.index or 0
    streams = []
    for _ in range(k):
        try:
            ctx = GreenContext.create(num_sms=n_sms, device_id=idx)
        except TypeError:  # an older signature: create(num_sms, device_id)
            ctx = GreenContext.create(n_sms, idx)
        if hasattr(ctx, "Stream"):
            streams.append(ctx.Stream())
        else:  # a stream made while the green context is current belongs to it
            ctx.set_context()
            try:
                streams.append(torch.cuda.Stream(dev))
            finally:
                ctx.pop_context()
        _GREEN.append(ctx)
    return streams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["new", "old"], default="new")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--top-k-blocks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-recall", action="store_true", help="KvConfig(measure_recall=False)")
    ap.add_argument("--cuda-graph", action="store_true", help="Engine(cuda_graph=True)")
    ap.add_argument("--backend", choices=["oasis", "dense"], default="oasis")
    ap.add_argument("--full", action="store_true", help="Qwen3-8B's MLP and vocabulary too (GPU time)")
    ap.add_argument("--same-prompt", action="store_true", help="one prompt, prefilled once")
    ap.add_argument("--fetch-cap", type=float, default=0.05)
    ap.add_argument(
        "--profile",
        help="kernel table of 3 steps here (with --variants also one per variant, at PATH.NAME-K-FUSED)",
    )
    ap.add_argument(
        "--gather-blocks",
        default="",
        help="comma list of GPU gather launches MAX_BLOCKS:WARPS:ENTRIES_PER_WARP[:STAGE_ENTRIES] to sweep "
        "in the same process (ops.set_gather_launch), for each --requests-sweep size; each drops the "
        "graphs and times --steps steps again",
    )
    ap.add_argument(
        "--gather-kv8",
        action="store_true",
        help="--gather-blocks sets the launch of gathers from an fp8_e4m3 host pool "
        "(set_gather_launch(kv8=True))",
    )
    ap.add_argument("--host-kv-dtype", choices=["fp8_e4m3"], default=None, help="KvConfig(host_kv_dtype=)")
    ap.add_argument("--host-pool", choices=["pinned", "device"], default="pinned")
    ap.add_argument("--background-streams", type=int, default=2, help="Engine(background_streams=N)")
    ap.add_argument(
        "--streams-sweep",
        default="",
        help="comma list of background stream counts to time in the same process",
    )
    ap.add_argument(
        "--priority-sweep",
        default="",
        help="comma list of capture-stream priorities (0: the background streams' own, -1: high) to "
        "time in the same process; with --requests-sweep, every pair",
    )
    ap.add_argument(
        "--requests-sweep",
        default="",
        help="comma list of batch sizes (<= --requests) to time in the same process: the first N requests",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="comma list of SELECTION:STREAMS:FUSED (fidelity|fidmma|fast|fid16: fidmma the fidelity "
        "selection with the 8-bit bound scored on the tensor cores (ops.set_bound8_score_kernel('mma')), "
        "fid16 with candidate_bound='summaries'; background streams; 0|1 for "
        "engine.selection.FUSED_RESCORE; optionally :SILU, 0|1 for transformer.FUSED_SILU_MUL, and "
        ":PRIO, the capture stream's priority) to time in the same process, in turn, --repeat times: the "
        "selection is switched on the live engine (fast drops the codes score; blocks completed "
        "meanwhile get no key codes, which changes no kernel's work), so both read one host pool",
    )
    ap.add_argument("--repeat", type=int, default=1, help="rounds of --variants (alternating)")
    ap.add_argument(
        "--silu-mul",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the MLP's silu(gate) * up as one kernel, or (--no-silu-mul) torch's two "
        "(transformer.FUSED_SILU_MUL); default: the module's",
    )
    ap.add_argument(
        "--background-sms",
        type=int,
        default=None,
        help="the background streams (selection chains, gathers) in CUDA green contexts of this "
        "many SMs (green_streams), for every timing of this process; default: ordinary streams",
    )
    ap.add_argument(
        "--capture-priority",
        type=int,
        default=None,
        help="the capture stream's priority for every timing of this process (0: the background "
        "streams' own, the engine's; -1: high), so that --variants compare under it",
    )
    ap.add_argument("--trace", help="with --profile: the Chrome trace of the profiled steps here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.silu_mul is not None:
        from oasiskv.models import transformer

        transformer.FUSED_SILU_MUL = args.silu_mul
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    # Qwen3-8B's shapes (models.config preset); without --full a narrow MLP and vocabulary.
    narrow = (
        {}
        if args.full
        else {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 1024, "eos_token_ids": []}
    )
    cfg = preset_config("qwen3-8b").replace(
        num_hidden_layers=args.layers, max_position_embeddings=args.context + 64, **narrow
    )
    if cuda:  # weights drawn on the GPU: seconds, where CausalLM.random draws 8B values on the CPU
        from oasiskv.models.random_weights import random_model

        model = random_model(cfg, dtype, dev).eval()
    else:
        model = CausalLM.random(cfg, seed=0, dtype=dtype, device=dev).eval()
    mod = importlib.import_module("oasiskv.engine" if args.engine == "new" else "oasiskv.engine_old")
    kv = KvConfig(
        block_size=16,
        top_k_blocks=args.top_k_blocks,
        fetch_cap=args.fetch_cap,
        measure_recall=not args.no_recall,
        host_kv_dtype=args.host_kv_dtype,
    )
    drafter = NgramDrafter()
    extra = {"cuda_graph": True} if args.cuda_graph else {}
    cache = mod.PrefillCache(1) if args.same_prompt else None
    if args.backend == "oasis":  # every request's whole KV in the host pool (on the device: the oracle)
        extra["host_kv_budget_bytes"] = (
            args.requests
            * (args.context + 1024)
            * cfg.num_hidden_layers
            * (cfg.num_key_value_heads * cfg.head_dim * 2 * (1 if args.host_kv_dtype else dtype.itemsize))
        )
    eng = mod.Engine(
        model,
        kv,
        args.backend,
        drafter,
        prefill_cache=cache,
        host_pool=args.host_pool,
        background_streams=args.background_streams,
        **extra,
    )
    if args.capture_priority is not None and cuda:  # as --priority-sweep, but from the start
        eng._capture_stream = torch.cuda.Stream(dev, priority=args.capture_priority)

    def sides(k: int) -> list:
        """The engine's ``k`` background streams for this run (--background-sms)."""
        if args.background_sms:
            return green_streams(args.background_sms, k, dev)
        return [torch.cuda.Stream(dev) for _ in range(k)]  # as Engine(background_streams=k)

    if args.background_sms and cuda:
        eng._sides = sides(args.background_streams)
    g = torch.Generator().manual_seed(0)
    prios = [int(x) for x in args.priority_sweep.split(",")] if args.priority_sweep else [None]
    sizes = [int(x) for x in args.requests_sweep.split(",")] if args.requests_sweep else [None]
    sweep_points = len(args.gather_blocks.split(",")) * len(sizes) if args.gather_blocks else 0
    sweep_points += len(args.streams_sweep.split(",")) if args.streams_sweep else 0
    sweep_points += len(args.variants.split(",")) * args.repeat if args.variants else 0
    if args.priority_sweep or args.requests_sweep:
        sweep_points += len(prios) * len(sizes)
    steps_all = (args.steps + 2) * (1 + sweep_points) + 3 + (3 * sweep_points if args.profile else 0)
    reqs = []
    for i in range(args.requests):
        if not (args.same_prompt and reqs):
            ids = torch.randint(0, cfg.vocab_size, (args.context,), generator=g).tolist()
        request = mod.Request if hasattr(mod, "Request") else mod._Request  # engine_old: the old name
        reqs.append(request(id=i, prompt=ids, max_new_tokens=steps_all + 8))
    eng.ensure_pools(reqs)
    for r in reqs:
        drafter.begin(r.id, r.prompt)
        r.tokens = list(r.prompt)
        logits = eng.prefill(r)
        r.tokens.append(int(logits.argmax()))
        r.draft = 1
        if args.backend == "oasis":
            eng.make_sparse(r)

    fetched: list[int] = []  # block-heads the timed steps gathered from the host pool, per step

    def timed(n: int, batch: list | None = None) -> tuple[list[float], list[float]]:
        batch = reqs if batch is None else batch
        host, step = [], []
        fetched.clear()
        acc = getattr(eng, "_acc_fetched", None)
        for s in range(n + 2):
            before = int(acc.sum()) if acc is not None else 0
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.decode_step(batch)
            t1 = time.perf_counter()
            if cuda:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if s >= 2:
                host.append((t1 - t0) * 1e3)
                step.append((t2 - t0) * 1e3)
                if acc is not None:
                    fetched.append(int(acc.sum()) - before)
            for r in batch:
                r.tokens.append(1)
                r.draft = 2
        return host, step

    host, step = timed(args.steps)
    fetched0 = list(fetched)
    sweep = []
    if args.gather_blocks and cuda:
        from oasiskv import ops

        kv8 = args.gather_kv8
        default_launch = ops.gather_launch(kv8=kv8)
        for size, spec in itertools.product(sizes, args.gather_blocks.split(",")):
            n = tuple(int(x) for x in spec.split(":"))
            ops.set_gather_launch(*n, kv8=kv8)
            if hasattr(eng, "drop_graphs"):
                eng.drop_graphs()
            h, st = timed(args.steps, reqs[:size] if size else None)
            row = dict(
                gather_blocks=n,
                requests=size or len(reqs),
                host_ms=statistics.median(h),
                step_ms=statistics.median(st),
            )
            print(json.dumps(row), flush=True)
            sweep.append(row)
        ops.set_gather_launch(*default_launch, kv8=kv8)
        eng.drop_graphs()
    if args.streams_sweep and cuda:
        for k in [int(x) for x in args.streams_sweep.split(",")]:
            eng._join_background()
            eng._sides = sides(k)
            eng.drop_graphs()
            h, st = timed(args.steps)
            row = dict(background_streams=k, host_ms=statistics.median(h), step_ms=statistics.median(st))
            print(json.dumps(row), flush=True)
            sweep.append(row)
    if args.variants:  # on the CPU too (the streams apart), to check the switch
        import dataclasses

        from oasiskv import ops
        from oasiskv.engine import selection as sel_mod

        kv_fidelity, codes_fidelity = eng.kv, eng.key_codes
        kv_fast = dataclasses.replace(
            kv_fidelity,
            block_score="quest",
            score_candidates=None,
            sticky_candidates=False,
            successor_blocks=0,
            lookahead_min_confidence=None,
        )
        kv_fid16 = dataclasses.replace(kv_fidelity, candidate_bound="summaries")  # the 16-bit bound
        for _ in range(args.repeat):
            for spec in args.variants.split(","):
                name, k, fused, *rest = spec.split(":")
                if len(rest) > 2:
                    raise SystemExit(f"--variants: SELECTION:STREAMS:FUSED[:SILU[:PRIO]], got {spec!r}")
                silu = rest[0] if rest else None
                prio = int(rest[1]) if len(rest) > 1 else None
                if name not in ("fidelity", "fidmma", "fast", "fid16"):
                    raise SystemExit(
                        f"--variants: selection must be fidelity, fidmma, fast or fid16, got {name!r}"
                    )
                if kv_fidelity.block_score != "codes":
                    raise SystemExit("--variants needs an engine made with the fidelity selection")
                eng.kv, eng.key_codes = {
                    "fidelity": (kv_fidelity, codes_fidelity),
                    "fidmma": (kv_fidelity, codes_fidelity),
                    "fid16": (kv_fid16, codes_fidelity),
                    "fast": (kv_fast, False),
                }[name]
                # fidmma: the fidelity selection with the 8-bit bound scored on the tensor cores.
                ops.set_bound8_score_kernel("mma" if name == "fidmma" else "fma")
                sel_mod.FUSED_RESCORE = fused == "1"
                if silu is not None:
                    from oasiskv.models import transformer

                    transformer.FUSED_SILU_MUL = silu == "1"
                for layer in range(args.layers):
                    eng._counters_of(layer)  # made outside any capture, as the engine's first step does
                if cuda:
                    eng._join_background()
                    eng._sides = sides(int(k))
                    if prio is not None:
                        eng._capture_stream = torch.cuda.Stream(dev, priority=prio)
                    eng.drop_graphs()
                h, st = timed(args.steps)
                if args.profile and cuda:  # this variant's kernel table beside the final one's
                    profile_steps(eng, reqs, args.layers, f"{args.profile}.{name}-{k}-{fused}", None)
                row = dict(
                    selection=name,
                    background_streams=int(k),
                    fused_rescore=fused == "1",
                    silu_mul=None if silu is None else silu == "1",
                    capture_priority=prio,
                    host_ms=statistics.median(h),
                    step_ms=statistics.median(st),
                    fetched_per_step=statistics.median(fetched) if fetched else None,
                )
                print(json.dumps(row), flush=True)
                sweep.append(row)
    if (args.priority_sweep or args.requests_sweep) and cuda:
        for size, prio in itertools.product(sizes, prios):
            eng._join_background()
            if prio is not None:
                eng._capture_stream = torch.cuda.Stream(dev, priority=prio)
            eng.drop_graphs()
            h, st = timed(args.steps, reqs[:size] if size else None)
            row = dict(
                capture_priority=prio,
                requests=size or len(reqs),
                host_ms=statistics.median(h),
                step_ms=statistics.median(st),
            )
            print(json.dumps(row), flush=True)
            sweep.append(row)
    kernels_per_step = None
    if args.profile and cuda:
        kernels_per_step = profile_steps(eng, reqs, args.layers, args.profile, args.trace)
    res = dict(
        kernels_per_step=kernels_per_step,
        engine=args.engine,
        backend=args.backend,
        cuda_graph=args.cuda_graph,
        full=args.full,
        graph_stats=getattr(eng, "graph_stats", None),
        requests=args.requests,
        layers=args.layers,
        context=args.context,
        top_k_blocks=args.top_k_blocks,
        measure_recall=not args.no_recall,
        device=str(dev),
        host_ms=statistics.median(host),
        step_ms=statistics.median(step),
        host_ms_all=host,
        fetched_per_step=statistics.median(fetched0) if fetched0 else None,
        host_pool=args.host_pool,
        capture_priority=args.capture_priority,
        background_sms=args.background_sms,
        silu_mul=args.silu_mul,
        sweep=sweep,
    )
    print(json.dumps({k: v for k, v in res.items() if k != "host_ms_all"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
