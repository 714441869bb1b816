"""Llama / Qwen3 decoder in PyTorch that does not own its attention.

:class:`CausalLM` computes everything of a decoder step except attention itself: embeddings,
RMSNorm pre-norms, the fused QKV projection, Qwen3's per-head q/k RMSNorm, rotate-half RoPE (with
llama3 or linear scaling), the SwiGLU MLP (or Qwen3-MoE's mixture of SwiGLU experts,
:mod:`oasiskv.models.moe`), the final norm and the LM head. At layer ``i`` it calls
``attn(i, q, k, v)`` and the caller decides where K/V live (a paged GPU pool, a host block store,
or the dense helpers below).

Tokens are a flat varlen batch (vLLM style): the rows of several requests are concatenated and
``positions`` gives each row's position inside its own request. Numerics follow Hugging Face
transformers (RMSNorm in float32, RoPE tables in float32 then cast to the compute dtype).

On CUDA tensors the elementwise work of a layer runs in fused kernels of :mod:`oasiskv.ops`
(issue 10; :data:`FUSED_KERNELS`): each RMSNorm is one kernel that also adds the residual (the
attention output into the post-attention norm, the MLP output into the next layer's input norm),
and q/k norm + RoPE + the V copy are one kernel straight from the QKV projection. They round as
the torch code does (only the sum of squares of a norm and cos/sin may differ from torch's in the
last float32 bit); the torch code below stays the reference, and runs on the CPU.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.torch_version import TorchVersion

try:  # torch >= 2.3
    from torch.nn.attention.bias import CausalBias, causal_lower_right
except ImportError:  # pragma: no cover - older torch: the explicit mask
    CausalBias = causal_lower_right = None
try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - older torch: its default backends
    SDPBackend = sdpa_kernel = None

from oasiskv import ops
from oasiskv.errors import ConfigError, ContextLengthError, ShapeError
from oasiskv.memory import ensure_fits, format_bytes
from oasiskv.models.config import ModelConfig, estimate_model_bytes, yarn_attention_factor
from oasiskv.models.moe import SparseMoE

#: ``attn(layer_index, q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]) -> o [n, Hq, D]``
AttnFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


# ---------------------------------------------------------------------------------------- numerics
#: Where the decoder runs the fused kernels of :mod:`oasiskv.ops` (``rms_norm``, ``qk_norm_rope``)
#: instead of its torch expressions: ``"cuda"`` (on CUDA tensors: the default), ``"always"`` (the CPU
#: twins too; for tests of the fused path without a GPU) or ``"never"`` (the torch code everywhere).
#: Read at every call (RMSNorm) and once per :meth:`CausalLM.forward` (the layers).
FUSED_KERNELS = "cuda"
#: Whether the fused path also takes the MLP's ``silu(gate) * up`` as one kernel
#: (:func:`oasiskv.ops.silu_mul`) instead of torch's two; read once per layer call. Off until the
#: kernel has run on a GPU (its test: tests/kernels/test_gpu_silu_mul.py) and shown a faster step
#: (``experiments/exp_step_host.py --silu-mul`` / ``--no-silu-mul``, results/pending-s27/s27c.sh).
FUSED_SILU_MUL = False
_FUSED_MODES = ("cuda", "always", "never")
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_fused(x: Tensor, *weights: Tensor) -> bool:
    """Whether an op on ``x`` (with ``weights``) runs as a fused kernel: as :data:`FUSED_KERNELS`
    says, for a dtype the kernels take (the weights in ``x``'s), and never where autograd needs
    the graph (the kernels have no backward: training the EAGLE-3 head keeps the torch code)."""
    mode = FUSED_KERNELS
    if mode not in _FUSED_MODES:
        raise ConfigError(f"FUSED_KERNELS must be one of {_FUSED_MODES}, got {mode!r}")
    if mode == "never" or (mode == "cuda" and not x.is_cuda):
        return False
    if x.dtype not in _FUSED_DTYPES or any(w.dtype != x.dtype for w in weights):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF-style RMSNorm: normalise in float32, cast back, then scale by ``weight``.

    Where :func:`use_fused` says so (CUDA), one kernel (:func:`oasiskv.ops.rms_norm`) with the same
    rounding; its sum of squares takes its own order (the last bit of float32 results may differ).
    """
    if use_fused(x, weight):
        return ops.rms_norm(x, weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse RoPE frequencies [head_dim // 2] (float32), with llama3 / linear / yarn scaling
    applied (yarn's cos/sin factor is :func:`rope_attention_factor`)."""
    dim = cfg.head_dim
    assert dim is not None
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs["rope_type"] == "linear":
        return inv_freq / rs["factor"]
    if rs["rope_type"] == "yarn":
        return _yarn_inv_freq(cfg.rope_theta, dim, rs)
    # llama3 (same arithmetic as transformers' _compute_llama3_parameters)
    factor = rs["factor"]
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(base: float, dim: int, rs: dict) -> Tensor:
    """YaRN's frequencies (transformers' ``_compute_yarn_parameters``, the same float32 steps):
    pairs that turn more than ``beta_fast`` times over the original context keep their frequency
    (extrapolation), those under ``beta_slow`` times are divided by ``factor`` (interpolation), a
    linear ramp over the pair index between."""
    factor, orig = rs["factor"], rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the pair that turns num_rotations times
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (transformers' ``attention_scaling``): YaRN's
    (:func:`~oasiskv.models.config.yarn_attention_factor`), 1.0 for every other RoPE."""
    rs = cfg.rope_scaling
    return yarn_attention_factor(rs) if rs is not None and rs["rope_type"] == "yarn" else 1.0


def rope_cos_sin(
    inv_freq: Tensor, positions: Tensor, dtype: torch.dtype, attention_factor: float = 1.0
) -> tuple[Tensor, Tensor]:
    """cos/sin tables [n, 1, head_dim] for ``positions`` [n] (computed in float32, times
    ``attention_factor`` (:func:`rope_attention_factor`) as transformers does, cast to ``dtype``)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(device=positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class Rope(NamedTuple):
    """The RoPE inputs of one forward (:meth:`CausalLM.rope`): ``positions`` [n] and ``inv_freq``
    [head_dim // 2] (float32), which the fused kernel reads, and the torch path's ``cos``/``sin``
    tables [n, 1, head_dim] (``None`` on the fused path, which needs no tables). ``kv_groups``: the
    row order of the k and v each layer hands to ``attn`` (see :meth:`CausalLM.forward`).
    ``attention_factor``: YaRN's scale of cos and sin (:func:`rope_attention_factor`), already in
    the tables; the fused path applies it to the rotated q and k."""

    positions: Tensor
    inv_freq: Tensor
    cos: Tensor | None
    sin: Tensor | None
    kv_groups: int = 1
    attention_factor: float = 1.0

    @property
    def fused(self) -> bool:
        return self.cos is None


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on x [n, heads, D] with cos/sin [n, 1, D]."""
    return x * cos + rotate_half(x) * sin


# -------------------------------------------------------------------------------------- attention
#: torch >= 2.5: SDPA's ``enable_gqa`` lets query head g read KV head g // (Hq // Hkv) in place (the
#: flash kernel indexes the shared head); older torch repeats the KV heads (a copy of K and V).
SDPA_GQA = TorchVersion(torch.__version__) >= (2, 5)
#: Whether SDPA passes ``enable_gqa`` on to a ``CausalBias`` mask (else a GQA chunk takes the
#: explicit mask).
_BIAS_GQA = CausalBias is not None and "enable_gqa" in inspect.signature(CausalBias._dispatch).parameters


def _chunk_mask(nq: int, nk: int, q: Tensor, gqa: bool):
    """The causal mask of ``nq`` queries that are the LAST of ``nk`` positions (bottom-right
    aligned): query i sees keys 0 ..= nk - nq + i.

    On CUDA in 16-bit floats this is torch's ``causal_lower_right`` bias, which SDPA runs as the
    flash kernel's own causal mask (flash aligns it bottom-right when nq < nk): nothing
    materialised. Elsewhere (CPU, float32, where no fused kernel takes the bias) an explicit
    boolean [nq, nk] mask.
    """
    fused = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if causal_lower_right is not None and fused and (_BIAS_GQA or not gqa):
        return causal_lower_right(nq, nk)
    rows = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
    return torch.arange(nk, device=q.device)[None, :] <= rows


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Causal attention of ONE contiguous sequence (torch SDPA, GQA without copying KV heads).

    q [nq, Hq, D]; k, v [nk, Hkv, D] with nk >= nq. The queries are the LAST nq positions of the
    nk-long sequence (so a chunk can attend to a cached prefix). Query head g uses KV head
    g // (Hq // Hkv). Returns [nq, Hq, D] (contiguous, q's dtype). ``scale`` defaults to D ** -0.5.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ShapeError(
            f"causal_attention expects q [nq, Hq, D] and k, v [nk, Hkv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    nq, hq, _ = q.shape
    nk, hkv, _ = k.shape
    if nk < nq or hq % hkv:
        raise ShapeError(
            "causal_attention needs nk >= nq and Hq a multiple "
            f"of Hkv; got nq={nq}, nk={nk}, Hq={hq}, Hkv={hkv}"
        )
    gqa = {}
    if hq != hkv:
        if SDPA_GQA:
            gqa["enable_gqa"] = True
        else:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
    # NOTE: 4-D [1, heads, n, D] views. On CUDA SDPA picks a fused kernel (flash, memory-efficient)
    # only for 4-D inputs; 3-D ones run the math backend, which materialises the [Hq, nq, nk]
    # scores: 17 GB or more a layer for a 16K-token Qwen3-8B prompt, seconds of prefill.
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if nq == nk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, **gqa)
    else:
        with _no_cudnn(q):
            if nq == 1:  # the last position sees every key: no mask
                out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale, **gqa)
            else:
                mask = _chunk_mask(nq, nk, q, bool(gqa))
                out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, **gqa)
    return out[0].transpose(0, 1).contiguous()


#: The SDPA backends a query against a longer cache may use on CUDA: all but cuDNN's. cuDNN
#: builds an execution plan per new shape, 40-70 ms on the H200 (torch 2.11), and a decoding
#: cache has a new length every step: an EAGLE-3 head's per-request attention cost 4 ms a call
#: until every length had been seen once (docs/PERF.md). Full causal prefill (nq == nk) keeps
#: cuDNN: one plan per prompt length serves every layer, and it runs there at twice flash's speed.
_NO_CUDNN = (
    None
    if sdpa_kernel is None
    else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
)


def _no_cudnn(q: Tensor):
    if _NO_CUDNN is None or not q.is_cuda:
        return contextlib.nullcontext()
    return sdpa_kernel(_NO_CUDNN)


def varlen_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Sequence[int] | Tensor, scale: float | None = None
) -> Tensor:
    """:func:`causal_attention` over a flat varlen batch; ``cu_seqlens`` = [0, len0, len0+len1, ...]."""
    cu = [int(x) for x in cu_seqlens]
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ShapeError(f"cu_seqlens must rise from 0 to n_tok={q.shape[0]}, got {cu}")
    if len(cu) == 2:
        return causal_attention(q, k, v, scale)
    out = torch.empty_like(q)
    for a, b in zip(cu, cu[1:], strict=False):
        if b > a:
            out[a:b] = causal_attention(q[a:b], k[a:b], v[a:b], scale)
    return out


def dense_causal_attn(cu_seqlens: Sequence[int] | Tensor | None = None, scale: float | None = None) -> AttnFn:
    """An ``attn`` callable for :meth:`CausalLM.forward` that runs full causal attention over the
    given tokens alone (no cache): one sequence, or a varlen batch described by ``cu_seqlens``."""

    def attn(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if cu_seqlens is None:
            return causal_attention(q, k, v, scale)
        return varlen_causal_attention(q, k, v, cu_seqlens, scale)

    return attn


class DenseKVCache:
    """A plain per-layer KV cache for ONE sequence, usable as the ``attn`` callable.

    Meant for tests, references and small prefill/generation jobs, not the production path. Each call
    appends the new K/V of that layer and attends causally over everything cached so far.
    """

    def __init__(self, num_layers: int, scale: float | None = None) -> None:
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers
        self.scale = scale

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else int(self.k[0].shape[0])

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        pk, pv = self.k[layer], self.v[layer]
        if pk is not None:
            k = torch.cat((pk, k))
            v = torch.cat((pv, v))  # type: ignore[arg-type]
        self.k[layer], self.v[layer] = k, v
        return causal_attention(q, k, v, self.scale)


# ------------------------------------------------------------------------------------------ model
def check_model_fits(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> None:
    """Raise :class:`~oasiskv.errors.OutOfMemoryError` when the weights of ``cfg`` in ``dtype`` would
    not fit in the free memory of ``device``, naming the sizes that make them large.

    Runs before anything is allocated: a config with ``vocab_size=10**11`` otherwise ends in a raw
    allocator ``RuntimeError``, or an OOM kill while the weights are copied in.
    """
    emb = cfg.embedding_parameters * dtype.itemsize
    layers = cfg.decoder_parameters * dtype.itemsize
    if emb >= layers:
        tied = "tied" if cfg.tie_word_embeddings else "untied"
        sizes = f"{tied} embeddings of vocab_size={cfg.vocab_size} x hidden_size={cfg.hidden_size}"
    elif cfg.is_moe:
        sizes = (
            f"num_hidden_layers={cfg.num_hidden_layers} layers of hidden_size={cfg.hidden_size}, "
            f"num_experts={cfg.num_experts} x moe_intermediate_size={cfg.moe_intermediate_size}"
        )
    else:
        sizes = (
            f"num_hidden_layers={cfg.num_hidden_layers} layers of hidden_size={cfg.hidden_size}, "
            f"intermediate_size={cfg.intermediate_size}"
        )
    ensure_fits(
        estimate_model_bytes(cfg, dtype),
        device,
        what=f"the model weights in {str(dtype).removeprefix('torch.')} ({format_bytes(max(emb, layers))} of "
        f"them in {sizes})",
        fix="check those sizes in config.json (or the GGUF metadata), load with a smaller dtype "
        "(bfloat16) or on a device with more free memory",
    )


class DecoderLayer(nn.Module):
    """One pre-norm block: fused QKV, optional per-head q/k norm (Qwen3), RoPE, and a SwiGLU MLP
    (``gate_up_proj``, ``down_proj``) or, where ``cfg.is_moe_layer(layer_idx)``, a mixture of
    SwiGLU experts (``moe``, :class:`~oasiskv.models.moe.SparseMoE`)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, layer_idx: int = 0) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        assert d is not None
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = d
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.intermediate_size = cfg.intermediate_size
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h, **kw))
        self.qk_norm = cfg.family == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, **kw)
        self.o_proj = nn.Parameter(torch.empty(h, self.q_size, **kw))
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.moe: SparseMoE | None = None
        if cfg.is_moe_layer(layer_idx):
            self.moe = SparseMoE(
                h,
                cfg.num_experts,
                cfg.moe_intermediate_size,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                **kw,
            )
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h, **kw))
            self.down_proj = nn.Parameter(torch.empty(h, cfg.intermediate_size, **kw))
        self.eps = cfg.rms_norm_eps
        #: Tensor parallelism (:mod:`oasiskv.models.tp`): the sum over the ranks of a row-parallel
        #: projection's partial output (o_proj, down_proj), or None in one process.
        self.all_reduce: Callable[[Tensor], Tensor] | None = None

    def forward(
        self, layer_idx: int, h: Tensor, rope: Rope, attn: AttnFn, delta: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """The layer over rows ``h`` [n, hidden] of the residual stream; returns ``(h, delta)``.

        The stream entering (and leaving) the layer is ``h + delta``: on the fused path
        (``rope.fused``) a residual add is left to the norm that follows it, so ``delta`` is the
        previous layer's MLP output, added inside this layer's input norm, and the layer returns its
        own MLP output as the next ``delta``. The torch path takes and returns ``delta = None``.
        """
        n = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        fused = rope.fused
        if delta is not None:
            x, h = ops.rms_norm(delta, self.input_layernorm.weight, self.input_layernorm.eps, residual=h)
        else:
            x = self.input_layernorm(h)
        qkv = F.linear(x, self.qkv_proj)
        if fused:
            # q/k norm, RoPE at rope.positions and the copies into contiguous q, k, v: one kernel.
            norms = (
                (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
                if self.qk_norm
                else (None, None, 0.0)
            )
            q, k, v = ops.qk_norm_rope(
                qkv,
                self.q_size,
                self.kv_size,
                hq,
                hkv,
                d,
                rope.positions,
                rope.inv_freq,
                *norms,
                kv_groups=rope.kv_groups,
                rope_scale=rope.attention_factor,  # YaRN's cos/sin scale (1.0 otherwise)
            )
        else:
            q = qkv[:, : self.q_size].view(n, hq, d)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, hkv, d)
            v = qkv[:, self.q_size + self.kv_size :].contiguous().view(n, hkv, d)
            if self.qk_norm:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q = apply_rope(q, rope.cos, rope.sin).contiguous()
            k = apply_rope(k, rope.cos, rope.sin).contiguous()
            if rope.kv_groups > 1:  # what the fused kernel writes directly
                g = rope.kv_groups
                k = k.view(n // g, g, hkv, d).transpose(0, 1).reshape(n, hkv, d)
                v = v.view(n // g, g, hkv, d).transpose(0, 1).reshape(n, hkv, d)
        o = attn(layer_idx, q, k, v)
        if o.shape != q.shape:
            raise ShapeError(
                f"attn(layer={layer_idx}) returned shape {tuple(o.shape)}, expected {tuple(q.shape)} "
                "([n_tok, num_heads, head_dim], same as q)"
            )
        attn_out = F.linear(o.reshape(n, self.q_size).to(h.dtype), self.o_proj)
        if self.all_reduce is not None:
            attn_out = self.all_reduce(attn_out)
        if fused:
            norm = self.post_attention_layernorm
            x, h = ops.rms_norm(attn_out, norm.weight, norm.eps, residual=h)
        else:
            h = h + attn_out
            x = self.post_attention_layernorm(h)
        if self.moe is not None:
            mlp_out = self.moe(x)
        else:
            gu = F.linear(x, self.gate_up_proj)
            if fused and FUSED_SILU_MUL:  # silu(gate) * up in one kernel, not two (issue 35)
                act = ops.silu_mul(gu)
            else:
                g, u = gu[:, : self.intermediate_size], gu[:, self.intermediate_size :]
                act = F.silu(g) * u
            mlp_out = F.linear(act, self.down_proj)
        if self.all_reduce is not None:
            mlp_out = self.all_reduce(mlp_out)
        if fused:
            return h, mlp_out
        return h + mlp_out, None


class CausalLM(nn.Module):
    """Llama / Qwen3 causal LM without attention (see the module docstring).

    ``CausalLM(cfg, dtype, device)`` allocates UNINITIALISED weights; use :meth:`random`, or the loaders
    in :mod:`oasiskv.models.loader`. Parameters have ``requires_grad=False`` (inference model).
    """

    #: oasiskv.engine.EngineModel: no score reduction (TPCausalLM sets one where KV heads are
    #: replicated across ranks); forward takes ``kv_groups`` and hands K/V grouped by row.
    score_reduce = None
    groups_kv = True

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ConfigError(f"CausalLM needs a ModelConfig, got {type(cfg).__name__}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"compute dtype must be float32, bfloat16 or float16, got {dtype}")
        check_model_fits(cfg, dtype, device)
        self.config = cfg
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, **kw)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens.weight
        else:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw))
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        #: YaRN's scale of cos and sin (1.0 for other RoPE): :func:`rope_attention_factor`.
        self.rope_attention_factor = rope_attention_factor(cfg)
        self.requires_grad_(False)

    # ------------------------------------------------------------------ properties
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim  # type: ignore[return-value]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def attn_scale(self) -> float:
        """Softmax scale the attention must use: head_dim ** -0.5."""
        return self.head_dim**-0.5

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def check_context_length(self, num_tokens: int) -> None:
        """Raise :class:`ContextLengthError` if ``num_tokens`` positions exceed the model's window."""
        limit = self.config.max_position_embeddings
        if num_tokens > limit:
            raise ContextLengthError(
                f"{num_tokens} tokens exceed the model's context window of {limit} "
                "(max_position_embeddings); shorten the prompt or request fewer new tokens"
            )

    def set_rope_freq_factors(self, factors: Tensor) -> None:
        """Divide the RoPE inverse frequencies by per-pair ``factors`` [head_dim // 2] (llama.cpp's
        ``rope_freqs`` tensor, used by GGUF conversions of llama3-scaled models)."""
        base = rope_inv_freq(self.config.replace(rope_scaling=None))
        if factors.shape != base.shape:
            raise ShapeError(
                f"rope freq factors must have shape {tuple(base.shape)}, got {tuple(factors.shape)}"
            )
        self.inv_freq = (base / factors.float().cpu()).to(self.inv_freq.device)

    # ------------------------------------------------------------------ forward
    def rope(self, positions: Tensor, like: Tensor) -> Rope:
        """The RoPE inputs of a forward over ``positions`` [n] with activations like ``like``: the
        positions and inverse frequencies on ``like``'s device for the fused kernel (where
        :func:`use_fused` says so; the final norm's weight stands for the model's, whose dtype and
        ``requires_grad`` they share), else also the cos/sin tables in ``like``'s dtype."""
        if use_fused(like, self.norm.weight):
            if positions.dtype not in (torch.int64, torch.int32):
                positions = positions.long()
            positions = positions.to(like.device).contiguous()
            return Rope(positions, self.inv_freq, None, None, attention_factor=self.rope_attention_factor)
        cos, sin = rope_cos_sin(self.inv_freq, positions, like.dtype, self.rope_attention_factor)
        return Rope(positions, self.inv_freq, cos, sin, attention_factor=self.rope_attention_factor)

    def embed(self, ids: Tensor) -> Tensor:
        """Token embeddings [n, hidden] in the compute dtype."""
        return F.embedding(ids, self.embed_tokens.weight)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm + LM head on residual-stream rows [n, hidden] -> float32 logits [n, vocab]."""
        return F.linear(self.norm(hidden), self.lm_head).float()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttnFn,
        logits_rows: Tensor | None = None,
        capture_layers: Sequence[int] = (),
        kv_groups: int = 1,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Run the decoder over a flat varlen batch.

        input_ids, positions: LongTensor [n_tok]. ``attn(i, q, k, v)`` is called at layer i with
        contiguous q [n_tok, num_heads, head_dim] and k, v [n_tok, num_kv_heads, head_dim] (after q/k
        norm and RoPE at ``positions``) and must return o [n_tok, num_heads, head_dim].

        ``kv_groups`` = G > 1 (dividing n_tok; a decode step's G rows per request): k and v come
        grouped by row, token ``s * G + r`` at row ``r * (n_tok / G) + s`` (each row index of every
        request contiguous, as the fused kernel writes them without a copy); q and o keep the
        token order.

        Returns ``(logits, captured)``: float32 logits [len(logits_rows), vocab] (all rows when
        ``logits_rows`` is None) and ``captured[i]`` = the residual stream ENTERING layer i
        (captured[0] = embeddings, captured[num_layers] = output of the last layer before the final
        norm) for every i in ``capture_layers``.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ShapeError(
                f"input_ids and positions must both be 1-D [n_tok]; got {tuple(input_ids.shape)} and "
                f"{tuple(positions.shape)} (flatten a batch of requests into one varlen row list)"
            )
        if input_ids.dtype.is_floating_point or positions.dtype.is_floating_point:
            raise ShapeError("input_ids and positions must be integer (LongTensor) tensors")
        want = set()
        for i in capture_layers:
            if not 0 <= int(i) <= self.num_layers:
                raise ShapeError(f"capture layer {i} is outside [0, {self.num_layers}]")
            want.add(int(i))
        if not isinstance(kv_groups, int) or kv_groups < 1 or input_ids.shape[0] % kv_groups:
            raise ShapeError(
                f"kv_groups must be an int >= 1 dividing n_tok = {input_ids.shape[0]}, got {kv_groups!r}"
            )
        captured: dict[int, Tensor] = {}
        h = self.embed(input_ids)
        rope = self.rope(positions, h)
        if kv_groups > 1:
            rope = rope._replace(kv_groups=kv_groups)
        # The residual stream is h + delta: on the fused path each layer leaves its MLP output
        # for the next layer's input norm to add (one kernel instead of an add and a norm).
        delta = None
        for i, layer in enumerate(self.layers):
            if i in want and delta is not None:
                h, delta = h + delta, None
            if i in want:
                captured[i] = h
            h, delta = layer(i, h, rope, attn, delta)
        if delta is not None:
            h = h + delta
        if self.num_layers in want:
            captured[self.num_layers] = h
        if logits_rows is not None:
            h = h[logits_rows]
        return self.logits(h), captured

    # ------------------------------------------------------------------ weights
    def hf_tensor_slots(self) -> dict[str, Tensor]:
        """Hugging Face tensor name -> the view of our (fused) parameter it fills.

        Names follow ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``
        (``model.layers.N.self_attn.q_proj.weight``, ``model.layers.N.mlp.experts.E.up_proj.weight``
        ...); ``lm_head.weight`` is absent when the embeddings are tied.
        """
        cfg = self.config
        slots: dict[str, Tensor] = {"model.embed_tokens.weight": self.embed_tokens.weight.data}
        qs, kvs, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qkv = layer.qkv_proj.data
            slots[p + "input_layernorm.weight"] = layer.input_layernorm.weight.data
            slots[p + "self_attn.q_proj.weight"] = qkv[:qs]
            slots[p + "self_attn.k_proj.weight"] = qkv[qs : qs + kvs]
            slots[p + "self_attn.v_proj.weight"] = qkv[qs + kvs :]
            slots[p + "self_attn.o_proj.weight"] = layer.o_proj.data
            if layer.qk_norm:
                slots[p + "self_attn.q_norm.weight"] = layer.q_norm.weight.data
                slots[p + "self_attn.k_norm.weight"] = layer.k_norm.weight.data
            slots[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.data
            if layer.moe is not None:
                slots.update(layer.moe.hf_tensor_slots(p))
                continue
            slots[p + "mlp.gate_proj.weight"] = layer.gate_up_proj.data[:inter]
            slots[p + "mlp.up_proj.weight"] = layer.gate_up_proj.data[inter:]
            slots[p + "mlp.down_proj.weight"] = layer.down_proj.data
        slots["model.norm.weight"] = self.norm.weight.data
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = self.lm_head.data
        return slots

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Weights under Hugging Face names (copies), e.g. for ``safetensors.torch.save_file``."""
        return {k: v.detach().clone().contiguous() for k, v in self.hf_tensor_slots().items()}

    def load_hf_state_dict(self, tensors: dict[str, Tensor], strict: bool = True) -> None:
        """Copy Hugging Face-named tensors into the model (shapes must match exactly)."""
        slots = self.hf_tensor_slots()
        missing = [n for n in slots if n not in tensors]
        if strict and missing:
            raise ShapeError(f"missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for name, t in tensors.items():
                dst = slots.get(name)
                if dst is None:
                    continue
                if tuple(t.shape) != tuple(dst.shape):
                    raise ShapeError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(t)

    @classmethod
    def random(
        cls,
        cfg: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        std: float = 0.02,
    ) -> CausalLM:
        """Deterministically initialised model: matrices ~ N(0, std), norm weights = 1 + N(0, 0.1)."""
        model = cls(cfg, dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, t in sorted(model.hf_tensor_slots().items()):
                if name.endswith("norm.weight"):
                    vals = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
                else:
                    vals = std * torch.randn(t.shape, generator=gen)
                t.copy_(vals)
        return model

    def extra_repr(self) -> str:
        c = self.config
        moe = f", experts={c.num_experts}/top{c.num_experts_per_tok}" if c.num_experts else ""
        return (
            f"family={c.family}{moe}, layers={c.num_hidden_layers}, "
            f"hidden={c.hidden_size}, heads={c.num_attention_heads}"
            f"/{c.num_key_value_heads}, head_dim={c.head_dim}, vocab={c.vocab_size}, dtype={self.dtype}"
        )


@torch.no_grad()
def greedy_generate(
    model: CausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] | None = None,
) -> list[int]:
    """Greedy decoding of one sequence with a :class:`DenseKVCache` (reference / smoke-test helper).

    Returns only the generated ids (stops after an eos id, which is included).
    """
    if not prompt_ids:
        raise ShapeError("prompt_ids must contain at least one token")
    model.check_context_length(len(prompt_ids) + max_new_tokens)
    eos = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    cache = DenseKVCache(model.num_layers, model.attn_scale)
    dev = model.device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=dev)
    pos = torch.arange(len(prompt_ids), device=dev)
    last = torch.tensor([len(prompt_ids) - 1], device=dev)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits, _ = model(ids, pos, cache, logits_rows=last)
        nxt = int(logits[0].argmax())
        out.append(nxt)
        if nxt in eos:
            break
        ids = torch.tensor([nxt], device=dev)
        pos = torch.tensor([cache.length], device=dev)
        last = torch.zeros(1, dtype=torch.long, device=dev)
    return out
