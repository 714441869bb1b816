"""The engine's block selection, end to end on small models: the current query beside the
lookahead, sink and pinned blocks, the two-stage codes score, sticky candidates, successor blocks,
per-layer budgets and the lookahead's confidence fallback; with their argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oasiskv
from oasiskv import KvConfig, errors, ops
from oasiskv.drafters import NgramDrafter, PreviousQueryDrafter
from support.engines import SMALL_KV, DrafterWithConfidence, repeated_prompts

# Private names read here: the engine's selection steps, each wrapped or read by the test that
# checks it: ``_select_and_fetch`` (its predictions and pins), ``_pins_of``, ``_pred_of``,
# ``_initial_selection`` (sticky candidates).
# No public hook exposes these per-layer steps.

torch.set_num_threads(2)


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
    llm.generate(repeated_prompts(qwen3.config.vocab_size, [90, 70], seed=4, period=37), 12, ignore_eos=True)
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

    kept_reference = False  # RecallRecorder: no actual_kept

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
    outs = llm.generate(
        repeated_prompts(qwen3.config.vocab_size, [90, 70], seed=4, period=37), 12, ignore_eos=True
    )
    assert check.calls > 20 and check.recalls > 20
    assert all(o.metrics.sparse_steps > 0 for o in outs)


def test_sink_blocks_zero_is_the_default_selection(qwen3):
    """sink_blocks=0 selects exactly as before (same tokens, traffic and recall), and sinks change
    the selection at a small budget (the sinks are not among the top blocks by score alone)."""
    ps = repeated_prompts(qwen3.config.vocab_size, [150, 97], seed=5, period=37)
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
        full = ops.score_blocks_codes(g, q, p.bounds8[layer], p.bound_scales[layer], p.codes[layer], *csr)
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
    outs = llm.generate(
        repeated_prompts(qwen3.config.vocab_size, [150, 97], seed=6, period=37), 10, ignore_eos=True
    )
    assert check.calls > 20 and check.staged > 20
    assert all(o.metrics.sparse_steps > 0 for o in outs)
    if succ:  # some successors of the codes score's best were not among the Quest bound's best
        assert check.outside > 0


@pytest.mark.parametrize("succ", [0, 1])
def test_two_stage_codes_score_with_every_block_a_candidate_is_the_codes_score(qwen3, succ):
    """When the candidates cover every block (m = 512 here), the two stages select exactly what the
    one-stage codes score does: same tokens, traffic and recall. And a budget that covers the
    context gives the dense tokens."""
    ps = repeated_prompts(qwen3.config.vocab_size, [150, 97], seed=7, period=37)
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
    ids = repeated_prompts(qwen3.config.vocab_size, [200], seed=8, period=37)
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
    ps = repeated_prompts(qwen3.config.vocab_size, [150, 97], seed=6, period=37)
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
    ps = repeated_prompts(qwen3.config.vocab_size, [90, 70], seed=4, period=37)
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
    ps = repeated_prompts(qwen3.config.vocab_size, [90, 70], seed=4, period=37)
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
    ps = repeated_prompts(qwen3.config.vocab_size, [90, 70], seed=4, period=37)
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
    ps = repeated_prompts(qwen3.config.vocab_size, [150, 97], seed=11, period=37)

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
