"""Disaggregation in fp8 (issue 36): a prefill worker whose KvConfig has an fp8 host tier
(``kv_dtype="fp8_e4m3"``: fp8 GPU pages and host pool; ``host_kv_dtype="fp8_e4m3"``: the host pool
alone) stages its blocks as E4M3 codes with a float32 scale per (block, KV head) (the daemon
geometry's ``kv_format`` 1), byte for byte what the single-process engine's host pool holds; the
decode engine of the same KvConfig admits them into its fp8 host pool, fully or block-head by
block-head, and decodes the single-process engine's greedy tokens. The blocks cross in
``(b*d + 4) / (2*b*d)`` of bf16's bytes. Mismatched formats are refused with the KvConfig to pass.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams, disagg
from oasiskv._core import RtClient
from oasiskv.disagg import PrefillWorker
from oasiskv.engine import Engine, Request
from support.fakes import pools_are_full, prompt, tiny
from support.rtd import Daemon
from support.staged import all_released

# Private names read here: ``RtClient`` from ``oasiskv._core`` (the daemon's client, to read the
# staged bytes back), ``Engine``/``Request`` (the single-process engine's host pool right after its
# dense -> sparse copy, the bytes the staged blocks must equal).

P, M = 300, 24  # prompt and new tokens (300 = 18 full blocks of 16 and a partial one)
#: A small budget: 4 blocks per KV head (the selection drifts, so partial transfers read misses).
SMALL = {"block_size": 16, "top_k_blocks": 4, "sparse_threshold": 64, "block_score": "quest"}
#: The budget covers the context: with ``first_query="first_token"`` the tokens then equal too.
BIG = {**SMALL, "top_k_blocks": 32}
#: The two fp8 configurations: fp8 GPU pages (and host pool), and an fp8 host pool under float pages.
FP8 = {"pages": {"kv_dtype": "fp8_e4m3"}, "host": {"host_kv_dtype": "fp8_e4m3"}}
SEEDS = (3, 5)


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def daemon():
    with Daemon(memory="512MiB") as d:
        yield d


def _params(n: int = M) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _run(eng: LLMEngine, adds) -> list:
    ids = [add(eng) for add in adds]
    out = eng.run_to_completion(ids)
    return [out[i] for i in ids]


def _stage(model, kv: KvConfig, addr: str, prompts, first_query: str = "prompt") -> list:
    worker = PrefillWorker(model, kv, addr, first_query=first_query)
    try:
        return [worker.prefill(p) for p in prompts]
    finally:
        worker.close()


def _host_pool_after_prefill(model, kv: KvConfig, ids: list[int]) -> list[tuple]:
    """The single-process engine's host pool right after the request's dense -> sparse copy: per
    layer ``(k_codes, k_scales, v_codes, v_scales)`` of its prompt's blocks, in block order."""
    eng = Engine(model, kv, "oasis", None)
    r = Request(id=0, prompt=ids, max_new_tokens=M)
    eng.ensure_pools([r])
    r.tokens = list(ids)
    eng.prefill(r)
    eng.make_sparse(r)
    p = eng.pools
    rows = torch.tensor(r.host_rows, dtype=torch.long)
    return [
        tuple(t[layer][rows].clone() for t in (p.host_k, p.host_k_scales, p.host_v, p.host_v_scales))
        for layer in range(model.config.num_hidden_layers)
    ]


def _staged_blocks(addr: str, h) -> list[tuple]:
    """What the daemon holds of ``h``: per layer ``(k_codes, k_scales, v_codes, v_scales)`` of
    every block, read back whole."""
    layers, hk, b, d, _, nb, fmt = h.geometry
    assert fmt == disagg.KV_FORMAT_FP8
    c = RtClient(addr)
    try:
        out = []
        for layer in range(layers):
            data, lens, errs = c.read_blocks([(h.request_id, layer, i, -1) for i in range(nb)])
            assert errs == [None] * nb and set(lens) == {disagg.block_bytes(h.geometry)}
            k, v, ks, vs = disagg.unpack_kv8(data, nb, hk, b, d)
            out.append((k, ks, v, vs))
        return out
    finally:
        c.close()


@pytest.mark.parametrize("first_query", ["prompt", "first_token"])
@pytest.mark.parametrize("tier", sorted(FP8))
def test_staged_fp8_blocks_are_the_single_process_host_pool(model, daemon, tier, first_query):
    """The staged codes and scales equal, bit for bit, the host pool of a single-process engine of
    the same KvConfig right after it turns the request sparse, the partial last block included
    (``first_token``'s extra decode step appends into that page; the staged block stays the
    prompt's)."""
    kv = KvConfig(**BIG, **FP8[tier])
    ids = prompt(P, 7)
    (h,) = _stage(model, kv, daemon.addr, [ids], first_query)
    assert h.geometry[-1] == disagg.KV_FORMAT_FP8 and h.geometry[4] == 4  # float32 model dtype
    want = _host_pool_after_prefill(model, kv, ids)
    got = _staged_blocks(daemon.addr, h)
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, a, b in zip(("k codes", "k scales", "v codes", "v scales"), g, w, strict=True):
            assert torch.equal(a, b), (layer, name)
    # Codes, not zeros: the comparison compared something.
    assert all(int(g[0].count_nonzero()) > 0 for g in got)
    RtClient(daemon.addr).release(h.request_id)


@pytest.mark.parametrize("read_ahead", [2, 0])
@pytest.mark.parametrize("transfer", ["partial", "full"])
@pytest.mark.parametrize("tier", sorted(FP8))
def test_fp8_tokens_equal_the_single_process_engine(model, daemon, tier, transfer, read_ahead):
    """Greedy tokens through the daemon equal the single-process OasisKV engine's of the same fp8
    KvConfig (two requests in one batch, a small budget, ``first_query="prompt"``), with the
    admission data read ahead or in the loop; a partial transfer reads fp8 block-heads during
    decode, a full one every block at admission."""
    kv = KvConfig(**SMALL, **FP8[tier])
    prompts = [prompt(P, s) for s in SEEDS]
    handles = _stage(model, kv, daemon.addr, prompts)
    eng = LLMEngine(model, kv=kv, drafter="ngram", kv_source=daemon.url, kv_transfer=transfer)
    assert eng.engine.host_kv8 and eng.engine.page_kv8 == (tier == "pages")
    eng.kv_source.prefetch_depth = read_ahead
    outs = _run(eng, [lambda e, h=h: e.add_staged_request(h, _params()) for h in handles])
    ref = LLMEngine(model, kv=kv, backend="oasis", drafter="ngram")
    refs = _run(ref, [lambda e, p=p: e.add_request(p, _params()) for p in prompts])
    for o, r, h in zip(outs, refs, handles, strict=True):
        assert o.finish_reason == "length", o.error
        assert o.token_ids == r.token_ids
        assert o.metrics.fetched_bytes_total == r.metrics.fetched_bytes_total  # the PCIe gathers
        if transfer == "partial":
            assert 0 < o.metrics.network_admission_bytes < h.kv_bytes
            assert o.metrics.network_fetched_bytes > 0
        else:
            assert o.metrics.network_admission_bytes > h.kv_bytes
    st = eng.kv_source.stats
    assert st.failures == 0 and st.cached_bytes == 0
    if transfer == "full":
        # Every fp8 block-head counted at its size: the cache held exactly the staged KV.
        assert st.peak_cached_bytes == sum(h.kv_bytes for h in handles)
    else:
        assert 0 < st.peak_cached_bytes < sum(h.kv_bytes for h in handles)
    assert pools_are_full(eng)
    assert all_released(eng.kv_source.client)


@pytest.mark.parametrize("transfer", ["partial", "full"])
@pytest.mark.parametrize("tier", sorted(FP8))
def test_a_prompt_of_whole_blocks_decodes_the_single_process_tokens(model, daemon, tier, transfer):
    """A prompt that fills its last block (288 = 18 x 16 tokens) has no partial last block: the
    worker stages no ``oasis/local_kv`` section over float pages, and the decode side must not ask
    for one (it did, failing the admission; found by ``bench.disagg --host-kv-dtype fp8`` at 4,096
    tokens). Its tokens equal the single-process engine's."""
    kv = KvConfig(**SMALL, **FP8[tier])
    prompts = [prompt(288, s) for s in SEEDS]
    handles = _stage(model, kv, daemon.addr, prompts)
    eng = LLMEngine(model, kv=kv, drafter="ngram", kv_source=daemon.url, kv_transfer=transfer)
    outs = _run(eng, [lambda e, h=h: e.add_staged_request(h, _params()) for h in handles])
    ref = LLMEngine(model, kv=kv, backend="oasis", drafter="ngram")
    refs = _run(ref, [lambda e, p=p: e.add_request(p, _params()) for p in prompts])
    for o, r in zip(outs, refs, strict=True):
        assert o.finish_reason == "length", o.error
        assert o.token_ids == r.token_ids
    assert eng.kv_source.stats.failures == 0 and pools_are_full(eng)
    assert all_released(eng.kv_source.client)


def test_fp8_blocks_cross_in_about_half_of_bf16_s_bytes(daemon):
    """The same prompt staged from a bf16 model with plain and with fp8 blocks: the blocks (the
    handle's ``kv_bytes`` and what the daemon returns for every block) are exactly
    ``(b*d + 4) / (2*b*d)`` of bf16's; the daemon's accounting of the request differs by exactly
    that and the sections that differ (the summaries and the query stay bf16)."""
    model16 = tiny().to(torch.bfloat16)
    ids = prompt(P, 11)
    (plain,) = _stage(model16, KvConfig(**SMALL), daemon.addr, [ids])
    (fp8,) = _stage(model16, KvConfig(**SMALL, host_kv_dtype="fp8_e4m3"), daemon.addr, [ids])
    layers, hk, b, d, elem, nb, fmt = fp8.geometry
    assert (elem, fmt, plain.geometry[-1]) == (2, disagg.KV_FORMAT_FP8, disagg.KV_FORMAT_PLAIN)
    assert plain.geometry[:-1] == fp8.geometry[:-1]
    ratio = Fraction(b * d + 4, 2 * b * d)
    assert Fraction(fp8.kv_bytes, plain.kv_bytes) == ratio
    c = RtClient(daemon.addr)
    read = {}
    for h in (plain, fp8):
        keys = [(h.request_id, layer, i, -1) for layer in range(layers) for i in range(nb)]
        read[h.geometry[-1]] = sum(c.read_blocks(keys)[1])
    assert Fraction(read[1], read[0]) == ratio and read[1] == fp8.kv_bytes
    # A block-head read: (b*d + 4) twice, against 2*b*d*2.
    assert sum(c.read_blocks([(fp8.request_id, 0, 0, 1)])[1]) == 2 * (b * d + 4)
    # The daemon's accounting of the whole request moves by the blocks' bytes alone, plus the
    # sections that differ: the unquantized local block (float pages over an fp8 host pool; a
    # section costs its name, its bytes and the entry overhead) and the meta's JSON. On this tiny
    # geometry (d = 16, 2 layers) the fixed per-entry overheads keep the ratio at ~0.62.
    meta = {h.geometry[-1]: c.fetch_admission(h.request_id, 0, 0)["sections"] for h in (plain, fp8)}
    assert disagg.LOCAL_SECTION not in meta[0]
    local = meta[1][disagg.LOCAL_SECTION]
    assert len(local) == layers * 2 * hk * b * d * elem
    meta_delta = len(meta[1][disagg.META_SECTION]) - len(meta[0][disagg.META_SECTION])
    local_cost = 64 + len(disagg.LOCAL_SECTION) + len(local)
    assert fp8.staged_bytes - plain.staged_bytes == fp8.kv_bytes - plain.kv_bytes + local_cost + meta_delta
    assert fp8.staged_bytes < 0.65 * plain.staged_bytes
    for h in (plain, fp8):
        c.release(h.request_id)
    c.close()


@pytest.mark.parametrize(
    ("staged", "decoded", "says"),
    [
        ({"host_kv_dtype": "fp8_e4m3"}, {}, "KvConfig(host_kv_dtype='fp8_e4m3')"),
        ({}, {"host_kv_dtype": "fp8_e4m3"}, "PrefillWorker whose KvConfig"),
        ({"kv_dtype": "fp8_e4m3"}, {}, "KvConfig(host_kv_dtype='fp8_e4m3')"),
        # Both fp8 blocks, but the pages differ: the staged summaries bound other keys.
        ({"kv_dtype": "fp8_e4m3"}, {"host_kv_dtype": "fp8_e4m3"}, "same KvConfig.kv_dtype"),
        ({"host_kv_dtype": "fp8_e4m3"}, {"kv_dtype": "fp8_e4m3"}, "same KvConfig.kv_dtype"),
    ],
)
def test_mismatched_formats_are_refused(model, daemon, staged, decoded, says):
    """A request staged in another block format (or over other GPU pages) than the decode
    engine's fails alone, saying which KvConfig fixes it; the engine and the daemon are left
    clean."""
    (h,) = _stage(model, KvConfig(**SMALL, **staged), daemon.addr, [prompt(P, 3)])
    eng = LLMEngine(model, kv=KvConfig(**SMALL, **decoded), drafter="ngram", kv_source=daemon.url)
    (o,) = _run(eng, [lambda e: e.add_staged_request(h, _params(4))])
    assert o.finish_reason == "error" and says in o.error and "fp8_e4m3" in o.error, o.error
    assert pools_are_full(eng)
    assert all_released(eng.kv_source.client)  # released with the failure


@pytest.mark.parametrize("tier", sorted(FP8))
def test_a_bounded_fp8_host_pool_decodes_as_the_unbounded_one(model, daemon, tier):
    """``kv_cache_blocks=C`` over an fp8 host pool: cached rows change hands (evictions), their
    codes and scales are read again, and the tokens stay the unbounded run's."""
    kv = KvConfig(**SMALL, **FP8[tier])
    c = model.config.num_key_value_heads * SMALL["top_k_blocks"]  # the floor: 8 of 19 blocks
    prompts = [prompt(P, s) for s in SEEDS]
    outs = {}
    for cache in (None, c):
        handles = _stage(model, kv, daemon.addr, prompts)
        eng = LLMEngine(model, kv=kv, drafter="ngram", kv_source=daemon.url, kv_cache_blocks=cache)
        outs[cache] = _run(eng, [lambda e, h=h: e.add_staged_request(h, _params()) for h in handles])
        st = eng.kv_source.stats
        assert st.failures == 0 and (st.evicted_blocks > 0) == (cache is not None)
        assert pools_are_full(eng)
    for a, b in zip(outs[None], outs[c], strict=True):
        assert a.finish_reason == b.finish_reason == "length", (a.error, b.error)
        assert a.token_ids == b.token_ids
