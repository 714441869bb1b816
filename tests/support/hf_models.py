"""transformers' own Llama and Qwen3 models on random weights, small and deliberately odd
geometries (``HF_CASES``): the anchors of the model tests (``tests/models/test_models.py``) and of
the fused decoder path (``tests/kernels/test_fused.py``). Needs transformers (imported on use)."""

from __future__ import annotations

import torch

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
#: Qwen3's 128K recipe (factor 4 over the trained context) scaled down: 64 positions trained, 256 run.
YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


# small, deliberately odd geometries
HF_CASES = {
    "llama-gqa3": dict(family="llama", heads=6, kv=2, head_dim=16),
    "llama-mha": dict(family="llama", heads=6, kv=6, head_dim=16),
    "llama-llama3rope": dict(family="llama", heads=6, kv=3, head_dim=16, rope_scaling=LLAMA3_SCALING),
    "llama-linear-tied": dict(
        family="llama",
        heads=6,
        kv=2,
        head_dim=16,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie=True,
    ),
    "qwen3-gqa3": dict(family="qwen3", heads=6, kv=2, head_dim=24),
    "qwen3-mha-tied": dict(family="qwen3", heads=6, kv=6, head_dim=16, tie=True),
    "qwen3-yarn": dict(family="qwen3", heads=6, kv=2, head_dim=16, rope_scaling=YARN_SCALING, max_pos=256),
    "llama-yarn": dict(family="llama", heads=6, kv=3, head_dim=16, rope_scaling=YARN_SCALING, max_pos=256),
}


def make_hf_model(case: dict, seed: int = 0):
    """transformers' model of one of ``HF_CASES``, in eval mode, its norms random around 1."""
    import transformers

    kw = dict(
        vocab_size=257,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=case["heads"],
        num_key_value_heads=case["kv"],
        head_dim=case["head_dim"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=case.get("max_pos", 512),
        tie_word_embeddings=case.get("tie", False),
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    if case.get("rope_scaling"):
        kw["rope_scaling"] = dict(case["rope_scaling"])
    torch.manual_seed(seed)
    if case["family"] == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
    with torch.no_grad():  # make the norms matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval()
