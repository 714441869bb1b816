"""Re-run the retrieval trials a selection lost and dense solved, under other selections.

The 8K retrieval gap of issue 12 sits in a handful of trials (ten needle trials in 140). Trials
are a pure function of (task, context, index, depth, seed), so the ones an `oasis eval` run
lost can be rebuilt from its results.json and decoded again, here, with any drafter spec and
budget: a cheap way to try a mechanism on the trials that matter before a full run.

    python3 experiments/exp_hard_trials.py --results results/eval/s10-2026-12-02/results.json \\
        --task needle --lost-by eagle3+codes2 --variants eagle3+codes2@1/4,eagle3+codes2@1/2 \\
        --device cpu --threads 2        # also drafter@budget@none (uncapped), quest-ideal@budget

Prints, per rebuilt trial, dense's and each variant's outcome (1 solved, 0 lost) and the answer
they generated. Runs on the CPU in float32 unless told otherwise, so dense itself may differ from
the H200's bf16 run; such trials are reported and left out of the counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from fractions import Fraction

import torch

from oasiskv import KvConfig
from oasiskv.drafters import Eagle3Drafter
from oasiskv.eval import corpus, retrieval
from oasiskv.eval.harness import budget_blocks, load, parse_caps
from oasiskv.eval.policies import CodesPolicy, ExactPolicy, QuestPolicy
from oasiskv.eval.teacher import parse_drafter
from oasiskv.llm import LLM


def lost_trials(
    results: str, task: str, context: int, lost_by: str, budget: str
) -> tuple[list[int], list[float]]:
    """Indices dense solved and ``lost_by`` at ``budget`` lost, and the run's depths."""
    recs = [r for r in json.load(open(results))["records"] if r.get("section") == "retrieval"]
    pick = [r for r in recs if r["task"] == task and r["context"] == context]
    dense = next((r for r in pick if r["policy"] == "dense"), None)
    ours = next(
        (r for r in pick if r["policy"] == "oasis" and r["drafter"] == lost_by and r["budget"] == budget),
        None,
    )
    if dense is None or ours is None:
        raise SystemExit(f"{results}: no dense and {lost_by} @ {budget} records for {task} at C={context}")
    idx = [
        i
        for i, (d, o) in enumerate(zip(dense["outcomes"], ours["outcomes"], strict=False))
        if d == "1" and o == "0"
    ]
    return idx, dense["depths"]


def add_trial_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments that pick the lost trials and the model, shared with exp_trial_mass.py."""
    ap.add_argument("--results", required=True, help="an oasis eval results.json with retrieval records")
    ap.add_argument("--task", default="needle")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--lost-by", default="eagle3+codes2", help="the drafter whose lost trials to rebuild")
    ap.add_argument("--budget", default="1/4", help="its budget label in the records")
    ap.add_argument("--only", default="", help="only these trial indices (comma separated)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--eagle3", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)


def rebuild_trials(args, tok, max_trials: int = 0) -> list[dict]:
    """The retrieval trials dense solved and ``args.lost_by`` lost in ``args.results`` (those in
    ``args.only``, at most ``max_trials``), rebuilt exactly as ``oasis eval``'s retrieval section
    builds them (same haystack, index, depth and seed)."""
    idx, depths = lost_trials(args.results, args.task, args.context, args.lost_by, args.budget)
    if args.only:
        idx = [i for i in idx if i in {int(x) for x in args.only.split(",")}]
    if max_trials:
        idx = idx[:max_trials]
    print(
        f"{len(idx)} trials of {args.task} at C={args.context} solved by dense, lost by {args.lost_by}: {idx}"
    )
    c = args.context
    files = corpus.list_files(source="stdlib")
    hay = corpus.heldout_texts(
        tok, min(c, 4096) + 1, max(2, -(-c // 4096) + 1), source="stdlib", seed=args.seed + 1, files=files
    )
    lines: list[str] = []
    for h in hay:
        lines += tok.decode(h["tokens"]).splitlines(keepends=True)
    lengths = retrieval._Lengths(tok)
    return [
        retrieval.make_trial(
            args.task,
            tok,
            c,
            i,
            depths[i % len(depths)],
            haystack_lines=lines,
            seed=args.seed,
            lengths=lengths,
        )
        for i in idx
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trial_arguments(ap)
    ap.add_argument(
        "--variants",
        default="eagle3+codes2@1/4",
        help="drafter@budget[@cap] (cap: a fraction, a count or none), quest-ideal@budget (the current "
        "query's top-K by the Quest bound), codes-ideal@budget (by the codes score) or exact-ideal@budget "
        "(by its true attention), comma separated",
    )
    ap.add_argument("--cap", type=float, default=0.05)
    ap.add_argument("--max-trials", type=int, default=0, help="at most this many (0: all)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, tok, head, _ = load(args, device)
    trials = rebuild_trials(args, tok, args.max_trials)
    c, b = args.context, args.block_size
    pages = -(-(c + 1) // b) + 2
    pool_kw = {"block_size": b, "num_gpu_pages": pages, "num_host_blocks": pages}
    variants: list[tuple[str, LLM]] = [
        ("dense", LLM(model, tokenizer=tok, kv=KvConfig(**pool_kw), backend="dense"))
    ]
    for v in args.variants.split(","):
        name, label, *cap = v.strip().split("@")
        k = budget_blocks(c, float(Fraction(label)), b, label)
        ideals = {"quest-ideal": QuestPolicy, "codes-ideal": CodesPolicy, "exact-ideal": ExactPolicy}
        if name in ideals:  # the current query's top-K by that score, all resident
            policy = ideals[name](k)
            llm = LLM(model, tokenizer=tok, kv=KvConfig(**pool_kw), backend="dense", policy=policy)
            variants.append((v.strip(), llm))
            continue
        spec = parse_drafter(name)
        fetch_cap = parse_caps(cap[0])[0] if cap else args.cap
        kv = KvConfig(
            top_k_blocks=k,
            fetch_cap=fetch_cap,
            measure_recall=False,
            **spec.kv_kwargs(),
            **pool_kw,
        )
        if spec.base.startswith("eagle3"):  # as oasis eval's retrieval section builds it
            drafter = Eagle3Drafter(head, model, prefill=spec.base != "eagle3-noprefill")
        else:
            drafter = spec.base
        variants.append((v.strip(), LLM(model, tokenizer=tok, kv=kv, backend="oasis", drafter=drafter)))
    wins = {n: 0 for n, _ in variants}
    counted = 0
    for t in trials:
        ids = tok.encode(t["prompt"])
        row = []
        for name, llm in variants:
            t0 = time.perf_counter()
            out = llm.generate([ids], max_new_tokens=t["max_new_tokens"], temperature=0.0)[0]
            ok = retrieval.score(args.task, t["answer"], out.text)
            row.append((name, int(ok), out.text.strip()[:24], time.perf_counter() - t0))
        dense_ok = row[0][1]
        if dense_ok:
            counted += 1
            for name, ok, _, _ in row:
                wins[name] += ok
        cells = "  ".join(f"{n}={ok} {txt!r}" for n, ok, txt, _ in row)
        print(
            f"trial {t['trial']} depth {t['depth']:g} answer {t['answer']}: {cells}"
            + ("" if dense_ok else "  (dense lost it here: not counted)"),
            flush=True,
        )
    print(
        f"solved, over the {counted} trials dense solves here: "
        + ", ".join(f"{n} {w}" for n, w in wins.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
