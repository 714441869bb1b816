"""Speculative decoding (``LLMEngine(speculative=True)``): the lookahead draft is verified in the
step that computes it and, when accepted, the request gains two tokens.

* Lossless: greedy tokens equal the non-speculative engine's, token for token, wherever attention
  is exact (the dense backend; the oasis backend with a working set that holds the context, so
  requests run sparse through the host pool, summaries, selection and gather). With a working set
  smaller than the context the two runs select different blocks (the lookahead queries differ),
  so only the invariants are checked there.
* The stored KV (pages, host pool, summaries) of a speculative run equals the non-speculative
  run's, so a rejected draft leaves nothing behind.
* Sampling: the distribution of the generated tokens matches the exact distribution of the model
  (a chi-square test against the enumerated joint distribution, fixed seed); the device rule
  (``verify_sampled_drafts``) on its own, over many uniforms; a seeded request's tokens do not
  depend on what runs beside it.
* Verification inside the step: greedy and sampled drafts are accepted by a per-row device flag
  and stored by the step itself into the tentative slot the plan reserved (no host sampling in a
  speculative decode step); the tables move on at ``commit_drafts`` (a rejected draft's slot goes
  back); greedy and sampling requests share a step. The same step function runs in the
  CUDA-graph path (``tests/engine/test_gpu_speculative.py``).
* Forced verdicts (measurement only, ``decode_step(verdicts=...)``): they override the argmax
  test both ways, and the metrics count the step's flag (``tests/engine/test_oracle_drafter.py`` runs
  ``OracleDrafter(force=True)`` end to end).
"""

from __future__ import annotations

import math

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, PrefillCache, SamplingParams, errors
from oasiskv.drafters import Eagle3Drafter, OracleDrafter
from oasiskv.engine import RowSampling
from oasiskv.models.eagle3 import Eagle3Head
from support.fakes import drain, pools_are_full, prompt, tiny
from support.sampling import (
    SMALL_VOCAB,
    ArgmaxDrafter,
    chi_square_p,
    exact_joint,
    peaked_model,
    probs_row,
    second_and_third_tokens,
)

# Private names read here: ``LLMEngine._by_id``/``_running`` (the live requests whose slots a draft
# holds), ``llm_engine._sample_rows`` (the host sampler, counted) and ``Engine._run_step`` (wrapped
# to see the step's sampling inputs): what these tests check; no public view.

torch.set_num_threads(2)

DENSE_KV = KvConfig(block_size=16, top_k_blocks=8)
# Sparse from 24 tokens on, but K x block_size = 512 holds every context here: exact attention.
SPARSE_EXACT_KV = KvConfig(block_size=8, top_k_blocks=64, sparse_threshold=24, fetch_cap=None)
# A working set smaller than the context: sparse attention is an approximation.
SPARSE_LOSSY_KV = KvConfig(block_size=16, top_k_blocks=4, fetch_cap=0.25, sparse_threshold=64)
EXACT = [("dense", DENSE_KV), ("oasis", SPARSE_EXACT_KV)]
PROMPT_LENS = (20, 70, 130, 45)
NEW = 30


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def reference(model):
    """Non-speculative greedy tokens of every prompt, per exact configuration (ngram drafter)."""
    return {backend: run(model, backend, kv, "ngram", False)[0] for backend, kv in EXACT}


def run(model, backend, kv, drafter, speculative, lens=PROMPT_LENS, new=NEW, **params):
    """Greedy tokens of every prompt (three seats for four requests: one waits), checking the
    runtime's invariants after every step; returns (tokens per prompt, engine)."""
    eng = LLMEngine(model, kv=kv, backend=backend, drafter=drafter, speculative=speculative, max_num_seqs=3)
    sp = SamplingParams(max_tokens=new, ignore_eos=True, **params)
    rids = [eng.add_request(prompt(n, i), sp) for i, n in enumerate(lens)]
    final = drain(eng)
    assert pools_are_full(eng)
    eng.metrics_of_run = [final[r].metrics for r in rids]
    return [final[r].token_ids for r in rids], eng


@pytest.fixture(scope="module")
def model8():
    return tiny(seed=2, layers=8)  # EAGLE-3 captures three distinct layers: (2, L // 2, L - 3)


def eagle3(model, seed: int = 5) -> Eagle3Drafter:
    head = Eagle3Head.random(model.config, draft_vocab_size=64, seed=seed).attach_target(model)
    return Eagle3Drafter(head, model)


@pytest.mark.parametrize("backend,kv", EXACT, ids=["dense", "oasis-sparse"])
def test_greedy_speculation_with_an_eagle3_head_is_lossless(model8, backend, kv):
    lens, new = (20, 45, 70), 16
    ref, _ = run(model8, backend, kv, eagle3(model8), False, lens=lens, new=new)
    toks, eng = run(model8, backend, kv, eagle3(model8), True, lens=lens, new=new)
    assert toks == ref
    assert eng.spec_stats["drafts"] > 0


@pytest.mark.parametrize("backend,kv", EXACT, ids=["dense", "oasis-sparse"])
@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_greedy_speculation_is_lossless(model, reference, backend, kv, drafter):
    ref = reference[backend]
    d = {"ngram": "ngram", "oracle": OracleDrafter(ref)}[drafter]
    toks, eng = run(model, backend, kv, d, True)
    assert toks == ref
    stats = eng.spec_stats
    assert stats["tokens"] == sum(NEW - 1 for _ in PROMPT_LENS)  # the first token is the prefill's
    assert stats["drafts"] > 0 and 0 <= stats["accepted"] <= stats["drafts"]
    if drafter == "oracle":
        assert stats["acceptance_rate"] == 1.0 and stats["tokens_per_step"] > 1.8
    if backend == "oasis":
        assert all(m.sparse_steps > 0 for m in eng.metrics_of_run)  # the requests ran sparse


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_greedy_speculation_with_per_layer_budgets_that_hold_everything_is_lossless(
    model, reference, drafter
):
    """KvConfig.layer_blocks smaller than top_k_blocks in one layer but still above every
    context's blocks: attention is exact, so speculation gives the non-speculative tokens."""
    ref = reference["oasis"]
    d = {"ngram": "ngram", "oracle": OracleDrafter(ref)}[drafter]
    kv = KvConfig(**{**SPARSE_EXACT_KV.__dict__, "layer_blocks": (64, 24)})  # contexts <= 20 blocks
    toks, eng = run(model, "oasis", kv, d, True)
    assert toks == ref
    assert all(m.sparse_steps > 0 for m in eng.metrics_of_run)


def test_oracle_drafter_metrics_on_the_dense_backend(model, reference):
    """Every draft accepted: every decode step makes two tokens (max_tokens = 1 + 2k)."""
    ref = reference["dense"]
    new = 21
    toks, eng = run(model, "dense", DENSE_KV, OracleDrafter(ref), True, new=new)
    assert toks == [t[:new] for t in ref]
    s = eng.spec_stats
    steps = len(PROMPT_LENS) * (new - 1) // 2
    assert s == {
        "steps": steps,
        "tokens": 2 * steps,
        "drafts": steps,
        "accepted": steps,
        "acceptance_rate": 1.0,
        "tokens_per_step": 2.0,
    }


def test_request_metrics(model, reference):
    ref = reference["dense"]
    eng = LLMEngine(model, kv=DENSE_KV, backend="dense", drafter=OracleDrafter(ref), speculative=True)
    rid = eng.add_request(prompt(PROMPT_LENS[0], 0), SamplingParams(max_tokens=10, ignore_eos=True))
    m = eng.run_to_completion([rid])[rid].metrics
    # 9 decode tokens: four steps of two, then one (no room for a second token).
    assert (m.steps, m.decode_tokens, m.draft_tokens, m.accepted_tokens) == (5, 9, 4, 4)
    assert m.acceptance_rate == 1.0 and m.tokens_per_step == pytest.approx(9 / 5)
    assert m.generated_tokens == 10
    # Off: the fields stay unset.
    off = LLMEngine(model, kv=DENSE_KV, backend="dense", drafter="ngram")
    rid = off.add_request(prompt(20, 0), SamplingParams(max_tokens=5, ignore_eos=True))
    m = off.run_to_completion([rid])[rid].metrics
    assert (m.draft_tokens, m.acceptance_rate, m.tokens_per_step) == (0, None, None)
    assert off.spec_stats["steps"] == 0


def test_stored_kv_equals_the_non_speculative_runs(model, reference):
    """Pages, host blocks and summaries hold exactly the non-speculative run's K/V: an accepted
    draft stores row 1's K/V (the same values the next step would compute), a rejected one
    nothing (a summary that had seen its key would differ)."""
    backend, kv = "oasis", SPARSE_EXACT_KV
    lens, stop_at = (70, 45), 25

    def stored(speculative):
        eng = LLMEngine(model, kv=kv, backend=backend, drafter="ngram", speculative=speculative)
        rids = [
            eng.add_request(prompt(n, i), SamplingParams(max_tokens=40, ignore_eos=True))
            for i, n in enumerate(lens)
        ]
        seqs = [eng._by_id[r] for r in rids]
        while min(len(s.req.tokens) - len(s.req.prompt) for s in seqs) < stop_at:
            eng.step()
        e, p, b = eng.engine, eng.engine.pools, kv.block_size
        out = []
        for s in seqs:
            r = s.req
            assert r.sparse
            n_complete = (len(r.prompt) + stop_at - 1) // b  # stored by both runs by now
            hb = torch.tensor(r.host_blocks[:n_complete])  # summaries by block id
            hr = torch.tensor(r.host_rows[:n_complete])  # K/V by host row
            out.append(
                [torch.stack([p.host_k[l][hr], p.host_v[l][hr]]) for l in range(e.cfg.num_hidden_layers)]
                + [p.summaries[l][hb] for l in range(e.cfg.num_hidden_layers)]
            )
        if speculative:
            assert eng.spec_stats["accepted"] > 0 and eng.spec_stats["accepted"] < eng.spec_stats["drafts"]
        for s in seqs:
            eng.abort_request(s.request_id)
        eng.step()
        assert pools_are_full(eng)
        return out

    for a, b in zip(stored(False), stored(True), strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
@pytest.mark.parametrize("layer_blocks", [None, (2, 4)], ids=["uniform", "per-layer"])
def test_lossy_working_set_keeps_the_tables_consistent(model, reference, drafter, layer_blocks):
    """With K x block_size below the context the selection trajectories differ (the lookahead
    queries do), so the tokens may too; the runtime's invariants hold every step and every block
    comes back (also with per-layer budgets, KvConfig.layer_blocks)."""
    d = OracleDrafter(reference["dense"]) if drafter == "oracle" else drafter
    kv = KvConfig(**{**SPARSE_LOSSY_KV.__dict__, "layer_blocks": layer_blocks})
    toks, eng = run(model, "oasis", kv, d, True)
    assert [len(t) for t in toks] == [NEW] * len(PROMPT_LENS)
    assert eng.spec_stats["accepted"] > 0


def test_a_request_that_stops_on_the_first_token_takes_no_second(model, reference):
    """A stop token (and max_tokens) ends the request at the first of the two tokens."""
    ref = reference["dense"][1]
    stop = ref[9]
    want = ref[: ref.index(stop) + 1]
    eng = LLMEngine(model, kv=DENSE_KV, backend="dense", drafter=OracleDrafter([[], ref]), speculative=True)
    eng.add_request(prompt(5, 99), SamplingParams(max_tokens=2, ignore_eos=True))  # id 0: unused continuation
    rid = eng.add_request(prompt(PROMPT_LENS[1], 1), SamplingParams(max_tokens=NEW, stop_token_ids=(stop,)))
    out = eng.run_to_completion([rid])[rid]
    assert out.token_ids == want and out.finish_reason == "stop"
    for new in (2, 3, 4):  # max_tokens: never one token too many
        toks, _ = run(model, "dense", DENSE_KV, OracleDrafter(reference["dense"]), True, new=new)
        assert toks == [t[:new] for t in reference["dense"]]


def test_speculative_needs_a_lookahead_row(model):
    with pytest.raises(errors.ConfigError, match="lookahead row"):
        LLMEngine(model, kv=DENSE_KV, backend="dense", drafter="previous-query", speculative=True)
    with pytest.raises(errors.ConfigError, match="bool"):
        LLMEngine(model, kv=DENSE_KV, backend="dense", drafter="ngram", speculative=1)


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_keeps_the_distribution(temperature, top_p):
    """2000 requests of 3 tokens each, with and without speculation: the joint distribution of
    the 2nd and 3rd tokens (the first is the prefill's; the decode step that makes the 2nd
    verifies a draft and, when accepted, makes the 3rd too) against the exact one, enumerated
    with the model's dense forward."""
    m = peaked_model()
    ids = [1, 5, 2, 7]
    exact: dict = {}
    for seq, pr in exact_joint(m, ids, temperature, top_p, 3).items():
        exact[seq[1:]] = exact.get(seq[1:], 0.0) + pr
    n = 2000
    for speculative in (False, True):
        eng = LLMEngine(
            m,
            kv=DENSE_KV,
            backend="dense",
            drafter=ArgmaxDrafter(m),
            speculative=speculative,
            max_num_seqs=256,
            seed=11,
            prefill_cache=PrefillCache(),
        )
        counts = second_and_third_tokens(eng, ids, n, temperature, top_p)
        assert chi_square_p(counts, exact, n) > 1e-3, (speculative, eng.spec_stats)
        if speculative:
            s = eng.spec_stats
            assert s["drafts"] == n and 0.1 < s["acceptance_rate"] < 0.95, s


@pytest.mark.parametrize("drafter", ["ngram", "eagle3"])  # about 7 s each on 2 cores
def test_smollm2_greedy_speculation_is_lossless(drafter):
    texts = [
        "Paged attention stores the KV cache in fixed-size blocks. " * 4 + "Why?",
        "Count from one to twenty: one, two, three,",
    ]
    kv = KvConfig(block_size=16, top_k_blocks=64, sparse_threshold=48, fetch_cap=None)
    outs = {}
    for speculative in (False, True):
        eng = LLMEngine("smollm2", kv=kv, drafter=drafter, speculative=speculative, max_num_seqs=2)
        rids = [eng.add_request(t, SamplingParams(max_tokens=24, ignore_eos=True)) for t in texts]
        res = eng.run_to_completion(rids)
        outs[speculative] = [res[r].token_ids for r in rids]
        assert pools_are_full(eng)
        if speculative:
            assert eng.spec_stats["accepted"] > 0
    assert outs[True] == outs[False]


# ---------------------------------------------------------------- verification inside the step


def _running_oracle_engine(model, ref, n: int) -> LLMEngine:
    """A dense speculative engine with the oracle drafter over ``ref``, stepped until its first
    ``n`` prompts are all running (decoded by hand from there)."""
    llm = LLMEngine(model, kv=DENSE_KV, backend="dense", drafter=OracleDrafter(ref), speculative=True)
    for i in range(n):
        llm.add_request(prompt(PROMPT_LENS[i], i), SamplingParams(max_tokens=NEW, ignore_eos=True))
    while len(llm._running) < n:
        llm.step()
    return llm


def test_the_step_verifies_greedy_drafts_and_holds_their_slots_until_commit(model, reference):
    """``Engine.decode_step(speculate=...)``: each trying request's draft gets a tentative slot at
    plan time; the step accepts a draft equal to row 0's argmax (a device flag) and stores it;
    the tables advance only at ``commit_drafts``: by two tokens where accepted, one elsewhere."""
    ref = reference["dense"]
    llm = _running_oracle_engine(model, ref, 3)
    eng, rt = llm.engine, llm.engine.runtime
    reqs = [s.req for s in llm._running]
    reqs[1].draft = (reqs[1].draft + 1) % model.config.vocab_size  # a wrong draft: rejected
    before = [rt.kv_len(r.id) for r in reqs]
    free = rt.num_free
    res = eng.decode_step(reqs, speculate=[True, True, False])
    assert res.tried == [True, True, False]
    assert res.accepted == [True, False, False]
    assert res.token[0] == reqs[0].draft and res.token[1] != reqs[1].draft
    assert res.token == res.logits.argmax(dim=-1).tolist()
    assert res.token2 == res.draft_logits.argmax(dim=-1).tolist()
    assert all(res.finite) and all(res.finite2)
    assert rt.pending_drafts() == [reqs[0].id, reqs[1].id]
    assert [rt.kv_len(r.id) for r in reqs] == [n + 1 for n in before]  # slots held back
    with pytest.raises(errors.ConfigError, match="commit_drafts"):
        eng.decode_step(reqs, speculate=[True] * 3)
    eng.commit_drafts()
    assert rt.pending_drafts() == []
    assert [rt.kv_len(r.id) for r in reqs] == [before[0] + 2, before[1] + 1, before[2] + 1]
    rt.check_invariants()
    assert rt.num_free[0] <= free[0]
    with pytest.raises(errors.ConfigError, match="decode_step"):
        eng.commit_drafts()
    for s in list(llm._running):
        llm.abort_request(s.request_id)
    llm.step()
    assert pools_are_full(llm)


def test_forced_verdicts_override_the_argmax_test(model, reference):
    """``Engine.decode_step(verdicts=...)`` (measurement only): True accepts a draft that is not
    row 0's argmax (the draft is the first token, row 1's argmax the second, its slot kept),
    False rejects one that is (the argmax is the token, the slot goes back), None verifies as
    usual; rows that do not try are untouched. Bad verdicts are a ConfigError."""
    ref = reference["dense"]
    llm = _running_oracle_engine(model, ref, 4)
    eng, rt = llm.engine, llm.engine.runtime
    reqs = [s.req for s in llm._running]
    reqs[1].draft = (reqs[1].draft + 1) % model.config.vocab_size  # wrong: forced in below
    drafts = [r.draft for r in reqs]
    before = [rt.kv_len(r.id) for r in reqs]
    greedy = [None] * 4
    for bad, says in (
        ([True], "one entry per request"),
        ([1, None, None, None], "must be True, False or None"),
    ):
        with pytest.raises(errors.ConfigError, match=says):
            eng.decode_step(reqs, speculate=[True] * 4, sampling=greedy, verdicts=bad)
    sampled = [RowSampling(1.0, 1.0, 0.5, 0.5, 0.5), None, None, None]
    with pytest.raises(errors.ConfigError, match="sampling row"):
        eng.decode_step(reqs, speculate=[True] * 4, sampling=sampled, verdicts=[True, None, None, None])
    with pytest.raises(errors.ConfigError, match="speculative steps"):
        eng.decode_step(reqs, verdicts=[None] * 4)
    assert rt.pending_drafts() == []  # the refused calls reserved nothing
    res = eng.decode_step(reqs, speculate=[True, True, True, False], verdicts=[False, True, None, True])
    assert res.tried == [True, True, True, False]
    argmax = res.logits.argmax(dim=-1).tolist()
    assert argmax[0] == drafts[0] and argmax[1] != drafts[1] and argmax[2] == drafts[2]
    assert res.accepted == [False, True, True, False]
    assert res.token == [argmax[0], drafts[1], argmax[2], argmax[3]]
    assert res.token2[1] == int(res.draft_logits[1].argmax())
    eng.commit_drafts()
    assert [rt.kv_len(r.id) for r in reqs] == [before[0] + 1, before[1] + 2, before[2] + 2, before[3] + 1]
    rt.check_invariants()
    for s in list(llm._running):
        llm.abort_request(s.request_id)
    llm.step()
    assert pools_are_full(llm)


def test_forced_rejections_of_right_drafts_count_nothing(model, reference):
    """A drafter that drafts the model's own next token (the reference) but forces every verdict
    to False: no draft is accepted (the metrics count the step's flag, not ``token == draft``),
    every step makes one token, and the tokens are the model's."""

    class RejectAll(OracleDrafter):
        def forced_verdicts(self, req_ids, tokens_list):
            return [False] * len(req_ids)

    ref = reference["dense"]
    toks, eng = run(model, "dense", DENSE_KV, RejectAll(ref), True)
    assert toks == ref
    s = eng.spec_stats
    assert s["drafts"] > 0 and s["accepted"] == 0 and s["tokens_per_step"] == 1.0, s
    assert all(m.accepted_tokens == 0 and m.acceptance_rate == 0.0 for m in eng.metrics_of_run)


def test_a_rejected_draft_entering_a_new_block_gives_it_back(model):
    """A draft at the first position of a new block enters it (a new page) at plan time; rejected,
    the page goes back and the next token takes the position (and a page) as without speculation."""
    llm = LLMEngine(model, kv=DENSE_KV, backend="dense", drafter="ngram", speculative=True)
    b = DENSE_KV.block_size
    llm.add_request(prompt(b + 5, 0), SamplingParams(max_tokens=3 * b, ignore_eos=True))
    eng, rt = llm.engine, llm.engine.runtime
    # Until x_t lands at the last position of a block: the draft would take the next block's first.
    while not llm._running or rt.kv_len(llm._running[0].req.id) % b != b - 1:
        llm.step()
    r = llm._running[0].req
    pages = list(r.pages)
    r.draft = -1 % model.config.vocab_size
    res = eng.decode_step([r], speculate=[True])
    if res.accepted[0]:  # pragma: no cover - the model's argmax happens to be the last token
        pytest.skip("the forced-wrong draft is the argmax")
    assert len(r.pages) == len(pages) + 1, "the slot entered block 2"
    free = rt.num_free
    eng.commit_drafts()
    assert r.pages == pages and rt.num_free[0] == free[0] + 1
    assert rt.take_map_updates() == ([], [])  # the new page's mapping was never queued
    rt.check_invariants()


@pytest.mark.parametrize("backend,kv", EXACT, ids=["dense", "oasis-sparse"])
def test_greedy_and_sampling_requests_in_one_batch(model, reference, backend, kv):
    """Greedy and sampling requests verified in the same step: the greedy tokens are the
    non-speculative engine's, the sampling requests run to their length, and every block comes
    back."""
    ref = reference[backend]
    eng = LLMEngine(model, kv=kv, backend=backend, drafter="ngram", speculative=True, max_num_seqs=4, seed=5)
    temps = [0.0, 0.9, 0.0, 0.7]
    rids = [
        eng.add_request(prompt(n, i), SamplingParams(max_tokens=NEW, temperature=t, ignore_eos=True))
        for i, (n, t) in enumerate(zip(PROMPT_LENS, temps, strict=True))
    ]
    final = drain(eng)
    assert pools_are_full(eng)
    for i, (rid, t) in enumerate(zip(rids, temps, strict=True)):
        if t == 0.0:
            assert final[rid].token_ids == ref[i], i
        else:
            assert len(final[rid].token_ids) == NEW and final[rid].metrics.draft_tokens > 0
    s = eng.spec_stats
    assert s["accepted"] > 0 and s["tokens"] == len(PROMPT_LENS) * (NEW - 1)
    assert eng.engine.spec_eager_steps == 0  # no graphs on the CPU


# ---------------------------------------------------------------- sampling inside the step


def _rule_inputs(n, temperature, top_p, seed):
    """The sampling inputs of ``n`` rows with one temperature and top_p and fresh uniforms
    (``[SAMPLING_FIELDS, n]``), and the uniforms."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(3, n, generator=g, dtype=torch.float64)
    samp = torch.cat(
        [
            torch.full((1, n), temperature, dtype=torch.float64),
            torch.full((1, n), top_p, dtype=torch.float64),
            u,
        ]
    )
    return samp, u


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.7)])
def test_the_device_rule_keeps_the_distribution(temperature, top_p):
    """``verify_sampled_drafts`` over 40000 uniforms of one row: the first token has distribution
    ``p`` (chi-square), the draft is taken with probability ``p(d)`` and, when taken, the second
    token has row 1's distribution; a token cut by top-p is never drawn, and a rejection never
    draws the draft. Rows that do not try sample ``p`` itself."""
    from oasiskv.engine import sampling_probs, verify_sampled_drafts

    g = torch.Generator().manual_seed(4)
    logits0, logits1 = torch.randn(2, SMALL_VOCAB, generator=g) * 2.0
    p = probs_row(logits0, temperature, top_p).double()
    p1 = probs_row(logits1, temperature, top_p).double()
    p, p1 = p / p.sum(), p1 / p1.sum()
    d = int(torch.argsort(p, descending=True)[1])  # the second most likely: p(d) well inside (0, 1)
    n = 40000
    samp, u = _rule_inputs(n, temperature, top_p, seed=9)
    t = torch.full((n,), temperature, dtype=torch.float64)
    torch.testing.assert_close(
        sampling_probs(logits0.expand(n, -1), t, samp[1]).double()[0], p, atol=1e-6, rtol=1e-5
    )
    for tried in (True, False):
        first, taken, second = verify_sampled_drafts(
            logits0.expand(n, -1), logits1.expand(n, -1), torch.full((n,), d), torch.full((n,), tried), samp
        )
        assert torch.equal(taken, tried & (u[0] < p[d]))
        assert torch.equal(first[taken], torch.full_like(first[taken], d))
        if tried:
            assert not (first[~taken] == d).any(), "the residual drew the draft"
        assert (p[first] > 0).all() and (p1[second] > 0).all(), "a token outside top-p"
        counts = torch.bincount(first, minlength=SMALL_VOCAB).tolist()
        assert chi_square_p(dict(enumerate(counts)), dict(enumerate(p.tolist())), n) > 1e-3, tried
        if tried:
            assert abs(taken.double().mean() - p[d]) < 4 * math.sqrt(p[d] * (1 - p[d]) / n)
            k = int(taken.sum())
            counts2 = torch.bincount(second[taken], minlength=SMALL_VOCAB).tolist()
            assert chi_square_p(dict(enumerate(counts2)), dict(enumerate(p1.tolist())), k) > 1e-3


def test_the_device_rule_at_its_edges():
    """``u_accept`` just under ``p(d)`` takes the draft, at it not; a draft holding all the mass
    (top-p keeps only it) is always taken; the inverse CDF never lands on a token without mass,
    even at ``u`` next to 1."""
    from oasiskv.engine import sample_inverse_cdf, sampling_probs, verify_sampled_drafts

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    one = torch.ones(1, dtype=torch.float64)
    p = sampling_probs(logits, one, one)[0].double()
    for u, want in ((p[1] - 1e-9, True), (p[1], False)):
        samp = torch.tensor([[1.0], [1.0], [float(u)], [0.5], [0.5]], dtype=torch.float64)
        _, taken, _ = verify_sampled_drafts(logits, logits, torch.tensor([1]), torch.tensor([True]), samp)
        assert bool(taken[0]) == want, u
    # top_p = 0.1 keeps the most likely token alone: a draft of it is always taken.
    samp = torch.tensor([[1.0], [0.1], [0.999999], [0.999999], [0.5]], dtype=torch.float64)
    first, taken, _ = verify_sampled_drafts(logits, logits, torch.tensor([0]), torch.tensor([True]), samp)
    assert bool(taken[0]) and int(first[0]) == 0
    q = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]])
    for u in (0.0, 0.3, 0.5, 1.0 - 2**-52):
        assert int(sample_inverse_cdf(q, torch.tensor([u], dtype=torch.float64))[0]) in (1, 3), u
    assert int(sample_inverse_cdf(q, torch.tensor([0.29], dtype=torch.float64))[0]) == 1
    assert int(sample_inverse_cdf(q, torch.tensor([0.31], dtype=torch.float64))[0]) == 3


def test_sampling_rows_are_verified_in_the_step(monkeypatch):
    """A speculative decode step samples nothing on the host: every step hands the sampling rows'
    temperature, top_p and uniforms to the step function (the inputs a CUDA graph reads), the
    step accepts sampled drafts itself (its flags, ``SpecStep.accepted``) and the host sampler
    only draws the prefills' first tokens. So a sampling step is the same step a graph captures
    (``spec_eager_steps`` stays 0; ``tests/engine/test_gpu_speculative.py`` replays it)."""
    import oasiskv.llm_engine as llm_mod

    host_samples = [0]
    real_sample_rows = llm_mod._sample_rows

    def count(logits, rows, *args):
        host_samples[0] += len(rows)
        return real_sample_rows(logits, rows, *args)

    monkeypatch.setattr(llm_mod, "_sample_rows", count)
    m = peaked_model()
    llm = LLMEngine(
        m, kv=DENSE_KV, backend="dense", drafter=ArgmaxDrafter(m), speculative=True, max_num_seqs=4, seed=5
    )
    eng = llm.engine
    seen = []
    real_step, real_run = eng.decode_step, eng._run_step

    def decode_step(reqs, **kw):
        res = real_step(reqs, **kw)
        seen.append((kw["sampling"], res))
        return res

    samp_inputs = []

    def run_step(*args, **kw):
        samp_inputs.append(kw.get("samp"))
        return real_run(*args, **kw)

    eng.decode_step, eng._run_step = decode_step, run_step
    temps = [0.0, 0.9, 0.0, 0.7]
    for i, t in enumerate(temps):
        llm.add_request(
            [1, 5, 2, 7, i], SamplingParams(max_tokens=16, temperature=t, top_p=0.95, ignore_eos=True)
        )
    while llm.has_unfinished_requests():
        llm.step()
    assert host_samples[0] == 2, "only the prefills of the two sampling requests sample outside the step"
    assert seen and len(samp_inputs) == len(seen)
    accepted_sampled = 0
    for (sampling, res), samp in zip(seen, samp_inputs, strict=True):
        rows = [i for i, s in enumerate(sampling) if s is not None]
        assert isinstance(samp, torch.Tensor) == bool(rows)
        for i in rows:
            assert sampling[i].temperature in (0.9, 0.7) and sampling[i].top_p == 0.95
            assert samp[:, i].tolist() == list(sampling[i])
            accepted_sampled += res.accepted[i]
    assert accepted_sampled > 0
    assert eng.spec_eager_steps == 0
    assert pools_are_full(llm)


def test_a_seeded_sampling_request_does_not_depend_on_its_neighbours(model):
    """A seeded request draws its uniforms from its own generator: its tokens are the same alone
    and beside other (seeded and unseeded) requests, and differ with another seed."""

    def tokens(seed, others):
        llm = LLMEngine(model, kv=DENSE_KV, backend="dense", drafter="ngram", speculative=True, seed=3)
        sp = SamplingParams(max_tokens=20, temperature=0.8, seed=seed, ignore_eos=True)
        for j in range(others):
            llm.add_request(
                prompt(30 + j, 10 + j), SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
            )
        rid = llm.add_request([7, 8, 9] * 8, sp)
        out = llm.run_to_completion([rid])[rid]
        while llm.has_unfinished_requests():
            llm.step()
        assert out.metrics.draft_tokens > 0
        return out.token_ids

    alone = tokens(1234, 0)
    assert tokens(1234, 2) == alone
    assert tokens(99, 0) != alone


def test_top_p_one_keeps_the_tail_of_a_large_vocabulary():
    """``sampling_probs`` at top_p = 1 keeps every token, as the host sampler does: where the
    float32 running sum reaches 1 before the tail, a bare ``< top_p`` cut dropped the tail."""
    from oasiskv.engine import sampling_probs

    logits = torch.full((1, 200_000), -30.0)
    logits[0, 0] = 0.0  # the head's probability rounds to 1.0 in float32; the tail's are ~1e-13
    assert float(torch.softmax(logits, dim=-1)[0, 0]) == 1.0
    got = sampling_probs(logits, torch.tensor([1.0]), torch.tensor([1.0]))
    assert (got > 0).all()
    want = torch.softmax(logits.double(), dim=-1).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # below 1 the cut still applies
    cut = sampling_probs(logits, torch.tensor([1.0]), torch.tensor([0.9]))
    assert int((cut > 0).sum()) == 1 and float(cut[0, 0]) == 1.0
