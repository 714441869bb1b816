"""Serving benchmarks: ``vllm bench serve``'s run against any OpenAI-compatible endpoint, and a
closed-loop sweep through HTTP or in-process, so the two compare.

    python -m oasiskv.bench.serve --base-url http://127.0.0.1:8000 [--endpoint /v1/completions]
        --dataset-name sharegpt --dataset-path ShareGPT_V3.json [--num-prompts 200]
        [--request-rate inf] [--max-concurrency N] [--metric-percentiles 50,90,99]
        [--save-result --result-dir DIR]          # vLLM's flags, metrics and result file
    python -m oasiskv.bench.serve --base-url URL --dataset-name random --random-input-len 16384 \
        --random-output-len 128 ...              # long-context synthetic prompts
    python -m oasiskv.bench.serve --endpoint http://127.0.0.1:8000 [--concurrency 1,4,16]
        [--prompt-tokens 512] [--max-tokens 64] [--requests 32] [--json out.json]
    python -m oasiskv.bench.serve --in-process MODEL [engine flags of `oasis serve`] [same sweep]
    python -m oasiskv.bench.serve --in-process qwen3-32b --tp 8 ...     # tensor-parallel, 8 ranks
    python -m oasiskv.bench.serve --endpoint URL ... --baseline in_process.json   # ratio column
    python -m oasiskv.bench.serve --fig11 [--preset qwen3-8b | --model DIR] [--contexts 16384,32768]
        [--concurrency 1,4,16,32,64] [--modes dense,oasis,oracle] [--gpu-kv-budget h100] ...
        # the paper's Fig. 11: decode throughput vs concurrency (see oasiskv.bench.fig11)

``--base-url`` is ``vllm bench serve`` (:mod:`oasiskv.bench.endpoint` has the details): requests
from a ShareGPT-format file or a random long-context set, sent at ``--request-rate`` (Poisson;
``--burstiness``) with at most ``--max-concurrency`` in flight, streamed from ``--endpoint``
(``/v1/completions`` or ``/v1/chat/completions``) of any OpenAI-compatible server; it reports
TTFT, TPOT, ITL and end-to-end latency (mean, median, std and ``--metric-percentiles``) and the
throughputs, with vLLM's names, and ``--save-result`` writes them with every request's lengths,
TTFT and ITLs. The same command against ``oasis serve`` and against ``vllm serve`` compares the
two. ``--tokenizer`` (default: ``--model``) counts ShareGPT's tokens: ``smollm2``, a ``.gguf``
file, a directory with ``tokenizer.json`` or a Hugging Face name in the local cache.

The closed-loop sweep (``--endpoint URL`` or ``--in-process MODEL``): at each concurrency ``C``,
``C`` clients each send their next request as soon as the previous
one finished, until ``--requests`` have run. Every request is the same size: ``--prompt-tokens``
token ids (seeded, drawn from ids every real vocabulary has) and exactly ``--max-tokens`` new
tokens (greedy, ``ignore_eos``). Reported per concurrency: output tokens/s over the wall time of
the sweep, requests/s, and TTFT and TPOT percentiles (HTTP: measured by the client on the SSE
stream; in-process: from the step that reports each request's tokens). One unmeasured warm-up
request runs first (the first forward of a process is slow).

For a fair comparison start the server with the same engine flags as ``--in-process`` and a
``--max-num-seqs`` of at least the largest concurrency.

``--speculative`` (an engine flag, so ``oasis serve`` takes it too) verifies and accepts the
lookahead draft (``LLMEngine(speculative=True)``); ``--in-process`` rows then add tokens per
request-step and the acceptance rate over that concurrency level (``LLMEngine.spec_stats``), e.g.
``--in-process smollm2 --drafter eagle3 --speculative`` with the bundled EAGLE-3 head. Run the
same command without ``--speculative`` first and pass its JSON as ``--baseline`` for the ratio.
The set-acceptance oracle (``--draft-acceptance``) is ``--fig11``'s: it needs reference tokens.

``--in-process`` takes what ``oasis serve`` takes (``smollm2``, a ``.gguf`` file, a Hugging Face
directory) or the name of a model-shaped preset (``oasiskv.models.config.PRESETS``: ``qwen3-8b``,
``qwen3-8b-128k``, ``qwen3-32b``, ``qwen3-235b-a22b``, ``tiny``, ...) for random weights
(``--seed``). ``--tp N`` runs the same sweep on a :class:`~oasiskv.parallel.TPLLMEngine` over
``N`` ranks spawned by :func:`~oasiskv.parallel.run_tp` (NCCL with a GPU per rank, gloo on the CPU with
``--device cpu``); rank 0 drives the sweep and reports it. A preset's ranks draw their own
shards on their device (``TPCausalLM.random_shards``: seconds, not the full model's draws); a
checkpoint is loaded on every rank and sharded. Budgets are per rank.

``--fig11`` is another experiment (``oasiskv.bench.fig11``): all requests of a concurrency level
arrive at once and decode together, dense vs OasisKV vs the all-resident oracle, over random
weights of a model-shaped preset; it reports decode throughput, TPOT, memory, bytes fetched,
kernels per layer and the fraction of the roofline, as JSON, a markdown table and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from . import fig11
from .common import PROMPT_ID_RANGE, percentile

#: Defaults of the flags whose default depends on the experiment.
SWEEP_DEFAULTS = {"concurrency": "1,4,16", "max_tokens": 64, "json": "bench_serve.json"}
DATASET_DEFAULTS = {"concurrency": "1", "max_tokens": 1, "json": ""}
FIG11_DEFAULTS = {
    "concurrency": "1,4,16,32,64",
    "max_tokens": 48,
    "json": "bench_fig11.json",
    "md": "bench_fig11.md",
    "png": "bench_fig11.png",
}


def make_prompts(n: int, prompt_tokens: int, seed: int, vocab_size: int | None = None) -> list[list[int]]:
    """``n`` prompts of ``prompt_tokens`` ids from :data:`PROMPT_ID_RANGE` (all of a preset's
    vocabulary when it is smaller, e.g. ``tiny``'s)."""
    lo, hi = PROMPT_ID_RANGE
    if vocab_size is not None and vocab_size < hi:
        lo, hi = 0, vocab_size
    rnd = random.Random(seed)
    return [[rnd.randrange(lo, hi) for _ in range(prompt_tokens)] for _ in range(n)]


def summarize(concurrency: int, records: list[dict], wall_s: float) -> dict:
    """One row: ``records`` hold each request's ``tokens``, ``ttft_s`` and ``tpot_s``."""
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
    tokens = sum(r["tokens"] for r in records)
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s else None,
        "requests_per_s": len(records) / wall_s if wall_s else None,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p90_s": percentile(tpot, 0.9),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else None,
    }


# ---------------------------------------------------------------------- through HTTP
async def _http_one(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"the server failed the request: {ev['error']}")
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev.get("choices") and ev["choices"][0]["text"]:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
    ttft = None if first is None else first - t0
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return {"tokens": tokens, "ttft_s": ttft, "tpot_s": tpot}


async def _http_sweep(args, prompts, concurrency: int) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(
        base_url=args.endpoint, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        if args.model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            args.model = r.json()["data"][0]["id"]
        todo = list(prompts)
        records: list[dict] = []

        async def worker():
            while todo:
                p = todo.pop()
                records.append(await _http_one(client, args.model, p, args.max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return summarize(concurrency, records, time.perf_counter() - t0)


# ---------------------------------------------------------------------- in-process
def spec_delta(before: dict, after: dict) -> dict:
    """Speculative decoding between two readings of ``LLMEngine.spec_stats``: tokens per
    request-step, the acceptance rate, the drafts verified (None where nothing was)."""
    d = {k: after[k] - before[k] for k in ("steps", "tokens", "drafts", "accepted")}
    return {
        "tokens_per_step": d["tokens"] / d["steps"] if d["steps"] else None,
        "acceptance_rate": d["accepted"] / d["drafts"] if d["drafts"] else None,
        "drafts": d["drafts"],
    }


def in_process_sweep(eng, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """The same closed loop driven directly on an :class:`~oasiskv.LLMEngine`; with
    ``speculative=True`` the row adds tokens per step and the acceptance rate (:func:`spec_delta`)."""
    from ..llm_engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    todo = list(prompts)
    live: dict[str, dict] = {}
    records: list[dict] = []

    def add():
        p = todo.pop()
        rid = eng.add_request(p, params)
        live[rid] = {"t0": time.perf_counter(), "first": None, "last": None}

    spec0 = dict(eng.spec_stats) if eng.speculative else None
    t0 = time.perf_counter()
    while todo and len(live) < concurrency:
        add()
    while live:
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            st = live.get(o.request_id)
            if st is None:
                continue
            if o.new_token_ids:
                st["first"] = st["first"] if st["first"] is not None else now
                st["last"] = now
            if o.finished:
                del live[o.request_id]
                if o.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"request {o.request_id} finished with {o.finish_reason}: {o.error}")
                n = len(o.token_ids)
                first = st["first"]
                records.append(
                    {
                        "tokens": n,
                        "ttft_s": None if first is None else first - st["t0"],
                        "tpot_s": (st["last"] - first) / (n - 1) if first is not None and n > 1 else None,
                    }
                )
                if todo:
                    add()
    row = summarize(concurrency, records, time.perf_counter() - t0)
    if spec0 is not None:
        row.update(spec_delta(spec0, eng.spec_stats))
    return row


# ---------------------------------------------------------------------- tensor parallel
def _preset(name: str):
    """:func:`~oasiskv.models.config.preset_unless_path`, imported when needed (this module
    stays light to import)."""
    from ..models.config import preset_unless_path

    return preset_unless_path(name)


def load_in_process_model(args, device, group=None):
    """The model of ``--in-process`` on ``device`` in the ``--dtype``: a checkpoint (loaded, and
    this rank's shard of it under ``group``) or a preset's random weights."""
    import torch

    from ..devices import compute_dtype

    dtype = compute_dtype(str(device)) if args.dtype == "auto" else getattr(torch, args.dtype)
    cfg = _preset(args.in_process)
    if group is None or group.size == 1:
        if cfg is None:
            from ..models.loader import load_model

            return load_model(args.in_process, dtype=dtype, device=device)[0]
        from ..models.random_weights import random_model

        return random_model(cfg, dtype, str(device), args.seed)
    from ..models.tp import TPCausalLM

    if cfg is not None:
        return TPCausalLM.random_shards(cfg, seed=args.seed, dtype=dtype, device=device, group=group)
    from ..models.loader import load_model

    full, _ = load_model(args.in_process, dtype=dtype, device="cpu")
    return TPCausalLM.from_full(full, group=group, device=device)


def _tp_sweep_job(group, args, prompts: list[list[int]], levels: list[int]):
    """One rank of ``--tp``: its shard and engine; rank 0 runs the sweep and returns its rows,
    the others follow it (:meth:`~oasiskv.parallel.TPLLMEngine.worker_loop`)."""
    from ..parallel import TPLLMEngine
    from ..serve.cli import engine_kwargs

    model = load_in_process_model(args, group.device, group)
    eng = TPLLMEngine(model, group=group, **engine_kwargs(args, device=str(group.device)))
    if not eng.is_driver:
        eng.worker_loop()
        return None
    try:
        in_process_sweep(eng, prompts[:1], args.max_tokens, 1)  # warm-up
        rows = []
        for c in levels:
            rows.append(in_process_sweep(eng, prompts, args.max_tokens, c))
            print(f"concurrency {c}: {rows[-1]['tokens_per_s']:.1f} tok/s (tp={group.size})", file=sys.stderr)
    finally:
        eng.shutdown()
    return {"rows": rows, "device": str(group.device), "kv_heads_per_rank": eng.engine.geo.num_kv_heads}


def tp_sweep(args, prompts: list[list[int]], levels: list[int]) -> dict:
    """The sweep over ``args.tp`` spawned ranks: rank 0's rows and what each rank held."""
    from ..models.tp import tp_config
    from ..parallel import run_tp

    preset = _preset(args.in_process)
    if preset is not None:
        tp_config(preset, args.tp)  # a tp that does not divide the heads fails here, not on the ranks
    backend = "gloo" if args.device == "cpu" else None
    return run_tp(_tp_sweep_job, tp=args.tp, args=(args, prompts, levels), backend=backend)[0]


# ---------------------------------------------------------------------- the command
def _fmt(v, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_table(rows: list[dict], baseline: dict[int, dict] | None, file=None) -> None:
    file = file or sys.stdout  # looked up now: a default bound at import misses later redirections
    head = ["conc", "reqs", "tok/s", "req/s", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms"]
    spec = any("tokens_per_step" in r for r in rows)
    if spec:
        head += ["tok/step", "accept"]
    if baseline:
        head.append("x baseline")
    lines = [head]
    for r in rows:
        line = [
            str(r["concurrency"]),
            str(r["requests"]),
            _fmt(r["tokens_per_s"]),
            _fmt(r["requests_per_s"], digits=2),
            _fmt(r["ttft_p50_s"], 1e3),
            _fmt(r["ttft_p90_s"], 1e3),
            _fmt(r["tpot_p50_s"], 1e3, 2),
            _fmt(r["tpot_p90_s"], 1e3, 2),
        ]
        if spec:
            line += [_fmt(r.get("tokens_per_step"), digits=3), _fmt(r.get("acceptance_rate"), digits=3)]
        if baseline:
            b = baseline.get(r["concurrency"])
            ok = b and b.get("tokens_per_s") and r["tokens_per_s"]
            line.append(f"{r['tokens_per_s'] / b['tokens_per_s']:.3f}" if ok else "-")
        lines.append(line)
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)), file=file)


def build_parser() -> argparse.ArgumentParser:
    from ..serve.cli import add_engine_arguments

    ap = argparse.ArgumentParser(
        prog="python -m oasiskv.bench.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # One of --base-url, --endpoint URL, --in-process and --fig11 (checked in main: --endpoint is
    # also the API path of --base-url, as in vLLM).
    ap.add_argument(
        "--base-url",
        default=None,
        help="an OpenAI-compatible server (oasis serve, vllm serve, ...): vLLM's benchmark run",
    )
    ap.add_argument(
        "--endpoint",
        default=None,
        help="with --base-url: the API path (/v1/completions, default, or /v1/chat/completions); "
        "a URL instead (http://127.0.0.1:8000): the closed-loop sweep against that server",
    )
    ap.add_argument("--in-process", metavar="MODEL", help="run the sweep on an LLMEngine in this process")
    ap.add_argument(
        "--fig11", action="store_true", help="decode throughput vs concurrency (the paper's Fig. 11)"
    )
    ds = ap.add_argument_group("--base-url: vllm bench serve's run (oasiskv.bench.endpoint)")
    ds.add_argument("--dataset-name", choices=("sharegpt", "random"), default="sharegpt")
    ds.add_argument("--dataset-path", default=None, help="sharegpt: the ShareGPT-format JSON file")
    ds.add_argument("--num-prompts", type=int, default=200, help="requests to send (default 200)")
    ds.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="max_tokens of every request (default: the gpt turn's)",
    )
    ds.add_argument("--random-input-len", type=int, default=1024)
    ds.add_argument("--random-output-len", type=int, default=128)
    ds.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn in [len * (1 - r), len * (1 + r)]",
    )
    ds.add_argument(
        "--tokenizer",
        default=None,
        help="counts the dataset's tokens (default: --model; see the description)",
    )
    ds.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (default inf: all at once)",
    )
    ds.add_argument(
        "--burstiness", type=float, default=1.0, help="1: Poisson arrivals; below 1 burstier, above steadier"
    )
    ds.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)"
    )
    ds.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly max_tokens (vLLM's and oasis serve's extension)",
    )
    ds.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ds.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="which metrics to print percentiles of: ttft, tpot, itl, e2el (all are saved)",
    )
    ds.add_argument(
        "--metric-percentiles",
        "--percentiles",
        dest="metric_percentiles",
        default="99",
        help="comma-separated percentiles to report (default 99; mean and median always)",
    )
    ds.add_argument("--save-result", action="store_true", help="write the result JSON (vLLM's fields)")
    ds.add_argument("--result-dir", default=".", help="where --save-result writes (default .)")
    ds.add_argument(
        "--result-filename",
        default=None,
        help="its file name (default oasis-bench-DATASET-RATEqps-MODEL-TIME.json); --json PATH writes it too",
    )
    ds.add_argument("--no-warmup", action="store_true", help="skip the unmeasured first request")
    ap.add_argument(
        "--model",
        default=None,
        help="the model id to request (default: the server's); --fig11: a local model instead of --preset",
    )
    ap.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY with --base-url)")
    ap.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated client counts (default 1,4,16); with --fig11 'max' is each mode's "
        "largest concurrency that fits its budgets",
    )
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64)")
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request")
    ap.add_argument(
        "--json", default=None, help="write the results here (default bench_serve.json; '': none)"
    )
    ap.add_argument("--baseline", default=None, help="a JSON written by an earlier run: adds a ratio column")
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="--in-process and --fig11: tensor-parallel ranks, one process each (NCCL with a GPU per "
        "rank, gloo with --device cpu)",
    )
    add_engine_arguments(ap)
    fig11.add_arguments(ap)
    return ap


def _error(msg: str) -> int:
    print(f"bench.serve: error: {msg}", file=sys.stderr)
    return 2


def _parse_floats(text: str) -> list[float] | None:
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return None
    return xs or None


def dataset_main(args) -> int:
    """``--base-url``: vLLM's benchmark run (:mod:`oasiskv.bench.endpoint`)."""
    import datetime
    import os

    from ..errors import OasisError
    from . import endpoint as ep

    pcts = _parse_floats(args.metric_percentiles)
    if pcts is None or not all(0 < p <= 100 for p in pcts):
        return _error(f"--metric-percentiles takes numbers in (0, 100], got {args.metric_percentiles!r}")
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if not selected or set(selected) - set(ep.METRIC_KEYS):
        return _error(
            f"--percentile-metrics takes {', '.join(ep.METRIC_KEYS)}, got {args.percentile_metrics!r}"
        )
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        return _error("--num-prompts and --max-concurrency must be >= 1")
    if not args.request_rate > 0 or not args.burstiness > 0:
        return _error("--request-rate and --burstiness must be > 0")
    path = args.endpoint or "/v1/completions"
    if not path.startswith("/"):
        return _error(f"with --base-url, --endpoint is an API path such as /v1/completions, got {path!r}")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        return _error("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-format JSON list)")
    chat = path.rstrip("/").endswith("chat/completions")
    base = args.base_url.rstrip("/")
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    model = args.model
    if model is None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            r = httpx.get(f"{base}/v1/models", headers=headers, timeout=args.timeout)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        except Exception as e:
            return _error(f"could not list {base}/v1/models to pick --model ({type(e).__name__}: {e})")
    try:
        tok_spec = args.tokenizer or model
        need_tok = args.dataset_name == "sharegpt" or chat
        tok = ep.load_tokenizer(tok_spec) if need_tok or args.tokenizer else None
        if args.dataset_name == "sharegpt":
            reqs = ep.sample_sharegpt(
                args.dataset_path, args.num_prompts, tok, args.sharegpt_output_len, seed=args.seed
            )
        else:
            reqs = ep.sample_random(
                args.num_prompts,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                seed=args.seed,
                tokenizer=tok,
                as_text=chat,
            )
    except OasisError as e:
        return _error(str(e))
    print(
        f"bench.serve: {len(reqs)} {args.dataset_name} requests to {base}{path} (model {model}), "
        f"rate {args.request_rate}, max concurrency {args.max_concurrency}",
        file=sys.stderr,
    )
    try:
        results, duration = asyncio.run(
            ep.run_benchmark(
                base,
                path,
                model,
                reqs,
                api_key=api_key,
                request_rate=args.request_rate,
                burstiness=args.burstiness,
                max_concurrency=args.max_concurrency,
                ignore_eos=args.ignore_eos,
                temperature=args.temperature,
                tokenizer=tok,
                timeout=args.timeout,
                seed=args.seed,
                warmup=not args.no_warmup,
            )
        )
    except RuntimeError as e:
        return _error(str(e))
    metrics = ep.calculate_metrics(results, duration, pcts)
    print(ep.format_report(metrics, pcts, selected))
    for r in results:
        if r.error:
            print(f"bench.serve: a request failed: {r.error}", file=sys.stderr)
            break
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    info = {
        "date": stamp,
        "backend": "openai-chat" if chat else "openai",
        "base_url": base,
        "endpoint": path,
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
        "dataset_name": args.dataset_name,
        "num_prompts": len(reqs),
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "percentiles": pcts,
        "expected_output_lens": [r.expected_output_len for r in reqs],
    }
    doc = ep.result_json(metrics, results, **info)
    targets = []
    if args.save_result:
        rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
        name = args.result_filename or (
            f"oasis-bench-{args.dataset_name}-{rate}qps-{Path(str(model)).name}-{stamp}.json"
        )
        targets.append(Path(args.result_dir) / name)
    if args.json:
        targets.append(Path(args.json))
    for t in targets:
        t.parent.mkdir(parents=True, exist_ok=True)
        t.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if metrics["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    legacy_url = args.endpoint is not None and args.endpoint.startswith(("http://", "https://"))
    chosen = {
        "--base-url": bool(args.base_url),
        "--endpoint URL": legacy_url,
        "--in-process": bool(args.in_process),
        "--fig11": bool(args.fig11),
    }
    modes = [m for m, on in chosen.items() if on]
    if args.endpoint is not None and not legacy_url and not args.base_url:
        return _error(f"--endpoint {args.endpoint} is an API path: use it with --base-url URL")
    if len(modes) != 1:
        return _error(
            "pass exactly one of --base-url URL (vLLM's benchmark run), --endpoint URL or "
            f"--in-process MODEL (the closed-loop sweep) and --fig11; got {', '.join(modes) or 'none'}"
        )
    if args.base_url:
        if args.tp > 1 or args.speculative:
            return _error(
                "--tp and --speculative configure an engine in this process; start the server "
                "with 'oasis serve ... --speculative' instead"
            )
        for name, value in DATASET_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        return dataset_main(args)
    defaults = (FIG11_DEFAULTS if args.fig11 else SWEEP_DEFAULTS).items()
    for name, value in defaults:
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        # --fig11 also takes "max": each mode's largest concurrency that fits (fig11.MAX_FITTING)
        levels = [
            fig11.MAX_FITTING if args.fig11 and x.strip() == "max" else int(x)
            for x in args.concurrency.split(",")
            if x.strip()
        ]
    except ValueError:
        levels = []
    if (
        not levels
        or any(c != fig11.MAX_FITTING and c < 1 for c in levels)
        or args.prompt_tokens < 1
        or args.max_tokens < 1
        or args.requests < 1
        or args.tp < 1
    ):
        print(
            "bench.serve: error: --concurrency (ints >= 1; with --fig11 also 'max'), --prompt-tokens, "
            "--max-tokens, --requests and --tp must be positive",
            file=sys.stderr,
        )
        return 2
    if args.draft_acceptance is not None and not args.fig11:
        print(
            "bench.serve: error: --draft-acceptance sets the oracle drafter of --fig11's speculative "
            "rows (it needs reference tokens); the sweep speculates with --drafter ngram or eagle3",
            file=sys.stderr,
        )
        return 2
    if args.speculative and args.endpoint:
        print(
            "bench.serve: error: --speculative configures an engine in this process; start the "
            "server with 'oasis serve ... --speculative' instead",
            file=sys.stderr,
        )
        return 2
    if args.tp > 1 and args.endpoint:
        print(
            "bench.serve: error: --tp runs the engine in this command's processes: use it with "
            "--in-process or --fig11 (a server takes its own flags)",
            file=sys.stderr,
        )
        return 2
    if args.fig11:
        args.concurrency = levels
        return fig11.main(args)
    baseline = None
    if args.baseline:
        with open(args.baseline, encoding="utf-8") as f:
            baseline = {r["concurrency"]: r for r in json.load(f)["rows"]}
    preset = _preset(args.in_process) if args.in_process else None
    vocab = preset.vocab_size if preset is not None else None
    prompts = make_prompts(args.requests, args.prompt_tokens, args.seed, vocab)
    rows = []
    if args.endpoint:
        asyncio.run(_http_sweep(args, prompts[:1], 1))  # warm-up
        for c in levels:
            rows.append(asyncio.run(_http_sweep(args, prompts, c)))
            print(f"concurrency {c}: {rows[-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        mode = {"mode": "http", "endpoint": args.endpoint, "model": args.model}
    elif args.tp > 1:
        from ..errors import OasisError, RankFailedError

        try:
            out = tp_sweep(args, prompts, levels)
        except (OasisError, RankFailedError) as e:
            print(f"bench.serve: error: {str(e).split(chr(10))[0]}", file=sys.stderr)
            return 2
        rows = out["rows"]
        mode = {
            "mode": "in-process",
            "model": args.in_process,
            "random_weights": _preset(args.in_process) is not None,
            "tp": args.tp,
            "backend": args.backend,
            "speculative": args.speculative,
            "device": out["device"],
            "kv_heads_per_rank": out["kv_heads_per_rank"],
        }
    else:
        from ..errors import OasisError
        from ..serve.cli import engine_from_args

        try:
            model = args.in_process
            if _preset(model) is not None:
                from ..devices import resolve_device

                model = load_in_process_model(args, resolve_device(args.device))
            eng = engine_from_args(model, args)
        except (OasisError, MemoryError) as e:
            print(f"bench.serve: error: {e}", file=sys.stderr)
            return 2
        in_process_sweep(eng, prompts[:1], args.max_tokens, 1)  # warm-up
        for c in levels:
            rows.append(in_process_sweep(eng, prompts, args.max_tokens, c))
            print(f"concurrency {c}: {rows[-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        mode = {
            "mode": "in-process",
            "model": args.in_process,
            "random_weights": _preset(args.in_process) is not None,
            "tp": 1,
            "backend": args.backend,
            "drafter": eng.drafter.name if eng.drafter is not None else None,
            "speculative": args.speculative,
        }
    report = {
        **mode,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "rows": rows,
    }
    print_table(rows, baseline)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
