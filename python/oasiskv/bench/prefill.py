"""Prefill benchmark: the engine's prefill of one long prompt against a plain SDPA forward.

    python -m oasiskv.bench.prefill [--preset qwen3-8b | --model DIR] [--tokens 16384]
        [--device cuda] [--dtype bfloat16] [--chunk 8192] [--repeat 3] [--json out.json]
    python -m oasiskv.bench.prefill --preset tiny --tokens 256 --device cpu    # smoke test

The ceiling is measured in the same run, on the same model: one forward of the prompt through
:class:`~oasiskv.models.CausalLM` with :func:`~oasiskv.models.dense_causal_attn` (torch SDPA, no
cache, last row's logits). Against it:

* ``engine_prefill``: ``Engine.prefill`` of the prompt as one piece, on the dense backend of an
  :class:`~oasiskv.LLMEngine` (admission, the forward, every layer's K/V written into its pages,
  release);
* ``engine_prefill_chunked``: the same prompt through ``Engine.prefill_chunk`` in ``--chunk``-token
  pieces, as ``LLMEngine`` prefills a prompt longer than ``max_num_batched_tokens`` (default: its
  default budget); absent when the prompt fits one chunk.

``--backend oasis`` runs both on the OasisKV backend, where a prompt past the sparse threshold is
admitted sparse (``Engine.prefills_sparse``): each layer goes to the host pool, the chunks read
the earlier positions back from there, and the initial working sets are selected. Each row then
says whether it was admitted sparse (``admitted_sparse``); its peak memory is what the prefill took
beside the weights and pools, so one piece against chunks shows the read-back's time and memory.

Each is run ``--warmup`` times, then timed ``--repeat`` times (``perf_counter`` between device
synchronisations); the median is reported with tokens/s, the speed ratio to the SDPA forward
(issue 10's target: >= 0.8), the peak device memory and the largest logit difference to the
forward. Presets (:data:`oasiskv.models.config.PRESETS`) carry published model shapes and get
random weights, so no checkpoint is needed.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import statistics
import sys
import time

import torch

from ..models.random_weights import random_model

#: Issue 10's target for the engine's prefill: this fraction of the SDPA forward's speed or more.
TARGET_RATIO = 0.8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device: torch.device, warmup: int, repeat: int) -> dict:
    """Median seconds of ``fn()`` over ``repeat`` runs after ``warmup``, with the peak device
    memory of the timed runs (None on the CPU) and what ``fn`` returned last."""
    for _ in range(warmup):
        fn()
    _sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    times = []
    out = None
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return {
        "s": statistics.median(times),
        "times_s": times,
        "peak_mem_bytes": peak,
        # Above what was allocated before the timed runs (the weights, and the engine's pools).
        "peak_extra_bytes": peak - before if cuda else None,
        "out": out,
    }


def run(args) -> dict:
    """Build the model and engine, time the three prefills, return the results (JSON-ready)."""
    from oasiskv import KvConfig, LLMEngine
    from oasiskv.devices import compute_dtype, resolve_device
    from oasiskv.engine import Request
    from oasiskv.models.config import preset_config
    from oasiskv.models.transformer import dense_causal_attn

    device = resolve_device(args.device)
    dev = torch.device(device)
    dtype = getattr(torch, args.dtype) if args.dtype else compute_dtype(device)
    if args.model:
        from oasiskv.models.loader import load_model

        model, _ = load_model(args.model, dtype=dtype, device=device)
        name = args.model
    else:
        model = random_model(preset_config(args.preset), dtype, device, args.seed)
        name = args.preset
    model.eval()
    n = args.tokens
    model.check_context_length(n)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.vocab_size, (n,), generator=gen).tolist()
    ids = torch.tensor(prompt, dtype=torch.long, device=dev)
    pos = torch.arange(n, device=dev)
    last = torch.tensor([n - 1], device=dev)

    @torch.no_grad()
    def sdpa_forward():
        return model(ids, pos, dense_causal_attn(scale=model.attn_scale), logits_rows=last)[0][0]

    llm = LLMEngine(
        model,
        kv=KvConfig(block_size=args.block_size),
        backend=args.backend,
        drafter=None,
        max_num_seqs=1,
        max_num_batched_tokens=min(args.chunk, 1 << 20),
    )
    eng = llm.engine
    rids = itertools.count()
    sparse: dict[int, bool] = {}

    def engine_prefill(chunk: int):
        r = Request(id=next(rids), prompt=prompt, max_new_tokens=1)
        try:
            for a in range(0, n, chunk):
                logits = eng.prefill_chunk(r, a, min(n, a + chunk))
            sparse[chunk] = r.sparse
        finally:
            eng.release(r)
        return logits

    rows = {"sdpa_forward": measure(sdpa_forward, dev, args.warmup, args.repeat)}
    rows["engine_prefill"] = measure(lambda: engine_prefill(n), dev, args.warmup, args.repeat)
    if args.chunk < n:
        rows["engine_prefill_chunked"] = measure(
            lambda: engine_prefill(args.chunk), dev, args.warmup, args.repeat
        )
    ref = rows["sdpa_forward"]
    res: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "model": name,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": n,
        "block_size": args.block_size,
        "chunk": args.chunk if args.chunk < n else None,
        "backend": args.backend,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "target": f">= {TARGET_RATIO} x the SDPA forward's speed",
    }
    for key, m in rows.items():
        row = {k: v for k, v in m.items() if k != "out"}
        row["ms"] = m["s"] * 1e3
        row["tokens_per_s"] = n / m["s"]
        if key != "sdpa_forward":
            row["admitted_sparse"] = sparse[n if key == "engine_prefill" else args.chunk]
            row["ratio_to_sdpa"] = ref["s"] / m["s"]
            row["max_abs_logit_diff"] = float((m["out"].float() - ref["out"].float()).abs().max())
        res[key] = row
    return res


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB"


def report(res: dict) -> None:
    print(
        f"{res['device']}  {res['model']}  {res['dtype']}  {res['tokens']} tokens  block {res['block_size']}"
        f"  backend {res['backend']}"
    )
    for key in ("sdpa_forward", "engine_prefill", "engine_prefill_chunked"):
        r = res.get(key)
        if r is None:
            continue
        label = key + (f" ({res['chunk']})" if key == "engine_prefill_chunked" else "")
        parts = [f"{label:<32} {r['ms']:10.1f} ms  {r['tokens_per_s']:12,.0f} tok/s"]
        if r["peak_mem_bytes"] is not None:
            parts.append(
                f"peak {_gib(r['peak_mem_bytes'])} (+{_gib(r['peak_extra_bytes'])} over weights/pools)"
            )
        if "ratio_to_sdpa" in r:
            if r["admitted_sparse"]:
                parts.append("admitted sparse")
            parts.append(f"ratio {r['ratio_to_sdpa']:.2f}  logit err {r['max_abs_logit_diff']:.1e}")
            parts.append(f"[target {res['target']}]")
        print("  ".join(parts))


def main(argv=None) -> int:
    from oasiskv import LLMEngine
    from oasiskv.models.config import PRESETS

    default_chunk = inspect.signature(LLMEngine).parameters["max_num_batched_tokens"].default
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--preset", default="qwen3-8b", choices=sorted(PRESETS), help="model shape, random weights"
    )
    src.add_argument("--model", help="a Hugging Face directory or .gguf file instead of a preset")
    ap.add_argument("--tokens", type=int, default=16384, help="prompt length")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda[:N]")
    ap.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], help="default: bf16 on a GPU, f32 on CPU"
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--backend",
        choices=["dense", "oasis"],
        default="dense",
        help="the engine's backend: oasis admits a long prompt sparse (into the host pool)",
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=default_chunk,
        help=f"chunked-prefill piece (default {default_chunk}: LLMEngine's max_num_batched_tokens)",
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    for flag in ("tokens", "block_size", "chunk", "repeat"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("oasiskv.bench.prefill: --device cuda but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    res = run(args)
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
