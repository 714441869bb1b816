"""PyTorch model side of OasisKV: Llama/Qwen3 decoders without attention, loaders, tokenizer, EAGLE-3 head.

from oasiskv.models import load_model, dense_causal_attn
model, tok = load_model("smollm2")                     # bundled SmolLM2-135M-Instruct (GGUF Q4_1)
ids = torch.tensor(tok.encode("The capital of France is"))
logits, captured = model(ids, torch.arange(len(ids)), dense_causal_attn(), capture_layers=(2, 15, 27))
"""

from oasiskv.models.config import ModelConfig, estimate_model_bytes
from oasiskv.models.eagle3 import Eagle3Head, Eagle3PagedKV, Eagle3State, eagle3_capture_layers
from oasiskv.models.loader import load_gguf, load_hf_dir, load_model, smollm2_gguf_path
from oasiskv.models.tokenizer import Tokenizer
from oasiskv.models.transformer import (
    AttnFn,
    CausalLM,
    DenseKVCache,
    causal_attention,
    dense_causal_attn,
    greedy_generate,
    varlen_causal_attention,
)

__all__ = [
    "AttnFn",
    "CausalLM",
    "DenseKVCache",
    "Eagle3Head",
    "Eagle3PagedKV",
    "Eagle3State",
    "ModelConfig",
    "Tokenizer",
    "causal_attention",
    "dense_causal_attn",
    "eagle3_capture_layers",
    "estimate_model_bytes",
    "greedy_generate",
    "load_gguf",
    "load_hf_dir",
    "load_model",
    "smollm2_gguf_path",
    "varlen_causal_attention",
]
