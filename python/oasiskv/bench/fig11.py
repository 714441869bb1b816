"""The paper's Fig. 11 on one machine: decode throughput against concurrency, dense vs OasisKV vs
the all-resident oracle, one process, one model.

    python -m oasiskv.bench.serve --fig11 [--preset qwen3-8b | --model DIR]
        [--contexts 16384,32768] [--concurrency 1,4,16,32,64] [--modes dense,oasis,oracle]
        [--max-tokens 48] [--gpu-kv-budget h100] [--top-k-blocks 128 --fetch-cap 0.05]
        [--enforce-eager] [--speculative [--draft-acceptance 0.4,0.7 [--draft-verdicts forced]]]
        [--json F --md F --png F]

Modes (each an :class:`~oasiskv.LLMEngine` over the same model):

* ``dense``: the dense backend; its KV must fit the GPU KV budget.
* ``oasis``: OasisKV, the host pool in pinned CPU memory (gathers over PCIe).
* ``oracle``: OasisKV with ``host_pool="device"``: the same selection, but the host pool is a
  copy of the full KV on the GPU, so every gather is device to device. It bounds what the PCIe
  transfers cost; it needs the whole KV of every request in GPU memory.

Per (context, mode, concurrency ``C``): ``C`` requests of the same context arrive at once; every
one is prefilled first (the engine's admission and prefill, no decode step), then they decode
``--max-tokens`` together (greedy, ``ignore_eos``), so the decode phase runs at exactly ``C``. Its
first step is a warm-up (and on CUDA one more is profiled); the rest are timed. Reported:

* decode tokens/s (``C`` x timed steps / their time) and TPOT p50/p99 (the timed steps' times:
  every request makes one token per step), TTFT p50/p99 from the common arrival (queueing behind
  the other prefills included), and per context the cold TTFT of one request alone;
* peak GPU memory, the host pool's bytes and place, GPU KV bytes (pages and summaries), bytes
  fetched per request and step (``RequestMetrics.fetched_bytes_per_step``), and the time per
  timed step the compute stream waited on the background chain and its transfers
  (``Engine.transfer_wait``: device clocks around each wait; 0 on the CPU);
* kernels per layer and step: CUDA kernel launches of one decode step (``torch.profiler``)
  divided by ``num_hidden_layers`` (CUDA only);
* the roofline: the bytes one decode step must read (the weights once, and per request what its
  attention reads: dense, the whole context's K and V; oasis and oracle, ``K + 1`` pages per KV
  head and layer plus the summaries scored) over the device-to-device copy bandwidth measured in
  this run (a 1 GiB copy timed with CUDA events), against the measured TPOT p50.

**The lookahead's drafter** (``--drafter``): ``ngram`` (the default; drafting costs next to
nothing), ``previous-query``, or ``eagle3``: on random weights (a ``--preset``) a random EAGLE-3
head of the target's shape, run as :class:`~oasiskv.drafters.Eagle3Drafter` runs a real one (its
drafts are as random as the weights, its cost is the paper's drafter's), said in the report.

**Speculative decoding** (``--speculative``): after the modes' rows, each oasis-backend mode
(``oasis``, ``oracle``) runs again with ``LLMEngine(speculative=True)``, one row per setting: with
``--drafter`` (mode ``oasis+spec``), or, with ``--draft-acceptance 0.4,0.7``, with an
:class:`~oasiskv.drafters.OracleDrafter` that drafts the reference token with that probability
and a wrong one otherwise (modes ``oasis+spec@0.4``, ``oasis+spec@0.7``): the speedup curve a real
head of that acceptance rate would follow, on random weights where no real head exists. What
keeps it honest:

* Cost: ``--draft-cost eagle3`` (the default) runs a random EAGLE-3 head of the target's shape
  beside the oracle -- the target's three layers captured, the head prefilled over the prompt,
  one head step per request and decode step, as :class:`~oasiskv.drafters.Eagle3Drafter` runs a
  real one -- and throws its drafts away, so the oracle costs what a real head costs here.
  ``none``: drafts cost nothing (an upper bound).
* Acceptance, ``--draft-verdicts forced`` (the default): the oracle forces the verdicts
  (``OracleDrafter(force=True)``, :meth:`~oasiskv.drafters.Drafter.forced_verdicts`): the
  verified draft of generated token ``i`` of request ``k`` is accepted exactly when a hash of
  (seed, ``k``, ``i``) falls below ``a``, whatever the target's logits say, and rejected otherwise.
  A hit does exactly the work of a genuine acceptance (the draft's K/V, computed in the step,
  stored with write-through and summary update, the tables advanced by two tokens, row 1's token
  emitted), a miss that of a rejection, in the eager and the CUDA-graph step alike (a per-row
  device input). So the accept column reads the set rate (up to the draw's sampling noise over
  the verified drafts) in one round, whatever the working set does to the tokens. The tokens are
  NOT the model's greedy outputs (a hit emits the drafted token): the row's note says so, and
  ``draft_verdicts`` in the JSON. On random weights tokens mean nothing; what is measured is the
  throughput at that acceptance rate.
* Acceptance, ``--draft-verdicts reference``: the engine's own greedy verification decides (the
  oracle only chooses what to draft). With a working set smaller than the context the drafts
  steer the selection (the lookahead query, and the position a step moves to after an
  acceptance), so the tokens depend on them and a reference from the run without speculation is
  left within a few tokens. The reference is therefore iterated: round 1 drafts from the base
  mode's tokens, each later round from the previous round's, until a round makes exactly its
  reference (it then accepts the set fraction of its drafts), at most ``--oracle-rounds``; the
  row is the last round, with ``reference_rounds``, ``reference_converged`` and the requests
  that left the reference. NOTE: on the H200 (Qwen3-8B shapes, 16K contexts, K = 128) eight
  rounds still measured 0.19 / 0.27 for 0.4 / 0.7: the reason ``forced`` is the default.
* Either way the rows report the measured acceptance rate and tokens per request-step from the
  requests' metrics.
* Lossless: ``tokens_match_base`` is the fraction of tokens equal to the base mode's row.
  Greedy speculation is lossless where attention is exact (``tests/test_speculative.py``); with a
  lossy working set the two runs select different blocks, so this fraction says how far apart
  the two trajectories went, not whether verification is correct (with forced verdicts it says
  nothing of the kind: the tokens are forced).

Timing is unchanged for rows without speculation. With it a step makes one or two tokens per
request: decode tokens/s counts the tokens the timed steps made, TPOT is a step's time over the
tokens it made per request, and only steps with all ``C`` requests running are timed (requests
finish at different steps).

A row whose KV does not fit is skipped, and the table says why: dense past the GPU KV budget
(the concurrency at which dense fills it is reported per context), oasis past the host pool limit
or the budget (pages and summaries), the oracle past the device's free memory.
``--gpu-kv-budget h100`` emulates an 80 GiB H100: 80 GiB minus the weights minus an activation
reserve. Oasis modes are given exactly the pages they need (at most the budget), so their pools
are allocated once and the peak memory shows what they use.

``--prompts shared`` (the default) gives every request the same random prompt, prefilled once per
context and then served from a :class:`~oasiskv.engine.PrefillCache` (its entry, the prompt's KV,
stays on the device and counts in the peak): decode cost does not depend on the prompt's content,
and a sweep then takes minutes instead of prefilling every request. ``distinct`` prefills every
request (real TTFT under load; much slower).

``--tp N`` runs the sweep on ``N`` tensor-parallel ranks (:func:`~oasiskv.parallel.run_tp`: NCCL
with a GPU each, gloo with ``--device cpu``): rank 0 runs this sweep on a
:class:`~oasiskv.parallel.TPLLMEngine` and writes the report; before every engine it makes, it
sends the engine's options to the other ranks, which build theirs and follow it
(``worker_loop``). A preset's ranks draw their own shards (``TPCausalLM.random_shards``). Every
byte count, budget, peak and roofline is rank 0's, i.e. per rank (its KV heads, its shard of the
weights, its device's bandwidth); each rank keeps its own prefill cache of its shard for
``shared`` prompts. Not with ``--tp`` yet: CUDA graphs (``--tp`` decodes eagerly) and ``--speculative``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import re
import sys
import time

from .common import PROMPT_ID_RANGE, percentile

#: Modes: (backend, host_pool) of the engine.
MODES: dict[str, tuple[str, str]] = {
    "dense": ("dense", "pinned"),
    "oasis": ("oasis", "pinned"),
    "oracle": ("oasis", "device"),
}
#: The emulated GPU of ``--gpu-kv-budget h100``. Arbitrary round figure: 80 GiB of HBM3 (torch
#: reports a little less, 79.2 GiB, as total_memory of an H100 SXM).
H100_BYTES = 80 * 2**30
#: Left for activations when the budget is ``h100``. Arbitrary, checked by the peak memory: a 32K
#: prompt prefilled in one piece on an 8B model takes about 3 GiB beyond weights and KV.
ACTIVATION_RESERVE_BYTES = 6 * 2**30
#: The host pool limit without ``--host-kv-budget``: this fraction of the available RAM (arbitrary;
#: pinned memory is never swapped or reclaimed, so leave the rest to the process and the system).
HOST_RAM_FRACTION = 0.6
#: The most concurrent requests the report's "most that fit" looks for (arbitrary).
MAX_SEARCHED = 1 << 16
#: The n-gram drafter's search window in this benchmark. NOTE: its Python search costs about 2 ms
#: per request and step over its default 8192 tokens, which at 64 requests would dominate a step.
NGRAM_WINDOW = 256

#: The drafter the report names for ``--drafter eagle3`` on random weights.
RANDOM_HEAD = "eagle3 (a random head of the target's shape)"
#: The draft vocabulary of the random EAGLE-3 head that ``--draft-cost eagle3`` runs: the size
#: published EAGLE-3 heads of 8B targets use (32000 tokens).
EAGLE3_DRAFT_VOCAB = 32000
#: What decides the oracle rows' verdicts (``--draft-verdicts``): forced by the oracle's draw (the
#: default), or the engine's verification against an iterated reference.
DRAFT_VERDICTS = ("forced", "reference")
#: Most rounds ``--draft-acceptance --draft-verdicts reference`` spends to reach a reference its
#: run reproduces. Arbitrary:
#: each round adds at least one token to the agreeing prefix; on the tiny preset 24 tokens took 6
#: to 9 rounds.
ORACLE_ROUNDS = 16

_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_bytes(s: str) -> int:
    """``"80GiB"`` -> 85899345920; plain ints are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", s)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 64GiB, 80GB or 1000000, got {s!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _budget(s: str) -> str | int:
    return "h100" if s.lower() == "h100" else parse_bytes(s)


def _int_list(s: str) -> list[int]:
    try:
        xs = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {s!r}")
    return xs


def _modes(s: str) -> list[str]:
    xs = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in xs if x not in MODES]
    if not xs or bad:
        raise argparse.ArgumentTypeError(f"modes are a comma-separated subset of {list(MODES)}, got {s!r}")
    return xs


def _acceptances(s: str) -> list[float]:
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
        "--contexts", type=_int_list, default=[16384, 32768], help="prompt tokens, comma-separated"
    )
    g.add_argument("--modes", type=_modes, default=list(MODES), help="comma-separated: dense,oasis,oracle")
    g.add_argument(
        "--gpu-kv-budget",
        type=_budget,
        default="h100",
        help="a size (64GiB, 60GB, bytes) or 'h100' (80 GiB - weights - activation reserve)",
    )
    g.add_argument("--activation-reserve", type=parse_bytes, default=ACTIVATION_RESERVE_BYTES)
    g.add_argument(
        "--host-kv-budget",
        type=parse_bytes,
        default=None,
        help=f"the oasis host pool's limit (default {HOST_RAM_FRACTION * 100:.0f}%% of the free RAM)",
    )
    g.add_argument("--prompts", choices=["shared", "distinct"], default="shared")
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
        type=_acceptances,
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


# ---------------------------------------------------------------------- helpers
def _pcts(xs: list[float]) -> tuple[float | None, float | None]:
    return percentile(xs, 0.5), percentile(xs, 0.99)


def _free_memory(torch, dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)  # torch's cached pinned blocks
        if empty_host is not None:
            empty_host()


def _prompts(vocab: int, n_tokens: int, count: int, shared: bool, seed: int) -> list[list[int]]:
    import random

    lo, hi = PROMPT_ID_RANGE if vocab >= PROMPT_ID_RANGE[1] else (0, vocab)
    rnd = random.Random(f"{seed}-{n_tokens}")
    one = [rnd.randrange(lo, hi) for _ in range(n_tokens)]
    if shared:
        return [one] * count
    return [one] + [[rnd.randrange(lo, hi) for _ in range(n_tokens)] for _ in range(count - 1)]


def _profiled(torch, fn, trace: str | None = None):
    """``fn()`` under ``torch.profiler``: its result, the CUDA kernels launched and the copies
    (memcpy / memset) queued; with ``trace``, the Chrome trace of it written there (host and
    streams: where a step's time goes, e.g. a drafter between two steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    kernels = copies = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(("Memcpy", "Memset", "memcpy", "memset")):
            copies += 1
        else:
            kernels += 1
    return out, kernels, copies


class _DoesNotFit(Exception):
    pass


# ---------------------------------------------------------------------- one run
def drive(
    eng, prompts: list[list[int]], max_tokens: int, profile_step: int | None = None, trace: str | None = None
) -> dict:
    """Add every prompt at once, prefill them all (no decode step), then decode them together.

    Returns TTFTs (from the common arrival), the timed decode steps (every step but the first and
    the profiled one, and, where requests finish apart -- speculative decoding --, those that
    began with fewer than all of them running), the tokens those steps made, each one's time per
    output token (its time over the tokens it made per request), the kernel counts of the
    profiled step, and each request's final output.
    """
    import torch

    from ..llm_engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = getattr(eng, "_llm", eng)  # a TPLLMEngine's driver LLMEngine (its private half-step)
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params) for p in prompts]
    ttft: dict[str, float] = {}
    touched: list = []
    # NOTE: LLMEngine._prefill is the admission + prefill half of LLMEngine.step (no decode step),
    # so that the decode phase starts with every request running. One request per call
    # (max_num_batched_tokens = the context), so each TTFT is its own.
    while llm.num_waiting or llm._prefilling:
        state = (llm.num_waiting, [s.prefilled for s in llm._prefilling], len(llm._running))
        llm._prefill(touched)
        now = time.perf_counter()
        for seq in touched:
            if seq.req.finish_reason == "error":
                raise RuntimeError(f"request {seq.request_id} failed: {seq.error}")
            ttft.setdefault(seq.request_id, now - t0)
        touched.clear()
        if state == (llm.num_waiting, [s.prefilled for s in llm._prefilling], len(llm._running)):
            raise _DoesNotFit(
                f"only {llm.num_running} of {len(prompts)} requests were admitted (the pools are full)"
            )
    cuda = eng.engine.device.type == "cuda"
    finals: dict = {}
    times: list[float] = []
    tpots: list[float] = []
    timed_tokens = 0
    kernels = copies = None
    waited = 0.0  # seconds the compute stream waited on transfers, over the timed steps
    wait_of = getattr(eng.engine, "transfer_wait", None)
    wait_seen = wait_of()[0] if wait_of is not None else 0.0  # the counter after the last step
    i = 0
    while eng.has_unfinished_requests():
        n = llm.num_running
        t = time.perf_counter()
        if i == profile_step and cuda:
            outs, kernels, copies = _profiled(torch, eng.step, trace)
        else:
            outs = eng.step()
        dt = time.perf_counter() - t
        timed = i > 0 and i != profile_step and n == len(prompts)
        if timed:
            made = sum(len(o.new_token_ids) for o in outs)
            times.append(dt)
            tpots.append(dt * n / made if made else dt)
            timed_tokens += made
        if wait_of is not None:  # one read per step, outside its timing
            wait_now = wait_of()[0]
            if timed:
                waited += wait_now - wait_seen
            wait_seen = wait_now
        for o in outs:
            if o.finished:
                if o.finish_reason != "length":
                    raise RuntimeError(f"request {o.request_id} finished with {o.finish_reason}: {o.error}")
                finals[o.request_id] = o
        i += 1
    return {
        "ttft": [ttft[r] for r in rids],
        "times": times,
        "tpots": tpots,
        "timed_tokens": timed_tokens,
        "transfer_wait_s": waited,
        "kernels": kernels,
        "copies": copies,
        "outputs": [finals[r] for r in rids],
    }


# ---------------------------------------------------------------------- the sweep
def build_model(args, group=None):
    """``(model, name, device)``: ``--model`` (loaded; this rank's shard of it under ``group``)
    or ``--preset``'s random weights, on ``--device`` (a rank: the group's device)."""
    import torch

    from ..devices import compute_dtype, resolve_device

    tp = group.size if group is not None else 1
    dev = torch.device(resolve_device(args.device)) if tp == 1 else group.device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    dtype = compute_dtype(dev.type) if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.model:
        from ..models.loader import load_model

        model, _ = load_model(args.model, dtype=dtype, device=dev if tp == 1 else "cpu")
        name = args.model
        if tp > 1:
            from ..models.tp import TPCausalLM

            model = TPCausalLM.from_full(model, group=group, device=dev)
    else:
        from ..models.config import preset_config

        cfg = preset_config(args.preset)
        name = f"{args.preset} (random weights)"
        if tp > 1:
            from ..models.tp import TPCausalLM

            model = TPCausalLM.random_shards(cfg, seed=args.seed, dtype=dtype, device=dev, group=group)
        else:
            from ..models.random_weights import random_model

            model = random_model(cfg, dtype, dev, args.seed)
    return model.eval(), name, dev


class Fig11:
    """The sweep's state: the model, the measured ceilings and the options. With ``group`` (a
    :class:`~oasiskv.parallel.TPGroup` of more than one rank) this is rank 0's side of ``--tp``:
    every engine is a :class:`~oasiskv.parallel.TPLLMEngine` whose options go to the other
    ranks first (:func:`_tp_worker`)."""

    def __init__(self, args, group=None) -> None:
        import torch

        from ..memory import available_bytes

        self.torch, self.args = torch, args
        self.group = group if group is not None and group.size > 1 else None
        self.tp = group.size if self.group is not None else 1
        self._live = None  # the TPLLMEngine the workers follow now
        self.model, self.model_name, self.dev = build_model(args, self.group)
        self.cuda = self.dev.type == "cuda"
        from ..serve.cli import enforce_eager

        #: Decode eagerly: --enforce-eager, or --tp (captured steps with collectives: not yet).
        self.enforce_eager = enforce_eager(args) or self.tp > 1
        self.cfg = self.model.config
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        emb = self.model.embed_tokens.weight
        # One decode step reads every weight once, but only the batch's rows of the embedding
        # table (when the LM head is a separate matrix).
        tied = self.cfg.tie_word_embeddings
        self.weights_read = self.weights_bytes - (0 if tied else emb.numel() * emb.element_size())
        if args.gpu_kv_budget == "h100":
            self.budget = H100_BYTES - self.weights_bytes - args.activation_reserve
            if self.budget <= 0:
                raise _usage(
                    f"the weights ({self.weights_bytes / 2**30:.1f} GiB) leave no KV budget on an H100"
                )
        else:
            self.budget = args.gpu_kv_budget
        ram = available_bytes("cpu")
        self.host_limit = args.host_kv_budget or int(HOST_RAM_FRACTION * (ram or 0))
        self.spec_modes = spec_modes(args)
        if getattr(args, "draft_acceptance", None) and not getattr(args, "speculative", False):
            raise _usage("--draft-acceptance sets the drafter of the speculative rows: add --speculative")
        if getattr(args, "speculative", False) and not self.spec_modes:
            raise _usage(
                "--speculative adds rows to the oasis-backend modes (oasis, oracle), and --modes has "
                "none; add oasis to --modes"
            )
        if args.oracle_rounds < 1:
            raise _usage(f"--oracle-rounds must be >= 1, got {args.oracle_rounds}")
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
            from .kernels import ceilings

            self.ceilings = ceilings(self.dev)
            _free_memory(torch, self.dev)

    def weights_read_at(self, conc: int) -> int:
        """Weight bytes one decode step of ``conc`` requests reads: :attr:`weights_read`, less,
        in a mixture of experts, the experts no row chose: ``E (1 - (1 - k/E)^conc)`` of the
        ``E`` are chosen per layer in expectation, for one row per request routed uniformly
        (an estimate: real routers are not uniform, and lookahead rows route too)."""
        cfg = self.cfg
        if not cfg.is_moe:
            return self.weights_read
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        unused = e * (1 - k / e) ** conc
        layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        itemsize = self.model.embed_tokens.weight.element_size()
        expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * itemsize
        return int(self.weights_read - layers * unused * expert)

    def _cost_head(self):
        """A random EAGLE-3 head of the target's shape (one decoder layer, ``fc`` over three
        captured layers, a draft LM head of :data:`EAGLE3_DRAFT_VOCAB` tokens) in the model's
        dtype, on its device."""
        from ..errors import ConfigError
        from ..models.eagle3 import Eagle3Head

        p = next(self.model.parameters())
        try:
            Eagle3Head.capture_layers(self.cfg.num_hidden_layers)
        except ConfigError as e:
            if self.random_head_drafter:
                raise _usage(f"--drafter eagle3: {e}; pass --drafter ngram") from None
            raise _usage(f"--draft-cost eagle3: {e}; pass --draft-cost none") from None
        head = Eagle3Head.random(
            self.cfg,
            draft_vocab_size=min(EAGLE3_DRAFT_VOCAB, self.cfg.vocab_size),
            seed=self.args.seed,
            dtype=p.dtype,
            device=p.device,
        )
        return head.attach_target(self.model).eval()

    @property
    def forced(self) -> bool:
        """Whether the oracle rows force their verdicts (``--draft-verdicts forced``)."""
        return getattr(self.args, "draft_verdicts", "forced") == "forced"

    def oracle(self, conc: int, accept: float):
        """The drafter of a ``--draft-acceptance`` row: an oracle right with probability
        ``accept`` (forcing its verdicts with ``--draft-verdicts forced``), with no reference yet
        (:meth:`row` sets it), paying for the head of ``--draft-cost``."""
        from ..drafters import Eagle3Drafter, OracleDrafter

        shadow = Eagle3Drafter(self.head, self.model) if self.head is not None else None
        return OracleDrafter(
            [[]] * conc,
            accept=accept,
            seed=self.args.seed,
            vocab_size=self.cfg.vocab_size,
            shadow=shadow,
            force=self.forced,
        )

    # ------------------------------------------------------------------ engines
    def kv(self):
        from ..config import KvConfig
        from ..serve.cli import selection_kwargs

        a = self.args
        # The selection flags (--block-score, --sticky-candidates, ...) are the engine's, as in
        # `oasis serve`; they were parsed but ignored here before the fifteenth session.
        return KvConfig(
            block_size=a.block_size,
            top_k_blocks=a.top_k_blocks,
            fetch_cap=a.fetch_cap,
            sparse_threshold=a.sparse_threshold,
            measure_recall=a.measure_recall,
            **selection_kwargs(a),
        )

    def engine(self, mode: str, conc: int, ctx: int, gpu_budget: int | None, host_budget: int | None, cache):
        from ..drafters import NgramDrafter
        from ..llm_engine import LLMEngine

        base, spec, accept = mode_parts(mode)
        backend, host_pool = MODES[base]
        a = self.args
        drafter = None
        if accept is not None:
            drafter = self.oracle(conc, accept)
        elif backend == "oasis":
            if self.random_head_drafter:
                from ..drafters import Eagle3Drafter

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
        from ..parallel import TPLLMEngine

        self.close(self._live)
        # The context's prefill cache travels as a tag: each worker keeps its own cache of its
        # shard per tag (_tp_worker).
        sent = {**kw, "prefill_cache": None if cache is None else ("prefill-cache", ctx)}
        self.group.broadcast_object(("engine", sent))
        self._live = TPLLMEngine(self.model, group=self.group, **kw)
        return self._live

    def close(self, eng) -> None:
        """Let the workers following ``eng`` (a TPLLMEngine) go; nothing in one process."""
        if eng is not None and self.group is not None and eng is self._live:
            self._live = None
            if self.group.broken is None:
                eng.shutdown()

    def _driver(self, eng):
        """The LLMEngine whose private admission and prefill :func:`drive` calls."""
        return getattr(eng, "_llm", eng)

    # ------------------------------------------------------------------ what fits
    def need(self, mode: str, ctx: int) -> dict:
        """One request's reservation in the engine's runtime: dense-phase peak pages, host
        blocks, whether it turns sparse; and the bytes of a block (all layers) and its summaries."""
        llm = self.engine(mode, 1, ctx, None, None, None)
        probe = llm.engine
        probe.reserve_pools([])  # makes the runtime, allocates nothing
        peak, host, sparse = probe.runtime.reservation(ctx, self.args.max_tokens)
        self.close(llm)
        per = probe.page_bytes_all_layers
        kv = probe.kv
        if mode != "dense" and not sparse:
            raise _usage(
                f"a {ctx}-token request does not turn sparse (sparse threshold "
                f"{kv.threshold_tokens} tokens): raise --contexts, or lower --top-k-blocks or "
                "--sparse-threshold"
            )
        return {
            "peak_pages": peak,
            "host_blocks": host,
            "kv_blocks": peak if mode == "dense" else host,  # every block of the request's KV
            "steady_pages": kv.top_k_blocks + 1,
            "block_bytes": per,
            "summary_bytes": per // kv.block_size,  # min and max keys: 2 of block_size rows
        }

    def fit(
        self, mode: str, conc: int, n: dict, device_free: int | None
    ) -> tuple[str | None, int, int | None]:
        """``(reason it does not fit or None, GPU budget, host budget)`` of ``conc`` requests."""
        mode = mode_parts(mode)[0]  # a speculative row fits where its base mode does
        gib = 2**30
        per = n["block_bytes"]
        if mode == "dense":
            need = conc * n["peak_pages"] * per
            if need > self.budget:
                return f"dense KV {need / gib:.1f} GiB > GPU KV budget {self.budget / gib:.1f} GiB", 0, None
            return None, self.budget, None
        # Admission turns one request sparse before the next is prefilled: (C - 1) working sets
        # and one dense prompt at the peak; every request's summaries stay on the GPU.
        pages = (conc - 1) * n["steady_pages"] + n["peak_pages"]
        summaries = conc * n["host_blocks"] * n["summary_bytes"]
        host = conc * n["host_blocks"] * per
        if pages * per + summaries > self.budget:
            gpu = (pages * per + summaries) / gib
            return f"pages + summaries {gpu:.1f} GiB > GPU KV budget {self.budget / gib:.1f} GiB", 0, None
        if mode == "oasis" and host > self.host_limit:
            return f"host pool {host / gib:.1f} GiB > host limit {self.host_limit / gib:.1f} GiB", 0, None
        if mode == "oracle" and device_free is not None:
            room = device_free - self.args.activation_reserve - pages * per - summaries
            if host > room:
                return (
                    f"full KV on the device {host / gib:.1f} GiB > {max(room, 0) / gib:.1f} GiB free",
                    0,
                    None,
                )
        return None, pages * per, host

    def max_concurrency(
        self, mode: str, n: dict, device_free: int | None, limit: int = MAX_SEARCHED
    ) -> int | None:
        """The largest concurrency that fits (0: not even one request; None: ``limit`` or more)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fit(mode, mid, n, device_free)[0] is None:
                lo = mid
            else:
                hi = mid - 1
        return None if lo == limit else lo

    # ------------------------------------------------------------------ rows
    def roofline(self, mode: str, ctx: int, conc: int, n: dict) -> dict:
        """Bytes one decode step must read, at the middle of the decode phase, and that over the
        measured device-to-device bandwidth."""
        b = self.args.block_size
        tokens = ctx + self.args.max_tokens // 2
        per = n["block_bytes"]
        if mode == "dense":
            kv_read = tokens * (per // b)
        else:
            kv_read = min(n["steady_pages"], math.ceil(tokens / b)) * per + (tokens // b) * n["summary_bytes"]
        total = self.weights_read_at(conc) + conc * kv_read
        bw = self.ceilings["d2d_copy_Bps"] if self.ceilings else None
        return {"step_read_bytes": total, "roofline_tpot_s": total / bw if bw else None}

    def row(self, mode: str, ctx: int, conc: int, n: dict, device_free, cache) -> dict:
        torch, dev, a = self.torch, self.dev, self.args
        base = {"context": ctx, "mode": mode, "concurrency": conc}
        reason, gpu_budget, host_budget = self.fit(mode, conc, n, device_free)
        if reason is not None:
            return {**base, "status": "skipped", "reason": reason}
        from ..errors import OutOfMemoryError

        _free_memory(torch, dev)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        eng = None
        prompts = _prompts(self.cfg.vocab_size, ctx, conc, a.prompts == "shared", a.seed)
        profile = 1 if self.cuda and a.max_tokens - 1 >= 3 else None  # leaves a timed step
        base_mode, spec, accept = mode_parts(mode)
        try:
            eng = self.engine(mode, conc, ctx, gpu_budget, host_budget, cache)
            # one allocation, not log2(C); through the driver's proxy under --tp (every rank)
            self._driver(eng).engine.reserve_pools([(ctx, a.max_tokens)] * conc)
            trace = None
            if a.trace_dir and profile is not None:
                os.makedirs(a.trace_dir, exist_ok=True)
                trace = os.path.join(a.trace_dir, f"{ctx}-{mode}-{conc}.json")
            if accept is None:
                res = drive(eng, prompts, a.max_tokens, profile, trace)
            else:
                start = self._tokens.get((ctx, base_mode, conc))
                res = self.oracle_rounds(eng, prompts, start, profile, trace)
        except (_DoesNotFit, OutOfMemoryError, torch.OutOfMemoryError) as e:
            self.close(eng)
            del eng
            _free_memory(torch, dev)
            why = " ".join(str(e).split())
            return {
                **base,
                "status": "skipped",
                "reason": why if isinstance(e, _DoesNotFit) else f"OOM: {why}",
            }
        p = eng.engine.pools
        layers = self.cfg.num_hidden_layers
        peak = torch.cuda.max_memory_allocated(dev) if self.cuda else None
        times, outs = res["times"], res["outputs"]
        tpot50, tpot99 = _pcts(res["tpots"])
        step50 = _pcts(times)[0]
        ttft50, ttft99 = _pcts(res["ttft"])
        tokens = [o.token_ids for o in outs]
        if not spec and any(m.startswith(f"{mode}+") for m in self.spec_modes):
            self._tokens[(ctx, mode, conc)] = tokens
        fetched = [o.metrics.fetched_bytes_per_step for o in outs]
        host_place = str(p.host_k[0].device) + (" pinned" if p.host_k[0].is_pinned() else "")
        out = {
            **base,
            "status": "ok",
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
            "host_pool_bytes": p.num_host_blocks * p.page_bytes * layers,
            "host_pool_place": host_place,
            "fetched_bytes_per_step": sum(fetched) / len(fetched) if eng.engine.backend == "oasis" else None,
            "kernels_per_layer_step": res["kernels"] / layers if res["kernels"] is not None else None,
            "transfer_wait_per_step_s": res["transfer_wait_s"] / len(times) if times else None,
            "copies_per_step": res["copies"],
            "tokens_digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            **(self.spec_columns(eng, ctx, base_mode, conc, accept, res) if spec else {"speculative": False}),
            **self.roofline(mode, ctx, conc, n),
        }
        rl = out["roofline_tpot_s"]
        # Against the step: a speculative step reads the same bytes but makes more tokens.
        out["roofline_fraction"] = rl / step50 if rl and step50 else None
        self.close(eng)
        del eng, p, res
        _free_memory(torch, dev)
        return out

    def oracle_rounds(self, eng, prompts: list[list[int]], start, profile, trace=None) -> dict:
        """:func:`drive` a ``--draft-acceptance`` row. Forced verdicts: once, drafting from
        ``start`` (the base mode's tokens, when that row ran); ``converged`` is None (there is
        nothing to reach). Else until a round makes exactly the tokens its oracle drafted from
        (then the oracle is right as often as it is set to be), at most ``--oracle-rounds``
        times; round 1 drafts from ``start``, each later round from the previous round's tokens.
        The last round's :func:`drive` result, with ``rounds``, ``converged`` and the oracle's
        counters."""
        d = eng.drafter
        conc = len(prompts)
        ref = [list(t) for t in start] if start is not None else [[] for _ in prompts]
        kernels = copies = None
        converged = False
        for k in range(1 if self.forced else self.args.oracle_rounds):
            d.set_reference(ref, first_id=k * conc)  # the engine numbers requests 0, 1, ...
            prof, tr = (profile, trace) if k == 0 else (None, None)
            res = drive(eng, prompts, self.args.max_tokens, prof, tr)
            if k == 0:
                kernels, copies = res["kernels"], res["copies"]
            if self.forced:
                converged = None
                break
            tokens = [o.token_ids for o in res["outputs"]]
            converged = tokens == ref
            if converged:
                break
            ref = tokens
        res.update(kernels=kernels, copies=copies)
        return {
            **res,
            "rounds": k + 1,
            "converged": converged,
            "off_reference": len(d.off_reference),
            "reference_drafts": d.reference_drafts / d.drafts if d.drafts else None,
        }

    def spec_columns(self, eng, ctx: int, base_mode: str, conc: int, accept, res) -> dict:
        """A speculative row's own columns: tokens per request-step and the acceptance rate the
        engine measured (the requests' metrics), how many tokens equal the base mode's row, and
        for an oracle row its reference rounds and draft cost."""
        ms = [o.metrics for o in res["outputs"]]
        steps, made = sum(m.steps for m in ms), sum(m.decode_tokens for m in ms)
        drafts, accepted = sum(m.draft_tokens for m in ms), sum(m.accepted_tokens for m in ms)
        base = self._tokens.get((ctx, base_mode, conc))
        match = None
        if base is not None:
            pairs = [
                (x, y)
                for o, b in zip(res["outputs"], base, strict=True)
                for x, y in zip(o.token_ids, b, strict=True)
            ]
            match = sum(x == y for x, y in pairs) / len(pairs) if pairs else None
        out = {
            "speculative": True,
            "drafter": eng.drafter.name,
            "tokens_per_step": made / steps if steps else None,
            "acceptance_rate": accepted / drafts if drafts else None,
            "drafts": drafts,
            "tokens_match_base": match,
            "draft_acceptance_set": accept,
        }
        if accept is not None:
            out.update(
                draft_cost=self.args.draft_cost,
                draft_verdicts="forced" if self.forced else "reference",
                reference_rounds=res["rounds"],
                reference_converged=res["converged"],
                off_reference_requests=res["off_reference"],
                reference_draft_fraction=res["reference_drafts"],
            )
        return out

    def warm_up(self, mode: str, ctx: int, cache) -> float:
        """One request alone through ``mode`` (compiles the kernels, fills the prefill cache):
        its TTFT, a cold prefill when the cache was empty."""
        eng = self.engine(mode, 1, ctx, None, None, cache)
        prompt = _prompts(self.cfg.vocab_size, ctx, 1, True, self.args.seed)
        res = drive(eng, prompt, min(3, self.args.max_tokens))
        self.close(eng)
        del eng
        _free_memory(self.torch, self.dev)
        return res["ttft"][0]

    def run(self, checkpoint=None) -> dict:
        """The sweep; ``checkpoint(report)`` is called after every row with the report so far."""
        from ..engine import PrefillCache
        from ..memory import available_bytes

        torch, a = self.torch, self.args
        kv = self.kv()
        # The oasis rows' drafter reports its probability (EAGLE-3): the "auto" fallback is on.
        label_kv = kv.resolve(reports_confidence=self.random_head_drafter or a.drafter == "eagle3")
        rows, contexts = [], {}
        rep = {
            "mode": "fig11",
            "model": self.model_name,
            "device": torch.cuda.get_device_name(self.dev) if self.cuda else "cpu",
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "num_hidden_layers": self.cfg.num_hidden_layers,
            "max_tokens": a.max_tokens,
            "tp": self.tp,
            "prompts": a.prompts,
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
            },
            "weights_bytes": self.weights_bytes,
            "gpu_kv_budget": a.gpu_kv_budget,
            "gpu_kv_budget_bytes": self.budget,
            "activation_reserve_bytes": a.activation_reserve,
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
            "contexts": contexts,
            "rows": rows,
        }
        # The first forward of a process is slow (allocator, cuBLAS): once, on a short prompt.
        self.warm_up("dense", min(64, self.cfg.max_position_embeddings - a.max_tokens), None)
        for ctx in a.contexts:
            if ctx + a.max_tokens - 1 > self.cfg.max_position_embeddings:
                raise _usage(
                    f"--contexts {ctx} + --max-tokens passes the model's context of "
                    f"{self.cfg.max_position_embeddings} tokens"
                )
            cache = PrefillCache() if a.prompts == "shared" else None
            modes = [*a.modes, *self.spec_modes]  # speculative rows draft from their base rows' tokens
            needs = {m: self.need(m, ctx) for m in modes}
            cold = None
            for mode in modes:
                t = self.warm_up(mode, ctx, cache)
                cold = t if cold is None else cold
            device_free = available_bytes(self.dev)  # beside the weights and the prefill cache
            info = {
                "ttft_cold_s": cold,
                "device_free_bytes": device_free,
                "prefill_cache_bytes": _cache_bytes(cache),
                "max_concurrency": {m: self.max_concurrency(m, needs[m], device_free) for m in a.modes},
                "request_kv_bytes": needs[a.modes[0]]["kv_blocks"] * needs[a.modes[0]]["block_bytes"],
            }
            dense_max = info["max_concurrency"].get("dense")
            info["dense_fills_budget_at"] = None if dense_max is None else dense_max + 1
            contexts[str(ctx)] = info
            for mode in modes:
                for conc in a.concurrency:
                    r = self.row(mode, ctx, conc, needs[mode], device_free, cache)
                    r["ttft_cold_s"] = cold
                    rows.append(r)
                    msg = r.get("reason") or f"{r['decode_tokens_per_s']:.1f} tok/s"
                    print(f"fig11: ctx {ctx} {mode} C={conc}: {msg}", file=sys.stderr)
                    if checkpoint is not None:
                        checkpoint(rep)
            del cache
            _free_memory(torch, self.dev)
        return rep


def _cache_bytes(cache) -> int:
    if cache is None:
        return 0
    total = 0
    for item in cache._items.values():
        total += sum(t.numel() * t.element_size() for t in (*item.k, *item.v))
    return total


def _usage(msg: str) -> Exception:
    from ..errors import ConfigError

    return ConfigError(msg)


# ---------------------------------------------------------------------- reports
def _f(v, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def selection_label(kv) -> str:
    """How a :class:`~oasiskv.KvConfig` selects blocks, in the eval's drafter-suffix words
    (``quest``, ``codes``, ``codes1.25+sticky+succ8``, ``+sink2``, ``+pin4``, ``+conf0.5``)."""
    parts = [kv.block_score]
    if kv.score_candidates is not None:
        parts[0] += f"{kv.score_candidates:g}"
    if kv.sticky_candidates:
        parts.append("sticky")
    if kv.successor_blocks:
        parts.append(f"succ{kv.successor_blocks}")
    if kv.sink_blocks:
        parts.append(f"sink{kv.sink_blocks}")
    if kv.pin_blocks:
        parts.append(f"pin{kv.pin_blocks}")
    if kv.lookahead_min_confidence is not None:
        parts.append(f"conf{kv.lookahead_min_confidence:g}")
    if kv.layer_blocks is not None:
        parts.append("layer-blocks")
    return "+".join(parts)


def markdown(rep: dict) -> str:
    """The report as a markdown table, with a header of what was measured where."""
    gib = 2**30
    c = rep["ceilings"]
    kv = rep["kv"]
    lines = [
        f"## Decode throughput vs concurrency (Fig. 11): {rep['model']}, {rep['device']}, {rep['dtype']}"
        + (f", TP={rep['tp']} (bytes, budgets and rooflines per rank)" if rep.get("tp", 1) > 1 else ""),
        "",
        f"- GPU KV budget {rep['gpu_kv_budget_bytes'] / gib:.1f} GiB ({rep['gpu_kv_budget']}; "
        f"weights {rep['weights_bytes'] / gib:.1f} GiB, "
        f"activation reserve {rep['activation_reserve_bytes'] / gib:.1f} GiB); "
        f"host pool limit {rep['host_limit_bytes'] / gib:.1f} GiB",
        f"- K = {kv['top_k_blocks']} blocks of {kv['block_size']}, "
        f"fetch cap {kv['fetch_cap_blocks']} blocks, "
        f"drafter {kv['drafter']}, {rep['max_tokens']} new tokens, prompts {rep['prompts']}, "
        f"CUDA graphs {rep['cuda_graph']}",
        f"- selection: {kv.get('selection', 'quest')}",
    ]
    sp = rep.get("speculative")
    if sp:
        if sp["draft_acceptance"]:
            cost = (
                f"a random EAGLE-3 head of the target's shape ({sp['draft_head_bytes'] / gib:.2f} GiB) "
                "runs beside it every step, its drafts discarded"
                if sp["draft_cost"] == "eagle3"
                else "nothing (no head runs: an upper bound)"
            )
            if sp.get("draft_verdicts") == "forced":
                lines.append(
                    "- speculative rows (`+spec@a`): an oracle drafter whose verdicts are FORCED: a draft "
                    "is accepted with probability a by a hash of (seed, request, position), whatever the "
                    "logits say (a hit does the work of an acceptance: the draft's K/V stored, two "
                    "tokens; a miss that of a rejection), so the tokens are NOT the model's greedy "
                    f"outputs (a throughput measurement only); its draft costs {cost}"
                )
            else:
                lines.append(
                    "- speculative rows (`+spec@a`): an oracle drafter right with probability a, verified "
                    f"by the engine; its draft costs {cost}; reference iterated until a round reproduces "
                    f"it, at most {sp['oracle_rounds']} rounds"
                )
        else:
            lines.append(f"- speculative rows (`+spec`): drafter {kv['drafter']}, verified by the engine")
        lines.append(
            "- TPOT is step time over tokens made per request; roofline against the step time; "
            "same tokens: the fraction equal to the base mode's row"
        )
    if c:
        lines.append(
            f"- measured here: device-to-device copy {c['d2d_copy_Bps'] / 1e9:.0f} GB/s, "
            f"pinned host-to-device {c['h2d_pinned_Bps'] / 1e9:.1f} GB/s"
        )
    for ctx, info in rep["contexts"].items():
        fills = info.get("dense_fills_budget_at")
        mc = ", ".join(
            f"{m} {f'>= {MAX_SEARCHED}' if n is None else n}" for m, n in info["max_concurrency"].items()
        )
        lines.append(
            f"- context {ctx}: {info['request_kv_bytes'] / gib:.2f} GiB of KV per request; most requests "
            f"that fit: {mc}"
            + (f"; dense fills its KV budget at concurrency {fills}" if fills else "")
            + f"; cold TTFT {_f(info['ttft_cold_s'], 1e3)} ms"
        )
    head = [
        "context", "mode", "conc", "tok/s", "TPOT p50 ms", "TPOT p99 ms", "TTFT p50 ms", "peak GPU GiB",
        "host pool GiB", "fetched/step MiB", "transfer wait/step ms", "kernels/layer/step", "roofline ms",
        "of roofline", "tok/step", "accept", "same tokens", "note",
    ]  # fmt: skip
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rep["rows"]:
        ok = r["status"] == "ok"
        cells = [str(r["context"]), r["mode"], str(r["concurrency"])]
        if ok:
            cells += [
                _f(r["decode_tokens_per_s"]),
                _f(r["tpot_p50_s"], 1e3, 2),
                _f(r["tpot_p99_s"], 1e3, 2),
                _f(r["ttft_p50_s"], 1e3),
                _f(r["peak_gpu_bytes"], 1 / gib, 2),
                _f(r["host_pool_bytes"], 1 / gib, 2),
                _f(r["fetched_bytes_per_step"], 1 / 2**20, 2),
                _f(r.get("transfer_wait_per_step_s") if r["mode"] != "dense" else None, 1e3, 3),
                _f(r["kernels_per_layer_step"]),
                _f(r["roofline_tpot_s"], 1e3, 2),
                "-" if r["roofline_fraction"] is None else f"{r['roofline_fraction']:.0%}",
                _f(r.get("tokens_per_step"), digits=2),
                _f(r.get("acceptance_rate"), digits=3),
                "-" if r.get("tokens_match_base") is None else f"{r['tokens_match_base']:.0%}",
                "; ".join(
                    x for x in (r["host_pool_place"] if r["mode"] != "dense" else "", _ref_note(r)) if x
                ),
            ]
        else:
            cells += ["-"] * 14 + [f"skipped: {r['reason']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ref_note(r: dict) -> str:
    """How an oracle row's verdicts were made: forced, or how its reference ended (empty for
    other rows)."""
    if r.get("draft_verdicts") == "forced":
        return "verdicts forced: tokens are not the model's"
    if r.get("reference_rounds") is None:
        return ""
    if r["reference_converged"]:
        return f"reference in {r['reference_rounds']} rounds"
    return (
        f"reference NOT reached in {r['reference_rounds']} rounds "
        f"({r['off_reference_requests']} requests left it)"
    )


def plot(rep: dict, path: str) -> None:
    """Decode throughput vs concurrency: one panel per context, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = list(rep["contexts"])
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs, strict=True):
        for mode in dict.fromkeys(r["mode"] for r in rep["rows"]):
            pts = [
                (r["concurrency"], r["decode_tokens_per_s"])
                for r in rep["rows"]
                if str(r["context"]) == ctx and r["mode"] == mode and r["status"] == "ok"
            ]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", label=mode)
        fills = rep["contexts"][ctx].get("dense_fills_budget_at")
        tested = [r["concurrency"] for r in rep["rows"] if str(r["context"]) == ctx]
        if fills and fills <= 2 * max(tested):
            ax.axvline(fills, color="grey", linestyle=":", label="dense fills its budget")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"context {ctx}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{rep['model']} on {rep['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    """Run the sweep the parsed ``args`` describe; write the JSON, markdown and plot."""
    from ..errors import OasisError

    if args.max_tokens < 3:
        print(
            "bench.serve: error: --fig11 needs --max-tokens >= 3 (a warm-up step and a timed one)",
            file=sys.stderr,
        )
        return 2

    def write(rep: dict) -> str:
        return _write(args, rep)

    if getattr(args, "tp", 1) > 1:
        if args.cuda_graph or args.speculative:  # graphs are off under --tp (not --enforce-eager)
            flag = "--cuda-graph" if args.cuda_graph else "--speculative"
            print(f"bench.serve: error: --fig11 --tp does not take {flag} yet", file=sys.stderr)
            return 2
        from ..errors import RankFailedError
        from ..parallel import run_tp

        try:
            rep = run_tp(_tp_job, tp=args.tp, args=(args,), backend="gloo" if args.device == "cpu" else None)[
                0
            ]
        except (OasisError, RankFailedError) as e:
            print(f"bench.serve: error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        print(write(rep))
    else:
        try:
            # After every row too: a sweep cut short (a time limit) keeps the rows it made.
            rep = Fig11(args).run(checkpoint=write)
        except (OasisError, MemoryError) as e:
            print(f"bench.serve: error: {e}", file=sys.stderr)
            return 2
        print(write(rep))
    if args.png:
        try:
            plot(rep, args.png)
        except ImportError:  # the GPU machine has no matplotlib: plot the JSON elsewhere
            print(
                'bench.serve: matplotlib is not installed, so no plot; later: python -c "import json; '
                "from oasiskv.bench.fig11 import plot; plot(json.load(open('F.json')), 'F.png')\"",
                file=sys.stderr,
            )
    return 0


def _write(args, rep: dict) -> str:
    """Write the JSON and markdown reports where ``args`` say; returns the markdown."""
    md = markdown(rep)
    for path, text in ((args.json, json.dumps(rep, indent=2)), (args.md, md)):
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    return md


def _tp_job(group, args):
    """One rank of ``--fig11 --tp``: rank 0 runs the sweep (writing the report after every row)
    and returns it; the others build an engine for each set of options rank 0 sends and follow
    it, until rank 0 says it is done."""
    if group.rank != 0:
        return _tp_worker(group, args)
    fig = None
    try:
        fig = Fig11(args, group)
        return fig.run(checkpoint=lambda rep: _write(args, rep))
    finally:
        if group.broken is None:
            if fig is not None:
                fig.close(fig._live)
            group.broadcast_object(("done", None))


def _tp_worker(group, args) -> None:
    from ..engine import PrefillCache
    from ..parallel import TPLLMEngine

    model, _, dev = build_model(args, group)
    import torch

    caches: dict = {}  # rank 0's cache tag -> this rank's cache (of its shard), the latest only
    while True:
        kind, kw = group.broadcast_object(None)
        if kind == "done":
            return None
        tag = kw.get("prefill_cache")
        if tag is not None:
            if tag not in caches:
                caches.clear()  # a new context: the last one's entry goes
                caches[tag] = PrefillCache()
            kw = {**kw, "prefill_cache": caches[tag]}
        eng = TPLLMEngine(model, group=group, **kw)
        eng.worker_loop()
        del eng
        _free_memory(torch, dev)
