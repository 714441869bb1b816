"""The ``--fig11`` command line: its flags, their parsers, the modes and the speculative rows'
mode names, and the caller-mistake error every room raises.

Pure argparse and strings: nothing here touches torch, a model or an engine.
"""

from __future__ import annotations

import argparse
import re

from .budget import ACTIVATION_RESERVE_BYTES, BUDGET_WORDS, HOST_RAM_FRACTION, REAL_ACTIVATION_RESERVE_BYTES

#: Modes: (backend, host_pool) of the engine.
MODES: dict[str, tuple[str, str]] = {
    "dense": ("dense", "pinned"),
    "oasis": ("oasis", "pinned"),
    "oracle": ("oasis", "device"),
}
#: The n-gram drafter's search window in this benchmark. NOTE: its Python search costs about 2 ms
#: per request and step over its default 8192 tokens, which at 64 requests would dominate a step.
NGRAM_WINDOW = 256
#: What decides the oracle rows' verdicts (``--draft-verdicts``): forced by the oracle's draw (the
#: default), or the engine's verification against an iterated reference.
DRAFT_VERDICTS = ("forced", "reference")
#: Most rounds ``--draft-acceptance --draft-verdicts reference`` spends to reach a reference its
#: run reproduces. Arbitrary:
#: each round adds at least one token to the agreeing prefix; on the tiny preset 24 tokens took 6
#: to 9 rounds.
ORACLE_ROUNDS = 16

#: Size suffixes :func:`parse_bytes` reads (lowercase), in bytes.
UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def usage_error(msg: str) -> Exception:
    """A caller mistake in the flags (or what they ask of the model), as the error to raise."""
    from ...errors import ConfigError

    return ConfigError(msg)


def parse_bytes(s: str) -> int:
    """``"80GiB"`` -> 85899345920; plain ints are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", s)
    if m is None or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 64GiB, 80GB or 1000000, got {s!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def parse_budget(s: str) -> str | int:
    """``--gpu-kv-budget``: one of :data:`~.budget.BUDGET_WORDS` (``auto``, ``real``, ``h100``)
    or a size in bytes."""
    return s.lower() if s.lower() in BUDGET_WORDS else parse_bytes(s)


def parse_int_list(s: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``, every one >= 1."""
    try:
        xs = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {s!r}")
    return xs


def parse_modes(s: str) -> list[str]:
    """``"dense,oasis"`` -> ``["dense", "oasis"]``, a subset of :data:`MODES`."""
    xs = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in xs if x not in MODES]
    if not xs or bad:
        raise argparse.ArgumentTypeError(f"modes are a comma-separated subset of {list(MODES)}, got {s!r}")
    return xs


def parse_acceptances(s: str) -> list[float]:
    """``"0.4,0.7"`` -> ``[0.4, 0.7]``, every one in [0, 1]."""
    try:
        xs = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or not all(0.0 <= x <= 1.0 for x in xs):
        raise argparse.ArgumentTypeError(f"expected comma-separated acceptance rates in [0, 1], got {s!r}")
    return xs


def mode_parts(mode: str) -> tuple[str, bool, float | None]:
    """``"oasis+spec@0.4"`` -> ``("oasis", True, 0.4)``; ``"oracle"`` -> ``("oracle", False, None)``."""
    base, plus, spec = mode.partition("+")
    if not plus:
        return mode, False, None
    _, at, acc = spec.partition("@")
    return base, True, float(acc) if at else None


def spec_modes(args) -> list[str]:
    """The speculative rows' modes of ``args`` (none without ``--speculative``)."""
    if not getattr(args, "speculative", False):
        return []
    accepts = args.draft_acceptance or [None]
    return [
        f"{m}+spec" + ("" if a is None else f"@{a:g}")
        for m in args.modes
        if MODES[m][0] == "oasis"
        for a in accepts
    ]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``--fig11`` flags (the engine's KV flags, ``--device``, ``--dtype``, ``--drafter``,
    ``--concurrency``, ``--max-tokens``, ``--seed`` and ``--json`` are the command's own)."""
    g = ap.add_argument_group("--fig11 (decode throughput vs concurrency; see oasiskv.bench.fig11)")
    g.add_argument(
        "--preset", default="qwen3-8b", help="model shape with random weights (models.config.PRESETS)"
    )
    g.add_argument(
        "--contexts", type=parse_int_list, default=[16384, 32768], help="prompt tokens, comma-separated"
    )
    g.add_argument(
        "--modes", type=parse_modes, default=list(MODES), help="comma-separated: dense,oasis,oracle"
    )
    g.add_argument(
        "--gpu-kv-budget",
        type=parse_budget,
        default="auto",
        help="'real' (the card's free memory beside the weights and the prefill cache, less the "
        "activation reserve), 'h100' (emulated: 80 GiB - weights - activation reserve), a size "
        "(64GiB, 60GB, bytes), or 'auto' (default: real on an H100, h100 elsewhere)",
    )
    g.add_argument(
        "--activation-reserve",
        type=parse_bytes,
        default=None,
        help=f"GPU memory left for activations (default {ACTIVATION_RESERVE_BYTES / 2**30:g} GiB; "
        f"{REAL_ACTIVATION_RESERVE_BYTES / 2**30:g} GiB with a real budget and shared prompts)",
    )
    g.add_argument(
        "--host-kv-budget",
        type=parse_bytes,
        default=None,
        help=f"the oasis host pool's limit (default {HOST_RAM_FRACTION * 100:.0f}%% of the free RAM)",
    )
    g.add_argument("--prompts", choices=["shared", "distinct"], default="shared")
    g.add_argument(
        "--prefill-cache",
        choices=["host", "device"],
        default="host",
        help="where a shared prompt's prefill entry is held: pinned host memory (the default: the "
        "card's memory all goes to the rows; a hit copies it in) or the GPU (the host pool keeps "
        "the RAM; at 128K the entry is 18 GiB on an 8B model)",
    )
    g.add_argument(
        "--ngram-window", type=int, default=NGRAM_WINDOW, help="tokens the n-gram drafter searches"
    )
    g.add_argument(
        "--measure-recall", action="store_true", help="also measure lookahead recall (one more scoring pass)"
    )
    # --enforce-eager (--cuda-graph, the default) and --speculative come with the engine flags of
    # `oasis serve` (bench.serve adds them).
    g.add_argument(
        "--draft-acceptance",
        type=parse_acceptances,
        default=None,
        help="with --speculative: one row per rate (comma-separated, in [0, 1]) with an oracle drafter "
        "right that often, instead of --drafter",
    )
    g.add_argument(
        "--draft-cost",
        choices=["eagle3", "none"],
        default="eagle3",
        help="what the oracle's draft costs: a random EAGLE-3 head of the target's shape runs beside it "
        "(default), or nothing",
    )
    g.add_argument(
        "--draft-verdicts",
        choices=DRAFT_VERDICTS,
        default="forced",
        help="with --draft-acceptance: 'forced' (default): a hit is accepted and a miss rejected whatever "
        "the logits say, at exactly the set rate (the tokens are not the model's); 'reference': the engine "
        "verifies against a reference iterated up to --oracle-rounds times",
    )
    g.add_argument(
        "--oracle-rounds",
        type=int,
        default=ORACLE_ROUNDS,
        help="with --draft-verdicts reference: most runs per row to reach a reference the speculative "
        "run reproduces",
    )
    g.add_argument(
        "--trace-dir",
        default=None,
        help="on a GPU: the Chrome trace of each row's profiled step here (CONTEXT-MODE-CONC.json)",
    )
    g.add_argument(
        "--md", default=None, help="write the markdown table here (default bench_fig11.md, '' for none)"
    )
    g.add_argument("--png", default=None, help="write the plot here (default bench_fig11.png, '' for none)")
