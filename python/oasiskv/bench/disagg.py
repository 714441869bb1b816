"""The paper's Fig. 12: disaggregated prefill and decode through the ``oasis-rt`` daemon, the full
KV transfer against partial fetching, over a request-rate sweep.

::

    python -m oasiskv.bench.disagg [--preset qwen3-8b | --model DIR] [--device cuda]
        [--kv-source oasis-rt://HOST:PORT | --daemon PATH [--transport tcp|ucx]]
        [--prompt-tokens 16384] [--max-tokens 64] [--requests 16] [--rates 0.5,1,2]
        [--transfers [local,]full,partial] [--first-query first_token|prompt]
        [--top-k-blocks 128] [--fetch-cap 0.05]
        [--kv-dtype auto|fp8_e4m3] [--host-kv-dtype auto|fp8_e4m3] [--json F] [--md F]

Three processes: the daemon (``--kv-source`` names a running one; else ``--daemon`` starts that
binary, or ``$OASIS_RT_BIN``, ``target/release/oasis-rt``, ``oasis-rt`` on the PATH, on a free
loopback port), a prefill process and this one, the decode node. The prefill process
(:class:`~oasiskv.disagg.PrefillWorker`, its own copy of the model) prefills each request at its
arrival time -- Poisson arrivals at ``rate`` requests per second, the same seeded schedule for
every transfer mode -- stages it in the daemon and hands the :class:`~oasiskv.disagg.StagedRequest`
over a pipe; this process adds it to an ``LLMEngine(kv_source=..., kv_transfer=...)`` between
decode steps. Greedy decoding, ``ignore_eos``.

Reported per (transfer, rate):

- throughput: output tokens over the time from the first arrival to the last token;
- TTFT (arrival to the decode engine's first token: prefill, staging, the wait for admission,
  the admission's transfer) p50/p99, and its part after staging (``admit``: waiting plus the
  transfer) p50;
- TPOT p50 (per request: decode time over its tokens after the first);
- bytes at admission and fetched during decode per request, and the peak of the decode side's
  host memory for KV (``TransferStats.peak_cached_bytes``: the staged bytes the host pool held
  at once; the paper: 2.2-2.6x less with partial fetching);
- whether each request's tokens equal the first mode's (partial fetching is exact: it reads the
  blocks the selection wants before they are gathered).

``--transfers local,full,partial`` adds the single-process engine as the first row: the same
``LLMEngine`` without a KV source, each request added at its arrival and prefilled by the decode
engine itself (nothing staged, no bytes over the network). With ``--first-query prompt`` the
staged requests' first working set is selected by the query the single-process engine selects
with, so every row's tokens equal the local row's whatever the budget (the default,
``first_token``, the paper's, selects with the first token's own query: equal only where the
budget holds the whole context).

``--kv-dtype`` / ``--host-kv-dtype fp8_e4m3`` (as ``bench.serve``) give both nodes that
``KvConfig``: the blocks are staged, moved and held in fp8 (codes and a scale per block and KV
head, about half of bf16's bytes); every row names the pages' and the host tier's dtype.

A warm-up request (not reported) runs first in every mode. Output: a markdown table (stdout and
``--md``) and JSON (``--json``). Prefill and decode share one GPU here; on two nodes the prefill
time would not slow the decode steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

from ..serve.cli import add_kv_dtype_arguments

#: The transfer modes, in report order (``LLMEngine(kv_transfer=...)``).
TRANSFERS = ("full", "partial")
#: What ``--transfers`` takes: the transfer modes, and ``local``, the single-process engine (the
#: decode engine prefills each request itself at its arrival; no daemon, nothing staged), the
#: reference the staged modes' tokens compare with when it comes first.
MODES = ("local", *TRANSFERS)
#: ``oasiskv.disagg.ADMISSIONS`` and ``FIRST_QUERIES``, spelled out so that ``--help`` needs no
#: torch import (a test checks that they agree).
ADMISSIONS = ("heads", "union")
FIRST_QUERIES = ("first_token", "prompt")
#: How long a pipe read may wait for the prefill process (arbitrary, generous: it loads the
#: model first).
READY_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------- arguments
def _floats(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not out or any(not (x > 0 and math.isfinite(x)) for x in out):
        raise argparse.ArgumentTypeError(f"rates must be positive numbers (requests per second), got {s!r}")
    return out


def _transfers(s: str) -> list[str]:
    out = [x for x in s.split(",") if x]
    bad = [x for x in out if x not in MODES]
    if not out or bad or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"--transfers takes distinct values of {MODES}, got {s!r}")
    return out


def _prefetch(args) -> int:
    """The partial rows' decode-time prefetch budget: ``--kv-prefetch``, else the source's default."""
    from ..disagg.wire import DECODE_PREFETCH

    return DECODE_PREFETCH if args.kv_prefetch is None else args.kv_prefetch


def _at_least(lo: int):
    """An argparse type: an integer >= ``lo``."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = lo - 1
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {s!r}")
        return v

    return parse


_positive, _non_negative = _at_least(1), _at_least(0)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m oasiskv.bench.disagg",
        description="Disaggregated prefill/decode through oasis-rt: full KV transfer against partial "
        "fetching over a request-rate sweep (the paper's Fig. 12).",
    )
    m = ap.add_argument_group("model")
    m.add_argument("--preset", default="qwen3-8b", help="random weights of this shape (PRESETS)")
    m.add_argument("--model", default=None, help="a local checkpoint directory instead of --preset")
    m.add_argument("--device", default="auto", help="cuda, cpu or auto")
    m.add_argument("--dtype", default="auto", help="bfloat16, float16, float32 or auto")
    m.add_argument("--seed", type=int, default=0, help="random weights, prompts and arrivals")
    d = ap.add_argument_group("daemon")
    d.add_argument("--kv-source", default=None, help="a running daemon, oasis-rt[+ucx]://HOST:PORT")
    d.add_argument("--daemon", default=None, help="the oasis-rt binary to start on a loopback port")
    d.add_argument("--transport", choices=["tcp", "ucx"], default="tcp", help="of a started daemon")
    d.add_argument("--daemon-memory", default="64GiB", help="a started daemon's --memory")
    d.add_argument("--timeout", type=float, default=60.0, help="deadline of every daemon call, seconds")
    w = ap.add_argument_group("workload")
    w.add_argument("--prompt-tokens", type=_positive, default=16384)
    w.add_argument("--max-tokens", type=_positive, default=64)
    w.add_argument("--requests", type=_positive, default=16, help="requests per rate")
    w.add_argument("--rates", type=_floats, default=[0.5, 1.0, 2.0], help="requests per second")
    w.add_argument(
        "--transfers",
        type=_transfers,
        default=list(TRANSFERS),
        help="modes, in report order: full, partial, and local (the single-process engine, no "
        "daemon: put it first to compare every row's tokens with it)",
    )
    w.add_argument("--max-num-seqs", type=_positive, default=None, help="default: --requests")
    w.add_argument(
        "--cuda-graph",
        action="store_true",
        help="decode in CUDA graphs (a partial transfer's misses are read after each replay)",
    )
    w.add_argument(
        "--admission", choices=list(ADMISSIONS), default="heads", help="the prefill worker's admission set"
    )
    w.add_argument(
        "--first-query",
        choices=list(FIRST_QUERIES),
        default="first_token",
        help="the query that selects a staged request's first working set (PrefillWorker(first_query=)): "
        "the first token's (the paper's) or the prompt's last, as the single-process engine selects, so "
        "that the staged rows' tokens equal a 'local' row's whatever the budget",
    )
    k = ap.add_argument_group("KV")
    k.add_argument("--block-size", type=_positive, default=16)
    k.add_argument("--top-k-blocks", type=_positive, default=128)
    k.add_argument("--fetch-cap", type=float, default=0.05)
    k.add_argument("--sparse-threshold", type=_positive, default=None, help="default: the KvConfig's")
    k.add_argument("--host-kv-budget", default=None, help="the decode engine's host pool, e.g. 64GiB")
    add_kv_dtype_arguments(k, whose="both nodes'")  # the staged blocks are the host pool's
    k.add_argument(
        "--read-connections",
        type=_positive,
        default=None,
        help="connections the decode engine spreads a large read over (RemoteKvSource.read_connections)",
    )
    k.add_argument(
        "--kv-cache-blocks",
        type=_positive,
        default=None,
        help="partial rows: bound each staged request's host cache (LLMEngine(kv_cache_blocks=)), "
        "so that the host pool holds what was fetched, not a row for every block",
    )
    k.add_argument(
        "--kv-prefetch",
        type=_non_negative,
        default=None,
        help="partial rows: block-heads a step may also read ahead in the background "
        "(LLMEngine(kv_prefetch=); 0: off; default: the source's)",
    )
    k.add_argument(
        "--kv-in-step-reads",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="partial rows: read each step's misses while the step runs, each layer's gather "
        "waiting for its own reads (LLMEngine(kv_in_step_reads=)); --no-kv-in-step-reads: after "
        "the step. Default: the engine's (on, except with --kv-cache-blocks)",
    )
    k.add_argument(
        "--transfer-stream",
        action="store_true",
        help="with in-step reads on a GPU: each layer's wait for its reads and its gather on a "
        "transfer stream of their own, not behind the layer's selection on its background stream "
        "(oasiskv.engine.core.IN_STEP_TRANSFER_STREAM; off by default until measured)",
    )
    o = ap.add_argument_group("output")
    o.add_argument("--json", default=None)
    o.add_argument("--md", default=None)
    return ap


def _kv(args):
    from ..config import KvConfig
    from ..serve.cli import host_kv_dtype, kv_dtype

    kw = dict(
        block_size=args.block_size,
        top_k_blocks=args.top_k_blocks,
        fetch_cap=args.fetch_cap,
        kv_dtype=kv_dtype(args),
        host_kv_dtype=host_kv_dtype(args),
    )
    if args.sparse_threshold is not None:
        kw["sparse_threshold"] = args.sparse_threshold
    # The Quest selection: key codes are not staged yet (PrefillWorker). Both nodes take this one.
    return KvConfig.fast(**kw)


def _dtypes(args, model) -> dict:
    """The pages' and the host tier's storage, named as fig11 names them (the model's dtype where
    the KvConfig leaves it)."""
    kv = _kv(args)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"kv_dtype": kv.kv_dtype or dtype, "host_kv_dtype": kv.host_kv_dtype or kv.kv_dtype or dtype}


# ---------------------------------------------------------------------- the prefill process
def _prefill_main(conn, args, url: str) -> None:
    """The prefill node: for each ``("row", jobs)`` message, prefill every job at its arrival
    time (``start + offset``, wall clock) and send ``("staged", i, handle_json, arrival,
    staged_at)``; ``("row_done",)`` after the last; ``("stop",)`` ends. Errors go back as
    ``("error", text)``."""
    try:
        from ..disagg import PrefillWorker
        from .fig11 import build_model

        model, _, _ = build_model(args)
        worker = PrefillWorker(
            model,
            _kv(args),
            url,
            timeout_s=args.timeout,
            admission=args.admission,
            first_query=args.first_query,
        )
        conn.send(("ready",))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, start, jobs = msg
            for i, (offset, prompt) in enumerate(jobs):
                arrival = start + offset
                delay = arrival - time.time()
                if delay > 0:
                    time.sleep(delay)
                h = worker.prefill(prompt)
                conn.send(("staged", i, h.to_json(), arrival, time.time()))
            conn.send(("row_done",))
        worker.close()
    except BaseException as e:  # the parent reports it; a traceback here would be lost
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def _recv(conn, timeout: float):
    if not conn.poll(timeout):
        raise TimeoutError(f"the prefill process sent nothing for {timeout:.0f} s")
    try:
        msg = conn.recv()
    except EOFError:
        raise RuntimeError("the prefill process exited without a word (killed? out of memory?)") from None
    if msg[0] == "error":
        raise RuntimeError(f"the prefill process failed: {msg[1]}")
    return msg


# ---------------------------------------------------------------------- one row
def _prompts(vocab: int, n_tokens: int, count: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(n_tokens)] for _ in range(count)]


def arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Poisson arrival offsets in seconds (the first at 0), seeded by ``seed`` alone."""
    g = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += g.expovariate(rate)
    return out


def _log(line: str) -> None:
    """Progress on stderr, flushed: a row can take minutes and a killed run keeps its log."""
    print(line, file=sys.stderr, flush=True)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def decode_engine(model, args, url: str, transfer: str):
    """The decode node's engine for every row of one mode, its pools reserved up front for
    ``max_num_seqs`` requests: growing a pinned host pool mid-row stalls the loop (about 0.6 s per
    GiB pinned, and the captured graphs are dropped with the old pools), which a serving engine
    pays once, not per row. ``local``: the same engine without a KV source (it prefills itself)."""
    from ..engine import core
    from ..llm_engine import LLMEngine

    core.IN_STEP_TRANSFER_STREAM = bool(args.transfer_stream)  # read as the engine is made
    n = args.max_num_seqs or args.requests
    staged = {}
    if transfer != "local":
        staged = dict(
            kv_source=url,
            kv_transfer=transfer,
            kv_timeout_s=args.timeout,
            kv_cache_blocks=args.kv_cache_blocks if transfer == "partial" else None,
            kv_prefetch=args.kv_prefetch,
            kv_in_step_reads=args.kv_in_step_reads if transfer == "partial" else False,
        )
    eng = LLMEngine(
        model,
        kv=_kv(args),
        backend="oasis",
        drafter="ngram",
        max_num_seqs=n,
        host_kv_budget_bytes=_bytes(args.host_kv_budget),
        enforce_eager=not args.cuda_graph,  # this benchmark's graphs stay opt-in (its published runs)
        output_kind="delta",
        **staged,
    )
    eng.reserve_pools([(args.prompt_tokens, args.max_tokens)] * n)
    if args.read_connections is not None and eng.kv_source is not None:
        eng.kv_source.read_connections = args.read_connections
    return eng


@dataclasses.dataclass
class _Row:
    """One row's clocks and tokens per request id, in arrival order (``order``)."""

    start: float
    order: list[str] = dataclasses.field(default_factory=list)
    arrival: dict[str, float] = dataclasses.field(default_factory=dict)
    staged_at: dict[str, float] = dataclasses.field(default_factory=dict)
    add_s: dict[str, float] = dataclasses.field(default_factory=dict)
    node_s: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    first: dict[str, float] = dataclasses.field(default_factory=dict)
    done: dict[str, float] = dataclasses.field(default_factory=dict)
    tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    all_added: bool = False


def _take_staged(eng, conn, row: _Row, params) -> None:
    """Add every request the prefill process has handed over since the last call."""
    from ..disagg import StagedRequest

    while conn.poll(0):
        msg = _recv(conn, 0)
        if msg[0] == "row_done":
            row.all_added = True
            continue
        _, i, handle, arr, st = msg
        h = StagedRequest.from_json(handle)
        t_add = time.time()
        rid = eng.add_staged_request(h, params, request_id=f"r{i}")
        row.add_s[rid] = time.time() - t_add
        row.arrival[rid], row.staged_at[rid] = arr, st
        row.node_s[rid] = (h.prefill_s, h.stage_s)
        row.order.append(rid)
        _log(
            f"  {rid}: arrived at +{arr - row.start:.2f} s, prefill {h.prefill_s:.2f} s + stage "
            f"{h.stage_s:.2f} s, handed over after {st - arr:.2f} s; add_staged_request "
            f"{row.add_s[rid]:.2f} s"
        )


def _take_local(eng, jobs: list, row: _Row, params) -> None:
    """``local``: add every request whose arrival time has come (the engine prefills it in its
    next step); ``jobs`` is the schedule still to come, consumed from the front."""
    while jobs and row.start + jobs[0][1] <= time.time():
        i, offset, prompt = jobs.pop(0)
        t_add = time.time()
        rid = eng.add_request(prompt, params, request_id=f"r{i}")
        row.add_s[rid] = time.time() - t_add
        row.arrival[rid] = row.staged_at[rid] = row.start + offset
        row.order.append(rid)
    row.all_added = not jobs


def run_row(eng, args, conn, transfer: str, rate: float, prompts) -> dict:
    """One (mode, rate) point through ``eng`` (idle): the prefill process's schedule, or, for
    ``local``, the same arrivals added to ``eng`` itself. The source's traffic counters are
    reported as this row's deltas, its peak from this row on."""
    from ..llm_engine import SamplingParams

    n = len(prompts)
    src = eng.kv_source
    stats0 = dataclasses.replace(src.stats) if src is not None else None
    coord0 = src.coordinator_stats if src is not None else None
    graphs0 = dict(eng.engine.graph_stats)
    gpu_wait0, _ = eng.engine.transfer_wait()
    if src is not None:
        src.stats.peak_cached_bytes = src.stats.cached_bytes
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    offsets = arrivals(rate, n, args.seed)
    row = _Row(start=time.time() + 0.5)  # time for the prefill process to read the jobs
    _log(f"disagg: {transfer} at {rate:g} req/s, {n} requests of {len(prompts[0])} tokens")
    jobs = [(i, off, p) for i, (off, p) in enumerate(zip(offsets, prompts, strict=True))]
    if transfer != "local":
        conn.send(("row", row.start, [(off, p) for _, off, p in jobs]))
    peak_rows = 0
    step_waits, last_wait = [], gpu_wait0  # the compute stream's wait in each step (s)
    step_s = []  # each eng.step() call's time (s)
    while not (row.all_added and len(row.done) == n):
        if transfer == "local":
            _take_local(eng, jobs, row, params)
        else:
            _take_staged(eng, conn, row, params)
        if eng.has_unfinished_requests():
            t_step = time.perf_counter()
            outs = eng.step()
            step_s.append(time.perf_counter() - t_step)
            peak_rows = max(peak_rows, eng.engine.runtime.reserved[2])
            wait = eng.engine.transfer_wait()[0]  # the step's tokens are on the host: no stall
            step_waits.append(wait - last_wait)
            last_wait = wait
            _note_outputs(outs, row)
        elif not row.all_added or len(row.done) < n:
            if transfer == "local":
                time.sleep(0.005)
            else:
                conn.poll(0.005)  # idle until the next staged request
    replays = eng.engine.graph_stats["replays"] - graphs0["replays"]
    eager = eng.engine.graph_stats["eager"] - graphs0["eager"]
    steps = replays + eager
    out = _row_timing(row, transfer, rate)
    out |= _row_traffic(eng, stats0, coord0, steps)
    gpu_wait_s = last_wait - gpu_wait0  # read after every step above
    out |= {
        # Host pool rows the admitted requests reserved at most (what the pinned pool must
        # hold): rows a partial transfer reserves but never fills count, unless
        # --kv-cache-blocks bounds them.
        "host_reserved_peak_bytes": peak_rows * eng.engine.host_row_bytes_all_layers,
        # Decode steps replayed from captured graphs, and run eagerly.
        "graph_replays": replays,
        "eager_steps": eager,
        "graph_error": eng.engine.graph_error,
        # The critical path: how long the compute stream itself was held per step waiting on the
        # background streams (their gathers, and the reads those wait for), as Engine.transfer_wait
        # measures it; the partial rows' excess over the full rows' is what late blocks cost.
        "gpu_wait_ms_per_step": gpu_wait_s / steps * 1e3 if steps else None,
        # Its spread over the steps: a few long waits (a few steps' late reads) against a wait
        # in every step (reads that lag throughout).
        "gpu_wait_p50_ms": 1e3 * statistics.median(step_waits) if step_waits else None,
        "gpu_wait_max_ms": 1e3 * max(step_waits) if step_waits else None,
        # The loop's eng.step() time, median: per-request TPOT p50 over a few staggered requests
        # moves with how their decode overlapped the admissions; the median step does not.
        "step_p50_ms": 1e3 * statistics.median(step_s) if step_s else None,
        "tokens": [row.tokens[f"r{i}"] for i in range(n)],
    }
    return out


def _note_outputs(outs, row: _Row) -> None:
    """A step's outputs into ``row``: first-token and finish clocks, the tokens."""
    for o in outs:
        now = time.time()
        if o.new_token_ids:
            if o.request_id not in row.first:
                row.first[o.request_id] = now
                _log(f"  {o.request_id}: first token at +{now - row.start:.2f} s")
            row.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            _log(f"  {o.request_id}: done at +{now - row.start:.2f} s ({len(row.done) + 1}/{len(row.order)})")
            if o.finish_reason != "length":
                raise RuntimeError(f"request {o.request_id} ended with {o.finish_reason}: {o.error}")
            row.done[o.request_id] = now


def _row_timing(row: _Row, transfer: str, rate: float) -> dict:
    """Throughput and latencies of a finished row."""
    order = row.order
    span = max(row.done.values()) - min(row.arrival.values())
    made = sum(len(row.tokens[r]) for r in order)
    ttft = [row.first[r] - row.arrival[r] for r in order]
    admit = [row.first[r] - row.staged_at[r] for r in order]
    tpot = [(row.done[r] - row.first[r]) / (len(row.tokens[r]) - 1) for r in order if len(row.tokens[r]) > 1]
    staged = bool(row.node_s)
    return {
        "transfer": transfer,
        "rate": rate,
        "requests": len(order),
        "output_tokens": made,
        "tokens_per_s": made / span if span > 0 else None,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "admit_p50_s": _pct(admit, 0.5),
        "tpot_p50_s": _pct(tpot, 0.5),
        # The prefill node's service time per request (its capacity is about 1 / the sum)
        # and how long handing a request to the decode engine blocked its loop (None: local).
        "prefill_p50_s": _pct([row.node_s[r][0] for r in order], 0.5) if staged else None,
        "stage_p50_s": _pct([row.node_s[r][1] for r in order], 0.5) if staged else None,
        "add_staged_p50_s": _pct([row.add_s[r] for r in order], 0.5) if staged else None,
    }


#: The source's counters a row reports as its deltas.
_DELTAS = (
    "requests",
    "admission_bytes",
    "fetched_bytes",
    "kv_bytes",
    "failures",
    "read_seconds",
    "wait_seconds",
    "miss_entries",
    "prefetched_entries",
    "prefetch_hits",
)


def _row_traffic(eng, stats0, coord0, steps: int) -> dict:
    """The KV source's traffic over a row (nothing crosses a network in a ``local`` row)."""
    src = eng.kv_source
    if src is None:
        zero = dict.fromkeys(
            ("admission_bytes_per_request", "fetched_bytes_per_request", "kv_bytes_per_request", "failures"),
            0,
        )
        return zero | {
            "peak_host_kv_bytes": None,
            "miss_entries": 0,
            "prefetched_entries": 0,
            "prefetch_hits": 0,
            "kv_in_step_reads": False,
            "read_ms_per_step": None,
            "wait_ms_per_step": None,
            "coord_read_ms_per_step": None,
        }
    now = src.stats
    stats = dataclasses.replace(now, **{f: getattr(now, f) - getattr(stats0, f) for f in _DELTAS})
    coord_read_s = src.coordinator_stats["read_seconds"] - coord0["read_seconds"]
    per = max(1, stats.requests)
    return {
        "admission_bytes_per_request": stats.admission_bytes / per,
        "fetched_bytes_per_request": stats.fetched_bytes / per,
        "kv_bytes_per_request": stats.kv_bytes / per,
        "peak_host_kv_bytes": stats.peak_cached_bytes,
        "failures": stats.failures,
        # Block-heads the steps read themselves, read ahead in the background (kv_prefetch),
        # and of those, later planned by a step.
        "miss_entries": stats.miss_entries,
        "prefetched_entries": stats.prefetched_entries,
        "prefetch_hits": stats.prefetch_hits,
        # Whether this row's steps read their misses during the step (the engine's choice).
        "kv_in_step_reads": src.in_step_reads,
        # The decode loop's seconds in decode-time reads per step; overlap: its seconds blocked
        # on late layers per step, and the coordinator's threads' seconds on reads (off the loop).
        "read_ms_per_step": stats.read_seconds / steps * 1e3 if steps else None,
        "wait_ms_per_step": stats.wait_seconds / steps * 1e3 if steps else None,
        "coord_read_ms_per_step": coord_read_s / steps * 1e3 if steps else None,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _bytes(s: str | None) -> int | None:
    if s is None:
        return None
    from .fig11 import parse_bytes

    return parse_bytes(s)


# ---------------------------------------------------------------------- the sweep
def run(args, on_row=None) -> dict:
    from ..staging_daemon import StagingDaemon
    from .fig11 import build_model

    daemon = None
    url = args.kv_source
    if url is None:
        daemon = StagingDaemon(args.daemon, transport=args.transport, memory=args.daemon_memory)
        url = daemon.url
    ctx = mp.get_context("spawn")  # CUDA in the child: never fork a process that holds it
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_main, args=(child, args, url), daemon=True)
    proc.start()
    try:
        model, name, dev = build_model(args)
        _recv(parent, READY_TIMEOUT_S)
        vocab = model.config.vocab_size
        rows = []
        for transfer in args.transfers:
            eng = decode_engine(model, args, url, transfer)
            try:
                # Warm-up: one request through this mode (kernels, allocator); not reported.
                warm = _prompts(vocab, args.prompt_tokens, 1, args.seed + 1)
                run_row(eng, args, parent, transfer, 1.0, warm)
                for rate in args.rates:
                    prompts = _prompts(vocab, args.prompt_tokens, args.requests, args.seed)
                    r = run_row(eng, args, parent, transfer, rate, prompts)
                    print(
                        f"disagg: {transfer} at {rate:g} req/s: {r['tokens_per_s']:.1f} tok/s, "
                        f"TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms, peak host KV "
                        f"{_mib(r['peak_host_kv_bytes'])}",
                        file=sys.stderr,
                    )
                    rows.append(r)
                    if on_row is not None:  # a sweep cut short by a time limit keeps its rows
                        on_row(_report(args, url, name, dev, rows, _dtypes(args, model)))
            finally:
                if eng.kv_source is not None:
                    eng.kv_source.close()  # its daemon connection; the engine's pools go with it
        return _report(args, url, name, dev, rows, _dtypes(args, model))
    finally:
        try:
            parent.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        if daemon is not None:
            daemon.close()


def _report(args, url: str, name: str, dev, rows: list[dict], dtypes: dict) -> dict:
    """The report of the rows made so far; the rows keep their tokens for later comparisons.
    ``dtypes``: :func:`_dtypes`, named in the header's ``kv`` and in every row."""
    out = []
    for r in rows:
        ref = next(x for x in rows if x["rate"] == r["rate"])  # the first mode's row at this rate
        same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"], strict=True))
        keep = {k: v for k, v in r.items() if k != "tokens"}
        out.append(keep | dtypes | {"same_tokens": same / len(r["tokens"])})
    # Staged KV held at peak against the first staged mode's row at the same rate (a local row
    # stages nothing).
    first_staged = next((t for t in args.transfers if t != "local"), None)
    for r in out:
        b = next((x for x in out if x["transfer"] == first_staged and x["rate"] == r["rate"]), None)
        peak, base = r["peak_host_kv_bytes"], b["peak_host_kv_bytes"] if b else None
        r["peak_host_kv_vs_first"] = peak / base if peak is not None and base else None
    return {
        "bench": "disagg",
        "model": name,
        "device": str(dev),
        "kv_source": url,
        "transport": "ucx" if url.startswith("oasis-rt+ucx://") else "tcp",
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "kv": {
            "block_size": args.block_size,
            "top_k_blocks": args.top_k_blocks,
            "fetch_cap": args.fetch_cap,
            "kv_cache_blocks": args.kv_cache_blocks,
            "first_query": args.first_query,
            "kv_prefetch": _prefetch(args),
            # Whether the partial rows read their misses in the step, as their engines did.
            "kv_in_step_reads": any(r["kv_in_step_reads"] for r in out if r["transfer"] == "partial"),
            "transfer_stream": bool(args.transfer_stream),
            **dtypes,
        },
        "cuda_graph": args.cuda_graph,
        "rows": out,
    }


def markdown(rep: dict) -> str:
    mib = 2**20

    def f(v, scale=1.0, d=1):
        return "-" if v is None else f"{v * scale:.{d}f}"

    in_step = ""
    if rep["kv"].get("kv_in_step_reads"):
        in_step = "; partial rows read their misses in the step (--kv-in-step-reads, the default)"
    lines = [
        f"## Disaggregated prefill/decode (Fig. 12): {rep['model']}, {rep['device']}, "
        f"over {rep['transport']}",
        "",
        f"- {rep['requests']} requests of {rep['prompt_tokens']} prompt tokens and {rep['max_tokens']} new "
        f"tokens per rate; K = {rep['kv']['top_k_blocks']} blocks of {rep['kv']['block_size']}, fetch cap "
        f"{rep['kv']['fetch_cap']}; KV pages {rep['kv']['kv_dtype']}, host pool and staged blocks "
        f"{rep['kv']['host_kv_dtype']}; daemon {rep['kv_source']}{in_step}",
        "",
        "| transfer | req/s | tok/s | TTFT p50 ms | TTFT p99 ms | admit p50 ms | TPOT p50 ms | "
        "admission MiB/req | fetched MiB/req | peak host KV MiB | vs first staged | host rows MiB | "
        "same tokens | prefill + stage s | read ms/step | wait ms/step | GPU wait ms/step | "
        "GPU wait p50 / max ms | step p50 ms | graph / eager steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        lines.append(
            f"| {r['transfer']} | {r['rate']:g} | {f(r['tokens_per_s'])} | {f(r['ttft_p50_s'], 1e3)} | "
            f"{f(r['ttft_p99_s'], 1e3)} | {f(r['admit_p50_s'], 1e3)} | {f(r['tpot_p50_s'], 1e3, 2)} | "
            f"{f(r['admission_bytes_per_request'], 1 / mib, 2)} | "
            f"{f(r['fetched_bytes_per_request'], 1 / mib, 2)} | "
            f"{f(r['peak_host_kv_bytes'], 1 / mib)} | {f(r['peak_host_kv_vs_first'], 1, 3)} | "
            f"{f(r['host_reserved_peak_bytes'], 1 / mib)} | "
            f"{r['same_tokens']:.0%} | {f(r['prefill_p50_s'], 1, 2)} + {f(r['stage_p50_s'], 1, 2)} | "
            f"{f(r.get('read_ms_per_step'), 1, 2)} | {f(r.get('wait_ms_per_step'), 1, 2)} | "
            f"{f(r.get('gpu_wait_ms_per_step'), 1, 2)} | "
            f"{f(r.get('gpu_wait_p50_ms'), 1, 2)} / {f(r.get('gpu_wait_max_ms'), 1, 1)} | "
            f"{f(r.get('step_p50_ms'), 1, 2)} | "
            f"{r.get('graph_replays', '-')} / {r.get('eager_steps', '-')} |"
        )
    lines += [
        "",
        "- peak host KV: the bytes of staged KV the decode side held at most (filled rows); host rows: "
        "the host pool rows its admitted requests reserved at most (with a partial transfer, a row "
        "for every block unless --kv-cache-blocks bounds them); vs first staged: the peak against the "
        "first staged mode's at the same rate. A local row (the single-process engine) stages nothing "
        "and reads nothing over the network: its host pool holds every block, as a full transfer's.",
        "- admit: from the prefill node's hand-over to the first token; prefill + stage: the prefill "
        "node's service time per request (p50), so it keeps up with about 1 / their sum requests/s.",
        "- read ms/step: the decode loop's time handing decode-time reads to the coordinator per step "
        "(plans copied to the host, submission, the layer-by-layer reads' waits); wait ms/step: its "
        "time blocked on late layers (wait_for_layer_load); the reads themselves run on the "
        "coordinator's threads (coord_read_ms_per_step in the JSON); graph / eager: decode steps "
        "replayed from captured CUDA graphs and run eagerly. With --kv-in-step-reads the partial rows' "
        "reads run during the step: read ms/step is the loop's time handing each step's block table "
        "over, wait ms/step the time the layers' streams were held on the GPU by late reads "
        "(wait_epoch, summed over the layers, which wait side by side, so it overstates the delay); GPU "
        "wait ms/step: the critical path, the time the compute stream itself was held waiting on the "
        "background streams (Engine.transfer_wait: at each layer in eager steps, at the step's join in "
        "CUDA-graph steps; 0 on the CPU). The partial rows' excess over the full rows' is what late "
        "blocks cost the step. GPU wait p50 / max: its median and longest single step (a long "
        "maximum over a small median: a few steps' late reads; a median near the mean: late reads "
        "in every step, as s31 measured). step p50: "
        "the decode loop's median eng.step() time, steadier than TPOT p50 over a few staggered "
        "requests (whose decode overlaps the admissions differently from run to run).",
        "- same tokens: requests whose whole output equals the first mode's at the same rate. Each row "
        "batches requests differently, so with random bf16 weights near-tied logits may flip. A staged "
        "request's first working set is selected by --first-query: 'prompt' is the single-process "
        "engine's choice (equal tokens to a local row), 'first_token' (the default, the paper's) the "
        "first token's own, which equals it only where the budget holds the whole context.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from ..errors import OasisError

    args = build_parser().parse_args(argv)

    def write(rep: dict) -> None:
        if args.md:
            Path(args.md).write_text(markdown(rep))
        if args.json:
            Path(args.json).write_text(json.dumps(rep, indent=2))

    try:
        rep = run(args, on_row=write)
    except (OasisError, ValueError) as e:
        print(f"bench.disagg: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, EOFError) as e:  # the prefill process failed or died
        print(f"bench.disagg: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(markdown(rep))
    write(rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
