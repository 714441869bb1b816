"""OasisKV: long-context LLM decoding with the KV cache beyond HBM.

The full KV cache of a long request lives in the host pool; the GPU keeps a bounded working set per
KV head. A lookahead (draft) token runs through the same forward pass; its query ranks tiny
per-block key summaries and the next step's blocks are fetched before that step needs them.

Quick start::

    import oasiskv
    llm = oasiskv.LLM("smollm2", kv=oasiskv.KvConfig(top_k_blocks=64))
    out = llm.generate("Tell me about paged attention.", max_new_tokens=32)[0]
    print(out.text, out.metrics.resident_kv_bytes)
"""

from __future__ import annotations

from . import errors
from .config import KvConfig
from .drafters import Drafter, Eagle3Drafter, NgramDrafter, OracleDrafter, PreviousQueryDrafter
from .engine import GenerationResult, PrefillCache, RequestMetrics
from .errors import (
    CheckpointError,
    ConfigError,
    ContextLengthError,
    CudaUnavailableError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    InvalidTextError,
    OasisError,
    OutOfBlocksError,
    OutOfMemoryError,
    ShapeError,
    UnsupportedQuantizationError,
)
from .llm import LLM
from .llm_engine import LLMEngine, RequestOutput, SamplingParams, StepInfo
from .policy import SelectionPolicy

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "StepInfo",
    "SelectionPolicy",
    "KvConfig",
    "GenerationResult",
    "RequestMetrics",
    "PrefillCache",
    "Drafter",
    "NgramDrafter",
    "Eagle3Drafter",
    "OracleDrafter",
    "PreviousQueryDrafter",
    "errors",
    "OasisError",
    "ConfigError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "InvalidArgumentError",
    "InvalidTextError",
    "OutOfBlocksError",
    "OutOfMemoryError",
    "ContextLengthError",
    "CheckpointError",
    "UnsupportedQuantizationError",
    "CudaUnavailableError",
]
