"""Tiny checkpoints written by the tests: a byte-level BPE tokenizer of 265 ids (3 specials, 256
bytes, 6 merges), its small Llama/Qwen3 config (``tiny_cfg``), a model written as an HF directory
(``write_hf_dir``) or as a GGUF file the way llama.cpp's converter writes it (``write_gguf``), and
a model's weights after a quantisation round trip (``roundtrip``). Used by the loader tests
(``tests/models/test_loaders.py``) and the bad-input audit (``tests/api/test_bad_input.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from oasiskv.models.config import ModelConfig
from oasiskv.models.tokenizer import bytes_to_unicode
from oasiskv.models.transformer import CausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at"]
MERGED = ["Ġt", "he", "Ġthe", "Ġc", "at", "Ġcat"]
TOKENS = SPECIALS + [bytes_to_unicode()[b] for b in range(256)] + MERGED
TOKEN_TYPES = [3] * len(SPECIALS) + [1] * (256 + len(MERGED))
VOCAB = len(TOKENS)  # 265
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_cfg(family: str = "llama", **kw) -> ModelConfig:
    base = dict(
        family=family,
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_ids=[2],
    )
    base.update(kw)
    return ModelConfig(**base)


def write_hf_dir(model: CausalLM, d: Path, drop: str | None = None, reshape: str | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    sd = model.hf_state_dict()
    if drop:
        sd.pop(drop)
    if reshape:
        sd[reshape] = sd[reshape][:-1].clone()
    save_file(sd, str(d / "model.safetensors"))
    return d


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    # verbatim from llama.cpp convert_hf_to_gguf.py (LlamaModel.permute)
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{HF_TO_GGUF[rest.removesuffix('.weight')]}.weight"


def write_gguf(
    model: CausalLM,
    path: Path,
    qtype: Q = Q.F32,
    tokenizer: bool = True,
    arch: str | None = None,
    override_type: tuple[str, Q] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    meta=None,
) -> Path:
    """``model`` as a llama.cpp-style GGUF at ``path``; ``meta(writer)`` adds metadata keys of its
    own (e.g. rope scaling) after the standard ones."""
    cfg = model.config
    arch = arch or cfg.family
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_file_type(int(qtype) if qtype != Q.F32 else 0)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(TOKENS)
        w.add_token_types(TOKEN_TYPES)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(CHAT_TEMPLATE)
    else:
        w.add_vocab_size(cfg.vocab_size)
    for name, t in model.hf_state_dict().items():
        arr = t.float().numpy()
        if cfg.family == "llama" and name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_attention_heads)
        elif cfg.family == "llama" and name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_key_value_heads)
        gname = gguf_name(name)
        if override_type and gname == override_type[0]:
            qt = override_type[1]
            block, size = gguf.GGML_QUANT_SIZES[qt]
            raw = np.random.default_rng(0).integers(
                0, 255, (arr.shape[0], 256 // block * size), dtype=np.uint8
            )
            w.add_tensor(gname, raw, raw_dtype=qt)
        elif arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    if meta is not None:
        meta(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def roundtrip(model: CausalLM, qtype: Q) -> CausalLM:
    """The model with every 2-D weight replaced by dequantize(quantize(w))."""
    if qtype == Q.F32:
        return model
    ref = CausalLM(model.config)
    sd = model.hf_state_dict()
    for name, t in sd.items():
        if t.dim() == 2:
            arr = t.numpy()
            if qtype == Q.F16:
                arr = arr.astype(np.float16).astype(np.float32)
            elif qtype == Q.BF16:  # gguf rounds to nearest even, like torch
                arr = t.bfloat16().float().numpy()
            else:
                arr = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
            sd[name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    ref.load_hf_state_dict(sd)
    return ref
