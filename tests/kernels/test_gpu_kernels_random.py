"""Every kernel of oasiskv.ops on randomized geometries (issue 10): the CUDA kernel against its CPU twin.

Each seed draws a geometry (bf16/f16/f32; block_size 8, 16, 32; head_dim 64, 96, 128; a GQA group of
1..8 over 1..4 KV heads) and a random case on it: page tables scattered over pools with spare pages,
holes in the head-wise ``page_map`` (some of them a whole (sequence, KV head) row), empty sequences,
host pools pinned or on the device. The dtype x block_size x head_dim grid is walked in a fixed
order from seed to seed, so any run of seeds covers it evenly; everything else is drawn.

The same body runs on two devices:
* ``cpu-N``: the CPU twin against the independent references (float64 for attention and scores,
  plain loops for the copies, the summaries and the selection). Part of the default CPU-only run,
  so the case builders and the comparisons are checked on any machine.
* ``cuda-N`` (marked ``gpu``): the same, then the CUDA kernel on copies of the inputs, outputs
  poisoned first, against the twin: bit for bit for copies, summaries, codes and the selection;
  attention and scores within the tolerances of tests/kernels/test_gpu_kernels.py, and also against the
  float64 references.

Decode attention has two CUDA kernels. The tensor-core one serves bf16/f16 storage with head_dim
64/128/256, at most 16 query vectors per KV head (num_rows x group), block_size a multiple of 16
and 16-byte aligned K/V; the generic one serves everything else (``attention_kernel``, after
``decode_attention`` in crates/oasis-cuda/src/ops/attention.rs). The random cases reach both with each
16-bit dtype, the generic one for each of those reasons (checked without a GPU), and the named
cases of ``PATH_CASES`` check under torch.profiler that the kernel they name is the one launched.
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from oasiskv import ops
from support.kernels import (
    HOSTS,
    INT_POISON,
    POISON,
    assert_bits_equal,
    bits,
    chance,
    host,
    pick,
    rand,
    randint,
    select_state,
    tied_scores,
)
from support.key_codes import (
    assert_scores_close,
    key_codes_case,
    magnitude,
    ref_key_codes,
    ref_score_blocks_codes,
    unpack_codes,
)
from support.reference import (
    ATTN_TOL,
    DEV,
    back,
    csr,
    gpu_test,
    i32,
    ref_decode_attention,
    ref_score_blocks,
    seeded,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLOCK_SIZES = [8, 16, 32]
HEAD_DIMS = [64, 96, 128]
GROUPS = list(range(1, 9))
KV_HEADS = list(range(1, 5))
GRID = list(itertools.product(DTYPES, BLOCK_SIZES, HEAD_DIMS))
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}

GPU_SEEDS = 20  # per kernel (arbitrary); the CPU side of every GPU case takes about 10 s on 2 cores
ATTN_SEEDS = len(GRID)  # attention walks the whole dtype x block_size x head_dim grid once
CPU_SEEDS = 3  # the harness check of the default run: fast
MAX_ROWS = 4  # stacked query rows: the current token and up to 3 lookahead rows
MAX_TOKENS = 512  # per sequence: several splits' worth of pages, and a float64 walk that stays cheap

# The tensor-core attention kernels (crates/oasis-cuda/src/ops/attention.rs, decode_attention and
# decode_attn_tc_entry): the head_dims they are instantiated for, the query vectors of one m16 tile,
# the tokens of one mma chunk (block_size must be a multiple) and the K/V alignment in bytes.
TC_HEAD_DIMS = (64, 128, 256)
TC_MAX_QUERIES = 16
TC_CHUNK = 16
TC_ALIGN = 16
TC_LIST_CAP = 512  # 16-token chunks the kernel compacts per round (DECODE_TC_LIST_CAP)

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


@dataclass(frozen=True)
class Geometry:
    dtype: torch.dtype
    block_size: int
    head_dim: int
    group: int
    num_kv_heads: int

    @property
    def num_qo_heads(self) -> int:
        return self.group * self.num_kv_heads

    def kv(self):
        return ops.KvGeometry(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.block_size)

    def __str__(self) -> str:
        return (
            f"{DTYPE_NAMES[self.dtype]} block_size={self.block_size} head_dim={self.head_dim} "
            f"group={self.group} num_kv_heads={self.num_kv_heads}"
        )


def draw(kernel: str, seed: int) -> tuple[torch.Generator, Geometry]:
    """The case generator and geometry of ``kernel``'s seed: dtype, block_size and head_dim walk GRID
    (each kernel from its own place), group and KV heads are drawn."""
    gen = seeded("random-geometry", kernel, seed)
    dtype, block_size, head_dim = GRID[(zlib.crc32(kernel.encode()) + seed) % len(GRID)]
    return gen, Geometry(dtype, block_size, head_dim, pick(gen, GROUPS), pick(gen, KV_HEADS))


class Case(SimpleNamespace):
    """A random case: CPU tensors and sizes as attributes; ``desc`` names it in failure messages."""

    def __str__(self) -> str:
        return self.desc


def put(t: torch.Tensor | None, device: str, where: str = "cuda") -> torch.Tensor | None:
    """A copy of an input for a run on ``device``: a clone on the CPU (the twins write in place); on the
    GPU a device copy, or for a host pool pinned memory when ``where == "pinned"``."""
    if t is None:
        return None
    return t.clone() if device == "cpu" else host(t, where)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit (NaN poison included): test_gpu_kernels' check for a GPU or pinned result, the same
    comparison without the synchronisation for a CPU one."""
    if got.device.type == "cuda" or got.is_pinned():
        assert_bits_equal(got, want, what)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, what
    same = bits(got) == bits(want) if got.is_floating_point() else got == want
    assert same.all(), (
        f"{what}: {int((~same).sum())} elements differ, first at {(~same).nonzero()[0].tolist()}"
    )


# ---------------------------------------------------------------- decode attention
def generic_reasons(g: Geometry, num_rows: int, aligned: bool = True) -> list[str]:
    """Why a case goes to the generic attention kernel; empty when it takes the tensor-core one."""
    reasons = []
    if g.dtype == torch.float32:
        reasons.append("f32")
    if g.head_dim not in TC_HEAD_DIMS:
        reasons.append("head_dim")
    if num_rows * g.group > TC_MAX_QUERIES:
        reasons.append("queries")
    if g.block_size % TC_CHUNK:
        reasons.append("block_size")
    if not aligned:
        reasons.append("alignment")
    return reasons


def attention_kernel(g: Geometry, num_rows: int, aligned: bool = True) -> str:
    """The CUDA kernel decode_attention launches for this geometry (before the split-KV merge)."""
    name = DTYPE_NAMES[g.dtype]
    if generic_reasons(g, num_rows, aligned):
        return f"decode_attn_{name}"
    return f"decode_attn_tc_{name}_d{g.head_dim}"


def build_attention(
    gen, g: Geometry, num_rows, pages, *, with_map, hole_rate, with_extra, empty_row, unaligned, desc
) -> Case:
    """Sequences of ``pages`` pages scattered over a pool with spare pages, random last-page lengths;
    a head-wise map with ``hole_rate`` of its entries negative (a quarter of those -7: every negative
    entry is a hole), and with ``empty_row`` one (sequence, KV head) with no valid entry at all (row 0
    gets zeros there); the extra K/V of the lookahead rows."""
    hk, bs, d = g.num_kv_heads, g.block_size, g.head_dim
    num_pages = sum(pages) + randint(gen, 0, 16)
    k_pages = rand(gen, g.dtype, num_pages, hk, bs, d)
    v_pages = rand(gen, g.dtype, num_pages, hk, bs, d)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    lists = [[perm.pop() for _ in range(n)] for n in pages]
    last = i32([randint(gen, 1, bs) for _ in pages])
    page_map = None
    if with_map:
        page_map = torch.randint(0, 1000, (num_pages, hk), generator=gen, dtype=torch.int32)
        r = torch.rand(num_pages, hk, generator=gen)
        page_map[r < hole_rate] = -1
        page_map[r < hole_rate / 4] = -7
        if empty_row:
            s, h = randint(gen, 0, len(pages) - 1), randint(gen, 0, hk - 1)
            page_map[i32(lists[s]).long(), h] = -1
    q = rand(gen, g.dtype, len(pages), num_rows, g.num_qo_heads, d)
    extra_k = rand(gen, g.dtype, len(pages), hk, d) if with_extra else None
    extra_v = rand(gen, g.dtype, len(pages), hk, d) if with_extra else None
    kernel = attention_kernel(g, num_rows, aligned=not unaligned)
    holes = (
        f"page_map holes {hole_rate}{' + an empty row' if empty_row else ''}" if with_map else "no page_map"
    )
    return Case(
        desc=(
            f"{desc}: {g} num_rows={num_rows} pages={pages} {holes} extra={with_extra}"
            f"{' unaligned' if unaligned else ''} -> {kernel}"
        ),
        g=g,
        num_rows=num_rows,
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        kv_indptr=csr(pages),
        kv_indices=i32([p for lst in lists for p in lst]),
        last=last,
        page_map=page_map,
        extra_k=extra_k,
        extra_v=extra_v,
        max_pages=max(pages),
        splits=(1, randint(gen, 2, 8), 0),  # 0: planned from the SM count
        unaligned=unaligned,
        kernel=kernel,
    )


def attention_case(seed: int) -> Case:
    gen, g = draw("decode_attention", seed)
    num_rows = randint(gen, 1, MAX_ROWS)
    pages = [randint(gen, 1, MAX_TOKENS // g.block_size) for _ in range(randint(gen, 1, 4))]
    with_map = chance(gen, 0.8)
    return build_attention(
        gen,
        g,
        num_rows,
        pages,
        with_map=with_map,
        hole_rate=pick(gen, [0.1, 0.3, 0.6]),
        with_extra=num_rows >= 2 and chance(gen, 0.75),
        empty_row=with_map and chance(gen, 0.5),
        unaligned=False,
        desc=f"seed {seed}",
    )


def unaligned_copy(t: torch.Tensor, device) -> torch.Tensor:
    """A contiguous copy of ``t`` starting one element past an allocation: not 16-byte aligned."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def run_attention(c: Case, device: str, num_splits: int = 0) -> torch.Tensor:
    """decode_attention on copies of the case's tensors, into a poisoned ``out``."""
    q, indptr, indices, last, page_map, ek, ev = (
        put(t, device) for t in (c.q, c.kv_indptr, c.kv_indices, c.last, c.page_map, c.extra_k, c.extra_v)
    )
    if c.unaligned:
        k, v = (unaligned_copy(t, DEV if device == "cuda" else "cpu") for t in (c.k_pages, c.v_pages))
    else:
        k, v = put(c.k_pages, device), put(c.v_pages, device)
    assert ((k.data_ptr() | v.data_ptr()) % TC_ALIGN != 0) == c.unaligned, c
    out = torch.full_like(q, POISON)
    got = ops.decode_attention(
        c.g.kv(),
        q,
        k,
        v,
        indptr,
        indices,
        last,
        page_map=page_map,
        extra_k=ek,
        extra_v=ev,
        out=out,
        num_splits=num_splits,
        max_pages_per_seq=c.max_pages if num_splits == 0 else 0,
    )
    assert got is out
    return out


def check_attention(c: Case, device: str) -> None:
    """The twin against the float64 walk; on the GPU, every split count against both."""
    atol, rtol = ATTN_TOL[c.g.dtype]
    want = run_attention(c, "cpu")
    ref = ref_decode_attention(
        c.q, c.k_pages, c.v_pages, c.kv_indptr, c.kv_indices, c.last, c.page_map, c.extra_k, c.extra_v
    )
    torch.testing.assert_close(
        want.double(), ref, atol=atol, rtol=rtol, msg=lambda m: f"CPU twin vs float64, {c}: {m}"
    )
    if device == "cpu":
        return
    for splits in c.splits:
        got = back(run_attention(c, "cuda", splits))
        for other, what in ((want, "CPU twin"), (ref, "float64")):
            torch.testing.assert_close(
                got.to(other.dtype),
                other,
                atol=atol,
                rtol=rtol,
                msg=lambda m, s=splits, w=what: f"GPU vs {w}, {c}, num_splits={s}: {m}",
            )


@gpu_test
@runs(gpu_seeds=ATTN_SEEDS)
def test_decode_attention(device, seed):
    check_attention(attention_case(seed), device)


def test_random_attention_cases_reach_both_kernels():
    """Not only the named cases: the random ones reach the tensor-core kernel and the generic one with
    each 16-bit dtype, and the generic one for each reason alone (block_size 8, head_dim 96, more than
    16 query vectors)."""
    kernels: dict[torch.dtype, set[str]] = {torch.bfloat16: set(), torch.float16: set()}
    sole_reasons = set()
    for seed in range(ATTN_SEEDS):
        c = attention_case(seed)
        if c.g.dtype == torch.float32:
            assert c.kernel == "decode_attn_f32"
            continue
        kernels[c.g.dtype].add("tc" if "_tc_" in c.kernel else "generic")
        reasons = generic_reasons(c.g, c.num_rows)
        if len(reasons) == 1:
            sole_reasons.add(reasons[0])
    assert kernels == {torch.bfloat16: {"tc", "generic"}, torch.float16: {"tc", "generic"}}
    assert sole_reasons == {"block_size", "head_dim", "queries"}


# Named cases: (dtype, head_dim, block_size, group, num_rows, pages per sequence); the name says the
# kernel. Two KV heads each.
PATH_CASES = {
    "tc-bf16-d128": (torch.bfloat16, 128, 16, 4, 2, [37, 5, 1]),
    "tc-f16-d64-bs32-16queries": (torch.float16, 64, 32, 8, 2, [20, 3]),
    # 700 pages of 16 tokens, 10% holes: more 16-token chunks than TC_LIST_CAP per KV head.
    "tc-bf16-d64-long": (torch.bfloat16, 64, 16, 1, 1, [700]),
    "generic-bf16-bs8": (torch.bfloat16, 128, 8, 2, 2, [70, 9, 1]),
    "generic-f16-d96": (torch.float16, 96, 32, 2, 1, [15, 2]),
    "generic-bf16-18queries": (torch.bfloat16, 64, 16, 6, 3, [30, 4]),
    "generic-f16-unaligned": (torch.float16, 128, 16, 2, 2, [25, 3]),  # K/V 2 bytes past alignment
    "generic-f32": (torch.float32, 128, 16, 4, 2, [30, 2]),
}


def path_case(name: str) -> Case:
    dtype, head_dim, block_size, group, num_rows, pages = PATH_CASES[name]
    gen = seeded("attention-path", name)
    long = max(pages) > 100
    case = build_attention(
        gen,
        Geometry(dtype, block_size, head_dim, group, 2),
        num_rows,
        pages,
        with_map=True,
        hole_rate=0.1 if long else 0.3,
        with_extra=num_rows >= 2,
        empty_row=not long,
        unaligned="unaligned" in name,
        desc=name,
    )
    case.splits = (1, 3, 0)
    if long:
        chunks = (case.page_map[case.kv_indices.long()] >= 0).sum(dim=0)
        assert (chunks > TC_LIST_CAP).all(), chunks
    return case


def launched_kernels(fn) -> set[str]:
    """Names of the CUDA kernels that ``fn`` launches, from torch.profiler (CUPTI sees the driver-API
    launches of the NVRTC kernels like torch's own)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


@gpu_test
@pytest.mark.parametrize(
    "device,name",
    [pytest.param("cpu", n, id=f"cpu-{n}") for n in PATH_CASES]
    + [pytest.param("cuda", n, id=f"cuda-{n}", marks=NEEDS_CUDA) for n in PATH_CASES],
)
def test_decode_attention_named_case_takes_its_kernel(device, name):
    c = path_case(name)
    assert ("_tc_" in c.kernel) == name.startswith("tc-"), c
    if device == "cuda":
        run_attention(c, "cuda")  # compiled and loaded outside the profile
        for splits in (1, 3):
            names = launched_kernels(lambda s=splits: run_attention(c, "cuda", s))
            if not names:
                pytest.skip("torch.profiler recorded no CUDA kernel here (CUPTI unavailable?)")
            attn = {n for n in names if n.startswith("decode_attn")}
            assert attn == {c.kernel}, f"{c}, num_splits={splits}: launched {sorted(names)}"
            merged = f"merge_attn_states_{DTYPE_NAMES[c.g.dtype]}" in names
            assert merged == (splits > 1), f"{c}, num_splits={splits}: launched {sorted(names)}"
    check_attention(c, device)


# ---------------------------------------------------------------- append and summaries
def append_case(seed: int) -> Case:
    """Up to six sequences, each appending to its own page (and, sparse ones, to their own host block;
    any negative host id is dense) for three steps at random offsets, 0 (a summary reset) a quarter of
    the time; garbage everywhere else in the pools."""
    gen, g = draw("append_kv", seed)
    hk, bs, d = g.num_kv_heads, g.block_size, g.head_dim
    ns = randint(gen, 1, 6)
    num_pages, n_host = ns + randint(gen, 0, 6), ns + randint(gen, 0, 6)
    page_ids = torch.randperm(num_pages, generator=gen)[:ns].to(torch.int32)
    host_ids = torch.randperm(n_host, generator=gen)[:ns].to(torch.int32)
    r = torch.rand(ns, generator=gen)
    host_ids[r < 0.3] = -1
    host_ids[r < 0.1] = -3
    steps = []
    for _ in range(3):
        offs = torch.randint(0, bs, (ns,), generator=gen, dtype=torch.int32)
        offs[torch.rand(ns, generator=gen) < 0.25] = 0
        steps.append((offs, rand(gen, g.dtype, ns, hk, d), rand(gen, g.dtype, ns, hk, d)))
    return Case(
        desc=f"seed {seed}: {g} pages={page_ids.tolist()} host blocks={host_ids.tolist()}",
        g=g,
        page_ids=page_ids,
        host_ids=host_ids,
        steps=steps,
        k_pages=rand(gen, g.dtype, num_pages, hk, bs, d),
        v_pages=rand(gen, g.dtype, num_pages, hk, bs, d),
        host_k=rand(gen, g.dtype, n_host, hk, bs, d),
        host_v=rand(gen, g.dtype, n_host, hk, bs, d),
        summaries=rand(gen, g.dtype, n_host, hk, 2, d),
        where=pick(gen, HOSTS),
    )


APPEND_OUTPUTS = ["k_pages", "v_pages", "host_k", "host_v", "summaries"]


def run_append(c: Case, device: str) -> dict[str, torch.Tensor]:
    out = {n: put(getattr(c, n), device, c.where if n.startswith("host") else "cuda") for n in APPEND_OUTPUTS}
    pages, host_ids = put(c.page_ids, device), put(c.host_ids, device)
    for offs, k_new, v_new in c.steps:
        ops.append_kv(
            c.g.kv(),
            put(k_new, device),
            put(v_new, device),
            pages,
            put(offs, device),
            host_ids,
            *out.values(),
        )
    return out


def ref_append(c: Case) -> dict[str, torch.Tensor]:
    out = {n: getattr(c, n).clone() for n in APPEND_OUTPUTS}
    for offs, k_new, v_new in c.steps:
        for s, (page, hb, off) in enumerate(
            zip(c.page_ids.tolist(), c.host_ids.tolist(), offs.tolist(), strict=True)
        ):
            out["k_pages"][page, :, off], out["v_pages"][page, :, off] = k_new[s], v_new[s]
            if hb < 0:
                continue
            out["host_k"][hb, :, off], out["host_v"][hb, :, off] = k_new[s], v_new[s]
            summ = out["summaries"][hb]
            if off == 0:
                summ[:, 0], summ[:, 1] = k_new[s], k_new[s]
            else:
                summ[:, 0], summ[:, 1] = (
                    torch.minimum(summ[:, 0], k_new[s]),
                    torch.maximum(summ[:, 1], k_new[s]),
                )
    return out


@gpu_test
@runs()
def test_append_kv(device, seed):
    c = append_case(seed)
    want = run_append(c, "cpu")
    other = ref_append(c) if device == "cpu" else run_append(c, "cuda")
    for name in APPEND_OUTPUTS:
        assert_same(other[name], want[name], f"{c}: {name}")


def summaries_case(seed: int) -> Case:
    gen, g = draw("build_summaries", seed)
    hk, bs, d = g.num_kv_heads, g.block_size, g.head_dim
    n_host = randint(gen, 1, 40)
    n = randint(gen, 1, n_host)
    lens = torch.randint(1, bs + 1, (n,), generator=gen, dtype=torch.int32)
    lens[torch.rand(n, generator=gen) < 0.5] = bs
    return Case(
        desc=f"seed {seed}: {g} {n} of {n_host} blocks",
        g=g,
        keys=rand(gen, g.dtype, n_host, hk, bs, d),
        summaries=rand(gen, g.dtype, n_host, hk, 2, d),  # blocks not listed keep this garbage
        ids=torch.randperm(n_host, generator=gen)[:n].to(torch.int32),
        lens=lens,
        where=pick(gen, HOSTS),
    )


@gpu_test
@runs()
def test_build_summaries(device, seed):
    c = summaries_case(seed)
    want = c.summaries.clone()
    ops.build_summaries(c.g.kv(), c.keys, c.ids, c.lens, want)
    if device == "cpu":
        got = c.summaries.clone()
        for b, n in zip(c.ids.tolist(), c.lens.tolist(), strict=True):
            got[b, :, 0], got[b, :, 1] = c.keys[b, :, :n].amin(dim=1), c.keys[b, :, :n].amax(dim=1)
    else:
        got = put(c.summaries, device)
        ops.build_summaries(c.g.kv(), host(c.keys, c.where), put(c.ids, device), put(c.lens, device), got)
    assert_same(got, want, f"{c}: summaries")


# ---------------------------------------------------------------- scores
def score_case(seed: int) -> Case:
    """Up to five sequences of 0..60 blocks (host blocks in random order), summaries of partly filled
    blocks built by the twin."""
    gen, g = draw("score_blocks", seed)
    hk, bs, d = g.num_kv_heads, g.block_size, g.head_dim
    lens = [randint(gen, 0, 60) for _ in range(randint(gen, 1, 5))]
    n_host = sum(lens) + randint(gen, 1, 8)
    keys = rand(gen, g.dtype, n_host, hk, bs, d)
    summaries = torch.empty(n_host, hk, 2, d, dtype=g.dtype)
    block_lens = torch.randint(1, bs + 1, (n_host,), generator=gen, dtype=torch.int32)
    ops.build_summaries(g.kv(), keys, i32(list(range(n_host))), block_lens, summaries)
    return Case(
        desc=f"seed {seed}: {g} blocks per sequence {lens}",
        g=g,
        q=rand(gen, g.dtype, len(lens), g.num_qo_heads, d),
        summaries=summaries,
        blk_indptr=csr(lens),
        blk_indices=torch.randperm(n_host, generator=gen)[: sum(lens)].to(torch.int32),
    )


@gpu_test
@runs()
def test_score_blocks(device, seed):
    c = score_case(seed)
    d, group = c.g.head_dim, c.g.group
    args = (c.q, c.summaries, c.blk_indptr, c.blk_indices)
    want = ops.score_blocks(c.g.kv(), *args)
    ref = ref_score_blocks(*args)
    # NOTE: tolerances of test_gpu_kernels' score test: d * group f32 products summed in any order.
    torch.testing.assert_close(
        want.double(), ref, atol=1e-3 * d * group, rtol=1e-4, msg=lambda m: f"{c}: {m}"
    )
    if device == "cpu":
        return
    scores = torch.full((c.blk_indices.numel(), c.g.num_kv_heads), POISON, device=DEV)
    got = ops.score_blocks(c.g.kv(), *(put(t, device) for t in args), scores=scores)
    assert got is scores
    got = back(got)
    torch.testing.assert_close(got, want, atol=1e-4 * d * group, rtol=1e-4, msg=lambda m: f"{c}: {m}")
    torch.testing.assert_close(got.double(), ref, atol=1e-3 * d * group, rtol=1e-4, msg=lambda m: f"{c}: {m}")


def codes_case(seed: int) -> Case:
    """Keys of complete host blocks (one block on a half-integer grid: exact ties of the rounding; one
    channel constant: an empty range; now and then an overflowed key: a NaN bound), their summaries
    and 8-bit bounds (the CPU twin's), garbage codes, a random subset listed."""
    gen, g = draw("build_key_codes", seed)
    hk, bs, d = g.num_kv_heads, g.block_size, g.head_dim
    n_host = randint(gen, 2, 24)
    keys = rand(gen, g.dtype, n_host, hk, bs, d)
    keys[0] = (torch.randint(0, 7, keys[0].shape, generator=gen).float() * 0.5).to(g.dtype)
    keys[1, :, :, 3] = 1.0
    if chance(gen, 0.5):
        keys[randint(gen, 0, n_host - 1), randint(gen, 0, hk - 1), 0, 0] = float("inf")
    summaries = torch.empty(n_host, hk, 2, d, dtype=g.dtype)
    ops.build_summaries(g.kv(), keys, i32(list(range(n_host))), i32([bs] * n_host), summaries)
    bounds8, scales = ops.empty_bounds8(g.kv(), n_host)
    ops.build_bounds8(g.kv(), summaries, i32(list(range(n_host))), bounds8, scales)
    ids = torch.randperm(n_host, generator=gen)[: randint(gen, 1, n_host)].to(torch.int32)
    return Case(
        desc=f"seed {seed}: {g} blocks {ids.tolist()} of {n_host}",
        g=g,
        keys=keys,
        summaries=summaries,
        bounds8=bounds8,
        scales=scales,
        codes=torch.randint(0, 256, (n_host, hk, bs, d // 4), generator=gen, dtype=torch.uint8),
        ids=ids,
        where=pick(gen, HOSTS),
    )


@gpu_test
@runs()
def test_build_key_codes(device, seed):
    """The codes inside the 8-bit bound (build_key_codes), and the bound with them (encode_blocks),
    bit for bit on the GPU; on the CPU the twin against the float64 encode inside the bound."""
    c = codes_case(seed)
    want = c.codes.clone()
    ops.build_key_codes(c.g.kv(), c.keys, c.bounds8, c.scales, c.ids, want)
    enc = [c.codes.clone(), torch.zeros_like(c.bounds8), torch.zeros_like(c.scales)]
    ops.encode_blocks(c.g.kv(), c.keys, c.summaries, c.ids, *enc)
    if device == "cpu":
        ref = ref_key_codes(c.keys, c.bounds8, c.scales, c.ids.tolist())
        for b in range(c.codes.shape[0]):
            got = unpack_codes(want[b])
            if b in ref:
                assert ((got == ref[b][0]) | (got == ref[b][1])).all(), f"{c}: block {b}"
            else:  # not listed: untouched
                assert torch.equal(got, unpack_codes(c.codes[b])), f"{c}: block {b}"
        assert torch.equal(enc[0], want), f"{c}: encode_blocks' codes"
        listed = c.ids.long()
        assert_same(enc[1][listed], c.bounds8[listed], f"{c}: encode_blocks' bounds")
        assert_same(enc[2][listed], c.scales[listed], f"{c}: encode_blocks' scales")
        return
    got = put(c.codes, device)
    keys = host(c.keys, c.where)
    ops.build_key_codes(
        c.g.kv(), keys, put(c.bounds8, device), put(c.scales, device), put(c.ids, device), got
    )
    assert_same(got, want, f"{c}: codes")
    g_enc = [put(t, device) for t in (c.codes, torch.zeros_like(c.bounds8), torch.zeros_like(c.scales))]
    ops.encode_blocks(c.g.kv(), keys, put(c.summaries, device), put(c.ids, device), *g_enc)
    for name, x, y in zip(("codes", "bounds8", "scales"), g_enc, enc, strict=True):
        assert_same(x, y, f"{c}: encode_blocks' {name}")


@gpu_test
@runs()
def test_score_blocks_codes(device, seed):
    gen, g = draw("score_blocks_codes", seed)
    lens = [randint(gen, 0, 60) for _ in range(randint(gen, 1, 5))]
    geo, _, bounds, codes, q, blk_indptr, blk_indices = key_codes_case(
        gen,
        g.dtype,
        g.group,
        g.head_dim,
        g.block_size,
        hk=g.num_kv_heads,
        lens=lens,
        extra_host=randint(gen, 1, 8),
    )
    what = f"seed {seed}: {g} blocks per sequence {lens}"
    args = (*bounds, codes, blk_indptr, blk_indices)
    want = ops.score_blocks_codes(geo, q, *args)
    mag = magnitude(q, *bounds, blk_indptr, blk_indices)
    if device == "cpu":
        ref = ref_score_blocks_codes(q, *args)
        # NOTE: test_key_codes' bound: a few head_dim ulps of the magnitude sum_g sum_d |q| (|lo| + |hi|).
        err = (want.double() - ref).abs()
        assert (err <= 2e-7 * g.head_dim * mag + 1e-6).all(), f"{what}: max error {err.max().item():.3g}"
        return
    scores = torch.full((blk_indices.numel(), g.num_kv_heads), POISON, device=DEV)
    got = ops.score_blocks_codes(geo, put(q, device), *(put(t, device) for t in args), scores=scores)
    assert got is scores
    assert_scores_close(back(got), want, mag)


# ---------------------------------------------------------------- top-k
def topk_case(seed: int) -> Case:
    """Up to six sequences of 0..40 blocks, half the time one of 500..1300 (more than the kernel's 512
    threads); k from 1 to 512; scores tie-free, or with ties everywhere (-0.0 and +0.0 mixed), and
    half the time a few NaN and infinite ones."""
    gen, g = draw("topk_blocks", seed)
    hk = g.num_kv_heads
    lens = [randint(gen, 0, 40) for _ in range(randint(gen, 1, 6))]
    if chance(gen, 0.5):
        lens[randint(gen, 0, len(lens) - 1)] = randint(gen, 500, 1300)
    k = pick(gen, [1, randint(gen, 2, 64), randint(gen, 65, 512)])
    nnz = sum(lens)
    ties = chance(gen, 1 / 3)
    scores = tied_scores(gen, nnz, hk) if ties else torch.randn(nnz, hk, generator=gen)
    special = nnz > 0 and chance(gen, 0.5)
    if special:
        at = torch.randint(0, nnz * hk, (8,), generator=gen)
        values = torch.tensor([math.nan, -math.inf, math.inf, -0.0])
        scores.view(-1)[at] = values[torch.randint(0, 4, (8,), generator=gen)]
    return Case(
        desc=f"seed {seed}: num_kv_heads={hk} k={k} lens={lens} ties={ties} nan/inf={special}",
        hk=hk,
        k=k,
        scores=scores,
        blk_indptr=csr(lens),
    )


def ref_topk(c: Case) -> torch.Tensor:
    """Best first, ties to the lower index, NaN below every number (-0.0 == 0.0 in Python)."""
    ptr = c.blk_indptr.tolist()
    out = torch.full((len(ptr) - 1, c.hk, c.k), -1, dtype=torch.int32)
    for s, (b, e) in enumerate(itertools.pairwise(ptr)):
        for h in range(c.hk):
            seg = c.scores[b:e, h].tolist()
            order = sorted(range(e - b), key=lambda i, seg=seg: (math.isnan(seg[i]), -seg[i], i))[: c.k]
            out[s, h, : len(order)] = i32(order)
    return out


@gpu_test
@runs()
def test_topk_blocks(device, seed):
    c = topk_case(seed)
    want = ops.topk_blocks(c.hk, c.scores, c.blk_indptr, c.k)
    if device == "cpu":
        got = ref_topk(c)
    else:
        out = torch.full(want.shape, INT_POISON, dtype=torch.int32, device=DEV)
        got = ops.topk_blocks(c.hk, put(c.scores, device), put(c.blk_indptr, device), c.k, out=out)
        assert got is out
    assert_same(got, want, f"{c}: top-k")


# ---------------------------------------------------------------- selection, gather, copy
def select_case(seed: int) -> Case:
    """test_gpu_kernels' random selection state, over budgets the warp kernel serves (up to 256 slots)
    and the block kernel serves (above)."""
    gen, g = draw("delta_select", seed)
    hk, ns = g.num_kv_heads, randint(gen, 1, 4)
    budget = randint(gen, 1, 64) if chance(gen, 0.6) else randint(gen, 200, 300)
    num_pred = pick(gen, [budget, randint(gen, 1, budget), randint(gen, 1, budget), 0])
    cap = pick(gen, [1, randint(gen, 1, budget), budget + 3])
    step = randint(gen, 0, 20)
    slot_pages, page_map, last_sel, predicted = select_state(gen, ns, hk, budget, num_pred)
    return Case(
        desc=f"seed {seed}: num_seqs={ns} num_kv_heads={hk} budget={budget} num_pred={num_pred} "
        f"fetch_cap={cap} step={step}",
        hk=hk,
        ns=ns,
        cap=cap,
        step=step,
        slot_pages=slot_pages,
        page_map=page_map,
        last_sel=last_sel,
        predicted=predicted,
    )


def ref_delta_select(c: Case):
    """The steps of oasis_core::kernels::delta_select's documentation, in Python: the new maps, the
    plan and (pairs, kept, missing)."""
    page_map, last_sel = c.page_map.clone(), c.last_sel.clone()
    plan_slots = torch.full((c.ns, c.hk, c.cap), -1, dtype=torch.int32)
    plan_blocks = plan_slots.clone()
    pairs = kept = missing_n = 0
    for s in range(c.ns):
        pages = c.slot_pages[s].tolist()
        for h in range(c.hk):
            wanted = list(dict.fromkeys(b for b in c.predicted[s, h].tolist() if b >= 0))  # best first
            blocks = [int(page_map[p, h]) for p in pages]
            resident = {b for b in blocks if b >= 0} & set(wanted)
            for p, b in zip(pages, blocks, strict=True):
                if b in resident:
                    last_sel[p, h] = c.step
            missing = [b for b in wanted if b not in resident]
            victims = sorted(
                (i for i, b in enumerate(blocks) if b not in resident),
                key=lambda i, blocks=blocks: (blocks[i] >= 0, int(last_sel[pages[i], h]), i),
            )
            n = min(len(missing), len(victims), c.cap)
            for i in range(n):
                p = pages[victims[i]]
                page_map[p, h], last_sel[p, h] = missing[i], c.step
                plan_slots[s, h, i], plan_blocks[s, h, i] = victims[i], missing[i]
            pairs, kept, missing_n = pairs + n, kept + len(resident), missing_n + len(missing)
    return page_map, last_sel, plan_slots, plan_blocks, (pairs, kept, missing_n)


@gpu_test
@runs()
def test_delta_select(device, seed):
    c = select_case(seed)
    poison = torch.full((c.ns, c.hk, c.cap), INT_POISON, dtype=torch.int32)
    want_map, want_last = c.page_map.clone(), c.last_sel.clone()
    want_ps, want_pb, totals = ops.delta_select(
        c.hk, c.predicted, c.slot_pages, want_map, want_last, c.step, c.cap, poison.clone(), poison.clone()
    )
    if device == "cpu":
        got_map, got_last, got_ps, got_pb, got_totals = ref_delta_select(c)
    else:
        got_map, got_last = put(c.page_map, device), put(c.last_sel, device)
        stats = torch.full((c.ns, c.hk, 3), -1, dtype=torch.int32, device=DEV)
        got_ps, got_pb, _ = ops.delta_select(
            c.hk,
            put(c.predicted, device),
            put(c.slot_pages, device),
            got_map,
            got_last,
            c.step,
            c.cap,
            put(poison, device),
            put(poison, device),
            stats=stats,
        )
        st = back(stats)
        got_totals = tuple(st.sum(dim=(0, 1)).tolist())
        assert torch.equal(st[..., 0], (want_ps >= 0).sum(dim=2).to(torch.int32)), f"{c}: pairs per head"
    assert got_totals == totals, f"{c}: (pairs, kept, missing)"
    for name, got, want in [
        ("page_map", got_map, want_map),
        ("page_last_selected", got_last, want_last),
        ("plan_slots", got_ps, want_ps),
        ("plan_blocks", got_pb, want_pb),
    ]:
        assert_same(got, want, f"{c}: {name}")


def gather_case(seed: int) -> Case:
    """A plan made by the twin's delta_select from test_gpu_kernels' random state; logical blocks mapped
    to a small host pool (repeats allowed); GPU pools of garbage with NaN pages."""
    gen, g = draw("gather_blocks", seed)
    hk, bs, d = g.num_kv_heads, g.block_size, g.head_dim
    ns, budget = randint(gen, 1, 3), randint(gen, 1, 24)
    slot_pages, page_map, last_sel, predicted = select_state(gen, ns, hk, budget, randint(gen, 0, budget))
    cap = randint(gen, 1, budget + 2)
    plan_slots, plan_blocks, _ = ops.delta_select(hk, predicted, slot_pages, page_map, last_sel, 0, cap)
    n_logical = 2 * budget + 3  # select_state's logical blocks per sequence
    n_host = randint(gen, 4, 40)
    num_pages = page_map.shape[0]
    k_pages = rand(gen, g.dtype, num_pages, hk, bs, d)
    k_pages[torch.rand(num_pages, generator=gen) < 0.3] = POISON
    return Case(
        desc=f"seed {seed}: {g} num_seqs={ns} budget={budget} fetch_cap={cap}",
        g=g,
        plan_slots=plan_slots,
        plan_blocks=plan_blocks,
        slot_pages=slot_pages,
        host_indptr=csr([n_logical] * ns),
        host_indices=torch.randint(0, n_host, (ns * n_logical,), generator=gen, dtype=torch.int32),
        host_k=rand(gen, g.dtype, n_host, hk, bs, d),
        host_v=rand(gen, g.dtype, n_host, hk, bs, d),
        k_pages=k_pages,
        v_pages=rand(gen, g.dtype, num_pages, hk, bs, d),
        where=pick(gen, HOSTS),
    )


@gpu_test
@runs()
def test_gather_blocks(device, seed):
    c = gather_case(seed)
    tables = (c.plan_slots, c.plan_blocks, c.slot_pages, c.host_indptr, c.host_indices)
    want_k, want_v = c.k_pages.clone(), c.v_pages.clone()
    copied = ops.gather_blocks(c.g.kv(), *tables, c.host_k, c.host_v, want_k, want_v)
    assert copied == int((c.plan_slots >= 0).sum()), c
    if device == "cpu":
        got_k, got_v = c.k_pages.clone(), c.v_pages.clone()
        ptr = c.host_indptr.tolist()
        for s, h, i in (c.plan_slots >= 0).nonzero().tolist():
            page = int(c.slot_pages[s, c.plan_slots[s, h, i]])
            hb = int(c.host_indices[ptr[s] + int(c.plan_blocks[s, h, i])])
            got_k[page, h], got_v[page, h] = c.host_k[hb, h], c.host_v[hb, h]
    else:
        got_k, got_v = put(c.k_pages, device), put(c.v_pages, device)
        pools = (host(c.host_k, c.where), host(c.host_v, c.where))
        # Every launch shape copies the same entries (the warps stride over the plan): a random one
        # per seed (staged through shared memory or not), the default for a third of them.
        lg = torch.Generator().manual_seed(seed)
        launch = (
            pick(lg, [0, 1, 2, 5]),
            randint(lg, 1, 4),
            pick(lg, [1, 2, 3, 7, 16, 31, 32]),
            pick(lg, [0, 1, 2, 5, 32]),
        )
        if seed % 3 == 0:
            launch = ops.gather_launch()
        ops.set_gather_launch(*launch)
        try:
            dev_tables = [put(t, device) for t in tables]
            assert ops.gather_blocks(c.g.kv(), *dev_tables, *pools, got_k, got_v) is None
            torch.cuda.synchronize()
        finally:
            ops.set_gather_launch()
        c.desc = f"{c.desc} gather launch {launch}"
    assert_same(got_k, want_k, f"{c}: k_pages")
    assert_same(got_v, want_v, f"{c}: v_pages")


def copy_case(seed: int) -> Case:
    """0..n_dst pages from a random source pool (repeats allowed) to distinct destination pages; each
    pool pinned or on the device."""
    gen, g = draw("copy_pages", seed)
    hk, bs, d = g.num_kv_heads, g.block_size, g.head_dim
    n_src, n_dst = randint(gen, 1, 16), randint(gen, 1, 16)
    n = randint(gen, 0, n_dst)
    dst_k = rand(gen, g.dtype, n_dst, hk, bs, d)
    dst_k[0] = POISON
    src_where, dst_where = pick(gen, HOSTS), pick(gen, HOSTS)
    return Case(
        desc=f"seed {seed}: {g} {n} pages, {src_where} -> {dst_where}",
        g=g,
        src_k=rand(gen, g.dtype, n_src, hk, bs, d),
        src_v=rand(gen, g.dtype, n_src, hk, bs, d),
        src_ids=torch.randint(0, n_src, (n,), generator=gen, dtype=torch.int32),
        dst_k=dst_k,
        dst_v=rand(gen, g.dtype, n_dst, hk, bs, d),
        dst_ids=torch.randperm(n_dst, generator=gen)[:n].to(torch.int32),
        src_where=src_where,
        dst_where=dst_where,
    )


@gpu_test
@runs()
def test_copy_pages(device, seed):
    c = copy_case(seed)
    want_k, want_v = c.dst_k.clone(), c.dst_v.clone()
    ops.copy_pages(c.g.kv(), c.src_k, c.src_v, c.src_ids, want_k, want_v, c.dst_ids)
    if device == "cpu":
        got_k, got_v = c.dst_k.clone(), c.dst_v.clone()
        for s, t in zip(c.src_ids.tolist(), c.dst_ids.tolist(), strict=True):
            got_k[t], got_v[t] = c.src_k[s], c.src_v[s]
    else:
        src = (host(c.src_k, c.src_where), host(c.src_v, c.src_where))
        got_k, got_v = host(c.dst_k, c.dst_where), host(c.dst_v, c.dst_where)
        ops.copy_pages(c.g.kv(), *src, put(c.src_ids, device), got_k, got_v, put(c.dst_ids, device))
    assert_same(got_k, want_k, f"{c}: dst_k")
    assert_same(got_v, want_v, f"{c}: dst_v")
