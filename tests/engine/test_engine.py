"""End-to-end generation: the oasis backend against dense, mixed batches, invariants, errors,
chunked prefill, pool growth, CUDA-graph defaults (the selection's options: test_selection.py)."""

from __future__ import annotations

import pytest
import torch

import oasiskv
from oasiskv import KvConfig, errors
from oasiskv.drafters import NgramDrafter, OracleDrafter, PreviousQueryDrafter
from oasiskv.engine import Engine
from oasiskv.models.transformer import CausalLM
from support.configs import LLAMA_8L
from support.engines import llama_like, repeated_prompts

# Private names read here: ``_last_q`` (the lookahead queries after a chunked prefill),
# ``_recall_phase`` (the per-step recall decision) and ``pools._grown`` (how a host pool grows).
# No public hook exposes them.

torch.set_num_threads(2)


@pytest.mark.parametrize("drafter,sinks", [("ngram", 0), ("previous-query", 0), ("ngram", 3)])
def test_full_budget_oasis_equals_dense_tokens_qwen3(qwen3, drafter, sinks):
    """Budget >= context: greedy tokens identical to dense, while the requests really run sparse
    (with sink blocks too: they take slots the budget has to spare)."""
    ps = repeated_prompts(qwen3.config.vocab_size, [211, 97, 150], period=37)
    kv = KvConfig(block_size=16, top_k_blocks=32, fetch_cap=4, sparse_threshold=64, sink_blocks=sinks)
    dense = oasiskv.LLM(qwen3, kv=kv, backend="dense", drafter=drafter).generate(ps, 24, ignore_eos=True)
    oasis = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter=drafter).generate(ps, 24, ignore_eos=True)
    for d, o in zip(dense, oasis, strict=True):
        assert o.tokens == d.tokens
        assert o.metrics.sparse_steps == o.metrics.steps > 0
        assert d.metrics.sparse_steps == 0
        # Everything fits: the prediction is exact (recall 1) once blocks complete.
        assert o.metrics.lookahead_recall is None or o.metrics.lookahead_recall == pytest.approx(1.0)


def test_mixed_dense_and_sparse_batch_with_small_budget(qwen3):
    """Requests of different lengths share one batch; the short one stays dense and is exact."""
    ps = repeated_prompts(qwen3.config.vocab_size, [300, 40, 123], seed=3, period=37)
    kv = KvConfig(block_size=8, top_k_blocks=6, fetch_cap=2, sparse_threshold=100)
    dense = oasiskv.LLM(qwen3, kv=kv, backend="dense", drafter="ngram").generate(ps, 16, ignore_eos=True)
    oasis = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram").generate(ps, 16, ignore_eos=True)
    assert oasis[1].metrics.sparse_steps == 0 and oasis[1].tokens == dense[1].tokens
    for r in (oasis[0], oasis[2]):
        m = r.metrics
        assert m.sparse_steps == m.steps
        assert m.resident_kv_bytes < m.full_kv_bytes
        assert 0.0 <= m.lookahead_recall <= 1.0
        # The cap bounds traffic: at most C blocks per KV head, layer and step.
        page_bytes = 2 * 2 * 8 * 32 * 4  # K+V, 2 kv heads, block 8, head_dim 32, f32
        entry_bytes = page_bytes // 2
        cap_bytes = 2 * 2 * qwen3.config.num_hidden_layers * entry_bytes
        assert m.fetched_bytes_per_step <= cap_bytes
        assert len(r.tokens) == 16


def test_working_set_invariants_during_generation(qwen3):
    """After every step: slots hold exactly the host blocks the mapping names, no block twice per
    head, the local block is resident and the budget is never exceeded."""
    kv = KvConfig(block_size=8, top_k_blocks=5, fetch_cap=1, sparse_threshold=50)
    llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
    eng = llm.engine
    checked = {"n": 0}
    orig = eng.decode_step

    def checked_step(reqs):
        logits = orig(reqs)
        p = eng.pools
        for r in reqs:
            if not r.sparse:
                continue
            assert len(r.slot_pages) == kv.top_k_blocks
            for layer in range(qwen3.config.num_hidden_layers):
                for h in range(qwen3.config.num_key_value_heads):
                    held = [int(p.page_map[layer, pg, h]) for pg in r.slot_pages]
                    valid = [b for b in held if b >= 0]
                    assert len(valid) == len(set(valid)), "a block sits in two slots"
                    for pg, b in zip(r.slot_pages, held, strict=True):
                        if b >= 0:
                            hb = r.host_blocks[b]
                            assert torch.equal(p.k_pages[layer][pg, h], p.host_k[layer][hb, h])
                            assert torch.equal(p.v_pages[layer][pg, h], p.host_v[layer][hb, h])
                # The local block: the block of the token this step stored (x_t, at position
                # kv_len until the sampled token is appended), resident in the local page.
                blk, off = divmod(r.kv_len, kv.block_size)
                assert int(p.page_map[layer, r.local_page, 0]) == blk
                hb = r.host_blocks[blk]
                assert torch.equal(
                    p.k_pages[layer][r.local_page, :, : off + 1], p.host_k[layer][hb, :, : off + 1]
                )
            checked["n"] += 1
        return logits

    eng.decode_step = checked_step
    llm.generate(repeated_prompts(qwen3.config.vocab_size, [90, 70], seed=4, period=37), 20, ignore_eos=True)
    assert checked["n"] > 20


def test_llama_family_and_drafters_run():
    model = llama_like()
    ps = repeated_prompts(model.config.vocab_size, [120], period=37)
    kv = KvConfig(block_size=16, top_k_blocks=3, fetch_cap=None, sparse_threshold=60)
    dense = oasiskv.LLM(model, kv=kv, backend="dense", drafter=None).generate(ps, 12, ignore_eos=True)[0]
    oracle = OracleDrafter([dense.tokens])
    res = oasiskv.LLM(model, kv=kv, backend="oasis", drafter=oracle).generate(ps, 12, ignore_eos=True)[0]
    assert res.metrics.sparse_steps > 0 and len(res.tokens) == 12
    for drafter in (NgramDrafter(), PreviousQueryDrafter()):
        r = oasiskv.LLM(model, kv=kv, backend="oasis", drafter=drafter).generate(ps, 6, ignore_eos=True)[0]
        assert len(r.tokens) == 6


def test_ngram_drafter_proposes_continuation():
    d = NgramDrafter(max_n=3)
    assert d.propose(0, [5, 6, 7, 8, 5, 6, 7]) == 8
    assert d.propose(0, [1, 2, 3]) == 3  # no match: repeat the current token


def test_sampling_is_seeded(qwen3):
    ps = repeated_prompts(qwen3.config.vocab_size, [50], period=37)
    llm = oasiskv.LLM(qwen3, backend="dense", drafter=None)
    a = llm.generate(ps, 8, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)[0].tokens
    b = llm.generate(ps, 8, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)[0].tokens
    assert a == b


# ---------------------------------------------------------------- bad input
def test_prompt_longer_than_context_is_a_typed_error(qwen3):
    llm = oasiskv.LLM(qwen3, backend="dense", drafter=None)
    with pytest.raises(errors.ContextLengthError, match="exceeds the model's context"):
        llm.generate([[1] * 2040], max_new_tokens=16)
    assert len(llm.generate([[1, 2, 3]], max_new_tokens=2, ignore_eos=True)[0].tokens) == 2
    # The last new token is never fed: a prompt filling the context still gets one token, and
    # prompt + max_new_tokens - 1 positions fit exactly.
    ctx = qwen3.config.max_position_embeddings
    assert len(llm.generate([[1] * ctx], max_new_tokens=1, ignore_eos=True)[0].tokens) == 1
    with pytest.raises(errors.ContextLengthError, match="exceeds the model's context"):
        llm.generate([[1] * ctx], max_new_tokens=2)


def test_budget_larger_than_pools_is_a_typed_error(qwen3):
    with pytest.raises(errors.ConfigError, match="num_gpu_pages"):
        KvConfig(top_k_blocks=64, num_gpu_pages=32)
    llm = oasiskv.LLM(
        qwen3,
        kv=KvConfig(block_size=16, top_k_blocks=4, num_gpu_pages=8, num_host_blocks=8, sparse_threshold=500),
        backend="oasis",
    )
    with pytest.raises(errors.OutOfBlocksError, match="num_gpu_pages"):
        llm.generate(repeated_prompts(qwen3.config.vocab_size, [400], period=37), 4)
    # The pools are intact after the failure: a small request still runs.
    assert len(llm.generate([[3, 4, 5]], 3, ignore_eos=True)[0].tokens) == 3


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"fetch_cap": 1.5}, "fraction"),
        ({"fetch_cap": 0}, "cap"),
        ({"block_size": 0}, "block_size"),
        ({"top_k_blocks": -1}, "top_k_blocks"),
        ({"kv_dtype": torch.int8}, "kv_dtype"),
        ({"select_queries": "current"}, "select_queries"),
        ({"sink_blocks": -1}, "sink_blocks"),
        ({"sink_blocks": True}, "sink_blocks"),
        ({"top_k_blocks": 4, "sink_blocks": 4}, "sink_blocks=4 is above 3"),
        ({"pin_blocks": -1}, "pin_blocks"),
        ({"pin_blocks": 1.0}, "pin_blocks"),
        ({"top_k_blocks": 4, "sink_blocks": 2, "pin_blocks": 2}, "pin_blocks=2 is above 1"),
    ],
)
def test_bad_kv_config(kw, match):
    with pytest.raises(errors.ConfigError, match=match):
        KvConfig(**kw)


@pytest.mark.parametrize("n", [0, 9, 1.5, "2"])
def test_bad_background_streams(qwen3, n):
    with pytest.raises(errors.ConfigError, match="background_streams must be an int in 1..8"):
        Engine(qwen3, KvConfig(), "oasis", None, background_streams=n)


def test_bad_generate_arguments(qwen3):
    llm = oasiskv.LLM(qwen3, backend="oasis")
    with pytest.raises(errors.ConfigError, match="empty"):
        llm.generate([[]], 4)
    with pytest.raises(errors.ConfigError, match="vocabulary"):
        llm.generate([[10**6]], 4)
    with pytest.raises(errors.ConfigError, match="tokenizer"):
        llm.generate("text without a tokenizer", 4)
    with pytest.raises(errors.ConfigError, match="drafter"):
        oasiskv.LLM(qwen3, drafter="bogus")
    with pytest.raises(ValueError):
        oasiskv.LLM(qwen3, backend="sparse-ish")


def test_prefill_cache_shares_a_prompt_between_engines(qwen3):
    ps = repeated_prompts(qwen3.config.vocab_size, [150], period=37)
    kv = KvConfig(block_size=16, top_k_blocks=4, fetch_cap=1, sparse_threshold=64)
    cache = oasiskv.PrefillCache()
    fresh = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram").generate(ps, 10, ignore_eos=True)[0]
    a = oasiskv.LLM(qwen3, kv=kv, backend="dense", drafter="ngram", prefill_cache=cache).generate(
        ps, 10, ignore_eos=True
    )
    b = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram", prefill_cache=cache).generate(
        ps, 10, ignore_eos=True
    )
    assert cache.hits == 1
    assert b[0].tokens == fresh.tokens and a[0].tokens[0] == fresh.tokens[0]
    c = qwen3.config
    assert cache.nbytes == 2 * c.num_hidden_layers * 150 * c.num_key_value_heads * c.head_dim * 4  # float32
    host = oasiskv.PrefillCache(on_host=True)
    t = torch.ones(3)
    assert host.hold(t) is t  # already on the host: kept as it is (pinning needs a GPU; see test_gpu_engine)


def test_eagle3_drafter_runs_through_the_engine():
    """A random EAGLE-3 head drafts from the target's captured states (layers 2, L/2, L-3)."""
    from oasiskv.models.eagle3 import Eagle3Head

    cfg = LLAMA_8L
    model = CausalLM.random(cfg, seed=4)
    head = Eagle3Head.random(cfg, draft_vocab_size=64, seed=5)
    drafter = oasiskv.Eagle3Drafter(head, model)
    assert drafter.capture_layers(8) == (2, 4, 5)
    kv = KvConfig(block_size=16, top_k_blocks=4, fetch_cap=1, sparse_threshold=64)
    ps = repeated_prompts(cfg.vocab_size, [150, 90], period=37)
    res = oasiskv.LLM(model, kv=kv, backend="oasis", drafter=drafter).generate(ps, 8, ignore_eos=True)
    assert all(len(r.tokens) == 8 for r in res)
    assert res[0].metrics.sparse_steps == res[0].metrics.steps
    # Budget >= context: the draft source does not change the tokens.
    kv_full = KvConfig(block_size=16, top_k_blocks=32, fetch_cap=4, sparse_threshold=64)
    d = oasiskv.LLM(model, kv=kv_full, backend="dense", drafter=oasiskv.Eagle3Drafter(head, model)).generate(
        ps, 8, ignore_eos=True
    )
    o = oasiskv.LLM(model, kv=kv_full, backend="oasis", drafter=oasiskv.Eagle3Drafter(head, model)).generate(
        ps, 8, ignore_eos=True
    )
    assert [r.tokens for r in d] == [r.tokens for r in o]


@pytest.mark.slow
def test_full_budget_oasis_equals_dense_tokens_smollm2():
    """The real pretrained model: greedy tokens with a full budget equal dense, while sparse."""
    from oasiskv.models.loader import load_model

    model, tok = load_model("smollm2")
    text = " ".join(
        f"Entry {i}: the {('red', 'blue', 'green')[i % 3]} box holds {i * 7} coins." for i in range(40)
    )
    prompt = tok.apply_chat_template([{"role": "user", "content": text + " Which box holds 91 coins?"}])
    kv = KvConfig(block_size=16, top_k_blocks=64, fetch_cap=0.05, sparse_threshold=128)
    dense = oasiskv.LLM(model, tokenizer=tok, kv=kv, backend="dense", drafter="ngram").generate(
        prompt, 24, ignore_eos=True
    )[0]
    oasis = oasiskv.LLM(model, tokenizer=tok, kv=kv, backend="oasis", drafter="ngram").generate(
        prompt, 24, ignore_eos=True
    )[0]
    assert oasis.metrics.prompt_tokens > 400 and oasis.metrics.sparse_steps == oasis.metrics.steps
    assert oasis.tokens == dense.tokens


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 16, 33, 64, 149])
def test_chunked_prefill_equals_one_shot(qwen3, chunk, kv_dtype):
    """Engine.prefill_chunk in pieces of ``chunk`` tokens (block-aligned or not, down to one token,
    the last piece shorter) stores the same K/V pages and last queries and gives the same
    last-position logits as one Engine.prefill of the 150-token prompt. With bfloat16 pages the
    chunks attend to their prefix as stored (rounded), the one-shot forward to it unrounded."""
    from oasiskv.engine import Request

    kv = KvConfig(block_size=16, top_k_blocks=4, sparse_threshold=500, kv_dtype=kv_dtype)
    ids = repeated_prompts(qwen3.config.vocab_size, [150], seed=3, period=37)[0]
    one, chunked = Engine(qwen3, kv, "dense", None), Engine(qwen3, kv, "dense", None)
    r1, r2 = Request(id=0, prompt=ids, max_new_tokens=4), Request(id=0, prompt=ids, max_new_tokens=4)
    want = one.prefill(r1)
    outs = [chunked.prefill_chunk(r2, a, min(a + chunk, len(ids))) for a in range(0, len(ids), chunk)]
    assert all(o is None for o in outs[:-1])
    # NOTE: with bfloat16 pages the chunks see a rounded prefix, so their K/V may round to the
    # neighbouring bf16 value (keys are O(1): an absolute 1e-2 is a few ulps).
    tol = dict(atol=1e-5, rtol=1e-5) if kv_dtype is None else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(outs[-1], want, **tol)
    p1, p2 = one.pools, chunked.pools
    for layer in range(qwen3.config.num_hidden_layers):
        torch.testing.assert_close(p2.k_pages[layer][r2.pages], p1.k_pages[layer][r1.pages], **tol)
        torch.testing.assert_close(p2.v_pages[layer][r2.pages], p1.v_pages[layer][r1.pages], **tol)
        torch.testing.assert_close(chunked._last_q[layer], one._last_q[layer], **tol)
        assert one._last_q[layer]._base is None  # a copy, not a view of the layer's queries


def test_a_large_pinned_host_pool_growth_is_announced(monkeypatch, caplog):
    """Pinning is slow (about 0.6 s per GiB): a large growth of the pinned host pool logs what it
    pins and keeps every block's contents (simulated on the CPU: pinning itself needs a GPU)."""
    import logging

    from oasiskv.engine import pools as eng_mod

    real_grown = eng_mod._grown
    pinned = []

    def fake_grown(old, rows, dim=0, fill=0, pin=False, numa_node=None):
        pinned.append(pin)
        return real_grown(old, rows, dim=dim, fill=fill, pin=False)

    monkeypatch.setattr(eng_mod, "_grown", fake_grown)
    monkeypatch.setattr(eng_mod, "PIN_NOTICE_BYTES", 1 << 20)
    geo = oasiskv.ops.KvGeometry(8, 2, 64, 16)
    pools = eng_mod.KvPools(geo, 2, torch.float32, 4, 4, torch.device("cpu"))
    pools.host_pin = True  # as on a GPU machine
    pools.host_k[0][1] = 7.0
    pinned.clear()
    with caplog.at_level(logging.INFO, logger="oasiskv.engine"):
        pools.grow(4, 8)  # 8 blocks x 2 layers x 16 KiB: under the notice, silent
        assert not caplog.records
        pools.grow(4, 64)  # 64 x 2 x 16 KiB = 2 MiB
    (record,) = caplog.records
    assert "pinning" in record.getMessage() and "64 blocks x 2 layers" in record.getMessage()
    assert all(pinned[:4]) and pools.num_host_blocks == 64
    assert (pools.host_k[0][1] == 7.0).all() and (pools.host_k[0][2:] == 0).all()


def test_cuda_graphs_are_the_gpu_default_and_do_not_apply_on_the_cpu(qwen3):
    """CUDA graphs are on by default on a GPU (``enforce_eager=True`` turns them off); on the CPU
    the eager step runs whatever is asked (same tokens, nothing captured). The old ``cuda_graph=``
    still works for one release with a DeprecationWarning; non-bools are refused."""
    ps = repeated_prompts(qwen3.config.vocab_size, [90, 40], period=37)
    kv = KvConfig(block_size=16, top_k_blocks=4, fetch_cap=2, sparse_threshold=32)
    plain = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
    assert not plain.llm_engine.cuda_graphs and not plain.llm_engine.enforce_eager
    base = plain.generate(ps, 8, ignore_eos=True)
    eager = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram", enforce_eager=True)
    assert eager.llm_engine.enforce_eager and not eager.llm_engine.cuda_graphs
    assert [g.tokens for g in eager.generate(ps, 8, ignore_eos=True)] == [p.tokens for p in base]
    with pytest.warns(DeprecationWarning, match="enforce_eager"):
        llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram", cuda_graph=True)
    graphed = llm.generate(ps, 8, ignore_eos=True)
    assert [g.tokens for g in graphed] == [p.tokens for p in base]
    stats = llm.engine.graph_stats
    assert (
        not llm.llm_engine.cuda_graphs and stats["captures"] == stats["replays"] == 0 and stats["eager"] >= 7
    )
    with pytest.warns(DeprecationWarning):
        old_eager = oasiskv.LLM(qwen3, kv=kv, backend="oasis", cuda_graph=False)
    assert old_eager.llm_engine.enforce_eager
    with pytest.raises(errors.ConfigError, match="cuda_graph"):
        oasiskv.LLM(qwen3, kv=kv, backend="oasis", cuda_graph="yes")
    with pytest.raises(errors.ConfigError, match="enforce_eager"):
        oasiskv.LLM(qwen3, kv=kv, backend="oasis", enforce_eager=1)
    with pytest.warns(DeprecationWarning), pytest.raises(errors.ConfigError, match="contradicts"):
        oasiskv.LLM(qwen3, kv=kv, backend="oasis", cuda_graph=True, enforce_eager=True)


def test_recall_is_measured_on_one_step_in_recall_every(qwen3):
    """``KvConfig(recall_every=N)``: the same tokens, recall counted on about 1/N of the steps
    (the engine's step count), and on every step at N=1 and under a recorder."""
    ps = repeated_prompts(qwen3.config.vocab_size, [300, 180], seed=5, period=37)
    out, counted = {}, {}
    for every in (1, 4):
        # The Quest selection: sticky candidates keep each step's prediction, whatever recall_every.
        kv = KvConfig.fast(
            block_size=8, top_k_blocks=6, fetch_cap=2, sparse_threshold=100, recall_every=every
        )
        llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
        eng = llm.engine
        seen = []
        orig = eng._recall_phase

        def phase(orig=orig, seen=seen):
            now = orig()
            seen.append(now)
            return now

        eng._recall_phase = phase  # observe the per-step decision (test-only instrumentation)
        out[every] = llm.generate(ps, 20, ignore_eos=True)
        counted[every] = seen
        for r in out[every]:
            assert r.metrics.lookahead_recall is not None and 0.0 <= r.metrics.lookahead_recall <= 1.0
    assert [r.tokens for r in out[1]] == [r.tokens for r in out[4]]
    assert all(now == (True, True) for now in counted[1])
    flags = counted[4]
    assert sum(m for m, _ in flags) == sum(1 for i in range(len(flags)) if i % 4 == 0)
    # the step before each measured one keeps its predictions, and no other step does
    assert [k for _, k in flags] == [i % 4 == 3 for i in range(len(flags))]
    with pytest.raises(oasiskv.errors.ConfigError, match="recall_every"):
        KvConfig(recall_every=0)


@pytest.mark.parametrize("key_codes", [False, True])
def test_summary_block_bytes_counts_every_gpu_metadata_tensor(key_codes):
    """``summary_block_bytes`` (what Fig. 11's fit and the request metrics count as GPU-resident
    per block) equals the bytes the pools really allocate per host block beside the pages:
    summaries, and with the codes block score the key codes, the 8-bit bound and its scales."""
    from oasiskv.engine import pools as eng_mod

    geo = oasiskv.ops.KvGeometry(8, 2, 64, 16)
    layers, blocks = 3, 5
    pools = eng_mod.KvPools(geo, layers, torch.bfloat16, 2, blocks, torch.device("cpu"), key_codes=key_codes)
    tensors = list(pools.summaries)
    if key_codes:
        tensors += pools.codes + pools.bounds8 + pools.bound_scales
    real = sum(t.nbytes for t in tensors)
    assert real == blocks * layers * pools.summary_block_bytes
    assert pools.summary_block_bytes == eng_mod.summary_block_bytes(geo, torch.bfloat16, key_codes)
    if key_codes:  # the codes score's metadata is more than the summaries alone
        assert pools.summary_block_bytes > eng_mod.summary_block_bytes(geo, torch.bfloat16, False)
