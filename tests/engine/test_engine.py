"""End-to-end generation: the oasis backend against dense, mixed batches, invariants, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oasiskv
from oasiskv import KvConfig, errors, ops
from oasiskv.drafters import NgramDrafter, OracleDrafter, PreviousQueryDrafter
from oasiskv.engine import Engine
from oasiskv.models.transformer import CausalLM
from support.configs import LLAMA_8L, QWEN3_3L
from support.engines import DrafterWithConfidence

# Private names read here: the engine's selection steps, each wrapped or read by the test that
# checks it: ``_select_and_fetch`` (its predictions and pins), ``_pins_of``, ``_pred_of``,
# ``_initial_selection`` (sticky candidates), ``_recall_phase`` (the per-step recall decision),
# ``_last_q`` (the lookahead queries after a chunked prefill) and ``pools._grown`` (how a host pool
# grows). No public hook exposes these per-layer steps.

torch.set_num_threads(2)

#: A budget of 3 blocks of 8 (fetch cap 1) from 40 tokens on: the selection tests' small budget.
SMALL_KV = dict(block_size=8, top_k_blocks=3, fetch_cap=1, sparse_threshold=40)


def qwen3_like(**kw) -> CausalLM:
    return CausalLM.random(QWEN3_3L.replace(**kw), seed=1)


def llama_like() -> CausalLM:
    return CausalLM.random(LLAMA_8L.replace(num_hidden_layers=2), seed=2)


def prompts(vocab: int, lens, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Repetitive text so the n-gram drafter finds matches.
    out = []
    for n in lens:
        base = torch.randint(0, vocab, (37,), generator=g).tolist()
        out.append((base * (n // 37 + 1))[:n])
    return out


@pytest.fixture(scope="module")
def qwen3():
    return qwen3_like()


@pytest.mark.parametrize("drafter,sinks", [("ngram", 0), ("previous-query", 0), ("ngram", 3)])
def test_full_budget_oasis_equals_dense_tokens_qwen3(qwen3, drafter, sinks):
    """Budget >= context: greedy tokens identical to dense, while the requests really run sparse
    (with sink blocks too: they take slots the budget has to spare)."""
    ps = prompts(qwen3.config.vocab_size, [211, 97, 150])
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
    ps = prompts(qwen3.config.vocab_size, [300, 40, 123], seed=3)
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
    llm.generate(prompts(qwen3.config.vocab_size, [90, 70], seed=4), 20, ignore_eos=True)
    assert checked["n"] > 20


def test_llama_family_and_drafters_run():
    model = llama_like()
    ps = prompts(model.config.vocab_size, [120])
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
    ps = prompts(qwen3.config.vocab_size, [50])
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
        llm.generate(prompts(qwen3.config.vocab_size, [400]), 4)
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
    ps = prompts(qwen3.config.vocab_size, [150])
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
    ps = prompts(cfg.vocab_size, [150, 90])
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


def test_select_with_current_query_ranks_by_the_larger_relative_score(qwen3):
    """KvConfig(select_queries="lookahead+current"): per (request, KV head) the predicted set is the
    top-K of max(s_lookahead - max s_lookahead, s_current - max s_current) over the candidates,
    checked against float64 Quest scores; and it is not simply the lookahead's own top-K."""
    from support.reference import ref_score_blocks

    kv = KvConfig.fast(
        block_size=8, top_k_blocks=4, fetch_cap=None, sparse_threshold=50, select_queries="lookahead+current"
    )
    llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
    eng = llm.engine
    orig = eng._select_and_fetch
    seen = {"calls": 0, "differs": 0}

    def checked(layer, q, slot_pages, blk_csr, host_csr, step, cap, k_budget, also=None, slots=None, **kw):
        summaries = eng.pools.summaries[layer].clone()
        pred, ps = orig(
            layer, q, slot_pages, blk_csr, host_csr, step, cap, k_budget, also=also, slots=slots, **kw
        )
        if also is None:  # make_sparse: the last prompt query alone
            return pred, ps
        indptr, indices = blk_csr
        s_la = ref_score_blocks(q, summaries, indptr, indices)
        s_cur = ref_score_blocks(also[0], summaries, indptr, indices)
        for i in range(q.shape[0]):
            lo, hi = int(indptr[i]), int(indptr[i + 1])
            la, cur = s_la[lo:hi], s_cur[lo:hi]
            mixed = torch.maximum(la - la.max(0).values, cur - cur.max(0).values)
            k = min(k_budget, hi - lo)
            for h in range(mixed.shape[1]):
                want = set(mixed[:, h].topk(k).indices.tolist())
                got = {int(b) for b in pred[i, h] if b >= 0}
                assert got == want, (layer, i, h)
                seen["differs"] += want != set(la[:, h].topk(k).indices.tolist())
        seen["calls"] += 1
        return pred, ps

    eng._select_and_fetch = checked
    llm.generate(prompts(qwen3.config.vocab_size, [90, 70], seed=4), 12, ignore_eos=True)
    assert seen["calls"] > 20 and seen["differs"] > 0


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    n_sink=st.integers(0, 5),
    k=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_keep_sinks_then_topk_takes_the_sinks_then_the_best_of_the_rest(lens, n_sink, k, seed):
    """Per (request, head), top-K after keep_sinks = the row's first min(n_sink, k, len) blocks plus
    the best of the others by score (tie-free random scores, rows of any length, empty ones too);
    n_sink = 0 returns the scores themselves."""
    from oasiskv import ops
    from oasiskv.engine import csr_tables, keep_sinks

    hk = 2
    indptr, _ = csr_tables([list(range(n)) for n in lens])
    scores = torch.rand(sum(lens), hk, generator=torch.Generator().manual_seed(seed))
    kept = keep_sinks(scores, indptr, n_sink)
    if n_sink == 0:
        assert kept is scores
    pred = ops.topk_blocks(hk, kept, indptr, k)
    for i, n in enumerate(lens):
        row = scores[int(indptr[i]) : int(indptr[i + 1])]
        sinks = list(range(min(n_sink, k, n)))
        for h in range(hk):
            rest = [j for j in row[:, h].argsort(descending=True).tolist() if j >= n_sink]
            want = sinks + rest[: min(k, n) - len(sinks)]
            assert pred[i, h].tolist() == want + [-1] * (k - len(want)), (lens, i, h)


class _SinkCheck:
    """Engine recorder and _select_and_fetch wrapper: every exact top-K (recall) and every
    prediction of a request with at least N candidates holds its blocks 0..N-1, and no slot is
    lost (min(K, candidates) blocks selected)."""

    def __init__(self, eng, n_sink: int) -> None:
        self.n, self.calls, self.recalls = n_sink, 0, 0
        orig = eng._select_and_fetch

        def checked(
            layer, q, slot_pages, blk_csr, host_csr, step, cap, k_budget, also=None, slots=None, **kw
        ):
            pred, ps = orig(
                layer, q, slot_pages, blk_csr, host_csr, step, cap, k_budget, also=also, slots=slots, **kw
            )
            self.check(pred, blk_csr[0])
            self.calls += 1
            return pred, ps

        eng._select_and_fetch = checked
        self.rec_indptr = None
        orig_score = eng.block_scores

        def score(layer, q, csr):
            self.rec_indptr = csr[0]
            return orig_score(layer, q, csr)

        eng.block_scores = score

    def check(self, pred, indptr) -> None:
        lens = (indptr[1:] - indptr[:-1]).tolist()
        for i, n in enumerate(lens):
            for h in range(pred.shape[1]):
                got = [int(b) for b in pred[i, h] if b >= 0]
                assert len(got) == min(n, pred.shape[2]) and len(set(got)) == len(got)
                assert set(range(min(self.n, n))) <= set(got), (i, h, got)

    def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None) -> None:
        self.check(actual, self.rec_indptr)  # the recall's own scoring ran last
        self.recalls += 1


@pytest.mark.parametrize("select", ["lookahead", "lookahead+current"])
def test_sink_blocks_are_always_selected(qwen3, select):
    """KvConfig(sink_blocks=N): blocks 0..N-1 are in every prediction (make_sparse's included)
    and in every exact top-K of the recall, with either select_queries."""
    kv = KvConfig(
        block_size=8, top_k_blocks=4, fetch_cap=1, sparse_threshold=50, select_queries=select, sink_blocks=2
    )
    llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
    check = _SinkCheck(llm.engine, 2)
    llm.engine.recorder = check
    outs = llm.generate(prompts(qwen3.config.vocab_size, [90, 70], seed=4), 12, ignore_eos=True)
    assert check.calls > 20 and check.recalls > 20
    assert all(o.metrics.sparse_steps > 0 for o in outs)


def test_sink_blocks_zero_is_the_default_selection(qwen3):
    """sink_blocks=0 selects exactly as before (same tokens, traffic and recall), and sinks change
    the selection at a small budget (the sinks are not among the top blocks by score alone)."""
    ps = prompts(qwen3.config.vocab_size, [150, 97], seed=5)
    base = SMALL_KV
    runs = [
        oasiskv.LLM(qwen3, kv=KvConfig(**base, **kw), backend="oasis", drafter="ngram").generate(
            ps, 16, ignore_eos=True
        )
        for kw in ({}, {"sink_blocks": 0}, {"sink_blocks": 2})
    ]
    for a, b in zip(runs[0], runs[1], strict=True):
        assert a.tokens == b.tokens
        assert a.metrics.fetched_bytes_total == b.metrics.fetched_bytes_total
        assert a.metrics.lookahead_recall == b.metrics.lookahead_recall
    assert any(
        a.metrics.lookahead_recall != c.metrics.lookahead_recall
        for a, c in zip(runs[0], runs[2], strict=True)
    )


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 16, 33, 64, 149])
def test_chunked_prefill_equals_one_shot(qwen3, chunk, kv_dtype):
    """Engine.prefill_chunk in pieces of ``chunk`` tokens (block-aligned or not, down to one token,
    the last piece shorter) stores the same K/V pages and last queries and gives the same
    last-position logits as one Engine.prefill of the 150-token prompt. With bfloat16 pages the
    chunks attend to their prefix as stored (rounded), the one-shot forward to it unrounded."""
    from oasiskv.engine import Engine, Request

    kv = KvConfig(block_size=16, top_k_blocks=4, sparse_threshold=500, kv_dtype=kv_dtype)
    ids = prompts(qwen3.config.vocab_size, [150], seed=3)[0]
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
    ps = prompts(qwen3.config.vocab_size, [90, 40])
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
    ps = prompts(qwen3.config.vocab_size, [300, 180], seed=5)
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


class _StagedCheck:
    """Wraps Engine.top_k_blocks: each two-stage selection (KvConfig.score_candidates) equals its
    definition composed from the one-stage ops -- the Quest bound's top-m (over the 8-bit bound
    with KvConfig.candidate_bound="fp8"; sinks first) as
    candidates, ranked by the full codes scores of those blocks (ties to the earlier candidate),
    the sinks ahead of them, and with KvConfig.successor_blocks = N the next block of each of the
    N best candidates by the codes score (a candidate or not) ahead of them too. With
    KvConfig.sticky_candidates the blocks ``keep`` are candidates whatever their bound, and
    ``every_block`` makes every block a candidate."""

    def __init__(self, eng) -> None:
        self.eng, self.calls, self.staged, self.outside, self.every, self.kept = eng, 0, 0, 0, 0, 0
        orig = eng.top_k_blocks

        def checked(layer, q, csr, k, slots=None, *, keep=None, every_block=False):
            got = orig(layer, q, csr, k, slots, keep=keep, every_block=every_block)
            self.check(layer, q, csr, k, got, keep, every_block)
            return got

        eng.top_k_blocks = checked

    def check(self, layer, q, csr, k, got, keep=None, every_block=False) -> None:
        from oasiskv.engine import keep_pins, keep_sinks

        eng, g = self.eng, self.eng.geo
        p, kv = eng.pools, eng.kv
        indptr = csr[0]
        m = None if every_block else kv.candidate_blocks(k)
        self.every += every_block
        self.kept += keep is not None
        if kv.candidate_bound == "fp8":  # the 8-bit bound of the same summaries (test_bound8.py)
            quest = ops.score_blocks_bound8(g, q, p.bounds8[layer], p.bound_scales[layer], *csr)
        else:
            quest = ops.score_blocks(g, q, p.summaries[layer], *csr)
        bound = keep_sinks(quest, indptr, kv.sink_blocks)
        bound = keep_pins(bound, indptr, keep)  # sticky candidates: the previous prediction
        cand = ops.topk_blocks(g.num_kv_heads, bound, indptr, m or int((indptr[1:] - indptr[:-1]).max()))
        full = ops.score_blocks_codes(g, q, p.summaries[layer], p.codes[layer], *csr)
        for s in range(indptr.numel() - 1):
            base = int(indptr[s])
            n_blocks = int(indptr[s + 1]) - base
            for h in range(g.num_kv_heads):
                cs = [int(c) for c in cand[s, h] if c >= 0]

                def score(c, base=base, h=h):
                    return float(full[base + c, h])

                forced = set(range(min(kv.sink_blocks, n_blocks)))
                ext = list(cs)  # the candidates, then the successors that are not candidates
                best = sorted(range(len(cs)), key=lambda i, cs=cs: (-score(cs[i]), i))
                for i in best[: kv.successor_blocks]:
                    if cs[i] + 1 < n_blocks:
                        forced.add(cs[i] + 1)
                        if cs[i] + 1 not in ext:
                            ext.append(cs[i] + 1)

                def key(i, ext=ext, forced=forced):
                    c = ext[i]
                    return (c not in forced, 0.0 if c in forced else -score(c), i)

                order = sorted(range(len(ext)), key=key)[:k]
                want = [ext[i] for i in order]
                assert got[s, h].tolist() == want + [-1] * (k - len(want)), (layer, s, h)
                self.staged += len(cs) < n_blocks
                self.outside += len(ext) > len(cs)
        self.calls += 1


@pytest.mark.parametrize(
    "sinks, succ, bound", [(0, 0, "fp8"), (1, 0, "fp8"), (1, 1, "fp8"), (1, 1, "summaries")]
)
def test_two_stage_codes_score_selects_its_definition(qwen3, sinks, succ, bound):
    """KvConfig(score_candidates=F): every prediction and every recall top-K equals the Quest
    bound's candidates (over the 8-bit bound or the summaries: KvConfig.candidate_bound) ranked by
    their codes scores (checked against the one-stage ops at each call), with fewer candidates
    than blocks on most calls; the requests decode sparse."""
    kv = KvConfig(
        **SMALL_KV,
        block_score="codes",
        score_candidates=2,
        sink_blocks=sinks,
        successor_blocks=succ,
        candidate_bound=bound,
    )
    assert kv.candidate_blocks(3) == 6
    llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
    check = _StagedCheck(llm.engine)
    outs = llm.generate(prompts(qwen3.config.vocab_size, [150, 97], seed=6), 10, ignore_eos=True)
    assert check.calls > 20 and check.staged > 20
    assert all(o.metrics.sparse_steps > 0 for o in outs)
    if succ:  # some successors of the codes score's best were not among the Quest bound's best
        assert check.outside > 0


@pytest.mark.parametrize("succ", [0, 1])
def test_two_stage_codes_score_with_every_block_a_candidate_is_the_codes_score(qwen3, succ):
    """When the candidates cover every block (m = 512 here), the two stages select exactly what the
    one-stage codes score does: same tokens, traffic and recall. And a budget that covers the
    context gives the dense tokens."""
    ps = prompts(qwen3.config.vocab_size, [150, 97], seed=7)
    base = dict(SMALL_KV, block_score="codes", successor_blocks=succ, sticky_candidates=False)
    runs = [
        oasiskv.LLM(qwen3, kv=KvConfig(**base, **kw), backend="oasis", drafter="ngram").generate(
            ps, 12, ignore_eos=True
        )
        for kw in ({"score_candidates": None}, {"score_candidates": 200})
    ]
    for a, b in zip(*runs, strict=True):
        assert a.tokens == b.tokens and a.metrics.sparse_steps > 0
        assert a.metrics.fetched_bytes_total == b.metrics.fetched_bytes_total
        assert a.metrics.lookahead_recall == b.metrics.lookahead_recall
    full = dict(block_size=16, top_k_blocks=32, fetch_cap=4, sparse_threshold=64, block_score="codes")
    ids = prompts(qwen3.config.vocab_size, [200], seed=8)
    dense = oasiskv.LLM(qwen3, kv=KvConfig(**full), backend="dense").generate(ids, 8, ignore_eos=True)
    staged = oasiskv.LLM(qwen3, kv=KvConfig(**full, score_candidates=1.5), backend="oasis", drafter="ngram")
    got = staged.generate(ids, 8, ignore_eos=True)
    assert got[0].tokens == dense[0].tokens and got[0].metrics.sparse_steps > 0


def test_sticky_candidates_keep_each_requests_previous_prediction(qwen3):
    """KvConfig(sticky_candidates=True): a request's first selection of each layer ranks every
    block by the codes, and every later prediction has that request's previous prediction of the
    layer among its candidates (each selection checked against its definition, each ``keep``
    against the prediction made before); recall's exact top-K keeps nothing; and it changes the
    selection."""
    kv = KvConfig(
        **SMALL_KV, block_score="codes", score_candidates=1.5, sticky_candidates=True, successor_blocks=1
    )
    assert kv.candidate_blocks(3) == 5  # the 3 kept and 2 more from the Quest bound
    llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
    eng = llm.engine
    check = _StagedCheck(eng)
    last: dict = {}  # (layer, slot) -> the latest prediction
    seen = {"kept": 0}
    inner = eng.top_k_blocks

    def recorded(layer, q, csr, k, slots=None, *, keep=None, every_block=False):
        out = inner(layer, q, csr, k, slots, keep=keep, every_block=every_block)
        if keep is not None:
            for i, slot in enumerate(slots.tolist()):
                assert keep[i].tolist() == last[layer, slot], (layer, slot)
                last[layer, slot] = out[i].tolist()
                seen["kept"] += 1
        return out

    first = eng._initial_selection

    def initial(layer, slot, pred):
        last[layer, slot] = pred.tolist()
        first(layer, slot, pred)

    eng.top_k_blocks, eng._initial_selection = recorded, initial
    ps = prompts(qwen3.config.vocab_size, [150, 97], seed=6)
    outs = llm.generate(ps, 10, ignore_eos=True)
    layers = qwen3.config.num_hidden_layers
    assert check.every == 2 * layers  # each request's first selection, per layer
    assert check.kept > 20 and seen["kept"] > 20 and check.staged > 20
    assert check.calls > check.kept + check.every  # the recall's top-K: no kept blocks
    assert all(o.metrics.sparse_steps > 0 for o in outs)
    plain = KvConfig(**{**kv.__dict__, "sticky_candidates": False})
    other = oasiskv.LLM(qwen3, kv=plain, backend="oasis", drafter="ngram").generate(ps, 10, ignore_eos=True)
    assert any(
        a.metrics.lookahead_recall != b.metrics.lookahead_recall or a.tokens != b.tokens
        for a, b in zip(outs, other, strict=True)
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"block_score": "quest", "score_candidates": 2}, "needs block_score='codes'"),
        ({"block_score": "codes", "score_candidates": 0.5}, "number >= 1"),
        ({"block_score": "codes", "score_candidates": True}, "number >= 1"),
        ({"block_score": "codes", "score_candidates": float("inf")}, "number >= 1"),
        ({"block_score": "codes", "score_candidates": "3"}, "number >= 1"),
        (
            {"block_score": "codes", "score_candidates": 3, "select_queries": "lookahead+current"},
            "select_queries='lookahead' only",
        ),
        (
            {"block_score": "codes", "score_candidates": None, "sticky_candidates": True},
            "needs score_candidates",
        ),
        ({"block_score": "codes", "score_candidates": 2, "sticky_candidates": 1}, "True or False"),
    ],
)
def test_bad_score_candidates(kw, match):
    with pytest.raises(errors.ConfigError, match=match):
        KvConfig(**kw)


def test_candidate_blocks_are_bounded_by_the_top_k_kernel():
    kv = KvConfig(block_score="codes", score_candidates=3, top_k_blocks=256)
    assert kv.candidate_blocks(128) == 384 and kv.candidate_blocks(256) == 512
    assert kv.candidate_blocks(512) == 512 and KvConfig.fast().candidate_blocks(128) is None
    assert KvConfig().candidate_blocks(128) == 160  # the default's two stages: 1.25 x K


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    n_pin=st.integers(0, 4),
    k=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_keep_pins_then_topk_takes_the_pins_then_the_best_of_the_rest(lens, n_pin, k, seed):
    """Per (request, head), top-K after keep_pins holds the row's valid pinned blocks (-1 and
    positions past the row ignored, repeats counted once) and fills the rest by score; no pins
    return the scores themselves."""
    from oasiskv import ops
    from oasiskv.engine import csr_tables, keep_pins

    hk = 2
    gen = torch.Generator().manual_seed(seed)
    indptr, _ = csr_tables([list(range(n)) for n in lens])
    scores = torch.rand(sum(lens), hk, generator=gen)
    pins = torch.randint(-1, 14, (len(lens), hk, n_pin), generator=gen, dtype=torch.int32)
    kept = keep_pins(scores, indptr, pins)
    if n_pin == 0:
        assert kept is scores
    pred = ops.topk_blocks(hk, kept, indptr, max(k, n_pin))
    kk = max(k, n_pin)
    for i, n in enumerate(lens):
        row = scores[int(indptr[i]) : int(indptr[i + 1])]
        for h in range(hk):
            valid = sorted({int(p) for p in pins[i, h] if 0 <= p < n})
            got = [int(b) for b in pred[i, h] if b >= 0]
            assert set(valid) <= set(got), (lens, i, h)
            rest = [j for j in row[:, h].argsort(descending=True).tolist() if j not in valid]
            assert sorted(got) == sorted(valid + rest[: min(kk, n) - len(valid)])


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"sink_blocks": 1},
        {"block_score": "codes", "score_candidates": 2},
        {"select_queries": "lookahead+current"},
    ],
)
def test_pinned_blocks_stay_in_every_prediction(qwen3, kw):
    """KvConfig(pin_blocks=N): the best N blocks (after the sinks) of a request's initial
    selection, per layer and KV head, are in every later prediction and exact top-K of that
    request, whichever score, two stages and query combination; and they change the selection
    at a small budget."""
    kv = KvConfig(block_size=8, top_k_blocks=4, fetch_cap=1, sparse_threshold=50, pin_blocks=2, **kw)
    llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
    eng = llm.engine
    orig = eng._select_and_fetch
    seen = {"checked": 0, "pinned": 0}

    def checked(layer, q, slot_pages, blk_csr, host_csr, step, cap, k_budget, also=None, slots=None, **kw):
        pred, ps = orig(
            layer, q, slot_pages, blk_csr, host_csr, step, cap, k_budget, also=also, slots=slots, **kw
        )
        if slots is not None:  # a decode step (make_sparse chooses the pins)
            pins = eng._pins_of(layer)[slots]
            for i in range(pred.shape[0]):
                for h in range(pred.shape[1]):
                    want = {int(b) for b in pins[i, h] if b >= 0}
                    assert want <= {int(b) for b in pred[i, h]}, (layer, i, h)
                    seen["pinned"] += len(want)
            seen["checked"] += 1
        return pred, ps

    eng._select_and_fetch = checked
    ps = prompts(qwen3.config.vocab_size, [90, 70], seed=4)
    outs = llm.generate(ps, 12, ignore_eos=True)
    assert seen["checked"] > 20 and seen["pinned"] > 0
    assert all(o.metrics.sparse_steps > 0 for o in outs)
    no_pins = KvConfig(**{**kv.__dict__, "pin_blocks": 0})
    unpinned = oasiskv.LLM(qwen3, kv=no_pins, backend="oasis", drafter="ngram")
    plain = unpinned.generate(ps, 12, ignore_eos=True)
    assert any(
        a.metrics.lookahead_recall != b.metrics.lookahead_recall or a.tokens != b.tokens
        for a, b in zip(outs, plain, strict=True)
    )


@pytest.mark.parametrize(
    "kw",
    [{}, {"sink_blocks": 1, "pin_blocks": 1}, {"block_score": "codes", "score_candidates": 2}],
)
def test_successor_blocks_follow_each_heads_best_blocks(qwen3, kw):
    """KvConfig(successor_blocks=N): every prediction and recall top-K holds the next block of
    each head's N best blocks by the codes score (in two stages: the best of the Quest bound's
    candidates), unless it is past the request's last block; and the successors change the
    selection at a small budget."""
    from oasiskv import ops

    kv = KvConfig.fast(
        block_size=8, top_k_blocks=5, fetch_cap=1, sparse_threshold=50, successor_blocks=2, **kw
    )
    llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
    eng = llm.engine
    orig = eng.top_k_blocks
    seen = {"calls": 0, "successors": 0}

    def checked(layer, q, csr, k, slots=None):
        pred = orig(layer, q, csr, k, slots)
        indptr = csr[0]
        first = eng.block_scores(layer, q, csr)
        if kv.score_candidates:  # the codes score's best among the Quest bound's best m (8-bit)
            p = eng.pools
            bound = ops.score_blocks_bound8(eng.geo, q, p.bounds8[layer], p.bound_scales[layer], *csr)
            cand = ops.topk_blocks(eng.geo.num_kv_heads, bound, indptr, kv.candidate_blocks(k))
            is_cand = torch.zeros_like(first, dtype=torch.bool)
            for i in range(cand.shape[0]):
                for h in range(cand.shape[1]):
                    for c in cand[i, h].tolist():
                        if c >= 0:
                            is_cand[int(indptr[i]) + c, h] = True
            first = first.masked_fill(~is_cand, -torch.inf)
        best = ops.topk_blocks(eng.geo.num_kv_heads, first, indptr, 2)
        lens = (indptr[1:] - indptr[:-1]).tolist()
        for i, n in enumerate(lens):
            for h in range(pred.shape[1]):
                got = {int(b) for b in pred[i, h] if b >= 0}
                assert len(got) == min(n, k), (layer, i, h)
                for b in best[i, h].tolist():
                    if 0 <= b < n - 1:
                        assert b + 1 in got, (layer, i, h, b, sorted(got))
                        seen["successors"] += 1
        seen["calls"] += 1
        return pred

    eng.top_k_blocks = checked
    ps = prompts(qwen3.config.vocab_size, [90, 70], seed=4)
    outs = llm.generate(ps, 12, ignore_eos=True)
    assert seen["calls"] > 20 and seen["successors"] > 20
    assert all(o.metrics.sparse_steps > 0 for o in outs)
    no_successors = KvConfig(**{**kv.__dict__, "successor_blocks": 0})
    plain = oasiskv.LLM(qwen3, kv=no_successors, backend="oasis", drafter="ngram")
    other = plain.generate(ps, 12, ignore_eos=True)
    assert any(
        a.metrics.lookahead_recall != b.metrics.lookahead_recall or a.tokens != b.tokens
        for a, b in zip(outs, other, strict=True)
    )


def test_successors_stop_at_each_rows_last_block():
    from oasiskv.engine import successors

    indptr = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    blocks = torch.tensor([[[0, 2]], [[-1, -1]], [[4, -1]]], dtype=torch.int32)
    assert successors(blocks, indptr).tolist() == [[[1, -1]], [[-1, -1]], [[-1, -1]]]
    blocks = torch.tensor([[[1, 1]], [[0, 0]], [[3, 0]]], dtype=torch.int32)
    assert successors(blocks, indptr).tolist() == [[[2, 2]], [[-1, -1]], [[4, 1]]]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"successor_blocks": -1}, "successor_blocks"),
        ({"successor_blocks": 4, "top_k_blocks": 4}, "successor_blocks"),
        ({"successor_blocks": 2, "sink_blocks": 1, "pin_blocks": 1, "top_k_blocks": 4}, "successor_blocks"),
        ({"successor_blocks": 1.5}, "successor_blocks"),
    ],
)
def test_bad_successor_blocks(kw, match):
    with pytest.raises(errors.ConfigError, match=match):
        KvConfig(**kw)


@pytest.mark.parametrize("cap", [None, 1])
def test_layer_blocks_bound_each_layers_working_set(qwen3, cap):
    """KvConfig(layer_blocks=...): layer l selects into its first layer_blocks[l] slots only; the
    slots past them stay unmapped in that layer (attention skips them); uncapped, the resident
    set of each head is exactly the layer's prediction, of at most its budget."""
    budgets = (2, 5, 3)
    kv = KvConfig(
        block_size=8, top_k_blocks=5, fetch_cap=cap, sparse_threshold=50, layer_blocks=budgets, recall_every=1
    )
    llm = oasiskv.LLM(qwen3, kv=kv, backend="oasis", drafter="ngram")
    eng = llm.engine
    orig = eng.decode_step
    seen = {"n": 0, "full": [0, 0, 0]}

    def checked_step(reqs):
        logits = orig(reqs)
        p = eng.pools
        for r in reqs:
            if not r.sparse:
                continue
            for layer, k in enumerate(budgets):
                assert eng._pred_of(layer).shape[-1] == k
                pred = eng._pred_of(layer)[r.slot]
                for h in range(qwen3.config.num_key_value_heads):
                    held = [int(p.page_map[layer, pg, h]) for pg in r.slot_pages]
                    assert all(b < 0 for b in held[k:]), (layer, h, held)
                    valid = {b for b in held[:k] if b >= 0}
                    assert len(valid) <= k
                    if cap is None:
                        assert valid == {int(b) for b in pred[h] if b >= 0}, (layer, h)
                    seen["full"][layer] += len(valid) == k
            seen["n"] += 1
        return logits

    eng.decode_step = checked_step
    ps = prompts(qwen3.config.vocab_size, [90, 70], seed=4)
    outs = llm.generate(ps, 12, ignore_eos=True)
    assert seen["n"] > 10 and all(seen["full"])
    # Every layer at the whole budget is the uniform engine; the smaller budgets change it.
    same = KvConfig(**{**kv.__dict__, "layer_blocks": (5, 5, 5)})
    uniform = KvConfig(**{**kv.__dict__, "layer_blocks": None})
    a = oasiskv.LLM(qwen3, kv=same, backend="oasis", drafter="ngram").generate(ps, 12, ignore_eos=True)
    b = oasiskv.LLM(qwen3, kv=uniform, backend="oasis", drafter="ngram").generate(ps, 12, ignore_eos=True)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens
        assert x.metrics.fetched_bytes_total == y.metrics.fetched_bytes_total
    assert any(
        x.metrics.fetched_bytes_total != y.metrics.fetched_bytes_total for x, y in zip(outs, b, strict=True)
    )


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"layer_blocks": [4, 4, 4]}, "tuple"),
        ({"layer_blocks": ()}, "tuple"),
        ({"layer_blocks": (4, 9, 4), "top_k_blocks": 8}, r"layer_blocks\[1\]=9 is above 8"),
        ({"layer_blocks": (4, 0, 4)}, r"layer_blocks\[1\]"),
        ({"layer_blocks": (4, 2, 4), "sink_blocks": 1, "pin_blocks": 1}, r"layer_blocks\[1\]"),
        ({"layer_blocks": (4, 2.0, 4)}, r"layer_blocks\[1\]"),
    ],
)
def test_bad_layer_blocks(kw, match):
    with pytest.raises(errors.ConfigError, match=match):
        KvConfig(**kw)


def test_layer_blocks_must_name_every_layer(qwen3):
    with pytest.raises(errors.ConfigError, match="has 2 budgets but the model has 3 layers"):
        oasiskv.LLM(qwen3, kv=KvConfig(top_k_blocks=8, layer_blocks=(4, 8)), backend="oasis")


@pytest.mark.parametrize(
    "extra", [{}, {"block_score": "codes", "score_candidates": 1.5, "sticky_candidates": True}]
)
def test_lookahead_min_confidence_selects_by_the_steps_own_query_when_unsure(qwen3, extra):
    """KvConfig(lookahead_min_confidence=P): drafts below P let row 0 (the step's own query)
    choose the next working set. Every draft unsure gives exactly the previous-query drafter's
    selections (tokens, traffic, recall), every draft sure exactly the lookahead's; and the
    drafter is asked for its probability."""
    base = dict(SMALL_KV, **extra)
    ps = prompts(qwen3.config.vocab_size, [150, 97], seed=11)

    def run(kv, drafter):
        return oasiskv.LLM(qwen3, kv=KvConfig(**base, **kv), backend="oasis", drafter=drafter).generate(
            ps, 10, ignore_eos=True
        )

    unsure = DrafterWithConfidence(0.3)
    got = run({"lookahead_min_confidence": 0.5}, unsure)
    assert unsure.track_confidence  # the engine asked for the probabilities
    own = run({}, PreviousQueryDrafter())
    look = run({}, NgramDrafter())
    sure = run({"lookahead_min_confidence": 0.25}, DrafterWithConfidence(0.3))
    for a, b, c, d in zip(got, own, sure, look, strict=True):
        assert a.metrics.sparse_steps > 0
        assert (a.tokens, a.metrics.fetched_bytes_total, a.metrics.lookahead_recall) == (
            b.tokens,
            b.metrics.fetched_bytes_total,
            b.metrics.lookahead_recall,
        )
        assert (c.tokens, c.metrics.fetched_bytes_total, c.metrics.lookahead_recall) == (
            d.tokens,
            d.metrics.fetched_bytes_total,
            d.metrics.lookahead_recall,
        )
    # The two selections differ here, so the equalities above say something.
    assert any(
        a.metrics.lookahead_recall != c.metrics.lookahead_recall for a, c in zip(got, sure, strict=True)
    )


@pytest.mark.parametrize(
    "kw, drafter, match",
    [
        ({"lookahead_min_confidence": 1.5}, "ngram", "probability in"),
        ({"lookahead_min_confidence": True}, "ngram", "probability in"),
        ({"lookahead_min_confidence": 0.5, "select_queries": "lookahead+current"}, "ngram", "select_queries"),
        ({"lookahead_min_confidence": 0.5}, "ngram", "eagle3"),
        ({"lookahead_min_confidence": 0.5}, "previous-query", "eagle3"),
    ],
)
def test_bad_lookahead_min_confidence(qwen3, kw, drafter, match):
    with pytest.raises(errors.ConfigError, match=match):
        oasiskv.LLM(qwen3, kv=KvConfig(sparse_threshold=40, **kw), backend="oasis", drafter=drafter)
