"""The tests' small model configs, one constant per shape; a test that needs a variant takes
``CFG.replace(...)`` of the nearest one rather than spelling out a new ``ModelConfig``.

Each is small enough for many engine runs on 2 CPU cores (the GPU one excepted). The vocabulary
is odd (301, 257) so that no size divides evenly by accident."""

from __future__ import annotations

from oasiskv.models.config import ModelConfig

#: Qwen3 family (q/k norm), 2 layers, 4 query heads over 2 KV heads of 16: ``fakes.tiny``'s model,
#: the one most engine, speculative and disaggregation tests run.
TINY_QWEN3 = ModelConfig(
    family="qwen3",
    vocab_size=301,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)

#: Qwen3 family, 3 layers, 8 query heads over 2 KV heads of 32 (a GQA group of 4): the engine's
#: and the per-layer budget's model.
QWEN3_3L = ModelConfig(
    family="qwen3",
    vocab_size=301,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
)

#: Llama family, 8 layers (EAGLE-3 capture layers 2, 4, 5), 6 query heads over 2 KV heads of 16:
#: the target of the EAGLE-3 head in the engine's tests.
LLAMA_8L = ModelConfig(
    family="llama",
    vocab_size=257,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=8,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)

#: Llama family, 8 layers, 4 query heads over 2 KV heads of 16, 4096 positions: the evaluation
#: harness's model (long corpora, retrieval prompts).
LLAMA_EVAL = ModelConfig(
    family="llama",
    vocab_size=301,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)

#: Llama family, 8 layers, a vocabulary of 300, head_dim 16 (hidden / heads), 512 positions: the
#: target of the EAGLE-3 head's own tests and of its trainer.
LLAMA_DRAFT_TARGET = ModelConfig("llama", 300, 64, 128, 8, 4, 2, max_position_embeddings=512)

#: Qwen3 family, 3 layers, 8 query heads over 2 KV heads of 64, 4096 positions: the GPU tests'
#: engine model (bfloat16 or float32 on CUDA).
QWEN3_GPU = ModelConfig(
    family="qwen3",
    vocab_size=301,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)
