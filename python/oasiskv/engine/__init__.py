"""The decode engine: requests, the KV pools, and one forward pass per step.

One :class:`Engine` owns the per-layer pools (GPU pages, host blocks, summaries, head-wise mapping)
and runs batches of requests. Every step it

1. plans on the CPU, once for all layers: which page each request's new token goes to, the
   attention tables (dense requests: their page table; sparse ones: their budget slots plus the
   local block) and the scoring tables of the sparse requests;
2. runs the model forward over the stacked rows ``[x_t ; d_{t+1}]`` of every request; at each
   layer the attention callback appends x_t's K/V (with write-through for sparse requests),
   attends both rows over the working set in one call, and for sparse requests lets the lookahead
   row score the block summaries, select the next step's blocks (delta selection, capped) and
   gather them from the host pool;
3. samples, drafts the next lookahead token, and turns requests sparse once their context passes
   the threshold.

Prefill is dense, one forward over the whole prompt. It captures the drafter's
``capture_layers`` for the first draft, and for a drafter that ``wants_prompt_features`` (an
EAGLE-3 head filling its cache over the prompt) those of every prompt position, handed over by
``Drafter.feed_prompt`` right after that same forward.

On the CPU the "background" stages run inline after each layer's attention; the GPU backend
moves them onto their own streams without changing this structure.

The package's rooms, each a module: :mod:`.requests` (requests, metrics, the prefill cache),
:mod:`.pools` (the KV pools, runtime and admission), :mod:`.selection` (scoring, two-stage top-K,
sinks, pins, successors, recall; the selection chain), :mod:`.speculative` (verification and
commit), :mod:`.graphs` (buckets, capture, replay), :mod:`.step` (the decode step's forward and
its attention callback), :mod:`.model` (:class:`EngineModel`, what the engine calls on a model)
and :mod:`.core` (the :class:`Engine` façade over them). The block source
a disaggregated decode reads from is a :class:`~oasiskv.policy.BlockSource`.
"""

from .core import BACKENDS, Engine
from .graphs import StepGraph
from .model import EngineModel, check_engine_model
from .pools import HOST_POOLS, PIN_NOTICE_BYTES, KvPools, copy_to_host, i32
from .requests import GenerationResult, PrefillCache, Prefilled, Request, RequestMetrics
from .selection import (
    RecallRecorder,
    SparsePlan,
    csr_tables,
    keep_pins,
    keep_sinks,
    recall_overlap,
    relative_to_best,
    successors,
    top_k_forced,
    two_stage_top_k,
)
from .speculative import (
    SAMPLING_FIELDS,
    VERDICT_ACCEPT,
    VERDICT_NONE,
    VERDICT_REJECT,
    RowSampling,
    SpecStep,
    sample_inverse_cdf,
    sampling_inputs,
    sampling_probs,
    verdict_inputs,
    verify_sampled_drafts,
)

__all__ = [
    "BACKENDS",
    "HOST_POOLS",
    "PIN_NOTICE_BYTES",
    "SAMPLING_FIELDS",
    "VERDICT_ACCEPT",
    "VERDICT_NONE",
    "VERDICT_REJECT",
    "Engine",
    "EngineModel",
    "RecallRecorder",
    "GenerationResult",
    "KvPools",
    "PrefillCache",
    "Prefilled",
    "Request",
    "RequestMetrics",
    "RowSampling",
    "SparsePlan",
    "SpecStep",
    "StepGraph",
    "check_engine_model",
    "copy_to_host",
    "csr_tables",
    "i32",
    "keep_pins",
    "keep_sinks",
    "recall_overlap",
    "relative_to_best",
    "sample_inverse_cdf",
    "sampling_inputs",
    "sampling_probs",
    "successors",
    "top_k_forced",
    "two_stage_top_k",
    "verdict_inputs",
    "verify_sampled_drafts",
]
