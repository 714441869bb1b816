"""The fused decoder kernels (issue 10) on the GPU: ``rms_norm_*`` and ``qk_norm_rope_*`` against their
CPU twins on random shapes, in a captured CUDA graph, and in the decoder on CUDA.

Each seed draws a case: bf16/f16/f32 (walked in order), for rms_norm a hidden size of 64..4096 (odd
ones too), 1..70 rows, rows strided or not, no residual / a separate residual output / the residual
updated in place; for qk_norm_rope head_dim 64 or 128, 1..8 KV heads with a GQA group of 1..8, 1..70
rows, strided or not, with and without the q/k norm, positions up to 40000 as int64 or int32.

The same body runs on two devices:
* ``cpu-N``: the CPU twin against the torch references of tests/support/fused_reference.py in the kernels'
  sum order with correctly rounded cos/sin, bit for bit (part of the default CPU-only run);
* ``cuda-N`` (marked ``gpu``): the same, then the CUDA kernel on copies of the inputs, outputs
  poisoned with NaN first, against the twin: bit for bit (the kernels and the twins round every
  operation alike and sum in one order; cos/sin are correctly rounded float32 on both sides).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from oasiskv import ops
from oasiskv.models import transformer
from oasiskv.models.config import ModelConfig
from oasiskv.models.transformer import CausalLM
from support.fused_reference import MODEL_TOL, assert_bits_equal, inv_freq_of, ref_qk_norm_rope, ref_rms_norm
from support.kernels import chance, pick, randint
from support.reference import DEV, gpu_test, seeded

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HIDDENS = [64, 97, 576, 896, 1000, 2048, 4096]  # half the cases; the others draw any of 64..4096
HEAD_DIMS = [64, 128]
MAX_ROWS = 70
MAX_POSITION = 40000
RESIDUAL_MODES = ["none", "separate", "in_place"]
GPU_SEEDS = 24  # per kernel (arbitrary)
CPU_SEEDS = 3  # the harness check of the default run
POISON = float("nan")

NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]


def runs(gpu_seeds: int = GPU_SEEDS, cpu_seeds: int = CPU_SEEDS):
    """Parametrize ``(device, seed)``: the CPU harness check on the first seeds, the GPU run on all."""
    params = [pytest.param("cpu", s, id=f"cpu-{s}") for s in range(cpu_seeds)]
    params += [pytest.param("cuda", s, id=f"cuda-{s}", marks=NEEDS_CUDA) for s in range(gpu_seeds)]
    return pytest.mark.parametrize("device,seed", params)


def draw_dtype(kernel: str, seed: int) -> torch.dtype:
    return DTYPES[(zlib.crc32(kernel.encode()) + seed) % len(DTYPES)]


def rows_with_stride(values: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wide, view)``: ``values [n, m]`` as the first ``m`` columns of ``wide [n, m + extra]`` (NaN
    beyond them), so that a kernel reading past a row shows."""
    n, m = values.shape
    wide = torch.full((n, m + extra), POISON, dtype=values.dtype)
    wide[:, :m] = values
    return wide, wide[:, :m]


def on_dev(wide: torch.Tensor, cols: int) -> torch.Tensor:
    """The same row-strided view of a GPU copy of ``wide``."""
    return wide.to(DEV)[:, :cols]


def poisoned(t: torch.Tensor) -> torch.Tensor:
    return torch.full(t.shape, POISON, dtype=t.dtype, device=DEV)


# ---------------------------------------------------------------- rms_norm
def rms_norm_case(seed: int):
    gen = seeded("gpu-fused", "rms_norm", seed)
    dtype = draw_dtype("rms_norm", seed)
    hidden = pick(gen, HIDDENS) if chance(gen, 0.5) else randint(gen, 64, 4096)
    n = randint(gen, 1, MAX_ROWS)
    extra = 0 if chance(gen, 0.4) else randint(gen, 1, 40)
    mode = pick(gen, RESIDUAL_MODES)
    scale = pick(gen, [0.01, 1.0, 30.0])
    x = (torch.randn(n, hidden, generator=gen) * scale).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = (torch.randn(n, hidden, generator=gen) * scale * 4).to(dtype) if mode != "none" else None
    eps = pick(gen, [1e-6, 1e-5])
    desc = f"{dtype} hidden={hidden} n={n} extra={extra} residual={mode} scale={scale} eps={eps}"
    return dtype, hidden, n, extra, mode, x, weight, residual, eps, desc


def run_rms_norm(x, weight, eps, mode, residual):
    """``(out, residual_out)`` of ops.rms_norm (outputs poisoned first on the GPU)."""
    cuda = x.is_cuda
    out = poisoned(x) if cuda else None
    if mode == "none":
        return ops.rms_norm(x, weight, eps, out=out), None
    if mode == "in_place":
        out, h = ops.rms_norm(x, weight, eps, residual=residual, residual_out=residual, out=out)
        assert h is residual
        return out, h
    ro = poisoned(residual) if cuda else None
    return ops.rms_norm(x, weight, eps, residual=residual, out=out, residual_out=ro)


@runs()
@gpu_test
def test_rms_norm_random(device, seed):
    dtype, hidden, n, extra, mode, x, weight, residual, eps, desc = rms_norm_case(seed)
    wide, xv = rows_with_stride(x, extra)
    res_cpu = residual.clone() if residual is not None else None
    out, h = run_rms_norm(xv, weight, eps, mode, res_cpu)
    h_want = residual + x if residual is not None else None
    if h is not None:
        assert_bits_equal(h, h_want, f"residual_out: {desc}")
    assert_bits_equal(out, ref_rms_norm(h_want if h is not None else x, weight, eps, "tree"), f"twin: {desc}")
    if device == "cpu":
        return
    res_dev = residual.to(DEV) if residual is not None else None
    out_d, h_d = run_rms_norm(on_dev(wide, hidden), weight.to(DEV), eps, mode, res_dev)
    torch.cuda.synchronize()
    assert_bits_equal(out_d.cpu(), out, f"gpu out: {desc}")
    if h is not None:
        assert_bits_equal(h_d.cpu(), h, f"gpu residual_out: {desc}")


# ---------------------------------------------------------------- qk_norm_rope
def qk_case(seed: int):
    gen = seeded("gpu-fused", "qk_norm_rope", seed)
    dtype = draw_dtype("qk_norm_rope", seed)
    d = pick(gen, HEAD_DIMS)
    hkv = randint(gen, 1, 8)
    hq = hkv * randint(gen, 1, 8)
    n = randint(gen, 1, MAX_ROWS)
    extra = 0 if chance(gen, 0.4) else randint(gen, 1, 40)
    norm = chance(gen, 0.5)
    width = (hq + 2 * hkv) * d
    qkv = (torch.randn(n, width, generator=gen) * pick(gen, [0.1, 1.0, 20.0])).to(dtype)
    pos = torch.randint(0, MAX_POSITION + 1, (n,), generator=gen)
    if chance(gen, 0.3):
        pos = pos.int()
    inv = inv_freq_of(d, pick(gen, [1e4, 5e5, 1e6]))
    if chance(gen, 0.3):  # llama3-style scaled frequencies: any float32 vector
        inv = inv / (1 + 7 * torch.rand(d // 2, generator=gen))
    qn = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype) if norm else None
    kn = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype) if norm else None
    eps = pick(gen, [1e-6, 1e-5])
    desc = f"{dtype} head_dim={d} hq={hq} hkv={hkv} n={n} extra={extra} norm={norm} pos={pos.dtype}"
    return dtype, d, hq, hkv, n, extra, qkv, pos, inv, qn, kn, eps, desc


@runs()
@gpu_test
def test_qk_norm_rope_random(device, seed):
    dtype, d, hq, hkv, n, extra, qkv, pos, inv, qn, kn, eps, desc = qk_case(seed)
    wide, qkv_v = rows_with_stride(qkv, extra)
    sizes = (hq * d, hkv * d, hq, hkv, d)
    got = ops.qk_norm_rope(qkv_v, *sizes, pos, inv, qn, kn, eps)
    want = ref_qk_norm_rope(qkv_v, hq, hkv, d, pos, inv, qn, kn, eps, order="warp", tables="exact")
    for g, w, name in zip(got, want, "qkv", strict=True):
        assert_bits_equal(g, w, f"twin {name}: {desc}")
    if device == "cpu":
        return
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    outs = dict(q_out=poisoned(got[0]), k_out=poisoned(got[1]), v_out=poisoned(got[2]))
    got_d = ops.qk_norm_rope(
        on_dev(wide, qkv.shape[1]), *sizes, dev(pos), dev(inv), dev(qn), dev(kn), eps, **outs
    )
    torch.cuda.synchronize()
    for g, w, name in zip(got_d, got, "qkv", strict=True):
        assert_bits_equal(g.cpu(), w, f"gpu {name}: {desc}")
    # kv_groups (a divisor of n, as a decode step's rows per request): the same bits, k and v
    # rows grouped by row on the device exactly as the twin groups them.
    groups = max(x for x in (1, 2, 3) if n % x == 0)
    if groups > 1:
        want_g = ops.qk_norm_rope(qkv_v, *sizes, pos, inv, qn, kn, eps, kv_groups=groups)
        outs = dict(q_out=poisoned(got[0]), k_out=poisoned(got[1]), v_out=poisoned(got[2]), kv_groups=groups)
        inputs = (on_dev(wide, qkv.shape[1]), *sizes, dev(pos), dev(inv), dev(qn), dev(kn), eps)
        got_g = ops.qk_norm_rope(*inputs, **outs)
        torch.cuda.synchronize()
        for g, w, name in zip(got_g, want_g, "qkv", strict=True):
            assert_bits_equal(g.cpu(), w, f"gpu {name}, kv_groups {groups}: {desc}")
    # rope_scale (YaRN's attention factor): the GPU's bits are the twin's.
    want_s = ops.qk_norm_rope(qkv_v, *sizes, pos, inv, qn, kn, eps, rope_scale=1.1386)
    outs = dict(q_out=poisoned(got[0]), k_out=poisoned(got[1]), v_out=poisoned(got[2]), rope_scale=1.1386)
    inputs = (on_dev(wide, qkv.shape[1]), *sizes, dev(pos), dev(inv), dev(qn), dev(kn), eps)
    got_s = ops.qk_norm_rope(*inputs, **outs)
    torch.cuda.synchronize()
    for g, w, name in zip(got_s, want_s, "qkv", strict=True):
        assert_bits_equal(g.cpu(), w, f"gpu {name}, rope_scale: {desc}")


# ---------------------------------------------------------------- CUDA graphs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@gpu_test
def test_fused_ops_replay_in_a_cuda_graph():
    """Both kernels captured in one graph (outputs allocated inside the capture, positions read on
    the device) replay new inputs exactly as the CPU twins compute them."""
    gen = seeded("gpu-fused", "graph")
    dtype, hidden, hq, hkv, d, n = torch.bfloat16, 1024, 8, 2, 128, 6
    width = (hq + 2 * hkv) * d

    def fresh():
        return (
            torch.randn(n, hidden, generator=gen).to(dtype),
            torch.randn(n, hidden, generator=gen).to(dtype),
            torch.randn(n, width, generator=gen).to(dtype),
            torch.randint(0, MAX_POSITION, (n,), generator=gen),
        )

    w = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    qn, kn = ((1 + 0.2 * torch.randn(d, generator=gen)).to(dtype) for _ in range(2))
    inv = inv_freq_of(d)
    x, res, qkv, pos = (t.to(DEV) for t in fresh())
    w_d, qn_d, kn_d, inv_d = (t.to(DEV) for t in (w, qn, kn, inv))

    def step():
        out, h = ops.rms_norm(x, w_d, 1e-6, residual=res)
        return (out, h, *ops.qk_norm_rope(qkv, hq * d, hkv * d, hq, hkv, d, pos, inv_d, qn_d, kn_d, 1e-6))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: loads the modules outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for trial in range(3):
        new = fresh()
        for dst, src in zip((x, res, qkv, pos), new, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        cx, cres, cqkv, cpos = new
        want = (
            *ops.rms_norm(cx, w, 1e-6, residual=cres),
            *ops.qk_norm_rope(cqkv, hq * d, hkv * d, hq, hkv, d, cpos, inv, qn, kn, 1e-6),
        )
        for name, g, wnt in zip(("out", "h", "q", "k", "v"), outs, want, strict=True):
            assert_bits_equal(g.cpu(), wnt, f"replay {trial}: {name}")


# ---------------------------------------------------------------- the decoder on CUDA
def _cuda_model(family: str, dtype, layers: int = 3, seed: int = 3) -> CausalLM:
    head_dim = 128 if family == "qwen3" else 64
    cfg = ModelConfig(family, 1000, 512, 1024, layers, 8, 2, head_dim=head_dim, max_position_embeddings=65536)
    return CausalLM.random(cfg, seed=seed, dtype=dtype, device=DEV)


def _forward(model, ids, pos, capture=()):
    return model(ids, pos, transformer.dense_causal_attn(), capture_layers=capture)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_mul", [False, True], ids=["silu-mul-off", "silu-mul"])
@gpu_test
def test_decoder_fused_path_on_cuda(family, dtype, silu_mul, monkeypatch):
    """The decoder on CUDA with the fused kernels (the default) against its torch path on CUDA:
    prefill of 41 tokens at far positions and the residual stream captured between layers; with
    the MLP's ``silu(gate) * up`` as one kernel or torch's two (``FUSED_SILU_MUL``)."""
    monkeypatch.setattr(transformer, "FUSED_SILU_MUL", silu_mul)
    model = _cuda_model(family, dtype)
    gen = seeded("gpu-fused", "decoder", family, dtype)
    ids = torch.randint(0, 1000, (41,), generator=gen).to(DEV)
    pos = (torch.arange(41) + 30000).to(DEV)
    fused_logits, fused_cap = _forward(model, ids, pos, capture=[0, 1, 3])
    monkeypatch.setattr(transformer, "FUSED_KERNELS", "never")
    torch_logits, torch_cap = _forward(model, ids, pos, capture=[0, 1, 3])
    atol, rtol = MODEL_TOL[dtype]
    torch.testing.assert_close(fused_logits, torch_logits, atol=atol, rtol=rtol)
    for i in torch_cap:
        torch.testing.assert_close(fused_cap[i], torch_cap[i], atol=atol, rtol=rtol)
    # Decode rows (one per sequence) at int32 positions: the same as the prefill's last rows.
    monkeypatch.setattr(transformer, "FUSED_KERNELS", "cuda")
    rows, _ = model(ids[-4:], pos[-4:].int(), lambda i, q, k, v: q)
    monkeypatch.setattr(transformer, "FUSED_KERNELS", "never")
    want, _ = model(ids[-4:], pos[-4:], lambda i, q, k, v: q)
    torch.testing.assert_close(rows, want, atol=atol, rtol=rtol)


def _cuda_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up: module loads, cuBLAS handles
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@gpu_test
def test_kernels_per_decode_layer_on_cuda(family, monkeypatch):
    """Issue 10 measured: CUDA kernels per layer of a decode step of 8 sequences (attention stubbed
    out), from the difference between a 5-layer and a 2-layer model. The fused path is 9 on the
    CPU count (tests/kernels/test_fused.py); allow cuBLAS a split-K reduction per GEMM."""
    ids = torch.arange(8, device=DEV)
    pos = torch.arange(8, device=DEV) + 100
    per_layer = {}
    for mode in ("cuda", "never"):
        monkeypatch.setattr(transformer, "FUSED_KERNELS", mode)
        counts = {}
        for layers in (2, 5):
            model = _cuda_model(family, torch.bfloat16, layers=layers)
            counts[layers] = _cuda_kernels(lambda m=model: m(ids, pos, lambda i, q, k, v: q))
        per_layer[mode] = (counts[5] - counts[2]) / 3
    print(
        f"{family}: CUDA kernels per decode layer: torch path {per_layer['never']}, fused {per_layer['cuda']}"
    )
    assert per_layer["cuda"] <= 13, per_layer
    assert per_layer["never"] >= {"llama": 30, "qwen3": 45}[family], per_layer
