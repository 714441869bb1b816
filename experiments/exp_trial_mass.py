"""Where a lost retrieval trial loses: per answer token and layer, the share of the true
attention each block set holds, teacher-forced on dense's own answer.

    python3 experiments/exp_trial_mass.py --results results/eval/s10-2026-12-02/results.json --task needle \\
        --lost-by eagle3+codes2 --only 46,131 --drafter eagle3+codes2 --drafter-budget 1/4 --threads 2

For each rebuilt trial (see exp_hard_trials.py): dense generates the answer; the prompt plus that
answer is teacher-forced through dense and through OasisKV (``TeacherForcing`` with
``mass_every=1``), and per answer token it prints the NLL of dense's token under both, and per
layer the share of the true query's attention (averaged over KV heads) held by the exact top-K,
the predicted set, the resident working set and the K blocks of most attention. The layers where
the predicted or resident share falls far below the exact top-K's at the token OasisKV gets wrong
are where a copy is lost. Runs on the CPU in float32 unless told otherwise.
"""

from __future__ import annotations

import argparse
import sys
from fractions import Fraction

import torch
from exp_hard_trials import add_trial_arguments, rebuild_trials

from oasiskv import KvConfig
from oasiskv.eval import retrieval
from oasiskv.eval.harness import budget_blocks, load
from oasiskv.eval.teacher import Policy, TeacherForcing
from oasiskv.llm import LLM


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trial_arguments(ap)
    ap.add_argument("--drafter", default="eagle3+codes2", help="the OasisKV drafter spec to measure")
    ap.add_argument("--drafter-budget", default="1/4", help="its budget, a fraction of the context")
    ap.add_argument("--cap", type=float, default=0.05)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, tok, head, _ = load(args, device)
    trials = rebuild_trials(args, tok)
    c, b = args.context, args.block_size
    pages = -(-(c + 64) // b) + 2
    dense = LLM(model, tokenizer=tok, kv=KvConfig(block_size=b, num_gpu_pages=pages), backend="dense")
    k = budget_blocks(c, float(Fraction(args.drafter_budget)), b, args.drafter_budget)
    for t in trials:
        i = t["trial"]
        prompt = tok.encode(t["prompt"])
        out = dense.generate([prompt], max_new_tokens=t["max_new_tokens"], temperature=0.0)[0]
        answer = list(out.tokens)
        if not retrieval.score(args.task, t["answer"], out.text):
            print(f"trial {i}: dense loses it here ({out.text.strip()[:24]!r}); skipped", flush=True)
            continue
        # Teacher-force the answer's tokens up to and including the last digit and one more.
        steps = min(len(answer), 12)
        text = prompt + answer[:steps]
        runner = TeacherForcing(
            model,
            [text],
            steps - 1,
            block_size=b,
            batch_size=1,
            eagle3_head=head,
            progress=False,
            mass_every=1,
        )
        d = runner.run(Policy("dense"))
        o = runner.run(Policy("oasis", drafter=args.drafter, top_k_blocks=k, fetch_cap=args.cap))
        print(f"\ntrial {i} depth {t['depth']:g} answer {t['answer']}; dense wrote {out.text.strip()[:24]!r}")
        print("answer tokens:", [tok.decode([x]) for x in answer[:steps]])
        print("step  nll dense  nll oasis   top-1 agrees with dense")
        for j in range(d.nll.shape[0]):
            agree = bool(o.top1_agree[j, 0]) if o.top1_agree is not None else None
            print(f"{j:4d} {float(d.nll[j, 0]):9.3f}  {float(o.nll[j, 0]):9.3f}   {agree}")
        if o.mass is None:
            continue
        # mass [S', L, n, 4]: exact top-K / predicted / resident / best-K shares per measured step.
        for jj, step in enumerate(o.measured_steps):
            m = o.mass[jj, :, 0]  # [L, 4]
            worst = torch.argsort(m[:, 2] - m[:, 0])[:6].tolist()
            cells = "  ".join(
                f"L{L}: ex {m[L, 0]:.2f} pr {m[L, 1]:.2f} res {m[L, 2]:.2f} best {m[L, 3]:.2f}" for L in worst
            )
            print(f"  step {step}, the six layers where residency loses most: {cells}")
            print(
                f"    mean over layers: exact {m[:, 0].mean():.3f} predicted {m[:, 1].mean():.3f} "
                f"resident {m[:, 2].mean():.3f} best {m[:, 3].mean():.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
