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

``--concurrency max`` is each mode's largest concurrency that fits its budgets (the report's
"most requests that fit"; a skipped row where not even one fits).

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
* the roofline (:mod:`.roofline`): the larger of the step's HBM time -- the bytes one decode
  step must read (the weights once, and per request what its attention reads: dense, the whole
  context's K and V; oasis and oracle, ``K + 1`` pages per KV head and layer plus the summaries
  scored) over the HBM read bandwidth measured in this run (``ceilings.hbm_read_Bps``: a
  reduction over 1 GiB of bf16, best of 10, CUDA events) -- and its PCIe time -- the bytes the
  oasis rows fetched from the pinned host pool over the pinned host-to-device bandwidth measured
  here (0 for dense and the oracle) -- against the measured step p50: ``roofline_fraction``,
  with ``hbm_fraction``, ``pcie_fraction`` and which one ``roofline_binds``;
  ``roofline_fraction_d2d`` keeps the earlier bound, the reads over a device-to-device copy
  counted as read plus write.

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
  Greedy speculation is lossless where attention is exact (``tests/engine/test_speculative.py``); with a
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
The GPU KV budget (:func:`~.budget.choose_gpu_kv_budget`), named with its bytes in the header,
every context and every row (``gpu_kv_budget_kind``, ``gpu_kv_budget_bytes``): ``real`` is what
the card has free beside the weights and the context's prefill cache, measured per context as the
engine's memory check measures it, less an activation reserve (1 GiB with shared prompts), and,
per mode, what that mode's warm admission needed past the reserve on CUDA
(:func:`~.budget.admission_excess`, ``admission_bytes`` in each context);
``--gpu-kv-budget h100`` emulates an 80 GiB H100: 80 GiB minus the weights minus an activation
reserve (6 GiB); the default ``auto`` is real on an H100 and emulated elsewhere. Oasis modes are
given exactly the pages they need (at most the budget), so their pools are allocated once and the
peak memory shows what they use.

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

The package's rooms, each a module: :mod:`.flags` (the flags, their parsers, the modes),
:mod:`.budget` (the GPU KV budget, the host pool limit, what fits: pure), :mod:`.roofline` (the
bytes a step reads and their time at a bandwidth: pure), :mod:`.drive` (one row's run: prefill,
timed and profiled decode steps), :mod:`.model` (the model under test, device memory between
rows), :mod:`.spec` (the speculative rows: the cost head, the oracle drafter, its rounds and
columns), :mod:`.sweep` (:class:`Fig11`: engines, rows, the report dict), :mod:`.report`
(markdown, plot, files), :mod:`.tp` (the ranks of ``--tp``) and :mod:`.cli` (:func:`main`).
"""

from .budget import (
    ACTIVATION_RESERVE_BYTES,
    H100_BYTES,
    HOST_RAM_FRACTION,
    MAX_FITTING,
    MAX_SEARCHED,
    REAL_ACTIVATION_RESERVE_BYTES,
    Budgets,
    GpuKvBudget,
    activation_reserve,
    budget_kind,
    choose_gpu_kv_budget,
    fit,
    gpu_kv_budget,
    host_kv_limit,
    max_concurrency,
    resolve_concurrency,
)
from .cli import main
from .drive import DoesNotFit, drive, make_prompts, p50_p99, profiled
from .flags import (
    DRAFT_VERDICTS,
    MODES,
    NGRAM_WINDOW,
    ORACLE_ROUNDS,
    UNITS,
    add_arguments,
    mode_parts,
    parse_acceptances,
    parse_budget,
    parse_bytes,
    parse_int_list,
    parse_modes,
    spec_modes,
    usage_error,
)
from .model import build_model, free_memory, hbm_read_Bps
from .report import COLUMNS, fmt, markdown, plot, ref_note, selection_label, write_reports
from .roofline import (
    fraction,
    kv_read_bytes,
    moe_weights_read_bytes,
    pcie_bytes_per_step,
    roofline_columns,
    step_bound,
    step_roofline,
    weights_read_bytes,
)
from .spec import EAGLE3_DRAFT_VOCAB, RANDOM_HEAD, cost_head, oracle_drafter, oracle_rounds, spec_columns
from .sweep import Fig11, cache_bytes
from .tp import tp_job, tp_worker

# The module's names before it became a package (issue 34), kept importable under them.
_UNITS = UNITS
_budget = parse_budget
_int_list = parse_int_list
_modes = parse_modes
_acceptances = parse_acceptances
_pcts = p50_p99
_free_memory = free_memory
_prompts = make_prompts
_profiled = profiled
_DoesNotFit = DoesNotFit
_cache_bytes = cache_bytes
_usage = usage_error
_f = fmt
_ref_note = ref_note
_write = write_reports
_tp_job = tp_job
_tp_worker = tp_worker

__all__ = [
    "ACTIVATION_RESERVE_BYTES",
    "COLUMNS",
    "DRAFT_VERDICTS",
    "EAGLE3_DRAFT_VOCAB",
    "H100_BYTES",
    "HOST_RAM_FRACTION",
    "MAX_SEARCHED",
    "MODES",
    "NGRAM_WINDOW",
    "ORACLE_ROUNDS",
    "RANDOM_HEAD",
    "REAL_ACTIVATION_RESERVE_BYTES",
    "UNITS",
    "Budgets",
    "DoesNotFit",
    "Fig11",
    "GpuKvBudget",
    "activation_reserve",
    "add_arguments",
    "budget_kind",
    "build_model",
    "cache_bytes",
    "choose_gpu_kv_budget",
    "cost_head",
    "drive",
    "fit",
    "fmt",
    "fraction",
    "free_memory",
    "gpu_kv_budget",
    "hbm_read_Bps",
    "host_kv_limit",
    "kv_read_bytes",
    "main",
    "make_prompts",
    "markdown",
    "max_concurrency",
    "MAX_FITTING",
    "resolve_concurrency",
    "mode_parts",
    "moe_weights_read_bytes",
    "oracle_drafter",
    "oracle_rounds",
    "p50_p99",
    "parse_acceptances",
    "parse_budget",
    "parse_bytes",
    "parse_int_list",
    "parse_modes",
    "pcie_bytes_per_step",
    "plot",
    "profiled",
    "ref_note",
    "roofline_columns",
    "selection_label",
    "spec_columns",
    "spec_modes",
    "step_bound",
    "step_roofline",
    "tp_job",
    "tp_worker",
    "usage_error",
    "weights_read_bytes",
    "write_reports",
]
