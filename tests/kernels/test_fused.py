"""The fused decoder kernels (issue 10) on the CPU: ``ops.rms_norm`` and ``ops.qk_norm_rope`` (the Rust
twins) against the torch expressions of oasiskv.models.transformer, their argument checks, and the
decoder's fused path (``FUSED_KERNELS = "always"`` runs it on the twins) against its torch path.

How exact (tests/support/fused_reference.py): the twins round every operation as the torch code does, and
differ from torch only in the order of an RMSNorm's sum of squares and in cos/sin (correctly rounded
float32; torch's are within 1 ulp). So:

* with the kernels' sum order and correctly rounded tables replayed in torch, bit for bit, every dtype;
* against the torch code itself: bit for bit when every sum is exact in any order (inputs on a
  1/16 grid), else within 1 ulp in bfloat16/float16 and the float32 tolerances of reference.TOL.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oasiskv import errors, ops
from oasiskv.models import transformer
from oasiskv.models.loader import load_hf_dir
from oasiskv.models.transformer import CausalLM, DenseKVCache, dense_causal_attn
from support.configs import LLAMA_8L
from support.fused_reference import (
    MODEL_TOL,
    assert_bits_equal,
    assert_rope_close,
    inv_freq_of,
    max_ulps,
    ref_qk_norm_rope,
    ref_rms_norm,
    rms_norm_threads,
    rope_operands,
    rope_tables,
)
from support.reference import TOL, seeded

torch.set_num_threads(2)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HIDDENS = [64, 97, 576, 4096]  # 97: odd, idle lanes; 4096: 1024 threads, 32 warps
HEAD_DIMS = [64, 128, 40]
EPS = 1e-6
# NOTE: against torch's own summation order a float32 RMSNorm can differ in the last bits of r,
# which the two roundings after it can turn into a few ulps (4 seen on random rows).
F32_NORM_ULPS = 8


def grid_values(gen, *shape) -> torch.Tensor:
    """Values k / 16, |k| <= 64: exact in every dtype, and so are their squares and every partial sum
    of up to 4096 of them (at most 2^24 units of 2^-8), so any summation order gives the same sum."""
    return torch.randint(-64, 65, shape, generator=gen).float() / 16


def norm_weight(gen, n, dtype) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)


def strided(x: torch.Tensor, extra: int) -> torch.Tensor:
    """``x [n, m]`` as a view whose rows are ``m + extra`` apart (a column slice of a wider tensor)."""
    if extra == 0:
        return x
    wide = torch.full((x.shape[0], x.shape[1] + extra), float("nan"), dtype=x.dtype)
    wide[:, : x.shape[1]] = x
    return wide[:, : x.shape[1]]


# ---------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("extra", [0, 5])
def test_rms_norm_is_the_torch_expression(dtype, hidden, extra):
    gen = seeded("rms_norm", dtype, hidden, extra)
    w = norm_weight(gen, hidden, dtype)
    # Sums exact in any order: the torch code itself, bit for bit.
    x = strided(grid_values(gen, 23, hidden).to(dtype), extra)
    assert_bits_equal(ops.rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS), "grid values vs transformer.rms_norm")
    # Random rows: bit for bit with the kernels' sum order; close to torch's.
    x = strided(torch.randn(23, hidden, generator=gen).to(dtype) * 3, extra)
    got = ops.rms_norm(x, w, EPS)
    assert_bits_equal(
        got, ref_rms_norm(x, w, EPS, order="tree"), "random rows vs the tree-ordered expression"
    )
    want = ref_rms_norm(x, w, EPS)
    if dtype == torch.float32:
        assert max_ulps(got, want) <= F32_NORM_ULPS
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    else:
        assert max_ulps(got, want) <= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 576])
def test_rms_norm_fuses_the_residual_add(dtype, hidden):
    gen = seeded("rms_norm residual", dtype, hidden)
    w = norm_weight(gen, hidden, dtype)
    x = strided(torch.randn(19, hidden, generator=gen).to(dtype), 3)  # the delta may be strided
    res = (torch.randn(19, hidden, generator=gen) * 4).to(dtype)
    h_want = res + x  # torch's add in the dtype
    out, h = ops.rms_norm(x, w, EPS, residual=res)
    assert_bits_equal(h, h_want, "residual_out")
    assert_bits_equal(out, ref_rms_norm(h_want, w, EPS, order="tree"), "out")
    # In place: residual_out=residual overwrites the residual with h; the same bits.
    res2 = res.clone()
    out2, h2 = ops.rms_norm(x, w, EPS, residual=res2, residual_out=res2)
    assert h2 is res2
    assert_bits_equal(res2, h_want, "residual in place")
    assert_bits_equal(out2, out, "out in place")
    # Preallocated outputs are filled and returned.
    o, r = torch.empty(19, hidden, dtype=dtype), torch.empty(19, hidden, dtype=dtype)
    out3, h3 = ops.rms_norm(x, w, EPS, residual=res, out=o, residual_out=r)
    assert out3 is o and h3 is r
    assert_bits_equal(o, out, "out=")
    # Grid values: against the torch code itself.
    x, res = grid_values(gen, 7, hidden).to(dtype), grid_values(gen, 7, hidden).to(dtype)
    out, h = ops.rms_norm(x, w, EPS, residual=res)
    assert_bits_equal(out, ref_rms_norm(res + x, w, EPS), "grid values with residual")


def test_rms_norm_shapes():
    gen = seeded("rms_norm shapes")
    w = norm_weight(gen, 64, torch.bfloat16)
    x = torch.randn(3, 5, 64, generator=gen).to(torch.bfloat16)
    got = ops.rms_norm(x, w, EPS)
    assert got.shape == (3, 5, 64)
    assert_bits_equal(got, ref_rms_norm(x, w, EPS, order="tree"), "3-D")
    # A non-contiguous 3-D input is copied to rows; a 1-D one is one row.
    xt = x.transpose(0, 1)
    assert_bits_equal(ops.rms_norm(xt, w, EPS), ref_rms_norm(xt, w, EPS, order="tree"), "transposed")
    assert ops.rms_norm(x[0, 0], w, EPS).shape == (64,)
    assert ops.rms_norm(x[:0, 0], w, EPS).shape == (0, 64)  # no rows: nothing to do
    # A single row of a column slice: its stride is irrelevant.
    wide = torch.randn(1, 100, generator=gen).to(torch.bfloat16)
    assert_bits_equal(
        ops.rms_norm(wide[:, 10:74], w, EPS), ref_rms_norm(wide[:, 10:74], w, EPS, "tree"), "1 row"
    )


def test_rms_norm_argument_errors():
    w = torch.ones(8)
    x = torch.randn(4, 8)
    with pytest.raises(errors.ShapeError, match=r"x must have shape \[n, 8\]"):
        ops.rms_norm(torch.randn(4, 9), w, EPS)
    with pytest.raises(errors.ShapeError, match="hidden"):
        ops.rms_norm(torch.randn(4, 9, 2), w, EPS)
    with pytest.raises(errors.ShapeError, match="weight"):
        ops.rms_norm(x, torch.ones(2, 4), EPS)
    with pytest.raises(errors.DTypeError, match="weight has dtype"):
        ops.rms_norm(x, w.half(), EPS)
    with pytest.raises(errors.DTypeError, match="float32, float16 or bfloat16"):
        ops.rms_norm(x.double(), w.double(), EPS)
    with pytest.raises(errors.ShapeError, match="contiguous rows"):
        ops.rms_norm(torch.randn(4, 16)[:, ::2], w, EPS)
    with pytest.raises(errors.ShapeError, match="overlap"):
        ops.rms_norm(torch.randn(1, 8).expand(4, 8), w, EPS)
    with pytest.raises(errors.ShapeError, match="out must have shape"):
        ops.rms_norm(x, w, EPS, out=torch.empty(4, 9))
    with pytest.raises(errors.ShapeError, match="residual must have shape"):
        ops.rms_norm(x, w, EPS, residual=torch.randn(3, 8))
    with pytest.raises(errors.InvalidArgumentError, match="together"):
        ops.rms_norm(x, w, EPS, residual_out=torch.empty(4, 8))
    with pytest.raises(errors.ConfigError, match="hidden > 0"):
        ops.rms_norm(torch.randn(4, 0), torch.ones(0), EPS)
    # Aliasing: outputs may share memory with nothing, except residual_out being residual itself.
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        ops.rms_norm(x, w, EPS, out=x)
    big = torch.randn(5, 8)
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        ops.rms_norm(x, w, EPS, residual=big[:4], residual_out=big[1:])
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        ops.rms_norm(x, w, EPS, residual=big[:4], residual_out=x)
    res = torch.randn(4, 8)
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        ops.rms_norm(x, w, EPS, residual=res, out=res)
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(errors.DeviceError, match="meta"):
        ops.rms_norm(meta, w, EPS)


# ---------------------------------------------------------------- qk_norm_rope
def _qk_case(gen, dtype, hq, hkv, d, n, extra, norm, grid=False, pos_dtype=torch.int64, theta=1e6):
    width = (hq + 2 * hkv) * d
    vals = grid_values(gen, n, width) if grid else torch.randn(n, width, generator=gen) * 2
    qkv = strided(vals.to(dtype), extra)
    pos = torch.randint(0, 40001, (n,), generator=gen).to(pos_dtype)
    qn = norm_weight(gen, d, dtype) if norm else None
    kn = norm_weight(gen, d, dtype) if norm else None
    return qkv, pos, inv_freq_of(d, theta), qn, kn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qwen3"])
def test_qk_norm_rope_is_the_torch_prologue(dtype, head_dim, norm):
    gen = seeded("qk_norm_rope", dtype, head_dim, norm)
    hq, hkv, n = 6, 2, 29
    qkv, pos, inv, qn, kn = _qk_case(gen, dtype, hq, hkv, head_dim, n, 7, norm)
    args = (hq * head_dim, hkv * head_dim, hq, hkv, head_dim, pos, inv, qn, kn, EPS)
    q, k, v = ops.qk_norm_rope(qkv, *args)
    assert q.shape == (n, hq, head_dim) and k.shape == (n, hkv, head_dim) and v.shape == (n, hkv, head_dim)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    # The kernels' sum order and correctly rounded tables: bit for bit.
    want = ref_qk_norm_rope(qkv, hq, hkv, head_dim, pos, inv, qn, kn, EPS, order="warp", tables="exact")
    for got, w, name in zip((q, k, v), want, "qkv", strict=True):
        assert_bits_equal(got, w, name)
    # The torch code itself (its tables, its sums): each RoPE term within an ulp or two.
    torch_q, torch_k, torch_v = ref_qk_norm_rope(qkv, hq, hkv, head_dim, pos, inv, qn, kn, EPS)
    assert_bits_equal(v, torch_v, "v")
    cos, sin = rope_tables(inv, pos, dtype)
    q_size = hq * head_dim
    heads = {
        "q": qkv[:, :q_size].reshape(n, hq, head_dim),
        "k": qkv[:, q_size : q_size + hkv * head_dim].reshape(n, hkv, head_dim),
    }
    # NOTE: a norm's r may differ from torch's in its last bits (sum order), which moves a
    # normalised value by an ulp (several in float32, see F32_NORM_ULPS), and torch's float32
    # cos/sin are 1 ulp off in a few percent of entries; a sum that cancels turns either into
    # many ulps of the RESULT, so the bound is in ulps of the two terms.
    ulps = 2 if dtype != torch.float32 else (F32_NORM_ULPS if norm else 2)
    for (name, got), w, weight in zip((("q", q), ("k", k)), (torch_q, torch_k), (qn, kn), strict=True):
        x = heads[name] if weight is None else ref_rms_norm(heads[name], weight, EPS)
        assert_rope_close(got, w, rope_operands(x, cos, sin), ulps, name)
    # Grid values (exact sums): with torch's own norm, bit for bit against the exact tables.
    qkv, pos, inv, qn, kn = _qk_case(gen, dtype, hq, hkv, head_dim, n, 0, norm, grid=True)
    q, k, _ = ops.qk_norm_rope(qkv, hq * head_dim, hkv * head_dim, hq, hkv, head_dim, pos, inv, qn, kn, EPS)
    want = ref_qk_norm_rope(qkv, hq, hkv, head_dim, pos, inv, qn, kn, EPS, order="torch", tables="exact")
    assert_bits_equal(q, want[0], "grid q")
    assert_bits_equal(k, want[1], "grid k")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_tables_are_correctly_rounded(dtype):
    """The kernels' cos/sin against torch's rope_cos_sin: within 1 ulp; in float32 about 5% of the
    entries differ (torch's cosf/sinf are not correctly rounded), once rounded to bfloat16/float16
    almost none (1 in 10^5 float16 entries here, none in bfloat16)."""
    inv = inv_freq_of(128)
    pos = torch.randint(0, 40001, (1500,), generator=seeded("tables"))
    for got, want in zip(rope_tables(inv, pos, dtype, "exact"), rope_tables(inv, pos, dtype), strict=True):
        assert max_ulps(got, want) <= 1
        differ = (got != want).float().mean().item()
        assert differ < (0.1 if dtype == torch.float32 else 1e-4), differ


def test_qk_norm_rope_positions_and_gqa():
    gen = seeded("qk positions")
    dtype, hq, hkv, d, n = torch.bfloat16, 8, 1, 64, 11
    qkv, pos, inv, qn, kn = _qk_case(gen, dtype, hq, hkv, d, n, 0, True)
    a = ops.qk_norm_rope(qkv, hq * d, hkv * d, hq, hkv, d, pos, inv, qn, kn, EPS)
    b = ops.qk_norm_rope(qkv, hq * d, hkv * d, hq, hkv, d, pos.int(), inv, qn, kn, EPS)
    for x, y, name in zip(a, b, "qkv", strict=True):
        assert_bits_equal(x, y, f"int32 positions: {name}")
    # Position 0 with no norm: the identity (cos 1, sin 0).
    q, k, v = ops.qk_norm_rope(qkv, hq * d, hkv * d, hq, hkv, d, torch.zeros(n, dtype=torch.long), inv)
    assert_bits_equal(q.view(n, -1), qkv[:, : hq * d], "position 0")
    # Preallocated outputs.
    outs = [torch.empty_like(t) for t in a]
    got = ops.qk_norm_rope(
        qkv, hq * d, hkv * d, hq, hkv, d, pos, inv, qn, kn, EPS, q_out=outs[0], k_out=outs[1], v_out=outs[2]
    )
    assert all(g is o for g, o in zip(got, outs, strict=True))


def test_qk_norm_rope_scales_cos_and_sin():
    """``rope_scale`` (YaRN's attention factor) multiplies cos and sin in float32 before their
    rounding: at position 0 (cos 1, sin 0) q and k come out times the scale, rounded once; v is
    copied as is. A scale that is not a finite positive number is a ConfigError."""
    gen = seeded("qk scale")
    dtype, hq, hkv, d, n = torch.float32, 4, 2, 64, 5
    qkv, pos, inv, _, _ = _qk_case(gen, dtype, hq, hkv, d, n, 0, False)
    zero = torch.zeros(n, dtype=torch.long)
    q, k, v = ops.qk_norm_rope(qkv, hq * d, hkv * d, hq, hkv, d, zero, inv, rope_scale=1.1386)
    f = torch.tensor(1.1386, dtype=torch.float32)
    assert_bits_equal(q.view(n, -1), qkv[:, : hq * d] * f, "q at position 0")
    assert_bits_equal(k.view(n, -1), qkv[:, hq * d : (hq + hkv) * d] * f, "k at position 0")
    assert_bits_equal(v.view(n, -1), qkv[:, (hq + hkv) * d :], "v")
    plain = ops.qk_norm_rope(qkv, hq * d, hkv * d, hq, hkv, d, pos, inv)
    one = ops.qk_norm_rope(qkv, hq * d, hkv * d, hq, hkv, d, pos, inv, rope_scale=1.0)
    for x, y, name in zip(plain, one, "qkv", strict=True):
        assert_bits_equal(x, y, f"rope_scale 1.0: {name}")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(errors.ConfigError, match="rope_scale"):
            ops.qk_norm_rope(qkv, hq * d, hkv * d, hq, hkv, d, pos, inv, rope_scale=bad)


@pytest.mark.parametrize("groups", [2, 3])
def test_qk_norm_rope_groups_key_and_value_rows_by_row(groups):
    """kv_groups = G: k and v rows move to row r * (n / G) + s for token s * G + r (what the engine's
    decode step reads without a copy); q stays; each moved row holds the token-order call's bits."""
    gen = seeded("qk groups", groups)
    dtype, hq, hkv, d, n = torch.bfloat16, 4, 2, 64, 12
    qkv, pos, inv, qn, kn = _qk_case(gen, dtype, hq, hkv, d, n, 0, True)
    args = (qkv, hq * d, hkv * d, hq, hkv, d, pos, inv, qn, kn, EPS)
    q1, k1, v1 = ops.qk_norm_rope(*args)
    q, k, v = ops.qk_norm_rope(*args, kv_groups=groups)
    assert_bits_equal(q, q1, "q keeps the token order")
    want_k = k1.view(n // groups, groups, hkv, d).transpose(0, 1).reshape(n, hkv, d)
    want_v = v1.view(n // groups, groups, hkv, d).transpose(0, 1).reshape(n, hkv, d)
    assert_bits_equal(k, want_k, f"k grouped by {groups}")
    assert_bits_equal(v, want_v, f"v grouped by {groups}")
    assert not torch.equal(k, k1)  # the order did change
    for bad in (0, 5):
        with pytest.raises(errors.InvalidArgumentError, match="kv_groups"):
            ops.qk_norm_rope(*args, kv_groups=bad)


def test_qk_norm_rope_argument_errors():
    d, hq, hkv, n = 8, 2, 1, 3
    qkv = torch.randn(n, (hq + 2 * hkv) * d)
    pos, inv, w = torch.arange(n), inv_freq_of(d), torch.ones(d)

    def call(
        qkv=qkv, q_size=hq * d, kv_size=hkv * d, hq=hq, hkv=hkv, d=d, pos=pos, inv=inv, qn=w, kn=w, **kw
    ):
        return ops.qk_norm_rope(qkv, q_size, kv_size, hq, hkv, d, pos, inv, qn, kn, EPS, **kw)

    call()
    with pytest.raises(errors.ConfigError, match="even head_dim"):
        call(d=7, q_size=14, kv_size=7)
    with pytest.raises(errors.ConfigError, match="num_kv_heads > 0"):
        call(hkv=0, kv_size=0)
    with pytest.raises(errors.InvalidArgumentError, match="num_heads \\* head_dim"):
        call(q_size=15)
    with pytest.raises(errors.ShapeError, match="qkv must have shape"):
        call(qkv=torch.randn(n, 31))
    with pytest.raises(errors.ShapeError, match="positions must have shape"):
        call(pos=torch.arange(n + 1))
    with pytest.raises(errors.DTypeError, match="int64 or int32"):
        call(pos=pos.float())
    with pytest.raises(errors.DTypeError, match="inv_freq must be float32"):
        call(inv=inv.double())
    with pytest.raises(errors.ShapeError, match="inv_freq must have shape"):
        call(inv=inv[:-1])
    with pytest.raises(errors.InvalidArgumentError, match="together"):
        call(kn=None)
    with pytest.raises(errors.ShapeError, match="q_norm must have shape"):
        call(qn=torch.ones(d + 1))
    with pytest.raises(errors.DTypeError, match="has dtype"):
        call(qn=w.half(), kn=w.half())
    with pytest.raises(errors.ShapeError, match="contiguous rows"):
        call(qkv=torch.randn(n, 64)[:, ::2])
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        call(q_out=qkv.view(-1)[: n * hq * d].view(n, hq, d))  # contiguous, inside qkv
    q_out = torch.empty(n, hq, d)
    with pytest.raises(errors.InvalidArgumentError, match="share memory"):
        call(q_out=q_out, k_out=q_out.view(-1)[: n * hkv * d].view(n, hkv, d))
    with pytest.raises(errors.ShapeError, match="k_out must have shape"):
        call(k_out=torch.empty(n, hkv + 1, d))


# ---------------------------------------------------------------- the decoder's fused path
@pytest.fixture
def fused(monkeypatch):
    """Run the decoder's fused path on the CPU twins."""
    monkeypatch.setattr(transformer, "FUSED_KERNELS", "always")


def _model(family: str, dtype, seed=3, layers=3):
    head_dim = 24 if family == "qwen3" else 16
    cfg = LLAMA_8L.replace(
        family=family, num_hidden_layers=layers, head_dim=head_dim, max_position_embeddings=4096
    )
    return CausalLM.random(cfg, seed=seed, dtype=dtype)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_mul", [False, True], ids=["silu-mul-off", "silu-mul"])
def test_fused_decoder_matches_the_torch_path(family, dtype, silu_mul, monkeypatch):
    monkeypatch.setattr(transformer, "FUSED_SILU_MUL", silu_mul)
    model = _model(family, dtype)
    g = seeded("decoder", family, dtype)
    ids = torch.randint(0, 257, (21,), generator=g)
    pos = torch.arange(21) + 3000  # far positions: RoPE at large angles
    runs = {}
    for mode in ("never", "always"):
        monkeypatch.setattr(transformer, "FUSED_KERNELS", mode)
        logits, captured = model(ids, pos, dense_causal_attn(), capture_layers=[0, 2, 3])
        # Incremental decode through a dense cache: prefill, then one token at a time.
        cache = DenseKVCache(model.num_layers, model.attn_scale)
        steps = [model(ids[:15], pos[:15], cache, logits_rows=torch.tensor([14]))[0]]
        for t in range(15, 21):
            steps.append(model(ids[t : t + 1], pos[t : t + 1], cache)[0])
        runs[mode] = (logits, captured, torch.cat(steps))
    (la, ca, sa), (lb, cb, sb) = runs["never"], runs["always"]
    assert set(cb) == {0, 2, 3}
    atol, rtol = MODEL_TOL[dtype]
    torch.testing.assert_close(lb, la, atol=atol, rtol=rtol)
    torch.testing.assert_close(sb, la[14:], atol=atol, rtol=rtol)
    torch.testing.assert_close(sa, la[14:], atol=atol, rtol=rtol)
    for i in ca:
        torch.testing.assert_close(cb[i].float(), ca[i].float(), atol=atol, rtol=rtol)
    assert_bits_equal(cb[0], ca[0], "captured[0] (the embeddings)")


@pytest.mark.parametrize("mode", ["never", "always"])
def test_decoder_hands_kv_grouped_by_row(mode, monkeypatch):
    """CausalLM.forward(kv_groups=2): attn sees q in token order and k, v grouped by row, on the
    torch path (regrouped) and the fused path (written so by the kernel): the same bits as the
    token-order forward's k, v regrouped, and the same logits."""
    monkeypatch.setattr(transformer, "FUSED_KERNELS", mode)
    model = _model("qwen3", torch.bfloat16)
    n = 10
    ids = torch.randint(0, 257, (n,), generator=seeded("kv groups", mode))
    pos = torch.arange(n) + 40
    seen: dict = {}

    def record(tag):
        inner = dense_causal_attn()

        def attn(layer, q, k, v):
            seen[(tag, layer)] = (q.clone(), k.clone(), v.clone())
            if tag == "grouped":  # give the inner attention the token order back
                k = k.view(2, n // 2, *k.shape[1:]).transpose(0, 1).reshape(k.shape)
                v = v.view(2, n // 2, *v.shape[1:]).transpose(0, 1).reshape(v.shape)
            return inner(layer, q, k, v)

        return attn

    la, _ = model(ids, pos, record("tokens"))
    lb, _ = model(ids, pos, record("grouped"), kv_groups=2)
    assert_bits_equal(lb, la, "logits")
    for layer in range(model.num_layers):
        qa, ka, va = seen[("tokens", layer)]
        qb, kb, vb = seen[("grouped", layer)]
        assert_bits_equal(qb, qa, f"layer {layer} q")
        assert_bits_equal(kb, ka.view(n // 2, 2, *ka.shape[1:]).transpose(0, 1).reshape(ka.shape), "k")
        assert_bits_equal(vb, va.view(n // 2, 2, *va.shape[1:]).transpose(0, 1).reshape(va.shape), "v")
    with pytest.raises(errors.ShapeError, match="kv_groups"):
        model(ids, pos, record("bad"), kv_groups=3)


def test_fused_decoder_matches_transformers(fused, tmp_path):
    """The fused path against transformers' Qwen3 in float32, as tests/models/test_models.py checks the torch
    path (and to the same tolerance)."""
    pytest.importorskip("transformers")
    from support.hf_models import HF_CASES, make_hf_model

    hf = make_hf_model(HF_CASES["qwen3-gqa3"])
    hf.save_pretrained(tmp_path)
    ours = load_hf_dir(tmp_path)
    n = 37
    ids = torch.randint(0, 257, (n,), generator=seeded("hf"))
    pos = torch.arange(n) + 20
    with torch.no_grad():
        ref = hf(ids[None], position_ids=pos[None])
    logits, _ = ours(ids, pos, dense_causal_attn())
    torch.testing.assert_close(logits, ref.logits[0], atol=1e-4, rtol=1e-4)


class _CountKernels(TorchDispatchMode):
    """Count the ops that would launch a kernel: every aten op but views, allocations and the
    in-place metadata ones; the fused ops of oasiskv.ops are counted by the test (one each)."""

    SKIP = {"empty", "empty_like", "empty_strided", "_unsafe_view", "detach", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not (self.paused or view or name in self.SKIP):
            self.ops.append(name)
        return out


_FUSED_OPS = {name: getattr(ops, name) for name in ("rms_norm", "qk_norm_rope", "silu_mul")}


def count_decode_kernels(model, monkeypatch) -> list[str]:
    """The kernels layer 1 launches in a decode step of 4 sequences, attention excluded."""
    counter = _CountKernels()
    counter.active = False
    for name, real in _FUSED_OPS.items():

        def counted(*a, _real=real, _name=name, **kw):
            paused, counter.paused = counter.paused, True
            try:
                return _real(*a, **kw)
            finally:
                counter.paused = paused
                if counter.active:
                    counter.ops.append(_name)

        monkeypatch.setattr(transformer.ops, name, counted)
    layer = model.layers[1]
    real_forward = type(layer).forward.__get__(layer)

    def forward(i, h, rope, attn, delta=None):
        def quiet_attn(*a):
            counter.paused = True
            try:
                return attn(*a)
            finally:
                counter.paused = False

        counter.active = True
        try:
            with counter:
                return real_forward(i, h, rope, quiet_attn, delta)
        finally:
            counter.active = False

    monkeypatch.setattr(layer, "forward", forward)
    # A decode step of 4 sequences: one row each (the attention, not counted, is a stand-in).
    model(torch.tensor([7, 8, 9, 10]), torch.tensor([5, 17, 3, 40]), lambda i, q, k, v: q)
    return list(counter.ops)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kernels_per_decode_layer(family, monkeypatch):
    """Issue 10: a decode layer's kernels outside attention. The torch path launches one per op
    (HF RMSNorm alone is 8 in 16-bit dtypes, 4 norms per Qwen3 layer); the fused path launches 9: two
    norms with their residual adds, the q/k norm + RoPE prologue, the 4 GEMMs and the MLP's
    ``silu(gate) * up`` in one kernel (``ops.silu_mul``; torch's SiLU and product before)."""
    model = _model(family, torch.bfloat16)
    monkeypatch.setattr(transformer, "FUSED_KERNELS", "never")
    before = count_decode_kernels(model, monkeypatch)
    monkeypatch.setattr(transformer, "FUSED_KERNELS", "always")
    monkeypatch.setattr(transformer, "FUSED_SILU_MUL", False)
    two = count_decode_kernels(model, monkeypatch)
    assert two[-4:] == ["mm", "silu", "mul", "mm"], two  # torch's SiLU and product
    monkeypatch.setattr(transformer, "FUSED_SILU_MUL", True)
    after = count_decode_kernels(model, monkeypatch)
    assert after == [
        "rms_norm",
        "mm",
        "qk_norm_rope",
        "mm",
        "rms_norm",
        "mm",
        "silu_mul",
        "mm",
    ], after
    print(f"{family}: {len(before)} kernels per decode layer before, {len(after)} after: {before}")
    assert len(before) == {"llama": 35, "qwen3": 51}[family], before


def test_grad_keeps_the_torch_path(monkeypatch):
    """The kernels have no backward: where autograd records (training the EAGLE-3 head), RMSNorm
    stays the torch code even where the fused kernels are on."""
    monkeypatch.setattr(transformer, "FUSED_KERNELS", "always")
    w = torch.ones(16, requires_grad=True)
    x = torch.randn(3, 16)
    assert not transformer.use_fused(x, w)
    transformer.rms_norm(x, w, EPS).sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        assert transformer.use_fused(x, w)
    assert not transformer.use_fused(x.double())
    monkeypatch.setattr(transformer, "FUSED_KERNELS", "cuda")
    assert not transformer.use_fused(x)  # CPU tensors keep the torch code by default
    monkeypatch.setattr(transformer, "FUSED_KERNELS", "sometimes")
    with pytest.raises(errors.ConfigError, match="FUSED_KERNELS"):
        transformer.use_fused(x)


def test_rms_norm_threads_mirror():
    """fused_reference.rms_norm_threads mirrors oasis_core's (its unit test pins the same values)."""
    assert [rms_norm_threads(h) for h in (1, 64, 576, 4096, 100_000)] == [32, 32, 160, 1024, 1024]
