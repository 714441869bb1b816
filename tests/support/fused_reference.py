"""References of the fused decoder kernels (issue 10; ``ops.rms_norm``, ``ops.qk_norm_rope``): the
exact torch expressions of :mod:`oasiskv.models.transformer`, plus the two knobs where the kernels
may differ from torch (and from each other not at all):

* the ORDER of an RMSNorm's sum of squares: the kernels sum in a fixed tree (``tree_sum``, mirrored
  from ``oasis_core::kernels::norm::tree_sum`` with torch float32 additions), identical on the CPU
  and the GPU; torch sums in its own order;
* cos/sin: the kernels round them correctly to float32 (evaluated in float64); torch's float32
  ``cos``/``sin`` are within 1 ulp of that.

With ``order="tree"`` and ``tables="exact"`` these references are bit for bit what the kernels must
compute; with ``order="torch"`` and ``tables="torch"`` they ARE the model's torch code. Shared by
tests/kernels/test_fused.py (CPU) and tests/kernels/test_gpu_fused.py.
"""

from __future__ import annotations

import math

import torch

from oasiskv.models.transformer import apply_rope, rms_norm, rope_cos_sin, rotate_half

# NOTE: the decoder's fused path differs from its torch path only in the norms' sum order and in
# cos/sin; through a few layers of a random model that stays within a few roundings of the dtype.
MODEL_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}

WARP = 32
RMS_NORM_ELEMS_PER_THREAD = 4  # oasis_core::kernels::norm::RMS_NORM_ELEMS_PER_THREAD
RMS_NORM_MAX_THREADS = 1024


def rms_norm_threads(hidden: int) -> int:
    """oasis_core::kernels::norm::rms_norm_threads: the block size of rms_norm_*, which fixes the
    order of its sum."""
    per_thread = math.ceil(hidden / RMS_NORM_ELEMS_PER_THREAD)
    t = math.ceil(per_thread / WARP) * WARP
    return min(max(t, WARP), RMS_NORM_MAX_THREADS)


def inv_freq_of(head_dim: int, theta: float = 1e6) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _butterfly(v: torch.Tensor) -> torch.Tensor:
    """``warp_sum``: lane i adds lane i ^ o for o = 16, 8, 4, 2, 1 (float32); lane 0 of ``v [..., 32]``."""
    idx = torch.arange(WARP)
    for o in (16, 8, 4, 2, 1):
        v = v + v[..., idx ^ o]
    return v[..., 0]


def tree_sum(terms: torch.Tensor, threads: int) -> torch.Tensor:
    """Row sums of ``terms [n, m]`` (float32) in the kernels' order: thread t adds terms t, t + threads,
    ... from 0; each warp's butterfly; with several warps, one more butterfly over the warp totals
    padded with zeros to 32 lanes."""
    n, m = terms.shape
    k = -(-m // threads)
    padded = torch.zeros(n, k * threads, dtype=torch.float32)
    padded[:, :m] = terms  # the kernels' idle lanes add nothing; here they add +0.0, the same
    parts = padded.view(n, k, threads)
    acc = torch.zeros(n, threads, dtype=torch.float32)
    for j in range(k):
        acc = acc + parts[:, j]
    warps = threads // WARP
    totals = _butterfly(acc.view(n, warps, WARP))
    if warps == 1:
        return totals[:, 0]
    lanes = torch.zeros(n, WARP, dtype=torch.float32)
    lanes[:, :warps] = totals
    return _butterfly(lanes)


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, order: str = "torch") -> torch.Tensor:
    """RMSNorm over the last dimension: transformer.rms_norm itself (``order="torch"``), or its
    expression with the kernels' sum (``"tree"``; the block size of ``rms_norm_*`` for rows of the
    last dimension, or one warp with ``"warp"``: the per-head norm of qk_norm_rope)."""
    if order == "torch":
        return rms_norm(x, weight, eps)
    hidden = x.shape[-1]
    threads = WARP if order == "warp" else rms_norm_threads(hidden)
    xf = x.float().reshape(-1, hidden)
    total = tree_sum(xf * xf, threads)
    r = torch.rsqrt(total / hidden + eps)  # as transformer.rms_norm (torch.sqrt is not IEEE on every CPU)
    y = (xf * r[:, None]).to(x.dtype)
    return (weight * y).reshape(x.shape)


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, tables: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, 1, head_dim]: transformer.rope_cos_sin (``"torch"``) or the kernels' correctly
    rounded float32 values (``"exact"``: float64 cos/sin of the same float32 freqs)."""
    if tables == "torch":
        return rope_cos_sin(inv_freq, positions, dtype)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).double()
    return emb.cos().float().to(dtype)[:, None, :], emb.sin().float().to(dtype)[:, None, :]


def ref_qk_norm_rope(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    order: str = "torch",
    tables: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DecoderLayer.forward's torch prologue (q/k slices, q_norm/k_norm, apply_rope, contiguous v),
    with the sum order (``"torch"`` or ``"warp"``) and the tables as above."""
    n = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(n, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].contiguous().view(n, num_kv_heads, head_dim)
    if q_norm is not None:
        q = ref_rms_norm(q, q_norm, eps, order)
        k = ref_rms_norm(k, k_norm, eps, order)
    cos, sin = rope_tables(inv_freq, positions, qkv.dtype, tables)
    return apply_rope(q, cos, sin).contiguous(), apply_rope(k, cos, sin).contiguous(), v


MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def ulp_at(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` values at magnitudes ``m`` (float32; the smallest normal's below it)."""
    tiny = torch.finfo(dtype).tiny
    return torch.exp2(torch.floor(torch.log2(m.float().clamp_min(tiny))) - MANTISSA_BITS[dtype])


def rope_operands(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``|x * cos| + |rotate_half(x) * sin|`` (float32): the scale of a RoPE output's two terms. A
    difference of an ulp in one term is that many ulps of this, however much the sum cancels."""
    return (x.float() * cos.float()).abs() + (rotate_half(x).float() * sin.float()).abs()


def assert_rope_close(got, want, scale, ulps: int, what: str) -> None:
    """``|got - want| <= ulps`` ulps of the RoPE terms' ``scale`` (:func:`rope_operands`), elementwise."""
    err = (got.float() - want.float()).abs()
    tol = ulps * ulp_at(scale, got.dtype)
    bad = (err > tol).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} elements off by more than {ulps} ulps of their terms, first at "
        f"{bad[0].tolist()}: got {got[tuple(bad[0])]}, want {want[tuple(bad[0])]}"
    )


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """The float bits as int64 in the order of the values (-0 and +0 both 0): differences are ulps."""
    t = t.contiguous()
    if t.element_size() == 2:
        b = t.view(torch.int16).long() & 0xFFFF
        mag, neg = b & 0x7FFF, b >= 0x8000
    else:
        b = t.view(torch.int32).long() & 0xFFFFFFFF
        mag, neg = b & 0x7FFFFFFF, b >= 0x80000000
    return torch.where(neg, -mag, mag)


def max_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if got.numel() == 0:
        return 0
    return int((ordered_bits(got) - ordered_bits(want)).abs().max())


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit (the sign of zero included)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    diff = (raw_bits(got) != raw_bits(want)).nonzero()
    assert diff.numel() == 0, (
        f"{what}: {diff.shape[0]} of {got.numel()} elements differ, first at {diff[0].tolist()}"
    )
