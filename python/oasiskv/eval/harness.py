"""``oasis eval``: the accuracy evaluation of OasisKV (lookahead accuracy, decode fidelity, retrieval).

Sections (``--sections``):

* ``teacher`` — teacher-forced runs (:mod:`oasiskv.eval.teacher`) on held-out corpus texts
  (:mod:`oasiskv.eval.corpus`) at each context length: dense, then per budget the Quest-like
  reference and OasisKV with every drafter and fetch cap. Each OasisKV run gives the lookahead
  accuracy per layer (split by whether the draft matched the next token), the decode fidelity
  against dense (NLL change, KL, top-1 agreement) and the bytes fetched per step — the sweep of
  top-K and fetch cap in the shape of the paper's Table 2.
* ``retrieval`` — passkey, needle and key-value retrieval (:mod:`oasiskv.eval.retrieval`) at
  several depths, greedy generation through :class:`oasiskv.LLM`: dense vs OasisKV (and Quest-like)
  per budget.

Results go to ``--out``: ``results.json`` (rewritten after every record, so an interrupted run
keeps what it measured; a later run into the same directory adds or replaces records by their
configuration, so one evaluation can be split over several commands), ``results.md`` and PNG plots
(:mod:`oasiskv.eval.report`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch

from ..config import KvConfig
from ..devices import resolve_device
from . import corpus, report, retrieval
from .teacher import (
    DRAFTERS,
    Policy,
    TeacherForcing,
    drafter_parts,
    greedy_continuations,
    kv_budget_kwargs,
    parse_drafter,
    summarize,
)

#: Train-split texts the ``+layers`` drafters fit their per-layer budgets on (per context).
CALIBRATION_TEXTS = 4


def _calibration(tok, context: int, args, files, drafters) -> list[list[int]] | None:
    """Calibration token lists of ``context`` tokens from the train split (disjoint from every
    evaluation text) when a drafter has ``+layers``, else None."""
    if not any(parse_drafter(d).layers for d in drafters):
        return None
    texts = corpus.heldout_texts(
        tok, context, CALIBRATION_TEXTS, source=args.source, seed=args.seed, files=files, split="train"
    )
    return [t["tokens"] for t in texts]


SCHEMA = "oasiskv-eval/1"

PRESETS: dict[str, dict] = {
    # Minutes on 2 CPU cores with SmolLM2-135M.
    "smoke": {
        "contexts": "512",
        "steps": 16,
        "texts": 1,
        "batch_size": 4,
        "budgets": "1/16,1/8,1/4",
        "caps": "0.05,none",
        "drafters": "eagle3,ngram,oracle,previous-query",
        "retrieval_trials": 2,
        "depths": "0.25,0.75",
        "retrieval_budgets": "1/4",
        "retrieval_contexts": None,
    },
    # The full evaluation (GPU): 4K and 8K, budgets 1/16..1/4, caps 0.05 and uncapped.
    "full": {
        "contexts": "4096,8192",
        "steps": 256,
        "texts": 8,
        "batch_size": 8,
        "budgets": "1/16,1/8,1/4",
        "caps": "0.05,none",
        "drafters": "eagle3,eagle3-noprefill,ngram,oracle,previous-query",
        "retrieval_trials": 200,
        "depths": "0.1,0.3,0.5,0.7,0.9",
        "retrieval_budgets": "1/16,1/8,1/4",
        "retrieval_contexts": None,
    },
}

DEFAULT_HEADS = {"smollm2": "data/eagle3-smollm2"}


# ------------------------------------------------------------------------------------------ args
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a HF Llama/Qwen3 directory")
    p.add_argument(
        "--eagle3",
        default=None,
        help="EAGLE-3 head directory (public checkpoint format); smollm2 default: the bundled head if any",
    )
    p.add_argument("--preset", default="smoke", choices=sorted(PRESETS), help="default sizes (smoke: CPU)")
    p.add_argument("--sections", default="teacher,retrieval", help="comma list of: teacher, retrieval")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],
        help="every run's KV pages (dense included): the model's dtype, or fp8_e4m3 (pages and host "
        "pool in E4M3; compare against a run without it; +hfp8 puts only OasisKV's host pool in fp8)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--out", default="out/eval", help="output directory (results.json, results.md, *.png)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--source", default="stdlib", choices=["stdlib", "all"], help="held-out corpus source")
    p.add_argument("--contexts", default=None, help="teacher-forced context lengths, e.g. 4096,8192")
    p.add_argument("--steps", type=int, default=None, help="teacher-forced decode steps per text")
    p.add_argument(
        "--attn-mass-every",
        type=int,
        default=16,
        help="every N-th measured step, also the share of the true query's exact attention that each "
        "block set covers (reads the whole context per layer on the CPU; 0 = off)",
    )
    p.add_argument(
        "--continuation",
        default="text",
        choices=["text", "greedy"],
        help="what the teacher-forced steps feed: the held-out text (default) or the tokens dense greedy "
        "decoding generates after the text's prefix (drafts then match when they agree with the model)",
    )
    p.add_argument("--texts", type=int, default=None, help="held-out texts per context")
    p.add_argument("--batch-size", type=int, default=None, help="requests decoded together")
    p.add_argument(
        "--budgets", default=None, help="top-K: fractions of the context (1/16,1/8,1/4) or blocks (20b)"
    )
    p.add_argument("--caps", default=None, help="fetch caps: fractions of K, counts, or 'none' (uncapped)")
    p.add_argument(
        "--drafters",
        default=None,
        help=f"comma list of {', '.join(DRAFTERS)}, each optionally followed by, in this order: "
        "+current (the current query also chooses the working set, KvConfig.select_queries), "
        "+fidelity (KvConfig()'s default selection: codes in two stages, sticky candidates, successors, "
        "and the confidence fallback with eagle3; without it a name runs the Quest selection), "
        "+codes (blocks ranked by 2-bit key codes; +codesF: the Quest bound's best F x K of them), "
        "+sinkN (KvConfig(sink_blocks=N): blocks 0..N-1 always selected), "
        "+pinN (KvConfig(pin_blocks=N): the initial selection's best N kept), "
        "+succN (KvConfig(successor_blocks=N)), "
        "+layers or +layersout (KvConfig(layer_blocks): per-layer budgets with the same total, "
        "fitted on train-split text by attention mass or output error), "
        "+top2 (eagle3: also measure lookahead from the head's two best drafts)",
    )
    p.add_argument("--no-quest", action="store_true", help="skip the Quest-like reference")
    p.add_argument(
        "--retrieval-tasks",
        default=",".join(retrieval.DEFAULT_TASKS),
        help=f"comma list of: {', '.join(retrieval.TASKS)} (copy*: exact copy out of a source file)",
    )
    p.add_argument("--retrieval-trials", type=int, default=None, help="trials per task and context")
    p.add_argument("--retrieval-contexts", default=None, help="defaults to --contexts")
    p.add_argument("--retrieval-budgets", default=None, help="budgets of the retrieval runs")
    p.add_argument("--retrieval-cap", default="0.05", help="fetch cap of the retrieval runs")
    p.add_argument(
        "--retrieval-drafter",
        default=None,
        help="drafter of the retrieval runs (default: eagle3 if a head, else ngram)",
    )
    p.add_argument("--depths", default=None, help="needle depths (fractions of the filler before it)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--resume", action="store_true", help="skip configurations already in --out/results.json")
    p.add_argument(
        "--time-limit-min",
        type=float,
        default=None,
        help="start no new run (retrieval: no new trial batch) after this many minutes",
    )
    p.add_argument(
        "--report-only", action="store_true", help="re-render results.md and plots from results.json"
    )
    p.add_argument(
        "--merge",
        nargs="*",
        default=[],
        metavar="RESULTS_JSON",
        help="with --report-only: first merge these results.json files into --out",
    )


def _fill_preset(args) -> None:
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.retrieval_contexts is None:
        args.retrieval_contexts = args.contexts


def parse_fractions(s: str) -> list[tuple[str, float | None]]:
    """Budgets: fractions of the context (``1/16``) or absolute block counts (``20b``, as the
    paper's Fig. 4 top-20); returns (label, fraction or None)."""
    out: list[tuple[str, float | None]] = []
    for x in s.split(","):
        x = x.strip()
        if not x:
            continue
        if x.endswith("b"):
            if not x[:-1].isdigit() or int(x[:-1]) < 1:
                raise ValueError(f"budget {x}: an absolute budget is a block count like 20b")
            out.append((x, None))
            continue
        f = Fraction(x)
        if not 0 < f <= 1:
            raise ValueError(f"budget {x} must be a fraction in (0, 1] or a block count like 20b")
        out.append((x, float(f)))
    return out


def parse_caps(s: str) -> list[float | int | None]:
    out: list[float | int | None] = []
    for x in s.split(","):
        x = x.strip().lower()
        if not x:
            continue
        out.append(None if x in ("none", "uncapped", "inf") else (float(x) if "." in x else int(x)))
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in str(s).split(",") if x.strip()]


def pick_device(spec: str) -> torch.device:
    """``auto``: the GPU when torch sees one and the kernels can run there (as ``oasis demo``), else
    the CPU."""
    return torch.device(resolve_device(spec))


def budget_blocks(context: int, frac: float | None, block_size: int, label: str | None = None) -> int:
    """K in blocks: ``round(context * frac / block_size)`` (at least 1), or the count of a ``20b`` label."""
    if frac is None:
        return int(str(label)[:-1])
    return max(1, round(context * frac / block_size))


# ------------------------------------------------------------------------------------------ results
class Results:
    """results.json: meta of every invocation plus records keyed by their configuration."""

    KEY_FIELDS = (
        "section",
        "context",
        "policy",
        "drafter",
        "budget",
        "fetch_cap",
        "task",
        "block_size",
        "steps",
        "texts",
        "continuation",  # absent for the held-out text; a greedy run must never replace a text run
        "kv_dtype",  # absent for the model's dtype; an fp8 run (--kv-dtype) stands beside it
    )

    def __init__(self, out: Path) -> None:
        self.out = out
        self.path = out / "results.json"
        self.data = {"schema": SCHEMA, "runs": [], "records": []}
        if self.path.is_file():
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("schema") != SCHEMA:
                raise ValueError(f"{self.path} has schema {data.get('schema')!r}, expected {SCHEMA!r}")
            self.data = data

    @classmethod
    def key(cls, rec: dict) -> tuple:
        return tuple(json.dumps(rec.get(k)) for k in cls.KEY_FIELDS)

    def find(self, rec: dict) -> dict | None:
        """The stored record with the configuration of ``rec``, if any."""
        k = self.key(rec)
        return next((r for r in self.data["records"] if self.key(r) == k), None)

    def merge(self, other: dict) -> None:
        """Add another results file's runs and records (records of the same configuration replace)."""
        if other.get("schema") != SCHEMA:
            raise ValueError(f"cannot merge schema {other.get('schema')!r} into {SCHEMA!r}")
        self.data["runs"] += other.get("runs", [])
        for rec in other.get("records", []):
            self.add(rec)

    def add_run(self, meta: dict) -> None:
        self.data["runs"].append(meta)
        self.save()

    def add(self, rec: dict, save: bool = True) -> None:
        k = self.key(rec)
        recs = [r for r in self.data["records"] if self.key(r) != k]
        recs.append(rec)
        self.data["records"] = recs
        if save:
            self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


def _kv_dtype(args) -> str | None:
    """``--kv-dtype`` as ``KvConfig.kv_dtype`` (None: the model's dtype)."""
    value = getattr(args, "kv_dtype", "auto")
    return None if value == "auto" else value


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=False
        )
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _meta(args, model, device, head_path, files) -> dict:
    from .. import __version__

    c = model.config
    return {
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "model": args.model,
        "model_config": {
            "family": c.family,
            "num_hidden_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab_size,
        },
        "eagle3": head_path,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "oasiskv": __version__,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "corpus_source": args.source,
        "corpus_fingerprint": corpus.fingerprint(files),
    }


# ------------------------------------------------------------------------------------------ loading
def load(args, device: torch.device):
    """(model, tokenizer, eagle3 head or None, head path or None)."""
    from importlib import resources

    from ..models.eagle3 import Eagle3Head
    from ..models.loader import load_model

    dtype = getattr(torch, args.dtype)
    model, tok = load_model(args.model, dtype=dtype, device=device)
    if tok is None:
        raise ValueError(f"{args.model} has no tokenizer.json; the evaluation needs a tokenizer")
    head_path = args.eagle3
    if head_path is None and args.model.lower() in DEFAULT_HEADS:
        cand = resources.files("oasiskv").joinpath(DEFAULT_HEADS[args.model.lower()])
        if cand.is_dir() and cand.joinpath("config.json").is_file():
            head_path = str(cand)
    head = None
    if head_path is not None:
        head = Eagle3Head.load(head_path, model.config, dtype=dtype, device=device).attach_target(model)
        head.eval()
    return model, tok, head, head_path


def _drafters(args) -> list[str]:
    """``--drafters`` as a list; ValueError naming the valid drafters for a bad one."""
    drafters = [d.strip() for d in (args.drafters or "").split(",") if d.strip()]
    for d in drafters:
        drafter_parts(d)
    return drafters


# ------------------------------------------------------------------------------------------ sections
def run_teacher(args, model, tok, head, results: Results, files, progress: bool) -> None:
    from tqdm import tqdm

    drafters = _drafters(args)
    if head is None and any(d.startswith("eagle3") for d in drafters):
        print(
            "oasis eval: no EAGLE-3 head (pass --eagle3 PATH): skipping the eagle3 drafters", file=sys.stderr
        )
        drafters = [d for d in drafters if not d.startswith("eagle3")]
    budgets = parse_fractions(args.budgets)
    caps = parse_caps(args.caps)
    b = args.block_size
    for context in _ints(args.contexts):
        steps = min(args.steps, context // 2)
        texts = corpus.heldout_texts(
            tok, context + 1, args.texts, source=args.source, seed=args.seed, files=files
        )
        token_lists = [t["tokens"] for t in texts]
        calibration = _calibration(tok, context, args, files, drafters)
        greedy = args.continuation == "greedy"
        if greedy:
            token_lists = greedy_continuations(
                model, token_lists, steps, block_size=b, batch_size=args.batch_size, progress=progress
            )
        runner = TeacherForcing(
            model,
            token_lists,
            steps,
            block_size=b,
            batch_size=args.batch_size,
            eagle3_head=head,
            progress=progress,
            mass_every=args.attn_mass_every,
            calibration=calibration,
            kv_dtype=_kv_dtype(args),
        )
        base = {
            "section": "teacher",
            "context": context,
            "steps": steps,
            "texts": len(texts),
            "text_ids": [f"{t['package']}#{t['window']}" for t in texts],
            "block_size": b,
            **({"continuation": "greedy"} if greedy else {}),
            **({"kv_dtype": _kv_dtype(args)} if _kv_dtype(args) else {}),
        }
        # The plan: (policy, budget label, fraction, cap, drafter); skip what --resume finds done.
        plan = []
        for label, frac in budgets:
            if not args.no_quest:
                plan.append(("quest", label, frac, None, None))
            for cap in caps:
                plan += [("oasis", label, frac, cap, d) for d in drafters]

        def key_of(kind, label, frac, cap, d, base=base):
            return {**base, "policy": kind, "budget": label, "fetch_cap": cap, "drafter": d}

        if args.resume:
            plan = [x for x in plan if results.find(key_of(*x)) is None]
            if not plan and results.find(key_of("dense", None, None, None, None)):
                continue
        bar = tqdm(total=1 + len(plan), desc=f"teacher C={context}", unit="run", disable=not progress)
        dense = runner.run(Policy("dense"))
        results.add({**base, "budget": None, "budget_frac": None, **summarize(dense, None)})
        bar.update(1)
        for i, (kind, label, frac, cap, d) in enumerate(plan):
            if deadline.passed():
                bar.write(
                    f"oasis eval: --time-limit-min reached: {len(plan) - i} teacher runs left (--resume)"
                )
                break
            k_blocks = budget_blocks(context, frac, b, label)
            frac = k_blocks * b / context if frac is None else frac
            common = {**base, "budget": label, "budget_frac": frac, "budget_tokens": k_blocks * b}
            if kind == "quest":
                rec = summarize(runner.run(Policy("quest", None, k_blocks)), dense)
                results.add({**common, **rec})
                bar.update(1)
                continue
            res = runner.run(Policy("oasis", d, k_blocks, cap))
            rec = summarize(res, dense)
            rec["cap_blocks"] = KvConfig(block_size=b, top_k_blocks=k_blocks, fetch_cap=cap).cap_blocks
            quest = results.find(key_of("quest", label, frac, None, None))
            if quest is not None:
                rec["nll_quest"] = quest["nll"]
                rec["delta_vs_quest_pct"] = 100.0 * (rec["nll"] - quest["nll"]) / quest["nll"]
            results.add({**common, **rec})
            bar.update(1)
            if progress:
                la = rec.get("lookahead", {})
                bar.write(
                    f"C={context} K={label} cap={cap} {d:15s} overlap={_f(la.get('overlap'))} "
                    + (f"own={_f(la['kept'].get('overlap'))} " if la.get("kept") else "")
                    + f"dNLL={_f(rec.get('delta_nll_pct'))}% KL={_f(rec.get('kl'), 5)} "
                    f"fetch/step={rec['fetched_bytes_per_step'] / 1e6:.3f} MB"
                )
        bar.close()
        del runner


class Deadline:
    """``--time-limit-min``: no new run starts once it has passed (what ran is saved)."""

    def __init__(self, minutes: float | None) -> None:
        self.end = time.perf_counter() + minutes * 60 if minutes else None

    def passed(self) -> bool:
        return self.end is not None and time.perf_counter() > self.end


deadline = Deadline(None)


def _f(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def run_retrieval(args, model, tok, head, results: Results, files, progress: bool) -> None:
    """The retrieval section: per context, every task's trials in batches of ``--batch-size``;
    each batch runs through every variant (dense, then per budget OasisKV and the Quest-like
    reference) before the next, so a prompt is prefilled once (``PrefillCache``) for all of them.

    Each (task, variant) record is rewritten after every batch: ``partial`` (with the trials so
    far) until all ``--retrieval-trials`` ran. ``--time-limit-min`` stops between batches;
    ``--resume`` skips complete records and continues partial ones from their next trial (trials
    are a pure function of their index, so the resumed record equals an uninterrupted one).

    The steps, per context: :func:`_haystack_lines`, the trials, :func:`_retrieval_variants`,
    then :func:`_run_retrieval_context` (the resume state, the batches, the records)."""
    tasks = [t.strip() for t in args.retrieval_tasks.split(",") if t.strip()]
    depths = _floats(args.depths)
    budgets = parse_fractions(args.retrieval_budgets)
    cap = parse_caps(args.retrieval_cap)[0]
    drafter_name = args.retrieval_drafter or ("eagle3" if head is not None else "ngram")
    if drafter_name.startswith("eagle3") and head is None:
        raise ValueError("the eagle3 retrieval drafter needs --eagle3 PATH")
    for context in _ints(args.retrieval_contexts):
        if deadline.passed():
            print(f"oasis eval: --time-limit-min reached before retrieval C={context} (use --resume)")
            return
        lines = _haystack_lines(args, tok, context, files)
        calibration = _calibration(tok, context, args, files, [drafter_name])
        trials = retrieval.make_trials(
            tok, tasks, context, args.retrieval_trials, depths, haystack_lines=lines, seed=args.seed
        )
        variants = _retrieval_variants(
            args, model, tok, head, context, budgets, cap, drafter_name, calibration
        )
        if not _run_retrieval_context(args, tok, results, context, tasks, depths, trials, variants, progress):
            return


def _haystack_lines(args, tok, context: int, files) -> list[str]:
    """The held-out text lines the retrieval trials at ``context`` hide their needles in."""
    hay = corpus.heldout_texts(
        tok,
        min(context, 4096) + 1,
        max(2, -(-context // 4096) + 1),
        source=args.source,
        seed=args.seed + 1,
        files=files,
    )
    lines: list[str] = []
    for h in hay:
        lines += tok.decode(h["tokens"]).splitlines(keepends=True)
    return lines


def _retrieval_variants(args, model, tok, head, context: int, budgets, cap, drafter_name: str, calibration):
    """``[(record config, LLM)]`` of one context: dense, then per budget OasisKV and (unless
    ``--no-quest``) the Quest-like reference, all sharing one prefill cache of a batch's prompts
    and pools sized for a full batch."""
    from ..drafters import Eagle3Drafter
    from ..engine import PrefillCache
    from ..llm import LLM
    from .policies import QuestPolicy

    b = args.block_size
    batch = args.batch_size
    # One set of pools for every variant, sized once for a full batch at this context (a
    # prompt plus its answer fits in ceil((C + 1) / b) + 1 pages; a sparse one needs K + 2).
    k_max = max([budget_blocks(context, f, b, lab) for lab, f in budgets], default=1)
    pages = batch * max(-(-(context + 1) // b) + 1, k_max + 2)
    pool_kw = {"block_size": b, "num_gpu_pages": pages, "num_host_blocks": pages}
    # Every variant runs the batch's prompts before the next batch: `batch` entries suffice.
    cache = PrefillCache(capacity=batch)
    variants: list[tuple[dict, LLM]] = []
    # Dense engines select nothing: the Quest-only config keeps key codes out of their prefills.
    pool_kw["kv_dtype"] = _kv_dtype(args)
    dense_kv = KvConfig.fast(top_k_blocks=1, fetch_cap=None, measure_recall=False, **pool_kw)

    def make_llm(kv, backend, drafter, policy=None, cache=cache):
        return LLM(
            model,
            tokenizer=tok,
            kv=kv,
            backend=backend,
            drafter=drafter,
            max_batch_size=batch,
            prefill_cache=cache,
            policy=policy,
        )

    dense_cfg = {"policy": "dense", "drafter": None, "budget": None, "fetch_cap": None}
    variants.append((dense_cfg, make_llm(dense_kv, "dense", None)))
    for label, frac in budgets:
        k_blocks = budget_blocks(context, frac, b, label)
        frac = k_blocks * b / context if frac is None else frac
        # Recall is not reported here: skip its extra scoring pass.
        spec = parse_drafter(drafter_name)
        base = spec.base
        kv = KvConfig(
            **kv_budget_kwargs(spec, k_blocks, b, model, calibration),
            fetch_cap=cap,
            measure_recall=False,
            **pool_kw,
        )
        if base.startswith("eagle3"):
            drafter = Eagle3Drafter(head, model, prefill=base != "eagle3-noprefill")
        else:
            drafter = base
        cfg = {"budget": label, "budget_frac": frac, "top_k_blocks": k_blocks}
        fitted = {"layer_blocks": list(kv.layer_blocks)} if kv.layer_blocks else {}
        variants.append(
            (
                {"policy": "oasis", "drafter": drafter_name, "fetch_cap": cap, **cfg, **fitted},
                make_llm(kv, "oasis", drafter),
            )
        )
        if not args.no_quest:
            # The same model as every variant: the prompt's prefill is shared with them.
            llm = make_llm(dense_kv, "dense", None, QuestPolicy(k_blocks))
            variants.append(({"policy": "quest", "drafter": None, "fetch_cap": None, **cfg}, llm))
    if pool_kw["kv_dtype"]:  # records of an fp8 run stay apart from the float run's (--resume)
        variants = [({**cfg, "kv_dtype": pool_kw["kv_dtype"]}, llm) for cfg, llm in variants]
    return variants


def _rec_base(cfg: dict, task: str, context: int, block_size: int) -> dict:
    """What identifies a retrieval record (the key ``--resume`` finds it by)."""
    return {"section": "retrieval", "context": context, "task": task, "block_size": block_size, **cfg}


def _retrieval_state(args, results: Results, tasks, trials, variants, context: int, depths) -> dict:
    """Per task: variant index -> what ran so far (``outcomes``, ``examples``, walls, generated
    tokens), from a partial record when resuming; a variant whose record is complete is left
    out."""
    state: dict[str, dict[int, dict]] = {}
    for task in tasks:
        n_task = sum(x["task"] == task for x in trials)
        st: dict[int, dict] = {}
        for vi, (cfg, _) in enumerate(variants):
            old = results.find(_rec_base(cfg, task, context, args.block_size)) if args.resume else None
            if old is not None and not old.get("partial"):
                continue  # done
            s = {"outcomes": [], "examples": [], "wall_s": 0.0, "wall_s_task": 0.0, "gen_tokens": 0}
            if (
                old is not None
                and old.get("seed") == args.seed
                and old.get("depths") == depths
                and len(old.get("outcomes", "")) <= n_task
            ):
                s["outcomes"] = [int(c) for c in old["outcomes"]]
                s["examples"] = list(old.get("examples", []))
                s["wall_s"] = old.get("wall_s", 0.0)
                s["wall_s_task"] = old.get("wall_s_task", 0.0)
                s["gen_tokens"] = round(old.get("generated_tokens_mean", 0.0) * len(s["outcomes"]))
            st[vi] = s
        state[task] = st
    return state


def _run_retrieval_context(
    args, tok, results: Results, context, tasks, depths, trials, variants, progress
) -> bool:
    """Every task's trials at one context through every variant, batch by batch, each batch's
    records saved after it; False where ``--time-limit-min`` stopped it."""
    from tqdm import tqdm

    batch = args.batch_size
    pools = None
    # Within a batch, variants whose engine captures drafter features prefill first: their
    # cache entries serve the others too (not the other way round).
    order = sorted(range(len(variants)), key=lambda vi: not variants[vi][1].engine.capture)
    prompt_ids = [tok.encode(x["prompt"]) for x in trials]
    state = _retrieval_state(args, results, tasks, trials, variants, context, depths)
    n_gen = 0
    for task in tasks:
        if state[task]:
            start = min(len(s["outcomes"]) for s in state[task].values())
            n_task = sum(x["task"] == task for x in trials)
            n_gen += -(-(n_task - start) // batch) * len(state[task])
    bar = tqdm(total=n_gen, desc=f"retrieval C={context}", unit="gen", disable=not progress)
    for task in tasks:
        st = state[task]
        if not st:
            continue
        members = [i for i, x in enumerate(trials) if x["task"] == task]
        group = [trials[i] for i in members]
        ids = [prompt_ids[i] for i in members]
        n_task = len(group)
        start = min(len(s["outcomes"]) for s in st.values())
        for c0 in range(start, n_task, batch):
            if deadline.passed():
                bar.write(
                    f"oasis eval: --time-limit-min reached: retrieval C={context} {task} stopped "
                    f"after {c0}/{n_task} trials (records marked partial; --resume continues)"
                )
                bar.close()
                return False
            t_chunk = time.perf_counter()
            ran, pools = _retrieval_batch(
                tok, task, group, ids, range(c0, min(c0 + batch, n_task)), order, st, variants, pools, bar
            )
            wall = time.perf_counter() - t_chunk
            for vi in ran:
                s = st[vi]
                s["wall_s_task"] += wall
                base = _rec_base(variants[vi][0], task, context, args.block_size)
                rec = _retrieval_record(args, base, s, group, ids, n_task, depths)
                results.add(rec, save=False)
                if progress and not rec["partial"]:
                    cfg = variants[vi][0]
                    bar.write(
                        f"C={context} {task:8s} {cfg['policy']:6s} {cfg.get('budget') or '':5s} "
                        f"acc={rec['accuracy']:.3f} ({rec['trials']} trials, {s['wall_s']:.1f} s)"
                    )
            results.save()
    bar.close()
    return True


def _retrieval_batch(tok, task, group, ids, rows, order, st, variants, pools, bar):
    """One batch of a task's trials (``rows``, indices into ``group``) through every variant
    that has not run them yet, in ``order``, on one set of pools; each stops a trial once its
    score is decided. Returns the variants that ran and the pools, for the next batch."""
    ran = []
    for vi in order:
        if vi not in st:
            continue
        s = st[vi]
        idx = [i for i in rows if i >= len(s["outcomes"])]
        if not idx:
            continue
        llm = variants[vi][1]
        eng = llm.engine
        if pools is not None and (pools.page_kv8, pools.host_kv8) == (eng.page_kv8, eng.host_kv8):
            eng.pools = pools  # one set of pools for all variants of one storage (fp8 tiers apart)
        answers = [group[i]["answer"] for i in idx]

        def stop(j, gen, task=task, answers=answers):
            return retrieval.decided(task, answers[j], tok.decode(gen))

        t0 = time.perf_counter()
        res = llm.generate(
            [ids[i] for i in idx],
            max_new_tokens=group[idx[0]]["max_new_tokens"],
            temperature=0.0,
            stop=stop,
        )
        s["wall_s"] += time.perf_counter() - t0
        pools = llm.engine.pools
        for i, r in zip(idx, res, strict=True):
            s["outcomes"].append(int(retrieval.score(task, group[i]["answer"], r.text)))
            s["gen_tokens"] += len(r.tokens)
            if len(s["examples"]) < 3:
                s["examples"].append({"answer": group[i]["answer"], "generated": r.text})
        ran.append(vi)
        bar.update(1)
    return ran, pools


def _retrieval_record(args, base: dict, s: dict, group, ids, n_task: int, depths) -> dict:
    """The (task, variant) record from what ran so far (``s``): ``partial`` until every trial ran."""
    oc = s["outcomes"]
    done = group[: len(oc)]
    per_depth: dict[str, list[int]] = {}
    for x, o in zip(done, oc, strict=True):
        per_depth.setdefault(f"{x['depth']:g}", []).append(o)
    return {
        **base,
        "trials": len(oc),
        "trials_planned": n_task,
        "partial": len(oc) < n_task,
        "seed": args.seed,
        "depths": depths,
        "accuracy": sum(oc) / len(oc),
        "per_depth": {k: sum(v) / len(v) for k, v in per_depth.items()},
        "outcomes": "".join(map(str, oc)),
        "examples": s["examples"],
        "prompt_tokens_mean": sum(len(ids[i]) for i in range(len(oc))) / len(oc),
        "generated_tokens_mean": s["gen_tokens"] / len(oc),
        "wall_s": s["wall_s"],
        "wall_s_task": s["wall_s_task"],
    }


# ------------------------------------------------------------------------------------------ main
def main(args) -> int:
    global deadline
    out = Path(args.out)
    if args.report_only:
        if args.merge:
            res = Results(out)
            for f in args.merge:
                res.merge(json.loads(Path(f).read_text(encoding="utf-8")))
            res.save()
        report.write(out)
        print(f"oasis eval: wrote {out / 'results.md'}")
        return 0
    _fill_preset(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in ("teacher", "retrieval")]
    if bad:
        raise ValueError(f"unknown section(s) {bad}; use teacher, retrieval")
    _drafters(args)  # bad arguments fail before the model loads
    if args.attn_mass_every < 0:
        raise ValueError(f"--attn-mass-every must be >= 0 (0 = off), got {args.attn_mass_every}")
    deadline = Deadline(args.time_limit_min)
    device = pick_device(args.device)
    progress = not args.no_progress
    model, tok, head, head_path = load(args, device)
    files = corpus.list_files(source=args.source)
    results = Results(out)
    results.add_run(_meta(args, model, device, head_path, files))
    t0 = time.perf_counter()
    if "teacher" in sections:
        run_teacher(args, model, tok, head, results, files, progress)
    if "retrieval" in sections:
        run_retrieval(args, model, tok, head, results, files, progress)
    results.data["runs"][-1]["wall_s"] = time.perf_counter() - t0
    results.save()
    written = report.write(out)
    print(f"oasis eval: results in {out}: " + ", ".join(p.name for p in written))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="oasis eval", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return ap


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
