"""A long prompt is admitted sparse (``Engine.prefills_sparse``), prefilled in one piece or in
chunks: its layers go from the forward straight to the host pool (later chunks read the earlier
positions back from there), and only its working set takes GPU pages. Against the path through
dense pages that ``make_sparse`` copies (``DIRECT_SPARSE_PREFILL`` off): the same pools bit for
bit and the same logits; a prompt whose dense pages exceed the GPU budget decodes the same
tokens; over an fp8 host pool the chunks read the prompt back as fp8 pages do; a failed chunk
gives everything back."""

from __future__ import annotations

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams
from oasiskv.engine import Engine, PrefillCache, Request
from oasiskv.engine import pools as pools_mod
from oasiskv.engine import prefill as prefill_mod
from oasiskv.engine.prefill import SparsePrefill, clip_runs, row_runs
from oasiskv.errors import OasisError
from support.engines import (
    SMALL_KV,
    chunked_prefill,
    host_state,
    kv8_pages_and_host_rows,
    repeated_prompts,
    teacher_forced_logits,
)
from support.fakes import pools_are_full, prompt, tiny

torch.set_num_threads(2)


def _run(model, kv, prompts, forced, direct, monkeypatch, **engine_kw):
    monkeypatch.setattr(pools_mod, "DIRECT_SPARSE_PREFILL", direct)
    return teacher_forced_logits(model, kv, "oasis", prompts, forced, **engine_kw)


@pytest.mark.parametrize("selection", ["fidelity", "fast"])
@pytest.mark.parametrize("host_kv_dtype", [None, "fp8_e4m3"])
@pytest.mark.parametrize("shared", [False, True])
def test_sparse_prefill_equals_the_path_through_pages(qwen3, monkeypatch, selection, host_kv_dtype, shared):
    """Two prompts (83 tokens: a partial last block; 96: whole blocks), or one prompt twice through
    a PrefillCache (``shared``: the second prefill stores the cached layers): the same logits at
    every step and the same host rows, summaries, codes and bounds as prefilling through dense
    pages and copying them; and the GPU page pool never grows past the working sets."""
    make = KvConfig.fidelity if selection == "fidelity" else KvConfig.fast
    kv = make(**SMALL_KV, host_kv_dtype=host_kv_dtype)
    lens = [83, 83] if shared else [83, 96]
    prompts = repeated_prompts(qwen3.config.vocab_size, lens, seed=5)
    if shared:
        prompts[1] = list(prompts[0])
    g = torch.Generator().manual_seed(9)
    forced = [torch.randint(0, qwen3.config.vocab_size, (6,), generator=g).tolist() for _ in prompts]
    runs = {}
    for direct in (False, True):
        kw = {"prefill_cache": PrefillCache()} if shared else {}
        runs[direct] = _run(qwen3, kv, prompts, forced, direct, monkeypatch, **kw)
    (lp, rp, ep), (ld, rd, ed) = runs[False], runs[True]
    assert torch.equal(ld, lp)
    for a, b in zip(rp, rd, strict=True):
        assert a.sparse and b.sparse
        assert b.metrics.sparse_since_token == len(b.prompt)
        for x, y in zip(host_state(ep, a), host_state(ed, b), strict=True):
            assert torch.equal(x, y)
    k1 = SMALL_KV["top_k_blocks"] + 1
    assert ed.runtime.pool_sizes[0] <= len(prompts) * k1 < ep.runtime.pool_sizes[0]


@pytest.mark.parametrize("chunk", [None, 100], ids=["one-piece", "chunks-of-100"])
def test_a_prompt_past_the_gpu_budget_decodes_sparse(monkeypatch, chunk):
    """A 400-token prompt needs 25 dense pages; with a GPU budget of 12 (K + 1 = 9 per request) it
    is admitted sparse, prefilled in one piece or in chunks of 100 tokens
    (``max_num_batched_tokens``), and decodes the greedy tokens of an engine that prefilled it
    through pages with room for them. The pools are full again afterwards."""
    model = tiny()
    kv = KvConfig(block_size=16, top_k_blocks=8, fetch_cap=0.25, sparse_threshold=64)
    ids = prompt(400, 2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    monkeypatch.setattr(pools_mod, "DIRECT_SPARSE_PREFILL", False)
    roomy = LLMEngine(model, kv=kv, drafter="ngram")
    rid = roomy.add_request(ids, params)
    want = roomy.run_to_completion([rid])[rid].token_ids

    monkeypatch.setattr(pools_mod, "DIRECT_SPARSE_PREFILL", True)
    page = LLMEngine(model, kv=kv).engine.page_bytes_all_layers
    opts = {} if chunk is None else {"max_num_batched_tokens": chunk}
    small = LLMEngine(model, kv=kv, drafter="ngram", gpu_kv_budget_bytes=12 * page, **opts)
    rid = small.add_request(ids, params)
    assert small.run_to_completion([rid])[rid].token_ids == want
    assert small.engine.runtime.pool_sizes[0] <= 12 and pools_are_full(small)


@pytest.mark.parametrize("selection", ["fidelity", "fast"])
@pytest.mark.parametrize("chunks", [[40, 64], [37, 50, 61, 80]], ids=["whole-blocks", "inside-blocks"])
def test_a_chunked_prefill_is_admitted_sparse_and_equals_the_path_through_pages(
    qwen3, monkeypatch, selection, chunks
):
    """Chunks of a long prompt go straight to the host pool and read the earlier positions back
    from there: against chunks through dense pages (then ``make_sparse``), the same logits at every
    step and the same host rows, summaries, codes and bounds, with chunks ending on block
    boundaries or inside blocks (83 and 96 tokens, blocks of 8); the page pool never holds more
    than the working sets."""
    make = KvConfig.fidelity if selection == "fidelity" else KvConfig.fast
    kv = make(**SMALL_KV)
    prompts = repeated_prompts(qwen3.config.vocab_size, [83, 96], seed=5)
    g = torch.Generator().manual_seed(9)
    forced = [torch.randint(0, qwen3.config.vocab_size, (6,), generator=g).tolist() for _ in prompts]
    runs = {}
    for direct in (False, True):
        monkeypatch.setattr(pools_mod, "DIRECT_SPARSE_PREFILL", direct)
        runs[direct] = teacher_forced_logits(qwen3, kv, "oasis", prompts, forced, chunks=chunks)
    (lp, rp, ep), (ld, rd, ed) = runs[False], runs[True]
    assert ed.prefills_sparse(83) and torch.equal(ld, lp)
    for a, b in zip(rp, rd, strict=True):
        assert a.sparse and b.sparse and b.sparse_prefill is None
        assert b.metrics.sparse_since_token == len(b.prompt)
        for x, y in zip(host_state(ep, a), host_state(ed, b), strict=True):
            assert torch.equal(x, y)
    k1 = SMALL_KV["top_k_blocks"] + 1
    assert ed.runtime.pool_sizes[0] <= len(prompts) * k1 < ep.runtime.pool_sizes[0]


def test_chunks_over_an_fp8_host_pool_read_the_prompt_back_as_fp8_pages_do(qwen3):
    """An fp8 host pool holds the prompt quantized, and later chunks read it back so (code x
    scale), as fp8 pages give a chunked prefill its earlier positions: with chunks ending on block
    boundaries, the prefill's logits equal those of the same chunks over fp8 pages
    (``kv_dtype="fp8_e4m3"``, the path through pages) bit for bit, and the host rows hold the
    codes and scales those pages hold (each block quantized once from its own K/V)."""
    ids = repeated_prompts(qwen3.config.vocab_size, [83], seed=3)[0]
    e8, r8, pages8 = chunked_prefill(qwen3, KvConfig(**SMALL_KV, kv_dtype="fp8_e4m3"), ids, [40, 64])
    assert not r8.sparse and not e8.prefills_sparse(len(ids))  # fp8 pages: through them
    eh, rh, host8 = chunked_prefill(qwen3, KvConfig(**SMALL_KV, host_kv_dtype="fp8_e4m3"), ids, [40, 64])
    assert rh.sparse and rh.pages == [] and torch.equal(host8, pages8)
    for a, b in kv8_pages_and_host_rows(e8, r8, eh, rh):
        assert torch.equal(a, b)


def test_row_runs_cover_the_rows_in_order():
    """``row_runs`` cuts a row list into maximal runs of consecutive rows that give the list back
    in order; ``clip_runs`` cuts them at a row count."""
    g = torch.Generator().manual_seed(4)
    for _ in range(200):
        rows = torch.randperm(40, generator=g)[: int(torch.randint(0, 40, (1,), generator=g))].tolist()
        if rows and int(torch.randint(0, 2, (1,), generator=g)):
            rows = list(range(7, 7 + len(rows)))  # one run
        runs = row_runs(rows)
        assert [r + i for _, r, n in runs for i in range(n)] == rows
        assert [at for at, _, _ in runs] == [sum(n for _, _, n in runs[:i]) for i in range(len(runs))]
        assert all(a[1] + a[2] != b[1] for a, b in zip(runs[:-1], runs[1:], strict=True))  # maximal
        for nb in range(len(rows) + 1):
            assert [r + i for _, r, n in clip_runs(runs, nb) for i in range(n)] == rows[:nb]


@pytest.mark.parametrize("host_kv_dtype", [None, "fp8_e4m3"])
@pytest.mark.parametrize("max_runs", [64, 0], ids=["copies", "page-kernel"])
def test_the_read_back_gives_the_host_rows_in_the_prompts_order(qwen3, monkeypatch, host_kv_dtype, max_runs):
    """``SparsePrefill.prefix`` reads a prompt's earlier positions back from host rows in any
    order (a fragmented pool: runs of consecutive rows, or the page copy kernel past
    ``MAX_COPY_RUNS``): positions ``0 .. n - 1`` equal the host rows' values (code x scale over an
    fp8 pool) laid out position by position, for every layer, prefetched or not."""
    monkeypatch.setattr(prefill_mod, "MAX_COPY_RUNS", max_runs)
    kv = KvConfig(**SMALL_KV, host_kv_dtype=host_kv_dtype)
    eng = Engine(qwen3, kv, "oasis", None)
    eng.ensure_pools([Request(id=0, prompt=list(range(200)), max_new_tokens=4)])
    p, b = eng.pools, kv.block_size
    hk, d = eng.geo.num_kv_heads, eng.geo.head_dim
    rows = [9, 10, 11, 3, 4, 17, 0, 1, 2, 12]  # four runs and a row alone
    assert p.host_k[0].shape[0] > max(rows)
    g = torch.Generator().manual_seed(2)
    for layer in range(eng.cfg.num_hidden_layers):
        for t in (p.host_k[layer], p.host_v[layer]):
            if host_kv8 := t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 0x7F, t.shape, generator=g, dtype=torch.uint8))  # finite E4M3
            else:
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        if host_kv8:
            for t in (p.host_k_scales[layer], p.host_v_scales[layer]):
                t.copy_(2.0 ** torch.randint(-3, 3, t.shape, generator=g).float())
    nr = len(rows)
    tr = {"host_blocks": list(range(nr)), "host_rows": rows, "n_complete": nr, "lens": [b] * nr}
    n = 7 * b + 5  # ends inside the eighth row
    direct = SparsePrefill(eng, tr)
    direct.prefetch(1, n)
    idx = torch.tensor(rows[: -(-n // b)], dtype=torch.long)
    for layer in range(eng.cfg.num_hidden_layers):
        k, v = direct.prefix(layer, n)
        for got, want in zip((k, v), p.host_kv(layer, idx), strict=True):
            want = want.transpose(1, 2).reshape(-1, hk, d)[:n]
            assert got.shape == (n, hk, d) and got.dtype == eng.dtype
            assert torch.equal(got.cpu(), want.cpu())


def test_a_failed_chunk_releases_the_request(qwen3, monkeypatch):
    """A chunk that fails while storing a layer gives the request's rows and pages back, and the
    engine admits and prefills it again afterwards."""
    kv = KvConfig(**SMALL_KV)
    ids = repeated_prompts(qwen3.config.vocab_size, [90], seed=3)[0]
    eng = Engine(qwen3, kv, "oasis", None)
    r = Request(id=0, prompt=ids, max_new_tokens=4)
    eng.ensure_pools([r])
    free = eng.runtime.num_free
    orig = SparsePrefill.store

    def flaky(self, layer, k, v, first=0):
        if first and layer == 1:
            raise OasisError("injected")
        orig(self, layer, k, v, first)

    monkeypatch.setattr(SparsePrefill, "store", flaky)
    assert eng.prefill_chunk(r, 0, 40) is None and r.sparse
    with pytest.raises(OasisError, match="injected"):
        eng.prefill_chunk(r, 40, len(ids))
    assert eng.runtime.num_requests == 0 and eng.runtime.num_free == free and r.sparse_prefill is None
    monkeypatch.setattr(SparsePrefill, "store", orig)
    r = Request(id=1, prompt=ids, max_new_tokens=4)
    eng.prefill_chunk(r, 0, 40)
    assert eng.prefill_chunk(r, 40, len(ids)) is not None and r.sparse
